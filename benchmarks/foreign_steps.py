"""Training steps the planner was not developed on, for the oracle benchmark (``benchmarks.optimality``).

Each is a plain-JAX loss written the way a user outside the project writes one: a dict of
parameters, one :func:`remat.checkpoint` around each block, no :mod:`remat.models`. Their
blocks differ in kind and in size, where the project's own models repeat one block:

* ``mixed``: attention, a GELU MLP four times wide, a tanh dense layer and a
  LayerNorm + ReLU MLP twice wide, in that order, at one width;
* ``unequal``: four blocks of two tanh layers each, whose hidden widths are 1, 4, 2 and 3
  times the model's width, so the regions' activations and recompute times differ.

Example:
  >>> loss, args = STEPS["mixed"](seed=0)  # doctest: +SKIP
  >>> remat.plan(loss, *args, memory_budget=0.5)  # doctest: +SKIP
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

WIDTH = 128  # the residual stream's width: large enough that the blocks' matmuls dominate the step
BATCH, SEQ = 8, 64  # tokens per step; the attention block's scores are [BATCH, SEQ, SEQ]


def _dense(key: Any, n_in: int, n_out: int) -> dict:
    import jax
    import jax.numpy as jnp

    return {"w": jax.random.normal(key, (n_in, n_out), jnp.float32) / n_in**0.5, "b": jnp.zeros((n_out,), jnp.float32)}


def _apply_dense(p: dict, x: Any) -> Any:
    return x @ p["w"] + p["b"]


def _layer_norm(x: Any) -> Any:
    import jax.numpy as jnp

    mean = x.mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)


def _attention(p: dict, x: Any) -> Any:
    import jax
    import jax.numpy as jnp

    q, k, v = (_apply_dense(p[n], x) for n in ("q", "k", "v"))
    scores = jnp.einsum("bqd,bkd->bqk", q, k) / q.shape[-1] ** 0.5
    mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    weights = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
    return x + _apply_dense(p["o"], jnp.einsum("bqk,bkd->bqd", weights, v))


def _mlp(activation: Callable[[Any], Any], norm: bool) -> Callable[[dict, Any], Any]:
    def block(p: dict, x: Any) -> Any:
        h = _layer_norm(x) if norm else x
        return x + _apply_dense(p["down"], activation(_apply_dense(p["up"], h)))

    return block


def _tanh_chain(p: dict, x: Any) -> Any:
    import jax.numpy as jnp

    h = jnp.tanh(_apply_dense(p["up"], x))
    h = jnp.tanh(_apply_dense(p["mid"], h))
    return x + _apply_dense(p["down"], h)


def _tanh_dense(p: dict, x: Any) -> Any:
    import jax.numpy as jnp

    return x + jnp.tanh(_apply_dense(p["w"], x))


def _block_params(key: Any, kind: str, hidden: int) -> dict:
    import jax

    keys = jax.random.split(key, 4)
    if kind == "attention":
        return {n: _dense(k, WIDTH, WIDTH) for n, k in zip(("q", "k", "v", "o"), keys)}
    if kind == "tanh":
        return {"w": _dense(keys[0], WIDTH, WIDTH)}
    if kind == "tanh_chain":
        return {"up": _dense(keys[0], WIDTH, hidden), "mid": _dense(keys[1], hidden, hidden),
                "down": _dense(keys[2], hidden, WIDTH)}
    return {"up": _dense(keys[0], WIDTH, hidden), "down": _dense(keys[1], hidden, WIDTH)}


def _step(blocks: list[tuple[str, int]], seed: int) -> tuple[Callable[..., Any], tuple]:
    """The loss over ``blocks`` (kind, hidden width), each a checkpointed region, and its arguments."""
    import jax
    import jax.numpy as jnp

    import remat

    appliers = {"attention": _attention, "gelu": _mlp(jax.nn.gelu, norm=False),
                "relu_norm": _mlp(jax.nn.relu, norm=True), "tanh": _tanh_dense, "tanh_chain": _tanh_chain}
    keys = jax.random.split(jax.random.key(seed), len(blocks) + 2)
    params = [_block_params(k, kind, hidden) for k, (kind, hidden) in zip(keys, blocks)]
    x = jax.random.normal(keys[-2], (BATCH, SEQ, WIDTH), jnp.float32)
    y = jax.random.normal(keys[-1], (BATCH, SEQ, WIDTH), jnp.float32)

    def loss(params: list, x: Any, y: Any) -> Any:
        h = x
        for (kind, _), p in zip(blocks, params):
            h = remat.checkpoint(appliers[kind], p, h)
        return jnp.mean((h - y) ** 2)

    return loss, (params, x, y)


def mixed(seed: int = 0) -> tuple[Callable[..., Any], tuple]:
    """Four blocks of four kinds: attention, GELU MLP (4x), tanh dense, LayerNorm + ReLU MLP (2x)."""
    return _step([("attention", 0), ("gelu", 4 * WIDTH), ("tanh", 0), ("relu_norm", 2 * WIDTH)], seed)


def unequal(seed: int = 0) -> tuple[Callable[..., Any], tuple]:
    """Four blocks of two tanh layers, of hidden widths 1, 4, 2 and 3 times the width."""
    return _step([("tanh_chain", m * WIDTH) for m in (1, 4, 2, 3)], seed)


#: The memory budgets the oracle benchmark plans these steps at. With four blocks, the backward
#: pass of the largest block holds a large share of the step's memory, so even the leanest
#: assignment needs most of the un-checkpointed temp bytes: budgets must lie above it to be met.
BUDGETS = (0.0, 0.7, 0.8, 0.9)

#: The steps by name, as ``benchmarks.optimality --models`` spells them.
STEPS: dict[str, Callable[..., tuple[Callable[..., Any], tuple]]] = {"mixed": mixed, "unequal": unequal}

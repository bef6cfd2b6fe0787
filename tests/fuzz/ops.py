"""The operations a drawn program is made of: each maps ``h`` of shape ``(n, N)`` to the same shape."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

N = 4  # the feature width; the row count n varies between calls of one case


def _scan(h: Any, env: dict) -> Any:
    def step(c, row):
        c = jnp.tanh(c * 0.9 + row @ env["w"])
        return c, c * row

    _, ys = lax.scan(step, jnp.zeros(N, h.dtype), h)
    return ys


def _rng(h: Any, env: dict) -> Any:
    # dropout-like use of a key that is a region input: the recomputation must see the same bits
    k1, k2 = jax.random.split(jax.random.fold_in(env["key"], env["step"]))
    keep = jax.random.bernoulli(k1, 0.7, h.shape)
    return jnp.where(keep, h / 0.7, 0.0) + 0.1 * jax.random.normal(k2, h.shape, h.dtype)


def _while(h: Any, env: dict) -> Any:  # forward-mode only: reverse mode rejects while_loop
    def body(c):
        i, t = c
        return i + 1, jnp.tanh(t @ env["w"]) + 0.5 * t
    return lax.while_loop(lambda c: c[0] < 2, body, (0, h))[1]


# name -> fn(h, env); env holds w (N, N), b (N,), idx (n, N) int, key, scale (a Python
# number), cfg (a mutable dict read at trace time), mode (a static string), step (op index)
OPS: dict[str, Callable[[Any, dict], Any]] = {
    "sin": lambda h, e: jnp.sin(h),
    "tanh": lambda h, e: jnp.tanh(h),
    "exp": lambda h, e: jnp.exp(0.1 * h),
    "square": lambda h, e: 0.5 * h * h,
    "mul_b": lambda h, e: h * e["b"],
    "add_b": lambda h, e: h + e["b"],
    "matmul": lambda h, e: h @ e["w"],
    "matmul_t": lambda h, e: jnp.dot(h, e["w"].T),
    "batched_dot": lambda h, e: jnp.einsum("bij,bjk->bik", h[:, None, :],
                                           jnp.broadcast_to(e["w"], (h.shape[0], N, N)))[:, 0, :],
    "sum_bcast": lambda h, e: h + 0.1 * jnp.sum(h, axis=0, keepdims=True),
    # the max's own gradient divides by how many elements equal it, which XLA may count as 0
    # when it fuses the two uses of h differently (NaN without any checkpoint): stop it, as
    # softmax stabilization does
    "max_sub": lambda h, e: h - jax.lax.stop_gradient(jnp.max(h, axis=1, keepdims=True)),
    "mean_all": lambda h, e: h * jnp.mean(h),
    "softmax": lambda h, e: jax.nn.softmax(h, axis=-1),
    "reshape": lambda h, e: h.reshape(N, h.shape[0]).T,
    "gather": lambda h, e: jnp.take_along_axis(h, e["idx"], axis=1) + 0.5 * h,
    "sort_gather": lambda h, e: jnp.take_along_axis(h, jnp.argsort(h, axis=1), axis=1) * 0.5 + h,
    "where": lambda h, e: jnp.where(h > 0, h, 0.1 * h),
    "bool_mask": lambda h, e: h + 0.1 * (h > 0).astype(h.dtype),
    "concat": lambda h, e: jnp.concatenate([2.0 * h[:, : N // 2], jnp.sin(h[:, N // 2:])], axis=1),
    "cond": lambda h, e: lax.cond(jnp.sum(h) > 0, jnp.sin, lambda t: jnp.cos(t) * e["b"], h),
    "scan": _scan,
    "fori": lambda h, e: lax.fori_loop(0, 2, lambda i, t: jnp.tanh(t @ e["w"]) + t, h),
    "while": _while,
    "rng": _rng,
    "scale": lambda h, e: h * e["scale"],
    "cfg": lambda h, e: h + e["cfg"]["shift"],
    "mode": lambda h, e: jnp.sin(h) if e["mode"] == "sin" else jnp.cos(h) * 0.5,
}

#: the operations whose reverse mode JAX rejects (only forward transforms may draw them)
FORWARD_ONLY = frozenset({"while"})

#: checkpoint_name tags the programs use
TAGS = ("a", "b")


def run_ops(steps: list, h: Any, env: dict, offset: int = 0) -> Any:
    """Applies ``steps`` (``[op, tag or None]`` pairs) to ``h``, tagging with ``checkpoint_name``."""
    import remat

    for i, (op, tag) in enumerate(steps):
        h = OPS[op](h, {**env, "step": offset + i})
        if tag is not None:
            h = remat.checkpoint_name(h, tag)
    return h

"""NNX cases: a stack of Linear, LayerNorm, Dropout and BatchNorm blocks, trained a few steps
under ``nnx.grad``/``nnx.jit`` or plain ``jax`` transforms of the split state."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .checkpointer import Remat, options
from .ops import N

LAYERS = ("linear", "layernorm", "dropout", "batchnorm")
NNX_FORMS = ("call", "method", "decorator", "apply", "sequential")
# nnx.value_and_grad, with and without nnx.jit; jax.jit(jax.value_and_grad) of the split state
NNX_MODES = ("nnx_grad", "nnx_jit", "jax_jit")


def _layer(name: str, dtype: Any, rngs: nnx.Rngs) -> nnx.Module:
    if name == "linear":
        return nnx.Linear(N, N, dtype=dtype, param_dtype=dtype, rngs=rngs)
    if name == "layernorm":
        return nnx.LayerNorm(N, dtype=dtype, param_dtype=dtype, rngs=rngs)
    if name == "dropout":
        return nnx.Dropout(0.3, rngs=rngs)
    return nnx.BatchNorm(N, dtype=dtype, param_dtype=dtype, rngs=rngs)


class Block(nnx.Module):
    def __init__(self, layer: nnx.Module):
        self.layer = layer

    def __call__(self, h: Any) -> Any:
        return jnp.tanh(self.layer(h)) + 0.5 * h


class Stack(nnx.Module):
    def __init__(self, spec: dict, ck: Remat):
        rngs = nnx.Rngs(spec["seed"], dropout=spec["seed"] + 1)
        dtype = jnp.dtype(spec["dtype"])
        self.blocks = nnx.List([Block(_layer(name, dtype, rngs)) for name in spec["layers"]])
        self.spec, self.ck = spec, ck
        if spec["form"] == "apply":
            ck.apply(self, Block, **options(spec, 1))

    def run_blocks(self, h: Any) -> Any:
        for block in self.blocks:
            h = block(h)
        return h

    def __call__(self, x: Any) -> Any:
        form, ck, opts = self.spec["form"], self.ck, options(self.spec, 1)
        if form == "call":
            h = x
            for block in self.blocks:
                h = ck.checkpoint(block, h, **opts)
        elif form == "method":
            h = ck.checkpoint(self.run_blocks, x, **opts)
        elif form == "decorator":
            h = ck.decorate(self.run_blocks, **opts)(x)
        elif form == "sequential":
            segments = min(self.spec.get("segments", 2), len(self.blocks))
            h = ck.sequential(list(self.blocks), segments, x, policy=opts["policy"])
        else:  # apply: the blocks themselves were checkpointed in __init__
            h = self.run_blocks(x)
        return jnp.sin(h)


def _loss(model: Stack, x: Any) -> Any:
    return jnp.sum(model(x) ** 2)


def _pure(tree: Any) -> Any:
    return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree


def _step(model: Stack, x: Any, mode: str) -> Any:
    if mode in ("nnx_grad", "nnx_jit"):
        grad_fn = nnx.value_and_grad(_loss)
        if mode == "nnx_jit":
            grad_fn = nnx.jit(grad_fn)
        return grad_fn(model, x)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def pure(params, rest, x):
        m = nnx.merge(graphdef, params, rest)
        return _loss(m, x), nnx.state(m, nnx.Not(nnx.Param))

    grad_fn = jax.jit(jax.value_and_grad(pure, has_aux=True))
    (loss, new_rest), grads = grad_fn(params, rest, x)
    nnx.update(model, new_rest)
    return loss, grads


def run_nnx(spec: dict, ck: Remat) -> list[Any]:
    """Every step's loss and gradients, then the module's state, then one more call."""
    model = Stack(spec, ck)
    rng = np.random.default_rng(spec["seed"])
    results = []
    for _ in range(spec["steps"]):
        x = jnp.asarray(rng.normal(size=(spec["n"], N)), spec["dtype"])
        loss, grads = _step(model, x, spec["mode"])
        results.append((loss, _pure(grads)))
    results.append(_pure(nnx.state(model)))
    results.append(model(jnp.asarray(rng.normal(size=(spec["n"], N)), spec["dtype"])))
    return results

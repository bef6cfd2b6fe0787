"""Placements (where the program runs: jit, scan, vmap, ...) and transforms (grad, jvp, ...)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

PLACEMENTS = ("none", "jit", "scan", "fori", "while", "cond", "vmap", "map", "outer_checkpoint")
TRANSFORMS = ("forward", "grad", "vjp", "jvp", "linearize", "jacfwd_grad", "hessian", "value_and_grad_aux")
#: the transforms that do not need reverse mode (a while_loop allows only these)
FORWARD_TRANSFORMS = ("forward", "jvp")


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _accumulate(acc: Any, out: Any) -> Any:
    return jax.tree.map(lambda a, o: a + o if _is_float(o) else o, acc, out)


def place(name: str, prog: Callable[[dict], Any]) -> Callable[[dict], Any]:
    """``prog`` run under the placement ``name``.

    ``prog`` reads the current call's Python values, so JAX's trace caches (keyed on the
    function, as for any pure function) must see a new function for each call.
    """
    program = prog

    def prog(p: dict) -> Any:  # noqa: F811  (a new function object on every call of place)
        return program(p)
    if name == "none":
        return lambda p: prog(p)
    if name == "jit":
        return jax.jit(lambda p: prog(p))
    if name == "outer_checkpoint":
        return jax.checkpoint(lambda p: prog(p))
    if name == "vmap":
        return lambda p: jax.vmap(lambda x: prog({**p, "x": x}))(p["x"])
    if name == "map":
        return lambda p: lax.map(lambda x: prog({**p, "x": x}), p["x"])
    if name == "cond":
        return lambda p: lax.cond(jnp.sum(p["x"]) > 0, prog, lambda q: prog({**q, "x": -q["x"]}), p)
    if name == "scan":
        def scanned(p):
            steps = jnp.arange(2, dtype=p["x"].dtype)
            return lax.scan(lambda c, i: (c, prog({**p, "x": p["x"] * (1 + 0.5 * i)})), 0, steps)[1]
        return scanned

    def looped(p):  # fori / while: the outputs summed over two iterations
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(prog, p))

        def body(i, acc):
            scale = (1 + 0.5 * i).astype(p["x"].dtype)
            return _accumulate(acc, prog({**p, "x": p["x"] * scale}))
        if name == "fori":
            return lax.fori_loop(0, 2, body, zeros)
        return lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, body(c[0], c[1])), (0, zeros))[1]
    if name in ("fori", "while"):
        return looped
    raise ValueError(f"unknown placement {name!r}")


def loss_of(f: Callable[[dict], Any]) -> Callable[[dict], Any]:
    """A scalar loss: the sum of ``sin`` over every float output."""
    def loss(p):
        return sum(jnp.sum(jnp.sin(leaf)) for leaf in jax.tree.leaves(f(p)) if _is_float(leaf))
    return loss


def _tangent_like(tree: Any, seed: int) -> Any:
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), tree)


def _cotangent_like(tree: Any, seed: int) -> Any:
    rng = np.random.default_rng(seed)

    def one(x):
        if _is_float(x):
            return jnp.asarray(rng.normal(size=x.shape), x.dtype)
        return np.zeros(x.shape, jax.dtypes.float0)
    return jax.tree.map(one, tree)


def transform(name: str, f: Callable[[dict], Any], params: dict, *, seed: int) -> Any:
    """What the transform ``name`` of ``f`` gives at ``params``: every output, compared leaf by leaf."""
    if name == "forward":
        return f(params)
    if name == "grad":
        return jax.grad(loss_of(f))(params)
    if name == "value_and_grad_aux":
        return jax.value_and_grad(lambda p: (loss_of(f)(p), f(p)), has_aux=True)(params)
    if name == "vjp":
        out, pullback = jax.vjp(f, params)
        return out, pullback(_cotangent_like(out, seed))
    if name == "jvp":
        return jax.jvp(f, (params,), (_tangent_like(params, seed),))
    if name == "linearize":
        out, f_jvp = jax.linearize(f, params)
        return out, f_jvp(_tangent_like(params, seed))
    if name == "jacfwd_grad":
        return jax.jacfwd(jax.grad(loss_of(f)))(params)
    if name == "hessian":
        return jax.hessian(loss_of(f))(params)
    raise ValueError(f"unknown transform {name!r}")

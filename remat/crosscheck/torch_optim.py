"""Optax transformations doing ``torch.optim``'s CPU arithmetic op by op, for the low-precision checks.

On bfloat16 parameters ``optax.adamw`` and ``torch.optim.AdamW`` do different arithmetic:
optax rounds every intermediate to bfloat16, its constants included (``-lr`` becomes
``-0.010009765625``, ``b2 = 0.999`` becomes ``1.0``), folds the weight decay into the
update and rounds the update before adding it; torch's single-tensor step (the CPU
default: no ``foreach`` kernels there) decays first (``param.mul_(1 - lr * wd)``), then
``exp_avg.lerp_``, ``exp_avg_sq.mul_(b2).addcmul_``, ``denom = (exp_avg_sq.sqrt() / bc2_sqrt)
.add_(eps)`` and ``param.addcdiv_(exp_avg, denom, value=-lr / bc1)``, each op computing in
float32 from float32 scalars and rounding once to the tensor's dtype. Given the same
bfloat16 gradients, optax's AdamW lands on a different bfloat16 value in many of the
entries (docs/crosscheck.md has the figures).
:func:`from_torch` builds the transformation that does torch's ops in torch's
order, so that the cross-check's two runs differ only by what the models compute.

The updates it returns are float32 differences ``new - old`` of values already rounded to
the parameter's dtype, so ``optax.apply_updates`` (``p + u`` in float32, cast back) lands
on torch's value exactly for bfloat16 parameters. SGD (with momentum, Nesterov) then
matches torch bit for bit; Adam(W) in all but a few entries, because torch's float32
``sqrt`` on CPU is not correctly rounded and XLA's is. On float32 parameters (mixed
precision) most entries are equal and the rest within 2 float32 ulps
(tests/test_torch_optim.py; docs/crosscheck.md has the figures).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax


class TorchOrderState(NamedTuple):
    """``count`` (steps taken), ``first`` and ``second`` (torch's ``exp_avg``/``exp_avg_sq``, or
    SGD's ``momentum_buffer`` in ``first``), each in the parameter's dtype."""

    count: jax.Array
    first: Any
    second: Any


def _f32(x: Any) -> jax.Array:
    return jnp.asarray(x, jnp.float32)


def adam(lr: float, b1: float, b2: float, eps: float, weight_decay: float = 0.0) -> optax.GradientTransformation:
    """``torch.optim.AdamW(lr, betas=(b1, b2), eps, weight_decay)`` (``Adam`` when ``weight_decay=0``).

    Example:
      >>> tx = adam(1e-2, 0.9, 0.999, 1e-8, weight_decay=0.01)
    """

    def init(params: optax.Params) -> optax.OptState:
        zeros = jax.tree.map(jnp.zeros_like, params)
        return TorchOrderState(jnp.zeros([], jnp.int32), zeros, jax.tree.map(jnp.zeros_like, params))

    def update(updates: optax.Updates, state: optax.OptState, params: optax.Params | None = None
               ) -> tuple[optax.Updates, optax.OptState]:
        state = cast(TorchOrderState, state)
        count = state.count + 1
        t = count.astype(jnp.float32)
        # torch computes these scalars in double on the host and hands the kernels float32; here
        # 1 - b**t = -expm1(t log b) keeps them within float32 ulps (1 - 0.999f**t is 1e-5 off)
        step_size = _f32(lr) / -jnp.expm1(t * _f32(math.log(b1)))
        bc2_sqrt = jnp.sqrt(-jnp.expm1(t * _f32(math.log(b2))))

        def one(g: jax.Array, p: jax.Array, m: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
            dtype = p.dtype
            decayed = (_f32(p) * _f32(1 - lr * weight_decay)).astype(dtype) if weight_decay else p
            g32 = _f32(g)
            m = (_f32(m) + _f32(1 - b1) * (g32 - _f32(m))).astype(dtype)  # lerp_, weight < 0.5
            v = (_f32((_f32(v) * _f32(b2)).astype(dtype)) + _f32(1 - b2) * g32 * g32).astype(dtype)
            denom = (_f32((_f32(jnp.sqrt(_f32(v)).astype(dtype)) / bc2_sqrt).astype(dtype)) + _f32(eps)).astype(dtype)
            new = (_f32(decayed) - step_size * _f32(m) / _f32(denom)).astype(dtype)  # addcdiv_
            return _f32(new) - _f32(p), m, v

        return _unzip(jax.tree.map(one, updates, params, state.first, state.second), count)

    return optax.GradientTransformation(init, update)


def sgd(lr: float, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
        weight_decay: float = 0.0) -> optax.GradientTransformation:
    """``torch.optim.SGD(lr, momentum, dampening, nesterov, weight_decay)``.

    Example:
      >>> tx = sgd(1e-2, momentum=0.9)
    """

    def init(params: optax.Params) -> optax.OptState:
        return TorchOrderState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, params), None)

    def update(updates: optax.Updates, state: optax.OptState, params: optax.Params | None = None
               ) -> tuple[optax.Updates, optax.OptState]:
        state = cast(TorchOrderState, state)
        count = state.count + 1

        def one(g: jax.Array, p: jax.Array, buf: jax.Array) -> tuple[jax.Array, jax.Array, None]:
            dtype = p.dtype

            def add(a: jax.Array, b: jax.Array, alpha: float) -> jax.Array:
                """``a.add(b, alpha=alpha)``: torch rounds ``alpha`` to the tensors' dtype first
                (``mul_``, ``lerp_``, ``addcmul_``, ``addcdiv_`` keep their scalar in float32)."""
                return (_f32(a) + _f32(jnp.asarray(alpha, dtype)) * _f32(b)).astype(dtype)

            if weight_decay:
                g = add(g, p, weight_decay)
            if momentum:
                later = add((_f32(buf) * _f32(momentum)).astype(dtype), g, 1 - dampening)
                buf = jnp.where(count == 1, g, later)  # torch's first step: buf = g.clone()
                g = add(g, buf, momentum) if nesterov else buf
            new = add(p, g, -lr)
            return _f32(new) - _f32(p), buf, None

        return _unzip(jax.tree.map(one, updates, params, state.first), count)

    return optax.GradientTransformation(init, update)


def _unzip(triples: Any, count: jax.Array) -> tuple[Any, TorchOrderState]:
    def part(i: int) -> Any:
        return jax.tree.map(lambda t: t[i], triples, is_leaf=lambda t: isinstance(t, tuple))

    return part(0), TorchOrderState(count, part(1), part(2))


def from_torch(optimizer: Any) -> optax.GradientTransformation:
    """The transformation doing ``optimizer``'s arithmetic (an ``SGD``, ``Adam`` or ``AdamW`` of
    ``torch.optim``, with its first parameter group's hyperparameters).

    Raises:
      ValueError: for another optimizer, or options it does not reproduce (``amsgrad``,
        ``maximize``, L2 ``weight_decay`` in ``Adam``).
    """
    import torch

    group = optimizer.param_groups[0]
    if group.get("maximize") or group.get("amsgrad"):
        raise ValueError("from_torch: maximize and amsgrad are not reproduced")
    lr = float(group["lr"])
    b1, b2 = group.get("betas", (0.9, 0.999))
    if isinstance(optimizer, torch.optim.AdamW):
        return adam(lr, b1, b2, group["eps"], weight_decay=group["weight_decay"])
    if isinstance(optimizer, torch.optim.Adam):
        if group["weight_decay"]:
            raise ValueError("from_torch: Adam's L2 weight_decay is not reproduced (use AdamW)")
        return adam(lr, b1, b2, group["eps"])
    if isinstance(optimizer, torch.optim.SGD):
        return sgd(lr, group["momentum"], group["dampening"], group["nesterov"], group["weight_decay"])
    raise ValueError(f"from_torch: {type(optimizer).__name__} is not reproduced (SGD, Adam, AdamW are)")

"""Lean element-wise ops and LayerNorm: JAX's math with PyTorch's backward residuals (see :mod:`remat.ops`)."""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


def _compute_dtype(dtype: Any) -> Any:
    """Statistics of half-precision inputs are computed in float32, as PyTorch does."""
    return jnp.promote_types(dtype, jnp.float32)


# --------------------------------------------------------------------------------------
# LayerNorm over the last axis
# --------------------------------------------------------------------------------------


def _ln_stats(x: jax.Array, eps: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    xf = x.astype(_compute_dtype(x.dtype))
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    # two-pass variance, like torch.nn.LayerNorm and Flax's use_fast_variance=False
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    return xf, mean, jax.lax.rsqrt(var + eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    return _layer_norm_fwd(x, scale, bias, eps)[0]


def _layer_norm_fwd(x, scale, bias, eps):
    xf, mean, rstd = _ln_stats(x, eps)
    out = ((xf - mean) * rstd * scale + bias).astype(x.dtype)
    return out, (x, mean, rstd, scale, bias)


def _layer_norm_bwd(eps, residuals, g):
    x, mean, rstd, scale, bias = residuals
    del eps
    acc = mean.dtype
    xhat = (x.astype(acc) - mean) * rstd  # recomputed: cheaper than keeping it
    gf = g.astype(acc)
    dxhat = gf * scale.astype(acc)
    dx = rstd * (dxhat - jnp.mean(dxhat, axis=-1, keepdims=True)
                 - xhat * jnp.mean(dxhat * xhat, axis=-1, keepdims=True))
    lead = tuple(range(x.ndim - 1))
    dscale = jnp.sum(gf * xhat, axis=lead)
    dbias = jnp.sum(gf, axis=lead)
    return dx.astype(x.dtype), dscale.astype(scale.dtype), dbias.astype(bias.dtype)


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def layer_norm(x: jax.Array, scale: jax.Array | None = None, bias: jax.Array | None = None,
               *, eps: float = 1e-5) -> jax.Array:
    """LayerNorm over the last axis whose backward keeps only ``x``, mean and 1/std.

    Args:
      x: input, normalized over its last axis.
      scale: per-feature scale of shape ``x.shape[-1:]``, or None for none.
      bias: per-feature shift of shape ``x.shape[-1:]``, or None for none.
      eps: added to the variance (PyTorch's default 1e-5; Flax's is 1e-6).

    Returns:
      ``(x - mean) / sqrt(var + eps) * scale + bias`` in ``x``'s dtype; the statistics
      of float16/bfloat16 inputs are computed in float32.

    Example:
      >>> import jax.numpy as jnp
      >>> from remat.ops import layer_norm
      >>> layer_norm(jnp.array([[1.0, 2.0, 3.0]])).round(3).tolist()
      [[-1.225, 0.0, 1.225]]
    """
    features = x.shape[-1:]
    if scale is None:
        scale = jnp.ones(features, x.dtype)
    if bias is None:
        bias = jnp.zeros(features, x.dtype)
    if scale.shape != features or bias.shape != features:
        raise ValueError(f"layer_norm: scale {scale.shape} and bias {bias.shape} must both have "
                         f"shape {features} (the last axis of x {x.shape})")
    return _layer_norm(x, scale, bias, float(eps))


class LayerNorm(nnx.LayerNorm):
    """``flax.nnx.LayerNorm`` whose backward keeps what PyTorch's keeps.

    Same constructor, parameters (``scale``, ``bias``) and forward values as
    ``nnx.LayerNorm`` with ``use_fast_variance=False``. Normalizing over the last axis
    without ``mask`` or ``axis_name`` takes :func:`layer_norm`'s lean backward; any other
    configuration falls back to ``nnx.LayerNorm`` unchanged.

    Example:
      >>> from flax import nnx
      >>> from remat.ops import LayerNorm
      >>> ln = LayerNorm(8, epsilon=1e-5, rngs=nnx.Rngs(0))
      >>> ln(jax.numpy.ones((2, 8))).shape
      (2, 8)
    """

    def _is_lean(self, mask: Any) -> bool:
        last = (-1,)
        axes = lambda a: tuple(a) if isinstance(a, (tuple, list)) else (a,)  # noqa: E731
        return (mask is None and self.axis_name is None
                and axes(self.reduction_axes) == last and axes(self.feature_axes) == last)

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        if not self._is_lean(mask):
            return super().__call__(x, mask=mask)
        scale = self.scale[...] if self.scale else None
        bias = self.bias[...] if self.bias else None
        x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
        return layer_norm(x, scale, bias, eps=self.epsilon)


# --------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------


_SQRT_HALF = math.sqrt(0.5)


def _gelu_value(x: jax.Array, approximate: bool) -> jax.Array:
    # computed in float32 for a half-precision x and rounded once, as PyTorch's kernel does (in
    # bfloat16 each of erf, the product and the sum rounded: more error than PyTorch's, docs/crosscheck.md)
    xf = x.astype(_compute_dtype(x.dtype))
    if approximate:
        return jax.nn.gelu(xf, approximate=True).astype(x.dtype)
    # PyTorch's formula, x * (1 + erf(x / sqrt(2))) / 2: jax.nn.gelu's erfc(-x / sqrt(2))
    # is the same value, but XLA:CPU expands erfc into a branchy sequence several times
    # slower than its erf polynomial
    return (xf * 0.5 * (1.0 + jax.lax.erf(xf * _SQRT_HALF))).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gelu(x: jax.Array, approximate: bool) -> jax.Array:
    return _gelu_value(x, approximate)


def _gelu_fwd(x, approximate):
    return _gelu_value(x, approximate), x


def _gelu_bwd(approximate, x, g):
    xf = x.astype(_compute_dtype(x.dtype))
    if approximate:
        c = math.sqrt(2.0 / math.pi)
        t = jnp.tanh(c * (xf + 0.044715 * xf ** 3))
        d = 0.5 * (1.0 + t) + 0.5 * xf * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * xf * xf)
    else:
        cdf = 0.5 * (1.0 + jax.lax.erf(xf * _SQRT_HALF))  # erf, not erfc: see _gelu_value
        pdf = jnp.exp(-0.5 * xf * xf) / math.sqrt(2.0 * math.pi)
        d = cdf + xf * pdf
    return ((g.astype(d.dtype) * d).astype(x.dtype),)


_gelu.defvjp(_gelu_fwd, _gelu_bwd)


def gelu(x: jax.Array, approximate: bool = False) -> jax.Array:
    """GELU whose backward keeps only its input (``jax.nn.gelu`` keeps four arrays).

    Args:
      x: input.
      approximate: False (the default, as in ``torch.nn.GELU``) for the exact erf form;
        True for the tanh approximation (``approximate="tanh"`` in PyTorch).

    Returns:
      ``jax.nn.gelu(x, approximate=approximate)`` (the exact form computed with ``erf``,
      as PyTorch does, instead of ``jax.nn.gelu``'s ``erfc``: equal up to rounding).
    """
    return _gelu(x, bool(approximate))


@jax.custom_vjp
def relu(x: jax.Array) -> jax.Array:
    """ReLU whose backward keeps only its output, as PyTorch's does (no separate mask).

    The derivative at 0 is 0, as for ``jax.nn.relu``.

    Args:
      x: input.

    Returns:
      ``max(x, 0)``.
    """
    return jax.nn.relu(x)


def _relu_fwd(x):
    y = jax.nn.relu(x)
    return y, y


def _relu_bwd(y, g):
    return (jnp.where(y > 0, g, jnp.zeros((), g.dtype)),)


relu.defvjp(_relu_fwd, _relu_bwd)


@jax.custom_vjp
def tanh(x: jax.Array) -> jax.Array:
    """tanh whose backward keeps only its output (``jnp.tanh`` keeps ``1 - tanh(x)**2`` too).

    Args:
      x: input.

    Returns:
      ``jnp.tanh(x)``.
    """
    return jnp.tanh(x)


def _tanh_fwd(x):
    y = jnp.tanh(x)
    return y, y


def _tanh_bwd(y, g):
    return (g * (1 - y * y),)


tanh.defvjp(_tanh_fwd, _tanh_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _softmax(x: jax.Array, axis: Any) -> jax.Array:
    return jax.nn.softmax(x, axis=axis)


def _softmax_fwd(x, axis):
    y = jax.nn.softmax(x, axis=axis)
    return y, y


def _softmax_bwd(axis, y, g):
    return (y * (g - jnp.sum(g * y, axis=axis, keepdims=True)),)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _masked_softmax(x: jax.Array, where: jax.Array, axis: Any) -> jax.Array:
    return jax.nn.softmax(x, axis=axis, where=where)


def _masked_softmax_fwd(x, where, axis):
    y = jax.nn.softmax(x, axis=axis, where=where)
    return y, y


def _masked_softmax_bwd(axis, y, g):
    # masked entries have y == 0, so their gradient is 0 without keeping the mask
    return _softmax_bwd(axis, y, g)[0], None


_masked_softmax.defvjp(_masked_softmax_fwd, _masked_softmax_bwd)


def softmax(x: jax.Array, axis: int | tuple[int, ...] = -1, where: jax.Array | None = None) -> jax.Array:
    """Softmax whose backward keeps only its output, even when masked.

    Args:
      x: logits.
      axis: the axis or axes to normalize over.
      where: optional boolean mask, broadcastable to ``x``; False entries take no part
        and come out as 0 (``jax.nn.softmax(where=...)``; PyTorch's
        ``masked_fill(~mask, -inf)`` then ``softmax``). The backward does not keep it.

    Returns:
      ``jax.nn.softmax(x, axis=axis, where=where)``.
    """
    axis = tuple(axis) if isinstance(axis, (list, tuple)) else int(axis)
    if where is None:
        return _softmax(x, axis)
    return _masked_softmax(x, jnp.asarray(where, bool), axis)

"""BatchNorm with PyTorch's running statistics, for NNX and Linen ports of PyTorch models."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen, nnx
from flax.linen.dtypes import promote_dtype


def _batch_norm(x: jax.Array, axis: int, use_running_average: bool, running: tuple[Any, Any], momentum: float,
                epsilon: float, scale: Any, bias: Any) -> tuple[jax.Array, tuple[Any, Any] | None]:
    """The normalized ``x``, and the new running ``(mean, var)`` (None when they are used, not updated)."""
    feature = axis % x.ndim
    axes = tuple(i for i in range(x.ndim) if i != feature)
    shape = [1] * x.ndim
    shape[feature] = x.shape[feature]
    if use_running_average:
        mean, var = running
        updated = None
    else:
        mean = x.mean(axes)
        var = jnp.square(x - mean.reshape(shape)).mean(axes)  # two-pass and biased, as torch normalizes
        n = x.size // x.shape[feature]
        unbiased = var * (n / max(n - 1, 1))  # what torch averages into running_var
        m = momentum
        updated = tuple(jax.lax.stop_gradient(m * r + (1 - m) * s) for r, s in zip(running, (mean, unbiased)))
    y = (x - mean.reshape(shape)) * jax.lax.rsqrt(var.reshape(shape) + epsilon)
    if scale is not None:
        y = y * scale.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return y, updated


def _unsupported(cls: str, mask: Any, axis_name: Any) -> None:
    if mask is not None or axis_name is not None:
        raise ValueError(f"remat.ops.{cls} does not support mask= or axis_name=; use Flax's BatchNorm for those")


class BatchNorm(nnx.BatchNorm):
    """``flax.nnx.BatchNorm`` with the running statistics of ``torch.nn.BatchNorm{1,2,3}d``.

    Same constructor, variables (``scale``, ``bias``, ``mean``, ``var``) and momentum
    convention as ``nnx.BatchNorm`` (``r = momentum * r + (1 - momentum) * batch_stat``:
    Flax's ``momentum=0.9`` is torch's ``momentum=0.1``). Two things follow PyTorch: the
    running variance averages the *unbiased* batch variance ``var * n / (n - 1)``
    (``nnx.BatchNorm`` averages the biased one), and the batch variance is computed in two
    passes, as torch does. The normalization itself uses the biased variance in both.
    ``mask=`` and ``axis_name=`` are not supported.

    Example:
      >>> from flax import nnx
      >>> from remat.ops import BatchNorm
      >>> bn = BatchNorm(3, momentum=0.9, rngs=nnx.Rngs(0))  # torch.nn.BatchNorm2d(3, momentum=0.1)
      >>> bn(jax.numpy.ones((2, 4, 4, 3))).shape
      (2, 4, 4, 3)
    """

    def __call__(self, x: jax.Array, use_running_average: bool | None = None, *,
                 mask: jax.Array | None = None) -> jax.Array:
        _unsupported("BatchNorm", mask, self.axis_name)
        use_running_average = self.use_running_average if use_running_average is None else use_running_average
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        x, mean, var, scale, bias = self.promote_dtype((x, self.mean[...], self.var[...], scale, bias),
                                                       dtype=self.dtype)
        y, updated = _batch_norm(x, self.axis, bool(use_running_average), (mean, var), self.momentum, self.epsilon,
                                 scale, bias)
        if updated is not None:
            self.mean[...], self.var[...] = updated
        return y


class LinenBatchNorm(linen.BatchNorm):
    """``flax.linen.BatchNorm`` with the running statistics of ``torch.nn.BatchNorm{1,2,3}d``.

    The Linen form of :class:`BatchNorm`: same fields, ``params`` (``scale``, ``bias``) and
    ``batch_stats`` (``mean``, ``var``) as ``linen.BatchNorm``; the running variance
    averages the unbiased batch variance, as torch's does. As in Linen, the statistics are
    not updated while initializing.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from remat.ops import LinenBatchNorm
      >>> bn = LinenBatchNorm(use_running_average=False, momentum=0.9)
      >>> variables = bn.init(jax.random.key(0), jnp.ones((2, 3)))
      >>> y, updates = bn.apply(variables, jnp.arange(6.0).reshape(2, 3), mutable=["batch_stats"])
      >>> updates["batch_stats"]["var"].tolist()  # 0.9 * 1 + 0.1 * unbiased var 4.5
      [1.350000023841858, 1.350000023841858, 1.350000023841858]
    """

    @linen.compact
    def __call__(self, x: jax.Array, use_running_average: bool | None = None, *,
                 mask: jax.Array | None = None) -> jax.Array:
        _unsupported("LinenBatchNorm", mask, self.axis_name)
        use_running_average = linen.merge_param("use_running_average", self.use_running_average,
                                                use_running_average)
        features = (x.shape[self.axis % x.ndim],)
        stat_dtype = jnp.float32 if self.force_float32_reductions else self.param_dtype
        ra_mean = self.variable("batch_stats", "mean", lambda s: jnp.zeros(s, stat_dtype), features)
        ra_var = self.variable("batch_stats", "var", lambda s: jnp.ones(s, stat_dtype), features)
        scale = self.param("scale", self.scale_init, features, self.param_dtype) if self.use_scale else None
        bias = self.param("bias", self.bias_init, features, self.param_dtype) if self.use_bias else None
        x, mean, var, scale, bias = promote_dtype(x, ra_mean.value, ra_var.value, scale, bias,
                                                               dtype=self.dtype)
        y, updated = _batch_norm(x, self.axis, bool(use_running_average), (mean, var), self.momentum, self.epsilon,
                                 scale, bias)
        if updated is not None and not self.is_initializing():
            ra_mean.value, ra_var.value = updated
        return y

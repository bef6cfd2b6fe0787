"""The two sides of a low-precision run: models, inputs and contexts in bfloat16 or under (emulated) autocast.

``"bfloat16"``: every floating parameter, buffer and input cast to bfloat16 on both sides
(``model.to(torch.bfloat16)``; :func:`remat.crosscheck.harness._cast_jax_model`).

In both, the JAX side's matmul and convolution modules accumulate in float32, add their
bias there and round once (``preferred_element_type=float32``, then a cast), as torch's
``addmm`` and oneDNN's convolutions do: XLA would round ``x @ w`` to bfloat16 and then add
the bias, a second rounding that flips the sign of small pre-activations and, through a
ReLU, moved an MLP's input gradient far further from the truth than PyTorch's (docs/crosscheck.md).
Normalisation modules compute in float32 and return their input's dtype, as torch's CPU
kernels do: in bfloat16, JAX's gradient of a broadcast (a BatchNorm's scale and shift over
``N*H*W`` positions) is a sum accumulated in bfloat16, further from the truth than
torch's float32 accumulation on the CNN's BatchNorm gradients (docs/crosscheck.md).

``"mixed"``: float32 parameters, bfloat16 compute. PyTorch runs the forward under
``torch.autocast("cpu", dtype=torch.bfloat16)``, whose CPU rules are: matmuls
(``linear``, ``matmul``, ``bmm``, ``addmm``), convolutions and
``scaled_dot_product_attention`` cast their operands to bfloat16 and return bfloat16;
losses (``cross_entropy``, ``mse_loss``, ...) run in float32; every other op (normalisation,
softmax, activations, embedding lookups, additions) runs in the dtype it is given, mixed
bfloat16/float32 operands promoting to float32. The JAX side follows the same rules per
module, since JAX has no autocast:

* ``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum``, ``nnx.Conv``, ``nnx.ConvTranspose``
  get ``dtype=bfloat16`` (Flax's ``dtype=bf16, param_dtype=float32``); the linear ones
  multiply with :func:`remat.ops.dot_general`, whose backward products take bfloat16
  operands as autocast's backward does (JAX's would promote them to float32);
* normalisation modules (``nnx.LayerNorm``, ``nnx.RMSNorm``, ``nnx.BatchNorm``,
  ``nnx.GroupNorm`` and subclasses) return their input's dtype, as torch's mixed-type
  kernels do (Flax would promote a bfloat16 input with float32 scales to float32);
* a module with an ``autocast_dtype`` attribute (the reference models' attention, for its
  explicit ``q @ k`` and ``p @ v``) gets it set to bfloat16 and casts those operands itself;
* the default training losses see float32 outputs.
"""
from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from remat import ops
from remat.crosscheck.harness import _cast_jax_model, _is_float, _to_jax_layout
from remat.crosscheck.lazy import _torch

_MATMUL_MODULES = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum, nnx.Conv, nnx.ConvTranspose)
_NORM_MODULES = (nnx.LayerNorm, nnx.RMSNorm, nnx.BatchNorm, nnx.GroupNorm)


@functools.cache
def _rounded_once_class(cls: type) -> type:
    """``cls`` (a matmul or convolution module) that accumulates in float32, adds its bias there and
    rounds once to its compute dtype, as torch's ``addmm`` and oneDNN convolutions do in bfloat16."""

    def __call__(self, x, *args, **kwargs):
        dtype = self.dtype if self.dtype is not None else x.dtype
        return cls.__call__(self, x, *args, **kwargs).astype(dtype)

    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


@functools.cache
def _float32_norm_class(cls: type) -> type:
    """``cls`` (a normalisation module) computing in float32 and returning its input's dtype, as
    torch's CPU kernels do for a bfloat16 input (float32 weights or not)."""

    def __call__(self, x, *args, **kwargs):
        wide = jnp.promote_types(x.dtype, jnp.float32)
        # running statistics updated in float32 and rounded once to their own dtype, as torch's
        stats = [v for v in (getattr(self, "mean", None), getattr(self, "var", None)) if isinstance(v, nnx.Variable)]
        kept = [v.get_value().dtype for v in stats]
        for v in stats:
            v.set_value(v.get_value().astype(wide))
        y = cls.__call__(self, x.astype(wide), *args, **kwargs).astype(x.dtype)
        for v, dtype in zip(stats, kept):
            v.set_value(v.get_value().astype(dtype))
        return y

    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def jax_model(model: nnx.Module, precision: str) -> nnx.Module:
    """A copy of ``model`` for a ``"bfloat16"``, ``"mixed"`` or ``"float32"`` run (module docstring)."""
    if precision not in ("bfloat16", "mixed"):
        return _cast_jax_model(model, precision)
    model = _cast_jax_model(model, "bfloat16") if precision == "bfloat16" else nnx.clone(model)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, _MATMUL_MODULES):
            node.preferred_element_type = jnp.float32
            node.__class__ = _rounded_once_class(type(node))
            if (isinstance(node, (nnx.Linear, nnx.LinearGeneral)) and node.dot_general in (None, lax.dot_general)
                    and getattr(node, "dot_general_cls", None) is None):  # a user's own product stays theirs
                # the output is rounded once to bfloat16 right after the bias, so its gradient
                # is a bfloat16 value: the backward products can take it in bfloat16, as torch's do
                node.dot_general = ops.dot_general
            if precision == "mixed":
                node.dtype = jnp.bfloat16
        elif isinstance(node, _NORM_MODULES):
            node.__class__ = _float32_norm_class(type(node))
        if isinstance(node, nnx.Module) and hasattr(node, "autocast_dtype") and precision == "mixed":
            twin_module: Any = node  # autocast_dtype is the reference twins' own field, not nnx's
            twin_module.autocast_dtype = jnp.bfloat16
    return model


def torch_model(model: Any, precision: str) -> Any:
    """A copy of the torch ``model``: float64, bfloat16, or float32 (``"mixed"``: autocast does the rest)."""
    torch = _torch()
    dtype = {"float64": torch.float64, "bfloat16": torch.bfloat16}.get(precision, torch.float32)
    return copy.deepcopy(model).to(dtype)


def torch_context(precision: str) -> Any:
    """``torch.autocast("cpu", dtype=torch.bfloat16)`` for ``"mixed"``, else nothing."""
    if precision != "mixed":
        return contextlib.nullcontext()
    torch = _torch()
    return torch.autocast("cpu", dtype=torch.bfloat16)


def input_dtype(precision: str) -> str:
    """The dtype floating inputs (and float targets) take: bfloat16, float64, else float32."""
    return precision if precision in ("bfloat16", "float64") else "float32"


def torch_inputs(xs: tuple[np.ndarray, ...], precision: str, requires_grad: bool) -> list[Any]:
    torch = _torch()
    dtype = getattr(torch, input_dtype(precision))
    return [torch.tensor(a, dtype=dtype, requires_grad=requires_grad) if _is_float(a)
            else torch.from_numpy(np.ascontiguousarray(a)) for a in xs]


def jax_inputs(xs: tuple[np.ndarray, ...], precision: str, channels_last: bool) -> list[jax.Array]:
    dtype = input_dtype(precision)
    return [jnp.asarray(_to_jax_layout(a, channels_last), dtype=dtype) if _is_float(a) else jnp.asarray(a)
            for a in xs]


def float32_outputs(out: Any) -> Any:
    """``out`` with its floating leaves in float32: what a loss sees under autocast (``cross_entropy``,
    ``mse_loss`` run in float32)."""
    return jax.tree.map(lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, out)


def dtype_name(value: Any) -> str:
    """``"bfloat16"``, ``"float32"``, ... of a torch tensor or an array."""
    return str(value.dtype).removeprefix("torch.")

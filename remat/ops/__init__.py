"""Lean element-wise ops: JAX's math, with the residuals PyTorch's backward keeps.

JAX differentiates ``jax.nn.gelu`` or a LayerNorm by linearizing them primitive by
primitive, so the backward pass keeps every intermediate the derivative touches: a
LayerNorm keeps ``x - mean``, the normalized ``x`` and its output, an exact GELU keeps
four arrays of its input's size, a masked softmax keeps the scores, their ``exp``, the
output and a broadcast mask, and ReLU keeps a boolean mask beside its output. PyTorch
writes these backward formulas by hand (``tools/autograd/derivatives.yaml``) and keeps
far less. Outside checkpointed regions, and in the ends of a model that are never
checkpointed, that difference is real memory.

The ops here compute the same forward values as their ``jax.nn`` / Flax counterparts and
carry a ``jax.custom_vjp`` whose backward needs only what PyTorch's needs:

=============  ===========================  ===================================
op             keeps for the backward       PyTorch keeps
=============  ===========================  ===================================
layer_norm     input, mean, 1/std           input, mean, rstd (and the weight)
gelu           input                        input
relu           output                       output
tanh           output                       output
softmax        output (mask not needed)     output (``masked_fill`` keeps a mask)
=============  ===========================  ===================================

Also here: :func:`chunked_cross_entropy`, an LM head and its cross-entropy in one, chunked
over tokens so that the ``[tokens, vocab]`` logits and their gradient never exist;
:func:`dot_general`, a ``lax.dot_general`` whose backward products stay in bfloat16 (float32
accumulation, one rounding) as PyTorch's do; :func:`scaled_dot_product_attention`, PyTorch's
attention call computed in tiles (flash attention), so the ``[..., L, S]`` scores and
probabilities are never kept; and, for ports of PyTorch models: :class:`BatchNorm` (NNX) and
:class:`LinenBatchNorm` (Linen), Flax's BatchNorm with PyTorch's running statistics.

They compose with :func:`remat.checkpoint` and every policy (inside a checkpointed
region they are recomputed like any other op), with ``jax.vmap`` and ``lax.scan``.
Forward-mode differentiation (``jax.jvp``, ``jax.jacfwd``, Hessians) is not defined for a
``custom_vjp``: use the ``jax.nn`` versions where you need it.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from remat import ops
  >>> x = jnp.linspace(-2.0, 2.0, 8).reshape(2, 4)
  >>> bool(jnp.allclose(jax.grad(lambda v: ops.gelu(v).sum())(x),
  ...                   jax.grad(lambda v: jax.nn.gelu(v, approximate=False).sum())(x)))
  True

References:
  PyTorch, ``tools/autograd/derivatives.yaml`` (``native_layer_norm``, ``gelu``,
  ``relu``, ``_softmax``).
"""
from __future__ import annotations

from remat.ops._attention import scaled_dot_product_attention
from remat.ops._batchnorm import BatchNorm, LinenBatchNorm
from remat.ops._cross_entropy import chunked_cross_entropy
from remat.ops._dot import dot_general
from remat.ops._lean import LayerNorm, gelu, layer_norm, relu, softmax, tanh

__all__ = ["layer_norm", "gelu", "relu", "tanh", "softmax", "LayerNorm", "BatchNorm", "LinenBatchNorm",
           "chunked_cross_entropy", "dot_general", "scaled_dot_product_attention"]

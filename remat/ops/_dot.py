"""A ``lax.dot_general`` whose backward stays in the operands' low precision, as PyTorch's does."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

DimensionNumbers = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: DimensionNumbers, precision: Any = None,
                preferred_element_type: Any = None, **kwargs: Any) -> jax.Array:
    """``lax.dot_general`` whose cotangent products run in the operands' dtype, as PyTorch's backward does.

    Under ``torch.autocast`` (or on a bfloat16 model) a matmul's output gradient is bfloat16,
    and each of its two backward products takes bfloat16 operands, accumulates in float32
    and rounds once. In JAX, ``lax.dot_general(a, b, preferred_element_type=float32)``
    followed by a cast to bfloat16 rounds the forward the same way, but its cotangent is
    float32: both backward products then promote the bfloat16 operand to float32, which
    keeps a float32 copy of every weight and runs float32 kernels where bfloat16 ones exist
    (XLA:CPU's oneDNN path, GPU tensor cores). This op computes the same forward value and,
    for low-precision operands, rounds the cotangent to their dtype before the two products,
    each accumulated in float32 and rounded once to its operand's dtype. That rounding is
    exact, and the gradients equal JAX's own, whenever the output is rounded to that dtype
    before any other use, as autocast and Flax's ``dtype=bfloat16`` modules do. Where the
    output stays float32 (attention scores before a float32 softmax) it is the rounding
    PyTorch's bfloat16 kernels make (its CPU flash attention rounds the scores' gradient
    before both products). For float32 (or wider) operands the values and gradients are
    ``lax.dot_general``'s, and so is the jaxpr, except in a dense layer's form.

    A dense layer's float32 product (``x[..., K] @ w[K, N]``, ``nnx.Linear``'s, or
    ``x[..., K] @ w[N, K].T``, a head tied to an ``[N, K]`` embedding as ``nnx.Embed.attend``
    computes it) has its backward written as two 2-D products over the flattened leading
    axes: ``g @ w.T`` and ``x.T @ g`` (or ``g @ w`` and ``g.T @ x``). JAX's transpose rule
    contracts the 3-D ``x`` and ``g`` over their two leading axes instead, which XLA:CPU
    lowers with a transposed copy of an activation-sized operand, fused into whatever
    element-wise work produced it (the SwiGLU backward of a 135M Llama spent more time in
    those copies than in its products, and its tied head copied the whole logits' gradient).
    In bfloat16 the order-picking backward above is the faster on XLA:CPU, and stays.

    Args:
      lhs, rhs, dimension_numbers, precision, preferred_element_type: as ``lax.dot_general``;
        the signature of Flax's ``dot_general=`` hook (``nnx.Linear(..., dot_general=...)``).
      **kwargs: passed to ``lax.dot_general`` (for example ``out_sharding``).

    Returns:
      ``lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from remat import ops
      >>> x, w = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 2), jnp.bfloat16)
      >>> dims = (((1,), (0,)), ((), ()))
      >>> ops.dot_general(x, w, dims, preferred_element_type=jnp.float32).dtype
      dtype('float32')
      >>> jax.grad(lambda w: ops.dot_general(x, w, dims).astype(jnp.float32).sum())(w).dtype
      dtype(bfloat16)
    """
    dtype = jnp.result_type(lhs, rhs)
    wide = jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits >= 32
    w_contracting = _dense_form(jnp.ndim(lhs), jnp.ndim(rhs), dimension_numbers)
    if wide and w_contracting is not None:
        return _dense_dot(w_contracting, precision, preferred_element_type, tuple(sorted(kwargs.items())), lhs, rhs)
    if wide or not jnp.issubdtype(dtype, jnp.floating):
        return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, **kwargs)
    return _low_precision_dot(_normalized(dimension_numbers), precision, preferred_element_type,
                              tuple(sorted(kwargs.items())), lhs, rhs)


def _dense_form(lhs_ndim: int, rhs_ndim: int, dimension_numbers: Any) -> int | None:
    """The axis of a 2-D ``w`` that ``x[..., K]`` is contracted with, nothing batched: 0 for a
    dense layer's ``w[K, N]``, 1 for a tied head's ``w[N, K]``; None for any other product."""
    (lc, rc), (lb, rb) = dimension_numbers
    if rhs_ndim == 2 and lhs_ndim >= 1 and tuple(lc) == (lhs_ndim - 1,) and not tuple(lb) and not tuple(rb):
        return {(0,): 0, (1,): 1}.get(tuple(rc))
    return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _dense_dot(w_contracting, precision, preferred_element_type, kwargs, x, w):
    return lax.dot_general(x, w, (((x.ndim - 1,), (w_contracting,)), ((), ())), precision=precision,
                           preferred_element_type=preferred_element_type, **dict(kwargs))


def _dense_dot_fwd(w_contracting, precision, preferred_element_type, kwargs, x, w):
    return _dense_dot(w_contracting, precision, preferred_element_type, kwargs, x, w), (x, w)


def _dense_dot_bwd(w_contracting, precision, preferred_element_type, kwargs, residuals, g):
    """``g @ w.T`` and ``x.T @ g`` (``w[K, N]``), or ``g @ w`` and ``g.T @ x`` (``w[N, K]``),
    over the flattened leading axes."""
    del preferred_element_type, kwargs
    x, w = residuals
    features = w.shape[w_contracting]
    g2 = g.astype(jnp.result_type(x, w)).reshape(-1, w.shape[1 - w_contracting])
    x2 = x.reshape(-1, features)
    dx = lax.dot_general(g2, w, (((1,), (1 - w_contracting,)), ((), ())), precision=precision)
    both_rows = (((0,), (0,)), ((), ()))
    dw = (lax.dot_general(x2, g2, both_rows, precision=precision) if w_contracting == 0
          else lax.dot_general(g2, x2, both_rows, precision=precision))
    return dx.reshape(x.shape).astype(x.dtype), dw.astype(w.dtype)


_dense_dot.defvjp(_dense_dot_fwd, _dense_dot_bwd)


def _normalized(dimension_numbers: Any) -> DimensionNumbers:
    (lc, rc), (lb, rb) = dimension_numbers
    return (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _low_precision_dot(dimension_numbers, precision, preferred_element_type, kwargs, lhs, rhs):
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type, **dict(kwargs))


def _low_precision_dot_fwd(dimension_numbers, precision, preferred_element_type, kwargs, lhs, rhs):
    out = lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                          preferred_element_type=preferred_element_type, **dict(kwargs))
    return out, (lhs, rhs)


def _low_precision_dot_bwd(dimension_numbers, precision, preferred_element_type, kwargs, residuals, g):
    del preferred_element_type, kwargs
    lhs, rhs = residuals
    g = g.astype(jnp.result_type(lhs, rhs))
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    lhs_free = tuple(d for d in range(lhs.ndim) if d not in lhs_contract and d not in lhs_batch)
    rhs_free = tuple(d for d in range(rhs.ndim) if d not in rhs_contract and d not in rhs_batch)
    # g's axes: batch, then lhs's free axes, then rhs's free axes
    g_batch = tuple(range(len(lhs_batch)))
    g_lhs_free = tuple(range(len(g_batch), len(g_batch) + len(lhs_free)))
    g_rhs_free = tuple(range(len(g_batch) + len(lhs_free), g.ndim))
    lhs_cotangent = _cotangent(g, rhs, ((g_rhs_free, rhs_free), (g_batch, tuple(rhs_batch))), lhs, precision,
                               lhs_batch, lhs_free, _paired(rhs_contract, lhs_contract))
    rhs_cotangent = _cotangent(g, lhs, ((g_lhs_free, lhs_free), (g_batch, tuple(lhs_batch))), rhs, precision,
                               rhs_batch, rhs_free, _paired(lhs_contract, rhs_contract))
    return lhs_cotangent, rhs_cotangent


def _paired(contract: tuple[int, ...], other: tuple[int, ...]) -> tuple[int, ...]:
    """``other``'s axes, in the order their partners in ``contract`` come in their operand."""
    return tuple(other[contract.index(d)] for d in sorted(contract))


def _cotangent(g: jax.Array, other: jax.Array, dimension_numbers: DimensionNumbers, operand: jax.Array,
               precision: Any, batch: tuple[int, ...], from_g: tuple[int, ...],
               from_other: tuple[int, ...]) -> jax.Array:
    """The cotangent of ``operand``: ``dot_general(g, other, dimension_numbers)`` (``g``
    contracted with the other operand over that operand's free axes), accumulated in float32
    and rounded once to ``operand``'s dtype.

    The product's axes stand for ``operand``'s axes ``batch``, then ``from_g``, then
    ``from_other``. It takes whichever operand order gives them in the operand's own order,
    so that no transpose follows it: XLA:CPU fails at run time ("DotThunk: BF16 x BF16 =
    F32") on some bfloat16 products whose result it must transpose. Where neither order
    does, it multiplies in float32, as JAX's own transpose rule does.
    """
    (g_axes, other_axes), (g_batch, other_batch) = dimension_numbers
    g_first = (*batch, *from_g, *from_other)
    if list(g_first) == sorted(g_first):
        out = lax.dot_general(g, other, dimension_numbers, precision=precision, preferred_element_type=jnp.float32)
    elif list((*batch, *from_other, *from_g)) == sorted(g_first):
        out = lax.dot_general(other, g, ((other_axes, g_axes), (other_batch, g_batch)), precision=precision,
                              preferred_element_type=jnp.float32)
    else:
        wide = jnp.float32
        out = lax.dot_general(g.astype(wide), other.astype(wide), dimension_numbers, precision=precision)
        out = jnp.transpose(out, [g_first.index(d) for d in range(operand.ndim)])
    return out.astype(operand.dtype)


_low_precision_dot.defvjp(_low_precision_dot_fwd, _low_precision_dot_bwd)

"""remat.ops.dot_general: lax.dot_general's values and gradients, with its backward products in bfloat16."""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import _subjaxprs
from flax import nnx
from jax import lax

from remat import ops

BF16, F32 = jnp.bfloat16, jnp.float32

# (lhs shape, rhs shape, dimension numbers): a linear layer on 2-D and 3-D inputs, x @ w.T (an
# LM head on a tied embedding), contractions over leading and several axes, attention's batched
# q @ k.T and p @ v, and batch axes in different places on the two sides
CASES = [
    ((4, 8), (8, 3), (((1,), (0,)), ((), ()))),
    ((2, 5, 8), (8, 3), (((2,), (0,)), ((), ()))),
    ((1, 16, 8), (64, 8), (((2,), (1,)), ((), ()))),
    ((8, 4), (8, 3), (((0,), (0,)), ((), ()))),
    ((6, 2, 5), (5, 7, 6), (((0, 2), (2, 0)), ((), ()))),
    ((2, 3, 5, 4), (2, 3, 6, 4), (((3,), (3,)), ((0, 1), (0, 1)))),
    ((2, 3, 5, 6), (2, 3, 6, 4), (((3,), (2,)), ((0, 1), (0, 1)))),
    ((3, 6, 2, 5), (5, 3, 7, 6), (((1, 3), (3, 0)), ((0,), (1,)))),
]


def _rounded(dot, dims, preferred):
    """``dot(a, b)`` rounded once to bfloat16, as an autocast matmul or a Flax ``dtype=bf16`` layer uses it."""
    return lambda a, b: dot(a, b, dims, preferred_element_type=preferred).astype(BF16)


def _loss(f, weights):
    return lambda a, b: (f(a, b).astype(F32) * weights).sum()


# every case with a bfloat16 result in the default run; with a float32 one (then rounded), the 3-D
# linear layer and the batch axes in different places on the two sides, the other six slow
F32_OUT_FAST = (1, 7)


FAST_CASES = [(*case, preferred) for preferred in (None, F32) for i, case in enumerate(CASES)
              if preferred is None or i in F32_OUT_FAST]


def _inputs(lhs_shape, rhs_shape, dims, preferred):
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=lhs_shape), BF16)
    b = jnp.asarray(rng.normal(size=rhs_shape), BF16)
    reference, ours = _rounded(lax.dot_general, dims, preferred), _rounded(ops.dot_general, dims, preferred)
    weights = jnp.asarray(rng.normal(size=jax.eval_shape(reference, a, b).shape), F32)
    return a, b, reference, ours, weights


def _values_and_gradients(reference, ours, weights):
    """Both values and both gradients, to be computed in a compiled program (eagerly, each
    operation compiles alone)."""
    def both(a, b):
        grads = [jax.grad(_loss(f, weights), (0, 1))(a, b) for f in (ours, reference)]
        return (ours(a, b), reference(a, b)), tuple(grads)
    return both


@functools.cache
def _fast_results():
    """The default run's cases, each on its own inputs, computed in one compiled program (one
    compile, not one per case)."""
    inputs = [_inputs(*case) for case in FAST_CASES]
    results = jax.jit(lambda ab: [_values_and_gradients(*i[2:])(a, b) for i, (a, b) in zip(inputs, ab)])(
        [i[:2] for i in inputs])
    return dict(zip(FAST_CASES, results, strict=True))


@pytest.mark.parametrize("lhs_shape,rhs_shape,dims,preferred", [
    pytest.param(*case, preferred, id=f"{case[2]}-{name}",
                 marks=pytest.mark.slow if preferred is F32 and i not in F32_OUT_FAST else ())
    for preferred, name in ((None, "bf16-out"), (F32, "f32-out")) for i, case in enumerate(CASES)])
def test_values_and_gradients_equal_lax_dot_general(lhs_shape, rhs_shape, dims, preferred):
    case = (lhs_shape, rhs_shape, dims, preferred)
    if case in FAST_CASES:  # the default run's cases: one program computes them all
        (value, want_value), (got, expected) = _fast_results()[case]
    else:  # a slow case: its values and gradients from one compiled program of its own
        a, b, reference, ours, weights = _inputs(*case)
        (value, want_value), (got, expected) = jax.jit(_values_and_gradients(reference, ours, weights))(a, b)
    np.testing.assert_array_equal(np.asarray(value, F32), np.asarray(want_value, F32))
    for e, g in zip(expected, got):
        assert g.dtype == e.dtype == BF16 and g.shape == e.shape
        # the same float32 sums of the same bfloat16 products, rounded once: at these sizes the
        # summation order cannot move a result across a bfloat16 rounding boundary
        np.testing.assert_array_equal(np.asarray(g, F32), np.asarray(e, F32))


def test_at_a_layer_size_the_gradients_differ_by_at_most_one_bfloat16_rounding():
    """A [256, 576] x [576, 1536] layer: XLA:CPU's bfloat16 kernel and its float32 one sum in
    different orders, so a float32 sum near a bfloat16 rounding boundary can round either way."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(1, 256, 576)), BF16)
    w = jnp.asarray(rng.normal(size=(576, 1536)) / 24, BF16)
    dims = (((2,), (0,)), ((), ()))
    weights = jnp.asarray(rng.normal(size=(1, 256, 1536)), F32)
    expected, got = jax.jit(lambda x, w: tuple(jax.grad(_loss(_rounded(dot, dims, F32), weights), (0, 1))(x, w)
                                               for dot in (lax.dot_general, ops.dot_general)))(x, w)  # one program
    # each gradient's sum of absolute products: the scale of the float32 summation error
    g_out = np.asarray((weights.astype(BF16)), F32)
    scales = (np.abs(g_out) @ np.abs(np.asarray(w, F32)).T, np.abs(np.asarray(x, F32))[0].T @ np.abs(g_out[0]))
    for e, g, scale in zip(expected, got, scales):
        e, g = np.asarray(e, F32), np.asarray(g, F32)
        # one bfloat16 rounding step of the result, plus float32 summation error (n eps of the sum of
        # absolute terms, n = 1536 the longest sum)
        bound = np.abs(e).reshape(scale.shape) * 2.0 ** -7 + 1536 * np.finfo(np.float32).eps * scale
        assert np.all(np.abs(g - e).reshape(scale.shape) <= bound)
        assert np.mean(g == e) > 0.95


def _dot_operand_types(hlo: str) -> list[tuple[str, str]]:
    types = dict(re.findall(r"(%[\w.\-]+) = (\w+)\[", hlo))
    return [(types[a], types[b]) for a, b in re.findall(r"= \w+\[[^\]]*\][^ ]* dot\((%[\w.\-]+), (%[\w.\-]+)\)", hlo)]


def test_every_backward_product_takes_bfloat16_operands():
    """JAX's own transpose promotes the float32 cotangent's partner to float32: a float32 copy
    of the weight, and float32 kernels. Here every product of the step multiplies bfloat16."""
    x = jnp.ones((2, 16, 32), BF16)
    w = jnp.ones((32, 64), F32)
    dims = (((2,), (0,)), ((), ()))

    def step(dot):
        return jax.jit(jax.grad(lambda x, w: dot(x, w.astype(BF16), dims, preferred_element_type=F32)
                                .astype(BF16).astype(F32).sum(), (0, 1)))

    theirs = _dot_operand_types(step(lax.dot_general).lower(x, w).compile().as_text())
    ours = _dot_operand_types(step(ops.dot_general).lower(x, w).compile().as_text())
    assert ("f32", "f32") in theirs  # what this op exists to avoid
    assert ours and all(t == ("bf16", "bf16") for t in ours)


def test_float32_operands_outside_a_dense_layer_are_lax_dot_general_itself():
    x, w = jnp.ones((2, 4, 8)), jnp.ones((2, 8, 3))
    dims = (((2,), (1,)), ((0,), (0,)))  # a batched product
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: ops.dot_general(x, w, dims).sum(), (0, 1)))(x, w)
    reference = jax.make_jaxpr(jax.grad(lambda x, w: lax.dot_general(x, w, dims).sum(), (0, 1)))(x, w)
    assert str(jaxpr) == str(reference)


@pytest.mark.parametrize("w_shape, dims", [((8, 3), (((2,), (0,)), ((), ()))),   # nnx.Linear's x @ w
                                            ((3, 8), (((2,), (1,)), ((), ())))],  # a tied head's x @ w.T
                         ids=["dense layer", "tied head"])
def test_a_float32_dense_layer_differentiates_as_two_2d_products(w_shape, dims):
    """JAX's transpose contracts the 3-D input and cotangent over two axes, which XLA:CPU
    lowers with a transposed copy of one of them; the dense forms' backward is 2-D."""
    rng = np.random.default_rng(1)
    x, w = jnp.asarray(rng.normal(size=(2, 5, 8)), F32), jnp.asarray(rng.normal(size=w_shape), F32)
    weights = jnp.asarray(rng.normal(size=(2, 5, 3)), F32)
    def value_and_grads(dot, x, w):
        return dot(x, w, dims), jax.grad(lambda x, w: (dot(x, w, dims) * weights).sum(), (0, 1))(x, w)

    # both values and both gradients from one compiled program (eager, each operation compiles alone)
    (value, got), (want_value, want) = jax.jit(lambda x, w: (value_and_grads(ops.dot_general, x, w),
                                                             value_and_grads(lax.dot_general, x, w)))(x, w)
    np.testing.assert_array_equal(value, want_value)
    for g, e in zip(got, want, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)
    backward = jax.make_jaxpr(jax.grad(lambda x, w: (ops.dot_general(x, w, dims) * weights).sum(), (0, 1)))(x, w)
    products = [e for e in _equations(backward.jaxpr) if e.primitive.name == "dot_general"]
    assert len(products) == 3 and all(v.aval.ndim == 2 for e in products[1:] for v in e.invars)


def _equations(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _subjaxprs(eqn.params):
            yield from _equations(sub)


def test_as_flax_hook_a_bfloat16_mlp_trains_to_the_same_gradients_in_less_memory():
    def mlp(dot_general):
        rngs = nnx.Rngs(0)
        return nnx.Sequential(*[nnx.Linear(64, 64, dtype=BF16, preferred_element_type=F32, rngs=rngs,
                                           dot_general=dot_general) for _ in range(4)])

    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 64)), BF16)

    def grad_step(model):
        graph, params = nnx.split(model)

        def loss(params):
            h = x
            for layer in nnx.merge(graph, params).layers:
                h = layer(h).astype(BF16)  # the rounding autocast and dtype=bf16 layers make
            return h.astype(F32).sum()

        return jax.jit(jax.grad(loss)), params

    (theirs, params), (ours, same_params) = grad_step(mlp(lax.dot_general)), grad_step(mlp(ops.dot_general))
    for e, g in zip(jax.tree.leaves(theirs(params)), jax.tree.leaves(ours(same_params))):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))
    temp = [f.lower(p).compile().memory_analysis().temp_size_in_bytes for f, p in ((theirs, params), (ours, params))]
    assert temp[1] < temp[0]  # no float32 copy of a weight or an activation for the backward

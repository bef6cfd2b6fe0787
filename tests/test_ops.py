"""remat.ops: jax.nn's values and gradients, with PyTorch's (smaller) saved set."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close
from flax import nnx

import remat
from remat import ops

EPS = 1e-5


def _ln_reference(x, scale, bias):
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + EPS) * scale + bias


def _data(shape=(3, 5, 16), seed=0, dtype=jnp.float32):
    # drawn and cast by NumPy, put on the device as it is: jax.random's threefry and jnp.asarray's
    # cast each compile a program for each shape and dtype
    return jax.device_put(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


MASK = jnp.tril(jnp.ones((5, 16), bool))

# (name, lean op, reference op); each takes one array
UNARY = [
    ("gelu", ops.gelu, lambda v: jax.nn.gelu(v, approximate=False)),
    ("gelu_tanh", lambda v: ops.gelu(v, approximate=True), lambda v: jax.nn.gelu(v, approximate=True)),
    ("relu", ops.relu, jax.nn.relu),
    ("tanh", ops.tanh, jnp.tanh),
    ("softmax", ops.softmax, jax.nn.softmax),
    ("softmax_axis0", lambda v: ops.softmax(v, axis=0), lambda v: jax.nn.softmax(v, axis=0)),
    ("masked_softmax", lambda v: ops.softmax(v, where=MASK),
     lambda v: jax.nn.softmax(jnp.where(MASK, v, -jnp.inf), axis=-1)),
    ("layer_norm", lambda v: ops.layer_norm(v, jnp.linspace(0.5, 2, 16), jnp.linspace(-1, 1, 16)),
     lambda v: _ln_reference(v, jnp.linspace(0.5, 2, 16), jnp.linspace(-1, 1, 16))),
]
IDS = [u[0] for u in UNARY]


def _weighted(f):
    # a non-uniform cotangent, so that a wrong backward cannot cancel out
    w = jnp.cos(jnp.arange(3 * 5 * 16, dtype=jnp.float32).reshape(3, 5, 16))
    return lambda v: jnp.sum(f(v) * w.astype(v.dtype))


# every op fast; its second variant (tanh GELU, softmax over axis 0) with the slow cases
SLOW_VARIANTS = ("gelu_tanh", "softmax_axis0")


@pytest.mark.parametrize("name,lean,reference", [
    pytest.param(*u, id=u[0], marks=pytest.mark.slow) if u[0] in SLOW_VARIANTS else pytest.param(*u, id=u[0])
    for u in UNARY
])
def test_values_and_gradients_equal_reference(name, lean, reference):
    x = _data()
    # both sides' values and gradients from one compiled program (eager, every operation compiles alone)
    (y_lean, g_lean), (y_ref, g_ref) = jax.jit(lambda v: tuple((f(v), jax.grad(_weighted(f))(v))
                                                               for f in (lean, reference)))(x)
    np.testing.assert_allclose(y_lean, y_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(g_lean, g_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,lean,reference", UNARY, ids=IDS)
def test_keeps_fewer_residual_bytes(name, lean, reference):
    x = _data()
    lean_bytes = remat.analysis.saved_residuals(_weighted(lean), x).residual_bytes
    ref_bytes = remat.analysis.saved_residuals(_weighted(reference), x).residual_bytes
    assert lean_bytes < ref_bytes, (name, lean_bytes, ref_bytes)


def test_layer_norm_keeps_input_mean_and_rstd_only():
    x, scale, bias = _data(), jnp.ones(16), jnp.zeros(16)
    report = remat.analysis.saved_residuals(lambda v, s, b: ops.layer_norm(v, s, b).sum(), x, scale, bias)
    computed = sorted(tuple(r.shape) for r in report.residuals if not r.is_argument)
    assert computed == [(3, 5, 1), (3, 5, 1)]  # mean and 1/std; x, scale, bias are arguments


def test_layer_norm_parameter_gradients_match_reference():
    x, scale, bias = _data(), jnp.linspace(0.5, 2, 16), jnp.linspace(-1, 1, 16)
    loss = lambda fn: (lambda s, b: jnp.sum(fn(x, s, b) ** 3))  # noqa: E731
    lean = jax.jit(jax.grad(loss(ops.layer_norm), argnums=(0, 1)))(scale, bias)
    ref = jax.jit(jax.grad(loss(_ln_reference), argnums=(0, 1)))(scale, bias)
    assert_trees_close(lean, ref, rtol=1e-5, atol=1e-4)


def test_layer_norm_module_matches_flax_and_falls_back_with_mask():
    x = _data()
    lean = ops.LayerNorm(16, epsilon=EPS, use_fast_variance=False, rngs=nnx.Rngs(0))
    flax_ln = nnx.LayerNorm(16, epsilon=EPS, use_fast_variance=False, rngs=nnx.Rngs(0))
    assert isinstance(lean, nnx.LayerNorm)
    assert jax.tree.structure(nnx.state(lean)) == jax.tree.structure(nnx.state(flax_ln))
    mask = x > -10  # everything in: the masked path is Flax's own
    # the four outputs from one compiled program (eager, each operation compiles alone)
    ours, theirs, ours_masked, theirs_masked = nnx.jit(lambda a, b, x, mask: (a(x), b(x), a(x, mask=mask),
                                                                              b(x, mask=mask)))(lean, flax_ln, x, mask)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours_masked, theirs_masked, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow)])
def test_half_precision_keeps_dtype_and_is_close(dtype):
    x = _data(dtype=dtype)
    # every op's value and gradient, and every float32 reference, from one compiled program
    # (eager, each operation compiles alone; one program per op, a compile's fixed cost 16 times)
    results = jax.jit(lambda v: [(lean(v), jax.grad(_weighted(lean))(v), reference(v.astype(jnp.float32)))
                                 for _, lean, reference in UNARY])(x)
    for (name, _, _), (y, g, ref) in zip(UNARY, results, strict=True):
        assert y.dtype == dtype and g.dtype == dtype, name
        np.testing.assert_allclose(y.astype(jnp.float32), ref, rtol=5e-2, atol=5e-2, err_msg=name)


@pytest.mark.parametrize("policy", ["nothing", pytest.param("dots", marks=pytest.mark.slow),
                                    pytest.param("everything", marks=pytest.mark.slow)])
def test_inside_checkpoint_gradients_are_unchanged(policy):
    x = _data()
    scale = jnp.linspace(0.5, 2, 16)

    def block(v, s):
        h = ops.layer_norm(v, s)
        return ops.softmax(ops.gelu(h) @ jnp.eye(16), where=MASK) * ops.tanh(ops.relu(h))

    # both gradients from one compiled program
    plain, ckpt = jax.jit(lambda v, s: (
        jax.grad(lambda v, s: jnp.sum(block(v, s) ** 2), argnums=(0, 1))(v, s),
        jax.grad(lambda v, s: jnp.sum(remat.checkpoint(block, v, s, policy=policy) ** 2), argnums=(0, 1))(v, s)))(
        x, scale)
    assert_trees_close(plain, ckpt, rtol=1e-6, atol=1e-6)


def test_vmap_and_scan_compose():
    x = _data()

    def loss(v):
        return jnp.sum(ops.gelu(ops.layer_norm(v)) ** 2)

    def scanned(v):
        return jax.lax.scan(lambda c, _: (ops.tanh(c), None), v, None, length=3)[0].sum()

    # the four gradients from one compiled program (one per gradient, a compile's fixed cost four times)
    per_row, whole, scan_grad, ref = jax.jit(lambda v: (
        jax.vmap(jax.grad(loss))(v), jax.grad(loss)(v), jax.grad(scanned)(v),
        jax.grad(lambda v: jnp.tanh(jnp.tanh(jnp.tanh(v))).sum())(v)))(x)
    np.testing.assert_allclose(per_row, whole, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scan_grad, ref, rtol=1e-6, atol=1e-6)


def test_relu_gradient_at_zero_is_zero_like_jax():
    x = jnp.array([-1.0, 0.0, 2.0])
    ours, theirs = jax.jit(lambda v: (jax.grad(lambda v: ops.relu(v).sum())(v),
                                      jax.grad(lambda v: jax.nn.relu(v).sum())(v)))(x)  # one program
    np.testing.assert_array_equal(ours, [0.0, 0.0, 1.0])
    np.testing.assert_array_equal(theirs, [0.0, 0.0, 1.0])


def test_layer_norm_rejects_mis_shaped_parameters():
    with pytest.raises(ValueError, match=r"scale \(8,\) and bias \(16,\) must both have shape \(16,\)"):
        ops.layer_norm(_data(), jnp.ones(8), jnp.zeros(16))

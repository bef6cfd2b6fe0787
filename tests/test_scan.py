"""remat.scan: scan over layers equals the unrolled loop, and its memory behaves."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from programs import (
    WIDE_X,
    assert_scan_matches_unrolled,
    assert_trees_close,
    layer,
    wide_layer,
    wide_params,
)
from programs import linen_block as _linen_block
from programs import nnx_block as _nnx_block
from programs import nnx_unrolled as _nnx_unrolled

from remat.analysis import compiled_memory
from remat.scan import (
    LinenScanLayers,
    best_segments,
    scan_layers,
    scan_nnx_layers,
    stack_nnx_layers,
)

POLICIES = [
    pytest.param("no_checkpoint", id="no_checkpoint"),
    pytest.param(None, id="None"),
    pytest.param("nothing", id="nothing"),
    pytest.param("dots", id="dots"),
    pytest.param(["pre"], id="names"),
    pytest.param(jax.checkpoint_policies.dots_with_no_batch_dims_saveable, id="callable"),
]
NESTING = [
    pytest.param({}, id="flat"),
    pytest.param({"nested": True}, id="nested"),
    pytest.param({"segments": 2}, id="segments2"),
]


def _normal(shape, scale=1.0, seed=0):
    """A float32 normal draw by NumPy, put on the device as it is (jax.random, run eagerly,
    compiles a program for each shape it draws)."""
    return jax.device_put((np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32))


def _ones(*shape):
    return jax.device_put(np.ones(shape, np.float32))  # jnp.ones compiles a program per shape


# Each nesting once in the fast suite, with a different policy; the rest of the matrix is slow.
FAST_PURE = {("flat", "None"), ("nested", "dots"), ("segments2", "names")}
PURE_CASES = [
    pytest.param(p.values[0], n.values[0], id=f"{n.id}-{p.id}",
                 marks=() if (n.id, p.id) in FAST_PURE else pytest.mark.slow)
    for n in NESTING for p in POLICIES
]


@pytest.mark.parametrize("policy,nesting", PURE_CASES)
def test_pure_gradients_equal_unrolled(policy, nesting):
    assert_scan_matches_unrolled(4, policy, nesting)


def test_pytree_carry():
    params = {"w": _normal((3, 8, 8), 0.5), "b": _normal((3, 8), 0.1, seed=1)}

    def two(p, h):
        a, b = h
        return layer(p, a), b + jnp.sum(a)

    def both(params, carry):  # the scan and the loop in one compiled program (eager, each operation compiles)
        ref = carry
        for i in range(3):
            ref = two(jax.tree.map(lambda a, i=i: a[i], params), ref)
        return scan_layers(two, params, carry), ref

    out, ref = jax.jit(both)(params, (_ones(2, 8), jax.device_put(np.float32(0))))
    assert_trees_close(out, ref)


def test_best_segments():
    assert [best_segments(n) for n in (1, 4, 8, 9, 12, 16, 64, 7)] == [1, 2, 2, 3, 3, 4, 8, 1]


def test_bad_inputs_are_clear_value_errors():
    # arrays made by NumPy (jnp.ones and jax.random compile a program per shape)
    params = {"w": _ones(4, 8, 8), "b": _ones(3, 8)}
    x = _ones(2, 8)
    with pytest.raises(ValueError, match=r"different leading \(layer\) axes: 4 \('w'\], 3 \['b'\]|different leading"):
        scan_layers(layer, params, x)
    four = {"w": _normal((4, 8, 8), 0.5), "b": _normal((4, 8), 0.1, seed=1)}
    with pytest.raises(ValueError, match=r"depth 4 is not divisible by segments=3; use one of \[1, 2, 4\]"):
        scan_layers(layer, four, x, segments=3)
    with pytest.raises(ValueError, match="segments must be a positive int"):
        scan_layers(layer, four, x, segments=0)
    with pytest.raises(ValueError, match="is a scalar"):
        scan_layers(layer, {"w": _ones()}, x)
    with pytest.raises(ValueError, match="no arrays"):
        scan_layers(layer, {}, x)
    with pytest.raises(ValueError, match="unknown policy"):
        scan_layers(layer, {"w": _normal((2, 8, 8), 0.5), "b": _normal((2, 8), 0.1, seed=1)}, x, policy="sometimes")


# ----------------------------------------------------------------------------- memory


def wide_shapes(depth):
    """The shapes of ``wide_params(depth)``: the compiled bytes depend on nothing else, and
    drawing the weights eagerly compiles a program per depth."""
    return jax.eval_shape(lambda: wide_params(depth))


@functools.lru_cache(maxsize=None)  # several tests share the same compilations
def scan_temp(depth, policy="nothing", nested=False):
    kw = {"policy": policy, "nested": nested}
    loss = lambda p, x: jnp.sum(scan_layers(wide_layer, p, x, **kw) ** 2)  # noqa: E731
    return compiled_memory(loss, wide_shapes(depth), WIDE_X).temp_bytes


def test_scan_checkpoint_far_below_unrolled_no_checkpoint():
    def loss(p, x):
        for i in range(8):
            x = wide_layer(jax.tree.map(lambda a, i=i: a[i], p), x)
        return jnp.sum(x ** 2)

    unrolled_none = compiled_memory(loss, wide_shapes(8), WIDE_X).temp_bytes
    scanned = scan_temp(8, policy="nothing")
    # Measured: 7.0 MiB vs 13.2 MiB (0.53); the rest is one layer's backward, a constant.
    assert scanned < 0.6 * unrolled_none, (scanned, unrolled_none)
    assert scan_temp(8, policy="no_checkpoint") > 2 * scanned  # the checkpoint is what saves it


def test_flat_scan_keeps_exactly_one_input_per_layer():
    flat = {n: scan_temp(n, policy="nothing") for n in (4, 16)}
    per_layer = (flat[16] - flat[4]) / 12
    # Measured: exactly one 512 KiB layer input per extra layer.
    assert abs(per_layer - WIDE_X.nbytes) < 0.1 * WIDE_X.nbytes, flat


def test_nested_memory_grows_like_sqrt_depth():
    flat = {n: scan_temp(n, policy="nothing") for n in (4, 16)}
    nested = {n: scan_temp(n, nested=True) for n in (4, 16)}
    # Theory: flat keeps N inputs (+12 from 4 to 16), nested k + N/k (4 -> 8: +4).
    # Measured 4 -> 16: flat 5.0 -> 11.0 MiB (2.2x), nested 5.1 -> 7.3 MiB (1.41x).
    assert nested[16] / nested[4] <= 1.6, nested
    assert nested[16] - nested[4] <= 0.45 * (flat[16] - flat[4]), (nested, flat)
    assert nested[16] < 0.75 * flat[16], (nested, flat)


@pytest.mark.slow
def test_nested_program_size_flat_in_depth():
    """One compiled layer whatever the depth: the optimized HLO does not grow with it
    (a structural stand-in for "compile time is flat in depth", which wall clocks measure
    unreliably on a shared machine)."""
    def hlo_instructions(depth):
        loss = lambda p, x: jnp.sum(scan_layers(wide_layer, p, x, nested=True) ** 2)  # noqa: E731
        text = jax.jit(jax.grad(loss)).lower(wide_params(depth), WIDE_X).compile().as_text()
        return sum(1 for line in text.splitlines() if " = " in line)

    small, large = hlo_instructions(4), hlo_instructions(64)
    assert large <= small + 10, (small, large)


# ----------------------------------------------------------------------------- Flax NNX


# the flat scan fast (test_scan_schedules has the grouped ones), the other cases slow
@pytest.mark.parametrize("policy,nesting", [
    pytest.param("nothing", {}, id="nothing-nesting0"),
    pytest.param("dots", {}, id="dots-nesting1", marks=pytest.mark.slow),
    pytest.param("no_checkpoint", {}, id="no_checkpoint-nesting2", marks=pytest.mark.slow),
    pytest.param("nothing", {"segments": 2}, id="nothing-nesting3", marks=pytest.mark.slow),
])
def test_nnx_gradients_equal_unrolled(policy, nesting):
    from flax import nnx

    layers = stack_nnx_layers(_nnx_block, 4, nnx.Rngs(0))
    assert layers.lin.kernel[...].shape == (4, 8, 8)
    # Layers are initialised independently.
    assert not np.allclose(layers.lin.kernel[...][0], layers.lin.kernel[...][1])
    x = _normal((3, 8), seed=2)

    scanned = nnx.grad(lambda m, x: jnp.sum(scan_nnx_layers(m, x, policy=policy, **nesting) ** 2))
    unrolled = nnx.grad(lambda m, x: jnp.sum(_nnx_unrolled(m, x, 4) ** 2))
    grads, ref = nnx.jit(lambda m, x: (scanned(m, x), unrolled(m, x)))(layers, x)  # one compile for both
    assert_trees_close(grads, ref)


def test_nnx_non_param_state_is_written_back():
    from flax import nnx

    def make(rngs):
        class Counting(nnx.Module):
            def __init__(self, rngs):
                self.lin = nnx.Linear(8, 8, rngs=rngs)
                self.calls = nnx.BatchStat(jnp.zeros(()))

            def __call__(self, x):
                self.calls[...] = self.calls[...] + 1
                return jnp.tanh(self.lin(x))

        return Counting(rngs)

    layers = stack_nnx_layers(make, 4, 0)
    y = scan_nnx_layers(layers, _ones(2, 8), segments=2)
    assert y.shape == (2, 8)
    np.testing.assert_array_equal(np.asarray(layers.calls[...]), np.ones(4))


def test_nnx_stack_rejects_bad_depth():
    with pytest.raises(ValueError, match="depth must be a positive int"):
        stack_nnx_layers(_nnx_block, 0, 0)


# ----------------------------------------------------------------------------- Flax Linen


# grouped fast (the flat scan: test_nnx_gradients_equal_unrolled); the other cases slow
@pytest.mark.parametrize("policy,nesting", [
    pytest.param("nothing", {}, id="nothing-nesting0", marks=pytest.mark.slow),
    pytest.param("dots", {}, id="dots-nesting1", marks=pytest.mark.slow),
    pytest.param("no_checkpoint", {}, id="no_checkpoint-nesting2", marks=pytest.mark.slow),
    pytest.param("nothing", {"segments": 2}, id="nothing-nesting3"),
])
def test_linen_gradients_equal_unrolled(policy, nesting):
    Block = _linen_block()
    model = LinenScanLayers(Block, depth=4, layer_kwargs={"features": 8}, policy=policy, **nesting)
    x = _normal((3, 8), seed=3)
    # the parameters' shapes from the init, traced; the arrays drawn by NumPy (the init, compiled,
    # is a program as large as the comparison's)
    shapes = jax.eval_shape(lambda x: model.init(jax.random.PRNGKey(0), x), x)
    rng = np.random.default_rng(0)
    variables = jax.tree.map(lambda s: jax.device_put((rng.standard_normal(s.shape) * 0.5).astype(s.dtype)), shapes)
    top = "groups" if nesting else "layers"
    kernel = variables["params"][top]["layers"]["Dense_0"]["kernel"] if nesting else \
        variables["params"]["layers"]["Dense_0"]["kernel"]
    assert kernel.shape == ((2, 2, 8, 8) if nesting else (4, 8, 8))
    flat_layers = jax.tree.map(  # regrouped by NumPy (a jax reshape, eager, compiles a program)
        lambda a: np.asarray(a).reshape(4, *a.shape[2:]) if nesting else a,
        variables["params"][top]["layers"] if nesting else variables["params"]["layers"],
    )

    def loss(params, x):
        return jnp.sum(model.apply({"params": params}, x) ** 2)

    def ref_loss(layer_params, x):
        block = Block(8)
        for i in range(4):
            x = block.apply({"params": jax.tree.map(lambda a, i=i: a[i], layer_params)}, x)
        return jnp.sum(x ** 2)

    # One jit for both sides: eager scans would compile every piece separately (slow).
    (value, g), (ref_value, ref_g) = jax.jit(lambda p, flat, x: (
        jax.value_and_grad(loss)(p, x), jax.value_and_grad(ref_loss)(flat, x)))(variables["params"], flat_layers, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    g_layers = g[top]["layers"] if nesting else g["layers"]
    g_layers = jax.tree.map(lambda a: np.asarray(a).reshape(4, *a.shape[2:]) if nesting else a, g_layers)
    assert_trees_close(g_layers, ref_g)


def test_linen_bad_segments():
    model = LinenScanLayers(_linen_block(), depth=4, segments=3)
    with pytest.raises(ValueError, match="not divisible by segments=3"):
        model.init(jax.random.PRNGKey(0), jnp.ones((2, 8)))

"""jax.checkpoint's contract, kept by remat.checkpoint: trace caching, Python scalars, prevent_cse."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close
from flax import nnx

import remat
from remat._core.trace_cache import SCALAR_VARIANTS_WARNING


class Counter:
    """A function that counts how often JAX traces (or Python runs) it."""

    def __init__(self, body=lambda x, *rest: jnp.sin(x)):
        self.calls = 0
        self.body = body

    def __call__(self, *args):
        self.calls += 1
        return self.body(*args)


def test_decorator_traces_once_for_ten_eager_calls():
    f = Counter()
    g = remat.checkpoint(f)
    for _ in range(10):
        g(jnp.ones(3)).block_until_ready()
    assert f.calls == 1


def test_decorator_with_static_argnums_traces_once():
    f = Counter(lambda x, n: jnp.sin(x) * n)
    g = remat.checkpoint(f, static_argnums=(1,))
    for _ in range(10):
        g(jnp.ones(3), 2)
    assert f.calls == 1
    g(jnp.ones(3), 3)  # a new static value is a new trace
    assert f.calls == 2


def test_call_form_traces_once_also_under_grad():
    f = Counter()
    for _ in range(10):
        remat.checkpoint(f, jnp.ones(3))
    assert f.calls == 1
    for _ in range(10):
        jax.grad(lambda x: remat.checkpoint(f, x).sum())(jnp.ones(3))
    assert f.calls == 1  # JAX's trace cache serves the grad's calls too


def test_new_shapes_retrace_and_outputs_keep_their_static_leaves():
    def f(x):
        return jnp.sin(x), x.shape[0], "tag"

    g = remat.checkpoint(f)
    for n in (2, 3, 2, 3):
        y, size, tag = g(jnp.ones(n))
        assert (y.shape, size, tag) == ((n,), n, "tag")


def test_nnx_module_and_method_trace_once():
    class Block(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
            self.calls = 0

        def forward(self, x):
            return self.lin(x)

    block = Block()
    f = Counter(lambda x: block.lin(x))
    for _ in range(10):
        remat.checkpoint(f, jnp.ones((2, 3)))
    assert f.calls == 1
    traced = []
    original = Block.forward

    def counting(self, x):
        traced.append(1)
        return original(self, x)

    Block.forward = counting
    try:
        for _ in range(10):
            remat.checkpoint(block.forward, jnp.ones((2, 3)))  # a new bound method each time
    finally:
        Block.forward = original
    assert len(traced) == 1


def test_decorator_traces_python_scalars_like_jax_checkpoint():
    f = Counter(lambda x, s: jnp.sin(x) * s)
    g = remat.checkpoint(f)
    for s in (0.5, 1.5, 2.5, 3.0):
        np.testing.assert_allclose(g(jnp.ones(2), s), np.sin(1.0) * s, rtol=1e-6)
    assert f.calls == 1  # a new value is not a new trace (weakly typed, as in jax.checkpoint)

    def branchy(x, flag):
        return jnp.sin(x) if flag else x

    with pytest.raises(jax.errors.TracerBoolConversionError):
        remat.checkpoint(branchy)(jnp.ones(2), True)
    with pytest.raises(jax.errors.TracerBoolConversionError):
        jax.checkpoint(branchy)(jnp.ones(2), True)
    np.testing.assert_allclose(remat.checkpoint(branchy, static_argnums=(1,))(jnp.ones(2), True), np.sin(1.0))


def test_call_form_passes_python_scalars_through_like_pytorch():
    def branchy(x, flag, p):
        return jnp.sin(x) if flag and p > 0.5 else x

    np.testing.assert_allclose(remat.checkpoint(branchy, jnp.ones(2), True, 0.7), np.sin(1.0))
    np.testing.assert_allclose(remat.checkpoint(branchy, jnp.ones(2), True, 0.2), 1.0)
    g = jax.grad(lambda x: remat.checkpoint(branchy, x, True, 0.7).sum())(jnp.ones(2))
    np.testing.assert_allclose(g, np.cos(1.0), rtol=1e-6)


def test_call_form_warns_when_changing_python_numbers_keep_retracing():
    def scaled(x, s):
        return jnp.sin(x) * s

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(SCALAR_VARIANTS_WARNING):
            remat.checkpoint(scaled, jnp.ones(2), float(i))
        assert not [w for w in caught if "Python number" in str(w.message)]
        for i in range(SCALAR_VARIANTS_WARNING, SCALAR_VARIANTS_WARNING + 5):
            remat.checkpoint(scaled, jnp.ones(2), float(i))
    messages = [str(w.message) for w in caught if "Python number" in str(w.message)]
    assert len(messages) == 1, messages  # once per function
    assert "jnp.asarray" in messages[0] and "decorator form" in messages[0]


def _loss(ws, x, layer):
    for w in ws:
        x = layer(w, x)
    return jnp.sum(x**2)


def test_prevent_cse_per_argument_tuple_as_in_jax():
    ws = [jnp.ones((3, 3)) * 0.1 for _ in range(2)]
    x = jnp.ones(3)
    layer = remat.checkpoint(lambda w, x: x @ w, prevent_cse=(False, True))
    plain = jax.grad(_loss, (0, 1))(ws, x, lambda w, x: x @ w)
    got = jax.grad(_loss, (0, 1))(ws, x, layer)
    assert_trees_close(got, plain, rtol=1e-6, atol=0)
    # jax's own test: the barrier holds exactly the arguments asked for, and the cotangent
    txt = jax.jit(jax.grad(_loss, (0, 1)), static_argnums=2).lower(ws, x, layer).as_text()
    assert "optimization_barrier %" in txt
    none = remat.checkpoint(lambda w, x: x @ w, prevent_cse=(False, False))
    txt = jax.jit(jax.grad(_loss, (0, 1)), static_argnums=2).lower(ws, x, none).as_text()
    compiled = jax.jit(jax.grad(_loss, (0, 1)), static_argnums=2).lower(ws, x, none).compile()
    assert " conditional(" not in compiled.as_text()


def test_prevent_cse_pytree_prefix_and_errors():
    layer = remat.checkpoint(lambda d: d["x"] @ d["W"], prevent_cse=({"W": False, "x": True},))
    g = jax.grad(lambda W: layer({"W": W, "x": jnp.ones(3)}).sum())(jnp.eye(3))
    np.testing.assert_allclose(g, np.ones((3, 3)))
    with pytest.raises(ValueError, match="prefix"):
        remat.checkpoint(lambda a, b: a + b, prevent_cse=(True,))(jnp.ones(2), jnp.ones(2))
    with pytest.raises(TypeError, match="prevent_cse"):
        remat.checkpoint(jnp.sin, prevent_cse="yes")


def test_no_checkpoint_is_one_spelling_accepted_by_every_form():
    from remat.policies import NO_CHECKPOINT, POLICY_NAMES, is_no_checkpoint, resolve_policy

    assert POLICY_NAMES[0] == NO_CHECKPOINT and "nothing" in POLICY_NAMES
    assert is_no_checkpoint(NO_CHECKPOINT) and not is_no_checkpoint("none") and not is_no_checkpoint(None)
    f = Counter(lambda x: jnp.sin(x) * 2.0)
    x = jnp.linspace(0.0, 1.0, 4)
    forms = {
        "call": (lambda x: remat.checkpoint(f, x, policy=NO_CHECKPOINT), 2 * np.sin(np.asarray(x))),
        "decorator": (lambda x: remat.checkpoint(f, policy=NO_CHECKPOINT)(x), 2 * np.sin(np.asarray(x))),
        "sequential": (lambda x: remat.checkpoint_sequential([f, f], 2, x, policy=NO_CHECKPOINT),
                       2 * np.sin(2 * np.sin(np.asarray(x)))),
    }
    for name, (form, expected) in forms.items():
        np.testing.assert_allclose(form(x), expected, rtol=1e-6, err_msg=name)
        jaxpr = jax.make_jaxpr(form)(x)
        assert not [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("checkpoint", "remat", "remat2")], name
    g = jax.grad(lambda x: remat.checkpoint(f, x, policy=NO_CHECKPOINT).sum())(x)
    np.testing.assert_allclose(g, 2 * np.cos(np.asarray(x)), rtol=1e-6)
    with pytest.raises(ValueError, match="not a JAX policy"):
        resolve_policy(NO_CHECKPOINT)


# --- The trace cache never serves a stale trace (issue 19) -------------------------------

def test_equal_scalars_of_different_types_get_their_own_traces():
    def f(x, flag):
        if isinstance(flag, bool):
            return jnp.sin(x) if flag else jnp.cos(x)
        return x * flag + 1.0

    x = jnp.ones(3)
    for value in (0, False, 0.0, 1, True, 1.0, 0, False):
        got = remat.checkpoint(f, x, value)
        want = f(x, value)
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-6)
        np.testing.assert_allclose(jax.grad(lambda x, v=value: remat.checkpoint(f, x, v).sum())(x),
                                   jax.grad(lambda x, v=value: f(x, v).sum())(x), rtol=1e-6)


def test_an_output_dtype_follows_the_scalar_type():
    def g(x, s):
        return jnp.full((2,), s)

    x = jnp.ones(3)
    for s in (1, 1.0, True, 1):
        assert remat.checkpoint(g, x, s).dtype == g(x, s).dtype


def test_static_argnums_tell_types_apart_as_jax_jit_does():
    f = Counter(lambda x, s: jnp.full(x.shape, s))
    g = remat.checkpoint(f, static_argnums=(1,))
    assert g(jnp.ones(2), 1).dtype == jnp.int32
    assert g(jnp.ones(2), 1.0).dtype == jnp.float32
    assert g(jnp.ones(2), True).dtype == jnp.bool_
    nested = remat.checkpoint(lambda x, pair: x * (2.0 if isinstance(pair[0], bool) else 3.0), static_argnums=(1,))
    np.testing.assert_allclose(nested(jnp.ones(1), (0, 1)), [3.0])
    np.testing.assert_allclose(nested(jnp.ones(1), (False, 1)), [2.0])
    assert f.calls == 3


def test_negative_zero_is_not_zero():
    def f(x, s):
        return x * jnp.copysign(1.0, s)

    x = jnp.ones(2)
    np.testing.assert_allclose(remat.checkpoint(f, x, 0.0), [1.0, 1.0])
    np.testing.assert_allclose(remat.checkpoint(f, x, -0.0), [-1.0, -1.0])


class _Layer:
    def __init__(self, w):
        self.w = w

    def fwd(self, x):
        return jnp.tanh(x @ self.w)


def test_bound_method_of_a_changed_object_is_traced_afresh():
    layer, x = _Layer(np.eye(3, dtype=np.float32)), jnp.ones((1, 3))
    remat.checkpoint(layer.fwd, x)
    jax.grad(lambda x: remat.checkpoint(layer.fwd, x).sum())(x)
    layer.w = 2 * np.eye(3, dtype=np.float32)
    np.testing.assert_allclose(remat.checkpoint(layer.fwd, x), jax.checkpoint(layer.fwd)(x), rtol=1e-6)
    np.testing.assert_allclose(remat.checkpoint(layer.fwd, x), layer.fwd(x), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda x: remat.checkpoint(layer.fwd, x).sum())(x),
                               jax.grad(lambda x: layer.fwd(x).sum())(x), rtol=1e-6)


def test_a_passed_object_hashed_by_identity_is_read_as_it_is_now():
    class Config:
        scale = 2.0

    def f(x, cfg):
        return x * cfg.scale

    cfg = Config()
    np.testing.assert_allclose(remat.checkpoint(f, jnp.ones(2), cfg), [2.0, 2.0])
    cfg.scale = 5.0
    np.testing.assert_allclose(remat.checkpoint(f, jnp.ones(2), cfg), [5.0, 5.0])


def test_a_frozen_value_object_is_keyed_by_value():
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Config:
        scale: float

    f = Counter(lambda x, cfg: x * cfg.scale)
    for scale in (2.0, 2.0, 3.0, 2.0):
        np.testing.assert_allclose(remat.checkpoint(f, jnp.ones(2), Config(scale)), [scale] * 2)
    assert f.calls == 2


def test_nnx_module_static_attributes_and_state_are_current():
    class Block(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
            self.scale = 2.0

        def __call__(self, x):
            return self.lin(x) * self.scale

    block, x = Block(), jnp.ones((1, 3))
    remat.checkpoint(block, x)
    block.scale = 3.0
    np.testing.assert_allclose(remat.checkpoint(block, x), block(x), rtol=1e-6)
    block.lin.kernel[...] = block.lin.kernel[...] * 2
    np.testing.assert_allclose(remat.checkpoint(block, x), block(x), rtol=1e-6)


def test_the_cache_holds_functions_weakly_as_jax_checkpoint_does():
    import gc
    import weakref

    from remat._core.trace_cache import REGIONS

    big = jnp.ones((64, 64))

    def make():
        def f(x):
            return jnp.sin(x) @ big
        return f

    functions = [make()]  # the only reference, so that dropping it can free the function
    jax.grad(lambda x: remat.checkpoint(functions[0], x).sum())(jnp.ones((2, 64)))
    before = len(REGIONS)
    alive = weakref.ref(functions[0])
    functions.clear()
    gc.collect()
    assert alive() is None  # neither remat's table nor JAX's trace cache keeps it
    assert len(REGIONS) < before

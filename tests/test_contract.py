"""jax.checkpoint's contract, kept by remat.checkpoint: trace caching, Python scalars, prevent_cse."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import remat
from remat._core.regions import SCALAR_VARIANTS_WARNING


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
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
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
    assert is_no_checkpoint(NO_CHECKPOINT) and is_no_checkpoint("none") and not is_no_checkpoint(None)
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

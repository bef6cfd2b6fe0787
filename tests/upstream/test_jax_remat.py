"""JAX's own ``RematTest`` (jax ``tests/api_test.py``), ported to call ``remat.checkpoint``.

Source: jax-ml/jax ``tests/api_test.py``, class ``RematTest`` (HEAD cec06d116c of the
mirror, whose tests are a superset of the jax-v0.10.2 tag's). Every ``jax.remat`` /
``jax.checkpoint`` of the original is ``remat.checkpoint`` here (the decorator form
``remat.checkpoint(f, policy=..., prevent_cse=..., static_argnums=...)``), with the same
computation and the same assertions. Where HEAD uses an API that jax 0.10.2 lacks
(``core.eval_jaxpr_p``), the jax-v0.10.2 version of that test is ported instead (said
above the test).

A few tests assert what JAX itself does only from some release on (``jax.checkpoint``
behaves the same way there); on an older JAX they are skipped by :func:`since_jax`.

``RematTest`` runs under ``jtu.with_config(jax_remat3=False)`` and ``JaxTestCase``'s
thread-local configuration; the autouse fixture below applies the same settings.
``assertAllClose`` is :func:`assert_all_close` (``numpy.testing`` with JAX's default
per-dtype tolerances: 1e-6 for float32).

The last test, :func:`test_import_safety_corpus`, is not from JAX: with remat imported,
``jax.checkpoint`` and ``remat.checkpoint`` (``prevent_cse`` True and False) inside
``lax.scan``/``fori_loop``/``while_loop``/``cond`` and under ``jit``/``vmap``/``grad``/
``jacfwd(grad)`` must give the un-checkpointed function's values and gradients.
"""
from __future__ import annotations

import functools
import logging
import re
import traceback
from contextlib import contextmanager
from functools import partial

import jax
import jax._src.util as jax_util
import jax.numpy as jnp
import numpy as np
import pytest
from jax import grad, lax
from jax._src import api, api_util, config, core, dtypes
from jax._src import linear_util as lu
from jax._src import test_util as jtu
from jax._src.ad_checkpoint import saved_residuals
from jax.ad_checkpoint import checkpoint_name
from jax.errors import TracerBoolConversionError, UnexpectedTracerError
from jax.interpreters import ad, batching

import remat

# ---------------------------------------------------------------------------------------
# The JaxTestCase environment
# ---------------------------------------------------------------------------------------

# jtu.JaxTestCase._default_thread_local_config, plus RematTest's @jtu.with_config.
_JAX_TEST_CONFIG = {
    "jax_enable_checks": True,
    "jax_numpy_dtype_promotion": "strict",
    "jax_numpy_rank_promotion": "raise",
    "jax_traceback_filtering": "off",
    "jax_legacy_prng_key": "error",
    **({"jax_remat3": False} if "jax_remat3" in config.config_states else {}),  # JAX 0.10.2+
}


def since_jax(version: tuple[int, ...], why: str):
    """Skips a test on JAX releases before ``version``, which lack the behaviour it asserts."""
    return pytest.mark.skipif(jax.__version_info__ < version,
                              reason=f"JAX {'.'.join(map(str, version))}+: {why}")


@pytest.fixture(autouse=True)
def _jax_test_case_config():
    with jtu.thread_local_config_context(**_JAX_TEST_CONFIG):
        yield
    assert core.reset_trace_state()  # JaxTestCase.tearDown


_TOLERANCE = {
    np.dtype(np.float16): 1e-3,
    np.dtype(dtypes.bfloat16): 1e-2,
    np.dtype(np.float32): 1e-6,
    np.dtype(np.float64): 1e-15,
    np.dtype(np.complex64): 1e-6,
    np.dtype(np.complex128): 1e-15,
}


def _canonical_dtype(x):
    return dtypes.canonicalize_dtype(jtu._dtype(x))


def assert_all_close(actual, desired, *, check_dtypes=True, atol=None, rtol=None):
    """``JaxTestCase.assertAllClose``: pytrees of arrays, JAX's default tolerances."""
    if isinstance(actual, dict):
        assert isinstance(desired, dict)
        assert set(actual) == set(desired)
        for k in actual:
            assert_all_close(actual[k], desired[k], check_dtypes=check_dtypes, atol=atol, rtol=rtol)
    elif isinstance(actual, (list, tuple)) and not hasattr(actual, "__array__"):
        assert isinstance(desired, (list, tuple)) and not hasattr(desired, "__array__"), desired
        assert len(actual) == len(desired)
        for a, d in zip(actual, desired):
            assert_all_close(a, d, check_dtypes=check_dtypes, atol=atol, rtol=rtol)
    elif hasattr(actual, "__array__") or np.isscalar(actual):
        assert hasattr(desired, "__array__") or np.isscalar(desired), desired
        if check_dtypes:
            assert _canonical_dtype(actual) == _canonical_dtype(desired), (
                f"dtypes differ: {_canonical_dtype(actual)} vs {_canonical_dtype(desired)}")
        a, d = np.asarray(actual), np.asarray(desired)
        tol = max(_TOLERANCE.get(a.dtype, 0), _TOLERANCE.get(d.dtype, 0))
        if a.dtype == dtypes.bfloat16 or d.dtype == dtypes.bfloat16:
            a, d = a.astype(np.float32), d.astype(np.float32)
        np.testing.assert_allclose(a, d, rtol=tol if rtol is None else rtol,
                                   atol=tol if atol is None else atol)
    else:
        assert actual == desired


# The named_parameters of the original, with remat.checkpoint for jax.remat/jax.checkpoint.
# ('', jax.remat), ('_policy', partial(jax.remat, policy=...)), ('_new', partial(jax.checkpoint, policy=...))
_never = lambda *_, **__: False  # noqa: E731
REMAT = pytest.param(remat.checkpoint, id="remat")
# '_policy' runs the same test with a never-saving callable policy (remat passes it to
# jax.checkpoint as it is; tests/test_policies.py checks callable policies in the default run):
# slow; the [remat] case, remat.checkpoint as users call it, stays fast
REMAT_POLICY = pytest.param(partial(remat.checkpoint, policy=_never), id="policy", marks=pytest.mark.slow)
# '_new' runs what '' and '_policy' run (jax.checkpoint is jax.remat today): the slow cases
REMAT_NEW_POLICY = pytest.param(partial(remat.checkpoint, policy=_never), id="new_policy", marks=pytest.mark.slow)
REMAT_NEW = pytest.param(remat.checkpoint, id="new", marks=pytest.mark.slow)
THREE = [REMAT, REMAT_POLICY, REMAT_NEW_POLICY]   # '', '_policy', '_new' (with policy)
TWO_POLICY = [REMAT, REMAT_POLICY]                # '', '_policy'
TWO_NEW = [REMAT, REMAT_NEW]                      # '', '_new'
# Both run remat.checkpoint (jax.remat and jax.checkpoint are one function today): the cases
# parametrized by them (order-2 check_grads, seconds on 2 cores) run once in the fast suite.
OLD_NEW = [pytest.param(remat.checkpoint, id="old_remat", marks=pytest.mark.slow),
           pytest.param(remat.checkpoint, id="new_remat")]


# ---------------------------------------------------------------------------------------
# RematTest
# ---------------------------------------------------------------------------------------

# jax tests/api_test.py RematTest.test_remat_basic
@pytest.mark.parametrize("remat_", TWO_POLICY)
def test_remat_basic(remat_):
    @remat_
    def g(x):
        return lax.sin(lax.sin(x)), 3.

    def f(x):
        x, _ = g(x)
        return x

    ans = f(2.)
    expected = np.sin(np.sin(2.))
    assert_all_close(ans, expected, check_dtypes=False)

    ans, f_lin = api.linearize(f, 2.)
    expected = np.sin(np.sin(2.))
    assert_all_close(ans, expected, check_dtypes=False)

    ans = f_lin(3.)
    expected = np.cos(np.sin(2.)) * np.cos(2.) * 3.
    assert_all_close(ans, expected, check_dtypes=False)

    sin_calls = []
    cos_calls = []
    sin_impl = lax.sin_p.impl
    cos_impl = lax.cos_p.impl
    try:
        lax.sin_p.def_impl(lambda x, **kwargs: sin_calls.append(1) or sin_impl(x, **kwargs))
        lax.cos_p.def_impl(lambda x, **kwargs: cos_calls.append(1) or cos_impl(x, **kwargs))
        f_lin(3.)
    finally:
        lax.sin_p.def_impl(sin_impl)
        lax.cos_p.def_impl(cos_impl)
    assert len(sin_calls) == 1
    assert len(cos_calls) == 2


# jax tests/api_test.py RematTest.test_remat_freevars
@pytest.mark.parametrize("remat_", TWO_POLICY)
def test_remat_freevars(remat_):
    def f1(x):
        y = 2 * jnp.sin(x)
        z = jnp.cos(x) * jnp.sin(y)
        return z

    def f2(x):
        y = 2 * jnp.sin(x)
        z = remat_(lambda x: jnp.cos(x) * jnp.sin(y))(x)
        return z

    ans, f_lin = api.linearize(f2, 2.)
    expected, f_lin_expected = api.linearize(f1, 2.)
    assert_all_close(ans, expected, check_dtypes=False)

    ans = f_lin(3.)
    expected = f_lin_expected(3.)
    assert_all_close(ans, expected, check_dtypes=False)


# jax tests/api_test.py RematTest.test_remat_grad_python_control_flow_static_argnums
@pytest.mark.skip(reason="@unittest.skip upstream (no reason given there)")
def test_remat_grad_python_control_flow_static_argnums():
    @partial(remat.checkpoint, static_argnums=(0,))
    def g(x):
        with jax.ensure_compile_time_eval():
            x_pos = x > 0
        if x_pos:
            return lax.sin(x), 3.
        else:
            return lax.cos(x), 4.

    def f(x):
        x, _ = g(x)
        return x

    ans = f(2.)
    expected = np.sin(2.)
    assert_all_close(ans, expected, check_dtypes=False)

    ans = api.grad(f)(2.)
    expected = np.cos(2.)
    assert_all_close(ans, expected, check_dtypes=False)


# jax tests/api_test.py RematTest.test_remat_grad_python_control_flow_unhashable_static_argnums
@pytest.mark.skip(reason="@unittest.skip upstream (no reason given there)")
def test_remat_grad_python_control_flow_unhashable_static_argnums():
    @partial(remat.checkpoint, static_argnums=(0,))
    def g(x):
        x = x.val
        with jax.ensure_compile_time_eval():
            x_pos = x > 0
        if x_pos:
            return lax.sin(x), 3.
        else:
            return lax.cos(x), 4.

    def f(x):
        x, _ = g(x)
        return x

    class A:
        def __init__(self, val):
            self.val = val

        def __hash__(self):
            raise TypeError

    ans = f(A(2.))
    expected = np.sin(2.)
    assert_all_close(ans, expected, check_dtypes=False)

    ans = api.grad(lambda x: f(A(x)))(2.)
    expected = np.cos(2.)
    assert_all_close(ans, expected, check_dtypes=False)


# jax tests/api_test.py RematTest.test_remat_retracing
def test_remat_retracing():
    # This is *not* a very important behavior; remat doesn't need to provide
    # caching guarantees with the same importance as jit. But even so, in the
    # interest of not redoing tracing work (and thus make jax.remat more
    # feasible to use in eager mode), this test checks that we don't re-trace
    # the remat-decorated function.
    count = 0

    @remat.checkpoint
    def g(x):
        nonlocal count
        count += 1
        return lax.sin(x), 3.

    def f(x):
        x, _ = g(x)
        return x

    for _ in range(10):
        y = f(2.)
        y.block_until_ready()
    assert count == 1


# jax tests/api_test.py RematTest.test_remat_static_agnums_retracing
def test_remat_static_agnums_retracing():
    # This is *not* a super important behavior; remat doesn't need to provide
    # caching guarantees with the same importance as jit. But even so, in the
    # interest of not redoing tracing work (and thus make jax.remat more
    # feasible to use in eager mode), this test checks that we don't re-trace
    # the remat-decorated function *even with static_argnums*. See also the
    # above test, which doesn't check for static_argnums.
    count = 0

    @partial(remat.checkpoint, static_argnums=(0,))
    def g(x):
        nonlocal count
        count += 1
        with jax.ensure_compile_time_eval():
            x_pos = x > 0
        if x_pos:
            return lax.sin(x), 3.
        else:
            return lax.cos(x), 4.

    def f(x):
        x, _ = g(x)
        return x

    for _ in range(10):
        y = f(2.)
        y.block_until_ready()
    assert count == 1


# jax tests/api_test.py RematTest.test_remat_jit
@pytest.mark.parametrize("remat_", THREE)
def test_remat_jit(remat_):
    @remat_
    def g(x):
        return lax.sin(lax.sin(x))

    def f_(x):
        return g(x)
    f = api.jit(f_)

    ans = f(2.)
    expected = np.sin(np.sin(2.))
    assert_all_close(ans, expected, check_dtypes=False)

    ans = api.grad(f)(2.)
    expected = np.cos(np.sin(2.)) * np.cos(2.)
    assert_all_close(ans, expected, check_dtypes=False)

    ans = api.jit(api.grad(f_))(2.)
    expected = np.cos(np.sin(2.)) * np.cos(2.)
    assert_all_close(ans, expected, check_dtypes=False)


# jax tests/api_test.py RematTest.test_remat_vmap
@pytest.mark.parametrize("remat_", THREE)
def test_remat_vmap(remat_):
    @remat_
    def g(x):
        return lax.sin(lax.sin(x))

    x = np.arange(3.)

    ans = api.vmap(g)(x)
    expected = np.sin(np.sin(x))
    assert_all_close(ans, expected, check_dtypes=False)

    ans = api.jacfwd(g)(x)
    expected = np.diag(np.cos(np.sin(x)) * np.cos(x))
    assert_all_close(ans, expected, check_dtypes=False)

    ans = api.jacrev(g)(x)
    expected = np.diag(np.cos(np.sin(x)) * np.cos(x))
    assert_all_close(ans, expected, check_dtypes=False)

    # Make sure that introducing constants in vmap works.
    constant_introducing_p = core.Primitive('introduce_constant')
    constant_introducing_p.def_abstract_eval(lambda x: x)

    def _constant_introducing_batcher(xs, ds):
        (x,), (d,) = xs, ds
        return (x + np.arange(x.size, dtype=x.dtype).reshape(x.shape)), d
    batching.primitive_batchers[constant_introducing_p] = _constant_introducing_batcher

    api.vmap(remat_(constant_introducing_p.bind))(jnp.ones(20))


# jax tests/api_test.py RematTest.test_remat_vmap_not_leading_dim
@pytest.mark.parametrize("remat_", THREE)
def test_remat_vmap_not_leading_dim(remat_):
    @remat_
    def g(x):
        return lax.sin(lax.sin(x))

    x = np.arange(3 * 5.).reshape(3, 5)

    ans = api.vmap(g, 1, 0)(x)
    expected = np.sin(np.sin(x)).T
    assert_all_close(ans, expected, check_dtypes=False)


# jax tests/api_test.py RematTest.test_remat_higher_order_autodiff
@pytest.mark.parametrize("remat_", THREE)
def test_remat_higher_order_autodiff(remat_):
    def f(x):
        return lax.cos(lax.sin(x))
    g = remat_(f)

    ans = api.grad(api.grad(g))(3.)
    expected = api.grad(api.grad(f))(3.)
    assert_all_close(ans, expected, check_dtypes=False)


# jax tests/api_test.py RematTest.test_remat_higher_order_ad_preserves_remat_primitive
@pytest.mark.parametrize("f", [
    pytest.param(lambda x: jnp.sin(jnp.sin(x)), id="basic"),
    pytest.param(lambda x: lax.cond(x > 0, jnp.sin, jnp.cos, x), id="cond"),
])
def test_remat_higher_order_ad_preserves_remat_primitive(f):
    g = remat.checkpoint(f)
    assert_all_close(api.grad(api.grad(g))(0.3),
                     api.grad(api.grad(f))(0.3), check_dtypes=False)
    jaxpr_text = str(jax.make_jaxpr(api.grad(api.grad(g)))(0.3))
    needle = 'RematTraced' if hasattr(config, "remat3") and config.remat3.value else 'remat2'
    assert needle in jaxpr_text


# jax tests/api_test.py RematTest.test_remat_scan
@pytest.mark.parametrize("remat_", TWO_NEW)
def test_remat_scan(remat_):
    to_scan = lambda c, x: (jnp.sin(c), None)  # noqa: E731

    def f_noremat(x):
        y, _ = lax.scan(to_scan, x, np.arange(3.))
        return y

    def f_yesremat(x):
        y, _ = lax.scan(remat_(to_scan), x, np.arange(3.))
        return y

    ans = f_yesremat(4.)
    expected = f_noremat(4.)
    assert_all_close(ans, expected, check_dtypes=False)

    ans = api.grad(f_yesremat)(4.)
    expected = api.grad(f_noremat)(4.)
    assert_all_close(ans, expected, check_dtypes=False)

    jaxpr = api.make_jaxpr(api.linearize(f_yesremat, 4.)[1])(1.)
    scan_eqn, = jaxpr.eqns
    assert ' cos ' in str(scan_eqn.params['jaxpr'])

    jaxpr = api.make_jaxpr(api.vjp(f_yesremat, 4.)[1])(1.)
    scan_eqn, = jaxpr.eqns
    assert ' cos ' in str(scan_eqn.params['jaxpr'])


# jax tests/api_test.py RematTest.test_remat_no_redundant_flops
@pytest.mark.parametrize("remat_", THREE)
def test_remat_no_redundant_flops(remat_):
    # see https://github.com/jax-ml/jax/pull/1749#issuecomment-558267584

    @api.jit
    def g(x):
        return f(2., x)

    @remat_
    def f(x, y):
        return jnp.sin(x) * y

    # We swap out sin_p's impl rule to count how many times it's invoked
    called = []
    sin_impl = lax.sin_p.impl
    try:
        lax.sin_p.def_impl(lambda x, **kwargs: called.append(1) or sin_impl(x, **kwargs))
        api.grad(g)(3.)
    finally:
        lax.sin_p.def_impl(sin_impl)
    num_calls = len(called)
    assert num_calls <= 1


# jax tests/api_test.py RematTest.test_remat_binomial_checkpointing
@pytest.mark.parametrize("remat_", THREE)
def test_remat_binomial_checkpointing(remat_):
    def binom_checkpoint(funs):
        if len(funs) == 1:
            return funs[0]
        else:
            f1 = binom_checkpoint(funs[:len(funs)//2])
            f2 = binom_checkpoint(funs[len(funs)//2:])
            return remat_(lambda x: f1(f2(x)))

    f1 = binom_checkpoint([jnp.sin, jnp.sin, jnp.sin, jnp.sin])
    f2 = lambda x: jnp.sin(jnp.sin(jnp.sin(jnp.sin(x))))  # noqa: E731
    x = 4.
    assert_all_close(f1(x), f2(x), check_dtypes=False)
    assert_all_close(api.grad(f1)(x), api.grad(f2)(x), check_dtypes=False)


# jax tests/api_test.py RematTest.test_remat_symbolic_zeros
@pytest.mark.parametrize("remat_", TWO_NEW)
def test_remat_symbolic_zeros(remat_):
    # code from https://github.com/jax-ml/jax/issues/1907

    key = jax.random.key(0)
    key, split = jax.random.split(key)
    n = 5

    def func(D0):
        def shift(R, dR, **unused_kwargs):
            return R + dR

        def apply_fn(R):
            return D0 * R

        Rinit = jax.random.uniform(split, (n, 3), minval=0.0, maxval=5.0,
                                   dtype=jnp.float32)

        def move(R, i):
            F = apply_fn(R)
            return shift(R, 0.001 * F), jnp.array([0.])

        move = remat_(move)
        R, temp = lax.scan(move, Rinit, jnp.arange(2))
        return R[0, 0]

    api.grad(func)(5.0)  # doesn't crash


# jax tests/api_test.py RematTest.test_remat_jit2
@pytest.mark.parametrize("remat_", THREE)
def test_remat_jit2(remat_):
    @api.jit
    def f(x):
        y = 2 * x

        @remat_
        def g():
            return y

        return g()

    assert_all_close(f(3), 6, check_dtypes=False)


# jax tests/api_test.py RematTest.test_remat_nontrivial_env
@pytest.mark.parametrize("remat_", TWO_NEW)
def test_remat_nontrivial_env(remat_):
    # simplified from https://github.com/jax-ml/jax/issues/2030

    @remat_
    def foo(state, dt=0.5, c=1):
        u, u_t = state
        u_tt = c**2 * u
        u_t = u_t + u_tt * dt
        return (u, u_t)

    @api.jit(static_argnums=(1,))
    def _multi_step(state, count, dt, c):
        f = lambda s, _: (foo(s, dt, c), _)  # noqa: E731
        return lax.scan(f, state, None, count)

    def multi_step(state, count, dt=1/jnp.sqrt(2), c=1):  # noqa: B008
        return _multi_step(state, count, dt, c)

    def loss(u0, target, steps, dt=1/jnp.sqrt(2), c=1):  # noqa: B008
        init = (u0, jnp.zeros_like(u0))
        (uf, _), _ = multi_step(init, steps, dt, c)
        return ((uf - target) ** 2).mean()

    target = jnp.zeros((128, 128))
    u0 = jnp.ones_like(target)
    loss(u0, target, 10)  # doesn't crash


# jax tests/api_test.py RematTest.test_remat_jit3
@pytest.mark.parametrize("remat_", THREE)
def test_remat_jit3(remat_):
    # https://github.com/jax-ml/jax/issues/2180
    def f(w, x):
        a = jnp.dot(x, w)
        b = jnp.einsum("btd,bTd->btT", a, a)
        c = jnp.einsum("btT,btd->btd", b, a)
        return jnp.sum(c)

    w = jnp.ones([1, 1])
    x = jnp.ones([1, 1, 1])
    f = remat_(f)
    api.grad(f)(w, x)  # doesn't crash

    @api.jit
    def mul(a, b):
        return a * b

    def f(w, x):
        a = mul(w, x)
        b = mul(a, a)
        return b

    w = 1.
    x = 1.
    f = remat_(f)
    api.grad(f)(w, x)  # doesn't crash


# jax tests/api_test.py RematTest.test_remat_scan2
@pytest.mark.parametrize("remat_", TWO_NEW)
def test_remat_scan2(remat_):
    # https://github.com/jax-ml/jax/issues/1963

    def scan_bug(x0):
        f = lambda x, _: (x + 1, None)  # noqa: E731

        def scanned_f(x, _):
            return lax.scan(f, x, xs=None, length=1)[0], None
        x, _ = remat_(scanned_f)(x0, None)
        return x

    jax.grad(scan_bug)(1.0)  # doesn't crash


# jax tests/api_test.py RematTest.test_remat_jit_static_argnum_omnistaging
# (the jax-v0.10.2 version: HEAD's uses core.eval_jaxpr_p, absent from jax 0.10.2; like
# upstream's, this test no longer calls remat at all, see its NOTE)
@since_jax((0, 9, 2), "core.call_p.bind(subfuns=...)")
def test_remat_jit_static_argnum_omnistaging():
    # https://github.com/jax-ml/jax/issues/2833
    # NOTE(mattjj): after #3370, this test doesn't actually call remat...
    def named_call(f):
        def named_f(*args):
            my_f = lambda: (f(*args),)  # noqa: E731
            f_ = lu.wrap_init(
                my_f, debug_info=api_util.debug_info("test_remat", my_f, (), {}))
            out, = core.call_p.bind(subfuns=(f_,))
            return out
        return named_f

    def f(a_bool, y):
        if a_bool:
            return y + 1
        else:
            return y

    api.jit(named_call(f), static_argnums=0)(True, 1)  # no crash


# jax tests/api_test.py RematTest.test_remat_eval_counter
# (the jax-v0.10.2 version of its `call` helper: HEAD's uses core.eval_jaxpr_p, absent
# from jax 0.10.2)
@since_jax((0, 9, 2), "lu.wrap_init(...).in_type of a jaxpr's avals")
def test_remat_eval_counter():
    # https://github.com/jax-ml/jax/issues/2737
    add_one_p = core.Primitive('add_one')
    add_one = add_one_p.bind

    num_evals = 0

    @contextmanager
    def assertEvals(n):
        start = num_evals
        yield
        assert num_evals - start == n

    def add_one_impl(x):
        nonlocal num_evals
        num_evals += 1
        return x + 1
    add_one_p.def_impl(add_one_impl)

    def add_one_jvp(pin, tin):
        pout = add_one(pin[0])
        return pout, pout * tin[0]
    ad.primitive_jvps[add_one_p] = add_one_jvp

    add_one_p.def_abstract_eval(lambda x: x)

    v = np.zeros((1,))

    f = remat.checkpoint(add_one)
    g = remat.checkpoint(lambda x: add_one(f(x)))

    # 2 calls needed to evaluate g
    with assertEvals(2):
        _, vjp = jax.vjp(g, v)
    # 2 calls made while transposing g, 1 call made while transposing f
    with assertEvals(3):
        vjp(v)

    @jax_util.curry
    def call(f, *args):
        my_f = lambda *args: [f(*args)]  # noqa: E731
        sub = lu.wrap_init(
            my_f, debug_info=api_util.debug_info("test_remat", my_f, args, {}))
        return core.call(*args, name='foo', subfuns=(sub,))[0]

    f = call(add_one)
    g = remat.checkpoint(lambda x: add_one(f(x)))

    # 2 calls needed to evaluate g
    with assertEvals(2):
        _, vjp = jax.vjp(g, v)
    # 2 calls made while transposing g, no reevaluation for transposition of f
    with assertEvals(2):
        vjp(v)


# jax tests/api_test.py RematTest.test_remat_recursive_checkpoint_recompute_counts
def test_remat_recursive_checkpoint_recompute_counts():
    add_one_p = core.Primitive('add_one')
    num_evals = 0

    def add_one_impl(x):
        nonlocal num_evals
        num_evals += 1
        return x + 1
    add_one_p.def_impl(add_one_impl)
    add_one_p.def_abstract_eval(lambda x: x)

    def add_one_jvp(pin, tin):
        pout = add_one_p.bind(pin[0])
        return pout, pout * tin[0]
    ad.primitive_jvps[add_one_p] = add_one_jvp

    def recursive_checkpoint(funs):
        if len(funs) == 1:
            return funs[0]
        elif len(funs) == 2:
            f1, f2 = funs
            return lambda x: f1(f2(x))
        else:
            f1 = recursive_checkpoint(funs[:len(funs)//2])
            f2 = recursive_checkpoint(funs[len(funs)//2:])
            return lambda x: f1(remat.checkpoint(f2)(x))

    for n, expected_bwd_evals in [(4, 2), (8, 8), (16, 24)]:
        f = recursive_checkpoint([add_one_p.bind] * n)
        num_evals = 0
        _, vjp = jax.vjp(f, np.ones(()))
        assert num_evals == n
        num_evals = 0
        vjp(np.ones(()))
        assert num_evals == expected_bwd_evals


# jax tests/api_test.py RematTest.test_escaped_tracer_remat
@pytest.mark.parametrize("remat_", THREE)
def test_escaped_tracer_remat(remat_):
    # b/169779185
    def f():
        seq = [jnp.zeros([])]

        def g():
            seq[0] += 1  # this is line 7 btw
            return seq[0]

        remat_(g)()
        remat_(lambda: g())()  # lambda defeats caching

    with pytest.raises(UnexpectedTracerError, match="global state"):
        api.jit(f)()


# jax tests/api_test.py RematTest.test_no_cse_widget_on_primals
@pytest.mark.parametrize("remat_", THREE)
def test_no_cse_widget_on_primals(remat_):
    @remat_
    def g(x):
        return lax.sin(lax.sin(x)), 3.

    def f(x):
        x, _ = g(x)
        return x

    text = jax.jit(f).lower(2.).as_text('hlo')
    assert 'while' not in text
    assert 'conditional' not in text
    assert 'opt-barrier' not in text

    text = jax.jit(grad(f)).lower(2.).as_text('hlo')
    assert ('while' in text or 'conditional' in text
            or 'opt-barrier' in text)


# jax tests/api_test.py RematTest.test_no_cse_widget_with_prevent_cse_false
@pytest.mark.parametrize("remat_", TWO_NEW)
def test_no_cse_widget_with_prevent_cse_false(remat_):
    @partial(remat_, prevent_cse=False)
    def g(x):
        return lax.sin(lax.sin(x)), 3.

    def f(x):
        x, _ = g(x)
        return x

    text = jax.jit(f).lower(2.).as_text('hlo')
    assert 'while' not in text
    assert 'conditional' not in text

    text = jax.jit(grad(f)).lower(2.).as_text('hlo')
    assert 'while' not in text
    assert 'conditional' not in text


# jax tests/api_test.py RematTest.test_remat_custom_policy
@pytest.mark.parametrize("policy,in_jaxpr2,not_in_jaxpr2", [
    pytest.param(jax.checkpoint_policies.everything_saveable, [], [' sin ', ' cos '],
                 id="save_anything_new_remat", marks=pytest.mark.slow),  # order-2 check_grads: slow
    pytest.param(None, [' sin ', ' cos '], [], id="save_nothing_new_remat", marks=pytest.mark.slow),
    pytest.param(jax.checkpoint_policies.save_only_these_names('sin'), [' cos '], [' sin '],
                 id="save_sin_new_remat"),
])
def test_remat_custom_policy(policy, in_jaxpr2, not_in_jaxpr2):
    remat_ = remat.checkpoint
    sin = lambda x: checkpoint_name(jnp.sin(x), 'sin')  # noqa: E731
    for square in [lambda x: x * x, api.jit(lambda x: x * x)]:
        f = remat_(lambda x: sin(square(sin(x))), policy=policy)  # noqa: B023
        y, f_lin = api.linearize(f, 1.)
        ydot = f_lin(2.)
        jaxpr_text = str(f_lin.func.args[0])
        for substr in in_jaxpr2:
            assert substr in jaxpr_text
        for substr in not_in_jaxpr2:
            assert substr not in jaxpr_text
        y_expected, ydot_expected = api.jvp(lambda x: sin(square(sin(x))),  # noqa: B023
                                            [1.], [2.])
        assert_all_close(y, y_expected)
        assert_all_close(ydot, ydot_expected)
        jtu.check_grads(f, (3.,), order=2, modes=['fwd', 'rev'])


# jax tests/api_test.py RematTest.test_remat_custom_policy_save_cos
def test_remat_custom_policy_save_cos():
    save_cos = lambda prim, *_, **__: str(prim) == 'cos'  # noqa: E731
    f = remat.checkpoint(lambda x: jnp.sin(jnp.sin(x)),  # different function
                         policy=save_cos)
    _, f_lin = api.linearize(f, 1.)
    jaxpr_text = str(f_lin.func.args[0])
    assert ' sin ' not in jaxpr_text
    assert ' cos ' not in jaxpr_text
    jtu.check_grads(f, (3.,), order=2, modes=['fwd', 'rev'])


# jax tests/api_test.py RematTest.test_remat_checkpoint_dots
@pytest.mark.parametrize("remat_", OLD_NEW)
def test_remat_checkpoint_dots(remat_):
    @partial(remat_, policy=jax.checkpoint_policies.checkpoint_dots)
    def f(x):
        x = jnp.dot(x, x, precision=lax.Precision.HIGHEST)
        x = jnp.sin(x)
        x = jnp.dot(x, x, precision=lax.Precision.HIGHEST)
        x = jnp.sin(x)
        x = jnp.dot(x, x, precision=lax.Precision.HIGHEST)
        x = jnp.sin(x)
        return x

    _, f_lin = api.linearize(f, jnp.ones((2, 2)))
    jaxpr_text = str(f_lin.func.args[0])
    assert jaxpr_text.count(' sin ') == 2
    assert jaxpr_text.count(' dot_') == 6
    jtu.check_grads(f, (jnp.ones((2, 2)),), order=2, modes=['fwd', 'rev'])


# jax tests/api_test.py RematTest.test_remat_checkpoint_dots_with_no_batch_dims
@pytest.mark.parametrize("remat_", OLD_NEW)
def test_remat_checkpoint_dots_with_no_batch_dims(remat_):
    @partial(remat_, policy=jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims)
    def f(x):
        x = jnp.einsum('ij,jk->ik', x, x, precision=lax.Precision.HIGHEST)
        x = jnp.sin(x)
        x = jnp.einsum('ij,jk->ik', x, x, precision=lax.Precision.HIGHEST)
        x = jnp.sin(x)
        x = jnp.einsum('ij,jk->ik', x, x, precision=lax.Precision.HIGHEST)
        x = jnp.sin(x)
        return x

    _, f_lin = api.linearize(f, jnp.ones((2, 2)))
    jaxpr_text = str(f_lin.func.args[0])
    assert jaxpr_text.count(' sin ') == 2
    assert jaxpr_text.count(' dot_general') == 6
    jtu.check_grads(f, (jnp.ones((2, 2)),), order=2, modes=['fwd', 'rev'])


# jax tests/api_test.py RematTest.test_remat_checkpoint_dots_with_no_batch_dims2
@pytest.mark.parametrize("remat_", OLD_NEW)
def test_remat_checkpoint_dots_with_no_batch_dims2(remat_):
    @partial(remat_, policy=jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims)
    def f(x):
        x = jnp.einsum('nij,njk->nik', x, x, precision=lax.Precision.HIGHEST)
        x = jnp.sin(x)
        x = jnp.einsum('nij,njk->nik', x, x, precision=lax.Precision.HIGHEST)
        x = jnp.sin(x)
        x = jnp.einsum('nij,njk->nik', x, x, precision=lax.Precision.HIGHEST)
        x = jnp.sin(x)
        return x

    _, f_lin = api.linearize(f, jnp.ones((3, 2, 2)))
    jaxpr_text = str(f_lin.func.args[0])
    assert jaxpr_text.count(' sin ') == 2
    assert jaxpr_text.count(' dot_general') == 9
    jtu.check_grads(f, (jnp.ones((3, 2, 2)),), order=2, modes=['fwd', 'rev'])


# jax tests/api_test.py RematTest.test_remat_checkpoint_dots_jit
@pytest.mark.slow  # order-2 check_grads / many compiles: seconds on 2 cores
@pytest.mark.parametrize("remat_", [pytest.param(remat.checkpoint, id="old_remat")])
def test_remat_checkpoint_dots_jit(remat_):
    @api.jit
    @partial(remat_, policy=jax.checkpoint_policies.checkpoint_dots)
    def f(x):
        x = jnp.dot(x, x, precision=lax.Precision.HIGHEST)
        x = jnp.sin(x * 1e-3)
        x = jnp.dot(x, x, precision=lax.Precision.HIGHEST)
        x = jnp.sin(x * 1e-3)
        x = jnp.dot(x, x, precision=lax.Precision.HIGHEST)
        x = jnp.sin(x * 1e-3)
        return x

    _, f_lin = api.linearize(f, jnp.ones((2, 2)))
    jaxpr_text = str(f_lin.func.args[0])
    assert jaxpr_text.count(' sin ') == 2
    assert jaxpr_text.count(' dot_') == 6
    jtu.check_grads(f, (jnp.ones((2, 2)),), order=2, modes=['fwd', 'rev'])


# jax tests/api_test.py RematTest.test_remat_checkpoint_dots_inside_scan
@pytest.mark.slow  # order-2 check_grads / many compiles: seconds on 2 cores
def test_remat_checkpoint_dots_inside_scan():
    x = jnp.ones((5,))

    def f(W):
        @partial(remat.checkpoint, policy=jax.checkpoint_policies.checkpoint_dots)
        def f(x):
            x = jnp.sin(jnp.dot(x, W, precision=lax.Precision.HIGHEST))
            x = jnp.sin(jnp.dot(x, W, precision=lax.Precision.HIGHEST))
            x = jnp.sin(jnp.dot(x, W, precision=lax.Precision.HIGHEST))
            return x

        def body(x, _): return f(x), None
        return lax.scan(body, x, None, length=2)[0]

    y, f_vjp = api.vjp(f, jnp.ones((5, 5)))
    jaxpr_text = str(jax.make_jaxpr(f_vjp)(y))

    # Two sine calls in the backward pass because while we don't save sines
    # within the (rematted) body function, we can save the scan carry, which
    # effectively saves one sine. Three cosines for the Jacobian coefficients.
    assert jaxpr_text.count(' sin ') == 2
    assert jaxpr_text.count(' cos ') == 3
    # Six calls to dot_general in the backward pass because we save the primal
    # matmuls and only compure the backward pass ones (two for each primal one).
    assert jaxpr_text.count(' dot_') == 6

    jtu.check_grads(api.jit(f), (jnp.ones((5, 5)),), order=2,
                    modes=['fwd', 'rev'])


# jax tests/api_test.py RematTest.test_remat_custom_jvp_policy
@pytest.mark.slow  # order-2 check_grads / many compiles: seconds on 2 cores
def test_remat_custom_jvp_policy():
    @jax.custom_jvp
    def sin(x):
        return jnp.sin(x)

    def sin_jvp(primals, tangents):
        x, = primals
        g, = tangents
        return sin(x), jnp.cos(x) * g
    sin.defjvp(sin_jvp)

    @partial(remat.checkpoint, policy=jax.checkpoint_policies.checkpoint_dots)
    def f(x):
        x = jnp.dot(x, x, precision=lax.Precision.HIGHEST)
        x = sin(x * 1e-3)
        x = jnp.dot(x, x, precision=lax.Precision.HIGHEST)
        x = sin(x * 1e-3)
        x = jnp.dot(x, x, precision=lax.Precision.HIGHEST)
        x = sin(x * 1e-3)
        return x

    jtu.check_grads(f, (3.,), order=2, modes=['fwd', 'rev'])

    def g(x):
        return lax.scan(lambda x, _: (f(x), None), x, None, length=2)[0]
    jtu.check_grads(g, (3.,), order=2, modes=['fwd', 'rev'])


# jax tests/api_test.py RematTest.test_remat_custom_vjp_policy
@pytest.mark.slow  # order-2 check_grads / many compiles: seconds on 2 cores
def test_remat_custom_vjp_policy():
    @jax.custom_vjp
    def sin(x):
        return jnp.sin(x)

    def sin_fwd(x):
        return sin(x), x

    def sin_bwd(x, y_bar):
        return (jnp.cos(x) * y_bar,)
    sin.defvjp(sin_fwd, sin_bwd)

    @partial(remat.checkpoint, policy=jax.checkpoint_policies.checkpoint_dots)
    def f(x):
        @partial(api.named_call, name="dot")
        def dot2(y, z):
            return jnp.dot(x, jnp.dot(y, z, precision=lax.Precision.HIGHEST),
                           precision=lax.Precision.HIGHEST)

        x = dot2(x, x)
        x = sin(x * 1e-3)
        x = dot2(x, x)
        x = sin(x * 1e-3)
        x = dot2(x, x)
        x = sin(x * 1e-3)
        return x

    jtu.check_grads(f, (3.,), order=2, modes=['rev'])

    def g(x):
        return lax.scan(lambda x, _: (f(x), None), x, None, length=2)[0]
    jtu.check_grads(g, (3.,), order=2, modes=['rev'])


# jax tests/api_test.py RematTest.test_remat_dropvar_policy
@pytest.mark.parametrize("remat_", OLD_NEW)
def test_remat_dropvar_policy(remat_):
    def f(x):
        return x, x

    @partial(remat_, policy=jax.checkpoint_policies.checkpoint_dots)
    def g(x):
        x = api.grad(lambda x: f(x)[0])(x)
        return x

    api.grad(g)(3.)


# jax tests/api_test.py RematTest.test_remat_custom_jvp_linear_policy
@pytest.mark.slow  # order-2 check_grads / many compiles: seconds on 2 cores
def test_remat_custom_jvp_linear_policy():
    @jax.custom_jvp
    def sum(x):
        return jnp.sum(x, axis=0)

    @sum.defjvp
    def sum_jvp(primals, tangents):
        (x,), (xdot,) = primals, tangents
        return sum(x), sum(xdot)

    @partial(remat.checkpoint, policy=jax.checkpoint_policies.checkpoint_dots)
    def f(x):
        return sum(x)
    jtu.check_grads(f, (jnp.ones(3),), order=2, modes=['fwd', 'rev'])

    def g(x):
        return lax.scan(lambda _, x: (None, f(x)), None, x)[1]
    jtu.check_grads(g, (jnp.ones((2, 3)),), order=2, modes=['fwd', 'rev'])


# jax tests/api_test.py RematTest.test_constants_not_hoisted
def test_constants_not_hoisted():
    # The old implementation of remat worked by data dependence, and so
    # (potentially large) constants would not be rematerialized and could be
    # wastefully instantiated. This test checks that the newer remat
    # implementation avoids that. See https://github.com/jax-ml/jax/pull/8191.

    # no residuals from constants created inside jnp.einsum
    @partial(remat.checkpoint, policy=lambda *_, **__: False)
    def f(x):
        return jnp.einsum('ii->i', x)
    res_avals = saved_residuals(f, jnp.ones((2, 2)))
    assert len(res_avals) == 0

    # no residuals from jnp.zeros
    @partial(remat.checkpoint, policy=lambda *_, **__: False)
    def f(x):
        return jnp.zeros_like(x) * x
    res_avals = saved_residuals(f, jnp.ones((2, 2)))
    assert len(res_avals) == 0

    # no residuals from jnp.zeros, but input must be saved
    @partial(remat.checkpoint, policy=lambda *_, **__: False)
    def f(x):
        return jnp.zeros_like(x) * jnp.sin(x)
    res_avals = saved_residuals(f, jnp.ones((2, 2)))
    assert len(res_avals) == 1


# jax tests/api_test.py RematTest.test_name_saveable_input
@since_jax((0, 10, 2), "saved_residuals looks through reduce_precision")
def test_name_saveable_input():
    policy = jax.checkpoint_policies.save_only_these_names('foo')

    @partial(remat.checkpoint, policy=policy)
    def f(x):
        x = checkpoint_name(jnp.dot(x, x), 'foo')
        x = jnp.dot(x, x)
        return x

    res = saved_residuals(f, jnp.ones((3, 3)))
    assert res[1][1].startswith("named 'foo'")


# jax tests/api_test.py RematTest.test_name_pytree
@since_jax((0, 10, 2), "saved_residuals looks through reduce_precision")
def test_name_pytree():
    policy = jax.checkpoint_policies.save_only_these_names('foo')

    @partial(remat.checkpoint, policy=policy)
    def f(x):
        x = checkpoint_name({'a': jnp.dot(x, x)}, 'foo')['a']
        x = jnp.dot(x, x)
        return x

    res = saved_residuals(f, jnp.ones((3, 3)))
    assert res[1][1].startswith("named 'foo'")


# jax tests/api_test.py RematTest.test_name_denylist
def test_name_denylist():
    def f(x):
        y = checkpoint_name(jnp.multiply(2., 2.), 'y')
        z = checkpoint_name(jnp.multiply(2., 2.), 'z')
        w = checkpoint_name(jnp.multiply(2., 2.), 'w')
        u = jnp.multiply(2., 2.)
        return (((x * y) * z) * w) * u

    policy = jax.checkpoint_policies.save_any_names_but_these('y', 'z', 'w')
    res = saved_residuals(remat.checkpoint(f, policy=policy), 1.)
    assert len(res) == 0  # can't save anything

    policy = jax.checkpoint_policies.save_any_names_but_these('z', 'w')
    res = saved_residuals(remat.checkpoint(f, policy=policy), 1.)
    assert len(res) == 1  # can save only y

    policy = jax.checkpoint_policies.save_any_names_but_these('w')
    res = saved_residuals(remat.checkpoint(f, policy=policy), 1.)
    assert len(res) == 2  # can save y and z

    policy = jax.checkpoint_policies.save_any_names_but_these()
    res = saved_residuals(remat.checkpoint(f, policy=policy), 1.)
    assert len(res) == 3  # can save y, z, and w


# jax tests/api_test.py RematTest.test_name_allowlist
def test_name_allowlist():
    def f(x):
        y = checkpoint_name(jnp.multiply(2., 2.), 'y')
        z = checkpoint_name(jnp.multiply(2., 2.), 'z')
        w = checkpoint_name(jnp.multiply(2., 2.), 'w')
        u = jnp.multiply(2., 2.)
        return (((x * y) * z) * w) * u

    policy = jax.checkpoint_policies.save_only_these_names('y', 'z', 'w')
    res = saved_residuals(remat.checkpoint(f, policy=policy), 1.)
    assert len(res) == 3  # can save y, z, and w

    policy = jax.checkpoint_policies.save_only_these_names('z', 'w')
    res = saved_residuals(remat.checkpoint(f, policy=policy), 1.)
    assert len(res) == 2  # can save z and w

    policy = jax.checkpoint_policies.save_only_these_names('w')
    res = saved_residuals(remat.checkpoint(f, policy=policy), 1.)
    assert len(res) == 1  # can save w

    policy = jax.checkpoint_policies.save_only_these_names()
    res = saved_residuals(remat.checkpoint(f, policy=policy), 1.)
    assert len(res) == 0  # can't save anything!


# jax tests/api_test.py RematTest.test_checkpoint_name_vmap
def test_checkpoint_name_vmap():
    def f(x):
        y = checkpoint_name(x * 2., 'y')
        return y + 1.

    policy = jax.checkpoint_policies.save_only_these_names('y')
    f_remat = remat.checkpoint(f, policy=policy)
    f_vmapped = jax.vmap(f_remat)

    x = jnp.arange(6.).reshape(2, 3)
    y_expected = f(x)
    y_actual = f_vmapped(x)
    assert_all_close(y_expected, y_actual, check_dtypes=False)

    grad_actual = jax.grad(lambda a: jnp.sum(f_vmapped(a)))(x)
    assert_all_close(grad_actual, jnp.full_like(x, 2.), check_dtypes=False)


# jax tests/api_test.py RematTest.test_saved_residuals_utility
# (no checkpoint in the upstream test either: it checks jax's saved_residuals, with remat imported)
def test_saved_residuals_utility():
    def f(x, y):
        x1, x2 = x
        z = checkpoint_name(jnp.sin(3.), 'z')
        return z * ((x1 * x2) * y) * np.array([3.])

    res = saved_residuals(f, (2., 3.), y=4.)
    assert len(res) == 6
    assert res[0][0].shape == (1,)
    if config.use_simplified_jaxpr_constants.value:
        assert res[0][1] == "from a literal"
    else:
        assert res[0][1] == "from a constant"
    assert res[1][0].shape == ()
    assert res[1][1] == "from the argument x[0]"
    assert res[2][0].shape == ()
    assert res[2][1] == "from the argument x[1]"
    assert res[3][0].shape == ()
    assert res[3][1] == "from the argument y"
    assert res[4][0].shape == ()
    assert res[4][1].startswith("named 'z'")
    assert res[5][0].shape == ()


# jax tests/api_test.py RematTest.test_saved_residuals_utility_jit
# (no checkpoint in the upstream test either: it checks jax's saved_residuals, with remat imported)
def test_saved_residuals_utility_jit():
    @jax.jit
    def f(x, y):
        x1, x2 = x
        z = checkpoint_name(jnp.sin(3.), 'z')
        return z * ((x1 * x2) * y) * np.array([3.])

    res = saved_residuals(f, (2., 3.), y=4.)
    assert len(res) == 6
    if config.use_simplified_jaxpr_constants.value:
        assert res[0][1] == "from the argument x[0]"
        assert res[0][0].shape == ()
        assert res[1][1] == "from the argument x[1]"
        assert res[1][0].shape == ()
        assert res[2][1] == "from the argument y"
        assert res[2][0].shape == ()
        assert res[3][1].startswith("output of jitted function 'f'")
        assert res[3][0].shape == ()
        assert res[4][1].startswith("output of jitted function 'f'")
        assert res[4][0].shape == ()
        assert res[5][1].startswith("output of jitted function 'f'")
        assert res[5][0].shape == (1,)
    else:
        assert res[0][1] == "from a constant"
        assert res[0][0].shape == (1,)
        assert res[1][1] == "from the argument x[0]"
        assert res[1][0].shape == ()
        assert res[2][1] == "from the argument x[1]"
        assert res[2][0].shape == ()
        assert res[3][1] == "from the argument y"
        assert res[4][0].shape == ()
        assert res[4][1].startswith("output of jitted function 'f'")
        assert res[4][0].shape == ()
        assert res[5][1].startswith("output of jitted function 'f'")
        assert res[5][0].shape == ()


# jax tests/api_test.py RematTest.test_checkpoint_dropvars
@pytest.mark.parametrize("remat_", THREE)
def test_checkpoint_dropvars(remat_):
    @remat_
    def f(x):
        _, x = api.jit(lambda: (x, x))()
        return x

    _ = api.grad(f)(3.)  # doesn't crash


# jax tests/api_test.py RematTest.test_dce_keeps_eqns_with_used_outputs_but_no_used_inputs
def test_dce_keeps_eqns_with_used_outputs_but_no_used_inputs():
    @remat.checkpoint
    def f(x):
        c = jax.jit(lambda: 3.)()
        return c * x

    _ = jax.grad(f)(3.)  # doesn't crash


# jax tests/api_test.py RematTest.test_linearize_caching
def test_linearize_caching():
    # https://github.com/jax-ml/jax/issues/9661
    identity = remat.checkpoint(jax.jit(lambda x: 2 * x))
    _, f_lin = jax.linearize(identity, 1.)
    with jtu.count_jit_and_pmap_lowerings() as count:  # noqa: F841
        for _ in range(20):
            f_lin(1.).block_until_ready()
    assert count() == 1  # cached after first execution


# jax tests/api_test.py RematTest.test_vjp_caching
def test_vjp_caching():
    # https://github.com/jax-ml/jax/issues/9661
    identity = remat.checkpoint(jax.jit(lambda x: 2 * x))
    _, f_vjp = jax.vjp(identity, 1.)
    with jtu.count_pjit_cpp_cache_miss() as count:  # noqa: F841
        for _ in range(20):
            f_vjp(1.)[0].block_until_ready()
    assert count() <= 2


# jax tests/api_test.py RematTest.test_vjp_caching_static_argnums
def test_vjp_caching_static_argnums():
    identity = remat.checkpoint(lambda x, y: jax.jit(lambda x: 2 * x if y else x)(x),
                                static_argnums=(1,))
    _, f_vjp = jax.vjp(lambda x: identity(x, True), 1.)
    with jtu.count_jit_and_pmap_lowerings() as count:  # noqa: F841
        for _ in range(20):
            f_vjp(1.)[0].block_until_ready()
    assert count() <= 2


# jax tests/api_test.py RematTest.test_fwd_caching
def test_fwd_caching():
    # see above test also
    identity = remat.checkpoint(jax.jit(lambda x: 2 * x))
    with jtu.count_jit_and_pmap_lowerings() as count:  # noqa: F841
        for _ in range(20):
            y, _ = jax.vjp(identity, 1.)
            y.block_until_ready()
    assert count() == 1


# jax tests/api_test.py RematTest.test_fwd_caching_static_argnums
def test_fwd_caching_static_argnums():
    # see above test also
    identity = remat.checkpoint(jax.jit(lambda x: 2 * x), static_argnums=(0,))
    with jtu.count_jit_and_pmap_lowerings() as count:  # noqa: F841
        for _ in range(20):
            y = identity(1.)
            y.block_until_ready()
    assert count() == 1


# jax tests/api_test.py RematTest.test_remat_of_scan
@pytest.mark.parametrize("remat_", TWO_NEW)
def test_remat_of_scan(remat_):
    to_scan = lambda c, _: (jnp.sin(c), jnp.sin(c))  # noqa: E731
    f = lambda x: lax.scan(to_scan, x, None, length=3)  # noqa: E731
    jtu.check_grads(remat_(f), (3.,), order=2, modes=['rev'])

    jaxpr = api.make_jaxpr(api.linearize(remat_(f), 4.)[1])(1.)
    print("debug jaxpr: ", str(jaxpr))
    assert ' sin ' in str(jaxpr)
    assert ' cos ' in str(jaxpr)


# jax tests/api_test.py RematTest.test_remat_of_scan_unused_extensive_output_grad
def test_remat_of_scan_unused_extensive_output_grad():
    # The scanned-over output `b` is unused by the differentiated function, so
    # its cotangent is a symbolic zero with the stacked aval; the scan
    # transpose must handle it.
    def f(c, a):
        b = jnp.sin(a).sum() + jnp.sin(c).sum()
        return jnp.sin(c * b), b

    g = remat.checkpoint(partial(lax.scan, f),
                         policy=jax.checkpoint_policies.nothing_saveable)
    c = jnp.arange(4.) / 4.
    as_ = jnp.arange(15.).reshape(5, 3) / 15.

    ans = api.grad(lambda c, as_: g(c, as_)[0].sum())(c, as_)
    expected = api.grad(lambda c, as_: lax.scan(f, c, as_)[0].sum())(c, as_)
    assert_all_close(ans, expected, check_dtypes=False)


# jax tests/api_test.py RematTest.test_remat_of_jit_residual_forwarding
@since_jax((0, 9, 1), "residuals of a nested jit forwarded")
def test_remat_of_jit_residual_forwarding():
    policy = jax.checkpoint_policies.save_only_these_names('y')

    @partial(remat.checkpoint, policy=policy)
    def f(x):
        y = checkpoint_name(jnp.sin(jnp.ones(2, 'float32')), 'y')
        x = jax.jit(lambda: x * y)()
        x = jax.jit(lambda: x * y)()
        return x

    res = saved_residuals(f, jnp.float32(3.))
    assert len(res) == 1

    ans = api.grad(lambda x: f(x).sum())(jnp.float32(3.))
    assert_all_close(ans, 2 * np.sin(1.) ** 2, check_dtypes=False)


# jax tests/api_test.py RematTest.test_remat_offload_names_jaxpr
def test_remat_offload_names_jaxpr():
    # Jaxpr-level check of save_and_offload_only_these_names: offloaded values
    # are device_put to the offload destination on the fwd pass and saved
    # there, then device_put back on the bwd pass. (Execution needs a device
    # with memory kinds; see tests/memories_test.py.)
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=['y'], names_which_can_be_offloaded=['z', 'w'],
        offload_src='device', offload_dst='pinned_host')

    @partial(remat.checkpoint, policy=policy)
    def f(x):
        y = checkpoint_name(jnp.sin(x), 'y')
        z = checkpoint_name(jnp.sin(y), 'z')
        w = checkpoint_name(jnp.sin(z), 'w')
        return jnp.sum(w * z)

    jaxpr_text = str(api.make_jaxpr(api.grad(f))(jnp.arange(16.)))
    assert jaxpr_text.count('MemorySpace.Host') == 2
    assert jaxpr_text.count('MemorySpace.Device') == 2

    with pytest.raises(ValueError,
                       match="The names should be exclusive and should not intersect"):
        jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=['y'], names_which_can_be_offloaded=['y'],
            offload_src='device', offload_dst='pinned_host')


# jax tests/api_test.py RematTest.test_remat_offload_names_of_scan_jaxpr
def test_remat_offload_names_of_scan_jaxpr():
    # Like test_remat_offload_names_jaxpr, but with the named values inside a
    # scan body: the per-iteration offloaded copies are saved as stacked
    # host-space residuals.
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=['y'], names_which_can_be_offloaded=['z', 'w'],
        offload_src='device', offload_dst='pinned_host')

    @partial(remat.checkpoint, policy=policy)
    def f(x):
        def g(y, _):
            y = checkpoint_name(jnp.sin(y), 'y')
            z = checkpoint_name(jnp.sin(y), 'z')
            w = checkpoint_name(jnp.sin(z), 'w')
            return w, jnp.sum(w * z)
        _, out = lax.scan(g, x, None, length=3)
        return jnp.sum(out)

    jaxpr_text = str(api.make_jaxpr(api.grad(f))(jnp.arange(16.)))
    assert jaxpr_text.count('MemorySpace.Host') == 2
    assert jaxpr_text.count('MemorySpace.Device') == 2
    assert '<host>[3,16]' in jaxpr_text  # stacked host residuals


# jax tests/api_test.py RematTest.test_remat_offload_dot_with_no_batch_dims_jaxpr
def test_remat_offload_dot_with_no_batch_dims_jaxpr():
    # Jaxpr-level check of offload_dot_with_no_batch_dims: outputs of dots
    # without batch dimensions are device_put to the offload destination on
    # the fwd pass and saved there, then device_put back on the bwd pass;
    # dots with batch dimensions are rematerialized as usual.
    policy = jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        'device', 'pinned_host')

    @partial(remat.checkpoint, policy=policy)
    def f(x, b):
        x = jnp.einsum('ij,jk->ik', x, x)      # offloaded
        b = jnp.einsum('bij,bjk->bik', b, b)   # batch dims: not offloaded
        x = jnp.sin(x)
        return jnp.sum(x) + jnp.sum(jnp.sin(b))

    jaxpr_text = str(api.make_jaxpr(api.grad(f))(jnp.ones((4, 4)),
                                                 jnp.ones((2, 4, 4))))
    assert jaxpr_text.count('MemorySpace.Host') == 1
    assert jaxpr_text.count('MemorySpace.Device') == 1


# jax tests/api_test.py RematTest.test_const_in_jvp_scan
@pytest.mark.parametrize("remat_", TWO_NEW)
def test_const_in_jvp_scan(remat_):
    @jax.custom_jvp
    def f(x):
        return x * jnp.arange(3.)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (xdot,) = primals, tangents
        return f(x), xdot * jnp.arange(3.)

    @remat_
    def g(x):
        def body(c, _):
            return f(c), None
        y, _ = jax.lax.scan(body, x, None, length=1)
        return y.sum()

    jax.grad(g)(jnp.arange(3.))  # doesn't crash


# jax tests/api_test.py RematTest.test_remat_checkpoint_dots_outside_scan
@pytest.mark.slow  # order-2 check_grads / many compiles: seconds on 2 cores
def test_remat_checkpoint_dots_outside_scan():
    # see also above test test_remat_checkpoint_dots_inside_scan
    x = jnp.ones((5,))

    @partial(remat.checkpoint, policy=jax.checkpoint_policies.checkpoint_dots)
    def f(W):
        def f(x):
            x = jnp.sin(jnp.dot(x, W, precision=lax.Precision.HIGHEST))
            x = jnp.sin(jnp.dot(x, W, precision=lax.Precision.HIGHEST))
            x = jnp.sin(jnp.dot(x, W, precision=lax.Precision.HIGHEST))
            return x

        def body(x, _): return f(x), None
        return lax.scan(body, x, None, length=2)[0]

    y, f_vjp = api.vjp(f, jnp.ones((5, 5)))
    jaxpr_text = str(jax.make_jaxpr(f_vjp)(y))

    assert jaxpr_text.count(' sin ') == 3
    assert jaxpr_text.count(' cos ') == 3
    # Six calls to dot_general in the backward pass because we save the primal
    # matmuls and only compute the backward pass ones (two for each primal one).
    assert jaxpr_text.count(' dot_') == 6

    jtu.check_grads(api.jit(f), (jnp.ones((5, 5)),), order=2,
                    modes=['fwd', 'rev'])


# jax tests/api_test.py RematTest.test_remat_of_scan_policy
def test_remat_of_scan_policy():
    save_cos = lambda prim, *_, **__: str(prim) == 'cos'  # noqa: E731
    to_scan = lambda c, _: (jnp.sin(c), jnp.sin(c))  # noqa: E731
    f = remat.checkpoint(lambda x: lax.scan(to_scan, x, None, length=3),
                         policy=save_cos)
    jtu.check_grads(f, (3.,), order=2, modes=['rev'])

    jaxpr = api.make_jaxpr(api.linearize(f, 4.)[1])(1.)
    jaxpr_text = str(jaxpr)
    assert jaxpr_text.count(' sin ') == 0
    assert jaxpr_text.count(' cos ') == 0


# jax tests/api_test.py RematTest.test_remat_of_scan_funky_custom_jvp
@pytest.mark.slow  # order-2 check_grads / many compiles: seconds on 2 cores
def test_remat_of_scan_funky_custom_jvp():
    def scan_apply(f, x):
        y, _ = lax.scan(lambda x, _: (f(x), None), x, None, length=1)
        return y

    @jax.custom_jvp
    def sin(x):
        return jnp.sin(x)

    def sin_jvp(primals, tangents):
        x, = primals
        xdot, = tangents
        y, c = jax.jit(lambda: (jnp.sin(x), jnp.cos(x)))()
        ydot = c * xdot
        return y, ydot
    sin.defjvp(sin_jvp)

    save_cos = lambda prim, *_, **__: str(prim) == 'cos'  # noqa: E731
    f = remat.checkpoint(partial(scan_apply, sin), policy=save_cos)
    jtu.check_grads(f, (3.,), order=2, modes=['rev'])
    jaxpr = api.make_jaxpr(api.linearize(f, 4.)[1])(1.)
    jaxpr_text = str(jaxpr)
    assert jaxpr_text.count(' sin ') == 0
    assert jaxpr_text.count(' cos ') == 0

    save_sin = lambda prim, *_, **__: str(prim) == 'sin'  # noqa: E731
    f = remat.checkpoint(partial(scan_apply, sin), policy=save_sin)
    jtu.check_grads(f, (3.,), order=2, modes=['rev'])
    jaxpr = api.make_jaxpr(api.linearize(f, 4.)[1])(1.)
    jaxpr_text = str(jaxpr)
    assert jaxpr_text.count(' sin ') == 0
    assert jaxpr_text.count(' cos ') == 1

    f = remat.checkpoint(partial(scan_apply, sin),
                         policy=jax.checkpoint_policies.everything_saveable)
    jtu.check_grads(f, (3.,), order=2, modes=['rev'])
    jaxpr = api.make_jaxpr(api.linearize(f, 4.)[1])(1.)
    jaxpr_text = str(jaxpr)
    assert jaxpr_text.count(' sin ') == 0
    assert jaxpr_text.count(' cos ') == 0

    f = remat.checkpoint(partial(scan_apply, sin),
                         policy=jax.checkpoint_policies.nothing_saveable)
    jtu.check_grads(f, (3.,), order=2, modes=['rev'])
    jaxpr = api.make_jaxpr(api.linearize(f, 4.)[1])(1.)
    jaxpr_text = str(jaxpr)
    assert jaxpr_text.count(' sin ') == 1  # +1 b/c dce fixed point
    assert jaxpr_text.count(' cos ') == 1

    f = remat.checkpoint(lambda x: scan_apply(sin, scan_apply(sin, x)),
                         policy=jax.checkpoint_policies.nothing_saveable)
    jtu.check_grads(f, (3.,), order=2, modes=['rev'])
    jaxpr = api.make_jaxpr(api.linearize(f, 4.)[1])(1.)
    jaxpr_text = str(jaxpr)
    assert jaxpr_text.count(' sin ') == 2  # +1 b/c dce fixed point
    assert jaxpr_text.count(' cos ') == 2


# jax tests/api_test.py RematTest.test_remat_of_scan_funky_custom_jvp2
@pytest.mark.slow  # order-2 check_grads / many compiles: seconds on 2 cores
def test_remat_of_scan_funky_custom_jvp2():
    # Like the above test but instead of using jit inside custom_jvp, use scan.

    def scan_apply(f, x):
        y, _ = lax.scan(lambda x, _: (f(x), None), x, None, length=1)
        return y

    @jax.custom_jvp
    def sin(x):
        return jnp.sin(x)

    def sin_jvp(primals, tangents):
        x, = primals
        xdot, = tangents
        y, c = scan_apply(lambda xs: (jnp.sin(xs[0]), jnp.cos(xs[1])), (x, x))
        ydot = c * xdot
        return y, ydot
    sin.defjvp(sin_jvp)

    save_cos = lambda prim, *_, **__: str(prim) == 'cos'  # noqa: E731
    f = remat.checkpoint(partial(scan_apply, sin), policy=save_cos)
    jtu.check_grads(f, (3.,), order=2, modes=['rev'])
    jaxpr = api.make_jaxpr(api.linearize(f, 4.)[1])(1.)
    jaxpr_text = str(jaxpr)
    assert jaxpr_text.count(' sin ') == 1  # +1 b/c dce fixed point
    assert jaxpr_text.count(' cos ') == 0

    save_sin = lambda prim, *_, **__: str(prim) == 'sin'  # noqa: E731
    f = remat.checkpoint(partial(scan_apply, sin), policy=save_sin)
    jtu.check_grads(f, (3.,), order=2, modes=['rev'])
    jaxpr = api.make_jaxpr(api.linearize(f, 4.)[1])(1.)
    jaxpr_text = str(jaxpr)
    assert jaxpr_text.count(' sin ') == 0
    assert jaxpr_text.count(' cos ') == 1

    f = remat.checkpoint(partial(scan_apply, sin),
                         policy=jax.checkpoint_policies.everything_saveable)
    jtu.check_grads(f, (3.,), order=2, modes=['rev'])
    jaxpr = api.make_jaxpr(api.linearize(f, 4.)[1])(1.)
    jaxpr_text = str(jaxpr)
    assert jaxpr_text.count(' sin ') == 0
    assert jaxpr_text.count(' cos ') == 0

    f = remat.checkpoint(partial(scan_apply, sin),
                         policy=jax.checkpoint_policies.nothing_saveable)
    jtu.check_grads(f, (3.,), order=2, modes=['rev'])
    jaxpr = api.make_jaxpr(api.linearize(f, 4.)[1])(1.)
    jaxpr_text = str(jaxpr)
    assert jaxpr_text.count(' sin ') == 1  # +1 b/c dce fixed point
    assert jaxpr_text.count(' cos ') == 1

    f = remat.checkpoint(lambda x: scan_apply(sin, scan_apply(sin, x)),
                         policy=jax.checkpoint_policies.nothing_saveable)
    jtu.check_grads(f, (3.,), order=2, modes=['rev'])
    jaxpr = api.make_jaxpr(api.linearize(f, 4.)[1])(1.)
    jaxpr_text = str(jaxpr)
    assert jaxpr_text.count(' sin ') == 2  # +1 b/c dce fixed point
    assert jaxpr_text.count(' cos ') == 2


# jax tests/api_test.py RematTest.test_remat_of_cond
@pytest.mark.slow  # order-2 check_grads / many compiles: seconds on 2 cores
@pytest.mark.parametrize("remat_", TWO_NEW)
def test_remat_of_cond(remat_):
    true_fn = lambda c: (jnp.sin(c), jnp.sin(c))  # noqa: E731
    false_fn = lambda c: (jnp.sin(c), jnp.sin(c))  # noqa: E731
    f = lambda x: lax.cond(x > 0., true_fn, false_fn, x)  # noqa: E731
    jtu.check_grads(remat_(f), (3.,), order=2, modes=['rev'])

    jaxpr = api.make_jaxpr(api.linearize(remat_(f), 4.)[1])(1.)
    assert ' sin ' not in str(jaxpr)
    assert ' cos ' in str(jaxpr)

    true_fn = lambda c: jnp.sin(jnp.sin(c))  # noqa: E731
    false_fn = lambda c: c  # noqa: E731
    f = lambda x: lax.cond(x > 0., true_fn, false_fn, x)  # noqa: E731
    jtu.check_grads(remat_(f), (3.,), order=2, modes=['rev'])

    jaxpr = api.make_jaxpr(api.linearize(remat_(f), 4.)[1])(1.)
    assert ' sin ' in str(jaxpr)
    assert ' cos ' in str(jaxpr)


# jax tests/api_test.py RematTest.test_const_in_jvp_cond
@pytest.mark.parametrize("remat_", TWO_NEW)
def test_const_in_jvp_cond(remat_):
    @jax.custom_jvp
    def f(x):
        return x * jnp.arange(3.)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (xdot,) = primals, tangents
        return f(x), xdot * jnp.arange(3.)

    @remat_
    def g(x):
        y = jax.lax.cond(x.sum() > 0, f, lambda x: x, x)
        return y.sum()

    jax.grad(g)(jnp.arange(3.))  # doesn't crash


# jax tests/api_test.py RematTest.test_remat_checkpoint_dots_inside_cond
@pytest.mark.slow  # order-2 check_grads / many compiles: seconds on 2 cores
def test_remat_checkpoint_dots_inside_cond():
    x = jnp.ones((5,))

    @partial(remat.checkpoint, policy=jax.checkpoint_policies.checkpoint_dots)
    def f(W):
        def f(x):
            x = jnp.sin(jnp.dot(x, W, precision=lax.Precision.HIGHEST))
            x = jnp.sin(jnp.dot(x, W, precision=lax.Precision.HIGHEST))
            x = jnp.sin(jnp.dot(x, W, precision=lax.Precision.HIGHEST))
            return x

        return lax.cond(x.sum() > 0, f, lambda x: x, x)

    y, f_vjp = api.vjp(f, jnp.ones((5, 5)))
    jaxpr_text = str(jax.make_jaxpr(f_vjp)(y))

    assert jaxpr_text.count(' sin ') == 2
    assert jaxpr_text.count(' cos ') == 3
    # Five calls to dot_general in the backward pass because we have two for
    # each forward-pass dot, except for the first which only has one (as we are
    # differentiating with respect to only W and not x).
    assert jaxpr_text.count(' dot_') == 5

    jtu.check_grads(api.jit(f), (jnp.ones((5, 5)),), order=2,
                    modes=['fwd', 'rev'])


# jax tests/api_test.py RematTest.test_remat_checkpoint_dots_outside_cond
@pytest.mark.slow  # order-2 check_grads / many compiles: seconds on 2 cores
def test_remat_checkpoint_dots_outside_cond():
    # see also above test test_remat_checkpoint_dots_inside_cond
    # The behavior between the two tests is essentially identical, whereas for
    # scan different things are saved based on this difference in remat
    # placement (because of the carry).
    x = jnp.ones((5,))

    @partial(remat.checkpoint, policy=jax.checkpoint_policies.checkpoint_dots)
    def f(W):
        def f(x):
            x = jnp.sin(jnp.dot(x, W, precision=lax.Precision.HIGHEST))
            x = jnp.sin(jnp.dot(x, W, precision=lax.Precision.HIGHEST))
            x = jnp.sin(jnp.dot(x, W, precision=lax.Precision.HIGHEST))
            return x

        return lax.cond(x.sum() > 0, f, lambda x: x, x)

    y, f_vjp = api.vjp(f, jnp.ones((5, 5)))
    jaxpr_text = str(jax.make_jaxpr(f_vjp)(y))

    assert jaxpr_text.count(' sin ') == 2
    assert jaxpr_text.count(' cos ') == 3
    assert jaxpr_text.count(' dot_') == 5

    jtu.check_grads(api.jit(f), (jnp.ones((5, 5)),), order=2,
                    modes=['fwd', 'rev'])


# jax tests/api_test.py RematTest.test_remat_of_cond_policy
def test_remat_of_cond_policy():
    save_cos = lambda prim, *_, **__: str(prim) == 'cos'  # noqa: E731
    f = remat.checkpoint(lambda x: lax.cond(x > 0, jnp.sin, lambda x: x, x),
                         policy=save_cos)
    jtu.check_grads(f, (3.,), order=2, modes=['rev'])

    jaxpr = api.make_jaxpr(api.linearize(f, 4.)[1])(1.)
    jaxpr_text = str(jaxpr)
    assert jaxpr_text.count(' sin ') == 0
    assert jaxpr_text.count(' cos ') == 0


# jax tests/api_test.py RematTest.test_remat_of_cond_funky_custom_jvp
@pytest.mark.slow  # order-2 check_grads / many compiles: seconds on 2 cores
def test_remat_of_cond_funky_custom_jvp():
    def cond_apply(f, x):
        return lax.cond(x.sum() > -jnp.inf, f, lambda x: x, x)

    @jax.custom_jvp
    def sin(x):
        return jnp.sin(x)

    def sin_jvp(primals, tangents):
        x, = primals
        xdot, = tangents
        y, c = jax.jit(lambda: (jnp.sin(x), jnp.cos(x)))()
        ydot = c * xdot
        return y, ydot
    sin.defjvp(sin_jvp)

    save_cos = lambda prim, *_, **__: str(prim) == 'cos'  # noqa: E731
    f = remat.checkpoint(partial(cond_apply, sin), policy=save_cos)
    jtu.check_grads(f, (3.,), order=2, modes=['rev'])
    jaxpr = api.make_jaxpr(api.linearize(f, 4.)[1])(1.)
    jaxpr_text = str(jaxpr)
    assert jaxpr_text.count(' sin ') == 0
    assert jaxpr_text.count(' cos ') == 0

    save_sin = lambda prim, *_, **__: str(prim) == 'sin'  # noqa: E731
    f = remat.checkpoint(partial(cond_apply, sin), policy=save_sin)
    jtu.check_grads(f, (3.,), order=2, modes=['rev'])
    jaxpr = api.make_jaxpr(api.linearize(f, 4.)[1])(1.)
    jaxpr_text = str(jaxpr)
    assert jaxpr_text.count(' sin ') == 0
    assert jaxpr_text.count(' cos ') == 1

    f = remat.checkpoint(partial(cond_apply, sin),
                         policy=jax.checkpoint_policies.everything_saveable)
    jtu.check_grads(f, (3.,), order=2, modes=['rev'])
    jaxpr = api.make_jaxpr(api.linearize(f, 4.)[1])(1.)
    jaxpr_text = str(jaxpr)
    assert jaxpr_text.count(' sin ') == 0
    assert jaxpr_text.count(' cos ') == 0

    f = remat.checkpoint(partial(cond_apply, sin),
                         policy=jax.checkpoint_policies.nothing_saveable)
    jtu.check_grads(f, (3.,), order=2, modes=['rev'])
    jaxpr = api.make_jaxpr(api.linearize(f, 4.)[1])(1.)
    jaxpr_text = str(jaxpr)
    assert jaxpr_text.count(' sin ') == 0
    assert jaxpr_text.count(' cos ') == 1

    f = remat.checkpoint(lambda x: cond_apply(sin, cond_apply(sin, x)),
                         policy=jax.checkpoint_policies.nothing_saveable)
    jtu.check_grads(f, (3.,), order=2, modes=['rev'])
    jaxpr = api.make_jaxpr(api.linearize(f, 4.)[1])(1.)
    jaxpr_text = str(jaxpr)
    assert jaxpr_text.count(' sin ') == 1
    assert jaxpr_text.count(' cos ') == 2


# jax tests/api_test.py RematTest.test_remat_of_cond_funky_custom_jvp2
@pytest.mark.slow  # order-2 check_grads / many compiles: seconds on 2 cores
def test_remat_of_cond_funky_custom_jvp2():
    # Like the above test but instead of using jit inside custom_jvp, use cond.

    def cond_apply(f, x):
        return lax.cond(True, f, lambda x: x, x)

    @jax.custom_jvp
    def sin(x):
        return jnp.sin(x)

    def sin_jvp(primals, tangents):
        x, = primals
        xdot, = tangents
        y, c = cond_apply(lambda xs: (jnp.sin(xs[0]), jnp.cos(xs[1])), (x, x))
        ydot = c * xdot
        return y, ydot
    sin.defjvp(sin_jvp)

    save_cos = lambda prim, *_, **__: str(prim) == 'cos'  # noqa: E731
    f = remat.checkpoint(partial(cond_apply, sin), policy=save_cos)
    jtu.check_grads(f, (3.,), order=2, modes=['rev'])
    jaxpr = api.make_jaxpr(api.linearize(f, 4.)[1])(1.)
    jaxpr_text = str(jaxpr)
    assert jaxpr_text.count(' sin ') == 0
    assert jaxpr_text.count(' cos ') == 0

    save_sin = lambda prim, *_, **__: str(prim) == 'sin'  # noqa: E731
    f = remat.checkpoint(partial(cond_apply, sin), policy=save_sin)
    jtu.check_grads(f, (3.,), order=2, modes=['rev'])
    jaxpr = api.make_jaxpr(api.linearize(f, 4.)[1])(1.)
    jaxpr_text = str(jaxpr)
    assert jaxpr_text.count(' sin ') == 0
    assert jaxpr_text.count(' cos ') == 1

    f = remat.checkpoint(partial(cond_apply, sin),
                         policy=jax.checkpoint_policies.everything_saveable)
    jtu.check_grads(f, (3.,), order=2, modes=['rev'])
    jaxpr = api.make_jaxpr(api.linearize(f, 4.)[1])(1.)
    jaxpr_text = str(jaxpr)
    assert jaxpr_text.count(' sin ') == 0
    assert jaxpr_text.count(' cos ') == 0

    f = remat.checkpoint(partial(cond_apply, sin),
                         policy=jax.checkpoint_policies.nothing_saveable)
    jtu.check_grads(f, (3.,), order=2, modes=['rev'])
    jaxpr = api.make_jaxpr(api.linearize(f, 4.)[1])(1.)
    jaxpr_text = str(jaxpr)
    assert jaxpr_text.count(' sin ') == 0
    assert jaxpr_text.count(' cos ') == 1

    f = remat.checkpoint(lambda x: cond_apply(sin, cond_apply(sin, x)),
                         policy=jax.checkpoint_policies.nothing_saveable)
    jtu.check_grads(f, (3.,), order=2, modes=['rev'])
    jaxpr = api.make_jaxpr(api.linearize(f, 4.)[1])(1.)
    jaxpr_text = str(jaxpr)
    assert jaxpr_text.count(' sin ') == 1
    assert jaxpr_text.count(' cos ') == 2


# jax tests/api_test.py RematTest.test_remat_of_while_loop
@pytest.mark.parametrize("remat_", TWO_NEW)
def test_remat_of_while_loop(remat_):
    def cond_fn(carry):
        i, _ = carry
        return i < 3

    def body_fn(carry):
        i, x = carry
        return i + 1, jnp.sin(x)

    def f(x):
        _, y = lax.while_loop(cond_fn, body_fn, (0, x))
        return y

    _, f_lin = jax.linearize(remat_(f), 3.)
    y_dot = f_lin(1.0)
    expected = jax.grad(lambda x: jnp.sin(jnp.sin(jnp.sin(x))))(3.)
    assert_all_close(y_dot, expected, check_dtypes=False)

    jaxpr = api.make_jaxpr(jax.linearize(remat_(f), 4.)[1])(1.)
    assert ' sin ' in str(jaxpr)
    assert ' cos ' in str(jaxpr)


# jax tests/api_test.py RematTest.test_remat_of_while_loop_policy
def test_remat_of_while_loop_policy():
    def cond_fn(carry):
        i, _ = carry
        return i < 3

    def body_fn(carry):
        i, x = carry
        return i + 1, jnp.sin(x)

    def f(x):
        _, y = lax.while_loop(cond_fn, body_fn, (0, x))
        return y

    # even with a policy, we can't save residuals (w/o dynamic shapes)!
    save_cos = lambda prim, *_, **__: str(prim) == 'cos'  # noqa: E731
    g = remat.checkpoint(f, policy=save_cos)
    jaxpr = api.make_jaxpr(jax.linearize(g, 4.)[1])(1.)
    assert ' sin ' in str(jaxpr)
    assert ' cos ' in str(jaxpr)


# jax tests/api_test.py RematTest.test_remat_residual_logging
# (upstream raises absl's verbosity to DEBUG and uses assertLogs on the root logger;
# caplog at DEBUG on jax's ad_checkpoint logger captures the same records)
def test_remat_residual_logging(caplog):
    def f(x):
        x = jnp.sin(x)
        x = jnp.cos(x.sum())
        return x

    x = jnp.arange(3.)

    f1 = remat.checkpoint(f)
    f2 = remat.checkpoint(f, policy=lambda *_, **__: True)
    f3 = remat.checkpoint(f, policy=lambda p, *_, **__: str(p) == 'cos')

    def logged(fun):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="jax._src.ad_checkpoint"):
            jax.grad(fun)(x)
        lines = [r.getMessage() for r in caplog.records]
        assert lines, "no log records"  # assertLogs fails when nothing is logged
        return lines

    output = logged(f1)
    assert any('remat-decorated function saving inputs with shapes:'
               in line for line in output)
    assert not any('intermediates' in line for line in output)

    output = logged(f2)
    assert not any('saving inputs' in line for line in output)
    assert any('remat-decorated function saving these intermediates:'
               in line for line in output)
    assert any(' sin ' in line for line in output)
    assert any(' cos ' in line for line in output)

    output = logged(f3)
    assert any('remat-decorated function saving inputs with shapes:'
               in line for line in output)
    assert any('and saving these intermediates:'
               in line for line in output)
    assert not any(' sin ' in line for line in output)
    assert any(' cos ' in line for line in output)


# jax tests/api_test.py RematTest.test_excess_precision_hell
def test_excess_precision_hell():
    finfo = jnp.finfo('bfloat16')
    eps = finfo.eps

    @jax.custom_vjp
    def dot(x):
        return jnp.dot(x, x)

    def dot_fwd(x):
        return dot(x), None

    def dot_bwd(_, g):
        return g,
    dot.defvjp(dot_fwd, dot_bwd)

    @jax.custom_vjp
    def foo(x):
        return jnp.float32(1.) * x.astype('float32')

    def foo_fwd(x):
        return foo(x), x

    def foo_bwd(x, _):
        return jnp.float32(1.) * x.astype('float32'),
    foo.defvjp(foo_fwd, foo_bwd)

    @jax.jit
    @partial(remat.checkpoint, policy=lambda *_, **__: True)
    def f(x):
        x = dot(x)
        return foo(x)

    x = (jnp.bfloat16(1) + eps) * jnp.eye(2, dtype='bfloat16')
    y, vjp = jax.vjp(f, x)
    y_, = vjp(jnp.ones_like(y))
    assert_all_close(y, y_, atol=0, rtol=0)


# jax tests/api_test.py RematTest.test_concreteness_error_includes_user_code
def test_concreteness_error_includes_user_code():
    @remat.checkpoint
    def f(x):
        if x > 0:
            return x
        else:
            return jnp.sin(x)

    try:
        f(3.)
    except TracerBoolConversionError:
        assert 'x > 0' in traceback.format_exc()
    else:
        pytest.fail('no TracerBoolConversionError')  # upstream: assert False


# jax tests/api_test.py RematTest.test_concreteness_error_includes_user_code_with_static_argnums
def test_concreteness_error_includes_user_code_with_static_argnums():
    @partial(remat.checkpoint, static_argnums=(1,))
    def f(x, _):
        if x > 0:
            return x
        else:
            return jnp.sin(x)

    try:
        f(3., 1.)
    except TracerBoolConversionError:
        assert 'x > 0' in traceback.format_exc()
    else:
        pytest.fail('no TracerBoolConversionError')  # upstream: assert False


# jax tests/api_test.py RematTest.test_name_stack_annotation
def test_name_stack_annotation():
    def g(x, y):
        with jax.named_scope("g"):
            return x @ y

    def g1(x, y):
        with jax.named_scope("g1"):
            t = checkpoint_name(x @ y, "save_me")
        return t

    def f2(x, ws):
        for i, w in enumerate(ws):
            if i % 8 == 1:
                x = g1(x, w)
            else:
                x = g(x, w)
            x = jnp.tanh(x)
        return jnp.sum(x)

    @remat.checkpoint
    def f(x, ws):
        return jax.named_call(jax.jit(f2), name='run_per_expert_shard')(x, ws)

    def make_weight(i):
        if i % 2 == 0:
            return jnp.ones([64, 128])
        else:
            return jnp.ones([128, 64])

    x = jnp.ones([64, 64])
    ws = [make_weight(i) for i in range(2)]

    out = f(x, ws)
    vjp = jax.make_jaxpr(jax.vjp(functools.partial(f, x), ws)[1])(out)

    s = vjp.jaxpr.pretty_print(name_stack=True)
    assert s.count('rematted_computation') == 1


# jax tests/api_test.py RematTest.test_remat_partial_cse_prevention
def test_remat_partial_cse_prevention():
    @partial(remat.checkpoint, prevent_cse=(False, True))
    def layer(W, x):
        res = x @ W
        res += jnp.array([1.0, 2.0, 3.0])  # ensure the jaxpr also contains a const
        return res

    def net(Ws, x):
        for W in Ws:
            x = layer(W, x)
        return x

    def loss(Ws, x):
        return jnp.sum(net(Ws, x)**2)

    Ws = [jnp.ones((3, 3)) for _ in range(2)]
    x = jnp.ones(3)
    txt = jax.jit(jax.grad(loss, (0, 1))).lower(Ws, x).as_text()
    assert re.search(r'optimization_barrier %[a-z0-9]+, %[a-z0-9]+ :', txt)


# jax tests/api_test.py RematTest.test_remat_partial_cse_prevention_all_false
def test_remat_partial_cse_prevention_all_false():
    @partial(remat.checkpoint, prevent_cse=(False, False))
    def layer(W, x):
        return x @ W

    def net(Ws, x):
        for W in Ws:
            x = layer(W, x)
        return x

    def loss(Ws, x):
        return jnp.sum(net(Ws, x)**2)

    Ws = [jnp.ones((3, 3)) for _ in range(2)]
    x = jnp.ones(3)
    jax.jit(jax.grad(loss, (0, 1))).lower(Ws, x).as_text()  # don't crash


# jax tests/api_test.py RematTest.test_remat_partial_cse_prevention_pytree
def test_remat_partial_cse_prevention_pytree():
    @partial(remat.checkpoint, prevent_cse=({'W': False, 'x': True},))
    def layer(dct):
        return dct['x'] @ dct['W']

    def net(Ws, x):
        for W in Ws:
            x = layer(dict(W=W, x=x))
        return x

    def loss(Ws, x):
        return jnp.sum(net(Ws, x)**2)

    Ws = [jnp.ones((3, 3)) for _ in range(2)]
    x = jnp.ones(3)
    txt = jax.jit(jax.grad(loss, (0, 1))).lower(Ws, x).as_text()
    assert re.search(r'optimization_barrier %[a-z0-9]+, %[a-z0-9]+ :', txt)


# jax tests/api_test.py RematTest.test_remat_grad_accum_refs
def test_remat_grad_accum_refs():
    @remat.checkpoint
    def f(param: jax.Array) -> jax.Array:
        return jnp.sin(param)

    param = jnp.array(2.0, dtype=jnp.float32)
    loss, vjp_fn = jax.vjp(f, param)
    grad_ref = jax.ref.new_ref(jnp.zeros_like(param))

    vjp_fn.with_refs(grad_ref)(jnp.array(1.0, dtype=param.dtype))

    np.testing.assert_allclose(loss, f(param))
    np.testing.assert_allclose(jax.ref.get(grad_ref), jax.grad(f)(param))


# jax tests/api_test.py Remat3Test (the whole subclass)
@pytest.mark.skip(reason=(
    "Remat3Test reruns RematTest under jax_remat3=True (JAX's experimental remat3: "
    "RematTraced, custom_remat); remat.checkpoint builds on jax.checkpoint's default "
    "(remat2) implementation and does not wrap remat3"))
def test_remat3_suite():
    pass


# ---------------------------------------------------------------------------------------
# Import safety corpus (not from JAX)
# ---------------------------------------------------------------------------------------
#
# With remat imported (tests/upstream/conftest.py imports it first), a checkpointed layer
# inside each control-flow primitive and under each transformation must give the
# un-checkpointed function's value and gradient: both jax.checkpoint itself (what import
# remat must not break, e.g. through process-wide XLA flags) and remat.checkpoint, in the
# decorator and the torch-style call form, with prevent_cse True and False.


def _layer(x, w):
    return jnp.tanh(jnp.sin(x) @ w + 0.5 * x)


def _make_ckpt(impl, prevent_cse):
    """fn -> checkpointed fn, for one implementation."""
    if impl == "jax":
        return lambda fn: jax.checkpoint(fn, prevent_cse=prevent_cse)
    if impl == "remat":
        return lambda fn: remat.checkpoint(fn, prevent_cse=prevent_cse)
    assert impl == "remat_call"  # torch style: checkpoint(fn, *args)
    return lambda fn: (lambda *args: remat.checkpoint(fn, *args, prevent_cse=prevent_cse))


def _loss(context, ckpt):
    """A scalar loss of (x, w) with ``ckpt(_layer)`` used in ``context``."""
    layer = ckpt(_layer)
    if context == "scan":
        def loss(x, w):
            y, ys = lax.scan(lambda c, _: (layer(c, w), jnp.sum(c)), x, None, length=3)
            return jnp.sum(y) + jnp.sum(ys)
    elif context == "fori_loop":
        def loss(x, w):
            return jnp.sum(lax.fori_loop(0, 3, lambda i, c: layer(c, w), x))
    elif context == "while_loop":
        def loss(x, w):
            _, y = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, layer(c[1], w)), (0, x))
            return jnp.sum(y)
    elif context == "cond":
        def loss(x, w):
            y = lax.cond(jnp.sum(x) > 0, layer, lambda c, w: c * 2.0, x, w)
            return jnp.sum(layer(y, w))
    else:  # a plain two-layer stack, transformed from outside
        def loss(x, w):
            return jnp.sum(layer(layer(x, w), w))
    return loss


_CORPUS_CONTEXTS = ["scan", "fori_loop", "while_loop", "cond", "jit", "vmap", "grad", "jacfwd_grad"]
# contexts whose cases are slow: fori_loop with a fixed trip count lowers to the scan of the
# "scan" context, and the plain stack under jax.jit is what every compiled context jits (its
# eager twin is "grad", its batched one "vmap"); the other six stay in the default run
_CORPUS_SLOW_CONTEXTS = {"fori_loop", "jit"}


def _evaluate(context, loss, x, w):
    """What is compared in ``context``: values, and gradients where the context has them."""
    return _evaluate_all(context, [loss], x, w)[0]


def _evaluate_all(context, losses, x, w):
    """:func:`_evaluate` of each loss; where the context compiles, one program computes them all
    (one compile per context, not one per loss)."""
    if context == "grad":  # eager (no jit)
        return [jax.value_and_grad(loss, argnums=(0, 1))(x, w) for loss in losses]
    if context == "while_loop":  # reverse-mode is undefined for while_loop: forward only
        one = lambda loss, x, w: jax.jvp(lambda x: loss(x, w), (x,), (jnp.ones_like(x),))  # noqa: E731
    elif context == "vmap":
        x = jnp.stack([x, -x, 2.0 * x])

        def one(loss, xs, w):
            batched = jax.vmap(loss, in_axes=(0, None))
            return batched(xs, w), jax.grad(lambda xs, w: jnp.sum(batched(xs, w)), argnums=(0, 1))(xs, w)
    elif context == "jacfwd_grad":  # higher order: the Hessian in w
        one = lambda loss, x, w: jax.jacfwd(jax.grad(loss, argnums=1))(x, w)  # noqa: E731
    else:  # jit, and inside scan / fori_loop / cond
        one = lambda loss, x, w: jax.value_and_grad(loss, argnums=(0, 1))(x, w)  # noqa: E731
    return jax.jit(lambda x, w: [one(loss, x, w) for loss in losses])(x, w)


def _corpus_inputs():
    x = jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32)
    w = jnp.reshape(jnp.linspace(-0.5, 0.5, 16, dtype=jnp.float32), (4, 4))
    return x, w


# jax.checkpoint and remat.checkpoint's decorator form with prevent_cse True and False; the
# torch-style call form (the same code path inside remat) with the default True only.
_CORPUS_IMPLS = [("jax", True), ("jax", False), ("remat", True), ("remat", False), ("remat_call", True)]


# the default run: jax.checkpoint and remat.checkpoint with the CSE barrier; the slow cases
# add the call form (remat's decorator code path), and both without the barrier (JAX's own
# lowering for jax.checkpoint, which importing remat leaves alone: tests/test_lowering.py)
_CORPUS_SLOW = {("jax", False), ("remat", False), ("remat_call", True)}
_CORPUS_FAST = [impl for impl in _CORPUS_IMPLS if impl not in _CORPUS_SLOW]


@functools.lru_cache(maxsize=None)
def _corpus_results(context):
    """The un-checkpointed function's results, then those of each implementation of the default
    run, computed together once per context (the slow cases compute theirs alone)."""
    losses = [_loss(context, lambda fn: fn), *(_loss(context, _make_ckpt(*impl)) for impl in _CORPUS_FAST)]
    expected, *actual = _evaluate_all(context, losses, *_corpus_inputs())
    return expected, dict(zip(_CORPUS_FAST, actual))


@pytest.mark.parametrize("impl,prevent_cse", [
    pytest.param(impl, cse, id=f"{impl}-{'cse_barrier' if cse else 'no_cse_barrier'}",
                 marks=pytest.mark.slow if (impl, cse) in _CORPUS_SLOW else ())
    for impl, cse in _CORPUS_IMPLS])
@pytest.mark.parametrize("context", [
    pytest.param(c, marks=pytest.mark.slow if c in _CORPUS_SLOW_CONTEXTS else ()) for c in _CORPUS_CONTEXTS])
def test_import_safety_corpus(context, impl, prevent_cse):
    expected, together = _corpus_results(context)
    actual = together.get((impl, prevent_cse))
    if actual is None:  # a slow case
        actual = _evaluate(context, _loss(context, _make_ckpt(impl, prevent_cse)), *_corpus_inputs())
    assert_all_close(actual, expected, rtol=1e-5, atol=1e-6)

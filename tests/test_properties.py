"""Property-based tests: random compositions of operations, every policy, exact gradients."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, nonarg_residuals
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax

from remat import checkpoint, checkpoint_name, checkpoint_sequential, policies

N = 4  # every operation maps (N, N) -> (N, N); tiny shapes keep compiles fast


def _scan(h, w):
    def step(c, row):
        c = jnp.tanh(c * 0.9 + row @ w)
        return c, c * row

    _, ys = lax.scan(step, jnp.zeros(N), h)
    return ys


OPS = {
    "sin": lambda h, w: jnp.sin(h),
    "tanh": lambda h, w: jnp.tanh(h),
    "exp": lambda h, w: jnp.exp(0.1 * h),
    "square": lambda h, w: 0.5 * h * h,
    "mul_w": lambda h, w: h * w,
    "matmul": lambda h, w: h @ w,
    "matmul_t": lambda h, w: jnp.dot(w.T, h),
    "batched_dot": lambda h, w: jnp.einsum("bij,bjk->bik", h.reshape(N, 1, N),
                                           jnp.broadcast_to(w, (N, N, N))).reshape(N, N),
    "sum_bcast": lambda h, w: h + 0.1 * jnp.sum(h, axis=0, keepdims=True),
    "max_sub": lambda h, w: h - jnp.max(h, axis=1, keepdims=True),
    "mean_all": lambda h, w: h * jnp.mean(h),
    "reshape": lambda h, w: h.reshape(2, 2 * N).T.reshape(N, N),
    "transpose": lambda h, w: h.T,
    "cond": lambda h, w: lax.cond(jnp.sum(h) > 0, jnp.sin, lambda t: jnp.cos(t) * w, h),
    "scan": _scan,
    "fori": lambda h, w: lax.fori_loop(0, 2, lambda i, t: jnp.tanh(t @ w) + t, h),
}
OP_NAMES = sorted(OPS)
TAGS = ("a", "b")

POLICIES = {
    "None": lambda: None,
    "nothing": lambda: "nothing",
    "everything": lambda: "everything",
    "dots": lambda: "dots",
    "dots_no_batch": lambda: "dots_no_batch",
    "names": lambda: ["a"],
    "save_names": lambda: policies.save_names("a", "b"),
    "save_all_but": lambda: policies.save_all_but("a"),
    "offload": lambda: policies.offload_names("b"),
    "any_of": lambda: policies.any_of("dots_no_batch", ["b"]),
    "selective": lambda: policies.selective(["mm", "tanh"]),
}


@st.composite
def programs(draw):
    """A list of steps: (op name, tag or None)."""
    n = draw(st.integers(1, 6))
    ops = draw(st.lists(st.sampled_from(OP_NAMES), min_size=n, max_size=n))
    tags = draw(st.lists(st.sampled_from((None, None) + TAGS), min_size=n, max_size=n))
    return list(zip(ops, tags))


def run_steps(steps, h, w):
    for op, tag in steps:
        h = OPS[op](h, w)
        if tag is not None:
            h = checkpoint_name(h, tag)
    return h


def _inputs(seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return jax.random.normal(k1, (N, N)) * 0.5, jax.random.normal(k2, (N, N))


def _assert_grads_equal(f_ck, f_plain, w, x):
    v_ck, g_ck = jax.jit(jax.value_and_grad(f_ck, argnums=(0, 1)))(w, x)
    v_pl, g_pl = jax.jit(jax.value_and_grad(f_plain, argnums=(0, 1)))(w, x)
    np.testing.assert_allclose(v_ck, v_pl, rtol=1e-5, atol=1e-6)
    assert_trees_close(g_ck, g_pl, rtol=2e-4, atol=2e-5)


SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.slow
@SETTINGS
@given(
    steps=programs(),
    policy=st.sampled_from(sorted(POLICIES)),
    cut=st.tuples(st.integers(0, 6), st.integers(0, 6)),
    nested=st.booleans(),
    seed=st.integers(0, 3),
)
def test_random_programs_every_policy_gives_plain_gradients(steps, policy, cut, nested, seed):
    w, x = _inputs(seed)
    lo, hi = sorted(min(c, len(steps)) for c in cut)
    hi = max(hi, lo + 1) if lo < len(steps) else len(steps)
    pol = POLICIES[policy]()

    def region(h, w):
        if nested and hi - lo >= 2:  # a checkpoint inside the checkpoint
            mid = (lo + hi) // 2
            h = checkpoint(lambda h, w: run_steps(steps[lo:mid], h, w), h, w, policy=pol)
            return run_steps(steps[mid:hi], h, w)
        return run_steps(steps[lo:hi], h, w)

    def f_ck(w, x):
        h = run_steps(steps[:lo], x, w)
        h = checkpoint(region, h, w, policy=pol)
        return jnp.sum(jnp.sin(run_steps(steps[hi:], h, w)))

    def f_plain(w, x):
        return jnp.sum(jnp.sin(run_steps(steps, x, w)))

    _assert_grads_equal(f_ck, f_plain, w, x)


@SETTINGS
@given(steps=programs(), seed=st.integers(0, 3))
def test_random_programs_whole_region_keeps_only_what_the_policy_says(steps, seed):
    w, x = _inputs(seed)

    def f(policy):
        return lambda w, x: jnp.sum(checkpoint(lambda w, x: jnp.sin(run_steps(steps, x, w)), w, x, policy=policy))

    # nothing: only the inputs
    assert nonarg_residuals(f(None), w, x) == []
    # a names policy: only named values
    kept = nonarg_residuals(f(["a", "b"]), w, x)
    assert all(d.startswith("named ") for _, d in kept), kept
    assert len(kept) <= sum(tag is not None for _, tag in steps)
    # dots: matmul outputs (inside a scan/loop they come out stacked), no element-wise work
    kept = nonarg_residuals(f("dots"), w, x)
    elementwise = ("sin", "cos", "tanh", "exp", "mul", "add", "sub", "max", "reduce_max")
    assert not any(d.startswith(tuple(f"output of {p} " for p in elementwise)) for _, d in kept), kept
    if not any(op in ("cond", "scan", "fori") for op, _ in steps):
        assert all(d.startswith("output of dot_general") for _, d in kept), kept
        n_dots = sum(op in ("matmul", "matmul_t", "batched_dot") for op, _ in steps)
        assert len(kept) <= n_dots


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(st.sampled_from(OP_NAMES), min_size=1, max_size=7),
    data=st.data(),
    seed=st.integers(0, 3),
)
def test_random_checkpoint_sequential(ops, data, seed):
    segments = data.draw(st.integers(1, len(ops)))
    policy = data.draw(st.sampled_from(["nothing", "dots", "everything"]))
    w, x = _inputs(seed)

    def f_ck(w, x):
        fs = [lambda h, op=op: OPS[op](h, w) for op in ops]
        return jnp.sum(jnp.sin(checkpoint_sequential(fs, segments, x, policy=policy)))

    def f_plain(w, x):
        return jnp.sum(jnp.sin(run_steps([(op, None) for op in ops], x, w)))

    _assert_grads_equal(f_ck, f_plain, w, x)

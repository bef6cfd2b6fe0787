"""Property-based tests of what a policy keeps: random compositions of operations, their residuals.

That checkpointing changes no value or gradient, for every policy, form, placement and
transform, is tests/test_fuzz.py's (docs/property-tests.md).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from conftest import nonarg_residuals
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax

from remat import checkpoint, checkpoint_name

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


SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


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

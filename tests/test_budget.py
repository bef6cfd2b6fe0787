"""The memory-budget policy: within the limit, the knapsack optimum, exact gradients."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close
from hypothesis import given, settings
from hypothesis import strategies as st

import remat
from remat.analysis import saved_residuals
from remat.analysis.budget import ResidualBudget, knapsack


def block(w, x):
    h = jnp.tanh(x @ w[0])
    h = jax.nn.gelu(h @ w[1])
    return jnp.sin(h @ w[2]) + x


# made by NumPy and put on the device: eagerly, each jnp operation compiles a program at import
W = jnp.asarray(np.stack([np.eye(32, dtype=np.float32) * np.float32(0.5)] * 3) + np.float32(0.01))
X = jnp.asarray(np.linspace(-1, 1, 16 * 32, dtype=np.float32).reshape(16, 32))


def kept_bytes(policy):
    return saved_residuals(lambda w, x: remat.checkpoint(block, w, x, policy=policy).sum(), W, X).residual_bytes


# the ends and the middle in the default run; 0.25 and 0.75 (the middle's code path: a knapsack
# under a limit strictly between nothing and everything) slow. test_budget_grows_what_it_keeps_with_the_fraction
# prices all five fractions in the default run
@pytest.mark.parametrize("fraction", [0.0, pytest.param(0.25, marks=pytest.mark.slow), 0.5,
                                      pytest.param(0.75, marks=pytest.mark.slow), 1.0])
def test_budget_keeps_at_most_the_fraction_and_gradients_are_exact(fraction):
    p = remat.residual_budget(fraction)
    full = kept_bytes("everything")
    assert kept_bytes(p) <= fraction * full
    choice = p.last_choice
    assert choice.kept_bytes <= choice.limit_bytes
    g = jax.grad(lambda w: remat.checkpoint(block, w, X, policy=p).sum())(W)
    np.testing.assert_allclose(g, _plain_grad(), rtol=1e-6, atol=1e-6)


@functools.cache
def _plain_grad():
    """The un-checkpointed block's gradient, compiled once (eagerly each primitive compiles alone)."""
    return jax.jit(jax.grad(lambda w: block(w, X).sum()))(W)


def test_zero_is_nothing_and_one_is_everything():
    assert kept_bytes(remat.residual_budget(0.0)) == kept_bytes("nothing")
    assert kept_bytes(remat.residual_budget(1.0)) == kept_bytes("everything")


def test_budget_grows_what_it_keeps_with_the_fraction():
    kept = [kept_bytes(remat.residual_budget(f)) for f in (0.0, 0.25, 0.5, 0.75, 1.0)]
    assert kept == sorted(kept) and kept[0] < kept[2] < kept[-1]


def test_budget_prefers_matmuls_when_room_is_tight():
    from remat.analysis.machine import UNCALIBRATED

    # fixed rates: a process that calibrated (the planner's tests on this worker) prices by its own
    p = remat.residual_budget(0.3, rates=UNCALIBRATED)
    kept_bytes(p)
    assert "dot_general" in {c.primitive for c in p.last_choice.kept}
    assert "dot_general" in str(p.last_choice) and "keep" in str(p.last_choice)


def test_budget_in_bytes_and_jit_and_nnx():
    from flax import nnx

    p = remat.residual_budget(bytes=4096)
    assert kept_bytes(p) <= 4096
    f = jax.jit(jax.grad(lambda w: remat.checkpoint(block, w, X, policy=p).sum()))
    np.testing.assert_allclose(f(W), _plain_grad(), rtol=1e-6, atol=1e-6)

    class Net(nnx.Module):
        def __init__(self, ck):
            self.l1, self.l2, self.ck = nnx.Linear(8, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 8, rngs=nnx.Rngs(1)), ck

        def body(self, x):
            return jnp.tanh(self.l2(jnp.tanh(self.l1(x))))

        def __call__(self, x):
            return remat.checkpoint(self.body, x, policy=remat.residual_budget(0.5)) if self.ck else self.body(x)

    x = jnp.ones((4, 8))
    g1 = nnx.state(nnx.grad(lambda m: m(x).sum())(Net(True)))
    g0 = nnx.state(nnx.grad(lambda m: m(x).sum())(Net(False)))
    assert_trees_close(g1, g0, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "half", True])
def test_bad_fractions_are_value_errors(bad):
    with pytest.raises(ValueError, match="budget"):
        remat.residual_budget(bad)


def test_budget_outside_remat_checkpoint_says_how_to_use_it():
    from remat._core.lowering import classic_remat

    # JAX's remat3 consults no callable policy at all, so the misuse can only be caught
    # where jax.checkpoint asks the policy: its checkpoint primitive
    with classic_remat(), pytest.raises(TypeError, match="policy= of remat.checkpoint"):
        jax.grad(lambda x: jax.checkpoint(jnp.sin, policy=ResidualBudget(0.5))(x).sum())(X)


def _brute_force(weights, values, capacity):
    """The best value of every subset that fits: the 2**n subsets' weights and values, each
    item doubling the list (without it, then with it)."""
    w, v = np.zeros(1, np.int64), np.zeros(1)
    for wi, vi in zip(weights, values):
        w, v = np.concatenate([w, w + wi]), np.concatenate([v, v + vi])
    return float(v[w <= capacity].max())  # the empty subset always fits


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 1000), st.floats(0.0, 100.0)), min_size=1, max_size=14),
       st.integers(0, 5000))
def test_knapsack_equals_brute_force(items, capacity):
    weights, values = [w for w, _ in items], [v for _, v in items]
    picked, method = knapsack(weights, values, capacity)
    assert method == "exact"
    assert sum(weights[i] for i in picked) <= capacity
    assert math.isclose(sum(values[i] for i in picked), _brute_force(weights, values, capacity),
                        rel_tol=1e-9, abs_tol=1e-9)


def test_knapsack_twenty_candidates_exact():
    rng = np.random.default_rng(0)
    weights = rng.integers(1, 500, 20).tolist()
    values = rng.random(20).tolist()
    picked, method = knapsack(weights, values, 2000)
    assert method == "exact"
    assert math.isclose(sum(values[i] for i in picked), _brute_force(weights, values, 2000))


def test_knapsack_beyond_the_exact_limit_is_greedy_and_feasible():
    picked, method = knapsack(list(range(1, 41)), [1.0] * 40, 50, exact_limit=24)
    assert method == "greedy" and sum(i + 1 for i in picked) <= 50


def _key_noise(x):
    return jnp.sin(x) * jax.random.normal(jax.random.key(0), x.shape)


def _key_residual(x):  # a typed key computed from the input: a key<fry> residual
    key = jax.random.fold_in(jax.random.key(0), (x.sum() > 0).astype(jnp.int32))
    return jnp.sin(x) * jax.random.normal(key, x.shape)


def _int4_and_bool(x):
    mask = x > 0.5
    q = (x * 3).astype(jnp.int4)
    return jnp.where(mask, jnp.sin(x), jnp.cos(x)) * q.astype(jnp.float32)


def _float0(x):  # an integer value inside the region: its cotangent is float0
    n = (x * 4).astype(jnp.int32)
    return jnp.sin(x) * n.astype(jnp.float32), n


# "every name" run eagerly (each policy's region compiled primitive by primitive) slow:
# test_every_named_policy_accepts_every_residual_dtype_in_one_program takes the same names through
# the same partial evaluation in one compiled program, and the "budget" cases here run eagerly
@pytest.mark.parametrize("fn", [_key_noise, _key_residual, _int4_and_bool, _float0])
@pytest.mark.parametrize("policy", [pytest.param("every name", marks=pytest.mark.slow), "budget"])
def test_every_policy_accepts_every_residual_dtype(fn, policy):
    from remat._names import POLICY_NAMES

    x = jnp.linspace(0.1, 1.0, 4)
    loss = lambda f: lambda x: jax.tree.leaves(f(x))[0].sum()  # noqa: E731
    want = jax.jit(jax.grad(loss(fn)))(x)  # the reference compiled: eagerly each primitive compiles alone
    chosen = list(POLICY_NAMES) + [["a"]] if policy == "every name" else [
        remat.residual_budget(f) for f in (0.0, 0.5, 1.0)]
    for p in chosen:
        got = jax.grad(loss(lambda x, p=p: remat.checkpoint(fn, x, policy=p)))(x)
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=str(p))


@pytest.mark.parametrize("fn", [_key_noise, _key_residual, _int4_and_bool, _float0])
def test_every_named_policy_accepts_every_residual_dtype_in_one_program(fn):
    from remat._names import POLICY_NAMES

    x = jnp.linspace(0.1, 1.0, 4)
    loss = lambda f: lambda x: jax.tree.leaves(f(x))[0].sum()  # noqa: E731
    want = jax.jit(jax.grad(loss(fn)))(x)
    chosen = list(POLICY_NAMES) + [["a"]]

    @jax.jit
    def every(x):  # each policy's gradient, all in one program (one compile, not one per primitive)
        return [jax.grad(loss(lambda x, p=p: remat.checkpoint(fn, x, policy=p)))(x) for p in chosen]

    for p, got in zip(chosen, every(x), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=str(p))


def test_calibrate_times_the_programs_it_is_given(monkeypatch):
    """Programs compiled beforehand (as plan() compiles them in the background while it
    traces) are the ones timed, and the rates follow from their median times."""
    from remat.analysis import machine as budget
    from remat.analysis import timing

    timed = []

    class Medians:
        def medians_s(self):
            return [0.002, 0.0005]

    def time_programs(programs, rounds, **kwargs):
        timed.append(list(programs))
        return Medians()

    monkeypatch.setattr(timing, "time_programs", time_programs)
    monkeypatch.setattr(budget, "fault_s_per_byte", lambda: 1e-10)
    programs = budget.calibration_programs(64)
    np.testing.assert_array_equal(programs[0](), np.full((64, 64), 64.0, np.float32))  # ones @ ones
    np.testing.assert_array_equal(programs[1](), np.full((4 * 64 * 64,), 2.5, np.float32))
    monkeypatch.setattr(budget, "_measured", budget._measured)  # the process's own rates come back after
    rates = budget.calibrate(size=64, programs=programs).to_dict()
    assert budget.calibrated() and budget.calibrate_once().to_dict() == rates
    assert timed and all(t == programs for t in timed)
    assert rates["flops_per_s"] == 2 * 64**3 / 0.002
    assert rates["bytes_per_s"] == 2 * (4 * 64 * 64 * 4) / 0.0005  # read and written, float32
    assert rates["fault_s_per_byte"] == (1e-10 if jax.default_backend() == "cpu" else 0.0)


def test_budget_prices_by_the_rates_it_is_given_not_the_process_calibration():
    from remat.analysis.machine import Rates

    dear_flops = remat.residual_budget(0.3, rates=Rates(flops_per_s=1e6, bytes_per_s=1e12, fault_s_per_byte=0.0))
    dear_bytes = remat.residual_budget(0.3, rates=Rates(flops_per_s=1e15, bytes_per_s=1e3, fault_s_per_byte=0.0))
    assert dear_flops != dear_bytes  # the rates are part of the value: no trace shared between them
    kept_bytes(dear_flops), kept_bytes(dear_bytes)
    kept = [{c.primitive for c in p.last_choice.kept} for p in (dear_flops, dear_bytes)]
    assert "dot_general" in kept[0] and kept[0] != kept[1], kept

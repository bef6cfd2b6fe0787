"""The default search plans a remat.scan_layers stack: every policy and schedule (flat, equal groups,
binomial) costed by the schedules' memory model from one layer's costs, the pick compiled to confirm."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEFAULT_COMPILE
from programs import stacked_layers

import remat
from remat.planner._schedules import schedule_bytes
from remat.planner.steering import Binomial, apply_policies
from remat.policies import NO_CHECKPOINT
from remat.scan import binomial_schedule, schedule_peak

DEPTH, WIDTH, BATCH = 8, 32, 256


def _layer(w, h):
    return h + jnp.tanh(h @ w["up"]) @ w["down"]


def _loss(params, x):
    return jnp.mean(remat.scan_layers(_layer, params, x) ** 2)


def _step():
    return stacked_layers(("up", "down"), DEPTH, WIDTH, BATCH)


@functools.cache
def _unchecked_grads():
    """The stack's gradients with the scan un-checkpointed, compiled once for the tests below."""
    return jax.jit(jax.grad(apply_policies(_loss, (), scan=(NO_CHECKPOINT, None))))(*_step())


def _assert_the_default_search_weighed_every_schedule(p):
    """Every policy and schedule weighed, the compile-everything families not, few compiles."""
    labels = {c.label for c in p.candidates}
    for policy in ("nothing", "dots"):
        assert {f"scan: {policy}, flat", f"scan: {policy}, 4 groups",
                f"scan: {policy}, binomial(levels=1) {binomial_schedule(DEPTH, 1)}"} <= labels
    assert "as written" not in labels and not any(label.startswith("whole step") for label in labels)
    assert sum(c.compiled is not None for c in p.candidates) <= 4


@pytest.mark.parametrize("schedule", [8, (2, 2, 2, 2), (4, 3, 1), ((3, 2, 1), (2, 1), 1)], ids=str)
def test_the_byte_model_is_the_schedules_peak_where_a_layer_keeps_its_input(schedule):
    assert schedule_bytes(schedule, 3.0, 3.0, working=5.0) == 3.0 * schedule_peak(schedule) + 5.0
    # a policy that keeps more per layer weighs on the flat runs only
    assert schedule_bytes((2, 2), layer_kept=3.0, layer_input=1.0, working=10.0) == 17.0


# slow: test_the_default_search_splits_a_scan_layers_stack_and_saves_the_split below runs the same
# default search on the same stack (its every policy and schedule weighed, few compiles, the pick's gradients)
@pytest.mark.slow
@pytest.mark.parametrize("budget", [0.3, 0])
def test_the_default_search_plans_a_scan_layers_stack(budget):
    params, x = _step()
    p = remat.plan(_loss, params, x, memory_budget=budget, measure=False)
    _assert_the_default_search_weighed_every_schedule(p)
    chosen = p.chosen
    assert p.feasible and chosen is not None and chosen.scan is not None and chosen.temp_bytes is not None
    assert chosen.temp_bytes <= p.limit_bytes
    if budget == 0:  # the leanest compiled is within LEAN_SLACK of the least
        assert chosen.temp_bytes <= 1.01 * p.minimum_bytes
    planned = jax.jit(jax.grad(p.apply(_loss)))(params, x)
    unchecked = _unchecked_grads()
    for a, b in zip(jax.tree.leaves(planned), jax.tree.leaves(unchecked), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_a_binomial_schedule_is_predicted_leaner_than_flat_for_nothing():
    from remat.analysis.machine import current_rates
    from remat.planner._schedules import scan_options, start_schedule_costs
    from remat.planner.steering import survey

    params, x = _step()
    finish = start_schedule_costs(_loss, (params, x), survey(_loss, params, x), ["nothing", "dots"],
                                  current_rates())
    assert finish is not None
    costs, weights = finish()
    assert weights == sum(a.nbytes for a in jax.tree.leaves(params))
    by = {(o.policy, o.groups): o for o in scan_options(costs, DEPTH, [None, 4, Binomial(1)], weights)}
    flat, grouped = by[("nothing", None)], by[("nothing", 4)]
    assert grouped.peak < flat.peak and grouped.ms > flat.ms  # one more forward, fewer inputs kept
    assert by[("dots", None)].peak > flat.peak and by[("dots", None)].ms <= flat.ms


@pytest.mark.slow
def test_the_default_search_plans_a_scan_nnx_layers_stack():
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.up = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
            self.down = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

        def __call__(self, h):
            return h + self.down(jnp.tanh(self.up(h)))

    graphdef, state = nnx.split(remat.scan.stack_nnx_layers(Block, DEPTH, nnx.Rngs(0)))

    def loss(state, x):
        return jnp.mean(remat.scan.scan_nnx_layers(nnx.merge(graphdef, state), x) ** 2)

    x = _step()[1]
    p = remat.plan(loss, state, x, memory_budget=0.3, measure=False)
    assert p.chosen is not None and p.chosen.scan is not None and p.chosen.temp_bytes <= p.limit_bytes
    assert sum(c.compiled is not None for c in p.candidates) <= 4
    unchecked = jax.jit(jax.grad(apply_policies(loss, (), scan=(NO_CHECKPOINT, None))))(state, x)
    planned = jax.jit(jax.grad(p.apply(loss)))(state, x)
    for a, b in zip(jax.tree.leaves(planned), jax.tree.leaves(unchecked), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_a_scan_layers_stack_split_in_two_scans_has_the_unsplit_gradients_bitwise():
    from remat.planner._segments import Segments
    from remat.planner.steering import PlanMismatch

    params, x = _step()
    split = Segments.of(((3, "nothing"), (5, "dots")))
    # bitwise at XLA's default compile; with LLVM's optimisations off (the tests' default,
    # conftest.py) the split and the whole scan round differently, by about 4e-8
    g, g0 = (jax.jit(jax.grad(apply_policies(_loss, (), scan=(s, None))), compiler_options=DEFAULT_COMPILE)(params, x)
             for s in (split, NO_CHECKPOINT))
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(PlanMismatch) as raised:
        jax.grad(apply_policies(_loss, (), scan=(Segments.of(((3, "nothing"), (6, "dots"))), None)))(params, x)
    assert str(raised.value).splitlines()[0].endswith("(9 layers), and the step's has 8")


def test_the_default_search_splits_a_scan_layers_stack_and_saves_the_split(tmp_path):
    from remat.planner._segments import Segments

    params, x = _step()
    # at 0.8 the fastest fitting option keeps the last layer un-checkpointed: a split
    p = remat.plan(_loss, params, x, memory_budget=0.8, measure=False)
    _assert_the_default_search_weighed_every_schedule(p)
    assert p.chosen is not None and p.chosen.scan is not None and p.chosen.temp_bytes <= p.limit_bytes
    split, groups = p.chosen.scan
    assert isinstance(split, Segments) and groups is None, p.chosen.label
    p.save(tmp_path / "plan.json")
    loaded = remat.Plan.load(tmp_path / "plan.json")
    assert loaded.chosen is not None and loaded.chosen.scan[0].parts == split.parts
    planned = jax.jit(jax.grad(p.apply(_loss)))(params, x)
    for a, b in zip(jax.tree.leaves(jax.jit(jax.grad(loaded.apply(_loss)))(params, x)), jax.tree.leaves(planned),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the planned split has the un-checkpointed stack's gradients (bitwise: the split test above)
    for a, b in zip(jax.tree.leaves(planned), jax.tree.leaves(_unchecked_grads()), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

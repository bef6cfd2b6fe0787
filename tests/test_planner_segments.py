"""A scanned stack split into segments with options of their own: run as consecutive scans with the
un-split step's gradients, weighed by the default search, kept in a saved plan, refused on another stack."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import remat
from benchmarks.scanned_oracle import assignments, scanned_step
from remat.analysis.machine import UNCALIBRATED
from remat.planner._costs import RegionCosts
from remat.planner._segments import Segments, split_note, stack_lengths
from remat.planner._split_options import pareto_pairs, with_splits
from remat.planner.steering import PlanMismatch, apply_policies, survey
from remat.policies import NO_CHECKPOINT

DEPTH, WIDTH = 6, 16


def _block(w, h):
    return h + jnp.tanh(h @ w["up"]) @ w["down"]


# built once per shape, in one compiled program: drawn eagerly, each random primitive compiles on its own
@functools.cache
@functools.partial(jax.jit, static_argnums=(0, 1))
def _stack(depth=DEPTH, lead=()):
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"up": jax.random.normal(k1, (*lead, depth, WIDTH, 4 * WIDTH)) / WIDTH ** 0.5,
            "down": jax.random.normal(k2, (*lead, depth, 4 * WIDTH, WIDTH)) / (4 * WIDTH) ** 0.5}


def _lax_loss(params, x):
    def body(h, w):
        return remat.checkpoint(_block, w, h), None
    h, _ = jax.lax.scan(body, x, params)
    return jnp.mean(h ** 2)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
        self.down = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

    def __call__(self, h):
        return h + self.down(jnp.tanh(self.up(h)))


def _nnx_step():
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return Block(rngs=nnx.Rngs(key))

    stack = make(jax.random.split(jax.random.key(0), DEPTH))
    remat.apply_checkpointing(stack, Block)
    graphdef, state = nnx.split(stack)

    def loss(state, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def body(layer, h):
            return layer(h)
        return jnp.mean(body(nnx.merge(graphdef, state), x) ** 2)

    return loss, state


X = jnp.linspace(-1.0, 1.0, 8 * WIDTH).reshape(8, WIDTH)


def _grads(step, policies, params):
    return jax.jit(jax.grad(apply_policies(step, policies)))(params, X)


def _assert_bitwise(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


SPLITS = [Segments.of(((2, "nothing"), (4, "dots"))),
          Segments.of(((1, NO_CHECKPOINT), (3, "nothing"), (2, "dots")))]


# the three-part split with the slow cases: the two-part one runs the same scans
@pytest.mark.parametrize("split", [SPLITS[0], pytest.param(SPLITS[1], marks=pytest.mark.slow)], ids=str)
def test_a_split_lax_scan_has_the_unsplit_steps_gradients_bitwise(split):
    params = _stack()
    _assert_bitwise(_grads(_lax_loss, (split,), params), _grads(_lax_loss, (NO_CHECKPOINT,), params))


@pytest.mark.slow
def test_a_split_nnx_scan_over_an_nnx_vmap_stack_has_the_unsplit_steps_gradients_bitwise():
    loss, state = _nnx_step()
    assert stack_lengths(survey(loss, state, X).jaxpr) == [DEPTH]
    _assert_bitwise(_grads(loss, (SPLITS[0],), state), _grads(loss, ("nothing",), state))


def test_a_split_of_another_length_is_a_one_line_plan_mismatch():
    with pytest.raises(PlanMismatch) as raised:
        jax.grad(apply_policies(_lax_loss, (Segments.of(((2, "nothing"), (5, "dots"))),)))(_stack(), X)
    # JAX appends its note on filtered frames below the message
    assert str(raised.value).splitlines()[0] == (
        "the plan does not match this step: it splits region 0 into layers 0-1: nothing; 2-6: dots "
        "(7 layers), and that region here is a stack of 6 layers")


def test_which_stacks_can_be_split_and_why_not():
    def two_regions(params, x):
        def body(h, w):
            return remat.checkpoint(_block, w, remat.checkpoint(_block, w, h)), None
        return jnp.mean(jax.lax.scan(body, x, params)[0] ** 2)

    def nested(params, x):
        def outer(h, ws):
            return jax.lax.scan(lambda c, w: (remat.checkpoint(_block, w, c), None), h, ws)[0], None
        return jnp.mean(jax.lax.scan(outer, x, params)[0] ** 2)

    def reversed_scan(params, x):
        body = lambda h, w: (remat.checkpoint(_block, w, h), None)  # noqa: E731
        return jnp.mean(jax.lax.scan(body, x, params, reverse=True)[0] ** 2)

    def by_hand(params, x):
        return jnp.mean(remat.checkpoint(_block, jax.tree.map(lambda a: a[0], params), x) ** 2)

    assert stack_lengths(survey(_lax_loss, _stack(), X).jaxpr) == [DEPTH]
    lengths = stack_lengths(survey(two_regions, _stack(), X).jaxpr)
    assert lengths[0] == lengths[1] and "other regions" in str(lengths[0])
    assert "loop inside" in str(stack_lengths(survey(nested, _stack(3, (2,)), X).jaxpr)[0])
    assert "reverse" in str(stack_lengths(survey(reversed_scan, _stack(), X).jaxpr)[0])
    assert stack_lengths(survey(by_hand, _stack(), X).jaxpr) == [""] and split_note([""]) is None
    note = split_note(stack_lengths(survey(two_regions, _stack(), X).jaxpr))
    assert note is not None and "\n" not in note and note.startswith("segment splits not considered for region 0")


def test_a_split_reads_back_from_its_name():
    from remat.planner._saved import option

    split = Segments.of(((4, ("hidden", "out")), (2, NO_CHECKPOINT)))
    assert str(split) == "layers 0-3: names:hidden,out; 4-5: no_checkpoint"
    assert option(str(split)).parts == split.parts
    with pytest.raises(ValueError, match="not a split of consecutive layers"):
        option("layers 0-3: nothing; 5-5: dots")


def test_splits_pair_the_options_no_other_beats():
    # per trip: (ms, kept) of no checkpoint, nothing, dots, and a dominated option
    assert pareto_pairs([0.0, 3.0, 1.0, 2.0], [10, 1, 4, 5]) == [(1, 2), (1, 0), (2, 0)]


def _scanned_step(depth):
    """benchmarks.scanned_oracle's step, its arrays drawn in one compiled program."""
    losses = []

    def arrays():
        loss, args = scanned_step(depth=depth)
        losses.append(loss)
        return args

    args = jax.jit(arrays)()
    return losses[0], args


def _split_plan():
    loss, (params, x) = _scanned_step(DEPTH)
    p = remat.plan(loss, params, x, memory_budget=0.5, measure=False)
    assert p.feasible and p.chosen is not None and p.chosen.temp_bytes is not None
    assert p.chosen.temp_bytes <= p.limit_bytes
    assert sum(c.compiled is not None for c in p.candidates) <= 6
    (chosen,) = p.chosen.policies
    assert isinstance(chosen, Segments), p.chosen.label  # this budget sits between "nothing" and "dots"
    return p, chosen, loss, params, x


@pytest.mark.slow  # at this machine's calibrated rates; the default run's sibling, at fixed
# rates: test_the_default_search_finds_the_faster_split_left_under_the_limit
def test_the_default_search_splits_a_stack_where_no_single_option_fits_as_fast():
    _split_plan()


def test_a_one_layer_last_part_of_the_last_region_keeps_only_its_copy():
    # per trip: (ms, kept) of no checkpoint, nothing, dots; two stacks of six, scanning 2 bytes each
    costs = RegionCosts(ms=[[0.0, 3.0, 1.0]] * 2, kept=[[10, 1, 4]] * 2, options=[NO_CHECKPOINT, "nothing", "dots"],
                        trips=[DEPTH, DEPTH])
    split, _ = with_splits(costs, [DEPTH, DEPTH], [2, 2])
    kept = {str(o): (split.kept[0][j], split.kept[1][j]) for j, o in enumerate(split.options)}
    # one layer is no loop: its backward follows its forward at once, so in the last region
    # it keeps nothing beyond its working set; one copy of the scanned operands (their gradients')
    assert kept["layers 0-4: dots; 5-5: no_checkpoint"] == (round((5 * 4 + 10 + 2) / 6), round((5 * 4 + 2) / 6))
    # two loops: two copies, and every layer's kept bytes
    assert kept["layers 0-2: dots; 3-5: no_checkpoint"] == (round((3 * 4 + 3 * 10 + 4) / 6),) * 2


def test_the_default_search_finds_the_faster_split_left_under_the_limit():
    """At budget 0.5 the oracle's stack fits no option on all layers faster than
    ``nothing`` (all ``dots`` compiles 1% over); of the splits, five layers of
    ``dots_no_batch`` and the last one un-checkpointed fits (its last layer, no loop, keeps
    nothing for later) and recomputes least. The search used to stop at layers 0-2
    ``nothing``, 0.47 MiB under the limit, the model pricing that split over it."""
    loss, (params, x) = _scanned_step(DEPTH)
    p = remat.plan(loss, params, x, memory_budget=0.5, measure=False, rates=UNCALIBRATED)
    assert p.chosen is not None and p.chosen.temp_bytes is not None and p.chosen.temp_bytes <= p.limit_bytes
    assert p.chosen.policies == (Segments.of(((DEPTH - 1, "dots_no_batch"), (1, NO_CHECKPOINT))),), p.chosen.label
    assert sum(c.compiled is not None for c in p.candidates) <= 3


@pytest.mark.slow
def test_a_planned_split_keeps_the_gradients_and_saves_and_loads(tmp_path):
    p, chosen, loss, params, x = _split_plan()
    unchecked = jax.jit(jax.grad(apply_policies(loss, (NO_CHECKPOINT,))))(params, x)
    planned = jax.jit(jax.grad(p.apply(loss)))(params, x)
    for a, b in zip(jax.tree.leaves(planned), jax.tree.leaves(unchecked), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    (row,) = remat.planner.region_choices(p, loss, params, x)
    assert row["policy"] == str(chosen) and row["predicted_bytes"] > 0 and row["measured_bytes"] > 0
    # saved and loaded: the same split, the same gradients, bitwise
    p.save(tmp_path / "plan.json")
    loaded = remat.Plan.load(tmp_path / "plan.json")
    assert loaded.chosen is not None and loaded.chosen.policies[0].parts == chosen.parts
    _assert_bitwise(jax.jit(jax.grad(loaded.apply(loss)))(params, x), planned)
    # on a stack of another depth the loaded plan is refused in one line, before it runs
    other, (deeper, _) = _scanned_step(DEPTH + 2)
    with pytest.raises(PlanMismatch, match="a stack of 8 layers"):
        jax.grad(loaded.apply(other))(deeper, x)


@pytest.mark.slow
def test_the_oracle_of_a_tiny_stack_holds_the_plans_program():
    """benchmarks.optimality's oracle for the scanned step, on three layers and three
    options (15 compiles): the plan's program is one of the oracle's, it fits, and no
    assignment the oracle compiled is leaner than the least the plan reports."""
    from benchmarks.optimality import _compile_oracle

    options = ("no_checkpoint", "nothing", "dots")
    loss, args = scanned_step(depth=3)
    todo = assignments(3, options)
    assert len(todo) == 15
    oracle = _compile_oracle(loss, args, todo, lambda line: None)
    none = next(r for r in oracle if r["label"] == "no_checkpoint")
    p = remat.plan(loss, *args, memory_budget=0.5, measure=False, policies=("nothing", "dots"))
    assert p.chosen is not None and p.chosen.temp_bytes <= 0.5 * none["temp_bytes"]
    assert p.chosen.program in {r["program"] for r in oracle}
    assert min(r["temp_bytes"] for r in oracle) <= p.chosen.temp_bytes


def test_why_says_in_one_line_why_a_scanned_stack_was_not_split():
    def two_regions(params, x):
        def body(h, w):
            return remat.checkpoint(_block, w, remat.checkpoint(_block, w, h)), None
        return jnp.mean(jax.lax.scan(body, x, params)[0] ** 2)

    p = remat.plan(two_regions, _stack(), X, memory_budget=0.5, measure=False)
    assert not any(isinstance(s, Segments) for c in p.candidates for s in c.policies)
    assert "segment splits not considered for region 0: its scan body holds other regions too " \
           "(a split would give them all one split)" in p.why()

"""The default search plans regions written with ``jax.checkpoint``, ``nnx.remat`` and
``nn.remat`` (unrolled, in a ``lax.scan`` body, an ``nnx.scan`` over an ``nnx.vmap``
stack, a ``flax.linen.scan`` stack) as it plans ``remat.checkpoint`` regions: the plan
fits, keeps the gradients, names the regions in a saved plan, and leaves the step as
traced outside the plan unchanged. The module runs under ``JAX_REMAT3=1`` too
(``test_the_regions_are_planned_under_jax_remat3``)."""
from __future__ import annotations

import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REMAT3, needs_remat3, remat3_set
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import remat
from remat.analysis import saved_residuals
from remat.analysis.compiled import CompiledMemory
from remat.analysis.machine import current_rates
from remat.planner import region_choices
from remat.planner._costs import region_costs
from remat.planner.steering import PlanMismatch, apply_policies, survey
from remat.policies import NO_CHECKPOINT

DEPTH, WIDTH, BATCH = 4, 32, 64


def _block(w, h):
    return h + jnp.tanh(h @ w["w1"]) @ w["w2"]


def _normal(rng, shape, scale=1.0):
    """A float32 normal draw by NumPy, put on the device as it is: jax.random compiles a program
    for each shape it draws (at XLA's level 0 as long as the steps' own compiles)."""
    return jax.device_put((rng.standard_normal(shape) * scale).astype(np.float32))


def _weights(seed, *lead, hidden=4 * WIDTH):
    rng = np.random.default_rng(seed)
    return {"w1": _normal(rng, (*lead, WIDTH, hidden), WIDTH ** -0.5),
            "w2": _normal(rng, (*lead, hidden, WIDTH), hidden ** -0.5)}


@functools.cache
def _batch():
    return _normal(np.random.default_rng(1), (BATCH, WIDTH))


@functools.cache  # each step built once (a pure function and its arrays)
def _unrolled_step():
    def loss(params, x):
        for w in params:
            x = jax.checkpoint(_block)(w, x)
        return jnp.mean(x ** 2)

    return loss, [_weights(i) for i in range(DEPTH)], _batch()


@functools.cache
def _lax_step():
    def loss(params, x):
        def body(h, w):
            return jax.checkpoint(_block, policy=jax.checkpoint_policies.dots_saveable)(w, h), None
        h, _ = jax.lax.scan(body, x, params)
        return jnp.mean(h ** 2)

    return loss, _weights(0, DEPTH), _batch()


class _Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
        self.down = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

    def __call__(self, h):
        return h + self.down(jnp.tanh(self.up(h)))


def _nnx_step():
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return _Block(nnx.Rngs(key))

    graphdef, state = nnx.split(make(jax.random.split(jax.random.key(0), DEPTH)))

    def loss(state, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        @nnx.remat
        def body(layer, h):
            return layer(h)
        return jnp.mean(body(nnx.merge(graphdef, state), x) ** 2)

    return loss, state, _batch()


class _LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return h + nn.Dense(WIDTH)(jnp.tanh(nn.Dense(4 * WIDTH)(h))), None


class _LinenStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        layers = nn.scan(nn.remat(_LinenBlock), variable_axes={"params": 0}, split_rngs={"params": True},
                         length=DEPTH)
        return layers(name="layers")(x, None)[0]


def _linen_step():
    model, x = _LinenStack(), _batch()
    params = model.init(jax.random.PRNGKey(0), x)

    def loss(params, x):
        return jnp.mean(model.apply(params, x) ** 2)

    return loss, params, x


# the step, its regions, what wrote them, and a budget it can meet (four unrolled blocks
# need more than half: the last block's working set stays live)
STEPS = {"unrolled jax.checkpoint": (_unrolled_step, DEPTH, "jax.checkpoint", 0.6),
         "jax.checkpoint in a lax.scan": (_lax_step, 1, "jax.checkpoint", 0.5),
         "nnx.remat in an nnx.scan": (_nnx_step, 1, "nnx.remat", 0.5),
         "nn.remat in a linen scan": (_linen_step, 1, "nn.remat", 0.5)}


def _unchecked_grads(step, params, x, regions):
    """The step's gradients with no region checkpointed (each foreign region a plain call)."""
    foreign = tuple(range(regions))
    return jax.jit(jax.grad(apply_policies(step, (NO_CHECKPOINT,) * regions, foreign=foreign)))(params, x)


def _assert_equal_grads(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _planned_by_default_search(name):
    """Plans ``STEPS[name]`` and checks the plan: the default search's few compiles, within
    the budget, the un-checkpointed gradients, and the step outside the plan unchanged."""
    make, regions, writer, budget = STEPS[name]
    step, params, x = make()
    traced_before = str(jax.make_jaxpr(step)(params, x))
    lowered_before = jax.jit(jax.grad(step)).lower(params, x).as_text()
    surveyed = survey(step, params, x)
    assert surveyed.regions == regions and surveyed.foreign == tuple(range(regions))
    assert {path[0] for path in surveyed.paths} == {writer}

    p = remat.plan(step, params, x, memory_budget=budget, measure=False)
    labels = {c.label for c in p.candidates}
    # the default search, not the compile-everything families: about two compiles
    assert "as written" not in labels and not any(label.startswith("whole step") for label in labels)
    assert sum(c.compiled is not None for c in p.candidates) <= 4
    assert p.feasible and p.chosen is not None and p.chosen.temp_bytes is not None
    assert p.chosen.temp_bytes <= p.limit_bytes < p.none_temp_bytes
    assert p.num_regions == regions and p.foreign_regions == tuple(range(regions))

    # the plan's memory is real: the planned step compiles to the chosen candidate's temp bytes
    compiled = jax.jit(jax.grad(p.apply(step))).lower(params, x).compile()
    assert CompiledMemory.from_compiled(compiled).temp_bytes == p.chosen.temp_bytes
    _assert_equal_grads(compiled(params, x), _unchecked_grads(step, params, x, regions))
    # nothing leaked: the step traced and lowered outside the plan is the step as written
    assert str(jax.make_jaxpr(step)(params, x)) == traced_before
    assert jax.jit(jax.grad(step)).lower(params, x).as_text() == lowered_before


# the lax.scan form by default; the unrolled one and the two Flax forms (each compiles like the
# lax.scan one, through Flax's own remat) with -m slow
@pytest.mark.parametrize("name", [n if "lax" in n else pytest.param(n, marks=pytest.mark.slow) for n in STEPS])
def test_the_default_search_plans_foreign_regions(name):
    _planned_by_default_search(name)


# two more default searches: slow; in the default run test_the_default_search_plans_foreign_regions
# plans the lax.scan step alone, and test_foreign_regions_take_their_place_among_remat_regions
# steers a foreign region beside remat.checkpoint ones
@pytest.mark.slow
def test_a_foreign_region_is_planned_as_its_remat_checkpoint_twin():
    step, params, x = _lax_step()

    def twin(params, x):  # the same step, its body checkpointed with remat.checkpoint
        def body(h, w):
            return remat.checkpoint(_block, w, h, policy="dots"), None
        h, _ = jax.lax.scan(body, x, params)
        return jnp.mean(h ** 2)

    plans = [remat.plan(f, params, x, memory_budget=0.5, measure=False) for f in (step, twin)]
    compiled = [{(c.label, c.temp_bytes) for c in p.candidates if c.compiled is not None} for p in plans]
    assert compiled[0] == compiled[1]
    assert plans[0].chosen is not None and plans[1].chosen is not None
    assert plans[0].chosen.label == plans[1].chosen.label


# jax_remat3 makes jax.checkpoint emit another construct (a RematTraced call), which the
# planner rewrites as the classic one; set here for this thread only (JAX's config context).
# Slow (a second default search of the steps above); in the default run
# test_a_foreign_regions_names_are_options_under_either_construct[True] surveys, costs, steers
# and differentiates foreign regions under jax_remat3, and CI's JAX_REMAT3=1 run of the fast
# suite plans the lax.scan step of test_the_default_search_plans_foreign_regions under it
@pytest.mark.slow
@needs_remat3
@pytest.mark.parametrize("name", list(STEPS))
def test_the_regions_are_planned_under_jax_remat3(name):
    with remat3_set(True):
        step, params, x = STEPS[name][0]()
        assert "RematTraced" in str(jax.make_jaxpr(step)(params, x))
        _planned_by_default_search(name)


@functools.cache
def _mixed_step():
    """A remat.checkpoint block, a wider block written with jax.checkpoint, and a remat.checkpoint block."""
    def loss(params, x):
        x = remat.checkpoint(_block, params[0], x)
        x = jax.checkpoint(_wide_block)(params[1], x)
        return jnp.mean(remat.checkpoint(_block, params[2], x) ** 2)

    return loss, [_weights(30), _weights(31, hidden=8 * WIDTH), _weights(32)], _batch()


def _wide_block(w, h):
    return h + jnp.tanh(h @ w["w1"]) @ w["w2"]


def test_foreign_regions_take_their_place_among_remat_regions():
    step, params, x = _mixed_step()
    surveyed = survey(step, params, x)
    assert surveyed.regions == 3 and surveyed.foreign == (1,)
    assert surveyed.paths[0] is None and surveyed.paths[1] == ("jax.checkpoint", "_wide_block", 3)

    def kept(*policies):
        return saved_residuals(apply_policies(step, policies, foreign=surveyed.foreign), params, x).residual_bytes

    # un-checkpointed, a region keeps its hidden activation (4 or 8 widths a row): each
    # position of the plan steers its own region
    lean = kept("nothing", "nothing", "nothing")
    assert kept(NO_CHECKPOINT, "nothing", "nothing") - lean >= BATCH * 4 * WIDTH * 4
    assert kept("nothing", NO_CHECKPOINT, "nothing") - lean >= BATCH * 8 * WIDTH * 4
    assert kept("nothing", NO_CHECKPOINT, "nothing") > kept(NO_CHECKPOINT, "nothing", "nothing")
    planned = apply_policies(step, ("dots", NO_CHECKPOINT, "nothing"), foreign=surveyed.foreign)
    _assert_equal_grads(jax.jit(jax.grad(planned))(params, x), jax.jit(jax.grad(step))(params, x))


def test_a_saved_plan_names_foreign_regions_refuses_another_step_and_reports_bytes(tmp_path):
    step, params, x = _mixed_step()
    p = remat.plan(step, params, x, memory_budget=0.9, measure=False)
    assert p.chosen is not None and p.foreign_regions == (1,)
    p.save(tmp_path / "plan.json")
    saved = json.loads((tmp_path / "plan.json").read_text())["regions"]
    assert saved[1]["path"] == ["jax.checkpoint", "_wide_block", 3] and saved[1]["foreign"] is True
    assert "foreign" not in saved[0]

    loaded = remat.Plan.load(tmp_path / "plan.json")
    assert loaded.foreign_regions == (1,) and loaded.region_paths == p.region_paths
    # both from one compiled program (compiled apart, a compile more)
    got, want = jax.jit(lambda *a: (jax.grad(loaded.apply(step))(*a), jax.grad(p.apply(step))(*a)))(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))

    def renamed(params, x):  # the middle block checkpoints another function
        x = remat.checkpoint(_block, params[0], x)
        x = jax.checkpoint(_block)(params[1], x)
        return jnp.mean(remat.checkpoint(_block, params[2], x) ** 2)

    def without(params, x):  # the middle block is not checkpointed
        x = remat.checkpoint(_block, params[0], x)
        x = _wide_block(params[1], x)
        return jnp.mean(remat.checkpoint(_block, params[2], x) ** 2)

    def shorter(params, x):  # the last block is not checkpointed
        x = remat.checkpoint(_block, params[0], x)
        x = jax.checkpoint(_wide_block)(params[1], x)
        return jnp.mean(_block(params[2], x) ** 2)

    # the errors number the regions among all the step's, foreign and remat's own alike
    for other, says in [(renamed, "region 1 is jax.checkpoint(_block) with 3 inputs here, "
                                  "jax.checkpoint(_wide_block) with 3 inputs in the plan"),
                        (without, "region 1 (jax.checkpoint(_wide_block) with 3 inputs) is missing"),
                        (shorter, "it has 2 remat.checkpoint regions, the step 1; region 2 (a region "
                                  "written by hand) is missing")]:
        with pytest.raises(PlanMismatch) as e:  # when traced (run eagerly, each operation compiles alone)
            jax.eval_shape(jax.grad(loaded.apply(other)), params, x)
        assert says in str(e.value) and "\n" not in str(e.value)

    # a plan whose options are known (the saved one, edited): each region's bytes, the
    # foreign one's too
    edited = json.loads((tmp_path / "plan.json").read_text())
    for region, option in zip(edited["regions"], ["nothing", "no_checkpoint", "nothing"]):
        region["option"] = option
    (tmp_path / "plan.json").write_text(json.dumps(edited))
    chosen = remat.Plan.load(tmp_path / "plan.json")

    regions = region_choices(chosen, step, params, x)
    assert [r["path"] for r in regions] == [None, "jax.checkpoint(_wide_block) with 3 inputs", None]
    assert [r["policy"] for r in regions] == ["nothing", "no_checkpoint", "nothing"]
    assert regions[0]["measured_bytes"] == regions[2]["measured_bytes"] == 0
    # the wide block un-checkpointed keeps at least its hidden activation, 8 widths a row;
    # the model's figure is its body's own residuals, within a boundary value
    wide = regions[1]
    assert wide["measured_bytes"] >= BATCH * 8 * WIDTH * 4
    # the model counts what XLA keeps: the matmul output, not its tanh (recomputed where read),
    # so at most JAX's residuals (as in test_planner_monotone)
    assert BATCH * 8 * WIDTH * 4 <= wide["predicted_bytes"] <= wide["measured_bytes"]


def test_foreign_regions_are_left_as_written_where_remat_regions_are_out_of_sight():
    def loss(params, x):
        def turn(carry):  # a remat.checkpoint region in a while loop: the jaxpr's walk skips it
            i, h = carry
            return i + 1, remat.checkpoint(_block, params[0], h)
        _, x = jax.lax.while_loop(lambda c: c[0] < 2, turn, (0, x))
        return jnp.mean(jax.checkpoint(_block)(params[1], x) ** 2)

    params = [_weights(40), _weights(41)]
    surveyed = survey(loss, params, _batch())
    # the foreign region's place among remat's is not known: only remat's own is planned
    assert surveyed.regions == 1 and surveyed.foreign == () and surveyed.paths == [None]


def _tagged_block(w, h):
    return h + checkpoint_name(jnp.tanh(h @ w["w1"]), "hidden") @ w["w2"]


def _tagged_loss(params, x):
    for w in params:
        x = jax.checkpoint(_tagged_block)(w, x)
    return jnp.mean(x ** 2)


# where JAX has jax_remat3, the classic construct with -m slow: the default run's True case
# surveys, costs and steers the same regions, and the tests above plan the classic construct
@pytest.mark.parametrize("remat3", [pytest.param(False, marks=() if REMAT3 is None else pytest.mark.slow),
                                    pytest.param(True, marks=needs_remat3)])
def test_a_foreign_regions_names_are_options_under_either_construct(remat3):
    params, x = [_weights(50), _weights(51)], _batch()
    with remat3_set(remat3):
        surveyed = survey(_tagged_loss, params, x)
        assert surveyed.names == ["hidden"] and surveyed.foreign == (0, 1)
        costs = region_costs(_tagged_loss, (params, x), 2, [NO_CHECKPOINT, "nothing", ("hidden",)],
                             rates=current_rates())

        def kept(policy):
            planned = apply_policies(_tagged_loss, (policy,) * 2, foreign=surveyed.foreign)
            return saved_residuals(planned, params, x).residual_bytes

        # keeping the tag keeps each block's hidden activation (4 widths a row) beyond "nothing"
        hidden = BATCH * 4 * WIDTH * 4
        assert kept(("hidden",)) - kept("nothing") == 2 * hidden
        assert costs is not None and [k[2] - k[1] for k in costs.kept] == [hidden, hidden]
        planned = apply_policies(_tagged_loss, (("hidden",), "nothing"), foreign=surveyed.foreign)
        _assert_equal_grads(jax.jit(jax.grad(planned))(params, x), jax.jit(jax.grad(_tagged_loss))(params, x))


def test_a_residual_budget_is_an_option_for_a_foreign_region():
    step, params, x = _lax_step()

    def kept(policy):
        return saved_residuals(apply_policies(step, (policy,), foreign=(0,)), params, x).residual_bytes

    # the budget picks the region's policy from its body (4 trips of it here): a larger
    # budget keeps more, all of it keeps what no checkpoint keeps
    half, whole = kept(remat.residual_budget(0.5)), kept(remat.residual_budget(1.0))
    assert kept("nothing") < half < whole <= kept(NO_CHECKPOINT)
    planned = apply_policies(step, (remat.residual_budget(0.5),), foreign=(0,))
    _assert_equal_grads(jax.jit(jax.grad(planned))(params, x), jax.jit(jax.grad(step))(params, x))


def test_a_rewritten_region_lowers_as_remats_and_saves_memory():
    step, params, x = _unrolled_step()

    def temp_bytes(fn):
        return CompiledMemory.from_compiled(jax.jit(jax.grad(fn)).lower(params, x).compile()).temp_bytes

    foreign = tuple(range(DEPTH))
    unchecked = temp_bytes(apply_policies(step, (NO_CHECKPOINT,) * DEPTH, foreign=foreign))
    # rewritten with policy "nothing", each region's recomputation waits for its cotangent
    # (remat's lowering), so the step keeps less than un-checkpointed, and less than as
    # written, which XLA:CPU may schedule early (docs/memory.md)
    planned = temp_bytes(apply_policies(step, ("nothing",) * DEPTH, foreign=foreign))
    assert planned < unchecked and planned <= temp_bytes(step)

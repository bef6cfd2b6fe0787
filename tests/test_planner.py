"""remat.plan: re-deciding every region of a step, within a compiled-memory budget."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from programs import WS, B, D, L, X, loss, tagged_loss

import remat
from remat.analysis import saved_residuals
from remat.planner import plan
from remat.planner.steering import apply_policies, count_regions
from remat.policies import NO_CHECKPOINT as NONE


def test_count_regions_and_apply_policies_change_what_is_kept():
    assert count_regions(loss, WS, X) == L
    everything = saved_residuals(apply_policies(loss, ["everything"] * L), WS, X).residual_bytes
    nothing = saved_residuals(apply_policies(loss, ["nothing"] * L), WS, X).residual_bytes
    plain = saved_residuals(apply_policies(loss, [NONE] * L), WS, X).residual_bytes
    assert nothing < everything and nothing < plain
    mixed = saved_residuals(apply_policies(loss, ["nothing"] * 2 + [NONE] * 2), WS, X).residual_bytes
    assert nothing < mixed < plain


def test_apply_policies_keeps_gradients():
    g0 = jax.grad(lambda ws: loss(ws, X))(WS)
    for specs in (["nothing"] * L, [NONE] * L, ["dots", NONE, remat.residual_budget(0.5), "nothing"]):
        g = jax.grad(lambda ws, specs=specs: apply_policies(loss, specs)(ws, X))(WS)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_plan_fits_or_says_why_and_gradients_match():
    p = plan(loss, WS, X, memory_budget=1.0, repeat=2, budget_fractions=(0.5,), exhaustive=True)
    assert p.feasible and p.chosen.temp_bytes <= p.limit_bytes
    assert p.chosen.measured_ms == min(c.measured_ms for c in p.candidates if c.fits)
    labels = {c.label for c in p.candidates}
    assert {"no checkpoint", "all: nothing", "all: dots", "all: residual_budget(0.5)"} <= labels
    g = jax.grad(lambda ws: p.apply(loss)(ws, X))(WS)
    g0 = jax.grad(lambda ws: loss(ws, X))(WS)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # the predictions use this machine's measured rates, not the built-in defaults
    from remat.analysis import machine

    assert machine.calibrated() and machine.current_rates().flops_per_s != 2.0e10
    # and XLA:CPU's temp buffers over glibc's mmap threshold cost their page faults
    from remat.analysis.allocator import glibc

    assert (machine.current_rates().fault_s_per_byte > 0) == (glibc() is not None and jax.default_backend() == "cpu")
    assert all(c.predicted_ms > 0 for c in p.candidates)
    # the timed executables are the compiled candidates themselves (no second compile)
    assert all(c.compiled is not None for c in p.candidates)
    tiny = plan(loss, WS, X, memory_budget=1e-6, measure=False, budget_fractions=(), exhaustive=True)
    assert not tiny.feasible and tiny.chosen is None
    assert tiny.minimum_bytes == min(c.temp_bytes for c in tiny.candidates)
    with pytest.raises(ValueError, match="cannot be met"):
        tiny.apply(loss)
    assert "cannot be met" in str(tiny)


@pytest.mark.parametrize("bad", [-0.1, 1.5, True])
def test_plan_rejects_bad_budgets(bad):
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        plan(loss, WS, X, memory_budget=bad)


def test_plan_needs_a_checkpointed_region():
    with pytest.raises(ValueError, match="no checkpointed region"):
        plan(lambda x: (x**2).sum(), X, memory_budget=0.5)


def test_plan_cli_json_and_bad_budget(capsys):
    import json

    from remat.cli import main

    rc = main(["plan", "mlp", "--budget", "1.0", "--depth", "2", "--repeat", "1", "--json"])
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert rc == 0 and out["feasible"] and out["num_regions"] == 2
    assert out["chosen"]["temp_bytes"] <= out["limit_bytes"]
    assert {"no checkpoint", "all: nothing", "all: dots"} <= {c["label"] for c in out["candidates"]}
    # the plan's and the compiles' seconds, each region's choice, the progress lines
    # (test_planner_monotone's command test, slow, the same at depth 3)
    assert out["plan_s"] > 0 and out["compile_s"] > 0
    assert [r["index"] for r in out["regions"]] == [0, 1]
    assert all({"policy", "predicted_bytes", "measured_bytes", "path"} <= r.keys() for r in out["regions"])
    assert "candidates compiled" in captured.err and "best so far" in captured.err
    assert main(["plan", "mlp", "--budget", "-0.5"]) == 2
    assert "--budget -0.5: use a fraction in [0, 1]" in capsys.readouterr().err


@pytest.mark.slow
def test_plan_cli_exhaustive_compiles_every_family(capsys):
    import json

    from remat.cli import main

    rc = main(["plan", "mlp", "--budget", "1.0", "--depth", "2", "--repeat", "1", "--json", "--exhaustive"])
    out = json.loads(capsys.readouterr().out)
    labels = {c["label"] for c in out["candidates"]}
    assert rc == 0 and {"as written", "all: residual_budget(0.5)", "whole step: nothing, regions as written"} <= labels
    assert all(c["temp_bytes"] is not None for c in out["candidates"]) and out["jit_s"] > 0


def _scan_step():
    depth, width = 8, 32

    def layer(p, h):
        return h + jnp.tanh(jax.nn.gelu(h @ p["w1"]) @ p["w2"])

    params = {"w1": jnp.stack([jnp.eye(width) * 0.3] * depth), "w2": jnp.stack([jnp.eye(width) * 0.2] * depth)}
    x = jnp.linspace(-1, 1, 64 * width).reshape(64, width)

    def step(p, x):
        return (remat.scan_layers(layer, p, x, policy="dots") ** 2).mean()

    return step, params, x


@pytest.mark.slow
def test_plan_chooses_the_scan_policy_and_segment_length():
    from remat.analysis import compiled_memory
    from remat.planner.steering import scan_depths

    step, params, x = _scan_step()
    assert scan_depths(step, params, x) == [8] and count_regions(step, params, x) == 0
    p = plan(step, params, x, memory_budget=0.6, measure=False, exhaustive=True)  # every schedule compiled
    labels = {c.label for c in p.candidates}
    for policy in ("nothing", "dots_no_batch", "dots"):
        assert {f"scan: {policy}, flat", f"scan: {policy}, 2 groups", f"scan: {policy}, 4 groups"} <= labels
    none = next(c for c in p.candidates if c.label == "no checkpoint")
    assert none.scan == (NONE, None)  # the baseline leaves the scan unchecked
    assert all(c.temp_bytes <= none.temp_bytes for c in p.candidates)
    assert p.feasible and p.chosen.temp_bytes <= p.limit_bytes and p.chosen.scan is not None
    applied = p.apply(step)
    assert compiled_memory(applied, params, x).temp_bytes == p.chosen.temp_bytes
    g, g0 = jax.grad(applied)(params, x), jax.grad(step)(params, x)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    nested = apply_policies(step, (), scan=("nothing", 4))
    for a, b in zip(jax.tree.leaves(jax.grad(nested)(params, x)), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert p.to_dict()["chosen"]["scan"]["policy"] in ("nothing", "dots_no_batch", "dots")


@pytest.mark.slow
def test_plan_tries_the_checkpoint_names_the_step_tags():
    from remat._core.residuals import checkpoint_names

    assert checkpoint_names(tagged_loss, WS, X) == ["hidden", "out"]
    p = plan(tagged_loss, WS, X, memory_budget=1.0, repeat=1, budget_fractions=(), exhaustive=True)
    by_label = {c.label: c for c in p.candidates}
    both, hidden = by_label["all: names:hidden,out"], by_label["all: names:hidden"]
    assert "all: names:out" in by_label
    assert both.policies == (("hidden", "out"),) * L
    # keeping two (B, D) values per block costs temp memory that keeping one does not
    nothing = by_label["all: nothing"]
    assert nothing.temp_bytes < hidden.temp_bytes < both.temp_bytes
    # the applied candidate keeps exactly the tagged values of every block
    kept = saved_residuals(apply_policies(tagged_loss, both.policies), WS, X)
    assert sorted(kept.named().items()) == [("hidden", L * B * D * 4), ("out", L * B * D * 4)]
    g0 = jax.grad(tagged_loss)(WS, X)
    g = jax.grad(apply_policies(tagged_loss, both.policies))(WS, X)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _sequential_step(segments=2, n=8, width=64):
    ws = [jnp.eye(width) * 0.5 + 0.01 * i for i in range(n)]
    x = jnp.linspace(-1, 1, 32 * width).reshape(32, width)

    def loss(ws, x):
        layers = [lambda h, w=w: jnp.tanh(jnp.sin(h @ w) * 1.5) for w in ws]
        return (remat.checkpoint_sequential(layers, segments, x) ** 2).mean()

    return loss, ws, x


@pytest.mark.slow
def test_plan_re_decides_checkpoint_sequential_segments():
    from remat.planner.steering import survey as _survey

    loss, ws, x = _sequential_step()
    survey = _survey(loss, ws, x)
    assert survey.sequential_lengths == [8] and survey.regions == 1  # segments=2: one chunk
    p = plan(loss, ws, x, memory_budget=1.0, repeat=1, budget_fractions=(), policies=("nothing",))
    by_label = {c.label: c for c in p.candidates}
    assert {"sequential: 2 segments", "sequential: 3 segments", "sequential: 4 segments",
            "sequential: 8 segments"} <= set(by_label)
    # each candidate is the program checkpoint_sequential writes with that many segments
    for k in (3, 8):
        written, _, _ = _sequential_step(segments=k)
        expected = jax.jit(jax.grad(written)).lower(ws, x).compile().memory_analysis().temp_size_in_bytes
        assert by_label[f"sequential: {k} segments"].temp_bytes == expected
        assert by_label[f"sequential: {k} segments"].sequential == k
    # more checkpointed segments keep less than one checkpointed half
    assert by_label["sequential: 8 segments"].temp_bytes < by_label["sequential: 2 segments"].temp_bytes
    g0 = jax.grad(lambda w: _sequential_step(segments=1)[0](w, x))(ws)
    g = jax.grad(apply_policies(loss, (), sequential=4))(ws, x)
    for a, b in zip(g0, g):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert p.to_dict()["candidates"][-1].keys() >= {"sequential_segments"}


@pytest.mark.slow
def test_equal_programs_are_timed_once_and_share_their_time():
    p = plan(loss, WS, X, memory_budget=1.0, repeat=2, budget_fractions=(), policies=("nothing", "dots"),
             exhaustive=True)
    by_label = {c.label: c for c in p.candidates}
    # remat.checkpoint's default policy is "nothing": the same program, spelled twice
    written, nothing, dots = by_label["as written"], by_label["all: nothing"], by_label["all: dots"]
    assert written.program == nothing.program != dots.program
    assert written.measured_ms == nothing.measured_ms
    assert len({c.program for c in p.candidates}) < len(p.candidates)
    assert p.to_dict()["candidates"][0]["program"] == p.candidates[0].program


@pytest.mark.slow
def test_plan_weighs_binomial_scan_schedules():
    from remat.planner import Binomial
    from remat.scan import binomial_schedule

    step, params, x = _scan_step()
    p = plan(step, params, x, memory_budget=1.0, measure=False, policies=("nothing",), exhaustive=True)
    by_label = {c.label: c for c in p.candidates}
    for levels in (1, 2):
        c = by_label[f"scan: nothing, binomial(levels={levels}) {binomial_schedule(8, levels)}"]
        assert c.scan == ("nothing", Binomial(levels))
        assert c.to_dict()["scan"]["groups"] == f"binomial(levels={levels})"

        # the candidate is the program scan_layers writes with that schedule
        def written(p_, x_, levels=levels):
            layer = lambda q, h: h + jnp.tanh(jax.nn.gelu(h @ q["w1"]) @ q["w2"])  # noqa: E731
            return (remat.scan_layers(layer, p_, x_, policy="nothing", levels=levels) ** 2).mean()

        expected = jax.jit(jax.grad(written)).lower(params, x).compile().memory_analysis().temp_size_in_bytes
        assert c.temp_bytes == expected
        g = jax.grad(apply_policies(step, (), scan=c.scan))(params, x)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(jax.grad(step)(params, x))):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_budget_zero_is_the_leanest_plan_and_whole_step_keeps_only_inputs_on_two_blocks():
    _budget_zero_is_the_leanest_plan_and_whole_step_keeps_only_inputs(WS[:2])


# slow: test_budget_zero_is_the_leanest_plan_and_whole_step_keeps_only_inputs_on_two_blocks runs the same
# search on two of the four blocks
@pytest.mark.slow
def test_budget_zero_is_the_leanest_plan_and_whole_step_keeps_only_inputs():
    _budget_zero_is_the_leanest_plan_and_whole_step_keeps_only_inputs(WS)


def _budget_zero_is_the_leanest_plan_and_whole_step_keeps_only_inputs(WS):
    p = plan(loss, WS, X, memory_budget=0, measure=False, policies=("nothing",), budget_fractions=(), exhaustive=True)
    by = {c.label: c for c in p.candidates}
    nothing, none = by["all: nothing"], by["no checkpoint"]
    whole_plain = by["whole step: nothing, regions no_checkpoint"]
    whole_nested = by["whole step: nothing, regions as written"]
    # the whole step checkpointed keeps no computed value, only the step's inputs
    assert whole_plain.residual_bytes == whole_nested.residual_bytes == 0
    assert nothing.residual_bytes > 0 and none.residual_bytes > nothing.residual_bytes
    # nested inside it, the regions still bound the temp memory; without them it is none's
    assert whole_nested.temp_bytes <= 1.01 * nothing.temp_bytes
    assert whole_plain.temp_bytes > nothing.temp_bytes
    # budget 0: the candidates within 1% of the least temp memory found, then the fastest
    assert p.feasible and p.chosen.temp_bytes == pytest.approx(p.minimum_bytes, rel=0.01)
    assert p.chosen.temp_bytes <= 1.01 * nothing.temp_bytes
    leanest = [c for c in p.candidates if c.fits]
    assert whole_nested.label in {c.label for c in leanest} and len(leanest) < len(p.candidates)
    assert p.chosen.predicted_ms == min(c.predicted_ms for c in leanest)
    # the whole step checkpointed recomputes the forward once more: slower than the regions alone
    assert p.chosen.predicted_ms < whole_nested.predicted_ms
    g = jax.grad(lambda ws: p.apply(loss)(ws, X))(WS)
    g0 = jax.grad(lambda ws: loss(ws, X))(WS)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_equal_lowerings_compile_once_and_early_rejection_changes_no_plan():
    full = plan(loss, WS, X, memory_budget=0.4, measure=False, budget_fractions=(0.5,), early_reject=False,
                exhaustive=True)
    by = {c.label: c for c in full.candidates}
    # written with remat.checkpoint's default policy: "as written" is "all: nothing", compiled once
    assert by["as written"].lowered == by["all: nothing"].lowered
    assert by["as written"].compiled is by["all: nothing"].compiled
    # the prediction early rejection uses (residual bytes, scaled by what XLA kept of the
    # un-checkpointed step's) stays below every candidate's compiled temp memory
    none = by["no checkpoint"]
    folded = min(1.0, none.temp_bytes / none.residual_bytes)
    assert all(c.temp_bytes >= folded * c.residual_bytes for c in full.candidates)
    lean = plan(loss, WS, X, memory_budget=0.4, measure=False, budget_fractions=(0.5,), exhaustive=True)
    rejected = [c for c in lean.candidates if c.compiled is None]
    assert rejected and all(not c.fits and c.temp_bytes is None for c in rejected)
    assert all(not by[c.label].fits for c in rejected if c.label in by)
    # the mixed assignments are sized from what compiled, so early rejection may propose others
    assert all(c.label.startswith("first ") for c in rejected if c.label not in by)
    assert lean.chosen.label == full.chosen.label and lean.chosen.temp_bytes <= lean.limit_bytes
    assert "-" in str(lean)

"""The default search's exact per-region assignment and its cost model, against brute force."""
import dataclasses
import itertools
import random

import jax.numpy as jnp
import pytest
from conftest import DEFAULT_COMPILE
from programs import WS, X, loss

from remat.analysis.machine import UNCALIBRATED, current_rates
from remat.planner import plan
from remat.planner._assign import RegionOption, describe, fastest_within, peak, ranked_within
from remat.planner._costs import region_costs
from remat.policies import NO_CHECKPOINT as NONE


def faults(s_per_byte: float):
    """The default rates with page faults at ``s_per_byte``."""
    return dataclasses.replace(UNCALIBRATED, fault_s_per_byte=s_per_byte)


def _fitting(options, working, limit):
    """Every assignment whose peak is at most ``limit``, with its time: the brute force."""
    fitting = {}
    for choice in itertools.product(*[range(len(o)) for o in options]):
        kept = [options[i][j].kept for i, j in enumerate(choice)]
        if peak(kept, working) <= limit:
            fitting[choice] = sum(options[i][j].ms for i, j in enumerate(choice))
    return fitting


def _random_case(seed, max_regions, ms):
    """Random options (times drawn by ``ms(rng)``), working sets and a limit."""
    rng = random.Random(seed)
    n, k = rng.randint(1, max_regions), rng.randint(1, 4)
    options = [[RegionOption(rng.randint(0, 20), ms(rng)) for _ in range(k)] for _ in range(n)]
    return options, [rng.randint(0, 30) for _ in range(n)], rng.randint(0, 80)


def _brute(options, working, limit):
    fitting = _fitting(options, working, limit)
    return min(((ms, choice) for choice, ms in fitting.items()), default=None)


@pytest.mark.parametrize("seed", range(40))
def test_fastest_within_is_the_brute_force_optimum(seed):
    options, working, limit = _random_case(seed, 5, lambda rng: rng.uniform(0, 10))
    found, brute = fastest_within(options, working, limit), _brute(options, working, limit)
    if brute is None:
        assert found is None
        return
    assert found is not None and found.ms == pytest.approx(brute[0])
    kept = [options[i][j].kept for i, j in enumerate(found.choice)]
    assert peak(kept, working) <= limit and found.peak == peak(kept, working)


@pytest.mark.parametrize("seed", range(40))
def test_ranked_within_lists_every_fitting_assignment_once_fastest_first(seed):
    # integer times: ties, which the ranking must still list each once
    options, working, limit = _random_case(seed, 4, lambda rng: rng.randint(0, 10))
    fitting = _fitting(options, working, limit)
    ranked = list(ranked_within(options, working, limit))
    assert sorted(a.choice for a in ranked) == sorted(fitting)  # all of them, each once
    assert [a.ms for a in ranked] == sorted(fitting.values())  # fastest first
    assert all(a.ms == fitting[a.choice] for a in ranked)


@pytest.mark.parametrize("seed", range(40))
def test_the_fronts_states_are_exactly_those_no_other_matches_or_beats(seed):
    from remat.planner._assign import _undominated

    # small integers: many ties in each coordinate, and duplicates
    rng = random.Random(seed)
    states = [(rng.randint(0, 6), rng.randint(0, 6), rng.randint(0, 6), (i,)) for i in range(rng.randint(0, 60))]
    kept = _undominated(list(states))
    ordered = sorted(states, key=lambda s: s[:3])

    def beaten(i):  # an earlier state in that order matches or beats it everywhere
        return any(all(a <= b for a, b in zip(t[:3], ordered[i][:3])) for t in ordered[:i])

    assert kept == [s for i, s in enumerate(ordered) if not beaten(i)]


def test_peak_counts_the_last_regions_kept_values_only_beyond_its_working_set():
    assert peak([1, 1, 1], [4, 4, 4]) == 6  # regions 0 and 1 kept while region 2 runs
    assert peak([0, 0, 4], [4, 4, 4]) == 4  # the last one kept costs nothing more
    assert peak([5, 5], [1, 1]) == 10  # at the turn to the backward pass, all kept values live
    assert describe(["nothing", "nothing", "dots", "nothing"]) == "nothing x2, dots, nothing"


def test_recompute_cost_is_zero_unchecked_and_least_where_the_policy_saves_the_matmuls():
    costs = region_costs(loss, (WS, X), len(WS), [NONE, "nothing", "dots", "everything"], rates=current_rates())
    assert len(costs.ms) == len(costs.kept) == len(WS)
    for none, nothing, dots, everything in costs.ms:
        assert none == 0.0 and everything == 0.0
        # dots recomputes only the gelu and the tanh: element-wise work that fuses into the
        # backward pass (a FLOP an element, no bytes of its own)
        assert nothing > 10 * dots > 0.0
    activation = X.size * 4  # a (B, D) float32 block input
    for i, (none, nothing, dots, everything) in enumerate(costs.kept):
        # every region but the first takes the previous one's output; the first, the step's argument
        assert nothing == (activation if i else 0)
        assert nothing < dots < none  # dots keeps the two matmuls' outputs
        # un-checkpointed, XLA recomputes the cheap residuals where they are read (GELU's
        # terms); "everything" keeps them all, each saved by the checkpoint as it is
        assert none < everything


def test_recompute_cost_is_the_matmuls_the_backward_pass_recomputes_not_the_fused_element_wise_work():
    import jax

    from remat import checkpoint
    from remat.analysis.machine import op_cost

    # eight element-wise operations in a row: recomputed, XLA fuses them into the
    # backward pass that reads them (a FLOP an element, no bytes of their own)
    def chain(x):
        for _ in range(4):
            x = jnp.sin(x) * 1.5
        return x

    # the backward pass of tanh(x @ w) reads tanh's output, so it recomputes the matmul;
    # that of (x @ w) * 2 reads only x and w, so it recomputes nothing
    def layer(x, w):
        return jnp.tanh(x @ w)

    def linear(x, w):
        return (x @ w) * 2.0

    x = jnp.ones((512, 512))
    aval = jax.ShapeDtypeStruct(x.shape, x.dtype)
    matmul = 1e3 * op_cost("dot_general", [aval, aval], {"dimension_numbers": (([1], [0]), ([], []))}, x.nbytes,
                         current_rates())
    elementwise = region_costs(lambda x: jnp.sum(checkpoint(chain, x)), (x,), 1, [NONE, "nothing"],
                               rates=current_rates()).ms[0]
    assert elementwise[0] == 0.0 and 0.0 < elementwise[1] < 0.01 * matmul
    costs = region_costs(lambda x, w: jnp.sum(checkpoint(layer, x, w)), (x, x), 1, [NONE, "nothing", "dots"],
                         rates=current_rates())
    assert costs.ms[0][0] == 0.0 and 0.0 < costs.ms[0][2] < 0.01 * matmul  # dots keeps the matmul's output
    assert costs.ms[0][1] == pytest.approx(matmul, rel=0.01)
    costs = region_costs(lambda x, w: jnp.sum(checkpoint(linear, x, w)), (x, x), 1, [NONE, "nothing"],
                         rates=current_rates())
    assert costs.ms[0] == [0.0, 0.0]


X64 = jnp.linspace(-1, 1, 64 * X.shape[1]).reshape(64, X.shape[1])


@pytest.fixture(scope="module")
def plan_at_0_9():
    """The default search at budget 0.9 on 64 rows, made once for the tests that only read it."""
    return plan(loss, WS, X64, memory_budget=0.9, measure=False)


# one budget in the default run (0.9: its plan is shared with the second-opinion test), the
# two others slow: the same search at other budgets
@pytest.mark.parametrize("budget", [0.9, pytest.param(0.6, marks=pytest.mark.slow),
                                    pytest.param(0, marks=pytest.mark.slow)])
def test_the_default_search_fits_and_compiles_a_few_programs(budget, request):
    x = X64
    p = request.getfixturevalue("plan_at_0_9") if budget == 0.9 else plan(loss, WS, x, memory_budget=budget,
                                                                           measure=False)
    assert p.feasible and p.chosen.temp_bytes <= p.limit_bytes
    compiled = [c for c in p.candidates if c.compiled is not None]
    assert 2 <= len(compiled) <= 6 < 4 ** len(WS)
    assert p.chosen.estimated_temp_bytes is not None and p.chosen.estimated_ms is not None
    # the uniform candidates are predicted (their regions' kept bytes), compiled only if picked
    assert {"all: nothing", "all: dots"} <= {c.label for c in p.candidates}
    # every compile, the un-checkpointed step's too, was for memory alone; the plan's
    # program runs fully compiled
    assert all(c.memory_only and c.lowering is not None for c in compiled)
    step = p.chosen.executable()
    assert step is not p.chosen.compiled
    for got, want in zip(step(WS, x), p.chosen.compiled(WS, x)):
        # the same HLO; LLVM's code generation may order float operations otherwise
        assert jnp.allclose(got, want, rtol=1e-5, atol=1e-7)


# the MLP with the un-checkpointed and the mixed assignment in the default run; its two uniform
# ones, the transformer and the CNN (a dozen compiles each) are slow
@pytest.mark.parametrize("model,every", [("mlp", False), pytest.param("mlp", True, marks=pytest.mark.slow),
                                         pytest.param("transformer", True, marks=pytest.mark.slow),
                                         pytest.param("cnn", True, marks=pytest.mark.slow)])
def test_a_memory_only_compile_has_the_full_compiles_hlo_and_temp_bytes(model, every):
    # the planner confirms its picks with LLVM's optimizations off (MEMORY_ONLY): it relies
    # on XLA's HLO passes and buffer assignment being the same as a full compile's
    from remat.analysis.compiled import CompiledMemory
    from remat.models.tasks import make_task, pure_step_loss
    from remat.planner._search import MEMORY_ONLY
    from remat.planner.programs import lower_step, program_fingerprint
    from remat.planner.steering import apply_policies, count_regions

    step, args = pure_step_loss(make_task(model, depth=3, seed=0))
    n = count_regions(step, *args)
    uniform = [("nothing",) * n, ("dots",) * n] if every else []
    for policies in [(NONE,) * n, *uniform, ("nothing", "dots_no_batch", NONE)[:n]]:
        lowered = lower_step(apply_policies(step, policies), args)
        full, lean = lowered.compile(DEFAULT_COMPILE), lowered.compile(MEMORY_ONLY)
        assert CompiledMemory.from_compiled(lean) == CompiledMemory.from_compiled(full)
        assert program_fingerprint(lean) == program_fingerprint(full)


def test_a_program_fingerprint_ignores_source_lines_and_tells_programs_apart(monkeypatch):
    import jax

    from remat import _jax as xb
    from remat.planner.programs import program_fingerprint

    def step(variant):
        def loss(x):  # one name: the module is named after it
            if variant == "other lines":  # the same program, traced from other lines
                y = jnp.sin(x)
                return y * 2.0
            return (jnp.cos if variant == "cos" else jnp.sin)(x) * 2.0
        return loss

    x = jnp.ones((4, 4))
    f_, g_, h_ = (jax.jit(step(v)).lower(x).compile() for v in ("sin", "other lines", "cos"))
    assert "metadata=" in f_.as_text()  # the source lines are in the HLO as printed
    for printer in ("XLA's", "the text edited"):
        if printer == "the text edited":  # a jaxlib without XLA's printer
            monkeypatch.setattr(xb, "optimized_hlo_without_metadata", lambda compiled: None)
        assert program_fingerprint(f_) == program_fingerprint(g_), printer
        assert program_fingerprint(f_) != program_fingerprint(h_), printer


def test_a_second_opinion_compiles_the_fastest_assignment_without_the_picks_main_policy(plan_at_0_9):
    alone = plan_at_0_9
    both = plan(loss, WS, X64, memory_budget=0.9, measure=False, second_opinion=True)

    def compiled(p):
        return {c.label: c for c in p.candidates if c.compiled is not None and c.label != "no checkpoint"}

    extra = set(compiled(both)) - set(compiled(alone))
    assert extra and both.feasible and both.chosen.temp_bytes <= both.limit_bytes
    main = max(set(alone.chosen.policies) - {NONE}, key=alone.chosen.policies.count)
    assert any(main not in compiled(both)[label].policies for label in extra)
    assert both.chosen.predicted_ms <= alone.chosen.predicted_ms  # it only adds candidates


@pytest.mark.slow
def test_the_leanest_plan_walks_down_the_models_ranking_when_its_pick_misses():
    # the CNN's first block is its largest: the model predicts the same peak for several
    # assignments as for the leanest, where XLA's temp differs by a few percent (over the
    # 1% of budget 0); the search compiles the next fastest in the model's order instead of
    # settling on the lean pair
    from remat.models.tasks import make_task, pure_step_loss

    step, args = pure_step_loss(make_task("cnn", depth=2, batch_size=16, seed=0))
    p = plan(step, *args, memory_budget=0, measure=False)
    confirmed = [c for c in p.candidates if c.compiled is not None and c.label != "no checkpoint"]
    missed = [c for c in confirmed if not c.fits]
    assert missed and all(c.temp_bytes > p.limit_bytes for c in missed)
    lean = {"all: nothing", "regions: nothing, no_checkpoint"}
    walked = [c for c in confirmed if c.fits and c.label not in lean]
    assert walked, [c.label for c in confirmed]  # a fitting plan beyond the lean pair
    assert p.feasible and p.chosen.temp_bytes <= p.limit_bytes


def test_page_faults_of_a_temp_buffer_over_the_mmap_threshold_are_part_of_the_predicted_time(monkeypatch):
    from remat.analysis.allocator import FRESH_MAP_BYTES
    from remat.analysis.machine import fault_ms
    from remat.planner._fast import RegionModel, _fastest

    mib = 2**20
    # four regions, each kept (8 MiB, 10 ms) or recomputed (1 MiB, 15 ms)
    opts = (RegionOption(8.0 * mib, 10.0), RegionOption(1.0 * mib, 15.0))
    model = RegionModel((NONE, "nothing"), (opts,) * 4, (8.0 * mib,) * 4, 1.0, rates=faults(0.0))
    assert fault_ms(10 * FRESH_MAP_BYTES, model.rates) == 0.0
    kept_all = _fastest(model, float("inf"))
    assert kept_all.choice == (0, 0, 0, 0) and kept_all.ms == 40.0  # no fault cost: keep everything
    model = dataclasses.replace(model, rates=faults(1e-3 / mib))  # 1 ms per MiB
    assert fault_ms(FRESH_MAP_BYTES - 1, model.rates) == 0.0  # reused below the threshold
    assert fault_ms(FRESH_MAP_BYTES, model.rates) == pytest.approx(32.0)
    # keeping all: a 32 MiB peak and 32 ms of faults; one early region recomputed: a 25 MiB
    # peak, under the threshold (less the model's error), and 45 ms in all, the fastest,
    # one step down the front
    assert model.assignment((0, 0, 0, 0)).ms == pytest.approx(40.0 + 32.0)
    # a predicted 30 MiB buffer is charged too: it may compile over 32 MiB
    assert model.fault_ms(30 * mib) == pytest.approx(30.0) and model.fault_ms(28 * mib) == 0.0
    best = _fastest(model, float("inf"))
    assert best.ms == pytest.approx(45.0) and best.peak == 25 * mib and sorted(best.choice) == [0, 0, 0, 1]
    # the last region recomputed saves nothing (its backward follows its forward at once)
    assert best.choice[-1] == 0
    assert _fastest(model, 30.0 * mib).ms == pytest.approx(45.0)


@pytest.mark.parametrize("seed", range(60))
def test_the_fastest_with_page_faults_is_the_brute_force_optimum(seed, monkeypatch):
    # the walk down the front stops early (the least faults a buffer over the threshold
    # pays); the brute force weighs every fitting assignment with its faults
    from remat.planner._fast import RegionModel, _fastest

    mib, rng = 2**20, random.Random(seed)
    n, k = rng.randint(1, 5), rng.randint(1, 4)
    options = tuple(tuple(RegionOption(rng.randint(0, 20) * mib, rng.uniform(0, 30)) for _ in range(k))
                    for _ in range(n))
    working = tuple(rng.randint(0, 30) * mib for _ in range(n))
    model = RegionModel((NONE, *range(1, k)), options, working, rng.uniform(0.5, 2.0),
                        rng.uniform(-8, 8) * mib, rates=faults(rng.choice([0.0, 0.2, 1.0, 5.0]) * 1e-3 / mib))
    limit = rng.randint(0, 80) * mib
    brute = [model.assignment(choice) for choice in _fitting(options, working, limit)]
    found = _fastest(model, limit)
    if not brute:
        assert found is None
        return
    assert found is not None and found.peak <= limit
    assert found.ms == pytest.approx(min(a.ms for a in brute))


def _two_regions_near_the_mmap_threshold(monkeypatch):
    """Two regions, each kept (12 MiB, 10 ms) or recomputed (1 MiB, 12 ms), faults at
    1 ms per MiB: the model at a byte of temp per byte of predicted peak."""
    from remat.planner import _fast

    mib = 2**20
    opts = (RegionOption(12.0 * mib, 10.0), RegionOption(1.0 * mib, 12.0))
    return _fast.RegionModel((NONE, "nothing"), (opts, opts), (12.0 * mib, 12.0 * mib), 1.0,
                             rates=faults(1e-3 / mib))


def test_the_pick_of_the_scaled_model_compiles_beside_the_first_when_it_is_faster(monkeypatch):
    from remat.planner import _fast

    # a byte of peak taken for a byte of temp, keeping both (24 MiB) is under the
    # threshold, so the first pick keeps both; scaled by 1.5 that is 36 MiB and 36 ms of
    # faults, and the first region recomputed (13 MiB, 19.5 scaled) is faster
    guess = _two_regions_near_the_mmap_threshold(monkeypatch)
    first = _fast._fastest(guess, float("inf"))
    assert first.choice == (0, 0) and first.ms == 20.0
    scaled = _fast.RegionModel(guess.policies, guess.options, guess.working, 1.5, rates=guess.rates)
    confirmed = []
    monkeypatch.setattr(_fast, "_confirm", lambda search, model, picks: confirmed.extend(picks) or (lambda: ["extra"]))
    pending, picks, better = _fast._scaled_pick(None, scaled, float("inf"), [scaled.assignment(first.choice)],
                                                lambda: ["first"])
    assert [a.choice for a in confirmed] == [(1, 0)] and [a.choice for a in picks] == [(0, 0), (1, 0)]
    assert pending() == ["first", "extra"] and better.choice == (1, 0)
    # where the scaled model agrees with the first pick, nothing more compiles
    confirmed.clear()
    same, kept, better = _fast._scaled_pick(None, guess, float("inf"), [first], lambda: ["first"])
    assert confirmed == [] and same() == ["first"] and kept == [first] and better.choice == first.choice


def test_the_first_pick_is_hedged_for_the_scale_not_known_before_the_step_compiles(monkeypatch):
    from remat.planner import _fast

    # at a byte of temp per byte of peak, keeping both regions (24 MiB, 20 ms) is fastest;
    # from 1.25 bytes per byte on it is over the threshold, 30-48 ms of faults more, while
    # the first region recomputed (13 MiB; 16-26 MiB of temp, no faults at any scale
    # hedged for) costs 2 ms more: it loses least at its worst scale
    guess = _two_regions_near_the_mmap_threshold(monkeypatch)
    first = _fast._fastest(guess, float("inf"))
    assert first.choice == (0, 0)
    hedged = _fast._hedged(guess, float("inf"), first)
    assert hedged.choice == (1, 0) and hedged.ms == pytest.approx(22.0)
    # without faults to charge, every scale picks the same
    guess = dataclasses.replace(guess, rates=faults(0.0))
    assert _fast._hedged(guess, float("inf"), first) == first


def test_a_fitting_pick_climbs_where_the_temp_bytes_follow_a_line_with_an_offset(monkeypatch):
    from remat.planner import _fast
    from remat.planner._candidate import PlanCandidate

    # four regions, each kept (4 bytes, 1 ms) or recomputed (1 byte, 2 ms); XLA's temp is
    # the predicted peak less 6 (the MLP's shape): 10 un-checkpointed, so a budget of 0.75
    # allows 7.5, which a bound proportional to the peak puts at a peak of 12, and the line
    # at 13.5
    opts = (RegionOption(4.0, 1.0), RegionOption(1.0, 2.0))
    model = _fast.RegionModel((NONE, "nothing"), (opts,) * 4, (4.0,) * 4, 10 / 16, rates=faults(0.0))
    limit = 7.5
    pick = _fast._fastest(model, 0.75 * 16)
    assert pick.choice == (1, 1, 0, 0) and pick.peak == 10.0
    spec = model.spec(pick)
    finalists = {spec.label: PlanCandidate(spec.label, spec.policies, temp_bytes=4)}
    line = model.fitted([(16.0, 10.0), (10.0, 4.0)])
    climbed = _fast._climbed(line, limit, finalists)
    assert climbed.choice == (1, 0, 0, 0) and climbed.peak == 13.0 and climbed.ms == 5.0
    # compiled already, or not faster: nothing to climb to
    finalists[model.spec(climbed).label] = PlanCandidate(model.spec(climbed).label, (), temp_bytes=7)
    assert _fast._climbed(line, limit, finalists) is None
    # temp bytes proportional to the peak: no line to fit, the bound stays where it was
    assert model.fitted([(16.0, 10.0)]) is model


def test_a_climb_that_keeps_more_needs_less_predicted_gain(monkeypatch):
    from remat.planner import _fast
    from remat.planner._candidate import PlanCandidate


    def climbed(recompute_ms: float, slower_fitting: bool = False):
        # as above: four regions, kept (4 bytes, 1 ms) or recomputed (1 byte); the pick
        # recomputes two, and the line puts one recomputed (13 bytes of peak) at 7 <= 7.5
        opts = (RegionOption(4.0, 1.0), RegionOption(1.0, recompute_ms), RegionOption(4.0, 5.0))
        model = _fast.RegionModel((NONE, "nothing", "dots"), (opts,) * 4, (4.0,) * 4, 10 / 16, rates=faults(0.0))
        fitting = [model.assignment((1, 1, 0, 0))]
        if slower_fitting:  # a slower one that fits and keeps as much as every region kept
            fitting.append(model.assignment((2, 2, 2, 2)))
        finalists = {model.spec(a).label: PlanCandidate(model.spec(a).label, model.spec(a).policies, temp_bytes=4)
                     for a in fitting}
        return _fast._climbed(model.fitted([(16.0, 10.0), (10.0, 4.0)]), 7.5, finalists)

    # 4.06 ms against the pick's 4.12: 1.5% faster, keeping more: over CLIMB, under REPICK
    assert _fast.CLIMB < 0.06 / 4.12 < _fast.REPICK
    assert climbed(1.06).choice == (1, 0, 0, 0)
    # 0.5% faster: not worth a compile
    assert climbed(1.02) is None
    # 1.5% faster but keeping less than a fitting finalist: it needs REPICK
    assert climbed(1.06, slower_fitting=True) is None
    assert climbed(1.12, slower_fitting=True).choice == (1, 0, 0, 0)


def test_an_assignment_the_line_puts_just_over_the_limit_compiles_too(monkeypatch):
    from remat.planner import _fast
    from remat.planner._candidate import PlanCandidate

    # four regions, kept (4 bytes, 1 ms) or recomputed (1 byte, 2 ms); XLA's temp bytes are
    # flat (4) at the bottom, as the MLP's are: un-checkpointed 16 bytes of peak compile
    # to 10, three regions recomputed (a peak of 7) to 4, so the line through the two puts
    # two recomputed (a peak of 10) at 6, over a limit of 5.6 but within TEMP_ERROR of it
    opts = (RegionOption(4.0, 1.0), RegionOption(1.0, 2.0))
    model = _fast.RegionModel((NONE, "nothing"), (opts,) * 4, (4.0,) * 4, 10 / 16, rates=faults(0.0))
    pick = model.assignment((1, 1, 1, 0))
    assert pick.peak == 7.0
    spec = model.spec(pick)
    finalists = {spec.label: PlanCandidate(spec.label, spec.policies, temp_bytes=4)}
    line = model.fitted([(16.0, 10.0), (7.0, 4.0)])
    nearer = model.assignment((1, 1, 0, 0))
    assert line.temp_bytes(nearer) == 6 and 5.6 < 6 <= (1 + _fast.TEMP_ERROR) * 5.6
    assert _fast._climbed(line, 5.6, finalists).choice == (1, 1, 0, 0)
    # beyond the band it does not: one region recomputed (13 bytes of peak, 8 on the line)
    finalists[model.spec(nearer).label] = PlanCandidate(model.spec(nearer).label, (), temp_bytes=7)
    assert _fast._climbed(line, 5.6, finalists) is None


def test_the_fastest_without_an_option_never_takes_it(monkeypatch):
    from remat.planner import _fast

    # the second opinion makes the pick's main option infinitely slow: no assignment it
    # gives may take that option, however lean (here every fitting one would)
    opts = (RegionOption(4.0, 1.0), RegionOption(1.0, 2.0), RegionOption(2.0, 1.5))
    model = _fast.RegionModel((NONE, "nothing", "dots"), (opts,) * 3, (4.0,) * 3, 1.0, rates=faults(0.0))
    best = _fast._fastest(model, 6.0)
    assert best.choice == (1, 1, 0)
    assert _fast._other(model, 6.0, best) is None
    # with room for two regions at "dots", the pick takes it, and the other does not
    best = _fast._fastest(model, 8.0)
    assert best.choice == (2, 2, 0) and best.ms == 4.0
    assert _fast._other(model, 8.0, best).choice == (1, 1, 0)


def test_kept_bytes_leave_out_residuals_fused_reads_recompute_and_match_the_compiled_step():
    import jax

    from remat import checkpoint
    from remat.analysis.compiled import compiled_step
    from remat.planner.steering import apply_policies

    # jax.vjp of tanh keeps its output t and 1 - t**2; XLA computes the second where the
    # backward reads it (a cheap element-wise op of a kept value), never storing it.
    # GELU's tanh is not recomputed (a transcendental): it stays kept beside its input
    def chain(w, x):
        return jnp.tanh(jnp.tanh(x @ w) @ w)

    def gelu(w, x):
        return jax.nn.gelu(x @ w, approximate=True) @ w

    w, x = jnp.eye(256) * 0.5, jnp.ones((1024, 256))
    for block in (chain, gelu):
        def step(w, x, block=block):
            return jnp.sum(checkpoint(block, w, checkpoint(block, w, x)))

        none = region_costs(step, (w, x), 2, [NONE], rates=current_rates()).kept
        # each region stores two values of x's size (chain: the two tanh outputs) or three
        # (GELU: the matmul's output, its tanh, and the GELU the second matmul reads), the
        # second also its input (the first's is an argument)
        stored = 2 if block is chain else 3
        assert none == [[stored * x.nbytes], [(stored + 1) * x.nbytes]]
        # the un-checkpointed step's compiled temp bytes hold those, not the residuals JAX lists
        temp = compiled_step(apply_policies(step, (NONE, NONE)), w, x).memory.temp_bytes
        assert sum(k for (k,) in none) <= temp <= sum(k for (k,) in none) + 2 * x.nbytes


def test_fitting_candidates_predicted_far_slower_than_the_fastest_are_not_timed():
    from remat.planner._candidate import PlanCandidate
    from remat.planner._fast import TIME_ERROR, outpaced

    def fitting(label, ms, model=True):
        return PlanCandidate(label, (), temp_bytes=1, fits=True, predicted_ms=1.0 if model else ms,
                             estimated_ms=ms if model else None)

    pool = [fitting("fast", 100.0), fitting("close", 100.0 * (1 + TIME_ERROR) - 1), fitting("slow", 120.0),
            fitting("none", 130.0, model=False), PlanCandidate("over", (), temp_bytes=9, fits=False, estimated_ms=1.0)]
    marked = {c.label: c.superseded for c in outpaced(pool)}
    assert marked == {"fast": False, "close": False, "slow": True, "none": True, "over": False}
    assert outpaced(pool[:1]) == pool[:1]


@pytest.mark.slow  # five compiles of a four-block step
def test_the_leanest_plan_finds_a_faster_assignment_as_lean_where_xlas_temp_bytes_have_a_floor():
    from benchmarks.foreign_steps import unequal
    from remat.planner._search import LEAN_SLACK

    # blocks of hidden widths 1, 4, 2 and 3: with the wide block kept whole, XLA's temp bytes
    # are those of all `nothing` (its backward's own buffers set the floor), which the
    # per-region model puts far above; the floor found by the lean pick's compile admits it
    loss_fn, args = unequal(seed=0)
    p = plan(loss_fn, *args, memory_budget=0, measure=False)
    compiled = [c for c in p.candidates if c.temp_bytes is not None]
    assert p.chosen.label == "regions: nothing, no_checkpoint, nothing, no_checkpoint"
    assert p.chosen.temp_bytes <= LEAN_SLACK * min(c.temp_bytes for c in compiled)
    everywhere = next(c for c in compiled if c.label == "all: nothing")
    assert p.chosen.estimated_ms < everywhere.estimated_ms and len(compiled) <= 5


def test_timing_is_weighed_against_the_search_by_its_runs():
    from remat.planner._candidate import PlanCandidate
    from remat.planner._timing import TIMING_FLOOR_S, TIMING_SHARE, running_seconds, untimed_note
    from remat.planner.programs import MIN_SAMPLE_S

    def fitting(ms):
        return PlanCandidate(f"{ms}", (), temp_bytes=1, fits=True, predicted_ms=ms)

    one_second = [fitting(1000.0), fitting(900.0)]
    # a warm-up, 5 rounds and 10 more of each, at the slowest one's predicted second
    assert running_seconds(one_second, repeat=5) == pytest.approx(2 * 16 * 1.0)
    # a loop's body counted once by XLA: the prediction scaled by its trips
    assert running_seconds(one_second, repeat=5, trips=4) == pytest.approx(2 * 16 * 4.0)
    # a toy step's samples last at least MIN_SAMPLE_S
    toys = [fitting(0.1), fitting(0.2)]
    assert running_seconds(toys, repeat=5) == pytest.approx(2 * 16 * MIN_SAMPLE_S)
    assert untimed_note(toys, 5, search_s=0.5) is None  # under the floor
    note = untimed_note(one_second, 5, search_s=3.0)
    assert note is not None and note.startswith("the 2 fitting programs were not timed") and "3.0 s" in note
    assert untimed_note(one_second, 5, search_s=32.0 / TIMING_SHARE) is None  # within TIMING_SHARE of the search
    assert untimed_note(one_second[:1], 5, search_s=0.0) is None  # one program: nothing to time
    assert TIMING_FLOOR_S > 2 * 16 * MIN_SAMPLE_S  # two toy programs are always timed


def test_a_steps_loop_trips_multiply_through_nested_scans():
    import jax
    from jax import lax

    from remat.planner._timing import loop_trips

    def step(x):
        def outer(c, _):
            return lax.scan(lambda c2, _: (c2 * 2.0, None), c, None, length=3)[0], None
        return lax.scan(outer, x, None, length=4)[0]

    assert loop_trips(jax.make_jaxpr(step)(1.0).jaxpr) == 12
    assert loop_trips(jax.make_jaxpr(lambda x: x * 2)(1.0).jaxpr) == 1


@pytest.mark.slow  # three plans of a small MLP, one of them timed
def test_where_timing_would_cost_more_than_the_search_the_plan_says_so_and_chooses_by_prediction(monkeypatch):
    from remat.models.tasks import make_task, pure_step_loss
    from remat.planner import _timing

    # the leanest plan of a small MLP: two programs fit, within the time model's error
    step, args = pure_step_loss(make_task("mlp", depth=4, width=64, batch_size=64, seed=0))
    predicted = plan(step, *args, memory_budget=0, measure=False)
    monkeypatch.setattr(_timing, "TIMING_FLOOR_S", 0.0)
    monkeypatch.setattr(_timing, "TIMING_SHARE", 0.0)
    p = plan(step, *args, memory_budget=0)
    assert len({c.program for c in p.candidates if c.contends}) >= 2  # something to time
    assert all(c.measured_ms is None for c in p.candidates)
    assert p.not_timed is not None and p.not_timed in p.why() and "measure=True" in p.not_timed
    assert p.chosen.label == predicted.chosen.label and predicted.not_timed is None
    forced = plan(step, *args, memory_budget=0, measure=True, repeat=1)
    assert forced.not_timed is None and forced.chosen.measured_ms is not None

"""The planner's default search: per-region costs from one trace per policy, the exact assignment, a few compiles."""
from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from remat.analysis.allocator import FRESH_MAP_BYTES
from remat.analysis.machine import Rates, fault_ms
from remat.planner._assign import Assignment, RegionOption, below, describe, front_within, peak, ranked_within
from remat.planner._candidate import CandidateSpec, PlanCandidate
from remat.planner._costs import RegionCosts
from remat.planner._families import no_checkpoint_spec
from remat.planner._search import LEAN_SLACK, CandidateSearch
from remat.planner._segments import Segments
from remat.planner.steering import Survey
from remat.policies import is_no_checkpoint, policy_name

#: How far under XLA's temp bytes the model's prediction for an assignment may be: a
#: buffer predicted just under glibc's mmap threshold can compile just over it
#: (docs/planner.md, "The constants, and why each is what it is").
TEMP_ERROR = 0.1
#: Rounds of confirming compiles; after each round that finds nothing that fits, the
#: next two assignments down the model's front compile.
ROUNDS = 4
#: How far down the model's ranking a further budget-0 finalist is looked for.
RANKED = 64

#: Waits for compiles started in the background, and gives their candidates.
Pending = Callable[[], list[PlanCandidate]]


@dataclasses.dataclass(frozen=True)
class RegionModel:
    """What each region costs under each option (:func:`region_model`).

    Attributes:
      policies: the options, ``NO_CHECKPOINT`` (not checkpointed) first.
      options: per region, per option, its kept bytes and predicted time.
      working: per region, its working set: what it keeps un-checkpointed.
      scale: compiled temp bytes per byte of predicted peak.
      offset: compiled temp bytes besides (``temp = offset + scale * peak``).
      rates: the machine's rates, for the page faults of a predicted temp buffer.
    """

    policies: tuple[Any, ...]
    options: tuple[tuple[RegionOption, ...], ...]
    working: tuple[float, ...]
    scale: float
    offset: float = 0.0
    rates: Rates = dataclasses.field(kw_only=True)

    def spec(self, a: Assignment) -> CandidateSpec:
        """The candidate that runs assignment ``a``."""
        policies = tuple(self.policies[j] for j in a.choice)
        labels = [policy_name(p) for p in policies]
        if len(set(labels)) == 1:
            label = "no checkpoint" if is_no_checkpoint(policies[0]) else f"all: {labels[0]}"
        else:
            label = f"regions: {describe(labels)}"
        return CandidateSpec(label, policies)

    def assignment(self, choice: tuple[int, ...]) -> Assignment:
        """The assignment ``choice`` (an option index per region) with this model's predictions:
        its peak, and its time, the regions' times and the page faults of its predicted temp
        buffer (:func:`remat.analysis.machine.fault_ms`).

        Where every region costs the same, only how many regions take each option matters
        (and the last region's option, see :func:`remat.planner._assign.peak`), so the
        others are put in one order: the leanest first.
        """
        if len(set(self.options)) == 1 and len(set(self.working)) == 1 and len(choice) > 2:
            opts = self.options[0]
            choice = (*sorted(choice[:-1], key=lambda j: (opts[j].kept, j)), choice[-1])
        kept = [self.options[i][j].kept for i, j in enumerate(choice)]
        top = peak(kept, self.working)
        ms = sum(self.options[i][j].ms for i, j in enumerate(choice))
        return Assignment(choice, top, ms + self.fault_ms(top))

    def fault_ms(self, top: float) -> float:
        """The page faults of the temp buffer predicted for a peak of ``top`` bytes
        (:func:`remat.analysis.machine.fault_ms`), charged from :data:`TEMP_ERROR` below the
        mmap threshold: a buffer predicted just under it may compile just over."""
        return fault_ms(self._temp(top), self.rates, (1 - TEMP_ERROR) * FRESH_MAP_BYTES)

    def temp_bytes(self, a: Assignment) -> int:
        """The compiled temp bytes ``a`` is predicted to need."""
        return int(self._temp(a.peak))

    def _temp(self, top: float) -> float:
        return self.offset + self.scale * top

    def fitted(self, points: Sequence[tuple[float, float]]) -> RegionModel:
        """This model with ``offset`` and ``scale`` fitted (least squares) to compiled
        ``(predicted peak, temp bytes)`` points; unchanged when they cannot fix a line
        with a positive slope."""
        if len({p for p, _ in points}) < 2:
            return self
        mean_p = sum(p for p, _ in points) / len(points)
        mean_t = sum(t for _, t in points) / len(points)
        slope = (sum((p - mean_p) * (t - mean_t) for p, t in points)
                 / sum((p - mean_p) ** 2 for p, _ in points))
        if slope <= 0:
            return self
        return dataclasses.replace(self, scale=slope, offset=mean_t - slope * mean_p)


def region_model(costs: RegionCosts, rates: Rates, none: PlanCandidate | None = None) -> RegionModel:
    """The per-region costs: each option's kept bytes and recompute time
    (:func:`remat.planner._costs.region_costs`), for all its runs (a region in a scanned
    body, every trip); a region's working set is what one run of it keeps un-checkpointed.

    Args:
      costs: :func:`remat.planner._costs.region_costs`, ``NO_CHECKPOINT`` first.
      rates: the machine's rates.
      none: the un-checkpointed step, compiled (None: not yet; then ``scale`` is 1 and the
        predicted times leave out the step's own time, which every assignment shares).

    Returns:
      The model; its ``scale`` makes the un-checkpointed step's predicted peak its
      compiled temp bytes.
    """
    n = len(costs.ms)
    # each region's share of the step's own time (its page faults are each assignment's own)
    base = ((none.predicted_ms or 0.0) - fault_ms(none.compiled_temp_bytes(), rates)) / n if none is not None else 0.0
    # a region in a scanned body runs once per trip, one option for all: the stacked
    # residuals of every trip are kept, and every trip recomputes; while its last trip
    # runs, one trip's working set is live beside them
    options = tuple(tuple(RegionOption(float(k * costs.runs(i)), base + t * costs.runs(i)) for t, k in zip(ms, kept))
                    for i, (ms, kept) in enumerate(zip(costs.ms, costs.kept)))
    working = tuple(float(kept[0]) for kept in costs.kept)
    model = RegionModel(tuple(costs.options), options, working, 1.0, rates=rates)
    if none is None:
        return model
    return dataclasses.replace(model, scale=none.compiled_temp_bytes() / max(model.assignment((0,) * n).peak, 1.0))


@dataclasses.dataclass
class FastSearch:
    """The state the default search's steps share (:func:`fast_search`).

    Attributes:
      search: the candidates traced and compiled.
      costs: the regions' costs, ``NO_CHECKPOINT`` first.
      budget: the memory budget, a fraction of the un-checkpointed step's temp bytes.
      model: the per-region model: a guess until the un-checkpointed step compiles, then
        scaled to it, then fitted to what compiled.
      bound: the largest predicted peak weighed (the same whatever the scale).
      picks: the assignments compiling now (``pending`` waits for them), predicted by ``pricing``.
      limit: the most compiled temp bytes allowed (0 until the un-checkpointed step compiles).
      points: ``(predicted peak, compiled temp bytes)`` of everything compiled.
      finalists: the compiled candidates, by label.
    """

    search: CandidateSearch
    costs: RegionCosts
    budget: float
    model: RegionModel
    bound: float
    picks: list[Assignment] = dataclasses.field(default_factory=list)
    pricing: RegionModel | None = None  # the model the picks compiling were predicted by
    pending: Pending | None = None
    limit: int = 0
    points: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    finalists: dict[str, PlanCandidate] = dataclasses.field(default_factory=dict)

    def compile(self, picks: list[Assignment], model: RegionModel | None = None) -> None:
        """Starts compiling ``picks`` (the assignments of ``model``, default this state's)."""
        self.picks, self.pricing = picks, model or self.model
        self.pending = _confirm(self.search, self.pricing, picks) if picks else None

    def collect(self) -> list[PlanCandidate]:
        """Waits for the picks compiling, and records them as finalists (their predicted
        times with the page faults of the temp buffer each compiled to) and points."""
        assert self.pending is not None and self.pricing is not None
        confirmed, self.pending = self.pending(), None
        confirmed = [_repriced(self.search, self.pricing, a, c) for a, c in zip(self.picks, confirmed)]
        self.finalists.update((c.label, c) for c in confirmed)
        self.points += [(a.peak, c.compiled_temp_bytes()) for a, c in zip(self.picks, confirmed)]
        return confirmed

    def fits(self) -> bool:
        """Whether a finalist fits the limit."""
        return any(c.fits_in(self.limit) for c in self.finalists.values())


def fast_search(search: CandidateSearch, survey: Survey, budget: float, costs: RegionCosts,
                waiting: Pending, second_opinion: bool = False) -> tuple[PlanCandidate, list[PlanCandidate]]:
    """The un-checkpointed step, and the candidates weighed: every option on all regions
    (predicted, compiled only if chosen), the predicted runner-up, and the finalists, compiled.

    :func:`region_model` turns ``costs`` into per-region costs, and
    :func:`remat.planner._assign.fastest_within` gives the exact fastest assignment whose
    predicted peak is at most ``budget`` times the un-checkpointed step's (with
    ``second_opinion``, :func:`_other` too: the fastest without the pick's main policy).
    Neither needs a compile, so the pick (hedged over the scale not known yet,
    :func:`_hedged`) compiles in the background, beside the un-checkpointed step (the
    budget's yardstick). Then :func:`_budget_rounds`, or for budget 0
    :func:`_leanest_rounds`, compile until a pick fits.

    Args:
      search: the search, not yet calibrated.
      survey: the step's regions (no scan over layers, no ``checkpoint_sequential``).
      budget: the memory budget, a fraction of the un-checkpointed step's temp bytes.
      costs: :func:`remat.planner._costs.region_costs` for ``NO_CHECKPOINT`` and the policies.
      waiting: the un-checkpointed step's compile, started (the budget's yardstick, which
        compiles while the regions are costed and the pick is solved and lowered).
      second_opinion: compile and time :func:`_other` beside the pick.

    Returns:
      ``(the un-checkpointed step, the candidates)``.
    """
    guess = region_model(costs, search.rates)
    unchecked = search.cache[no_checkpoint_spec(survey).label]
    if unchecked.residual_bytes is None:  # staged untraced: what its regions keep
        kept = sum(o[0].kept for o in guess.options)
        search.cache[unchecked.label] = dataclasses.replace(unchecked, residual_bytes=int(kept))
    state = FastSearch(search, costs, budget, guess, _bound(guess, budget))
    fastest = _first_picks(state, second_opinion)
    none = _scaled(state, waiting())
    if budget == 0:
        _leanest_rounds(state)
    else:
        _budget_rounds(state, [state.model.assignment(a.choice) for a in fastest])
    return none, [*_shown(state), *state.finalists.values()]


def _first_picks(state: FastSearch, second_opinion: bool) -> list[Assignment]:
    """Starts compiling the first picks of the guessed model, before the scale is known;
    the fastest of them, which a pick of the scaled model may supersede (none for budget 0).

    Predicted not to fit at all, the leanest compile at once, for the minimum reported."""
    guess, bound, budget = state.model, state.bound, state.budget
    picks = _picks(guess, bound, budget, with_leaner=budget == 0, with_other=second_opinion)
    if picks and budget > 0:  # the fastest for the scale unknown yet
        picks = list({a.choice: a for a in [_hedged(guess, bound, picks[0]), *picks[1:]]}.values())
    fastest = picks[:1] if budget > 0 else []
    state.compile(picks or _lean_pair(guess))
    return fastest


def _scaled(state: FastSearch, waited: list[PlanCandidate]) -> PlanCandidate:
    """The un-checkpointed step compiled (``waited``): the limit set, the model scaled to
    its temp bytes and time, and the picks compiling re-predicted with it."""
    none = waited[0]
    state.limit = int(state.budget * none.compiled_temp_bytes())
    state.search.calibrate(none, state.limit)
    state.model = model = region_model(state.costs, state.search.rates, none)
    state.picks = [model.assignment(a.choice) for a in state.picks]
    state.points = [(model.assignment((0,) * len(model.options)).peak, float(none.compiled_temp_bytes()))]
    for a in state.picks:  # their predictions, now with the step's own time and temp bytes
        _estimated(state.search, model, a)
    return none


def _leanest_rounds(state: FastSearch) -> None:
    """Budget 0: the least temp bytes compiled (the lean pair's) fix the limit; while the
    predicted-fastest misses it by more than :data:`remat.planner._search.LEAN_SLACK` (the
    model's peaks tie where XLA's differ by a few percent), the next fastest not compiled
    yet in the model's ranking (:func:`remat.planner._assign.ranked_within`) compiles, at
    most :data:`ROUNDS` rounds in all. Once it fits, the floor (:func:`_floored`) may
    admit a faster assignment as lean, which compiles too."""
    tried: set[tuple[RegionOption, ...]] = set()  # what the assignments compiled cost, region by region
    floored = False
    for round_ in range(ROUNDS):
        if state.pending is None:
            return
        confirmed = state.collect()
        least = min(c.compiled_temp_bytes() for c in state.finalists.values())
        if round_ == ROUNDS - 1:
            return
        if confirmed[0].fits_in(int(LEAN_SLACK * least)) or floored:
            # fitting, the floor's pick may follow (once: where it misses, the walk ends)
            quicker = None if floored else _floored(state, least)
            floored = True
            state.compile([quicker] if quicker is not None else [])
            continue
        tried.update(_signature(state.model, a) for a in state.picks)
        following = _next_ranked(state.model, state.bound, tried)
        state.compile([following] if following is not None else [])


def _floored(state: FastSearch, least: float) -> Assignment | None:
    """Budget 0, a lean pick compiled and fitting: the fastest assignment not compiled yet
    whose predicted temp bytes are within :data:`remat.planner._search.LEAN_SLACK` of the
    ``least`` compiled, where it is predicted :data:`REPICK` faster than every finalist
    that fits; None where there is none.

    XLA's temp bytes stop falling near the leanest (the backward pass's own buffers, which
    the per-region model does not see, set a floor): where the leanest compiled is over the
    model's prediction, assignments the model puts between the two are as lean as it, and
    the fastest of them may recompute far less (``benchmarks.foreign_steps``' ``unequal``:
    a large block kept whole, as lean as all ``nothing``). The bound is raised once, to
    that floor, so the walk stays as short.
    """
    floor = LEAN_SLACK * least / state.model.scale - state.model.offset / state.model.scale
    if floor <= state.bound:
        return None
    state.bound = floor
    limit = int(LEAN_SLACK * least)
    fitting = [_choice(state.model, c) for c in state.finalists.values() if c.fits_in(limit)]
    quickest = min((state.model.assignment(ch).ms for ch in fitting if ch is not None), default=float("inf"))
    found = _fastest(state.model, floor, skip=frozenset(state.finalists))
    return found if found is not None and found.ms < (1 - REPICK) * quickest else None


def _budget_rounds(state: FastSearch, fastest: list[Assignment]) -> None:
    """A budget over 0: the first picks, beside them the scaled model's own where it is
    faster (:func:`_scaled_pick`); while none fits, the next two assignments down the
    model's front, at most :data:`ROUNDS` rounds in all; then the climb (:func:`_climbed`);
    and if still nothing fits, the leanest pair, so that the minimum reported is compiled."""
    scaled, best = state.model, None
    if fastest and state.pending is not None:
        state.pending, state.picks, best = _scaled_pick(state.search, scaled, state.bound, state.picks,
                                                        state.pending)
    _walk_down(state)
    line = state.model.fitted(state.points)  # through every compiled point
    climbed = _climbed(line, state.limit, state.finalists) if line is not state.model else None
    if climbed is not None:
        state.compile([climbed], line)
        state.collect()
    _supersede(state, scaled, [*fastest, *([best] if best is not None else [])])
    if not state.fits():
        state.compile(_lean_pair(state.model))
        state.collect()


def _walk_down(state: FastSearch) -> None:
    """Compiles the picks; while none fits, the next two assignments down the model's
    front, below the least predicted peak that missed (a walk that skips none, so that a
    lower budget never stops above a higher one's plan), their predictions refitted to
    what compiled."""
    for round_ in range(ROUNDS):
        if state.pending is None:
            return
        confirmed = state.collect()
        if any(c.fits_in(state.limit) for c in confirmed) or round_ == ROUNDS - 1:
            return
        state.model = state.model.fitted(state.points)
        state.bound = below(min(a.peak for a in state.picks))
        state.compile(_picks(state.model, state.bound, state.budget, with_leaner=True))


def _supersede(state: FastSearch, scaled: RegionModel, picks: list[Assignment]) -> None:
    """Of ``picks`` (for one scale or another) that fit, those the ``scaled`` model predicts
    :data:`REPICK` slower than the fastest of them are marked superseded: not timed."""
    fitting = [a for a in picks
               if (c := state.finalists.get(scaled.spec(a).label)) is not None and c.fits_in(state.limit)]
    quickest = min((a.ms for a in fitting), default=float("inf"))
    for a in fitting:
        if quickest < (1 - REPICK) * a.ms:
            label = scaled.spec(a).label
            state.finalists[label] = dataclasses.replace(state.finalists[label], superseded=True)


#: Predicted step times further apart than this fraction are told apart without timing:
#: twice the time model's largest error on a whole step measured so far
#: (``benchmarks.recompute``, docs/planner.md, "The time model against measured steps").
TIME_ERROR = 0.1


def outpaced(pool: list[PlanCandidate]) -> list[PlanCandidate]:
    """``pool`` with the fitting candidates predicted more than :data:`TIME_ERROR` slower
    than the predicted-fastest fitting one marked superseded: not timed, not chosen.

    Timing a candidate costs a full compile (the search compiles for memory alone) and
    several runs of the step, more than the whole search where one step takes seconds; the
    time model tells apart what it predicts that far apart. A candidate's prediction is
    the per-region model's (``estimated_ms``), else its compile's (``predicted_ms``: the
    un-checkpointed step's, which the model's times are built on).
    """
    contending = [c for c in pool if c.contends and _predicted(c) is not None]
    if len(contending) < 2:
        return pool
    fastest = min(_predicted(c) or 0.0 for c in contending)
    slow = {c.label for c in contending if (_predicted(c) or 0.0) > (1 + TIME_ERROR) * fastest}
    return [dataclasses.replace(c, superseded=True) if c.label in slow else c for c in pool]


def _predicted(c: PlanCandidate) -> float | None:
    return c.estimated_ms if c.estimated_ms is not None else c.predicted_ms


def _shown(state: FastSearch) -> list[PlanCandidate]:
    """Every option on all regions, and the model's runner-up: predicted, not compiled."""
    model, n = state.model, len(state.model.options)
    shown = [_estimated(state.search, model, model.assignment((j,) * n)) for j in range(1, len(model.policies))
             if not isinstance(model.policies[j], Segments)]  # splits: one region's, shown if the runner-up
    shown = [c for c in shown if c.label not in state.finalists]
    best = _fastest(model, state.bound)
    if best is not None:
        up = _runner_up(model, state.bound, best, set(state.finalists))
        if up is not None:
            shown.append(_estimated(state.search, model, up))
    return shown


#: How much faster (predicted) the pick of the model scaled to the compiled un-checkpointed
#: step must be than the first picks for it to compile too.
REPICK = 0.02
#: How much faster (predicted) than what fits an assignment that keeps more must be for the
#: climb (:func:`_climbed`) to compile it: less than :data:`REPICK`, because the time model
#: under-prices what keeping more saves (the attention output's, docs/planner.md, "The time
#: model against measured steps"), and the climb uses room the pick left unused.
CLIMB = 0.01


#: The compiled temp bytes per byte of predicted peak the first pick is hedged for
#: (:func:`_hedged`; what the built-in models measured is in docs/planner.md, the constants' table).
HEDGE_SCALES = (1.0, 1.25, 1.5, 1.75, 2.0)


def _hedged(guess: RegionModel, bound: float, fastest: Assignment) -> Assignment:
    """Of the fastest assignments of ``guess`` were its temp bytes each of
    :data:`HEDGE_SCALES` times its predicted peak, the one that loses least, at its worst
    scale, to the fastest at that scale (``fastest``: the fastest at ``guess``'s scale).

    The first pick is chosen before the un-checkpointed step compiles, so the scale is not
    known (XLA's temp is more than the predicted peak): it decides on which side of glibc's
    mmap threshold a buffer falls, that is, whether it pays page faults at every step
    (:func:`remat.analysis.machine.fault_ms`). Where the threshold is not in play every
    scale picks the same.
    """
    models = [dataclasses.replace(guess, scale=s * guess.scale) for s in HEDGE_SCALES]
    found = {fastest.choice: fastest}
    for model in models:
        a = _fastest(model, bound)
        if a is not None:
            found.setdefault(a.choice, guess.assignment(a.choice))
    if len(found) == 1:
        return fastest
    times = {choice: [model.assignment(choice).ms for model in models] for choice in found}
    best = [min(ts[k] for ts in times.values()) for k in range(len(models))]

    def regret(a: Assignment) -> float:
        return max(t - b for t, b in zip(times[a.choice], best))

    return min(found.values(), key=lambda a: (regret(a), a.peak))


def _scaled_pick(search: CandidateSearch, model: RegionModel, bound: float, picks: list[Assignment],
                 pending: Pending) -> tuple[Pending, list[Assignment], Assignment | None]:
    """The first picks, and beside them the fastest assignment of the scaled ``model`` where
    it is predicted :data:`REPICK` faster than all of them (the scale was outside what
    :func:`_hedged` covered); and that fastest assignment.

    Where the model has no faults to charge, the scaled model's order is the first one's,
    and nothing more compiles.
    """
    better = _fastest(model, bound)
    fitting = [a.ms for a in picks if a.peak <= bound]
    if better is None or better.choice in {a.choice for a in picks} or not fitting \
            or better.ms >= (1 - REPICK) * min(fitting):
        return pending, picks, better
    first, extra = pending, _confirm(search, model, [better])
    return (lambda: first() + extra()), [*picks, better], better


def _climbed(fitted: RegionModel, limit: float, finalists: dict[str, PlanCandidate]) -> Assignment | None:
    """The fastest assignment that the model ``fitted`` to every compiled point predicts
    within ``limit``, or else within :data:`TEMP_ERROR` above it, and not compiled yet (not
    one of ``finalists``), where none of ``finalists`` fits or it is predicted
    :data:`REPICK` faster than those that fit (:data:`CLIMB` where it keeps more than
    each of them).

    The model's bound is a fraction of the un-checkpointed step's predicted peak, that is,
    temp bytes proportional to the predicted peak. Where XLA's temp bytes follow a line
    with an offset (the MLP's are the predicted peak less a constant), that bound shuts out
    assignments that fit; the line through the un-checkpointed step and the picks admits
    them. Near the leanest, XLA's temp bytes stop falling (what is live outside the
    regions sets them: the MLP's are flat below a third of its predicted peak), which no
    line through the compiled points shows: so an assignment the line puts just over the
    limit compiles too, and it is the compile that says whether it fits.
    """
    fitting = [(c, fitted.assignment(choice)) for c in finalists.values()
               if c.fits_in(limit) and (choice := _choice(fitted, c)) is not None]
    # what fits is priced with the page faults of the temp buffer it compiled to (collect)
    quickest = min((a.ms if c.estimated_ms is None else c.estimated_ms for c, a in fitting), default=float("inf"))
    most_kept = max((a.peak for _, a in fitting), default=float("-inf"))
    compiled = frozenset(finalists)
    for allowed in (limit, (1 + TEMP_ERROR) * limit):  # what the line says fits first
        found = _fastest(fitted, (allowed - fitted.offset) / fitted.scale, skip=compiled)
        if found is not None and found.ms < (1 - (CLIMB if found.peak > most_kept else REPICK)) * quickest:
            return found
    return None


def _choice(model: RegionModel, c: PlanCandidate) -> tuple[int, ...] | None:
    """The option index of each region of candidate ``c`` (None: not a per-region assignment of ``model``)."""
    labels = [policy_name(p) for p in model.policies]
    try:
        return tuple(labels.index(policy_name(p)) for p in c.policies)
    except ValueError:
        return None


def _fastest(model: RegionModel, bound: float, options: Sequence[Sequence[RegionOption]] | None = None,
             skip: frozenset[str] = frozenset()) -> Assignment | None:
    """The predicted-fastest assignment within ``bound``, page faults counted.

    :func:`remat.planner._assign.fastest_within` weighs the regions' times alone; a temp
    buffer over glibc's mmap threshold also costs its page faults at every step, in
    proportion to its size, which is not a sum over regions. So every assignment of the
    model's front within ``bound`` (the fastest at each peak,
    :func:`remat.planner._assign.front_within`) is weighed with its faults. The front is
    computed once for each set of options and bound (the hedge weighs it at five scales).
    Assignments whose candidates' labels are in ``skip`` (compiled already) are passed over.
    """
    options = model.options if options is None else options
    front = _front(tuple(map(tuple, options)), tuple(model.working), bound)
    if not front:
        return None
    # a tie: the most peak allowed (the fastest of the regions' times alone); an option
    # made infinitely slow (:func:`_other`) rules out every assignment that takes it
    return min((model.assignment(a.choice) for a in reversed(front)
                if a.ms < float("inf") and not (skip and model.spec(a).label in skip)),
               key=lambda a: a.ms, default=None)


@functools.lru_cache(maxsize=16)
def _front(options: tuple[tuple[RegionOption, ...], ...], working: tuple[float, ...], bound: float) -> list[Assignment]:
    return front_within(options, working, bound)


def _picks(model: RegionModel, bound: float, budget: float, with_leaner: bool,
           with_other: bool = False) -> list[Assignment]:
    """The fastest assignment within ``bound``; with ``with_other`` also the fastest one
    without the policy it uses most (:func:`_other`); with ``with_leaner`` the next leaner
    one (for budget 0, :func:`_lean_pair`)."""
    best = _fastest(model, bound)
    if best is None:
        return []
    picks = [best]
    other = _other(model, bound, best) if with_other else None
    if other is not None and other.choice != best.choice:
        picks.append(other)
    if with_leaner:
        leaner = _lean_pair(model) if budget == 0 else [_fastest(model, below(best.peak))]
        picks += [a for a in leaner if a is not None]
    return list({a.choice: a for a in picks}.values())


def _next_ranked(model: RegionModel, bound: float, tried: set[tuple[RegionOption, ...]]) -> Assignment | None:
    """The predicted-fastest assignment within ``bound`` unlike every one ``tried`` (two
    options that keep the same bytes at the same cost, ``dots`` and ``dots_no_batch`` on a
    convolution say, are alike); None past the first ``RANKED`` in the model's order."""
    for a in itertools.islice(ranked_within(model.options, model.working, bound), RANKED):
        a = model.assignment(a.choice)
        if _signature(model, a) not in tried:
            return a
    return None


def _signature(model: RegionModel, a: Assignment) -> tuple[RegionOption, ...]:
    """What ``a`` keeps and costs, region by region: alike assignments are one program."""
    return tuple(model.options[i][j] for i, j in enumerate(a.choice))


def _other(model: RegionModel, bound: float, best: Assignment) -> Assignment | None:
    """The fastest assignment within ``bound`` that never uses the policy ``best`` puts on
    most regions: a second opinion where the time model is least sure (predicted recompute
    times of two policies within a few percent have measured far apart on the benchmark's
    transformer, docs/planner.md), timed beside ``best``."""
    used = [j for j in best.choice if j != 0]  # option 0 is NO_CHECKPOINT
    if not used:
        return None
    most = max(set(used), key=used.count)
    without = tuple(tuple(o._replace(ms=float("inf")) if j == most else o for j, o in enumerate(opts))
                    for opts in model.options)
    return _fastest(model, bound, without)


def _lean_pair(model: RegionModel) -> list[Assignment]:
    """The leanest assignment, and the same with the last region un-checkpointed (its
    backward follows its forward at once, so it may cost no more)."""
    lean = _leanest(model)
    return [lean, model.assignment(lean.choice[:-1] + (0,))]


def _runner_up(model: RegionModel, bound: float, best: Assignment, compiled: set[str]) -> Assignment | None:
    """The fastest assignment within ``bound`` other than ``best`` and not ``compiled``
    (labels): the fastest leaner one, or one that differs from ``best`` in one region."""
    leaner = _fastest(model, below(best.peak))
    others = [leaner] if leaner is not None else []
    for i, j in enumerate(best.choice):
        for k in range(len(model.options[i])):
            if k != j:
                a = model.assignment(best.choice[:i] + (k,) + best.choice[i + 1:])
                if a.peak <= bound and a.choice != best.choice:
                    others.append(a)
    others = [a for a in others if model.spec(a).label not in compiled]
    return min(others, key=lambda a: (a.ms, a.peak), default=None)


def _bound(model: RegionModel, budget: float) -> float:
    """The largest predicted peak allowed: ``budget`` times the un-checkpointed step's (for
    budget 0, :data:`remat.planner._search.LEAN_SLACK` times the least)."""
    if budget == 0:
        return LEAN_SLACK * _leanest(model).peak
    return budget * model.assignment((0,) * len(model.options)).peak


def _leanest(model: RegionModel) -> Assignment:
    """The leanest assignment; among options that keep equally little, the one that
    recomputes most (the slowest), which leaves XLA the least to hold besides."""
    return model.assignment(tuple(max(range(len(opts)), key=lambda j: (-opts[j].kept, opts[j].ms))
                                  for opts in model.options))


def _estimated(search: CandidateSearch, model: RegionModel, a: Assignment) -> PlanCandidate:
    """The candidate of assignment ``a`` with its predicted temp bytes and time; its
    residual bytes are its regions' kept bytes (no trace: :func:`region_model` knows them)."""
    spec = model.spec(a)
    kept = sum(model.options[i][j].kept for i, j in enumerate(a.choice))
    known = search.cache.get(spec.label)
    if known is None:
        known = PlanCandidate(spec.label, spec.policies, residual_bytes=int(kept))
    c = search.cache[spec.label] = dataclasses.replace(known, estimated_temp_bytes=model.temp_bytes(a),
                                                       estimated_ms=a.ms)
    return c


def _repriced(search: CandidateSearch, model: RegionModel, a: Assignment, c: PlanCandidate) -> PlanCandidate:
    """Candidate ``c``, compiled from assignment ``a`` of ``model``, its predicted time
    charged the page faults of the temp buffer it compiled to rather than of the one predicted."""
    if c.temp_bytes is None:
        return c
    ms = a.ms - model.fault_ms(a.peak) + fault_ms(c.temp_bytes, model.rates)
    c = search.cache[c.label] = dataclasses.replace(c, estimated_ms=ms)
    return c


def _confirm(search: CandidateSearch, model: RegionModel,
             picks: list[Assignment]) -> Callable[[], list[PlanCandidate]]:
    """Starts compiling the assignments ``picks`` (with their predicted temp bytes and
    time); the function returned waits for them."""
    for a in picks:
        _estimated(search, model, a)
    return search.start([model.spec(a) for a in picks], memory_only=True)

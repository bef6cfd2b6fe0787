"""``remat.plan``: weigh every candidate family, compile what may fit, time what fits, choose."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from remat.analysis.machine import Rates, calibrate_once, calibrated, calibration_programs
from remat.planner._candidate import PlanCandidate
from remat.planner._costs import RegionCosts, start_region_costs
from remat.planner._families import (
    BUDGET_FRACTIONS,
    PLANNED_POLICIES,
    family_specs,
    name_groups,
    no_checkpoint_spec,
    offload_groups,
    offload_note,
)
from remat.planner._fast import fast_search, outpaced
from remat.planner._footprint import footprint
from remat.planner._mixed import mixed_spec, mixed_specs, uniform_costs
from remat.planner._plan import Plan
from remat.planner._schedules import schedule_search, start_schedule_costs
from remat.planner._search import BACKGROUND, LEAN_SLACK, CandidateSearch
from remat.planner._segments import scanned_bytes, split_note, stack_lengths
from remat.planner._split_options import with_splits
from remat.planner._timing import fitting_programs, loop_trips, timed, untimed_note
from remat.planner._units import parse_bytes
from remat.planner.steering import Survey, survey
from remat.policies import NO_CHECKPOINT, PolicySpec


def plan(
    step_fn: Callable[..., Any],
    *args: Any,
    memory_budget: float | None = None,
    memory_limit: int | str | None = None,
    argnums: int | Sequence[int] = 0,
    policies: Sequence[PolicySpec] = PLANNED_POLICIES,
    budget_fractions: Sequence[float] = BUDGET_FRACTIONS,
    repeat: int = 5,
    measure: bool | None = None,
    cache: dict[str, PlanCandidate] | None = None,
    early_reject: bool = True,
    progress: Callable[[str], None] | None = None,
    exhaustive: bool = False,
    second_opinion: bool = False,
    rates: Rates | None = None,
) -> Plan:
    """Finds the fastest way to checkpoint ``step_fn`` whose compiled temp memory fits.

    Args:
      step_fn: a scalar loss ``step_fn(*args)`` whose blocks call :func:`remat.checkpoint`
        (or are checkpointed with ``jax.checkpoint``, ``nnx.remat`` or ``nn.remat``, whose
        regions the planner re-decides in the step's jaxpr: ``remat.planner._foreign``).
      *args: example arguments (parameters first, or as ``argnums`` says).
      memory_budget: the most compiled temp memory of ``jit(grad(step_fn))``, as a fraction
        in [0, 1] of the same step without any checkpoint (the whole step's memory, unlike
        :func:`remat.residual_budget`'s fraction of one region's residuals); 0 asks for the
        leanest plan found: the fastest of the candidates within 1% (``LEAN_SLACK``) of the least temp memory.
      memory_limit: instead of ``memory_budget``, the most bytes the compiled step may hold
        on one device (arguments + outputs + temp - aliased, from its
        ``memory_analysis()``): an int, or a string such as ``"6GiB"``, ``"512MiB"`` or
        ``"8GB"``. ``plan.device_bytes`` is the chosen plan's compiled figure.
      argnums: what the gradient is taken with respect to.
      policies: fixed policies tried on every region.
      budget_fractions: fractions of :func:`remat.residual_budget` tried on every region.
      repeat: timing rounds of the fitting candidates (each round runs each once; the
        candidates within 3% of the fastest run ``2 * repeat`` rounds more,
        :func:`remat.planner.programs.time_side_by_side`).
      measure: time the fitting candidates (True), or choose by predicted time (False).
        None: the default search times them where their runs are predicted to take at
        most twice the search itself, or two seconds (``remat.planner._timing``), so that
        planning a step that runs for seconds takes about as long as compiling it
        (``plan.not_timed`` says when they were not timed, and why); the other searches
        always time them (XLA's cost analysis counts a loop body once, so their
        predictions of scan candidates are far too low).
      cache: a dict to reuse compiled candidates across calls with the same ``step_fn``
        and argument shapes (e.g. several budgets for one model).
      early_reject: leave uncompiled the candidates whose residual bytes (one trace) predict
        a temp memory over the limit; they are listed with no temp bytes, and compiled after
        all when nothing else fits.
      progress: called with one line (candidates compiled out of those weighed, the best
        plan so far) after each batch of compiles; e.g. ``print`` to stderr.
      exhaustive: compile every candidate of the families (``remat plan --exhaustive``).
        The default, for a step whose regions are all there is to decide (no
        ``remat.scan_layers``, no ``checkpoint_sequential``; a region in a ``lax.scan``'s
        body is one decision for all its trips, which may also split the stack into two
        segments), traces each of ``policies`` (and the
        step's ``checkpoint_name`` tags) once on every region, solves for the fastest
        per-region assignment predicted to fit, and compiles only that one to confirm
        (and a few more where it misses, or where the compiled temp bytes show room for
        a faster one: ``docs/planner.md``, "The default search"); a step whose one decision
        is a ``remat.scan_layers`` stack weighs its policies and schedules by their model and
        compiles a few (:mod:`remat.planner._schedules`); other steps, and
        ``exhaustive=True``, compile every candidate.
      second_opinion: the default search also compiles, and times beside its pick, the
        fastest assignment that does without the pick's main policy (the time model's
        errors between policies are larger than its margins; this costs about one more
        compile and a timing run; ``remat plan --second-opinion``).
      rates: the machine's rates the predicted times are priced at (default: this
        process's, measured on first use, :func:`remat.analysis.machine.calibrate_once`).

    Returns:
      A :class:`Plan`; ``plan.apply(step_fn)`` runs the step the planned way.

    Example:
      >>> p = plan(loss, params, x, memory_budget=0.5)            # doctest: +SKIP
      >>> grads = jax.jit(jax.grad(p.apply(loss)))(params, x)  # doctest: +SKIP
    """
    started = time.perf_counter()
    budget, limit_bytes = _checked_limit(memory_budget, memory_limit)
    surveyed, rates = _surveyed(step_fn, args, rates)
    options = [*policies, *name_groups(surveyed.names), *offload_groups(surveyed.names)]
    costing = _start_costing(step_fn, args, surveyed, options, rates, exhaustive)
    # a step whose one decision is a remat.scan_layers stack: its schedules' own search
    stack = None if costing is not None or exhaustive else start_schedule_costs(step_fn, args, surveyed, options,
                                                                               rates)
    search = CandidateSearch(step_fn, args, argnums, {} if cache is None else cache,
                             early_reject and costing is None, lean=budget == 0, progress=progress, rates=rates)
    search.foreign = surveyed.foreign
    if budget is None:  # a device limit: the un-checkpointed step compiled first, for the limit's temp share
        assert limit_bytes is not None  # _checked_limit admits exactly one
        budget = _budget_within(search, surveyed, limit_bytes)
    if costing is not None:
        none, pool = _default_search(search, surveyed, budget, costing, second_opinion)
    elif stack is not None:
        none, pool = schedule_search(search, surveyed, budget, *stack())
    else:
        none, pool = _family_search(search, surveyed, budget, policies, budget_fractions)
    # budget 0, the leanest: the least temp memory any candidate reached, with LEAN_SLACK
    limit = int(LEAN_SLACK * search.least) if budget == 0 else int(budget * none.compiled_temp_bytes())
    pool = _settled(search, pool, limit, complete=costing is None and stack is None)
    if costing is not None:  # the default search's predictions tell apart what is far apart
        pool = outpaced(pool)
    # the other searches' predictions count a scan's body once: always timed, unless asked not to
    untimed = (None if measure is not None or costing is None else
               untimed_note(fitting_programs(pool), repeat, time.perf_counter() - started,
                            loop_trips(surveyed.jaxpr.jaxpr)))
    if measure is not False and untimed is None:
        pool = timed(pool, args, repeat)
    plan_s = time.perf_counter() - started
    return _result(pool, none, surveyed, (budget, limit, limit_bytes), (args, argnums), (untimed, costing is not None),
                   plan_s)


def _surveyed(step_fn: Callable[..., Any], args: tuple, rates: Rates | None) -> tuple[Survey, Rates]:
    """One trace of the step (:func:`remat.planner.steering.survey`), and the machine's
    rates: ``rates``, else this process's, measured on first use, their timing programs
    compiled in the background while the step is traced (only the timing needs the
    machine to itself)."""
    programs = None if rates is not None or calibrated() else BACKGROUND.submit(calibration_programs).result
    surveyed = survey(step_fn, *args)
    if surveyed.regions == 0 and not surveyed.scan_depths:
        raise ValueError("plan() found no checkpointed region (remat.checkpoint, jax.checkpoint, nnx.remat, "
                         "nn.remat) or remat.scan_layers in step_fn: "
                         "checkpoint its blocks first")
    return surveyed, calibrate_once(programs) if rates is None else rates


def _result(pool: list[PlanCandidate], none: PlanCandidate, surveyed: Survey, limits: tuple[float, int, int | None],
            step: tuple[tuple, int | Sequence[int]], choosing: tuple[str | None, bool], plan_s: float) -> Plan:
    """The :class:`Plan` of the candidates weighed: the chosen one (:func:`_choose`), and
    the footprint on one device of it or, where nothing fits, of the leanest.

    Args:
      limits: ``(budget, temp limit, device limit or None)``.
      step: ``(args, argnums)`` of the step planned.
      choosing: why the fitting candidates were not timed (None: they were, or were not
        to be), and whether the default search, with its per-region model, weighed them.
    """
    (budget, limit, limit_bytes), (args, argnums), (untimed, default_search) = limits, step, choosing
    lengths = stack_lengths(surveyed.jaxpr)
    # XLA's cost analysis counts a loop body once: where regions run in a scan, the
    # per-region model, which prices every trip, ranks what is chosen untimed
    by_model = default_search and any(where != "" for where in lengths)
    contending = [c for c in pool if c.contends]
    chosen = _choose(contending, measured=any(c.measured_ms is not None for c in contending), by_model=by_model)
    compiled = [c for c in pool if c.temp_bytes is not None]
    shown = chosen or min(compiled, key=PlanCandidate.compiled_temp_bytes)
    on_device = footprint(shown.compiled, args, argnums)
    return Plan(memory_budget=float(budget), limit_bytes=limit, none_temp_bytes=none.compiled_temp_bytes(),
                num_regions=surveyed.regions, feasible=chosen is not None, chosen=chosen, candidates=tuple(pool),
                minimum_bytes=min(c.compiled_temp_bytes() for c in compiled), plan_s=plan_s,
                compile_s=none.compile_s, memory_limit_bytes=limit_bytes,
                device_bytes=on_device.device_bytes if chosen is not None else None,
                footprint=on_device, region_paths=tuple(surveyed.paths), not_offloaded=offload_note(surveyed.names),
                foreign_regions=surveyed.foreign,
                # a remat.scan_layers stack's own checkpoints are no regions to name
                not_split=None if surveyed.scan_depths else split_note(lengths),
                not_timed=untimed)


def _checked_limit(budget: Any, limit: Any) -> tuple[float | None, int | None]:
    """``(budget, limit in bytes)``, exactly one of them given: a fraction in [0, 1], or
    bytes (:func:`remat.planner._units.parse_bytes`); a one-line ValueError otherwise."""
    if (budget is None) == (limit is None):
        raise ValueError("plan() takes memory_budget= (a fraction of no checkpoint's temp memory) or "
                         "memory_limit= (bytes per device, e.g. '6GiB'): exactly one of them")
    if limit is not None:
        return None, parse_bytes(limit)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
        raise ValueError("plan(memory_budget=...) must be a fraction in [0, 1] (0: the leanest plan), "
                         f"got {budget!r}")
    return budget, None


#: The budget of a device limit that leaves no room for temp memory (the arguments and
#: outputs fill it already): above 0, which asks for the leanest plan, and met by nothing.
NO_ROOM = 1e-12


def _budget_within(search: CandidateSearch, surveyed: Survey, limit_bytes: int) -> float:
    """The budget a device limit of ``limit_bytes`` means: the temp bytes it leaves beside
    the arguments and outputs (``limit - arguments - outputs + aliased``, from the
    un-checkpointed step's compile, which no checkpointing changes), as a fraction of that
    step's temp bytes; at most 1."""
    none = search.evaluate_many([no_checkpoint_spec(surveyed)])[0]
    room = limit_bytes - footprint(none.compiled, search.args, search.argnums).fixed_bytes
    if room <= 0:
        return NO_ROOM
    return min(1.0, room / max(none.compiled_temp_bytes(), 1))


def _start_costing(step_fn: Callable[..., Any], args: tuple, surveyed: Survey, options: list[Any], rates: Rates,
                   exhaustive: bool) -> Callable[[], RegionCosts] | None:
    """The regions' costs, started (:func:`remat.planner._costs.start_region_costs`), where
    the default search applies: not ``exhaustive``, and regions are all there is to decide
    (no ``remat.scan_layers``, no ``checkpoint_sequential``); None where it does not. The
    regions' bodies compile in the background (a fraction of the step each) while the
    un-checkpointed step (the budget's yardstick) lowers. A region in the body of a
    ``lax.scan`` is costed once per trip (:class:`remat.planner._costs.RegionCosts`)."""
    if exhaustive or surveyed.regions == 0 or surveyed.scan_depths or surveyed.sequential_lengths:
        return None
    return start_region_costs(step_fn, args, surveyed.regions, [NO_CHECKPOINT, *options], rates=rates,
                              jaxpr=surveyed.jaxpr)


def _default_search(search: CandidateSearch, surveyed: Survey, budget: float, costing: Callable[[], RegionCosts],
                    second_opinion: bool) -> tuple[PlanCandidate, list[PlanCandidate]]:
    """The default search (:func:`remat.planner._fast.fast_search`): the un-checkpointed
    step and the candidates weighed, with what earlier plans of this step compiled into
    ``cache=`` (weighed at no cost: a sweep down the budgets never forgets a plan that
    still fits)."""
    unchecked = no_checkpoint_spec(surveyed)
    # its residual bytes come with the regions' costs, not from a trace of its own
    search.cache.setdefault(unchecked.label, PlanCandidate(unchecked.label, unchecked.policies))
    # compiles (for its memory; fully only if it is timed) while the regions are costed and the pick is made
    waiting = search.start([unchecked], memory_only=True)
    # a scanned stack may also be split into two segments with options of their own
    costs, _ = with_splits(costing(), stack_lengths(surveyed.jaxpr), scanned_bytes(surveyed.jaxpr))
    none, pool = fast_search(search, surveyed, budget, costs, waiting, second_opinion)
    seen = {c.label for c in pool} | {none.label}
    earlier = [c for c in search.cache.values() if c.compiled is not None and c.label not in seen
               and c.scan is None and c.sequential is None and len(c.policies) == surveyed.regions]
    return none, [none, *pool, *earlier]


def _family_search(search: CandidateSearch, surveyed: Survey, budget: float, policies: Sequence[PolicySpec],
                   budget_fractions: Sequence[float]) -> tuple[PlanCandidate, list[PlanCandidate]]:
    """The compile-everything search: the un-checkpointed step and every candidate of the
    families (:func:`remat.planner._families.family_specs`), and where no scan is in play
    the mixed assignments within the limit (for budget 0, within the least temp memory
    compiled so far: the last region kept, say, may need no more than all rematerialized)."""
    none = search.evaluate_many([no_checkpoint_spec(surveyed)])[0]
    search.calibrate(none, int(budget * none.compiled_temp_bytes()))
    pool = [none, *search.evaluate_many(family_specs(surveyed, policies, budget_fractions))]
    if not surveyed.scan_depths:
        limit = int(budget * none.compiled_temp_bytes()) if budget > 0 else int(LEAN_SLACK * search.least)
        pool += _mixed(search, pool, surveyed.regions, limit)
    return none, pool


def _settled(search: CandidateSearch, pool: list[PlanCandidate], limit: int, complete: bool) -> list[PlanCandidate]:
    """The pool, each policy listed twice weighed once, each marked whether it fits; with
    ``complete``, where nothing fits, the candidates rejected early compiled after all (the
    minimum reported must be the true one)."""
    pool = list({c.label: c for c in pool}.values())
    if complete and not any(c.fits_in(limit) for c in pool) and any(c.compiled is None for c in pool):
        search.early_reject = False
        again = iter(search.evaluate_many([c.spec for c in pool if c.compiled is None]))
        pool = [c if c.compiled is not None else next(again) for c in pool]
    return [dataclasses.replace(c, fits=c.fits_in(limit)) for c in pool]


def _mixed(search: CandidateSearch, pool: list[PlanCandidate], n: int, limit: int) -> list[PlanCandidate]:
    """The mixed assignments (:mod:`remat.planner._mixed`) predicted fastest, compiled to
    confirm whatever the uniform candidates' predictions (XLA's cost analysis has misjudged
    the benchmark's transformer); then, for each, one region
    more of the lean policy where it did not fit, or one fewer where it did."""
    proposals = mixed_specs(uniform_costs(pool, n), n, limit, float("inf"))
    first = search.evaluate_many([spec for spec, _, _ in proposals])
    neighbours = []
    for (spec, _, k), c in zip(proposals, first):
        j = k - 1 if c.fits_in(limit) else k + 1
        if 1 <= j < n:
            neighbours.append(mixed_spec(spec.policies[0], spec.policies[-1], j, n))
    return first + search.evaluate_many(neighbours)


#: Predicted times this close to the fastest's are a tie (XLA's cost analysis and the
#: cost model's rates are not that exact); of tied candidates the leanest is chosen.
PREDICTED_TIE = 0.01


def _choose(fitting: list[PlanCandidate], measured: bool, by_model: bool = False) -> PlanCandidate | None:
    """The fastest fitting candidate (for the leanest plan, the fitting ones are those
    within 1% of the least temp memory); among equally fast ones, the fewest residual bytes.
    Chosen by predicted time (the compiled program's; with ``by_model``, the per-region
    model's where it has one), the candidates within :data:`PREDICTED_TIE` of the fastest
    tie, and the one with the least temp memory is chosen (so that a budget sweep sharing
    ``cache=`` does not trade memory for a predicted gain within the tie)."""
    if not fitting:
        return None
    if measured:
        return min(fitting, key=lambda c: (c.speed_ms(), c.residual_bytes or 0))

    def predicted(c: PlanCandidate) -> float:
        return c.estimated_ms if by_model and c.estimated_ms is not None else c.compiled_ms()

    fastest = min(predicted(c) for c in fitting)
    tied = [c for c in fitting if predicted(c) <= (1 + PREDICTED_TIE) * fastest]
    return min(tied, key=lambda c: (c.compiled_temp_bytes(), predicted(c), c.residual_bytes or 0))

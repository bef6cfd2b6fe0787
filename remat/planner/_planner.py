"""``remat.plan``: weigh every candidate family, compile what may fit, time what fits, choose."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from remat.analysis.budget import calibrate_once, calibrated, calibration_programs
from remat.planner._candidate import PlanCandidate
from remat.planner._costs import start_region_costs
from remat.planner._families import family_specs, name_groups, no_checkpoint_spec
from remat.planner._fast import fast_search
from remat.planner._mixed import mixed_spec, mixed_specs, uniform_costs
from remat.planner._plan import Plan
from remat.planner._search import _BACKGROUND, CandidateSearch
from remat.planner.programs import time_side_by_side
from remat.planner.steering import NONE, _survey
from remat.policies import PolicySpec


def plan(
    step_fn: Callable[..., Any],
    *args: Any,
    memory_budget: float,
    argnums: int | Sequence[int] = 0,
    policies: Sequence[PolicySpec] = ("nothing", "dots_no_batch", "dots"),
    budget_fractions: Sequence[float] = (0.25, 0.5, 0.75),
    repeat: int = 5,
    measure: bool = True,
    cache: dict[str, PlanCandidate] | None = None,
    early_reject: bool = True,
    progress: Callable[[str], None] | None = None,
    exhaustive: bool = False,
    second_opinion: bool = False,
) -> Plan:
    """Finds the fastest way to checkpoint ``step_fn`` whose compiled temp memory fits.

    Args:
      step_fn: a scalar loss ``step_fn(*args)`` whose blocks call :func:`remat.checkpoint`.
      *args: example arguments (parameters first, or as ``argnums`` says).
      memory_budget: the most compiled temp memory of ``jit(grad(step_fn))``, as a fraction
        in [0, 1] of the same step without any checkpoint (the whole step's memory, unlike
        :func:`remat.residual_budget`'s fraction of one region's residuals); 0 asks for the
        leanest plan found: the fastest of the candidates within 1% of the least temp memory.
      argnums: what the gradient is taken with respect to.
      policies: fixed policies tried on every region.
      budget_fractions: fractions of :func:`remat.residual_budget` tried on every region.
      repeat: timing rounds of the fitting candidates (each round runs each once; the
        candidates within 3% of the fastest run ``2 * repeat`` rounds more,
        :func:`remat.planner.programs.time_side_by_side`).
      measure: time the fitting candidates (otherwise choose by predicted time; XLA's cost
        analysis counts a loop body once, so predictions of scan candidates are far too low).
      cache: a dict to reuse compiled candidates across calls with the same ``step_fn``
        and argument shapes (e.g. several budgets for one model).
      early_reject: leave uncompiled the candidates whose residual bytes (one trace) predict
        a temp memory over the limit; they are listed with no temp bytes, and compiled after
        all when nothing else fits.
      progress: called with one line (candidates compiled out of those weighed, the best
        plan so far) after each batch of compiles; e.g. ``print`` to stderr.
      exhaustive: compile every candidate of the families (``remat plan --exhaustive``).
        The default, for a step whose regions are all there is to decide (no scan over
        layers, no ``checkpoint_sequential``), traces each of ``policies`` (and the
        step's ``checkpoint_name`` tags) once on every region, solves for the fastest
        per-region assignment predicted to fit, and compiles only that one to confirm
        (and a few more where it misses, or where the compiled temp bytes show room for
        a faster one: ``docs/planner.md``, "The default search"); other steps, and
        ``exhaustive=True``, compile every candidate.
      second_opinion: the default search also compiles, and times beside its pick, the
        fastest assignment that does without the pick's main policy (the time model's
        errors between policies are larger than its margins; this costs about one more
        compile and a timing run; ``remat plan --second-opinion``).

    Returns:
      A :class:`Plan`; ``plan.apply(step_fn)`` runs the step the planned way.

    Example:
      >>> p = plan(loss, params, x, memory_budget=0.5)            # doctest: +SKIP
      >>> grads = jax.jit(jax.grad(p.apply(loss)))(params, x)  # doctest: +SKIP
    """
    started = time.perf_counter()
    budget = memory_budget
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
        raise ValueError("plan(memory_budget=...) must be a fraction in [0, 1] (0: the leanest plan), "
                         f"got {budget!r}")
    # the cost model's timing programs compile in the background while the step is traced
    # (only their timing, below, needs the machine to itself)
    programs = None if calibrated() else _BACKGROUND.submit(calibration_programs).result
    survey = _survey(step_fn, *args)
    n = survey.regions
    if n == 0 and not survey.scan_depths:
        raise ValueError("plan() found no remat.checkpoint region or remat.scan_layers in step_fn: "
                         "checkpoint its blocks first")
    calibrate_once(programs)  # predicted_ms at this machine's FLOP and byte rates, not defaults
    fast = not exhaustive and n > 0 and not survey.scan_depths and not survey.sequential_lengths
    options = [*policies, *name_groups(survey.names)]
    # the regions' bodies compile in the background (a fraction of the step each) while
    # the un-checkpointed step (the budget's yardstick) lowers; it compiles while the
    # regions are costed and the first pick is made
    costing = start_region_costs(step_fn, args, n, [NONE, *options], survey.jaxpr) if fast else None
    fast = costing is not None
    search = CandidateSearch(step_fn, args, argnums, {} if cache is None else cache,
                             early_reject and not fast, lean=budget == 0, progress=progress)
    unchecked = no_checkpoint_spec(survey)
    if fast:  # its residual bytes come with the regions' costs, not from a trace of its own
        search.cache.setdefault(unchecked.label, PlanCandidate(unchecked.label, unchecked.policies))
    waiting = search.start([unchecked])
    if costing is not None:
        none, pool = fast_search(search, survey, budget, costing(), waiting, second_opinion)
        # what earlier plans of this step compiled into cache= is weighed too, at no cost
        # (a sweep down the budgets then never forgets a plan that still fits)
        seen = {c.label for c in pool} | {none.label}
        earlier = [c for c in search.cache.values() if c.compiled is not None and c.label not in seen
                   and c.scan is None and c.sequential is None and len(c.policies) == n]
        pool = [none, *pool, *earlier]
    else:
        none = waiting()[0]
        search.calibrate(none, int(budget * none.compiled_temp_bytes()))
        pool = [none, *search.evaluate_many(family_specs(survey, policies, budget_fractions))]
        if not survey.scan_depths:
            # the leanest: mixed within the least temp memory compiled so far (the last
            # region kept, say, may need no more memory than all rematerialized)
            limit = int(budget * none.compiled_temp_bytes())
            pool += _mixed(search, pool, n, limit if budget > 0 else int(1.01 * search.least))
    limit = int(budget * none.compiled_temp_bytes())
    if budget == 0:
        # the leanest: the least temp memory any candidate reached, with 1% of slack so
        # that programs differing by a few bytes of bookkeeping are all weighed
        limit = int(1.01 * search.least)
    pool = list({c.label: c for c in pool}.values())  # a policy listed twice is weighed once
    if not fast and not any(c.fits_in(limit) for c in pool) and any(c.compiled is None for c in pool):
        # nothing fits: the minimum reported must be the true one, so the rejected compile too
        search.early_reject = False
        again = iter(search.evaluate_many([c.spec for c in pool if c.compiled is None]))
        pool = [c if c.compiled is not None else next(again) for c in pool]
    pool = [dataclasses.replace(c, fits=c.fits_in(limit)) for c in pool]
    if measure:
        pool = _timed(pool, args, repeat)
    chosen = _choose([c for c in pool if c.contends], measured=measure)
    return Plan(memory_budget=float(budget), limit_bytes=limit, none_temp_bytes=none.compiled_temp_bytes(),
                num_regions=n, feasible=chosen is not None, chosen=chosen, candidates=tuple(pool),
                minimum_bytes=min(c.temp_bytes for c in pool if c.temp_bytes is not None),
                plan_s=time.perf_counter() - started, compile_s=none.compile_s)


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


def _timed(pool: list[PlanCandidate], args: tuple, repeat: int) -> list[PlanCandidate]:
    """The fitting candidates with their measured times, when more than one program fits:
    one program is timed once,
    whatever its spellings (timing it against itself would only let the machine's noise
    choose among equal programs)."""
    fitting = {c.program: c for c in pool if c.contends}
    if len(fitting) < 2:  # nothing to choose between: the one program that fits is the plan
        return pool
    programs = {program: c.executable() for program, c in fitting.items()}
    times = dict(zip(programs, time_side_by_side(list(programs.values()), args, repeat)))
    return [dataclasses.replace(c, measured_ms=times.get(c.program) if c.fits else None) for c in pool]


#: Predicted times this close to the fastest's are a tie (XLA's cost analysis and the
#: cost model's rates are not that exact); of tied candidates the leanest is chosen.
PREDICTED_TIE = 0.01


def _choose(fitting: list[PlanCandidate], measured: bool) -> PlanCandidate | None:
    """The fastest fitting candidate (for the leanest plan, the fitting ones are those
    within 1% of the least temp memory); among equally fast ones, the fewest residual bytes.
    Chosen by predicted time, the candidates within :data:`PREDICTED_TIE` of the fastest
    tie, and the one with the least temp memory is chosen (so that a budget sweep sharing
    ``cache=`` does not trade memory for a predicted gain within the tie)."""
    if not fitting:
        return None
    if measured:
        return min(fitting, key=lambda c: (c.speed_ms(), c.residual_bytes or 0))
    fastest = min(c.compiled_ms() for c in fitting)
    tied = [c for c in fitting if c.compiled_ms() <= (1 + PREDICTED_TIE) * fastest]
    return min(tied, key=lambda c: (c.compiled_temp_bytes(), c.compiled_ms(), c.residual_bytes or 0))

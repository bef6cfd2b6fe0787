"""``remat.plan``: the fastest rematerialization of a whole training step that fits a budget.

The step is the user's own loss function, with ``remat.checkpoint`` (or
``checkpoint_sequential``) around its blocks as usual. While the planner traces it, it
re-decides every checkpointed region (through a hook in :func:`remat.checkpoint`'s one
dispatch): checkpoint it or not, and with which policy. Candidate plans:

* every fixed named policy on every region (``"nothing"``, ``"dots_no_batch"``,
  ``"dots"``, the user's own policies as written, and no checkpoint at all);
* the memory-budget policy at several fractions (:mod:`remat.analysis.budget`);
* the values the step tags with ``checkpoint_name``: all names kept, and each alone;
* which regions to checkpoint: the first ``k`` regions fully rematerialized and the rest
  kept, with ``k`` the smallest that fits (found by bisection; memory falls as ``k`` grows);
* the whole step checkpointed once more (policy ``"nothing"``), its regions not
  checkpointed or each rematerialized inside it: the backward pass keeps only the step's
  inputs, what it cannot recompute (nested checkpointing across the blocks' boundaries).

Each candidate is compiled (XLA's memory analysis gives its exact temp bytes, and its
cost analysis the FLOPs and bytes from which a step time is predicted); the candidates
that fit are timed side by side, and the fastest measured one is the plan. The budget is
a fraction of the un-checkpointed step's compiled temp memory. When nothing fits, the
plan says so and gives the smallest temp memory any candidate reached. Budget 0 asks for
the leanest plan: the least compiled temp memory found (within 1%), then the fewest
residual bytes (values the backward keeps besides the step's inputs), then the fastest.

* for a step that calls :func:`remat.checkpoint_sequential`: its segment count (2, about
  √n, n/2 and n segments for n functions), the segments checkpointed as written;
* for a step that runs stacks of layers with :func:`remat.scan.scan_layers` (or
  ``scan_nnx_layers``): the scan's policy and its segment length, i.e. one flat scan
  checkpointed per layer, ``k`` checkpointed groups of ``N / k`` layers for every
  divisor ``k`` of the depth (√N groups is the classic anchor), and the unequal
  binomial (Revolve-like) schedules of 1 and 2 levels of nesting
  (:func:`remat.scan.binomial_schedule`); the planner measures them all. Linen's
  ``LinenScanLayers`` is taken as written.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from remat import scan as _scan
from remat._core.apply import region_paths  # noqa: F401  (re-exported: the module each planned region is)
from remat.analysis import saved_residuals
from remat.analysis.budget import ResidualBudget, calibrate_once
from remat.analysis.compiled import CompiledMemory
from remat.planner.programs import (  # noqa: F401  (re-exported)
    _predicted_ms,
    _spec_label,
    compile_step,
    lower_step,
    lowered_fingerprint,
    program_fingerprint,
    time_side_by_side,
)
from remat.planner.steering import (  # noqa: F401  (re-exported)
    AS_WRITTEN,
    NONE,
    Binomial,
    _common_divisors,
    _region_policies,
    _scan_choice,
    _sequential_choice,
    _sequential_segment_counts,
    _survey,
    apply_policies,
    count_regions,
    scan_depths,
)
from remat.policies import PolicySpec, policy_name


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run the step: a label and a policy (or ``NONE``) for each region."""

    label: str
    policies: tuple[Any, ...]
    temp_bytes: int | None = None
    predicted_ms: float | None = None
    measured_ms: float | None = None
    fits: bool | None = None
    # every scan over layers: (policy, groups), groups None for a flat scan; None: as written
    scan: tuple[Any, Any] | None = None
    # the segment count of every checkpoint_sequential call (at most its length); None: as written
    sequential: int | None = None
    # a fingerprint of the optimized HLO: candidates spelled differently may compile to
    # the same program (e.g. "as written" and "all: nothing"), which is then timed once
    program: str | None = None
    # a fingerprint of the lowered (unoptimized) program: equal ones are compiled once
    lowered: str | None = None
    # the compiled jit(grad(step)), kept so that timing does not compile it a second time
    compiled: Any = dataclasses.field(default=None, repr=False, compare=False)
    # the whole step checkpointed around its regions (apply_policies(whole_step=True))
    whole_step: bool = False
    # bytes the backward keeps besides the step's inputs (saved_residuals().residual_bytes)
    residual_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "policies": [_spec_label(p) for p in self.policies],
                "scan": None if self.scan is None else {
                    "policy": _spec_label(self.scan[0]),
                    "groups": str(self.scan[1]) if isinstance(self.scan[1], Binomial) else self.scan[1]},
                "sequential_segments": self.sequential, "whole_step": self.whole_step,
                "residual_bytes": self.residual_bytes, "temp_bytes": self.temp_bytes, "predicted_ms": self.predicted_ms,
                "measured_ms": self.measured_ms, "fits": self.fits, "program": self.program}


@dataclasses.dataclass(frozen=True)
class Plan:
    """The planner's answer: the chosen candidate, every candidate it weighed, and why."""

    budget: float
    limit_bytes: int
    none_temp_bytes: int
    num_regions: int
    feasible: bool
    chosen: Candidate | None
    candidates: tuple[Candidate, ...]
    minimum_bytes: int

    def apply(self, step_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``step_fn`` with the plan's choice for every checkpointed region (at trace time)."""
        if self.chosen is None:
            raise ValueError(
                f"the budget {self.budget} cannot be met: the smallest compiled temp memory "
                f"found is {self.minimum_bytes} bytes ({self.minimum_bytes / self.none_temp_bytes:.2f} "
                "of no checkpoint); raise the budget or use remat.scan"
            )
        return apply_policies(step_fn, self.chosen.policies, scan=self.chosen.scan,
                              sequential=self.chosen.sequential, whole_step=self.chosen.whole_step)

    def to_dict(self) -> dict[str, Any]:
        return {"budget": self.budget, "limit_bytes": self.limit_bytes,
                "none_temp_bytes": self.none_temp_bytes, "num_regions": self.num_regions,
                "feasible": self.feasible, "minimum_bytes": self.minimum_bytes,
                "chosen": self.chosen.to_dict() if self.chosen else None,
                "candidates": [c.to_dict() for c in self.candidates]}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        mib = 2**20
        lines = [f"remat plan: budget {self.budget} of {self.none_temp_bytes / mib:.1f} MiB "
                 f"(limit {self.limit_bytes / mib:.1f} MiB), {self.num_regions} checkpointed regions"]
        if not self.feasible:
            lines.append(f"  the budget cannot be met: the minimum found is {self.minimum_bytes / mib:.1f} MiB "
                         f"({self.minimum_bytes / self.none_temp_bytes:.2f} of no checkpoint)")
        lines.append(f"  {'':2}{'candidate':<42}{'temp MiB':>10}{'of none':>9}{'fits':>6}"
                     f"{'pred ms':>9}{'meas ms':>9}")
        for c in self.candidates:
            mark = "->" if self.chosen is not None and c.label == self.chosen.label else "  "
            meas = f"{c.measured_ms:9.2f}" if c.measured_ms is not None else f"{'-':>9}"
            if c.temp_bytes is None:  # rejected before compiling
                lines.append(f"  {mark}{c.label:<42}{'-':>10}{'-':>9}{'no':>6}{'-':>9}{meas}")
                continue
            lines.append(f"  {mark}{c.label:<42}{c.temp_bytes / mib:>10.1f}"
                         f"{c.temp_bytes / self.none_temp_bytes:>9.2f}{'yes' if c.fits else 'no':>6}"
                         f"{c.predicted_ms:>9.2f}{meas}")
        return "\n".join(lines)


def plan(
    step_fn: Callable[..., Any],
    *args: Any,
    budget: float,
    argnums: int | Sequence[int] = 0,
    policies: Sequence[PolicySpec] = ("nothing", "dots_no_batch", "dots"),
    budget_fractions: Sequence[float] = (0.25, 0.5, 0.75),
    repeat: int = 5,
    measure: bool = True,
    cache: dict[str, Candidate] | None = None,
    early_reject: bool = True,
) -> Plan:
    """Finds the fastest way to checkpoint ``step_fn`` whose compiled temp memory fits.

    Args:
      step_fn: a scalar loss ``step_fn(*args)`` whose blocks call :func:`remat.checkpoint`.
      *args: example arguments (parameters first, or as ``argnums`` says).
      budget: the most compiled temp memory of ``jit(grad(step_fn))``, as a fraction in
        [0, 1] of the same step without any checkpoint; 0 asks for the leanest plan
        found (least temp memory, then fewest residual bytes, then fastest).
      argnums: what the gradient is taken with respect to.
      policies: fixed policies tried on every region.
      budget_fractions: fractions of :func:`remat.residual_budget` tried on every region.
      repeat: timed steps per fitting candidate (the median is used).
      measure: time the fitting candidates (otherwise choose by predicted time; XLA's cost
        analysis counts a loop body once, so predictions of scan candidates are far too low).
      cache: a dict to reuse compiled candidates across calls with the same ``step_fn``
        and argument shapes (e.g. several budgets for one model).
      early_reject: leave uncompiled the candidates whose residual bytes (one trace) predict
        a temp memory over the limit (see ``_REJECT_MARGIN``); they are listed with no temp
        bytes, and compiled after all when nothing else fits.

    Returns:
      A :class:`Plan`; ``plan.apply(step_fn)`` runs the step the planned way.

    Example:
      >>> p = plan(loss, params, x, budget=0.5)            # doctest: +SKIP
      >>> grads = jax.jit(jax.grad(p.apply(loss)))(params, x)  # doctest: +SKIP
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
        raise ValueError(f"plan(budget=...) must be a fraction in [0, 1] (0: the leanest plan), got {budget!r}")
    survey = _survey(step_fn, *args)
    n, depths, names = survey.regions, survey.scan_depths, survey.names
    if n == 0 and not depths:
        raise ValueError("plan() found no remat.checkpoint region or remat.scan_layers in step_fn: "
                         "checkpoint its blocks first")

    cache = {} if cache is None else cache
    calibrate_once()  # predicted_ms at this machine's FLOP and byte rates, not defaults

    # the temp bytes above which a candidate is rejected before it is compiled (None: none
    # yet), and the least temp memory compiled so far (budget 0 rejects above it)
    ceiling: list[float | None] = [None]
    least: list[float] = [float("inf")]
    # compiled temp bytes per residual byte, at most 1: XLA may fuse cheap residuals into
    # their consumers (jax.nn's GELU keeps 1.9x more than the un-checkpointed temp buffer)
    folded: list[float] = [1.0]

    def rejected(c: Candidate) -> bool:
        bound = ceiling[0] if budget > 0 else (1.01 * least[0] if least[0] < float("inf") else None)
        return early_reject and bound is not None and c.residual_bytes * folded[0] > _REJECT_MARGIN * bound

    def evaluate_many(requests: list[tuple[Any, ...]]) -> list[Candidate]:
        """Candidates ``(label, specs, scan, sequential, whole_step)``: traced and lowered one
        by one (the hooks steer one trace at a time), the distinct programs compiled together."""
        staged: list[tuple[Candidate, Any, str | None]] = []
        for label, specs, scan, sequential, whole_step in requests:
            c = cache.get(label)
            if c is not None and c.compiled is not None:
                staged.append((c, None, None))
                continue
            planned = apply_policies(step_fn, specs, scan, sequential, whole_step)
            if c is None:  # one trace: what the backward keeps, the candidate's predicted memory
                c = cache[label] = Candidate(label, specs, scan=scan, sequential=sequential, whole_step=whole_step,
                                             residual_bytes=saved_residuals(planned, *args).residual_bytes)
            if rejected(c):  # not compiled: predicted not to fit (see _REJECT_MARGIN)
                staged.append((c, None, None))
                continue
            lowered = lower_step(planned, args, argnums)
            staged.append((c, lowered, lowered_fingerprint(lowered)))
        # spelled differently, lowered the same ("as written" and "all: nothing" often): one
        # compile; the distinct new programs compile side by side (XLA releases the GIL)
        known = {o.lowered: o for o in cache.values() if o.compiled is not None}
        todo = {key: lowered for _, lowered, key in staged if key is not None and key not in known}
        for key, compiled in zip(todo, compile_all(list(todo.values()))):
            # one compile gives the exact temp bytes, the FLOPs/bytes for the time model and
            # the executable that is timed
            known[key] = Candidate("", (), temp_bytes=CompiledMemory.from_compiled(compiled).temp_bytes,
                                   predicted_ms=_predicted_ms(compiled), program=program_fingerprint(compiled),
                                   lowered=key, compiled=compiled)
        out = []
        for c, _, key in staged:
            if key is not None:
                k = known[key]
                c = cache[c.label] = dataclasses.replace(c, temp_bytes=k.temp_bytes, predicted_ms=k.predicted_ms,
                                                         program=k.program, lowered=key, compiled=k.compiled)
            if c.temp_bytes is not None:
                least[0] = min(least[0], c.temp_bytes)
            out.append(c)
        return out

    def evaluate(label: str, specs: tuple[Any, ...], scan: tuple[Any, Any] | None = None,
                 sequential: int | None = None, whole_step: bool = False) -> Candidate:
        return evaluate_many([(label, specs, scan, sequential, whole_step)])[0]

    # without any checkpoint: no region checkpointed and every scan unchecked and flat
    none = evaluate("no checkpoint", (NONE,) * n, (NONE, None) if depths else None)
    limit = int(budget * none.temp_bytes)
    ceiling[0] = limit
    folded[0] = min(1.0, none.temp_bytes / max(none.residual_bytes, 1))
    requests: list[tuple[Any, ...]] = [("as written", (AS_WRITTEN,) * n, None, None, False)]
    # the whole step checkpointed: only its inputs kept, its regions not checkpointed (one
    # recomputation of the forward) or each rematerialized again inside it
    for inner in (NONE, AS_WRITTEN):
        requests.append(_request(f"whole step: nothing, regions {'as written' if inner == AS_WRITTEN else NONE}",
                             (inner,) * n, whole_step=True))
    for p in policies if n else ():
        requests.append(_request(f"all: {policy_name(p)}", (p,) * n))
    for f in budget_fractions if n else ():
        requests.append(_request(f"all: residual_budget({f})", (ResidualBudget(f),) * n))
    # the values the model's author tagged with checkpoint_name: all of them, and each
    # alone while there are few (a tag marks a value worth keeping, e.g. an attention
    # output that is costly to recompute and small to keep)
    for group in ([tuple(names)] + ([(m,) for m in names] if 1 < len(names) <= 4 else [])) if n and names else ():
        requests.append(_request(f"all: {policy_name(group)}", (group,) * n))
    if depths:
        # the regions as written (e.g. inside the scanned layer); every scan re-decided
        # and unequal (binomial, Revolve-like) schedules of 1 and 2 levels of nesting, which
        # keep fewer layer inputs than any equal grouping (remat.scan.binomial_schedule)
        binomial = [Binomial(levels) for levels in (1, 2) if min(depths) >= 4]
        for p in policies:
            for groups in [None, *_common_divisors(depths), *binomial]:
                if groups is None:
                    shape = "flat"
                elif isinstance(groups, Binomial):
                    shape = str(groups) + (f" {_scan.binomial_schedule(depths[0], groups.levels)}"
                                           if len(set(depths)) == 1 else "")
                else:
                    shape = f"{groups} groups"
                requests.append(_request(f"scan: {policy_name(p)}, {shape}", (AS_WRITTEN,) * n, (p, groups)))
    if survey.sequential_lengths:
        # the segment count of every checkpoint_sequential; its segments keep the options
        # written (their number changes, so no per-region policy applies)
        for k in _sequential_segment_counts(survey.sequential_lengths):
            requests.append(_request(f"sequential: {k} segments", (), sequential=k))
    pool: list[Candidate] = [none, *evaluate_many(requests)]
    if budget == 0:
        # the leanest: the least temp memory any candidate reached, with 1% of slack so
        # that programs differing by a few bytes of bookkeeping are all weighed
        limit = int(1.01 * least[0])
    for rest in (NONE, "dots") if budget > 0 else ():
        prefix = _smallest_prefix(lambda k, rest=rest: evaluate(f"first {k}: nothing, rest {rest}",
                                                                ("nothing",) * k + (rest,) * (n - k)), n, limit)
        if prefix is not None:
            pool.append(prefix)

    pool = list({c.label: c for c in pool}.values())  # a policy listed twice is weighed once
    if not any(_fits(c, limit) for c in pool) and any(c.compiled is None for c in pool):
        # nothing fits: the minimum reported must be the true one, so the rejected compile too
        ceiling[0] = None
        again = evaluate_many([(c.label, c.policies, c.scan, c.sequential, c.whole_step)
                               for c in pool if c.compiled is None])
        pool = [c if c.compiled is not None else again.pop(0) for c in pool]
    pool = [dataclasses.replace(c, fits=_fits(c, limit)) for c in pool]
    fitting = [c for c in pool if c.fits]
    if measure and fitting:
        # one program is timed once, whatever its spellings: timing it against itself
        # would only let the machine's noise choose among equal programs
        programs = {c.program: c.compiled for c in fitting}
        times = dict(zip(programs, time_side_by_side(list(programs.values()), args, repeat)))
        pool = [dataclasses.replace(c, measured_ms=times.get(c.program) if c.fits else None) for c in pool]
        fitting = [c for c in pool if c.fits]
    key = (lambda c: c.measured_ms) if measure else (lambda c: c.predicted_ms)
    if budget == 0 and fitting:
        # the leanest first: fewest residual bytes (within 1%), then the fastest of those
        fewest = min(c.residual_bytes for c in fitting)
        fitting = [c for c in fitting if c.residual_bytes <= 1.01 * fewest]
    chosen = min(fitting, key=key) if fitting else None
    return Plan(budget=float(budget), limit_bytes=limit, none_temp_bytes=none.temp_bytes,
                num_regions=n, feasible=chosen is not None, chosen=chosen,
                candidates=tuple(pool), minimum_bytes=min(c.temp_bytes for c in pool if c.temp_bytes is not None))


#: A candidate whose predicted temp bytes exceed the limit by this factor is not compiled.
#: The prediction is its residual bytes (one trace), scaled by what XLA kept of the
#: un-checkpointed step's residuals when that is less than all: the residuals are live
#: together where the forward pass turns into the backward, so the temp buffer holds them
#: unless XLA fuses them into their consumers. Measured: temp >= residual bytes for every
#: candidate of the benchmark's transformer and MLP (remat.ops); with jax.nn ops the
#: scaled prediction stayed below the temp bytes too (tests/test_planner.py).
_REJECT_MARGIN = 1.25


def _request(label: str, specs: tuple[Any, ...], scan: tuple[Any, Any] | None = None,
             sequential: int | None = None, whole_step: bool = False) -> tuple[Any, ...]:
    return (label, specs, scan, sequential, whole_step)


def compile_all(lowered: list[Any]) -> list[Any]:
    """``[l.compile() for l in lowered]``, on as many threads as the machine has cores."""
    if len(lowered) <= 1:
        return [low.compile() for low in lowered]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(lowered), os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda low: low.compile(), lowered))


def _fits(c: Candidate, limit: float) -> bool:
    return c.temp_bytes is not None and c.temp_bytes <= limit


def _smallest_prefix(evaluate: Callable[[int], Candidate], n: int, limit: int) -> Candidate | None:
    """Bisection for the fewest leading regions to checkpoint so that the step fits."""
    lo, hi, best = 1, n - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        c = evaluate(mid)
        if _fits(c, limit):
            best, hi = c, mid - 1
        else:
            lo = mid + 1
    return best

"""The default search of a `remat.scan_layers` step: each policy and schedule costed by a model, the pick compiled."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from remat import scan as _scan
from remat.analysis.machine import Rates
from remat.planner._candidate import CandidateSpec, PlanCandidate
from remat.planner._costs import RegionCosts, start_region_costs
from remat.planner._families import BINOMIAL_DEPTH, no_checkpoint_spec
from remat.planner._search import LEAN_SLACK, CandidateSearch
from remat.planner._segments import Segments, scanned_bytes
from remat.planner._split_options import SPLIT_COPIES, pareto_pairs
from remat.planner.steering import Binomial, Survey, apply_policies
from remat.policies import NO_CHECKPOINT, is_no_checkpoint, policy_name

#: Rounds of confirming compiles: after a pick that does not fit, the fastest leaner one.
ROUNDS = 4


@dataclasses.dataclass(frozen=True)
class ScanOption:
    """One way to run the stack: a per-layer policy and a schedule, with its predictions.

    Attributes:
      policy: each layer's policy.
      groups: None (flat), ``k`` equal groups, or :class:`~remat.planner.steering.Binomial`.
      schedule: the schedule ``groups`` makes at the stack's depth (an int: flat).
      peak: the predicted peak, bytes (:func:`schedule_bytes`).
      ms: the predicted time it adds to the un-checkpointed step.
    """

    policy: Any
    groups: Any
    schedule: _scan.Schedule
    peak: float
    ms: float

    @property
    def spec(self) -> CandidateSpec:
        """The candidate that runs this option (labelled as the compile-everything search labels it)."""
        if self.groups is None:
            shape = "flat"
        elif isinstance(self.groups, Binomial):
            shape = f"{self.groups} {self.schedule}"
        else:
            shape = f"{self.groups} groups"
        return CandidateSpec(f"scan: {policy_name(self.policy)}, {shape}", (), (self.policy, self.groups))


def schedule_bytes(schedule: _scan.Schedule, layer_kept: float, layer_input: float, working: float,
                   split_bytes: float = 0.0) -> float:
    """The predicted peak of a stack run by ``schedule``: the schedules' model
    (:func:`remat.scan.schedule_peak`) in bytes.

    A flat run of ``n`` layers keeps ``n * layer_kept`` (each layer's kept values under its
    policy); while child ``i`` (1-based) of a tuple is recomputed, the inputs of children
    ``1..i-1`` are held (``layer_input`` each) beside the child's own peak; one layer's
    ``working`` set is live on top. Unequal children cut the stacked weights with
    ``lax.split``, whose backward concatenates their gradients: ``split_bytes`` more.

    Example:
      >>> schedule_bytes((2, 2), layer_kept=3.0, layer_input=1.0, working=10.0)   # max(0 + 6, 1 + 6) + 10
      17.0
    """
    def peak(s: _scan.Schedule) -> float:
        if isinstance(s, int):
            return s * layer_kept
        return max(i * layer_input + peak(child) for i, child in enumerate(s))

    unequal = not isinstance(schedule, int) and len(set(map(str, schedule))) > 1
    return peak(schedule) + working + (split_bytes if unequal else 0.0)


def scan_options(costs: RegionCosts, depth: int, groups: Sequence[Any], split_bytes: float) -> list[ScanOption]:
    """Every checkpointing policy of ``costs`` (``NO_CHECKPOINT`` first, then ``"nothing"``)
    with every one of ``groups``, costed from one layer's costs: its kept bytes and recompute
    time under each policy, its input (what ``"nothing"`` keeps) and its working set
    (what it keeps un-checkpointed). Each level of nesting recomputes every layer's
    forward once more (``"nothing"``'s recompute time). Besides, the stack split into two
    flat scans, ``k`` layers of a leaner policy and the rest of a faster one, for every
    ``k`` and every pair of :func:`remat.planner._split_options.pareto_pairs` (with
    :data:`~remat.planner._split_options.SPLIT_COPIES` copies of the stacked weights).

    Args:
      costs: one layer's costs (the stack's scanned body), per trip.
      depth: the stack's layers.
      groups: the schedules weighed: None (flat), ints (equal groups), :class:`Binomial`.
      split_bytes: the stacked weights' bytes (what unequal children concatenate).
    """
    kept, ms = costs.kept[0], costs.ms[0]
    layer_input, forward_ms, working = kept[1], ms[1], float(kept[0])
    out = []
    for j, policy in enumerate(costs.options):
        if is_no_checkpoint(policy):
            continue
        for g in groups:
            schedule = _schedule(depth, g)
            if schedule is None:
                continue
            levels = _scan.schedule_recomputes(schedule)
            out.append(ScanOption(policy, g, schedule,
                                  schedule_bytes(schedule, kept[j], layer_input, working, split_bytes),
                                  depth * (ms[j] + levels * forward_ms)))
    # the stack split in two flat scans, a leaner policy on the first k layers, a faster one on the rest
    for a, b in pareto_pairs(ms, kept):
        for k in range(1, depth):
            split = Segments.of(((k, costs.options[a]), (depth - k, costs.options[b])))
            out.append(ScanOption(split, None, depth,
                                  k * kept[a] + (depth - k) * kept[b] + working + SPLIT_COPIES * split_bytes,
                                  k * ms[a] + (depth - k) * ms[b]))
    return out


def _schedule(depth: int, groups: Any) -> _scan.Schedule | None:
    """The schedule of ``groups`` at ``depth`` (None: it does not apply)."""
    if groups is None:
        return depth
    if isinstance(groups, Binomial):
        schedule = _scan.binomial_schedule(depth, groups.levels)
        return None if isinstance(schedule, int) else schedule
    return (depth // groups,) * groups if depth % groups == 0 else None


def start_schedule_costs(step_fn: Callable[..., Any], args: tuple, surveyed: Survey, policies: Sequence[Any],
                         rates: Rates) -> Callable[[], tuple[RegionCosts, float]] | None:
    """One layer's costs under ``NO_CHECKPOINT``, ``"nothing"`` and ``policies``, started
    (:func:`remat.planner._costs.start_region_costs` on the step traced with its stack
    flat, each layer checkpointed), and the stack's scanned bytes; None where the step's
    only decision is not one ``remat.scan_layers`` stack (no region, no
    ``checkpoint_sequential``) whose layer shows as one checkpointed body."""
    if surveyed.regions or surveyed.sequential_lengths or len(surveyed.scan_depths) != 1:
        return None
    flat = jax.make_jaxpr(lambda *a: apply_policies(step_fn, (), scan=("nothing", None))(*a))(*args)
    options = [NO_CHECKPOINT, "nothing", *(p for p in policies if policy_name(p) != "nothing")]
    finish = start_region_costs(step_fn, args, 1, options, rates=rates, jaxpr=flat)
    if finish is None:
        return None
    weights = scanned_bytes(flat)
    return lambda: (finish(), float(weights[0]) if weights else 0.0)


def schedule_search(search: CandidateSearch, surveyed: Survey, budget: float, costs: RegionCosts,
                    split_bytes: float) -> tuple[PlanCandidate, list[PlanCandidate]]:
    """The un-checkpointed step and the candidates weighed: every policy flat, in equal
    groups and in binomial schedules (:func:`scan_options`), predicted; the fastest
    predicted to fit compiled beside the un-checkpointed step (the prediction's scale,
    compiled temp bytes per predicted byte, cancels in ``peak <= budget * none's peak``);
    while the compiled pick does not fit, the fastest leaner one, at most :data:`ROUNDS`.

    Args:
      search: the search, not yet calibrated.
      surveyed: the step (one scan over layers).
      budget: the memory budget, a fraction of the un-checkpointed step's temp bytes (0: the leanest).
      costs: one layer's costs (:func:`start_schedule_costs`).
      split_bytes: the stack's scanned bytes.
    """
    depth = surveyed.scan_depths[0]
    groups = [None, *(k for k in range(2, depth) if depth % k == 0),
              *(Binomial(levels) for levels in (1, 2) if depth >= BINOMIAL_DEPTH)]
    options = scan_options(costs, depth, groups, split_bytes)
    none_peak = depth * float(costs.kept[0][0]) + float(costs.kept[0][0])
    bound = LEAN_SLACK * min(o.peak for o in options) if budget == 0 else budget * none_peak
    search.early_reject = False  # what compiles is chosen here
    pick = _fastest(options, bound)
    none, *first = search.evaluate_many([no_checkpoint_spec(surveyed), *([pick.spec] if pick else [])])
    limit = int(budget * none.compiled_temp_bytes())
    search.calibrate(none, limit)
    compiled = list(first)
    if budget == 0:  # the leanest predicted, and the next leanest: their compiles say which is
        compiled += search.evaluate_many([o.spec for o in sorted(options, key=lambda o: o.peak)[1:2]])
    for _ in range(ROUNDS - 1):
        if budget == 0 or pick is None or compiled[-1].fits_in(limit):
            break
        pick = _fastest(options, pick.peak * (1 - 1e-9))
        compiled += search.evaluate_many([pick.spec]) if pick is not None else []
    if not any(c.fits_in(limit) for c in compiled) and budget > 0:  # the leanest, for the minimum reported
        compiled += search.evaluate_many([min(options, key=lambda o: (o.peak, -o.ms)).spec])
    scale = none.compiled_temp_bytes() / max(none_peak, 1.0)
    shown = {c.label for c in compiled}
    estimated = [PlanCandidate(o.spec.label, (), scan=(o.policy, o.groups), estimated_temp_bytes=int(scale * o.peak),
                               estimated_ms=(none.predicted_ms or 0.0) + o.ms)
                 for o in options if o.spec.label not in shown]
    return none, [none, *compiled, *estimated]


def _fastest(options: list[ScanOption], bound: float) -> ScanOption | None:
    """The predicted-fastest option whose peak is at most ``bound`` (ties: the leaner)."""
    within = [o for o in options if o.peak <= bound]
    return min(within, key=lambda o: (o.ms, o.peak), default=None)

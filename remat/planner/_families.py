"""The candidate families the planner weighs, as specs (what each candidate changes in the step)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from remat import scan as _scan
from remat.analysis.budget import ResidualBudget
from remat.planner._candidate import CandidateSpec
from remat.planner.steering import AS_WRITTEN, Binomial, Survey
from remat.policies import NO_CHECKPOINT, PolicySpec, offload_names, policy_name

#: The fixed policies the planner tries on every region (``remat.plan(policies=)``'s default).
PLANNED_POLICIES: tuple[PolicySpec, ...] = ("nothing", "dots_no_batch", "dots")
#: The residual-budget fractions tried on every region by the compile-everything search.
BUDGET_FRACTIONS = (0.25, 0.5, 0.75)
#: Up to this many checkpoint names, each is also tried alone: more would multiply the options.
FEW_NAMES = 4
#: Scans at least this deep are also tried with binomial schedules: shallower ones have
#: nothing to gain from nesting over equal groups.
BINOMIAL_DEPTH = 4


def no_checkpoint_spec(survey: Survey) -> CandidateSpec:
    """No region checkpointed and every scan over layers unchecked and flat: the baseline."""
    scan = (NO_CHECKPOINT, None) if survey.scan_depths else None
    return CandidateSpec("no checkpoint", (NO_CHECKPOINT,) * survey.regions, scan)


def family_specs(survey: Survey, policies: Sequence[PolicySpec],
                 budget_fractions: Sequence[float]) -> list[CandidateSpec]:
    """Every candidate of the fixed families, for a step with what ``survey`` found.

    Args:
      survey: one trace's regions, scan depths, sequential lengths and checkpoint names.
      policies: fixed policies tried on every region (and on every scan).
      budget_fractions: fractions of :func:`remat.residual_budget` tried on every region.

    Returns:
      The specs, "as written" first.
    """
    n = survey.regions
    specs = [CandidateSpec("as written", (AS_WRITTEN,) * n)]
    # the whole step checkpointed: only its inputs kept, its regions not checkpointed (one
    # recomputation of the forward) or each rematerialized again inside it
    for inner in (NO_CHECKPOINT, AS_WRITTEN):
        specs.append(CandidateSpec(f"whole step: nothing, regions {policy_name(inner)}",
                                   (inner,) * n, whole_step=True))
    if n:
        specs += [CandidateSpec(f"all: {policy_name(p)}", (p,) * n) for p in policies]
        specs += [CandidateSpec(f"all: residual_budget({f})", (ResidualBudget(f),) * n) for f in budget_fractions]
        specs += _name_specs(survey)
    specs += _scan_specs(survey, policies)
    # the segment count of every checkpoint_sequential; its segments keep the options
    # written (their number changes, so no per-region policy applies)
    for k in _sequential_segment_counts(survey.sequential_lengths) if survey.sequential_lengths else ():
        specs.append(CandidateSpec(f"sequential: {k} segments", (), sequential=k))
    return specs


def name_groups(names: Sequence[str]) -> list[tuple[str, ...]]:
    """The checkpoint-name policies weighed for the values a step tags: all of them, and
    each alone while there are few (a tag marks a value worth keeping, e.g. an attention
    output that is costly to recompute and small to keep).

    Example:
      >>> name_groups(["attn_out", "mlp_hidden"])
      [('attn_out', 'mlp_hidden'), ('attn_out',), ('mlp_hidden',)]
    """
    if not names:
        return []
    return [tuple(names)] + ([(m,) for m in names] if 1 < len(names) <= FEW_NAMES else [])


#: The one line :meth:`remat.planner.Plan.why` gives where the step tags values but
#: :func:`host_offload_available` is False.
NO_HOST_OFFLOAD = ("host offload not considered: the backend ({platform}) has no host memory "
                   "separate from the device's")


def host_offload_available(devices: Sequence[Any] | None = None) -> bool:
    """Whether ``devices`` (default: ``jax.devices()``) can move a value to host memory
    distinct from theirs: GPUs or TPUs that expose a ``pinned_host`` memory kind. XLA:CPU
    lists one too, but there it is the same memory, and JAX lowers the move as nothing."""
    import jax

    devices = jax.devices() if devices is None else devices
    return bool(devices) and all(
        d.platform in ("gpu", "tpu") and "pinned_host" in {m.kind for m in d.addressable_memories()}
        for d in devices)


def offload_groups(names: Sequence[str], devices: Sequence[Any] | None = None) -> list[Any]:
    """Each of :func:`name_groups` offloaded to host memory instead of kept on the device
    (:func:`remat.policies.offload_names`), where :func:`host_offload_available`; else none.

    Example:
      >>> offload_groups(["attn_out"], jax.devices("cpu"))  # doctest: +SKIP
      []
    """
    if not names or not host_offload_available(devices):
        return []
    return [offload_names(*g) for g in name_groups(names)]


def offload_note(names: Sequence[str], devices: Sequence[Any] | None = None) -> str | None:
    """Why host offload was not weighed for a step tagging ``names`` (None: it was, or
    there is nothing tagged to offload)."""
    import jax

    if not names or host_offload_available(devices):
        return None
    devices = jax.devices() if devices is None else devices
    return NO_HOST_OFFLOAD.format(platform=devices[0].platform if devices else "none")


def _name_specs(survey: Survey) -> list[CandidateSpec]:
    """Every region keeping the values the model's author tagged (:func:`name_groups`),
    or offloading them to host memory (:func:`offload_groups`)."""
    groups = [*name_groups(survey.names), *offload_groups(survey.names)]
    return [CandidateSpec(f"all: {policy_name(g)}", (g,) * survey.regions) for g in groups]


def _scan_specs(survey: Survey, policies: Sequence[PolicySpec]) -> list[CandidateSpec]:
    """Every scan re-decided (the regions as written, e.g. inside the scanned layer): each
    policy flat, in equal groups, and in unequal binomial (Revolve-like) schedules of 1 and
    2 levels of nesting, which keep fewer layer inputs than any equal grouping."""
    depths = survey.scan_depths
    if not depths:
        return []
    binomial = [Binomial(levels) for levels in (1, 2) if min(depths) >= BINOMIAL_DEPTH]
    specs = []
    for p in policies:
        for groups in [None, *_common_divisors(depths), *binomial]:
            if groups is None:
                shape = "flat"
            elif isinstance(groups, Binomial):
                shape = str(groups) + (f" {_scan.binomial_schedule(depths[0], groups.levels)}"
                                       if len(set(depths)) == 1 else "")
            else:
                shape = f"{groups} groups"
            specs.append(CandidateSpec(f"scan: {policy_name(p)}, {shape}", (AS_WRITTEN,) * survey.regions,
                                       (p, groups)))
    return specs


def _sequential_segment_counts(lengths: Sequence[int]) -> list[int]:
    """Segment counts to try for checkpoint_sequential calls of these lengths.

    2 (one checkpointed half), about sqrt(n) (Chen et al.'s anchor), n / 2 and n (every
    function its own checkpointed segment but the last), for the longest call.
    """
    n = max(lengths)
    return sorted({k for k in (2, 3, 4, round(math.sqrt(n)), n // 2, n) if 2 <= k <= n})


def _common_divisors(depths: Sequence[int]) -> list[int]:
    """Group counts that divide every scan's depth, excluding 1 and the depth itself."""
    g = 0
    for d in depths:
        g = math.gcd(g, d)
    return [k for k in range(2, g) if g % k == 0]

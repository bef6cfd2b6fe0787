"""The candidate families the planner weighs, as specs (what each candidate changes in the step)."""
from __future__ import annotations

from collections.abc import Sequence

from remat import scan as _scan
from remat.analysis.budget import ResidualBudget
from remat.planner._candidate import CandidateSpec
from remat.planner.steering import (
    AS_WRITTEN,
    NONE,
    Binomial,
    _common_divisors,
    _sequential_segment_counts,
    _Survey,
)
from remat.policies import PolicySpec, policy_name


def no_checkpoint_spec(survey: _Survey) -> CandidateSpec:
    """No region checkpointed and every scan over layers unchecked and flat: the baseline."""
    return CandidateSpec("no checkpoint", (NONE,) * survey.regions, (NONE, None) if survey.scan_depths else None)


def family_specs(survey: _Survey, policies: Sequence[PolicySpec],
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
    for inner in (NONE, AS_WRITTEN):
        specs.append(CandidateSpec(f"whole step: nothing, regions {'as written' if inner == AS_WRITTEN else NONE}",
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
    return [tuple(names)] + ([(m,) for m in names] if 1 < len(names) <= 4 else [])


def _name_specs(survey: _Survey) -> list[CandidateSpec]:
    """Every region keeping the values the model's author tagged (:func:`name_groups`)."""
    return [CandidateSpec(f"all: {policy_name(g)}", (g,) * survey.regions) for g in name_groups(survey.names)]


def _scan_specs(survey: _Survey, policies: Sequence[PolicySpec]) -> list[CandidateSpec]:
    """Every scan re-decided (the regions as written, e.g. inside the scanned layer): each
    policy flat, in equal groups, and in unequal binomial (Revolve-like) schedules of 1 and
    2 levels of nesting, which keep fewer layer inputs than any equal grouping."""
    depths = survey.scan_depths
    if not depths:
        return []
    binomial = [Binomial(levels) for levels in (1, 2) if min(depths) >= 4]
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

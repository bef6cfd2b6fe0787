"""The planner's default search: estimate every candidate before compiling, compile the finalists."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from remat.planner._candidate import CandidateSpec, PlanCandidate
from remat.planner._mixed import mixed_specs, uniform_costs
from remat.planner._search import CandidateSearch
from remat.planner.programs import _spec_label
from remat.policies import is_no_checkpoint

#: Finalists compiled together per round (two cores' worth), and rounds at most before
#: every remaining candidate estimated to fit is compiled.
ROUND_SIZE, ROUNDS = 2, 3


def temp_of(c: PlanCandidate) -> float | None:
    """The compiled temp bytes, else the estimate."""
    return c.temp_bytes if c.temp_bytes is not None else c.estimated_temp_bytes


def ms_of(c: PlanCandidate) -> float | None:
    """The compiled program's predicted time, else the estimate before compiling."""
    return c.predicted_ms if c.predicted_ms is not None else c.estimated_ms


def finalists(search: CandidateSearch, specs: Sequence[CandidateSpec], n: int, limit: int,
              mixed: bool) -> list[PlanCandidate]:
    """Every candidate of ``specs`` (and the mixed assignments), the finalists compiled.

    Each candidate is traced and lowered (:meth:`CandidateSearch.preview`), which gives its
    estimated temp bytes and time without compiling. The candidates estimated to fit are
    compiled in order of estimated time, ``ROUND_SIZE`` at a time, until two fit (the plan
    and its runner-up); for the leanest plan (``limit`` 0), those estimated leanest.

    Args:
      search: the search, calibrated on the un-checkpointed step.
      specs: the candidates of the fixed families.
      n: the number of regions.
      limit: the temp bytes allowed (0: the leanest plan).
      mixed: add the mixed assignments (:mod:`remat.planner._mixed`) sized from the estimates.

    Returns:
      The candidates, compiled or with their estimates only.
    """
    labels = [search.preview(spec)[0].label for spec in specs]
    per_region = _per_region_bytes([search.cache[label] for label in labels], n, search)
    _refine(search, labels, per_region)
    if mixed:
        pool = [search.cache[label] for label in labels] + [search.none]
        beat = min((ms_of(c) for c in pool if temp_of(c) is not None and temp_of(c) <= limit), default=float("inf"))
        for spec, _, _ in mixed_specs(uniform_costs(pool, n, temp_of, ms_of), n, limit, beat):
            labels.append(search.preview(spec)[0].label)
    labels = list(dict.fromkeys(labels))
    _refine(search, labels, per_region)
    ranked = _ranked([search.cache[label] for label in labels], limit)
    for _ in range(ROUNDS):
        weighed = [search.cache[label] for label in labels]
        fitting = [c for c in weighed if c.compiled is not None and _fits(c, limit, search)]
        todo = [c for c in ranked if search.cache[c.label].compiled is None][:ROUND_SIZE]
        if len(fitting) >= 2 or not todo:
            break
        search.evaluate_many([c.spec for c in todo])
    return [search.cache[label] for label in labels]


def _per_region_bytes(pool: list[PlanCandidate], n: int, search: CandidateSearch) -> dict[str, float]:
    """What one region is estimated to hold at the peak under each policy: a uniform
    candidate's residual bytes over ``n``; for no checkpoint, scaled by what XLA kept of the
    un-checkpointed step's residuals (it fuses some into their consumers)."""
    out = {}
    for c in [search.none, *pool]:
        labels = {_spec_label(p) for p in c.policies}
        if len(labels) == 1 and len(c.policies) == n and not c.whole_step and c.scan in (None, search.none.scan):
            label = labels.pop()
            scale = search.folded if is_no_checkpoint(c.policies[0]) else 1.0
            out.setdefault(label, scale * c.residual_bytes / n)
    return out


def _refine(search: CandidateSearch, labels: list[str], per_region: dict[str, float]) -> None:
    """Estimated temp bytes as the sum over regions of :func:`_per_region_bytes` (the whole
    step checkpointed: as its regions alone), where every region's policy has a figure."""
    for label in labels:
        c = search.cache[label]
        if c.compiled is not None or c.scan is not None or c.sequential is not None or not c.policies:
            continue
        parts = [per_region.get(_spec_label(p)) for p in c.policies]
        if all(part is not None for part in parts):
            search.cache[label] = dataclasses.replace(c, estimated_temp_bytes=int(sum(parts)))


def _fits(c: PlanCandidate, limit: int, search: CandidateSearch) -> bool:
    return c.fits_in(limit if limit > 0 else 1.01 * search.least)


def _ranked(pool: list[PlanCandidate], limit: int) -> list[PlanCandidate]:
    """The candidates worth compiling, first first: estimated to fit, fastest first; for the
    leanest plan, those within 10% of the least estimated temp bytes, fastest first."""
    known = [c for c in pool if temp_of(c) is not None and ms_of(c) is not None]
    if limit <= 0:
        least = min((temp_of(c) for c in known), default=0)
        return sorted((c for c in known if temp_of(c) <= 1.1 * least), key=ms_of)
    return sorted((c for c in known if temp_of(c) <= limit), key=ms_of)

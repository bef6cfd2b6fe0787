"""The planner's default search: estimate every candidate before compiling, compile the finalists."""
from __future__ import annotations

from collections.abc import Sequence

from remat.planner._candidate import CandidateSpec, PlanCandidate
from remat.planner._mixed import mixed_specs, uniform_costs
from remat.planner._search import CandidateSearch

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
    if mixed:
        pool = [search.cache[label] for label in labels] + [search.none]
        beat = min((ms_of(c) for c in pool if temp_of(c) is not None and temp_of(c) <= limit), default=float("inf"))
        for spec, _, _ in mixed_specs(uniform_costs(pool, n, temp_of, ms_of), n, limit, beat):
            labels.append(search.preview(spec)[0].label)
    labels = list(dict.fromkeys(labels))
    ranked = _ranked([search.cache[label] for label in labels], limit)
    for _ in range(ROUNDS):
        weighed = [search.cache[label] for label in labels]
        fitting = [c for c in weighed if c.compiled is not None and _fits(c, limit, search)]
        todo = [c for c in ranked if search.cache[c.label].compiled is None][:ROUND_SIZE]
        if len(fitting) >= 2 or not todo:
            break
        search.evaluate_many([c.spec for c in todo])
    return [search.cache[label] for label in labels]


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

"""Mixed assignments: some regions with a lean policy, the rest a faster one, sized by a cost model.

Every uniform candidate (one policy on every region, or none) is compiled anyway. Taken
per region, its temp bytes and predicted time say what one region costs under that
policy: a step whose first ``k`` regions use policy A and the rest policy B is predicted
to need ``(k * temp_A + (n - k) * temp_B) / n`` temp bytes and likewise time (the lean
policy first: the last regions' backward passes follow their forward soonest). For each
pair of policies (A leaner than B) the fewest ``k`` predicted to fit is the knapsack's
answer; the pairs predicted fastest are compiled to confirm, and the ``k`` next to it is
tried when the prediction was off by a region.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from remat.planner._candidate import CandidateSpec, PlanCandidate
from remat.policies import policy_name


def uniform_costs(pool: Sequence[PlanCandidate], n: int) -> list[tuple[Any, float, float]]:
    """``(policy, temp, ms)`` of every compiled candidate that uses one policy (or none) on
    all ``n`` regions and leaves scans and sequentials as written: its compiled temp bytes
    and predicted time."""
    out, seen = [], set()
    for c in pool:
        if c.temp_bytes is None or c.predicted_ms is None or not _uniform(c, n):
            continue
        label = policy_name(c.policies[0])
        if label in seen or label == "as written":
            continue
        seen.add(label)
        out.append((c.policies[0], float(c.temp_bytes), c.predicted_ms))
    return out


def _uniform(c: PlanCandidate, n: int) -> bool:
    """One policy (or none) on all ``n`` regions, scans and sequentials as written."""
    if c.whole_step or c.sequential is not None or n < 2 or len(c.policies) != n:
        return False
    return len(set(map(policy_name, c.policies))) == 1 and (c.scan is None or c.label == "no checkpoint")


#: The mixed pairs compiled to confirm: each costs a compile, and the model's ranking
#: past the first few is seldom right by the margins between them.
MIXED_PAIRS = 3


def mixed_specs(costs: Sequence[tuple[Any, float, float]], n: int, limit: int, beat_ms: float,
                top: int = MIXED_PAIRS) -> list[tuple[CandidateSpec, float, int]]:
    """The mixed assignments predicted fastest within ``limit`` and faster than ``beat_ms``.

    Args:
      costs: :func:`uniform_costs`.
      n: the number of regions.
      limit: the temp bytes allowed.
      beat_ms: the predicted time of the fastest uniform candidate that fits (inf: none).
      top: how many pairs to return.

    Returns:
      ``(spec, predicted_ms, k)`` for the ``top`` pairs, fastest first; ``k`` leading
      regions use the leaner policy.
    """
    found = []
    for lean, temp_lean, ms_lean in costs:
        for fast, temp_fast, ms_fast in costs:
            if not temp_lean < temp_fast or not ms_fast < ms_lean or temp_lean > limit:
                continue  # B must cost more memory and less time than A, and A alone must fit
            # fewest k with (k * temp_lean + (n - k) * temp_fast) / n <= limit
            # at most n - 1: the last region's backward follows its forward at once, so what
            # it keeps costs little at the peak (the linear model overstates it)
            k = min(n - 1, max(1, math.ceil(n * (temp_fast - limit) / (temp_fast - temp_lean))))
            ms = (k * ms_lean + (n - k) * ms_fast) / n
            if ms < beat_ms:
                found.append((mixed_spec(lean, fast, k, n), ms, k))
    found.sort(key=lambda f: f[1])
    return found[:top]


def mixed_spec(lean: Any, fast: Any, k: int, n: int) -> CandidateSpec:
    """The first ``k`` of ``n`` regions with ``lean``, the rest with ``fast``."""
    return CandidateSpec(f"first {k}: {policy_name(lean)}, rest {policy_name(fast)}", (lean,) * k + (fast,) * (n - k))

"""Segment splits of scanned stacks as options of their regions, costed from the regions' per-trip costs."""
from __future__ import annotations

from collections.abc import Sequence

from remat.planner._costs import RegionCosts
from remat.planner._segments import Segments

#: What a split adds to the bytes its stack keeps, in copies of the operands the scan
#: slices per layer (the stacked weights): the slices its segments scan over are copies,
#: and the backward concatenates the segments' gradients of them into one buffer
#: (``lax.split``'s transpose), beside the pieces. Compiled splits of
#: ``tests/test_planner_segments.py``'s stacks add between one and two such copies.
SPLIT_COPIES = 2
#: The copies a split with a one-layer part makes instead: the gradients' concatenation
#: alone (one layer is no loop, so its slice is not copied into a stacked buffer of its
#: own). Compiled 5/1 and 1/5 splits of ``benchmarks.scanned_oracle``'s stack, and of the
#: same stack with 64 times its weights, add about one such copy (3/3 splits add 1.5).
ONE_LAYER_COPIES = 1

#: A split option that a region cannot take (its stack is another length, or not
#: splittable): infinitely slow, so no assignment takes it (as ``_assign`` narrows options).
NOT_OFFERED_MS = float("inf")


def pareto_pairs(ms: Sequence[float], kept: Sequence[int]) -> list[tuple[int, int]]:
    """The ``(leaner, faster)`` option pairs worth splitting a stack between: both on the
    front of the options' per-trip ``(kept, ms)`` (none keeps less and is no slower), the
    first keeping less and the second faster.

    With one limit on the kept bytes, the fastest mix of per-layer options is a mix of two
    options of that front, as many layers of the faster one as fit; the options that no
    other beats are all weighed, as the peak is not a sum alone (a region's working set).

    Example:
      >>> pareto_pairs([0.0, 3.0, 1.0, 2.0], [10, 1, 4, 5])  # option 3 keeps more than 2, and is slower
      [(1, 2), (1, 0), (2, 0)]
    """
    order = sorted(range(len(ms)), key=lambda j: (kept[j], ms[j]))
    front, best = [], float("inf")
    for j in order:
        if ms[j] < best:
            front.append(j)
            best = ms[j]
    return [(a, b) for n, a in enumerate(front) for b in front[n + 1:]]


def with_splits(costs: RegionCosts, lengths: Sequence[int | str],
                scanned: Sequence[int]) -> tuple[RegionCosts, list[Segments]]:
    """``costs`` with a split option for each stack: two consecutive segments, the first
    ``k`` layers with a leaner option and the other ``N - k`` with a faster one
    (:func:`pareto_pairs`), for every ``0 < k < N``.

    A split's costs per run of the region are the mean of its parts' per-trip costs,
    weighted by their layers (the model multiplies them by the trips again): a segment of
    ``k`` layers keeps ``k`` times a layer's kept bytes and recomputes ``k`` times; the
    split keeps copies of its scanned operands besides (:func:`_split_cost`: fewer where a
    part is one layer, and the last region's last layer, split off, keeps nothing). A
    region whose stack cannot be split, or is of another length, is not offered it.

    Args:
      costs: the regions' costs, per run; ``costs.trips`` says how many runs.
      lengths: per region, its stack's length where it can be split
        (:func:`remat.planner._segments.stack_lengths`), else why not.
      scanned: per region, the bytes its scan slices per layer
        (:func:`remat.planner._segments.scanned_bytes`).

    Returns:
      The costs with the split options after the others, and those options.
    """
    splits: dict[str, Segments] = {}
    for i, length in enumerate(lengths):
        if not isinstance(length, int) or costs.runs(i) != length:
            continue
        for a, b in pareto_pairs(costs.ms[i], costs.kept[i]):
            for k in range(1, length):
                s = Segments.of(((k, costs.options[a]), (length - k, costs.options[b])))
                splits.setdefault(str(s), s)
    if not splits:
        return costs, []
    options = list(costs.options)
    ms, kept = [list(row) for row in costs.ms], [list(row) for row in costs.kept]
    for s in splits.values():
        for i, length in enumerate(lengths):
            cost = _split_cost(costs, i, s, scanned[i], i == len(lengths) - 1) \
                if length == s.length and costs.runs(i) == length else None
            ms[i].append(NOT_OFFERED_MS if cost is None else cost[0])
            kept[i].append(kept[i][0] if cost is None else cost[1])
    return costs._replace(ms=ms, kept=kept, options=[*options, *splits.values()]), list(splits.values())


def _split_cost(costs: RegionCosts, i: int, s: Segments, scanned: int, last: bool) -> tuple[float, int]:
    """Region ``i``'s per-run ``(ms, kept)`` under split ``s``: its parts' per-trip costs,
    weighted by their layers, and the copies of the ``scanned`` operands spread over the
    runs (:data:`ONE_LAYER_COPIES` where a part is one layer, else :data:`SPLIT_COPIES`).

    A one-layer last part of the ``last`` region keeps nothing: one layer is no loop (XLA
    inlines a loop of one trip), so its backward follows its forward at once and it holds
    its working set alone, as the last region does (:func:`remat.planner._assign.peak`);
    in a loop, that layer's kept bytes would be stacked with the others'.
    """
    tail = len(s.parts) - 1 if last and s.parts[-1][0] == 1 else None
    copies = ONE_LAYER_COPIES if any(count == 1 for count, _ in s.parts) else SPLIT_COPIES
    ms, kept = 0.0, float(copies * scanned)
    for part, (count, option) in enumerate(s.parts):
        j = costs.options.index(option)
        ms += count * costs.ms[i][j]
        kept += 0 if part == tail else count * costs.kept[i][j]
    return ms / s.length, round(kept / s.length)

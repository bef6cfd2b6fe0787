"""Checkpoint schedules for scan over layers: their memory model, the binomial (Revolve) schedule, validation.

A schedule is an int ``n`` (a flat scan of ``n`` layers) or a tuple whose children run in
sequence, each checkpointed as a whole (it keeps only its input). Its peak in layer
inputs is ``peak(n) = n`` and ``peak((c_1, ..., c_m)) = max_i (i - 1 + peak(c_i))``;
:func:`binomial_schedule` gives the least peak for a number of nesting levels.
"""
from __future__ import annotations

import math
from typing import Any, Union

__all__ = [
    "Schedule",
    "best_segments",
    "binomial_schedule",
    "schedule_peak",
    "schedule_recomputes",
]

# A checkpoint schedule: an int n is a flat scan of n layers; a tuple runs its children
# in sequence, each under its own jax.checkpoint (it keeps only its input).
Schedule = Union[int, tuple["Schedule", ...]]


def best_segments(depth: int) -> int:
    """The number of segments that minimises memory for ``nested=True``.

    The divisor ``k`` of ``depth`` minimising ``k + depth / k`` (the saved group inputs
    plus the layer inputs of one group), fewer segments on a tie. For a prime depth this
    is 1 (no nesting helps without uneven groups); pass a depth with divisors.

    Example:
      >>> best_segments(16), best_segments(12), best_segments(7)
      (4, 3, 1)
    """
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    divisors = [k for k in range(1, depth + 1) if depth % k == 0]
    return min(divisors, key=lambda k: (k + depth // k, k))


# --------------------------------------------------------------------------------------
# Checkpoint schedules
# --------------------------------------------------------------------------------------


def _check_schedule(schedule: Any, whole: Any = None) -> Schedule:
    """``schedule`` with lists turned into tuples; a one-line ValueError if malformed."""
    whole = schedule if whole is None else whole
    if isinstance(schedule, bool) or not isinstance(schedule, (int, tuple, list)):
        raise ValueError(
            f"schedule {whole!r} has a leaf {schedule!r} of type {type(schedule).__name__}; "
            "use positive ints (flat runs of layers) and tuples (checkpointed groups)"
        )
    if isinstance(schedule, int):
        if schedule < 1:
            raise ValueError(
                f"schedule {whole!r} has a leaf {schedule}; every leaf must be a positive int number of layers"
            )
        return schedule
    if not schedule:
        raise ValueError(f"schedule {whole!r} has an empty tuple; every tuple needs at least one child")
    return tuple(_check_schedule(c, whole) for c in schedule)


def _schedule_depth(schedule: Schedule) -> int:
    return schedule if isinstance(schedule, int) else sum(_schedule_depth(c) for c in schedule)


def schedule_peak(schedule: Schedule) -> int:
    """The most layer inputs a schedule keeps at once (the memory model's peak).

    ``peak(n) = n`` for a flat run of ``n`` layers (it saves every layer input);
    ``peak((c_1, ..., c_m)) = max_i (i - 1 + peak(c_i))``: while the backward of child
    ``i`` runs, the inputs of children ``1..i-1`` are still held and child ``i`` is
    recomputed with its own peak. Memory is about ``peak * A`` plus one layer's
    internals, with ``A`` the size of a layer input.

    Example:
      >>> schedule_peak(16), schedule_peak((4, 4, 4, 4)), schedule_peak((6, 5, 4, 1))
      (16, 7, 6)
      >>> schedule_peak(((4, 3, 2, 1), (3, 2, 1)))
      4
    """
    schedule = _check_schedule(schedule)
    return _peak(schedule)


def _peak(schedule: Schedule) -> int:
    if isinstance(schedule, int):
        return schedule
    return max(i + _peak(c) for i, c in enumerate(schedule))


def schedule_recomputes(schedule: Schedule) -> int:
    """Extra forward passes a schedule costs: its nesting depth (a flat int is 0).

    A layer inside ``d`` nested tuples is recomputed ``d`` times during the backward
    (on top of whatever its own per-layer ``policy`` recomputes).

    Example:
      >>> schedule_recomputes(16), schedule_recomputes((4, 4, 4, 4)), schedule_recomputes(((3, 2, 1), (2, 1), 1))
      (0, 1, 2)
    """
    schedule = _check_schedule(schedule)
    return _levels(schedule)


def _levels(schedule: Schedule) -> int:
    return 0 if isinstance(schedule, int) else 1 + max(_levels(c) for c in schedule)


def _capacity(peak: int, levels: int) -> int:
    """The most layers any schedule with at most ``levels`` levels fits in ``peak`` inputs.

    ``cap(p, 0) = p``; ``cap(p, l) = sum_{q=1..p} cap(q, l-1)`` (child ``i`` may peak at
    ``p - i + 1``), which is ``C(p + l, l + 1)``.
    """
    return math.comb(peak + levels, levels + 1) if peak > 0 else 0


def _build(n: int, peak: int, levels: int) -> Schedule:
    """A schedule of ``n <= cap(peak, levels)`` layers within ``peak``: fewest levels, then fewest children."""
    lv = next(k for k in range(levels + 1) if _capacity(peak, k) >= n)
    if lv == 0:
        return n
    children: list[Schedule] = []
    q = peak
    while n:  # child i (1-based) may peak at peak - i + 1; filling the first ones fullest
        size = min(n, _capacity(q, lv - 1))  # gives the fewest children
        children.append(_build(size, q, lv - 1))
        n -= size
        q -= 1
    return tuple(children)


def binomial_schedule(depth: int, levels: int) -> Schedule:
    """The schedule of ``depth`` layers with the least peak memory and at most ``levels`` levels.

    Under the model of :func:`schedule_peak` (``peak(n) = n``, ``peak(tuple) =
    max_i (i - 1 + peak(child_i))``), the most layers that fit in a peak of ``p``
    stored inputs with ``l`` levels is ``cap(p, 0) = p`` and ``cap(p, l) =
    sum_{q=1..p} cap(q, l - 1) = C(p + l, l + 1)``: child ``i`` of the top tuple may
    itself peak at ``p - i + 1``. This is the binomial bound of Revolve (Griewank &
    Walther 2000, "Algorithm 799: revolve") with the levels as the number of
    recomputations; one level with equal groups is Chen et al. 2016's ``sqrt(N)``.
    The schedule takes the least ``p`` with ``cap(p, levels) >= depth``, then the fewest
    levels that still fit in ``p``, and fills the children in order to their capacity
    (the fewest children); segment lengths therefore decrease, e.g. ``(6, 5, 4, 1)``.

    Args:
      depth: number of layers (at least 1).
      levels: most levels of nesting (0: flat). Each level costs at most one more
        forward recomputation (:func:`schedule_recomputes`).

    Returns:
      A schedule for ``scan_layers(..., segments=...)``: ``depth`` itself (an int) when
      no nesting lowers the peak, otherwise a nested tuple.

    Example:
      >>> binomial_schedule(16, 0), binomial_schedule(16, 1), binomial_schedule(16, 2)
      (16, (6, 5, 4, 1), ((4, 3, 2, 1), (3, 2, 1)))
      >>> [schedule_peak(binomial_schedule(16, l)) for l in range(4)]
      [16, 6, 4, 4]
      >>> binomial_schedule(10, 1)
      (4, 3, 2, 1)
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"binomial_schedule(depth={depth!r}): depth must be a positive int")
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 0:
        raise ValueError(f"binomial_schedule(levels={levels!r}): levels must be an int >= 0 (0: flat)")
    if levels == 0:
        return depth
    lo, hi = 1, depth  # cap(depth, levels) >= depth: bisect the least peak
    while lo < hi:
        mid = (lo + hi) // 2
        if _capacity(mid, levels) >= depth:
            hi = mid
        else:
            lo = mid + 1
    return _build(depth, lo, levels)


# --------------------------------------------------------------------------------------
# Validating the nesting a caller (or a planner) asked for
# --------------------------------------------------------------------------------------


def _groups(depth: int, segments: Any, nested: bool, levels: int | None) -> int | Schedule | None:
    if levels is not None:
        if isinstance(levels, bool) or not isinstance(levels, int) or levels < 0:
            raise ValueError(f"levels must be an int >= 0 (0: flat), got {levels!r}")
        if segments is not None or nested:
            given = f"segments={segments!r}" if segments is not None else "nested=True"
            raise ValueError(f"levels={levels} and {given} both choose the nesting; pass only one of them")
        schedule = binomial_schedule(depth, levels)
        return None if isinstance(schedule, int) else schedule
    if isinstance(segments, (tuple, list)):
        if nested:
            raise ValueError(f"segments={segments!r} and nested=True both choose the nesting; pass only one of them")
        return _check_groups(depth, segments, "schedule")
    return _num_segments(depth, segments, nested)


def _check_groups(depth: int, groups: Any, what: str) -> int | Schedule | None:
    if groups is None:
        return None
    if not isinstance(groups, (tuple, list)):
        return _num_segments(depth, groups, False)
    schedule = _check_schedule(groups)
    covered = _schedule_depth(schedule)
    if covered != depth:
        raise ValueError(
            f"{what} {schedule!r} covers {covered} layers but params have depth {depth}; "
            "its leaf lengths must sum to the depth"
        )
    return schedule


def _num_segments(depth: int, segments: int | None, nested: bool) -> int | None:
    if segments is None:
        return best_segments(depth) if nested else None
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(
            f"segments must be a positive int (equal groups) or a schedule tuple, got {segments!r}"
        )
    if depth % segments:
        divisors = [k for k in range(1, depth + 1) if depth % k == 0]
        raise ValueError(
            f"depth {depth} is not divisible by segments={segments}; use one of {divisors}"
        )
    return segments

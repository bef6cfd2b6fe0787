"""The exact per-region assignment: the fastest choice for every region whose predicted peak fits a limit."""
from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import NamedTuple


class RegionOption(NamedTuple):
    """One choice for one region: what it keeps for its backward pass and what it costs.

    Attributes:
      kept: bytes the region keeps from its forward pass to its backward pass.
      ms: the region's predicted share of the step time under this choice.
    """

    kept: float
    ms: float


class Assignment(NamedTuple):
    """A choice for every region, by index into that region's options, and its predictions.

    Attributes:
      choice: the option index of each region, in trace order.
      peak: the predicted peak (:func:`peak`), in the units of ``RegionOption.kept``.
      ms: the predicted step time, the sum of the regions' ``ms``.
    """

    choice: tuple[int, ...]
    peak: float
    ms: float


#: Turns "a peak of at most ``p``" into "below ``p``" (:func:`below`) despite float rounding.
JUST_BELOW = 1 - 1e-9


def below(top: float) -> float:
    """The largest peak bound that excludes a peak of ``top``: the next leaner assignments."""
    return top * JUST_BELOW


def peak(kept: Sequence[float], working: Sequence[float]) -> float:
    """The predicted peak of a step whose regions keep ``kept`` bytes each, in order.

    While region ``i`` runs (its forward, or its backward with its forward recomputed),
    every earlier region's kept values are live and so is region ``i``'s whole working set
    (``working[i]``: what it would keep un-checkpointed); at the turn from the forward to
    the backward pass every region's kept values are live. The peak is the largest of
    those sums. So what the last region keeps costs nothing beyond its working set: its
    backward follows its forward at once.

    Args:
      kept: each region's kept bytes.
      working: each region's working set (its kept bytes un-checkpointed).

    Returns:
      ``max(max_i(sum(kept[:i]) + working[i]), sum(kept))``.

    Example:
      >>> peak([1, 1, 1], [4, 4, 4])
      6.0
    """
    cum, top = 0.0, 0.0
    for k, w in zip(kept, working):
        top = max(top, cum + w)
        cum += k
    return max(top, cum)


def fastest_within(options: Sequence[Sequence[RegionOption]], working: Sequence[float],
                   limit: float) -> Assignment | None:
    """The predicted-fastest assignment whose :func:`peak` is at most ``limit``: exact.

    A dynamic program over the regions in order: a partial assignment is a state
    ``(kept so far, time so far)``, and a state that keeps no less and is no faster than
    another is dropped (every completion of it is feasible for the other, and slower), so
    what is left after the last region holds the optimum. Each step checks that the
    region's working set fits on top of what the earlier regions keep. Ties on time go to
    the fewer kept bytes.

    Args:
      options: each region's choices.
      working: each region's working set.
      limit: the largest peak allowed.

    Returns:
      The assignment, or None when none fits.

    Example:
      >>> opts = [RegionOption(0, 3.0), RegionOption(4, 1.0)]   # recompute, or keep
      >>> fastest_within([opts] * 3, [4] * 3, 4).choice           # the last one kept for free
      (0, 0, 1)
    """
    states: list[tuple[float, float, tuple[int, ...]]] = [(0.0, 0.0, ())]
    top = [0.0]  # the peak so far of each state
    for choices, w in zip(options, working):
        grown = []
        for (cum, ms, choice), high in zip(states, top):
            if cum + w > limit:
                continue
            for j, o in enumerate(choices):
                grown.append((cum + o.kept, ms + o.ms, choice + (j,), max(high, cum + w)))
        # the Pareto front in (kept so far, time so far); the peak so far is at most the
        # limit for every state left, so it needs no third dimension
        grown.sort(key=lambda s: (s[0], s[1]))
        states, top, best_ms = [], [], float("inf")
        for cum, ms, choice, high in grown:
            if ms < best_ms:
                states.append((cum, ms, choice))
                top.append(high)
                best_ms = ms
        if not states:
            return None
    final = [(ms, cum, choice, max(high, cum)) for (cum, ms, choice), high in zip(states, top) if cum <= limit]
    if not final:
        return None
    ms, _, choice, high = min(final, key=lambda s: (s[0], s[1]))
    return Assignment(choice, high, ms)


def front_within(options: Sequence[Sequence[RegionOption]], working: Sequence[float],
                 limit: float) -> list[Assignment]:
    """Every assignment whose :func:`peak` is at most ``limit`` and that no other one beats
    on both peak and time (the model's front), leanest first: exact.

    The dynamic program of :func:`fastest_within`, with the peak so far as a third
    dimension of a state (a state that keeps no less, is no faster and peaked no lower
    than another is dropped), so that one pass gives the fastest assignment at every
    peak: what a cost that is not a sum over regions (the page faults of a temp buffer
    over glibc's mmap threshold, say) is weighed on.

    Example:
      >>> opts = [RegionOption(0, 3.0), RegionOption(4, 1.0)]
      >>> [(a.choice, a.peak, a.ms) for a in front_within([opts] * 2, [4] * 2, 8)]
      [((0, 1), 4.0, 4.0), ((1, 1), 8.0, 2.0)]
    """
    states: list[_State] = [(0.0, 0.0, 0.0, ())]
    for choices, w in zip(options, working):
        grown = [(cum + o.kept, ms + o.ms, max(high, cum + w), choice + (j,))
                 for cum, ms, high, choice in states if cum + w <= limit
                 for j, o in enumerate(choices)]
        states = _undominated(grown)
        if not states:
            return []
    final = _undominated([(max(high, cum), ms, max(high, cum), choice)
                          for cum, ms, high, choice in states if cum <= limit])
    return [Assignment(choice, top, ms) for top, ms, _, choice in final]


_State = tuple[float, float, float, tuple[int, ...]]  # kept so far, time so far, peak so far, choice


def _undominated(states: list[_State]) -> list[_State]:
    """The states ``(kept, ms, high, choice)`` that no other one matches or beats in all of
    ``kept``, ``ms`` and ``high``; in order of ``kept`` (then ``ms``)."""
    states.sort(key=lambda s: (s[0], s[1], s[2]))
    kept: list[_State] = []
    # the staircase of the states kept so far: by time, ascending, the least peak of those
    # no slower (strictly falling), so that "one kept state is no slower and peaked no
    # higher" is one bisection, not a scan of them all
    stair_ms: list[float] = []
    stair_high: list[float] = []
    for s in states:
        i = bisect.bisect_right(stair_ms, s[1])
        if i and stair_high[i - 1] <= s[2]:
            continue
        kept.append(s)
        j = i
        while j < len(stair_ms) and stair_high[j] >= s[2]:
            j += 1
        start = i - 1 if i and stair_ms[i - 1] == s[1] else i  # the same time, peaked higher
        stair_ms[start:j] = [s[1]]
        stair_high[start:j] = [s[2]]
    return kept


def ranked_within(options: Sequence[Sequence[RegionOption]], working: Sequence[float],
                  limit: float) -> Iterator[Assignment]:
    """Every assignment whose :func:`peak` is at most ``limit``, fastest first: exact.

    Lawler's ranking over :func:`fastest_within`: once an assignment ``s`` is given, what
    is left of its space splits into the assignments that first differ from ``s`` at
    region ``i`` (regions before ``i`` as in ``s``, region ``i`` anything else), and the
    fastest of each part is one more :func:`fastest_within`. A part's options are
    narrowed by making the others infinitely slow.

    Example:
      >>> opts = [RegionOption(0, 3.0), RegionOption(4, 1.0)]
      >>> [a.choice for a in itertools.islice(ranked_within([opts] * 2, [4] * 2, 4), 3)]
      [(0, 1), (0, 0)]
    """
    ties = itertools.count()  # equal times pop in the order found

    def solve(allowed: list[set[int]]) -> Assignment | None:
        narrowed = [[o if j in ok else o._replace(ms=float("inf")) for j, o in enumerate(opts)]
                    for opts, ok in zip(options, allowed)]
        found = fastest_within(narrowed, working, limit)
        return None if found is None or found.ms == float("inf") else found

    everything = [set(range(len(opts))) for opts in options]
    first = solve(everything)
    heap = [] if first is None else [(first.ms, next(ties), first, everything)]
    while heap:
        _, _, best, allowed = heapq.heappop(heap)
        yield best
        for i, j in enumerate(best.choice):
            part = [{best.choice[k]} for k in range(i)] + [allowed[i] - {j}] + allowed[i + 1:]
            if part[i]:
                found = solve(part)
                if found is not None:
                    heapq.heappush(heap, (found.ms, next(ties), found, part))


def describe(labels: Sequence[str]) -> str:
    """A short label for an assignment: runs of equal choices, e.g. ``"nothing x3, dots"``.

    Example:
      >>> describe(["nothing", "nothing", "nothing", "dots"])
      'nothing x3, dots'
    """
    runs: list[list] = []
    for label in labels:
        if runs and runs[-1][0] == label:
            runs[-1][1] += 1
        else:
            runs.append([label, 1])
    return ", ".join(label if count == 1 else f"{label} x{count}" for label, count in runs)

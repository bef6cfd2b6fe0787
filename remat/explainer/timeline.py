"""Live temp memory over a compiled program's schedule, replayed from XLA's heap simulation.

XLA's buffer assignment packs every temporary value of a compiled program into one temp
buffer (``memory_analysis().temp_size_in_bytes``), guided by a heap simulation that walks
the schedule allocating and freeing values. :func:`heap_timeline` replays that
simulation's trace: which value occupies which bytes of the temp buffer from which step
to which, the live bytes after every step, the peak, and the gaps that XLA's packing
leaves free at the peak (bytes that are part of the temp buffer because a value placed
there lives just before or after it).
"""
from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable

from remat.explainer._hlo_proto import Allocation, HeapTrace, HloProgram


@dataclasses.dataclass(frozen=True)
class Occupancy:
    """One value holding ``size`` bytes at ``offset`` of the temp buffer during steps ``[start, end)``.

    A value computed in place of another (XLA's ``share``) takes over the other's bytes:
    the earlier value's occupancy ends where the later one's starts.
    """

    buffer_id: int
    offset: int
    size: int
    start: int
    end: int

    def live_at(self, step: int) -> bool:
        return self.start <= step < self.end


@dataclasses.dataclass(frozen=True)
class Gap:
    """Bytes of the temp buffer free at the peak, and the value XLA packed there nearest in time."""

    offset: int
    size: int
    holder: Occupancy | None


@dataclasses.dataclass(frozen=True)
class HeapTimeline:
    """The temp buffer over the schedule.

    Attributes:
      size: the temp buffer's bytes (``temp_size_in_bytes``).
      live_bytes: bytes held by live values after each step (a step is one heap event).
      occupancies: every value's stay in the temp buffer.
      step_buffers: the logical buffer each step allocates or frees.
      peak: the step where the packed buffer reaches its full size with the most bytes live.
    """

    size: int
    live_bytes: tuple[int, ...]
    occupancies: tuple[Occupancy, ...]
    step_buffers: tuple[int, ...]
    peak: int

    @property
    def steps(self) -> int:
        return len(self.live_bytes)

    def live_at(self, step: int) -> list[Occupancy]:
        return [o for o in self.occupancies if o.live_at(step)]

    def gaps_at(self, step: int) -> list[Gap]:
        """The free ranges of the temp buffer at ``step``, each with its nearest holder in time."""
        covered = sorted((o.offset, o.offset + o.size) for o in self.live_at(step))
        free, position = [], 0
        for begin, end in covered:
            if begin > position:
                free.append((position, begin))
            position = max(position, end)
        if position < self.size:
            free.append((position, self.size))
        gaps: list[Gap] = []
        for begin, end in free:
            gaps.extend(self._split_by_holders(begin, end, step))
        return gaps

    def _split_by_holders(self, begin: int, end: int, step: int) -> list[Gap]:
        """Cuts ``[begin, end)`` into pieces, each given to the value placed there nearest to ``step``."""
        def distance(o: Occupancy) -> int:
            return o.start - step if o.start > step else step - o.end + 1

        pieces: list[Gap] = []
        todo = [(begin, end)]
        candidates = sorted((o for o in self.occupancies if o.offset < end and o.offset + o.size > begin),
                            key=distance)
        for holder in candidates:
            rest = []
            for b, e in todo:
                lo, hi = max(b, holder.offset), min(e, holder.offset + holder.size)
                if lo >= hi:
                    rest.append((b, e))
                    continue
                pieces.append(Gap(lo, hi - lo, holder))
                rest.extend(x for x in ((b, lo), (hi, e)) if x[0] < x[1])
            todo = rest
            if not todo:
                break
        pieces.extend(Gap(b, e - b, None) for b, e in todo)  # never used: alignment padding
        return pieces


def temp_allocation(program: HloProgram) -> Allocation | None:
    """The allocation that holds the program's temporaries (the largest, if several)."""
    temps = [a for a in program.allocations if a.is_temp]
    return max(temps, key=lambda a: a.size) if temps else None


def _temp_trace(program: HloProgram, allocation: Allocation) -> HeapTrace | None:
    ids = {b for b, _, _ in allocation.assigned}
    scored = [(sum(e.buffer_id in ids for e in t.events), t) for t in program.traces]
    scored = [s for s in scored if s[0]]
    return max(scored, key=lambda s: s[0])[1] if scored else None


def heap_timeline(program: HloProgram) -> HeapTimeline:
    """Replays XLA's heap simulation of the temp buffer.

    Args:
      program: a compiled program read with its buffer assignment.

    Returns:
      A :class:`HeapTimeline` (empty when the program has no temp buffer).
    """
    allocation = temp_allocation(program)
    trace = _temp_trace(program, allocation) if allocation is not None else None
    if allocation is None or trace is None:
        return HeapTimeline(allocation.size if allocation else 0, (), (), (), 0)
    placed = {b: (offset, size) for b, offset, size in allocation.assigned}
    group: dict[int, int] = {}  # buffer -> canonical buffer whose bytes it uses
    members: dict[int, set[int]] = {}
    current: dict[int, tuple[int, int]] = {}  # canonical -> (buffer now holding its bytes, since step)
    occupancies: list[Occupancy] = []
    live = 0
    ends: list[tuple[int, int]] = []  # (-end offset, canonical): the top of the packed buffer, lazily
    live_bytes: list[int] = []
    best = (-1, -1, 0)

    def close(canonical: int, step: int) -> None:
        buffer, since = current.pop(canonical)
        offset, _ = placed.get(canonical, (0, 0))
        occupancies.append(Occupancy(buffer, offset, _size(canonical), since, step))

    def _size(canonical: int) -> int:
        return placed.get(canonical, (0, program.buffers[canonical].size))[1]

    reused: dict[int, int] = {}  # freed canonical -> the buffer that took its bytes over

    def holder_group(buffer: int) -> int | None:
        """The live group holding ``buffer``'s bytes (following bytes freed and taken over)."""
        for _ in range(len(trace.events)):
            canonical = group.get(buffer)
            if canonical is not None and members.get(canonical):
                return canonical
            if buffer not in reused:
                return None
            buffer = reused[buffer]
        return None

    for step, event in enumerate(trace.events):
        if event.buffer_id not in placed and event.buffer_id not in group and event.kind != "share":
            live_bytes.append(live)
            continue
        canonical = holder_group(event.share_with) if event.kind == "share" else None
        if canonical is not None:
            group[event.buffer_id] = canonical  # the same bytes as a live value (in place, or an alias)
            members[canonical].add(event.buffer_id)
            close(canonical, step)
            current[canonical] = (event.buffer_id, step)
        elif event.kind in ("alloc", "share"):
            if event.kind == "share":
                reused[event.share_with] = event.buffer_id  # takes over bytes just freed
                if event.buffer_id not in placed and event.share_with in placed:
                    placed[event.buffer_id] = placed[event.share_with]
            group[event.buffer_id] = event.buffer_id
            members[event.buffer_id] = {event.buffer_id}
            current[event.buffer_id] = (event.buffer_id, step)
            live += _size(event.buffer_id)
            if event.buffer_id in placed:
                heapq.heappush(ends, (-sum(placed[event.buffer_id]), event.buffer_id))
        else:  # free
            canonical = group.get(event.buffer_id, event.buffer_id)
            members.get(canonical, set()).discard(event.buffer_id)
            if canonical in current and not members.get(canonical):
                close(canonical, step)
                live -= _size(canonical)
        while ends and ends[0][1] not in current:
            heapq.heappop(ends)
        top = -ends[0][0] if ends else 0
        live_bytes.append(live)
        if (top, live) > best[:2]:
            best = (top, live, step)
    for canonical in list(current):
        close(canonical, len(trace.events))
    return HeapTimeline(allocation.size, tuple(live_bytes), tuple(occupancies),
                        tuple(e.buffer_id for e in trace.events), best[2])


def split_forward_backward(is_backward: Callable[[int], bool | None], steps: int) -> int | None:
    """The step where the backward pass begins: the split that leaves fewest steps on the wrong side.

    Args:
      is_backward: step -> True (the step's value belongs to the backward pass), False
        (forward) or None (neither: not counted).
      steps: the number of steps.

    Returns:
      The first step of the backward pass, or None when the program has no backward pass.
    """
    marks = [is_backward(i) for i in range(steps)]
    if not any(m is True for m in marks):
        return None
    wrong = sum(m is False for m in marks)  # all steps backward: every forward one misplaced
    best, best_at = wrong, 0
    for i, m in enumerate(marks):
        wrong += (m is True) - (m is False)  # step i moves to the forward side
        if wrong < best:
            best, best_at = wrong, i + 1
    return best_at

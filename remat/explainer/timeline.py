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

from remat.explainer._hlo_proto import Allocation, HeapEvent, HeapTrace, HloProgram


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
class Placement:
    """A value XLA placed at ``offset`` of the temp buffer that its heap trace never names: a value
    of a computation the program calls (a conditional's branch, say), whose steps are unknown."""

    buffer_id: int
    offset: int
    size: int


@dataclasses.dataclass(frozen=True)
class Gap:
    """Bytes of the temp buffer free at the peak, and the value XLA packed there nearest in time.

    ``holder`` is None where no traced value ever held these bytes; ``placed`` is then the
    untraced value XLA placed there or, for ``padding`` (bytes no value ever held, there for
    alignment), the value placed right below whose slot they pad.
    """

    offset: int
    size: int
    holder: Occupancy | None
    placed: Placement | None = None
    padding: bool = False


@dataclasses.dataclass(frozen=True)
class HeapTimeline:
    """The temp buffer over the schedule.

    Attributes:
      size: the temp buffer's bytes (``temp_size_in_bytes``).
      live_bytes: bytes held by live values after each step (a step is one heap event).
      occupancies: every value's stay in the temp buffer.
      step_buffers: the logical buffer each step allocates or frees.
      peak: the step where the packed buffer reaches its full size with the most bytes live.
      untraced: the values placed in the temp buffer that the heap trace does not name.
    """

    size: int
    live_bytes: tuple[int, ...]
    occupancies: tuple[Occupancy, ...]
    step_buffers: tuple[int, ...]
    peak: int
    untraced: tuple[Placement, ...] = ()

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
        for b, e in todo:
            pieces.extend(self._split_by_placements(b, e))
        return pieces

    def _split_by_placements(self, begin: int, end: int) -> list[Gap]:
        """Cuts ``[begin, end)``, which no traced value ever held, by the untraced values placed there;
        the rest is alignment padding, charged to the value placed right below it (whose slot it pads)."""
        pieces: list[Gap] = []
        position = begin
        for placed in sorted(self.untraced, key=lambda p: (p.offset, -p.size)):
            lo, hi = max(position, placed.offset), min(end, placed.offset + placed.size)
            if lo >= hi:
                continue
            if lo > position:
                pieces.append(self._padding(position, lo))
            pieces.append(Gap(lo, hi - lo, None, placed))
            position = hi
        if position < end:
            pieces.append(self._padding(position, end))
        return pieces

    def _padding(self, begin: int, end: int) -> Gap:
        """Bytes no value ever held: XLA aligns each value's offset, so the slot of the value placed
        right below them ends here."""
        below = [p for p in (*self.untraced, *(Placement(o.buffer_id, o.offset, o.size) for o in self.occupancies))
                 if p.offset + p.size <= begin]
        padded = max(below, key=lambda p: p.offset + p.size, default=None)
        return Gap(begin, end - begin, None, padded, padding=True)


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
    replay = _Replay(program, allocation, trace)
    for step, event in enumerate(trace.events):
        replay.step(step, event)
    return replay.timeline()


class _Replay:
    """The state of one replay of a heap trace: which values hold which bytes, step by step."""

    def __init__(self, program: HloProgram, allocation: Allocation, trace: HeapTrace):
        self.program, self.allocation, self.trace = program, allocation, trace
        self.placed = {b: (offset, size) for b, offset, size in allocation.assigned}
        self.group: dict[int, int] = {}  # buffer -> canonical buffer whose bytes it uses
        self.members: dict[int, set[int]] = {}
        self.current: dict[int, tuple[int, int]] = {}  # canonical -> (buffer now holding its bytes, since step)
        self.reused: dict[int, int] = {}  # freed canonical -> the buffer that took its bytes over
        self.occupancies: list[Occupancy] = []
        self.live = 0
        self.ends: list[tuple[int, int]] = []  # (-end offset, canonical): the top of the packed buffer, lazily
        self.live_bytes: list[int] = []
        self.best = (-1, -1, 0)  # (top, live, step) of the peak so far

    def _size(self, canonical: int) -> int:
        return self.placed.get(canonical, (0, self.program.buffers[canonical].size))[1]

    def _close(self, canonical: int, step: int) -> None:
        buffer, since = self.current.pop(canonical)
        offset, _ = self.placed.get(canonical, (0, 0))
        self.occupancies.append(Occupancy(buffer, offset, self._size(canonical), since, step))

    def _holder_group(self, buffer: int) -> int | None:
        """The live group holding ``buffer``'s bytes (following bytes freed and taken over)."""
        for _ in range(len(self.trace.events)):
            canonical = self.group.get(buffer)
            if canonical is not None and self.members.get(canonical):
                return canonical
            if buffer not in self.reused:
                return None
            buffer = self.reused[buffer]
        return None

    def step(self, step: int, event: HeapEvent) -> None:
        if event.buffer_id not in self.placed and event.buffer_id not in self.group and event.kind != "share":
            self.live_bytes.append(self.live)
            return
        canonical = self._holder_group(event.share_with) if event.kind == "share" else None
        if canonical is not None:
            self._join(canonical, event.buffer_id, step)
        elif event.kind in ("alloc", "share"):
            self._allocate(event, step)
        else:
            self._free(event.buffer_id, step)
        while self.ends and self.ends[0][1] not in self.current:
            heapq.heappop(self.ends)
        top = -self.ends[0][0] if self.ends else 0
        self.live_bytes.append(self.live)
        if (top, self.live) > self.best[:2]:
            self.best = (top, self.live, step)

    def _join(self, canonical: int, buffer: int, step: int) -> None:
        """``buffer`` takes the same bytes as a live value (in place, or an alias)."""
        self.group[buffer] = canonical
        self.members[canonical].add(buffer)
        self._close(canonical, step)
        self.current[canonical] = (buffer, step)

    def _allocate(self, event: HeapEvent, step: int) -> None:
        buffer = event.buffer_id
        if event.kind == "share":
            self.reused[event.share_with] = buffer  # takes over bytes just freed
            if buffer not in self.placed and event.share_with in self.placed:
                self.placed[buffer] = self.placed[event.share_with]
        self.group[buffer] = buffer
        self.members[buffer] = {buffer}
        self.current[buffer] = (buffer, step)
        self.live += self._size(buffer)
        if buffer in self.placed:
            heapq.heappush(self.ends, (-sum(self.placed[buffer]), buffer))

    def _free(self, buffer: int, step: int) -> None:
        canonical = self.group.get(buffer, buffer)
        self.members.get(canonical, set()).discard(buffer)
        if canonical in self.current and not self.members.get(canonical):
            self._close(canonical, step)
            self.live -= self._size(canonical)

    def timeline(self) -> HeapTimeline:
        for canonical in list(self.current):
            self._close(canonical, len(self.trace.events))
        traced = {e.buffer_id for e in self.trace.events} | {e.share_with for e in self.trace.events}
        untraced = tuple(Placement(b, offset, size) for b, offset, size in self.allocation.assigned
                         if b not in traced and size > 0)
        return HeapTimeline(self.allocation.size, tuple(self.live_bytes), tuple(self.occupancies),
                            tuple(e.buffer_id for e in self.trace.events), self.best[2], untraced)


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

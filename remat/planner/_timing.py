"""Whether the planner times its fitting candidates, and the timing itself."""
from __future__ import annotations

import dataclasses
import math
import os

from remat.planner._candidate import PlanCandidate
from remat.planner._search import compile_all
from remat.planner.programs import MIN_SAMPLE_S, time_side_by_side

#: Timing may cost at most this multiple of the search's own seconds. The search is about
#: one compile of the step; timing a small step costs a full compile of each candidate
#: (side by side) and short samples, about as long again, which this admits; a step that
#: runs for seconds needs samples costing many times the search, and is chosen by prediction.
TIMING_SHARE = 2.0
#: ...or this many seconds, whichever is more: timing a small step is a wait nobody
#: notices, and it settles choices the time model cannot make (its errors between
#: policies are larger than its margins).
TIMING_FLOOR_S = 2.0
#: A full compile's seconds per memory-only compile's: the memory-only compile skips
#: LLVM's optimizations (``MEMORY_ONLY``), about half of the CPU backend's work.
FULL_COMPILE = 2.0


def timing_seconds(fitting: list[PlanCandidate], compile_s: float, repeat: int) -> float:
    """The predicted seconds of timing ``fitting`` (one candidate per program): the full
    compiles of those compiled for memory alone (side by side, one per core), and the
    runs of :func:`remat.planner.programs.time_side_by_side` (a warm-up, ``repeat``
    rounds, and ``2 * repeat`` more if they are close, each sample at least
    ``MIN_SAMPLE_S``) at the slowest one's predicted step time.

    Args:
      fitting: the candidates that would be timed.
      compile_s: seconds of one memory-only compile of the step (the un-checkpointed one's).
      repeat: timing rounds (``remat.plan(repeat=)``).
    """
    to_compile = sum(c.memory_only for c in fitting)
    compiles = FULL_COMPILE * compile_s * math.ceil(to_compile / (os.cpu_count() or 1))
    step_s = max((c.speed_ms() for c in fitting), default=0.0) / 1e3
    return compiles + len(fitting) * (1 + 3 * repeat) * max(step_s, MIN_SAMPLE_S)


def untimed_note(fitting: list[PlanCandidate], compile_s: float, repeat: int, search_s: float) -> str | None:
    """Why ``fitting`` are not timed, in one line: timing them is predicted to cost more
    than :data:`TIMING_SHARE` times the search's ``search_s`` seconds, and more than
    :data:`TIMING_FLOOR_S`; None where they are timed (or only one program fits)."""
    if len(fitting) < 2:  # one program fits: nothing to time
        return None
    cost = timing_seconds(fitting, compile_s, repeat)
    allowed = max(TIMING_FLOOR_S, TIMING_SHARE * search_s)
    if cost <= allowed:
        return None
    return (f"the {len(fitting)} fitting programs were not timed: timing them would take about {cost:.0f} s "
            f"against the search's {search_s:.1f} s; chosen by predicted time (remat.plan(measure=True) times them)")


def fitting_programs(pool: list[PlanCandidate]) -> list[PlanCandidate]:
    """One contending candidate per distinct program (a program is timed once, whatever
    its spellings: timing it against itself would only let the machine's noise choose
    among equal programs)."""
    return list({c.program: c for c in pool if c.contends}.values())


def timed(pool: list[PlanCandidate], args: tuple, repeat: int) -> list[PlanCandidate]:
    """The pool with the fitting candidates' measured times, when more than one program
    fits: the ones compiled for memory alone compiled fully, side by side, then timed in
    interleaved rounds (:func:`remat.planner.programs.time_side_by_side`)."""
    fitting = fitting_programs(pool)
    if len(fitting) < 2:  # nothing to choose between: the one program that fits is the plan
        return pool
    lowered = [c.lowering for c in fitting if c.memory_only]
    full = iter(compile_all(lowered))
    programs = [next(full) if c.memory_only else c.compiled for c in fitting]
    times = dict(zip((c.program for c in fitting), time_side_by_side(programs, args, repeat)))
    return [dataclasses.replace(c, measured_ms=times.get(c.program) if c.fits else None) for c in pool]


"""Whether the planner times its fitting candidates, and the timing itself."""
from __future__ import annotations

import dataclasses
from typing import Any

from remat import _jax as xb
from remat.planner._candidate import PlanCandidate
from remat.planner._search import compile_all
from remat.planner.programs import MIN_SAMPLE_S, time_side_by_side

#: The timing runs may cost at most this multiple of the search's own seconds. The full
#: compiles timing needs cost about what the search's own compiles did, whatever the step;
#: the runs grow with the step's time: for a small step they cost about as long as the
#: search, which this admits; a step that runs for seconds needs runs costing many times
#: the search, and is chosen by prediction.
TIMING_SHARE = 2.0
#: ...or this many seconds, whichever is more: timing a small step is a wait nobody
#: notices, and it settles choices the time model cannot make (its errors between
#: policies are larger than its margins).
TIMING_FLOOR_S = 2.0


def running_seconds(fitting: list[PlanCandidate], repeat: int, trips: int = 1) -> float:
    """The predicted seconds of the runs that time ``fitting`` (one candidate per program):
    :func:`remat.planner.programs.time_side_by_side`'s warm-up, ``repeat`` rounds and
    ``2 * repeat`` more if they are close, each sample at least ``MIN_SAMPLE_S``, at the
    slowest one's predicted step time.

    Args:
      fitting: the candidates that would be timed.
      repeat: timing rounds (``remat.plan(repeat=)``).
      trips: the most trips a loop of the step makes: XLA's cost analysis, which predicts
        the step time, counts a loop body once, so the prediction is scaled by it (an
        upper bound: the step is not all loop).
    """
    step_s = trips * max((c.speed_ms() for c in fitting), default=0.0) / 1e3
    return len(fitting) * (1 + 3 * repeat) * max(step_s, MIN_SAMPLE_S)


def loop_trips(jaxpr: Any) -> int:
    """The most trips one step makes through a ``lax.scan`` body (nested scans multiply); 1: none."""
    most = 1
    for eqn in jaxpr.eqns:
        inner = max((loop_trips(getattr(sub, "jaxpr", sub)) for sub in xb.eqn_subjaxprs(eqn)), default=1)
        most = max(most, inner * (eqn.params["length"] if eqn.primitive.name == "scan" else 1))
    return most


def untimed_note(fitting: list[PlanCandidate], repeat: int, search_s: float, trips: int = 1) -> str | None:
    """Why ``fitting`` are not timed, in one line: their runs (:func:`running_seconds`) are
    predicted to cost more than :data:`TIMING_SHARE` times the search's ``search_s``
    seconds, and more than :data:`TIMING_FLOOR_S`; None where they are timed (or only one
    program fits)."""
    if len(fitting) < 2:  # one program fits: nothing to time
        return None
    cost = running_seconds(fitting, repeat, trips)
    if cost <= max(TIMING_FLOOR_S, TIMING_SHARE * search_s):
        return None
    return (f"the {len(fitting)} fitting programs were not timed: their runs would take about {cost:.0f} s "
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


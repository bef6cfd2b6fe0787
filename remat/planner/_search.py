"""The planner's search state: candidates traced, rejected early or compiled, and cached."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from remat.analysis import saved_residuals
from remat.analysis.compiled import CompiledMemory
from remat.planner._candidate import CandidateSpec, PlanCandidate
from remat.planner.programs import _predicted_ms, lower_step, lowered_fingerprint, program_fingerprint
from remat.planner.steering import apply_policies

#: A candidate whose predicted temp bytes exceed the limit by this factor is not compiled.
#: The prediction is its residual bytes (one trace), scaled by what XLA kept of the
#: un-checkpointed step's residuals when that is less than all: the residuals are live
#: together where the forward pass turns into the backward, so the temp buffer holds them
#: unless XLA fuses them into their consumers. Measured: temp >= residual bytes for every
#: candidate of the benchmark's transformer and MLP (remat.ops); with jax.nn ops the
#: scaled prediction stayed below the temp bytes too (tests/test_planner.py).
REJECT_MARGIN = 1.25


class CandidateSearch:
    """Evaluates candidates of one step: one trace each, one compile per distinct program.

    Args:
      step_fn: the user's loss.
      args: its example arguments.
      argnums: what the gradient is taken with respect to.
      cache: candidates by label, shared across searches of the same step and shapes.
      early_reject: leave uncompiled the candidates predicted (from one trace) not to fit.
      lean: budget 0: reject above the least temp memory compiled so far, not a fixed limit.
      progress: called with a line after each batch of compiles (None: silent).
    """

    def __init__(self, step_fn: Callable[..., Any], args: tuple, argnums: int | Sequence[int],
                 cache: dict[str, PlanCandidate], early_reject: bool, lean: bool,
                 progress: Callable[[str], None] | None = None):
        self.step_fn, self.args, self.argnums, self.cache = step_fn, args, argnums, cache
        self.early_reject, self.lean, self.progress = early_reject, lean, progress
        self.limit: float | None = None  # the plan's limit, for the best-so-far of the progress lines
        self.evaluated: dict[str, PlanCandidate] = {}  # this search's candidates, by label
        self.ceiling: float | None = None  # temp bytes above which a candidate is not compiled
        self.least = float("inf")  # the least temp memory compiled so far
        # compiled temp bytes per residual byte, at most 1: XLA may fuse cheap residuals into
        # their consumers (jax.nn's GELU keeps 1.9x more than the un-checkpointed temp buffer)
        self.folded = 1.0
        self.compiles = 0  # programs compiled by this search

    def calibrate(self, none: PlanCandidate, limit: int) -> None:
        """The un-checkpointed step compiled: set the rejection ceiling and the folding ratio."""
        self.ceiling = self.limit = limit
        self.folded = min(1.0, none.temp_bytes / max(none.residual_bytes, 1))

    def predicted_temp_bytes(self, c: PlanCandidate) -> float:
        """A lower estimate of ``c``'s compiled temp bytes, from its residual bytes alone."""
        return c.residual_bytes * self.folded

    def _rejected(self, c: PlanCandidate) -> bool:
        if self.lean:
            bound = 1.01 * self.least if self.least < float("inf") else None
        else:
            bound = self.ceiling
        return self.early_reject and bound is not None and self.predicted_temp_bytes(c) > REJECT_MARGIN * bound

    def trace(self, spec: CandidateSpec) -> PlanCandidate:
        """The candidate of ``spec`` with its residual bytes (one trace), from the cache if there."""
        c = self.cache.get(spec.label)
        if c is None:
            planned = apply_policies(self.step_fn, spec.policies, spec.scan, spec.sequential, spec.whole_step)
            c = self.cache[spec.label] = PlanCandidate(
                spec.label, spec.policies, scan=spec.scan, sequential=spec.sequential, whole_step=spec.whole_step,
                residual_bytes=saved_residuals(planned, *self.args).residual_bytes)
        return c

    def evaluate_many(self, specs: Sequence[CandidateSpec]) -> list[PlanCandidate]:
        """The candidates of ``specs``: traced and lowered one by one (the hooks steer one
        trace at a time), the distinct programs compiled together."""
        staged: list[tuple[PlanCandidate, str | None]] = []
        lowered_by_key: dict[str, Any] = {}
        for spec in specs:
            c = self.trace(spec)
            if c.compiled is not None or self._rejected(c):  # compiled before, or predicted not to fit
                staged.append((c, None))
                continue
            planned = apply_policies(self.step_fn, spec.policies, spec.scan, spec.sequential, spec.whole_step)
            lowered = lower_step(planned, self.args, self.argnums)
            key = lowered_fingerprint(lowered)
            lowered_by_key[key] = lowered
            staged.append((c, key))
        # spelled differently, lowered the same ("as written" and "all: nothing" often): one
        # compile; the distinct new programs compile side by side (XLA releases the GIL)
        known = {o.lowered: o for o in self.cache.values() if o.compiled is not None}
        todo = {key: low for key, low in lowered_by_key.items() if key not in known}
        started = time.perf_counter()
        programs = compile_all(list(todo.values()))
        alone_s = time.perf_counter() - started if len(todo) == 1 else None
        for key, compiled in zip(todo, programs):
            # one compile gives the exact temp bytes, the FLOPs/bytes for the time model and
            # the executable that is timed
            known[key] = PlanCandidate("", (), temp_bytes=CompiledMemory.from_compiled(compiled).temp_bytes,
                                       predicted_ms=_predicted_ms(compiled), program=program_fingerprint(compiled),
                                       lowered=key, compiled=compiled, compile_s=alone_s)
        self.compiles += len(todo)
        out = []
        for c, key in staged:
            if key is not None:
                k = known[key]
                c = self.cache[c.label] = dataclasses.replace(
                    c, temp_bytes=k.temp_bytes, predicted_ms=k.predicted_ms, program=k.program, lowered=key,
                    compiled=k.compiled, compile_s=k.compile_s)
            if c.temp_bytes is not None:
                self.least = min(self.least, c.temp_bytes)
            self.evaluated[c.label] = c
            out.append(c)
        if todo and self.progress is not None:
            self.progress(self._progress_line(len(specs)))
        return out

    def _progress_line(self, batch: int) -> str:
        compiled = sum(c.compiled is not None for c in self.evaluated.values())
        line = f"remat plan: {compiled} of {len(self.evaluated)} candidates compiled ({self.compiles} programs)"
        if self.limit is not None:
            fitting = [c for c in self.evaluated.values() if c.fits_in(self.limit)]
            if fitting:
                best = min(fitting, key=lambda c: c.predicted_ms)
                line += (f"; best so far: {best.label} ({best.temp_bytes / 2**20:.1f} MiB, "
                         f"{best.predicted_ms:.2f} ms predicted)")
        return line

    def evaluate(self, spec: CandidateSpec) -> PlanCandidate:
        return self.evaluate_many([spec])[0]


def compile_all(lowered: list[Any]) -> list[Any]:
    """``[l.compile() for l in lowered]``, on as many threads as the machine has cores."""
    if len(lowered) <= 1:
        return [low.compile() for low in lowered]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(lowered), os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda low: low.compile(), lowered))

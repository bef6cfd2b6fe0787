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
from remat.analysis.machine import Rates
from remat.planner._candidate import CandidateSpec, PlanCandidate
from remat.planner.programs import lower_step, lowered_fingerprint, predicted_ms, program_fingerprint
from remat.planner.steering import apply_policies

#: A candidate whose predicted temp bytes exceed the limit by this factor is not compiled.
#: The prediction is its residual bytes (one trace), scaled by what XLA kept of the
#: un-checkpointed step's residuals when that is less than all: the residuals are live
#: together where the forward pass turns into the backward, so the temp buffer holds them
#: unless XLA fuses them into their consumers. Measured: temp >= residual bytes for every
#: candidate of the benchmark's transformer and MLP (remat.ops); with jax.nn ops the
#: scaled prediction stayed below the temp bytes too (tests/test_planner.py).
REJECT_MARGIN = 1.25

#: Budget 0 weighs every candidate within this factor of the least temp memory compiled:
#: programs that differ by a few bytes of bookkeeping are equally lean.
LEAN_SLACK = 1.01


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
      rates: the machine's rates, for the predicted times.
    """

    def __init__(self, step_fn: Callable[..., Any], args: tuple, argnums: int | Sequence[int],
                 cache: dict[str, PlanCandidate], early_reject: bool, lean: bool,
                 progress: Callable[[str], None] | None, rates: Rates):
        self.step_fn, self.args, self.argnums, self.cache, self.rates = step_fn, args, argnums, cache, rates
        self.early_reject, self.lean, self.progress = early_reject, lean, progress
        self.limit: float | None = None  # the plan's limit, for the best-so-far of the progress lines
        self.evaluated: dict[str, PlanCandidate] = {}  # this search's candidates, by label
        self.ceiling: float | None = None  # temp bytes above which a candidate is not compiled
        self.least = float("inf")  # the least temp memory compiled so far
        # compiled temp bytes per residual byte, at most 1: XLA may fuse cheap residuals into
        # their consumers (jax.nn's GELU keeps more than the un-checkpointed temp buffer holds)
        self.folded = 1.0
        self.compiles = 0  # programs compiled by this search
        self.none: PlanCandidate | None = None  # the un-checkpointed step, compiled
        self.fused = 1.0  # compiled bytes accessed per lowered byte, the un-checkpointed step's
        self._lowered: dict[str, Any] = {}  # lowerings not compiled yet, by fingerprint
        self.foreign: tuple[int, ...] = ()  # the regions written with jax.checkpoint (Survey.foreign)

    def calibrate(self, none: PlanCandidate, limit: int) -> None:
        """The un-checkpointed step compiled: set the rejection ceiling and the ratios the
        estimates before compiling scale by."""
        self.ceiling = self.limit = limit
        self.none = none
        self.folded = min(1.0, none.compiled_temp_bytes() / max(_residuals(none), 1))
        cost = none.compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        lowered_bytes = none.estimated_cost[1] if none.estimated_cost else 0.0
        if cost and lowered_bytes:
            self.fused = float(cost.get("bytes accessed", 0.0)) / lowered_bytes

    def predicted_temp_bytes(self, c: PlanCandidate) -> float:
        """A lower estimate of ``c``'s compiled temp bytes, from its residual bytes alone."""
        return _residuals(c) * self.folded

    def _rejected(self, c: PlanCandidate) -> bool:
        if self.lean:
            bound = LEAN_SLACK * self.least if self.least < float("inf") else None
        else:
            bound = self.ceiling
        return self.early_reject and bound is not None and self.predicted_temp_bytes(c) > REJECT_MARGIN * bound

    def trace(self, spec: CandidateSpec) -> PlanCandidate:
        """The candidate of ``spec`` with its residual bytes (one trace), from the cache if there."""
        c = self.cache.get(spec.label)
        if c is None:
            planned = apply_policies(self.step_fn, spec.policies, spec.scan, spec.sequential, spec.whole_step,
                                     foreign=self.foreign)
            c = self.cache[spec.label] = PlanCandidate(
                spec.label, spec.policies, scan=spec.scan, sequential=spec.sequential, whole_step=spec.whole_step,
                residual_bytes=saved_residuals(planned, *self.args).residual_bytes)
        return c

    def preview(self, spec: CandidateSpec) -> tuple[PlanCandidate, str | None]:
        """The candidate of ``spec`` traced and lowered, not compiled: its residual bytes, and
        its estimated temp bytes and time (:meth:`estimate`). The key is its lowering's
        fingerprint (None: compiled already, or rejected early)."""
        c = self.trace(spec)
        if c.compiled is not None or self._rejected(c):
            return c, None
        if c.lowered is not None and c.lowered in self._lowered:
            return c, c.lowered
        planned = apply_policies(self.step_fn, spec.policies, spec.scan, spec.sequential, spec.whole_step,
                                     foreign=self.foreign)
        lowered = lower_step(planned, self.args, self.argnums)
        key = lowered_fingerprint(lowered)
        self._lowered[key] = lowered
        # an estimate made before (the default search's, from its per-region model) stays;
        # the lowered program's cost analysis takes about a tenth of a compile, so only a
        # search that rejects early estimates what is not estimated yet
        estimates = ({k: v for k, v in self.estimate(c, lowered).items() if getattr(c, k) is None}
                     if self.early_reject else {})
        c = self.cache[c.label] = dataclasses.replace(c, lowered=key, **estimates)
        return c, key

    def estimate(self, c: PlanCandidate, lowered: Any) -> dict[str, Any]:
        """Temp bytes and time predicted before compiling: the un-checkpointed step's temp
        bytes less the residual bytes ``c`` no longer keeps (as much as XLA kept of them),
        and the lowered program's FLOPs and bytes (the bytes scaled by what XLA's fusion left
        of the un-checkpointed step's) at this machine's rates."""
        cost = lowered.cost_analysis() or {}
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        flops, moved = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
        out: dict[str, Any] = {"estimated_cost": (flops, moved)}
        if self.none is not None:
            none = self.none
            out["estimated_temp_bytes"] = int(max(0.0, none.compiled_temp_bytes()
                                                  - self.folded * (_residuals(none) - _residuals(c))))
            out["estimated_ms"] = 1e3 * (flops / self.rates.flops_per_s + moved * self.fused / self.rates.bytes_per_s)
        return out

    def evaluate_many(self, specs: Sequence[CandidateSpec]) -> list[PlanCandidate]:
        """The candidates of ``specs``: traced and lowered one by one (the hooks steer one
        trace at a time), the distinct programs compiled together."""
        return self.start(specs)()

    def start(self, specs: Sequence[CandidateSpec], memory_only: bool = False) -> Callable[[], list[PlanCandidate]]:
        """Traces and lowers ``specs`` here, compiles their distinct new programs on a
        background thread (XLA releases the GIL, so tracing can go on meanwhile), and
        returns a function that waits for the compiles and gives the candidates.

        With ``memory_only``, the programs compile with LLVM's optimizations off
        (:data:`MEMORY_ONLY`): XLA's HLO passes and buffer assignment, which decide the
        temp bytes, run as ever, and the compile takes about a third less.
        """
        staged = [self.preview(spec) for spec in specs]
        # spelled differently, lowered the same ("as written" and "all: nothing" often): one
        # compile; the distinct new programs compile side by side
        known = {o.lowered: o for o in self.cache.values() if o.compiled is not None}
        todo = {key: self._lowered[key] for _, key in staged if key is not None and key not in known}
        future = BACKGROUND.submit(_timed_compile_all, list(todo.values()), MEMORY_ONLY if memory_only else None)

        def finish() -> list[PlanCandidate]:
            done, seconds = future.result()
            alone_s = seconds if len(todo) == 1 else None
            for (key, lowering), (compiled, temp_bytes, program) in zip(todo.items(), done):
                # one compile gives the exact temp bytes, the FLOPs/bytes for the time model and
                # the executable that is timed
                known[key] = PlanCandidate("", (), temp_bytes=temp_bytes,
                                           predicted_ms=predicted_ms(compiled, temp_bytes, self.rates), program=program,
                                           lowered=key, compiled=compiled, compile_s=alone_s,
                                           memory_only=memory_only, lowering=lowering if memory_only else None)
                self._lowered.pop(key, None)  # compiled: the lowering is no longer needed
            self.compiles += len(todo)
            out = []
            for c, key in staged:
                c = self.cache.get(c.label, c)  # with any estimate made since it was staged
                if key is not None:
                    k = known[key]
                    c = self.cache[c.label] = dataclasses.replace(
                        self.cache[c.label], temp_bytes=k.temp_bytes, predicted_ms=k.predicted_ms,
                        program=k.program, lowered=key, compiled=k.compiled, compile_s=k.compile_s,
                        memory_only=k.memory_only, lowering=k.lowering)
                if c.temp_bytes is not None:
                    self.least = min(self.least, c.temp_bytes)
                self.evaluated[c.label] = c
                out.append(c)
            if todo and self.progress is not None:
                self.progress(self._progress_line())
            return out

        return finish

    def _progress_line(self) -> str:
        compiled = sum(c.compiled is not None for c in self.evaluated.values())
        line = f"remat plan: {compiled} of {len(self.evaluated)} candidates compiled ({self.compiles} programs)"
        if self.limit is not None:
            fitting = [c for c in self.evaluated.values() if c.fits_in(self.limit)]
            if fitting:
                best = min(fitting, key=PlanCandidate.compiled_ms)
                line += (f"; best so far: {best.label} ({best.compiled_temp_bytes() / 2**20:.1f} MiB, "
                         f"{best.compiled_ms():.2f} ms predicted)")
        return line


def _residuals(c: PlanCandidate) -> int:
    """The residual bytes of a traced candidate (every candidate is traced first)."""
    assert c.residual_bytes is not None, f"candidate {c.label!r} was not traced"
    return c.residual_bytes


#: Compiles started by :meth:`CandidateSearch.start` run here while the caller traces the
#: next candidates; two batches (the un-checkpointed step and the first finalists) overlap.
BACKGROUND = concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1),
                                                    thread_name_prefix="remat-plan-compile")


#: Compiler options for a compile that only needs the program's memory and cost analyses:
#: the optimization level applies to LLVM's code generation alone, after XLA's HLO passes
#: and buffer assignment (tests/test_planner_assign.py checks the temp bytes and optimized
#: HLO equal a full compile's).
MEMORY_ONLY = {"xla_backend_optimization_level": 0}


def _timed_compile_all(lowered: list[Any], options: dict[str, Any] | None) -> tuple[list[tuple[Any, int, str]], float]:
    """``(compiled, temp bytes, program fingerprint)`` of each lowering, and the seconds
    the compiles took; the analyses run here too, off the tracing thread."""
    started = time.perf_counter()
    programs = compile_all(lowered, options)
    seconds = time.perf_counter() - started
    return [(c, CompiledMemory.from_compiled(c).temp_bytes, program_fingerprint(c)) for c in programs], seconds


def compile_all(lowered: list[Any], options: dict[str, Any] | None = None) -> list[Any]:
    """``[l.compile(options) for l in lowered]``, on as many threads as the machine has cores."""
    def one(low: Any) -> Any:
        return low.compile(options) if options else low.compile()

    if len(lowered) <= 1:
        return [one(low) for low in lowered]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(lowered), os.cpu_count() or 1)) as pool:
        return list(pool.map(one, lowered))

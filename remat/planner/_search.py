"""The planner's search state: candidates traced, rejected early or compiled, and cached."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
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
    """

    def __init__(self, step_fn: Callable[..., Any], args: tuple, argnums: int | Sequence[int],
                 cache: dict[str, PlanCandidate], early_reject: bool, lean: bool):
        self.step_fn, self.args, self.argnums, self.cache = step_fn, args, argnums, cache
        self.early_reject, self.lean = early_reject, lean
        self.ceiling: float | None = None  # temp bytes above which a candidate is not compiled
        self.least = float("inf")  # the least temp memory compiled so far
        # compiled temp bytes per residual byte, at most 1: XLA may fuse cheap residuals into
        # their consumers (jax.nn's GELU keeps 1.9x more than the un-checkpointed temp buffer)
        self.folded = 1.0
        self.compiles = 0  # programs compiled by this search

    def calibrate(self, none: PlanCandidate, limit: int) -> None:
        """The un-checkpointed step compiled: set the rejection ceiling and the folding ratio."""
        self.ceiling = limit
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
        for key, compiled in zip(todo, compile_all(list(todo.values()))):
            # one compile gives the exact temp bytes, the FLOPs/bytes for the time model and
            # the executable that is timed
            known[key] = PlanCandidate("", (), temp_bytes=CompiledMemory.from_compiled(compiled).temp_bytes,
                                       predicted_ms=_predicted_ms(compiled), program=program_fingerprint(compiled),
                                       lowered=key, compiled=compiled)
        self.compiles += len(todo)
        out = []
        for c, key in staged:
            if key is not None:
                k = known[key]
                c = self.cache[c.label] = dataclasses.replace(
                    c, temp_bytes=k.temp_bytes, predicted_ms=k.predicted_ms, program=k.program, lowered=key,
                    compiled=k.compiled)
            if c.temp_bytes is not None:
                self.least = min(self.least, c.temp_bytes)
            out.append(c)
        return out

    def evaluate(self, spec: CandidateSpec) -> PlanCandidate:
        return self.evaluate_many([spec])[0]

    def smallest_prefix(self, rest: Any, n: int, limit: int) -> PlanCandidate | None:
        """Bisection for the fewest leading regions to rematerialize fully (the others
        ``rest``) so that the step fits; memory falls as the prefix grows."""
        lo, hi, best = 1, n - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            c = self.evaluate(CandidateSpec(f"first {mid}: nothing, rest {rest}",
                                            ("nothing",) * mid + (rest,) * (n - mid)))
            if c.fits_in(limit):
                best, hi = c, mid - 1
            else:
                lo = mid + 1
        return best


def compile_all(lowered: list[Any]) -> list[Any]:
    """``[l.compile() for l in lowered]``, on as many threads as the machine has cores."""
    if len(lowered) <= 1:
        return [low.compile() for low in lowered]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(lowered), os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda low: low.compile(), lowered))

"""One candidate plan: a choice for every region, scan and sequential, and what its compile showed."""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from remat.planner.steering import Binomial
from remat.policies import policy_name


class CandidateSpec(NamedTuple):
    """What a candidate changes in the step (the arguments of :func:`apply_policies`)."""

    label: str
    policies: tuple[Any, ...]
    scan: tuple[Any, Any] | None = None
    sequential: int | None = None
    whole_step: bool = False


@dataclasses.dataclass(frozen=True)
class PlanCandidate:
    """One way to run the step: a label and a policy (or ``NO_CHECKPOINT``) for each region.

    Attributes:
      label: how the plan names it, e.g. ``"all: dots"`` or ``"first 3: nothing, rest dots"``.
      policies: the policy of each checkpointed region, in trace order (``NO_CHECKPOINT``: not checkpointed).
      temp_bytes: the compiled step's temp memory (None: not compiled, predicted not to fit).
      predicted_ms: the step time XLA's cost analysis predicts at this machine's rates.
      measured_ms: the median measured step time (None: not timed).
      fits: whether ``temp_bytes`` is within the plan's limit.
      scan: every scan over layers' ``(policy, groups)``; None: as written.
      sequential: the segment count of every ``checkpoint_sequential``; None: as written.
      program: a fingerprint of the optimized HLO; equal programs are timed once.
      lowered: a fingerprint of the lowered program; equal ones are compiled once.
      compiled: the compiled ``jit(grad(step))``; timed without a second compile unless
        ``memory_only``.
      whole_step: the whole step checkpointed once more around its regions.
      residual_bytes: bytes the backward keeps besides the step's inputs.
      compile_s: seconds its program took to compile, when it compiled alone (None: with others).
      estimated_temp_bytes, estimated_ms: predicted before compiling, from its residual bytes
        and its lowered program's cost (None: not estimated).
      estimated_cost: the lowered program's ``(flops, bytes accessed)``.
      memory_only: ``compiled`` was built for its memory and cost analyses alone, with
        LLVM's optimizations off: the same optimized HLO and buffers in less compile time,
        but slower code; :meth:`executable` compiles it fully to run.
      lowering: the lowered program (kept where ``memory_only``, for :meth:`executable`).
      superseded: compiled before the un-checkpointed step gave the model its scale, and
        predicted slower than the pick made after, which fits too: not timed, not chosen.
    """

    label: str
    policies: tuple[Any, ...]
    temp_bytes: int | None = None
    predicted_ms: float | None = None
    measured_ms: float | None = None
    fits: bool | None = None
    scan: tuple[Any, Any] | None = None
    sequential: int | None = None
    program: str | None = None
    lowered: str | None = None
    compiled: Any = dataclasses.field(default=None, repr=False, compare=False)
    whole_step: bool = False
    residual_bytes: int | None = None
    compile_s: float | None = None
    estimated_temp_bytes: int | None = None
    estimated_ms: float | None = None
    estimated_cost: tuple[float, float] | None = None
    memory_only: bool = False
    lowering: Any = dataclasses.field(default=None, repr=False, compare=False)
    superseded: bool = False

    def executable(self) -> Any:
        """The compiled step at full optimization, to run or time (compiled now where the
        search compiled it for its memory alone; JAX keeps the result for later calls)."""
        if self.compiled is None:
            raise ValueError(f"candidate {self.label!r} was not compiled")
        return self.lowering.compile() if self.memory_only else self.compiled

    @property
    def spec(self) -> CandidateSpec:
        return CandidateSpec(self.label, self.policies, self.scan, self.sequential, self.whole_step)

    def fits_in(self, limit: float) -> bool:
        """Compiled, and its temp memory at most ``limit`` bytes."""
        return self.temp_bytes is not None and self.temp_bytes <= limit

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "policies": [policy_name(p) for p in self.policies],
                "scan": None if self.scan is None else {
                    "policy": policy_name(self.scan[0]),
                    "groups": str(self.scan[1]) if isinstance(self.scan[1], Binomial) else self.scan[1]},
                "sequential_segments": self.sequential, "whole_step": self.whole_step,
                "residual_bytes": self.residual_bytes, "temp_bytes": self.temp_bytes, "predicted_ms": self.predicted_ms,
                "measured_ms": self.measured_ms, "fits": self.fits, "program": self.program,
                "estimated_temp_bytes": self.estimated_temp_bytes, "estimated_ms": self.estimated_ms,
                "superseded": self.superseded}

    @property
    def contends(self) -> bool:
        """Fits, and is not superseded: one of the candidates the plan is chosen from."""
        return bool(self.fits) and not self.superseded

    def speed_ms(self) -> float:
        """The measured time, else the predicted one (inf: neither, not compiled)."""
        if self.measured_ms is not None:
            return self.measured_ms
        return self.predicted_ms if self.predicted_ms is not None else float("inf")

    def compiled_temp_bytes(self) -> int:
        """The compiled temp bytes of a candidate that compiled (a ValueError otherwise)."""
        if self.temp_bytes is None:
            raise ValueError(f"candidate {self.label!r} was not compiled")
        return self.temp_bytes

    def compiled_ms(self) -> float:
        """The compiled program's predicted time (a ValueError when it did not compile)."""
        if self.predicted_ms is None:
            raise ValueError(f"candidate {self.label!r} was not compiled")
        return self.predicted_ms

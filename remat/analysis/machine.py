"""The cost model's machine: what a FLOP, a byte moved and a byte faulted in cost here (:class:`Rates`)."""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from remat._core.residuals import aval_nbytes, itemsize
from remat.analysis.allocator import FRESH_MAP_BYTES, fault_s_per_byte

__all__ = ["UNCALIBRATED", "Rates", "calibrate", "calibrate_once", "calibrated", "calibration_programs",
           "current_rates", "fault_ms", "op_cost", "op_work"]


@dataclasses.dataclass(frozen=True)
class Rates:
    """What work costs on one machine: the cost model's three rates.

    Attributes:
      flops_per_s: matmul-like work (``dot_general``, convolutions), FLOP/s.
      bytes_per_s: memory-bound work (element-wise, reductions, data movement), bytes read
        and written per second.
      fault_s_per_byte: seconds per byte a temp buffer mapped afresh at every step costs
        (XLA:CPU over glibc's mmap threshold; 0 on accelerators, which pool their buffers).

    Example:
      >>> Rates(flops_per_s=1e9, bytes_per_s=1e9, fault_s_per_byte=0.0).flops_per_s
      1000000000.0
    """

    flops_per_s: float
    bytes_per_s: float
    fault_s_per_byte: float

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


#: The rates before :func:`calibrate` measures this machine (no page-fault cost until measured).
UNCALIBRATED = Rates(flops_per_s=2.0e10, bytes_per_s=5.0e9, fault_s_per_byte=0.0)

#: This process's measured rates (:func:`calibrate_once`): the only state here, a value
#: that the planner's entry point reads once and passes down.
_measured: Rates | None = None


def _elementwise_length(size: int) -> int:
    """The element-wise calibration program's length: four matmul operands' worth of floats."""
    return 4 * size * size


def calibration_programs(size: int = 512) -> list[Callable[[], Any]]:
    """The programs :func:`calibrate` times, compiled: a ``size`` x ``size`` matmul and an
    element-wise pass over ``4 * size**2`` floats (compiling them is not timed, so it may
    run beside other work, e.g. in a background thread while the caller traces)."""
    import jax

    a = jax.device_put(np.ones((size, size), np.float32))
    v = jax.device_put(np.ones((_elementwise_length(size),), np.float32))
    mm = jax.jit(lambda a: a @ a).lower(a).compile()
    ew = jax.jit(lambda v: v * 1.5 + 1.0).lower(v).compile()
    return [functools.partial(mm, a), functools.partial(ew, v)]


def calibrate(size: int = 512, repeat: int = 5, programs: Sequence[Callable[[], Any]] | None = None) -> Rates:
    """Measures this machine's :class:`Rates`: the matmul FLOP rate, the memory-bound byte
    rate and what a temp buffer mapped afresh costs per byte
    (:func:`remat.analysis.allocator.fault_s_per_byte`); they become this process's
    measured rates (:func:`calibrate_once`).

    Args:
      size: the matmul's side (:func:`calibration_programs`).
      repeat: timed samples of each program; the rates are their medians.
      programs: :func:`calibration_programs` of ``size``, compiled already (default: here).

    Returns:
      The measured rates.
    """
    import jax

    from remat.analysis.timing import time_programs

    global _measured
    programs = calibration_programs(size) if programs is None else programs
    # a sample averages a hundredth of a second of calls, since a single call of a
    # sub-millisecond program is too noisy to time (docs/planner.md); the rates are the medians
    # of `repeat` samples each, after two untimed rounds: a process's first samples run slow
    time_programs(programs, rounds=2, min_sample_s=0.01)
    mm_s, ew_s = (max(t, 1e-9) for t in time_programs(programs, rounds=repeat, min_sample_s=0.01).medians_s())
    _measured = Rates(
        flops_per_s=2 * size**3 / mm_s,
        bytes_per_s=2 * _elementwise_length(size) * np.float32().nbytes / ew_s,  # read and written
        # XLA:CPU mallocs its temp buffer at every step; accelerators keep theirs in a pool
        fault_s_per_byte=fault_s_per_byte() if jax.default_backend() == "cpu" else 0.0,
    )
    return _measured


def calibrate_once(programs: Callable[[], Sequence[Callable[[], Any]]] | None = None) -> Rates:
    """This process's measured rates: :func:`calibrate` on first use (about a second).

    Args:
      programs: returns :func:`calibration_programs` (e.g. a background compile's
        ``Future.result``), called only if this process has not calibrated yet.
    """
    if _measured is not None:
        return _measured
    return calibrate(programs=None if programs is None else programs())


def calibrated() -> bool:
    """Whether this process has run :func:`calibrate` (its rates are measured, not :data:`UNCALIBRATED`)."""
    return _measured is not None


def current_rates() -> Rates:
    """This process's measured rates, else :data:`UNCALIBRATED`; nothing is measured here."""
    return _measured if _measured is not None else UNCALIBRATED


def fault_ms(temp_bytes: float, rates: Rates, threshold: float = FRESH_MAP_BYTES) -> float:
    """Milliseconds an XLA:CPU step whose temp buffer is ``temp_bytes`` spends on faulting
    it in afresh, at every execution: none below glibc's mmap threshold
    (:data:`remat.analysis.allocator.FRESH_MAP_BYTES`), where the freed buffer is reused.
    A predicted buffer may be charged from a lower ``threshold``, for the prediction's error.

    Example:
      >>> fault_ms(64 * 2**20, Rates(1e9, 1e9, fault_s_per_byte=1e-9))
      67.108864
    """
    if temp_bytes < threshold:
        return 0.0
    return 1e3 * rates.fault_s_per_byte * temp_bytes


def op_cost(primitive: str, avals: Sequence[Any], params: dict, out_bytes: int, rates: Rates) -> float:
    """Estimated seconds to recompute one operation: :func:`op_work` at ``rates``."""
    flops, moved = op_work(primitive, avals, params, out_bytes)
    return moved / rates.bytes_per_s + flops / rates.flops_per_s


def op_work(primitive: str, avals: Sequence[Any], params: dict, out_bytes: int) -> tuple[float, float]:
    """The work of one operation, unfused: ``(FLOPs of a matmul or convolution, bytes read
    and written)``; :func:`op_cost` prices it at a machine's rates.

    Example:
      >>> import jax, numpy as np
      >>> op_work("exp", [jax.ShapeDtypeStruct((8, 4), np.float32)], {}, 128)
      (0.0, 256.0)
    """
    moved = float(sum(aval_nbytes(a) for a in avals) + out_bytes)
    flops = 0.0
    if primitive == "dot_general" and len(avals) >= 2:
        (lhs_contract, _), _ = params["dimension_numbers"]
        k = math.prod(avals[0].shape[d] for d in lhs_contract)
        out_elems = out_bytes // max(itemsize(avals[0].dtype), 1)
        flops = 2.0 * out_elems * k
    elif primitive == "conv_general_dilated" and len(avals) >= 2:
        rhs = avals[1]
        groups = params.get("feature_group_count", 1) or 1
        out_elems = out_bytes // max(itemsize(avals[0].dtype), 1)
        kernel_elems = math.prod(rhs.shape)
        out_features = rhs.shape[params["dimension_numbers"].rhs_spec[0]] if params.get("dimension_numbers") else 1
        flops = 2.0 * out_elems * kernel_elems / max(out_features * groups, 1) * groups
    return flops, moved

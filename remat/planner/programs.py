"""Compiled candidate programs: their fingerprint, predicted time, and timing side by side."""
from __future__ import annotations

import functools
import hashlib
import re
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import jax

from remat import _jax as xb
from remat.analysis.machine import Rates, fault_ms
from remat.analysis.timing import time_programs


def predicted_ms(compiled: Any, temp_bytes: int, rates: Rates) -> float:
    """Step time from XLA's cost analysis at ``rates``, with the page faults of a temp
    buffer of ``temp_bytes`` (:func:`remat.analysis.machine.fault_ms`)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops = float(cost.get("flops", 0.0)) if cost else 0.0
    moved = float(cost.get("bytes accessed", 0.0)) if cost else 0.0
    return 1e3 * (flops / rates.flops_per_s + moved / rates.bytes_per_s) + fault_ms(temp_bytes, rates)


_HLO_METADATA_SECTIONS = {"FileNames", "FunctionNames", "FileLocations", "StackFrames"}


def program_fingerprint(compiled: Any) -> str:
    """A hash of a compiled step's optimized HLO, without source locations.

    Two candidates with the same fingerprint run the same program; only the Python lines
    that traced them (kept in the HLO's metadata) differ.
    """
    printed = xb.optimized_hlo_without_metadata(compiled)
    if printed is not None:
        return hashlib.sha256(printed.encode()).hexdigest()[:16]
    kept, skipping = [], False
    for line in compiled.as_text().splitlines():
        if line in _HLO_METADATA_SECTIONS:
            skipping = True
            continue
        if skipping and (not line or line[0].isdigit() or line[0].isspace()):
            continue
        skipping = False
        kept.append(re.sub(r",? ?metadata=\{[^}]*\}|,? ?stack_frame_id=\d+", "", line))
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]


def lower_step(fn: Callable[..., Any], args: tuple, argnums: int | Sequence[int] = 0) -> Any:
    """``jax.jit(jax.grad(fn, argnums))`` lowered for ``args``: traced, not yet compiled.

    The same program :func:`remat.analysis.compiled.compiled_step` compiles; the planner
    lowers first so that candidates lowering to the same program compile once. Arguments
    that carry shardings (``jax.Array`` or ``jax.ShapeDtypeStruct`` over a ``Mesh``) keep
    them, so every byte figure of the compile is per device; where every differentiated
    array carries a ``NamedSharding``, each gradient is sharded as its array, as in a
    training step that feeds the gradients to a sharded optimizer.
    """
    argnums = argnums if isinstance(argnums, int) else tuple(argnums)
    return jax.jit(jax.grad(fn, argnums=argnums), **gradient_shardings(args, argnums)).lower(*args)


def gradient_shardings(args: tuple, argnums: int | tuple[int, ...]) -> dict[str, Any]:
    """``{"out_shardings": ...}``: the differentiated arguments' ``NamedSharding`` s, when all have one
    (an FSDP step's gradients sharded as its parameters); ``{}`` otherwise (the compiler decides)."""
    picked = args[argnums] if isinstance(argnums, int) else tuple(args[i] for i in argnums)
    shardings = jax.tree.map(lambda x: getattr(x, "sharding", None), picked)
    leaves = jax.tree.leaves(shardings)
    if not leaves or not all(isinstance(s, jax.sharding.NamedSharding) for s in leaves) \
            or len(leaves) != len(jax.tree.leaves(picked)):
        return {}
    return {"out_shardings": shardings}


def lowered_fingerprint(lowered: Any) -> str:
    """A hash of a lowered program's StableHLO text (printed without source locations)."""
    return hashlib.sha256(lowered.as_text().encode()).hexdigest()[:16]


#: Seconds of back-to-back calls each timing sample averages (:func:`remat.analysis.timing.time_programs`):
#: one call of a step of a few milliseconds varies by more than the plans it compares differ.
MIN_SAMPLE_S = 0.05


#: Steps whose times are within this fraction of the fastest's run again, with twice the
#: rounds, before one is chosen: the plans the time model leaves close often measure a few
#: percent apart, about as much as five rounds on a shared machine can tell apart.
CLOSE = 0.03


def time_side_by_side(steps: list[Callable[..., Any]], args: tuple, repeat: int) -> list[float]:
    """Each compiled step's time (ms) called with ``args``, timed in interleaved rounds.

    :func:`remat.analysis.timing.time_programs` (one warm-up call each, then ``repeat``
    rounds whose order rotates, each sample at least :data:`MIN_SAMPLE_S` of calls), for
    steps that all take the same arguments; the times are
    :meth:`~remat.analysis.timing.Timings.paired_ms`. The steps within :data:`CLOSE` of the
    fastest run again, alone, for ``2 * repeat`` rounds, and their times are those of the
    second run, scaled to keep their geometric mean from the first.
    """
    calls = [functools.partial(s, *args) for s in steps]
    ms = time_programs(calls, rounds=repeat, min_sample_s=MIN_SAMPLE_S).paired_ms()
    close = [i for i, m in enumerate(ms) if m <= (1 + CLOSE) * min(ms)]
    if len(close) < 2:
        return ms
    again = time_programs([calls[i] for i in close], rounds=2 * repeat, min_sample_s=MIN_SAMPLE_S).paired_ms()
    scale = statistics.geometric_mean([ms[i] for i in close]) / statistics.geometric_mean(again)
    for i, m in zip(close, again):
        ms[i] = m * scale
    return ms

"""``remat.explain``: where a compiled step's memory goes, every byte at the peak attributed.

One compilation of the step, with XLA's buffer assignment read from that very
compilation, answers "what is still using my memory, and why" on any backend, CPU
included: each buffer live at the peak of the temp buffer with its size, its kind
(parameter, optimizer state, input, residual saved for the backward pass, recomputed
value, gradient, other temporary), the module and the line of the user's code that
produced it, and for a residual the checkpointed region and the policy rule that kept
it. Mistakes are named with their fix: a policy that matches nothing in its region, a
checkpoint that saves nothing, the largest residual coming from code that is not
checkpointed.

Example:
  >>> report = remat.explain(jax.grad(loss), params, x)   # doctest: +SKIP
  >>> print(report)                                        # doctest: +SKIP
  >>> report.plot("memory.png"); report.to_trace("memory.json")  # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from remat._core.residuals import format_bytes
from remat.analysis.compiled import CompiledMemory
from remat.explainer import _region_residuals
from remat.explainer._attribution import KINDS, Attributor, PeakBuffer
from remat.explainer._mistakes import mistakes
from remat.explainer._module_names import module_scopes
from remat.explainer._xla_buffers import compile_with_buffer_assignment
from remat.explainer.timeline import HeapTimeline

__all__ = ["KINDS", "ExplainReport", "PeakBuffer", "explain", "saved_bytes_by_module"]

PROGRESS_AFTER_S = 3.0  # a compile slower than this prints a progress line on stderr


@dataclasses.dataclass
class ExplainReport:
    """What a compiled step keeps at its peak, and why.

    Attributes:
      temp_bytes: XLA's temp buffer, ``memory_analysis().temp_size_in_bytes``.
      peak_buffers: every buffer at the peak, largest first (:class:`PeakBuffer`): the
        temp buffer's live values and packing gaps, the arguments and the outputs.
      attributed_fraction: the share of ``temp_bytes`` given a source line or a module (a
        packing gap counts for the value XLA placed there, alignment padding for the value whose
        slot it pads, bytes of a called computation's value for that value).
      warnings: mistakes found, each with its fix.
      memory: all of ``memory_analysis()`` (:class:`~remat.analysis.CompiledMemory`).
      regions: the checkpointed regions: label, policy, bytes kept.
      compile_s: seconds the compilation took; explain_s: the whole explanation.
    """

    function: str
    temp_bytes: int
    peak_buffers: list[PeakBuffer]
    attributed_fraction: float
    warnings: list[str]
    memory: CompiledMemory
    regions: list[dict[str, Any]]
    timeline: HeapTimeline
    backward_step: int | None
    step_labels: dict[int, PeakBuffer]
    compile_s: float
    explain_s: float
    program: Any = dataclasses.field(default=None, repr=False)

    @property
    def temp_peak_buffers(self) -> list[PeakBuffer]:
        return [b for b in self.peak_buffers if b.allocation == "temp"]

    @property
    def unattributed_bytes(self) -> int:
        """Temp bytes at the peak with neither a source line nor a module."""
        return self.temp_bytes - round(self.attributed_fraction * self.temp_bytes)

    @property
    def gap_bytes(self) -> int:
        """Temp bytes free at the peak: gaps that XLA's heap packing left."""
        return sum(b.bytes for b in self.temp_peak_buffers if not b.live)

    def by_kind(self) -> dict[str, int]:
        """Temp bytes at the peak per kind (packing gaps under "other temporary")."""
        totals = {k: 0 for k in KINDS}
        for b in self.temp_peak_buffers:
            totals[b.kind] = totals.get(b.kind, 0) + b.bytes
        return {k: v for k, v in totals.items() if v}

    def to_dict(self) -> dict[str, Any]:
        return {
            "function": self.function,
            "temp_bytes": self.temp_bytes,
            "attributed_fraction": self.attributed_fraction,
            "unattributed_bytes": self.unattributed_bytes,
            "gap_bytes": self.gap_bytes,
            "argument_bytes": self.memory.argument_bytes,
            "output_bytes": self.memory.output_bytes,
            "by_kind": self.by_kind(),
            "peak_buffers": [b.to_dict() for b in self.peak_buffers],
            "regions": self.regions,
            "warnings": list(self.warnings),
            "timeline": {"steps": self.timeline.steps, "peak_step": self.timeline.peak,
                         "backward_step": self.backward_step},
            "compile_s": round(self.compile_s, 3),
            "explain_s": round(self.explain_s, 3),
        }

    def to_json(self, **kwargs: Any) -> str:
        """The report as one JSON object (the keys of :meth:`to_dict`)."""
        return json.dumps(self.to_dict(), **kwargs)

    def plot(self, path: str, *, top: int = 5, title: str | None = None) -> str:
        """Writes the timeline: live temp bytes per step, the peak, the backward pass, the largest buffers."""
        from remat.explainer._trace_files import plot_timeline

        return plot_timeline(self, path, top=top, title=title)

    def to_trace(self, path: str) -> str:
        """Writes the timeline for a viewer: ``.json`` Chrome/Perfetto trace events, ``.pickle``
        PyTorch's memory snapshot (open it at https://pytorch.org/memory_viz)."""
        from remat.explainer._trace_files import write_trace

        return write_trace(self, path)

    def rows(self, top: int = 15) -> list[list[str]]:
        """The largest buffers at the peak, as table rows (see :attr:`columns`)."""
        return [[format_bytes(b.bytes), b.kind, b.module or "-", b.source or "-", b.shape or "-",
                 b.region or "-", b.rule or "-"] for b in self.peak_buffers[:top]]

    columns = ["bytes", "kind", "module", "source", "shape", "region", "why"]

    def summary(self) -> list[str]:
        kinds = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.by_kind().items())
        return [
            f"temp {format_bytes(self.temp_bytes)} at the peak: {kinds}",
            f"attributed to a line or module: {self.attributed_fraction:.2%} "
            f"(unattributed {format_bytes(self.unattributed_bytes)}; packing gaps {format_bytes(self.gap_bytes)})",
            f"arguments {format_bytes(self.memory.argument_bytes)}, outputs {format_bytes(self.memory.output_bytes)}",
        ]

    def __str__(self) -> str:
        lines = [f"remat.explain({self.function}): peak of the compiled step"]
        widths = [max(len(c), *(len(r[i]) for r in self.rows())) if self.rows() else len(c)
                  for i, c in enumerate(self.columns)]
        for row in [self.columns, *self.rows()]:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        lines.extend(self.summary())
        lines.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(lines)


def _first_argument(fn: Callable) -> str | None:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    return params[0].name if params and params[0].kind in (params[0].POSITIONAL_ONLY,
                                                            params[0].POSITIONAL_OR_KEYWORD) else None


def _fn_name(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


class _Progress:
    """A line on stderr when the compilation takes longer than ``PROGRESS_AFTER_S``."""

    def __init__(self, what: str):
        self.what, self.started, self.printed = what, time.perf_counter(), False
        self.timer = threading.Timer(PROGRESS_AFTER_S, self._say)
        self.timer.daemon = True

    def _say(self) -> None:
        self.printed = True
        print(f"remat explain: compiling {self.what} (one XLA compilation; the explanation reads its "
              "buffer assignment)...", file=sys.stderr, flush=True)

    def __enter__(self) -> _Progress:
        self.timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.timer.cancel()
        if self.printed:
            print(f"remat explain: compiled in {time.perf_counter() - self.started:.1f} s", file=sys.stderr,
                  flush=True)


def explain(fn: Callable, *args: Any, **kwargs: Any) -> ExplainReport:
    """Compiles ``fn`` once and attributes every byte at the peak of its memory.

    Args:
      fn: a function JAX can compile that differentiates, or that already returns
        gradients: a loss wrapped in ``jax.grad``, a whole training step. (A function
        without a backward pass is explained too; it has no residuals.)
      *args: example inputs (arrays or pytrees; ``jax.ShapeDtypeStruct`` works).
      **kwargs: keyword inputs, traced like ``args``.

    Returns:
      An :class:`ExplainReport`. ``temp_bytes`` equals
      ``jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> loss = lambda w, x: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w))
      >>> r = explain(jax.grad(loss), jnp.ones((64, 64)), jnp.ones((32, 64)))
      >>> r.temp_bytes == jax.jit(jax.grad(loss)).lower(jnp.ones((64, 64)), jnp.ones((32, 64))).compile(
      ...     ).memory_analysis().temp_size_in_bytes
      True
    """
    if not callable(fn):
        raise TypeError(f"remat.explain needs a function, got {type(fn).__name__}")
    started = time.perf_counter()

    # A fresh function: JAX caches traces per function, and the cached trace would lack module names.
    @functools.wraps(fn)
    def step(*a: Any, **k: Any) -> Any:
        return fn(*a, **k)

    with module_scopes():
        traced = jax.jit(step).trace(*args, **kwargs)
    lowered = traced.lower()
    with _Progress(_fn_name(fn)) as progress:
        compiled, program = compile_with_buffer_assignment(lowered)
    compile_s = time.perf_counter() - progress.started
    memory = CompiledMemory.from_compiled(compiled)

    from remat.explainer.timeline import heap_timeline

    timeline = heap_timeline(program)
    regions = _region_residuals.regions(traced.jaxpr)
    output_paths = [jax.tree_util.keystr(path) for path, _ in
                    jax.tree_util.tree_flatten_with_path(traced.out_info)[0]]
    attributor = Attributor(program, timeline, regions, _first_argument(fn), output_paths)
    buffers = attributor.peak_buffers()
    temp = memory.temp_bytes
    attributed = sum(b.bytes for b in buffers if b.allocation == "temp" and (b.source or b.module))
    labels = {o.buffer_id: attributor.temp_buffer(o.buffer_id, o.start, o.end, o.size) for o in timeline.occupancies}
    warnings = mistakes(attributor, labels, buffers)
    region_rows = [{"region": r.label, "policy": r.policy, "source": r.source,
                    "kept_bytes": sum(k.nbytes for k in r.kept),
                    "kept_by_policy_bytes": sum(k.nbytes for k in r.kept if k.by_policy)} for r in regions]
    return ExplainReport(_fn_name(fn), temp, buffers, attributed / temp if temp else 1.0, warnings, memory,
                         region_rows, timeline, attributor.backward_step, labels, compile_s,
                         time.perf_counter() - started, program)


def saved_bytes_by_module(fn: Callable, *args: Any, **kwargs: Any) -> tuple[dict[str | None, int], list[str]]:
    """Bytes the backward pass of ``fn`` keeps, by the module path that keeps them.

    Args:
      fn: a function that differentiates (``jax.grad(loss)``), traced with module names.
      *args, **kwargs: example inputs.

    Returns:
      ``(bytes by module path, the module paths of the checkpointed regions)``; the step's
      inputs are not counted, values outside every module are under ``None``.
    """
    @functools.wraps(fn)
    def step(*a: Any, **k: Any) -> Any:
        return fn(*a, **k)

    with module_scopes():
        jaxpr = jax.make_jaxpr(step)(*args, **kwargs)
    return _region_residuals.kept_bytes_by_module(jaxpr)

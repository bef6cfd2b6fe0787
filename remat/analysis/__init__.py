"""What checkpointing really saves: residuals, compiled buffer sizes and measured RSS.

Three views, from cheapest to most honest:

* :func:`saved_residuals` traces ``jax.vjp`` and lists every value the backward pass
  keeps, with its size, source line and checkpoint name. No compilation; exact for
  the program JAX hands to XLA, but blind to what XLA's scheduler does with it.
* :func:`compiled_memory` compiles ``jax.jit(jax.grad(fn))`` and reads XLA's buffer
  assignment (``memory_analysis()``): the bytes the step will really allocate.
  On XLA:CPU this is where the scheduler's choices show up.
* :func:`peak_rss_bytes` runs a step in a fresh Python process and reads the kernel's
  high-water mark of resident memory.

:func:`compare_policies` puts residual bytes, compiled temp bytes and step time side by
side for several checkpoint policies, and can plot them. :func:`explain` attributes every
byte at the peak of one compiled step (kind, module, source line, region, policy rule).

The measuring kernel every report of remat (and the benchmarks) goes through:
:func:`compiled_step` (compile ``jit(grad(fn))`` once: executable and bytes),
:func:`time_programs` (warm-up, interleaved rounds, medians) and the process-memory
readers of :mod:`remat.analysis.process` (:func:`current_rss_bytes`,
:func:`peak_rss_during`, :func:`process_peak_rss_bytes`).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from remat.analysis import saved_residuals, compiled_memory
  >>> def loss(w, x):
  ...     return jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w))
  >>> w, x = jnp.ones((64, 64)), jnp.ones((8, 64))
  >>> print(saved_residuals(loss, w, x))       # doctest: +SKIP
  >>> compiled_memory(loss, w, x).temp_bytes   # doctest: +SKIP
"""
from __future__ import annotations

from remat._core.residuals import (
    Residual,
    ResidualReport,
    checkpoint_names,
    format_bytes,
    names_in_jaxpr,
    saved_residuals,
)
from remat.analysis.compare import DEFAULT_POLICIES, PolicyComparison, PolicyResult, compare_policies, with_policy
from remat.analysis.compiled import CompiledMemory, CompiledStep, compiled_memory, compiled_step
from remat.analysis.explanation import ExplainReport, PeakBuffer, explain
from remat.analysis.process import (
    PeakRSS,
    RSSMeasurement,
    current_rss_bytes,
    peak_rss_bytes,
    peak_rss_during,
    proc_status_bytes,
    process_peak_rss_bytes,
    reset_peak_rss,
)
from remat.analysis.timing import Timings, time_programs

__all__ = [
    "DEFAULT_POLICIES",
    "CompiledMemory",
    "CompiledStep",
    "ExplainReport",
    "PolicyComparison",
    "PeakBuffer",
    "PeakRSS",
    "PolicyResult",
    "RSSMeasurement",
    "Residual",
    "ResidualReport",
    "Timings",
    "checkpoint_names",
    "compare_policies",
    "compiled_memory",
    "compiled_step",
    "current_rss_bytes",
    "explain",
    "format_bytes",
    "names_in_jaxpr",
    "peak_rss_bytes",
    "peak_rss_during",
    "proc_status_bytes",
    "process_peak_rss_bytes",
    "reset_peak_rss",
    "saved_residuals",
    "time_programs",
    "with_policy",
]

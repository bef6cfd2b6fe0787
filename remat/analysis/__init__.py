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
side for several checkpoint policies, and can plot them. :func:`remat.explain`
(:mod:`remat.explainer`) attributes every byte at the peak of one compiled step.

The measuring kernel every report of remat (and the benchmarks) goes through:
:func:`compiled_step` (compile ``jit(grad(fn))`` once: executable and bytes),
:func:`time_programs` (warm-up, interleaved rounds, medians) and the process-memory
readers of :mod:`remat.analysis.process` (:func:`peak_rss_during`, and more in that module).

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

from remat._core.residuals import Residual, ResidualReport, saved_residuals
from remat.analysis.compare import PolicyComparison, PolicyResult, compare_policies
from remat.analysis.compiled import CompiledMemory, CompiledStep, compiled_memory, compiled_step
from remat.analysis.process import PeakRSS, RSSMeasurement, peak_rss_bytes, peak_rss_during
from remat.analysis.timing import Timings, time_programs

__all__ = [
    "CompiledMemory",
    "CompiledStep",
    "PeakRSS",
    "PolicyComparison",
    "PolicyResult",
    "RSSMeasurement",
    "Residual",
    "ResidualReport",
    "Timings",
    "compare_policies",
    "compiled_memory",
    "compiled_step",
    "peak_rss_bytes",
    "peak_rss_during",
    "saved_residuals",
    "time_programs",
]

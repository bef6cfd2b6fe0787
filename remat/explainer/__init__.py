"""Where a compiled step's memory goes: every byte at its peak attributed (:func:`remat.explain`).

One compilation of the step, with XLA's buffer assignment read from that very compilation:
each buffer live at the peak with its size, its kind (:data:`KINDS`), the module and the
line of the user's code that produced it, and for a residual the checkpointed region and
the policy rule that kept it (:class:`PeakBuffer`); mistakes are named with their fix
(:attr:`ExplainReport.warnings`). The guide is ``docs/explain.md``.

Example:
  >>> report = remat.explain(jax.grad(loss), params, x)   # doctest: +SKIP
  >>> print(report)                                        # doctest: +SKIP
"""
from __future__ import annotations

from remat.explainer._attribution import KINDS, PeakBuffer
from remat.explainer.explanation import ExplainReport, explain

__all__ = ["KINDS", "ExplainReport", "PeakBuffer", "explain"]

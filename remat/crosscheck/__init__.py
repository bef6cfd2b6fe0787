"""Cross-framework checks: a Flax NNX model against its PyTorch twin.

Three tools:

* :func:`load_torch_state` copies a ``torch.nn.Module`` (or a state dict) into an NNX
  module, converting layouts; strict by default, naming every offending entry at once.
* :func:`compare_gradients` runs both models on the same inputs and compares outputs,
  parameter gradients, input gradients and (BatchNorm) running statistics, in train and
  eval mode: a :class:`GradientReport`.
* :func:`compare_training` trains both for a few steps with matching optimizers (optax
  against ``torch.optim``) and compares the loss curves and the final weights: a
  :class:`TrainingReport`.

PyTorch is imported only inside these functions; without it they raise ``ImportError``
("remat.crosscheck needs PyTorch: pip install 'remat[torch]'").

The modules, from the bottom up:

* :mod:`remat.crosscheck.lazy`: torch imported on first use, with the install hint.
* :mod:`remat.crosscheck.layouts`: each tensor's layout from its owning torch module
  (``nn.Linear``, HF ``Conv1D``, convolutions), ``layouts=`` overrides, tied tensors.
* :mod:`remat.crosscheck.pytrees`: Linen modules and ``(apply_fn, params)`` as NNX modules
  (:func:`as_nnx`), under the same naming convention.
* :mod:`remat.crosscheck.outputs`: outputs as they come (HF ``ModelOutput`` s, caches) and the
  ``output=`` selector.
* :mod:`remat.crosscheck.weights`: names (the naming convention) and :func:`load_torch_state`.
* :mod:`remat.crosscheck.checkpoint`: :func:`torch_checkpoint`.
* :mod:`remat.crosscheck.report`: rows, tolerances (why they are what they are) and the reports.
* :mod:`remat.crosscheck.harness`: what both comparisons share (dtypes, modes, layouts, calls).
* :mod:`remat.crosscheck.gradients`: :func:`compare_gradients`.
* :mod:`remat.crosscheck.training`: :func:`compare_training` and the optimizer mapping.
* :mod:`remat.crosscheck.precision`: bfloat16 and mixed precision judged against a float64
  reference (``err_jax <= 2 * max(err_torch, eps)``): rows and :class:`PrecisionReport`.
* :mod:`remat.crosscheck.autocast`: the two sides of a low-precision run (``torch.autocast``
  and its per-module counterpart for NNX); :mod:`remat.crosscheck.precision_runs`: the runs.

Example:
  >>> from remat.crosscheck import compare_gradients, load_torch_state
  >>> load_torch_state(jax_model, torch_model)                 # doctest: +SKIP
  >>> report = compare_gradients(jax_model, torch_model, (x,))  # doctest: +SKIP
  >>> print(report); assert report.ok                          # doctest: +SKIP
"""
from __future__ import annotations

from remat.crosscheck.checkpoint import torch_checkpoint
from remat.crosscheck.gradients import compare_gradients
from remat.crosscheck.layouts import LAYOUTS, LayoutWarning
from remat.crosscheck.lazy import TORCH_MISSING
from remat.crosscheck.precision import PRECISIONS, PrecisionReport, PrecisionRow
from remat.crosscheck.pytrees import PytreeModel, as_nnx
from remat.crosscheck.report import TOLERANCES, TRAINING_TOLERANCES, GradientReport, Row, TrainingReport
from remat.crosscheck.training import OPTIMIZERS, compare_training, make_optimizers
from remat.crosscheck.weights import (
    LoadReport,
    StateDictMismatchError,
    load_torch_state,
    to_nnx_layout,
    to_torch_layout,
    torch_names,
)

__all__ = [
    "GradientReport",
    "LAYOUTS",
    "LayoutWarning",
    "LoadReport",
    "OPTIMIZERS",
    "PRECISIONS",
    "PrecisionReport",
    "PrecisionRow",
    "PytreeModel",
    "Row",
    "StateDictMismatchError",
    "TOLERANCES",
    "TORCH_MISSING",
    "TRAINING_TOLERANCES",
    "TrainingReport",
    "as_nnx",
    "compare_gradients",
    "compare_training",
    "load_torch_state",
    "make_optimizers",
    "to_nnx_layout",
    "to_torch_layout",
    "torch_checkpoint",
    "torch_names",
]

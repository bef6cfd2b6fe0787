"""Rows, tolerances and reports: one JAX tensor against its torch counterpart, and the tables of many.

Tolerances
----------
A tensor passes when ``max|jax - torch| <= atol + rtol * max|torch|`` (a norm-wise test:
entry-wise relative errors are meaningless for entries that are zero up to rounding).

* **float32** (defaults ``rtol=1e-4, atol=1e-6``): XLA and PyTorch's CPU kernels sum
  matmuls and convolutions in different orders (blocked, vectorised, sometimes fused), so
  results differ by a few ulps per operation, and the differences grow through the layers
  and the backward pass; deeper or wider models and BatchNorm (which divides by small
  standard deviations) grow them most, hence the margin.
* **float64** (``dtype="float64"``, defaults ``rtol=1e-10, atol=1e-12``): the same
  reordering costs ~1e-16 per operation. JAX's x64 mode is global, so the comparison runs
  inside ``jax.enable_x64(True)`` on float64 copies of both models and leaves the rest of
  the program in float32.
* **training** (:func:`remat.crosscheck.training.compare_training`): differences compound over
  steps, and Adam's ``m / (sqrt(v) + eps)`` amplifies them for entries whose gradient is
  ~0, so the float32 defaults are looser (``rtol=1e-3, atol=1e-5``); float64 stays tight
  (``rtol=1e-10, atol=1e-12``). A parameter whose gradient is exactly zero in theory (a
  bias right before a train-mode BatchNorm) gets rounding-noise gradients that Adam turns
  into full steps of size ``lr`` in unrelated directions: leave such biases out of the
  model (``bias=False``) or, for a model you cannot change (GPT-2's key bias inside
  ``c_attn.bias``), out of the comparison (``compare_training(..., exclude=...)``).
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from remat.crosscheck.layouts import to_torch
from remat.crosscheck.weights import TorchNaming, _tied_line, _to_numpy

TOLERANCES: dict[str, tuple[float, float]] = {"float32": (1e-4, 1e-6), "float64": (1e-10, 1e-12)}
TRAINING_TOLERANCES: dict[str, tuple[float, float]] = {"float32": (1e-3, 1e-5), "float64": (1e-10, 1e-12)}


def _tolerances(table: dict[str, tuple[float, float]], dtype: str, rtol: float | None,
                atol: float | None) -> tuple[float, float]:
    default_rtol, default_atol = table[dtype]
    return (default_rtol if rtol is None else rtol), (default_atol if atol is None else atol)


def _errors(jax_value: np.ndarray, torch_value: np.ndarray) -> tuple[float, float, float]:
    """(max abs error, max abs error / max|torch|, max|torch|)."""
    a = np.asarray(jax_value, dtype=np.float64)
    b = np.asarray(torch_value, dtype=np.float64)
    if a.shape != b.shape:
        return math.inf, math.inf, float(np.max(np.abs(b))) if b.size else 0.0
    if a.size == 0:
        return 0.0, 0.0, 0.0
    diff = np.abs(a - b)
    if not np.all(np.isfinite(a) == np.isfinite(b)):
        return math.inf, math.inf, float(np.nanmax(np.abs(b[np.isfinite(b)]), initial=0.0))
    diff = np.where(np.isfinite(b), diff, 0.0)
    scale = float(np.max(np.abs(np.where(np.isfinite(b), b, 0.0))))
    max_abs = float(np.max(diff))
    return max_abs, max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf), scale


@dataclass(frozen=True)
class Row:
    """One compared tensor: its kind, name, shape, errors and verdict."""

    mode: str
    kind: str  # "weight" (before), "output", "param" (gradient), "input", "buffer", "loss"
    name: str
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    ok: bool

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "kind": self.kind, "name": self.name, "shape": list(self.shape),
                "max_abs_err": self.max_abs, "max_rel_err": self.max_rel, "ok": self.ok}


def _row(mode: str, kind: str, name: str, jax_value: Any, torch_value: Any, rtol: float, atol: float) -> Row:
    a, b = np.asarray(jax_value), np.asarray(torch_value)
    max_abs, max_rel, scale = _errors(a, b)
    ok = a.shape == b.shape and max_abs <= atol + rtol * scale
    return Row(mode, kind, name, tuple(b.shape), max_abs, max_rel, bool(ok))


def _format_rows(rows: list[Row]) -> list[str]:
    header = ("mode", "kind", "name", "shape", "max abs err", "max rel err", "ok")
    cells = [(r.mode, r.kind, r.name, "x".join(map(str, r.shape)) or "scalar", f"{r.max_abs:.2e}",
              f"{r.max_rel:.2e}", "ok" if r.ok else "FAIL") for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths)) for cell in cells]
    return lines


def _param_rows(mode: str, kind: str, jax_vars: dict[str, tuple[tuple, Any]], torch_values: Mapping[str, Any],
                rtol: float, atol: float, naming: TorchNaming, exclude: Any = None) -> list[Row]:
    """One row per tensor of either side (tied tensors once), in each tensor's own layout;
    names ``exclude`` accepts are left out."""
    torch_values = naming.torch_side(torch_values, list(jax_vars))
    rows = []
    for name in sorted(set(jax_vars) | set(torch_values)):
        if exclude is not None and exclude(name):
            continue
        if name not in torch_values or name not in jax_vars:
            missing_in = "torch" if name not in torch_values else "jax"
            rows.append(Row(mode, kind, f"{name} (no {missing_in} counterpart)", (), math.inf, math.inf, False))
            continue
        path, value = jax_vars[name]
        torch_value = _to_numpy(torch_values[name])
        layout = naming.layouts.of(name, str(path[-1]), torch_value.shape)
        rows.append(_row(mode, kind, name, to_torch(layout, np.asarray(value)), torch_value, rtol, atol))
    return rows


class _RowsVerdict:
    """``ok``, ``failures``, ``max_rel`` and ``to_json`` of a report made of :class:`Row` s."""

    rows: list[Row]

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def ok(self) -> bool:
        """True when every row is within tolerance."""
        return all(r.ok for r in self.rows)

    @property
    def failures(self) -> list[Row]:
        """The rows out of tolerance."""
        return [r for r in self.rows if not r.ok]

    @property
    def max_rel(self) -> float:
        """The largest relative error over all rows."""
        return max((r.max_rel for r in self.rows), default=0.0)

    def to_json(self) -> str:
        """:meth:`to_dict` as a JSON string."""
        return json.dumps(self.to_dict())

    def _verdict(self) -> str:
        return "ok" if self.ok else f"FAILED ({len(self.failures)} out of tolerance)"


@dataclass
class GradientReport(_RowsVerdict):
    """Per-tensor comparison of a JAX model against its PyTorch twin.

    Attributes:
      rows: one :class:`Row` per starting weight (mode ``"init"``, kind ``"weight"``), and
        per mode one per output, parameter gradient, input gradient and running statistic.
      dtype: ``"float32"`` or ``"float64"``.
      rtol, atol: the tolerances used.
      tied: groups of torch names that are one tensor (compared once, under the name the
        Flax side uses).
      skipped: output leaves that are not arrays (e.g. ``output.past_key_values``, a
        ``DynamicCache``), named and left out.
    """

    rows: list[Row]
    dtype: str
    rtol: float
    atol: float
    tied: list[tuple[str, ...]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: ``ok``, ``dtype``, tolerances, ``max_rel_err``, ``rows``, ``tied``, ``skipped``."""
        return {"ok": self.ok, "dtype": self.dtype, "rtol": self.rtol, "atol": self.atol,
                "max_rel_err": self.max_rel, "rows": [r.to_dict() for r in self.rows],
                "tied": [list(g) for g in self.tied], "skipped": self.skipped}

    def notes(self) -> list[str]:
        """What the rows do not show: tied names, skipped output leaves (one line each)."""
        notes = [_tied_line(self.tied)] if self.tied else []
        return notes + ([f"skipped (not arrays): {', '.join(sorted(set(self.skipped)))}"] if self.skipped else [])

    def __str__(self) -> str:
        title = (f"gradient check, {self.dtype}, pass when max abs err <= {self.atol:g} + "
                 f"{self.rtol:g} * max|torch|: {self._verdict()}")
        return "\n".join([title, *_format_rows(self.rows), *self.notes()])


@dataclass
class TrainingReport(_RowsVerdict):
    """Loss curves and final weights of a JAX model and its PyTorch twin after training.

    Attributes:
      optimizer: the optimizer name.
      steps: the number of steps.
      jax_losses, torch_losses: the loss before each step.
      rows: final-weight (and running-statistic) comparisons, plus one ``loss`` row.
      dtype, rtol, atol, tied: as in :class:`GradientReport`.
      excluded: the names ``exclude=`` left out of the weight comparison.
    """

    optimizer: str
    steps: int
    mode: str
    jax_losses: list[float]
    torch_losses: list[float]
    rows: list[Row]
    dtype: str
    rtol: float
    atol: float
    tied: list[tuple[str, ...]] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "optimizer": self.optimizer, "steps": self.steps, "mode": self.mode,
                "dtype": self.dtype, "rtol": self.rtol, "atol": self.atol, "max_rel_err": self.max_rel,
                "jax_losses": self.jax_losses, "torch_losses": self.torch_losses,
                "rows": [r.to_dict() for r in self.rows], "tied": [list(g) for g in self.tied],
                "excluded": self.excluded}

    def __str__(self) -> str:
        lines = [f"training check, {self.optimizer}, {self.steps} steps, {self.mode} mode, {self.dtype}: "
                 f"{self._verdict()}",
                 "step  jax loss          torch loss"]
        lines += [f"{i:<4}  {a:<16.10g}  {b:.10g}" for i, (a, b) in enumerate(zip(self.jax_losses, self.torch_losses))]
        return "\n".join(lines + _format_rows(self.rows) + self.notes())

    def notes(self) -> list[str]:
        """What the rows do not show: tied names, excluded parameters (one line each)."""
        notes = [_tied_line(self.tied)] if self.tied else []
        return notes + ([f"excluded from the weight comparison: {', '.join(self.excluded)}"] if self.excluded else [])

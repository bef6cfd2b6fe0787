"""Low-precision cross-checks judged against each framework's own error: the criterion, its rows and report.

The criterion
-------------
In bfloat16 (and in mixed precision: bfloat16 compute, float32 parameters) a fixed
tolerance means nothing: both frameworks are far from the truth, by amounts that depend on
the model. So both are measured against the truth. Same weights, same batch; a float64
run of the PyTorch twin is the reference, and every tensor gets three relative errors
(norm-wise, ``||a - ref||_2 / ||ref||_2``: the standard relative error of a tensor, which a
systematic mismatch moves and the luck of one entry does not; a single near-zero gradient
whose sign bfloat16 rounding flips becomes a full ``lr`` step in Adam, on either side):

* ``err_jax``: remat's low-precision run against the reference;
* ``err_torch``: PyTorch's low-precision run against the reference;
* ``err_cross``: the two low-precision runs against each other (shown, not judged).

A tensor passes when ``err_jax <= 2 * max(err_torch, eps)``: remat is no further from the
truth than twice PyTorch's own error. ``eps`` is the unit roundoff of the dtype the
tensor is held in (:data:`EPS`: ``2**-8`` for bfloat16, ``2**-24`` for float32): merely
storing the exact reference in that dtype costs up to ``eps``, so no implementation can
be asked to beat it; a tensor that both frameworks get right to within a rounding of its
own storage cannot fail on luck. ``eps`` never hides a real gap: a float32 master weight
keeps the float32 ``eps``, so there the criterion is ``err_jax <= 2 * err_torch``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: The low precisions: ``"bfloat16"`` (everything in bfloat16: parameters, activations,
#: gradients, optimizer state) and ``"mixed"`` (bfloat16 matmuls and convolutions on
#: float32 parameters, gradients and optimizer state: ``torch.autocast``).
PRECISIONS = ("bfloat16", "mixed")

#: Unit roundoff of the dtype a compared tensor is held in (the ``eps`` of the criterion).
EPS: dict[str, float] = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24,
                         "float64": 2.0 ** -53}

#: ``err_jax <= FACTOR * max(err_torch, eps)``.
FACTOR = 2.0


def relative_error(value: Any, reference: Any) -> float:
    """``||value - reference||_2 / ||reference||_2`` in float64 (inf on a shape or finiteness mismatch).

    Example:
      >>> relative_error(np.array([3.0, 4.0]), np.array([3.0, 4.5]))  # 0.5 / sqrt(9 + 20.25)
      0.09245003270420485
    """
    a = np.asarray(value, dtype=np.float64)
    b = np.asarray(reference, dtype=np.float64)
    if a.shape != b.shape or not np.array_equal(np.isfinite(a), np.isfinite(b)):
        return math.inf
    if a.size == 0:
        return 0.0
    finite = np.isfinite(b)
    diff = float(np.linalg.norm(np.where(finite, a - b, 0.0)))
    scale = float(np.linalg.norm(np.where(finite, b, 0.0)))
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / scale


@dataclass(frozen=True)
class PrecisionRow:
    """One tensor: its errors against the float64 reference and the verdict.

    Attributes:
      mode, kind, name, shape: as in :class:`remat.crosscheck.Row` (kinds ``output``,
        ``param`` (a gradient, or a weight after training), ``input``, ``buffer``, ``loss``).
      dtype: the dtype the tensor is held in by the low-precision runs (it sets ``eps``).
      err_jax, err_torch, err_cross: the three relative errors (module docstring).
      eps: the floor of the criterion for this tensor.
      ok: ``err_jax <= 2 * max(err_torch, eps)``.
    """

    mode: str
    kind: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    err_jax: float
    err_torch: float
    err_cross: float
    eps: float
    ok: bool

    @property
    def ratio(self) -> float:
        """``err_jax / max(err_torch, eps)``: passes when at most 2."""
        return self.err_jax / max(self.err_torch, self.eps)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "kind": self.kind, "name": self.name, "shape": list(self.shape),
                "dtype": self.dtype, "err_jax": self.err_jax, "err_torch": self.err_torch,
                "err_cross": self.err_cross, "eps": self.eps, "ok": self.ok}


def precision_row(mode: str, kind: str, name: str, jax_value: Any, torch_value: Any, reference: Any,
                  dtype: str) -> PrecisionRow:
    """The row of one tensor from its two low-precision values and the float64 reference.

    Example:
      >>> r = precision_row("train", "param", "w", np.array([1.01]), np.array([1.02]), np.array([1.0]), "bfloat16")
      >>> r.ok, round(r.err_jax, 4), round(r.err_torch, 4)
      (True, 0.01, 0.02)
    """
    eps = EPS[dtype]
    e_jax, e_torch = relative_error(jax_value, reference), relative_error(torch_value, reference)
    e_cross = relative_error(jax_value, torch_value)
    ok = bool(np.isfinite(e_jax) and e_jax <= FACTOR * max(e_torch, eps))
    return PrecisionRow(mode, kind, name, tuple(np.shape(reference)), dtype, e_jax, e_torch, e_cross, eps, ok)


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"median": 0.0, "p90": 0.0, "max": 0.0}
    a = np.asarray(values, dtype=np.float64)
    return {"median": float(np.median(a)), "p90": float(np.quantile(a, 0.9)), "max": float(np.max(a))}


@dataclass
class PrecisionReport:
    """Every tensor of a low-precision cross-check, with the distribution of its errors.

    Attributes:
      check: ``"gradients"`` or ``"training"``.
      precision: ``"bfloat16"`` or ``"mixed"``.
      rows: one :class:`PrecisionRow` per tensor.
      steps, optimizer: for a training check (else 0 and None).
      losses: ``{"jax": [...], "torch": [...], "reference": [...]}``, the loss before each step.
      tied, skipped, excluded: as in the float reports.
      notes: for a training check, per failing weight, how many entries each side moved
        more than ``lr / 2`` from the reference (Adam's sign flips).
    """

    check: str
    precision: str
    rows: list[PrecisionRow]
    steps: int = 0
    optimizer: str | None = None
    losses: dict[str, list[float]] = field(default_factory=dict)
    tied: list[tuple[str, ...]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every row passes the criterion."""
        return all(r.ok for r in self.rows)

    @property
    def failures(self) -> list[PrecisionRow]:
        """The rows that fail the criterion."""
        return [r for r in self.rows if not r.ok]

    @property
    def max_rel(self) -> float:
        """The largest ``err_jax``."""
        return max((r.err_jax for r in self.rows), default=0.0)

    def distribution(self, worst: int = 3) -> dict[str, Any]:
        """Median, p90 and max of ``err_jax``, ``err_torch`` and their ratio, and the ``worst`` rows by ratio."""
        ranked = sorted(self.rows, key=lambda r: r.ratio, reverse=True)
        return {"err_jax": _quantiles([r.err_jax for r in self.rows]),
                "err_torch": _quantiles([r.err_torch for r in self.rows]),
                "err_cross": _quantiles([r.err_cross for r in self.rows]),
                "ratio": _quantiles([r.ratio for r in self.rows]),
                "worst": [{"name": f"{r.mode} {r.kind} {r.name}", "err_jax": r.err_jax, "err_torch": r.err_torch,
                           "ratio": r.ratio} for r in ranked[:worst]]}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: ``ok``, ``precision``, ``criterion``, ``distribution``, ``rows``, ..."""
        return {"ok": self.ok, "check": self.check, "precision": self.precision, "dtype": self.precision,
                "criterion": f"err_jax <= {FACTOR:g} * max(err_torch, eps)", "steps": self.steps,
                "optimizer": self.optimizer, "losses": self.losses, "max_rel_err": self.max_rel,
                "distribution": self.distribution(), "rows": [r.to_dict() for r in self.rows],
                "tied": [list(g) for g in self.tied], "skipped": self.skipped, "excluded": self.excluded,
                "notes": self.notes}

    def to_json(self) -> str:
        """:meth:`to_dict` as a JSON string."""
        return json.dumps(self.to_dict())

    def summary_lines(self) -> list[str]:
        """The distribution as a few lines of text (median / p90 / max, then the worst tensors)."""
        d = self.distribution()
        lines = [f"{'':10}  {'median':>9}  {'p90':>9}  {'max':>9}"]
        for key in ("err_jax", "err_torch", "err_cross", "ratio"):
            q = d[key]
            lines.append(f"{key:10}  {q['median']:9.2e}  {q['p90']:9.2e}  {q['max']:9.2e}")
        lines += [f"worst: {w['name']}: err_jax {w['err_jax']:.2e}, err_torch {w['err_torch']:.2e}, "
                  f"ratio {w['ratio']:.2f}" for w in d["worst"]]
        return lines + self.notes

    def table_rows(self) -> list[list[str]]:
        """One list of cells per row, for :data:`COLUMNS`."""
        return [[r.mode, r.kind, r.name, "x".join(map(str, r.shape)) or "scalar", r.dtype, f"{r.err_jax:.2e}",
                 f"{r.err_torch:.2e}", f"{r.err_cross:.2e}", f"{r.ratio:.2f}", "ok" if r.ok else "FAIL"]
                for r in self.rows]

    def title(self) -> str:
        verdict = "ok" if self.ok else f"FAILED ({len(self.failures)} fail the criterion)"
        what = f"{self.optimizer}, {self.steps} steps" if self.check == "training" else "gradients"
        return (f"{what}, {self.precision} vs a float64 reference, pass when err_jax <= "
                f"{FACTOR:g} * max(err_torch, eps): {verdict}")

    def __str__(self) -> str:
        cells = self.table_rows()
        widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(COLUMNS)]
        lines = [self.title(), "  ".join(h.ljust(w) for h, w in zip(COLUMNS, widths)),
                 "  ".join("-" * w for w in widths)]
        lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths)) for cell in cells]
        return "\n".join(lines + self.summary_lines())


COLUMNS = ["mode", "kind", "name", "shape", "dtype", "err_jax", "err_torch", "err_cross", "ratio", "ok"]

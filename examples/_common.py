"""Small helpers shared by the seed examples (kept out of the scripts' way)."""
from __future__ import annotations

from typing import Any

import numpy as np


def try_import_torch() -> Any | None:
    """PyTorch if installed (the ``[torch]`` extra), else None: the JAX side runs either way."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def max_abs_diff(a: Any, b: Any) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


def result(example: str, jax_result: str, torch_result: str | None, diffs: list[float],
           tol: float, jax_ok: bool = True) -> dict[str, Any]:
    """The record ``remat demo`` prints: ok when the JAX checks hold and PyTorch agrees."""
    max_diff = max(diffs) if diffs else None
    ok = jax_ok and (max_diff is None or max_diff <= tol)
    return {"example": example, "jax": jax_result, "torch": torch_result,
            "max_diff": max_diff, "tol": tol, "ok": ok}

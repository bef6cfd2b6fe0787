"""The comparison: the same tree, dtypes and shapes exactly, values within rtol."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

RTOL = {"float32": 1e-6, "float64": 1e-12}


def _leaf(x: Any) -> Any:
    if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x


def assert_same(got: Any, want: Any, rtol: float, what: str = "") -> None:
    """``got`` (checkpointed) equals ``want`` (plain): tree, dtype, shape exactly; floats to ``rtol``.

    Floats compare to ``rtol`` of each leaf's largest magnitude, so that an element that
    cancels to ~0 in one run and to 1e-9 in the other is not a failure.
    """
    lg, tg = jax.tree.flatten(got)
    lw, tw = jax.tree.flatten(want)
    assert tg == tw, f"{what}: tree structures differ:\n{tg}\n{tw}"
    for i, (g, w) in enumerate(zip(lg, lw, strict=True)):
        g, w = np.asarray(_leaf(g)), np.asarray(_leaf(w))
        where = f"{what} leaf {i} of {tw}"
        assert g.dtype == w.dtype, f"{where}: dtype {g.dtype} != {w.dtype}"
        assert g.shape == w.shape, f"{where}: shape {g.shape} != {w.shape}"
        if g.dtype == jax.dtypes.float0:
            continue
        if np.issubdtype(w.dtype, np.inexact):
            scale = float(np.max(np.abs(w), initial=0.0))
            np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale, err_msg=where)
        else:
            np.testing.assert_array_equal(g, w, err_msg=where)

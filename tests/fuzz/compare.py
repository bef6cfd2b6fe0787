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


def assert_no_less_accurate(got: Any, want: Any, reference: Any, rtol: float, what: str = "") -> None:
    """``got`` is as close to the float64 ``reference`` as ``want`` is, give or take rounding.

    For float32 results that differ by more than ``rtol``: checkpointing may reorder sums, so
    a result is wrong only if it strays from the exact value by clearly more (4x, or ``rtol``
    of the leaf's scale) than the un-checkpointed program's own rounding error.
    """
    assert jax.tree.structure(got) == jax.tree.structure(want), f"{what}: tree structures differ"
    for i, (g, w, r) in enumerate(zip(*(jax.tree.leaves(t) for t in (got, want, reference)), strict=True)):
        try:
            assert_same(g, w, rtol, what=f"{what} leaf {i}")
            continue
        except AssertionError:
            g, w, r = (np.asarray(_leaf(x)) for x in (g, w, r))
            if (g.dtype, g.shape) != (w.dtype, w.shape) or not np.issubdtype(w.dtype, np.floating):
                raise
        finite = np.isfinite(w)
        assert np.array_equal(finite, np.isfinite(g)) and np.array_equal(g[~finite], w[~finite]), (
            f"{what} leaf {i}: the checkpointed and plain float32 results differ in where they are not finite")
        g, w, r = (x[finite].astype(np.float64) for x in (g, w, r))
        scale = float(np.max(np.abs(r), initial=0.0))
        own_error = float(np.max(np.abs(w - r), initial=0.0))
        error = float(np.max(np.abs(g - r), initial=0.0))
        assert error <= max(4 * own_error, rtol * scale), (
            f"{what} leaf {i}: checkpointed float32 is {error:.3g} from the float64 result, "
            f"the plain float32 program {own_error:.3g} (scale {scale:.3g})"
        )

"""Scan over a stack of identical layers, with checkpointing, flat or nested.

A Python loop over N layers gives XLA N copies of the layer: compile time grows with N,
and on XLA:CPU's default scheduler (and XLA:GPU's latency-hiding scheduler) per-layer
checkpointing can save nothing (see :mod:`remat._core.lowering`). ``lax.scan`` over
stacked parameters compiles one layer and runs it N times; the backward loop cannot
start before the forward loop ends, so the saved layer inputs are the only residuals
under any scheduler.

* :func:`scan_layers`: a pure ``layer(params, x) -> x`` and parameters stacked along a
  leading axis of size N.
* :func:`stack_nnx_layers` and :func:`scan_nnx_layers`: the same for a Flax NNX layer
  (created N times with ``nnx.vmap``, applied with ``nnx.split``/``nnx.merge``).
* :class:`LinenScanLayers`: a Flax Linen module that wraps ``nn.scan`` +
  ``nn.remat`` around a layer class.

Modules: :mod:`remat.scan.schedules` (the schedules, their memory model, validation),
:mod:`remat.scan.layers` (:func:`scan_layers` and the runners), :mod:`remat.scan.nnx`,
:mod:`remat.scan.linen` (imported on first use of :class:`LinenScanLayers`, so that
importing this package does not import Flax Linen).

Memory, for a depth-N stack with activations of size ``A`` per layer input:

* flat (``segments=None``): ``N * A`` of saved layer inputs, plus one layer's
  internals during its backward.
* nested (``nested=True`` or ``segments=k``): an outer scan over ``k`` groups, each
  group checkpointed (it keeps only its input), and an inner scan over the ``N/k``
  layers of the group. The backward recomputes one group at a time, so memory is
  about ``(k + N/k) * A``, smallest at ``k = sqrt(N)`` (Chen et al. 2016), for the
  price of one more forward pass.
* a schedule (``segments=(5, 4, 3, 2, 1, 1)``, ``segments=((3, 2, 1), (2, 1), 1)``):
  a nested tuple; an int ``n`` is a flat run of ``n`` layers, a tuple runs its
  children in sequence, each checkpointed as a whole. While the backward of child
  ``i`` (1-based) of a tuple runs, the inputs of children ``1..i`` are held and child
  ``i`` is being recomputed with its own peak, so in layer inputs
  ``peak(tuple) = max_i (i - 1 + peak(child_i))`` and ``peak(n) = n``
  (:func:`schedule_peak`). Equal groups waste memory: the first group is recomputed
  while only one input is held, the last while ``k`` are, so the first groups can be
  longer. :func:`binomial_schedule` (``levels=...``) gives the schedule of least peak
  with at most ``levels`` levels of nesting (each level one more forward
  recomputation): ``depth`` layers fit in peak ``p`` with ``l`` levels if
  ``depth <= C(p + l, l + 1)``, the binomial bound of Revolve (Griewank & Walther
  2000), i.e. peak ``~ sqrt(2 N)`` with one level and ``~ (6 N) ** (1/3)`` with two.

  Identical consecutive children (``(4, 4, 4, 4)``, the int ``segments`` path) run as
  one outer scan, compiled once; it keeps all their inputs stacked until its
  backward ends (one input more than the model when it starts the tuple). Any other
  child runs on its own, under ``jax.checkpoint(prevent_cse=True)`` inside a
  ``lax.cond`` that XLA cannot fold away: that keeps each child's recomputed layer
  inputs in its own backward step (on XLA:CPU they were otherwise all allocated at
  the start), for a few input-sized copies per child. Where the layer inputs are
  large next to the parameters, each level lowers compiled temp memory further
  (``tests/test_scan_schedules.py`` checks flat > equal groups > ``levels=1`` >
  ``levels=2`` at depth 32; docs/memory.md lists the figures).

  Unequal children cut the stacked parameters with ``lax.split``, whose backward
  concatenates the children's parameter gradients: a temp buffer about the size of the
  stack's parameters, which equal groups (a free reshape) do not pay. So a schedule
  pays off where the layer inputs dwarf the parameters, and not where the parameters
  are as large as the layer inputs or larger (as in the 16-block models of
  ``benchmarks/``, where flat stays smallest). :func:`remat.plan` measures every one
  of them and keeps the smallest or fastest that fits.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from remat.scan import scan_layers
  >>> def layer(p, x):
  ...     return jnp.tanh(x @ p["w"] + p["b"])
  >>> params = {"w": jnp.stack([jnp.eye(16)] * 8), "b": jnp.zeros((8, 16))}
  >>> y = scan_layers(layer, params, jnp.ones((4, 16)), policy="dots")
  >>> y.shape
  (4, 16)
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from remat.scan.layers import scan_layers
from remat.scan.nnx import scan_nnx_layers, stack_nnx_layers
from remat.scan.schedules import (
    Schedule,
    best_segments,
    binomial_schedule,
    schedule_peak,
    schedule_recomputes,
)

__all__ = [
    "LinenScanLayers",
    "Schedule",
    "best_segments",
    "binomial_schedule",
    "scan_layers",
    "scan_nnx_layers",
    "schedule_peak",
    "schedule_recomputes",
    "stack_nnx_layers",
]

if TYPE_CHECKING:
    # Imported on first access by the module's __getattr__ (below), so that importing
    # remat.scan does not import Flax Linen.
    from remat.scan.linen import LinenScanLayers


def __getattr__(name: str) -> Any:
    # Import the Linen module on first use so importing remat.scan does not import Linen.
    if name == "LinenScanLayers":
        from remat.scan.linen import LinenScanLayers

        globals()[name] = LinenScanLayers
        return LinenScanLayers
    raise AttributeError(f"module 'remat.scan' has no attribute {name!r}")

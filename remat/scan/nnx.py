"""Scan over layers for Flax NNX: stack_nnx_layers creates the stacked layer, scan_nnx_layers applies it."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from remat.scan.layers import _depth, _planned_run, _scan_plan, scan_layers
from remat.scan.schedules import Schedule

__all__ = ["scan_nnx_layers", "stack_nnx_layers"]


def stack_nnx_layers(make_layer: Callable[[Any], Any], depth: int, rngs: Any) -> Any:
    """Creates ``depth`` independently initialised copies of an NNX layer, stacked.

    Every parameter of the returned module has a leading axis of size ``depth``, as
    ``nnx.vmap`` over an init function produces (flax's "scan over layers" recipe).

    Args:
      make_layer: ``make_layer(rngs) -> nnx.Module``, e.g.
        ``lambda rngs: Block(256, rngs=rngs)``.
      depth: number of layers.
      rngs: an ``nnx.Rngs`` (split ``depth`` ways) or an int seed.

    Returns:
      One module whose state is the stacked state of ``depth`` layers; apply it with
      :func:`scan_nnx_layers`.

    Example:
      >>> from flax import nnx
      >>> layers = stack_nnx_layers(lambda r: nnx.Linear(8, 8, rngs=r), 4, nnx.Rngs(0))
      >>> layers.kernel[...].shape
      (4, 8, 8)
    """
    from flax import nnx

    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be a positive int, got {depth!r}")
    if isinstance(rngs, int):
        rngs = nnx.Rngs(rngs)

    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(r):
        return make_layer(r)

    return create(rngs)


def scan_nnx_layers(
    layers: Any,
    x: Any,
    *,
    policy: Any = "nothing",
    segments: int | Schedule | None = None,
    nested: bool = False,
    levels: int | None = None,
    call: Callable[[Any, Any], Any] | None = None,
) -> Any:
    """Applies a stacked NNX layer (from :func:`stack_nnx_layers`) with :func:`scan_layers`.

    The parameters (``nnx.Param``) are scanned over; any other state (batch statistics,
    RNG counts) is scanned too and written back into ``layers`` after the call, in
    layer order, so stateful layers behave as in an unrolled loop. Use it inside
    ``nnx.grad`` / ``nnx.jit`` like any module call.

    Args:
      layers: the stacked module.
      x: input of the first layer.
      policy, segments, nested, levels: as in :func:`scan_layers` (``segments`` may be
        a schedule tuple, ``levels`` picks :func:`binomial_schedule`).
      call: ``call(layer, x) -> x`` to run one layer; defaults to ``layer(x)``.

    Returns:
      The output of the last layer.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> layers = stack_nnx_layers(lambda r: nnx.Linear(8, 8, rngs=r), 4, 0)
      >>> y = scan_nnx_layers(layers, jnp.ones((2, 8)), policy="dots")
      >>> y2 = scan_nnx_layers(layers, jnp.ones((2, 8)), segments=(2, 1, 1))
    """
    from flax import nnx

    call = call or (lambda m, h: m(h))
    graphdef, params, rest = nnx.split(layers, nnx.Param, ...)
    has_rest = bool(jax.tree.leaves(rest))

    def layer(p, h):
        p_i, rest_i = p
        module = nnx.merge(graphdef, p_i, rest_i)
        h = call(module, h)
        if not has_rest:
            return h
        _, _, new_rest = nnx.split(module, nnx.Param, ...)
        return h, new_rest

    if not has_rest:
        return scan_layers(layer, (params, rest), x, policy=policy, segments=segments,
                           nested=nested, levels=levels)

    # Non-parameter state (batch stats, RNG counts): each layer returns its updated
    # slice as a scan output, stacked in layer order and written back after the loop.
    depth = _depth(params)
    policy, groups = _scan_plan(depth, policy, segments, nested, levels)

    def step(h, p):
        return layer(p, h)

    out, new_rest = _planned_run(depth, policy, groups, step, (params, rest), x, 1)
    nnx.update(layers, new_rest)
    return out

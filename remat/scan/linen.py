"""LinenScanLayers: a Flax Linen module that runs a layer class with nn.scan and nn.remat.

It imports Flax Linen; :mod:`remat.scan` imports this module only when
``remat.scan.LinenScanLayers`` is first used.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
from flax.core import FrozenDict

from remat._core.lowering import classic_remat
from remat.policies import is_no_checkpoint, resolve_policy
from remat.scan.schedules import _num_segments

__all__ = ["LinenScanLayers"]


def _linen_cell(layer_cls: type) -> type:
    """A subclass of ``layer_cls`` with ``nn.scan``'s ``(carry, x) -> (carry, y)`` call."""

    class Cell(layer_cls):  # type: ignore[misc, valid-type]
        def __call__(self, carry, _):  # noqa: D401
            return super().__call__(carry), None

    # Keep the layer's own name so parameter paths read like the unscanned module's.
    Cell.__name__ = Cell.__qualname__ = layer_cls.__name__
    return Cell


class LinenScanLayers(nn.Module):
    """``depth`` copies of a Linen layer class, run with ``nn.scan`` and ``nn.remat``.

    Parameters are stacked along axis 0 under ``"layers"`` (``variable_axes=
    {"params": 0}``, ``split_rngs={"params": True}``); with nesting, along the first
    two axes ``(segments, depth // segments)``.

    Attributes:
      layer_cls: a Linen module class whose ``__call__(x)`` returns an ``x``-like value.
      depth: number of layers.
      layer_kwargs: constructor arguments of ``layer_cls``.
      policy: per-layer checkpoint policy (as in :func:`scan_layers`; ``"no_checkpoint"``
        disables per-layer checkpointing).
      segments: number of equal checkpointed groups (must divide ``depth``). Schedule
        tuples (unequal groups) are not supported here (a ValueError says so); use
        :func:`scan_layers` or :func:`scan_nnx_layers` for them.
      nested: use :func:`best_segments` groups.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> class Block(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         return x + jnp.tanh(nn.Dense(x.shape[-1])(x))
      >>> m = LinenScanLayers(Block, depth=4, policy="dots")
      >>> v = m.init(jax.random.PRNGKey(0), jnp.ones((2, 8)))
    """

    layer_cls: Any
    depth: int
    layer_kwargs: Mapping[str, Any] = FrozenDict()
    policy: Any = "nothing"
    segments: int | None = None
    nested: bool = False

    @nn.compact
    def __call__(self, x):
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 1:
            raise ValueError(f"depth must be a positive int, got {self.depth!r}")
        if isinstance(self.segments, (tuple, list)):
            raise ValueError(
                f"LinenScanLayers(segments={self.segments!r}): Linen takes only None or an int "
                "number of equal groups; for an unequal schedule use scan_layers or scan_nnx_layers"
            )
        # built and traced as JAX's checkpoint primitive also under jax_remat3 (remat._core.lowering)
        with classic_remat():
            k = _num_segments(self.depth, self.segments, self.nested)
            cell = _linen_cell(self.layer_cls)
            if not is_no_checkpoint(self.policy):
                cell = nn.remat(cell, policy=resolve_policy(self.policy), prevent_cse=False)
            scan = lambda target, length: nn.scan(  # noqa: E731
                target, variable_axes={"params": 0}, split_rngs={"params": True}, length=length
            )
            kwargs = dict(self.layer_kwargs)
            if k is None:
                out, _ = scan(cell, self.depth)(name="layers", **kwargs)(x, None)
                return out
            inner = scan(cell, self.depth // k)

            class Group(nn.Module):
                @nn.compact
                def __call__(self, h, _):
                    h, _ = inner(name="layers", **kwargs)(h, None)
                    return h, None

            out, _ = scan(nn.remat(Group, prevent_cse=False), k)(name="groups")(x, None)
            return out

"""Splitting a call's arguments into traced arrays and values that pass through as they are.

PyTorch users pass strings, flags, ``None`` and callables to checkpointed functions
without marking them. ``jax.checkpoint`` would try to trace them, so ``remat`` traces
only array leaves (and, for Flax NNX, graph nodes such as modules and RNG streams) and
closes over the rest, which may then drive Python control flow.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx


def is_array(x: Any) -> bool:
    """True for values that ``jax.checkpoint`` should trace (jax/NumPy arrays and scalars)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def is_nnx_node(x: Any) -> bool:
    """True for Flax NNX graph nodes (modules, RNG streams, variables)."""
    return isinstance(x, (nnx.Pytree, nnx.Variable))


class _Static:
    """Marks a whole positional argument named in ``static_argnums``."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


@dataclass(frozen=True)
class SplitCall:
    """A call's arguments, split into traced leaves and a rebuild function."""

    dynamic: list[Any]
    rebuild: Callable[[Sequence[Any]], tuple[tuple, dict]]


def split_call(args: tuple, kwargs: dict, static_argnums: tuple[int, ...]) -> SplitCall:
    """Splits ``(args, kwargs)`` into the leaves to trace and a function that puts them back.

    Args:
      args: positional arguments of the call.
      kwargs: keyword arguments of the call.
      static_argnums: positions of arguments that are never traced, whatever they hold.

    Returns:
      A :class:`SplitCall`; ``rebuild(dynamic)`` returns ``(args, kwargs)`` with the given
      values in place of the traced leaves.
    """
    marked = tuple(_Static(a) if i in static_argnums else a for i, a in enumerate(args))
    leaves, treedef = jax.tree.flatten(
        (marked, kwargs), is_leaf=lambda x: isinstance(x, _Static) or is_nnx_node(x)
    )
    traced = [not isinstance(x, _Static) and (is_array(x) or is_nnx_node(x)) for x in leaves]
    dynamic = [x for x, t in zip(leaves, traced) if t]
    static = [None if t else x for x, t in zip(leaves, traced)]

    def rebuild(values: Sequence[Any]) -> tuple[tuple, dict]:
        it = iter(values)
        filled = [next(it) if t else s for s, t in zip(static, traced)]
        new_args, new_kwargs = jax.tree.unflatten(treedef, filled)
        new_args = tuple(a.value if isinstance(a, _Static) else a for a in new_args)
        return new_args, new_kwargs

    return SplitCall(dynamic, rebuild)


class OutputStore:
    """Lets a traced region return any pytree: arrays go through JAX, the rest is kept here.

    ``jax.checkpoint`` only returns arrays. The region's non-array outputs (``None``,
    strings, Python numbers) are recorded at trace time and put back afterwards.
    """

    def __init__(self) -> None:
        self._treedef = None
        self._static: list[Any] = []
        self._traced: list[bool] = []

    def pack(self, out: Any) -> list[Any]:
        leaves, self._treedef = jax.tree.flatten(out, is_leaf=is_nnx_node)
        for x in leaves:
            if is_nnx_node(x):
                raise TypeError(
                    "a checkpointed function returned a Flax NNX object "
                    f"({type(x).__name__}); return arrays (or pytrees of arrays) instead"
                )
        self._traced = [is_array(x) for x in leaves]
        self._static = [None if t else x for x, t in zip(leaves, self._traced)]
        return [x for x, t in zip(leaves, self._traced) if t]

    def unpack(self, arrays: Sequence[Any]) -> Any:
        it = iter(arrays)
        leaves = [next(it) if t else s for s, t in zip(self._static, self._traced)]
        return jax.tree.unflatten(self._treedef, leaves)

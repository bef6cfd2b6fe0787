"""Splitting a call's arguments into traced arrays and values that pass through as they are.

PyTorch users pass strings, flags, ``None`` and callables to checkpointed functions
without marking them. ``jax.checkpoint`` would try to trace them, so ``remat`` traces
only array leaves (and, for Flax NNX, graph nodes such as modules and RNG streams) and
closes over the rest, which may then drive Python control flow.
"""
from __future__ import annotations

from collections.abc import Sequence
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

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and bool(self.value == other.value)

    def __hash__(self) -> int:
        return hash((_Static, self.value))


def is_python_scalar(x: Any) -> bool:
    """Python ``bool``/``int``/``float``/``complex``: traced by ``jax.checkpoint``, weakly typed."""
    return isinstance(x, (bool, int, float, complex))


@dataclass(frozen=True)
class SplitCall:
    """A call's arguments, split into traced leaves and what is needed to put them back.

    ``static_key`` identifies everything that is not traced (the tree structure and the
    pass-through values); it is ``None`` when a pass-through value is not hashable.
    ``prevent_cse`` holds one flag per traced leaf.
    """

    dynamic: list[Any]
    treedef: Any
    static: tuple[Any, ...]
    traced: tuple[bool, ...]
    prevent_cse: tuple[bool, ...]

    @property
    def static_key(self) -> Any:
        try:
            key = (self.treedef, self.static, self.traced)
            hash(key)
        except TypeError:
            return None
        return key

    def rebuild(self, values: Sequence[Any]) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with ``values`` in place of the traced leaves."""
        it = iter(values)
        filled = [next(it) if t else s for s, t in zip(self.static, self.traced)]
        new_args, new_kwargs = jax.tree.unflatten(self.treedef, filled)
        new_args = tuple(a.value if isinstance(a, _Static) else a for a in new_args)
        return new_args, new_kwargs


def _is_split_leaf(x: Any) -> bool:
    return isinstance(x, _Static) or is_nnx_node(x)


def split_call(
    args: tuple, kwargs: dict, static_argnums: tuple[int, ...], *, trace_scalars: bool = False,
    prevent_cse: bool | tuple = True,
) -> SplitCall:
    """Splits ``(args, kwargs)`` into the leaves to trace and the rest.

    Args:
      args: positional arguments of the call.
      kwargs: keyword arguments of the call.
      static_argnums: positions of arguments that are never traced, whatever they hold.
      trace_scalars: trace Python ``bool``/``int``/``float``/``complex`` leaves (the
        decorator form, as ``jax.checkpoint``) instead of passing them through (the call form).
      prevent_cse: a bool, or ``jax.checkpoint``'s per-argument tuple: a prefix of the
        positional arguments that are not static (of ``(args, kwargs)`` when there are kwargs).

    Returns:
      A :class:`SplitCall`.
    """
    marked = tuple(_Static(a) if i in static_argnums else a for i, a in enumerate(args))
    leaves, treedef = jax.tree.flatten((marked, kwargs), is_leaf=_is_split_leaf)
    traced = tuple(
        not isinstance(x, _Static) and (is_array(x) or is_nnx_node(x) or (trace_scalars and is_python_scalar(x)))
        for x in leaves
    )
    if isinstance(prevent_cse, bool):
        flags = [prevent_cse] * len(leaves)
    else:
        cse_args: Any = tuple(a for i, a in enumerate(args) if i not in static_argnums)
        cse_args = (cse_args, kwargs) if kwargs else cse_args
        try:
            counts = jax.tree.map(lambda flag, sub: [flag] * len(jax.tree.leaves(sub, is_leaf=_is_split_leaf)),
                                  prevent_cse, cse_args)
            per_leaf = iter([f for fs in jax.tree.leaves(counts, is_leaf=lambda x: isinstance(x, list)) for f in fs])
        except ValueError:
            raise ValueError(
                f"prevent_cse={prevent_cse!r} is not a prefix of the non-static arguments; give one "
                "bool per positional argument (or a pytree prefix of each)"
            ) from None
        flags = [True if isinstance(x, _Static) else bool(next(per_leaf)) for x in leaves]
    return SplitCall(
        dynamic=[x for x, t in zip(leaves, traced) if t],
        treedef=treedef,
        static=tuple(None if t else x for x, t in zip(leaves, traced)),
        traced=traced,
        prevent_cse=tuple(f for f, t in zip(flags, traced) if t),
    )


class OutputStore:
    """Lets a traced region return any pytree: arrays go through JAX, the rest is kept here.

    ``jax.checkpoint`` only returns arrays. The region's non-array outputs (``None``,
    strings, Python numbers) are recorded when it is traced, under the signature of the
    inputs it was traced for, and put back after every call with that signature, also
    when JAX's trace cache means the region was not traced again.
    """

    def __init__(self) -> None:
        self._layouts: dict[Any, tuple[Any, list[Any], list[bool]]] = {}

    def pack(self, out: Any, signature: Any) -> list[Any]:
        leaves, treedef = jax.tree.flatten(out, is_leaf=is_nnx_node)
        for x in leaves:
            if is_nnx_node(x):
                raise TypeError(
                    "a checkpointed function returned a Flax NNX object "
                    f"({type(x).__name__}); return arrays (or pytrees of arrays) instead"
                )
        traced = [is_array(x) for x in leaves]
        self._layouts[signature] = (treedef, [None if t else x for x, t in zip(leaves, traced)], traced)
        return [x for x, t in zip(leaves, traced) if t]

    def has(self, signature: Any) -> bool:
        return signature in self._layouts

    def unpack(self, arrays: Sequence[Any], signature: Any) -> Any:
        treedef, static, traced = self._layouts[signature]
        it = iter(arrays)
        return jax.tree.unflatten(treedef, [next(it) if t else s for s, t in zip(static, traced)])


def signature(values: Sequence[Any]) -> Any:
    """What a trace of ``values`` depends on: their tree structure and abstract values."""
    leaves, treedef = jax.tree.flatten(values)
    return treedef, tuple(jax.typeof(x) for x in leaves)

"""Splitting a call's arguments into traced arrays and values that pass through as they are.

PyTorch users pass strings, flags, ``None`` and callables to checkpointed functions
without marking them. ``jax.checkpoint`` would try to trace them, so ``remat`` traces
only array leaves (and, for Flax NNX, graph nodes such as modules and RNG streams) and
closes over the rest, which may then drive Python control flow.
"""
from __future__ import annotations

import types
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


# Values that are their own key: immutable, compared by value, and never equal to a value of
# another of these types unless the type is part of the key (0 == False == 0.0).
_VALUE_TYPES = (type(None), bool, int, str, bytes, type(Ellipsis), range, slice)
# Code, keyed by identity as jax.checkpoint keys the function it wraps (a closure's captured
# values are the function's own, as under jax.jit).
_CODE_TYPES = (types.FunctionType, types.BuiltinFunctionType, types.ModuleType, type)


def cache_key(value: Any, *, by_identity: bool) -> Any:
    """``value`` as part of a trace-cache key: equal keys mean the same trace.

    The type is part of the key, as for ``jax.jit``'s static arguments, so ``0``, ``False``
    and ``0.0`` (equal in Python) are told apart; floats are keyed by their bits, so ``-0.0``
    and ``0.0`` are too. Containers are keyed element by element. An object whose class
    defines ``__hash__`` is trusted to compare by value (frozen dataclasses, enums, dtypes).

    Args:
      value: a value that is not traced.
      by_identity: how to key an object hashed by identity (a plain class instance, whose
        attributes can change between calls): by identity, ``jax.jit``'s rule for
        ``static_argnums``, or not at all.

    Returns:
      A hashable key.

    Raises:
      TypeError: ``value`` is unhashable, or hashed by identity and ``by_identity`` is
        false: the call cannot be served from a cache and is traced afresh.
    """
    kind = type(value)
    if kind in _VALUE_TYPES or isinstance(value, _CODE_TYPES):
        return kind, value
    if kind is float:
        return kind, value.hex()
    if kind is complex:
        return kind, value.real.hex(), value.imag.hex()
    if isinstance(value, (tuple, list)):
        return kind, tuple(cache_key(v, by_identity=by_identity) for v in value)
    if isinstance(value, dict):
        return kind, tuple((cache_key(k, by_identity=by_identity), cache_key(v, by_identity=by_identity))
                           for k, v in value.items())
    if isinstance(value, (set, frozenset)):
        return kind, frozenset(cache_key(v, by_identity=by_identity) for v in value)
    if isinstance(value, types.MethodType):  # a bound method is as current as its object
        return kind, value.__func__, cache_key(value.__self__, by_identity=by_identity)
    if kind.__hash__ is object.__hash__ and not by_identity:
        raise TypeError(f"{kind.__name__} is hashed by identity")
    hash(value)
    return kind, value


def is_python_scalar(x: Any) -> bool:
    """Python ``bool``/``int``/``float``/``complex``: traced by ``jax.checkpoint``, weakly typed."""
    return isinstance(x, (bool, int, float, complex))


@dataclass(frozen=True)
class SplitCall:
    """A call's arguments, split into traced leaves and what is needed to put them back.

    ``static_key`` identifies everything that is not traced (the tree structure and the
    pass-through values, see :func:`cache_key`); it is ``None`` when they cannot be keyed,
    and the call is then traced afresh.
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
            static = tuple(
                None if t else ("static", cache_key(s.value, by_identity=True)) if isinstance(s, _Static)
                else cache_key(s, by_identity=False)
                for s, t in zip(self.static, self.traced)
            )
            key = (self.treedef, static, self.traced)
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

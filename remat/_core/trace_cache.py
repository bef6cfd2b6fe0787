"""Checkpointed regions as JAX sees them: one region object per distinct call, so traces are cached.

A region is the untraced part of one checkpointed call: what JAX must not be asked to trace
again when it recurs. The trace cache follows ``jax.checkpoint``'s rules:

* the function is keyed by identity and held weakly, as ``jax.checkpoint`` holds the function
  it wraps: a region and its traces live only as long as the function does. A bound method
  is keyed by its own object, so ``checkpoint(obj.method, x)`` (a new bound method each call)
  is traced afresh each call, reading the object as it is now; an NNX module or method is
  keyed by its class or function, because its state is a traced input;
* the values that are not traced are keyed by type and value, as ``jax.jit``'s static
  arguments are (:func:`remat._core.arguments.cache_key`); a value that cannot be keyed (an
  object hashed by identity, whose attributes may have changed) makes the call uncached;
* the traced inputs are keyed by JAX itself, on their tree structure and abstract values.

Equal calls get the same :class:`Region` object, whose checkpointed callers carry JAX's trace
cache and whose :class:`~remat._core.arguments.OutputStore` holds the non-array outputs
recorded when the region was traced.
"""
from __future__ import annotations

import contextvars
import dataclasses
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from remat._core import flax_adapters as _flax
from remat._core.arguments import OutputStore, SplitCall, is_python_scalar
from remat._core.lowering import classic_checkpoint, classic_remat, in_classic_remat, mark_region

# A warning, once per function, when Python scalars passed through the call form have made
# this many different traces.
SCALAR_VARIANTS_WARNING = 8

# Bounds: distinct static variants kept per function, and option sets kept per region (a
# residual budget's per-region policies are new objects per budget).
_MAX_VARIANTS = 256
_MAX_CALLERS = 16


@dataclasses.dataclass(frozen=True)
class ActiveCall:
    """What the region being called runs: set for the duration of one checkpointed call.

    A region holds no reference to the user's function or module: the call in progress
    supplies them, so a cached region never keeps them alive, nor runs a stale copy.
    """

    function: Any
    rebind: Callable[[Sequence[Any]], Callable[..., Any]] | None
    num_nodes: int
    call: SplitCall
    signature: Any


ACTIVE_CALL: contextvars.ContextVar[ActiveCall] = contextvars.ContextVar("remat_active_call")


class Region:
    """The untraced part of a checkpointed call, compared by identity.

    Calling it (as JAX does when it traces) runs the active call's function on the traced
    leaves and records the non-array outputs in :attr:`store`.
    """

    __name__ = "checkpointed_region"  # for JAX's debug info

    def __init__(self) -> None:
        self.store = OutputStore()
        self._callers: OrderedDict[Any, Callable[..., Any]] = OrderedDict()

    def __call__(self, *dynamic: Any) -> Any:
        now = ACTIVE_CALL.get()
        nodes, leaves = dynamic[:now.num_nodes], dynamic[now.num_nodes:]
        target = now.rebind(nodes) if now.rebind is not None else now.function
        args, kwargs = now.call.rebuild(leaves)
        return self.store.pack(target(*args, **kwargs), now.signature)

    def caller(self, policy: Any, prevent_cse: bool | tuple[bool, ...], nnx_mode: str | None) -> Callable[..., Any]:
        """This region under ``jax.checkpoint`` (``nnx.remat`` with NNX nodes), one per option set.

        ``nnx_mode``: ``None`` without Flax NNX nodes; ``"in place"`` or ``"changed only"``
        (see :func:`remat._core.flax_adapters.nnx_remat`) with them. JAX caches the traces
        on the returned callable, which lives as long as this region.
        """
        key = (policy, prevent_cse, nnx_mode)
        found = self._callers.get(key)
        if found is not None:
            self._callers.move_to_end(key)
            return found
        if nnx_mode is not None:
            with classic_remat():  # nnx.remat builds its jax.checkpoint now
                made = in_classic_remat(_flax.nnx_remat(self, policy=policy, prevent_cse=prevent_cse,
                                                        in_place=nnx_mode == "in place"))
        else:
            made = classic_checkpoint(self, policy=mark_region(policy), prevent_cse=prevent_cse)
        if len(self._callers) >= _MAX_CALLERS:
            self._callers.popitem(last=False)
        self._callers[key] = made
        return made


@dataclasses.dataclass
class _Anchored:
    """The regions of one function, and the pass-through Python numbers it was called with."""

    held: Any  # a weak reference to the function (the function itself if it cannot have one)
    variants: OrderedDict[Any, Region] = dataclasses.field(default_factory=OrderedDict)
    scalar_sets: set = dataclasses.field(default_factory=set)


class RegionTable:
    """Interned regions: per function (held weakly), one :class:`Region` per static key."""

    def __init__(self) -> None:
        self._by_anchor: dict[int, _Anchored] = {}

    def region(self, anchor: Any, key: Any) -> Region:
        """The region of calls of ``anchor`` with static ``key``; ``key`` None: a new, uncached one."""
        if key is None:
            return Region()
        variants = self._entry(anchor).variants
        found = variants.get(key)
        if found is not None:
            variants.move_to_end(key)
            return found
        if len(variants) >= _MAX_VARIANTS:
            variants.popitem(last=False)
        variants[key] = made = Region()
        return made

    def _entry(self, anchor: Any) -> _Anchored:
        entry = self._by_anchor.get(id(anchor))
        if entry is None or _deref(entry.held) is not anchor:
            entry = self._by_anchor[id(anchor)] = _Anchored(self._hold(anchor))
        return entry

    def _hold(self, anchor: Any) -> Any:
        ident = id(anchor)

        def forget(ref: Any, table: dict = self._by_anchor) -> None:
            entry = table.get(ident)
            if entry is not None and entry.held is ref:
                del table[ident]

        try:
            return weakref.ref(anchor, forget)
        except TypeError:  # not weakly referenceable (builtins): long-lived, held as it is
            return anchor

    def __len__(self) -> int:
        return sum(len(entry.variants) for entry in self._by_anchor.values())

    def count_scalar_variants(self, anchor: Any, function: Any, call: SplitCall) -> None:
        """Warns once per function when pass-through Python scalars have made many traces."""
        scalars = tuple((type(x), x) for x in call.static if is_python_scalar(x))
        if not scalars:
            return
        seen = self._entry(anchor).scalar_sets
        if len(seen) > SCALAR_VARIANTS_WARNING:
            return
        seen.add(scalars)
        if len(seen) > SCALAR_VARIANTS_WARNING:
            name = getattr(function, "__qualname__", type(function).__name__)
            warnings.warn(
                f"remat.checkpoint({name}, ...) was traced for {len(seen)} different values of its Python "
                "number arguments, which the call form passes through untraced (as PyTorch does); pass "
                "numbers that change as jnp.asarray(v), or use the decorator form, which traces them",
                RuntimeWarning, stacklevel=4,
            )


def _deref(held: Any) -> Any:
    return held() if isinstance(held, weakref.ref) else held


REGIONS = RegionTable()

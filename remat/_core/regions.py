"""Checkpointed regions as JAX sees them: one static region object per call, so traces are cached.

A region is the untraced part of one checkpointed call (the function and the static
structure of its arguments). Equal regions are interned, so that JAX's own trace cache
serves repeated calls, and the output store filled by the trace is found again.
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax

from remat._core import flax_adapters as _flax
from remat._core.arguments import OutputStore, SplitCall, is_python_scalar
from remat._core.lowering import mark_region

# The signature of the inputs of the region being called, for its OutputStore.
CALL_SIGNATURE: contextvars.ContextVar[Any] = contextvars.ContextVar("remat_call_signature")

# A warning, once per function, when Python scalars passed through the call form have made
# this many different traces.
SCALAR_VARIANTS_WARNING = 8


class Region:
    """One checkpointed call's untraced part: the function and the arguments' static structure.

    It is the static argument of the cached ``jax.checkpoint``/``nnx.remat`` callables, so
    JAX's own trace cache recognizes a repeated call: equal regions (the same function, the
    same pass-through values and structure) share one trace per input signature.
    """

    def __init__(self, function: Any, rebind: Any, num_nodes: int, call: SplitCall, key: Any):
        # With NNX nodes the function is rebound to the region's copies of them, so the
        # original module is not kept (nor, under nnx transforms, its traced state).
        self.function = None if num_nodes else function
        self.rebind = rebind
        self.num_nodes = num_nodes
        self.call = dataclasses.replace(call, dynamic=[])  # never keep the traced values
        self.store = OutputStore()
        self._key = key

    def __eq__(self, other: object) -> bool:
        if self._key is None or not isinstance(other, Region):
            return self is other
        return self._key == other._key

    def __hash__(self) -> int:
        return id(self) if self._key is None else hash(self._key)

    def __call__(self, *dynamic: Any) -> Any:
        nodes, leaves = dynamic[:self.num_nodes], dynamic[self.num_nodes:]
        target = self.rebind(nodes) if self.num_nodes else self.function
        args, kwargs = self.call.rebuild(leaves)
        return self.store.pack(target(*args, **kwargs), CALL_SIGNATURE.get())


# Interned regions: equal calls get the same Region object, so that the OutputStore filled
# when JAX traced it is the one read on later calls that JAX serves from its cache.
_REGIONS: dict[Any, Region] = {}
_MAX_REGIONS = 4096


def interned(region: Region) -> Region:
    if region._key is None:
        return region
    found = _REGIONS.get(region._key)
    if found is not None:
        return found
    if len(_REGIONS) >= _MAX_REGIONS:
        _REGIONS.pop(next(iter(_REGIONS)))
    _REGIONS[region._key] = region
    return region


def call_region(static: Region, *dynamic: Any) -> Any:
    return static(*dynamic)


# Bounded: per-region policies (a residual budget's choices) are new objects per budget.
@functools.lru_cache(maxsize=256)
def checkpointed_caller(policy: Any, prevent_cse: bool | tuple[bool, ...], nnx_mode: str | None) -> Callable[..., Any]:
    """The checkpointed caller of regions, one per option set, so that JAX caches traces.

    ``nnx_mode``: ``None`` without Flax NNX nodes; ``"in place"`` or ``"changed only"``
    (see :func:`remat._core.flax_adapters.nnx_remat`) with them.
    """
    if nnx_mode is not None:
        return _flax.nnx_remat(call_region, policy=policy, prevent_cse=prevent_cse,
                               in_place=nnx_mode == "in place")
    return jax.checkpoint(call_region, static_argnums=(0,), policy=mark_region(policy),
                          prevent_cse=prevent_cse)


_scalar_variants: dict[Any, set] = {}


def count_scalar_variants(function: Any, call: SplitCall) -> None:
    """Warns once per function when pass-through Python scalars have made many traces."""
    scalars = tuple(x for x in call.static if is_python_scalar(x))
    if not scalars:
        return
    key = _flax.function_key(function)
    if len(_scalar_variants) >= _MAX_REGIONS:
        _scalar_variants.clear()
    seen = _scalar_variants.setdefault(key, set())
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

"""``checkpoint_sequential``: PyTorch's function, with PyTorch's exact segmentation."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
from flax import nnx

from remat._core import flax_adapters as _flax
from remat._core.dispatch import run_region
from remat._core.hooks import current
from remat._core.options import KEYWORDS, normalize_options

# The options of remat.checkpoint that checkpoint_sequential passes on (not static_argnums).
_OPTION_NAMES = frozenset(KEYWORDS) - {"use_reentrant", "static_argnums"}

__all__ = ["checkpoint_sequential", "segment_bounds"]


def segment_bounds(num_functions: int, segments: int) -> list[tuple[int, int]]:
    """Half-open ``[start, end)`` index ranges of the checkpointed segments.

    The same boundaries as ``torch.utils.checkpoint.checkpoint_sequential``: ``segments - 1``
    checkpointed chunks of ``num_functions // segments`` functions each; the remaining
    functions (the last segment, which is at least as long) run without checkpoint,
    because the backward pass starts from them anyway.

    Example:
      >>> segment_bounds(10, 3)
      [(0, 3), (3, 6)]
    """
    size = num_functions // segments
    return [(start, start + size) for start in range(0, size * (segments - 1), size)]


def _layers(functions: Any) -> list[Callable[..., Any]]:
    if isinstance(functions, nnx.Sequential):
        return list(functions.layers)
    if isinstance(functions, nn.Sequential):
        if functions.scope is None:
            raise TypeError(
                "checkpoint_sequential got an unbound Linen nn.Sequential: call it inside "
                "the parent module's __call__ (with the Sequential defined in setup())"
            )
        return list(functions.layers)
    if isinstance(functions, Sequence) and not isinstance(functions, (str, bytes)):
        # lists, tuples, nnx.List and other sequences of layers
        return list(functions)
    raise TypeError(
        "checkpoint_sequential expects a list or tuple of callables, an nnx.Sequential or a "
        f"Linen nn.Sequential, got {type(functions).__name__}"
    )


def checkpoint_sequential(
    functions: Sequence[Callable[..., Any]] | nnx.Sequential | nn.Sequential,
    segments: int,
    input: Any,
    use_reentrant: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Runs ``functions`` one after another on ``input``, checkpointing ``segments - 1`` chunks.

    Args:
      functions: a list/tuple of one-argument callables, an ``nnx.Sequential``, or a bound
        Linen ``nn.Sequential`` (or list of its layers) inside a parent's ``__call__``.
      segments: number of chunks, ``1 <= segments <= len(functions)``. With ``segments=1``
        nothing is checkpointed, exactly as in PyTorch.
      input: the input of the first function.
      use_reentrant: as in :func:`remat.checkpoint`.
      **kwargs: further options of :func:`remat.checkpoint` (``policy``,
        ``preserve_rng_state``, ``debug``, ...).

    Returns:
      The output of the last function.

    Example:
      >>> import jax.numpy as jnp
      >>> layers = [jnp.sin, jnp.cos, jnp.tanh, jnp.exp]
      >>> y = checkpoint_sequential(layers, 2, jnp.ones(3))  # sin, cos checkpointed
    """
    layers = _layers(functions)
    decide = current().sequential  # a planner's choice (remat._core.hooks), checked like the caller's
    if decide is not None:
        segments = decide(len(layers), segments)
    if not isinstance(segments, int) or isinstance(segments, bool):
        raise TypeError(f"segments must be an int, got {type(segments).__name__}")
    if not 1 <= segments <= len(layers):
        raise ValueError(
            f"segments={segments} must be between 1 and the number of functions ({len(layers)})"
        )
    for i, f in enumerate(layers):
        if not callable(f):
            raise TypeError(f"checkpoint_sequential: functions[{i}] is not callable ({type(f).__name__})")
    if "static_argnums" in kwargs:
        raise TypeError(
            "checkpoint_sequential does not take static_argnums: each function gets one input, "
            "which must be traced; close over static values instead (functools.partial)"
        )
    unknown = sorted(set(kwargs) - _OPTION_NAMES)
    if unknown:
        raise TypeError(
            f"checkpoint_sequential got unexpected keyword argument(s) {', '.join(unknown)}; "
            f"it accepts {', '.join(sorted(_OPTION_NAMES))}"
        )
    opts = normalize_options(use_reentrant=use_reentrant, **kwargs)

    bounds = segment_bounds(len(layers), segments)
    parent = _linen_parent(layers)
    for start, end in bounds:
        chunk = layers[start:end]
        if parent is not None:
            input = _flax.linen_call_children(parent, chunk, _run_chunk, opts, input)
        else:
            # the chunk is an argument: NNX modules in it carry their state into the region,
            # and equal chunks of plain functions share one trace
            input = run_region(_run_chunk, opts, (chunk, input), {})
    last = bounds[-1][1] if bounds else 0
    return _run_chunk(layers[last:], input)


def _run_chunk(chunk: list[Callable[..., Any]], x: Any) -> Any:
    for f in chunk:
        x = f(x)
    return x


def _linen_parent(layers: list[Any]) -> nn.Module | None:
    linen = [f for f in layers if isinstance(f, nn.Module)]
    if not linen:
        return None
    parents = {id(f.parent) for f in linen}
    # Plain callables (nn.tanh, jnp.sin) may sit between the layers, as in nn.Sequential.
    if len(parents) != 1 or not isinstance(linen[0].parent, nn.Module):
        raise TypeError(
            "checkpoint_sequential over Linen layers needs all of them to be submodules of one "
            "parent (an nn.Sequential or a list defined in setup())"
        )
    return linen[0].parent

"""``remat.apply_checkpointing``: checkpoint the submodules of a Flax model you did not write.

The counterpart of torch.distributed's ``apply_activation_checkpointing`` and of
HuggingFace's ``gradient_checkpointing_enable``. Each call of a selected submodule (its
``__call__`` or any other method its classes define) becomes one ordinary
:func:`remat.checkpoint` region, so the planner re-decides it like a hand-written one.
Both frameworks get the model back, and each call replaces what an earlier one
checkpointed: NNX in place (:mod:`remat._core.apply_nnx`), Linen as a new module or class
(:mod:`remat._core.apply_linen`).
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from remat._core import apply_linen, apply_nnx, hooks
from remat._core.apply_selected import Applied, Path, Selector, take_entering_path
from remat._core.options import KEYWORDS, CheckpointOptions, normalize_options

CheckFn = Callable[..., bool]

# remat.checkpoint's keywords besides policy=
_CHECKPOINT_KEYWORDS = frozenset(KEYWORDS) - {"policy"}

__all__ = ["apply_checkpointing", "checkpointed", "region_paths", "remove_checkpointing"]


def apply_checkpointing(model: Any, check_fn: CheckFn | type | tuple[type, ...], *, policy: Any = None,
                        every: int = 1, **checkpoint_kwargs: Any) -> Any:
    """Checkpoints every submodule for which ``check_fn`` is true, without editing the model's source.

    A selected submodule is checkpointed whatever calls it: each call of its ``__call__``, or
    of any other method its classes define (``encode``, ``attend``; not ``setup``, nor Flax's
    own ``Module`` methods), is one region. Each call of ``apply_checkpointing`` replaces what
    an earlier one checkpointed, as HuggingFace's ``gradient_checkpointing_enable`` does.

    Args:
      model: an NNX module (changed in place), or a Linen module instance or class (the
        given one is left as it is).
      check_fn: ``check_fn(path, module) -> bool`` (a one-argument ``check_fn(module)``,
        as torch's ``apply_activation_checkpointing`` takes, works too), or a class or a
        tuple of classes, meaning ``isinstance(module, classes)``. NNX paths are those of
        ``nnx.iter_graph`` (``("blocks", 0)``); Linen paths are ``module.path``.
      policy: what each region may keep, as in :func:`remat.checkpoint` (``None``, the
        default: only its inputs, as PyTorch does).
      every: checkpoint the 1st, (k+1)-th, (2k+1)-th ... match only (like HF's
        ``every_n_layers``); NNX counts matches in ``nnx.iter_graph`` order, Linen in the
        order their first call is traced.
      **checkpoint_kwargs: the other keywords of :func:`remat.checkpoint`
        (``prevent_cse``, ``static_argnums``, ``use_reentrant``, ...).

    Returns:
      The model: for NNX the same object, changed in place; for Linen a new module (or
      class) of the same name and fields. :func:`checkpointed` lists what it checkpoints.

    Example:
      >>> model = apply_checkpointing(model, Block, policy="dots")  # doctest: +SKIP
      >>> remat.checkpointed(model)                                  # doctest: +SKIP
      [(('blocks', 0), 'dots'), (('blocks', 1), 'dots')]
    """
    unknown = sorted(set(checkpoint_kwargs) - _CHECKPOINT_KEYWORDS)
    if unknown:
        raise TypeError(f"apply_checkpointing() got an unexpected keyword {unknown[0]!r}; it takes "
                        f"remat.checkpoint's: policy, {', '.join(sorted(_CHECKPOINT_KEYWORDS))}")
    opts = normalize_options(policy=policy, **checkpoint_kwargs)  # a misspelled policy raises here
    select = _selector(check_fn)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"apply_checkpointing(every={every!r}): use an int >= 1 (1 checkpoints every match)")
    if isinstance(model, nnx.Module):
        apply_nnx.apply(model, select, Applied(opts, policy, _options_key(policy, checkpoint_kwargs)), every)
        return model
    if isinstance(model, nn.Module) or (isinstance(model, type) and issubclass(model, nn.Module)):
        return apply_linen.apply(model, select, Applied(opts, policy), every)
    raise TypeError(_not_a_model(model))


def remove_checkpointing(model: Any) -> Any:
    """Undoes :func:`apply_checkpointing`.

    Args:
      model: an NNX module (restored in place) or a Linen module or class it returned.

    Returns:
      The model as it was: for NNX the same object; for Linen the original module or class.
    """
    if isinstance(model, nnx.Module):
        apply_nnx.remove(model)
        return model
    if isinstance(model, nn.Module) or (isinstance(model, type) and issubclass(model, nn.Module)):
        return apply_linen.remove(model)
    raise TypeError(f"remove_checkpointing() takes a Flax NNX or Linen module, got {type(model).__name__}")


def checkpointed(model: Any) -> list[tuple[Path, Any]]:
    """What :func:`apply_checkpointing` checkpointed: ``(path, policy)`` pairs.

    The policy is the one asked for, as it was given: ``None`` is remat's default (each region
    keeps only its inputs, as PyTorch does), ``"dots"`` is ``"dots"``. For a Linen module or
    class, the submodules selected when it was last traced (``init``/``apply``); empty before that.

    Example:
      >>> remat.checkpointed(remat.apply_checkpointing(model, Block))  # doctest: +SKIP
      [(('blocks', 0), None), (('blocks', 1), None)]
    """
    if isinstance(model, nnx.Module):
        return apply_nnx.checkpointed(model)
    if isinstance(model, nn.Module) or (isinstance(model, type) and issubclass(model, nn.Module)):
        return apply_linen.checkpointed(model)
    raise TypeError(f"checkpointed() takes a Flax NNX or Linen module, got {type(model).__name__}")


def region_paths(step_fn: Callable[..., Any], *args: Any) -> list[Path | None]:
    """The module path of every checkpointed region one trace of ``step_fn(*args)`` goes through.

    In trace order, which is the order of the per-region choices of :func:`remat.plan`
    (``plan.chosen.policies``), so ``zip(region_paths(loss, *args), plan.chosen.policies)``
    says, per module, whether the plan checkpoints it and how. ``None`` marks a region
    written by hand (a :func:`remat.checkpoint` call) rather than applied. Regions written
    with ``jax.checkpoint``, ``nnx.remat`` or ``nn.remat`` are not listed here; a plan's
    ``region_paths`` names every region it decides, those too.

    Example:
      >>> dict(zip(region_paths(loss, params, x), p.chosen.policies))  # doctest: +SKIP
      {('blocks', 0): 'nothing', ('blocks', 1): 'no_checkpoint', ...}
    """
    paths: list[Path | None] = []

    def record(opts: CheckpointOptions) -> CheckpointOptions:
        paths.append(take_entering_path())
        return opts

    with hooks.deciding(region=record):
        jax.make_jaxpr(lambda *a: step_fn(*a))(*args)  # a fresh function: JAX's cache would skip the trace
    return paths


# --- selection -------------------------------------------------------------------------

def _selector(check_fn: Any) -> Selector:
    """``check_fn`` as ``(path, module) -> bool``; classes mean isinstance."""
    if isinstance(check_fn, type) or (isinstance(check_fn, tuple) and check_fn
                                      and all(isinstance(c, type) for c in check_fn)):
        return lambda path, module: isinstance(module, check_fn)
    if not callable(check_fn):
        raise TypeError(f"apply_checkpointing(check_fn=...) takes check_fn(path, module) -> bool, a class or "
                        f"a tuple of classes, got {type(check_fn).__name__}")
    if _takes_one_argument(check_fn):
        return lambda path, module: bool(check_fn(module))
    return lambda path, module: bool(check_fn(path, module))


def _takes_one_argument(fn: Any) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 1 and not any(p.kind == p.VAR_POSITIONAL for p in params)


def _not_a_model(model: Any) -> str:
    """The one-line error for something that is not a Flax model, naming the fix."""
    made = model.func if isinstance(model, functools.partial) else model
    if isinstance(made, type) and issubclass(made, (nn.Module, nnx.Module)):
        kind = "Linen" if issubclass(made, nn.Module) else "NNX"
        if made is not model:  # how Flax's ImageNet example exports ResNet18 = partial(ResNet, ...)
            return (f"apply_checkpointing() got functools.partial({made.__name__}, ...), not a model: build the "
                    f"{kind} module first (model = the_partial(...)) and pass model")
        return (f"apply_checkpointing() got the NNX class {made.__name__}: build the model first and pass it "
                f"(NNX models are changed in place)")
    hint = "; wrap functions with remat.checkpoint instead" if callable(model) else ""
    return (f"apply_checkpointing() takes a Flax NNX module or a Linen module or class, got "
            f"{type(model).__name__}{hint}")


def _options_key(policy: Any, kwargs: dict[str, Any]) -> Any:
    """A hashable key of the options as spelled, or None when unhashable."""
    def frozen(v: Any) -> Any:  # a list as (list, items): checkpointed() shows the spelling asked for
        return (type(v), tuple(frozen(x) for x in v)) if isinstance(v, (list, tuple)) else v

    key = (frozen(policy), tuple(sorted((k, frozen(v)) for k, v in kwargs.items())))
    try:
        hash(key)
    except TypeError:
        return None
    return key

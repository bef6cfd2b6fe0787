"""``remat.apply_checkpointing``: checkpoint the submodules of a Flax model you did not write.

The counterpart of torch.distributed's ``apply_activation_checkpointing`` and of
HuggingFace's ``gradient_checkpointing_enable``. Each selected submodule's ``__call__``
becomes one ordinary :func:`remat.checkpoint` region, so the planner re-decides it like a
hand-written one.

* **NNX**, in place: each selected module's class is swapped for a generated subclass
  (same name) whose ``__call__`` runs the original as a region. Only the class changes:
  no attribute, no Variable, so ``nnx.state`` paths stay the same, and the class travels
  in the graphdef through ``nnx.split``/``merge`` and every nnx transform.
* **Linen**: a module (or class) of a generated subclass (same name, same fields) whose
  ``__call__`` intercepts the ``__call__`` of every selected submodule
  (``nn.intercept_methods``) and runs it lifted over the submodule's scope, so parameter
  names are unchanged and the model's source is never needed.
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from remat._core import hooks
from remat._core.checkpoint import CheckpointOptions, _run, normalize_options
from remat._core.flax_adapters import linen_method

Path = tuple[Any, ...]
CheckFn = Callable[..., bool]

# remat.checkpoint's keywords besides policy=
_CHECKPOINT_KEYWORDS = frozenset(inspect.signature(normalize_options).parameters) - {"policy"}

__all__ = ["apply_checkpointing", "checkpointed", "region_paths", "remove_checkpointing"]

# the path of the module whose region is being entered, for the planner's region deciders
_REGION_PATH: contextvars.ContextVar[Path | None] = contextvars.ContextVar("remat_region_path", default=None)


def apply_checkpointing(model: Any, check_fn: CheckFn | type | tuple[type, ...], *, policy: Any = None,
                        every: int = 1, **checkpoint_kwargs: Any) -> Any:
    """Checkpoints every submodule for which ``check_fn`` is true, without editing the model's source.

    Args:
      model: an NNX module (changed in place), or a Linen module instance or class (a
        new one is returned; the given one is left as it is).
      check_fn: ``check_fn(path, module) -> bool`` (a one-argument ``check_fn(module)``,
        as torch's ``apply_activation_checkpointing`` takes, works too), or a class or a
        tuple of classes, meaning ``isinstance(module, classes)``. NNX paths are those of
        ``nnx.iter_graph`` (``("blocks", 0)``); Linen paths are ``module.path``.
      policy: what each region may keep, as in :func:`remat.checkpoint` (``None``: only
        its inputs, as PyTorch does).
      every: checkpoint the 1st, (k+1)-th, (2k+1)-th ... match only (like HF's
        ``every_n_layers``); NNX counts matches in ``nnx.iter_graph`` order, Linen in the
        order their first call is traced.
      **checkpoint_kwargs: the other keywords of :func:`remat.checkpoint`
        (``prevent_cse``, ``static_argnums``, ``use_reentrant``, ...).

    Returns:
      NNX: the paths checkpointed (a second call with the same options changes nothing
      and returns the same paths). Linen: the rematerialized module or class.

    Example:
      >>> paths = apply_checkpointing(model, Block, policy="dots")  # doctest: +SKIP
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
        return _apply_nnx(model, select, opts, every, _options_key(policy, checkpoint_kwargs))
    if isinstance(model, nn.Module) or (isinstance(model, type) and issubclass(model, nn.Module)):
        return _apply_linen(model, select, opts, every)
    raise TypeError(f"apply_checkpointing() takes a Flax NNX module or a Linen module or class, got "
                    f"{type(model).__name__}; wrap functions with remat.checkpoint instead")


def remove_checkpointing(model: Any) -> Any:
    """Undoes :func:`apply_checkpointing`.

    Args:
      model: an NNX module (restored in place) or a Linen module or class it returned.

    Returns:
      NNX: the paths that were checkpointed. Linen: the original module or class.
    """
    if isinstance(model, nnx.Module):
        restored = []
        for path, module in _nnx_modules(model):
            base = type(module).__dict__.get("_remat_base")
            if base is not None:
                object.__setattr__(module, "__class__", base)
                restored.append(path)
        return restored
    if isinstance(model, type) and issubclass(model, nn.Module):
        return model.__dict__.get("_remat_base", model)
    if isinstance(model, nn.Module):
        base = type(model).__dict__.get("_remat_base")
        return model if base is None else _linen_instance(model, base)
    raise TypeError(f"remove_checkpointing() takes a Flax NNX or Linen module, got {type(model).__name__}")


def checkpointed(model: Any) -> list[tuple[Path, str]]:
    """What :func:`apply_checkpointing` checkpointed: ``(path, policy)`` pairs.

    For a Linen module or class, the submodules selected when it was last traced
    (``init``/``apply``); empty before that.
    """
    if isinstance(model, nnx.Module):
        return [(path, type(m)._remat_options.policy_label) for path, m in _nnx_modules(model)
                if "_remat_base" in type(m).__dict__]
    cls = model if isinstance(model, type) else type(model)
    selection = cls.__dict__.get("_remat_selection") if issubclass(cls, nn.Module) else None
    if selection is None:
        if issubclass(cls, nn.Module):
            return []
        raise TypeError(f"checkpointed() takes a Flax NNX or Linen module, got {cls.__name__}")
    return list(selection.last_traced)


def region_paths(step_fn: Callable[..., Any], *args: Any) -> list[Path | None]:
    """The module path of every checkpointed region one trace of ``step_fn(*args)`` goes through.

    In trace order, which is the order of the per-region choices of :func:`remat.plan`
    (``plan.chosen.policies``), so ``zip(region_paths(loss, *args), plan.chosen.policies)``
    says, per module, whether the plan checkpoints it and how. ``None`` marks a region
    written by hand (a :func:`remat.checkpoint` call) rather than applied.

    Example:
      >>> dict(zip(region_paths(loss, params, x), p.chosen.policies))  # doctest: +SKIP
      {('blocks', 0): 'nothing', ('blocks', 1): 'no_checkpoint', ...}
    """
    paths: list[Path | None] = []

    def record(opts: CheckpointOptions) -> CheckpointOptions:
        paths.append(_REGION_PATH.get())
        return opts

    with hooks.deciding(region=record):
        jax.make_jaxpr(lambda *a: step_fn(*a))(*args)  # a fresh function: JAX's cache would skip the trace
    return paths


def _run_region(path: Path, function: Callable[..., Any], opts: CheckpointOptions, args: tuple,
                kwargs: dict) -> Any:
    """One applied region: remat.checkpoint's dispatch, with the module's path known to deciders."""
    token = _REGION_PATH.set(path)
    try:
        return _run(function, opts, args, kwargs)
    finally:
        _REGION_PATH.reset(token)


# --- selection -------------------------------------------------------------------------

def _selector(check_fn: Any) -> Callable[[Path, Any], bool]:
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


def _has_call(cls: type) -> bool:
    return any("__call__" in vars(k) for k in cls.__mro__ if k not in (object, nnx.Module, nn.Module))


def _no_match_warning(seen: set[str], stacklevel: int) -> None:
    warnings.warn(f"apply_checkpointing: check_fn matched no submodule; the model's module classes are "
                  f"{', '.join(sorted(seen)) or '(none)'}", UserWarning, stacklevel=stacklevel)


def _options_key(policy: Any, kwargs: dict[str, Any]) -> Any:
    """A hashable key of the options as spelled (lists become tuples), or None when unhashable."""
    def frozen(v: Any) -> Any:
        return tuple(frozen(x) for x in v) if isinstance(v, (list, tuple)) else v

    key = (frozen(policy), tuple(sorted((k, frozen(v)) for k, v in kwargs.items())))
    try:
        hash(key)
    except TypeError:
        return None
    return key


# --- NNX -------------------------------------------------------------------------------

def _nnx_modules(model: nnx.Module) -> list[tuple[Path, nnx.Module]]:
    """Every module of the graph once (a shared module at its first path), in iter_graph order."""
    return [(tuple(path), m) for path, m in nnx.iter_graph(model, graph=True) if isinstance(m, nnx.Module)]


# (base class, options key, path) -> generated subclass, so that equal options share one
# class (and so one graphdef: nnx.jit does not retrace for a re-applied model). The path is
# the class's, not an attribute's: the module's own attributes, and so its graph, stay as they are.
_NNX_CLASSES: dict[tuple[type, Any, Path], type] = {}


def _apply_nnx(model: nnx.Module, select: Callable[[Path, Any], bool], opts: CheckpointOptions,
               every: int, key: Any) -> list[Path]:
    matches, seen = [], set()
    for path, module in _nnx_modules(model):
        base = type(module).__dict__.get("_remat_base", type(module))
        seen.add(base.__name__)
        if select(path, module):
            matches.append((path, module, base))
    chosen = matches[::every]
    if not chosen:
        _no_match_warning(seen, stacklevel=3)
        return []
    missing = sorted({base.__name__ for _, _, base in chosen if not _has_call(base)})
    if missing:  # checked for all before any class is swapped: the model stays untouched
        raise TypeError(f"apply_checkpointing: {', '.join(missing)} has no __call__ to checkpoint; "
                        "select the modules that are called")
    for path, module, base in chosen:
        cls = _nnx_class(base, opts, key, path)
        if type(module) is not cls:
            object.__setattr__(module, "__class__", cls)
    return [path for path, _, _ in chosen]


def _nnx_class(base: type, opts: CheckpointOptions, key: Any, path: Path) -> type:
    cached = _NNX_CLASSES.get((base, key, path)) if key is not None else None
    if cached is not None:
        return cached
    call = base.__call__

    @functools.wraps(call)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        # the original __call__, bound to this module: remat.checkpoint's dispatch lifts it
        # with nnx.remat and rebinds it to the region's copy of the module
        return _run_region(path, call.__get__(self), opts, args, kwargs)

    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        # pickle names classes by module and name, which find the base class: pickle the
        # module as one of it, and swap the class again on load
        new, args, *rest = super(cls, self).__reduce_ex__(protocol)
        return (_unpickle_nnx, (new, (base, *args[1:]), opts, key, path), *rest)

    namespace = {"__call__": __call__, "__reduce_ex__": __reduce_ex__, "__module__": base.__module__,
                 "__qualname__": base.__qualname__, "__doc__": base.__doc__, "_remat_base": base,
                 "_remat_options": opts}
    cls = type(base.__name__, (base,), namespace, pytree=base._pytree__is_pytree)
    if key is not None:
        _NNX_CLASSES[(base, key, path)] = cls
    return cls


def _unpickle_nnx(new: Callable[..., Any], args: tuple, opts: CheckpointOptions, key: Any, path: Path) -> Any:
    module = new(*args)
    object.__setattr__(module, "__class__", _nnx_class(args[0], opts, key, path))
    return module


# --- Linen -----------------------------------------------------------------------------

@dataclasses.dataclass
class _LinenSelection:
    """What a generated Linen class checkpoints, and what its last trace selected."""

    select: Callable[[Path, Any], bool]
    opts: CheckpointOptions
    every: int
    last_traced: list[tuple[Path, str]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _LinenTrace:
    """One call of the root: the order of first calls of matches, and the classes seen."""

    order: dict[Path, int] = dataclasses.field(default_factory=dict)
    chosen: dict[Path, bool] = dataclasses.field(default_factory=dict)
    seen: set[str] = dataclasses.field(default_factory=set)


# the path of the submodule whose lifted copy is being entered: its call runs as it is
_ENTERING: contextvars.ContextVar[Path | None] = contextvars.ContextVar("remat_linen_entering", default=None)


def _apply_linen(model: Any, select: Callable[[Path, Any], bool], opts: CheckpointOptions, every: int) -> Any:
    given = model if isinstance(model, type) else type(model)
    base = given.__dict__.get("_remat_base", given)  # re-applying replaces, never nests
    if not _has_call(base):
        raise TypeError(f"apply_checkpointing: the Linen module {base.__name__} has no __call__")
    selection = _LinenSelection(select, opts, every)
    call = base.__call__

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        trace = _LinenTrace()
        with nn.intercept_methods(functools.partial(_intercept, selection, trace)):
            out = call(self, *args, **kwargs)
        if not trace.chosen or not any(trace.chosen.values()):
            _no_match_warning(trace.seen, stacklevel=2)
        selection.last_traced = [(p, opts.policy_label) for p, chosen in trace.chosen.items() if chosen]
        return out

    namespace = {"__call__": linen_method(functools.wraps(call)(__call__)), "__module__": base.__module__,
                 "__qualname__": base.__qualname__, "__doc__": base.__doc__, "_remat_base": base,
                 "_remat_selection": selection}
    cls = type(base.__name__, (base,), namespace)
    return cls if isinstance(model, type) else _linen_instance(model, cls)


def _linen_instance(model: nn.Module, cls: type) -> nn.Module:
    """``model``'s fields (as ``Module.clone`` copies them) in an instance of ``cls``."""
    return cls(**{f.name: getattr(model, f.name) for f in dataclasses.fields(model) if f.init})


def _intercept(selection: _LinenSelection, trace: _LinenTrace, next_fun: Callable[..., Any], args: tuple,
               kwargs: dict, context: Any) -> Any:
    if context.method_name != "__call__":
        return next_fun(*args, **kwargs)
    module = context.module
    path = tuple(module.path)
    if _ENTERING.get() == path:  # the lifted copy of a selected module: run its own call
        _ENTERING.set(None)
        return next_fun(*args, **kwargs)
    trace.seen.add(type(module).__dict__.get("_remat_base", type(module)).__name__)
    if path not in trace.chosen:
        matched = selection.select(path, module)
        if matched:
            trace.order[path] = len(trace.order)
        trace.chosen[path] = matched and trace.order[path] % selection.every == 0
    if not trace.chosen[path]:
        return next_fun(*args, **kwargs)
    token = _ENTERING.set(path)
    try:
        # the bound Linen method: remat.checkpoint's dispatch lifts it over the module's
        # scope (nn.checkpoint) and calls it on the lifted copy, which comes back here
        return _run_region(path, module.__call__, selection.opts, args, kwargs)
    finally:
        _ENTERING.reset(token)

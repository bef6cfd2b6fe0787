"""``apply_checkpointing`` on Linen: a module (or class) of a generated subclass (same name, same
fields) whose methods intercept the method calls of every selected submodule
(``nn.intercept_methods``) and run each lifted over the submodule's scope.

Parameter names are unchanged and the model's source is never needed. Every method of the
root Linen runs through its handler (``__call__``, ``encode``, ...) installs the
interception, so ``model.apply(v, x, method="encode")`` checkpoints as ``__call__`` does.
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import flax.linen as nn

from remat._core.apply_selected import (
    REGION_PATH,
    Applied,
    Path,
    Selector,
    is_region_method,
    no_match_warning,
    region_methods,
    run_applied,
)
from remat._core.flax_adapters import linen_method


@dataclasses.dataclass(eq=False)
class _Selection:
    """What a generated Linen class checkpoints, and what its last trace selected."""

    select: Selector
    applied: Applied
    every: int
    last_traced: list[tuple[Path, Any]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Trace:
    """One call of the root: the order of first calls of matches, and the classes seen."""

    order: dict[Path, int] = dataclasses.field(default_factory=dict)
    chosen: dict[Path, bool] = dataclasses.field(default_factory=dict)
    seen: set[str] = dataclasses.field(default_factory=set)


# the selections whose root method is running: a root method called by another one (__call__
# calling self.encode) runs under the interception already installed
_INTERCEPTING: contextvars.ContextVar[tuple[_Selection, ...]] = contextvars.ContextVar(
    "remat_linen_intercepting", default=())


def checkpointed(model: Any) -> list[tuple[Path, Any]]:
    """``(path, policy as asked)`` of the submodules selected when ``model`` was last traced."""
    cls = model if isinstance(model, type) else type(model)
    selection = cls.__dict__.get("_remat_selection")
    return [] if selection is None else list(selection.last_traced)


def remove(model: Any) -> Any:
    """The original class, or a module of it with ``model``'s fields."""
    if isinstance(model, type):
        return model.__dict__.get("_remat_base", model)
    base = type(model).__dict__.get("_remat_base")
    return model if base is None else _instance(model, base)


def apply(model: Any, select: Selector, applied: Applied, every: int) -> Any:
    """A module (or class) like ``model`` that checkpoints the submodules ``select`` picks."""
    given = model if isinstance(model, type) else type(model)
    base = given.__dict__.get("_remat_base", given)  # re-applying replaces, never nests
    # the methods Linen runs through its handler, and so through interceptors
    entries = [name for name in region_methods(base, nn.Module)
               if getattr(getattr(base, name), "method_handler_wrapped", False)]
    if not entries:
        raise TypeError(f"apply_checkpointing: the Linen module {base.__name__} has no method to call")
    selection = _Selection(select, applied, every)
    namespace: dict[str, Any] = {name: _entry(selection, getattr(base, name)) for name in entries}
    namespace.update({"__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__,
                      "_remat_base": base, "_remat_selection": selection})
    cls = type(base.__name__, (base,), namespace)
    return cls if isinstance(model, type) else _instance(model, cls)


def _instance(model: nn.Module, cls: type) -> nn.Module:
    """``model``'s fields (as ``Module.clone`` copies them) in an instance of ``cls``."""
    return cls(**{f.name: getattr(model, f.name) for f in dataclasses.fields(model) if f.init})


def _entry(selection: _Selection, impl: Callable[..., Any]) -> Callable[..., Any]:
    """A method of the root (``__call__``, ``encode``, ...): ``impl`` with the selected submodules intercepted."""
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        running = _INTERCEPTING.get()
        if any(s is selection for s in running):
            return impl(self, *args, **kwargs)
        trace = _Trace()
        token = _INTERCEPTING.set((*running, selection))
        try:
            with nn.intercept_methods(functools.partial(_intercept, selection, trace)):
                out = impl(self, *args, **kwargs)
        finally:
            _INTERCEPTING.reset(token)
        if not any(trace.chosen.values()):
            no_match_warning(trace.seen, stacklevel=1)
        selection.last_traced = [(p, selection.applied.policy) for p, chosen in trace.chosen.items() if chosen]
        return out

    return linen_method(functools.wraps(impl)(method))


def _intercept(selection: _Selection, trace: _Trace, next_fun: Callable[..., Any], args: tuple,
               kwargs: dict, context: Any) -> Any:
    if not is_region_method(context.method_name):
        return next_fun(*args, **kwargs)
    module = context.module
    path = tuple(module.path)
    if REGION_PATH.get() == path:  # inside the module's own region (its lifted copy): run as it is
        return next_fun(*args, **kwargs)
    trace.seen.add(type(module).__dict__.get("_remat_base", type(module)).__name__)
    if path not in trace.chosen:
        matched = selection.select(path, module)
        if matched:
            trace.order[path] = len(trace.order)
        trace.chosen[path] = matched and trace.order[path] % selection.every == 0
    if not trace.chosen[path]:
        return next_fun(*args, **kwargs)
    method = getattr(module, context.method_name, None)
    if method is None or getattr(method, "__self__", None) is not module:  # stored under a name not its own
        warnings.warn(f"apply_checkpointing: {type(module).__name__}.{context.method_name} is not found under its "
                      "own name, so it runs without checkpoint", UserWarning, stacklevel=2)
        return next_fun(*args, **kwargs)
    # the bound Linen method: remat.checkpoint's dispatch lifts it over the module's scope
    # (nn.checkpoint) and calls it on the lifted copy, whose call comes back here
    return run_applied(path, method, selection.applied.opts, args, kwargs)

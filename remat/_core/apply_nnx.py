"""``apply_checkpointing`` on NNX, in place: each selected module's class becomes a generated
subclass (same name) whose methods run the originals as regions.

Only the class changes: no attribute, no Variable, so ``nnx.state`` paths stay the same, and
the class travels in the graphdef through ``nnx.split``/``merge`` and every nnx transform.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from flax import nnx

from remat._core.apply_selected import (
    REGION_PATH,
    Applied,
    Path,
    Selector,
    no_match_warning,
    region_methods,
    run_applied,
)


def modules(model: nnx.Module) -> list[tuple[Path, nnx.Module]]:
    """Every module of the graph once (a shared module at its first path), in iter_graph order."""
    return [(tuple(path), m) for path, m in nnx.iter_graph(model, graph=True) if isinstance(m, nnx.Module)]


def checkpointed(model: nnx.Module) -> list[tuple[Path, Any]]:
    """``(path, policy as asked)`` of each checkpointed module, in iter_graph order."""
    return [(path, vars(type(m))["_remat_applied"].policy) for path, m in modules(model)
            if "_remat_base" in vars(type(m))]


def remove(model: nnx.Module) -> None:
    """Gives every checkpointed module of ``model`` its class back."""
    _set_classes([(m, type(m).__dict__["_remat_base"]) for _, m in modules(model) if "_remat_base" in type(m).__dict__])


def apply(model: nnx.Module, select: Selector, applied: Applied, every: int) -> None:
    """Checkpoints the modules ``select`` picks (every ``every``-th), and only them."""
    found = modules(model)
    earlier = [(m, type(m)) for _, m in found if "_remat_base" in type(m).__dict__]
    _set_classes([(m, cls.__dict__["_remat_base"]) for m, cls in earlier])  # check_fn sees the model as written
    try:
        chosen = [(path, m) for path, m in found if select(path, m)][::every]
        missing = sorted({type(m).__name__ for _, m in chosen if not region_methods(type(m), nnx.Module)})
        if missing:  # checked for all before any class is swapped
            raise TypeError(f"apply_checkpointing: {', '.join(missing)} defines no method to checkpoint "
                            "(no __call__); select the modules that are called")
    except BaseException:
        _set_classes(earlier)  # a bad check_fn or selection leaves the model as it was
        raise
    if not chosen:
        no_match_warning({type(m).__name__ for _, m in found}, stacklevel=3)
    _set_classes([(m, _nnx_class(type(m), applied, path)) for path, m in chosen])


def _set_classes(pairs: list[tuple[nnx.Module, type]]) -> None:
    for module, cls in pairs:
        if type(module) is not cls:
            object.__setattr__(module, "__class__", cls)


# (base class, options key, path) -> generated subclass, so that equal options share one
# class (and so one graphdef: nnx.jit does not retrace for a re-applied model). The path is
# the class's, not an attribute's: the module's own attributes, and so its graph, stay as they are.
_NNX_CLASSES: dict[tuple[type, Any, Path], type] = {}


def _nnx_class(base: type, applied: Applied, path: Path) -> type:
    cached = _NNX_CLASSES.get((base, applied.key, path)) if applied.key is not None else None
    if cached is not None:
        return cached

    def region_method(impl: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(impl)
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            if REGION_PATH.get() == path:  # called by the module itself, inside its region
                return impl(self, *args, **kwargs)
            # the original method, bound to this module: remat.checkpoint's dispatch lifts it
            # with nnx.remat and rebinds it to the region's copy of the module
            return run_applied(path, impl.__get__(self), applied.opts, args, kwargs)
        return method

    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        # pickle names classes by module and name, which find the base class: pickle the
        # module as one of it, and swap the class again on load
        new, args, *rest = super(cls, self).__reduce_ex__(protocol)
        return (_unpickle, (new, (base, *args[1:]), applied, path), *rest)

    namespace: dict[str, Any] = {name: region_method(getattr(base, name)) for name in region_methods(base, nnx.Module)}
    namespace.update({"__reduce_ex__": __reduce_ex__, "__module__": base.__module__, "__qualname__": base.__qualname__,
                      "__doc__": base.__doc__, "_remat_base": base, "_remat_applied": applied})
    cls = type(base.__name__, (base,), namespace, pytree=base._pytree__is_pytree)
    if applied.key is not None:
        _NNX_CLASSES[(base, applied.key, path)] = cls
    return cls


def _unpickle(new: Callable[..., Any], args: tuple, applied: Applied, path: Path) -> Any:
    module = new(*args)
    object.__setattr__(module, "__class__", _nnx_class(args[0], applied, path))
    return module

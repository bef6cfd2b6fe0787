"""How a module that ``apply_checkpointing`` selected runs: which of its methods are regions, and
the one region each call of them is."""
from __future__ import annotations

import contextvars
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

from remat._core.dispatch import run_region
from remat._core.options import CheckpointOptions

Path = tuple[Any, ...]
Selector = Callable[[Path, Any], bool]

# the path of the applied module whose region is running: read by the planner's region
# deciders (region_paths), and by the module's own methods, which run as they are inside it
REGION_PATH: contextvars.ContextVar[Path | None] = contextvars.ContextVar("remat_region_path", default=None)
# the same path until the region it belongs to is decided (take_entering_path): a region
# written by hand inside the applied one must not be taken for it
_ENTERING_PATH: contextvars.ContextVar[Path | None] = contextvars.ContextVar("remat_entering_path", default=None)


@dataclasses.dataclass(frozen=True)
class Applied:
    """What one ``apply_checkpointing`` call gives each module it selects."""

    opts: CheckpointOptions
    policy: Any  # as the caller gave it, for checkpointed()
    key: Any = None  # the options as spelled, hashable (None when not): equal keys share one NNX class


def run_applied(path: Path, function: Callable[..., Any], opts: CheckpointOptions, args: tuple,
                kwargs: dict) -> Any:
    """One applied region: remat.checkpoint's dispatch, with the module's path known."""
    token, entering = REGION_PATH.set(path), _ENTERING_PATH.set(path)
    try:
        return run_region(function, opts, args, kwargs)
    finally:
        _ENTERING_PATH.reset(entering)
        REGION_PATH.reset(token)


def take_entering_path() -> Path | None:
    """The path of the applied region now being decided, once; ``None`` for any other region."""
    path = _ENTERING_PATH.get()
    _ENTERING_PATH.set(None)
    return path


def is_region_method(name: str) -> bool:
    """Whether a selected module's method of this name runs as a region: not setup, no dunder but __call__."""
    return name == "__call__" or not (name == "setup" or (name.startswith("__") and name.endswith("__")))


def region_methods(base: type, framework: type) -> list[str]:
    """The methods of ``base`` that run as regions: those its own classes define, not ``framework``'s.

    ``framework`` is ``nnx.Module`` or ``nn.Module``: their methods (``sow``, ``apply``, ...)
    are the framework's, not the model's computation.
    """
    names: list[str] = []
    for klass in base.__mro__:
        if klass in framework.__mro__:
            continue
        names += [name for name, attr in vars(klass).items()
                  if name not in names and is_region_method(name) and _is_method(attr)]
    return names


def _is_method(attr: Any) -> bool:
    """Whether a class attribute binds ``self`` when called through an instance (a function, a
    jitted function, ...), and is not marked ``nn.nowrap``."""
    return (callable(attr) and hasattr(attr, "__get__") and not getattr(attr, "nowrap", False)
            and not isinstance(attr, (staticmethod, classmethod, type)))


def no_match_warning(seen: set[str], stacklevel: int) -> None:
    warnings.warn(f"apply_checkpointing: check_fn matched no submodule; the model's module classes are "
                  f"{', '.join(sorted(seen)) or '(none)'}", UserWarning, stacklevel=stacklevel + 1)

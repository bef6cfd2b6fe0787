"""Module paths in a traced program's names: every Flax module call runs under a named scope.

:func:`module_scopes` makes the operations a Flax NNX or Linen module traces carry the
module's path in their name stack (``~blocks.3.mlp``), so the HLO op metadata of the
compiled step says which module produced each buffer. Only the names of operations
change: the computation, and so the compiled program's memory, is the same.

* **Linen**: ``nn.intercept_methods`` (thread-local, Flax's own hook), with ``module.path``.
* **NNX** has no call hook. For the duration of the ``with`` block, the ``__call__`` of
  every NNX module class is wrapped; the wrapper names scopes only in the context that
  entered the block (a ``ContextVar``), so other threads see a transparent wrapper. The
  first module called (the root) gets each of its submodules tagged with its path; the
  tag is a static attribute, so it travels into the copies that ``nnx.split``/``merge``
  and checkpointed regions make, and every tag is removed on exit.
"""
from __future__ import annotations

import contextlib
import contextvars
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax

MARK = "~"  # name-stack prefix of a module path (XLA cuts op names at "@")
_TAG = "_remat_module_path"
_MODULE_IN_NAME = re.compile(re.escape(MARK) + r"([^/()\s;]+)")



class _Naming:
    """The state of one ``with module_scopes()`` block: tagged modules, the module call stack."""

    def __init__(self) -> None:
        self.tagged: list[Any] = []
        self.stack: list[tuple[str, int]] = []  # (path, id of the module object) of the calls running


_active: contextvars.ContextVar[_Naming | None] = contextvars.ContextVar("remat_module_scopes", default=None)


def module_of(op_name: str) -> str | None:
    """The innermost module path in an op name or name stack, or None.

    Example:
      >>> module_of("jit(loss)/transpose(jvp(~blocks.0))/~blocks.0.mlp/dot_general")
      'blocks.0.mlp'
    """
    found = _MODULE_IN_NAME.findall(op_name.split(";")[0])
    return found[-1] if found else None


@contextlib.contextmanager
def module_scopes() -> Iterator[None]:
    """Within the block, Flax modules called while tracing name their operations by module path."""
    naming = _Naming()
    token = _active.set(naming)
    patched = _patch_nnx_classes()
    try:
        with _linen_interceptor():
            yield
    finally:
        for cls, original in patched:
            cls.__call__ = original
        for module in naming.tagged:
            module.__dict__.pop(_TAG, None)
        _active.reset(token)


def _scope(path: str) -> Any:
    return jax.named_scope(MARK + path) if path else contextlib.nullcontext()


# --- NNX ---------------------------------------------------------------------------------

def _all_subclasses(cls: type) -> Iterator[type]:
    seen: set[type] = set()
    todo = [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
                yield sub


def _patch_nnx_classes() -> list[tuple[type, Callable[..., Any]]]:
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is a dependency
        return []
    patched = []
    for cls in [nnx.Module, *_all_subclasses(nnx.Module)]:
        original = cls.__dict__.get("__call__")
        if not inspect.isfunction(original) or getattr(original, "_remat_scoped", False):
            continue  # absent, a descriptor, or already wrapped by another thread's block
        wrapper = _nnx_wrapper(original)
        cls.__call__ = wrapper
        patched.append((cls, original))
    return patched


def _nnx_wrapper(call: Callable[..., Any]) -> Callable[..., Any]:
    def scoped_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        naming = _active.get()
        if naming is None:  # another thread, or after the block: transparent
            return call(self, *args, **kwargs)
        path = getattr(self, "__dict__", {}).get(_TAG)
        if path is None:
            if naming.stack:  # made inside the model (not in the root's graph): unnamed
                return call(self, *args, **kwargs)
            path = _tag_graph(self, naming.tagged)  # a root: name its whole graph
        if naming.stack and naming.stack[-1] == (path, id(self)):  # super().__call__ of the same object
            return call(self, *args, **kwargs)
        # (a copy of the module inside a checkpointed region names its scope again: the region's
        # own jaxpr then carries the path of the module it checkpoints)
        naming.stack.append((path, id(self)))
        try:
            with _scope(path):
                return call(self, *args, **kwargs)
        finally:
            naming.stack.pop()

    scoped_call._remat_scoped = True  # type: ignore[attr-defined]
    scoped_call.__wrapped__ = call  # type: ignore[attr-defined]
    return scoped_call


def _tag_graph(root: Any, tagged: list[Any]) -> str:
    """Tags ``root`` (path "") and every submodule with its path; returns the root's."""
    from flax import nnx

    for path, node in nnx.iter_graph(root):
        if isinstance(node, nnx.Module) and _TAG not in node.__dict__:
            vars(node)[_TAG] = ".".join(map(str, path))
            tagged.append(node)
    return root.__dict__.get(_TAG, "")


# --- Linen -------------------------------------------------------------------------------

@contextlib.contextmanager
def _linen_interceptor() -> Iterator[None]:
    try:
        import flax.linen as nn
    except ImportError:  # pragma: no cover - flax is a dependency
        yield
        return

    def interceptor(next_fun: Callable[..., Any], args: tuple, kwargs: dict, context: Any) -> Any:
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        path = ".".join(str(p) for p in (context.module.path or ()))
        with _scope(path):
            return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):
        yield

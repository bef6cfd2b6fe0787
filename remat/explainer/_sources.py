"""Which frame of a traced operation is the user's code: the innermost one outside the libraries.

JAX keeps the Python stack of every operation (and XLA keeps it in the op metadata).
Its innermost frames are often inside Flax (``nnx.Linear.__call__``), optax or remat
itself; the line a user wants is the first frame outside them, e.g. the ``self.fc(x)``
of their model. remat's reference models (``remat.models``) and examples count as user
code.
"""
from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Iterable

_USER_PARTS_OF_REMAT = ("models", "examples")


@functools.lru_cache(maxsize=1)
def _library_roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(library folders, remat folders that are user code)``, as absolute paths with a separator."""
    roots = []
    for name in ("jax", "jaxlib", "flax", "optax", "remat", "numpy", "orbax", "chex"):
        try:
            module = __import__(name)
        except ImportError:
            continue
        path = getattr(module, "__file__", None)
        if path:
            roots.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    for key in ("stdlib", "platstdlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.append(os.path.abspath(path) + os.sep)
    remat_root = next((r for r in roots if r.rstrip(os.sep).endswith(os.sep + "remat")), None)
    user = tuple(remat_root + part + os.sep for part in _USER_PARTS_OF_REMAT) if remat_root else ()
    return tuple(roots), user


def is_library_file(path: str) -> bool:
    """True for files of JAX, Flax, optax, NumPy, the standard library and remat (not its models)."""
    if not path or path.startswith("<"):
        return True
    path = os.path.abspath(path)
    roots, user = _library_roots()
    if any(path.startswith(u) for u in user):
        return False
    return any(path.startswith(r) for r in roots)


def user_frame(frames: Iterable[tuple[str, int, str]]) -> tuple[str, int, str] | None:
    """The innermost ``(file, line, function)`` outside the libraries, or None."""
    for frame in frames:
        if not is_library_file(frame[0]):
            return frame
    return None


def format_source(frame: tuple[str, int, str] | None) -> str | None:
    """``"transformer.py:85"``: the file's base name and the line, or None."""
    if frame is None:
        return None
    return f"{os.path.basename(frame[0])}:{frame[1]}"

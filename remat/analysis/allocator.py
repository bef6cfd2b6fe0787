"""Keeps freed memory in the process heap, so XLA:CPU steps stop page-faulting it afresh.

XLA:CPU allocates a step's temp buffer (one block of ``memory_analysis().temp_size_in_bytes``)
with ``malloc`` on every execution and frees it at the end. glibc serves blocks above its
mmap threshold (at most 32 MiB) with a fresh ``mmap`` and returns them with ``munmap``, so
every step touches, faults in and zeroes every page of that buffer again. The cost grows
with the buffer, which punishes exactly the programs that keep more activations. On the
2-core machine of the README, the 8-block transformer (B=8, T=128) ran without any
checkpoint at 265 ms, ``nothing`` at 234 and ``budget(0.5)`` at 232: keeping more did not
pay. After :func:`keep_freed_memory` the same programs ran at 194, 246 and 215 ms, the
order one expects when recomputation is the only cost.

:func:`keep_freed_memory` tells glibc (through ``mallopt``) to serve every block from the
heap and never to give freed memory back to the kernel, the way PyTorch's caching
allocator or tcmalloc keep theirs, and to use one arena for all threads (a thread's own
arena is made of 64 MiB heaps that still map bigger blocks afresh). It is a process-wide
choice, so remat never makes it for you: call it once at start-up, before the first JAX
computation starts XLA's threads (``remat plan/train/profile --keep-freed-memory``). The
resident memory then stays at its high-water mark instead of shrinking after each step,
and all threads share one arena's lock (XLA:CPU allocates little per step).

References:
  glibc manual, "Malloc Tunable Parameters" (``M_ARENA_MAX``, ``M_MMAP_MAX``,
  ``M_TRIM_THRESHOLD``); the same settings as the ``MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0
  MALLOC_TRIM_THRESHOLD_=...`` environment variables, but made from Python.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import warnings

from remat.analysis.process import jax_backend_started

# mallopt parameter numbers, from glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


@functools.lru_cache(maxsize=1)
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version"):  # only glibc has it (not musl, not macOS)
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def keep_freed_memory() -> bool:
    """Makes glibc's ``malloc`` keep freed memory for reuse instead of unmapping it.

    The first steps still fault their buffers in while the heap grows to its working size
    (measured: two to six steps); after that a step's temp buffer reuses freed heap.

    Returns:
      True when the settings took effect; False where the C library is not glibc
      (macOS, musl), which keeps its own behaviour.

    Example:
      >>> import remat
      >>> remat.keep_freed_memory()  # doctest: +SKIP
      True
    """
    libc = _glibc()
    if libc is None:
        return False
    if jax_backend_started():
        warnings.warn("keep_freed_memory() after JAX started: its running threads keep their own "
                      "malloc arenas; call it before the first JAX computation", RuntimeWarning, stacklevel=2)
    # mallopt returns 1 on success. All three are needed: one arena (a thread's own arena
    # is made of 64 MiB heaps, which still map bigger blocks afresh and unmap freed
    # ones), no mmap for big blocks, and no trimming of the heap's top. M_TOP_PAD stays
    # at its default: a larger pad made the heap grow for more steps before blocks were
    # reused (256 MiB: 6 faulting steps and a 1 GiB heap for a 128 MiB temp buffer;
    # default: 2 steps, 357 MiB).
    ok = libc.mallopt(_M_ARENA_MAX, 1) == 1
    ok &= libc.mallopt(_M_MMAP_MAX, 0) == 1
    ok &= libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    return bool(ok)

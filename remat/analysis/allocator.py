"""glibc's allocator: keep freed memory in the heap (so XLA:CPU steps stop page-faulting it afresh).

XLA:CPU allocates a step's temp buffer (one block of ``memory_analysis().temp_size_in_bytes``)
with ``malloc`` on every execution and frees it at the end. glibc serves blocks above its
mmap threshold (at most 32 MiB) with a fresh ``mmap`` and returns them with ``munmap``, so
every step touches, faults in and zeroes every page of that buffer again. The cost grows
with the buffer, which punishes exactly the programs that keep more activations, so that
keeping more can stop paying (docs/memory.md gives measured step times).

:func:`keep_freed_memory` tells glibc (through ``mallopt``) to serve every block from the
heap and never to give freed memory back to the kernel, the way PyTorch's caching
allocator or tcmalloc keep theirs, and to use one arena for all threads (a thread's own
arena is made of 64 MiB heaps that still map bigger blocks afresh). It is a process-wide
choice, so remat never makes it for you: call it once at start-up, before the first JAX
computation starts XLA's threads (``remat plan/train/profile --keep-freed-memory``). The
resident memory then stays at its high-water mark instead of shrinking after each step,
and all threads share one arena's lock (XLA:CPU allocates little per step).

This module is also remat's one handle on glibc (:func:`glibc`): :func:`trim_heap` and
:func:`malloc_mode`, which the benchmarks use to switch between measuring memory and
timing, go through it.

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
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


@functools.lru_cache(maxsize=1)
def glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (``mallopt``, ``malloc_trim``); None elsewhere."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version"):  # only glibc has it (not musl, not macOS)
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc


_glibc = glibc  # the name tests and older callers use


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
    libc = glibc()
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


def trim_heap() -> bool:
    """Returns the heap's free memory to the kernel (``malloc_trim(0)``); False if not glibc."""
    libc = glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def malloc_mode(mode: str) -> bool:
    """Switches glibc's allocator between measuring memory and timing (False if not glibc).

    ``"measure"``: buffers over 128 KiB are mmap'd and go back to the kernel when freed,
    and free heap memory is trimmed, so that RSS tracks live bytes (the setting
    :func:`remat.analysis.peak_rss_bytes` gives its fresh process through
    ``MALLOC_MMAP_THRESHOLD_``). ``"time"``: buffers up to 32 MiB come from the heap and
    are reused (glibc's steady state after its dynamic threshold has grown), so that steps
    are not timed with page faults and mmap/munmap calls for every tensor (which hits
    PyTorch, whose CPU allocator does not cache, far harder than XLA).
    """
    if mode not in ("measure", "time"):
        raise ValueError(f"mode must be 'measure' or 'time', got {mode!r}")
    libc = glibc()
    if libc is None:
        return False
    if mode == "measure":
        libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
        libc.mallopt(_M_TRIM_THRESHOLD, 128 * 1024)
        libc.malloc_trim(0)
    else:
        libc.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)
        libc.mallopt(_M_TRIM_THRESHOLD, 64 * 2**20)
    return True

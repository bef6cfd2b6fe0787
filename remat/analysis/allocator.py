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

import concurrent.futures
import ctypes
import ctypes.util
import functools
import os
import time
import warnings

from remat.analysis.process import jax_backend_started

# mallopt parameter numbers, from glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


@functools.lru_cache(maxsize=1)
def glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (``mallopt``, ``malloc_trim``, ``malloc``,
    ``free``, ``memset``); None elsewhere."""
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
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    libc.memset.restype = ctypes.c_void_p
    return libc


_glibc = glibc  # the name tests and older callers use

#: glibc's largest mmap threshold on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``): a block this big
#: or bigger is mapped afresh by every ``malloc`` (unless :func:`keep_freed_memory`), so an
#: XLA:CPU step whose temp buffer is this big faults it in at every execution.
FRESH_MAP_BYTES = 32 * 2**20


def fault_s_per_byte(size: int = 48 * 2**20, repeat: int = 3) -> float:
    """Seconds per byte that a freshly ``malloc``'d block costs to fill, over a reused one.

    What an XLA:CPU step whose temp buffer is at least :data:`FRESH_MAP_BYTES` pays at every
    execution for glibc's fresh ``mmap`` (a page fault and a zeroed page per 4 KiB): a block
    of ``size`` bytes is filled on every core at once (as XLA's threads fill theirs),
    freshly allocated and freed each time, against the same block kept. After
    :func:`keep_freed_memory` the fresh block is the freed one, and the cost is about 0.

    Args:
      size: the block's bytes; above :data:`FRESH_MAP_BYTES`, so that it is mapped afresh
        by default (and, being above it, leaves glibc's dynamic threshold as it was).
      repeat: fills of each kind; the fastest of each is used.

    Returns:
      The extra seconds per byte (at least 0); 0 where the C library is not glibc.
    """
    libc = glibc()
    if libc is None:
        return 0.0
    malloc, free, memset = libc.malloc, libc.free, libc.memset
    cores = os.cpu_count() or 1
    part = size // cores

    def fill(block: int) -> float:
        started = time.perf_counter()
        # ctypes lets go of the GIL in a foreign call: the parts fill at once
        list(pool.map(lambda i: memset(block + i * part, 1, part), range(cores)))
        return time.perf_counter() - started

    def fresh() -> float:
        started = time.perf_counter()
        block = malloc(size)
        if not block:
            raise MemoryError(size)
        fill(block)
        free(block)
        return time.perf_counter() - started

    kept = malloc(size)
    if not kept:
        return 0.0
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=cores) as pool:
            fill(kept)  # faulted in once; after this a fill only writes
            reused = min(fill(kept) for _ in range(repeat))
            fresh()
            new = min(fresh() for _ in range(repeat))
    except MemoryError:
        return 0.0
    finally:
        free(kept)
    return max(new - reused, 0.0) / size


def keep_freed_memory() -> bool:
    """Makes glibc's ``malloc`` keep freed memory for reuse instead of unmapping it.

    A step still faults its temp buffer in when the heap has to grow: small blocks
    allocated between steps can split the freed buffer's chunk, until the heap holds enough
    room for both. That happens in a few steps, mostly the first ones; the others reuse
    freed heap.

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
    # reused, and the heap bigger (docs/memory.md).
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

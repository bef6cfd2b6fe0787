"""The process: whether JAX's backend started, and its resident memory (RSS), measured.

The one place remat reads process memory: RSS now (psutil), the lifetime peak
(``getrusage``), the kernel's resettable high-water mark (``/proc/self/status`` ``VmHWM``,
which psutil cannot reset or read), the peak during one call (:func:`peak_rss_during`)
and the peak of a step run in a fresh process (:func:`peak_rss_bytes`).
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import json
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from remat import _jax


def jax_backend_started() -> bool:
    """True once a JAX backend exists (the first computation made it); never imports JAX.

    Settings read when a backend starts (host device counts, allocator arenas) can no
    longer take effect after that.
    """
    return _jax.backend_started()


@dataclasses.dataclass(frozen=True)
class RSSMeasurement:
    """Resident memory of a step run in a fresh process.

    Attributes:
      step_peak_bytes: high-water mark of RSS while the timed steps ran.
      baseline_bytes: RSS just before them (JAX imported, inputs on the device, program
        compiled).
      step_bytes: ``step_peak_bytes - baseline_bytes``: what running the step needs on
        top of that (its temporaries and outputs). Compare this across policies.
      process_peak_bytes: the process's lifetime peak, compilation included.
      exact: False when the kernel did not let us reset the high-water mark, in which
        case ``step_peak_bytes`` was sampled in a thread and may miss a short peak.
    """

    step_peak_bytes: int
    baseline_bytes: int
    step_bytes: int
    process_peak_bytes: int
    exact: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def proc_status_bytes(field: str) -> int | None:
    """A byte figure from ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...); None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=1)
def _process(pid: int) -> Any:
    import psutil

    return psutil.Process(pid)


def current_rss_bytes() -> int:
    """This process's resident memory now (psutil)."""
    return int(_process(os.getpid()).memory_info().rss)  # by pid: a forked child is another process


def process_peak_rss_bytes() -> int:
    """This process's lifetime peak of resident memory (``getrusage``; never goes down)."""
    import resource

    # ru_maxrss is KiB on Linux, bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def reset_peak_rss() -> bool:
    """Resets the kernel's RSS high-water mark (``VmHWM``) to the current RSS.

    Linux >= 4.0: writing 5 to ``/proc/self/clear_refs`` does it, so that the next
    ``proc_status_bytes("VmHWM")`` is the peak of what ran after this point only.

    Returns:
      False where it cannot be done (not Linux, or no permission).
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return proc_status_bytes("VmHWM") is not None
    except OSError:
        return False


class _RSSSampler:
    """Fallback when VmHWM cannot be reset: samples RSS every ~0.5 ms in a thread."""

    def __init__(self, floor: int) -> None:
        self.peak = max(floor, current_rss_bytes())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss_bytes())
            time.sleep(0.0005)

    def __enter__(self) -> _RSSSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss_bytes())


@dataclasses.dataclass(frozen=True)
class PeakRSS:
    """Resident memory around one call (:func:`peak_rss_during`).

    Attributes:
      baseline_bytes: RSS just before the call (after a garbage collection).
      peak_bytes: the high-water mark of RSS during the call.
      exact: True when the kernel's high-water mark was reset and read (``VmHWM``);
        False when RSS was sampled in a thread instead, which can miss a short peak.
    """

    baseline_bytes: int
    peak_bytes: int
    exact: bool

    @property
    def increase_bytes(self) -> int:
        """``peak_bytes - baseline_bytes``: what the call needed on top of what was resident."""
        return max(0, self.peak_bytes - self.baseline_bytes)

    @property
    def method(self) -> str:
        """``"vmhwm_reset"`` or ``"sampled"``."""
        return "vmhwm_reset" if self.exact else "sampled"


def peak_rss_during(run: Callable[[], Any]) -> PeakRSS:
    """Runs ``run()`` once and reports the peak of this process's RSS meanwhile.

    The baseline is read after ``gc.collect()``; the peak is the kernel's high-water mark
    after :func:`reset_peak_rss`, or, where it cannot be reset, RSS sampled in a thread.
    """
    gc.collect()
    baseline = current_rss_bytes()
    if reset_peak_rss():
        run()
        hwm = proc_status_bytes("VmHWM")
        return PeakRSS(baseline, max(baseline, hwm or baseline), True)
    with _RSSSampler(baseline) as sampler:
        run()
    return PeakRSS(baseline, sampler.peak, False)


def _measure_here(step: Callable, args: tuple, kwargs: dict, repeat: int) -> RSSMeasurement:
    compiled = jax.jit(step).lower(*args, **kwargs).compile()

    def run() -> None:
        for _ in range(repeat):
            jax.block_until_ready(compiled(*args, **kwargs))

    # Baseline: inputs on the device and the program compiled, nothing run yet.
    p = peak_rss_during(run)
    return RSSMeasurement(p.peak_bytes, p.baseline_bytes, p.increase_bytes, process_peak_rss_bytes(), p.exact)


def _rss_child_main() -> None:  # runs in the fresh interpreter started by peak_rss_bytes
    payload = pickle.loads(sys.stdin.buffer.read())
    step, args, kwargs, repeat = payload
    result = _measure_here(step, args, kwargs, repeat)
    sys.stdout.write("REMAT_RSS " + json.dumps(result.to_dict()) + "\n")


def peak_rss_bytes(
    step: Callable,
    *args: Any,
    repeat: int = 3,
    isolate: bool = True,
    timeout: float = 600.0,
    **kwargs: Any,
) -> RSSMeasurement:
    """Measures the resident memory a step really uses, end to end.

    The step is jitted and compiled; then the kernel's RSS high-water mark is reset
    (``/proc/self/clear_refs``) and the step runs ``repeat`` times. By default this
    happens in a fresh Python process, which is the honest choice: the caller's other
    arrays, compilation caches and allocator history would blur the number,
    ``ru_maxrss`` in a long-lived process never goes down, and only a new process lets
    us set glibc's ``MALLOC_MMAP_THRESHOLD_`` so that freed buffers (compilation's,
    or the previous step's) go back to the kernel instead of hiding the next step's
    allocations in a retained heap. The child otherwise inherits the environment, so
    ``XLA_FLAGS`` apply the same way.

    Args:
      step: the function to run (e.g. ``jax.grad(loss)``). With ``isolate=True`` it
        and the inputs must be picklable: a module-level function or a
        ``functools.partial`` of one, not a lambda or a local function.
      *args: inputs (NumPy or JAX arrays, pytrees of them).
      repeat: timed runs after the warm-up.
      isolate: run in a fresh subprocess (True) or in this process (False; works for
        any callable, less reliable).
      timeout: seconds before the child is killed.
      **kwargs: keyword inputs for ``step``.

    Returns:
      An :class:`RSSMeasurement`; ``step_bytes`` is the number to compare.

    Example:
      >>> import functools, jax, jax.numpy as jnp
      >>> m = peak_rss_bytes(functools.partial(jnp.sum), jnp.ones((1024, 1024)))  # doctest: +SKIP
    """
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    if not isolate:
        return _measure_here(step, args, dict(kwargs), repeat)
    host = lambda t: jax.tree.map(lambda a: np.asarray(a) if isinstance(a, jax.Array) else a, t)  # noqa: E731
    try:
        payload = pickle.dumps((step, host(args), host(kwargs), repeat))
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(
            f"peak_rss_bytes(isolate=True) must pickle the step and its inputs ({e}); "
            "use a module-level function, or pass isolate=False"
        ) from None
    code = "from remat.analysis.process import _rss_child_main; _rss_child_main()"
    # The child must import the caller's modules the same way: give it our sys.path.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    # Large buffers via mmap, returned to the kernel on free: RSS then tracks live bytes.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    proc = subprocess.run(
        [sys.executable, "-c", code], input=payload, capture_output=True, timeout=timeout, env=env
    )
    for line in proc.stdout.decode(errors="replace").splitlines():
        if line.startswith("REMAT_RSS "):
            return RSSMeasurement(**json.loads(line.removeprefix("REMAT_RSS ")))
    err = proc.stderr.decode(errors="replace").strip().splitlines()
    raise RuntimeError(f"peak_rss_bytes: the measuring process failed: {err[-1] if err else proc.returncode}")

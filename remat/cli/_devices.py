"""The devices ``remat train`` runs on: host device counts, multi-process runs, device memory.

One step function serves one CPU, one GPU or many: ``remat train`` builds a
``jax.sharding.Mesh`` with axes ``"data"`` and ``"fsdp"`` over :func:`setup_devices`' devices
(:mod:`remat.cli._mesh`; ``--mesh data=D,fsdp=F`` asks for ``D * F`` of them).
``--devices N`` on CPU sets ``jax_num_cpu_devices`` before JAX's backend starts (the same
as ``XLA_FLAGS=--xla_force_host_platform_device_count=N``; flags already in XLA_FLAGS, such
as the XLA:CPU flag ``import remat`` adds, are kept).

Multi-host: start one process per host with ``--coordinator HOST:PORT --num-processes P
--process-id I`` (passed to ``jax.distributed.initialize``), or with ``REMAT_DISTRIBUTED=1``
on a cluster JAX recognizes (SLURM, Open MPI, Kubernetes...), where ``initialize()`` finds
them itself. The mesh spans ``jax.devices()``, every device of every process; ``--devices
N`` is the global count (on CPU each process makes ``N / P`` host devices).
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from remat.cli._common import UsageError

MAX_HOST_DEVICES = 256  # a sanity bound for --devices on CPU
DISTRIBUTED_TIMEOUT_S = 120  # how long a process waits for the others to join


def is_distributed(args: Any) -> bool:
    """Whether this run is one process of several (``--coordinator`` or ``REMAT_DISTRIBUTED=1``)."""
    return getattr(args, "coordinator", None) is not None or os.environ.get("REMAT_DISTRIBUTED") == "1"


def _start_distributed(args: Any) -> None:
    """Joins a multi-process run when asked to."""
    import jax

    if not is_distributed(args):
        return
    if getattr(args, "coordinator", None) is not None:
        try:
            jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                       process_id=args.process_id, initialization_timeout=DISTRIBUTED_TIMEOUT_S)
        except Exception as e:  # a wrong address or a missing peer: say so in one line
            raise UsageError(f"--coordinator {args.coordinator}: could not join the {args.num_processes}-process "
                             f"run as process {args.process_id} ({type(e).__name__}: {str(e).splitlines()[0]}); "
                             "start every process with the same --coordinator and --num-processes") from None
    else:
        jax.distributed.initialize()  # REMAT_DISTRIBUTED=1: the cluster (SLURM, ...) says who is who


def setup_devices(n: int | None, args: Any = None, flag: str | None = None) -> list[Any]:
    """The devices to train on; makes ``n`` CPU host devices when JAX has not started yet.

    ``n`` is the global device count: in a run of P processes each makes ``n / P``.
    ``flag`` is how errors name the option that asked for ``n`` (default ``--devices N``).
    """
    import jax

    from remat.analysis.process import jax_backend_started

    asked = flag or f"--devices {n}"
    started = jax_backend_started()
    n_proc_asked = getattr(args, "num_processes", None) or 1
    if n is not None and n > 1 and not started:
        local = n // n_proc_asked
        if local > MAX_HOST_DEVICES:
            raise UsageError(f"{asked}: at most {MAX_HOST_DEVICES} devices can be made on a host")
        if jax.config.values["jax_num_cpu_devices"] < local:
            jax.config.update("jax_num_cpu_devices", local)
    _start_distributed(args)
    devices = jax.devices()
    if n is None:
        return devices
    if len(devices) < n:
        platform = devices[0].platform
        if started and platform == "cpu":
            raise UsageError(
                f"{asked}: JAX already started in this process with {len(devices)} CPU device(s) and "
                "cannot make more; run remat train in a fresh process")
        fewer = f"use --devices {len(devices)} or fewer" if flag is None else "use a smaller mesh"
        raise UsageError(f"{asked}: only {len(devices)} {platform} device(s) available; {fewer}")
    if jax.process_count() > 1 and n != len(devices):
        raise UsageError(f"{asked}: a multi-host run uses every device ({len(devices)})")
    return devices[:n]


@contextlib.contextmanager
def native_stdout_to_stderr() -> Any:
    """Sends what native code writes to file descriptor 1 to stderr; Python's stdout stays.

    Gloo (XLA:CPU's cross-process collectives) prints its connection messages to the C
    stdout, which would break ``--json``'s one-object output.
    """
    sys.stdout.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    python_stdout = sys.stdout
    sys.stdout = open(real, "w", buffering=1, closefd=False)  # noqa: SIM115
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = python_stdout
        os.dup2(real, 1)
        os.close(real)


def device_peak_bytes(devices: list[Any]) -> int | None:
    """The largest ``peak_bytes_in_use`` over the devices (GPU/TPU), None where not reported."""
    peaks = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None

"""XLA:CPU flags that make activation checkpointing actually save memory.

Why per-layer ``jax.checkpoint`` saves nothing on XLA:CPU by default
--------------------------------------------------------------------
Measured with jax/jaxlib 0.10.2 on an unrolled stack of 4 pre-LN transformer
blocks (B=8, T=256, D=256) under ``jax.jit(jax.grad(loss))``; temp bytes from
``memory_analysis()``: no checkpoint 294 MiB, ``jax.checkpoint`` per block 306 MiB;
with the flag below: 264 MiB and 100 MiB.

1. JAX lowers the backward half of a checkpointed function with
   ``prevent_cse=True``: the recomputation's inputs (the saved block input, the
   parameters *and the incoming cotangent*) pass through one
   ``opt-barrier``. That barrier is the only thing tying the recomputation to
   the backward pass; the recomputed forward does not otherwise use the
   cotangent.
2. XLA:CPU removes every ``opt-barrier`` in its ``cse_barrier_expander`` pass
   (OptimizationBarrierExpander), right after CSE and *before* scheduling,
   without adding control dependencies (an HLO dump with
   ``--xla_dump_to=DIR --xla_dump_hlo_pass_re=.*`` shows both barriers in
   ``before_optimizations`` and none from ``after_cse_barrier_expander`` on,
   and no ``control-predecessors``). CSE did *not* undo the remat: the compiled
   modules with and without the flag hold the very same multiset of
   instructions (118 dots each, vs 93 without checkpointing); only their order
   differs.
3. With the barrier gone, each block's recomputation depends only on forward
   values, so it is ready as soon as the forward of that block is. XLA:CPU's
   default ``BFScheduler`` (``--xla_cpu_enable_concurrency_optimized_scheduler``)
   runs an instruction as early as its operands allow, so it hoists the
   recomputation into the forward pass (129 of the 137 recomputed instructions
   land before the last forward instruction) and their outputs stay live until
   the backward needs them: the residuals exist twice instead of not at all.

The fix remat applies: ``--xla_disable_hlo_passes=cse_barrier_expander``. The
barrier then survives to scheduling, the recomputation cannot start before the
cotangent arrives, and the default scheduler keeps its parallelism. Compiled temp
bytes (jax 0.10.2, this 2-core machine):

===========================================  =========  ==========  =================
model                                        no ckpt    ckpt        ckpt, this flag
===========================================  =========  ==========  =================
transformer, 4 blocks, embedding (B8 T128)   72.6 MiB   72.6 MiB    23.5 MiB (none: 72.6)
pre-LN GELU MLP, 8 blocks (B256 D128)        13.7 MiB   13.2 MiB    1.6 MiB (none: 13.7)
tanh MLP, 8 layers (B512 D128)               9.5 MiB    9.5 MiB     2.0 MiB (none: 9.5)
===========================================  =========  ==========  =================

(The transformer is ``models.transformer`` with :mod:`remat.ops`, measured by ``remat
profile transformer --depth 4 --width 128 --batch-size 8 --seq-len 128``; with
``jax.nn``'s ops it was 83.2, 91.2 and 26.5 MiB.)

Code without checkpoints has no barriers, so the flag leaves it exactly as it was.
The alternative first tried, ``--xla_cpu_enable_concurrency_optimized_scheduler=false``
(XLA's ``DFSMemoryScheduler``), helped the transformer stack without an embedding
(306 -> 100 MiB) but saved nothing once the first block's input needed a gradient
(74.2 MiB checkpointed against 68.6 MiB without) and made the tanh MLP worse (18.0 MiB against 9.5).

``lax.scan`` over layers is immune (the backward loop cannot run before the
forward loop ends), which is why :func:`remat.scan.scan_layers` saves memory
under either scheduler.

The flag is read once, when JAX creates its CPU client. Setting it later, or
passing it as ``jax.jit(..., compiler_options=...)`` or
``.compile(compiler_options=...)``, changes nothing (measured). Hence
:func:`configure_cpu_for_remat` runs from ``import remat``, before any backend
exists.

GPU
---
XLA:GPU's latency-hiding scheduler has the same kind of interaction with remat
in unrolled (non-scan) models: it moves recomputation early to overlap it with
other work and keeps the results live (jax-ml/jax issue 20763, "Latency Hiding
Scheduler leads to x5 memory usage if used without jax.lax.scan"). remat sets
no GPU flags, because they trade away communication overlap that multi-device
training depends on. Users can choose: scan over layers
(:func:`remat.scan.scan_layers`, the robust fix), or set
``XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=false``, or lower the
memory budget the scheduler may use with ``--xla_gpu_memory_limit_slop_factor``
(percent of device memory, default 95).
"""
from __future__ import annotations

import os
import re
import sys
import warnings
from typing import Literal

__all__ = ["CPU_REMAT_FLAG", "OPT_OUT_ENV", "configure_cpu_for_remat"]

_FLAG_NAME = "xla_disable_hlo_passes"
CPU_REMAT_FLAG = f"--{_FLAG_NAME}=cse_barrier_expander"
OPT_OUT_ENV = "REMAT_KEEP_XLA_FLAGS"

# Any spelling of the flag: ``--name``, ``--name=VALUE``, ``-name=...``.
_MENTION = re.compile(rf"(?:^|\s)--?{_FLAG_NAME}(?:=|\s|$)")

Outcome = Literal["added", "already_set", "opted_out", "backend_started", "backend_unknown"]

_warned = False


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def _backend_state() -> tuple[bool | None, str | None]:
    """Returns (started, default_platform) without ever starting a backend.

    ``started`` is None when JAX's internals changed and we cannot tell.
    """
    # JAX not imported yet means no backend can exist; never import it here.
    xb = sys.modules.get("jax._src.xla_bridge")
    if xb is None:
        return False, None
    backends = getattr(xb, "_backends", None)
    default = getattr(xb, "_default_backend", None)
    platform = getattr(default, "platform", None)
    if isinstance(backends, dict):
        return bool(backends), platform
    probe = getattr(xb, "backends_are_initialized", None)
    if callable(probe):
        try:
            return bool(probe()), platform
        except Exception:  # API drift: an unknown state is reported, not raised
            return None, platform
    return None, platform


def configure_cpu_for_remat(environ: dict[str, str] | None = None) -> Outcome:
    """Makes XLA:CPU schedule recomputation where checkpointing needs it.

    Appends ``--xla_disable_hlo_passes=cse_barrier_expander`` to ``XLA_FLAGS``
    (see the module docstring for why). The user always wins: nothing changes when
    ``XLA_FLAGS`` already sets ``--xla_disable_hlo_passes`` (their list is kept as it is),
    or when ``REMAT_KEEP_XLA_FLAGS=1``. All other flags are kept. The barrier is an
    identity, so keeping it changes no value on any backend; only the order of work.

    If a JAX backend already exists the flag can no longer take effect, so
    nothing is changed and one warning (per process) says how to fix it.

    Args:
      environ: the environment to edit; ``os.environ`` when None (tests pass a dict).

    Returns:
      What happened: ``"added"``, ``"already_set"`` (the user's XLA_FLAGS mention
      the flag), ``"opted_out"``, ``"backend_started"`` (too late, warned) or
      ``"backend_unknown"`` (JAX internals changed; nothing done, warned).

    Example:
      >>> import os
      >>> env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
      >>> configure_cpu_for_remat(env)  # doctest: +SKIP
      'added'
      >>> env["XLA_FLAGS"]  # doctest: +SKIP
      '--xla_force_host_platform_device_count=2 --xla_disable_hlo_passes=cse_barrier_expander'
    """
    global _warned
    env = os.environ if environ is None else environ
    if _truthy(env.get(OPT_OUT_ENV)):
        return "opted_out"
    flags = env.get("XLA_FLAGS", "")
    if _MENTION.search(flags):
        return "already_set"
    started, platform = _backend_state()
    if started is None or started:
        # A GPU/TPU-only run does not need the CPU flag: stay quiet there.
        if started and platform not in (None, "cpu"):
            return "backend_started"
        if not _warned:
            _warned = True
            warnings.warn(
                "remat: JAX's backend already started, so checkpointing may save no memory on "
                "XLA:CPU; import remat before running any JAX computation, "
                f"or set XLA_FLAGS={CPU_REMAT_FLAG} yourself (REMAT_KEEP_XLA_FLAGS=1 silences this).",
                RuntimeWarning,
                stacklevel=2,
            )
        return "backend_started" if started else "backend_unknown"
    env["XLA_FLAGS"] = f"{flags} {CPU_REMAT_FLAG}".strip()
    return "added"

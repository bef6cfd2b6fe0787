"""The measurements: one (model, depth) at a time, every variant of both frameworks.

For one model and depth, :func:`measure_model` builds the model of :mod:`models` (the
NNX model and its PyTorch twin, with identical weights), prepares every JAX variant
(compiled ``jax.jit(jax.grad(loss))``) and every PyTorch variant, and then measures:

``saved_bytes``
    What the backward pass keeps, **parameters excluded**, model inputs and targets
    included, in both frameworks:

    * JAX: the residuals of ``jax.vjp`` of the loss of the parameters (the outputs of
      its jaxpr that the backward closes over, as :func:`remat.analysis.saved_residuals`
      lists them), all of them as ``residual_total_bytes``; ``saved_bytes`` counts those
      that depend on the batch, found by a dependency pass over that jaxpr. Left out (as
      ``saved_param_bytes``): parameters and values computed from parameters and
      constants alone (the reshape of stacked parameters that the nested scan keeps,
      the causal mask, the broadcast zeros of relu's derivative).
    * PyTorch: the tensors packed by ``torch.autograd.graph.saved_tensors_hooks``
      during the forward pass (this includes the inputs that ``torch.utils.checkpoint``
      saves for its recomputation, which go through the same hooks), deduplicated by
      storage (``untyped_storage().data_ptr()``, counting each storage's size once);
      storages of parameters are counted apart, as ``saved_param_bytes``.

    Parameters are excluded because the frameworks keep them differently without it
    costing memory: a JAX checkpoint region takes the block's parameters as inputs (so
    they are residuals), a PyTorch checkpoint closes over the module (so they are not);
    either way they live in the model anyway.

``temp_bytes``
    JAX only: ``memory_analysis().temp_size_in_bytes`` of the compiled
    ``jax.jit(jax.grad(loss))`` (XLA's buffer assignment). None for PyTorch.

``peak_rss_bytes``
    The *increase* of the process's peak resident memory during one training step:
    the kernel's high-water mark is reset (``/proc/self/clear_refs``) right before the
    step and read right after; the baseline is the RSS just before it (models,
    parameters, inputs and compiled programs resident, previous outputs and gradients
    freed). Each (model, depth) runs in a fresh process; while RSS is measured, glibc's
    allocator is switched (``mallopt``, see :func:`malloc_mode`) so that buffers over
    128 KiB are mmap'd and returned to the kernel when freed, so the high-water mark
    tracks live bytes; for the timed steps it is switched back to reusing its heap.
    When the high-water mark cannot be reset, the step's RSS is sampled in a thread
    instead (``rss_method`` says which).

``step_ms``
    Median over ``steps`` timed training steps (loss + gradient w.r.t. all parameters;
    JAX: the compiled program, ``block_until_ready``; PyTorch: forward + ``backward()``
    with the gradients reset to None first), after one warm-up step. All variants of
    both frameworks are timed in interleaved rounds (one step of each per round, the
    order rotating), so that load from other processes hits them alike.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import remat

JAX_VARIANTS: tuple[str, ...] = (
    "none", "nothing", "dots", "dots_no_batch", "names", "scan", "scan_nested", "sequential",
    "budget_0.25", "budget_0.5", "budget_0.75",  # remat.residual_budget(F) on every block
)
TORCH_VARIANTS: tuple[str, ...] = ("none", "nothing", "sequential")
MODELS: tuple[str, ...] = ("mlp", "transformer")
ROW_KEYS: tuple[str, ...] = (
    "framework", "model", "depth", "variant", "saved_bytes", "temp_bytes", "peak_rss_bytes",
    "step_ms", "overhead",
)

#: What the ``names`` variant saves, per model (a list of ``remat.checkpoint_name`` tags).
NAMES_POLICY: dict[str, tuple[str, ...]] = {
    # the attention output of every block (the choice)
    "transformer": ("attn_out",),
    # the MLP's only tag: each block's pre-activation, i.e. its matmul output, so that only
    # the activation function is recomputed (close to "dots" for this model)
    "mlp": ("mlp_hidden",),
}

#: Seconds of idle time when the timing switches framework (not timed): long enough for
#: the other framework's spinning worker threads (PyTorch's OpenMP team, XLA's pool) to
#: go to sleep. Steps of one framework run back to back, as in a training loop: an idle
#: gap before every step made XLA:CPU's steps ~40% slower (its pool falls asleep), which
#: is not what a training loop sees.
GAP_S = 0.02

_POLICY: dict[str, Any] = {"nothing": "nothing", "dots": "dots", "dots_no_batch": "dots_no_batch"}


# --------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Model sizes (config fields other than depth) and the depths to run."""

    name: str
    depths: tuple[int, ...]
    transformer: dict[str, Any]
    mlp: dict[str, Any]
    steps: int = 5

    def model_kwargs(self, model: str) -> dict[str, Any]:
        return dict(getattr(self, model))


SIZES: dict[str, Sizes] = {
    "tiny": Sizes(
        "tiny", (2, 4),
        # activations larger than parameters, so that memory relations show at this size
        transformer=dict(vocab=32, width=32, heads=2, seq_len=64, batch=4),
        mlp=dict(in_dim=32, width=64, out_dim=8, batch=256, activation="relu"),
        steps=5,
    ),
    "quick": Sizes(
        "quick", (4, 8, 16),
        transformer=dict(vocab=256, width=128, heads=4, seq_len=64, batch=4),
        mlp=dict(in_dim=512, width=512, out_dim=16, batch=128, activation="relu"),
        steps=7,
    ),
    "full": Sizes(
        "full", (4, 8, 16, 32),
        transformer=dict(vocab=256, width=256, heads=4, seq_len=256, batch=8),
        mlp=dict(in_dim=1024, width=1024, out_dim=16, batch=256, activation="relu"),
        steps=7,
    ),
}


def segments_for(depth: int) -> int:
    """``round(sqrt(depth))``: the segments of the ``sequential`` variants (at least 1)."""
    return max(1, round(math.sqrt(depth)))


# --------------------------------------------------------------------------------------
# Memory helpers (Linux /proc; graceful elsewhere)
# --------------------------------------------------------------------------------------


from remat.analysis import current_rss_bytes as current_rss  # noqa: E402
from remat.analysis import proc_status_bytes as _status_bytes  # noqa: E402


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_bytes("VmHWM") is not None


class _Sampler:
    """Fallback when VmHWM cannot be reset: samples RSS every ~0.5 ms in a thread."""

    def __init__(self) -> None:
        self.peak = current_rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss())
            time.sleep(0.0005)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss())


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def _libc() -> Any:
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except (OSError, ImportError):
        return None


def malloc_mode(mode: str) -> bool:
    """Switches glibc's allocator between measuring memory and timing (False if not glibc).

    ``"measure"``: buffers over 128 KiB are mmap'd and go back to the kernel when freed,
    and free heap memory is trimmed, so that RSS tracks live bytes. ``"time"``: buffers
    up to 32 MiB come from the heap and are reused (glibc's steady state after its
    dynamic threshold has grown), so that steps are not timed with page faults and
    mmap/munmap calls for every tensor (which hits PyTorch, whose CPU allocator does not
    cache, far harder than XLA).
    """
    libc = _libc()
    if libc is None:
        return False
    if mode == "measure":
        libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
        libc.mallopt(_M_TRIM_THRESHOLD, 128 * 1024)
        libc.malloc_trim(0)
    elif mode == "time":
        libc.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)
        libc.mallopt(_M_TRIM_THRESHOLD, 64 * 2**20)
    else:
        raise ValueError(f"mode must be 'measure' or 'time', got {mode!r}")
    return True


def step_peak_rss(step: Callable[[], Any], before: Callable[[], Any] | None = None) -> tuple[int, str]:
    """(increase of peak RSS during one call of ``step``, method).

    ``before`` runs first, outside the measurement (PyTorch: drop the previous step's
    gradients, so that the baseline holds none, as in JAX where the step returns them).
    """
    if before is not None:
        before()
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
    baseline = current_rss()
    if _reset_hwm():
        step()
        peak = _status_bytes("VmHWM") or baseline
        return max(0, peak - baseline), "vmhwm_reset"
    with _Sampler() as s:
        step()
    return max(0, s.peak - baseline), "sampled"


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------


def _model_module(model: str) -> Any:
    from remat.models import mlp, transformer

    return {"mlp": mlp, "transformer": transformer}[model]


def model_config(model: str, depth: int, sizes: Sizes) -> Any:
    from remat.models import RematSettings

    mod = _model_module(model)
    cls = mod.TransformerConfig if model == "transformer" else mod.MLPConfig
    # The twin's own forward is not used (the benchmark applies checkpointing itself).
    return cls(depth=depth, remat=RematSettings.none(), **sizes.model_kwargs(model))


@dataclasses.dataclass
class Built:
    model: str
    depth: int
    config: Any
    jax_model: Any
    torch_model: Any
    inputs: np.ndarray
    targets: np.ndarray


def build(model: str, depth: int, sizes: Sizes, seed: int = 0) -> Built:
    """Both frameworks' models with identical weights, one batch and its targets."""
    mod = _model_module(model)
    config = model_config(model, depth, sizes)
    jm, tm, inputs = mod.build(config, seed)
    targets = mod.example_targets(config, seed)
    return Built(model, depth, config, jm, tm, np.asarray(inputs[0]), np.asarray(targets))


_OUTER = {"transformer": ("wte", "wpe", "ln_f", "head"), "mlp": ("inp", "head")}


# --------------------------------------------------------------------------------------
# JAX
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class JaxProgram:
    """One JAX variant: the loss, its parameters and the compiled gradient step."""

    variant: str
    loss: Callable
    params: Any
    x: Any
    y: Any
    compiled: Any
    compile_s: float

    def step(self) -> Any:
        import jax

        return jax.block_until_ready(self.compiled(self.params, self.x, self.y))


def _cross_entropy(logits: Any, y: Any) -> Any:
    import jax
    import jax.numpy as jnp

    logits = logits.reshape(-1, logits.shape[-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, y.reshape(-1, 1), axis=1))


def jax_loss(built: Built, variant: str) -> tuple[Callable, Any]:
    """``(loss(params, x, y), params)`` for ``variant``; ``params`` is what is differentiated.

    ``params = {"outer": {name: state}, "blocks": [state, ...]}``; for the scan variants
    ``"blocks"`` holds one state whose leaves are stacked along a leading layer axis, as
    a scanned model stores them.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from remat.models.mlp import jax_activation  # the model's own (remat.ops) activations
    from remat.scan import scan_layers

    if variant not in JAX_VARIANTS:
        raise ValueError(f"unknown JAX variant {variant!r}; use one of {', '.join(JAX_VARIANTS)}")
    jm, model, depth = built.jax_model, built.model, built.depth
    outer_gd, outer_params = {}, {}
    for name in _OUTER[model]:
        outer_gd[name], outer_params[name] = nnx.split(getattr(jm, name))
    splits = [nnx.split(b) for b in jm.blocks]
    block_gd = splits[0][0]
    block_states = [s for _, s in splits]
    scanned = variant in ("scan", "scan_nested")
    blocks = jax.tree.map(lambda *a: jnp.stack(a), *block_states) if scanned else block_states
    params = {"outer": outer_params, "blocks": blocks}
    act = jax_activation(getattr(built.config, "activation", "relu"))

    def prologue(outer: dict, x: Any) -> Any:
        if model == "transformer":
            return outer["wte"](x) + outer["wpe"](jnp.arange(x.shape[1]))
        return act(outer["inp"](x))

    def epilogue(outer: dict, h: Any) -> Any:
        if model == "transformer":
            return outer["head"](outer["ln_f"](h))
        return outer["head"](h)

    def apply_block(p: Any, h: Any) -> Any:
        return nnx.merge(block_gd, p)(h)

    def run_blocks(blocks: Any, h: Any) -> Any:
        if variant == "scan":
            return scan_layers(apply_block, blocks, h, policy="nothing")
        if variant == "scan_nested":
            return scan_layers(apply_block, blocks, h, policy="nothing", nested=True)
        modules = [nnx.merge(block_gd, p) for p in blocks]
        if variant == "none":
            for m in modules:
                h = m(h)
            return h
        if variant == "sequential":
            return remat.checkpoint_sequential(modules, segments_for(depth), h)
        if variant.startswith("budget_"):
            policy = remat.residual_budget(float(variant.removeprefix("budget_")))
        else:
            policy = list(NAMES_POLICY[model]) if variant == "names" else _POLICY[variant]
        for m in modules:
            h = remat.checkpoint(m, h, policy=policy)
        return h

    def loss(params: Any, x: Any, y: Any) -> Any:
        outer = {n: nnx.merge(outer_gd[n], params["outer"][n]) for n in _OUTER[model]}
        return _cross_entropy(epilogue(outer, run_blocks(params["blocks"], prologue(outer, x))), y)

    return loss, params


def jax_inputs(built: Built) -> tuple[Any, Any]:
    import jax.numpy as jnp

    x = built.inputs
    x = x.astype(np.int32) if np.issubdtype(x.dtype, np.integer) else x.astype(np.float32)
    return jnp.asarray(x), jnp.asarray(built.targets.astype(np.int32))


def jax_program(built: Built, variant: str) -> JaxProgram:
    import jax

    loss, params = jax_loss(built, variant)
    x, y = jax_inputs(built)
    t0 = time.perf_counter()
    compiled = jax.jit(jax.grad(loss)).lower(params, x, y).compile()
    return JaxProgram(variant, loss, params, x, y, compiled, time.perf_counter() - t0)


def _data_dependent_vars(jaxpr: Any, data_invars: list) -> set:
    """Variables of ``jaxpr`` that depend on ``data_invars`` (the batch), transitively.

    Nested jaxprs (jit, custom_jvp, scan, checkpoint) count as one equation whose outputs
    all depend on the batch when any input does (an over-estimate, never an under-).
    """
    from jax._src import core

    data = set(data_invars)
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, core.Literal) and v in data for v in eqn.invars):
            data.update(eqn.outvars)
    return data


def _nbytes(aval: Any) -> int:
    dtype = np.dtype(aval.dtype)
    return int(math.prod(aval.shape)) * int(getattr(dtype, "itemsize", 0) or 0)


def jax_saved_bytes(loss: Callable, params: Any, x: Any, y: Any) -> dict[str, int]:
    """``saved_bytes``, ``saved_param_bytes`` and ``residual_total_bytes`` of the loss of params.

    ``residual_total_bytes`` is every residual, deduplicated (the sum of the two, as for
    PyTorch in :func:`torch_saved_bytes`). ``saved_bytes`` counts the residuals that depend
    on the batch (inputs and targets included); the others (``saved_param_bytes``) are
    the parameters and what is computed from parameters and constants alone, such as the
    reshape of stacked parameters in the nested scan, the causal mask or the broadcast
    zeros of relu's derivative, which XLA folds into their consumers or which live in
    the model anyway. Found by a dependency pass over the jaxpr of the same ``jax.vjp``
    with the batch as explicit inputs.
    """
    import jax
    from jax._src import core

    def vjp_of_params(p: Any, xx: Any, yy: Any) -> Any:
        return jax.vjp(lambda q: loss(q, xx, yy), p)

    closed, out_shape = jax.make_jaxpr(vjp_of_params, return_shape=True)(params, x, y)
    jaxpr = closed.jaxpr
    num_res = jax.tree_util.tree_structure(out_shape[1]).num_leaves
    res_vars = jaxpr.outvars[len(jaxpr.outvars) - num_res:]
    n_data = len(jax.tree.leaves((x, y)))
    data = _data_dependent_vars(jaxpr, list(jaxpr.invars[len(jaxpr.invars) - n_data:]))
    seen: set = set()
    param_bytes = data_bytes = 0
    for v in res_vars:
        if isinstance(v, core.Literal) or v in seen:
            continue
        seen.add(v)
        if v in data:
            data_bytes += _nbytes(v.aval)
        else:
            param_bytes += _nbytes(v.aval)
    return {"saved_bytes": int(data_bytes), "saved_param_bytes": int(param_bytes),
            "residual_total_bytes": int(data_bytes + param_bytes)}


def jax_temp_bytes(program: JaxProgram) -> int:
    from remat.analysis import CompiledMemory

    return CompiledMemory.from_compiled(program.compiled).temp_bytes


# --------------------------------------------------------------------------------------
# PyTorch
# --------------------------------------------------------------------------------------


def _torch_act(name: str) -> Callable:
    import torch
    from torch.nn import functional as F

    return {"relu": torch.relu, "tanh": torch.tanh, "gelu": F.gelu}[name]


@dataclasses.dataclass
class TorchProgram:
    variant: str
    forward: Callable[[], Any]  # returns the loss
    params: list

    def zero(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> Any:
        self.zero()
        loss = self.forward()
        loss.backward()
        return loss


def torch_program(built: Built, variant: str) -> TorchProgram:
    import torch
    import torch.utils.checkpoint as tcp
    from torch.nn import functional as F

    if variant not in TORCH_VARIANTS:
        raise ValueError(f"unknown PyTorch variant {variant!r}; use one of {', '.join(TORCH_VARIANTS)}")
    tm, model, depth = built.torch_model, built.model, built.depth
    tm.train()
    x = torch.from_numpy(np.ascontiguousarray(built.inputs))
    y = torch.from_numpy(np.ascontiguousarray(built.targets)).long()
    blocks = list(tm.blocks)
    act = _torch_act(getattr(built.config, "activation", "relu"))

    def prologue() -> Any:
        return tm.embed(x) if model == "transformer" else act(tm.inp(x))

    def epilogue(h: Any) -> Any:
        return tm.head(tm.ln_f(h)) if model == "transformer" else tm.head(h)

    def forward() -> Any:
        h = prologue()
        if variant == "none":
            for b in blocks:
                h = b(h)
        elif variant == "nothing":
            for b in blocks:
                # looked up on the module at call time, so counting hooks can wrap it
                h = tcp.checkpoint(b, h, use_reentrant=False)
        else:
            h = tcp.checkpoint_sequential(blocks, segments_for(depth), h, use_reentrant=False)
        logits = epilogue(h)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    return TorchProgram(variant, forward, [p for p in tm.parameters() if p.requires_grad])


def torch_saved_bytes(program: TorchProgram) -> dict[str, int]:
    """Bytes of the tensors packed for the backward during one forward, by storage."""
    import torch

    param_ptrs = {p.untyped_storage().data_ptr() for p in program.params}
    storages: dict[int, int] = {}

    def pack(t: Any) -> Any:
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = program.forward()
    loss.backward()  # the saved tensors must be consumable: the graph is real
    for p in program.params:
        p.grad = None
    params = sum(n for ptr, n in storages.items() if ptr in param_ptrs)
    saved = sum(n for ptr, n in storages.items() if ptr not in param_ptrs)
    return {"saved_bytes": int(saved), "saved_param_bytes": int(params), "residual_total_bytes": int(saved + params)}


# --------------------------------------------------------------------------------------
# One (model, depth): every variant, timed in interleaved rounds
# --------------------------------------------------------------------------------------


def threads() -> int:
    """Threads both frameworks use: XLA:CPU's pool has one per core, so torch gets as many."""
    return os.cpu_count() or 1


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    del out
    return dt


@dataclasses.dataclass
class Prepared:
    """Every variant of one (model, depth), compiled and analysed, ready to be timed."""

    model: str
    depth: int
    entries: list  # (row, step, before-RSS hook) triples

    def run(self, steps: int) -> list[dict[str, Any]]:
        """Warm-up, one peak-RSS step per variant, then ``steps`` interleaved timed rounds.

        In each round every variant runs once, grouped by framework: one framework's
        variants back to back (their order rotating from round to round), a pause of
        :data:`GAP_S`, an untimed step of the first variant of the next group (it wakes
        that framework's threads), then that group; which framework goes first alternates.
        """
        if steps < 1:
            raise ValueError(f"steps must be at least 1, got {steps}")
        for _, step, _ in self.entries:
            _timed(step)
        malloc_mode("measure")
        for row, step, before in self.entries:
            row["peak_rss_bytes"], row["rss_method"] = step_peak_rss(step, before)
        malloc_mode("time")
        for _, step, _ in self.entries:  # settle the heap in timing mode
            _timed(step)
        groups: dict[str, list[int]] = {}
        for i, (row, _, _) in enumerate(self.entries):
            groups.setdefault(row["framework"], []).append(i)
        order = list(groups.values())
        times: list[list[float]] = [[] for _ in self.entries]
        for r in range(steps):
            for group in order[r % len(order):] + order[:r % len(order)]:
                k = r % len(group)
                group = group[k:] + group[:k]
                time.sleep(GAP_S)
                _timed(self.entries[group[0]][1])  # wake this framework's threads
                for i in group:
                    times[i].append(_timed(self.entries[i][1]))
        rows = []
        for (row, _, _), ts in zip(self.entries, times):
            row = dict(row)
            row["step_ms"] = round(statistics.median(ts) * 1e3, 3)
            row["step_ms_min"] = round(min(ts) * 1e3, 3)
            row["step_ms_max"] = round(max(ts) * 1e3, 3)
            row["steps"] = len(ts)
            rows.append(row)
        add_overheads(rows)
        return rows


def prepare_model(
    model: str,
    depth: int,
    sizes: Sizes,
    *,
    jax_variants: tuple[str, ...] = JAX_VARIANTS,
    torch_variants: tuple[str, ...] = TORCH_VARIANTS,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> Prepared:
    """Builds, compiles and analyses every variant (saved and temp bytes); no timing yet."""
    import torch

    log = log or (lambda s: None)
    n_threads = threads()
    torch.set_num_threads(n_threads)
    built = build(model, depth, sizes, seed)
    entries: list[tuple[dict[str, Any], Callable[[], Any], Any]] = []
    for v in jax_variants:
        prog = jax_program(built, v)
        row = _row("jax", model, depth, v, n_threads)
        t0 = time.perf_counter()
        row.update(jax_saved_bytes(prog.loss, prog.params, prog.x, prog.y))
        row["temp_bytes"] = int(jax_temp_bytes(prog))
        row["compile_s"] = round(prog.compile_s, 3)
        entries.append((row, prog.step, None))
        log(f"jax {model} depth {depth} {v}: compiled in {prog.compile_s:.1f}s, "
            f"residuals analysed in {time.perf_counter() - t0:.1f}s")
    for v in torch_variants:
        t0 = time.perf_counter()
        prog = torch_program(built, v)
        row = _row("torch", model, depth, v, n_threads)
        row.update(torch_saved_bytes(prog))
        row["temp_bytes"] = None
        row["compile_s"] = None
        entries.append((row, prog.step, prog.zero))
        log(f"torch {model} depth {depth} {v}: saved tensors counted in {time.perf_counter() - t0:.1f}s")
    return Prepared(model, depth, entries)


def measure_model(
    model: str,
    depth: int,
    sizes: Sizes,
    *,
    jax_variants: tuple[str, ...] = JAX_VARIANTS,
    torch_variants: tuple[str, ...] = TORCH_VARIANTS,
    steps: int | None = None,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """All rows for one model and depth, measured in this process.

    One flat dict per (framework, variant) with :data:`ROW_KEYS` plus
    ``saved_param_bytes``, ``residual_total_bytes``, ``compile_s``, ``step_ms_min``,
    ``step_ms_max``, ``steps``, ``rss_method``, ``threads`` and ``segments``.
    """
    prepared = prepare_model(model, depth, sizes, jax_variants=jax_variants,
                             torch_variants=torch_variants, seed=seed, log=log)
    return prepared.run(sizes.steps if steps is None else steps)


def _row(framework: str, model: str, depth: int, variant: str, n_threads: int) -> dict[str, Any]:
    return {
        "framework": framework, "model": model, "depth": int(depth), "variant": variant,
        "saved_bytes": None, "temp_bytes": None, "peak_rss_bytes": None, "step_ms": None,
        "overhead": None, "threads": n_threads,
        "segments": segments_for(depth) if variant == "sequential" else None,
    }


def add_overheads(rows: list[dict[str, Any]]) -> None:
    """``overhead = step_ms / step_ms`` of the same framework's ``none`` row (same model, depth)."""
    base = {(r["framework"], r["model"], r["depth"]): r["step_ms"] for r in rows if r["variant"] == "none"}
    for r in rows:
        b = base.get((r["framework"], r["model"], r["depth"]))
        r["overhead"] = round(r["step_ms"] / b, 4) if b and r["step_ms"] is not None else None


def process_info() -> dict[str, Any]:
    """What the process runs with: the user's XLA_FLAGS (if any), versions, threads."""
    import jax
    import torch

    return {
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax": jax.__version__, "torch": torch.__version__, "threads": threads(),
        "torch_threads": torch.get_num_threads(), "jax_devices": str(jax.devices()),
        "malloc_mode_switch": _libc() is not None,
    }


# --------------------------------------------------------------------------------------
# Worker entry point (run by benchmarks.run in a fresh process)
# --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """Worker: prepares one measurement, then obeys ``GO``/``DONE`` lines on stdin.

    Prints ``BENCH_READY`` once compiled; ``GO`` runs the timed part (the full
    measurement), then prints ``BENCH_RESULT {json}`` and exits; ``DONE`` (or end of
    input) before ``GO`` prints ``BENCH_RESULT`` without a result. The runner grants
    ``GO`` to one worker at a time and pauses the others meanwhile.
    """
    ap = argparse.ArgumentParser(description="one benchmark measurement (worker of benchmarks.run)")
    ap.add_argument("--model", required=True, choices=MODELS)
    ap.add_argument("--depth", required=True, type=int)
    ap.add_argument("--sizes", default="quick", choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args(argv)
    sizes = SIZES[args.sizes]
    steps = args.steps or sizes.steps
    import torch

    torch.set_num_threads(threads())
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    worker = prepare_model(args.model, args.depth, sizes, log=log)
    print("BENCH_READY", flush=True)
    result: Any = None
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "GO":
            t0 = time.perf_counter()
            result = worker.run(steps)
            log(f"timed part (warm-up, peak RSS, {steps} rounds) took {time.perf_counter() - t0:.1f}s")
            break
        elif cmd == "DONE":
            break
    print("BENCH_RESULT " + json.dumps({"result": result, "info": process_info()}), flush=True)


if __name__ == "__main__":
    main()

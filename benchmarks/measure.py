"""The measurements: one (model, depth) at a time, every variant of both frameworks.

For one model and depth, :func:`measure_model` builds the model of :mod:`remat.models`
(the NNX model and its PyTorch twin, with identical weights), prepares every JAX variant
(:mod:`benchmarks.jax_programs`: the model's own code, ``jax.jit(jax.grad(loss))``
compiled by :func:`remat.analysis.compiled_step`) and every PyTorch variant
(:mod:`benchmarks.torch_programs`), and then measures:

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
    step and read right after (:func:`remat.analysis.peak_rss_during`); the baseline is
    the RSS just before it (models, parameters, inputs and compiled programs resident,
    previous outputs and gradients freed). Each (model, depth) runs in a fresh process;
    while RSS is measured, glibc's allocator is switched
    (:func:`remat.analysis.allocator.malloc_mode`) so that buffers over 128 KiB are
    mmap'd and returned to the kernel when freed, so the high-water mark tracks live
    bytes; for the timed steps it is switched back to reusing its heap. When the
    high-water mark cannot be reset, the step's RSS is sampled in a thread instead
    (``rss_method`` says which).

``step_ms``
    Median over ``steps`` timed training steps (loss + gradient w.r.t. all parameters;
    JAX: the compiled program, ``block_until_ready``; PyTorch: forward + ``backward()``
    with the gradients reset to None first), after one warm-up step. All variants of
    both frameworks are timed in interleaved rounds (:func:`remat.analysis.time_programs`:
    one step of each per round, the order rotating), so that load from other processes
    hits them alike.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.cases import (
    GAP_S,
    JAX_VARIANTS,
    MODELS,
    NAMES_POLICY,
    ROW_KEYS,
    SIZES,
    TORCH_VARIANTS,
    Built,
    Sizes,
    add_overheads,
    build,
    model_config,
    segments_for,
)
from benchmarks.jax_programs import (
    JaxProgram,
    PlanInfeasible,
    jax_inputs,
    jax_loss,
    jax_program,
    jax_saved_bytes,
    jax_temp_bytes,
)
from benchmarks.torch_programs import TorchProgram, torch_program, torch_saved_bytes
from remat.analysis import peak_rss_during, time_programs
from remat.analysis.allocator import glibc, malloc_mode, trim_heap
from remat.analysis.timing import warm_up

# The measurement's names, wherever they live (tests and benchmarks.run import them from here).
__all__ = [
    "GAP_S", "JAX_VARIANTS", "MODELS", "NAMES_POLICY", "ROW_KEYS", "SIZES", "TORCH_VARIANTS", "Built", "JaxProgram",
    "Prepared", "Sizes", "TorchProgram", "add_overheads", "build", "jax_inputs", "jax_loss", "jax_program",
    "jax_saved_bytes", "jax_temp_bytes", "main", "malloc_mode", "measure_model", "model_config", "prepare_model",
    "process_info", "segments_for", "step_peak_rss", "threads", "torch_program", "torch_saved_bytes",
]


def step_peak_rss(step: Callable[[], Any], before: Callable[[], Any] | None = None) -> tuple[int, str]:
    """(increase of peak RSS during one call of ``step``, method).

    ``before`` runs first, outside the measurement (PyTorch: drop the previous step's
    gradients, so that the baseline holds none, as in JAX where the step returns them).
    """
    import jax

    if before is not None:
        before()
    gc.collect()
    trim_heap()
    p = peak_rss_during(lambda: jax.block_until_ready(step()))
    return p.increase_bytes, p.method


def threads() -> int:
    """Threads both frameworks use: XLA:CPU's pool has one per core, so torch gets as many."""
    return os.cpu_count() or 1


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
        import jax

        if steps < 1:
            raise ValueError(f"steps must be at least 1, got {steps}")
        programs = [step for _, step, _ in self.entries]
        warm_up(programs)
        malloc_mode("measure")
        for row, step, before in self.entries:
            row["peak_rss_bytes"], row["rss_method"] = step_peak_rss(step, before)
        malloc_mode("time")
        groups: dict[str, list[int]] = {}
        for i, (row, _, _) in enumerate(self.entries):
            groups.setdefault(row["framework"], []).append(i)

        def wake(group: list[int]) -> None:
            time.sleep(GAP_S)
            jax.block_until_ready(programs[group[0]]())  # wake this framework's threads

        # one untimed round first settles the heap in timing mode
        timings = time_programs(programs, rounds=steps, warmup=1, groups=list(groups.values()),
                                before_group=wake)
        rows = []
        for (row, _, _), ts, median in zip(self.entries, timings.samples_s, timings.medians_s()):
            row = dict(row)
            row["step_ms"] = round(median * 1e3, 3)
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
        try:
            prog = jax_program(built, v)
        except PlanInfeasible as e:  # a budget below what any plan reaches: no row, said in the log
            log(f"jax {model} depth {depth} {e}")
            continue
        row = _row("jax", model, depth, v, n_threads)
        t0 = time.perf_counter()
        row.update(jax_saved_bytes(prog.loss, prog.params, prog.x, prog.y))
        row["temp_bytes"] = int(prog.temp_bytes)
        row["compile_s"] = round(prog.compile_s, 3)  # plan_F: the whole planning time
        if prog.plan is not None:
            row["plan_choice"] = prog.plan.chosen.label
        entries.append((row, prog.step, None))
        log(f"jax {model} depth {depth} {v}: compiled in {prog.compile_s:.1f}s, "
            f"residuals analysed in {time.perf_counter() - t0:.1f}s")
    for v in torch_variants:
        t0 = time.perf_counter()
        prog = torch_program(built, v)
        row = _row("torch", model, depth, v, n_threads)
        row.update(torch_saved_bytes(prog))
        row["temp_bytes"] = None
        # torch.compile variants: the first step's seconds (compiling both graphs); eager: None
        row["compile_s"] = None if prog.compile_s is None else round(prog.compile_s, 3)
        entries.append((row, prog.step, prog.zero))
        log(f"torch {model} depth {depth} {v}: prepared and saved tensors counted in "
            f"{time.perf_counter() - t0:.1f}s")
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


def process_info() -> dict[str, Any]:
    """What the process runs with: the user's XLA_FLAGS (if any), versions, threads."""
    import jax
    import torch

    return {
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax": jax.__version__, "torch": torch.__version__, "threads": threads(),
        "torch_threads": torch.get_num_threads(), "jax_devices": str(jax.devices()),
        "malloc_mode_switch": glibc() is not None,
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
    ap.add_argument("--jax-variants", default=",".join(JAX_VARIANTS), help="comma-separated")
    ap.add_argument("--torch-variants", default=",".join(TORCH_VARIANTS), help="comma-separated")
    args = ap.parse_args(argv)
    sizes = SIZES[args.sizes]
    steps = args.steps or sizes.steps
    import torch

    torch.set_num_threads(threads())
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    worker = prepare_model(args.model, args.depth, sizes, log=log,
                           jax_variants=tuple(v for v in args.jax_variants.split(",") if v),
                           torch_variants=tuple(v for v in args.torch_variants.split(",") if v))
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

"""SmolLM-135M's shape beside HuggingFace PyTorch: peak RSS and step time, every variant in a fresh process.

``python -m benchmarks.hf_scale --quick --out DIR`` writes ``DIR/hf_scale.json`` (rows
``{framework, variant, precision, seq_len, batch_size, peak_rss_bytes, step_ms, tokens_per_s}``
and ``error`` for a variant that failed), ``DIR/hf_scale.md`` (command, commit, date,
machine, the table, the targets) and ``DIR/hf_scale.png`` (peak RSS against step time).

The model is :data:`remat.models.llama.CONFIGS` ``"smollm-135m"`` (random init at a fixed
seed; the remat twin holds the same weights). One training step is the mean next-token
cross-entropy and the gradients of every parameter (PyTorch: forward, ``backward()``;
remat: ``jax.jit(jax.value_and_grad(loss))``). The variants:

* torch ``eager``; ``hf_checkpoint`` (``gradient_checkpointing_enable()``, non-reentrant);
  ``compile`` (``torch.compile``); ``compile_budget_0.5`` and ``compile_budget_0``
  (``torch._functorch.config.activation_memory_budget``);
* remat ``no_checkpoint``; ``nothing`` (every layer ``remat.checkpoint``ed); the same two
  with :func:`remat.ops.chunked_cross_entropy` over the vocabulary (``*_chunked_ce``); ``plan`` and
  ``plan_scanned`` (``remat.plan(loss, ..., memory_limit=)`` at the ``hf_checkpoint`` row's
  measured peak, on the unrolled and on the layer-scanned model), and ``plan_chunked_ce``
  (the same limit on the unrolled model's chunked loss).

Precisions: ``float32``, and ``mixed``: ``torch.autocast("cpu", bfloat16)`` against remat's
mixed precision (:func:`remat.crosscheck.autocast.jax_model`: bfloat16 matmuls on float32
parameters), the loss in float32 on both sides.

Each (variant, precision) runs in a fresh process (``--worker``), and the rounds are
interleaved: round 1 runs every variant once, then round 2, so that load from other
processes hits them alike; a row's figures are the medians over its rounds. In a worker:
the model is built and one untimed step compiles it; then the increase of the process's
peak RSS over the loaded model (parameters, inputs, the compiled program) during one step
is read (:func:`remat.analysis.peak_rss_during`, glibc returning freed buffers); then
``steps`` steps are timed (median). The baseline holds no gradients in either framework
(PyTorch's of the step before are set to None first, as remat's are dropped with its
outputs); the step's own gradients count in both. Progress goes to stderr; a variant that fails (out of
memory, a compile error, a timeout) becomes a row with its ``error``.

``--gradients`` instead measures criterion 1: remat's float32 gradients of all 30 layers
(per-layer checkpointed on both sides, :func:`remat.crosscheck.compare_gradients`) against
PyTorch's, and the float32 floor: PyTorch against itself with 1 and 2 threads (bitwise equal
here) and against itself in float64.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.results import write_result

ROOT = Path(__file__).resolve().parent.parent
TORCH_VARIANTS = ("eager", "hf_checkpoint", "compile", "compile_budget_0.5", "compile_budget_0")
REMAT_VARIANTS = ("no_checkpoint", "nothing", "no_checkpoint_chunked_ce", "nothing_chunked_ce", "plan",
                  "plan_scanned", "plan_chunked_ce")
PRECISIONS = ("float32", "mixed")
ROW_KEYS = ("framework", "variant", "precision", "seq_len", "batch_size", "peak_rss_bytes", "step_ms",
            "tokens_per_s")
# chunked_cross_entropy over the vocabulary, 4096 entries a chunk: [tokens, 4096] float32 logits
# (4 MiB at 256 tokens), and the head's gradient written a chunk of rows at a time, with no
# [vocab, width] accumulator (chunking over tokens needs one: 108 MiB at vocab 49152)
CE_CHUNK = 4096
WORKER_TIMEOUT_S = 1800.0


@dataclasses.dataclass(frozen=True)
class Shape:
    """The benchmark's sizes: sequence length, batch, rounds and timed steps per round."""

    seq_len: int
    batch_size: int
    rounds: int
    steps: int


FULL = Shape(seq_len=512, batch_size=2, rounds=3, steps=5)
QUICK = Shape(seq_len=256, batch_size=1, rounds=2, steps=3)


# --------------------------------------------------------------------------------------
# One variant, in the worker process
# --------------------------------------------------------------------------------------


def _config(name: str, shape: Shape, remat_settings: Any) -> Any:
    from remat.models import llama

    return dataclasses.replace(llama.CONFIGS[name], seq_len=shape.seq_len, batch=shape.batch_size,
                               remat=remat_settings)


def _data(config: Any, seed: int) -> tuple[Any, Any]:
    from remat.models import llama

    return llama.example_inputs(config, seed)[0], llama.example_targets(config, seed)


def torch_step(variant: str, precision: str, config_name: str, shape: Shape, seed: int = 0) -> Callable[[], Any]:
    """One PyTorch training step of ``variant`` (a closure: zero the grads, forward, backward)."""
    import torch

    from remat.models import RematSettings, llama

    torch.manual_seed(seed)
    config = _config(config_name, shape, RematSettings.none())
    model = llama.make_torch_model(config).train()
    if variant == "hf_checkpoint":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    forward: Callable[..., Any] = model
    if variant.startswith("compile"):
        if variant.startswith("compile_budget_"):
            torch._functorch.config.activation_memory_budget = float(variant.rsplit("_", 1)[1])
        forward = torch.compile(model)
    ids, labels = (torch.from_numpy(a) for a in _data(config, seed))
    params = list(model.parameters())

    def release() -> None:  # the gradients of the step before, as remat's are dropped with its outputs
        for p in params:
            p.grad = None

    def step() -> Any:
        release()
        with torch.autocast("cpu", dtype=torch.bfloat16) if precision == "mixed" else contextlib.nullcontext():
            logits = forward(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))
        loss.backward()
        return loss

    step.release = release  # type: ignore[attr-defined]
    return step


def jax_loss(model: Any, chunked: bool) -> tuple[Callable[..., Any], Any]:
    """``(loss(params, ids, labels), params)`` of an NNX Llama: mean next-token cross-entropy in float32."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from remat import ops

    graphdef, params = nnx.split(model)

    def loss(params: Any, ids: Any, labels: Any) -> Any:
        m = nnx.merge(graphdef, params)
        if chunked:
            h = m.hidden(ids)
            return ops.chunked_cross_entropy(h, m.head_weight().astype(h.dtype), labels, chunk=CE_CHUNK, over="vocab")
        logits = m(ids).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return loss, params


def jax_step(variant: str, precision: str, config_name: str, shape: Shape, memory_limit: int | None,
             seed: int = 0) -> Callable[[], Any]:
    """One remat training step of ``variant`` (a closure running the compiled ``value_and_grad``)."""
    import jax

    grad_fn, args = jax_program(variant, precision, config_name, shape, memory_limit, seed)
    compiled = jax.jit(grad_fn)

    def step() -> Any:
        return jax.block_until_ready(compiled(*args))

    return step


def jax_program(variant: str, precision: str, config_name: str, shape: Shape, memory_limit: int | None,
                seed: int = 0) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """``(value_and_grad(loss), (params, ids, labels))`` of a remat ``variant``, not yet compiled."""
    import jax
    import jax.numpy as jnp

    import remat
    from remat.crosscheck.autocast import jax_model
    from remat.models import RematSettings, llama
    from remat.models._twin import build_pair

    settings = RematSettings.none() if variant.startswith("no_checkpoint") else RematSettings()
    config = _config(config_name, shape, settings)
    model, torch_model = build_pair(llama.LlamaForCausalLM, llama.make_torch_model, config, seed)
    del torch_model
    if precision == "mixed":
        model = jax_model(model, "mixed")
    if variant == "plan_scanned":
        model = llama.ScannedLlamaForCausalLM(model)
    loss, params = jax_loss(model, chunked=variant.endswith("chunked_ce"))
    ids, labels = (jnp.asarray(a, jnp.int32) for a in _data(config, seed))
    if variant.startswith("plan"):
        if memory_limit is None:
            raise ValueError("the plan variants need --memory-limit (the hf_checkpoint row's peak)")
        # memory_limit is the rise over the loaded model that the HF-checkpointed run needed;
        # the plan's limit is the compiled step's whole footprint, which holds the parameters too
        loaded = sum(x.nbytes for x in jax.tree.leaves(params))
        loss = remat.plan(loss, params, ids, labels, memory_limit=memory_limit + loaded).apply(loss)
    return jax.value_and_grad(loss), (params, ids, labels)


def explain(variant: str, precision: str, config_name: str, shape: Shape, top: int = 12) -> str:
    """``remat.explain`` of a remat variant's training step: what holds its compiled peak."""
    import remat

    grad_fn, args = jax_program(variant, precision, config_name, shape, None)
    report = remat.explain(grad_fn, *args)
    head = (f"remat explain, hf_scale {variant} {precision}, {config_name} seq {shape.seq_len} "
            f"batch {shape.batch_size}: temp {report.temp_bytes / 2**20:.1f} MiB")
    from remat.explainer.explanation import format_bytes

    temp = [[format_bytes(b.bytes), b.kind, b.module or "-", b.source or "-", b.shape or "-", b.region or "-",
             b.rule or "-"] for b in report.temp_peak_buffers[:top]]  # the parameters are arguments, not temp
    table_rows = [report.columns, ["---"] * len(report.columns), *temp]
    return "\n".join([head, "", *report.summary(), "", *("| " + " | ".join(r) + " |" for r in table_rows)])


def measure(step: Callable[[], Any], steps: int, progress: Callable[[str], None]) -> dict[str, Any]:
    """One untimed step (compiles), the peak RSS increase of one step, then ``steps`` timed steps."""
    from remat.analysis import peak_rss_during
    from remat.analysis.allocator import malloc_mode

    t0 = time.perf_counter()
    step()
    first_s = time.perf_counter() - t0
    progress(f"first step (compiles) {first_s:.1f} s")
    malloc_mode("measure")
    getattr(step, "release", lambda: None)()  # the baseline holds no gradients in either framework
    rss = peak_rss_during(step)
    malloc_mode("time")
    step()
    times = []
    for i in range(steps):
        t = time.perf_counter()
        step()
        times.append((time.perf_counter() - t) * 1e3)
        progress(f"step {i + 1}/{steps}: {times[-1]:.0f} ms")
    return {"peak_rss_bytes": rss.increase_bytes, "baseline_rss_bytes": rss.baseline_bytes,
            "rss_method": rss.method, "first_step_s": round(first_s, 2), "step_ms": statistics.median(times),
            "step_ms_all": [round(t, 1) for t in times]}


def run_worker(framework: str, variant: str, precision: str, config_name: str, shape: Shape,
               memory_limit: int | None = None) -> dict[str, Any]:
    """Measures one variant here and returns its row (``error`` set if it failed)."""
    row: dict[str, Any] = {"framework": framework, "variant": variant, "precision": precision,
                           "seq_len": shape.seq_len, "batch_size": shape.batch_size}

    def progress(message: str) -> None:
        print(f"  {framework} {variant} {precision}: {message}", file=sys.stderr, flush=True)

    try:
        if framework == "torch":
            step = torch_step(variant, precision, config_name, shape)
        else:
            step = jax_step(variant, precision, config_name, shape, memory_limit)
        row.update(measure(step, shape.steps, progress))
    except Exception as e:  # a failed variant is a row with its error, not a failed run
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        return row
    row["tokens_per_s"] = shape.seq_len * shape.batch_size / (row["step_ms"] / 1e3)
    return row


# --------------------------------------------------------------------------------------
# The controller: fresh processes, interleaved rounds
# --------------------------------------------------------------------------------------


def _worker_command(framework: str, variant: str, precision: str, config_name: str, shape: Shape,
                    memory_limit: int | None) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks.hf_scale", "--worker", f"{framework}:{variant}",
           "--precision", precision, "--config", config_name, "--seq", str(shape.seq_len),
           "--batch", str(shape.batch_size), "--steps", str(shape.steps)]
    return cmd + (["--memory-limit", str(memory_limit)] if memory_limit is not None else [])


def _worker_env(out: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env.pop("MALLOC_MMAP_THRESHOLD_", None)  # the worker switches glibc's allocator itself
    env.pop("MALLOC_TRIM_THRESHOLD_", None)
    return env


def run_in_fresh_process(framework: str, variant: str, precision: str, config_name: str, shape: Shape,
                         memory_limit: int | None, out: Path, timeout_s: float = WORKER_TIMEOUT_S) -> dict[str, Any]:
    """Runs one worker; its stderr streams to ours (progress) and its row comes back on stdout."""
    base = {"framework": framework, "variant": variant, "precision": precision, "seq_len": shape.seq_len,
            "batch_size": shape.batch_size}
    cmd = _worker_command(framework, variant, precision, config_name, shape, memory_limit)
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=_worker_env(out), stdout=subprocess.PIPE, stderr=None,
                              text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {**base, "error": f"timeout after {timeout_s:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith("HF_SCALE_ROW "):
            return json.loads(line[len("HF_SCALE_ROW "):])
    why = "killed (out of memory?)" if done.returncode < 0 else f"exit status {done.returncode}"
    return {**base, "error": f"worker died: {why}"}


def merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from a variant's rounds: medians of ``step_ms`` and ``peak_rss_bytes``; an error if all failed."""
    good = [r for r in rounds if "error" not in r]
    if not good:
        return {**rounds[-1], "rounds": len(rounds)}
    row = {k: good[0][k] for k in ("framework", "variant", "precision", "seq_len", "batch_size")}
    row["step_ms"] = statistics.median(r["step_ms"] for r in good)
    row["peak_rss_bytes"] = int(statistics.median(r["peak_rss_bytes"] for r in good))
    row["tokens_per_s"] = row["seq_len"] * row["batch_size"] / (row["step_ms"] / 1e3)
    row["step_ms_rounds"] = [round(r["step_ms"], 1) for r in good]
    row["peak_rss_rounds"] = [r["peak_rss_bytes"] for r in good]
    row["first_step_s"] = statistics.median(r["first_step_s"] for r in good)
    row["rounds"] = len(good)
    errors = [r["error"] for r in rounds if "error" in r]
    if errors:
        row["round_errors"] = errors
    return row


def variants(only: list[str] | None = None) -> list[tuple[str, str]]:
    """``(framework, variant)`` pairs, torch's hf_checkpoint before the plans (they need its peak)."""
    # torch.compile's (minutes each) last, so that a run cut short has the rest
    every = [("torch", v) for v in TORCH_VARIANTS if not v.startswith("compile")]
    every += [("remat", v) for v in REMAT_VARIANTS] + [("torch", v) for v in TORCH_VARIANTS if v.startswith("compile")]
    return [fv for fv in every if only is None or f"{fv[0]}:{fv[1]}" in only or fv[1] in only]


def run_benchmark(shape: Shape, out: Path, *, precisions: tuple[str, ...] = PRECISIONS,
                  config_name: str = "smollm-135m", only: list[str] | None = None,
                  log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every (variant, precision) in fresh processes, round after round; writes the results into ``out``."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    chosen = variants(only)
    per_variant: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    limits: dict[str, int] = {}
    total = shape.rounds * len(precisions) * len(chosen)
    n, data = 0, {}
    for r in range(shape.rounds):
        for precision in precisions:
            for framework, variant in chosen:
                n += 1
                log(f"[{n}/{total}] round {r + 1}/{shape.rounds} {framework} {variant} {precision} "
                    f"(elapsed {time.perf_counter() - t0:.0f} s)")
                limit = limits.get(precision) if variant.startswith("plan") else None
                row = run_in_fresh_process(framework, variant, precision, config_name, shape, limit, out)
                if variant == "hf_checkpoint" and "error" not in row:
                    limits.setdefault(precision, row["peak_rss_bytes"])
                log(f"    -> {row.get('error') or _brief(row)}")
                per_variant.setdefault((framework, variant, precision), []).append(row)
                data = write_results(out, per_variant, run_meta(shape, time.perf_counter() - t0, config_name))
    return data


def write_results(out: Path, per_variant: dict[Any, list[dict[str, Any]]], meta: dict[str, Any]) -> dict[str, Any]:
    """``hf_scale.json``, ``.md`` and ``.png`` of the rounds so far (rewritten after every variant)."""
    rows = [merge_rounds(rs) for rs in per_variant.values()]
    data = {"meta": meta, "rows": rows, "targets": targets(rows)}
    (out / "hf_scale.json").write_text(json.dumps(data, indent=1))
    (out / "hf_scale.md").write_text(markdown(data))
    plot(rows, out / "hf_scale.png")
    return data


def _brief(row: dict[str, Any]) -> str:
    return f"peak +{row['peak_rss_bytes'] / 2**20:.0f} MiB, {row['step_ms']:.0f} ms"


def run_meta(shape: Shape, wall_s: float, config_name: str) -> dict[str, Any]:
    """Command, commit, date, machine and versions of this run."""
    import platform

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()
        except OSError:
            return "?"

    versions = {}
    for name in ("jax", "flax", "torch", "transformers"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    return {"command": "python -m benchmarks.hf_scale " + " ".join(sys.argv[1:]),
            "commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain", "-uno")),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": _machine(platform),
            "loadavg_end": _loadavg(), "wall_s": round(wall_s, 1), "config": config_name,
            "shape": dataclasses.asdict(shape), "versions": versions}


def _machine(platform: Any) -> str:
    import psutil

    mem = psutil.virtual_memory().total / 2**30
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {mem:.0f} GiB, {platform.system()}"


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def _find(rows: list[dict[str, Any]], framework: str, variant: str, precision: str) -> dict[str, Any] | None:
    for r in rows:
        if (r["framework"], r["variant"], r["precision"]) == (framework, variant, precision) and "error" not in r:
            return r
    return None


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 36's targets per precision: a remat row within hf_checkpoint's peak and time; no_checkpoint vs eager."""
    found = []
    for precision in PRECISIONS:
        hf, eager = _find(rows, "torch", "hf_checkpoint", precision), _find(rows, "torch", "eager", precision)
        plain = _find(rows, "remat", "no_checkpoint", precision)
        if hf is not None:
            fits = [r for r in rows if r["framework"] == "remat" and r["precision"] == precision and "error" not in r
                    and r["peak_rss_bytes"] <= hf["peak_rss_bytes"] and r["step_ms"] <= hf["step_ms"]]
            found.append({"precision": precision, "target": "a remat row at <= hf_checkpoint's peak RSS and step time",
                          "met": bool(fits), "rows": [r["variant"] for r in fits]})
        if eager is not None and plain is not None:
            found.append({"precision": precision, "target": "remat no_checkpoint no slower than torch eager",
                          "met": plain["step_ms"] <= eager["step_ms"],
                          "ratio": round(plain["step_ms"] / eager["step_ms"], 3)})
    return found


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown table: one line per row, the errors written out."""
    lines = ["| precision | framework | variant | peak RSS MiB | step ms | tokens/s | rounds (ms) |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["precision"], r["framework"] != "torch")):
        head = f"| {r['precision']} | {r['framework']} | {r['variant']} "
        if "error" in r:
            lines.append(head + f"| - | - | - | error: {r['error'].replace('|', '/')} |")
            continue
        rounds = ", ".join(f"{t:.0f}" for t in r.get("step_ms_rounds", []))
        lines.append(head + f"| {r['peak_rss_bytes'] / 2**20:.0f} | {r['step_ms']:.0f} | {r['tokens_per_s']:.0f} "
                            f"| {rounds} |")
    return lines


def markdown(data: dict[str, Any]) -> str:
    """The result file: how it was run, the table and the targets."""
    m = data["meta"]
    s = m["shape"]
    lines = [f"# hf_scale: {m['config']} beside HuggingFace PyTorch", "",
             f"`{m['command']}` at commit {m['commit']}{' (dirty)' if m['dirty'] else ''}, {m['date']}, "
             f"{m['machine']}; load average at the end {m['loadavg_end']}; {m['wall_s']:.0f} s. "
             f"seq {s['seq_len']}, batch {s['batch_size']}, {s['rounds']} rounds of {s['steps']} timed steps, "
             "each variant in a fresh process per round; figures are medians over the rounds. "
             f"Versions: {', '.join(f'{k} {v}' for k, v in m['versions'].items())}.", "",
             "`peak RSS` is the increase of the process's peak resident memory during one training step over the "
             "loaded model (parameters, inputs, compiled program).", "", *table(data["rows"]), "", "Targets:", ""]
    for t in data["targets"]:
        extra = f" (ratio {t['ratio']})" if "ratio" in t else (f" ({', '.join(t['rows'])})" if t.get("rows") else "")
        lines.append(f"- {t['precision']}: {t['target']}: {'met' if t['met'] else 'missed'}{extra}")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Peak RSS against step time, one panel per precision, each point labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PRECISIONS), figsize=(12, 5), squeeze=False)
    for ax, precision in zip(axes[0], PRECISIONS):
        for r in rows:
            if r["precision"] != precision or "error" in r:
                continue
            color = "tab:red" if r["framework"] == "torch" else "tab:blue"
            x, y = r["step_ms"], r["peak_rss_bytes"] / 2**20
            ax.scatter([x], [y], color=color)
            ax.annotate(f"{r['framework']} {r['variant']}", (x, y), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        ax.set_title(precision)
        ax.set_xlabel("step ms (median)")
        ax.set_ylabel("peak RSS over the loaded model, MiB")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------
# Criterion 1: float32 gradients at full depth, and the summation-order floor
# --------------------------------------------------------------------------------------


def _distribution(named: dict[str, float]) -> dict[str, Any]:
    import numpy as np

    values = np.array(list(named.values()))
    worst = sorted(named.items(), key=lambda kv: -kv[1])[:5]
    return {"median": float(np.median(values)), "p90": float(np.percentile(values, 90)),
            "max": float(values.max()), "worst": worst, "tensors": len(values)}


def _torch_grads(model: Any, ids: Any, threads: int) -> dict[str, Any]:
    """Gradients of the sum of the logits (compare_gradients' default loss) with ``threads`` threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model.zero_grad(set_to_none=True)
        model(input_ids=torch.from_numpy(ids)).logits.sum().backward()
        return {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}
    finally:
        torch.set_num_threads(before)


def gradient_check(config_name: str = "smollm-135m", seed: int = 0) -> dict[str, Any]:
    """remat vs PyTorch float32 gradients (per-layer checkpointed on both); PyTorch against itself with
    1 and 2 threads, and PyTorch float32 against PyTorch float64 (its own float32 error).

    The relative error of a tensor is ``max|a - b| / max|b|`` (:mod:`remat.crosscheck.report`).
    """
    import numpy as np

    from remat import crosscheck
    from remat.models import llama

    config = llama.CONFIGS[config_name]
    jax_model, torch_model, inputs = llama.build(config, seed)
    report = crosscheck.compare_gradients(jax_model, torch_model, inputs, dtype="float32")
    remat_vs_torch = {r.name: r.max_rel for r in report.rows if r.kind == "param"}
    one, two = _torch_grads(torch_model, inputs[0], 1), _torch_grads(torch_model, inputs[0], 2)

    def rel(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
        return {n: float(np.max(np.abs(a[n] - b[n])) / max(float(np.max(np.abs(b[n]))), 1e-30)) for n in b}

    own = _own_float32_errors(jax_model, torch_model, inputs)
    return {"config": config_name, "seq_len": config.seq_len, "batch_size": config.batch, "ok": report.ok,
            "remat_vs_torch": _distribution(remat_vs_torch), "torch_1_vs_2_threads": _distribution(rel(one, two)),
            "remat_float32_vs_float64": _distribution({r.name: r.err_jax for r in own}),
            "torch_float32_vs_float64": _distribution({r.name: r.err_torch for r in own}),
            "worst_own_error_ratio": _worst_ratio(own),
            "outputs_rel": {r.name: r.max_rel for r in report.rows if r.kind == "output"}}


def gradients_markdown(result: dict[str, Any]) -> str:
    """The result of :func:`gradient_check` as a Markdown table and its worst tensors."""
    rows = (("remat vs PyTorch, both float32", "remat_vs_torch"),
            ("remat float32 vs the float64 twin", "remat_float32_vs_float64"),
            ("PyTorch float32 vs the float64 twin", "torch_float32_vs_float64"),
            ("PyTorch float32, 1 thread vs 2 threads", "torch_1_vs_2_threads"))
    lines = [f"{result['config']}, seq {result['seq_len']}, batch {result['batch_size']}, every layer checkpointed "
             "on both sides: each parameter gradient's relative error, `max|a - b| / max|b|` between the "
             "frameworks and between thread counts (the cross-check's), `||a - b|| / ||b||` against the "
             "float64 twin (its precision criterion's).", "",
             "| | tensors | median | p90 | max | worst |", "|---|---|---|---|---|---|"]
    for title, key in rows:
        d = result[key]
        lines.append(f"| {title} | {d['tensors']} | {d['median']:.3g} | {d['p90']:.3g} | {d['max']:.3g} | "
                     f"`{d['worst'][0][0]}` |")
    w = result["worst_own_error_ratio"]
    lines += ["", f"The largest ratio of remat's float32 error to PyTorch's on one tensor: {w['ratio']:.2f} "
              f"(`{w['name']}`, {w['remat']:.3g} against {w['torch']:.3g})."]
    return "\n".join(lines) + "\n"


def _own_float32_errors(jax_model: Any, torch_model: Any, inputs: Any) -> list[Any]:
    """Each parameter gradient's :class:`~remat.crosscheck.precision.PrecisionRow` in float32.

    Both float32 runs are measured against the same float64 truth (PyTorch in float64), the
    crosscheck's precision criterion (:mod:`remat.crosscheck.precision`) applied to float32.
    """
    from remat.crosscheck.outputs import jax_sum, selectors, torch_sum
    from remat.crosscheck.precision_runs import precision_gradients
    from remat.crosscheck.weights import TorchNaming, _variables

    naming = TorchNaming(torch_model, None, None, list(_variables(jax_model)))
    report = precision_gradients(jax_model, torch_model, tuple(inputs), precision="float32", modes=("train",),
                                 checkpoint=False, losses=(jax_sum, torch_sum), selectors=selectors(None),
                                 channels_last=False, naming=naming)
    return [r for r in report.rows if r.kind == "param"]


def _worst_ratio(rows: list[Any]) -> dict[str, Any]:
    """The tensor whose remat error is the largest multiple of PyTorch's own (``PrecisionRow.ratio``)."""
    worst = max(rows, key=lambda r: r.ratio)
    return {"name": worst.name, "ratio": worst.ratio, "remat": worst.err_jax, "torch": worst.err_torch}


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="SmolLM-135M's shape beside HuggingFace PyTorch (issue 36)")
    ap.add_argument("--quick", action="store_true", help="seq 256, batch 1, 2 rounds of 3 steps")
    ap.add_argument("--out", default="hf-scale-out", help="the results folder")
    ap.add_argument("--only", default=None, help="comma-separated variants (e.g. eager,remat:nothing)")
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--config", default="smollm-135m", help="a named config of remat.models.llama")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--gradients", action="store_true", help="criterion 1: the float32 gradient check, as JSON")
    ap.add_argument("--explain", default=None, metavar="VARIANT",
                    help="print remat.explain of a remat variant's step (--precision) instead")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="float32", help="with --explain: float32 or mixed")
    ap.add_argument("--memory-limit", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    base = QUICK if args.quick else FULL
    shape = Shape(args.seq or base.seq_len, args.batch or base.batch_size, args.rounds or base.rounds,
                  args.steps or base.steps)
    if args.worker:
        framework, variant = args.worker.split(":")
        row = run_worker(framework, variant, args.precision, args.config, shape, args.memory_limit)
        print("HF_SCALE_ROW " + json.dumps(row), flush=True)
        return 0
    if args.explain:
        print(explain(args.explain, args.precision, args.config, shape))
        return 0
    if args.gradients:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result = gradient_check(args.config)
        (out / "hf_scale_gradients.json").write_text(json.dumps(result, indent=1))
        write_result(str(out), "hf_scale_gradients", gradients_markdown(result), argv, module="benchmarks.hf_scale")
        print(json.dumps(result, indent=1))
        return 0 if result["ok"] else 1
    only = args.only.split(",") if args.only else None
    data = run_benchmark(shape, Path(args.out), precisions=tuple(args.precisions.split(",")),
                         config_name=args.config, only=only)
    print(markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m benchmarks.run [--quick] [--frontier] [--out DIR]``: remat vs PyTorch.

Measures the MLP and the transformer of :mod:`models` at several depths (``--quick``:
4, 8 and 16 layers; default: up to 32), in JAX (``no_checkpoint``, ``nothing``, ``dots``,
``dots_no_batch``, ``names``, ``scan``, ``scan_nested``, ``sequential``, ``budget_F``,
``whole``, ``whole_nested``) and PyTorch (``no_checkpoint``, ``nothing``, ``sequential``,
``torch_compile_F``), and writes to ``--out``:

* ``results.json``: ``{"meta": ..., "rows": [...], "ratios": [...], "targets": [...]}``;
  every row a flat object with ``framework``, ``model``, ``depth``,
  ``variant``, ``saved_bytes``, ``temp_bytes``, ``peak_rss_bytes``, ``step_ms``,
  ``overhead`` (and a few extra fields, see :func:`benchmarks.measure.measure_model`);
* ``results.md``: the tables, the JAX/PyTorch ratios and the targets;
* ``memory_vs_time.png``;
* with ``--frontier`` (the variants of :mod:`benchmarks.frontier`, ``remat.plan`` at five
  budgets among them; depths 8 and 16): ``frontier.md`` and ``frontier.png``.

How it runs: every (model, depth) is measured in a fresh worker process
(``python -m benchmarks.measure``) holding all variants of both frameworks. Up to
``--jobs`` workers build and compile at the same time (compilation dominates the run
time), but only one at a time runs its timed part: the runner pauses every other worker
(SIGSTOP) until it is done, so timings never share the CPU with our own compilation.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from benchmarks import frontier, report
from benchmarks.cases import JAX_VARIANTS, MODELS, NAMES_POLICY, SIZES, TORCH_VARIANTS, Sizes
from benchmarks.results import add_results_argument, write_result

ROOT = Path(__file__).resolve().parents[1]


class WorkerFailed(RuntimeError):
    pass


class Worker:
    """One ``python -m benchmarks.measure`` process and its stdout lines."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path,
                 events: queue.Queue, meta: dict[str, Any]):
        self.name, self.meta = name, meta
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.measure", *args], cwd=ROOT, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, bufsize=1,
        )
        self.ready = False
        self.stopped = False
        self.started = time.perf_counter()
        self._events = events
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._events.put((self, line.rstrip("\n")))
        self._events.put((self, None))

    def send(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def pause(self) -> None:
        if not self.stopped and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGSTOP)
            self.stopped = True

    def resume(self) -> None:
        if self.stopped and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
        self.stopped = False

    def close(self) -> None:
        self.resume()
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def log_tail(self, n: int = 5) -> str:
        try:
            lines = self.log_path.read_text().strip().splitlines()
        except OSError:
            return ""
        return " | ".join(lines[-n:])


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def worker_env() -> dict[str, str]:
    """The workers' environment: ours, with the repository on ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    # The worker switches glibc's allocator itself (remat.analysis.allocator.malloc_mode): no env override.
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    env.pop("MALLOC_TRIM_THRESHOLD_", None)
    # torch.compile's first step is timed cold, as remat.plan's compiles are: no reuse of
    # graphs that an earlier run (or variant) left in inductor's on-disk caches
    env.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    env.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
    return env


class Runner:
    """Schedules workers: ``jobs`` preparing at once, one timing at a time."""

    def __init__(self, out: Path, jobs: int, log=print, timeout_s: float = 1800.0):
        self.out, self.jobs, self.log, self.timeout_s = out, max(1, jobs), log, timeout_s
        self.log_dir = out / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.events: queue.Queue = queue.Queue()
        self.failures: list[str] = []

    def run(self, tasks: list[dict[str, Any]]) -> list[tuple[dict[str, Any], Any]]:
        """``tasks``: ``{"name", "args", "env", ...}`` (the rest is kept as the worker's meta).

        Returns ``(task, BENCH_RESULT payload)`` for each task that succeeded.
        """
        pending = deque(tasks)
        active: list[Worker] = []
        results: list[tuple[dict[str, Any], Any]] = []
        deferred: deque = deque()

        def start() -> None:
            while pending and len(active) < self.jobs:
                t = pending.popleft()
                w = Worker(t["name"], t["args"], t["env"], self.log_dir, self.events, t)
                active.append(w)
                self.log(f"[{time.strftime('%H:%M:%S')}] start {w.name}")

        def next_event(timeout: float) -> tuple[Worker, str | None]:
            if deferred:
                return deferred.popleft()
            return self.events.get(timeout=timeout)

        def fail(w: Worker, why: str) -> None:
            msg = f"{w.name}: {why}; log: {w.log_tail()}"
            self.failures.append(msg)
            self.log("FAILED " + msg)
            if w in active:
                active.remove(w)
            w.close()

        def exclusive(w: Worker) -> None:
            """Pauses every other worker and runs the timed part of ``w``."""
            others = [o for o in active if o is not w]
            for o in others:
                o.pause()
            try:
                w.send("GO")
                payload = self._await(w, "BENCH_RESULT", deferred)
                results.append((w.meta, payload))
                self.log(f"[{time.strftime('%H:%M:%S')}] done {w.name} "
                         f"({time.perf_counter() - w.started:.0f}s)")
            except WorkerFailed as e:
                self.failures.append(str(e))
                self.log("FAILED " + str(e))
            finally:
                if w in active:
                    active.remove(w)
                w.close()
                for o in others:
                    o.resume()

        start()
        while active or pending:
            start()
            try:
                w, line = next_event(timeout=self.timeout_s)
            except queue.Empty:
                for w in list(active):
                    fail(w, f"no output for {self.timeout_s:.0f}s")
                continue
            if w not in active:
                continue
            if line is None:
                fail(w, f"exited with code {w.proc.wait()} before it was ready")
                continue
            if not line.startswith("BENCH_READY"):
                continue
            w.ready = True
            exclusive(w)
        return results

    def _await(self, w: Worker, prefix: str, deferred: deque) -> Any:
        while True:
            try:
                ev_w, line = self.events.get(timeout=self.timeout_s)
            except queue.Empty:
                raise WorkerFailed(f"{w.name}: no {prefix} within {self.timeout_s:.0f}s; log: {w.log_tail()}") from None
            if ev_w is not w:
                deferred.append((ev_w, line))
                continue
            if line is None:
                raise WorkerFailed(f"{w.name}: exited with code {w.proc.wait()}; log: {w.log_tail()}")
            if line.startswith(prefix):
                body = line[len(prefix):].strip()
                return json.loads(body) if body else None


def plan(sizes: Sizes, models: tuple[str, ...], depths: tuple[int, ...],
         steps: int | None, jax_variants: tuple[str, ...] = JAX_VARIANTS,
         torch_variants: tuple[str, ...] = TORCH_VARIANTS) -> list[dict[str, Any]]:
    """Worker tasks, most expensive first (the transformer's deepest compiles longest)."""
    common = ["--sizes", sizes.name] + (["--steps", str(steps)] if steps else [])
    common += ["--jax-variants", ",".join(jax_variants), "--torch-variants", ",".join(torch_variants)]
    tasks = []
    measure = sorted(((m, d) for m in models for d in depths),
                     key=lambda md: (-(md[1] * (3 if md[0] == "transformer" else 1)), md[0]))
    for m, d in measure:
        tasks.append({"name": f"{m}-{d}", "model": m, "depth": d,
                      "args": ["--model", m, "--depth", str(d), *common], "env": worker_env()})
    return tasks


def run_benchmark(sizes: Sizes, out: str | os.PathLike, *, models: tuple[str, ...] = MODELS,
                  depths: tuple[int, ...] | None = None, jobs: int = 2,
                  steps: int | None = None, log=print, frontier_run: bool = False) -> dict[str, Any]:
    """Runs everything and writes ``results.json``, ``results.md`` and ``memory_vs_time.png``.

    ``frontier_run``: the variants of :mod:`benchmarks.frontier` (default depths 8 and 16),
    and ``frontier.md`` and ``frontier.png`` besides. Returns the ``results.json`` content.
    """
    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    depths = tuple(depths or (frontier.FRONTIER_DEPTHS if frontier_run else sizes.depths))
    variants = (frontier.FRONTIER_JAX, frontier.FRONTIER_TORCH) if frontier_run else (JAX_VARIANTS, TORCH_VARIANTS)
    loadavg = _loadavg()
    runner = Runner(out, jobs, log=log)
    results = runner.run(plan(sizes, models, depths, steps, *variants))
    rows: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    for _task, payload in results:
        rows.extend(payload["result"])
        info = info or payload["info"]
    rows.sort(key=lambda r: (r["model"], r["depth"], r["framework"], r["variant"]))
    report.add_overheads(rows)
    notes = [
        "peak_rss_bytes is the increase of peak RSS during one step in a fresh per-(model, depth) "
        "process (not a fresh process per variant); all variants of that (model, depth) live in it. "
        "glibc's allocator is switched to mmap big buffers while RSS is measured and back to its "
        "heap for the timed steps (mmap/munmap and page faults per tensor would otherwise dominate "
        "PyTorch's step time).",
        "The PyTorch models are the twins of models/ with identical weights; torch checkpoints "
        "use preserve_rng_state=True (the default).",
        "Timings on a shared machine: see load average above; ratios come from interleaved rounds.",
        "JAX saved_bytes vs PyTorch: the checkpointed blocks keep the same block inputs in both; "
        "outside them the models' LayerNorm, GELU, masked softmax and ReLU are remat.ops, whose "
        "custom VJPs keep what PyTorch's backward formulas keep (jax.nn's would keep up to 1.9x "
        "more). Compare temp_bytes for what XLA really allocates.",
    ]
    meta = {
        "sizes": sizes.name, "depths": list(depths), "models": list(models), "steps": steps or sizes.steps,
        "jobs": jobs, "loadavg": loadavg, "wall_s": round(time.perf_counter() - t0, 1),
        "model_sizes": {m: sizes.model_kwargs(m) for m in models},
        "names_policy": {m: list(NAMES_POLICY[m]) for m in models},
        "failures": runner.failures, "notes": notes, "loadavg_end": _loadavg(), **info,
    }
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    data = write_outputs(out, rows, meta)
    if frontier_run:
        (out / "frontier.md").write_text(frontier.markdown(rows, meta))
        frontier.plot(rows, out / "frontier.png")
    return data


def write_outputs(out: str | os.PathLike, rows: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """Writes ``results.json``, ``results.md`` and ``memory_vs_time.png``; returns the JSON data."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report.add_overheads(rows)
    data = {
        "meta": meta, "rows": rows, "ratios": report.jax_torch_ratios(rows), "targets": report.targets(rows),
    }
    (out / "results.json").write_text(json.dumps(data, indent=1))
    (out / "results.md").write_text(report.markdown(rows, meta))
    report.plot(rows, out / "memory_vs_time.png")
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4, 8 and 16 layers, small sizes (< 5 min)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes, depths 2 and 4 (tests, smoke runs)")
    ap.add_argument("--out", default="bench-out", help="output folder (default: bench-out)")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated: mlp,transformer")
    ap.add_argument("--depths", default=None, help="comma-separated depths (default: by size preset)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per variant (>= 5)")
    ap.add_argument("--jobs", type=int, default=2, help="workers compiling at once (timing is exclusive)")
    ap.add_argument("--frontier", action="store_true",
                    help="the Pareto frontiers against torch.compile (depths 8 and 16; frontier.md, frontier.png)")
    add_results_argument(ap)
    args = ap.parse_args(argv)
    sizes = SIZES["tiny" if args.tiny else "quick" if args.quick else "full"]
    models = tuple(m for m in args.models.split(",") if m)
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; use {', '.join(MODELS)}")
    depths = tuple(int(d) for d in args.depths.split(",")) if args.depths else None
    if args.steps is not None and args.steps < 1:
        ap.error("--steps must be at least 1")
    data = run_benchmark(sizes, args.out, models=models, depths=depths, jobs=args.jobs, steps=args.steps,
                         log=lambda s: print(s, flush=True), frontier_run=args.frontier)
    shown = (Path(args.out) / ("frontier.md" if args.frontier else "results.md")).read_text()
    print(shown)
    if not args.tiny:  # tiny sizes are the tests' smoke runs, not a result
        name = ("frontier" if args.frontier else "run") + ("-quick" if args.quick else "")
        write_result(args.results, name, shown, argv, "benchmarks.run")
    return 1 if data["meta"]["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())

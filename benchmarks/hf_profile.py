"""``python -m benchmarks.hf_profile``: where the 135M training step's time goes, PyTorch's and remat's.

One un-checkpointed training step of the SmolLM-135M-shaped Llama (the same model, inputs
and loss as :mod:`benchmarks.hf_scale`), profiled in each framework: PyTorch eager with
``torch.profiler`` (self CPU time of each ATen op), remat with ``jax.profiler`` (the time
of each XLA:CPU operation). Both are sorted into the same kinds of work (matrix products,
attention, element-wise and reductions, the rest) so the two steps can be read side by
side: which kind of work makes remat slower or faster. Each framework runs in a fresh
process; ``--steps`` steps are profiled after one warm-up step, and the times are per step.
Writes ``docs/results/hf_profile_<precision>.md``.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.hf_scale import FULL, QUICK, Shape, jax_program, torch_step
from benchmarks.results import add_results_argument, write_result

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("matrix products", "attention", "element-wise and reductions", "data movement", "other")

# ATen ops by kind (self time: an op's children are counted where they run)
_TORCH_KINDS = (
    ("attention", re.compile(r"scaled_dot_product|flash_attention|_efficient_attention")),
    ("matrix products", re.compile(r"^aten::(mm|addmm|bmm|matmul|linear|baddbmm|dot|mv)$")),
    ("data movement", re.compile(r"^aten::(copy_|to|_to_copy|cat|clone|contiguous|index_select|embedding.*|"
                                 r"transpose|t|view|reshape|permute|expand|slice|select|_unsafe_view|"
                                 r"as_strided|empty.*|zeros.*|fill_|zero_|index.*|scatter.*|gather)$")),
    ("element-wise and reductions", re.compile(r"^aten::")),
)

# XLA:CPU operations by the HLO opcode their name starts with
_XLA_KINDS = (
    # ynn_fusion: a product (and what XLA fused into it) handed to YNNPACK
    ("matrix products", re.compile(r"^(dot|convolution|custom-call|ynn_fusion|onednn)")),
    # no "attention": the tiled attention is a loop whose body's products and element-wise
    # work show as operations of their own, counted with their kinds
    ("data movement", re.compile(r"^(copy|transpose|concatenate|slice|dynamic-slice|dynamic-update-slice|"
                                 r"gather|scatter|pad|broadcast|reshape|bitcast|tuple|get-tuple-element|"
                                 r"parameter|constant|iota)")),
    ("element-wise and reductions", re.compile(r"fusion$|^(reduce|add|multiply|subtract|divide|exponential|log|"
                                               r"tanh|convert|select|maximum|minimum|compare|negate|rsqrt|"
                                               r"sqrt|power|logistic)")),
)


def _kind(name: str, table: tuple[tuple[str, re.Pattern[str]], ...]) -> str:
    return next((kind for kind, pattern in table if pattern.search(name)), "other")


def profile_torch(precision: str, shape: Shape, steps: int) -> dict[str, float]:
    """Milliseconds per step of each ATen op (self CPU time), PyTorch eager."""
    from torch.profiler import ProfilerActivity, profile

    step = torch_step("eager", precision, "smollm-135m", shape)
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages() if e.self_cpu_time_total > 0}


def profile_jax(precision: str, shape: Shape, steps: int) -> dict[str, float]:
    """Milliseconds per step of each XLA:CPU operation, remat without checkpoints."""
    import jax

    grad_fn, args = jax_program("no_checkpoint", precision, "smollm-135m", shape, None)
    compiled = jax.jit(grad_fn)
    jax.block_until_ready(compiled(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                jax.block_until_ready(compiled(*args))
        (xspace,) = Path(trace_dir).rglob("*.xplane.pb")
        data = jax.profiler.ProfileData.from_file(str(xspace))
    return _xla_op_times(data, steps)


# XLA control flow: its bodies' operations have events of their own, counted by kind
_CONTROL_FLOW = ("while", "conditional", "call")


def _xla_op_times(data: Any, steps: int) -> dict[str, float]:
    """Each HLO operation's time per step, from the events that carry an ``hlo_op`` stat.

    Operations are grouped by name without the ``.N`` suffix and the ``wrapped_`` prefix
    (``wrapped_tanh.2`` is ``tanh``). Control flow (``while``, ``conditional``, ``call``)
    is left out: the operations of its bodies have events of their own.
    """
    times: dict[str, float] = collections.defaultdict(float)
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                name = hlo_kind_name(event.name)
                if "hlo_op" in dict(event.stats) and not name.startswith(_CONTROL_FLOW):
                    times[name] += event.duration_ns / 1e6 / steps
    return dict(times)


def hlo_kind_name(name: str) -> str:
    """``wrapped_tanh.2`` -> ``tanh``; ``add_select_fusion.3`` -> ``add_select_fusion``."""
    return re.sub(r"(\.\d+)+$", "", name).removeprefix("wrapped_")


def by_kind(times: dict[str, float], table: tuple[tuple[str, re.Pattern[str]], ...]) -> dict[str, float]:
    kinds = dict.fromkeys(KINDS, 0.0)
    for name, ms in times.items():
        kinds[_kind(name, table)] += ms
    return kinds


def run_worker(framework: str, precision: str, shape: Shape, steps: int) -> dict[str, float]:
    if framework == "torch":
        return profile_torch(precision, shape, steps)
    return profile_jax(precision, shape, steps)


def in_fresh_process(framework: str, precision: str, shape: Shape, steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        result = Path(out) / "times.json"
        command = [sys.executable, "-m", "benchmarks.hf_profile", "--worker", framework, "--precision", precision,
                   "--seq", str(shape.seq_len), "--batch", str(shape.batch_size), "--steps", str(steps),
                   "--worker-out", str(result)]
        subprocess.run(command, cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        return json.loads(result.read_text())


def markdown(torch_ms: dict[str, float], jax_ms: dict[str, float], top: int = 8) -> str:
    torch_kinds, jax_kinds = by_kind(torch_ms, _TORCH_KINDS), by_kind(jax_ms, _XLA_KINDS)
    lines = ["| kind of work | PyTorch eager ms | remat (no checkpoint) ms | remat / PyTorch |", "|---|---|---|---|"]
    for kind in (*KINDS, "total"):
        t = sum(torch_kinds.values()) if kind == "total" else torch_kinds[kind]
        j = sum(jax_kinds.values()) if kind == "total" else jax_kinds[kind]
        if kind == "attention":  # remat's is in the rows of its products and element-wise work
            lines.append(f"| {kind} | {t:.0f} | (in the other rows) | — |")
            continue
        ratio = f"{j / t:.2f}" if t > 0 else "—"
        lines.append(f"| {kind} | {t:.0f} | {j:.0f} | {ratio} |")
    for title, times, table in (("PyTorch", torch_ms, _TORCH_KINDS), ("remat", jax_ms, _XLA_KINDS)):
        lines += ["", f"The {top} largest in {title} (ms per step):", "", "| op | kind | ms |", "|---|---|---|"]
        for name, ms in sorted(times.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"| `{name}` | {_kind(name, table)} | {ms:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hf_profile", description=__doc__.split("\n")[0])
    parser.add_argument("--precision", default="float32", choices=("float32", "mixed"))
    parser.add_argument("--quick", action="store_true", help="seq 256, batch 1 (default: seq 512, batch 2)")
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--worker", choices=("torch", "jax"), help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    add_results_argument(parser)
    args = parser.parse_args(argv)
    base = QUICK if args.quick else FULL
    shape = Shape(args.seq or base.seq_len, args.batch or base.batch_size, 1, args.steps)
    if args.worker:
        Path(args.worker_out).write_text(json.dumps(run_worker(args.worker, args.precision, shape, args.steps)))
        return 0
    torch_ms = in_fresh_process("torch", args.precision, shape, args.steps)
    jax_ms = in_fresh_process("jax", args.precision, shape, args.steps)
    table = markdown(torch_ms, jax_ms)
    print(table)
    head = (f"One un-checkpointed training step of the SmolLM-135M-shaped Llama, seq {shape.seq_len}, batch "
            f"{shape.batch_size}, {args.precision}: PyTorch eager's ATen ops (self CPU time, `torch.profiler`) "
            f"beside remat's XLA:CPU operations (`jax.profiler`), ms per step over {args.steps} profiled steps "
            "after a warm-up, each framework in a fresh process. Profiling adds overhead to both.\n\n")
    write_result(args.results, f"hf_profile_{args.precision}", head + table, argv, module="benchmarks.hf_profile")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

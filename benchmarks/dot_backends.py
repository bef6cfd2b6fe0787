"""``python -m benchmarks.dot_backends``: XLA:CPU's matrix-product backends against PyTorch's ``aten::mm``.

The un-checkpointed SmolLM-135M step of ``benchmarks.hf_scale`` spends most of its time in
matrix products, and XLA:CPU's are slower than PyTorch's (``benchmarks.hf_profile``). This
benchmark asks whether any XLA:CPU setting closes that gap: it times the step's three
product shapes (the SwiGLU's up and down projections and the tied head, at seq 512, batch 2)
forward and backward: a dense layer's three products, ``a @ b``, ``g @ b.T`` and ``a.T @ g``
(the output and the gradients of ``a`` and ``b`` for an output gradient ``g``), written
out as products alone so that no element-wise work is timed beside them, under each
backend XLA:CPU offers, and under PyTorch.

Each backend runs in a fresh process (XLA reads its flags once), round after round so that
load hits them alike; a process reports the best of ``--calls`` calls per shape, and the
table shows the median over rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.results import add_results_argument, write_result

#: ``(tokens, in, out)`` of the step's products: tokens = seq 512 x batch 2
SHAPES = {"up (576 -> 1536)": (1024, 576, 1536), "down (1536 -> 576)": (1024, 1536, 576),
          "head (576 -> 49152)": (1024, 576, 49152)}
QUICK_SHAPES = {"up (576 -> 1536)": (256, 576, 1536), "head (576 -> 49152)": (256, 576, 49152)}

#: backend -> XLA_FLAGS; an empty YNNPACK fusion type turns XLA:CPU's default dot library off
BACKENDS = {
    "xla: YNNPACK (default)": "",
    "xla: oneDNN": "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_use_onednn=true",
    "xla: own emitter": "--xla_cpu_experimental_ynn_fusion_type=",
    "torch: aten::mm": None,
}


def _time_jax(shapes: dict[str, tuple[int, int, int]], calls: int) -> dict:
    """``{"ms": best ms per shape, "ynnpack": whether the compiled programs call YNNPACK}``."""
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    step = jax.jit(lambda a, b, g: (a @ b, g @ b.T, a.T @ g))
    best, ynnpack = {}, False
    for name, (m, k, n) in shapes.items():
        a, b, g = (jax.device_put(rng.standard_normal(s, np.float32)) for s in ((m, k), (k, n), (m, n)))
        ynnpack |= "ynn_fusion" in step.lower(a, b, g).compile().as_text()
        jax.block_until_ready(step(a, b, g))
        best[name] = _best_ms(lambda: jax.block_until_ready(step(a, b, g)), calls)  # noqa: B023
    return {"ms": best, "ynnpack": ynnpack}


def _time_torch(shapes: dict[str, tuple[int, int, int]], calls: int) -> dict:
    """``{"ms": best ms per shape}``."""
    import torch

    torch.manual_seed(0)
    best = {}
    for name, (m, k, n) in shapes.items():
        a, b, g = (torch.randn(*s) for s in ((m, k), (k, n), (m, n)))

        def step() -> None:
            torch.mm(a, b), torch.mm(g, b.T), torch.mm(a.T, g)  # noqa: B023

        step()
        best[name] = _best_ms(step, calls)
    return {"ms": best}


def _best_ms(run, calls: int) -> float:
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1e3)
    return min(times)


def _child(backend: str, quick: bool, calls: int) -> dict:
    """One backend's best times (and, for XLA, whether it ran YNNPACK), in a fresh process."""
    # the backend's flags alone: any other XLA flag (an optimisation level) could change the kernels
    env = {**os.environ, "XLA_FLAGS": BACKENDS[backend] or ""}
    command = [sys.executable, "-m", "benchmarks.dot_backends", "--child", backend, "--calls", str(calls)]
    out = subprocess.run(command + (["--quick"] if quick else []), env=env, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def table(runs: dict[str, list[dict]], shapes: dict[str, tuple[int, int, int]]) -> str:
    """The median over rounds of each backend's time per shape, and its ratio to PyTorch's."""
    torch_ms = {s: statistics.median(r["ms"][s] for r in runs["torch: aten::mm"]) for s in shapes}
    lines = ["| backend | YNNPACK in the program | " + " | ".join(f"{s} ms (x torch)" for s in shapes) + " |",
             "|---|---|" + "---|" * len(shapes)]
    for backend, rounds in runs.items():
        cells = []
        for s in shapes:
            ms = statistics.median(r["ms"][s] for r in rounds)
            cells.append(f"{ms:.1f} ({ms / torch_ms[s]:.2f})")
        ynnpack = {"ynnpack" in r and ("yes" if r["ynnpack"] else "no") for r in rounds} - {False}
        lines.append(f"| {backend} | {', '.join(sorted(ynnpack)) or '-'} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dot_backends", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="256 tokens and two shapes, two rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds over the backends (default 5; 2 quick)")
    parser.add_argument("--calls", type=int, default=5, help="timed calls per shape in each process")
    parser.add_argument("--child", choices=list(BACKENDS), help=argparse.SUPPRESS)
    add_results_argument(parser)
    args = parser.parse_args(argv)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.child:
        timer = _time_torch if BACKENDS[args.child] is None else _time_jax
        print(json.dumps(timer(shapes, args.calls)))
        return 0
    rounds = args.rounds or (2 if args.quick else 5)
    times: dict[str, list[dict]] = {b: [] for b in BACKENDS}
    started = time.perf_counter()
    for r in range(rounds):
        for backend in BACKENDS:
            print(f"round {r + 1}/{rounds}: {backend} ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
            times[backend].append(_child(backend, args.quick, args.calls))
    tokens = next(iter(shapes.values()))[0]
    head = (f"A dense layer's three float32 products, `a @ b`, `g @ b.T` and `a.T @ g`, {tokens} tokens; "
            f"the best of {args.calls} calls in a fresh process per backend, the median of {rounds} "
            "interleaved rounds.\n\n")
    body = head + table(times, shapes)
    print(body)
    write_result(args.results, "dot_backends" + ("-quick" if args.quick else ""), body, argv,
                 module="benchmarks.dot_backends")
    return 0


if __name__ == "__main__":
    sys.exit(main())

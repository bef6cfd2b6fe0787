"""bfloat16 and mixed precision against float32: a transformer training step in JAX and in PyTorch, side by side.

For each precision (``float32``; ``mixed``: bfloat16 compute on float32 parameters, the
JAX side by :func:`remat.crosscheck.autocast.jax_model`, PyTorch under
``torch.autocast("cpu", dtype=torch.bfloat16)``; ``bfloat16``: everything in bfloat16)
one AdamW step of the reference transformer (every block checkpointed, both sides) is
timed (median of ``--repeats`` steps after a warm-up) and its memory measured: JAX, XLA's
compiled temp buffer of the step (``memory_analysis().temp_size_in_bytes``); PyTorch, the
bytes its autograd graph saves for the backward (``saved_tensors_hooks``, each storage
once, parameters excluded).

Run: ``python -m benchmarks.precision`` (``--quick`` for a small model, ``--json`` for rows).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

from benchmarks.results import add_results_argument, write_result

PRECISIONS = ("float32", "mixed", "bfloat16")
FULL = {"vocab": 256, "depth": 4, "width": 256, "heads": 8, "seq_len": 128, "batch": 16}
QUICK = {"vocab": 64, "depth": 2, "width": 64, "heads": 4, "seq_len": 32, "batch": 8}


def _median_seconds(step: Any, repeats: int) -> float:
    step()  # warm-up (and compilation)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def jax_row(jax_model: Any, ids: np.ndarray, targets: np.ndarray, precision: str, repeats: int) -> dict[str, Any]:
    """Median step time and compiled temp bytes of one JAX AdamW step in ``precision``."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from remat.crosscheck.autocast import float32_outputs
    from remat.crosscheck.autocast import jax_model as precision_model

    model = precision_model(jax_model, precision)
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    graphdef, state = nnx.split((model, opt))

    def loss_fn(m: Any, x: Any, y: Any) -> Any:
        out = m(x)
        out = float32_outputs(out) if precision == "mixed" else out
        return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()

    def step(state: Any, x: Any, y: Any) -> Any:
        m, o = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(m, x, y)
        o.update(m, grads)
        return nnx.state((m, o)), loss

    x, y = jnp.asarray(ids), jnp.asarray(targets)
    compiled = jax.jit(step).lower(state, x, y).compile()
    temp = int(compiled.memory_analysis().temp_size_in_bytes)
    box = [state]

    def run() -> None:
        box[0], loss = compiled(box[0], x, y)
        jax.block_until_ready(loss)

    return {"framework": "jax", "precision": precision, "step_ms": 1e3 * _median_seconds(run, repeats),
            "memory_bytes": temp, "memory": "XLA temp"}


def torch_row(torch_model: Any, ids: np.ndarray, targets: np.ndarray, precision: str, repeats: int
              ) -> dict[str, Any]:
    """Median step time and saved-for-backward bytes of one torch AdamW step in ``precision``."""
    import copy

    import torch

    from remat.crosscheck.autocast import torch_context

    model = copy.deepcopy(torch_model).to(torch.bfloat16 if precision == "bfloat16" else torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.from_numpy(ids), torch.from_numpy(targets)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: Any) -> Any:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    def run(measure: bool = False) -> None:
        opt.zero_grad()
        with torch_context(precision):
            if measure:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = model(x)
            else:
                out = model(x)
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()

    run(measure=True)
    return {"framework": "torch", "precision": precision, "step_ms": 1e3 * _median_seconds(run, repeats),
            "memory_bytes": sum(saved.values()), "memory": "saved for backward"}


def measure(sizes: dict[str, int], repeats: int) -> list[dict[str, Any]]:
    """Every (framework, precision) row for the transformer of ``sizes``."""
    from remat.models import MODELS, RematSettings

    entry = MODELS["transformer"]
    jm, tm, (ids,) = entry.build(remat=RematSettings(), **sizes)
    targets = entry.example_targets(entry.make_config(RematSettings(), **sizes))
    rows = []
    for precision in PRECISIONS:
        rows.append(jax_row(jm, ids, targets, precision, repeats))
        rows.append(torch_row(tm, ids, targets, precision, repeats))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table, JAX and PyTorch side by side per precision."""
    by = {(r["framework"], r["precision"]): r for r in rows}
    lines = ["| precision | JAX step (ms) | JAX temp (MiB) | PyTorch step (ms) | PyTorch saved (MiB) |",
             "|---|---|---|---|---|"]
    for p in PRECISIONS:
        j, t = by[("jax", p)], by[("torch", p)]
        lines.append(f"| {p} | {j['step_ms']:.2f} | {j['memory_bytes'] / 2**20:.2f} | {t['step_ms']:.2f} | "
                     f"{t['memory_bytes'] / 2**20:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.precision", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small transformer (seconds)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per row (default 20, quick 5)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--threads", type=int, default=2, help="PyTorch's intra-op threads (default 2, as "
                        "benchmarks.run; more than the machine's free cores oversubscribes it)")
    add_results_argument(parser)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else FULL
    repeats = args.repeats or (5 if args.quick else 20)
    rows = measure(sizes, repeats)
    if args.json:
        print(json.dumps({"sizes": sizes, "repeats": repeats, "rows": rows}))
    else:
        title = (f"transformer {sizes}, AdamW step, every block checkpointed, median of {repeats}, "
                 f"torch threads {args.threads}")
        print(title)
        print(table(rows))
        write_result(args.results, "precision-quick" if args.quick else "precision", f"{title}\n\n{table(rows)}",
                     argv, "benchmarks.precision")


if __name__ == "__main__":
    main()

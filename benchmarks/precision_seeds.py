"""How the low-precision training check's verdict moves with the seed: err_jax / err_torch per weight, over seeds.

For each ``MODEL:PRECISION`` and seed (new weights and batch), ``compare_training`` (3
AdamW steps, lr 1e-2, every block checkpointed on both sides) measures each trained weight's
``err_jax`` and ``err_torch`` against the float64 twin. Reported per configuration: the
seeds where a JAX row fails ``err_jax <= 2 * max(err_torch, eps)``; the *mirror* count,
seeds where a PyTorch row fails the same criterion with the sides swapped
(``err_torch <= 2 * max(err_jax, eps)``); and the distribution of ``err_jax / err_torch``
over every weight of every seed (geometric mean, p5, p95, share beyond 2x either way).
A systematic gap shows as a geometric mean above 1 and more JAX failures than mirror
ones; rounding luck as a distribution centred at 1 with tails on both sides.

Run: ``python -m benchmarks.precision_seeds transformer:bfloat16 cnn:bfloat16 llama:mixed --seeds 8``
(``--json`` for the rows).
"""
from __future__ import annotations

import argparse
import json
import math
from typing import Any

import numpy as np

from benchmarks.results import add_results_argument, write_result


def _entry(name: str) -> Any:
    from remat.models import HF_MODELS, MODELS

    return MODELS.get(name) or HF_MODELS[name]


def trained_rows(name: str, precision: str, seed: int, steps: int = 3) -> list[dict[str, Any]]:
    """The weight rows (``name``, ``err_jax``, ``err_torch``, ``eps``) of one training check."""
    from remat.crosscheck import compare_training
    from remat.crosscheck.precision import PrecisionReport

    entry = _entry(name)
    config = entry.make_config()
    jax_model, torch_model, inputs = entry.factory(config, seed)
    report = compare_training(jax_model, torch_model, inputs, entry.example_targets(config, seed), steps=steps,
                              precision=precision, mode="train", exclude=entry.training_exclude)
    assert isinstance(report, PrecisionReport)
    return [{"seed": seed, "name": r.name, "err_jax": r.err_jax, "err_torch": r.err_torch, "eps": r.eps}
            for r in report.rows if r.kind == "param"]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Seeds failing on each side, and the distribution of ``err_jax / err_torch``."""
    fails: dict[int, list[str]] = {}
    mirror: dict[int, list[str]] = {}
    for r in rows:
        if r["err_jax"] > 2 * max(r["err_torch"], r["eps"]):
            fails.setdefault(r["seed"], []).append(r["name"])
        if r["err_torch"] > 2 * max(r["err_jax"], r["eps"]):
            mirror.setdefault(r["seed"], []).append(r["name"])
    ratios = np.array([r["err_jax"] / r["err_torch"] for r in rows if r["err_torch"] > 0 and r["err_jax"] > 0])
    logs = np.log(ratios)
    return {"seeds": len({r["seed"] for r in rows}), "weights": len(ratios), "jax_fails": fails, "torch_fails": mirror,
            "geomean": float(math.exp(logs.mean())), "p5": float(np.quantile(ratios, 0.05)),
            "p95": float(np.quantile(ratios, 0.95)), "beyond_2x": float(np.mean(ratios > 2)),
            "below_half": float(np.mean(ratios < 0.5))}


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| model:precision | seeds | seeds a JAX row fails | seeds a torch row fails (mirror) | "
             "err_jax/err_torch geomean [p5, p95] | share > 2x / < 0.5x |", "|---|---|---|---|---|---|"]
    for key, s in results.items():
        def seeds(d: dict[int, list[str]]) -> str:  # the failing tensors' names: --json
            return f"{len(d)}" + (f" (seeds {', '.join(str(k) for k in sorted(int(k) for k in d))})" if d else "")

        lines.append(f"| {key} | {s['seeds']} | {seeds(s['jax_fails'])} | {seeds(s['torch_fails'])} | "
                     f"{s['geomean']:.2f} [{s['p5']:.2f}, {s['p95']:.2f}] | "
                     f"{100 * s['beyond_2x']:.1f}% / {100 * s['below_half']:.1f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="err_jax / err_torch of the trained weights, over seeds")
    parser.add_argument("configs", nargs="+", metavar="MODEL:PRECISION")
    parser.add_argument("--seeds", type=int, default=8, help="seeds 0..N-1 (default 8)")
    parser.add_argument("--json", action="store_true")
    add_results_argument(parser)
    args = parser.parse_args(argv)
    results, rows_by = {}, {}
    for key in args.configs:
        name, precision = key.split(":")
        rows = [r for seed in range(args.seeds) for r in trained_rows(name, precision, seed)]
        rows_by[key], results[key] = rows, summarize(rows)
    print(json.dumps({"summary": results, "rows": rows_by}) if args.json else table(results))
    write_result(args.results, "precision-seeds", f"{args.seeds} seeds:\n\n{table(results)}", argv,
                 "benchmarks.precision_seeds")


if __name__ == "__main__":
    main()

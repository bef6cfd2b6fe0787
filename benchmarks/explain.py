"""``python -m benchmarks.explain``: what ``remat.explain`` costs, as a ratio to one plain compile of the step.

For each model, in interleaved rounds: the step ``jax.grad(loss)`` traced, lowered and
compiled plainly (``jax.jit(step).lower(*args).compile()``), and explained
(:func:`remat.explain`: the same compile with XLA's buffer assignment written for it,
plus the attribution). Each round uses a step of a new name, so neither JAX's trace cache
nor its compilation cache serves a later round. Prints medians and the ratio as a
Markdown table.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax

from benchmarks.results import add_results_argument, write_result
from remat.explainer.explanation import explain

# (registry name, policy, sizes): the README's profile sizes for the transformer
CASES: tuple[tuple[str, str, dict[str, int]], ...] = (
    ("mlp", "nothing", {"depth": 8, "width": 256, "batch_size": 256}),
    ("transformer", "dots", {"depth": 4, "width": 128, "seq_len": 128, "batch_size": 8}),
    ("cnn", "nothing", {}),
)


def _renamed(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def step(*args: Any) -> Any:
        return fn(*args)

    step.__name__ = step.__qualname__ = name
    return step


def measure(model: str, policy: str, sizes: dict[str, int], rounds: int = 3) -> dict[str, Any]:
    """Median seconds of a plain compile and of an explanation of one model's gradient step."""
    from remat.models.tasks import make_task, pure_step_loss

    loss, args = pure_step_loss(make_task(model, policy=policy, **sizes))
    grad = jax.grad(loss)
    plain, explained, compile_part = [], [], []
    for i in range(rounds):
        t0 = time.perf_counter()
        jax.jit(_renamed(grad, f"plain_{i}")).lower(*args).compile()
        plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        report = explain(_renamed(grad, f"explained_{i}"), *args)
        explained.append(time.perf_counter() - t0)
        compile_part.append(report.compile_s)
    p, e = statistics.median(plain), statistics.median(explained)
    return {"model": model, "policy": policy, "plain_s": p, "explain_s": e, "ratio": e / p,
            "explain_compile_s": statistics.median(compile_part), "temp_bytes": report.temp_bytes,
            "attributed": report.attributed_fraction}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | policy | plain compile (s) | remat.explain (s) | of which compiling (s) | ratio | attributed |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['policy']} | {r['plain_s']:.2f} | {r['explain_s']:.2f} | "
                     f"{r['explain_compile_s']:.2f} | {r['ratio']:.2f} | {r['attributed']:.1%} |")
    return "\n".join(lines)


#: the built-in twins ``remat explain MODEL`` takes (transformers needed for gpt2 and resnet)
TWINS = ("mlp", "transformer", "cnn", "llama", "gpt2", "resnet")


def attribution(model: str) -> dict[str, Any]:
    """The least attributed share of ``remat explain MODEL``'s temp bytes over every policy of
    :data:`remat.policies.POLICY_NAMES` and the leanest plan (``--plan 0``), with the policy
    it fell to and the largest unattributed remainder in bytes."""
    from remat.cli import main as remat_main
    from remat.policies import POLICY_NAMES

    runs: list[tuple[str, float, int]] = []
    for label, extra in [(p, ["--policy", p]) for p in POLICY_NAMES] + [("plan", ["--plan", "0"])]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            if remat_main(["explain", model, "--json", *extra]) != 0:
                raise RuntimeError(f"remat explain {model} {' '.join(extra)} failed")
        report = json.loads(out.getvalue())
        fraction = report["attributed_fraction"]
        runs.append((label, fraction, round(report["temp_bytes"] * (1 - fraction))))
    label, fraction, _ = min(runs, key=lambda r: r[1])
    return {"model": model, "least": fraction, "policy": label, "remainder": max(r[2] for r in runs)}


def attribution_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | lowest attributed share (policy) | largest unattributed remainder |", "|---|---|---|"]
    lines += [f"| {r['model']} | {r['least']:.2%} ({r['policy']}) | {r['remainder']} B |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.explain", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per model (median)")
    parser.add_argument("--attribution", action="store_true",
                        help="instead: the least attributed share of each twin over every policy and a plan")
    add_results_argument(parser)
    args = parser.parse_args(argv)
    if args.attribution:
        table = attribution_markdown([attribution(m) for m in TWINS])
        print(table)
        write_result(args.results, "explain-attribution", table, argv, "benchmarks.explain")
        return 0
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {args.rounds} rounds, medians")
    table = markdown([measure(m, p, s, args.rounds) for m, p, s in CASES])
    print(table)
    write_result(args.results, "explain", table, argv, "benchmarks.explain")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m benchmarks.scanned_plan``: planning a scanned Llama-shaped step against jitting it.

A pure-JAX decoder layer (RMS norm, causal attention, SwiGLU MLP, the attention output
and the MLP hidden tagged with ``checkpoint_name``), checkpointed with
``remat.checkpoint`` inside the body of one ``lax.scan`` over its stacked weights.
At each of ``--budgets`` (0.5 and 0.25), ``--runs`` times (3), on a step built afresh:
``jit_s``, the seconds to trace, lower and compile ``jax.jit(jax.grad(step))`` alone
(:func:`remat.cli.plan.jit_seconds`), then ``plan_s``, ``remat.plan``'s with the default
options (rates calibrated beforehand, once per process; the fitting candidates timed where
that is predicted to cost no more than the search, ``remat.plan(measure=None)``;
``--measure``: always timed, ``--no-measure``: never). Writes ``docs/results/scanned-plan.md`` (the medians, and each
run's ratio) and prints one JSON line: the budget with the largest median ratio, each
budget's medians (``budgets``) and every run (``rows``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp

import remat
from benchmarks.results import add_results_argument, write_result


def rms(x: Any, g: Any) -> Any:
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


def layer(w: dict, x: Any, heads: int) -> Any:
    """One decoder layer, ``(B, T, C) -> (B, T, C)``."""
    b, t, c = x.shape
    h = rms(x, w["n1"])
    q, k, v = (jnp.einsum("btc,cd->btd", h, w[n]).reshape(b, t, heads, c // heads) for n in ("wq", "wk", "wv"))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (c // heads) ** 0.5
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, c)
    x = x + remat.checkpoint_name(a @ w["wo"], "attn_out")
    h = rms(x, w["n2"])
    u = remat.checkpoint_name(jax.nn.silu(h @ w["wg"]) * (h @ w["wu"]), "mlp_hidden")
    return x + u @ w["wd"]


def scanned_step(depth: int, width: int, heads: int, mlp: int, vocab: int, batch: int, seq: int) -> tuple:
    """``(loss, params, ids)``: the embedding, ``depth`` layers in one ``lax.scan``, the head."""
    ks = iter(jax.random.split(jax.random.PRNGKey(0), 16))

    def normal(*shape: int) -> Any:
        return jax.random.normal(next(ks), shape) / shape[-2] ** 0.5

    stack = {"wq": normal(depth, width, width), "wk": normal(depth, width, width),
             "wv": normal(depth, width, width), "wo": normal(depth, width, width),
             "wg": normal(depth, width, mlp), "wu": normal(depth, width, mlp), "wd": normal(depth, mlp, width),
             "n1": jnp.ones((depth, width)), "n2": jnp.ones((depth, width))}
    params = {"embed": normal(vocab, width), "layers": stack, "norm": jnp.ones(width), "head": normal(width, vocab)}

    def loss(params: dict, ids: Any) -> Any:
        def body(h: Any, w: dict) -> tuple[Any, None]:
            return remat.checkpoint(lambda w_, h_: layer(w_, h_, heads), w, h), None
        x, _ = jax.lax.scan(body, params["embed"][ids], params["layers"])
        return -jnp.mean(jax.nn.log_softmax(rms(x, params["norm"]) @ params["head"])[..., 0])

    return loss, params, jax.random.randint(next(ks), (batch, seq), 0, vocab)


def measure(budget: float, timed: bool | None = None, **sizes: int) -> dict[str, Any]:
    """The plan's and the jit's seconds, side by side in this process, on a step built
    afresh (no trace or compile shared with an earlier run): ``jit_s`` first, alone, then
    the plan (``timed``: ``remat.plan(measure=)``)."""
    from remat.analysis.machine import calibrate_once
    from remat.cli.plan import jit_seconds

    loss, params, ids = scanned_step(**sizes)
    calibrate_once()  # once per process: not a cost of planning this step
    jit_s = jit_seconds(loss, (params, ids))
    started = time.perf_counter()
    p = remat.plan(loss, params, ids, memory_budget=budget, measure=timed)
    plan_s = time.perf_counter() - started
    chosen = p.chosen
    return {"budget": budget, "plan_s": plan_s, "jit_s": jit_s, "ratio": plan_s / jit_s, "regions": p.num_regions,
            "chosen": None if chosen is None else chosen.label,
            "compiled": sum(c.compiled is not None for c in p.candidates),
            "timed": sum(c.measured_ms is not None for c in p.candidates),
            "fits": chosen is not None and chosen.temp_bytes is not None and chosen.temp_bytes <= p.limit_bytes}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians over ``rows`` (runs at one budget): plan_s, jit_s and their ratio, run by run."""
    return {"budget": rows[0]["budget"], "runs": len(rows),
            **{k: statistics.median(r[k] for r in rows) for k in ("plan_s", "jit_s", "ratio")},
            "ratios": [round(r["ratio"], 2) for r in rows], "chosen": sorted({str(r["chosen"]) for r in rows}),
            "compiled": max(r["compiled"] for r in rows), "timed": max(r["timed"] for r in rows),
            "regions": rows[0]["regions"], "fits": all(r["fits"] for r in rows)}


def markdown(summaries: list[dict[str, Any]]) -> str:
    lines = ["| budget | runs | plan_s (median) | jit_s (median) | plan_s / jit_s (median) | each run | plan "
             "| programs compiled | candidates timed |", "|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        lines.append(f"| {s['budget']} | {s['runs']} | {s['plan_s']:.1f} | {s['jit_s']:.1f} | {s['ratio']:.2f} "
                     f"| {', '.join(f'{r:.2f}' for r in s['ratios'])} | {'; '.join(s['chosen'])} "
                     f"| {s['compiled']} | {s['timed']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scanned_plan", description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="0.5,0.25", help="memory budgets, comma-separated")
    parser.add_argument("--runs", type=int, default=3, help="runs at each budget, each on a step built afresh")
    parser.add_argument("--measure", dest="timed", action="store_const", const=True, default=None,
                        help="always time the fitting candidates (default: where it costs no more than the search)")
    parser.add_argument("--no-measure", dest="timed", action="store_const", const=False,
                        help="choose by predicted time: the fitting candidates are not timed")
    for name, default in (("depth", 32), ("width", 256), ("heads", 4), ("mlp", 688), ("vocab", 256),
                          ("batch", 4), ("seq", 128)):
        parser.add_argument(f"--{name}", type=int, default=default)
    add_results_argument(parser)
    args = vars(parser.parse_args(argv))
    budgets = [float(b) for b in args.pop("budgets").split(",")]
    runs, timed, results_dir = args.pop("runs"), args.pop("timed"), args.pop("results")
    # the budgets interleaved, run by run: the machine's slow spells fall on all of them
    rows = [measure(b, timed, **args) for _ in range(runs) for b in budgets]
    summaries = [summary([r for r in rows if r["budget"] == b]) for b in budgets]
    write_result(results_dir, "scanned-plan", markdown(summaries), argv, "benchmarks.scanned_plan")
    worst = max(summaries, key=lambda s: s["ratio"])
    print(json.dumps({**worst, "budgets": summaries, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

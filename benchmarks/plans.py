"""Checks ``remat.plan`` against every fixed named policy, for the budget issue's criteria.

``python -m benchmarks.plans [--quick] [--out DIR]`` plans the MLP and the transformer of
``models/`` at 8 and 16 blocks for budgets 0.25, 0.5 and 0.75 of the un-checkpointed
step's compiled temp memory, then re-times the plan (twice --repeat rounds) beside the fastest fixed named policy
that fits (interleaved rounds, medians) and writes ``plans.json`` and ``plans.md``.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import remat


def _task(model: str, depth: int):
    from remat.models.tasks import make_task, pure_step_loss

    sizes = {"mlp": dict(width=256, batch_size=256), "transformer": dict(width=128, batch_size=8, seq_len=128)}
    return pure_step_loss(make_task(model, depth=depth, seed=0, **sizes[model]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plans", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 blocks only")
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="remat.keep_freed_memory() first: glibc keeps freed heap for reuse")
    args = parser.parse_args(argv)
    if args.keep_freed_memory and not remat.keep_freed_memory():
        parser.error("--keep-freed-memory needs glibc")
    from remat.analysis import time_programs
    from remat.planner import plan

    fixed = {"all: nothing", "all: dots_no_batch", "all: dots", "no checkpoint"}
    rows = []
    for model in ("mlp", "transformer"):
        for depth in ((8,) if args.quick else (8, 16)):
            loss, step_args = _task(model, depth)
            cache: dict = {}
            for budget in (0.25, 0.5, 0.75):
                t0 = time.perf_counter()
                p = plan(loss, *step_args, memory_budget=budget, repeat=args.repeat, cache=cache)
                row = {"model": model, "depth": depth, "budget": budget, "feasible": p.feasible,
                       "keep_freed_memory": args.keep_freed_memory,
                       "limit_bytes": p.limit_bytes, "none_temp_bytes": p.none_temp_bytes,
                       "minimum_bytes": p.minimum_bytes, "plan_s": round(time.perf_counter() - t0, 1)}
                row["candidates"] = [{"label": c.label, "temp_bytes": c.temp_bytes, "fits": c.fits,
                                      "measured_ms": c.measured_ms, "program": c.program} for c in p.candidates]
                # a fixed policy is one a user could name: the three above, no checkpoint,
                # or the model's checkpoint names
                fits = [c for c in p.candidates if c.fits and (c.label in fixed or c.label.startswith("all: names:"))]
                if p.chosen is not None:
                    row.update(chosen=p.chosen.label, chosen_temp_bytes=p.chosen.temp_bytes)
                    best = min(fits, key=lambda c: c.measured_ms) if fits else None
                    nothing = next((c for c in p.candidates if c.label == "all: nothing" and c.fits), None)
                    # one program is timed once, however many roles or spellings it has (the
                    # plan may compile to the best fixed policy, or to nothing itself): timing
                    # it against itself measures only the machine's noise
                    unique = {c.program: functools.partial(c.compiled, *step_args)
                              for c in (p.chosen, best, nothing) if c is not None}
                    timings = time_programs(list(unique.values()), rounds=2 * args.repeat)
                    ms = dict(zip(unique, timings.medians_ms()))
                    row["chosen_ms"] = ms[p.chosen.program]
                    if best is not None:
                        row.update(best_fixed=best.label, best_fixed_ms=ms[best.program],
                                   ratio_to_best_fixed=ms[p.chosen.program] / ms[best.program])
                    if nothing is not None:
                        row.update(nothing_ms=ms[nothing.program],
                                   ratio_to_nothing=ms[p.chosen.program] / ms[nothing.program])
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "candidates"}), file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "plans.json"), "w") as f:
        json.dump(rows, f, indent=1)
    lines = ["| model | depth | budget | plan | temp MiB (limit) | plan ms | best fixed that fits | its ms | ratio "
             "| vs nothing |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    mib = 2**20
    for r in rows:
        if not r["feasible"]:
            lines.append(f"| {r['model']} | {r['depth']} | {r['budget']} | cannot be met: minimum "
                         f"{r['minimum_bytes'] / mib:.1f} MiB ({r['minimum_bytes'] / r['none_temp_bytes']:.2f}) | "
                         f"- ({r['limit_bytes'] / mib:.1f}) | - | - | - | - | - |")
            continue
        lines.append(
            f"| {r['model']} | {r['depth']} | {r['budget']} | {r['chosen']} | "
            f"{r['chosen_temp_bytes'] / mib:.1f} ({r['limit_bytes'] / mib:.1f}) | {r['chosen_ms']:.1f} | "
            f"{r.get('best_fixed', '-')} | {r.get('best_fixed_ms', float('nan')):.1f} | "
            f"{r.get('ratio_to_best_fixed', float('nan')):.2f} | {r.get('ratio_to_nothing', float('nan')):.2f} |")
    with open(os.path.join(args.out, "plans.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

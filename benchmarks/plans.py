"""Checks ``remat.plan`` against every fixed named policy, and its monotonicity in the budget.

``python -m benchmarks.plans [--quick] [--out DIR]`` plans the MLP and the transformer of
``models/`` at 8 and 16 blocks for budgets 0.25, 0.5 and 0.75 of the un-checkpointed
step's compiled temp memory, with the default search and with the compile-everything one
(``exhaustive=True``), then re-times the two plans (twice --repeat rounds) beside the
fastest fixed named policy that fits (interleaved rounds, ``Timings.paired_ms``) and writes
``plans.json`` and ``plans.md``; ``ratio_to_exhaustive`` is the default plan's time over
the compile-everything plan's.

``--sweep`` instead plans the 8-block MLP and transformer at every budget from 1 down to
0 in steps of 0.05 (one shared cache, so every budget weighs the same compiled
candidates; chosen by predicted time, which is deterministic), then times the distinct
chosen programs side by side (--repeat interleaved rounds) and writes ``sweep.json``
and ``sweep.md``: each budget's plan, temp bytes, predicted and measured time, and the
rounds' spread (the timing noise the monotonicity is judged against).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import remat
from benchmarks.results import add_results_argument, write_result


def _task(model: str, depth: int):
    from remat.models.tasks import make_task, pure_step_loss

    sizes = {"mlp": dict(width=256, batch_size=256), "transformer": dict(width=128, batch_size=8, seq_len=128)}
    return pure_step_loss(make_task(model, depth=depth, seed=0, **sizes[model]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plans", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 blocks only")
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--sweep", action="store_true", help="budgets 1 to 0 by 0.05, 8 blocks")
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="remat.keep_freed_memory() first: glibc keeps freed heap for reuse")
    add_results_argument(parser)
    args = parser.parse_args(argv)
    if args.keep_freed_memory and not remat.keep_freed_memory():
        parser.error("--keep-freed-memory needs glibc")
    if args.sweep:
        return sweep(args.out, args.repeat, args.results, argv)
    from remat.analysis import time_programs
    from remat.planner import plan
    from remat.planner.programs import MIN_SAMPLE_S

    fixed = {"all: nothing", "all: dots_no_batch", "all: dots", "no checkpoint"}
    rows = []
    for model in ("mlp", "transformer"):
        for depth in ((8,) if args.quick else (8, 16)):
            loss, step_args = _task(model, depth)
            for budget in (0.25, 0.5, 0.75):
                # the default search first, with nothing compiled before it; then the
                # compile-everything search, which reuses its compiled candidates
                cache: dict = {}
                t0 = time.perf_counter()
                p = plan(loss, *step_args, memory_budget=budget, repeat=args.repeat, cache=cache)
                plan_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                full = plan(loss, *step_args, memory_budget=budget, repeat=args.repeat, cache=cache, exhaustive=True)
                row = {"model": model, "depth": depth, "budget": budget, "feasible": p.feasible,
                       "keep_freed_memory": args.keep_freed_memory,
                       "limit_bytes": p.limit_bytes, "none_temp_bytes": p.none_temp_bytes,
                       "minimum_bytes": p.minimum_bytes, "plan_s": round(plan_s, 1),
                       "compile_s": p.compile_s, "exhaustive_s": round(time.perf_counter() - t0, 1),
                       "exhaustive_feasible": full.feasible,
                       "exhaustive_minimum_bytes": full.minimum_bytes}
                row["candidates"] = [{"label": c.label, "temp_bytes": c.temp_bytes, "fits": c.fits,
                                      "measured_ms": c.measured_ms, "program": c.program} for c in p.candidates]
                # a fixed policy is one a user could name: the three above, no checkpoint,
                # or the model's checkpoint names
                fits = [c for c in full.candidates
                        if c.fits and (c.label in fixed or c.label.startswith("all: names:"))]
                if p.chosen is not None:
                    row.update(chosen=p.chosen.label, chosen_temp_bytes=p.chosen.temp_bytes)
                    best = min(fits, key=lambda c: c.measured_ms) if fits else None
                    nothing = next((c for c in full.candidates if c.label == "all: nothing" and c.fits), None)
                    everything = full.chosen
                    # one program is timed once, however many roles or spellings it has (the
                    # plan may compile to the best fixed policy, or to nothing itself): timing
                    # it against itself measures only the machine's noise
                    unique = {c.program: functools.partial(c.executable(), *step_args)
                              for c in (p.chosen, everything, best, nothing) if c is not None}
                    timings = time_programs(list(unique.values()), rounds=2 * args.repeat,
                                            min_sample_s=MIN_SAMPLE_S)
                    # each sample over its round's median: the machine's slow spells cancel
                    ms = dict(zip(unique, timings.paired_ms()))
                    row["chosen_ms"] = ms[p.chosen.program]
                    if everything is not None:
                        # the default search against the compile-everything one, timed together
                        row.update(exhaustive_chosen=everything.label, exhaustive_ms=ms[everything.program],
                                   exhaustive_temp_bytes=everything.temp_bytes,
                                   ratio_to_exhaustive=ms[p.chosen.program] / ms[everything.program])
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
    lines = ["| model | depth | budget | plan | temp MiB (limit) | plan ms | compile-everything's plan | its ms "
             "| ratio | planning s (compile-everything s) | best fixed that fits | its ms | ratio | vs nothing |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    mib = 2**20
    for r in rows:
        if not r["feasible"]:
            lines.append(f"| {r['model']} | {r['depth']} | {r['budget']} | cannot be met: minimum "
                         f"{r['minimum_bytes'] / mib:.1f} MiB ({r['minimum_bytes'] / r['none_temp_bytes']:.2f}) | "
                         f"- ({r['limit_bytes'] / mib:.1f}) | - | "
                         f"{'feasible' if r['exhaustive_feasible'] else 'cannot be met either'}: minimum "
                         f"{r['exhaustive_minimum_bytes'] / mib:.1f} MiB | - | - | {r['plan_s']} ({r['exhaustive_s']}) "
                         "| - | - | - | - |")
            continue
        lines.append(
            f"| {r['model']} | {r['depth']} | {r['budget']} | {r['chosen']} | "
            f"{r['chosen_temp_bytes'] / mib:.1f} ({r['limit_bytes'] / mib:.1f}) | {r['chosen_ms']:.1f} | "
            f"{r.get('exhaustive_chosen', '-')} | {r.get('exhaustive_ms', float('nan')):.1f} | "
            f"{r.get('ratio_to_exhaustive', float('nan')):.3f} | {r['plan_s']} ({r['exhaustive_s']}) | "
            f"{r.get('best_fixed', '-')} | {r.get('best_fixed_ms', float('nan')):.1f} | "
            f"{r.get('ratio_to_best_fixed', float('nan')):.2f} | {r.get('ratio_to_nothing', float('nan')):.2f} |")
    with open(os.path.join(args.out, "plans.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    write_result(args.results, "plans-quick" if args.quick else "plans", "\n".join(lines), argv, "benchmarks.plans")
    print("\n".join(lines))
    return 0


def sweep(out: str, repeat: int, results: str = "", argv: list[str] | None = None) -> int:
    """Budgets 1, 0.95, ..., 0 on the 8-block MLP and transformer: the plans' temp bytes and times."""
    import statistics

    from remat.analysis import time_programs
    from remat.planner import plan
    from remat.planner.programs import MIN_SAMPLE_S

    rows = []
    for model in ("mlp", "transformer"):
        loss, step_args = _task(model, 8)
        cache: dict = {}
        plans = []
        for i in range(20, -1, -1):
            budget = round(0.05 * i, 2)
            plans.append((budget, plan(loss, *step_args, memory_budget=budget, measure=False, cache=cache)))
        chosen = {p.chosen.program: p.chosen.executable() for _, p in plans if p.chosen is not None}
        timings = time_programs([functools.partial(c, *step_args) for c in chosen.values()], rounds=repeat,
                                min_sample_s=MIN_SAMPLE_S)
        medians = dict(zip(chosen, timings.medians_ms()))
        # the noise: each program's rounds, their spread around the median
        spread = {k: (max(ts) - min(ts)) / statistics.median(ts) for k, ts in zip(chosen, timings.samples_s)}
        for budget, p in plans:
            c = p.chosen
            rows.append({"model": model, "depth": 8, "budget": budget, "feasible": p.feasible,
                         "plan": c.label if c else None, "temp_bytes": c.temp_bytes if c else None,
                         "limit_bytes": p.limit_bytes, "predicted_ms": c.predicted_ms if c else None,
                         "measured_ms": medians[c.program] if c else None,
                         "spread": spread[c.program] if c else None})
            print(json.dumps(rows[-1]), file=sys.stderr)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)
    lines = ["| model | budget | plan | temp MiB (limit) | predicted ms | measured ms | rounds' spread |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["feasible"]:
            limit = r["limit_bytes"] / 2**20
            lines.append(f"| {r['model']} | {r['budget']} | cannot be met | - ({limit:.2f}) | - | - | - |")
            continue
        lines.append(f"| {r['model']} | {r['budget']} | {r['plan']} | {r['temp_bytes'] / 2**20:.2f} "
                     f"({r['limit_bytes'] / 2**20:.2f}) | {r['predicted_ms']:.2f} | {r['measured_ms']:.2f} "
                     f"| {100 * r['spread']:.0f}% |")
    with open(os.path.join(out, "sweep.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    write_result(results, "plans-sweep", "\n".join(lines), argv, "benchmarks.plans")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How far ``remat.plan`` is from the best per-region assignment: an exhaustive oracle.

``python -m benchmarks.optimality [--quick] [--out DIR]`` builds the MLP, the transformer
and the CNN of ``models/`` at depth 4 (``--quick``) or 4 and 5 (the CNN at 3, the most
its 8x8 images allow), and the two four-block steps of :mod:`benchmarks.foreign_steps`
(written outside ``models/``, planned at that module's ``BUDGETS``), compiles every per-region
assignment over ``{no_checkpoint, nothing, dots_no_batch, dots}`` (4**depth programs) and
the whole step checkpointed around each uniform assignment (for ``scanned``, the six-layer
``lax.scan`` of :mod:`benchmarks.scanned_oracle`: each of seven options on the whole stack
and every split of it into two segments with different options), keeps the compiled temp bytes
of each, then plans the step at budgets 0, 0.25, 0.5 and 0.75. The plans' programs and
every oracle program that fits the largest budget (or is among the leanest, for budget 0)
are timed side by side in one interleaved run
(:meth:`~remat.analysis.timing.Timings.paired_ms`), so the plan's time and the oracle's
fastest fitting time are measured in the same rounds. Budget 0 is the leanest:
the oracle's set is the assignments within 1% of its least temp memory. The fastest of
many noisy medians is biased low, so each budget's five fastest fitting oracle programs
and the plan's run again side by side with three times the rounds; ``ratio`` is from that
second run (``first_pass_ratio`` from the first): the median, over its rounds, of the
plan's time over the oracle's in the same round, where the oracle's fastest is the
finalist with the least paired time in that run (``ratio_of_medians``: the plan's median
over that finalist's; ``worst_ratio``: the same median against the finalist the plan is
slowest against, the largest of several noisy ratios).

Writes ``DIR/optimality.json``: one row per (model, depth, budget) with ``model``,
``depth``, ``budget``, ``plan_ms``, ``oracle_ms``, ``ratio`` (plan / oracle),
``plan_temp_bytes``, ``oracle_min_temp_bytes``, ``limit_bytes`` and what was chosen.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
import time

from benchmarks.results import add_results_argument, write_result

SIZES = {"mlp": dict(width=128, batch_size=512), "transformer": dict(width=64, batch_size=8, seq_len=64),
         "cnn": dict(batch_size=16)}
BUDGETS = (0.0, 0.25, 0.5, 0.75)


def _task(model: str, depth: int):
    from benchmarks.foreign_steps import STEPS
    from remat.models.tasks import make_task, pure_step_loss

    if model in STEPS:  # written outside remat.models, at their own fixed depth of four blocks
        return STEPS[model](seed=0)
    if model == "scanned":  # one lax.scan over a stack of six layers
        from benchmarks.scanned_oracle import scanned_step

        return scanned_step(depth=depth)
    return pure_step_loss(make_task(model, depth=depth, seed=0, **SIZES[model]))


def _assignments(n: int) -> list[tuple[str, tuple[str, ...], bool]]:
    """Every per-region assignment of the planner's options, then the whole step checkpointed
    around each uniform one."""
    from remat.planner._families import PLANNED_POLICIES
    from remat.policies import policy_name

    options = ("no_checkpoint", *map(policy_name, PLANNED_POLICIES))
    out = [(", ".join(a), a, False) for a in itertools.product(options, repeat=n)]
    out += [(f"whole step around all {o}", (o,) * n, True) for o in options]
    return out


def _oracle_assignments(model: str, depth: int, n: int) -> list[tuple[str, tuple, bool]]:
    """The scanned stack's: every option on it and every split into two segments
    (:func:`benchmarks.scanned_oracle.assignments`); another model's, every per-region one."""
    if model == "scanned":
        from benchmarks.scanned_oracle import assignments

        return assignments(depth)
    return _assignments(n)


def _compile_oracle(loss, step_args, todo: list[tuple[str, tuple, bool]], log) -> list[dict]:
    """Compiles every assignment of ``todo`` once per distinct lowering; returns label, temp bytes, program."""
    from remat.analysis.compiled import CompiledMemory
    from remat.planner._search import compile_all
    from remat.planner.programs import lower_step, lowered_fingerprint, program_fingerprint
    from remat.planner.steering import apply_policies

    rows, compiled_by_key, pending = [], {}, []
    for i, (label, specs, whole) in enumerate(todo):
        lowered = lower_step(apply_policies(loss, specs, whole_step=whole), step_args)
        key = lowered_fingerprint(lowered)
        rows.append({"label": label, "whole_step": whole, "key": key})
        if key not in compiled_by_key:
            compiled_by_key[key] = None
            pending.append((key, lowered))
        if len(pending) >= 8 or i == len(todo) - 1:
            for (k, _), c in zip(pending, compile_all([low for _, low in pending])):
                compiled_by_key[k] = c
            pending = []
            log(f"oracle: {i + 1}/{len(todo)} assignments lowered, {len(compiled_by_key)} distinct compiled")
    for r in rows:
        c = compiled_by_key[r["key"]]
        r.update(temp_bytes=CompiledMemory.from_compiled(c).temp_bytes, program=program_fingerprint(c), compiled=c)
    return rows


def run_one(model: str, depth: int, repeat: int, log, budgets: tuple[float, ...] = BUDGETS) -> list[dict]:
    """The rows of one model and depth: the plan at every budget beside the oracle."""
    from remat.analysis import time_programs
    from remat.planner import plan
    from remat.planner.programs import MIN_SAMPLE_S
    from remat.planner.steering import count_regions

    loss, step_args = _task(model, depth)
    n = count_regions(loss, *step_args)
    t0 = time.perf_counter()
    oracle = _compile_oracle(loss, step_args, _oracle_assignments(model, depth, n), log)
    oracle_s = time.perf_counter() - t0
    none_temp = next(r["temp_bytes"] for r in oracle if r["label"] == ", ".join(["no_checkpoint"] * n)
                     and not r["whole_step"])
    least = min(r["temp_bytes"] for r in oracle)
    cache: dict = {}
    plans = {}
    for budget in budgets:
        t0 = time.perf_counter()
        plans[budget] = (plan(loss, *step_args, memory_budget=budget, repeat=repeat, cache=cache),
                         time.perf_counter() - t0)
        log(f"{model} {depth}: budget {budget}: {plans[budget][0].chosen.label if plans[budget][0].chosen else '-'}")
    # one interleaved timing run: every oracle program that fits the largest budget or is
    # among the leanest, and every plan's program (one program is timed once)
    top = max(budgets) * none_temp
    timed = {r["program"]: r["compiled"] for r in oracle if r["temp_bytes"] <= top or r["temp_bytes"] <= 1.01 * least}
    for p, _ in plans.values():
        if p.chosen is not None:
            timed.setdefault(p.chosen.program, p.chosen.executable())
    log(f"{model} {depth}: timing {len(timed)} programs side by side, {repeat} rounds")
    medians = time_programs([functools.partial(c, *step_args) for c in timed.values()], rounds=repeat,
                            min_sample_s=MIN_SAMPLE_S).paired_ms()
    ms = dict(zip(timed, medians))
    # the fastest of many noisy medians is biased low (on a loaded machine the same program's
    # median moved by 30% between runs): the plan's program and each budget's five fastest
    # fitting oracle programs run again, side by side, with three times the rounds
    finalists: dict = {}
    for budget, (p, _) in plans.items():
        limit = int(1.01 * least) if budget == 0 else int(budget * none_temp)
        fitting = sorted({r["program"] for r in oracle if r["temp_bytes"] <= limit}, key=lambda k: ms[k])[:5]
        for k in fitting + ([p.chosen.program] if p.chosen is not None else []):
            finalists[k] = timed[k]
    log(f"{model} {depth}: timing {len(finalists)} finalists again, {3 * repeat} rounds")
    again = time_programs([functools.partial(c, *step_args) for c in finalists.values()],
                          rounds=3 * repeat, min_sample_s=MIN_SAMPLE_S)
    ms_again = dict(zip(finalists, again.medians_ms()))
    paired_again = dict(zip(finalists, again.paired_ms()))
    rounds = dict(zip(finalists, again.samples_s))
    out = []
    for budget, (p, plan_s) in plans.items():
        limit = int(1.01 * least) if budget == 0 else int(budget * none_temp)
        fitting = [r for r in oracle if r["temp_bytes"] <= limit]
        best = min(fitting, key=lambda r: ms[r["program"]]) if fitting else None
        row = {"model": model, "depth": depth, "regions": n, "budget": budget, "limit_bytes": limit,
               "none_temp_bytes": none_temp, "oracle_min_temp_bytes": least, "oracle_fitting": len(fitting),
               "oracle_assignments": len(oracle), "oracle_compile_s": round(oracle_s, 1),
               "plan_s": round(plan_s, 1), "plan": p.chosen.label if p.chosen else None,
               "plan_temp_bytes": p.chosen.temp_bytes if p.chosen else None,
               "plan_fits": p.chosen is not None and p.chosen.temp_bytes <= limit,
               "plan_ms": ms[p.chosen.program] if p.chosen else None,
               "oracle": best["label"] if best else None, "oracle_ms": ms[best["program"]] if best else None,
               "oracle_temp_bytes": best["temp_bytes"] if best else None,
               # the five fastest fitting assignments, to see how far apart the leaders are
               "oracle_fastest": sorted(((ms[r["program"]], r["label"]) for r in fitting))[:5],
               # what the planner weighed, compiled and timed: why it chose what it chose
               "plan_candidates": [c.to_dict() for c in p.candidates]}
        row["first_pass_ratio"] = row["plan_ms"] / row["oracle_ms"] if best and p.chosen else None
        row["ratio"] = row["worst_ratio"] = row["ratio_of_medians"] = None
        if best and p.chosen:
            # the ratio: the plan against the oracle's fastest re-timed finalist (the least
            # paired time), in the second run, round by round (a round's samples run back to
            # back, so the machine's slow spells, which move one program's median by several
            # percent between runs, cancel); worst_ratio: against the finalist the plan is
            # slowest against, the largest of several noisy ratios, so biased high
            mine = rounds[p.chosen.program]
            paired = {r["program"]: (statistics.median(a / b for a, b in zip(mine, rounds[r["program"]])), r)
                      for r in fitting if r["program"] in rounds}
            top = min((r for _, r in paired.values()), key=lambda r: paired_again[r["program"]])
            row.update(plan_ms=ms_again[p.chosen.program], oracle=top["label"], oracle_ms=ms_again[top["program"]],
                       oracle_temp_bytes=top["temp_bytes"], ratio=paired[top["program"]][0],
                       worst_ratio=max(v[0] for v in paired.values()),
                       ratio_of_medians=ms_again[p.chosen.program] / ms_again[top["program"]])
        out.append(row)
        log(json.dumps(row))
    return out


def markdown(rows: list[dict]) -> str:
    mib = 2**20
    lines = ["| model | depth | budget | plan | plan ms | oracle's fastest fitting | oracle ms | ratio | worst ratio "
             "| plan temp MiB (limit) | oracle min MiB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    def cell(value: float | None, digits: int, scale: float = 1.0) -> str:  # "-": nothing measured
        return "-" if value is None else f"{value / scale:.{digits}f}"

    for r in rows:
        plan_cell = r["plan"] or "cannot be met (no assignment fits)"
        lines.append(
            f"| {r['model']} | {r['depth']} | {r['budget']} | {plan_cell} | {cell(r['plan_ms'], 2)} | "
            f"{r['oracle'] or '-'} | {cell(r['oracle_ms'], 2)} | {cell(r.get('ratio'), 3)} | "
            f"{cell(r.get('worst_ratio'), 3)} | {cell(r['plan_temp_bytes'], 2, mib)} ({r['limit_bytes'] / mib:.2f}) | "
            f"{r['oracle_min_temp_bytes'] / mib:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.optimality", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="depth 4 only")
    parser.add_argument("--models", default="mlp,transformer,cnn,mixed,unequal,scanned",
                        help="registry models, the steps of benchmarks.foreign_steps, and scanned "
                             "(benchmarks.scanned_oracle: a six-layer lax.scan, every two-segment split)")
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--repeat", type=int, default=7, help="interleaved timing rounds (medians)")
    add_results_argument(parser)
    args = parser.parse_args(argv)
    from benchmarks.foreign_steps import BUDGETS as FOREIGN_BUDGETS
    from benchmarks.foreign_steps import STEPS
    from benchmarks.scanned_oracle import DEPTH as SCANNED_DEPTH

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    rows = []
    for model in args.models.split(","):
        # the CNN pools 2x per block: its 8x8 images allow at most 3 blocks
        depths = (3,) if model == "cnn" else (SCANNED_DEPTH,) if model == "scanned" else (4,) \
            if args.quick or model in STEPS else (4, 5)
        for depth in depths:
            rows += run_one(model, depth, args.repeat, log, FOREIGN_BUDGETS if model in STEPS else BUDGETS)
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "optimality.json"), "w") as f:
                json.dump(rows, f, indent=1)
    with open(os.path.join(args.out, "optimality.md"), "w") as f:
        f.write(markdown(rows))
    name = "optimality-scanned" if args.models == "scanned" else "optimality-quick" if args.quick else "optimality"
    write_result(args.results, name, markdown(rows), argv,
                 "benchmarks.optimality")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

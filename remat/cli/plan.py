"""``remat plan``: the fastest checkpointing of a model's training step that fits a budget."""
from __future__ import annotations

import argparse

from remat.cli._common import (
    EXIT_CHECK_FAILED,
    EXIT_OK,
    UsageError,
    add_keep_freed_memory_flag,
    apply_keep_freed_memory_flag,
    build_task,
    print_json,
    print_table,
)

HELP = "find the fastest remat plan whose compiled memory fits a budget, beside every fixed policy"
EXAMPLE = "remat plan transformer --budget 0.5 --depth 8"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="mlp, transformer, cnn, seed-model, seed-mymodel or path/to/file.py:factory")
    parser.add_argument("--memory-budget", "--budget", dest="budget", type=float, required=True, metavar="F",
                        help="the whole step's compiled temp memory allowed, as a fraction in (0, 1] of no "
                             "checkpoint (--budget is the shorter spelling)")
    parser.add_argument("--depth", type=int, default=None, help="number of blocks (built-in models)")
    parser.add_argument("--width", type=int, default=None, help="block width (built-in models)")
    parser.add_argument("--batch-size", type=int, default=None, help="batch size (default: the model's)")
    parser.add_argument("--seq-len", type=int, default=None, help="transformer context length")
    parser.add_argument("--repeat", type=int, default=5, help="timed steps per fitting candidate (median)")
    parser.add_argument("--seed", type=int, default=0)
    add_keep_freed_memory_flag(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    if not 0 < args.budget <= 1:
        raise UsageError(f"--budget {args.budget}: use a fraction in (0, 1], e.g. --budget 0.5")
    if args.repeat < 1:
        raise UsageError("--repeat must be at least 1")
    apply_keep_freed_memory_flag(args)  # before JAX starts its threads
    from remat.models.tasks import pure_step_loss
    from remat.planner import plan

    # every block checkpointed (policy "nothing"); the planner re-decides each region
    budget = args.budget
    task = build_task(args)
    loss, step_args = pure_step_loss(task)
    result = plan(loss, *step_args, budget=budget, repeat=args.repeat)
    if args.json:
        print_json({"model": task.name, **result.to_dict()})
    else:
        mib = 2**20
        rows = [[("-> " if result.chosen and c.label == result.chosen.label else "   ") + c.label,
                 f"{c.temp_bytes / mib:.1f}", f"{c.temp_bytes / result.none_temp_bytes:.2f}",
                 "yes" if c.fits else "no", f"{c.predicted_ms:.2f}",
                 "-" if c.measured_ms is None else f"{c.measured_ms:.2f}"] for c in result.candidates]
        print_table(f"remat plan {task.name}: budget {budget} of {result.none_temp_bytes / mib:.1f} MiB "
                    f"compiled temp memory, {result.num_regions} regions",
                    ["candidate", "temp MiB", "of none", "fits", "predicted ms", "measured ms"], rows)
        if result.chosen is None:
            print(f"the budget cannot be met: the minimum found is {result.minimum_bytes / mib:.1f} MiB "
                  f"({result.minimum_bytes / result.none_temp_bytes:.2f} of no checkpoint); "
                  "raise --budget or use remat.scan for stacks of identical layers")
        else:
            print(f"plan: {result.chosen.label} ({result.chosen.temp_bytes / mib:.1f} MiB, "
                  f"{result.chosen.measured_ms:.2f} ms per step)")
    return EXIT_OK if result.feasible else EXIT_CHECK_FAILED

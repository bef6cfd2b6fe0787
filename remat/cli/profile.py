"""``remat profile``: residual bytes, compiled memory and step time per checkpoint policy."""
from __future__ import annotations

import argparse

from remat._names import NO_CHECKPOINT, POLICY_NAMES, is_no_checkpoint
from remat.cli._common import (
    EXIT_OK,
    UsageError,
    add_checkpoint_flags,
    add_keep_freed_memory_flag,
    apply_keep_freed_memory_flag,
    build_task,
    print_json,
    print_table,
    validate_checkpoint_flags,
)

HELP = "compare checkpoint policies for one model: residual bytes, compiled memory, step time"
EXAMPLE = "remat profile transformer --depth 8 --plot policies.png"

DEFAULT_POLICIES = ",".join(POLICY_NAMES)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="mlp, transformer, cnn, seed-model, seed-mymodel or path/to/file.py:factory")
    parser.add_argument("--depth", type=int, default=4, help="number of blocks (default 4)")
    parser.add_argument("--width", type=int, default=None, help="block width (default: the model's)")
    parser.add_argument("--batch-size", type=int, default=None, help="batch size (default: the model's)")
    parser.add_argument("--seq-len", type=int, default=None, help="transformer context length")
    parser.add_argument("--seed", type=int, default=0)
    add_checkpoint_flags(parser, every_aliases=("--every",))
    parser.add_argument("--policies", default=DEFAULT_POLICIES,
                        help=f"comma-separated policies to compare (default {DEFAULT_POLICIES}); "
                             f"'{NO_CHECKPOINT}' = no checkpoint")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per policy, median reported (default 5)")
    parser.add_argument("--plot", metavar="FILE", default=None, help="also write a PNG of memory vs step time")
    add_keep_freed_memory_flag(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _policies(spec: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in spec.split(",") if p.strip())
    valid = POLICY_NAMES
    bad = [p for p in names if p not in valid]
    if not names or bad:
        raise UsageError(f"--policies {spec!r}: unknown {bad or 'empty list'}; use a comma list of {', '.join(valid)}")
    return names


def run(args: argparse.Namespace) -> int:
    if args.depth < 1:
        raise UsageError(f"--depth {args.depth}: use at least 1")
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: use at least 1")
    policies = _policies(args.policies)
    validate_checkpoint_flags(args)
    apply_keep_freed_memory_flag(args)  # before JAX starts its threads

    from remat.analysis import compare_policies
    from remat.models.tasks import pure_step_loss
    from remat.planner.steering import apply_policies, count_regions
    from remat.policies import NO_CHECKPOINT as NONE

    # every block is a checkpointed region; each policy is applied to all of them at trace time
    task = build_task(args)
    loss, step_args = pure_step_loss(task)
    n = count_regions(loss, *step_args)

    def factory(policy: str):
        return apply_policies(loss, [NONE if is_no_checkpoint(policy) else policy] * n)

    table = compare_policies(factory, *step_args, policies=policies, steps=args.steps)
    title = f"remat profile {args.model} --depth {args.depth}"
    if args.checkpoint:  # the regions are the modules apply_checkpointing selected
        title += f" --checkpoint {' '.join(args.checkpoint)} ({n} regions)"
    plot = table.plot(args.plot, title=title) if args.plot else None

    if args.json:
        print_json({"model": args.model, "depth": args.depth, "checkpoint": args.checkpoint, "regions": n,
                    "plot": plot, **table.to_dict()})
    else:
        print_table(f"{title}: gradient step per policy",
                    table.columns, table.rows())
        if plot:
            print(f"plot written to {plot}")
    return EXIT_OK

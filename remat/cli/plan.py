"""``remat plan``: the fastest checkpointing of a model's training step that fits a budget."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from remat.cli import _mesh
from remat.cli._common import (
    EXIT_CHECK_FAILED,
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

HELP = "find the fastest remat plan whose compiled memory fits a budget, beside every fixed policy"
EXAMPLE = "remat plan transformer --budget 0.5 --depth 8"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="mlp, transformer, cnn, seed-model, seed-mymodel or path/to/file.py:factory")
    limit = parser.add_mutually_exclusive_group(required=True)
    limit.add_argument("--memory-budget", "--budget", dest="memory_budget", type=float, default=None, metavar="F",
                       help="the whole step's compiled temp memory allowed, as a fraction in [0, 1] of no "
                            "checkpoint; 0: the leanest plan found (--budget is the shorter spelling)")
    limit.add_argument("--memory-limit", dest="memory_limit", default=None, metavar="BYTES",
                       help="the most the compiled step may hold on one device (arguments + outputs + temp), "
                            "e.g. 6GiB, 512MiB, 8GB or a plain number of bytes")
    parser.add_argument("--out", default=None, metavar="FILE",
                        help="save the chosen plan as JSON (remat train/explain MODEL --plan FILE apply it)")
    parser.add_argument("--depth", type=int, default=None, help="number of blocks (built-in models)")
    parser.add_argument("--width", type=int, default=None, help="block width (built-in models)")
    parser.add_argument("--batch-size", type=int, default=None, help="batch size (default: the model's)")
    parser.add_argument("--seq-len", type=int, default=None, help="transformer context length")
    parser.add_argument("--mesh", default=None, metavar="data=D,fsdp=F",
                        help="plan the step sharded as remat train --mesh shards it (the batch over both axes, "
                             "parameters over fsdp) on D * F devices (on CPU: host devices); every byte figure "
                             "is then per device")
    parser.add_argument("--repeat", type=int, default=5, help="timed steps per fitting candidate (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exhaustive", action="store_true",
                        help="compile every candidate of the families (slow; default: solve for the fastest "
                             "per-region assignment predicted to fit, compile it and the next leaner one)")
    parser.add_argument("--second-opinion", action="store_true",
                        help="also compile and time the fastest assignment without the pick's main policy")
    add_checkpoint_flags(parser, every_aliases=("--every",))
    add_keep_freed_memory_flag(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from remat.planner._units import parse_bytes

    if args.memory_budget is not None and not 0 <= args.memory_budget <= 1:
        raise UsageError(f"--budget {args.memory_budget}: use a fraction in [0, 1] (0: the leanest plan), "
                         "e.g. --budget 0.5")
    try:
        memory_limit = None if args.memory_limit is None else parse_bytes(args.memory_limit)
    except ValueError as e:
        raise UsageError(f"--memory-limit {args.memory_limit}: {e}") from None
    if args.out is not None and not args.out.strip():
        raise UsageError("--out: give a file name")
    if args.repeat < 1:
        raise UsageError("--repeat must be at least 1")
    validate_checkpoint_flags(args)
    sizes = _mesh.parse_mesh(args.mesh) if args.mesh is not None else None
    if sizes is not None and args.batch_size is not None and args.batch_size % _mesh.mesh_size(sizes):
        raise UsageError(f"--batch-size {args.batch_size} does not split evenly over the {_mesh.mesh_size(sizes)} "
                         f"devices of --mesh {_mesh.mesh_label(sizes)}; use a multiple of {_mesh.mesh_size(sizes)}")
    apply_keep_freed_memory_flag(args)  # before JAX starts its threads
    mesh = _planning_mesh(sizes)
    from remat.models.tasks import pure_step_loss
    from remat.planner import plan, region_choices

    # every block checkpointed (policy "nothing"); the planner re-decides each region
    budget = args.memory_budget
    task = build_task(args)
    loss, step_args = pure_step_loss(task)
    if mesh is not None:
        _mesh.check_batch(task.batch_size, mesh)
        step_args = _mesh.shard_step_args(step_args, mesh)
    # the yardstick of the plan's time: what a user waits for to jit the step, measured alone
    jit_s = jit_seconds(loss, step_args) if args.json else None
    result = plan(loss, *step_args, memory_budget=budget, memory_limit=memory_limit, repeat=args.repeat,
                  exhaustive=args.exhaustive,
                  second_opinion=args.second_opinion,
                  progress=lambda line: print(line, file=sys.stderr, flush=True))
    plan_s = result.plan_s or 0.0  # plan() always measures it
    modules = _module_choices(loss, step_args, result.chosen) if args.checkpoint else []
    if args.out is not None and result.chosen is not None:
        result.save(args.out)
    if args.json:
        print_json({"model": task.name, "checkpoint": args.checkpoint, "mesh": sizes,
                    "modules": [{"path": p, "policy": s} for p, s in modules],
                    "regions": region_choices(result, loss, *step_args), **result.to_dict(),
                    "jit_s": jit_s})
    else:
        mib = 2**20
        rows = [[("-> " if result.chosen and c.label == result.chosen.label else "   ") + c.label,
                 *((f"{c.temp_bytes / mib:.1f}", f"{c.temp_bytes / result.none_temp_bytes:.2f}")
                   if c.temp_bytes is not None else ("-", "not compiled")),
                 "yes" if c.fits else "no", "-" if c.predicted_ms is None else f"{c.predicted_ms:.2f}",
                 "-" if c.measured_ms is None else f"{c.measured_ms:.2f}"] for c in result.candidates]
        per_device = f" per device of mesh {_mesh.mesh_label(sizes)}" if sizes is not None else ""
        asked = (f"budget {budget}" if budget is not None
                 else f"limit {args.memory_limit} per device: budget {result.memory_budget:.3g}")
        print_table(f"remat plan {task.name}: {asked} of {result.none_temp_bytes / mib:.1f} MiB "
                    f"compiled temp memory{per_device}, {result.num_regions} regions"
                    + (f" ({task.policy})" if args.checkpoint else ""),
                    ["candidate", "temp MiB", "of none", "fits", "predicted ms", "measured ms"], rows)
        if result.chosen is None:
            if memory_limit is not None:
                print(result.shortfall())
            else:
                print(f"the budget cannot be met: the minimum found is {result.minimum_bytes / mib:.1f} MiB "
                      f"({result.minimum_bytes / result.none_temp_bytes:.2f} of no checkpoint); "
                      "raise --budget or use remat.scan for stacks of identical layers")
        else:
            chosen_bytes, chosen_ms = result.chosen.temp_bytes or 0, result.chosen.speed_ms() or float("nan")
            print(f"plan: {result.chosen.label} ({chosen_bytes / mib:.1f} MiB, {chosen_ms:.2f} ms per step)")
            if result.device_bytes is not None:
                print(f"on one device: {result.device_bytes / mib:.1f} MiB (arguments, outputs and temp)")
            if args.out is not None:
                print(f"saved to {args.out}")
            if modules:
                print("per module: " + ", ".join(f"{p} {s}" for p, s in modules))
            for line in result.why():
                print(line)
        compiled = sum(c.compiled is not None for c in result.candidates)
        compile_s = result.compile_s
        one = f" ({plan_s / compile_s:.1f}x one compile of the un-checkpointed step, " \
              f"{compile_s:.1f} s)" if compile_s else ""
        print(f"planned in {plan_s:.1f} s{one}: {len(result.candidates)} candidates, {compiled} compiled, "
              f"{len({c.program for c in result.candidates if c.program})} distinct programs")
    return EXIT_OK if result.feasible else EXIT_CHECK_FAILED


def _planning_mesh(sizes: dict[str, int] | None) -> Any:
    """The ``--mesh`` to plan on (its CPU host devices made before JAX starts), or None."""
    if sizes is None:
        return None
    from remat.cli._devices import setup_devices

    label = f"--mesh {_mesh.mesh_label(sizes)}"
    return _mesh.make_mesh(sizes, setup_devices(_mesh.mesh_size(sizes), flag=label))


def jit_seconds(loss: Any, step_args: tuple) -> float:
    """Seconds to trace, lower and compile ``jax.jit(jax.grad(loss))`` for ``step_args``,
    with nothing else running: what a user waits for before the step's first run. The
    function is a fresh one, so no trace or compile is shared with any other.

    Example:
      >>> jit_seconds(loss, (params, x)) > 0  # doctest: +SKIP
      True
    """
    import time

    from remat.planner.programs import lower_step

    started = time.perf_counter()
    lower_step(lambda *a: loss(*a), step_args).compile()
    return time.perf_counter() - started


def _module_choices(loss: Any, step_args: tuple, chosen: Any) -> list[tuple[str, str]]:
    """``--checkpoint``: the plan's choice for each module apply_checkpointing selected."""
    from remat.planner import region_paths
    from remat.policies import policy_name

    if chosen is None:
        return []
    paths = region_paths(loss, *step_args)
    if len(paths) != len(chosen.policies):
        return []
    return [(".".join(map(str, p)) if p is not None else "(by hand)", policy_name(s))
            for p, s in zip(paths, chosen.policies)]

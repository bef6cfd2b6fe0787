"""The planner's recompute prices against measured steps: one option on every region, page faults removed.

``python -m benchmarks.recompute MODEL [remat plan's model flags and --repeat]`` (for
example ``transformer --depth 8 --width 128 --batch-size 8 --seq-len 128``) compiles the
step with every region un-checkpointed, and with each option of the default search
(``nothing``, ``dots_no_batch``, ``dots`` and the checkpoint names, all and each alone) on
every region, times them side by side in interleaved rounds, and prints a Markdown table:
each option's kept bytes a region, temp bytes, step time, the recompute a region measured
(its step time over the un-checkpointed one's, over the regions) and the time model's
(:func:`remat.planner._costs.region_costs`). It calls ``remat.keep_freed_memory()``
first, so that the temp buffers over glibc's mmap threshold are not page-faulted afresh
at every step: the faults are charged separately, and would otherwise swamp the
recomputation.
"""
from __future__ import annotations

import argparse
import sys

import remat
from benchmarks.results import add_results_argument, write_result

MIB = 2**20


def rows(argv: list[str]) -> list[dict]:
    """One row per option: ``option``, ``kept_bytes`` (a region's), ``temp_bytes``,
    ``step_ms``, ``measured_ms`` and ``predicted_ms`` (the recompute of one region)."""
    import remat.cli.plan as plan_command
    from remat.analysis.compiled import CompiledMemory
    from remat.analysis.machine import calibrate_once
    from remat.cli._common import build_task
    from remat.models.tasks import pure_step_loss
    from remat.planner._costs import start_region_costs
    from remat.planner._families import PLANNED_POLICIES, name_groups
    from remat.planner.programs import lower_step, time_side_by_side
    from remat.planner.steering import apply_policies, survey
    from remat.policies import NO_CHECKPOINT as NONE
    from remat.policies import policy_name

    parser = argparse.ArgumentParser()
    plan_command.configure(parser)
    args = parser.parse_args([*argv, "--budget", "0.5"])
    loss, step_args = pure_step_loss(build_task(args))
    surveyed = survey(loss, *step_args)
    n = surveyed.regions
    rates = calibrate_once()
    options = [NONE, *PLANNED_POLICIES, *name_groups(surveyed.names)]
    # the survey's trace, reused
    costing = start_region_costs(loss, step_args, n, options, rates=rates, jaxpr=surveyed.jaxpr)
    if costing is None:
        raise SystemExit("the step's regions are not plain checkpointed blocks (a scan over layers, say)")
    costs = costing()
    compiled = [lower_step(apply_policies(loss, (o,) * n), step_args).compile() for o in options]
    times = time_side_by_side(compiled, step_args, args.repeat)
    # the middle region: the first takes the step's argument, which it does not keep
    middle = n // 2
    return [{"option": policy_name(o), "kept_bytes": costs.kept[middle][j],
             "temp_bytes": CompiledMemory.from_compiled(compiled[j]).temp_bytes, "step_ms": times[j],
             "measured_ms": (times[j] - times[0]) / n, "predicted_ms": costs.ms[middle][j]}
            for j, o in enumerate(options)]


def table(found: list[dict]) -> str:
    lines = ["| option on every region | kept MiB a region | temp MiB | step ms | recompute ms a region, measured "
             "| predicted |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['option']} | {r['kept_bytes'] / MIB:.2f} | {r['temp_bytes'] / MIB:.1f} | {r['step_ms']:.1f} "
              f"| {r['measured_ms']:.2f} | {r['predicted_ms']:.2f} |" for r in found]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    remat.keep_freed_memory()  # before JAX starts its threads
    own = argparse.ArgumentParser(add_help=False)
    add_results_argument(own)
    args, plan_flags = own.parse_known_args(sys.argv[1:] if argv is None else argv)
    found = table(rows(plan_flags))
    print(found)
    write_result(args.results, "recompute", found, argv, "benchmarks.recompute")
    return 0


if __name__ == "__main__":
    sys.exit(main())

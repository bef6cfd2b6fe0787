"""``python -m benchmarks.scan_schedules``: compiled temp memory of the scan schedules ``remat.plan`` weighs.

The benchmark's scanned models (the ``scan`` variant of :mod:`benchmarks.jax_programs`, quick
sizes unless ``--sizes`` says otherwise, 16 blocks) planned with ``measure=False, exhaustive=True``: every
scan candidate (flat, ``k`` equal groups, the binomial schedules) is compiled for its temp
bytes, none is timed. Prints one Markdown row per model and policy; the "scan schedules,
for the record" figures of docs/planner.md are this output.
"""
from __future__ import annotations

import argparse

import jax

from benchmarks.cases import SIZES, build
from benchmarks.jax_programs import jax_inputs, jax_loss
from benchmarks.results import add_results_argument, write_result

MiB = 2**20
SCHEDULES = ("flat", "8 groups", "4 groups", "2 groups", "binomial(levels=1)", "binomial(levels=2)")


def measure(model: str, depth: int, sizes: str = "quick") -> dict[str, dict[str, float]]:
    """Temp MiB of each scan candidate of the planner, by policy and schedule."""
    from remat.planner import plan

    built = build(model, depth, SIZES[sizes])
    loss, params = jax_loss(built, "scan")
    p = plan(loss, params, *jax_inputs(built), memory_budget=1.0, measure=False, early_reject=False,
             exhaustive=True)
    table: dict[str, dict[str, float]] = {}
    for c in p.candidates:  # labels such as "scan: nothing, binomial(levels=1) (6, 5, 4, 1)"
        if c.label.startswith("scan: ") and c.temp_bytes is not None:
            policy, schedule = c.label.removeprefix("scan: ").split(", ", 1)
            schedule = next((s for s in SCHEDULES if schedule.startswith(s)), schedule)
            table.setdefault(policy, {})[schedule] = c.temp_bytes / MiB
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scan_schedules", description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--models", default="transformer,mlp")
    parser.add_argument("--sizes", default="quick", choices=sorted(SIZES))
    add_results_argument(parser)
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {args.depth} blocks, compiled temp MiB")
    lines = ["| model | policy | " + " | ".join(SCHEDULES) + " |", "|---" * (len(SCHEDULES) + 2) + "|"]
    print("\n".join(lines))
    for model in args.models.split(","):
        for policy, row in measure(model, args.depth, args.sizes).items():
            cells = [f"{row[s]:.1f}" if s in row else "-" for s in SCHEDULES]
            lines.append(f"| {model} | {policy} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    if args.sizes != "tiny":  # tiny sizes are the tests' smoke runs, not a result
        write_result(args.results, "scan-schedules", f"{args.depth} blocks, compiled temp MiB:\n\n" + "\n".join(lines),
                     argv, "benchmarks.scan_schedules")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

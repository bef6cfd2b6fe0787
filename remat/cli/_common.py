"""Shared conventions for every ``remat`` subcommand.

Exit codes: 0 ok, 1 a check failed, 2 bad usage. A subcommand raises
:class:`UsageError` for bad input (printed as one line, exit 2) and returns 1 when a
check it ran failed. ``--json`` prints exactly one JSON object on stdout.
"""
from __future__ import annotations

import json
import sys
from typing import Any, TypeVar

Report = TypeVar("Report")

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input from the user: printed as ``remat: error: <message>``, exit code 2."""


def print_json(obj: Any) -> None:
    """Prints ``obj`` as one JSON object on stdout (NumPy scalars become numbers)."""

    def default(o: Any) -> Any:
        if hasattr(o, "item"):
            return o.item()
        if hasattr(o, "tolist"):
            return o.tolist()
        return str(o)

    json.dump(obj, sys.stdout, default=default)
    sys.stdout.write("\n")


def expect_report(report: Any, kind: type[Report]) -> Report:
    """``report`` as the ``kind`` its call returns for the options given (compare_gradients and
    compare_training return a PrecisionReport in low precision, else their own report)."""
    if not isinstance(report, kind):
        raise TypeError(f"expected a {kind.__name__}, got a {type(report).__name__}")
    return report


def print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    """Prints a table for people: rich when installed, plain aligned text otherwise."""
    cells = [[str(c) for c in row] for row in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is optional: fall back to aligned text.
        widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(columns)]
        print(title)
        print("  ".join(h.ljust(w) for h, w in zip(columns, widths)))
        print("  ".join("-" * w for w in widths))
        for r in cells:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
        return
    table = Table(title=title)
    for h in columns:
        table.add_column(h)
    for r in cells:
        table.add_row(*r)
    # Wide enough for every cell on one line: output is often piped or logged, not a tty.
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(columns)]
    Console(width=max(80, sum(widths) + 3 * len(widths) + 4)).print(table)


def add_keep_freed_memory_flag(parser: Any) -> None:
    """``--keep-freed-memory``: :func:`remat.keep_freed_memory` before any JAX computation."""
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="keep freed memory in glibc's heap so XLA:CPU's temp buffers are not "
                             "page-faulted afresh every step (faster steps, resident memory stays at its peak)")


def apply_keep_freed_memory_flag(args: Any) -> None:
    if getattr(args, "keep_freed_memory", False):
        from remat.analysis.allocator import keep_freed_memory

        if not keep_freed_memory():
            print("remat: --keep-freed-memory needs glibc; the C library here keeps its own behaviour",
                  file=sys.stderr)


def flag(option: str) -> str:
    """The command-line spelling of a keyword argument: ``seq_len`` -> ``--seq-len``."""
    return "--" + option.replace("_", "-")


def build_task(args: Any, *, policy: str | None = None, residual_budget: float | None = None) -> Any:
    """:func:`remat.models.tasks.make_task` from the parsed ``MODEL``, ``--seed`` and size flags.

    ``policy`` and ``residual_budget`` (a fraction of each region's residual bytes) are
    passed apart: ``remat plan``'s ``--memory-budget`` bounds the whole step, not the task.
    A :class:`~remat.models.tasks.TaskError` becomes a :class:`UsageError` that names the
    flags. With ``--checkpoint CLASSNAME`` the model is built without its own checkpoints
    and :func:`remat.apply_checkpointing` checkpoints the modules of those classes instead,
    with ``policy`` or ``residual_budget``.
    """
    from remat.models.tasks import TaskError, make_task

    classes = getattr(args, "checkpoint", None)
    try:
        if not classes:
            return make_task(args.model, seed=args.seed, policy=policy, residual_budget=residual_budget,
                             depth=args.depth, width=args.width, seq_len=args.seq_len, batch_size=args.batch_size)
        from remat.models import MODELS

        own = "no_checkpoint" if args.model in MODELS else None  # a factory's model stays as built
        task = make_task(args.model, seed=args.seed, policy=own, depth=args.depth, width=args.width,
                         seq_len=args.seq_len, batch_size=args.batch_size)
    except TaskError as e:
        raise UsageError(e.spelled(flag)) from None
    _apply_checkpoint_flags(task, classes, getattr(args, "checkpoint_every", None) or 1, policy, residual_budget)
    return task


def add_checkpoint_flags(parser: Any, *, every_aliases: tuple[str, ...] = ()) -> None:
    """``--checkpoint CLASSNAME`` (repeatable) and ``--checkpoint-every K``: :func:`remat.apply_checkpointing`."""
    parser.add_argument("--checkpoint", action="append", default=None, metavar="CLASSNAME",
                        help="checkpoint every module of this class with remat.apply_checkpointing instead of "
                             "the model's own checkpoints (repeatable; e.g. --checkpoint Block)")
    parser.add_argument("--checkpoint-every", *every_aliases, dest="checkpoint_every", type=int, default=None,
                        metavar="K", help="with --checkpoint: only every K-th matching module (default 1: all)")


def validate_checkpoint_flags(args: Any) -> None:
    every = getattr(args, "checkpoint_every", None)
    if every is not None and not getattr(args, "checkpoint", None):
        raise UsageError(f"--checkpoint-every {every} needs --checkpoint CLASSNAME (the modules to count)")
    if every is not None and every < 1:
        raise UsageError(f"--checkpoint-every must be at least 1, got {every}")


def _apply_checkpoint_flags(task: Any, classes: list[str], every: int, policy: str | None,
                            residual_budget: float | None) -> None:
    """Checkpoints the task's modules of ``classes``; a class the model lacks is a usage error."""
    from flax import nnx

    from remat import apply_checkpointing, checkpointed
    from remat._names import is_no_checkpoint
    from remat.models import MODELS

    present = {type(m).__name__ for _, m in nnx.iter_graph(task.model) if isinstance(m, nnx.Module)}
    missing = [c for c in classes if c not in present]
    if missing:
        raise UsageError(f"--checkpoint {missing[0]}: {task.name} has no module of that class; its classes are "
                         f"{', '.join(sorted(present))}")
    if residual_budget is not None:
        from remat.analysis.budget import residual_budget as make_budget

        spec, label = make_budget(residual_budget), f"residual_budget({residual_budget})"
    elif policy == "names":
        entry = MODELS.get(task.name)
        names = entry.checkpoint_names if entry else tuple(getattr(task.model, "checkpoint_names", ()))
        spec, label = list(names) or None, "names"
    elif is_no_checkpoint(policy):
        spec, label = "no_checkpoint", "no_checkpoint"
    else:
        spec, label = policy, policy or "nothing"
    wanted = set(classes)
    apply_checkpointing(task.model, lambda path, m: type(m).__name__ in wanted, policy=spec, every=every)
    task.policy = f"{label} on {len(checkpointed(task.model))} {'/'.join(classes)} (apply_checkpointing)"

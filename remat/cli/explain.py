"""``remat explain``: where the memory of a model's training step goes, every byte at the peak attributed.

Builds a model's gradient step (a built-in model, a HuggingFace twin or a factory),
checkpointed with ``--policy``, ``--checkpoint CLASS`` (:func:`remat.apply_checkpointing`)
or the plan :func:`remat.plan` finds for ``--plan BUDGET``, and explains it with
:func:`remat.explain`: the buffers at the peak of its compiled memory with their kind,
module, source line, region and policy rule; warnings with their fix; optionally the
timeline as a plot and as a trace file for Perfetto or PyTorch's memory_viz.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any

from remat._names import POLICY_NAMES
from remat.cli._common import (
    EXIT_OK,
    UsageError,
    build_task,
    flag,
    print_json,
    print_table,
    validate_checkpoint_flags,
)

HELP = "explain a step's compiled memory: every buffer at the peak with its kind, module, line and policy rule"
EXAMPLE = "remat explain transformer --policy dots --plot memory.png --trace memory.json"

POLICIES = (*POLICY_NAMES, "names")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="mlp, transformer, cnn, seed-model, seed-mymodel; llama, gpt2, resnet (HuggingFace "
                             "twins' Flax side); or path/to/file.py:factory")
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--policy", default=None, choices=POLICIES,
                     help="the policy of every checkpointed block ('names': the model's tagged values; "
                          "'no_checkpoint': none). Default: nothing, as torch.utils.checkpoint")
    how.add_argument("--plan", default=None, metavar="BUDGET|FILE",
                     help="explain the plan remat.plan finds for this memory budget (a fraction of the "
                          "un-checkpointed step's compiled temp memory), or the plan saved in FILE "
                          "(remat plan MODEL ... --out FILE)")
    parser.add_argument("--checkpoint", action="append", default=None, metavar="CLASS",
                        help="checkpoint the modules of this class with remat.apply_checkpointing instead of the "
                             "model's own checkpoints (repeatable; with --policy: their policy)")
    parser.add_argument("--checkpoint-every", "--every", dest="checkpoint_every", type=int, default=None,
                        metavar="K", help="with --checkpoint: only every K-th matching module")
    parser.add_argument("--depth", type=int, default=None, help="number of blocks (built-in models)")
    parser.add_argument("--width", type=int, default=None, help="block width (built-in models)")
    parser.add_argument("--batch-size", type=int, default=None, help="batch size (default: the model's)")
    parser.add_argument("--seq-len", type=int, default=None, help="transformer context length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"),
                        help="the parameters' and inputs' floating dtype (float64 runs under jax.enable_x64)")
    parser.add_argument("--top", type=int, default=15, help="buffers listed in the table (default 15)")
    parser.add_argument("--plot", metavar="FILE", default=None, help="write the timeline as a PNG")
    parser.add_argument("--trace", metavar="FILE", default=None,
                        help="write the timeline for a viewer: FILE.json (Perfetto / chrome://tracing) or "
                             "FILE.pickle (PyTorch's memory snapshot, https://pytorch.org/memory_viz)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the report's keys)")


def _hf_task(args: argparse.Namespace, policy: str | None) -> Any:
    """The training task of a HuggingFace twin's Flax side: its example batch, cross-entropy."""
    import numpy as np

    from remat.models import HF_MODELS
    from remat.models.tasks import Task, TaskError, cross_entropy, init_model, remat_settings

    entry = HF_MODELS[args.model]
    for option in ("depth", "width", "seq_len"):
        if getattr(args, option) is not None:
            raise UsageError(f"{flag(option)} does not apply to {args.model} (its config is fixed)")
    try:
        settings, label = remat_settings("no_checkpoint" if args.checkpoint else policy)
    except TaskError as e:
        raise UsageError(e.spelled(flag)) from None
    overrides = {"batch": args.batch_size} if args.batch_size else {}
    config = entry.make_config(settings, **overrides)
    module = sys.modules[entry.module.__module__]
    (x,) = module.example_inputs(config, args.seed)
    y = module.example_targets(config, args.seed)
    model = init_model(entry.module, config, args.seed)
    if getattr(model, "input_layout", None) == "NHWC" and x.ndim == 4:
        x = x.transpose(0, 2, 3, 1)  # the twins' examples are PyTorch's NCHW
    x = x.astype(np.int32) if x.dtype == np.int64 else x
    batch = ((x,), y.astype(np.int32))
    return Task(args.model, "hf", "the twin's example batch", model, lambda step: batch, cross_entropy,
                x.shape[0], policy=label)


def _task(args: argparse.Namespace) -> Any:
    """The model's task, checkpointed as the flags say (``--plan`` re-decides it later)."""
    from remat.cli._common import _apply_checkpoint_flags
    from remat.models import HF_MODELS

    if args.model not in HF_MODELS:
        return build_task(args, policy=args.policy)
    task = _hf_task(args, None if args.checkpoint else args.policy)
    if args.checkpoint:
        _apply_checkpoint_flags(task, args.checkpoint, args.checkpoint_every or 1, args.policy, None)
    return task


def run(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise UsageError(f"--top {args.top}: use at least 1")
    budget = _plan_budget(args.plan)
    if budget is not None and not 0 <= budget <= 1:
        raise UsageError(f"--plan {args.plan}: use a fraction in [0, 1] (0: the leanest plan), e.g. --plan 0.5")
    if args.plan is not None and budget is None and not os.path.isfile(args.plan):
        raise UsageError(f"--plan {args.plan}: neither a budget in [0, 1] nor a saved plan's file")
    if args.plan is not None and args.checkpoint:
        raise UsageError("--plan re-decides the model's own checkpoints; leave out --checkpoint")
    validate_checkpoint_flags(args)
    for option, path in (("--plot", args.plot), ("--trace", args.trace)):
        if path is not None and not path.strip():
            raise UsageError(f"{option}: give a file name")

    import jax

    x64 = jax.enable_x64(True) if args.dtype == "float64" else contextlib.nullcontext()
    with x64:
        report, label = _explain(args)
    plot = report.plot(args.plot, title=f"remat explain {args.model} ({label})") if args.plot else None
    trace = report.to_trace(args.trace) if args.trace else None
    if args.json:
        print_json({"model": args.model, "remat": label, "dtype": args.dtype, "plot": plot, "trace": trace,
                    **report.to_dict()})
        return EXIT_OK
    print_table(f"remat explain {args.model} ({label}, {args.dtype}): the largest buffers at the peak",
                report.columns, report.rows(args.top))
    for line in report.summary():
        print(line)
    if report.regions:
        print("regions: " + "; ".join(f"{r['region']} ({r['policy']}) keeps {_bytes(r['kept_bytes'])}"
                                      for r in report.regions))
    for warning in report.warnings:
        print(f"warning: {warning}")
    for what, path in (("plot", plot), ("trace", trace)):
        if path:
            print(f"{what} written to {path}")
    return EXIT_OK


def _bytes(n: int) -> str:
    from remat._core.residuals import format_bytes

    return format_bytes(n)


def _explain(args: argparse.Namespace) -> tuple[Any, str]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from remat.explainer.explanation import explain
    from remat.models.tasks import pure_step_loss

    task = _task(args)
    if args.dtype == "float64":  # every floating array of the model, before its step is split out
        cast = lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a  # noqa: E731
        nnx.update(task.model, jax.tree.map(cast, nnx.state(task.model)))
    loss, step_args = pure_step_loss(task)
    if args.dtype == "float64":
        step_args = jax.tree.map(cast, step_args)
    label = task.policy
    if args.plan is not None and _plan_budget(args.plan) is None:  # a saved plan
        from remat.planner import Plan

        saved = Plan.load(args.plan)
        assert saved.chosen is not None  # a saved plan is a feasible one
        loss, label = saved.apply(loss), f"plan {args.plan}: {saved.chosen.label}"
    elif args.plan is not None:
        from remat.planner import plan

        result = plan(loss, *step_args, memory_budget=float(args.plan), repeat=3)
        if result.chosen is None:
            raise UsageError(f"--plan {args.plan}: no plan fits; the minimum found is "
                             f"{result.minimum_bytes / result.none_temp_bytes:.2f} of no checkpoint")
        loss, label = result.apply(loss), f"plan for budget {args.plan}: {result.chosen.label}"
    return explain(jax.grad(loss), *step_args), label


def _plan_budget(flag: str | None) -> float | None:
    """``--plan``'s budget, where it is a number (None: not given, or a file name)."""
    try:
        return None if flag is None else float(flag)
    except ValueError:
        return None

"""``remat train``: train a built-in model or your own with optax, on one device or many.

The task (model, data, loss) comes from :mod:`remat.models.tasks`; the loop is
:mod:`remat.cli._train_loop`, with :mod:`remat.cli._devices` (devices, multi-process runs)
and :mod:`remat.cli._checkpoints` (save and resume). They are imported only when the
command runs, so ``remat --help`` stays fast.
"""
from __future__ import annotations

import argparse
import os
import sys

from remat._names import POLICY_NAMES
from remat.cli._common import (
    UsageError,
    add_checkpoint_flags,
    add_keep_freed_memory_flag,
    apply_keep_freed_memory_flag,
    validate_checkpoint_flags,
)

HELP = "train a model with activation checkpointing, on one device or many, with save/resume"
EXAMPLE = "remat train transformer --steps 200 --policy dots --devices 4 --save-dir runs/t --plot loss.png"

POLICIES = (*POLICY_NAMES, "names")  # names: the model's tagged values
OPTIMIZERS = ("sgd", "adam", "adamw")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        f"{HELP}.\n\nMODEL is one of mlp (regression on a fixed random teacher), transformer "
        "(character-level language model on a text that ships with remat), cnn (10-class synthetic "
        "images), seed-model, seed-mymodel, or path/to/file.py:factory. A factory is called as "
        "factory(seed=S) when it takes a seed, factory() otherwise, and returns (jax_model, "
        "torch_model, example_inputs) like the models/ files do; the NNX model is trained on its "
        "example inputs (the whole batch every step, leading axis = batch) to minimise "
        "train_loss(outputs, *inputs) when the factory's file defines it, otherwise the mean of "
        "the squared outputs. The torch model is not used (it may be None)."
    )
    parser.add_argument("model", metavar="MODEL",
                        help="mlp, transformer, cnn, seed-model, seed-mymodel or path/to/file.py:factory")
    parser.add_argument("--steps", type=int, default=100, help="total optimizer steps (default 100)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="global batch size, split across --devices (default 32; 16 for the transformer)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adam", help="optax optimizer (default adam)")
    parser.add_argument("--precision", choices=("float32", "mixed"), default="float32",
                        help="mixed: bfloat16 matmuls and convolutions on float32 parameters and optimizer state, "
                             "torch.autocast's rules (remat.crosscheck.autocast); default float32")
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default 0.1 for sgd, 3e-3 for adam/adamw)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--policy", choices=POLICIES, default=None,
                       help="remat policy for every block: no_checkpoint = no checkpointing, "
                            "nothing = save only the block inputs (torch.utils.checkpoint), everything, dots, "
                            "dots_no_batch, names = the values the model tags (default: nothing)")
    group.add_argument("--residual-budget", dest="residual_budget", type=float, default=None, metavar="F",
                       help="per block, keep at most this fraction (0 < F <= 1) of its residual bytes "
                            "(remat.residual_budget)")
    group.add_argument("--plan", default=None, metavar="FILE",
                       help="apply the plan `remat plan MODEL ... --out FILE` saved (same model flags)")
    add_checkpoint_flags(parser, every_aliases=("--every",))
    parser.add_argument("--depth", type=int, default=None, help="number of blocks (built-in models)")
    parser.add_argument("--width", type=int, default=None,
                        help="block width (mlp, transformer) or first conv's channels (cnn, doubled per block)")
    parser.add_argument("--seq-len", type=int, default=None, help="transformer context length (default 32)")
    parser.add_argument("--devices", type=int, default=None, metavar="N",
                        help="data-parallel over N devices (on CPU: N host devices; default: every device JAX sees)")
    parser.add_argument("--mesh", default=None, metavar="data=D,fsdp=F",
                        help="shard over a D x F device mesh: the batch over both axes, parameters and optimizer "
                             "state over fsdp (FSDP); D * F devices (on CPU: host devices); e.g. data=2,fsdp=2")
    parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                        help="multi-process run: address of process 0 (jax.distributed.initialize); "
                             "needs --num-processes and --process-id; --devices is then the global count")
    parser.add_argument("--num-processes", type=int, default=None, metavar="P",
                        help="multi-process run: how many processes take part")
    parser.add_argument("--process-id", type=int, default=None, metavar="I",
                        help="multi-process run: this process's index, 0 to P-1")
    parser.add_argument("--save-dir", default=None, metavar="DIR",
                        help="save params, optimizer state, step and loss history here (atomic; the last 2 kept)")
    parser.add_argument("--save-every", type=int, default=None, metavar="K",
                        help="save every K steps (default 10) and at the end")
    parser.add_argument("--resume", action="store_true", help="continue from the last save in --save-dir")
    parser.add_argument("--plot", default=None, metavar="PNG", help="write the loss curve to this PNG file")
    parser.add_argument("--seed", type=int, default=0, help="seeds the initialisation and the data order (default 0)")
    add_keep_freed_memory_flag(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object (no progress bar, no table)")


def validate(args: argparse.Namespace) -> None:
    """Checks everything that needs no JAX; raises :class:`UsageError`."""
    if args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    if args.plan is not None and not os.path.isfile(args.plan):
        raise UsageError(f"--plan {args.plan}: no such file (save one with remat plan MODEL ... --out FILE)")
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.lr is not None and not args.lr > 0:
        raise UsageError(f"--lr must be positive, got {args.lr}")
    if args.residual_budget is not None and not 0 < args.residual_budget <= 1:
        raise UsageError(f"--residual-budget must be in (0, 1] (a fraction of each block's residual bytes to keep), "
                         f"got {args.residual_budget}")
    if args.devices is not None and args.devices < 1:
        raise UsageError(f"--devices must be at least 1, got {args.devices}")
    if args.devices is not None and args.batch_size is not None and args.batch_size % args.devices:
        raise UsageError(
            f"--batch-size {args.batch_size} does not split evenly over --devices {args.devices}; "
            f"use a multiple of {args.devices}")
    _validate_mesh(args)
    _save_interval(args)
    validate_checkpoint_flags(args)
    _validate_distributed(args)
    for name in ("depth", "width", "seq_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.resume and not args.save_dir:
        raise UsageError("--resume needs --save-dir DIR (the directory an earlier run saved into)")


def _validate_mesh(args: argparse.Namespace) -> None:
    """Sets ``args.mesh_sizes`` from ``--mesh`` (None without it) and checks it against the other flags."""
    from remat.cli._mesh import mesh_label, mesh_size, parse_mesh

    args.mesh_sizes = None if args.mesh is None else parse_mesh(args.mesh)
    if args.mesh_sizes is None:
        return
    size, label = mesh_size(args.mesh_sizes), mesh_label(args.mesh_sizes)
    if args.devices is not None and args.devices != size:
        raise UsageError(f"--mesh {label} spans {size} devices but --devices is {args.devices}; "
                         "leave --devices out (the mesh says how many) or make them agree")
    if args.batch_size is not None and args.batch_size % size:
        raise UsageError(f"--batch-size {args.batch_size} does not split evenly over the {size} devices of "
                         f"--mesh {label}; use a multiple of {size}")
    if args.num_processes is not None and args.num_processes >= 1 and size % args.num_processes:
        raise UsageError(f"--mesh {label} spans {size} devices, which do not split evenly over "
                         f"--num-processes {args.num_processes}")


def _save_interval(args: argparse.Namespace) -> None:
    """Sets ``args.save_every``; ``--every K`` alone beside ``--save-dir`` keeps its old meaning, the save interval."""
    if args.checkpoint_every is not None and not args.checkpoint and args.save_dir:
        if args.save_every is not None:
            raise UsageError("--every K counts --checkpoint modules; the save interval is --save-every K")
        print(f"remat: note: --every {args.checkpoint_every} without --checkpoint is read as the save interval, "
              "as before; spell it --save-every", file=sys.stderr)
        args.save_every, args.checkpoint_every = args.checkpoint_every, None
    if args.save_every is None:
        args.save_every = 10
    if args.save_every < 1:
        raise UsageError(f"--save-every must be at least 1, got {args.save_every}")


def _validate_distributed(args: argparse.Namespace) -> None:
    given = [f for f in ("coordinator", "num_processes", "process_id") if getattr(args, f) is not None]
    if not given:
        return
    if len(given) < 3:
        raise UsageError("a multi-process run needs all of --coordinator HOST:PORT, --num-processes P and "
                         "--process-id I (the same first two on every process)")
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--coordinator {args.coordinator!r}: expected HOST:PORT, e.g. 10.0.0.1:1234")
    if args.num_processes < 1:
        raise UsageError(f"--num-processes must be at least 1, got {args.num_processes}")
    if not 0 <= args.process_id < args.num_processes:
        raise UsageError(f"--process-id {args.process_id}: must be in 0..{args.num_processes - 1}")
    if args.devices is not None and args.devices % args.num_processes:
        raise UsageError(f"--devices {args.devices} (the global count) does not split evenly over "
                         f"--num-processes {args.num_processes}; use a multiple of {args.num_processes}")


def run(args: argparse.Namespace) -> int:
    validate(args)
    apply_keep_freed_memory_flag(args)  # before JAX starts its threads
    from remat.cli import _train_loop

    return _train_loop.main(args)

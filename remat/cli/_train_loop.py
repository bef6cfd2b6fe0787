"""The training loop behind ``remat train``: sharded steps, saves, progress and the summary.

The task (model, data, loss) comes from :mod:`remat.models.tasks`, the devices from
:mod:`remat.cli._devices`, the mesh and where each array lives from :mod:`remat.cli._mesh`,
the saves from :mod:`remat.cli._checkpoints`. The mesh has axes ``data`` and ``fsdp``
(``--mesh data=D,fsdp=F``; ``--devices N`` alone is ``data=N,fsdp=1``). The batch is
split along its leading axis over both; parameters and optimizer state are sharded over
``fsdp`` (replicated when ``F`` is 1), non-parameter state such as BatchNorm statistics
is replicated, and ``jax.jit`` inserts the all-gathers and the gradient reductions. In a
multi-process run every process computes the same global batch from ``(seed, step)`` and
puts only its devices' rows; the jitted step is the same program everywhere and XLA's
collectives (gloo on CPU) do the reductions. Data order is a pure function of
``(seed, step)``, so a resumed run's losses are bitwise the uninterrupted run's on CPU.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

import numpy as np

from remat.cli import _mesh
from remat.cli._checkpoints import check_save_dir, open_saves
from remat.cli._common import EXIT_CHECK_FAILED, EXIT_OK, UsageError, build_task, print_json, print_table
from remat.cli._devices import device_peak_bytes, is_distributed, native_stdout_to_stderr, setup_devices

DEFAULT_LR = {"sgd": 0.1, "adam": 3e-3, "adamw": 3e-3}


def make_optimizer(name: str, lr: float) -> Any:
    import optax

    return {"sgd": optax.sgd, "adam": optax.adam, "adamw": optax.adamw}[name](lr)


def _progress(total: int, initial: int, desc: str, disable: bool) -> Any:
    if disable:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True,
                mininterval=0.2)


def write_plot(path: str, losses: list[float], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.plot(np.arange(1, len(losses) + 1), losses, lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if losses and all(math.isfinite(v) and v > 0 for v in losses):
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)


def planned(path: str | None, train_step: Any) -> Any:
    """``--plan FILE``: the saved plan applied to the training step (its regions checked at trace time)."""
    if path is None:
        return train_step
    from remat.planner import Plan
    from remat.planner.steering import PlanMismatch

    applied = Plan.load(path).apply(train_step)

    def step(*args: Any) -> Any:
        try:
            return applied(*args)
        except PlanMismatch as e:  # raised while the step is traced, before it runs
            raise UsageError(f"--plan {path}: {e}; plan this model with the same flags") from None

    return step


def sharded_training(model: Any, loss_of: Any, tx: Any, mesh: Any, plan: str | None = None) -> tuple[Any, Any, Any]:
    """The training state on ``mesh``, its shardings, and the jitted step that updates it.

    Args:
      model: the NNX model; its parameters and the optimizer state are sharded over
        ``fsdp`` (:func:`remat.cli._mesh.fsdp_shardings`), its other state replicated.
      loss_of: ``loss_of(outputs, inputs, targets)``, a scalar.
      tx: the optax optimizer.
      mesh: the ``data``/``fsdp`` mesh (:func:`remat.cli._mesh.make_mesh`).
      plan: a saved plan's path (:meth:`remat.Plan.save`), applied to the step; ``None``: as built.

    Returns:
      ``(state, shardings, step)``: ``state`` is ``(params, rest, opt_state)``, placed;
      ``step(state, inputs, targets)`` returns ``(new state, loss)``, donates ``state``
      and keeps every array where ``shardings`` puts it.

    Example:
      >>> state, shardings, step = sharded_training(model, task.loss, optax.adam(3e-3), mesh)  # doctest: +SKIP
      >>> state, loss = step(state, inputs, targets)  # doctest: +SKIP
    """
    import jax
    import optax
    from flax import nnx

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    param_shardings = _mesh.fsdp_shardings(params, mesh)
    params = jax.device_put(params, param_shardings)
    # jit(tx.init): one compilation, not one per parameter shape; the moments are sharded as the parameters
    opt_state = jax.jit(tx.init)(params)
    shardings = (param_shardings, _mesh.replicated_tree(rest, mesh), _mesh.fsdp_shardings(opt_state, mesh))
    state = jax.device_put((params, rest, opt_state), shardings)
    batch = _mesh.batch_sharding(mesh)

    def train_step(state: Any, inputs: tuple, targets: Any) -> tuple[Any, Any]:
        params, rest, opt_state = state
        model = nnx.merge(graphdef, params, rest)
        # nnx.value_and_grad, not jax's: it lets checkpointed NNX regions (nnx.remat under
        # remat.checkpoint) update BatchNorm statistics of a model merged inside this trace.
        loss, grads = nnx.value_and_grad(lambda m: loss_of(m(*inputs), inputs, targets))(model)
        _, _, new_rest = nnx.split(model, nnx.Param, ...)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), new_rest, opt_state), loss

    step = jax.jit(planned(plan, train_step), in_shardings=(shardings, batch, batch),
                   out_shardings=(shardings, _mesh.replicated(mesh)), donate_argnums=(0,))
    return state, shardings, step


def main(args: argparse.Namespace) -> int:
    """``remat train``; returns the exit code (see :mod:`remat.cli.train` for the options)."""
    if not is_distributed(args):
        return _main(args)
    with native_stdout_to_stderr():
        return _main(args)


def _check_outputs(args: argparse.Namespace) -> None:
    """``--plot`` and ``--save-dir`` can be written, checked before anything runs."""
    if args.plot:
        parent = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise UsageError(f"--plot {args.plot!r}: directory {parent!r} does not exist or is not writable")
    if args.save_dir:
        check_save_dir(args)



def _steps_per_s(ran: int, t_start: float, t_first: float | None, t_end: float, paused: float) -> float | None:
    """Steps per second of the steps run, without the first (compiling) one and the time spent saving."""
    if ran > 1 and t_first is not None:
        return (ran - 1) / max(t_end - t_first - paused, 1e-9)
    if ran == 1:
        return 1 / max(t_end - t_start, 1e-9)
    return None


def _main(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    _check_outputs(args)

    sizes = getattr(args, "mesh_sizes", None)  # --mesh, parsed by remat.cli.train.validate
    devices = setup_devices(args.devices if sizes is None else _mesh.mesh_size(sizes), args,
                            flag=None if sizes is None else f"--mesh {_mesh.mesh_label(sizes)}")
    n_dev = len(devices)
    sizes = sizes or {"data": n_dev, "fsdp": 1}

    import jax

    from remat.analysis.process import current_rss_bytes, process_peak_rss_bytes

    task = build_task(args, policy=args.policy, residual_budget=args.residual_budget)
    loss_of = _in_precision(args, task)
    mesh = _mesh.make_mesh(sizes, devices)
    _mesh.check_batch(task.batch_size, mesh)
    batch = _mesh.batch_sharding(mesh)

    lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]
    tx = make_optimizer(args.optimizer, lr)
    state, shardings, step_fn = sharded_training(task.model, loss_of, tx, mesh, getattr(args, "plan", None))
    n_params = int(sum(x.size for x in jax.tree.leaves(state[0])))
    identity = {**task.identity, "optimizer": args.optimizer, "lr": lr, "batch_size": task.batch_size,
                "seed": args.seed}
    if getattr(args, "precision", "float32") == "mixed":  # a float32 run's saves keep their identity
        identity["precision"] = "mixed"

    saver, losses, resumed_from = None, [], None
    if args.save_dir:
        saver, state, losses, resumed_from = open_saves(args, state, identity, shardings)

    n_proc = jax.process_count()

    start = len(losses)
    bar = _progress(args.steps, start, task.name, args.json)
    t_first = None
    paused = 0.0  # time spent saving, left out of steps/s
    nonfinite_at = None
    try:
        for step in range(start, args.steps):
            inputs, targets = task.batch(step)
            state, loss = step_fn(state, _mesh.put_global(inputs, batch), _mesh.put_global(targets, batch))
            value = float(loss)
            losses.append(value)
            if t_first is None:
                t_first = time.perf_counter()
            if nonfinite_at is None and not math.isfinite(value):
                nonfinite_at = step + 1
            if bar is not None:
                bar.set_postfix_str(f"loss={value:.4f} rss={current_rss_bytes() / 2**20:.0f}MiB", refresh=False)
                bar.update(1)
            if saver is not None and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
                t_save = time.perf_counter()
                saver.save_state(step + 1, state, args.seed, losses, identity)
                paused += time.perf_counter() - t_save
        t_end = time.perf_counter()
    finally:
        if bar is not None:
            bar.close()
        if saver is not None:
            saver.close()  # waits for the last (asynchronous) save to be complete on disk
    ran = len(losses) - start
    steps_per_s = _steps_per_s(ran, t_start, t_first, t_end, paused)

    if args.plot:
        write_plot(args.plot, losses, f"remat train {task.name} (policy {task.policy})")

    peak = process_peak_rss_bytes()  # the run's lifetime peak, compilation included
    dev_peak = device_peak_bytes(devices)
    result = {
        "model": task.name,
        "task": task.kind,
        "data": task.data,
        "config": identity,
        "policy": task.policy,
        "precision": getattr(args, "precision", "float32"),
        "optimizer": args.optimizer,
        "lr": lr,
        "batch_size": task.batch_size,
        "parameters": n_params,
        "devices": n_dev,
        "mesh": sizes,
        "state_bytes": sum(x.nbytes for x in jax.tree.leaves((state[0], state[2]))),
        "state_bytes_per_device": _mesh.bytes_per_device((state[0], state[2])),
        "platform": devices[0].platform,
        "processes": n_proc,
        "steps": args.steps,
        "resumed_from": resumed_from,
        "steps_run": ran,
        "losses": losses,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "steps_per_s": steps_per_s,
        "wall_s": time.perf_counter() - t_start,
        "peak_rss_mb": peak / 2**20,
        "device_peak_bytes": dev_peak,
        "save_dir": os.path.abspath(args.save_dir) if args.save_dir else None,
        "saved_steps": saver.steps() if saver is not None else [],
        "plot": os.path.abspath(args.plot) if args.plot else None,
    }
    return _report(result, args.json, nonfinite_at)


def _in_precision(args: argparse.Namespace, task: Any) -> Any:
    """The loss ``(out, inputs, targets) -> scalar`` to train; ``--precision mixed`` also casts ``task.model``."""
    if getattr(args, "precision", "float32") != "mixed":
        return task.loss
    from remat.crosscheck.autocast import float32_outputs, jax_model

    # float32 parameters and optimizer state, bfloat16 compute; the loss in float32, as under autocast
    task.model = jax_model(task.model, "mixed")
    return lambda out, inputs, targets: task.loss(float32_outputs(out), inputs, targets)


def _report(result: dict[str, Any], as_json: bool, nonfinite_at: int | None) -> int:
    """Prints the run's summary (or its JSON object); the exit code: 1 when the loss became non-finite."""
    if as_json:
        print_json(result)
    else:
        _print_summary(result)
    if nonfinite_at is not None:
        print(f"remat: the loss became non-finite at step {nonfinite_at}; lower --lr", file=sys.stderr)
        return EXIT_CHECK_FAILED
    return EXIT_OK


def _print_summary(result: dict[str, Any]) -> None:
    """The table ``remat train`` prints for people (``--json`` prints ``result`` instead)."""
    fmt = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
    n_proc, resumed_from = result["processes"], result["resumed_from"]
    rows = [
        ["model", f"{result['model']} ({result['parameters']:,} parameters)"],
        ["data", result["data"]],
        ["remat policy", result["policy"]],
        ["precision", result["precision"]],
        ["optimizer", f"{result['optimizer']}, lr {result['lr']:g}, batch {result['batch_size']}"],
        ["devices", f"{result['devices']} x {result['platform']}"
         + (f" over {n_proc} processes" if n_proc > 1 else "") + f", mesh {_mesh.mesh_label(result['mesh'])}"],
        ["params + optimizer", f"{result['state_bytes_per_device'] / 2**20:.2f} MiB per device "
                               f"of {result['state_bytes'] / 2**20:.2f} MiB"],
        ["steps", f"{result['steps']}" + (f" (resumed at {resumed_from})" if resumed_from is not None else "")],
        ["loss", f"{fmt(result['first_loss'])} -> {fmt(result['final_loss'])}"],
        ["steps/s", fmt(result["steps_per_s"])],
        ["peak RSS", f"{result['peak_rss_mb']:.0f} MiB"],
    ]
    if result["device_peak_bytes"] is not None:
        rows.append(["peak device memory", f"{result['device_peak_bytes'] / 2**20:.1f} MiB"])
    if result["save_dir"] is not None:
        rows.append(["saves", f"{result['save_dir']} (steps {', '.join(map(str, result['saved_steps']))})"])
    if result["plot"] is not None:
        rows.append(["loss curve", result["plot"]])
    print_table("remat train", ["", "value"], rows)

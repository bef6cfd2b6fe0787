"""``remat crosscheck``: gradients (and a short training run) of a Flax model against its PyTorch twin.

Builds a built-in reference model (``seed-model``, ``seed-mymodel``, ``mlp``,
``transformer``, ``cnn``; ``llama``, ``gpt2``, ``resnet``, whose twins are stock
HuggingFace ``transformers`` models: the ``[hf]`` extra) or a user factory ``path/to/file.py:factory`` returning
``(jax_model, torch_model, example_inputs)`` (optionally a 4th element: training
targets), loads the twin's weights into the JAX model, applies the remat policy in both
and compares outputs and gradients (:func:`remat.crosscheck.compare_gradients`); with
``--steps N`` also ``N`` optimizer steps (:func:`remat.crosscheck.compare_training`).

A factory that accepts a ``remat=`` keyword gets a :class:`models.RematSettings` and places
the checkpoints itself; any other factory's models are checkpointed as a whole.
``--dtype bfloat16`` and ``--precision mixed`` judge each tensor against a float64 reference
instead of a fixed tolerance (:mod:`remat.crosscheck.precision`).
Exit codes: 0 all within tolerance, 1 something out of tolerance, 2 bad usage.
"""
from __future__ import annotations

import argparse
from typing import Any

from remat._names import CROSSCHECK_OPTIMIZERS, POLICY_NAMES, is_no_checkpoint
from remat.cli._common import EXIT_CHECK_FAILED, EXIT_OK, UsageError, expect_report, print_json, print_table
from remat.cli._model_entry import model_entry

HELP = "compare gradients and training of a Flax model against its PyTorch twin"
EXAMPLE = "remat crosscheck transformer --policy dots --dtype float64 --steps 3"

POLICIES = (*POLICY_NAMES, "names")  # names: the model's tagged values
OPTIMIZERS = CROSSCHECK_OPTIMIZERS


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="a built-in model (seed-model, seed-mymodel, mlp, transformer, cnn; llama, gpt2, "
                             "resnet: HuggingFace twins) or path/to/file.py:factory")
    parser.add_argument("--config", default=None, metavar="NAME",
                        help="a built-in model's named config instead of its small default "
                             "(llama: smollm-135m, SmolLM-135M's shape)")
    parser.add_argument("--policy", default="nothing", choices=POLICIES,
                        help="remat policy in every block ('names': the model's tagged names; "
                             "'no_checkpoint': no checkpointing). Default: nothing (PyTorch's behaviour)")
    parser.add_argument("--blocks", default="all",
                        help="which blocks to checkpoint: 'all' or indices like 0,2 (built-in models)")
    parser.add_argument("--checkpoint", action="append", default=None, metavar="CLASSNAME",
                        help="instead of the model's own checkpoints: remat.apply_checkpointing on the Flax "
                             "modules of this class (repeatable) and torch's apply_activation_checkpointing "
                             "on the twin's modules at the same paths")
    parser.add_argument("--checkpoint-every", "--every", dest="checkpoint_every", type=int, default=1, metavar="K",
                        help="with --checkpoint: only every K-th matching module (default 1: all)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64", "bfloat16"),
                        help="float32/float64: a fixed tolerance; bfloat16: everything in bfloat16, judged against "
                             "a float64 reference (pass: err_jax <= 2 * max(err_torch, eps))")
    parser.add_argument("--precision", default=None, choices=("mixed", "bfloat16"),
                        help="mixed: bfloat16 compute on float32 parameters and optimizer state (torch.autocast "
                             "against Flax dtype=bf16, param_dtype=float32), judged as --dtype bfloat16")
    parser.add_argument("--steps", type=int, default=0, help="also train N steps and compare (default 0)")
    parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    parser.add_argument("--lr", type=float, default=1e-2, help="learning rate for --steps (default 0.01)")
    parser.add_argument("--mode", default="auto", choices=("auto", "train", "eval", "both"),
                        help="train/eval mode (auto: both when the model has BatchNorm or Dropout)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rtol", type=float, default=None, help="override the dtype's default rtol")
    parser.add_argument("--atol", type=float, default=None, help="override the dtype's default atol")
    parser.add_argument("--memory", action="store_true",
                        help="instead of gradients: saved-for-backward bytes per module of both twins, modules "
                             "that differ by more than 10%% named")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _blocks(text: str) -> Any:
    if text in ("all", "none"):
        return text
    try:
        return frozenset(int(i) for i in text.split(",") if i.strip())
    except ValueError:
        raise UsageError(f"--blocks {text!r}: use 'all', 'none' or comma-separated indices like 0,2") from None


def _load(args: argparse.Namespace, settings: Any) -> tuple[Any, Any, tuple, Any, Any, str]:
    """``(jax_model, torch_model, inputs, targets, whole_model_checkpoint, remat_label)``."""
    from remat.models import HF_MODELS, MODELS, call_factory, is_factory_spec, load_factory

    if not is_factory_spec(args.model):
        entry = MODELS.get(args.model) or HF_MODELS.get(args.model)
        if entry is None:
            raise UsageError(f"unknown model {args.model!r}; choose one of {', '.join([*MODELS, *HF_MODELS])} "
                             "or give path/to/file.py:factory")
        if args.model in HF_MODELS:
            from remat.models._hf import transformers_module

            try:
                transformers_module()
            except ImportError as e:
                raise UsageError(str(e)) from None
        try:
            config = entry.make_config(settings, named=args.config)
        except ValueError as e:
            raise UsageError(str(e)) from None
        jax_model, torch_model, inputs = entry.factory(config, args.seed)
        return jax_model, torch_model, inputs, entry.example_targets(config, args.seed), False, settings.label
    if args.config is not None:
        raise UsageError(f"--config {args.config}: only a built-in model has named configs, not {args.model}")
    try:
        factory = load_factory(args.model)
    except ValueError as e:
        raise UsageError(str(e)) from None
    result, passed = call_factory(factory, remat=settings)
    takes_remat = "remat" in passed
    if not isinstance(result, tuple) or len(result) not in (3, 4):
        raise UsageError(f"{args.model} must return (jax_model, torch_model, example_inputs[, targets]), "
                         f"got {type(result).__name__}")
    jax_model, torch_model, inputs = result[:3]
    targets = result[3] if len(result) == 4 else None
    if takes_remat:
        return jax_model, torch_model, inputs, targets, False, settings.label + " (placed by the factory)"
    if is_no_checkpoint(args.policy):
        return jax_model, torch_model, inputs, targets, False, "no checkpoint"
    policy = settings.jax_policy(tuple(getattr(jax_model, "checkpoint_names", ())))
    return (jax_model, torch_model, inputs, targets, True if policy is None else policy,
            f"whole model, policy={args.policy}")


def _tolerances(args: argparse.Namespace, training: bool = False) -> tuple[float | None, float | None]:
    """The built-in model's own ``(rtol, atol)`` for ``--dtype`` (HF's float32 islands), else None;
    ``--rtol``/``--atol`` override the gradient comparison's."""
    entry = model_entry(args)
    table = (entry.training_tolerances if training else entry.tolerances) if entry is not None else {}
    rtol, atol = table.get(args.dtype, (None, None))
    if training:
        return rtol, atol
    return (rtol if args.rtol is None else args.rtol), (atol if args.atol is None else args.atol)


def _apply_checkpointing(args: argparse.Namespace, jax_model: Any, torch_model: Any) -> str:
    """``--checkpoint``: both twins checkpointed from outside, the same modules; returns the label."""
    from flax import nnx

    from remat.models import MODELS
    from remat.models._twin import apply_checkpointing_pair

    if args.checkpoint_every < 1:
        raise UsageError(f"--checkpoint-every must be at least 1, got {args.checkpoint_every}")
    present = {type(m).__name__ for _, m in nnx.iter_graph(jax_model) if isinstance(m, nnx.Module)}
    missing = [c for c in args.checkpoint if c not in present]
    if missing:
        raise UsageError(f"--checkpoint {missing[0]}: the model has no module of that class; its classes are "
                         f"{', '.join(sorted(present))}")
    policy = args.policy
    if policy == "names":
        entry = MODELS.get(args.model)
        names = entry.checkpoint_names if entry else tuple(getattr(jax_model, "checkpoint_names", ()))
        policy = list(names) or None
    wanted = set(args.checkpoint)
    try:
        paths = apply_checkpointing_pair(jax_model, torch_model, lambda path, m: type(m).__name__ in wanted,
                                         every=args.checkpoint_every, policy=policy)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return (f"apply_checkpointing on {len(paths)} {'/'.join(args.checkpoint)} (torch: apply_activation_checkpointing)"
            f", policy={args.policy}")


def _rows(rows: list[Any]) -> list[list[Any]]:
    return [[r.mode, r.kind, r.name, "x".join(map(str, r.shape)) or "scalar", f"{r.max_abs:.2e}",
             f"{r.max_rel:.2e}", "ok" if r.ok else "FAIL"] for r in rows]


COLUMNS = ["mode", "kind", "name", "shape", "max abs err", "max rel err", "ok"]


def run(args: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UsageError("remat crosscheck needs PyTorch: pip install 'remat[torch]'") from None
    if args.steps < 0:
        raise UsageError(f"--steps {args.steps}: use 0 (no training) or a positive number of steps")
    if args.precision and args.dtype not in ("float32", args.precision):
        raise UsageError(f"--precision {args.precision} with --dtype {args.dtype}: give one of them")
    if (args.precision or args.dtype == "bfloat16") and (args.rtol is not None or args.atol is not None):
        raise UsageError("--rtol/--atol do not apply in bfloat16 or mixed precision: each tensor is judged against "
                         "PyTorch's own error (err_jax <= 2 * max(err_torch, eps))")
    from remat import crosscheck
    from remat.crosscheck.report import GradientReport, TrainingReport
    from remat.models import RematSettings

    if is_no_checkpoint(args.policy):
        settings = RematSettings.none()
    else:
        settings = RematSettings(_blocks(args.blocks), args.policy)
    if args.checkpoint:  # the model's own checkpoints give way to those applied from outside
        settings = RematSettings.none()
    jax_model, torch_model, inputs, targets, whole, label = _load(args, settings)
    if args.checkpoint and not is_no_checkpoint(args.policy):
        label, whole = _apply_checkpointing(args, jax_model, torch_model), False
    if args.memory:
        from remat.cli._crosscheck_memory import run_memory

        return run_memory(args, jax_model, torch_model, inputs, label)
    mode = None if args.mode == "auto" else (("train", "eval") if args.mode == "both" else args.mode)
    precision = args.precision or ("bfloat16" if args.dtype == "bfloat16" else None)
    if precision is not None:
        from remat.cli._crosscheck_precision import run_precision

        return run_precision(args, precision, jax_model, torch_model, inputs, targets, whole, label, mode)
    rtol, atol = _tolerances(args)
    grads = expect_report(crosscheck.compare_gradients(jax_model, torch_model, inputs, dtype=args.dtype, mode=mode,
                                                       checkpoint=whole, rtol=rtol, atol=atol), GradientReport)
    training = None
    if args.steps:
        train_mode = "eval" if args.mode == "eval" else "train"
        train_rtol, train_atol = _tolerances(args, training=True)
        training = expect_report(crosscheck.compare_training(
            jax_model, torch_model, inputs, targets, optimizer=args.optimizer, lr=args.lr, steps=args.steps,
            dtype=args.dtype, mode=train_mode, checkpoint=whole, rtol=train_rtol, atol=train_atol,
            exclude=getattr(model_entry(args), "training_exclude", None)), TrainingReport)
    ok = grads.ok and (training is None or training.ok)
    if args.json:
        print_json({"model": args.model, "policy": args.policy, "remat": label, "dtype": args.dtype, "ok": ok,
                    "gradients": grads.to_dict(), "training": training.to_dict() if training else None})
        return EXIT_OK if ok else EXIT_CHECK_FAILED
    verdict = "ok" if grads.ok else f"FAILED ({len(grads.failures)} out of tolerance)"
    print_table(f"{args.model}: gradients vs PyTorch, {label}, {args.dtype} "
                f"(pass: max abs err <= {grads.atol:g} + {grads.rtol:g} * max|torch|): {verdict}",
                COLUMNS, _rows(grads.rows))
    for note in grads.notes():
        print(note)
    if training is not None:
        verdict = "ok" if training.ok else f"FAILED ({len(training.failures)} out of tolerance)"
        print_table(f"{args.model}: {args.optimizer}, {args.steps} steps, {training.mode} mode, loss curves",
                    ["step", "jax loss", "torch loss"],
                    [[i, f"{a:.10g}", f"{b:.10g}"] for i, (a, b) in
                     enumerate(zip(training.jax_losses, training.torch_losses))])
        print_table(f"{args.model}: after training (pass: max abs err <= {training.atol:g} + "
                    f"{training.rtol:g} * max|torch|): {verdict}", COLUMNS, _rows(training.rows))
        for note in training.notes():
            print(note)
    print(f"{'PASS' if ok else 'FAIL'}: {args.model}, {label}, {args.dtype}")
    return EXIT_OK if ok else EXIT_CHECK_FAILED

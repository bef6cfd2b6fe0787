"""``remat crosscheck --dtype bfloat16`` / ``--precision mixed``: the low-precision check and its tables."""
from __future__ import annotations

import argparse
from typing import Any

from remat.cli._common import EXIT_CHECK_FAILED, EXIT_OK, expect_report, print_json, print_table
from remat.cli._model_entry import model_entry


def run_precision(args: argparse.Namespace, precision: str, jax_model: Any, torch_model: Any, inputs: Any,
                  targets: Any, whole: Any, label: str, mode: Any) -> int:
    """Gradients (and ``--steps`` of training) in ``precision``, each tensor against a float64 reference.

    Prints the per-tensor tables and the error distribution (or one JSON object with
    ``--json``: every row carries ``err_jax``, ``err_torch``, ``err_cross`` and ``ok``);
    returns 0 when every row passes ``err_jax <= 2 * max(err_torch, eps)``, else 1.
    """
    from remat import crosscheck
    from remat.crosscheck.precision import COLUMNS, PrecisionReport

    grads = expect_report(crosscheck.compare_gradients(jax_model, torch_model, inputs, precision=precision,
                                                       mode=mode, checkpoint=whole), PrecisionReport)
    training = None
    if args.steps:
        train_mode = "eval" if args.mode == "eval" else "train"
        training = expect_report(crosscheck.compare_training(
            jax_model, torch_model, inputs, targets, optimizer=args.optimizer, lr=args.lr, steps=args.steps,
            precision=precision, mode=train_mode, checkpoint=whole,
            exclude=getattr(model_entry(args), "training_exclude", None)), PrecisionReport)
    reports = [grads] + ([training] if training is not None else [])
    ok = all(r.ok for r in reports)
    if args.json:
        print_json({"model": args.model, "policy": args.policy, "remat": label, "dtype": precision,
                    "precision": precision, "ok": ok, "gradients": grads.to_dict(),
                    "training": training.to_dict() if training else None})
        return EXIT_OK if ok else EXIT_CHECK_FAILED
    for report in reports:
        if report.check == "training":
            print_table(f"{args.model}: loss curves ({precision}; float64 reference)", ["step", "jax", "torch",
                        "float64"], [[i, f"{a:.6g}", f"{b:.6g}", f"{c:.6g}"] for i, (a, b, c) in enumerate(
                            zip(report.losses["jax"], report.losses["torch"], report.losses["reference"]))])
        print_table(f"{args.model}: {label}, {report.title()}", COLUMNS, report.table_rows())
        for line in report.summary_lines():
            print(line)
        if report.excluded:
            print(f"excluded from the weight comparison: {', '.join(report.excluded)}")
    print(f"{'PASS' if ok else 'FAIL'}: {args.model}, {label}, {precision}")
    return EXIT_OK if ok else EXIT_CHECK_FAILED

"""``remat crosscheck MODEL --memory``: saved-for-backward bytes per module, JAX beside PyTorch."""
from __future__ import annotations

import argparse
from typing import Any

from remat.cli._common import EXIT_CHECK_FAILED, EXIT_OK, print_json, print_table


def run_memory(args: argparse.Namespace, jax_model: Any, torch_model: Any, inputs: Any, label: str) -> int:
    """Prints the per-module comparison; exit code 1 when a module's bytes differ by more than 10%."""
    from remat._core.residuals import format_bytes
    from remat.crosscheck.memory import compare_saved_bytes

    mode = "eval" if args.mode == "eval" else "train"
    report = compare_saved_bytes(jax_model, torch_model, inputs, mode=mode)
    if args.json:
        print_json({"model": args.model, "remat": label, "memory": report.to_dict(), "ok": not report.differing})
    else:
        rows = [[r.module, format_bytes(r.jax_bytes), format_bytes(r.torch_bytes),
                 "DIFFERS" if report.differs(r) else "ok"] for r in report.rows]
        rows.append(["total", format_bytes(report.jax_total), format_bytes(report.torch_total), ""])
        print_table(f"{args.model}: saved for backward per module, {label}, {mode} mode "
                    f"(JAX: read by its backward pass; PyTorch: saved_tensors_hooks)",
                    ["module", "jax", "torch", f"within {report.tolerance:.0%}"], rows)
        if report.differing:
            print(f"differ by more than {report.tolerance:.0%}: {', '.join(report.differing)}")
    return EXIT_CHECK_FAILED if report.differing else EXIT_OK

"""``remat demo``: the four seed examples end to end, JAX beside PyTorch."""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io

from remat.cli._common import EXIT_CHECK_FAILED, EXIT_OK, print_json, print_table

HELP = "run the seed examples in JAX and PyTorch and compare their results"
EXAMPLE = "remat demo --json"

EXAMPLES = (
    "remat.examples.seed1_model",
    "remat.examples.seed1_my_computation",
    "remat.examples.seed1_forward",
    "remat.examples.seed2_training_loop",
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    results = []
    for name in EXAMPLES:
        with contextlib.redirect_stdout(io.StringIO()):  # the scripts' own prints are for script use
            results.append(importlib.import_module(name).run())
    has_torch = all(r["torch"] is not None for r in results)
    ok = all(r["ok"] for r in results)
    if args.json:
        print_json({"ok": ok, "torch": has_torch, "examples": results})
    else:
        rows = [
            [r["example"], r["jax"], r["torch"] or "-",
             "-" if r["max_diff"] is None else f"{r['max_diff']:.2e}", "pass" if r["ok"] else "FAIL"]
            for r in results
        ]
        print_table("remat demo: the seed examples, JAX beside PyTorch",
                    ["example", "JAX result", "PyTorch result", "largest difference", "pass/fail"], rows)
        if not has_torch:
            print("PyTorch is not installed, so only the JAX side ran; to compare: pip install 'remat[torch]'")
    return EXIT_OK if ok else EXIT_CHECK_FAILED

"""Reproduces one case in this process: ``python -m tests.fuzz.run '<json spec>'``.

Exit status 0 if checkpointing changed nothing; the traceback otherwise.
"""
from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    spec = json.loads(argv[0])
    if spec["dtype"] == "float64":
        os.environ["JAX_ENABLE_X64"] = "1"  # before JAX is imported, as the worker does
    from .cases import run_case

    run_case(spec)
    print("ok: checkpointing changed nothing")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

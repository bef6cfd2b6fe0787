"""The child process that runs cases: one JSON spec per line in, one JSON result per line out.

Started by :mod:`tests.fuzz.pool` (``python -m tests.fuzz.worker``) with ``JAX_ENABLE_X64``
set for float64 cases, so the pytest process never changes a JAX setting.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback


def main() -> None:
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr  # anything a case prints stays off the protocol channel
    from .cases import InvalidSpec, run_case

    for line in sys.stdin:
        spec = json.loads(line)
        start = time.perf_counter()
        try:
            run_case(spec)
            result = {"ok": True}
        except InvalidSpec as e:
            result = {"ok": False, "kind": "invalid spec", "error": str(e)[-2000:]}
        except Exception as e:  # an AssertionError is a wrong number; anything else, an error remat raised
            kind = "mismatch" if isinstance(e, AssertionError) else "error"
            result = {"ok": False, "kind": kind, "error": "".join(traceback.format_exception(e))[-4000:]}
        result["seconds"] = round(time.perf_counter() - start, 3)
        protocol.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()

"""Runs specs in long-lived child workers (float32 ones and float64 ones, in parallel).

A worker that dies (an abort) or hangs (``timeout_s``) is replaced, and its spec is reported
as failed with the command that reproduces it; the pytest process itself runs no case.
"""
from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root: tests.fuzz.worker imports from there

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def reproducer(spec: dict) -> str:
    """The one-line command that runs ``spec`` alone."""
    env = "JAX_REMAT3=1 " if os.environ.get("JAX_REMAT3") else ""
    env += f'XLA_FLAGS="{FAST_COMPILE}" '
    return f"{env}python -m tests.fuzz.run '{json.dumps(spec, separators=(',', ':'))}'"


class Worker:
    """One child process; :meth:`run` sends a spec and waits at most ``timeout_s`` for its result."""

    def __init__(self, x64: bool, timeout_s: float):
        self.x64, self.timeout_s, self.proc = x64, timeout_s, None

    def _start(self) -> None:
        # XLA's backend optimisations off: compiles dominate a case, and both runs share the flags
        xla_flags = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()
        env = {**os.environ, "JAX_ENABLE_X64": "1" if self.x64 else "0", "XLA_FLAGS": xla_flags,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.fuzz.worker"], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, bufsize=1)

    def _stderr_tail(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")[-3000:]

    def run(self, spec: dict) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        proc = self.proc
        try:
            proc.stdin.write(json.dumps(spec) + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            pass
        ready, _, _ = select.select([proc.stdout], [], [], self.timeout_s)
        line = proc.stdout.readline() if ready else ""
        if line:
            return json.loads(line)
        if ready:  # end of file: the worker died
            proc.wait()
            result = {"ok": False, "kind": f"worker died (status {proc.returncode})", "error": self._stderr_tail()}
        else:
            proc.kill()
            proc.wait()
            result = {"ok": False, "kind": f"hung (no result in {self.timeout_s:.0f} s)", "error": self._stderr_tail()}
        self.proc = None
        return result

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        self.proc = None


class Pool:
    """Child workers for float32 and for float64 cases, ``per_dtype`` of each, all at once.

    Each worker takes the next spec of its dtype when it is free, so one slow case does not
    hold up the others (float64 cases and heavy transforms are not spread evenly).
    """

    def __init__(self, timeout_s: float = 120.0, per_dtype: int = 2):
        self.workers = [Worker(x64, timeout_s) for x64 in (False, True) for _ in range(per_dtype)]

    def run(self, specs: list[dict]) -> list[tuple[dict, dict]]:
        """``(spec, result)`` for every spec, in the order given."""
        results: list = [None] * len(specs)
        queues = {x64: queue.SimpleQueue() for x64 in (False, True)}
        for i, spec in enumerate(specs):
            queues[spec["dtype"] == "float64"].put(i)
        log = os.environ.get("REMAT_FUZZ_LOG")  # a file to append one line per case to (timings)
        lock = threading.Lock()

        def drive(worker: Worker) -> None:
            while True:
                try:
                    i = queues[worker.x64].get_nowait()
                except queue.Empty:
                    return
                results[i] = (specs[i], worker.run(specs[i]))
                if log:
                    with lock, open(log, "a") as f:
                        f.write(json.dumps({"result": results[i][1], "spec": specs[i]}) + "\n")

        threads = [threading.Thread(target=drive, args=(w,)) for w in self.workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    def close(self) -> None:
        for w in self.workers:  # every worker told to end first, so that they shut down side by side
            if w.proc is not None and w.proc.poll() is None:
                w.proc.stdin.close()
        for w in self.workers:
            w.close()


def failure_report(results: list[tuple[dict, dict]]) -> str:
    """One paragraph per failed spec: what happened, the reproducer, the error's tail."""
    parts = []
    for spec, result in results:
        if not result["ok"]:
            parts.append(f"{result['kind']}: {reproducer(spec)}\n{result['error']}")
    return "\n\n".join(parts)

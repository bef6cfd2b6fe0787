"""The one place a benchmark writes its result file, with the provenance the docs show.

Every benchmark command ends in :func:`write_result`, which writes
``docs/results/<name>.md``: the command that produced it, the commit when it started (``+dirty`` when
the work tree had uncommitted changes), the date, the machine (CPU model, cores, memory, load,
jax and jaxlib versions), then the benchmark's own Markdown. The docs pages include these
files (``--8<--``) rather than retyping their figures, so a rerun updates the docs.
``--results DIR`` (:func:`add_results_argument`) sends the file elsewhere; ``--results ''``
writes none. GitHub shows the README without includes, so the README copies a result's
body (its tables, without the provenance) between ``<!-- result: docs/results/<name>.md -->``
and ``<!-- end result -->``: :func:`write_result` updates that copy, and
``tests/test_readme.py`` checks that it matches the file (``python -m benchmarks.results``
copies them all again).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "docs" / "results"
README = REPO / "README.md"
README_COPY = re.compile(r"(<!-- result: (?P<path>[^ ]+) -->\n)(?P<body>.*?)(<!-- end result -->)", re.S)


def add_results_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", default=str(RESULTS_DIR), metavar="DIR",
                        help="where the result file goes (default: docs/results; '' writes none)")


def commit() -> str:
    """``git rev-parse --short HEAD``, with ``+dirty`` when tracked files have changed."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + ("+dirty" if dirty else "")


# taken when the benchmark starts, so edits made while it runs do not mark its code dirty
COMMIT_AT_START = commit()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> str:
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        return f"{kib / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        return "unknown"


def machine() -> str:
    """CPU model, cores, memory, load average, and the jax/jaxlib versions measured."""
    import jax
    import jaxlib

    try:
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        load = "unknown"
    return (f"{_cpu_model()}, {os.cpu_count()} cores, {_memory_gib()}, load average {load} at the end; "
            f"Python {platform.python_version()}, jax {jax.__version__}, jaxlib {jaxlib.__version__}")


def provenance(argv: list[str] | None = None, module: str | None = None) -> str:
    """The Markdown lines that say how a result was made."""
    args = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m", module or "benchmarks", *map(shlex.quote, args)])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return (f"Command: `{command}`  \nCommit: `{COMMIT_AT_START}`  \nDate: {date}  \nMachine: {machine()}\n")


def write_result(results_dir: str, name: str, body: str, argv: list[str] | None = None,
                 module: str | None = None) -> Path | None:
    """Writes ``<results_dir>/<name>.md``: the provenance, then ``body`` (Markdown); None when
    ``results_dir`` is empty."""
    if not results_dir:
        return None
    path = Path(results_dir) / f"{name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(provenance(argv, module) + "\n" + body.rstrip("\n") + "\n")
    if README.exists():
        README.write_text(readme_with_results(README.read_text()))
    return path


def body(result_file: Path) -> str:
    """A result file's Markdown without its provenance (the lines before the first blank line)."""
    return result_file.read_text().split("\n\n", 1)[1]


def readme_with_results(readme: str) -> str:
    """``readme`` with each result copy replaced by the body of the file it names."""
    def copy(found: re.Match) -> str:
        result_file = REPO / found.group("path")
        text = body(result_file) if result_file.exists() else found.group("body")
        return found.group(1) + text + found.group(4)

    return README_COPY.sub(copy, readme)


def main() -> int:
    README.write_text(readme_with_results(README.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

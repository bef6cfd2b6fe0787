"""No measured figure in a comment or docstring of ``remat/`` or ``models/``.

A measurement in the code goes stale the day the code or the machine changes; it belongs
in a benchmark's result file and the docs page that includes it (``docs/results/``). This
test reads every comment (``tokenize``) and every docstring (``ast``: the first statement
of a module, class or function; string literals used as code are not read) and looks for
a number followed by a unit: ``ms``, ``s``, ``MiB``, ``GiB``, ``KiB``, ``MB``, ``GB``,
``%``, ``x`` or ``×``. A real constant that reads like one (a threshold, a default, a
size in an example) is listed in :data:`ALLOWED` with the reason it is not a measurement.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("remat", "models")
_NUMBER = r"\d+(?:[.,]\d+)?(?:\s*[-–]\s*\d+(?:\.\d+)?)?"
FIGURE = re.compile(rf"(?<![\w.]){_NUMBER}\s*(?:ms|s|MiB|GiB|KiB|MB|GB)\b|(?<![\w.]){_NUMBER}\s*%"
                    rf"|(?<![\w.]){_NUMBER}\s?[x×](?![\w*])")

#: (file, matched text): why it is a constant, not a measurement.
ALLOWED: dict[tuple[str, str], str] = {
    ("remat/planner/_footprint.py", "2.0 GiB"): "Footprint.dominant's output format, an example",
    **{(path, spelling): "memory_limit='s accepted spellings, examples of the syntax"
       for path, spellings in (("remat/planner/_planner.py", ("6GiB", "512MiB", "8GB")),
                               ("remat/planner/_units.py", ("6GiB", "512MiB", "8GB", "1.5GiB")))
       for spelling in spellings},
    ("models/gpt2.py", "4x"): "GPT-2's MLP is 4 times the model's width: the architecture",
    ("models/transformer.py", "4x"): "the reference transformer's MLP is 4 times its width: the architecture",
    ("remat/_core/residuals.py", "1.5 KiB"): "format_bytes's example: what it returns for 1536",
    ("remat/analysis/allocator.py", "32 MiB"): "glibc's largest mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)",
    ("remat/analysis/allocator.py", "64 MiB"): "glibc's size of a thread arena's heap (HEAP_MAX_SIZE, 64-bit)",
    ("remat/analysis/allocator.py", "4 KiB"): "the page size that each fault maps",
    ("remat/analysis/allocator.py", "128 KiB"): "glibc's default mmap threshold, which 'measure' sets",
    ("remat/analysis/process.py", "0.5 ms"): "the sampler's interval, time.sleep(0.0005) in the code",
    ("remat/cli/_crosscheck_memory.py", "10%"): "the command's tolerance for a module's bytes (its default)",
    ("remat/crosscheck/memory.py", "1%"): "the share of the larger total under which a difference is not named",
    ("remat/planner/_planner.py", "1%"): "budget 0's slack over the least peak and temp bytes (LEAN_SLACK, 1.01)",
    ("remat/planner/_planner.py", "3%"): "remat.planner.programs.CLOSE, the re-timing band",
}


def _comments(source: str) -> list[tuple[int, str]]:
    return [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type == tokenize.COMMENT]


def _docstrings(source: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                found.append((first.lineno, first.value.value))
    # the "#:" convention documents a module constant in the comment above it: tokenize reads those
    return found


def figures(path: Path) -> list[tuple[int, str]]:
    """(line, matched text) of each figure with a unit in ``path``'s comments and docstrings."""
    source = path.read_text()
    hits = []
    for line, text in [*_comments(source), *_docstrings(source)]:
        for found in FIGURE.finditer(text):
            hits.append((line + text[:found.start()].count("\n"), found.group().strip()))
    return hits


def _files() -> list[Path]:
    return sorted(p for folder in SCANNED for p in (ROOT / folder).rglob("*.py"))


def test_no_measured_figure_in_comments_or_docstrings():
    used, problems = set(), []
    for path in _files():
        name = str(path.relative_to(ROOT))
        for line, text in figures(path):
            if (name, text) in ALLOWED:
                used.add((name, text))
            else:
                problems.append(f"{name}:{line}: {text!r}")
    assert not problems, ("a measured figure in a comment or docstring goes stale: move it to a result file "
                          "and the docs (or, for a real constant, to ALLOWED with the reason):\n"
                          + "\n".join(problems))
    assert not set(ALLOWED) - used, f"ALLOWED entries that no longer match: {sorted(set(ALLOWED) - used)}"


@pytest.mark.parametrize(("text", "found"), [
    ("# 1.9x more", ["1.9x"]), ("# 357 MiB", ["357 MiB"]), ("# 10-20 s a model", ["10-20 s"]),
    ("# 27-40% of entries", ["27-40%"]), ("# 3.5×", ["3.5×"]), ("# took 500–600 ms", ["500–600 ms"]),
    ("# 2**20 bytes, x2 = y, shape (8, 16), float32, 3 steps", []),
])
def test_the_pattern_sees_figures_and_nothing_else(text, found):
    assert [m.group().strip() for m in FIGURE.finditer(text)] == found


def test_comments_and_docstrings_are_read_but_not_strings_used_as_code(tmp_path):
    path = tmp_path / "module.py"
    path.write_text('"""Takes 2 s."""\nLABEL = "5 ms"  # 3 MiB\n\n\ndef f():\n    """4%."""\n    return "6x"\n')
    assert figures(path) == [(2, "3 MiB"), (1, "2 s"), (6, "4%")]

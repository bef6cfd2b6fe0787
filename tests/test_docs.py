"""Every Python example in the README and the docs runs, so that none can drift from the code.

What a fence's language says (``tests/test_docs.py`` checks that every fence says one):

* ```` ```python ````: runs. A page's blocks run in order in one namespace (a later block
  uses what an earlier one defined), in a temporary directory.
* ```` ```py ````: Python that cannot run as a test (two programs side by side, a GPU),
  right below a ``<!-- skip: the reason -->`` line.
* ``<!-- slow: the reason -->`` right above a ```` ```python ```` block: that block and the
  rest of its page run only with ``-m slow`` (the blocks above it run in the default suite).
* any other language (``text``, ``bash``, ...) is not Python and does not run.

A page whose examples import PyTorch or ``transformers`` is skipped, saying so, where they
are not installed (the ``torch`` and ``hf`` extras).
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LANGUAGES = {"python", "py", "text", "bash", "console", "toml", "yaml"}
OPTIONAL = {"torch", "transformers"}  # the extras an example may need
_NOTE = re.compile(r"<!--\s*(skip|slow):\s*(.*?)\s*-->")


@dataclasses.dataclass(frozen=True)
class Fence:
    language: str
    line: int  # of the first line of code, 1-based
    code: str
    note: str | None  # "skip" or "slow", from the comment right above the fence
    reason: str


def fences(path: Path) -> list[Fence]:
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = re.match(r"^(`{3,})\s*(\S*)", lines[i])
        if not opening:
            i += 1
            continue
        ticks, language = opening.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(ticks)), None)
        assert end is not None, f"{path.name}:{i + 1}: a fence that never closes"
        above = lines[i - 1] if i else ""
        note = _NOTE.search(above)
        found.append(Fence(language, i + 2, "\n".join(lines[i + 1:end]) + "\n",
                           note and note.group(1), note.group(2) if note else ""))
        i = end + 1
    return found


def _page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_fence_says_what_it_is(page):
    for fence in fences(page):
        where = f"{_page_id(page)}:{fence.line - 1}"
        assert fence.language in LANGUAGES, f"{where}: fence language {fence.language!r}, not one of {LANGUAGES}"
        if fence.language == "py" or fence.note == "skip":
            assert fence.language == "py" and fence.reason, f"{where}: ```py below <!-- skip: reason -->"
        if fence.note == "slow":
            assert fence.language == "python" and fence.reason, f"{where}: <!-- slow: reason --> above ```python"


def _run(page: Path, *, slow: bool, tmp_path, monkeypatch) -> int:
    """Runs the page's Python blocks in order in one namespace; returns how many ran."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__main__"}
    ran = 0
    for fence in fences(page):
        if fence.language != "python":
            continue
        if fence.note == "slow" and not slow:
            break  # the rest of the page may use what this block defines
        code = "\n" * (fence.line - 1) + fence.code  # tracebacks name the page's own lines
        try:
            exec(compile(code, str(page), "exec"), namespace)
        except ModuleNotFoundError as error:
            if error.name in OPTIONAL:
                pytest.skip(f"{_page_id(page)}:{fence.line}: needs {error.name} (an optional extra)")
            raise
        ran += 1
    return ran


def _has_slow_block(page: Path) -> bool:
    return any(f.note == "slow" for f in fences(page))


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_examples_run(page, tmp_path, monkeypatch):
    _run(page, slow=False, tmp_path=tmp_path, monkeypatch=monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if _has_slow_block(p)], ids=_page_id)
def test_slow_examples_run(page, tmp_path, monkeypatch):
    assert _run(page, slow=True, tmp_path=tmp_path, monkeypatch=monkeypatch)


def test_the_conventions_are_seen(tmp_path):
    """The parser finds what this file's docstring promises, on a page made for the purpose."""
    page = "\n".join([
        "<!-- skip: two columns -->", "```py", "a | b", "```",
        "```python", "x = 1", "```",
        "<!-- slow: compiles a lot -->", "```python", "y = x + 1", "```",
        "```text", "remat demo", "```",
    ])
    path = tmp_path / "page.md"
    path.write_text(page)
    assert [(f.language, f.line, f.note, f.reason) for f in fences(path)] == [
        ("py", 3, "skip", "two columns"), ("python", 6, None, ""),
        ("python", 10, "slow", "compiles a lot"), ("text", 13, None, ""),
    ]

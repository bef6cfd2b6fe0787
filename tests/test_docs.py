"""Every Python example in the README and the docs runs, so that none can drift from the code.

What a fence's language says (``tests/test_docs.py`` checks that every fence says one):

* ```` ```python ````: runs. A page's blocks run in order in one namespace (a later block
  uses what an earlier one defined), in a temporary directory.
* ```` ```py ````: Python that cannot run as a test (two programs side by side, a GPU),
  right below a ``<!-- skip: the reason -->`` line.
* ``<!-- slow: the reason -->`` right above a ```` ```python ```` block: that block and the
  rest of its page run only with ``-m slow`` (the blocks above it run in the default suite).
* any other language (``text``, ``bash``, ...) is not Python and does not run.
* ``expression  # -> value`` in a block that runs: the run asserts ``expression == value``,
  so a result shown in a comment is the one the code returns. A trailing comment that
  reads like a result (a literal, ``==``) must use that form.

The pages themselves state what is: no commit hash or clock time outside the result files
(``docs/results/``) and the changelog, and ``docs/api/index.md`` lists every public name
(``python docs/gen_api.py`` regenerates it).

A page whose examples import PyTorch or ``transformers`` is skipped, saying so, where they
are not installed (the ``torch`` and ``hf`` extras).
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import io
import re
import subprocess
import tokenize
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
        code = "\n" * (fence.line - 1) + with_result_checks(fence.code, f"{_page_id(page)}:{fence.line}")
        try:
            exec(compile(code, str(page), "exec"), namespace)
        except ModuleNotFoundError as error:
            if error.name in OPTIONAL:
                pytest.skip(f"{_page_id(page)}:{fence.line}: needs {error.name} (an optional extra)")
            raise
        ran += 1
    return ran


_RESULT = re.compile(r"^(?P<indent>\s*)(?P<expression>\S.*?)\s*#\s*->\s*(?P<value>.+?)\s*$")
# a trailing comment that shows a value: a literal or a comparison, not words
_LOOKS_LIKE_A_RESULT = re.compile(r"#\s*([\[({'\"0-9-]|True\b|False\b|None\b|==)")


def with_result_checks(code: str, where: str) -> str:
    """``code`` with each ``expression  # -> value`` line an assertion, on the same line
    (tracebacks keep the page's line numbers)."""
    lines = code.split("\n")
    for i, line in enumerate(lines):
        found = _RESULT.match(line)
        if not found:
            continue
        expression, value = found.group("expression"), found.group("value")
        ast.parse(expression, mode="eval")  # a SyntaxError here: '# ->' follows something not an expression
        message = f"{where.rsplit(':', 1)[0]}:{int(where.rsplit(':', 1)[1]) + i}: {expression} is not {value}: "
        lines[i] = (f"{found.group('indent')}assert ({expression}) == ({value}), "
                    f"{message!r} + repr({expression})")
    return "\n".join(lines)


def _trailing_comments(code: str) -> list[tuple[int, str]]:
    """(line, comment) of each comment that follows code on its line."""
    found = []
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(code).readline))
    except (tokenize.TokenError, SyntaxError):
        return found
    for previous, token in zip(tokens, tokens[1:]):
        if token.type == tokenize.COMMENT and previous.end[0] == token.start[0] and previous.type not in (
                tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            found.append((token.start[0], token.string))
    return found


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_result_comments_are_checked(page):
    for fence in fences(page):
        if fence.language != "python":
            continue
        for line, comment in _trailing_comments(fence.code):
            if _LOOKS_LIKE_A_RESULT.match(comment) and not comment.lstrip("# ").startswith("->"):
                raise AssertionError(f"{_page_id(page)}:{fence.line + line - 1}: {comment!r} shows a result; "
                                     "write it '# -> value' so that the run asserts it")


def test_result_comments_become_assertions():
    code = "x = [1, 2]\nlen(x)  # -> 2\nx  # -> [1, 3]\n"
    checked = with_result_checks(code, "page.md:5")
    namespace: dict = {}
    with pytest.raises(AssertionError, match=r"page.md:7: x is not \[1, 3\]: \[1, 2\]"):
        exec(checked, namespace)
    assert checked.count("\n") == code.count("\n") and namespace["x"] == [1, 2]


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


# Pages that hold provenance by design: the result files a benchmark writes, and the changelog
# (docs/changelog.md only includes CHANGELOG.md).
_HISTORY = {"CHANGELOG.md", "docs/changelog.md"}
_STATED_PAGES = [p for p in [*PAGES, ROOT / "CHANGELOG.md"]
                 if _page_id(p) not in _HISTORY and not _page_id(p).startswith("docs/results/")]
_CLOCK = re.compile(r"(?<![\d:.])(?:[01]?\d|2[0-3]):[0-5]\d(?![\d:])")
_HEX = re.compile(r"(?<![\w/#.-])[0-9a-f]{7,40}(?![\w/-])")


@functools.cache  # one git run for all the pages (each run is a process start)
def _known_commits() -> frozenset[str]:
    try:
        out = subprocess.run(["git", "rev-list", "--all"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return frozenset()
    return frozenset(out.split())


def _looks_like_a_commit(word: str, commits: frozenset[str] | set[str]) -> bool:
    """A hex word of 7 to 40 digits that is a commit of this repository, or that mixes
    letters and digits as abbreviated hashes do (a plain number or word is neither)."""
    if any(c.startswith(word) for c in commits):
        return True
    return any(c.isdigit() for c in word) and any(c.isalpha() for c in word)


@pytest.mark.parametrize("page", _STATED_PAGES, ids=_page_id)
def test_pages_state_what_is_without_commits_or_clock_times(page):
    commits = _known_commits()
    problems = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        problems += [f"{_page_id(page)}:{number}: commit-like {m.group()!r}"
                     for m in _HEX.finditer(line) if _looks_like_a_commit(m.group(), commits)]
        problems += [f"{_page_id(page)}:{number}: clock time {m.group()!r}" for m in _CLOCK.finditer(line)]
    assert not problems, ("history goes to CHANGELOG.md and measured runs to docs/results/:\n"
                          + "\n".join(problems))


def test_the_history_checks_see_what_they_look_for():
    commits = {"03d9ac2aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"}
    words = [m.group() for m in _HEX.finditer("at commit 03d9ac2, bf9dccf and 1234567; deadbeef; #ffaa00")]
    assert words == ["03d9ac2", "bf9dccf", "1234567", "deadbeef"]
    assert [w for w in words if _looks_like_a_commit(w, commits)] == ["03d9ac2", "bf9dccf"]
    assert [m.group() for m in _CLOCK.finditer("10:56–11:04, ratio 1:2, 2026-12-04, 1:30:00, 0.25:1")] == [
        "10:56", "11:04"]


def test_the_api_page_lists_every_public_name_once():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    assert spec and spec.loader
    gen_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_api)
    expected = [f"{module}.{name}" for module, names in gen_api.public_names().items() for name in names]
    listed = re.findall(r"^\| `([\w.]+)` \|", gen_api.PAGE.read_text(), re.M)
    stale = "docs/api/index.md is out of date: run python docs/gen_api.py"
    assert len(set(expected)) == len(expected)
    assert sorted(listed) == sorted(expected), stale


def test_the_planner_page_states_the_algorithm_not_its_history():
    # the algorithm, its constants and the included results fit in 350 lines; run history
    # goes to CHANGELOG.md
    assert len((ROOT / "docs" / "planner.md").read_text().splitlines()) <= 350

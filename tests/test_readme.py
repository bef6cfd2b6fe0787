"""The README's two set-up commands are the ones CI runs and they name real files."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setup_commands():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_readme_opens_with_exactly_two_setup_commands():
    commands = _setup_commands()
    assert len(commands) == 2
    assert commands[0].endswith("remat demo")
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _setup_commands()[1] in ci


def test_torch_is_pinned_only_by_the_constraints_file():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'torch = \["torch>=2\.\d+"\]', pyproject), "the extra must not pin a release"
    assert "torch==2.13.0" in (ROOT / "constraints" / "cpu.txt").read_text()
    assert "-c constraints/cpu.txt" in _setup_commands()[1]


def test_readme_is_the_front_page():
    """Under about 200 lines, linking every page of docs/; the rest lives in those pages."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, "the README grew: move the new section into a page of docs/"
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)", readme))
    # docs/results/ holds the benchmarks' result files, which the pages include; docs/changelog.md
    # includes CHANGELOG.md, which the README links itself
    pages = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")
             if p.name != "index.md" and p.parent.name != "results" and p.name != "changelog.md"}
    assert "](CHANGELOG.md)" in readme
    assert pages - linked == set(), "pages the README does not link"
    assert all((ROOT / path).exists() for path in linked), "README links to pages that do not exist"


def test_the_site_opens_with_the_readme():
    """docs/index.md includes the README's opening sections, so the two never differ."""
    readme = (ROOT / "README.md").read_text()
    index = (ROOT / "docs" / "index.md").read_text()
    assert '--8<-- "README.md:front"' in index
    front = readme.split("--8<-- [start:front]", 1)[1].split("--8<-- [end:front]", 1)[0]
    assert _setup_commands()[1] in front and "## In one picture" in front


def test_the_readme_copies_its_results_from_the_result_files():
    from benchmarks.results import README_COPY, readme_with_results

    text = (ROOT / "README.md").read_text()
    copies = [m.group("path") for m in README_COPY.finditer(text)]
    assert copies and all((ROOT / path).exists() for path in copies), copies
    assert text == readme_with_results(text), (
        "the README's result copies differ from docs/results/: run python -m benchmarks.results")

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

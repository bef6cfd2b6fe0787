"""JAX's internals are read in one module, remat/_jax.py, and the versions it names are the ones remat promises.

``remat._jax.TESTED`` names the oldest and newest jax/flax the suites passed with; the
floor in ``pyproject.toml``, the pins of ``constraints/oldest.txt`` (CI's second
environment) and the README's sentence must say the same.
"""
from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

from remat._jax import TESTED

ROOT = Path(__file__).resolve().parents[1]
INTERNAL = ("jax._src", "jax.interpreters", "jax.extend")


def _internal_uses(path: Path) -> list[str]:
    """Imports, attribute chains (``jax._src.x``) and strings (``sys.modules["jax._src.x"]``) that reach an internal."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith(INTERNAL)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found += [n for n in names if n.startswith(INTERNAL)][:1]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "jax"
              and f"jax.{node.attr}" in INTERNAL):
            found.append(f"jax.{node.attr} (line {node.lineno})")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(INTERNAL):
            found.append(f"{node.value!r} (line {node.lineno})")
    return found


def test_only_remat_jax_reads_jax_internals():
    offenders = {}
    for folder in ("remat", "models", "examples", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == ROOT / "remat" / "_jax.py":
                continue
            uses = _internal_uses(path)
            if uses:
                offenders[str(path.relative_to(ROOT))] = uses
    assert not offenders, offenders
    assert _internal_uses(ROOT / "remat" / "_jax.py")  # the check sees what it looks for


def test_importing_remat_jax_imports_no_jax():
    code = "import sys, remat._jax; print(sorted(m for m in ('jax', 'flax') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def _pins(text: str, operator: str) -> dict[str, str]:
    return dict(re.findall(rf'^\s*"?([a-z]+){re.escape(operator)}([0-9.]+)', text, re.M))


def test_the_floor_is_the_oldest_tested_release():
    floor = _pins((ROOT / "pyproject.toml").read_text(), ">=")
    oldest = _pins((ROOT / "constraints" / "oldest.txt").read_text(), "==")
    for package, (low, _) in TESTED.items():
        assert floor[package] == low, (package, floor[package], low)
        assert oldest[package] == low, (package, oldest[package], low)


def test_the_readme_states_the_tested_range():
    readme = (ROOT / "README.md").read_text()
    for package in ("jax", "flax"):
        low, high = TESTED[package]
        assert f"{package} {low} to {high}" in readme, package


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def test_the_installed_releases_are_in_the_tested_range():
    """A new jax or flax fails here until the suites pass with it and TESTED names it."""
    for package, (low, high) in TESTED.items():
        installed = importlib.metadata.version(package)
        assert _release(low) <= _release(installed) <= _release(high), (
            f"{package} {installed} is outside remat's tested range {low} to {high}: run the fast "
            f"and slow suites with it, then widen remat/_jax.py's TESTED (and the README)")

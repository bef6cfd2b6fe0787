"""The layers hold where import-linter cannot look: remat.models and remat.examples.

``lint-imports`` (run by ``.ci/run``) checks the layers of the packages under ``remat/``.
``models/`` and ``examples/`` install as ``remat.models`` and ``remat.examples`` from other
folders, which import-linter cannot see; only the command line may import them.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REMAT = Path(__file__).resolve().parents[1] / "remat"
ABOVE_THE_LIBRARY = ("remat.models", "remat.examples")


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_only_the_command_line_imports_models_and_examples():
    offenders = {}
    for path in REMAT.rglob("*.py"):
        if path.relative_to(REMAT).parts[0] == "cli":
            continue
        bad = sorted(m for m in _imported_modules(path) if m.startswith(ABOVE_THE_LIBRARY))
        if bad:
            offenders[str(path.relative_to(REMAT))] = bad
    assert not offenders, offenders


def test_remat_installs_one_top_level_package():
    import importlib.metadata

    import remat.models

    tops = sorted(name for name, dists in importlib.metadata.packages_distributions().items() if "remat" in dists)
    assert tops == ["remat"], tops  # no top-level `models` beside it
    assert Path(remat.models.__file__).parent.name == "models"


def test_one_name_for_each_thing_no_shims():
    import importlib

    for gone in ("remat.memory", "remat.budget", "remat.sequential"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(gone)
    import remat.policies
    import remat.scan

    for module, name in [(remat.policies, "budget"), (remat.policies, "Budget"), (remat.scan, "resolve_policy_spec"),
                         (remat.scan, "_capacity"), (remat, "budget"), (remat, "memory")]:
        assert not hasattr(module, name), (module.__name__, name)
    for package in ("remat", "remat.policies", "remat.scan", "remat.analysis", "remat.ops", "remat.crosscheck"):
        exported = importlib.import_module(package).__all__
        assert not [n for n in exported if n.startswith("_")], package


def test_the_type_checking_imports_and_the_lazy_exports_name_the_same_objects():
    import ast

    import remat

    tree = ast.parse(Path(remat.__file__).read_text())
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING"]
    declared = {}
    for node in block.body:
        for alias in node.names:
            if isinstance(node, ast.ImportFrom) and node.module == "remat":  # from remat import ops as ops
                declared[alias.asname or alias.name] = (f"remat.{alias.name}", None)
            else:
                declared[alias.asname or alias.name] = (node.module, alias.name)
            assert alias.asname == alias.name or alias.asname is None or alias.asname in remat._EXPORTS
    assert declared == remat._EXPORTS
    assert remat.__all__ == sorted(remat._EXPORTS)
    for name in remat.__all__:
        assert getattr(remat, name) is not None

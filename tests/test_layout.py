"""The layers hold where import-linter cannot look: remat.models and remat.examples.

``lint-imports`` (run by ``.ci/run``) checks the layers of the packages under ``remat/``.
``models/`` and ``examples/`` install as ``remat.models`` and ``remat.examples`` from other
folders, which import-linter cannot see; only the command line may import them.
"""
from __future__ import annotations

import ast
from pathlib import Path

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


def test_old_module_paths_still_work_and_say_where_to_go():
    import importlib
    import sys
    import warnings

    for old, new, name in [("remat.memory", "remat.analysis", "saved_residuals"),
                           ("remat.budget", "remat.analysis.budget", "budget"),
                           ("remat.sequential", "remat._core.sequential", "checkpoint_sequential")]:
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        assert getattr(module, name) is getattr(importlib.import_module(new), name)
        assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught), old
    import remat.crosscheck
    import remat.torch

    assert remat.crosscheck is remat.torch  # the public path of the bridge, not deprecated
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import remat.analysis.budget
        assert remat.policies.budget is remat.analysis.budget.budget
    assert any("remat.residual_budget" in str(w.message) for w in caught)

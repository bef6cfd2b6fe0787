"""The layers hold where import-linter cannot look: remat.models, remat.examples, hidden imports.

``lint-imports`` (run by ``.ci/run``) checks the layers of the packages under ``remat/``.
``models/`` and ``examples/`` install as ``remat.models`` and ``remat.examples`` from other
folders, which import-linter cannot see; only the command line may import them. No module
imports itself through others: the graph of every import, at any depth (inside a function,
under ``TYPE_CHECKING``), has no cycle.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REMAT = Path(__file__).resolve().parents[1] / "remat"
ABOVE_THE_LIBRARY = ("remat.models", "remat.examples")
# each installed package and the folder it comes from (pyproject.toml's package-dir)
SOURCE_FOLDERS = {"remat": REMAT, "remat.models": REMAT.parent / "models", "remat.examples": REMAT.parent / "examples"}


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _installed_modules() -> dict[str, Path]:
    """Every module of the installed package, by its dotted name (a package by its ``__init__.py``)."""
    found = {}
    for package, folder in SOURCE_FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _resolve(target: str, modules: dict[str, Path]) -> str | None:
    """The module an import of ``target`` runs: itself, else the package that holds the name."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def _import_edges(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The modules ``name`` imports, at any depth, each with the line of its first import."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from ..a import b
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            module = _resolve(target, modules)
            if module is not None and module != name:
                edges.setdefault(module, node.lineno)
    return edges


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) in each strongly connected group of modules that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_through(group, graph) for group in groups]


def _cycle_through(group: list[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """The shortest path from the group's first module back to itself, within the group."""
    start, members = group[0], set(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, {})):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w in members and w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    return group  # unreachable for a strongly connected group


def import_graph() -> dict[str, dict[str, int]]:
    modules = _installed_modules()
    return {name: _import_edges(name, path, modules) for name, path in modules.items()}


def test_no_module_imports_itself_through_others():
    graph = import_graph()
    assert "remat.models.tasks" in graph and "remat.examples" in graph and "remat.cli.crosscheck" in graph
    described = []
    for cycle in import_cycles(graph):
        steps = [f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
        described.append(" -> ".join([*steps, cycle[-1]]))
    assert not described, "import cycles: " + "; ".join(described)


def test_the_cycle_check_sees_imports_inside_functions_and_under_type_checking(tmp_path):
    """The old crosscheck cycle, hidden by a function-level import, is found; so is one under TYPE_CHECKING."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "crosscheck.py").write_text("def run():\n    from pkg._precision import run_precision\n")
    (package / "_precision.py").write_text("def run_precision():\n    from pkg.crosscheck import _entry\n")
    (package / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import other\n")
    (package / "other.py").write_text("from .typed import x\n")
    modules = {"pkg": package / "__init__.py", **{f"pkg.{p.stem}": p for p in package.glob("[!_]*.py")},
               "pkg._precision": package / "_precision.py"}
    graph = {name: _import_edges(name, path, modules) for name, path in modules.items()}
    assert sorted(import_cycles(graph)) == [["pkg._precision", "pkg.crosscheck", "pkg._precision"],
                                            ["pkg.other", "pkg.typed", "pkg.other"]]


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
    for package in ("remat", "remat.policies", "remat.scan", "remat.analysis", "remat.explainer", "remat.ops",
                    "remat.crosscheck"):
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


def test_the_measuring_and_explaining_surfaces_name_what_a_user_calls_and_reads():
    """remat.analysis keeps the measurements and their results; helpers live in their modules, the
    explainer in remat.explainer, and each function once (``rematerialized``, not ``with_policy``)."""
    import remat.analysis
    import remat.explainer

    assert sorted(remat.analysis.__all__) == [
        "CompiledMemory", "CompiledStep", "PeakRSS", "PolicyComparison", "PolicyResult", "RSSMeasurement",
        "Residual", "ResidualReport", "Timings", "compare_policies", "compiled_memory", "compiled_step",
        "peak_rss_bytes", "peak_rss_during", "saved_residuals", "time_programs"]
    assert sorted(remat.explainer.__all__) == ["ExplainReport", "KINDS", "PeakBuffer", "explain"]
    for gone in ("with_policy", "explain", "format_bytes", "names_in_jaxpr", "current_rss_bytes"):
        assert not hasattr(remat.analysis, gone), gone
    for gone in ("saved_residuals", "compiled_memory", "compare_policies", "peak_rss_bytes"):
        assert gone not in remat.__all__ and not hasattr(remat, gone), gone  # remat.analysis.<name>
    assert remat.explain is remat.explainer.explain

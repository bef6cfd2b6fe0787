"""The wheel holds every package: the hand-written list in pyproject.toml is complete, and a built wheel works.

An editable install (the README's, CI's) finds every package on disk and so hides one missing from
``[tool.setuptools] packages``; only a non-editable install of the built wheel shows it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
# Folders installed under another name (pyproject.toml's [tool.setuptools.package-dir]).
INSTALLED_AS = {"remat": "remat", "models": "remat.models", "examples": "remat.examples"}


def _packages_on_disk() -> set[str]:
    found = set()
    for folder, dotted in INSTALLED_AS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((dotted, *parts)))
    return found


def _listed_packages() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(config["packages"])


def test_the_package_list_names_every_package_on_disk():
    on_disk, listed = _packages_on_disk(), _listed_packages()
    assert on_disk - listed == set(), f"add to pyproject.toml's packages: {sorted(on_disk - listed)}"
    assert listed - on_disk == set(), f"listed but not on disk: {sorted(listed - on_disk)}"


@pytest.mark.slow
def test_the_built_wheel_installs_whole_into_a_fresh_environment(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(ROOT)], check=True)
    (wheel,) = wheels.glob("remat-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in sorted(_packages_on_disk()):
        assert package.replace(".", "/") + "/__init__.py" in names, f"the wheel lacks {package}"

    # A fresh environment holding the wheel alone; its dependencies (jax, flax, torch, ...) are
    # borrowed from this one through a path entry, which reads no .pth file in it, so this
    # environment's editable remat stays invisible there.
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    python = env / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)

    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    imports = "; ".join(f"import {p}" for p in sorted(_packages_on_disk()))
    probe = f"{imports}; import remat; print(remat.__file__)"
    where = subprocess.run([str(python), "-c", probe], check=True, capture_output=True, text=True,
                           cwd=tmp_path, env=clean).stdout.strip()
    assert Path(where).is_relative_to(site), f"remat was imported from {where}, not the installed wheel"

    demo = subprocess.run([str(env / "bin" / "remat"), "demo"], capture_output=True, text=True, cwd=tmp_path,
                          env=clean, timeout=600)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]

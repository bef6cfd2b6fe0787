"""The ``remat`` command: one style for every subcommand."""
import json
import subprocess
import sys

import pytest

from remat.cli import SUBCOMMANDS, build_parser, main


def test_help_lists_every_built_subcommand_with_an_example(capsys):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert "demo" in sub.choices
    for name, p in sub.choices.items():
        assert name in SUBCOMMANDS
        assert "example:" in p.format_help() and f"remat {name}" in p.format_help()


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_unknown_option_is_a_usage_error():
    with pytest.raises(SystemExit) as e:
        main(["demo", "--no-such-flag"])
    assert e.value.code == 2


def test_help_is_fast_and_does_not_import_jax():
    code = ("import sys; from remat.cli import build_parser; build_parser(); "
            "print('jax' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_import_remat_is_cheap():
    code = ("import sys, remat; "
            "print(sorted(m for m in ('jax', 'flax', 'torch', 'matplotlib', 'remat.models') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.slow
def test_demo_json_all_pass(capsys):
    pytest.importorskip("torch")
    assert main(["demo", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["torch"]
    assert [r["ok"] for r in out["examples"]] == [True] * 4


def test_demo_without_pytorch_runs_the_jax_side_and_names_the_extra(monkeypatch, capsys):
    import importlib

    from remat.cli.demo import EXAMPLES
    from remat.examples import seed2_training_loop

    for name in EXAMPLES:  # as if PyTorch were not installed
        monkeypatch.setattr(importlib.import_module(name), "try_import_torch", lambda: None)
    full_run = seed2_training_loop.run
    monkeypatch.setattr(seed2_training_loop, "run", lambda: full_run(size=32, epochs=3))
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "pip install 'remat[torch]'" in out
    assert out.count("pass") >= 4 and "FAIL" not in out

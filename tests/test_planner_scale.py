"""remat.plan at scale: a memory limit in bytes per device, and a plan saved, loaded and applied."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from programs import WS, batch_of, loss

import remat
from remat.analysis.compiled import CompiledMemory
from remat.planner import Plan, plan
from remat.planner._units import parse_bytes

# the planner's four blocks (tests/programs.py) on a batch of 64 rows, where byte limits have room
X = batch_of(64)


def compiled_device_bytes(step, *args):
    m = CompiledMemory.from_compiled(jax.jit(jax.grad(step)).lower(*args).compile())
    return m.argument_bytes + m.output_bytes + m.temp_bytes - m.alias_bytes


@pytest.mark.parametrize("text, expected", [
    ("6GiB", 6 * 2**30), ("8GB", 8 * 10**9), ("512MiB", 512 * 2**20), ("1.5GiB", int(1.5 * 2**30)),
    ("100kb", 100_000), ("12", 12), (" 3 TiB ", 3 * 2**40), (4096, 4096), (0, 0),
])
def test_parse_bytes_reads_si_and_iec_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad, message", [
    ("-1GiB", "negative"), (-5, "negative"), ("6GiX", "unknown unit 'GiX'"), ("GiB", "cannot read"),
    ("", "cannot read"), (1.5, "an int of bytes"), (True, "an int of bytes"),
])
def test_parse_bytes_rejects_in_one_line(bad, message):
    with pytest.raises(ValueError, match=message) as e:
        parse_bytes(bad)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kwargs", [{}, {"memory_budget": 0.5, "memory_limit": "1MiB"}])
def test_plan_takes_a_budget_or_a_limit_exactly(kwargs):
    with pytest.raises(ValueError, match="exactly one of them"):
        plan(loss, WS, X, **kwargs)


def test_plan_rejects_a_bad_limit_before_tracing():
    traced = []
    with pytest.raises(ValueError, match="unknown unit"):
        plan(lambda ws, x: traced.append(1) or loss(ws, x), WS, X, memory_limit="3 parsecs")
    assert traced == []


def test_a_limit_in_bytes_is_the_compiled_footprint_on_one_device():
    unchecked = plan(loss, WS, X, memory_budget=1.0, measure=False)
    fixed, temp = unchecked.footprint.fixed_bytes, unchecked.footprint.temp_bytes
    assert unchecked.device_bytes == compiled_device_bytes(unchecked.apply(loss), WS, X)
    # half the un-checkpointed temp memory beside what no checkpoint changes: a plan that rematerializes
    limit = fixed + temp // 2
    p = plan(loss, WS, X, memory_limit=limit, measure=False)
    assert p.feasible and p.memory_limit_bytes == limit
    assert p.device_bytes == compiled_device_bytes(p.apply(loss), WS, X) <= limit
    assert p.device_bytes < unchecked.device_bytes
    assert p.to_dict()["memory_limit_bytes"] == limit and p.to_dict()["device_bytes"] == p.device_bytes


# a third search of the same step: slow; in the default run test_a_limit_below_the_parameters_says_what_dominates
# plans with a limit spelled with a unit, and test_parse_bytes_reads_si_and_iec_units reads the units
@pytest.mark.slow
def test_a_limit_spelled_with_a_unit_is_that_many_bytes():
    unchecked = plan(loss, WS, X, memory_budget=1.0, measure=False)
    limit = unchecked.footprint.fixed_bytes + unchecked.footprint.temp_bytes // 2
    spelled = plan(loss, WS, X, memory_limit=f"{limit / 2**10}KiB", measure=False)
    assert spelled.memory_limit_bytes == int(limit / 2**10 * 2**10) and spelled.device_bytes <= limit


def test_a_limit_below_the_parameters_says_what_dominates():
    p = plan(loss, WS, X, memory_limit="10KiB", measure=False)
    assert not p.feasible and p.chosen is None and p.device_bytes is None
    least = p.footprint.device_bytes
    assert least == p.footprint.fixed_bytes + p.footprint.temp_bytes and least > 10 * 2**10
    with pytest.raises(ValueError, match="cannot be met") as e:
        p.apply(loss)
    message = str(e.value)
    assert "\n" not in message and "least footprint" in message
    # the parameters (with their gradients) are 64 KiB of the 80-odd: they dominate
    assert p.footprint.dominant().startswith("parameters") and "mostly parameters" in message
    assert "cannot be met" in str(p)


def test_optimizer_state_among_the_arguments_is_told_apart():
    import optax

    from remat.planner._footprint import footprint

    state = optax.adam(1e-3).init(WS)

    def step(ws, state, x):
        return loss(ws, x)

    compiled = jax.jit(jax.grad(step)).lower(WS, state, X).compile()
    found = footprint(compiled, (WS, state, X), 0)
    params = sum(w.nbytes for w in WS)
    assert found.parameter_bytes == params and found.optimizer_bytes == 2 * params + 4  # mu, nu and the count
    assert found.parts()["optimizer state"] == found.optimizer_bytes


@pytest.fixture(scope="module")
def half_plan():
    """The plan at half the budget, planned once for the tests below that only read it."""
    return plan(loss, WS, X, memory_budget=0.5, measure=False)


def test_a_saved_plan_loads_and_applies_with_equal_gradients(tmp_path, half_plan):
    p = half_plan
    path = tmp_path / "plan.json"
    p.save(path)
    saved = json.loads(path.read_text())
    assert saved["format"] == "remat.plan/1" and saved["versions"]["jax"] == jax.__version__
    assert [r["option"] for r in saved["regions"]] == [remat.policies.policy_name(s) for s in p.chosen.policies]
    loaded = Plan.load(path)
    assert loaded.chosen.policies == p.chosen.policies and loaded.region_paths == p.region_paths
    # both from one compiled program (compiled apart, a compile more)
    want, got = jax.jit(lambda *a: (jax.grad(p.apply(loss))(*a), jax.grad(loaded.apply(loss))(*a)))(WS, X)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)


def test_a_plan_never_applies_to_other_regions(tmp_path, half_plan):
    p = half_plan
    # each mismatch when traced (run eagerly, each operation compiles alone before the error)
    with pytest.raises(ValueError, match="region 3 .* is missing"):
        jax.eval_shape(jax.grad(p.apply(lambda ws, x: loss(ws[:3], x))), WS, X)
    with pytest.raises(ValueError, match="reaches region 4"):
        jax.eval_shape(jax.grad(p.apply(lambda ws, x: loss([*ws, ws[0]], x))), WS, X)
    # a region of another module at the same place
    path = tmp_path / "plan.json"
    p.save(path)
    saved = json.loads(path.read_text())
    saved["regions"][1]["path"] = ["blocks", 7]
    path.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"region 1 is a region written by hand here, module blocks\.7 in the plan"):
        jax.eval_shape(jax.grad(Plan.load(path).apply(loss)), WS, X)
    saved["format"] = "remat.plan/0"
    path.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="not a saved remat plan"):
        Plan.load(path)


@pytest.mark.slow
def test_a_saved_plan_applies_in_a_new_process_with_bitwise_equal_gradients(tmp_path, half_plan):
    p = half_plan
    p.save(tmp_path / "plan.json")
    want = jax.jit(jax.grad(p.apply(loss)))(WS, X)
    np.save(tmp_path / "want.npy", np.concatenate([np.ravel(a) for a in jax.tree.leaves(want)]))
    script = textwrap.dedent(f"""
        import sys
        import jax, numpy as np
        from remat.planner import Plan
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from programs import WS, batch_of, loss
        X = batch_of(64)
        plan = Plan.load({str(tmp_path / "plan.json")!r})
        got = jax.jit(jax.grad(plan.apply(loss)))(WS, X)
        np.save({str(tmp_path / "got.npy")!r}, np.concatenate([np.ravel(a) for a in jax.tree.leaves(got)]))
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    np.testing.assert_array_equal(np.load(tmp_path / "got.npy"), np.load(tmp_path / "want.npy"))


MLP = ["mlp", "--depth", "4", "--width", "256", "--batch-size", "512"]


# a plan of the command's MLP: slow; in the default run test_a_limit_in_bytes_is_the_compiled_footprint_on_one_device
# plans with a limit in bytes, and test_the_command_refuses_a_bad_limit_in_one_line reads the command's flag
@pytest.mark.slow
def test_the_command_takes_a_limit_in_bytes_and_reports_the_footprint(capsys):
    from remat.cli import main

    assert main(["plan", *MLP, "--memory-limit", "6.6MiB", "--repeat", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["memory_limit_bytes"] == int(6.6 * 2**20)
    assert out["device_bytes"] == out["footprint"]["device_bytes"] <= out["memory_limit_bytes"]


def test_the_command_refuses_a_bad_limit_in_one_line(capsys):
    from remat.cli import main

    assert main(["plan", *MLP, "--memory-limit", "6 parsecs"]) == 2
    assert "unknown unit 'parsecs'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: the two spellings of the limit exclude each other
        main(["plan", *MLP, "--memory-limit", "1GiB", "--budget", "0.5"])
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.slow
def test_a_plan_saved_by_the_command_trains_and_explains(tmp_path, capsys):
    from remat.cli import main

    path = str(tmp_path / "plan.json")
    assert main(["plan", *MLP, "--memory-limit", "6.6MiB", "--repeat", "1", "--out", path]) == 0
    saved = json.loads(open(path).read())
    assert saved["memory_limit_bytes"] == int(6.6 * 2**20) and len(saved["regions"]) == 4
    capsys.readouterr()
    assert main(["train", *MLP, "--plan", path, "--steps", "2", "--json"]) == 0
    out = capsys.readouterr().out
    trained = json.loads(out[out.index("{"):])
    assert len(trained["losses"]) == 2 and all(np.isfinite(trained["losses"]))
    assert main(["explain", *MLP, "--plan", path, "--top", "2"]) == 0
    assert f"plan {path}: {saved['label']}" in capsys.readouterr().out
    # another depth: its regions are not the plan's, a one-line usage error
    other = ["mlp", "--depth", "3", "--width", "256", "--batch-size", "512"]
    assert main(["train", *other, "--plan", path, "--steps", "1"]) == 2
    assert "region 3 (a region written by hand) is missing" in capsys.readouterr().err
    assert main(["train", *MLP, "--plan", str(tmp_path / "none.json")]) == 2

"""remat.analysis: residual reports, compiled buffer sizes, measured RSS, policy tables."""
from __future__ import annotations

import functools
import inspect
import json
import operator
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name
from programs import mlp_factory as _mlp_factory
from programs import mlp_params as _drawn_mlp_params

from remat._core.checkpoint import rematerialized
from remat._core.residuals import format_bytes
from remat.analysis import (
    CompiledMemory,
    ResidualReport,
    compare_policies,
    compiled_memory,
    peak_rss_bytes,
    saved_residuals,
)

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def _mlp_params(depth):
    """tests/programs.py's MLP parameters, drawn in one compiled program (drawn eagerly, each
    random primitive compiles on its own), once per depth: the tests only read them."""
    return jax.jit(lambda: _drawn_mlp_params(depth))()


def _line_of(fn, text: str) -> int:
    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(src) if text in line)


def tagged(w, x):
    h = checkpoint_name(jnp.sin(x @ w), "hidden")
    g = jnp.cos(h @ w)
    return jnp.sum(g * g)


W = jnp.ones((16, 16), jnp.float32)
X = jnp.ones((4, 16), jnp.float32)


def test_residuals_as_data():
    r = saved_residuals(tagged, W, X)
    assert isinstance(r, ResidualReport)
    kinds = [(e.kind, e.name, e.primitive) for e in r]
    # w and x, then cos(x@w... )'s operands: the named sin output, sin for the backward
    # of h@w, the cos result used by g*g, and g itself.
    assert kinds[:2] == [("argument", None, None), ("argument", None, None)]
    assert [e.argument for e in r if e.is_argument] == ["w", "x"]
    named = [e for e in r if e.name == "hidden"]
    assert len(named) == 1
    assert named[0].shape == (4, 16) and named[0].dtype == "float32" and named[0].nbytes == 4 * 16 * 4
    assert named[0].line == _line_of(tagged, "checkpoint_name(")
    assert named[0].function == "tagged" and named[0].file.endswith("test_memory.py")
    assert all(e.nbytes == int(np.prod(e.shape)) * 4 for e in r)
    assert r.argument_bytes == W.nbytes + X.nbytes
    assert r.total_bytes == sum(e.nbytes for e in r)
    assert r.residual_bytes == r.total_bytes - r.argument_bytes > 0
    assert r.named() == {"hidden": 256}


def test_residuals_match_jax_print_saved_residuals():
    from jax._src.ad_checkpoint import saved_residuals as jax_saved

    ours = saved_residuals(tagged, W, X)
    theirs = jax_saved(tagged, W, X)
    assert [e.shape for e in ours] == [tuple(a.shape) for a, _ in theirs]


def test_checkpoint_keeps_only_inputs_and_named_values():
    everything_recomputed = saved_residuals(jax.checkpoint(tagged), W, X)
    assert [e.kind for e in everything_recomputed] == ["argument", "argument"]
    assert everything_recomputed.residual_bytes == 0
    policy = jax.checkpoint_policies.save_only_these_names("hidden")
    only_named = saved_residuals(jax.checkpoint(tagged, policy=policy), W, X)
    assert [(e.kind, e.name) for e in only_named if not e.is_argument] == [("named", "hidden")]
    assert only_named.residual_bytes == 256


def test_pytree_output_and_pytree_args():
    def f(params, x):
        h = jnp.tanh(x @ params["w"])
        return {"y": h * 2.0, "aux": (jnp.sum(h),)}

    r = saved_residuals(f, {"w": W}, X)
    # The literal is the constant 2.0 of the linear map y = 2h, which the vjp keeps.
    assert [(e.kind, e.argument or e.primitive) for e in r] == [
        ("literal", None), ("argument", "params['w']"), ("argument", "x"), ("output", "tanh"), ("output", "sub")]
    assert r.residual_bytes == 4 + 2 * X.nbytes


def test_report_serialises_and_prints():
    r = saved_residuals(tagged, W, X)
    d = json.loads(r.to_json())
    assert d["count"] == len(r) and d["residual_bytes"] == r.residual_bytes
    assert d["residuals"][0]["shape"] == [16, 16]
    text = str(r)
    assert "hidden" in text and "argument" in text and "total" in text
    assert format_bytes(r.total_bytes) in text


def test_saved_residuals_rejects_non_callable():
    with pytest.raises(TypeError, match="needs a function"):
        saved_residuals(3, W)


def test_compiled_memory_fields():
    m = compiled_memory(tagged, W, X)
    assert isinstance(m, CompiledMemory)
    assert m.argument_bytes == W.nbytes + X.nbytes
    assert m.output_bytes == W.nbytes  # grad wrt argnums=0
    assert m.peak_bytes >= m.temp_bytes
    both = compiled_memory(tagged, W, X, argnums=(0, 1))
    # A tuple output also holds its table of buffer pointers (8 bytes per element).
    assert both.output_bytes == W.nbytes + X.nbytes + 2 * 8
    fwd = compiled_memory(lambda w, x: x @ w, W, X, grad=False)
    assert fwd.output_bytes == X.nbytes
    assert set(json.loads(m.to_json())) == {
        "temp_bytes", "argument_bytes", "output_bytes", "alias_bytes", "generated_code_bytes", "peak_bytes"}


def test_compiled_step_is_the_executable_and_its_memory():
    from remat.analysis import compiled_step

    step = compiled_step(tagged, W, X)
    assert step.memory == compiled_memory(tagged, W, X)
    np.testing.assert_allclose(step.executable(W, X), jax.grad(tagged)(W, X), rtol=1e-6)
    assert step.compile_s > 0
    executable, memory, _ = compiled_step(lambda w, x: x @ w, W, X, grad=False)
    assert memory.output_bytes == X.nbytes and executable(W, X).shape == X.shape


def test_time_programs_rounds_rotate_and_groups_alternate():
    from remat.analysis import time_programs

    calls = []
    programs = [lambda i=i: calls.append(i) for i in range(4)]
    t = time_programs(programs, rounds=3, warmup=1)
    assert [len(s) for s in t.samples_s] == [3, 3, 3, 3] and all(m > 0 for m in t.medians_ms())
    # one warm-up round in order, then rounds whose order rotates by one each time
    assert calls == [0, 1, 2, 3] + [0, 1, 2, 3] + [1, 2, 3, 0] + [2, 3, 0, 1]
    calls.clear()
    woken = []
    time_programs(programs, rounds=2, warmup=0, groups=[[0, 1], [2, 3]], before_group=woken.append)
    assert calls == [0, 1, 2, 3] + [3, 2, 1, 0]  # the groups alternate, each rotating inside
    assert woken == [[0, 1], [2, 3], [3, 2], [1, 0]]
    with pytest.raises(ValueError, match="rounds"):
        time_programs(programs, rounds=0)
    with pytest.raises(ValueError, match="groups"):
        time_programs(programs, rounds=1, groups=[[0, 1], [2]])


def test_time_programs_averages_back_to_back_calls_up_to_the_minimum_sample(monkeypatch):
    from types import SimpleNamespace

    from remat.analysis import time_programs

    # a clock of our own, which each program moves on by its length: the sample sizing and the
    # averaging are checked exactly, without a wall clock (lengths in powers of two: exact sums)
    clock = [0.0]
    timing = sys.modules[time_programs.__module__]
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    calls = []

    def program(i, seconds):
        def run():
            calls.append(i)
            clock[0] += seconds
        return run

    t = time_programs([program(0, 2 ** -9), program(1, 2 ** -5)], rounds=2, warmup=1, min_sample_s=2 ** -6)
    # one warm-up call each, one call each to size the samples (2 ** -6 s: 8 calls of program 0,
    # one of program 1), then two rounds, the second in the rotated order
    assert calls == [0, 1, 0, 1] + [0] * 8 + [1] + [1] + [0] * 8
    assert t.samples_s == ((2 ** -9, 2 ** -9), (2 ** -5, 2 ** -5))
    assert t.medians_s() == [2 ** -9, 2 ** -5]


def test_paired_times_take_out_a_slow_spell_that_medians_keep():
    from remat.analysis.timing import Timings

    # program 1 is 10% slower than program 0 in every round; four of the seven rounds are
    # a slow spell (3x) that caught program 0 in more of its samples than program 1
    fast, slow = [1.0, 3.0, 3.0, 1.0, 3.0, 1.0, 3.0], [1.1, 3.3, 3.3, 1.1, 3.3, 1.1, 3.3]
    t = Timings((tuple(x / 1e3 for x in fast), tuple(x / 1e3 for x in slow)))
    assert t.paired_ms()[1] / t.paired_ms()[0] == pytest.approx(1.1)
    spelled = Timings((tuple(x / 1e3 for x in [3.0, 3.0, 3.0, 1.0, 3.0, 1.0, 3.0]),
                       tuple(x / 1e3 for x in [1.1, 1.1, 3.3, 1.1, 3.3, 1.1, 1.1])))
    # the medians say program 0 is the slower; the rounds without a spell on it alone say
    # it is 10% faster
    assert spelled.medians_ms()[0] > spelled.medians_ms()[1]
    assert spelled.paired_ms()[0] < spelled.paired_ms()[1]
    assert Timings(()).paired_ms() == []


def test_time_side_by_side_times_close_steps_again(monkeypatch):
    from remat.analysis.timing import Timings
    from remat.planner import programs

    runs = []

    def fake(calls, rounds, min_sample_s):
        runs.append((len(calls), rounds))
        if len(runs) == 1:  # steps 0 and 2 within 3% of each other, step 1 far behind
            return Timings(((0.0100,) * rounds, (0.0200,) * rounds, (0.0102,) * rounds))
        return Timings(((0.0110,) * rounds, (0.0100,) * rounds))  # again: step 2 the faster

    monkeypatch.setattr(programs, "time_programs", fake)
    ms = programs.time_side_by_side([lambda: None] * 3, (), repeat=5)
    assert runs == [(3, 5), (2, 10)]
    assert ms[2] < ms[0] < ms[1]
    # the re-timed pair keeps its geometric mean from the first run
    assert ms[0] * ms[2] == pytest.approx(10.0 * 10.2) and ms[0] / ms[2] == pytest.approx(1.1)
    assert ms[1] == pytest.approx(20.0, rel=0.05)


def test_time_side_by_side_stays_the_planners_name():
    from remat.planner.programs import time_side_by_side

    f = jax.jit(lambda w, x: x @ w).lower(W, X).compile()
    ms = time_side_by_side([f, f], (W, X), repeat=3)
    assert len(ms) == 2 and all(m > 0 for m in ms)


def test_peak_rss_during_sees_a_new_buffer():
    from remat.analysis import peak_rss_during
    from remat.analysis.process import current_rss_bytes

    assert current_rss_bytes() > 0
    p = peak_rss_during(lambda: np.ones((2048, 2048), np.float32).sum())  # 16 MiB, touched
    assert p.exact and p.method == "vmhwm_reset"
    assert 12 * 2**20 <= p.increase_bytes < 2**30, p


def test_compiled_memory_accepts_shape_dtype_structs():
    spec = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    assert compiled_memory(tagged, spec, jax.ShapeDtypeStruct((4, 16), jnp.float32)).argument_bytes == 1280


def test_rematerialized_under_each_policy_spelling():
    f = lambda w, x: jnp.sum(jnp.tanh(x @ w))  # noqa: E731
    assert rematerialized(f, "no_checkpoint") is f
    r = saved_residuals(rematerialized(f, "nothing"), W, X)
    assert r.residual_bytes == 0
    r = saved_residuals(rematerialized(f, "dots"), W, X)
    assert [e.primitive for e in r if not e.is_argument] == ["dot_general"]


# a child interpreter importing jax: slow; in the default run test_peak_rss_in_process measures
# the peak in this one, and test_peak_rss_explains_unpicklable_steps the way to the child
@pytest.mark.slow
def test_peak_rss_in_a_fresh_process():
    a = np.ones((2048, 2048), np.float32)  # 16 MiB per operand and per output
    m = peak_rss_bytes(operator.matmul, a, a, repeat=2)
    assert m.exact
    assert m.baseline_bytes > 0 and m.step_peak_bytes >= m.baseline_bytes
    # The output (16 MiB) must show up; a sane step needs far less than 1 GiB extra.
    assert 12 * 2**20 <= m.step_bytes < 2**30, m


def test_peak_rss_explains_unpicklable_steps():
    with pytest.raises(TypeError, match="isolate=False"):
        peak_rss_bytes(lambda x: x * 2, np.ones(4))


def test_peak_rss_in_process():
    m = peak_rss_bytes(lambda x: x * 2, np.ones((256, 256), np.float32), isolate=False)
    assert m.step_peak_bytes >= m.baseline_bytes > 0


# importing remat.analysis pulls in neither matplotlib nor torch: checked in a fresh interpreter with
# the other import checks (test_lowering.py::test_import_remat_changes_nothing_observable_and_imports_nothing_heavy)


@pytest.fixture(scope="module")
def policy_table():
    """Three policies of the 2-block MLP compared once (three compiles); the plotting test only reads it."""
    return compare_policies(_mlp_factory, _mlp_params(2), jnp.ones((8, 32)),
                            policies=("no_checkpoint", "nothing", "dots"), steps=2)


def test_compare_policies_factory_and_keyword_forms(tmp_path, policy_table):
    ps, x, table = _mlp_params(2), jnp.ones((8, 32)), policy_table
    assert [r.policy for r in table] == ["no_checkpoint", "nothing", "dots"]
    assert all(len(r.step_times_s) == 2 and r.step_time_s > 0 for r in table)
    assert table["nothing"].residual_bytes < table["dots"].residual_bytes < table["no_checkpoint"].residual_bytes
    # Exact: block 1's input and the final output (for x ** 2); block 0's input is x itself.
    assert table["nothing"].residual_bytes == 2 * 8 * 32 * 4

    def loss_with_kwarg(ps, x, *, policy="no_checkpoint"):
        return _mlp_factory(policy)(ps, x)

    again = compare_policies(loss_with_kwarg, ps, x, policies=("nothing",), steps=1)
    assert again["nothing"].residual_bytes == table["nothing"].residual_bytes

    d = json.loads(table.to_json())
    assert [r["policy"] for r in d["results"]] == ["no_checkpoint", "nothing", "dots"]
    assert "temp vs no checkpoint" in str(table) and "1.00x" in str(table)
    png = table.plot(tmp_path / "policies.png")
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(KeyError, match="no policy"):
        table["everything"]


def test_compare_policies_rejects_bad_input():
    with pytest.raises(ValueError, match="steps"):
        compare_policies(_mlp_factory, _mlp_params(1), jnp.ones((2, 32)), steps=0)
    with pytest.raises(ValueError, match="policies is empty"):
        compare_policies(_mlp_factory, _mlp_params(1), jnp.ones((2, 32)), policies=())
    with pytest.raises(TypeError, match="factory"):
        compare_policies(lambda policy: 3, _mlp_params(1), jnp.ones((2, 32)))


@pytest.mark.slow
def test_compiled_bytes_order_nothing_dots_none_after_import_remat():
    # In a fresh process so that `import remat` is guaranteed to configure XLA:CPU
    # before any backend starts (another test module may already have started it here).
    code = textwrap.dedent("""
        import json
        import remat
        import jax, jax.numpy as jnp
        from remat.analysis import compare_policies
        from tests.programs import mlp_factory as _mlp_factory, mlp_params as _mlp_params
        t = compare_policies(_mlp_factory, _mlp_params(4, d=128, hidden=512), jnp.ones((256, 128)),
                             policies=("no_checkpoint", "nothing", "dots", "everything"), steps=5, warmup=1)
        print(t.to_json())
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "REMAT_KEEP_XLA_FLAGS")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    d = {r["policy"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])["results"]}
    temp = {k: v["temp_bytes"] for k, v in d.items()}
    assert temp["nothing"] < temp["dots"] < temp["no_checkpoint"], temp
    assert temp["nothing"] < 0.5 * temp["no_checkpoint"], temp
    assert temp["everything"] >= 0.9 * temp["no_checkpoint"], temp  # saving everything = no checkpoint
    res = {k: v["residual_bytes"] for k, v in d.items()}
    assert res["nothing"] < res["dots"] < res["no_checkpoint"], res
    assert abs(res["everything"] - res["no_checkpoint"]) < 0.01 * res["no_checkpoint"], res  # up to a few literals


@pytest.mark.slow
def test_profile_cli_handles_batchnorm_models(capsys):
    from remat.cli import main

    rc = main(["profile", "cnn", "--depth", "2", "--width", "4", "--steps", "1", "--policies", "no_checkpoint,nothing",
               "--json"])
    assert rc == 0, capsys.readouterr().err
    none, nothing = json.loads(capsys.readouterr().out)["results"]
    assert nothing["residual_bytes"] < none["residual_bytes"]
    assert nothing["temp_bytes"] < none["temp_bytes"]


@pytest.mark.slow
def test_profile_cli_json_and_errors(capsys, tmp_path):
    from remat.cli import main

    png = tmp_path / "p.png"
    rc = main(["profile", "transformer", "--depth", "2", "--width", "16", "--seq-len", "8", "--batch-size", "4",
               "--steps", "2", "--policies", "no_checkpoint,nothing", "--plot", str(png), "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert d["model"] == "transformer" and [r["policy"] for r in d["results"]] == ["no_checkpoint", "nothing"]
    assert d["results"][1]["residual_bytes"] < d["results"][0]["residual_bytes"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["profile", "resnet"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'resnet'; use one of seed-model, seed-mymodel, mlp, transformer, cnn" in err
    assert main(["profile", "mlp", "--policies", "dots,often"]) == 2
    assert "often" in capsys.readouterr().err


def test_plotting_leaves_the_host_programs_matplotlib_backend_alone(tmp_path, policy_table):
    import matplotlib

    before = matplotlib.get_backend()
    matplotlib.use("svg")  # the host program's choice, which matplotlib.use("Agg") in remat once replaced
    try:
        policy_table.plot(tmp_path / "p.png")
        assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(before)

"""benchmarks/: the measurement functions at tiny sizes, the report, the files written.

No wall-clock assertions: timings are only checked to be positive numbers.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is a folder of the repository, not installed
    sys.path.insert(0, str(ROOT))

from benchmarks import measure as M  # noqa: E402
from benchmarks import report  # noqa: E402
from benchmarks import run as bench_run  # noqa: E402

pytest.importorskip("torch")

TINY = M.SIZES["tiny"]


def _check_schema(rows: list[dict]) -> None:
    assert rows
    for r in rows:
        for k in M.ROW_KEYS:
            assert k in r, f"missing {k} in {r}"
        assert r["framework"] in ("jax", "torch")
        assert r["model"] in M.MODELS
        assert isinstance(r["depth"], int) and r["depth"] >= 1
        variants = M.JAX_VARIANTS if r["framework"] == "jax" else M.TORCH_VARIANTS
        assert r["variant"] in variants
        assert isinstance(r["saved_bytes"], int) and r["saved_bytes"] > 0
        if r["framework"] == "jax":
            assert isinstance(r["temp_bytes"], int) and r["temp_bytes"] > 0
        else:
            assert r["temp_bytes"] is None
        assert isinstance(r["peak_rss_bytes"], int) and r["peak_rss_bytes"] >= 0
        assert isinstance(r["step_ms"], float) and r["step_ms"] > 0
        assert isinstance(r["overhead"], float) and r["overhead"] > 0
        # flat: no nested objects
        assert all(not isinstance(v, (dict, list)) for v in r.values()), r
    # every row is JSON-serialisable as it is
    json.dumps(rows)


@pytest.fixture(scope="module")
def mlp_rows() -> list[dict]:
    return M.measure_model("mlp", 2, TINY, jax_variants=("no_checkpoint", "nothing", "scan"),
                           torch_variants=("no_checkpoint", "nothing"), steps=2)


def _get(rows, framework, variant, depth=None):
    (r,) = [r for r in rows if r["framework"] == framework and r["variant"] == variant
            and (depth is None or r["depth"] == depth)]
    return r


@pytest.mark.slow  # measures five programs (mlp_rows); the synthetic rows' tests are the fast case
def test_row_schema(mlp_rows):
    _check_schema(mlp_rows)
    assert {(r["framework"], r["variant"]) for r in mlp_rows} == {
        ("jax", "no_checkpoint"), ("jax", "nothing"), ("jax", "scan"), ("torch", "no_checkpoint"), ("torch", "nothing")}


@pytest.mark.slow  # measures five programs (mlp_rows); the synthetic rows' tests are the fast case
def test_none_overhead_is_one(mlp_rows):
    for fw in ("jax", "torch"):
        assert _get(mlp_rows, fw, "no_checkpoint")["overhead"] == 1.0
    r = _get(mlp_rows, "jax", "nothing")
    assert r["overhead"] == pytest.approx(r["step_ms"] / _get(mlp_rows, "jax", "no_checkpoint")["step_ms"], rel=1e-3)


@pytest.mark.slow  # measures five programs (mlp_rows); the synthetic rows' tests are the fast case
def test_memory_relations_mlp(mlp_rows):
    none, nothing, scan = (_get(mlp_rows, "jax", v) for v in ("no_checkpoint", "nothing", "scan"))
    assert scan["temp_bytes"] < none["temp_bytes"]
    assert nothing["temp_bytes"] < none["temp_bytes"]
    # an MLP block's only saved tensor is its relu output (remat.ops.relu keeps no mask),
    # the next block's input: the same tensors that checkpointing keeps, in both frameworks
    assert nothing["saved_bytes"] == none["saved_bytes"]
    assert _get(mlp_rows, "torch", "nothing")["saved_bytes"] == _get(mlp_rows, "torch", "no_checkpoint")["saved_bytes"]
    # and JAX keeps no more than PyTorch
    for v in ("no_checkpoint", "nothing"):
        assert _get(mlp_rows, "jax", v)["saved_bytes"] <= _get(mlp_rows, "torch", v)["saved_bytes"], v


def test_saved_bytes_exclude_parameters():
    built = M.build("mlp", 2, TINY)
    loss, params = M.jax_loss(built, "nothing")
    x, y = M.jax_inputs(built)
    jb = M.jax_saved_bytes(loss, params, x, y)
    # each checkpointed block keeps its parameters as residuals: counted apart
    block_param_bytes = 2 * (TINY.mlp["width"] ** 2 + TINY.mlp["width"]) * 4
    assert jb["saved_param_bytes"] >= block_param_bytes
    assert jb["residual_total_bytes"] >= jb["saved_bytes"] + block_param_bytes
    act = TINY.mlp["batch"] * TINY.mlp["width"] * 4
    # input x, the block inputs and the head input: activations, not parameters
    assert jb["saved_bytes"] >= 3 * act
    tb = M.torch_saved_bytes(M.torch_program(built, "nothing"))
    # torch.utils.checkpoint saves its inputs through saved_tensors_hooks: they are counted
    assert tb["saved_bytes"] >= 3 * act


@pytest.mark.slow
def test_jax_variants_run_the_models_own_forward():
    import jax
    import jax.numpy as jnp

    built = M.build("transformer", 2, TINY)
    x, y = M.jax_inputs(built)
    logp = jax.nn.log_softmax(built.jax_model(x), axis=-1)  # the NNX model itself
    expected = -jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))
    for v in ("no_checkpoint", "nothing", "names", "budget_0.5", "scan", "scan_nested", "sequential"):
        loss, params = M.jax_loss(built, v)
        assert float(loss(params, x, y)) == pytest.approx(float(expected), rel=1e-5), v
    with pytest.raises(ValueError, match="unknown JAX variant"):
        M.jax_loss(built, "everything")


def test_segments_for():
    assert [M.segments_for(d) for d in (1, 2, 4, 8, 16, 32)] == [1, 1, 2, 3, 4, 6]


def _synthetic_rows() -> list[dict]:
    rows = []

    def add(fw, model, depth, variant, saved, temp, ms):
        rows.append({"framework": fw, "model": model, "depth": depth, "variant": variant,
                     "saved_bytes": saved, "temp_bytes": temp, "peak_rss_bytes": saved,
                     "step_ms": float(ms), "overhead": None})

    for d in (4, 16):
        add("jax", "transformer", d, "no_checkpoint", 100 * d, 100 * d, 10 * d)
        add("jax", "transformer", d, "nothing", 10 * d, 15 * d, 13 * d)
        add("jax", "transformer", d, "dots", 50 * d, 70 * d, 11 * d)
        add("jax", "transformer", d, "scan_nested", 5 * d, 100 * math.sqrt(d), 14 * d)
        add("torch", "transformer", d, "no_checkpoint", 100 * d, None, 12 * d)
        add("torch", "transformer", d, "nothing", 12 * d, None, 12.5 * d)
    return rows


def test_targets_and_ratios():
    rows = _synthetic_rows()
    report.add_overheads(rows)
    t = {x["target"].split(":")[0]: x for x in report.targets(rows)}
    assert t["transformer 16 layers, per-block nothing"]["met"] is True
    assert t["transformer 16 layers, per-block dots"]["met"] is False  # temp 70% > 60%
    met = {x["target"]: x["met"] for x in report.targets(rows)}
    assert met["transformer 16 layers, nothing: JAX step_ms <= PyTorch"] is False  # 13 > 12.5
    assert met["transformer 16 layers, nothing: JAX saved_bytes <= PyTorch"] is True
    (sn,) = [v for k, v in met.items() if "scan_nested" in k]
    assert sn is True  # grows exactly like sqrt(depth)
    ratios = report.jax_torch_ratios(rows)
    r = [x for x in ratios if x["depth"] == 4 and x["variant"] == "no_checkpoint"][0]
    assert r["step_ms_ratio"] == pytest.approx(40 / 48)
    assert r["saved_bytes_ratio"] == pytest.approx(1.0)


@pytest.mark.parametrize("measured", [pytest.param(True, marks=pytest.mark.slow), False],
                         ids=["measured", "synthetic"])
def test_outputs_written(tmp_path, request, measured):
    rows = request.getfixturevalue("mlp_rows") if measured else _synthetic_rows()
    meta = {"sizes": "tiny", **M.process_info(), "model_sizes": {"mlp": TINY.mlp}}
    data = bench_run.write_outputs(tmp_path, [dict(r) for r in rows], meta)
    for name in ("results.json", "results.md", "memory_vs_time.png"):
        assert (tmp_path / name).stat().st_size > 0
    loaded = json.loads((tmp_path / "results.json").read_text())
    assert loaded["rows"] == data["rows"]
    if measured:
        _check_schema(loaded["rows"])
    md = (tmp_path / "results.md").read_text()
    for section in ("## Results", "## JAX / PyTorch", "## targets"):
        assert section in md
    assert (tmp_path / "memory_vs_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_transformer_all_variants_tiny():
    rows = M.measure_model("transformer", 2, TINY, steps=1)
    _check_schema(rows)
    assert {r["variant"] for r in rows if r["framework"] == "jax"} == set(M.JAX_VARIANTS)
    assert {r["variant"] for r in rows if r["framework"] == "torch"} == set(M.TORCH_VARIANTS)
    temp = {r["variant"]: r["temp_bytes"] for r in rows if r["framework"] == "jax"}
    assert temp["nothing"] < temp["dots"] < temp["no_checkpoint"]
    assert temp["scan"] < temp["no_checkpoint"]
    saved = {r["variant"]: r["saved_bytes"] for r in rows if r["framework"] == "jax"}
    assert saved["nothing"] < saved["names"] < saved["dots"] < saved["no_checkpoint"]
    assert saved["scan"] == saved["nothing"]  # the same block inputs, kept by the scan
    # with remat.ops (LayerNorm, GELU, masked softmax), JAX keeps no more than PyTorch
    torch_saved = {r["variant"]: r["saved_bytes"] for r in rows if r["framework"] == "torch"}
    for v in ("no_checkpoint", "nothing", "sequential"):
        assert saved[v] <= torch_saved[v], (v, saved[v], torch_saved[v])
    # the whole step checkpointed keeps less than torch.compile's leanest partition (the
    # batch, in int32 against int64), and torch.compile's budget orders what it keeps
    assert saved["whole"] <= torch_saved["torch_compile_0.0"] < torch_saved["torch_compile_1.0"]
    compile_s = {r["variant"]: r["compile_s"] for r in rows if r["framework"] == "torch"}
    assert all(compile_s[v] > 0 for v in M.TORCH_VARIANTS if v.startswith("torch_compile_"))


@pytest.mark.slow
def test_cli_tiny(tmp_path):
    rc = bench_run.main(["--tiny", "--models", "mlp", "--depths", "2,4", "--steps", "2", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    _check_schema(data["rows"])
    assert {r["depth"] for r in data["rows"]} == {2, 4}
    assert len(data["rows"]) == 2 * (len(M.JAX_VARIANTS) + len(M.TORCH_VARIANTS))
    assert (tmp_path / "memory_vs_time.png").stat().st_size > 0


def test_whole_step_variants_keep_only_the_inputs():
    built = M.build("transformer", 2, TINY)
    x, y = M.jax_inputs(built)
    saved = {}
    for v in ("no_checkpoint", "nothing", "whole", "whole_nested"):
        loss, params = M.jax_loss(built, v)
        saved[v] = M.jax_saved_bytes(loss, params, x, y)["saved_bytes"]
    # the whole step checkpointed keeps the batch (tokens and targets) and nothing computed
    assert saved["whole"] == saved["whole_nested"] == x.nbytes + y.nbytes
    assert saved["whole"] < saved["nothing"] < saved["no_checkpoint"]


def _frontier_rows() -> list[dict]:
    def r(fw, variant, saved, ms):
        return {"framework": fw, "model": "mlp", "depth": 8, "variant": variant, "saved_bytes": saved,
                "step_ms": float(ms), "compile_s": 1.0}

    return [r("jax", "no_checkpoint", 100, 10), r("jax", "nothing", 20, 12), r("jax", "dots", 60, 13),
            r("jax", "whole_nested", 2, 12.5), r("jax", "plan_0.0", 2, 12.0),
            r("torch", "no_checkpoint", 100, 11), r("torch", "torch_compile_1.0", 90, 9),
            r("torch", "torch_compile_0.0", 2, 11.5), r("torch", "torch_compile_0.5", 40, 9.5)]


def test_pareto_and_goal():
    from benchmarks import frontier

    rows = _frontier_rows()
    front = frontier.pareto([r for r in rows if r["framework"] == "jax"])
    # dots is beaten by nothing (less saved, faster); plan_0.0 beats whole_nested (equal saved, faster)
    assert [r["variant"] for r in front] == ["plan_0.0", "no_checkpoint"]
    goal = {g["torch_variant"]: g for g in frontier.goal(rows)}
    assert goal["torch_compile_0.0"]["remat_variant"] == "plan_0.0"
    assert goal["torch_compile_0.0"]["ratio"] == pytest.approx(12.0 / 11.5) and not goal["torch_compile_0.0"]["met"]
    assert goal["torch_compile_1.0"]["ratio"] == pytest.approx(12.0 / 9.0) and not goal["torch_compile_1.0"]["met"]
    assert goal["torch_compile_0.5"]["ratio"] == pytest.approx(12.0 / 9.5)
    md = frontier.markdown(rows, {})
    assert "| mlp | 8 | remat | plan_0.0 |" in md and "missed" in md


def test_compile_budget_names():
    from benchmarks.cases import TORCH_COMPILE_VARIANTS, compile_budget

    assert [compile_budget(v) for v in TORCH_COMPILE_VARIANTS] == [1.0, 0.5, 0.25, 0.0]
    assert compile_budget("nothing") is None and compile_budget("torch_compile_2") is None
    with pytest.raises(ValueError, match="unknown PyTorch variant"):
        M.torch_program(M.build("mlp", 2, TINY), "torch_compile_x")


@pytest.mark.slow
def test_torch_compile_variants_count_what_the_compiled_backward_saves():
    built = M.build("mlp", 2, TINY)
    eager = M.torch_saved_bytes(M.torch_program(built, "no_checkpoint"))["saved_bytes"]
    full = M.torch_program(built, "torch_compile_1.0")
    lean = M.torch_program(built, "torch_compile_0.0")
    assert full.compile_s > 0 and lean.compile_s > 0
    full_saved = M.torch_saved_bytes(full)["saved_bytes"]
    lean_saved = M.torch_saved_bytes(lean)["saved_bytes"]
    # budget 1.0 keeps about what eager keeps; budget 0.0 only the batch (int64 targets)
    assert 0.9 * eager <= full_saved <= 1.1 * eager
    x, y = built.inputs, built.targets
    assert lean_saved <= x.astype("float32").nbytes + y.astype("int64").nbytes < full_saved
    # gradients equal the eager twin's
    import torch

    eager_prog = M.torch_program(built, "no_checkpoint")
    eager_prog.step()
    g0 = [p.grad.clone() for p in eager_prog.params]
    lean.step()
    for a, b in zip(lean.params, g0, strict=True):
        torch.testing.assert_close(a.grad, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_frontier_run_tiny(tmp_path):
    from benchmarks import frontier

    rc = bench_run.main(["--tiny", "--frontier", "--models", "mlp", "--depths", "2", "--steps", "2",
                         "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    variants = {(r["framework"], r["variant"]) for r in rows}
    assert {("torch", v) for v in frontier.FRONTIER_TORCH} <= variants
    assert ("jax", "plan_0.0") in variants and ("jax", "whole_nested") in variants
    goal = frontier.goal(rows)
    assert len(goal) == 4 and all(g["remat_saved_bytes"] <= g["torch_saved_bytes"] for g in goal)
    md = (tmp_path / "frontier.md").read_text()
    assert "## remat against every torch.compile point" in md and "torch_compile_0.0" in md
    assert (tmp_path / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_scan_schedules_tiny(capsys):
    from benchmarks import scan_schedules

    assert scan_schedules.main(["--depth", "4", "--models", "mlp", "--sizes", "tiny"]) == 0
    rows = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| mlp |")]
    assert [row[1] for row in rows] == ["nothing", "dots_no_batch", "dots"]
    for row in rows:  # 4 blocks: flat, 2 groups and both binomial schedules; no 8 or 4 groups
        cells = dict(zip(scan_schedules.SCHEDULES, row[2:], strict=True))
        assert cells["8 groups"] == cells["4 groups"] == "-", row
        assert all(float(cells[s]) > 0 for s in ("flat", "2 groups", "binomial(levels=1)", "binomial(levels=2)"))


@pytest.mark.slow
def test_optimality_rows_hold_the_plan_beside_the_exhaustive_oracle():
    # a 2-block MLP: 16 assignments and 4 whole-step ones, a few seconds of compiles
    from benchmarks import optimality

    rows = optimality.run_one("mlp", 2, 3, lambda msg: None)
    keys = {"model", "depth", "budget", "plan_ms", "oracle_ms", "ratio", "plan_temp_bytes",
            "oracle_min_temp_bytes", "limit_bytes"}
    assert [r["budget"] for r in rows] == list(optimality.BUDGETS)
    for r in rows:
        assert keys <= r.keys() and r["oracle_assignments"] == 4 ** 2 + 4
        if r["oracle_fitting"]:
            # the oracle found something that fits: so does the plan, within the limit
            assert r["plan"] is not None and r["plan_temp_bytes"] <= r["limit_bytes"]
            assert r["ratio"] > 0 and r["plan_ms"] > 0 and r["oracle_ms"] > 0
        if r["plan"] is None:
            assert r["ratio"] is None
    lean = rows[0]
    assert lean["budget"] == 0 and lean["plan_temp_bytes"] <= 1.01 * lean["oracle_min_temp_bytes"]
    assert optimality.markdown(rows).count("\n") == 2 + len(rows)


def test_recompute_prices_beside_measured_steps():
    from benchmarks.recompute import rows, table

    argv = ["mlp", "--depth", "2", "--width", "64", "--batch-size", "32", "--repeat", "1"]
    found = {r["option"]: r for r in rows(argv)}
    assert {"no_checkpoint", "nothing", "dots_no_batch", "dots", "names:mlp_hidden"} == set(found)
    assert found["no_checkpoint"]["measured_ms"] == 0.0 and found["no_checkpoint"]["predicted_ms"] == 0.0
    # relu's backward reads its output, so "nothing" recomputes the block's matmul; "dots"
    # keeps it, and recomputes only the relu
    assert found["nothing"]["predicted_ms"] > found["dots"]["predicted_ms"] > 0.0
    assert found["nothing"]["kept_bytes"] < found["dots"]["kept_bytes"]
    assert all(r["step_ms"] > 0 for r in found.values())
    assert table(list(found.values())).count("\n") == len(found) + 1


def test_a_result_file_says_how_it_was_made(tmp_path, monkeypatch):
    from benchmarks import results

    monkeypatch.setattr(results, "README", tmp_path / "README.md")  # the real README is left alone
    (tmp_path / "README.md").write_text("a\n<!-- result: docs/results/x.md -->\nold\n<!-- end result -->\n")
    path = results.write_result(str(tmp_path), "x", "| a |\n|---|\n| 1 |\n", ["--quick"], "benchmarks.x")
    assert path == tmp_path / "x.md"
    head, body = path.read_text().split("\n\n", 1)
    assert body == "| a |\n|---|\n| 1 |\n"
    fields = dict(line.rstrip().split(": ", 1) for line in head.splitlines())
    assert fields["Command"] == "`python -m benchmarks.x --quick`"
    assert fields["Commit"].strip("`") == results.COMMIT_AT_START
    assert "cores" in fields["Machine"] and "jax " in fields["Machine"]
    assert results.write_result("", "x", "| b |\n", []) is None
    # the README's copy names docs/results/x.md, which is not this file: it is left as it was
    assert "old" in (tmp_path / "README.md").read_text()
    copy = "<!-- result: docs/results/plans-quick.md -->\nold\n<!-- end result -->"
    assert results.readme_with_results(copy) == copy.replace(
        "old\n", results.body(results.RESULTS_DIR / "plans-quick.md"))


@pytest.mark.slow  # tests/test_planner_scanned.py plans scanned steps in the default run
def test_scanned_plan_tiny(capsys):
    from benchmarks import scanned_plan

    assert scanned_plan.main(["--depth", "3", "--width", "16", "--heads", "2", "--mlp", "32", "--vocab", "16",
                              "--batch", "2", "--seq", "8", "--runs", "1", "--results", ""]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["regions"] == 1 and out["fits"] and out["compiled"] <= 4
    assert out["plan_s"] > 0 and out["jit_s"] > 0


@pytest.mark.slow  # tests/test_planner_foreign_regions.py plans these steps in the default run
def test_foreign_plan_tiny(capsys):
    from benchmarks import foreign_plan

    assert foreign_plan.main(["--depth", "2", "--width", "16", "--batch", "16", "--rounds", "1",
                              "--results", ""]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].startswith("| step |") and len(rows) == 2 + len(foreign_plan.CASES)


@pytest.mark.slow
def test_attention_benchmark_tiny(capsys):
    from benchmarks import attention

    assert attention.main(["--seq", "32", "--dtypes", "float32", "--rounds", "1", "--steps", "1", "--results", ""]) == 0
    rows = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    variants = [row[1] for row in rows]
    assert variants[:2] == ["written out", "remat.ops, chunk 64"] and len(variants) >= 1 + len(attention.CHUNKS)
    assert all(float(row[2]) > 0 for row in rows)
    tiled = [float(row[3]) for row in rows if row[1].startswith("remat.ops")]
    assert all(t > 0 for t in tiled)


def test_hf_profile_sorts_both_frameworks_ops_into_the_same_kinds():
    from benchmarks import hf_profile

    assert hf_profile.hlo_kind_name("wrapped_tanh.2") == "tanh"
    assert hf_profile.hlo_kind_name("add_select_fusion.3.1") == "add_select_fusion"
    xla = {"ynn_fusion": 10.0, "dot": 2.0, "copy_bitcast_fusion": 3.0, "subtract_exponential_fusion": 4.0,
           "transpose": 1.0, "reduce": 0.5}
    torch = {"aten::mm": 8.0, "aten::_scaled_dot_product_flash_attention_for_cpu": 2.0, "aten::mul": 1.0,
             "aten::copy_": 0.5, "autograd::engine": 0.25}
    xla_kinds = hf_profile.by_kind(xla, hf_profile._XLA_KINDS)
    torch_kinds = hf_profile.by_kind(torch, hf_profile._TORCH_KINDS)
    assert xla_kinds["matrix products"] == 12.0 and xla_kinds["data movement"] == 4.0
    assert xla_kinds["element-wise and reductions"] == 4.5 and xla_kinds["attention"] == 0.0
    assert torch_kinds == {"matrix products": 8.0, "attention": 2.0, "element-wise and reductions": 1.0,
                           "data movement": 0.5, "other": 0.25}
    table = hf_profile.markdown(torch, xla)
    assert "| matrix products | 8 | 12 | 1.50 |" in table and "| total | 12 | 20 | 1.74 |" in table


def test_dot_backends_table_is_the_median_over_rounds_against_torch():
    from benchmarks import dot_backends

    shapes = {"up": (4, 3, 5)}
    runs = {"xla: YNNPACK (default)": [{"ms": {"up": t}, "ynnpack": True} for t in (3.0, 1.0, 2.0)],
            "torch: aten::mm": [{"ms": {"up": t}} for t in (4.0, 8.0, 5.0)]}
    rows = dot_backends.table(runs, shapes).splitlines()
    assert rows[2] == "| xla: YNNPACK (default) | yes | 2.0 (0.40) |"
    assert rows[3] == "| torch: aten::mm | - | 5.0 (1.00) |"


@pytest.mark.slow
def test_dot_backends_quick_round_selects_each_backend(capsys):
    from benchmarks import dot_backends

    assert dot_backends.main(["--quick", "--rounds", "1", "--calls", "1", "--results", ""]) == 0
    # the table's rows after its header (the separator row starts "|---")
    rows = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert {row[0]: row[1] for row in rows} == {
        "xla: YNNPACK (default)": "yes", "xla: oneDNN": "no", "xla: own emitter": "no", "torch: aten::mm": "-"}
    assert all(float(cell.split()[0]) > 0 for row in rows for cell in row[2:])

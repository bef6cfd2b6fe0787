"""Low-precision cross-checks: bfloat16 and mixed precision judged against a float64 reference."""
from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from remat.cli import main  # noqa: E402
from remat.crosscheck import autocast, compare_gradients, compare_training  # noqa: E402
from remat.crosscheck.outputs import jax_sum  # noqa: E402
from remat.crosscheck.precision import EPS, precision_row, relative_error  # noqa: E402
from remat.crosscheck.precision_runs import EXACT_ROUNDING  # noqa: E402
from remat.models import HF_MODELS, MODELS, RematSettings  # noqa: E402

SLOW = [("cnn", MODELS), ("llama", HF_MODELS), ("gpt2", HF_MODELS), ("resnet", HF_MODELS)]
ROW_KEYS = {"mode", "kind", "name", "shape", "dtype", "err_jax", "err_torch", "err_cross", "eps", "ok"}


def test_relative_error_is_normwise_and_flags_mismatches():
    ref = np.array([3.0, 4.0])
    assert relative_error(ref, ref) == 0.0
    assert relative_error(np.array([3.0, 4.5]), ref) == pytest.approx(0.1)  # ||(0, .5)|| / ||(3, 4)||
    assert relative_error(np.zeros(3), np.zeros(2)) == math.inf  # shape
    assert relative_error(np.array([np.nan, 4.0]), ref) == math.inf  # finiteness
    assert relative_error(np.ones(2), np.zeros(2)) == math.inf


def test_criterion_factor_two_and_the_storage_floor():
    ref = np.ones(4)
    # twice torch's error passes, a bit more fails
    assert precision_row("train", "param", "w", ref * 1.02, ref * 1.01, ref, "bfloat16").ok
    assert not precision_row("train", "param", "w", ref * 1.0201, ref * 1.01, ref, "bfloat16").ok
    # both within a bfloat16 rounding: passes although torch happens to be exact
    tiny = precision_row("train", "output", "y", ref * (1 + 2 ** -8), ref, ref, "bfloat16")
    assert tiny.ok and tiny.err_torch == 0.0 and tiny.eps == EPS["bfloat16"] == 2 ** -8
    # a float32 master weight gets float32's floor: the same gap fails there
    assert not precision_row("train", "param", "w", ref * (1 + 2 ** -8), ref, ref, "float32").ok


@pytest.fixture(scope="module")
def mlp_bf16():
    jm, tm, x = MODELS["mlp"].build()
    return compare_gradients(jm, tm, x, dtype="bfloat16")


def test_mlp_bfloat16_gradients_match_torch_bit_for_bit(mlp_bf16):
    r = mlp_bf16
    assert r.ok and r.precision == "bfloat16" and r.check == "gradients"
    kinds = {row.kind for row in r.rows}
    assert kinds == {"output", "param", "input"}
    for row in r.rows:
        assert row.dtype == "bfloat16"
        # matmuls add their bias before rounding, as torch's addmm: the runs agree exactly
        assert row.err_cross == 0.0
        assert row.err_jax == row.err_torch
    # real bfloat16 errors, a few ulps (2**-8 = 3.9e-3), not float32's
    assert 1e-3 < max(row.err_jax for row in r.rows) < 3e-2
    d = r.to_dict()
    assert set(d["rows"][0]) == ROW_KEYS and d["criterion"] == "err_jax <= 2 * max(err_torch, eps)"
    assert d["distribution"]["err_jax"]["max"] == pytest.approx(r.max_rel)


def test_the_input_gradient_is_as_close_as_torchs(mlp_bf16):
    """XLA rounded x @ w to bfloat16 before adding the bias; one ReLU flipped: 9.3e-2 against 5.3e-3."""
    (row,) = [r for r in mlp_bf16.rows if r.kind == "input"]
    assert row.err_jax < 1e-2 and row.ok


@pytest.mark.slow
def test_transformer_mixed_gradients_and_training():
    entry = MODELS["transformer"]
    jm, tm, x = entry.build()
    r = compare_gradients(jm, tm, x, precision="mixed")
    assert r.ok, str(r)
    params = [row for row in r.rows if row.kind == "param"]
    assert params and all(row.dtype == "float32" for row in params)  # float32 master weights' gradients
    out = [row for row in r.rows if row.kind == "output"]
    assert out[0].dtype == "bfloat16"  # autocast's lm head
    assert max(row.err_jax for row in r.rows) < 2e-2
    t = compare_training(jm, tm, x, entry.example_targets(), steps=2, precision="mixed")
    assert t.check == "training" and t.steps == 2 and len(t.losses["reference"]) == 2
    loss_row = t.rows[0]
    assert loss_row.kind == "loss" and loss_row.err_jax < 1e-3
    # the same forward as autocast's, op by op: the first losses are equal; the second is computed at
    # each run's own weights after a step, whose rounding luck the seed study measures (docs/crosscheck.md)
    assert t.losses["jax"][0] == t.losses["torch"][0]


@pytest.mark.slow  # test_cli_table trains the MLP in mixed precision (compare_training, --steps 2) by default
def test_mlp_mixed_training_passes_with_float32_weights():
    entry = MODELS["mlp"]
    jm, tm, x = entry.build()
    t = compare_training(jm, tm, x, entry.example_targets(), steps=3, precision="mixed")
    assert t.ok, str(t)
    assert {row.dtype for row in t.rows if row.kind == "param"} == {"float32"}
    assert all(abs(a - b) < 0.05 for a, b in zip(t.losses["jax"], t.losses["reference"]))


def _jax_bf16_grads(name: str, settings: RematSettings, precision: str, exact: bool = True):
    from remat.crosscheck.harness import _channels_last, _inputs

    jm, _, xs = (MODELS.get(name) or HF_MODELS[name]).build(remat=settings)
    model = autocast.jax_model(jm, precision)
    graphdef, state = nnx.split(model)
    xs = autocast.jax_inputs(_inputs(xs), "bfloat16", _channels_last(jm, None))

    def grads(state, *xs):
        return jax.grad(lambda s: jax_sum(nnx.merge(graphdef, s)(*xs)))(state)

    options = EXACT_ROUNDING if exact else None
    return jax.tree.leaves(jax.jit(grads, compiler_options=options)(state, *xs))


# the MLP in the default run; the transformer (its mixed and excess-precision cases stay) is slow
@pytest.mark.parametrize("name", ["mlp", pytest.param("transformer", marks=pytest.mark.slow)])
def test_checkpointed_and_unchecked_bfloat16_runs_are_bitwise_equal(name):
    plain = _jax_bf16_grads(name, RematSettings.none(), "bfloat16")
    for settings in (RematSettings(), RematSettings(policy="dots")):
        ckpt = _jax_bf16_grads(name, settings, "bfloat16")
        for a, b in zip(ckpt, plain, strict=True):
            assert a.dtype == b.dtype == jnp.bfloat16 and np.array_equal(np.asarray(a), np.asarray(b))


# slow: in the default run, test_checkpointed_and_unchecked_bfloat16_runs_are_bitwise_equal shows the
# MLP's bfloat16 gradients bitwise equal with and without checkpoints (so are its trained weights),
# and test_cli_table trains it through the command
@pytest.mark.slow
@pytest.mark.parametrize("name,rows", [("mlp", 9), ("transformer", 30)])
def test_checkpointed_and_plain_bfloat16_training_end_on_the_same_weights(name, rows):
    """3 AdamW steps in bfloat16: every trained weight's error (and loss) identical."""
    entry = MODELS[name]
    errors = []
    for settings in (RematSettings.none(), RematSettings()):
        config = entry.make_config(settings)
        jm, tm, x = entry.factory(config, 0)
        report = compare_training(jm, tm, x, entry.example_targets(config, 0), steps=3, precision="bfloat16")
        errors.append([(r.name, r.err_jax) for r in report.rows])
    assert errors[0] == errors[1] and len(errors[0]) == rows


@pytest.mark.slow
@pytest.mark.parametrize("name,registry", SLOW, ids=[n for n, _ in SLOW])
def test_heavier_twins_checkpointed_bfloat16_gradients_are_bitwise_equal(name, registry):
    if registry is HF_MODELS:
        pytest.importorskip("transformers")
    plain = _jax_bf16_grads(name, RematSettings.none(), "bfloat16")
    ckpt = _jax_bf16_grads(name, RematSettings(), "bfloat16")
    for a, b in zip(ckpt, plain, strict=True):
        assert a.dtype == b.dtype == jnp.bfloat16 and np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_mixed_checkpointing_moves_only_float32_sums_by_float32_ulps():
    """Mixed: the float32 gradients of the residual stream (embeddings, ln2.scale) sum in another order."""
    plain = _jax_bf16_grads("transformer", RematSettings.none(), "mixed")
    ckpt = _jax_bf16_grads("transformer", RematSettings(), "mixed")
    differ = 0
    for a, b in zip(ckpt, plain, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        differ += not np.array_equal(a, b)
        assert np.max(np.abs(a - b)) <= 2 ** -21 * np.max(np.abs(b))  # a few float32 ulps
    assert 0 < differ <= 4 < len(plain)


@pytest.mark.slow
def test_with_xla_excess_precision_checkpointing_moves_bfloat16_by_an_ulp():
    """XLA's default keeps bfloat16 values in float32 inside a fusion; a checkpoint ends fusions."""
    plain = _jax_bf16_grads("transformer", RematSettings.none(), "bfloat16", exact=False)
    ckpt = _jax_bf16_grads("transformer", RematSettings(), "bfloat16", exact=False)
    worst = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                / float(np.max(np.abs(np.asarray(b, np.float64)))) for a, b in zip(ckpt, plain, strict=True))
    assert 0 < worst <= 2 ** -7  # differs, by about one bfloat16 ulp of the tensor's largest entry


def test_autocast_rules_on_the_jax_side():
    jm, _, _ = MODELS["transformer"].build()
    mixed = autocast.jax_model(jm, "mixed")
    assert mixed.head.dtype == jnp.bfloat16 and mixed.head.kernel[...].dtype == jnp.float32
    assert mixed.wte.embedding[...].dtype == jnp.float32  # embeddings stay float32 under autocast
    bf16 = autocast.jax_model(jm, "bfloat16")
    assert bf16.head.kernel[...].dtype == jnp.bfloat16
    assert jm.head.dtype is None and type(jm.head) is nnx.Linear  # the original is untouched


def test_cli_json_rows_and_exit_codes(capsys, tmp_path):
    assert main(["crosscheck", "mlp", "--dtype", "bfloat16", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ok"] and d["precision"] == "bfloat16"
    assert d["gradients"]["rows"] and all(set(r) == ROW_KEYS for r in d["gradients"]["rows"])
    # a JAX twin 5% off: 10x torch's own bfloat16 error, exit 1
    factory = tmp_path / "off.py"
    factory.write_text(
        "from remat.models import MODELS\n"
        "def build():\n"
        "    jm, tm, x = MODELS['mlp'].build()\n"
        "    jm.head.kernel.set_value(jm.head.kernel[...] * 1.05)\n"
        "    return jm, tm, x\n")
    assert main(["crosscheck", f"{factory}:build", "--precision", "mixed", "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    bad = [r for r in d["gradients"]["rows"] if not r["ok"]]
    assert bad and all(r["err_jax"] > 2 * max(r["err_torch"], r["eps"]) for r in bad)
    assert any(r["name"] == "output" for r in bad)


def test_cli_rejects_mixed_options(capsys):
    assert main(["crosscheck", "mlp", "--precision", "mixed", "--dtype", "float64"]) == 2
    assert main(["crosscheck", "mlp", "--dtype", "bfloat16", "--rtol", "1e-2"]) == 2
    assert "--rtol/--atol do not apply" in capsys.readouterr().err


def test_cli_table(capsys):
    assert main(["crosscheck", "mlp", "--precision", "mixed", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "err_jax" in out and "float64 reference" in out and "PASS: mlp" in out and "median" in out




@pytest.mark.slow
@pytest.mark.parametrize("name,registry", SLOW, ids=[n for n, _ in SLOW])
@pytest.mark.parametrize("precision", ["bfloat16", "mixed"])
def test_heavier_twins_pass_the_criterion(name, registry, precision):
    if registry is HF_MODELS:
        pytest.importorskip("transformers")
    jm, tm, x = registry[name].build()
    r = compare_gradients(jm, tm, x, precision=precision)
    assert r.ok, str(r)
    assert 1e-3 < r.distribution()["err_jax"]["median"] < 2e-2


@pytest.mark.slow
def test_precision_benchmark_rows():
    from benchmarks.precision import PRECISIONS, measure, table

    sizes = {"vocab": 16, "depth": 1, "width": 16, "heads": 2, "seq_len": 8, "batch": 4}
    rows = measure(sizes, repeats=1)
    by = {(r["framework"], r["precision"]): r for r in rows}
    assert set(by) == {(f, p) for f in ("jax", "torch") for p in PRECISIONS}
    assert all(r["step_ms"] > 0 and r["memory_bytes"] > 0 for r in rows)
    # bfloat16 activations are half the bytes of float32 ones in what torch saves
    assert by[("torch", "bfloat16")]["memory_bytes"] < 0.75 * by[("torch", "float32")]["memory_bytes"]
    assert table(rows).count("\n") == 1 + len(PRECISIONS)


def test_a_failing_trained_weight_counts_adams_far_steps():
    from remat.crosscheck.precision_runs import _far_steps_note

    key = ("train", "param", "w")
    ref = np.ones(32)
    jax_w, torch_w = ref.copy(), ref + 1e-3
    jax_w[3] -= 0.02  # one entry stepped the other way: 2 lr off
    row = precision_row(*key, jax_w, torch_w, ref, "float32")
    assert not row.ok and row.err_jax == pytest.approx(0.02 / np.sqrt(32))
    note = _far_steps_note(row, {key: jax_w}, {key: torch_w}, {key: ref}, lr=0.01)
    assert note.startswith("w: entries more than lr/2 from the reference: jax 1, torch 0 of 32")


def test_seed_study_counts_both_sides_failures():
    from benchmarks.precision_seeds import summarize, table

    rows = [{"seed": 0, "name": "a", "err_jax": 3e-2, "err_torch": 1e-2, "eps": 2.0 ** -8},  # JAX fails
            {"seed": 0, "name": "b", "err_jax": 1e-2, "err_torch": 1e-2, "eps": 2.0 ** -8},
            {"seed": 1, "name": "a", "err_jax": 1e-3, "err_torch": 9e-3, "eps": 2.0 ** -8},  # torch fails the mirror
            {"seed": 1, "name": "b", "err_jax": 1e-3, "err_torch": 3e-3, "eps": 2.0 ** -8}]  # under 2 * eps: passes
    s = summarize(rows)
    assert s["jax_fails"] == {0: ["a"]} and s["torch_fails"] == {1: ["a"]}
    assert s["geomean"] == pytest.approx((3 * 1 * (1 / 9) * (1 / 3)) ** 0.25)
    assert s["beyond_2x"] == 0.25 and s["below_half"] == 0.5
    assert "| x:bfloat16 | 2 | 1 (seeds 0) | 1 (seeds 1) |" in table({"x:bfloat16": s})


def test_bfloat16_layernorm_parameter_gradients_are_the_exact_sums_rounded_once():
    """Why remat's LayerNorm parameter gradients beat torch's in bfloat16 (docs/crosscheck.md): the
    cross-check's norm modules sum in float32 and round once; torch's bfloat16 kernel rounds more."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 32)) * 2, jnp.bfloat16)
    ct = jnp.asarray(rng.standard_normal((16, 32)), jnp.bfloat16)
    ln = autocast.jax_model(nnx.LayerNorm(32, rngs=nnx.Rngs(0)), "bfloat16")
    graphdef, state = nnx.split(ln)
    grads = jax.jit(lambda s: jax.vjp(lambda s: nnx.merge(graphdef, s)(x), s)[1](ct)[0],
                    compiler_options=EXACT_ROUNDING)(state)
    exact = np.asarray(ct, np.float64).sum(axis=0)
    assert np.array_equal(np.asarray(grads["bias"][...]), np.asarray(jnp.asarray(exact, jnp.bfloat16)))
    tln = torch.nn.LayerNorm(32).to(torch.bfloat16)
    tln(torch.tensor(np.asarray(x, np.float32)).to(torch.bfloat16)).backward(
        torch.tensor(np.asarray(ct, np.float32)).to(torch.bfloat16))
    ours = relative_error(np.asarray(grads["bias"][...], np.float64), exact)
    assert ours <= 2.0 ** -9 < relative_error(tln.bias.grad.double().numpy(), exact)

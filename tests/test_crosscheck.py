"""remat.crosscheck: the converter, the gradient comparison and the ``remat crosscheck`` command."""
from __future__ import annotations

import json
import sys

import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from remat.cli import main  # noqa: E402
from remat.crosscheck import (  # noqa: E402
    StateDictMismatchError,
    compare_gradients,
    load_torch_state,
    to_nnx_layout,
    to_torch_layout,
    torch_checkpoint,
    torch_names,
)
from remat.models import MODELS, mlp, transformer  # noqa: E402


@pytest.fixture(scope="module")
def built():
    """Every built-in model, built once (compare_gradients never changes them)."""
    return {name: entry.build() for name, entry in MODELS.items()}


# --- load_torch_state: every converter -------------------------------------------------

class Convs(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 5, kernel_size=(3, 2), rngs=rngs)
        self.conv1d = nnx.Conv(2, 4, kernel_size=(3,), rngs=rngs)
        self.ln = nnx.LayerNorm(5, rngs=rngs)
        self.emb = nnx.Embed(7, 5, rngs=rngs)
        self.bn = nnx.BatchNorm(5, rngs=rngs)
        self.layers = nnx.data([nnx.Linear(5, 6, rngs=rngs), nnx.Linear(6, 2, use_bias=False, rngs=rngs)])


def _torch_convs():
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.conv = torch.nn.Conv2d(3, 5, (3, 2))
    m.conv1d = torch.nn.Conv1d(2, 4, 3)
    m.ln = torch.nn.LayerNorm(5)
    m.emb = torch.nn.Embedding(7, 5)
    m.bn = torch.nn.BatchNorm2d(5)
    m.layers = torch.nn.ModuleList([torch.nn.Linear(5, 6), torch.nn.Linear(6, 2, bias=False)])
    with torch.no_grad():
        for p in [*m.parameters(), m.bn.running_mean, m.bn.running_var]:
            p.copy_(torch.randn_like(p).abs() + 0.1)
    return m


def test_every_layout_converts():
    tm = _torch_convs()
    jm = nnx.eval_shape(lambda: Convs(nnx.Rngs(0)))  # abstract: loading fills every variable
    report = load_torch_state(jm, tm)
    assert report.ok and len(report.loaded) == 14  # num_batches_tracked ignored
    sd = {k: v.numpy() for k, v in tm.state_dict().items()}
    np.testing.assert_array_equal(jm.conv.kernel[...], sd["conv.weight"].transpose(2, 3, 1, 0))  # OIHW -> HWIO
    np.testing.assert_array_equal(jm.conv1d.kernel[...], sd["conv1d.weight"].transpose(2, 1, 0))
    np.testing.assert_array_equal(jm.conv.bias[...], sd["conv.bias"])
    np.testing.assert_array_equal(jm.ln.scale[...], sd["ln.weight"])
    np.testing.assert_array_equal(jm.emb.embedding[...], sd["emb.weight"])
    np.testing.assert_array_equal(jm.bn.scale[...], sd["bn.weight"])
    np.testing.assert_array_equal(jm.bn.mean[...], sd["bn.running_mean"])
    np.testing.assert_array_equal(jm.bn.var[...], sd["bn.running_var"])
    np.testing.assert_array_equal(jm.layers[0].kernel[...], sd["layers.0.weight"].T)
    np.testing.assert_array_equal(jm.layers[1].kernel[...], sd["layers.1.weight"].T)


def test_layout_round_trip_and_names():
    a = np.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5)
    np.testing.assert_array_equal(to_torch_layout("kernel", to_nnx_layout("kernel", a)), a)
    assert to_nnx_layout("bias", a) is a
    names = torch_names(nnx.eval_shape(lambda: transformer.Transformer(transformer.TransformerConfig(),
                                                                        rngs=nnx.Rngs(0))))
    assert names["blocks.0.attn.qkv.weight"] == "blocks/0/attn/qkv/kernel"
    assert names["wte.weight"] == "wte/embedding" and names["ln_f.weight"] == "ln_f/scale"


def test_numpy_state_dict_and_dtype():
    lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    w, b = np.ones((2, 3), np.float64), np.arange(2.0)
    load_torch_state(lin, {"weight": w, "bias": b})
    assert lin.kernel[...].dtype == jnp.float32 and lin.kernel[...].shape == (3, 2)
    with jax.enable_x64(True):
        load_torch_state(lin, {"weight": w, "bias": b}, dtype=jnp.float64)
        assert lin.kernel[...].dtype == jnp.float64


def test_errors_name_everything_at_once_and_copy_nothing():
    jm = mlp.MLP(mlp.MLPConfig(), rngs=nnx.Rngs(0))
    before = jax.tree.map(np.asarray, nnx.state(jm))
    sd = dict(mlp.make_torch_model(mlp.MLPConfig()).state_dict())
    del sd["head.bias"]                                   # missing
    sd["extra.weight"] = torch.zeros(3)                   # unexpected
    sd["blocks.1.linear.weight"] = torch.zeros(32, 31)    # mis-shaped
    with pytest.raises(StateDictMismatchError) as info:
        load_torch_state(jm, sd)
    msg = str(info.value)
    assert "\n" not in msg
    for name in ("head.bias", "extra.weight", "blocks.1.linear.weight", "nothing copied", "rename="):
        assert name in msg
    assert info.value.missing == ["head.bias"] and info.value.unexpected == ["extra.weight"]
    after = jax.tree.map(np.asarray, nnx.state(jm))
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(x, y)


def test_non_strict_copies_what_matches():
    jm = mlp.MLP(mlp.MLPConfig(), rngs=nnx.Rngs(0))
    tm = mlp.make_torch_model(mlp.MLPConfig())
    sd = dict(tm.state_dict())
    del sd["head.bias"]
    sd["extra.weight"] = torch.zeros(3)
    sd["inp.weight"] = torch.zeros(5, 5)
    with pytest.warns(UserWarning, match="square weights blocks.0.linear.weight.*by a guess"):
        report = load_torch_state(jm, sd, strict=False)  # a bare state dict: orientation guessed
    assert not report.ok
    assert report.missing == ["head.bias"] and report.unexpected == ["extra.weight"]
    assert report.mismatched == ["inp.weight"]
    assert "head.weight" in report.loaded and "missing (1): head.bias" in str(report)
    np.testing.assert_array_equal(jm.head.kernel[...], tm.head.weight.detach().numpy().T)


def test_rename_mapping_and_function():
    jm = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    sd = {"fc.weight": np.ones((2, 3)), "fc.bias": np.zeros(2), "drop.me": np.zeros(1)}
    load_torch_state(jm, sd, rename=lambda k: None if k == "drop.me" else k.removeprefix("fc."))
    np.testing.assert_array_equal(jm.kernel[...], np.ones((3, 2)))
    load_torch_state(jm, {"w": np.full((2, 3), 2.0), "bias": np.zeros(2)}, rename={"w": "weight"})
    np.testing.assert_array_equal(jm.kernel[...], np.full((3, 2), 2.0))
    with pytest.raises(TypeError, match="rename"):
        load_torch_state(jm, sd, rename=3)
    with pytest.raises(TypeError, match="torch.nn.Module or a state dict"):
        load_torch_state(jm, [1, 2])


# --- compare_gradients -----------------------------------------------------------------

# the transformer (the slowest) with the slow cases; its policies are checked by the command below.
# The CNN too: test_loss_mode_checkpoint_and_layout_options compares it in the default run (in
# float64, in eval mode and in train mode), and the other models float32
@pytest.mark.parametrize("name", [n if n not in ("cnn", "transformer") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in MODELS])
def test_every_model_float32(built, name):
    report = compare_gradients(*built[name])
    assert report.ok, str(report)
    kinds = {r.kind for r in report.rows}
    assert {"weight", "output", "param"} <= kinds
    if name == "transformer":
        assert "input" not in kinds  # token ids: no input gradient
    else:
        assert "input" in kinds
    if name == "cnn":
        assert {r.mode for r in report.rows} == {"init", "train", "eval"} and "buffer" in kinds


# the first seed's model and the MLP fast; the second seed's (two linear layers around a
# checkpointed ReLU method: test_every_model_float32 compares it in the default run), the CNN and
# the transformer in float64 with the slow cases
@pytest.mark.parametrize("name", [n if n not in ("seed-mymodel", "cnn", "transformer")
                                  else pytest.param(n, marks=pytest.mark.slow) for n in MODELS])
def test_every_model_float64_is_tight(built, name):
    report = compare_gradients(*built[name], dtype="float64")
    assert report.ok and report.rtol == 1e-10, str(report)
    assert max(r.max_abs for r in report.rows) < 1e-11
    assert jnp.asarray(1.0).dtype == jnp.float32  # x64 did not leak


def test_perturbed_weight_is_caught():
    jm, tm, inputs = mlp.build(mlp.MLPConfig(activation="tanh"))  # smooth: every gradient moves
    jm.blocks[1].linear.kernel[...] = jm.blocks[1].linear.kernel[...].at[0, 0].add(1e-3)
    report = compare_gradients(jm, tm, inputs, dtype="float64")
    assert not report.ok
    failed = {(r.kind, r.name) for r in report.failures}
    assert ("weight", "blocks.1.linear.weight") in failed  # the starting weights differ, named
    assert ("param", "blocks.1.linear.weight") in failed and ("output", "output") in failed
    assert not any(name == "blocks.0.linear.bias" for kind, name in failed if kind == "weight")
    assert "FAIL" in str(report)


def test_rename_in_comparisons():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.layer = nnx.Linear(4, 3, rngs=rngs)

        def __call__(self, x):
            return jnp.tanh(self.layer(x))

    torch.manual_seed(0)
    tm = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
    jm = Net(nnx.Rngs(0))
    rename = {"0.weight": "layer.weight", "0.bias": "layer.bias"}
    load_torch_state(jm, tm, rename=rename)
    x = np.ones((2, 4), np.float32)
    assert compare_gradients(jm, tm, (x,), rename=rename).ok
    assert not compare_gradients(jm, tm, (x,)).ok  # without it, nothing pairs up


def test_report_json_and_table(built):
    report = compare_gradients(*built["seed-model"])
    data = json.loads(report.to_json())
    assert data["ok"] is True and data["dtype"] == "float32"
    assert {r["name"] for r in data["rows"]} >= {"output", "fc1.weight", "fc2.bias", "input[0]"}
    assert "fc2.weight" in str(report) and "max rel err" in str(report)


def test_loss_mode_checkpoint_and_layout_options(built):
    jm, tm, inputs = built["cnn"]
    r = compare_gradients(jm, tm, inputs, loss=lambda y: (y ** 2).sum(), mode="eval", dtype="float64")
    assert r.ok and {row.mode for row in r.rows} == {"init", "eval"}
    r = compare_gradients(jm, tm, inputs, loss=(lambda y: jnp.sum(y ** 3), lambda y: (y ** 3).sum()),
                          mode="train", checkpoint="dots", dtype="float64")
    assert r.ok, str(r)
    ref = [row for row in r.rows if row.kind == "input"][0]
    assert ref.shape == inputs[0].shape  # compared in torch's NCHW layout
    with pytest.raises(ValueError, match="layout"):
        compare_gradients(jm, tm, inputs, layout="HWCN")
    with pytest.raises(ValueError, match="mode"):
        compare_gradients(jm, tm, inputs, mode="test")
    with pytest.raises(ValueError, match="dtype"):
        compare_gradients(jm, tm, inputs, dtype="float16")


def test_torch_checkpoint_updates_batchnorm_once():
    import torch.utils.checkpoint as tuc

    x = torch.randn(6, 3, requires_grad=True)
    plain, ours = torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3)
    tuc.checkpoint(plain, x, use_reentrant=False).sum().backward()
    torch_checkpoint(ours, x).sum().backward()
    assert int(plain.num_batches_tracked) == 2  # PyTorch's recomputation updates again
    assert int(ours.num_batches_tracked) == 1
    ref = torch.nn.BatchNorm1d(3)
    ref(x)
    torch.testing.assert_close(ours.running_mean, ref.running_mean)


# --- the command -----------------------------------------------------------------------

def test_cli_builtin_and_json(capsys):
    assert main(["crosscheck", "seed-model", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["policy"] == "nothing" and data["gradients"]["rows"]
    assert main(["crosscheck", "mlp", "--policy", "names", "--blocks", "0"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "blocks 0" in out


# "names" (the transformer tags its blocks) fast, the other policies slow
@pytest.mark.parametrize("policy", [p if p == "names" else pytest.param(p, marks=pytest.mark.slow) for p in
                                    ["nothing", "everything", "dots", "dots_no_batch", "names", "no_checkpoint"]])
def test_cli_every_policy_on_the_transformer(policy, capsys):
    assert main(["crosscheck", "transformer", "--policy", policy, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("policy", ["nothing", "everything", "dots", "dots_no_batch", "names", "no_checkpoint"])
@pytest.mark.parametrize("name", list(MODELS))
def test_cli_full_matrix(name, policy, dtype, capsys):
    assert main(["crosscheck", name, "--policy", policy, "--dtype", dtype, "--json"]) == 0, capsys.readouterr().out


@pytest.mark.slow  # test_cli_user_factory trains through the command in the fast suite
def test_cli_training(capsys):
    assert main(["crosscheck", "cnn", "--steps", "2", "--optimizer", "sgd", "--dtype", "float64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["training"]["ok"] and len(data["training"]["jax_losses"]) == 2


def test_cli_usage_errors(capsys, tmp_path):
    assert main(["crosscheck", "vgg"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'vgg'" in err and "transformer" in err and "seed-mymodel" in err
    assert main(["crosscheck", "nofile.py:make"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["crosscheck", "a:b:c"]) == 2
    assert "malformed factory" in capsys.readouterr().err
    bad = tmp_path / "bad.py"
    bad.write_text("def make():\n    return 3\n")
    assert main(["crosscheck", f"{bad}:make"]) == 2
    assert "must return (jax_model, torch_model, example_inputs" in capsys.readouterr().err
    assert main(["crosscheck", "mlp", "--blocks", "x"]) == 2
    assert main(["crosscheck", "mlp", "--steps", "-1"]) == 2


def test_cli_without_torch(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)
    assert main(["crosscheck", "mlp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install 'remat[torch]'" in err


FACTORY = '''
import numpy as np, torch
from flax import nnx
from remat.crosscheck import load_torch_state

class Net(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(4, 3, rngs=rngs)
    def __call__(self, x):
        return nnx.relu(self.fc(x))

class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
    def forward(self, x):
        return torch.relu(self.fc(x))

def make(PERTURB=0.0):
    torch.manual_seed(0)
    tm = TorchNet()
    jm = Net(nnx.Rngs(0))
    load_torch_state(jm, tm)
    jm.fc.bias[...] = jm.fc.bias[...] + PERTURB
    return jm, tm, (np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32),)

def make_bad():
    return make(PERTURB=0.1)

def make_with_remat(remat=None):
    assert remat is not None
    return make() + (np.zeros((5, 3), np.float32),)
'''


def test_cli_user_factory(tmp_path, capsys):
    f = tmp_path / "user_models.py"
    f.write_text(FACTORY)
    assert main(["crosscheck", f"{f}:make", "--policy", "dots", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["remat"] == "whole model, policy=dots"
    assert main(["crosscheck", f"{f}:make_with_remat", "--steps", "2", "--optimizer", "adam"]) == 0
    assert "placed by the factory" in capsys.readouterr().out
    assert main(["crosscheck", f"{f}:make_bad"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_cli_offers_the_library_names():
    from remat.cli import crosscheck as cli
    from remat.crosscheck import OPTIMIZERS
    from remat.policies import NO_CHECKPOINT, POLICY_NAMES

    assert cli.OPTIMIZERS is OPTIMIZERS  # one list, in remat._names
    assert set(POLICY_NAMES) <= set(cli.POLICIES) and NO_CHECKPOINT in cli.POLICIES

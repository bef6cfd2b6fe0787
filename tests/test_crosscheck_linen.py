"""remat.crosscheck on Linen modules and ``(apply_fn, params)`` pairs: loading into variables dicts, comparisons."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import linen  # noqa: E402

from remat.crosscheck import as_nnx, compare_gradients, compare_training, load_torch_state, torch_names  # noqa: E402

RNG = np.random.default_rng(0)


class ConvNet(linen.Module):
    """Explicit names, as torch's attributes: ``conv``, ``bn``, ``fc``."""

    @linen.compact
    def __call__(self, x, train: bool = True):
        x = linen.Conv(4, (3, 3), padding="VALID", name="conv")(x)
        x = linen.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, name="bn")(x)
        return linen.Dense(3, name="fc")(jax.nn.relu(x).mean(axis=(1, 2)))


class TorchConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


def _convnet():
    torch.manual_seed(0)
    tm = TorchConvNet()
    with torch.no_grad():  # running statistics that are not the defaults, so loading them shows
        tm.bn.running_mean.copy_(torch.randn(4))
        tm.bn.running_var.copy_(torch.rand(4) + 0.5)
        tm.bn.weight.copy_(torch.rand(4) + 0.5)
    net = ConvNet()
    # compiled: eager, each of the init's operations compiles alone (load_torch_state replaces the values)
    variables = jax.jit(lambda x: net.init(jax.random.key(0), x))(np.zeros((1, 6, 6, 2), np.float32))
    return net, variables, tm


def test_load_fills_a_new_linen_variables_dict():
    net, variables, tm = _convnet()
    before = jax.tree.map(np.asarray, variables)
    new, report = load_torch_state(variables, tm)
    assert report.ok and sorted(report.loaded) == sorted(
        ["conv.weight", "conv.bias", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var", "fc.weight",
         "fc.bias"])
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, variables), before)  # unchanged
    assert set(new) == {"params", "batch_stats"}
    hwio = tm.conv.weight.detach().numpy().transpose(2, 3, 1, 0)
    np.testing.assert_array_equal(new["params"]["conv"]["kernel"], hwio)
    np.testing.assert_array_equal(new["params"]["fc"]["kernel"], tm.fc.weight.detach().numpy().T)
    np.testing.assert_array_equal(new["batch_stats"]["bn"]["var"], tm.bn.running_var.numpy())
    x = RNG.standard_normal((2, 2, 6, 6)).astype(np.float32)
    out = jax.jit(lambda v, x: net.apply(v, x, train=False))(new, jnp.asarray(x.transpose(0, 2, 3, 1)))  # one program
    np.testing.assert_allclose(np.asarray(out), tm.eval()(torch.from_numpy(x)).detach().numpy(), rtol=0, atol=1e-6)
    assert torch_names(as_nnx((net, new)))["bn.running_mean"] == "batch_stats/bn/mean"


def test_compare_gradients_on_a_linen_module():
    net, variables, tm = _convnet()
    new, _ = load_torch_state(variables, tm)
    x = RNG.standard_normal((2, 2, 6, 6))
    model = as_nnx((net, new), train_kwargs={"train": True}, eval_kwargs={"train": False})
    report = compare_gradients(model, tm, (x,), dtype="float64", mode="eval")
    assert report.ok, str(report)
    kinds = {(r.kind, r.name) for r in report.rows}
    assert {("param", "conv.weight"), ("weight", "bn.running_var"), ("input", "input[0]")} <= kinds
    assert max(r.max_rel for r in report.rows) < 1e-12
    # a variables dict that was not loaded fails on its weights, by name
    bad = compare_gradients(as_nnx((net, variables), eval_kwargs={"train": False}), tm, (x,), mode="eval")
    assert {"conv.weight", "fc.weight"} <= {r.name for r in bad.failures if r.kind == "weight"}


def test_linen_train_mode_updates_batch_stats():
    net, variables, tm = _convnet()
    new, _ = load_torch_state(variables, tm)
    x = RNG.standard_normal((4, 2, 6, 6)).astype(np.float32)
    model = as_nnx((net.apply, new), train_kwargs={"train": True})
    # Linen's BatchNorm keeps the biased batch variance (torch: unbiased), hence the exclusion
    report = compare_training(model, tm, (x,), optimizer="sgd", lr=0.1, steps=3, exclude=["bn.running_var"])
    assert report.ok, str(report)
    assert report.excluded == ["bn.running_var"]
    mean = [r for r in report.rows if r.name == "bn.running_mean"]
    assert mean and mean[0].ok and mean[0].kind == "buffer"
    moved = copy.deepcopy(tm).train()
    moved(torch.from_numpy(x))  # the statistics did move, so the matching row compared an update
    assert not np.allclose(moved.bn.running_mean.numpy(), tm.bn.running_mean.numpy())


class MLP(linen.Module):
    """Linen's automatic names: ``Dense_0``, ``Dense_1``."""

    @linen.compact
    def __call__(self, x):
        x = jnp.tanh(linen.Dense(5)(x))
        return linen.Dense(3)(x)


def test_linen_auto_names_with_rename_train_like_torch():
    torch.manual_seed(1)
    tm = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    net = MLP()
    # one program, the key included, not one per operation
    variables = jax.jit(lambda x: net.init(jax.random.key(0), x))(np.zeros((1, 4), np.float32))

    def rename(name):
        index, leaf = name.split(".")
        return f"Dense_{int(index) // 2}.{leaf}"

    variables, report = load_torch_state(variables, tm, rename=rename)
    assert report.ok
    x, y = RNG.standard_normal((8, 4)), RNG.integers(0, 3, 8)
    grads = compare_gradients((net, variables), tm, (x,), dtype="float64", rename=rename)
    assert grads.ok, str(grads)
    assert {r.name for r in grads.rows if r.kind == "param"} == {
        "Dense_0.weight", "Dense_0.bias", "Dense_1.weight", "Dense_1.bias"}
    train = compare_training((net, variables), tm, (x.astype(np.float32),), y, optimizer="adam", steps=3,
                             rename=rename)
    assert train.ok, str(train)


class TorchTanh(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)  # square: the owner (nn.Linear) decides, no guess

    def forward(self, x):
        return torch.tanh(self.fc(x)) * 2


def test_apply_fn_and_params_pair():
    torch.manual_seed(2)
    tm = TorchTanh()

    def apply(params, x):
        return jnp.tanh(x @ params["fc"]["kernel"] + params["fc"]["bias"]) * 2

    params = {"fc": {"kernel": jnp.zeros((6, 6)), "bias": jnp.zeros(6)}}
    params, report = load_torch_state(params, tm)
    assert report.ok and set(params) == {"fc"}
    np.testing.assert_array_equal(params["fc"]["kernel"], tm.fc.weight.detach().numpy().T)
    x = RNG.standard_normal((3, 6))
    report = compare_gradients((apply, params), tm, (x,), dtype="float64")
    assert report.ok, str(report)
    assert max(r.max_rel for r in report.rows) < 1e-12
    assert compare_training((apply, params), tm, (x.astype(np.float32),), optimizer="adamw", steps=3).ok
    assert compare_gradients((apply, params), tm, (x,), checkpoint=True).ok  # remat.checkpoint on the pair
    with pytest.raises(TypeError, match=r"\(linen_module, variables\) or \(apply_fn, params\)"):
        compare_gradients(params, tm, (x,))

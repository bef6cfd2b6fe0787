"""Training parity: optax against torch.optim, same data and initial weights, N steps."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from remat.crosscheck import OPTIMIZERS, compare_training, make_optimizers  # noqa: E402
from remat.models import MODELS  # noqa: E402

STEPS = 3


@pytest.fixture(scope="module")
def built():
    return {name: (*MODELS[name].build(), MODELS[name].example_targets()) for name in ("mlp", "cnn")}


# --- the hyperparameter mapping, on one parameter vector --------------------------------

def _run_both(name, steps=4, **hp):
    """Final parameters of optax and torch.optim on the quadratic loss sum(a * p**2 + b * p)."""
    rng = np.random.default_rng(0)
    p0, a, b = rng.standard_normal(6), rng.random(6) + 0.5, rng.standard_normal(6)
    tp = torch.tensor(p0, requires_grad=True)
    tx, opt = make_optimizers(name, [tp], lr=0.1, **hp)
    for _ in range(steps):
        opt.zero_grad()
        (torch.tensor(a) * tp ** 2 + torch.tensor(b) * tp).sum().backward()
        opt.step()
    with jax.enable_x64(True):
        p = jnp.asarray(p0)
        state = tx.init(p)
        for _ in range(steps):
            g = 2 * a * p + b
            updates, state = tx.update(g, state, p)
            p = optax.apply_updates(p, updates)
        return np.asarray(p), tp.detach().numpy()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_mapping_is_exact(name):
    ours, theirs = _run_both(name, momentum=0.8, weight_decay=0.1)
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-14)


def test_adamw_decay_is_lr_times_wd_times_param():
    """With a zero gradient both AdamW steps are pure decay: p * (1 - lr * wd)."""
    p0 = np.array([1.0, -2.0, 3.0])
    tp = torch.tensor(p0, requires_grad=True)
    tp.grad = torch.zeros(3, dtype=torch.float64)
    tx, opt = make_optimizers("adamw", [tp], lr=0.1, weight_decay=0.5)
    opt.step()
    with jax.enable_x64(True):
        updates, _ = tx.update(jnp.zeros(3), tx.init(jnp.asarray(p0)), jnp.asarray(p0))
        ours = np.asarray(optax.apply_updates(jnp.asarray(p0), updates))
    np.testing.assert_allclose(tp.detach().numpy(), p0 * (1 - 0.1 * 0.5), rtol=1e-15)
    np.testing.assert_allclose(ours, p0 * (1 - 0.1 * 0.5), rtol=1e-15)


def test_adam_l2_weight_decay_is_a_chain():
    """torch Adam(weight_decay=wd) adds wd * p to the gradient: optax.chain(add_decayed_weights, adam)."""
    rng = np.random.default_rng(1)
    p0, g = rng.standard_normal(5), rng.standard_normal(5)
    tp = torch.tensor(p0, requires_grad=True)
    opt = torch.optim.Adam([tp], lr=0.1, weight_decay=0.3)
    tx = optax.chain(optax.add_decayed_weights(0.3), optax.adam(0.1))
    with jax.enable_x64(True):
        p, state = jnp.asarray(p0), tx.init(jnp.asarray(p0))
        for _ in range(3):
            tp.grad = torch.tensor(g)
            opt.step()
            updates, state = tx.update(jnp.asarray(g), state, p)
            p = optax.apply_updates(p, updates)
        np.testing.assert_allclose(np.asarray(p), tp.detach().numpy(), rtol=1e-12)


def test_sgd_dampening_has_no_optax_counterpart():
    """torch's dampening scales the gradient inside the buffer (after the first step):
    optax.sgd(momentum=...) does not, so the two differ; compare_training never sets it."""
    ours, _ = _run_both("momentum", momentum=0.8)
    tp = torch.tensor(np.random.default_rng(0).standard_normal(6), requires_grad=True)
    rng = np.random.default_rng(0)
    _, a, b = rng.standard_normal(6), rng.random(6) + 0.5, rng.standard_normal(6)
    opt = torch.optim.SGD([tp], lr=0.1, momentum=0.8, dampening=0.5)
    for _ in range(4):
        opt.zero_grad()
        (torch.tensor(a) * tp ** 2 + torch.tensor(b) * tp).sum().backward()
        opt.step()
    assert np.max(np.abs(ours - tp.detach().numpy())) > 1e-3


# --- models --------------------------------------------------------------------------

# the CNN with SGD fast (its running statistics compared too); the MLP trains in the fast run in
# test_training_parity_float32 (adam), and test_optimizer_mapping_is_exact and
# test_adamw_decay_is_lr_times_wd_times_param check every optimizer's step; the rest slow
FAST_FLOAT64 = {("cnn", "sgd")}


@pytest.mark.parametrize("name,optimizer", [
    pytest.param(n, o, id=f"{n}-{o}", marks=() if (n, o) in FAST_FLOAT64 else pytest.mark.slow)
    for n in ("mlp", "cnn") for o in OPTIMIZERS
])
def test_training_parity_float64(built, name, optimizer):
    jm, tm, inputs, targets = built[name]
    report = compare_training(jm, tm, inputs, targets, optimizer=optimizer, steps=STEPS, dtype="float64")
    assert report.ok, str(report)
    assert report.jax_losses[-1] < report.jax_losses[0]  # it trained
    if name == "cnn":
        assert any(r.kind == "buffer" for r in report.rows)  # running statistics compared


@pytest.mark.parametrize("optimizer", ["sgd", pytest.param("adamw", marks=pytest.mark.slow)])
def test_cnn_eval_mode_training(built, optimizer):
    jm, tm, inputs, targets = built["cnn"]
    report = compare_training(jm, tm, inputs, targets, optimizer=optimizer, steps=STEPS, dtype="float64",
                              mode="eval")
    assert report.ok and report.mode == "eval", str(report)
    assert not any(r.kind == "buffer" for r in report.rows)


@pytest.mark.parametrize("name", ["mlp", pytest.param("cnn", marks=pytest.mark.slow)])
def test_training_parity_float32(built, name):
    jm, tm, inputs, targets = built[name]
    report = compare_training(jm, tm, inputs, targets, optimizer="adam", steps=STEPS)
    assert report.ok and report.rtol == 1e-3, str(report)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["momentum", "nesterov", "adam"])
def test_cnn_eval_mode_training_more(built, optimizer):
    jm, tm, inputs, targets = built["cnn"]
    assert compare_training(jm, tm, inputs, targets, optimizer=optimizer, steps=STEPS, dtype="float64",
                            mode="eval").ok


@pytest.mark.slow
@pytest.mark.parametrize("name", ["seed-model", "seed-mymodel", "transformer"])
def test_other_models_train_alike(name):
    entry = MODELS[name]
    jm, tm, inputs = entry.build()
    report = compare_training(jm, tm, inputs, entry.example_targets(), optimizer="adamw", steps=STEPS,
                              dtype="float64")
    assert report.ok, str(report)


def test_training_report_and_errors(built):
    jm, tm, inputs, targets = built["mlp"]
    report = compare_training(jm, tm, inputs, None, optimizer="sgd", steps=2, dtype="float64")
    assert report.ok and len(report.torch_losses) == 2  # no targets: minimise mean(out ** 2)
    assert "loss curve" in str(report) and report.to_dict()["optimizer"] == "sgd"
    with pytest.raises(ValueError, match="unknown optimizer"):
        compare_training(jm, tm, inputs, targets, optimizer="lion")
    with pytest.raises(ValueError, match="steps"):
        compare_training(jm, tm, inputs, targets, steps=0)
    with pytest.raises(TypeError, match="pair"):
        compare_training(jm, tm, inputs, targets, loss=lambda out, y: out.sum())

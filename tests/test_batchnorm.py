"""remat.ops.BatchNorm (NNX) and LinenBatchNorm against torch.nn.BatchNorm2d: outputs, gradients, running stats."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

from remat.ops import BatchNorm, LinenBatchNorm

torch = pytest.importorskip("torch")

C = 3


def _torch_run(xs, weight, bias):
    """Two train-mode steps (outputs and input/weight/bias gradients of sum(y * y)), then eval."""
    bn = torch.nn.BatchNorm2d(C, momentum=0.1).double()
    with torch.no_grad():
        bn.weight.copy_(torch.from_numpy(weight))
        bn.bias.copy_(torch.from_numpy(bias))
    outs, grads = [], []
    for x in xs:
        xt = torch.tensor(x, requires_grad=True)
        y = bn(xt)
        (y * y).sum().backward()
        outs.append(y.detach().numpy())
        grads.append((xt.grad.numpy(), bn.weight.grad.numpy().copy(), bn.bias.grad.numpy().copy()))
        bn.weight.grad = bn.bias.grad = None
    bn.eval()
    evals = bn(torch.from_numpy(xs[0])).detach().numpy()
    return outs, grads, evals, bn.running_mean.numpy(), bn.running_var.numpy()


def _data():
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((4, C, 5, 5)) * 2 + 1 for _ in range(2)]
    return xs, rng.standard_normal(C), rng.standard_normal(C)


def _nhwc(x):
    return jnp.asarray(np.moveaxis(x, 1, -1))


def _nchw(y):
    return np.moveaxis(np.asarray(y), -1, 1)


def _check(ours, torch_result):
    outs, grads, evals, mean, var = torch_result
    for (y, g), (ty, tg) in zip(ours["train"], zip(outs, grads, strict=True), strict=True):
        np.testing.assert_allclose(_nchw(y), ty, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(_nchw(g[0]), tg[0], rtol=1e-10, atol=1e-12)  # input gradient
        np.testing.assert_allclose(g[1], tg[1], rtol=1e-10, atol=1e-12)  # scale
        np.testing.assert_allclose(g[2], tg[2], rtol=1e-10, atol=1e-12)  # bias
    np.testing.assert_allclose(ours["mean"], mean, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(ours["var"], var, rtol=1e-13)  # unbiased, as torch
    np.testing.assert_allclose(_nchw(ours["eval"]), evals, rtol=1e-12, atol=1e-12)


def test_nnx_batchnorm_matches_torch_in_train_and_eval():
    xs, weight, bias = _data()
    with jax.enable_x64(True):
        bn = BatchNorm(C, momentum=0.9, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        bn.scale.set_value(jnp.asarray(weight))
        bn.bias.set_value(jnp.asarray(bias))
        bn.mean.set_value(jnp.zeros(C, jnp.float64))
        bn.var.set_value(jnp.ones(C, jnp.float64))
        def loss(m, x):
            y = m(x)
            return jnp.sum(y * y), y

        @nnx.jit  # compiled: eager, each operation of the step compiles alone
        def step(m, x):
            (_, y), (gm, gx) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(m, x)
            return y, gx, gm.scale[...], gm.bias[...]  # the running statistics update m in place

        train = []
        for x in xs:
            y, gx, g_scale, g_bias = step(bn, _nhwc(x))
            train.append((y, (gx, np.asarray(g_scale), np.asarray(g_bias))))
        bn.eval()
        ours = {"train": train, "eval": nnx.jit(lambda m, x: m(x))(bn, _nhwc(xs[0])), "mean": np.asarray(bn.mean[...]),
                "var": np.asarray(bn.var[...])}
    _check(ours, _torch_run(xs, weight, bias))


def test_linen_batchnorm_matches_torch_in_train_and_eval():
    xs, weight, bias = _data()
    with jax.enable_x64(True):
        bn = LinenBatchNorm(momentum=0.9, param_dtype=jnp.float64, force_float32_reductions=False)
        variables = bn.init(jax.random.key(0), _nhwc(xs[0]), use_running_average=False)
        assert set(variables) == {"params", "batch_stats"}
        np.testing.assert_array_equal(variables["batch_stats"]["var"], np.ones(C))  # not updated by init
        params = {"scale": jnp.asarray(weight), "bias": jnp.asarray(bias)}
        stats = variables["batch_stats"]
        def loss(params, x, stats):
            y, upd = bn.apply({"params": params, "batch_stats": stats}, x, use_running_average=False,
                              mutable=["batch_stats"])
            return jnp.sum(y * y), (y, upd["batch_stats"])

        # compiled: eager, each operation of the step compiles alone
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        train = []
        for x in xs:
            (_, (y, stats)), (gp, gx) = step(params, _nhwc(x), stats)
            train.append((y, (gx, np.asarray(gp["scale"]), np.asarray(gp["bias"]))))
        evals = jax.jit(lambda params, stats, x: bn.apply({"params": params, "batch_stats": stats}, x,
                                                          use_running_average=True))(params, stats, _nhwc(xs[0]))
        ours = {"train": train, "eval": evals, "mean": np.asarray(stats["mean"]), "var": np.asarray(stats["var"])}
    _check(ours, _torch_run(xs, weight, bias))


def test_flax_batchnorm_running_var_is_the_biased_one():
    """What the remat versions fix: Linen's own BatchNorm averages the biased batch variance."""
    x = _nhwc(_data()[0][0])
    n = x.size // C
    ours = LinenBatchNorm(use_running_average=False, momentum=0.0)
    theirs = linen.BatchNorm(use_running_average=False, momentum=0.0, use_fast_variance=False)
    # both initialised and applied in one compiled program (eager, each operation compiles alone)
    v_ours, v_theirs = jax.jit(lambda x: tuple(
        bn.apply(bn.init(jax.random.key(0), x), x, mutable=["batch_stats"])[1]["batch_stats"]["var"]
        for bn in (ours, theirs)))(x)
    np.testing.assert_allclose(np.asarray(v_ours), np.asarray(v_theirs) * n / (n - 1), rtol=1e-5)


@pytest.mark.parametrize("cls, kwargs", [(BatchNorm, {"rngs": nnx.Rngs(0)}), (LinenBatchNorm, {})])
def test_mask_and_axis_name_are_refused_in_one_line(cls, kwargs):
    x = jnp.ones((2, C))
    if cls is BatchNorm:
        with pytest.raises(ValueError, match="does not support mask= or axis_name="):
            cls(C, use_running_average=False, **kwargs)(x, mask=jnp.ones((2, C), bool))
    else:
        with pytest.raises(ValueError, match="does not support mask= or axis_name="):
            cls(use_running_average=False, axis_name="batch").init(jax.random.key(0), x)

"""The reference models: Flax NNX models, their PyTorch twins, remat settings, the registry."""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import remat
from remat.models import MODELS, RematSettings, cnn, load_factory, mlp, seed, transformer
from remat.models._settings import jax_block

HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="needs PyTorch (pip install 'remat[torch]')")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


def _grads(model, *xs):
    """Parameter gradients of ``sum(model(*xs))``, compiled once (quickly: see remat.crosscheck.harness._jit)."""
    from remat.crosscheck.harness import _jit

    graphdef, state = nnx.split(model)
    return _jit(lambda s, *a: nnx.grad(lambda m: jnp.sum(m(*a)))(nnx.merge(graphdef, s)))(state, *xs)


@nnx.jit
def _forward(model, *xs):
    """``model(*xs)`` compiled: run eagerly, each operation compiles alone (a CNN's forward, seconds)."""
    return model(*xs)


def _assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    """Norm-wise: max|a - b| <= atol + rtol * max|b| per leaf (float32 reordering noise)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape
        assert np.max(np.abs(x - y), initial=0) <= atol + rtol * np.max(np.abs(y), initial=0)


# --- RematSettings ---------------------------------------------------------------------

def test_settings_blocks_and_policies():
    s = RematSettings(blocks={0, 2}, policy="dots")
    assert [s.applies(i) for i in range(3)] == [True, False, True]
    assert RematSettings().applies(5) and not RematSettings.none().applies(0)
    assert RematSettings(policy="names").jax_policy(("attn_out",)) == ["attn_out"]
    assert RematSettings(policy="names").jax_policy(()) is None
    assert RematSettings(policy=["a", "b"]).policy == ("a", "b")  # hashable: a static NNX attribute
    assert RematSettings(policy="everything").torch_checkpoints(0) is False
    assert RematSettings(policy="dots").torch_checkpoints(0) is True
    assert RematSettings(blocks=[1]).label == "blocks 1, policy=nothing"
    assert RematSettings.none().label == "no checkpoint"


@pytest.mark.parametrize("kwargs, error", [
    ({"blocks": "some"}, ValueError), ({"blocks": 3}, TypeError),
    ({"policy": "bogus"}, ValueError), ({"policy": lambda *a, **k: True}, TypeError),
])
def test_settings_errors(kwargs, error):
    with pytest.raises(error, match="RematSettings"):
        RematSettings(**kwargs)


def test_jax_block_is_a_plain_call_when_not_selected():
    calls = []
    out = jax_block(RematSettings.none(), 0, lambda x: calls.append(x) or x * 2, 3.0)
    assert out == 6.0 and calls == [3.0]


# --- without torch ---------------------------------------------------------------------

@pytest.mark.slow  # the fast check that these imports pull no torch in, in a fresh interpreter too:
# test_lowering.py::test_import_remat_changes_nothing_observable_and_imports_nothing_heavy
def test_models_and_remat_import_without_torch():
    r = _run_python("""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import remat, remat.crosscheck, models, models.mlp, models.cnn, models.transformer, models.seed
        from flax import nnx
        import jax.numpy as jnp
        m = models.mlp.MLP(models.mlp.MLPConfig(), rngs=nnx.Rngs(0))
        assert m(jnp.ones((2, 16))).shape == (2, 8)
        try:
            remat.crosscheck.compare_gradients(m, None, (jnp.ones((2, 16)),))
        except ImportError as e:
            print("IMPORTERROR:", e)
    """)
    assert r.returncode == 0, r.stderr
    assert "IMPORTERROR: remat.crosscheck needs PyTorch: pip install 'remat[torch]'" in r.stdout


# --- every model: twin and NNX model agree ---------------------------------------------

# the transformer slow: `remat crosscheck transformer` (test_crosscheck.py) compares its outputs
@needs_torch
@pytest.mark.parametrize("name", [n if n != "transformer" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in MODELS])
def test_twin_outputs_match(name):
    import torch

    jax_model, torch_model, inputs = MODELS[name].build()
    jax_inputs = [jnp.asarray(np.moveaxis(a, 1, -1) if a.ndim == 4 else a) for a in inputs]
    out = np.asarray(_forward(jax_model, *jax_inputs))
    with torch.no_grad():
        ref = torch_model(*[torch.from_numpy(a) for a in inputs]).numpy()
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    n_jax = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(jax_model, nnx.Param)))
    assert n_jax == sum(p.numel() for p in torch_model.parameters())


@needs_torch
@pytest.mark.parametrize("config", [
    mlp.MLPConfig(activation="gelu"), mlp.MLPConfig(activation="tanh", depth=3),
    pytest.param(transformer.TransformerConfig(fused_qkv=False), marks=pytest.mark.slow),
    cnn.CNNConfig(pool="avg", channels=(4,)),
], ids=["mlp-gelu", "mlp-tanh", "transformer-separate-qkv", "cnn-avgpool"])
def test_variants_match(config):
    import torch

    module = {mlp.MLPConfig: mlp, transformer.TransformerConfig: transformer, cnn.CNNConfig: cnn}[type(config)]
    jax_model, torch_model, inputs = module.build(config)
    if isinstance(config, cnn.CNNConfig):
        jax_model.eval(), torch_model.eval()
    x = inputs[0]
    out = np.asarray(_forward(jax_model, jnp.asarray(np.moveaxis(x, 1, -1) if x.ndim == 4 else x)))
    with torch.no_grad():
        ref = torch_model(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_config_defaults_and_errors():
    assert seed.MyModelConfig().size == 1000  # the seed's size
    assert (seed.ModelConfig().in_dim, seed.ModelConfig().hidden, seed.ModelConfig().out_dim) == (10, 20, 30)
    with pytest.raises(ValueError, match="activation"):
        mlp.MLPConfig(activation="swish")
    with pytest.raises(ValueError, match="divisible"):
        transformer.TransformerConfig(width=30, heads=4)
    with pytest.raises(ValueError, match="pool"):
        cnn.CNNConfig(pool="min")


# --- remat settings change nothing numerically -----------------------------------------

_TCFG = transformer.TransformerConfig(depth=1)


@functools.cache
def _plain_transformer_grads():
    ids = jnp.asarray(transformer.example_inputs(_TCFG)[0])
    model = transformer.Transformer(dataclasses.replace(_TCFG, remat=RematSettings.none()), rngs=nnx.Rngs(0))
    return _grads(model, ids)


# slow: test_crosscheck.py's `remat crosscheck transformer --policy names` checks a policy's
# gradients on the transformer (against PyTorch) in the fast suite
@pytest.mark.slow
@pytest.mark.parametrize("policy", [None, "everything", "dots", "dots_no_batch", "names"])
def test_transformer_policies_give_the_same_gradients(policy):
    ids = jnp.asarray(transformer.example_inputs(_TCFG)[0])
    model = transformer.Transformer(dataclasses.replace(_TCFG, remat=RematSettings(policy=policy)), rngs=nnx.Rngs(0))
    _assert_trees_close(_grads(model, ids), _plain_transformer_grads())


def test_names_policy_saves_the_tagged_values():
    from conftest import residuals

    ids = jnp.asarray(transformer.example_inputs(_TCFG)[0])

    def saved(settings):
        # abstract parameters (only traced): no initialisation to run
        model = nnx.eval_shape(lambda: transformer.Transformer(dataclasses.replace(_TCFG, remat=settings),
                                                               rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(model)
        return " ".join(d for _, d in residuals(lambda s: jnp.sum(nnx.merge(graphdef, s)(ids)), state))

    names, nothing = saved(RematSettings(policy="names")), saved(RematSettings(policy=None))
    assert "named 'attn_out'" in names and "named 'mlp_hidden'" in names
    assert "named 'attn_out'" not in nothing


@pytest.mark.slow
def test_block_lists_work_with_checkpoint_sequential():
    cfg = mlp.MLPConfig(depth=4)
    model = mlp.MLP(dataclasses.replace(cfg, remat=RematSettings.none()), rngs=nnx.Rngs(0))
    x = jnp.ones((2, cfg.width))

    def seq(m, k):
        return jnp.sum(remat.checkpoint_sequential(m.blocks, k, x))

    # compiled (nnx.jit): op by op, the transformer alone takes seconds
    _assert_trees_close(nnx.jit(nnx.grad(lambda m: seq(m, 1)))(model), nnx.jit(nnx.grad(lambda m: seq(m, 2)))(model))
    assert isinstance(model.blocks, list)

    tcfg = transformer.TransformerConfig(depth=4, remat=RematSettings.none())
    tm = transformer.Transformer(tcfg, rngs=nnx.Rngs(0))
    h = tm.embed(jnp.asarray(transformer.example_inputs(tcfg)[0]))

    def loop(tm, b):
        for block in tm.blocks:
            b = block(b)
        return b

    a = nnx.jit(lambda tm, h: remat.checkpoint_sequential(tm.blocks, 2, h))(tm, h)
    np.testing.assert_allclose(np.asarray(a), np.asarray(nnx.jit(loop)(tm, h)), rtol=1e-6, atol=1e-6)


@needs_torch
@pytest.mark.parametrize("settings, expected", [
    (RematSettings(), 2), (RematSettings(blocks={1}), 1), (RematSettings.none(), 0),
    (RematSettings(policy="dots"), 2), (RematSettings(policy="everything"), 0),
])
def test_torch_twin_checkpoints_the_same_blocks(monkeypatch, settings, expected):
    import torch
    import torch.utils.checkpoint as tuc

    calls = []
    real = tuc.checkpoint

    def counting(fn, *args, **kwargs):
        assert kwargs.get("use_reentrant") is False
        calls.append(fn)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(tuc, "checkpoint", counting)
    tm = mlp.make_torch_model(mlp.MLPConfig(depth=2, remat=settings))
    tm(torch.ones(2, 16)).sum().backward()
    assert len(calls) == expected


# --- BatchNorm conventions -------------------------------------------------------------

@needs_torch
def test_nnx_batchnorm_running_var_differs_from_torch_by_n_over_n_minus_1():
    """Documents the exact difference our BatchNorm removes: nnx.BatchNorm averages the
    biased batch variance into the running variance, torch the unbiased one."""
    import torch

    x = np.random.default_rng(0).standard_normal((4, 3, 5, 5)).astype(np.float64)
    n = 4 * 5 * 5
    tbn = torch.nn.BatchNorm2d(3, momentum=0.1).double()
    tbn(torch.from_numpy(x))
    with jax.enable_x64(True):
        xs = jnp.asarray(np.moveaxis(x, 1, -1))
        fbn = nnx.BatchNorm(3, momentum=0.9, use_fast_variance=False, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        fbn.mean.set_value(jnp.zeros(3, jnp.float64))
        fbn.var.set_value(jnp.ones(3, jnp.float64))
        _forward(fbn, xs)
        ours = cnn.BatchNorm(3, momentum=0.9, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        ours.mean.set_value(jnp.zeros(3, jnp.float64))
        ours.var.set_value(jnp.ones(3, jnp.float64))
        _forward(ours, xs)
        flax_var, our_var = np.asarray(fbn.var[...]), np.asarray(ours.var[...])
    torch_var = tbn.running_var.numpy()
    np.testing.assert_allclose((torch_var - 0.9) / (flax_var - 0.9), n / (n - 1), rtol=1e-12)
    np.testing.assert_allclose(our_var, torch_var, rtol=1e-14)
    np.testing.assert_allclose(np.asarray(ours.mean[...]), tbn.running_mean.numpy(), rtol=1e-12, atol=1e-15)


# --- registry and factories ------------------------------------------------------------

def test_registry_entries():
    assert set(MODELS) == {"seed-model", "seed-mymodel", "mlp", "transformer", "cnn"}
    assert MODELS["transformer"].checkpoint_names == ("attn_out", "mlp_hidden")
    cfg = MODELS["mlp"].make_config(RematSettings.none(), depth=3)
    assert cfg.depth == 3 and cfg.remat == RematSettings.none()
    assert MODELS["cnn"].example_targets().shape == (MODELS["cnn"].config.batch,)


def test_load_factory(tmp_path):
    f = tmp_path / "user_model.py"
    f.write_text("VALUE = 3\ndef make():\n    return 'built'\n")
    assert load_factory(f"{f}:make")() == "built"


@pytest.mark.parametrize("spec, message", [
    ("no_colon.py", "malformed factory"),
    ("file.txt:make", "must be a .py file"),
    (":make", "malformed factory"),
    ("missing_file.py:make", "does not exist"),
    ("{tmp}:nothing_here", "has no attribute 'nothing_here'"),
    ("{tmp}:VALUE", "is not callable"),
    ("{tmp}:1bad", "malformed factory"),
])
def test_load_factory_errors(tmp_path, spec, message):
    f = tmp_path / "user_model.py"
    f.write_text("VALUE = 3\n")
    with pytest.raises(ValueError, match=message) as info:
        load_factory(spec.format(tmp=f))
    assert "\n" not in str(info.value)


def test_load_factory_import_error_is_one_line(tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match="importing .* failed: RuntimeError: boom"):
        load_factory(f"{f}:make")


# the MLP in the default run; the transformer (the same init_model path, a larger program) slow
@pytest.mark.parametrize("name", ["mlp", pytest.param("transformer", marks=pytest.mark.slow)])
def test_a_built_task_leaves_its_init_program_to_reference_counting(name):
    """Building a task frees the compiled init program on return, not at some later
    garbage collection (which would land inside whatever the caller times next, a plan say)."""
    import gc

    from remat.models import tasks

    tasks._initializer.cache_clear()  # a program another test compiled for this config would not be built here
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds is kept in gc.garbage, to look at
    try:
        task = tasks.make_task(name, depth=1, seed=0)
        gc.collect()
        cyclic = {type(o).__name__ for o in gc.garbage}
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert task.model is not None
    assert not cyclic & {"PjitFunction", "JitWrapped", "JitFn"}, cyclic

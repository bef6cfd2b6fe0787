"""The HuggingFace twins (models/llama.py, gpt2.py, hf_resnet.py): gradients against the stock
transformers models, per-block checkpointing on both sides, HF's float32 islands, the CLI."""
from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from remat import crosscheck  # noqa: E402
from remat.analysis import saved_residuals  # noqa: E402
from remat.cli import main  # noqa: E402
from remat.models import HF_MODELS, RematSettings, gpt2, hf_resnet, llama  # noqa: E402
from remat.models._hf import HF_MISSING, transformers_module  # noqa: E402

NAMES = tuple(HF_MODELS)
MODULES = {"llama": llama, "gpt2": gpt2, "resnet": hf_resnet}
FAST = {("llama", "float64")}  # the rest: -m slow


def _build(name, settings=None, seed=0):
    entry = HF_MODELS[name]
    return entry.factory(entry.make_config(settings or RematSettings()), seed)


def _tolerances(name, dtype):
    return HF_MODELS[name].tolerances.get(dtype, (None, None))


# --- gradients against the stock HuggingFace models, checkpointed per block -----------------

@pytest.mark.parametrize("name, dtype", [
    pytest.param(n, d, marks=() if (n, d) in FAST else pytest.mark.slow)
    for n in NAMES for d in ("float32", "float64")])
def test_gradients_match_hf_checkpointed_per_block(name, dtype):
    jm, tm, inputs = _build(name)
    rtol, atol = _tolerances(name, dtype)
    report = crosscheck.compare_gradients(jm, tm, inputs, dtype=dtype, mode="train", rtol=rtol, atol=atol)
    assert report.ok, str(report)
    params = {r.name for r in report.rows if r.kind == "param"}
    assert params == {n for n, _ in tm.named_parameters()}  # every HF parameter, each once
    if name == "gpt2":  # Conv1D kernels loaded as they are, the head tied to wte
        assert ("transformer.wte.weight", "lm_head.weight") in [tuple(g) for g in report.tied]
    if name == "resnet":  # BatchNorm running statistics after the step, torch's unbiased variance
        assert any(r.kind == "buffer" and r.name.endswith("running_var") for r in report.rows)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_unchecked_twins_match_too(name):
    jm, tm, inputs = _build(name, RematSettings.none())
    rtol, atol = _tolerances(name, "float64")
    report = crosscheck.compare_gradients(jm, tm, inputs, dtype="float64", rtol=rtol, atol=atol)
    assert report.ok, str(report)


# --- checkpointing really happens --------------------------------------------------------

def _residual_count(name, settings):
    entry = HF_MODELS[name]
    config = entry.make_config(settings)
    model = nnx.eval_shape(lambda: entry.module(config, rngs=nnx.Rngs(0)))  # traced only: nothing initialised
    x = jnp.asarray(MODULES[name].example_inputs(config)[0])
    if x.ndim == 4:
        x = x.transpose(0, 2, 3, 1)
    graphdef, state = nnx.split(model)
    return len(saved_residuals(lambda s: jnp.sum(nnx.merge(graphdef, s)(x)), state))


@pytest.mark.parametrize("name", NAMES)
def test_flax_twins_keep_fewer_residuals_checkpointed(name):
    none = _residual_count(name, RematSettings.none())
    one = _residual_count(name, RematSettings(blocks={0}))
    every = _residual_count(name, RematSettings())
    assert every < one < none


def _blocks(name, model):
    if name == "llama":
        return [layer.mlp for layer in model.model.layers]
    if name == "gpt2":
        return [block.mlp for block in model.transformer.h]
    return [layer.layer[0] for stage in model.resnet.encoder.stages for layer in stage.layers]


@pytest.mark.parametrize("name", NAMES)
def test_torch_twins_recompute_exactly_the_selected_blocks(name):
    """A module inside a checkpointed block starts twice: forward, then recomputation in backward
    (a pre-hook: torch's recomputation stops as soon as it has what the backward needs)."""
    _, tm, (x,) = _build(name, RematSettings(blocks={1}))
    calls = [0, 0]
    for i, module in enumerate(_blocks(name, tm)[:2]):
        module.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    tm(torch.from_numpy(x)).logits.sum().backward()
    assert calls == [1, 2]


def test_resnet_twin_updates_batchnorm_statistics_once_when_checkpointed():
    _, tm, (x,) = _build("resnet", RematSettings())
    bn = tm.resnet.encoder.stages[0].layers[0].layer[0].normalization
    tm(torch.from_numpy(x)).logits.sum().backward()
    assert int(bn.num_batches_tracked) == 1


# --- HuggingFace's float32 islands --------------------------------------------------------

def _float64_rms_norm(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _float64_rotary(self, x, position_ids):
    dim = 2 * self.inv_freq.shape[0]
    base = self.config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=x.dtype) / dim))
    freqs = position_ids[..., None].to(x.dtype) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _float64_eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    from transformers.models.llama.modeling_llama import repeat_kv

    k, v = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, k.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.nn.functional.softmax(weights, dim=-1)  # HF: dtype=torch.float32
    return torch.matmul(weights, v).transpose(1, 2).contiguous(), weights


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_llama_float64_reaches_1e10_once_hf_float32_islands_are_float64(monkeypatch, attention):
    """Stock HF Llama in float64 stalls near float32's rounding; its float32 islands are RMSNorm and
    the rotary tables (and, with eager attention, the softmax). Patched to float64: 1e-10 holds."""
    from transformers.models.llama import modeling_llama

    jm, tm, inputs = _build("llama", RematSettings())
    tm.config._attn_implementation = attention
    stock = crosscheck.compare_gradients(jm, tm, inputs, dtype="float64", rtol=1.0, atol=1.0)
    assert 1e-8 < stock.max_rel < HF_MODELS["llama"].tolerances["float64"][0]

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _float64_rms_norm)
    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", _float64_rotary)
    if attention == "eager":
        monkeypatch.setattr(modeling_llama, "eager_attention_forward", _float64_eager_attention)
    patched = crosscheck.compare_gradients(jm, tm, inputs, dtype="float64", rtol=1e-10, atol=1e-12)
    assert patched.ok, str(patched)
    assert patched.max_rel < 1e-13


# --- the command line -------------------------------------------------------------------

@pytest.mark.parametrize("name, dtype", [
    pytest.param(n, d, marks=pytest.mark.slow) for n in NAMES for d in ("float32", "float64")])
def test_cli_crosscheck_passes(name, dtype, capsys):
    """Gradients and three AdamW steps, with each model's own tolerances and exclusions."""
    assert main(["crosscheck", name, "--dtype", dtype, "--steps", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rtol = _tolerances(name, dtype)[0] or crosscheck.TOLERANCES[dtype][0]
    assert result["ok"] and result["gradients"]["rtol"] == rtol
    training = result["training"]
    assert training["ok"] and len(training["rows"]) > 10
    # GPT-2 leaves out its attention biases (zero-in-theory key gradients), nothing else does
    expected = [f"transformer.h.{i}.attn.c_attn.bias" for i in range(2)] if name == "gpt2" else []
    assert training["excluded"] == expected


def test_missing_transformers_is_one_line_naming_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.raises(ImportError) as e:
        transformers_module()
    assert str(e.value) == HF_MISSING and "pip install 'remat[hf]'" in HF_MISSING
    assert main(["crosscheck", "gpt2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"remat: error: {HF_MISSING}"


def test_flax_models_need_no_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    for name in NAMES:
        entry = HF_MODELS[name]
        model = nnx.eval_shape(lambda entry=entry: entry.module(entry.config, rngs=nnx.Rngs(0)))
        assert jax.tree.leaves(nnx.state(model, nnx.Param))


@pytest.mark.slow
def test_port_recipe_prints_the_report_it_shows(capsys):
    """docs/crosscheck.md's "Port a HuggingFace model" code runs and prints the rows pasted below it."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "crosscheck.md").read_text()
    section = page.split("## Port a HuggingFace model", 1)[1]
    code, shown = re.findall(r"```(?:python|text)?\n(.*?)```", section, re.S)[:2]
    exec(compile(code, "docs/crosscheck.md recipe", "exec"), {})
    printed = capsys.readouterr().out

    def skeleton(text):  # everything but the measured errors, which vary with the machine
        return [re.sub(r"\d\.\d\de[-+]\d\d", "E", line).split() for line in text.strip().splitlines()]

    assert skeleton(printed) == skeleton(shown)


@pytest.mark.slow
def test_cli_table_names_what_its_rows_leave_out(capsys):
    assert main(["crosscheck", "gpt2", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "tied (one tensor, loaded and compared once): transformer.wte.weight = lm_head.weight" in out
    assert ("excluded from the weight comparison: transformer.h.0.attn.c_attn.bias, "
            "transformer.h.1.attn.c_attn.bias") in out

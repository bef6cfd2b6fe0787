"""remat.crosscheck on HuggingFace models as they come: Conv1D layouts, tied weights, ModelOutputs, exclude=."""
from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

from remat.crosscheck import (  # noqa: E402
    LayoutWarning,
    StateDictMismatchError,
    compare_gradients,
    compare_training,
    load_torch_state,
)

E, HEADS, VOCAB, POSITIONS, LAYERS = 32, 2, 64, 32, 2


# --- a square Conv1D beside a square nn.Linear --------------------------------------------

class TorchPair(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1d = Conv1D(8, 8)   # HF stores (in, out)
        self.linear = torch.nn.Linear(8, 8)  # torch stores (out, in)

    def forward(self, x):
        return self.linear(torch.tanh(self.conv1d(x)))


class NNXPair(nnx.Module):
    def __init__(self, rngs):
        self.conv1d = nnx.Linear(8, 8, rngs=rngs)
        self.linear = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return self.linear(jnp.tanh(self.conv1d(x)))


def _pair():
    torch.manual_seed(0)
    tm = TorchPair()
    with torch.no_grad():
        tm.conv1d.weight.copy_(torch.randn(8, 8))
        tm.conv1d.bias.copy_(torch.randn(8))
    jm = NNXPair(nnx.Rngs(0))
    return jm, tm


def test_square_conv1d_loads_in_its_own_layout():
    jm, tm = _pair()
    report = load_torch_state(jm, tm)
    assert report.ok
    np.testing.assert_array_equal(np.asarray(jm.conv1d.kernel[...]), tm.conv1d.weight.detach().numpy())
    np.testing.assert_array_equal(np.asarray(jm.linear.kernel[...]), tm.linear.weight.detach().numpy().T)
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    out = np.asarray(jm(jnp.asarray(x)))
    np.testing.assert_allclose(out, tm(torch.from_numpy(x)).detach().numpy(), rtol=0, atol=1e-6)
    g = compare_gradients(jm, tm, (x,), dtype="float64")
    assert g.ok, str(g)
    assert max(r.max_abs for r in g.rows) <= 1e-12
    assert {r.name for r in g.rows if r.kind == "param"} == {
        "conv1d.weight", "conv1d.bias", "linear.weight", "linear.bias"}


def test_square_weights_from_a_bare_state_dict_warn_and_layouts_fix_them():
    jm, tm = _pair()
    with pytest.warns(LayoutWarning, match=r"conv1d\.weight, linear\.weight"):
        load_torch_state(jm, tm.state_dict())
    # the guess transposed the Conv1D weight: the module-aware comparison catches it
    bad = compare_gradients(jm, tm, (np.ones((2, 8), np.float32),), mode="train")
    assert {r.name for r in bad.failures if r.kind == "weight"} == {"conv1d.weight"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_torch_state(jm, tm.state_dict(), layouts={"conv1d.weight": "same", "linear.weight": "linear"})
    assert compare_gradients(jm, tm, (np.ones((2, 8), np.float32),)).ok
    # a layout that contradicts the owner shows in the weight row
    load_torch_state(jm, tm, layouts=lambda n: "linear" if n == "conv1d.weight" else None)
    wrong = compare_gradients(jm, tm, (np.ones((2, 8), np.float32),))
    assert {r.name for r in wrong.failures if r.kind == "weight"} == {"conv1d.weight"}
    with pytest.raises(ValueError, match="layouts"):
        load_torch_state(jm, tm, layouts={"linear.weight": "transposed"})


class TorchDictOut(TorchPair):
    def forward(self, x):
        y = super().forward(x)
        return {"y": y, "hidden": (y * 2, None), "step": 3}


class NNXDictOut(NNXPair):
    def __call__(self, x):
        y = super().__call__(x)
        return {"y": y, "hidden": (y * 2, None)}


def test_dict_and_tuple_outputs_compare_their_array_leaves():
    jm, tm = _pair()
    torch_model = TorchDictOut()
    torch_model.load_state_dict(tm.state_dict())
    jax_model = NNXDictOut(nnx.Rngs(0))
    load_torch_state(jax_model, torch_model)
    x = np.random.default_rng(1).standard_normal((3, 8))
    report = compare_gradients(jax_model, torch_model, (x,), dtype="float64")
    assert report.ok, str(report)
    assert [r.name for r in report.rows if r.kind == "output"] == ["output.hidden[0]", "output.y"]
    assert report.skipped == ["output.hidden[1]", "output.step"]
    # a pair of selectors: one per side
    picked = compare_gradients(jax_model, torch_model, (x,), output=(lambda o: o["y"], lambda o: o["y"]))
    assert picked.ok and [r.name for r in picked.rows if r.kind == "output"] == ["output"]
    with pytest.raises(TypeError, match="output must be"):
        compare_gradients(jax_model, torch_model, (x,), output="y")


# --- a GPT-2 written from scratch in NNX against transformers.GPT2LMHeadModel -------------

class Attention(nnx.Module):
    def __init__(self, rngs):
        self.c_attn = nnx.Linear(E, 3 * E, rngs=rngs)
        self.c_proj = nnx.Linear(E, E, rngs=rngs)

    def __call__(self, x):
        b, t, _ = x.shape
        q, k, v = (a.reshape(b, t, HEADS, E // HEADS) for a in jnp.split(self.c_attn(x), 3, axis=-1))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(E // HEADS).astype(x.dtype)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, jnp.finfo(x.dtype).min)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return self.c_proj(out.reshape(b, t, E))


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.c_fc = nnx.Linear(E, 4 * E, rngs=rngs)
        self.c_proj = nnx.Linear(4 * E, E, rngs=rngs)

    def __call__(self, x):
        return self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=True))  # HF's gelu_new


class Block(nnx.Module):
    def __init__(self, rngs):
        self.ln_1 = nnx.LayerNorm(E, epsilon=1e-5, rngs=rngs)
        self.attn = Attention(rngs)
        self.ln_2 = nnx.LayerNorm(E, epsilon=1e-5, rngs=rngs)
        self.mlp = MLP(rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Body(nnx.Module):
    def __init__(self, rngs):
        self.wte = nnx.Embed(VOCAB, E, rngs=rngs)
        self.wpe = nnx.Embed(POSITIONS, E, rngs=rngs)
        self.h = nnx.data([Block(rngs) for _ in range(LAYERS)])
        self.ln_f = nnx.LayerNorm(E, epsilon=1e-5, rngs=rngs)


class GPT2(nnx.Module):
    """``transformer.*`` as HF names it; the head is the tied ``wte`` (no ``lm_head`` variable)."""

    def __init__(self, rngs):
        self.transformer = Body(rngs)

    def __call__(self, ids):
        t = self.transformer
        x = t.wte(ids) + t.wpe(jnp.arange(ids.shape[1]))
        for block in t.h:
            x = block(x)
        return t.wte.attend(t.ln_f(x))


def _hf_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=LAYERS, n_embd=E, n_head=HEADS, vocab_size=VOCAB,
                                     n_positions=POSITIONS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


@pytest.fixture(scope="module")
def gpt2():
    tm = _hf_gpt2()
    jm = nnx.eval_shape(lambda: GPT2(nnx.Rngs(0)))  # no initialisation: every value comes from torch
    report = load_torch_state(jm, tm)  # strict: the tied lm_head.weight is not "unexpected"
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 12))
    return jm, tm, report, ids


def test_tied_weights_load_once_and_are_listed(gpt2):
    jm, tm, report, _ = gpt2
    assert report.ok and report.tied == [("transformer.wte.weight", "lm_head.weight")]
    assert "lm_head.weight" not in report.loaded and "tied" in str(report)
    # Conv1D weights, square (c_proj, 32x32) or not, loaded as HF stores them: (in, out)
    for name in ("c_attn", "c_proj"):
        hf = getattr(tm.transformer.h[0].attn, name).weight.detach().numpy()
        np.testing.assert_array_equal(np.asarray(getattr(jm.transformer.h[0].attn, name).kernel[...]), hf)


@pytest.mark.slow
def test_model_output_with_dynamic_cache(gpt2):
    jm, tm, _, ids = gpt2
    report = compare_gradients(jm, tm, (ids,), dtype="float64", mode="train")
    assert report.ok, str(report)
    assert report.skipped == ["output.cache"]  # transformers 5's name for the DynamicCache
    assert "skipped (not arrays): output.cache" in str(report)
    assert [r.name for r in report.rows if r.kind == "output"] == ["output.logits"]
    names = [r.name for r in report.rows if r.mode == "train" and r.kind == "param"]
    assert names.count("transformer.wte.weight") == 1 and "lm_head.weight" not in names
    assert report.tied == [("transformer.wte.weight", "lm_head.weight")] and "lm_head.weight" in str(report)
    assert max(r.max_rel for r in report.rows) < 1e-12
    # output= selects on the HF side and leaves the twin's bare logits as they are
    chosen = compare_gradients(jm, tm, (ids,), output=lambda o: o.logits, mode="eval")
    assert chosen.ok and not chosen.skipped, str(chosen)
    assert [r.name for r in chosen.rows if r.kind == "output"] == ["output"]


@pytest.mark.slow
def test_exclude_makes_float32_adam_training_pass(gpt2):
    jm, tm, _, ids = gpt2
    targets = np.roll(ids, -1, axis=1)
    plain = compare_training(jm, tm, (ids,), targets, optimizer="adam", lr=1e-2, steps=5)
    # the default loss read the logits out of the ModelOutput (beside its DynamicCache)
    np.testing.assert_allclose(plain.jax_losses, plain.torch_losses, rtol=1e-4)
    # ... but Adam turned the key bias's float32 rounding-noise gradient into full steps
    assert plain.failures
    assert {r.name for r in plain.failures} <= {f"transformer.h.{i}.attn.c_attn.bias" for i in range(LAYERS)}
    report = compare_training(jm, tm, (ids,), targets, optimizer="adam", lr=1e-2, steps=5,
                              exclude=lambda n: n.endswith("attn.c_attn.bias"))
    assert report.ok, str(report)
    assert report.excluded == [f"transformer.h.{i}.attn.c_attn.bias" for i in range(LAYERS)]
    assert not any(r.name.endswith("c_attn.bias") for r in report.rows)
    assert report.tied == [("transformer.wte.weight", "lm_head.weight")]
    by_name = compare_training(jm, tm, (ids,), targets, optimizer="adam", steps=2,
                               exclude=[f"transformer.h.{i}.attn.c_attn.bias" for i in range(LAYERS)])
    assert by_name.ok, str(by_name)
    with pytest.raises(ValueError, match="exclude names no parameter: nope"):
        compare_training(jm, tm, (ids,), targets, exclude=["nope"])


def test_unloaded_variables_are_named_before_anything_runs():
    tm = _hf_gpt2()
    jm = nnx.eval_shape(lambda: GPT2(nnx.Rngs(0)))
    skip = ("transformer.ln_f.weight", "transformer.wpe.weight")
    report = load_torch_state(jm, tm, strict=False, rename=lambda n: None if n in skip else n)
    assert report.missing == ["transformer.ln_f.weight", "transformer.wpe.weight"]
    ids = np.zeros((1, 4), np.int64)
    for compare in (compare_gradients, compare_training):
        with pytest.raises(ValueError, match=r"never loaded .*: transformer\.ln_f\.weight, transformer\.wpe\.weight;"):
            compare(jm, tm, (ids,))
    with pytest.raises(StateDictMismatchError, match="missing in the torch state: transformer.ln_f.weight"):
        load_torch_state(jm, tm, rename=lambda n: None if n in skip else n)


# --- a Llama written from scratch in NNX against transformers.LlamaForCausalLM ---------------

HEAD_DIM, KV_HEADS, LLAMA_HEADS, HIDDEN = 8, 2, 4, 64


def _rotate(x, positions):
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, HEAD_DIM, 2, dtype=jnp.float32) / HEAD_DIM))
    angles = positions[:, None].astype(jnp.float32) * inv_freq
    cos, sin = (jnp.concatenate([f(angles)] * 2, axis=-1)[None, :, None, :].astype(x.dtype) for f in (jnp.cos, jnp.sin))
    half = jnp.concatenate([-x[..., HEAD_DIM // 2:], x[..., :HEAD_DIM // 2]], axis=-1)
    return x * cos + half * sin


class LlamaAttention(nnx.Module):
    def __init__(self, rngs):
        self.q_proj = nnx.Linear(E, LLAMA_HEADS * HEAD_DIM, use_bias=False, rngs=rngs)  # square: 32x32
        self.k_proj = nnx.Linear(E, KV_HEADS * HEAD_DIM, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(E, KV_HEADS * HEAD_DIM, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(LLAMA_HEADS * HEAD_DIM, E, use_bias=False, rngs=rngs)

    def __call__(self, x):
        b, t, _ = x.shape
        positions = jnp.arange(t)
        q = _rotate(self.q_proj(x).reshape(b, t, LLAMA_HEADS, HEAD_DIM), positions)
        k = _rotate(self.k_proj(x).reshape(b, t, KV_HEADS, HEAD_DIM), positions)
        v = self.v_proj(x).reshape(b, t, KV_HEADS, HEAD_DIM)
        k, v = (jnp.repeat(a, LLAMA_HEADS // KV_HEADS, axis=2) for a in (k, v))  # grouped-query attention
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * HEAD_DIM ** -0.5
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, jnp.finfo(x.dtype).min)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return self.o_proj(out.reshape(b, t, -1))


class LlamaMLP(nnx.Module):
    def __init__(self, rngs):
        self.gate_proj = nnx.Linear(E, HIDDEN, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(E, HIDDEN, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(HIDDEN, E, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nnx.Module):
    def __init__(self, rngs):
        self.input_layernorm = nnx.RMSNorm(E, epsilon=1e-6, rngs=rngs)
        self.self_attn = LlamaAttention(rngs)
        self.post_attention_layernorm = nnx.RMSNorm(E, epsilon=1e-6, rngs=rngs)
        self.mlp = LlamaMLP(rngs)

    def __call__(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nnx.Module):
    def __init__(self, rngs):
        self.embed_tokens = nnx.Embed(VOCAB, E, rngs=rngs)
        self.layers = nnx.data([LlamaLayer(rngs) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(E, epsilon=1e-6, rngs=rngs)


class Llama(nnx.Module):
    def __init__(self, rngs):
        self.model = LlamaBody(rngs)
        self.lm_head = nnx.Linear(E, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, ids):
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


@pytest.mark.slow
def test_llama_linear_layouts_and_model_output():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=E, intermediate_size=HIDDEN,
                                      num_hidden_layers=LAYERS, num_attention_heads=LLAMA_HEADS,
                                      num_key_value_heads=KV_HEADS, max_position_embeddings=POSITIONS,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                                      pad_token_id=0)
    tm = transformers.LlamaForCausalLM(config)
    jm = nnx.eval_shape(lambda: Llama(nnx.Rngs(0)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayoutWarning)  # every owner is known: nothing guessed
        report = load_torch_state(jm, tm)
    assert report.ok and not report.tied
    q = tm.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    assert q.shape[0] == q.shape[1]
    np.testing.assert_array_equal(np.asarray(jm.model.layers[0].self_attn.q_proj.kernel[...]), q.T)
    ids = np.random.default_rng(1).integers(0, VOCAB, (2, 10))
    grads = compare_gradients(jm, tm, (ids,), output=lambda o: o.logits, mode="eval")
    assert grads.ok, str(grads)
    assert [r.name for r in grads.rows if r.kind == "output"] == ["output"]

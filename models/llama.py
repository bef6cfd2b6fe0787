"""A Llama-style decoder in Flax NNX whose PyTorch twin is ``transformers.LlamaForCausalLM``.

Token embedding, ``depth`` pre-norm decoder layers (RMSNorm, grouped-query causal
self-attention with rotary position embeddings, RMSNorm, SwiGLU MLP), a final RMSNorm and
an LM head without bias, untied as in HuggingFace's Llama by default, or tied to the token
embedding (``tie_embeddings``: the NNX model then has no ``lm_head`` and computes the logits
with ``embed_tokens.attend``, as SmolLM does). The attribute names follow
HuggingFace's (``model.layers.0.self_attn.q_proj``, ``model.norm``, ``lm_head``), so that
:func:`remat.crosscheck.load_torch_state` fills the NNX model from the stock
``LlamaForCausalLM`` (random init from a tiny ``transformers.LlamaConfig``) without
``rename=``. Each decoder layer is one block of :class:`RematSettings`: the NNX layer is
checkpointed with :func:`remat.checkpoint`, the twin's layer with HuggingFace's own
activation checkpointing (``activation_checkpointing_enable``). Inside each layer the
attention output is tagged ``"attn_out"`` and the SwiGLU product ``"mlp_hidden"``.

The rotary tables and the RMSNorm statistics are computed in the model's dtype; the
attention is :func:`remat.ops.scaled_dot_product_attention`, in tiles as PyTorch's CPU
flash kernel computes it (scores and softmax in float32 or wider, the ``[b, h, t, t]``
scores never kept). HuggingFace computes the rotary tables and RMSNorm in float32 whatever the model's
dtype (and the softmax too with ``attn_implementation="eager"``; the twin keeps the default
``"sdpa"``), so a float64 check against the stock model cannot get below float32's
rounding (:data:`TOLERANCES`; docs/crosscheck.md names the exact lines and the floor measured).

Needs ``transformers`` for the twin only (``pip install 'remat[hf]'``); the NNX model
needs nothing beyond JAX and Flax.

Named configs (:data:`CONFIGS`): ``"tiny"`` (the default, for tests) and ``"smollm-135m"``
(SmolLM-135M's shape: 30 layers, 135M parameters, seq 512, batch 2), chosen on the command
line with ``remat crosscheck llama --config smollm-135m``.

Example:
  >>> from remat.models import llama
  >>> jm, tm, (ids,) = llama.build(llama.LlamaConfig())  # doctest: +SKIP
  >>> llama.CONFIGS["smollm-135m"].depth
  30
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import remat
from remat import ops
from remat.models._hf import checkpoint_hf_layers, transformers_module
from remat.models._settings import RematSettings, jax_block
from remat.models._twin import build_pair, silu_like_torch
from remat.models._twin import token_inputs as example_inputs  # noqa: F401  (the registry's)
from remat.models._twin import token_targets as example_targets  # noqa: F401  (the registry's)

CHECKPOINT_NAMES = ("attn_out", "mlp_hidden")

#: ``dtype -> (rtol, atol)`` against the stock twin where the library's defaults are too tight.
#: float64: HuggingFace's rotary tables and RMSNorm run in float32, so the gradients agree to
#: a few float32 ulps (the worst measured: docs/crosscheck.md) and no better.
TOLERANCES = {"float64": (1e-6, 1e-12)}

#: The training comparison: Adam divides each gradient by its own running size, so rounding
#: (float32's, and in float64 the islands') becomes a relative error of the step itself; the
#: worst measured over 3 AdamW steps (docs/crosscheck.md) sits at float32's library default, 1e-3.
TRAINING_TOLERANCES: dict[str, tuple[float, float]] = {"float32": (3e-3, 1e-5), "float64": (3e-4, 1e-12)}
TRAINING_EXCLUDE = None  # no parameter has a gradient that is zero in theory


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes and remat settings of :class:`LlamaForCausalLM` (and of its twin's ``transformers.LlamaConfig``)."""

    vocab: int = 64
    width: int = 32
    depth: int = 2
    heads: int = 4
    kv_heads: int = 2
    mlp_width: int = 64
    seq_len: int = 8
    batch: int = 2
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = False
    remat: RematSettings = field(default_factory=RematSettings)

    def __post_init__(self) -> None:
        if self.width % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"LlamaConfig: width={self.width} must divide by heads={self.heads}, "
                             f"and heads by kv_heads={self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


def rotary_tables(seq_len: int, head_dim: int, theta: float, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)`` of shape ``(seq_len, head_dim)``: HuggingFace's default rotary embedding, in ``dtype``.

    Computed in float32 (float64 for a float64 model) and rounded once to ``dtype``, as
    HuggingFace does in bfloat16: angles of bfloat16 positions times bfloat16 frequencies
    would be off by a few bfloat16 ulps of the angle."""
    wide = jnp.promote_types(dtype, jnp.float32)
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=wide) / head_dim))
    freqs = jnp.arange(seq_len, dtype=wide)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def _rotate_half(x: jax.Array) -> jax.Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


#: every projection's product: remat.ops.dot_general (a dense layer's backward as two 2-D
#: products; in bfloat16, products in bfloat16 as PyTorch's)
_DENSE = {"dot_general": ops.dot_general}


class LlamaAttention(nnx.Module):
    """Causal grouped-query self-attention with rotary embeddings, ``(B, T, C) -> (B, T, C)``."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        hd = config.head_dim
        self.q_proj = nnx.Linear(config.width, config.heads * hd, use_bias=False, **_DENSE, rngs=rngs)
        self.k_proj = nnx.Linear(config.width, config.kv_heads * hd, use_bias=False, **_DENSE, rngs=rngs)
        self.v_proj = nnx.Linear(config.width, config.kv_heads * hd, use_bias=False, **_DENSE, rngs=rngs)
        self.o_proj = nnx.Linear(config.heads * hd, config.width, use_bias=False, **_DENSE, rngs=rngs)
        self.heads, self.kv_heads, self.head_dim = config.heads, config.kv_heads, hd
        self.autocast_dtype = None  # bfloat16 under an emulated torch.autocast (remat.crosscheck.autocast)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        b, t, _ = x.shape

        def heads(a: jax.Array, n: int) -> jax.Array:
            return a.reshape(b, t, n, self.head_dim).transpose(0, 2, 1, 3)

        q, k, v = heads(self.q_proj(x), self.heads), heads(self.k_proj(x), self.kv_heads), \
            heads(self.v_proj(x), self.kv_heads)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if self.autocast_dtype is not None:
            q, k, v = (a.astype(self.autocast_dtype) for a in (q, k, v))
        # torch's CPU SDPA runs a flash kernel: tiles with an online softmax, the [b, h, t, t]
        # scores never kept; enable_gqa is HuggingFace's repeat_kv without the copies
        y = ops.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(0, 2, 1, 3).reshape(b, t, self.heads * self.head_dim))


class LlamaMLP(nnx.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``; the product is tagged."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        self.gate_proj = nnx.Linear(config.width, config.mlp_width, use_bias=False, **_DENSE, rngs=rngs)
        self.up_proj = nnx.Linear(config.width, config.mlp_width, use_bias=False, **_DENSE, rngs=rngs)
        self.down_proj = nnx.Linear(config.mlp_width, config.width, use_bias=False, **_DENSE, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = remat.checkpoint_name(silu_like_torch(self.gate_proj(x)) * self.up_proj(x), "mlp_hidden")
        return self.down_proj(h)


def _rms_norm(config: LlamaConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(config.width, epsilon=config.rms_eps, rngs=rngs)


class LlamaDecoderLayer(nnx.Module):
    """``x + self_attn(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        self.self_attn = LlamaAttention(config, rngs=rngs)
        self.mlp = LlamaMLP(config, rngs=rngs)
        self.input_layernorm = _rms_norm(config, rngs)
        self.post_attention_layernorm = _rms_norm(config, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        x = x + remat.checkpoint_name(self.self_attn(self.input_layernorm(x), cos, sin), "attn_out")
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nnx.Module):
    """Embedding, decoder layers (each a remat block) and the final norm: ids -> hidden states."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(config.vocab, config.width, rngs=rngs)
        self.layers = nnx.data([LlamaDecoderLayer(config, rngs=rngs) for _ in range(config.depth)])
        self.norm = _rms_norm(config, rngs)
        self.settings = config.remat
        self.head_dim, self.rope_theta = config.head_dim, config.rope_theta

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.embed_tokens(ids)
        cos, sin = rotary_tables(ids.shape[1], self.head_dim, self.rope_theta, x.dtype)
        for i, layer in enumerate(self.layers):
            x = jax_block(self.settings, i, layer, x, cos, sin, tagged=CHECKPOINT_NAMES)
        return self.norm(x)


#: The named configs; ``"smollm-135m"`` is HuggingFaceTB/SmolLM-135M's shape (its config.json),
#: at the benchmark's sequence length and batch.
CONFIGS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(),
    "smollm-135m": LlamaConfig(vocab=49152, width=576, depth=30, heads=9, kv_heads=3, mlp_width=1536,
                               seq_len=512, batch=2, rope_theta=10000.0, rms_eps=1e-5, tie_embeddings=True),
}


def tied_logits(h: jax.Array, embedding: jax.Array, **kwargs: Any) -> jax.Array:
    """``nnx.Embed.attend``'s logits ``h @ embedding.T``, as :func:`remat.ops.dot_general`'s
    tied-head product: its backward takes the embedding's gradient as one 2-D product, where
    JAX's own transposed the whole ``[tokens, vocab]`` logits' gradient first. ``kwargs`` go
    to :func:`remat.ops.dot_general` (``preferred_element_type``)."""
    return ops.dot_general(h, embedding, (((h.ndim - 1,), (1,)), ((), ())), **kwargs)


class LlamaForCausalLM(nnx.Module):
    """The Flax NNX Llama: token ids ``(B, T)`` -> logits ``(B, T, vocab)``.

    :meth:`hidden` and :meth:`head_weight` split the call in two, for a loss that never
    forms the logits (:func:`remat.ops.chunked_cross_entropy`).
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        self.model = LlamaModel(config, rngs=rngs)
        if not config.tie_embeddings:
            self.lm_head = nnx.Linear(config.width, config.vocab, use_bias=False, **_DENSE, rngs=rngs)
        self.autocast_dtype = None  # bfloat16 under an emulated torch.autocast (remat.crosscheck.autocast)

    def hidden(self, ids: jax.Array) -> jax.Array:
        """The final norm's output ``(B, T, width)``, the LM head's input."""
        return self.model(ids)

    def head_weight(self) -> jax.Array:
        """The LM head's weight as ``(vocab, width)`` (PyTorch's layout), the embedding when tied."""
        if hasattr(self, "lm_head"):
            return self.lm_head.kernel[...].T
        return self.model.embed_tokens.embedding[...]

    def __call__(self, ids: jax.Array) -> jax.Array:
        h = self.hidden(ids)
        if hasattr(self, "lm_head"):
            return self.lm_head(h)
        if self.autocast_dtype is None:
            return tied_logits(h, self.model.embed_tokens.embedding[...])
        # under torch.autocast the tied head is a bfloat16 nn.Linear; the embedding lookup stays float32
        w = self.model.embed_tokens.embedding[...].astype(self.autocast_dtype)
        return tied_logits(h.astype(self.autocast_dtype), w, preferred_element_type=jnp.float32).astype(
            self.autocast_dtype)


class ScannedLlamaForCausalLM(nnx.Module):
    """The same Llama with its decoder layers stacked and run by :func:`remat.scan.scan_nnx_layers`.

    Built from an unrolled :class:`LlamaForCausalLM` (:meth:`from_unrolled`), sharing its
    embedding, final norm and head and holding its layers' parameters stacked on a leading
    axis: one compiled layer body instead of ``depth``. Each layer is checkpointed with
    ``policy`` (``"nothing"``, as :class:`RematSettings`' default; None: no checkpoint).
    """

    def __init__(self, model: LlamaForCausalLM, policy: Any = "nothing"):
        layers = list(model.model.layers)
        graphdef, first = nnx.split(layers[0])
        states = [first, *(nnx.split(layer)[1] for layer in layers[1:])]
        self.layers = nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))
        self.embed_tokens, self.norm = model.model.embed_tokens, model.model.norm
        self.lm_head = getattr(model, "lm_head", None)
        self.head_dim, self.rope_theta, self.policy = model.model.head_dim, model.model.rope_theta, policy

    def hidden(self, ids: jax.Array) -> jax.Array:
        """The final norm's output ``(B, T, width)``."""
        from remat.scan import scan_nnx_layers

        x = self.embed_tokens(ids)
        cos, sin = rotary_tables(ids.shape[1], self.head_dim, self.rope_theta, x.dtype)
        x = scan_nnx_layers(self.layers, x, policy=self.policy, call=lambda layer, h: layer(h, cos, sin))
        return self.norm(x)

    def head_weight(self) -> jax.Array:
        """The LM head's weight as ``(vocab, width)``, the embedding when tied."""
        return self.embed_tokens.embedding[...] if self.lm_head is None else self.lm_head.kernel[...].T

    def __call__(self, ids: jax.Array) -> jax.Array:
        h = self.hidden(ids)
        return tied_logits(h, self.embed_tokens.embedding[...]) if self.lm_head is None else self.lm_head(h)


def hf_config(config: LlamaConfig) -> Any:
    """The ``transformers.LlamaConfig`` of the twin: the same sizes, no KV cache (a training setup)."""
    t = transformers_module()
    return t.LlamaConfig(
        vocab_size=config.vocab, hidden_size=config.width, intermediate_size=config.mlp_width,
        num_hidden_layers=config.depth, num_attention_heads=config.heads, num_key_value_heads=config.kv_heads,
        max_position_embeddings=config.seq_len, rms_norm_eps=config.rms_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=config.tie_embeddings, bos_token_id=0, eos_token_id=1, use_cache=False)


def make_torch_model(config: LlamaConfig) -> Any:
    """The stock ``transformers.LlamaForCausalLM`` (its own random init), checkpointed per ``config.remat``."""
    model = transformers_module().LlamaForCausalLM(hf_config(config))
    checkpoint_hf_layers(model, model.model.layers, config.remat)
    return model


def build(config: LlamaConfig | None = None, seed: int = 0) -> tuple[Any, Any, tuple]:
    """``(jax_model, hf_model, example_inputs)`` with identical weights (HuggingFace's init).

    Args:
      config: the sizes; the default is small enough for tests.
      seed: seeds torch's initialisation and the example batch.

    Returns:
      The NNX model, the ``transformers.LlamaForCausalLM`` and a tuple of NumPy token ids.

    Raises:
      ImportError: one line, when ``transformers`` is not installed.
    """
    config = config if config is not None else LlamaConfig()
    jax_model, torch_model = build_pair(LlamaForCausalLM, make_torch_model, config, seed)
    return jax_model, torch_model, example_inputs(config, seed)

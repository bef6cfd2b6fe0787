"""GPT-2 in Flax NNX whose PyTorch twin is ``transformers.GPT2LMHeadModel``.

Token and learned position embeddings, ``depth`` pre-LayerNorm blocks (causal multi-head
self-attention with a fused ``c_attn`` projection, then a 4x-wide MLP with GPT-2's tanh
GELU), a final ``ln_f`` and an LM head tied to the token embedding, as in HuggingFace's
GPT-2. The attribute names follow HuggingFace's (``transformer.h.0.attn.c_attn``,
``transformer.ln_f``), so :func:`remat.crosscheck.load_torch_state` fills the NNX model from
the stock ``GPT2LMHeadModel`` without ``rename=``, with two things the bridge reads from the
torch modules themselves: GPT-2's ``Conv1D`` stores its weight as ``(in, out)``, the layout
of an ``nnx.Linear`` kernel (so it is not transposed, where an ``nn.Linear`` weight is), and
``lm_head.weight`` is the token embedding (tied: the NNX model has no ``lm_head`` and
computes the logits with ``wte.attend``).

Each block is one block of :class:`RematSettings`: the NNX block is checkpointed with
:func:`remat.checkpoint`, the twin's with HuggingFace's own activation checkpointing.
Inside each block the attention output is tagged ``"attn_out"`` and the MLP
pre-activation ``"mlp_hidden"``. The twin's dropout rates are 0, so train mode matches too.

Needs ``transformers`` for the twin only (``pip install 'remat[hf]'``).

Example:
  >>> from remat.models import gpt2
  >>> jm, tm, (ids,) = gpt2.build(gpt2.GPT2Config())  # doctest: +SKIP
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
from remat.models._twin import build_pair, sdpa_like_torch
from remat.models._twin import token_inputs as example_inputs  # noqa: F401  (the registry's)
from remat.models._twin import token_targets as example_targets  # noqa: F401  (the registry's)

CHECKPOINT_NAMES = ("attn_out", "mlp_hidden")
LN_EPS = 1e-5  # GPT-2's layer_norm_epsilon

#: ``dtype -> (rtol, atol)`` against the stock twin: none needed, GPT-2 computes everything
#: in the model's dtype (no float32 islands), so the library defaults hold in both dtypes.
TOLERANCES: dict[str, tuple[float, float]] = {}


def TRAINING_EXCLUDE(name: str) -> bool:  # noqa: N802  (a constant of the registry, spelled like the others)
    """The attention biases ``c_attn.bias``: their key third has a gradient that is zero in
    theory (a key bias adds the same score to every key of a query, which softmax cancels),
    so Adam turns its float32 rounding noise into full steps."""
    return name.endswith("attn.c_attn.bias")


#: float32 under Adam: besides the key bias, any gradient element that is near zero by chance
#: (seed 0: one of ``h.1.ln_2.bias`` at 1.8e-8, against ~1e-3 for the rest) turns rounding noise
#: into a step; the worst such row measured is 2.1e-3 (docs/crosscheck.md).
TRAINING_TOLERANCES: dict[str, tuple[float, float]] = {"float32": (5e-3, 1e-5)}


@dataclass(frozen=True)
class GPT2Config:
    """Sizes and remat settings of :class:`GPT2LMHeadModel` (and of its twin's ``transformers.GPT2Config``)."""

    vocab: int = 64
    width: int = 32
    depth: int = 2
    heads: int = 4
    seq_len: int = 8
    batch: int = 2
    remat: RematSettings = field(default_factory=RematSettings)

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(f"GPT2Config: width={self.width} is not divisible by heads={self.heads}")


def _layer_norm(width: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return ops.LayerNorm(width, epsilon=LN_EPS, use_fast_variance=False, rngs=rngs)


class GPT2Attention(nnx.Module):
    """Causal multi-head self-attention with HuggingFace's fused ``c_attn`` (q, k, v in that order)."""

    def __init__(self, width: int, heads: int, *, rngs: nnx.Rngs):
        self.c_attn = nnx.Linear(width, 3 * width, rngs=rngs)  # HF Conv1D(3 * width, width)
        self.c_proj = nnx.Linear(width, width, rngs=rngs)
        self.heads = heads

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, c = x.shape
        hd = c // self.heads
        q, k, v = (a.reshape(b, t, self.heads, hd).transpose(0, 2, 1, 3) for a in jnp.split(self.c_attn(x), 3, -1))
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        y = sdpa_like_torch(q, k, v, hd ** -0.5, causal)
        return self.c_proj(y.transpose(0, 2, 1, 3).reshape(b, t, c))


class GPT2MLP(nnx.Module):
    """``c_fc`` (C -> 4C), GPT-2's tanh GELU, ``c_proj`` (4C -> C); the pre-activation is tagged."""

    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.c_fc = nnx.Linear(width, 4 * width, rngs=rngs)
        self.c_proj = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = remat.checkpoint_name(self.c_fc(x), "mlp_hidden")
        return self.c_proj(ops.gelu(h, approximate=True))  # HF's "gelu_new"


class GPT2Block(nnx.Module):
    """``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, width: int, heads: int, *, rngs: nnx.Rngs):
        self.ln_1 = _layer_norm(width, rngs)
        self.attn = GPT2Attention(width, heads, rngs=rngs)
        self.ln_2 = _layer_norm(width, rngs)
        self.mlp = GPT2MLP(width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + remat.checkpoint_name(self.attn(self.ln_1(x)), "attn_out")
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nnx.Module):
    """Embeddings, blocks ``h`` (each a remat block) and ``ln_f``: ids -> hidden states."""

    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs):
        self.wte = nnx.Embed(config.vocab, config.width, rngs=rngs)
        self.wpe = nnx.Embed(config.seq_len, config.width, rngs=rngs)
        self.h = nnx.data([GPT2Block(config.width, config.heads, rngs=rngs) for _ in range(config.depth)])
        self.ln_f = _layer_norm(config.width, rngs)
        self.settings = config.remat

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.wte(ids) + self.wpe(jnp.arange(ids.shape[1]))
        for i, block in enumerate(self.h):
            x = jax_block(self.settings, i, block, x, tagged=CHECKPOINT_NAMES)
        return self.ln_f(x)


class GPT2LMHeadModel(nnx.Module):
    """The Flax NNX GPT-2: token ids ``(B, T)`` -> logits ``(B, T, vocab)``, the head tied to ``wte``."""

    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs):
        self.transformer = GPT2Model(config, rngs=rngs)
        self.autocast_dtype = None  # bfloat16 under an emulated torch.autocast (remat.crosscheck.autocast)

    def __call__(self, ids: jax.Array) -> jax.Array:
        h = self.transformer(ids)
        if self.autocast_dtype is None:
            return self.transformer.wte.attend(h)
        # under torch.autocast the tied head is a bfloat16 nn.Linear; the embedding lookup stays float32
        w = self.transformer.wte.embedding[...].astype(self.autocast_dtype)
        return jnp.matmul(h.astype(self.autocast_dtype), w.T, preferred_element_type=jnp.float32
                          ).astype(self.autocast_dtype)


def hf_config(config: GPT2Config) -> Any:
    """The ``transformers.GPT2Config`` of the twin: the same sizes, no dropout, no KV cache (a training setup)."""
    t = transformers_module()
    return t.GPT2Config(
        vocab_size=config.vocab, n_positions=config.seq_len, n_embd=config.width, n_layer=config.depth,
        n_head=config.heads, layer_norm_epsilon=LN_EPS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=config.vocab - 1, eos_token_id=config.vocab - 1, use_cache=False)


def make_torch_model(config: GPT2Config) -> Any:
    """The stock ``transformers.GPT2LMHeadModel`` (its own random init), checkpointed per ``config.remat``."""
    model = transformers_module().GPT2LMHeadModel(hf_config(config))
    checkpoint_hf_layers(model, model.transformer.h, config.remat)
    return model


def build(config: GPT2Config | None = None, seed: int = 0) -> tuple[Any, Any, tuple]:
    """``(jax_model, hf_model, example_inputs)`` with identical weights (HuggingFace's init).

    Args:
      config: the sizes; the default is small enough for tests.
      seed: seeds torch's initialisation and the example batch.

    Returns:
      The NNX model, the ``transformers.GPT2LMHeadModel`` and a tuple of NumPy token ids.

    Raises:
      ImportError: one line, when ``transformers`` is not installed.
    """
    config = config if config is not None else GPT2Config()
    jax_model, torch_model = build_pair(GPT2LMHeadModel, make_torch_model, config, seed)
    return jax_model, torch_model, example_inputs(config, seed)

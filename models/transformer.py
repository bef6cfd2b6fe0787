"""A GPT-style decoder, as a Flax NNX model and its PyTorch twin.

Token + learned position embeddings (``wte``, ``wpe``), ``depth`` pre-LayerNorm blocks
(causal multi-head self-attention, fused ``qkv`` or separate ``q``/``k``/``v``, then a
4x-wide MLP with exact erf GELU), a final LayerNorm ``ln_f`` and an LM head without bias.
Attention is written out (scores, causal mask, softmax) in both frameworks so that the
two compute the same thing step by step. LayerNorm, softmax and GELU are the
:mod:`remat.ops` versions: the same values as Flax's and ``jax.nn``'s, with backward
passes that keep what PyTorch's keep. Inside each block the attention output is tagged
``"attn_out"`` and the MLP pre-activation ``"mlp_hidden"``.

The block stack is the list ``model.blocks``: ``remat.checkpoint_sequential(model.blocks,
k, x)`` runs it on embedded inputs ``x`` of shape ``(batch, seq, width)``.

Example:
  >>> from remat.models import transformer
  >>> jm, tm, (ids,) = transformer.build(transformer.TransformerConfig())  # doctest: +SKIP
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import remat
from remat import ops
from remat.models._settings import RematSettings, jax_block, torch_block
from remat.models._twin import build_pair, softmax_like_torch
from remat.models._twin import token_inputs as example_inputs  # noqa: F401  (the registry's)
from remat.models._twin import token_targets as example_targets  # noqa: F401  (the registry's)

CHECKPOINT_NAMES = ("attn_out", "mlp_hidden")
LN_EPS = 1e-5  # torch.nn.LayerNorm's default (Flax's is 1e-6)


@dataclass(frozen=True)
class TransformerConfig:
    """Sizes and remat settings of :class:`Transformer`."""

    vocab: int = 64
    depth: int = 2
    width: int = 32
    heads: int = 4
    seq_len: int = 8
    batch: int = 2
    fused_qkv: bool = True
    remat: RematSettings = field(default_factory=RematSettings)

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(f"TransformerConfig: width={self.width} is not divisible by heads={self.heads}")


def _layer_norm(width: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
    # remat.ops.LayerNorm: nnx.LayerNorm's parameters and values, PyTorch's saved tensors
    return ops.LayerNorm(width, epsilon=LN_EPS, use_fast_variance=False, rngs=rngs)


class Attention(nnx.Module):
    """Causal multi-head self-attention, ``(B, T, C) -> (B, T, C)``."""

    def __init__(self, width: int, heads: int, fused_qkv: bool, *, rngs: nnx.Rngs):
        if fused_qkv:
            self.qkv = nnx.Linear(width, 3 * width, rngs=rngs)
        else:
            self.q = nnx.Linear(width, width, rngs=rngs)
            self.k = nnx.Linear(width, width, rngs=rngs)
            self.v = nnx.Linear(width, width, rngs=rngs)
        self.proj = nnx.Linear(width, width, rngs=rngs)
        self.heads = heads
        self.fused_qkv = fused_qkv

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, c = x.shape
        if self.fused_qkv:
            q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        hd = c // self.heads
        q, k, v = (a.reshape(b, t, self.heads, hd).transpose(0, 2, 1, 3) for a in (q, k, v))
        scores = q @ k.transpose(0, 1, 3, 2)
        # divided in float32 and rounded once, as torch's bfloat16 kernel does with its float32 scalar
        # (a Python float is rounded to bfloat16 here first: sqrt(8) becomes 2.828125); no-op in float32
        scores = (scores.astype(jnp.promote_types(scores.dtype, jnp.float32)) / math.sqrt(hd)).astype(scores.dtype)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        # masked entries come out 0, as after torch's masked_fill(-inf); the backward
        # keeps only the probabilities (jnp.where + jax.nn.softmax keep three more arrays)
        y = softmax_like_torch(scores, where=causal) @ v
        return self.proj(y.transpose(0, 2, 1, 3).reshape(b, t, c))


class MLP(nnx.Module):
    """``fc`` (C -> 4C), exact GELU, ``proj`` (4C -> C); the pre-activation is tagged."""

    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.fc = nnx.Linear(width, 4 * width, rngs=rngs)
        self.proj = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = remat.checkpoint_name(self.fc(x), "mlp_hidden")
        return self.proj(ops.gelu(h))


class Block(nnx.Module):
    """A pre-LayerNorm decoder block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, width: int, heads: int, fused_qkv: bool, *, rngs: nnx.Rngs):
        self.ln1 = _layer_norm(width, rngs)
        self.attn = Attention(width, heads, fused_qkv, rngs=rngs)
        self.ln2 = _layer_norm(width, rngs)
        self.mlp = MLP(width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + remat.checkpoint_name(self.attn(self.ln1(x)), "attn_out")
        return x + self.mlp(self.ln2(x))


class Transformer(nnx.Module):
    """The Flax NNX decoder: token ids ``(B, T)`` -> logits ``(B, T, vocab)``."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.wte = nnx.Embed(config.vocab, config.width, rngs=rngs)
        self.wpe = nnx.Embed(config.seq_len, config.width, rngs=rngs)
        self.blocks = nnx.data([Block(config.width, config.heads, config.fused_qkv, rngs=rngs)
                                for _ in range(config.depth)])
        self.ln_f = _layer_norm(config.width, rngs)
        self.head = nnx.Linear(config.width, config.vocab, use_bias=False, rngs=rngs)
        self.settings = config.remat

    def embed(self, ids: jax.Array) -> jax.Array:
        """Token plus position embeddings, ``(B, T) -> (B, T, width)``."""
        return self.wte(ids) + self.wpe(jnp.arange(ids.shape[1]))

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.embed(ids)
        for i, block in enumerate(self.blocks):
            x = jax_block(self.settings, i, block, x, tagged=CHECKPOINT_NAMES)
        return self.head(self.ln_f(x))


@functools.cache
def torch_classes() -> Any:
    """The PyTorch twin classes (defined on first use: importing this module needs no torch)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class TorchAttention(nn.Module):
        def __init__(self, width: int, heads: int, fused_qkv: bool):
            super().__init__()
            if fused_qkv:
                self.qkv = nn.Linear(width, 3 * width)
            else:
                self.q = nn.Linear(width, width)
                self.k = nn.Linear(width, width)
                self.v = nn.Linear(width, width)
            self.proj = nn.Linear(width, width)
            self.heads = heads
            self.fused_qkv = fused_qkv

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, c = x.shape
            if self.fused_qkv:
                q, k, v = self.qkv(x).split(c, dim=-1)
            else:
                q, k, v = self.q(x), self.k(x), self.v(x)
            hd = c // self.heads
            q, k, v = (a.view(b, t, self.heads, hd).transpose(1, 2) for a in (q, k, v))
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
            causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device))
            scores = scores.masked_fill(~causal, float("-inf"))
            y = torch.softmax(scores, dim=-1) @ v
            return self.proj(y.transpose(1, 2).reshape(b, t, c))

    class TorchMLP(nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.fc = nn.Linear(width, 4 * width)
            self.proj = nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(F.gelu(self.fc(x)))

    class TorchBlock(nn.Module):
        def __init__(self, width: int, heads: int, fused_qkv: bool):
            super().__init__()
            self.ln1 = nn.LayerNorm(width, eps=LN_EPS)
            self.attn = TorchAttention(width, heads, fused_qkv)
            self.ln2 = nn.LayerNorm(width, eps=LN_EPS)
            self.mlp = TorchMLP(width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class TorchTransformer(nn.Module):
        def __init__(self, config: TransformerConfig):
            super().__init__()
            self.wte = nn.Embedding(config.vocab, config.width)
            self.wpe = nn.Embedding(config.seq_len, config.width)
            self.blocks = nn.ModuleList([TorchBlock(config.width, config.heads, config.fused_qkv)
                                         for _ in range(config.depth)])
            self.ln_f = nn.LayerNorm(config.width, eps=LN_EPS)
            self.head = nn.Linear(config.width, config.vocab, bias=False)
            self.settings = config.remat

        def embed(self, ids: torch.Tensor) -> torch.Tensor:
            return self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.embed(ids)
            for i, block in enumerate(self.blocks):
                x = torch_block(self.settings, i, block, x)
            return self.head(self.ln_f(x))

    return type("TransformerTorchClasses", (), {
        "Attention": TorchAttention, "MLP": TorchMLP, "Block": TorchBlock, "Transformer": TorchTransformer,
    })


def make_torch_model(config: TransformerConfig) -> Any:
    """The PyTorch twin of ``Transformer(config)`` (torch's default initialisation)."""
    return torch_classes().Transformer(config)


def build(config: TransformerConfig | None = None, seed: int = 0) -> tuple[Any, Any, tuple]:
    """``(jax_model, torch_model, example_inputs)`` with identical weights (torch's init).

    Args:
      config: the sizes; the default is small enough for tests.
      seed: seeds torch's initialisation and the example batch.

    Returns:
      The NNX model, its PyTorch twin and a tuple of NumPy inputs (token ids).
    """
    config = config if config is not None else TransformerConfig()
    jax_model, torch_model = build_pair(Transformer, make_torch_model, config, seed)
    return jax_model, torch_model, example_inputs(config, seed)

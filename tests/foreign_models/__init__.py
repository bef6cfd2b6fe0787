"""Models written elsewhere, without any remat: stand-ins for a package whose source the user cannot edit.

``tests/test_apply_checkpointing.py`` turns checkpointing on in them from outside with
``remat.apply_checkpointing``; nothing here imports remat.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx


class MixerBlock(nnx.Module):
    """A pre-LayerNorm GELU MLP block with a residual connection."""

    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class Mixer(nnx.Module):
    """``depth`` :class:`MixerBlock` s between an input and an output projection."""

    def __init__(self, in_dim: int, width: int, depth: int, out_dim: int, *, rngs: nnx.Rngs):
        self.inp = nnx.Linear(in_dim, width, rngs=rngs)
        self.blocks = nnx.List([MixerBlock(width, rngs=rngs) for _ in range(depth)])
        self.out = nnx.Linear(width, out_dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class LinenBlock(nn.Module):
    """A pre-LayerNorm GELU MLP block with dropout, Linen style (``@nn.compact``)."""

    width: int
    rate: float = 0.1

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
        h = nn.Dense(4 * self.width)(nn.LayerNorm()(x))
        h = nn.Dropout(self.rate, deterministic=deterministic)(jax.nn.gelu(h))
        return x + nn.Dense(self.width)(h)


class LinenMixer(nn.Module):
    """``depth`` :class:`LinenBlock` s and a head; the blocks are auto-named ``LinenBlock_i``."""

    width: int = 64
    depth: int = 4
    out_dim: int = 8

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
        x = nn.Dense(self.width)(x)
        for _ in range(self.depth):
            x = LinenBlock(self.width)(x, deterministic)
        return nn.Dense(self.out_dim)(jnp.tanh(x))


class EncoderDecoder(nnx.Module):
    """:class:`MixerBlock` s in an encoder and a decoder, with ``encode`` and ``decode`` entry points."""

    def __init__(self, width: int, depth: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Linear(16, width, rngs=rngs)
        self.encoder = nnx.List([MixerBlock(width, rngs=rngs) for _ in range(depth)])
        self.decoder = nnx.List([MixerBlock(width, rngs=rngs) for _ in range(depth)])
        self.head = nnx.Linear(width, 8, rngs=rngs)

    def encode(self, x: jax.Array) -> jax.Array:
        h = self.embed(x)
        for block in self.encoder:
            h = block(h)
        return h

    def decode(self, h: jax.Array) -> jax.Array:
        for block in self.decoder:
            h = block(h)
        return self.head(jnp.tanh(h))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.decode(self.encode(x))


class TiedLM(nnx.Module):
    """A language model whose output layer is its embedding's ``attend``, as tied-weight models have."""

    def __init__(self, vocab: int, width: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.block = MixerBlock(width, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return self.embed.attend(self.block(self.embed(ids)))


class LinenEncoderDecoder(nn.Module):
    """:class:`LinenBlock` s (from ``setup``) in an encoder and a decoder, with ``encode`` and
    ``decode`` entry points, as Flax's WMT model has."""

    width: int = 16
    depth: int = 2

    def setup(self) -> None:
        self.embed = nn.Dense(self.width)
        self.encoder = [LinenBlock(self.width) for _ in range(self.depth)]
        self.decoder = [LinenBlock(self.width) for _ in range(self.depth)]
        self.head = nn.Dense(8)

    def encode(self, x: jax.Array) -> jax.Array:
        h = self.embed(x)
        for block in self.encoder:
            h = block(h)
        return h

    def decode(self, h: jax.Array) -> jax.Array:
        for block in self.decoder:
            h = block(h)
        return self.head(jnp.tanh(h))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.decode(self.encode(x))


class LinenTiedLM(nn.Module):
    """:class:`TiedLM` in Linen: the output layer is ``nn.Embed.attend``."""

    vocab: int = 32
    width: int = 16

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        embed = nn.Embed(self.vocab, self.width)
        return embed.attend(LinenBlock(self.width)(embed(ids)))

"""A configurable MLP, as a Flax NNX model and its PyTorch twin.

``inp`` (in_dim->width) + activation, then ``depth`` blocks ``act(Linear(width->width))``
(the block stack is the list ``model.blocks``, so
``remat.checkpoint_sequential(model.blocks, k, x)`` works), then ``head`` (width->out_dim).
Each block tags its pre-activation ``"mlp_hidden"``.

Example:
  >>> from remat.models import mlp
  >>> jm, tm, (x,) = mlp.build(mlp.MLPConfig(depth=2, width=16))  # doctest: +SKIP
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from flax import nnx

import remat
from remat import ops
from remat.models._settings import RematSettings, jax_block, torch_block
from remat.models._twin import build_pair

#: Names this model tags with ``remat.checkpoint_name`` (the ``"names"`` policy saves them).
CHECKPOINT_NAMES = ("mlp_hidden",)
ACTIVATIONS = ("relu", "gelu", "tanh")


@dataclass(frozen=True)
class MLPConfig:
    """Sizes and remat settings of :class:`MLP`; ``activation`` is relu, gelu (exact) or tanh."""

    in_dim: int = 16
    width: int = 32
    depth: int = 2
    out_dim: int = 8
    activation: str = "relu"
    batch: int = 8
    remat: RematSettings = field(default_factory=RematSettings)

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MLPConfig(activation={self.activation!r}): use one of {', '.join(ACTIVATIONS)}")


def jax_activation(name: str):
    """The activation ``name`` from :mod:`remat.ops` (PyTorch's saved tensors, JAX's values)."""
    return {"relu": ops.relu, "gelu": ops.gelu, "tanh": ops.tanh}[name]


class Block(nnx.Module):
    """``act(linear(x))`` with the pre-activation tagged ``"mlp_hidden"``."""

    def __init__(self, width: int, activation: str, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(width, width, rngs=rngs)
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax_activation(self.activation)(remat.checkpoint_name(self.linear(x), "mlp_hidden"))


class MLP(nnx.Module):
    """The Flax NNX MLP; ``blocks[i]`` is checkpointed when ``config.remat.applies(i)``."""

    def __init__(self, config: MLPConfig, *, rngs: nnx.Rngs):
        self.inp = nnx.Linear(config.in_dim, config.width, rngs=rngs)
        self.blocks = nnx.data([Block(config.width, config.activation, rngs=rngs) for _ in range(config.depth)])
        self.head = nnx.Linear(config.width, config.out_dim, rngs=rngs)
        self.activation = config.activation
        self.settings = config.remat

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jax_activation(self.activation)(self.inp(x))
        for i, block in enumerate(self.blocks):
            x = jax_block(self.settings, i, block, x, tagged=CHECKPOINT_NAMES)
        return self.head(x)


@functools.cache
def torch_classes() -> Any:
    """The PyTorch twin classes (defined on first use: importing this module needs no torch)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    acts = {"relu": torch.relu, "gelu": F.gelu, "tanh": torch.tanh}

    class TorchBlock(nn.Module):
        def __init__(self, width: int, activation: str):
            super().__init__()
            self.linear = nn.Linear(width, width)
            self.activation = activation

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return acts[self.activation](self.linear(x))

    class TorchMLP(nn.Module):
        def __init__(self, config: MLPConfig):
            super().__init__()
            self.inp = nn.Linear(config.in_dim, config.width)
            self.blocks = nn.ModuleList([TorchBlock(config.width, config.activation) for _ in range(config.depth)])
            self.head = nn.Linear(config.width, config.out_dim)
            self.activation = config.activation
            self.settings = config.remat

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = acts[self.activation](self.inp(x))
            for i, block in enumerate(self.blocks):
                x = torch_block(self.settings, i, block, x)
            return self.head(x)

    return type("MLPTorchClasses", (), {"Block": TorchBlock, "MLP": TorchMLP})


def make_torch_model(config: MLPConfig) -> Any:
    """The PyTorch twin of ``MLP(config)`` (torch's default initialisation)."""
    return torch_classes().MLP(config)


def example_inputs(config: MLPConfig, seed: int = 0) -> tuple[np.ndarray, ...]:
    """One float32 batch ``(batch, in_dim)``."""
    return (np.random.default_rng(seed).standard_normal((config.batch, config.in_dim)).astype(np.float32),)


def example_targets(config: MLPConfig, seed: int = 0) -> np.ndarray:
    """Class labels ``(batch,)`` in ``[0, out_dim)`` for a cross-entropy training run."""
    return np.random.default_rng(seed + 1).integers(0, config.out_dim, size=(config.batch,)).astype(np.int64)


def build(config: MLPConfig | None = None, seed: int = 0) -> tuple[Any, Any, tuple]:
    """``(jax_model, torch_model, example_inputs)`` with identical weights (torch's init).

    Args:
      config: the sizes; the default is small enough for tests.
      seed: seeds torch's initialisation and the example batch.

    Returns:
      The NNX model, its PyTorch twin and a tuple of NumPy inputs in PyTorch's layout.
    """
    config = config if config is not None else MLPConfig()
    jax_model, torch_model = build_pair(MLP, make_torch_model, config, seed)
    return jax_model, torch_model, example_inputs(config, seed)

"""The two seed examples of the project, as Flax NNX models with their PyTorch twins.

``Model`` (first seed): ``fc1`` Linear 10->20, ``fc2`` Linear 20->30, with ``fc2``
checkpointed: ``x = fc1(x); x = checkpoint(fc2, x)``.

``MyModel`` (second seed): ``linear1`` -> checkpointed ``activation`` (ReLU, a method) ->
``linear2``. The seed called ``torch.utils.checkpoint(...)``, which is a module, not a
function; the twin uses ``torch.utils.checkpoint.checkpoint(self.activation, y,
use_reentrant=False)``. The sizes default to the seed's 1000 and are configurable.

Example:
  >>> from remat.models import seed
  >>> jax_model, torch_model, (x,) = seed.build(seed.ModelConfig(), seed=0)  # doctest: +SKIP
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from flax import nnx

from remat.models._settings import RematSettings, jax_block, torch_block
from remat.models._twin import build_pair


@dataclass(frozen=True)
class ModelConfig:
    """The first seed: ``fc1`` in_dim->hidden, ``fc2`` hidden->out_dim (checkpointed)."""

    in_dim: int = 10
    hidden: int = 20
    out_dim: int = 30
    batch: int = 4
    remat: RematSettings = field(default_factory=RematSettings)


@dataclass(frozen=True)
class MyModelConfig:
    """The second seed: ``linear1`` size->size, checkpointed ReLU, ``linear2`` size->size."""

    size: int = 1000
    batch: int = 4
    remat: RematSettings = field(default_factory=RematSettings)


class Model(nnx.Module):
    """The first seed in Flax NNX; block 0 is the ``fc2`` region."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(config.in_dim, config.hidden, rngs=rngs)
        self.fc2 = nnx.Linear(config.hidden, config.out_dim, rngs=rngs)
        self.settings = config.remat

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.fc1(x)
        return jax_block(self.settings, 0, self.fc2, x)


class MyModel(nnx.Module):
    """The second seed in Flax NNX; block 0 is the ``activation`` region."""

    def __init__(self, config: MyModelConfig, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(config.size, config.size, rngs=rngs)
        self.linear2 = nnx.Linear(config.size, config.size, rngs=rngs)
        self.settings = config.remat

    def activation(self, y: jax.Array) -> jax.Array:
        return jax.nn.relu(y)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.linear1(x)
        y = jax_block(self.settings, 0, self.activation, y)
        return self.linear2(y)


@functools.cache
def torch_classes() -> Any:
    """The PyTorch twins (defined on first use, so importing this module needs no torch)."""
    import torch
    from torch import nn

    class TorchModel(nn.Module):
        def __init__(self, config: ModelConfig):
            super().__init__()
            self.fc1 = nn.Linear(config.in_dim, config.hidden)
            self.fc2 = nn.Linear(config.hidden, config.out_dim)
            self.settings = config.remat

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.fc1(x)
            return torch_block(self.settings, 0, self.fc2, x)

    class TorchMyModel(nn.Module):
        def __init__(self, config: MyModelConfig):
            super().__init__()
            self.linear1 = nn.Linear(config.size, config.size)
            self.linear2 = nn.Linear(config.size, config.size)
            self.settings = config.remat

        def activation(self, y: torch.Tensor) -> torch.Tensor:
            return torch.relu(y)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.linear1(x)
            y = torch_block(self.settings, 0, self.activation, y)
            return self.linear2(y)

    return type("SeedTorchClasses", (), {"Model": TorchModel, "MyModel": TorchMyModel})


def make_torch_model(config: ModelConfig | MyModelConfig) -> Any:
    """The PyTorch twin for ``config`` (torch's default initialisation)."""
    cls = torch_classes()
    return cls.Model(config) if isinstance(config, ModelConfig) else cls.MyModel(config)


def example_inputs(config: ModelConfig | MyModelConfig, seed: int = 0) -> tuple[np.ndarray, ...]:
    """One float32 batch, ``(batch, in_dim)``, in PyTorch's layout."""
    dim = config.in_dim if isinstance(config, ModelConfig) else config.size
    return (np.random.default_rng(seed).standard_normal((config.batch, dim)).astype(np.float32),)


def example_targets(config: ModelConfig | MyModelConfig, seed: int = 0) -> np.ndarray:
    """Regression targets for training-parity runs (mean-squared error)."""
    dim = config.out_dim if isinstance(config, ModelConfig) else config.size
    return np.random.default_rng(seed + 1).standard_normal((config.batch, dim)).astype(np.float32)


def build(config: ModelConfig | MyModelConfig | None = None, seed: int = 0) -> tuple[Any, Any, tuple]:
    """``(jax_model, torch_model, example_inputs)`` with identical weights (torch's init).

    Args:
      config: a :class:`ModelConfig` (first seed, the default) or :class:`MyModelConfig`.
      seed: seeds torch's initialisation and the example batch.

    Returns:
      The NNX model, its PyTorch twin, and a tuple of NumPy inputs in PyTorch's layout.

    Example:
      >>> jm, tm, (x,) = build(MyModelConfig(size=16))  # doctest: +SKIP
    """
    config = config if config is not None else ModelConfig()
    cls = Model if isinstance(config, ModelConfig) else MyModel
    jax_model, torch_model = build_pair(cls, make_torch_model, config, seed)
    return jax_model, torch_model, example_inputs(config, seed)


def build_mymodel(config: MyModelConfig | None = None, seed: int = 0) -> tuple[Any, Any, tuple]:
    """:func:`build` for the second seed (default :class:`MyModelConfig`)."""
    return build(config if config is not None else MyModelConfig(), seed)

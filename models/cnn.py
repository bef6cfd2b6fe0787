"""A small CNN with BatchNorm, as a Flax NNX model and its PyTorch twin.

Blocks ``Conv2d(3x3, padding 1, no bias) -> BatchNorm -> ReLU -> pool(2x2)`` (max or
average, the same in both), then global average pooling and a linear ``head``. The
convolutions have no bias, as usual before BatchNorm: in train mode BatchNorm subtracts
it again, so its gradient is zero up to rounding, and Adam (which divides by the
gradient's root mean square) would turn that rounding noise into full-size steps that
differ between the frameworks. The JAX model takes
NHWC images, the twin NCHW; :func:`remat.crosscheck.compare_gradients` transposes for you.

BatchNorm follows PyTorch exactly (:class:`remat.ops.BatchNorm`, also importable here as
``BatchNorm``): batch statistics in train mode, running statistics in eval mode
(``model.train()`` / ``model.eval()`` in both), and the running averages updated as
``r = momentum * r + (1 - momentum) * stat`` with Flax's momentum convention
(``momentum=0.9`` here is ``momentum=0.1`` in torch) and, as in torch, the *unbiased*
batch variance ``var * n / (n - 1)`` in the running-variance update (``nnx.BatchNorm``
uses the biased one; the normalisation itself uses the biased one in all three).

Example:
  >>> from remat.models import cnn
  >>> jm, tm, (x,) = cnn.build(cnn.CNNConfig())  # doctest: +SKIP
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import jax
from flax import nnx

import remat
from remat import ops
from remat.models._settings import RematSettings, jax_block, torch_block
from remat.models._twin import build_pair
from remat.models._twin import image_inputs as example_inputs  # noqa: F401  (the registry's)
from remat.models._twin import image_targets as example_targets  # noqa: F401  (the registry's)
from remat.ops import BatchNorm  # public in remat.ops; the name models.cnn.BatchNorm stays

CHECKPOINT_NAMES = ("conv_out",)
BN_EPS = 1e-5


@dataclass(frozen=True)
class CNNConfig:
    """Sizes and remat settings of :class:`CNN`; ``pool`` is ``"max"`` or ``"avg"``."""

    in_channels: int = 3
    channels: tuple[int, ...] = (8, 16)
    image_size: int = 8
    num_classes: int = 10
    pool: str = "max"
    momentum: float = 0.9  # Flax convention; the torch twin gets 1 - momentum
    batch: int = 4
    remat: RematSettings = field(default_factory=RematSettings)

    def __post_init__(self) -> None:
        if self.pool not in ("max", "avg"):
            raise ValueError(f"CNNConfig(pool={self.pool!r}): use 'max' or 'avg'")
        object.__setattr__(self, "channels", tuple(self.channels))


class ConvBlock(nnx.Module):
    """``pool(relu(bn(conv(x))))`` on NHWC input; the convolution output is tagged."""

    def __init__(self, cin: int, cout: int, pool: str, momentum: float, *, rngs: nnx.Rngs):
        self.conv = nnx.Conv(cin, cout, kernel_size=(3, 3), padding=((1, 1), (1, 1)), use_bias=False, rngs=rngs)
        self.bn = BatchNorm(cout, momentum=momentum, epsilon=BN_EPS, rngs=rngs)
        self.pool = pool

    def __call__(self, x: jax.Array) -> jax.Array:
        x = ops.relu(self.bn(remat.checkpoint_name(self.conv(x), "conv_out")))
        pool = nnx.max_pool if self.pool == "max" else nnx.avg_pool
        return pool(x, window_shape=(2, 2), strides=(2, 2))


class CNN(nnx.Module):
    """The Flax NNX CNN: NHWC images -> logits ``(N, num_classes)``."""

    def __init__(self, config: CNNConfig, *, rngs: nnx.Rngs):
        chans = (config.in_channels, *config.channels)
        self.blocks = nnx.data([ConvBlock(a, b, config.pool, config.momentum, rngs=rngs)
                                for a, b in zip(chans[:-1], chans[1:])])
        self.head = nnx.Linear(chans[-1], config.num_classes, rngs=rngs)
        self.settings = config.remat
        self.input_layout = "NHWC"  # read by remat.crosscheck: torch inputs are NCHW

    def __call__(self, x: jax.Array) -> jax.Array:
        for i, block in enumerate(self.blocks):
            x = jax_block(self.settings, i, block, x, tagged=CHECKPOINT_NAMES)
        return self.head(x.mean(axis=(1, 2)))


@functools.cache
def torch_classes() -> Any:
    """The PyTorch twin classes (defined on first use: importing this module needs no torch)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class TorchConvBlock(nn.Module):
        def __init__(self, cin: int, cout: int, pool: str, momentum: float):
            super().__init__()
            self.conv = nn.Conv2d(cin, cout, kernel_size=3, padding=1, bias=False)
            self.bn = nn.BatchNorm2d(cout, eps=BN_EPS, momentum=1 - momentum)
            self.pool = pool

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.relu(self.bn(self.conv(x)))
            return F.max_pool2d(x, 2, 2) if self.pool == "max" else F.avg_pool2d(x, 2, 2)

    class TorchCNN(nn.Module):
        def __init__(self, config: CNNConfig):
            super().__init__()
            chans = (config.in_channels, *config.channels)
            self.blocks = nn.ModuleList([TorchConvBlock(a, b, config.pool, config.momentum)
                                         for a, b in zip(chans[:-1], chans[1:])])
            self.head = nn.Linear(chans[-1], config.num_classes)
            self.settings = config.remat

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i, block in enumerate(self.blocks):
                x = torch_block(self.settings, i, block, x)
            return self.head(x.mean(dim=(2, 3)))

    return type("CNNTorchClasses", (), {"ConvBlock": TorchConvBlock, "CNN": TorchCNN})


def make_torch_model(config: CNNConfig) -> Any:
    """The PyTorch twin of ``CNN(config)`` (torch's default initialisation)."""
    return torch_classes().CNN(config)


def build(config: CNNConfig | None = None, seed: int = 0) -> tuple[Any, Any, tuple]:
    """``(jax_model, torch_model, example_inputs)`` with identical weights (torch's init).

    Both models start in train mode (BatchNorm uses batch statistics); call ``.eval()``
    on both for running statistics.

    Args:
      config: the sizes; the default is small enough for tests (8x8 images).
      seed: seeds torch's initialisation and the example batch.

    Returns:
      The NNX model, its PyTorch twin and a tuple with one NCHW NumPy image batch.
    """
    config = config if config is not None else CNNConfig()
    jax_model, torch_model = build_pair(CNN, make_torch_model, config, seed)
    return jax_model, torch_model, example_inputs(config, seed)

"""A ResNet in Flax NNX whose PyTorch twin is ``transformers.ResNetForImageClassification``.

HuggingFace's ResNet with basic layers (ResNet-18/34 style): a stem (7x7 stride-2
convolution, BatchNorm, ReLU, 3x3 stride-2 max pooling), stages of residual layers (two
3x3 convolution + BatchNorm pairs, a 1x1 convolution + BatchNorm shortcut where the shape
changes; stride 2 from the second stage on), global average pooling and a linear
classifier. The attribute names follow HuggingFace's
(``resnet.encoder.stages.1.layers.0.shortcut.convolution``, ``classifier.1``), so
:func:`remat.crosscheck.load_torch_state` fills the NNX model from the stock model without
``rename=``; BatchNorm is :class:`remat.ops.BatchNorm`, whose running variance follows
torch's. A twin from a library rather than this repository (torchvision's wheel does not
load beside the CPU build of torch on this project's machines; ``transformers``' ResNet
is the same network).

Each residual layer, numbered across the stages, is one block of :class:`RematSettings`:
the NNX layer is checkpointed with :func:`remat.checkpoint`; HuggingFace's ResNet has no
activation checkpointing of its own, so the twin's layers go through
:func:`remat.crosscheck.torch_checkpoint`, which keeps torch's recomputation from updating
the BatchNorm statistics a second time. Each convolution output is tagged ``"conv_out"``.
The JAX model takes NHWC images, the twin NCHW.

Needs ``transformers`` for the twin only (``pip install 'remat[hf]'``).

Example:
  >>> from remat.models import hf_resnet
  >>> jm, tm, (x,) = hf_resnet.build(hf_resnet.ResNetConfig())  # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
from flax import nnx

import remat
from remat import ops
from remat.models._hf import checkpoint_torch_blocks, transformers_module
from remat.models._settings import RematSettings, jax_block
from remat.models._twin import build_pair
from remat.models._twin import image_inputs as example_inputs  # noqa: F401  (the registry's)
from remat.models._twin import image_targets as example_targets  # noqa: F401  (the registry's)

CHECKPOINT_NAMES = ("conv_out",)
BN_EPS = 1e-5
BN_MOMENTUM = 0.9  # Flax convention: torch.nn.BatchNorm2d's default momentum=0.1

#: ``dtype -> (rtol, atol)`` against the stock twin: none needed (no float32 islands).
TOLERANCES: dict[str, tuple[float, float]] = {}

TRAINING_TOLERANCES: dict[str, tuple[float, float]] = {}
TRAINING_EXCLUDE = None  # no parameter has a gradient that is zero in theory


@dataclass(frozen=True)
class ResNetConfig:
    """Sizes and remat settings of :class:`ResNetForImageClassification` (ResNet-18: ``embedding_size=64,
    hidden_sizes=(64, 128, 256, 512), depths=(2, 2, 2, 2)``)."""

    in_channels: int = 3
    embedding_size: int = 8
    hidden_sizes: tuple[int, ...] = (8, 16)
    depths: tuple[int, ...] = (1, 1)
    num_classes: int = 10
    image_size: int = 16
    batch: int = 4
    remat: RematSettings = field(default_factory=RematSettings)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden_sizes", tuple(self.hidden_sizes))
        object.__setattr__(self, "depths", tuple(self.depths))
        if len(self.hidden_sizes) != len(self.depths):
            raise ValueError(f"ResNetConfig: hidden_sizes {self.hidden_sizes} and depths {self.depths} "
                             "must have one entry per stage")


class ResNetConvLayer(nnx.Module):
    """``activation(normalization(convolution(x)))``, the convolution padded by ``kernel // 2``, without bias."""

    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1, relu: bool = True, *,
                 rngs: nnx.Rngs):
        pad = kernel // 2
        self.convolution = nnx.Conv(cin, cout, kernel_size=(kernel, kernel), strides=(stride, stride),
                                    padding=((pad, pad), (pad, pad)), use_bias=False, rngs=rngs)
        self.normalization = ops.BatchNorm(cout, momentum=BN_MOMENTUM, epsilon=BN_EPS, rngs=rngs)
        self.relu = relu

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.normalization(remat.checkpoint_name(self.convolution(x), "conv_out"))
        return ops.relu(x) if self.relu else x


class ResNetShortCut(nnx.Module):
    """The projection of the residual where the shape changes: 1x1 convolution (strided) and BatchNorm."""

    def __init__(self, cin: int, cout: int, stride: int, *, rngs: nnx.Rngs):
        self.convolution = nnx.Conv(cin, cout, kernel_size=(1, 1), strides=(stride, stride), padding="VALID",
                                    use_bias=False, rngs=rngs)
        self.normalization = ops.BatchNorm(cout, momentum=BN_MOMENTUM, epsilon=BN_EPS, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.normalization(self.convolution(x))


class ResNetBasicLayer(nnx.Module):
    """``relu(layer(x) + shortcut(x))``, ``layer`` two conv layers, the second without ReLU."""

    def __init__(self, cin: int, cout: int, stride: int, *, rngs: nnx.Rngs):
        self.shortcut = ResNetShortCut(cin, cout, stride, rngs=rngs) if cin != cout or stride != 1 else None
        self.layer = nnx.data([ResNetConvLayer(cin, cout, stride=stride, rngs=rngs),
                               ResNetConvLayer(cout, cout, relu=False, rngs=rngs)])

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x
        for conv in self.layer:
            h = conv(h)
        return ops.relu(h + (self.shortcut(x) if self.shortcut is not None else x))


class ResNetStage(nnx.Module):
    """``depth`` basic layers, the first one strided."""

    def __init__(self, cin: int, cout: int, stride: int, depth: int, *, rngs: nnx.Rngs):
        self.layers = nnx.data([ResNetBasicLayer(cin if i == 0 else cout, cout, stride if i == 0 else 1, rngs=rngs)
                                for i in range(depth)])


class ResNetEmbeddings(nnx.Module):
    """The stem: 7x7 stride-2 conv layer, then 3x3 stride-2 max pooling (padding 1)."""

    def __init__(self, cin: int, cout: int, *, rngs: nnx.Rngs):
        self.embedder = ResNetConvLayer(cin, cout, kernel=7, stride=2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return nnx.max_pool(self.embedder(x), window_shape=(3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))


class ResNetEncoder(nnx.Module):
    """The stages; stride 1 in the first (HuggingFace's ``downsample_in_first_stage=False``), 2 after."""

    def __init__(self, config: ResNetConfig, *, rngs: nnx.Rngs):
        cins = (config.embedding_size, *config.hidden_sizes[:-1])
        self.stages = nnx.data([ResNetStage(cin, cout, 1 if s == 0 else 2, depth, rngs=rngs)
                                for s, (cin, cout, depth) in enumerate(zip(cins, config.hidden_sizes, config.depths))])
        self.settings = config.remat

    def blocks(self) -> list[ResNetBasicLayer]:
        """The residual layers of every stage, in order: the remat blocks."""
        return [layer for stage in self.stages for layer in stage.layers]

    def __call__(self, x: jax.Array) -> jax.Array:
        for i, layer in enumerate(self.blocks()):
            x = jax_block(self.settings, i, layer, x, tagged=CHECKPOINT_NAMES)
        return x


class ResNetModel(nnx.Module):
    """Stem, encoder and global average pooling: NHWC images -> features ``(N, hidden_sizes[-1])``."""

    def __init__(self, config: ResNetConfig, *, rngs: nnx.Rngs):
        self.embedder = ResNetEmbeddings(config.in_channels, config.embedding_size, rngs=rngs)
        self.encoder = ResNetEncoder(config, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.encoder(self.embedder(x)).mean(axis=(1, 2))


class Flatten(nnx.Module):
    """``torch.nn.Flatten``: keeps the batch axis, flattens the rest (here, pooled features)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return x.reshape(x.shape[0], -1)


class ResNetForImageClassification(nnx.Module):
    """The Flax NNX ResNet: NHWC images -> logits ``(N, num_classes)``; ``classifier`` is ``[Flatten, Linear]``."""

    def __init__(self, config: ResNetConfig, *, rngs: nnx.Rngs):
        self.resnet = ResNetModel(config, rngs=rngs)
        self.classifier = nnx.data([Flatten(), nnx.Linear(config.hidden_sizes[-1], config.num_classes, rngs=rngs)])
        self.input_layout = "NHWC"  # read by remat.crosscheck: torch inputs are NCHW

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.resnet(x)
        for layer in self.classifier:
            x = layer(x)
        return x


def hf_config(config: ResNetConfig) -> Any:
    """The ``transformers.ResNetConfig`` of the twin: basic layers, the same sizes."""
    t = transformers_module()
    return t.ResNetConfig(num_channels=config.in_channels, embedding_size=config.embedding_size,
                          hidden_sizes=list(config.hidden_sizes), depths=list(config.depths), layer_type="basic",
                          num_labels=config.num_classes, downsample_in_first_stage=False)


def make_torch_model(config: ResNetConfig) -> Any:
    """The stock ``transformers.ResNetForImageClassification`` (its own init), checkpointed per ``config.remat``."""
    model = transformers_module().ResNetForImageClassification(hf_config(config))
    checkpoint_torch_blocks([layer for stage in model.resnet.encoder.stages for layer in stage.layers], config.remat)
    return model


def build(config: ResNetConfig | None = None, seed: int = 0) -> tuple[Any, Any, tuple]:
    """``(jax_model, hf_model, example_inputs)`` with identical weights (HuggingFace's init).

    Both models start in train mode (BatchNorm uses batch statistics); call ``.eval()``
    on both for running statistics.

    Args:
      config: the sizes; the default is small enough for tests (16x16 images).
      seed: seeds torch's initialisation and the example batch.

    Returns:
      The NNX model, the ``transformers.ResNetForImageClassification`` and a tuple with
      one NCHW NumPy image batch.

    Raises:
      ImportError: one line, when ``transformers`` is not installed.
    """
    config = config if config is not None else ResNetConfig()
    jax_model, torch_model = build_pair(ResNetForImageClassification, make_torch_model, config, seed)
    return jax_model, torch_model, example_inputs(config, seed)

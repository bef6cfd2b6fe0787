"""What the HuggingFace twins share: importing ``transformers`` (with the install hint) and per-block checkpoints."""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from remat.models._settings import RematSettings, torch_block

HF_MISSING = "the HuggingFace twins (llama, gpt2, resnet) need transformers: pip install 'remat[hf]'"


def transformers_module() -> Any:
    """``import transformers``, or a one-line ``ImportError`` naming the ``[hf]`` extra."""
    try:
        import transformers
    except ImportError:
        raise ImportError(HF_MISSING) from None
    return transformers


def checkpoint_hf_layers(model: Any, layers: Sequence[Any], settings: RematSettings) -> None:
    """Turns on HuggingFace's own activation checkpointing, for the layers ``settings`` select.

    ``model.activation_checkpointing_enable()`` wraps every ``GradientCheckpointingLayer``
    in ``torch.utils.checkpoint(use_reentrant=False)``; each layer's
    ``gradient_checkpointing`` flag then says which of them really checkpoint, so that the
    twin checkpoints exactly the blocks the Flax model does.
    """
    if not any(settings.torch_checkpoints(i) for i in range(len(layers))):
        return
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = settings.torch_checkpoints(i)


def checkpoint_torch_blocks(blocks: Sequence[Any], settings: RematSettings) -> None:
    """Checkpoints the selected ``blocks`` of a model with no checkpointing of its own.

    Each selected block's ``forward`` goes through :func:`remat.models._settings.torch_block`
    (``torch.utils.checkpoint`` whose recomputation leaves BatchNorm statistics alone). The
    block stays the library's own module: its class, names and state dict are unchanged.
    """
    for i, block in enumerate(blocks):
        if settings.torch_checkpoints(i):
            block.forward = functools.partial(torch_block, settings, i, type(block).forward.__get__(block))

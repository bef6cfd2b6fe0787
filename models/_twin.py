"""The shared ``build`` step: a PyTorch twin, and an NNX model holding the very same weights."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx


def build_pair(jax_cls: type[nnx.Module], make_torch_model: Callable[[Any], Any], config: Any,
               seed: int) -> tuple[Any, Any]:
    """``(jax_model, torch_model)``: torch initialises (seeded), the NNX model copies it.

    The NNX model is created abstractly (``nnx.eval_shape``: no random initialisation is
    computed) and every variable is then filled from the twin by
    :func:`remat.crosscheck.load_torch_state` (strict, so nothing is left abstract).

    Args:
      jax_cls: the NNX model class, called as ``jax_cls(config, rngs=...)``.
      make_torch_model: builds the twin from ``config``.
      config: the model's config.
      seed: seeds ``torch.manual_seed`` before the twin is built.

    Returns:
      The NNX model and its PyTorch twin, with identical weights.
    """
    import torch

    from remat.crosscheck import load_torch_state

    torch.manual_seed(seed)
    torch_model = make_torch_model(config)
    jax_model = nnx.eval_shape(lambda: jax_cls(config, rngs=nnx.Rngs(seed)))
    load_torch_state(jax_model, torch_model)
    return jax_model, torch_model

"""The shared ``build`` step (a PyTorch twin, and an NNX model holding the very same weights),
and checkpointing applied to both twins from outside."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
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


def apply_checkpointing_pair(jax_model: nnx.Module, torch_model: Any, check_fn: Any, *, every: int = 1,
                             **checkpoint_kwargs: Any) -> list[tuple[Any, ...]]:
    """Checkpoints the same submodules in both twins, each with its framework's own tool.

    The NNX model through :func:`remat.apply_checkpointing` (``check_fn``, ``every`` and
    the keywords as there); the PyTorch twin through torch.distributed's
    ``apply_activation_checkpointing`` with ``checkpoint_wrapper`` (non-reentrant), on its
    modules at the same paths (``("blocks", 0)`` is ``blocks.0``). PyTorch's wrapper adds
    ``_checkpoint_wrapped_module.`` to the twin's parameter names (not to its
    ``state_dict``); :mod:`remat.crosscheck` reads names through it.

    Args:
      jax_model: the NNX model, changed in place.
      torch_model: its twin, changed in place.
      check_fn: ``check_fn(path, module)``, a class or a tuple of classes, judged on the NNX model.

    Returns:
      The paths checkpointed in both.

    Example:
      >>> paths = apply_checkpointing_pair(jax_model, torch_model, mlp.Block)  # doctest: +SKIP
    """
    import remat

    names = dict(torch_model.named_modules())
    # the twin is checked before the NNX model is touched
    would = remat.apply_checkpointing(nnx.clone(jax_model), check_fn, every=every, **checkpoint_kwargs)
    missing = [p for p, _ in remat.checkpointed(would) if _torch_path(p) not in names or not p]
    if missing:
        raise ValueError(f"the PyTorch twin has no submodule {_torch_path(missing[0]) or '(the root)'} to wrap; "
                         "the twins' attribute names must match")
    remat.apply_checkpointing(jax_model, check_fn, every=every, **checkpoint_kwargs)
    paths = [p for p, _ in remat.checkpointed(jax_model)]
    apply_torch_checkpointing(torch_model, paths)
    return paths


def apply_torch_checkpointing(torch_model: Any, paths: list[tuple[Any, ...]]) -> None:
    """torch.distributed's ``apply_activation_checkpointing`` on the twin's submodules at ``paths``.

    Each is wrapped in ``checkpoint_wrapper`` (non-reentrant) whose checkpoint function is
    :func:`remat.crosscheck.torch_checkpoint`: ``torch.utils.checkpoint`` itself, except that
    BatchNorm running statistics are restored after the recomputation, which would otherwise
    update them a second time (JAX's recomputation updates nothing).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    from remat.crosscheck import torch_checkpoint

    names = dict(torch_model.named_modules())
    chosen = {id(names[_torch_path(p)]) for p in paths}
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                checkpoint_fn=torch_checkpoint)
    apply_activation_checkpointing(torch_model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: id(m) in chosen)


def _torch_path(path: tuple[Any, ...]) -> str:
    return ".".join(map(str, path))


def token_inputs(config: Any, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Token ids ``(batch, seq_len)`` below ``config.vocab``, int64 as PyTorch's embeddings expect."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, config.vocab, size=(config.batch, config.seq_len)).astype(np.int64),)


def token_targets(config: Any, seed: int = 0) -> np.ndarray:
    """Next-token labels ``(batch, seq_len)`` for a cross-entropy training run."""
    rng = np.random.default_rng(seed + 1)
    return rng.integers(0, config.vocab, size=(config.batch, config.seq_len)).astype(np.int64)


def image_inputs(config: Any, seed: int = 0) -> tuple[np.ndarray, ...]:
    """One float32 image batch in PyTorch's NCHW layout."""
    shape = (config.batch, config.in_channels, config.image_size, config.image_size)
    return (np.random.default_rng(seed).standard_normal(shape).astype(np.float32),)


def image_targets(config: Any, seed: int = 0) -> np.ndarray:
    """Class labels ``(batch,)`` for a cross-entropy training run."""
    return np.random.default_rng(seed + 1).integers(0, config.num_classes, size=(config.batch,)).astype(np.int64)


def softmax_like_torch(scores: Any, where: Any = None) -> Any:
    """``remat.ops.softmax`` over the last axis, computed in float32 (or wider) and rounded once to
    the scores' dtype: torch's CPU softmax (forward and backward) on bfloat16 does the same, where
    JAX would round ``exp``, the sum and the quotient to bfloat16 each. A no-op cast in float32/64."""
    import jax.numpy as jnp

    from remat import ops

    wide = jnp.promote_types(scores.dtype, jnp.float32)
    return ops.softmax(scores.astype(wide), axis=-1, where=where).astype(scores.dtype)


@jax.custom_vjp
def silu_like_torch(x: Any) -> Any:
    """``x * sigmoid(x)`` computed in float32 (or wider) and rounded once, keeping only ``x`` for the
    backward, as torch's CPU ``silu`` and ``silu_backward`` do on bfloat16: ``jax.nn.silu`` in
    bfloat16 rounds the sigmoid and the product (further from the truth than PyTorch, docs/crosscheck.md)."""
    return _silu_fwd(x)[0]


def _silu_fwd(x: Any) -> tuple[Any, Any]:
    import jax.numpy as jnp

    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return (xf * jax.nn.sigmoid(xf)).astype(x.dtype), x


def _silu_bwd(x: Any, g: Any) -> tuple[Any]:
    import jax.numpy as jnp

    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    s = jax.nn.sigmoid(xf)
    return ((g.astype(xf.dtype) * s * (1 + xf * (1 - s))).astype(x.dtype),)  # torch's silu_backward


silu_like_torch.defvjp(_silu_fwd, _silu_bwd)


def sdpa_like_torch(q: Any, k: Any, v: Any, scale: float, where: Any, autocast_dtype: Any = None) -> Any:
    """Attention as ``torch.nn.functional.scaled_dot_product_attention`` computes it on CPU (the
    HuggingFace twins' default): scores and softmax accumulated in float32 (or wider), the
    probabilities rounded once to the inputs' dtype for ``p @ v``. ``autocast_dtype`` (bfloat16
    under ``torch.autocast``) is the dtype q, k and v are cast to first, as autocast does."""
    import jax.numpy as jnp

    from remat import ops

    if autocast_dtype is not None:
        q, k, v = (a.astype(autocast_dtype) for a in (q, k, v))
    wide = jnp.promote_types(q.dtype, jnp.float32)
    batch = tuple(range(q.ndim - 2))  # [..., tokens, head_dim]: every leading axis is a batch axis
    # ops.dot_general: both products' backward runs in the inputs' dtype, as torch's does: p @ v's
    # output is rounded to it anyway, and torch's CPU flash attention rounds the scores' float32
    # gradient to it before its two products (JAX's own transpose would promote to float32)
    scores = ops.dot_general(q, k, (((q.ndim - 1,), (k.ndim - 1,)), (batch, batch)),
                             preferred_element_type=wide) * scale
    p = ops.softmax(scores, axis=-1, where=where).astype(v.dtype)
    return ops.dot_general(p, v, (((p.ndim - 1,), (v.ndim - 2,)), (batch, batch)),
                           preferred_element_type=wide).astype(v.dtype)

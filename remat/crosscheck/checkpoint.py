"""``torch.utils.checkpoint`` for the twins, updating BatchNorm statistics once as JAX does."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from remat.crosscheck.lazy import _torch


def torch_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)`` whose
    recomputation leaves BatchNorm running statistics alone.

    PyTorch's recomputation runs BatchNorm's forward a second time, updating its running
    mean and variance (and ``num_batches_tracked``) twice per step; JAX's recomputation is
    a pure function of the saved inputs, so a checkpointed NNX BatchNorm updates once. This
    wrapper restores the buffers after the recomputation, so both frameworks agree.

    Args:
      function: a ``torch.nn.Module`` or a bound method of one.
      *args: its tensor arguments.
      **kwargs: its keyword arguments.

    Returns:
      ``function(*args, **kwargs)``.
    """
    _torch()  # without PyTorch: the ImportError that names the [torch] extra
    import torch.utils.checkpoint  # binds the name torch as well

    owner = function if isinstance(function, torch.nn.Module) else getattr(function, "__self__", None)
    norms = [m for m in owner.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
             and m.track_running_stats] if isinstance(owner, torch.nn.Module) else []
    if not norms:
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    calls = [0]

    def once(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1 or not torch.is_grad_enabled():
            return function(*a, **k)
        saved = [(b, b.clone()) for m in norms for b in m.buffers()]
        try:
            return function(*a, **k)
        finally:
            with torch.no_grad():
                for b, v in saved:
                    b.copy_(v)

    return torch.utils.checkpoint.checkpoint(once, *args, use_reentrant=False, **kwargs)

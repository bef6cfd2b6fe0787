"""PyTorch on first use: every torch import of the bridge goes through :func:`_torch`."""
from __future__ import annotations

from typing import Any

TORCH_MISSING = "remat.crosscheck needs PyTorch: pip install 'remat[torch]'"


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ImportError(TORCH_MISSING) from None
    return torch

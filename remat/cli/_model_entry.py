"""The registry entry of the built-in model a command names (``remat.models``), for its settings."""
from __future__ import annotations

import argparse
from typing import Any


def model_entry(args: argparse.Namespace) -> Any:
    """``args.model``'s entry in ``MODELS`` or ``HF_MODELS``; None for a model that is not built in."""
    from remat.models import HF_MODELS, MODELS

    return MODELS.get(args.model) or HF_MODELS.get(args.model)

"""What the benchmarks measure: the models, their sizes and the checkpointing variants.

The models are those of :mod:`remat.models` (each an NNX model and its PyTorch twin with
identical weights); a variant says how the block stack runs, and
:func:`remat_settings` turns the per-block variants into the models' own
:class:`remat.models.RematSettings`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

JAX_VARIANTS: tuple[str, ...] = (
    "none", "nothing", "dots", "dots_no_batch", "names", "scan", "scan_nested", "sequential",
    "budget_0.25", "budget_0.5", "budget_0.75",  # remat.residual_budget(F) on every block
)
TORCH_VARIANTS: tuple[str, ...] = ("none", "nothing", "sequential")
MODELS: tuple[str, ...] = ("mlp", "transformer")
ROW_KEYS: tuple[str, ...] = (
    "framework", "model", "depth", "variant", "saved_bytes", "temp_bytes", "peak_rss_bytes",
    "step_ms", "overhead",
)

#: What the ``names`` variant saves, per model (a list of ``remat.checkpoint_name`` tags).
NAMES_POLICY: dict[str, tuple[str, ...]] = {
    # the attention output of every block (the choice)
    "transformer": ("attn_out",),
    # the MLP's only tag: each block's pre-activation, i.e. its matmul output, so that only
    # the activation function is recomputed (close to "dots" for this model)
    "mlp": ("mlp_hidden",),
}

#: Variants that run the block stack as one (a scan over stacked parameters, or
#: ``checkpoint_sequential``) instead of the model's own per-block loop.
STACK_VARIANTS: tuple[str, ...] = ("scan", "scan_nested", "sequential")

#: Seconds of idle time when the timing switches framework (not timed): long enough for
#: the other framework's spinning worker threads (PyTorch's OpenMP team, XLA's pool) to
#: go to sleep. Steps of one framework run back to back, as in a training loop: an idle
#: gap before every step slowed XLA:CPU's steps (its pool falls asleep), which is not
#: what a training loop sees.
GAP_S = 0.02


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Model sizes (config fields other than depth) and the depths to run."""

    name: str
    depths: tuple[int, ...]
    transformer: dict[str, Any]
    mlp: dict[str, Any]
    steps: int = 5

    def model_kwargs(self, model: str) -> dict[str, Any]:
        return dict(getattr(self, model))


SIZES: dict[str, Sizes] = {
    "tiny": Sizes(
        "tiny", (2, 4),
        # activations larger than parameters, so that memory relations show at this size
        transformer=dict(vocab=32, width=32, heads=2, seq_len=64, batch=4),
        mlp=dict(in_dim=32, width=64, out_dim=8, batch=256, activation="relu"),
        steps=5,
    ),
    "quick": Sizes(
        "quick", (4, 8, 16),
        transformer=dict(vocab=256, width=128, heads=4, seq_len=64, batch=4),
        mlp=dict(in_dim=512, width=512, out_dim=16, batch=128, activation="relu"),
        steps=7,
    ),
    "full": Sizes(
        "full", (4, 8, 16, 32),
        transformer=dict(vocab=256, width=256, heads=4, seq_len=256, batch=8),
        mlp=dict(in_dim=1024, width=1024, out_dim=16, batch=256, activation="relu"),
        steps=7,
    ),
}


def segments_for(depth: int) -> int:
    """``round(sqrt(depth))``: the segments of the ``sequential`` variants (at least 1)."""
    return max(1, round(math.sqrt(depth)))


def remat_settings(model: str, variant: str) -> Any:
    """The model's :class:`remat.models.RematSettings` for a per-block JAX variant.

    None for :data:`STACK_VARIANTS`, which run the block stack another way.
    """
    import remat
    from remat.models import RematSettings

    if variant in STACK_VARIANTS:
        return None
    if variant == "none":
        return RematSettings.none()
    if variant == "names":
        return RematSettings(policy=NAMES_POLICY[model])
    if variant.startswith("budget_"):
        return RematSettings(policy=remat.residual_budget(float(variant.removeprefix("budget_"))))
    return RematSettings(policy=variant)  # "nothing", "dots", "dots_no_batch"


def _model_module(model: str) -> Any:
    from remat.models import mlp, transformer

    return {"mlp": mlp, "transformer": transformer}[model]


def model_config(model: str, depth: int, sizes: Sizes, settings: Any = None) -> Any:
    """The model's config at ``depth``; ``settings`` default to no checkpoint."""
    from remat.models import RematSettings

    mod = _model_module(model)
    cls = mod.TransformerConfig if model == "transformer" else mod.MLPConfig
    return cls(depth=depth, remat=settings or RematSettings.none(), **sizes.model_kwargs(model))


@dataclasses.dataclass
class Built:
    """One (model, depth): both frameworks' models (no checkpoint), one batch, its targets."""

    model: str
    depth: int
    config: Any
    jax_model: Any
    torch_model: Any
    inputs: np.ndarray
    targets: np.ndarray


def build(model: str, depth: int, sizes: Sizes, seed: int = 0) -> Built:
    """Both frameworks' models with identical weights (the model's own ``build``)."""
    mod = _model_module(model)
    config = model_config(model, depth, sizes)
    jm, tm, inputs = mod.build(config, seed)
    targets = mod.example_targets(config, seed)
    return Built(model, depth, config, jm, tm, np.asarray(inputs[0]), np.asarray(targets))


def add_overheads(rows: list[dict[str, Any]]) -> None:
    """``overhead = step_ms / step_ms`` of the same framework's ``none`` row (same model, depth)."""
    base = {(r["framework"], r["model"], r["depth"]): r["step_ms"] for r in rows if r["variant"] == "none"}
    for r in rows:
        b = base.get((r["framework"], r["model"], r["depth"]))
        r["overhead"] = round(r["step_ms"] / b, 4) if b and r["step_ms"] is not None else None

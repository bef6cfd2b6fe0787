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

from remat._names import NO_CHECKPOINT, POLICY_NAMES

#: The per-block policies: remat's vocabulary (``remat.policies.POLICY_NAMES``) but
#: ``everything``, which compiles to the no-checkpoint program.
BLOCK_POLICIES: tuple[str, ...] = tuple(p for p in POLICY_NAMES if p != "everything")
JAX_VARIANTS: tuple[str, ...] = (
    *BLOCK_POLICIES, "names", "scan", "scan_nested", "sequential",
    "budget_0.25", "budget_0.5", "budget_0.75",  # remat.residual_budget(F) on every block
    # the whole loss one remat.checkpoint (policy "nothing"): the backward keeps only the
    # step's inputs; its blocks inside not checkpointed, or each checkpointed too (nested)
    "whole", "whole_nested",
)
#: ``plan_F``: the step as ``remat.plan(..., memory_budget=F)`` plans it (the frontier run only:
#: planning compiles dozens of candidates)
PLAN_BUDGETS: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
PLAN_VARIANTS: tuple[str, ...] = tuple(f"plan_{b}" for b in PLAN_BUDGETS)
#: ``torch_compile_F``: ``torch.compile`` with ``activation_memory_budget = F`` (the peer to beat)
TORCH_COMPILE_BUDGETS: tuple[float, ...] = (1.0, 0.5, 0.25, 0.0)
TORCH_COMPILE_VARIANTS: tuple[str, ...] = tuple(f"torch_compile_{b}" for b in TORCH_COMPILE_BUDGETS)
TORCH_VARIANTS: tuple[str, ...] = (NO_CHECKPOINT, "nothing", "sequential", *TORCH_COMPILE_VARIANTS)
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


def compile_budget(variant: str) -> float | None:
    """The ``activation_memory_budget`` of a ``torch_compile_F`` variant; None for the others."""
    if not variant.startswith("torch_compile_"):
        return None
    try:
        budget = float(variant.removeprefix("torch_compile_"))
    except ValueError:
        return None
    return budget if 0.0 <= budget <= 1.0 else None


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
    if variant in (NO_CHECKPOINT, "whole"):
        return RematSettings.none()
    if variant == "whole_nested" or variant.startswith("plan_"):
        return RematSettings(policy="nothing")  # the planner re-decides every block
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
    # remat.plan's compiled candidates, shared by the plan_F variants (each compiled once)
    plan_cache: dict = dataclasses.field(default_factory=dict, repr=False)


def build(model: str, depth: int, sizes: Sizes, seed: int = 0) -> Built:
    """Both frameworks' models with identical weights (the model's own ``build``)."""
    mod = _model_module(model)
    config = model_config(model, depth, sizes)
    jm, tm, inputs = mod.build(config, seed)
    targets = mod.example_targets(config, seed)
    return Built(model, depth, config, jm, tm, np.asarray(inputs[0]), np.asarray(targets))


def add_overheads(rows: list[dict[str, Any]]) -> None:
    """``overhead = step_ms / step_ms`` of the same framework's ``no_checkpoint`` row (same model, depth)."""
    base = {(r["framework"], r["model"], r["depth"]): r["step_ms"] for r in rows if r["variant"] == NO_CHECKPOINT}
    for r in rows:
        b = base.get((r["framework"], r["model"], r["depth"]))
        r["overhead"] = round(r["step_ms"] / b, 4) if b and r["step_ms"] is not None else None

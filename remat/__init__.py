"""remat: PyTorch's activation checkpointing (``torch.utils.checkpoint``) for JAX and Flax.

The public surface::

    remat.checkpoint(fn, *args, policy=None, ...)    # call form, decorator, Flax modules
    remat.checkpoint_sequential(functions, segments, input)
    remat.checkpoint_name(x, "name")                 # tag a value for name-based policies
    remat.apply_checkpointing(model, Block)          # checkpoint a model's blocks without editing it
    remat.policies                                   # named and composable policies
    remat.ops                                        # LayerNorm, GELU, ... keeping PyTorch's saved set
    remat.residual_budget(0.5)                       # per region: keep at most half its residual bytes
    remat.analysis                                   # residuals, compiled memory, RSS, comparisons
    remat.plan(loss, *args, memory_budget=0.5)              # the fastest checkpointing that fits a budget
    remat.explain(jax.grad(loss), *args)             # every byte at the compiled peak, attributed
    remat.keep_freed_memory()                        # glibc keeps XLA:CPU's freed buffers for reuse

Importing ``remat`` is cheap and changes nothing: no environment variable, no XLA flag,
no JAX setting. The rest loads on first use, so ``remat --help`` does not pay for
importing JAX and Flax.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> (module, attribute); attribute None means the module itself
_EXPORTS: dict[str, tuple[str, str | None]] = {
    "checkpoint": ("remat._core.checkpoint", "checkpoint"),
    "checkpoint_sequential": ("remat._core.sequential", "checkpoint_sequential"),
    "apply_checkpointing": ("remat._core.apply", "apply_checkpointing"),
    "remove_checkpointing": ("remat._core.apply", "remove_checkpointing"),
    "checkpointed": ("remat._core.apply", "checkpointed"),
    "checkpoint_name": ("jax.ad_checkpoint", "checkpoint_name"),
    "CheckpointPolicy": ("remat.policies", "CheckpointPolicy"),
    "policies": ("remat.policies", None),
    "analysis": ("remat.analysis", None),
    "scan": ("remat.scan", None),
    "ops": ("remat.ops", None),
    "explain": ("remat.explainer", "explain"),
    "scan_layers": ("remat.scan", "scan_layers"),
    "stack_nnx_layers": ("remat.scan", "stack_nnx_layers"),
    "scan_nnx_layers": ("remat.scan", "scan_nnx_layers"),
    "plan": ("remat.planner", "plan"),
    "Plan": ("remat.planner", "Plan"),
    "keep_freed_memory": ("remat.analysis.allocator", "keep_freed_memory"),
    "residual_budget": ("remat.analysis.budget", "residual_budget"),
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    # For type checkers and IDEs: ``name as name`` marks each import as a re-export
    # (``__all__`` is computed, so they cannot read it); at run time __getattr__ loads them.
    # tests/test_layout.py checks that this list and _EXPORTS name the same objects.
    from jax.ad_checkpoint import checkpoint_name as checkpoint_name

    from remat import analysis as analysis
    from remat import ops as ops
    from remat import policies as policies
    from remat import scan as scan
    from remat._core.apply import apply_checkpointing as apply_checkpointing
    from remat._core.apply import checkpointed as checkpointed
    from remat._core.apply import remove_checkpointing as remove_checkpointing
    from remat._core.checkpoint import checkpoint as checkpoint
    from remat._core.sequential import checkpoint_sequential as checkpoint_sequential
    from remat.analysis.allocator import keep_freed_memory as keep_freed_memory
    from remat.analysis.budget import residual_budget as residual_budget
    from remat.explainer import explain as explain
    from remat.planner import Plan as Plan
    from remat.planner import plan as plan
    from remat.policies import CheckpointPolicy as CheckpointPolicy
    from remat.scan import scan_layers as scan_layers
    from remat.scan import scan_nnx_layers as scan_nnx_layers
    from remat.scan import stack_nnx_layers as stack_nnx_layers


def __getattr__(name: str) -> Any:
    try:
        module_name, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'remat' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

"""The JAX variants: a loss of all parameters through the model's own code, compiled once.

The per-block variants (``no_checkpoint``, ``nothing``, ``dots``, ``dots_no_batch``, ``names``,
``budget_F``) are the NNX model of :mod:`remat.models` built with the variant's
:class:`remat.models.RematSettings`: its own forward, its own ``remat.checkpoint`` per
block. ``whole`` and ``whole_nested`` checkpoint the whole loss once more. ``plan_F`` is
the step as :func:`remat.plan` plans it at ``memory_budget=F`` (its blocks checkpointed as the
plan says); its ``compile_s`` is the whole planning time. The stack variants (``scan``,
``scan_nested``, ``sequential``) run the same model with its block stack
(``model.blocks``) replaced by one call that runs the model's own block:
:func:`remat.scan.scan_layers` over the blocks' stacked parameters, or
:func:`remat.checkpoint_sequential` over the blocks.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import remat
from benchmarks.cases import JAX_VARIANTS, PLAN_VARIANTS, Built, remat_settings, segments_for
from remat import _jax
from remat.analysis import compiled_step


@dataclasses.dataclass
class JaxProgram:
    """One JAX variant: the loss, its parameters and the compiled gradient step."""

    variant: str
    loss: Callable
    params: Any
    x: Any
    y: Any
    compiled: Any
    compile_s: float
    temp_bytes: int
    plan: Any = None  # plan_F: the remat.planner.Plan

    def step(self) -> Any:
        """One gradient step, dispatched: the caller waits for it (``jax.block_until_ready``)."""
        return self.compiled(self.params, self.x, self.y)


def _cross_entropy(logits: Any, y: Any) -> Any:
    import jax
    import jax.numpy as jnp

    logits = logits.reshape(-1, logits.shape[-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, y.reshape(-1, 1), axis=1))


def _graphdef(built: Built, settings: Any) -> Any:
    """The graph of the model built with ``settings`` (abstractly: no initialisation runs)."""
    from flax import nnx

    cls, config = type(built.jax_model), dataclasses.replace(built.config, remat=settings)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0))))
    return graphdef


class _Stack:
    """Stands in for the model's whole block stack: ``model.blocks = [_Stack(run)]``."""

    def __init__(self, run: Callable[[Any], Any]) -> None:
        self.run = run

    def __call__(self, h: Any) -> Any:
        return self.run(h)


def jax_loss(built: Built, variant: str) -> tuple[Callable, Any]:
    """``(loss(params, x, y), params)`` for ``variant``; ``params`` is what is differentiated.

    Per-block variants: ``params`` is the model's state. Stack variants:
    ``{"outer": state without the blocks, "blocks": [state, ...]}``; for the scan
    variants ``"blocks"`` holds one state whose leaves are stacked along a leading layer
    axis, as a scanned model stores them.
    """
    from flax import nnx

    from remat.models import RematSettings

    if variant not in JAX_VARIANTS + PLAN_VARIANTS:
        raise ValueError(f"unknown JAX variant {variant!r}; use one of {', '.join(JAX_VARIANTS + PLAN_VARIANTS)}")
    _, state = nnx.split(built.jax_model)
    settings = remat_settings(built.model, variant)
    if settings is not None:
        graphdef = _graphdef(built, settings)

        def loss(params: Any, x: Any, y: Any) -> Any:
            return _cross_entropy(nnx.merge(graphdef, params)(x), y)

        if variant.startswith("whole"):
            # the step's inputs are all its backward keeps; the recomputation runs inside
            # the backward, its blocks checkpointed again for "whole_nested"
            loss = remat.checkpoint(loss, policy="nothing")
        return loss, state
    return _stack_loss(built, variant, nnx.merge(_graphdef(built, RematSettings.none()), state))


def _stack_loss(built: Built, variant: str, model: Any) -> tuple[Callable, Any]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from remat.scan import scan_layers

    blocks = list(model.blocks)
    model.blocks = nnx.data([])
    outer_gd, outer = nnx.split(model)
    block_gd = nnx.split(blocks[0])[0]
    block_states = [nnx.split(b)[1] for b in blocks]
    scanned = variant != "sequential"
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *block_states) if scanned else block_states

    def apply_block(p: Any, h: Any) -> Any:  # the model's own block, on its parameters
        return nnx.merge(block_gd, p)(h)

    def run_stack(blocks: Any, h: Any) -> Any:
        if scanned:
            return scan_layers(apply_block, blocks, h, policy="nothing", nested=variant == "scan_nested")
        modules = [nnx.merge(block_gd, p) for p in blocks]
        return remat.checkpoint_sequential(modules, segments_for(built.depth), h)

    def loss(params: Any, x: Any, y: Any) -> Any:
        m = nnx.merge(outer_gd, params["outer"])
        m.blocks = nnx.data([_Stack(lambda h: run_stack(params["blocks"], h))])
        return _cross_entropy(m(x), y)

    return loss, {"outer": outer, "blocks": stacked}


def jax_inputs(built: Built) -> tuple[Any, Any]:
    import jax.numpy as jnp

    x = built.inputs
    x = x.astype(np.int32) if np.issubdtype(x.dtype, np.integer) else x.astype(np.float32)
    return jnp.asarray(x), jnp.asarray(built.targets.astype(np.int32))


#: timed steps per fitting candidate when the benchmark plans (the planner's median)
PLAN_REPEAT = 3


class PlanInfeasible(ValueError):
    """A ``plan_F`` variant whose budget no candidate meets: it has no program to measure."""


def jax_program(built: Built, variant: str) -> JaxProgram:
    """The variant's ``jax.jit(jax.grad(loss))``, compiled by :func:`remat.analysis.compiled_step`.

    ``plan_F``: planned by :func:`remat.plan` (candidates shared across budgets through
    ``built.plan_cache``); the chosen candidate's executable is the program.
    """
    loss, params = jax_loss(built, variant)
    x, y = jax_inputs(built)
    if variant.startswith("plan_"):
        from remat.planner import plan

        t0 = time.perf_counter()
        p = plan(loss, params, x, y, memory_budget=float(variant.removeprefix("plan_")), repeat=PLAN_REPEAT,
                 cache=built.plan_cache)
        if p.chosen is None:
            raise PlanInfeasible(f"{variant}: the budget cannot be met (minimum {p.minimum_bytes} temp bytes, "
                                 f"{p.minimum_bytes / p.none_temp_bytes:.2f} of no checkpoint)")
        return JaxProgram(variant, p.apply(loss), params, x, y, p.chosen.executable(), time.perf_counter() - t0,
                          p.chosen.temp_bytes, plan=p)
    step = compiled_step(loss, params, x, y)
    return JaxProgram(variant, loss, params, x, y, step.executable, step.compile_s, step.memory.temp_bytes)


def _data_dependent_vars(jaxpr: Any, data_invars: list) -> set:
    """Variables of ``jaxpr`` that depend on ``data_invars`` (the batch), transitively.

    Nested jaxprs (jit, custom_jvp, scan, checkpoint) count as one equation whose outputs
    all depend on the batch when any input does (an over-estimate, never an under-).
    """
    data = set(data_invars)
    for eqn in jaxpr.eqns:
        if any(not _jax.is_literal(v) and v in data for v in eqn.invars):
            data.update(eqn.outvars)
    return data


def _nbytes(aval: Any) -> int:
    dtype = np.dtype(aval.dtype)
    return int(math.prod(aval.shape)) * int(getattr(dtype, "itemsize", 0) or 0)


def jax_saved_bytes(loss: Callable, params: Any, x: Any, y: Any) -> dict[str, int]:
    """``saved_bytes``, ``saved_param_bytes`` and ``residual_total_bytes`` of the loss of params.

    ``residual_total_bytes`` is every residual, deduplicated (the sum of the two, as for
    PyTorch in :func:`benchmarks.torch_programs.torch_saved_bytes`). ``saved_bytes``
    counts the residuals that depend on the batch (inputs and targets included); the
    others (``saved_param_bytes``) are the parameters and what is computed from
    parameters and constants alone, such as the reshape of stacked parameters in the
    nested scan, the causal mask or the broadcast zeros of relu's derivative, which XLA
    folds into their consumers or which live in the model anyway. Found by a dependency
    pass over the jaxpr of the same ``jax.vjp`` with the batch as explicit inputs.
    """
    import jax

    def vjp_of_params(p: Any, xx: Any, yy: Any) -> Any:
        return jax.vjp(lambda q: loss(q, xx, yy), p)

    closed, out_shape = jax.make_jaxpr(vjp_of_params, return_shape=True)(params, x, y)
    jaxpr = closed.jaxpr
    num_res = jax.tree_util.tree_structure(out_shape[1]).num_leaves
    res_vars = jaxpr.outvars[len(jaxpr.outvars) - num_res:]
    n_data = len(jax.tree.leaves((x, y)))
    data = _data_dependent_vars(jaxpr, list(jaxpr.invars[len(jaxpr.invars) - n_data:]))
    seen: set = set()
    param_bytes = data_bytes = 0
    for v in res_vars:
        if _jax.is_literal(v) or v in seen:
            continue
        seen.add(v)
        if v in data:
            data_bytes += _nbytes(v.aval)
        else:
            param_bytes += _nbytes(v.aval)
    return {"saved_bytes": int(data_bytes), "saved_param_bytes": int(param_bytes),
            "residual_total_bytes": int(data_bytes + param_bytes)}


def jax_temp_bytes(program: JaxProgram) -> int:
    """XLA's temp bytes of the variant's compiled step (read when it was compiled)."""
    return program.temp_bytes

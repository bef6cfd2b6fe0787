"""How remat's own checkpoint regions lower on XLA:CPU: their recomputation waits for its cotangent.

JAX ties a region's backward recomputation to the incoming cotangent with an
``optimization_barrier`` (``prevent_cse=True``). XLA:CPU deletes every barrier in its
``cse_barrier_expander`` pass, before scheduling, and its scheduler then runs the
recomputation as early as its operands allow: inside the forward pass, where its results
stay alive until the backward needs them, so per-layer checkpointing of an unrolled model
saved no memory at all. Disabling that pass process-wide (what remat once did) keeps the
barrier, but a barrier left inside a loop body aborts XLA:CPU's code generator, which
broke programs that merely imported remat.

Here the fix is local to remat's regions: a region is marked by wrapping its policy in
:class:`RegionPolicy`, and on CPU the backward half of a marked region that asks for CSE
prevention lowers as JAX lowers it, barrier included, but inside a conditional whose
operands include the cotangent and whose predicate XLA cannot fold. A conditional is one
instruction to the scheduler, so nothing in it can start before the cotangent exists.
Every other ``checkpoint`` equation, and any program without remat regions, lowers through
JAX's own rule unchanged. The rule is registered on the first remat region, not on import.

JAX 0.10's ``jax_remat3`` (off by default) makes ``jax.checkpoint`` emit a different construct,
whose backward recomputation sits behind a bare barrier that XLA:CPU deletes, so the savings
vanish. remat's own regions are therefore built and traced under :func:`classic_remat`: the
setting is switched off for remat's calls only (a thread-local JAX config context, never the
process-wide value), so every remat region is a ``checkpoint`` equation whatever the user's
setting, and the rule above applies to it. Code outside remat's regions is left as configured.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from remat import _jax

__all__ = ["RegionPolicy", "classic_checkpoint", "classic_remat", "in_classic_remat", "install_cpu_lowering",
           "mark_region"]


@dataclasses.dataclass(frozen=True)
class RegionPolicy:
    """A JAX checkpoint policy that also marks its region as remat's.

    It decides exactly what ``policy`` decides (``None``: save nothing but the inputs,
    as ``jax.checkpoint``'s default), so jaxprs, residuals and gradients are those of
    ``jax.checkpoint(fn, policy=policy)``.
    """

    policy: Callable[..., Any] | None

    def __call__(self, *args: Any, **params: Any) -> Any:
        if self.policy is None:
            return False  # jax's nothing_saveable
        return self.policy(*args, **params)


def mark_region(policy: Callable[..., Any] | None) -> RegionPolicy:
    """``policy`` wrapped as a :class:`RegionPolicy` (once), after installing the CPU rule."""
    install_cpu_lowering()
    return policy if isinstance(policy, RegionPolicy) else RegionPolicy(policy)


@contextlib.contextmanager
def classic_remat() -> Iterator[None]:
    """JAX's ``checkpoint`` primitive for the regions built and traced inside, under ``jax_remat3`` too."""
    setting = _jax.remat3_setting()  # JAX releases before remat3 have one kind
    with contextlib.nullcontext() if setting is None else setting(False):
        yield


def classic_checkpoint(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """``jax.checkpoint(fn, **options)``, built and called under :func:`classic_remat`."""
    import jax

    with classic_remat():
        checkpointed = jax.checkpoint(fn, **options)
    return in_classic_remat(checkpointed)


def in_classic_remat(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, called under :func:`classic_remat` (for lifted transforms built at call time)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with classic_remat():
            return fn(*args, **kwargs)

    return call


_installed = False


def install_cpu_lowering() -> None:
    """Registers the CPU lowering of ``checkpoint`` equations; idempotent."""
    global _installed
    if _installed:
        return
    jax_rule = _jax.checkpoint_lowering()

    def lowering(ctx: Any, *args: Any, jaxpr: Any, prevent_cse: Any, differentiated: bool,
                 policy: Any) -> Any:
        params = dict(jaxpr=jaxpr, prevent_cse=prevent_cse, differentiated=differentiated,
                      policy=policy)
        if not (differentiated and isinstance(policy, RegionPolicy) and np.any(prevent_cse)
                and _lowers_in_conditional(ctx, jaxpr)):
            return jax_rule(ctx, *args, **params)
        return _lower_in_conditional(ctx, args, lambda: jax_rule(ctx, *args, **params))

    _jax.register_cpu_lowering(_jax.checkpoint_primitive(), lowering)
    _installed = True


def _lowers_in_conditional(ctx: Any, jaxpr: Any) -> bool:
    """Ordered effects need tokens threaded through; exotic dtypes have no zero: keep JAX's rule."""
    if _jax.has_ordered_effects(jaxpr):
        return False
    return all(np.issubdtype(getattr(a, "dtype", None), np.number) or a.dtype == np.bool_
               for a in ctx.avals_out)


def _lower_in_conditional(ctx: Any, args: tuple, body: Callable[[], list[Any]]) -> list[Any]:
    """``if opaque_true: body() else: zeros`` with every region argument an operand.

    ``body`` is JAX's own rule; it also sets the (empty: no ordered effects) output tokens.
    """
    jax_mlir, ir, hlo = _jax.mlir_modules()
    out_types = [_jax.ir_type(ctx, a) for a in ctx.avals_out]
    # An optimization barrier hides the constant from the conditional simplifier, which
    # runs before the barrier is expanded; the branches use the region's arguments
    # implicitly, so the conditional depends on all of them.
    true = hlo.OptimizationBarrierOp([jax_mlir.ir_constant(np.array(True))]).results[0]
    conditional = hlo.IfOp(out_types, true)
    with ir.InsertionPoint(conditional.true_branch.blocks.append()):
        hlo.return_(list(body()))
    with ir.InsertionPoint(conditional.false_branch.blocks.append()):
        hlo.return_([jax_mlir.full_like_aval(ctx, 0, a) for a in ctx.avals_out])
    return [jax_mlir.lower_with_sharding_in_types(ctx, r, a)
            for r, a in zip(conditional.results, ctx.avals_out)]

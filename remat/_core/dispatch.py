"""One checkpointed call: the dispatch that picks what runs it (a plain callable, an NNX module or
method, a bound Linen module or method) and runs it as one region.

Every form of ``remat.checkpoint``, ``checkpoint_sequential`` and ``apply_checkpointing`` ends
in :func:`run_region`; its options arrive checked (:mod:`remat._core.options`).
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any

from remat._core import flax_adapters as _flax
from remat._core.arguments import signature, split_call
from remat._core.hooks import RegionChooser, current
from remat._core.options import CheckpointOptions
from remat._core.trace_cache import ACTIVE_CALL, REGIONS, ActiveCall, Region

__all__ = ["run_region"]


def run_region(function: Callable[..., Any], opts: CheckpointOptions, args: tuple, kwargs: dict) -> Any:
    """Evaluates ``function(*args, **kwargs)`` as one checkpointed region.

    Args:
      function: a plain callable, an NNX module or bound method (lifted with ``nnx.remat``),
        a bound Linen module or method (lifted with ``nn.checkpoint``), or a
        ``functools.partial`` of one of these.
      opts: the region's options, checked (:func:`remat._core.options.normalize_options`);
        a planner's decider (:mod:`remat._core.hooks`) may replace them here.
      args: the positional call arguments.
      kwargs: the keyword call arguments.

    Returns:
      What ``function`` returns; under autodiff its activations are recomputed on the
      backward pass instead of kept.
    """
    if not opts.enabled:  # policy=NO_CHECKPOINT: not a region at all, so no planner sees it
        return function(*args, **kwargs)
    decide = current().region  # a planner re-deciding this region (remat._core.hooks)
    if decide is not None:
        opts = decide(opts)
        if opts is None:
            return function(*args, **kwargs)
    if opts.static_argnums and max(opts.static_argnums) >= len(args):
        raise ValueError(
            f"static_argnums={opts.static_argnums} names a position beyond the "
            f"{len(args)} positional argument(s) given"
        )
    while isinstance(function, functools.partial):
        # partial(self.block, mask=m): its arguments are call arguments like any other (traced
        # when arrays), so the module behind .func is found and lifted as without partial
        bound_args = function.args
        if isinstance(opts.prevent_cse, tuple):  # the caller's flags name the call's own arguments
            opts = dataclasses.replace(opts, prevent_cse=_cse_with_bound(opts.prevent_cse, function, bool(kwargs)))
        args, kwargs = bound_args + tuple(args), {**function.keywords, **kwargs}
        function = function.func
        if opts.static_argnums and bound_args:
            opts = dataclasses.replace(
                opts, static_argnums=tuple(i + len(bound_args) for i in opts.static_argnums)
            )
    linen_module = _flax.linen_owner(function, args)
    if linen_module is not None:
        if isinstance(opts.policy, RegionChooser):
            raise TypeError(
                "policy=remat.residual_budget(...) works for JAX functions and Flax NNX modules; for a "
                "Linen module pick a named policy (remat plan shows which one fits your memory)"
            )
        return _flax.linen_call(function, linen_module, opts, args, kwargs)

    call = split_call(args, kwargs, opts.static_argnums, trace_scalars=opts.trace_scalars,
                      prevent_cse=opts.prevent_cse)
    # The module, the method's owner, or the modules a closure captured: nnx.remat inputs.
    bound = _flax.nnx_bound(function)
    nodes, rebind = bound if bound is not None else ([], None)
    graph_nodes = list(nodes) + [x for x in call.dynamic if _flax.is_nnx_node(x)]
    nnx_mode = None if not graph_nodes else "in place" if _flax.nnx_in_place(graph_nodes) else "changed only"
    anchor, kind = _flax.function_anchor(function)
    if not opts.trace_scalars:
        REGIONS.count_scalar_variants(anchor, function, call)
    static_key = call.static_key
    region = REGIONS.region(anchor, None if static_key is None else (kind, len(nodes), static_key))
    inputs = list(nodes) + call.dynamic
    flags = (True,) * len(nodes) + call.prevent_cse
    prevent_cse = flags[0] if flags and all(f == flags[0] for f in flags) else flags

    def remat_with(policy: Any) -> Callable[..., Any]:
        return region.caller(policy, prevent_cse, nnx_mode)

    sig = signature(inputs)
    token = ACTIVE_CALL.set(ActiveCall(function, rebind, len(nodes), call, sig))
    try:
        policy = opts.policy
        if isinstance(policy, RegionChooser):  # e.g. a residual budget: per region, from the inputs
            policy = policy.choose_policy(remat_with, inputs)
        if opts.debug:
            _print_debug_report(function, region, remat_with(policy), inputs, opts)
        outputs = remat_with(policy)(*inputs)
        if not region.store.has(sig):
            # A trace cache keyed differently from the store (it never should be): trace
            # this call afresh rather than guess its non-array outputs.
            region = Region()
            outputs = remat_with(policy)(*inputs)
    finally:
        ACTIVE_CALL.reset(token)
    return region.store.unpack(outputs, sig)


def _cse_with_bound(flags: tuple, part: functools.partial, has_kwargs: bool) -> tuple:
    """A per-argument ``prevent_cse`` for the call's arguments, extended over what ``part`` binds.

    The caller's flags are a prefix of the positional arguments it passes (of ``(args, kwargs)``
    when it passes keywords); the partial's bound arguments keep the default, ``True``.
    """
    bound = (True,) * len(part.args)
    if has_kwargs:
        if len(flags) != 2:  # not the (args, kwargs) pair: split_call says so
            return flags
        args_flags, kwargs_flags = flags
        if isinstance(kwargs_flags, dict):
            kwargs_flags = {**dict.fromkeys(part.keywords, True), **kwargs_flags}
        return (bound + tuple(args_flags), kwargs_flags)
    return (bound + flags, True) if part.keywords else bound + flags


def _print_debug_report(function, region, remat_region, inputs, opts: CheckpointOptions) -> None:
    """``debug=True``: what the backward pass keeps, and what is recomputed instead."""
    from remat._core.residuals import saved_residuals

    name = getattr(function, "__qualname__", type(function).__name__)
    try:
        kept = saved_residuals(remat_region, *inputs)
        plain = saved_residuals(region, *inputs)
        recomputed = plain.residual_bytes - kept.residual_bytes
        report = (
            f"remat.checkpoint(debug=True) {name}, policy={opts.policy_label}:\n"
            f"  kept for the backward pass: {len(kept)} value(s), {kept.total_bytes} bytes\n"
            f"  without checkpoint it would keep: {len(plain)} value(s), {plain.total_bytes} bytes\n"
            f"  recomputed instead of kept: {max(recomputed, 0)} bytes\n"
            + "\n".join("  " + line for line in str(kept).splitlines())
        )
    except Exception as e:  # a report must never break the computation it describes
        print(f"remat.checkpoint(debug=True) {name}: no report ({type(e).__name__}: {e})", file=sys.stderr)
        return
    print(report, file=sys.stderr)

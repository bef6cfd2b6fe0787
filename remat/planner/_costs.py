"""Each region's recompute time and kept bytes under each option, from one trace of the step's forward pass."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jax

from remat import _jax as xb
from remat._core.lowering import classic_checkpoint
from remat._core.residuals import aval_nbytes
from remat.analysis.budget import op_work, rates
from remat.planner._search import _BACKGROUND, MEMORY_ONLY, compile_all
from remat.planner.steering import apply_policies
from remat.policies import is_no_checkpoint, resolve_policy


class RegionCosts(NamedTuple):
    """Per region, per option: ``ms`` recomputing, ``kept`` bytes kept for the backward pass
    (what JAX keeps of the region for its backward pass: its activation inputs and the
    values the option saves; not checkpointed, what its own backward needs)."""

    ms: list[list[float]]
    kept: list[list[int]]
    options: list[Any]


def region_costs(step_fn: Callable[..., Any], args: tuple, n: int, options: Sequence[Any]) -> RegionCosts | None:
    """Each region's predicted recompute time and kept bytes under each option.

    One trace of the step with every region checkpointed shows each region's forward
    operations. Under a policy, a region recomputes every operation whose output the
    policy does not save (its backward reads nearly every intermediate). Each operation's
    work is what :func:`remat.analysis.budget.op_work` counts (a matmul's or convolution's
    FLOPs, and bytes read and written as if nothing fused), scaled by what XLA's fusion
    leaves of the whole forward: one compile of each distinct body's forward, without
    LLVM's code generation, gives XLA's own FLOPs and bytes accessed for it. The work is
    priced at this machine's rates. Not checkpointed, a region recomputes nothing. The
    kept bytes are exact: the residuals of ``jax.vjp`` of the region's body under each
    option (:func:`_kept_bytes`), traced once per distinct body (a stack of identical
    blocks traces one).

    Args:
      step_fn: the step.
      args: its example arguments.
      n: the number of checkpointed regions one trace goes through.
      options: the choices (``NONE``, a policy name, checkpoint names, a JAX policy).

    Returns:
      The costs, ``[region][option]``, or None when the trace does not show the ``n``
      regions as checkpoint equations outside any loop (a scan's body, say).

    Example:
      >>> region_costs(loss, (params, x), 4, [NONE, "nothing", "dots"]).ms[0]  # doctest: +SKIP
      [0.0, 0.021, 0.008]
    """
    finish = start_region_costs(step_fn, args, n, options)
    return None if finish is None else finish()


def start_region_costs(step_fn: Callable[..., Any], args: tuple, n: int, options: Sequence[Any],
                       jaxpr: Any = None) -> Callable[[], RegionCosts] | None:
    """:func:`region_costs` in two halves: the step's trace here (or ``jaxpr``, that trace
    made already, every region checkpointed with policy ``"nothing"``), which starts the
    compiles of its distinct region bodies in the background; the rest in the function
    returned (None: the trace does not show the ``n`` regions)."""
    if jaxpr is None:
        jaxpr = jax.make_jaxpr(lambda *a: apply_policies(step_fn, ("nothing",) * n)(*a))(*args)
    bodies = list(_region_bodies(jaxpr.jaxpr))
    if len(bodies) != n:
        return None
    # identical blocks print alike: one trace per distinct body; XLA compiles each
    # distinct body's forward in the background, to show what its fusion saves
    keys = [(str(body), computed) for computed, body in bodies]
    distinct = dict(zip(keys, (body for _, body in bodies)))
    fusing = {key: _BACKGROUND.submit(_compiled_work, body) for key, body in distinct.items()}
    return lambda: _priced(keys, distinct, fusing, list(options))


Key = tuple[str, tuple[bool, ...]]  # a region body, printed, and which of its inputs the step computed


def _priced(keys: list[Key], distinct: dict[Key, Any], fusing: dict[Key, Any], options: list[Any]) -> RegionCosts:
    """The costs of the regions ``keys`` (in order), one trace of each distinct body per
    option, its work scaled by what XLA's compile of its forward (``fusing``) counted."""
    policies = [None if is_no_checkpoint(o) else resolve_policy(o) for o in options]
    rate = rates()
    rows: dict[Key, tuple[list[float], list[int]]] = {}
    for key, body in distinct.items():
        ops = list(_leaf_eqns(body.jaxpr))
        work = {e: _work(e) for e in ops}
        work_row, kept_row = [], []
        for option, policy in zip(options, policies):
            unchecked = is_no_checkpoint(option)
            saved = {v for e in ops for v in e.outvars} if unchecked else _saved_vars(ops, policy)
            work_row.append(_total(w for e, w in work.items() if not all(v in saved for v in e.outvars)))
            kept_row.append(_kept_bytes(body, key[1], policy, checkpointed=not unchecked))
        fused, unfused = fusing[key].result(), _total(work.values())
        # XLA's count over the cost model's, for the whole forward: recomputing part of
        # it is taken to fuse as well (1 where either count is missing)
        scale = [x / u if x and u else 1.0 for x, u in zip(fused, unfused)] if fused else [1.0, 1.0]
        rows[key] = ([1e3 * (f * scale[0] / rate["flops_per_s"] + b * scale[1] / rate["bytes_per_s"])
                      for f, b in work_row], kept_row)
    return RegionCosts([list(rows[k][0]) for k in keys], [list(rows[k][1]) for k in keys], list(options))


def _kept_bytes(body: Any, computed: tuple[bool, ...], policy: Any, checkpointed: bool) -> int:
    """Bytes a region keeps for its backward pass: the residuals of ``jax.vjp`` of its
    body, less the inputs that are the step's arguments (parameters and data are held anyway).

    Args:
      body: the region's body, a closed jaxpr.
      computed: per input of ``body``, whether the step computed it (an activation).
      policy: the JAX policy it is checkpointed with (None: save nothing).
      checkpointed: False: the body is not checkpointed (``policy`` is ignored).
    """
    fn = xb.jaxpr_function(body)
    if checkpointed:  # as remat's regions are built, whatever jax_remat3 says
        fn = classic_checkpoint(fn, policy=policy)
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in body.jaxpr.invars]
    traced, shapes = jax.make_jaxpr(lambda *xs: jax.vjp(fn, *xs), return_shape=True)(*avals)
    jaxpr = traced.jaxpr
    count = jax.tree_util.tree_structure(shapes[1]).num_leaves
    residuals = {v for v in jaxpr.outvars[len(jaxpr.outvars) - count:] if not xb.is_literal(v)}
    position = {v: i for i, v in enumerate(jaxpr.invars)}
    constants = set(jaxpr.constvars)
    return sum(aval_nbytes(v.aval) for v in residuals
               if (computed[position[v]] if v in position else v not in constants))


def _region_bodies(jaxpr: Any) -> Iterator[tuple[tuple[bool, ...], Any]]:
    """``(computed, body)`` of every checkpoint equation, in order, looking through jits
    and calls but not into loops (a region in a loop body runs many times) or into the
    regions. ``body`` is a closed jaxpr; ``computed`` says, per input, whether the step
    computed it (an activation), not took it as an argument (parameters, data)."""
    remat_p = xb.checkpoint_primitive()
    produced = {v for e in jaxpr.eqns for v in e.outvars}
    for eqn in jaxpr.eqns:
        if eqn.primitive is remat_p:
            body = eqn.params["jaxpr"]
            yield tuple(not xb.is_literal(v) and v in produced for v in eqn.invars), xb.closed_jaxpr(body)
        elif eqn.primitive.name not in ("scan", "while"):
            for sub in xb.eqn_subjaxprs(eqn):
                yield from _region_bodies(getattr(sub, "jaxpr", sub))


def _leaf_eqns(jaxpr: Any) -> Iterator[Any]:
    """Every equation that holds no other jaxpr, nested ones included."""
    for eqn in jaxpr.eqns:
        subs = list(xb.eqn_subjaxprs(eqn))
        if not subs:
            yield eqn
        for sub in subs:
            yield from _leaf_eqns(getattr(sub, "jaxpr", sub))


def _saved_vars(ops: list[Any], policy: Any) -> set[Any]:
    """The values ``policy`` saves: the outputs of the operations it marks saveable; a
    ``checkpoint_name`` it saves also saves the value it names."""
    saved: set[Any] = set()
    if policy is None:
        return saved
    name_p = xb.name_primitive()
    for eqn in ops:
        try:
            decision = policy(eqn.primitive, *[v.aval for v in eqn.invars], **eqn.params)
        except Exception:  # a policy that cannot judge this operation saves nothing by it
            continue
        if decision and "Recompute" not in type(decision).__name__:
            saved.update(eqn.outvars)
            if eqn.primitive is name_p:
                saved.update(v for v in eqn.invars if not xb.is_literal(v))
    return saved


def _work(eqn: Any) -> tuple[float, float]:
    """``(FLOPs, bytes moved)`` of one operation, unfused (:func:`remat.analysis.budget.op_work`)."""
    out_bytes = sum(aval_nbytes(v.aval) for v in eqn.outvars)
    return op_work(eqn.primitive.name, [v.aval for v in eqn.invars], eqn.params, out_bytes)


def _total(work: Iterable[tuple[float, float]]) -> tuple[float, float]:
    flops, moved = 0.0, 0.0
    for f, b in work:
        flops, moved = flops + f, moved + b
    return flops, moved


def _compiled_work(body: Any) -> tuple[float, float] | None:
    """``(FLOPs, bytes accessed)`` of a region's forward as XLA compiles it, fused (its cost
    analysis; LLVM's code generation is skipped, :data:`remat.planner._search.MEMORY_ONLY`);
    None where the backend gives no cost analysis."""
    fn = xb.jaxpr_function(body)
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in body.jaxpr.invars]
    try:
        cost = compile_all([jax.jit(fn).lower(*avals)], MEMORY_ONLY)[0].cost_analysis()
    except Exception:  # no cost analysis here: the unfused counts stand
        return None
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    if not cost:
        return None
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))

"""Each region's recompute time and kept bytes under each option, from traces of its forward and backward pass."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from remat import _jax as xb
from remat._core.lowering import classic_checkpoint
from remat._core.residuals import aval_nbytes
from remat.analysis.machine import Rates, op_work
from remat.planner._search import BACKGROUND, MEMORY_ONLY, compile_all
from remat.planner.steering import apply_policies
from remat.policies import is_no_checkpoint, resolve_policy


class RegionCosts(NamedTuple):
    """Per region, per option: ``ms`` recomputing, ``kept`` bytes kept for the backward pass
    (what JAX keeps of the region for its backward pass: its activation inputs and the
    values the option saves; not checkpointed, what its own backward needs); both for one
    run of the region. ``trips``: per region, how many times one step runs it (a region in
    the body of a ``lax.scan`` of length 32 runs 32 times, with one decision for all)."""

    ms: list[list[float]]
    kept: list[list[int]]
    options: list[Any]
    trips: list[int] | None = None

    def runs(self, i: int) -> int:
        """How many times one step runs region ``i``."""
        return 1 if self.trips is None else self.trips[i]


def region_costs(step_fn: Callable[..., Any], args: tuple, n: int, options: Sequence[Any], *,
                 rates: Rates) -> RegionCosts | None:
    """Each region's predicted recompute time and kept bytes under each option.

    One trace of the step with every region checkpointed shows each region's body. Under
    each option, one trace of the body's forward and backward pass (``jax.vjp`` and its
    backward function) shows what JAX's partial evaluation recomputes: the work beyond the
    un-checkpointed body's forward and backward (:func:`_vjp_work`). A matmul, a
    convolution or a reduction costs its FLOPs and the bytes it reads and writes
    (:func:`remat.analysis.machine.op_work`); another operation fuses into the backward
    pass's fusion that reads it, and costs one FLOP an output element (none if it only
    moves data). The FLOPs are scaled by XLA's count over this one for the whole forward
    (one compile of each distinct body's forward, without LLVM's code generation), and
    the work is priced at ``rates``. Not checkpointed, a region recomputes
    nothing. The kept bytes are exact: the residuals of the same ``jax.vjp``. Each
    distinct body is traced once per option (a stack of identical blocks traces one).

    Args:
      step_fn: the step.
      args: its example arguments.
      n: the number of checkpointed regions one trace goes through.
      options: the choices (``NO_CHECKPOINT``, a policy name, checkpoint names, a JAX policy).
      rates: the machine's rates (:func:`remat.analysis.machine.calibrate`).

    Returns:
      The costs, ``[region][option]``, for one run of each region (``trips``: how many
      runs one step makes, a region in a ``lax.scan``'s body one per trip), or None when
      the trace does not show the ``n`` regions as checkpoint equations outside any
      ``while`` loop.

    Example:
      >>> region_costs(loss, (params, x), 4, [NO_CHECKPOINT, "nothing", "dots"], rates=rates).ms[0]  # doctest: +SKIP
      [0.0, 0.021, 0.008]
    """
    finish = start_region_costs(step_fn, args, n, options, rates=rates)
    return None if finish is None else finish()


def start_region_costs(step_fn: Callable[..., Any], args: tuple, n: int, options: Sequence[Any], *,
                       rates: Rates, jaxpr: Any = None) -> Callable[[], RegionCosts] | None:
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
    keys = [(str(body), computed) for computed, body, _ in bodies]
    distinct = dict(zip(keys, (body for _, body, _ in bodies)))
    fusing = {key: BACKGROUND.submit(_compiled_work, body) for key, body in distinct.items()}
    trips = [t for _, _, t in bodies]
    return lambda: _priced(keys, distinct, fusing, list(options), rates)._replace(trips=trips)


Key = tuple[str, tuple[bool, ...]]  # a region body, printed, and which of its inputs the step computed


def _priced(keys: list[Key], distinct: dict[Key, Any], fusing: dict[Key, Any], options: list[Any],
            rates: Rates) -> RegionCosts:
    """The costs of the regions ``keys`` (in order), one trace of each distinct body's
    forward and backward pass per option, its work scaled by what XLA's compile of its
    forward (``fusing``) counted."""
    policies = [None if is_no_checkpoint(o) else resolve_policy(o) for o in options]
    rows: dict[Key, tuple[list[float], list[int]]] = {}
    for key, body in distinct.items():
        traced = [_vjp_work(body, key[1], policy, checkpointed=not is_no_checkpoint(option))
                  for option, policy in zip(options, policies)]
        # what a region recomputes is what its forward and backward pass do beyond the
        # un-checkpointed ones: JAX's partial evaluation, not a guess, decides which of
        # its operations run again (the backward reads only some of them)
        unchecked = next((t for t, o in zip(traced, options) if is_no_checkpoint(o)), None)
        base = unchecked[2] if unchecked is not None else _vjp_work(body, key[1], None, checkpointed=False)[2]
        work_row = [(max(f - base[0], 0.0), max(b - base[1], 0.0)) for _, _, (f, b) in traced]
        kept_row = [kept for kept, _, _ in traced]
        fused, unfused = fusing[key].result(), _total(_work(e) for e in _leaf_eqns(body.jaxpr))
        # XLA's FLOPs over the cost model's, for the whole forward (1 where either count is missing)
        scale = fused[0] / unfused[0] if fused and fused[0] and unfused[0] else 1.0
        rows[key] = ([1e3 * (f * scale / rates.flops_per_s + b / rates.bytes_per_s) + host_transfer_ms(host)
                      for (f, b), (_, host, _) in zip(work_row, traced)], kept_row)
    return RegionCosts([list(rows[k][0]) for k in keys], [list(rows[k][1]) for k in keys], list(options))


def _vjp_work(body: Any, computed: tuple[bool, ...], policy: Any,
              checkpointed: bool) -> tuple[int, int, tuple[float, float]]:
    """The bytes a region keeps for its backward pass, and the work of its forward and
    backward passes, from one trace of ``jax.vjp`` of its body and of the backward pass.

    The kept bytes are the residuals of ``jax.vjp``, less the inputs that are the step's
    arguments (parameters and data are held anyway), and less those an offloading policy
    puts in host memory: the offloaded bytes, which cost a copy each way instead.

    Args:
      body: the region's body, a closed jaxpr.
      computed: per input of ``body``, whether the step computed it (an activation).
      policy: the JAX policy it is checkpointed with (None: save nothing).
      checkpointed: False: the body is not checkpointed (``policy`` is ignored).

    Returns:
      ``(kept bytes, offloaded bytes, (FLOPs, bytes moved))``, the work unfused (:func:`_work`).
    """
    fn = xb.jaxpr_function(body)
    if checkpointed:  # as remat's regions are built, whatever jax_remat3 says
        fn = classic_checkpoint(fn, policy=policy)

    def forward_and_backward(*xs):
        out, backward = jax.vjp(fn, *xs)
        # the outputs stand for their cotangents (same shapes): nothing is added to the trace
        cotangents = jax.tree_util.tree_map(_cotangent, out)
        return jax.tree_util.tree_leaves(backward), backward(cotangents)

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in body.jaxpr.invars]
    traced, shapes = jax.make_jaxpr(forward_and_backward, return_shape=True)(*avals)
    jaxpr = traced.jaxpr
    count = len(shapes[0])
    residuals = {v for v in jaxpr.outvars[:count] if not xb.is_literal(v)}
    position = {v: i for i, v in enumerate(jaxpr.invars)}
    constants = set(jaxpr.constvars)
    held = [v for v in residuals if (computed[position[v]] if v in position else v not in constants)]
    offloaded = sum(aval_nbytes(v.aval) for v in held if _on_host(v.aval))
    # held anyway: the step's arguments (parameters, data) and the jaxpr's constants
    given = constants | {v for v, c in zip(jaxpr.invars, computed) if not c}
    stored = _materialized(jaxpr, [v for v in held if not _on_host(v.aval)], given)
    kept = sum(aval_nbytes(v.aval) for v in stored)
    return kept, offloaded, _total(_work(e) for e in _leaf_eqns(jaxpr))


def _materialized(jaxpr: Any, held: list[Any], given: set[Any]) -> list[Any]:
    """The residuals of ``held`` that XLA keeps in memory: not those that fused operations
    compute from the others (and from ``given``, what the step holds anyway).

    A residual that cheap element-wise operations compute from other residuals
    (``1 - tanh(x)**2`` from ``tanh(x)``) fuses into the backward pass's fusions that read
    it: XLA recomputes it there and never stores it, so it costs no bytes; one that a
    matmul reads (:data:`_LIBRARY_CALLS`) is stored. The
    latest residuals are weighed first, each against the others still kept, so of values
    derived from one another the earliest (the one the others derive from) stays.
    """
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    order = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    # a value a library call reads (a matmul, a convolution) is a buffer of its own, not fused
    operands = {v for e in jaxpr.eqns if e.primitive.name in _LIBRARY_CALLS or any(True for _ in xb.eqn_subjaxprs(e))
                for v in e.invars if not xb.is_literal(v)}
    stored = set(held)
    for r in sorted(held, key=lambda v: order.get(v, -1), reverse=True):
        if r not in operands and _fusible(r, (stored - {r}) | given, producer, {}):
            stored.discard(r)
    return [v for v in held if v in stored]


#: Operations XLA:CPU runs as library calls, which read their operands from buffers:
#: a value one of them reads is stored, whatever computes it.
_LIBRARY_CALLS = frozenset({"dot_general", "conv_general_dilated"})


#: Element-wise operations XLA does not compute twice to fuse them into a second reader
#: (its ``IsExpensive``: transcendentals, division, powers): a residual they compute is
#: stored (GELU's ``tanh``), where one cheap operations compute is recomputed.
_EXPENSIVE = frozenset({"tanh", "exp", "exp2", "log", "log1p", "expm1", "logistic", "erf", "erfc", "erf_inv",
                        "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh",
                        "atanh", "pow", "sqrt", "rsqrt", "cbrt", "div", "rem", "lgamma", "digamma"})


def _fusible(v: Any, available: set[Any], producer: dict[Any, Any], seen: dict[Any, bool]) -> bool:
    """Whether ``v`` is computed from ``available`` values by operations XLA fuses into
    their readers, computing them again there (cheap element-wise operations and moves:
    not :data:`_MATERIALIZED`, not :data:`_EXPENSIVE`, no nested jaxpr)."""
    if xb.is_literal(v) or v in available:
        return True
    if v not in seen:
        eqn = producer.get(v)
        seen[v] = False  # a value is not derived from itself
        seen[v] = (eqn is not None and eqn.primitive.name not in _MATERIALIZED | _EXPENSIVE
                   and not any(True for _ in xb.eqn_subjaxprs(eqn))
                   and all(_fusible(u, available, producer, seen) for u in eqn.invars))
    return seen[v]


#: Bytes per second a value offloaded to host memory crosses the link at, each way:
#: PCIe 4.0 x16's nominal rate, the slowest host link of current GPUs and TPUs.
HOST_BYTES_PER_S = 32e9


def host_transfer_ms(nbytes: float) -> float:
    """Milliseconds to move ``nbytes`` offloaded values to host memory in the forward pass
    and back in the backward pass, at :data:`HOST_BYTES_PER_S`."""
    return 1e3 * 2 * nbytes / HOST_BYTES_PER_S


def _on_host(aval: Any) -> bool:
    """Whether a residual is kept in host memory (an offloading policy's ``pinned_host``)."""
    space = getattr(aval, "memory_space", None)
    return str(getattr(space, "name", space)).lower() == "host"


def _cotangent(out: Any) -> Any:
    """The cotangent of one output: itself where it is floating, else a ``float0`` zero."""
    if jax.numpy.issubdtype(out.dtype, jax.numpy.inexact):
        return out
    return np.zeros(out.shape, dtype=jax.dtypes.float0)


def _region_bodies(jaxpr: Any, computed: frozenset[Any] = frozenset(),
                   trips: int = 1) -> Iterator[tuple[tuple[bool, ...], Any, int]]:
    """``(computed, body, trips)`` of every checkpoint equation, in order, looking through
    jits, calls and the bodies of ``lax.scan`` (a region there runs once per trip: ``trips``
    is the product of the lengths of the scans around it), but not into ``while`` loops
    (their trip count is not known) or into the regions. ``body`` is a closed jaxpr;
    ``computed`` says, per input, whether the step computed it (an activation), not took
    it as an argument (parameters, data).

    Args:
      jaxpr: the jaxpr walked.
      computed: its input variables that hold activations (a scan body's carry, say).
      trips: how many times one step runs ``jaxpr``.
    """
    produced = set(computed) | {v for e in jaxpr.eqns for v in e.outvars}
    for eqn in jaxpr.eqns:
        body = xb.checkpoint_body(eqn)  # jax_remat3's construct too (a region written with jax.checkpoint)
        if body is not None:
            yield (tuple(not xb.is_literal(v) and v in produced for v in eqn.invars), xb.closed_jaxpr(body),
                   trips)
        elif eqn.primitive.name == "scan":
            body = eqn.params["jaxpr"].jaxpr
            yield from _region_bodies(body, _scan_computed(eqn, body, produced), trips * eqn.params["length"])
        elif eqn.primitive.name != "while":
            for sub in xb.eqn_subjaxprs(eqn):
                yield from _region_bodies(getattr(sub, "jaxpr", sub), trips=trips)


def _scan_computed(eqn: Any, body: Any, produced: set[Any]) -> frozenset[Any]:
    """The inputs of a scan's ``body`` that hold activations: the carry (each trip computes
    the next), and the constants and scanned-over operands the step computed (a stack of
    layer weights that is an argument is not one)."""
    consts, carry = eqn.params["num_consts"], eqn.params["num_carry"]
    out = set()
    for i, (inner, outer) in enumerate(zip(body.invars, eqn.invars)):
        if consts <= i < consts + carry or (not xb.is_literal(outer) and outer in produced):
            out.add(inner)
    return frozenset(out)


def _leaf_eqns(jaxpr: Any) -> Iterator[Any]:
    """Every equation that holds no other jaxpr, nested ones included."""
    for eqn in jaxpr.eqns:
        subs = list(xb.eqn_subjaxprs(eqn))
        if not subs:
            yield eqn
        for sub in subs:
            yield from _leaf_eqns(getattr(sub, "jaxpr", sub))


#: Operations whose output XLA writes to memory: a matmul or a convolution (a library
#: call on CPU) and a reduction. Element-wise operations, broadcasts, reshapes and the
#: like fuse into the operations that read them, so recomputed in the backward pass they
#: move no bytes of their own: they are computed where the backward reads them.
_MATERIALIZED = frozenset({"dot_general", "conv_general_dilated", "reduce_sum", "reduce_max", "reduce_min",
                           "reduce_prod", "reduce_and", "reduce_or", "argmax", "argmin", "cumsum", "cumprod",
                           "cummax", "cummin", "cumlogsumexp", "sort", "scatter", "scatter-add"})


#: Operations that only move or relabel data: fused, they compute nothing.
_MOVES = frozenset({"reshape", "broadcast_in_dim", "squeeze", "expand_dims", "transpose", "slice", "dynamic_slice",
                    "concatenate", "pad", "copy", "copy_p", "convert_element_type", "name", "reduce_precision",
                    "optimization_barrier", "iota", "split", "stop_gradient", "rev", "gather", "dynamic_update_slice",
                    "device_put"})  # an offload's copy to host and back is priced apart (:func:`host_transfer_ms`)


def _work(eqn: Any) -> tuple[float, float]:
    """``(FLOPs, bytes moved)`` of one operation (:func:`remat.analysis.machine.op_work`),
    the bytes only where its output is materialized (:data:`_MATERIALIZED`); another
    operation that computes costs one FLOP an output element, as XLA counts it."""
    name = eqn.primitive.name
    if name in _MOVES:
        return 0.0, 0.0
    if name not in _MATERIALIZED:
        return float(sum(math.prod(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))), 0.0
    out_bytes = sum(aval_nbytes(v.aval) for v in eqn.outvars)
    return op_work(name, [v.aval for v in eqn.invars], eqn.params, out_bytes)


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

"""Each region's recompute time under each option, from one trace of the step's forward pass."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from remat import _jax as xb
from remat._core.residuals import aval_nbytes
from remat.analysis.budget import op_cost
from remat.planner.steering import apply_policies
from remat.policies import is_no_checkpoint, resolve_policy


def recompute_ms(step_fn: Callable[..., Any], args: tuple, n: int,
                 options: Sequence[Any]) -> list[list[float]] | None:
    """Per region, per option: the predicted ms its backward pass spends recomputing.

    One trace of the step with every region checkpointed shows each region's forward
    operations. Under a policy, a region recomputes every operation whose output the
    policy does not save (its backward reads nearly every intermediate); each costs what
    :func:`remat.analysis.budget.op_cost` says (the residual budget's own model: bytes
    read and written, and a matmul's or convolution's FLOPs, at this machine's rates).
    Not checkpointed, a region recomputes nothing.

    Args:
      step_fn: the step.
      args: its example arguments.
      n: the number of checkpointed regions one trace goes through.
      options: the choices (``NONE``, a policy name, checkpoint names, a JAX policy).

    Returns:
      ``[region][option]`` in ms, or None when the trace does not show the ``n``
      regions as checkpoint equations outside any loop (a scan's body, say).

    Example:
      >>> recompute_ms(loss, (params, x), 4, [NONE, "nothing", "dots"])[0]  # doctest: +SKIP
      [0.0, 0.021, 0.008]
    """
    jaxpr = jax.make_jaxpr(lambda *a: apply_policies(step_fn, ("nothing",) * n)(*a))(*args)
    bodies = list(_region_bodies(jaxpr.jaxpr))
    if len(bodies) != n:
        return None
    policies = [None if is_no_checkpoint(o) else resolve_policy(o) for o in options]
    rows = []
    for body in bodies:
        ops = list(_leaf_eqns(body))
        row = []
        for option, policy in zip(options, policies):
            if is_no_checkpoint(option):
                row.append(0.0)
                continue
            saved = _saved_vars(ops, policy)
            row.append(1e3 * sum(_cost(e) for e in ops if not all(v in saved for v in e.outvars)))
        rows.append(row)
    return rows


def _region_bodies(jaxpr: Any) -> Iterator[Any]:
    """The body of every checkpoint equation, in order, looking through jits and calls but
    not into loops (a region in a loop body runs many times) or into the regions."""
    remat_p = xb.checkpoint_primitive()
    for eqn in jaxpr.eqns:
        if eqn.primitive is remat_p:
            body = eqn.params["jaxpr"]
            yield getattr(body, "jaxpr", body)
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


def _cost(eqn: Any) -> float:
    avals = [v.aval for v in eqn.invars]
    out_bytes = sum(aval_nbytes(v.aval) for v in eqn.outvars)
    return op_cost(eqn.primitive.name, avals, eqn.params, out_bytes)

"""The checkpointed regions of a traced step, what each keeps for its backward pass, and why.

In the jaxpr of a step that differentiates (``jax.grad``, a training step), the forward
half of every checkpointed region is inlined and its backward half is one ``checkpoint``
equation (``differentiated=True``) whose operands are what the region kept: its inputs
and the values its policy saves. Each kept value is described by where it was produced
(module path, user source line, bytes), so that the compiled program's buffers, which
carry the same metadata, can be told which region and which policy rule kept them.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from remat import _jax as xb
from remat.explainer._module_names import module_of
from remat.explainer._sources import format_source, user_frame


@dataclasses.dataclass(frozen=True)
class Kept:
    """One value a region keeps for its backward pass."""

    module: str | None
    source: str | None
    nbytes: int
    rule: str
    by_policy: bool  # the policy chose it (else: a region input, kept by every policy)


@dataclasses.dataclass(frozen=True)
class RegionInfo:
    """One checkpointed region (its backward ``checkpoint`` equation).

    Attributes:
      label: the module path of the region (``"blocks.3"``) or ``"region at file.py:LINE"``.
      module: the module path, when the region's code ran inside one.
      policy: the policy's name (``"dots"``, ``"names ['attn_out']"``, ...).
      kept: what it keeps for the backward pass.
      names: the ``checkpoint_name`` tags applied inside it.
      order: its position among the regions' backward halves (0 runs first).
    """

    label: str
    module: str | None
    source: str | None
    policy: str
    kept: tuple[Kept, ...]
    names: tuple[str, ...]
    order: int
    saveable_names: tuple[str, ...] = ()
    in_loop: bool = False  # inside a scan or while body: its kept values are stacked per iteration
    keeps_everything: bool = False  # its backward recomputes nothing its policy would not keep

    @property
    def policy_matches_nothing(self) -> bool:
        """The policy chose nothing here though it is meant to (any policy but ``nothing``)."""
        return self.policy != "nothing" and not any(k.by_policy for k in self.kept)


def describe_policy(policy: Any) -> tuple[str, tuple[str, ...]]:
    """``(name, saveable names)`` of a JAX policy, looking through remat's region marker."""
    inner = getattr(policy, "policy", policy) if type(policy).__name__ == "RegionPolicy" else policy
    if inner is None:
        return "nothing", ()
    kind = type(inner).__name__
    if kind == "DotsSaveable":
        return ("dots_no_batch" if getattr(inner, "only_if_no_batch_dims", False) else "dots"), ()
    if kind in ("SaveOnlyTheseNames", "SaveNames"):  # JAX's class, or remat's before JAX 0.10.2
        names = tuple(sorted(getattr(inner, "saveable_names", ())))
        return f"names {list(names)}", names
    name = getattr(inner, "__name__", kind)
    return {"everything_saveable": "everything", "nothing_saveable": "nothing", "dots_saveable": "dots",
            "dots_with_no_batch_dims_saveable": "dots_no_batch", "budget_choice": "residual budget"}.get(name, name), ()


def _rule(policy: str, primitive: str, name: str | None, by_policy: bool, region: str) -> str:
    if not by_policy:
        return f"saved: an input of {region} (a checkpointed region always keeps its inputs)"
    if name is not None and policy.startswith("names"):
        return f"saved: `{policy}` keeps the value named {name!r}"
    return {
        "dots": "saved: `dots` keeps dot and convolution outputs",
        "dots_no_batch": "saved: `dots_no_batch` keeps dot outputs without batch dimensions",
        "everything": "saved: `everything` keeps every intermediate",
        "residual budget": "saved: the residual budget chose it for this region",
    }.get(policy, f"saved: `{policy}` keeps this {primitive} output")


def _nbytes(aval: Any) -> int:
    try:
        return int(math.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys)
        return 0


_LOOPS = ("scan", "while")


def _walk(jaxpr: Any, in_loop: bool = False) -> Iterator[tuple[Any, bool]]:
    """Every jaxpr, nested ones included, and whether it runs inside a loop's body."""
    current = getattr(jaxpr, "jaxpr", jaxpr)
    yield current, in_loop
    for eqn in current.eqns:
        looped = in_loop or eqn.primitive.name in _LOOPS
        for sub in xb.eqn_subjaxprs(eqn):
            yield from _walk(sub, looped)


def _eqns(jaxpr: Any) -> Iterator[Any]:
    for j, _ in _walk(jaxpr):
        yield from j.eqns


def _common_module(jaxpr: Any) -> str | None:
    paths = [m.split(".") for m in (module_of(xb.name_stack(e)) for e in _eqns(jaxpr)) if m]
    if not paths:
        return None
    common = paths[0]
    for p in paths[1:]:
        n = 0
        while n < min(len(common), len(p)) and common[n] == p[n]:
            n += 1
        common = common[:n]
    return ".".join(common) or None


def region_module(eqn: Any) -> str | None:
    """The module a checkpointed region's backward equation checkpoints.

    The modules called inside the region name its operations; a region whose own code runs
    outside them (a module whose ``__call__`` was made the region, as
    :func:`remat.apply_checkpointing` does) is the module it is called in.
    """
    inner = eqn.params["jaxpr"]
    outer = module_of(xb.name_stack(eqn))
    unscoped = any(module_of(xb.name_stack(e)) is None for e in _eqns(inner))
    if outer and unscoped:
        return outer
    return _common_module(inner) or outer


def _look_through(eqn: Any, producers: dict) -> tuple[Any, str | None]:
    """The equation that really made a value (past reduce_precision), and its checkpoint name."""
    name = None
    seen = 0
    while eqn is not None and seen < 8:
        seen += 1
        if eqn.primitive is xb.name_primitive():
            name = eqn.params.get("name")
            return eqn, name
        if eqn.primitive is xb.reduce_precision_primitive() and eqn.invars:
            eqn = producers.get(eqn.invars[0])
            continue
        return eqn, name
    return eqn, name


def _is_cotangent(v: Any, producers: dict) -> bool:
    """An operand of a region's backward half that flows in from the backward pass (a literal: the seed)."""
    if xb.is_literal(v):
        return True
    producer = producers.get(v)
    return producer is not None and "transpose(" in xb.name_stack(producer)


def recomputed_operations(eqn: Any, producers: dict) -> list[Any]:
    """The operations a region's backward half recomputes: those that read no cotangent.

    Args:
      eqn: the region's backward ``checkpoint`` equation (``differentiated=True``).
      producers: the equation that makes each variable of the jaxpr around it.
    """
    inner = getattr(eqn.params["jaxpr"], "jaxpr", eqn.params["jaxpr"])
    backward = {inner_var for outer, inner_var in zip(eqn.invars, inner.invars) if _is_cotangent(outer, producers)}
    recomputed = []
    for e in inner.eqns:
        if any(not xb.is_literal(v) and v in backward for v in e.invars):
            backward.update(e.outvars)
        else:
            recomputed.append(e)
    return recomputed


def keeps_everything(policy: Any, eqn: Any, producers: dict) -> bool:
    """The region's backward recomputes nothing, or only what its policy would have kept (values JAX
    does not save, such as a comparison's mask): its checkpoint saves no memory."""
    return all(_decides(policy, e) for e in recomputed_operations(eqn, producers))


def _decides(policy: Any, eqn: Any) -> bool:
    try:
        decision = policy(eqn.primitive, *[v.aval for v in eqn.invars], **eqn.params)
    except Exception:  # a policy that cannot judge this equation keeps nothing by it
        return False
    return bool(decision) and "Recompute" not in type(decision).__name__


def regions(closed_jaxpr: Any) -> list[RegionInfo]:
    """Every checkpointed region whose backward half the traced step runs, in order.

    Args:
      closed_jaxpr: the step's jaxpr (``jax.jit(step).trace(...).jaxpr``).
    """
    found: list[RegionInfo] = []
    remat_p = xb.checkpoint_primitive()
    for jaxpr, in_loop in _walk(closed_jaxpr):
        producers = {v: e for e in jaxpr.eqns for v in e.outvars}
        for eqn in jaxpr.eqns:
            if eqn.primitive is not remat_p or not eqn.params.get("differentiated"):
                continue
            inner = eqn.params["jaxpr"]
            policy = eqn.params.get("policy")
            label_policy, saveable = describe_policy(policy)
            module = region_module(eqn)
            # where remat.checkpoint was called; else (a decorated function called by JAX) its first line
            source = format_source(user_frame(xb.frames(eqn)) or next(
                (f for f in (user_frame(xb.frames(e)) for e in _eqns(inner)) if f), None))
            label = module if module else f"region at {source or '?'}"
            kept = []
            for v in eqn.invars:
                if xb.is_literal(v):
                    continue
                producer = producers.get(v)
                if producer is not None and "transpose(" in xb.name_stack(producer):
                    continue  # a cotangent flowing in, not a kept value
                maker, name = _look_through(producer, producers) if producer is not None else (None, None)
                by_policy = maker is not None and _decides(policy, maker)
                where = producer if producer is not None else None
                kept.append(Kept(
                    module_of(xb.name_stack(where)) if where is not None else None,
                    format_source(user_frame(xb.frames(where))) if where is not None else None,
                    _nbytes(v.aval),
                    _rule(label_policy, maker.primitive.name if maker is not None else "input", name, by_policy,
                          label),
                    by_policy))
            names = tuple(dict.fromkeys(e.params["name"] for e in _eqns(inner)
                                        if e.primitive is xb.name_primitive()))
            found.append(RegionInfo(label, module, source, label_policy, tuple(kept), names, len(found), saveable,
                                    in_loop, keeps_everything(policy, eqn, producers)))
    return found


def kept_index(infos: list[RegionInfo]) -> dict[tuple, list[tuple[RegionInfo, Kept]]]:
    """``(module, source, bytes)`` and ``(None, source, bytes)`` -> the regions that keep such a value."""
    index: dict[tuple, list[tuple[RegionInfo, Kept]]] = {}
    for info in infos:
        for k in info.kept:
            index.setdefault((k.module, k.source, k.nbytes), []).append((info, k))
            index.setdefault((None, k.source, k.nbytes), []).append((info, k))
    return index


def kept_bytes_by_module(closed_jaxpr: Any) -> tuple[dict[str | None, int], list[str]]:
    """What a differentiating step keeps for its backward pass, by the module that keeps it.

    A value is kept when the forward pass makes it and the backward pass reads it; it is
    charged to the module whose backward reads it (as PyTorch charges a saved tensor to
    the operation that saves it): a checkpointed region to its module (it keeps its
    inputs), any other backward operation to the module in its name stack. The step's own
    inputs (parameters, data) are not counted.

    Returns:
      ``(bytes by module path (None: outside every module), the regions' module paths)``.
    """
    jaxpr = getattr(closed_jaxpr, "jaxpr", closed_jaxpr)
    remat_p = xb.checkpoint_primitive()
    made_forward = {v for e in jaxpr.eqns if "transpose(" not in xb.name_stack(e) for v in e.outvars}
    charged: dict[Any, tuple[bool, str | None]] = {}
    region_modules = []
    for eqn in jaxpr.eqns:  # in backward order, so the last reader is the first in forward order
        region = eqn.primitive is remat_p and eqn.params.get("differentiated")
        if region:
            module = region_module(eqn)
            region_modules.append(module)
        elif "transpose(" in xb.name_stack(eqn):
            module = module_of(xb.name_stack(eqn))
        else:
            continue
        for v in eqn.invars:  # a region that keeps a value is charged for it before any other reader
            if not xb.is_literal(v) and v in made_forward and (region or not charged.get(v, (False,))[0]):
                charged[v] = (bool(region), module)
    totals: dict[str | None, int] = {}
    for v, (_, module) in charged.items():
        totals[module] = totals.get(module, 0) + _nbytes(v.aval)
    return totals, [m for m in region_modules if m]

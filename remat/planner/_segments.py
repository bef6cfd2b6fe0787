"""One scanned stack split into segments: consecutive scans over slices of its layers, each with its own option."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax import lax

from remat import _jax as xb
from remat._core.residuals import aval_nbytes
from remat.policies import is_no_checkpoint, policy_name

#: How a split is spelled: ``"layers 0-19: nothing; 20-31: dots"`` (a saved plan's option too).
PREFIX = "layers "
_PART = re.compile(r"^(\d+)-(\d+): (.+)$")


class Segments(str):
    """A scanned region's option for each run of consecutive layers (trips of its scan).

    A string (its spelling, the label and saved name of the option, e.g.
    ``"layers 0-19: nothing; 20-31: dots"``) that also holds ``parts``: ``((count,
    option), ...)`` in layer order. :meth:`remat.planner.Plan.apply` runs the scan as
    one scan per part, over that part's slice of the stacked operands.

    Example:
      >>> s = Segments.of(((2, "nothing"), (4, "dots")))
      >>> str(s), s.length
      ('layers 0-1: nothing; 2-5: dots', 6)
    """

    parts: tuple[tuple[int, Any], ...]

    @classmethod
    def of(cls, parts: tuple[tuple[int, Any], ...]) -> Segments:
        """The split of ``parts`` (each count at least 1)."""
        if len(parts) < 2 or any(n < 1 for n, _ in parts):
            raise ValueError(f"a split needs two or more parts of at least one layer each, got {parts!r}")
        spelled, start = [], 0
        for n, option in parts:
            spelled.append(f"{start}-{start + n - 1}: {policy_name(option)}")
            start += n
        made = super().__new__(cls, PREFIX + "; ".join(spelled))
        made.parts = tuple(parts)
        return made

    @classmethod
    def parse(cls, name: str, option: Callable[[str], Any]) -> Segments:
        """The split a saved name spells, each part's option read by ``option``
        (a one-line ValueError where the name is not a split of consecutive layers from 0)."""
        parts, start = [], 0
        for piece in name[len(PREFIX):].split("; "):
            found = _PART.match(piece)
            if found is None or int(found.group(1)) != start or int(found.group(2)) < start:
                raise ValueError(f"the saved plan's option {name!r} is not a split of consecutive layers from 0")
            count = int(found.group(2)) - start + 1
            parts.append((count, option(found.group(3))))
            start += count
        return cls.of(tuple(parts))

    @property
    def length(self) -> int:
        """The layers (trips) of the whole stack."""
        return sum(n for n, _ in self.parts)


# --------------------------------------------------------------------------------------
# Which regions can be split
# --------------------------------------------------------------------------------------


def _regions_in(jaxpr: Any) -> int:
    """The checkpoint equations in ``jaxpr`` (not inside one another), as the planner counts them."""
    remat_p = xb.checkpoint_primitive()
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive is remat_p:
            count += 1
        else:
            count += sum(_regions_in(getattr(sub, "jaxpr", sub)) for sub in xb.eqn_subjaxprs(eqn))
    return count


def _stack_length(eqn: Any) -> int | str:
    """The length of the scan ``eqn`` whose body holds one region, if it can be split;
    else why not."""
    body = eqn.params["jaxpr"].jaxpr
    if eqn.params.get("reverse", False):
        return "its scan runs in reverse"
    if _regions_in(body) > 1:
        return "its scan body holds other regions too (a split would give them all one split)"
    if not any(e.primitive is xb.checkpoint_primitive() for e in body.eqns):
        return "it sits in a loop inside the scan's body"
    if eqn.params["length"] < 2:
        return "its scan has one layer"
    return int(eqn.params["length"])


def _placed(jaxpr: Any) -> Iterator[tuple[int, int | str]]:
    """Per region, in trace order: the index of the equation of ``jaxpr`` that holds it,
    and its stack's length where a split applies (a scan of the step's own, holding it
    alone in its body), else why not (None where it is in no scan)."""
    for index, eqn in enumerate(jaxpr.eqns):
        count = 1 if eqn.primitive is xb.checkpoint_primitive() else sum(
            _regions_in(getattr(sub, "jaxpr", sub)) for sub in xb.eqn_subjaxprs(eqn))
        if eqn.primitive.name == "scan" and count:
            where: int | str = _stack_length(eqn)
        elif count and _has_scan(eqn):
            where = f"its scan is inside a {eqn.primitive.name} of the step"
        else:
            where = ""
        for _ in range(count):
            yield index, where


def _has_scan(eqn: Any) -> bool:
    for sub in xb.eqn_subjaxprs(eqn):
        sub = getattr(sub, "jaxpr", sub)
        if any(e.primitive.name == "scan" or _has_scan(e) for e in sub.eqns):
            return True
    return False


def stack_lengths(closed: Any) -> list[int | str]:
    """Per region of a traced step (its closed jaxpr, as :func:`remat.planner.steering.survey`
    makes it): the length of the stack a split may cut it into (an int), or why it cannot
    be split (a string; empty: the region is in no scan)."""
    return [where for _, where in _placed(closed.jaxpr)]


def scanned_bytes(closed: Any) -> list[int]:
    """Per region of a traced step, the bytes of the operands its scan slices per layer
    (the stacked weights, say; 0 where the region is in no scan of the step's own): what
    a split copies into its segments' slices, and whose gradients it concatenates."""
    out = []
    for index, where in _placed(closed.jaxpr):
        eqn = closed.jaxpr.eqns[index]
        scanned = eqn.invars[eqn.params["num_consts"] + eqn.params["num_carry"]:] if isinstance(where, int) else []
        out.append(sum(aval_nbytes(v.aval) for v in scanned))
    return out


def split_note(lengths: list[int | str]) -> str | None:
    """Why a scanned region is not offered segment splits, in one line (the first such
    region; None where every scanned region is)."""
    for i, where in enumerate(lengths):
        if isinstance(where, str) and where:
            return f"segment splits not considered for region {i}: {where}"
    return None


# --------------------------------------------------------------------------------------
# Running a split
# --------------------------------------------------------------------------------------


def split_step(traced_for: Callable[[dict[int, Any]], Callable[..., Any]], splits: dict[int, Segments],
               mismatch: type[Exception] = ValueError) -> Callable[..., Any]:
    """The step whose scanned regions ``splits`` (region index -> :class:`Segments`) run
    as consecutive scans, one per part.

    The step is traced once with each split region at its first checkpointed part's
    option (``traced_for(options)``: the step with region ``i`` at ``options[i]``; a
    region not checkpointed is no equation to find), and once more for each part with
    another option, for that part's scan; then the first trace is evaluated
    with each split region's scan replaced by consecutive scans of its parts' traces,
    over consecutive slices of the scanned operands (one ``lax.split``, whose backward
    concatenates), the carry passed on and the per-layer outputs concatenated.

    Args:
      traced_for: the step with the given options for the split regions.
      splits: the split regions.
      mismatch: the exception a step whose stack is not the plan's length raises.
    """
    first = {i: next((o for _, o in s.parts if not is_no_checkpoint(o)), s.parts[0][1]) for i, s in splits.items()}

    def run(*args: Any, **kwargs: Any) -> Any:
        flat, tree = jax.tree_util.tree_flatten((args, kwargs))

        def trace(options: dict[int, Any]) -> tuple[Any, Any]:
            fn = traced_for(options)

            def flat_fn(*leaves: Any) -> Any:
                a, k = jax.tree_util.tree_unflatten(tree, leaves)
                return fn(*a, **k)

            return jax.make_jaxpr(flat_fn, return_shape=True)(*flat)

        base, shape = trace(first)
        placed = list(_placed(base.jaxpr))
        replaced = {}
        for i, seg in splits.items():
            index, where = placed[i] if i < len(placed) else (None, "the step has fewer regions")
            if where != seg.length:
                found = f"a stack of {where} layers" if isinstance(where, int) else f"not splittable ({where})"
                raise mismatch(f"the plan does not match this step: it splits region {i} into {seg} "
                               f"({seg.length} layers), and that region here is {found}")
            scans = [base.jaxpr.eqns[index] if option == first[i] else trace({**first, i: option})[0].jaxpr.eqns[index]
                     for _, option in seg.parts]
            replaced[index] = (scans, [n for n, _ in seg.parts])
        out = _evaluate(base, flat, replaced)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), out)

    return run


def _evaluate(closed: Any, flat: list[Any], replaced: dict[int, tuple[list[Any], list[int]]]) -> list[Any]:
    """``closed`` evaluated on ``flat``, its equations bound again one by one, those in
    ``replaced`` (by index) run as split scans (:func:`_split_scan`)."""
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, flat))

    def read(v: Any) -> Any:
        return v.val if xb.is_literal(v) else env[v]

    for index, eqn in enumerate(jaxpr.eqns):
        values = [read(v) for v in eqn.invars]
        with eqn.ctx.manager:  # as jax.core.eval_jaxpr binds it
            if index in replaced:
                outs = _split_scan(*replaced[index], values)
            else:
                outs = xb.bind_equation(eqn.primitive, values, eqn.params)
                outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _split_scan(scans: list[Any], counts: list[int], values: list[Any]) -> list[Any]:
    """One scan run as consecutive scans: ``scans[j]`` (a scan equation, its body with
    part ``j``'s option) over the next ``counts[j]`` slices of the scanned operands."""
    params = scans[0].params
    consts, carries = params["num_consts"], params["num_carry"]
    for s in scans[1:]:  # the same scan traced with another option for its region
        if (s.params["num_consts"], s.params["num_carry"], len(s.invars)) != (consts, carries, len(values)):
            raise ValueError("the scan to split traced differently for another option of its region")
    const_values, carry = values[:consts], values[consts:consts + carries]
    pieces = [lax.split(x, counts, axis=0) for x in values[consts + carries:]]
    ys = []
    for j, (scan, count) in enumerate(zip(scans, counts)):
        outs = xb.bind_equation(scan.primitive, [*const_values, *carry, *(p[j] for p in pieces)],
                                  {**scan.params, "length": count})
        carry, y = list(outs[:carries]), outs[carries:]
        ys.append(y)
    stacked = [lax.concatenate(list(parts), 0) for parts in zip(*ys)]
    return [*carry, *stacked]

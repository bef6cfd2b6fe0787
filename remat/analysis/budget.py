"""Activation memory budget: keep the values that are dearest to recompute, within a limit.

``remat.residual_budget(0.5)`` is a policy like any other (``policy=`` of
:func:`remat.checkpoint`, :func:`remat.checkpoint_sequential`): for each checkpointed
region it keeps at most half of what the backward pass would keep from inside the
region without checkpointing (the region's own inputs are always kept and not counted),
and within that limit it keeps the values that are most expensive to recompute.
``residual_budget(0)`` behaves like ``"nothing"`` and ``residual_budget(1)`` like ``"everything"``.

How a region's choice is made (once per region structure and input shapes; regions of
identical structure, such as the blocks of a transformer, share it):

1. **Candidates.** The region is traced once with a recording policy that keeps
   everything; every operation the policy is asked about is a candidate. Operations
   that look alike to a policy (same primitive, input shapes and parameters) form one
   candidate, since a JAX policy decides per operation, not per value.
2. **Costs.** Each candidate's bytes are its output bytes; its recompute cost is
   estimated from FLOPs for ``dot_general``/convolutions and from bytes moved for all
   other (element-wise, reduction, data-movement) work, at the rates
   :func:`remat.analysis.machine.calibrate` measured in this process, if it ran.
3. **Knapsack.** Maximise the recompute cost saved subject to the byte limit: exactly
   (a Pareto-frontier dynamic programme) up to ``exact_limit`` candidates, greedily by
   cost per byte beyond.
4. **Check.** The choice is applied and the kept bytes are measured with
   :func:`remat.analysis.saved_residuals`; candidates are dropped (cheapest per byte
   first) until the measured bytes fit, then left-over room is filled greedily.

References:
  PyTorch's ``torch._functorch.config.activation_memory_budget`` (a 0–1 fraction,
  solved as a knapsack over the values the backward pass could keep).
  Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from remat._core.hooks import RegionChooser
from remat._core.residuals import aval_nbytes, format_bytes, saved_residuals
from remat.analysis.machine import Rates, current_rates, op_cost

__all__ = ["KeepChosen", "KeepableOp", "ResidualBudget", "ResidualBudgetChoice", "knapsack", "residual_budget"]


@dataclasses.dataclass(frozen=True)
class KeepableOp:
    """One kind of operation the policy may keep (all alike operations of a region)."""

    key: tuple
    primitive: str
    count: int
    nbytes: int  # output bytes of all `count` operations
    cost_s: float  # estimated seconds to recompute all `count` operations

    def to_dict(self) -> dict[str, Any]:
        return {"primitive": self.primitive, "count": self.count, "bytes": self.nbytes,
                "recompute_cost_s": self.cost_s}


@dataclasses.dataclass(frozen=True)
class ResidualBudgetChoice:
    """What a budget kept for one region, and why."""

    limit_bytes: int
    baseline_bytes: int  # kept from inside the region without checkpointing
    kept_bytes: int  # measured, with the choice applied
    kept: tuple[KeepableOp, ...]
    dropped: tuple[KeepableOp, ...]
    method: str  # "exact", "greedy", "nothing" or "everything"
    policy: Callable[..., Any] | None = dataclasses.field(repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "limit_bytes": self.limit_bytes, "baseline_bytes": self.baseline_bytes,
            "kept_bytes": self.kept_bytes, "method": self.method,
            "kept": [c.to_dict() for c in self.kept], "dropped": [c.to_dict() for c in self.dropped],
        }

    def __str__(self) -> str:

        lines = [
            f"budget: keep at most {format_bytes(self.limit_bytes)} of "
            f"{format_bytes(self.baseline_bytes)} (measured {format_bytes(self.kept_bytes)}, {self.method})",
            f"  {'':4} {'operation':<24} {'count':>5} {'bytes':>10} {'recompute':>10}",
        ]
        for mark, group in (("keep", self.kept), ("drop", self.dropped)):
            for c in sorted(group, key=lambda c: -c.cost_s):
                lines.append(f"  {mark:4} {c.primitive:<24} {c.count:>5} {format_bytes(c.nbytes):>10} "
                             f"{c.cost_s * 1e6:>8.1f}us")
        return "\n".join(lines)


class ResidualBudget(RegionChooser):
    """``policy=residual_budget(fraction)`` or ``policy=residual_budget(bytes=N)``; see :func:`residual_budget`."""

    def __init__(self, fraction: float | None = None, *, bytes: int | None = None, exact_limit: int = 24,
                 rates: Rates | None = None):
        if (fraction is None) == (bytes is None):
            raise ValueError("residual_budget() takes a fraction in [0, 1] or bytes=N, exactly one of them")
        if fraction is not None:
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or math.isnan(fraction) \
                    or not 0.0 <= fraction <= 1.0:
                raise ValueError(f"residual_budget fraction must be a number in [0, 1], got {fraction!r}")
            fraction = float(fraction)
        if bytes is not None and (isinstance(bytes, bool) or not isinstance(bytes, int) or bytes < 0):
            raise ValueError(f"residual_budget(bytes=...) must be a non-negative int, got {bytes!r}")
        self.fraction = fraction
        self.bytes = bytes
        self.exact_limit = exact_limit
        self.rates = rates
        self.last_choice: ResidualBudgetChoice | None = None
        self._cache: dict[tuple, ResidualBudgetChoice] = {}
        self.__name__ = f"residual_budget({fraction})" if fraction is not None else f"residual_budget(bytes={bytes})"

    def __repr__(self) -> str:
        return self.__name__

    def __eq__(self, other: object) -> bool:  # a value: equal budgets share traces
        return isinstance(other, ResidualBudget) and self._limits() == other._limits()

    def __hash__(self) -> int:
        return hash(self._limits())

    def _limits(self) -> tuple:
        return self.fraction, self.bytes, self.exact_limit, self.rates

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> bool:
        raise TypeError(
            f"{self.__name__} chooses per region and needs the region's inputs: use it as "
            "policy= of remat.checkpoint or remat.checkpoint_sequential, not of jax.checkpoint"
        )

    def choose_policy(self, remat_with: Callable[[Any], Callable[..., Any]], inputs: Sequence[Any]) -> Any:
        """The JAX policy for one region (:class:`remat._core.hooks.RegionChooser`)."""
        return self.choose(remat_with, inputs).policy

    def choose(self, remat_with: Callable[[Any], Callable[..., Any]], inputs: Sequence[Any]) -> ResidualBudgetChoice:
        """Picks what to keep for one region.

        Args:
          remat_with: ``policy -> checkpointed region``; the region takes ``inputs``.
          inputs: the region's traced inputs.

        Returns:
          A :class:`ResidualBudgetChoice` whose ``policy`` is a plain JAX policy.
        """
        calls: list[tuple[tuple, Any, tuple, dict]] = []

        def recorder(prim, *avals, **params):
            calls.append((_op_key(prim, avals, params), prim, avals, params))
            return True

        everything = saved_residuals(remat_with(recorder), *inputs).residual_bytes
        if self.fraction is not None:
            limit = everything if self.fraction >= 1.0 else int(self.fraction * everything)
        else:
            assert self.bytes is not None  # __post_init__ admits exactly one of the two
            limit = self.bytes
        # without rates of its own, a calibration since the last choice re-prices the candidates
        rates = self.rates if self.rates is not None else current_rates()
        cache_key = (tuple(c[0] for c in calls), _shapes(inputs), limit, rates)
        if cache_key in self._cache:
            self.last_choice = self._cache[cache_key]
            return self.last_choice
        candidates = _candidates(calls, rates)
        if limit >= everything:
            choice = ResidualBudgetChoice(limit, everything, everything, tuple(candidates), (), "everything",
                                          _everything)
        else:
            choice = self._solve(remat_with, inputs, candidates, limit, everything, saved_residuals)
        self._cache[cache_key] = choice
        self.last_choice = choice
        return choice

    def _solve(self, remat_with, inputs, candidates, limit, everything, saved_residuals) -> ResidualBudgetChoice:
        def measure(chosen: list[KeepableOp]) -> int:
            if not chosen:
                return saved_residuals(remat_with(None), *inputs).residual_bytes
            return saved_residuals(remat_with(_policy_for(chosen)), *inputs).residual_bytes

        nothing = measure([])
        room = max(limit - nothing, 0)  # e.g. values kept by nested checkpoints
        weights = [c.nbytes for c in candidates]
        values = [c.cost_s for c in candidates]
        picked, method = knapsack(weights, values, room, exact_limit=self.exact_limit)
        chosen = [candidates[i] for i in picked]
        kept = measure(chosen)
        while chosen and kept > limit:  # shared values make bytes less than additive: check
            chosen.remove(min(chosen, key=lambda c: c.cost_s / max(c.nbytes, 1)))
            kept = measure(chosen)
        for c in sorted(set(candidates) - set(chosen), key=lambda c: -c.cost_s / max(c.nbytes, 1))[:8]:
            if kept < limit:
                trial = measure(chosen + [c])
                if trial <= limit:
                    chosen.append(c)
                    kept = trial
        method = method if chosen else "nothing"
        dropped = tuple(c for c in candidates if c not in chosen)
        return ResidualBudgetChoice(limit, everything, kept, tuple(chosen), dropped, method,
                            _policy_for(chosen) if chosen else None)


def residual_budget(fraction: float | None = None, *, bytes: int | None = None,
                    rates: Rates | None = None) -> ResidualBudget:
    """A policy that keeps the dearest-to-recompute values within a memory limit.

    Args:
      fraction: the most the backward pass may keep from inside each checkpointed region,
        as a fraction of what it keeps there without checkpointing; 0 behaves like
        ``"nothing"``, 1 like ``"everything"``.
      bytes: the same limit as an absolute number of bytes per region.
      rates: the machine rates that price recomputation (:class:`remat.analysis.machine.Rates`);
        default: this process's calibrated rates if the planner measured them, else
        :data:`~remat.analysis.machine.UNCALIBRATED`.

    Returns:
      A :class:`ResidualBudget`, usable as ``policy=``; after a call its ``last_choice``
      (a :class:`ResidualBudgetChoice`) says what was kept and dropped, with bytes and costs.

    Raises:
      ValueError: a fraction outside [0, 1] or NaN, a negative byte count, or both/neither.

    Example:
      >>> import jax, jax.numpy as jnp, remat
      >>> p = remat.residual_budget(0.5)
      >>> f = lambda w, x: jnp.tanh(jnp.tanh(x @ w) @ w).sum()
      >>> g = jax.grad(lambda w: remat.checkpoint(f, w, jnp.ones((4, 8)), policy=p))(jnp.eye(8))
    """
    return ResidualBudget(fraction, bytes=bytes, rates=rates)


def knapsack(weights: Sequence[int], values: Sequence[float], capacity: int, *,
             exact_limit: int = 24) -> tuple[list[int], str]:
    """0/1 knapsack: indices maximising ``sum(values)`` with ``sum(weights) <= capacity``.

    Exact (a dynamic programme over the Pareto frontier of (weight, value) pairs) for up
    to ``exact_limit`` items while the frontier stays small; greedy by value per weight
    beyond.

    Returns:
      ``(indices, method)`` with ``method`` ``"exact"`` or ``"greedy"``.
    """
    n = len(weights)
    if n <= exact_limit:
        frontier: list[tuple[int, float, tuple[int, ...]]] = [(0, 0.0, ())]
        for i, (w, v) in enumerate(zip(weights, values)):
            grown = [(fw + w, fv + v, items + (i,)) for fw, fv, items in frontier if fw + w <= capacity]
            merged = sorted(frontier + grown, key=lambda t: (t[0], -t[1]))
            frontier = []
            for t in merged:  # keep only pairs that beat every lighter one
                if not frontier or t[1] > frontier[-1][1]:
                    frontier.append(t)
            if len(frontier) > 200_000:
                break
        else:
            best = max(frontier, key=lambda t: t[1])
            return sorted(best[2]), "exact"
    order = sorted(range(n), key=lambda i: -values[i] / max(weights[i], 1))
    picked, total = [], 0
    for i in order:
        if total + weights[i] <= capacity:
            picked.append(i)
            total += weights[i]
    return sorted(picked), "greedy"


# --- helpers ---------------------------------------------------------------------------

def _everything(prim: Any, *avals: Any, **params: Any) -> bool:
    return True


def _shapes(inputs: Sequence[Any]) -> tuple:
    import jax

    return tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__)))
                 for x in jax.tree.leaves(inputs))


def _param_sig(value: Any) -> Any:
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_param_sig(v) for v in value)
    text = type(value).__name__
    return text if "jaxpr" in text.lower() else repr(value)[:200]


def _op_key(prim: Any, avals: Sequence[Any], params: dict) -> tuple:
    shapes = tuple((tuple(getattr(a, "shape", ())), str(getattr(a, "dtype", ""))) for a in avals)
    return (prim.name, shapes, tuple(sorted((k, _param_sig(v)) for k, v in params.items())))


def _out_bytes(prim: Any, avals: Sequence[Any], params: dict) -> int:
    try:
        out = prim.abstract_eval(*avals, **params)
        out = out[0] if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], (set, frozenset)) else out
        outs = out if prim.multiple_results else [out]
        return sum(aval_nbytes(o) for o in outs)
    except Exception:  # an unusual primitive: its largest input is a fair stand-in
        return max((aval_nbytes(a) for a in avals), default=0)


def _candidates(calls: list[tuple[tuple, Any, tuple, dict]], rates: Rates) -> list[KeepableOp]:
    groups: dict[tuple, list] = {}
    for key, prim, avals, params in calls:
        groups.setdefault(key, [prim, avals, params, 0])[3] += 1
    out = []
    for key, (prim, avals, params, count) in groups.items():
        each = _out_bytes(prim, avals, params)
        cost = op_cost(prim.name, avals, params, each, rates)
        out.append(KeepableOp(key, prim.name, count, each * count, cost * count))
    return out


@dataclasses.dataclass(frozen=True)
class KeepChosen:
    """The JAX policy of one region's choice: keep the operations whose key is in ``keys``."""

    keys: frozenset

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> bool:
        return _op_key(prim, avals, params) in self.keys

    def __repr__(self) -> str:
        return f"residual_budget choice ({len(self.keys)} kinds of operation kept)"


def _policy_for(chosen: Sequence[KeepableOp]) -> KeepChosen:
    return KeepChosen(frozenset(c.key for c in chosen))

"""Policies built from other policies."""
from __future__ import annotations

import dataclasses
from typing import Any

from jax.ad_checkpoint import Recompute

from remat.policies._resolve import Policy, PolicySpec, policy_name, resolve_policy


@dataclasses.dataclass(frozen=True)
class AnyOf:
    """Keeps a value when any of ``policies`` keeps it; see :func:`any_of`."""

    policies: tuple[Policy, ...]

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> Any:
        for policy in self.policies:
            decision = policy(prim, *avals, **params)
            if _keeps(decision):
                return decision
        return False

    def __repr__(self) -> str:
        return "any_of(" + ", ".join(policy_name(p) for p in self.policies) + ")"


def any_of(*policies: PolicySpec) -> AnyOf:
    """Keeps a value when any of ``policies`` keeps it (the first decision that keeps wins).

    Example:
      >>> any_of("dots_no_batch", ["attn_out"])
      any_of(dots_no_batch, save_names('attn_out'))
    """
    resolved = (resolve_policy(p) for p in policies)
    return AnyOf(tuple(p for p in resolved if p is not None))


def _keeps(decision: Any) -> bool:
    """True when a policy's decision is "save" or "offload" rather than "recompute"."""
    if isinstance(decision, bool):
        return decision
    return decision is not None and decision is not Recompute

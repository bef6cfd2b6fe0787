"""Every spelling of a policy (``None``, a name, a list of names, a callable) turned into a JAX policy."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Union

from jax import checkpoint_policies as _jcp

from remat import _names
from remat.policies._by_name import OffloadNames, offload_names, save_names

Policy = Callable[..., Any]
PolicySpec = Union[None, str, Sequence[str], Policy]

NAMED_POLICIES: dict[str, Policy | None] = dict(zip(_names.NAMED_POLICY_NAMES, (
    None,  # "nothing", jax.checkpoint's default: save only the inputs of the region
    _jcp.everything_saveable,
    _jcp.dots_saveable,
    _jcp.dots_with_no_batch_dims_saveable,
)))


# JAX's class of save_only_these_names policies; before JAX 0.10.2 that policy is a closure.
_SAVE_NAMES = type(_jcp.save_only_these_names())
_SAVE_NAMES = _SAVE_NAMES if dataclasses.is_dataclass(_SAVE_NAMES) else None


def resolve_policy(policy: PolicySpec) -> Policy | None:
    """Turns any accepted spelling of a policy into a JAX policy (``None`` = save nothing).

    Args:
      policy: ``None``, a name from :data:`NAMED_POLICIES`, a sequence of checkpoint names,
        or a callable JAX policy.

    Returns:
      A callable for ``jax.checkpoint(policy=...)``, or ``None`` for "save only inputs".

    Raises:
      ValueError: for an unknown policy name.
      TypeError: for anything else that is not a policy.

    Example:
      >>> policy_name(resolve_policy(["attn_out"]))
      "save_names('attn_out')"
    """
    if policy is None:
        return None
    if _names.is_no_checkpoint(policy):
        raise ValueError(f"policy={policy!r} means no checkpoint at all, which is not a JAX policy; "
                         "check remat.policies.is_no_checkpoint(policy) before resolving")
    if isinstance(policy, str):
        try:
            return NAMED_POLICIES[policy]
        except KeyError:
            raise ValueError(_unknown_name(policy)) from None
    if callable(policy):
        return policy
    if isinstance(policy, Iterable):
        names = list(policy)
        if not names or not all(isinstance(n, str) for n in names):
            raise TypeError(
                f"policy={policy!r}: a sequence policy must be a non-empty list of checkpoint "
                "names (strings) given to remat.checkpoint_name"
            )
        return save_names(*names)
    raise TypeError(
        f"policy must be None, a policy name, a list of checkpoint names or a callable, "
        f"got {type(policy).__name__}"
    )


def _unknown_name(name: str) -> str:
    valid = ", ".join(repr(n) for n in _names.POLICY_NAMES)
    if name.lower() == "none":
        return (f"policy={name!r} is not a policy name: for no checkpoint at all use "
                f"{_names.NO_CHECKPOINT!r}; policy=None (the Python value) keeps nothing but the inputs")
    return f"unknown policy {name!r}; use one of {valid}, a list of checkpoint names, or a callable from remat.policies"


def policy_name(policy: PolicySpec) -> str:
    """A short human-readable name for a policy spelling (used in reports).

    Example:
      >>> policy_name(None), policy_name(["a", "b"]), policy_name(offload_names("a"))
      ('nothing', 'names:a,b', 'offload:a')
    """
    if policy is None or isinstance(policy, str):
        return policy or "nothing"
    # the planner's offload option: names offloaded, none saved, device to pinned_host
    if isinstance(policy, OffloadNames) and policy.names and policy == offload_names(*policy.names):
        return "offload:" + ",".join(sorted(policy.names))
    for name, named in NAMED_POLICIES.items():
        if named is not None and policy is named:
            return name
    if _SAVE_NAMES is not None and isinstance(policy, _SAVE_NAMES):  # JAX's class, whose repr is its dataclass fields
        jax_policy: Any = policy  # its class is found at import time, so no checker knows its fields
        return "save_names(" + ", ".join(repr(n) for n in sorted(jax_policy.saveable_names)) + ")"
    if callable(policy):
        return getattr(policy, "__name__", None) or str(policy)
    return "names:" + ",".join(policy)

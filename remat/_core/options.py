"""The options of a checkpointed region: ``remat.checkpoint``'s keywords, checked once, in their JAX meaning.

:class:`CheckpointKeywords` is the one list of the keywords (names, types, defaults) that
``checkpoint``, ``checkpoint_sequential`` and ``apply_checkpointing`` accept;
:func:`normalize_options` checks them and maps them to :class:`CheckpointOptions`, which the
rest of the core takes as given.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from remat.policies import PolicySpec, is_no_checkpoint, policy_name, resolve_policy

__all__ = ["KEYWORDS", "CheckpointKeywords", "CheckpointOptions", "normalize_options"]

_DETERMINISM_CHECKS = ("default", "none")


@dataclass(frozen=True)
class CheckpointKeywords:
    """``remat.checkpoint``'s keywords as a caller spells them, with their defaults.

    PyTorch's five (``use_reentrant`` ... ``context_fn``), then JAX's ``policy``,
    ``static_argnums`` and ``prevent_cse``. See :func:`remat.checkpoint` for their meaning.
    """

    use_reentrant: bool | None = None
    preserve_rng_state: bool = True
    determinism_check: str = "default"
    debug: bool = False
    early_stop: bool = True
    context_fn: Any = None
    policy: PolicySpec = None
    static_argnums: int | tuple[int, ...] = ()
    prevent_cse: bool | Sequence[Any] = True


# The keyword names, in the order of their definition.
KEYWORDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(CheckpointKeywords))


@dataclass(frozen=True)
class CheckpointOptions:
    """Validated options of one checkpointed region, in their JAX meaning."""

    policy: Callable[..., Any] | None
    policy_label: str
    static_argnums: tuple[int, ...]
    prevent_cse: bool | tuple[Any, ...]
    debug: bool
    trace_scalars: bool = False  # the decorator form traces Python numbers, as jax.checkpoint does
    enabled: bool = True  # False: policy=NO_CHECKPOINT, the region runs as a plain call


def normalize_options(**keywords: Any) -> CheckpointOptions:
    """Checks the keyword arguments of :func:`remat.checkpoint` and maps them to JAX.

    Args:
      **keywords: any of :data:`KEYWORDS`; the others take their defaults.

    Returns:
      The options in their JAX meaning.

    Raises ``TypeError`` or ``ValueError`` with a one-line message naming the fix.

    Example:
      >>> normalize_options(policy="dots", static_argnums=1).static_argnums
      (1,)
    """
    unknown = sorted(set(keywords) - set(KEYWORDS))
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}; remat.checkpoint's keywords are "
                        f"{', '.join(KEYWORDS)}")
    given = CheckpointKeywords(**keywords)
    use_reentrant, debug, policy = given.use_reentrant, given.debug, given.policy
    static_argnums, prevent_cse = given.static_argnums, given.prevent_cse
    if given.context_fn is not None:
        raise TypeError(
            "context_fn has no meaning in JAX (there are no autograd contexts); choose what "
            "to save with policy= instead, e.g. policy=remat.policies.selective([...])"
        )
    for name, value in (("preserve_rng_state", given.preserve_rng_state), ("debug", debug),
                        ("early_stop", given.early_stop)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if isinstance(prevent_cse, (list, tuple)):
        prevent_cse = tuple(prevent_cse)
        if not all(isinstance(f, bool) for f in jax.tree.leaves(prevent_cse)):
            raise TypeError(f"prevent_cse must be a bool or a tuple (pytree prefix) of bools, got {prevent_cse!r}")
    elif not isinstance(prevent_cse, bool):
        raise TypeError(f"prevent_cse must be a bool or a tuple (pytree prefix) of bools, got {prevent_cse!r}")
    if use_reentrant is not None and not isinstance(use_reentrant, bool):
        raise TypeError(f"use_reentrant must be True, False or None, got {use_reentrant!r}")
    if given.determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(
            f"determinism_check={given.determinism_check!r} is not supported; use one of "
            f"{', '.join(map(repr, _DETERMINISM_CHECKS))}"
        )
    if isinstance(static_argnums, int):
        static_argnums = (static_argnums,)
    if not all(isinstance(i, int) and i >= 0 for i in static_argnums):
        raise ValueError(f"static_argnums must be non-negative ints, got {static_argnums!r}")
    enabled = not is_no_checkpoint(policy)
    resolved = resolve_policy(policy) if enabled else None
    if use_reentrant and (resolved is not None or debug):
        # The same rule as PyTorch's: context_fn (our policy=) and debug need the
        # non-reentrant variant, so code that runs here also runs there.
        raise ValueError(
            "policy= and debug=True need use_reentrant=False, as context_fn and debug do in "
            "torch.utils.checkpoint; drop use_reentrant=True"
        )
    return CheckpointOptions(
        policy=resolved,
        policy_label=policy_name(policy),
        static_argnums=tuple(sorted(set(static_argnums))),
        prevent_cse=prevent_cse,
        debug=debug,
        enabled=enabled,
    )

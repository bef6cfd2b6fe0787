"""Rematerialization policies: what the backward pass may keep instead of recomputing.

A JAX policy is a tiny predicate ``policy(primitive, *avals, **params) -> bool | Saveable |
Offloadable | Recompute`` consulted for every operation inside a checkpointed region
(see ``jax/_src/ad_checkpoint.py``). This module gives those predicates names a PyTorch
user can read, and small constructors that compose.

Every ``policy=`` argument in ``remat`` accepts:

* ``None`` or ``"nothing"``: keep only the region's inputs, recompute everything else
  (what ``torch.utils.checkpoint.checkpoint`` does);
* ``"everything"``: keep every intermediate (no recomputation: checkpointing switched off);
* ``"dots"``: keep the results of matrix multiplies and convolutions, recompute the
  cheap element-wise work in between;
* ``"dots_no_batch"``: as ``"dots"``, but only for matmuls without batch dimensions
  (weights-times-activations, not attention's batched ``q @ k``);
* a sequence of names, e.g. ``["attn_out"]``: keep only the values tagged with
  :func:`remat.checkpoint_name`;
* any callable JAX policy, including the constructors below.

Example:
  >>> import jax, jax.numpy as jnp, remat
  >>> def block(w, x):
  ...     h = remat.checkpoint_name(jnp.tanh(x @ w), "hidden")
  ...     return jnp.sin(h @ w)
  >>> f = remat.checkpoint(block, policy=remat.policies.save_names("hidden"))
  >>> g = jax.grad(lambda w, x: f(w, x).sum())(jnp.eye(3), jnp.ones((2, 3)))

References:
  Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016.
  https://docs.jax.dev/en/latest/gradient-checkpointing.html
  https://pytorch.org/docs/stable/checkpoint.html (selective activation checkpoint)
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Union

from jax import checkpoint_policies as _jcp
from jax.ad_checkpoint import Recompute

from remat import _jax, _names

Policy = Callable[..., Any]
PolicySpec = Union[None, str, Sequence[str], Policy]

NAMED_POLICIES: dict[str, Policy | None] = dict(zip(_names.NAMED_POLICY_NAMES, (
    None,  # "nothing", jax.checkpoint's default: save only the inputs of the region
    _jcp.everything_saveable,
    _jcp.dots_saveable,
    _jcp.dots_with_no_batch_dims_saveable,
)))


NO_CHECKPOINT = _names.NO_CHECKPOINT
POLICY_NAMES = _names.POLICY_NAMES
is_no_checkpoint = _names.is_no_checkpoint


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
    """
    if policy is None:
        return None
    if is_no_checkpoint(policy):
        raise ValueError(f"policy={policy!r} means no checkpoint at all, which is not a JAX policy; "
                         "check remat.policies.is_no_checkpoint(policy) before resolving")
    if isinstance(policy, str):
        try:
            return NAMED_POLICIES[policy]
        except KeyError:
            valid = ", ".join(repr(n) for n in POLICY_NAMES)
            raise ValueError(
                f"unknown policy {policy!r}; use one of {valid}, a list of checkpoint names, "
                "or a callable from remat.policies"
            ) from None
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


def policy_name(policy: PolicySpec) -> str:
    """A short human-readable name for a policy spelling (used in reports)."""
    if policy is None or isinstance(policy, str):
        return policy or "nothing"
    if callable(policy):
        return getattr(policy, "__name__", type(policy).__name__)
    return "names:" + ",".join(policy)


def _names(names: tuple[str, ...], what: str) -> list[str]:
    if len(names) == 1 and not isinstance(names[0], str) and isinstance(names[0], Iterable):
        names = tuple(names[0])  # also accept save_names(["a", "b"])
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"{what}() takes checkpoint names (strings), got {names!r}")
    return list(names)


def save_names(*names: str) -> Policy:
    """Keeps only values tagged with one of ``names`` via :func:`remat.checkpoint_name`.

    Example:
      >>> p = save_names("attn_out", "mlp_in")
    """
    return _jcp.save_only_these_names(*_names(names, "save_names"))


def save_all_but(*names: str) -> Policy:
    """Keeps every intermediate except the values tagged with one of ``names``.

    The tagged values themselves are not kept; note that :func:`remat.checkpoint_name` is
    an identity, so the output of the operation that produced a tagged value is still
    kept (every untagged value is) and the tagged value is recomputed from it. To really
    drop a large tensor, use :func:`save_names` for what should stay instead.

    (``jax.checkpoint_policies.save_anything_except_these_names`` is not used: by
    JAX 0.10 at the latest it ignores its names and saves everything.)
    """
    excluded = frozenset(_names(names, "save_all_but"))

    def policy(prim, *_, **params):
        if _jax.is_name_primitive(prim):
            return params["name"] not in excluded
        return True

    policy.__name__ = "save_all_but(" + ",".join(sorted(excluded)) + ")"
    return policy


def offload_names(
    *names: str, src: str = "device", dst: str = "pinned_host", save: Sequence[str] = ()
) -> Policy:
    """Moves the values tagged with ``names`` to host memory instead of keeping them on
    the device, and brings them back for the backward pass.

    Args:
      *names: checkpoint names whose values are offloaded.
      src: memory kind the value lives in (``"device"``).
      dst: memory kind to offload to (``"pinned_host"``).
      save: names that are kept on the device as usual.

    Returns:
      A JAX policy. Offloading needs a backend with host memory spaces (GPU, TPU); on
      XLA:CPU device and host memory are the same, so there is nothing to gain there.
    """
    return _jcp.save_and_offload_only_these_names(
        names_which_can_be_saved=list(save),
        names_which_can_be_offloaded=_names(names, "offload_names"),
        offload_src=src,
        offload_dst=dst,
    )


def any_of(*policies: PolicySpec) -> Policy:
    """Keeps a value when any of ``policies`` keeps it (the first decision that keeps wins).

    Example:
      >>> p = any_of("dots_no_batch", save_names("attn_out"))
    """
    resolved = [resolve_policy(p) for p in policies]
    resolved = [p for p in resolved if p is not None]

    def policy(prim, *avals, **params):
        for p in resolved:
            decision = p(prim, *avals, **params)
            if _keeps(decision):
                return decision
        return False

    policy.__name__ = "any_of(" + ", ".join(policy_name(p) for p in policies) + ")"
    return policy


def _keeps(decision: Any) -> bool:
    """True when a policy's decision is "save" or "offload" rather than "recompute"."""
    if isinstance(decision, bool):
        return decision
    return decision is not None and decision is not Recompute


class CheckpointPolicy(enum.Enum):
    """PyTorch's ``torch.utils.checkpoint.CheckpointPolicy``, for :func:`selective`.

    XLA never overrides a policy, so ``MUST_*`` and ``PREFER_*`` act the same here, as
    they do in PyTorch's eager mode.
    """

    MUST_SAVE = "must_save"
    PREFER_SAVE = "prefer_save"
    MUST_RECOMPUTE = "must_recompute"
    PREFER_RECOMPUTE = "prefer_recompute"


# PyTorch operator names a ported selective-checkpoint policy tends to use, mapped to the
# JAX primitives that implement them.
TORCH_OP_ALIASES: dict[str, tuple[str, ...]] = {
    "mm": ("dot_general",),
    "bmm": ("dot_general",),
    "addmm": ("dot_general",),
    "matmul": ("dot_general",),
    "linear": ("dot_general",),
    "einsum": ("dot_general",),
    "convolution": ("conv_general_dilated",),
    "conv2d": ("conv_general_dilated",),
    "relu": ("max",),
    "gelu": ("erf", "tanh"),
    "tanh": ("tanh",),
    "exp": ("exp",),
    "softmax": ("exp", "reduce_max", "reduce_sum", "div"),
    "sum": ("reduce_sum",),
    "max": ("reduce_max",),
}


def _op_names(op: Any) -> tuple[str, ...]:
    """Primitive names for a JAX primitive, a primitive name, or a PyTorch op (name or object)."""
    if _jax.is_primitive(op):
        return (op.name,)
    # torch.ops.aten.mm / .default carry their operator's name; strings and others are parsed
    name = getattr(op, "_opname", None)
    if name is None and not isinstance(op, str) and not hasattr(op, "__name__"):
        raise TypeError(
            f"selective() takes operations (a PyTorch op such as torch.ops.aten.mm.default or "
            f"'mm', a JAX primitive or its name), got {op!r}"
        )
    if name is None:
        name = op if isinstance(op, str) else getattr(op, "__name__", str(op))
        name = name.removeprefix("torch.ops.").removeprefix("aten::").removeprefix("aten.")
        name = name.split(".")[0]  # "mm.default": an overload of mm
    return TORCH_OP_ALIASES.get(name, (name,))


def selective(
    policy_fn_or_ops: Callable[..., CheckpointPolicy | bool] | Iterable[Any],
) -> Policy:
    """PyTorch's selective activation checkpoint, as a JAX policy.

    The counterpart of ``torch.utils.checkpoint.create_selective_checkpoint_contexts``:

    * a list of operations to save, e.g. ``selective(["mm", "conv2d"])`` or
      ``selective([jax.lax.dot_general_p])``; everything else is recomputed;
    * or a function ``policy_fn(op_name, *avals, **params)`` returning a
      :class:`CheckpointPolicy` (or a bool, True meaning save), called for every
      operation in the region. ``op_name`` is the JAX primitive's name
      (``"dot_general"``, ``"exp"``, ...).

    PyTorch operator names (``mm``, ``bmm``, ``addmm``, ``matmul``, ``linear``,
    ``convolution``, ``softmax``, ...) map to the JAX primitives that implement them
    (:data:`TORCH_OP_ALIASES`); JAX primitive names and objects work as they are.

    Example:
      >>> p = selective(["mm"])            # save matmul outputs, recompute the rest
      >>> def fn(op, *avals, **params):
      ...     return CheckpointPolicy.MUST_SAVE if op == "exp" else CheckpointPolicy.PREFER_RECOMPUTE
      >>> q = selective(fn)
    """
    if callable(policy_fn_or_ops) and not isinstance(policy_fn_or_ops, (list, tuple, set)):
        user_fn = policy_fn_or_ops

        def policy(prim, *avals, **params):
            decision = user_fn(prim.name, *avals, **params)
            if isinstance(decision, CheckpointPolicy):
                return decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)
            if isinstance(decision, bool):
                return decision
            raise TypeError(
                f"selective policy function returned {decision!r} for {prim.name!r}; "
                "return a remat.policies.CheckpointPolicy or a bool"
            )

        policy.__name__ = f"selective({getattr(user_fn, '__name__', 'fn')})"
        return policy

    ops = list(policy_fn_or_ops)
    if not ops:
        raise ValueError("selective() needs at least one operation to save, or a policy function")
    saved = frozenset(n for op in ops for n in _op_names(op))

    def policy(prim, *avals, **params):
        return prim.name in saved

    policy.__name__ = "selective(" + ",".join(sorted(saved)) + ")"
    return policy


__all__ = [
    "CheckpointPolicy",
    "NAMED_POLICIES",
    "NO_CHECKPOINT",
    "POLICY_NAMES",
    "Policy",
    "PolicySpec",
    "TORCH_OP_ALIASES",
    "any_of",
    "is_no_checkpoint",
    "offload_names",
    "policy_name",
    "resolve_policy",
    "save_all_but",
    "save_names",
    "selective",
]



def __getattr__(name: str) -> Any:
    # Deprecated spellings: the residual budget lives in the analysis layer (its cost model
    # and knapsack), which the core does not import; remat.residual_budget is the new name.
    if name in ("budget", "Budget"):
        import importlib
        import warnings

        warnings.warn(f"remat.policies.{name} is deprecated: use remat.residual_budget "
                      f"(remat.analysis.budget.{name})", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module("remat.analysis.budget"), name)
    raise AttributeError(f"module 'remat.policies' has no attribute {name!r}")

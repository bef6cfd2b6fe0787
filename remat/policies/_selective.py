"""PyTorch's selective activation checkpoint (``create_selective_checkpoint_contexts``) as JAX policies."""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable
from typing import Any

from remat import _jax


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


@dataclasses.dataclass(frozen=True)
class SaveOps:
    """Keeps the outputs of the primitives named in ``primitives``; see :func:`selective`."""

    primitives: frozenset[str]

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> bool:
        return prim.name in self.primitives

    def __repr__(self) -> str:
        return "selective(" + ", ".join(repr(n) for n in sorted(self.primitives)) + ")"


@dataclasses.dataclass(frozen=True)
class AskFunction:
    """Asks ``function(op_name, *avals, **params)`` for every operation; see :func:`selective`."""

    function: Callable[..., CheckpointPolicy | bool]

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> bool:
        decision = self.function(prim.name, *avals, **params)
        if isinstance(decision, CheckpointPolicy):
            return decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)
        if isinstance(decision, bool):
            return decision
        raise TypeError(
            f"selective policy function returned {decision!r} for {prim.name!r}; "
            "return a remat.policies.CheckpointPolicy or a bool"
        )

    def __repr__(self) -> str:
        return f"selective({getattr(self.function, '__name__', type(self.function).__name__)})"


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


def selective(policy_fn_or_ops: Callable[..., CheckpointPolicy | bool] | Iterable[Any]) -> SaveOps | AskFunction:
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
      >>> selective(["mm"])            # save matmul outputs, recompute the rest
      selective('dot_general')
      >>> def fn(op, *avals, **params):
      ...     return CheckpointPolicy.MUST_SAVE if op == "exp" else CheckpointPolicy.PREFER_RECOMPUTE
      >>> q = selective(fn)
    """
    if callable(policy_fn_or_ops) and not isinstance(policy_fn_or_ops, (list, tuple, set)):
        return AskFunction(policy_fn_or_ops)
    ops = list(policy_fn_or_ops)
    if not ops:
        raise ValueError("selective() needs at least one operation to save, or a policy function")
    return SaveOps(frozenset(n for op in ops for n in _op_names(op)))

"""Policies that decide by the names given with :func:`remat.checkpoint_name`."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from jax import checkpoint_policies as _jcp
from jax.ad_checkpoint import Offloadable, Recompute, Saveable

from remat import _jax


def _names(names: tuple[Any, ...], what: str) -> frozenset[str]:
    if len(names) == 1 and not isinstance(names[0], str) and isinstance(names[0], Iterable):
        names = tuple(names[0])  # also accept save_names(["a", "b"])
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"{what}() takes checkpoint names (strings), got {names!r}")
    return frozenset(names)


def _listed(names: frozenset[str]) -> str:
    return ", ".join(repr(n) for n in sorted(names))


@dataclasses.dataclass(frozen=True)
class SaveNames:
    """Keeps only the values tagged with one of ``names``; :func:`save_names` before JAX 0.10.2."""

    saveable_names: frozenset[str]  # the field's name in JAX's own class, which tools read

    def __call__(self, prim: Any, *_: Any, **params: Any) -> bool:
        # jax.checkpoint_policies.save_only_these_names, as a value
        return _jax.is_name_primitive(prim) and params["name"] in self.saveable_names

    def __repr__(self) -> str:
        return f"save_names({_listed(self.saveable_names)})"


def save_names(*names: str) -> Any:
    """Keeps only values tagged with one of ``names`` via :func:`remat.checkpoint_name`.

    JAX's own ``save_only_these_names`` policy, a frozen dataclass from JAX 0.10.2 on
    (equal names, equal policies; JAX's remat3 knows it); on older JAX, whose policy is a
    closure, the equivalent :class:`SaveNames`.

    Example:
      >>> p = save_names("attn_out", "mlp_in")
    """
    wanted = _names(names, "save_names")
    policy = _jcp.save_only_these_names(*sorted(wanted))
    return policy if dataclasses.is_dataclass(policy) else SaveNames(wanted)


@dataclasses.dataclass(frozen=True)
class SaveAllBut:
    """Keeps every intermediate except the values tagged with one of ``names``; see :func:`save_all_but`."""

    names: frozenset[str]

    def __call__(self, prim: Any, *_: Any, **params: Any) -> bool:
        if _jax.is_name_primitive(prim):
            return params["name"] not in self.names
        return True

    def __repr__(self) -> str:
        return f"save_all_but({_listed(self.names)})"


def save_all_but(*names: str) -> SaveAllBut:
    """Keeps every intermediate except the values tagged with one of ``names``.

    The tagged values themselves are not kept; note that :func:`remat.checkpoint_name` is
    an identity, so the output of the operation that produced a tagged value is still
    kept (every untagged value is) and the tagged value is recomputed from it. To really
    drop a large tensor, use :func:`save_names` for what should stay instead.

    (``jax.checkpoint_policies.save_anything_except_these_names`` is not used: by
    JAX 0.10 at the latest it ignores its names and saves everything.)

    Example:
      >>> save_all_but("logits")
      save_all_but('logits')
    """
    return SaveAllBut(_names(names, "save_all_but"))


@dataclasses.dataclass(frozen=True)
class OffloadNames:
    """Moves the values tagged with ``names`` to host memory; see :func:`offload_names`."""

    names: frozenset[str]
    save: frozenset[str]
    src: str
    dst: str

    def __call__(self, prim: Any, *_: Any, **params: Any) -> Any:
        # jax.checkpoint_policies.save_and_offload_only_these_names, as a value
        name = params["name"] if _jax.is_name_primitive(prim) else None
        if name in self.save:
            return Saveable
        if name in self.names:
            return Offloadable(src=self.src, dst=self.dst)
        return Recompute

    def __repr__(self) -> str:
        return f"offload_names({_listed(self.names)})"


def offload_names(
    *names: str, src: str = "device", dst: str = "pinned_host", save: Sequence[str] = ()
) -> OffloadNames:
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

    Example:
      >>> p = offload_names("attn_out", save=["mlp_in"])
    """
    offloaded, saved = _names(names, "offload_names"), _names(tuple(save), "offload_names")
    if offloaded & saved:
        raise ValueError(f"offload_names(): {_listed(offloaded & saved)} cannot be both offloaded and saved")
    return OffloadNames(offloaded, saved, src, dst)

"""One remat-settings object shared by every reference model, in both frameworks.

:class:`RematSettings` says *which* blocks are checkpointed and *with which policy*. The
Flax model calls :func:`jax_block` for each block, the PyTorch twin :func:`torch_block`,
so both checkpoint exactly the same regions.

PyTorch's eager ``torch.utils.checkpoint`` has no counterpart of JAX's saveable policies
(``"dots"``, ``"dots_no_batch"``, checkpoint names): for those the torch side checkpoints
the same blocks fully. ``"everything"`` (keep every intermediate) is the same as no
checkpoint, so torch runs those blocks plainly. Gradients are identical either way:
a policy only decides what is kept and what is recomputed, never what is computed.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Union

import remat
from remat.analysis.budget import ResidualBudget
from remat.policies import NAMED_POLICIES, is_no_checkpoint

BlocksSpec = Union[str, Iterable[int]]

#: ``policy="names"``: save the values the model tags with ``remat.checkpoint_name``.
NAMES = "names"


@dataclass(frozen=True)
class RematSettings:
    """Which blocks of a model are checkpointed, and with which policy.

    Args:
      blocks: ``"all"``, ``"none"`` or a set of block indices (0-based).
      policy: ``None``/``"nothing"``, ``"everything"``, ``"dots"``, ``"dots_no_batch"``,
        ``"names"`` (the names the model tags) or a list of checkpoint names.

    Example:
      >>> s = RematSettings(blocks={0, 2}, policy="dots")
      >>> s.applies(0), s.applies(1)
      (True, False)
    """

    blocks: Any = "all"
    policy: Any = None

    def __post_init__(self) -> None:
        blocks = self.blocks
        if isinstance(blocks, str):
            if blocks not in ("all", "none"):
                raise ValueError(f"RematSettings(blocks={blocks!r}): use 'all', 'none' or a set of block indices")
        else:
            try:
                blocks = frozenset(int(i) for i in blocks)
            except TypeError:
                raise TypeError(
                    f"RematSettings(blocks={self.blocks!r}): use 'all', 'none' or a set of block indices"
                ) from None
            object.__setattr__(self, "blocks", blocks)
        policy = self.policy
        if is_no_checkpoint(policy):  # policy=NO_CHECKPOINT: the same as blocks="none"
            object.__setattr__(self, "blocks", "none")
            object.__setattr__(self, "policy", None)
            return
        if isinstance(policy, str):
            if policy != NAMES and policy not in NAMED_POLICIES:
                valid = ", ".join(map(repr, [*NAMED_POLICIES, NAMES]))
                raise ValueError(f"RematSettings(policy={policy!r}): use one of {valid}, None or a list of names")
        elif isinstance(policy, ResidualBudget):
            pass  # a memory budget: remat.checkpoint chooses per block; torch checkpoints fully
        elif policy is not None:
            if callable(policy):
                raise TypeError("RematSettings(policy=...) takes a name, a list of names or "
                                "remat.residual_budget(F), not an arbitrary callable")
            object.__setattr__(self, "policy", tuple(policy))

    @classmethod
    def none(cls) -> RematSettings:
        """No checkpointing at all."""
        return cls(blocks="none")

    def applies(self, index: int) -> bool:
        """True when block ``index`` is checkpointed."""
        if self.blocks == "all":
            return True
        if self.blocks == "none":
            return False
        return index in self.blocks

    def jax_policy(self, tagged: tuple[str, ...] = ()) -> Any:
        """The ``policy=`` for :func:`remat.checkpoint`; ``"names"`` becomes ``tagged``."""
        if self.policy == NAMES:
            return list(tagged) if tagged else None  # nothing tagged: nothing to save
        if isinstance(self.policy, tuple):
            return list(self.policy)
        return self.policy

    def torch_checkpoints(self, index: int) -> bool:
        """True when the PyTorch twin wraps block ``index`` in ``torch.utils.checkpoint``."""
        return self.applies(index) and self.policy != "everything"

    @property
    def label(self) -> str:
        """A short description for reports, e.g. ``"all blocks, policy=dots"``."""
        if self.blocks == "none":
            return "no checkpoint"
        where = "all blocks" if self.blocks == "all" else "blocks " + ",".join(map(str, sorted(self.blocks)))
        keep_as_is = self.policy is None or isinstance(self.policy, (str, ResidualBudget))
        pol = self.policy if keep_as_is else list(self.policy)
        return f"{where}, policy={pol or 'nothing'}"


def jax_block(settings: RematSettings, index: int, fn: Callable[..., Any], *args: Any,
              tagged: tuple[str, ...] = ()) -> Any:
    """``fn(*args)``, checkpointed with :func:`remat.checkpoint` when ``settings`` say so."""
    if not settings.applies(index):
        return fn(*args)
    return remat.checkpoint(fn, *args, policy=settings.jax_policy(tagged))


def torch_block(settings: RematSettings, index: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` when
    ``settings`` say so (imports torch: call only from a PyTorch twin).

    Through :func:`remat.crosscheck.torch_checkpoint`, which restores BatchNorm running
    statistics after torch's recomputation: torch would otherwise update them twice per
    step, where JAX (whose recomputation is pure) updates them once.
    """
    if not settings.torch_checkpoints(index):
        return fn(*args)
    from remat.crosscheck import torch_checkpoint

    return torch_checkpoint(fn, *args)

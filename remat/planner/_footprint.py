"""A compiled step's footprint on one device, and what it is made of: parameters, optimizer state, activations."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from remat._core.residuals import format_bytes
from remat.analysis.compiled import CompiledMemory


@dataclasses.dataclass(frozen=True)
class Footprint:
    """One compiled ``jit(grad(step))``'s bytes on one device (``memory_analysis()``).

    Attributes:
      argument_bytes: the step's arguments.
      output_bytes: its outputs (the gradients).
      temp_bytes: XLA's temp buffer: the activations and what the backward pass keeps.
      alias_bytes: outputs that reuse donated argument buffers.
      parameter_bytes: of the arguments, those differentiated (``argnums``).
      optimizer_bytes: of the arguments, optax optimizer states.
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    parameter_bytes: int = 0
    optimizer_bytes: int = 0

    @property
    def device_bytes(self) -> int:
        """Arguments + outputs + temp - aliased: what the step holds on the device at once."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    @property
    def fixed_bytes(self) -> int:
        """What no checkpointing changes: arguments + outputs - aliased."""
        return self.device_bytes - self.temp_bytes

    def parts(self) -> dict[str, int]:
        """The footprint by kind: parameters (with their gradients), optimizer state,
        activations (the temp buffer) and other arguments (the batch)."""
        gradients = min(self.output_bytes, self.parameter_bytes)
        other = self.argument_bytes - self.parameter_bytes - self.optimizer_bytes + self.output_bytes - gradients
        return {"parameters": self.parameter_bytes + gradients - self.alias_bytes,
                "optimizer state": self.optimizer_bytes, "activations": self.temp_bytes, "other": max(other, 0)}

    def dominant(self) -> str:
        """``"parameters (2.0 GiB)"``: the largest part (:meth:`parts`), with its bytes."""
        kind, size = max(self.parts().items(), key=lambda kv: kv[1])
        return f"{kind} ({format_bytes(size)})"

    def to_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "device_bytes": self.device_bytes}


def footprint(compiled: Any, args: tuple, argnums: int | Sequence[int]) -> Footprint:
    """The footprint of ``compiled`` (a ``jit(grad(step, argnums))`` of ``args``), its
    arguments split into parameters (``argnums``), optax optimizer states and the rest."""
    memory = CompiledMemory.from_compiled(compiled)
    differentiated = {argnums} if isinstance(argnums, int) else set(argnums)
    parameters = sum(_nbytes(a) for i, a in enumerate(args) if i in differentiated)
    optimizer = sum(_nbytes(a) for i, a in enumerate(args) if i not in differentiated and _optimizer_state(a))
    return Footprint(memory.argument_bytes, memory.output_bytes, memory.temp_bytes, memory.alias_bytes,
                     parameters, optimizer)


def _nbytes(tree: Any) -> int:
    return sum(int(getattr(leaf, "nbytes", 0)) for leaf in jax.tree.leaves(tree))


def _optimizer_state(tree: Any) -> bool:
    """Whether ``tree`` holds an optax state (its nodes' classes come from optax)."""
    found = jax.tree.leaves(tree, is_leaf=lambda node: type(node).__module__.startswith("optax"))
    return any(type(node).__module__.startswith("optax") for node in found)

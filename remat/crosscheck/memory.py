"""Saved-for-backward bytes per module: a Flax model beside its PyTorch twin.

JAX's side: what the backward pass of the model's gradient reads from its forward pass,
charged to the module whose backward reads it (a checkpointed region keeps its inputs),
from the traced step (:func:`remat.explainer.explanation.saved_bytes_by_module`). PyTorch's
side: every tensor autograd saves during the forward pass, counted with
``torch.autograd.graph.saved_tensors_hooks`` and charged to the innermost module running;
a module that runs under ``torch.utils.checkpoint`` saves nothing through those hooks
(the checkpoint's own hooks take over), so what it keeps, its inputs, is counted when it
is called. On both sides a tensor is counted once, and parameters and the model's inputs
are left out.

Example:
  >>> report = compare_saved_bytes(jax_model, torch_model, (x,))  # doctest: +SKIP
  >>> print(report); report.differing                              # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from remat._core.residuals import format_bytes
from remat.crosscheck.harness import _channels_last, _inputs, _jax_arrays, _torch_tensors
from remat.crosscheck.lazy import _torch

OUTSIDE = "(outside every module)"
_WRAPPED = "._checkpoint_wrapped_module"  # torch.distributed's checkpoint_wrapper inserts it in names


@dataclasses.dataclass(frozen=True)
class ModuleBytes:
    """Saved-for-backward bytes of one module (and its submodules) in both frameworks."""

    module: str
    jax_bytes: int
    torch_bytes: int

    def differs(self, tolerance: float, floor: int = 0) -> bool:
        """True when the two differ by more than ``tolerance`` of the larger and by more than ``floor`` bytes."""
        gap = abs(self.jax_bytes - self.torch_bytes)
        return gap > tolerance * max(self.jax_bytes, self.torch_bytes) and gap > floor


@dataclasses.dataclass(frozen=True)
class MemoryComparison:
    """Per-module saved-for-backward bytes of a JAX model and its PyTorch twin.

    Attributes:
      rows: one per module at ``depth`` (``"blocks.3"`` at depth 2), and values kept outside every module.
      checkpointed: the module paths of the JAX model's checkpointed regions.
      tolerance: the relative difference above which a module is named in :attr:`differing`;
        differences under 1% of the larger total are not named (index tensors are int32 in
        JAX, int64 in PyTorch).
    """

    rows: tuple[ModuleBytes, ...]
    checkpointed: tuple[str, ...]
    depth: int
    tolerance: float = 0.1

    @property
    def floor(self) -> int:
        return max(self.jax_total, self.torch_total) // 100

    def differs(self, row: ModuleBytes) -> bool:
        return row.differs(self.tolerance, self.floor)

    @property
    def differing(self) -> list[str]:
        return [r.module for r in self.rows if self.differs(r)]

    @property
    def jax_total(self) -> int:
        return sum(r.jax_bytes for r in self.rows)

    @property
    def torch_total(self) -> int:
        return sum(r.torch_bytes for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {"rows": [dataclasses.asdict(r) | {"differs": self.differs(r)} for r in self.rows],
                "checkpointed": list(self.checkpointed), "depth": self.depth, "tolerance": self.tolerance,
                "jax_total": self.jax_total, "torch_total": self.torch_total, "differing": self.differing}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        lines = [f"saved for backward, per module (depth {self.depth}): jax {format_bytes(self.jax_total)}, "
                 f"torch {format_bytes(self.torch_total)}"]
        for r in self.rows:
            mark = "  DIFFERS" if self.differs(r) else ""
            lines.append(f"  {r.module:<32} jax {format_bytes(r.jax_bytes):>10}  torch "
                         f"{format_bytes(r.torch_bytes):>10}{mark}")
        return "\n".join(lines)


def _prefix(module: str | None, depth: int) -> str:
    return OUTSIDE if not module else ".".join(module.split(".")[:depth])


def _loss_value(out: Any) -> Any:
    """A scalar from a model's output: the logits of a HuggingFace output, the first of a tuple."""
    out = getattr(out, "logits", out)
    if isinstance(out, (tuple, list)):
        out = out[0]
    return (out.astype(jnp.float32) if hasattr(out, "astype") else out.float()).__pow__(2).mean()


def _tensors(tree: Any) -> Any:
    """The tensors in nested tuples, lists and dicts (a module's positional and keyword arguments)."""
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (tuple, list)):
        for item in tree:
            yield from _tensors(item)
    elif hasattr(tree, "untyped_storage"):
        yield tree


def jax_saved_bytes(jax_model: nnx.Module, xs: list[Any]) -> tuple[dict[str | None, int], list[str]]:
    """The JAX model's saved-for-backward bytes by module (its parameters differentiated)."""
    from remat.explainer.explanation import saved_bytes_by_module

    graphdef, params, rest = nnx.split(jax_model, nnx.Param, ...)

    def loss(params: Any, *inputs: Any) -> Any:
        return _loss_value(nnx.merge(graphdef, params, rest, copy=True)(*inputs))

    return saved_bytes_by_module(jax.grad(loss), params, *xs)


def torch_saved_bytes(torch_model: Any, xs: list[Any], checkpointed: list[str]) -> dict[str | None, int]:
    """The PyTorch model's saved-for-backward bytes by module, one forward pass under the hooks."""
    torch = _torch()
    skip = {p.untyped_storage().data_ptr() for p in torch_model.parameters()}
    skip |= {x.untyped_storage().data_ptr() for x in xs if torch.is_tensor(x)}
    owner: dict[int, tuple[str | None, int]] = {}  # storage -> (module charged, bytes)
    stack: list[tuple[str, int]] = []  # (module path, tensors saved when it was entered)
    saved = [0]

    def count(t: Any, module: str | None, recharge: bool = False) -> None:
        if not torch.is_tensor(t) or t.is_sparse:
            return
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip and (recharge or ptr not in owner):
            owner[ptr] = (module, t.untyped_storage().nbytes())

    def pack(t: Any) -> Any:
        saved[0] += 1
        count(t, stack[-1][0] if stack else None)
        return t

    handles = []
    for name, module in torch_model.named_modules():
        path = name.replace(_WRAPPED, "").removeprefix("_checkpoint_wrapped_module.")
        if not path:
            continue

        def enter(mod: Any, args: Any, kwargs: Any, path: str = path) -> None:
            stack.append((path, saved[0]))
            if path in checkpointed:  # kept if its forward saves nothing through our hooks
                mod._remat_inputs = list(_tensors((args, kwargs)))

        def leave(mod: Any, args: Any, out: Any, path: str = path) -> None:
            _, before = stack.pop()
            inputs = mod.__dict__.pop("_remat_inputs", ())
            if path in checkpointed and saved[0] == before:  # ran under torch.utils.checkpoint
                for a in inputs:  # what the checkpoint keeps (saved just before, outside the module)
                    count(a, path, recharge=True)

        handles += [module.register_forward_pre_hook(enter, with_kwargs=True), module.register_forward_hook(leave)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = _loss_value(torch_model(*xs))
        del loss
    finally:
        for h in handles:
            h.remove()
    totals: dict[str | None, int] = {}
    for module, nbytes in owner.values():
        totals[module] = totals.get(module, 0) + nbytes
    return totals


def compare_saved_bytes(jax_model: nnx.Module, torch_model: Any, inputs: Any, *, depth: int | None = None,
                        tolerance: float = 0.1, mode: str = "train") -> MemoryComparison:
    """Saved-for-backward bytes per module of a Flax model and its PyTorch twin, side by side.

    Args:
      jax_model: the NNX model, checkpointed as its twin is (``RematSettings``,
        :func:`remat.models._twin.apply_checkpointing_pair`).
      torch_model: its PyTorch twin.
      inputs: example inputs in PyTorch's layout (NumPy arrays or tensors).
      depth: the module depth compared (default: the checkpointed regions', else 2).
      tolerance: modules whose bytes differ by more than this fraction are named.
      mode: ``"train"`` or ``"eval"`` for both models.

    Returns:
      A :class:`MemoryComparison`.
    """
    torch = _torch()
    xs = _inputs(inputs)
    for model in (jax_model, torch_model):
        getattr(model, mode)()
    jax_bytes, regions = jax_saved_bytes(jax_model, _jax_arrays(xs, "float32", _channels_last(jax_model, None)))
    depth = depth or min((len(r.split(".")) for r in regions), default=2)
    with torch.enable_grad():
        torch_bytes = torch_saved_bytes(torch_model, _torch_tensors(xs, "float32", False), regions)
    rows: dict[str, list[int]] = {}
    for side, totals in enumerate((jax_bytes, torch_bytes)):
        for module, n in totals.items():
            rows.setdefault(_prefix(module, depth), [0, 0])[side] += n
    ordered = sorted(rows, key=lambda m: (m == OUTSIDE, [(0, int(p), "") if p.isdigit() else (1, 0, p)
                                                         for p in m.split(".")]))
    return MemoryComparison(tuple(ModuleBytes(m, *rows[m]) for m in ordered), tuple(regions), depth, tolerance)


__all__ = ["OUTSIDE", "MemoryComparison", "ModuleBytes", "compare_saved_bytes", "jax_saved_bytes",
           "torch_saved_bytes"]

"""The PyTorch variants: the twin's own forward, its block stack run by ``torch.utils.checkpoint``.

Each variant is the PyTorch twin of :mod:`remat.models` (built without checkpointing)
running its own forward, embeddings and head included; only its block stack
(``model.blocks``) is run the variant's way, for the duration of a forward: plainly
(``none``), each block under ``torch.utils.checkpoint.checkpoint`` (``nothing``), or
``torch.utils.checkpoint.checkpoint_sequential`` (``sequential``), both with
``use_reentrant=False`` and nothing of remat's in between.

``torch_compile_F`` is the strongest peer: the plain forward (``none``) under
``torch.compile``, its default configuration but for
``torch._functorch.config.activation_memory_budget = F``, which makes AOTAutograd's
min-cut partitioner keep at most the fraction ``F`` of the activations it would keep
at 1.0 and recompute the rest in the backward graph. Its first step compiles;
``compile_s`` is that step's time.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from benchmarks.cases import TORCH_VARIANTS, Built, compile_budget, segments_for
from remat._names import NO_CHECKPOINT


@dataclasses.dataclass
class TorchProgram:
    variant: str
    forward: Callable[[], Any]  # returns the loss
    params: list
    compile_s: float | None = None  # torch.compile variants: the first (compiling) step

    def zero(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> Any:
        self.zero()
        loss = self.forward()
        loss.backward()
        return loss


def _stack(run: Callable[[Any], Any]) -> Any:
    """A ``ModuleList`` of one module calling ``run(h)``: a whole block stack in one."""
    import torch

    class Stack(torch.nn.Module):
        def forward(self, h: Any) -> Any:
            return run(h)

    return torch.nn.ModuleList([Stack()])


@contextlib.contextmanager
def _blocks_replaced(model: Any, stack: Any) -> Iterator[None]:
    """``model.blocks`` is ``stack`` meanwhile (None: left as they are)."""
    if stack is None:
        yield
        return
    blocks = model.blocks
    model.blocks = stack
    try:
        yield
    finally:
        model.blocks = blocks


def torch_program(built: Built, variant: str) -> TorchProgram:
    import torch
    import torch.utils.checkpoint as tcp
    from torch.nn import functional as F

    if variant not in TORCH_VARIANTS and compile_budget(variant) is None:
        raise ValueError(f"unknown PyTorch variant {variant!r}; use one of {', '.join(TORCH_VARIANTS)}")
    tm = built.torch_model
    tm.train()
    x = torch.from_numpy(np.ascontiguousarray(built.inputs))
    y = torch.from_numpy(np.ascontiguousarray(built.targets)).long()
    blocks = list(tm.blocks)

    def nothing(h: Any) -> Any:
        for b in blocks:
            # the module itself, called by checkpoint, so that counting hooks can wrap it
            h = tcp.checkpoint(b, h, use_reentrant=False)
        return h

    def sequential(h: Any) -> Any:
        return tcp.checkpoint_sequential(blocks, segments_for(built.depth), h, use_reentrant=False)

    budget = compile_budget(variant)
    plain = variant == NO_CHECKPOINT or budget is not None
    stack = None if plain else _stack(nothing if variant == "nothing" else sequential)

    def forward() -> Any:
        with _blocks_replaced(tm, stack):
            logits = tm(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    params = [p for p in tm.parameters() if p.requires_grad]
    if budget is None:
        return TorchProgram(variant, forward, params)
    return _compiled_program(variant, forward, params, budget)


def _compiled_program(variant: str, forward: Callable[[], Any], params: list, budget: float) -> TorchProgram:
    """``torch.compile(forward)`` partitioned at ``activation_memory_budget=budget``; first step run.

    Dynamo keeps its compiled graphs per code object, so every variant compiles a fresh
    copy of ``forward``'s code (the same closure would reuse another budget's graph).
    Every call runs under the budget, so a recompilation, should a guard fail, partitions
    the same way.
    """
    import torch
    import torch._functorch.config as functorch_config

    fresh = types.FunctionType(forward.__code__.replace(), forward.__globals__, f"forward_{variant}",
                               forward.__defaults__, forward.__closure__)
    compiled = torch.compile(fresh)

    def compiled_forward() -> Any:
        with functorch_config.patch(activation_memory_budget=budget):
            return compiled()

    program = TorchProgram(variant, compiled_forward, params)
    t0 = time.perf_counter()
    program.step()  # compiles the forward and the backward graphs
    program.compile_s = time.perf_counter() - t0
    program.zero()
    return program


def torch_saved_bytes(program: TorchProgram) -> dict[str, int]:
    """Bytes of the tensors packed for the backward during one forward, by storage.

    A compiled forward is one ``autograd.Function`` whose ``save_for_backward`` goes
    through the same hooks: what its partitioned backward graph takes from the forward.
    """
    import torch

    param_ptrs = {p.untyped_storage().data_ptr() for p in program.params}
    storages: dict[int, int] = {}

    def pack(t: Any) -> Any:
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = program.forward()
    loss.backward()  # the saved tensors must be consumable: the graph is real
    for p in program.params:
        p.grad = None
    params = sum(n for ptr, n in storages.items() if ptr in param_ptrs)
    saved = sum(n for ptr, n in storages.items() if ptr not in param_ptrs)
    return {"saved_bytes": int(saved), "saved_param_bytes": int(params), "residual_total_bytes": int(saved + params)}

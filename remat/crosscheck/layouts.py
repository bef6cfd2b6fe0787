"""Per-tensor layouts from the torch module that owns each tensor, and tied (shared-storage) tensors.

Layouts
-------
A layout says how a torch tensor's axes map to the Flax variable's:

| layout | torch | Flax | owners |
|---|---|---|---|
| ``"linear"`` | ``(out, in)`` | ``(in, out)`` | ``nn.Linear`` |
| ``"conv"`` | ``(O, I, *spatial)`` | ``(*spatial, I, O)`` | ``nn.Conv1d/2d/3d`` |
| ``"conv_transpose"`` | ``(I, O, *spatial)`` | ``(*spatial, I, O)`` | ``nn.ConvTranspose1d/2d/3d`` |
| ``"same"`` | unchanged | unchanged | HF ``Conv1D`` (already ``(in, out)``), ``nn.Embedding``, norms, biases, buffers |

Only a Flax ``kernel`` takes its owner's layout; every other Flax leaf (``bias``,
``scale``, ``embedding``, your own ``nnx.Param``) is taken as stored in torch's layout.
When the owner is unknown (a bare state dict, a custom module's own ``nn.Parameter``),
the layout is guessed from the Flax leaf: a 2-D ``kernel`` is ``"linear"``, an n-D one
``"conv"``. A guessed square kernel cannot be told from its transpose, so it is named in
a :class:`LayoutWarning`. ``layouts=`` overrides any of this per tensor.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from remat.crosscheck.lazy import _torch

LAYOUTS = ("linear", "conv", "conv_transpose", "same")


class LayoutWarning(UserWarning):
    """A square weight's orientation was guessed from its Flax leaf name, not known from its owner."""


def to_flax(layout: str, array: np.ndarray) -> np.ndarray:
    """A torch tensor's values in the Flax layout ``layout`` names (see the module docstring)."""
    if layout == "same" or array.ndim < 2:
        return array
    if layout == "linear" or array.ndim == 2:
        return array.T
    if layout == "conv":
        return np.transpose(array, (*range(2, array.ndim), 1, 0))
    if layout == "conv_transpose":
        return np.transpose(array, (*range(2, array.ndim), 0, 1))
    raise ValueError(f"layout {layout!r}: use one of {', '.join(LAYOUTS)}")


def to_torch(layout: str, array: np.ndarray) -> np.ndarray:
    """The inverse of :func:`to_flax`: Flax values in the torch tensor's layout."""
    if layout == "same" or array.ndim < 2:
        return array
    if layout == "linear" or array.ndim == 2:
        return array.T
    n = array.ndim
    if layout == "conv":
        return np.transpose(array, (n - 1, n - 2, *range(n - 2)))
    if layout == "conv_transpose":
        return np.transpose(array, (n - 2, n - 1, *range(n - 2)))
    raise ValueError(f"layout {layout!r}: use one of {', '.join(LAYOUTS)}")


def guess(leaf: str, ndim: int) -> str:
    """The layout the Flax leaf name implies: a ``kernel`` is Linear (2-D) or conv (n-D)."""
    if leaf != "kernel" or ndim < 2:
        return "same"
    return "linear" if ndim == 2 else "conv"


def _owner_layout(module: Any) -> str | None:
    torch = _torch()
    nn = torch.nn
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        return "conv_transpose"
    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    if type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers"):
        return "same"  # HF's GPT-2 "Conv1D" is a Linear that stores (in, out)
    if isinstance(module, (nn.Embedding, nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)):
        return "same"
    if type(module).__name__.endswith("RMSNorm") or isinstance(module, getattr(nn, "RMSNorm", ())):
        return "same"
    return None


#: Attribute names torch's wrappers put between a model and its modules: ``checkpoint_wrapper``
#: (``apply_activation_checkpointing``) and ``torch.compile``. The wrapped model's tensors are
#: the user's, so names are compared without them, as the wrappers' own state dicts do.
WRAPPER_PREFIXES: tuple[str, ...] = ("_checkpoint_wrapped_module.", "_orig_mod.")


def torch_name(name: str) -> str:
    """``name`` as the unwrapped model spells it (see :data:`WRAPPER_PREFIXES`)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def owner_layouts(source: Any) -> dict[str, str | None]:
    """torch name -> the layout its owning module implies (``None``: owner unknown)."""
    torch = _torch()
    if not isinstance(source, torch.nn.Module):
        return {}
    out: dict[str, str | None] = {}
    for prefix, module in source.named_modules(remove_duplicate=False):
        layout = _owner_layout(module)
        for name, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            out[torch_name(f"{prefix}.{name}" if prefix else name)] = layout if name == "weight" else "same"
    return out


def _override(layouts: Mapping[str, str] | Callable[[str], str | None] | None) -> Callable[[str], str | None]:
    if layouts is None:
        return lambda name: None
    if isinstance(layouts, Mapping):
        return layouts.get
    if callable(layouts):
        return layouts
    raise TypeError(f"layouts must be a mapping or a function of the torch name, got {type(layouts).__name__}")


class Layouts:
    """Resolves each tensor's layout: ``layouts=`` first, then the owning module, then a guess.

    Args:
      source: the torch module (owners known) or a state dict (owners unknown).
      names: torch name -> name after ``rename=`` (the Flax-convention name).
      layouts: the user's override, keyed by torch name (before ``rename=``).
    """

    def __init__(self, source: Any, names: Mapping[str, str], layouts: Any = None):
        override, owners = _override(layouts), owner_layouts(source)
        self.given: dict[str, str] = {}
        self.owned: dict[str, str] = {}
        for torch_name, new in names.items():
            chosen = override(torch_name)
            if chosen is not None:
                if chosen not in LAYOUTS:
                    raise ValueError(f"layouts[{torch_name!r}] = {chosen!r}: use one of {', '.join(LAYOUTS)}")
                self.given[new] = chosen
            elif (owned := owners.get(torch_name)) is not None:
                self.owned[new] = owned
        self.guessed_square: list[str] = []

    def of(self, name: str, leaf: str, torch_shape: tuple[int, ...]) -> str:
        """The layout of the tensor ``name`` (Flax-convention name) whose Flax leaf is ``leaf``."""
        if name in self.given:
            return self.given[name]
        if leaf != "kernel":
            return "same"
        if name in self.owned:
            return self.owned[name]
        layout = guess(leaf, len(torch_shape))
        if len(torch_shape) == 2 and torch_shape[0] == torch_shape[1]:
            self.guessed_square.append(name)
        return layout

    def warn_guessed(self, where: str) -> None:
        """One :class:`LayoutWarning` naming every square kernel whose layout was guessed."""
        if self.guessed_square:
            names = ", ".join(sorted(set(self.guessed_square)))
            warnings.warn(
                f"{where}: square weights {names} were transposed as nn.Linear's (out, in) by a guess from "
                f"the Flax leaf name 'kernel'; pass the torch.nn.Module itself, or layouts={{name: 'linear' or "
                f"'same'}} (HF Conv1D stores (in, out): 'same')", LayoutWarning, stacklevel=3)


def tied_groups(source: Any) -> list[tuple[str, ...]]:
    """Names of the state-dict tensors that share storage (GPT-2's ``lm_head.weight`` and
    ``transformer.wte.weight``), each group in state-dict order (the first is what
    ``named_parameters()`` keeps)."""
    torch = _torch()
    state = source.state_dict(keep_vars=True) if isinstance(source, torch.nn.Module) else source
    if not isinstance(state, Mapping):
        return []
    groups: dict[tuple, list[str]] = {}
    for name, t in state.items():
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
            groups.setdefault(key, []).append(torch_name(name))
    return [tuple(g) for g in groups.values() if len(g) > 1]

"""torch -> Flax NNX state: names, layouts and :func:`load_torch_state`.

Naming convention
-----------------
An NNX variable at path ``blocks/0/attn/qkv/kernel`` matches the torch entry
``blocks.0.attn.qkv.weight``: path parts are joined with ``.``, and the last part is
renamed and re-laid-out by the kind of layer that owns it:

| NNX leaf | torch name | layout |
|---|---|---|
| ``kernel`` (2-D) | ``weight`` | transposed: torch ``(out, in)`` -> ``(in, out)`` |
| ``kernel`` (n-D, conv) | ``weight`` | ``(O, I, *spatial)`` -> ``(*spatial, I, O)`` (OIHW -> HWIO) |
| ``scale`` | ``weight`` | LayerNorm / BatchNorm / RMSNorm, unchanged |
| ``embedding`` | ``weight`` | ``nn.Embedding``, unchanged |
| ``mean`` (BatchStat) | ``running_mean`` | unchanged |
| ``var`` (BatchStat) | ``running_var`` | unchanged |
| anything else | the same name | unchanged (``bias``, your own ``nnx.Param``) |

torch's ``num_batches_tracked`` is ignored. So a user's models convert as they are when
their attribute names match (``self.blocks = nnx.data([...])`` against an
``nn.ModuleList`` called ``blocks``, ``self.fc1`` against ``self.fc1``); when they differ,
pass ``rename=`` (a mapping or a function from torch names to the names above).
:func:`torch_names` lists what an NNX module expects.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from remat.torch.lazy import _torch

_LEAF_TO_TORCH = {"kernel": "weight", "scale": "weight", "embedding": "weight"}
_STAT_TO_TORCH = {"mean": "running_mean", "var": "running_var"}
_IGNORED_TORCH = ("num_batches_tracked",)


# --- names and layouts -----------------------------------------------------------------

def _leaf_torch_name(leaf: str, variable: nnx.Variable) -> str:
    if isinstance(variable, nnx.BatchStat) and leaf in _STAT_TO_TORCH:
        return _STAT_TO_TORCH[leaf]
    return _LEAF_TO_TORCH.get(leaf, leaf)


def _variables(module: nnx.Module) -> dict[str, tuple[tuple, nnx.Variable]]:
    """Torch-style name -> (NNX path, Variable) for every Param and BatchStat of ``module``."""
    out: dict[str, tuple[tuple, nnx.Variable]] = {}
    for path, node in nnx.iter_graph(module):
        if not isinstance(node, (nnx.Param, nnx.BatchStat)) or not path:
            continue
        name = ".".join(map(str, (*path[:-1], _leaf_torch_name(str(path[-1]), node))))
        if name in out:
            raise ValueError(
                f"two NNX variables map to the torch name {name!r} ({_slash(out[name][0])} and "
                f"{_slash(path)}); rename one attribute"
            )
        out[name] = (tuple(path), node)
    return out


def _slash(path: Sequence[Any]) -> str:
    return "/".join(map(str, path))


def torch_names(module: nnx.Module) -> dict[str, str]:
    """The torch state-dict names an NNX module expects, with the NNX path of each.

    Args:
      module: an NNX module.

    Returns:
      ``{"blocks.0.attn.qkv.weight": "blocks/0/attn/qkv/kernel", ...}``.

    Example:
      >>> torch_names(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
      {'bias': 'bias', 'weight': 'kernel'}
    """
    return {name: _slash(path) for name, (path, _) in sorted(_variables(module).items())}


def to_nnx_layout(leaf: str, array: np.ndarray) -> np.ndarray:
    """A torch tensor's values in the layout of the NNX variable called ``leaf``.

    Args:
      leaf: the NNX variable's name (``"kernel"`` is transposed, everything else is not).
      array: the torch values as a NumPy array.

    Returns:
      ``array`` transposed for a ``kernel``: Linear ``(out, in) -> (in, out)``, convolution
      ``(O, I, *spatial) -> (*spatial, I, O)``; unchanged otherwise.
    """
    if leaf != "kernel" or array.ndim < 2:
        return array
    if array.ndim == 2:
        return array.T
    return np.transpose(array, (*range(2, array.ndim), 1, 0))


def to_torch_layout(leaf: str, array: np.ndarray) -> np.ndarray:
    """The inverse of :func:`to_nnx_layout`: NNX values in the torch tensor's layout."""
    if leaf != "kernel" or array.ndim < 2:
        return array
    if array.ndim == 2:
        return array.T
    n = array.ndim
    return np.transpose(array, (n - 1, n - 2, *range(n - 2)))


def _to_numpy(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu()
        if not value.dtype.is_floating_point or value.dtype in _numpy_torch_floats():
            return value.numpy()
        return value.float().numpy()  # bfloat16 and friends have no NumPy dtype
    return np.asarray(value)


def _numpy_torch_floats() -> tuple:
    torch = _torch()
    return (torch.float16, torch.float32, torch.float64)


# --- loading ---------------------------------------------------------------------------

class StateDictMismatchError(ValueError):
    """The torch state dict and the NNX module disagree; names every offending entry.

    Attributes:
      missing: NNX variables (torch-style names) with no torch entry.
      unexpected: torch entries with no NNX variable.
      mismatched: ``(name, torch shape, shape after layout conversion, NNX shape)`` for
        entries of the wrong shape.
    """

    def __init__(self, missing: list[str], unexpected: list[str], mismatched: list[tuple[str, tuple, tuple, tuple]]):
        self.missing, self.unexpected, self.mismatched = missing, unexpected, mismatched
        parts = []
        if missing:
            parts.append("missing in the torch state: " + ", ".join(missing))
        if unexpected:
            parts.append("unexpected torch entries: " + ", ".join(unexpected))
        if mismatched:
            parts.append("shape mismatch: " + ", ".join(
                f"{n} (torch {tuple(t)} -> {tuple(to)} after layout conversion, NNX expects {tuple(e)})"
                for n, t, to, e in mismatched))
        super().__init__(
            "load_torch_state: nothing copied; " + "; ".join(parts)
            + " (fix the names with rename=, or pass strict=False to copy what matches)"
        )


@dataclass
class LoadReport:
    """What :func:`load_torch_state` copied and what it skipped (``strict=False``)."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when everything matched (nothing skipped)."""
        return not (self.missing or self.unexpected or self.mismatched)

    def __str__(self) -> str:
        lines = [f"loaded {len(self.loaded)} tensors"]
        for what in ("missing", "unexpected", "mismatched"):
            names = getattr(self, what)
            if names:
                lines.append(f"{what} ({len(names)}): {', '.join(names)}")
        return "\n".join(lines)


def _state_dict(source: Any) -> dict[str, Any]:
    if hasattr(source, "state_dict") and callable(source.state_dict):
        return dict(source.state_dict())
    if isinstance(source, Mapping):
        return dict(source)
    raise TypeError(
        f"load_torch_state expects a torch.nn.Module or a state dict, got {type(source).__name__}"
    )


def _renamer(rename: Mapping[str, str] | Callable[[str], str | None] | None) -> Callable[[str], str | None]:
    if rename is None:
        return lambda k: k
    if isinstance(rename, Mapping):
        return lambda k: rename.get(k, k)
    if callable(rename):
        return rename
    raise TypeError(f"rename must be a mapping or a function of the torch name, got {type(rename).__name__}")


def load_torch_state(
    module: nnx.Module,
    source: Any,
    *,
    strict: bool = True,
    rename: Mapping[str, str] | Callable[[str], str | None] | None = None,
    dtype: Any = None,
) -> LoadReport:
    """Copies a torch module's parameters and buffers into an NNX module, in place.

    Names map structurally (see the module docstring): torch ``blocks.0.attn.qkv.weight``
    fills NNX ``blocks/0/attn/qkv/kernel``, transposed. Every entry is checked before
    anything is copied, so on an error the NNX module is unchanged.

    Args:
      module: the NNX module to fill.
      source: a ``torch.nn.Module``, or a state dict of torch tensors or NumPy arrays.
      strict: when True (the default), missing, unexpected and mis-shaped entries raise
        one :class:`StateDictMismatchError` naming all of them; when False, matching
        entries are copied and the rest reported.
      rename: torch name -> NNX-convention name, as a mapping (unlisted names unchanged)
        or a function (returning ``None`` drops the entry).
      dtype: cast floating values to this dtype; ``None`` keeps each NNX variable's dtype
        (as ``torch.nn.Module.load_state_dict`` keeps the target's).

    Returns:
      A :class:`LoadReport` (with ``strict=True``, one where nothing was skipped).

    Raises:
      StateDictMismatchError: with ``strict=True``, for any missing, unexpected or
        mis-shaped entry (all named in one message).

    Example:
      >>> report = load_torch_state(jax_model, torch_model)  # doctest: +SKIP
      >>> load_torch_state(jax_model, sd, rename=lambda k: k.replace("net.", "layers."))  # doctest: +SKIP
    """
    targets = _variables(module)
    rename_fn = _renamer(rename)
    incoming: dict[str, Any] = {}
    for key, value in _state_dict(source).items():
        if key.rsplit(".", 1)[-1] in _IGNORED_TORCH:
            continue
        new = rename_fn(key)
        if new is not None:
            incoming[new] = value
    missing = sorted(set(targets) - set(incoming))
    unexpected = sorted(set(incoming) - set(targets))
    mismatched, ready = [], {}
    for name in sorted(set(targets) & set(incoming)):
        path, var = targets[name]
        raw = _to_numpy(incoming[name])
        arr = to_nnx_layout(str(path[-1]), raw)
        if tuple(arr.shape) != tuple(var.shape):
            mismatched.append((name, raw.shape, arr.shape, var.shape))
            continue
        ready[name] = arr
    if strict and (missing or unexpected or mismatched):
        raise StateDictMismatchError(missing, unexpected, mismatched)
    for name, arr in ready.items():
        var = targets[name][1]
        target_dtype = var.dtype if dtype is None or not jnp.issubdtype(var.dtype, jnp.floating) else dtype
        var.set_value(jnp.asarray(arr, dtype=target_dtype))
    return LoadReport(loaded=sorted(ready), missing=missing, unexpected=unexpected,
                      mismatched=[m[0] for m in mismatched])

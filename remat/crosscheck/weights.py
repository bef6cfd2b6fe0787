"""torch -> Flax NNX state: names, layouts and :func:`load_torch_state`.

Naming convention
-----------------
An NNX variable at path ``blocks/0/attn/qkv/kernel`` matches the torch entry
``blocks.0.attn.qkv.weight``: path parts are joined with ``.``, and the last part is
renamed and re-laid-out by the kind of layer that owns it:

| NNX leaf | torch name | layout |
|---|---|---|
| ``kernel`` (2-D) | ``weight`` | the owner's: ``nn.Linear`` ``(out, in)`` -> ``(in, out)``; HF ``Conv1D`` unchanged |
| ``kernel`` (n-D, conv) | ``weight`` | ``(O, I, *spatial)`` -> ``(*spatial, I, O)`` (OIHW -> HWIO) |
| ``scale`` | ``weight`` | LayerNorm / BatchNorm / RMSNorm, unchanged |
| ``embedding`` | ``weight`` | ``nn.Embedding``, unchanged |
| ``mean`` (BatchStat) | ``running_mean`` | unchanged |
| ``var`` (BatchStat) | ``running_var`` | unchanged |
| anything else | the same name | unchanged (``bias``, your own ``nnx.Param``) |

Layouts come from the torch module that owns each tensor (:mod:`remat.crosscheck.layouts`;
``layouts=`` overrides them); tensors that share storage (tied embeddings) count once.
Linen variables dicts and parameter pytrees follow the same convention
(:mod:`remat.crosscheck.pytrees`). torch's ``num_batches_tracked`` is ignored. So a user's
models convert as they are when their attribute names match (``self.blocks =
nnx.data([...])`` against an ``nn.ModuleList`` called ``blocks``, ``self.fc1`` against
``self.fc1``); when they differ, pass ``rename=`` (a mapping or a function from torch
names to the names above).
:func:`torch_names` lists what an NNX module expects.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from remat.crosscheck.layouts import Layouts, guess, tied_groups, to_flax, to_torch, torch_name
from remat.crosscheck.lazy import _torch
from remat.crosscheck.pytrees import PytreeModel

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
    strip = getattr(module, "_crosscheck_strip", 0)  # a PytreeModel's "tree" (and collection) parts
    for path, node in nnx.iter_graph(module):
        if not isinstance(node, (nnx.Param, nnx.BatchStat)) or len(path) <= strip:
            continue
        parts = path[strip:]
        name = ".".join(map(str, (*parts[:-1], _leaf_torch_name(str(parts[-1]), node))))
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
    root = 1 if getattr(module, "_crosscheck_strip", 0) else 0  # a PytreeModel's "tree"
    return {name: _slash(path[root:]) for name, (path, _) in sorted(_variables(module).items())}


def to_nnx_layout(leaf: str, array: np.ndarray) -> np.ndarray:
    """A torch tensor's values in the layout of the NNX variable called ``leaf``.

    Args:
      leaf: the NNX variable's name (``"kernel"`` is transposed, everything else is not).
      array: the torch values as a NumPy array.

    Returns:
      ``array`` transposed for a ``kernel``: Linear ``(out, in) -> (in, out)``, convolution
      ``(O, I, *spatial) -> (*spatial, I, O)``; unchanged otherwise.
    """
    return to_flax(guess(leaf, array.ndim), array)


def to_torch_layout(leaf: str, array: np.ndarray) -> np.ndarray:
    """The inverse of :func:`to_nnx_layout`: NNX values in the torch tensor's layout."""
    return to_torch(guess(leaf, array.ndim), array)


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
    tied: list[tuple[str, ...]] = field(default_factory=list)

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
        lines += [_tied_line(self.tied)] if self.tied else []
        return "\n".join(lines)


def _tied_line(tied: Sequence[tuple[str, ...]]) -> str:
    return "tied (one tensor, loaded and compared once): " + "; ".join(" = ".join(g) for g in tied)


def _torch_names(state: Mapping[str, Any], rename: Any) -> dict[str, str]:
    """torch name -> name after ``rename=``, for the entries that are kept."""
    rename_fn = _renamer(rename)
    return {k: new for k in state
            if k.rsplit(".", 1)[-1] not in _IGNORED_TORCH and (new := rename_fn(k)) is not None}


def _tied(source: Any, names: Mapping[str, str], targets: Any) -> tuple[list[tuple[str, ...]], set[str]]:
    """The tied groups (renamed), and the aliases to drop: the members the Flax side has
    no variable for (all but the first when it has none)."""
    groups, dropped = [], set()
    for group in tied_groups(source):
        renamed = tuple(names[k] for k in group if k in names)
        if len(renamed) < 2:
            continue
        groups.append(renamed)
        present = [n for n in renamed if n in targets]
        if present:
            dropped.update(n for n in renamed if n not in present)
        else:
            dropped.update(renamed[1:])
    return groups, dropped


def _state_dict(source: Any) -> dict[str, Any]:
    state_dict = getattr(source, "state_dict", None)
    if callable(state_dict):
        entries: Any = state_dict()  # a torch module's (or anything that offers one)
        return {torch_name(k): v for k, v in entries.items()}
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
    module: Any,
    source: Any,
    *,
    strict: bool = True,
    rename: Mapping[str, str] | Callable[[str], str | None] | None = None,
    dtype: Any = None,
    layouts: Mapping[str, str] | Callable[[str], str | None] | None = None,
) -> Any:
    """Copies a torch module's parameters and buffers into an NNX module (in place) or a Linen dict.

    Names map structurally (see the module docstring): torch ``blocks.0.attn.qkv.weight``
    fills NNX ``blocks/0/attn/qkv/kernel``. Each kernel takes the layout of the torch
    module that owns it (:mod:`remat.crosscheck.layouts`: ``nn.Linear`` transposed, HF
    ``Conv1D`` as it is, convolutions OIHW -> HWIO). Tensors that share storage (tied
    embeddings) are loaded once. Every entry is checked before anything is copied, so on
    an error the target is unchanged.

    Args:
      module: the NNX module to fill; or a Linen variables dict
        (``{"params": ..., "batch_stats": ...}``) or any parameter pytree, which are
        immutable: a new one is returned.
      source: a ``torch.nn.Module``, or a state dict of torch tensors or NumPy arrays
        (owners unknown: a kernel's layout is guessed from its rank, and a square one is
        named in a :class:`~remat.crosscheck.layouts.LayoutWarning`).
      strict: when True (the default), missing, unexpected and mis-shaped entries raise
        one :class:`StateDictMismatchError` naming all of them; when False, matching
        entries are copied and the rest reported.
      rename: torch name -> NNX-convention name, as a mapping (unlisted names unchanged)
        or a function (returning ``None`` drops the entry).
      dtype: cast floating values to this dtype; ``None`` keeps each NNX variable's dtype
        (as ``torch.nn.Module.load_state_dict`` keeps the target's).
      layouts: per-tensor layout override, torch name (before ``rename=``) ->
        ``"linear"``, ``"conv"``, ``"conv_transpose"`` or ``"same"``, as a mapping or a
        function (returning ``None`` keeps the default).

    Returns:
      For an NNX module, a :class:`LoadReport` (with ``strict=True``, one where nothing
      was skipped). For a Linen dict or a pytree, ``(new_variables, report)``.

    Raises:
      StateDictMismatchError: with ``strict=True``, for any missing, unexpected or
        mis-shaped entry (all named in one message).

    Example:
      >>> report = load_torch_state(jax_model, torch_model)  # doctest: +SKIP
      >>> load_torch_state(jax_model, sd, rename=lambda k: k.replace("net.", "layers."))  # doctest: +SKIP
      >>> variables, report = load_torch_state(variables, torch_model)  # Linen  # doctest: +SKIP
    """
    if not isinstance(module, nnx.Module):
        if not isinstance(module, (Mapping, list, tuple)):
            raise TypeError(f"load_torch_state fills an NNX module, a Linen variables dict or a parameter pytree "
                            f"(dicts, lists, tuples of arrays), got {type(module).__name__}")
        holder = PytreeModel(None, module, linen=False, train_kwargs={}, eval_kwargs={})
        report = load_torch_state(holder, source, strict=strict, rename=rename, dtype=dtype, layouts=layouts)
        return holder.value(), report
    targets = _variables(module)
    state = _state_dict(source)
    names = _torch_names(state, rename)
    tied, aliases = _tied(source, names, targets)
    incoming = {new: state[k] for k, new in names.items() if new not in aliases}
    resolve = Layouts(source, names, layouts)
    missing = sorted(set(targets) - set(incoming))
    unexpected = sorted(set(incoming) - set(targets))
    mismatched, ready = [], {}
    for name in sorted(set(targets) & set(incoming)):
        path, var = targets[name]
        raw = _to_numpy(incoming[name])
        arr = to_flax(resolve.of(name, str(path[-1]), raw.shape), raw)
        if tuple(arr.shape) != tuple(var.shape):
            mismatched.append((name, raw.shape, arr.shape, var.shape))
            continue
        ready[name] = arr
    if strict and (missing or unexpected or mismatched):
        raise StateDictMismatchError(missing, unexpected, mismatched)
    resolve.warn_guessed("load_torch_state")
    for name, arr in ready.items():
        var = targets[name][1]
        target_dtype = var.dtype if dtype is None or not jnp.issubdtype(var.dtype, jnp.floating) else dtype
        var.set_value(jnp.asarray(arr, dtype=target_dtype))
    return LoadReport(loaded=sorted(ready), missing=missing, unexpected=unexpected,
                      mismatched=[m[0] for m in mismatched], tied=tied)


class TorchNaming:
    """How one torch model's names meet the Flax side: ``rename=``, layouts and tied tensors.

    Args:
      torch_model: the ``torch.nn.Module`` (or state dict) of the comparison.
      rename, layouts: as for :func:`load_torch_state`.
      flax_names: the Flax side's torch-style names (which member of a tied group it has).
    """

    def __init__(self, torch_model: Any, rename: Any = None, layouts: Any = None,
                 flax_names: Sequence[str] = ()):
        state = _state_dict(torch_model)
        self._rename = _renamer(rename)
        self.names = _torch_names(state, rename)
        self.layouts = Layouts(torch_model, self.names, layouts)
        self.tied, self._aliases = _tied(torch_model, self.names, set(flax_names))

    def torch_side(self, values: Mapping[str, Any], flax_names: Sequence[str]) -> dict[str, Any]:
        """``values`` (torch names) renamed, each tied tensor under the name the Flax side uses."""
        out = {}
        for k, v in values.items():
            new = self.names.get(k) or (None if k.rsplit(".", 1)[-1] in _IGNORED_TORCH else self._rename(k))
            if new is not None:
                out[new] = v
        for group in self.tied:
            value = next((out[n] for n in group if n in out), None)
            for n in group:
                out.pop(n, None)
            if value is not None:
                for n in [n for n in group if n in flax_names] or group[:1]:
                    out[n] = value
        return out

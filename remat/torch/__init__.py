"""Cross-framework checks: a Flax NNX model against its PyTorch twin.

Three tools:

* :func:`load_torch_state` copies a ``torch.nn.Module`` (or a state dict) into an NNX
  module, converting layouts; strict by default, naming every offending entry at once.
* :func:`compare_gradients` runs both models on the same inputs and compares outputs,
  parameter gradients, input gradients and (BatchNorm) running statistics, in train and
  eval mode: a :class:`GradientReport`.
* :func:`compare_training` trains both for a few steps with matching optimizers (optax
  against ``torch.optim``) and compares the loss curves and the final weights: a
  :class:`TrainingReport`.

PyTorch is imported only inside these functions; without it they raise ``ImportError``
("remat.crosscheck needs PyTorch: pip install 'remat[torch]'").

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

Tolerances
----------
A tensor passes when ``max|jax - torch| <= atol + rtol * max|torch|`` (a norm-wise test:
entry-wise relative errors are meaningless for entries that are zero up to rounding).

* **float32** (defaults ``rtol=1e-4, atol=1e-6``): XLA and PyTorch's CPU kernels sum
  matmuls and convolutions in different orders (blocked, vectorised, sometimes fused), so
  results differ by a few ulps per operation; through a few layers and the backward pass
  that grows to ~1e-7..1e-6 relative to the largest entry (measured on the built-in
  models, ``remat crosscheck MODEL --json``: 2e-8 to 3e-7, 2e-6 for the BatchNorm CNN);
  deeper or wider models and BatchNorm (which divides by small standard deviations)
  approach 1e-5, hence the margin.
* **float64** (``dtype="float64"``, defaults ``rtol=1e-10, atol=1e-12``): the same
  reordering costs ~1e-16 per operation; measured errors are 2e-16..1e-14 relative. JAX's
  x64 mode is global, so the comparison runs inside ``jax.enable_x64(True)`` on float64
  copies of both models and leaves the rest of the program in float32.
* **training** (:func:`compare_training`): differences compound over steps, and Adam's
  ``m / (sqrt(v) + eps)`` amplifies them for entries whose gradient is ~0, so the
  float32 defaults are looser (``rtol=1e-3, atol=1e-5``; measured ~1e-5 after 5 Adam
  steps, ~1e-6 with SGD); float64 stays tight (``rtol=1e-10, atol=1e-12``; measured
  ~1e-15). A parameter whose gradient is exactly zero in theory (a bias right before a
  train-mode BatchNorm) gets rounding-noise gradients that Adam turns into full steps of
  size ``lr`` in unrelated directions: leave such biases out (``bias=False``).

Optimizers
----------
:func:`compare_training` builds both optimizers from one set of hyperparameters:

| ``optimizer=`` | ``torch.optim`` | optax |
|---|---|---|
| ``"sgd"`` | ``SGD(lr)`` | ``optax.sgd(lr)`` |
| ``"momentum"`` | ``SGD(lr, momentum=mu)`` (dampening 0) | ``optax.sgd(lr, momentum=mu)`` |
| ``"nesterov"`` | ``SGD(lr, momentum=mu, nesterov=True)`` | ``optax.sgd(lr, momentum=mu, nesterov=True)`` |
| ``"adam"`` | ``Adam(lr, betas=(b1, b2), eps=eps)`` | ``optax.adam(lr, b1, b2, eps=eps)`` (``eps_root=0``) |
| ``"adamw"`` | ``AdamW(lr, betas, eps, weight_decay=wd)`` | ``optax.adamw(lr, b1, b2, eps=eps, weight_decay=wd)`` |
| (L2 Adam, by hand) | ``Adam(lr, weight_decay=wd)`` | ``optax.chain(optax.add_decayed_weights(wd), optax.adam(lr))`` |

Why these match (verified numerically by the tests, float64 to ~1e-12):

* SGD momentum: torch keeps ``buf = mu * buf + (1 - dampening) * g`` (``buf = g`` on the
  first step) and steps ``p -= lr * buf``; optax's ``trace`` keeps ``t = g + mu * t``
  from ``t = 0``: the same with ``dampening=0`` (torch's default). Nesterov: both step
  with ``g + mu * buf``. torch's ``dampening > 0`` has no optax counterpart.
* Adam: both step ``lr * m_hat / (sqrt(v_hat) + eps)``, ``eps`` outside the square root
  (optax's ``eps_root``, inside, must stay 0). torch's ``Adam(weight_decay=wd)`` is L2
  (``g += wd * p``): ``optax.chain(optax.add_decayed_weights(wd), optax.adam(...))``.
* AdamW: torch decays ``p *= 1 - lr * wd`` before the Adam step; optax.adamw adds
  ``wd * p`` to the Adam direction and then scales everything by ``-lr``: the same
  ``lr * wd * p``. Mind the defaults: torch ``weight_decay=0.01``, optax ``1e-4``;
  :func:`compare_training` passes ``weight_decay`` to both.

Example:
  >>> from remat.crosscheck import compare_gradients, load_torch_state
  >>> load_torch_state(jax_model, torch_model)                 # doctest: +SKIP
  >>> report = compare_gradients(jax_model, torch_model, (x,))  # doctest: +SKIP
  >>> print(report); assert report.ok                          # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

TORCH_MISSING = "remat.crosscheck needs PyTorch: pip install 'remat[torch]'"

TOLERANCES: dict[str, tuple[float, float]] = {"float32": (1e-4, 1e-6), "float64": (1e-10, 1e-12)}
TRAINING_TOLERANCES: dict[str, tuple[float, float]] = {"float32": (1e-3, 1e-5), "float64": (1e-10, 1e-12)}
OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw")

_LEAF_TO_TORCH = {"kernel": "weight", "scale": "weight", "embedding": "weight"}
_STAT_TO_TORCH = {"mean": "running_mean", "var": "running_var"}
_IGNORED_TORCH = ("num_batches_tracked",)


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ImportError(TORCH_MISSING) from None
    return torch


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


# --- torch checkpoint with a single BatchNorm update -----------------------------------

def torch_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)`` whose
    recomputation leaves BatchNorm running statistics alone.

    PyTorch's recomputation runs BatchNorm's forward a second time, updating its running
    mean and variance (and ``num_batches_tracked``) twice per step; JAX's recomputation is
    a pure function of the saved inputs, so a checkpointed NNX BatchNorm updates once. This
    wrapper restores the buffers after the recomputation, so both frameworks agree.

    Args:
      function: a ``torch.nn.Module`` or a bound method of one.
      *args: its tensor arguments.
      **kwargs: its keyword arguments.

    Returns:
      ``function(*args, **kwargs)``.
    """
    _torch()  # without PyTorch: the ImportError that names the [torch] extra
    import torch.utils.checkpoint  # binds the name torch as well

    owner = function if isinstance(function, torch.nn.Module) else getattr(function, "__self__", None)
    norms = [m for m in owner.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
             and m.track_running_stats] if isinstance(owner, torch.nn.Module) else []
    if not norms:
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    calls = [0]

    def once(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1 or not torch.is_grad_enabled():
            return function(*a, **k)
        saved = [(b, b.clone()) for m in norms for b in m.buffers()]
        try:
            return function(*a, **k)
        finally:
            with torch.no_grad():
                for b, v in saved:
                    b.copy_(v)

    return torch.utils.checkpoint.checkpoint(once, *args, use_reentrant=False, **kwargs)


# --- shared helpers of the comparisons -------------------------------------------------

def _dtype_name(dtype: Any) -> str:
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in TOLERANCES:
        raise ValueError(f"dtype={dtype!r} is not supported; use 'float32' or 'float64'")
    return name


# Checks, not speed: a low LLVM optimisation level compiles these small programs 2-3x
# faster on XLA:CPU and leaves floating-point semantics alone (no fast-math either way).
_CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    options = _CPU_COMPILER_OPTIONS if jax.default_backend() == "cpu" else None
    return jax.jit(fn, compiler_options=options)


def _precision(dtype: str):
    return jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()


def _cast_jax_model(jax_model: nnx.Module, dtype: str) -> nnx.Module:
    """A copy of ``jax_model`` with floating Params and BatchStats cast to ``dtype``."""
    model = nnx.clone(jax_model)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Variable) and hasattr(node, "dtype") and jnp.issubdtype(node.dtype, jnp.floating):
            node.set_value(jnp.asarray(np.asarray(node.get_value()), dtype=dtype))
        elif isinstance(node, nnx.Module) and _is_float_dtype(getattr(node, "dtype", None)):
            node.dtype = jnp.dtype(dtype)  # e.g. nnx.Embed fixes its compute dtype at init
    return model


def _is_float_dtype(dtype: Any) -> bool:
    try:
        return dtype is not None and jnp.issubdtype(dtype, jnp.floating)
    except TypeError:
        return False


def _cast_torch_model(torch_model: Any, dtype: str) -> Any:
    torch = _torch()
    return copy.deepcopy(torch_model).to(torch.float64 if dtype == "float64" else torch.float32)


def _has_mode_layers(torch_model: Any) -> bool:
    torch = _torch()
    kinds = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.modules.dropout._DropoutNd)
    return any(isinstance(m, kinds) for m in torch_model.modules())


def _modes(mode: str | Sequence[str] | None, torch_model: Any) -> tuple[str, ...]:
    if mode is None:
        return ("train", "eval") if _has_mode_layers(torch_model) else ("train",)
    modes = (mode,) if isinstance(mode, str) else tuple(mode)
    for m in modes:
        if m not in ("train", "eval"):
            raise ValueError(f"mode={m!r}: use 'train', 'eval' or both")
    return modes


def _set_mode(jax_model: nnx.Module, torch_model: Any, mode: str) -> None:
    if mode == "train":
        jax_model.train()
        torch_model.train()
    else:
        jax_model.eval()
        torch_model.eval()


def _channels_last(jax_model: nnx.Module, layout: str | None) -> bool:
    if layout is None or layout == "auto":
        layout = getattr(jax_model, "input_layout", None)
        if layout is None:
            return any(isinstance(n, nnx.Conv) for _, n in nnx.iter_graph(jax_model))
    if layout in ("NHWC", "NWC", "NDHWC", "channels_last"):
        return True
    if layout in ("NCHW", "NCW", "NCDHW", "same", "channels_first"):
        return False
    raise ValueError(f"layout={layout!r}: use 'auto', 'channels_last' (NHWC) or 'same'")


def _is_float(a: np.ndarray) -> bool:
    return np.issubdtype(a.dtype, np.floating)


def _to_jax_layout(a: np.ndarray, channels_last: bool) -> np.ndarray:
    return np.moveaxis(a, 1, -1) if channels_last and a.ndim >= 3 else a


def _from_jax_layout(a: np.ndarray, channels_last: bool) -> np.ndarray:
    return np.moveaxis(a, -1, 1) if channels_last and a.ndim >= 3 else a


def _inputs(inputs: Any) -> tuple[np.ndarray, ...]:
    if isinstance(inputs, (np.ndarray, jax.Array)) or hasattr(inputs, "detach"):
        inputs = (inputs,)
    return tuple(_to_numpy(a) for a in inputs)


def _leaves(out: Any) -> list[Any]:
    if isinstance(out, (tuple, list)):
        return [leaf for o in out for leaf in _leaves(o)]
    if isinstance(out, Mapping):
        return [leaf for k in sorted(out) for leaf in _leaves(out[k])]
    return [out]


def _default_loss(out: Any) -> Any:
    total = 0
    for leaf in _leaves(out):
        total = total + leaf.sum()
    return total


def _loss_pair(loss: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    if loss is None:
        return _default_loss, _default_loss
    if isinstance(loss, tuple) and len(loss) == 2 and all(map(callable, loss)):
        return loss
    if callable(loss):
        return loss, loss
    raise TypeError("loss must be a function of the outputs (working on jax and torch arrays) "
                    "or a pair (jax_loss, torch_loss)")


def _wrap_jax(jax_model: nnx.Module, checkpoint: Any) -> Callable[..., Any]:
    if checkpoint is False or checkpoint is None:
        return lambda m, *xs: m(*xs)
    import remat

    policy = None if checkpoint is True else checkpoint
    return lambda m, *xs: remat.checkpoint(m, *xs, policy=policy)


def _call_torch(torch_model: Any, xs: list[Any], checkpoint: Any) -> Any:
    if checkpoint is False or checkpoint is None or checkpoint == "everything":
        return torch_model(*xs)
    return torch_checkpoint(torch_model, *xs)


def _errors(jax_value: np.ndarray, torch_value: np.ndarray) -> tuple[float, float, float]:
    """(max abs error, max abs error / max|torch|, max|torch|)."""
    a = np.asarray(jax_value, dtype=np.float64)
    b = np.asarray(torch_value, dtype=np.float64)
    if a.shape != b.shape:
        return math.inf, math.inf, float(np.max(np.abs(b))) if b.size else 0.0
    if a.size == 0:
        return 0.0, 0.0, 0.0
    diff = np.abs(a - b)
    if not np.all(np.isfinite(a) == np.isfinite(b)):
        return math.inf, math.inf, float(np.nanmax(np.abs(b[np.isfinite(b)]), initial=0.0))
    diff = np.where(np.isfinite(b), diff, 0.0)
    scale = float(np.max(np.abs(np.where(np.isfinite(b), b, 0.0))))
    max_abs = float(np.max(diff))
    return max_abs, max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf), scale


@dataclass(frozen=True)
class Row:
    """One compared tensor: its kind, name, shape, errors and verdict."""

    mode: str
    kind: str  # "weight" (before), "output", "param" (gradient), "input", "buffer", "loss"
    name: str
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    ok: bool

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "kind": self.kind, "name": self.name, "shape": list(self.shape),
                "max_abs_err": self.max_abs, "max_rel_err": self.max_rel, "ok": self.ok}


def _row(mode: str, kind: str, name: str, jax_value: Any, torch_value: Any, rtol: float, atol: float) -> Row:
    a, b = np.asarray(jax_value), np.asarray(torch_value)
    max_abs, max_rel, scale = _errors(a, b)
    ok = a.shape == b.shape and max_abs <= atol + rtol * scale
    return Row(mode, kind, name, tuple(b.shape), max_abs, max_rel, bool(ok))


def _format_rows(rows: list[Row]) -> list[str]:
    header = ("mode", "kind", "name", "shape", "max abs err", "max rel err", "ok")
    cells = [(r.mode, r.kind, r.name, "x".join(map(str, r.shape)) or "scalar", f"{r.max_abs:.2e}",
              f"{r.max_rel:.2e}", "ok" if r.ok else "FAIL") for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths)) for cell in cells]
    return lines


def _tolerances(table: dict[str, tuple[float, float]], dtype: str, rtol: float | None,
                atol: float | None) -> tuple[float, float]:
    default_rtol, default_atol = table[dtype]
    return (default_rtol if rtol is None else rtol), (default_atol if atol is None else atol)


def _torch_tensors(xs: tuple[np.ndarray, ...], dtype: str, requires_grad: bool) -> list[Any]:
    torch = _torch()
    tdtype = torch.float64 if dtype == "float64" else torch.float32
    out = []
    for a in xs:
        if _is_float(a):
            out.append(torch.tensor(a, dtype=tdtype, requires_grad=requires_grad))
        else:
            out.append(torch.from_numpy(np.ascontiguousarray(a)))
    return out


def _jax_arrays(xs: tuple[np.ndarray, ...], dtype: str, channels_last: bool) -> list[jax.Array]:
    return [jnp.asarray(_to_jax_layout(a, channels_last), dtype=dtype) if _is_float(a) else jnp.asarray(a)
            for a in xs]


def _param_rows(mode: str, kind: str, jax_vars: dict[str, tuple[tuple, Any]], torch_values: Mapping[str, Any],
                rtol: float, atol: float, rename: Any = None) -> list[Row]:
    rename_fn = _renamer(rename)
    torch_values = {new: v for k, v in torch_values.items()
                    if k.rsplit(".", 1)[-1] not in _IGNORED_TORCH and (new := rename_fn(k)) is not None}
    rows = []
    for name in sorted(set(jax_vars) | set(torch_values)):
        if name not in torch_values or name not in jax_vars:
            missing_in = "torch" if name not in torch_values else "jax"
            rows.append(Row(mode, kind, f"{name} (no {missing_in} counterpart)", (), math.inf, math.inf, False))
            continue
        path, value = jax_vars[name]
        jax_value = to_torch_layout(str(path[-1]), np.asarray(value))
        rows.append(_row(mode, kind, name, jax_value, _to_numpy(torch_values[name]), rtol, atol))
    return rows


def _buffers(torch_model: Any) -> dict[str, Any]:
    return {k: v for k, v in torch_model.state_dict().items()
            if k.rsplit(".", 1)[-1] in ("running_mean", "running_var")}


def _jax_buffers(model: nnx.Module) -> dict[str, tuple[tuple, Any]]:
    return {n: (p, v.get_value()) for n, (p, v) in _variables(model).items() if isinstance(v, nnx.BatchStat)}


# --- gradients -------------------------------------------------------------------------

class _RowsVerdict:
    """``ok``, ``failures`` and ``max_rel`` of a report made of :class:`Row` s."""

    rows: list[Row]

    @property
    def ok(self) -> bool:
        """True when every row is within tolerance."""
        return all(r.ok for r in self.rows)

    @property
    def failures(self) -> list[Row]:
        """The rows out of tolerance."""
        return [r for r in self.rows if not r.ok]

    @property
    def max_rel(self) -> float:
        """The largest relative error over all rows."""
        return max((r.max_rel for r in self.rows), default=0.0)


@dataclass
class GradientReport(_RowsVerdict):
    """Per-tensor comparison of a JAX model against its PyTorch twin.

    Attributes:
      rows: one :class:`Row` per starting weight (mode ``"init"``, kind ``"weight"``), and
        per mode one per output, parameter gradient, input gradient and running statistic.
      dtype: ``"float32"`` or ``"float64"``.
      rtol, atol: the tolerances used.
    """

    rows: list[Row]
    dtype: str
    rtol: float
    atol: float

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: ``ok``, ``dtype``, tolerances, ``max_rel_err`` and ``rows``."""
        return {"ok": self.ok, "dtype": self.dtype, "rtol": self.rtol, "atol": self.atol,
                "max_rel_err": self.max_rel, "rows": [r.to_dict() for r in self.rows]}

    def to_json(self) -> str:
        """:meth:`to_dict` as a JSON string."""
        return json.dumps(self.to_dict())

    def __str__(self) -> str:
        verdict = "ok" if self.ok else f"FAILED ({len(self.failures)} out of tolerance)"
        title = (f"gradient check, {self.dtype}, pass when max abs err <= {self.atol:g} + "
                 f"{self.rtol:g} * max|torch|: {verdict}")
        return "\n".join([title, *_format_rows(self.rows)])


def _jax_value_and_grad(call: Callable[..., Any], jax_loss: Callable[[Any], Any], graphdef: Any,
                        argnums: tuple[int, ...]) -> Callable[..., Any]:
    """The jitted ``(state, *inputs) -> (outputs, gradients, new state)`` of one JAX step."""

    def f(model, *args):
        out = call(model, *args)
        return jax_loss(out), out

    @_jit
    def value_and_grad(state, *args):
        model = nnx.merge(graphdef, state)
        (_, out), grads = nnx.value_and_grad(f, argnums=argnums, has_aux=True)(model, *args)
        return out, grads, nnx.state(model)

    return value_and_grad


def compare_gradients(
    jax_model: nnx.Module,
    torch_model: Any,
    inputs: Any,
    *,
    loss: Any = None,
    rtol: float | None = None,
    atol: float | None = None,
    dtype: str = "float32",
    mode: str | Sequence[str] | None = None,
    layout: str | None = None,
    checkpoint: Any = False,
    rename: Mapping[str, str] | Callable[[str], str | None] | None = None,
) -> GradientReport:
    """Compares outputs and gradients of a JAX model and its PyTorch twin on the same inputs.

    Works on copies: neither model (nor its BatchNorm statistics) is changed.

    Args:
      jax_model: an NNX module; load the twin's weights first (:func:`load_torch_state`).
      torch_model: the ``torch.nn.Module``.
      inputs: an array or a tuple of NumPy arrays in PyTorch's layout. Floating inputs get
        gradients (compared too); integer inputs (token ids) pass as they are.
      loss: a function of the outputs that works on both jax and torch arrays, or a pair
        ``(jax_loss, torch_loss)``; default: the sum of all outputs.
      rtol, atol: a tensor passes when ``max|jax - torch| <= atol + rtol * max|torch|``;
        defaults from :data:`TOLERANCES` for ``dtype``.
      dtype: ``"float32"`` or ``"float64"`` (both models are copied and cast; JAX runs
        inside ``jax.enable_x64(True)``).
      mode: ``"train"``, ``"eval"`` or both; default both when the torch model has
        BatchNorm or Dropout, else ``"train"``. Dropout cannot match across frameworks in
        train mode (different random streams): compare such models in ``"eval"``.
      layout: ``"auto"`` (default: the model's ``input_layout`` attribute, else
        channels-last when it contains an ``nnx.Conv``), ``"channels_last"`` (floating
        inputs of 3+ dims are transposed NCHW -> NHWC for JAX) or ``"same"``.
      checkpoint: ``False`` (default) runs the models as they are; ``True`` or a policy
        (``"dots"``, a list of names, ...) wraps the whole JAX call in
        :func:`remat.checkpoint` and the torch call in ``torch.utils.checkpoint``.
      rename: the ``rename=`` given to :func:`load_torch_state`, when the names differ.

    Returns:
      A :class:`GradientReport`; ``report.ok``, ``print(report)``, ``report.to_json()``.

    Example:
      >>> report = compare_gradients(jax_model, torch_model, (x,), dtype="float64")  # doctest: +SKIP
    """
    torch = _torch()
    dtype = _dtype_name(dtype)
    rtol, atol = _tolerances(TOLERANCES, dtype, rtol, atol)
    xs = _inputs(inputs)
    jax_loss, torch_loss = _loss_pair(loss)
    channels_last = _channels_last(jax_model, layout)
    float_idx = [i for i, a in enumerate(xs) if _is_float(a)]
    rows: list[Row] = []
    with _precision(dtype):  # the starting weights themselves: a bad conversion shows here first
        start = {n: (p, v.get_value()) for n, (p, v) in _variables(_cast_jax_model(jax_model, dtype)).items()}
        rows += _param_rows("init", "weight", start, _cast_torch_model(torch_model, dtype).state_dict(), rtol, atol,
                           rename)
    for m in _modes(mode, torch_model):
        with _precision(dtype):
            jm = _cast_jax_model(jax_model, dtype)
            tm = _cast_torch_model(torch_model, dtype)
            _set_mode(jm, tm, m)
            # PyTorch
            txs = _torch_tensors(xs, dtype, requires_grad=True)
            t_out = _call_torch(tm, txs, checkpoint)
            torch_loss(t_out).backward()
            t_grads = {n: p.grad if p.grad is not None else torch.zeros_like(p)
                       for n, p in tm.named_parameters()}
            # JAX
            jxs = _jax_arrays(xs, dtype, channels_last)
            argnums = (0, *(i + 1 for i in float_idx))
            graphdef, state = nnx.split(jm)
            value_and_grad = _jax_value_and_grad(_wrap_jax(jm, checkpoint), jax_loss, graphdef, argnums)
            j_out, grads, state = value_and_grad(state, *jxs)
            nnx.update(jm, state)  # the BatchNorm statistics of the train-mode step
            # outputs
            t_leaves = [_to_numpy(o) for o in _leaves(t_out)]
            j_leaves = [_from_jax_layout(np.asarray(o), channels_last) for o in _leaves(j_out)]
            for k, (a, b) in enumerate(zip(j_leaves, t_leaves)):
                rows.append(_row(m, "output", f"output[{k}]" if len(t_leaves) > 1 else "output", a, b, rtol, atol))
            if len(j_leaves) != len(t_leaves):
                rows.append(Row(m, "output", f"outputs: jax {len(j_leaves)}, torch {len(t_leaves)}", (),
                                math.inf, math.inf, False))
            # parameter gradients
            names = {n: (p, None) for n, (p, _) in _variables(jm).items()}
            flat = {tuple(p): v for p, v in nnx.to_flat_state(grads[0])}
            jax_grads = {n: (p, np.asarray(flat[p][...] if isinstance(flat[p], nnx.Variable) else flat[p]))
                         for n, (p, _) in names.items() if p in flat}
            rows += _param_rows(m, "param", jax_grads, t_grads, rtol, atol, rename)
            # input gradients
            for k, i in enumerate(float_idx):
                t_g = txs[i].grad
                t_g = np.zeros(xs[i].shape) if t_g is None else _to_numpy(t_g)
                j_g = _from_jax_layout(np.asarray(grads[k + 1]), channels_last)
                rows.append(_row(m, "input", f"input[{i}]", j_g, t_g, rtol, atol))
            # running statistics after the step
            if m == "train":
                rows += _param_rows(m, "buffer", _jax_buffers(jm), _buffers(tm), rtol, atol, rename)
    return GradientReport(rows, dtype, rtol, atol)


# --- training --------------------------------------------------------------------------

def make_optimizers(
    name: str, torch_params: Any, *, lr: float, momentum: float = 0.9, betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8, weight_decay: float = 0.01,
) -> tuple[Any, Any]:
    """The matching ``(optax transformation, torch.optim optimizer)`` for ``name``.

    Args:
      name: one of :data:`OPTIMIZERS` (see the table in the module docstring).
      torch_params: the torch parameters to optimize.
      lr, momentum, betas, eps, weight_decay: hyperparameters, passed to both (momentum for
        ``"momentum"``/``"nesterov"``, betas/eps for Adam(W), weight_decay for AdamW).

    Returns:
      ``(optax.GradientTransformation, torch.optim.Optimizer)``.
    """
    import optax

    torch = _torch()
    b1, b2 = betas
    if name == "sgd":
        return optax.sgd(lr), torch.optim.SGD(torch_params, lr=lr)
    if name in ("momentum", "nesterov"):
        nesterov = name == "nesterov"
        return (optax.sgd(lr, momentum=momentum, nesterov=nesterov),
                torch.optim.SGD(torch_params, lr=lr, momentum=momentum, nesterov=nesterov))
    if name == "adam":
        return optax.adam(lr, b1=b1, b2=b2, eps=eps), torch.optim.Adam(torch_params, lr=lr, betas=betas, eps=eps)
    if name == "adamw":
        return (optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay),
                torch.optim.AdamW(torch_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
    raise ValueError(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZERS)}")


def _training_losses(targets: np.ndarray | None) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(jax_loss(out, y), torch_loss(out, y))``: cross-entropy for integer targets, MSE for
    float targets, ``mean(out ** 2)`` without targets."""
    import optax

    torch = _torch()
    if targets is None:
        return (lambda out, y: jnp.mean(jnp.square(out)), lambda out, y: (out ** 2).mean())
    if np.issubdtype(targets.dtype, np.integer):
        def jax_ce(out, y):
            return optax.softmax_cross_entropy_with_integer_labels(out.reshape(-1, out.shape[-1]), y.reshape(-1)).mean()

        def torch_ce(out, y):
            return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

        return jax_ce, torch_ce
    return (lambda out, y: jnp.mean(jnp.square(out - y)), lambda out, y: torch.nn.functional.mse_loss(out, y))


@dataclass
class TrainingReport(_RowsVerdict):
    """Loss curves and final weights of a JAX model and its PyTorch twin after training.

    Attributes:
      optimizer: the optimizer name.
      steps: the number of steps.
      jax_losses, torch_losses: the loss before each step.
      rows: final-weight (and running-statistic) comparisons, plus one ``loss`` row.
      dtype, rtol, atol: as in :class:`GradientReport`.
    """

    optimizer: str
    steps: int
    mode: str
    jax_losses: list[float]
    torch_losses: list[float]
    rows: list[Row]
    dtype: str
    rtol: float
    atol: float

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "optimizer": self.optimizer, "steps": self.steps, "mode": self.mode,
                "dtype": self.dtype, "rtol": self.rtol, "atol": self.atol, "max_rel_err": self.max_rel,
                "jax_losses": self.jax_losses, "torch_losses": self.torch_losses,
                "rows": [r.to_dict() for r in self.rows]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def __str__(self) -> str:
        verdict = "ok" if self.ok else f"FAILED ({len(self.failures)} out of tolerance)"
        lines = [f"training check, {self.optimizer}, {self.steps} steps, {self.mode} mode, {self.dtype}: {verdict}",
                 "step  jax loss          torch loss"]
        lines += [f"{i:<4}  {a:<16.10g}  {b:.10g}" for i, (a, b) in enumerate(zip(self.jax_losses, self.torch_losses))]
        return "\n".join(lines + _format_rows(self.rows))


def compare_training(
    jax_model: nnx.Module,
    torch_model: Any,
    inputs: Any,
    targets: Any = None,
    *,
    optimizer: str = "adamw",
    lr: float = 1e-2,
    steps: int = 5,
    momentum: float = 0.9,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    loss: Any = None,
    dtype: str = "float32",
    mode: str = "train",
    layout: str | None = None,
    checkpoint: Any = False,
    rename: Mapping[str, str] | Callable[[str], str | None] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
) -> TrainingReport:
    """Trains copies of both models on the same batch and compares losses and final weights.

    Each step: forward on ``inputs``, loss against ``targets``, backward, one optimizer
    step (optax in JAX, ``torch.optim`` in PyTorch, mapped as in the module docstring).

    Args:
      jax_model, torch_model: the models, with identical weights.
      inputs: NumPy arrays in PyTorch's layout (as for :func:`compare_gradients`).
      targets: integer labels (cross-entropy over the last output axis), float targets
        (mean squared error) or ``None`` (minimise ``mean(out ** 2)``).
      optimizer: one of :data:`OPTIMIZERS`.
      lr, momentum, betas, eps, weight_decay: hyperparameters given to both optimizers.
      steps: number of optimizer steps.
      loss: a pair ``(jax_loss(out, y), torch_loss(out, y))`` replacing the default.
      dtype: ``"float32"`` or ``"float64"``.
      mode: ``"train"`` (BatchNorm on batch statistics, running statistics updated and
        compared) or ``"eval"`` (running statistics fixed).
      layout, checkpoint, rename: as for :func:`compare_gradients`.
      rtol, atol: defaults from :data:`TRAINING_TOLERANCES`.

    Returns:
      A :class:`TrainingReport`.

    Example:
      >>> r = compare_training(jm, tm, (x,), y, optimizer="adam", steps=5)  # doctest: +SKIP
    """
    _torch()  # fail early, with the install hint, when PyTorch is missing
    dtype = _dtype_name(dtype)
    rtol, atol = _tolerances(TRAINING_TOLERANCES, dtype, rtol, atol)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} must be a positive int")
    (mode,) = _modes(mode, torch_model)
    xs = _inputs(inputs)
    y = None if targets is None else _to_numpy(targets)
    if loss is None:
        jax_loss, torch_loss = _training_losses(y)
    elif isinstance(loss, tuple) and len(loss) == 2:
        jax_loss, torch_loss = loss
    else:
        raise TypeError("loss must be a pair (jax_loss(out, y), torch_loss(out, y))")
    channels_last = _channels_last(jax_model, layout)
    with _precision(dtype):
        jm = _cast_jax_model(jax_model, dtype)
        tm = _cast_torch_model(torch_model, dtype)
        _set_mode(jm, tm, mode)
        tx, topt = make_optimizers(optimizer, tm.parameters(), lr=lr, momentum=momentum, betas=betas,
                                   eps=eps, weight_decay=weight_decay)
        # PyTorch
        txs = _torch_tensors(xs, dtype, requires_grad=False)
        ty = None if y is None else _torch_tensors((y,), dtype, requires_grad=False)[0]
        torch_losses = []
        for _ in range(steps):
            topt.zero_grad()
            value = torch_loss(_call_torch(tm, txs, checkpoint), ty)
            value.backward()
            topt.step()
            torch_losses.append(float(value.detach()))
        # JAX
        jxs = _jax_arrays(xs, dtype, channels_last)
        jy = None if y is None else (jnp.asarray(y) if not _is_float(y) else jnp.asarray(y, dtype=dtype))
        opt = nnx.Optimizer(jm, tx, wrt=nnx.Param)
        call = _wrap_jax(jm, checkpoint)
        graphdef, state = nnx.split((jm, opt))

        @_jit
        def step(state, xs, y):
            model, opt = nnx.merge(graphdef, state)
            value, grads = nnx.value_and_grad(lambda m: jax_loss(call(m, *xs), y))(model)
            opt.update(model, grads)
            return value, nnx.state((model, opt))

        jax_losses = []
        for _ in range(steps):
            value, state = step(state, jxs, jy)
            jax_losses.append(float(value))
        nnx.update((jm, opt), state)
        rows = [_row(mode, "loss", "loss curve", np.array(jax_losses), np.array(torch_losses), rtol, atol)]
        jax_params = {n: (p, v.get_value()) for n, (p, v) in _variables(jm).items() if isinstance(v, nnx.Param)}
        rows += _param_rows(mode, "param", jax_params, dict(tm.named_parameters()), rtol, atol, rename)
        if mode == "train":
            rows += _param_rows(mode, "buffer", _jax_buffers(jm), _buffers(tm), rtol, atol, rename)
    return TrainingReport(optimizer, steps, mode, jax_losses, torch_losses, rows, dtype, rtol, atol)


__all__ = [
    "GradientReport",
    "LoadReport",
    "OPTIMIZERS",
    "Row",
    "StateDictMismatchError",
    "TOLERANCES",
    "TORCH_MISSING",
    "TRAINING_TOLERANCES",
    "TrainingReport",
    "compare_gradients",
    "compare_training",
    "load_torch_state",
    "make_optimizers",
    "to_nnx_layout",
    "to_torch_layout",
    "torch_checkpoint",
    "torch_names",
]

"""What both comparisons share: dtypes, train/eval modes, input layouts, the models' copies and calls."""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from remat.crosscheck.checkpoint import torch_checkpoint
from remat.crosscheck.layouts import torch_name
from remat.crosscheck.lazy import _torch
from remat.crosscheck.outputs import Select, select
from remat.crosscheck.report import TOLERANCES
from remat.crosscheck.weights import _to_numpy, _variables


def _check_loaded(model: nnx.Module, where: str) -> None:
    """One error naming every variable that holds no value (an ``nnx.eval_shape`` model loaded
    with ``strict=False``), before anything runs."""
    names = {tuple(p): n for n, (p, _) in _variables(model).items()}
    strip = getattr(model, "_crosscheck_strip", 0)
    abstract = [names.get(tuple(path), "/".join(map(str, path[strip:]))) for path, node in nnx.iter_graph(model)
                if isinstance(node, nnx.Variable) and isinstance(node.get_value(), jax.ShapeDtypeStruct)]
    if abstract:
        raise ValueError(
            f"{where}: variables never loaded (abstract, as nnx.eval_shape leaves them): "
            f"{', '.join(sorted(abstract))}; "
            "load them (load_torch_state(..., strict=True) names what the torch state lacks) or build the model "
            "with real values")


def _dtype_name(dtype: Any) -> str:
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in TOLERANCES:
        raise ValueError(f"dtype={dtype!r} is not supported; use 'float32' or 'float64'")
    return name


# Checks, not speed: a low LLVM optimisation level compiles these small programs faster on
# XLA:CPU and leaves floating-point semantics alone (no fast-math either way).
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
            module: Any = node  # any module with a compute dtype field
            module.dtype = jnp.dtype(dtype)  # e.g. nnx.Embed fixes its compute dtype at init
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


def _wrap_jax(jax_model: nnx.Module, checkpoint: Any, output: Select = None) -> Callable[..., Any]:
    """``(model, *inputs) -> selected output``, the whole call under :func:`remat.checkpoint` if asked."""
    if checkpoint is False or checkpoint is None:
        return lambda m, *xs: select(output, m(*xs))
    import remat

    policy = None if checkpoint is True else checkpoint
    return lambda m, *xs: select(output, remat.checkpoint(m, *xs, policy=policy))


def _call_torch(torch_model: Any, xs: list[Any], checkpoint: Any) -> Any:
    if checkpoint is False or checkpoint is None or checkpoint == "everything":
        return torch_model(*xs)
    return torch_checkpoint(torch_model, *xs)


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


def _buffers(torch_model: Any) -> dict[str, Any]:
    return {torch_name(k): v for k, v in torch_model.state_dict().items()
            if k.rsplit(".", 1)[-1] in ("running_mean", "running_var")}


def _jax_buffers(model: nnx.Module) -> dict[str, tuple[tuple, Any]]:
    return {n: (p, v.get_value()) for n, (p, v) in _variables(model).items() if isinstance(v, nnx.BatchStat)}


def jax_value_and_grad(call: Callable[..., Any], jax_loss: Callable[[Any], Any], graphdef: Any,
                       argnums: tuple[int, ...], jit: Callable[..., Any] = _jit) -> Callable[..., Any]:
    """The jitted ``(state, *inputs) -> (outputs, gradients, new state)`` of one JAX step.

    ``jit``: how it compiles (the low-precision runs pass theirs, which keeps XLA from
    rounding in excess precision).
    """

    def f(model, *args):
        out = call(model, *args)
        return jax_loss(out), out

    @jit
    def value_and_grad(state, *args):
        model = nnx.merge(graphdef, state)
        (_, out), grads = nnx.value_and_grad(f, argnums=argnums, has_aux=True)(model, *args)
        return out, grads, nnx.state(model)

    return value_and_grad

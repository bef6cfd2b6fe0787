"""Outputs and gradients of a JAX model against its PyTorch twin: :func:`compare_gradients`."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from flax import nnx

from remat.torch.harness import (
    _buffers,
    _call_torch,
    _cast_jax_model,
    _cast_torch_model,
    _channels_last,
    _dtype_name,
    _from_jax_layout,
    _inputs,
    _is_float,
    _jax_arrays,
    _jax_buffers,
    _jit,
    _modes,
    _precision,
    _set_mode,
    _torch_tensors,
    _wrap_jax,
)
from remat.torch.lazy import _torch
from remat.torch.report import TOLERANCES, GradientReport, Row, _param_rows, _row, _tolerances
from remat.torch.weights import _to_numpy, _variables


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

"""Outputs and gradients of a JAX model against its PyTorch twin: :func:`compare_gradients`."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from remat.crosscheck.harness import (
    _buffers,
    _call_torch,
    _cast_jax_model,
    _cast_torch_model,
    _channels_last,
    _check_loaded,
    _dtype_name,
    _from_jax_layout,
    _inputs,
    _is_float,
    _jax_arrays,
    _jax_buffers,
    _modes,
    _precision,
    _set_mode,
    _torch_tensors,
    _wrap_jax,
    jax_value_and_grad,
)
from remat.crosscheck.layouts import torch_name
from remat.crosscheck.lazy import _torch
from remat.crosscheck.outputs import jax_sum, select, selectors, torch_arrays, torch_sum
from remat.crosscheck.precision import PrecisionReport
from remat.crosscheck.precision_runs import precision_gradients, resolve_precision
from remat.crosscheck.pytrees import as_nnx
from remat.crosscheck.report import TOLERANCES, GradientReport, Row, _param_rows, _row, _tolerances
from remat.crosscheck.weights import TorchNaming, _state_dict, _to_numpy, _variables


def _loss_pair(loss: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    if loss is None:
        return jax_sum, torch_sum
    if isinstance(loss, tuple) and len(loss) == 2 and all(map(callable, loss)):
        return loss
    if callable(loss):
        return loss, loss
    raise TypeError("loss must be a function of the outputs (working on jax and torch arrays) "
                    "or a pair (jax_loss, torch_loss)")


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
    output: Any = None,
    layouts: Mapping[str, str] | Callable[[str], str | None] | None = None,
    precision: str | None = None,
) -> GradientReport | PrecisionReport:
    """Compares outputs and gradients of a JAX model and its PyTorch twin on the same inputs.

    Works on copies: neither model (nor its BatchNorm statistics) is changed.

    Args:
      jax_model: an NNX module; or ``(linen_module, variables)`` or ``(apply_fn, params)``
        (:func:`~remat.crosscheck.pytrees.as_nnx`; call it yourself to give Linen train/eval
        keyword arguments). Load the twin's weights first (:func:`load_torch_state`);
        variables that hold no value (``nnx.eval_shape``) raise one ``ValueError`` naming them.
      torch_model: the ``torch.nn.Module``, HF ``transformers`` models as they come.
      inputs: an array or a tuple of NumPy arrays in PyTorch's layout. Floating inputs get
        gradients (compared too); integer inputs (token ids) pass as they are.
      loss: a function of the (selected) outputs that works on both jax and torch arrays,
        or a pair ``(jax_loss, torch_loss)``; default: the sum of every floating array leaf.
      rtol, atol: a tensor passes when ``max|jax - torch| <= atol + rtol * max|torch|``;
        defaults from :data:`TOLERANCES` for ``dtype``.
      dtype: ``"float32"`` or ``"float64"`` (both models are copied and cast; JAX runs
        inside ``jax.enable_x64(True)``); ``"bfloat16"``: everything in bfloat16, judged
        against a float64 reference (``precision=``).
      mode: ``"train"``, ``"eval"`` or both; default both when the torch model has
        BatchNorm or Dropout, else ``"train"``. Dropout cannot match across frameworks in
        train mode (different random streams): compare such models in ``"eval"``.
      layout: ``"auto"`` (default: the model's ``input_layout`` attribute, else
        channels-last when it contains an ``nnx.Conv``), ``"channels_last"`` (floating
        inputs of 3+ dims are transposed NCHW -> NHWC for JAX) or ``"same"``.
      checkpoint: ``False`` (default) runs the models as they are; ``True`` or a policy
        (``"dots"``, a list of names, ...) wraps the whole JAX call in
        :func:`remat.checkpoint` and the torch call in ``torch.utils.checkpoint``.
        Checkpointing per block instead (the JAX blocks under :func:`remat.checkpoint`, the
        torch blocks under a checkpoint inside the torch model's ``forward``), use
        :func:`torch_checkpoint` in the torch model (``x = torch_checkpoint(block, x)``)
        rather than ``torch.utils.checkpoint.checkpoint``: torch's recomputation runs a
        block's BatchNorm forward again and updates its running statistics twice per step,
        while JAX's recomputation is pure; ``torch_checkpoint`` restores them after the
        recomputation, so the ``buffer`` rows agree.
      rename: the ``rename=`` given to :func:`load_torch_state`, when the names differ.
      output: what to compare: a function of a model's output (``lambda o: o.logits``),
        applied to each side whose output is a container (a single array is taken as it
        is), or a pair ``(jax_select, torch_select)``; see :mod:`remat.crosscheck.outputs`.
        Without it, every array leaf is compared and the others (a ``DynamicCache``) are
        named in ``report.skipped``.
      layouts: per-tensor layout override, as for :func:`load_torch_state` (by default
        each kernel takes its torch owner's layout: ``nn.Linear``, HF ``Conv1D``, convs).
      precision: ``"bfloat16"`` (the same as ``dtype="bfloat16"``) or ``"mixed"``
        (bfloat16 compute on float32 parameters: ``torch.autocast`` against Flax's
        ``dtype=bf16, param_dtype=float32``, :mod:`remat.crosscheck.autocast`). Both
        runs are measured against the twin in float64 and a tensor passes when
        ``err_jax <= 2 * max(err_torch, eps)`` (:mod:`remat.crosscheck.precision`);
        ``rtol``/``atol`` do not apply.

    Returns:
      A :class:`GradientReport` (a :class:`~remat.crosscheck.precision.PrecisionReport` for
      ``bfloat16``/``mixed``); ``report.ok``, ``print(report)``, ``report.to_json()``;
      tensors that share storage (tied embeddings) appear once and are listed in
      ``report.tied``.

    Example:
      >>> report = compare_gradients(jax_model, torch_model, (x,), dtype="float64")  # doctest: +SKIP
    """
    torch = _torch()
    jax_model = as_nnx(jax_model)
    _check_loaded(jax_model, "compare_gradients")
    low = resolve_precision(dtype, precision)
    xs = _inputs(inputs)
    jax_loss, torch_loss = _loss_pair(loss)
    jax_select, torch_select = selectors(output)
    channels_last = _channels_last(jax_model, layout)
    naming = TorchNaming(torch_model, rename, layouts, list(_variables(jax_model)))
    if low is not None:
        return precision_gradients(jax_model, torch_model, xs, precision=low, modes=_modes(mode, torch_model),
                                   checkpoint=checkpoint, losses=(jax_loss, torch_loss),
                                   selectors=(jax_select, torch_select), channels_last=channels_last, naming=naming)
    dtype = _dtype_name(dtype)
    rtol, atol = _tolerances(TOLERANCES, dtype, rtol, atol)
    float_idx = [i for i, a in enumerate(xs) if _is_float(a)]
    rows: list[Row] = []
    skipped: list[str] = []
    with _precision(dtype):  # the starting weights themselves: a bad conversion shows here first
        start = {n: (p, v.get_value()) for n, (p, v) in _variables(_cast_jax_model(jax_model, dtype)).items()}
        rows += _param_rows("init", "weight", start, _state_dict(_cast_torch_model(torch_model, dtype)), rtol, atol,
                            naming)
    for m in _modes(mode, torch_model):
        with _precision(dtype):
            jm = _cast_jax_model(jax_model, dtype)
            tm = _cast_torch_model(torch_model, dtype)
            _set_mode(jm, tm, m)
            # PyTorch
            txs = _torch_tensors(xs, dtype, requires_grad=True)
            t_out = select(torch_select, _call_torch(tm, txs, checkpoint))
            torch_loss(t_out).backward()
            t_grads = {torch_name(n): p.grad if p.grad is not None else torch.zeros_like(p)
                       for n, p in tm.named_parameters()}
            # JAX
            jxs = _jax_arrays(xs, dtype, channels_last)
            argnums = (0, *(i + 1 for i in float_idx))
            graphdef, state = nnx.split(jm)
            value_and_grad = jax_value_and_grad(_wrap_jax(jm, checkpoint, jax_select), jax_loss, graphdef, argnums)
            j_out, grads, state = value_and_grad(state, *jxs)
            nnx.update(jm, state)  # the BatchNorm statistics of the train-mode step
            # outputs: array leaves in order, named as torch's; the others skipped and named
            t_arrays, t_skipped = torch_arrays(t_out)
            skipped += t_skipped
            j_leaves = [_from_jax_layout(np.asarray(o), channels_last) for o in jax.tree.leaves(j_out)]
            for (name, b), a in zip(t_arrays, j_leaves):
                rows.append(_row(m, "output", name, a, _to_numpy(b), rtol, atol))
            if len(j_leaves) != len(t_arrays):
                rows.append(Row(m, "output", f"outputs: jax {len(j_leaves)} arrays, torch {len(t_arrays)}", (),
                                math.inf, math.inf, False))
            # parameter gradients
            names = {n: (p, None) for n, (p, _) in _variables(jm).items()}
            flat = {tuple(p): v for p, v in nnx.to_flat_state(grads[0])}
            jax_grads = {n: (p, np.asarray(flat[p][...] if isinstance(flat[p], nnx.Variable) else flat[p]))
                         for n, (p, _) in names.items() if p in flat}
            rows += _param_rows(m, "param", jax_grads, t_grads, rtol, atol, naming)
            # input gradients
            for k, i in enumerate(float_idx):
                t_g = txs[i].grad
                t_g = np.zeros(xs[i].shape) if t_g is None else _to_numpy(t_g)
                j_g = _from_jax_layout(np.asarray(grads[k + 1]), channels_last)
                rows.append(_row(m, "input", f"input[{i}]", j_g, t_g, rtol, atol))
            # running statistics after the step
            if m == "train":
                rows += _param_rows(m, "buffer", _jax_buffers(jm), _buffers(tm), rtol, atol, naming)
    return GradientReport(rows, dtype, rtol, atol, tied=naming.tied, skipped=sorted(set(skipped)))

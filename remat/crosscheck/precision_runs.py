"""Low-precision gradient and training checks: each side's run, the float64 reference, the rows.

:func:`compare_gradients` and :func:`compare_training` hand ``dtype="bfloat16"`` or
``precision="mixed"`` here; the criterion is in :mod:`remat.crosscheck.precision`, the two
sides' casts and autocast rules in :mod:`remat.crosscheck.autocast`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from remat.crosscheck import autocast, torch_optim
from remat.crosscheck.harness import (
    _CPU_COMPILER_OPTIONS,
    _buffers,
    _call_torch,
    _from_jax_layout,
    _is_float,
    _jax_buffers,
    _wrap_jax,
    jax_value_and_grad,
)
from remat.crosscheck.layouts import to_torch, torch_name
from remat.crosscheck.lazy import _torch
from remat.crosscheck.outputs import select, torch_arrays
from remat.crosscheck.precision import PRECISIONS, PrecisionReport, PrecisionRow, precision_row
from remat.crosscheck.weights import TorchNaming, _to_numpy, _variables

Values = dict[tuple[str, str, str], Any]  # (mode, kind, name) -> array (torch layout)

#: XLA may keep a bfloat16 value in float32 across the ops of one fusion ("excess precision"),
#: so where fusions end (a checkpoint ends them) would change the rounding: checkpointed and
#: plain runs then differ by up to one bfloat16 ulp. Torch rounds after every op; so do these runs.
EXACT_ROUNDING = {"xla_allow_excess_precision": False}


def _jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    options = {**(_CPU_COMPILER_OPTIONS if jax.default_backend() == "cpu" else {}), **EXACT_ROUNDING}
    return jax.jit(fn, compiler_options=options)


def resolve_precision(dtype: Any, precision: str | None) -> str | None:
    """``"bfloat16"`` or ``"mixed"`` when a low-precision check is asked for, else None (float32/float64)."""
    if precision is None:
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
        return "bfloat16" if name == "bfloat16" else None
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: use one of {', '.join(PRECISIONS)} (or None)")
    return precision


def _torch_named(values: dict[str, Any], naming: TorchNaming, flax_names: list[str]) -> dict[str, Any]:
    return naming.torch_side(values, flax_names)


def _jax_named(jax_vars: dict[str, tuple[tuple, Any]], torch_shapes: dict[str, tuple], naming: TorchNaming
               ) -> dict[str, Any]:
    """JAX tensors under the names the rows use, each in its torch layout."""
    out = {}
    for name, (path, value) in jax_vars.items():
        if name in torch_shapes:
            layout = naming.layouts.of(name, str(path[-1]), torch_shapes[name])
            out[name] = to_torch(layout, np.asarray(value))
    return out


def torch_gradients(torch_model: Any, xs: tuple, precision: str, mode: str, checkpoint: Any, torch_loss: Callable,
                    torch_select: Any, naming: TorchNaming, flax_names: list[str]) -> Values:
    """Outputs, parameter and input gradients (and train-mode running statistics) of one torch run."""
    torch = _torch()
    tm = autocast.torch_model(torch_model, precision)
    tm.train() if mode == "train" else tm.eval()
    txs = autocast.torch_inputs(xs, precision, requires_grad=True)
    with autocast.torch_context(precision):
        out = select(torch_select, _call_torch(tm, txs, checkpoint))
        loss = torch_loss(out)
    loss.backward()
    values: Values = {(mode, "output", n): v.detach() for n, v in torch_arrays(out)[0]}
    grads = {torch_name(n): p.grad if p.grad is not None else torch.zeros_like(p) for n, p in tm.named_parameters()}
    values.update({(mode, "param", n): v for n, v in _torch_named(grads, naming, flax_names).items()})
    values.update({(mode, "input", f"input[{i}]"): t.grad if t.grad is not None else torch.zeros_like(t)
                   for i, t in enumerate(txs) if _is_float(xs[i])})
    if mode == "train":
        values.update({(mode, "buffer", n): v for n, v in _torch_named(_buffers(tm), naming, flax_names).items()})
    return values


def jax_gradients(jax_model: nnx.Module, xs: tuple, precision: str, mode: str, checkpoint: Any, jax_loss: Callable,
                  jax_select: Any, channels_last: bool, naming: TorchNaming, torch_shapes: dict[tuple, tuple],
                  output_names: list[str]) -> Values:
    """The JAX run's values under the torch run's names (``torch_shapes`` gives each tensor's layout)."""
    jm = autocast.jax_model(jax_model, precision)
    if mode == "train":
        jm.train()
    else:
        jm.eval()
    float_idx = [i for i, a in enumerate(xs) if _is_float(a)]
    jxs = autocast.jax_inputs(xs, precision, channels_last)
    graphdef, state = nnx.split(jm)
    call = _wrap_jax(jm, checkpoint, jax_select)

    value_and_grad = jax_value_and_grad(call, jax_loss, graphdef, (0, *(i + 1 for i in float_idx)), jit=_jit)
    out, grads, state = value_and_grad(state, *jxs)
    nnx.update(jm, state)
    leaves = [_from_jax_layout(np.asarray(o), channels_last) for o in jax.tree.leaves(out)]
    values: Values = {(mode, "output", n): a for n, a in zip(output_names, leaves)}
    flat = {tuple(p): v for p, v in nnx.to_flat_state(grads[0])}
    jax_grads = {n: (p, flat[p][...] if isinstance(flat[p], nnx.Variable) else flat[p])
                 for n, (p, _) in _variables(jm).items() if p in flat}
    params = {k[2]: v for k, v in torch_shapes.items() if k[1] == "param"}
    values.update({(mode, "param", n): v for n, v in _jax_named(jax_grads, params, naming).items()})
    for k, i in enumerate(float_idx):
        values[(mode, "input", f"input[{i}]")] = _from_jax_layout(np.asarray(grads[k + 1]), channels_last)
    if mode == "train":
        buffers = {k[2]: v for k, v in torch_shapes.items() if k[1] == "buffer"}
        values.update({(mode, "buffer", n): v for n, v in _jax_named(_jax_buffers(jm), buffers, naming).items()})
    return values


def rows_of(jax_values: Values, torch_values: Values, reference: Values) -> list[PrecisionRow]:
    """One row per tensor of the reference; a tensor missing on a side fails (an infinite error)."""
    rows = []
    for key, ref in reference.items():
        t = torch_values.get(key)
        dtype = autocast.dtype_name(t) if t is not None else "float32"
        ref_np = _to_numpy(ref)
        t_np = _to_numpy(t) if t is not None else np.full(ref_np.shape, np.inf)
        j_np = np.asarray(jax_values[key]) if key in jax_values else np.full(ref_np.shape, np.inf)
        rows.append(precision_row(*key, j_np, t_np, ref_np, dtype))
    return rows


def precision_gradients(jax_model: nnx.Module, torch_model: Any, xs: tuple, *, precision: str, modes: tuple,
                        checkpoint: Any, losses: tuple[Callable, Callable], selectors: tuple[Any, Any],
                        channels_last: bool, naming: TorchNaming) -> PrecisionReport:
    """:func:`remat.crosscheck.compare_gradients` in ``"bfloat16"`` or ``"mixed"`` (see its docstring)."""
    jax_loss, torch_loss = losses
    jax_select, torch_select = selectors
    flax_names = list(_variables(jax_model))
    rows: list[PrecisionRow] = []
    for mode in modes:
        args = (mode, checkpoint, torch_loss, torch_select, naming, flax_names)
        reference = torch_gradients(torch_model, xs, "float64", *args)
        low = torch_gradients(torch_model, xs, precision, *args)
        output_names = [k[2] for k in reference if k[1] == "output"]
        shapes = {k: tuple(v.shape) for k, v in reference.items()}
        jax_values = jax_gradients(jax_model, xs, precision, mode, checkpoint, jax_loss, jax_select, channels_last,
                                   naming, shapes, output_names)
        rows += rows_of(jax_values, low, reference)
    return PrecisionReport("gradients", precision, rows, tied=naming.tied)


def torch_training(torch_model: Any, xs: tuple, y: np.ndarray | None, precision: str, mode: str, steps: int,
                   make_optimizer: Callable, checkpoint: Any, torch_loss: Callable, torch_select: Any,
                   naming: TorchNaming, flax_names: list[str]) -> tuple[list[float], Values]:
    """``steps`` optimizer steps of one torch run: the losses and the final parameters (and statistics)."""
    tm = autocast.torch_model(torch_model, precision)
    tm.train() if mode == "train" else tm.eval()
    opt = make_optimizer(tm.parameters())
    txs = autocast.torch_inputs(xs, precision, requires_grad=False)
    ty = None if y is None else autocast.torch_inputs((y,), precision, requires_grad=False)[0]
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with autocast.torch_context(precision):
            value = torch_loss(select(torch_select, _call_torch(tm, txs, checkpoint)), ty)
        value.backward()
        opt.step()
        losses.append(float(value.detach().double()))
    params = {torch_name(n): p.detach() for n, p in tm.named_parameters()}
    values: Values = {(mode, "param", n): v for n, v in _torch_named(params, naming, flax_names).items()}
    if mode == "train":
        values.update({(mode, "buffer", n): v for n, v in _torch_named(_buffers(tm), naming, flax_names).items()})
    return losses, values


def jax_training(jax_model: nnx.Module, xs: tuple, y: np.ndarray | None, precision: str, mode: str, steps: int,
                 tx: Any, checkpoint: Any, jax_loss: Callable, jax_select: Any, channels_last: bool,
                 naming: TorchNaming, torch_shapes: dict[tuple, tuple]) -> tuple[list[float], Values]:
    """The JAX run of :func:`torch_training`, under the torch run's names."""
    import jax.numpy as jnp

    jm = autocast.jax_model(jax_model, precision)
    jm.train() if mode == "train" else jm.eval()
    jxs = autocast.jax_inputs(xs, precision, channels_last)
    jy = None if y is None else (jnp.asarray(y) if not _is_float(y) else
                                 jnp.asarray(y, dtype=autocast.input_dtype(precision)))
    opt = nnx.Optimizer(jm, tx, wrt=nnx.Param)
    call = _wrap_jax(jm, checkpoint, jax_select)
    graphdef, state = nnx.split((jm, opt))
    to_float32 = precision == "mixed" and y is not None  # autocast runs losses with targets in float32

    @_jit
    def step(state, xs, y):
        model, opt = nnx.merge(graphdef, state)
        value, grads = nnx.value_and_grad(
            lambda m: jax_loss(autocast.float32_outputs(call(m, *xs)) if to_float32 else call(m, *xs), y))(model)
        opt.update(model, grads)
        return value, nnx.state((model, opt))

    losses = []
    for _ in range(steps):
        value, state = step(state, jxs, jy)
        losses.append(float(np.asarray(value, dtype=np.float64)))
    nnx.update((jm, opt), state)
    params = {n: (p, v.get_value()) for n, (p, v) in _variables(jm).items() if isinstance(v, nnx.Param)}
    values: Values = {(mode, "param", n): v for n, v in _jax_named(
        params, {k[2]: s for k, s in torch_shapes.items() if k[1] == "param"}, naming).items()}
    if mode == "train":
        values.update({(mode, "buffer", n): v for n, v in _jax_named(
            _jax_buffers(jm), {k[2]: s for k, s in torch_shapes.items() if k[1] == "buffer"}, naming).items()})
    return losses, values


def precision_training(jax_model: nnx.Module, torch_model: Any, xs: tuple, y: np.ndarray | None, *, precision: str,
                       mode: str, steps: int, optimizers: Callable[[Any], tuple[Any, Any]], checkpoint: Any,
                       losses: tuple[Callable, Callable], selectors: tuple[Any, Any], channels_last: bool,
                       naming: TorchNaming, exclude: Callable[[str], bool] | None, optimizer: str,
                       excluded: list[str], lr: float) -> PrecisionReport:
    """:func:`remat.crosscheck.compare_training` in ``"bfloat16"`` or ``"mixed"`` (see its docstring)."""
    jax_loss, torch_loss = losses
    jax_select, torch_select = selectors
    flax_names = list(_variables(jax_model))

    def make_torch_optimizer(params: Any) -> Any:
        return optimizers(params)[1]

    args = (steps, make_torch_optimizer, checkpoint, torch_loss, torch_select, naming, flax_names)
    ref_losses, reference = torch_training(torch_model, xs, y, "float64", mode, *args)
    torch_losses, low = torch_training(torch_model, xs, y, precision, mode, *args)
    shapes = {k: tuple(v.shape) for k, v in reference.items()}
    # the JAX side does torch.optim's arithmetic (remat.crosscheck.torch_optim): the check is of the models
    tx = torch_optim.from_torch(optimizers([_torch().zeros(1, requires_grad=True)])[1])
    jax_losses, jax_values = jax_training(jax_model, xs, y, precision, mode, steps, tx, checkpoint, jax_loss,
                                          jax_select, channels_last, naming, shapes)
    keep = {k: v for k, v in reference.items() if exclude is None or not exclude(k[2])}
    loss_dtype = "bfloat16" if precision == "bfloat16" else "float32"
    rows = [precision_row(mode, "loss", "loss curve", np.array(jax_losses), np.array(torch_losses),
                          np.array(ref_losses), loss_dtype)]
    rows += rows_of(jax_values, low, keep)
    notes = [_far_steps_note(row, jax_values, low, keep, lr) for row in rows
             if not row.ok and (row.mode, row.kind, row.name) in jax_values]
    return PrecisionReport("training", precision, rows, steps=steps, optimizer=optimizer,
                           losses={"jax": jax_losses, "torch": torch_losses, "reference": ref_losses},
                           tied=naming.tied, excluded=excluded, notes=notes)


def _far_steps_note(row: PrecisionRow, jax_values: Values, torch_values: Values, reference: Values, lr: float) -> str:
    """How many entries of a failing weight each side moved more than ``lr / 2`` away from the reference:
    Adam's steps are ``~lr`` whatever the gradient's size, so a near-zero gradient whose sign
    rounding flipped puts its entry ``~2 lr`` off; a few such entries on either side are luck."""
    key = (row.mode, row.kind, row.name)
    ref = _to_numpy(reference[key]).astype(np.float64)
    far = [int(np.sum(np.abs(np.asarray(_to_numpy(v[key]), np.float64) - ref) > lr / 2))
           for v in (jax_values, torch_values)]
    return (f"{row.name}: entries more than lr/2 from the reference: jax {far[0]}, torch {far[1]} "
            f"of {ref.size} (Adam steps ~lr whatever the gradient's size; see docs/crosscheck.md)")

"""A few training steps of a JAX model and its PyTorch twin, optax against ``torch.optim``.

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

Why these match (``tests/test_training_parity.py`` checks each in float64):

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
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from remat._names import CROSSCHECK_OPTIMIZERS
from remat.crosscheck.harness import (
    _buffers,
    _call_torch,
    _cast_jax_model,
    _cast_torch_model,
    _channels_last,
    _check_loaded,
    _dtype_name,
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
from remat.crosscheck.layouts import torch_name
from remat.crosscheck.lazy import _torch
from remat.crosscheck.outputs import only_array, select, selectors
from remat.crosscheck.precision import PrecisionReport
from remat.crosscheck.precision_runs import precision_training, resolve_precision
from remat.crosscheck.pytrees import as_nnx
from remat.crosscheck.report import TRAINING_TOLERANCES, TrainingReport, _param_rows, _row, _tolerances
from remat.crosscheck.weights import TorchNaming, _to_numpy, _variables

OPTIMIZERS = CROSSCHECK_OPTIMIZERS


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
    float targets, ``mean(out ** 2)`` without targets; on the output's single floating
    array (a ``ModelOutput``'s logits beside its cache)."""
    import optax

    torch = _torch()

    def on_array(side: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        return lambda out, y: fn(only_array(out, side), y)

    if targets is None:
        return (on_array("jax", lambda out, y: jnp.mean(jnp.square(out))),
                on_array("torch", lambda out, y: (out ** 2).mean()))
    if np.issubdtype(targets.dtype, np.integer):
        def jax_ce(out, y):
            return optax.softmax_cross_entropy_with_integer_labels(out.reshape(-1, out.shape[-1]), y.reshape(-1)).mean()

        def torch_ce(out, y):
            return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

        return on_array("jax", jax_ce), on_array("torch", torch_ce)
    return (on_array("jax", lambda out, y: jnp.mean(jnp.square(out - y))),
            on_array("torch", lambda out, y: torch.nn.functional.mse_loss(out, y)))


def _excluder(exclude: Any, known: set[str]) -> Callable[[str], bool] | None:
    if exclude is None:
        return None
    if isinstance(exclude, str):
        exclude = (exclude,)
    if callable(exclude):
        predicate = exclude
        return lambda name: bool(predicate(name))
    names = set(exclude)
    unknown = sorted(names - known)
    if unknown:
        raise ValueError(f"compare_training: exclude names no parameter: {', '.join(unknown)} "
                         "(use the torch-style names of the report rows)")
    return names.__contains__


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
    output: Any = None,
    exclude: Collection[str] | Callable[[str], bool] | None = None,
    layouts: Mapping[str, str] | Callable[[str], str | None] | None = None,
    precision: str | None = None,
) -> TrainingReport | PrecisionReport:
    """Trains copies of both models on the same batch and compares losses and final weights.

    Each step: forward on ``inputs``, loss against ``targets``, backward, one optimizer
    step (optax in JAX, ``torch.optim`` in PyTorch, mapped as in the module docstring).

    Args:
      jax_model, torch_model: the models, with identical weights; ``jax_model`` in any
        form :func:`compare_gradients` accepts (NNX, ``(linen_module, variables)``,
        ``(apply_fn, params)``).
      inputs: NumPy arrays in PyTorch's layout (as for :func:`compare_gradients`).
      targets: integer labels (cross-entropy over the last output axis), float targets
        (mean squared error) or ``None`` (minimise ``mean(out ** 2)``).
      optimizer: one of :data:`OPTIMIZERS`.
      lr, momentum, betas, eps, weight_decay: hyperparameters given to both optimizers.
      steps: number of optimizer steps.
      loss: a pair ``(jax_loss(out, y), torch_loss(out, y))`` replacing the default (the
        default works on the output's single floating array: a ``ModelOutput``'s logits
        beside its cache; with more than one, say which with ``output=``).
      dtype: ``"float32"``, ``"float64"`` or ``"bfloat16"`` (parameters and optimizer
        state in bfloat16 too).
      precision: ``"bfloat16"`` or ``"mixed"`` (bfloat16 compute, float32 parameters and
        optimizer state): the losses and final weights of both runs are measured against
        the twin trained in float64, as in :func:`compare_gradients`; ``rtol``/``atol``
        do not apply. The JAX side then steps with torch's optimizer arithmetic
        (:func:`remat.crosscheck.torch_optim.from_torch`), so the runs differ by their models only.
      mode: ``"train"`` (BatchNorm on batch statistics, running statistics updated and
        compared) or ``"eval"`` (running statistics fixed).
      layout, checkpoint, rename, output, layouts: as for :func:`compare_gradients`
        (``output=`` selects what the loss sees).
      rtol, atol: defaults from :data:`TRAINING_TOLERANCES`.
      exclude: parameters left out of the final-weight comparison (listed in
        ``report.excluded``): torch-style names, or a predicate of the name. For
        parameters whose gradient is zero in theory but not in rounding: Adam divides
        the rounding noise by its own running magnitude (plus ``eps``) and steps up to
        ``lr`` in its direction, so the two frameworks' weights part by up to ``lr`` per
        step although the models agree. This bites in float32, where the noise is not
        small against ``eps``. GPT-2's key bias (part of ``attn.c_attn.bias``: softmax
        is invariant to it) and a bias right before a train-mode BatchNorm are such;
        their gradients are still compared by :func:`compare_gradients`. Example:
        ``exclude=lambda n: n.endswith("c_attn.bias")``.

    Returns:
      A :class:`TrainingReport`.

    Example:
      >>> r = compare_training(jm, tm, (x,), y, optimizer="adam", steps=5)  # doctest: +SKIP
    """
    _torch()  # fail early, with the install hint, when PyTorch is missing
    jax_model = as_nnx(jax_model)
    _check_loaded(jax_model, "compare_training")
    low = resolve_precision(dtype, precision)
    if low is None:
        dtype = _dtype_name(dtype)
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
    jax_select, torch_select = selectors(output)
    flax_names = list(_variables(jax_model))
    naming = TorchNaming(torch_model, rename, layouts, flax_names)
    excluded_by = _excluder(exclude, set(flax_names) | set(naming.names.values()))
    channels_last = _channels_last(jax_model, layout)
    excluded = sorted(n for n in set(flax_names) | set(naming.names.values()) if excluded_by and excluded_by(n))
    if low is not None:
        def optimizers(params: Any) -> tuple[Any, Any]:
            return make_optimizers(optimizer, params, lr=lr, momentum=momentum, betas=betas, eps=eps,
                                   weight_decay=weight_decay)

        return precision_training(jax_model, torch_model, xs, y, precision=low, mode=mode, steps=steps,
                                  optimizers=optimizers, checkpoint=checkpoint, losses=(jax_loss, torch_loss),
                                  selectors=(jax_select, torch_select), channels_last=channels_last, naming=naming,
                                  exclude=excluded_by, optimizer=optimizer, excluded=excluded, lr=lr)
    rtol, atol = _tolerances(TRAINING_TOLERANCES, dtype, rtol, atol)
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
            value = torch_loss(select(torch_select, _call_torch(tm, txs, checkpoint)), ty)
            value.backward()
            topt.step()
            torch_losses.append(float(value.detach()))
        # JAX
        jxs = _jax_arrays(xs, dtype, channels_last)
        jy = None if y is None else (jnp.asarray(y) if not _is_float(y) else jnp.asarray(y, dtype=dtype))
        opt = nnx.Optimizer(jm, tx, wrt=nnx.Param)
        call = _wrap_jax(jm, checkpoint, jax_select)
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
        torch_params = {torch_name(n): t for n, t in tm.named_parameters()}
        rows += _param_rows(mode, "param", jax_params, torch_params, rtol, atol, naming, excluded_by)
        if mode == "train":
            rows += _param_rows(mode, "buffer", _jax_buffers(jm), _buffers(tm), rtol, atol, naming, excluded_by)
    return TrainingReport(optimizer, steps, mode, jax_losses, torch_losses, rows, dtype, rtol, atol,
                          tied=naming.tied, excluded=excluded)

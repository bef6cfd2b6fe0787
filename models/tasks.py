"""Training tasks: a model of the registry (or a user's factory), its data and its loss.

:func:`make_task` is the one way ``remat train``, ``remat plan``, ``remat profile`` and the
benchmarks (``benchmarks/plans.py``) get a model to train or to compile a step of:

* a name of :data:`remat.models.MODELS`: the NNX model is built from its config
  (``module(config, rngs=nnx.Rngs(seed))``, no PyTorch), with the data its entry's
  ``task`` names (:mod:`remat.models.datasets`):

  - ``"regression"`` (``mlp``, ``seed-model``, ``seed-mymodel``): onto the fixed random
    tanh teacher, mean-squared error;
  - ``"char-lm"`` (``transformer``): character-level language modelling on
    ``models/data/corpus.txt``, the vocabulary its characters, the loss the mean
    next-character cross-entropy;
  - ``"images"`` (``cnn``): 10-class synthetic images, cross-entropy;

* ``"path/to/file.py:factory"``: the factory's ``(jax_model, torch_model,
  example_inputs)``; the NNX model trains full-batch on its example inputs (PyTorch
  layout is converted: NCHW images go NHWC when the model has ``input_layout ==
  "NHWC"``) to minimise ``train_loss(outputs, *inputs)`` when the factory's file defines
  it, otherwise the mean of the squared outputs.

:func:`pure_step_loss` turns a task into a pure ``loss(params, inputs, targets)`` for the
tools that compile whole training steps (:func:`remat.plan`, :func:`remat.analysis.compare_policies`).

Example:
  >>> from remat.models.tasks import make_task, pure_step_loss
  >>> task = make_task("mlp", depth=4, batch_size=64, policy="dots")  # doctest: +SKIP
  >>> (x,), y = task.batch(0)  # doctest: +SKIP
  >>> loss, (params, inputs, targets) = pure_step_loss(task)  # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from remat._names import is_no_checkpoint
from remat.models import MODELS, ModelEntry, RematSettings, call_factory, is_factory_spec, load_factory
from remat.models.datasets import CORPUS, char_batches, image_batches, load_corpus, regression_batches

DEFAULT_SEQ_LEN = 32  # the transformer's context length when seq_len is not given


class TaskError(ValueError):
    """Arguments that make no task, in one line; ``options`` names the keyword arguments at fault.

    :meth:`spelled` writes the message with other names for those options (``remat``
    shows its flags: ``--seq-len`` for ``seq_len``).
    """

    def __init__(self, message: str, options: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.options = tuple(options)

    def spelled(self, spell: Callable[[str], str]) -> str:
        """The message, each option's first mention replaced by ``spell(option)``."""
        text = str(self)
        for name in self.options:
            text = re.sub(rf"\b{re.escape(name)}\b", lambda _m, n=name: spell(n), text, count=1)
        return text


@dataclass
class Task:
    """What to train and on what.

    Attributes:
      name: the registry name or the factory spec.
      kind: ``"regression"``, ``"char-lm"``, ``"images"`` or ``"factory"``.
      data: the data, in words (for reports).
      model: the NNX model, initialised.
      batch: ``step -> (inputs, targets)``, ``inputs`` a tuple of arrays with a leading
        batch axis; a pure function of the step (and the task's seed).
      loss: ``(outputs, inputs, targets) -> scalar``.
      batch_size: the leading axis of every batch.
      identity: what a resumed run must match (the model and its config, without the remat
        settings), as JSON-able data.
      policy: the remat policy, in words (``"as built"`` for a factory).
    """

    name: str
    kind: str
    data: str
    model: Any
    batch: Callable[[int], tuple[tuple[np.ndarray, ...], Any]]
    loss: Callable[[Any, tuple, Any], Any]
    batch_size: int
    identity: dict[str, Any] = field(default_factory=dict)
    policy: str = "-"


def mse(out: Any, inputs: tuple, targets: Any) -> Any:
    """Mean-squared error, the regression tasks' loss."""
    import jax.numpy as jnp

    return jnp.mean((out - targets) ** 2)


def cross_entropy(out: Any, inputs: tuple, targets: Any) -> Any:
    """Mean softmax cross-entropy against integer labels, the char-lm and image tasks' loss."""
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(out, targets).mean()


def remat_settings(policy: str | None = None, residual_budget: float | None = None) -> tuple[RematSettings, str]:
    """:class:`RematSettings` for every block from a policy name or a budget, and a label for reports.

    Args:
      policy: ``None`` or ``"nothing"`` (save only the block inputs, as
        ``torch.utils.checkpoint``), ``"no_checkpoint"`` (or ``"none"``: no checkpoint), or another named policy.
      residual_budget: instead of ``policy``: keep at most this fraction of the activations
        (:func:`remat.residual_budget`).
    """
    if residual_budget is not None:
        from remat.analysis.budget import residual_budget as make_budget

        try:
            settings = RematSettings(policy=make_budget(residual_budget))
        except (TypeError, ValueError) as e:
            raise TaskError(f"residual budget {residual_budget}: {e}", ["residual_budget"]) from None
        return settings, f"residual_budget({residual_budget})"
    if is_no_checkpoint(policy):
        return RematSettings.none(), f"{policy} (no checkpoint)"
    try:
        settings = RematSettings(policy=None if policy in (None, "nothing") else policy)
    except (TypeError, ValueError) as e:
        raise TaskError(f"policy {policy!r}: {e}", ["policy"]) from None
    return settings, policy or "nothing"


def init_model(cls: Any, config: Any, seed: int) -> Any:
    """``cls(config, rngs=nnx.Rngs(seed))``, initialised in one compiled program.

    Under ``jax.jit`` (one compilation instead of one per parameter shape) and with JAX's
    non-partitionable threefry: on XLA:CPU (jax 0.10) the partitionable one compiles a normal
    draw of a 4-D conv-kernel shape many times slower (docs/design.md). Both only
    change which random initial weights are drawn. The compiled program is kept for the
    same class, config and seed (:func:`_initializer`), so a second model of them costs no
    compile; a config that cannot be hashed compiles afresh.
    """
    from flax import nnx

    try:
        graphdef, initial_state = _initializer(cls, config, seed)
    except TypeError:  # an unhashable config (a list in a field, say)
        graphdef, initial_state = _initializer.__wrapped__(cls, config, seed)
    return nnx.merge(graphdef, initial_state())


@functools.lru_cache(maxsize=16)
def _initializer(cls: Any, config: Any, seed: int) -> tuple[Any, Callable[[], Any]]:
    """The model's graph definition and its initial state's compiled program.

    ``jax.jit`` of the state, not ``nnx.jit``: an ``nnx.jit`` wrapper is a reference cycle,
    so a compiled program dropped with it would be freed by whichever later full garbage
    collection finds it, inside whatever the caller times next (a plan, say: CHANGELOG.md).
    """
    import jax
    from flax import nnx

    structure = {}

    def initial_state() -> Any:
        structure["graphdef"], state = nnx.split(cls(config, rngs=nnx.Rngs(seed)))
        return state

    scope = getattr(jax, "threefry_partitionable", None)
    with scope(False) if scope is not None else contextlib.nullcontext():
        compiled = jax.jit(initial_state).lower().compile()
    return structure["graphdef"], compiled


def _config_fields(config: Any) -> dict[str, Any]:
    """The config as JSON-able data, without its remat settings (a resume may change those)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "remat"}
    return json.loads(json.dumps(fields, default=str))


def _size_overrides(entry: ModelEntry, depth: int | None, width: int | None) -> dict[str, Any]:
    """Config fields for ``depth``/``width``: direct fields, or a conv stack's channels."""
    if depth is None and width is None:
        return {}
    names = {f.name for f in dataclasses.fields(entry.config)}
    if {"depth", "width"} <= names:
        return {k: v for k, v in (("depth", depth), ("width", width)) if v is not None}
    if "channels" in names:  # one conv block per entry, the width doubling per block
        depth = depth if depth is not None else len(entry.config.channels)
        width = width if width is not None else entry.config.channels[0]
        size = getattr(entry.config, "image_size", None)
        if size is not None and 2 ** depth > size:
            raise TaskError(f"depth {depth}: the {entry.name} pools 2x per block, so {size}x{size} images allow "
                            f"at most {int(math.log2(size))} blocks", ["depth"])
        return {"channels": tuple(width * 2 ** i for i in range(depth))}
    raise TaskError(f"depth and width do not apply to {entry.name} (its sizes are fixed)", ["depth", "width"])


def builtin_task(name: str, *, seed: int = 0, policy: str | None = None, residual_budget: float | None = None,
                 depth: int | None = None, width: int | None = None, seq_len: int | None = None,
                 batch_size: int | None = None) -> Task:
    """The task of :data:`remat.models.MODELS` ``[name]``; see :func:`make_task` for the arguments."""
    entry = MODELS[name]
    if entry.module is None or entry.task is None:
        raise TaskError(f"{name} has no training task (its registry entry names no module or task)")
    settings, label = remat_settings(policy, residual_budget)
    batch = batch_size or entry.train_batch
    overrides: dict[str, Any] = {"batch": batch}
    if seq_len is not None and "seq_len" not in {f.name for f in dataclasses.fields(entry.config)}:
        raise TaskError(f"seq_len does not apply to {name} (it has no sequence length)", ["seq_len"])
    overrides.update(_size_overrides(entry, depth, width))
    text, chars = "", []
    if entry.task == "char-lm":
        text = load_corpus()
        chars = sorted(set(text))
        overrides.update(vocab=len(chars), seq_len=seq_len or DEFAULT_SEQ_LEN)
    try:
        config = entry.make_config(remat=settings, **overrides)
    except (TypeError, ValueError) as e:
        raise TaskError(f"{name}: {e}") from None

    if entry.task == "regression":
        dims = (config.in_dim, config.out_dim) if hasattr(config, "in_dim") else (config.size, config.size)
        make = regression_batches(*dims, batch, seed)
        loss, data = mse, f"fixed random tanh teacher, {dims[0]} -> {dims[1]}"
    elif entry.task == "char-lm":
        try:
            make, _ = char_batches(text, config.seq_len, batch, seed)
        except ValueError as e:
            raise TaskError(str(e), ["seq_len"]) from None
        loss = cross_entropy
        data = f"{CORPUS}: {len(text)} characters, vocab {len(chars)}, windows of {config.seq_len}"
    elif entry.task == "images":
        make = image_batches(config.image_size, config.in_channels, config.num_classes, batch, seed)
        loss = cross_entropy
        shape = f"{config.image_size}x{config.image_size}x{config.in_channels}"
        data = f"synthetic {config.num_classes}-class {shape} images"
    else:
        raise TaskError(f"{name}: unknown task {entry.task!r}; use regression, char-lm or images")
    model = init_model(entry.module, config, seed)
    identity = {"model": name, "config": _config_fields(config)}
    return Task(name, entry.task, data, model, make, loss, batch, identity, label)


def factory_task(spec: str, *, seed: int = 0) -> Task:
    """The task of a user factory ``"path/to/file.py:factory"`` (called with ``seed=`` when it takes one)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    try:
        factory = load_factory(spec)
    except ValueError as e:
        raise TaskError(str(e)) from None
    try:
        built, _ = call_factory(factory, seed=seed)
    except Exception as e:
        first_line = str(e).splitlines()[0] if str(e) else ""
        raise TaskError(f"{spec}: the factory raised {type(e).__name__}: {first_line}") from None
    if not (isinstance(built, tuple) and len(built) == 3 and isinstance(built[0], nnx.Module)):
        raise TaskError(f"{spec}: a factory must return (jax_model, torch_model, example_inputs) with an "
                        f"nnx.Module first, got {type(built).__name__}")
    model, _, inputs = built
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    nhwc = getattr(model, "input_layout", None) == "NHWC"
    arrays = []
    for x in inputs:
        x = np.asarray(x)
        if nhwc and x.ndim == 4:
            x = x.transpose(0, 2, 3, 1)
        if x.dtype == np.int64:
            x = x.astype(np.int32)
        elif x.dtype == np.float64:
            x = x.astype(np.float32)
        arrays.append(x)
    if not arrays or any(a.ndim == 0 for a in arrays):
        raise TaskError(f"{spec}: example_inputs must be arrays with a leading batch axis")
    module = sys.modules.get(getattr(factory, "__module__", ""), None)
    user_loss = getattr(module, "train_loss", None)

    if user_loss is not None:
        def loss(out: Any, ins: tuple, targets: Any) -> Any:
            return user_loss(out, *ins)
        how = "train_loss(outputs, *inputs)"
    else:
        def loss(out: Any, ins: tuple, targets: Any) -> Any:
            return sum(jnp.mean(jnp.square(o.astype(jnp.float32))) for o in jax.tree.leaves(out))
        how = "mean of squared outputs"
    fixed = tuple(arrays)
    shapes = [list(a.shape) for a in arrays]
    return Task(spec, "factory", f"the factory's example inputs {shapes}, loss = {how}", model,
                lambda step: (fixed, ()), loss, arrays[0].shape[0],
                {"model": spec, "inputs": [[*a.shape, str(a.dtype)] for a in arrays]}, "as built")


def make_task(model: str, *, seed: int = 0, policy: str | None = None, residual_budget: float | None = None,
              depth: int | None = None, width: int | None = None, seq_len: int | None = None,
              batch_size: int | None = None) -> Task:
    """The training task of a built-in model or a factory.

    Args:
      model: a name of :data:`remat.models.MODELS` or ``"path/to/file.py:factory"``.
      seed: seeds the initialisation and the data order.
      policy: the remat policy of every block (see :func:`remat_settings`; default
        ``"nothing"``, as ``torch.utils.checkpoint``).
      residual_budget: instead of ``policy``, the fraction of activations to keep.
      depth: number of blocks (the CNN: conv blocks).
      width: block width (the CNN: the first conv's channels, doubled per block).
      seq_len: the transformer's context length (default 32).
      batch_size: the batch (default: the entry's ``train_batch``).

    A factory's model trains as built: only ``seed`` applies to it.

    Raises:
      TaskError: one line, for an unknown model, an option that does not apply, a bad
        size or a factory that cannot be loaded or called.
    """
    sizes = {"depth": depth, "width": width, "seq_len": seq_len, "batch_size": batch_size}
    for key, value in sizes.items():
        if value is not None and value < 1:
            raise TaskError(f"{key} must be at least 1, got {value}", [key])
    if model in MODELS:
        return builtin_task(model, seed=seed, policy=policy, residual_budget=residual_budget, **sizes)
    if is_factory_spec(model):
        for key, value in {"policy": policy, "residual_budget": residual_budget, **sizes}.items():
            if value is not None:
                raise TaskError(f"{key} does not apply to a factory: its model trains as built, on its example "
                                "inputs", [key])
        return factory_task(model, seed=seed)
    raise TaskError(f"unknown model {model!r}; use one of {', '.join(MODELS)}, or path/to/file.py:factory")


def pure_step_loss(task: Task) -> tuple[Callable[..., Any], tuple]:
    """The task's loss as a pure function ``loss(params, inputs, targets)``, and its arguments.

    For the tools that compile and compare whole training steps (``remat plan``,
    ``remat profile``, the benchmarks): the NNX model is split into its parameters,
    differentiated with respect to them, and merged back inside the function. A BatchNorm
    model runs in training mode (batch statistics), as in ``remat train``; the running
    averages it updates are left out of the result, so they are not part of what is
    compiled. The arguments are the parameters and the batch of step 0.

    Example:
      >>> loss, args = pure_step_loss(make_task("mlp"))  # doctest: +SKIP
      >>> grads = jax.grad(loss)(*args)  # doctest: +SKIP
    """
    import jax.numpy as jnp
    from flax import nnx

    inputs, targets = task.batch(0)
    graphdef, params, rest = nnx.split(task.model, nnx.Param, ...)

    def loss(params: Any, inputs: tuple, targets: Any) -> Any:
        # copy=True: fresh Variables of this trace, so that BatchNorm may update its
        # statistics here (on the merged copy; the update is not part of the result)
        model = nnx.merge(graphdef, params, rest, copy=True)
        return task.loss(model(*inputs), inputs, targets)

    return loss, (params, tuple(jnp.asarray(x) for x in inputs), jnp.asarray(targets))


__all__ = ["DEFAULT_SEQ_LEN", "Task", "TaskError", "builtin_task", "cross_entropy", "factory_task", "init_model",
           "make_task", "mse", "pure_step_loss", "remat_settings"]

"""Reference models: each a Flax NNX model and its PyTorch twin, side by side in one file.

Every model file has a config dataclass (with a ``remat:`` :class:`RematSettings`), the
NNX model, its PyTorch twin (built by ``make_torch_model(config)``; torch is imported
only there), ``example_inputs``/``example_targets`` and
``build(config, seed) -> (jax_model, torch_model, example_inputs)``, which loads the
twin's weights into the NNX model so that both start identical.

:data:`MODELS` is the one registry of the built-in models: small configs suitable for fast
tests, and what training each needs (its NNX class, its kind of data, its batch size);
:func:`load_factory` loads a user's ``path/to/file.py:factory``. :mod:`remat.models.tasks`
turns a registry name or a factory into a training task (model, data, loss), for
``remat train``/``plan``/``profile`` and the benchmarks; :mod:`remat.models.datasets`
makes the data.

Example:
  >>> from remat.models import MODELS
  >>> entry = MODELS["mlp"]
  >>> jm, tm, inputs = entry.build()  # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from remat.models import cnn, mlp, seed, transformer
from remat.models._settings import NAMES, RematSettings

Factory = Callable[..., tuple[Any, Any, tuple]]


@dataclass(frozen=True)
class ModelEntry:
    """A built-in model: its default (small) config, factory, targets and tagged names.

    The last three fields say how :func:`remat.models.tasks.make_task` trains it:
    ``module`` is the NNX class (built as ``module(config, rngs=nnx.Rngs(seed))``, no
    PyTorch needed), ``task`` the kind of data (``"regression"``, ``"char-lm"`` or
    ``"images"``, see :mod:`remat.models.datasets`) and ``train_batch`` the default batch.
    """

    name: str
    description: str
    config: Any
    factory: Callable[[Any, int], tuple[Any, Any, tuple]]
    targets: Callable[[Any, int], Any]
    checkpoint_names: tuple[str, ...] = ()
    module: type | None = None
    task: str | None = None
    train_batch: int = 32

    def build(self, remat: RematSettings | None = None, seed: int = 0, **overrides: Any) -> tuple[Any, Any, tuple]:
        """``(jax_model, torch_model, example_inputs)`` for the default config.

        Args:
          remat: the remat settings (default: the config's, i.e. every block, policy None).
          seed: seeds the initialisation and the inputs.
          **overrides: config fields to change, e.g. ``depth=4``.
        """
        return self.factory(self.make_config(remat, **overrides), seed)

    def make_config(self, remat: RematSettings | None = None, **overrides: Any) -> Any:
        """The default config with ``remat`` and ``overrides`` applied."""
        if remat is not None:
            overrides["remat"] = remat
        return dataclasses.replace(self.config, **overrides)

    def example_targets(self, config: Any = None, seed: int = 0) -> Any:
        """Training targets for ``config`` (default config when omitted)."""
        return self.targets(config if config is not None else self.config, seed)


MODELS: dict[str, ModelEntry] = {
    "seed-model": ModelEntry(
        "seed-model", "first seed: fc1 10->20, checkpointed fc2 20->30",
        seed.ModelConfig(), seed.build, seed.example_targets, module=seed.Model, task="regression"),
    "seed-mymodel": ModelEntry(
        "seed-mymodel", "second seed: linear1, checkpointed ReLU method, linear2 (size 32 here)",
        seed.MyModelConfig(size=32), seed.build, seed.example_targets, module=seed.MyModel, task="regression"),
    "mlp": ModelEntry(
        "mlp", "MLP, depth 2, width 32, relu",
        mlp.MLPConfig(), mlp.build, mlp.example_targets, mlp.CHECKPOINT_NAMES, module=mlp.MLP, task="regression"),
    "transformer": ModelEntry(
        "transformer", "GPT decoder, depth 2, width 32, 4 heads, seq 8",
        transformer.TransformerConfig(), transformer.build, transformer.example_targets,
        transformer.CHECKPOINT_NAMES, module=transformer.Transformer, task="char-lm", train_batch=16),
    "cnn": ModelEntry(
        "cnn", "Conv-BatchNorm-ReLU-maxpool x2 on 8x8 images, linear head",
        cnn.CNNConfig(), cnn.build, cnn.example_targets, cnn.CHECKPOINT_NAMES, module=cnn.CNN, task="images"),
}


def is_factory_spec(model: str) -> bool:
    """Whether ``model`` names a factory (``path/to/file.py:factory``) rather than an entry of :data:`MODELS`."""
    return model not in MODELS and (":" in model or model.endswith(".py"))


def load_factory(spec: str) -> Factory:
    """Imports ``path/to/file.py`` and returns its attribute ``factory``.

    Args:
      spec: ``"path/to/file.py:factory"``; the factory returns
        ``(jax_model, torch_model, example_inputs)``.

    Returns:
      The factory callable.

    Raises:
      ValueError: one line, for a malformed spec, a missing file or a missing attribute.

    Example:
      >>> factory = load_factory("my_models.py:build")  # doctest: +SKIP
    """
    path, sep, attr = spec.rpartition(":")
    if not sep or not path or not attr or not attr.isidentifier():
        raise ValueError(f"malformed factory {spec!r}: use path/to/file.py:function_name")
    if not path.endswith(".py"):
        raise ValueError(f"malformed factory {spec!r}: the part before ':' must be a .py file")
    if not os.path.isfile(path):
        raise ValueError(f"factory file {path!r} does not exist (from {spec!r})")
    name = "remat_user_factory_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"cannot import {path!r} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise ValueError(f"importing {path!r} failed: {type(e).__name__}: {e}") from e
    factory = getattr(module, attr, None)
    if factory is None:
        raise ValueError(f"{path!r} has no attribute {attr!r} (from {spec!r})")
    if not callable(factory):
        raise ValueError(f"{spec!r} is not callable (it is a {type(factory).__name__})")
    return factory


def call_factory(factory: Factory, **offered: Any) -> tuple[Any, frozenset[str]]:
    """Calls a user factory with those of ``offered`` keyword arguments it declares.

    A factory may take ``seed=`` (``remat train``) or ``remat=`` (``remat crosscheck``),
    or nothing at all.

    Returns:
      ``(result, names_passed)``.
    """
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: offer nothing
        params = {}
    passed = {k: v for k, v in offered.items() if k in params}
    return factory(**passed), frozenset(passed)


__all__ = ["MODELS", "NAMES", "ModelEntry", "RematSettings", "call_factory", "is_factory_spec", "load_factory", "cnn",
           "mlp", "seed", "transformer"]

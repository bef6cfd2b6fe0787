"""Reference models: each a Flax NNX model and its PyTorch twin, side by side in one file.

Every model file has a config dataclass (with a ``remat:`` :class:`RematSettings`), the
NNX model, its PyTorch twin (built by ``make_torch_model(config)``; torch is imported
only there), ``example_inputs``/``example_targets`` and
``build(config, seed) -> (jax_model, torch_model, example_inputs)``, which loads the
twin's weights into the NNX model so that both start identical.

:data:`MODELS` is the one registry of the built-in models: small configs suitable for fast
tests, and what training each needs (its NNX class, its kind of data, its batch size);
:data:`HF_MODELS` holds the twins whose PyTorch side is a stock ``transformers`` model
(``llama``, ``gpt2``, ``resnet``; the ``[hf]`` extra);
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

from remat.models import cnn, gpt2, hf_resnet, llama, mlp, seed, transformer
from remat.models._settings import NAMES, RematSettings

Factory = Callable[..., tuple[Any, Any, tuple]]


@dataclass(frozen=True)
class ModelEntry:
    """A built-in model: its default (small) config, factory, targets and tagged names.

    The last three fields say how :func:`remat.models.tasks.make_task` trains it:
    ``module`` is the NNX class (built as ``module(config, rngs=nnx.Rngs(seed))``, no
    PyTorch needed), ``task`` the kind of data (``"regression"``, ``"char-lm"`` or
    ``"images"``, see :mod:`remat.models.datasets`) and ``train_batch`` the default batch.
    ``tolerances`` maps a dtype to the ``(rtol, atol)`` its cross-check needs where the
    library's defaults are too tight for the twin (HuggingFace's float32 islands);
    ``training_tolerances`` the same for the training comparison, and ``training_exclude``
    the parameters it leaves out (``compare_training(exclude=)``: gradients zero in theory).
    ``configs`` maps a name to a full-size config (``llama``'s ``"smollm-135m"``).
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
    tolerances: Any = dataclasses.field(default_factory=dict)
    training_tolerances: Any = dataclasses.field(default_factory=dict)
    training_exclude: Any = None
    configs: Any = dataclasses.field(default_factory=dict)

    def build(self, remat: RematSettings | None = None, seed: int = 0, **overrides: Any) -> tuple[Any, Any, tuple]:
        """``(jax_model, torch_model, example_inputs)`` for the default config.

        Args:
          remat: the remat settings (default: the config's, i.e. every block, policy None).
          seed: seeds the initialisation and the inputs.
          **overrides: config fields to change, e.g. ``depth=4``.
        """
        return self.factory(self.make_config(remat, **overrides), seed)

    def make_config(self, remat: RematSettings | None = None, named: str | None = None, **overrides: Any) -> Any:
        """The default config (or the named one of :attr:`configs`) with ``remat`` and ``overrides`` applied."""
        if named is not None and named not in self.configs:
            raise ValueError(f"{self.name} has no config {named!r}; its configs: {', '.join(self.configs) or 'none'}")
        if remat is not None:
            overrides["remat"] = remat
        return dataclasses.replace(self.config if named is None else self.configs[named], **overrides)

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

#: Twins that come from ``transformers`` rather than this repository: the PyTorch side *is*
#: the stock HuggingFace model (random init from a tiny config). Their ``build`` needs the
#: ``[hf]`` extra; ``remat crosscheck llama|gpt2|resnet`` runs them.
HF_MODELS: dict[str, ModelEntry] = {
    "llama": ModelEntry(
        "llama", "transformers.LlamaForCausalLM: depth 2, width 32, 4 heads / 2 kv heads, RoPE, SwiGLU, seq 8",
        llama.LlamaConfig(), llama.build, llama.example_targets, llama.CHECKPOINT_NAMES,
        module=llama.LlamaForCausalLM, tolerances=llama.TOLERANCES,
        training_tolerances=llama.TRAINING_TOLERANCES, training_exclude=llama.TRAINING_EXCLUDE,
        configs=llama.CONFIGS),
    "gpt2": ModelEntry(
        "gpt2", "transformers.GPT2LMHeadModel: depth 2, width 32, 4 heads, Conv1D, tied head, seq 8",
        gpt2.GPT2Config(), gpt2.build, gpt2.example_targets, gpt2.CHECKPOINT_NAMES,
        module=gpt2.GPT2LMHeadModel, tolerances=gpt2.TOLERANCES,
        training_tolerances=gpt2.TRAINING_TOLERANCES, training_exclude=gpt2.TRAINING_EXCLUDE),
    "resnet": ModelEntry(
        "resnet", "transformers.ResNetForImageClassification: basic layers, 2 stages, 16x16 images",
        hf_resnet.ResNetConfig(), hf_resnet.build, hf_resnet.example_targets, hf_resnet.CHECKPOINT_NAMES,
        module=hf_resnet.ResNetForImageClassification, tolerances=hf_resnet.TOLERANCES,
        training_tolerances=hf_resnet.TRAINING_TOLERANCES, training_exclude=hf_resnet.TRAINING_EXCLUDE),
}


def is_factory_spec(model: str) -> bool:
    """Whether ``model`` names a factory (``path/to/file.py:factory``) rather than an entry of :data:`MODELS`."""
    return model not in MODELS and model not in HF_MODELS and (":" in model or model.endswith(".py"))


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


__all__ = ["HF_MODELS", "MODELS", "NAMES", "ModelEntry", "RematSettings", "call_factory", "is_factory_spec",
           "load_factory", "cnn", "gpt2", "hf_resnet", "llama", "mlp", "seed", "transformer"]

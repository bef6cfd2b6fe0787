"""Linen modules and plain parameter pytrees as NNX modules, so the cross-checks treat them as NNX.

A Linen variables dict ``{"params": ..., "batch_stats": ...}`` or any parameter pytree
is held as NNX variables (``params`` -> ``nnx.Param``, ``batch_stats`` ->
``nnx.BatchStat``, other collections -> plain ``nnx.Variable``, neither loaded nor
compared) under the same naming convention as NNX (:mod:`remat.crosscheck.weights`): the path
inside the collection joined with ``.``, the leaf renamed (``Dense_0/kernel`` ->
``Dense_0.weight``, ``BatchNorm_0/mean`` -> ``BatchNorm_0.running_mean``). Linen's
automatic names (``Dense_0``, a ``setup`` list's ``blocks_0``) are kept as they are: name
the layers as torch does (``nn.Dense(..., name="fc1")``, ``name=str(i)`` as HF's Flax
models do), or pass ``rename=``.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

_COLLECTION_KIND = {"params": nnx.Param, "batch_stats": nnx.BatchStat}


def _key(entry: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def is_variables_dict(tree: Any) -> bool:
    """True for a Linen variables dict: a mapping with a ``"params"`` collection."""
    return isinstance(tree, Mapping) and "params" in tree


def _is_linen_module(obj: Any) -> bool:
    from flax import linen

    return isinstance(obj, linen.Module)


class PytreeModel(nnx.Module):
    """A Linen module with its variables, or ``apply_fn`` with its parameter pytree, as an NNX module.

    Build it with :func:`as_nnx`. ``model.train()`` / ``model.eval()`` choose the keyword
    arguments of the call; in train mode a Linen ``batch_stats`` collection is mutable and
    its update is kept, as a train-mode NNX BatchNorm does.
    """

    _crosscheck_strip = 1  # the path's "tree" part; a variables dict adds its collection

    def __init__(self, apply: Callable[..., Any] | None, tree: Any, *, linen: bool, train_kwargs: Mapping[str, Any],
                 eval_kwargs: Mapping[str, Any]):
        leaves, self._treedef = jax.tree_util.tree_flatten_with_path(tree)
        variables = is_variables_dict(tree)
        self._crosscheck_strip = 2 if variables else 1
        self._paths = tuple(tuple(_key(e) for e in path) for path, _ in leaves)
        nested: dict[str, Any] = {}
        for parts, (_, value) in zip(self._paths, leaves):
            kind = _COLLECTION_KIND.get(parts[0], nnx.Variable) if variables else nnx.Param
            node = nested
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = kind(np.asarray(value) if not isinstance(value, jax.ShapeDtypeStruct) else value)
        self.tree = nnx.data(nested)
        self._apply, self._linen = apply, linen
        self._kwargs = {"train": tuple(train_kwargs.items()), "eval": tuple(eval_kwargs.items())}
        self._mode = "train"
        kernels = [v for _, v in nnx.iter_graph(self.tree) if isinstance(v, nnx.Param) and len(v.shape) >= 3]
        self.input_layout = "channels_last" if kernels else "same"  # Linen convolutions are NHWC

    def _variable(self, parts: tuple[str, ...]) -> nnx.Variable:
        node: Any = self.tree
        for part in parts:
            node = node[part]
        if not isinstance(node, nnx.Variable):
            raise KeyError(f"{'/'.join(parts)} is a subtree, not a variable")
        return node

    def value(self) -> Any:
        """The variables (or parameters) as the pytree they came in, with the current values."""
        leaves = [self._variable(p).get_value() for p in self._paths]
        return jax.tree_util.tree_unflatten(self._treedef, leaves)

    def train(self, **attributes: Any) -> None:
        self._mode = "train"

    def eval(self, **attributes: Any) -> None:
        self._mode = "eval"

    def __call__(self, *inputs: Any) -> Any:
        if self._apply is None:
            raise TypeError("this PytreeModel only holds weights (load_torch_state's); it has no apply function")
        variables = self.value()
        kwargs = dict(self._kwargs[self._mode])
        if not (self._linen and self._mode == "train" and "batch_stats" in variables):
            return self._apply(variables, *inputs, **kwargs)
        out, updates = self._apply(variables, *inputs, mutable=["batch_stats"], **kwargs)
        for path, value in jax.tree_util.tree_flatten_with_path(updates["batch_stats"])[0]:
            self._variable(("batch_stats", *(_key(e) for e in path))).set_value(value)
        return out


def as_nnx(model: Any, *, train_kwargs: Mapping[str, Any] | None = None,
           eval_kwargs: Mapping[str, Any] | None = None) -> nnx.Module:
    """Any model the cross-checks accept, as an NNX module.

    Args:
      model: an NNX module (returned as it is); ``(linen_module, variables)`` with
        ``variables`` the ``{"params": ..., "batch_stats": ...}`` dict of ``init``
        (``(linen_module.apply, variables)`` too); or ``(apply_fn, params)`` with
        ``apply_fn(params, *inputs)`` and ``params`` any pytree of arrays (a dict with a
        ``"params"`` entry is read as a Linen variables dict).
      train_kwargs, eval_kwargs: keyword arguments of the call in train and eval mode
        (Linen has no mode of its own), e.g. ``{"train": True}`` / ``{"train": False}``.

    Returns:
      The module: a :class:`PytreeModel` unless ``model`` is already an NNX module.

    Example:
      >>> m = as_nnx((net, variables), train_kwargs={"train": True}, eval_kwargs={"train": False})  # doctest: +SKIP
    """
    if isinstance(model, nnx.Module):
        return model
    kwargs = {"train_kwargs": dict(train_kwargs or {}), "eval_kwargs": dict(eval_kwargs or {})}
    if isinstance(model, tuple) and len(model) == 2:
        fn, tree = model
        owner = getattr(fn, "__self__", None)
        if _is_linen_module(fn):
            return PytreeModel(fn.apply, tree, linen=True, **kwargs)
        if _is_linen_module(owner) and getattr(fn, "__name__", "") == "apply":
            return PytreeModel(fn, tree, linen=True, **kwargs)
        if callable(fn):
            return PytreeModel(fn, tree, linen=False, **kwargs)
    raise TypeError(
        f"expected an NNX module, (linen_module, variables) or (apply_fn, params), got {type(model).__name__}"
    )

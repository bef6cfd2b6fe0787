"""Model outputs as they come (arrays, tuples, dicts, HF ``ModelOutput`` s with caches): selection, leaves, losses.

The ``output=`` selector
------------------------
``output=`` picks what is compared and what the default loss uses. A function is applied
to each side's output that is a container (tuple, dict, ``ModelOutput``, dataclass); an
output that is already a single array is taken as it is. So ``output=lambda o: o.logits``
reads HF's ``CausalLMOutputWithPast`` on the torch side and leaves the Flax side's bare
logits alone, and equally reads a Flax model that returns an object with ``.logits``. A
pair ``(jax_select, torch_select)`` (either ``None``) gives each side its own.

Without a selector every leaf is visited: array leaves are compared (in order, JAX's
against torch's), and the others (a ``DynamicCache``, ``None``) are skipped and named
in the report.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Select = Callable[[Any], Any] | None


def selectors(output: Any) -> tuple[Select, Select]:
    """``(jax_select, torch_select)`` from ``output=``: ``None``, a function, or a pair."""
    if output is None:
        return None, None
    if isinstance(output, tuple) and len(output) == 2 and all(f is None or callable(f) for f in output):
        return output
    if callable(output):
        return output, output
    raise TypeError("output must be a function of a model's output (e.g. lambda o: o.logits) "
                    "or a pair (jax_select, torch_select)")


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, (Mapping, tuple, list))


def select(fn: Select, out: Any) -> Any:
    """``fn(out)``, unless ``fn`` is ``None`` or ``out`` is already a single array."""
    return out if fn is None or _is_array(out) else fn(out)


def torch_leaves(out: Any, name: str = "output") -> list[tuple[str, Any]]:
    """``(name, leaf)`` for every leaf of a torch output: ``output[0]``, ``output.logits``, ...

    Tuples and lists by position, dicts by sorted key (as ``jax.tree`` orders them),
    ordered dicts and ``ModelOutput`` s in their own order; anything else is a leaf.
    """
    if isinstance(out, (tuple, list)):
        return [leaf for i, o in enumerate(out) for leaf in torch_leaves(o, f"{name}[{i}]")]
    if isinstance(out, Mapping):
        keys = list(out) if isinstance(out, OrderedDict) else sorted(out)
        return [leaf for k in keys for leaf in torch_leaves(out[k], f"{name}.{k}")]
    return [(name, out)]


def torch_arrays(out: Any) -> tuple[list[tuple[str, Any]], list[str]]:
    """The tensor leaves of a torch output with their names, and the names of the others."""
    leaves = torch_leaves(out)
    arrays = [(n, v) for n, v in leaves if _is_array(v)]
    return arrays, [n for n, v in leaves if not _is_array(v)]


def _floating(xs: list[Any]) -> list[Any]:
    return [x for x in xs if _is_array(x) and getattr(x.dtype, "is_floating_point", None) is not False
            and (not isinstance(x.dtype, np.dtype) or np.issubdtype(x.dtype, np.floating))]


def jax_sum(out: Any) -> Any:
    """The default gradient loss on the JAX side: the sum of every floating array leaf."""
    leaves = [x for x in jax.tree.leaves(out) if jnp.issubdtype(x.dtype, jnp.floating)]
    return sum((x.sum() for x in leaves), jnp.zeros(()))


def torch_sum(out: Any) -> Any:
    """The default gradient loss on the torch side: the sum of every floating tensor leaf."""
    total = 0
    for x in _floating([v for _, v in torch_arrays(out)[0]]):
        total = total + x.sum()
    return total


def only_array(out: Any, side: str) -> Any:
    """The single floating array of ``out`` (the default training losses need one)."""
    if _is_array(out):
        return out
    if side == "jax":
        arrays = [x for x in jax.tree.leaves(out) if jnp.issubdtype(x.dtype, jnp.floating)]
        names = [f"leaf {i}" for i in range(len(arrays))]
    else:
        named = [(n, v) for n, v in torch_arrays(out)[0] if _floating([v])]
        names, arrays = [n for n, _ in named], [v for _, v in named]
    if len(arrays) != 1:
        raise ValueError(f"the {side} model's output holds {len(arrays)} floating arrays ({', '.join(names)}); "
                         "say which one the loss uses with output=, e.g. output=lambda o: o.logits")
    return arrays[0]

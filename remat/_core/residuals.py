"""What the backward pass of a function keeps: its residuals, with size, source line and name.

The core's ``debug=True`` report and the analysis layer both read residuals from here.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from remat import _jax


def format_bytes(n: int | float) -> str:
    """``1536 -> '1.5 KiB'``: binary units, one decimal."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


# --------------------------------------------------------------------------------------
# Residuals
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Residual:
    """One value the backward pass keeps.

    Attributes:
      shape: array shape.
      dtype: dtype name, e.g. ``"float32"``.
      nbytes: size in bytes.
      kind: ``"argument"``, ``"named"`` (tagged with ``checkpoint_name``), ``"output"``
        (result of an operation), ``"constant"`` or ``"literal"``.
      source: where it came from, e.g. ``"model.py:12 (block)"`` or ``"argument x"``.
      name: the ``jax.ad_checkpoint.checkpoint_name`` tag, or None.
      primitive: the JAX primitive that produced it (``"dot_general"``), or None.
      is_argument: True when the residual is one of ``fn``'s inputs (kept anyway by
        the caller, so it costs nothing extra).
      argument: the input's path (``"params['w']"``) when ``is_argument``.
      file, line, function: the user source location, when known.
      memory_space: where it is kept when not on the device (``"host"`` under an
        offloading policy such as ``remat.policies.offload_names``), else None.
    """

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    kind: str
    source: str
    name: str | None = None
    primitive: str | None = None
    is_argument: bool = False
    argument: str | None = None
    file: str | None = None
    line: int | None = None
    function: str | None = None
    memory_space: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        return d


@dataclasses.dataclass(frozen=True)
class ResidualReport:
    """The residuals of ``jax.vjp(fn, *args)``, as data.

    Attributes:
      residuals: one :class:`Residual` per kept value, in JAX's order (literals,
        constants, arguments, then operation outputs in program order).
      function: the name of the analysed function.
    """

    residuals: tuple[Residual, ...]
    function: str = "fn"

    @property
    def total_bytes(self) -> int:
        """Bytes of every residual, arguments included."""
        return sum(r.nbytes for r in self.residuals)

    @property
    def argument_bytes(self) -> int:
        """Bytes of residuals that are inputs of ``fn``."""
        return sum(r.nbytes for r in self.residuals if r.is_argument)

    @property
    def residual_bytes(self) -> int:
        """Bytes the backward pass keeps beyond ``fn``'s inputs: what checkpointing cuts."""
        return self.total_bytes - self.argument_bytes

    def __len__(self) -> int:
        return len(self.residuals)

    def __iter__(self):
        return iter(self.residuals)

    def __getitem__(self, i: int) -> Residual:
        return self.residuals[i]

    def named(self) -> dict[str, int]:
        """Bytes per checkpoint name, for residuals that carry one."""
        out: dict[str, int] = {}
        for r in self.residuals:
            if r.name is not None:
                out[r.name] = out.get(r.name, 0) + r.nbytes
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "function": self.function,
            "count": len(self.residuals),
            "total_bytes": self.total_bytes,
            "argument_bytes": self.argument_bytes,
            "residual_bytes": self.residual_bytes,
            "residuals": [r.to_dict() for r in self.residuals],
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        rows = [("shape", "dtype", "bytes", "from", "name", "source")]
        for r in self.residuals:
            shape = "[" + ",".join(map(str, r.shape)) + "]"
            op = "argument" if r.is_argument else (r.primitive or r.kind)
            src = r.argument if r.is_argument else r.source
            rows.append((shape, r.dtype, format_bytes(r.nbytes), op, r.name or "", src or ""))
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        lines = [f"Residuals of {self.function}: {len(self.residuals)} values"]
        for k, row in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row[:5], widths)) + "  " + row[5])
            if k == 0:
                lines.append("  ".join("-" * w for w in widths) + "  ------")
        lines.append(
            f"total {format_bytes(self.total_bytes)} = arguments "
            f"{format_bytes(self.argument_bytes)} + residuals {format_bytes(self.residual_bytes)}"
        )
        return "\n".join(lines)


def itemsize(dtype: Any) -> int:
    """Bytes per element of any dtype JAX has, as ``jax.Array.nbytes`` counts them.

    Extended dtypes (typed PRNG keys) have no NumPy dtype but carry an itemsize; ``float0``
    has none (0 bytes); sub-byte types (``int4``) take a byte each.
    """
    try:
        dtype = np.dtype(dtype)
    except TypeError:  # an extended dtype (a PRNG key)
        pass
    return int(getattr(dtype, "itemsize", 0) or 0)


def aval_nbytes(aval: Any) -> int:
    """Bytes of one abstract value (0 for a value without a shape)."""
    shape = getattr(aval, "shape", None)
    return 0 if shape is None else int(math.prod(shape)) * itemsize(getattr(aval, "dtype", np.float32))


def _aval_fields(aval: Any) -> tuple[tuple[int, ...], str, int]:
    shape = tuple(int(d) for d in getattr(aval, "shape", ()))
    dtype = getattr(aval, "dtype", np.float32)
    try:
        name = str(np.dtype(dtype))
    except TypeError:  # an extended dtype (a PRNG key)
        name = str(dtype)
    return shape, name, aval_nbytes(aval)


def _memory_space(aval: Any) -> str | None:
    space = getattr(aval, "memory_space", None)
    name = str(getattr(space, "name", space) or "").lower()
    return None if name in ("", "none", "device") else name


def _fn_name(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", None) or type(fn).__name__


def saved_residuals(fn: Callable, *args: Any, **kwargs: Any) -> ResidualReport:
    """Lists what the backward pass of ``fn`` keeps: the residuals of ``jax.vjp``.

    ``fn`` may return a scalar or any pytree; the residuals are those of
    ``jax.vjp(fn, *args, **kwargs)``, i.e. of the backward pass with respect to every
    array input. Checkpointed regions (``jax.checkpoint``/``remat.checkpoint``) show up
    as their saved inputs plus whatever their policy saves. This is the structured form
    of ``jax.ad_checkpoint.print_saved_residuals``.

    Args:
      fn: the function to differentiate.
      *args: example inputs (arrays or pytrees of arrays; ``jax.ShapeDtypeStruct`` works).
      **kwargs: example keyword inputs, traced like ``args``.

    Returns:
      A :class:`ResidualReport`; ``str(report)`` is a readable table.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> f = lambda w, x: jnp.sum(jnp.sin(x @ w))
      >>> r = saved_residuals(f, jnp.ones((4, 4)), jnp.ones((2, 4)))
      >>> [x.kind for x in r]
      ['argument', 'argument', 'output']
    """
    if not callable(fn):
        raise TypeError(f"saved_residuals needs a function, got {type(fn).__name__}")
    residuals = _saved_residuals_structured(fn, args, kwargs)
    return ResidualReport(tuple(residuals), function=_fn_name(fn))


def _saved_residuals_structured(fn: Callable, args: tuple, kwargs: dict) -> list[Residual]:
    # Mirrors jax._src.ad_checkpoint.saved_residuals/_saved_residuals, keeping the
    # pieces (equation, primitive, frame) that its strings flatten away.
    in_leaves, in_tree = jax.tree_util.tree_flatten((args, kwargs))

    def flat_fn(*leaves):
        a, k = jax.tree_util.tree_unflatten(in_tree, leaves)
        return fn(*a, **k)

    jaxpr_, out_shape = jax.make_jaxpr(lambda *a: jax.vjp(flat_fn, *a), return_shape=True)(*in_leaves)
    jaxpr = jaxpr_.jaxpr
    num_res = jax.tree_util.tree_structure(out_shape[1]).num_leaves
    outvars = jaxpr.outvars[len(jaxpr.outvars) - num_res :]
    arg_names = _jax.argument_names("saved_residuals", fn, args, kwargs) or (None,) * len(jaxpr.invars)

    # reduce_precision is not a producer worth naming: look through it, as JAX does.
    subst = {
        e.outvars[0]: e.invars[0] for e in jaxpr.eqns if e.primitive is jax.lax.reduce_precision_p
    }
    res_vars = {subst.get(v, v) for v in outvars if not _jax.is_literal(v)}
    out: list[Residual] = []

    for v in outvars:
        if _jax.is_literal(v):
            out.append(Residual(*_aval_fields(v.aval), kind="literal", source="a literal"))
    for v in jaxpr.constvars:
        if v in res_vars:
            out.append(Residual(*_aval_fields(v.aval), kind="constant", source="a constant",
                                    memory_space=_memory_space(v.aval)))
    for i, v in enumerate(jaxpr.invars):
        if v in res_vars:
            name = arg_names[i] if i < len(arg_names) and arg_names[i] else f"flat[{i}]"
            out.append(
                Residual(
                    *_aval_fields(v.aval), kind="argument", source=f"argument {name}",
                    is_argument=True, argument=name, memory_space=_memory_space(v.aval),
                )
            )

    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            if v not in res_vars:
                continue
            frame = _jax.user_frame(eqn.source_info)
            where = _jax.summarize_source(eqn.source_info) if frame else "unknown"
            prim = eqn.primitive.name
            name = _jax.checkpoint_name_of(eqn)
            if prim in ("jit", "pjit"):  # produced inside a nested jit: name the function
                prim = f"jit({eqn.params.get('name', '?')})"
            kind, src = ("named" if name is not None else "output"), where
            out.append(
                Residual(
                    *_aval_fields(v.aval), kind=kind, source=src, name=name, primitive=prim,
                    memory_space=_memory_space(v.aval),
                    file=frame.file_name if frame else None,
                    line=frame.start_line if frame else None,
                    function=frame.function_name if frame else None,
                )
            )
    return out


def checkpoint_names(fn: Callable, *args: Any, **kwargs: Any) -> list[str]:
    """Every :func:`remat.checkpoint_name` tag that ``fn(*args, **kwargs)`` applies, in order.

    Looks inside nested jaxprs (checkpointed regions, scans, jits), so the tags of a
    model's blocks are found wherever the blocks run.

    Args:
      fn: any traceable function.
      *args, **kwargs: example arguments (only shapes and dtypes matter).

    Returns:
      The distinct names, in the order they are first applied.

    Example:
      >>> import jax.numpy as jnp, remat
      >>> checkpoint_names(lambda x: remat.checkpoint_name(jnp.sin(x), "h") * 2, jnp.ones(3))
      ['h']
    """
    return names_in_jaxpr(jax.make_jaxpr(lambda *a, **k: fn(*a, **k))(*args, **kwargs).jaxpr)


def names_in_jaxpr(jaxpr: Any) -> list[str]:
    """The distinct ``checkpoint_name`` tags of a jaxpr and its nested jaxprs, in order."""
    names: dict[str, None] = {}
    todo = [getattr(jaxpr, "jaxpr", jaxpr)]
    while todo:
        jaxpr = todo.pop(0)
        for eqn in jaxpr.eqns:
            name = _jax.checkpoint_name_of(eqn)
            if name is not None:
                names.setdefault(name)
        todo.extend(_jax.subjaxprs(jaxpr))  # scan bodies, checkpointed regions, jits, ...
        # a jax_remat3 region (jax.checkpoint under JAX_REMAT3=1) holds its body out of subjaxprs' sight
        todo.extend(body for e in jaxpr.eqns if e.primitive is not _jax.checkpoint_primitive()
                    and (body := _jax.checkpoint_body(e)) is not None)
    return list(names)



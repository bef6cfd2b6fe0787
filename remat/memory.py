"""What checkpointing really saves: residuals, compiled buffer sizes and measured RSS.

Three views, from cheapest to most honest:

* :func:`saved_residuals` traces ``jax.vjp`` and lists every value the backward pass
  keeps, with its size, source line and checkpoint name. No compilation; exact for
  the program JAX hands to XLA, but blind to what XLA's scheduler does with it.
* :func:`compiled_memory` compiles ``jax.jit(jax.grad(fn))`` and reads XLA's buffer
  assignment (``memory_analysis()``): the bytes the step will really allocate.
  On XLA:CPU this is where the scheduler effect shows up (see :mod:`remat._xla_flags`).
* :func:`peak_rss_bytes` runs a step in a fresh Python process and reads the kernel's
  high-water mark of resident memory.

:func:`compare_policies` puts residual bytes, compiled temp bytes and step time side by
side for several checkpoint policies, and can plot them.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from remat.memory import saved_residuals, compiled_memory
  >>> def loss(w, x):
  ...     return jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w))
  >>> w, x = jnp.ones((64, 64)), jnp.ones((8, 64))
  >>> print(saved_residuals(loss, w, x))       # doctest: +SKIP
  >>> compiled_memory(loss, w, x).temp_bytes   # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import os
import pickle
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

__all__ = [
    "CompiledMemory",
    "PolicyComparison",
    "PolicyResult",
    "RSSMeasurement",
    "Residual",
    "ResidualReport",
    "compare_policies",
    "compiled_memory",
    "format_bytes",
    "peak_rss_bytes",
    "saved_residuals",
    "with_policy",
]

DEFAULT_POLICIES: tuple[str, ...] = ("none", "nothing", "dots", "dots_no_batch", "everything")


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


def _aval_fields(aval: Any) -> tuple[tuple[int, ...], str, int]:
    shape = tuple(int(d) for d in getattr(aval, "shape", ()))
    dtype = np.dtype(getattr(aval, "dtype", np.float32))
    # Extended dtypes (PRNG keys) have no NumPy itemsize; count them as 0 rather than fail.
    itemsize = getattr(dtype, "itemsize", 0) or 0
    return shape, str(dtype), int(math.prod(shape)) * int(itemsize)


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
    try:
        residuals = _saved_residuals_structured(fn, args, kwargs)
    except (ImportError, AttributeError):  # JAX internals moved: parse JAX's own summary
        residuals = _saved_residuals_from_strings(fn, args, kwargs)
    return ResidualReport(tuple(residuals), function=_fn_name(fn))


def _saved_residuals_structured(fn: Callable, args: tuple, kwargs: dict) -> list[Residual]:
    # Mirrors jax._src.ad_checkpoint.saved_residuals/_saved_residuals, keeping the
    # pieces (equation, primitive, frame) that its strings flatten away.
    from jax._src import api_util, core, source_info_util
    from jax._src.lax import lax as lax_internal

    in_leaves, in_tree = jax.tree_util.tree_flatten((args, kwargs))

    def flat_fn(*leaves):
        a, k = jax.tree_util.tree_unflatten(in_tree, leaves)
        return fn(*a, **k)

    dbg = api_util.debug_info("saved_residuals", fn, args, kwargs)
    jaxpr_, out_shape = jax.make_jaxpr(lambda *a: jax.vjp(flat_fn, *a), return_shape=True)(*in_leaves)
    jaxpr = jaxpr_.jaxpr
    num_res = jax.tree_util.tree_structure(out_shape[1]).num_leaves
    outvars = jaxpr.outvars[len(jaxpr.outvars) - num_res :]
    arg_names = dbg.arg_names or (None,) * len(jaxpr.invars)

    # reduce_precision is not a producer worth naming: look through it, as JAX does.
    subst = {
        e.outvars[0]: e.invars[0] for e in jaxpr.eqns if e.primitive is lax_internal.reduce_precision_p
    }
    res_vars = {subst.get(v, v) for v in outvars if not isinstance(v, core.Literal)}
    out: list[Residual] = []

    for v in outvars:
        if isinstance(v, core.Literal):
            out.append(Residual(*_aval_fields(v.aval), kind="literal", source="a literal"))
    for v in jaxpr.constvars:
        if v in res_vars:
            out.append(Residual(*_aval_fields(v.aval), kind="constant", source="a constant"))
    for i, v in enumerate(jaxpr.invars):
        if v in res_vars:
            name = arg_names[i] if i < len(arg_names) and arg_names[i] else f"flat[{i}]"
            out.append(
                Residual(
                    *_aval_fields(v.aval), kind="argument", source=f"argument {name}",
                    is_argument=True, argument=name,
                )
            )

    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            if v not in res_vars:
                continue
            frame = source_info_util.user_frame(eqn.source_info.traceback)
            where = source_info_util.summarize(eqn.source_info) if frame else "unknown"
            prim = eqn.primitive.name
            name = _checkpoint_name_of(eqn)
            if prim in ("jit", "pjit"):  # produced inside a nested jit: name the function
                prim = f"jit({eqn.params.get('name', '?')})"
            kind, src = ("named" if name is not None else "output"), where
            out.append(
                Residual(
                    *_aval_fields(v.aval), kind=kind, source=src, name=name, primitive=prim,
                    file=frame.file_name if frame else None,
                    line=frame.start_line if frame else None,
                    function=frame.function_name if frame else None,
                )
            )
    return out


def _checkpoint_name_of(eqn: Any) -> str | None:
    """The ``checkpoint_name`` tag an equation applies, or None."""
    from jax._src import ad_checkpoint as adc

    name_p = getattr(adc, "name_p", None)
    if name_p is not None and eqn.primitive is name_p:
        return eqn.params["name"]
    call_hi = getattr(adc, "call_hi_primitive_p", None)
    checkpoint_name_cls = getattr(adc, "CheckpointName", None)
    if call_hi is not None and eqn.primitive is call_hi and checkpoint_name_cls is not None:
        p = eqn.params.get("_prim")
        if isinstance(p, checkpoint_name_cls):
            return p.name
    return None


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
    from jax._src import core

    names: dict[str, None] = {}
    todo = [getattr(jaxpr, "jaxpr", jaxpr)]
    while todo:
        jaxpr = todo.pop(0)
        for eqn in jaxpr.eqns:
            name = _checkpoint_name_of(eqn)
            if name is not None:
                names.setdefault(name)
        todo.extend(core.subjaxprs(jaxpr))  # scan bodies, checkpointed regions, jits, ...
    return list(names)


def _saved_residuals_from_strings(fn: Callable, args: tuple, kwargs: dict) -> list[Residual]:
    from jax._src.ad_checkpoint import saved_residuals as jax_saved_residuals

    out = []
    for aval, src in jax_saved_residuals(fn, *args, **kwargs):
        fields = _aval_fields(aval)
        if src.startswith("from the argument"):
            name = src.removeprefix("from the argument").strip()
            out.append(Residual(*fields, kind="argument", source=f"argument {name}", is_argument=True, argument=name))
        elif src.startswith("named '"):
            name = src.split("'")[1]
            out.append(Residual(*fields, kind="named", source=src, name=name))
        elif "literal" in src or "constant" in src:
            out.append(Residual(*fields, kind="literal" if "literal" in src else "constant", source=src))
        else:
            out.append(Residual(*fields, kind="output", source=src))
    return out


# --------------------------------------------------------------------------------------
# Compiled memory
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """XLA's buffer assignment for one compiled program (``memory_analysis()``).

    Attributes:
      temp_bytes: scratch buffers live during the call: activations and residuals.
      argument_bytes: inputs.
      output_bytes: outputs.
      alias_bytes: outputs that reuse (donated) input buffers.
      generated_code_bytes: size of the compiled code.
      peak_bytes: estimate of the device memory the call needs: XLA's own peak when the
        backend reports one, else ``argument + output + temp - alias``.
    """

    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    generated_code_bytes: int
    peak_bytes: int

    @classmethod
    def from_compiled(cls, compiled: Any) -> CompiledMemory:
        """Reads ``compiled.memory_analysis()`` (a ``jax.stages.Compiled``)."""
        m = compiled.memory_analysis()
        if m is None:
            raise ValueError("this backend reports no memory analysis; run on CPU, GPU or TPU")
        get = lambda k: int(getattr(m, k, 0) or 0)  # noqa: E731
        temp, arg, out, alias = (get(k) for k in ("temp_size_in_bytes", "argument_size_in_bytes",
                                                  "output_size_in_bytes", "alias_size_in_bytes"))
        # XLA:CPU reports 0, or a figure below its own temp buffer, as peak_memory_in_bytes;
        # the sum of the live buffers is then the honest bound.
        peak = get("peak_memory_in_bytes")
        if peak < temp:
            peak = arg + out + temp - alias
        return cls(temp, arg, out, alias, get("generated_code_size_in_bytes"), peak)

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        return ", ".join(f"{k.removesuffix('_bytes')} {format_bytes(v)}" for k, v in self.to_dict().items())


def _grad_program(fn: Callable, grad: bool, argnums: int | Sequence[int]) -> Callable:
    if not grad:
        return fn
    argnums = argnums if isinstance(argnums, int) else tuple(argnums)
    return jax.grad(fn, argnums=argnums)


def compiled_memory(
    fn: Callable, *args: Any, grad: bool = True, argnums: int | Sequence[int] = 0, **kwargs: Any
) -> CompiledMemory:
    """Compiles ``jax.jit(jax.grad(fn))`` (or ``fn`` itself) and reports XLA's buffer sizes.

    Args:
      fn: with ``grad=True`` a function returning a scalar loss; otherwise any function.
      *args: example inputs (arrays, pytrees, or ``jax.ShapeDtypeStruct``).
      grad: compile the gradient of ``fn`` (a training step's backward) rather than ``fn``.
      argnums: which positional arguments to differentiate, as in ``jax.grad``.
      **kwargs: keyword inputs, traced like ``args``.

    Returns:
      A :class:`CompiledMemory`. ``temp_bytes`` is the number to compare between
      checkpoint policies. On XLA:CPU it depends on the scheduler flag that
      ``import remat`` sets (see :mod:`remat._xla_flags`).

    Example:
      >>> import jax.numpy as jnp
      >>> m = compiled_memory(lambda w, x: jnp.sum(jnp.tanh(x @ w)), jnp.ones((8, 8)), jnp.ones((4, 8)))
      >>> m.argument_bytes
      384
    """
    compiled = jax.jit(_grad_program(fn, grad, argnums)).lower(*args, **kwargs).compile()
    return CompiledMemory.from_compiled(compiled)


# --------------------------------------------------------------------------------------
# Peak resident memory, measured
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RSSMeasurement:
    """Resident memory of a step run in a fresh process.

    Attributes:
      step_peak_bytes: high-water mark of RSS while the timed steps ran.
      baseline_bytes: RSS just before them (JAX imported, inputs on the device, program
        compiled).
      step_bytes: ``step_peak_bytes - baseline_bytes``: what running the step needs on
        top of that (its temporaries and outputs). Compare this across policies.
      process_peak_bytes: the process's lifetime peak, compilation included.
      exact: False when the kernel did not let us reset the high-water mark, in which
        case ``step_peak_bytes`` may include compilation.
    """

    step_peak_bytes: int
    baseline_bytes: int
    step_bytes: int
    process_peak_bytes: int
    exact: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def proc_status_bytes(field: str) -> int | None:
    """A byte figure from ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...); None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def current_rss_bytes() -> int:
    """This process's resident memory now (``/proc``, else psutil, else 0)."""
    rss = proc_status_bytes("VmRSS")
    if rss is not None:
        return rss
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:  # pragma: no cover
        return 0


def _lifetime_peak() -> int:
    import resource

    # ru_maxrss is KiB on Linux, bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _reset_peak() -> bool:
    # Linux >= 4.0: writing 5 to clear_refs resets VmHWM to the current RSS, so the next
    # reading is the peak of what ran after this point only.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return proc_status_bytes("VmHWM") is not None
    except OSError:
        return False


def _measure_here(step: Callable, args: tuple, kwargs: dict, repeat: int) -> RSSMeasurement:
    import gc

    compiled = jax.jit(step).lower(*args, **kwargs).compile()
    gc.collect()
    # Baseline: inputs on the device and the program compiled, nothing run yet.
    baseline = current_rss_bytes()
    exact = _reset_peak()
    for _ in range(repeat):
        jax.block_until_ready(compiled(*args, **kwargs))
    peak = (proc_status_bytes("VmHWM") if exact else None) or _lifetime_peak()
    return RSSMeasurement(peak, baseline, max(0, peak - baseline), _lifetime_peak(), exact)


def _rss_child_main() -> None:  # runs in the fresh interpreter started by peak_rss_bytes
    payload = pickle.loads(sys.stdin.buffer.read())
    step, args, kwargs, repeat = payload
    result = _measure_here(step, args, kwargs, repeat)
    sys.stdout.write("REMAT_RSS " + json.dumps(result.to_dict()) + "\n")


def peak_rss_bytes(
    step: Callable,
    *args: Any,
    repeat: int = 3,
    isolate: bool = True,
    timeout: float = 600.0,
    **kwargs: Any,
) -> RSSMeasurement:
    """Measures the resident memory a step really uses, end to end.

    The step is jitted and compiled; then the kernel's RSS high-water mark is reset
    (``/proc/self/clear_refs``) and the step runs ``repeat`` times. By default this
    happens in a fresh Python process, which is the honest choice: the caller's other
    arrays, compilation caches and allocator history would blur the number,
    ``ru_maxrss`` in a long-lived process never goes down, and only a new process lets
    us set glibc's ``MALLOC_MMAP_THRESHOLD_`` so that freed buffers (compilation's,
    or the previous step's) go back to the kernel instead of hiding the next step's
    allocations in a retained heap. The child otherwise inherits the environment, so
    ``XLA_FLAGS`` apply the same way.

    Args:
      step: the function to run (e.g. ``jax.grad(loss)``). With ``isolate=True`` it
        and the inputs must be picklable: a module-level function or a
        ``functools.partial`` of one, not a lambda or a local function.
      *args: inputs (NumPy or JAX arrays, pytrees of them).
      repeat: timed runs after the warm-up.
      isolate: run in a fresh subprocess (True) or in this process (False; works for
        any callable, less reliable).
      timeout: seconds before the child is killed.
      **kwargs: keyword inputs for ``step``.

    Returns:
      An :class:`RSSMeasurement`; ``step_bytes`` is the number to compare.

    Example:
      >>> import functools, jax, jax.numpy as jnp
      >>> m = peak_rss_bytes(functools.partial(jnp.sum), jnp.ones((1024, 1024)))  # doctest: +SKIP
    """
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    if not isolate:
        return _measure_here(step, args, dict(kwargs), repeat)
    host = lambda t: jax.tree.map(lambda a: np.asarray(a) if isinstance(a, jax.Array) else a, t)  # noqa: E731
    try:
        payload = pickle.dumps((step, host(args), host(kwargs), repeat))
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(
            f"peak_rss_bytes(isolate=True) must pickle the step and its inputs ({e}); "
            "use a module-level function, or pass isolate=False"
        ) from None
    code = "from remat.memory import _rss_child_main; _rss_child_main()"
    # The child must import the caller's modules the same way: give it our sys.path.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    # Large buffers via mmap, returned to the kernel on free: RSS then tracks live bytes.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    proc = subprocess.run(
        [sys.executable, "-c", code], input=payload, capture_output=True, timeout=timeout, env=env
    )
    for line in proc.stdout.decode(errors="replace").splitlines():
        if line.startswith("REMAT_RSS "):
            return RSSMeasurement(**json.loads(line.removeprefix("REMAT_RSS ")))
    err = proc.stderr.decode(errors="replace").strip().splitlines()
    raise RuntimeError(f"peak_rss_bytes: the measuring process failed: {err[-1] if err else proc.returncode}")


# --------------------------------------------------------------------------------------
# Policies side by side
# --------------------------------------------------------------------------------------


def with_policy(fn: Callable, policy: Any) -> Callable:
    """``fn`` checkpointed under ``policy``, where ``"none"`` means not checkpointed at all.

    The helper a policy-parametrised model uses so :func:`compare_policies` can switch
    checkpointing off as one of the options.

    Args:
      fn: a layer or block function.
      policy: ``"none"`` (no checkpoint), or anything ``remat.policies.resolve_policy``
        accepts: ``None``/``"nothing"``, ``"dots"``, ``"dots_no_batch"``,
        ``"everything"``, a list of checkpoint names, or a callable JAX policy.

    Returns:
      ``fn`` itself for ``"none"``, else ``jax.checkpoint(fn, policy=...)``.

    Example:
      >>> import jax.numpy as jnp
      >>> block = with_policy(lambda w, x: jnp.tanh(x @ w), "dots")
    """
    from remat._lowering import mark_region
    from remat.scan import resolve_policy_spec

    if isinstance(policy, str) and policy == "none":
        return fn
    return jax.checkpoint(fn, policy=mark_region(resolve_policy_spec(policy)))


@dataclasses.dataclass(frozen=True)
class PolicyResult:
    """One row of :class:`PolicyComparison`.

    Attributes:
      policy: the policy's name.
      residual_bytes: bytes kept for the backward beyond the inputs
        (:attr:`ResidualReport.residual_bytes`).
      residual_count: number of residuals, inputs included.
      temp_bytes: compiled scratch bytes of ``jax.jit(jax.grad(loss))``.
      peak_bytes: compiled peak estimate (:attr:`CompiledMemory.peak_bytes`).
      step_time_s: median wall time of one gradient step.
      step_times_s: every timed step.
    """

    policy: str
    residual_bytes: int
    residual_count: int
    temp_bytes: int
    peak_bytes: int
    step_time_s: float
    step_times_s: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["step_times_s"] = list(self.step_times_s)
        return d


@dataclasses.dataclass(frozen=True)
class PolicyComparison:
    """Residual bytes, compiled bytes and step time per checkpoint policy."""

    results: tuple[PolicyResult, ...]
    xla_flags: str = ""

    def __getitem__(self, policy: str) -> PolicyResult:
        for r in self.results:
            if r.policy == policy:
                return r
        raise KeyError(f"no policy {policy!r} in this comparison; have {[r.policy for r in self.results]}")

    def __iter__(self):
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    @property
    def columns(self) -> list[str]:
        return ["policy", "residuals", "residual bytes", "compiled temp", "compiled peak", "step (ms)", "vs none"]

    def rows(self) -> list[list[str]]:
        """Table rows for people (bytes formatted, time in ms)."""
        base = next((r for r in self.results if r.policy == "none"), None)
        rows = []
        for r in self.results:
            rel = f"{r.temp_bytes / base.temp_bytes:.2f}x" if base and base.temp_bytes else "-"
            rows.append([
                r.policy, str(r.residual_count), format_bytes(r.residual_bytes), format_bytes(r.temp_bytes),
                format_bytes(r.peak_bytes), f"{r.step_time_s * 1e3:.2f}", rel,
            ])
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {"xla_flags": self.xla_flags, "results": [r.to_dict() for r in self.results]}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        table = [self.columns, *self.rows()]
        widths = [max(len(row[i]) for row in table) for i in range(len(self.columns))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in table]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike, title: str | None = None) -> str:
        """Writes a PNG: compiled temp bytes and residual bytes against step time.

        Args:
          path: the PNG file to write.
          title: the figure title.

        Returns:
          ``str(path)``.
        """
        import matplotlib  # lazily: importing remat.memory must stay light

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
        ms = [r.step_time_s * 1e3 for r in self.results]
        temp = [r.temp_bytes / 2**20 for r in self.results]
        res = [r.residual_bytes / 2**20 for r in self.results]
        ax.scatter(ms, temp, marker="o", label="compiled temp (XLA)")
        ax.scatter(ms, res, marker="x", label="residuals (jax.vjp)")
        for r, x, y in zip(self.results, ms, temp):
            ax.annotate(r.policy, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_xlabel("median step time (ms)")
        ax.set_ylabel("MiB")
        ax.set_title(title or "checkpoint policies: memory vs time")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.fspath(path), format="png")
        plt.close(fig)
        return os.fspath(path)


def _policy_label(policy: Any) -> str:
    if policy is None:
        return "nothing"
    if isinstance(policy, str):
        return policy
    if callable(policy):
        return getattr(policy, "__name__", type(policy).__name__)
    return "names:" + ",".join(map(str, policy))


def _loss_for(fn: Callable, policy: Any) -> Callable:
    """``fn(policy)`` for a factory; ``partial(fn, policy=policy)`` for a loss with ``policy=``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    p = params.get("policy")
    others = [n for n in params if n != "policy"]
    if p is not None and (others or p.kind is inspect.Parameter.KEYWORD_ONLY):
        return functools.partial(fn, policy=policy)
    loss = fn(policy)
    if not callable(loss):
        raise TypeError(
            f"compare_policies: fn(policy) returned {type(loss).__name__}; pass a factory "
            "policy -> loss_fn, or a loss with a policy= keyword"
        )
    return loss


def compare_policies(
    fn: Callable,
    *args: Any,
    policies: Sequence[Any] = DEFAULT_POLICIES,
    argnums: int | Sequence[int] = 0,
    steps: int = 5,
    warmup: int = 1,
    **kwargs: Any,
) -> PolicyComparison:
    """Residual bytes, compiled temp bytes and step time of a loss under several policies.

    ``fn`` is either a factory ``fn(policy) -> loss`` or a loss taking a ``policy=``
    keyword (detected from its signature: a ``policy`` parameter alongside others, or
    keyword-only). It receives each entry of ``policies`` as it is; ``"none"`` means
    "no checkpoint at all", which :func:`with_policy` implements for you.

    For each policy the gradient ``jax.jit(jax.grad(loss, argnums))`` is compiled once;
    its ``memory_analysis()`` gives the bytes and the same executable is timed
    (``warmup`` untimed calls, then ``steps`` timed ones; the median is reported).

    Args:
      fn: the policy-parametrised loss (see above); the loss returns a scalar.
      *args: example inputs of the loss.
      policies: policy spellings to try, in table order.
      argnums: the loss arguments to differentiate.
      steps: timed steps per policy (at least 5 gives a usable median).
      warmup: untimed steps first.
      **kwargs: keyword inputs of the loss (traced).

    Returns:
      A :class:`PolicyComparison`; ``str()`` is a table, ``.plot(path)`` a PNG.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def make_loss(policy):
      ...     block = with_policy(lambda w, x: jnp.tanh(x @ w), policy)
      ...     def loss(ws, x):
      ...         for w in ws:
      ...             x = block(w, x)
      ...         return jnp.sum(x ** 2)
      ...     return loss
      >>> ws = [jnp.eye(64)] * 4
      >>> table = compare_policies(make_loss, ws, jnp.ones((32, 64)))  # doctest: +SKIP
      >>> print(table)                                                # doctest: +SKIP
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if not policies:
        raise ValueError("policies is empty; pass at least one, e.g. policies=('none', 'nothing')")
    results = []
    for policy in policies:
        loss = _loss_for(fn, policy)
        report = saved_residuals(loss, *args, **kwargs)
        compiled = jax.jit(_grad_program(loss, True, argnums)).lower(*args, **kwargs).compile()
        mem = CompiledMemory.from_compiled(compiled)
        for _ in range(warmup):
            jax.block_until_ready(compiled(*args, **kwargs))
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args, **kwargs))
            times.append(time.perf_counter() - t0)
        results.append(
            PolicyResult(
                policy=_policy_label(policy),
                residual_bytes=report.residual_bytes,
                residual_count=len(report),
                temp_bytes=mem.temp_bytes,
                peak_bytes=mem.peak_bytes,
                step_time_s=statistics.median(times),
                step_times_s=tuple(times),
            )
        )
    return PolicyComparison(tuple(results), xla_flags=os.environ.get("XLA_FLAGS", ""))

"""Every JAX internal remat reads (``jax._src``, ``jax.interpreters``, ``jax.extend``), in one place.

These are not JAX's public API and change between releases; each is wrapped here in a
small named function, so that a new JAX release is checked against this one file.
:data:`TESTED` names the oldest and newest releases the test suite passed with
(``pyproject.toml``'s floor and ``constraints/oldest.txt`` repeat the oldest;
``tests/test_jax_internals.py`` keeps them equal). Nothing is imported until a function
runs, so ``remat --help`` never imports JAX.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from typing import Any

# (oldest, newest): the releases the fast suite passed with (CI runs it with both; the slow
# suite runs with the newest). Older flax has no ``nnx.remat(graph_updates=...)``, and
# flax 0.12.6 itself needs jax>=0.8.1.
TESTED: dict[str, tuple[str, str]] = {
    "jax": ("0.8.1", "0.10.2"),
    "jaxlib": ("0.8.1", "0.10.2"),
    "flax": ("0.12.6", "0.12.8"),
}


# --- the process ------------------------------------------------------------------------

def backend_started() -> bool:
    """True once a JAX backend exists (the first computation made it); never imports JAX."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bridge is not None and bool(bridge.backends_are_initialized())


# --- jaxprs -------------------------------------------------------------------------------

def is_literal(var: Any) -> bool:
    """Whether a jaxpr operand is a literal (a constant written into the equation), not a variable."""
    from jax.extend.core import Literal

    return isinstance(var, Literal)


def is_primitive(obj: Any) -> bool:
    """Whether ``obj`` is a JAX primitive (``jax.lax.sin_p``, ``jax.lax.dot_general_p``, ...)."""
    from jax.extend.core import Primitive

    return isinstance(obj, Primitive)


def subjaxprs(jaxpr: Any) -> Iterator[Any]:
    """The jaxprs nested in ``jaxpr``'s equations (scan bodies, checkpointed regions, jits)."""
    from jax._src import core

    return core.subjaxprs(jaxpr)


def argument_names(traced_for: str, fn: Any, args: tuple, kwargs: dict) -> tuple[str | None, ...] | None:
    """The names JAX gives the flattened arguments of ``fn(*args, **kwargs)`` (``w``, ``x['a']``)."""
    from jax._src import api_util

    return api_util.debug_info(traced_for, fn, args, kwargs).arg_names


def user_frame(source_info: Any) -> Any:
    """The innermost frame of user code (outside JAX) that made an equation, or None."""
    from jax._src import source_info_util

    return source_info_util.user_frame(source_info.traceback)


def summarize_source(source_info: Any) -> str:
    """``file:line (function)`` of the user code that made an equation, as JAX prints it."""
    from jax._src import source_info_util

    return source_info_util.summarize(source_info)


def is_name_primitive(primitive: Any) -> bool:
    """Whether ``primitive`` is the one ``jax.ad_checkpoint.checkpoint_name`` binds."""
    from jax._src import ad_checkpoint

    return primitive is ad_checkpoint.name_p


def checkpoint_name_of(eqn: Any) -> str | None:
    """The ``checkpoint_name`` tag an equation applies, or None.

    A tag is ``name_p``, or (JAX 0.10 with hijax) a ``call_hi_primitive_p`` equation whose
    ``_prim`` is a ``CheckpointName``.
    """
    from jax._src import ad_checkpoint as adc

    if eqn.primitive is adc.name_p:
        return eqn.params["name"]
    call_hi = getattr(adc, "call_hi_primitive_p", None)
    checkpoint_name_cls = getattr(adc, "CheckpointName", None)
    if call_hi is not None and eqn.primitive is call_hi and checkpoint_name_cls is not None:
        p = eqn.params.get("_prim")
        if isinstance(p, checkpoint_name_cls):
            return p.name
    return None


def has_ordered_effects(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` has effects that must run in order (tokens threaded through it)."""
    from jax._src import effects

    return bool(list(effects.ordered_effects.filter_in(jaxpr.effects)))


def name_primitive() -> Any:
    """The primitive :func:`jax.ad_checkpoint.checkpoint_name` binds."""
    from jax._src import ad_checkpoint

    return ad_checkpoint.name_p


def reduce_precision_primitive() -> Any:
    """The primitive of ``jax.lax.reduce_precision`` (bf16 islands that explain attributes)."""
    from jax._src.lax import lax as lax_internal

    return lax_internal.reduce_precision_p


def name_stack(eqn: Any) -> str:
    """An equation's name stack as text, e.g. ``"transpose(jvp(@blocks.0))/@blocks.0.attn"``."""
    return str(eqn.source_info.name_stack)


def frames(eqn: Any) -> list[tuple[str, int, str]]:
    """An equation's Python frames of user code ``(file, line, function)``, innermost first."""
    from jax._src import source_info_util

    traceback = eqn.source_info.traceback
    if traceback is None:
        return []
    return [(f.file_name, f.start_line, f.function_name) for f in source_info_util.user_frames(traceback)]


def eqn_subjaxprs(eqn: Any) -> Iterator[Any]:
    """The jaxprs one equation's parameters hold (a scan's body, a region, a jit, ...)."""
    from jax._src import core

    for param in eqn.params.values():
        for value in (param if isinstance(param, (tuple, list)) else (param,)):
            if isinstance(value, (core.Jaxpr, core.ClosedJaxpr)):
                yield value


def closed_jaxpr(jaxpr: Any) -> Any:
    """``jaxpr`` as a closed jaxpr (a region's body may be open, with no constants)."""
    from jax.extend import core

    return jaxpr if hasattr(jaxpr, "jaxpr") else core.ClosedJaxpr(jaxpr, ())


def jaxpr_function(closed: Any) -> Any:
    """A Python function that evaluates a closed jaxpr (traceable again, e.g. under ``jax.vjp``)."""
    from jax.extend import core

    return core.jaxpr_as_fun(closed)


def replace_eqns(jaxpr: Any, eqns: list[Any]) -> Any:
    """``jaxpr`` with ``eqns`` in place of its equations (same inputs and outputs)."""
    return jaxpr.replace(eqns=eqns)


def with_subjaxprs(eqn: Any, rewrite: Any) -> Any:
    """``eqn`` with each jaxpr its parameters hold (a scan's body, a jit's, a cond's
    branches) passed through ``rewrite`` (an open jaxpr to an open jaxpr); ``eqn`` itself
    where ``rewrite`` changed none."""
    from jax._src import core

    def new(value: Any) -> Any:
        if isinstance(value, core.ClosedJaxpr):
            inner = rewrite(value.jaxpr)
            return value if inner is value.jaxpr else core.ClosedJaxpr(inner, value.consts)
        if isinstance(value, core.Jaxpr):
            return rewrite(value)
        if isinstance(value, tuple) and value and all(isinstance(v, (core.Jaxpr, core.ClosedJaxpr)) for v in value):
            return tuple(map(new, value))
        return value

    params = {k: new(v) for k, v in eqn.params.items()}
    return eqn if all(params[k] is v for k, v in eqn.params.items()) else eqn.replace(params=params)


# --- checkpoint equations (jax.checkpoint, nnx.remat and nn.remat build them) ----------------

def _remat3_call(eqn: Any) -> Any:
    """The ``RematTraced`` a ``jax_remat3`` checkpoint equation calls, or None."""
    from jax._src import ad_checkpoint as adc

    call_hi, remat3 = getattr(adc, "call_hi_primitive_p", None), getattr(adc, "RematTraced", None)
    if call_hi is None or remat3 is None or eqn.primitive is not call_hi:
        return None
    prim = eqn.params.get("_prim")
    return prim if isinstance(prim, remat3) else None


def checkpoint_body(eqn: Any) -> Any:
    """The open jaxpr a checkpoint equation runs, or None for any other equation: the
    ``checkpoint`` primitive's, or under ``jax_remat3`` the ``RematTraced`` call's (its
    constants are its first inputs, so its body is open too)."""
    if eqn.primitive is checkpoint_primitive():
        return eqn.params["jaxpr"]
    called = _remat3_call(eqn)
    return None if called is None else _classic_names(called.jaxpr.jaxpr)


def _classic_names(jaxpr: Any) -> Any:
    """``jaxpr`` with each ``jax_remat3`` name tag (a ``CheckpointName`` call) as the classic
    ``name_p`` equation, which the classic checkpoint's name policies read."""
    from jax._src import ad_checkpoint as adc

    eqns, changed = [], False
    for eqn in jaxpr.eqns:
        name = checkpoint_name_of(eqn)
        if name is not None and eqn.primitive is not adc.name_p:
            new = eqn.replace(primitive=adc.name_p, params={"name": name})
        else:
            new = with_subjaxprs(eqn, _classic_names)
        changed |= new is not eqn
        eqns.append(new)
    return replace_eqns(jaxpr, eqns) if changed else jaxpr


def checkpoint_policy(eqn: Any) -> Any:
    """The policy of a checkpoint equation (:func:`checkpoint_body` is not None)."""
    called = _remat3_call(eqn)
    return eqn.params["policy"] if called is None else called.policy


def checkpoint_function_name(eqn: Any) -> str:
    """The name of the function a checkpoint equation checkpointed (``"?"`` where JAX kept none)."""
    info = getattr(checkpoint_body(eqn), "debug_info", None)
    source = getattr(info, "func_src_info", None) or "?"
    return source.split(" at ", 1)[0]


def as_checkpoint(eqn: Any, policy: Any) -> Any:
    """A checkpoint equation as the ``checkpoint`` primitive (whatever ``jax_remat3`` made
    of it) with ``policy``: the same inputs, outputs, body and ``prevent_cse``."""
    called = _remat3_call(eqn)
    prevent_cse = True if called is not None else eqn.params["prevent_cse"]
    return eqn.replace(primitive=checkpoint_primitive(),
                       params=dict(jaxpr=checkpoint_body(eqn), prevent_cse=prevent_cse, differentiated=False,
                                   policy=policy))


def inlined_checkpoint(eqn: Any) -> Any:
    """A checkpoint equation as a plain call of its body: not checkpointed."""
    from jax._src import core

    return eqn.replace(primitive=core.closed_call_p, params=dict(call_jaxpr=core.ClosedJaxpr(checkpoint_body(eqn), ())))


def eval_closed_jaxpr(closed: Any, jaxpr: Any, *args: Any) -> list[Any]:
    """Evaluates ``jaxpr`` (``closed``'s jaxpr, or one rewritten from it) with ``closed``'s
    constants, binding each equation in the current trace."""
    from jax._src import core

    return core.eval_jaxpr(jaxpr, closed.consts, *args)


def bind_equation(primitive: Any, values: Any, params: dict[str, Any]) -> Any:
    """``primitive`` bound on ``values`` with an equation's ``params``, as ``jax.core.eval_jaxpr`` binds it.

    ``get_bind_params`` returns the parameters in JAX 0.10, and in JAX 0.8 a pair: the
    sub-functions to bind first, and the parameters.
    """
    bind = primitive.get_bind_params(params)
    subfuns, bind = ((), bind) if isinstance(bind, dict) else bind
    return primitive.bind(*subfuns, *values, **bind)


def remat3_setting() -> Any:
    """The ``jax_remat3`` setting (called with a bool, a thread-local context), or None before JAX 0.10.2."""
    from jax._src import config

    return getattr(config, "remat3", None)


# --- the checkpoint primitive's lowering --------------------------------------------------

def checkpoint_primitive() -> Any:
    """The primitive ``jax.checkpoint`` binds (``remat2`` in jaxprs, ``checkpoint`` when printed)."""
    from jax._src import ad_checkpoint

    return ad_checkpoint.remat_p


def checkpoint_lowering() -> Any:
    """JAX's own lowering rule of :func:`checkpoint_primitive`: ``rule(ctx, *args, **params)``."""
    from jax._src import ad_checkpoint

    return ad_checkpoint._remat_lowering


def register_cpu_lowering(primitive: Any, rule: Any) -> None:
    """Makes ``rule`` the lowering of ``primitive`` on CPU (other platforms keep JAX's)."""
    from jax.interpreters import mlir

    mlir.register_lowering(primitive, rule, platform="cpu")


def mlir_modules() -> tuple[Any, Any, Any]:
    """``(mlir, ir, hlo)``: JAX's lowering helpers, the MLIR core and the StableHLO dialect."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir  # pyright: ignore[reportPrivateImportUsage]
    from jax._src.lib.mlir.dialects import hlo

    return mlir, ir, hlo


def ir_type(ctx: Any, aval: Any) -> Any:
    """The MLIR type of ``aval`` in the lowering context ``ctx``.

    JAX 0.10.1 added the module context as the first argument of ``aval_to_ir_type``.
    """
    from jax._src.interpreters import mlir

    if _ir_type_takes_context():
        return mlir.aval_to_ir_type(ctx.module_context, aval)
    return mlir.aval_to_ir_type(aval)  # pyright: ignore[reportCallIssue]  (the older signature)


@functools.cache
def _ir_type_takes_context() -> bool:
    import inspect

    from jax._src.interpreters import mlir

    return len(inspect.signature(mlir.aval_to_ir_type).parameters) == 2


# --- compiled programs --------------------------------------------------------------------

def optimized_hlo_without_metadata(compiled: Any) -> str | None:
    """The optimized HLO of a ``jax.stages.Compiled``, printed without source locations
    (XLA's printer leaves the metadata out, a sixth of the time of editing it out of
    ``as_text()``); None where this jaxlib has no such printer."""
    try:
        from jaxlib import _hlo  # pyright: ignore[reportAttributeAccessIssue]

        options = _hlo.HloPrintOptions()
        options.print_metadata = False
        return "\n".join(m.to_string(options) for m in compiled.runtime_executable().hlo_modules())
    except Exception:  # another jaxlib's printer or executable: the caller edits as_text() instead
        return None

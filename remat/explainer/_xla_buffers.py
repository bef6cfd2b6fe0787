"""XLA's buffer assignment of one compilation, for :func:`remat.explain`.

:func:`compile_with_buffer_assignment` compiles one lowered program with debug options
given to that compilation only (``compiler_options``: XLA writes the optimized module and
its buffer assignment, heap simulator trace included, into a temporary folder that is read
and removed); no environment variable or process-wide flag is touched. The jaxpr helpers
explain reads (name stacks, source frames, primitives) are in :mod:`remat._jax`, with every
other JAX internal.

Example:
  >>> compiled, program = compile_with_buffer_assignment(jax.jit(f).lower(x))  # doctest: +SKIP
"""
from __future__ import annotations

import glob
import os
import shutil
import tempfile
from typing import Any

from remat.explainer._hlo_proto import HloProgram, parse_hlo_proto

# What XLA needs to write the optimized module with its buffer assignment (the heap
# simulator's trace is recorded only when dumping): the proto, not the text forms.
_DUMP_OPTIONS = {"xla_dump_hlo_as_proto": True, "xla_dump_hlo_as_text": False}
# Newer XLA also writes a text analysis of the buffer assignment unless told not to; older
# XLA (jaxlib < 0.9) has no such option and rejects the compilation that names it.
_OPTIONAL_OPTIONS = {"xla_dump_buffer_assignment_analysis": False}


def compile_with_buffer_assignment(lowered: Any) -> tuple[Any, HloProgram]:
    """Compiles ``lowered`` once and reads XLA's buffer assignment of that very compilation.

    Args:
      lowered: a ``jax.stages.Lowered``.

    Returns:
      ``(compiled, program)``: the ``jax.stages.Compiled`` and its :class:`HloProgram`.

    Raises:
      RuntimeError: the backend wrote no optimized module (it does not honour
        ``xla_dump_to``).
    """
    folder = tempfile.mkdtemp(prefix="remat-explain-")
    try:
        compiled = _compile(lowered, {"xla_dump_to": folder, **_DUMP_OPTIONS})
        found = sorted(glob.glob(os.path.join(folder, "*after_optimizations.hlo.pb")), key=os.path.getmtime)
        name = _module_name(compiled)
        found = [f for f in found if name and f".{name}." in os.path.basename(f)] or found
        if not found:
            raise RuntimeError("XLA wrote no optimized module for this backend; remat.explain reads XLA's "
                               "buffer assignment from it (CPU, GPU and TPU write one)")
        with open(found[-1], "rb") as f:
            program = parse_hlo_proto(f.read())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return compiled, program


def _compile(lowered: Any, options: dict[str, Any]) -> Any:
    """``lowered.compile`` with ``options``, and with the optional ones where XLA knows them."""
    try:
        return lowered.compile(compiler_options={**options, **_OPTIONAL_OPTIONS})
    except Exception as error:  # XLA raises its own runtime error type
        if "No such compile option" not in str(error):
            raise
    return lowered.compile(compiler_options=options)


def _module_name(compiled: Any) -> str | None:
    """The optimized HLO module's name (the dump's file names carry it)."""
    try:
        return compiled.runtime_executable().hlo_modules()[0].name
    except (AttributeError, IndexError, RuntimeError):
        return None

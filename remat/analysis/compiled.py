"""Compiling a step and reading XLA's buffer sizes: the one place remat does ``jit(grad(fn))``.

:func:`compiled_step` compiles ``jax.jit(jax.grad(fn))`` (or ``fn``) once and returns the
executable together with its :class:`CompiledMemory`, so the program whose bytes are read
is the very program that is timed (:mod:`remat.analysis.timing`).
:func:`compiled_memory` is the same compile when only the bytes are wanted.
"""
from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from remat._core.residuals import format_bytes


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


class CompiledStep(NamedTuple):
    """A compiled step and what XLA says it allocates.

    Attributes:
      executable: the ``jax.stages.Compiled``; call it with the example inputs' shapes.
      memory: its buffer sizes (:class:`CompiledMemory`).
      compile_s: seconds spent tracing, lowering and compiling it.
    """

    executable: Any
    memory: CompiledMemory
    compile_s: float


def compiled_step(
    fn: Callable, *args: Any, grad: bool = True, argnums: int | Sequence[int] = 0, **kwargs: Any
) -> CompiledStep:
    """Compiles ``jax.jit(jax.grad(fn))`` (or ``fn`` itself) once: the executable and its bytes.

    Args:
      fn: with ``grad=True`` a function returning a scalar loss; otherwise any function.
      *args: example inputs (arrays, pytrees, or ``jax.ShapeDtypeStruct``).
      grad: compile the gradient of ``fn`` (a training step's backward) rather than ``fn``.
      argnums: which positional arguments to differentiate, as in ``jax.grad``.
      **kwargs: keyword inputs, traced like ``args``.

    Returns:
      A :class:`CompiledStep` ``(executable, memory, compile_s)``.

    Raises:
      ValueError: the backend reports no memory analysis.

    Example:
      >>> import jax.numpy as jnp
      >>> w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
      >>> step = compiled_step(lambda w, x: jnp.sum(jnp.tanh(x @ w)), w, x)
      >>> step.executable(w, x).shape, step.memory.argument_bytes
      ((8, 8), 384)
    """
    t0 = time.perf_counter()
    executable = jax.jit(_grad_program(fn, grad, argnums)).lower(*args, **kwargs).compile()
    compile_s = time.perf_counter() - t0
    return CompiledStep(executable, CompiledMemory.from_compiled(executable), compile_s)


def compiled_memory(
    fn: Callable, *args: Any, grad: bool = True, argnums: int | Sequence[int] = 0, **kwargs: Any
) -> CompiledMemory:
    """Compiles ``jax.jit(jax.grad(fn))`` (or ``fn`` itself) and reports XLA's buffer sizes.

    The memory of :func:`compiled_step`, when the executable is not needed.

    Args:
      fn: with ``grad=True`` a function returning a scalar loss; otherwise any function.
      *args: example inputs (arrays, pytrees, or ``jax.ShapeDtypeStruct``).
      grad: compile the gradient of ``fn`` (a training step's backward) rather than ``fn``.
      argnums: which positional arguments to differentiate, as in ``jax.grad``.
      **kwargs: keyword inputs, traced like ``args``.

    Returns:
      A :class:`CompiledMemory`. ``temp_bytes`` is the number to compare between
      checkpoint policies. On XLA:CPU it depends on where the scheduler places the
      recomputation, which remat's regions tie to their cotangent (see
      :mod:`remat._core.lowering`).

    Example:
      >>> import jax.numpy as jnp
      >>> m = compiled_memory(lambda w, x: jnp.sum(jnp.tanh(x @ w)), jnp.ones((8, 8)), jnp.ones((4, 8)))
      >>> m.argument_bytes
      384
    """
    return compiled_step(fn, *args, grad=grad, argnums=argnums, **kwargs).memory

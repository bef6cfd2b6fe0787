"""Shared helpers for the tests: residual counting, jaxpr inspection, tree comparison.

A test marked ``@pytest.mark.isolated`` runs in a child process of its own, so that a test
which could abort the interpreter (an XLA check failure) fails alone instead of taking the
suite down with it.

Import them in a test module with ``from conftest import ...`` (pytest puts ``tests/`` on
``sys.path`` for a rootless ``conftest.py``).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from typing import Any

# The tests draw their random numbers with XLA's RngBitGenerator ("rbg") unless
# JAX_DEFAULT_PRNG_IMPL says otherwise: threefry, JAX's default, is a hash that compiles to a
# large program for every distinct shape it draws, and initialising the tests' many small
# models spent more time compiling threefry than checking remat. remat never depends on the
# generator; CI runs the slow cases and a second fast run under threefry (.ci/run). Set before jax is imported, so
# that the child processes the tests start (CLI runs, fuzz workers, isolated tests) inherit it.
os.environ.setdefault("JAX_DEFAULT_PRNG_IMPL", "rbg")

#: XLA's own defaults for the CPU backend, for a test whose subject is the default compile
#: (``jax.jit(f, compiler_options=DEFAULT_COMPILE)`` or ``lowered.compile(DEFAULT_COMPILE)``).
DEFAULT_COMPILE = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False}

# The tests compile with XLA:CPU's backend optimisations off (LLVM at -O0, its expensive passes
# skipped): compiling dominates the tests' small programs, and this takes about a fifth off the
# default run. remat works on jaxprs and HLO, which these flags do not touch, nor XLA's buffer
# assignment, so every memory figure is the same (test_planner_assign compares the two
# compiles). An XLA_FLAGS that sets the level itself wins: CI runs the slow cases and the remat3
# run at XLA's default (.ci/run). Set before jax is imported, for the child processes too.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
         "--xla_llvm_disable_expensive_passes=true"]).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import remat  # noqa: F401, E402  (every test, the upstream ports included, runs with remat imported)
from remat import _jax  # noqa: E402
from remat.analysis import saved_residuals  # noqa: E402

# in case a plugin imported jax before this file ran
jax.config.update("jax_default_prng_impl", os.environ["JAX_DEFAULT_PRNG_IMPL"])

REMAT_PRIMITIVES = ("checkpoint", "remat", "remat2")
REMAT_DIR = os.path.dirname(os.path.abspath(remat.__file__))

#: JAX's ``jax_remat3`` setting (called with a bool: a thread-local context), None before
#: JAX 0.10.2, which has no other kind of remat.
REMAT3 = _jax.remat3_setting()
needs_remat3 = pytest.mark.skipif(REMAT3 is None, reason="jax_remat3 exists from JAX 0.10.2")


def remat3_set(value: bool) -> Any:
    """``jax_remat3`` set to ``value`` for this thread only; before JAX 0.10.2 nothing to set."""
    return contextlib.nullcontext() if REMAT3 is None else REMAT3(value)


class _Aval:
    """The shape, dtype and memory space of one residual, printed as JAX prints an aval
    (``float32<host>[2,3,4]`` for an offloaded one)."""

    __slots__ = ("shape", "dtype", "nbytes", "memory_space")

    def __init__(self, shape: tuple[int, ...], dtype: str, nbytes: int, memory_space: str | None):
        self.shape, self.dtype, self.nbytes, self.memory_space = shape, dtype, nbytes, memory_space

    def __repr__(self) -> str:
        space = f"<{self.memory_space}>" if self.memory_space else ""
        return f"{self.dtype}{space}[{','.join(map(str, self.shape))}]"


def _description(r: Any) -> str:
    """The residual's source in the words of ``jax.ad_checkpoint.print_saved_residuals``."""
    if r.kind == "literal":
        return "from a literal"
    if r.kind == "constant":
        return "from a constant"
    if r.is_argument:
        return f"from the argument {r.argument}"
    if r.name is not None:
        return f"named '{r.name}' from {r.source}"
    prim = r.primitive or "?"
    if prim.startswith("jit(") and prim.endswith(")"):
        return f"output of jitted function '{prim[4:-1]}' from {r.source}"
    return f"output of {prim} from {r.source}"


def residuals(f: Callable[..., Any], *args: Any) -> list[tuple[Any, str]]:
    """``(aval, description)`` for every value the backward pass of ``f(*args)`` keeps.

    Read from :func:`remat.analysis.saved_residuals`; ``aval`` has ``shape``, ``dtype`` (a
    name), ``nbytes`` and ``memory_space``, and ``description`` is worded as JAX's
    ``print_saved_residuals``.
    """
    return [(_Aval(r.shape, r.dtype, r.nbytes, r.memory_space), _description(r)) for r in saved_residuals(f, *args)]


def num_residuals(f: Callable[..., Any], *args: Any) -> int:
    return len(saved_residuals(f, *args))


def residual_bytes(f: Callable[..., Any], *args: Any) -> int:
    return saved_residuals(f, *args).total_bytes


def nonarg_residuals(f: Callable[..., Any], *args: Any) -> list[tuple[Any, str]]:
    """The residuals that are not simply the function's own arguments (or literals, constants)."""
    return [
        (a, d) for a, d in residuals(f, *args)
        if not d.startswith("from the argument") and d not in ("from a literal", "from a constant")
    ]


def _subjaxprs(params: dict) -> list[Any]:
    out = []
    for v in params.values():
        vs = v if isinstance(v, (list, tuple)) else [v]
        for j in vs:
            if isinstance(j, jax.extend.core.ClosedJaxpr):
                out.append(j.jaxpr)
            elif isinstance(j, jax.extend.core.Jaxpr):
                out.append(j)
    return out


def count_remat_eqns(jaxpr: Any) -> int:
    """Number of checkpoint/remat equations in ``jaxpr`` and every jaxpr nested in it."""
    if isinstance(jaxpr, jax.extend.core.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in REMAT_PRIMITIVES:
            n += 1
        for sub in _subjaxprs(eqn.params):
            n += count_remat_eqns(sub)
    return n


def remat_count(f: Callable[..., Any], *args: Any) -> int:
    """Checkpoint equations in the jaxpr of ``f(*args)``."""
    return count_remat_eqns(jax.make_jaxpr(f)(*args))


def assert_trees_close(a: Any, b: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb, f"tree structures differ:\n{ta}\n{tb}"
    assert la, "empty trees compare trivially; compare something"
    for x, y in zip(la, lb):
        if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def assert_clean_error(excinfo: pytest.ExceptionInfo, *fragments: str) -> None:
    """The error is one line, names the fix (``fragments``) and is raised from remat code."""
    msg = str(excinfo.value)
    assert "\n" not in msg, f"multi-line error message: {msg!r}"
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"
    frames = traceback.extract_tb(excinfo.tb)
    assert frames[-1].filename.startswith(REMAT_DIR), (
        f"raised from {frames[-1].filename}, not from remat"
    )
    assert not any("/jax/" in f.filename for f in frames), "raised after JAX started tracing"
    # exactly TypeError/ValueError: JAX's own errors (ConcretizationTypeError, ...) subclass them
    assert type(excinfo.value) in (TypeError, ValueError), type(excinfo.value)


# --- isolated tests ---------------------------------------------------------------------

_CHILD = "REMAT_ISOLATED_CHILD"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    if item.get_closest_marker("isolated") is None or os.environ.get(_CHILD):
        return
    env = {**os.environ, _CHILD: "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=", "-m", "",
         f"{item.path}::{item.name}" if item.cls is None else f"{item.path}::{item.cls.__name__}::{item.name}"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        pytest.fail(f"isolated run exited with status {proc.returncode}:\n{tail}", pytrace=False)
    # the child ran the test; skip the in-process call
    item.runtest = lambda: None  # type: ignore[method-assign]

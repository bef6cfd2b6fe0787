"""Runs one case spec: the program with remat, the same program plain, then compares."""
from __future__ import annotations

import functools
import os
import time
from typing import Any

import jax

from .checkpointer import Plain, Remat
from .compare import RTOL, assert_no_less_accurate, assert_same
from .nnx_stacks import run_nnx
from .programs import Program
from .transforms import place, transform


def _run_function(spec: dict, ck: Remat) -> list[Any]:
    program = Program(spec, ck)
    results = []
    for k in range(len(spec["calls"])):
        params = program.set_call(k)
        placed = place(spec["placement"], program)
        run = functools.partial(transform, spec["transform"], placed, seed=spec["seed"])
        if spec["placement"] not in ("none", "jit"):
            # the placement traces the program anyway: one compile for the whole transform,
            # not one per operation run eagerly around it (none and jit keep the eager outside)
            run = jax.jit(run)
        results.append(run(params))
    return results


def run_case(spec: dict) -> None:
    """Raises ``AssertionError`` if checkpointing changed anything (and whatever remat raises).

    The plain run goes first: if it raises, the spec is invalid, not remat.
    """
    if spec["kind"] == "selftest":  # the isolation's own tests: a case that aborts, hangs or passes
        _selftest(spec["action"])
        return
    run = run_nnx if spec["kind"] == "nnx" else _run_function
    try:
        want = run(spec, Plain())
    except Exception as e:
        raise InvalidSpec(f"the plain program fails: {type(e).__name__}: {e}") from e
    got = run(spec, Remat())
    reference = None
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        try:
            assert_same(g, w, RTOL[spec["dtype"]], what=f"result {k}")
        except AssertionError:
            if spec["dtype"] != "float32":
                raise
            # float32 second derivatives through softmax or exp lose more than rtol to rounding
            # alone, and checkpointing reorders sums: the arbiter is the same program in float64
            if reference is None:
                with jax.enable_x64(True):
                    reference = run(dict(spec, dtype="float64"), Plain())
            assert_no_less_accurate(g, w, reference[k], RTOL["float32"], what=f"result {k}")


def _selftest(action: str) -> None:
    if action == "abort":
        os.abort()
    if action == "hang":
        time.sleep(3600)


class InvalidSpec(Exception):
    """The strategies drew a program that fails without checkpointing: a bug of the suite."""

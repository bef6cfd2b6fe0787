"""Plain regression tests for the bugs the property-based suite (tests/test_fuzz.py) found."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from conftest import REMAT_PRIMITIVES, assert_trees_close

from remat import checkpoint

W = jnp.arange(16.0).reshape(4, 4) / 10
X = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)


def _block(w, x, *, scale):
    return jnp.sin(x @ w) * scale


def _loss_plain(w, x):
    return jnp.sum(_block(w, x, scale=2.0))


def _remat_eqn(f, *args):
    (eqn,) = [e for e in jax.make_jaxpr(f)(*args).jaxpr.eqns if e.primitive.name in REMAT_PRIMITIVES]
    return eqn


def test_partial_with_keywords_takes_per_argument_prevent_cse():
    # found by the fuzz suite: checkpoint(partial(f, scale=s), w, x, prevent_cse=(True, False))
    # raised "not a prefix of the non-static arguments", the partial's keywords counting
    # as call arguments the caller's flags had to cover
    f = lambda w, x: jnp.sum(checkpoint(functools.partial(_block, scale=2.0), w, x,  # noqa: E731
                                        prevent_cse=(True, False)))
    assert_trees_close(jax.grad(f, argnums=(0, 1))(W, X), jax.grad(_loss_plain, argnums=(0, 1))(W, X))
    assert _remat_eqn(f, W, X).params["prevent_cse"] == (True, False)


def test_partial_bound_positional_keeps_the_callers_flags_on_its_arguments():
    # the flags name the caller's arguments: the partial's bound w gets the default (True),
    # x gets the caller's False (before the fix, False landed on w and x got True)
    f = lambda w, x: jnp.sum(checkpoint(functools.partial(_block, w, scale=2.0), x,  # noqa: E731
                                        prevent_cse=(False,)))
    assert_trees_close(jax.grad(f, argnums=(0, 1))(W, X), jax.grad(_loss_plain, argnums=(0, 1))(W, X))
    assert _remat_eqn(f, W, X).params["prevent_cse"] == (True, False)


@pytest.mark.xfail(strict=True, raises=ValueError, reason=(
    "JAX 0.10 bug: jax.checkpoint's jvp rule (ad_checkpoint.remat_jvp) prepends the jvp jaxpr's "
    "constants to the operands without extending a per-argument prevent_cse tuple, so the "
    "outer region's partial eval/DCE (remat_dce) zips flags and operands of different lengths; "
    "hit by an inner prevent_cse tuple inside an outer region whose policy saves something"))
def test_inner_per_argument_prevent_cse_inside_a_saving_outer_region():
    # found by the fuzz suite (form "nested"): ValueError: safe_zip() argument 1 has length 4
    # but argument 0 has length 3; the same with jax.checkpoint alone (no remat involved)
    def outer(w, x):
        return checkpoint(lambda w, x: jnp.sin(x @ w), w, x, prevent_cse=(True, False))

    f = lambda w, x: jnp.sum(checkpoint(outer, w, x, policy="dots"))  # noqa: E731
    plain = lambda w, x: jnp.sum(jnp.sin(x @ w))  # noqa: E731
    assert_trees_close(jax.grad(f, argnums=(0, 1))(W, X), jax.grad(plain, argnums=(0, 1))(W, X))

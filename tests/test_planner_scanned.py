"""The default search plans steps whose checkpointed regions sit in a scanned body
(``lax.scan``, ``nnx.scan`` over an ``nnx.vmap`` stack): one decision for all the trips,
costed as many times as the scan runs; the plan fits and keeps the gradients."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from programs import stacked_layers

import remat
from remat.analysis.machine import current_rates
from remat.planner._costs import region_costs
from remat.planner.steering import apply_policies, survey
from remat.policies import NO_CHECKPOINT

DEPTH, WIDTH, BATCH = 6, 32, 32


def _block(w, h):
    return h + jnp.tanh(h @ w["w1"]) @ w["w2"]


def _lax_arrays():
    return stacked_layers(("w1", "w2"), DEPTH, WIDTH, BATCH)


def _lax_step():
    def loss(params, x):
        def body(h, w):
            return remat.checkpoint(_block, w, h), None
        h, _ = jax.lax.scan(body, x, params)
        return jnp.mean(h ** 2)

    return (loss, *_lax_arrays())


class Block(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, h):
        return h + self.down(jnp.tanh(self.up(h)))


def _nnx_step():
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return Block(WIDTH, rngs=nnx.Rngs(key))

    stack = make(jax.random.split(jax.random.key(0), DEPTH))
    remat.apply_checkpointing(stack, Block)
    graphdef, state = nnx.split(stack)

    def loss(state, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def body(layer, h):
            return layer(h)
        return jnp.mean(body(nnx.merge(graphdef, state), x) ** 2)

    return loss, state, jax.random.normal(jax.random.PRNGKey(1), (BATCH, WIDTH))


def _assert_planned_by_default_search(step, params, x, budget=0.5):
    p = remat.plan(step, params, x, memory_budget=budget, measure=False)
    labels = {c.label for c in p.candidates}
    # the compile-everything families (the step as written, the whole step checkpointed) are not weighed
    assert "as written" not in labels and not any(label.startswith("whole step") for label in labels)
    assert sum(c.compiled is not None for c in p.candidates) <= 4
    chosen = p.chosen
    assert p.feasible and chosen is not None and chosen.temp_bytes is not None
    assert chosen.temp_bytes <= p.limit_bytes
    unchecked = jax.jit(jax.grad(apply_policies(step, (NO_CHECKPOINT,))))(params, x)
    planned = jax.jit(jax.grad(p.apply(step)))(params, x)
    for a, b in zip(jax.tree.leaves(planned), jax.tree.leaves(unchecked), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    return p


def test_a_region_in_a_lax_scan_is_one_region_costed_once_per_trip():
    step, params, x = _lax_step()
    assert survey(step, params, x).regions == 1
    costs = region_costs(step, (params, x), 1, [NO_CHECKPOINT, "nothing"], rates=current_rates())
    assert costs is not None and costs.trips == [DEPTH]
    # not checkpointed, one trip keeps at least its hidden activation; "nothing", its input (the carry)
    assert costs.kept[0][0] >= BATCH * 4 * WIDTH * 4 and costs.kept[0][1] == BATCH * WIDTH * 4


def test_default_search_plans_a_lax_scan_step():
    _assert_planned_by_default_search(*_lax_step())


# slow: an nnx.scan traces to the lax.scan whose region test_default_search_plans_a_lax_scan_step
# plans in the default run
@pytest.mark.slow
def test_default_search_plans_an_nnx_scan_over_an_nnx_vmap_stack():
    step, state, x = _nnx_step()
    assert survey(step, state, x).regions == 1
    chosen = _assert_planned_by_default_search(step, state, x).chosen
    assert chosen is not None and len(chosen.policies) == 1


@pytest.mark.slow
def test_regions_inside_nested_scans_and_outside_are_planned_together():
    def loss(params, x):
        x = remat.checkpoint(_block, params["first"], x)

        def outer(h, ws):
            def body(h, w):
                return remat.checkpoint(_block, w, h), None
            return jax.lax.scan(body, h, ws)[0], None
        h, _ = jax.lax.scan(outer, x, params["stack"])
        return jnp.mean(remat.checkpoint(_block, params["last"], h) ** 2)

    def weights(key, *lead):
        k1, k2 = jax.random.split(key)
        return {"w1": jax.random.normal(k1, (*lead, WIDTH, 4 * WIDTH)) / WIDTH ** 0.5,
                "w2": jax.random.normal(k2, (*lead, 4 * WIDTH, WIDTH)) / (4 * WIDTH) ** 0.5}

    keys = jax.random.split(jax.random.PRNGKey(2), 4)
    params = {"first": weights(keys[0]), "stack": weights(keys[1], 3, 4), "last": weights(keys[2])}
    x = jax.random.normal(keys[3], (BATCH, WIDTH))
    costs = region_costs(loss, (params, x), 3, [NO_CHECKPOINT, "nothing"], rates=current_rates())
    assert costs is not None and costs.trips == [1, 12, 1]  # the inner region runs 3 x 4 times
    _assert_planned_by_default_search(loss, params, x)

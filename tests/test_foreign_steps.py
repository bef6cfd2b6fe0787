"""The oracle benchmark's steps written outside remat.models: four regions, exact gradients, real savings."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from benchmarks.foreign_steps import STEPS


@pytest.mark.slow  # the oracle benchmark's steps; the planner's own tests cover the same calls fast
@pytest.mark.parametrize("name", sorted(STEPS))
def test_each_step_has_four_regions_whose_checkpoints_keep_gradients_and_save_memory(name):
    from remat.planner.programs import lower_step
    from remat.planner.steering import apply_policies, count_regions

    loss, args = STEPS[name](seed=0)
    assert count_regions(loss, *args) == 4
    plain = jax.jit(jax.grad(loss))(*args)
    lean = apply_policies(loss, ("nothing",) * 4)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(jax.jit(jax.grad(lean))(*args))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    temp = {o: lower_step(apply_policies(loss, (o,) * 4), args).compile().memory_analysis().temp_size_in_bytes
            for o in ("no_checkpoint", "nothing")}
    assert temp["nothing"] < temp["no_checkpoint"], temp

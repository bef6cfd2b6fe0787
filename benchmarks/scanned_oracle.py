"""A small scanned stack with two tagged names, and its oracle: every option on the stack, and every two-segment split.

The step runs ``depth`` layers as one ``lax.scan`` over stacked weights, each layer a
``remat.checkpoint`` region tagging its hidden activation ``"hidden"`` and its output
``"out"``. The activations (``batch`` rows) are large next to a layer's weights, as in a
language model's long sequences, so that a split (say layers 0-2 ``nothing``, 3-5
``dots``) can fit a budget that no single option meets as fast. :mod:`benchmarks.optimality`
compiles every assignment of :func:`assignments` (``remat.plan``'s default search compiles
a handful) and compares the plan's time with the fastest that fits.
"""
from __future__ import annotations

import itertools
from typing import Any

#: The options of the stack: the planner's policies, and the tagged names kept together or alone.
OPTIONS: tuple[Any, ...] = ("no_checkpoint", "nothing", "dots_no_batch", "dots",
                            ("hidden", "out"), ("hidden",), ("out",))
#: The oracle's depth: every split of six layers between two of seven options is 217 programs.
DEPTH = 6


def scanned_step(depth: int = DEPTH, width: int = 32, batch: int = 512, seed: int = 0) -> tuple[Any, tuple]:
    """``(loss, (params, x))``: the stacked step; ``loss(params, x)`` is a scalar."""
    import jax
    import jax.numpy as jnp

    import remat

    def block(w: Any, h: Any) -> Any:
        hidden = remat.checkpoint_name(jnp.tanh(h @ w["up"]), "hidden")
        return h + remat.checkpoint_name(hidden @ w["down"], "out")

    def loss(params: Any, x: Any) -> Any:
        def body(h: Any, w: Any) -> tuple[Any, None]:
            return remat.checkpoint(block, w, h), None

        h, _ = jax.lax.scan(body, x, params)
        return jnp.mean(h ** 2)

    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    params = {"up": jax.random.normal(k1, (depth, width, 4 * width)) / width ** 0.5,
              "down": jax.random.normal(k2, (depth, 4 * width, width)) / (4 * width) ** 0.5}
    return loss, (params, jax.random.normal(k3, (batch, width)))


def assignments(depth: int, options: tuple[Any, ...] = OPTIONS) -> list[tuple[str, tuple[Any, ...], bool]]:
    """``(label, policies, whole_step)`` of every option on the whole stack, then every
    split of it into two segments with different options (``k`` layers, then ``depth - k``),
    as :mod:`benchmarks.optimality`'s oracle takes them.

    Example:
      >>> len(assignments(3, ("nothing", "dots", "no_checkpoint")))   # 3 whole, 3 * 2 pairs * 2 points
      15
    """
    from remat.planner._segments import Segments
    from remat.policies import policy_name

    out = [(policy_name(o), (o,), False) for o in options]
    for a, b in itertools.permutations(options, 2):
        for k in range(1, depth):
            split = Segments.of(((k, a), (depth - k, b)))
            out.append((str(split), (split,), False))
    return out

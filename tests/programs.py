"""The test programs several test modules share: one home, so that test files never import each other.

``from programs import ...`` in a test module (pytest puts ``tests/`` on ``sys.path``), or
``from tests.programs import ...`` in a child process started at the repository root.
Assertion helpers shared by every module stay in ``conftest.py``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

import remat
from remat._core.checkpoint import rematerialized
from remat.scan import scan_layers

# --- remat.plan: four residual blocks (test_planner, test_planner_assign, test_planner_monotone)

D, B, L = 32, 16, 4


def block(w, x):
    return x + jnp.tanh(jax.nn.gelu(x @ w[0]) @ w[1])


def loss(ws, x):
    for w in ws:
        x = remat.checkpoint(block, w, x)
    return (x**2).mean()


# made by NumPy and put on the device: eagerly, each jnp operation compiles a program at import
WS = [jnp.asarray(np.stack([np.eye(D, dtype=np.float32) * np.float32(0.3) + np.float32(0.01 * i)] * 2))
      for i in range(L)]


def batch_of(rows: int) -> jax.Array:
    """The blocks' input with ``rows`` rows (``X`` has ``B``)."""
    return jnp.asarray(np.linspace(-1, 1, rows * D, dtype=np.float32).reshape(rows, D))


X = batch_of(B)


def tagged_block(w, x):
    """:func:`block` with its two matmul outputs tagged ``"hidden"`` and ``"out"``."""
    h = remat.checkpoint_name(jax.nn.gelu(x @ w[0]), "hidden")
    return x + jnp.tanh(remat.checkpoint_name(h @ w[1], "out"))


def tagged_loss(ws, x):
    for w in ws:
        x = remat.checkpoint(tagged_block, w, x)
    return (x**2).mean()


# --- scanned steps the planner plans: a stack of two-matrix layers (test_planner_scanned,
# test_planner_schedules) ---------------------------------------------------------------------

@functools.cache
def stacked_layers(names: tuple[str, str], depth: int, width: int, batch: int) -> tuple[dict, jax.Array]:
    """``(params, x)``: ``depth`` layers of a ``width -> 4 * width`` and a ``4 * width -> width``
    matrix, stacked, under ``names``, and a ``(batch, width)`` input; drawn once, in one
    compiled program (drawn eagerly, each random primitive compiles on its own)."""
    @jax.jit
    def draw() -> tuple[dict, jax.Array]:
        k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
        params = {names[0]: jax.random.normal(k1, (depth, width, 4 * width)) / width ** 0.5,
                  names[1]: jax.random.normal(k2, (depth, 4 * width, width)) / (4 * width) ** 0.5}
        return params, jax.random.normal(k3, (batch, width))

    return draw()


# --- remat.scan: stacked layers against the unrolled loop (test_scan, test_scan_schedules) ---

def assert_trees_close(a, b, rtol=1e-5):
    """Equal to float32 accuracy: ``rtol`` relative to each leaf's largest entry."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb, strict=True):
        y = np.asarray(y)
        scale = float(np.max(np.abs(y))) if y.size else 0.0
        np.testing.assert_allclose(np.asarray(x), y, rtol=rtol, atol=rtol * scale + 1e-7)


def layer(p, x):
    pre = checkpoint_name(x @ p["w"] + p["b"], "pre")
    return x + jnp.tanh(pre)


def stacked(depth, d=8, seed=0):
    kw, kb = jax.random.split(jax.random.PRNGKey(seed))
    return {"w": jax.random.normal(kw, (depth, d, d)) * 0.5, "b": jax.random.normal(kb, (depth, d)) * 0.1}


def unrolled(params, x):
    depth = jax.tree.leaves(params)[0].shape[0]
    for i in range(depth):
        x = layer(jax.tree.map(lambda a, i=i: a[i], params), x)
    return x


@functools.lru_cache(maxsize=None)
def _unrolled_value_and_grads(depth):
    """The Python loop's value and gradients: the same for every policy and nesting."""
    params, x = stacked(depth), jax.random.normal(jax.random.PRNGKey(1), (3, 8))
    ref_loss = lambda p, x: jnp.sum(jnp.sin(unrolled(p, x)))  # noqa: E731
    return jax.jit(jax.value_and_grad(ref_loss, (0, 1)))(params, x)


def assert_scan_matches_unrolled(depth, policy, nesting):
    """Value and gradients of scan_layers equal the Python loop's."""
    params, x = stacked(depth), jax.random.normal(jax.random.PRNGKey(1), (3, 8))
    loss = lambda p, x: jnp.sum(jnp.sin(scan_layers(layer, p, x, policy=policy, **nesting)))  # noqa: E731
    # One jit per side: eager scans would compile every piece separately (slow).
    value, grads = jax.jit(jax.value_and_grad(loss, (0, 1)))(params, x)
    ref_value, ref_grads = _unrolled_value_and_grads(depth)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    assert_trees_close(grads, ref_grads)


def wide_layer(p, x):
    # Activations dominate: x is (2048, 64) = 512 KiB, weights 16 KiB.
    return x + jnp.tanh(jnp.tanh(x @ p["w"]) @ p["v"])


def wide_params(depth):
    kw, kv = jax.random.split(jax.random.PRNGKey(0))
    return {"w": jax.random.normal(kw, (depth, 64, 64)) * 0.1, "v": jax.random.normal(kv, (depth, 64, 64)) * 0.1}


WIDE_X = jnp.ones((2048, 64))


def nnx_block(rngs):
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.LayerNorm(8, rngs=rngs)
            self.lin = nnx.Linear(8, 8, rngs=rngs)

        def __call__(self, x):
            return x + jnp.tanh(self.lin(self.norm(x)))

    return Block(rngs)


def nnx_unrolled(layers, x, depth):
    from flax import nnx

    graphdef, state = nnx.split(layers)
    for i in range(depth):
        x = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))(x)
    return x


def linen_block():
    import flax.linen as nn

    class Block(nn.Module):
        features: int = 8

        @nn.compact
        def __call__(self, x):
            return x + jnp.tanh(nn.Dense(self.features)(nn.LayerNorm()(x)))

    return Block


# --- remat.analysis.compare_policies: pre-LN MLP blocks (test_memory, also in a child process) -

def mlp_factory(policy):
    # A factory: policy -> loss. Pre-LN MLP blocks, unrolled.
    blk = rematerialized(_pre_ln_block, policy)

    def loss(ps, x):
        for p in ps:
            x = blk(p, x)
        return jnp.sum(x ** 2)

    return loss


def _pre_ln_block(p, x):
    h = x - x.mean(-1, keepdims=True)
    h = h / jnp.sqrt((h * h).mean(-1, keepdims=True) + 1e-5)
    return x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]


def mlp_params(depth, d=32, hidden=64):
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * depth)
    return [{"w1": jax.random.normal(keys[2 * i], (d, hidden)) * 0.1,
             "w2": jax.random.normal(keys[2 * i + 1], (hidden, d)) * 0.1} for i in range(depth)]

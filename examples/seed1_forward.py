"""Seed 1, example 3: checkpointing a function of several inputs, ``x @ w + b``.

PyTorch original::

    def forward(x, w, b):
        return x @ w + b
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 2, requires_grad=True)
    b = torch.randn(2, requires_grad=True)
    res = checkpoint(forward, x, w, b, use_reentrant=False)
    res.sum().backward()
    print("Gradients computed")

In JAX the three gradients come from one ``jax.grad`` over all three arguments.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from remat import checkpoint
from remat.examples._common import max_abs_diff, result, try_import_torch  # examples/ installs as remat.examples


def forward(x, w, b):
    return x @ w + b


def run() -> dict:
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in ((4, 3), (3, 2), (2,))]

    def loss(x, w, b):
        return checkpoint(forward, x, w, b, use_reentrant=False).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2))(*map(jnp.asarray, arrays))
    print("Gradients computed")
    jax_result = "grads: " + ", ".join(f"{n}{tuple(g.shape)}" for n, g in zip("xwb", grads))

    torch = try_import_torch()
    if torch is None:
        return result("seed1 forward (x @ w + b)", jax_result, None, [], 1e-5)
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    tensors = [torch.tensor(a, requires_grad=True) for a in arrays]
    res = torch_checkpoint(forward, *tensors, use_reentrant=False)
    res.sum().backward()
    torch_result = "grads: " + ", ".join(f"{n}{tuple(t.grad.shape)}" for n, t in zip("xwb", tensors))
    diffs = [max_abs_diff(g, t.grad.numpy()) for g, t in zip(grads, tensors)]
    return result("seed1 forward (x @ w + b)", jax_result, torch_result, diffs, 1e-5)


if __name__ == "__main__":
    print(run())

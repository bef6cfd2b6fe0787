"""Seed 1, example 1: a model whose second Linear layer is checkpointed.

PyTorch original::

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(10, 20)
            self.fc2 = nn.Linear(20, 30)
        def forward(self, x):
            x = self.fc1(x)
            x = checkpoint(self.fc2, x, use_reentrant=False)
            return x

The JAX version is the same model in Flax NNX; ``checkpoint(self.fc2, x)`` has the
same call shape. The gradients are those of the un-checkpointed model: checkpointing
changes what the backward pass keeps (here only ``fc2``'s input), not what it computes.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from remat import checkpoint
from remat.examples._common import max_abs_diff, result, try_import_torch  # examples/ installs as remat.examples


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(10, 20, rngs=rngs)
        self.fc2 = nnx.Linear(20, 30, rngs=rngs)

    def __call__(self, x):
        x = self.fc1(x)
        x = checkpoint(self.fc2, x, use_reentrant=False)
        return x


def run() -> dict:
    x_np = np.random.default_rng(0).standard_normal((5, 10)).astype(np.float32)
    model = Model(nnx.Rngs(0))
    torch = try_import_torch()
    if torch is not None:
        torch.manual_seed(0)
        tmodel = _torch_model(torch)
        for name in ("fc1", "fc2"):  # torch Linear keeps (out, in); Flax keeps (in, out)
            layer, tlayer = getattr(model, name), getattr(tmodel, name)
            layer.kernel[...] = jnp.asarray(tlayer.weight.detach().numpy().T)
            layer.bias[...] = jnp.asarray(tlayer.bias.detach().numpy())

    def loss(model, x):
        return model(x).sum()

    (grads, x_grad) = nnx.grad(loss, argnums=(0, 1))(model, jnp.asarray(x_np))
    print("Backward completed")
    jax_result = f"|dL/dx|={float(jnp.linalg.norm(x_grad)):.6f}"
    if torch is None:
        return result("seed1 Model (fc2 checkpointed)", jax_result, None, [], 1e-5)

    x = torch.tensor(x_np, requires_grad=True)
    y = tmodel(x)
    y.sum().backward()
    diffs = [
        max_abs_diff(x_grad, x.grad.numpy()),
        max_abs_diff(grads.fc1.kernel[...], tmodel.fc1.weight.grad.numpy().T),
        max_abs_diff(grads.fc2.kernel[...], tmodel.fc2.weight.grad.numpy().T),
        max_abs_diff(grads.fc2.bias[...], tmodel.fc2.bias.grad.numpy()),
    ]
    torch_result = f"|dL/dx|={float(x.grad.norm()):.6f}"
    return result("seed1 Model (fc2 checkpointed)", jax_result, torch_result, diffs, 1e-5)


def _torch_model(torch):
    """The seed's PyTorch model, unchanged."""
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    class TorchModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(10, 20)
            self.fc2 = nn.Linear(20, 30)

        def forward(self, x):
            x = self.fc1(x)
            x = torch_checkpoint(self.fc2, x, use_reentrant=False)
            return x

    return TorchModel()


if __name__ == "__main__":
    print(run())

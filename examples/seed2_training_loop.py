"""Seed 2: a training loop with the ReLU between two 1000x1000 Linear layers checkpointed.

PyTorch original (corrected)::

    class MyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear1 = nn.Linear(1000, 1000)
            self.linear2 = nn.Linear(1000, 1000)
        def forward(self, x):
            y = self.linear1(x)
            y = torch.utils.checkpoint.checkpoint(self.activation, y, use_reentrant=False)
            y = self.linear2(y)
            return y
        def activation(self, x):
            return nn.functional.relu(x)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01); criterion = nn.MSELoss()
    for epoch in range(10): ...

Corrections to the seed:

* it calls ``torch.utils.checkpoint(self.activation, y)``; ``torch.utils.checkpoint`` is
  a module and calling it fails. The function is ``torch.utils.checkpoint.checkpoint``.
* it says checkpointing speeds training up. It does not: it trades extra computation
  (the checkpointed part runs again on the backward pass) for less activation memory,
  so a step is as fast or slower. Its use is fitting a bigger model or batch in memory.

The JAX version trains the same model with optax (``optax.sgd(0.01)``, mean squared
error), from the same initial weights and data, and compares the loss of every epoch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from remat import checkpoint
from remat.examples._common import result, try_import_torch  # examples/ installs as remat.examples

EPOCHS = 10
LR = 0.01


class MyModel(nnx.Module):
    def __init__(self, size: int = 1000, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(size, size, rngs=rngs)
        self.linear2 = nnx.Linear(size, size, rngs=rngs)

    def __call__(self, x):
        y = self.linear1(x)
        y = checkpoint(self.activation, y, use_reentrant=False)
        y = self.linear2(y)
        return y

    def activation(self, x):
        return jax.nn.relu(x)


def train_jax(model: MyModel, x, target, epochs: int = EPOCHS) -> list[float]:
    optimizer = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, target):
        def loss_fn(model):
            return jnp.mean((model(x) - target) ** 2)  # nn.MSELoss(): mean over all elements

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    return [float(step(model, optimizer, x, target)) for _ in range(epochs)]


def run(size: int = 1000, epochs: int = EPOCHS) -> dict:
    rng = np.random.default_rng(3)
    input_np = rng.standard_normal((size, size)).astype(np.float32)
    target_np = rng.standard_normal((size, size)).astype(np.float32)
    model = MyModel(size, rngs=nnx.Rngs(0))

    torch = try_import_torch()
    if torch is not None:
        torch.manual_seed(0)
        tmodel = _torch_model(torch, size)
        for name in ("linear1", "linear2"):  # torch Linear keeps (out, in); Flax (in, out)
            layer, tlayer = getattr(model, name), getattr(tmodel, name)
            layer.kernel[...] = jnp.asarray(tlayer.weight.detach().numpy().T)
            layer.bias[...] = jnp.asarray(tlayer.bias.detach().numpy())

    losses = train_jax(model, jnp.asarray(input_np), jnp.asarray(target_np), epochs)
    for epoch, loss in enumerate(losses):
        print(f"epoch {epoch}: loss {loss:.6f}")
    decreasing = all(b < a for a, b in zip(losses, losses[1:]))
    jax_result = f"loss {losses[0]:.6f} -> {losses[-1]:.6f}"
    if torch is None:
        return result("seed2 training loop (10 epochs, SGD)", jax_result, None, [], 1e-5, decreasing)

    torch_losses = _train_torch(torch, tmodel, input_np, target_np, epochs)
    torch_result = f"loss {torch_losses[0]:.6f} -> {torch_losses[-1]:.6f}"
    diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, torch_losses)]
    return result("seed2 training loop (10 epochs, SGD)", jax_result, torch_result, diffs, 1e-5, decreasing)


def _torch_model(torch, size: int):
    """The seed's PyTorch model, with the call fixed to torch.utils.checkpoint.checkpoint."""
    import torch.nn as nn
    import torch.utils.checkpoint

    class TorchMyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear1 = nn.Linear(size, size)
            self.linear2 = nn.Linear(size, size)

        def forward(self, x):
            y = self.linear1(x)
            y = torch.utils.checkpoint.checkpoint(self.activation, y, use_reentrant=False)
            y = self.linear2(y)
            return y

        def activation(self, x):
            return nn.functional.relu(x)

    return TorchMyModel()


def _train_torch(torch, model, input_np, target_np, epochs: int) -> list[float]:
    input_data, target_data = torch.tensor(input_np), torch.tensor(target_np)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    criterion = torch.nn.MSELoss()
    losses = []
    for _ in range(epochs):
        optimizer.zero_grad()
        output_data = model(input_data)
        loss = criterion(output_data, target_data)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    print(run())

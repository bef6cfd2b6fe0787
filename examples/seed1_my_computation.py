"""Seed 1, example 2: checkpointing a plain function of two tensors.

PyTorch original::

    def my_computation(x, y):
        return x * y
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(3, 4, requires_grad=False)
    res = checkpoint(my_computation, a, b, use_reentrant=False)
    res.sum().backward()
    print(a.grad)

Correction: the seed prints a matrix of ones as ``a.grad``. That is wrong: the
derivative of ``sum(a * b)`` with respect to ``a`` is ``b``, so ``a.grad`` equals ``b``
(PyTorch itself prints ``b``). This example checks exactly that, in JAX and in PyTorch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from remat import checkpoint
from remat.examples._common import max_abs_diff, result, try_import_torch  # examples/ installs as remat.examples


def my_computation(x, y):
    return x * y


def run() -> dict:
    rng = np.random.default_rng(1)
    a_np = rng.standard_normal((3, 4)).astype(np.float32)
    b_np = rng.standard_normal((3, 4)).astype(np.float32)
    a, b = jnp.asarray(a_np), jnp.asarray(b_np)

    # jax.grad differentiates with respect to `a` only: JAX's counterpart of
    # requires_grad=True on `a` and False on `b`.
    a_grad = jax.grad(lambda a: checkpoint(my_computation, a, b, use_reentrant=False).sum())(a)
    print(a_grad)
    grad_is_b = bool(jnp.array_equal(a_grad, b))
    jax_result = f"a.grad == b: {grad_is_b}"

    torch = try_import_torch()
    if torch is None:
        return result("seed1 my_computation (a.grad == b)", jax_result, None, [], 0.0, grad_is_b)
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    ta = torch.tensor(a_np, requires_grad=True)
    tb = torch.tensor(b_np, requires_grad=False)
    res = torch_checkpoint(my_computation, ta, tb, use_reentrant=False)
    res.sum().backward()
    torch_result = f"a.grad == b: {bool(torch.equal(ta.grad, tb))}"
    return result("seed1 my_computation (a.grad == b)", jax_result, torch_result,
                  [max_abs_diff(a_grad, ta.grad.numpy())], 0.0, grad_is_b)


if __name__ == "__main__":
    print(run())

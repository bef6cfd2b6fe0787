"""remat.crosscheck.torch_optim: torch.optim's arithmetic in optax, checked against torch step by step."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from remat.crosscheck import torch_optim  # noqa: E402
from remat.crosscheck.precision_runs import EXACT_ROUNDING  # noqa: E402
from remat.crosscheck.training import OPTIMIZERS, make_optimizers  # noqa: E402


def _differing_entries(name: str, dtype: str, tx_of: str, steps: int = 4, n: int = 4096) -> list[int]:
    """Per step, how many entries the JAX transformation puts elsewhere than torch.optim,
    both fed the same gradients (a tenth of the weights start at 0, as biases do)."""
    rng = np.random.default_rng(0)
    start = (rng.normal(size=n) * 0.1).astype(np.float32)
    start[: n // 10] = 0
    grads = [(rng.normal(size=n) * np.exp(rng.normal(size=n) * 3) * 1e-3).astype(np.float32) for _ in range(steps)]
    torch_param = torch.tensor(start).to(getattr(torch, dtype)).requires_grad_(True)
    optax_tx, torch_opt = make_optimizers(name, [torch_param], lr=1e-2)
    tx = torch_optim.from_torch(torch_opt) if tx_of == "torch_optim" else optax_tx

    @jax.jit
    def step(p, g, state):
        updates, state = tx.update(g, state, p)
        return optax.apply_updates(p, updates), state

    step = jax.jit(step.__wrapped__, compiler_options=EXACT_ROUNDING)
    param = jnp.asarray(start).astype(dtype)
    state = tx.init(param)
    differing = []
    for g in grads:
        torch_param.grad = torch.tensor(g).to(getattr(torch, dtype))
        torch_opt.step()
        param, state = step(param, jnp.asarray(torch_param.grad.float().numpy()).astype(dtype), state)
        differing.append(int(np.sum(np.asarray(param.astype(jnp.float32)) != torch_param.detach().float().numpy())))
    return differing


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_bfloat16_steps_land_where_torchs_do(name):
    ours = _differing_entries(name, "bfloat16", "torch_optim")
    if name.startswith("adam"):
        # torch's float32 sqrt on CPU is not correctly rounded; XLA's is: a few entries in 4096
        assert max(ours) <= 8, ours
    else:
        assert ours == [0, 0, 0, 0]
    # optax's own arithmetic (bfloat16 constants, another order) lands elsewhere: what this replaces
    assert sum(_differing_entries(name, "bfloat16", "optax")) > 40 * sum(ours) + 50


def test_float32_steps_are_within_two_ulps_of_torchs():
    rng = np.random.default_rng(1)
    start = rng.normal(size=256).astype(np.float32)
    p = torch.nn.Parameter(torch.tensor(start))
    opt = torch.optim.AdamW([p], lr=1e-2)
    tx = torch_optim.from_torch(opt)
    param, state = jnp.asarray(start), tx.init(jnp.asarray(start))
    for _ in range(3):
        g = rng.normal(size=256).astype(np.float32)
        p.grad = torch.tensor(g)
        opt.step()
        updates, state = tx.update(jnp.asarray(g), state, param)
        param = optax.apply_updates(param, updates)
    ours, theirs = np.asarray(param), p.detach().numpy()
    # torch's sqrt and its double-precision scalars: an ulp or two away, in a few entries
    assert np.all(np.abs(ours - theirs) <= 2 * np.spacing(np.abs(theirs)))
    assert np.mean(ours == theirs) > 0.9


def test_unreproduced_options_are_refused():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="amsgrad"):
        torch_optim.from_torch(torch.optim.AdamW(p, amsgrad=True))
    with pytest.raises(ValueError, match="L2"):
        torch_optim.from_torch(torch.optim.Adam(p, weight_decay=0.1))
    with pytest.raises(ValueError, match="RMSprop"):
        torch_optim.from_torch(torch.optim.RMSprop(p))

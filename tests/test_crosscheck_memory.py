"""``remat crosscheck MODEL --memory``: saved-for-backward bytes per module, a Flax model beside its twin.

A planted difference (``jax.nn.gelu`` keeps more than PyTorch's GELU, ``remat.ops.gelu``
keeps the same) is named; a checkpointed twin's blocks keep the same bytes in both.
"""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from remat.cli import main


def _gelu_twins(lean: bool):
    """An NNX model and its PyTorch twin (same names): Linear, GELU, Linear; the NNX GELU is
    remat.ops.gelu (keeps its input, as PyTorch's) or jax.nn.gelu (keeps more)."""
    torch = pytest.importorskip("torch")
    from remat import ops

    class Mid(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(16, 64, rngs=rngs)

        def __call__(self, x):
            h = self.fc(x)
            return ops.gelu(h) if lean else jax.nn.gelu(h, approximate=False)

    class Net2(nnx.Module):
        def __init__(self, rngs):
            self.mid = Mid(rngs)
            self.out = nnx.Linear(64, 8, rngs=rngs)

        def __call__(self, x):
            return self.out(self.mid(x))

    class TorchMid(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 64)

        def forward(self, x):
            return torch.nn.functional.gelu(self.fc(x))

    class TorchNet2(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mid, self.out = TorchMid(), torch.nn.Linear(64, 8)

        def forward(self, x):
            return self.out(self.mid(x))

    return Net2(nnx.Rngs(0)), TorchNet2(), (np.ones((32, 16), np.float32),)


def test_saved_bytes_per_module_match_pytorch_and_a_greedy_gelu_is_named():
    from remat.crosscheck.memory import compare_saved_bytes

    report = compare_saved_bytes(*_gelu_twins(lean=True), depth=1)
    assert not report.differing and report.jax_total == report.torch_total > 0
    report = compare_saved_bytes(*_gelu_twins(lean=False), depth=1)
    assert report.differing == ["mid"]  # jax.nn.gelu keeps more than its input
    row = next(r for r in report.rows if r.module == "mid")
    assert row.jax_bytes > row.torch_bytes


@pytest.mark.slow
def test_crosscheck_memory_of_a_checkpointed_twin(capsys):
    pytest.importorskip("torch")
    assert main(["crosscheck", "transformer", "--memory", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["module"]: r for r in out["memory"]["rows"]}
    assert out["memory"]["checkpointed"] == ["blocks.1", "blocks.0"]
    assert rows["blocks.0"]["jax_bytes"] == rows["blocks.0"]["torch_bytes"] > 0  # the block's input, both sides
    assert out["ok"] and not out["memory"]["differing"]

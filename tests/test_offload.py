"""Host offload as a per-region option: offered only where host memory is separate (GPU, TPU)."""
import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from programs import tagged_block, tagged_loss

import remat
from remat._core.residuals import saved_residuals
from remat.analysis.machine import UNCALIBRATED
from remat.planner import Plan, _families, plan
from remat.planner._costs import host_transfer_ms, region_costs
from remat.planner._families import NO_HOST_OFFLOAD, family_specs, host_offload_available, offload_groups
from remat.planner._saved import option
from remat.planner.steering import survey
from remat.policies import NO_CHECKPOINT, offload_names, policy_name

D, B, L = 16, 32, 3


block, loss = tagged_block, tagged_loss  # the planner's four blocks, tagged (tests/programs.py)


def plain_loss(ws, x):
    for w in ws:
        x = block(w, x)
    return (x**2).mean()


# made by NumPy and put on the device: eagerly, each jnp operation compiles a program at import
WS = [jnp.asarray(np.stack([np.eye(D, dtype=np.float32) * np.float32(0.3) + np.float32(0.01 * i)] * 2))
      for i in range(L)]
X = jnp.asarray(np.linspace(-1, 1, B * D, dtype=np.float32).reshape(B, D))
NOTE = NO_HOST_OFFLOAD.format(platform="cpu")


@functools.cache
def _plain_grads():
    """The un-checkpointed blocks' gradients, compiled once for the tests that compare with them."""
    return jax.jit(jax.grad(plain_loss))(WS, X)


def fake_device(platform, kinds):
    memories = [types.SimpleNamespace(kind=k) for k in kinds]
    return types.SimpleNamespace(platform=platform, addressable_memories=lambda: memories)


def test_host_offload_is_available_only_on_gpu_or_tpu_with_pinned_host():
    assert jax.devices()[0].platform == "cpu"
    # XLA:CPU lists a pinned_host memory kind, but it is the device's own memory
    assert "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()}
    assert not host_offload_available()
    assert not host_offload_available(jax.devices("cpu"))
    assert host_offload_available([fake_device("gpu", ["device", "pinned_host"])])
    assert host_offload_available([fake_device("tpu", ["device", "pinned_host", "unpinned_host"])])
    assert not host_offload_available([fake_device("gpu", ["device"])])
    assert not host_offload_available([fake_device("cpu", ["device", "pinned_host"])])
    assert not host_offload_available([])
    assert offload_groups(["hidden", "out"]) == []
    assert offload_groups(["hidden", "out"], [fake_device("gpu", ["device", "pinned_host"])]) == [
        offload_names("hidden", "out"), offload_names("hidden"), offload_names("out")]


def test_an_offload_option_is_spelled_and_read_back_like_a_names_option():
    assert policy_name(offload_names("out", "hidden")) == "offload:hidden,out"
    assert option("offload:hidden,out") == offload_names("hidden", "out")
    assert option(policy_name(offload_names("hidden"))) == offload_names("hidden")
    # not the planner's option (saves a name too): its own repr, which a saved plan refuses
    assert policy_name(offload_names("hidden", save=["out"])) == "offload_names('hidden')"


def test_an_offloaded_step_lowers_on_cpu_with_the_unchecked_gradients():
    policy = offload_names("hidden")

    def offloaded(ws, x):
        for w in ws:
            x = remat.checkpoint(block, w, x, policy=policy)
        return (x**2).mean()

    # the policy takes effect: the tagged values are kept in host memory...
    on_host = [r for r in saved_residuals(offloaded, WS, X) if r.memory_space == "host"]
    assert [r.nbytes for r in on_host] == [B * D * 4] * L
    # ...and on CPU JAX lowers the move to host as nothing, so the step compiles and runs
    got = jax.jit(jax.grad(offloaded))(WS, X)
    want = _plain_grads()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_offloaded_bytes_are_not_kept_on_the_device_but_cost_a_transfer():
    options = [NO_CHECKPOINT, ("hidden",), offload_names("hidden")]
    costs = region_costs(loss, (WS, X), L, options, rates=UNCALIBRATED)
    hidden = B * D * 4
    for kept, ms in zip(costs.kept, costs.ms):
        assert kept[2] == kept[1] - hidden
        assert ms[2] == pytest.approx(ms[1] + host_transfer_ms(hidden))
    assert host_transfer_ms(hidden) > 0


def test_on_cpu_the_plan_offers_no_offload_and_says_why_once():
    p = plan(loss, WS, X, memory_budget=0.6, measure=False, rates=UNCALIBRATED)
    assert p.feasible
    assert not any("offload" in c.label for c in p.candidates)
    assert p.not_offloaded == NOTE
    assert p.why().count(NOTE) == 1
    assert sum("host offload" in line for line in p.why()) == 1
    assert p.to_dict()["why"].count(NOTE) == 1
    # a step that tags nothing has nothing to offload: no line
    assert _families.offload_note([]) is None and _families.offload_note(["hidden"]) == NOTE


def test_with_host_memory_the_planner_weighs_offload_and_a_plan_keeps_it(monkeypatch, tmp_path):
    monkeypatch.setattr(_families, "host_offload_available", lambda devices=None: True)
    labels = [s.label for s in family_specs(survey(loss, WS, X), ["nothing"], ())]
    assert {"all: offload:hidden,out", "all: offload:hidden", "all: offload:out"} <= set(labels)
    p = plan(loss, WS, X, memory_budget=0.6, measure=False, rates=UNCALIBRATED)
    labels = {c.label for c in p.candidates}
    assert {"all: offload:hidden,out", "all: offload:hidden", "all: offload:out"} <= labels
    assert p.not_offloaded is None and not any("host offload" in line for line in p.why())
    # a plan that offloads is saved and loaded as such, and applies (on CPU, as nothing moved)
    policies = (offload_names("hidden"),) * (L - 1) + (NO_CHECKPOINT,)
    offloading = dataclasses.replace(p, chosen=dataclasses.replace(p.chosen, label="offloading", policies=policies))
    offloading.save(tmp_path / "plan.json")
    assert '"option": "offload:hidden"' in (tmp_path / "plan.json").read_text()
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.chosen.policies == policies
    got = jax.jit(jax.grad(loaded.apply(loss)))(WS, X)
    want = _plain_grads()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

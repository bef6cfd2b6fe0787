"""``--mesh data=D,fsdp=F``: the spec, the FSDP rules, a sharded training step, a sharded plan.

The spec and the rules are pure functions, checked here in this process. What needs 4
devices runs as ``isolated`` tests: each child process makes 4 CPU host devices before
JAX starts (the planning test in the default suite, the training step's with ``-m slow``).
The 20-step loss comparisons (one process and two) are in ``test_train.py``.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from remat.cli import main
from remat.cli._common import UsageError
from remat.cli._mesh import fsdp_spec, mesh_label, mesh_size, parse_mesh


def test_mesh_spec_parses_both_axes_and_defaults_the_missing_one_to_1():
    assert parse_mesh("data=2,fsdp=2") == {"data": 2, "fsdp": 2}
    assert parse_mesh("fsdp=4, data=1") == {"data": 1, "fsdp": 4}
    assert parse_mesh("data=8") == {"data": 8, "fsdp": 1}
    assert mesh_size(parse_mesh("data=3,fsdp=2")) == 6
    assert mesh_label(parse_mesh("fsdp=2")) == "data=1,fsdp=2"


@pytest.mark.parametrize("spec,fragment", [
    ("data", "AXIS=SIZE"), ("data=", "AXIS=SIZE"), ("data=two", "AXIS=SIZE"), ("data=-1", "AXIS=SIZE"),
    ("model=2", "unknown axis 'model'"), ("data=2,data=2", "given twice"), ("data=0", "at least 1"),
    ("", "AXIS=SIZE"),
])
def test_a_bad_mesh_spec_is_one_line(spec, fragment):
    with pytest.raises(UsageError) as e:
        parse_mesh(spec)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_fsdp_shards_the_largest_divisible_dimension_or_replicates():
    assert fsdp_spec((16, 64), 2) == P(None, "fsdp")  # the larger one
    assert fsdp_spec((64, 16), 4) == P("fsdp", None)
    assert fsdp_spec((64, 6), 4) == P("fsdp", None)
    assert fsdp_spec((3, 6), 4) == P()  # none divisible: replicated
    assert fsdp_spec((7,), 2) == P()  # an odd bias
    assert fsdp_spec((8,), 2) == P("fsdp")
    assert fsdp_spec((), 2) == P()  # Adam's step count
    assert fsdp_spec((32, 32), 2) == P("fsdp", None)  # equals: the first
    assert fsdp_spec((64, 16), 1) == P()  # no fsdp axis: plain data parallelism


@pytest.mark.parametrize("argv,fragments", [
    (["train", "mlp", "--mesh", "data=2,tp=2"], ["unknown axis 'tp'"]),
    (["train", "mlp", "--mesh", "data=2,fsdp=2", "--devices", "8"], ["spans 4 devices", "--devices is 8"]),
    (["train", "mlp", "--mesh", "data=2,fsdp=2", "--batch-size", "6"], ["--batch-size 6", "multiple of 4"]),
    (["train", "mlp", "--mesh", "data=3", "--coordinator", "h:1", "--num-processes", "2", "--process-id", "0"],
     ["spans 3 devices", "--num-processes 2"]),
    (["plan", "mlp", "--budget", "0.5", "--mesh", "fsdp=two"], ["AXIS=SIZE"]),
    (["plan", "mlp", "--budget", "0.5", "--mesh", "fsdp=2", "--batch-size", "3"], ["multiple of 2"]),
])
def test_bad_mesh_flags_are_one_line_exit_2_before_jax_runs(capsys, argv, fragments):
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.startswith("remat: error: ") and err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_a_mesh_larger_than_the_started_backend_is_one_line(capsys):
    import jax

    have = len(jax.devices())  # starts the backend here if no test did
    rc = main(["train", "mlp", "--mesh", f"data={have + 1}", "--batch-size", str(8 * (have + 1))])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and f"--mesh data={have + 1},fsdp=1" in err, err


def _leaf(tree: Any, *names: str) -> Any:
    """The array at the path whose keys include ``names`` (an NNX state, an optax moment)."""
    import jax

    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        if all(n in keys for n in names):
            return leaf
    raise KeyError(names)


def _four_cpu_devices() -> list:
    """4 CPU host devices; only in a fresh (``isolated``) process, before JAX's backend starts."""
    import jax

    from remat.analysis.process import jax_backend_started

    if not jax_backend_started():
        jax.config.update("jax_num_cpu_devices", 4)
    devices = jax.devices()
    assert len(devices) >= 4, "run this test isolated: JAX started with fewer devices"
    return devices[:4]


@pytest.mark.slow  # a child process and two compiles; the rules' fast check is fsdp_spec's test above
@pytest.mark.isolated
def test_a_sharded_step_keeps_parameters_and_adam_moments_sharded_over_fsdp():
    import jax
    import optax
    from flax import nnx

    from remat.cli import _mesh
    from remat.cli._train_loop import sharded_training
    from remat.models.tasks import make_task

    mesh = _mesh.make_mesh(parse_mesh("data=2,fsdp=2"), _four_cpu_devices())
    task = make_task("mlp", depth=1, width=16, batch_size=8)
    reference = nnx.split(task.model, nnx.Param, ...)  # the one-device start, before it is sharded
    state, shardings, step = sharded_training(task.model, task.loss, optax.adam(1e-2), mesh)
    inputs, targets = task.batch(0)
    batch = _mesh.batch_sharding(mesh)
    state, loss = step(state, _mesh.put_global(inputs, batch), _mesh.put_global(targets, batch))
    params, _, opt_state = state
    kernel, mu = _leaf(params, "inp", "kernel"), _leaf(opt_state[0].mu, "inp", "kernel")
    for leaf in (kernel, mu):  # (16, 16): split in two over fsdp, a copy on each data row
        assert leaf.sharding.spec == P("fsdp", None), leaf.sharding
        assert leaf.shape == (16, 16) and leaf.sharding.shard_shape(leaf.shape) == (8, 16)
        assert {s.data.shape for s in leaf.addressable_shards} == {(8, 16)}
    assert opt_state[0].count.sharding.spec == P()  # a scalar is replicated
    assert _mesh.bytes_per_device((params, opt_state)) < 0.6 * sum(
        x.nbytes for x in jax.tree.leaves((params, opt_state)))

    # the same step on one device: the same loss and, to float32 rounding, the same update
    graphdef, p0, rest0 = reference
    tx = optax.adam(1e-2)

    def one_device(p: Any) -> Any:
        return task.loss(nnx.merge(graphdef, p, rest0)(*inputs), inputs, targets)

    loss0, grads0 = jax.value_and_grad(one_device)(p0)
    updates, _ = tx.update(grads0, tx.init(p0), p0)
    np.testing.assert_allclose(float(loss), float(loss0), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(optax.apply_updates(p0, updates)), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.isolated
def test_a_sharded_step_is_planned_with_its_bytes_per_device():
    import jax

    from remat.cli import _mesh
    from remat.models.tasks import make_task, pure_step_loss
    from remat.planner import plan
    from remat.planner.steering import apply_policies

    mesh = _mesh.make_mesh(parse_mesh("data=2,fsdp=2"), _four_cpu_devices())
    # a batch large enough that the activations, split four ways, dominate the temp memory
    loss, step_args = pure_step_loss(make_task("mlp", depth=4, width=64, batch_size=512))
    sharded = _mesh.shard_step_args(step_args, mesh)
    p = plan(loss, *sharded, memory_budget=0.8, measure=False)
    assert p.feasible and p.chosen is not None

    def memory(args: tuple, **jit: Any) -> Any:
        return jax.jit(jax.grad(p.apply(loss)), **jit).lower(*args).compile().memory_analysis()

    param_shardings = jax.tree.map(lambda x: x.sharding, sharded[0])
    per_device = memory(sharded, out_shardings=param_shardings)  # gradients sharded as their parameters
    planned = p.chosen.compiled.memory_analysis()
    for figure in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes"):
        assert getattr(planned, figure) == getattr(per_device, figure), figure
    assert p.chosen.temp_bytes == per_device.temp_size_in_bytes <= p.limit_bytes

    whole = memory(step_args)  # the same plan on one device
    assert per_device.temp_size_in_bytes < 0.6 * whole.temp_size_in_bytes
    assert per_device.argument_size_in_bytes < 0.6 * whole.argument_size_in_bytes
    # the gradients are sharded as the parameters: each device holds its shards of them, not all
    # (beside them, both outputs hold the same few bytes: XLA's table of the output buffers)
    n_param_bytes = sum(x.nbytes for x in jax.tree.leaves(step_args[0]))
    assert _mesh.bytes_per_device(sharded[0]) < 0.6 * n_param_bytes
    assert per_device.output_size_in_bytes - _mesh.bytes_per_device(sharded[0]) \
        == whole.output_size_in_bytes - n_param_bytes
    # the un-checkpointed step, the budget's yardstick, is per device too
    none = next(c for c in p.candidates if c.label == "no checkpoint")
    none_step = jax.jit(jax.grad(apply_policies(loss, none.policies)), out_shardings=param_shardings)
    none_memory: Any = none_step.lower(*sharded).compile().memory_analysis()
    assert p.none_temp_bytes == none_memory.temp_size_in_bytes

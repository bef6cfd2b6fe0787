"""``--mesh data=D,fsdp=F``: the device mesh, and where each array of a sharded training step lives.

The mesh has two axes. ``data`` splits the batch; ``fsdp`` splits the parameters and the
optimizer state (fully sharded data parallelism, ZeRO-3): each such array is sharded over
``fsdp`` on its largest dimension that ``F`` divides, and replicated when none does. XLA
all-gathers a parameter where the step uses it and reduce-scatters its gradient, so each
device keeps ``1/F`` of the state between steps. The batch is split over both axes, as
FSDP does: the ``fsdp`` devices are data-parallel too (each computes its own rows with the
gathered parameters), otherwise they would compute the same rows twice. Without
``--mesh``, ``--devices N`` is the mesh ``data=N,fsdp=1``: plain data parallelism.

Example:
  >>> parse_mesh("data=2,fsdp=2")
  {'data': 2, 'fsdp': 2}
  >>> fsdp_spec((16, 64), 2)
  PartitionSpec(None, 'fsdp')
"""
from __future__ import annotations

import math
from typing import Any

from remat.cli._common import UsageError

MESH_AXES = ("data", "fsdp")
#: the batch's leading axis is split over both mesh axes (see the module docstring)
BATCH_AXES = ("data", "fsdp")
MESH_EXAMPLE = "e.g. --mesh data=2,fsdp=2"


def parse_mesh(text: str) -> dict[str, int]:
    """The axis sizes of a ``--mesh`` spec such as ``data=2,fsdp=2``; an axis left out has size 1.

    Args:
      text: comma-separated ``AXIS=SIZE`` items, each axis one of :data:`MESH_AXES` at most once.

    Returns:
      ``{"data": D, "fsdp": F}``, in that order.

    Raises:
      UsageError: a malformed item, an unknown or repeated axis, a size below 1 (one line).

    Example:
      >>> parse_mesh("fsdp=4")
      {'data': 1, 'fsdp': 4}
    """
    sizes: dict[str, int] = {}
    for item in text.split(","):
        axis, eq, size = (part.strip() for part in item.partition("="))
        if not eq or not axis or not size.isdigit():
            raise UsageError(f"--mesh {text!r}: expected AXIS=SIZE items separated by commas, {MESH_EXAMPLE}")
        if axis not in MESH_AXES:
            raise UsageError(f"--mesh {text!r}: unknown axis {axis!r}; the axes are {' and '.join(MESH_AXES)}")
        if axis in sizes:
            raise UsageError(f"--mesh {text!r}: axis {axis!r} is given twice")
        if int(size) < 1:
            raise UsageError(f"--mesh {text!r}: axis {axis!r} must have size at least 1, got {size}")
        sizes[axis] = int(size)
    return {axis: sizes.get(axis, 1) for axis in MESH_AXES}


def mesh_size(sizes: dict[str, int]) -> int:
    """How many devices the mesh spans: the product of its axis sizes."""
    return math.prod(sizes.values())


def mesh_label(sizes: dict[str, int]) -> str:
    """The spec as the flag spells it, e.g. ``data=2,fsdp=2``."""
    return ",".join(f"{axis}={size}" for axis, size in sizes.items())


def make_mesh(sizes: dict[str, int], devices: list[Any]) -> Any:
    """The ``jax.sharding.Mesh`` of ``sizes`` over ``devices`` (their count must be the mesh's size).

    The devices fill the mesh in order, ``fsdp`` varying fastest: in a multi-process run
    (``jax.devices()`` lists each process's devices together) an ``fsdp`` group lies within
    one process where it fits, so the parameter all-gathers stay local.
    """
    import numpy as np
    from jax.sharding import Mesh

    if len(devices) != mesh_size(sizes):
        raise UsageError(f"--mesh {mesh_label(sizes)} spans {mesh_size(sizes)} devices, but {len(devices)} "
                         "are used; make the product of the sizes the device count")
    return Mesh(np.array(devices).reshape(tuple(sizes.values())), tuple(sizes))


def fsdp_spec(shape: tuple[int, ...], fsdp: int) -> Any:
    """Where an array of ``shape`` is split over the ``fsdp`` axis of size ``fsdp``.

    Its largest dimension that ``fsdp`` divides (the first of equals) is sharded; an array
    with no such dimension (a scalar, a bias of odd length), or any array when ``fsdp`` is
    1, is replicated.

    Example:
      >>> fsdp_spec((3, 8), 2), fsdp_spec((3,), 2)
      (PartitionSpec(None, 'fsdp'), PartitionSpec())
    """
    from jax.sharding import PartitionSpec

    divisible = [i for i, d in enumerate(shape) if d % fsdp == 0] if fsdp > 1 else []
    if not divisible:
        return PartitionSpec()
    dim = max(divisible, key=lambda i: (shape[i], -i))
    return PartitionSpec(*(["fsdp" if i == dim else None for i in range(len(shape))]))


def fsdp_shardings(tree: Any, mesh: Any) -> Any:
    """A ``NamedSharding`` for each array of ``tree`` (parameters, optimizer state), by :func:`fsdp_spec`."""
    import jax
    from jax.sharding import NamedSharding

    fsdp = mesh.shape["fsdp"]
    return jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(tuple(x.shape), fsdp)), tree)


def batch_sharding(mesh: Any) -> Any:
    """The batch's sharding: its leading axis split over :data:`BATCH_AXES`."""
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def replicated(mesh: Any) -> Any:
    """A copy on every device of the mesh (the loss; non-parameter state such as BatchNorm statistics)."""
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec())


def check_batch(batch_size: int, mesh: Any) -> None:
    """Fails in one line when the batch does not split evenly over the mesh's devices."""
    n = mesh.devices.size
    if batch_size % n:
        raise UsageError(f"batch size {batch_size} does not split evenly over {n} devices (the batch is split "
                         f"over {' and '.join(BATCH_AXES)}); use a multiple of {n} (--batch-size)")


def put_global(tree: Any, sharding: Any) -> Any:
    """Arrays of ``sharding`` from host arrays every process holds whole (each puts only its shards).

    Unlike ``jax.device_put``, it works for any sharding in a multi-process run, where each
    process can write only its own devices.
    """
    import jax
    import numpy as np

    def one(x: Any) -> Any:
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(one, tree)


def bytes_per_device(tree: Any) -> int:
    """The bytes one device holds of ``tree``'s arrays: the largest shard of each, summed."""
    import jax

    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def replicated_tree(tree: Any, mesh: Any) -> Any:
    """:func:`replicated` for every array of ``tree``."""
    import jax

    return jax.tree.map(lambda _: replicated(mesh), tree)


def shard_step_args(step_args: tuple, mesh: Any) -> tuple:
    """``(params, inputs, targets)`` of :func:`remat.models.tasks.pure_step_loss` placed on ``mesh``.

    The parameters by :func:`fsdp_shardings`, the batch by :func:`batch_sharding`: the
    arguments of the step ``remat train --mesh`` runs, so that :func:`remat.plan` compiles
    it as sharded and reports its bytes per device.
    """
    import jax

    params, inputs, targets = step_args
    batch = batch_sharding(mesh)
    return (jax.device_put(params, fsdp_shardings(params, mesh)), jax.device_put(inputs, batch),
            jax.device_put(targets, batch))

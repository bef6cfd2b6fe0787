"""remat: PyTorch's activation checkpointing (``torch.utils.checkpoint``) for JAX and Flax.

The public surface::

    remat.checkpoint(fn, *args, policy=None, ...)    # call form, decorator, Flax modules
    remat.checkpoint_sequential(functions, segments, input)
    remat.checkpoint_name(x, "name")                 # tag a value for name-based policies
    remat.policies                                   # named and composable policies
"""
from remat._xla_flags import configure_cpu_for_remat as _configure_cpu_for_remat

# Must run before anything starts a JAX backend: XLA reads its flags once, at start-up.
_configure_cpu_for_remat()

from jax.ad_checkpoint import checkpoint_name  # noqa: E402

from remat import policies  # noqa: E402
from remat._checkpoint import checkpoint  # noqa: E402
from remat.policies import CheckpointPolicy  # noqa: E402
from remat.sequential import checkpoint_sequential  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "CheckpointPolicy",
    "checkpoint",
    "checkpoint_name",
    "checkpoint_sequential",
    "policies",
]

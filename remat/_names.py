"""Names the library and its command line share: constants with no imports, cheap for ``--help``."""
from __future__ import annotations

from typing import Any

#: "Do not checkpoint this region": the one spelling of it, accepted wherever a policy is.
#: It is never ``None``, which means "checkpoint, keep nothing but the inputs".
NO_CHECKPOINT = "no_checkpoint"

#: The named JAX policies (:data:`remat.policies.NAMED_POLICIES` maps them to JAX's).
NAMED_POLICY_NAMES: tuple[str, ...] = ("nothing", "everything", "dots", "dots_no_batch")

#: Every policy name, in the order reports list them.
POLICY_NAMES: tuple[str, ...] = (NO_CHECKPOINT, *NAMED_POLICY_NAMES)

#: The optimizers the PyTorch cross-check maps between torch.optim and optax.
CROSSCHECK_OPTIMIZERS: tuple[str, ...] = ("sgd", "momentum", "nesterov", "adam", "adamw")


def is_no_checkpoint(policy: Any) -> bool:
    """True for :data:`NO_CHECKPOINT`, "do not checkpoint"."""
    return isinstance(policy, str) and policy == NO_CHECKPOINT

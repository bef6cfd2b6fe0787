"""Rematerialization policies: what the backward pass may keep instead of recomputing.

A JAX policy is a tiny predicate ``policy(primitive, *avals, **params) -> bool | Saveable |
Offloadable | Recompute`` consulted for every operation inside a checkpointed region
(see ``jax/_src/ad_checkpoint.py``). This package gives those predicates names a PyTorch
user can read, and small constructors that compose. Each constructor returns a frozen
dataclass, as ``jax.checkpoint_policies`` does: equal policies are equal and hash equal
(so traces are shared), print as they were written, and pickle.

Every ``policy=`` argument in ``remat`` accepts:

* ``None`` or ``"nothing"``: keep only the region's inputs, recompute everything else
  (what ``torch.utils.checkpoint.checkpoint`` does);
* ``"everything"``: keep every intermediate (no recomputation: checkpointing switched off);
* ``"dots"``: keep the results of matrix multiplies and convolutions, recompute the
  cheap element-wise work in between;
* ``"dots_no_batch"``: as ``"dots"``, but only for matmuls without batch dimensions
  (weights-times-activations, not attention's batched ``q @ k``);
* a sequence of names, e.g. ``["attn_out"]``: keep only the values tagged with
  :func:`remat.checkpoint_name`;
* any callable JAX policy, including the constructors below.

Example:
  >>> import jax, jax.numpy as jnp, remat
  >>> def block(w, x):
  ...     h = remat.checkpoint_name(jnp.tanh(x @ w), "hidden")
  ...     return jnp.sin(h @ w)
  >>> f = remat.checkpoint(block, policy=remat.policies.save_names("hidden"))
  >>> g = jax.grad(lambda w, x: f(w, x).sum())(jnp.eye(3), jnp.ones((2, 3)))

References:
  Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016.
  https://docs.jax.dev/en/latest/gradient-checkpointing.html
  https://pytorch.org/docs/stable/checkpoint.html (selective activation checkpoint)
"""
from __future__ import annotations

from remat._names import NO_CHECKPOINT, POLICY_NAMES, is_no_checkpoint
from remat.policies._by_name import OffloadNames, SaveAllBut, SaveNames, offload_names, save_all_but, save_names
from remat.policies._compose import AnyOf, any_of
from remat.policies._resolve import NAMED_POLICIES, Policy, PolicySpec, policy_name, resolve_policy
from remat.policies._selective import TORCH_OP_ALIASES, AskFunction, CheckpointPolicy, SaveOps, selective

__all__ = [
    "NAMED_POLICIES",
    "NO_CHECKPOINT",
    "POLICY_NAMES",
    "TORCH_OP_ALIASES",
    "AnyOf",
    "AskFunction",
    "CheckpointPolicy",
    "OffloadNames",
    "Policy",
    "PolicySpec",
    "SaveAllBut",
    "SaveNames",
    "SaveOps",
    "any_of",
    "is_no_checkpoint",
    "offload_names",
    "policy_name",
    "resolve_policy",
    "save_all_but",
    "save_names",
    "selective",
]

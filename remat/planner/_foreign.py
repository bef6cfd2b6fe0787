"""Regions written with ``jax.checkpoint``, ``nnx.remat`` or ``nn.remat``: found in the step's jaxpr, re-policied there.

Such a region never calls remat, so no decider (:mod:`remat._core.hooks`) sees it. The
planner finds it where every checkpoint ends up, as a checkpoint equation of the step's
jaxpr, and realises an option by rewriting that equation in a copy of the jaxpr, which
the planned step evaluates in place of the step. Why the jaxpr and not an interception
of ``jax.checkpoint`` while the step is traced: ``nnx.remat`` and ``nn.remat`` hold
their own references to JAX's function, so an interception would have to patch JAX and
Flax modules, which other threads and the host program would see; a rewritten copy of a
jaxpr changes nothing outside the planned step, and the equation looks the same however
it was written (``jax_remat3``'s construct included, rewritten as the classic one).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from remat import _jax as xb
from remat._core.hooks import RegionChooser
from remat._core.lowering import RegionPolicy, classic_checkpoint, mark_region
from remat.policies import is_no_checkpoint, resolve_policy

#: The option that leaves a region as its code wrote it (``remat.planner.AS_WRITTEN``).
AS_WRITTEN = "as written"

#: Equations whose inner jaxprs are not searched: a ``while`` loop's trip count is not known
#: (as the region costs, :mod:`remat.planner._costs`), and a custom derivative's rules are
#: traced from the original function, so a rewritten copy of its body would not be differentiated.
_UNSEARCHED = frozenset({"while", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"})

#: ``(eqn) -> eqn``: what becomes of each foreign region, in trace order.
Decide = Callable[[Any], Any]


def is_foreign(eqn: Any) -> bool:
    """Whether ``eqn`` is a checkpoint equation remat did not make (remat's carry a :class:`RegionPolicy`)."""
    return xb.checkpoint_body(eqn) is not None and not isinstance(xb.checkpoint_policy(eqn), RegionPolicy)


def rewrite(jaxpr: Any, decide: Decide, remat_too: bool = False) -> Any:
    """``jaxpr`` with each foreign region's equation replaced by ``decide(eqn)``, in trace
    order: through jits, calls, conds and scan bodies, not into regions (a region inside
    another is the outer one's business) nor into :data:`_UNSEARCHED`. ``remat_too``:
    remat's own regions are passed to ``decide`` too (in their place in the order)."""
    eqns, changed = [], False
    for eqn in jaxpr.eqns:
        new = eqn
        if xb.checkpoint_body(eqn) is not None:
            if remat_too or is_foreign(eqn):
                new = decide(eqn)
        elif eqn.primitive.name not in _UNSEARCHED:
            new = xb.with_subjaxprs(eqn, lambda inner: rewrite(inner, decide, remat_too))
        changed |= new is not eqn
        eqns.append(new)
    return xb.replace_eqns(jaxpr, eqns) if changed else jaxpr


def region_path(eqn: Any) -> tuple[str, str, int]:
    """A foreign region's name, the same in every process that traces the same step:
    ``(what wrote it, the function checkpointed, its number of inputs)``, e.g.
    ``("nnx.remat", "body", 3)``."""
    return _writer(eqn), xb.checkpoint_function_name(eqn), len(eqn.invars)


def path_text(path: Sequence[Any]) -> str:
    """A foreign region's path in words, e.g. ``nnx.remat(body) with 3 inputs``."""
    writer, name, inputs = path
    return f"{writer}({name}) with {inputs} inputs"


def _writer(eqn: Any) -> str:
    """Which transform made a checkpoint equation: Flax's lifted ones show in the frames that traced it."""
    files = [file.replace("\\", "/") for file, _, _ in xb.frames(eqn)]
    if any("/flax/nnx/" in f for f in files):
        return "nnx.remat"
    if any("/flax/linen/" in f or "/flax/core/" in f for f in files):
        return "nn.remat"
    return "jax.checkpoint"


def choice(spec: Any) -> Decide:
    """What a region's equation becomes under the option ``spec``: unchanged
    (``AS_WRITTEN``), a plain call of its body (``NO_CHECKPOINT``), or a checkpoint with the
    policy, marked as remat's own so that it lowers as remat's regions do
    (:mod:`remat._core.lowering`: on CPU the recomputation waits for its cotangent)."""
    if spec == AS_WRITTEN:
        return lambda eqn: eqn
    if is_no_checkpoint(spec):
        return xb.inlined_checkpoint
    policy = resolve_policy(spec)
    if isinstance(policy, RegionChooser):  # a residual budget: its policy picked from the region's inputs
        return lambda eqn: xb.as_checkpoint(eqn, mark_region(_chosen_policy(policy, eqn)))
    marked = mark_region(policy)
    return lambda eqn: xb.as_checkpoint(eqn, marked)


def _chosen_policy(chooser: RegionChooser, eqn: Any) -> Any:
    """The policy ``chooser`` picks for the region of ``eqn``, from its body and input shapes."""
    body = xb.closed_jaxpr(xb.checkpoint_body(eqn))
    run = xb.jaxpr_function(body)
    inputs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in body.jaxpr.invars]
    return chooser.choose_policy(lambda policy: classic_checkpoint(run, policy=policy), inputs)


def traced(step_fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> tuple[Any, Callable[..., Any]]:
    """The jaxpr of ``step_fn(*args, **kwargs)`` (closed, over the array leaves of the
    arguments; the other leaves are fixed), and ``run(jaxpr)``: evaluates that jaxpr, or
    one rewritten from it, on the arrays in the current trace, and returns the step's
    outputs as the step would."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    traced_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, np.ndarray, np.generic))]
    arrays = [leaves[i] for i in traced_at]

    def fixed_step(*xs: Any) -> Any:
        filled = list(leaves)
        for i, x in zip(traced_at, xs):
            filled[i] = x
        a, k = jax.tree.unflatten(tree, filled)
        return step_fn(*a, **k)

    closed, shapes = jax.make_jaxpr(fixed_step, return_shape=True)(*arrays)

    def run(jaxpr: Any) -> Any:
        return jax.tree.unflatten(jax.tree.structure(shapes), xb.eval_closed_jaxpr(closed, jaxpr, *arrays))

    return closed, run

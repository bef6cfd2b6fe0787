"""scan_layers: a pure layer scanned over stacked parameters, flat, in equal groups or by a schedule."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from remat._core.checkpoint import rematerialized
from remat._core.hooks import current
from remat._core.lowering import classic_checkpoint, mark_region
from remat.scan.schedules import Schedule, _check_groups, _groups, _schedule_depth

__all__ = ["scan_layers"]


def _maybe_checkpoint(fn: Callable, policy: Any) -> Callable:
    # Inside a scan, XLA cannot CSE the recomputation into the forward loop, so the
    # optimization barriers of prevent_cse=True would only cost time (JAX docs).
    return rematerialized(fn, policy, prevent_cse=False)


def _depth(params: Any) -> int:
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    if not leaves:
        raise ValueError("params has no arrays; pass the layers' parameters stacked along axis 0")
    sizes = {}
    for path, leaf in leaves:
        shape = getattr(leaf, "shape", ())
        if len(shape) == 0:
            raise ValueError(
                f"params leaf {jax.tree_util.keystr(path)} is a scalar; every leaf needs a leading "
                "layer axis (stack per-layer parameters with jax.tree.map(lambda *p: jnp.stack(p), *layers))"
            )
        sizes.setdefault(int(shape[0]), jax.tree_util.keystr(path))
    if len(sizes) > 1:
        seen = ", ".join(f"{n} ({where})" for n, where in sizes.items())
        raise ValueError(
            f"params leaves have different leading (layer) axes: {seen}; stack every layer's "
            "parameters along axis 0 with the same depth"
        )
    (depth,) = sizes
    if depth == 0:
        raise ValueError("params have a leading axis of size 0; a stack needs at least one layer")
    return depth


# --------------------------------------------------------------------------------------
# Runners: flat, equal groups, schedules
# --------------------------------------------------------------------------------------


def _runs(schedule: tuple) -> list[tuple[Schedule, int]]:
    """Consecutive identical children as ``(child, count)``."""
    runs: list[tuple[Schedule, int]] = []
    for c in schedule:
        if runs and runs[-1][0] == c:
            runs[-1] = (c, runs[-1][1] + 1)
        else:
            runs.append((c, 1))
    return runs


def _split(params: Any, sizes: list[int]) -> list[Any]:
    """``params`` cut along axis 0 into pieces of ``sizes`` (one ``split``; its transpose concatenates)."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    cut = [lax.split(a, sizes, axis=0) for a in leaves]
    return [jax.tree_util.tree_unflatten(treedef, [c[j] for c in cut]) for j in range(len(sizes))]


def _concat(ys: list[Any]) -> Any:
    if len(ys) == 1:
        return ys[0]
    return jax.tree.map(lambda *a: lax.concatenate(a, 0), *ys)


def _opaque_true() -> Any:
    """``True``, hidden from XLA's constant folding (an unbatched value under ``vmap``)."""
    import jax.numpy as jnp

    return lax.optimization_barrier(jnp.array(True))


def _run_schedule(schedule: Schedule, step: Callable, params: Any, x: Any, unroll: int) -> tuple[Any, Any]:
    """Runs ``step`` (``(h, p_i) -> (h, y_i)``, already checkpointed per layer) over a schedule.

    Returns the last carry and the per-layer outputs stacked in layer order.
    """
    if isinstance(schedule, int):
        return lax.scan(step, x, params, unroll=unroll)
    runs = _runs(schedule)
    sizes = [count * _schedule_depth(child) for child, count in runs]
    pieces = [params] if len(runs) == 1 else _split(params, sizes)
    ys = []
    for (child, count), piece in zip(runs, pieces):
        if count == 1:
            # A lone child, checkpointed. Two things keep its recomputation in its own
            # backward step: prevent_cse=True keeps the barrier that ties it to its
            # cotangent (see remat._core.lowering), and the cond (whose predicate XLA cannot
            # fold; both branches are the child) scopes the buffers of the recomputed
            # scan to the branch. Without the cond, XLA:CPU allocates every child's
            # stacked layer inputs at the start of the program and keeps them all:
            # measured (9, 7) at depth 16: 23.5 layer inputs of temp memory against 15-17.
            ck = classic_checkpoint(lambda h, p, child=child: _run_schedule(child, step, p, h, unroll),
                                    prevent_cse=True, policy=mark_region(None))
            x, y = lax.cond(_opaque_true(), ck, ck, x, piece)
        else:
            x, y = _run_groups(child, count, step, piece, x, unroll)
        ys.append(y)
    return x, _concat(ys)


def _run_groups(child: Schedule, count: int, step: Callable, params: Any, x: Any, unroll: int) -> tuple[Any, Any]:
    """``count`` identical checkpointed children: one outer ``lax.scan``, compiled once."""
    n = _schedule_depth(child)
    grouped = jax.tree.map(lambda a: a.reshape(count, n, *a.shape[1:]), params)

    def group(h, gp):
        return _run_schedule(child, step, gp, h, unroll)

    # The group keeps only its input ("nothing"): any policy that saved more would keep
    # per-layer values of every group and undo the sqrt(N) saving. Inside a scan XLA
    # cannot hoist the recomputation, so the barriers of prevent_cse=True would only cost.
    x, y = lax.scan(classic_checkpoint(group, prevent_cse=False), x, grouped)
    return x, jax.tree.map(lambda a: a.reshape(count * n, *a.shape[2:]), y)


def _run(depth: int, groups: int | Schedule | None, step: Callable, params: Any, x: Any,
         unroll: int) -> tuple[Any, Any]:
    """One scan as ``_scan_plan`` decided: flat, ``k`` equal groups, or a schedule."""
    if groups is None:
        return lax.scan(step, x, params, unroll=unroll)
    if isinstance(groups, int):  # always the outer scan, even for k = 1 (as before schedules)
        return _run_groups(depth // groups, groups, step, params, x, unroll)
    return _run_schedule(groups, step, params, x, unroll)


def _planned_run(depth: int, policy: Any, groups: int | Schedule | None, step: Callable, params: Any, x: Any,
                 unroll: int) -> tuple[Any, Any]:
    """``step`` (``(h, p_i) -> (h, y_i)``) checkpointed with ``policy`` and run as ``groups``
    says (:func:`_run`). A policy with ``parts``, ``((count, policy), ...)`` summing to the
    depth (a planner's split of the stack, :class:`remat.planner._segments.Segments`), runs
    as consecutive flat scans, one per part with its own policy, over consecutive slices
    of ``params``."""
    parts = getattr(policy, "parts", None)
    if parts is None:
        return _run(depth, groups, _maybe_checkpoint(step, policy), params, x, unroll)
    ys = []
    for (_, part_policy), piece in zip(parts, _split(params, [count for count, _ in parts])):
        x, y = lax.scan(_maybe_checkpoint(step, part_policy), x, piece, unroll=unroll)
        ys.append(y)
    return x, _concat(ys)


def _scan_plan(depth: int, policy: Any, segments: Any, nested: bool,
               levels: int | None = None) -> tuple[Any, int | Schedule | None]:
    """``(policy, groups)`` of one scan: as called, or as a planner re-decides it.

    ``groups`` is None (flat), an int ``k`` (``k`` equal groups) or a schedule tuple,
    validated against ``depth``.
    """
    groups = _groups(depth, segments, nested, levels)
    decide = current().scan  # a planner re-deciding this scan (remat._core.hooks)
    if decide is None:
        return policy, groups
    policy, groups = decide(depth, policy, groups)
    return policy, _check_groups(depth, groups, "the planner's schedule")


def scan_layers(
    layer: Callable[[Any, Any], Any],
    params: Any,
    x: Any,
    *,
    policy: Any = "nothing",
    segments: int | Schedule | None = None,
    nested: bool = False,
    levels: int | None = None,
    unroll: int = 1,
) -> Any:
    """Applies ``layer`` N times with ``lax.scan`` over stacked parameters, checkpointed.

    Computes ``for i in range(N): x = layer(params[i], x)`` where ``params[i]`` is the
    i-th slice of every leaf.

    Args:
      layer: ``layer(params_i, x) -> x``; ``x`` may be any pytree whose structure,
        shapes and dtypes the layer preserves.
      params: a pytree whose leaves all have the same leading axis N (the depth).
      x: the input of the first layer.
      policy: checkpoint policy of each layer: ``"no_checkpoint"``, ``None`` or
        ``"nothing"`` (keep only layer inputs), ``"dots"``, ``"dots_no_batch"``,
        ``"everything"``, a list of checkpoint names, or a callable JAX policy.
      segments: nest. An int ``k``: split the N layers into ``k`` equal groups (``k``
        must divide N); each group is checkpointed as a whole and keeps only its input;
        ``policy`` applies to the layers inside a group. A schedule tuple, e.g.
        ``(5, 4, 3, 2, 1, 1)`` or ``((3, 2, 1), (2, 1), 1)``: ints are flat scans of
        that many layers, tuples run their children in order, each checkpointed as a
        whole; the leaves must sum to N (see :func:`schedule_peak`).
      nested: nest with :func:`best_segments` ``(N)`` equal groups (about ``sqrt(N)``).
      levels: nest with :func:`binomial_schedule` ``(N, levels)``, the least-memory
        schedule with at most ``levels`` extra forward recomputations.
      unroll: passed to the (inner) ``lax.scan``.

    Returns:
      The output of the last layer.

    Raises:
      ValueError: params leaves with different leading axes, ``segments`` not
        dividing the depth, a schedule whose leaves do not sum to the depth, or
        ``levels`` given with ``segments`` or ``nested``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> params = {"w": jnp.stack([jnp.eye(8)] * 16)}
      >>> f = lambda p, x: jnp.sum(scan_layers(lambda q, h: jnp.sin(h @ q["w"]), p, x, nested=True))
      >>> g = jax.grad(f)(params, jnp.ones((2, 8)))
      >>> f2 = lambda p, x: jnp.sum(scan_layers(lambda q, h: jnp.sin(h @ q["w"]), p, x, levels=2))
      >>> g2 = jax.grad(f2)(params, jnp.ones((2, 8)))
      >>> bool(jnp.allclose(g["w"], g2["w"], rtol=1e-5))
      True
    """
    depth = _depth(params)
    policy, groups = _scan_plan(depth, policy, segments, nested, levels)

    def step(h, p):
        return layer(p, h), None

    out, _ = _planned_run(depth, policy, groups, step, params, x, unroll)
    return out

"""Scan over a stack of identical layers, with checkpointing, flat or nested.

A Python loop over N layers gives XLA N copies of the layer: compile time grows with N,
and on XLA:CPU's default scheduler (and XLA:GPU's latency-hiding scheduler) per-layer
checkpointing can save nothing (see :mod:`remat._xla_flags`). ``lax.scan`` over
stacked parameters compiles one layer and runs it N times; the backward loop cannot
start before the forward loop ends, so the saved layer inputs are the only residuals
under any scheduler.

* :func:`scan_layers`: a pure ``layer(params, x) -> x`` and parameters stacked along a
  leading axis of size N.
* :func:`stack_nnx_layers` and :func:`scan_nnx_layers`: the same for a Flax NNX layer
  (created N times with ``nnx.vmap``, applied with ``nnx.split``/``nnx.merge``).
* :class:`LinenScanLayers`: a Flax Linen module that wraps ``nn.scan`` +
  ``nn.remat`` around a layer class.

Memory, for a depth-N stack with activations of size ``A`` per layer input:

* flat (``segments=None``): ``N * A`` of saved layer inputs, plus one layer's
  internals during its backward.
* nested (``nested=True`` or ``segments=k``): an outer scan over ``k`` groups, each
  group checkpointed (it keeps only its input), and an inner scan over the ``N/k``
  layers of the group. The backward recomputes one group at a time, so memory is
  about ``(k + N/k) * A``, smallest at ``k = sqrt(N)`` (Chen et al. 2016), for the
  price of one more forward pass.
* a schedule (``segments=(5, 4, 3, 2, 1, 1)``, ``segments=((3, 2, 1), (2, 1), 1)``):
  a nested tuple; an int ``n`` is a flat run of ``n`` layers, a tuple runs its
  children in sequence, each checkpointed as a whole. While the backward of child
  ``i`` (1-based) of a tuple runs, the inputs of children ``1..i`` are held and child
  ``i`` is being recomputed with its own peak, so in layer inputs
  ``peak(tuple) = max_i (i - 1 + peak(child_i))`` and ``peak(n) = n``
  (:func:`schedule_peak`). Equal groups waste memory: the first group is recomputed
  while only one input is held, the last while ``k`` are, so the first groups can be
  longer. :func:`binomial_schedule` (``levels=...``) gives the schedule of least peak
  with at most ``levels`` levels of nesting (each level one more forward
  recomputation): ``depth`` layers fit in peak ``p`` with ``l`` levels if
  ``depth <= C(p + l, l + 1)``, the binomial bound of Revolve (Griewank & Walther
  2000), i.e. peak ``~ sqrt(2 N)`` with one level and ``~ (6 N) ** (1/3)`` with two.

  Identical consecutive children (``(4, 4, 4, 4)``, the int ``segments`` path) run as
  one outer scan, compiled once; it keeps all their inputs stacked until its
  backward ends (one input more than the model when it starts the tuple). Any other
  child runs on its own, under ``jax.checkpoint(prevent_cse=True)`` inside a
  ``lax.cond`` that XLA cannot fold away: that keeps each child's recomputed layer
  inputs in its own backward step (on XLA:CPU they were otherwise all allocated at
  the start), for a few input-sized copies per child. Measured compiled temp memory,
  depth 32, 0.5 MiB layer inputs (``tests/test_scan_schedules.py``): flat 18.5 MiB,
  4 equal groups of 8 (``nested=True``) 9.0, ``levels=1`` 7.8, ``levels=2`` 7.2.

  Unequal children cut the stacked parameters with ``lax.split``, whose backward
  concatenates the children's parameter gradients: a temp buffer about the size of the
  stack's parameters, which equal groups (a free reshape) do not pay. So a schedule
  pays off where the layer inputs dwarf the parameters, as above (64x64 weights), and
  not where they do not: the 16-block models of ``benchmarks/`` (B=4, T=64, D=128
  transformer, 12.6 MiB of parameters; 512-wide MLP, 16 MiB) measured flat 7.9 / 5.0
  MiB, 8 equal groups 10.2 / 7.5, ``levels=1`` 18.6 / 19.0 and ``levels=2`` 21.5 /
  27.0. :func:`remat.plan` measures every one of them and keeps the smallest or
  fastest that fits.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from remat.scan import scan_layers
  >>> def layer(p, x):
  ...     return jnp.tanh(x @ p["w"] + p["b"])
  >>> params = {"w": jnp.stack([jnp.eye(16)] * 8), "b": jnp.zeros((8, 16))}
  >>> y = scan_layers(layer, params, jnp.ones((4, 16)), policy="dots")
  >>> y.shape
  (4, 16)
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Union

import jax
from jax import lax

from remat._core.hooks import current
from remat._core.lowering import mark_region
from remat.policies import resolve_policy

__all__ = [
    "LinenScanLayers",
    "Schedule",
    "best_segments",
    "binomial_schedule",
    "resolve_policy_spec",
    "scan_layers",
    "scan_nnx_layers",
    "schedule_peak",
    "schedule_recomputes",
    "stack_nnx_layers",
]

if TYPE_CHECKING:
    # Built on first access by the module's __getattr__ (below), so that importing
    # remat.scan does not import Flax Linen.
    LinenScanLayers: type[Any]

# A checkpoint schedule: an int n is a flat scan of n layers; a tuple runs its children
# in sequence, each under its own jax.checkpoint (it keeps only its input).
Schedule = Union[int, tuple["Schedule", ...]]


def resolve_policy_spec(policy: Any) -> Callable[..., Any] | None:
    """Turns a remat policy spelling into a JAX policy (None = save nothing).

    Every spelling ``remat.policies.resolve_policy`` accepts works here too; ``"none"`` is
    handled by the callers (it means "do not checkpoint") and is rejected here.
    """
    if isinstance(policy, str) and policy == "none":
        raise ValueError("policy 'none' means no checkpoint; handle it before resolving the policy")
    return resolve_policy(policy)


def _maybe_checkpoint(fn: Callable, policy: Any) -> Callable:
    if isinstance(policy, str) and policy == "none":
        return fn
    # Inside a scan, XLA cannot CSE the recomputation into the forward loop, so the
    # optimization barriers of prevent_cse=True would only cost time (JAX docs).
    return jax.checkpoint(fn, policy=resolve_policy_spec(policy), prevent_cse=False)


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


def best_segments(depth: int) -> int:
    """The number of segments that minimises memory for ``nested=True``.

    The divisor ``k`` of ``depth`` minimising ``k + depth / k`` (the saved group inputs
    plus the layer inputs of one group), fewer segments on a tie. For a prime depth this
    is 1 (no nesting helps without uneven groups); pass a depth with divisors.

    Example:
      >>> best_segments(16), best_segments(12), best_segments(7)
      (4, 3, 1)
    """
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    divisors = [k for k in range(1, depth + 1) if depth % k == 0]
    return min(divisors, key=lambda k: (k + depth // k, k))


# --------------------------------------------------------------------------------------
# Checkpoint schedules
# --------------------------------------------------------------------------------------


def _check_schedule(schedule: Any, whole: Any = None) -> Schedule:
    """``schedule`` with lists turned into tuples; a one-line ValueError if malformed."""
    whole = schedule if whole is None else whole
    if isinstance(schedule, bool) or not isinstance(schedule, (int, tuple, list)):
        raise ValueError(
            f"schedule {whole!r} has a leaf {schedule!r} of type {type(schedule).__name__}; "
            "use positive ints (flat runs of layers) and tuples (checkpointed groups)"
        )
    if isinstance(schedule, int):
        if schedule < 1:
            raise ValueError(
                f"schedule {whole!r} has a leaf {schedule}; every leaf must be a positive int number of layers"
            )
        return schedule
    if not schedule:
        raise ValueError(f"schedule {whole!r} has an empty tuple; every tuple needs at least one child")
    return tuple(_check_schedule(c, whole) for c in schedule)


def _schedule_depth(schedule: Schedule) -> int:
    return schedule if isinstance(schedule, int) else sum(_schedule_depth(c) for c in schedule)


def schedule_peak(schedule: Schedule) -> int:
    """The most layer inputs a schedule keeps at once (the memory model's peak).

    ``peak(n) = n`` for a flat run of ``n`` layers (it saves every layer input);
    ``peak((c_1, ..., c_m)) = max_i (i - 1 + peak(c_i))``: while the backward of child
    ``i`` runs, the inputs of children ``1..i-1`` are still held and child ``i`` is
    recomputed with its own peak. Memory is about ``peak * A`` plus one layer's
    internals, with ``A`` the size of a layer input.

    Example:
      >>> schedule_peak(16), schedule_peak((4, 4, 4, 4)), schedule_peak((6, 5, 4, 1))
      (16, 7, 6)
      >>> schedule_peak(((4, 3, 2, 1), (3, 2, 1)))
      4
    """
    schedule = _check_schedule(schedule)
    return _peak(schedule)


def _peak(schedule: Schedule) -> int:
    if isinstance(schedule, int):
        return schedule
    return max(i + _peak(c) for i, c in enumerate(schedule))


def schedule_recomputes(schedule: Schedule) -> int:
    """Extra forward passes a schedule costs: its nesting depth (a flat int is 0).

    A layer inside ``d`` nested tuples is recomputed ``d`` times during the backward
    (on top of whatever its own per-layer ``policy`` recomputes).

    Example:
      >>> schedule_recomputes(16), schedule_recomputes((4, 4, 4, 4)), schedule_recomputes(((3, 2, 1), (2, 1), 1))
      (0, 1, 2)
    """
    schedule = _check_schedule(schedule)
    return _levels(schedule)


def _levels(schedule: Schedule) -> int:
    return 0 if isinstance(schedule, int) else 1 + max(_levels(c) for c in schedule)


def _capacity(peak: int, levels: int) -> int:
    """The most layers any schedule with at most ``levels`` levels fits in ``peak`` inputs.

    ``cap(p, 0) = p``; ``cap(p, l) = sum_{q=1..p} cap(q, l-1)`` (child ``i`` may peak at
    ``p - i + 1``), which is ``C(p + l, l + 1)``.
    """
    return math.comb(peak + levels, levels + 1) if peak > 0 else 0


def _build(n: int, peak: int, levels: int) -> Schedule:
    """A schedule of ``n <= cap(peak, levels)`` layers within ``peak``: fewest levels, then fewest children."""
    lv = next(k for k in range(levels + 1) if _capacity(peak, k) >= n)
    if lv == 0:
        return n
    children: list[Schedule] = []
    q = peak
    while n:  # child i (1-based) may peak at peak - i + 1; filling the first ones fullest
        size = min(n, _capacity(q, lv - 1))  # gives the fewest children
        children.append(_build(size, q, lv - 1))
        n -= size
        q -= 1
    return tuple(children)


def binomial_schedule(depth: int, levels: int) -> Schedule:
    """The schedule of ``depth`` layers with the least peak memory and at most ``levels`` levels.

    Under the model of :func:`schedule_peak` (``peak(n) = n``, ``peak(tuple) =
    max_i (i - 1 + peak(child_i))``), the most layers that fit in a peak of ``p``
    stored inputs with ``l`` levels is ``cap(p, 0) = p`` and ``cap(p, l) =
    sum_{q=1..p} cap(q, l - 1) = C(p + l, l + 1)``: child ``i`` of the top tuple may
    itself peak at ``p - i + 1``. This is the binomial bound of Revolve (Griewank &
    Walther 2000, "Algorithm 799: revolve") with the levels as the number of
    recomputations; one level with equal groups is Chen et al. 2016's ``sqrt(N)``.
    The schedule takes the least ``p`` with ``cap(p, levels) >= depth``, then the fewest
    levels that still fit in ``p``, and fills the children in order to their capacity
    (the fewest children); segment lengths therefore decrease, e.g. ``(6, 5, 4, 1)``.

    Args:
      depth: number of layers (at least 1).
      levels: most levels of nesting (0: flat). Each level costs at most one more
        forward recomputation (:func:`schedule_recomputes`).

    Returns:
      A schedule for ``scan_layers(..., segments=...)``: ``depth`` itself (an int) when
      no nesting lowers the peak, otherwise a nested tuple.

    Example:
      >>> binomial_schedule(16, 0), binomial_schedule(16, 1), binomial_schedule(16, 2)
      (16, (6, 5, 4, 1), ((4, 3, 2, 1), (3, 2, 1)))
      >>> [schedule_peak(binomial_schedule(16, l)) for l in range(4)]
      [16, 6, 4, 4]
      >>> binomial_schedule(10, 1)
      (4, 3, 2, 1)
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"binomial_schedule(depth={depth!r}): depth must be a positive int")
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 0:
        raise ValueError(f"binomial_schedule(levels={levels!r}): levels must be an int >= 0 (0: flat)")
    if levels == 0:
        return depth
    lo, hi = 1, depth  # cap(depth, levels) >= depth: bisect the least peak
    while lo < hi:
        mid = (lo + hi) // 2
        if _capacity(mid, levels) >= depth:
            hi = mid
        else:
            lo = mid + 1
    return _build(depth, lo, levels)


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
            # cotangent (see remat._xla_flags), and the cond (whose predicate XLA cannot
            # fold; both branches are the child) scopes the buffers of the recomputed
            # scan to the branch. Without the cond, XLA:CPU allocates every child's
            # stacked layer inputs at the start of the program and keeps them all:
            # measured (9, 7) at depth 16: 23.5 layer inputs of temp memory against 15-17.
            ck = jax.checkpoint(lambda h, p, child=child: _run_schedule(child, step, p, h, unroll),
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
    x, y = lax.scan(jax.checkpoint(group, prevent_cse=False), x, grouped)
    return x, jax.tree.map(lambda a: a.reshape(count * n, *a.shape[2:]), y)


def _run(depth: int, groups: int | Schedule | None, step: Callable, params: Any, x: Any,
         unroll: int) -> tuple[Any, Any]:
    """One scan as ``_scan_plan`` decided: flat, ``k`` equal groups, or a schedule."""
    if groups is None:
        return lax.scan(step, x, params, unroll=unroll)
    if isinstance(groups, int):  # always the outer scan, even for k = 1 (as before schedules)
        return _run_groups(depth // groups, groups, step, params, x, unroll)
    return _run_schedule(groups, step, params, x, unroll)


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


def _groups(depth: int, segments: Any, nested: bool, levels: int | None) -> int | Schedule | None:
    if levels is not None:
        if isinstance(levels, bool) or not isinstance(levels, int) or levels < 0:
            raise ValueError(f"levels must be an int >= 0 (0: flat), got {levels!r}")
        if segments is not None or nested:
            given = f"segments={segments!r}" if segments is not None else "nested=True"
            raise ValueError(f"levels={levels} and {given} both choose the nesting; pass only one of them")
        schedule = binomial_schedule(depth, levels)
        return None if isinstance(schedule, int) else schedule
    if isinstance(segments, (tuple, list)):
        if nested:
            raise ValueError(f"segments={segments!r} and nested=True both choose the nesting; pass only one of them")
        return _check_groups(depth, segments, "schedule")
    return _num_segments(depth, segments, nested)


def _check_groups(depth: int, groups: Any, what: str) -> int | Schedule | None:
    if groups is None:
        return None
    if not isinstance(groups, (tuple, list)):
        return _num_segments(depth, groups, False)
    schedule = _check_schedule(groups)
    covered = _schedule_depth(schedule)
    if covered != depth:
        raise ValueError(
            f"{what} {schedule!r} covers {covered} layers but params have depth {depth}; "
            "its leaf lengths must sum to the depth"
        )
    return schedule


def _num_segments(depth: int, segments: int | None, nested: bool) -> int | None:
    if segments is None:
        return best_segments(depth) if nested else None
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(
            f"segments must be a positive int (equal groups) or a schedule tuple, got {segments!r}"
        )
    if depth % segments:
        divisors = [k for k in range(1, depth + 1) if depth % k == 0]
        raise ValueError(
            f"depth {depth} is not divisible by segments={segments}; use one of {divisors}"
        )
    return segments


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
      policy: checkpoint policy of each layer: ``"none"`` (no checkpoint), ``None`` or
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

    step = _maybe_checkpoint(step, policy)
    out, _ = _run(depth, groups, step, params, x, unroll)
    return out


# --------------------------------------------------------------------------------------
# Flax NNX
# --------------------------------------------------------------------------------------


def stack_nnx_layers(make_layer: Callable[[Any], Any], depth: int, rngs: Any) -> Any:
    """Creates ``depth`` independently initialised copies of an NNX layer, stacked.

    Every parameter of the returned module has a leading axis of size ``depth``, as
    ``nnx.vmap`` over an init function produces (flax's "scan over layers" recipe).

    Args:
      make_layer: ``make_layer(rngs) -> nnx.Module``, e.g.
        ``lambda rngs: Block(256, rngs=rngs)``.
      depth: number of layers.
      rngs: an ``nnx.Rngs`` (split ``depth`` ways) or an int seed.

    Returns:
      One module whose state is the stacked state of ``depth`` layers; apply it with
      :func:`scan_nnx_layers`.

    Example:
      >>> from flax import nnx
      >>> layers = stack_nnx_layers(lambda r: nnx.Linear(8, 8, rngs=r), 4, nnx.Rngs(0))
      >>> layers.kernel[...].shape
      (4, 8, 8)
    """
    from flax import nnx

    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be a positive int, got {depth!r}")
    if isinstance(rngs, int):
        rngs = nnx.Rngs(rngs)

    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(r):
        return make_layer(r)

    return create(rngs)


def scan_nnx_layers(
    layers: Any,
    x: Any,
    *,
    policy: Any = "nothing",
    segments: int | Schedule | None = None,
    nested: bool = False,
    levels: int | None = None,
    call: Callable[[Any, Any], Any] | None = None,
) -> Any:
    """Applies a stacked NNX layer (from :func:`stack_nnx_layers`) with :func:`scan_layers`.

    The parameters (``nnx.Param``) are scanned over; any other state (batch statistics,
    RNG counts) is scanned too and written back into ``layers`` after the call, in
    layer order, so stateful layers behave as in an unrolled loop. Use it inside
    ``nnx.grad`` / ``nnx.jit`` like any module call.

    Args:
      layers: the stacked module.
      x: input of the first layer.
      policy, segments, nested, levels: as in :func:`scan_layers` (``segments`` may be
        a schedule tuple, ``levels`` picks :func:`binomial_schedule`).
      call: ``call(layer, x) -> x`` to run one layer; defaults to ``layer(x)``.

    Returns:
      The output of the last layer.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> layers = stack_nnx_layers(lambda r: nnx.Linear(8, 8, rngs=r), 4, 0)
      >>> y = scan_nnx_layers(layers, jnp.ones((2, 8)), policy="dots")
      >>> y2 = scan_nnx_layers(layers, jnp.ones((2, 8)), segments=(2, 1, 1))
    """
    from flax import nnx

    call = call or (lambda m, h: m(h))
    graphdef, params, rest = nnx.split(layers, nnx.Param, ...)
    has_rest = bool(jax.tree.leaves(rest))

    def layer(p, h):
        p_i, rest_i = p
        module = nnx.merge(graphdef, p_i, rest_i)
        h = call(module, h)
        if not has_rest:
            return h
        _, _, new_rest = nnx.split(module, nnx.Param, ...)
        return h, new_rest

    if not has_rest:
        return scan_layers(layer, (params, rest), x, policy=policy, segments=segments,
                           nested=nested, levels=levels)

    # Non-parameter state (batch stats, RNG counts): each layer returns its updated
    # slice as a scan output, stacked in layer order and written back after the loop.
    depth = _depth(params)
    policy, groups = _scan_plan(depth, policy, segments, nested, levels)

    def step(h, p):
        return layer(p, h)

    step = _maybe_checkpoint(step, policy)
    out, new_rest = _run(depth, groups, step, (params, rest), x, 1)
    nnx.update(layers, new_rest)
    return out


# --------------------------------------------------------------------------------------
# Flax Linen
# --------------------------------------------------------------------------------------


def _linen_cell(layer_cls: type) -> type:
    """A subclass of ``layer_cls`` with ``nn.scan``'s ``(carry, x) -> (carry, y)`` call."""

    class Cell(layer_cls):  # type: ignore[misc, valid-type]
        def __call__(self, carry, _):  # noqa: D401
            return super().__call__(carry), None

    # Keep the layer's own name so parameter paths read like the unscanned module's.
    Cell.__name__ = Cell.__qualname__ = layer_cls.__name__
    return Cell


def _linen_module():
    import flax.linen as nn
    from flax.core import FrozenDict

    class LinenScanLayers(nn.Module):
        """``depth`` copies of a Linen layer class, run with ``nn.scan`` and ``nn.remat``.

        Parameters are stacked along axis 0 under ``"layers"`` (``variable_axes=
        {"params": 0}``, ``split_rngs={"params": True}``); with nesting, along the first
        two axes ``(segments, depth // segments)``.

        Attributes:
          layer_cls: a Linen module class whose ``__call__(x)`` returns an ``x``-like value.
          depth: number of layers.
          layer_kwargs: constructor arguments of ``layer_cls``.
          policy: per-layer checkpoint policy (as in :func:`scan_layers`; ``"none"``
            disables per-layer checkpointing).
          segments: number of equal checkpointed groups (must divide ``depth``). Schedule
            tuples (unequal groups) are not supported here (a ValueError says so); use
            :func:`scan_layers` or :func:`scan_nnx_layers` for them.
          nested: use :func:`best_segments` groups.

        Example:
          >>> import jax, jax.numpy as jnp, flax.linen as nn
          >>> class Block(nn.Module):
          ...     @nn.compact
          ...     def __call__(self, x):
          ...         return x + jnp.tanh(nn.Dense(x.shape[-1])(x))
          >>> m = LinenScanLayers(Block, depth=4, policy="dots")
          >>> v = m.init(jax.random.PRNGKey(0), jnp.ones((2, 8)))
        """

        layer_cls: Any
        depth: int
        layer_kwargs: Mapping[str, Any] = FrozenDict()
        policy: Any = "nothing"
        segments: int | None = None
        nested: bool = False

        @nn.compact
        def __call__(self, x):
            if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 1:
                raise ValueError(f"depth must be a positive int, got {self.depth!r}")
            if isinstance(self.segments, (tuple, list)):
                raise ValueError(
                    f"LinenScanLayers(segments={self.segments!r}): Linen takes only None or an int "
                    "number of equal groups; for an unequal schedule use scan_layers or scan_nnx_layers"
                )
            k = _num_segments(self.depth, self.segments, self.nested)
            cell = _linen_cell(self.layer_cls)
            if not (isinstance(self.policy, str) and self.policy == "none"):
                cell = nn.remat(cell, policy=resolve_policy_spec(self.policy), prevent_cse=False)
            scan = lambda target, length: nn.scan(  # noqa: E731
                target, variable_axes={"params": 0}, split_rngs={"params": True}, length=length
            )
            kwargs = dict(self.layer_kwargs)
            if k is None:
                out, _ = scan(cell, self.depth)(name="layers", **kwargs)(x, None)
                return out
            inner = scan(cell, self.depth // k)

            class Group(nn.Module):
                @nn.compact
                def __call__(self, h, _):
                    h, _ = inner(name="layers", **kwargs)(h, None)
                    return h, None

            out, _ = scan(nn.remat(Group, prevent_cse=False), k)(name="groups")(x, None)
            return out

    return LinenScanLayers


def __getattr__(name: str) -> Any:
    # Build the Linen module on first use so importing remat.scan does not import Linen.
    if name == "LinenScanLayers":
        cls = _linen_module()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module 'remat.scan' has no attribute {name!r}")

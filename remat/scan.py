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

import contextvars
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax import lax

__all__ = [
    "LinenScanLayers",
    "best_segments",
    "resolve_policy_spec",
    "scan_layers",
    "scan_nnx_layers",
    "stack_nnx_layers",
]


def resolve_policy_spec(policy: Any) -> Callable[..., Any] | None:
    """Turns a remat policy spelling into a JAX policy (None = save nothing).

    Uses ``remat.policies.resolve_policy`` when available, so every spelling the rest
    of remat accepts works here too; ``"none"`` is handled by the callers (it means
    "do not checkpoint") and is rejected here.
    """
    if isinstance(policy, str) and policy == "none":
        raise ValueError("policy 'none' means no checkpoint; handle it before resolving the policy")
    try:
        from remat.policies import resolve_policy
    except ImportError:  # remat.policies not importable: accept the basic spellings
        return _fallback_resolve(policy)
    return resolve_policy(policy)


def _fallback_resolve(policy: Any) -> Callable[..., Any] | None:
    cp = jax.checkpoint_policies
    named = {
        "nothing": None,
        "everything": cp.everything_saveable,
        "dots": cp.dots_saveable,
        "dots_no_batch": cp.dots_with_no_batch_dims_saveable,
    }
    if policy is None:
        return None
    if isinstance(policy, str):
        if policy not in named:
            raise ValueError(f"unknown policy {policy!r}; use one of {', '.join(map(repr, named))}, a list of names or a callable")
        return named[policy]
    if callable(policy):
        return policy
    names = list(policy)
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"policy={policy!r}: a sequence policy must be a non-empty list of checkpoint names")
    return cp.save_only_these_names(*names)


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


# A planner (remat.plan) may re-decide every scan while it is traced: it sets a function
# ``(depth, policy, groups) -> (policy, groups)`` here (groups None: one flat scan).
_SCAN_OVERRIDE: contextvars.ContextVar[Callable[[int, Any, int | None], tuple[Any, int | None]] | None] = \
    contextvars.ContextVar("remat_scan_override", default=None)


def _scan_plan(depth: int, policy: Any, segments: int | None, nested: bool) -> tuple[Any, int | None]:
    """``(policy, groups)`` of one scan: as called, or as a planner re-decides it."""
    k = _num_segments(depth, segments, nested)
    override = _SCAN_OVERRIDE.get()
    return (policy, k) if override is None else override(depth, policy, k)


def _num_segments(depth: int, segments: int | None, nested: bool) -> int | None:
    if segments is None:
        return best_segments(depth) if nested else None
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(f"segments must be a positive int, got {segments!r}")
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
    segments: int | None = None,
    nested: bool = False,
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
      segments: nest: split the N layers into this many groups (must divide N). Each
        group is checkpointed as a whole and keeps only its input; ``policy`` applies
        to the layers inside a group.
      nested: nest with :func:`best_segments` ``(N)`` groups (about ``sqrt(N)``).
      unroll: passed to the (inner) ``lax.scan``.

    Returns:
      The output of the last layer.

    Raises:
      ValueError: params leaves with different leading axes, or ``segments`` not
        dividing the depth.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> params = {"w": jnp.stack([jnp.eye(8)] * 16)}
      >>> f = lambda p, x: jnp.sum(scan_layers(lambda q, h: jnp.sin(h @ q["w"]), p, x, nested=True))
      >>> g = jax.grad(f)(params, jnp.ones((2, 8)))
    """
    depth = _depth(params)
    policy, k = _scan_plan(depth, policy, segments, nested)

    def step(h, p):
        return layer(p, h), None

    step = _maybe_checkpoint(step, policy)
    if k is None:
        out, _ = lax.scan(step, x, params, unroll=unroll)
        return out

    grouped = jax.tree.map(lambda a: a.reshape(k, depth // k, *a.shape[1:]), params)

    def group(h, group_params):
        h, _ = lax.scan(step, h, group_params, unroll=unroll)
        return h, None

    # The group keeps only its input ("nothing"): any policy that saved more would keep
    # per-layer values of every group and undo the sqrt(N) saving.
    out, _ = lax.scan(jax.checkpoint(group, prevent_cse=False), x, grouped)
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
    segments: int | None = None,
    nested: bool = False,
    call: Callable[[Any, Any], Any] | None = None,
) -> Any:
    """Applies a stacked NNX layer (from :func:`stack_nnx_layers`) with :func:`scan_layers`.

    The parameters (``nnx.Param``) are scanned over; any other state (batch statistics,
    RNG counts) is scanned too and written back into ``layers`` after the call, so
    stateful layers behave as in an unrolled loop. Use it inside ``nnx.grad`` /
    ``nnx.jit`` like any module call.

    Args:
      layers: the stacked module.
      x: input of the first layer.
      policy, segments, nested: as in :func:`scan_layers`.
      call: ``call(layer, x) -> x`` to run one layer; defaults to ``layer(x)``.

    Returns:
      The output of the last layer.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> layers = stack_nnx_layers(lambda r: nnx.Linear(8, 8, rngs=r), 4, 0)
      >>> y = scan_nnx_layers(layers, jnp.ones((2, 8)), policy="dots")
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
        return scan_layers(layer, (params, rest), x, policy=policy, segments=segments, nested=nested)

    # Non-parameter state (batch stats, RNG counts): each layer returns its updated
    # slice as a scan output, written back into `layers` after the loop.
    depth = _depth(params)
    policy, k = _scan_plan(depth, policy, segments, nested)

    def step(h, p):
        return layer(p, h)

    step = _maybe_checkpoint(step, policy)
    if k is None:
        out, new_rest = lax.scan(step, x, (params, rest))
    else:
        grouped = jax.tree.map(lambda a: a.reshape(k, depth // k, *a.shape[1:]), (params, rest))

        def group(h, gp):
            return lax.scan(step, h, gp)

        out, new_rest = lax.scan(jax.checkpoint(group, prevent_cse=False), x, grouped)
        new_rest = jax.tree.map(lambda a: a.reshape(depth, *a.shape[2:]), new_rest)
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
          segments: number of checkpointed groups (must divide ``depth``).
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

"""``remat.checkpoint``: PyTorch's ``torch.utils.checkpoint.checkpoint`` for JAX and Flax.

One normalisation step (:func:`normalize_options`: policy spelling -> JAX policy, PyTorch
keywords -> their JAX meaning, bad combinations rejected once) and one dispatch
(:func:`_run`: plain callable, Flax NNX module or method, Linen bound module or method,
Linen class). The adapters in :mod:`remat._core.flax_adapters` never re-validate options.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import jax

from remat._core import flax_adapters as _flax
from remat._core.arguments import signature, split_call
from remat._core.hooks import RegionChooser, current
from remat._core.lowering import classic_checkpoint, mark_region
from remat._core.regions import ACTIVE_CALL, REGIONS, ActiveCall, Region
from remat.policies import PolicySpec, is_no_checkpoint, policy_name, resolve_policy

F = TypeVar("F", bound=Callable[..., Any])

_DETERMINISM_CHECKS = ("default", "none")


@dataclass(frozen=True)
class CheckpointOptions:
    """Validated options of one checkpointed region, in their JAX meaning."""

    policy: Callable[..., Any] | None
    policy_label: str
    static_argnums: tuple[int, ...]
    prevent_cse: bool | tuple[Any, ...]
    debug: bool
    trace_scalars: bool = False  # the decorator form traces Python numbers, as jax.checkpoint does
    enabled: bool = True  # False: policy=NO_CHECKPOINT, the region runs as a plain call


def normalize_options(
    *,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    context_fn: Any = None,
    policy: PolicySpec = None,
    static_argnums: int | tuple[int, ...] = (),
    prevent_cse: bool | Sequence[Any] = True,
) -> CheckpointOptions:
    """Checks the keyword arguments of :func:`checkpoint` and maps them to JAX.

    See :func:`checkpoint` for what each one means here. Raises ``TypeError`` or
    ``ValueError`` with a one-line message naming the fix.
    """
    if context_fn is not None:
        raise TypeError(
            "context_fn has no meaning in JAX (there are no autograd contexts); choose what "
            "to save with policy= instead, e.g. policy=remat.policies.selective([...])"
        )
    for name, value in (("preserve_rng_state", preserve_rng_state), ("debug", debug),
                        ("early_stop", early_stop)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if isinstance(prevent_cse, (list, tuple)):
        prevent_cse = tuple(prevent_cse)
        if not all(isinstance(f, bool) for f in jax.tree.leaves(prevent_cse)):
            raise TypeError(f"prevent_cse must be a bool or a tuple (pytree prefix) of bools, got {prevent_cse!r}")
    elif not isinstance(prevent_cse, bool):
        raise TypeError(f"prevent_cse must be a bool or a tuple (pytree prefix) of bools, got {prevent_cse!r}")
    if use_reentrant is not None and not isinstance(use_reentrant, bool):
        raise TypeError(f"use_reentrant must be True, False or None, got {use_reentrant!r}")
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(
            f"determinism_check={determinism_check!r} is not supported; use one of "
            f"{', '.join(map(repr, _DETERMINISM_CHECKS))}"
        )
    if isinstance(static_argnums, int):
        static_argnums = (static_argnums,)
    if not all(isinstance(i, int) and i >= 0 for i in static_argnums):
        raise ValueError(f"static_argnums must be non-negative ints, got {static_argnums!r}")
    enabled = not is_no_checkpoint(policy)
    resolved = resolve_policy(policy) if enabled else None
    if use_reentrant and (resolved is not None or debug):
        # The same rule as PyTorch's: context_fn (our policy=) and debug need the
        # non-reentrant variant, so code that runs here also runs there.
        raise ValueError(
            "policy= and debug=True need use_reentrant=False, as context_fn and debug do in "
            "torch.utils.checkpoint; drop use_reentrant=True"
        )
    return CheckpointOptions(
        policy=resolved,
        policy_label=policy_name(policy),
        static_argnums=tuple(sorted(set(static_argnums))),
        prevent_cse=prevent_cse,
        debug=debug,
        enabled=enabled,
    )


@overload
def checkpoint(function: F, /, **options: Any) -> F: ...
@overload
def checkpoint(function: None = None, /, **options: Any) -> Callable[[F], F]: ...
@overload
def checkpoint(function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any: ...


def checkpoint(
    function: Callable[..., Any] | None = None,
    /,
    *args: Any,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    context_fn: Any = None,
    policy: PolicySpec = None,
    static_argnums: int | tuple[int, ...] = (),
    prevent_cse: bool | Sequence[Any] = True,
    **kwargs: Any,
) -> Any:
    """Runs ``function`` so that its backward pass recomputes activations instead of keeping them.

    Three uses, one function:

    * **call form**, as in PyTorch: ``y = checkpoint(fn, *args, **kwargs)`` evaluates
      ``fn(*args, **kwargs)``. Under ``jax.grad``/``jax.vjp``/``nnx.grad`` (jitted or
      not) only the inputs are kept and everything inside is recomputed on the backward
      pass; outside autodiff it is a plain call.
    * **decorator**: ``@checkpoint``, ``checkpoint(fn)`` or ``@checkpoint(policy=...)``
      return a function with the same signature. Because ``checkpoint(fn)`` with no
      arguments returns the wrapped function, a zero-argument function runs as
      ``checkpoint(fn)()``.
    * **Flax**: ``checkpoint(self.fc2, x)`` inside an NNX ``__call__`` (a submodule or a
      bound method such as ``self.block``), the same inside a Linen ``__call__`` with
      submodules from ``setup()``, and ``checkpoint(nn.Dense)`` which returns a
      rematerialized Linen class with the same parameter tree. Dropout and other RNG use
      inside the region recompute exactly the same values.

    Arguments that are not arrays (strings, ``None``, bools, callables, containers of
    them) pass through untraced, so they may drive Python control flow; use
    ``static_argnums`` for array-like values that must be static. Outputs may be any pytree.
    The arguments bound by a ``functools.partial`` count as call arguments (so
    ``checkpoint(partial(self.block, mask=m), x)`` works for Flax modules too).

    Args:
      function: the callable, NNX module/method, bound Linen module/method or Linen class.
      *args: positional arguments for ``function`` (call form).
      use_reentrant: accepted for PyTorch code. JAX has one checkpoint mechanism, a
        functional transform of the computation, so ``True`` and ``False`` both give
        exact gradients and both rematerialize; as in PyTorch, ``policy=`` and ``debug``
        need ``False`` (or ``None``, the default).
      preserve_rng_state: accepted for PyTorch code. JAX random keys are values, so the
        recomputation always sees the same randomness (Flax RNG streams included);
        ``False`` cannot make it differ.
      determinism_check: ``"default"`` or ``"none"``. The recomputation replays the very
        program traced for the forward pass, so its shapes and dtypes cannot differ and
        there is nothing to check at run time.
      debug: print, at trace time, what the backward pass keeps (and where it came
        from) and how much is recomputed instead, compared with no checkpoint.
      early_stop: accepted for PyTorch code; XLA removes recomputation the backward pass
        does not need, which is what ``early_stop=True`` does in PyTorch.
      context_fn: not supported (raises): use ``policy=``.
      policy: what may be kept instead of recomputed (see :mod:`remat.policies`):
        ``None``/``"nothing"`` (PyTorch's behaviour), ``"everything"``, ``"dots"``,
        ``"dots_no_batch"``, a list of names given to :func:`remat.checkpoint_name`, or
        any callable JAX policy; ``remat.policies.NO_CHECKPOINT`` runs ``function`` as a
        plain call (no checkpoint), so a flag can switch checkpointing off.
      static_argnums: positions of arguments to treat as compile-time constants.
      prevent_cse: as in ``jax.checkpoint``; ``True`` stops XLA from merging the
        recomputation with the forward pass (needed outside ``scan``).
      **kwargs: keyword arguments for ``function`` (call form).

    Returns:
      The call form returns ``function(*args, **kwargs)``; the decorator forms return the
      checkpointed function (or Linen class).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from remat import checkpoint
      >>> def my_computation(x, y):
      ...     return jnp.sin(x) * y
      >>> a, b = jnp.ones((3, 4)), jnp.full((3, 4), 2.0)
      >>> grad_a = jax.grad(lambda a: checkpoint(my_computation, a, b).sum())(a)
    """
    opts = normalize_options(
        use_reentrant=use_reentrant,
        preserve_rng_state=preserve_rng_state,
        determinism_check=determinism_check,
        debug=debug,
        early_stop=early_stop,
        context_fn=context_fn,
        policy=policy,
        static_argnums=static_argnums,
        prevent_cse=prevent_cse,
    )
    if function is None:
        if args or kwargs:  # checkpoint(None, x): a missing function, not the decorator form
            _check_callable(function)
        return lambda fn: _wrap(fn, opts)
    if _flax.is_linen_class(function):
        if args or kwargs:
            raise TypeError(
                f"checkpoint({function.__name__}, ...) got call arguments, but "
                f"{function.__name__} is a Linen Module class: use "
                f"checkpoint({function.__name__})(...) to build the rematerialized module"
            )
        return _flax.linen_remat_class(function, opts, _run)
    _check_callable(function)
    if not args and not kwargs:
        return _wrap(function, opts)
    return _run(function, opts, args, kwargs)


def rematerialized(fn: Callable[..., Any], policy: PolicySpec, *, prevent_cse: bool = True) -> Callable[..., Any]:
    """``fn`` under ``jax.checkpoint`` with remat's policy spelling; ``fn`` itself for NO_CHECKPOINT.

    The building block of scans over layers and policy comparisons: a plain region, without
    :func:`checkpoint`'s argument handling, trace cache or planner hooks.
    """
    if is_no_checkpoint(policy):
        return fn
    return classic_checkpoint(fn, policy=mark_region(resolve_policy(policy)), prevent_cse=prevent_cse)


def _check_callable(function: Any) -> None:
    if not callable(function):
        hint = " (did you pass the input first? the function comes first)" if hasattr(function, "shape") else ""
        raise TypeError(
            "checkpoint() expects a function or module as its first argument, got "
            f"{type(function).__name__}{hint}"
        )


def _wrap(function: Callable[..., Any], opts: CheckpointOptions) -> Callable[..., Any]:
    """The decorator form: a function with ``function``'s signature that checkpoints each call."""
    if _flax.is_linen_class(function):
        return _flax.linen_remat_class(function, opts, _run)
    _check_callable(function)

    opts = dataclasses.replace(opts, trace_scalars=True)

    @functools.wraps(function)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return _run(function, opts, args, kwargs)

    return _flax.linen_method(checkpointed)



def _run(function: Callable[..., Any], opts: CheckpointOptions, args: tuple, kwargs: dict) -> Any:
    """Evaluates ``function(*args, **kwargs)`` as one checkpointed region."""
    if not opts.enabled:  # policy=NO_CHECKPOINT: not a region at all, so no planner sees it
        return function(*args, **kwargs)
    decide = current().region  # a planner re-deciding this region (remat._core.hooks)
    if decide is not None:
        opts = decide(opts)
        if opts is None:
            return function(*args, **kwargs)
    if opts.static_argnums and max(opts.static_argnums) >= len(args):
        raise ValueError(
            f"static_argnums={opts.static_argnums} names a position beyond the "
            f"{len(args)} positional argument(s) given"
        )
    while isinstance(function, functools.partial):
        # partial(self.block, mask=m): its arguments are call arguments like any other (traced
        # when arrays), so the module behind .func is found and lifted as without partial
        bound_args = function.args
        args, kwargs = bound_args + tuple(args), {**function.keywords, **kwargs}
        function = function.func
        if opts.static_argnums and bound_args:
            opts = dataclasses.replace(
                opts, static_argnums=tuple(i + len(bound_args) for i in opts.static_argnums)
            )
    linen_module = _flax.linen_owner(function, args)
    if linen_module is not None:
        if isinstance(opts.policy, RegionChooser):
            raise TypeError(
                "policy=remat.residual_budget(...) works for JAX functions and Flax NNX modules; for a "
                "Linen module pick a named policy (remat plan shows which one fits your memory)"
            )
        return _flax.linen_call(function, linen_module, opts, args, kwargs)

    call = split_call(args, kwargs, opts.static_argnums, trace_scalars=opts.trace_scalars,
                      prevent_cse=opts.prevent_cse)
    # The module, the method's owner, or the modules a closure captured: nnx.remat inputs.
    bound = _flax.nnx_bound(function)
    nodes, rebind = bound if bound is not None else ([], None)
    graph_nodes = list(nodes) + [x for x in call.dynamic if _flax.is_nnx_node(x)]
    nnx_mode = None if not graph_nodes else "in place" if _flax.nnx_in_place(graph_nodes) else "changed only"
    anchor, kind = _flax.function_anchor(function)
    if not opts.trace_scalars:
        REGIONS.count_scalar_variants(anchor, function, call)
    static_key = call.static_key
    region = REGIONS.region(anchor, None if static_key is None else (kind, len(nodes), static_key))
    inputs = list(nodes) + call.dynamic
    flags = (True,) * len(nodes) + call.prevent_cse
    prevent_cse = flags[0] if flags and all(f == flags[0] for f in flags) else flags

    def remat_with(policy: Any) -> Callable[..., Any]:
        return region.caller(policy, prevent_cse, nnx_mode)

    sig = signature(inputs)
    token = ACTIVE_CALL.set(ActiveCall(function, rebind, len(nodes), call, sig))
    try:
        policy = opts.policy
        if isinstance(policy, RegionChooser):  # e.g. a residual budget: per region, from the inputs
            policy = policy.choose_policy(remat_with, inputs)
        if opts.debug:
            _print_debug_report(function, region, remat_with(policy), inputs, opts)
        outputs = remat_with(policy)(*inputs)
        if not region.store.has(sig):
            # A trace cache keyed differently from the store (it never should be): trace
            # this call afresh rather than guess its non-array outputs.
            region = Region()
            outputs = remat_with(policy)(*inputs)
    finally:
        ACTIVE_CALL.reset(token)
    return region.store.unpack(outputs, sig)


def _print_debug_report(function, region, remat_region, inputs, opts: CheckpointOptions) -> None:
    """``debug=True``: what the backward pass keeps, and what is recomputed instead."""
    from remat._core.residuals import saved_residuals

    name = getattr(function, "__qualname__", type(function).__name__)
    try:
        kept = saved_residuals(remat_region, *inputs)
        plain = saved_residuals(region, *inputs)
        recomputed = plain.residual_bytes - kept.residual_bytes
        report = (
            f"remat.checkpoint(debug=True) {name}, policy={opts.policy_label}:\n"
            f"  kept for the backward pass: {len(kept)} value(s), {kept.total_bytes} bytes\n"
            f"  without checkpoint it would keep: {len(plain)} value(s), {plain.total_bytes} bytes\n"
            f"  recomputed instead of kept: {max(recomputed, 0)} bytes\n"
            + "\n".join("  " + line for line in str(kept).splitlines())
        )
    except Exception as e:  # a report must never break the computation it describes
        print(f"remat.checkpoint(debug=True) {name}: no report ({type(e).__name__}: {e})", file=sys.stderr)
        return
    print(report, file=sys.stderr)

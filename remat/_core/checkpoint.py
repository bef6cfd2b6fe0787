"""``remat.checkpoint``: PyTorch's ``torch.utils.checkpoint.checkpoint`` for JAX and Flax.

Its keywords are checked once (:mod:`remat._core.options`); every form then ends in the one
dispatch, :func:`remat._core.dispatch.run_region`. The Linen class form
(``checkpoint(nn.Dense)``) lives here, above the dispatch it calls.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, overload

import flax.linen as nn

from remat._core import flax_adapters as _flax
from remat._core.dispatch import run_region
from remat._core.lowering import classic_checkpoint, mark_region
from remat._core.options import KEYWORDS, CheckpointKeywords, CheckpointOptions, normalize_options
from remat.policies import PolicySpec, is_no_checkpoint, resolve_policy

F = TypeVar("F", bound=Callable[..., Any])


@overload
def checkpoint(function: F, /, **options: Any) -> F: ...
@overload
def checkpoint(function: None = None, /, **options: Any) -> Callable[[F], F]: ...
@overload
def checkpoint(function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any: ...


def checkpoint(function: Callable[..., Any] | None = None, /, *args: Any, **kwargs: Any) -> Any:
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
    # the keywords of remat._core.options.KEYWORDS are checkpoint's; the others are function's
    opts = normalize_options(**{name: kwargs.pop(name) for name in KEYWORDS if name in kwargs})
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
        return linen_class(function, opts)
    _check_callable(function)
    if not args and not kwargs:
        return _wrap(function, opts)
    return run_region(function, opts, args, kwargs)


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
        return linen_class(function, opts)
    _check_callable(function)

    opts = dataclasses.replace(opts, trace_scalars=True)

    @functools.wraps(function)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return run_region(function, opts, args, kwargs)

    return _flax.linen_method(checkpointed)


def linen_class(cls: type[nn.Module], opts: CheckpointOptions) -> type[nn.Module]:
    """``checkpoint(nn.Dense)``: a subclass whose ``__call__`` is one checkpointed region.

    Unlike ``nn.remat(cls)`` (whose class is named ``CheckpointDense``, so auto-named
    parameters move from ``Dense_0`` to ``CheckpointDense_0``), the class keeps its name
    and so the parameter tree is unchanged; non-array call arguments pass through untraced.
    """
    # static_argnums count self as position 0, as nn.remat's do; the bound __call__ does not
    if 0 in opts.static_argnums:
        raise ValueError(f"checkpoint({cls.__name__}, static_argnums=...): position 0 is self; "
                         "the call arguments start at 1, as in nn.remat")
    opts = dataclasses.replace(opts, trace_scalars=True,
                               static_argnums=tuple(i - 1 for i in opts.static_argnums))

    @_flax.linen_method
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return run_region(cls.__call__.__get__(self), opts, args, kwargs)

    # run_region sees a bound method of a Linen module and lifts it over the module's scope,
    # applying the original (un-overridden) __call__ to the lifted copy. As nn.remat's class
    # does, this __call__ escapes Linen's method handler (linen_method), so setup() runs
    # once, inside the innermost region, however many times the class is checkpointed.
    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


# help(remat.checkpoint) and inspect.signature show its keywords, as torch's checkpoint does; the
# list itself lives once, in CheckpointKeywords.
checkpoint.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
    inspect.Parameter("function", inspect.Parameter.POSITIONAL_ONLY, default=None),
    inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
    *(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
      for f in dataclasses.fields(CheckpointKeywords)),
    inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
])

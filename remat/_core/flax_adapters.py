"""Flax adapters: NNX modules and methods through ``nnx.remat``, Linen through ``nn.checkpoint``.

Options arrive validated (:class:`remat._core.options.CheckpointOptions`); nothing here
re-checks them. The lifted transforms carry module state and RNG streams into the
region, which is why Dropout recomputes the very same mask on the backward pass.
"""
from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import flax.linen as nn
from flax import nnx

from remat._core.arguments import OutputStore, is_nnx_node, split_call
from remat._core.lowering import classic_remat, mark_region
from remat._core.options import CheckpointOptions

__all__ = ["is_nnx_node"]


# --- NNX -------------------------------------------------------------------------------

def _module_of(function: Any, kind: type) -> Any:
    """The module of class ``kind`` that ``function`` is, or whose bound method it is."""
    if isinstance(function, kind):
        return function
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, kind) and inspect.ismethod(function) else None


def nnx_owner(function: Any) -> nnx.Module | None:
    """The NNX module that ``function`` is (a submodule) or belongs to (a bound method)."""
    return _module_of(function, nnx.Module)


def function_anchor(function: Any) -> tuple[Any, str]:
    """What a region's trace cache is tied to, and the kind of call.

    For an NNX module or bound method it is the class or the method's function, because
    the module itself (its state) is an input of the region; for anything else it is the
    callable object itself, as for ``jax.checkpoint``.
    """
    if isinstance(function, nnx.Module):
        return type(function), "nnx.Module"
    if nnx_owner(function) is not None:
        return function.__func__, "nnx.Module method"
    return function, "callable"


def nnx_bound(function: Any) -> tuple[list[Any], Callable[[Sequence[Any]], Callable[..., Any]]] | None:
    """The NNX graph nodes ``function`` carries, and how to rebind it to the region's copies.

    ``function`` may be a module, a bound method, or a closure over modules (the
    ``checkpoint(lambda h: self.fc2(self.fc1(h)), x)`` of a PyTorch port). The nodes must
    go into ``nnx.remat`` as inputs, or state updates (BatchNorm statistics, RNG counts)
    inside the region would cross trace levels. Returns ``None`` when there are none.
    """
    owner = nnx_owner(function)
    if owner is not None:
        if owner is function:
            return [owner], lambda nodes: nodes[0]
        method = function.__func__  # not the bound method: it would keep the original module
        return [owner], lambda nodes: method.__get__(nodes[0])
    nodes, rebuild = captured(function, is_nnx_node)
    return (nodes, rebuild) if nodes and rebuild is not None else None


def captured(
    fn: Any, wanted: Callable[[Any], bool], _depth: int = 0
) -> tuple[list[Any], Callable[[Sequence[Any]], Callable[..., Any]] | None]:
    """The ``wanted`` objects in ``fn``'s closure (also through inner closures), and a rebuild.

    ``rebuild(values)`` returns a copy of ``fn`` whose closure holds ``values`` in their
    place, so the region can run on the copies a lifted transform hands it.
    """
    if not isinstance(fn, types.FunctionType) or not fn.__closure__ or _depth > 4:
        return [], None
    closure = fn.__closure__
    found: list[Any] = []
    parts: list[tuple[int, int, Callable[..., Any] | None] | None] = []
    for cell in closure:
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not yet assigned
            parts.append(None)
            continue
        if wanted(value):
            parts.append((len(found), 1, None))
            found.append(value)
            continue
        inner, inner_rebuild = captured(value, wanted, _depth + 1)
        parts.append((len(found), len(inner), inner_rebuild) if inner else None)
        found.extend(inner)
    if not found:
        return [], None

    def rebuild(values: Sequence[Any]) -> Callable[..., Any]:
        cells = []
        for cell, part in zip(closure, parts):
            if part is None:
                cells.append(cell)
                continue
            start, n, inner_rebuild = part
            new = values[start] if inner_rebuild is None else inner_rebuild(values[start:start + n])
            cells.append(types.CellType(new))
        copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(cells))
        copy.__kwdefaults__ = fn.__kwdefaults__
        return copy

    return found, rebuild


def nnx_remat(fn: Callable[..., Any], *, policy: Any, prevent_cse: bool | tuple,
              in_place: bool) -> Callable[..., Any]:
    """``nnx.remat(fn)``.

    ``in_place``: the nodes belong to the current trace (eager code, or inside an nnx
    transform), so every update is written back as ``nnx.remat`` does, attributes and
    graph changes included. Otherwise (a plain ``jax.grad``/``jax.jit`` over modules made
    outside it) ``nnx.remat``'s tree mode writes back only the Variables the region changed:
    the untouched parameters are never written, so the modules stay valid.
    """
    # nnx.remat hands prevent_cse to jax.checkpoint, which takes a bool per argument too
    # (flax annotates it as bool only)
    return nnx.remat(fn, policy=mark_region(policy), prevent_cse=prevent_cse,  # pyright: ignore[reportArgumentType]
                     graph_updates=None if in_place else False)


def nnx_in_place(nodes: Sequence[Any]) -> bool:
    """Whether every Variable of ``nodes`` can be updated in the current trace."""
    return all(v._can_update for _, v in nnx.graph.iter_graph(list(nodes)) if isinstance(v, nnx.Variable))


# --- Linen -----------------------------------------------------------------------------

def is_linen_class(obj: Any) -> TypeGuard[type[nn.Module]]:
    return isinstance(obj, type) and issubclass(obj, nn.Module)


def _linen_instance(function: Any) -> nn.Module | None:
    return _module_of(function, nn.Module)


def _is_linen_module(x: Any) -> bool:
    return isinstance(x, nn.Module)


def linen_owner(function: Any, args: tuple) -> nn.Module | None:
    """The Linen module to lift: ``function`` itself, its ``self``, a module first argument,
    or the one module a closure captured (``checkpoint(lambda h: self.fc(h), x)``)."""
    module = _linen_instance(function)
    if module is None and args and isinstance(args[0], nn.Module):
        module = args[0]
    if module is None:
        for a in args[1:]:
            if isinstance(a, nn.Module):
                raise TypeError(
                    f"a Linen module ({type(a).__name__}) is passed as argument "
                    f"{args.index(a)}; pass it first, or checkpoint the module itself: "
                    "checkpoint(self.layer, x)"
                )
        found, _ = captured(function, _is_linen_module)
        if not found:
            return None
        if len({id(m) for m in found}) > 1:
            raise TypeError(
                "the checkpointed function captures several Linen modules ("
                + ", ".join(sorted({type(m).__name__ for m in found}))
                + "); capture only self (e.g. lambda h: self.fc2(self.fc1(h))), or pass the module first"
            )
        module = found[0]
    if module.scope is None and module.parent is None:
        raise TypeError(
            f"the Linen module {type(module).__name__} is not bound: call checkpoint inside "
            f"the parent's __call__, or checkpoint the class: checkpoint({type(module).__name__})"
        )
    return module


def linen_call(function: Any, module: nn.Module, opts: CheckpointOptions, args: tuple, kwargs: dict) -> Any:
    """Runs ``function(*args, **kwargs)`` as a region lifted over ``module``'s scope."""
    # the module came as args[0] (else it is function itself, its self, or in its closure)
    lifted_first_arg = _linen_instance(function) is None and bool(args) and args[0] is module
    if lifted_first_arg and _is_own_method(module, function):
        # A method decorated with @remat.checkpoint, which Linen left unwrapped (see
        # linen_method): as under nn.remat, Linen's handler (and so setup) runs inside the
        # region, on the lifted copy, and the lift only validates setup outside.
        function = nn.module.wrap_method_once(function)
    closure, rebuild = ([], None) if lifted_first_arg else captured(function, _is_linen_module)
    call_args = args[1:] if lifted_first_arg else args
    static = tuple(i - 1 for i in opts.static_argnums if i > 0) if lifted_first_arg else opts.static_argnums
    call = split_call(call_args, kwargs, static, trace_scalars=opts.trace_scalars)
    store = OutputStore()

    # Marked as its own handler (linen_method), so the lift runs no setup() on the copy: what
    # the region calls (the module, its method, a submodule) sets the copy up when it needs
    # to, as in nn.remat's lifted class, and a region inside a region sets it up only once.
    @linen_method
    def region(mdl: nn.Module, *dynamic: Any) -> Any:
        a, k = call.rebuild(dynamic)
        if lifted_first_arg:
            out = function(mdl, *a, **k)
        elif rebuild is not None:
            out = rebuild([mdl] * len(closure))(*a, **k)  # the closure, on the lifted copy
        elif isinstance(function, nn.Module):
            out = mdl(*a, **k)
        else:
            out = function.__func__(mdl, *a, **k)  # the method, applied to the lifted copy
        return store.pack(out, None)

    with classic_remat():
        lifted = nn.checkpoint(region, policy=mark_region(opts.policy), prevent_cse=_linen_cse(opts, call))
        return store.unpack(lifted(module, *call.dynamic), None)


def linen_method(checkpointed: Callable[..., Any]) -> Callable[..., Any]:
    """Marks a decorated function so that Linen does not wrap it as a module method.

    Linen wraps each method of a Module class with a handler that sets the module up
    first. Under ``nn.remat`` that handler runs inside the lifted region instead
    (``linen_call`` does the same), so ``setup`` runs as often with remat as there.
    The mark means nothing for functions that never become Linen methods.
    """
    checkpointed.method_handler_wrapped = True  # type: ignore[attr-defined]
    return checkpointed


def _is_own_method(module: nn.Module, function: Any) -> bool:
    attribute = getattr(type(module), getattr(function, "__name__", ""), None)
    return getattr(attribute, "__wrapped__", None) is function


def linen_call_children(
    parent: nn.Module, children: list[Any], body: Callable[[list[Any], Any], Any],
    opts: CheckpointOptions, x: Any,
) -> Any:
    """Runs ``body(children, x)`` as one region lifted over the children's common parent.

    Linen's lifted transforms take one module; a segment of ``checkpoint_sequential``
    spans several siblings, so the region receives the parent and finds each child in
    the parent's copy by the attribute that holds it. ``children`` may also hold plain
    callables (``nn.tanh``), which are called as they are.
    """
    # Plain callables in the chunk (nn.tanh in an nn.Sequential) have no path: they stay as they are.
    paths = [_attribute_path(parent, c) if isinstance(c, nn.Module) else None for c in children]
    store = OutputStore()

    def region(mdl: nn.Module, *dynamic: Any) -> Any:
        mine = [c if p is None else _follow(mdl, p) for c, p in zip(children, paths)]
        return store.pack(body(mine, call.rebuild(dynamic)[0][0]), None)

    call = split_call((x,), {}, ())
    with classic_remat():
        lifted = nn.checkpoint(region, policy=mark_region(opts.policy), prevent_cse=_linen_cse(opts, call))
        return store.unpack(lifted(parent, *call.dynamic), None)


def _linen_cse(opts: CheckpointOptions, call: Any) -> bool:
    """Linen's lifted checkpoint takes one bool: any argument asking for CSE prevention gets it."""
    return opts.prevent_cse if isinstance(opts.prevent_cse, bool) else any(call.prevent_cse)


def _attribute_path(parent: nn.Module, child: nn.Module) -> tuple[str, int | None]:
    for name, value in vars(parent).items():
        if value is child:
            return name, None
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                if v is child:
                    return name, i
    raise TypeError(
        f"cannot checkpoint the Linen layer {type(child).__name__}: define the layers in the "
        "parent's setup() (as an attribute or a list attribute), as nn.Sequential does"
    )


def _follow(module: nn.Module, path: tuple[str, int | None]) -> nn.Module:
    name, index = path
    value = getattr(module, name)
    return value if index is None else value[index]

"""Remat's entry points, and the same calls with every checkpoint replaced by the identity.

A program is written once against a :class:`Remat` object; running it with :class:`Plain`
instead gives the reference that checkpointing must not change.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

import remat
from remat import policies


def make_policy(spec: Any) -> Any:
    """A JSON policy spec as remat spells it: ``None``, a name, a name list, or a
    ``{"save_names"|"save_all_but"|"offload"|"selective": [...]}``, ``{"any_of": [spec, ...]}``,
    ``{"budget": fraction}`` or ``{"budget_bytes": n}`` dict."""
    if spec is None or isinstance(spec, str):
        return spec
    if isinstance(spec, list):
        return list(spec)
    (kind, arg), = spec.items()
    if kind == "save_names":
        return policies.save_names(*arg)
    if kind == "save_all_but":
        return policies.save_all_but(*arg)
    if kind == "offload":
        return policies.offload_names(*arg)
    if kind == "selective":
        return policies.selective(arg)
    if kind == "any_of":
        return policies.any_of(*(make_policy(p) for p in arg))
    if kind == "budget":
        return remat.residual_budget(arg)
    if kind == "budget_bytes":
        return remat.residual_budget(bytes=arg)
    raise ValueError(f"unknown policy spec {spec!r}")


def options(spec: dict, n_args: int) -> dict:
    """``policy=`` and ``prevent_cse=`` for a region of ``n_args`` arguments."""
    opts: dict[str, Any] = {"policy": make_policy(spec.get("policy"))}
    cse = spec.get("prevent_cse", True)
    if isinstance(cse, list):  # per argument: as many flags as the region has arguments
        cse = tuple((cse * n_args)[:n_args])
    opts["prevent_cse"] = cse
    return opts


class Remat:
    """The real thing."""

    checkpointing = True

    def checkpoint(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        return remat.checkpoint(fn, *args, **kw)

    def decorate(self, fn: Callable[..., Any], **kw: Any) -> Callable[..., Any]:
        return remat.checkpoint(**kw)(fn)

    def sequential(self, fns: Sequence[Callable[..., Any]], segments: int, x: Any, **kw: Any) -> Any:
        return remat.checkpoint_sequential(fns, segments, x, **kw)

    def apply(self, model: Any, classes: Any, **kw: Any) -> Any:
        return remat.apply_checkpointing(model, classes, **kw)


class Plain(Remat):
    """The same calls, no checkpoint anywhere."""

    checkpointing = False

    def checkpoint(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        for name in ("policy", "prevent_cse", "static_argnums", "use_reentrant"):
            kw.pop(name, None)
        return fn(*args, **kw)

    def decorate(self, fn: Callable[..., Any], **kw: Any) -> Callable[..., Any]:
        return fn

    def sequential(self, fns: Sequence[Callable[..., Any]], segments: int, x: Any, **kw: Any) -> Any:
        return functools.reduce(lambda h, f: f(h), fns, x)

    def apply(self, model: Any, classes: Any, **kw: Any) -> Any:
        return model


def outer_checkpoint(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The placement "inside an outer jax.checkpoint" (kept in both runs: it is not remat's)."""
    return jax.checkpoint(fn)

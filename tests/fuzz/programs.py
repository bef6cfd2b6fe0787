"""Builds a drawn function program from its spec: ops before, inside and after one region.

A program is built once per case (so remat's trace caches see the same function across
the case's calls) against a :class:`~tests.fuzz.checkpointer.Remat` or ``Plain`` object.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .checkpointer import Remat, make_policy, options
from .ops import N, run_ops

# the region's positional arguments: arrays first, then the Python values
ARG_NAMES = ("h", "w", "b", "idx", "key", "scale", "cfg", "mode")
DIFF_NAMES = ("x", "w", "b")  # the differentiable inputs, in order; spec["inputs"] of them are


class Program:
    """``program(params)`` for the current call; :meth:`set_call` moves to the next call.

    ``params`` holds the differentiable inputs (``x`` and, per spec, ``w`` and ``b``);
    the rest (constants, an int index array, a PRNG key, a Python scalar, a mutable
    config dict read at trace time, a static mode string) live in the program.
    """

    def __init__(self, spec: dict, ck: Remat):
        self.spec, self.ck = spec, ck
        self.dtype = jnp.dtype(spec["dtype"])
        rng = np.random.default_rng(spec["seed"])
        self.w0 = jnp.asarray(rng.normal(size=(N, N)) * 0.6, self.dtype)
        self.b0 = jnp.asarray(rng.normal(size=(N,)), self.dtype)
        self.key = jax.random.key(spec["seed"])
        self.cfg = {"shift": 0.0}  # one dict for the whole case, mutated in place between calls
        self.call: dict = {}
        self.region = self._build_region()

    # --- the region ---------------------------------------------------------------------

    def _body(self, h: Any, w: Any, b: Any, idx: Any, key: Any, scale: Any, cfg: dict, mode: str) -> Any:
        env = {"w": w, "b": b, "idx": idx, "key": key, "scale": scale, "cfg": cfg, "mode": mode}
        steps = self.spec["body"]
        if self.spec["form"] == "nested" and len(steps) >= 2:
            mid = len(steps) // 2
            h = run_ops(steps[:mid], h, env)
            inner = functools.partial(run_ops, steps[mid:], offset=mid)
            opts = options({**self.spec, "policy": self.spec.get("inner_policy")}, 2)
            # a bool: an inner per-argument tuple inside a saving outer region hits a JAX bug
            # (tests/test_fuzz_regressions.py, xfail), with or without remat
            opts["prevent_cse"] = bool(opts["prevent_cse"])
            h = self.ck.checkpoint(lambda h, env: inner(h, env), h, env, **opts)
        else:
            h = run_ops(steps, h, env)
        return self._outputs(h, scale)

    def _outputs(self, h: Any, scale: Any) -> Any:
        kind = self.spec["output"]
        if kind == "array":
            return h
        if kind == "pytree":  # a dict, a tuple, and the Python scalar come back as an array
            return {"h": h, "stats": (jnp.sum(h, axis=0), jnp.tanh(h)), "scale": jnp.asarray(scale) * 1}
        if kind == "int":
            return h, jnp.argmax(h, axis=1)
        return h, h > 0  # bool

    def _build_region(self) -> Callable[..., Any]:
        spec, ck = self.spec, self.ck
        form = spec["form"]
        static = tuple(spec.get("static", ()))
        opts = options(spec, len(ARG_NAMES) - len(static))  # prevent_cse flags: the non-static arguments
        if form == "decorator":
            return ck.decorate(self._body, static_argnums=static, **opts)
        if form == "sequential":
            return self._sequential
        if form == "partial":
            def region(h, w, b, idx, key, scale, cfg, mode):
                part = functools.partial(self._body, scale=scale, cfg=cfg, mode=mode)
                return ck.checkpoint(part, h, w, b, idx, key, **options(spec, 5))
            return region
        return lambda *args: ck.checkpoint(self._body, *args, static_argnums=static, **opts)  # call, nested

    def _sequential(self, h, w, b, idx, key, scale, cfg, mode):
        env = {"w": w, "b": b, "idx": idx, "key": key, "scale": scale, "cfg": cfg, "mode": mode}
        layers = [functools.partial(run_ops, [step], env=env, offset=i) for i, step in enumerate(self.spec["body"])]
        segments = min(self.spec.get("segments", 2), len(layers))
        policy = make_policy(self.spec.get("policy"))
        h = self.ck.sequential(layers, segments, h, policy=policy, prevent_cse=bool(self.spec.get("prevent_cse", True)))
        return self._outputs(h, scale)

    # --- calls ----------------------------------------------------------------------------

    def set_call(self, k: int) -> dict:
        """Moves to call ``k`` of the spec's call sequence; returns its ``params``."""
        self.call = self.spec["calls"][k]
        self.cfg["shift"] = self.call["shift"]  # mutated in place: a stale trace would miss it
        rng = np.random.default_rng([self.spec["seed"], k])
        batch = (2,) if self.spec["placement"] in ("vmap", "map") else ()
        x = jnp.asarray(rng.normal(size=(*batch, self.call["n"], N)) * 0.7, self.dtype)
        self.idx = jnp.asarray(rng.integers(0, N, size=(self.call["n"], N)), jnp.int32)
        params = {"x": x, "w": self.w0 + 0.1 * k, "b": self.b0 - 0.1 * k}
        return {name: params[name] for name in DIFF_NAMES[: self.spec["inputs"]]}

    def __call__(self, params: dict) -> Any:
        w = params.get("w", self.w0)
        b = params.get("b", self.b0)
        env = {"w": w, "b": b, "idx": self.idx, "key": self.key, "scale": self.call["scale"],
               "cfg": self.cfg, "mode": self.call["mode"]}
        h = run_ops(self.spec["pre"], params["x"], env, offset=100)
        out = self.region(h, w, b, self.idx, self.key, self.call["scale"], self.cfg, self.call["mode"])
        h, rest = (out, None) if self.spec["output"] == "array" else (
            (out["h"], out) if self.spec["output"] == "pytree" else out)
        return {"y": run_ops(self.spec["post"], h, env, offset=200), "rest": rest}

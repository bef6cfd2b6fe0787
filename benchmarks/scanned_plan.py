"""``python -m benchmarks.scanned_plan``: planning a scanned Llama-shaped step against jitting it.

A pure-JAX decoder layer (RMS norm, causal attention, SwiGLU MLP, the attention output
and the MLP hidden tagged with ``checkpoint_name``), checkpointed with
``remat.checkpoint`` inside the body of one ``lax.scan`` over its stacked weights.
Prints one JSON line: ``plan_s`` (``remat.plan``'s default search, rates calibrated
beforehand; with ``--no-measure`` the fitting candidates are not timed), ``jit_s`` (the
median of three times to trace, lower and compile ``jax.jit(jax.grad(step))`` alone,
before and after the plan), the plan chosen, how many programs it compiled, and whether
it fits.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp

import remat


def rms(x: Any, g: Any) -> Any:
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


def layer(w: dict, x: Any, heads: int) -> Any:
    """One decoder layer, ``(B, T, C) -> (B, T, C)``."""
    b, t, c = x.shape
    h = rms(x, w["n1"])
    q, k, v = (jnp.einsum("btc,cd->btd", h, w[n]).reshape(b, t, heads, c // heads) for n in ("wq", "wk", "wv"))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (c // heads) ** 0.5
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, c)
    x = x + remat.checkpoint_name(a @ w["wo"], "attn_out")
    h = rms(x, w["n2"])
    u = remat.checkpoint_name(jax.nn.silu(h @ w["wg"]) * (h @ w["wu"]), "mlp_hidden")
    return x + u @ w["wd"]


def scanned_step(depth: int, width: int, heads: int, mlp: int, vocab: int, batch: int, seq: int) -> tuple:
    """``(loss, params, ids)``: the embedding, ``depth`` layers in one ``lax.scan``, the head."""
    ks = iter(jax.random.split(jax.random.PRNGKey(0), 16))

    def normal(*shape: int) -> Any:
        return jax.random.normal(next(ks), shape) / shape[-2] ** 0.5

    stack = {"wq": normal(depth, width, width), "wk": normal(depth, width, width),
             "wv": normal(depth, width, width), "wo": normal(depth, width, width),
             "wg": normal(depth, width, mlp), "wu": normal(depth, width, mlp), "wd": normal(depth, mlp, width),
             "n1": jnp.ones((depth, width)), "n2": jnp.ones((depth, width))}
    params = {"embed": normal(vocab, width), "layers": stack, "norm": jnp.ones(width), "head": normal(width, vocab)}

    def loss(params: dict, ids: Any) -> Any:
        def body(h: Any, w: dict) -> tuple[Any, None]:
            return remat.checkpoint(lambda w_, h_: layer(w_, h_, heads), w, h), None
        x, _ = jax.lax.scan(body, params["embed"][ids], params["layers"])
        return -jnp.mean(jax.nn.log_softmax(rms(x, params["norm"]) @ params["head"])[..., 0])

    return loss, params, jax.random.randint(next(ks), (batch, seq), 0, vocab)


def jit_seconds(loss: Any, params: Any, ids: Any) -> float:
    """Seconds to trace, lower and compile ``jax.jit(jax.grad(loss))`` (a fresh function: no cache)."""
    started = time.perf_counter()
    jax.jit(jax.grad(lambda p, i: loss(p, i))).lower(params, ids).compile()
    return time.perf_counter() - started


def measure(budget: float, timed: bool = True, **sizes: int) -> dict[str, Any]:
    """The plan's and the jit's seconds, side by side in this process (``timed``: the
    plan times its fitting candidates, ``remat.plan(measure=)``)."""
    from remat.analysis.machine import calibrate_once

    loss, params, ids = scanned_step(**sizes)
    calibrate_once()  # once per process: not a cost of planning this step
    jits = [jit_seconds(loss, params, ids)]
    started = time.perf_counter()
    p = remat.plan(loss, params, ids, memory_budget=budget, measure=timed)
    plan_s = time.perf_counter() - started
    jits += [jit_seconds(loss, params, ids) for _ in range(2)]
    chosen = p.chosen
    return {"plan_s": plan_s, "jit_s": statistics.median(jits), "regions": p.num_regions,
            "chosen": None if chosen is None else chosen.label,
            "compiled": sum(c.compiled is not None for c in p.candidates),
            "fits": chosen is not None and chosen.temp_bytes is not None and chosen.temp_bytes <= p.limit_bytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scanned_plan", description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--no-measure", dest="timed", action="store_false",
                        help="choose by predicted time: the fitting candidates are not timed")
    for name, default in (("depth", 32), ("width", 256), ("heads", 4), ("mlp", 688), ("vocab", 256),
                          ("batch", 4), ("seq", 128)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = vars(parser.parse_args(argv))
    print(json.dumps(measure(args.pop("budget"), args.pop("timed"), **args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

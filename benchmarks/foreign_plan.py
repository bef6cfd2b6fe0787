"""``python -m benchmarks.foreign_plan``: planning regions written with ``jax.checkpoint``,
``nnx.remat`` or ``nn.remat`` against the same steps written with ``remat.checkpoint``.

Four steps of residual MLP blocks (``h + tanh(h @ w1) @ w2``, hidden four widths): unrolled,
in the body of a ``lax.scan``, an ``nnx.scan`` over an ``nnx.vmap`` stack, and a
``flax.linen.scan`` stack; each written twice, with the JAX or Flax transform and with
remat's. Each is planned by the default search (``measure=False``: the fitting
candidates are not timed, so the figure is the search's own), in interleaved rounds after
one warm-up plan each; the medians of ``plan_s`` and the programs each plan compiled and
chose are written to ``docs/results/foreign-plan.md``.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import remat
from benchmarks.results import add_results_argument, write_result

Step = tuple[Callable[..., Any], Any, Any]


def block(w: dict, h: Any) -> Any:
    return h + jnp.tanh(h @ w["w1"]) @ w["w2"]


def weights(key: Any, width: int, *lead: int) -> dict:
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (*lead, width, 4 * width)) / width ** 0.5,
            "w2": jax.random.normal(k2, (*lead, 4 * width, width)) / (4 * width) ** 0.5}


def unrolled(depth: int, width: int, batch: int, foreign: bool) -> Step:
    def loss(params: list, x: Any) -> Any:
        for w in params:
            x = jax.checkpoint(block)(w, x) if foreign else remat.checkpoint(block, w, x)
        return jnp.mean(x ** 2)

    keys = jax.random.split(jax.random.PRNGKey(0), depth + 1)
    return loss, [weights(k, width) for k in keys[:-1]], jax.random.normal(keys[-1], (batch, width))


def lax_scanned(depth: int, width: int, batch: int, foreign: bool) -> Step:
    def loss(params: dict, x: Any) -> Any:
        def body(h: Any, w: dict) -> tuple[Any, None]:
            return (jax.checkpoint(block)(w, h) if foreign else remat.checkpoint(block, w, h)), None
        return jnp.mean(jax.lax.scan(body, x, params)[0] ** 2)

    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return loss, weights(k1, width, depth), jax.random.normal(k2, (batch, width))


def nnx_scanned(depth: int, width: int, batch: int, foreign: bool) -> Step:
    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.up = nnx.Linear(width, 4 * width, rngs=rngs)
            self.down = nnx.Linear(4 * width, width, rngs=rngs)

        def __call__(self, h: Any) -> Any:
            return h + self.down(jnp.tanh(self.up(h)))

    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key: Any) -> Block:
        return Block(nnx.Rngs(key))

    stack = make(jax.random.split(jax.random.key(0), depth))
    if not foreign:
        remat.apply_checkpointing(stack, Block)
    graphdef, state = nnx.split(stack)

    def layer(module: Block, h: Any) -> Any:
        return module(h)

    def loss(state: Any, x: Any) -> Any:
        body = nnx.scan(nnx.remat(layer) if foreign else layer, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        return jnp.mean(body(nnx.merge(graphdef, state), x) ** 2)

    return loss, state, jax.random.normal(jax.random.PRNGKey(1), (batch, width))


def linen_scanned(depth: int, width: int, batch: int, foreign: bool) -> Step | None:
    """The ``nn.remat`` layer stacked by ``nn.scan``; None for the ``remat.checkpoint`` writing
    (remat's Linen forms do not run inside ``nn.scan``: ``remat.scan.LinenScanLayers`` is
    remat's stack, which the compile-everything search plans)."""
    if not foreign:
        return None

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h: Any, _: Any) -> tuple[Any, None]:
            return h + nn.Dense(width)(jnp.tanh(nn.Dense(4 * width)(h))), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            layers = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=depth)
            return layers(name="layers")(x, None)[0]

    model, x = Stack(), jax.random.normal(jax.random.PRNGKey(1), (batch, width))

    def loss(params: Any, x: Any) -> Any:
        return jnp.mean(model.apply(params, x) ** 2)

    return loss, model.init(jax.random.PRNGKey(0), x), x


#: ``(name, the step's maker, the budget it is planned at)``: four unrolled blocks need more
#: than half of the un-checkpointed temp memory (the last block's working set stays live).
CASES = [("unrolled blocks", unrolled, 0.6), ("lax.scan", lax_scanned, 0.5),
         ("nnx.scan over nnx.vmap", nnx_scanned, 0.5), ("flax.linen.scan", linen_scanned, 0.5)]


def plan_once(step: Step, budget: float) -> tuple[float, Any]:
    """``(seconds, plan)`` of one default search of ``step``."""
    loss, params, x = step
    started = time.perf_counter()
    p = remat.plan(loss, params, x, memory_budget=budget, measure=False)
    return time.perf_counter() - started, p


def measure(depth: int, width: int, batch: int, rounds: int) -> list[dict[str, Any]]:
    """Per case, the two writings' median plan seconds, and what each plan compiled and chose."""
    from remat.analysis.machine import calibrate_once

    calibrate_once()  # once per process: not a cost of planning either step
    rows = []
    for name, make, budget in CASES:
        steps = [make(depth, width, batch, foreign) for foreign in (False, True)]
        present = [k for k, step in enumerate(steps) if step is not None]
        plans: list[Any] = [None, None]
        for k in present:  # warm-up: first-use imports and caches
            plans[k] = plan_once(steps[k], budget)[1]
        seconds: list[list[float]] = [[], []]
        for r in range(rounds):  # interleaved, the order alternating
            for k in (present if r % 2 == 0 else present[::-1]):
                s, plans[k] = plan_once(steps[k], budget)
                seconds[k].append(s)
        rows.append({"case": name, "budget": budget,
                     "seconds": [statistics.median(s) if s else None for s in seconds],
                     "compiled": [None if p is None else sum(c.compiled is not None for c in p.candidates)
                                  for p in plans],
                     "chosen": [None if p is None else p.chosen.label if p.chosen is not None else "cannot be met"
                                for p in plans]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of :func:`measure`'s rows (``-``: no ``remat.checkpoint`` writing)."""
    lines = ["| step | budget | `remat.checkpoint` plan_s | `jax.checkpoint` / Flax plan_s | ratio | compiles | "
             "plan chosen |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        (ours, theirs), (n_ours, n_theirs) = r["seconds"], r["compiled"]
        ratio = f"{theirs / ours:.2f}" if ours else "-"
        chosen = " / ".join(dict.fromkeys(c for c in r["chosen"] if c is not None))
        lines.append(f"| {r['case']} | {r['budget']} | {_cell(ours, '.2f')} | {theirs:.2f} | {ratio} | "
                     f"{_cell(n_ours, 'd')} / {n_theirs} | {chosen} |")
    return "\n".join(lines) + "\n"


def _cell(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.foreign_plan", description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    add_results_argument(parser)
    args = parser.parse_args(argv)
    rows = measure(args.depth, args.width, args.batch, args.rounds)
    text = table(rows)
    print(text, end="")
    body = (f"Medians of {args.rounds} interleaved plans of each writing ({args.depth} blocks of width "
            f"{args.width}, batch {args.batch}; compiles: programs each plan compiled, the "
            "`remat.checkpoint` writing's first):\n\n" + text)
    write_result(args.results, "foreign-plan", body, argv, "benchmarks.foreign_plan")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

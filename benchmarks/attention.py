"""``python -m benchmarks.attention``: attention's forward and backward, written out, in tiles, and PyTorch's.

One causal grouped-query attention at SmolLM-135M's shape (batch 2, 9 query heads, 3
key/value heads, head 64; seq 512 by default), as ``jit(value_and_grad)`` of the sum of
its output: the scores written out (``softmax(q @ k.T) @ v`` with the key/value heads
repeated, what the Llama twin ran before :func:`remat.ops.scaled_dot_product_attention`),
the tiled op at several ``chunk`` sizes, and ``torch.nn.functional.scaled_dot_product_attention``
(``enable_gqa=True``; PyTorch's CPU flash kernel) when torch is installed. Each variant is
timed in interleaved rounds in one process (medians); the compiled temp bytes come from
``memory_analysis()``. Writes ``docs/results/attention.md``.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.results import add_results_argument, write_result
from remat import ops

MiB = 2**20
BATCH, HEADS, KV_HEADS, HEAD_DIM = 2, 9, 3, 64
CHUNKS: tuple[Any, ...] = (64, 128, 256, (128, 256), 512)


def written_out(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Attention with its ``[b, h, t, t]`` scores, as HuggingFace's eager path writes it."""
    group = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, group, 1), jnp.repeat(v, group, 1)
    wide = jnp.promote_types(q.dtype, jnp.float32)
    scores = jnp.einsum("bhqe,bhke->bhqk", q, k, preferred_element_type=wide) * q.shape[-1] ** -0.5
    t = q.shape[2]
    p = jax.nn.softmax(jnp.where(jnp.tri(t, dtype=bool), scores, -jnp.inf), -1).astype(v.dtype)
    return jnp.einsum("bhqk,bhke->bhqe", p, v, preferred_element_type=wide).astype(v.dtype)


def tiled(chunk: Any) -> Callable[..., jax.Array]:
    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return ops.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, chunk=chunk)
    return attend


def _jax_step(attend: Callable[..., jax.Array], args: tuple[jax.Array, ...]) -> tuple[Callable[[], Any], int]:
    step = jax.jit(jax.value_and_grad(lambda *a: attend(*a).astype(jnp.float32).sum(), (0, 1, 2)))
    temp = step.lower(*args).compile().memory_analysis().temp_size_in_bytes  # pyright: ignore[reportOptionalMemberAccess]
    return (lambda: jax.block_until_ready(step(*args))), temp


def _torch_step(args: tuple[jax.Array, ...], dtype: str) -> Callable[[], Any] | None:
    try:
        import torch
    except ImportError:
        return None
    tdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    q, k, v = (torch.tensor(np.asarray(a.astype(jnp.float32)), dtype=tdtype, requires_grad=True) for a in args)

    def step() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.float().sum().backward()
    return step


def measure(seq: int, dtype: str, rounds: int, steps: int) -> list[dict[str, Any]]:
    """One row per variant: median step ms over ``rounds`` interleaved rounds of ``steps`` steps."""
    rng = np.random.default_rng(0)
    args = tuple(jnp.asarray(rng.normal(size=(BATCH, h, seq, HEAD_DIM)), dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
    variants: dict[str, tuple[Callable[[], Any], int | None]] = {"written out": _jax_step(written_out, args)}
    for chunk in CHUNKS:
        variants[f"remat.ops, chunk {chunk}"] = _jax_step(tiled(chunk), args)
    torch_step = _torch_step(args, dtype)
    if torch_step is not None:
        variants["torch SDPA"] = (torch_step, None)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for step, _ in variants.values():
        step()  # compile, warm up
    for _ in range(rounds):
        for name, (step, _) in variants.items():
            start = time.perf_counter()
            for _ in range(steps):
                step()
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    return [{"variant": name, "dtype": dtype, "seq": seq, "step_ms": statistics.median(times[name]),
             "temp_bytes": temp} for name, (_, temp) in variants.items()]


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| dtype | variant | forward + backward ms | compiled temp MiB |", "|---|---|---|---|"]
    for r in rows:
        temp = "—" if r["temp_bytes"] is None else f"{r['temp_bytes'] / MiB:.1f}"
        lines.append(f"| {r['dtype']} | {r['variant']} | {r['step_ms']:.1f} | {temp} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    add_results_argument(parser)
    args = parser.parse_args(argv)
    rows = [row for dtype in args.dtypes.split(",") for row in measure(args.seq, dtype, args.rounds, args.steps)]
    table = markdown(rows)
    print(table)
    head = (f"Causal grouped-query attention, batch {BATCH}, {HEADS} query heads, {KV_HEADS} key/value heads, "
            f"head {HEAD_DIM}, seq {args.seq}: `jit(value_and_grad)` of the output's sum; medians of "
            f"{args.rounds} interleaved rounds of {args.steps} steps in one process.\n\n")
    write_result(args.results, "attention", head + table, argv, module="benchmarks.attention")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

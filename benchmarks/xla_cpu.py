"""``python -m benchmarks.xla_cpu``: what per-block checkpointing saves on XLA:CPU, JAX's and remat's.

Three unrolled models, each compiled as ``jit(grad(loss))`` three ways: no checkpoint,
``jax.checkpoint`` per block, and ``remat.checkpoint`` per block. Prints the compiled
temp bytes (``memory_analysis().temp_size_in_bytes``) as a Markdown table; the XLA:CPU table
of docs/design.md is this output.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

import remat
from benchmarks.results import add_results_argument, write_result
from remat.analysis import compiled_memory

MiB = 2**20


def _layer_norm(x: jax.Array) -> jax.Array:
    h = x - x.mean(-1, keepdims=True)
    return h * jax.lax.rsqrt((h * h).mean(-1, keepdims=True) + 1e-5)


def _transformer_block(p: dict, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    q, k, v = jnp.split(_layer_norm(x) @ p["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, 4, d // 4) for a in (q, k, v))
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(d / 4), -1e9)
    x = x + jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores), v).reshape(b, t, d) @ p["out"]
    return x + jax.nn.gelu(_layer_norm(x) @ p["up"]) @ p["down"]


def _gelu_block(p: dict, x: jax.Array) -> jax.Array:
    return x + jax.nn.gelu(_layer_norm(x) @ p["up"]) @ p["down"]


def _tanh_block(p: dict, x: jax.Array) -> jax.Array:
    return jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"])


@dataclass(frozen=True)
class Model:
    """An unrolled stack: ``loss(params, x)`` with each block wrapped by ``wrap``."""

    name: str
    block: Callable[[dict, jax.Array], jax.Array]
    shapes: dict[str, tuple[int, ...]]
    depth: int
    input_shape: tuple[int, ...]
    embed_vocab: int = 0  # > 0: the input is token ids through an embedding table

    def params(self) -> dict[str, Any]:
        keys = iter(jax.random.split(jax.random.key(0), self.depth * len(self.shapes) + 1))
        blocks = [{n: jax.random.normal(next(keys), s) * 0.05 for n, s in self.shapes.items()}
                  for _ in range(self.depth)]
        width = self.input_shape[-1] if not self.embed_vocab else self.shapes["out"][0]
        embed = jax.random.normal(next(keys), (max(self.embed_vocab, 1), width)) * 0.05
        return {"blocks": blocks, "embed": embed}

    def inputs(self) -> jax.Array:
        if self.embed_vocab:
            return jnp.zeros(self.input_shape, jnp.int32)
        return jnp.ones(self.input_shape)

    def loss(self, wrap: Callable[[Callable], Callable]) -> Callable[[dict, jax.Array], jax.Array]:
        block = wrap(self.block)

        def loss(params: dict, x: jax.Array) -> jax.Array:
            h = params["embed"][x] if self.embed_vocab else x
            for p in params["blocks"]:
                h = block(p, h)
            return jnp.mean(h**2)

        return loss

    def temp_bytes(self, wrap: Callable[[Callable], Callable]) -> int:
        """XLA's temp bytes of ``jax.jit(jax.grad(loss))`` (:func:`remat.analysis.compiled_memory`)."""
        return compiled_memory(self.loss(wrap), self.params(), self.inputs()).temp_bytes


D = 128
MODELS = (
    Model("pre-LN transformer, 4 blocks, embedding (B=8, T=128, D=128)", _transformer_block,
          {"qkv": (D, 3 * D), "out": (D, D), "up": (D, 4 * D), "down": (4 * D, D)}, 4, (8, 128),
          embed_vocab=256),
    Model("pre-LN GELU MLP, 8 blocks (B=256, D=128)", _gelu_block,
          {"up": (D, 4 * D), "down": (4 * D, D)}, 8, (256, D)),
    Model("tanh MLP, 8 blocks of 2 layers (B=512, D=128)", _tanh_block,
          {"w1": (D, 4 * D), "w2": (4 * D, D)}, 8, (512, D)),
)

WRAPS: dict[str, Callable[[Callable], Callable]] = {
    "no checkpoint": lambda f: f,
    "jax.checkpoint": jax.checkpoint,
    "remat.checkpoint": remat.checkpoint,
}


def measure(models: tuple[Model, ...] = MODELS) -> list[dict[str, Any]]:
    """One row per model: its temp bytes for each of :data:`WRAPS`."""
    return [{"model": m.name, **{w: m.temp_bytes(wrap) for w, wrap in WRAPS.items()}} for m in models]


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | " + " | ".join(WRAPS) + " |", "|---" * (len(WRAPS) + 1) + "|"]
    for r in rows:
        lines.append(f"| {r['model']} | " + " | ".join(f"{r[w] / MiB:.1f} MiB" for w in WRAPS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.xla_cpu", description=__doc__.split("\n")[0])
    add_results_argument(parser)
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}")
    table = markdown(measure())
    print(table)
    write_result(args.results, "xla-cpu", table, argv, "benchmarks.xla_cpu")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``remat profile``: residual bytes, compiled memory and step time per checkpoint policy."""
from __future__ import annotations

import argparse
from typing import Any

from remat.cli._common import EXIT_OK, UsageError, print_json, print_table

HELP = "compare checkpoint policies for one model: residual bytes, compiled memory, step time"
EXAMPLE = "remat profile transformer --depth 8 --plot policies.png"

DEFAULT_POLICIES = "none,nothing,dots,dots_no_batch,everything"
MODEL_NAMES = ("mlp", "transformer")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help=f"one of: {', '.join(MODEL_NAMES)}")
    parser.add_argument("--depth", type=int, default=4, help="number of blocks (default 4)")
    parser.add_argument("--width", type=int, default=None, help="model width (default: mlp 128, transformer 64)")
    parser.add_argument("--batch-size", type=int, default=None, help="batch size (default: mlp 256, transformer 4)")
    parser.add_argument("--policies", default=DEFAULT_POLICIES,
                        help=f"comma-separated policies to compare (default {DEFAULT_POLICIES}); 'none' = no checkpoint")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per policy, median reported (default 5)")
    parser.add_argument("--plot", metavar="FILE", default=None, help="also write a PNG of memory vs step time")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _policies(spec: str) -> tuple[str, ...]:
    from remat.policies import NAMED_POLICIES

    names = tuple(p.strip() for p in spec.split(",") if p.strip())
    valid = ("none", *NAMED_POLICIES)
    bad = [p for p in names if p not in valid]
    if not names or bad:
        raise UsageError(f"--policies {spec!r}: unknown {bad or 'empty list'}; use a comma list of {', '.join(valid)}")
    return names


def _mlp(depth: int, width: int, batch: int) -> tuple[Any, tuple]:
    """Pre-LN MLP blocks (x + W2 gelu(W1 LN(x))): a policy factory and its inputs."""
    import jax
    import jax.numpy as jnp

    from remat.memory import with_policy

    def block(p, x):
        return x + jax.nn.gelu(_layer_norm(x) @ p["w1"]) @ p["w2"]

    keys = jax.random.split(jax.random.PRNGKey(0), 2 * depth)
    params = [{"w1": jax.random.normal(keys[2 * i], (width, 4 * width)) * width ** -0.5,
               "w2": jax.random.normal(keys[2 * i + 1], (4 * width, width)) * (4 * width) ** -0.5}
              for i in range(depth)]
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, width))

    def factory(policy):
        blk = with_policy(block, policy)

        def loss(params, x):
            for p in params:
                x = blk(p, x)
            return jnp.mean(x ** 2)

        return loss

    return factory, (params, x)


def _transformer(depth: int, width: int, batch: int, seq_len: int = 64, heads: int = 4) -> tuple[Any, tuple]:
    """Pre-LN transformer blocks (attention + MLP): a policy factory and its inputs."""
    import jax
    import jax.numpy as jnp

    from remat.memory import with_policy

    if width % heads:
        raise UsageError(f"--width {width} must be divisible by the {heads} attention heads")

    def block(p, x):
        b, t, d = x.shape
        h = _layer_norm(x)
        split = lambda y: y.reshape(b, t, heads, d // heads)  # noqa: E731
        q, k, v = split(h @ p["wq"]), split(h @ p["wk"]), split(h @ p["wv"])
        att = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k) / (d // heads) ** 0.5, axis=-1)
        x = x + jnp.einsum("bhts,bshd->bthd", att, v).reshape(b, t, d) @ p["wo"]
        return x + jax.nn.gelu(_layer_norm(x) @ p["w1"]) @ p["w2"]

    shapes = {"wq": (width, width), "wk": (width, width), "wv": (width, width), "wo": (width, width),
              "w1": (width, 4 * width), "w2": (4 * width, width)}
    params = []
    for layer_key in jax.random.split(jax.random.PRNGKey(0), depth):
        ks = jax.random.split(layer_key, len(shapes))
        params.append({n: jax.random.normal(k, s) * s[0] ** -0.5 for k, (n, s) in zip(ks, shapes.items())})
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, seq_len, width))

    def factory(policy):
        blk = with_policy(block, policy)

        def loss(params, x):
            for p in params:
                x = blk(p, x)
            return jnp.mean(x ** 2)

        return loss

    return factory, (params, x)


def _layer_norm(x):
    import jax.numpy as jnp

    h = x - x.mean(-1, keepdims=True)
    return h / jnp.sqrt((h * h).mean(-1, keepdims=True) + 1e-5)


def run(args: argparse.Namespace) -> int:
    if args.model not in MODEL_NAMES:
        raise UsageError(f"unknown model {args.model!r}; use one of: {', '.join(MODEL_NAMES)}")
    if args.depth < 1:
        raise UsageError(f"--depth {args.depth}: use at least 1")
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: use at least 1")
    for flag in ("width", "batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} {value}: use a positive number")
    policies = _policies(args.policies)

    from remat.memory import compare_policies

    if args.model == "mlp":
        factory, inputs = _mlp(args.depth, args.width or 128, args.batch_size or 256)
    else:
        factory, inputs = _transformer(args.depth, args.width or 64, args.batch_size or 4)
    table = compare_policies(factory, *inputs, policies=policies, steps=args.steps)
    plot = table.plot(args.plot, title=f"remat profile {args.model} --depth {args.depth}") if args.plot else None

    if args.json:
        print_json({"model": args.model, "depth": args.depth, "plot": plot, **table.to_dict()})
    else:
        print_table(f"remat profile {args.model} --depth {args.depth}: gradient step per policy",
                    table.columns, table.rows())
        if plot:
            print(f"plot written to {plot}")
    return EXIT_OK

"""The ``remat`` command: one module per subcommand, imported lazily so ``--help`` is fast.

Each subcommand module defines ``HELP`` (one line), ``EXAMPLE`` (a command line),
``configure(parser)`` (adds its arguments; imports nothing heavy) and ``run(args) -> int``.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from remat.cli._common import EXIT_USAGE, UsageError

# Subcommand name -> module. Order is the order shown in ``remat --help``.
SUBCOMMANDS = {
    "demo": "remat.cli.demo",
    "crosscheck": "remat.cli.crosscheck",
    "profile": "remat.cli.profile",
    "plan": "remat.cli.plan",
    "explain": "remat.cli.explain",
    "train": "remat.cli.train",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="remat",
        description="Activation checkpointing for JAX and Flax, with PyTorch's call shapes.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(
            name,
            help=module.HELP,
            description=module.HELP,
            epilog=f"example:\n  {module.EXAMPLE}\n",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.configure(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args._run(args) or 0)
    except UsageError as e:
        print(f"remat: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("remat: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""The ``racecpu`` command line.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their subcommand runs, so
``racecpu --version`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS = {
    "demo": ("racecpu.apps.demo", "one forward+backward of a RACE layer at 1M tokens, checked against the exact reference"),
    "bench": ("racecpu.apps.bench", "benchmark suite: kernels vs NumPy/PyTorch statements, roofline, scaling"),
    "validate": ("racecpu.apps.validation", "measure RACE against the angular kernel and Theorem 1"),
    "train": ("racecpu.apps.train", "train small Transformers with RACE or baseline attention in pure NumPy"),
}


def _version():
    from . import __version__
    return __version__


def build_parser(only=None):
    parser = argparse.ArgumentParser(prog="racecpu", description="RACE attention on CPUs.")
    parser.add_argument("--version", action="version", version=f"racecpu {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (modname, helptext) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=helptext, description=helptext)
        if only == name:
            importlib.import_module(modname).add_arguments(p)
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    only = command if command in SUBCOMMANDS else None
    parser = build_parser(only)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

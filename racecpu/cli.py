"""The ``racecpu`` command line.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their subcommand runs, so
``racecpu --version`` and ``--help`` stay instant and never compile a kernel.

Conventions every subcommand follows (README, "Command line"):

* flag names are the API's words (``--tokens``, ``--heads``, ``--head-dim``,
  ``--num-planes``, ``--num-tables``, ``--beta``, ``--causal``, ``--dtype``,
  ``--seed``); numeric flags are checked by argparse (usage error, exit 2);
* ``--json``: exactly one JSON document on stdout, every human line on stderr;
* ``--quiet``: no human text and no progress bars (errors still go to stderr);
* progress bars only when stderr is a terminal;
* files go to ``--out DIR`` (default: a new folder in the current directory), checked
  before any work starts;
* optional dependencies are checked before any work starts.

A subcommand's ``run`` stores its JSON result in ``args.result`` and returns
its exit status; it raises :class:`UsageError` for a bad combination of flags.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import tempfile
import time

# name -> (module, one-line help)
SUBCOMMANDS = {
    "demo": ("racecpu.apps.demo", "forward+backward of a RACE layer, timed and checked against the exact reference"),
    "bench": ("racecpu.apps.bench", "benchmark suite: kernels vs NumPy/PyTorch statements, roofline, scaling"),
    "validate": ("racecpu.apps.validation", "measure RACE against the angular kernel and Theorem 1"),
    "train": ("racecpu.apps.train", "train small Transformers with RACE or baseline attention in pure NumPy"),
    "info": ("racecpu.apps.info", "versions, threads, kernel cache and memory pool (for bug reports)"),
    "warmup": ("racecpu.apps.warmup", "compile every kernel signature into the cache (images, read-only installs)"),
}

from .config import DEFAULT_BETA, MAX_PLANES  # light: compiles nothing


class UsageError(Exception):
    """A bad combination of flags found after parsing: reported like argparse's (exit 2)."""


# -- argparse types ---------------------------------------------------------------
def _int_at_least(text, least, wanted):
    """``text`` as an int >= ``least``, else argparse's type error naming ``wanted``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {wanted}, got {value}")
    return value


def positive_int(text):
    """An int >= 1 (argparse type)."""
    return _int_at_least(text, 1, "a positive integer")


def nonnegative_int(text):
    """An int >= 0 (argparse type)."""
    return _int_at_least(text, 0, "an integer >= 0")


def positive_float(text):
    """A finite float > 0 (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def nonnegative_float(text):
    """A finite float >= 0 (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not (0 <= value < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def num_planes(text):
    """Hyperplanes per table: an int in 1..16 (argparse type)."""
    value = positive_int(text)
    if value > MAX_PLANES:
        raise argparse.ArgumentTypeError(f"expected 1..{MAX_PLANES} hyperplanes per table, got {value}")
    return value


# -- shared flags -----------------------------------------------------------------
def add_alias(parser, old, dest, type=None):
    """A hidden old spelling ``old`` of a flag whose value lands in ``dest``."""
    parser.add_argument(old, dest=dest, type=type, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def add_race_arguments(parser, *, heads=4, head_dim=128, tokens=None, dtype=True, causal=True, seed=True):
    """The RACE layer's flags, named as in the API; returns the argument group."""
    g = parser.add_argument_group("RACE layer")
    if tokens is not None:
        g.add_argument("--tokens", type=positive_int, default=tokens, help=f"sequence length N (default {tokens:,})")
    if heads is not None:
        g.add_argument("--heads", type=positive_int, default=heads, help=f"number of heads H (default {heads})")
    if head_dim is not None:
        g.add_argument("--head-dim", type=positive_int, default=head_dim,
                       help=f"head dimension d = dv (default {head_dim})")
        add_alias(g, "--dim", "head_dim", positive_int)
    g.add_argument("--num-planes", type=num_planes, default=3, help="hyperplanes per table P, 1..16 (default 3)")
    add_alias(g, "--planes", "num_planes", num_planes)
    g.add_argument("--num-tables", type=positive_int, default=3, help="hash tables L (default 3)")
    add_alias(g, "--tables", "num_tables", positive_int)
    g.add_argument("--beta", type=positive_float, default=DEFAULT_BETA,
                   help=f"soft-hash temperature, > 0 (default {DEFAULT_BETA})")
    if causal:
        g.add_argument("--causal", action="store_true", help="causal attention")
    if dtype:
        g.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="default float32")
    if seed:
        g.add_argument("--seed", type=nonnegative_int, default=0, help="random seed (default 0)")
    return g


def add_common_arguments(parser, *, out=False):
    """``--json``, ``--quiet`` and (when the subcommand writes files) ``--out DIR``."""
    g = parser.add_argument_group("output")
    g.add_argument("--json", action="store_true",
                   help="print one JSON document on stdout (human text goes to stderr)")
    g.add_argument("--quiet", "-q", action="store_true", help="no human text and no progress bars")
    if out:
        g.add_argument("--out", metavar="DIR", default=None,
                       help="folder for the files written (default: a new folder racecpu-<command>-<time> "
                            "in the current directory)")
    return g


def output_dir(args, command):
    """The folder ``--out`` names (created), or a new ``racecpu-<command>-<time>`` in the current directory.

    Raises :class:`UsageError` where ``--out`` cannot be made a folder.
    """
    path = getattr(args, "out", None)
    if path is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = os.path.abspath(f"racecpu-{command}-{stamp}")
        n = 1
        while os.path.exists(path):
            n += 1
            path = os.path.abspath(f"racecpu-{command}-{stamp}-{n}")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UsageError(_out_problem(path, exc)) from None
    return str(path)


def _out_problem(path, exc):
    if os.path.exists(path) and not os.path.isdir(path):
        return f"--out {path}: is a file, not a folder"
    return f"--out {path}: cannot make this folder or write in it ({exc.strerror or exc})"


def check_out(path):
    """Raise :class:`UsageError` unless files can be written in folder ``path``, made if missing.

    Checked by doing it: the folders made and the probe file are removed again, so
    a run that stops before writing leaves nothing behind.
    """
    target = os.path.abspath(path)
    missing = []
    probe = target
    while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
        missing.append(probe)
        probe = os.path.dirname(probe)
    try:
        os.makedirs(target, exist_ok=True)
        with tempfile.TemporaryFile(dir=target):
            pass
    except OSError as exc:
        raise UsageError(_out_problem(path, exc)) from None
    finally:
        for folder in missing:  # deepest first
            with contextlib.suppress(OSError):
                os.rmdir(folder)


def show_progress(args):
    """Whether to draw progress bars: stderr is a terminal and not ``--quiet``."""
    if getattr(args, "quiet", False):
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def require(module, why, extra):
    """Import ``module`` or raise :class:`UsageError` naming what to install (before any work starts)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UsageError(f"{why} needs {module.split('.')[0]}, which is not installed: "
                         f"pip install {module.split('.')[0]}  (or the extra: pip install 'racecpu[{extra}]' "
                         f"from racecpu's source folder)") from None


def note(*parts, **kw):
    """A human line on stderr (compilation notes, warnings): shown unless ``--quiet``."""
    if not _QUIET:
        print(*parts, file=sys.stderr, flush=True, **kw)


_QUIET = False


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
    """Entry point of the ``racecpu`` console script and ``python -m racecpu``; returns the exit status."""
    global _QUIET
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    only = command if command in SUBCOMMANDS else None
    parser = build_parser(only)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    as_json = getattr(args, "json", False)
    _QUIET = getattr(args, "quiet", False)
    args.progress = show_progress(args)
    args.result = None
    real_stdout = sys.stdout
    with contextlib.ExitStack() as stack:
        if _QUIET:
            stack.enter_context(contextlib.redirect_stdout(open(os.devnull, "w")))
            # no line on stderr when the kernels compile (racecpu._kernels._jit reads it), this command only
            from unittest import mock
            stack.enter_context(mock.patch.dict(os.environ, RACECPU_QUIET_COMPILE="1"))
        elif as_json:
            stack.enter_context(contextlib.redirect_stdout(sys.stderr))
        try:
            if getattr(args, "out", None) is not None:
                check_out(args.out)  # before any work: train writes only at the end
            rc = int(module.run(args) or 0)
        except UsageError as exc:
            print(f"racecpu {args.command}: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"racecpu {args.command}: interrupted", file=sys.stderr)
            return 130
    if as_json:
        doc = args.result if args.result is not None else {}
        if isinstance(doc, dict):
            doc = {"command": args.command, "exit_status": rc, **doc}
        real_stdout.write(json.dumps(doc, default=_jsonable) + "\n")
        real_stdout.flush()
    return rc


def _jsonable(x):
    import numpy as np
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


if __name__ == "__main__":
    sys.exit(main())

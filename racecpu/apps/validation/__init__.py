"""Validation of RACE attention against the angular kernel and Theorem 1 of the paper.

``racecpu validate [--quick] [--out DIR]`` runs five experiments and writes,
into ``DIR``, one CSV per table, PNG plots and ``REPORT.md`` with a verdict per
claim:

1. :mod:`~racecpu.apps.validation.kernel` -- one table's soft kernel against
   ``(1 - theta/pi)^P``: bias against the paper's bound, bias -> 0 as
   beta -> inf, variance against 1/L;
2. :mod:`~racecpu.apps.validation.theorem` -- RMS error of ``race_attention``
   against ``reference.angular_attention(gamma=P)`` versus L, beta and N,
   non-causal and causal;
3. :mod:`~racecpu.apps.validation.softmax` -- angular against softmax attention as
   gamma grows, and the best-matching gamma per head dim;
4. :mod:`~racecpu.apps.validation.assumptions` -- (A1) ``s_min / N`` and (A2) for
   every data set;
5. :mod:`~racecpu.apps.validation.estimators` -- the paper's ratio against the
   per-bucket mean of the authors' released code, against angular and softmax
   attention, their limits in beta and L, and the ratio's bias at finite L.

Data sets (seeded) are in :mod:`~racecpu.apps.validation.data`; queries and keys
of a trained model enter through ``--qkv FILE.npz`` (arrays ``q``, ``k``,
``v``), see :func:`racecpu.apps.validation.data.npz_dataset`.

Python use::

    from racecpu.apps.validation import run_all
    results = run_all("out", quick=True)      # list of Result, REPORT.md in out/
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from . import assumptions, data, estimators, kernel, softmax, theorem
from .common import Claim, Result, style, write_csv

__all__ = ["run_all", "add_arguments", "run", "main", "EXPERIMENTS", "Claim", "Result"]

#: name -> module with ``run(mode, seed, out_dir, show_progress[, datasets])``
EXPERIMENTS = {"kernel": kernel, "theorem": theorem, "softmax": softmax, "assumptions": assumptions,
               "estimators": estimators}


def run_all(out_dir, *, quick=False, seed=0, only=None, datasets=None, show_progress=False, argv=None):
    """Run the experiments, write CSVs, PNGs and a report into ``out_dir``.

    Parameters
    ----------
    out_dir : str
        Created if missing.
    quick : bool
        Small sizes (well under a minute); otherwise the full sizes (minutes).
    seed : int
        Root seed of every data set and plane draw.
    only : iterable of str, optional
        Subset of :data:`EXPERIMENTS`; the report is then ``REPORT-<names>.md``.
    datasets : iterable of str, optional
        Data set names (keys of ``data.DATASETS``) used by the data-driven
        experiments instead of their defaults; names not in a preset are added.
    show_progress : bool, default False
        Draw tqdm progress bars on stderr.

    Notes
    -----
    Plots are drawn on :class:`matplotlib.figure.Figure` objects with an Agg
    canvas inside :func:`matplotlib.rc_context`: the caller's backend,
    rcParams and pyplot figures are left as they were.

    Returns
    -------
    list of Result
    """
    names = list(EXPERIMENTS) if not only else [n for n in EXPERIMENTS if n in set(only)]
    unknown = set(only or ()) - set(EXPERIMENTS)
    if unknown:
        raise ValueError(f"unknown experiments {sorted(unknown)}; choose from {list(EXPERIMENTS)}")
    for name in datasets or ():
        if name not in data.DATASETS:
            raise ValueError(f"unknown data set {name!r}; known: {sorted(data.DATASETS)}")
    os.makedirs(out_dir, exist_ok=True)
    mode = "quick" if quick else "full"
    results = []
    t_all = time.perf_counter()
    for name in names:
        mod = EXPERIMENTS[name]
        t0 = time.perf_counter()
        kwargs = {} if name == "kernel" else {"datasets": datasets}
        with style():
            res = mod.run(mode, seed=seed, out_dir=out_dir, show_progress=show_progress, **kwargs)
        res.seconds = time.perf_counter() - t0
        for fname, rows in res.tables.items():
            write_csv(os.path.join(out_dir, fname), rows)
        results.append(res)
    seconds = time.perf_counter() - t_all
    from .report import write_report
    report = "REPORT.md" if names == list(EXPERIMENTS) else f"REPORT-{'-'.join(names)}.md"
    write_report(os.path.join(out_dir, report), results, mode=mode, seed=seed,
                 argv=argv or f"run_all(quick={quick}, seed={seed})", seconds=seconds,
                 datasets_note=_datasets_note(datasets))
    return results


def _datasets_note(datasets):
    doc = data.__doc__.split("Built-in data sets\n------------------\n")[1].split("\nHook")[0].strip()
    note = ["All generators: `racecpu.apps.validation.data` (seeded with `numpy.random.default_rng`). Raw queries and "
            "keys have unit-variance coordinates; Theorem 1 experiments normalise them to unit norm.", "",
            "```", doc, "```"]
    extra = [n for n in (datasets or ()) if n not in ("isotropic", "clustered", "near_duplicate")]
    if extra:
        note += ["", "Also: " + ", ".join(f"`{n}`" for n in extra) + " (registered from files or code)."]
    return "\n".join(note)


# ---------------------------------------------------------------------------
# command line: racecpu validate
# ---------------------------------------------------------------------------

def add_arguments(parser):
    """Options of ``racecpu validate``."""
    from ...cli import add_common_arguments, nonnegative_int

    parser.add_argument("--quick", action="store_true", help="small sizes: under a minute (default: full run, minutes)")
    parser.add_argument("--only", nargs="+", choices=list(EXPERIMENTS), metavar="EXP",
                        help=f"run only these experiments ({', '.join(EXPERIMENTS)})")
    parser.add_argument("--datasets", nargs="+", metavar="NAME",
                        help=f"data sets to use (default per experiment; built-in: {', '.join(data.DATASETS)})")
    parser.add_argument("--qkv", action="append", default=[], metavar="FILE.npz",
                        help="add a data set of queries/keys/values (arrays q, k, v of shape (..., N, d)), "
                             "e.g. dumped from a trained model; repeatable")
    parser.add_argument("--seed", type=nonnegative_int, default=0, help="root seed (default 0)")
    parser.add_argument("--strict", action="store_true", help="exit with status 1 if any claim does not hold")
    add_common_arguments(parser, out=True)
    # old flag: progress bars are drawn only on a terminal now, so it changes nothing
    parser.add_argument("--no-progress", action="store_true", dest="_no_progress", help=argparse.SUPPRESS)
    return parser


def run(args):
    """Entry point of ``racecpu validate``; returns the exit status."""
    from ...cli import UsageError, output_dir, require

    require("matplotlib", "racecpu validate (its plots)", "validate")
    datasets = list(args.datasets) if args.datasets else None
    for name in datasets or ():
        if name not in data.DATASETS:
            raise UsageError(f"--datasets: unknown data set {name!r}; known: {', '.join(sorted(data.DATASETS))}")
    for path in args.qkv:
        if not os.path.isfile(path):
            raise UsageError(f"--qkv {path}: no such file")
        name = data.register_dataset(f"npz:{os.path.splitext(os.path.basename(path))[0]}", data.npz_dataset(path))
        if datasets is None:
            datasets = ["isotropic", "clustered", "near_duplicate"]
        datasets.append(name)
    argv = getattr(args, "command_line", None) or "racecpu " + " ".join(sys.argv[1:])
    out = output_dir(args, "validate")
    try:
        results = run_all(out, quick=args.quick, seed=args.seed, only=args.only, datasets=datasets,
                          show_progress=getattr(args, "progress", False), argv=argv)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    failed = 0
    claims = []
    for r in results:
        for c in r.claims:
            print(f"[{c.verdict:>13}] {c.key}: {c.statement} -- {c.measured}")
            failed += c.holds is False
            claims.append(dict(experiment=r.name, key=c.key, verdict=c.verdict,
                               holds=c.holds, statement=c.statement, measured=c.measured))
    print(f"wrote {out} ({failed} claim(s) do not hold)")
    args.result = dict(out=out, claims=claims, failed=failed)
    return 1 if (args.strict and failed) else 0


def main(argv=None, default_out=None):
    """Run as a script: ``python -m racecpu.apps.validation [options]`` (used by the validation/ scripts)."""
    import argparse
    parser = argparse.ArgumentParser(prog="racecpu validate", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    if default_out:
        parser.set_defaults(out=default_out)
    args = parser.parse_args(argv)
    script = os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0] else "racecpu.apps.validation"
    args.command_line = " ".join(["python", script, *sys.argv[1:]])
    args.progress = not args.quiet and sys.stderr.isatty()
    from ...cli import UsageError
    try:
        return run(args)
    except UsageError as exc:
        parser.error(str(exc))

"""Train a list of configurations with ``racecpu train``, a few at a time, and tabulate them.

    python benchmarks/train_sweep.py SWEEP.txt --out DIR [--jobs 2] [--trainer torch] [-- COMMON TRAIN FLAGS]

``SWEEP.txt`` holds one run per line: a name, then that run's ``racecpu train``
flags (``#`` starts a comment).  Each run is one process with one Numba and
one BLAS thread, ``--jobs`` of them at a time (one per core), its JSON kept
as ``DIR/NAME.json``; a run whose JSON is already there is not run again,
so an interrupted sweep resumes.  When all are done, ``DIR/table.md`` and
``DIR/table.csv`` list every run: the task's metric (accuracy or bits per
character), validation loss, median ms per step, training seconds and the
trained betas.  ``--trainer torch`` runs ``benchmarks/torch_train.py`` instead (the
same model and tasks in PyTorch).  ms per step is measured with ``--jobs`` runs
sharing the machine: compare rows of one sweep, not across machines.

Example (issue 43's character LM at 512 tokens)::

    python benchmarks/train_sweep.py benchmarks/sweeps/chars512.txt --out benchmarks/results/train/chars512 \\
        -- --task chars --tokens 512 --steps 1000 --eval-every 100
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def read_sweep(path):
    """``[(name, [flags...]), ...]`` from a sweep file."""
    runs = []
    with open(path) as fh:
        for line in fh:
            line = line.split("#", 1)[0].strip()
            if line:
                name, *flags = shlex.split(line)
                runs.append((name, flags))
    names = [n for n, _ in runs]
    if len(set(names)) != len(names):
        raise SystemExit(f"{path}: run names must be unique")
    return runs


#: The command line of each trainer, before the run's flags: ``racecpu train`` (the NumPy autograd)
#: or its PyTorch twin, ``benchmarks/torch_train.py`` (the same model and tasks, a faster step).
TRAINERS = {"racecpu": [sys.executable, "-m", "racecpu", "train"],
            "torch": [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_train.py"),
                      "--threads", "1"]}


def run_one(name, flags, common, out, trainer="racecpu"):
    """Run one configuration unless its JSON exists; returns (name, seconds or None if skipped)."""
    path = os.path.join(out, f"{name}.json")
    if os.path.exists(path):
        return name, None
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               NUMBA_NUM_THREADS="1", RACECPU_QUIET_COMPILE="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    cmd = [*TRAINERS[trainer], *common, *flags, "--json", "--quiet", "--out", os.path.join(out, "files", name)]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        with open(os.path.join(out, f"{name}.err"), "w") as fh:
            fh.write(" ".join(map(shlex.quote, cmd)) + "\n" + res.stderr)
        print(f"  {name}: failed (rc {res.returncode}), see {name}.err", flush=True)
        return name, time.perf_counter() - t0
    doc = json.loads(res.stdout)
    doc["command"] = ("racecpu train " if trainer == "racecpu" else "python benchmarks/torch_train.py ") + " ".join(
        map(shlex.quote, [*common, *flags]))
    with open(path + ".tmp", "w") as fh:
        json.dump(doc, fh, default=str)
    os.replace(path + ".tmp", path)
    print(f"  {name}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    return name, time.perf_counter() - t0


def table(runs, out):
    """Write ``table.md`` and ``table.csv`` from the runs' JSON files; returns the markdown."""
    rows = []
    for name, _ in runs:
        path = os.path.join(out, f"{name}.json")
        if not os.path.exists(path):
            continue
        with open(path) as fh:
            r = json.load(fh)
        metric = "val_accuracy" if r["task"] == "mqar" else "val_bpc"
        cfg = r["config"]
        hybrid = "".join(f"+softmax@{i}" for i in cfg.get("softmax_layers") or [])
        rows.append(dict(run=name, attention=r["attention"] + hybrid, seed=cfg.get("seed", 0), estimator=cfg.get("estimator", "ratio")
                         if r["attention"] == "race" else "", P=cfg["num_planes"] if r["attention"] in ("race", "angular") else "",
                         L=cfg["num_tables"] if r["attention"] == "race" else "",
                         beta0=cfg["beta"] if r["attention"] == "race" else "",
                         metric=round(r[metric], 4), val_loss=round(r["val_loss"], 4),
                         ms_per_step=round(r["time_per_step_ms"], 1), train_s=round(r["train_seconds"]),
                         beta=" ".join(f"{b:.2f}" for b in r["beta"]) if r.get("beta") else ""))
    if not rows:
        return ""
    label = "accuracy" if metric == "val_accuracy" else "bits/char"
    with open(os.path.join(out, "table.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    head = ["run", "attention", "seed", "estimator", "P", "L", "beta0", label, "val loss", "ms/step", "train s", "trained beta"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(str(x) for x in r.values()) + " |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(out, "table.md"), "w") as fh:
        fh.write(md)
    return md


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    common = []
    if "--" in argv:
        i = argv.index("--")
        argv, common = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("sweep", help="one run per line: NAME then its racecpu train flags")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (default 2: one per core here)")
    p.add_argument("--only", metavar="REGEX", default=None,
                   help="run only the runs whose name matches (re.search); the table lists every run done")
    p.add_argument("--trainer", choices=sorted(TRAINERS), default="racecpu",
                   help="racecpu: racecpu train (NumPy autograd); torch: benchmarks/torch_train.py")
    a = p.parse_args(argv)
    runs = read_sweep(a.sweep)
    os.makedirs(a.out, exist_ok=True)
    todo = [(n, f) for n, f in runs if not os.path.exists(os.path.join(a.out, f"{n}.json"))
            and (a.only is None or re.search(a.only, n))]
    done = sum(os.path.exists(os.path.join(a.out, f"{n}.json")) for n, _ in runs)
    print(f"{len(runs)} runs, {done} already done, {len(runs) - done - len(todo)} left out by --only; "
          f"{len(todo)} to run, {a.jobs} at a time", flush=True)
    with ThreadPoolExecutor(max(1, a.jobs)) as pool:
        list(pool.map(lambda nf: run_one(nf[0], nf[1], common, a.out, a.trainer), todo))
    print(table(runs, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

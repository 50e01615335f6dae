"""The (P, L, beta) map of issue 59: training runs grouped into cells over their seeds, and the frontier.

    python benchmarks/defaults_map.py DIR [DIR ...] --out PREFIX [--reference "race P3 L3 b8"]

Reads every run's JSON that ``benchmarks/train_sweep.py`` wrote in the ``DIR``s (one file
per run, ``racecpu train --json``'s or ``benchmarks/torch_train.py``'s fields), groups the
runs into *cells* (attention, estimator, P, L, beta0, trained or fixed beta, one beta per
layer or per head, softmax layers of a hybrid) and, for each cell, the seeds it has, the
median metric (MQAR accuracy or bits per character) with the lowest and highest seed,
the median ms per training step, that cost as a multiple of the ``--reference`` cell's
(the library's defaults before issue 59) and the median peak resident memory of the
runs' processes.  Writes ``PREFIX.md`` (the table, best first, and the frontier: the
RACE cells no other RACE cell beats at a lower or equal cost), ``PREFIX.csv`` and
``PREFIX.png`` (metric against cost, one point per cell with its seeds' range, softmax
and linear attention as lines).  Step times come from runs that shared the machine two
at a time: compare cells of one sweep.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import statistics
import sys


def cell_of(doc):
    """``(label, fields)`` of a run: what its cell is (everything but the seed)."""
    cfg, att = doc["config"], doc["attention"]
    hybrid = "".join(f"+softmax@{i}" for i in cfg.get("softmax_layers") or [])
    if att != "race":
        return att + hybrid, dict(attention=att + hybrid, estimator="", P="", L="", beta0="", beta="")
    beta = ("fixed" if not cfg.get("train_beta", True) else "per head" if cfg.get("beta_per_head") else "trained")
    est = cfg.get("estimator", "ratio")
    fields = dict(attention="race" + hybrid, estimator=est, P=cfg["num_planes"], L=cfg["num_tables"],
                  beta0=cfg["beta"], beta=beta)
    label = (f"race{hybrid}{'' if est == 'ratio' else ' ' + est} P{cfg['num_planes']} L{cfg['num_tables']} "
             f"b{cfg['beta']:g}{'' if beta == 'trained' else ' ' + beta}")
    return label, fields


def load(dirs):
    """Every run's JSON in ``dirs``, as a list of dicts (the run's name added)."""
    runs = []
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "*.json"))):
            with open(path) as fh:
                doc = json.load(fh)
            if "config" in doc:
                doc["run"] = os.path.splitext(os.path.basename(path))[0]
                runs.append(doc)
    return runs


def cells(runs, cost_seed=None):
    """The runs grouped by cell: a list of row dicts, one per cell.  The step time is the median over
    the cell's runs, or its seed-``cost_seed`` run's where it has one (runs of one seed shared the
    machine alike, when a sweep's later seeds ran beside other work)."""
    groups = {}
    for r in runs:
        label, fields = cell_of(r)
        groups.setdefault(label, (fields, []))[1].append(r)
    rows = []
    for label, (fields, rs) in groups.items():
        metric = "val_accuracy" if rs[0]["task"] == "mqar" else "val_bpc"
        vals = [r[metric] for r in rs]
        peaks = [r["peak_rss_mib"] for r in rs if r.get("peak_rss_mib")]
        timed = [r for r in rs if r["config"].get("seed", 0) == cost_seed] or rs
        rows.append(dict(cell=label, **fields, seeds=len(rs), metric=statistics.median(vals), low=min(vals),
                         high=max(vals), ms_per_step=round(statistics.median(r["time_per_step_ms"] for r in timed), 1),
                         peak_mib=round(statistics.median(peaks)) if peaks else "",
                         trained_beta=" ".join(f"{statistics.median(b):.2f}" for b in
                                               zip(*[r["beta"] for r in rs if r.get("beta")])) or "",
                         per_seed=" ".join(f"{v:.3f}" for v in vals), metric_name=metric))
    return rows


def frontier(rows, higher_is_better):
    """The RACE cells (hybrids too) no other RACE cell beats at a lower or equal cost: the settings
    worth choosing.  Softmax and linear attention are the references, not on it."""
    best, out = None, []
    rows = [r for r in rows if r["attention"].startswith("race")]
    for r in sorted(rows, key=lambda r: (r["ms_per_step"], -r["metric"] if higher_is_better else r["metric"])):
        if best is None or (r["metric"] > best if higher_is_better else r["metric"] < best):
            out.append(r)
            best = r["metric"]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+")
    p.add_argument("--out", required=True, metavar="PREFIX")
    p.add_argument("--reference", default="race P3 L3 b8", help="the cell costs are relative to (its label)")
    p.add_argument("--title", default=None)
    p.add_argument("--cost-seed", type=int, default=None,
                   help="take each cell's step time from its run of this seed where it has one (default: the "
                        "median over its seeds)")
    a = p.parse_args(argv)
    rows = cells(load(a.dirs), a.cost_seed)
    if not rows:
        raise SystemExit(f"no runs in {a.dirs}")
    hib = rows[0]["metric_name"] == "val_accuracy"
    name = "accuracy" if hib else "bits/char"
    ref = next((r for r in rows if r["cell"] == a.reference), None)
    for r in rows:
        r["cost"] = round(r["ms_per_step"] / ref["ms_per_step"], 2) if ref else ""
    rows.sort(key=lambda r: -r["metric"] if hib else r["metric"])
    cols = ["cell", "seeds", "metric", "low", "high", "ms_per_step", "cost", "peak_mib", "trained_beta", "per_seed"]
    with open(a.out + ".csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["cell", "attention", "estimator", "P", "L", "beta0", "beta", *cols[1:]])
        w.writeheader()
        w.writerows({k: r[k] for k in w.fieldnames} for r in rows)
    places = dict(ms_per_step=1, cost=2)  # the rest: 3 decimals

    def fmt(col, v):
        return f"{v:.{places.get(col, 3)}f}" if isinstance(v, float) else str(v)
    head = ["cell", "seeds", f"{name} (median)", "lowest", "highest", "ms/step", f"cost × {a.reference}",
            "peak RSS MiB", "trained beta (median)", "per seed"]
    timing = (f"step time of each cell's seed-{a.cost_seed} run (the median over its seeds where it has none)"
              if a.cost_seed is not None else "step time: the median over each cell's seeds")
    md = [f"# {a.title or name + ' by cell'}", "", f"Metric: the median over seeds, with the lowest and highest; "
          f"{timing}; cost: that time over {a.reference}'s.", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    md += ["| " + " | ".join(fmt(c, r[c]) for c in cols) + " |" for r in rows]
    front = frontier(rows, hib)
    md += ["", "Frontier (no RACE cell is better at a lower or equal step time): "
           + "; ".join(f"{r['cell']} {r['metric']:.3f} at {r['ms_per_step']:.0f} ms" for r in front), ""]
    with open(a.out + ".md", "w") as fh:
        fh.write("\n".join(md))
    print("\n".join(md))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return 0
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        if r["attention"] in ("softmax", "linear"):
            ax.axhline(r["metric"], ls="--", color="k" if r["attention"] == "softmax" else "gray", lw=1)
            ax.annotate(f"{r['attention']} ({r['ms_per_step']:.0f} ms)", (0.01, r["metric"]),
                        xycoords=("axes fraction", "data"), va="bottom", fontsize=8)
            continue
        color = "C1" if r["estimator"] == "bucket_mean" else "C2" if "softmax@" in r["attention"] else "C0"
        ax.errorbar(r["ms_per_step"], r["metric"], yerr=[[r["metric"] - r["low"]], [r["high"] - r["metric"]]],
                    fmt="o", color=color, ms=4, capsize=2)
        ax.annotate(r["cell"].replace("race", "").strip(), (r["ms_per_step"], r["metric"]), fontsize=6,
                    xytext=(3, 2), textcoords="offset points")
    ax.plot([r["ms_per_step"] for r in front], [r["metric"] for r in front], "-", color="C3", lw=1, label="frontier")
    ax.set_xlabel("ms per training step (median over seeds; two runs sharing 2 cores)")
    ax.set_ylabel(f"{name} (median over seeds; bars: lowest to highest)")
    ax.set_title(a.title or f"RACE settings: {name} against cost", fontsize=10)
    from matplotlib.lines import Line2D
    kinds = [Line2D([], [], marker="o", ls="", color=c, label=t) for c, t in
             (("C0", "RACE (ratio)"), ("C1", "RACE (bucket mean)"), ("C2", "softmax layer + RACE"))]
    ax.legend(handles=kinds + ax.get_legend_handles_labels()[0], loc="lower right", fontsize=8)
    ax.margins(x=0.12)
    fig.tight_layout()
    fig.savefig(a.out + ".png", dpi=130)
    return 0


if __name__ == "__main__":
    sys.exit(main())

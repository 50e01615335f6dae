"""The model of docs/distributed.md ("A model for 10^8-10^9 tokens on k machines") from a
``benchmarks/dask_scaling.py`` result: compute, scans (tree and chain), scheduling and network
of a causal forward+backward on k machines of w single-threaded Dask workers.

Usage::

    python benchmarks/dask_model.py [benchmarks/results/dask-scaling-one-pass.json] [--heads 4]
                                    [--workers 32] [--task-ms 1.0] [--tasks-per-block 21.7]

``t`` (per token-head on one worker) is twice the 2-worker wall time per token-head of the
causal forward+backward, ``ell`` the measured latency of one scan link; ``--task-ms`` is the
scheduler's time per task and ``--tasks-per-block`` the tasks of one block and head (1,387 for
64 blocks of a causal forward+backward with the tree scan, inputs included, counted from the
graph on 2026-11-30).  A results file of several runs (``{"runs": [...]}``) gives a table per run.
"""

from __future__ import annotations

import argparse
import json
import math
import os

ROWS = ((1e8, 1, 18), (1e8, 8, 18), (1e9, 1, 18), (1e9, 8, 20), (1e9, 64, 20), (1e9, 64, 22))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", nargs="?",
                    default=os.path.join(os.path.dirname(__file__), "results", "dask-scaling-one-pass.json"))
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--workers", type=int, default=32, help="single-threaded workers per machine")
    ap.add_argument("--task-ms", type=float, default=1.0)
    ap.add_argument("--tasks-per-block", type=float, default=21.7)
    a = ap.parse_args(argv)
    with open(a.result) as f:
        r = json.load(f)
    for i, run in enumerate(r.get("runs", [r])):
        if "runs" in r:
            print(f"run {i + 1} of {len(r['runs'])} ({run.get('date', '')}):")
        table(run, a)


def table(r, a):
    """The model's table (markdown) for one dask_scaling result ``r``."""
    t = 2 * r["dask_ns"]["2:causal fwd+bwd"] * 1e-9
    ell = r["chain_link_s"]
    dv = r["dim"]
    sketch = 24 * (dv + 1) * 8 + 300  # A and B float64 at P = L = 3, and the wire sketch's other fields
    H, w, tau = a.heads, a.workers, a.task_ms * 1e-3
    print(f"t = {t * 1e9:.0f} ns per token-head on one worker, one scan link {ell * 1e3:.2f} ms, "
          f"{a.tasks_per_block:g} tasks per block and head at {a.task_ms:g} ms each")
    print("| N | k | b | compute | tree scans (bound) | chain scans (bound) | scheduling | network |")
    print("|---|---|---|---|---|---|---|---|")
    for N, k, lb in ROWS:
        blocks = math.ceil(N / 2 ** lb)
        compute = N * H * t / (k * w)
        tree = 2 * 2 * math.ceil(math.log2(blocks)) * ell
        chain = 2 * blocks * ell
        sched = H * blocks * a.tasks_per_block * tau
        net = 4 * sketch * H * N / 2 ** lb
        print(f"| 10^{round(math.log10(N))} | {k} | 2^{lb} | {compute:.1f} s | {tree:.2f} s | {chain:.1f} s | "
              f"{sched:.0f} s | {net / 1e9:.2f} GB |")


if __name__ == "__main__":
    main()

"""Cold compile time of two racecpu checkouts, measured alternately.

Each run is a fresh process with an empty ``NUMBA_CACHE_DIR`` that imports
one checkout's racecpu (``PYTHONPATH``) and computes, in float32, one
non-causal and one causal forward+backward at ``(heads, tokens, d)``: every
kernel those calls use compiles.  The runs alternate between the checkouts
(A first in even rounds, B first in odd ones), so a machine that slows down
over the minutes slows both; the medians and the median of the per-round
ratios B/A are printed.

    python benchmarks/compile_time.py OTHER_CHECKOUT [--rounds 3] [--heads 4] [--tokens 4096] [--dim 64]
                                      [--paths both|noncausal|causal]

``--paths noncausal`` times the demo's own path alone (``racecpu demo`` is non-causal by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import time, json
t0 = time.perf_counter()
import numpy as np, racecpu
rng = np.random.default_rng(0)
q, k, v, g = (rng.standard_normal((1, {heads}, {tokens}, {dim})).astype(np.float32) for _ in range(4))
W = racecpu.hyperplanes({dim})
for causal in {causal}:
    out, res = racecpu.race_attention_fwd(q, k, v, W, causal=causal)
    racecpu.race_attention_bwd(res, g)
print("RESULT" + json.dumps(dict(seconds=time.perf_counter() - t0, where=racecpu.__file__)))
"""


PATHS = {"both": (False, True), "noncausal": (False,), "causal": (True,)}


def cold_run(tree, heads, tokens, dim, causal=(False, True)):
    """Seconds from before ``import racecpu`` to the end of the calls (``causal``: the flags of
    the forward+backward calls made, in order), with an empty kernel cache."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()), NUMBA_CACHE_DIR=cache)
        child = CHILD.format(heads=heads, tokens=tokens, dim=dim, causal=tuple(causal))
        p = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, cwd=cache)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT"):
            res = json.loads(line[len("RESULT"):])
            if not res["where"].startswith(str(Path(tree).resolve())):
                raise SystemExit(f"imported {res['where']}, not the checkout {tree}")
            return res["seconds"]
    raise SystemExit(f"the run in {tree} failed:\n{p.stderr[-2000:]}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("other", help="the other checkout (B)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--paths", choices=tuple(PATHS), default="both", help="which calls compile (default both)")
    args = ap.parse_args(argv)
    trees = {"A": ROOT, "B": Path(args.other)}
    times = {"A": [], "B": []}
    for r in range(args.rounds):
        for side in ("AB" if r % 2 == 0 else "BA"):
            times[side].append(cold_run(trees[side], args.heads, args.tokens, args.dim, PATHS[args.paths]))
            print(f"round {r} {side}: {times[side][-1]:.1f} s", flush=True)
    ratios = [b / a for a, b in zip(times["A"], times["B"])]
    print(f"A {trees['A']}: median {statistics.median(times['A']):.1f} s  {[round(t, 1) for t in times['A']]}")
    print(f"B {trees['B']}: median {statistics.median(times['B']):.1f} s  {[round(t, 1) for t in times['B']]}")
    print(f"B/A per round: median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()

"""What a (P, L) setting costs the attention itself: causal forward+backward time and memory per setting.

    PYTHONPATH=. python benchmarks/defaults_cost.py [--settings 3x3,4x4,5x4,4x8,5x8] [--tokens 16384]
        [--heads 2] [--dims 32,64,128] [--rounds 5] [--threads 1] [--out FILE.md]

A training step of issue 59's small models is mostly their dense layers, so its time says
little about what P and L cost at long contexts.  This times ``race_attention_fwd`` +
``race_attention_bwd`` (causal, float32, beta 4) at each setting and head dimension, the
settings alternated round by round (median of ``--rounds``, so that load on a shared
machine hits all alike), and reports ns per token-head, the multiple of the first
setting's time, the bytes per token-head the forward keeps for the backward, and the
sketch (the causal state) per head: ``L * 2^P * (dv + 1)`` float64 numbers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def _settings(text):
    out = []
    for item in text.split(","):
        p, l_ = item.lower().split("x")
        out.append((int(p), int(l_)))
    return out


def residual_bytes(res):
    """Bytes of every distinct NumPy array reachable from the residuals' attributes (tuples, lists too):
    the rows the forward made and the caller's q and v it holds on to for the backward."""
    seen, total, stack = set(), 0, [res]
    while stack:
        x = stack.pop()
        if isinstance(x, np.ndarray):
            base = x if x.base is None else x.base
            if id(base) not in seen and isinstance(base, np.ndarray):
                seen.add(id(base))
                total += base.nbytes
        elif isinstance(x, (tuple, list)):
            stack.extend(x)
        elif hasattr(x, "__dict__") or hasattr(x, "__slots__"):
            names = list(getattr(x, "__dict__", {})) + list(getattr(x, "__slots__", ()))
            stack.extend(getattr(x, n) for n in names if hasattr(x, n))
    return total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", type=_settings, default=_settings("3x3,4x4,5x4,4x8,5x8"),
                   help="PxL, comma-separated; the first is the reference")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dims", default="32,64,128")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import racecpu

    racecpu.set_threads(a.threads)
    dims = [int(d) for d in a.dims.split(",")]
    rng = np.random.default_rng(0)
    cases = {}
    for d in dims:
        q, k, v, g = (rng.standard_normal((a.heads, a.tokens, d), dtype=np.float32) for _ in range(4))
        q, k = q * d ** -0.5, k * d ** -0.5  # unit scale, as the layers hash them
        for P, L in a.settings:
            cases[d, P, L] = (q, k, v, g, racecpu.hyperplanes(d, P, L, seed=0))
    times = {key: [] for key in cases}
    kept = {}
    for r in range(a.rounds + 1):  # round 0 compiles and warms up, untimed
        for key, (q, k, v, g, W) in cases.items():
            t0 = time.perf_counter()
            out, res = racecpu.race_attention_fwd(q, k, v, W, 4.0, causal=True)
            racecpu.race_attention_bwd(res, g)
            if r:
                times[key].append(time.perf_counter() - t0)
            else:
                kept[key] = residual_bytes(res)
            del out, res
    head = ["d", "P", "L", "buckets L·2^P", "ns per token-head", "× first", "kept bytes per token-head",
            "state KiB per head"]
    lines = [f"causal forward+backward, float32, {a.heads} heads × {a.tokens} tokens, {a.threads} thread(s), "
             f"median of {a.rounds} rounds (settings alternated)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in dims:
        ref = None
        for P, L in a.settings:
            ns = statistics.median(times[d, P, L]) / (a.heads * a.tokens) * 1e9
            ref = ref or ns
            state = L * 2 ** P * (d + 1) * 8 / 1024
            lines.append(f"| {d} | {P} | {L} | {L * 2 ** P} | {ns:.0f} | {ns / ref:.2f} | "
                         f"{kept[d, P, L] / (a.heads * a.tokens):.0f} | {state:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write("    PYTHONPATH=. python benchmarks/defaults_cost.py " + " ".join(argv or sys.argv[1:]) + "\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

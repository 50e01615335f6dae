"""Float32 drift of causal RACE attention over a long sequence (issue: accuracy at 2^20 tokens).

Runs one causal race_attention in float32 and the same inputs in float64, and
reports the relative error of the float32 outputs at the end of the sequence
(the last 4096 tokens, where a drifting float32 prefix sum would show).

    python benchmarks/causal_drift.py [--log2n 20] [--dim 128]
"""

import argparse

import numpy as np

import racecpu


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log2n", type=int, default=20)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--tail", type=int, default=4096)
    a = p.parse_args(argv)
    n, d = 2 ** a.log2n, a.dim
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((n, d), dtype=np.float32) for _ in range(3))
    W = racecpu.hyperplanes(d, dtype=np.float64)
    o32 = racecpu.race_attention(q, k, v, W, causal=True)[-a.tail:].astype(np.float64)
    o64 = racecpu.race_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), W,
                                 causal=True)[-a.tail:]
    rel = np.abs(o32 - o64).max() / np.abs(o64).max()
    rows = np.abs(o32 - o64).max(1) / np.abs(o64).max(1)
    print(f"N = 2^{a.log2n}, d = {d}, causal, last {a.tail} tokens: max |o32 - o64| / max |o64| = {rel:.2e}; "
          f"worst row relative {rows.max():.2e}")
    return 0 if rel < 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""What the planes' gradient adds to the backward: ``race_attention_bwd`` with and without ``dplanes``.

    python benchmarks/dplanes.py [--tokens 65536] [--heads 4] [--dim 128] [--planes 3] [--tables 3] [--reps 5]

One process, one forward per mode (causal and not), then ``reps`` rounds that
each call the backward without and with ``dplanes=True`` (alternating, so
that drift in the machine's load hits both alike).  Prints the median seconds
of each and their ratio; float32 throughout.
"""

import argparse
import time

import numpy as np

import racecpu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--planes", type=int, default=3)
    ap.add_argument("--tables", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    shape = (1, a.heads, a.tokens, a.dim)
    q, k, v, g = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
    W = racecpu.hyperplanes(a.dim, a.planes, a.tables, seed=0, dtype=np.float32)
    print(f"backward at {a.tokens} tokens x {a.heads} heads, d = {a.dim}, P = {a.planes}, L = {a.tables}, "
          f"float32; median of {a.reps} alternating calls")
    for causal in (False, True):
        _, res = racecpu.race_attention_fwd(q, k, v, W, causal=causal)
        for dp in (False, True):  # compile and warm the pool
            racecpu.race_attention_bwd(res, g, dplanes=dp)
        times = {False: [], True: []}
        for _ in range(a.reps):
            for dp in (False, True):
                t0 = time.perf_counter()
                racecpu.race_attention_bwd(res, g, dplanes=dp)
                times[dp].append(time.perf_counter() - t0)
        base, with_dw = np.median(times[False]), np.median(times[True])
        print(f"{'causal' if causal else 'non-causal':>10}: without {base:.3f} s, with dplanes {with_dw:.3f} s, "
              f"ratio {with_dw / base:.3f}  (without: {' '.join(f'{t:.3f}' for t in times[False])}; "
              f"with: {' '.join(f'{t:.3f}' for t in times[True])})")
        del res


if __name__ == "__main__":
    main()

"""Where a racecpu.dask call's time goes inside each worker process: CPU time in user and kernel
mode, page faults, and racecpu's result pool.

    python benchmarks/dask_workers.py [--log2n 22] [--heads 4] [--dim 128] [--log2-block 18]
                                      [--rounds 2] [--scan auto] [--not-causal] [--forward-only]

The inputs and cluster are those of ``benchmarks/dask_scaling.py`` (2 single-threaded worker
processes, one cached random block per worker, results stored into a target that keeps nothing).
For each round it prints the wall time, and per worker: the seconds its process spent in user and
kernel (system) mode, its minor page faults, and racecpu's pool (hits, misses, and the GiB it
held at the end of the round, all idle then).  On a VM where a fresh page costs the host a
fault, a worker whose pool misses pays for it in kernel time (docs/distributed.md, "where a
worker's time goes").  The first round, which faults the pools in, is printed but is not a
steady state.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))


def _usage():
    import resource
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def _pool():
    from racecpu._memory import POOL
    s = POOL.stats()
    return s["hits"], s["misses"], (s["live_bytes"] + s["idle_bytes"]) / 2 ** 30


def main(argv=None):
    import dask_scaling as ds
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ds.add_shape_arguments(ap)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--scan", default="auto")
    ap.add_argument("--not-causal", action="store_true")
    ap.add_argument("--forward-only", action="store_true")
    a = ap.parse_args(argv)

    import dask.array as da

    import racecpu
    import racecpu.dask as rd
    W = racecpu.hyperplanes(a.dim, 3, 3, seed=0, dtype=np.float32)
    n, H, blk = 2 ** a.log2n, a.heads, 2 ** a.log2_block
    causal, backward = not a.not_causal, not a.forward_only
    c, client = ds.cluster(2)
    try:
        ds.dask_run(client, 8 * 4096, 4, a.dim, 4096, causal, backward, W)  # every worker loads the kernels
        client.run(ds._prime, (4, 1, blk, a.dim))
        print(f"{'causal' if causal else 'non-causal'} {'fwd+bwd' if backward else 'fwd'}, 2^{a.log2n} x {H} heads, "
              f"d={a.dim}, blocks of 2^{a.log2_block}, scan={a.scan}, 2 workers x 1 thread")
        for rnd in range(a.rounds + 1):
            q, k, v, g = ds.inputs(n, H, a.dim, blk)
            out, res = rd.race_attention_fwd(q, k, v, W, causal=causal, scan=a.scan)
            if backward:
                dq, dk, dv, dbeta = rd.race_attention_bwd(res, g)
                work = [da.store([dq, dk, dv], [ds._Discard()] * 3, lock=False, compute=False), dbeta]
            else:
                work = [da.store(out, ds._Discard(), lock=False, compute=False)]
            if rnd == 0 and causal:
                print(f"scan: {res.scan}")
            u0, p0 = client.run(_usage), client.run(_pool)
            t0 = time.perf_counter()
            client.compute(work, sync=True)
            wall = time.perf_counter() - t0
            u1, p1 = client.run(_usage), client.run(_pool)
            print(f"round {rnd}{' (first)' if rnd == 0 else ''}: wall {wall:.1f} s, {wall / (n * H) * 1e9:.0f} ns per "
                  f"token-head")
            for i, w in enumerate(sorted(u0)):
                (ut, st, fl), (hi, mi) = (b - a for a, b in zip(u0[w], u1[w])), \
                    (b - a for a, b in zip(p0[w][:2], p1[w][:2]))
                print(f"  worker {i}: user {ut:6.1f} s  system {st:6.1f} s  faults {fl:9,d}   pool: hits {hi:4d} "
                      f"misses {mi:4d}, {p1[w][2]:.2f} GiB held")
    finally:
        client.close()
        c.close()


if __name__ == "__main__":
    main()

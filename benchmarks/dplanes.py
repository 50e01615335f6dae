"""What the planes' gradient adds to the backward: ``race_attention_bwd`` with and without ``dplanes``.

    python benchmarks/dplanes.py [--tokens 65536] [--heads 4] [--dim 128] [--planes 3] [--tables 3] [--reps 5]
    python benchmarks/dplanes.py --product [--tokens 65536] [--heads 4] [--reps 11]

One process, one forward per mode (causal and not), then ``reps`` rounds that
each call the backward without and with ``dplanes=True`` (alternating, so
that drift in the machine's load hits both alike).  Prints the median seconds
of each and their ratio; float32 throughout.

``--product``: the chunk product ``du^T x`` alone, as the backward forms it
(chunks of 1024 rows, one thread per half of the chunks), over the rows of
one of q or k (tokens x heads rows of d), read from memory (every chunk
once) and in cache (the first chunk again and again): ``tn_product`` against
the earlier route (``combine_rows`` on ``du^T`` copied to rows) and against
only reading x.  ns per row, medians of alternating calls.
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
    ap.add_argument("--product", action="store_true", help="time the chunk product du^T x alone")
    a = ap.parse_args()
    if a.product:
        return product(a)
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


def product(a):
    """``--product``: time the chunk product routes (module docstring) and print ns per row."""
    import numba
    from numba import prange

    from racecpu._kernels._jit import OPTIONS
    from racecpu._kernels.products import combine_rows, tn_product

    chunk = 1024

    def route(kind):
        @numba.njit(parallel=True, **OPTIONS)
        def run(du, x, out, same):
            nch = x.shape[0] // chunk
            for w in prange(2):
                tmp = np.empty((du.shape[1], x.shape[1]), np.float64)
                tmp32 = np.empty((du.shape[1], x.shape[1]), x.dtype)
                for c in range(w, nch, 2):
                    lo = 0 if same else c * chunk
                    if kind == 0:
                        tn_product(du[lo:lo + chunk], x[lo:lo + chunk], tmp)
                    elif kind == 1:
                        combine_rows(np.ascontiguousarray(du[lo:lo + chunk].T), x[lo:lo + chunk], tmp32, False)
                        tmp[:] = tmp32
                    else:
                        acc = tmp32[0]
                        acc[:] = 0.0
                        for r in range(lo, lo + chunk):
                            for j in range(x.shape[1]):
                                acc[j] += x[r, j]
                        tmp[0] = acc
                    out[w] += tmp
        return run

    n = a.tokens * a.heads // chunk * chunk
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, a.dim), dtype=np.float32)
    du = rng.standard_normal((n, a.planes * a.tables), dtype=np.float32)
    routes = {"tn_product": route(0), "combine_rows(du^T)": route(1), "read x only": route(2)}
    out = np.zeros((2, du.shape[1], a.dim))
    for f in routes.values():
        f(du, x, out, False)
    print(f"du^T x over {n} rows of d = {a.dim} (L*P = {du.shape[1]}), float32, chunks of {chunk}, "
          f"{numba.get_num_threads()} threads; ns per row, median of {a.reps} alternating calls")
    for same in (False, True):
        times = {k: [] for k in routes}
        for _ in range(a.reps):
            for k, f in routes.items():
                t0 = time.perf_counter()
                f(du, x, out, same)
                times[k].append(time.perf_counter() - t0)
        print(("  in cache:   " if same else "  from memory:") + "  ".join(
            f"{k} {np.median(v) / n * 1e9:.1f}" for k, v in times.items()))


if __name__ == "__main__":
    main()

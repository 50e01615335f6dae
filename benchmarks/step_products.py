"""ns per call of the causal scan steps' small products, each in a jitted loop.

A scan step (``racecpu._kernels.causal``) runs a handful of products on 8
rows (SCAN_BLOCK): the state readouts and updates (F x dv), the in-step
scores (8 x 8) and their products with rows of phi (8 x F) and of v or the
cotangent (8 x dv).  Timed one by one, 200,000 calls in a jitted loop,
best of 5, with the flop rate beside each, so a product that runs far below
its neighbours' rate stands out (docs/performance.md, "combine tiles").

    python benchmarks/step_products.py [--planes 3] [--tables 3] [--dv 64] [--dtype float32] [--calls 200000]
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from racecpu._kernels.products import add_product, combine_rows, dot_rows, step_scores


@numba.njit
def _combine(X, S, out, calls):
    for _ in range(calls):
        combine_rows(X, S, out)


@numba.njit
def _dot(S, X, Y, calls):
    for _ in range(calls):
        dot_rows(S, X, Y)


@numba.njit
def _add(w, x, S, tmp, calls):
    for _ in range(calls):
        add_product(w, x, S, tmp, tmp, False)


@numba.njit
def _scores(X, Y, out, calls):
    for _ in range(calls):
        step_scores(X, Y, out, False)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--planes", type=int, default=3)
    ap.add_argument("--tables", type=int, default=3)
    ap.add_argument("--dv", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--calls", type=int, default=200_000)
    a = ap.parse_args(argv)
    F, dv, m, dt = a.tables * 2 ** a.planes, a.dv, 8, np.dtype(a.dtype)
    rng = np.random.default_rng(0)

    def rows(*shape):
        return rng.standard_normal(shape).astype(dt)

    M, Pk, wb, S, V, G = rows(m, m), rows(m, F), rows(m, F), rows(F, dv), rows(m, dv), rows(m, dv)
    cases = [
        (f"combine_rows M ({m}x{m}) . Pk ({m}x{F})", _combine, (M, Pk, np.empty((m, F), dt)), 2 * m * m * F),
        (f"combine_rows Pk ({m}x{F}) . S ({F}x{dv})", _combine, (Pk, S, np.empty((m, dv), dt)), 2 * m * F * dv),
        (f"combine_rows M ({m}x{m}) . G ({m}x{dv})", _combine, (M, G, np.empty((m, dv), dt)), 2 * m * m * dv),
        (f"dot_rows S ({F}x{dv}), G ({m}x{dv})", _dot, (S, G, np.empty((m, F), dt)), 2 * m * F * dv),
        (f"dot_rows V ({m}x{dv}), G ({m}x{dv})", _dot, (V, G, np.empty((m, m), dt)), 2 * m * m * dv),
        (f"add_product S += Pk^T V ({F}x{dv})", _add, (Pk, V, np.zeros((F, dv), dt), np.empty((F, dv), dt)),
         2 * m * F * dv + F * dv),
        (f"step_scores Pk . Wq^T ({m}x{m}, upper)", _scores, (Pk, wb, np.empty((m, m), dt)), m * (m + 1) * F),
    ]
    print(f"F = {F} (P = {a.planes}, L = {a.tables}), dv = {dv}, {m}-row steps, {dt}; {a.calls:,} calls, best of 5")
    for name, fn, args, flops in cases:
        fn(*args, 10)  # compile
        best = min(_timed(fn, args, a.calls) for _ in range(5))
        ns = best / a.calls * 1e9
        print(f"{name:44s}{ns:9.1f} ns/call {flops / ns:7.1f} flop/ns")


def _timed(fn, args, calls):
    t0 = time.perf_counter()
    fn(*args, calls)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()

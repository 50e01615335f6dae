"""ns per call of the causal scan steps' small products, each in a jitted loop.

A scan step (``racecpu._kernels.causal``) runs a handful of products on 8
rows (SCAN_BLOCK): the state readouts and updates (F x dv), the in-step
scores (8 x 8) and their products with rows of phi (8 x F) and of v or the
cotangent (8 x dv).  Timed one by one, 200,000 calls in a jitted loop,
best of 5, with the flop rate beside each, so a product that runs far below
its neighbours' rate stands out (docs/performance.md, "combine tiles").

``--against OTHER_CHECKOUT``: an A/B of the products instead, in one process
as ``ab.py`` does for whole calls (A = this checkout, B = the other, imported
side by side), each product's two loops alternating round by round
(``--rounds`` of ``--calls`` calls, A first in even rounds): medians per side,
the median of the per-round ratios B/A with its quartiles, and whether B's
results have A's bits.  Two processes minutes apart differ here by up to 1.5x
on this machine; rounds alternated in one process tell a 5 % change apart.

    python benchmarks/step_products.py [--planes 3] [--tables 3] [--dv 64] [--dtype float32] [--calls 200000]
    python benchmarks/step_products.py --against /tmp/b [--rounds 60] [--calls 3000] [...]
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

import racecpu._kernels.products as this_products


def loops(products):
    """Jitted loops ``(args..., calls)`` over the products of module ``products`` (a checkout's
    ``racecpu._kernels.products``): ``combine``, ``dot``, ``add`` (S += w^T x) and ``scores``."""
    combine_rows, dot_rows = products.combine_rows, products.dot_rows
    add_product, step_scores = products.add_product, products.step_scores

    @numba.njit
    def combine(X, S, out, calls):
        for _ in range(calls):
            combine_rows(X, S, out)

    @numba.njit
    def dot(S, X, Y, calls):
        for _ in range(calls):
            dot_rows(S, X, Y)

    @numba.njit
    def add(w, x, S, tmp, calls):
        for _ in range(calls):
            add_product(w, x, S, tmp, tmp, False)

    @numba.njit
    def scores(X, Y, out, calls):
        for _ in range(calls):
            step_scores(X, Y, out, False)

    return {"combine": combine, "dot": dot, "add": add, "scores": scores}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--planes", type=int, default=3)
    ap.add_argument("--tables", type=int, default=3)
    ap.add_argument("--dv", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--calls", type=int, default=None, help="calls per timing (default 200,000; 3,000 with --against)")
    ap.add_argument("--against", default=None, metavar="OTHER_CHECKOUT", help="A/B against another checkout's products")
    ap.add_argument("--rounds", type=int, default=60, help="alternating rounds of an A/B (default 60)")
    a = ap.parse_args(argv)
    calls = a.calls or (3000 if a.against else 200_000)
    F, dv, m, dt = a.tables * 2 ** a.planes, a.dv, 8, np.dtype(a.dtype)
    rng = np.random.default_rng(0)

    def rows(*shape):
        return rng.standard_normal(shape).astype(dt)

    M, Pk, wb, S, V, G = rows(m, m), rows(m, F), rows(m, F), rows(F, dv), rows(m, dv), rows(m, dv)
    Pk_small = Pk * dt.type(1e-3)  # S += Pk^T V, calls after calls: kept far from overflow
    cases = [  # name, loop, inputs, the output (written) and the state (added to), flop per call
        (f"combine_rows M ({m}x{m}) . Pk ({m}x{F})", "combine", (M, Pk), np.empty((m, F), dt), 2 * m * m * F),
        (f"combine_rows Pk ({m}x{F}) . S ({F}x{dv})", "combine", (Pk, S), np.empty((m, dv), dt), 2 * m * F * dv),
        (f"combine_rows M ({m}x{m}) . G ({m}x{dv})", "combine", (M, G), np.empty((m, dv), dt), 2 * m * m * dv),
        (f"dot_rows S ({F}x{dv}), G ({m}x{dv})", "dot", (S, G), np.empty((m, F), dt), 2 * m * F * dv),
        (f"dot_rows V ({m}x{dv}), G ({m}x{dv})", "dot", (V, G), np.empty((m, m), dt), 2 * m * m * dv),
        (f"add_product S += Pk^T V ({F}x{dv})", "add", (Pk_small, V), np.zeros((F, dv), dt), 2 * m * F * dv + F * dv),
        (f"step_scores Pk . Wq^T ({m}x{m}, upper)", "scores", (Pk, wb), np.empty((m, m), dt), m * (m + 1) * F),
    ]
    print(f"F = {F} (P = {a.planes}, L = {a.tables}), dv = {dv}, {m}-row steps, {dt}; {calls:,} calls", end="")
    if a.against:
        _ab(a, cases, calls, dt)
        return
    print(", best of 5")
    mine = loops(this_products)
    for name, kind, inputs, out, flops in cases:
        args = (*inputs, out) + ((np.empty_like(out),) if kind == "add" else ())
        mine[kind](*args, 10)  # compile
        best = min(_timed(mine[kind], args, calls) for _ in range(5))
        ns = best / calls * 1e9
        print(f"{name:44s}{ns:9.1f} ns/call {flops / ns:7.1f} flop/ns")


def _ab(a, cases, calls, dt):
    """The A/B of ``--against``: every case's loops of both checkouts, alternated round by round."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ab import load  # noqa: E402  (benchmarks/ab.py: a checkout's racecpu under another name)

    load(a.against, "racecpu_ab_other")
    sides = (loops(this_products), loops(sys.modules["racecpu_ab_other._kernels.products"]))
    print(f" per round, {a.rounds} rounds alternating; A = this checkout, B = {a.against}")
    print(f"{'':44s}{'A ns':>9s}{'B ns':>9s}  {'B/A (quartiles)':22s} bits")
    for name, kind, inputs, out, _ in cases:
        outs = [out.copy(), out.copy()]
        tmps = [np.empty_like(out), np.empty_like(out)]
        args = [(*inputs, outs[i]) + ((tmps[i],) if kind == "add" else ()) for i in (0, 1)]
        for i in (0, 1):
            sides[i][kind](*args[i], 1)  # compile, and one call each from the same state
        same = np.array_equal(outs[0], outs[1])
        times = ([], [])
        for r in range(a.rounds):
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                times[i].append(_timed(sides[i][kind], args[i], calls) / calls * 1e9)
        ta, tb = np.array(times[0]), np.array(times[1])
        q1, q2, q3 = np.quantile(tb / ta, [0.25, 0.5, 0.75])
        print(f"{name:44s}{np.median(ta):9.1f}{np.median(tb):9.1f}  {q2:.3f} ({q1:.3f}..{q3:.3f}){'':5s}"
              f"{'same' if same else 'DIFFER'}")


def _timed(fn, args, calls):
    t0 = time.perf_counter()
    fn(*args, calls)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()

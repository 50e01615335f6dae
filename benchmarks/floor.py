"""What this machine can do for RACE's shapes, against what the kernels do.

The roofline of ``racecpu bench`` divides the flops by the square-SGEMM rate.
RACE's products are thin: per token, a (d x L*P) hash projection and
(F x dv) sketch / readout products with F = L * 2**P = 24; the causal scans
add products within each step of SCAN_BLOCK (8) tokens.  This script
measures what BLAS itself reaches on exactly those shapes (one thread,
1024-row blocks as the non-causal kernels use them, 16-row steps called from
Numba as the causal scans do), what racecpu's own soft-hash math costs, what a
page of fresh memory costs to touch, and builds from them an *achievable
floor* per token-head, non-causal and causal.  The products are timed on
operands already in cache: streamed from memory, as in the scans, the 16-row
step products cost up to twice as much (one thread, the queries' backward pair:
118 ns per token on 2^10 rows, 299 on 2^18), so the causal floor is low by
about that much:

    compute  = sum of the thin products the algorithm needs, at BLAS's own
               rate for each shape (the projection: the faster of BLAS and
               racecpu's own loop), plus the soft-hash math, divided by the threads
    memory   = bytes streamed / copy bandwidth (threads)
    floor    = max(compute, memory) + first touch of the fresh output bytes

Fresh pages cost more on a VM that hands freed memory back to its host (free
page reporting, as on this machine: ``page_reporting`` in /proc/cmdline): a
page freed seconds ago must be backed again by the host on its first write.
The script measures that too ("taken back": pages freed ``--wait`` = 4 s earlier) and the
floor it implies for a call that writes fresh outputs.

It then times each RACE kernel on outputs it has already touched (steady state)
and the public calls, without ``out=`` (what a user writes by default: after
the first call racecpu's pool hands them the memory of the previous call's
dropped results) and with reused ``out=`` buffers, so the gap to the floor can
be read per kernel.  Both reach the *reused floor* (no fresh pages) after the
first call; the floors with first touch are what a first call pays.
Everything not counted (the softmax backward, the scans' per-token
bookkeeping, dtype conversions) makes the real floor higher: a target below
this floor is out of reach for this algorithm on this machine.

    python benchmarks/floor.py [--log2n 20] [--heads 4] [--repeats 3]

Writes benchmarks/results/floor.txt.
"""

from __future__ import annotations

import argparse
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numba
import numpy as np
from numba import njit
from threadpoolctl import threadpool_limits
from tqdm import tqdm

import racecpu
from racecpu import _kernels as K
from racecpu import plan as racecpu_plan
from racecpu._kernels.bundles import Backward, Forward, Grads, Hash, PlanesGrad, Rows, Sums
from racecpu.apps.bench import best_time as best


def memory_limits(reps, mib=1024, wait=4.0):
    """Copy bandwidth (GB/s, read + write) and first-touch cost (s per byte), 1 and 2 threads;
    ``touch_back`` is the cost for pages freed ``wait`` seconds before."""
    n = mib * 2 ** 18  # float32
    a = np.ones(n, np.float32)
    b = np.ones(n, np.float32)
    out = {}
    with ThreadPoolExecutor(2) as ex:
        for th in (1, 2):
            parts = [slice(i * n // th, (i + 1) * n // th) for i in range(th)]

            def copy(dst):
                list(ex.map(lambda s: np.copyto(dst[s], a[s]), parts))
            t_touched = best(lambda: copy(b), reps)

            def copy_fresh(pause=0.0):
                time.sleep(pause)
                c = np.empty(n, np.float32)
                t = time.perf_counter()
                copy(c)
                return time.perf_counter() - t
            # The best is the floor; the median shows how much worse it gets when the
            # host must back the pages first (a VM: 2-7x on this machine).
            fresh = [copy_fresh() for _ in range(max(reps, 5))]
            # free page reporting hands free memory to the host after 2 s
            taken_back = [copy_fresh(wait) for _ in range(2)]
            out[th] = dict(bw=2 * a.nbytes / t_touched, touch=(min(fresh) - t_touched) / a.nbytes,
                           touch_med=(float(np.median(fresh)) - t_touched) / a.nbytes,
                           touch_back=(min(taken_back) - t_touched) / a.nbytes)
    return out


@njit  # not cached: this file is also loaded under another module name (tests)
def _projection(x, W2, U):
    """The soft hash's own projection W x, HASH_BLOCK rows at a time into plane-major scratch
    ``U``, as :func:`racecpu._kernels.hash_block` computes it (its own loop, not BLAS)."""
    LP, T = W2.shape[0], K.HASH_BLOCK
    for b0 in range(0, x.shape[0], T):
        m = min(T, x.shape[0] - b0)
        K.dot_rows(W2, x[b0:b0 + m], U[:LP * m].reshape(LP, m).T)


@njit  # not cached: this file is also loaded under another module name (tests)
def _steps(kind, a, b, o, m):
    """The causal scans' product of one shape, once per ``m``-row step of ``a`` (and ``b``)."""
    for i0 in range(0, a.shape[0], m):
        i1 = i0 + m
        if kind == 0:
            np.dot(a[i0:i1], b, o)  # (m,F)x(F,dv): readout of the state
        elif kind == 1:
            np.dot(a[i0:i1].T, b[i0:i1], o)  # (F,m)x(m,dv): state update
        elif kind == 2:
            np.dot(a[i0:i1], b.T, o)  # (m,dv)x(dv,F): cotangent through the state
        elif kind == 3:
            np.dot(a[i0:i1], b[i0:i1].T, o)  # (m,x)x(x,m): scores within the step
        else:
            np.dot(b, a[i0:i1], o)  # (m,m)x(m,x): scores times the step's rows


def thin_gemms(W, dv, reps):
    """ns per token of each product shape RACE needs for ``W (L, P, d)``, one thread, 1024-row
    blocks (the causal scans' products: SCAN_BLOCK-row steps, called from Numba as the kernels
    do), and of racecpu's own soft-hash math: forward, its kernel's time less that of its own
    projection loop; backward, the math alone (dx = du W is the "dx" product)."""
    L, P, d = W.shape
    F, LP = L * 2 ** P, L * P
    rng = np.random.default_rng(0)
    n, m = 1024, K.SCAN_BLOCK
    x = rng.standard_normal((n, d), dtype=np.float32)
    g = rng.standard_normal((n, dv), dtype=np.float32)
    phi = rng.random((n, F), dtype=np.float32)
    S = rng.standard_normal((F, dv), dtype=np.float32)
    WT = rng.standard_normal((d, LP), dtype=np.float32)
    du = rng.standard_normal((n, LP), dtype=np.float32)
    W2 = rng.standard_normal((LP, d), dtype=np.float32)
    ST = np.ascontiguousarray(S.T)
    mm = rng.random((m, m), dtype=np.float32)
    shapes = {  # key: (label, call, output shape)
        "proj": ("hash projection   (n,d)x(d,LP)", lambda o: np.matmul(x, WT, out=o), (n, LP)),
        "sketch": ("sketch     B += (F,256)x(256,dv)", lambda o: [np.matmul(phi[i:i + 256].T, g[i:i + 256], out=o)
                                                         for i in range(0, n, 256)], (F, dv)),
        "readout": ("readout        (n,F)x(F,dv)", lambda o: np.matmul(phi, S, out=o), (n, dv)),
        "cot": ("cotangent      (n,dv)x(dv,F)", lambda o: np.matmul(g, ST, out=o), (n, F)),
        "dx": ("dx = du W      (n,LP)x(LP,d)", lambda o: np.matmul(du, W2, out=o), (n, d)),
        "s_readout": ("causal readout    (m,F)x(F,dv)", lambda o: _steps(0, phi, S, o, m), (m, dv)),
        "s_update": ("causal update     (F,m)x(m,dv)", lambda o: _steps(1, phi, g, o, m), (F, dv)),
        "s_cot": ("causal cotangent  (m,dv)x(dv,F)", lambda o: _steps(2, g, S, o, m), (m, F)),
        "s_scoresF": ("causal scores     (m,F)x(F,m)", lambda o: _steps(3, phi, phi, o, m), (m, m)),
        "s_scoresV": ("causal scores     (m,dv)x(dv,m)", lambda o: _steps(3, g, g, o, m), (m, m)),
        "s_mixV": ("causal mix        (m,m)x(m,dv)", lambda o: _steps(4, g, mm, o, m), (m, dv)),
        "s_mixF": ("causal mix        (m,m)x(m,F)", lambda o: _steps(4, phi, mm, o, m), (m, F)),
    }
    res = {}
    with threadpool_limits(1, "blas"):
        for key, (label, f, oshape) in shapes.items():
            o = np.empty(oshape, np.float32)
            res[key] = (label, best(lambda: f(o), reps) / n)
        # the soft hash forward (projection + math) and the backward's math (to du), one thread
        t, ph, du_out = np.empty((n, LP), np.float32), np.empty((n, F), np.float32), np.empty((n, LP), np.float32)
        dphi = rng.standard_normal((n, F))  # overwritten by each call: every call sees finite numbers
        numba.set_num_threads(1)
        # Both sides of the forward's difference are racecpu's code timed alike: the BLAS
        # projection above is another loop, and at 1024 rows it can be the slower of the two.
        U = np.empty(LP * K.HASH_BLOCK, np.float32)
        own_proj = best(lambda: _projection(x, W.reshape(LP, d), U), reps) / n
        hash_f = best(lambda: K.soft_hash_rows(x, Hash(W, racecpu.DEFAULT_BETA), t, ph), reps) / n
        hash_b = best(lambda: K.hash_rows_du(dphi, ph, t, P, racecpu.DEFAULT_BETA, du_out), reps) / n
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    res["proj_own"] = ("hash projection   racecpu's loop", own_proj)
    res["hash_f"] = ("soft-hash math, fwd (racecpu's)", max(hash_f - own_proj, 0.0))
    res["hash_b"] = ("soft-hash math, bwd (racecpu's)", hash_b)
    return res


def _zero(*arrays):
    """Zero each array given (None: skipped)."""
    for x in arrays:
        if x is not None:
            x[...] = 0


def _kernel_calls(causal, q, k, v, g, W, beta):
    """The four kernels of one forward+backward on outputs they overwrite (the forward's own
    arrays, rewritten with the same values: memory already touched), each run where the engine
    runs it (:func:`racecpu._kernels.task_threads`); causal scans in the segments the public calls
    pick for the current thread count (:func:`racecpu.plan.scan_segments`)."""
    G, N, d = q.shape
    out, r = racecpu.race_attention_fwd(q, k, v, W, beta, causal=causal)
    F, chunk = r.phik.shape[2], r.chunk
    nc = -(-N // chunk)
    seg = racecpu_plan.scan_segments(G, nc, N)
    mask = np.ones((G, N), np.bool_)
    partA, partB = np.zeros((G, nc, F)), np.zeros((G, nc, F, d))
    phik, tk, phiq, tq, den, o = r.phik, r.tk, r.phiq, r.tq, r.den, out.reshape(G, N, d)
    dq, dk, dv = (np.zeros((G, N, d), np.float32) for _ in range(3))
    pdA, pdB, dbq, dbk = np.zeros((G, nc, F)), np.zeros((G, nc, F, d)), np.zeros((G, nc)), np.zeros((G, nc))
    hsh, rows = Hash(W, beta), Rows(phiq, tq, phik, tk, den)
    dden = np.zeros((G, N)) if causal else np.zeros((G, 0))
    none = np.empty((G, 0, d), np.float32)
    grads = Grads(dq, dk, dv, dden, dbq, dbk, PlanesGrad(none, none, np.empty((G, nc, 0, d)), np.empty((G, nc, 0, d))))
    chunks = K.even_chunks(N, chunk)
    bwd = Backward(g, v, rows, hsh, grads, chunks)

    def run(kernel, *args, **kw):
        def call():
            with K.task_threads(G * N, chunk):
                return kernel(*args, **kw)
        return call
    if not causal:
        A, B = r.A[:, None], r.B.astype(np.float32)[:, None]
        rng = np.random.default_rng(1)
        dA, dB = rng.random((G, 1, F)), rng.standard_normal((G, 1, F, d)).astype(np.float32)
        return {
            "sketch_chunks (hash k, sketch)": run(K.sketch_chunks, k, v, mask, hsh, chunks, rows, Sums(partA, partB),
                                                  span=K.SKETCH_FUSED),
            "queries_fwd (hash q, readout)": run(K.queries_fwd, q, hsh, chunks, Sums(A, B), rows, o),
            "queries_bwd (y, dB, dq)": run(K.queries_bwd, bwd, Sums(A, B), Sums(pdA, pdB)),
            "keys_bwd (dphik, dv, dk)": run(K.keys_bwd, v, rows, Sums(dA, dB), hsh, chunks, grads),
        }
    # totals of B (dB) before the last (after the first) segment: none with one segment per group
    tB, tdB = (0, K.segment_start(seg - 1, seg, nc)), (K.segment_start(1, seg, nc), nc)
    run(K.causal_queries_bwd, bwd, Sums(r.A, r.B), Sums(pdA, pdB), totals=tdB)()
    cdA, cdB = K.exclusive_scan(pdA, True), K.exclusive_scan(pdB, True, segments=seg)
    B, final = r.B.copy(), np.zeros((G, F, d))  # the scans rewrite the carries within segments
    sketch, fwd_scan = run(K.sketch_chunks, k, v, mask, hsh, chunks, rows, Sums(partA, partB), totals=tB), \
        run(K.causal_fwd, Forward(q, v, hsh, rows, o, chunks), Sums(r.A, B), final=final, segments=seg)
    queries = run(K.causal_queries_bwd, bwd, Sums(r.A, r.B), Sums(pdA, pdB), totals=tdB)
    return {  # each call first zeroes the sums it adds to
        "causal sketch_chunks (hash k)": lambda: (_zero(partA), sketch()),
        "causal_fwd (hash q, scan)": fwd_scan,
        "causal_queries_bwd (rescan, dq)": lambda: (_zero(pdA), queries()),
        "causal_keys_bwd (reverse scan, dk, dv)": run(K.causal_keys_bwd, bwd, Sums(cdA, cdB), final=final,
                                                      segments=seg),
    }


def kernels(N, H, d, threads, reps):
    """Seconds per token-head of each kernel, non-causal and causal, on touched outputs, and of
    the public calls without ``out=`` and with reused ``out=`` buffers."""
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((H, N, d), dtype=np.float32) for _ in range(4))
    W = racecpu.hyperplanes(d, 3, 3)
    beta = racecpu.DEFAULT_BETA
    res = {}
    for causal in (False, True):
        for th in threads:
            numba.set_num_threads(th)
            calls = _kernel_calls(causal, q, k, v, g, W, beta)
            for name in list(calls):
                res[(name, th)] = best(calls.pop(name), reps) / (N * H)
            # the calls held the arrays: room for the next set (and the public calls' outputs)

    def public(label, o=None, grads=None):
        for causal in (False, True):
            c = "causal " if causal else ""

            def fwd():
                return racecpu.race_attention_fwd(q, k, v, W, beta, causal=causal, out=o)

            def fwdbwd():
                return racecpu.race_attention_bwd(fwd()[1], g, out=grads)
            for th in threads:
                numba.set_num_threads(th)
                res[(f"public {c}fwd ({label})", th)] = best(fwd, reps) / (N * H)
                res[(f"public {c}fwd+bwd ({label})", th)] = best(fwdbwd, reps) / (N * H)
    public("no out=")
    # touched once, then reused
    public("out= buffers", np.ones_like(v), tuple(np.ones_like(x) for x in (q, k, v)))
    return res


def main(argv=None):
    """Measure, print and write the floor table; returns 0."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log2n", type=int, default=20)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--copy-mib", type=int, default=1024, help="array size of the memory measurements")
    p.add_argument("--wait", type=float, default=4.0,
                   help="seconds between freeing and reusing pages for the 'taken back' cost (default 4)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "floor.txt")
    a = p.parse_args(argv)
    if not 10 <= a.log2n <= 24 or a.heads < 1 or a.repeats < 1 or a.copy_mib < 1 or not a.wait >= 0:
        p.error("need 10 <= --log2n <= 24, --heads >= 1, --repeats >= 1, --copy-mib >= 1, --wait >= 0")
    d = dv = 128
    P = L = 3
    F, LP = L * 2 ** P, L * P
    N, H, s = 2 ** a.log2n, a.heads, 4
    threads = sorted({1, numba.config.NUMBA_NUM_THREADS})
    nt = threads[-1]
    bar = tqdm(total=3, desc="memory limits")
    mem = memory_limits(a.repeats, a.copy_mib, a.wait)
    bar.update()
    bar.set_description("thin GEMMs")
    # 1024-row calls of well under a millisecond: take the best of at least 10, since a single
    # call on a shared VM can be preempted and the hash math is a difference of two timings
    gm = thin_gemms(racecpu.hyperplanes(d, L, P), dv, max(a.repeats * 3, 10))
    bar.update()
    bar.set_description(f"kernels at N=2^{a.log2n} x {H} heads")
    kr = kernels(N, H, d, threads, a.repeats)
    bar.update()
    bar.close()

    # how many of each product (and soft hash) one token-head needs, per mode; the causal
    # scans as in their sequential mode (chunked: + one update each way for the chunk totals)
    uses = {
        "fwd": dict(proj=2, sketch=1, readout=1, hash_f=2),
        "bwd": dict(cot=2, sketch=1, readout=1, dx=2, hash_b=2),
        "causal fwd": dict(proj=2, s_readout=1, s_update=1, s_scoresF=1, s_mixV=1, hash_f=2),
        "causal bwd": dict(s_cot=2, s_scoresV=2, s_mixF=2, s_update=2, s_readout=1, s_scoresF=1, s_mixV=1,
                           dx=2, hash_b=2),
    }
    # bytes streamed per token-head (read + write; see racecpu.apps.bench's roofline); the causal
    # backward's two passes both read grad_out, v, phik, phiq and den, and it keeps dden
    stream = {"fwd": s * (2 * d + 2 * dv + 2 * F + 2 * LP) + 8, "bwd": s * (2 * d + 3 * dv + 2 * F + 2 * LP) + 8}
    stream["causal fwd"] = stream["fwd"]
    stream["causal bwd"] = stream["bwd"] + s * (2 * dv + 2 * F) + 16
    # fresh bytes of a first call: the residuals (phi, t of q and k, den) and the outputs
    resid = {"fwd": s * (2 * F + 2 * LP) + 8, "bwd": 0, "causal fwd": s * (2 * F + 2 * LP) + 8, "causal bwd": 8}
    fresh = {m: resid[m] + (s * dv if m.endswith("fwd") else s * (2 * d + dv)) for m in resid}
    for c in ("", "causal "):
        uses[c + "fwd+bwd"] = {key: uses[c + "fwd"].get(key, 0) + uses[c + "bwd"].get(key, 0)
                               for key in gm}
        for x in (stream, resid, fresh):
            x[c + "fwd+bwd"] = x[c + "fwd"] + x[c + "bwd"]
    modes = [c + m for c in ("", "causal ") for m in ("fwd", "bwd", "fwd+bwd")]
    hash_keys = ("hash_f", "hash_b")
    # the floor takes the faster of BLAS and racecpu's own loop for the projection
    rate = {key: min(t, gm["proj_own"][1]) if key == "proj" else t for key, (_, t) in gm.items()}
    products = {m: sum(n * rate[key] for key, n in u.items() if key not in hash_keys) for m, u in uses.items()}
    hashing = {m: sum(u.get(key, 0) * gm[key][1] for key in hash_keys) for m, u in uses.items()}

    lines = [f"command: python benchmarks/floor.py --log2n {a.log2n} --heads {H} --repeats {a.repeats}",
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, {nt} threads, "
             f"numpy {np.__version__}, numba {numba.__version__}; d = dv = {d}, P = L = 3, F = {F}, float32",
             "", f"memory ({a.copy_mib} MiB float32, touched destination; first touch = extra time to write fresh pages;",
             f"taken back = pages freed {a.wait:g} s before, which a VM with free page reporting has handed to its host):"]
    for th, m in mem.items():
        lines.append(f"  {th} thread(s): copy {m['bw'] / 1e9:5.1f} GB/s, first touch "
                     f"{m['touch'] * 1e9 * s * d:5.1f} ns per {s * d} B row best, "
                     f"{m['touch_med'] * 1e9 * s * d:5.1f} median ({m['touch'] * 1e12:.1f} ps/B best), "
                     f"taken back {m['touch_back'] * 1e9 * s * d:5.1f}")
    lines += ["", "thin products and the soft hash, one thread, ns per token (square SGEMM for comparison: "
              f"racecpu bench; m = SCAN_BLOCK = {K.SCAN_BLOCK}):"]
    lines += [f"  {label:34s} {t * 1e9:6.1f}" for label, t in gm.values()]
    lines += ["", f"achievable floor per token-head at {nt} threads (compute / threads, memory at the {nt}-thread "
              "copy rate;", "products: BLAS on RACE's shapes (projection: the faster of BLAS and racecpu's loop), "
              "hash: racecpu's own soft-hash math):",
              f"  {'':15s} {'products':>8s} {'hash':>6s} {'memory':>7s} {'1st touch':>9s} {'floor':>7s} "
              f"{'taken back':>10s} {'floor':>7s} {'reused floor':>12s}   (ns)"]
    floor, floor_back, floor_reused = {}, {}, {}
    for mode in modes:
        c = (products[mode] + hashing[mode]) / nt
        mm = stream[mode] / mem[nt]["bw"]
        ft, fb = fresh[mode] * mem[nt]["touch"], fresh[mode] * mem[nt]["touch_back"]
        floor[mode] = max(c, mm) + ft
        floor_back[mode] = max(c, mm) + fb
        floor_reused[mode] = max(c, mm)
        lines.append(f"  {mode:15s} {products[mode] / nt * 1e9:8.1f} {hashing[mode] / nt * 1e9:6.1f} {mm * 1e9:7.1f} "
                     f"{ft * 1e9:9.1f} {floor[mode] * 1e9:7.1f} {fb * 1e9:10.1f} {floor_back[mode] * 1e9:7.1f} "
                     f"{floor_reused[mode] * 1e9:12.1f}")
    lines.append("  (floor: a first call, all outputs and residuals fresh; reused floor: later calls, whose"
                 " memory racecpu's pool or out= buffers reuse)")
    lines += ["", f"RACE at N = 2^{a.log2n}, {H} heads, ns per token-head "
              f"(kernels: outputs already touched; public: input checks, after one untimed call):",
              f"  {'':38s}" + "".join(f"{str(th) + ' thr':>9s}" for th in threads)]
    for name in dict.fromkeys(n for n, _ in kr):
        lines.append(f"  {name:38s}" + "".join(f"{kr[(name, th)] * 1e9:9.1f}" for th in threads))
    for mode in ("fwd", "fwd+bwd", "causal fwd", "causal fwd+bwd"):
        fr, ob = kr[(f"public {mode} (no out=)", nt)], kr[(f"public {mode} (out= buffers)", nt)]
        lines.append(f"  {mode}: no out= / reused floor = {fr / floor_reused[mode]:.2f}; "
                     f"out= buffers / reused floor = {ob / floor_reused[mode]:.2f}")
    text = "\n".join(lines) + "\n"
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(text)
    print(text, end="")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

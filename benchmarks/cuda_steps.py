"""racecpu.cuda's chunkwise form on a GPU: variants side by side and where one head's time goes.

For one N (default 2**22, 4 heads, d = 128, float32, P = L = 3, beta = 8), on CuPy arrays:

* whole calls (forward, forward+backward; causal and not), median of ``--reps`` after a
  warm-up, a device synchronize around each: the defaults, then the variants that
  ``racecpu.cuda.CudaOps`` switches (``FUSED_CHUNK`` / ``FUSED_TILE``, the fused hash off or
  with other ``HASH_LANES``, the fused kernels off, i.e. the array expressions of
  ``racecpu.chunkwise``);
* at a shorter N (``--short-log2n``, default 2^16), the defaults (the array form below
  ``FUSED_MIN_TOKENS``) against the fused kernels at every length, both modes;
* one head's steps, each alone, timed with CUDA events (median of 5): the soft hash, chunk
  states and scans, the readout, the two backward kernels, the hash's backward, and a copy
  of ``q`` for scale (what one pass over an (N, d) array costs on this card).

Run it on a GPU machine (``pip install "racecpu[cuda]"``)::

    python benchmarks/cuda_steps.py --out cuda_steps.json
    python benchmarks/cuda_steps.py --log2n 20 --budget-s 60

``--sim`` runs the same code on NumPy arrays under Numba's CUDA simulator (tiny sizes; the
times mean nothing there): the tests do that.  Results go to ``--out`` after every row.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def run(log2n=22, heads=4, dim=128, reps=3, budget_s=150.0, sim=False, out=None, progress=True, only=None,
        steps=True, short_log2n=16):
    """Measure; returns ``{"rows": [...], "steps_one_head_ms": {...}, ...}`` (also written to ``out``).
    ``only``: the labels of the variants to time (all when None); ``steps``: time one head's steps;
    ``short_log2n``: also time the defaults against the fused kernels at every length at this
    shorter N (rows marked ``short``, which ``recommend`` leaves out; None: not)."""
    if sim:
        import numba.core.config
        numba.core.config.ENABLE_CUDASIM = 1
    import racecpu
    import racecpu.cuda as rc
    from racecpu import chunkwise

    t_start = time.perf_counter()
    if sim:
        xp = np

        def sync():
            return None
    else:
        import cupy as xp

        def sync():
            xp.cuda.Device().synchronize()
    N, H, d = 2 ** log2n, heads, dim
    rows = []
    res = dict(N=N, heads=H, dim=d, reps=reps, sim=sim, rows=rows, steps_one_head_ms={})

    def say(*a):
        if progress:
            print(*a, flush=True)

    def save():
        if out:
            with open(out, "w") as f:
                json.dump(res, f, indent=1)

    def randn(shape, seed):
        if sim:
            return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
        x = xp.empty(shape, xp.float32)
        r = xp.random.default_rng(seed)
        for h in range(shape[1]):  # head by head: each call under 2**31 elements
            x[0, h] = r.standard_normal(shape[2:], dtype=xp.float32)
        return x

    q, k, v, g = (randn((1, H, N, d), s) for s in range(4))
    planes = racecpu.hyperplanes(d, 3, 3)

    def timeit(fn):
        fn()
        sync()
        ts = []
        for _ in range(reps):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t)
        return float(np.median(ts)) * 1e3

    inputs = [(q, k, v, g)]   # [0]: the arrays the rows time (the short N swaps them in)

    def fwd(causal):
        return lambda: rc.race_attention(*inputs[0][:3], planes, 8.0, causal=causal, check_finite=False)

    def fwdbwd(causal):
        def f():
            _, r = rc.race_attention_fwd(*inputs[0][:3], planes, 8.0, causal=causal, check_finite=False)
            rc.race_attention_bwd(r, inputs[0][3])
        return f

    ops_cls = rc.CudaOps
    defaults = {name: getattr(ops_cls, name) for name in
                ("FUSED", "FUSED_HASH", "FUSED_CHUNK", "FUSED_TILE", "FUSED_BLOCKED", "FUSED_NONCAUSAL",
                 "FUSED_MIN_TOKENS", "HASH_LANES", "STATES_BY_GEMM", "READOUT_BY_GEMM")}

    def row(label, causal_modes=(True,), short=False, **attrs):
        for name, val in {**defaults, **attrs}.items():
            setattr(ops_cls, name, val)
        try:
            for causal in causal_modes:
                r = dict(variant=label, causal=causal, **attrs, fwd_ms=timeit(fwd(causal)),
                         fwdbwd_ms=timeit(fwdbwd(causal)))
                if short:
                    r.update(short=True, N=inputs[0][0].shape[2])
                rows.append(r)
                say(r)
                save()
        finally:
            for name, val in defaults.items():
                setattr(ops_cls, name, val)

    row("defaults", (True, False))
    if steps:
        res["steps_one_head_ms"] = _steps(rc, chunkwise, xp, sync, sim, q[0, :1], k[0, :1], v[0, :1], g[0, :1],
                                          planes, say)
        save()
    # (label, causal modes, switches): the switches not yet timed on a GPU first
    both, causal_only = (True, False), (True,)
    variants = [("states by the fused kernel", causal_only, dict(STATES_BY_GEMM=False)),
                ("non-causal readout by the fused kernel", (False,), dict(READOUT_BY_GEMM=False)),
                ("hash fused, 8 lanes a row", both, dict(FUSED_HASH=True, HASH_LANES=8)),
                ("products blocked", causal_only, dict(FUSED_BLOCKED=True)),
                ("non-causal backward fused", (False,), dict(FUSED_NONCAUSAL=True)),
                ("hash fused, 4 lanes a row", causal_only, dict(FUSED_HASH=True, HASH_LANES=4)),
                ("chunk 1024", causal_only, dict(FUSED_CHUNK=1024)), ("chunk 256", causal_only, dict(FUSED_CHUNK=256)),
                ("hash fused, 2 lanes a row", causal_only, dict(FUSED_HASH=True, HASH_LANES=2)),
                ("tile 8", causal_only, dict(FUSED_TILE=8)),
                ("array expressions", causal_only, dict(FUSED=False, FUSED_HASH=False))]
    if only is not None:
        variants = [v for v in variants if v[0] in only]
    for label, modes, attrs in variants[:1] if sim else variants:
        if time.perf_counter() - t_start > budget_s:
            say("budget spent: left out", label)
            continue
        row(label, modes, **attrs)
    if short_log2n is not None and time.perf_counter() - t_start <= budget_s:
        ns = 2 ** short_log2n   # the array form below FUSED_MIN_TOKENS against the fused kernels there
        inputs[0] = tuple(x[:, :, :ns].copy() for x in (q, k, v, g))
        row(f"2^{short_log2n}: defaults", both, short=True)
        row(f"2^{short_log2n}: fused kernels at every length", both, short=True, FUSED_MIN_TOKENS=0)
        inputs[0] = (q, k, v, g)
    res["recommended"] = recommend(rows)
    say("switches that beat the defaults by 2 % or more in forward+backward:", res["recommended"])
    save()
    return res


def recommend(rows, margin=1.02):
    """The switches of the variants whose forward+backward beat the defaults' by ``margin`` or more in
    every mode they were timed in (per switch, the value of the best such variant):
    ``{name: {"value": ..., "gain": ...}}``, gain the defaults' time over the variant's (the smaller
    over its modes).  Each variant is judged alone; two winners together are untimed."""
    rows = [r for r in rows if not r.get("short")]   # another N: not against the defaults' times
    base = {r["causal"]: r["fwdbwd_ms"] for r in rows if r["variant"] == "defaults"}
    by_variant = {}
    for r in rows:
        if r["variant"] != "defaults" and r["causal"] in base:
            by_variant.setdefault(r["variant"], []).append(r)
    best = {}
    for label, rs in by_variant.items():
        gain = min(base[r["causal"]] / r["fwdbwd_ms"] for r in rs)
        for name, val in rs[0].items():
            if name.isupper() and gain >= margin and gain > best.get(name, {}).get("gain", 0):
                best[name] = dict(value=val, gain=round(gain, 3), variant=label)
    return best


def _steps(rc, chunkwise, xp, sync, sim, q1, k1, v1, g1, planes, say):
    """One head's steps alone (CUDA events on a GPU, the wall clock under the simulator)."""
    ops = rc.CudaOps(xp, rc._Device(not sim))
    N, d = q1.shape[-2:]
    L, P = 3, 3
    C = ops.FUSED_CHUNK
    steps = {}

    def ev(name, fn, reps=5):
        fn()
        sync()
        ts = []
        for _ in range(1 if sim else reps):
            if sim:
                t = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t) * 1e3)
                continue
            e0, e1 = xp.cuda.Event(), xp.cuda.Event()
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            ts.append(xp.cuda.get_elapsed_time(e0, e1))
        steps[name] = float(np.median(ts))
        say(f"{name}: {steps[name]:.3f} ms")

    W = xp.asarray(planes)
    pk, _ = ops.soft_hash(k1, W, 8.0)
    pq, tq = ops.soft_hash(q1, W, 8.0)
    F = pq.shape[-1]
    out = xp.empty((1, N, d), xp.float32)
    D = xp.empty((1, N), xp.float32)
    by_gemm = rc.CudaOps.STATES_BY_GEMM
    try:
        for on in (True, False):
            rc.CudaOps.STATES_BY_GEMM = on
            ev(f"chunk states B, A and their scan ({'cuBLAS' if on else 'fused kernel'})",
               lambda: ops._states(pk, None, v1, None, C, d, False))
    finally:
        rc.CudaOps.STATES_BY_GEMM = by_gemm
    by_gemm = rc.CudaOps.READOUT_BY_GEMM
    try:
        for on in (True, False):
            rc.CudaOps.READOUT_BY_GEMM = on
            ev(f"attend, non-causal (sketch + readout by {'cuBLAS' if on else 'the fused kernel'})",
               lambda: ops.readout(pq[:, None], ops.sketch(pk, v1, 1024, N).astype(xp.float32), L, out, D, N))
    finally:
        rc.CudaOps.READOUT_BY_GEMM = by_gemm
    ev("attend, causal (states + readout)",
       lambda: ops.attend_causal(pq[:, None], pk, v1, 64, L, out, D, None, False, N))
    prefix = ops.attend_causal(pq[:, None], pk, v1, 64, L, out, D, None, False, N)[1]   # what the backward is given
    winv = chunkwise._inverse(xp, D, L)
    dvo = xp.empty((1, N, d), xp.float32)
    blocked = rc.CudaOps.FUSED_BLOCKED
    try:
        for on in (True, False):
            rc.CudaOps.FUSED_BLOCKED = on
            ev(f"causal backward of one head (fused, products {'blocked' if on else 'a thread per output'}, to dphi)",
               lambda: ops.causal_bwd(pq[:, None], pk, v1, g1[:, None], winv[:, None], D[:, None], 64, dvo,
                                      prefix=prefix, tokens=N))
    finally:
        rc.CudaOps.FUSED_BLOCKED = blocked
    sketch = ops.sketch(pk, v1, 1024, N).astype(xp.float32)
    ops.readout(pq[:, None], sketch, L, out, D, N)
    winv = chunkwise._inverse(xp, D, L)
    fused_nc = rc.CudaOps.FUSED_NONCAUSAL
    try:
        for on in (True, False):
            rc.CudaOps.FUSED_NONCAUSAL = on
            ev(f"non-causal backward of one head ({'fused' if on else 'array expressions'}, to dphi)",
               lambda: ops.noncausal_keys_bwd(pk, v1, ops.noncausal_queries_bwd(
                   pq[:, None], g1[:, None], winv[:, None], sketch, 1024, N)[1].astype(xp.float32), dvo, N))
    finally:
        rc.CudaOps.FUSED_NONCAUSAL = fused_nc
    dxo = xp.empty((N, d), xp.float32)
    rows = (pq.reshape(-1, F), pq.reshape(-1, F), tq.reshape(-1, L * P))
    fused_hash = rc.CudaOps.FUSED_HASH
    try:
        rc.CudaOps.FUSED_HASH = True
        ev(f"soft hash of q (fused, {rc.CudaOps.HASH_LANES} lanes a row)", lambda: ops.soft_hash(q1, W, 8.0))
        ev(f"hash backward to dq (fused, {rc.CudaOps.HASH_LANES} lanes a row)",
           lambda: ops.hash_dx(*rows, W, 8.0, dxo))
        rc.CudaOps.FUSED_HASH = False
        ev("soft hash of q (cuBLAS + a pass)", lambda: ops.soft_hash(q1, W, 8.0))
        ev("hash backward to dq (a pass + cuBLAS)", lambda: ops.hash_dx(*rows, W, 8.0, dxo))
    finally:
        rc.CudaOps.FUSED_HASH = fused_hash
    ev("copy of q (one (N, d) array read and written)", lambda: q1.copy())
    return steps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log2n", type=int, default=22)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=150.0, help="start no new variant after this many seconds")
    p.add_argument("--out", default=None)
    p.add_argument("--sim", action="store_true", help="NumPy under Numba's CUDA simulator (tiny sizes)")
    p.add_argument("--variants", default=None, help="comma-separated labels of the variants to time (default: all)")
    p.add_argument("--no-steps", action="store_true", help="leave out one head's steps")
    p.add_argument("--short-log2n", type=int, default=16,
                   help="also time the defaults against the fused kernels at every length at this N (0: not)")
    a = p.parse_args(argv)
    if a.sim:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    only = None if a.variants is None else [x.strip() for x in a.variants.split(",")]
    run(a.log2n, a.heads, a.dim, a.reps, a.budget_s, a.sim, a.out, only=only, steps=not a.no_steps,
        short_log2n=a.short_log2n or None)


if __name__ == "__main__":
    main()

"""``racecpu demo``: one forward+backward of a RACE layer at a million tokens.

Draws random q, k, v and a random output cotangent, runs
``race_attention_fwd`` / ``race_attention_bwd`` head by head (each call uses
every core), and checks a sample of output rows against two exact O(N)-per-row
statements computed in float64, independently of the kernels:

* the dense RACE reference (same planes, the soft hash as an explicit softmax
  over corners): the kernels' numerical error;
* exact angular attention with gamma = P: what RACE approximates (Theorem 1).
"""

from __future__ import annotations

import time

import numpy as np
from tqdm.auto import tqdm

from .. import reference as ref
from .._memory import peak_rss
from ..attention import race_attention_bwd, race_attention_fwd
from ..hashing import DEFAULT_BETA, DEN_FLOOR, hyperplanes


def add_arguments(p):
    p.add_argument("--tokens", type=int, default=2 ** 20, help="sequence length N (default 1,048,576)")
    p.add_argument("--heads", type=int, default=4, help="number of heads (default 4)")
    p.add_argument("--dim", type=int, default=128, help="head dim d = dv (default 128)")
    p.add_argument("--planes", type=int, default=3, help="hyperplanes per table P (default 3)")
    p.add_argument("--tables", type=int, default=3, help="hash tables L (default 3)")
    p.add_argument("--beta", type=float, default=DEFAULT_BETA, help=f"temperature (default {DEFAULT_BETA})")
    p.add_argument("--causal", action="store_true", help="causal attention")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--samples", type=int, default=32, help="query rows checked against the exact references")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-of-core", metavar="DIR", default=None,
                   help="stream the sequence through memory-mapped files in DIR with bounded RAM; inputs are "
                        "generated per block from --seed, results written to DIR; rerunning resumes "
                        "(e.g. --tokens 8388608 --causal --out-of-core DIR needs ~68 GiB of disk)")


def _exact_rows(q_rows, rows, k, v, sim, causal, block=1 << 16):
    """Exact normalised attention of the given query rows, streaming over keys (float64)."""
    num = np.zeros((len(rows), v.shape[1]))
    den = np.zeros(len(rows))
    for lo in range(0, k.shape[0], block):
        s = sim(q_rows, k[lo:lo + block].astype(np.float64))  # (rows, block)
        if causal:
            s = s * (np.arange(lo, lo + s.shape[1])[None, :] <= np.asarray(rows)[:, None])
        num += s @ v[lo:lo + block].astype(np.float64)
        den += s.sum(1)
    return np.where((den > DEN_FLOOR)[:, None], num / np.where(den > DEN_FLOOR, den, 1)[:, None], 0)


def _run_out_of_core(args):
    """``--out-of-core DIR``: stream the sequence through memory-mapped files, RAM bounded."""
    from .ooc_demo import demo

    m = demo(tokens=args.tokens, heads=args.heads, dim=args.dim, directory=args.out_of_core, causal=args.causal,
             seed=args.seed, num_planes=args.planes, num_tables=args.tables, beta=args.beta)
    gib = 2.0 ** 30
    print(f"out-of-core RACE attention: N={m['tokens']:,} tokens, {m['heads']} heads, d={m['dim']}, "
          f"{'causal' if m['causal'] else 'non-causal'}, directory {m['directory']}")
    print(f"blocks computed   {m['blocks_computed']} of {m['blocks_total']} (the rest resumed from a checkpoint)")
    print(f"forward           {m['seconds_forward']:8.1f} s")
    print(f"backward          {m['seconds_backward']:8.1f} s")
    print(f"total             {m['seconds_total']:8.1f} s   {m['ns_per_token_head']:8.1f} ns per token-head")
    print(f"peak RSS          {m['peak_rss_bytes'] / gib:8.2f} GiB")
    print(f"disk used         {m['disk_bytes'] / gib:8.2f} GiB (out, dq, dk, dv in {m['directory']}; delete when done)")
    if m.get("check_max_abs_err") is not None:
        print(f"max abs error of the first tokens vs the in-memory API: {m['check_max_abs_err']:.2e}")
    ok = m.get("check_max_abs_err") is None or m["check_max_abs_err"] < 1e-4
    return 0 if ok else 1


def run(args):
    if args.out_of_core:
        return _run_out_of_core(args)
    N, H, d = args.tokens, args.heads, args.dim
    if N < 1 or H < 1 or d < 1:
        raise SystemExit("--tokens, --heads and --dim must be >= 1")
    dt = np.dtype(args.dtype)
    gib = 2.0 ** 30
    base_bytes = 8 * H * N * d * dt.itemsize  # q, k, v, out, grad_out, dq, dk, dv
    print(f"RACE attention demo: N={N:,} tokens, {H} heads, d=dv={d}, P={args.planes}, L={args.tables}, "
          f"beta={args.beta}, {'causal' if args.causal else 'non-causal'}, {dt}")
    print(f"arrays q, k, v, out, grad_out, dq, dk, dv: {base_bytes / gib:.2f} GiB")
    rng = np.random.default_rng(args.seed)
    W = hyperplanes(d, args.planes, args.tables, seed=args.seed, dtype=dt)
    steps = tqdm(total=4 * H, desc="demo", unit="step", dynamic_ncols=True)
    shape = (H, N, d)
    q, k, v, g = (np.empty(shape, dt) for _ in range(4))
    for h in range(H):
        for x in (q, k, v, g):
            x[h] = rng.standard_normal((N, d), dtype=np.float32)
        steps.set_postfix_str("inputs")
        steps.update(1)
    # Compile (or load the on-disk cache) on a tiny input so the timings below are the kernels'.
    t0 = time.perf_counter()
    tiny, tres = race_attention_fwd(q[0, :64], k[0, :64], v[0, :64], W, args.beta, causal=args.causal)
    race_attention_bwd(tres, tiny)
    t_compile = time.perf_counter() - t0
    out = np.empty(shape, dt)
    dq, dk, dv = (np.empty(shape, dt) for _ in range(3))
    t_fwd = t_bwd = 0.0
    for h in range(H):
        t0 = time.perf_counter()
        out[h], res = race_attention_fwd(q[h], k[h], v[h], W, args.beta, causal=args.causal)
        t1 = time.perf_counter()
        dq[h], dk[h], dv[h], _ = race_attention_bwd(res, g[h])
        t2 = time.perf_counter()
        del res
        t_fwd += t1 - t0
        t_bwd += t2 - t1
        steps.set_postfix_str(f"head {h + 1}/{H} forward+backward")
        steps.update(2)
    rows = np.sort(rng.choice(N, size=min(args.samples, N), replace=False))
    W64 = W.astype(np.float64)
    L = W.shape[0]

    def race_sim(qr, kb):
        pq = ref.soft_buckets_dense(qr, W64, args.beta)[0].reshape(len(qr), -1)
        pk = ref.soft_buckets_dense(kb, W64, args.beta)[0].reshape(len(kb), -1)
        return pq @ pk.T / L

    def angular_sim(qr, kb):
        qn = qr / np.maximum(np.linalg.norm(qr, axis=1, keepdims=True), 1e-300)
        kn = kb / np.maximum(np.linalg.norm(kb, axis=1, keepdims=True), 1e-300)
        return (1 - np.arccos(np.clip(qn @ kn.T, -1, 1)) / np.pi) ** args.planes

    err_kernel, err_angular = [], []
    for h in range(H):
        qr = q[h, rows].astype(np.float64)
        got = out[h, rows].astype(np.float64)
        want = _exact_rows(qr, rows, k[h], v[h], race_sim, args.causal)
        ang = _exact_rows(qr, rows, k[h], v[h], angular_sim, args.causal)
        err_kernel.append(np.abs(got - want).max() / np.abs(want).max())
        # Theorem 1 bounds the error in units of ||V||: report RMS error / RMS of v.
        err_angular.append(np.sqrt(np.mean((got - ang) ** 2)) / np.sqrt(np.mean(v[h].astype(np.float64) ** 2)))
        steps.set_postfix_str(f"head {h + 1}/{H} exact check")
        steps.update(1)
    steps.close()
    peak = peak_rss()
    per = 1e9 / (N * H)
    finite = all(np.isfinite(x).all() for x in (out, dq, dk, dv))
    print(f"compile/cache load{t_compile:8.2f} s   (first call, excluded below)")
    print(f"forward           {t_fwd:8.2f} s   {t_fwd * per:8.1f} ns per token-head")
    print(f"backward          {t_bwd:8.2f} s   {t_bwd * per:8.1f} ns per token-head")
    print(f"forward+backward  {t_fwd + t_bwd:8.2f} s   {(t_fwd + t_bwd) * per:8.1f} ns per token-head")
    print(f"peak RSS          {peak / gib:8.2f} GiB  ({peak / base_bytes:.2f}x the eight arrays)")
    print(f"max relative error vs exact dense RACE reference ({len(rows)} rows x {H} heads, float64): "
          f"{max(err_kernel):.2e}")
    print(f"RMS error vs exact angular attention (gamma=P={args.planes}), in units of RMS(v): "
          f"{max(err_angular):.3f} (the estimator's bias + variance; shrinks as beta and L grow)")
    print(f"all outputs and gradients finite: {finite}")
    tol = 1e-4 if dt == np.float32 else 1e-9
    return 0 if finite and max(err_kernel) < tol else 1

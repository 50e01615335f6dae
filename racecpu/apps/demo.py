"""``racecpu demo``: a RACE layer's forward+backward, timed honestly and checked.

Draws random q, k, v and an output cotangent (in parallel, seeded), then times
only racecpu's calls on the whole ``(H, N, d)`` tensors:

* the first call on fresh memory (the result buffers' pages are faulted in by
  the call, as they are for a script that calls racecpu once);
* the steady state a training loop sees: the same call repeated with its
  results written into buffers allocated once (``out=``), so the memory racecpu
  uses is reused, as in ``racecpu bench``'s ``race-out`` measurement.

A sample of output rows is checked against two exact statements computed in
float64, independently of the kernels: the dense RACE reference (the kernels'
numerical error) and exact angular attention with gamma = P (what RACE
approximates, Theorem 1).  The default size fits in 8 GiB; the memory
available is checked before anything is allocated.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from ..cli import UsageError, add_common_arguments, add_race_arguments, positive_float, positive_int

DEFAULT_TOKENS = 2 ** 18
_GIB = 2.0 ** 30


def add_arguments(p):
    add_race_arguments(p, tokens=DEFAULT_TOKENS, heads=4, head_dim=128)
    p.add_argument("--samples", type=positive_int, default=32,
                   help="query rows per head checked against the exact references (default 32)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="steady-state calls timed after the first one (default 3; the best is reported)")
    p.add_argument("--out-of-core", metavar="DIR", default=None,
                   help="stream the sequence through memory-mapped files in DIR with bounded RAM; inputs are "
                        "generated per block from --seed, results written to DIR; rerunning resumes "
                        "(e.g. --tokens 8388608 --causal --out-of-core DIR needs ~68 GiB of disk)")
    p.add_argument("--dask", metavar="SCHEDULER", nargs="?", const="local", default=None,
                   help="causal forward+backward on a Dask cluster (a distributed scheduler address, or none for a "
                        "LocalCluster of one worker process per core); inputs generated per block from --seed. "
                        "Writes out, dq, dk, dv as zarr arrays to --dask-dir: 16 x tokens x head-dim bytes per head "
                        "(512 MiB per head at the default 262,144 tokens and d=128; 32 GiB at --tokens 16777216), "
                        "and leaves them there: delete the folder when done. Refused before any work when they do "
                        "not fit the free disk (4 GiB kept free). Needs racecpu[dask]")
    p.add_argument("--dask-dir", metavar="DIR", default="racecpu-dask",
                   help="where --dask writes out, dq, dk, dv (zarr; an earlier run's replaced; yours to delete; "
                        "default ./racecpu-dask)")
    p.add_argument("--block", type=positive_int, default=None,
                   help="tokens per block (one dask task and zarr chunk) for --dask (default: --tokens split "
                        "evenly into blocks of at most 262,144; a --block above --tokens is one block of --tokens)")
    p.add_argument("--max-memory-gib", type=positive_float, default=None, metavar="GIB",
                   help="refuse sizes needing more than this (default: the memory available now)")
    add_common_arguments(p)


def available_memory():
    """Bytes of memory available to a new allocation now, or None if unknown."""
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except Exception:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def memory_needed(N, H, d, P, L, itemsize, causal):
    """Bytes the demo needs: eight (H, N, d) arrays, the residuals and the kernels' working memory."""
    F, LP = L * 2 ** P, L * P
    arrays = 8 * H * N * d * itemsize                   # q, k, v, grad_out, out, dq, dk, dv
    residuals = H * N * (2 * F + 2 * LP) * itemsize + 8 * H * N
    working = 2 * H * N * max(d, F) * itemsize          # the pool's scratch in the backward
    return arrays + residuals + working + (512 << 20)   # + the interpreter, numpy, numba


def draw(shape, dtype, seed, base_rows=8192):
    """A seeded ``(..., N, d)`` array of standard normal rows, drawn cheaply.

    The first ``base_rows`` rows of every head are drawn with
    ``numpy.random.default_rng``; every later block of rows is those rows in a
    random order with a random sign per column, so each row is still a standard
    normal vector and blocks differ, at the cost of a gather (a full draw of
    2^18 tokens x 4 heads x 4 arrays took ~20 s on a loaded 2-core machine).
    """
    rng = np.random.default_rng(seed)
    out = np.empty(shape, dtype)
    flat = out.reshape(-1, shape[-2], shape[-1])
    n, d = shape[-2], shape[-1]
    nb = min(n, base_rows)
    for x in flat:
        base = rng.standard_normal((nb, d), dtype=np.float64).astype(dtype)
        x[:nb] = base
        for lo in range(nb, n, nb):
            hi = min(n, lo + nb)
            np.take(base, rng.integers(0, nb, hi - lo), axis=0, out=x[lo:hi])
            x[lo:hi] *= rng.choice(np.array([-1, 1], dtype), d)
    return out


def _exact_rows(q_rows, rows, k, v, sim, causal, block=1 << 15):
    """Exact normalised attention of the given query rows, streaming over keys (float64)."""
    from ..config import DEN_FLOOR

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

    m = demo(tokens=args.tokens, heads=args.heads, dim=args.head_dim, directory=args.out_of_core,
             causal=args.causal, seed=args.seed, num_planes=args.num_planes, num_tables=args.num_tables,
             beta=args.beta, progress=args.progress)
    print(f"out-of-core RACE attention: N={m['tokens']:,} tokens, {m['heads']} heads, d={m['dim']}, "
          f"{'causal' if m['causal'] else 'non-causal'}, directory {m['directory']}")
    print(f"blocks computed   {m['blocks_computed']} of {m['blocks_total']} (the rest resumed from a checkpoint)")
    print(f"forward           {m['seconds_forward']:8.1f} s")
    print(f"backward          {m['seconds_backward']:8.1f} s")
    print(f"total             {m['seconds_total']:8.1f} s   {m['ns_per_token_head']:8.1f} ns per token-head")
    print(f"peak RSS          {m['peak_rss_bytes'] / _GIB:8.2f} GiB")
    print(f"forward's rows    {m['rows_bytes'] / _GIB:8.2f} GiB (in {m['directory']}/rows from the forward to the "
          f"backward, then deleted)")
    print(f"disk used         {m['disk_bytes'] / _GIB:8.2f} GiB (out, dq, dk, dv in {m['directory']}; "
          f"delete when done)")
    if m.get("check_max_abs_err") is not None:
        print(f"max abs error of the first tokens vs the in-memory API: {m['check_max_abs_err']:.2e}")
    ok = m.get("check_max_abs_err") is None or m["check_max_abs_err"] < 1e-4
    args.result = {k: v for k, v in m.items()}
    return 0 if ok else 1


def _run_dask(args):
    """``--dask [SCHEDULER]``: the causal layer's forward+backward on a Dask cluster, results as zarr.

    Before any work (no cluster started, nothing written): the optional
    dependencies, ``--dask-dir`` a folder, and the results fitting its free
    disk; each problem is a :class:`~racecpu.cli.UsageError` (exit 2).
    """
    from ..cli import require
    for module in ("dask", "distributed", "zarr"):
        require(module, "racecpu demo --dask", "dask")
    from . import dask_demo

    directory = args.dask_dir
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UsageError(f"--dask-dir {directory}: is a file, not a folder")
    block = dask_demo.pick_block(args.tokens, args.block)
    problem = dask_demo.disk_problem(args.tokens, args.heads, args.head_dim, block, directory,
                                     num_planes=args.num_planes, num_tables=args.num_tables)
    if problem is not None:
        raise UsageError(f"--dask: {problem}")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--dask-dir {directory}: cannot make this folder ({exc.strerror or exc})") from None

    scheduler = None if args.dask == "local" else args.dask
    need = dask_demo.disk_needed(args.tokens, args.heads, args.head_dim, block)[0]
    blocks = f"blocks of {block:,} token{'s' if block > 1 else ''}"
    if args.block is not None and args.block > args.tokens:
        blocks += " (--block exceeds --tokens: one block)"
    print(f"RACE attention on Dask: N={args.tokens:,} tokens x {args.heads} heads, d=dv={args.head_dim}, "
          f"P={args.num_planes}, L={args.num_tables}, beta={args.beta}, causal, float32, {blocks}, "
          f"{'a LocalCluster' if scheduler is None else scheduler}; results (out, dq, dk, dv as zarr, about "
          f"{need / _GIB:.2f} GiB) in {directory}: delete it when done", flush=True)
    m = dask_demo.demo(tokens=args.tokens, heads=args.heads, dim=args.head_dim, directory=directory,
                       scheduler=scheduler, seed=args.seed, num_planes=args.num_planes, num_tables=args.num_tables,
                       beta=args.beta, block=block, progress=args.progress)
    th = m["tokens"] * m["heads"]
    print(f"heads {m['heads']}, workers {m['workers']}, {m['blocks']} blocks, scan {m['scan']}")
    for label, seconds in m["phases"]:  # four where the carries are scanned, two where the scan is fused
        print(f"{label:18}{seconds:8.1f} s")
    print(f"{'total':18}{m['seconds_total']:8.1f} s   {m['ns_per_token_head']:8.1f} ns per token-head "
          f"({th:,} token-heads)")
    for w, b in sorted(m["peak_rss_bytes"].items()):
        print(f"peak RSS {w}: {b / _GIB:.2f} GiB")
    print(f"bytes moved between workers: {m['bytes_moved_sketches']:,} of sketches "
          f"({m['bytes_moved_sketches'] / m['blocks']:,.0f} per block; one state is {m['state_bytes']:,}), "
          f"{m['bytes_moved_other']:,} of other keys")
    print(f"forward's rows    {m['rows_bytes'] / _GIB:8.2f} GiB (in {m['directory']}/rows from the forward to the "
          f"backward, then deleted)")
    print(f"disk used         {m['disk_bytes'] / _GIB:8.2f} GiB ({m['disk_bytes']:,} bytes: out, dq, dk, dv as zarr in "
          f"{m['directory']}; delete it when done)")
    print(f"max abs error of the first {m['check_tokens']:,} tokens vs the in-memory API: "
          f"out {m['check_max_abs_err_out']:.2e}, dq {m['check_max_abs_err_dq']:.2e}")
    ok = max(m["check_max_abs_err_out"], m["check_max_abs_err_dq"]) < 1e-4
    args.result = dict(m, ok=ok)
    return 0 if ok else 1


def run(args):
    if args.dask is not None and args.out_of_core:
        raise UsageError("choose one of --dask and --out-of-core")
    if args.dask is not None:
        return _run_dask(args)
    if args.out_of_core:
        return _run_out_of_core(args)
    # --samples is the in-memory demo's alone: the drivers above check their first tokens instead,
    # so fewer --tokens than the default 32 samples is no error for them.
    if args.samples > args.tokens:
        raise UsageError(f"--samples {args.samples} exceeds --tokens {args.tokens}")

    from .. import reference as ref
    from .._memory import peak_rss
    from ..config import CHUNK
    from ..attention import race_attention_bwd, race_attention_fwd
    from ..hashing import hyperplanes

    N, H, d, P, L = args.tokens, args.heads, args.head_dim, args.num_planes, args.num_tables
    dt = np.dtype(args.dtype)
    need = memory_needed(N, H, d, P, L, dt.itemsize, args.causal)
    avail = args.max_memory_gib * _GIB if args.max_memory_gib is not None else available_memory()
    if avail is not None and need > avail:
        print(f"racecpu demo: N={N:,} x {H} heads x d={d} {dt} needs about {need / _GIB:.1f} GiB; "
              f"{avail / _GIB:.1f} GiB {'allowed' if args.max_memory_gib else 'available'}. "
              f"Choose a smaller --tokens or --heads, or stream it with --out-of-core DIR.", file=sys.stderr)
        return 2
    causal = "causal" if args.causal else "non-causal"
    print(f"RACE attention demo: N={N:,} tokens x {H} heads, d=dv={d}, P={P}, L={L}, beta={args.beta}, "
          f"{causal}, {dt}; needs ~{need / _GIB:.1f} GiB"
          + (f" of {avail / _GIB:.1f} GiB available" if avail is not None else ""))

    t0 = time.perf_counter()
    shape = (H, N, d)
    q, k, v, g = (draw(shape, dt, [args.seed, i]) for i in range(4))
    t_inputs = time.perf_counter() - t0
    print(f"inputs drawn      {t_inputs:8.2f} s")
    W = hyperplanes(d, P, L, seed=args.seed, dtype=dt)

    # Compile (or load from the cache) on a tiny input, so the timings below are the kernels'.
    # A compilation announces itself on stderr (racecpu._kernels._jit.announce_compilation).
    t0 = time.perf_counter()
    n0 = min(N, 4 * CHUNK + 5)  # several chunks and a partial one: the full size's code paths
    tiny, tres = race_attention_fwd(q[:, :n0], k[:, :n0], v[:, :n0], W, args.beta, causal=args.causal)
    race_attention_bwd(tres, g[:, :n0])
    del tiny, tres
    t_compile = time.perf_counter() - t0

    # First call at full size on fresh memory: the result buffers' pages are touched for the first time.
    out = np.empty(shape, dt)
    grads = tuple(np.empty(shape, dt) for _ in range(3))
    t0 = time.perf_counter()
    out, res = race_attention_fwd(q, k, v, W, args.beta, causal=args.causal, out=out)
    t1 = time.perf_counter()
    dq, dk, dv, _ = race_attention_bwd(res, g, out=grads)
    t2 = time.perf_counter()
    del res
    first = (t1 - t0, t2 - t1)
    # Steady state: the same calls again, results into the same buffers (a training loop's step).
    steady = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        _, res = race_attention_fwd(q, k, v, W, args.beta, causal=args.causal, out=out)
        t1 = time.perf_counter()
        race_attention_bwd(res, g, out=grads)
        t2 = time.perf_counter()
        del res
        steady.append((t1 - t0, t2 - t1))
    best = min(steady, key=sum)

    # Check a sample of rows against the exact references (float64, O(N) per row).
    rng = np.random.default_rng(args.seed)
    rows = np.sort(rng.choice(N, size=args.samples, replace=False))
    W64 = W.astype(np.float64)

    def race_sim(qr, kb):
        pq = ref.soft_buckets_dense(qr, W64, args.beta)[0].reshape(len(qr), -1)
        pk = ref.soft_buckets_dense(kb, W64, args.beta)[0].reshape(len(kb), -1)
        return pq @ pk.T / L

    def angular_sim(qr, kb):
        qn = qr / np.maximum(np.linalg.norm(qr, axis=1, keepdims=True), 1e-300)
        kn = kb / np.maximum(np.linalg.norm(kb, axis=1, keepdims=True), 1e-300)
        return (1 - np.arccos(np.clip(qn @ kn.T, -1, 1)) / np.pi) ** P

    t0 = time.perf_counter()
    err_kernel, err_angular = [], []
    for h in range(H):
        qr = q[h, rows].astype(np.float64)
        got = out[h, rows].astype(np.float64)
        want = _exact_rows(qr, rows, k[h], v[h], race_sim, args.causal)
        ang = _exact_rows(qr, rows, k[h], v[h], angular_sim, args.causal)
        err_kernel.append(float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-300)))
        # Theorem 1 bounds the error in units of ||V||: report RMS error / RMS of v.
        err_angular.append(float(np.sqrt(np.mean((got - ang) ** 2)) / np.sqrt(np.mean(v[h].astype(np.float64) ** 2))))
    t_check = time.perf_counter() - t0
    peak = peak_rss()
    finite = bool(all(np.isfinite(x).all() for x in (out, dq, dk, dv)))
    per = 1e9 / (N * H)
    print(f"compile/cache load{t_compile:8.2f} s   (first calls in this process, 4K tokens)")
    print(f"{'':18}{'forward':>22}{'backward':>22}{'forward+backward':>26}")
    for label, (tf, tb) in (("first call", first), (f"steady (best of {args.repeats})", best)):
        print(f"{label:18}{tf:8.3f} s {tf * per:7.1f} ns/th  {tb:8.3f} s {tb * per:7.1f} ns/th  "
              f"{tf + tb:8.3f} s {(tf + tb) * per:9.1f} ns/th")
    print("  (ns/th: nanoseconds per token-head; steady: results written into buffers allocated once, "
          "as in a training loop)")
    print(f"peak RSS          {peak / _GIB:8.2f} GiB (estimate before running: {need / _GIB:.2f} GiB)")
    print(f"max relative error vs the exact dense RACE reference ({len(rows)} rows x {H} heads, float64): "
          f"{max(err_kernel):.2e}")
    print(f"RMS error vs exact angular attention (gamma=P={P}), in units of RMS(v): "
          f"{max(err_angular):.3f} (the estimator's bias + variance; shrinks as beta and L grow)")
    print(f"all outputs and gradients finite: {finite}")
    tol = 1e-4 if dt == np.float32 else 1e-9
    ok = finite and max(err_kernel) < tol
    args.result = dict(
        tokens=N, heads=H, head_dim=d, num_planes=P, num_tables=L, beta=args.beta, causal=args.causal,
        dtype=str(dt), seconds_inputs=t_inputs, seconds_compile=t_compile, seconds_check=t_check,
        first_call=dict(forward_s=first[0], backward_s=first[1], ns_per_token_head=sum(first) * per),
        steady_state=dict(forward_s=best[0], backward_s=best[1], ns_per_token_head=sum(best) * per,
                          repeats=args.repeats),
        peak_rss_bytes=int(peak), memory_estimate_bytes=int(need),
        max_rel_error_vs_reference=max(err_kernel), rms_error_vs_angular=max(err_angular),
        finite=finite, ok=ok)
    return 0 if ok else 1

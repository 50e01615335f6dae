"""GPU benchmark of :mod:`racecpu.cuda`: forward+backward time and peak device memory.

Run on a machine with an NVIDIA GPU and ``pip install "racecpu[cuda,bench]"``::

    python -m racecpu.apps.cuda_bench                       # N = 2**20 .. 2**23, 4 heads, d = 128, float32
    python -m racecpu.apps.cuda_bench --log2n 22 --threads 32 64 128   # tile-length sweep at one N
    python -m racecpu.apps.cuda_bench --log2n 20 22 --path chunkwise tiles   # the two formulations side by side
    python -m racecpu.apps.cuda_bench --out gpu_bench.json
    python -m racecpu.apps.cuda_bench --n 12582912 --causal yes --dtype bfloat16   # issue 55's memory target

What it does, per configuration (N, causal, formulation ``racecpu.cuda.PATH``, threads per block):

1. a correctness spot check at N = 300 against the CPU path (max-norm relative
   error of out, dq, dk, dv; should be ~1e-6 in float32);
2. one untimed forward+backward at the full N (compiles the kernels), then
   ``repeats`` timed ones (``cuda.synchronize`` around each), median and best;
3. peak device memory of one forward+backward: CuPy's memory-pool high-water
   mark (``racecpu.cuda`` allocates from CuPy's pool for CuPy inputs), inputs
   and grad_out included;
4. the effective bandwidth: q, k, v, grad_out, out, dq, dk, dv counted once
   each, over the median time (``GBps``).

With ``--authors DIR`` (a checkout of the authors' public repository
sahiljoshi515/RACE_Attention, or their files laid out as there:
``scaling/race_causal_cuda.py``, ``scaling/race_common.py`` and
``kernels/gpu/{forward_kernel.cu, backward_kernels.cu, race_cuda_binding.cpp,
race_cuda_build.py}``), their causal module (CUDA kernels built by
``torch.utils.cpp_extension`` on its first call, ~1 minute; their hash in
torch; float32) is timed at the same causal sizes on racecpu's planes, and
each racecpu.cuda causal row gets its speed-up over it (``x_authors``).

``torch.nn.functional.scaled_dot_product_attention`` runs on the same GPU in
bfloat16 (the FlashAttention backend; float32 has no flash kernel) up to
``--sdpa-max-log2n`` (quadratic time: ~minutes at N = 2**20); larger N are
extrapolated as ``t * (N / N_max)**2`` and marked so.  Its peak is
``torch.cuda.max_memory_allocated``.

Targets (issue 55, on an H100 or H200): forward+backward at N = 2**22, 4
heads, d = 128, float32, <= 100 ms causal and <= 60 ms non-causal; causal
forward+backward <= 10 ms at N = 2**16; >= 10x the authors' causal module
at 2**20 and 2**22 (``--authors``); peak device memory <= 1.15x the eight
arrays.  What was measured: ``docs/performance.md``, "GPU".
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import racecpu


def _cupy():
    try:
        import cupy
        return cupy
    except ImportError:
        return None


def _sync():
    from numba import cuda
    cuda.synchronize()


def _randn(shape, dtype, seed):
    """Device array of N(0, 1) entries: CuPy when installed, numba otherwise; ``dtype``
    "bfloat16": :class:`racecpu.cuda.Bfloat16` of the rounded values' bits."""
    from numba import cuda
    cp = _cupy()
    if dtype == "bfloat16":
        from ..chunkwise import Bfloat16Bits
        from ..cuda import Bfloat16
        xp = cp if cp is not None else np
        x = _randn(shape, np.float32, seed)
        bits = Bfloat16Bits.empty(xp, shape)
        bits[...] = x if cp is not None else x.copy_to_host()
        return Bfloat16(bits.bits if cp is not None else cuda.to_device(bits.bits))
    if cp is not None:
        return cp.random.default_rng(seed).standard_normal(shape, dtype=np.float32).astype(dtype)
    return cuda.to_device(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


def _itemsize(dtype):
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


def check_against_cpu(n=300, heads=2, head_dim=16, causal=True, seed=0):
    """Max-norm relative errors of out, dq, dk, dv (racecpu.cuda vs the CPU kernels), float32."""
    from ..cuda import race_attention_bwd, race_attention_fwd
    rng = np.random.default_rng(seed)
    q, k, v, g = (rng.standard_normal((heads, n, head_dim)).astype(np.float32) for _ in range(4))
    planes = racecpu.hyperplanes(head_dim)
    out, res = race_attention_fwd(q, k, v, planes, causal=causal)
    grads = race_attention_bwd(res, g)
    ref, rres = racecpu.race_attention_fwd(q, k, v, planes, causal=causal)
    want = racecpu.race_attention_bwd(rres, g)

    def host(x):
        return x.get() if hasattr(x, "get") else x.copy_to_host()

    errs = {}
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out,) + tuple(grads[:3]), (ref,) + tuple(want[:3])):
        errs[name] = float(np.max(np.abs(host(a) - b)) / np.max(np.abs(b)))
    return errs


def time_race(n, heads=4, head_dim=128, causal=True, num_planes=3, num_tables=3, repeats=3, threads=None,
              path=None, dtype="float32"):
    """Forward+backward seconds (list) and peak pool bytes of racecpu.cuda at one size
    (``path``: :data:`racecpu.cuda.PATH` for these calls; None: as it is) and dtype of q, k, v
    and grad_out ("float32", "float16" or "bfloat16": :class:`racecpu.cuda.Bfloat16`)."""
    from ..cuda import race_attention_bwd, race_attention_fwd
    import racecpu.cuda as rc
    cp = _cupy()
    old, old_path = rc.THREADS, rc.PATH
    if threads:
        rc.THREADS = int(threads)
    if path:
        rc.PATH = path
    try:
        pool = cp.get_default_memory_pool() if cp is not None else None
        q, k, v, g = (_randn((heads, n, head_dim), dtype if dtype == "bfloat16" else np.dtype(dtype), s)
                      for s in range(4))
        if pool is not None:   # the inputs' float32 sources are not the call's
            pool.free_all_blocks()
        planes = racecpu.hyperplanes(head_dim, num_planes, num_tables)
        times = []
        for rep in range(repeats + 1):  # the first call compiles
            _sync()
            t0 = time.perf_counter()
            out, res = race_attention_fwd(q, k, v, planes, causal=causal, check_finite=False)
            grads = race_attention_bwd(res, g)
            _sync()
            if rep:
                times.append(time.perf_counter() - t0)
            del out, res, grads
        peak = int(pool.total_bytes()) if pool is not None else None
        return times, peak
    finally:
        rc.THREADS, rc.PATH = old, old_path


def time_sdpa(n, heads=4, head_dim=128, causal=True, repeats=3):
    """Forward+backward seconds and peak bytes of torch SDPA (bfloat16, flash) at one size."""
    import torch
    import torch.nn.functional as F
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, g = (torch.randn((1, heads, n, head_dim), device="cuda", dtype=torch.bfloat16, generator=gen)
                  for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    times = []
    ctx = getattr(torch.nn.attention, "sdpa_kernel", None)
    for rep in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if ctx is not None:
            with ctx(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out.backward(g)
        torch.cuda.synchronize()
        if rep:
            times.append(time.perf_counter() - t0)
        for t in (q, k, v):
            t.grad = None
        del out
    return times, int(torch.cuda.max_memory_allocated())


#: The authors' files that ``--authors`` needs, relative to their repository's root.
AUTHORS_FILES = ("scaling/race_causal_cuda.py", "scaling/race_common.py", "kernels/gpu/forward_kernel.cu",
                 "kernels/gpu/backward_kernels.cu", "kernels/gpu/race_cuda_binding.cpp",
                 "kernels/gpu/race_cuda_build.py")


def load_authors(repo):
    """The authors' module ``race_causal_cuda`` from their repository at ``repo`` (see the
    module docstring); FileNotFoundError naming what is missing.  Their code is imported as
    it is (it puts ``kernels/gpu`` on ``sys.path`` itself); nothing is built until a call."""
    import importlib
    import os
    repo = os.path.abspath(os.fspath(repo))
    missing = [f for f in AUTHORS_FILES if not os.path.isfile(os.path.join(repo, f))]
    if missing:
        raise FileNotFoundError(f"--authors {repo}: missing {', '.join(missing)} (a checkout of "
                                "github.com/sahiljoshi515/RACE_Attention has them)")
    scaling = os.path.join(repo, "scaling")
    if scaling not in sys.path:
        sys.path.insert(0, scaling)
    return importlib.import_module("race_causal_cuda")


def time_authors(module, n, heads=4, head_dim=128, num_planes=3, num_tables=3, repeats=3, device="cuda"):
    """Causal forward+backward seconds (list) and peak torch bytes of the authors' module
    (``module.RaceCausalCuda``, from :func:`load_authors`) at one size, float32, on
    racecpu's planes (their ``planes_T`` is ``planes.reshape(L * P, d).T``); the first call,
    which builds their kernels, is not timed."""
    import torch
    cuda = device.startswith("cuda")
    planes = racecpu.hyperplanes(head_dim, num_planes, num_tables)
    m = module.RaceCausalCuda(head_dim, num_planes, num_tables, 1, device=device, seed=0)
    with torch.no_grad():
        m.planes_T.copy_(torch.from_numpy(np.ascontiguousarray(planes.reshape(-1, head_dim).T)))
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, g = (torch.randn((1, heads, n, head_dim), device=device, dtype=torch.float32, generator=gen)
                  for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    times = []
    for rep in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        m(q, k, v).backward(g)
        if cuda:
            torch.cuda.synchronize()
        if rep:
            times.append(time.perf_counter() - t0)
        for t in (q, k, v):
            t.grad = None
    return times, int(torch.cuda.max_memory_allocated()) if cuda else None


def _torch_cuda():
    try:
        import torch
        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def run_benchmark(log2ns=(20, 21, 22, 23), heads=4, head_dim=128, causal=(False, True), threads=(None,),
                  repeats=3, sdpa=True, sdpa_max_log2n=18, check=True, progress=True, paths=(None,), authors=None,
                  authors_device="cuda", dtypes=("float32",), ns=None):
    """Benchmark rows (dicts) for every (N, causal, path, threads, dtype); see the module docstring.
    ``authors``: the module of :func:`load_authors`, timed at every causal N.  Each racecpu.cuda
    row has ``peak_over_arrays``: the pool's peak over the eight arrays' bytes at its dtype.
    ``ns``: token counts to run instead of ``2**log2ns``."""
    from tqdm import tqdm
    rows = []
    if check:
        for c in causal:
            errs = check_against_cpu(causal=c)
            rows.append(dict(impl="check-vs-cpu", causal=c, **errs))
    import racecpu.cuda as rc
    sizes = [int(n) for n in ns] if ns else [2 ** ln for ln in log2ns]
    jobs = [(n, c, pa, t, dt) for n in sizes for c in causal for pa in paths for t in threads for dt in dtypes]
    sdpa_ref = {}
    for n, c, pa, t, dt in tqdm(jobs, desc="racecpu.cuda bench", disable=not progress):
        ln = np.log2(n)
        row = dict(impl="race-cuda", n=n, heads=heads, head_dim=head_dim, causal=c, path=pa or rc.PATH,
                   threads=int(t or rc.THREADS), dtype=dt)
        eight = 8 * _itemsize(dt) * n * heads * head_dim
        try:
            times, peak = time_race(n, heads, head_dim, c, repeats=repeats, threads=t, path=pa, dtype=dt)
            med = float(np.median(times))
            row.update(median_ms=1e3 * med, best_ms=1e3 * min(times), peak_bytes=peak,
                       ns_per_token_head=1e9 * med / (n * heads), GBps=eight / med / 1e9)
            if peak:
                row.update(peak_over_arrays=peak / eight)
        except Exception as exc:  # out of memory and the like: say so and go on
            row.update(error=f"{type(exc).__name__}: {exc}"[:300])
        rows.append(row)
        if dt != dtypes[0]:
            continue
        if sdpa and t == threads[0] and pa == paths[0] and _torch_cuda():
            srow = dict(impl="sdpa-flash-bf16", n=n, heads=heads, head_dim=head_dim, causal=c, dtype="bfloat16")
            if ln <= sdpa_max_log2n:
                try:
                    times, peak = time_sdpa(n, heads, head_dim, c, repeats=repeats)
                    srow.update(median_ms=1e3 * float(np.median(times)), best_ms=1e3 * min(times), peak_bytes=peak)
                    sdpa_ref[c] = (n, float(np.median(times)))
                except Exception as exc:
                    srow.update(error=f"{type(exc).__name__}: {exc}"[:300])
            elif c in sdpa_ref:
                n0, t0 = sdpa_ref[c]
                srow.update(median_ms=1e3 * t0 * (n / n0) ** 2, extrapolated_from=n0)
            rows.append(srow)
        if authors is not None and c and t == threads[0] and pa == paths[0]:
            arow = dict(impl="authors-cuda", n=n, heads=heads, head_dim=head_dim, causal=True, dtype="float32")
            try:
                times, peak = time_authors(authors, n, heads, head_dim, repeats=repeats, device=authors_device)
                med = float(np.median(times))
                arow.update(median_ms=1e3 * med, best_ms=1e3 * min(times), peak_bytes=peak,
                            ns_per_token_head=1e9 * med / (n * heads), GBps=8 * 4 * n * heads * head_dim / med / 1e9)
            except Exception as exc:
                arow.update(error=f"{type(exc).__name__}: {exc}"[:300])
            rows.append(arow)
    theirs = {r["n"]: r["median_ms"] for r in rows if r["impl"] == "authors-cuda" and "median_ms" in r}
    for r in rows:  # the speed-up the issue asks for (>= 10x), beside each causal racecpu.cuda row
        if r["impl"] == "race-cuda" and r["causal"] and r["n"] in theirs and "median_ms" in r:
            r["x_authors"] = theirs[r["n"]] / r["median_ms"]
    return rows


def format_rows(rows):
    lines = []
    for r in rows:
        if r["impl"] == "check-vs-cpu":
            lines.append(f"check vs CPU (causal={r['causal']}): " +
                         ", ".join(f"{k} {r[k]:.1e}" for k in ("out", "dq", "dk", "dv")))
            continue
        ln = np.log2(r["n"])
        size = f"N=2^{int(ln):<3}" if ln == int(ln) else f"N={r['n']:<6}"
        head = f"{r['impl']:<16} {size} causal={str(r['causal']):<5} {r.get('dtype', ''):<8}"
        if "path" in r:
            head += f" {r['path']:<9}"
        if "threads" in r:
            head += f" T={r['threads']:<4}"
        if "error" in r:
            lines.append(f"{head} {r['error']}")
            continue
        extra = f" (extrapolated from N={r['extrapolated_from']})" if "extrapolated_from" in r else ""
        peak = f"  peak {r['peak_bytes'] / 2**30:.1f} GiB" if r.get("peak_bytes") else ""
        if "peak_over_arrays" in r:
            peak += f" ({r['peak_over_arrays']:.2f}x the eight arrays)"
        bw = f"  {r['GBps']:.0f} GB/s" if "GBps" in r else ""
        vs = f"  {r['x_authors']:.1f}x the authors' module" if "x_authors" in r else ""
        lines.append(f"{head} fwd+bwd {r['median_ms']:.1f} ms{extra}{bw}{peak}{vs}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m racecpu.apps.cuda_bench", description=__doc__.splitlines()[0])
    p.add_argument("--log2n", type=int, nargs="+", default=[20, 21, 22, 23])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--threads", type=int, nargs="+", default=[None], help="threads per block to sweep")
    p.add_argument("--path", nargs="+", default=[None], choices=("auto", "chunkwise", "tiles"),
                   help="racecpu.cuda.PATH: the formulations to run (default: as set)")
    p.add_argument("--n", type=int, nargs="+", help="token counts to run instead of --log2n's powers of two")
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=("float32", "float16", "bfloat16"),
                   help="dtypes of q, k, v and grad_out (bfloat16 as racecpu.cuda.Bfloat16 bits)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-sdpa", action="store_true")
    p.add_argument("--sdpa-max-log2n", type=int, default=18)
    p.add_argument("--authors", metavar="DIR",
                   help="the authors' repository (sahiljoshi515/RACE_Attention): time their causal module too")
    p.add_argument("--out", help="write the rows as JSON here")
    a = p.parse_args(argv)
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[a.causal]
    try:
        authors = None if a.authors is None else load_authors(a.authors)
    except FileNotFoundError as exc:
        p.error(str(exc))
    rows = run_benchmark(a.log2n, a.heads, a.head_dim, causal, tuple(a.threads), a.repeats, not a.no_sdpa,
                         a.sdpa_max_log2n, paths=tuple(a.path), authors=authors, dtypes=tuple(a.dtype), ns=a.n)
    print(format_rows(rows))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

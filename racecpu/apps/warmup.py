"""``racecpu warmup``: compile every kernel signature racecpu uses into the kernels' cache.

Run it once when building an image or after a read-only install (with
``NUMBA_CACHE_DIR`` pointing at a directory that will be writable, or the
package folder while it still is), so that no process later pays the
compilation.  It runs tiny calls: forward and backward, causal and not,
float32 and float64 (and float16 and bfloat16 inputs), with and without
residuals, key masks, grouped key/value heads, packed sequences, the planes'
gradient, ``soft_buckets`` and a ``RaceState`` step: every signature the NumPy
API, ``racecpu.torch``, ``racecpu.jax`` and ``racecpu.autograd`` call (inputs
reach the kernels read-only whatever their origin, so one signature serves all).
"""

from __future__ import annotations

import argparse
import os
import time

from ..cli import add_common_arguments


def add_arguments(p):
    from ..cli import positive_int

    add_common_arguments(p)
    p.add_argument("--jobs", type=positive_int, default=1,
                   help="processes that compile at once, each a share of the signatures (default 1)")
    p.add_argument("--part", type=int, default=0, help=argparse.SUPPRESS)  # one of --jobs' processes: steps
    p.add_argument("--parts", type=int, default=1, help=argparse.SUPPRESS)  # part, part + parts, ...


def _attention_calls(rng, W, dtype, causal):
    """Forward and backward at every path a call can take: tiny (one thread) and several
    chunks with a partial one and the scans' segments (1, 2, 3 heads), key masks, grouped
    key/value heads, packed sequences and the planes' gradient."""
    import numpy as np

    import racecpu

    for heads, n in ((2, 40), (1, 4101), (2, 4101), (3, 4101)):
        q, k, v, g = (rng.standard_normal((heads, n, 8)).astype(dtype) for _ in range(4))
        racecpu.race_attention(q, k, v, W, causal=causal)              # no residuals
        out, res = racecpu.race_attention_fwd(q, k, v, W, causal=causal)
        racecpu.race_attention_bwd(res, g)
        racecpu.race_attention_bwd(res, g, dplanes=True)
        racecpu.race_attention(q, k, v, W, causal=causal, key_mask=np.ones((heads, n), bool))
    q, g = (rng.standard_normal((4, 3000, 8)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((2, 3000, 8)).astype(dtype) for _ in range(2))
    out, res = racecpu.race_attention_fwd(q, k, v, W, causal=causal)                # grouped-query
    racecpu.race_attention_bwd(res, g)
    cu = np.array([0, 1000, 1100, 3000], np.int32)
    out, res = racecpu.race_attention_fwd(q, q, g, W, causal=causal, cu_seqlens=cu)  # packed sequences
    racecpu.race_attention_bwd(res, g)
    if dtype == np.float32:  # 16-bit inputs (torch's bfloat16 and half): float32 kernels, the conversions
        from .._arrays import bfloat16
        for half in (np.float16, bfloat16()):
            if half is not None:
                qh, gh = (rng.standard_normal((2, 300, 8)).astype(half) for _ in range(2))
                out, res = racecpu.race_attention_fwd(qh, qh, qh, W, causal=causal)
                racecpu.race_attention_bwd(res, gh, dplanes=True)


def _state_calls(rng, W, dtype):
    import racecpu

    q, k, v = (rng.standard_normal((2, 40, 8)).astype(dtype) for _ in range(3))
    racecpu.soft_buckets(q, W)
    state = racecpu.RaceState(W, racecpu.DEFAULT_BETA, batch_shape=(2,), dv=8, dtype=dtype)
    state.extend(q[:, :10], k[:, :10], v[:, :10])
    state.step(q[:, 10], k[:, 10], v[:, 10])


def warmup(progress=None, part=0, parts=1):
    """Compile (or load) every kernel signature with tiny calls; returns seconds per step as a dict.

    ``part``, ``parts``: run only steps ``part, part + parts, ...`` (of six:
    float32 and float64, each causal, non-causal, and ``soft_buckets`` with a
    ``RaceState`` step), so that ``parts`` processes warm one cache together.
    """
    import numpy as np

    import racecpu

    if not (isinstance(parts, int) and parts >= 1 and isinstance(part, int) and 0 <= part < parts):
        raise ValueError(f"need 0 <= part < parts, got part={part!r}, parts={parts!r}")
    steps = []  # (name, dtype, what); the costliest (causal) first so that parts share them
    for what in ("causal", "non-causal", "soft_buckets, RaceState"):
        for dtype in (np.float32, np.float64):
            steps.append((f"{np.dtype(dtype).name} {what}", dtype, what))
    times = {}
    for name, dtype, what in steps[part::parts]:
        rng = np.random.default_rng(0)
        W = racecpu.hyperplanes(8, 3, 2, seed=0, dtype=dtype)
        t0 = time.perf_counter()
        if what == "soft_buckets, RaceState":
            _state_calls(rng, W, dtype)
        else:
            _attention_calls(rng, W, dtype, what == "causal")
        times[name] = time.perf_counter() - t0
        if progress:
            progress(name, times[name])
    return times


def _in_processes(jobs, path):
    """Run the warm-up's steps in ``jobs`` processes at once (one share each); their seconds per step."""
    import json
    import subprocess
    import sys

    from ..cli import UsageError

    if path is None or path != _shared():
        raise UsageError("--jobs needs a kernel cache every process shares (set NUMBA_CACHE_DIR to a writable "
                         "directory)")
    import racecpu

    # run from the folder that holds this racecpu, so that the children import it and not
    # another copy from the current directory (python -m puts that first on sys.path)
    here = os.path.dirname(os.path.dirname(os.path.abspath(racecpu.__file__)))
    procs = [subprocess.Popen([sys.executable, "-m", "racecpu", "warmup", "--part", str(i), "--parts", str(jobs),
                               "--json", "--quiet"], stdout=subprocess.PIPE, text=True, cwd=here)
             for i in range(jobs)]
    times = {}
    for p in procs:
        out, _ = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"a warm-up process failed (exit status {p.returncode})")
        times.update(json.loads(out)["seconds"])
    for name, s in times.items():
        print(f"  {name:38} {s:7.2f} s", flush=True)
    return times


def _shared():
    from .._kernels._jit import shared_cache_dir
    return shared_cache_dir()


def run(args):
    from .._kernels._jit import cache_dir

    path = cache_dir()
    print(f"kernel cache: {path or 'none: nothing will be kept (set NUMBA_CACHE_DIR to a writable directory)'}")
    t0 = time.perf_counter()
    if args.jobs > 1:
        times = _in_processes(args.jobs, path)
    else:
        times = warmup(progress=lambda name, s: print(f"  {name:38} {s:7.2f} s", flush=True), part=args.part,
                       parts=args.parts)
    total = time.perf_counter() - t0
    print(f"done in {total:.1f} s")
    args.result = dict(kernel_cache_dir=path, seconds=times, seconds_total=total)
    return 0

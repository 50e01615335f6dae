"""``racecpu warmup``: compile every kernel signature racecpu uses into the kernels' cache.

Run it once when building an image or after a read-only install (with
``NUMBA_CACHE_DIR`` pointing at a directory that will be writable, or the
package folder while it still is), so that no process later pays the
compilation.  It runs tiny calls: forward and backward, causal and not,
float32 and float64, with and without residuals, ``soft_buckets`` and a
``RaceState`` step.
"""

from __future__ import annotations

import time

from ..cli import add_common_arguments


def add_arguments(p):
    add_common_arguments(p)


def warmup(progress=None):
    """Compile (or load) every kernel signature with tiny calls; returns seconds per step as a dict."""
    import numpy as np

    import racecpu

    times = {}
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        W = racecpu.hyperplanes(8, 3, 2, seed=0, dtype=dtype)
        for causal in (False, True):
            name = f"{np.dtype(dtype).name} {'causal' if causal else 'non-causal'}"
            t0 = time.perf_counter()
            # 40 tokens run on one thread; 4101 tokens x 1, 2 and 3 heads take several chunks, a
            # partial one and the scans' segments: every code path of a large call
            for heads, n in ((2, 40), (1, 4101), (2, 4101), (3, 4101)):
                q, k, v, g = (rng.standard_normal((heads, n, 8)).astype(dtype) for _ in range(4))
                racecpu.race_attention(q, k, v, W, causal=causal)              # no residuals
                out, res = racecpu.race_attention_fwd(q, k, v, W, causal=causal)
                racecpu.race_attention_bwd(res, g)
                racecpu.race_attention(q, k, v, W, causal=causal, key_mask=np.ones((heads, n), bool))
            times[name] = time.perf_counter() - t0
            if progress:
                progress(name, times[name])
        t0 = time.perf_counter()
        q, k, v = (rng.standard_normal((2, 40, 8)).astype(dtype) for _ in range(3))
        racecpu.soft_buckets(q, W)
        state = racecpu.RaceState(W, racecpu.DEFAULT_BETA, batch_shape=(2,), dv=8, dtype=dtype)
        state.extend(q[:, :10], k[:, :10], v[:, :10])
        state.step(q[:, 10], k[:, 10], v[:, 10])
        name = f"{np.dtype(dtype).name} soft_buckets, RaceState"
        times[name] = time.perf_counter() - t0
        if progress:
            progress(name, times[name])
    return times


def run(args):
    from .._kernels._jit import cache_dir

    path = cache_dir()
    print(f"kernel cache: {path or 'none: nothing will be kept (set NUMBA_CACHE_DIR to a writable directory)'}")
    t0 = time.perf_counter()
    times = warmup(progress=lambda name, s: print(f"  {name:38} {s:7.2f} s", flush=True))
    total = time.perf_counter() - t0
    print(f"done in {total:.1f} s")
    args.result = dict(kernel_cache_dir=path, seconds=times, seconds_total=total)
    return 0

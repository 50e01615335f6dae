"""racecpu.torch on bfloat16 CUDA tensors: its two crossings to racecpu.cuda side by side (issue 55).

On a GPU, a forward+backward of ``(1, H, N, d)`` bfloat16 tensors (q, k, v requiring grad) with
``racecpu.torch.CUDA_BFLOAT16`` "float32" (whole float32 copies, the default) and "bits"
(``racecpu.cuda.Bfloat16``: widened a segment at a time, results in bfloat16): the median time
of ``--reps`` calls after a warm-up, torch's peak allocated bytes and CuPy's pool bytes (racecpu's
temporaries), each over the eight bfloat16 arrays, and the largest difference between the two
crossings' out, dq, dk, dv (both compute in float32 from the same exact values; the rounding to
bfloat16 is torch's in one and racecpu's in the other, both to nearest even)::

    python benchmarks/torch_cuda_bf16.py --log2n 20 --heads 4 --dim 128 --causal --out bf16.json

It needs CUDA tensors: no simulator runs it (racecpu.cuda's own side of "bits" is tested there).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def run(log2n, heads, dim, causal, reps):
    import cupy as cp
    import torch

    import racecpu
    import racecpu.torch as rt
    n = 2 ** log2n
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = [torch.randn((1, heads, n, dim), device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4)]
    planes = torch.from_numpy(racecpu.hyperplanes(dim, 3, 3, seed=0)).cuda()
    eight = 8 * base[0].numel() * 2
    pool = cp.get_default_memory_pool()
    rows, results = [], {}
    for mode in ("float32", "bits"):
        rt.CUDA_BFLOAT16 = mode
        times = []
        for rep in range(reps + 1):
            q, k, v = (x.clone().requires_grad_() for x in base[:3])
            pool.free_all_blocks()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            out = rt.race_attention(q, k, v, planes, 8.0, causal=causal)
            out.backward(base[3])
            torch.cuda.synchronize()
            if rep:
                times.append(time.perf_counter() - t0)
        results[mode] = [out.detach().float()] + [x.grad.float() for x in (q, k, v)]
        rows.append(dict(mode=mode, n=n, heads=heads, dim=dim, causal=causal, median_ms=1e3 * float(np.median(times)),
                         torch_peak_over_arrays=torch.cuda.max_memory_allocated() / eight,
                         cupy_pool_over_arrays=pool.total_bytes() / eight))
        del out, q, k, v
    rt.CUDA_BFLOAT16 = "float32"
    diffs = {}
    for name, a, b in zip(("out", "dq", "dk", "dv"), results["float32"], results["bits"]):
        diffs[name] = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
    rows.append(dict(mode="float32 against bits", max_rel_diff=diffs))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log2n", type=int, default=20)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    rows = run(a.log2n, a.heads, a.dim, a.causal, a.reps)
    for r in rows:
        print(r)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

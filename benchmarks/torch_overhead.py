"""racecpu.torch's op against the NumPy API: forward+backward time, same inputs, alternating calls.

    python benchmarks/torch_overhead.py [--tokens 65536] [--heads 4] [--dim 128] [--reps 5] [--causal]

Prints the median ns per token-head of: the NumPy API (race_attention_fwd +
race_attention_bwd), the torch op (forward + backward through autograd) in
float32, and the torch op in bfloat16 (computed in float32, converted both ways).
"""

import argparse
import time

import numpy as np
import torch

import racecpu
import racecpu.torch as rt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--causal", action="store_true")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    shape = (1, a.heads, a.tokens, a.dim)
    q, k, v, go = (torch.randn(shape, generator=g) for _ in range(4))
    planes = racecpu.hyperplanes(a.dim, 3, 3, seed=0)
    planes_t = torch.from_numpy(planes)

    def numpy_api():
        out, res = racecpu.race_attention_fwd(q.numpy(), k.numpy(), v.numpy(), planes, 8.0, causal=a.causal)
        racecpu.race_attention_bwd(res, go.numpy())

    def make_torch(dtype):
        qq, kk, vv = (x.to(dtype, copy=True).requires_grad_() for x in (q, k, v))
        gg = go.to(dtype)

        def run():
            for x in (qq, kk, vv):
                x.grad = None
            rt.race_attention(qq, kk, vv, planes_t, 8.0, causal=a.causal).backward(gg)
        return run

    fns = {"numpy api": numpy_api, "torch float32": make_torch(torch.float32),
           "torch bfloat16": make_torch(torch.bfloat16)}
    for f in fns.values():
        f()  # compile and warm the pool
    times = {name: [] for name in fns}
    for _ in range(a.reps):
        for name, f in fns.items():
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    scale = 1e9 / (a.tokens * a.heads)
    base = np.median(times["numpy api"])
    for name, ts in times.items():
        m = np.median(ts)
        print(f"{name:15s} {m * scale:8.1f} ns per token-head  ({m / base:.3f}x the NumPy API)")


if __name__ == "__main__":
    main()

"""What 16-bit inputs cost against float32: forward+backward through the NumPy API.

    python benchmarks/half.py [--tokens 1048576] [--heads 4] [--dim 64] [--reps 5] [--causal]

Times ``race_attention_fwd`` + ``race_attention_bwd`` with q, k, v and grad_out in
float32, bfloat16 (ml_dtypes) and float16 (the same values), alternating the dtypes each
round so that drift in the machine's load hits all alike, and prints the median ns per
token-head of each, its ratio to float32, and the part spent converting (the same
widening/narrowing calls timed alone: 4 inputs widened, 4 results narrowed).  Then, in
a fresh process per dtype (``--peak DTYPE``), one forward+backward's peak resident memory
above the inputs.  The pool is released between dtypes.
"""

import argparse
import json
import subprocess
import sys
import time

import numba
import numpy as np

import racecpu
from racecpu._checks import narrowed, widened
from racecpu._memory import peak_rss, proc_status, reset_peak_rss

DTYPES = ("float32", "bfloat16", "float16")


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _inputs(a, dt):
    rng = np.random.default_rng(0)
    shape = (1, a.heads, a.tokens, a.dim)
    return [rng.standard_normal(shape, dtype=np.float32).astype(dt) for _ in range(4)]


def _step(x, W, causal):
    y, res = racecpu.race_attention_fwd(x[0], x[1], x[2], W, 8.0, causal=causal)
    grads = racecpu.race_attention_bwd(res, x[3])
    return y, grads


def peak(a, name):
    """Two forward+backward calls in this process; prints the peak RSS above the inputs (JSON)."""
    W = racecpu.hyperplanes(a.dim, 3, 3, seed=0)
    x = _inputs(a, _dtype(name))
    base = proc_status("VmRSS")
    reset_peak_rss()
    for _ in range(2):  # the second reuses the pool's memory, as a training loop does
        _step(x, W, a.causal)
    print(json.dumps({"dtype": name, "peak_above_inputs": peak_rss() - base,
                      "inputs": sum(t.nbytes for t in x)}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--peak", choices=DTYPES)
    a = ap.parse_args()
    if a.peak:
        return peak(a, a.peak)
    th = a.tokens * a.heads
    W = racecpu.hyperplanes(a.dim, 3, 3, seed=0)
    data = {name: _inputs(a, _dtype(name)) for name in DTYPES}
    times = {name: [] for name in DTYPES}
    conv = {name: [] for name in DTYPES[1:]}
    for name in DTYPES:
        _step(data[name], W, a.causal)  # compile and warm the pool
    print(f"forward+backward, {'causal' if a.causal else 'non-causal'}, {a.tokens} tokens x {a.heads} heads, "
          f"d = {a.dim}, P = L = 3, {numba.get_num_threads()} threads; median of {a.reps} alternating rounds", flush=True)
    for _ in range(a.reps):
        for name in DTYPES:
            t0 = time.perf_counter()
            _step(data[name], W, a.causal)
            times[name].append(time.perf_counter() - t0)
        for name in DTYPES[1:]:  # the conversions alone: 4 widened (q, k, v, grad_out), 4 narrowed (out, dq, dk, dv)
            x = data[name]
            t0 = time.perf_counter()
            wide = [widened(t, np.dtype(np.float32)) for t in x]
            for w in wide:
                narrowed(w, x[0].dtype)
            conv[name].append(time.perf_counter() - t0)
            del wide
    base = np.median(times["float32"])
    rows = []
    for name in DTYPES:
        t = np.median(times[name])
        c = np.median(conv[name]) if name in conv else 0.0
        rows.append((name, t, c))
        print(f"{name:>9}: {t / th * 1e9:7.1f} ns per token-head, {t / base:5.3f}x float32"
              + (f"; converting alone {c / th * 1e9:5.1f} ns ({c / t:.0%})" if c else ""), flush=True)
    del data
    racecpu.release_memory()
    for name in DTYPES:
        cmd = [sys.executable, __file__, "--peak", name, "--tokens", str(a.tokens), "--heads", str(a.heads),
               "--dim", str(a.dim)] + (["--causal"] if a.causal else [])
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        print(f"{name:>9}: peak {r['peak_above_inputs'] / 2**30:5.2f} GiB above its inputs "
              f"({r['inputs'] / 2**30:.2f} GiB)", flush=True)


if __name__ == "__main__":
    main()

"""Grouped-query attention against repeating k and v: forward+backward time, same inputs.

    python benchmarks/gqa.py [--tokens 65536] [--q-heads 32] [--kv-heads 8] [--dim 128] [--reps 3]

One process; for each mode (non-causal, causal) one warm-up call of each, then
``reps`` alternating rounds of: the grouped call (k, v with ``kv-heads`` heads);
the repeated call (k, v repeated to ``q-heads`` heads beforehand, the repeat not
timed, the gradients of the repeated heads not summed back); and the same by
hand (``np.repeat`` of k and v, the call, and dk, dv summed back over each group
with NumPy, all timed).  Prints the median seconds of each, ns per query
token-head, and the grouped call's ratio to the other two; float32.
"""

import argparse
import numba
import numpy as np

import racecpu
from alternating import alternate, rounds_text  # benchmarks/alternating.py


def _fwd_bwd(q, k, v, g, W, causal):
    _, res = racecpu.race_attention_fwd(q, k, v, W, 8.0, causal=causal)
    racecpu.race_attention_bwd(res, g)


def _by_hand(q, k, v, g, W, causal, group):
    kr, vr = (np.repeat(x, group, axis=1) for x in (k, v))
    _, res = racecpu.race_attention_fwd(q, kr, vr, W, 8.0, causal=causal)
    _, dk, dv, _ = racecpu.race_attention_bwd(res, g)
    return [x.reshape(x.shape[:1] + (x.shape[1] // group, group) + x.shape[2:]).sum(2) for x in (dk, dv)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    group = a.q_heads // a.kv_heads
    rng = np.random.default_rng(0)
    q, g = (rng.standard_normal((1, a.q_heads, a.tokens, a.dim), dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, a.kv_heads, a.tokens, a.dim), dtype=np.float32) for _ in range(2))
    kr, vr = (np.repeat(x, group, axis=1) for x in (k, v))
    W = racecpu.hyperplanes(a.dim, 3, 3, seed=0, dtype=np.float32)
    th = a.tokens * a.q_heads
    print(f"forward+backward, {a.tokens} tokens, {a.q_heads} query heads over {a.kv_heads} key/value heads, "
          f"d = {a.dim}, P = L = 3, float32, {numba.get_num_threads()} threads; median of {a.reps} alternating rounds")
    for causal in (False, True):
        calls = {"grouped": lambda: _fwd_bwd(q, k, v, g, W, causal),
                 "repeated": lambda: _fwd_bwd(q, kr, vr, g, W, causal),
                 "by hand": lambda: _by_hand(q, k, v, g, W, causal, group)}
        times, med = alternate(calls, a.reps)
        print(f"{'causal' if causal else 'non-causal':>10}: " + ", ".join(
            f"{n} {med[n]:.3f} s ({med[n] / th * 1e9:.0f} ns per token-head)" for n in calls)
            + f"; grouped / repeated {med['grouped'] / med['repeated']:.3f}, grouped / by hand "
              f"{med['grouped'] / med['by hand']:.3f}  ("
            + rounds_text(times) + ")", flush=True)


if __name__ == "__main__":
    main()

"""Packed sequences against one sequence of the same total length: forward+backward time, same inputs.

    python benchmarks/packed.py [--tokens 65536] [--sequences 64] [--heads 4] [--dim 128] [--reps 5]

One process; for each mode (non-causal, causal) one warm-up call of each, then
``reps`` alternating rounds of: one sequence of ``tokens`` tokens; the same
tokens as ``sequences`` packed sequences of equal length (``cu_seqlens``);
and as ``sequences`` of random lengths (uniform over 1 .. twice the mean,
summing to ``tokens``: a sequence's last chunk is shorter, so there are up to
``sequences`` more chunks).  Prints the median seconds of each, ns per
token-head, and each packed call's ratio to the one sequence; float32.
"""

import argparse
import numba
import numpy as np

import racecpu
from alternating import alternate, rounds_text  # benchmarks/alternating.py
from racecpu.packing import packed_chunks
from racecpu.plan import cpu_chunk_model


def _fwd_bwd(q, k, v, g, W, causal, cu):
    _, res = racecpu.race_attention_fwd(q, k, v, W, 8.0, causal=causal, cu_seqlens=cu)
    racecpu.race_attention_bwd(res, g)


def random_offsets(rng, tokens, sequences):
    """``sequences`` lengths >= 1, uniform over 1 .. 2 * mean - 1, adjusted to sum to ``tokens``."""
    mean = tokens // sequences
    lengths = rng.integers(1, 2 * mean, sequences)
    lengths = np.maximum(1, np.round(lengths * tokens / lengths.sum())).astype(np.int64)
    lengths[-1] += tokens - lengths.sum()
    assert lengths.min() >= 1 and lengths.sum() == tokens
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((1, a.heads, a.tokens, a.dim), dtype=np.float32) for _ in range(4))
    W = racecpu.hyperplanes(a.dim, 3, 3, seed=0, dtype=np.float32)
    equal = np.linspace(0, a.tokens, a.sequences + 1).round().astype(np.int32)
    ragged = random_offsets(rng, a.tokens, a.sequences)
    chunk = cpu_chunk_model().length(a.tokens, a.heads, 24, a.dim)
    pe, pr = packed_chunks(equal, a.tokens, chunk), packed_chunks(ragged, a.tokens, chunk)
    th = a.tokens * a.heads
    print(f"forward+backward, {a.tokens} tokens x {a.heads} heads, d = {a.dim}, P = L = 3, float32, "
          f"{numba.get_num_threads()} threads; median of {a.reps} alternating rounds")
    print(f"chunks of {chunk} tokens: one sequence {-(-a.tokens // chunk)}; equal: {a.sequences} x "
          f"{a.tokens // a.sequences} tokens, {pe.chunks.seq.size} chunks; random: lengths "
          f"{np.diff(ragged).min()} .. {np.diff(ragged).max()}, {pr.chunks.seq.size} chunks")
    for causal in (False, True):
        calls = {"one sequence": lambda: _fwd_bwd(q, k, v, g, W, causal, None),
                 "packed, equal": lambda: _fwd_bwd(q, k, v, g, W, causal, equal),
                 "packed, random": lambda: _fwd_bwd(q, k, v, g, W, causal, ragged)}
        times, med = alternate(calls, a.reps)
        one = med["one sequence"]
        print(f"{'causal' if causal else 'non-causal':>10}: " + ", ".join(
            f"{n} {med[n]:.3f} s ({med[n] / th * 1e9:.0f} ns per token-head)" for n in calls)
            + "; " + ", ".join(f"{n} / one {med[n] / one:.3f}" for n in list(calls)[1:]) + "  ("
            + rounds_text(times) + ")", flush=True)


if __name__ == "__main__":
    main()

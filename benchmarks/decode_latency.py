"""Decode latency: RACE streaming state vs softmax attention with a KV cache.

For each context length c (1K ... 1M tokens) this times one decode step --
append one token's (q, k, v) and read its attention output -- for

* RACE: :class:`racecpu.streaming.RaceState.step`; the state holds
  ``L * 2**P * (dv + 1)`` float64 numbers per head whatever c is;
* softmax attention with a preallocated KV cache (NumPy, float32): write
  ``k, v`` at position c, then ``softmax(K[:c+1] q / sqrt(d)) V[:c+1]``,
  which reads all c cached keys and values.

The RACE states are filled with one pass of ``extend`` over random tokens (in
blocks) and snapshotted at every context; the KV cache is preallocated and
filled with random keys/values.  Timing is round-robin over contexts (so load
drift on a shared machine hits all of them alike), every step timed on its
own, and the median over all repeats reported, with the 25-75 % range.
Everything runs single-threaded (NUMBA/OMP/OPENBLAS/MKL threads = 1) unless
those variables are set.

Usage::

    python benchmarks/decode_latency.py [--heads 1 4] [--max-log2 20] [--rounds 5]

Writes ``benchmarks/results/decode_latency.{json,md,png}``.
"""

from __future__ import annotations

import os

for _var in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import racecpu  # noqa: E402
from racecpu.streaming import RaceState  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def fill_race_states(contexts, heads, d, P, L, beta, seed, block=1 << 15):
    """One extend pass over random tokens; a copy of the state at every context."""
    rng = np.random.default_rng(seed)
    planes = racecpu.hyperplanes(d, P, L, seed=seed)
    state = RaceState(planes, beta, batch_shape=(heads,), dv=d)
    snaps = {}
    for c in sorted(contexts):
        while state.count < c:
            n = min(block, c - state.count)
            q, k, v = (rng.standard_normal((heads, n, d), dtype=np.float32) for _ in range(3))
            state.extend(q, k, v, check_finite=False)
        snaps[c] = state.copy()
    return snaps


class KVCache:
    """Softmax attention decode step over a preallocated float32 KV cache (one head at a time)."""

    def __init__(self, capacity, heads, d, seed):
        rng = np.random.default_rng(seed)
        self.K = np.empty((heads, capacity, d), np.float32)
        self.V = np.empty((heads, capacity, d), np.float32)
        for h in range(heads):  # fill in slices to keep temporaries small
            for lo in range(0, capacity, 1 << 16):
                hi = min(lo + (1 << 16), capacity)
                self.K[h, lo:hi] = rng.standard_normal((hi - lo, d), dtype=np.float32)
                self.V[h, lo:hi] = rng.standard_normal((hi - lo, d), dtype=np.float32)
        self.scale = np.float32(1.0 / np.sqrt(d))

    def step(self, pos, q, k, v):
        out = np.empty_like(q)
        for h in range(q.shape[0]):
            self.K[h, pos] = k[h]
            self.V[h, pos] = v[h]
            s = self.K[h, :pos + 1] @ (q[h] * self.scale)
            s -= s.max()
            np.exp(s, out=s)
            out[h] = (s @ self.V[h, :pos + 1]) / s.sum()
        return out


def time_steps(fn, reps):
    ts = np.empty(reps)
    for i in range(reps):
        t0 = time.perf_counter()
        fn()
        ts[i] = time.perf_counter() - t0
    return ts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[1, 4], help="head counts for RACE (default 1 4)")
    ap.add_argument("--kv-heads", type=int, default=1, help="heads for the KV-cache baseline (default 1)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--planes", type=int, default=3)
    ap.add_argument("--tables", type=int, default=3)
    ap.add_argument("--beta", type=float, default=racecpu.DEFAULT_BETA)
    ap.add_argument("--min-log2", type=int, default=10)
    ap.add_argument("--max-log2", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5, help="round-robin rounds over contexts")
    ap.add_argument("--race-reps", type=int, default=200, help="RACE steps per context per round")
    ap.add_argument("--kv-seconds", type=float, default=0.4, help="KV-cache time budget per context per round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "decode_latency")
    args = ap.parse_args(argv)

    d = args.dim
    contexts = [2 ** e for e in range(args.min_log2, args.max_log2 + 1)]
    rng = np.random.default_rng(args.seed + 1)
    print(f"contexts {contexts[0]} .. {contexts[-1]}, d = dv = {d}, P = {args.planes}, L = {args.tables}")

    states = {}
    for H in args.heads:
        t0 = time.perf_counter()
        states[H] = fill_race_states(contexts, H, d, args.planes, args.tables, args.beta, args.seed)
        print(f"filled RACE states, {H} head(s): {time.perf_counter() - t0:.1f} s; "
              f"state {states[H][contexts[0]].nbytes / H / 1024:.1f} KiB per head at every context")
    Hk = args.kv_heads
    t0 = time.perf_counter()
    cache = KVCache(contexts[-1] + 1, Hk, d, args.seed)
    print(f"filled KV cache: {Hk} head(s) x {contexts[-1]} tokens = {(cache.K.nbytes + cache.V.nbytes) / 2 ** 30:.2f} GiB "
          f"in {time.perf_counter() - t0:.1f} s")

    race = {H: {c: [] for c in contexts} for H in args.heads}
    kv = {c: [] for c in contexts}
    for H in args.heads:  # warm-up (JIT compile, caches)
        s = states[H][contexts[0]].copy()
        x = rng.standard_normal((3, H, d), dtype=np.float32)
        for _ in range(20):
            s.step(x[0], x[1], x[2])
    for r in range(args.rounds):
        for c in contexts:
            for H in args.heads:
                s = states[H][c].copy()  # each round restarts from the context-c state
                x = rng.standard_normal((3, H, d), dtype=np.float32)
                race[H][c].extend(time_steps(lambda: s.step(x[0], x[1], x[2]), args.race_reps) / H)
            x = rng.standard_normal((3, Hk, d), dtype=np.float32)
            first = time_steps(lambda: cache.step(c, x[0], x[1], x[2]), 1)[0]
            reps = int(np.clip(args.kv_seconds / max(first, 1e-9), 3, 200))
            kv[c].extend(time_steps(lambda: cache.step(c, x[0], x[1], x[2]), reps) / Hk)
        print(f"round {r + 1}/{args.rounds} done")

    def summary(ts):
        a = np.asarray(ts) * 1e6
        return dict(median_us=float(np.median(a)), p25_us=float(np.percentile(a, 25)),
                    p75_us=float(np.percentile(a, 75)), n=int(a.size))

    rows = []
    for c in contexts:
        row = dict(context=c, kv_cache=summary(kv[c]))
        for H in args.heads:
            row[f"race_h{H}"] = summary(race[H][c])
        rows.append(row)
    flat = {H: max(r[f"race_h{H}"]["median_us"] for r in rows) / min(r[f"race_h{H}"]["median_us"] for r in rows)
            for H in args.heads}
    kv_growth = rows[-1]["kv_cache"]["median_us"] / rows[0]["kv_cache"]["median_us"]
    result = dict(
        what="decode step latency, microseconds per token per head (median over all timed steps)",
        config=dict(dim=d, dv=d, planes=args.planes, tables=args.tables, beta=args.beta, heads=args.heads,
                    kv_heads=Hk, rounds=args.rounds, race_reps_per_round=args.race_reps, dtype="float32",
                    threads={v: os.environ[v] for v in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS",
                                                         "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}),
        machine=dict(platform=platform.platform(), processor=platform.processor(), cpus=os.cpu_count(),
                     numpy=np.__version__, racecpu=racecpu.__version__),
        rows=rows, race_max_over_min={str(H): v for H, v in flat.items()}, kv_last_over_first=kv_growth,
        race_flat_within_1_2={str(H): bool(v <= 1.2) for H, v in flat.items()},
        time=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))

    head = "| context | " + " | ".join(f"RACE, {H} head{'s' * (H > 1)} (us)" for H in args.heads) + \
           f" | softmax + KV cache, {Hk} head{'s' * (Hk > 1)} (us) | KV / RACE({args.heads[0]}) |"
    lines = [f"Decode step latency, us per token per head (median of {args.rounds} rounds; "
             f"d = dv = {d}, P = {args.planes}, L = {args.tables}, float32, 1 thread)", "", head,
             "|" + "---|" * (3 + len(args.heads))]
    for r in rows:
        c = r["context"]
        label = f"{c // 2 ** 20}M" if c >= 2 ** 20 else f"{c // 1024}K"
        cells = [f"{r[f'race_h{H}']['median_us']:.1f}" for H in args.heads]
        ratio = r["kv_cache"]["median_us"] / r[f"race_h{args.heads[0]}"]["median_us"]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {r['kv_cache']['median_us']:.1f} | {ratio:.1f}x |")
    lines += ["", "RACE max/min over contexts: " + ", ".join(f"{H} head(s) {v:.3f}" for H, v in flat.items()) +
              f" (flat if <= 1.2); KV cache {contexts[-1]}/{contexts[0]} tokens: {kv_growth:.0f}x"]
    table = "\n".join(lines)
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for H in args.heads:
        ax.errorbar(contexts, [r[f"race_h{H}"]["median_us"] for r in rows],
                    yerr=[[r[f"race_h{H}"]["median_us"] - r[f"race_h{H}"]["p25_us"] for r in rows],
                          [r[f"race_h{H}"]["p75_us"] - r[f"race_h{H}"]["median_us"] for r in rows]],
                    marker="o", capsize=2, label=f"RACE state, {H} head{'s' * (H > 1)}")
    ax.errorbar(contexts, [r["kv_cache"]["median_us"] for r in rows],
                yerr=[[r["kv_cache"]["median_us"] - r["kv_cache"]["p25_us"] for r in rows],
                      [r["kv_cache"]["p75_us"] - r["kv_cache"]["median_us"] for r in rows]],
                marker="s", capsize=2, label=f"softmax + KV cache, {Hk} head{'s' * (Hk > 1)}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode step, us per token per head")
    ax.set_title(f"Decode latency (d = {d}, P = {args.planes}, L = {args.tables}, 1 thread)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print(f"wrote {args.out.with_suffix('.json')}, .md, .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

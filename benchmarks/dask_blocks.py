"""One causal block as racecpu.dask's tasks compute it, against the whole call, on one thread.

Usage::

    python benchmarks/dask_blocks.py [--log2n 18] [--dim 128] [--rounds 7]

ns per token (one head, float32, P = L = 3, medians over rounds after a warm-up), one thread
(a Dask worker's): the whole call's causal forward and backward (``engine.forward`` and
``engine.backward``), a block's keys' pass and forward (``engine.advance_keys``, then
``engine.advance(keys=)``), its backward from the kept rows (``engine.advance_bwd(step=)``) and
recomputing them, and the seconds to save and load a block's rows (``BlockForward.save`` /
``load``, what ``racecpu.dask``'s ``rows_dir`` does).  docs/distributed.md quotes it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np


def median_ns(f, n, rounds):
    ts = []
    for _ in range(rounds + 1):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[1:]) / n * 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log2n", type=int, default=18)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)

    import numba

    import racecpu
    from racecpu import engine
    from racecpu import sketches as S
    numba.set_num_threads(1)
    n, d = 2 ** a.log2n, a.dim
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((1, n, d), dtype=np.float32) for _ in range(4))
    W = racecpu.hyperplanes(d, 3, 3, seed=0, dtype=np.float32)
    A0, B0 = np.zeros((1, 24)), np.zeros((1, 24, d))
    out = np.empty((1, n, d), np.float32)

    def block_fwd():
        keys = engine.advance_keys(k, v, W, 8.0, 1)
        return engine.advance(q, k, v, W, 8.0, A0, B0, out, keys=keys)

    step = block_fwd()
    _, res = engine.forward(q, k, v, W, 8.0, causal=True)
    rows = {
        "whole call: forward": lambda: engine.forward(q, k, v, W, 8.0, causal=True),
        "block: keys' pass": lambda: engine.advance_keys(k, v, W, 8.0, 1),
        "block: keys' pass + forward": block_fwd,
        "whole call: backward": lambda: engine.backward(res, g),
        "block: backward, kept rows": lambda: engine.advance_bwd(q, k, v, g, W, 8.0, A0, B0, A0, B0, step=step),
        "block: backward, recomputing": lambda: engine.advance_bwd(q, k, v, g, W, 8.0, A0, B0, A0, B0),
    }
    print(f"ns per token, 1 head x 2^{a.log2n} tokens, d={d}, float32, 1 thread, median of {a.rounds}")
    for name, f in rows.items():
        print(f"{name:32}{median_ns(f, n, a.rounds):9.0f}")
    _, _, fw = S.causal_block(q, k, v, W, 8.0, None, keep=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.npz")
        save = median_ns(lambda: fw.save(path), 1, a.rounds) * 1e-9
        load = median_ns(lambda: S.BlockForward.load(path), 1, a.rounds) * 1e-9
        size = os.path.getsize(path)
    print(f"rows of the block: {size / 2 ** 20:.0f} MiB ({size / n:.0f} bytes per token); save {save:.3f} s, "
          f"load {load:.3f} s")


if __name__ == "__main__":
    main()

"""racecpu.dask on this machine: 1 vs 2 worker processes, against the in-memory call, and the scheduler's overhead.

Usage::

    python benchmarks/dask_scaling.py [--log2n 22] [--heads 4] [--dim 128] [--log2-block 18]
                                      [--overhead-blocks 14,16,18,20] [--rounds 2] [--memory-log2n 19]

What it measures (ns per token-head, float32, P = L = 3, medians over rounds):

* the in-memory API (``racecpu.race_attention_fwd``/``_bwd`` on NumPy arrays, all
  threads; a forward alone by ``racecpu.race_attention``, as dask's by
  ``racecpu.dask.race_attention``: no residuals) at ``2**memory-log2n`` tokens x heads: the largest size whose eight
  arrays and residuals fit this machine's RAM comfortably; its ns per
  token-head is flat in N from ~2^17 up;
* ``racecpu.dask`` at ``2**log2n`` tokens x heads on a ``distributed.LocalCluster``
  of 1 and of 2 single-threaded worker processes, in blocks of ``2**log2-block``
  tokens x 1 head.  Inputs are one cached random block per worker process,
  made before the clock starts (every block reads the same numbers), and
  results are discarded by a store that keeps nothing, so the time is
  racecpu's tasks plus Dask's scheduling and the transfers of sketches.  Each
  mode's first run on a cluster (the workers' result pools fault their pages
  in) is not counted, as the in-memory call's first is not;
* the latency of one link of the causal scans' chain of carries (a sketch
  addition whose carry crosses between worker processes), and the wall time
  of a causal forward+backward of 64 tiny blocks (the scans' critical path)
  with the carries summed as a chain and as a tree;
* the sketches that crossed between the 2 workers per block and pass, in units of one block's
  state (workers' ``transfer_incoming_log``, racecpu's keys that hold no rows);
* the scheduler's overhead at several block sizes (causal forward+backward, 2
  workers): ``(wall x workers - sum of task compute times) / sum of task compute
  times`` from Dask's task stream, which counts everything that is not a task
  computing: scheduling, transfers, and workers idle while the scans' chains
  of small additions run.

Prints a table and writes ``benchmarks/results/dask-scaling.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

MODES = (("fwd", False, False), ("fwd+bwd", False, True), ("causal fwd", True, False), ("causal fwd+bwd", True, True))


@functools.lru_cache(maxsize=2)
def _cached(shape):
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    x.flags.writeable = False
    return x


def _block(shape, block_info=None):
    """A block of the stacked inputs: the worker's one cached random block, cut to this block's shape."""
    loc = block_info[None]["array-location"]
    want = tuple(b - a for a, b in loc)
    return _cached(shape)[tuple(slice(0, w) for w in want)]


def _prime(shape):
    """Make the worker's cached block before the clock starts (not counted as racecpu's time)."""
    _cached(shape)


class _Discard:
    """A ``da.store`` target that keeps nothing."""

    def __setitem__(self, key, value):
        pass


def inputs(n, heads, dim, block):
    import dask.array as da

    from racecpu.apps.dask_demo import stacked_view
    chunks = ((4,), (1,) * heads, tuple(min(block, n - lo) for lo in range(0, n, block)), (dim,))
    X = da.map_blocks(_block, (4, 1, block, dim), chunks=chunks, dtype=np.float32,
                      meta=np.empty((0, 0, 0, 0), np.float32), name=f"cached-{n}-{heads}-{dim}-{block}")
    return tuple(stacked_view(X, i) for i in range(4))


def dask_run(client, n, heads, dim, block, causal, backward, W, scan="auto", rows_dir=None, placed=False):
    """One call on the cluster; returns (wall seconds, sum of every task's compute seconds, of
    racecpu's tasks alone, sketch bytes that crossed between workers per block and pass in
    units of one block's state: ``L 2**P (dv + 1)`` float64).  ``placed``: every block's tasks
    on one worker, the blocks split evenly (``racecpu.dask.block_placement``; slower in one
    submission: docs/distributed.md, "the demo's blocks placed")."""
    import contextlib

    import dask
    import dask.array as da
    from distributed import get_task_stream

    import racecpu.dask as rd
    from racecpu.apps.dask_demo import _clear_log, _incoming
    client.run(_clear_log)
    q, k, v, g = inputs(n, heads, dim, block)
    if backward:
        out, res = rd.race_attention_fwd(q, k, v, W, causal=causal, scan=scan, rows_dir=rows_dir)
    elif scan == "auto":  # a forward that no backward follows keeps no rows (and counts only its output)
        out = rd.race_attention(q, k, v, W, causal=causal)
    else:
        out = rd.race_attention_fwd(q, k, v, W, causal=causal, scan=scan, keep_rows=False)[0]
    if backward:
        dq, dk, dv, dbeta = rd.race_attention_bwd(res, g)
        work = [da.store([dq, dk, dv], [_Discard()] * 3, lock=False, compute=False), dbeta]
    else:
        work = [da.store(out, _Discard(), lock=False, compute=False)]
    where = contextlib.nullcontext()
    if placed:
        graph = rd.graph_of(work)
        stacked = next(iter(q.dask.dependencies[q.name]))  # q is a view of the stacked inputs' blocks
        block_of = {key: key[2:4] for key in graph if isinstance(key, tuple) and key[0] == stacked}
        placement = rd.block_placement(graph, block_of, sorted(client.scheduler_info()["workers"]))
        where = dask.annotate(workers=placement, allow_other_workers=True)
    with get_task_stream(client) as ts, where:
        t0 = time.perf_counter()
        client.compute(work, sync=True)
        wall = time.perf_counter() - t0
    busy = race = 0.0
    for t in ts.data:
        name = t["key"] if isinstance(t["key"], str) else t["key"][0]
        for s in t["startstops"]:
            if s["action"] == "compute":
                busy += s["stop"] - s["start"]
                race += (s["stop"] - s["start"]) * ("race-" in name)  # racecpu's tasks (fused ones too)
    sketch_bytes = sum(ours for ours, _ in client.run(_incoming).values())
    state = W.shape[0] * 2 ** W.shape[1] * (dim + 1) * 8
    states = sketch_bytes / (-(-n // block) * heads * (2 if backward else 1) * state)
    return wall, busy, race, states


def auto_scan(n, heads, dim, block, backward, W):
    """The causal scan ``scan="auto"`` takes for :func:`dask_run`'s call on the current client."""
    import racecpu.dask as rd
    from racecpu.config import DEFAULT_BETA
    q, k, v, _ = inputs(n, heads, dim, block)
    if backward:
        return rd.race_attention_fwd(q, k, v, W, causal=True)[1].scan
    # race_attention's own choice (it counts only the output against a slot's memory; a chain and a
    # tree both have a keys' pass, so the graph's keys do not tell them apart)
    return rd._forward(q, k, v, W, DEFAULT_BETA, causal=True, key_mask=None, check_finite=True, threads=None,
                       keep_rows=False, rows_dir=None, scan="auto", backward=False)[1].scan


def chain_latency(client, links, dim, W):
    """Seconds per link of a chain of sketch additions (the causal scans' carries) on the cluster.

    Every link is one task that adds a block's total to the carry, as in
    ``racecpu.dask``; its wall time is the latency a scan pays per block
    whatever the block's size.  Links alternate between the workers, so a
    carry crosses between processes at every step (the worst case)."""
    import racecpu
    import racecpu.dask as rd
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((2, 64, dim), dtype=np.float32)
    sk = rd._wire(racecpu.sketch(k, v, W))  # as a task sends it: the sums and a digest of the planes
    workers = sorted(client.scheduler_info()["workers"])
    parts = client.scatter([sk] * links, broadcast=True)
    carry = parts[0]
    futs = []
    t0 = time.perf_counter()
    for i in range(1, links):
        carry = client.submit(rd._t_add, carry, parts[i], workers=[workers[i % len(workers)]], pure=False)
        futs.append(carry)
    carry.result()
    return (time.perf_counter() - t0) / (links - 1)


def in_memory(n, heads, dim, rounds, W):
    import racecpu
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((heads, n, dim), dtype=np.float32) for _ in range(4))
    res = {}
    for name, causal, backward in MODES:
        ts = []
        for _ in range(rounds + 1):  # the first call faults pages in: not counted
            t0 = time.perf_counter()
            if backward:
                out, r = racecpu.race_attention_fwd(q, k, v, W, causal=causal)
                racecpu.race_attention_bwd(r, g)
            else:  # a forward that no backward follows keeps no residuals
                out = r = racecpu.race_attention(q, k, v, W, causal=causal)
            ts.append(time.perf_counter() - t0)
            del out, r
        res[name] = statistics.median(ts[1:]) / (n * heads) * 1e9
    return res


def cluster(workers):
    from distributed import Client

    from racecpu.apps.dask_demo import local_cluster
    c = local_cluster(workers)
    return c, Client(c)


def add_shape_arguments(ap):
    """The call's shape: ``--log2n``, ``--heads``, ``--dim``, ``--log2-block`` (also dask_workers.py's)."""
    ap.add_argument("--log2n", type=int, default=22)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--log2-block", type=int, default=18)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(ap)
    ap.add_argument("--overhead-blocks", default="14,16,18,20")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--memory-log2n", type=int, default=19)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "dask-scaling.json"))
    a = ap.parse_args(argv)

    import numba

    import racecpu
    import racecpu.dask  # noqa: F401  (without the dask extra this fails here, before any timing)
    W = racecpu.hyperplanes(a.dim, 3, 3, seed=0, dtype=np.float32)
    n, H, blk = 2 ** a.log2n, a.heads, 2 ** a.log2_block
    th = n * H
    result = dict(log2n=a.log2n, heads=H, dim=a.dim, log2_block=a.log2_block, rounds=a.rounds,
                  cpu_count=os.cpu_count(), date=time.strftime("%Y-%m-%d"))

    print(f"in-memory at 2^{a.memory_log2n} x {H} heads, {numba.get_num_threads()} threads ...", file=sys.stderr)
    result["in_memory_ns"] = mem = in_memory(2 ** a.memory_log2n, H, a.dim, a.rounds, W)

    result["dask_ns"], result["dask_busy"], result["dask_race"] = {}, {}, {}
    for workers in (1, 2):
        c, client = cluster(workers)
        try:
            for _, causal, backward in MODES:  # warm-up: every worker loads the kernels
                dask_run(client, 8 * 4096, 2 * workers, a.dim, 4096, causal, backward, W)
            client.run(_prime, (4, 1, blk, a.dim))
            for name, causal, backward in MODES:
                print(f"dask, {workers} worker(s), {name} ...", file=sys.stderr)
                # The first run faults the workers' result pools in (not counted, as for the in-memory call).
                runs = [dask_run(client, n, H, a.dim, blk, causal, backward, W) for _ in range(a.rounds + 1)][1:]
                result["dask_ns"][f"{workers}:{name}"] = statistics.median(r[0] for r in runs) / th * 1e9
                result["dask_busy"][f"{workers}:{name}"] = statistics.median(r[1] for r in runs) / th * 1e9
                result["dask_race"][f"{workers}:{name}"] = statistics.median(r[2] for r in runs) / th * 1e9
                result.setdefault("states_moved", {})[f"{workers}:{name}"] = statistics.median(r[3] for r in runs)
            if workers == 2:
                # The causal forward's rows handed to the backward in files rather than in the workers' memory.
                with tempfile.TemporaryDirectory(prefix="racecpu-rows-") as rows_dir:
                    runs = [dask_run(client, n, H, a.dim, blk, True, True, W, rows_dir=rows_dir)
                            for _ in range(a.rounds + 1)][1:]
                result["dask_ns"]["2:causal fwd+bwd, rows in files"] = statistics.median(r[0] for r in runs) / th * 1e9
                # A scan "auto" did not pick (the tree where it fused or chained, else the fused one), for comparison.
                for name, causal, backward in MODES[2:]:
                    other = "tree" if auto_scan(n, H, a.dim, blk, backward, W) != "tree" else "fused"
                    runs = [dask_run(client, n, H, a.dim, blk, causal, backward, W, other)
                            for _ in range(a.rounds + 1)][1:]
                    result["dask_ns"][f"2:{name}, scan={other}"] = statistics.median(r[0] for r in runs) / th * 1e9
                    result["states_moved"][f"2:{name}, scan={other}"] = statistics.median(r[3] for r in runs)
                result["chain_link_s"] = statistics.median(chain_latency(client, 256, a.dim, W) for _ in range(3))
                # The scans' critical path: 64 blocks of 256 tokens x 1 head, causal forward+backward, where
                # the blocks' compute is negligible and the carries' links set the time.
                result["scan_64_blocks_s"] = {
                    scan: statistics.median(dask_run(client, 64 * 256, 1, a.dim, 256, True, True, W, scan)[0]
                                            for _ in range(5)) for scan in ("chain", "tree", "fused")}
                result["overhead"] = {}
                for lb in (int(x) for x in a.overhead_blocks.split(",")):
                    print(f"dask, 2 workers, causal fwd+bwd, blocks of 2^{lb} ...", file=sys.stderr)
                    runs = [dask_run(client, n, H, a.dim, 2 ** lb, True, True, W) for _ in range(a.rounds)]
                    wall = statistics.median(r[0] for r in runs)
                    busy = statistics.median(r[1] for r in runs)
                    result["overhead"][str(lb)] = dict(wall_s=wall, busy_s=busy,
                                                       overhead=(wall * workers - busy) / busy,
                                                       ns_per_token_head=wall / th * 1e9,
                                                       tasks_per_head=-(-n // 2 ** lb))
        finally:
            client.close()
            c.close()

    print(f"\nns per token-head, float32, d={a.dim}, P=L=3; in-memory at 2^{a.memory_log2n} x {H} heads on "
          f"{numba.get_num_threads()} threads; dask at 2^{a.log2n} x {H} heads, blocks of 2^{a.log2_block} x 1 head")
    print(f"{'mode':16}{'in-memory':>11}{'dask 1w':>10}{'dask 2w':>10}{'2w vs 1w':>10}{'2w / mem':>10}")
    for name, _, _ in MODES:
        one, two = result["dask_ns"][f"1:{name}"], result["dask_ns"][f"2:{name}"]
        print(f"{name:16}{mem[name]:11.1f}{one:10.1f}{two:10.1f}{one / (2 * two):10.3f}{mem[name] / two:10.3f}")
    print("(2w vs 1w: parallel efficiency of 2 workers; 2w / mem: dask's throughput as a fraction of the "
          "in-memory call's)")
    spilled = result["dask_ns"]["2:causal fwd+bwd, rows in files"]
    print(f"causal fwd+bwd, 2 workers, the forward's rows in files (rows_dir): {spilled:.1f} ns per token-head, "
          f"{mem['causal fwd+bwd'] / spilled:.3f} of the in-memory call")
    for key, ns in result["dask_ns"].items():
        if ", scan=" in key:
            print(f"{key[2:]}, 2 workers: {ns:.1f} ns per token-head, {mem[key[2:].split(',')[0]] / ns:.3f} of the "
                  f"in-memory call (the scan 'auto' did not pick)")
    print("\nsketches moved between the 2 workers per block and pass, in states (one block's L 2^P (dv + 1) "
          "float64; target <= 1.2)")
    for key, st in result["states_moved"].items():
        if key.startswith("2:"):
            print(f"{key[2:]:34}{st:8.3f}")
    nt = numba.get_num_threads()
    print(f"\nwhere a worker's time went, 1 worker, ns per token-head on one core (in-memory: x {nt} threads)")
    print(f"{'mode':16}{'in-memory':>11}{'racecpu tasks':>15}{'other tasks':>13}{'idle':>8}")
    for name, _, _ in MODES:
        key = f"1:{name}"
        race, busy, wall = result["dask_race"][key], result["dask_busy"][key], result["dask_ns"][key]
        print(f"{name:16}{nt * mem[name]:11.1f}{race:15.1f}{busy - race:13.1f}{wall - busy:8.1f}")
    print(f"\nscheduler overhead, causal fwd+bwd, 2 workers, 2^{a.log2n} x {H} heads")
    print(f"{'block':>8}{'tasks/head':>12}{'wall s':>9}{'busy s':>9}{'overhead':>10}{'ns/th':>9}")
    for lb, o in result["overhead"].items():
        print(f"{'2^' + lb:>8}{o['tasks_per_head']:12d}{o['wall_s']:9.2f}{o['busy_s']:9.2f}{o['overhead']:10.1%}"
              f"{o['ns_per_token_head']:9.1f}")
    print(f"\na chain of sketch additions across 2 worker processes: {result['chain_link_s'] * 1e3:.2f} ms per link")
    sc = result["scan_64_blocks_s"]
    print(f"causal fwd+bwd of 64 blocks x 256 tokens x 1 head on 2 workers (the scans' critical path): "
          f"chain {sc['chain'] * 1e3:.0f} ms, tree {sc['tree'] * 1e3:.0f} ms, fused {sc['fused'] * 1e3:.0f} ms")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwritten {a.out}")


if __name__ == "__main__":
    main()

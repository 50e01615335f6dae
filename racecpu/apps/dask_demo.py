"""The Dask demo (``racecpu demo --dask [SCHEDULER]``): causal RACE over a cluster, results in zarr.

:func:`demo` runs :func:`racecpu.dask.race_attention_fwd` and ``_bwd`` over
``tokens`` tokens on a ``distributed`` cluster (by default a
``LocalCluster`` of one single-threaded worker process per core of this
machine).  The inputs ``q, k, v`` and the cotangent ``grad_out`` are never
stored: every block is generated on the worker that uses it, from a seed
(:class:`racecpu.apps.ooc_demo.SeededArray`), and the results ``out, dq, dk,
dv`` go into zarr arrays on disk, one zarr chunk per block.

Where the carries between blocks are scanned (a tree or a chain), the
graph runs in four phases, each of which keeps its small results (the
sketches, float64, ``L * 2**P * (dv + 1)`` numbers per head) in the cluster's
memory for the next: (1) the forward's carried-in states, (2) the outputs
and, from each block's output, the cotangent it sends back to its state, (3)
the backward's reverse carries (a scan of additions of those), (4) the
gradients.  Within a phase every
block depends only on its own rows and those small states, so a worker holds
a few blocks' rows at a time whatever the length; computing the graph in one
go would let the scheduler hold every block's rows across the scans.
Where the scan is fused (``scan="auto"`` fuses where every worker has a
sequence of its own and their results fit, :func:`racecpu.dask.pick_scan`),
a block's forward task gives its output, carry and rows at once, and its
backward task its gradients and reverse carry, so the graph runs in two
phases, the outputs and the gradients.  The rows each block's backward
reads (272 bytes per token and head at float32) go from the forward to the
gradients in files (``directory/rows``, deleted at the end:
:func:`rows_needed` bytes), so no block's forward runs twice.  With one
block per head (``tokens <= block``) there are no carries.

Every block's tasks, in every phase, run on one worker, the blocks split
into one contiguous run per worker (:func:`racecpu.dask.block_placement`),
and a worker runs its blocks one after another: the sketches cross between
workers only where a scan passes from one run to the next, and no rows
cross.  Dask's own placement, phase by phase, put a block's carry on the
other worker about as often as not (docs/distributed.md, "the demo's blocks
placed").

The results take :func:`disk_needed` bytes (about ``16 * tokens * dim``
per head: four float32 arrays) in ``directory``, which stay there for the
user to delete; :func:`disk_problem` says, before any work, when they do not
fit.
"""

from __future__ import annotations

import functools
import os
import shutil
import time

import numpy as np

__all__ = ["demo", "seeded_inputs", "stacked_view", "pick_block", "disk_needed", "rows_needed", "disk_free",
           "disk_problem"]

_OUTPUTS = ("out", "dq", "dk", "dv")

#: Most tokens per block when none is asked for: a block's rows are what a task holds (128 MiB per
#: float32 array at d = 128).
MAX_BLOCK = 2 ** 18

#: Disk left free after the results by default: the demo writes tens of GiB at its documented sizes,
#: and a disk filled to the last byte stalls everything else on it.
DISK_MARGIN = 4 * 2 ** 30

#: Bytes a file's or folder's size is rounded up to on disk (the common filesystem block).
_FS_BLOCK = 4096


@functools.lru_cache(maxsize=2)
def _source(shape, seed):
    from .ooc_demo import SeededArray
    return SeededArray(shape, np.float32, seed)


def _seeded_rows(shape, seed, a, block_info=None):
    """One block of input ``a`` (0: q, 1: k, 2: v, 3: grad_out) of the inputs ``shape = (4, H, N, d)``,
    generated here."""
    (h0, h1), (n0, n1), _ = block_info[None]["array-location"]
    src = _source(shape, seed)
    H = shape[1]
    out = np.empty((h1 - h0, n1 - n0, shape[-1]), np.float32)
    for h in range(h0, h1):
        src.rows(a * H + h, n0, n1, out=out[h - h0])  # no row copy of its own
    return out


def stacked_view(X, i):
    """``X[i]`` of a stacked dask array whose blocks span its whole first axis, as views of X's blocks.

    One ``getitem`` task per block, in a layer of its own: Dask's slicing (and
    ``map_blocks``) copy a result that is a small part of its block, which for
    a quarter of a 512 MiB block cost more than racecpu's task on it."""
    import operator

    import dask
    import dask.array as da
    from dask.highlevelgraph import HighLevelGraph

    if len(X.chunks[0]) != 1:
        raise ValueError("X must have one chunk along its first axis")
    name = f"view{i}-" + dask.base.tokenize(X, i)
    layer = {(name,) + idx[1:]: (operator.getitem, (X.name,) + idx, i) for idx in np.ndindex(X.numblocks)}
    graph = HighLevelGraph.from_collections(name, layer, dependencies=[X])
    return da.Array(graph, name, X.chunks[1:], dtype=X.dtype, meta=np.empty((0,) * (X.ndim - 1), X.dtype))


def _seeded_name(tokens, heads, dim, block, seed, a):
    """The name of input ``a`` (0: q, 1: k, 2: v, 3: grad_out) of :func:`seeded_inputs`: its key
    ``(name, h, j, 0)`` is block ``j`` of head ``h``."""
    return f"seeded-{'qkvg'[a]}-{tokens}-{heads}-{dim}-{block}-{seed}"


def _placement(collections, tokens, heads, dim, block, seed, workers):
    """:func:`racecpu.dask.block_placement` of the demo's graph (``collections``: every one its
    phases compute): each block's tasks, in every phase, on the worker of its run of blocks
    (head-major), so that the phases' sketches cross only where a scan passes from one run to
    the next (docs/distributed.md, "the demo's blocks placed")."""
    from .. import dask as rd

    graph = rd.graph_of(collections)
    names = {_seeded_name(tokens, heads, dim, block, seed, a) for a in range(4)}
    block_of = {k: (k[1], k[2]) for k in graph if isinstance(k, tuple) and k[0] in names}
    return rd.block_placement(graph, block_of, workers)


def seeded_inputs(tokens, heads, dim, block, seed=0):
    """``q, k, v, grad_out`` as lazy dask arrays ``(heads, tokens, dim)`` float32, chunked by ``block`` tokens.

    Every block of each is generated by a task of its own where it is used (the demo's placement puts
    a block's four on its worker), so a phase that reads only some of them (the forward's states: k
    and v) generates only those.  The fifth value is their :class:`racecpu.apps.ooc_demo.SeededArray`
    ``(4 * heads, tokens, dim)``: input ``a`` of head ``h`` is its group ``a * heads + h``.
    """
    import dask.array as da

    shape = (4, int(heads), int(tokens), int(dim))
    chunks = ((1,) * heads, tuple(min(block, tokens - lo) for lo in range(0, tokens, block)), (dim,))
    arrays = tuple(da.map_blocks(_seeded_rows, shape, int(seed), a, chunks=chunks, dtype=np.float32,
                                 meta=np.empty((0, 0, 0), np.float32),
                                 name=_seeded_name(tokens, heads, dim, block, seed, a)) for a in range(4))
    return arrays + (_source(shape, int(seed)),)


def _keys(collection, prefixes):
    """The collection's graph (a dict) and its keys that start with one of ``prefixes``."""
    graph = dict(collection.__dask_graph__())
    return graph, [k for k in graph if isinstance(k, str) and k.startswith(prefixes)]


#: Workers that never spill, pause or restart for memory: racecpu's tasks bound their own rows,
#: and spilling would write blocks to the disk the results go to.
NO_SPILL = {"distributed.worker.memory.target": False, "distributed.worker.memory.spill": False,
            "distributed.worker.memory.pause": False, "distributed.worker.memory.terminate": False}


def local_cluster(n_workers=None, stealing=True):
    """A ``LocalCluster`` of ``n_workers`` (default: one per core) single-threaded worker processes
    configured with :data:`NO_SPILL`; ``stealing=False``: the scheduler steals no work (the demo
    places every block's tasks itself, so a stolen task would only pull its rows)."""
    import dask
    from distributed import LocalCluster

    with dask.config.set({**NO_SPILL, "distributed.scheduler.work-stealing": bool(stealing)}):
        return LocalCluster(n_workers=n_workers or os.cpu_count() or 1, threads_per_worker=1, processes=True,
                            dashboard_address=None)


def _incoming(dask_worker):
    """Bytes this worker received from others, split into racecpu's sketches and the rest (rows: inputs,
    and racecpu's outputs and gradients where the scheduler placed a task away from the block's worker)."""
    from ..dask import holds_rows
    ours = other = 0
    for e in dask_worker.transfer_incoming_log:
        for key, nbytes in e["keys"].items():
            name = key if isinstance(key, str) else key[0]
            if name.startswith("race-") and not holds_rows(name):
                ours += nbytes
            else:
                other += nbytes
    return ours, other


def _clear_log(dask_worker):
    dask_worker.transfer_incoming_log.clear()


def _peak():
    from .._memory import peak_rss
    return peak_rss()


def _reset_peak():
    from .._memory import reset_peak_rss
    return reset_peak_rss()


def pick_block(tokens, block=None):
    """Tokens per block for ``tokens`` tokens: ``block`` (at most ``tokens``), or an even split.

    zarr stores every chunk at its full size, the last one included, so a
    block longer than the sequence would write its padding to disk (2 GiB for
    one token at the default block, d = 128 and 4 heads): such a block is
    ``tokens`` long.  With no ``block``, the tokens are split into the fewest
    blocks of at most :data:`MAX_BLOCK` tokens, of equal length up to one
    token, so the last chunk pads by less than a token per block.

    Parameters
    ----------
    tokens : int
        Sequence length, >= 1.
    block : int, optional
        Tokens per block asked for, >= 1.

    Returns
    -------
    int
    """
    tokens = int(tokens)
    if block is not None:
        return min(int(block), tokens)
    n = -(-tokens // MAX_BLOCK)
    return -(-tokens // n)


def disk_needed(tokens, heads, dim, block):
    """Bytes the results take on disk: ``out, dq, dk, dv`` as uncompressed float32 zarr arrays.

    Every chunk is ``block`` tokens long (zarr pads the last one), and every
    file and folder takes whole filesystem blocks: zarr 3's layout
    ``NAME/zarr.json``, ``NAME/c/HEAD/BLOCK/0`` is a file and a folder per
    chunk, a folder per head and three entries per array (zarr 2's flat
    layout takes less).

    Returns
    -------
    total, per_head : int
        Bytes in all, and bytes per head (the chunks; the metadata aside).
    """
    nblocks = -(-int(tokens) // int(block))
    chunk = -(-int(block) * int(dim) * 4 // _FS_BLOCK) * _FS_BLOCK + _FS_BLOCK
    per_head = len(_OUTPUTS) * (nblocks * chunk + _FS_BLOCK)
    return int(heads) * per_head + (3 * len(_OUTPUTS) + 1) * _FS_BLOCK, per_head


def _existing(path):
    """``path`` or its nearest ancestor that exists (the filesystem a folder not yet made goes to)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _results_bytes(directory, names=_OUTPUTS):
    """Bytes on disk of the ``out, dq, dk, dv`` (or other ``names``) in ``directory`` (an earlier run's,
    which a run replaces, or this run's)."""
    total = 0
    for name in names:
        for root, _, files in os.walk(os.path.join(directory, name)):
            for f in files:
                try:
                    st = os.lstat(os.path.join(root, f))
                except OSError:
                    continue
                total += getattr(st, "st_blocks", 0) * 512 or st.st_size
    return total


def disk_free(directory):
    """Bytes free for the results in ``directory``, made or not.

    The filesystem's free bytes (of the nearest existing folder) plus those
    of an earlier run's results there, which the run deletes first.

    Returns
    -------
    free, replaced : int
        Bytes free in all, and the part of them an earlier run's results hold now.
    """
    replaced = _results_bytes(directory) if os.path.isdir(directory) else 0
    return int(shutil.disk_usage(_existing(directory)).free) + replaced, replaced


def rows_needed(tokens, heads, dim, num_planes=3, num_tables=3):
    """Bytes the forward's rows take on disk between the forward and the backward (``DIR/rows``,
    deleted at the end of the run): per token and head the soft buckets and projections of
    queries and keys and a float64 denominator (``(2 F + 2 L P) * 4 + 8`` bytes, F = L 2^P:
    272 at P = L = 3), plus each chunk's float64 carried-in state (counted here as one per
    1,024 tokens, more than the engine's chunks have)."""
    F = num_tables * 2 ** num_planes
    per_token = (2 * F + 2 * num_tables * num_planes) * 4 + 8
    carries = F * (dim + 1) * 8 * -(-int(tokens) // 1024)
    return int(heads) * (int(tokens) * per_token + carries)


def disk_problem(tokens, heads, dim, block, directory, margin=DISK_MARGIN, num_planes=3, num_tables=3):
    """Why the results do not fit in ``directory`` (one sentence), or None where they do.

    They fit when :func:`disk_needed` plus :func:`rows_needed` plus ``margin``
    bytes is at most :func:`disk_free`.  Reads the disk's state only: nothing
    is made or deleted.
    """
    need, per_head = disk_needed(tokens, heads, dim, block)
    rows = rows_needed(tokens, heads, dim, num_planes, num_tables)
    free, replaced = disk_free(directory)
    if need + rows + margin <= free:
        return None
    earlier = f", counting {replaced:,} bytes of an earlier run's results there" if replaced else ""
    return (f"the results (out, dq, dk, dv as zarr) of {heads} head(s) x {tokens:,} tokens x d={dim} need "
            f"{need:,} bytes ({need / 2 ** 30:.2f} GiB, {per_head:,} per head) in {directory}, the forward's rows "
            f"{rows:,} more while it runs, plus {margin:,} bytes ({margin / 2 ** 30:.2f} GiB) kept free; it has "
            f"{free:,} bytes ({free / 2 ** 30:.2f} GiB) free{earlier}. Choose fewer --tokens or --heads, or another "
            f"--dask-dir")


def _wait(futures, progress, label):
    from distributed import progress as show, wait

    if not futures:  # one block per head: no carries to compute (distributed refuses empty collections)
        if progress:
            print(f"{label}: nothing to compute (one block per head)", flush=True)
        return
    if progress:
        print(f"{label}:", flush=True)
        show(futures, notebook=False)
        print(flush=True)
    wait(futures)
    for f in futures:
        if f.status == "error":
            f.result()  # raises the task's exception


def demo(tokens=2 ** 24, heads=4, dim=128, directory="racecpu-dask", scheduler=None, *, seed=0,
         num_planes=3, num_tables=3, beta=None, block=None, check=True, progress=True, disk_margin=DISK_MARGIN,
         n_workers=None, scan="auto"):
    """One causal RACE forward + backward over ``tokens`` tokens on a Dask cluster; returns metrics.

    Parameters
    ----------
    tokens, dim : int
        Sequence length and head dimension (d = dv).
    heads : int, default 4
        Heads.  The results take about ``16 * tokens * dim`` bytes per head
        (:func:`disk_needed`: 32 GiB per head at 2^24 tokens, d = 128).
    directory : path
        Where the zarr arrays ``out, dq, dk, dv`` are written (replaced if
        present; left there for the caller to delete).
    scheduler : str, optional
        A ``distributed`` scheduler address; default a ``LocalCluster`` of
        ``n_workers`` single-threaded worker processes (default: one per
        core).
    seed, num_planes, num_tables, beta :
        Input seed, hash shape and temperature (default racecpu's).
    block : int, optional
        Tokens per block (one dask task and zarr chunk): as
        :func:`pick_block` makes of it (at most ``tokens``; default an
        even split into blocks of at most :data:`MAX_BLOCK` tokens).
    check : bool, default True
        Compare the first ``min(tokens, 4096)`` tokens of ``out`` and ``dq``
        (which, causal, depend on nothing later) with the in-memory
        :func:`racecpu.race_attention_fwd` / ``_bwd``.
    progress : bool, default True
        Dask's progress bar for each phase.
    disk_margin : int, default :data:`DISK_MARGIN` (4 GiB)
        Refuse to start unless this much disk stays free after the results.
    n_workers : int, optional
        Worker processes of the demo's own ``LocalCluster`` (default one per core).
    scan : {"auto", "fused", "tree", "chain"}, default "auto"
        How the carries between blocks are computed
        (:func:`racecpu.dask.race_attention_fwd`); a fused scan runs in two
        phases, the others in four (see the module's docstring).

    Returns
    -------
    dict
        tokens, heads, dim, block, workers, the scan, ``phases`` (each phase's
        label and seconds; ``seconds_states``, ``seconds_forward``,
        ``seconds_reverse``, ``seconds_backward`` name the four of a scanned
        run, 0 for a phase a fused run does not have) and the total,
        ns_per_token_head, peak RSS per worker, bytes moved between workers
        (racecpu's sketches and other keys, e.g. rows of a task that Dask's
        work stealing moved), one block's state bytes, disk bytes (measured
        after the run), dbeta and the check's max abs errors.

    Raises
    ------
    ValueError
        ``tokens``, ``heads``, ``dim`` or ``block`` below 1.
    RuntimeError
        The results do not fit on the disk (:func:`disk_problem`), before
        anything is written or started.
    """
    import dask
    import zarr
    from distributed import Client

    from .. import dask as rd
    from ..attention import race_attention_bwd, race_attention_fwd
    from ..config import DEFAULT_BETA
    from ..hashing import hyperplanes

    beta = DEFAULT_BETA if beta is None else float(beta)
    for name, value in (("tokens", tokens), ("heads", heads), ("dim", dim), ("block", 1 if block is None else block)):
        if int(value) < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    tokens, heads, dim = int(tokens), int(heads), int(dim)
    block = pick_block(tokens, block)
    problem = disk_problem(tokens, heads, dim, block, directory, disk_margin, num_planes, num_tables)
    if problem is not None:
        raise RuntimeError(problem)
    os.makedirs(directory, exist_ok=True)
    for name in _OUTPUTS + ("rows",):
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    rows_dir = os.path.join(directory, "rows")
    os.makedirs(rows_dir)
    W = hyperplanes(dim, num_planes, num_tables, seed=seed, dtype=np.float32)
    stores = [_zarr_array(zarr, os.path.join(directory, n), (heads, tokens, dim), (1, block, dim))
              for n in _OUTPUTS]

    # Every phase's rows are bounded by construction: the workers of a local cluster never spill.
    cluster = local_cluster(n_workers, stealing=False) if scheduler is None else None
    client = Client(cluster if cluster is not None else scheduler)
    try:
        workers = len(client.scheduler_info()["workers"])
        client.run(_warm, W, beta)  # every worker loads (or compiles) the kernels before the clock starts
        client.run(_clear_log)
        client.run(_reset_peak)

        Q, K, V, G, src = seeded_inputs(tokens, heads, dim, block, seed)
        t0 = time.perf_counter()
        # Each block's forward writes the rows its backward reads to rows_dir and hands on the file's path,
        # which the gradients' phase reads: no forward runs twice and no worker holds rows between phases.
        out, res = rd.race_attention_fwd(Q, K, V, W, beta, causal=True, rows_dir=rows_dir, scan=scan)
        dq, dk, dv, dbeta = rd.race_attention_bwd(res, G)
        where = _placement((out, dq, dk, dv, dbeta), tokens, heads, dim, block, seed,
                          sorted(client.scheduler_info()["workers"]))
        phases = _fused_phases if res.scan == "fused" else _scanned_phases
        # Loose: a lost worker's blocks go elsewhere.  The priorities run each worker's blocks in turn.
        with dask.annotate(workers=where, priority=where.priority, allow_other_workers=True):
            t, kept, rows_bytes, f_grads = phases(client, res, out, (dq, dk, dv, dbeta), stores, directory, progress)
        total = time.perf_counter() - t0
        db = float(f_grads[-1].result())
        del kept, f_grads
        shutil.rmtree(rows_dir, ignore_errors=True)
        peaks = client.run(_peak)
        moved = client.run(_incoming)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()

    m = dict(tokens=tokens, heads=heads, dim=dim, block=block, workers=workers, num_planes=num_planes,
             num_tables=num_tables, beta=beta, scan=res.scan, phases=[(label, sec) for _, label, sec in t],
             **{f"seconds_{key}": sum(sec for k, _, sec in t if k == key)
                for key in ("states", "forward", "reverse", "backward")}, seconds_total=total,
             ns_per_token_head=total / (tokens * heads) * 1e9, peak_rss_bytes=dict(peaks),
             bytes_moved_sketches=sum(a for a, _ in moved.values()),
             bytes_moved_other=sum(b for _, b in moved.values()),
             blocks=-(-tokens // block) * heads, disk_bytes=_results_bytes(directory), rows_bytes=rows_bytes,
             dbeta=db, directory=os.path.abspath(directory))
    m["state_bytes"] = num_tables * 2 ** num_planes * (dim + 1) * 8  # one block's (one head's) state
    if check:
        n = min(tokens, 4096)
        x = np.stack([np.stack([src.rows(a * heads + h, 0, n) for h in range(heads)]) for a in range(4)])
        o, r = race_attention_fwd(x[0], x[1], x[2], W, beta, causal=True)
        dq0 = race_attention_bwd(r, x[3])[0]
        m["check_tokens"] = n
        m["check_max_abs_err_out"] = float(np.abs(stores[0][:, :n] - o).max())
        m["check_max_abs_err_dq"] = float(np.abs(stores[1][:, :n] - dq0).max())
    return m


def _fused_phases(client, res, out, grads, stores, directory, progress):
    """The demo's graph in two phases when the scan is fused: each block's forward task gives its
    output, the carry its successor starts from and the path of its rows at once, and its
    backward task its gradients and the cotangent its predecessor starts from, so the outputs are
    stored with the carries and rows kept, then the gradients, and every block task runs once
    (four phases, as :func:`_scanned_phases`, ran each chain again for what an earlier phase had
    not kept).  Returns the phases' ``(key, label, seconds)`` (the keys of :func:`demo`'s
    ``seconds_*``), the futures kept to the end, the bytes of the rows' files and the gradients'
    futures (dbeta last)."""
    t0 = time.perf_counter()
    # One submission: a block task whose output had been stored before a second submission
    # asked for its carry would have been released, and computed again.
    small = [x for b in res.states for x in res.states[b] + res.forwards[b] if x is not None]
    f_out, *kept = client.compute([da_store(out, stores[0])] + small)
    _wait([f_out] + kept, progress, "1/2 forward: outputs, and each block's carry and rows")
    rows_bytes = _results_bytes(directory, ("rows",))
    t1 = time.perf_counter()
    f_grads = _gradients(client, grads, stores, progress, "2/2 backward: gradients")
    return ([("forward", "outputs", t1 - t0), ("backward", "gradients", time.perf_counter() - t1)], kept, rows_bytes,
            f_grads)


def _gradients(client, grads, stores, progress, label):
    """The last phase of either flow: dq, dk, dv stored (``stores[1:]``) and dbeta computed;
    their futures, dbeta last, once done."""
    dq, dk, dv, dbeta = grads
    f_grads = client.compute([da_store(x, s) for x, s in zip((dq, dk, dv), stores[1:])] + [dbeta])
    _wait(f_grads, progress, label)
    return f_grads


def _scanned_phases(client, res, out, grads, stores, directory, progress):
    """The demo's graph in four phases when the carries are scanned (tree or chain), each keeping
    only states for the next: (1) the forward's carried-in states, (2) the outputs and, from each
    block's output, the cotangent it sends back to its state, (3) the backward's reverse carries,
    (4) the gradients.  Within a phase every block depends only on its own rows and those small
    states, so a worker holds a few blocks' rows at a time whatever the length (computing the
    graph in one go would let the scheduler hold every block's rows across the scans).  Returns
    as :func:`_fused_phases`."""
    from dask.delayed import Delayed
    from distributed import futures_of

    dq = grads[0]  # its graph holds the dstate, reverse-carry and forward keys
    t0 = time.perf_counter()
    # The first block of a head has no carried-in state: with one block per head there are none,
    # and distributed's persist refuses an empty list ("No collections provided").
    carries = [c for b in res.states.values() for c in b if c is not None]
    kept = client.persist(carries) if carries else []
    _wait(futures_of(kept), progress, "1/4 forward: block totals and carried-in states")
    t1 = time.perf_counter()
    # With the outputs, each block's cotangent to its state (the dstate tasks read the block's output,
    # which is then computed once), in one submission so that they share the forward's tasks.
    graph, keys = _keys(dq, ("race-dstate-", "race-rcarry-", "race-fwd-"))
    dkeys = [k for k in keys if k.startswith(("race-dstate-", "race-fwd-"))]  # and the paths of the rows
    f_out, *dfut = client.compute([da_store(out, stores[0])] + [Delayed(k, graph) for k in dkeys])
    _wait([f_out] + dfut, progress, "2/4 forward: outputs, and what they send back to the states")
    rows_bytes = _results_bytes(directory, ("rows",))
    t2 = time.perf_counter()
    rkeys = [k for k in keys if k.startswith("race-rcarry-")]
    rfut = client.get(graph, rkeys, sync=False) if rkeys else []
    _wait(list(rfut), progress, "3/4 backward: reverse carries")
    t3 = time.perf_counter()
    f_grads = _gradients(client, grads, stores, progress, "4/4 backward: gradients")
    t4 = time.perf_counter()
    return ([("states", "forward states", t1 - t0), ("forward", "outputs, dstates", t2 - t1),
             ("reverse", "reverse carries", t3 - t2), ("backward", "gradients", t4 - t3)],
            [kept, dfut, list(rfut)], rows_bytes, f_grads)


def _warm(W, beta):
    """Load, in a worker, the kernels of the sketch functions that racecpu.dask's causal tasks call
    (each worker process compiles or loads its own)."""
    from .. import sketches as S
    rng = np.random.default_rng(0)
    q, k, v, g = rng.standard_normal((4, 1, 4 * 1024 + 5, W.shape[-1])).astype(np.float32)
    st = S.sketch(k, v, W, beta)
    S.causal_block(q, k, v, W, beta, st)
    dst = S.causal_block_dstate(q, k, v, W, beta, g, st)
    S.causal_block_bwd(q, k, v, W, beta, g, st, dst)
    return True


def _zarr_array(zarr, path, shape, chunks):
    """A new float32 zarr array without compression (random floats do not compress) that writes every
    chunk it is given.

    zarr's default (``write_empty_chunks=False``) compares each chunk with the fill value before
    writing it, to skip an empty one: at 2^18 tokens x 128 a comparison of 128 MiB through a
    temporary, 50-600 ms against 40 ms for the write itself (docs/distributed.md, "zarr's
    empty-chunk check").  The demo's chunks are never empty."""
    if hasattr(zarr, "create_array"):  # zarr 3
        return zarr.create_array(path, shape=shape, chunks=chunks, dtype=np.float32, compressors=None,
                                 overwrite=True, config={"write_empty_chunks": True})
    return zarr.open_array(path, mode="w", shape=shape, chunks=chunks, dtype=np.float32, compressor=None,
                           write_empty_chunks=True)


def da_store(x, target):
    """A lazy store of dask array ``x`` into ``target`` (a zarr array with one chunk per block)."""
    import dask.array as da
    return da.store(x, target, lock=False, compute=False)

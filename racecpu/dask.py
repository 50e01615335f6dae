"""RACE attention on Dask arrays: the NumPy API's forward and backward as lazy task graphs.

:func:`race_attention`, :func:`race_attention_fwd` and :func:`race_attention_bwd`
take ``dask.array`` inputs chunked along the sequence axis (any chunks along
the leading batch/head axes; the feature axis is rechunked to one chunk) and
return lazy dask arrays.  Every task is one *block* of rows (one chunk along
the sequence axis and the leading axes) plus small float64 sketches
(:class:`racecpu.Sketch`, ``L * R * (dv + 1)`` numbers per group); the only
values that cross between tasks of different blocks are sketches and
scalars, never rows:

* non-causal forward: a sketch per key block (with ``keep_rows``, keeping its
  keys' soft buckets for the block's gradient task:
  :func:`racecpu.sketches.sketch_kept`), summed by a tree of additions
  (fan-in :data:`FAN_IN`), then a readout per query block;
* causal forward: per block one pass over its keys that sums its state and
  keeps their soft buckets (:func:`racecpu.sketches.causal_block_keys`), an
  exclusive scan of the states across blocks (a parallel-prefix tree of
  additions of sketches, or a chain for a few blocks: ``scan``), then every
  block's queries from its carried-in state and its keys' pass
  (:func:`racecpu.sketches.causal_block`), which keeps the rows the block's
  backward reads (``keep_rows``; in memory, or in files: ``rows_dir``);
  or, with ``scan="fused"`` (the default where there are at least as many
  sequences as block tasks run at once), each block's forward from the state
  its predecessor's forward ended with: one pass per block and no sums
  across blocks, the sequence's blocks one after another;
* non-causal backward: per query block the queries' gradients and the
  sketch's cotangent, summed by a tree, then per key block the keys' and
  values' gradients;
* causal backward: per block the cotangent its outputs send to its
  carried-in state (:func:`racecpu.sketches.causal_block_dstate` from the
  block's output and rows: one product, no rescan), a reverse exclusive
  scan of those, then every block's gradients from its carried-in state,
  its reverse carry and its forward's rows
  (:func:`racecpu.sketches.causal_block_bwd`); ``scan="fused"``: each
  block's gradients from the cotangent of the state its successor's
  backward started from, last block first.

With kept rows no block's forward runs twice in a forward+backward; a worker
holds 272 bytes per token and head (float32, P = L = 3) from a block's
forward to its backward.  Without them (``keep_rows=False``) the gradient
tasks recompute their block's forward, and the only values held between
tasks are sketches.  Sketches travel as :class:`WireSketch`: their sums and
a digest of their planes, which every task checks against the planes it is
given.  Results equal the in-memory API up to float rounding (the chunk
totals are summed in another order), and their bits do not depend on the
number of workers or the schedule: the order of every sum is fixed by the
blocks.

Threads.  Dask workers cap OpenMP and BLAS threads but not Numba's: each task
sets Numba's thread count (for the thread it runs on) to ``threads``, by
default the worker's thread count on a ``distributed`` worker, and leaves it
unchanged under other schedulers.

Requires ``dask[array]`` (and ``distributed`` for clusters): ``pip install racecpu[dask]``.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, field

import numpy as np

import dask
import dask.array as da

from . import sketches as S
from ._checks import check_args
from .config import DEFAULT_BETA

__all__ = ["race_attention", "race_attention_fwd", "race_attention_bwd", "DaskResiduals", "WireSketch", "SpilledRows",
           "FAN_IN", "CHAIN_BLOCKS", "SCANS", "FUSED_MEMORY_SHARE", "block_slots", "slot_memory", "pick_scan",
           "BlockPlacement", "block_placement", "graph_of"]

#: Sketches summed per task of the tree reductions.
FAN_IN = 8


# ---------------------------------------------------------------------------
# tasks (module level: they are pickled to the workers)
# ---------------------------------------------------------------------------

def _set_threads(threads):
    """Numba threads for this task: ``threads``, or the distributed worker's thread count.

    On a ``distributed`` worker, also set once per process how racecpu's
    result pool keeps memory (:func:`_worker_pool`)."""
    import numba
    w = None
    try:
        from distributed import get_worker
        w = get_worker()
    except (ImportError, ValueError):
        pass
    if w is not None:
        _worker_pool(w)
    if threads is None:
        if w is None:
            return
        state = getattr(w, "state", None)
        threads = getattr(state, "nthreads", None) or getattr(w, "nthreads", 1)
    numba.set_num_threads(max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS)))


def _worker_pool(worker):
    """Configure racecpu's result pool for a Dask worker (once per process).

    A worker's tasks interleave calls of several kinds (a causal graph runs
    every block's forward and cotangent tasks between two of its backward
    tasks), so the pool's ageing by calls would release the blocks of one
    kind before their next use, and every such task would fault its results
    in afresh: the pool keeps its idle blocks instead, up to its limit,
    lowered to half the worker's memory limit where it has one (idle blocks
    are ``MADV_FREE``: the kernel takes them back when memory runs short)."""
    from ._memory import POOL
    if not POOL.age_by_calls:  # done already
        return
    POOL.age_by_calls = False
    limit = getattr(getattr(worker, "memory_manager", None), "memory_limit", None)
    if limit:
        POOL.set_limit(min(POOL.limit, int(limit) // 2))


@dataclass(frozen=True, eq=False)
class WireSketch:
    """A :class:`racecpu.Sketch` as it travels between tasks: its sums and a digest of its
    planes (:func:`racecpu.sketches.planes_digest`), not the planes themselves, which every
    task is given by the graph; :func:`_sketch` checks the digest against them."""
    A: np.ndarray
    B: np.ndarray
    beta: float
    dtype: np.dtype
    in_dtype: np.dtype
    digest: str

    @property
    def nbytes(self):
        return self.A.nbytes + self.B.nbytes


@dask.sizeof.sizeof.register(WireSketch)
def _sizeof_wire(s):
    return s.nbytes + 300


@dask.sizeof.sizeof.register(S.KeptKeys)
@dask.sizeof.sizeof.register(S.BlockForward)
def _sizeof_rows(rows):
    """A block's kept rows at their arrays' size: Dask's default (``sys.getsizeof``) counts a
    dataclass as a few dozen bytes, so its memory accounting and transfer costs left them out."""
    return rows.nbytes + 300


def _wire(sk):
    """What a task sends for sketch ``sk`` (None for None)."""
    return None if sk is None else WireSketch(sk.A, sk.B, sk.beta, sk.dtype, sk.in_dtype, sk.digest)


def _sketch(w, planes):
    """The :class:`racecpu.Sketch` of wire sketch ``w`` with ``planes`` (None for None), after
    checking that ``planes`` are the ones it was built with."""
    if w is None:
        return None
    if w.digest != S.planes_digest(planes):
        raise ValueError("a sketch reached a task of a graph built with other planes (their digests differ)")
    return S.Sketch(w.A, w.B, planes, w.beta, w.dtype, w.in_dtype, w.digest)


def _t_add(*sketches):
    """The sum of wire sketches (or of floats), left to right (``((s0 + s1) + s2) + ...``)."""
    first = sketches[0]
    if not isinstance(first, WireSketch):
        return sum(sketches)
    A, B = first.A, first.B
    for s in sketches[1:]:
        if s.digest != first.digest or s.beta != first.beta or s.A.shape != first.A.shape or \
                s.B.shape != first.B.shape:
            raise ValueError("sketches of other planes, beta or shapes cannot be added")
        A, B = A + s.A, B + s.B
    return WireSketch(A, B, first.beta, np.result_type(*(s.dtype for s in sketches)),
                      np.result_type(*(s.in_dtype for s in sketches)), first.digest)


def _t_sketch(threads, k, v, mask, planes, beta, cdt, cf):
    _set_threads(threads)
    return _wire(S.sketch(k, v, planes, beta, key_mask=mask, dtype=cdt, check_finite=cf))


def _t_readout(threads, q, sk, planes, cf):
    _set_threads(threads)
    return S.readout(q, _sketch(sk, planes), check_finite=cf)


def _t_readout_bwd(threads, q, sk, g, planes, cf):
    _set_threads(threads)
    dq, dsk, dbeta = S.readout_bwd(q, _sketch(sk, planes), g, check_finite=cf)
    return dq, _wire(dsk), dbeta


def _t_sketch_kept(threads, k, v, mask, planes, beta, cdt, cf):
    """A non-causal block's keys hashed once: ``(sketch, keys)`` (wire sketch, KeptKeys for its backward)."""
    _set_threads(threads)
    sk, keys = S.sketch_kept(k, v, planes, beta, key_mask=mask, dtype=cdt, check_finite=cf)
    return _wire(sk), keys


def _t_sketch_bwd(threads, k, v, dsk, mask, planes, cdt, cf, keys=None):
    _set_threads(threads)
    return S.sketch_bwd(k, v, _sketch(dsk, planes), key_mask=mask, dtype=cdt, check_finite=cf, keys=keys)


def _t_keys(threads, k, v, mask, planes, beta, cdt, keep, cf):
    """A causal block's keys hashed and summed once: ``(total, keys)`` (wire sketch, BlockForward)."""
    _set_threads(threads)
    total, keys = S.causal_block_keys(k, v, planes, beta, key_mask=mask, dtype=cdt, keep=keep, check_finite=cf)
    return _wire(total), keys


@dataclass(frozen=True)
class SpilledRows:
    """A causal block's forward rows written to ``path`` (:meth:`racecpu.sketches.BlockForward.save`):
    what a forward task hands on instead of the rows with ``rows_dir``."""
    path: str


def _load(forward):
    """The :class:`racecpu.sketches.BlockForward` of ``forward`` (read back if spilled; None for None)."""
    return S.BlockForward.load(forward.path) if isinstance(forward, SpilledRows) else forward


def _handed_on(forward, spill):
    """A causal block's kept rows as its forward task hands them on: ``forward`` itself, or with a
    ``spill`` path, a :class:`SpilledRows` where they were written."""
    return forward if spill is None else SpilledRows(forward.save(spill))


def _t_causal(threads, q, k, v, mask, planes, beta, state, keys, keep, spill, cf):
    """A causal block from its carried-in state and its keys' pass: ``out``, or with ``keep``
    ``(out, forward)``: the rows the block's backward tasks read (:func:`_handed_on`)."""
    _set_threads(threads)
    got = S.causal_block(q, k, v, planes, beta, _sketch(state, planes), key_mask=mask, check_finite=cf,
                         keys=keys[1], keep=keep)
    return (got[0], _handed_on(got[2], spill)) if keep else got[0]


def _t_causal_fused(threads, q, k, v, mask, planes, beta, state, keep, spill, cf):
    """A causal block of ``scan="fused"`` from the state its predecessor ended with (None: the
    first block): ``(out, final state)``, with ``keep`` ``(out, final state, forward)`` (as
    :func:`_t_causal`)."""
    _set_threads(threads)
    got = S.causal_block(q, k, v, planes, beta, _sketch(state, planes), key_mask=mask, check_finite=cf, keep=keep,
                         scan=True)
    return (got[0], _wire(got[1])) + ((_handed_on(got[2], spill),) if keep else ())


def _t_causal_dstate(threads, q, k, v, g, mask, planes, beta, state, fwd, keep, use_out, cf):
    _set_threads(threads)
    out, forward = fwd if keep else (fwd, None)
    # Spilled: hash q and k again from the output's block (about what reading the rows back costs,
    # benchmarks/dask_blocks.py) rather than read the file twice; 16-bit outputs need the rows.
    if isinstance(forward, SpilledRows):
        forward = None if use_out else _load(forward)
    return _wire(S.causal_block_dstate(q, k, v, planes, beta, g, _sketch(state, planes), key_mask=mask,
                                       check_finite=cf, out=out if use_out else None, forward=forward))


def _t_causal_bwd(threads, q, k, v, g, mask, planes, beta, state, dstate, forward, cf, fused=False):
    """A causal block's gradients from its carried-in state and the cotangent of its final state:
    ``(dq, dk, dv, dbeta)``; ``fused`` (``scan="fused"``): also the cotangent of its initial
    state, which its predecessor's task starts from."""
    _set_threads(threads)
    got = S.causal_block_bwd(q, k, v, planes, beta, g, _sketch(state, planes), _sketch(dstate, planes),
                             key_mask=mask, check_finite=cf, forward=_load(forward), scan=fused)
    return got[:4] + ((_wire(got[4]),) if fused else ())


def _pick(x, i, *marker):
    """``x[i]``, or ``x`` for ``i`` None (``marker``: see :func:`_outputs`)."""
    return x if i is None else x[i]


def _mark(x):
    """The marker of a task that returns several results (None; see :func:`_outputs`)."""
    return None


#: Prefixes of racecpu's keys whose values hold a block's rows (forward outputs, gradients);
#: every other ``race-`` key holds a sketch, a marker or a scalar.
ROW_KEYS = ("race-keys-", "race-fwd-", "race-causal-", "race-readout-", "race-sketch-bwd-", "race-out-", "race-dq-",
            "race-dk-", "race-dv-")


def holds_rows(name):
    """Whether the key named ``name`` (a str key, or a tuple key's first item) holds a block's rows."""
    return name.startswith(ROW_KEYS)


# ---------------------------------------------------------------------------
# placement: a block's tasks on one worker (for graphs computed in parts)
# ---------------------------------------------------------------------------

def _reads_rows_of(key):
    """Whether a task that reads ``key`` reads a block's rows through it: any key but racecpu's
    keys that hold a sketch, a marker or a scalar (:data:`ROW_KEYS`)."""
    name = key[0] if isinstance(key, tuple) else key
    return not isinstance(name, str) or not name.startswith("race-") or holds_rows(name)


class BlockPlacement:
    """Where :func:`block_placement` puts each task and in which order a worker runs its blocks.

    Picklable, for ``dask.annotate(workers=placement, priority=placement.priority,
    allow_other_workers=True)``: the scheduler calls both with every key it is
    given; a key they were not built with may run on any of ``workers``, at
    Dask's default priority.
    """

    def __init__(self, where, turn, workers):
        self.where = dict(where)  # key -> [worker]
        self.turn = dict(turn)  # key -> its block's turn, 1 for the first block
        self.workers = list(workers)

    def __call__(self, key):
        return self.where.get(key, self.workers)

    def priority(self, key):
        """Dask's user priority (higher first): a block's tasks before the later blocks' (``-turn``);
        0, before any block, for a task of no one block (a sum of sketches, which others wait for)."""
        return -self.turn.get(key, 0)


def graph_of(collections):
    """The union of the Dask graphs of ``collections`` (nested lists and tuples of Dask
    collections, as ``dask.compute`` takes them): the ``graph`` of :func:`block_placement`."""
    from dask.core import flatten

    graph = {}
    for x in flatten(collections, container=(list, tuple)):
        graph.update(dict(x.__dask_graph__()))
    return graph


def block_placement(graph, block_of, workers):
    """Keep every block's tasks on one worker, the blocks in one contiguous run per worker.

    Dask places a task near the data it reads; the sketches of a scan over
    blocks are small, so where a graph runs in several submissions (the
    demo's phases) a block's carried-in state ends up on either worker about
    as often as not, and crosses (docs/distributed.md, "the demo's blocks
    placed"). Placed this way a sketch crosses only where a scan passes
    from one worker's run of blocks to the next.  Not for a graph computed
    in one submission: placed tasks are not queued, so a worker would run
    every block's forward before any backward and hold all their rows
    (measured there); Dask's own placement is the better one then.

    Parameters
    ----------
    graph : mapping
        A Dask graph (key -> task): :func:`graph_of` the collections that will be
        computed, in any number of submissions.
    block_of : mapping
        The root keys that define the blocks (the input chunks a block's tasks
        read) -> their position (sortable: e.g. ``(sequence, block)``).
    workers : sequence of str
        Worker addresses; the blocks, in position order, are split into
        ``len(workers)`` contiguous runs of (nearly) equal length.

    Returns
    -------
    BlockPlacement
        Its priorities run a worker's blocks one after another: restricted
        tasks are not queued by the scheduler, so without them a worker would
        be handed every block's first task at once and, in Dask's order, run
        them all before any block's next (every block's inputs in memory).
        A task that reads the rows of one block (directly or through tasks
        that hold rows; a sketch it reads ties it to no block) runs on that
        block's worker; a sum of sketches, or a task of several blocks or
        none, where the fewest values cross: the worker most often among its
        placed inputs and the nearest tasks that read it and have one block (on
        a tie, the readers' choice, then the first worker), or anywhere if it
        has neither.
    """
    from dask.core import get_deps, toposort

    workers = list(workers)
    if not workers:
        raise ValueError("block_placement needs at least one worker")
    deps, dependents = get_deps(graph)
    missing = [k for k in block_of if k not in graph]
    if missing:
        raise ValueError(f"block_of names keys that are not in the graph: {missing[:3]}")
    order = sorted(set(block_of.values()))
    index = {b: i for i, b in enumerate(order)}
    rank = {b: i * len(workers) // len(order) for i, b in enumerate(order)}  # position -> worker index
    home, turn = {}, {}  # key -> the worker index of its one block, and that block's turn (1, 2, ...)
    blocks = {}  # key -> the blocks it reads, not through a sum
    ordered = toposort(graph, dependencies=deps)
    for key in ordered:
        if key in block_of:
            mine = {block_of[key]}
        else:  # a sketch read (a carry, a sum) ties the task to no block
            mine = set().union(*(blocks[d] for d in deps[key] if _reads_rows_of(d)))
        blocks[key] = mine
        if len(mine) == 1:
            b = next(iter(mine))
            home[key], turn[key] = rank[b], index[b] + 1
    where = {}  # key -> worker index
    for key in ordered:
        if key in home:
            where[key] = home[key]
            continue
        readers, seen, level = [], {key}, set(dependents[key])  # the nearest readers with one block
        while level and not readers:
            readers = [home[k] for k in level if k in home]
            seen |= level
            level = {d for k in level for d in dependents[k]} - seen
        inputs = [where[d] for d in deps[key] if d in where]
        votes = readers + inputs  # each a sketch or a value that would cross if placed elsewhere
        if votes:  # the most votes; on a tie, the readers' choice, then the lower worker
            where[key] = max(set(votes), key=lambda r: (votes.count(r), readers.count(r), -r))
    return BlockPlacement({k: [workers[r]] for k, r in where.items()}, turn, workers)


# ---------------------------------------------------------------------------
# graph building
# ---------------------------------------------------------------------------

def _call(name, fn, *args):
    """A delayed call with a readable, deterministic key ``race-<name>-<token>``."""
    token = dask.base.tokenize(fn.__name__, *args)
    return dask.delayed(fn, pure=True)(*args, dask_key_name=f"race-{name}-{token}")


def _outputs(task, n=None):
    """``task``'s ``n`` results as ``(task, i, marker)`` triples, for :func:`_assemble` and :func:`_part`
    (``n`` None: its one result, ``(task, None, marker)``, for a task that other tasks also read).

    Every task that picks a result depends on ``task`` and on its marker, a
    task of ``task`` alone.  So ``task`` always has two dependents and a pick
    two dependencies, and Dask's linear fusion never merges a pick with
    ``task``: a fused copy gets a new key, and where two collections that
    share ``task`` are optimized apart (a ``distributed`` client computing
    ``da.store(..., compute=False)`` and ``dbeta`` together) ``task`` would
    run twice.  The marker runs where ``task`` did, so the picks add no
    other worker to those the scheduler may place them on.
    """
    marker = dask.delayed(_mark, pure=True)(task, dask_key_name=f"race-marker-{task.key.removeprefix('race-')}")
    return [(task, None, marker)] if n is None else [(task, i, marker) for i in range(n)]


def _part(name, output):
    """Delayed result ``output`` (a triple of :func:`_outputs`)."""
    task, i, marker = output
    return _call(name, _pick, task, i, marker)


def _tree_sum(items, name):
    """Sum of delayed sketches (or floats) by a tree of FAN_IN-ary additions."""
    items = list(items)
    if not items:
        return None
    while len(items) > 1:
        items = [items[i] if len(items[i:i + FAN_IN]) == 1 else _call(name, _t_add, *items[i:i + FAN_IN])
                 for i in range(0, len(items), FAN_IN)]
    return items[0]


def _add(name, a, b):
    """Delayed ``a + b`` of two sketches, where None is zero (no task for a sum with zero)."""
    if a is None:
        return b
    if b is None:
        return a
    return _call(name, _t_add, a, b)


def _exclusive_scan(items, name, method):
    """Delayed exclusive prefix sums ``c_j = items[0] + ... + items[j-1]`` (None: zero).

    ``method`` "chain": ``c_j = c_{j-1} + items[j-1]``, a critical path of one
    addition per item.  "tree": recursive doubling -- the sums of adjacent
    pairs are scanned the same way, and an odd position adds its left
    neighbour to its pair's prefix -- a critical path of about ``2 log2(n)``
    additions and at most ``2 n`` additions in all.  Either way the order of
    every addition is fixed by the positions alone, so the bits do not depend
    on the workers or the schedule (the two methods differ by rounding).
    """
    if method == "chain":
        out, acc = [], None
        for x in items:
            out.append(acc)
            acc = _add(name, acc, x)
        return out
    if len(items) <= 1:
        return [None] * len(items)
    pairs = [_add(name, items[i], items[i + 1]) if i + 1 < len(items) else items[i]
             for i in range(0, len(items), 2)]
    prefix = _exclusive_scan(pairs, name, method)
    return [prefix[i // 2] if i % 2 == 0 else _add(name, prefix[i // 2], items[i - 1]) for i in range(len(items))]


#: The most sequence blocks per head whose carries ``scan="auto"`` adds as a chain (more: a tree),
#: where it does not fuse them; a chain has fewer tasks, a tree a shorter critical path
#: (docs/distributed.md).
CHAIN_BLOCKS = 8

SCANS = ("auto", "fused", "tree", "chain")

#: The share of a block slot's memory that the results of a fused scan's sequences may take
#: before ``scan="auto"`` takes the tree instead (:func:`pick_scan`): half, the rest left to the
#: kept rows (272 bytes per token and head at float32, beside 2,048 of results at d = dv = 128)
#: and the pool's idle blocks.  Measured on 2 workers of 11.75 GiB (docs/distributed.md, "Where a
#: worker's time goes"): fused faster where a worker's two sequences' results came to 4 GiB
#: (2^20 tokens x 4 heads, d = 128), the tree faster where they came to 16 GiB (2^22).
FUSED_MEMORY_SHARE = 0.5


def _worker_slots(nthreads, threads):
    """Block tasks a worker of ``nthreads`` threads runs at once when each takes ``threads``
    (None: all of its worker's, so one)."""
    return 1 if threads is None else max(1, int(nthreads) // threads)


def block_slots(threads=None):
    """How many block tasks the current scheduler runs at once: with a ``distributed`` client,
    the sum over its workers of their threads over ``threads`` (None: a task takes all its
    worker's threads, so one per worker); 1 without one, where a task runs on all of Numba's
    threads (the local schedulers)."""
    try:
        from distributed import get_client
        nthreads = get_client().nthreads()
    except (ImportError, ValueError):
        return 1
    if not isinstance(nthreads, dict):  # an asynchronous client: no answer here
        return 1
    return max(1, sum(_worker_slots(n, threads) for n in nthreads.values()))


def slot_memory(threads=None):
    """Bytes of worker memory per block slot (as :func:`block_slots` counts slots): the
    smallest, over the ``distributed`` client's workers, of a worker's memory limit over its
    slots; None without a client, or where a worker has no memory limit."""
    try:
        from distributed import get_client
        client = get_client()
    except (ImportError, ValueError):
        return None
    if getattr(client, "asynchronous", False):  # no answer here without awaiting
        return None
    try:
        info = client.scheduler_info(n_workers=-1)
    except TypeError:  # a distributed that lists every worker without being asked
        info = client.scheduler_info()
    per_slot = []
    for w in info.get("workers", {}).values():
        limit, n = w.get("memory_limit"), int(w.get("nthreads") or 1)
        if not limit:
            return None
        per_slot.append(int(limit) // _worker_slots(n, threads))
    return min(per_slot) if per_slot else None


def pick_scan(scan, blocks, sequences, slots, held=0, memory=None):
    """The causal scan ``scan="auto"`` means for ``sequences`` independent sequences of
    ``blocks`` blocks each when ``slots`` block tasks run at once: "fused" where every slot
    has a sequence of its own (no block's keys are read twice, nothing is summed across
    blocks) and the results a slot's sequences hold fit in :data:`FUSED_MEMORY_SHARE` of
    ``memory``, the bytes of a slot (None: no limit); else "chain" up to
    :data:`CHAIN_BLOCKS` blocks and "tree" beyond; another ``scan`` as given.

    ``held``: the bytes of one sequence's results (its output, and dq, dk and dv
    where a backward may follow).  Dask's
    static order runs a fused sequence's chain of blocks before the tasks that
    consume their results (a ``da.store`` or ``to_zarr``), so a worker holds
    every result of its sequences until their chains end (measured in
    docs/distributed.md, "Where a worker's time goes"); the tree's blocks are
    independent, and their results are stored as they come."""
    if scan != "auto":
        return scan
    per_slot = -(-sequences // max(1, slots))
    if sequences >= slots and (memory is None or held * per_slot <= FUSED_MEMORY_SHARE * memory):
        return "fused"
    return "chain" if blocks <= CHAIN_BLOCKS else "tree"


def _stand_in(x):
    """A zero-stride array with x's shape and dtype, for the NumPy API's shape checks."""
    return np.broadcast_to(np.zeros((), x.dtype), x.shape)


def _as_dask(x):
    if x is None or isinstance(x, da.Array):
        return x
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = np.asarray(x)
    return da.from_array(x, chunks=x.shape if x.ndim == 0 else "auto", name=False)


def _align(x, like_chunks, whole_last=True):
    """Rechunk x to ``like_chunks`` on all axes but the last (one chunk on the last)."""
    chunks = tuple(like_chunks) + ((x.shape[-1],) if whole_last else ())
    return x.rechunk(chunks) if x.chunks != chunks else x


def _blocks(x):
    """``x``'s delayed blocks as an object array of its numblocks (None for None)."""
    return None if x is None else x.to_delayed(optimize_graph=False)


def _assemble(pieces, chunks, dtype, name):
    """Dask array from an object array of ``(delayed task, index, marker)`` laid out as ``chunks``.

    ``index`` and ``marker`` are None for a task that returns the block
    itself, else as :func:`_outputs` gives them.  Each block's key is the
    array's own key ``(name, *index)``, computed by :func:`_pick` from the
    block's racecpu task: no alias task that the scheduler could place on
    another worker and move rows to."""
    from dask.highlevelgraph import HighLevelGraph
    name = f"race-{name}-{dask.base.tokenize(*(t.key for t, _, _ in pieces.flat))}"
    layer, deps = {}, {}
    for idx, (t, i, m) in zip(np.ndindex(pieces.shape), pieces.flat):
        layer[(name,) + idx] = (_pick, t.key, i) + (() if m is None else (m.key,))
        deps.update({x.key: x for x in (t, m) if x is not None})
    graph = HighLevelGraph.from_collections(name, layer, dependencies=list(deps.values()))
    meta = np.empty((0,) * len(chunks), dtype)
    return da.Array(graph, name, chunks, dtype=dtype, meta=meta)


def _scalar(items):
    items = [x for x in items if x is not None]
    total = _tree_sum(items, "dbeta") if items else dask.delayed(0.0)
    return da.from_delayed(dask.delayed(float)(total), (), dtype=np.float64)


@dataclass(frozen=True)
class DaskResiduals:
    """What :func:`race_attention_bwd` needs from :func:`race_attention_fwd` (treat as opaque).

    The (rechunked) dask inputs and the delayed sketches: per block of the
    leading axes, the key sketch's total (non-causal) or the carried-in
    state of every sequence block (causal; and the blocks' forward tasks,
    whose outputs, and with ``keep_rows`` rows, give the cotangents the
    blocks send to their states and their gradients without a rescan).
    Nothing is computed until a
    result is; computing the forward's output and the gradients together
    (``dask.compute(out, dq, ...)``) computes the sketches once.
    """
    q: object
    k: object
    v: object
    mask: object
    planes: np.ndarray
    beta: float
    causal: bool
    cdt: np.dtype
    odt: np.dtype
    check_finite: bool
    threads: object
    states: dict
    outputs: dict
    keep_rows: bool = False
    scan: str = "auto"
    forwards: dict = field(default_factory=dict)  # per leading block: its blocks' kept rows (or None each)


def _check_threads(threads):
    """``threads`` as a Python int (or None) after checking it: the tasks would fail only when
    computed, and would run 0 or fewer threads as 1."""
    if threads is None:
        return None
    if isinstance(threads, (bool, np.bool_)) or not isinstance(threads, numbers.Integral):
        raise TypeError(f"threads must be a positive int or None, got {type(threads).__name__} {threads!r}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    return int(threads)


def _prepare(q, k, v, planes, beta, causal, key_mask):
    q, k, v, key_mask = (_as_dask(x) for x in (q, k, v, key_mask))
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype.kind != "f" or x.dtype.itemsize > 8:
            raise TypeError(f"{name} must be a float16, float32 or float64 array, got dtype {x.dtype}")
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., N, d), got shape {x.shape}")
    if key_mask is not None and key_mask.dtype != np.bool_:
        raise TypeError(f"key_mask must be a bool array, got dtype {key_mask.dtype}")
    cdt, odt, lead, _, W, beta, _ = check_args(_stand_in(q), _stand_in(k), _stand_in(v), planes, beta, causal,
                                            None if key_mask is None else _stand_in(key_mask))
    q = q.rechunk(q.chunks[:-1] + ((q.shape[-1],),)) if len(q.chunks[-1]) > 1 else q
    if causal:
        k, v = _align(k, q.chunks[:-1]), _align(v, q.chunks[:-1])
        key_mask = None if key_mask is None else _align(key_mask, q.chunks[:-1], False)
    else:
        k = _align(k, q.chunks[:-2] + (k.chunks[-2],))
        v = _align(v, k.chunks[:-1])
        key_mask = None if key_mask is None else _align(key_mask, k.chunks[:-1], False)
    return q, k, v, key_mask, W, beta, cdt, odt


def race_attention_fwd(q, k, v, planes, beta=DEFAULT_BETA, *, causal=False, key_mask=None, check_finite=True,
                       threads=None, keep_rows=True, rows_dir=None, scan="auto"):
    """RACE attention forward on Dask arrays; returns ``(out, residuals)`` for :func:`race_attention_bwd`.

    Parameters
    ----------
    q : dask array (or array-like), shape (..., Nq, d)
    k : dask array, shape (..., Nk, d)
    v : dask array, shape (..., Nk, dv)
        Chunked along the sequence axis; ``k`` and ``v`` are rechunked to
        ``q``'s chunks on the leading axes (causal: on the sequence axis
        too), ``v`` to ``k``'s, every input to one chunk on its last axis.
        Other array-likes (NumPy, zarr) become one-chunk-per-"auto" dask
        arrays.
    planes, beta, causal, check_finite :
        As for :func:`racecpu.race_attention`.
    key_mask : bool dask array, shape (..., Nk), optional
        Rechunked to ``k``'s chunks.
    threads : int, optional
        Numba threads per task (default: the worker's thread count on a
        ``distributed`` worker; unchanged under other schedulers), at most
        Numba's thread count.  A positive int: anything else raises
        TypeError or ValueError here, not when the graph is computed.
    keep_rows : bool, default True
        Causal: each block's forward task keeps the rows its backward tasks
        read (soft buckets, projections, denominators: 272 bytes per token
        and head at float32, P = L = 3, held by the worker from the forward
        task to the block's gradient task), so that no block's forward runs
        twice in a forward+backward.  Non-causal: each block's sketch task
        keeps its keys' soft buckets and projections (132 bytes per key and
        head at float32, held in the worker's memory until the block's
        gradient task: every key block's at once), so that no key is hashed
        twice.  False: the gradient tasks recompute their block's forward
        (about one more forward in all; non-causal: the keys' hash), and a
        worker holds no rows between tasks; :func:`race_attention` (no
        backward) keeps none.
    rows_dir : str or path, optional
        Causal, with ``keep_rows``: each forward task writes its rows to a
        file there (``<task key>.npz``, 272 bytes per token and head at
        float32) and hands on the path, so that the workers hold no rows
        between the forward and the backward (a driver that computes them
        in phases, as ``racecpu demo --dask`` does, bounds memory this way).
        Every worker must be able to read what any worker wrote there (one
        machine, or a shared file system); the files stay: delete them
        when done.
    scan : {"auto", "fused", "tree", "chain"}, default "auto"
        Causal: how each block gets the state of every key before it (and,
        backward, the cotangent from every query after it).  "fused": from
        its predecessor's forward task, which ends with it (and backward
        from its successor's gradient task): one pass over each block, no
        sums across blocks, but a sequence's blocks run one after another,
        so only the sequences (blocks of the leading axes) run in parallel.
        "chain" and "tree": every block's keys are summed first, in a pass
        of their own, and those states added across blocks, one addition
        after another (a critical path of one link per block) or by a
        parallel prefix (about ``2 log2(blocks)`` links); then the blocks'
        forwards run in parallel.  "auto": :func:`pick_scan` with
        :func:`block_slots` and :func:`slot_memory` (fused where the
        sequences fill the cluster's slots and their results, the output
        and the gradients a backward would add, fit in
        :data:`FUSED_MEMORY_SHARE` of a slot's memory: a worker holds a fused
        sequence's results until its chain ends; :func:`race_attention`,
        which no backward follows, counts the output alone).  The order of
        every sum is fixed by the blocks, so the results' bits do not depend
        on the number of workers or the schedule; the scans differ from each
        other by rounding.

    Returns
    -------
    out : dask array, shape (..., Nq, dv)
        Chunks of ``q`` (last axis: one chunk); dtype as :func:`racecpu.race_attention`.
    residuals : DaskResiduals
    """
    return _forward(q, k, v, planes, beta, causal, key_mask, check_finite, threads, keep_rows, rows_dir, scan,
                    backward=True)


def _forward(q, k, v, planes, beta, causal, key_mask, check_finite, threads, keep_rows, rows_dir, scan, backward):
    """:func:`race_attention_fwd`; ``backward``: whether a backward may follow (what a fused
    chain would hold, for ``scan="auto"``)."""
    threads = _check_threads(threads)
    if scan not in SCANS:
        raise ValueError(f"scan must be one of {SCANS}, got {scan!r}")
    q, k, v, m, W, beta, cdt, odt = _prepare(q, k, v, planes, beta, causal, key_mask)
    keep = bool(keep_rows) and bool(causal)
    keep_keys = bool(keep_rows) and not causal  # a non-causal block's keys' soft buckets, for its backward
    spill_dir = None if rows_dir is None or not keep else os.fspath(rows_dir)
    qb, kb, vb, mb = _blocks(q), _blocks(k), _blocks(v), _blocks(m)
    nlead = qb.shape[:-2]
    dv = v.shape[-1]
    if causal:
        if scan == "auto":
            # A sequence's results: out, and the gradients dq, dk, dv a backward would add.
            held = q.shape[-2] * dv * odt.itemsize
            if backward:
                held += (q.shape[-2] * q.shape[-1] * q.dtype.itemsize
                         + k.shape[-2] * (k.shape[-1] * k.dtype.itemsize + dv * v.dtype.itemsize))
            scan = pick_scan(scan, qb.shape[-2], int(np.prod(nlead)), block_slots(threads), held,
                             slot_memory(threads))
    out = np.empty(qb.shape, object)
    states, outputs, forwards = {}, {}, {}
    cf, thr = bool(check_finite), threads
    for b in np.ndindex(nlead):
        mask = (lambda j: None) if mb is None else (lambda j: mb[b + (j,)])
        if causal and scan == "fused":
            nb = qb.shape[-2]
            # a file per block, named by what the block's forward reads (its task's key is not known yet)
            spill = [None if spill_dir is None else os.path.join(spill_dir, "race-fused-" + dask.base.tokenize(
                *(x[b + (j, 0)].key for x in (qb, kb, vb)), W, beta, cdt, None if mb is None else mb[b + (j,)].key)
                + ".npz") for j in range(nb)]
            carries, tasks, rows, state = [], [], [], None
            for j in range(nb):  # each block from the state its predecessor ended with
                carries.append(state)
                t = _call("causal", _t_causal_fused, thr, qb[b + (j, 0)], kb[b + (j, 0)], vb[b + (j, 0)], mask(j), W,
                          beta, state, keep, spill[j], cf)
                picks = _outputs(t, 3 if keep else 2)
                out[b + (j, 0)] = picks[0]
                state = _part("carry", picks[1]) if j + 1 < nb else None
                tasks.append(t)
                rows.append(_part("fwd", picks[2]) if keep else None)
            states[b], outputs[b], forwards[b] = carries, tasks, rows
        elif causal:
            nb = qb.shape[-2]
            # Each block's keys are hashed once: the pass that sums its state also keeps their soft buckets
            # for the block's forward task (no separate sketch pass).
            keys = [_call("keys", _t_keys, thr, kb[b + (j, 0)], vb[b + (j, 0)], mask(j), W, beta, cdt, keep, cf)
                    for j in range(nb)]
            totals = [_part("sketch", _outputs(t, 2)[0]) for t in keys[:-1]] + [None]  # the last carries into nothing
            carries = _exclusive_scan(totals, "carry", scan)
            states[b] = carries
            spill = [None if spill_dir is None else os.path.join(spill_dir, f"{keys[j].key}.npz") for j in range(nb)]
            outputs[b] = [_call("causal", _t_causal, thr, qb[b + (j, 0)], kb[b + (j, 0)], vb[b + (j, 0)], mask(j), W,
                                beta, carries[j], keys[j], keep, spill[j], cf) for j in range(nb)]
            for j, t in enumerate(outputs[b]):  # marked: the backward's tasks read them too
                out[b + (j, 0)] = _outputs(t, 2)[0] if keep else _outputs(t)[0]
            # each block's rows under a key of their own: a backward computed later reads them, not the outputs
            forwards[b] = [_part("fwd", _outputs(t, 2)[1]) if keep else None for t in outputs[b]]
        else:
            if keep_keys:  # each block's keys hashed once: its sketch task hands their soft buckets to its backward
                kept = [_outputs(_call("keys", _t_sketch_kept, thr, kb[b + (j, 0)], vb[b + (j, 0)], mask(j), W, beta,
                                       cdt, cf), 2) for j in range(kb.shape[-2])]
                tot = [_part("sketch", t[0]) for t in kept]
                forwards[b] = [_part("fwd", t[1]) for t in kept]
            else:
                tot = [_call("sketch", _t_sketch, thr, kb[b + (j, 0)], vb[b + (j, 0)], mask(j), W, beta, cdt, cf)
                       for j in range(kb.shape[-2])]
            total = _tree_sum(tot, "sum") if tot else _call("zeros", _zero_sketch, W, beta,
                                                              tuple(c[i] for c, i in zip(q.chunks, b)), dv, cdt)
            states[b] = total
            for i in range(qb.shape[-2]):
                out[b + (i, 0)] = (_call("readout", _t_readout, thr, qb[b + (i, 0)], total, W, cf), None, None)
    y = _assemble(out, q.chunks[:-1] + ((dv,),), odt, "out")
    return y, DaskResiduals(q, k, v, m, W, beta, bool(causal), cdt, odt, cf, threads, states, outputs, keep, scan,
                            forwards)


def _zero_sketch(W, beta, lead, dv, cdt):
    return _wire(S.Sketch.zeros(W, beta, lead=lead, dv=dv, dtype=cdt))


def race_attention(q, k, v, planes, beta=DEFAULT_BETA, *, causal=False, key_mask=None, check_finite=True,
                   threads=None):
    """RACE attention on Dask arrays: :func:`race_attention_fwd`'s output alone (lazy).

    Arguments as :func:`race_attention_fwd`.  Returns a dask array of shape
    ``(..., Nq, dv)`` that equals :func:`racecpu.race_attention` on the
    computed inputs up to float rounding.
    """
    return _forward(q, k, v, planes, beta, causal, key_mask, check_finite, threads, False, None, "auto",
                    backward=False)[0]


def race_attention_bwd(residuals, grad_out):
    """RACE attention backward on Dask arrays.

    Parameters
    ----------
    residuals : DaskResiduals
        From :func:`race_attention_fwd`.
    grad_out : dask array (or array-like), shape of the forward's output
        Rechunked to the output's chunks.

    Returns
    -------
    dq, dk, dv : dask arrays
        Shapes and dtypes of q, k, v; chunks those of the (rechunked) inputs.
    dbeta : 0-d dask array, float64
        Gradient w.r.t. beta, summed over every batch, head and token.
    """
    r = residuals
    if not isinstance(r, DaskResiduals):
        raise TypeError(f"residuals must come from racecpu.dask.race_attention_fwd, got {type(r).__name__}")
    g = _as_dask(grad_out)
    want = r.q.shape[:-1] + (r.v.shape[-1],)
    if g.shape != want:
        raise ValueError(f"grad_out must have the output's shape {want}, got {g.shape}")
    if g.dtype.kind != "f" or g.dtype.itemsize > 8:
        raise TypeError(f"grad_out must be a float16, float32 or float64 array, got dtype {g.dtype}")
    g = _align(g, r.q.chunks[:-1])
    qb, kb, vb, gb, mb = _blocks(r.q), _blocks(r.k), _blocks(r.v), _blocks(g), _blocks(r.mask)
    dq = np.empty(qb.shape, object)
    dk = np.empty(kb.shape, object)
    dv = np.empty(vb.shape, object)
    dbetas = []
    cf, thr, W, beta = r.check_finite, r.threads, r.planes, r.beta
    for b in np.ndindex(qb.shape[:-2]):
        mask = (lambda j: None) if mb is None else (lambda j: mb[b + (j,)])
        if r.causal and r.scan == "fused":
            carries, nb, dfinal = r.states[b], qb.shape[-2], None
            for j in range(nb - 1, -1, -1):  # each block from the cotangent its successor's backward started from
                t = _call("causal-bwd", _t_causal_bwd, thr, qb[b + (j, 0)], kb[b + (j, 0)], vb[b + (j, 0)],
                          gb[b + (j, 0)], mask(j), W, beta, carries[j], dfinal, r.forwards[b][j], cf, True)
                picks = _outputs(t, 5)
                dq[b + (j, 0)], dk[b + (j, 0)], dv[b + (j, 0)], d_beta = picks[:4]
                dbetas.append(_part("dbeta-part", d_beta))
                dfinal = _part("rcarry", picks[4]) if j > 0 else None
        elif r.causal:
            carries = r.states[b]
            nb = qb.shape[-2]
            # The cotangent block j's outputs send to its state, from its forward output and rows (a product)
            # rather than a rescan; from the rows alone where the output is narrower than the compute dtype.
            use_out = r.odt.itemsize >= np.dtype(r.cdt).itemsize
            fwds = r.outputs[b]
            blk = [(qb[b + (j, 0)], kb[b + (j, 0)], vb[b + (j, 0)], gb[b + (j, 0)]) for j in range(nb)]
            parts = [None] + [_call("dstate", _t_causal_dstate, thr, *blk[j], mask(j), W, beta, carries[j], fwds[j],
                                    r.keep_rows, use_out, cf) for j in range(1, nb)]
            # reverse carries rc_j = parts_{j+1} + ... + parts_{nb-1}: an exclusive scan of the reversed list
            rc = _exclusive_scan(parts[::-1], "rcarry", r.scan)[::-1]
            for j in range(nb):
                t = _call("causal-bwd", _t_causal_bwd, thr, *blk[j], mask(j), W, beta, carries[j], rc[j],
                          r.forwards[b][j], cf)
                dq[b + (j, 0)], dk[b + (j, 0)], dv[b + (j, 0)], d_beta = _outputs(t, 4)
                dbetas.append(_part("dbeta-part", d_beta))
        else:
            total = r.states[b]
            parts = []
            for i in range(qb.shape[-2]):
                t = _call("readout-bwd", _t_readout_bwd, thr, qb[b + (i, 0)], total, gb[b + (i, 0)], W, cf)
                dq[b + (i, 0)], d_sketch, d_beta = _outputs(t, 3)
                parts.append(_part("dsketch-part", d_sketch))
                dbetas.append(_part("dbeta-part", d_beta))
            dsk = _tree_sum(parts, "dsum")  # every dask array has a block, even of no rows
            kept = r.forwards.get(b) or [None] * kb.shape[-2]  # the keys' soft buckets, where the forward kept them
            for j in range(kb.shape[-2]):
                t = _call("sketch-bwd", _t_sketch_bwd, thr, kb[b + (j, 0)], vb[b + (j, 0)], dsk, mask(j), W, r.cdt,
                          cf, kept[j])
                dk[b + (j, 0)], dv[b + (j, 0)], d_beta = _outputs(t, 3)
                dbetas.append(_part("dbeta-part", d_beta))
    return (_assemble(dq, r.q.chunks, r.q.dtype, "dq"), _assemble(dk, r.k.chunks, r.k.dtype, "dk"),
            _assemble(dv, r.v.chunks, r.v.dtype, "dv"), _scalar(dbetas))

"""RACE attention over sequences larger than RAM (chunked, on ``np.memmap``, zarr or any sliceable array).

:func:`race_attention_fwd_ooc` and :func:`race_attention_bwd_ooc` compute
exactly what :func:`racecpu.race_attention_fwd` / ``_bwd`` compute, but read
their inputs and write their outputs one *block* of tokens at a time, so peak
RAM is ``O(block * heads * (d + dv))`` whatever the sequence length.  Inputs
are ``np.memmap``, ``ndarray``, row sources (objects that generate rows on
demand, such as :class:`racecpu.apps.ooc_demo.SeededArray`) or array-likes
that slice (``shape``, ``dtype`` and ``__getitem__`` returning what
``np.asarray`` takes: a ``zarr.Array``, a dask array...; see
:mod:`racecpu._blocks`), and outputs go into caller-supplied ``out=`` arrays
(``np.memmap`` opened ``'r+'``/``'w+'``, ``ndarray``, or an array-like with
``__setitem__`` such as a ``zarr.Array`` opened writable; read-only ones are
refused).  The results are the same bits whatever the kinds.  An array-like
is read or written one block of every head per call, so a zarr array is best
chunked along the tokens by a divisor of ``block`` (other chunks work, with
partial-chunk reads and writes).  After every block the pages of
memory-mapped arguments are dropped from this process
(``madvise(MADV_DONTNEED)``; written data stays in the file), so mapped files
do not pile up in the resident set.

Passes (each a scan of :mod:`racecpu._blocks` that carries a small float64 state,
each block computed by the CPU engine's block operations, :mod:`racecpu.engine`):

* non-causal forward: a sketch pass over keys (running sums ``A, B``), then an
  output pass over queries;
* causal forward: one pass carrying the prefix state ``(A, B)``; the state at
  every block boundary is kept (``O(L R dv)`` per block) for the backward;
* non-causal backward: a pass over queries (``dq`` and running sums
  ``dA, dB``), then a pass over keys (``dk, dv``);
* causal backward: one reverse pass carrying the suffix sums ``(dA, dB)``;
  each block recomputes its forward from the stored boundary state.

Checkpoints.  With ``checkpoint=DIR`` every pass records, after each block
whose outputs are flushed to disk, the carried state (``.npy`` row) and then a
manifest (JSON, replaced atomically).  Rerunning with the same arguments and
``DIR`` resumes after the last recorded block, giving the same bits as an
uninterrupted run; if anything in the arguments changed (shapes, planes,
beta, block, output files or zarr stores, input files' size/mtime, the
contents of in-RAM, zarr and array-like inputs) the pass restarts from the
first block.  What identifies each kind of argument is listed in
:mod:`racecpu._blocks`; the contents of a zarr or array-like input are
checked by a SHA-256 that costs one extra read pass over it per checkpointed
call (none without ``checkpoint``).  A pass is reported complete only by its manifest.  Nothing
on disk is trusted: the manifest, every recorded state row and every done
block's outputs carry checksums that a resume verifies (so an output file
reopened ``'w+'``, a truncated state file or an edited manifest restarts the
pass from its first block, with a :class:`racecpu._blocks.CheckpointWarning`
that says why; so does a folder, link or special file where a manifest
or state file belongs, which the restart removes), and a pass that reads
another's state resumes only onto the same state.

Not supported here: ``key_mask`` and float16 compute (pass float32).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np

from . import _blocks as blocks
from . import engine
from ._checks import check_beta, check_planes, kv_lead
from ._memory import Buffers
from .config import CHUNK
from .hashing import DEFAULT_BETA, soft_buckets

__all__ = ["race_attention_fwd_ooc", "race_attention_bwd_ooc", "OocResiduals", "BLOCK"]

#: Default tokens per block (per head); a multiple of ``CHUNK`` so the chunk
#: grid is that of the in-memory kernels.  At 4 heads, d = dv = 128, float32
#: the backward's block buffers take about 0.5 GiB.
BLOCK = 32 * CHUNK


# ---------------------------------------------------------------------------
# residuals, forward and backward
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class OocResiduals:
    """What :func:`race_attention_bwd_ooc` needs from :func:`race_attention_fwd_ooc`.

    References to the inputs (they must not change in between) and the
    carried float64 state: the sketch totals ``(A (G, F), B (G, F, dv))``
    (non-causal) or the prefix state at every block boundary (causal).
    """
    q: object
    k: object
    v: object
    planes: np.ndarray
    beta: float
    causal: bool
    block: int
    lead: tuple
    nq: int
    nk: int
    cdt: np.dtype
    check_finite: bool
    A: np.ndarray
    B: np.ndarray
    key: dict
    group: int = 1  # query heads per key/value head (grouped-query attention)

    @property
    def kv_lead(self):
        return kv_lead(self.lead, self.group)


def _group_of(q, k, v):
    """Query heads per key/value head: 1 where k, v have q's leading dims; else k's and
    v's head axis (the last leading one) divides q's, the others equal."""
    lead, klead = tuple(q.shape[:-2]), tuple(k.shape[:-2])
    if tuple(v.shape[:-2]) == klead:
        if klead == lead:
            return 1
        if len(klead) == len(lead) and lead and klead[:-1] == lead[:-1] and klead[-1] and not lead[-1]:
            # 0 % n == 0, but no group size would do: 0 query heads per key/value head
            raise ValueError(f"k and v must have q's leading dims, or (grouped-query attention) the same leading "
                             f"dims but a head axis (the one before the tokens) that divides q's into groups of at "
                             f"least one query head: q has 0 heads and k, v have {klead[-1]}, got shapes "
                             f"q {q.shape}, k {k.shape}, v {v.shape}")
        if len(klead) == len(lead) and lead and klead[:-1] == lead[:-1] and klead[-1] and lead[-1] % klead[-1] == 0:
            return lead[-1] // klead[-1]
    raise ValueError(f"q, k, v must have the same leading dims, or k and v a head axis (the one before the tokens) "
                     f"that divides q's, got shapes q {q.shape}, k {k.shape}, v {v.shape}")


def _checkpoint_dir(checkpoint):
    """The ``checkpoint`` argument as a directory path, created if missing (None: no checkpoint)."""
    if checkpoint is None:
        return None
    path = os.fspath(checkpoint)
    try:
        os.makedirs(path, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"checkpoint {path!r} is not a directory (it, or a folder above it, is an existing "
                         f"file): pass the path of a directory, new or existing, or move that file away") from None
    return path


def race_attention_fwd_ooc(q, k, v, planes, beta=DEFAULT_BETA, *, causal=False, out, block=BLOCK,
                           checkpoint=None, commit_every=30.0, check_finite=True, progress=True):
    """Chunked RACE attention forward for inputs larger than RAM.

    Parameters
    ----------
    q, k : np.memmap, ndarray, row source or array-like (e.g. zarr.Array), shape (..., Nq, d), (..., Nk, d)
    v : same kinds, shape (..., Nk, dv)
        float32 or float64 (the compute dtype is their common type).  k and
        v may have a head axis (the one before the tokens) that divides q's
        (grouped-query attention, as :func:`racecpu.race_attention`).
    planes, beta, causal :
        As for :func:`racecpu.race_attention`.
    out : np.memmap ('r+'/'w+'), ndarray or writable array-like (e.g. zarr.Array), shape (..., Nq, dv)
        Receives the output (cast to its dtype); any float dtype.
    block : int, default BLOCK
        Tokens per head read at a time; peak RAM grows linearly with it.
    checkpoint : path, optional
        Directory recording progress, created if missing; a rerun with the
        same arguments resumes.  ValueError if the path (or a folder above
        it) is an existing file.
    commit_every : float, default 30
        Seconds between checkpoint commits (each flushes the outputs to disk;
        0 commits after every block).  A pass's last block always commits.
    check_finite : bool, default True
    progress : bool or tqdm bar, default True

    Returns
    -------
    OocResiduals
        For :func:`race_attention_bwd_ooc`; the output is in ``out``.
    """
    cdt = np.result_type(*(blocks.check_store_input(n, x) for n, x in (("q", q), ("k", k), ("v", v))))
    lead = tuple(q.shape[:-2])
    group = _group_of(q, k, v)
    klead = kv_lead(lead, group)
    (nq, d), (nk, dk_), (nv, dv) = q.shape[-2:], k.shape[-2:], v.shape[-2:]
    if dk_ != d:
        raise ValueError(f"q and k must have the same head dim, got shapes q {q.shape} and k {k.shape}")
    if nv != nk:
        raise ValueError(f"k and v must have the same number of tokens, got shapes k {k.shape} and v {v.shape}")
    if causal and nq != nk:
        raise ValueError(f"causal attention needs as many queries as keys, got shapes q {q.shape} and k {k.shape}")
    planes = check_planes(planes, d, cdt)
    beta = check_beta(beta)
    block = blocks.check_block(block)
    blocks.check_store_out("out", out, lead + (nq, dv), readback=checkpoint is not None)
    G = int(np.prod(lead, dtype=np.int64))
    Gk = G // group
    L, P, _ = planes.shape
    F = L * 2 ** P
    ckdir = _checkpoint_dir(checkpoint)  # before the identities: their digests read every input
    ck = ckdir is not None
    key = dict(q=blocks.identity(q, digest=ck), k=blocks.identity(k, digest=ck), v=blocks.identity(v, digest=ck),
               out=blocks.identity(out, written=True),
               planes=hashlib.sha256(planes.tobytes()).hexdigest(), beta=beta, causal=bool(causal),
               block=block, cdt=np.dtype(cdt).name)
    bufs = Buffers()
    shapes = [(Gk, F), (Gk, F, dv)]  # the keys' sketch or state, per key/value head
    ones = np.ones(Gk * block, np.bool_)  # key mask: every key counts

    if causal:
        def body(lo, hi, state):
            n = hi - lo
            qb = blocks.load_block(q, "q", lead, lo, hi, bufs, cdt, check_finite)
            kb = blocks.load_block(k, "k", klead, lo, hi, bufs, cdt, check_finite)
            vb = blocks.load_block(v, "v", klead, lo, hi, bufs, cdt, check_finite)
            ob = bufs("out", (G, n, dv), cdt)
            step = engine.advance(qb, kb, vb, planes, beta, state[0], state[1], ob, keep=(), work=bufs)
            blocks.store_block(out, lead, lo, hi, ob)
            return (step.A, step.B), 0.0

        scan = blocks.Scan(ckdir, "fwd_causal", key, -(-nk // block), shapes, commit_every)
        blocks.run(scan, blocks.block_ranges(nk, block), body, progress, "forward (causal)", [out], [q, k, v])
        A, B = scan.states
        key = dict(key, fwd_sum=scan.digest())  # the backward resumes only onto these very states
    else:
        def sketch(lo, hi, state):
            n = hi - lo
            kb = blocks.load_block(k, "k", klead, lo, hi, bufs, cdt, check_finite)
            vb = blocks.load_block(v, "v", klead, lo, hi, bufs, cdt, check_finite)
            A, B, _ = engine.sketch_keys(kb, vb, ones[:Gk * n].reshape(Gk, n), planes, beta)
            return (state[0] + A, state[1] + B), 0.0

        scan = blocks.Scan(ckdir, "fwd_sketch", key, -(-nk // block), shapes, commit_every)
        (A, B), _ = blocks.run(scan, blocks.block_ranges(nk, block), sketch, progress, "forward: key sketch", [],
                               [k, v])
        # grouped-query attention: every query head reads its key/value head's sketch
        A_q, B_q = np.repeat(A, group, axis=0), np.repeat(B, group, axis=0)
        key = dict(key, sketch_sum=scan.digest())  # what reads the sketch resumes only onto this very one

        def readout(lo, hi, state):
            qb = blocks.load_block(q, "q", lead, lo, hi, bufs, cdt, check_finite)
            blocks.store_block(out, lead, lo, hi, engine.readout(qb, A_q, B_q, planes, beta, work=bufs))
            return (), 0.0

        scan2 = blocks.Scan(ckdir, "fwd_readout", dict(key, sketch=scan.key), -(-nq // block), [], commit_every)
        blocks.run(scan2, blocks.block_ranges(nq, block), readout, progress, "forward: queries", [out], [q])
    return OocResiduals(q, k, v, planes, beta, bool(causal), block, lead, nq, nk, np.dtype(cdt), check_finite,
                        np.asarray(A), np.asarray(B), key, group)


def race_attention_bwd_ooc(res, grad_out, *, dq, dk, dv, checkpoint=None, commit_every=30.0, progress=True):
    """Chunked RACE attention backward for inputs larger than RAM.

    Parameters
    ----------
    res : OocResiduals
        From :func:`race_attention_fwd_ooc` (its inputs must be unchanged).
    grad_out : np.memmap, ndarray, row source or array-like (e.g. zarr.Array), shape (..., Nq, dv)
    dq, dk, dv : np.memmap ('r+'/'w+'), ndarray or writable array-like (e.g. zarr.Array)
        Receive the gradients, shapes of q, k, v; any float dtype.
    checkpoint : path, optional
        Directory recording progress (may be the forward's), created if
        missing; a rerun resumes.  ValueError if the path (or a folder above
        it) is an existing file.
    commit_every : float, default 30
        Seconds between checkpoint commits (see :func:`race_attention_fwd_ooc`).
    progress : bool or tqdm bar, default True

    Returns
    -------
    dbeta : float
        Gradient w.r.t. beta summed over every head and token.
    """
    if not isinstance(res, OocResiduals):
        raise TypeError(f"res must come from race_attention_fwd_ooc, got {type(res).__name__}")
    r = res
    blocks.check_store_input("grad_out", grad_out)
    lead, nq, nk, cdt, block = r.lead, r.nq, r.nk, r.cdt, r.block
    dvdim = r.v.shape[-1]
    if tuple(grad_out.shape) != lead + (nq, dvdim):
        raise ValueError(f"grad_out must have the output's shape {lead + (nq, dvdim)}, got {tuple(grad_out.shape)}")
    for name, x, shape in (("dq", dq, r.q.shape), ("dk", dk, r.k.shape), ("dv", dv, r.v.shape)):
        blocks.check_store_out(name, x, shape, readback=checkpoint is not None)
    G = int(np.prod(lead, dtype=np.int64))
    group, klead = r.group, r.kv_lead
    Gk = G // group
    L, P, _ = r.planes.shape
    F = L * 2 ** P
    planes, beta, cf = r.planes, r.beta, r.check_finite
    ckdir = _checkpoint_dir(checkpoint)
    key = dict(fwd=r.key, g=blocks.identity(grad_out, digest=checkpoint is not None), dq=blocks.identity(dq, True),
               dk=blocks.identity(dk, True),
               dv=blocks.identity(dv, True))
    bufs = Buffers()
    shapes = [(G, F), (G, F, dvdim)]
    if G == 0 or nq == 0 or nk == 0:
        for x in (dq, dk, dv):
            x[(slice(None),) * len(x.shape)] = 0  # one slice a dimension: what array-likes must take
        return 0.0

    if r.causal:
        ranges = blocks.block_ranges(nk, block, reverse=True)

        def body(lo, hi, state):
            b = lo // block
            qb = blocks.load_block(r.q, "q", lead, lo, hi, bufs, cdt, cf)
            kb = blocks.load_block(r.k, "k", klead, lo, hi, bufs, cdt, cf)
            vb = blocks.load_block(r.v, "v", klead, lo, hi, bufs, cdt, cf)
            gb = blocks.load_block(grad_out, "grad_out", lead, lo, hi, bufs, cdt, cf)
            # grouped-query attention: the scans run per key/value head, over its group of query heads
            dqb, dkb, dvb, dbeta, dA, dB = engine.advance_bwd(qb, kb, vb, gb, planes, beta, np.array(r.A[b]),
                                                              np.array(r.B[b]), state[0], state[1], work=bufs)
            blocks.store_block(dq, lead, lo, hi, dqb)
            for x, a in ((dk, dkb), (dv, dvb)):
                blocks.store_block(x, klead, lo, hi, a)
            return (dA, dB), dbeta

        # the reverse state (dA, dB) per key/value head, summed over its group of query heads
        scan = blocks.Scan(ckdir, "bwd_causal", key, len(ranges), [(Gk, F), (Gk, F, dvdim)], commit_every)
        _, dbeta = blocks.run(scan, ranges, body, progress, "backward (causal, reverse)", [dq, dk, dv],
                              [r.q, r.k, r.v, grad_out])
        return dbeta

    # grouped-query attention: every query head reads its key/value head's sketch
    A, B = np.repeat(r.A, group, axis=0), np.repeat(r.B, group, axis=0)
    ones = np.ones(Gk * block, np.bool_)  # key mask: every key counts

    def queries(lo, hi, state):
        qb = blocks.load_block(r.q, "q", lead, lo, hi, bufs, cdt, cf)
        gb = blocks.load_block(grad_out, "grad_out", lead, lo, hi, bufs, cdt, cf)
        dqb, dA, dB, dbeta = engine.readout_bwd(qb, A, B, gb, planes, beta, work=bufs)
        blocks.store_block(dq, lead, lo, hi, dqb)
        return (state[0] + dA, state[1] + dB), dbeta

    scan = blocks.Scan(ckdir, "bwd_queries", key, -(-nq // block), shapes, commit_every)
    (dA, dB), dbeta_q = blocks.run(scan, blocks.block_ranges(nq, block), queries, progress, "backward: queries", [dq],
                                   [r.q, grad_out])
    dA, dB = engine.group_sum(dA, group), engine.group_sum(dB, group)  # a sketch read by its whole group

    def keys(lo, hi, state):
        n = hi - lo
        kb = blocks.load_block(r.k, "k", klead, lo, hi, bufs, cdt, cf)
        vb = blocks.load_block(r.v, "v", klead, lo, hi, bufs, cdt, cf)
        dkb, dvb, dbeta = engine.keys_bwd(kb, vb, ones[:Gk * n].reshape(Gk, n), dA, dB, planes, beta, work=bufs)
        for x, a in ((dk, dkb), (dv, dvb)):
            blocks.store_block(x, klead, lo, hi, a)
        return (), dbeta

    scan2 = blocks.Scan(ckdir, "bwd_keys", dict(key, queries=scan.key, queries_sum=scan.digest()), -(-nk // block), [],
                        commit_every)
    _, dbeta_k = blocks.run(scan2, blocks.block_ranges(nk, block), keys, progress, "backward: keys", [dk, dv],
                            [r.k, r.v])
    return dbeta_q + dbeta_k


def noncausal_rows(q, A, B, planes, beta):
    """Rows ``q (n, d)`` read out of the summed key sketch ``A (F,), B (F, dv)`` (float64).

    Built from :func:`racecpu.soft_buckets` rather than the kernels, so it
    checks them independently: the out-of-core demo compares its first rows with it.
    """
    L = planes.shape[0]
    phi = soft_buckets(q, planes, beta).reshape(len(q), -1).astype(np.float64)
    den = phi @ A / L
    return (phi @ B / L) / den[:, None]

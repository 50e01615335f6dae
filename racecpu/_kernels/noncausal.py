"""Non-causal RACE attention: the keys' sketch, its readout by the queries, and both backwards.

Forward (Algorithm 1 of the paper; ``docs/design.md`` section 1): every key is
hashed and its sketch summed per chunk (:func:`sketch_chunks`, float64 chunk
totals ``A (F,)``, ``B (F, dv)``), the chunk totals are summed, and every query
reads the sum (:func:`queries_fwd`: ``out_i = phiq_i B / phiq_i . A``).
Backward (``docs/design.md`` section 3): the queries' cotangents and the chunk
totals of ``(dA, dB)`` (:func:`queries_bwd`), then the keys' cotangents from
their sum (:func:`keys_bwd`).  The causal scan (:mod:`.causal`) reuses the
keys' chunk totals and the per-token readout's backward (:func:`dphi_from_y`,
:func:`queries_chunk_end`).
"""

from __future__ import annotations

import numpy as np

from ..config import BLAS_SPAN, DEN_FLOOR, SCAN_BLOCK
from ._jit import kernel
from .hash import hash_bwd_rows_dw, hash_chunk, hash_sketch_range, residual_rows
from .products import add_rows, combine_rows, dot_rows, span_totals
from .runtime import blas_tasks, run_tasks
from .bundles import Backward, QueryScratch, Spread, Sums
from .scan import even_chunks, spread_order, task_bounds


#: ``span`` of :func:`sketch_chunks` for totals that no scan has to match:
#: each hash block's product as soon as it is hashed (:func:`hash_sketch_range`).
SKETCH_FUSED = 0


@kernel
def readout_rows(phiq, A, S, L, den, out):
    """out_i = (phiq_i S) / (phiq_i . A) with the 1/L of both, den_i = phiq_i . A / L, every row.

    A is float64; S is (F, dv) in the compute dtype.  Rows whose den is at
    most DEN_FLOOR get zeros (see hashing.DEN_FLOOR).  The rows of phiq are
    scaled first, so that out is written once, streamed
    (:func:`combine_rows`): an sgemm and a pass scaling its result read and
    wrote every row of out twice.
    """
    n, F = phiq.shape
    w = np.empty((n, F), phiq.dtype)
    for i in range(n):
        dn = 0.0
        for f in range(F):
            dn += phiq[i, f] * A[f]
        dn /= L
        den[i] = dn
        inv = 1.0 / (L * dn) if dn > DEN_FLOOR else 0.0  # the floor: zeros
        for f in range(F):
            w[i, f] = phiq[i, f] * inv
    combine_rows(w, S, out, True)


@kernel
def dphi_from_y(phiq, A, den, L, dphi, wq):
    """Cotangent of one row of :func:`readout_rows` w.r.t. phiq, once ``dphi``
    (float64) holds y = S g; returns dden.

    dden = -(phiq . y) / (L den^2),  dphiq = y / (L den) + A dden / L
    (overwriting ``dphi``), and the weights ``wq = phiq / (L den)`` with which
    g enters dB (dB += wq g^T).  Rows at the DEN_FLOOR get zeros.
    """
    F = phiq.shape[0]
    if den <= DEN_FLOOR:
        for f in range(F):
            dphi[f] = 0.0
            wq[f] = 0.0
        return 0.0
    inv = 1.0 / (L * den)
    phiy = 0.0
    for f in range(F):
        phiy += phiq[f] * dphi[f]
    dden = -phiy * inv / den
    for f in range(F):
        dphi[f] = dphi[f] * inv + A[f] * dden / L
        wq[f] = phiq[f] * inv
    return dden


@kernel
def _sketch_chunks_task(task, spread, k, v, mask, hsh, chunks, span, rows, part, nan):
    """One (group, chunk) task of :func:`sketch_chunks` (run by :func:`run_tasks`)."""
    partA, partB = part
    F = rows.phik.shape[2]
    g, c, lo, hi = task_bounds(spread.order[task], chunks)
    if span == SKETCH_FUSED:
        # phik, tk with no rows (a forward with no backward): hash_block writes none
        nan[task] = hash_sketch_range(k[g, lo:hi], v[g, lo:hi], 0, hi - lo, hsh, mask[g, lo:hi],
                                      rows.tk[g, lo:hi], rows.phik[g, lo:hi], partA[g, c], partB[g, c])
        return
    phi, _, nan[task] = hash_chunk(k, g, lo, hi, hsh, mask[g, lo:hi], rows.tk, rows.phik)
    add_rows(partA[g, c], phi)
    if spread.t0 <= c < spread.t1:
        span_totals(phi, v[g, lo:hi], span, False, partB[g, c], np.empty((F, v.shape[2]), v.dtype))


@blas_tasks
def sketch_chunks(k, v, mask, hsh, chunk, rows, part, span=None, totals=None, chunks=None):
    """Hash every key and sum its sketch per chunk.

    Parameters
    ----------
    k : (G, Nk, d), v : (G, Nk, dv)
        Keys and values, C-contiguous, compute dtype.
    mask : bool (G, Nk)
        False keys get phi = 0 (t is still written).
    hsh : Hash
    chunk : int
        Tokens per chunk; ``part`` has ``nc = ceil(Nk / chunk)`` chunks.
    rows : Rows
        Only ``phik`` and ``tk`` are written (either may have no rows: a
        forward with no backward keeps none).
    part : Sums
        Out: ``A (G, nc, F)`` float64, zeros on entry (the chunk totals are
        added); ``B (G, nc, F, dv)`` float64 (written for the chunks of
        ``totals``, not read).
    span : int, optional
        Rows per product of the B totals: default SCAN_BLOCK, the causal
        scans' steps (:func:`racecpu._kernels.products.span_totals`: the
        same bits as a scan tracks them); SKETCH_FUSED: each hash block's
        product as soon as it is hashed (:func:`racecpu._kernels.hash.hash_sketch_range`),
        where no scan has to match.
    totals : (int, int), optional
        The chunks ``[c0, c1)`` of every group whose B totals are summed
        (default all; the causal forward needs those before its last segment).
    chunks : Chunks, optional
        Each chunk's rows (default: chunks of ``chunk``; packed sequences
        start a chunk each).

    Returns
    -------
    int
        The number of NaNs in the keys' t: a NaN/Inf in k, or a projection
        that overflowed (see :func:`racecpu._kernels.hash.hash_block`).
    """
    partA = part.A
    G, nc = partA.shape[:2]
    t0, t1 = (0, nc) if totals is None else totals
    nan = np.zeros(G * nc, np.int64)
    chunks = even_chunks(k.shape[1], chunk) if chunks is None else chunks
    run_tasks(_sketch_chunks_task, G * nc, Spread(spread_order(G, nc, t0, t1), t0, t1), k, v, mask, hsh, chunks,
              SCAN_BLOCK if span is None else span, rows, part, nan)
    return int(nan.sum())


@kernel
def _keys_bwd_task(task, v, rows, dsum, hsh, chunks, grads):
    """One (group, chunk) task of :func:`keys_bwd` (run by :func:`run_tasks`)."""
    phik, tk = rows.phik, rows.tk
    F = phik.shape[2]
    g, c, lo, hi = task_bounds(task, chunks)
    s = chunks.seq[c]
    dA, dB = dsum.A[g, s], dsum.B[g, s]  # the cotangent of the chunk's sequence's sketch
    DPHI = np.empty((hi - lo, F), np.float64)
    combine_rows(phik[g, lo:hi], dB, grads.dv[g, lo:hi], True)  # dv_j = dB^T phik_j (masked keys: 0)
    dot_rows(dB, v[g, lo:hi], DPHI)  # dphik_j = dB v_j + dA
    for j in range(hi - lo):
        for f in range(F):
            DPHI[j, f] += dA[f]
    pg = grads.planes
    grads.dbk[g, c] = hash_bwd_rows_dw(DPHI, phik[g, lo:hi], tk[g, lo:hi], hsh, grads.dk[g, lo:hi], pg.k[g, lo:hi],
                                       pg.dWk[g, c])


@blas_tasks
def keys_bwd(v, rows, dsum, hsh, chunk, grads, chunks=None):
    """Non-causal cotangents of every key from the summed cotangent of the sketch.

    Parameters
    ----------
    v : (G, Nk, dv)
        The forward's values (compute dtype).
    rows : Rows
        The forward's ``phik``, ``tk`` (all rows).
    dsum : Sums
        ``dA (G, F)`` float64 and ``dB (G, F, dv)`` in the compute dtype:
        the cotangent of the summed sketch; with ``chunks``, ``(G, S, F)``
        and ``(G, S, F, dv)``, one per packed sequence.
    hsh : Hash
    chunk : int
    grads : Grads
        Out: ``dk``, ``dv`` (every row written), ``dbk (G, nc)`` (each
        chunk's share of dbeta) and, where computed, ``planes.dWk`` (each
        chunk's share of the planes' gradient, from ``planes.k``).
    chunks : Chunks, optional
        Each chunk's rows and packed sequence, the index into ``dsum``'s
        axis 1 (default: one sequence in chunks of ``chunk``).
    """
    G, nc = grads.dbk.shape
    dsum, chunks = per_sequence(dsum, chunks, v.shape[1], chunk)
    run_tasks(_keys_bwd_task, G * nc, v, rows, dsum, hsh, chunks, grads)


@kernel
def _queries_fwd_task(task, keep, q, hsh, chunks, sketch, rows, out, nan):
    """One (group, chunk) task of :func:`queries_fwd` (run by :func:`run_tasks`)."""
    L = hsh.W.shape[0]
    g, c, lo, hi = task_bounds(task, chunks)
    phi, _, nan[task] = hash_chunk(q, g, lo, hi, hsh, keep[lo:hi], rows.tq, rows.phiq)
    s = chunks.seq[c]  # the chunk's packed sequence, whose sketch its queries read
    readout_rows(phi, sketch.A[g, s], sketch.B[g, s], L, residual_rows(rows.den, g, lo, hi), out[g, lo:hi])


def per_sequence(sketch, chunks, n, chunk):
    """``sketch`` and ``chunks`` as the kernels take them: a sketch per packed sequence,
    ``A (G, S, F)``, ``B (G, S, F, dv)``, and the :class:`Chunks`; for
    ``chunks=None``, the one sketch ``A (G, F)``, ``B (G, F, dv)`` as S = 1
    (views) and ``n`` tokens in chunks of ``chunk``."""
    if chunks is None:
        return Sums(sketch.A[:, None], sketch.B[:, None]), even_chunks(n, chunk)
    return sketch, chunks


@blas_tasks
def queries_fwd(q, hsh, chunk, sketch, rows, out, chunks=None):
    """Hash every query and read the summed sketch.

    Parameters
    ----------
    q : (G, Nq, d)
        Queries (compute dtype).
    hsh : Hash
    chunk : int
    sketch : Sums
        ``A (G, F)`` float64 and ``B (G, F, dv)`` in the compute dtype.
    rows : Rows
        Out: ``phiq``, ``tq``, ``den`` (each may have no rows: not kept).
    out : (G, Nq, dv)
        Out, compute dtype; every row written (streamed).
    chunks : Chunks, optional
        Each chunk's rows and packed sequence: then ``sketch`` holds one per
        sequence, ``A (G, S, F)``, ``B (G, S, F, dv)``, and each chunk's
        queries read their sequence's (default: one, chunks of ``chunk``).

    Returns
    -------
    int
        The number of NaNs in the queries' t (see :func:`racecpu._kernels.hash.hash_block`).
    """
    G, n, _ = q.shape
    sketch, chunks = per_sequence(sketch, chunks, n, chunk)
    keep = np.ones(n, np.bool_)  # queries are never masked
    nan = np.zeros(G * chunks.seq.shape[0], np.int64)
    run_tasks(_queries_fwd_task, nan.size, keep, q, hsh, chunks, sketch, rows, out, nan)
    return int(nan.sum())


@kernel
def query_bwd_buffers(grad, F, n):
    """:class:`QueryScratch` of a query chunk's backward of ``n`` rows."""
    return QueryScratch(np.empty(F, np.float64), np.empty((n, F), grad.dtype),
                        np.zeros(F, np.float64), np.empty((n, F), np.float64))


@kernel
def queries_chunk_end(bwd, partd, g, c, scratch, span):
    """End of a non-causal query chunk's backward; returns the chunk's hash share of dbeta.

    The chunk's total of dA to ``partd.A[g, c]``, and to ``partd.B[g, c]``
    (float64) its dB = sum_i wq_i g_i^T by :func:`span_totals` over ``span``
    rows (last span first, as the reverse scan meets them; span 0: none),
    then the hash backward of every query (``scratch.DPHI`` holds the dphi
    rows) with dq and the chunk's share of the planes' gradient
    (:func:`racecpu._kernels.hash.hash_bwd_rows_dw`).
    """
    grad = bwd.grad
    lo, hi = bwd.chunks.cuts[c], bwd.chunks.cuts[c + 1]
    partd.A[g, c] = scratch.dA
    if span > 0:
        span_totals(scratch.wblock, grad[g, lo:hi], span, True, partd.B[g, c],
                    np.empty((scratch.wblock.shape[1], grad.shape[2]), grad.dtype))
    pg = bwd.grads.planes
    return hash_bwd_rows_dw(scratch.DPHI, bwd.rows.phiq[g, lo:hi], bwd.rows.tq[g, lo:hi], bwd.hsh,
                            bwd.grads.dq[g, lo:hi], pg.q[g, lo:hi], pg.dWq[g, c])


@kernel
def _queries_bwd_task(task, bwd, sketch, partd):
    """One (group, chunk) task of :func:`queries_bwd` (run by :func:`run_tasks`)."""
    grad, phiq, den = bwd.grad, bwd.rows.phiq, bwd.rows.den
    A, B = sketch
    L = bwd.hsh.W.shape[0]
    F = phiq.shape[2]
    g, c, lo, hi = task_bounds(task, bwd.chunks)
    s = bwd.chunks.seq[c]  # the chunk's packed sequence, whose sketch its queries read
    scratch = query_bwd_buffers(grad, F, hi - lo)
    wq, wblock, dA, DPHI = scratch
    dot_rows(B[g, s], grad[g, lo:hi], DPHI)  # y_i = B g_i, turned into dphi_i in place
    for i in range(lo, hi):
        dden = dphi_from_y(phiq[g, i], A[g, s], den[g, i], L, DPHI[i - lo], wq)
        for f in range(F):
            dA[f] += phiq[g, i, f] * dden / L
            wblock[i - lo, f] = wq[f]
    bwd.grads.dbq[g, c] = queries_chunk_end(bwd, partd, g, c, scratch, BLAS_SPAN)


@blas_tasks
def queries_bwd(grad, v, rows, sketch, hsh, chunk, grads, partd, chunks=None):
    """Non-causal cotangents of every query, and the chunk totals of the sketch's cotangent.

    Parameters
    ----------
    grad : (G, Nq, dv)
        The output's cotangent (compute dtype).
    v : (G, Nk, dv)
        The forward's values (not read here; part of :class:`Backward`).
    rows : Rows
        The forward's rows (``phiq``, ``tq``, ``den`` read).
    sketch : Sums
        The forward's ``A (G, F)`` float64 and ``B (G, F, dv)`` in the compute dtype.
    hsh : Hash
    chunk : int
    grads : Grads
        Out: ``dq`` (every row), ``dbq (G, nc)`` and, where computed,
        ``planes.dWq`` (from ``planes.q``).
    partd : Sums
        Out: the chunk totals ``dA (G, nc, F)``, ``dB (G, nc, F, dv)`` (float64).
    chunks : Chunks, optional
        Each chunk's rows and packed sequence: ``sketch`` then holds one per
        sequence (as :func:`queries_fwd`).
    """
    G, nc = partd.A.shape[:2]
    sketch, chunks = per_sequence(sketch, chunks, grad.shape[1], chunk)
    run_tasks(_queries_bwd_task, G * nc, Backward(grad, v, rows, hsh, chunk, grads, chunks), sketch, partd)

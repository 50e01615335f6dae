"""Non-causal RACE attention: the readout of a summed sketch by the queries, and both backwards.

Forward (Algorithm 1 of the paper; ``docs/design.md`` section 1): the keys'
chunk totals of :func:`racecpu._kernels.sketch.sketch_chunks` summed into
one sketch per group (or per packed sequence), then every query hashed and
reading it (:func:`queries_fwd`: the estimator's :func:`readout_rows`).
Backward (``docs/design.md`` section 3): the queries' cotangents and the
chunk totals of ``(dA, dB)`` (:func:`queries_bwd`), then the keys' cotangents
from their sum (:func:`keys_bwd`).  The causal queries' backward
(:mod:`.causal`) ends its chunks as these do (:func:`queries_chunk_end`).

A sketch is read per packed sequence: ``A (G, S, F)``, ``B (G, S, F, dv)``,
chunk ``c``'s queries reading ``[g, seq[c]]`` (an unpacked call has ``S = 1``).
"""

from __future__ import annotations

import numpy as np

from ..config import BLAS_SPAN
from ._jit import kernel
from .bundles import QueryScratch
from .hash import hash_bwd_rows_dw, hash_chunk, residual_rows
from .products import combine_rows, copy_into, dot_rows, span_totals
from .readout import den_rows, dphi_from_y, readout_rows
from .runtime import read_only, run_tasks
from .scan import task_bounds


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


def keys_bwd(v, rows, dsum, hsh, chunks, grads):
    """Non-causal cotangents of every key from the summed cotangent of the sketch.

    Parameters
    ----------
    v : (G, Nk, dv)
        The forward's values (compute dtype).
    rows : Rows
        The forward's ``phik``, ``tk`` (all rows).
    dsum : Sums
        ``dA (G, S, F)`` float64 and ``dB (G, S, F, dv)`` in the compute
        dtype: the cotangent of each packed sequence's sketch (S = 1 unpacked).
    hsh : Hash
    chunks : Chunks
        Each chunk's rows and packed sequence (the index into ``dsum``'s axis 1).
    grads : Grads
        Out: ``dk``, ``dv`` (every row written), ``dbk (G, nc)`` (each
        chunk's share of dbeta) and, where computed, ``planes.dWk`` (each
        chunk's share of the planes' gradient, from ``planes.k``); the
        others are not touched.
    """
    G, nc = grads.dbk.shape
    run_tasks(_keys_bwd_task, G * nc, v, rows, dsum, hsh, chunks, grads)


@kernel
def _queries_fwd_task(task, keep, q, hsh, chunks, sketch, rows, out, nan):
    """One (group, chunk) task of :func:`queries_fwd` (run by :func:`run_tasks`)."""
    L = hsh.W.shape[0]
    g, c, lo, hi = task_bounds(task, chunks)
    phi, _, nan[task] = hash_chunk(q, g, lo, hi, hsh, keep[lo:hi], rows.tq, rows.phiq)
    s = chunks.seq[c]  # the chunk's packed sequence, whose sketch its queries read
    den = residual_rows(rows.den, g, lo, hi)
    if out.shape[1] == 0:  # a backward's recomputed rows: its y = B g stands in for the output
        den_rows(phi, sketch.A[g, s], L, den)
    else:
        readout_rows(phi, sketch.A[g, s], sketch.B[g, s], L, den, out[g, lo:hi])


def queries_fwd(q, hsh, chunks, sketch, rows, out):
    """Hash every query and read its sequence's summed sketch.

    Parameters
    ----------
    q : (G, Nq, d)
        Queries (compute dtype).
    hsh : Hash
    chunks : Chunks
        Each chunk's rows and packed sequence.
    sketch : Sums
        ``A (G, S, F)`` float64 and ``B (G, S, F, dv)`` in the compute
        dtype, one per packed sequence (S = 1 unpacked).
    rows : Rows
        Out: ``phiq``, ``tq``, ``den`` (each may have no rows: not kept).
    out : (G, Nq, dv) or (G, 0, dv)
        Out, compute dtype; every row written (streamed).  With no rows,
        only ``rows`` are computed (the hash and ``den``: what
        :func:`queries_bwd` reads), not the output.

    Returns
    -------
    int
        The number of NaNs in the queries' t (see :func:`racecpu._kernels.hash.hash_block`).
    """
    G, n, _ = q.shape
    keep = read_only(np.ones(n, np.bool_))  # queries are never masked
    nan = np.zeros(G * chunks.seq.shape[0], np.int64)
    run_tasks(_queries_fwd_task, nan.size, keep, q, hsh, chunks, sketch, rows, out, nan)
    return int(nan.sum())


@kernel
def query_bwd_buffers(grad, F, n):
    """:class:`QueryScratch` of a query chunk's backward of ``n`` rows."""
    return QueryScratch(np.empty(F, np.float64), np.empty((n, F), grad.dtype),
                        np.zeros(F, np.float64), np.empty((n, F), np.float64))


@kernel(inline="always")
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
    copy_into(partd.A[g, c], scratch.dA)
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
    rows, As = phiq[g], A[g, s]  # (rows by index below, not a view per token)
    for i in range(lo, hi):
        dden = dphi_from_y(rows, i, As, den[g, i], L, DPHI, i - lo, wq)
        for f in range(F):
            dA[f] += phiq[g, i, f] * dden / L
            wblock[i - lo, f] = wq[f]
    bwd.grads.dbq[g, c] = queries_chunk_end(bwd, partd, g, c, scratch, BLAS_SPAN)


def queries_bwd(bwd, sketch, partd):
    """Non-causal cotangents of every query, and the chunk totals of the sketch's cotangent.

    Parameters
    ----------
    bwd : Backward
        ``grad``, the forward's ``rows`` (``phiq``, ``tq``, ``den`` read),
        ``hsh``, ``chunks``; out ``grads.dq`` (every row), ``grads.dbq (G,
        nc)`` and, where computed, ``grads.planes.dWq`` (from ``planes.q``).
    sketch : Sums
        The forward's ``A (G, S, F)`` float64 and ``B (G, S, F, dv)`` in the
        compute dtype (as :func:`queries_fwd`).
    partd : Sums
        Out: the chunk totals ``dA (G, nc, F)``, ``dB (G, nc, F, dv)`` (float64).
    """
    G, nc = partd.A.shape[:2]
    run_tasks(_queries_bwd_task, G * nc, bwd, sketch, partd)

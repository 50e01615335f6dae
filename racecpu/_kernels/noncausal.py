"""TODO noncausal"""

from __future__ import annotations

import numpy as np

from ..config import BLAS_SPAN, DEN_FLOOR, SCAN_BLOCK
from ._jit import kernel
from .hash import hash_bwd_rows, hash_chunk, hash_sketch_range, residual_rows
from .products import add_rows, combine_rows, dot_rows, span_totals
from .runtime import blas_tasks, run_tasks
from .scan import spread_order, task_bounds


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
def _sketch_chunks_task(task, order, k, v, mask, W, beta, chunk, span, t0, t1, phik, tk, partA, partB, nan):
    """One (group, chunk) task of :func:`sketch_chunks` (run by :func:`run_tasks`;
    loops inlined into a prange body were not vectorised)."""
    G, n, _ = k.shape
    nc = partA.shape[1]
    F = phik.shape[2]
    g, c, lo, hi = task_bounds(order[task], nc, chunk, n)
    if span == SKETCH_FUSED:
        # phik, tk with no rows (a forward with no backward): hash_block writes none
        nan[task] = hash_sketch_range(k[g, lo:hi], v[g, lo:hi], 0, hi - lo, W, beta, mask[g, lo:hi],
                                      tk[g, lo:hi], phik[g, lo:hi], partA[g, c], partB[g, c])
        return
    phi, _, nan[task] = hash_chunk(k, g, lo, hi, W, beta, mask[g, lo:hi], tk, phik)
    add_rows(partA[g, c], phi)
    if t0 <= c < t1:
        span_totals(phi, v[g, lo:hi], span, False, partB[g, c], np.empty((F, v.shape[2]), v.dtype))


@blas_tasks
def sketch_chunks(k, v, mask, W, beta, chunk, phik, tk, partA, partB, span=None, totals=None):
    """Hash every key and sum its sketch per chunk.

    Writes ``phik (G, Nk, F)`` and ``tk (G, Nk, L*P)`` (masked keys: phi = 0;
    either may have no rows, when nothing reads it later: see
    :func:`residual_rows`), adds the chunk totals of A to ``partA (G, nc, F)`` (float64, zeros on
    entry) and writes those of B to ``partB (G, nc, F, dv)`` (float64).
    Non-causal attention sums them; the causal scan carries them.  ``span``: rows per product of the B totals (default
    SCAN_BLOCK, the causal scans' steps, see :func:`span_totals`), or
    SKETCH_FUSED: each block's product as soon as it is hashed
    (:func:`hash_sketch_range`; faster, where no scan has to match).  ``totals``: the chunks ``(c0, c1)``
    of every group whose B totals are summed (default all; the causal forward
    needs those before its last segment, see :func:`scan_segments`).
    Returns the number of NaNs in the keys' t (see :func:`hash_block`).
    """
    G, nc = partA.shape[:2]
    t0, t1 = (0, nc) if totals is None else totals
    nan = np.zeros(G * nc, np.int64)
    run_tasks(_sketch_chunks_task, G * nc, spread_order(G, nc, t0, t1), k, v, mask, W, beta, chunk,
              SCAN_BLOCK if span is None else span, t0, t1, phik, tk, partA, partB, nan)
    return int(nan.sum())


@kernel
def _keys_bwd_task(task, v, phik, tk, dA, dB, W, beta, chunk, dk, dv_out, dbeta_part):
    """One (group, chunk) task of :func:`keys_bwd` (run by :func:`run_tasks`;
    loops inlined into a prange body were not vectorised)."""
    G, n, _ = v.shape
    F = phik.shape[2]
    nc = dbeta_part.shape[1]
    g, c, lo, hi = task_bounds(task, nc, chunk, n)
    DPHI = np.empty((hi - lo, F), np.float64)
    combine_rows(phik[g, lo:hi], dB[g], dv_out[g, lo:hi], True)  # dv_j = dB^T phik_j (masked keys: 0)
    dot_rows(dB[g], v[g, lo:hi], DPHI)  # dphik_j = dB v_j + dA
    for j in range(hi - lo):
        for f in range(F):
            DPHI[j, f] += dA[g, f]
    dbeta_part[g, c] = hash_bwd_rows(DPHI, phik[g, lo:hi], tk[g, lo:hi], W, beta, dk[g, lo:hi])


@blas_tasks
def keys_bwd(v, phik, tk, dA, dB, W, beta, chunk, dk, dv_out, dbeta_part):
    """Non-causal cotangents of every key from the summed (dA, dB)."""
    G, nc = dbeta_part.shape[:2]
    run_tasks(_keys_bwd_task, G * nc, v, phik, tk, dA, dB, W, beta, chunk, dk, dv_out, dbeta_part)


@kernel
def _queries_fwd_task(task, keep, q, W, beta, chunk, A, B, phiq, tq, den, out, nan):
    """One (group, chunk) task of :func:`queries_fwd` (run by :func:`run_tasks`;
    loops inlined into a prange body were not vectorised)."""
    G, n, _ = q.shape
    L = W.shape[0]
    nc = (n + chunk - 1) // chunk
    g, c, lo, hi = task_bounds(task, nc, chunk, n)
    phi, _, nan[task] = hash_chunk(q, g, lo, hi, W, beta, keep[lo:hi], tq, phiq)
    readout_rows(phi, A[g], B[g], L, residual_rows(den, g, lo, hi), out[g, lo:hi])


@blas_tasks
def queries_fwd(q, W, beta, chunk, A, B, phiq, tq, den, out):
    """Hash every query and read the summed sketch ``A (G, F)``, ``B (G, F, dv)``.

    ``phiq``, ``tq``, ``den`` may have no rows (:func:`residual_rows`).
    Returns the number of NaNs in the queries' t (see :func:`hash_block`).
    """
    G, n, _ = q.shape
    keep = np.ones(n, np.bool_)  # queries are never masked
    nan = np.zeros(G * ((n + chunk - 1) // chunk), np.int64)
    run_tasks(_queries_fwd_task, nan.size, keep, q, W, beta, chunk, A, B, phiq, tq, den, out, nan)
    return int(nan.sum())


@kernel
def query_bwd_buffers(grad, F, n):
    """Per-task buffers of a query chunk's backward: ``wq`` (F,), the weights
    ``wblock (n, F)`` of g in dB, ``dA`` (F,) and the dphi rows ``DPHI (n, F)``."""
    return (np.empty(F, np.float64), np.empty((n, F), grad.dtype),
            np.zeros(F, np.float64), np.empty((n, F), np.float64))


@kernel
def queries_chunk_end(g, c, lo, hi, grad, phiq, tq, wblock, DPHI, dA, W, beta, dq, partdA, partdB, span):
    """End of a query chunk's backward (causal or not); returns the chunk's hash share of dbeta.

    The chunk totals to ``partdA``, and to ``partdB`` (float64) the
    chunk's dB = sum_i wq_i g_i^T by :func:`span_totals` over
    ``span`` rows (last span first, as the reverse scan meets them; span 0:
    none), then the hash backward of every query (``DPHI`` holds dphi rows)
    with dq (:func:`hash_bwd_rows`).
    """
    partdA[g, c] = dA
    if span > 0:
        span_totals(wblock, grad[g, lo:hi], span, True, partdB[g, c],
                    np.empty((wblock.shape[1], grad.shape[2]), grad.dtype))
    return hash_bwd_rows(DPHI, phiq[g, lo:hi], tq[g, lo:hi], W, beta, dq[g, lo:hi])


@kernel
def _queries_bwd_task(task, grad, phiq, tq, den, A, B, W, beta, chunk, dq, partdA, partdB, dbeta_part):
    """One (group, chunk) task of :func:`queries_bwd` (run by :func:`run_tasks`;
    loops inlined into a prange body were not vectorised)."""
    G, n, dv = grad.shape
    L = W.shape[0]
    F = phiq.shape[2]
    nc = partdA.shape[1]
    g, c, lo, hi = task_bounds(task, nc, chunk, n)
    wq, wblock, dA, DPHI = query_bwd_buffers(grad, F, hi - lo)
    dot_rows(B[g], grad[g, lo:hi], DPHI)  # y_i = B g_i, turned into dphi_i in place
    for i in range(lo, hi):
        dden = dphi_from_y(phiq[g, i], A[g], den[g, i], L, DPHI[i - lo], wq)
        for f in range(F):
            dA[f] += phiq[g, i, f] * dden / L
            wblock[i - lo, f] = wq[f]
    dbeta_part[g, c] = queries_chunk_end(g, c, lo, hi, grad, phiq, tq, wblock, DPHI, dA, W, beta,
                                         dq, partdA, partdB, BLAS_SPAN)


@blas_tasks
def queries_bwd(grad, phiq, tq, den, A, B, W, beta, chunk, dq, partdA, partdB, dbeta_part):
    """Non-causal cotangents of every query, and chunk sums of (dA, dB)."""
    G, nc = partdA.shape[:2]
    run_tasks(_queries_bwd_task, G * nc, grad, phiq, tq, den, A, B, W, beta, chunk, dq, partdA, partdB, dbeta_part)

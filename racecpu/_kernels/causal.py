"""TODO causal"""

from __future__ import annotations

import numpy as np

from .. import config
from ..config import DEN_FLOOR, SCAN_BLOCK
from ._jit import kernel
from .hash import hash_bwd_rows, hash_chunk, residual_rows
from .noncausal import dphi_from_y, query_bwd_buffers, queries_chunk_end
from .products import add_product, add_rows, combine_rows, dot_rows, step_scores, zero_above, zero_below
from .runtime import blas_tasks, run_tasks
from .scan import (carry_on, exclusive_scan, exclusive_step, scan_segments, segment_chunks, segment_start,
                   spread_order, task_bounds)


@kernel
def step_buffers(like, F, m):
    """Scratch of one scan step of ``m`` tokens in the compute dtype of ``like``:
    two (m, m), three (m, F), one (m, dv) and the state increment (F, dv)."""
    dv = like.shape[-1]
    dt = like.dtype
    return (np.zeros((m, m), dt), np.zeros((m, m), dt), np.zeros((m, F), dt), np.zeros((m, F), dt),
            np.zeros((m, F), dt), np.zeros((m, dv), dt), np.zeros((F, dv), dt))


@kernel
def _causal_fwd_task(task, segments, keep, q, v, phik, carryA, carryB, W, beta, chunk, phiq, tq, den, out, final, nan):
    """One segment of :func:`causal_fwd` (run by :func:`run_tasks`; loops inlined
    into a prange body were not vectorised)."""
    G, n, _ = q.shape
    L = W.shape[0]
    nc = carryA.shape[1]
    F = phik.shape[2]
    dv = v.shape[2]
    g, c0, c1 = segment_chunks(task, segments, nc)
    last = c1 == nc and final.shape[0] > 0  # this segment writes the total to final
    track = last or c1 - c0 > 1
    total = np.zeros((F, dv), v.dtype)  # the chunk's sum of state updates, for the next carry
    for c in range(c0, c1):
        lo = c * chunk
        hi = min(lo + chunk, n)
        phi, _, bad = hash_chunk(q, g, lo, hi, W, beta, keep[lo:hi], tq, phiq)
        nan[task] += bad
        dnc = residual_rows(den, g, lo, hi)
        A = carryA[g, c].copy()
        S = carryB[g, c].astype(v.dtype)  # the carried-in state, in the compute dtype
        H, _, _, _, _, X, dS = step_buffers(v, F, min(SCAN_BLOCK, hi - lo))
        for i0 in range(lo, hi, SCAN_BLOCK):
            i1 = min(i0 + SCAN_BLOCK, hi)
            m = i1 - i0
            if m != H.shape[0]:  # the chunk's last, shorter step
                H, _, _, _, _, X, dS = step_buffers(v, F, m)
            Pq, Pk, V, O = phi[i0 - lo:i1 - lo], phik[g, i0:i1], v[g, i0:i1], out[g, i0:i1]
            step_scores(Pq, Pk, H, True)  # H_ij = phiq_i . phik_j, kept for j <= i
            if dv > 0:
                combine_rows(Pq, S, O)
                combine_rows(H, V, X)
            for i in range(m):
                dn = 0.0
                for f in range(F):
                    dn += Pq[i, f] * A[f]
                for j in range(i + 1):
                    dn += H[i, j]
                dn /= L
                dnc[i0 - lo + i] = dn
                inv = 1.0 / (L * dn) if dn > DEN_FLOOR else 0.0  # the floor: zeros
                for cc in range(dv):
                    O[i, cc] = (O[i, cc] + X[i, cc]) * inv
            add_rows(A, Pk)
            add_product(Pk, V, S, dS, total, track)
        if c + 1 < c1 or last:
            carry_on(carryB, g, c, c + 1, total, final)


@blas_tasks
def causal_fwd(q, v, phik, carryA, carryB, W, beta, chunk, phiq, tq, den, out, final=None, segments=None):
    """Scan every segment of chunks from its carried-in state; query i sees keys j <= i.

    ``carryA (G, nc, F)``, ``carryB (G, nc, F, dv)`` (float64) hold the state
    (A, B) summed over all keys before each chunk; of B, only the carry at
    the first chunk of each of the ``segments`` per group (default: one per
    chunk) is read, and the scan writes the others, bit for bit those of the
    chunk totals (:func:`span_totals`).  Per step of SCAN_BLOCK tokens with
    state B before it: out = (Phiq B + tril(Phiq Phik^T) V) / ..., then
    B += Phik^T V.  ``final (G, F, dv)`` (float64) given: the total B too.
    ``phiq``, ``tq``, ``den`` may have no rows (:func:`residual_rows`).
    Returns the number of NaNs in the queries' t (see :func:`hash_block`).
    """
    G, nc = carryA.shape[:2]
    keep = np.ones(q.shape[1], np.bool_)  # queries are never masked
    segments = nc if segments is None else segments
    nan = np.zeros(G * segments, np.int64)
    run_tasks(_causal_fwd_task, G * segments, segments, keep, q, v, phik, carryA, carryB, W, beta, chunk,
              phiq, tq, den, out, np.zeros((0, 0, 0)) if final is None else final, nan)
    return int(nan.sum())


@kernel
def _causal_queries_bwd_chunk(g, c, t0, t1, grad, v, phik, phiq, tq, den, carryA, carryB, W, beta, chunk, dq, dden_out, partdA, partdB, dbeta_part):
    """Chunk ``c`` of group ``g`` of :func:`causal_queries_bwd`."""
    G, n, dv = grad.shape
    L = W.shape[0]
    F = phik.shape[2]
    lo = c * chunk
    hi = min(lo + chunk, n)
    A = carryA[g, c].copy()
    S = carryB[g, c].astype(v.dtype)  # the carried-in state, in the compute dtype
    wq, wblock, dA, DPHI = query_bwd_buffers(grad, F, hi - lo)
    M, _, _, Y, Z, _, dS = step_buffers(v, F, min(SCAN_BLOCK, hi - lo))
    for i0 in range(lo, hi, SCAN_BLOCK):
        i1 = min(i0 + SCAN_BLOCK, hi)
        m = i1 - i0
        if m != M.shape[0]:  # the chunk's last, shorter step
            M, _, _, Y, Z, _, dS = step_buffers(v, F, m)
        Pq, Pk, V, Gb = phiq[g, i0:i1], phik[g, i0:i1], v[g, i0:i1], grad[g, i0:i1]
        if dv > 0:  # y_i = B_i g_i = B g_i + sum_{j<=i} phik_j (v_j . g_i)
            dot_rows(S, Gb, Y)
            dot_rows(V, Gb, M)  # M_ij = g_i . v_j, kept for j <= i
            zero_above(M)
            np.dot(M, Pk, Z)
        for i in range(m):
            dphi = DPHI[i0 + i - lo]  # the hash backward runs once per chunk, SIMD over tokens
            for f in range(F):
                A[f] += Pk[i, f]
                dphi[f] = Y[i, f] + Z[i, f]
            dden = dphi_from_y(Pq[i], A, den[g, i0 + i], L, dphi, wq)
            dden_out[g, i0 + i] = dden
            for f in range(F):
                dA[f] += Pq[i, f] * dden / L
                wblock[i0 + i - lo, f] = wq[f]
        add_product(Pk, V, S, dS, dS, False)  # (no total to track)
    dbeta_part[g, c] = queries_chunk_end(g, c, lo, hi, grad, phiq, tq, wblock, DPHI, dA, W, beta,
                                         dq, partdA, partdB, SCAN_BLOCK if t0 <= c < t1 else 0)


@kernel
def _causal_queries_bwd_task(task, order, t0, t1, grad, v, phik, phiq, tq, den, carryA, carryB, W, beta, chunk, dq, dden_out, partdA, partdB, dbeta_part):
    """One (group, chunk) task of :func:`causal_queries_bwd` (run by :func:`run_tasks`;
    loops inlined into a prange body were not vectorised)."""
    nc = carryA.shape[1]
    g, c, _, _ = task_bounds(order[task], nc, chunk, grad.shape[1])
    _causal_queries_bwd_chunk(g, c, t0, t1, grad, v, phik, phiq, tq, den, carryA, carryB, W, beta, chunk,
                              dq, dden_out, partdA, partdB, dbeta_part)


@blas_tasks
def causal_queries_bwd(grad, v, phik, phiq, tq, den, carryA, carryB, W, beta, chunk,
                       dq, dden_out, partdA, partdB, dbeta_part, totals=None):
    """Backward pass 1: rebuild prefix states by rescanning; cotangents of queries.

    Per step with state B before it: Y = G B^T + tril(G V^T) Phik, whose rows
    are y_i = B_i g_i.  Also stores dden per query and the chunk totals of
    (dA, dB) for the reverse scan (``partdA``, ``partdB``: written, not added),
    those of dB for the chunks ``totals = (c0, c1)`` of every group only
    (default all; :func:`causal_keys_bwd` needs those after its first segment).
    """
    G, nc = carryA.shape[:2]
    t0, t1 = (0, nc) if totals is None else totals
    run_tasks(_causal_queries_bwd_task, G * nc, spread_order(G, nc, t0, t1), t0, t1, grad, v, phik, phiq, tq, den,
              carryA, carryB, W, beta, chunk, dq, dden_out, partdA, partdB, dbeta_part)


@kernel
def _causal_keys_bwd_task(task, segments, grad, v, phik, tk, phiq, den, dden, carrydA, carrydB, W, beta, chunk, dk, dv_out, dbeta_part, final):
    """One segment of :func:`causal_keys_bwd` (run by :func:`run_tasks`; loops
    inlined into a prange body were not vectorised)."""
    dv = grad.shape[2]
    nc = carrydA.shape[1]
    F = phik.shape[2]
    g, c0, c1 = segment_chunks(task, segments, nc)
    last = c0 == 0 and final.shape[0] > 0  # this segment writes the total to final
    total = np.zeros((F, dv), grad.dtype)  # the chunk's sum of dB updates, for the next carry
    for ci in range(c1 - c0):
        _causal_keys_bwd_chunk(g, c1 - 1 - ci, c0, last or c1 - c0 > 1, last, grad, v, phik, tk, phiq, den, dden,
                               carrydA, carrydB, W, beta, chunk, dk, dv_out, dbeta_part, final, total)


@kernel
def _causal_keys_bwd_chunk(g, c, c0, track, last, grad, v, phik, tk, phiq, den, dden, carrydA, carrydB, W, beta, chunk, dk, dv_out, dbeta_part, final, total):
    """Chunk ``c`` of group ``g`` of :func:`causal_keys_bwd`, in a segment from
    chunk ``c0``: its dB total is summed in ``total`` when ``track``, and
    carried on to chunk c - 1 (``final`` for the first chunk if ``last``)."""
    G, n, dv = grad.shape
    L = W.shape[0]
    F = phik.shape[2]
    ddv = np.zeros(SCAN_BLOCK, np.float64)
    lo = c * chunk
    hi = min(lo + chunk, n)
    dA = carrydA[g, c].copy()
    dB = carrydB[g, c].astype(grad.dtype)  # the carried-in state, in the compute dtype
    DPHI = np.empty((hi - lo, F), np.float64)
    nb = (hi - lo + SCAN_BLOCK - 1) // SCAN_BLOCK
    M, M2, wb, Y, Z, X, dS = step_buffers(grad, F, min(SCAN_BLOCK, hi - lo))
    for bi in range(nb - 1, -1, -1):
        i0 = lo + bi * SCAN_BLOCK
        i1 = min(i0 + SCAN_BLOCK, hi)
        m = i1 - i0
        if m != M.shape[0]:  # the chunk's last, shorter step
            M, M2, wb, Y, Z, X, dS = step_buffers(grad, F, m)
        Pq, Pk, V, Gb, dV = phiq[g, i0:i1], phik[g, i0:i1], v[g, i0:i1], grad[g, i0:i1], dv_out[g, i0:i1]
        for i in range(m):
            dn = den[g, i0 + i]
            inv = 1.0 / (L * dn) if dn > DEN_FLOOR else 0.0
            ddv[i] = dden[g, i0 + i] / L if dn > DEN_FLOOR else 0.0
            for f in range(F):
                wb[i, f] = Pq[i, f] * inv  # the weights wq_i of g_i in dB
        if dv > 0:
            # dphik_j = dB v_j + sum_{i>=j} wq_i (g_i . v_j) + dA_j, dB from after the step
            dot_rows(dB, V, Y)
            dot_rows(Gb, V, M)  # M_ji = v_j . g_i, kept for i >= j
            zero_below(M)
            np.dot(M, wb, Z)
            # dv_j = dB^T phik_j + sum_{i>=j} (wq_i . phik_j) g_i
            np.dot(Pk, dB, dV)
            step_scores(Pk, wb, M2, False)  # M2_ji = phik_j . wq_i, kept for i >= j
            np.dot(M2, Gb, X)
            for j in range(m):
                for cc in range(dv):
                    dV[j, cc] += X[j, cc]
        for j in range(m - 1, -1, -1):
            for f in range(F):
                dA[f] += Pq[j, f] * ddv[j]
                DPHI[i0 + j - lo, f] = Y[j, f] + Z[j, f] + dA[f]
        add_product(wb, Gb, dB, dS, total, track)
    dbeta_part[g, c] = hash_bwd_rows(DPHI, phik[g, lo:hi], tk[g, lo:hi], W, beta, dk[g, lo:hi])
    if c - 1 >= c0 or last:
        carry_on(carrydB, g, c, c - 1, total, final)


@blas_tasks
def causal_keys_bwd(grad, v, phik, tk, phiq, den, dden, carrydA, carrydB, W, beta, chunk,
                    dk, dv_out, dbeta_part, final=None, segments=None):
    """Backward pass 2: suffix sums over queries i >= j by a reverse rescan.

    Per step with dB from after it (queries past the step):
    dPhik = V dB^T + triu(V G^T) Wq + dA (suffix sums),
    dV = Phik dB + triu(Phik Wq^T) G, then dB += Wq^T G.

    Each of the ``segments`` per group (default: one per chunk) scans its
    chunks last to first from the dB carry of its last chunk and writes the
    others, and ``final (G, F, dv)``, if given, gets the total dB, as
    :func:`causal_fwd` does for B.
    """
    G, nc = carrydA.shape[:2]
    segments = nc if segments is None else segments
    run_tasks(_causal_keys_bwd_task, G * segments, segments, grad, v, phik, tk, phiq, den, dden, carrydA, carrydB,
              W, beta, chunk, dk, dv_out, dbeta_part, np.zeros((0, 0, 0)) if final is None else final)


@kernel
def _causal_bwd_chunks(g, cs, grad, v, phik, tk, phiq, tq, den, carryA, carryB, W, beta, chunk, dq, dk, dv_out, dden,
                       partdA, partdB, dbq, dbk, acc, total, last, final):
    """Chunks ``nc - 1`` down to ``cs`` of group ``g`` in one pass: each one's
    queries' backward and then its keys' backward, the reverse carries summed
    on the way as :func:`exclusive_scan` sums them (dA in ``acc``).  Chunk
    cs's dB is left in ``total``, not carried on, unless ``last`` (cs = 0,
    ``final`` gets the total dB)."""
    nc = carryA.shape[1]
    acc[:] = 0.0
    partdB[g, nc - 1] = 0.0  # no dB after the last chunk
    for c in range(nc - 1, cs - 1, -1):
        _causal_queries_bwd_chunk(g, c, nc, nc, grad, v, phik, phiq, tq, den, carryA, carryB, W, beta, chunk,
                                  dq, dden, partdA, partdB, dbq)
        exclusive_step(partdA[g, c], partdA[g, c], acc)  # the chunk's dA total -> its carry
        _causal_keys_bwd_chunk(g, c, cs, last or nc > 1, last, grad, v, phik, tk, phiq, den, dden,
                               partdA, partdB, W, beta, chunk, dk, dv_out, dbk, final, total)


@kernel
def _causal_bwd_task(g, grad, v, phik, tk, phiq, tq, den, carryA, carryB, W, beta, chunk, dq, dk, dv_out, dden,
                     partdA, partdB, dbq, dbk, final):
    """Group ``g`` of :func:`causal_bwd`."""
    F = phik.shape[2]
    _causal_bwd_chunks(g, 0, grad, v, phik, tk, phiq, tq, den, carryA, carryB, W, beta, chunk, dq, dk, dv_out, dden,
                       partdA, partdB, dbq, dbk, np.zeros(F), np.zeros((F, grad.shape[2]), grad.dtype),
                       final.shape[0] > 0, final)


@blas_tasks
def causal_bwd(grad, v, phik, tk, phiq, tq, den, carryA, carryB, W, beta, chunk, dq, dk, dv_out, dden,
               partdA, partdB, dbq, dbk, final=None):
    """:func:`causal_queries_bwd`, :func:`exclusive_scan` of the carries and
    :func:`causal_keys_bwd` in one pass, for one segment per group
    (:func:`scan_segments`): each chunk's keys' backward follows its queries'
    backward while the chunk's rows of ``v`` and ``grad`` are still in cache
    (a chunk's 1024 of each: 1 MB, against L2 caches of 1-2 MB per core),
    instead of reading them from memory again in a second pass.  The same
    bits as the three calls; ``partdA``, ``partdB`` end as their carries.
    """
    G = grad.shape[0]
    run_tasks(_causal_bwd_task, G, grad, v, phik, tk, phiq, tq, den, carryA, carryB, W, beta, chunk, dq, dk,
              dv_out, dden, partdA, partdB, dbq, dbk, np.zeros((0, 0, 0)) if final is None else final)


@kernel
def _causal_bwd_split_task(task, cs, grad, v, phik, tk, phiq, tq, den, carryA, carryB, W, beta, chunk, dq, dk,
                           dv_out, dden, partdA, partdB, dbq, dbk, tailA, tailB):
    """Task of :func:`causal_bwd_split`: even, group ``task // 2``'s chunks
    ``[cs, nc)`` in one pass, with their dA and dB sums in ``tailA``,
    ``tailB``; odd, the queries' backward of its chunks ``[0, cs)``, with the
    dB totals of the keys' second segment, ``[cs // 2, cs)``."""
    g = task // 2
    if task % 2 == 0:
        total = np.zeros((phik.shape[2], grad.shape[2]), grad.dtype)
        _causal_bwd_chunks(g, cs, grad, v, phik, tk, phiq, tq, den, carryA, carryB, W, beta, chunk, dq, dk, dv_out,
                           dden, partdA, partdB, dbq, dbk, tailA[g], total, False, tailB)
        carry_on(partdB, g, cs, -1, total, tailB)  # tailB[g]: the dB carry of chunk cs - 1
    else:
        for c in range(cs):
            _causal_queries_bwd_chunk(g, c, segment_start(1, 2, cs), cs, grad, v, phik, phiq, tq, den,
                                      carryA, carryB, W, beta, chunk, dq, dden, partdA, partdB, dbq)


@kernel
def _split_carries(partdA, partdB, tailA, tailB, cs):
    """Reverse carries of chunks ``c < cs`` (in place of their totals), summed on from
    the sums of chunks ``>= cs``, ``tailA``, ``tailB``: dA of every chunk, dB of the
    last chunks of the keys' two segments (``partdB`` flat: (G, nc, F * dv))."""
    m = segment_start(1, 2, cs)
    for g in range(partdA.shape[0]):
        acc = tailA[g].copy()
        for c in range(cs - 1, -1, -1):
            exclusive_step(partdA[g, c], partdA[g, c], acc)
        acc = tailB[g].copy()
        for c in range(cs - 1, m - 1, -1):  # the totals of the second segment's chunks
            exclusive_step(partdB[g, c], partdB[g, c], acc)
        partdB[g, m - 1] = acc


@blas_tasks
def causal_bwd_split(grad, v, phik, tk, phiq, tq, den, carryA, carryB, W, beta, chunk, dq, dk, dv_out, dden,
                     partdA, partdB, dbq, dbk, final=None):
    """:func:`causal_bwd` on two tasks per group, for two segments per group
    (:func:`scan_segments`); the same bits.

    The last chunks, ``[cs, nc)`` with nc - cs ~ SPLIT_TAIL * nc, need no
    carry: one task runs them in one pass while the other runs the queries'
    backward of the chunks before them, with the dB totals of
    ``[cs // 2, cs)``; then :func:`causal_keys_bwd` runs ``[0, cs)`` in two
    segments from the first task's carries.  Against the three calls over
    two segments of ``nc / 2`` (totals of half the chunks, every keys' chunk
    read again in a second pass), a third of the chunks takes the one pass
    and a third pays totals.  Needs nc >= 3.
    """
    G, nc = carryA.shape[:2]
    if nc < 3:
        raise ValueError(f"causal_bwd_split needs 3 chunks or more, got {nc}")
    cs = nc - min(nc - 2, max(1, round(config.SPLIT_TAIL * nc)))
    F, dv = partdB.shape[2:]
    tailA, tailB = np.zeros((G, F)), np.zeros((G, F, dv))
    run_tasks(_causal_bwd_split_task, 2 * G, cs, grad, v, phik, tk, phiq, tq, den, carryA, carryB, W, beta,
              chunk, dq, dk, dv_out, dden, partdA, partdB, dbq, dbk, tailA, tailB)
    _split_carries(partdA, partdB.reshape(G, nc, F * dv), tailA, tailB.reshape(G, F * dv), cs)
    causal_keys_bwd(grad, v, phik, tk, phiq, den, dden, partdA[:, :cs], partdB[:, :cs], W, beta, chunk,
                    dk, dv_out, dbk, final=final, segments=2)


def causal_backward(grad, v, phik, tk, phiq, tq, den, carryA, carryB, W, beta, chunk, dq, dk, dv_out, dden,
                    partdA, partdB, dbq, dbk, final):
    """The causal backward by the route that suits the thread count; every route gives the same bits.

    One segment per group (:func:`racecpu._kernels.scan.scan_segments`): one pass,
    chunk by chunk (:func:`causal_bwd`).  Two, with three chunks or more: a third
    of the chunks in one pass beside the queries' backward of the rest
    (:func:`causal_bwd_split`).  Otherwise the queries' backward, the reverse
    exclusive scan of the chunk totals and the keys' backward in segments.
    """
    G, nk = v.shape[:2]
    nck = carryA.shape[1]
    seg = scan_segments(G, nck, nk)
    if seg == 1:
        causal_bwd(grad, v, phik, tk, phiq, tq, den, carryA, carryB, W, beta, chunk,
                   dq, dk, dv_out, dden, partdA, partdB, dbq, dbk, final=final)
    elif seg == 2 and nck >= 3:
        causal_bwd_split(grad, v, phik, tk, phiq, tq, den, carryA, carryB, W, beta, chunk,
                         dq, dk, dv_out, dden, partdA, partdB, dbq, dbk, final=final)
    else:
        # the dB totals of the chunks after the first segment give the reverse segments' carries
        causal_queries_bwd(grad, v, phik, phiq, tq, den, carryA, carryB, W, beta, chunk,
                           dq, dden, partdA, partdB, dbq, totals=(segment_start(1, seg, nck), nck))
        cA = exclusive_scan(partdA, True, partdA)  # in place
        cB = exclusive_scan(partdB, True, partdB, segments=seg)  # the segments' last chunks
        causal_keys_bwd(grad, v, phik, tk, phiq, den, dden, cA, cB, W, beta, chunk,
                        dk, dv_out, dbk, final=final, segments=seg)

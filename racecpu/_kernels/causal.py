"""Causal RACE attention: the prefix scan and its backward (three routes, the same bits).

Query ``i`` reads the sketch of keys ``j <= i`` (Algorithm 2 of the paper;
``docs/design.md`` sections 1 and 4).  The scan runs in *segments* of
consecutive chunks (:func:`racecpu.plan.scan_segments`): the chunk
totals of the keys before the last segment (:func:`racecpu._kernels.sketch.sketch_chunks`),
a float64 exclusive scan of them (:func:`racecpu._kernels.scan.exclusive_scan`),
then every segment scanned from its carried-in state (:func:`causal_fwd`),
SCAN_BLOCK tokens per step, each step a few small matrix products.  The
carries are the same, bit for bit, however many segments.

The backward is exact (``docs/design.md`` section 3): prefix states are rebuilt
by rescanning from the stored carries (:func:`causal_queries_bwd`) and the
suffix sums of ``(dA, dB)`` come from a reverse scan (:func:`causal_keys_bwd`);
nothing is obtained by subtracting from a total.  Three routes give the
same bits (the plan picks one, :mod:`racecpu.plan`; the engine calls it): the
two passes in segments, both in one pass chunk by chunk (:func:`causal_bwd`),
or a third of the chunks in one pass beside the queries' pass over the rest
(:func:`causal_bwd_split`).  How a query reads the state (the ratio and its
floor, and their backward) is the estimator's, in :mod:`.readout`.

Every scan runs per key/value head ``gk`` (``Gk`` of them): the state
depends on the keys alone, so under grouped-query attention (``G = group *
Gk`` query heads, query head ``h`` reading key/value head ``h // group``)
each step's state is read by the ``group`` query heads in turn and updated
once, and the reverse scan sums the group's ``(dA, dB)`` into one suffix
state; dk, dv and the carries are per key/value head, with nothing to
repeat or sum back (``docs/design.md`` section 4).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import config
from ..config import SCAN_BLOCK
from ._jit import kernel
from .bundles import Chunks, Spread, Sums
from .hash import hash_bwd_rows_dw, hash_range, head_rows, head_scratch
from .products import (add_product, add_rows, combine_rows, copy_into, dot_rows, group_span_totals, step_scores,
                       zero_above, zero_below)
from .readout import den_share, dphi_from_y, ratio_inverse, step_readout
from .runtime import read_only, run_tasks
from .scan import carry_on, exclusive_step, restarts, segment_chunks, segment_start, spread_order, task_bounds


class StepScratch(NamedTuple):
    """Scratch of one scan step of ``m`` tokens, compute dtype: two ``(m, m)``
    score blocks ``M``, ``M2``, three ``(m, F)`` blocks ``wb``, ``Y``, ``Z``, one
    ``(m, dv)`` block ``X`` and the state increment ``dS (F, dv)``."""

    M: np.ndarray
    M2: np.ndarray
    wb: np.ndarray
    Y: np.ndarray
    Z: np.ndarray
    X: np.ndarray
    dS: np.ndarray


@kernel
def step_buffers(like, F, m):
    """:class:`StepScratch` for ``m`` tokens in the dtype of ``like (..., dv)``."""
    dv = like.shape[-1]
    dt = like.dtype
    return StepScratch(np.zeros((m, m), dt), np.zeros((m, m), dt), np.zeros((m, F), dt), np.zeros((m, F), dt),
                       np.zeros((m, F), dt), np.zeros((m, dv), dt), np.zeros((F, dv), dt))


@kernel
def _causal_fwd_task(task, segments, keep, fwd, carry, final, nan):
    """One segment of one key/value head of :func:`causal_fwd` (run by :func:`run_tasks`)."""
    q, v, hsh, rows, out, chunks = fwd
    phik = rows.phik
    carryA, carryB = carry
    G, n, _ = q.shape
    group = G // v.shape[0]  # the query heads that read this key/value head's state
    L = hsh.W.shape[0]
    nc = carryA.shape[1]
    F = phik.shape[2]
    dv = v.shape[2]
    gk, c0, c1 = segment_chunks(task, segments, nc)
    h0 = gk * group
    last = c1 == nc and final.shape[0] > 0  # this segment writes the total to final
    track = last or c1 - c0 > 1
    total = np.zeros((F, dv), v.dtype)  # the chunk's sum of state updates, for the next carry
    for c in range(c0, c1):
        lo, hi = chunks.cuts[c], chunks.cuts[c + 1]
        phis, dens = head_scratch(rows.phiq, group, hi - lo), head_scratch(rows.den, group, hi - lo)
        for hl in range(group):
            t = rows.tq[h0 + hl, lo:hi]  # no rows where none is kept
            nan[task] += hash_range(q[h0 + hl, lo:hi], 0, hi - lo, hsh, keep[lo:hi], t,
                                    head_rows(rows.phiq, phis, h0 + hl, hl, lo, hi))
        A = carryA[gk, c].copy()
        S = carryB[gk, c].astype(v.dtype)  # the carried-in state, in the compute dtype
        st = step_buffers(v, F, min(SCAN_BLOCK, hi - lo))
        H, X, dS = st.M, st.X, st.dS  # (once, not per step: every new view counts a reference)
        for i0 in range(lo, hi, SCAN_BLOCK):
            i1 = min(i0 + SCAN_BLOCK, hi)
            m = i1 - i0
            if m != H.shape[0]:  # the chunk's last, shorter step
                st = step_buffers(v, F, m)
                H, X, dS = st.M, st.X, st.dS
            Pk, V = phik[gk, i0:i1], v[gk, i0:i1]
            for hl in range(group):  # every query head of the group reads the one state
                phi, dnc = head_rows(rows.phiq, phis, h0 + hl, hl, lo, hi), head_rows(rows.den, dens, h0 + hl, hl,
                                                                                      lo, hi)
                Pq, O = phi[i0 - lo:i1 - lo], out[h0 + hl, i0:i1]
                step_scores(Pq, Pk, H, True)  # H_ij = phiq_i . phik_j, kept for j <= i
                if dv > 0:
                    combine_rows(Pq, S, O)
                    combine_rows(H, V, X)
                step_readout(Pq, A, H, X, L, dnc[i0 - lo:i1 - lo], O)
            add_rows(A, Pk)
            add_product(Pk, V, S, dS, total, track)
        if c + 1 < c1 or last:
            carry_on(carryB, gk, c, c + 1, total, final, restarts(chunks.seq, c + 1))


def causal_fwd(fwd, carry, final=None, segments=None):
    """Scan every segment of chunks from its carried-in state; query i sees keys j <= i.

    Per step of SCAN_BLOCK tokens with state B before it:
    out = (Phiq B + tril(Phiq Phik^T) V) / den, then B += Phik^T V.

    Parameters
    ----------
    fwd : Forward
        Queries ``q (G, N, d)`` and values ``v (Gk, N, dv)`` (compute dtype;
        ``Gk`` divides ``G``), the hash, the rows (``phik (Gk, N, F)`` read,
        every row; ``phiq``, ``tq``, ``den`` (G heads) written, each may have
        no rows: not kept), ``out (G, N, dv)`` (compute dtype, every row
        written) and the chunks (each chunk's rows and packed sequence: the
        scan restarts at the first chunk of each sequence, whose carries
        must be zero).
    carry : Sums
        ``A (Gk, nc, F)``, ``B (Gk, nc, F, dv)`` float64: the state summed over
        all keys before each chunk.  Of B only the carry at the first chunk of
        each of the ``segments`` per key/value head is read; the scan writes
        the others, bit for bit those of the chunk totals
        (:func:`racecpu._kernels.products.span_totals`).
    final : (Gk, F, dv) float64, optional
        Out: the total B.
    segments : int, optional
        Segments per key/value head (default: one per chunk).

    Returns
    -------
    int
        The number of NaNs in the queries' t (see :func:`racecpu._kernels.hash.hash_block`).
    """
    Gk, nc = carry.A.shape[:2]
    keep = read_only(np.ones(fwd.q.shape[1], np.bool_))  # queries are never masked
    segments = nc if segments is None else segments
    nan = np.zeros(Gk * segments, np.int64)
    run_tasks(_causal_fwd_task, Gk * segments, segments, keep, fwd, carry,
              np.zeros((0, 0, 0)) if final is None else final, nan)
    return int(nan.sum())


@kernel(by_address=True)
def _causal_queries_bwd_chunk(bwd, carry, partd, gk, c, t0, t1):
    """Chunk ``c`` of key/value head ``gk`` of :func:`causal_queries_bwd`, for
    every query head of its group; the chunk's dB total is summed for
    ``t0 <= c < t1`` only."""
    grad, v, rows, hsh, grads, chunks = bwd
    phik, phiq, den = rows.phik, rows.phiq, rows.den
    G, n, dv = grad.shape
    group = G // v.shape[0]
    h0 = gk * group
    L = hsh.W.shape[0]
    F = phik.shape[2]
    lo, hi = chunks.cuts[c], chunks.cuts[c + 1]
    A = carry.A[gk, c].copy()
    Ah = np.empty(F)  # A before each key of the step, per query head
    S = carry.B[gk, c].astype(v.dtype)  # the carried-in state, in the compute dtype
    wq = np.empty(F)
    dA = np.zeros(F)  # the chunk's dA total, summed over the group
    wblock = np.empty((group, hi - lo, F), grad.dtype)
    DPHI = np.empty((group, hi - lo, F))  # the hash backward runs once per chunk, SIMD over tokens
    st = step_buffers(v, F, min(SCAN_BLOCK, hi - lo))
    M, Y, Z, dS = st.M, st.Y, st.Z, st.dS  # (once, not per step: every new view counts a reference)
    for i0 in range(lo, hi, SCAN_BLOCK):
        i1 = min(i0 + SCAN_BLOCK, hi)
        m = i1 - i0
        if m != M.shape[0]:  # the chunk's last, shorter step
            st = step_buffers(v, F, m)
            M, Y, Z, dS = st.M, st.Y, st.Z, st.dS
        Pk, V = phik[gk, i0:i1], v[gk, i0:i1]
        for hl in range(group):  # every query head of the group reads the one rebuilt state
            h = h0 + hl
            Pq, Gb, dphi = phiq[h, i0:i1], grad[h, i0:i1], DPHI[hl]
            if dv > 0:  # y_i = B_i g_i = B g_i + sum_{j<=i} phik_j (v_j . g_i)
                dot_rows(S, Gb, Y)
                dot_rows(V, Gb, M)  # M_ij = g_i . v_j, kept for j <= i
                zero_above(M)
                combine_rows(M, Pk, Z)
            copy_into(Ah, A)
            for i in range(m):
                r = i0 + i - lo  # rows by index, not views: a view per token counted a reference
                for f in range(F):
                    Ah[f] += Pk[i, f]
                    dphi[r, f] = Y[i, f] + Z[i, f]
                dden = dphi_from_y(Pq, i, Ah, den[h, i0 + i], L, dphi, r, wq)
                grads.dden[h, i0 + i] = dden
                for f in range(F):
                    dA[f] += Pq[i, f] * dden / L
                    wblock[hl, i0 + i - lo, f] = wq[f]
        copy_into(A, Ah)
        add_product(Pk, V, S, dS, dS, False)  # (no total to track)
    copy_into(partd.A[gk, c], dA)
    if t0 <= c < t1:  # dB = sum_i wq_i g_i^T, summed as the keys' reverse scan sums it
        group_span_totals(wblock, grad, h0, lo, SCAN_BLOCK, partd.B[gk, c], np.empty((F, dv), grad.dtype))
    pg = grads.planes
    for hl in range(group):
        h = h0 + hl
        grads.dbq[h, c] = hash_bwd_rows_dw(DPHI[hl], phiq[h, lo:hi], rows.tq[h, lo:hi], hsh, grads.dq[h, lo:hi],
                                           pg.q[h, lo:hi], pg.dWq[h, c])


@kernel
def _causal_queries_bwd_task(task, spread, bwd, carry, partd):
    """One (key/value head, chunk) task of :func:`causal_queries_bwd` (run by :func:`run_tasks`)."""
    g, c, _, _ = task_bounds(spread.order[task], bwd.chunks)
    _causal_queries_bwd_chunk(bwd, carry, partd, g, c, spread.t0, spread.t1)


def causal_queries_bwd(bwd, carry, partd, totals=None):
    """Backward pass 1: rebuild the prefix states by rescanning; cotangents of the queries.

    Per step with state B before it: Y = G B^T + tril(G V^T) Phik, whose rows
    are y_i = B_i g_i.

    Parameters
    ----------
    bwd : Backward
        ``grad (G, N, dv)`` (the output's cotangent, compute dtype), ``v (Gk,
        N, dv)``, the forward's rows (all kept), the hash and the chunks
        (each chunk's rows and packed sequence: the carries restart at each
        sequence); out ``grads.dq``, ``grads.dden``, ``grads.dbq`` (G heads)
        and, where computed, ``grads.planes.dWq``.
    carry : Sums
        The forward's carries ``A (Gk, nc, F)``, ``B (Gk, nc, F, dv)`` float64.
    partd : Sums
        Out: the chunk totals of ``(dA, dB)``, ``(Gk, nc, F)`` and ``(Gk, nc,
        F, dv)`` float64 summed over each key/value head's query heads
        (written, not added), those of dB for the chunks ``totals = (c0,
        c1)`` only (default all; :func:`causal_keys_bwd` needs those after
        its first segment).
    """
    Gk, nc = carry.A.shape[:2]
    t0, t1 = (0, nc) if totals is None else totals
    run_tasks(_causal_queries_bwd_task, Gk * nc, Spread(spread_order(Gk, nc, t0, t1), t0, t1), bwd, carry, partd)


@kernel(by_address=True)
def _causal_keys_bwd_chunk(bwd, dcarry, gk, c, c0, track, last, final, total):
    """Chunk ``c`` of key/value head ``gk`` of :func:`causal_keys_bwd`, in a
    segment from chunk ``c0``: the suffix sums run over every query head of
    the group; its dB total is summed in ``total`` when ``track``, and
    carried on to chunk c - 1 (``final`` for the first chunk if ``last``)."""
    grad, v, rows, hsh, grads, chunks = bwd
    phik, phiq, den = rows.phik, rows.phiq, rows.den
    G, n, dv = grad.shape
    group = G // v.shape[0]
    h0 = gk * group
    L = hsh.W.shape[0]
    F = phik.shape[2]
    ddv = np.zeros((group, SCAN_BLOCK))
    wq = np.empty((group, SCAN_BLOCK, F), grad.dtype)  # the weights wq_i of g_i in dB, per query head
    Zh = np.empty((SCAN_BLOCK, F), grad.dtype)  # one query head's share of Z
    lo, hi = chunks.cuts[c], chunks.cuts[c + 1]
    dA = dcarry.A[gk, c].copy()
    dB = dcarry.B[gk, c].astype(grad.dtype)  # the carried-in state, in the compute dtype
    DPHI = np.empty((hi - lo, F), np.float64)
    nb = (hi - lo + SCAN_BLOCK - 1) // SCAN_BLOCK
    st = step_buffers(grad, F, min(SCAN_BLOCK, hi - lo))
    M, M2, _, Y, Z, X, dS = st  # (once, not per step: every new view counts a reference)
    for bi in range(nb - 1, -1, -1):
        i0 = lo + bi * SCAN_BLOCK
        i1 = min(i0 + SCAN_BLOCK, hi)
        m = i1 - i0
        if m != M.shape[0]:  # the chunk's last, shorter step
            st = step_buffers(grad, F, m)
            M, M2, _, Y, Z, X, dS = st
        Pk, V, dV = phik[gk, i0:i1], v[gk, i0:i1], grads.dv[gk, i0:i1]
        for hl in range(group):
            h = h0 + hl
            for i in range(m):
                dn = den[h, i0 + i]
                inv = ratio_inverse(dn, L)
                ddv[hl, i] = den_share(grads.dden[h, i0 + i], dn, L)
                for f in range(F):
                    wq[hl, i, f] = phiq[h, i0 + i, f] * inv
        if dv > 0:
            # dphik_j = dB v_j + sum_h sum_{i>=j} wq_hi (g_hi . v_j) + dA_j, dB from after the step
            # dv_j = dB^T phik_j + sum_h sum_{i>=j} (wq_hi . phik_j) g_hi
            dot_rows(dB, V, Y)
            combine_rows(Pk, dB, dV)
            for hl in range(group):
                wb, Gb = wq[hl, :m], grad[h0 + hl, i0:i1]
                dot_rows(Gb, V, M)  # M_ji = v_j . g_i, kept for i >= j
                zero_below(M)
                if hl == 0:
                    combine_rows(M, wb, Z)
                else:
                    combine_rows(M, wb, Zh[:m])
                    for j in range(m):
                        for f in range(F):
                            Z[j, f] += Zh[j, f]
                step_scores(Pk, wb, M2, False)  # M2_ji = phik_j . wq_i, kept for i >= j
                combine_rows(M2, Gb, X)
                for j in range(m):
                    for cc in range(dv):
                        dV[j, cc] += X[j, cc]
        for j in range(m - 1, -1, -1):
            for hl in range(group):
                for f in range(F):
                    dA[f] += phiq[h0 + hl, i0 + j, f] * ddv[hl, j]
            for f in range(F):
                DPHI[i0 + j - lo, f] = Y[j, f] + Z[j, f] + dA[f]
        for hl in range(group):  # dB += Wq_h^T G_h, head by head (as group_span_totals sums them)
            add_product(wq[hl, :m], grad[h0 + hl, i0:i1], dB, dS, total, track)
    pg = grads.planes
    grads.dbk[gk, c] = hash_bwd_rows_dw(DPHI, phik[gk, lo:hi], rows.tk[gk, lo:hi], hsh, grads.dk[gk, lo:hi],
                                        pg.k[gk, lo:hi], pg.dWk[gk, c])
    if c - 1 >= c0 or last:
        carry_on(dcarry.B, gk, c, c - 1, total, final, restarts(chunks.seq, c))


@kernel
def _causal_keys_bwd_task(task, segments, bwd, dcarry, final):
    """One segment of one key/value head of :func:`causal_keys_bwd` (run by :func:`run_tasks`)."""
    dv = bwd.grad.shape[2]
    nc = dcarry.A.shape[1]
    F = bwd.rows.phik.shape[2]
    g, c0, c1 = segment_chunks(task, segments, nc)
    last = c0 == 0 and final.shape[0] > 0  # this segment writes the total to final
    total = np.zeros((F, dv), bwd.grad.dtype)  # the chunk's sum of dB updates, for the next carry
    for ci in range(c1 - c0):
        _causal_keys_bwd_chunk(bwd, dcarry, g, c1 - 1 - ci, c0, last or c1 - c0 > 1, last, final, total)


def causal_keys_bwd(bwd, dcarry, final=None, segments=None):
    """Backward pass 2: suffix sums over queries i >= j by a reverse rescan; cotangents of the keys.

    Per step with dB from after it (queries past the step):
    dPhik = V dB^T + triu(V G^T) Wq + dA (suffix sums),
    dV = Phik dB + triu(Phik Wq^T) G, then dB += Wq^T G.

    Parameters
    ----------
    bwd : Backward
        As :func:`causal_queries_bwd` (the reverse scan restarts at the last
        chunk of each packed sequence); ``grads.dden`` read (from pass 1);
        out ``grads.dk``, ``grads.dv``, ``grads.dbk`` and, where computed,
        ``grads.planes.dWk`` (Gk heads).
    dcarry : Sums
        ``dA (Gk, nc, F)``, ``dB (Gk, nc, F, dv)`` float64: the reverse
        (exclusive suffix) carries at every chunk, summed over each key/value
        head's query heads; of dB only the carry at the last chunk of each
        segment is read, the scan writes the others.
    final : (Gk, F, dv) float64, optional
        Out: the total dB.
    segments : int, optional
        Segments per key/value head (default: one per chunk).
    """
    Gk, nc = dcarry.A.shape[:2]
    segments = nc if segments is None else segments
    run_tasks(_causal_keys_bwd_task, Gk * segments, segments, bwd, dcarry,
              np.zeros((0, 0, 0)) if final is None else final)


@kernel(inline="always")
def _causal_bwd_chunks(bwd, carry, partd, g, cs, acc, total, last, final):
    """Chunks ``nc - 1`` down to ``cs`` of key/value head ``g`` in one pass: each one's
    queries' backward and then its keys' backward, the reverse carries summed
    on the way as :func:`exclusive_scan` sums them (dA in ``acc``, from its
    value on entry; dB from ``partd.B[g, nc - 1]``'s, which the caller sets: the
    dA and dB after the last chunk).  Chunk cs's dB is left in ``total``, not
    carried on, unless ``last`` (cs = 0, ``final`` gets the total dB)."""
    nc = carry.A.shape[1]
    for c in range(nc - 1, cs - 1, -1):
        _causal_queries_bwd_chunk(bwd, carry, partd, g, c, nc, nc)
        if restarts(bwd.chunks.seq, c + 1):
            acc[:] = 0.0
        exclusive_step(partd.A[g, c], partd.A[g, c], acc)  # the chunk's dA total -> its carry
        _causal_keys_bwd_chunk(bwd, partd, g, c, cs, last or nc > 1, last, final, total)


@kernel
def _causal_bwd_task(g, bwd, carry, partd, final, ends):
    """Key/value head ``g`` of :func:`causal_bwd`: from the dA and dB after the last chunk
    (``ends``, or zero where it has no rows), and ``ends.A[g]`` gets the total dA."""
    F = bwd.rows.phik.shape[2]
    nc = carry.A.shape[1]
    acc = np.zeros(F)
    given = ends.A.shape[0] > 0
    if given:
        copy_into(acc, ends.A[g])
        copy_into(partd.B[g, nc - 1], ends.B[g])
    else:
        partd.B[g, nc - 1] = 0.0  # no dB after the last chunk
    _causal_bwd_chunks(bwd, carry, partd, g, 0, acc, np.zeros((F, bwd.grad.shape[2]), bwd.grad.dtype),
                       final.shape[0] > 0, final)
    if given:
        copy_into(ends.A[g], acc)


def causal_bwd(bwd, carry, partd, final=None, ends=None):
    """:func:`causal_queries_bwd`, :func:`exclusive_scan` of the carries and
    :func:`causal_keys_bwd` in one pass, for one segment per key/value head.

    Each chunk's keys' backward follows its queries' backward while the
    chunk's rows of ``v`` and ``grad`` are still in cache, instead of
    reading them again in a second pass (docs/performance.md, "one-pass
    causal backward").  The same bits as the three calls; ``partd`` ends as
    the reverse carries.  Arguments as :func:`causal_queries_bwd`; ``bwd.grads``
    gets every output and ``final (Gk, F, dv)`` (optional) the total dB.

    ``ends`` (optional, a block of a longer sequence, unpacked): ``Sums(A (Gk,
    F), B (Gk, F, dv))`` float64, on entry the cotangent of the state after
    the last chunk, which every reverse carry then starts from (default
    zero; the three calls add it after the scan instead, so the carries
    differ from theirs by rounding); on return ``ends.A`` is the total dA
    (entry value included), and ``final`` (needed with ``ends``) the total
    dB: the cotangent of the state before the first chunk.  ``ends.B`` is
    read only.
    """
    if ends is not None and final is None:
        raise ValueError("causal_bwd(ends=...) writes the total dB to final: give final")
    none = Sums(np.zeros((0, 0)), np.zeros((0, 0, 0)))
    run_tasks(_causal_bwd_task, bwd.v.shape[0], bwd, carry, partd, np.zeros((0, 0, 0)) if final is None else final,
              none if ends is None else ends)


@kernel
def _causal_bwd_split_task(task, cs, bwd, carry, partd, tail):
    """Task of :func:`causal_bwd_split`: even, key/value head ``task // 2``'s chunks
    ``[cs, nc)`` in one pass, with their dA and dB sums in ``tail``; odd, the
    queries' backward of its chunks ``[0, cs)``, with the dB totals of the
    keys' second segment, ``[cs // 2, cs)``."""
    g = task // 2
    if task % 2 == 0:
        total = np.zeros((bwd.rows.phik.shape[2], bwd.grad.shape[2]), bwd.grad.dtype)
        tail.A[g] = 0.0
        partd.B[g, carry.A.shape[1] - 1] = 0.0  # no dA or dB after the last chunk
        _causal_bwd_chunks(bwd, carry, partd, g, cs, tail.A[g], total, False, tail.B)
        carry_on(partd.B, g, cs, -1, total, tail.B, restarts(bwd.chunks.seq, cs))  # tail.B[g]: the dB carry of chunk cs - 1
    else:
        for c in range(cs):
            _causal_queries_bwd_chunk(bwd, carry, partd, g, c, segment_start(1, 2, cs), cs)


@kernel
def _split_carries(partdA, partdB, tailA, tailB, cs, seq):
    """Reverse carries of chunks ``c < cs`` (in place of their totals), summed on from
    the sums of chunks ``>= cs``, ``tailA``, ``tailB``: dA of every chunk, dB of the
    last chunks of the keys' two segments (``partdB`` flat: (Gk, nc, F * dv)); the
    sums restart at each packed sequence (``seq``)."""
    m = segment_start(1, 2, cs)
    for g in range(partdA.shape[0]):
        acc = tailA[g].copy()
        for c in range(cs - 1, -1, -1):
            if restarts(seq, c + 1):
                acc[:] = 0.0
            exclusive_step(partdA[g, c], partdA[g, c], acc)
        acc = tailB[g].copy()
        for c in range(cs - 1, m - 1, -1):  # the totals of the second segment's chunks
            if restarts(seq, c + 1):
                acc[:] = 0.0
            exclusive_step(partdB[g, c], partdB[g, c], acc)
        if restarts(seq, m):
            acc[:] = 0.0
        copy_into(partdB[g, m - 1], acc)


def causal_bwd_split(bwd, carry, partd, final=None):
    """:func:`causal_bwd` on two tasks per key/value head, for two segments each; the same bits.

    The last chunks, ``[cs, nc)`` with nc - cs ~ SPLIT_TAIL * nc, need no
    carry: one task runs them in one pass while the other runs the queries'
    backward of the chunks before them, with the dB totals of
    ``[cs // 2, cs)``; then :func:`causal_keys_bwd` runs ``[0, cs)`` in two
    segments from the first task's carries (docs/performance.md, "split
    backward").  Arguments as :func:`causal_bwd`.  Needs nc >= 3.
    """
    G, nc = carry.A.shape[:2]
    if nc < 3:
        raise ValueError(f"causal_bwd_split needs 3 chunks or more, got {nc}")
    cs = nc - min(nc - 2, max(1, round(config.SPLIT_TAIL * nc)))
    F, dv = partd.B.shape[2:]
    tail = Sums(np.zeros((G, F)), np.zeros((G, F, dv)))
    run_tasks(_causal_bwd_split_task, 2 * G, cs, bwd, carry, partd, tail)
    _split_carries(partd.A, partd.B.reshape(G, nc, F * dv), tail.A, tail.B.reshape(G, F * dv), cs, bwd.chunks.seq)
    causal_keys_bwd(bwd._replace(chunks=Chunks(bwd.chunks.cuts[:cs + 1], bwd.chunks.seq[:cs])),
                    Sums(partd.A[:, :cs], partd.B[:, :cs]), final=final, segments=2)

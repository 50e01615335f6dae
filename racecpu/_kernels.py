"""Numba CPU kernels of RACE attention (no argument checking here: see attention.py).

Layout.  Every (batch, head) pair is a *group* ``g``.  Arrays are C-contiguous:
``x (G, N, d)``, ``v (G, N, dv)``, planes ``W (L, P, d)``.  The soft hash of
all tables of one token is one row ``phi (F,)`` with ``F = L * R``, table ``l``
at ``phi[l*R:(l+1)*R]``; its tanh projections are ``t (L * P,)``.

Work is split into *chunks* of at most ``chunk`` consecutive tokens of one
group, and ``prange`` runs over all (group, chunk) tasks, so a single head
still uses every core.  Each task keeps its sketch ``(A, B)`` (``A (F,)``,
``B (F, dv)``) in the compute dtype for at most ``chunk`` tokens; sums across
chunks are carried in float64, so no long sum drifts in float32.  Partial
sketches are per chunk, not per thread: results do not depend on the thread
count.

The causal scan is chunk-parallel around an explicit carried state:
(1) chunk totals in parallel (:func:`sketch_chunks`), (2) an exclusive scan of
the totals in float64 (:func:`exclusive_scan`), (3) every chunk rescanned from
its carried-in state (:func:`causal_readout`).  The backward is exact: prefix
states are rebuilt by rescanning from the stored carries and suffix sums by a
reverse scan; nothing is obtained by subtracting from a total.

Forward and backward of each step stand side by side.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .hashing import DEN_FLOOR

# Reassociation lets LLVM vectorise the dv-long inner loops and dot products.
# No 'nnan'/'ninf': the guards below must see real comparisons.
_FM = {"contract", "reassoc", "nsz", "arcp"}
_JIT = dict(cache=True, fastmath=_FM, nogil=True)
_PJIT = dict(parallel=True, cache=True, fastmath=_FM, nogil=True)


# ---------------------------------------------------------------------------
# soft hash of one token: forward and backward
# ---------------------------------------------------------------------------

@njit(**_JIT)
def _sigmoid(z):
    # Stable for any z: exp never sees a positive argument.
    if z >= 0.0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


@njit(**_JIT)
def hash_row(x, W, beta, t, phi, keep):
    """phi_l(x) for every table, by the logistic factorisation of the softmax.

    softmax_r(beta t.v_r) = prod_p sigmoid(2 beta t_p v_{r,p}); the product is
    built by doubling, plane 0 being the most significant bit of r.  With
    ``keep`` False (a masked key) phi is set to 0 but t is still written.
    """
    L, P, d = W.shape
    R = 1 << P
    zero = W[0, 0, 0] - W[0, 0, 0]  # typed zero in the compute dtype
    for l in range(L):
        base = l * R
        phi[base] = 1.0
        n = 1
        for p in range(P):
            u = zero
            for i in range(d):
                u += x[i] * W[l, p, i]
            th = math.tanh(u)
            t[l * P + p] = th
            a = _sigmoid(2.0 * beta * th)
            b = _sigmoid(-2.0 * beta * th)
            for i in range(n - 1, -1, -1):
                val = phi[base + i]
                phi[base + 2 * i + 1] = val * a
                phi[base + 2 * i] = val * b
            n *= 2
        if not keep:
            for r in range(R):
                phi[base + r] = 0.0


@njit(**_JIT)
def hash_row_bwd(dphi, phi, t, W, beta, dx):
    """Back through softmax over corners, tanh and x -> W x.

    dz = phi * (dphi - phi.dphi);  s = C^T dz;  du = beta s (1 - t^2);
    dx = sum_l W_l^T du.  Returns this token's contribution s.t to dbeta.
    ``dphi`` is float64; ``dx`` is overwritten.
    """
    L, P, d = W.shape
    R = 1 << P
    for i in range(d):
        dx[i] = 0.0
    dbeta = 0.0
    for l in range(L):
        base = l * R
        dot = 0.0
        for r in range(R):
            dot += phi[base + r] * dphi[base + r]
        for p in range(P):
            shift = P - 1 - p
            s = 0.0
            for r in range(R):
                dz = phi[base + r] * (dphi[base + r] - dot)
                if (r >> shift) & 1:
                    s += dz
                else:
                    s -= dz
            th = t[l * P + p]
            dbeta += s * th
            du = beta * s * (1.0 - th * th)
            for i in range(d):
                dx[i] += du * W[l, p, i]
    return dbeta


@njit(**_PJIT)
def soft_hash_rows(x, W, beta, t, phi):
    """phi and t of every row of ``x (N, d)`` (the public ``soft_buckets``)."""
    for i in prange(x.shape[0]):
        hash_row(x[i], W, beta, t[i], phi[i], True)


# ---------------------------------------------------------------------------
# per-token readout of a sketch: forward and backward
# ---------------------------------------------------------------------------

@njit(**_JIT)
def readout_row(phiq, A, S, L, out):
    """out = (phiq S) / (phiq . A) with the 1/L of both; returns den.

    A is float64; S is (F, dv) in the compute dtype.  Rows whose den is at
    most DEN_FLOOR get zeros (see hashing.DEN_FLOOR).
    """
    F, dv = S.shape
    den = 0.0
    for f in range(F):
        den += phiq[f] * A[f]
    den /= L
    for c in range(dv):
        out[c] = 0.0
    if den <= DEN_FLOOR:
        return den
    for f in range(F):
        w = phiq[f]
        for c in range(dv):
            out[c] += w * S[f, c]
    inv = 1.0 / (L * den)
    for c in range(dv):
        out[c] *= inv
    return den


@njit(**_JIT)
def readout_row_bwd(phiq, A, S, g, den, L, dphi, wq):
    """Cotangent of :func:`readout_row` w.r.t. phiq; returns dden.

    With y = S g:  dden = -(phiq . y) / (L den^2),
    dphiq = y / (L den) + A dden / L  (written to ``dphi``, float64), and the
    weights ``wq = phiq / (L den)`` with which g enters dB (dB += wq g^T).
    """
    F, dv = S.shape
    if den <= DEN_FLOOR:
        for f in range(F):
            dphi[f] = 0.0
            wq[f] = 0.0
        return 0.0
    inv = 1.0 / (L * den)
    phiy = 0.0
    for f in range(F):
        y = 0.0
        for c in range(dv):
            y += S[f, c] * g[c]
        dphi[f] = y  # stash y
        phiy += phiq[f] * y
    dden = -phiy * inv / den
    for f in range(F):
        dphi[f] = dphi[f] * inv + A[f] * dden / L
        wq[f] = phiq[f] * inv
    return dden


@njit(**_JIT)
def key_row_bwd(phik, tk, vrow, dB, dA, W, beta, dphi, dk, dvrow):
    """Cotangents of one key: dphik = dB v + dA, dv = dB^T phik, then dk.

    Returns the key's contribution to dbeta.  A masked key has phik = 0, so
    its dv, dk and dbeta come out 0 by the formulas themselves.
    """
    F, dv = dB.shape
    for c in range(dv):
        dvrow[c] = 0.0
    for f in range(F):
        y = 0.0
        w = phik[f]
        for c in range(dv):
            y += dB[f, c] * vrow[c]
            dvrow[c] += w * dB[f, c]
        dphi[f] = y + dA[f]
    return hash_row_bwd(dphi, phik, tk, W, beta, dk)


# ---------------------------------------------------------------------------
# chunk bookkeeping
# ---------------------------------------------------------------------------

@njit(**_JIT)
def _bounds(task, nc, chunk, n):
    g = task // nc
    c = task - g * nc
    lo = c * chunk
    hi = min(lo + chunk, n)
    return g, c, lo, hi


def exclusive_scan(part, reverse=False):
    """Exclusive prefix (or suffix, ``reverse``) sums over axis 1, in float64."""
    out = np.zeros_like(part)
    if part.shape[1] > 1:
        if reverse:
            out[:, :-1] = np.cumsum(part[:, :0:-1], axis=1)[:, ::-1]
        else:
            out[:, 1:] = np.cumsum(part[:, :-1], axis=1)
    return out


# ---------------------------------------------------------------------------
# sketch of keys: forward (chunk totals) and its cotangent (per key)
# ---------------------------------------------------------------------------

@njit(**_PJIT)
def sketch_chunks(k, v, mask, W, beta, chunk, phik, tk, partA, partB):
    """Hash every key and sum its sketch per chunk.

    Writes ``phik (G, Nk, F)`` and ``tk (G, Nk, L*P)`` (masked keys: phi = 0),
    and the chunk totals ``partA (G, nc, F)``, ``partB (G, nc, F, dv)`` in
    float64.  Non-causal attention sums them; the causal scan carries them.
    """
    G, n, _ = k.shape
    nc = partA.shape[1]
    F = phik.shape[2]
    dv = v.shape[2]
    for task in prange(G * nc):
        g, c, lo, hi = _bounds(task, nc, chunk, n)
        A = np.zeros(F, np.float64)
        B = np.zeros((F, dv), v.dtype)
        for j in range(lo, hi):
            ph = phik[g, j]
            hash_row(k[g, j], W, beta, tk[g, j], ph, mask[g, j])
            vj = v[g, j]
            for f in range(F):
                w = ph[f]
                A[f] += w
                for cc in range(dv):
                    B[f, cc] += w * vj[cc]
        partA[g, c] = A
        for f in range(F):
            for cc in range(dv):
                partB[g, c, f, cc] = B[f, cc]


@njit(**_PJIT)
def keys_bwd(v, phik, tk, dA, dB, W, beta, chunk, dk, dv_out, dbeta_part):
    """Non-causal cotangents of every key from the summed (dA, dB)."""
    G, n, _ = v.shape
    F = phik.shape[2]
    nc = dbeta_part.shape[1]
    for task in prange(G * nc):
        g, c, lo, hi = _bounds(task, nc, chunk, n)
        dphi = np.empty(F, np.float64)
        acc = 0.0
        for j in range(lo, hi):
            acc += key_row_bwd(phik[g, j], tk[g, j], v[g, j], dB[g], dA[g], W, beta,
                               dphi, dk[g, j], dv_out[g, j])
        dbeta_part[g, c] = acc


# ---------------------------------------------------------------------------
# non-causal readout of queries: forward and backward
# ---------------------------------------------------------------------------

@njit(**_PJIT)
def queries_fwd(q, W, beta, chunk, A, B, phiq, tq, den, out):
    """Hash every query and read the summed sketch ``A (G, F)``, ``B (G, F, dv)``."""
    G, n, _ = q.shape
    L = W.shape[0]
    nc = (n + chunk - 1) // chunk
    for task in prange(G * nc):
        g, c, lo, hi = _bounds(task, nc, chunk, n)
        for i in range(lo, hi):
            hash_row(q[g, i], W, beta, tq[g, i], phiq[g, i], True)
            den[g, i] = readout_row(phiq[g, i], A[g], B[g], L, out[g, i])


@njit(**_PJIT)
def queries_bwd(grad, phiq, tq, den, A, B, W, beta, chunk, dq, partdA, partdB, dbeta_part):
    """Non-causal cotangents of every query, and chunk sums of (dA, dB)."""
    G, n, dv = grad.shape
    L = W.shape[0]
    F = phiq.shape[2]
    nc = partdA.shape[1]
    for task in prange(G * nc):
        g, c, lo, hi = _bounds(task, nc, chunk, n)
        dphi = np.empty(F, np.float64)
        wq = np.empty(F, np.float64)
        dA = np.zeros(F, np.float64)
        dB = np.zeros((F, dv), grad.dtype)
        acc = 0.0
        for i in range(lo, hi):
            gi = grad[g, i]
            dden = readout_row_bwd(phiq[g, i], A[g], B[g], gi, den[g, i], L, dphi, wq)
            for f in range(F):
                dA[f] += phiq[g, i, f] * dden / L
                w = wq[f]
                for cc in range(dv):
                    dB[f, cc] += w * gi[cc]
            acc += hash_row_bwd(dphi, phiq[g, i], tq[g, i], W, beta, dq[g, i])
        partdA[g, c] = dA
        for f in range(F):
            for cc in range(dv):
                partdB[g, c, f, cc] = dB[f, cc]
        dbeta_part[g, c] = acc


# ---------------------------------------------------------------------------
# causal scan: forward (rescan from carries) and backward (two rescans)
# ---------------------------------------------------------------------------

@njit(**_PJIT)
def causal_fwd(q, v, phik, carryA, carryB, W, beta, chunk, phiq, tq, den, out):
    """Rescan every chunk from its carried-in state, reading each query after its key.

    ``carryA (G, nc, F)``, ``carryB (G, nc, F, dv)`` (float64) hold the state
    (A, B) summed over all keys before the chunk.
    """
    G, n, _ = q.shape
    L = W.shape[0]
    nc = carryA.shape[1]
    F = phik.shape[2]
    dv = v.shape[2]
    for task in prange(G * nc):
        g, c, lo, hi = _bounds(task, nc, chunk, n)
        A = carryA[g, c].copy()
        S = np.empty((F, dv), v.dtype)
        for f in range(F):
            for cc in range(dv):
                S[f, cc] = carryB[g, c, f, cc]
        for i in range(lo, hi):
            ph = phik[g, i]
            vi = v[g, i]
            for f in range(F):
                w = ph[f]
                A[f] += w
                for cc in range(dv):
                    S[f, cc] += w * vi[cc]
            hash_row(q[g, i], W, beta, tq[g, i], phiq[g, i], True)
            den[g, i] = readout_row(phiq[g, i], A, S, L, out[g, i])


@njit(**_PJIT)
def causal_queries_bwd(grad, v, phik, phiq, tq, den, carryA, carryB, W, beta, chunk,
                       dq, dden_out, partdA, partdB, dbeta_part):
    """Backward pass 1: rebuild prefix states by rescanning; cotangents of queries.

    Also stores dden per query and the chunk totals of (dA, dB) for the
    reverse scan.
    """
    G, n, dv = grad.shape
    L = W.shape[0]
    nc = carryA.shape[1]
    F = phik.shape[2]
    for task in prange(G * nc):
        g, c, lo, hi = _bounds(task, nc, chunk, n)
        A = carryA[g, c].copy()
        S = np.empty((F, dv), v.dtype)
        for f in range(F):
            for cc in range(dv):
                S[f, cc] = carryB[g, c, f, cc]
        dphi = np.empty(F, np.float64)
        wq = np.empty(F, np.float64)
        dA = np.zeros(F, np.float64)
        dB = np.zeros((F, dv), grad.dtype)
        acc = 0.0
        for i in range(lo, hi):
            ph = phik[g, i]
            vi = v[g, i]
            for f in range(F):
                w = ph[f]
                A[f] += w
                for cc in range(dv):
                    S[f, cc] += w * vi[cc]
            gi = grad[g, i]
            dden = readout_row_bwd(phiq[g, i], A, S, gi, den[g, i], L, dphi, wq)
            dden_out[g, i] = dden
            for f in range(F):
                dA[f] += phiq[g, i, f] * dden / L
                w = wq[f]
                for cc in range(dv):
                    dB[f, cc] += w * gi[cc]
            acc += hash_row_bwd(dphi, phiq[g, i], tq[g, i], W, beta, dq[g, i])
        partdA[g, c] = dA
        for f in range(F):
            for cc in range(dv):
                partdB[g, c, f, cc] = dB[f, cc]
        dbeta_part[g, c] = acc


@njit(**_PJIT)
def causal_keys_bwd(grad, v, phik, tk, phiq, den, dden, carrydA, carrydB, W, beta, chunk,
                    dk, dv_out, dbeta_part):
    """Backward pass 2: suffix sums (dA, dB) over queries i >= j by a reverse rescan."""
    G, n, dv = grad.shape
    L = W.shape[0]
    nc = carrydA.shape[1]
    F = phik.shape[2]
    for task in prange(G * nc):
        g, c, lo, hi = _bounds(task, nc, chunk, n)
        dA = carrydA[g, c].copy()
        dB = np.empty((F, dv), grad.dtype)
        for f in range(F):
            for cc in range(dv):
                dB[f, cc] = carrydB[g, c, f, cc]
        dphi = np.empty(F, np.float64)
        acc = 0.0
        for j in range(hi - 1, lo - 1, -1):
            dn = den[g, j]
            if dn > DEN_FLOOR:
                gj = grad[g, j]
                inv = 1.0 / (L * dn)
                for f in range(F):
                    pq = phiq[g, j, f]
                    dA[f] += pq * dden[g, j] / L
                    w = pq * inv
                    for cc in range(dv):
                        dB[f, cc] += w * gj[cc]
            acc += key_row_bwd(phik[g, j], tk[g, j], v[g, j], dB, dA, W, beta,
                               dphi, dk[g, j], dv_out[g, j])
        dbeta_part[g, c] = acc

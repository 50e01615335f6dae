"""Fused numba.cuda kernels of the chunkwise form (``racecpu.chunkwise``), used by ``racecpu.cuda.CudaOps``.

The array form of :mod:`racecpu.chunkwise` writes and reads back an ``(N, dv)`` or
``(nc, C, C)`` temporary for every array expression; on a GPU that traffic, not the
arithmetic, is its time.  These kernels compute the same numbers reading each input
once and writing each result once, with a block of ``TPB`` threads per (head, chunk)
that walks its chunk in tiles of ``T`` tokens:

* column work: thread ``j`` owns column ``j`` of ``v`` / ``grad`` and keeps column
  ``j`` of the running state (``F`` numbers) in registers, so the causal readout
  ``out_i = phi_q_i . S_i / D_i`` is a recurrence inside the chunk that needs no
  reduction across threads (``fused_recurrent`` in flash-linear-attention's terms);
* token work: the sums over ``dv`` that a backward needs for each token
  (``sum_j S[f, j] g[i, j]`` and the ``T x T`` products ``g_i . v_t``) run as small
  products over the tile in shared memory, thread per output.

The chunk states come from :func:`chunk_states` (a thread per column sums
``phi^T v`` over the chunk), and the exclusive float64 scan over chunks is
``racecpu.cuda._kernels.segment_sums / segment_scan`` as before.  Shared tiles are
padded to an odd row length so a warp reading a column hits 32 banks.

Kernels depend on ``(F, T, TPB, dtype)`` through local and shared array sizes and
are built once per combination by :func:`make_chunk_kernels`.  Math and names as
in :mod:`racecpu.chunkwise`: ``D_i = phi_q_i . A_i`` (``L * den``), ``1 / D`` is 0
where ``D <= L * DEN_FLOOR``.
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np
from numba import cuda

__all__ = ["make_chunk_kernels", "make_hash_kernels", "hash_fits"]


@functools.lru_cache(maxsize=None)
def make_chunk_kernels(F, T, TPB, dtype):
    """The fused kernels for ``F`` features per token, tiles of ``T`` tokens, ``TPB`` threads
    per block (``TPB >= dv`` for the backward kernels) and compute ``dtype`` (float32/float64).

    Returns a dict of kernels (launch ``[grid, TPB, stream]``):

    ``chunk_states(phi, w, x, C, mode, part)``
        ``part[s, c, f, j] = sum_{t in chunk c} phi[s, t, f] * w[s, t] * x[s, t, j]``, where bit 1 of
        ``mode`` unset reads ``w`` as 1 and bit 2 set reads ``x`` as 1 (then ``part (S, nc, F, 1)``);
        an array read as 1 is not read at all.  Grid ``(nc, S, ceil(dv / TPB))``.
    ``readout(phiq, phik, v, Bp, Ap, group, C, causal, floor_d, out, D)``
        the forward: ``out[h] = num / D`` and ``D[h]``; causal: ``Bp (S, nc, F, dv)``,
        ``Ap (S, nc, F)`` the states each chunk starts from; else ``Bp (S, 1, F, dv)``,
        ``Ap (S, 1, F)`` the whole sketch.  Grid ``(ceil(N / C), S * group, ceil(dv / TPB))``.
    ``queries_bwd(phiq, phik, v, g, W, Bp, Ap, C, dpq, dD)``
        causal, one query head per key/value head, ``W (S, N)`` the ``1 / D``: ``dphi_q`` and
        ``dD``; grid ``(nc, S)``.
    ``keys_bwd(phiq, phik, v, g, W, dD, dBn, dAn, C, dpk, dv_out)``
        causal: ``dphi_k`` and ``dv`` from the suffix states ``dBn``, ``dAn`` after each
        chunk; grid ``(nc, S)``.
    """
    ty = numba.from_dtype(np.dtype(dtype))
    DVP = TPB + 1  # shared row length of the (T, dv) tiles: odd, so a column read hits distinct banks
    zero = ty(0.0)
    one = ty(1.0)
    # The (T, dv) and (F, dv) tiles of the backward are flat and indexed in uint64: Numba wraps
    # negative signed indices, which costs ~8 integer instructions per shared load in the loops
    # over dv; unsigned offsets leave 2 loads and an FMA per step.
    UDVP = np.uint64(DVP)
    U0 = np.uint64(0)
    U1 = np.uint64(1)
    ROWS_SZ = T * DVP
    STATE_SZ = F * DVP

    @cuda.jit(device=True)
    def dot(a, ia, b, ib, n):
        """``sum_{m < n} a[ia + m] * b[ib + m]`` over flat shared rows (uint64 offsets)."""
        acc = zero
        m = U0
        while m < n:
            acc += a[ia + m] * b[ib + m]
            m += U1
        return acc

    @cuda.jit
    def chunk_states(phi, w, x, C, mode, part):
        c = cuda.blockIdx.x
        s = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        j = cuda.blockIdx.z * TPB + tid
        N = phi.shape[1]
        dv = part.shape[3]
        t0 = c * C
        t1 = min(N, t0 + C)
        acc = cuda.local.array(F, ty)
        for f in range(F):
            acc[f] = zero
        pt = cuda.shared.array((T, F), ty)
        xt = cuda.shared.array((T, TPB), ty)
        for a in range(t0, t1, T):
            nb = min(t1 - a, T)
            cuda.syncthreads()
            if j < dv and not mode & 2:
                for i in range(T):  # a constant trip count: unrolled, the tile's loads in flight together
                    if i < nb:
                        xt[i, tid] = x[s, a + i, j]
            for e in range(tid, nb * F, TPB):
                i = e // F
                f = e - i * F
                val = phi[s, a + i, f]
                if mode & 1:
                    val *= w[s, a + i]
                pt[i, f] = val
            cuda.syncthreads()
            if j < dv:
                for i in range(nb):
                    xv = one if mode & 2 else xt[i, tid]
                    for f in range(F):
                        acc[f] += pt[i, f] * xv
        if j < dv:
            for f in range(F):
                part[s, c, f, j] = acc[f]

    @cuda.jit
    def readout(phiq, phik, v, Bp, Ap, group, C, causal, floor_d, out, D):
        c = cuda.blockIdx.x
        h = cuda.blockIdx.y
        s = h // group
        tid = cuda.threadIdx.x
        j = cuda.blockIdx.z * TPB + tid
        N = phiq.shape[1]
        dv = v.shape[2]
        cs = c if causal else 0
        t0 = c * C
        t1 = min(N, t0 + C)
        col = cuda.local.array(F, ty)        # column j of the state: B (causal: running)
        for f in range(F):
            col[f] = Bp[s, cs, f, j] if j < dv else zero
        qt = cuda.shared.array((T, F), ty)
        kt = cuda.shared.array((T, F), ty)
        kc = cuda.shared.array((T, F), ty)   # A_i: the state's key mass up to token i of the tile
        vt = cuda.shared.array((T, TPB), ty)
        arun = cuda.shared.array(F, ty)      # A before the tile
        winv = cuda.shared.array(T, ty)
        if tid < F:
            arun[tid] = Ap[s, cs, tid]
        for a in range(t0, t1, T):
            nb = min(t1 - a, T)
            cuda.syncthreads()
            if causal and j < dv:
                for i in range(T):  # a constant trip count: unrolled, the tile's loads in flight together
                    if i < nb:
                        vt[i, tid] = v[s, a + i, j]
            for e in range(tid, nb * F, TPB):
                i = e // F
                f = e - i * F
                qt[i, f] = phiq[h, a + i, f]
                if causal:
                    kt[i, f] = phik[s, a + i, f]
            cuda.syncthreads()
            if tid < F:
                acc = arun[tid]
                for i in range(nb):
                    if causal:
                        acc += kt[i, tid]
                    kc[i, tid] = acc
                arun[tid] = acc
            cuda.syncthreads()
            if tid < nb:
                den = zero
                for f in range(F):
                    den += qt[tid, f] * kc[tid, f]
                if cuda.blockIdx.z == 0:
                    D[h, a + tid] = den
                winv[tid] = one / den if den > floor_d else zero
            cuda.syncthreads()
            if j < dv:
                for i in range(nb):
                    if causal:
                        xv = vt[i, tid]
                        for f in range(F):
                            col[f] += kt[i, f] * xv
                    num = zero
                    for f in range(F):
                        num += qt[i, f] * col[f]
                    out[h, a + i, j] = num * winv[i]

    @cuda.jit(device=True)
    def stage(g, v, s, a, nb, j, col, gt, vt, st):
        """Column ``j`` of a tile of ``g`` and ``v`` (rows ``a .. a + nb``) and of the state ``col``
        into the flat shared tiles ``gt``, ``vt`` (``(T, DVP)``) and ``st`` (``(F, DVP)``)."""
        for i in range(T):  # a constant trip count: unrolled, the tile's loads in flight together
            if i < nb:
                gt[i * DVP + j] = g[s, a + i, j]
                vt[i * DVP + j] = v[s, a + i, j]
        for f in range(F):
            st[f * DVP + j] = col[f]

    @cuda.jit
    def queries_bwd(phiq, phik, v, g, W, Bp, Ap, C, dpq, dD):
        # SG_i[f] = sum_j S_i[f, j] g_ij with S_i the inclusive state, split as
        # S_prev^T g_i (the tile-start state, from shared) + sum_{t <= i in tile} (g_i . v_t) phi_k_t.
        c = cuda.blockIdx.x
        s = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        j = tid
        N = phiq.shape[1]
        dv = v.shape[2]
        t0 = c * C
        t1 = min(N, t0 + C)
        col = cuda.local.array(F, ty)
        for f in range(F):
            col[f] = Bp[s, c, f, j] if j < dv else zero
        st = cuda.shared.array(STATE_SZ, ty)   # the tile-start state S_prev, (F, DVP) flat
        gt = cuda.shared.array(ROWS_SZ, ty)    # (T, DVP) flat
        vt = cuda.shared.array(ROWS_SZ, ty)
        udv = np.uint64(dv)
        qt = cuda.shared.array((T, F), ty)
        kt = cuda.shared.array((T, F), ty)
        sg = cuda.shared.array((T, F), ty)
        gv = cuda.shared.array((T, T), ty)
        arun = cuda.shared.array(F, ty)
        winv = cuda.shared.array(T, ty)
        ddt = cuda.shared.array(T, ty)
        kc = cuda.shared.array((T, F), ty)     # A_i, inclusive
        if tid < F:
            arun[tid] = Ap[s, c, tid]
        for a in range(t0, t1, T):
            nb = min(t1 - a, T)
            cuda.syncthreads()
            if j < dv:
                stage(g, v, s, a, nb, j, col, gt, vt, st)
            for e in range(tid, nb * F, TPB):
                i = e // F
                f = e - i * F
                qt[i, f] = phiq[s, a + i, f]
                kt[i, f] = phik[s, a + i, f]
            if tid < nb:
                winv[tid] = W[s, a + tid]
            cuda.syncthreads()
            if tid < F:
                acc = arun[tid]
                for i in range(nb):
                    acc += kt[i, tid]
                    kc[i, tid] = acc
                arun[tid] = acc
            for e in range(tid, nb * nb, TPB):
                i = e // nb
                t = e - i * nb
                acc = zero
                if t <= i:
                    acc = dot(gt, np.uint64(i) * UDVP, vt, np.uint64(t) * UDVP, udv)
                gv[i, t] = acc
            for e in range(tid, nb * F, TPB):
                i = e // F
                f = e - i * F
                sg[i, f] = dot(st, np.uint64(f) * UDVP, gt, np.uint64(i) * UDVP, udv)
            cuda.syncthreads()
            for e in range(tid, nb * F, TPB):
                i = e // F
                f = e - i * F
                acc = sg[i, f]
                for t in range(i + 1):
                    acc += gv[i, t] * kt[t, f]
                sg[i, f] = acc
            cuda.syncthreads()
            if tid < nb:
                gnum = zero
                for f in range(F):
                    gnum += qt[tid, f] * sg[tid, f]
                w = winv[tid]
                dd = -gnum * w * w
                ddt[tid] = dd
                dD[s, a + tid] = dd
            cuda.syncthreads()
            for e in range(tid, nb * F, TPB):
                i = e // F
                f = e - i * F
                dpq[s, a + i, f] = sg[i, f] * winv[i] + ddt[i] * kc[i, f]
            if j < dv:
                for i in range(nb):
                    xv = vt[i * DVP + j]
                    for f in range(F):
                        col[f] += kt[i, f] * xv

    @cuda.jit
    def keys_bwd(phiq, phik, v, g, W, dD, dBn, dAn, C, dpk, dv_out):
        # Reverse over the chunk's tiles from the suffix state U (sum over later tokens i of
        # phi_q_i g_i^T / D_i) and a (sum of phi_q_i dD_i): for key t (queries i >= t see it)
        # dv_t = phi_k_t . U_t and dphi_k_t = v_t . U_t + a_t, U_t, a_t inclusive of t's tile.
        c = cuda.blockIdx.x
        s = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        j = tid
        N = phiq.shape[1]
        dv = v.shape[2]
        t0 = c * C
        t1 = min(N, t0 + C)
        col = cuda.local.array(F, ty)          # column j of U after the current tile
        for f in range(F):
            col[f] = dBn[s, c, f, j] if j < dv else zero
        st = cuda.shared.array(STATE_SZ, ty)   # U after the tile, (F, DVP) flat
        gt = cuda.shared.array(ROWS_SZ, ty)    # (T, DVP) flat
        vt = cuda.shared.array(ROWS_SZ, ty)
        udv = np.uint64(dv)
        qt = cuda.shared.array((T, F), ty)     # phi_q / D
        pt = cuda.shared.array((T, F), ty)     # phi_q
        kt = cuda.shared.array((T, F), ty)
        vu = cuda.shared.array((T, F), ty)
        vg = cuda.shared.array((T, T), ty)     # v_t . g_i / D_i, i >= t
        mt = cuda.shared.array((T, T), ty)     # phi_k_t . phi_q_i / D_i, i >= t
        arun = cuda.shared.array(F, ty)
        ddt = cuda.shared.array(T, ty)
        if tid < F:
            arun[tid] = dAn[s, c, tid]
        ntile = (t1 - t0 + T - 1) // T
        for m in range(ntile):
            a = t0 + (ntile - 1 - m) * T
            nb = min(t1 - a, T)
            cuda.syncthreads()
            if j < dv:
                stage(g, v, s, a, nb, j, col, gt, vt, st)
            for e in range(tid, nb * F, TPB):
                i = e // F
                f = e - i * F
                w = W[s, a + i]
                pq = phiq[s, a + i, f]
                pt[i, f] = pq
                qt[i, f] = pq * w
                kt[i, f] = phik[s, a + i, f]
            if tid < nb:
                ddt[tid] = dD[s, a + tid]
            cuda.syncthreads()
            for e in range(tid, nb * nb, TPB):
                t = e // nb
                i = e - t * nb
                acc = zero
                acc2 = acc
                if i >= t:
                    acc = dot(vt, np.uint64(t) * UDVP, gt, np.uint64(i) * UDVP, udv)
                    for f in range(F):
                        acc2 += kt[t, f] * qt[i, f]
                vg[t, i] = acc
                mt[t, i] = acc2
            for e in range(tid, nb * F, TPB):
                t = e // F
                f = e - t * F
                vu[t, f] = dot(st, np.uint64(f) * UDVP, vt, np.uint64(t) * UDVP, udv)
            cuda.syncthreads()
            for e in range(tid, nb * F, TPB):
                t = e // F
                f = e - t * F
                acc = vu[t, f] + arun[f]
                for i in range(t, nb):
                    acc += vg[t, i] * qt[i, f] + ddt[i] * pt[i, f]
                dpk[s, a + t, f] = acc
            if j < dv:
                for t in range(nb):
                    acc = zero
                    for f in range(F):
                        acc += kt[t, f] * col[f]
                    for i in range(t, nb):
                        acc += mt[t, i] * gt[i * DVP + j]
                    dv_out[s, a + t, j] = acc
                for i in range(nb):
                    xv = gt[i * DVP + j]
                    for f in range(F):
                        col[f] += qt[i, f] * xv
            cuda.syncthreads()
            if tid < F:
                acc = arun[tid]
                for i in range(nb):
                    acc += ddt[i] * pt[i, tid]
                arun[tid] = acc

    return dict(chunk_states=chunk_states, readout=readout, queries_bwd=queries_bwd, keys_bwd=keys_bwd)


@functools.lru_cache(maxsize=None)
def make_hash_kernels(L, P, dtype, simulated=False, threads=128):
    """The soft hash and its backward with the planes' product fused in, one warp per row.

    ``hash_rows(x, W, beta, phi, t)``: ``x (M, d)``, ``W (L * P, d)``; writes ``t = tanh(W x)``
    ``(M, L * P)`` and ``phi (M, L * 2**P)`` (:func:`racecpu.chunkwise.soft_hash`'s numbers).
    ``hash_rows_bwd(dphi, phi, t, W, beta, dx, st)``: ``dx (M, d)`` of the rows and ``st (M,)``
    each row's dbeta term (summed by the caller).  Launch with blocks of ``threads`` (whole warps);
    any grid (the blocks stride over the rows).  The lanes read a row's ``d`` entries together
    (coalesced) and sum the ``L * P`` projections across the warp, so there is no ``(M, L * P)``
    GEMM output and no second pass.  Needs :func:`hash_fits`.

    The lanes exchange values by warp shuffles; Numba's CUDA simulator has none, so
    ``simulated=True`` builds the same kernels with the exchanges through shared memory and
    block barriers (every loop that exchanges runs the same trip count in all threads).
    """
    ty = numba.from_dtype(np.dtype(dtype))
    LP = L * P
    R = 1 << P
    F = L * R
    WPB = threads // 32
    zero = ty(0.0)
    one = ty(1.0)
    two = ty(2.0)
    FULL = 0xFFFFFFFF

    if simulated:
        @cuda.jit(device=True)
        def xor_get(val, off, buf, w, lane):
            cuda.syncthreads()
            buf[w, lane] = val
            cuda.syncthreads()
            return buf[w, lane ^ off]

        @cuda.jit(device=True)
        def lane_get(val, src, buf, w, lane):
            cuda.syncthreads()
            buf[w, lane] = val
            cuda.syncthreads()
            return buf[w, src]
    else:
        @cuda.jit(device=True)
        def xor_get(val, off, buf, w, lane):
            return cuda.shfl_xor_sync(FULL, val, off)

        @cuda.jit(device=True)
        def lane_get(val, src, buf, w, lane):
            return cuda.shfl_sync(FULL, val, src)

    @cuda.jit(device=True)
    def sigmoid(z):
        # stable for any z: exp never sees a positive argument
        e = math.exp(-abs(z))
        h = one / (one + e)
        return h if z >= zero else e * h

    @cuda.jit
    def hash_rows(x, W, beta, phi, t):
        M, d = x.shape
        lane = cuda.threadIdx.x & 31
        w = cuda.threadIdx.x >> 5
        buf = cuda.shared.array((WPB, 32), ty)
        u = cuda.local.array(LP, ty)
        b2 = ty(two * beta)  # beta arrives as float64: compute in the kernel's dtype
        for base in range(cuda.blockIdx.x * WPB, M, cuda.gridDim.x * WPB):
            i = base + w
            ok = i < M
            for m in range(LP):
                u[m] = zero
            if ok:
                for kk in range(lane, d, 32):
                    xv = x[i, kk]
                    for m in range(LP):
                        u[m] += xv * W[m, kk]
            um = zero
            for m in range(LP):
                val = u[m]
                off = 16
                while off > 0:
                    val += xor_get(val, off, buf, w, lane)
                    off >>= 1
                if m == lane:
                    um = val
            th = math.tanh(um)          # lane m < LP: plane m
            a = sigmoid(b2 * th)        # the plane's plus side
            b = sigmoid(-b2 * th)
            if ok and lane < LP:
                t[i, lane] = th
            for e0 in range(0, F, 32):  # lane e0 + lane: corner r of table l
                e = e0 + lane
                l = min(e, F - 1) // R
                r = min(e, F - 1) - l * R
                prod = one
                for p in range(P):
                    av = lane_get(a, l * P + p, buf, w, lane)
                    bv = lane_get(b, l * P + p, buf, w, lane)
                    prod *= av if (r >> (P - 1 - p)) & 1 else bv
                if ok and e < F:
                    phi[i, e] = prod

    @cuda.jit
    def hash_rows_bwd(dphi, phi, t, W, beta, dx, st):
        M, d = dx.shape
        lane = cuda.threadIdx.x & 31
        w = cuda.threadIdx.x >> 5
        buf = cuda.shared.array((WPB, 32), ty)
        du = cuda.local.array(LP, ty)
        bt = ty(beta)
        r = lane & (R - 1)
        for base in range(cuda.blockIdx.x * WPB, M, cuda.gridDim.x * WPB):
            i = base + w
            ok = i < M
            term = zero
            for e0 in range(0, F, 32):
                e = e0 + lane
                valid = ok and e < F
                ph = phi[i, e] if valid else zero
                dp = dphi[i, e] if valid else zero
                # the table's dot: a sum over its R lanes (aligned groups of R within the warp)
                dot = ph * dp
                off = R >> 1
                while off > 0:
                    dot += xor_get(dot, off, buf, w, lane)
                    off >>= 1
                dz = ph * (dp - dot)
                l = min(e, F - 1) // R
                for p in range(P):
                    sv = dz if (r >> (P - 1 - p)) & 1 else -dz
                    off = R >> 1
                    while off > 0:
                        sv += xor_get(sv, off, buf, w, lane)
                        off >>= 1
                    # lane r == p of each table holds plane p's cotangent
                    duv = zero
                    if valid and r == p:
                        th = t[i, l * P + p]
                        term += sv * th
                        duv = bt * sv * (one - th * th)
                    for q in range(32 // R):  # every lane gathers this pass's cotangents of plane p
                        got = lane_get(duv, q * R + p, buf, w, lane)
                        lq = e0 // R + q
                        for mm in range(LP):
                            if mm == lq * P + p:
                                du[mm] = got
            off = 16
            while off > 0:
                term += xor_get(term, off, buf, w, lane)
                off >>= 1
            if ok:
                if lane == 0:
                    st[i] = term
                for kk in range(lane, d, 32):
                    acc = zero
                    for m in range(LP):
                        acc += du[m] * W[m, kk]
                    dx[i, kk] = acc

    return dict(hash_rows=hash_rows, hash_rows_bwd=hash_rows_bwd)


def hash_fits(L, P):
    """Whether :func:`make_hash_kernels` takes ``(L, P)``: a warp holds the projections and a table."""
    return L * P <= 32 and (1 << P) <= 32 and P >= 1

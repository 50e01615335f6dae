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
  products over the tile in shared memory: a thread per output (2 shared loads an
  FMA), or with ``blocked`` register blocks of several rows by several outputs whose
  partial sums over alternate columns two threads add (``tile_products``).

A column thread's loops over the ``F`` features of a token are unrolled, and the
``(T, F)`` tiles sit on 16 bytes, so its broadcast reads of a feature row are 16-byte
loads (a quarter of the instructions).

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

__all__ = ["make_chunk_kernels", "make_hash_kernels", "hash_fits", "backward_shared_items"]


#: Threads that share each register block of ``tile_products`` / ``tile_proj``, each summing every
#: KSPLIT-th column: more makes the blocks larger for the same threads, and the partial sums'
#: shared buffer (``T * (T + F) * KSPLIT`` numbers) larger too.
KSPLIT = 2
#: Blocks of the fused backward kernels that share a streaming multiprocessor (their launch bounds).
BACKWARD_BLOCKS = 5


def tile_blocks(T, Q, TPB, KS):
    """Register blocks of the ``(T, Q)`` outputs of a tile product for ``TPB`` threads in groups of
    ``KS``: ``(RB, QB, NR, NQB)``, blocks of ``RB`` rows (dividing ``T``) by ``QB`` outputs, ``NR``
    blocks down and ``NQB`` across (the last may reach past ``Q``), as many blocks as the threads
    take at once (``TPB // KS``) where that keeps a block within 24 sums."""
    RB = next(r for r in (4, 2, 1) if T % r == 0)
    NR = T // RB
    QB = max(1, min(-(-Q // max(1, TPB // KS // NR)), max(1, 24 // RB)))
    return RB, QB, NR, -(-Q // QB)


def tile_layout(F, T, TPB):
    """The shapes of the backward's tile products: ``(RB, QB, NR, NQB, RS)`` of the tile's
    ``(T, T + F)`` products and of its ``(T, F)`` projections (:func:`tile_blocks`, and ``RS`` the
    row length of their partial sums: ``+ 2`` spreads a warp's stores over the banks), the rows of
    the shared ``xs`` (a tile's ``T`` rows then the state's ``F``, padded to whole blocks: the
    padding rows are read, never summed into an output) and the length of the partial sums'
    buffer."""
    pair = tile_blocks(T, T + F, TPB, KSPLIT)
    proj = tile_blocks(T, F, TPB, KSPLIT)
    pair += (pair[3] * pair[1] * KSPLIT + 2,)
    proj += (proj[3] * proj[1] * KSPLIT + 2,)
    xs_rows = max(T + F, pair[3] * pair[1], T + proj[3] * proj[1])
    return pair, proj, xs_rows, T * max(pair[4], proj[4])


def backward_shared_items(F, T, TPB):
    """Shared-memory numbers of the largest fused backward block (``keys_bwd`` with the
    blocked products, or a non-causal one): the ``(T, TPB + 1)`` tile and ``xs``, five
    ``(T, F)`` and two ``(T, T)`` tiles, the partial sums and a few vectors."""
    _, _, xs_rows, red = tile_layout(F, T, TPB)
    return (xs_rows + T) * (TPB + 1) + 5 * T * F + 2 * T * T + F + 2 * T + red


@functools.lru_cache(maxsize=None)
def make_chunk_kernels(F, T, TPB, dtype, blocked=False):
    """The fused kernels for ``F`` features per token, tiles of ``T`` tokens, ``TPB`` threads
    per block (``TPB >= dv`` for the backward kernels) and compute ``dtype`` (float32/float64).
    ``blocked``: the backward's sums over ``dv`` as register-blocked tile products
    (``tile_products``), else a thread per output (``dot``), kept for A/B.

    Returns a dict of kernels (launch ``[grid, TPB, stream]``):

    ``chunk_states(phi, w, x, w2, C, mode, part)``
        a chunk's state and its key mass in one pass over the chunk, ``part (S, nc, F, dv + 1)``:
        ``part[s, c, f, j] = sum_{t in chunk c} phi[s, t, f] * w[s, t] * x[s, t, j]`` for ``j < dv``
        and ``part[s, c, f, dv] = sum_t phi[s, t, f] * w2[s, t]``, where bit 1 of ``mode`` unset
        reads ``w`` as 1 and bit 4 unset reads ``w2`` as 1 (an array read as 1 is not read at
        all).  Grid ``(nc, S, ceil(dv / TPB))``.
    ``readout(phiq, phik, v, BA, group, C, causal, floor_d, out, D)``
        the forward: ``out[h] = num / D`` and ``D[h]``; causal: ``BA (S, nc, F, dv + 1)`` the
        states each chunk starts from, ``B`` in columns ``:dv`` and the key mass ``A`` in column
        ``dv`` (the scanned ``chunk_states`` output); else ``BA (S, 1, F, dv + 1)`` the whole
        sketch.  Grid ``(ceil(N / C), S * group, ceil(dv / TPB))``.
    ``queries_bwd(phiq, phik, v, g, W, BA, C, dpq, dD)``
        causal, one query head per key/value head, ``W (S, N)`` the ``1 / D``: ``dphi_q`` and
        ``dD``; grid ``(nc, S)``.
    ``keys_bwd(phiq, phik, v, g, W, dD, dBA, C, dpk, dv_out)``
        causal: ``dphi_k`` and ``dv`` from the suffix states ``dBA`` after each chunk
        (``dB`` and ``dA`` packed as ``BA``); grid ``(nc, S)``.
    ``nc_queries_bwd(phiq, g, W, BA, C, dpq, dD, part)``
        non-causal, one query head per key/value head, ``BA (S, 1, F, dv + 1)`` the forward's
        sketch: ``dphi_q``, ``dD`` and each chunk's share ``part (S, nc, F, dv + 1)`` of
        ``dB = sum_i phi_q_i g_i^T / D_i`` and ``dA = sum_i phi_q_i dD_i``; grid ``(nc, S)``.
    ``nc_keys_bwd(phik, v, dBA, C, dpk, dv_out)``
        non-causal: ``dphi_k = dB v + dA`` and ``dv = dB^T phi_k`` from the summed ``dBA
        (S, 1, F, dv + 1)``; grid ``(nc, S)``.
    """
    if not 1 <= T <= TPB:
        raise ValueError(f"a tile of T = {T} tokens needs 1 <= T <= TPB = {TPB} threads (a thread per token)")
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
    # tile_products / tile_proj: register blocks of RB rows by QB outputs, each summed over every
    # KS-th column by KS threads (KSPLIT) and the KS partial sums added from shared memory after
    TF = T + F
    KS = KSPLIT
    (RB, QB, NR, NQB, RS), (RBP, QBP, NRP, NQBP, RSP), xs_rows, RED_SZ = tile_layout(F, T, TPB)
    RED_BLOCKED = RED_SZ if blocked else 1
    XS_SZ = xs_rows * DVP

    # Shared (T, F) rows and F vectors on 16 bytes: NVVM then loads 4 features at once where an
    # unrolled loop reads consecutive ones (ld.shared.v4: 6 loads, not 24, for a row of F = 24).
    # The simulator takes no alignment.
    ALIGN = None if numba.config.ENABLE_CUDASIM else 16
    # The backward kernels at most 65536 / (5 * TPB) registers a thread, so that five blocks share an
    # SM (their shared tiles allow five on an H100 / H200): ptxas gave the blocked build 127 and
    # 153, which leave four and three; bounded, 96 and no spills (sm_90, float32, TPB = 128).
    backward_jit = cuda.jit if numba.config.ENABLE_CUDASIM else cuda.jit(launch_bounds=(TPB, BACKWARD_BLOCKS))

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
    def chunk_states(phi, w, x, w2, C, mode, part):
        # The key mass (column dv) rides along with the state: a pass of its own read phi again
        # and ran one busy thread per block (4.95 ms a head at 2^22 on an H200, the state 3.64).
        c = cuda.blockIdx.x
        s = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        j = cuda.blockIdx.z * TPB + tid
        N = phi.shape[1]
        dv = part.shape[3] - 1
        t0 = c * C
        t1 = min(N, t0 + C)
        mass = cuda.blockIdx.z == 0
        acc = cuda.local.array(F, ty)
        for f in range(F):
            acc[f] = zero
        pt = cuda.shared.array((T, F), ty, alignment=ALIGN)
        xt = cuda.shared.array((T, TPB), ty)
        ms = cuda.shared.array(F, ty, alignment=ALIGN)   # the key mass, feature f summed by thread f % TPB
        for f in range(tid, F, TPB):
            ms[f] = zero
        for a in range(t0, t1, T):
            nb = min(t1 - a, T)
            cuda.syncthreads()
            if j < dv:
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
            if mass:  # phi's rows were just read by the loop above: these loads hit L1
                for f in range(tid, F, TPB):
                    am = ms[f]
                    for i in range(nb):
                        pm = phi[s, a + i, f]
                        if mode & 4:
                            pm *= w2[s, a + i]
                        am += pm
                    ms[f] = am
            cuda.syncthreads()
            if j < dv:
                for i in range(nb):
                    xv = xt[i, tid]
                    for f in range(F):
                        acc[f] += pt[i, f] * xv
        if j < dv:
            for f in range(F):
                part[s, c, f, j] = acc[f]
        if mass:
            for f in range(tid, F, TPB):
                part[s, c, f, dv] = ms[f]

    @cuda.jit
    def readout(phiq, phik, v, BA, group, C, causal, floor_d, out, D):
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
            col[f] = BA[s, cs, f, j] if j < dv else zero
        qt = cuda.shared.array((T, F), ty, alignment=ALIGN)
        kt = cuda.shared.array((T, F), ty, alignment=ALIGN)
        kc = cuda.shared.array((T, F), ty, alignment=ALIGN)   # A_i: the state's key mass up to token i of the tile
        vt = cuda.shared.array((T, TPB), ty)
        arun = cuda.shared.array(F, ty, alignment=ALIGN)      # A before the tile
        winv = cuda.shared.array(T, ty)
        for f in range(tid, F, TPB):  # per-feature work strides: F may exceed the threads
            arun[f] = BA[s, cs, f, BA.shape[3] - 1]
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
            for f in range(tid, F, TPB):
                acc = arun[f]
                for i in range(nb):
                    if causal:
                        acc += kt[i, f]
                    kc[i, f] = acc
                arun[f] = acc
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
    def clear_tiles(rows, xs, tid):
        """Zero the shared ``rows (ROWS_SZ,)`` and ``xs (XS_SZ,)`` and synchronise: a short tile and
        ``xs``' padding rows are read by the tile products (into outputs nobody reads), and
        values left in shared memory by another kernel may not be finite."""
        for e in range(tid, ROWS_SZ, TPB):
            rows[e] = zero
        for e in range(tid, XS_SZ, TPB):
            xs[e] = zero
        cuda.syncthreads()

    @cuda.jit(device=True)
    def load_rows(x, s, a, nb, j, dst):
        """Column ``j`` of rows ``a .. a + nb`` of ``x[s]`` into the flat shared ``dst`` (``(T, DVP)``)."""
        for i in range(T):  # a constant trip count: unrolled, the tile's loads in flight together
            if i < nb:
                dst[i * DVP + j] = x[s, a + i, j]

    @cuda.jit(device=True)
    def load_features(phi, s, a, nb, tid, dst):
        """Rows ``a .. a + nb`` of ``phi[s]`` (``F`` wide) into the shared ``dst (T, F)``, all threads."""
        for e in range(tid, nb * F, TPB):
            i = e // F
            f = e - i * F
            dst[i, f] = phi[s, a + i, f]

    @cuda.jit(device=True)
    def stage(y, x, s, a, nb, j, col, rows, xs):
        """Column ``j`` of a tile of ``y`` and ``x`` (rows ``a .. a + nb``) and of the state ``col``
        into the flat shared arrays ``rows`` (``(T, DVP)``: ``y``) and ``xs`` (``(T + F, DVP)``:
        ``x``'s rows, then the state's ``F`` rows).  The two tiles' loads interleave in one loop:
        two load_rows calls in a row took queries_bwd from 94 registers to 164 (ptxas, sm_90)."""
        for i in range(T):  # a constant trip count: unrolled, the tile's loads in flight together
            if i < nb:
                rows[i * DVP + j] = y[s, a + i, j]
                xs[i * DVP + j] = x[s, a + i, j]
        for f in range(F):
            xs[(T + f) * DVP + j] = col[f]

    def block_sums_from(Q0, RBk, QBk, NRk, NQBk, RSk):
        """A device function ``(rows, xs, udv, tid, red)``: the partial sums
        ``red[r * RSk + q * KS + k] = sum_{m = k mod KS} rows_r[m] xs_{Q0 + q}[m]`` over ``udv``
        columns, for every row ``r < T`` and output ``q < NQBk * QBk``, by blocks of ``RBk`` rows
        by ``QBk`` outputs: thread ``tid`` takes slice ``k = tid % KS`` of block ``tid // KS``
        (more blocks than threads: every ``TPB // KS``-th).  Per column it loads ``RBk + QBk``
        values for ``RBk * QBk`` FMAs (a thread per output: 2 loads an FMA).  Adjacent threads
        take adjacent columns and rows ``RBk * DVP`` apart (``DVP`` odd), so a warp's loads fall
        in distinct banks or broadcast."""
        NB = NRk * NQBk
        NACC = RBk * QBk  # a constant: local array sizes must be literal
        @cuda.jit(device=True)
        def block_sums(rows, xs, udv, tid, red):
            acc = cuda.local.array(NACC, ty)
            rv = cuda.local.array(RBk, ty)
            xv = cuda.local.array(QBk, ty)
            k = tid % KS
            for blk in range(tid // KS, NB, TPB // KS):
                r0 = (blk % NRk) * RBk
                q0 = (blk // NRk) * QBk
                for c in range(NACC):
                    acc[c] = zero
                ra = np.uint64(r0) * UDVP + np.uint64(k)
                xa = np.uint64(Q0 + q0) * UDVP + np.uint64(k)
                m = np.uint64(k)
                while m < udv:
                    for ri in range(RBk):  # constant offsets from ra and xa: unrolled
                        rv[ri] = rows[ra + np.uint64(ri) * UDVP]
                    for qi in range(QBk):
                        xv[qi] = xs[xa + np.uint64(qi) * UDVP]
                    for ri in range(RBk):
                        for qi in range(QBk):
                            acc[ri * QBk + qi] += rv[ri] * xv[qi]
                    m += UKS
                    ra += UKS
                    xa += UKS
                for ri in range(RBk):
                    for qi in range(QBk):
                        red[(r0 + ri) * RSk + (q0 + qi) * KS + k] = acc[ri * QBk + qi]
        return block_sums

    UKS = np.uint64(KS)
    sums_all = block_sums_from(0, RB, QB, NR, NQB, RS)
    sums_state = block_sums_from(T, RBP, QBP, NRP, NQBP, RSP)

    @cuda.jit(device=True)
    def added(red, at):
        """The ``KS`` partial sums of one output, ``red[at : at + KS]``, added."""
        acc = zero
        for k in range(KS):
            acc += red[at + k]
        return acc

    @cuda.jit(device=True)
    def tile_products(rows, xs, udv, tid, lower, nb, pair, proj, red):
        """``pair[r, q] = rows_r . xs_q`` for ``q < T`` (0 unless ``q <= r``, or ``q >= r`` when
        not ``lower``) and ``proj[r, f] = rows_r . xs_{T + f}``: sums over ``udv`` columns, every
        row ``r < T``.  Register blocks of partial sums (``block_sums``) into ``red (RED_SZ,)``,
        then a thread per output adds its ``KS`` partials; every thread of the block calls it (it
        synchronises).  Rows and outputs past the tile's ``nb`` tokens hold stale values nobody
        reads."""
        sums_all(rows, xs, udv, tid, red)
        cuda.syncthreads()
        for e in range(tid, T * TF, TPB):
            r = e // TF
            q = e - r * TF
            acc = added(red, r * RS + q * KS)
            if q < T:
                keep = (q <= r) if lower else (q >= r)
                pair[r, q] = acc if keep and r < nb and q < nb else zero
            else:
                proj[r, q - T] = acc

    @cuda.jit(device=True)
    def tile_proj(rows, xs, udv, tid, proj, red):
        """``proj[r, f] = rows_r . xs_{T + f}``, as :func:`tile_products` without the ``T`` pairs."""
        sums_state(rows, xs, udv, tid, red)
        cuda.syncthreads()
        for e in range(tid, T * F, TPB):
            r = e // F
            proj[r, e - r * F] = added(red, r * RSP + (e - r * F) * KS)

    @cuda.jit(device=True)
    def denominator_grad(qt, sg, winv, ddt, dD, s, a, tid, nb):
        """Thread ``i < nb``: ``dD_i = -(phi_q_i . SG_i) / D_i^2`` into ``ddt[i]`` and ``dD[s, a + i]``
        (``SG_i`` the sum over ``dv`` of the state times ``g_i``, in ``sg``; ``winv`` the ``1 / D``)."""
        if tid < nb:
            gnum = zero
            for f in range(F):
                gnum += qt[tid, f] * sg[tid, f]
            w = winv[tid]
            dd = -gnum * w * w
            ddt[tid] = dd
            dD[s, a + tid] = dd

    @backward_jit
    def nc_queries_bwd(phiq, g, W, BA, C, dpq, dD, part):
        # Y_i = B g_i (tile_proj against the sketch's B, staged once), dD_i = -(phi_q_i . Y_i) / D_i^2,
        # dphi_q_i = Y_i / D_i + dD_i A; and, from the same tiles, the chunk's share of dB and dA.
        c = cuda.blockIdx.x
        s = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        j = tid
        N = phiq.shape[1]
        dv = g.shape[2]
        t0 = c * C
        t1 = min(N, t0 + C)
        gt = cuda.shared.array(ROWS_SZ, ty)    # the tile of g, (T, DVP) flat
        xs = cuda.shared.array(XS_SZ, ty)      # rows T .. T + F: the sketch's B
        red = cuda.shared.array(RED_SZ, ty)    # tile_proj's partial sums
        clear_tiles(gt, xs, tid)
        udv = np.uint64(dv)
        qt = cuda.shared.array((T, F), ty, alignment=ALIGN)
        sg = cuda.shared.array((T, F), ty, alignment=ALIGN)
        ab = cuda.shared.array(F, ty, alignment=ALIGN)
        ms = cuda.shared.array(F, ty, alignment=ALIGN)          # the chunk's dA, feature f summed by thread f % TPB
        winv = cuda.shared.array(T, ty)
        ddt = cuda.shared.array(T, ty)
        acc = cuda.local.array(F, ty)          # column j of the chunk's dB
        for f in range(F):
            acc[f] = zero
            if j < dv:
                xs[(T + f) * DVP + j] = BA[s, 0, f, j]
        for f in range(tid, F, TPB):
            ab[f] = BA[s, 0, f, dv]
            ms[f] = zero
        for a in range(t0, t1, T):
            nb = min(t1 - a, T)
            cuda.syncthreads()
            if j < dv:
                load_rows(g, s, a, nb, j, gt)
            load_features(phiq, s, a, nb, tid, qt)
            if tid < nb:
                winv[tid] = W[s, a + tid]
            cuda.syncthreads()
            tile_proj(gt, xs, udv, tid, sg, red)
            cuda.syncthreads()
            denominator_grad(qt, sg, winv, ddt, dD, s, a, tid, nb)
            cuda.syncthreads()
            for e in range(tid, nb * F, TPB):
                i = e // F
                f = e - i * F
                dpq[s, a + i, f] = sg[i, f] * winv[i] + ddt[i] * ab[f]
            if j < dv:
                for i in range(nb):
                    xv = gt[i * DVP + j] * winv[i]
                    for f in range(F):
                        acc[f] += qt[i, f] * xv
            for f in range(tid, F, TPB):
                am = ms[f]
                for i in range(nb):
                    am += qt[i, f] * ddt[i]
                ms[f] = am
        if j < dv:
            for f in range(F):
                part[s, c, f, j] = acc[f]
        for f in range(tid, F, TPB):
            part[s, c, f, dv] = ms[f]

    @backward_jit
    def nc_keys_bwd(phik, v, dBA, C, dpk, dv_out):
        # dphi_k_t = dB v_t + dA (tile_proj against dB, staged once); dv_t = dB^T phi_k_t (column j
        # of dB in registers).
        c = cuda.blockIdx.x
        s = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        j = tid
        N = phik.shape[1]
        dv = v.shape[2]
        t0 = c * C
        t1 = min(N, t0 + C)
        vt = cuda.shared.array(ROWS_SZ, ty)    # the tile of v, (T, DVP) flat
        xs = cuda.shared.array(XS_SZ, ty)      # rows T .. T + F: dB
        red = cuda.shared.array(RED_SZ, ty)    # tile_proj's partial sums
        clear_tiles(vt, xs, tid)
        udv = np.uint64(dv)
        kt = cuda.shared.array((T, F), ty, alignment=ALIGN)
        vu = cuda.shared.array((T, F), ty, alignment=ALIGN)
        da = cuda.shared.array(F, ty, alignment=ALIGN)
        col = cuda.local.array(F, ty)
        for f in range(F):
            col[f] = dBA[s, 0, f, j] if j < dv else zero
            if j < dv:
                xs[(T + f) * DVP + j] = col[f]
        for f in range(tid, F, TPB):
            da[f] = dBA[s, 0, f, dv]
        for a in range(t0, t1, T):
            nb = min(t1 - a, T)
            cuda.syncthreads()
            if j < dv:
                load_rows(v, s, a, nb, j, vt)
            load_features(phik, s, a, nb, tid, kt)
            cuda.syncthreads()
            tile_proj(vt, xs, udv, tid, vu, red)
            cuda.syncthreads()
            for e in range(tid, nb * F, TPB):
                i = e // F
                f = e - i * F
                dpk[s, a + i, f] = vu[i, f] + da[f]
            if j < dv:
                for t in range(nb):
                    acc = zero
                    for f in range(F):
                        acc += kt[t, f] * col[f]
                    dv_out[s, a + t, j] = acc

    @backward_jit
    def queries_bwd(phiq, phik, v, g, W, BA, C, dpq, dD):
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
            col[f] = BA[s, c, f, j] if j < dv else zero
        gt = cuda.shared.array(ROWS_SZ, ty)    # the tile of g, (T, DVP) flat
        xs = cuda.shared.array(XS_SZ, ty)      # the tile of v, then the tile-start state S_prev (F rows)
        red = cuda.shared.array(RED_BLOCKED, ty)  # tile_products' partial sums (blocked)
        if blocked:  # only the tile products read past a short tile and into xs' padding
            clear_tiles(gt, xs, tid)
        udv = np.uint64(dv)
        qt = cuda.shared.array((T, F), ty, alignment=ALIGN)
        kt = cuda.shared.array((T, F), ty, alignment=ALIGN)
        sg = cuda.shared.array((T, F), ty, alignment=ALIGN)
        gv = cuda.shared.array((T, T), ty)
        arun = cuda.shared.array(F, ty, alignment=ALIGN)
        winv = cuda.shared.array(T, ty)
        ddt = cuda.shared.array(T, ty)
        kc = cuda.shared.array((T, F), ty, alignment=ALIGN)     # A_i, inclusive
        for f in range(tid, F, TPB):
            arun[f] = BA[s, c, f, dv]
        for a in range(t0, t1, T):
            nb = min(t1 - a, T)
            cuda.syncthreads()
            if j < dv:
                stage(g, v, s, a, nb, j, col, gt, xs)
            for e in range(tid, nb * F, TPB):
                i = e // F
                f = e - i * F
                qt[i, f] = phiq[s, a + i, f]
                kt[i, f] = phik[s, a + i, f]
            if tid < nb:
                winv[tid] = W[s, a + tid]
            cuda.syncthreads()
            for f in range(tid, F, TPB):
                acc = arun[f]
                for i in range(nb):
                    acc += kt[i, f]
                    kc[i, f] = acc
                arun[f] = acc
            if blocked:
                tile_products(gt, xs, udv, tid, True, nb, gv, sg, red)
            else:
                for e in range(tid, nb * nb, TPB):
                    i = e // nb
                    t = e - i * nb
                    acc = zero
                    if t <= i:
                        acc = dot(gt, np.uint64(i) * UDVP, xs, np.uint64(t) * UDVP, udv)
                    gv[i, t] = acc
                for e in range(tid, nb * F, TPB):
                    i = e // F
                    f = e - i * F
                    sg[i, f] = dot(xs, np.uint64(T + f) * UDVP, gt, np.uint64(i) * UDVP, udv)
            cuda.syncthreads()
            for e in range(tid, nb * F, TPB):
                i = e // F
                f = e - i * F
                acc = sg[i, f]
                for t in range(i + 1):
                    acc += gv[i, t] * kt[t, f]
                sg[i, f] = acc
            cuda.syncthreads()
            denominator_grad(qt, sg, winv, ddt, dD, s, a, tid, nb)
            cuda.syncthreads()
            for e in range(tid, nb * F, TPB):
                i = e // F
                f = e - i * F
                dpq[s, a + i, f] = sg[i, f] * winv[i] + ddt[i] * kc[i, f]
            if j < dv:
                for i in range(nb):
                    xv = xs[i * DVP + j]
                    for f in range(F):
                        col[f] += kt[i, f] * xv

    @backward_jit
    def keys_bwd(phiq, phik, v, g, W, dD, dBA, C, dpk, dv_out):
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
            col[f] = dBA[s, c, f, j] if j < dv else zero
        vt = cuda.shared.array(ROWS_SZ, ty)    # the tile of v, (T, DVP) flat
        xs = cuda.shared.array(XS_SZ, ty)      # the tile of g, then U after the tile (F rows)
        red = cuda.shared.array(RED_BLOCKED, ty)  # tile_products' partial sums (blocked)
        if blocked:  # only the tile products read past a short tile and into xs' padding
            clear_tiles(vt, xs, tid)
        udv = np.uint64(dv)
        qt = cuda.shared.array((T, F), ty, alignment=ALIGN)     # phi_q / D
        pt = cuda.shared.array((T, F), ty, alignment=ALIGN)     # phi_q
        kt = cuda.shared.array((T, F), ty, alignment=ALIGN)
        vu = cuda.shared.array((T, F), ty, alignment=ALIGN)
        vg = cuda.shared.array((T, T), ty)     # v_t . g_i / D_i, i >= t
        mt = cuda.shared.array((T, T), ty, alignment=ALIGN)  # phi_k_t . phi_q_i / D_i, i >= t (else 0)
        xcol = cuda.local.array(T, ty)
        for e in range(tid, T * T, TPB):  # rows past a short tile's nb are read (times 0): finite
            mt[e // T, e % T] = zero
        arun = cuda.shared.array(F, ty, alignment=ALIGN)
        ddt = cuda.shared.array(T, ty)
        for f in range(tid, F, TPB):
            arun[f] = dBA[s, c, f, dv]
        ntile = (t1 - t0 + T - 1) // T
        for m in range(ntile):
            a = t0 + (ntile - 1 - m) * T
            nb = min(t1 - a, T)
            cuda.syncthreads()
            if j < dv:
                stage(v, g, s, a, nb, j, col, vt, xs)
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
            if blocked:
                tile_products(vt, xs, udv, tid, False, nb, vg, vu, red)
            for e in range(tid, nb * nb, TPB):
                t = e // nb
                i = e - t * nb
                acc = zero
                acc2 = acc
                if i >= t:
                    if not blocked:
                        acc = dot(vt, np.uint64(t) * UDVP, xs, np.uint64(i) * UDVP, udv)
                    for f in range(F):
                        acc2 += kt[t, f] * qt[i, f]
                if not blocked:
                    vg[t, i] = acc
                mt[t, i] = acc2
            if not blocked:
                for e in range(tid, nb * F, TPB):
                    t = e // F
                    f = e - t * F
                    vu[t, f] = dot(xs, np.uint64(T + f) * UDVP, vt, np.uint64(t) * UDVP, udv)
            cuda.syncthreads()
            for e in range(tid, nb * F, TPB):
                t = e // F
                f = e - t * F
                acc = vu[t, f] + arun[f]
                for i in range(t, nb):
                    acc += vg[t, i] * qt[i, f] + ddt[i] * pt[i, f]
                dpk[s, a + t, f] = acc
            if j < dv:
                # column j of the tile of g in registers (0 past nb) and whole rows of mt (0 below
                # the diagonal; finite past nb): loops of constant trip count, unrolled, whose
                # shared loads of mt, kt and qt rows combine into 16-byte ones
                for i in range(T):
                    xcol[i] = xs[i * DVP + j] if i < nb else zero
                for t in range(nb):
                    acc = zero
                    for f in range(F):
                        acc += kt[t, f] * col[f]
                    for i in range(T):
                        acc += mt[t, i] * xcol[i]
                    dv_out[s, a + t, j] = acc
                for i in range(T):
                    if i < nb:
                        xv = xcol[i]
                        for f in range(F):
                            col[f] += qt[i, f] * xv
            cuda.syncthreads()
            for f in range(tid, F, TPB):
                acc = arun[f]
                for i in range(nb):
                    acc += ddt[i] * pt[i, f]
                arun[f] = acc

    return dict(chunk_states=chunk_states, readout=readout, queries_bwd=queries_bwd, keys_bwd=keys_bwd,
                nc_queries_bwd=nc_queries_bwd, nc_keys_bwd=nc_keys_bwd)


@functools.lru_cache(maxsize=None)
def make_hash_kernels(L, P, dtype, simulated=False, threads=128, lanes=8):
    """The soft hash and its backward with the planes' product fused in, ``G`` lanes per row.

    ``hash_rows(x, W, beta, phi, t)``: ``x (M, d)``, ``W (L * P, d)``; writes ``t = tanh(W x)``
    ``(M, L * P)`` and ``phi (M, L * 2**P)`` (:func:`racecpu.chunkwise.soft_hash`'s numbers).
    ``hash_rows_bwd(dphi, phi, t, W, beta, dx, st)``: ``dx (M, d)`` of the rows and ``st (M,)``
    each row's dbeta term (summed by the caller).  ``hash_from_u(u, beta, phi, t)``: the same
    ``t`` and ``phi`` from the projections ``u = x W^T (M, L * P)`` (cuBLAS's; ``t`` must not
    alias ``u``).  Launch with blocks of ``threads`` (whole warps);
    any grid (the blocks stride over the rows).  Needs :func:`hash_fits`.

    A group of ``G = min(lanes, 2**P)`` lanes (a power of two dividing a table's ``2**P``
    corners) takes a row: its lanes read the row's ``d`` entries ``G`` apart, sum the ``L * P``
    projections by xor butterflies inside the group (every lane ends with all of them), and
    lane ``r`` of the group owns corner ``r + G k`` of the row, so which table and plane a
    corner reads is known when the kernel is compiled (registers, not local memory).  Against
    a warp per row this does ``log2(G)`` exchange steps per sum instead of 5 and reads ``32 / G``
    rows per warp load.

    The lanes exchange values by warp shuffles; Numba's CUDA simulator has none, so
    ``simulated=True`` builds the same kernels with the exchanges through shared memory and
    block barriers (every loop that exchanges runs the same trip count in all threads).
    """
    ty = numba.from_dtype(np.dtype(dtype))
    LP = L * P
    R = 1 << P
    F = L * R
    G = min(int(lanes), R)
    if G < 1 or G & (G - 1) or G > 32:
        raise ValueError(f"lanes must be a power of two from 1 to 32, got {lanes}")
    NE = F // G          # corners per lane
    WPB = threads // 32
    RPB = threads // G   # rows per block
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
    else:
        @cuda.jit(device=True)
        def xor_get(val, off, buf, w, lane):
            return cuda.shfl_xor_sync(FULL, val, off)

    @cuda.jit(device=True)
    def group_sum(val, buf, w, lane):
        """The sum of ``val`` over the row's ``G`` lanes, in every one of them."""
        off = G >> 1
        while off > 0:
            val += xor_get(val, off, buf, w, lane)
            off >>= 1
        return val

    @cuda.jit(device=True)
    def sigmoid(z):
        # stable for any z: exp never sees a positive argument
        e = math.exp(-abs(z))
        h = one / (one + e)
        return h if z >= zero else e * h

    @cuda.jit(device=True)
    def corners(th, b2, sub, i, phi):
        """Row ``i``'s corners owned by lane ``sub`` from its ``L * P`` values ``th = tanh(u)``."""
        for k in range(NE):  # corner e = G k + sub: table (G k) // R, corner bits (G k) % R + sub
            l = (G * k) // R
            r = (G * k) % R + sub
            prod = one
            for p in range(P):
                z = b2 * th[l * P + p]
                prod *= sigmoid(z if (r >> (P - 1 - p)) & 1 else -z)
            phi[i, G * k + sub] = prod

    @cuda.jit
    def hash_rows(x, W, beta, phi, t):
        M, d = x.shape
        tid = cuda.threadIdx.x
        lane = tid & 31
        w = tid >> 5
        sub = tid & (G - 1)
        buf = cuda.shared.array((WPB, 32), ty)
        u = cuda.local.array(LP, ty)
        b2 = ty(two * beta)  # beta arrives as float64: compute in the kernel's dtype
        for base in range(cuda.blockIdx.x * RPB, M, cuda.gridDim.x * RPB):
            i = base + tid // G
            ok = i < M
            for m in range(LP):
                u[m] = zero
            if ok:
                for kk in range(sub, d, G):
                    xv = x[i, kk]
                    for m in range(LP):
                        u[m] += xv * W[m, kk]
            for m in range(LP):
                u[m] = math.tanh(group_sum(u[m], buf, w, lane))
                if ok and m % G == sub:
                    t[i, m] = u[m]
            if ok:
                corners(u, b2, sub, i, phi)

    @cuda.jit
    def hash_from_u(u, beta, phi, t):
        # The pass after cuBLAS's projections, G lanes a row, so that a warp's stores of phi are
        # runs of G contiguous values (a thread per (row, table) stored its 2**P corners strided by
        # 2**P values across the warp and rewrote them P times: bound by the load/store units, the
        # performance log's GPU section).  No exchanges: each lane takes the row's tanh values itself.
        M = u.shape[0]
        tid = cuda.threadIdx.x
        sub = tid & (G - 1)
        th = cuda.local.array(LP, ty)
        b2 = ty(two * beta)  # beta arrives as float64: compute in the kernel's dtype
        for base in range(cuda.blockIdx.x * RPB, M, cuda.gridDim.x * RPB):
            i = base + tid // G
            if i < M:
                for m in range(LP):
                    th[m] = math.tanh(u[i, m])
                    if m % G == sub:
                        t[i, m] = th[m]
                corners(th, b2, sub, i, phi)

    @cuda.jit
    def hash_rows_bwd(dphi, phi, t, W, beta, dx, st):
        M, d = dx.shape
        tid = cuda.threadIdx.x
        lane = tid & 31
        w = tid >> 5
        sub = tid & (G - 1)
        buf = cuda.shared.array((WPB, 32), ty)
        du = cuda.local.array(LP, ty)
        ph = cuda.local.array(NE, ty)
        dp = cuda.local.array(NE, ty)
        tdot = cuda.local.array(L, ty)
        bt = ty(beta)
        for base in range(cuda.blockIdx.x * RPB, M, cuda.gridDim.x * RPB):
            i = base + tid // G
            ok = i < M
            for l in range(L):
                tdot[l] = zero
            for k in range(NE):
                ph[k] = phi[i, G * k + sub] if ok else zero
                dp[k] = dphi[i, G * k + sub] if ok else zero
                tdot[(G * k) // R] += ph[k] * dp[k]
            for l in range(L):  # each table's dot over its R corners
                tdot[l] = group_sum(tdot[l], buf, w, lane)
            for m in range(LP):
                du[m] = zero
            for k in range(NE):  # dz of the corner, then its signed share of each of its table's planes
                l = (G * k) // R
                r = (G * k) % R + sub
                dz = ph[k] * (dp[k] - tdot[l])
                for p in range(P):
                    du[l * P + p] += dz if (r >> (P - 1 - p)) & 1 else -dz
            term = zero
            for m in range(LP):
                sv = group_sum(du[m], buf, w, lane)
                th = t[i, m] if ok else zero
                term += sv * th
                du[m] = bt * sv * (one - th * th)
            if ok:
                if sub == 0:
                    st[i] = term
                for kk in range(sub, d, G):
                    acc = zero
                    for m in range(LP):
                        acc += du[m] * W[m, kk]
                    dx[i, kk] = acc

    return dict(hash_rows=hash_rows, hash_rows_bwd=hash_rows_bwd, hash_from_u=hash_from_u)


def hash_fits(L, P):
    """Whether :func:`make_hash_kernels` takes ``(L, P)``: each lane keeps the ``L * P``
    projections and its corners in registers, at most 32 of each."""
    return L * P <= 32 and (1 << P) <= 32 and P >= 1

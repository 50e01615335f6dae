"""The soft hash of Algorithm 1 and its backward, a block of rows at a time.

``phi_l(x) = softmax_r(beta * tanh(W_l x) . v_r)`` over the ``R = 2**P`` corners
``v_r`` of each table, computed in closed form as a product of logistics
(``docs/design.md`` section 2) with every step vectorised over HASH_BLOCK rows
(:func:`hash_block`).  The backward (:func:`hash_rows_du`, :func:`hash_bwd_rows`)
gives the cotangent of the projections ``u = W x`` and ``dx = du W``, and each
row's share of dbeta (``docs/design.md`` section 3).
"""

from __future__ import annotations

import numpy as np

from ..config import (DU_BLOCK, HASH_BLOCK, PREFETCH_CORNERS, PREFETCH_MATH, PREFETCH_T, SKETCH_RUN,
                      TANH_SERIES_MAX)
from ._jit import kernel
from .bundles import HashScratch
from .expmath import exp_neg
from .products import add_into, combine_rows, dot_rows, prefetch_to, tn_product
from .runtime import read_only, run_tasks
from .tiles import TRANSPOSE_BYTES, transpose_tile


@kernel(by_address=True, readonly=("x", "keep"), refcounts=False)
def hash_block(x, hsh, keep, scratch, t, phi, ahead=0, lines=0):
    """phi_l(x) and t = tanh(W_l x) of a block of rows, every table.

    Parameters
    ----------
    x : (T, d)
        T <= HASH_BLOCK rows (compute dtype; rows may be strided).
    hsh : Hash
    keep : bool (T,)
        False rows (masked keys) get phi = 0; their t is still written.
    scratch : HashScratch
        From :func:`hash_scratch`, in the planes' dtype, which sets the
        precision of the tanh/logistic math.  On return ``scratch.ph[:F * T]``
        holds phi^T ``(F, T)``, masked rows zero, for :func:`hash_sketch_range`.
    t : (T, L*P) or (0, L*P)
        Out: the tanh projections; not written when it has no rows.
    phi : (T, F) or (0, F)
        Out: the soft buckets, table l at ``phi[:, l*R:(l+1)*R]``, corner r
        +1 on plane p iff bit P-1-p of r is set; not written when it has no rows.
    ahead, lines : int
        ``lines`` 64-byte lines from address ``ahead`` (the next block's rows)
        are prefetched, spread over the math after the projection
        (docs/performance.md, "hash prefetch").

    Returns
    -------
    int
        How many values of t are NaN: a projection that is NaN or +-Inf
        gives t = NaN (phi is computed as if it were clamped), so the
        caller's NaN/Inf check of x reads t (``racecpu._checks.check_derived``).

    softmax_r(beta t.v_r) = prod_p sigmoid(2 beta t_p v_{r,p}) (docs/design.md
    section 2): per plane a = sigmoid(2 beta t) and 1 - a, both from one exp
    of a non-positive argument, so nothing overflows for any beta.  Every
    step runs over all T rows at once, plane-major, and each value is stored
    once at the end (docs/performance.md, "hash block").
    """
    W, beta = hsh
    U, a, b, ph = scratch
    T, d = x.shape
    L, P, _ = W.shape
    R = 1 << P
    LP = L * P
    # Constants in the scratch dtype: a float64 literal would promote float32 math.
    as_u = U.dtype.type
    m2, m2beta, one, small = as_u(-2.0), as_u(-2.0 * beta), as_u(1.0), as_u(TANH_SERIES_MAX)
    c3, c5, c7, c9 = as_u(-1 / 3), as_u(2 / 15), as_u(-17 / 315), as_u(62 / 2835)
    dot_rows(W.reshape(LP, d), x, U[:LP * T].reshape(LP, T).T)  # plane-major: U[m * T + j]
    done = 0  # lines prefetched so far (schedule: PREFETCH_MATH, PREFETCH_T, PREFETCH_CORNERS)
    n = T * LP
    for piece in range(4):
        done = prefetch_to(ahead, done, lines * PREFETCH_MATH * (piece + 1) // 128)
        # Unsigned bounds: a signed index that LLVM cannot prove >= 0 gets
        # Numba's wraparound select, and the loop is not vectorised (docs/performance.md,
        # "tanh loop bounds").
        for s in range(np.uint64(n * piece // 4), np.uint64(n * (piece + 1) // 4)):  # SIMD over the block
            u = U[s]
            bad = u - u  # 0, or NaN when u is NaN/Inf: see the end of the loop
            au = abs(u)
            e2 = exp_neg(m2 * au)
            th = (one - e2) / (one + e2)
            # Near 0, 1 - e2 cancels: ~1 ulp of 1 absolute, which 2 beta t turns into
            # ~2 beta ulp in the logistic (float32, beta = 1e4: 1e-3).  The series is
            # exact to < 1 ulp there, in either dtype.
            u2 = u * u
            ts = au + au * u2 * (c3 + u2 * (c5 + u2 * (c7 + u2 * c9)))
            th = ts if au < small else th
            th = th if u >= 0 else -th
            e = exp_neg(m2beta * abs(th))
            hi = one / (one + e)  # sigmoid(2 beta |t|)
            lo = e * hi           # sigmoid(-2 beta |t|), without the cancellation of 1 - hi
            a[s] = hi if th >= 0 else lo  # sigmoid(2 beta t)
            b[s] = lo if th >= 0 else hi  # 1 - sigmoid(2 beta t)
            # A non-finite projection leaves NaN in t (phi is computed as if it were
            # clamped): a NaN/Inf anywhere in x makes every W x non-finite, so the
            # caller's NaN/Inf check reads t (L*P values per row) instead of x (d).
            U[s] = th if bad == 0 else bad
    nan = 0  # in a loop of its own: counted in the loop above, it was not vectorised
    for s in range(np.uint64(0), np.uint64(n)):
        nan += U[s] != U[s]
    # t or phi with no rows (a forward that keeps no residuals): those loops are
    # skipped and the loops before them issue their share of the prefetches.
    pf_t = PREFETCH_T if t.shape[0] else PREFETCH_MATH
    pf_c = PREFETCH_CORNERS if phi.shape[0] else 32
    # t and phi from their plane-major scratch, k x k blocks at a time (transpose_tile), the
    # values past the last whole block one by one.
    k = TRANSPOSE_BYTES // U.itemsize
    if t.shape[0]:
        Ut = U[:LP * T].reshape(LP, T)
        m1 = LP - LP % k if t.strides[1] == t.itemsize else 0
        for j0 in range(0, T, k):
            j1 = min(j0 + k, T)
            done = prefetch_to(ahead, done, lines * (PREFETCH_MATH + (PREFETCH_T - PREFETCH_MATH) * j1 // T) // 32)
            mt = m1 if j1 - j0 == k else 0
            for m0 in range(0, mt, k):
                transpose_tile(Ut, t, m0, j0)
            for j in range(j0, j1):
                for m in range(mt, LP):
                    t[j, m] = Ut[m, j]
    # Corner f = l R + r of table l: the product over planes p of a (bit p of r
    # set) or b, a row of T tokens at a time.
    for f in range(L * R):
        done = prefetch_to(ahead, done, lines * (pf_t + (pf_c - pf_t) * (f + 1) // (L * R)) // 32)
        l = f // R
        r = f - l * R
        row = ph[f * T:(f + 1) * T]
        for p in range(P):
            src = a if (r >> (P - 1 - p)) & 1 else b
            col = src[(l * P + p) * T:(l * P + p + 1) * T]
            if p == 0:
                for j in range(T):
                    row[j] = col[j]
            else:
                for j in range(T):
                    row[j] *= col[j]
    for j in range(T):  # ph is phi^T for callers that read it (hash_sketch_range)
        if not keep[j]:
            for f in range(L * R):
                ph[f * T + j] = 0.0
    if phi.shape[0]:  # the block's length as the bound: faster (docs/performance.md, "residual rows")
        F = L * R
        Ph = ph[:F * T].reshape(F, T)  # masked rows: zero in ph already
        f1 = F - F % k if phi.strides[1] == phi.itemsize else 0
        for j0 in range(0, T, k):
            j1 = min(j0 + k, T)
            done = prefetch_to(ahead, done, lines * (PREFETCH_CORNERS + (32 - PREFETCH_CORNERS) * j1 // T) // 32)
            ft = f1 if j1 - j0 == k else 0
            for f0 in range(0, ft, k):
                transpose_tile(Ph, phi, f0, j0)
            for j in range(j0, j1):
                for f in range(ft, F):
                    phi[j, f] = Ph[f, j]
    return nan


@kernel
def hash_rows_du(dphi, phi, t, P, beta, du):
    """Back through softmax over corners and tanh, every row of ``dphi (n, F)``.

    dz = phi * (dphi - phi.dphi);  s = C^T dz;  du = beta s (1 - t^2) is the
    cotangent of the projections W x, written to ``du (n, L*P)``; ``dphi``
    (float64) is overwritten.  Returns the rows' share sum s.t of dbeta.

    Each table's rows are first gathered into (R, tokens) blocks so that every
    loop runs over tokens: per token the work is a few dozen flops over
    tiny R-long rows, which one token at a time cannot vectorise
    (docs/performance.md, "du block").  The gathers of phi, dphi and t and the
    store of du move square blocks in registers (:func:`.tiles.transpose_tile`)
    where a block's tokens and a table's corners fill them, values one at a
    time elsewhere ("hash stores").
    dz = phi dphi - phi (phi.dphi);  s_p = sum_r v_{r,p} dz_r.
    """
    n, F = dphi.shape
    R = 1 << P
    L = F // R
    LP = L * P
    T = DU_BLOCK
    ph = np.empty((R, T), phi.dtype)  # phi's values exactly, in half the bytes for float32
    z = np.empty((R, T))
    tT = np.empty((LP, T), t.dtype)
    duT = np.empty((LP, T), du.dtype)
    dot = np.empty(T)
    s = np.empty(T)
    kp, kz = TRANSPOSE_BYTES // phi.itemsize, TRANSPOSE_BYTES // dphi.itemsize  # the side of X's blocks
    kt, kd = TRANSPOSE_BYTES // t.itemsize, TRANSPOSE_BYTES // du.itemsize
    # Blocks only where rows are contiguous (transpose_tile's contract) and whole.
    rows_ok = (phi.strides[1] == phi.itemsize and dphi.strides[1] == dphi.itemsize
               and t.strides[1] == t.itemsize and du.strides[1] == du.itemsize)
    dbeta = 0.0
    for j0 in range(0, n, T):
        m = min(T, n - j0)
        whole = rows_ok and m == T
        tb, db = t[j0:j0 + m], du[j0:j0 + m]
        mt = LP - LP % kt if whole else 0
        for jj in range(0, T if mt else 0, kt):
            for c0 in range(0, mt, kt):
                transpose_tile(tb, tT, jj, c0)
        for j in range(m):
            for c in range(mt, LP):
                tT[c, j] = tb[j, c]
        for l in range(L):
            base = l * R
            pb, zb = phi[j0:j0 + m, base:base + R], dphi[j0:j0 + m, base:base + R]
            if whole and R % kp == 0:
                for jj in range(0, T, kp):
                    for r0 in range(0, R, kp):
                        transpose_tile(pb, ph, jj, r0)
            else:
                for j in range(m):  # a token's R values are contiguous: read them in order
                    for r in range(R):
                        ph[r, j] = pb[j, r]
            if whole and R % kz == 0:
                for jj in range(0, T, kz):
                    for r0 in range(0, R, kz):
                        transpose_tile(zb, z, jj, r0)
            else:
                for j in range(m):
                    for r in range(R):
                        z[r, j] = zb[j, r]
            for j in range(m):
                dot[j] = 0.0
            for r in range(R):
                for j in range(m):
                    e = ph[r, j] * z[r, j]
                    z[r, j] = e
                    dot[j] += e
            for r in range(R):
                for j in range(m):
                    z[r, j] -= ph[r, j] * dot[j]
            for p in range(P):
                shift = P - 1 - p
                for j in range(m):
                    s[j] = 0.0
                for r in range(R):
                    sign = 1.0 if (r >> shift) & 1 else -1.0  # corner coordinate v_{r,p}
                    for j in range(m):
                        s[j] += sign * z[r, j]
                c = l * P + p
                for j in range(m):
                    th = tT[c, j]
                    dbeta += s[j] * th
                    duT[c, j] = beta * s[j] * (1.0 - th * th)
        md = LP - LP % kd if whole else 0
        for jj in range(0, T if md else 0, kd):
            for c0 in range(0, md, kd):
                transpose_tile(duT, db, c0, jj)
        for j in range(m):
            for c in range(md, LP):
                db[j, c] = duT[c, j]
    return dbeta


@kernel
def hash_bwd_rows(dphi, phi, t, hsh, dx):
    """dx = (cotangent of the projections) W for rows with soft-hash cotangents
    ``dphi (n, F)`` (float64, overwritten); returns their share of dbeta.
    The hash backward runs SIMD over the rows, then :func:`combine_rows` gives
    dx, streamed (a result of the backward, not read again)."""
    return hash_bwd_rows_dw(dphi, phi, t, hsh, dx, dx[:0], np.empty((0, dx.shape[1])))


@kernel
def hash_bwd_rows_dw(dphi, phi, t, hsh, dx, x, dW):
    """:func:`hash_bwd_rows`, and the rows' share of the planes' gradient.

    Parameters
    ----------
    dphi, phi, t, hsh, dx
        As :func:`hash_bwd_rows` (``dphi`` overwritten, ``dx`` written).
    x : (n, d)
        The rows whose soft hash this is (compute dtype); not read when
        ``dW`` has no rows.
    dW : (L*P, d) float64, or (0, d)
        Out: ``du^T x``, row ``l*P + p`` the gradient of plane p of table l
        from these rows (``docs/design.md`` section 3.3), overwritten; one
        product summed in the compute dtype (:func:`tn_product`, not an sgemm
        of LP rows: docs/performance.md, "planes' gradient"), stored as
        float64 for the caller's sum over chunks.  With
        no rows: nothing is computed (the backward without the planes'
        gradient).

    Returns
    -------
    float
        The rows' share of dbeta.
    """
    W, beta = hsh
    L, P, d = W.shape
    du = np.empty((dphi.shape[0], L * P), W.dtype)
    acc = hash_rows_du(dphi, phi, t, P, beta, du)
    if dW.shape[0]:  # before dx's streamed stores, which a call with arrays would wait for
        tn_product(du, x, dW)
    combine_rows(du, W.reshape(L * P, d), dx, True)
    return acc


@kernel
def hash_scratch(W):
    """:func:`hash_block`'s scratch ``(U, a, b, ph)`` for HASH_BLOCK rows, in the planes' dtype."""
    L, P, _ = W.shape
    m = HASH_BLOCK * L * P
    return HashScratch(np.empty(m, W.dtype), np.empty(m, W.dtype), np.empty(m, W.dtype),
                       np.empty((HASH_BLOCK * L) << P, W.dtype))


@kernel
def hash_range(x, lo, hi, hsh, keep, t, phi):
    """:func:`hash_block` over rows lo..hi of ``x (N, d)``, HASH_BLOCK rows at a
    time; returns the NaNs it left in t (:func:`hash_block`)."""
    scratch = hash_scratch(hsh.W)
    # The next block's rows are prefetched during each block where x's rows are contiguous.
    row = x.shape[1] * x.itemsize
    flat = x.strides[1] == x.itemsize and x.strides[0] == row
    nan = 0
    for b0 in range(lo, hi, HASH_BLOCK):
        b1 = min(b0 + HASH_BLOCK, hi)
        lines = (min(b1 + HASH_BLOCK, hi) - b1) * row // 64 if flat else 0
        nan += hash_block(x[b0:b1], hsh, keep[b0:b1], scratch, t[b0:b1], phi[b0:b1], x.ctypes.data + b1 * row, lines)
    return nan


@kernel(inline="always")
def hash_sketch_range(x, v, lo, hi, hsh, keep, t, phi, A, total):
    """:func:`hash_range` of rows lo..hi of ``x (N, d)``, summing the sketch of
    each block as soon as it is hashed: ``A`` (float64) += their rows of phi,
    and ``total`` (float64, overwritten) = phi^T v over rows lo..hi of
    ``v (N, dv)``, summed in v's dtype as :func:`span_totals` does for runs of
    SKETCH_RUN rows (whole blocks), the runs' sums in float64.  Returns
    the NaNs left in t (:func:`hash_block`).  Both sums read each block's
    phi^T from the hash's scratch, so ``t`` and ``phi`` may have no rows (a
    forward with no backward: nothing is written to them) and the sums are
    the same bits either way.

    Each block's product (:func:`combine_rows`, phi^T as X) prefetches the
    next block's rows of v while the hash prefetches its rows of x, so every
    read from memory overlaps math (docs/performance.md, "fused sketch").
    For the non-causal sketch, whose product order no scan has to match.
    """
    F = phi.shape[1]
    dv = v.shape[1]
    scratch = hash_scratch(hsh.W)
    ph = scratch.ph
    tmp = np.empty((F, dv), v.dtype)
    acc = np.zeros((F, dv), v.dtype)
    rx = x.shape[1] * x.itemsize
    rv = dv * v.itemsize
    flat = (x.strides[1] == x.itemsize and x.strides[0] == rx
            and v.strides[1] == v.itemsize and v.strides[0] == rv)
    nan = 0
    total[:, :] = 0.0
    run = lo  # first row of the run in acc
    for b0 in range(lo, hi, HASH_BLOCK):
        b1 = min(b0 + HASH_BLOCK, hi)
        nxt = (min(b1 + HASH_BLOCK, hi) - b1) if flat else 0
        nan += hash_block(x[b0:b1], hsh, keep[b0:b1], scratch, t[b0:b1], phi[b0:b1],
                          x.ctypes.data + b1 * rx, nxt * rx // 64)
        m = b1 - b0
        P = ph[:F * m].reshape(F, m)  # phi^T of the block, masked keys zero (see hash_block)
        for f in range(F):  # the block's column sums (SIMD over its tokens), then A
            s = 0.0
            for j in range(m):
                s += P[f, j]
            A[f] += s
        combine_rows(P, v[b0:b1], tmp, False, v.ctypes.data + b1 * rv, nxt * rv // 64)
        add_into(acc, tmp)
        if b1 - run >= SKETCH_RUN or b1 == hi:  # the run summed in v's dtype ends: into float64
            for f in range(F):
                for c in range(dv):
                    total[f, c] += acc[f, c]
                    acc[f, c] = 0.0
            run = b1
    return nan


@kernel
def _hash_rows_task(blk, x, hsh, keep, t, phi):
    hash_range(x, blk * 1024, min(x.shape[0], blk * 1024 + 1024), hsh, keep, t, phi)


def soft_hash_rows(x, hsh, t, phi):
    """phi and t of every row of ``x (N, d)`` (the public ``soft_buckets``)."""
    n = x.shape[0]
    run_tasks(_hash_rows_task, (n + 1023) // 1024, x, hsh, read_only(np.ones(n, np.bool_)), t, phi)


@kernel
def residual_rows(res, g, lo, hi):
    """Rows lo..hi of group ``g`` of a residual ``res (G, N, ...)``, or scratch
    for them where the caller keeps none (``res`` has no rows: a forward with
    no backward, which then writes no phi, t or den to memory)."""
    if res.shape[1] == 0:
        return np.empty((hi - lo,) + res.shape[2:], res.dtype)
    return res[g, lo:hi]


@kernel(inline="always")
def head_rows(res, scratch, h, hl, lo, hi):
    """Rows lo..hi of head ``h`` of a residual ``res (G, N, ...)``, or
    ``scratch[hl]`` (:func:`head_scratch`) where the caller keeps none of its
    rows: :func:`residual_rows` for the heads of a group that one task runs
    (the causal scan of grouped-query attention)."""
    if res.shape[1] == 0:
        return scratch[hl]
    return res[h, lo:hi]


@kernel
def head_scratch(res, group, n):
    """Scratch for ``n`` rows of each of ``group`` heads of ``res (G, N, ...)``
    where the caller keeps none of its rows (no rows otherwise; :func:`head_rows`)."""
    return np.empty((group if res.shape[1] == 0 else 0, n) + res.shape[2:], res.dtype)


@kernel(inline="always")
def hash_chunk(x, g, lo, hi, hsh, keep, t_res, phi_res):
    """:func:`hash_range` of rows lo..hi of group ``g`` of ``x (G, N, d)`` into
    their rows of the residuals ``t_res``, ``phi_res`` (phi: or scratch, see
    :func:`residual_rows`; t: not written where ``t_res`` has no rows).
    Returns ``(phi, t, nan)``, ``nan`` the NaNs in t: the hash leaves one per
    projection of a row with a NaN/Inf (racecpu._checks.check_derived)."""
    phi, t = residual_rows(phi_res, g, lo, hi), t_res[g, lo:hi]  # t: no rows where none is kept
    return phi, t, hash_range(x[g, lo:hi], 0, hi - lo, hsh, keep, t, phi)

"""The small matrix products every kernel is made of.

The products are thin (one side is F = L * 2**P or L * P long, a few dozen
values, the other d or dv long), where BLAS's call overhead or copying paths
cost more than the work: :func:`dot_rows` and :func:`combine_rows` run them
in the register tiles of :mod:`.tiles` with plain loops at the edges;
:func:`tn_product` gives the planes' gradient ``du^T x``;
:func:`step_scores` gives a scan step's triangular scores; :func:`step_product`
and :func:`span_totals` the rank-k state updates and chunk totals (BLAS from
BLAS_ROWS rows).  Sums run in the dtype of the rows unless a docstring says
float64.
"""

from __future__ import annotations

import numpy as np

from ..config import BLAS_ROWS, SCORE_TILE_F
from ._jit import kernel
from .tiles import (ADD_ROWS, COMB_ROWS, COMB_VECTORS, TILE_ROWS, TN_ACC, VEC_ROWS, VECTOR_BYTES, comb_half,
                    comb_half_tall, comb_tile, comb_tile_lines, comb_tile_pieces, comb_vec, comb_vec_lines,
                    comb_vec_pieces, comb_vec_tall,
                    dot_tile_cols, dot_tile_cols1, dot_tile_rows, prefetch_lines, tn_add2_row, tn_add2_tile,
                    tn_add_row, tn_add_tile, tn_row2, tn_row4, tn_row8, tn_tile2, tn_tile4, tn_tile8)


@kernel
def prefetch_to(addr, done, target):
    """:func:`racecpu._kernels.tiles.prefetch_lines` of lines done..target of ``addr``; returns the new count."""
    if target > done:
        prefetch_lines(addr, done, target - done)
        return target
    return done


@kernel
def add_rows(A, rows):
    """A += the sum of the rows of ``rows (n, F)``, one row at a time (A: float64)."""
    for j in range(rows.shape[0]):
        for f in range(rows.shape[1]):
            A[f] += rows[j, f]


@kernel(by_address=True, readonly=("X", "S"), refcounts=False)
def combine_rows(X, S, out, stream=False, ahead=0, lines=0):
    """out[j] = sum_f X[j, f] S[f, :] for every row j, overwriting ``out``.

    Register tiles (:func:`racecpu._kernels.tiles.comb_tile`: COMB_ROWS rows of X by
    COMB_VECTORS vectors of S's columns, then one vector, ``comb_vec``, for
    the columns past the last whole tile, then half a vector where 8 lanes
    or more are left, ``comb_half``, plain stores) where S's and out's rows are
    contiguous (X's elements are read one at a time), and
    :func:`_combine_rows_loop` at the edges (the last rows; the columns
    past the last whole vector).  ``stream``: a result that
    nothing reads soon (a kernel's output rows, at scale far larger than
    the caches) is written with non-temporal stores, whole vectors where
    out's rows start on one (racecpu's own results: page-aligned), else in
    16-byte pieces where they start on 16 bytes (2-row tiles, see
    :func:`racecpu._kernels.tiles.comb_tile`; the task runner fences them
    after each task).  Streamed in one call over many rows:
    an atomic, such as Numba's reference counts in a call with arrays,
    waits for the streamed stores in flight (batches of 16 rows between
    such calls were written at half the rate).  ``lines`` 64-byte lines
    from address ``ahead`` are prefetched into L2, spread over the plain
    tiles (:func:`hash_sketch_range`: the next block's rows of v).
    """
    n, F = X.shape
    dv = S.shape[1]
    lanes = VECTOR_BYTES // X.itemsize
    width = COMB_VECTORS * lanes
    c1 = dv - dv % width  # columns in whole tiles
    c2 = dv - dv % lanes  # and in whole vectors: c1..c2 by one-vector tiles
    c3 = c2  # and c2..c3 by half-vector tiles (plain stores, at least 8 lanes a half)
    n1 = 0  # rows done by tiles
    if c2 > 0 and S.strides[1] == S.itemsize and out.strides[1] == out.itemsize:
        line = lanes * out.itemsize  # bytes of one stored vector
        if stream and out.ctypes.data % line == 0 and out.strides[0] % line == 0:
            n1 = n - n % COMB_ROWS
            for i in range(0, n1, COMB_ROWS):
                for c in range(0, c1, width):
                    comb_tile_lines(X, S, out, i, c)
                for c in range(c1, c2, lanes):
                    comb_vec_lines(X, S, out, i, c)
        elif stream and out.ctypes.data % 16 == 0 and out.strides[0] % 16 == 0:
            n1 = n - n % 2
            for i in range(0, n1, 2):
                for c in range(0, c1, width):
                    comb_tile_pieces(X, S, out, i, c)
                for c in range(c1, c2, lanes):
                    comb_vec_pieces(X, S, out, i, c)
        else:
            n1 = n - n % COMB_ROWS
            tiles = (n1 // COMB_ROWS) * (c1 // width)
            done = 0
            for i in range(0, n1, COMB_ROWS):
                for c in range(0, c1, width):
                    comb_tile(X, S, out, i, c)
                    if lines > 0:  # (an integer division per tile, which a small product notices)
                        done = prefetch_to(ahead, done, lines * ((i // COMB_ROWS) * (c1 // width) + c // width + 1)
                                            // tiles)
            # The one-vector columns, then the half vector: VEC_ROWS rows a tile (COMB_ROWS' 2
            # accumulators wait on each other's FMAs), then COMB_ROWS.
            if lanes // 2 >= 8 and c2 + lanes // 2 <= dv:
                c3 = c2 + lanes // 2
            nv = n1 - n1 % VEC_ROWS
            i = 0
            while i < n1:
                tall = i < nv
                for c in range(c1, c2, lanes):
                    if tall:
                        comb_vec_tall(X, S, out, i, c)
                    else:
                        comb_vec(X, S, out, i, c)
                if c3 > c2:
                    if tall:
                        comb_half_tall(X, S, out, i, c2)
                    else:
                        comb_half(X, S, out, i, c2)
                i += VEC_ROWS if tall else COMB_ROWS
    if n1 == 0:
        _combine_rows_loop(X, S, out, 0, n, 0)
        return
    if c3 < dv:
        _combine_rows_loop(X, S, out, 0, n1, c3)
    if n1 < n:
        _combine_rows_loop(X, S, out, n1, n, 0)


@kernel(by_address=True, readonly=("X", "S"), refcounts=False)
def _combine_rows_loop(X, S, out, j0, j1, c0):
    """:func:`combine_rows` by loops for rows j0..j1 and columns c0.. of out:
    eight rows of S per sweep over out[j], the first sweep assigning, so that
    the dv-long loop is bound by FMAs, not by reloading and storing out[j]
    once per row of S.  Bounds rather than slices, so that the edges of a
    tiled call compile with the same array layouts as the whole (one
    compilation, not two)."""
    F = X.shape[1]
    dv = S.shape[1]
    for j in range(j0, j1):
        w = X[j]
        o = out[j]
        f = 0
        if F >= 8:
            w0, w1, w2, w3, w4, w5, w6, w7 = w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]
            s0, s1, s2, s3, s4, s5, s6, s7 = S[0], S[1], S[2], S[3], S[4], S[5], S[6], S[7]
            for c in range(c0, dv):
                o[c] = (((w0 * s0[c] + w1 * s1[c]) + (w2 * s2[c] + w3 * s3[c]))
                        + ((w4 * s4[c] + w5 * s5[c]) + (w6 * s6[c] + w7 * s7[c])))
            f = 8
        else:
            for c in range(c0, dv):
                o[c] = 0.0
        while f + 8 <= F:
            w0, w1, w2, w3, w4, w5, w6, w7 = w[f], w[f + 1], w[f + 2], w[f + 3], w[f + 4], w[f + 5], w[f + 6], w[f + 7]
            s0, s1, s2, s3, s4, s5, s6, s7 = S[f], S[f + 1], S[f + 2], S[f + 3], S[f + 4], S[f + 5], S[f + 6], S[f + 7]
            for c in range(c0, dv):
                o[c] += (((w0 * s0[c] + w1 * s1[c]) + (w2 * s2[c] + w3 * s3[c]))
                         + ((w4 * s4[c] + w5 * s5[c]) + (w6 * s6[c] + w7 * s7[c])))
            f += 8
        while f < F:
            wf = w[f]
            sf = S[f]
            for c in range(c0, dv):
                o[c] += wf * sf[c]
            f += 1


@kernel(by_address=True, readonly=("U", "X"))
def tn_product(U, X, out):
    """out = U^T X, overwriting ``out (m, d)``, for ``U (n, m)`` and ``X (n, d)``.

    Sums run in U's dtype (X converted on load, out on store: out may be
    float64).  Transposed combine tiles (:mod:`racecpu._kernels.tiles`,
    ``tn_tile8`` and siblings: rows of out by 8, 4 or 2 vectors of X's
    columns) where X's and out's columns are contiguous, widest first, so
    that X's rows are read in order (docs/performance.md, "planes'
    gradient"); :func:`_tn_product_loop` for the last columns.  U may be
    strided.  None of the arrays may alias ``out``.
    """
    m = U.shape[1]
    d = X.shape[1]
    lanes = VECTOR_BYTES // U.itemsize
    c = 0
    if X.strides[1] == X.itemsize and out.strides[1] == out.itemsize:
        for width in (8, 4, 2):  # vectors; after the 8-wide blocks at most one of 4 and one of 2
            tall = TN_ACC // width  # rows of out in a whole tile
            while c + width * lanes <= d:
                r = 0
                while r < m:
                    step = tall if r + tall <= m else 1
                    if width == 8:
                        if step > 1:
                            tn_tile8(U, X, out, r, c)
                        else:
                            tn_row8(U, X, out, r, c)
                    elif width == 4:
                        if step > 1:
                            tn_tile4(U, X, out, r, c)
                        else:
                            tn_row4(U, X, out, r, c)
                    elif step > 1:
                        tn_tile2(U, X, out, r, c)
                    else:
                        tn_row2(U, X, out, r, c)
                    r += step
                c += width * lanes
    if c < d:
        _tn_product_loop(U, X[:, c:], out[:, c:])


@kernel
def _tn_product_loop(U, X, out):
    """:func:`tn_product` by loops, summing in U's dtype."""
    n, m = U.shape
    d = X.shape[1]
    acc = np.zeros((m, d), U.dtype)
    for k in range(n):
        xk = X[k]
        for i in range(m):
            u = U[k, i]
            a = acc[i]
            for c in range(d):
                a[c] += u * xk[c]
    for i in range(m):
        for c in range(d):
            out[i, c] = acc[i, c]


@kernel(by_address=True, readonly=("S", "X"), any_layout=("Y",), refcounts=False)
def dot_rows(S, X, Y):
    """Y[j, f] = S[f, :] . X[j, :] for every row j of ``X (n, dv)`` and f of ``S (F, dv)``.

    ``Y (n, F)`` may be float64 or strided (the projection writes its
    transpose); the sums run in X's dtype.  Register tiles
    (:func:`racecpu._kernels.tiles.dot_tile_rows` / ``dot_tile_cols``: TILE_ROWS rows
    of X by a few rows of S) where rows are contiguous, dv is a whole number
    of vectors and Y is contiguous along either axis; :func:`_dot_rows_loop`
    for the edges (last rows of X or of S) and everything else.  Y in any
    layout, compiled once for all: the tiles address it by its strides.
    """
    F, dv = S.shape
    n = X.shape[0]
    lanes = VECTOR_BYTES // X.itemsize
    ms = lanes // TILE_ROWS
    n1 = n - n % TILE_ROWS  # rows of X in tiles
    f1 = F - F % ms  # rows of S in tiles
    by_row = Y.strides[1] == Y.itemsize
    if (n1 == 0 or f1 == 0 or dv == 0 or dv % lanes or X.strides[1] != X.itemsize
            or S.strides[1] != S.itemsize or not (by_row or Y.strides[0] == Y.itemsize)):
        _dot_rows_loop(S, X, Y)
        return
    for j in range(0, n1, TILE_ROWS):
        for f in range(0, f1, ms):
            if by_row:
                dot_tile_rows(S, X, Y, j, f)
            else:
                dot_tile_cols(S, X, Y, j, f)
    # The last rows of S: one at a time where Y's columns are contiguous.
    n2 = 0 if by_row else n - n % lanes
    for j in range(0, n2, lanes):
        for f in range(f1, F):
            dot_tile_cols1(S, X, Y, j, f)
    if f1 < F and n2 < n1:
        _dot_rows_loop(S[f1:], X[n2:n1], Y[n2:n1, f1:])
    if n1 < n:
        _dot_rows_loop(S, X[n1:], Y[n1:])


@kernel(by_address=True, readonly=("S", "X"), any_layout=("Y",), refcounts=False)
def _dot_rows_loop(S, X, Y):
    """:func:`dot_rows` by loops.  Two rows of X and four of S per sweep, each product with
    its own accumulator: every load feeds two FMAs and the horizontal sums
    overlap.  A whole block per call, not a row, so the call's cost is
    shared (docs/performance.md, "dot tiles").  Y in any layout, compiled
    once for all: each of its elements is stored once, after dv-long sums.
    """
    F, dv = S.shape
    n = X.shape[0]
    if dv == 0:
        for j in range(n):
            for f in range(F):
                Y[j, f] = 0.0
        return
    for j in range(0, n, 2):
        x = X[j]
        u = X[j + 1] if j + 1 < n else x  # an odd last row is summed twice, stored once
        y = Y[j]
        zx = x[0] - x[0]  # typed zeros (NaN with a non-finite row, whose sums are NaN anyway)
        zu = u[0] - u[0]
        f = 0
        while f + 4 <= F:
            a0 = a1 = a2 = a3 = zx
            b0 = b1 = b2 = b3 = zu
            s0, s1, s2, s3 = S[f], S[f + 1], S[f + 2], S[f + 3]
            for c in range(dv):
                xc = x[c]
                uc = u[c]
                a0 += s0[c] * xc
                a1 += s1[c] * xc
                a2 += s2[c] * xc
                a3 += s3[c] * xc
                b0 += s0[c] * uc
                b1 += s1[c] * uc
                b2 += s2[c] * uc
                b3 += s3[c] * uc
            y[f], y[f + 1], y[f + 2], y[f + 3] = a0, a1, a2, a3
            if j + 1 < n:
                z = Y[j + 1]
                z[f], z[f + 1], z[f + 2], z[f + 3] = b0, b1, b2, b3
            f += 4
        while f < F:
            a = zx
            b = zu
            for c in range(dv):
                a += S[f, c] * x[c]
                b += S[f, c] * u[c]
            y[f] = a
            if j + 1 < n:
                Y[j + 1, f] = b
            f += 1


@kernel(by_address=True, readonly=("w", "x"))
def step_product(w, x, out):
    """out = w^T x for ``w (m, F)``, ``x (m, dv)``, overwriting ``out (F, dv)``:
    sgemm from BLAS_ROWS rows, racecpu's own tiles below (call overhead and
    packing win: a scan step's 8 rows always take the tiles; docs/performance.md,
    "BLAS rows").

    The tiles are transposed combine tiles two vectors wide and TN_ACC / 2
    rows of out tall (:func:`racecpu._kernels.tiles.tn_tile2`; one row,
    ``tn_row2``, for the last rows): per row of w and x, two loads of x
    feed TN_ACC FMAs, where sweeping out a row at a time loaded x once per
    FMA (docs/performance.md, "step product tiles").  Columns past the last
    whole tile by loops.  Every element is summed over the m rows in order,
    from zero.  ``w`` may be strided; ``out`` must not alias either.
    """
    m, F = w.shape
    dv = x.shape[1]
    if m >= BLAS_ROWS and dv > 0:
        np.dot(w.T, x, out)
        return
    width = 2 * (VECTOR_BYTES // w.itemsize)
    c1 = dv - dv % width  # columns in tiles
    if x.strides[1] != x.itemsize or out.strides[1] != out.itemsize:
        c1 = 0
    tall = TN_ACC // 2
    f1 = F - F % tall
    for c in range(0, c1, width):
        for f in range(0, f1, tall):
            tn_tile2(w, x, out, f, c)
        for f in range(f1, F):
            tn_row2(w, x, out, f, c)
    _product_columns(w, x, out, c1)


@kernel
def _product_columns(w, x, out, c1):
    """out[:, c1:] = w^T x[:, c1:] by loops (the columns past :func:`step_product`'s tiles)."""
    m, F = w.shape
    dv = x.shape[1]
    for f in range(F):
        for c in range(c1, dv):
            out[f, c] = 0.0
        for k in range(m):
            wk = w[k, f]
            for c in range(c1, dv):
                out[f, c] += wk * x[k, c]


@kernel(by_address=True, readonly=("w", "x"), refcounts=False)
def add_product(w, x, S, tmp, total, track):
    """S += w^T x (one scan step's state update), and ``total`` += the same
    product when ``track`` (one chunk's sum, in the compute dtype as S: a
    float64 total's 24 KB pushed the step's arrays out of L1;
    docs/performance.md, "chunk totals in the compute dtype").

    The product's bits are :func:`step_product`'s, each element rounded
    before it is added.  Below BLAS_ROWS rows, tiles ADD_ROWS rows of S tall
    add their sums to S (and total) in registers
    (:func:`racecpu._kernels.tiles.tn_add_tile` and siblings) instead of
    storing them in ``tmp (F, dv)`` and reading them back (docs/performance.md,
    "add tiles"); ``tmp`` takes the columns past the tiles and every product
    from BLAS_ROWS rows.  ``total`` may be ``tmp`` when not ``track``; neither
    may alias S, w or x.
    """
    m, F = w.shape
    dv = x.shape[1]
    width = 2 * (VECTOR_BYTES // w.itemsize)
    c1 = dv - dv % width  # columns in tiles
    if (m >= BLAS_ROWS or x.strides[1] != x.itemsize or S.strides[1] != S.itemsize
            or (track and total.strides[1] != total.itemsize)):
        c1 = 0
    if c1 == 0:
        step_product(w, x, tmp)
    else:
        tall = ADD_ROWS
        f1 = F - F % tall
        for c in range(0, c1, width):
            for f in range(0, f1, tall):
                if track:
                    tn_add2_tile(w, x, S, total, f, c)
                else:
                    tn_add_tile(w, x, S, S, f, c)
            for f in range(f1, F):
                if track:
                    tn_add2_row(w, x, S, total, f, c)
                else:
                    tn_add_row(w, x, S, S, f, c)
        if c1 == dv:
            return
        _product_columns(w, x, tmp, c1)
    if track:  # one pass over tmp for both sums
        for f in range(F):
            for c in range(c1, dv):
                t = tmp[f, c]
                S[f, c] += t
                total[f, c] += t
    else:
        for f in range(F):
            for c in range(c1, dv):
                S[f, c] += tmp[f, c]


@kernel
def copy_into(dst, src):
    """dst[...] = src for two arrays of one shape, 1-D or 2-D (src may be float32 and dst float64).

    A loop rather than a slice assignment: Numba compiles a slice assignment's
    shape check with a formatted message, which brings its whole string
    machinery into the caller (about 2.5 s of a cold compile, see
    docs/performance.md); the shapes here agree by construction.
    """
    if dst.ndim == 1:
        for i in range(dst.shape[0]):
            dst[i] = src[i]
    else:
        for i in range(dst.shape[0]):
            for j in range(dst.shape[1]):
                dst[i, j] = src[i, j]


@kernel
def add_into(acc, tmp):
    """acc += tmp for two (F, dv) arrays: the sum of a chunk's products."""
    F, dv = acc.shape
    for f in range(F):
        for c in range(dv):
            acc[f, c] += tmp[f, c]


@kernel(by_address=True, readonly=("w", "x"))
def span_totals(w, x, span, reverse, total, tmp):
    """total (float64) = w^T x, one :func:`step_product` per ``span`` rows
    (aligned at row 0; the last span first when ``reverse``).

    The span products are summed in the compute dtype of ``tmp`` (a chunk's
    rows at most, as the scans' states), and that sum is written to ``total``
    as float64.  With span = SCAN_BLOCK these are, bit for bit, the chunk
    totals that a segment's scan tracks step by step (:func:`add_product`,
    :func:`carry_on`), so the causal scans carry identical states however
    many segments they run in.
    """
    n = w.shape[0]
    F, dv = total.shape
    acc = np.zeros((F, dv), tmp.dtype)
    nb = (n + span - 1) // span
    for b in range(nb):
        bi = nb - 1 - b if reverse else b
        j0 = bi * span
        j1 = min(j0 + span, n)
        add_product(w[j0:j1], x[j0:j1], acc, tmp, tmp, False)
    for f in range(F):
        for c in range(dv):
            total[f, c] = acc[f, c]


@kernel(by_address=True, readonly=("w", "x"))
def group_span_totals(w, x, h0, lo, span, total, tmp):
    """total (float64) = sum_h w[h]^T x[h0 + h, lo:lo + n] for the query heads
    of one key/value head (``w (group, n, F)``, ``x (G, N, dv)``), summed as
    the causal keys' reverse scan sums them: the last span of rows first,
    and within each span head by head (:func:`span_totals`, whose bits it
    gives for one head)."""
    group, n = w.shape[:2]
    F, dv = total.shape
    acc = np.zeros((F, dv), tmp.dtype)
    nb = (n + span - 1) // span
    for b in range(nb):
        j0 = (nb - 1 - b) * span
        j1 = min(j0 + span, n)
        for hl in range(group):
            add_product(w[hl, j0:j1], x[h0 + hl, lo + j0:lo + j1], acc, tmp, tmp, False)
    for f in range(F):
        for c in range(dv):
            total[f, c] = acc[f, c]


@kernel
def zero_above(M):
    """Zero the strict upper triangle of square ``M`` (keep j <= i)."""
    m = M.shape[0]
    for i in range(m):
        for j in range(i + 1, m):
            M[i, j] = 0.0


@kernel
def zero_below(M):
    """Zero the strict lower triangle of square ``M`` (keep j >= i)."""
    m = M.shape[0]
    for i in range(1, m):
        for j in range(i):
            M[i, j] = 0.0


@kernel(by_address=True, readonly=("X", "Y"), refcounts=False)
def step_scores(X, Y, out, lower):
    """out[i, j] = X[i] . Y[j] where j <= i (``lower``) or j >= i (not), 0 elsewhere.

    The triangular scores of a scan step between rows of phi (``X (m, F)``,
    ``Y (k, F)``, ``out (m, k)``).  Four rows of Y per sweep over a row of X
    (each load of X feeds four FMAs; the masked entries of a sweep are
    overwritten with zeros) below SCORE_TILE_F columns; from there the whole
    product in :func:`dot_rows`' register tiles and a mask, not np.dot, whose
    call and packing cost more than an 8 x 8 product (docs/performance.md,
    "step scores").
    """
    m, F = X.shape
    k = Y.shape[0]
    if F >= SCORE_TILE_F:
        dot_rows(Y, X, out)
        if lower:
            zero_above(out)
        else:
            zero_below(out)
        return
    for i in range(m):
        x = X[i]
        o = out[i]
        lo, hi = (0, min(i + 1, k)) if lower else (i, k)
        j = lo - lo % 4
        while j < hi and j + 4 <= k:
            y0, y1, y2, y3 = Y[j], Y[j + 1], Y[j + 2], Y[j + 3]
            a0 = a1 = a2 = a3 = x[0] - x[0]  # typed zeros (NaN with a non-finite row, whose sums are NaN anyway)
            for f in range(F):
                xf = x[f]
                a0 += xf * y0[f]
                a1 += xf * y1[f]
                a2 += xf * y2[f]
                a3 += xf * y3[f]
            o[j], o[j + 1], o[j + 2], o[j + 3] = a0, a1, a2, a3
            j += 4
        while j < hi:
            y0 = Y[j]
            a0 = x[0] - x[0]
            for f in range(F):
                a0 += x[f] * y0[f]
            o[j] = a0
            j += 1
        for j in range(lo):
            o[j] = 0.0
        for j in range(hi, k):
            o[j] = 0.0

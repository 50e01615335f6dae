"""numba.cuda kernels of RACE attention (no argument checking here: see ``racecpu.cuda``).

Same layout and math as the CPU kernels in :mod:`racecpu._kernels`, step for
step: every (batch, head) pair is a group ``g``; arrays are C-contiguous
``x (G, N, d)``, ``v (G, N, dv)``, planes ``W (L, P, d)``; the soft hash of one
token is a row ``phi (F,)``, ``F = L * R``, with tanh projections ``t (L*P,)``.
The per-token helpers (:func:`hash_row`, :func:`hash_row_bwd`,
:func:`readout_row`, :func:`readout_row_bwd`, :func:`key_row_bwd`) compute one
token's share of what the CPU kernels do a chunk at a time (``readout_rows``,
``hash_rows_du``, ``dot_rows``), with loops ordered so a thread keeps its sums
in registers.

GPU work split.  A *block* owns one (group, chunk) task, as one ``prange``
task does on the CPU, and walks its chunk in *tiles* of ``T`` tokens
(``T`` = threads per block).  Each tile has two phases separated by
``syncthreads``:

* token phase: thread ``t`` handles token ``t`` of the tile (soft hash fused
  with the readout or its backward);
* column phase: thread ``t`` handles columns ``t, t + T, ...`` of the
  augmented value matrix ``[v, 1]`` (``dv + 1`` columns; the last one is the
  key mass ``A``) and adds the tile to the block's sketch or running state.

Sketches and states are stored as ``(F, dv + 1)``: columns ``< dv`` are ``B``
and column ``dv`` is ``A``.  The non-causal sketch is a two-level reduction:
per-block partials (float64, :func:`make_kernels` ``sketch_chunks``) then a sum
over blocks (:func:`sum_chunks`); no global atomics.  The causal scan is
chunk totals -> exclusive scan of the totals in float64 (:func:`scan_chunks`)
-> every chunk rescanned from its carried-in state.  Inside a tile the causal
readout uses the tile-start state plus the tile's own pairs (``j <= i`` within
the tile, a T x T triangle, never N x N), so no per-token barrier is needed.
The backward is exact: pass 1 rebuilds prefix states by the same rescan,
pass 2 carries suffix sums of (dA, dB) by a reverse rescan; nothing is
obtained by subtracting from a total.

Running states live in a per-block scratch in the compute dtype and sum at
most one chunk on top of their float64 carry; carries, block partials and
totals are float64 (as on the CPU, no long sum runs in float32).  Kernels
depend on (L, P, T, dtype) through local-array sizes and are built once per
combination by :func:`make_kernels`.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda
from numba.core import config as _numba_config

from ..hashing import DEN_FLOOR

# ---------------------------------------------------------------------------
# 16-bit elements: read as compute numbers, results rounded once
# ---------------------------------------------------------------------------


def load(x):
    """An element of q, k, v or grad_out as a number to compute with: float16 widened to float32,
    bfloat16 bits (a ``uint16`` array's element: :class:`racecpu.cuda.Bfloat16`) widened exactly
    to float32, floats as they are.  So the tile kernels read 16-bit inputs in their own dtype and
    no widened copy of a whole array is made.  (This body runs under the simulator; on a GPU the
    overload below is compiled.)"""
    if isinstance(x, np.uint16):
        return np.asarray(np.uint32(x) << np.uint32(16)).view(np.float32)[()]
    if isinstance(x, np.float16):
        return np.float32(x)
    return x


def store(a, i, x, zero):
    """``a[i] = x`` rounded to the compute dtype (that of the scalar ``zero``), then to ``a``'s
    dtype, ties to even: a result written in its caller's dtype with the rounding a cast of the
    compute dtype's result would give; a ``uint16`` ``a`` holds bfloat16 bits (NaN kept NaN, as
    :class:`racecpu.chunkwise.Bfloat16Bits`)."""
    if np.dtype(a.dtype) == np.uint16:
        a[i] = _bfloat16_bits(int(np.asarray(np.float32(x)).view(np.uint32)))
    else:
        a[i] = type(zero)(x)


@cuda.jit(device=True)
def _bfloat16_bits(u):
    """The bfloat16 pattern nearest the float32 pattern ``u`` (an int in 0 .. 2**32), ties to even;
    NaN stays NaN (its sum could carry into the sign)."""
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return (u >> 16) | 0x40
    return (u + 0x7FFF + ((u >> 16) & 1)) >> 16


if not _numba_config.ENABLE_CUDASIM:  # the simulator runs the Python bodies above
    from numba.cuda import libdevice as _libdevice
    from numba.cuda import types as _types
    from numba.cuda.extending import overload as _overload

    @_overload(load, target="cuda")
    def _load_cuda(x):
        if x == _types.uint16:
            return lambda x: _libdevice.int_as_float(np.int32(x) << 16)
        if x == _types.float16:
            return lambda x: np.float32(x)
        return lambda x: x

    @_overload(store, target="cuda")
    def _store_cuda(a, i, x, zero):
        if a.dtype == _types.uint16:
            def store_bits(a, i, x, zero):
                a[i] = np.uint16(_bfloat16_bits(np.int64(_libdevice.float_as_int(np.float32(x))) & 0xFFFFFFFF))
            return store_bits
        compute = zero  # a numba scalar type, callable as a cast

        def store_float(a, i, x, zero):
            a[i] = compute(x)
        return store_float

# ---------------------------------------------------------------------------
# soft hash of one token: forward and backward (as racecpu._kernels)
# ---------------------------------------------------------------------------


@cuda.jit(device=True)
def _sigmoid(z):
    # Stable for any z: exp never sees a positive argument.
    if z >= 0.0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


@cuda.jit(device=True)
def hash_row(x, W, beta, t, phi, keep):
    """phi_l(x) of every table by the logistic factorisation (see the CPU kernel)."""
    L, P, d = W.shape
    R = 1 << P
    zero = W[0, 0, 0] - W[0, 0, 0]
    for l in range(L):
        base = l * R
        phi[base] = 1.0
        n = 1
        for p in range(P):
            u = zero
            for i in range(d):
                u += load(x[i]) * W[l, p, i]
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


@cuda.jit(device=True)
def hash_row_bwd(dphi, phi, t, W, beta, du, dx):
    """Back through softmax over corners, tanh and W x; returns the dbeta term.

    As the CPU kernel, except that ``du (L*P,)`` (thread-local scratch) holds
    every plane's cotangent first, so each entry of ``dx`` is stored once.
    """
    L, P, d = W.shape
    R = 1 << P
    zero = W[0, 0, 0] - W[0, 0, 0]
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
            du[l * P + p] = beta * s * (1.0 - th * th)
    for i in range(d):
        acc = 0.0
        for l in range(L):
            for p in range(P):
                acc += du[l * P + p] * W[l, p, i]
        store(dx, i, acc, zero)
    return dbeta


# ---------------------------------------------------------------------------
# per-token readout of a sketch: forward and backward
# ---------------------------------------------------------------------------


@cuda.jit(device=True)
def readout_row(phiq, S, L, out):
    """out = (phiq B) / (L den), den = phiq . A / L; returns den (DEN_FLOOR rows: zeros).

    ``S (F, dv + 1)``: B in columns < dv, A (float64 mass) in column dv.
    """
    F = S.shape[0]
    dv = S.shape[1] - 1
    zero = phiq[0] - phiq[0]
    den = 0.0
    for f in range(F):
        den += phiq[f] * S[f, dv]
    den /= L
    if den <= DEN_FLOOR:
        for c in range(dv):
            store(out, c, 0.0, zero)
        return den
    inv = 1.0 / (L * den)
    for c in range(dv):
        acc = zero
        for f in range(F):
            acc += phiq[f] * S[f, c]
        store(out, c, acc * inv, zero)
    return den


@cuda.jit(device=True)
def readout_row_bwd(phiq, S, g, den, L, dphi):
    """Cotangent of :func:`readout_row` w.r.t. phiq (to ``dphi``); returns (dden, 1/(L den)).

    y = B g;  dden = -(phiq . y) / (L den^2);  dphi = y / (L den) + A dden / L.
    Rows at or below DEN_FLOOR pass nothing back: (0, 0) and dphi = 0.
    """
    F = S.shape[0]
    dv = S.shape[1] - 1
    if den <= DEN_FLOOR:
        for f in range(F):
            dphi[f] = 0.0
        return 0.0, 0.0
    zero = phiq[0] - phiq[0]
    inv = 1.0 / (L * den)
    phiy = 0.0
    for f in range(F):
        y = zero
        for c in range(dv):
            y += S[f, c] * load(g[c])
        dphi[f] = y
        phiy += phiq[f] * y
    dden = -phiy * inv / den
    for f in range(F):
        dphi[f] = dphi[f] * inv + S[f, dv] * dden / L
    return dden, inv


@cuda.jit(device=True)
def key_row_bwd(phik, tk, vrow, dS, W, beta, dphi, du, dk, dvrow):
    """Cotangents of one key from the summed (dA, dB) in ``dS (F, dv + 1)``.

    dphik = dB v + dA, dv = dB^T phik, then dk through the hash; returns the
    dbeta term.  A masked key has phik = 0, so everything comes out 0.
    """
    F = dS.shape[0]
    dv = dS.shape[1] - 1
    zero = phik[0] - phik[0]
    for f in range(F):
        y = zero
        for c in range(dv):
            y += dS[f, c] * load(vrow[c])
        dphi[f] = y + dS[f, dv]
    for c in range(dv):
        s = zero
        for f in range(F):
            s += phik[f] * dS[f, c]
        store(dvrow, c, s, zero)
    return hash_row_bwd(dphi, phik, tk, W, beta, du, dk)


# ---------------------------------------------------------------------------
# column phase: add one tile to a sketch / state (thread owns column col)
# ---------------------------------------------------------------------------


@cuda.jit(device=True)
def tile_sketch(phi, v, t0, t1, col, S):
    """S[:, col] += sum_{t0 <= j < t1} phi_j v_j[col]  (col == dv: the mass, v = 1)."""
    F = phi.shape[1]
    dv = v.shape[1]
    if col < dv:
        for f in range(F):
            s = phi[t0, f] - phi[t0, f]
            for j in range(t0, t1):
                s += phi[j, f] * load(v[j, col])
            S[f, col] += s
    else:
        for f in range(F):
            s = 0.0
            for j in range(t0, t1):
                s += phi[j, f]
            S[f, col] += s


@cuda.jit(device=True)
def tile_dsketch(phiq, winv, dden, g, t0, t1, L, col, dS):
    """dS[:, col] += the tile's (dB, dA): dB += phiq_i g_i^T / (L den_i), dA += phiq_i dden_i / L."""
    F = phiq.shape[1]
    dv = g.shape[1]
    if col < dv:
        for f in range(F):
            s = 0.0
            for i in range(t0, t1):
                s += phiq[i, f] * winv[i] * load(g[i, col])
            dS[f, col] += s
    else:
        for f in range(F):
            s = 0.0
            for i in range(t0, t1):
                s += phiq[i, f] * dden[i]
            dS[f, col] += s / L


@cuda.jit(device=True)
def copy_cols(src, dst, col):
    for f in range(src.shape[0]):
        dst[f, col] = src[f, col]


# ---------------------------------------------------------------------------
# reductions over chunks (second level of the sketch), scans, casts
# ---------------------------------------------------------------------------


@cuda.jit
def sum_chunks(part, bounds, out):
    """out[g, s, e] = sum of part[g, c, e] over the chunks ``bounds[s] <= c < bounds[s + 1]``
    of packed sequence s (one sequence: bounds = (0, nc)), in float64, in chunk
    order (part (G, nc, E), out (G, S, E))."""
    G, S, E = out.shape
    for x in range(cuda.grid(1), G * S * E, cuda.gridsize(1)):
        g = x // (S * E)
        r = x - g * (S * E)
        q = r // E
        e = r - q * E
        acc = 0.0
        for c in range(bounds[q], min(bounds[q + 1], part.shape[1])):  # (the queries may have fewer chunks)
            acc += part[g, c, e]
        out[g, q, e] = acc


@cuda.jit
def scan_chunks(part, seq, out, reverse):
    """Exclusive prefix (or suffix, ``reverse``) sums over axis 1 in float64, restarting
    at each packed sequence (``seq (nc,)``: each chunk's; as the CPU's ``restarts``)."""
    G, nc, E = part.shape
    for x in range(cuda.grid(1), G * E, cuda.gridsize(1)):
        g = x // E
        e = x - g * E
        s = 0.0
        for m in range(nc):
            c = nc - 1 - m if reverse else m
            first = c + 1 if reverse else c  # the chunk whose start would restart the sum
            if 0 < first < nc and seq[first] != seq[first - 1]:
                s = 0.0
            out[g, c, e] = s
            s += part[g, c, e]


@cuda.jit
def plane_sums(du, x, rows, part):
    """Block b's float64 share of ``du^T x``: ``part[b, r * d + i]`` = the sum over rows ``m``
    of ``b * rows .. (b + 1) * rows`` of ``du[m, r] * x[m, i]`` (``du (M, L * P)``, ``x (M, d)``,
    ``part (nb, L * P * d)``): the first level of the planes' gradient, each output a thread's
    sum in row order."""
    M, R = du.shape
    d = x.shape[1]
    lo = cuda.blockIdx.x * rows
    hi = min(lo + rows, M)
    for o in range(cuda.threadIdx.x, R * d, cuda.blockDim.x):
        r = o // d
        i = o - r * d
        s = 0.0
        for m in range(lo, hi):
            s += du[m, r] * load(x[m, i])
        part[cuda.blockIdx.x, o] = s


@cuda.jit
def scatter_rows(src, rows, dst):
    """dst[g, rows[i], e] = src[g, i, e] (src (G, n, E), dst (G, m, E)): packed sequences
    into the kernels' padded layout."""
    G, n, E = src.shape
    for x in range(cuda.grid(1), G * n * E, cuda.gridsize(1)):
        g = x // (n * E)
        r = x - g * (n * E)
        i = r // E
        e = r - i * E
        dst[g, rows[i], e] = src[g, i, e]


@cuda.jit
def gather_rows(src, rows, dst):
    """dst[g, i, e] = src[g, rows[i], e] (src (G, m, E), dst (G, n, E)): the tokens' rows back."""
    G, n, E = dst.shape
    for x in range(cuda.grid(1), G * n * E, cuda.gridsize(1)):
        g = x // (n * E)
        r = x - g * (n * E)
        i = r // E
        e = r - i * E
        dst[g, i, e] = src[g, rows[i], e]


@cuda.jit
def fold_groups(src, dst, group):
    """dst[h, m] = sum of src[h * group + j, m] over j < group, in order: the gradients of
    a key/value head summed over its query heads."""
    Gk, M = dst.shape
    for x in range(cuda.grid(1), Gk * M, cuda.gridsize(1)):
        h = x // M
        m = x - h * M
        acc = src[h * group, m]
        for j in range(1, group):
            acc += src[h * group + j, m]
        dst[h, m] = acc


@cuda.jit
def cast_copy(src, dst):
    """dst[i] = src[i] (1-d, any float dtypes)."""
    for x in range(cuda.grid(1), src.shape[0], cuda.gridsize(1)):
        dst[x] = src[x]


@cuda.jit
def flag_nonfinite(x, flag):
    """flag[0] = 1 if any entry of the 1-d array x is NaN or +-Inf."""
    for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        if not math.isfinite(load(x[i])):
            flag[0] = 1


# ---------------------------------------------------------------------------
# kernels specialised on (F, T, dtype)
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def make_kernels(L, P, T, dtype):
    """Kernels for ``L`` tables of ``P`` planes, ``T`` threads per block, compute ``dtype``.

    These size the per-thread scratch (``cuda.local.array``) and the block
    reduction; every launch must use ``T`` threads per block.
    """
    DT = np.dtype(dtype).type
    F = int(L) * 2 ** int(P)
    DV_BLOCK = 128  # columns of a key's dv summed in registers/local memory at a time
    LP = int(L) * int(P)
    T = int(T)

    @cuda.jit(device=True)
    def block_sum(acc, out, idx):
        """out[idx] = sum of ``acc`` over the block (deterministic order)."""
        red = cuda.shared.array(T, np.float64)
        red[cuda.threadIdx.x] = acc
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            s = 0.0
            for m in range(T):
                s += red[m]
            out[idx] = s

    @cuda.jit(device=True)
    def keep_du(du, keep, du_out, g, i):
        """du_out[g, i] = du where the planes' gradient is asked for (``keep``; else ``du_out``
        is a dummy, never indexed)."""
        if keep:
            for r in range(LP):
                du_out[g, i, r] = du[r]

    @cuda.jit
    def soft_hash_rows(x, W, beta, t, phi):
        """phi and t of every row of ``x (M, d)`` (the public ``soft_buckets``)."""
        i = cuda.grid(1)
        if i < x.shape[0]:
            hash_row(x[i], W, beta, t[i], phi[i], True)

    # -- sketch of keys: block partials (both attentions) ------------------

    @cuda.jit
    def sketch_chunks(k, v, mask, W, beta, chunk, phik, tk, part):
        """Hash every key (phik, tk; masked keys phi = 0) and sum its sketch per chunk.

        ``part (G, nc, F, dv + 1)`` float64, zero on entry.
        """
        n = k.shape[1]
        nc = part.shape[1]
        dv = v.shape[2]
        tid = cuda.threadIdx.x
        g = cuda.blockIdx.x // nc
        c = cuda.blockIdx.x - g * nc
        lo = c * chunk
        hi = min(lo + chunk, n)
        for t0 in range(lo, hi, T):
            t1 = min(t0 + T, hi)
            j = t0 + tid
            if j < t1:
                hash_row(k[g, j], W, beta, tk[g, j], phik[g, j], mask[g, j])
            cuda.syncthreads()
            for col in range(tid, dv + 1, T):
                tile_sketch(phik[g], v[g], t0, t1, col, part[g, c])
            # no second barrier: the next token phase writes other rows
        # (part columns are owned by one thread each)

    # -- non-causal readout: forward and backward --------------------------

    @cuda.jit
    def queries_fwd(q, W, beta, S, seq, chunk, group, phiq, tq, den, out):
        """Hash every query and read its packed sequence's summed sketch ``S (Gk, S, F, dv + 1)``
        (compute dtype; ``seq[c]`` the sequence of chunk c, one: S = 1), that of its
        key/value head ``g // group`` (grouped-query attention)."""
        n = q.shape[1]
        L = W.shape[0]
        nb = (n + T - 1) // T
        g = cuda.blockIdx.x // nb
        i = (cuda.blockIdx.x - g * nb) * T + cuda.threadIdx.x
        if i < n:
            hash_row(q[g, i], W, beta, tq[g, i], phiq[g, i], True)
            den[g, i] = readout_row(phiq[g, i], S[g // group, seq[i // chunk]], L, out[g, i])

    @cuda.jit
    def queries_bwd(grad, phiq, tq, den, S, seq, group, W, beta, chunk, dq, dden, winv, part, dbeta_part, keep,
                    du_out):
        """Non-causal cotangents of every query; chunk sums of (dB, dA) into ``part``; with
        ``keep``, each query's cotangent of its projections into ``du_out (G, n, L * P)``
        float64 (for the planes' gradient; else a ``(1, 1, L * P)`` dummy)."""
        n = grad.shape[1]
        dv = grad.shape[2]
        L = W.shape[0]
        nc = part.shape[1]
        tid = cuda.threadIdx.x
        g = cuda.blockIdx.x // nc
        c = cuda.blockIdx.x - g * nc
        lo = c * chunk
        hi = min(lo + chunk, n)
        dphi = cuda.local.array(F, np.float64)
        du = cuda.local.array(LP, np.float64)
        acc = 0.0
        for t0 in range(lo, hi, T):
            t1 = min(t0 + T, hi)
            i = t0 + tid
            if i < t1:
                dd, wi = readout_row_bwd(phiq[g, i], S[g // group, seq[c]], grad[g, i], den[g, i], L, dphi)
                dden[g, i] = dd
                winv[g, i] = wi
                acc += hash_row_bwd(dphi, phiq[g, i], tq[g, i], W, beta, du, dq[g, i])
                keep_du(du, keep, du_out, g, i)
            cuda.syncthreads()
            for col in range(tid, dv + 1, T):
                tile_dsketch(phiq[g], winv[g], dden[g], grad[g], t0, t1, L, col, part[g, c])
        block_sum(acc, dbeta_part, cuda.blockIdx.x)

    @cuda.jit
    def keys_bwd(v, phik, tk, dS, seq, chunk, W, beta, dk, dv_out, dbeta_part, keep, du_out):
        """Non-causal cotangents of every key from its packed sequence's summed
        ``dS (G, S, F, dv + 1)`` (``seq``, ``chunk`` as :func:`queries_fwd`; ``keep``,
        ``du_out`` as :func:`queries_bwd`'s, per key)."""
        n = v.shape[1]
        nb = (n + T - 1) // T
        g = cuda.blockIdx.x // nb
        j = (cuda.blockIdx.x - g * nb) * T + cuda.threadIdx.x
        dphi = cuda.local.array(F, np.float64)
        du = cuda.local.array(LP, np.float64)
        acc = 0.0
        if j < n:
            acc = key_row_bwd(phik[g, j], tk[g, j], v[g, j], dS[g, seq[j // chunk]], W, beta, dphi, du, dk[g, j],
                              dv_out[g, j])
            keep_du(du, keep, du_out, g, j)
        block_sum(acc, dbeta_part, cuda.blockIdx.x)

    # -- causal scan: forward and backward ---------------------------------

    @cuda.jit(device=True)
    def load_state(carry, g, c, state):
        for col in range(cuda.threadIdx.x, carry.shape[3], T):
            copy_cols(carry[g, c], state, col)
        cuda.syncthreads()

    @cuda.jit(device=True)
    def causal_readout_row(phiq, S, phik, v, t0, i, L, out):
        """:func:`readout_row` at prefix i: tile-start state ``S`` plus keys t0..i."""
        F_ = S.shape[0]
        dv = v.shape[1]
        zero = phiq[0] - phiq[0]
        kap = cuda.local.array(T, DT)
        den = 0.0
        for f in range(F_):
            den += phiq[f] * S[f, dv]
        for j in range(t0, i + 1):
            kp = zero
            for f in range(F_):
                kp += phiq[f] * phik[j, f]
            kap[j - t0] = kp
            den += kp
        den /= L
        if den <= DEN_FLOOR:
            for c in range(dv):
                store(out, c, 0.0, zero)
            return den
        inv = 1.0 / (L * den)
        for c in range(dv):
            acc = zero
            for f in range(F_):
                acc += phiq[f] * S[f, c]
            for j in range(t0, i + 1):
                acc += kap[j - t0] * load(v[j, c])
            store(out, c, acc * inv, zero)
        return den

    @cuda.jit
    def causal_fwd(q, v, phik, carry, group, W, beta, chunk, state, phiq, tq, den, out):
        """Rescan every chunk of every key/value group gk from its carried-in state
        ``carry (Gk, nc, F, dv + 1)``: each tile's state is read by the ``group``
        query groups ``gk * group ..`` in turn and updated once.

        ``state (Gk * nc, F, dv + 1)`` (compute dtype) is each block's running
        state; it sums at most one chunk on top of the float64 carry.
        """
        n = q.shape[1]
        dv = v.shape[2]
        L = W.shape[0]
        nc = carry.shape[1]
        tid = cuda.threadIdx.x
        b = cuda.blockIdx.x
        gk = b // nc
        c = b - gk * nc
        lo = c * chunk
        hi = min(lo + chunk, n)
        S = state[b]
        load_state(carry, gk, c, S)
        for t0 in range(lo, hi, T):
            t1 = min(t0 + T, hi)
            i = t0 + tid
            if i < t1:
                for h in range(gk * group, gk * group + group):
                    hash_row(q[h, i], W, beta, tq[h, i], phiq[h, i], True)
                    den[h, i] = causal_readout_row(phiq[h, i], S, phik[gk], v[gk], t0, i, L, out[h, i])
            cuda.syncthreads()
            for col in range(tid, dv + 1, T):
                tile_sketch(phik[gk], v[gk], t0, t1, col, S)
            cuda.syncthreads()

    @cuda.jit(device=True)
    def causal_readout_row_bwd(phiq, S, phik, v, g, t0, i, den, L, dphi):
        """:func:`readout_row_bwd` at prefix i (tile-start state plus keys t0..i)."""
        F_ = S.shape[0]
        dv = v.shape[1]
        if den <= DEN_FLOOR:
            for f in range(F_):
                dphi[f] = 0.0
            return 0.0, 0.0
        zero = phiq[0] - phiq[0]
        gv = cuda.local.array(T, DT)
        for j in range(t0, i + 1):
            s = zero
            for c in range(dv):
                s += load(v[j, c]) * load(g[c])
            gv[j - t0] = s
        inv = 1.0 / (L * den)
        phiy = 0.0
        for f in range(F_):
            y = zero
            for c in range(dv):
                y += S[f, c] * load(g[c])
            for j in range(t0, i + 1):
                y += phik[j, f] * gv[j - t0]
            dphi[f] = y
            phiy += phiq[f] * y
        dden = -phiy * inv / den
        for f in range(F_):
            a = S[f, dv]
            for j in range(t0, i + 1):
                a += phik[j, f]
            dphi[f] = dphi[f] * inv + a * dden / L
        return dden, inv

    @cuda.jit
    def causal_queries_bwd(grad, v, phik, phiq, tq, den, carry, group, W, beta, chunk, state,
                           dq, dden, winv, part, dbeta_part, keep, du_out):
        """Backward pass 1: rebuild prefix states by rescanning; cotangents of queries.

        Per key/value group gk, whose rebuilt state the ``group`` query groups
        ``gk * group ..`` read in turn: writes dden and 1/(L den) per query and
        the chunk totals of (dB, dA), summed over those query groups, into
        ``part (Gk, nc, F, dv + 1)`` for the reverse scan (``keep``, ``du_out`` as
        :func:`queries_bwd`'s).
        """
        n = grad.shape[1]
        dv = grad.shape[2]
        L = W.shape[0]
        nc = carry.shape[1]
        tid = cuda.threadIdx.x
        b = cuda.blockIdx.x
        gk = b // nc
        c = b - gk * nc
        h0 = gk * group
        lo = c * chunk
        hi = min(lo + chunk, n)
        S = state[b]
        load_state(carry, gk, c, S)
        dphi = cuda.local.array(F, np.float64)
        du = cuda.local.array(LP, np.float64)
        acc = 0.0
        for t0 in range(lo, hi, T):
            t1 = min(t0 + T, hi)
            i = t0 + tid
            if i < t1:
                for h in range(h0, h0 + group):
                    dd, wi = causal_readout_row_bwd(phiq[h, i], S, phik[gk], v[gk], grad[h, i], t0, i,
                                                    den[h, i], L, dphi)
                    dden[h, i] = dd
                    winv[h, i] = wi
                    acc += hash_row_bwd(dphi, phiq[h, i], tq[h, i], W, beta, du, dq[h, i])
                    keep_du(du, keep, du_out, h, i)
            cuda.syncthreads()
            for col in range(tid, dv + 1, T):
                for h in range(h0, h0 + group):
                    tile_dsketch(phiq[h], winv[h], dden[h], grad[h], t0, t1, L, col, part[gk, c])
                tile_sketch(phik[gk], v[gk], t0, t1, col, S)
            cuda.syncthreads()
        block_sum(acc, dbeta_part, b)

    @cuda.jit(device=True)
    def causal_key_row_bwd(phik, tk, vrow, dS, phiq, g, dden, winv, h0, group, j, t1, L, W, beta, dphi, du, dk,
                           dvrow):
        """:func:`key_row_bwd` at suffix j: tile-end state ``dS`` (summed over the
        key/value head's query groups) plus the queries j..t1-1 of each of its
        ``group`` query groups ``h0 ..`` (``phiq``, ``g``, ``dden``, ``winv``
        indexed by query group)."""
        F_ = dS.shape[0]
        dv = vrow.shape[0]
        zero = phik[0] - phik[0]
        gv = cuda.local.array(T, DT)
        pw = cuda.local.array(T, DT)
        dvacc = cuda.local.array(DV_BLOCK, DT)  # dvrow's sums, stored once (rounded once if 16-bit)
        for f in range(F_):
            y = zero
            for c in range(dv):
                y += dS[f, c] * load(vrow[c])
            dphi[f] = y + dS[f, dv]
        for hl in range(group):
            h = h0 + hl
            for i in range(j, t1):
                s = zero
                for c in range(dv):
                    s += load(g[h, i, c]) * load(vrow[c])
                gv[i - j] = s
            for f in range(F_):
                e = 0.0
                for i in range(j, t1):
                    e += phiq[h, i, f] * (winv[h, i] * gv[i - j] + dden[h, i] / L)
                dphi[f] += e
        for c0 in range(0, dv, DV_BLOCK):
            nb = min(DV_BLOCK, dv - c0)
            for c in range(nb):
                s = zero
                for f in range(F_):
                    s += phik[f] * dS[f, c0 + c]
                dvacc[c] = s
            for hl in range(group):
                h = h0 + hl
                for i in range(j, t1):  # (again for each block of DV_BLOCK columns past the first)
                    p = zero
                    for f in range(F_):
                        p += phik[f] * phiq[h, i, f]
                    pw[i - j] = p * winv[h, i]
                for c in range(nb):
                    s = zero
                    for i in range(j, t1):
                        s += pw[i - j] * load(g[h, i, c0 + c])
                    dvacc[c] += s
            for c in range(nb):
                store(dvrow, c0 + c, dvacc[c], zero)
        return hash_row_bwd(dphi, phik, tk, W, beta, du, dk)

    @cuda.jit
    def causal_keys_bwd(grad, v, phik, tk, phiq, dden, winv, carry, group, W, beta, chunk, state,
                        dk, dv_out, dbeta_part, keep, du_out):
        """Backward pass 2: suffix sums of (dB, dA) over queries i >= j by a reverse rescan.

        Per key/value group gk (``carry (Gk, nc, F, dv + 1)``: the reverse carries
        summed over its query groups; ``dk``, ``dv_out`` have k's groups), the
        suffix state summing the ``group`` query groups ``gk * group ..``: the
        keys' terms and hash backward run once per key/value group (``keep``, ``du_out`` as
        :func:`queries_bwd`'s, per key)."""
        n = grad.shape[1]
        dv = grad.shape[2]
        L = W.shape[0]
        nc = carry.shape[1]
        tid = cuda.threadIdx.x
        b = cuda.blockIdx.x
        gk = b // nc
        c = b - gk * nc
        h0 = gk * group
        lo = c * chunk
        hi = min(lo + chunk, n)
        S = state[b]
        load_state(carry, gk, c, S)
        dphi = cuda.local.array(F, np.float64)
        du = cuda.local.array(LP, np.float64)
        acc = 0.0
        ntiles = (hi - lo + T - 1) // T
        for m in range(ntiles - 1, -1, -1):
            t0 = lo + m * T
            t1 = min(t0 + T, hi)
            j = t0 + tid
            if j < t1:
                acc += causal_key_row_bwd(phik[gk, j], tk[gk, j], v[gk, j], S, phiq, grad, dden, winv, h0, group,
                                          j, t1, L, W, beta, dphi, du, dk[gk, j], dv_out[gk, j])
                keep_du(du, keep, du_out, gk, j)
            cuda.syncthreads()
            for col in range(tid, dv + 1, T):
                for hl in range(group):
                    tile_dsketch(phiq[h0 + hl], winv[h0 + hl], dden[h0 + hl], grad[h0 + hl], t0, t1, L, col, S)
            cuda.syncthreads()
        block_sum(acc, dbeta_part, b)

    return dict(soft_hash_rows=soft_hash_rows, sketch_chunks=sketch_chunks, queries_fwd=queries_fwd,
                queries_bwd=queries_bwd, keys_bwd=keys_bwd, causal_fwd=causal_fwd,
                causal_queries_bwd=causal_queries_bwd, causal_keys_bwd=causal_keys_bwd)


@cuda.jit
def fill(x, val):
    """x[:] = val (1-d)."""
    for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        x[i] = val


# ---------------------------------------------------------------------------
# fused steps of the chunkwise form (racecpu.chunkwise.ArrayOps on the GPU: racecpu.cuda.CudaOps)
# ---------------------------------------------------------------------------


@cuda.jit
def hash_from_u(u, beta, P, phi):
    """The soft hash from the projections: ``u (M, L*P)`` becomes ``t = tanh(u)`` in place and
    ``phi (M, L * 2**P)`` gets the buckets (:func:`hash_row`'s factorisation); one thread per
    (row, table)."""
    M, LP = u.shape
    L = LP // P
    R = 1 << P
    for x in range(cuda.grid(1), M * L, cuda.gridsize(1)):
        i = x // L
        l = x - i * L
        base = l * R
        phi[i, base] = 1.0
        n = 1
        for p in range(P):
            th = math.tanh(u[i, l * P + p])
            u[i, l * P + p] = th
            a = _sigmoid(2.0 * beta * th)
            b = _sigmoid(-2.0 * beta * th)
            for j in range(n - 1, -1, -1):
                val = phi[i, base + j]
                phi[i, base + 2 * j + 1] = val * a
                phi[i, base + 2 * j] = val * b
            n *= 2


@cuda.jit
def hash_du_rows(dphi, phi, t, beta, P, du, st):
    """Back through the softmax over corners and tanh, one thread per (row, projection), so that
    a warp writes ``du`` and ``st`` in contiguous runs (a thread per (row, table) read its table's
    corners strided by 2**P values across the warp: bound by the load/store units, the performance
    log's GPU section): ``du (M, L*P)`` the projections' cotangents, ``st (M, L*P)`` the dbeta terms
    (summed by the caller)."""
    M, LP = t.shape
    R = 1 << P
    for x in range(cuda.grid(1), M * LP, cuda.gridsize(1)):
        i = x // LP
        m = x - i * LP
        l = m // P
        shift = P - 1 - (m - l * P)
        base = l * R
        dot = phi[i, base] - phi[i, base]
        for r in range(R):
            dot += phi[i, base + r] * dphi[i, base + r]
        s = dot - dot
        for r in range(R):
            dz = phi[i, base + r] * (dphi[i, base + r] - dot)
            if (r >> shift) & 1:
                s += dz
            else:
                s -= dz
        th = t[i, m]
        st[i, m] = s * th
        du[i, m] = beta * s * (1.0 - th * th)


@cuda.jit
def segment_sums(part, seg, totals):
    """``totals[g, s, e]`` = the float64 sum of ``part[g, c, e]`` over the chunks
    ``s * seg <= c < (s + 1) * seg`` (first level of a blocked scan over axis 1)."""
    G, nc, E = part.shape
    nseg = totals.shape[1]
    for x in range(cuda.grid(1), G * nseg * E, cuda.gridsize(1)):
        g = x // (nseg * E)
        r = x - g * (nseg * E)
        s = r // E
        e = r - s * E
        acc = 0.0
        for c in range(s * seg, min(s * seg + seg, nc)):
            acc += part[g, c, e]
        totals[g, s, e] = acc


@cuda.jit
def segment_scan(part, carry, seg, reverse, out):
    """Second level: ``out[g, c, e]`` = ``carry[g, s, e]`` (float64: the segments before, or after
    with ``reverse``) plus the chunks of segment ``s`` before ``c`` (after ``c``), summed in float64
    and stored in ``out``'s dtype: an exclusive scan over axis 1, chunk order fixed by the shape."""
    G, nc, E = part.shape
    nseg = carry.shape[1]
    for x in range(cuda.grid(1), G * nseg * E, cuda.gridsize(1)):
        g = x // (nseg * E)
        r = x - g * (nseg * E)
        s = r // E
        e = r - s * E
        lo = s * seg
        hi = min(lo + seg, nc)
        acc = carry[g, s, e]
        for m in range(hi - lo):
            c = hi - 1 - m if reverse else lo + m
            out[g, c, e] = acc
            acc += part[g, c, e]

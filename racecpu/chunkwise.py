"""The ratio estimator in chunkwise matrix form, for any NumPy-like array module.

This is the GPU backend's fast path (:mod:`racecpu.cuda` runs it with CuPy,
where each product below is one cuBLAS call), written against an array
module ``xp`` so that the same lines run on NumPy in the tests.  The math is
the one of :mod:`racecpu._kernels` (and :func:`racecpu.reference.race_attention_dense`):
with ``phi (N, F)`` the soft buckets of every table side by side
(``F = L * 2**P``; masked keys have ``phi = 0``) and, for query ``i``,

    D_i = sum_{j visible} phi_q_i . phi_k_j        (= L * den_i)
    out_i = sum_{j visible} (phi_q_i . phi_k_j) v_j / D_i      (0 where den_i <= DEN_FLOOR)

Non-causal, the sums are one sketch ``B = phi_k^T v``, ``A = phi_k^T 1``.
Causal, the tokens are cut into chunks of ``C``: each chunk's state
``(B_c, A_c)`` is one batched product, an exclusive scan over chunks (in
float64) gives the state every chunk starts from, and inside a chunk the
visible pairs are the lower triangle of ``phi_q phi_k^T`` (C x C, never
N x N).  The backward has the same shape: the gradients of the queries read
the prefix states, those of the keys and values the suffix sums of
``(dB, dA)`` by a reverse scan, and both share the masked ``C x C`` matrix

    Dmat_ij = [j <= i] ((g_i . v_j) / D_i + dD_i),   dD_i = -(g_i . out_i) / D_i,

so ``dphi_q = (g/D) B_prev^T + dD A_prev^T + Dmat phi_k`` and
``dphi_k = v dB_next^T + dA_next + Dmat^T phi_q``.  Nothing is obtained by
subtracting from a total.

Arrays are group-major as in the kernels: ``q (G, Nq, d)``, ``k (Gk, Nk, d)``,
``v (Gk, Nk, dv)`` with ``G = Gk * group`` (query head ``h`` reads key/value
head ``h // group``); every function takes and returns arrays of ``xp``.
Work runs in slabs of key/value heads (:func:`slab_shape`) so that the
temporaries stay within a workspace budget at any length: as many whole heads
as fit, and a head that does not fit alone in *segments* of whole chunks,
across which the causal state (forward) and its cotangent (backward) are
carried in float64.  16-bit inputs are widened a segment at a time, never
whole, and a forward may keep the projections ``x W^T`` of q and k instead of
their buckets (``keep_buckets=False``), which the backward makes again.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from .config import DEN_FLOOR

__all__ = ["soft_hash", "soft_hash_bwd", "projections", "buckets_from_u", "forward", "backward", "slab_heads",
           "slab_shape", "PrefixStates", "Bfloat16Bits"]


class PrefixStates(NamedTuple):
    """The states a causal forward started each chunk from, kept for the backward.

    ``states (S, nc, F, dv + 1)`` in the compute dtype: the exclusive prefix ``B`` in columns
    ``:dv`` and the key mass ``A`` in column ``dv`` (packed as the fused kernels read them), over
    chunks of ``chunk`` tokens (``nc = ceil(N / chunk)``); ``S`` key/value heads.  The backward
    reads them instead of summing the chunks and scanning again (the same numbers: the same
    pass made them).
    """

    states: Any
    chunk: int


# ---------------------------------------------------------------------------
# bfloat16 as 16-bit patterns (CuPy has no bfloat16)
# ---------------------------------------------------------------------------

def _bfloat16_dtype():
    """The dtype a :class:`Bfloat16Bits` reports: ml_dtypes' bfloat16 where installed, else a
    2-byte void named for it (compared, never computed with)."""
    from ._arrays import bfloat16
    return bfloat16() or np.dtype((np.void, 2))


class Bfloat16Bits:
    """bfloat16 numbers held as the 16-bit patterns of a ``uint16`` array ``bits`` of ``xp``.

    What the chunkwise form reads and writes for bfloat16 inputs and results where the array
    module has no bfloat16 (CuPy): indexing and ``reshape`` give views (of the same bits);
    ``astype(float32)`` widens exactly (a bfloat16 is the high half of a float32), a segment at a
    time where the caller slices first; assigning float values rounds them to the nearest
    bfloat16, ties to even, NaN kept NaN (as :mod:`racecpu._kernels.convert` on the CPU).
    """

    def __init__(self, xp, bits):
        if np.dtype(bits.dtype) != np.uint16:
            raise TypeError(f"Bfloat16Bits holds uint16 patterns, got dtype {bits.dtype}")
        self.xp, self.bits = xp, bits
        self.dtype = _bfloat16_dtype()

    @classmethod
    def empty(cls, xp, shape):
        return cls(xp, xp.empty(shape, np.uint16))

    shape = property(lambda self: self.bits.shape)
    ndim = property(lambda self: self.bits.ndim)
    size = property(lambda self: self.bits.size)
    nbytes = property(lambda self: self.bits.nbytes)
    flags = property(lambda self: self.bits.flags)

    def __getitem__(self, key):
        return Bfloat16Bits(self.xp, self.bits[key])

    def reshape(self, *shape):
        return Bfloat16Bits(self.xp, self.bits.reshape(*shape))

    def astype(self, dtype, copy=True):
        dtype = np.dtype(dtype)
        if dtype == self.dtype:
            return Bfloat16Bits(self.xp, self.bits.copy()) if copy else self
        wide = (self.bits.astype(np.uint32) << 16).view(np.float32)
        return wide if dtype == np.float32 else wide.astype(dtype)

    def __setitem__(self, key, value):
        if isinstance(value, Bfloat16Bits):
            self.bits[key] = value.bits
            return
        xp = self.xp
        u = xp.ascontiguousarray(xp.asarray(value, dtype=np.float32)).view(np.uint32)   # read, never written
        # in uint32 (4 bytes a value, as the float32 result itself): drop 16 bits, ties to even; a
        # carry into the exponent is right (up to Inf), and NaN, whose sum may wrap, is taken apart
        r = (u >> 16) & 1
        r += 0x7FFF
        r += u
        r >>= 16
        r = xp.where((u & 0x7FFFFFFF) > 0x7F800000, (u >> 16) | 0x40, r)
        self.bits[key] = r.astype(np.uint16)


def is_bfloat16(dtype):
    """Whether ``dtype`` is bfloat16: any 2-byte dtype named so, or the one :class:`Bfloat16Bits`
    reports (no import for the others)."""
    dtype = np.dtype(dtype)
    return dtype.itemsize == 2 and (dtype.name == "bfloat16" or dtype.kind == "V")


def _empty(xp, shape, dtype):
    """An uninitialised result of ``dtype``: an array of ``xp``, or :class:`Bfloat16Bits` for
    bfloat16 (:func:`is_bfloat16`)."""
    if is_bfloat16(dtype):
        return Bfloat16Bits.empty(xp, shape)
    return xp.empty(shape, dtype)


def _cast(xp, x, dtype):
    """``x`` (an array of ``xp`` in the compute dtype) as ``dtype``: itself where it is, else a copy."""
    if np.dtype(x.dtype) == np.dtype(dtype):
        return x
    y = _empty(xp, x.shape, dtype)
    y[...] = x
    return y


# ---------------------------------------------------------------------------
# the soft hash (as racecpu._kernels.hash: the logistic factorisation of the softmax over corners)
# ---------------------------------------------------------------------------

def soft_hash(xp, x, planes, beta):
    """Soft buckets of the rows of ``x (..., d)``: ``phi (..., L * R)`` and ``t (..., L * P)``.

    ``phi`` of table ``l`` is the softmax over the corners ``r`` of
    ``beta * t_l . corner_r`` (``racecpu.hashing.corners`` order), written as a
    product of logistic factors, one per plane: bit ``P - 1 - p`` of ``r``
    set takes ``sigmoid(2 beta t_p)``, else ``sigmoid(-2 beta t_p)``.
    """
    L, P, d = planes.shape
    return buckets_from_u(xp, projections(x, planes), L, P, beta)


def projections(x, planes):
    """The rows' projections on every plane, ``u = x W^T``: ``(..., L * P)`` from ``x (..., d)``
    (one 2-d GEMM; what :func:`soft_hash` takes the tanh of, and what a forward that keeps no
    buckets keeps instead)."""
    L, P, d = planes.shape
    return (x.reshape(-1, d) @ planes.reshape(L * P, d).T).reshape(x.shape[:-1] + (L * P,))


def buckets_from_u(xp, u, L, P, beta):
    """``(phi (..., L * 2**P), t (..., L * P))`` of the projections ``u (..., L * P)``: the second
    half of :func:`soft_hash`, so that buckets remade from kept projections are the forward's to
    the bit."""
    t = xp.tanh(u)
    z = (2.0 * beta) * t.reshape(t.shape[:-1] + (L, P))
    e = xp.exp(-xp.abs(z))  # never overflows
    hi = 1.0 / (1.0 + e)
    lo = e * hi
    pos = z >= 0
    a = xp.where(pos, hi, lo)  # sigmoid(z)
    b = xp.where(pos, lo, hi)  # sigmoid(-z)
    phi = a[..., :1] * 0 + 1
    for p in range(P):  # corner 2r takes the plane's minus side, 2r + 1 its plus side
        n = phi.shape[-1]
        phi = xp.stack([phi * b[..., p:p + 1], phi * a[..., p:p + 1]], axis=-1).reshape(phi.shape[:-1] + (2 * n,))
    return phi.reshape(t.shape[:-1] + (L * 2 ** P,)), t


def _hash_du(xp, dphi, phi, t, beta, L, P):
    """Cotangents of the projections ``u`` (``du (..., L * P)``) and the float64 dbeta of
    :func:`soft_hash` from ``dphi``: the softmax over corners and tanh, without the planes."""
    R = 2 ** P
    shp = phi.shape[:-1]
    phi3 = phi.reshape(shp + (L, R))
    dphi3 = dphi.reshape(shp + (L, R))
    dz = phi3 * (dphi3 - (phi3 * dphi3).sum(-1, keepdims=True))
    s = dz @ xp.asarray(_corner_signs(P, phi.dtype))  # (..., L, P)
    t3 = t.reshape(shp + (L, P))
    dbeta = (s * t3).sum(dtype=np.float64)
    return (beta * s * (1.0 - t3 * t3)).reshape(shp + (L * P,)), dbeta


class ArrayOps:
    """The steps of the chunkwise form that a backend may hand to fused kernels, written with ``xp``.

    :mod:`racecpu.cuda` subclasses it with numba.cuda kernels (one pass over the rows
    instead of one per array expression); the products stay with ``xp`` (cuBLAS).

    Each step takes one *segment*: a slab of ``S`` key/value heads (``group`` query heads
    each) over a run of tokens.  A head longer than the workspace allows is cut into segments
    of whole chunks (:meth:`granule`); the causal steps then carry the state ``(B, A)`` from one
    segment to the next (forward) and ``(dB, dA)`` from one to the one before (backward), in
    float64, packed ``(S, F, dv + 1)`` as the kernels read them (``B`` in columns ``:dv``, the key
    mass ``A`` in column ``dv``).  ``tokens`` is the head's whole length, by which a backend
    chooses its kernels the same way for every segment of a call.
    """

    def __init__(self, xp):
        self.xp = xp

    def granule(self, chunk):
        """Tokens every segment but the last is a whole number of (the causal scan's chunks)."""
        return int(chunk)

    def bytes_per_token(self, tokens, group, d, dv, L, P, chunk, cdt, widen, keep_buckets, causal=True):
        """An upper estimate of the temporaries one token of one key/value head (with its
        ``group`` query heads) costs at once in a forward or backward segment, in bytes.

        ``widen``: the inputs are not in the compute dtype ``cdt`` (a segment's rows of q, k, v
        and the cotangent are widened, its gradients made in ``cdt`` and cast); ``keep_buckets``
        False: the buckets are made per segment (forward and backward) instead of kept.  Counted
        from the array expressions of this module (items of ``cdt`` per token) and held above
        tracemalloc's peaks by ``tests/test_chunkwise.py`` (the margins: the performance log's
        "memory of long and 16-bit calls")."""
        g, F, LP = group, L * 2 ** P, L * P
        rows = g + 1                                      # a token's rows hashed: its queries, its key
        hashing = rows * (8 * LP + 3 * F)                 # soft_hash's transient factors
        if causal:   # the C x C matrices of a chunk, its dv-wide products, the chunks' sums and scans
            C = chunk
            states = 6 * F * (dv + 1) / chunk
            fwd = g * (C + 2 * dv + 2 * F) + dv + F + states
            bwd = g * (3 * C + 2 * dv + 6 * F + LP) + 2 * dv + 3 * F + LP + 1.5 * states
        else:        # F-wide rows only: the sketch's products write out and dv in place
            fwd = g * (2 * F + 4) + F
            bwd = g * (6 * F + LP + 4) + 3 * F + LP
        fx, bx = self._rows_items(g, d, dv, F, LP, widen, keep_buckets)
        return int(np.dtype(cdt).itemsize * (max(fwd + fx, bwd + bx) + hashing)) + 64

    @staticmethod
    def _rows_items(group, d, dv, F, LP, widen, keep_buckets):
        """Items a token adds to the forward's and the backward's temporaries, on any path, for
        16-bit rows (``widen``) and buckets made per segment (not ``keep_buckets``)."""
        fwd = bwd = 0
        rows = group + 1
        if widen:
            fwd += group * (d + dv) + d + dv                  # q, k, v widened; out made in cdt, cast
            bwd += group * (2 * d + 2 * dv) + 2 * d + 2 * dv  # g, v, q, k widened; dq, dk, dv made in cdt
        if not keep_buckets:
            fwd += rows * (F + LP)
            bwd += rows * (F + LP)
        return fwd, bwd

    def soft_hash(self, x, planes, beta, phi_out=None, t_out=None):
        """:func:`soft_hash` of ``x (..., d)``: ``(phi (..., F), t (..., L * P))``, written into
        ``phi_out`` and ``t_out`` where given (C-contiguous, of those shapes; they are returned)."""
        phi, t = soft_hash(self.xp, x, planes, beta)
        if phi_out is not None:
            phi_out[...] = phi
            phi = phi_out
        if t_out is not None:
            t_out[...] = t
            t = t_out
        return phi, t

    def hash_from_u(self, u, beta, L, P):
        """``(phi, t)`` of the projections ``u (M, L * P)`` (:func:`buckets_from_u`), fresh
        ``(M, F)`` and ``(M, L * P)`` arrays; ``u`` is not modified.  The same numbers as
        :meth:`soft_hash` of the rows ``u`` was projected from."""
        return buckets_from_u(self.xp, u, L, P, beta)

    def hash_du(self, dphi, phi, t, beta, L, P):
        """``(du, dbeta)`` of rows ``(M, F)`` (see :func:`_hash_du`)."""
        return _hash_du(self.xp, dphi, phi, t, beta, L, P)

    def exclusive_scan(self, part, reverse, dtype, init=None, total=False):
        """Exclusive prefix (``reverse``: suffix) sums over axis 1 of ``part (S, nc, E)`` in float64,
        as ``dtype``, each starting from ``init (S, E)`` (float64; None: zero).  ``total``: also
        return the float64 sum of ``init`` and every chunk, ``(S, E)``, the next segment's ``init``."""
        return _exclusive_scan(self.xp, part, reverse, dtype, init, total)

    def hash_dx(self, dphi, phi, t, planes, beta, dx_out):
        """Back through :func:`soft_hash` to the rows: ``dx_out[...] = du @ W`` (``(M, d)``, a view of
        the caller's result) from rows ``(M, F)``; returns the float64 dbeta."""
        L, P, d = planes.shape
        du, dbeta = self.hash_du(dphi, phi, t, beta, L, P)
        self.xp.matmul(du, planes.reshape(L * P, d), out=dx_out)
        return dbeta

    def sketch(self, pk, v, sum_chunk, tokens):
        """A segment's share of the non-causal sketch, ``(S, F, dv + 1)`` in float64 (a fresh
        array): ``sum_n pk_n v_n^T`` in columns ``:dv``, ``sum_n pk_n`` in column ``dv``, each the
        float64 sum of float32 partials of ``sum_chunk`` rows.  ``pk (S, n, F)`` (masked keys zero),
        ``v (S, n, dv)`` in the compute dtype."""
        return _sketch64(self.xp, pk, v, sum_chunk)

    def readout(self, pq, sketch, L, out, D, tokens):
        """The non-causal forward of a segment: ``out[...] = (phi_q / D) B`` and ``D[...] = phi_q . A``
        from the slab's ``sketch (S, F, dv + 1)`` in the compute dtype.  ``pq (S, group, n, F)``;
        ``out (S * group, n, dv)`` (any float dtype) and ``D (S * group, n)`` are views of the
        caller's arrays (not necessarily contiguous), aliasing nothing else."""
        _noncausal_readout(self.xp, pq, sketch, L, out, D)

    def attend_causal(self, pq, pk, v, chunk, L, out, D, carry, carry_out, tokens):
        """The causal forward of a segment: ``out[...] = num / D`` and ``D[...]`` (as :meth:`readout`),
        every query seeing the keys before the segment through ``carry (S, F, dv + 1)`` (float64;
        None: the segment starts the head) and the segment's keys up to itself.

        Returns ``(carry_next, prefix)``: the state after the segment where ``carry_out`` (else
        None), and the :class:`PrefixStates` of the segment's chunks where the backend keeps them
        for its backward (None here: the array form makes its own)."""
        xp = self.xp
        S, group, n, F = pq.shape
        cdt = pk.dtype
        num, Dn, nxt = _causal_fwd_slab(xp, self, pq, pk, v, chunk, _tril(xp, chunk, cdt), carry, carry_out)
        Dn = Dn.reshape(S * group, n)
        D[...] = Dn
        num = num.reshape(S * group, n, v.shape[-1])
        num *= _inverse(xp, Dn, L)[..., None]
        out[...] = num
        return nxt, None

    def noncausal_queries_bwd(self, pq, g, winv, sketch, sum_chunk, tokens):
        """The queries' side of a non-causal backward segment: ``(dphi_q (S, group, n, F), dBA)``,
        ``dBA (S, F, dv + 1)`` the segment's share of ``(dB, dA)`` in float64 (summed over the
        group's query heads).  ``g (S, group, n, dv)``, ``winv (S, group, n)`` (1 / D, 0 on
        floored rows), the forward's ``sketch (S, F, dv + 1)``."""
        return _noncausal_queries_bwd(self.xp, pq, g, winv, sketch, sum_chunk)

    def noncausal_keys_bwd(self, pk, v, dBA, dv_out, tokens):
        """The keys' side of a non-causal backward segment: ``dphi_k (S, n, F)``, and the values'
        gradient written into ``dv_out (S, n, dv)`` (a view of the caller's result); ``dBA
        (S, F, dv + 1)`` in the compute dtype, summed over every query."""
        xp = self.xp
        dv = v.shape[-1]
        dB, dA = dBA[..., :dv], dBA[..., dv]
        dpk = v @ xp.swapaxes(dB, -1, -2) + dA[:, None, :]
        xp.matmul(pk, dB, out=dv_out)
        return dpk

    def causal_bwd(self, pq, pk, v, g, winv, D, C, dv_out, prefix=None, carry=None, dcarry=None,
                   carry_out=False, tokens=None):
        """Causal ``(dphi_q, dphi_k, dcarry_next)`` of a segment (:func:`_causal_bwd_slab`; ``D (S,
        group, n)`` the denominators that ``winv`` inverts); the values' gradient is written into
        ``dv_out (S, n, dv)`` (a view of the caller's result, aliasing no input).  ``carry``: the
        forward's state before the segment (None: it starts the head); ``dcarry``: ``(dB, dA)`` of
        every later token (None: the segment ends the head), both float64 ``(S, F, dv + 1)``;
        ``dcarry_next`` (where ``carry_out``) adds the segment's own, for the segment before.
        ``prefix``: the segment's :class:`PrefixStates` where :meth:`attend_causal` returned them
        (unused by the array form, which makes its own at chunks of ``C``)."""
        dpq, dpk, dv_out[...], nxt = _causal_bwd_slab(self.xp, self, pq, pk, v, g, winv, C,
                                                      _tril(self.xp, C, pk.dtype), carry, dcarry, carry_out)
        return dpq, dpk, nxt


def _corner_signs(P, dtype):
    r = np.arange(2 ** P)[:, None]
    return (2 * ((r >> (P - 1 - np.arange(P))[None, :]) & 1) - 1).astype(dtype)  # (R, P)


def soft_hash_bwd(xp, dphi, phi, t, planes, beta, x=None):
    """Back through :func:`soft_hash`: ``(dx, dbeta)``, and ``dW`` too when the rows ``x`` are given.

    ``dphi``, ``phi (..., L * R)``, ``t (..., L * P)``; ``dbeta`` is a float64
    scalar of ``xp``; ``dW (L, P, d)`` sums over every row.
    """
    L, P, d = planes.shape
    shp = phi.shape[:-1]
    du, dbeta = _hash_du(xp, dphi, phi, t, beta, L, P)
    dx = (du.reshape(-1, L * P) @ planes.reshape(L * P, d)).reshape(shp + (d,))
    if x is None:
        return dx, dbeta
    dW = du.reshape(-1, L * P).T @ x.reshape(-1, d)
    return dx, dbeta, dW.reshape(L, P, d)


# ---------------------------------------------------------------------------
# chunk sums and scans
# ---------------------------------------------------------------------------

def _chunks(xp, x, C):
    """``x (S, N, E)`` as ``(S, nc, C, E)``, zero rows appended to a whole chunk (a copy only then)."""
    S, N, E = x.shape
    nc = -(-N // C)
    if nc * C != N:
        y = xp.zeros((S, nc * C, E), x.dtype)
        y[:, :N] = x
        x = y
    return x.reshape(S, nc, C, E)


def _sum_chunks64(xp, phi, w, C):
    """``sum_n phi_n w_n^T`` of ``phi (S, N, F)`` and ``w (S, N, E)`` (``w = None``: a column of ones)
    in chunks of ``C`` rows summed in float64: ``(S, F, E)`` (``(S, F)`` for ones), float64."""
    pc = _chunks(xp, phi, C)
    part = pc.sum(axis=2) if w is None else xp.swapaxes(pc, -1, -2) @ _chunks(xp, w, C)
    return part.sum(axis=1, dtype=np.float64)


def _sketch64(xp, pk, v, C):
    """The non-causal sketch of ``pk (S, N, F)`` and ``v (S, N, dv)`` packed as ``(S, F, dv + 1)`` in
    float64: ``B = sum_n pk_n v_n^T`` in columns ``:dv`` and ``A = sum_n pk_n`` in column ``dv``."""
    S, _, F = pk.shape
    dv = v.shape[-1]
    sketch = xp.empty((S, F, dv + 1), np.float64)
    sketch[..., :dv] = _sum_chunks64(xp, pk, v, C)
    sketch[..., dv] = _sum_chunks64(xp, pk, None, C)
    return sketch


def _exclusive_scan(xp, part, reverse, dtype, init=None, total=False):
    """Exclusive prefix (``reverse``: suffix) sums over axis 1 of ``part (S, nc, ...)``, in float64,
    from ``init (S, ...)`` where given; with ``total``, ``(sums, init + every chunk)``."""
    out = xp.zeros(part.shape, np.float64)
    nc = part.shape[1]
    if nc > 1:
        if reverse:
            out[:, :-1] = xp.cumsum(part[:, ::-1][:, :-1], axis=1, dtype=np.float64)[:, ::-1]
        else:
            out[:, 1:] = xp.cumsum(part[:, :-1], axis=1, dtype=np.float64)
    if init is not None:
        out += init[:, None]
    if not total:
        return out.astype(dtype)
    if nc:
        edge = 0 if reverse else nc - 1
        tot = out[:, edge] + part[:, edge]
    else:
        tot = xp.zeros((part.shape[0],) + part.shape[2:], np.float64) if init is None else init.copy()
    return out.astype(dtype), tot


def _pack(xp, B, A):
    """``(S, F, dv)`` and ``(S, F)`` float64 sums packed as ``(S, F, dv + 1)``."""
    S, F, dv = B.shape
    out = xp.empty((S, F, dv + 1), np.float64)
    out[..., :dv] = B
    out[..., dv] = A
    return out


def _unpack(carry, dv):
    """``(S, F, dv + 1)`` as the scans' inits: ``(S, F * dv)`` and ``(S, F)`` (None: None, None)."""
    if carry is None:
        return None, None
    S, F, _ = carry.shape
    return carry[..., :dv].reshape(S, F * dv), carry[..., dv]


def _sum_group(x):
    """``x (S, group, ...)`` summed over its query heads (axis 1); no copy for one head."""
    return x[:, 0] if x.shape[1] == 1 else x.sum(axis=1)


def _tril(xp, C, dtype):
    return xp.asarray(np.tril(np.ones((C, C), dtype)))


# ---------------------------------------------------------------------------
# slabs and segments
# ---------------------------------------------------------------------------

def slab_heads(Gk, per_head_bytes, workspace):
    """Key/value heads per slab: as many as keep ``per_head_bytes`` each within ``workspace`` (at least 1)."""
    return max(1, min(Gk, int(workspace // max(per_head_bytes, 1))))


def slab_shape(Gk, n, per_token_bytes, workspace, granule):
    """``(heads, tokens)`` of a slab: as many whole heads as keep their temporaries
    (``per_token_bytes`` a token of a head) within ``workspace``; where one head does not fit, one
    head a slab in segments of equal length, a whole number of ``granule`` tokens (the last one
    shorter), each within ``workspace`` (at least ``granule`` tokens)."""
    per_head = per_token_bytes * max(n, 1)
    if per_head <= workspace or n <= granule:
        return slab_heads(Gk, per_head, workspace), max(n, 1)
    most = max(granule, int(workspace // max(per_token_bytes, 1)) // granule * granule)
    nseg = -(-n // most)
    return 1, -(-(-(-n // nseg)) // granule) * granule


def _segments(n, seg):
    """The ``(start, stop)`` token ranges of a head of ``n`` tokens in segments of ``seg`` (one
    empty range for ``n = 0``)."""
    return [(a, min(n, a + seg)) for a in range(0, n, seg)] or [(0, 0)]


def _contiguous(x):
    return x is not None and bool(x.flags.c_contiguous)


def _hash_rows(ops, x, planes, beta, cdt, phi_dst, t_dst, u_dst):
    """``(phi, t)`` of the rows ``x (S, n, d)`` (widened to ``cdt``), written into the residuals'
    views ``phi_dst`` and ``t_dst``; or, where the forward keeps the projections instead
    (``u_dst``, a view of them), ``u`` written there and ``phi``, ``t`` fresh."""
    x = x.astype(cdt, copy=False)
    L, P, _ = planes.shape
    if phi_dst is None and u_dst is None:   # a forward that keeps nothing
        return ops.soft_hash(x, planes, beta)
    if u_dst is not None:
        u = projections(x, planes)
        u_dst[...] = u
        phi, t = ops.hash_from_u(u.reshape(-1, L * P), beta, L, P)
        return phi.reshape(x.shape[:-1] + (-1,)), t.reshape(u.shape)
    if _contiguous(phi_dst) and _contiguous(t_dst):
        return ops.soft_hash(x, planes, beta, phi_out=phi_dst, t_out=t_dst)
    phi_dst[...], t_dst[...] = ops.soft_hash(x, planes, beta)   # a grouped head's segment: strided views
    return phi_dst, t_dst


def _rows(res, name, lo, hi, a, b):
    x = res[name]
    return None if x is None else x[lo:hi, a:b]


def _buckets(ops, res, side, lo, hi, a, b):
    """``(phi, t)`` of heads ``lo:hi``, tokens ``a:b`` of the queries (``side`` "q") or keys ("k"):
    views of the kept ones, or remade from the kept projections (masked keys zeroed, as the
    forward did): the forward's numbers either way."""
    phi = _rows(res, "phi" + side, lo, hi, a, b)
    if phi is not None:
        return phi, _rows(res, "t" + side, lo, hi, a, b)
    L, P, _ = res["planes"].shape
    u = _rows(res, "u" + side, lo, hi, a, b)
    phi, t = ops.hash_from_u(u.reshape(-1, L * P), res["beta"], L, P)
    phi = phi.reshape(u.shape[:-1] + (-1,))
    if side == "k" and res["mask"] is not None:
        phi *= res["mask"][lo:hi, a:b, None]
    return phi, t.reshape(u.shape)


def _keep_prefix(xp, prefix, kept, g0, g1, a, Gk, n, whole):
    """The forward's :class:`PrefixStates` of every head with a segment's ``kept`` written in (None
    as soon as one segment keeps none: the backward then makes them all)."""
    if kept is None:
        return None
    if whole:
        return kept
    if prefix is None:
        nc = -(-n // kept.chunk)
        prefix = PrefixStates(xp.empty((Gk, nc) + kept.states.shape[2:], kept.states.dtype), kept.chunk)
    if a % kept.chunk or prefix.chunk != kept.chunk:
        return None
    c0 = a // kept.chunk
    prefix.states[g0:g1, c0:c0 + kept.states.shape[1]] = kept.states
    return prefix


# ---------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------

def forward(xp, q, k, v, planes, beta, *, causal, key_mask=None, group=1, chunk=64, sum_chunk=1024,
            workspace=2 ** 31, out_dtype=None, ops=None, keep_buckets=True, residuals=True):
    """RACE attention (ratio estimator): ``(out, residuals)``.

    Parameters
    ----------
    xp : array module (numpy or cupy)
    q : (G, Nq, d); k : (Gk, Nk, d); v : (Gk, Nk, dv), ``G = Gk * group``; C-contiguous, any float
        dtype (16-bit ones are widened to float32 a segment at a time).  Causal needs ``Nq == Nk``.
    planes : (L, P, d) in the compute dtype (float32, or float64 for float64 inputs)
    key_mask : (Gk, Nk) bool or None (kept by reference where ``keep_buckets`` is False)
    chunk : tokens per chunk of the causal scan; sum_chunk : rows per float32 partial of the
        non-causal sketch (summed in float64)
    workspace : bytes of temporaries a slab may use: as many key/value heads as fit, and a head
        that does not fit alone is cut into segments of tokens (:func:`slab_shape`, from
        ``ops.bytes_per_token``); the causal state crosses segments in float64
    out_dtype : dtype of ``out`` (default: the compute dtype)
    ops : :class:`ArrayOps` (default ``ArrayOps(xp)``): the hash and the scans
    keep_buckets : keep the soft buckets ``phi`` and ``t`` of q and k for the backward (F + L * P
        numbers a row), else only the projections ``u = x W^T`` (L * P a row), from which the
        backward makes the same buckets again: for 16-bit inputs at d = 128 the kept buckets are
        13 % of the eight arrays, the projections 3.5 %.
    residuals : False for a forward alone (inference): nothing is kept for a backward (the
        buckets are made a segment at a time and dropped), and ``(out, None)`` is returned.

    Returns
    -------
    out : (G, Nq, dv) of ``out_dtype``; a fresh array, aliasing no input.
    residuals : dict of ``phiq (G, Nq, F)``, ``tq``, ``phik (Gk, Nk, F)``, ``tk`` (None where
        ``keep_buckets`` is False) or ``uq (G, Nq, L * P)``, ``uk`` (None where it is True),
        ``D (G, Nq)``, non-causal ``sketch (Gk, F, dv + 1)`` (None when causal; compute dtype),
        causal ``prefix`` (:class:`PrefixStates` of all ``Gk`` heads where ``ops`` kept them, else
        None) and ``carries (Gk, nseg, F, dv + 1)`` (float64, the state at each segment's start;
        None for one segment), ``slab`` (heads, tokens) and the scalars; ``v`` and ``mask`` are
        kept by reference.
    """
    ops = ops or ArrayOps(xp)
    cdt = np.dtype(planes.dtype)
    G, nq, d = q.shape
    Gk, nk, dv = v.shape
    L, P, _ = planes.shape
    F, LP = L * 2 ** P, L * P
    n = max(nq, nk)
    out = _empty(xp, (G, nq, dv), out_dtype or cdt)
    D = xp.empty((G, nq), cdt)
    if not residuals:
        phiq = tq = phik = tk = uq = uk = None
        keep_buckets = False   # for the estimate: the buckets are a segment's temporaries
    elif keep_buckets:
        phiq, tq, phik, tk = (xp.empty(s, cdt) for s in ((G, nq, F), (G, nq, LP), (Gk, nk, F), (Gk, nk, LP)))
        uq = uk = None
    else:
        phiq = tq = phik = tk = None
        uq, uk = xp.empty((G, nq, LP), cdt), xp.empty((Gk, nk, LP), cdt)
    widen = any(np.dtype(x.dtype) != cdt for x in (q, k, v, out))
    per_token = ops.bytes_per_token(n, group, d, dv, L, P, chunk, cdt, widen, keep_buckets, causal)
    # segments of whole chunks, and of whole partials of the sketch (a short one would be padded)
    granule = ops.granule(chunk) if causal else math.lcm(ops.granule(chunk), int(sum_chunk))
    hs, seg = slab_shape(Gk, n, per_token, workspace, granule)
    nseg = len(_segments(n, seg))
    sketch = None if causal else xp.empty((Gk, F, dv + 1), cdt)
    carries = xp.zeros((Gk, nseg, F, dv + 1), np.float64) if causal and nseg > 1 and residuals else None
    prefix = None
    res = dict(phiq=phiq, tq=tq, phik=phik, tk=tk, uq=uq, uk=uk)

    def hashed(x, side, lo, hi, a, b):
        dst = (_rows(res, name + side, lo, hi, a, b) for name in ("phi", "t", "u"))
        return _hash_rows(ops, x, planes, beta, cdt, *dst)[0]

    def hashed_keys(g0, g1, a, b):
        pk = hashed(k[g0:g1, a:b], "k", g0, g1, a, b)
        if key_mask is not None:
            pk *= key_mask[g0:g1, a:b, None]
        return pk

    for g0 in range(0, Gk, hs):
        g1 = min(Gk, g0 + hs)
        h0, h1 = g0 * group, g1 * group
        S = g1 - g0
        if causal:
            carry = None
            for s, (a, b) in enumerate(_segments(n, seg)):
                pk = hashed_keys(g0, g1, a, b)
                pq = hashed(q[h0:h1, a:b], "q", h0, h1, a, b)
                if carries is not None and carry is not None:
                    carries[g0:g1, s] = carry
                carry, kept = ops.attend_causal(pq.reshape(S, group, b - a, F), pk,
                                                v[g0:g1, a:b].astype(cdt, copy=False), chunk, L,
                                                out[h0:h1, a:b], D[h0:h1, a:b], carry, s + 1 < nseg, n)
                if residuals and (prefix is not None or (g0 == 0 and s == 0)):
                    prefix = _keep_prefix(xp, prefix, kept, g0, g1, a, Gk, n, hs == Gk and nseg == 1)
        else:
            sk = None
            for a, b in _segments(nk, seg):
                part = ops.sketch(hashed_keys(g0, g1, a, b), v[g0:g1, a:b].astype(cdt, copy=False), sum_chunk, n)
                if sk is None:
                    sk = part
                else:
                    sk += part
            sketch[g0:g1] = sk
            for a, b in _segments(nq, seg):
                pq = hashed(q[h0:h1, a:b], "q", h0, h1, a, b)
                ops.readout(pq.reshape(S, group, b - a, F), sketch[g0:g1], L, out[h0:h1, a:b], D[h0:h1, a:b], n)
    if not residuals:
        return out, None
    res.update(D=D, sketch=sketch, prefix=prefix, carries=carries, slab=(hs, seg), v=v, mask=key_mask,
               planes=planes, beta=beta, causal=causal, group=group, chunk=chunk, sum_chunk=sum_chunk,
               workspace=workspace)
    return out, res


def _noncausal_readout(xp, pq, sketch, L, out, D):
    """``out[...] = (phi_q / D) B`` and ``D[...] = phi_q . A`` from the packed ``sketch (S, F, dv + 1)``
    (``pq (S, group, nq, F)``; ``out (S * group, nq, dv)``, ``D (S * group, nq)`` views to write).
    The 1 / D scales the F-wide rows before the product, which then writes ``out`` itself where it
    is contiguous and in the compute dtype: no dv-wide temporary, no second pass over it.  Batched
    products of ``(S, group * nq, F)`` rows against ``(S, F, .)`` (no broadcast batch axes under
    ``out=``)."""
    S, group, nq, F = pq.shape
    dv = sketch.shape[-1] - 1
    rows = pq.reshape(S, group * nq, F)
    Dn = (rows @ sketch[:, :, dv:])[..., 0]                         # (S, group * nq)
    D[...] = Dn.reshape(S * group, nq)
    pw = rows * _inverse(xp, Dn, L)[..., None]
    if out.dtype == pq.dtype and _contiguous(out):
        xp.matmul(pw, sketch[..., :dv], out=out.reshape(S, group * nq, dv))
    else:
        out[...] = (pw @ sketch[..., :dv]).reshape(out.shape)


def _inverse(xp, Dn, L):
    """``1 / D``, and 0 where ``den = D / L <= DEN_FLOOR`` (those queries output 0 and pass nothing back)."""
    keep = Dn > L * DEN_FLOOR
    return keep / xp.where(keep, Dn, 1)


def _causal_fwd_slab(xp, ops, pq, pk, v, C, mask_c, carry=None, carry_out=False):
    """Causal numerators and ``D`` of one segment: ``pq (S, group, N, F)``, ``pk (S, N, F)``,
    ``v (S, N, dv)``, from ``carry`` (see :meth:`ArrayOps.attend_causal`); and the state after it
    where ``carry_out``."""
    S, group, N, F = pq.shape
    cdt = pk.dtype
    kc, vc, Bp, Ap, nxt = _prefix_states(xp, ops, pk, v, C, cdt, carry, carry_out)
    nc = kc.shape[1]
    qc = _chunks(xp, pq.reshape(S * group, N, F), C).reshape(S, group, nc, C, F)
    M = qc @ xp.swapaxes(kc, -1, -2)[:, None]    # (S, group, nc, C, C): phi_q . phi_k within the chunk
    M *= mask_c
    num = qc @ Bp[:, None]
    num += M @ vc[:, None]
    Dn = (qc @ Ap[:, None, :, :, None])[..., 0] + M.sum(axis=-1)
    dv = v.shape[-1]
    return num.reshape(S, group, nc * C, dv)[:, :, :N], Dn.reshape(S, group, nc * C)[:, :, :N], nxt


def _prefix_states(xp, ops, pk, v, C, cdt, carry=None, carry_out=False):
    """The chunks of ``pk``, ``v`` and the state ``(B, A)`` every chunk starts from (exclusive, float64
    scan from ``carry``), and the state after the last chunk where ``carry_out`` (else None)."""
    kc = _chunks(xp, pk, C)                      # (S, nc, C, F)
    vc = _chunks(xp, v, C)                       # (S, nc, C, dv)
    S, nc, _, F = kc.shape
    dv = vc.shape[-1]
    Bc = xp.swapaxes(kc, -1, -2) @ vc            # (S, nc, F, dv)
    ib, ia = _unpack(carry, dv)
    Bp = ops.exclusive_scan(Bc.reshape(S, nc, F * dv), False, cdt, ib, carry_out)
    Ap = ops.exclusive_scan(kc.sum(axis=2), False, cdt, ia, carry_out)            # (S, nc, F)
    nxt = None
    if carry_out:
        (Bp, tb), (Ap, ta) = Bp, Ap
        nxt = _pack(xp, tb.reshape(S, F, dv), ta)
    return kc, vc, Bp.reshape(S, nc, F, dv), Ap, nxt


# ---------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------

def backward(xp, res, grad, *, q=None, k=None, ops=None, grad_dtypes=None):
    """Gradients of :func:`forward`: ``(dq, dk, dv, dbeta)``, and ``dplanes`` when ``q`` and ``k`` are given.

    ``grad (G, Nq, dv)`` (any float dtype); ``dq (G, Nq, d)``, ``dk (Gk, Nk, d)``,
    ``dv (Gk, Nk, dv)`` in ``grad_dtypes`` (three dtypes; default: the compute dtype), fresh
    arrays (the key/value gradients summed over each key/value head's query heads); ``dbeta`` a
    Python float; ``dplanes (L, P, d)``.  The work runs in the forward's slabs and segments (its
    ``slab``), the causal segments of a head from the last to the first.  A gradient of another
    dtype than the compute dtype is computed in the compute dtype and cast: a segment at a time
    where the work is split (16-bit gradients of a long sequence never exist whole in float32),
    else once at the end (then the result of another dtype is not allocated beside the slab's
    temporaries).
    """
    ops = ops or ArrayOps(xp)
    planes, beta, group, C = res["planes"], res["beta"], res["group"], res["chunk"]
    D, v = res["D"], res["v"]
    cdt = np.dtype(D.dtype)
    G, nq = D.shape
    Gk, nk, dv = v.shape
    L, P, d = planes.shape
    F = L * 2 ** P
    W2 = planes.reshape(L * P, d)
    want_dw = q is not None
    dW = xp.zeros((L * P, d), cdt) if want_dw else None
    dbeta = 0.0
    n = max(nq, nk)
    hs, seg = res["slab"]
    nseg = len(_segments(n, seg))
    want = (cdt,) * 3 if grad_dtypes is None else tuple(np.dtype(t) for t in grad_dtypes)
    qdt, kdt, vdt = want if hs < Gk or nseg > 1 else (cdt,) * 3
    dq = _empty(xp, (G, nq, d), qdt)
    dk = _empty(xp, (Gk, nk, d), kdt)
    dV = _empty(xp, (Gk, nk, dv), vdt)
    prefix, carries = res.get("prefix"), res.get("carries")

    def back(dphi, phi, t, x, dst):
        """Through the soft hash to the rows' gradient ``dst`` (a view of dq or dk), ``dW`` where asked;
        returns dbeta's share."""
        tgt = _in_cdt(xp, dst, cdt)
        rows = (dphi.reshape(-1, F), phi.reshape(-1, F), t.reshape(-1, L * P))
        if want_dw:  # the planes' gradient needs the projections' cotangents themselves
            du, db = ops.hash_du(*rows, beta, L, P)
            xp.matmul(du, W2, out=tgt.reshape(-1, d))
            dW[...] += du.T @ x.astype(cdt, copy=False).reshape(-1, d)
        else:
            db = ops.hash_dx(*rows, planes, beta, tgt.reshape(-1, d))
        if tgt is not dst:
            dst[...] = tgt   # the segment's gradient cast into its place
        return float(db)

    def cotangent(h0, h1, a, b):
        S = (h1 - h0) // group
        g = grad[h0:h1, a:b].astype(cdt, copy=False).reshape(S, group, b - a, dv)
        return g, _inverse(xp, D[h0:h1, a:b], L).reshape(S, group, b - a)   # 1 / D, 0 on floored rows

    for g0 in range(0, Gk, hs):
        g1 = min(Gk, g0 + hs)
        h0, h1 = g0 * group, g1 * group
        S = g1 - g0
        dbq = dbk = 0.0
        if res["causal"]:
            dcarry = None
            segs = _segments(n, seg)
            for s in range(len(segs) - 1, -1, -1):
                a, b = segs[s]
                pq, tq = _buckets(ops, res, "q", h0, h1, a, b)
                pk, tk = _buckets(ops, res, "k", g0, g1, a, b)
                g, winv = cotangent(h0, h1, a, b)
                dv_dst = dV[g0:g1, a:b]
                dv_s = _in_cdt(xp, dv_dst, cdt)
                pre = None
                if prefix is not None and a % prefix.chunk == 0:
                    c0 = a // prefix.chunk
                    pre = PrefixStates(prefix.states[g0:g1, c0:c0 + -(-(b - a) // prefix.chunk)], prefix.chunk)
                dpq, dpk, dcarry = ops.causal_bwd(
                    pq.reshape(S, group, b - a, F), pk, v[g0:g1, a:b].astype(cdt, copy=False), g, winv,
                    D[h0:h1, a:b].reshape(S, group, b - a), C, dv_s, prefix=pre,
                    carry=None if carries is None or s == 0 else carries[g0:g1, s], dcarry=dcarry,
                    carry_out=s > 0, tokens=n)
                if dv_s is not dv_dst:
                    dv_dst[...] = dv_s
                dbq += back(dpq, pq, tq, q[h0:h1, a:b] if want_dw else None, dq[h0:h1, a:b])
                dbk += back(dpk, pk, tk, k[g0:g1, a:b] if want_dw else None, dk[g0:g1, a:b])
        else:
            dBA = None
            for a, b in _segments(nq, seg):
                pq, tq = _buckets(ops, res, "q", h0, h1, a, b)
                g, winv = cotangent(h0, h1, a, b)
                dpq, part = ops.noncausal_queries_bwd(pq.reshape(S, group, b - a, F), g, winv,
                                                      res["sketch"][g0:g1], res["sum_chunk"], n)
                if dBA is None:
                    dBA = part
                else:
                    dBA += part
                dbq += back(dpq, pq, tq, q[h0:h1, a:b] if want_dw else None, dq[h0:h1, a:b])
            dBA = dBA.astype(cdt)
            for a, b in _segments(nk, seg):
                pk, tk = _buckets(ops, res, "k", g0, g1, a, b)
                dv_dst = dV[g0:g1, a:b]
                dv_s = _in_cdt(xp, dv_dst, cdt)
                dpk = ops.noncausal_keys_bwd(pk, v[g0:g1, a:b].astype(cdt, copy=False), dBA, dv_s, n)
                if dv_s is not dv_dst:
                    dv_dst[...] = dv_s
                dbk += back(dpk, pk, tk, k[g0:g1, a:b] if want_dw else None, dk[g0:g1, a:b])
        dbeta += dbq + dbk
    dq, dk, dV = (_cast(xp, x, t) for x, t in zip((dq, dk, dV), want))
    return (dq, dk, dV, dbeta) + ((dW.reshape(L, P, d),) if want_dw else ())


def _in_cdt(xp, out_slab, cdt):
    """Where a segment's gradient is computed: ``out_slab`` itself (a view of the result) where it is
    contiguous and in the compute dtype, else a fresh array of its shape in ``cdt`` that the
    caller casts into it."""
    return out_slab if out_slab.dtype == cdt and _contiguous(out_slab) else xp.empty(out_slab.shape, cdt)


def _noncausal_queries_bwd(xp, pq, g, winv, sketch, sum_chunk):
    """The queries' side of a non-causal backward segment (``pq (S, group, N, F)``,
    ``g (S, group, N, dv)``, ``winv = 1 / D`` ``(S, group, N)``, the forward's ``sketch (S, F, dv + 1)``):
    ``dphi_q`` and the segment's ``(dB, dA)`` packed ``(S, F, dv + 1)`` in float64."""
    S, group, nq, F = pq.shape
    dv = sketch.shape[-1] - 1
    B, A = sketch[..., :-1], sketch[..., -1]
    Y = g @ xp.swapaxes(B, -1, -2)[:, None]       # (S, group, nq, F): B g_i
    dD = -(pq * Y).sum(axis=-1) * winv * winv     # -(g_i . num_i) / D_i^2
    Y *= winv[..., None]
    dpq = Y + dD[..., None] * A[:, None, None, :]
    pw = (pq * winv[..., None]).reshape(S, group * nq, F)   # phi_q / D: scales F columns, not dv
    dBA = xp.empty((S, F, dv + 1), np.float64)
    dBA[..., :dv] = _sum_chunks64(xp, pw, g.reshape(S, group * nq, -1), sum_chunk)
    dBA[..., dv] = _sum_chunks64(xp, pq.reshape(S, group * nq, F), dD.reshape(S, group * nq, 1), sum_chunk)[..., 0]
    return dpq, dBA


def _causal_bwd_slab(xp, ops, pq, pk, v, g, winv, C, mask_c, carry=None, dcarry=None, carry_out=False):
    """Causal ``(dphi_q, dphi_k, dv, dcarry_next)`` of one segment (shapes as
    :func:`_noncausal_queries_bwd`; ``carry``, ``dcarry`` as :meth:`ArrayOps.causal_bwd`).

    ``1 / D`` scales the F-wide rows of phi_q and the C x C matrices, never the dv-wide
    rows of ``g``, so no (N, dv) temporary is made beside the gradients themselves.
    """
    S, group, N, F = pq.shape
    dv = v.shape[-1]
    cdt = pk.dtype
    kc, vc, Bp, Ap, _ = _prefix_states(xp, ops, pk, v, C, cdt, carry)    # the prefix states, as the forward
    nc = kc.shape[1]

    def chunks4(x):
        return _chunks(xp, x.reshape(S * group, N, x.shape[-1]), C).reshape(S, group, nc, C, x.shape[-1])

    qc, gc = chunks4(pq), chunks4(g)
    wc = chunks4(winv[..., None])                                # (S, group, nc, C, 1)
    kT = xp.swapaxes(kc, -1, -2)[:, None]
    M = qc @ kT                                                  # phi_q . phi_k, visible pairs
    M *= mask_c
    GV = gc @ xp.swapaxes(vc, -1, -2)[:, None]                   # g_i . v_j
    GV *= mask_c
    Y = gc @ xp.swapaxes(Bp, -1, -2)[:, None]                    # B_prev g_i: (S, group, nc, C, F)
    # g_i . num_i, then dD_i = -(g_i . num_i) / D_i^2
    gnum = (qc * Y).sum(axis=-1) + (M * GV).sum(axis=-1)
    dD = (-gnum * wc[..., 0] * wc[..., 0])[..., None]           # (S, group, nc, C, 1)
    Dm = GV                                                      # Dmat_ij = [j <= i] ((g_i . v_j) / D_i + dD_i)
    Dm *= wc
    Dm += dD
    Dm *= mask_c
    Y *= wc
    dpq = Y + dD * Ap[:, None, :, None, :] + Dm @ kc[:, None]
    # suffix sums of (dB, dA) over later chunks (and segments), summed over the query heads of the group
    qw = xp.swapaxes(qc * wc, -1, -2)                            # (phi_q / D)^T: (S, group, nc, F, C)
    dBc = _sum_group(qw @ gc)                                    # (S, nc, F, dv)
    dAc = _sum_group((xp.swapaxes(qc, -1, -2) @ dD)[..., 0])     # (S, nc, F)
    ib, ia = _unpack(dcarry, dv)
    dBn = ops.exclusive_scan(dBc.reshape(S, nc, F * dv), True, cdt, ib, carry_out)
    dAn = ops.exclusive_scan(dAc, True, cdt, ia, carry_out)
    nxt = None
    if carry_out:
        (dBn, tb), (dAn, ta) = dBn, dAn
        nxt = _pack(xp, tb.reshape(S, F, dv), ta)
    dBn = dBn.reshape(S, nc, F, dv)
    dpk = vc @ xp.swapaxes(dBn, -1, -2) + dAn[:, :, None, :] + _sum_group(xp.swapaxes(Dm, -1, -2) @ qc)
    M *= wc                                                      # M_ij / D_i
    dvs = kc @ dBn
    dvs += _sum_group(xp.swapaxes(M, -1, -2) @ gc)
    return (dpq.reshape(S, group, nc * C, F)[:, :, :N], dpk.reshape(S, nc * C, F)[:, :N],
            dvs.reshape(S, nc * C, dv)[:, :N], nxt)

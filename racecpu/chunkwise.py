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
Work runs in slabs of key/value heads (:func:`slab_heads`) so that the
temporaries stay within a workspace budget at any length; 16-bit inputs are
widened one slab at a time, never whole.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .config import DEN_FLOOR

__all__ = ["soft_hash", "soft_hash_bwd", "forward", "backward", "slab_heads", "PrefixStates"]


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
    t = xp.tanh(x.reshape(-1, d) @ planes.reshape(L * P, d).T).reshape(x.shape[:-1] + (L * P,))  # one 2-d GEMM
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
    return phi.reshape(x.shape[:-1] + (L * 2 ** P,)), t


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
    """

    def __init__(self, xp):
        self.xp = xp

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

    def hash_du(self, dphi, phi, t, beta, L, P):
        """``(du, dbeta)`` of rows ``(M, F)`` (see :func:`_hash_du`)."""
        return _hash_du(self.xp, dphi, phi, t, beta, L, P)

    def exclusive_scan(self, part, reverse, dtype):
        """Exclusive prefix (suffix) sums over axis 1 of ``part (S, nc, E)`` in float64, as ``dtype``."""
        return _exclusive_scan(self.xp, part, reverse, dtype)

    def hash_dx(self, dphi, phi, t, planes, beta, dx_out):
        """Back through :func:`soft_hash` to the rows: ``dx_out[...] = du @ W`` (``(M, d)``, a view of
        the caller's result) from rows ``(M, F)``; returns the float64 dbeta."""
        L, P, d = planes.shape
        du, dbeta = self.hash_du(dphi, phi, t, beta, L, P)
        self.xp.matmul(du, planes.reshape(L * P, d), out=dx_out)
        return dbeta

    def attend(self, pq, pk, v, causal, chunk, sum_chunk, L, out, D):
        """The forward of one slab from its soft buckets: ``out[...] = num / D`` and ``D[...]``.

        ``pq (S, group, Nq, F)``, ``pk (S, Nk, F)`` (masked keys zero), ``v (S, Nk, dv)`` in the
        compute dtype; ``out (S * group, Nq, dv)`` (any float dtype) and ``D (S * group, Nq)`` are
        written in place (views of the caller's arrays; they alias nothing else).  Returns the
        non-causal sketch packed as ``(S, F, dv + 1)`` (``B`` in columns ``:dv``, the key mass
        ``A`` in column ``dv``), a fresh array the backward reads again; causal, None here (a
        backend whose causal forward keeps its chunks' states returns them as
        :class:`PrefixStates`, which :meth:`causal_bwd` is then given).
        """
        xp = self.xp
        S, group, nq, F = pq.shape
        cdt = pk.dtype
        if not causal:
            sketch = _sketch(xp, pk, v, sum_chunk, cdt)
            _noncausal_readout(xp, pq, sketch, L, out, D)
            return sketch
        num, Dn = _causal_fwd_slab(xp, self, pq, pk, v, chunk, _tril(xp, chunk, cdt))
        Dn = Dn.reshape(S * group, nq)
        D[...] = Dn
        num = num.reshape(S * group, nq, v.shape[-1])
        num *= _inverse(xp, Dn, L)[..., None]
        out[...] = num
        return None

    def noncausal_bwd(self, pq, pk, v, g, winv, sketch, sum_chunk, dv_out):
        """Non-causal ``(dphi_q, dphi_k)`` of one slab (:func:`_noncausal_bwd_slab`) from the
        forward's ``sketch (S, F, dv + 1)`` (:meth:`attend`'s); the values' gradient is written
        into ``dv_out (S, Nk, dv)`` (a view of the caller's result, aliasing no input)."""
        return _noncausal_bwd_slab(self.xp, pq, pk, v, g, winv, sketch, sum_chunk, dv_out)

    def causal_bwd(self, pq, pk, v, g, winv, D, C, dv_out, prefix=None):
        """Causal ``(dphi_q, dphi_k)`` of one slab (:func:`_causal_bwd_slab`; ``D (S, group, N)`` the
        denominators that ``winv`` inverts); the values' gradient is written into ``dv_out (S, N, dv)``
        (a view of the caller's result, aliasing no input).  ``prefix``: the slab's
        :class:`PrefixStates` where :meth:`attend` returned them (unused by the array form, which
        makes its own at chunks of ``C``)."""
        dpq, dpk, dv_out[...] = _causal_bwd_slab(self.xp, self, pq, pk, v, g, winv, C, _tril(self.xp, C, pk.dtype))
        return dpq, dpk


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


def _sum_chunks(xp, phi, w, C, dtype):
    """``sum_n phi_n w_n^T`` of ``phi (S, N, F)`` and ``w (S, N, E)`` (``w = None``: a column of ones)
    in chunks of ``C`` rows summed in float64: ``(S, F, E)`` (``(S, F)`` for ones) in ``dtype``."""
    pc = _chunks(xp, phi, C)
    part = pc.sum(axis=2) if w is None else xp.swapaxes(pc, -1, -2) @ _chunks(xp, w, C)
    return part.sum(axis=1, dtype=np.float64).astype(dtype)


def _sketch(xp, pk, v, C, dtype):
    """The non-causal sketch of ``pk (S, N, F)`` and ``v (S, N, dv)`` packed as ``(S, F, dv + 1)``:
    ``B = sum_n pk_n v_n^T`` in columns ``:dv`` and ``A = sum_n pk_n`` in column ``dv``."""
    S, _, F = pk.shape
    dv = v.shape[-1]
    sketch = xp.empty((S, F, dv + 1), dtype)
    sketch[..., :dv] = _sum_chunks(xp, pk, v, C, dtype)
    sketch[..., dv] = _sum_chunks(xp, pk, None, C, dtype)
    return sketch


def _exclusive_scan(xp, part, reverse, dtype):
    """Exclusive prefix (``reverse``: suffix) sums over axis 1 of ``part (S, nc, ...)``, in float64."""
    out = xp.zeros(part.shape, np.float64)
    if part.shape[1] > 1:
        if reverse:
            out[:, :-1] = xp.cumsum(part[:, ::-1][:, :-1], axis=1, dtype=np.float64)[:, ::-1]
        else:
            out[:, 1:] = xp.cumsum(part[:, :-1], axis=1, dtype=np.float64)
    return out.astype(dtype)


def _sum_group(x):
    """``x (S, group, ...)`` summed over its query heads (axis 1); no copy for one head."""
    return x[:, 0] if x.shape[1] == 1 else x.sum(axis=1)


def _tril(xp, C, dtype):
    return xp.asarray(np.tril(np.ones((C, C), dtype)))


def slab_heads(Gk, per_head_bytes, workspace):
    """Key/value heads per slab: as many as keep ``per_head_bytes`` each within ``workspace`` (at least 1)."""
    return max(1, min(Gk, int(workspace // max(per_head_bytes, 1))))


# ---------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------

def forward(xp, q, k, v, planes, beta, *, causal, key_mask=None, group=1, chunk=64, sum_chunk=1024,
            workspace=2 ** 31, out_dtype=None, ops=None):
    """RACE attention (ratio estimator): ``(out, residuals)``.

    Parameters
    ----------
    xp : array module (numpy or cupy)
    q : (G, Nq, d); k : (Gk, Nk, d); v : (Gk, Nk, dv), ``G = Gk * group``; C-contiguous, any float
        dtype (16-bit ones are widened to float32 one slab at a time).  Causal needs ``Nq == Nk``.
    planes : (L, P, d) in the compute dtype (float32, or float64 for float64 inputs)
    key_mask : (Gk, Nk) bool or None
    chunk : tokens per chunk of the causal scan; sum_chunk : rows per float32 partial of the
        non-causal sketch (summed in float64)
    workspace : bytes of temporaries a slab of key/value heads may use
    out_dtype : dtype of ``out`` (default: the compute dtype)
    ops : :class:`ArrayOps` (default ``ArrayOps(xp)``): the hash and the scans

    Returns
    -------
    out : (G, Nq, dv) of ``out_dtype``; a fresh array, aliasing no input.
    residuals : dict of ``phiq (G, Nq, F)``, ``tq``, ``phik (Gk, Nk, F)``, ``tk``, ``D (G, Nq)``,
        non-causal ``sketch (Gk, F, dv + 1)`` (None when causal; compute dtype), causal
        ``prefix`` (:class:`PrefixStates` of all ``Gk`` heads where ``ops.attend`` kept them, else
        None) and the scalars; ``v`` is kept by reference.
    """
    ops = ops or ArrayOps(xp)
    cdt = np.dtype(planes.dtype)
    G, nq, d = q.shape
    Gk, nk, dv = v.shape
    L, P, _ = planes.shape
    F = L * 2 ** P
    out = xp.empty((G, nq, dv), out_dtype or cdt)
    phiq = xp.empty((G, nq, F), cdt)
    tq = xp.empty((G, nq, L * P), cdt)
    phik = xp.empty((Gk, nk, F), cdt)
    tk = xp.empty((Gk, nk, L * P), cdt)
    D = xp.empty((G, nq), cdt)
    sketch = None if causal else xp.empty((Gk, F, dv + 1), cdt)
    prefix = None
    n = max(nq, nk)
    per_head = cdt.itemsize * (group * n * (chunk + 3 * dv + 2 * F) + n * (d + dv + F)
                               + 3 * (n // chunk + 1) * F * (dv + 1))
    hs = slab_heads(Gk, per_head, workspace)
    for g0 in range(0, Gk, hs):
        g1 = min(Gk, g0 + hs)
        h0, h1 = g0 * group, g1 * group
        S = g1 - g0
        # written into the residuals themselves: a copy of phi and t per slab was ~2 % of a
        # causal forward+backward on the GPU
        pk, _ = ops.soft_hash(k[g0:g1].astype(cdt, copy=False), planes, beta, phi_out=phik[g0:g1], t_out=tk[g0:g1])
        if key_mask is not None:
            pk *= key_mask[g0:g1, :, None]
        pq, _ = ops.soft_hash(q[h0:h1].astype(cdt, copy=False), planes, beta, phi_out=phiq[h0:h1], t_out=tq[h0:h1])
        vs = v[g0:g1].astype(cdt, copy=False)
        sk = ops.attend(pq.reshape(S, group, nq, F), pk, vs, causal, chunk, sum_chunk, L, out[h0:h1], D[h0:h1])
        if not causal:
            sketch[g0:g1] = sk
        elif isinstance(sk, PrefixStates):
            if g0 == 0 and g1 == Gk:
                prefix = sk
            else:
                if prefix is None:
                    prefix = PrefixStates(xp.empty((Gk,) + sk.states.shape[1:], cdt), sk.chunk)
                prefix.states[g0:g1] = sk.states
    return out, dict(phiq=phiq, tq=tq, phik=phik, tk=tk, D=D, sketch=sketch, prefix=prefix, v=v, planes=planes,
                     beta=beta, causal=causal, group=group, chunk=chunk, sum_chunk=sum_chunk, workspace=workspace)


def _noncausal_readout(xp, pq, sketch, L, out, D):
    """``out[...] = (phi_q / D) B`` and ``D[...] = phi_q . A`` from the packed ``sketch (S, F, dv + 1)``
    (``pq (S, group, nq, F)``; ``out (S * group, nq, dv)``, ``D (S * group, nq)`` views to write).
    The 1 / D scales the F-wide rows before the product, which then writes ``out`` itself where it
    is in the compute dtype: no dv-wide temporary, no second pass over it.  Batched products of
    ``(S, group * nq, F)`` rows against ``(S, F, .)`` (no broadcast batch axes under ``out=``)."""
    S, group, nq, F = pq.shape
    dv = sketch.shape[-1] - 1
    rows = pq.reshape(S, group * nq, F)
    Dn = (rows @ sketch[:, :, dv:])[..., 0]                         # (S, group * nq)
    D[...] = Dn.reshape(S * group, nq)
    pw = rows * _inverse(xp, Dn, L)[..., None]
    dst = out.reshape(S, group * nq, dv)
    if out.dtype == pq.dtype:
        xp.matmul(pw, sketch[..., :dv], out=dst)
    else:
        dst[...] = pw @ sketch[..., :dv]


def _inverse(xp, Dn, L):
    """``1 / D``, and 0 where ``den = D / L <= DEN_FLOOR`` (those queries output 0 and pass nothing back)."""
    keep = Dn > L * DEN_FLOOR
    return keep / xp.where(keep, Dn, 1)


def _causal_fwd_slab(xp, ops, pq, pk, v, C, mask_c):
    """Causal numerators and ``D`` of one slab: ``pq (S, group, N, F)``, ``pk (S, N, F)``, ``v (S, N, dv)``."""
    S, group, N, F = pq.shape
    cdt = pk.dtype
    kc, vc, Bp, Ap = _prefix_states(xp, ops, pk, v, C, cdt)
    nc = kc.shape[1]
    qc = _chunks(xp, pq.reshape(S * group, N, F), C).reshape(S, group, nc, C, F)
    M = qc @ xp.swapaxes(kc, -1, -2)[:, None]    # (S, group, nc, C, C): phi_q . phi_k within the chunk
    M *= mask_c
    num = qc @ Bp[:, None]
    num += M @ vc[:, None]
    Dn = (qc @ Ap[:, None, :, :, None])[..., 0] + M.sum(axis=-1)
    dv = v.shape[-1]
    return num.reshape(S, group, nc * C, dv)[:, :, :N], Dn.reshape(S, group, nc * C)[:, :, :N]


def _prefix_states(xp, ops, pk, v, C, cdt):
    """The chunks of ``pk``, ``v`` and the state ``(B, A)`` every chunk starts from (exclusive, float64 scan)."""
    kc = _chunks(xp, pk, C)                      # (S, nc, C, F)
    vc = _chunks(xp, v, C)                       # (S, nc, C, dv)
    S, nc, _, F = kc.shape
    dv = vc.shape[-1]
    Bc = xp.swapaxes(kc, -1, -2) @ vc            # (S, nc, F, dv)
    Bp = ops.exclusive_scan(Bc.reshape(S, nc, F * dv), False, cdt).reshape(S, nc, F, dv)
    Ap = ops.exclusive_scan(kc.sum(axis=2), False, cdt)                  # (S, nc, F)
    return kc, vc, Bp, Ap


# ---------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------

def backward(xp, res, grad, *, q=None, k=None, ops=None, grad_dtypes=None):
    """Gradients of :func:`forward`: ``(dq, dk, dv, dbeta)``, and ``dplanes`` when ``q`` and ``k`` are given.

    ``grad (G, Nq, dv)`` (any float dtype); ``dq (G, Nq, d)``, ``dk (Gk, Nk, d)``,
    ``dv (Gk, Nk, dv)`` in ``grad_dtypes`` (three dtypes; default: the compute dtype), fresh
    arrays (the key/value gradients summed over each key/value head's query heads); ``dbeta`` a
    Python float; ``dplanes (L, P, d)``.  A gradient of another dtype than the compute dtype is
    computed in the compute dtype and cast: a slab at a time where the heads take several slabs
    (16-bit gradients of a long sequence never exist whole in float32), else once at the end
    (then the result of another dtype is not allocated beside the slab's temporaries).
    """
    ops = ops or ArrayOps(xp)
    planes, beta, group, C = res["planes"], res["beta"], res["group"], res["chunk"]
    phiq, tq, phik, tk, D, v = res["phiq"], res["tq"], res["phik"], res["tk"], res["D"], res["v"]
    cdt = np.dtype(phiq.dtype)
    G, nq, F = phiq.shape
    Gk, nk, dv = v.shape
    L, P, d = planes.shape
    W2 = planes.reshape(L * P, d)
    want_dw = q is not None
    dW = xp.zeros((L * P, d), cdt) if want_dw else None
    dbeta = 0.0
    n = max(nq, nk)
    per_head = cdt.itemsize * (group * n * (3 * C + 2 * dv + 4 * F) + n * (2 * dv + 2 * F)
                               + 4 * (n // C + 1) * F * (dv + 1))
    hs = slab_heads(Gk, per_head, res["workspace"])
    want = (cdt,) * 3 if grad_dtypes is None else tuple(np.dtype(t) for t in grad_dtypes)
    qdt, kdt, vdt = want if hs < Gk else (cdt,) * 3
    dq = xp.empty((G, nq, d), qdt)
    dk = xp.empty((Gk, nk, d), kdt)
    dV = xp.empty((Gk, nk, dv), vdt)
    for g0 in range(0, Gk, hs):
        g1 = min(Gk, g0 + hs)
        h0, h1 = g0 * group, g1 * group
        S = g1 - g0
        g = grad[h0:h1].astype(cdt, copy=False).reshape(S, group, nq, dv)
        winv = _inverse(xp, D[h0:h1], L).reshape(S, group, nq)   # 1 / D, 0 on floored rows
        pq = phiq[h0:h1].reshape(S, group, nq, F)
        pk = phik[g0:g1]
        vs = v[g0:g1].astype(cdt, copy=False)
        dq_s, dk_s, dv_s = (_in_cdt(xp, x[a:b], cdt) for x, a, b in ((dq, h0, h1), (dk, g0, g1), (dV, g0, g1)))
        if res["causal"]:
            prefix = res.get("prefix")
            if prefix is not None:
                prefix = PrefixStates(prefix.states[g0:g1], prefix.chunk)
            dpq, dpk = ops.causal_bwd(pq, pk, vs, g, winv, D[h0:h1].reshape(S, group, nq), C, dv_s,
                                      prefix=prefix)
        else:
            dpq, dpk = ops.noncausal_bwd(pq, pk, vs, g, winv, res["sketch"][g0:g1], res["sum_chunk"], dv_s)
        rows_q = (dpq.reshape(S * group * nq, F), phiq[h0:h1].reshape(-1, F), tq[h0:h1].reshape(-1, L * P))
        rows_k = (dpk.reshape(S * nk, F), pk.reshape(-1, F), tk[g0:g1].reshape(-1, L * P))
        if want_dw:  # the planes' gradient needs the projections' cotangents themselves
            duq, dbq = ops.hash_du(*rows_q, beta, L, P)
            duk, dbk = ops.hash_du(*rows_k, beta, L, P)
            xp.matmul(duq, W2, out=dq_s.reshape(-1, d))
            xp.matmul(duk, W2, out=dk_s.reshape(-1, d))
            dW += duq.T @ q[h0:h1].astype(cdt, copy=False).reshape(-1, d)
            dW += duk.T @ k[g0:g1].astype(cdt, copy=False).reshape(-1, d)
        else:
            dbq = ops.hash_dx(*rows_q, planes, beta, dq_s.reshape(-1, d))
            dbk = ops.hash_dx(*rows_k, planes, beta, dk_s.reshape(-1, d))
        dbeta += float(dbq) + float(dbk)
        for x, a, b, x_s in ((dq, h0, h1, dq_s), (dk, g0, g1, dk_s), (dV, g0, g1, dv_s)):
            if x.dtype != cdt:
                x[a:b] = x_s   # the slab's gradient cast into its place
    dq, dk, dV = (x.astype(t, copy=False) for x, t in zip((dq, dk, dV), want))
    return (dq, dk, dV, dbeta) + ((dW.reshape(L, P, d),) if want_dw else ())


def _in_cdt(xp, out_slab, cdt):
    """Where a slab's gradient is computed: ``out_slab`` itself (a view of the result) in the
    compute dtype, else a fresh array of its shape in ``cdt`` that the caller casts into it."""
    return out_slab if out_slab.dtype == cdt else xp.empty(out_slab.shape, cdt)


def _noncausal_bwd_slab(xp, pq, pk, v, g, winv, sketch, sum_chunk, dv_out):
    """Non-causal ``(dphi_q, dphi_k)`` of one slab (``pq (S, group, N, F)``, ``g (S, group, N, dv)``,
    ``winv = 1 / D`` ``(S, group, N)``, the forward's ``sketch (S, F, dv + 1)``); the values'
    gradient is written into ``dv_out (S, N, dv)``."""
    S, group, nq, F = pq.shape
    cdt = pk.dtype
    B, A = sketch[..., :-1], sketch[..., -1]
    Y = g @ xp.swapaxes(B, -1, -2)[:, None]       # (S, group, nq, F): B g_i
    dD = -(pq * Y).sum(axis=-1) * winv * winv     # -(g_i . num_i) / D_i^2
    Y *= winv[..., None]
    dpq = Y + dD[..., None] * A[:, None, None, :]
    pw = (pq * winv[..., None]).reshape(S, group * nq, F)   # phi_q / D: scales F columns, not dv
    dB = _sum_chunks(xp, pw, g.reshape(S, group * nq, -1), sum_chunk, cdt)     # (S, F, dv)
    dA = _sum_chunks(xp, pq.reshape(S, group * nq, F), dD.reshape(S, group * nq, 1), sum_chunk, cdt)[..., 0]
    dpk = v @ xp.swapaxes(dB, -1, -2) + dA[:, None, :]
    xp.matmul(pk, dB, out=dv_out)
    return dpq, dpk


def _causal_bwd_slab(xp, ops, pq, pk, v, g, winv, C, mask_c):
    """Causal ``(dphi_q, dphi_k, dv)`` of one slab (shapes as :func:`_noncausal_bwd_slab`).

    ``1 / D`` scales the F-wide rows of phi_q and the C x C matrices, never the dv-wide
    rows of ``g``, so no (N, dv) temporary is made beside the gradients themselves.
    """
    S, group, N, F = pq.shape
    dv = v.shape[-1]
    cdt = pk.dtype
    kc, vc, Bp, Ap = _prefix_states(xp, ops, pk, v, C, cdt)    # the prefix states, as the forward
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
    # suffix sums of (dB, dA) over later chunks, summed over the query heads of the group
    qw = xp.swapaxes(qc * wc, -1, -2)                            # (phi_q / D)^T: (S, group, nc, F, C)
    dBc = _sum_group(qw @ gc)                                    # (S, nc, F, dv)
    dAc = _sum_group((xp.swapaxes(qc, -1, -2) @ dD)[..., 0])     # (S, nc, F)
    dBn = ops.exclusive_scan(dBc.reshape(S, nc, F * dv), True, cdt).reshape(S, nc, F, dv)
    dAn = ops.exclusive_scan(dAc, True, cdt)
    dpk = vc @ xp.swapaxes(dBn, -1, -2) + dAn[:, :, None, :] + _sum_group(xp.swapaxes(Dm, -1, -2) @ qc)
    M *= wc                                                      # M_ij / D_i
    dvs = kc @ dBn
    dvs += _sum_group(xp.swapaxes(M, -1, -2) @ gc)
    return (dpq.reshape(S, group, nc * C, F)[:, :, :N], dpk.reshape(S, nc * C, F)[:, :N],
            dvs.reshape(S, nc * C, dv)[:, :N])

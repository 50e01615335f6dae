"""Plain NumPy O(N^2) statements of the attentions racecpu approximates.

These are the oracles of the test-suite and the baselines of benchmarks and
training.  They build the full (Nq, Nk) similarity matrix, so they are meant
for small N.  Every function works on ``(..., N, d)`` arrays with any leading
batch/head dims, computes in the inputs' float dtype (float32 or float64), and
has a ``*_fwd`` returning ``(out, residuals)`` and a ``*_bwd(residuals, grad_out)``.

All three are *normalised similarity attention* (the paper's Eq. for O_i)::

    O_i = sum_j S_ij V_j / sum_j S_ij

with ``S`` the softmax, the sharpened angular or the RACE kernel.  A row whose
similarity mass is ``<= DEN_FLOOR`` (no visible key) outputs zeros.

:func:`race_attention_bucket_mean` is the exception: not normalised similarity
attention but the estimator of the authors' released code (a mean per bucket,
then a query-weighted sum over buckets and tables); see its docstring.

The RACE kernel here is written independently of the library's kernels: the
soft hash is an explicit softmax over the 2**P corners (not the logistic
factorisation) and the kernel matrix is materialised.
"""

from __future__ import annotations

import numpy as np

from .hashing import DEN_FLOOR, corners

__all__ = [
    "softmax_attention", "softmax_attention_fwd", "softmax_attention_bwd",
    "angular_attention", "angular_attention_fwd", "angular_attention_bwd",
    "race_attention_dense", "race_attention_dense_fwd", "race_attention_dense_bwd",
    "race_kernel_dense", "soft_buckets_dense", "soft_buckets_dense_bwd", "float_dtype",
    "race_attention_bucket_mean", "race_attention_bucket_mean_fwd", "race_attention_bucket_mean_bwd",
]

# Derivative of arccos is singular at cos = +-1; clamp 1 - cos^2 there.
_ACOS_EPS = 1e-12


def float_dtype(*arrays):
    """The dtype the references compute in: float32 for float16/float32, float64 otherwise."""
    dt = np.result_type(*arrays)
    if dt.kind != "f":
        raise TypeError(f"reference attention needs float arrays, got {dt}")
    return np.float32 if dt.itemsize <= 4 else np.float64


def _visibility(nq, nk, causal, key_mask, lead, dt):
    """(..., Nq, Nk) 0/1 matrix of which keys each query may see."""
    vis = np.ones(lead + (nq, nk), dtype=dt)
    if causal:
        if nq != nk:
            raise ValueError(f"causal attention needs Nq == Nk, got {nq} and {nk}")
        vis = vis * np.tril(np.ones((nq, nk), dtype=dt))
    if key_mask is not None:
        vis = vis * np.asarray(key_mask, dtype=bool)[..., None, :].astype(dt)
    return vis


# --------------------------------------------------------------------------
# normalised attention from a similarity matrix (shared by all three)
# --------------------------------------------------------------------------

def _normalized_fwd(S, v):
    den = S.sum(-1)
    valid = den > DEN_FLOOR
    safe = np.where(valid, den, 1)
    out = np.where(valid[..., None], (S @ v) / safe[..., None], 0).astype(v.dtype)
    return out, (S, v, safe, valid, out)


def _normalized_bwd(res, g):
    """Gradients w.r.t. the similarity matrix S and the values V."""
    S, v, safe, valid, out = res
    dnum = np.where(valid[..., None], g / safe[..., None], 0)
    dden = -np.where(valid, (g * out).sum(-1) / safe, 0)
    dS = dnum @ np.swapaxes(v, -1, -2) + dden[..., None]
    dv = np.swapaxes(S, -1, -2) @ dnum
    return dS, dv


# --------------------------------------------------------------------------
# softmax attention
# --------------------------------------------------------------------------

def softmax_attention_fwd(q, k, v, *, causal=False, scale=None, key_mask=None):
    """Softmax attention ``softmax(scale * q k^T) v``; returns ``(out, residuals)``."""
    dt = float_dtype(q, k, v)
    q, k, v = (np.asarray(a, dtype=dt) for a in (q, k, v))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else float(scale)
    vis = _visibility(q.shape[-2], k.shape[-2], causal, key_mask, np.broadcast_shapes(q.shape[:-2], k.shape[:-2]), dt)
    logits = scale * (q @ np.swapaxes(k, -1, -2))
    logits = np.where(vis > 0, logits, -np.inf)
    m = logits.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    S = np.exp(logits - m)  # un-normalised, max entry 1: den >= 1 if any key is visible
    out, nres = _normalized_fwd(S, v)
    return out, (q, k, scale, nres)


def softmax_attention_bwd(residuals, grad_out):
    """Returns ``(dq, dk, dv)``."""
    q, k, scale, nres = residuals
    S, _, safe, valid, _ = nres
    dS, dv = _normalized_bwd(nres, np.asarray(grad_out, dtype=q.dtype))
    # d logits = S * dS (S = exp(logits - m); the shift m cancels in the ratio).
    dlog = S * dS
    dq = scale * (dlog @ k)
    dk = scale * (np.swapaxes(dlog, -1, -2) @ q)
    return dq.astype(q.dtype), dk.astype(q.dtype), dv.astype(q.dtype)


def softmax_attention(q, k, v, *, causal=False, scale=None, key_mask=None):
    """Exact softmax attention; ``scale`` defaults to ``1/sqrt(d)``."""
    return softmax_attention_fwd(q, k, v, causal=causal, scale=scale, key_mask=key_mask)[0]


# --------------------------------------------------------------------------
# sharpened angular attention
# --------------------------------------------------------------------------

def _unit(x):
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    safe = np.where(n > 0, n, 1)
    return x / safe, safe, n > 0


def angular_attention_fwd(q, k, v, gamma, *, causal=False, key_mask=None):
    """Angular attention with ``S_ij = (1 - arccos(cos(q_i, k_j)) / pi) ** gamma``.

    Zero vectors have cosine 0 with everything.  Returns ``(out, residuals)``.
    """
    dt = float_dtype(q, k, v)
    q, k, v = (np.asarray(a, dtype=dt) for a in (q, k, v))
    gamma = float(gamma)
    qh, qn, _ = _unit(q)
    kh, kn, _ = _unit(k)
    C = np.clip(qh @ np.swapaxes(kh, -1, -2), -1.0, 1.0)
    base = 1.0 - np.arccos(C) / np.pi
    vis = _visibility(q.shape[-2], k.shape[-2], causal, key_mask, np.broadcast_shapes(q.shape[:-2], k.shape[:-2]), dt)
    S = (base ** gamma) * vis
    out, nres = _normalized_fwd(S, v)
    return out, (qh, qn, kh, kn, C, base, vis, gamma, nres)


def angular_attention_bwd(residuals, grad_out):
    """Returns ``(dq, dk, dv)``; d arccos is clamped where |cos| -> 1."""
    qh, qn, kh, kn, C, base, vis, gamma, nres = residuals
    dS, dv = _normalized_bwd(nres, np.asarray(grad_out, dtype=qh.dtype))
    dbase = gamma * base ** (gamma - 1) if gamma != 0 else np.zeros_like(base)
    dC = dS * vis * dbase / (np.pi * np.sqrt(np.maximum(1.0 - C * C, _ACOS_EPS)))
    # C = qh . kh with qh = q/|q|:  dq = (dC kh - (sum_j dC C) qh) / |q|
    dq = (dC @ kh - (dC * C).sum(-1, keepdims=True) * qh) / qn
    dCt = np.swapaxes(dC, -1, -2)
    dk = (dCt @ qh - (dCt * np.swapaxes(C, -1, -2)).sum(-1, keepdims=True) * kh) / kn
    dt = qh.dtype
    return dq.astype(dt), dk.astype(dt), dv.astype(dt)


def angular_attention(q, k, v, gamma, *, causal=False, key_mask=None):
    """Exact sharpened angular attention (the kernel RACE estimates with gamma = P)."""
    return angular_attention_fwd(q, k, v, gamma, causal=causal, key_mask=key_mask)[0]


# --------------------------------------------------------------------------
# RACE attention, dense
# --------------------------------------------------------------------------

def soft_buckets_dense(x, planes, beta, xp=np):
    """Soft hash as an explicit softmax over corners: ``(..., N, L, R)`` and ``t``
    (``x`` an array of the module ``xp``: NumPy, or CuPy for racecpu.cuda's per-bucket mean)."""
    planes = xp.asarray(planes, dtype=x.dtype)
    C = xp.asarray(corners(planes.shape[1]).astype(x.dtype))
    t = xp.tanh(xp.einsum("...nd,lpd->...nlp", x, planes))
    z = beta * (t @ C.T)
    z = z - z.max(-1, keepdims=True)
    e = xp.exp(z)
    return e / e.sum(-1, keepdims=True), t


def race_kernel_dense(q, k, planes, beta):
    """The RACE kernel matrix ``(1/L) sum_l phi_l(q_i) . phi_l(k_j)``, shape (..., Nq, Nk)."""
    dt = float_dtype(q, k)
    q, k = np.asarray(q, dtype=dt), np.asarray(k, dtype=dt)
    pq, _ = soft_buckets_dense(q, planes, beta)
    pk, _ = soft_buckets_dense(k, planes, beta)
    return np.einsum("...ilr,...jlr->...ij", pq, pk) / pq.shape[-2]


def race_attention_dense_fwd(q, k, v, planes, beta, *, causal=False, key_mask=None):
    """Dense RACE attention; returns ``(out, residuals)``."""
    dt = float_dtype(q, k, v)
    q, k, v = (np.asarray(a, dtype=dt) for a in (q, k, v))
    beta = float(beta)
    planes = np.asarray(planes, dtype=dt)
    pq, tq = soft_buckets_dense(q, planes, beta)
    pk, tk = soft_buckets_dense(k, planes, beta)
    L = planes.shape[0]
    vis = _visibility(q.shape[-2], k.shape[-2], causal, key_mask, np.broadcast_shapes(q.shape[:-2], k.shape[:-2]), dt)
    S = np.einsum("...ilr,...jlr->...ij", pq, pk) / L * vis
    out, nres = _normalized_fwd(S, v)
    return out, (planes, beta, pq, tq, pk, tk, vis, nres, q, k)


def soft_buckets_dense_bwd(dphi, phi, t, planes, beta, x=None, xp=np):
    """Back through softmax over corners, tanh and the projection: ``(dx, dbeta)``,
    and with the rows ``x (..., N, d)`` also the planes' gradient
    ``dW_l = sum_n du_{n,l} x_n^T`` (shape of ``planes``, summed over every
    leading axis): ``(dx, dbeta, dW)``.  Arrays of the module ``xp`` (as
    :func:`soft_buckets_dense`)."""
    C = xp.asarray(corners(planes.shape[1]).astype(phi.dtype))
    dz = phi * (dphi - (phi * dphi).sum(-1, keepdims=True))
    s = dz @ C  # (..., N, L, P)
    du = beta * s * (1 - t * t)
    dx = xp.einsum("...nlp,lpd->...nd", du, planes)
    if x is None:
        return dx, float((s * t).sum())
    x = xp.broadcast_to(x, du.shape[:-2] + x.shape[-1:])
    dW = (du.reshape(-1, t.shape[-2] * t.shape[-1]).T @ x.reshape(-1, x.shape[-1])).reshape(planes.shape)
    return dx, float((s * t).sum()), dW


def race_attention_dense_bwd(residuals, grad_out, *, dplanes=False):
    """Returns ``(dq, dk, dv, dbeta)`` with ``dbeta`` summed over everything,
    and with ``dplanes=True`` also the planes' gradient ``(L, P, d)``
    (summed over everything, the queries' and the keys' shares)."""
    planes, beta, pq, tq, pk, tk, vis, nres, q, k = residuals
    L = planes.shape[0]
    dS, dv = _normalized_bwd(nres, np.asarray(grad_out, dtype=pq.dtype))
    dS = dS * vis / L
    dpq = np.einsum("...ij,...jlr->...ilr", dS, pk)
    dpk = np.einsum("...ij,...ilr->...jlr", dS, pq)
    dq, db_q, *dw_q = soft_buckets_dense_bwd(dpq, pq, tq, planes, beta, q if dplanes else None)
    dk, db_k, *dw_k = soft_buckets_dense_bwd(dpk, pk, tk, planes, beta, k if dplanes else None)
    dt = pq.dtype
    grads = dq.astype(dt), dk.astype(dt), dv.astype(dt), db_q + db_k
    return grads + ((dw_q[0] + dw_k[0]).astype(dt),) if dplanes else grads


def race_attention_dense(q, k, v, planes, beta, *, causal=False, key_mask=None):
    """Dense O(N^2) RACE attention: the oracle of the fast kernels."""
    return race_attention_dense_fwd(q, k, v, planes, beta, causal=causal, key_mask=key_mask)[0]


# --------------------------------------------------------------------------
# RACE attention, per-bucket mean (the estimator of the authors' released code)
# --------------------------------------------------------------------------

def race_attention_bucket_mean_fwd(q, k, v, planes, beta, *, causal=False, key_mask=None, eps=1e-6):
    """Per-bucket-mean RACE attention; returns ``(out, residuals)``.

    See :func:`race_attention_bucket_mean`.  Written through the (Nq, Nk)
    matrix ``S_ij = vis_ij sum_{l,r} phi_l(q_i)_r phi_l(k_j)_r / (A_ilr + eps)``,
    so that ``out = S @ v``; ``A_ilr = sum_j vis_ij phi_l(k_j)_r``.
    """
    dt = float_dtype(q, k, v)
    q, k, v = (np.asarray(a, dtype=dt) for a in (q, k, v))
    beta, eps = float(beta), float(eps)
    planes = np.asarray(planes, dtype=dt)
    pq, tq = soft_buckets_dense(q, planes, beta)
    pk, tk = soft_buckets_dense(k, planes, beta)
    vis = _visibility(q.shape[-2], k.shape[-2], causal, key_mask, np.broadcast_shapes(q.shape[:-2], k.shape[:-2]), dt)
    den = np.einsum("...ij,...jlr->...ilr", vis, pk) + eps  # A + eps, per query (one row when not causal)
    W = pq / den
    S = np.einsum("...ilr,...jlr->...ij", W, pk) * vis
    out = (S @ v).astype(dt)
    return out, (planes, beta, pq, tq, pk, tk, vis, den, W, S, v)


def race_attention_bucket_mean_bwd(residuals, grad_out):
    """Returns ``(dq, dk, dv, dbeta)`` with ``dbeta`` summed over everything."""
    planes, beta, pq, tq, pk, tk, vis, den, W, S, v = residuals
    g = np.asarray(grad_out, dtype=pq.dtype)
    dv = np.swapaxes(S, -1, -2) @ g
    dS = (g @ np.swapaxes(v, -1, -2)) * vis
    dW = np.einsum("...ij,...jlr->...ilr", dS, pk)
    dpk = np.einsum("...ij,...ilr->...jlr", dS, W)
    dpq = dW / den
    dA = -dW * W / den                                   # W = pq / (A + eps)
    dpk = dpk + np.einsum("...ij,...ilr->...jlr", vis, dA)  # A_ilr = sum_j vis_ij pk_jlr
    dq, db_q = soft_buckets_dense_bwd(dpq, pq, tq, planes, beta)
    dk, db_k = soft_buckets_dense_bwd(dpk, pk, tk, planes, beta)
    dt = pq.dtype
    return dq.astype(dt), dk.astype(dt), dv.astype(dt), db_q + db_k


def race_attention_bucket_mean(q, k, v, planes, beta, *, causal=False, key_mask=None, eps=1e-6):
    """RACE attention as the authors' released code computes it: a mean per bucket, summed over tables.

    For every table ``l`` and bucket ``r`` the keys a query sees are pooled
    into a soft count and a soft sum of values,

        A_lr = sum_j phi_l(k_j)_r,        B_lr = sum_j phi_l(k_j)_r v_j,

    each bucket's mean value ``B_lr / (A_lr + eps)`` is formed first, and the
    query then weights the bucket means by its own soft bucket memberships and
    adds them over buckets *and tables*:

        out_i = sum_l sum_r phi_l(q_i)_r B_lr / (A_lr + eps).

    There is no 1/L: the tables are summed, so the output grows with L (as
    beta -> 0 every phi is uniform and ``out_i -> L * mean_j v_j``; as
    beta -> inf phi is a hard SimHash bucket and table ``l`` contributes the
    mean of the values of the keys in q_i's bucket, or 0 if it is empty).
    The paper's estimator (Algorithms 1 and 2, :func:`race_attention_dense`)
    instead divides the sums over tables, ``sum_l phi_l(q).B_l /
    sum_l phi_l(q).A_l``; the two differ even as L grows.  Causal: ``A`` and
    ``B`` are prefix sums over the keys ``j <= i`` (the current token
    included), so they are per query.  Masked keys (``key_mask`` False) add
    nothing to ``A`` or ``B``.  A query that sees no key outputs zeros.

    The soft hash is racecpu's (:func:`soft_buckets_dense`): a softmax over
    the 2**P corners (``itertools.product([-1, 1], repeat=P)`` order) of
    ``beta * tanh(W_l x)``; q and k are used as given (not normalised).
    As issue 43 reads the released code: Gaussian planes drawn as one
    (L*P, d) matrix (ours are (L, P, d); reshaping theirs assumes their rows
    are grouped table by table), ``eps = 1e-6``, ``beta = 1/sqrt(d)`` fixed in
    the causal code, a learnable scalar starting at 1 elsewhere.

    Parameters
    ----------
    q : ndarray, shape (..., Nq, d), float32 or float64
    k : ndarray, shape (..., Nk, d)
    v : ndarray, shape (..., Nk, dv)
        Leading dims broadcast; computed in the inputs' float dtype.
    planes : ndarray, shape (L, P, d)
    beta : float
    causal : bool
        Needs ``Nq == Nk``.
    key_mask : bool ndarray, shape (..., Nk), optional
    eps : float
        Added to every bucket's soft count.

    Returns
    -------
    out : ndarray, shape (..., Nq, dv)

    Notes
    -----
    O(Nq Nk L 2**P) time and O(Nq Nk + Nq L 2**P) memory: an oracle for
    small N.
    """
    return race_attention_bucket_mean_fwd(q, k, v, planes, beta, causal=causal, key_mask=key_mask, eps=eps)[0]

"""Ops of :mod:`racecpu.autograd` that are not Tensor methods.

Normalisations and losses (``softmax``, ``log_softmax``, ``layer_norm``,
``embedding``, ``cross_entropy``, ``dropout``), the attention ops, and
``check_grad``.  The attention ops call the library's own forward/backward
pairs (:func:`racecpu.race_attention_fwd` / :func:`racecpu.race_attention_bwd`
and the O(N^2) oracles of :mod:`racecpu.reference`); only linear attention,
which the library does not have, is written out here.
"""

from __future__ import annotations

import numpy as np

from .. import bucket_mean as _bm
from .. import reference as _ref
from ..attention import race_attention_bwd, race_attention_fwd
from ..hashing import DEFAULT_BETA, DEN_FLOOR
from .tensor import Tensor, as_tensor, no_grad, op

__all__ = [
    "softmax", "log_softmax", "layer_norm", "embedding", "cross_entropy", "dropout", "causal_conv1d",
    "race_attention", "race_attention_bucket_mean", "softmax_attention", "angular_attention", "linear_attention",
    "check_grad",
]


# ---------------------------------------------------------------------------
# normalisations, embedding, losses
# ---------------------------------------------------------------------------

def softmax(x, axis=-1):
    """Softmax along ``axis``."""
    x = as_tensor(x)
    e = np.exp(x.data - x.data.max(axis=axis, keepdims=True))
    y = e / e.sum(axis=axis, keepdims=True)
    return op(y, (x,), lambda g: (y * (g - (g * y).sum(axis=axis, keepdims=True)),))


def log_softmax(x, axis=-1):
    """``x - logsumexp(x)`` along ``axis``."""
    x = as_tensor(x)
    m = x.data.max(axis=axis, keepdims=True)
    y = x.data - (m + np.log(np.exp(x.data - m).sum(axis=axis, keepdims=True)))
    return op(y, (x,), lambda g: (g - np.exp(y) * g.sum(axis=axis, keepdims=True),))


def layer_norm(x, weight=None, bias=None, eps=1e-5):
    """Layer normalisation over the last axis, then ``* weight + bias`` (each optional)."""
    x = as_tensor(x)
    xd = x.data
    mu = xd.mean(-1, keepdims=True)
    xc = xd - mu
    rstd = 1.0 / np.sqrt((xc * xc).mean(-1, keepdims=True) + eps)
    xhat = xc * rstd
    w = None if weight is None else weight.data
    y = xhat if w is None else xhat * w
    if bias is not None:
        y = y + bias.data

    def vjp(g):
        gx = g if w is None else g * w
        dx = rstd * (gx - gx.mean(-1, keepdims=True) - xhat * (gx * xhat).mean(-1, keepdims=True))
        return dx, (None if w is None else g * xhat), g
    parents = (x, weight if weight is not None else Tensor(0.0), bias if bias is not None else Tensor(0.0))
    return op(y, parents, vjp)


def _int_index(name, idx, size=None):
    idx = idx.data if isinstance(idx, Tensor) else np.asarray(idx)
    if idx.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {idx.dtype}")
    if size is not None and idx.size and (idx.min() < 0 or idx.max() >= size):
        raise ValueError(f"{name} must lie in [0, {size}), got values in [{idx.min()}, {idx.max()}]")
    return idx


def embedding(weight, indices):
    """Rows ``weight[indices]``: int ``indices`` of any shape -> ``indices.shape + (d,)``."""
    idx = _int_index("indices", indices, weight.shape[0])
    shape, dtype = weight.shape, weight.dtype

    def vjp(g):
        z = np.zeros(shape, dtype)
        np.add.at(z, idx.ravel(), g.reshape(-1, shape[1]))
        return (z,)
    return op(weight.data[idx], (weight,), vjp)


def cross_entropy(logits, targets, ignore_index=-100):
    """Mean negative log-likelihood (nats) of int ``targets`` under ``softmax(logits)``.

    Parameters
    ----------
    logits : Tensor, shape (..., C)
    targets : int array, shape (...)
        Entries equal to ``ignore_index`` are left out of the mean.
    """
    logits = as_tensor(logits)
    t = _int_index("targets", targets)
    if t.shape != logits.shape[:-1]:
        raise ValueError(f"targets must have shape {logits.shape[:-1]} (logits without the class axis), got {t.shape}")
    C = logits.shape[-1]
    x = logits.data.reshape(-1, C)
    t = t.ravel()
    valid = t != ignore_index
    if valid.any() and (t[valid].min() < 0 or t[valid].max() >= C):
        raise ValueError(f"targets must lie in [0, {C}) or equal ignore_index={ignore_index}")
    n = max(int(valid.sum()), 1)
    tt = np.where(valid, t, 0)
    m = x.max(-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(-1))
    nll = (lse - x[np.arange(len(t)), tt]) * valid
    loss = np.asarray(nll.sum() / n, dtype=logits.dtype)

    def vjp(g):
        p = np.exp(x - lse[:, None])
        p[np.arange(len(t)), tt] -= 1
        p *= (valid * (g / n))[:, None]
        return (p.reshape(logits.shape),)
    return op(loss, (logits,), vjp)


def dropout(x, p, rng, training=True):
    """Inverted dropout: zero each entry with probability ``p``, scale the rest by ``1/(1-p)``.

    ``rng`` is a ``numpy.random.Generator`` (seeded by the caller).
    """
    if not 0 <= p < 1:
        raise ValueError(f"dropout probability p must be in [0, 1), got {p}")
    x = as_tensor(x)
    if not training or p == 0:
        return x
    keep = (rng.random(x.shape) >= p).astype(x.dtype) * (1.0 / (1 - p))
    return op(x.data * keep, (x,), lambda g: (g * keep,))


def causal_conv1d(x, weight):
    """Depthwise causal convolution along the token axis.

    ``y[..., t, c] = sum_i weight[i, c] * x[..., t - i, c]`` for ``i < K``
    (``x`` is zero before the first token), so position ``t`` sees only
    tokens ``t - K + 1 .. t``.  This is the "short convolution" that
    linear-attention models (H3, GLA, DeltaNet, Mamba) put on q, k, v.

    Parameters
    ----------
    x : Tensor, shape (..., N, C)
    weight : Tensor, shape (K, C)
        ``weight[0]`` multiplies the current token, ``weight[i]`` the token
        ``i`` steps back.
    """
    x, weight = as_tensor(x), as_tensor(weight)
    if weight.ndim != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must have shape (K, {x.shape[-1]}), got {weight.shape}")
    K, N = weight.shape[0], x.shape[-2]
    X, W = x.data, weight.data
    y = X * W[0]
    for i in range(1, min(K, N)):
        y[..., i:, :] += X[..., :-i, :] * W[i]

    def vjp(g):
        dx = g * W[0]
        dw = np.zeros_like(W)
        dw[0] = (g * X).reshape(-1, X.shape[-1]).sum(0)
        for i in range(1, min(K, N)):
            dx[..., :-i, :] += g[..., i:, :] * W[i]
            dw[i] = (g[..., i:, :] * X[..., :-i, :]).reshape(-1, X.shape[-1]).sum(0)
        return dx, dw
    return op(y, (x, weight), vjp)


# ---------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------

def race_attention(q, k, v, planes, beta=DEFAULT_BETA, *, causal=False, key_mask=None, cu_seqlens=None):
    """RACE attention (:func:`racecpu.race_attention`) as an autograd op.

    ``beta`` is a positive float, a scalar Tensor, or a Tensor of shape
    ``(H,)`` for inputs ``(B, H, N, d)`` (one temperature per head; the heads
    are then computed one at a time).  As a Tensor it receives the gradient
    :func:`racecpu.race_attention_bwd` returns (summed over the tokens, and
    over the heads for a scalar).  ``planes`` (L, P, d) are an array
    (constants, as in the paper) or a Tensor; a Tensor that requires grad
    receives the planes' gradient (``race_attention_bwd(..., dplanes=True)``,
    summed over every batch, head and token): learnable hash planes.
    ``cu_seqlens``: packed sequences, as :func:`racecpu.race_attention`'s.
    """
    q, k, v = as_tensor(q), as_tensor(k), as_tensor(v)
    planes_t = planes if isinstance(planes, Tensor) else None
    W = planes_t.data if planes_t is not None else planes
    learn = planes_t is not None and planes_t.requires_grad
    extra = (planes_t,) if learn else ()
    beta_t = beta if isinstance(beta, Tensor) else None
    if beta_t is not None and beta_t.ndim == 1 and q.ndim == 4 and beta_t.shape[0] == q.shape[1]:
        return _race_per_head(q, k, v, W, beta_t, causal, key_mask, extra, cu_seqlens)
    if beta_t is not None and beta_t.size != 1:
        raise ValueError(f"beta must be a scalar Tensor, or of shape (H,) for q of shape (B, H, N, d); got beta "
                         f"of shape {beta_t.shape} and q of shape {q.shape}")
    b = float(beta_t.data) if beta_t is not None else beta
    out, res = race_attention_fwd(q.data, k.data, v.data, W, b, causal=causal, key_mask=key_mask,
                                  cu_seqlens=cu_seqlens)

    def vjp(g):
        dq, dk, dv, dbeta, *dW = race_attention_bwd(res, g, dplanes=learn)
        dbeta = () if beta_t is None else (np.full(beta_t.shape, dbeta, dtype=beta_t.dtype),)
        return (dq, dk, dv) + dbeta + tuple(dW)
    return op(out, (q, k, v) + ((beta_t,) if beta_t is not None else ()) + extra, vjp)


def _race_per_head(q, k, v, planes, beta_t, causal, key_mask, extra=(), cu_seqlens=None):
    """Heads one at a time (one beta each); ``extra``: the planes' Tensor when it learns.
    Grouped-query k, v (fewer heads than q): query head h reads key/value head h // group."""
    H, Hk = q.shape[1], k.shape[1]
    if Hk < 1 or H % Hk or v.shape[1] != Hk:
        raise ValueError(f"k and v must have q's number of heads or one that divides it, got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    group = H // Hk
    outs, ress = [], []
    for h in range(H):
        m = None if key_mask is None else np.asarray(key_mask)[:, h // group]
        o, r = race_attention_fwd(q.data[:, h], k.data[:, h // group], v.data[:, h // group], planes,
                                  float(beta_t.data[h]), causal=causal, key_mask=m, cu_seqlens=cu_seqlens)
        outs.append(o)
        ress.append(r)

    def vjp(g):
        grads = [race_attention_bwd(r, np.ascontiguousarray(g[:, h]), dplanes=bool(extra))
                 for h, r in enumerate(ress)]
        dq = np.stack([gr[0] for gr in grads], axis=1)
        dk, dv = (np.stack([sum(grads[h][i] for h in range(j * group, (j + 1) * group)) for j in range(Hk)], axis=1)
                  for i in (1, 2))
        dW = (sum(gr[4] for gr in grads),) if extra else ()
        return (dq, dk, dv, np.array([gr[3] for gr in grads], dtype=beta_t.dtype)) + dW
    return op(np.stack(outs, axis=1), (q, k, v, beta_t) + extra, vjp)


def race_attention_bucket_mean(q, k, v, planes, beta=DEFAULT_BETA, *, causal=False, key_mask=None, eps=1e-6,
                               cu_seqlens=None):
    """Per-bucket-mean RACE attention (:func:`racecpu.bucket_mean.race_attention_bucket_mean`) as an op.

    The estimator of the authors' released code: ``out_i = sum_l sum_r
    phi_l(q_i)_r B_lr / (A_lr + eps)`` (no 1/L; prefix sums when causal).
    Linear in N (the per-bucket sums of :mod:`racecpu.bucket_mean`, equal
    to the O(N^2) oracle :func:`racecpu.reference.race_attention_bucket_mean`).  ``beta`` as in :func:`race_attention`: a positive float, a
    scalar Tensor, or a Tensor of shape ``(H,)`` for inputs ``(B, H, N, d)``;
    as a Tensor it receives its gradient.  ``planes``, as in :func:`race_attention`, are
    constants or a Tensor, which receives the planes' gradient when it requires grad.

    Parameters
    ----------
    q : Tensor, shape (..., Nq, d)
    k : Tensor, shape (..., Nk, d)
    v : Tensor, shape (..., Nk, dv)
    planes : ndarray or Tensor, shape (L, P, d)
    beta : float or Tensor
    causal : bool
    key_mask : bool ndarray, shape (..., Nk), optional
    eps : float
    cu_seqlens : int array_like, optional
        Packed sequences, as :func:`race_attention`'s.

    Returns
    -------
    Tensor, shape (..., Nq, dv), the inputs' dtype.
    """
    q, k, v = as_tensor(q), as_tensor(k), as_tensor(v)
    planes_t = planes if isinstance(planes, Tensor) else None
    learn = planes_t is not None and planes_t.requires_grad
    extra = (planes_t,) if learn else ()
    if planes_t is not None:
        planes = planes_t.data
    beta_t = beta if isinstance(beta, Tensor) else None
    per_head = beta_t is not None and beta_t.ndim == 1 and q.ndim == 4 and beta_t.shape[0] == q.shape[1]
    if beta_t is not None and beta_t.size != 1 and not per_head:
        raise ValueError(f"beta must be a scalar Tensor, or of shape (H,) for q of shape (B, H, N, d); got beta "
                         f"of shape {beta_t.shape} and q of shape {q.shape}")
    if per_head:
        H = q.shape[1]
        mask = None if key_mask is None else np.broadcast_to(np.asarray(key_mask), k.shape[:-1])
        fr = [_bm.race_attention_bucket_mean_fwd(q.data[:, h], k.data[:, h], v.data[:, h], planes,
                                                  float(beta_t.data[h]), causal=causal, eps=eps, cu_seqlens=cu_seqlens,
                                                  key_mask=None if mask is None else mask[:, h]) for h in range(H)]

        def vjp(g):
            grads = [_bm.race_attention_bucket_mean_bwd(r, g[:, h], learn) for h, (_, r) in enumerate(fr)]
            dq, dk, dv = (np.stack([gr[i] for gr in grads], axis=1) for i in range(3))
            dW = (sum(gr[4] for gr in grads).astype(planes_t.dtype),) if learn else ()
            return (dq, dk, dv, np.array([gr[3] for gr in grads], dtype=beta_t.dtype)) + dW
        return op(np.stack([o for o, _ in fr], axis=1), (q, k, v, beta_t) + extra, vjp)
    b = float(beta_t.data) if beta_t is not None else beta
    out, res = _bm.race_attention_bucket_mean_fwd(q.data, k.data, v.data, planes, b, causal=causal,
                                                   key_mask=key_mask, eps=eps, cu_seqlens=cu_seqlens)

    def vjp(g):
        dq, dk, dv, dbeta, *dW = _bm.race_attention_bucket_mean_bwd(res, g, learn)
        dbeta = () if beta_t is None else (np.full(beta_t.shape, dbeta, dtype=beta_t.dtype),)
        return (dq, dk, dv) + dbeta + tuple(w.astype(planes_t.dtype) for w in dW)
    return op(out, (q, k, v) + ((beta_t,) if beta_t is not None else ()) + extra, vjp)


def softmax_attention(q, k, v, *, causal=False, scale=None, key_mask=None):
    """Exact softmax attention (:func:`racecpu.reference.softmax_attention`) as an op."""
    q, k, v = as_tensor(q), as_tensor(k), as_tensor(v)
    out, res = _ref.softmax_attention_fwd(q.data, k.data, v.data, causal=causal, scale=scale, key_mask=key_mask)
    return op(out, (q, k, v), lambda g: _ref.softmax_attention_bwd(res, g))


def angular_attention(q, k, v, gamma, *, causal=False, key_mask=None):
    """Sharpened angular attention (:func:`racecpu.reference.angular_attention`) as an op."""
    q, k, v = as_tensor(q), as_tensor(k), as_tensor(v)
    out, res = _ref.angular_attention_fwd(q.data, k.data, v.data, gamma, causal=causal, key_mask=key_mask)
    return op(out, (q, k, v), lambda g: _ref.angular_attention_bwd(res, g))


def linear_attention(q, k, v, *, causal=False, key_mask=None, chunk=64):
    """Linear attention (Katharopoulos et al. 2020) with feature map ``elu(x) + 1``.

    ``O_i = f(q_i) . sum_j f(k_j) v_j^T / f(q_i) . sum_j f(k_j)`` over the keys
    ``j`` query ``i`` sees (``j <= i`` when causal).  The causal form is computed
    in chunks of ``chunk`` tokens: exact within a chunk, a carried
    ``sum_j f(k_j) v_j^T`` state across chunks, so time and memory are linear in N.
    """
    q, k, v = as_tensor(q), as_tensor(k), as_tensor(v)
    fq, fk = q.elu() + 1.0, k.elu() + 1.0
    if key_mask is not None:
        m = np.asarray(key_mask)
        if m.dtype != np.bool_ or m.shape != k.shape[:-1]:
            raise ValueError(f"key_mask must be a bool array of shape {k.shape[:-1]}, got {m.dtype} {m.shape}")
        fk = fk * m[..., None].astype(k.dtype)
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal attention needs Nq == Nk, got shapes q {q.shape} and k {k.shape}")
    return (_linear_causal if causal else _linear_full)(fq, fk, v, int(chunk))


def _guarded_ratio(num, den):
    valid = den > DEN_FLOOR
    safe = np.where(valid, den, 1)
    return np.where(valid[..., None], num / safe[..., None], 0).astype(num.dtype), safe, valid


def _ratio_bwd(g, out, safe, valid):
    """Cotangents of ``num`` and ``den`` from the cotangent of ``out = num / den``."""
    dnum = np.where(valid[..., None], g / safe[..., None], 0)
    dden = -np.where(valid, (g * out).sum(-1) / safe, 0)
    return dnum, dden


def _linear_full(fq, fk, v, _chunk):
    Q, K, V = fq.data, fk.data, v.data
    S = np.swapaxes(K, -1, -2) @ V            # (..., d, dv)
    z = K.sum(-2)                              # (..., d)
    out, safe, valid = _guarded_ratio(Q @ S, (Q * z[..., None, :]).sum(-1))

    def vjp(g):
        dnum, dden = _ratio_bwd(g, out, safe, valid)
        dQ = dnum @ np.swapaxes(S, -1, -2) + dden[..., None] * z[..., None, :]
        dS = np.swapaxes(Q, -1, -2) @ dnum
        dz = (Q * dden[..., None]).sum(-2)
        return dQ, V @ np.swapaxes(dS, -1, -2) + dz[..., None, :], K @ dS
    return op(out, (fq, fk, v), vjp)


def _exclusive_cumsum(x, axis, reverse=False):
    """``y[c] = sum_{c' < c} x[c']`` (``c' > c`` if reverse) along ``axis``, without subtraction."""
    if reverse:
        return np.flip(_exclusive_cumsum(np.flip(x, axis), axis), axis)
    x = np.moveaxis(x, axis, 0)
    y = np.zeros_like(x)
    np.cumsum(x[:-1], axis=0, out=y[1:])
    return np.moveaxis(y, 0, axis)


def _linear_causal(fq, fk, v, C):
    n = fq.shape[-2]
    nc = -(-n // C)
    pad = nc * C - n

    def blocks(x):  # (..., N, e) -> (..., nc, C, e), zero-padded (padded keys add nothing)
        x = np.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, pad), (0, 0)])
        return x.reshape(x.shape[:-2] + (nc, C, x.shape[-1]))

    Q, K, V = blocks(fq.data), blocks(fk.data), blocks(v.data)
    tri = np.tril(np.ones((C, C), dtype=Q.dtype))
    Kt = np.swapaxes(K, -1, -2)
    KV, Z = Kt @ V, K.sum(-2)                                  # per-chunk totals
    Sp, Zp = _exclusive_cumsum(KV, -3), _exclusive_cumsum(Z, -2)  # state before each chunk
    M = (Q @ Kt) * tri                                          # (..., nc, C, C) in-chunk scores
    num = Q @ Sp + M @ V
    den = (Q * Zp[..., None, :]).sum(-1) + M.sum(-1)
    out, safe, valid = _guarded_ratio(num, den)

    def unblock(x):
        return x.reshape(x.shape[:-3] + (nc * C, x.shape[-1]))[..., :n, :]

    def vjp(g):
        g = blocks(g)
        dnum, dden = _ratio_bwd(g, out, safe, valid)
        dM = (dnum @ np.swapaxes(V, -1, -2) + dden[..., None]) * tri
        dQ = dnum @ np.swapaxes(Sp, -1, -2) + dden[..., None] * Zp[..., None, :] + dM @ K
        dK = np.swapaxes(dM, -1, -2) @ Q
        dV = np.swapaxes(M, -1, -2) @ dnum
        dSp = np.swapaxes(Q, -1, -2) @ dnum                     # (..., nc, d, dv)
        dZp = (Q * dden[..., None]).sum(-2)                     # (..., nc, d)
        # chunk c's totals feed the states of all later chunks: reverse exclusive cumsum
        dKV, dZ = _exclusive_cumsum(dSp, -3, reverse=True), _exclusive_cumsum(dZp, -2, reverse=True)
        dK = dK + V @ np.swapaxes(dKV, -1, -2) + dZ[..., None, :]
        dV = dV + K @ dKV
        return unblock(dQ), unblock(dK), unblock(dV)
    return op(unblock(out), (fq, fk, v), vjp)


# ---------------------------------------------------------------------------
# gradient check
# ---------------------------------------------------------------------------

def check_grad(f, *tensors, eps=1e-6, atol=1e-6, rtol=1e-5, seed=0):
    """Check the gradients of ``f`` against central finite differences.

    ``f(*tensors)`` must return a Tensor; the scalar checked is
    ``sum(f(*tensors) * w)`` for a fixed random ``w``, so every output entry
    takes part.  Every tensor passed (float64 only) is differentiated.

    Returns
    -------
    max_abs_err : float
        Largest |analytic - numerical| over all entries.

    Raises
    ------
    AssertionError
        If any entry differs by more than ``atol + rtol * |numerical|``.
    """
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"check_grad argument {i} must be a Tensor, got {type(t).__name__}")
        if t.dtype != np.float64:
            raise TypeError(f"check_grad needs float64 tensors (argument {i} is {t.dtype})")
    saved = [(t.requires_grad, t.grad) for t in tensors]
    try:
        for t in tensors:
            t.requires_grad, t.grad = True, None
        out = f(*tensors)
        w = np.random.default_rng(seed).standard_normal(out.shape)
        (out * w).sum().backward()
        analytic = [np.zeros_like(t.data) if t.grad is None else t.grad for t in tensors]

        def value():
            with no_grad():
                return float((f(*tensors).data * w).sum())

        worst = 0.0
        for i, t in enumerate(tensors):
            original = t.data
            num = np.zeros_like(original)
            for j in np.ndindex(original.shape):
                x = original.copy()
                x[j] += eps
                t.data = x
                up = value()
                x[j] -= 2 * eps
                down = value()
                num[j] = (up - down) / (2 * eps)
            t.data = original
            err = np.abs(analytic[i] - num)
            worst = max(worst, float(err.max(initial=0)))
            bad = err > atol + rtol * np.abs(num)
            if bad.any():
                j = np.unravel_index(np.argmax(err), err.shape)
                raise AssertionError(f"gradient of argument {i} (shape {t.shape}) is wrong at {bad.sum()} "
                                     f"entries; worst at {j}: analytic {analytic[i][j]:.6g}, "
                                     f"numerical {num[j]:.6g}")
        return worst
    finally:
        for t, (rg, gr) in zip(tensors, saved):
            t.requires_grad, t.grad = rg, gr

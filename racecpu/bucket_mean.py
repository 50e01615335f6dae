"""The per-bucket-mean estimator of the authors' released code, in linear time.

:func:`racecpu.reference.race_attention_bucket_mean` states the estimator
(read its docstring for what it is and how it differs from the paper's
ratio) through the ``(Nq, Nk)`` matrix, as an oracle.  This module computes
the same numbers from the per-bucket sums themselves, in O(N L 2**P dv) time,
so that models train with it at about the cost of the ratio estimator:
non-causal, one sum per bucket over all keys; causal, prefix sums over the
keys ``j <= i``, computed in blocks of BLOCK tokens as linear attention with
queries ``W_i = phi(q_i) / (A_i + eps)`` (the prefix counts ``A_i`` are cheap)
and keys ``phi(k_j)``, so that no per-token ``(L, 2**P, dv)`` sum is formed
(``docs/design.md`` section 1.5).

With ``phi`` the soft hash (:func:`racecpu.reference.soft_buckets_dense`,
shared with the oracle so that both state one hash), ``A_lr = sum_j
phi_l(k_j)_r`` and ``B_lr = sum_j phi_l(k_j)_r v_j`` (prefix sums when
causal), ``U_lr = B_lr / (A_lr + eps)`` and ``out_i = sum_lr phi_l(q_i)_r
U_lr``.  The backward, for ``g_i = d out_i``::

    dphi(q_i)_lr = g_i . U_lr
    dB_lr        = sum_i phi_l(q_i)_r g_i / (A_lr + eps)        (suffix sums i >= j when causal)
    dA_lr        = -sum_i phi_l(q_i)_r (g_i . U_lr) / (A_lr + eps)
    dphi(k_j)_lr = v_j . dB_lr + dA_lr,     dv_j = sum_lr phi_l(k_j)_r dB_lr

and the soft hash's backward gives dq, dk and dbeta.

:func:`forward` and :func:`backward` are this estimator behind the NumPy API
(``racecpu.race_attention(..., estimator="bucket_mean")``, chosen by the CPU
backend, :mod:`racecpu.backend`): the ratio's checks, layout, grouped-query
heads, 16-bit inputs and ``out`` buffers (:mod:`racecpu.engine`), this
module's NumPy sums, a call per packed sequence (:func:`forward_sequences`);
a kernel of its own is not written yet.  The sums themselves
(:func:`forward_sums`, :func:`backward_sums`) take the array module ``xp``:
racecpu.cuda runs them on CuPy for arrays in GPU memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ._arrays import namespace_of, to_namespace
from ._checks import (check_array, check_grad_buffers, check_out, deliver, kv_lead, planes_grad_dtype, prepare,
                      widened)
from ._memory import POOL
from .engine import group_sum
from .packing import check_cu_seqlens, check_packed_lengths
from .reference import float_dtype, soft_buckets_dense, soft_buckets_dense_bwd

__all__ = ["race_attention_bucket_mean", "race_attention_bucket_mean_fwd", "race_attention_bucket_mean_bwd",
           "forward", "backward", "Residuals"]

#: Tokens per block of the causal form (``docs/design.md`` section 1.5).
BLOCK = 64
#: What the whole calls (the NumPy API's and racecpu.cuda's) add to every bucket's soft count:
#: the released code's.
EPS = 1e-6


def _reverse_cumsum(xp, x, axis):
    return xp.flip(xp.cumsum(xp.flip(x, axis), axis), axis)


def race_attention_bucket_mean_fwd(q, k, v, planes, beta, *, causal=False, key_mask=None, eps=1e-6,
                                   cu_seqlens=None):
    """The per-bucket-mean estimator and what its backward needs; returns ``(out, residuals)``.

    Arguments as :func:`race_attention_bucket_mean`.  ``residuals`` is opaque
    (for :func:`race_attention_bucket_mean_bwd`); it holds the inputs' soft
    hashes, the per-bucket sums and, when causal, each block's weights (each
    packed sequence's).
    """
    dt = float_dtype(q, k, v)
    q, k, v = (np.asarray(a, dtype=dt) for a in (q, k, v))
    if q.ndim < 2 or k.ndim < 2 or v.ndim < 2:
        raise ValueError(f"q, k, v need shape (..., N, d); got {q.shape}, {k.shape}, {v.shape}")
    if k.shape[-2] != v.shape[-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q (..., Nq, d), k (..., Nk, d) and v (..., Nk, dv) disagree: {q.shape}, {k.shape}, "
                         f"{v.shape}")
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal attention needs Nq == Nk, got {q.shape[-2]} and {k.shape[-2]}")
    mask = None if key_mask is None else np.asarray(key_mask, dtype=bool)
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    out, parts = forward_sequences(np, q, k, v, np.asarray(planes, dtype=dt), beta, causal=causal, key_mask=mask,
                                   eps=eps, bounds=sequences(cu_seqlens, q.shape[-2], k.shape[-2]))
    return out, (parts, (lead + q.shape[-2:], lead + k.shape[-2:], lead + v.shape[-2:]))


def forward_sums(xp, q, k, v, planes, beta, *, causal, key_mask, eps):
    """:func:`race_attention_bucket_mean_fwd` on checked arrays of the module ``xp`` (NumPy, or
    CuPy for racecpu.cuda): ``q``, ``k``, ``v``, ``planes`` of one float dtype, ``key_mask`` a
    bool array or None; nothing is converted or checked here."""
    dt = q.dtype.type
    beta, eps = float(beta), float(eps)
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    pq, tq = soft_buckets_dense(q, planes, beta, xp)     # (..., Nq, L, R)
    pk, tk = soft_buckets_dense(k, planes, beta, xp)     # (..., Nk, L, R)
    mask = None if key_mask is None else xp.broadcast_to(key_mask, lead + k.shape[-2:-1])[..., None, None].astype(dt)
    pkm = pk if mask is None else pk * mask      # masked keys add nothing to any bucket
    n, dv = q.shape[-2], v.shape[-1]
    F = pq.shape[-2] * pq.shape[-1]
    if causal:
        D = xp.cumsum(pkm, axis=-3) + dt(eps)        # (..., N, L, R): prefix counts
        W = xp.broadcast_to(pq / D, lead + pq.shape[-3:]).reshape(lead + (n, F))  # a query's weight per bucket
        Wb, Kb, Vb = (_blocks(xp, x, lead) for x in (W, pkm.reshape(pkm.shape[:-2] + (F,)), v))
        B0 = _exclusive(xp, xp.swapaxes(Kb, -1, -2) @ Vb, axis=-3)   # (..., nb, F, dv): sums before each block
        S = _triangle(xp, Wb @ xp.swapaxes(Kb, -1, -2))               # (..., nb, c, c): within the block, j <= i
        out = (Wb @ B0 + S @ Vb).reshape(lead + (-1, dv))[..., :n, :]
        extra = (Wb, Kb, Vb, B0, S)
    else:
        D = pkm.sum(-3)[..., None, :, :] + dt(eps)                                 # (..., 1, L, R)
        U = xp.einsum("...jlr,...jc->...lrc", pkm, v) / D[..., 0, :, :, None]    # (..., L, R, dv): bucket means
        out = xp.einsum("...ilr,...lrc->...ic", pq, U)
        extra = (U,)
    return out.astype(dt), (planes, beta, causal, mask, lead, pq, tq, pk, tk, pkm, D, v, extra, q, k)


def _blocks(xp, x, lead):
    """``x (..., N, F)`` broadcast to ``lead`` and cut into ``(..., nb, BLOCK, F)``, zero rows past N."""
    n, c = x.shape[-2], BLOCK
    nb = -(-n // c)
    x = xp.broadcast_to(x, lead + x.shape[-2:])
    if nb * c != n:
        x = xp.concatenate([x, xp.zeros(lead + (nb * c - n, x.shape[-1]), x.dtype)], axis=-2)
    return x.reshape(lead + (nb, c, x.shape[-1]))


def _triangle(xp, x, upper=False):
    """``x (..., c, c)`` with the entries above the diagonal zeroed (``upper``: below it), as
    ``np.tril`` / ``np.triu`` on the last two axes (the same bits) for any ``xp``."""
    keep = np.tri(x.shape[-1], dtype=bool)
    return xp.where(xp.asarray(keep.T if upper else keep), x, x.dtype.type(0))


def _exclusive(xp, x, axis, reverse=False):
    """Exclusive cumulative sum along ``axis`` (from the end when ``reverse``)."""
    if reverse:
        return xp.flip(_exclusive(xp, xp.flip(x, axis), axis), axis)
    c = xp.cumsum(x, axis=axis)
    head = (slice(None),) * (axis % x.ndim)
    return xp.concatenate([xp.zeros_like(c[head + (slice(0, min(1, x.shape[axis])),)]), c[head + (slice(0, -1),)]],
                          axis=axis)


def race_attention_bucket_mean_bwd(residuals, grad_out, dplanes=False):
    """Returns ``(dq, dk, dv, dbeta)``, ``dbeta`` summed over everything, and with
    ``dplanes`` the planes' gradient ``(L, P, d)`` too (summed over everything,
    the queries' and the keys' shares), in the compute dtype.

    ``dq``, ``dk``, ``dv`` have the shapes of the inputs the forward got
    (after broadcasting the leading axes); fresh arrays, the residuals are
    not modified.
    """
    parts, shapes = residuals
    return backward_sequences(np, parts, np.asarray(grad_out, dtype=buckets_of(parts).dtype), shapes, dplanes)


def backward_sums(xp, residuals, g, dplanes=False):
    """:func:`race_attention_bucket_mean_bwd` on ``g``, an array of the module ``xp`` in the
    compute dtype (the residuals of :func:`forward_sums` with the same ``xp``)."""
    planes, beta, causal, mask, lead, pq, tq, pk, tk, pkm, D, v, extra, q, k = residuals
    dt = pq.dtype
    n, dv = pq.shape[-3], v.shape[-1]
    if causal:
        Wb, Kb, Vb, B0, S = extra
        Gb = _blocks(xp, g, lead)
        # out_i = sum_{j <= i} (W_i . pk_j) v_j: linear attention with queries W, keys pk
        dWb = Gb @ xp.swapaxes(B0, -1, -2) + _triangle(xp, Gb @ xp.swapaxes(Vb, -1, -2)) @ Kb
        C = _exclusive(xp, xp.swapaxes(Wb, -1, -2) @ Gb, axis=-3, reverse=True)   # (..., nb, F, dv): queries after
        dKb = Vb @ xp.swapaxes(C, -1, -2) + _triangle(xp, Vb @ xp.swapaxes(Gb, -1, -2), upper=True) @ Wb
        dVb = Kb @ C + xp.swapaxes(S, -1, -2) @ Gb
        shape = lead + pq.shape[-3:]  # (..., N, L, R)
        dW = dWb.reshape(lead + (-1, Wb.shape[-1]))[..., :n, :].reshape(shape)
        dpq = dW / D
        dpkm = dKb.reshape(lead + (-1, Kb.shape[-1]))[..., :n, :].reshape(shape)
        W = Wb.reshape(lead + (-1, Wb.shape[-1]))[..., :n, :].reshape(shape)
        dpkm = dpkm + _reverse_cumsum(xp, -dW * W / D, axis=-3)   # through the prefix counts
        dv = dVb.reshape(lead + (-1, dv))[..., :n, :]
    else:
        (U,) = extra
        dpq = xp.einsum("...ic,...lrc->...ilr", g, U)
        dB = xp.einsum("...ilr,...ic->...lrc", pq, g) / D[..., 0, :, :, None]
        dA = -(dpq * pq).sum(-3) / D[..., 0, :, :]
        dpkm = xp.einsum("...jc,...lrc->...jlr", v, dB) + dA[..., None, :, :]
        dv = xp.einsum("...jlr,...lrc->...jc", pkm, dB)
    dpk = dpkm if mask is None else dpkm * mask
    dq, db_q, *dw_q = soft_buckets_dense_bwd(dpq, pq, tq, planes, beta, q if dplanes else None, xp=xp)
    dk, db_k, *dw_k = soft_buckets_dense_bwd(dpk, pk, tk, planes, beta, k if dplanes else None, xp=xp)
    grads = dq.astype(dt), dk.astype(dt), xp.broadcast_to(dv, lead + dv.shape[-2:]).astype(dt), db_q + db_k
    return grads + ((dw_q[0] + dw_k[0]).astype(dt),) if dplanes else grads


def race_attention_bucket_mean(q, k, v, planes, beta, *, causal=False, key_mask=None, eps=1e-6, cu_seqlens=None):
    """RACE attention as the authors' released code computes it, in linear time.

    ``out_i = sum_l sum_r phi_l(q_i)_r B_lr / (A_lr + eps)`` with ``A``, ``B``
    the soft count and soft value sum of bucket ``r`` of table ``l`` over the
    keys query ``i`` sees (all of them; ``j <= i`` when causal); no 1/L.  The
    same numbers as :func:`racecpu.reference.race_attention_bucket_mean`
    (which states the estimator), from the per-bucket sums.

    Parameters
    ----------
    q : ndarray, shape (..., Nq, d), float32 or float64
    k : ndarray, shape (..., Nk, d)
    v : ndarray, shape (..., Nk, dv)
        Leading dims broadcast; computed in the inputs' float dtype.  Not modified.
    planes : ndarray, shape (L, P, d)
    beta : float
    causal : bool
        Needs ``Nq == Nk``.
    key_mask : bool ndarray, shape (..., Nk), optional
        False: the key adds nothing to any bucket.
    eps : float, default 1e-6
        Added to every bucket's soft count (the released code's).
    cu_seqlens : int array_like, shape (S + 1,), optional
        Packed sequences (offsets ``0, n1, n1 + n2, ..., N``, as
        :func:`racecpu.race_attention`'s), each attending only within itself;
        needs ``Nq == Nk``.

    Returns
    -------
    out : ndarray, shape (..., Nq, dv), the inputs' dtype

    Notes
    -----
    O(N L 2**P (d + dv + BLOCK)) time, O(N L 2**P + N BLOCK + (N / BLOCK) L 2**P dv)
    memory (the blocks' sums when causal, one per bucket otherwise).
    """
    return race_attention_bucket_mean_fwd(q, k, v, planes, beta, causal=causal, key_mask=key_mask, eps=eps,
                                          cu_seqlens=cu_seqlens)[0]


# ---------------------------------------------------------------------------
# whole calls of the NumPy API (racecpu.race_attention(..., estimator="bucket_mean"))
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Residuals:
    """What :func:`backward` needs from :func:`forward` (treat as opaque): the residuals of
    :func:`forward_sequences` over the flattened groups (``inner``: a sequence's rows and its
    sums' residuals, one for each packed sequence), and how to give the gradients back the
    inputs' layout and dtypes."""

    backend: ClassVar[str] = "cpu"
    estimator: ClassVar[str] = "bucket_mean"

    inner: tuple
    lead: tuple
    kv_lead: tuple
    group: int
    nq: int
    nk: int
    d: int
    dv: int
    in_dtypes: tuple
    check_finite: bool
    namespace: object = None
    planes_dtype: object = None  # the dtype of the planes' gradient

    @property
    def out_shape(self):
        return self.lead + (self.nq, self.dv)


def repeated(x, group, xp=np):
    """``x (Gk, ...)`` (an array of ``xp``) with each key/value group repeated for its ``group``
    query groups."""
    return x if group == 1 else xp.repeat(x, group, axis=0)


def sequences(cu_seqlens, nq, nk):
    """The packed sequences' ``(start, end)`` rows, checked as the ratio's (:mod:`racecpu.packing`),
    or None for one sequence (``cu_seqlens`` None)."""
    if cu_seqlens is None:
        return None
    check_packed_lengths(nq, nk)
    cu = check_cu_seqlens(cu_seqlens, nq)
    return [(int(a), int(b)) for a, b in zip(cu[:-1], cu[1:])]


def forward_sequences(xp, q, k, v, planes, beta, *, causal, key_mask, eps, bounds):
    """:func:`forward_sums` of each packed sequence (``bounds`` from :func:`sequences`; None: one),
    each attending only within itself: ``(out, parts)``, ``parts`` the residuals of each
    non-empty sequence with its rows, what :func:`backward_sequences` takes.  Arrays of ``xp``
    with the sequence axis second to last; one sequence makes no copy."""
    if bounds is None or all(a == b for a, b in bounds):  # (no tokens: the whole empty call)
        out, inner = forward_sums(xp, q, k, v, planes, beta, causal=causal, key_mask=key_mask, eps=eps)
        return out, [(None, inner)]
    out = xp.zeros(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]) + q.shape[-2:-1] + v.shape[-1:],
                   q.dtype)
    parts = []
    for a, b in bounds:
        if a == b:
            continue
        rows = (Ellipsis, slice(a, b), slice(None))
        y, inner = forward_sums(xp, q[rows], k[rows], v[rows], planes, beta, causal=causal,
                                key_mask=None if key_mask is None else key_mask[..., a:b], eps=eps)
        out[rows] = y
        parts.append(((a, b), inner))
    return out, parts


def buckets_of(parts):
    """The forward's soft buckets of q in the residuals ``parts`` of :func:`forward_sequences`
    (their first sequence's): an array in the compute dtype with q's groups first."""
    return parts[0][1][5]


def backward_sequences(xp, parts, g, shapes, dplanes=False):
    """The backward of :func:`forward_sequences`: ``(dq, dk, dv, dbeta[, dplanes])`` with ``dq``,
    ``dk``, ``dv`` of ``shapes`` (the forward's inputs', leading axes broadcast), ``g`` the
    cotangent of the whole output; sequences' dbeta and dplanes summed in sequence order."""
    if parts[0][0] is None:
        return backward_sums(xp, parts[0][1], g, dplanes)
    dt = g.dtype
    grads = [xp.zeros(s, dt) for s in shapes]
    dbeta, dW = 0.0, None
    for (a, b), inner in parts:
        rows = (Ellipsis, slice(a, b), slice(None))
        dq, dk, dv, db, *w = backward_sums(xp, inner, xp.ascontiguousarray(g[rows]), dplanes)
        for full, part in zip(grads, (dq, dk, dv)):
            full[rows] = part
        dbeta += db
        if dplanes:
            dW = w[0] if dW is None else dW + w[0]
    return tuple(grads) + (dbeta,) + ((dW,) if dplanes else ())


def forward(q, k, v, planes, beta, *, causal=False, key_mask=None, check_finite=True, out=None, cu_seqlens=None,
            residuals=True):
    """The NumPy API's forward with the per-bucket mean (``racecpu.race_attention(...,
    estimator="bucket_mean")``): the same arguments, checks, grouped-query heads, 16-bit
    inputs, ``out`` buffer, packed sequences and array types as the ratio's
    (:func:`racecpu.engine.forward`), the estimator of :func:`race_attention_bucket_mean` (its
    ``eps``: :data:`EPS`), a call per packed sequence (:func:`forward_sequences`)."""
    POOL.tick()
    a = prepare(q, k, v, planes, beta, causal, key_mask, check_finite, grouped=True)
    G, nq, d = a.q.shape
    Gk, nk, dv = a.v.shape
    bounds = sequences(cu_seqlens, nq, nk)
    if out is not None:
        out = check_out("out", out, a.lead + (nq, dv), a.out_dtype,
                        [("q", q), ("k", k), ("v", v), ("planes", planes), ("key_mask", key_mask)])
    mask = None if key_mask is None else repeated(a.mask, a.group)
    y, inner = forward_sequences(np, a.q, repeated(a.k, a.group), repeated(a.v, a.group), a.planes, a.beta,
                                 causal=a.causal, key_mask=mask, eps=EPS, bounds=bounds)
    y = deliver(np.ascontiguousarray(y), out, a.lead + (nq, dv), a.out_dtype)
    xp = namespace_of(q)
    if out is None:
        y = to_namespace(xp, y)
    if not residuals:
        return y, None
    return y, Residuals(inner=inner, lead=a.lead, kv_lead=kv_lead(a.lead, a.group), group=a.group, nq=nq, nk=nk,
                        d=d, dv=dv, in_dtypes=a.in_dtypes, check_finite=a.check_finite, namespace=xp,
                        planes_dtype=planes_grad_dtype(np.asarray(planes).dtype, a.q.dtype))


def backward(residuals, grad_out, *, out=None, dplanes=False):
    """The NumPy API's backward of :func:`forward`: ``(dq, dk, dv, dbeta[, dplanes])`` as the
    ratio's (:func:`racecpu.engine.backward`; the planes' gradient in the planes' dtype)."""
    r = residuals
    if not isinstance(r, Residuals):
        raise TypeError(f"residuals must come from race_attention_fwd, got {type(r).__name__}")
    POOL.tick()
    g, _, _ = check_array("grad_out", grad_out, False)
    shapes = (r.lead + (r.nq, r.d), r.kv_lead + (r.nk, r.d), r.kv_lead + (r.nk, r.dv))
    out = check_grad_buffers(g, out, r.out_shape, shapes, r.in_dtypes, [], r.check_finite)
    check_array("grad_out", g, r.check_finite)
    cdt = buckets_of(r.inner).dtype
    G = int(np.prod(r.lead, dtype=np.int64))
    dq, dk, dv, dbeta, *dW = backward_sequences(np, r.inner, widened(g.reshape(G, r.nq, r.dv), cdt),
                                                ((G, r.nq, r.d), (G, r.nk, r.d), (G, r.nk, r.dv)), dplanes)
    # a key/value head's rows were read by its whole group of query heads
    dk, dv = (np.ascontiguousarray(group_sum(np.ascontiguousarray(x), r.group)) for x in (dk, dv))
    xp = r.namespace
    grads = tuple(to_namespace(xp if buf is None else None, deliver(x, buf, shape, dt))
                  for x, buf, shape, dt in zip((dq, dk, dv), out, shapes, r.in_dtypes)) + (float(dbeta),)
    return grads + (to_namespace(xp, dW[0].astype(r.planes_dtype)),) if dplanes else grads

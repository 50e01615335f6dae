"""RACE attention: the public NumPy API (argument checking, layout, residuals).

The numerical work is in :mod:`racecpu._kernels`; this module turns user
arrays into the kernels' layout, checks everything a user can get wrong, and
packs the residuals the backward needs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from . import _kernels as K
from ._kernels.bundles import Grads, Hash, PlanesGrad, Rows, Sums, no_planes_grad
from ._arrays import namespace_of, to_namespace
from ._checks import (SUMS_OVERFLOW, all_finite, check_array, check_beta, check_derived, check_out, half_format,
                      narrowed, prepare, widened)
from ._memory import POOL
from .config import DEFAULT_BETA
from .hashing import hyperplanes
from .packing import Packing, packed_chunks, sequence_sums

__all__ = ["race_attention", "race_attention_fwd", "race_attention_bwd", "RaceAttention", "Residuals"]


def _target(out, shape, cdt):
    """Where a kernel writes a result of ``shape`` in the compute dtype: the
    caller's buffer ``out`` when it is C-contiguous in that dtype, else an
    array from the pool (README, "Memory")."""
    if out is not None and out.dtype == cdt and out.flags.c_contiguous:
        return out.reshape(shape)
    return POOL.empty(shape, cdt)


def _deliver(result, out, shape, dtype):
    """``result`` as the caller's ``out`` (copied in unless it already is it) or as a new
    array, in ``dtype`` (16-bit dtypes narrowed from float32 on every core)."""
    if half_format(dtype) is not None and result.dtype == np.float32:
        if out is not None and out.flags.c_contiguous:
            narrowed(result.reshape(shape), dtype, out)
            return out
        y = narrowed(result.reshape(shape), dtype)
        if out is None:
            return y
        out[...] = y
        return out
    if out is None:
        return result.reshape(shape).astype(dtype, copy=False)
    if not np.may_share_memory(result, out):
        out[...] = result.reshape(shape)
    return out


@dataclass(frozen=True)
class Residuals:
    """What :func:`race_attention_bwd` needs from the forward (treat as opaque).

    Holds O(N * L * R) numbers per head (soft buckets, tanh projections, the
    denominators) plus the O(L * R * dv) sketch or, for causal attention, the
    carried state at every chunk start.  ``v``, ``q`` and ``k`` are kept by
    reference (flattened to ``(G, N, d)``: the caller's own arrays where
    those are C-contiguous in the compute dtype or are 16-bit, which the
    backward widens again): do not modify them between forward and backward.
    Only the planes' gradient (``race_attention_bwd(..., dplanes=True)``)
    reads ``q`` and ``k``.
    """
    planes: np.ndarray
    beta: float
    causal: bool
    chunk: int
    v: np.ndarray        # (Gk, Nk, dv), compute dtype or 16-bit; Gk = G // group
    phiq: np.ndarray     # (G, Nq, F)
    tq: np.ndarray       # (G, Nq, L*P)
    phik: np.ndarray     # (Gk, Nk, F)
    tk: np.ndarray       # (Gk, Nk, L*P)
    den: np.ndarray      # (G, Nq) float64
    A: np.ndarray        # (Gk, F) total ((Gk, S, F) per packed sequence), or (Gk, nc, F) carries
                         # when causal; float64
    B: np.ndarray        # (Gk, F, dv) total ((Gk, S, F, dv) packed), or (Gk, nc, F, dv) carries when causal
    lead: tuple
    in_dtypes: tuple
    out_dtype: np.dtype
    check_finite: bool
    q: np.ndarray        # (G, Nq, d), compute dtype or 16-bit, for the planes' gradient only
    k: np.ndarray        # (Gk, Nk, d), compute dtype or 16-bit, for the planes' gradient only
    planes_dtype: np.dtype  # the dtype the planes were given in (their gradient's)
    namespace: object = None  # the array-API namespace of the forward's q (None: NumPy), for the gradients
    group: int = 1  # query heads per key/value head (grouped-query attention)
    packing: Packing | None = None  # packed sequences (cu_seqlens): their chunks

    @property
    def out_shape(self):
        return self.lead + (self.phiq.shape[1], self.v.shape[2])

    @property
    def kv_lead(self):
        """The leading dims of k and v (fewer heads than q's under grouped-query attention)."""
        return self.lead[:-1] + (self.lead[-1] // self.group,) if self.group > 1 else self.lead


def _repeat(x, group):
    """``x (Gk, ...)`` with each group repeated ``group`` times along axis 0 (``x`` itself for 1),
    into memory from the pool (a training loop does not fault fresh pages in for it every step)."""
    if group == 1:
        return x
    y = POOL.empty((x.shape[0] * group,) + x.shape[1:], x.dtype)
    y.reshape((x.shape[0], group) + x.shape[1:])[...] = x[:, None]
    return y


def race_attention_fwd(q: ArrayLike, k: ArrayLike, v: ArrayLike, planes: ArrayLike, beta: float = DEFAULT_BETA, *,
                       causal: bool = False, key_mask: ArrayLike | None = None, check_finite: bool = True,
                       out: np.ndarray | None = None,
                       cu_seqlens: ArrayLike | None = None) -> tuple[np.ndarray, Residuals]:
    """RACE attention forward; returns ``(out, residuals)`` for :func:`race_attention_bwd`.

    Arguments are those of :func:`race_attention`, which computes the same
    ``out`` (bit for bit) without keeping residuals.  CuPy ``q`` runs on the
    GPU (:func:`racecpu.cuda.race_attention_fwd`: device arrays out, and
    residuals that :func:`race_attention_bwd` sends back to the GPU).
    """
    if _is_cupy(q):
        return _gpu("race_attention_fwd", out)(q, k, v, planes, beta, causal=causal, key_mask=key_mask,
                                               check_finite=check_finite, cu_seqlens=cu_seqlens)
    xp = namespace_of(q)
    y, res = _forward(q, k, v, planes, beta, causal, key_mask, check_finite, out, residuals=True,
                      cu_seqlens=cu_seqlens)
    if xp is None:
        return y, res
    return (y if out is not None else to_namespace(xp, y)), replace(res, namespace=xp)


def _packed(a, cu_seqlens, F):
    """The :class:`racecpu.packing.Packing` of ``cu_seqlens`` for the prepared
    arguments ``a`` (None for None): every sequence in the usual chunks."""
    if cu_seqlens is None:
        return None
    G, nq, _ = a.q.shape
    Gk, nk, dv = a.v.shape
    if nq != nk:
        raise ValueError(f"cu_seqlens packs q, k and v alike: they need the same sequence length, got {nq} and {nk}")
    return packed_chunks(cu_seqlens, nq, K.chunk_length(nq, G, F, dv))


def _forward(q, k, v, planes, beta, causal, key_mask, check_finite, out, residuals, cu_seqlens=None):
    """The forward; ``residuals=False``: the soft buckets, projections and
    denominators that only the backward reads stay in per-chunk scratch (the
    kernels get arrays with no rows, see ``_kernels.residual_rows``) and
    ``(out, None)`` is returned.  The causal scan still keeps the keys' phi
    (it reads them after the keys' pass)."""
    POOL.tick()
    a = prepare(q, k, v, planes, beta, causal, key_mask, check_finite, defer=True, grouped=True)
    if out is not None:
        out = check_out("out", out, a.lead + (a.q.shape[1], a.v.shape[2]), a.out_dtype,
                         [("q", q), ("k", k), ("v", v), ("planes", planes), ("key_mask", key_mask)])
    L, P, _ = a.planes.shape
    F = L * 2 ** P
    pk = _packed(a, cu_seqlens, F)
    chunks = None if pk is None else pk.chunks
    group = a.group
    G, nq, _ = a.q.shape
    Gk, nk, dv = a.v.shape
    cdt = a.q.dtype
    if pk is None:
        base = K.chunk_length(max(nq, nk), G, F, dv)  # the backward's chunks (and the causal forward's carries)
        chunk = base if causal else K.sketch_task_length(base, max(nq, nk), G)
    else:
        base = chunk = pk.chunk  # every packed sequence starts a chunk (its last one shorter)
    nck = -(-nk // chunk) if pk is None else pk.chunks.seq.size
    rq, rk = (nq, nk) if residuals else (0, 0)  # rows kept of the queries' and keys' residuals
    phik = POOL.empty((Gk, nk if causal else rk, F), cdt)
    tk = POOL.empty((Gk, rk, L * P), cdt)
    seg = K.scan_segments(Gk, nck, nk) if causal else 1
    partA = POOL.zeros((Gk, nck, F))
    partB = POOL.empty((Gk, nck, F, dv), np.float64)  # the kernels write every value read (causal: the carries)
    phiq = POOL.empty((G, rq, F), cdt)
    tq = POOL.empty((G, rq, L * P), cdt)
    den = POOL.zeros((G, rq))
    o = _target(out, (G, nq, dv), cdt)  # the kernels write every row
    hsh, rows = Hash(a.planes, a.beta), Rows(phiq, tq, phik, tk, den)
    nan_q = nan_k = 0  # NaNs in the hashes' t: a NaN/Inf in q or k, or an overflow
    if Gk and nk:
        # causal: the B totals of the chunks before the last segment give the segments' carries
        nan_k = K.sketch_chunks(a.k, a.v, a.mask, hsh, chunk, rows, Sums(partA, partB),
                                span=K.SCAN_BLOCK if causal else K.SKETCH_FUSED,
                                totals=(0, K.segment_start(seg - 1, seg, nck)) if causal else None, chunks=chunks)
    if causal:
        seq = None if pk is None else pk.chunks.seq
        A = K.exclusive_scan(partA, out=partA, seq=seq)
        B = K.exclusive_scan(partB, out=partB, segments=seg, seq=seq)  # the segments' first carries; the scan the rest
        # grouped-query attention: one scan per key/value head, read by its whole group of query heads
        sums_v = POOL.zeros((Gk, F, dv))  # the scan's total of B, for the check of v
        if G and nq:
            nan_q = K.causal_fwd(a.q, a.v, hsh, chunk, rows, Sums(A, B), o, final=sums_v,
                                 segments=seg, chunks=chunks)
    else:
        # packed: a sketch per sequence, (Gk, S, F) and (Gk, S, F, dv)
        A, B = (partA.sum(1), partB.sum(1)) if pk is None else (sequence_sums(partA, pk), sequence_sums(partB, pk))
        sums_v = B
        if G and nq:  # grouped-query attention: each query head reads its key/value head's sketch
            nan_q = K.queries_fwd(a.q, hsh, chunk, Sums(_repeat(A, group), _repeat(B.astype(cdt), group)), rows, o,
                                  chunks=chunks)
    overflow = f"its projections onto the planes overflow {cdt}"
    # packed and causal: the scan restarts, its total is the last sequence's; the output shows the others'
    finite_v = all_finite(sums_v) and not (causal and pk is not None and not all_finite(o))
    check_derived(a.check_finite, ("q", a.q, nan_q == 0, overflow), ("k", a.k, nan_k == 0, overflow),
                   ("v", a.v, finite_v, SUMS_OVERFLOW))
    y = _deliver(o, out, a.lead + (nq, dv), a.out_dtype)
    if not residuals:
        return y, None
    pdt = np.asarray(planes).dtype
    # 16-bit inputs: the caller's arrays, not the widened copies (half the memory held until the backward)
    kq, kk, kv = (given if half_format(given.dtype) is not None else x
                  for given, x in zip(a.given, (a.q, a.k, a.v)))
    return y, Residuals(a.planes, a.beta, a.causal, base, kv, phiq, tq, phik, tk, den, A, B,
                        a.lead, a.in_dtypes, a.out_dtype, a.check_finite, kq, kk,
                        pdt if pdt.kind == "f" else np.dtype(cdt), group=group, packing=pk)


def race_attention_bwd(residuals: Residuals, grad_out: ArrayLike, *,
                       out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                       dplanes: bool = False) -> tuple:
    """RACE attention backward.

    Parameters
    ----------
    residuals : Residuals
        From :func:`race_attention_fwd`.  Those of a forward on CuPy arrays
        run the backward on the GPU (:func:`racecpu.cuda.race_attention_bwd`:
        device arrays out; ``out`` and ``dplanes`` are not available there).
    grad_out : array_like, shape like the forward's output
        Cotangent of the output.
    out : tuple of three ndarrays, optional
        Buffers ``(dq, dk, dv)`` to write the gradients into, each with the
        shape and dtype of its input (see :func:`race_attention`'s ``out``).
    dplanes : bool, default False
        Also return the gradient w.r.t. the planes (learnable hash planes).
        Without it nothing of that gradient is computed.

    Returns
    -------
    dq, dk, dv : ndarray
        Gradients, each in the dtype of its input (the ``out`` buffers if
        given), in the array type of the forward's ``q`` (see
        :func:`race_attention`'s ``out``).
    dbeta : float
        Gradient w.r.t. beta, summed over every batch, head and token.
    dplanes : ndarray, shape (L, P, d)
        Only with ``dplanes=True``: the gradient w.r.t. the planes, summed
        over every batch, head, query and key (``docs/design.md`` section
        3.3), in the dtype the planes were given in (the compute dtype for
        integer planes); each chunk's share is one product in
        the compute dtype, the shares are summed in float64 in a fixed
        order, so the bits do not depend on the thread count.
    """
    if type(residuals).__module__ == "racecpu.cuda":  # from a CuPy forward: the backward runs there too
        if dplanes:
            raise NotImplementedError("dplanes=True is not implemented on the GPU (racecpu.cuda) yet; "
                                      "run the forward and backward on NumPy arrays for the planes' gradient")
        return _gpu("race_attention_bwd", out)(residuals, grad_out)
    POOL.tick()
    r = residuals
    if not isinstance(r, Residuals):
        raise TypeError(f"residuals must come from race_attention_fwd, got {type(r).__name__}")
    g, _, _ = check_array("grad_out", grad_out, False)  # NaN/Inf: from what the kernels sum (below)
    G, nq, F = r.phiq.shape
    Gk, nk, dv = r.v.shape
    d = r.planes.shape[2]
    cdt = r.phiq.dtype
    qdt, kdt, vdt = r.in_dtypes
    lead, klead = r.lead, r.kv_lead
    pk = r.packing
    shapes = (lead + (nq, d), klead + (nk, d), klead + (nk, dv))
    try:
        if g.shape != r.out_shape:
            raise ValueError(f"grad_out must have the output's shape {r.out_shape}, got {g.shape}")
        if out is not None:
            if not isinstance(out, (tuple, list)) or len(out) != 3:
                raise TypeError(f"out must be a tuple of three arrays (dq, dk, dv), got {type(out).__name__}")
            reads = [("grad_out", grad_out), ("the forward's v", r.v), ("planes", r.planes)]
            checked = []
            for name, buf, shape, dt in zip(("dq", "dk", "dv"), out, shapes, (qdt, kdt, vdt)):
                checked.append(check_out(f"out {name}", buf, shape, dt, reads))
                reads.append((f"out {name}", buf))
            out = checked
        else:
            out = (None, None, None)
    except (TypeError, ValueError):
        check_array("grad_out", g, r.check_finite)  # errors in the eager order: grad_out's NaN first
        raise
    g = widened(g.reshape(G, nq, dv), cdt)
    v = widened(r.v, cdt)
    chunks = None if pk is None else pk.chunks
    chunk = r.chunk
    ncq, nck = (-(-nq // chunk), -(-nk // chunk)) if pk is None else (pk.chunks.seq.size,) * 2
    hsh, rows = Hash(r.planes, r.beta), Rows(r.phiq, r.tq, r.phik, r.tk, r.den)
    # The kernels write every row; without queries or keys they do not run.
    dq = _target(out[0], (G, nq, d), cdt)
    dk, dv_ = (_target(buf, (Gk,) + shape[-2:], cdt) for buf, shape in zip(out[1:], shapes[1:]))
    dbeta = 0.0
    LP = r.planes.shape[0] * r.planes.shape[1]
    dW = np.zeros((LP, d))
    if not (G and nq and nk):
        check_array("grad_out", g, r.check_finite)  # no kernel sums it
        for x in (dq, dk, dv_):
            x[...] = 0
    else:
        if dplanes:  # per-chunk shares, summed below in a fixed order
            pg = PlanesGrad(widened(r.q, cdt), widened(r.k, cdt), POOL.empty((G, ncq, LP, d), np.float64),
                            POOL.empty((Gk, nck, LP, d), np.float64))
        else:
            pg = no_planes_grad(g, G, ncq, nck, d)
        # the chunk totals of (dA, dB): per query head, or per key/value head (summed over
        # its group) from the causal scan, which runs the group's query heads together
        Gd = Gk if r.causal else G
        partdA = POOL.zeros((Gd, ncq, F))
        partdB = POOL.empty((Gd, ncq, F, dv), np.float64)  # the kernels write every value read
        dbq = POOL.zeros((G, ncq))
        dbk = POOL.zeros((Gk, nck))
        if r.causal:
            dB = POOL.zeros((Gk, F, dv))  # the scan's total of dB, for the check of grad_out
            grads = Grads(dq, dk, dv_, POOL.zeros((G, nq)), dbq, dbk, pg)
            K.causal_backward(g, v, rows, Sums(r.A, r.B), hsh, chunk, grads, Sums(partdA, partdB), final=dB, chunks=chunks)
            # packed: the reverse scan restarts, its total is the first sequence's; dv shows the others'
            finite = all_finite(dB) and (pk is None or all_finite(dv_))
            check_derived(r.check_finite, ("grad_out", g, finite, SUMS_OVERFLOW))
        else:
            grads = Grads(dq, dk, dv_, POOL.zeros((G, 0)), dbq, dbk, pg)
            sketch = Sums(_repeat(r.A, r.group), _repeat(r.B.astype(cdt), r.group))
            K.queries_bwd(g, v, rows, sketch, hsh, chunk, grads, Sums(partdA, partdB), chunks=chunks)
            # a key/value head's sketch was read by its whole group (packed: one sketch per sequence)
            per_seq = (lambda x: x.sum(1)) if pk is None else (lambda x: sequence_sums(x, pk))
            dB = K.group_sum(per_seq(partdB), r.group)
            check_derived(r.check_finite, ("grad_out", g, all_finite(dB), SUMS_OVERFLOW))  # before the keys' backward
            K.keys_bwd(v, rows, Sums(K.group_sum(per_seq(partdA), r.group), dB.astype(cdt)), hsh, chunk, grads,
                       chunks=chunks)
        dbeta = float(dbq.sum() + dbk.sum())
        if dplanes:
            dW = pg.dWq.sum((0, 1)) + pg.dWk.sum((0, 1))
    xp = r.namespace
    grads = tuple(to_namespace(xp if buf is None else None, _deliver(x, buf, shape, dt))
                  for x, buf, shape, dt in zip((dq, dk, dv_), out, shapes, (qdt, kdt, vdt))) + (dbeta,)
    if not dplanes:
        return grads
    return grads + (to_namespace(xp, dW.reshape(r.planes.shape).astype(r.planes_dtype)),)


def race_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, planes: ArrayLike, beta: float = DEFAULT_BETA, *,
                   causal: bool = False, key_mask: ArrayLike | None = None, check_finite: bool = True,
                   out: np.ndarray | None = None, cu_seqlens: ArrayLike | None = None) -> np.ndarray:
    """RACE attention: linear-time soft-LSH estimate of sharpened angular attention.

    The forward alone: it keeps none of the residuals that
    :func:`race_attention_fwd` returns for the backward (the per-token soft
    buckets, projections and denominators stay in per-chunk scratch), so it
    writes less memory and needs less; the output is the same, bit for bit.

    Parameters
    ----------
    q : array_like, shape (..., Nq, d)
    k : array_like, shape (..., Nk, d)
    v : array_like, shape (..., Nk, dv)
        Any number (>= 0) of leading batch/head dims, the same for q, k, v;
        or, for grouped-query (multi-query) attention, k and v with a head
        axis (the one before the tokens) ``group`` times smaller than q's,
        every other leading axis equal: query head h reads key/value head
        ``h // group``, whose keys are hashed and sketched (causal: whose
        state is scanned) once for the group and whose gradients sum over
        it; equal to repeating k and v ``group`` times.
        NumPy arrays, or any array with ``__array__`` or DLPack (torch CPU
        tensors without grad, JAX CPU arrays, ...), read without a copy where
        the library allows; CuPy ``q`` runs on the GPU (:mod:`racecpu.cuda`).
    planes : array_like, shape (L, P, d)
        Hyperplanes from :func:`racecpu.hyperplanes` (cast to the compute dtype).
    beta : float, default ``DEFAULT_BETA``
        Soft-hash temperature (> 0); larger is closer to hard SimHash buckets.
    causal : bool, default False
        Query i sees keys j <= i (needs Nq == Nk).
    key_mask : bool array, shape (..., Nk), optional
        k's leading dims: False keys contribute nothing.
    check_finite : bool, default True
        Raise ValueError on NaN/Inf in q, k, v, on q or k so large that
        their projections onto the planes overflow, and on v so large that
        the sketch's float64 sums overflow.  The inputs are checked after the
        kernels, from what they derived (q and k from their hash, 9 values
        per token at P = L = 3 instead of d; v from the sketch): no extra
        pass over them, but ``out`` may have been written when it raises.
        :func:`race_attention_bwd` checks ``grad_out`` the same way.
    out : ndarray, shape (..., Nq, dv), optional
        Buffer for the result, in the result's dtype; it must not share
        memory with q, k, v, planes or key_mask.  Without one, the result's memory comes from
        racecpu's pool, which reuses that of dropped results so that a loop
        does not fault fresh pages in every call (README, "Memory").  A
        C-contiguous float32/float64 buffer is written directly.
    cu_seqlens : 1-D int array, optional
        Packed sequences (flash-attn's convention): the offsets
        ``0, n1, n1 + n2, ..., N`` of the sequences on the sequence axis
        (Nq == Nk == N; empty sequences allowed).  Each attends only within
        itself: the causal scan restarts at each, the non-causal sketch is
        per sequence; equal to a call per sequence.  The same for every
        leading index.

    Returns
    -------
    out : ndarray, shape (..., Nq, dv)
        In ``q``'s array type when it is not NumPy and ``out`` is not given
        (its array-API namespace through array-api-compat: a torch CPU
        tensor sharing racecpu's result, a JAX array, ...); else NumPy.
        float32/float64 follow the inputs; float16 computes in float32 and
        returns float16.  A query whose buckets hold no key mass
        (``den <= DEN_FLOOR``, e.g. every key masked) gets zeros.
    """
    if _is_cupy(q):
        return _gpu("race_attention", out)(q, k, v, planes, beta, causal=causal, key_mask=key_mask,
                                           check_finite=check_finite, cu_seqlens=cu_seqlens)
    y = _forward(q, k, v, planes, beta, causal, key_mask, check_finite, out, residuals=False,
                 cu_seqlens=cu_seqlens)[0]
    return y if out is not None else to_namespace(namespace_of(q), y)


def _is_cupy(x):
    return type(x).__module__.split(".")[0] == "cupy"


def _gpu(name, out):
    """``racecpu.cuda``'s function ``name``, for CuPy arrays given to the NumPy API (imported
    only then: the CPU path never loads numba.cuda)."""
    if out is not None:
        raise TypeError("out is for NumPy arrays; CuPy's memory pool already reuses device memory")
    from . import cuda
    return getattr(cuda, name)


class RaceAttention:
    """A RACE attention layer holding its hyperplanes.

    Parameters
    ----------
    head_dim : int
    num_planes : int, default 3
    num_tables : int, default 3
    beta : float, default ``DEFAULT_BETA``
    seed : int, default 0
    dtype : dtype, default float32
        dtype of the stored planes (cast to the inputs' compute dtype on use).

    Examples
    --------
    >>> import numpy as np, racecpu
    >>> att = racecpu.RaceAttention(64)
    >>> x = np.random.default_rng(0).standard_normal((2, 128, 64), dtype=np.float32)
    >>> att(x, x, x, causal=True).shape
    (2, 128, 64)
    """

    def __init__(self, head_dim: int, num_planes: int = 3, num_tables: int = 3, beta: float = DEFAULT_BETA,
                 seed: int | None = 0, dtype: DTypeLike = np.float32):
        self.planes = hyperplanes(head_dim, num_planes, num_tables, seed=seed, dtype=dtype)
        self.beta = check_beta(beta)

    @property
    def head_dim(self):
        return self.planes.shape[2]

    @property
    def num_planes(self):
        return self.planes.shape[1]

    @property
    def num_tables(self):
        return self.planes.shape[0]

    def __repr__(self):
        return (f"RaceAttention(head_dim={self.head_dim}, num_planes={self.num_planes}, "
                f"num_tables={self.num_tables}, beta={self.beta})")

    def __call__(self, q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = False,
                 key_mask: ArrayLike | None = None, check_finite: bool = True,
                 out: np.ndarray | None = None, cu_seqlens: ArrayLike | None = None) -> np.ndarray:
        return race_attention(q, k, v, self.planes, self.beta, causal=causal, key_mask=key_mask,
                              check_finite=check_finite, out=out, cu_seqlens=cu_seqlens)

    def fwd(self, q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = False,
            key_mask: ArrayLike | None = None, check_finite: bool = True,
            out: np.ndarray | None = None, cu_seqlens: ArrayLike | None = None) -> tuple[np.ndarray, Residuals]:
        return race_attention_fwd(q, k, v, self.planes, self.beta, causal=causal, key_mask=key_mask,
                                  check_finite=check_finite, out=out, cu_seqlens=cu_seqlens)

    def bwd(self, residuals: Residuals, grad_out: ArrayLike, *,
            out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None, dplanes: bool = False) -> tuple:
        return race_attention_bwd(residuals, grad_out, out=out, dplanes=dplanes)

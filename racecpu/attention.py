"""RACE attention: the public NumPy API (argument checking, layout, residuals).

The numerical work is in :mod:`racecpu._kernels`; this module turns user
arrays into the kernels' layout, checks everything a user can get wrong, and
packs the residuals the backward needs.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numba
import numpy as np

from . import _kernels as K
from ._memory import POOL
from .hashing import DEFAULT_BETA, MAX_PLANES, hyperplanes

__all__ = ["race_attention", "race_attention_fwd", "race_attention_bwd", "RaceAttention", "Residuals"]

#: Tokens per chunk: the unit of parallel work and the longest run summed in
#: the compute dtype before the sum moves to float64.
CHUNK = 1024
# Cap on the float64 chunk partials (G * nc * F * (dv + 1) * 8 bytes); above
# it chunks grow, which only matters for very large P.
_PARTIAL_BUDGET = 256 * 2 ** 20
#: Chunks per task of the non-causal forward (see :func:`_sketch_chunk`).
SKETCH_CHUNKS = 4


# ---------------------------------------------------------------------------
# argument checking
# ---------------------------------------------------------------------------

def _dtypes(*arrays):
    """(compute dtype, output dtype) of float inputs: float16 computes in float32."""
    dt = np.result_type(*arrays)
    if dt == np.float16:
        return np.dtype(np.float32), np.dtype(np.float16)
    return dt, dt


def _check_array(name, x, check_finite, min_ndim=2):
    """Float array check; returns (array, output dtype, compute dtype)."""
    try:
        x = np.asarray(x)
    except Exception as exc:  # ragged lists and the like
        raise TypeError(f"{name} must be an array of floats: {exc}") from None
    if x.dtype.kind != "f" or x.dtype.itemsize > 8:
        raise TypeError(f"{name} must be a float16, float32 or float64 array, got dtype {x.dtype}; "
                        f"pass {name}.astype(np.float32)")
    if x.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dims (..., N, d), got shape {x.shape}")
    if check_finite and not _all_finite(x):
        raise ValueError(f"{name} contains NaN or Inf (pass check_finite=False to skip this check)")
    cdt = np.dtype(np.float32) if x.dtype == np.float16 else x.dtype
    return x, x.dtype, cdt


def _check_planes(planes, d, cdt):
    planes = np.asarray(planes)
    if planes.dtype.kind not in "fiu" or planes.dtype.kind == "b":
        raise TypeError(f"planes must be a float array (L, P, d), got dtype {planes.dtype}")
    if planes.ndim != 3:
        raise ValueError(f"planes must have shape (L, P, d), got shape {planes.shape}")
    L, P, pd = planes.shape
    if pd != d:
        raise ValueError(f"planes have head dim {pd} but the inputs have head dim {d} "
                         f"(planes shape {planes.shape})")
    if L < 1 or not 1 <= P <= MAX_PLANES:
        raise ValueError(f"planes need L >= 1 tables and 1 <= P <= {MAX_PLANES} planes, got shape {planes.shape}")
    if d < 1:
        raise ValueError(f"head dim must be >= 1, got planes shape {planes.shape}")
    if not np.isfinite(planes).all():
        raise ValueError("planes contain NaN or Inf")
    return np.ascontiguousarray(planes, dtype=cdt)


def _check_beta(beta):
    if isinstance(beta, (bool, np.bool_)) or not isinstance(beta, (numbers.Real, np.ndarray, np.generic)):
        raise TypeError(f"beta must be a positive finite float, got {type(beta).__name__} {beta!r}")
    b = np.asarray(beta)
    if b.ndim != 0 or b.dtype.kind not in "fiu":
        raise TypeError(f"beta must be a scalar float, got {b.dtype} array of shape {b.shape}")
    b = float(b)
    if not np.isfinite(b) or b <= 0:
        raise ValueError(f"beta must be finite and > 0, got {b}")
    return b


_EXP_BITS = {4: (np.uint32, 0x7F800000), 8: (np.uint64, 0x7FF0000000000000)}


def _all_finite(x):
    """np.isfinite(x).all(), on every core and without a temporary for big float32/64 arrays."""
    if x.size < 1 << 16 or x.dtype.itemsize not in _EXP_BITS or not x.flags.c_contiguous:
        return bool(np.isfinite(x).all())
    ut, mask = _EXP_BITS[x.dtype.itemsize]
    return K.count_nonfinite(x.reshape(-1).view(ut), ut(mask)) == 0


@dataclass(frozen=True)
class _Args:
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: np.ndarray
    planes: np.ndarray
    beta: float
    lead: tuple
    out_dtype: np.dtype
    in_dtypes: tuple
    causal: bool
    check_finite: bool


def _check_args(q, k, v, planes, beta, causal, key_mask):
    """Cross-argument checks on already-checked q, k, v (anything with shape and dtype).

    Shared with racecpu.cuda, which passes zero-stride stand-ins of device
    arrays.  Returns (compute dtype, output dtype, lead, G, planes, beta).
    """
    cdt, odt = _dtypes(q, k, v)
    lead = q.shape[:-2]
    if k.shape[:-2] != lead or v.shape[:-2] != lead:
        raise ValueError(f"q, k, v must have the same leading dims, got shapes q {q.shape}, k {k.shape}, v {v.shape}")
    nq, d = q.shape[-2:]
    nk = k.shape[-2]
    if k.shape[-1] != d:
        raise ValueError(f"q and k must have the same head dim, got shapes q {q.shape} and k {k.shape}")
    if v.shape[-2] != nk:
        raise ValueError(f"k and v must have the same number of tokens, got shapes k {k.shape} and v {v.shape}")
    if causal and nq != nk:
        raise ValueError(f"causal attention needs as many queries as keys, got shapes q {q.shape} and k {k.shape}")
    planes = _check_planes(planes, d, cdt)
    beta = _check_beta(beta)
    G = int(np.prod(lead, dtype=np.int64))
    if key_mask is not None:
        m = np.asarray(key_mask)
        if m.dtype != np.bool_:
            raise TypeError(f"key_mask must be a bool array, got dtype {m.dtype}")
        if m.shape != lead + (nk,):
            raise ValueError(f"key_mask must have shape {lead + (nk,)} (leading dims + (Nk,)), got {m.shape}")
    return cdt, odt, lead, G, planes, beta


def _prepare(q, k, v, planes, beta, causal, key_mask, check_finite, defer=False):
    """Check and lay out the arguments.  ``defer``: the NaN/Inf checks of q, k
    and v are left to :func:`_check_derived`, after the kernels read them."""
    eager = check_finite and not defer
    q, qdt, _ = _check_array("q", q, eager)
    passed = [("q", q)]
    try:
        k, kdt, _ = _check_array("k", k, eager)
        passed.append(("k", k))
        v, vdt, _ = _check_array("v", v, eager)
        passed.append(("v", v))
        cdt, odt, lead, G, planes, beta = _check_args(q, k, v, planes, beta, causal, key_mask)
    except (TypeError, ValueError):
        if check_finite and not eager:  # errors in the eager order: q's NaN before anything about k
            for name, x in passed:
                _check_array(name, x, True)
        raise
    nk = k.shape[-2]
    if key_mask is None:
        mask = np.ones((G, nk), dtype=np.bool_)
    else:
        mask = np.ascontiguousarray(np.asarray(key_mask).reshape(G, nk))

    def flat(x):
        return np.ascontiguousarray(x.reshape((G,) + x.shape[-2:]), dtype=cdt)

    return _Args(flat(q), flat(k), flat(v), mask, planes, beta, lead, odt, (qdt, kdt, vdt),
                 bool(causal), bool(check_finite))


#: Why a finite v or grad_out whose sums are not finite is an error (:func:`_check_derived`).
_SUMS_OVERFLOW = "its weighted sums overflow float64"


def _check_derived(check_finite, *named):
    """NaN/Inf check of inputs from small arrays that the kernels derived from them.

    ``named``: ``(name, x, finite, overflow)`` in the order the errors are
    raised, ``finite`` whether what the kernels derived from ``x`` is, where
    a NaN/Inf anywhere in ``x`` makes it not: for q and k the tanh
    projections t (the soft hash leaves NaN in t where W x is non-finite,
    and a NaN/Inf in a row of x makes all of its W x so; the kernels count
    those NaNs while t is in cache, 9 values per row at P = L = 3 instead of
    d); for v and grad_out the float64 sums over all rows that the kernels
    form anyway (every row enters them with a weight, and 0 * NaN is NaN).
    This saves a pass over each input.  A flagged array is then checked itself, so the error is the
    eager one; a flagged array that is finite overflowed what was derived
    from it (``overflow`` says what), which is an error too.
    """
    if not check_finite:
        return
    for name, x, finite, overflow in named:
        if finite:
            continue
        if not _all_finite(x):
            raise ValueError(f"{name} contains NaN or Inf (pass check_finite=False to skip this check)")
        raise ValueError(f"{name} is too large: {overflow} (max |{name}| = {np.abs(x).max():.3g}); "
                         f"scale it down{' or pass float64' if x.dtype != np.float64 else ''}")


def _check_out(name, out, shape, dtype, reads):
    """A caller's output buffer: exact shape and dtype, writeable, sharing no memory
    with ``reads`` (``(name, array)`` pairs the call reads, or other outputs)."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array, got {type(out).__name__}")
    if out.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {out.shape}")
    if out.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype} (the dtype of the result), got {out.dtype}")
    if not out.flags.writeable:
        raise ValueError(f"{name} is read-only")
    for rname, x in reads:
        if isinstance(x, np.ndarray) and np.may_share_memory(out, x):
            raise ValueError(f"{name} must not share memory with {rname}")
    return out


def _target(out, shape, cdt):
    """Where a kernel writes a result of ``shape`` in the compute dtype: the
    caller's buffer ``out`` when it is C-contiguous in that dtype, else an
    array from the pool (README, "Memory")."""
    if out is not None and out.dtype == cdt and out.flags.c_contiguous:
        return out.reshape(shape)
    return POOL.empty(shape, cdt)


def _deliver(result, out, shape, dtype):
    """``result`` as the caller's ``out`` (copied in unless it already is it) or as a new array."""
    if out is None:
        return result.reshape(shape).astype(dtype, copy=False)
    if not np.may_share_memory(result, out):
        out[...] = result.reshape(shape)
    return out


def _chunk(n, G, F, dv):
    """Chunk length: CHUNK tokens unless the float64 partials would outgrow their budget."""
    per_chunk = G * F * (dv + 1) * 8
    max_chunks = max(1, _PARTIAL_BUDGET // max(per_chunk, 1))
    return max(CHUNK, -(-n // max_chunks), 1)


def _sketch_chunk(chunk, n, G):
    """Task length of the non-causal forward: up to SKETCH_CHUNKS chunks, while
    every thread keeps at least 8 tasks.  Its float64 partials (24 KB a task
    at F = 24, dv = 128) are written, then summed by NumPy on one thread:
    with 1024-token tasks at 2^20 tokens x 4 heads that was 100 MB and
    ~7 ms a call; the keys' sketch still sums in float32 for at most
    ``_kernels.SKETCH_RUN`` rows at a time, the queries need no sums."""
    tasks = G * n // (8 * numba.get_num_threads())
    return max(chunk, min(SKETCH_CHUNKS * chunk, tasks // chunk * chunk))


# ---------------------------------------------------------------------------
# forward / backward
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Residuals:
    """What :func:`race_attention_bwd` needs from the forward (treat as opaque).

    Holds O(N * L * R) numbers per head (soft buckets, tanh projections, the
    denominators) plus the O(L * R * dv) sketch or, for causal attention, the
    carried state at every chunk start.  ``v`` is kept by reference (in the
    compute dtype): do not modify it between forward and backward.
    """
    planes: np.ndarray
    beta: float
    causal: bool
    chunk: int
    v: np.ndarray        # (G, Nk, dv)
    phiq: np.ndarray     # (G, Nq, F)
    tq: np.ndarray       # (G, Nq, L*P)
    phik: np.ndarray     # (G, Nk, F)
    tk: np.ndarray       # (G, Nk, L*P)
    den: np.ndarray      # (G, Nq) float64
    A: np.ndarray        # (G, F) total, or (G, nc, F) carries when causal; float64
    B: np.ndarray        # (G, F, dv) total, or (G, nc, F, dv) carries when causal; float64
    lead: tuple
    in_dtypes: tuple
    out_dtype: np.dtype
    check_finite: bool

    @property
    def out_shape(self):
        return self.lead + (self.phiq.shape[1], self.v.shape[2])


def race_attention_fwd(q, k, v, planes, beta=DEFAULT_BETA, *, causal=False, key_mask=None, check_finite=True,
                       out=None):
    """RACE attention forward; returns ``(out, residuals)`` for :func:`race_attention_bwd`.

    Arguments are those of :func:`race_attention`, which computes the same
    ``out`` (bit for bit) without keeping residuals.
    """
    return _forward(q, k, v, planes, beta, causal, key_mask, check_finite, out, residuals=True)


def _forward(q, k, v, planes, beta, causal, key_mask, check_finite, out, residuals):
    """The forward; ``residuals=False``: the soft buckets, projections and
    denominators that only the backward reads stay in per-chunk scratch (the
    kernels get arrays with no rows, see ``_kernels.residual_rows``) and
    ``(out, None)`` is returned.  The causal scan still keeps the keys' phi
    (it reads them after the keys' pass)."""
    POOL.tick()
    a = _prepare(q, k, v, planes, beta, causal, key_mask, check_finite, defer=True)
    if out is not None:
        out = _check_out("out", out, a.lead + (a.q.shape[1], a.v.shape[2]), a.out_dtype,
                         [("q", q), ("k", k), ("v", v), ("key_mask", key_mask)])
    G, nq, _ = a.q.shape
    nk, dv = a.v.shape[1:]
    L, P, _ = a.planes.shape
    F = L * 2 ** P
    cdt = a.q.dtype
    base = _chunk(max(nq, nk), G, F, dv)  # the backward's chunks (and the causal forward's carries)
    chunk = base if causal else _sketch_chunk(base, max(nq, nk), G)
    nck = -(-nk // chunk)
    rq, rk = (nq, nk) if residuals else (0, 0)  # rows kept of the queries' and keys' residuals
    phik = POOL.empty((G, nk if causal else rk, F), cdt)
    tk = POOL.empty((G, rk, L * P), cdt)
    seg = K.scan_segments(G, nck, nk) if causal else 1
    partA = POOL.zeros((G, nck, F))
    partB = POOL.empty((G, nck, F, dv), np.float64)  # the kernels write every value read (causal: the carries)
    phiq = POOL.empty((G, rq, F), cdt)
    tq = POOL.empty((G, rq, L * P), cdt)
    den = POOL.zeros((G, rq))
    o = _target(out, (G, nq, dv), cdt)  # the kernels write every row
    nan_q = nan_k = 0  # NaNs in the hashes' t: a NaN/Inf in q or k, or an overflow
    if G and nk:
        # causal: the B totals of the chunks before the last segment give the segments' carries
        nan_k = K.sketch_chunks(a.k, a.v, a.mask, a.planes, a.beta, chunk, phik, tk, partA, partB,
                                span=K.SCAN_BLOCK if causal else K.SKETCH_FUSED,
                                totals=(0, K.segment_start(seg - 1, seg, nck)) if causal else None)
    if causal:
        A = K.exclusive_scan(partA, out=partA)
        B = K.exclusive_scan(partB, out=partB, segments=seg)  # the segments' first carries; the scan the rest
        sums_v = POOL.zeros((G, F, dv))  # the scan's total of B, for the check of v
        if G and nq:
            nan_q = K.causal_fwd(a.q, a.v, phik, A, B, a.planes, a.beta, chunk, phiq, tq, den, o, final=sums_v,
                                 segments=seg)
    else:
        A, B = partA.sum(1), partB.sum(1)
        sums_v = B
        if G and nq:
            nan_q = K.queries_fwd(a.q, a.planes, a.beta, chunk, A, B.astype(cdt), phiq, tq, den, o)
    overflow = f"its projections onto the planes overflow {cdt}"
    _check_derived(a.check_finite, ("q", a.q, nan_q == 0, overflow), ("k", a.k, nan_k == 0, overflow),
                   ("v", a.v, _all_finite(sums_v), _SUMS_OVERFLOW))
    y = _deliver(o, out, a.lead + (nq, dv), a.out_dtype)
    if not residuals:
        return y, None
    return y, Residuals(a.planes, a.beta, a.causal, base, a.v, phiq, tq, phik, tk, den, A, B,
                        a.lead, a.in_dtypes, a.out_dtype, a.check_finite)


def race_attention_bwd(residuals, grad_out, *, out=None):
    """RACE attention backward.

    Parameters
    ----------
    residuals : Residuals
        From :func:`race_attention_fwd`.
    grad_out : array_like, shape like the forward's output
        Cotangent of the output.
    out : tuple of three ndarrays, optional
        Buffers ``(dq, dk, dv)`` to write the gradients into, each with the
        shape and dtype of its input (see :func:`race_attention`'s ``out``).

    Returns
    -------
    dq, dk, dv : ndarray
        Gradients, each in the dtype of its input (the ``out`` buffers if given).
    dbeta : float
        Gradient w.r.t. beta, summed over every batch, head and token.
    """
    POOL.tick()
    r = residuals
    if not isinstance(r, Residuals):
        raise TypeError(f"residuals must come from race_attention_fwd, got {type(r).__name__}")
    g, _, _ = _check_array("grad_out", grad_out, False)  # NaN/Inf: from what the kernels sum (below)
    G, nq, F = r.phiq.shape
    nk, dv = r.v.shape[1:]
    d = r.planes.shape[2]
    cdt = r.phiq.dtype
    qdt, kdt, vdt = r.in_dtypes
    lead = r.lead
    shapes = (lead + (nq, d), lead + (nk, d), lead + (nk, dv))
    try:
        if g.shape != r.out_shape:
            raise ValueError(f"grad_out must have the output's shape {r.out_shape}, got {g.shape}")
        if out is not None:
            if not isinstance(out, (tuple, list)) or len(out) != 3:
                raise TypeError(f"out must be a tuple of three arrays (dq, dk, dv), got {type(out).__name__}")
            reads = [("grad_out", grad_out), ("the forward's v", r.v)]
            checked = []
            for name, buf, shape, dt in zip(("dq", "dk", "dv"), out, shapes, (qdt, kdt, vdt)):
                checked.append(_check_out(f"out {name}", buf, shape, dt, reads))
                reads.append((f"out {name}", buf))
            out = checked
        else:
            out = (None, None, None)
    except (TypeError, ValueError):
        _check_array("grad_out", g, r.check_finite)  # errors in the eager order: grad_out's NaN first
        raise
    g = np.ascontiguousarray(g.reshape(G, nq, dv), dtype=cdt)
    chunk = r.chunk
    ncq, nck = -(-nq // chunk), -(-nk // chunk)
    # The kernels write every row; without queries or keys they do not run.
    dq, dk, dv_ = (_target(buf, (G,) + shape[-2:], cdt) for buf, shape in zip(out, shapes))
    dbeta = 0.0
    if not (G and nq and nk):
        _check_array("grad_out", g, r.check_finite)  # no kernel sums it
        for x in (dq, dk, dv_):
            x[...] = 0
    else:
        partdA = POOL.zeros((G, ncq, F))
        partdB = POOL.empty((G, ncq, F, dv), np.float64)  # the kernels write every value read
        dbq = POOL.zeros((G, ncq))
        dbk = POOL.zeros((G, nck))
        if r.causal:
            seg = K.scan_segments(G, nck, nk)
            dden = POOL.zeros((G, nq))
            dB = POOL.zeros((G, F, dv))  # the scan's total of dB, for the check of grad_out
            if seg == 1:  # one pass, chunk by chunk (the same bits)
                K.causal_bwd(g, r.v, r.phik, r.tk, r.phiq, r.tq, r.den, r.A, r.B, r.planes, r.beta, chunk,
                             dq, dk, dv_, dden, partdA, partdB, dbq, dbk, final=dB)
            elif seg == 2 and nck >= 3:  # a third of the chunks in one pass (the same bits)
                K.causal_bwd_split(g, r.v, r.phik, r.tk, r.phiq, r.tq, r.den, r.A, r.B, r.planes, r.beta, chunk,
                                   dq, dk, dv_, dden, partdA, partdB, dbq, dbk, final=dB)
            else:
                # the dB totals of the chunks after the first segment give the reverse segments' carries
                K.causal_queries_bwd(g, r.v, r.phik, r.phiq, r.tq, r.den, r.A, r.B, r.planes, r.beta, chunk,
                                     dq, dden, partdA, partdB, dbq, totals=(K.segment_start(1, seg, nck), nck))
                cA = K.exclusive_scan(partdA, True, partdA)  # in place
                cB = K.exclusive_scan(partdB, True, partdB, segments=seg)  # the segments' last chunks
                K.causal_keys_bwd(g, r.v, r.phik, r.tk, r.phiq, r.den, dden, cA, cB, r.planes, r.beta, chunk,
                                  dk, dv_, dbk, final=dB, segments=seg)
            _check_derived(r.check_finite, ("grad_out", g, _all_finite(dB), _SUMS_OVERFLOW))
        else:
            K.queries_bwd(g, r.phiq, r.tq, r.den, r.A, r.B.astype(cdt), r.planes, r.beta, chunk,
                          dq, partdA, partdB, dbq)
            dB = partdB.sum(1)
            _check_derived(r.check_finite, ("grad_out", g, _all_finite(dB), _SUMS_OVERFLOW))  # before the keys' backward
            K.keys_bwd(r.v, r.phik, r.tk, partdA.sum(1), dB.astype(cdt), r.planes, r.beta, chunk,
                       dk, dv_, dbk)
        dbeta = float(dbq.sum() + dbk.sum())
    return tuple(_deliver(x, buf, shape, dt)
                 for x, buf, shape, dt in zip((dq, dk, dv_), out, shapes, (qdt, kdt, vdt))) + (dbeta,)


def race_attention(q, k, v, planes, beta=DEFAULT_BETA, *, causal=False, key_mask=None, check_finite=True,
                   out=None):
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
        Any number (>= 0) of leading batch/head dims, the same for q, k, v.
    planes : array_like, shape (L, P, d)
        Hyperplanes from :func:`racecpu.hyperplanes` (cast to the compute dtype).
    beta : float, default ``DEFAULT_BETA``
        Soft-hash temperature (> 0); larger is closer to hard SimHash buckets.
    causal : bool, default False
        Query i sees keys j <= i (needs Nq == Nk).
    key_mask : bool array, shape (..., Nk), optional
        False keys contribute nothing.
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
        memory with q, k, v.  Without one, the result's memory comes from
        racecpu's pool, which reuses that of dropped results so that a loop
        does not fault fresh pages in every call (README, "Memory").  A
        C-contiguous float32/float64 buffer is written directly.

    Returns
    -------
    out : ndarray, shape (..., Nq, dv)
        float32/float64 follow the inputs; float16 computes in float32 and
        returns float16.  A query whose buckets hold no key mass
        (``den <= DEN_FLOOR``, e.g. every key masked) gets zeros.
    """
    if _is_cupy(q):
        if out is not None:
            raise TypeError("out is for NumPy arrays; CuPy's memory pool already reuses device memory")
        from . import cuda  # noqa: F401  (the CUDA path registers itself lazily)
        return cuda.race_attention(q, k, v, planes, beta, causal=causal, key_mask=key_mask,
                                   check_finite=check_finite)
    return _forward(q, k, v, planes, beta, causal, key_mask, check_finite, out, residuals=False)[0]


def _is_cupy(x):
    return type(x).__module__.split(".")[0] == "cupy"


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

    def __init__(self, head_dim, num_planes=3, num_tables=3, beta=DEFAULT_BETA, seed=0, dtype=np.float32):
        self.planes = hyperplanes(head_dim, num_planes, num_tables, seed=seed, dtype=dtype)
        self.beta = _check_beta(beta)

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

    def __call__(self, q, k, v, *, causal=False, key_mask=None, check_finite=True, out=None):
        return race_attention(q, k, v, self.planes, self.beta, causal=causal, key_mask=key_mask,
                              check_finite=check_finite, out=out)

    def fwd(self, q, k, v, *, causal=False, key_mask=None, check_finite=True, out=None):
        return race_attention_fwd(q, k, v, self.planes, self.beta, causal=causal, key_mask=key_mask,
                                  check_finite=check_finite, out=out)

    def bwd(self, residuals, grad_out, *, out=None):
        return race_attention_bwd(residuals, grad_out, out=out)

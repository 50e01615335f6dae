"""racecpu.cuda: RACE attention on NVIDIA GPUs (numba.cuda kernels, CuPy or device arrays).

The same functions as the CPU package, with the same signatures, semantics,
errors and corner order; only the arrays move::

    import cupy as cp, racecpu, racecpu.cuda as rc
    out, res = rc.race_attention_fwd(cp.asarray(q), cp.asarray(k), cp.asarray(v), planes)
    dq, dk, dv, dbeta = rc.race_attention_bwd(res, cp.ones_like(out))

Inputs may be CuPy arrays, any object with ``__cuda_array_interface__``
(numba device arrays, PyTorch CUDA tensors) or NumPy arrays (copied to the
device).  Outputs are CuPy arrays when ``q`` (or ``x``, or ``grad_out``'s
forward ``q``) is a CuPy array, numba device arrays otherwise; ``dbeta`` is a
Python float.  CuPy is imported only when a CuPy array comes in.

Needs ``numba-cuda`` (``pip install "racecpu[cuda]"``).  Without a GPU the
kernels run under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1`` set
before ``numba.cuda`` is imported): slow, for tests only.

Tuning knobs (module attributes, read at each call): ``THREADS`` threads per
block (= tokens per tile), ``CHUNK`` tokens per block task.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

try:
    from numba import cuda
    from numba.cuda import devicearray as _devicearray
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError('racecpu.cuda needs numba-cuda: pip install "racecpu[cuda]" '
                      f"(import of numba.cuda failed: {exc})") from exc

from .. import attention as _cpu
from ..hashing import DEFAULT_BETA
from . import _kernels as K

__all__ = ["soft_buckets", "race_attention", "race_attention_fwd", "race_attention_bwd", "Residuals",
           "THREADS", "CHUNK"]

#: Threads per block, which is also the tile length in tokens (a multiple of 32 on a GPU).
THREADS = 128
#: Tokens per block task (rounded up to whole tiles); more chunks = more blocks.
CHUNK = 1024
# Cap on the float64 chunk partials / carries (bytes); above it chunks grow.
_PARTIAL_BUDGET = 2 ** 30
# Blocks of the grid-stride helper kernels.
_MAX_BLOCKS = 4096


# ---------------------------------------------------------------------------
# arrays: kind, validation through the CPU checks, moves to and from the device
# ---------------------------------------------------------------------------

def _is_cupy(x):
    return type(x).__module__.split(".")[0] == "cupy"


def _on_device(x):
    return _is_cupy(x) or hasattr(x, "__cuda_array_interface__") or _devicearray.is_cuda_ndarray(x)


def _as_numba(x):
    """A numba device array viewing the device array ``x`` (no copy)."""
    if _devicearray.is_cuda_ndarray(x):
        return x
    return cuda.as_cuda_array(x)


def _proxy(x):
    """Zero-stride NumPy stand-in with the shape and dtype of a device array (no memory)."""
    dtype = np.dtype(x.dtype)
    shape = tuple(int(s) for s in x.shape)
    return np.lib.stride_tricks.as_strided(np.zeros((), dtype), shape=shape, strides=(0,) * len(shape))


def _check_array(name, x, check_finite, min_ndim=2):
    """:func:`racecpu.attention._check_array` for host or device arrays (same errors, same order)."""
    if not _on_device(x):
        return _cpu._check_array(name, x, check_finite, min_ndim)
    _, dt, cdt = _cpu._check_array(name, _proxy(x), False, min_ndim)
    if check_finite and not _all_finite(x):
        raise ValueError(f"{name} contains NaN or Inf (pass check_finite=False to skip this check)")
    return x, dt, cdt


def _launch(n):
    t = int(THREADS)
    return max(1, min(_MAX_BLOCKS, -(-n // t))), t


def _all_finite(x):
    if _is_cupy(x):
        import cupy
        return bool(cupy.isfinite(x).all())
    a = _as_numba(x)
    if a.size == 0:
        return True
    if not (a.is_c_contiguous() and a.dtype in (np.float32, np.float64)):
        a = _to_device(a, np.float64 if a.dtype == np.float64 else np.float32, (a.size,))
    flag = cuda.to_device(np.zeros(1, np.int32))
    K.flag_nonfinite[_launch(a.size)](a.reshape(a.size), flag)
    return not flag.copy_to_host()[0]


def _to_device(x, dtype, shape):
    """C-contiguous numba device array of ``dtype`` and ``shape`` holding ``x`` (a copy unless it fits)."""
    dtype = np.dtype(dtype)
    if not _on_device(x):
        return cuda.to_device(np.ascontiguousarray(np.asarray(x).reshape(shape), dtype=dtype))
    if _is_cupy(x):
        import cupy
        return cuda.as_cuda_array(cupy.ascontiguousarray(x, dtype=dtype).reshape(shape))
    a = _as_numba(x)
    if not a.is_c_contiguous():  # rare: strided numba/torch views go through the host
        return cuda.to_device(np.ascontiguousarray(a.copy_to_host().reshape(shape), dtype=dtype))
    a = a.reshape(shape)
    if a.dtype == dtype:
        return a
    out = cuda.device_array(shape, dtype)
    if a.size:
        K.cast_copy[_launch(a.size)](a.reshape(a.size), out.reshape(a.size))
    return out


def _host(x):
    """Small arrays (planes, masks) as NumPy."""
    if _is_cupy(x):
        return x.get()
    if _on_device(x):
        return _as_numba(x).copy_to_host()
    return x


def _zeros(shape, dtype=np.float64):
    a = cuda.device_array(shape, dtype)
    if a.size:
        K.fill[_launch(a.size)](a.reshape(a.size), 0)
    return a


def _output(a, dtype, shape, cupy_out):
    """Reshape/cast a device result to the caller's dtype and kind."""
    if a.dtype != dtype:
        b = cuda.device_array(a.shape, dtype)
        if a.size:
            K.cast_copy[_launch(a.size)](a.reshape(a.size), b.reshape(a.size))
        a = b
    a = a.reshape(shape)
    if cupy_out:
        import cupy
        return cupy.asarray(a)
    return a


@dataclass(frozen=True)
class _Args:
    q: object
    k: object
    v: object
    mask: object
    planes: object      # device (L, P, d), compute dtype
    beta: float
    lead: tuple
    G: int
    cdt: np.dtype
    out_dtype: np.dtype
    in_dtypes: tuple
    cupy_out: bool


def _prepare(q, k, v, planes, beta, causal, key_mask, check_finite):
    """:func:`racecpu.attention._prepare` for host or device arrays.

    Runs the CPU checks (the per-array ones directly, on zero-stride stand-ins
    of device arrays) and the same cross-shape checks in the same order, then
    moves q, k, v, the mask and the planes to the device in the kernel layout.
    """
    cupy_out = _is_cupy(q)
    q, qdt, _ = _check_array("q", q, check_finite)
    k, kdt, _ = _check_array("k", k, check_finite)
    v, vdt, _ = _check_array("v", v, check_finite)
    pq, pk, pv = (_proxy(x) if _on_device(x) else x for x in (q, k, v))
    cdt, odt = _cpu._dtypes(pq, pk, pv)
    lead = pq.shape[:-2]
    # --- the cross-shape checks of racecpu.attention._prepare, in its order ---
    if pk.shape[:-2] != lead or pv.shape[:-2] != lead:
        raise ValueError(f"q, k, v must have the same leading dims, got shapes q {pq.shape}, k {pk.shape}, "
                         f"v {pv.shape}")
    nq, d = pq.shape[-2:]
    nk = pk.shape[-2]
    if pk.shape[-1] != d:
        raise ValueError(f"q and k must have the same head dim, got shapes q {pq.shape} and k {pk.shape}")
    if pv.shape[-2] != nk:
        raise ValueError(f"k and v must have the same number of tokens, got shapes k {pk.shape} and v {pv.shape}")
    if causal and nq != nk:
        raise ValueError(f"causal attention needs as many queries as keys, got shapes q {pq.shape} and k {pk.shape}")
    planes = _cpu._check_planes(_host(planes), d, cdt)
    beta = _cpu._check_beta(beta)
    G = int(np.prod(lead, dtype=np.int64))
    if key_mask is not None:
        m = _proxy(key_mask) if _on_device(key_mask) else np.asarray(key_mask)
        if m.dtype != np.bool_:
            raise TypeError(f"key_mask must be a bool array, got dtype {m.dtype}")
        if m.shape != lead + (nk,):
            raise ValueError(f"key_mask must have shape {lead + (nk,)} (leading dims + (Nk,)), got {m.shape}")
    # --- to the device, kernel layout ---
    if key_mask is None:
        mask = cuda.device_array((G, nk), np.bool_)
        if mask.size:
            K.fill[_launch(mask.size)](mask.reshape(mask.size), True)
    else:
        mask = _to_device(key_mask, np.bool_, (G, nk))
    dv = pv.shape[-1]
    return _Args(_to_device(q, cdt, (G, nq, d)), _to_device(k, cdt, (G, nk, d)), _to_device(v, cdt, (G, nk, dv)),
                 mask, cuda.to_device(planes), beta, lead, G, np.dtype(cdt), np.dtype(odt), (qdt, kdt, vdt),
                 cupy_out)


def _chunk(n, G, F, dv):
    """Tokens per block task: CHUNK (whole tiles) unless the float64 partials outgrow their budget."""
    t = int(THREADS)
    per_chunk = G * F * (dv + 1) * 8
    max_chunks = max(1, _PARTIAL_BUDGET // max(per_chunk, 1))
    c = max(int(CHUNK), -(-n // max_chunks), 1)
    return -(-c // t) * t


# ---------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------

def soft_buckets(x, planes, beta=DEFAULT_BETA):
    """Soft bucket probabilities on the GPU; see :func:`racecpu.soft_buckets`.

    Returns a device array (CuPy if ``x`` is CuPy) of shape ``(..., N, L, 2**P)``.
    """
    cupy_out = _is_cupy(x)
    x, out_dtype, cdt = _check_array("x", x, check_finite=True)
    px = _proxy(x) if _on_device(x) else x
    planes = _cpu._check_planes(_host(planes), px.shape[-1], cdt)
    beta = _cpu._check_beta(beta)
    L, P, d = planes.shape
    R = 2 ** P
    lead = px.shape[:-1]
    M = int(np.prod(lead, dtype=np.int64))
    flat = _to_device(x, cdt, (M, d))
    phi = cuda.device_array((M, L * R), cdt)
    t = cuda.device_array((M, L * P), cdt)
    if M:
        kern = K.make_kernels(L * R, int(THREADS), np.dtype(cdt))["soft_hash_rows"]
        kern[-(-M // int(THREADS)), int(THREADS)](flat, cuda.to_device(planes), beta, t, phi)
    return _output(phi, out_dtype, lead + (L, R), cupy_out)


@dataclass(frozen=True)
class Residuals:
    """What :func:`race_attention_bwd` needs from the forward (device arrays; treat as opaque).

    O(N * L * R) per head (soft buckets, tanh projections, denominators) plus
    the O(L * R * dv) sketch ``S (G, F, dv + 1)`` (B, then A in the last
    column) or, for causal attention, the float64 carried state at every chunk
    start ``(G, nc, F, dv + 1)``.  ``v`` is kept by reference when it already
    is a contiguous device array of the compute dtype: do not modify it
    between forward and backward.
    """
    planes: object
    beta: float
    causal: bool
    chunk: int
    threads: int
    v: object
    phiq: object
    tq: object
    phik: object
    tk: object
    den: object
    S: object
    lead: tuple
    in_dtypes: tuple
    out_dtype: np.dtype
    check_finite: bool
    cupy_out: bool

    @property
    def out_shape(self):
        return self.lead + (self.phiq.shape[1], self.v.shape[2])


def race_attention_fwd(q, k, v, planes, beta=DEFAULT_BETA, *, causal=False, key_mask=None, check_finite=True):
    """RACE attention forward on the GPU; returns ``(out, residuals)``.

    Arguments and results as :func:`racecpu.race_attention_fwd`; arrays are
    on the device (see the module docstring).
    """
    a = _prepare(q, k, v, planes, beta, causal, key_mask, check_finite)
    G, nq, _ = a.q.shape
    nk, dv = a.v.shape[1:]
    L, P, _ = a.planes.shape
    F = L * 2 ** P
    cdt = a.cdt
    T = int(THREADS)
    kern = K.make_kernels(F, T, cdt)
    chunk = _chunk(max(nq, nk), G, F, dv)
    nck = -(-nk // chunk)
    phik = cuda.device_array((G, nk, F), cdt)
    tk = cuda.device_array((G, nk, L * P), cdt)
    part = _zeros((G, nck, F, dv + 1))
    phiq = cuda.device_array((G, nq, F), cdt)
    tq = cuda.device_array((G, nq, L * P), cdt)
    den = cuda.device_array((G, nq), np.float64)
    out = cuda.device_array((G, nq, dv), cdt)
    if G and nk:
        kern["sketch_chunks"][G * nck, T](a.k, a.v, a.mask, a.planes, a.beta, chunk, phik, tk, part)
    E = F * (dv + 1)
    if causal:
        S = cuda.device_array(part.shape, np.float64)
        if S.size:
            K.scan_chunks[_launch(G * E)](part.reshape(G, nck, E), S.reshape(G, nck, E), False)
        if G and nq:
            state = cuda.device_array((G * nck, F, dv + 1), cdt)
            kern["causal_fwd"][G * nck, T](a.q, a.v, phik, S, a.planes, a.beta, chunk, state, phiq, tq, den, out)
    else:
        S = _sum_chunks(part)
        if G and nq:
            Sc = _to_device(S, cdt, S.shape)
            kern["queries_fwd"][G * -(-nq // T), T](a.q, a.planes, a.beta, Sc, phiq, tq, den, out)
    res = Residuals(a.planes, a.beta, bool(causal), chunk, T, a.v, phiq, tq, phik, tk, den, S,
                    a.lead, a.in_dtypes, a.out_dtype, bool(check_finite), a.cupy_out)
    return _output(out, a.out_dtype, res.out_shape, a.cupy_out), res


def _sum_chunks(part):
    G, nc, F, dv1 = part.shape
    S = cuda.device_array((G, F, dv1), np.float64)
    if S.size:
        K.sum_chunks[_launch(S.size)](part.reshape(G, nc, F * dv1), S.reshape(G, F * dv1))
    return S


def race_attention_bwd(residuals, grad_out):
    """RACE attention backward on the GPU; see :func:`racecpu.race_attention_bwd`.

    Returns
    -------
    dq, dk, dv : device arrays (CuPy if the forward's ``q`` was CuPy)
        Each in the dtype of its input.
    dbeta : float
    """
    r = residuals
    if not isinstance(r, Residuals):
        raise TypeError(f"residuals must come from racecpu.cuda.race_attention_fwd, got {type(r).__name__}")
    g, _, _ = _check_array("grad_out", grad_out, r.check_finite)
    gshape = tuple(int(s) for s in g.shape)
    if gshape != r.out_shape:
        raise ValueError(f"grad_out must have the output's shape {r.out_shape}, got {gshape}")
    G, nq, F = r.phiq.shape
    nk, dv = r.v.shape[1:]
    L, P, d = r.planes.shape
    cdt = np.dtype(r.phiq.dtype)
    if r.threads != int(THREADS):
        raise RuntimeError(f"racecpu.cuda.THREADS changed between forward ({r.threads}) and backward ({THREADS})")
    T = r.threads
    kern = K.make_kernels(F, T, cdt)
    g = _to_device(g, cdt, (G, nq, dv))
    chunk = r.chunk
    ncq, nck = -(-nq // chunk), -(-nk // chunk)
    dq = cuda.device_array((G, nq, d), cdt)
    dk = cuda.device_array((G, nk, d), cdt)
    dv_ = cuda.device_array((G, nk, dv), cdt)
    dbeta = 0.0
    if G and nq and nk:
        part = _zeros((G, ncq, F, dv + 1))
        dden = cuda.device_array((G, nq), np.float64)
        winv = cuda.device_array((G, nq), np.float64)
        dbq = cuda.device_array(G * ncq, np.float64)
        E = F * (dv + 1)
        if r.causal:
            state = cuda.device_array((G * ncq, F, dv + 1), cdt)
            kern["causal_queries_bwd"][G * ncq, T](g, r.v, r.phik, r.phiq, r.tq, r.den, r.S, r.planes, r.beta,
                                                   chunk, state, dq, dden, winv, part, dbq)
            carry = cuda.device_array(part.shape, np.float64)
            K.scan_chunks[_launch(G * E)](part.reshape(G, ncq, E), carry.reshape(G, ncq, E), True)
            dbk = cuda.device_array(G * nck, np.float64)
            kern["causal_keys_bwd"][G * nck, T](g, r.v, r.phik, r.tk, r.phiq, dden, winv, carry, r.planes, r.beta,
                                                chunk, state, dk, dv_, dbk)
        else:
            Sc = _to_device(r.S, cdt, r.S.shape)
            kern["queries_bwd"][G * ncq, T](g, r.phiq, r.tq, r.den, Sc, r.planes, r.beta, chunk,
                                            dq, dden, winv, part, dbq)
            dS = _to_device(_sum_chunks(part), cdt, (G, F, dv + 1))
            nbk = G * -(-nk // T)
            dbk = cuda.device_array(nbk, np.float64)
            kern["keys_bwd"][nbk, T](r.v, r.phik, r.tk, dS, r.planes, r.beta, dk, dv_, dbk)
        dbeta = float(dbq.copy_to_host().sum() + dbk.copy_to_host().sum())
    else:  # no queries or no keys: nothing flows back
        for x in (dq, dk, dv_):
            if x.size:
                K.fill[_launch(x.size)](x.reshape(x.size), 0)
    qdt, kdt, vdt = r.in_dtypes
    lead = r.lead
    return (_output(dq, qdt, lead + (nq, d), r.cupy_out),
            _output(dk, kdt, lead + (nk, d), r.cupy_out),
            _output(dv_, vdt, lead + (nk, dv), r.cupy_out),
            dbeta)


def race_attention(q, k, v, planes, beta=DEFAULT_BETA, *, causal=False, key_mask=None, check_finite=True):
    """RACE attention on the GPU; see :func:`racecpu.race_attention`.

    Returns a device array (CuPy if ``q`` is CuPy) of shape ``(..., Nq, dv)``.
    """
    return race_attention_fwd(q, k, v, planes, beta, causal=causal, key_mask=key_mask,
                              check_finite=check_finite)[0]

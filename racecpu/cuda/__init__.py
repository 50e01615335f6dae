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

Two formulations compute the same numbers (:data:`PATH`): the *chunkwise*
one (:mod:`racecpu.chunkwise` on CuPy: per chunk of tokens the state
``phi_k^T [v, 1]``, a blocked float64 scan over chunks, and inside a chunk a
recurrence or small products; :class:`CudaOps` runs these steps as the fused
kernels of ``racecpu.cuda._chunk_kernels``, and the array expressions, batched
cuBLAS products over chunks of :data:`SCAN_CHUNK`, where a kernel does not
take the shape), taken by default
where CuPy is installed, and the *tile* kernels of ``racecpu.cuda._kernels``
(one thread per token, states in per-block scratch), which also take packed
sequences.  16-bit inputs are widened a segment at a time in the chunkwise
form (:data:`WORKSPACE`), an element at a time in the tile kernels' registers
(``racecpu.cuda._kernels.load``; their results are written in the inputs'
dtypes, rounded once: ``store``).

Needs ``numba-cuda`` (``pip install "racecpu[cuda]"``).  Without a GPU the
kernels run under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1`` set
before ``numba.cuda`` is imported): slow, for tests only.

Tuning knobs (module attributes, read at each call): ``THREADS`` threads per
block (= tokens per tile), ``CHUNK`` tokens per block task (the chunk model
of :data:`BACKEND`, from which :func:`racecpu.plan.make_plan` cuts a call).  The backward
keeps ``L * 2**P`` float64 per thread in local memory, comfortable for the
usual ``P <= 8``; very large ``P`` is for the CPU path.

Without a GPU the tests run both formulations under the simulator (the
chunkwise one on NumPy) and compile every kernel to PTX; with
``RACECPU_TEST_GPU=1`` they run on the card (124 passed on an H200).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

try:
    from numba import cuda
    from numba.cuda import devicearray as _devicearray
    from numba.cuda.cudadrv.error import CudaSupportError  # the simulator's own class under it
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError('racecpu.cuda needs numba-cuda: pip install "racecpu[cuda]" '
                      f"(import of numba.cuda failed: {exc})") from exc

from .. import _checks as cpu_checks
from .._arrays import is_cupy as _is_cupy
from .._arrays import on_device
from ..hashing import DEFAULT_BETA, DEN_FLOOR
from .. import bucket_mean, chunkwise
from ..plan import ChunkModel, make_plan
from . import _kernels as cuda_kernels
from ._chunk_kernels import backward_shared_items, hash_fits, make_chunk_kernels, make_hash_kernels

__all__ = ["soft_buckets", "race_attention", "race_attention_fwd", "race_attention_bwd", "Residuals",
           "ChunkwiseResiduals", "is_available", "BACKEND", "THREADS", "CHUNK", "PATH", "SCAN_CHUNK",
           "SUM_CHUNK", "WORKSPACE", "WORKSPACE_SHARE", "KEEP_BUCKETS", "Bfloat16", "BucketMeanResiduals", "ESTIMATORS"]

#: Threads per block, which is also the tile length in tokens (a multiple of 32 on a GPU).
THREADS = 64
#: Tokens per block task (rounded up to whole tiles); more chunks = more blocks.
CHUNK = 1024
#: Cap on the float64 chunk partials / carries (bytes); above it chunks grow.
PARTIAL_BUDGET = 2 ** 30
# Blocks of the grid-stride helper kernels.
_MAX_BLOCKS = 4096
_PLANE_ROWS = 256  # fewest rows a block of the planes' gradient sums (tests lower it to cross blocks)
#: The estimators racecpu.cuda computes: all of the CPU's (``racecpu.backend.ESTIMATORS``).
ESTIMATORS = ("ratio", "bucket_mean")
#: Which formulation runs a call: "chunkwise" (:mod:`racecpu.chunkwise`: batched
#: products through CuPy and cuBLAS), "tiles" (the numba.cuda kernels of
#: ``racecpu.cuda._kernels``, one thread per token), or "auto": chunkwise where
#: CuPy is installed and the GPU is real, tiles otherwise and for packed sequences
#: (``cu_seqlens``), which the chunkwise form does not take yet.  Read at each forward.
PATH = "auto"
#: Tokens per chunk of the chunkwise causal scan (the C x C products inside a chunk).
SCAN_CHUNK = 64
#: Rows per float32 partial of the chunkwise non-causal sketch (partials summed in float64).
SUM_CHUNK = 1024
#: Bytes of temporaries one slab of the chunkwise form may use, at least: as many whole key/value
#: heads as fit, and a head that does not fit alone is cut into segments of tokens (each within it;
#: a segment costs the kernels' launches again).
WORKSPACE = 2 ** 31
#: ... or this share of the call's eight arrays (q, k, v, out and their gradients at their dtypes)
#: where that is more: long calls take longer segments (fewer launches), and their temporaries
#: stay under 8 % of what the caller holds, which with the residuals (7 % of float32 arrays at
#: d = 128 with the buckets kept, 5 % of 16-bit ones with the projections) is issue 55's bound of
#: 15 %.  At 2^22 tokens x 4 heads x 128 in float32 a head is one segment, as timed on an H200.
WORKSPACE_SHARE = 0.08
#: Whether the chunkwise forward keeps the soft buckets of q and k for the backward (``F + L * P``
#: numbers a row), else only their projections (``L * P``), from which the backward makes the same
#: buckets again (one pass over them, no more reads of q or k).  None: kept for 32- and 64-bit
#: inputs, remade for 16-bit ones, where kept buckets would be 13 % of the eight arrays at d = 128
#: (issue 55's bound on memory is 15 %).
KEEP_BUCKETS = None


# ---------------------------------------------------------------------------
# arrays: kind, validation through the CPU checks, moves to and from the device
# ---------------------------------------------------------------------------

class Bfloat16:
    """bfloat16 numbers on the GPU: ``bits``, a CuPy array or any ``__cuda_array_interface__``
    object of int16 or uint16, read as bfloat16 patterns (CuPy and numba.cuda have no bfloat16;
    a torch bfloat16 tensor ``t`` crosses as ``Bfloat16(t.view(torch.int16))``).

    The chunkwise form (:data:`PATH`) takes them for ``q``, ``k``, ``v`` and ``grad_out``: it
    widens a segment at a time, never the whole array (:data:`WORKSPACE`), and returns the results
    of a bfloat16 call as ``Bfloat16`` too (``bits`` int16: CuPy for CuPy callers, numba device
    arrays otherwise), rounded to nearest even.  Needs ml_dtypes for the dtype the checks see
    (``pip install "racecpu[bf16]"``).  The tile kernels (``PATH = "tiles"``, packed sequences)
    read the bits in their kernels and write their results' bits, rounded the same way.
    """

    def __init__(self, bits):
        dt = np.dtype(_proxy(bits).dtype) if _on_device(bits) else None
        if dt is None or dt.kind not in "iu" or dt.itemsize != 2:
            raise TypeError("Bfloat16 takes a device array of int16 or uint16 bit patterns, got "
                            f"{type(bits).__name__} of dtype {dt}")
        self.bits = bits

    @property
    def shape(self):
        return tuple(int(s) for s in self.bits.shape)

    @property
    def dtype(self):
        from .._arrays import bfloat16
        dt = bfloat16()
        if dt is None:
            raise ImportError('racecpu.cuda.Bfloat16 needs ml_dtypes: pip install "racecpu[bf16]"')
        return dt

    def __repr__(self):
        return f"racecpu.cuda.Bfloat16(shape={self.shape})"


def _on_device(x):
    return on_device(x) or _devicearray.is_cuda_ndarray(x)


def _as_numba(x):
    """A numba device array viewing the device array ``x`` (no copy)."""
    if _devicearray.is_cuda_ndarray(x):
        return x
    return cuda.as_cuda_array(x)


def _proxy(x):
    """Zero-stride NumPy stand-in with the shape and dtype of a device array (no memory)."""
    if isinstance(x, Bfloat16):
        return np.lib.stride_tricks.as_strided(np.zeros((), x.dtype), shape=x.shape, strides=(0,) * len(x.shape))
    if not _is_cupy(x):
        x = _as_numba(x)  # NumPy dtypes for torch tensors and other interface owners
    dtype = np.dtype(x.dtype)
    shape = tuple(int(s) for s in x.shape)
    return np.lib.stride_tricks.as_strided(np.zeros((), dtype), shape=shape, strides=(0,) * len(shape))


def _check_array(name, x, check_finite, dev, min_ndim=2):
    """:func:`racecpu._checks.check_array` for host or device arrays (same errors, same order)."""
    if isinstance(x, Bfloat16):
        _, dt, cdt = cpu_checks.check_array(name, _proxy(x), False, min_ndim)
        if check_finite and not _all_finite(_kernel_array(x), dev):  # the bits widened as the kernels read them
            raise ValueError(f"{name} contains NaN or Inf (pass check_finite=False to skip this check)")
        return x, dt, cdt
    if not _on_device(x):
        return cpu_checks.check_array(name, x, check_finite, min_ndim)
    _, dt, cdt = cpu_checks.check_array(name, _proxy(x), False, min_ndim)
    if check_finite and not _all_finite(x, dev):
        raise ValueError(f"{name} contains NaN or Inf (pass check_finite=False to skip this check)")
    return x, dt, cdt


def _launch(n):
    t = int(THREADS)
    return max(1, min(_MAX_BLOCKS, -(-n // t))), t


class _Device:
    """Where one call allocates and launches.

    CuPy callers get CuPy's memory pool and CuPy's current stream (so results
    are ordered with their other CuPy work and ``cupy`` memory statistics see
    everything); other callers get numba allocations on the default stream.
    """

    def __init__(self, use_cupy):
        self.cupy = bool(use_cupy)
        try:  # every call starts here: the first to touch the driver
            if self.cupy:
                import cupy
                self._cp = cupy
                ptr = cupy.cuda.get_current_stream().ptr
                self.stream = cuda.external_stream(ptr) if ptr else cuda.default_stream()
            else:
                self.stream = cuda.default_stream()
        except CudaSupportError as exc:
            raise RuntimeError("racecpu.cuda found no usable CUDA driver or GPU (numba's error above); "
                               "racecpu.cuda.is_available() tells whether there is one. On a machine with "
                               'an NVIDIA GPU, pip install "racecpu[cuda]" (CUDA 12) or "racecpu[cuda13]" '
                               "(CUDA 13) installs the GPU extras; without one, racecpu's own functions "
                               "run on NumPy arrays on the CPU") from exc

    def empty(self, shape, dtype):
        if self.cupy:
            return cuda.as_cuda_array(self._cp.empty(shape, dtype))
        return cuda.device_array(shape, dtype, stream=self.stream)

    def full(self, shape, dtype, value):
        a = self.empty(shape, dtype)
        if a.size:
            self.grid(cuda_kernels.fill, a.size)(a.reshape(a.size), value)
        return a

    def to_device(self, host):
        host = np.ascontiguousarray(host)
        if self.cupy:
            return cuda.as_cuda_array(self._cp.asarray(host))
        return cuda.to_device(host, stream=self.stream)

    def launch(self, kernel, blocks, threads):
        return kernel[blocks, threads, self.stream]

    def grid(self, kernel, n):
        """A grid-stride kernel over n items."""
        b, t = _launch(n)
        return kernel[b, t, self.stream]

    def cast(self, a, dtype, shape):
        """``a`` (contiguous device array) as a new contiguous array of ``dtype`` and ``shape``."""
        out = self.empty(shape, dtype)
        if a.size:
            self.grid(cuda_kernels.cast_copy, a.size)(a.reshape(a.size), out.reshape(a.size))
        return out

    def to_host(self, a):
        return a.copy_to_host(stream=self.stream)


def _rows_view(a, M, E):
    """``a`` (C-contiguous, ``M * E`` elements) as an ``(M, E)`` view that a kernel writes into."""
    if not a.flags.c_contiguous or a.size != M * E:
        raise ValueError(f"an output of the soft hash must be C-contiguous with {M} x {E} elements, "
                         f"got shape {a.shape}")
    return a.reshape(M, E)


def _all_finite(x, dev):
    if _is_cupy(x):
        import cupy
        return bool(cupy.isfinite(x).all())
    a = _as_numba(x)
    if a.size == 0:
        return True
    if not a.is_c_contiguous():  # (flag_nonfinite reads float16 and bfloat16 bits as they are)
        a = _to_device(a, None, (a.size,), dev)
    flag = dev.to_device(np.zeros(1, np.int32))
    dev.grid(cuda_kernels.flag_nonfinite, a.size)(a.reshape(a.size), flag)
    return not dev.to_host(flag)[0]


def _to_device(x, dtype, shape, dev):
    """C-contiguous numba device array of ``dtype`` (None: ``x``'s own) and ``shape`` holding ``x``
    (a copy unless it fits)."""
    if isinstance(x, Bfloat16):
        if dtype is not None and np.dtype(dtype) != x.dtype:   # widened whole (the per-bucket mean's)
            xp = _bfloat16_xp()
            wide = chunkwise.Bfloat16Bits(xp, _as_xp(xp, x.bits).view(np.uint16)).astype(dtype)
            wide = wide.reshape(shape)
            return dev.to_device(wide) if xp is np else cuda.as_cuda_array(xp.ascontiguousarray(wide))
        b = x.bits if _is_cupy(x.bits) else _as_numba(x.bits)
        if _is_cupy(b):
            import cupy
            b = cupy.ascontiguousarray(b)
        elif not b.is_c_contiguous():
            b = dev.to_device(dev.to_host(b))
        return Bfloat16(b.reshape(shape))
    if dtype is None:
        dtype = _proxy(x).dtype if _on_device(x) else np.asarray(x).dtype
    dtype = np.dtype(dtype)
    if not _on_device(x):
        return dev.to_device(np.asarray(x).reshape(shape).astype(dtype, copy=False))
    if _is_cupy(x):
        import cupy
        return cuda.as_cuda_array(cupy.ascontiguousarray(x, dtype=dtype).reshape(shape))
    a = _as_numba(x)
    if not a.is_c_contiguous():  # rare: strided numba/torch views go through the host
        return dev.to_device(dev.to_host(a).reshape(shape).astype(dtype, copy=False))
    a = a.reshape(shape)
    return a if a.dtype == dtype else dev.cast(a, dtype, shape)


def _host(x):
    """Small arrays (planes) as NumPy."""
    if isinstance(x, Bfloat16):
        return chunkwise.Bfloat16Bits(np, np.ascontiguousarray(_host(x.bits)).view(np.uint16)).astype(np.float32)
    if _is_cupy(x):
        return x.get()
    if _on_device(x):
        return _as_numba(x).copy_to_host()
    return x


def _bfloat16_xp():
    """The array module that widens and rounds bfloat16 bits in array expressions (the per-bucket
    mean's inputs, the soft hash's results): CuPy on a GPU, NumPy under the simulator."""
    try:
        return _xp()
    except ImportError as exc:
        raise ImportError('racecpu.cuda.Bfloat16 needs CuPy (pip install "racecpu[cuda]"): numba.cuda has no '
                          "bfloat16") from exc


def _kernel_dtype(dtype):
    """The dtype of a kernel's array for a caller's ``dtype``: bfloat16 as its ``uint16`` bits."""
    return np.dtype(np.uint16) if chunkwise.is_bfloat16(dtype) else np.dtype(dtype)


def _kernel_array(x):
    """A device array as the tile kernels read it: :class:`Bfloat16` as a numba ``uint16`` view of
    its bits (no copy), other arrays as they are."""
    if not isinstance(x, Bfloat16):
        return x
    return _as_numba(x.bits).view(np.uint16)


def _output(a, dtype, shape, dev):
    """Reshape/cast a device result to the caller's dtype and kind (bfloat16: :class:`Bfloat16`
    bits, rounded to nearest even; a ``uint16`` result of the tile kernels already holds them)."""
    if chunkwise.is_bfloat16(dtype) and np.dtype(a.dtype) == np.uint16:
        bits = a.view(np.int16).reshape(shape)
        return Bfloat16(dev._cp.asarray(bits) if dev.cupy else bits)
    if chunkwise.is_bfloat16(dtype):
        xp = _bfloat16_xp()
        bits = chunkwise.Bfloat16Bits.empty(xp, shape)
        bits[...] = _as_xp(xp, a).reshape(shape)
        return _from_xp(xp, bits, dev)
    if a.dtype != dtype:
        a = dev.cast(a, dtype, a.shape)
    a = a.reshape(shape)
    if dev.cupy:
        return dev._cp.asarray(a)
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
    cdt: np.dtype
    out_dtype: np.dtype
    in_dtypes: tuple
    group: int = 1  # query heads per key/value head: k, v and mask have G // group groups


def _prepare(q, k, v, planes, beta, causal, key_mask, check_finite, dev, widen=True):
    """:func:`racecpu._checks.prepare` for host or device arrays.

    Runs the CPU checks (the per-array ones directly, on zero-stride stand-ins
    of device arrays) and the same cross-shape checks in the same order, then
    moves q, k, v, the mask and the planes to the device in the kernel layout:
    q, k, v in the compute dtype, or (``widen=False``) in their own dtype; no
    mask array where ``key_mask`` is None.
    """
    q, qdt, _ = _check_array("q", q, check_finite, dev)
    k, kdt, _ = _check_array("k", k, check_finite, dev)
    v, vdt, _ = _check_array("v", v, check_finite, dev)
    pq, pk, pv = (_proxy(x) if _on_device(x) else x for x in (q, k, v))
    pm = None if key_mask is None else (_proxy(key_mask) if _on_device(key_mask) else key_mask)
    # the CPU's checks and messages (grouped-query shapes included)
    cdt, odt, lead, G, planes, beta, group = cpu_checks.check_args(pq, pk, pv, _host(planes), beta, causal, pm, True)
    Gk = G // group
    nq, d = pq.shape[-2:]
    nk = pk.shape[-2]
    # --- to the device, kernel layout ---
    mask = None if key_mask is None else _to_device(key_mask, np.bool_, (Gk, nk), dev)
    dv = pv.shape[-1]
    wdt = cdt if widen else None
    return _Args(_to_device(q, wdt, (G, nq, d), dev), _to_device(k, wdt, (Gk, nk, d), dev),
                 _to_device(v, wdt, (Gk, nk, dv), dev), mask, dev.to_device(planes), beta, lead,
                 np.dtype(cdt), np.dtype(odt), (qdt, kdt, vdt), group)


def chunk_model():
    """How racecpu.cuda cuts sequences: CHUNK tokens in whole tiles of THREADS, PARTIAL_BUDGET
    bytes of float64 partials, packed sequences padded to whole chunks (read per call)."""
    return ChunkModel(int(CHUNK), int(PARTIAL_BUDGET), int(THREADS), padded=True)


def _sum_chunks(part, dev, bounds):
    """Second level of the sketch reduction: float64 sums of the block partials, one per
    packed sequence (chunks ``bounds[s] .. bounds[s + 1]``, a device array): ``(G, S, F, dv + 1)``."""
    G, nc, F, dv1 = part.shape
    S = dev.empty((G, bounds.shape[0] - 1, F, dv1), np.float64)
    if S.size:
        dev.grid(cuda_kernels.sum_chunks, S.size)(part.reshape(G, nc, F * dv1), bounds, S.reshape(G, S.shape[1], F * dv1))
    return S


def _scan_chunks(part, dev, reverse, seq):
    """Exclusive float64 scan of the block totals over chunks (the carries), restarting
    at each packed sequence (``seq``: each chunk's, a device array)."""
    G, nc, F, dv1 = part.shape
    out = dev.empty(part.shape, np.float64)
    if out.size:
        E = F * dv1
        dev.grid(cuda_kernels.scan_chunks, G * E)(part.reshape(G, nc, E), seq, out.reshape(G, nc, E), reverse)
    return out


@dataclass(frozen=True)
class _Layout:
    """Packed sequences on the device (see :mod:`racecpu.packing`): the host
    :class:`racecpu.packing.Packing` (None: one sequence), each chunk's sequence
    ``seq`` and the sequences' chunk bounds ``bounds`` as device arrays, and
    ``rows`` (each token's row in the padded layout; None: nothing moves)."""
    packing: object
    chunk: int
    seq: object
    bounds: object
    rows: object

    @classmethod
    def make(cls, plan, n, dev):
        """The layout of a call of ``n`` tokens cut by ``plan`` (:func:`racecpu.plan.make_plan`
        with this backend's chunk model)."""
        if plan.packing is None:
            chunk = plan.chunk
            nc = -(-n // chunk)
            return cls(None, chunk, dev.to_device(np.zeros(nc, np.int64)),
                       dev.to_device(np.array([0, nc], np.int64)), None)
        pk = plan.packing
        bounds = np.append(pk.first, pk.seq.size).astype(np.int64)
        return cls(pk, pk.chunk, dev.to_device(pk.seq), dev.to_device(bounds),
                   None if pk.rows is None else dev.to_device(pk.rows))

    def pack(self, x, dev, fill=0):
        """``x (G, n, ...)`` in the padded layout (``x`` itself where nothing moves)."""
        if self.rows is None:
            return x
        G, n = x.shape[:2]
        E = x.size // max(G * n, 1)
        y = dev.full((G, self.packing.padded) + tuple(x.shape[2:]), x.dtype, fill)
        if x.size:
            dev.grid(cuda_kernels.scatter_rows, x.size)(x.reshape(G, n, E), self.rows, y.reshape(G, self.packing.padded, E))
        return y

    def unpack(self, y, dev):
        """The tokens' rows of ``y (G, padded, ...)``."""
        if self.rows is None:
            return y
        G, m = y.shape[:2]
        n = self.packing.n
        E = y.size // max(G * m, 1)
        x = dev.empty((G, n) + tuple(y.shape[2:]), y.dtype)
        if x.size:
            dev.grid(cuda_kernels.gather_rows, x.size)(y.reshape(G, m, E), self.rows, x.reshape(G, n, E))
        return x


def _fold(x, group, dev):
    """``x (Gk * group, ...)`` summed over each run of ``group`` heads (the gradients of k, v)."""
    if group == 1:
        return x
    Gk = x.shape[0] // group
    y = dev.empty((Gk,) + tuple(x.shape[1:]), x.dtype)
    if y.size:
        M = y.size // Gk
        dev.grid(cuda_kernels.fold_groups, y.size)(x.reshape(Gk * group, M), y.reshape(Gk, M), group)
    return y


# ---------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------

def is_available():
    """True if numba.cuda sees a usable GPU (or runs under the CUDA simulator)."""
    return bool(cuda.is_available())


def soft_buckets(x, planes, beta=DEFAULT_BETA):
    """Soft bucket probabilities on the GPU; see :func:`racecpu.soft_buckets`.

    Returns a device array (CuPy if ``x`` is CuPy) of shape ``(..., N, L, 2**P)``.
    """
    dev = _Device(_is_cupy(x))
    x, out_dtype, cdt = _check_array("x", x, True, dev)
    px = _proxy(x) if _on_device(x) else x
    planes = cpu_checks.check_planes(_host(planes), px.shape[-1], cdt)
    beta = cpu_checks.check_beta(beta)
    L, P, d = planes.shape
    R = 2 ** P
    lead = px.shape[:-1]
    M = int(np.prod(lead, dtype=np.int64))
    phi = dev.empty((M, L * R), cdt)
    t = dev.empty((M, L * P), cdt)
    if M:
        T = int(THREADS)
        kern = cuda_kernels.make_kernels(L, P, T, np.dtype(cdt))["soft_hash_rows"]
        dev.launch(kern, -(-M // T), T)(_kernel_array(_to_device(x, None, (M, d), dev)), dev.to_device(planes), beta,
                                        t, phi)
    return _output(phi, out_dtype, lead + (L, R), dev)


@dataclass(frozen=True)
class Residuals:
    """What :func:`race_attention_bwd` needs from the forward (device arrays; treat as opaque).

    O(N * L * R) per head (soft buckets, tanh projections, denominators) plus
    the float64 sketch ``S (G, F, dv + 1)`` (B, then A in the last column)
    or, for causal attention, the float64 carried state at every chunk start
    ``(G, nc, F, dv + 1)``.  ``v`` is kept by reference (in its own dtype;
    :class:`Bfloat16`: a ``uint16`` view of its bits) when it already is a
    contiguous device array and no packed sequences are padded: do not modify
    it between forward and backward.  They record the backend that runs their backward
    (``backend``, :func:`racecpu.backend.backend_of`: :data:`BACKEND`).
    """

    backend: ClassVar[str] = "cuda"
    estimator: ClassVar[str] = "ratio"

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
    tokens: int = -1  # the forward's sequence length (the rows above may be padded: packed sequences)
    group: int = 1  # query heads per key/value head; v and the rows above have q's heads
    layout: object = None  # _Layout: packed sequences (or one), the chunks' sequences
    q_in: object = None  # the caller's q and k by reference (None: planes_grad=False), for dplanes only
    k_in: object = None
    planes_dtype: object = None  # the dtype of the planes' gradient

    @property
    def out_shape(self):
        return self.lead + (self.tokens, self.v.shape[2])


    @property
    def kv_lead(self):
        return cpu_checks.kv_lead(self.lead, self.group)


def _grad_out(r, grad_out):
    """``(device, grad_out)`` of a backward: the forward's kind of device, ``grad_out`` checked
    (finite where the forward checked, the output's shape)."""
    dev = _Device(r.cupy_out)
    g, _, _ = _check_array("grad_out", grad_out, r.check_finite, dev)
    gshape = tuple(int(s) for s in g.shape)
    if gshape != r.out_shape:
        raise ValueError(f"grad_out must have the output's shape {r.out_shape}, got {gshape}")
    return dev, g


_NO_Q_K = ("these residuals keep no q and k: their forward was told the planes' gradient would not be asked for "
           "(planes_grad=False)")


def _planes_dtype(planes, cdt):
    """The dtype of the planes' gradient (:func:`racecpu._checks.planes_grad_dtype`) of host or
    device planes."""
    return cpu_checks.planes_grad_dtype(_proxy(planes).dtype if _on_device(planes) else np.asarray(planes).dtype, cdt)


def _plane_sums(pairs, dev):
    """The sum of ``du^T x`` over the ``(du (G, n, L * P) float64, x (G, n, d))`` pairs, flat
    ``(L * P * d,)`` float64 on the device: the planes' gradient of the tile kernels' backward
    (blocks of rows summed by :func:`racecpu.cuda._kernels.plane_sums`, then their partials in
    block order by ``sum_chunks``)."""
    R, d = pairs[0][0].shape[2], pairs[0][1].shape[2]
    cuts = []  # (du, x, rows a block, blocks) of each pair
    for du, x in pairs:
        M = du.shape[0] * du.shape[1]
        rows = max(_PLANE_ROWS, -(-M // _MAX_BLOCKS))
        cuts.append((du.reshape(M, R), x.reshape(M, d), rows, -(-M // rows)))
    nb = sum(c[3] for c in cuts)
    out = dev.full((1, 1, R * d), np.float64, 0)
    if nb:
        part = dev.empty((nb, R * d), np.float64)
        b0 = 0
        for du, x, rows, blocks in cuts:
            if blocks:
                dev.launch(cuda_kernels.plane_sums, blocks, int(THREADS))(du, x, rows, part[b0:b0 + blocks])
            b0 += blocks
        bounds = dev.to_device(np.array([0, nb], np.int64))
        dev.grid(cuda_kernels.sum_chunks, out.size)(part.reshape(1, nb, R * d), bounds, out)
    return out.reshape(R * d)


def race_attention_fwd(q, k, v, planes, beta=DEFAULT_BETA, *, causal=False, key_mask=None, check_finite=True,
                       cu_seqlens=None, planes_grad=True):
    """RACE attention forward on the GPU; returns ``(out, residuals)``.

    Arguments and results as :func:`racecpu.race_attention_fwd`; arrays are
    on the device (see the module docstring).  ``planes_grad=False``: the
    backward will not be asked for the planes' gradient, and the residuals
    keep no reference to ``q`` and ``k`` (which may be a caller's
    conversions, such as racecpu.torch's float32 copies of bfloat16 tensors).  Grouped-query k and v are
    hashed and sketched once per key/value head, as on the CPU, and the
    causal scans run one thread block per key/value head and chunk, whose
    state its query heads read in turn.  Packed sequences (``cu_seqlens``)
    are padded to whole chunks (:func:`racecpu.packing.padded_layout`).
    """
    dev = _Device(_is_cupy(q.bits if isinstance(q, Bfloat16) else q))
    if _use_chunkwise(cu_seqlens):
        return _chunkwise_fwd(q, k, v, planes, beta, causal, key_mask, check_finite, dev, planes_grad)
    a = _prepare(q, k, v, planes, beta, causal, key_mask, check_finite, dev, widen=False)
    G, n_given, d = a.q.shape
    nk, dv = a.v.shape[1:]
    L, P, _ = a.planes.shape
    # q, k, v in their own dtypes (16-bit ones read by the kernels' ``load``), results written in theirs
    mask = dev.full((G // a.group, nk), np.bool_, True) if a.mask is None else a.mask
    q_, k_, v_ = (_kernel_array(x) for x in (a.q, a.k, a.v))
    F = L * 2 ** P
    cdt = a.cdt
    T = int(THREADS)
    kern = cuda_kernels.make_kernels(L, P, T, cdt)
    plan = make_plan(G=G, group=a.group, nq=n_given, nk=nk, d=d, dv=dv, L=L, P=P, causal=causal, model=chunk_model(),
                     cu_seqlens=None if cu_seqlens is None else _host(cu_seqlens))
    lay = _Layout.make(plan, max(n_given, nk), dev)
    # packed sequences in the padded layout; grouped-query k, v: sketched once per key/value head
    Gk = G // a.group
    kk, vv, mask = (lay.pack(x, dev, fill) for x, fill in ((k_, 0), (v_, 0), (mask, False)))
    qq = lay.pack(q_, dev)
    nq, nk = qq.shape[1], kk.shape[1]
    chunk = lay.chunk
    nck = -(-nk // chunk)
    phik = dev.empty((Gk, nk, F), cdt)
    tk = dev.empty((Gk, nk, L * P), cdt)
    part = dev.full((Gk, nck, F, dv + 1), np.float64, 0)
    phiq = dev.empty((G, nq, F), cdt)
    tq = dev.empty((G, nq, L * P), cdt)
    den = dev.empty((G, nq), np.float64)
    out = dev.empty((G, nq, dv), _kernel_dtype(a.out_dtype))
    if G and nk:
        dev.launch(kern["sketch_chunks"], Gk * nck, T)(kk, vv, mask, a.planes, a.beta, chunk, phik, tk, part)
    # S per key/value head: the carries (causal) or sketch that its query heads read
    if causal:
        S = _scan_chunks(part, dev, False, lay.seq)
        if G and nq:
            state = dev.empty((Gk * nck, F, dv + 1), cdt)
            dev.launch(kern["causal_fwd"], Gk * nck, T)(qq, vv, phik, S, a.group, a.planes, a.beta, chunk, state,
                                                       phiq, tq, den, out)
    else:
        S = _sum_chunks(part, dev, lay.bounds)
        if G and nq:
            dev.launch(kern["queries_fwd"], G * -(-nq // T), T)(qq, a.planes, a.beta, dev.cast(S, cdt, S.shape),
                                                                lay.seq, chunk, a.group, phiq, tq, den, out)
    res = Residuals(a.planes, a.beta, bool(causal), chunk, T, vv, phiq, tq, phik, tk, den, S,
                    a.lead, a.in_dtypes, a.out_dtype, bool(check_finite), dev.cupy, n_given, a.group, lay,
                    q if planes_grad else None, k if planes_grad else None, _planes_dtype(planes, cdt))
    return _output(lay.unpack(out, dev), a.out_dtype, res.out_shape, dev), res


def race_attention_bwd(residuals, grad_out, *, dplanes=False):
    """RACE attention backward on the GPU; see :func:`racecpu.race_attention_bwd`.

    Returns
    -------
    dq, dk, dv : device arrays (CuPy if the forward's ``q`` was CuPy)
        Each in the dtype of its input.
    dbeta : float
    dplanes : device array (L, P, d)
        Only with ``dplanes=True``: the planes' gradient, in the planes' dtype (the compute dtype
        for integer planes), from the chunkwise form's residuals (not those of packed sequences,
        which the tile kernels ran).
    """
    r = residuals
    if isinstance(r, ChunkwiseResiduals):
        return _chunkwise_bwd(r, grad_out, dplanes)
    if not isinstance(r, Residuals):
        raise TypeError(f"residuals must come from racecpu.cuda.race_attention_fwd, got {type(r).__name__}")
    if dplanes and r.q_in is None:
        raise ValueError(_NO_Q_K)
    dev, g = _grad_out(r, grad_out)
    G, nq, F = r.phiq.shape  # (packed sequences: the padded layout's rows)
    nk, dv = r.v.shape[1:]
    L, P, d = r.planes.shape
    cdt = np.dtype(r.phiq.dtype)
    T = r.threads  # the kernels must run with the forward's tile length
    kern = cuda_kernels.make_kernels(L, P, T, cdt)
    lay = r.layout
    g = lay.pack(_kernel_array(_to_device(g, None, (G, r.tokens, dv), dev)), dev)
    chunk = r.chunk
    ncq, nck = -(-nq // chunk), -(-nk // chunk)
    Gk = G // r.group
    qdt, kdt, vdt = r.in_dtypes  # each gradient written in its input's dtype by the kernels
    dq = dev.empty((G, nq, d), _kernel_dtype(qdt))
    dk = dev.empty((Gk, nk, d), _kernel_dtype(kdt))
    dv_ = dev.empty((Gk, nk, dv), _kernel_dtype(vdt))
    dbeta = 0.0
    # each row's cotangent of its projections, kept for the planes' gradient (else a dummy)
    keep = bool(dplanes and nq and nk)
    duq, duk = ((dev.full((Gx, nx, L * P), np.float64, 0) if keep else dev.empty((1, 1, L * P), np.float64))
                for Gx, nx in ((G, nq), (Gk, nk)))
    if G and nq and nk:
        # the chunk totals of (dB, dA): per query head, or per key/value head (causal: summed
        # over the query heads that one block runs)
        Gd = Gk if r.causal else G
        part = dev.full((Gd, ncq, F, dv + 1), np.float64, 0)
        dden = dev.empty((G, nq), np.float64)
        winv = dev.empty((G, nq), np.float64)
        dbq = dev.empty(Gd * ncq, np.float64)
        if r.causal:
            state = dev.empty((Gk * ncq, F, dv + 1), cdt)
            dev.launch(kern["causal_queries_bwd"], Gk * ncq, T)(
                g, r.v, r.phik, r.phiq, r.tq, r.den, r.S, r.group, r.planes, r.beta, chunk, state, dq, dden, winv,
                part, dbq, keep, duq)
            carry = _scan_chunks(part, dev, True, lay.seq)  # the reverse carries per key/value head
            dbk = dev.empty(Gk * nck, np.float64)
            dev.launch(kern["causal_keys_bwd"], Gk * nck, T)(
                g, r.v, r.phik, r.tk, r.phiq, dden, winv, carry, r.group, r.planes, r.beta, chunk, state, dk, dv_,
                dbk, keep, duk)
        else:
            dev.launch(kern["queries_bwd"], G * ncq, T)(
                g, r.phiq, r.tq, r.den, dev.cast(r.S, cdt, r.S.shape), lay.seq, r.group, r.planes, r.beta, chunk,
                dq, dden, winv, part, dbq, keep, duq)
            dS = _fold(_sum_chunks(part, dev, lay.bounds), r.group, dev)  # a sketch read by its whole group
            dS = dev.cast(dS, cdt, dS.shape)
            nbk = Gk * -(-nk // T)
            dbk = dev.empty(nbk, np.float64)
            dev.launch(kern["keys_bwd"], nbk, T)(r.v, r.phik, r.tk, dS, lay.seq, chunk, r.planes, r.beta, dk, dv_,
                                                 dbk, keep, duk)
        dbeta = float(dev.to_host(dbq).sum() + dev.to_host(dbk).sum())
    else:  # no queries or no keys: nothing flows back
        for x in (dq, dk, dv_):
            if x.size:
                dev.grid(cuda_kernels.fill, x.size)(x.reshape(x.size), 0)
    dq, dk, dv_ = (lay.unpack(x, dev) for x in (dq, dk, dv_))
    lead, klead = r.lead, r.kv_lead
    grads = (_output(dq, qdt, lead + (dq.shape[1], d), dev),
             _output(dk, kdt, klead + (dk.shape[1], d), dev),
             _output(dv_, vdt, klead + (dv_.shape[1], dv), dev),
             dbeta)
    if dplanes:
        if keep:  # q and k as the forward read them, in the padded layout of du
            x_q = lay.pack(_kernel_array(_to_device(r.q_in, None, (G, r.tokens, d), dev)), dev)
            nk_in = r.v.shape[1] if lay.rows is None else lay.packing.n
            x_k = lay.pack(_kernel_array(_to_device(r.k_in, None, (Gk, nk_in, d), dev)), dev)
            dW = _plane_sums(((duq, x_q), (duk, x_k)), dev)
        else:  # no queries or no keys
            dW = dev.full((L * P * d,), np.float64, 0)
        grads += (_output(dW, r.planes_dtype, (L, P, d), dev),)
    return grads


# ---------------------------------------------------------------------------
# the chunkwise form (racecpu.chunkwise on CuPy)
# ---------------------------------------------------------------------------

def _simulated():
    from numba.core import config
    return bool(config.ENABLE_CUDASIM)


def _use_chunkwise(cu_seqlens):
    """Whether this forward runs the chunkwise form (:data:`PATH`)."""
    if PATH not in ("auto", "chunkwise", "tiles"):
        raise ValueError(f"racecpu.cuda.PATH must be 'auto', 'chunkwise' or 'tiles', got {PATH!r}")
    if PATH == "tiles" or cu_seqlens is not None:
        return False
    if PATH == "chunkwise" or _simulated():
        return PATH == "chunkwise"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def _xp():
    """The array module of the chunkwise form: CuPy on a GPU; NumPy under the simulator (tests)."""
    if _simulated():
        return np
    import cupy
    return cupy


def _as_xp(xp, x):
    """The numba device array (or CuPy array) ``x`` as an array of ``xp`` (no copy on a GPU);
    :class:`Bfloat16` as :class:`racecpu.chunkwise.Bfloat16Bits` of the same bits."""
    if isinstance(x, Bfloat16):
        return chunkwise.Bfloat16Bits(xp, _as_xp(xp, x.bits).view(np.uint16))
    if xp is np:
        return x.copy_to_host() if _devicearray.is_cuda_ndarray(x) else np.asarray(x)
    return xp.asarray(x)


def _from_xp(xp, a, dev):
    """A result of ``xp`` as the caller's kind: CuPy for CuPy callers, numba device arrays otherwise
    (bfloat16 results as :class:`Bfloat16` of int16 bits of that kind)."""
    if isinstance(a, chunkwise.Bfloat16Bits):
        return Bfloat16(_from_xp(xp, a.bits.view(np.int16), dev))
    if xp is np:
        return dev.to_device(a)
    return a if dev.cupy else cuda.as_cuda_array(a)


class CudaOps(chunkwise.ArrayOps):
    """The steps of :mod:`racecpu.chunkwise` that one kernel pass does better than a chain of
    array expressions: the soft hash and its backward (one thread per row and table, after and
    before the cuBLAS products with the planes), the float64 scans over chunks (blocked: segment
    sums, a scan of the segments, a rescan of each segment from its carry), and the fused forward
    readout and causal backward of ``racecpu.cuda._chunk_kernels`` (each input read once, each
    result written once, no ``(N, dv)`` or ``(nc, C, C)`` temporaries).  Arrays of ``xp`` (CuPy,
    or NumPy under the simulator)."""

    #: Threads of the scans' first and last level: enough (row, segment) pairs to fill a GPU.
    SCAN_THREADS = 1 << 20
    #: Whether the fused readout and causal backward run (else the array expressions of the base class).
    FUSED = True
    #: Fewest tokens per head for the fused readout and causal backward: on an H200 their first
    #: version lost to the array expressions at 2^16 tokens (12.5 against 8.9 ms causal fwd+bwd)
    #: and won from 2^20 (109 against 135); see the performance log's GPU section.
    FUSED_MIN_TOKENS = 2 ** 18
    #: Whether the soft hash and its backward run as one kernel with the planes' product fused in
    #: (:func:`racecpu.cuda._chunk_kernels.make_hash_kernels`, :attr:`HASH_LANES` lanes a row), else
    #: a cuBLAS product and a pass.  Off: on an H200 the cuBLAS form took 2.22 ms a head at 2^22
    #: against 2.85 for the first fused kernel (a warp a row); the grouped-lanes kernel that replaced
    #: it is untimed (the performance log's GPU section), so it waits for a measurement.
    FUSED_HASH = False
    #: Threads per block of the fused hash (whole warps).
    HASH_THREADS = 128
    #: Lanes per row of the fused hash (a power of two; at most a table's ``2**P`` corners).
    HASH_LANES = 8
    #: Tokens per block of the fused kernels (a causal chunk: one state per chunk in the scan).
    #: 512: on an H200 at 2^22 tokens x 4 heads, once the key mass rode with the state, causal
    #: fwd+bwd took 219.2 ms against 219.1 (256) and 225.7 (1024), median of 3 each; 512 keeps
    #: half the prefix states of 256 for the backward (the performance log's GPU section).
    FUSED_CHUNK = 512
    #: Whether each chunk's sums ``(B, A)`` of the causal states come from batched cuBLAS products
    #: (``phi_c^T x_c``) and a column sum, else from the fused ``chunk_states`` kernel.  On an H200
    #: at 2^22 tokens the kernel took 4.2 ms a head (ncu at 2^20: 1.28 ms, 10.5 % of the memory
    #: bandwidth, a shared load per FMA) where the same product by cuBLAS took 1.7 (chunks of 64,
    #: the array form's breakdown); the performance log's GPU section.
    STATES_BY_GEMM = True
    #: Whether the non-causal forward is the array form's (its readout a batched cuBLAS product of
    #: the 1 / D-scaled ``phi_q`` with the sketch), else the fused ``readout`` kernel (a shared load per FMA: 0.64 ms a head at
    #: 2^20 on an H200 by ncu, where cuBLAS wrote an (N, 128) product of the same size in 0.28).
    READOUT_BY_GEMM = True
    #: Tokens per shared-memory tile inside a fused block.
    FUSED_TILE = 16
    #: Whether the fused causal backward sums over ``dv`` as register-blocked tile products
    #: (``tile_products``: blocks of 4 rows by 3 outputs, each over every other column, two threads'
    #: partial sums added after: 0.58 shared loads an FMA against 2, at 96 registers a thread as the
    #: other form under the kernels' launch bounds), else a thread per output, the form timed on an
    #: H200.  Off until a GPU has timed it (a first blocked form, 1.2 loads an FMA at 168
    #: registers, lost: 230.5 against 225.7 ms at 2^22).
    FUSED_BLOCKED = False
    #: Whether the non-causal backward runs the fused kernels (``nc_queries_bwd``, ``nc_keys_bwd``:
    #: g and v read once each), else the array expressions, the form timed on an H200.  Off until
    #: a GPU has timed it.
    FUSED_NONCAUSAL = False
    #: Most threads per block of the fused kernels (one per column of v; more columns: more blocks).
    FUSED_THREADS = 128
    #: Shared memory a fused backward block may take (the default static limit of a CUDA block).
    SHARED_BYTES = 48 * 1024

    def __init__(self, xp, dev):
        super().__init__(xp)
        self.dev = dev

    def _launch(self, kernel, n):
        return kernel[max(1, min(-(-n // 256), 1 << 16)), 256, self.dev.stream]

    def _hash_kernels(self, L, P, dtype):
        return make_hash_kernels(L, P, np.dtype(dtype).name, _simulated(), int(self.HASH_THREADS),
                                 int(self.HASH_LANES))

    def _rows_launch(self, kernel, M, P):
        """:attr:`HASH_LANES` lanes per row (at most ``2**P``), :attr:`HASH_THREADS` per block,
        the blocks striding over ``M`` rows."""
        rpb = int(self.HASH_THREADS) // min(int(self.HASH_LANES), 1 << P)
        return kernel[max(1, min(-(-M // rpb), 1 << 15)), int(self.HASH_THREADS), self.dev.stream]

    def soft_hash(self, x, planes, beta, phi_out=None, t_out=None):
        L, P, d = planes.shape
        shp = x.shape[:-1]
        xr = x.reshape(-1, d)
        M, F = xr.shape[0], L * 2 ** P
        W = planes.reshape(L * P, d)
        phi = self.xp.empty((M, F), planes.dtype) if phi_out is None else _rows_view(phi_out, M, F)
        t = None if t_out is None else _rows_view(t_out, M, L * P)
        if self.FUSED_HASH and hash_fits(L, P):  # the projection and the hash in one pass over x
            t = self.xp.empty((M, L * P), planes.dtype) if t is None else t
            if M:
                self._rows_launch(self._hash_kernels(L, P, planes.dtype)["hash_rows"], M, P)(xr, W, beta, phi, t)
        else:  # cuBLAS's projections, then a pass
            u = xr @ W.T   # a fresh (M, L*P) array, which the thread-per-table pass may take as t
            if t is None:
                t = self.xp.empty(u.shape, u.dtype) if hash_fits(L, P) else u
            self._buckets_into(u, beta, L, P, phi, t)
        return phi.reshape(shp + (F,)), t.reshape(shp + (L * P,))

    def _buckets_into(self, u, beta, L, P, phi, t):
        """``phi (M, F)`` and ``t (M, L * P)`` of the projections ``u (M, L * P)``, written in place:
        :attr:`HASH_LANES` lanes a row where :func:`hash_fits` (``t`` not ``u``), else a thread per
        (row, table), which turns ``t`` (``u`` itself, or a copy of it made here) into tanh in place."""
        M = u.shape[0]
        if not M:
            return
        if hash_fits(L, P):
            self._rows_launch(self._hash_kernels(L, P, u.dtype)["hash_from_u"], M, P)(u, beta, phi, t)
            return
        if t is not u:
            t[...] = u
        self._launch(cuda_kernels.hash_from_u, M * L)(t, beta, P, phi)

    def hash_from_u(self, u, beta, L, P):
        phi = self.xp.empty((u.shape[0], L * 2 ** P), u.dtype)
        t = self.xp.empty(u.shape, u.dtype)   # the kept u stays as it is
        self._buckets_into(u, beta, L, P, phi, t)
        return phi, t

    def granule(self, chunk):
        return math.lcm(int(chunk), int(self.FUSED_CHUNK))

    def _fused_causal(self, tokens, F, dv, group, dtype):
        """Whether a causal call of ``tokens`` a head runs the fused forward and backward."""
        return self.FUSED and tokens >= max(1, self.FUSED_MIN_TOKENS) and self._fused_bwd_fits(F, dv, group, dtype)

    def bytes_per_token(self, tokens, group, d, dv, L, P, chunk, cdt, widen, keep_buckets, causal=True):
        """The array form's estimate, or, where the fused causal kernels take the call (or, not
        causal, the hash's kernels take its shape), theirs: no ``C x C`` or ``dv``-wide temporaries
        beyond the widened rows, and no transients of the hash but the projections; the F-wide
        ``dphi`` (and causal, the weighted buckets of the reverse states by GEMM and the chunks'
        states), the projections' cotangents; a quarter more for what the count misses."""
        F, LP = L * 2 ** P, L * P
        if not (self._fused_causal(tokens, F, dv, group, cdt) if causal else hash_fits(L, P)):
            return super().bytes_per_token(tokens, group, d, dv, L, P, chunk, cdt, widen, keep_buckets, causal)
        rows = group + 1
        if causal:
            states = 4 * F * (dv + 1) / int(self.FUSED_CHUNK)
            fwd = rows * LP + states
            bwd = 4 * F + 2 * LP + 2 + states
        else:
            fwd = rows * LP + group * (F + 4)
            bwd = group * (5 * F + 4) + 2 * F + 2 * LP
        fx, bx = self._rows_items(group, d, dv, F, LP, widen, keep_buckets)
        return int(1.25 * np.dtype(cdt).itemsize * max(fwd + fx, bwd + bx)) + 64

    def hash_du(self, dphi, phi, t, beta, L, P):
        du = self.xp.empty(t.shape, t.dtype)
        st = self.xp.empty(t.shape, t.dtype)
        if t.size:
            self._launch(cuda_kernels.hash_du_rows, t.size)(dphi, phi, t, beta, P, du, st)
        return du, st.sum(dtype=np.float64)

    def hash_dx(self, dphi, phi, t, planes, beta, dx_out):
        L, P, d = planes.shape
        if not (self.FUSED_HASH and hash_fits(L, P)):
            return super().hash_dx(dphi, phi, t, planes, beta, dx_out)
        M = phi.shape[0]
        st = self.xp.empty(M, planes.dtype)
        if M:
            K = self._hash_kernels(L, P, planes.dtype)
            self._rows_launch(K["hash_rows_bwd"], M, P)(dphi, phi, t, planes.reshape(L * P, d), beta, dx_out, st)
        return st.sum(dtype=np.float64)

    def exclusive_scan(self, part, reverse, dtype, init=None, total=False):
        xp = self.xp
        S, nc, E = part.shape
        out = xp.empty(part.shape, dtype)
        if out.size == 0:
            if not total:
                return out
            return out, (xp.zeros((S, E), np.float64) if init is None else init.astype(np.float64))
        nseg = max(1, min(nc, self.SCAN_THREADS // (S * E)))
        seg = -(-nc // nseg)
        nseg = -(-nc // seg)
        totals = xp.empty((S, nseg, E), np.float64)
        carry = xp.empty((S, nseg, E), np.float64)
        self._launch(cuda_kernels.segment_sums, totals.size)(part, seg, totals)
        self._launch(cuda_kernels.scan_chunks, S * E)(totals, xp.zeros(nseg, np.int64), carry, bool(reverse))
        if init is not None:   # every segment of the scan starts from the state before the call's chunks
            carry += init[:, None, :]
        self._launch(cuda_kernels.segment_scan, totals.size)(part, carry, seg, bool(reverse), out)
        if not total:
            return out
        edge = 0 if reverse else nseg - 1
        return out, carry[:, edge] + totals[:, edge]

    # -- the fused kernels ---------------------------------------------------------------------

    def _threads(self, dv):
        """Threads per fused block: whole warps, one per column, at most :attr:`FUSED_THREADS`."""
        return max(32, min(int(self.FUSED_THREADS), 32 * -(-dv // 32)))

    def _kernels(self, F, dtype, tpb):
        return make_chunk_kernels(int(F), int(self.FUSED_TILE), int(tpb), np.dtype(dtype).name,
                                  bool(self.FUSED_BLOCKED))

    def _states(self, phi, w, x, w2, C, dv, reverse, init=None, total=False):
        """Exclusive prefix (``reverse``: suffix) states over chunks of ``C`` and their key mass,
        each chunk's sums (:meth:`_chunk_sums`) and one scan: ``(S, nc, F, dv + 1)``, the state
        ``B`` (the sum of ``phi_t w_t x_t^T``) in columns ``:dv`` and the key mass ``A`` (the sum
        of ``phi_t w2_t``) in column ``dv``, as the fused kernels read them; ``w`` or ``w2`` None
        reads as ones.  ``phi (S, N, F)``, ``x (S, N, dv)``, ``w``, ``w2 (S, N)``.  ``init`` and
        ``total`` as :meth:`exclusive_scan` (``(S, F, dv + 1)`` float64): with ``total``,
        ``(states, the float64 state after the last chunk)``."""
        S, N, F = phi.shape
        nc = max(1, -(-N // C))
        part = self._chunk_sums(phi, w, x, w2, C, dv)
        r = self.exclusive_scan(part.reshape(S, nc, F * (dv + 1)), reverse, phi.dtype,
                                None if init is None else init.reshape(S, F * (dv + 1)), total)
        if not total:
            return r.reshape(S, nc, F, dv + 1)
        return r[0].reshape(S, nc, F, dv + 1), r[1].reshape(S, F, dv + 1)

    def _chunk_sums(self, phi, w, x, w2, C, dv):
        """Each chunk's ``(B, A)`` packed as ``(S, nc, F, dv + 1)`` (a fresh array; the arguments
        as :meth:`_states`): by batched cuBLAS products and a column sum where
        :attr:`STATES_BY_GEMM`, else by the fused ``chunk_states`` kernel."""
        xp = self.xp
        S, N, F = phi.shape
        nc = max(1, -(-N // C))
        part = xp.empty((S, nc, F, dv + 1), phi.dtype)
        if not N:
            part[...] = 0
            return part
        if self.STATES_BY_GEMM:
            pw = phi if w is None else phi * w[..., None]         # (S, N, F): F columns scaled, not dv
            pm = phi if w2 is None else phi * w2[..., None]
            full = N // C
            if full:  # whole chunks as views: (S, full, C, F) and (S, full, C, dv)
                pc = pw[:, :full * C].reshape(S, full, C, F)
                part[:, :full, :, :dv] = xp.swapaxes(pc, -1, -2) @ x[:, :full * C].reshape(S, full, C, dv)
                part[:, :full, :, dv] = pm[:, :full * C].reshape(S, full, C, F).sum(axis=2)
            if full < nc:  # the last chunk, shorter than C
                a = full * C
                part[:, full, :, :dv] = xp.swapaxes(pw[:, a:], -1, -2) @ x[:, a:]
                part[:, full, :, dv] = pm[:, a:].sum(axis=1)
            return part
        tpb = self._threads(dv)
        mode = (w is not None) | 4 * (w2 is not None)
        unread = xp.empty((1, 1), phi.dtype)  # the type of a real weight, so one build serves both
        K = self._kernels(F, phi.dtype, tpb)
        K["chunk_states"][(nc, S, max(1, -(-dv // tpb))), tpb, self.dev.stream](
            phi, unread if w is None else w, x, unread if w2 is None else w2, C, mode, part)
        return part

    def _readout(self, pq, pk, v, BA, causal, L, out, D):
        """The fused ``readout`` kernel over ``pq (S, group, nq, F)`` from the states ``BA (S, nc,
        F, dv + 1)`` (causal: each chunk's prefix; else the sketch, ``nc = 1``) into the views
        ``out`` and ``D``."""
        xp = self.xp
        S, group, nq, F = pq.shape
        dv = BA.shape[-1] - 1
        cdt = BA.dtype
        if nq == 0 or dv == 0:
            D[...] = 0
            return
        dst = out if out.dtype == cdt and out.flags.c_contiguous else xp.empty(out.shape, cdt)
        Dst = D if D.flags.c_contiguous else xp.empty(D.shape, cdt)
        tpb = self._threads(dv)
        K = self._kernels(F, cdt, tpb)
        K["readout"][(-(-nq // int(self.FUSED_CHUNK)), S * group, -(-dv // tpb)), tpb, self.dev.stream](
            pq.reshape(S * group, nq, F), pk, v, BA, group, int(self.FUSED_CHUNK), bool(causal), L * DEN_FLOOR,
            dst, Dst)
        if dst is not out:
            out[...] = dst
        if Dst is not D:
            D[...] = Dst

    def readout(self, pq, sketch, L, out, D, tokens):
        if not self.FUSED or tokens < max(1, self.FUSED_MIN_TOKENS) or self.READOUT_BY_GEMM:
            return super().readout(pq, sketch, L, out, D, tokens)
        dv = sketch.shape[-1] - 1   # the non-causal readout reads no keys or values, only v's width
        keys, values = (self.xp.empty((1, 1, e), sketch.dtype) for e in (pq.shape[-1], dv))
        self._readout(pq, keys, values, sketch[:, None], False, L, out, D)

    def attend_causal(self, pq, pk, v, chunk, L, out, D, carry, carry_out, tokens):
        S, group, nq, F = pq.shape
        dv = v.shape[-1]
        cdt = pk.dtype
        if not self.FUSED or tokens < max(1, self.FUSED_MIN_TOKENS):   # the array form's products
            return super().attend_causal(pq, pk, v, chunk, L, out, D, carry, carry_out, tokens)
        C = int(self.FUSED_CHUNK)
        r = self._states(pk, None, v, None, C, dv, False, carry, carry_out)   # (S, nc, F, dv + 1)
        BA, nxt = r if carry_out else (r, None)
        # kept for the fused backward, which would otherwise sum the chunks and scan again
        kept = chunkwise.PrefixStates(BA, C) if self._fused_bwd_fits(F, dv, group, cdt) else None
        self._readout(pq, pk, v, BA, True, L, out, D)
        return nxt, kept

    def _fused_bwd_fits(self, F, dv, group, dtype):
        """Whether the fused causal backward takes this shape: one query head per key/value head,
        ``dv`` columns in one block, its shared tiles within :attr:`SHARED_BYTES`."""
        tpb = self._threads(dv)
        shared = np.dtype(dtype).itemsize * backward_shared_items(int(F), int(self.FUSED_TILE), tpb)
        return self.FUSED and group == 1 and dv <= tpb and shared <= self.SHARED_BYTES

    def _fused_noncausal(self, tokens, F, dv, group, dtype):
        return (self.FUSED_NONCAUSAL and tokens >= max(1, self.FUSED_MIN_TOKENS)
                and self._fused_bwd_fits(F, dv, group, dtype))

    def noncausal_queries_bwd(self, pq, g, winv, sketch, sum_chunk, tokens):
        S, group, nq, F = pq.shape
        dv = g.shape[-1]
        cdt = pq.dtype
        if not self._fused_noncausal(tokens, F, dv, group, cdt):
            return super().noncausal_queries_bwd(pq, g, winv, sketch, sum_chunk, tokens)
        xp = self.xp
        C = int(self.FUSED_CHUNK)
        tpb = self._threads(dv)
        K = self._kernels(F, cdt, tpb)
        ncq = -(-nq // C)
        dpq = xp.empty((S, nq, F), cdt)
        dD = xp.empty((S, nq), cdt)
        part = xp.empty((S, ncq, F, dv + 1), cdt)   # each chunk's share of (dB, dA)
        if nq:
            K["nc_queries_bwd"][(ncq, S), tpb, self.dev.stream](
                pq.reshape(S, nq, F), g.reshape(S, nq, dv), winv.reshape(S, nq), sketch[:, None], C, dpq, dD, part)
        return dpq.reshape(S, 1, nq, F), part.sum(axis=1, dtype=np.float64)

    def noncausal_keys_bwd(self, pk, v, dBA, dv_out, tokens):
        S, nk, F = pk.shape
        dv = v.shape[-1]
        cdt = pk.dtype
        if not self._fused_noncausal(tokens, F, dv, 1, cdt):
            return super().noncausal_keys_bwd(pk, v, dBA, dv_out, tokens)
        xp = self.xp
        C = int(self.FUSED_CHUNK)
        tpb = self._threads(dv)
        K = self._kernels(F, cdt, tpb)
        dpk = xp.empty((S, nk, F), cdt)
        if nk:
            K["nc_keys_bwd"][(-(-nk // C), S), tpb, self.dev.stream](pk, v, dBA[:, None], C, dpk, dv_out)
        return dpk

    def causal_bwd(self, pq, pk, v, g, winv, D, C, dv_out, prefix=None, carry=None, dcarry=None,
                   carry_out=False, tokens=None):
        S, group, N, F = pq.shape
        dv = v.shape[-1]
        cdt = pk.dtype
        tokens = N if tokens is None else tokens
        if not self._fused_causal(tokens, F, dv, group, cdt):
            return super().causal_bwd(pq, pk, v, g, winv, D, C, dv_out, carry=carry, dcarry=dcarry,
                                      carry_out=carry_out, tokens=tokens)
        xp = self.xp
        C = int(self.FUSED_CHUNK)
        nc = -(-N // C)
        pq3, g3, w3 = pq.reshape(S, N, F), g.reshape(S, N, dv), winv.reshape(S, N)
        tpb = self._threads(dv)
        K = self._kernels(F, cdt, tpb)
        if prefix is not None and prefix.chunk == C and prefix.states.shape == (S, nc, F, dv + 1):
            BA = prefix.states                                              # the forward's, kept
        else:
            BA = self._states(pk, None, v, None, C, dv, False, carry)       # as the forward
        dpq = xp.empty((S, N, F), cdt)
        dD = xp.empty((S, N), cdt)
        K["queries_bwd"][(nc, S), tpb, self.dev.stream](pq3, pk, v, g3, w3, BA, C, dpq, dD)
        # after each chunk: the sums of phi_q g^T / D and of phi_q dD
        r = self._states(pq3, w3, g3, dD, C, dv, True, dcarry, carry_out)
        dBA, nxt = r if carry_out else (r, None)
        dpk = xp.empty((S, N, F), cdt)
        K["keys_bwd"][(nc, S), tpb, self.dev.stream](pq3, pk, v, g3, w3, dD, dBA, C, dpk, dv_out)
        return dpq.reshape(S, 1, N, F), dpk, nxt


@dataclass(frozen=True)
class ChunkwiseResiduals:
    """What :func:`race_attention_bwd` needs from a chunkwise forward (treat as opaque).

    ``state``: the residuals of :func:`racecpu.chunkwise.forward`: the soft buckets and tanh
    projections of q and k (``L * (2**P + P)`` numbers a row), or for 16-bit inputs only their
    projections (``L * P``: :data:`KEEP_BUCKETS`), and the denominators; causal with the fused
    kernels, the chunks' prefix states, ``F * (dv + 1)`` per :attr:`CudaOps.FUSED_CHUNK` tokens,
    and for a head cut into segments the float64 state at each segment's start; ``v``, the key
    mask, and the caller's ``q`` and ``k`` for the planes' gradient, by reference: do not modify
    them between forward and backward.
    """

    backend: ClassVar[str] = "cuda"
    estimator: ClassVar[str] = "ratio"

    state: dict
    lead: tuple
    kv_lead: tuple
    tokens: int
    in_dtypes: tuple
    out_dtype: np.dtype
    check_finite: bool
    cupy_out: bool

    @property
    def out_shape(self):
        return self.lead + (self.tokens, self.state["v"].shape[2])


def _out_bytes(a, n, dv):
    """Bytes of a call's ``out`` (the query heads' rows of ``dv`` in the output dtype)."""
    return int(np.prod(a.lead)) * n * dv * np.dtype(a.out_dtype).itemsize


def _chunkwise_fwd(q, k, v, planes, beta, causal, key_mask, check_finite, dev, planes_grad=True, residuals=True):
    """The chunkwise forward: ``(out, ChunkwiseResiduals)``, or ``(out, None)`` without ``residuals``
    (nothing kept for a backward)."""
    a = _prepare(q, k, v, planes, beta, causal, key_mask, check_finite, dev, widen=False)
    xp = _xp()
    n = a.q.shape[1]
    q_, k_, v_ = (_as_xp(xp, x) for x in (a.q, a.k, a.v))
    mask = None if a.mask is None else _as_xp(xp, a.mask)
    keep = KEEP_BUCKETS if KEEP_BUCKETS is not None else min(np.dtype(t).itemsize for t in a.in_dtypes) >= 4
    # the share is of the eight arrays of a training step, the four of a forward alone
    arrays = (2 if residuals else 1) * (sum(x.size * x.dtype.itemsize for x in (q_, k_, v_))
                                        + _out_bytes(a, n, v_.shape[2]))
    workspace = max(int(WORKSPACE), int(float(WORKSPACE_SHARE) * arrays))
    out, state = chunkwise.forward(xp, q_, k_, v_, _as_xp(xp, a.planes), a.beta, causal=bool(causal),
                                   key_mask=mask, group=a.group, chunk=int(SCAN_CHUNK), sum_chunk=int(SUM_CHUNK),
                                   workspace=workspace, out_dtype=a.out_dtype, ops=CudaOps(xp, dev),
                                   keep_buckets=bool(keep), residuals=residuals)
    out = _from_xp(xp, out.reshape(a.lead + (n, v_.shape[2])), dev)
    if not residuals:
        return out, None
    kv_lead = cpu_checks.kv_lead(a.lead, a.group)
    # the caller's q and k by reference (as v), read again only for the planes' gradient
    state.update(q_in=q if planes_grad else None, k_in=k if planes_grad else None,
                 planes_dtype=_planes_dtype(planes, a.cdt))
    res = ChunkwiseResiduals(state, a.lead, kv_lead, n, a.in_dtypes, a.out_dtype, bool(check_finite), dev.cupy)
    return out, res


def _chunkwise_bwd(r, grad_out, dplanes=False):
    dev, g = _grad_out(r, grad_out)
    xp = _xp()
    G, n = r.state["D"].shape
    g = _as_xp(xp, _to_device(g, None, (G, n, r.out_shape[-1]), dev))
    kw = {}
    if dplanes:  # q and k as the forward read them (no copy where they are contiguous device arrays)
        st = r.state
        if st["q_in"] is None:
            raise ValueError(_NO_Q_K)
        d = st["planes"].shape[-1]
        kw = dict(q=_as_xp(xp, _to_device(st["q_in"], None, st["D"].shape + (d,), dev)),
                  k=_as_xp(xp, _to_device(st["k_in"], None, st["v"].shape[:2] + (d,), dev)))
    # the gradients in the inputs' dtypes, a slab at a time: 16-bit ones never whole in float32
    dq, dk, dv, dbeta, *dW = chunkwise.backward(xp, r.state, g, ops=CudaOps(xp, dev), grad_dtypes=r.in_dtypes,
                                                **kw)
    grads = (_from_xp(xp, dq.reshape(r.lead + dq.shape[1:]), dev),
             _from_xp(xp, dk.reshape(r.kv_lead + dk.shape[1:]), dev),
             _from_xp(xp, dv.reshape(r.kv_lead + dv.shape[1:]), dev),
             float(dbeta))
    if dplanes:
        grads += (_from_xp(xp, dW[0].astype(r.state["planes_dtype"], copy=False), dev),)
    return grads


def race_attention(q, k, v, planes, beta=DEFAULT_BETA, *, causal=False, key_mask=None, check_finite=True,
                   cu_seqlens=None):
    """RACE attention on the GPU; see :func:`racecpu.race_attention`.

    Returns a device array (CuPy if ``q`` is CuPy) of shape ``(..., Nq, dv)``.
    """
    if _use_chunkwise(cu_seqlens):   # keeps nothing for a backward
        dev = _Device(_is_cupy(q.bits if isinstance(q, Bfloat16) else q))
        return _chunkwise_fwd(q, k, v, planes, beta, causal, key_mask, check_finite, dev, residuals=False)[0]
    return race_attention_fwd(q, k, v, planes, beta, causal=causal, key_mask=key_mask,
                              check_finite=check_finite, cu_seqlens=cu_seqlens)[0]


# ---------------------------------------------------------------------------
# the per-bucket mean (racecpu.bucket_mean's sums on CuPy)
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class BucketMeanResiduals(bucket_mean.Residuals):
    """What the per-bucket mean's backward on the GPU needs (treat as opaque): the CPU's record
    (:class:`racecpu.bucket_mean.Residuals`) with arrays of CuPy (NumPy under the simulator) in
    ``inner``, and whether the results go back as CuPy arrays (``cupy_out``)."""

    backend: ClassVar[str] = "cuda"

    cupy_out: bool = False


def _bucket_mean_fwd(q, k, v, planes, beta, *, causal, key_mask, check_finite, cu_seqlens, residuals):
    """The NumPy API's forward with ``estimator="bucket_mean"`` on arrays in GPU memory: the
    ratio's checks and layout (:func:`_prepare`), then
    :func:`racecpu.bucket_mean.forward_sequences` on CuPy (batched products, cumulative sums
    and einsums, a call per packed sequence; no kernel of its own): the CPU's numbers up to
    the order of sums."""
    dev = _Device(_is_cupy(q.bits if isinstance(q, Bfloat16) else q))
    a = _prepare(q, k, v, planes, beta, causal, key_mask, check_finite, dev)
    n, dv = a.q.shape[1], a.v.shape[2]
    bounds = bucket_mean.sequences(None if cu_seqlens is None else _host(cu_seqlens), n, a.k.shape[1])
    xp = _xp()
    q_, k_, v_ = (_as_xp(xp, x) for x in (a.q, a.k, a.v))
    mask = None if key_mask is None else bucket_mean.repeated(_as_xp(xp, a.mask), a.group, xp)
    y, inner = bucket_mean.forward_sequences(xp, q_, bucket_mean.repeated(k_, a.group, xp),
                                             bucket_mean.repeated(v_, a.group, xp), _as_xp(xp, a.planes), a.beta,
                                             causal=bool(causal), key_mask=mask, eps=bucket_mean.EPS, bounds=bounds)
    out = _from_xp(xp, chunkwise._cast(xp, y, a.out_dtype).reshape(a.lead + (n, dv)), dev)
    if not residuals:
        return out, None
    kv_lead = cpu_checks.kv_lead(a.lead, a.group)
    return out, BucketMeanResiduals(inner=inner, lead=a.lead, kv_lead=kv_lead, group=a.group, nq=n, nk=a.k.shape[1],
                                    d=a.q.shape[2], dv=dv, in_dtypes=a.in_dtypes, check_finite=bool(check_finite),
                                    planes_dtype=_planes_dtype(planes, a.cdt), cupy_out=dev.cupy)


def _bucket_mean_bwd(r, grad_out, dplanes=False):
    """The backward of :func:`_bucket_mean_fwd`: ``(dq, dk, dv, dbeta[, dplanes])`` in the inputs'
    dtypes (the planes' gradient in the planes' dtype), device arrays of the forward's kind."""
    dev, g = _grad_out(r, grad_out)
    xp = _xp()
    pq = bucket_mean.buckets_of(r.inner)  # the compute dtype, q's groups
    G = pq.shape[0]
    g = _as_xp(xp, _to_device(g, pq.dtype, (G, r.nq, r.dv), dev))
    shapes = ((G, r.nq, r.d), (G, r.nk, r.d), (G, r.nk, r.dv))
    dq, dk, dv, dbeta, *dW = bucket_mean.backward_sequences(xp, r.inner, g, shapes, dplanes)
    if r.group > 1:  # a key/value head's rows were read by its whole group of query heads
        dk, dv = (x.reshape((G // r.group, r.group) + x.shape[1:]).sum(1) for x in (dk, dv))
    grads = []
    for x, lead, dt in zip((dq, dk, dv), (r.lead, r.kv_lead, r.kv_lead), r.in_dtypes):
        grads.append(_from_xp(xp, chunkwise._cast(xp, xp.ascontiguousarray(x), dt).reshape(lead + x.shape[1:]),
                              dev))
    grads = tuple(grads) + (float(dbeta),)
    return grads + (_from_xp(xp, dW[0].astype(r.planes_dtype), dev),) if dplanes else grads


class CudaBackend:
    """racecpu.cuda as a backend (the :class:`racecpu.backend.Backend` protocol): the NumPy
    API's calls on arrays in GPU memory come here (:func:`racecpu.backend.backend_for`)."""

    name = "cuda"

    def chunk_model(self) -> ChunkModel:
        return chunk_model()

    def forward(self, q, k, v, planes, beta, *, causal=False, key_mask=None, check_finite=True, cu_seqlens=None,
                out=None, residuals=True, estimator="ratio", planes_grad=True):
        """:func:`race_attention_fwd` (``residuals=False``: :func:`race_attention`, ``(out, None)``)."""
        if out is not None:
            raise TypeError("out is for NumPy arrays; CuPy's memory pool already reuses device memory")
        kw = dict(causal=causal, key_mask=key_mask, check_finite=check_finite, cu_seqlens=cu_seqlens)
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
        if estimator == "bucket_mean":
            return _bucket_mean_fwd(q, k, v, planes, beta, residuals=residuals, **kw)
        if residuals:
            return race_attention_fwd(q, k, v, planes, beta, planes_grad=planes_grad, **kw)
        return race_attention(q, k, v, planes, beta, **kw), None

    def backward(self, residuals, grad_out, *, out=None, dplanes=False):
        """:func:`race_attention_bwd`; ``out`` buffers are the CPU's alone."""
        if out is not None:
            raise TypeError("out is for NumPy arrays; CuPy's memory pool already reuses device memory")
        if isinstance(residuals, BucketMeanResiduals):
            return _bucket_mean_bwd(residuals, grad_out, dplanes)
        return race_attention_bwd(residuals, grad_out, dplanes=dplanes)

    def __repr__(self):
        return "racecpu.cuda.BACKEND"


#: racecpu.cuda's backend.
BACKEND = CudaBackend()

"""16-bit floats (bfloat16, float16) to float32 and back, on every core.

The kernels compute in float32 or float64; 16-bit inputs are widened to
float32 before them and results narrowed after.  These conversions work on
the bits (a 16-bit array viewed as ``uint16``, a float32 one as ``uint32``)
with integer operations only, so the kernels' fast-math options cannot
change them: widening is exact, narrowing rounds to nearest, ties to even,
as NumPy and ml_dtypes do, and both keep signed zeros, subnormals,
infinities and NaN.  NumPy converts float16 one value at a time and has no
bfloat16 (``docs/performance.md``, "16-bit inputs").
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ._jit import kernel
from .runtime import parallel_region, start_threads

#: Formats, the ``fmt`` argument of :func:`widen` and :func:`narrow`.
BFLOAT16, FLOAT16 = 0, 1

_RUN = 1 << 15  # values per task: a run's source and result stay in L2


@kernel
def _widen_run(src, dst, fmt):
    """float32 bits ``dst (n,) uint32`` of the 16-bit values ``src (n,) uint16``."""
    if fmt == BFLOAT16:  # bfloat16 is the top half of a float32
        for i in range(src.size):
            dst[i] = np.uint32(src[i]) << np.uint32(16)
        return
    # float16: one branch-free pass that is exact for normal numbers, zeros, Inf and NaN
    # (it vectorises), then subnormals, if the run has any, one at a time.
    sub = 0
    for i in range(src.size):
        h = np.uint32(src[i])
        e = h & np.uint32(0x7C00)
        o = ((h & np.uint32(0x7FFF)) << np.uint32(13)) + np.uint32(0x38000000)  # rebias 15 -> 127
        o = o + np.uint32(0x38000000) if e == np.uint32(0x7C00) else o  # Inf, NaN: exponent 255
        o = o if e != np.uint32(0) else np.uint32(0)  # zero (subnormals: below)
        sub += (e == np.uint32(0)) & ((h & np.uint32(0x3FF)) != np.uint32(0))
        dst[i] = ((h & np.uint32(0x8000)) << np.uint32(16)) | o
    if sub == 0:
        return
    for i in range(src.size):
        h = np.int64(src[i])
        m = h & 0x3FF
        if (h & 0x7C00) == 0 and m != 0:  # subnormal m * 2^-24: normalise, float32 has the range
            e32 = 113
            while (m & 0x400) == 0:
                m <<= 1
                e32 -= 1
            dst[i] = ((h & 0x8000) << 16) | (e32 << 23) | ((m & 0x3FF) << 13)


@kernel
def _narrow_run(src, dst, fmt):
    """16-bit values ``dst (n,) uint16`` nearest to the float32 bits ``src (n,) uint32``."""
    if fmt == BFLOAT16:
        for i in range(src.size):
            u = np.int64(src[i])
            if (u & 0x7FFFFFFF) > 0x7F800000:  # NaN: rounding could carry it into Inf
                dst[i] = (u >> 16) | 0x40
            else:  # drop 16 bits, ties to even; a carry into the exponent is right (up to Inf)
                dst[i] = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return
    # float16: one branch-free pass that is right for results that are normal float16
    # numbers (it vectorises), then the rest (subnormal or zero results, Inf, NaN), if
    # the run has any, one at a time.
    rest = 0
    for i in range(src.size):
        u = src[i]
        f = u & np.uint32(0x7FFFFFFF)
        # rebias 127 -> 15, drop 13 bits, ties to even (a carry may reach Inf: right)
        o = (f - np.uint32(112 << 23) + np.uint32(0xFFF) + ((f >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
        dst[i] = ((u >> np.uint32(16)) & np.uint32(0x8000)) | (o & np.uint32(0xFFFF))
        rest += (f < np.uint32(0x38800000)) | (f >= np.uint32(0x47800000))
    if rest == 0:
        return
    for i in range(src.size):
        u = np.int64(src[i])
        sign = (u >> 16) & 0x8000
        f = u & 0x7FFFFFFF
        if 0x38800000 <= f < 0x47800000:
            continue  # normal: done above
        if f > 0x7F800000:  # NaN
            o = 0x7E00
        elif f >= 0x47800000:  # >= 2^16, Inf included: Inf
            o = 0x7C00
        else:  # below 2^-14: a subnormal float16, or zero
            e = f >> 23
            if e < 102:  # below 2^-25: rounds to zero
                o = 0
            else:  # m * 2^(e - 150) in units of 2^-24: m >> (126 - e), ties to even
                m = (f & 0x7FFFFF) | 0x800000
                s = 126 - e
                o = m >> s
                rem = m & ((1 << s) - 1)
                half = 1 << (s - 1)
                if rem > half or (rem == half and (o & 1) == 1):
                    o += 1  # 1024 is the smallest normal's bits: right
        dst[i] = sign | o


@kernel(parallel=True)
def _widen_all(src, dst, fmt):
    n = src.size
    for r in prange((n + _RUN - 1) // _RUN):
        _widen_run(src[r * _RUN:min(n, (r + 1) * _RUN)], dst[r * _RUN:min(n, (r + 1) * _RUN)], fmt)


@kernel(parallel=True)
def _narrow_all(src, dst, fmt):
    n = src.size
    for r in prange((n + _RUN - 1) // _RUN):
        _narrow_run(src[r * _RUN:min(n, (r + 1) * _RUN)], dst[r * _RUN:min(n, (r + 1) * _RUN)], fmt)


def widen(src, dst, fmt):
    """Write the float32 values of 16-bit ``src`` into ``dst``.

    Parameters
    ----------
    src : ndarray, uint16, 1-D, C-contiguous
        The 16-bit values' bits (``x.view(np.uint16)``).
    dst : ndarray, uint32, 1-D, C-contiguous, ``src.size`` values
        Out: the float32 bits (``y.view(np.uint32)`` of a float32 ``y``);
        must not overlap ``src``.
    fmt : int
        :data:`BFLOAT16` or :data:`FLOAT16`.
    """
    start_threads()
    with parallel_region():
        _widen_all(src, dst, fmt)


def narrow(src, dst, fmt):
    """Write the 16-bit values nearest to float32 ``src`` into ``dst``.

    Parameters
    ----------
    src : ndarray, uint32, 1-D, C-contiguous
        The float32 values' bits.
    dst : ndarray, uint16, 1-D, C-contiguous, ``src.size`` values
        Out: the 16-bit values' bits (round to nearest, ties to even);
        must not overlap ``src``.
    fmt : int
        :data:`BFLOAT16` or :data:`FLOAT16`.
    """
    start_threads()
    with parallel_region():
        _narrow_all(src, dst, fmt)

"""A branch-free exp of non-positive arguments, so that the soft hash's loops vectorise.

libm's exp is a scalar call; :func:`exp_neg` is a polynomial after a
Cody-Waite range reduction, inlined into the caller's SIMD loop, with its
precision following the argument's dtype (docs/performance.md, "exp_neg").
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from ._jit import OPTIONS, kernel


_LOG2E = 1.4426950408889634


_LN2_HI = 0.693147180369123816490  # ln 2 split so k * _LN2_HI is exact (Cody-Waite)


_LN2_LO = 1.90821492927058770002e-10


_EXP_MIN = -708.0  # exp(x) for x below is returned as ~3e-308, not 0


@intrinsic
def _pow2(typingctx, k, like):
    """2.0**k in the float type of ``like``, for an integer k of that type's
    normal exponents, by writing k + bias into the exponent bits: SIMD integer
    ops, where selecting the powers 2**-(2**i) by the bits of -k took a
    multiply and a blend each (docs/performance.md, "exp_neg")."""
    mant, bias, width = (23, 127, 32) if like == types.float32 else (52, 1023, 64)
    if not isinstance(k, types.Integer) or not k.signed:
        return None  # the callers pass an int32

    def codegen(context, builder, sig, args):
        it = ir.IntType(width)
        v = args[0]  # an int32: sign-extended for float64 (SIMD on int lanes either way)
        v = builder.trunc(v, it) if v.type.width > width else builder.sext(v, it) if v.type.width < width else v
        e = builder.shl(builder.add(v, ir.Constant(it, bias)), ir.Constant(it, mant))
        return builder.bitcast(e, context.get_value_type(sig.return_type))
    return like(k, like), codegen


@kernel(inline="always")
def _exp_neg_f64(x):
    """exp(x), x <= 0, float64: x = k ln2 + g, exp(g) by its Taylor series to
    degree 13 (|g| <= ln2/2), times 2**k (k >= -1022, a normal)."""
    x = x if x > _EXP_MIN else _EXP_MIN
    ki = np.int32(x * _LOG2E - 0.5)  # round to nearest: truncation of y - 1/2 for y <= 0
    k = float(ki)
    g = (x - k * _LN2_HI) - k * _LN2_LO
    p = 1.0 + g * (1.0 + g * (1 / 2 + g * (1 / 6 + g * (1 / 24 + g * (1 / 120 + g * (1 / 720 + g * (
        1 / 5040 + g * (1 / 40320 + g * (1 / 362880 + g * (1 / 3628800 + g * (1 / 39916800 + g * (
            1 / 479001600 + g * (1 / 6227020800)))))))))))))
    return p * _pow2(ki, x)


# float32 constants (globals are frozen with their type, so the arithmetic stays float32)
_f = np.float32


_LOG2E_F, _HALF_F, _ONE_F, _ZERO_F = _f(_LOG2E), _f(0.5), _f(1.0), _f(0.0)


_LN2_HI_F, _LN2_LO_F = _f(0.693359375), _f(-2.12194440e-4)  # Cody-Waite split of ln 2 (Cephes expf)


_EXP_MIN_F = _f(-87.0)  # above the smallest normal float32, 2**-126 ~ exp(-87.3)


_EXP_C_F = tuple(_f(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                                4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1))


@kernel(inline="always")
def _exp_neg_f32(x):
    """exp(x), x <= 0, float32, ~1 ulp: Cephes' expf polynomial (degree 7 in
    all) after the same range reduction; 16 lanes per SIMD op, a third of the
    float64 cost, for the hash of float32 inputs."""
    c0, c1, c2, c3, c4, c5 = _EXP_C_F
    under = x < _EXP_MIN_F  # 0 below, as float64's ~1e-308 is once stored in float32
    x = x if x > _EXP_MIN_F else _EXP_MIN_F
    ki = np.int32(x * _LOG2E_F - _HALF_F)  # round to nearest, as in _exp_neg_f64; k >= -126
    k = _f(ki)
    g = (x - k * _LN2_HI_F) - k * _LN2_LO_F
    p = (((((c0 * g + c1) * g + c2) * g + c3) * g + c4) * g + c5) * (g * g) + g + _ONE_F
    return _ZERO_F if under else p * _pow2(ki, x)


def exp_neg(x):
    """exp(x) for x <= 0, branch-free so that loops over it vectorise.

    Inlined into SIMD loops where libm's exp is a scalar call; the
    precision follows the argument's type (see the overload below): float32
    math for float32 arguments.  Relative error: float32 <= 3
    ulp, and 0 below -87; float64 ~1 ulp near 0 growing to ~110 ulp (2.4e-14)
    near -708 (fastmath reassociates the Cody-Waite reduction), and ~3e-308
    below (tests/test_race.py).
    """
    return float(np.exp(min(x, 0.0)))


# Not cached: the cached callers hold this code, and Numba makes these lambdas at
# typing time, caching them under whatever module name and cache directory are
# current then: a checkout imported under another name (benchmarks/ab.py's B)
# would leave entries here that the next 'import racecpu' cannot load.
@overload(exp_neg, jit_options=dict(OPTIONS))
def _exp_neg_typed(x):
    if x == types.float32:
        return lambda x: _exp_neg_f32(x)
    return lambda x: _exp_neg_f64(x)

"""Argument checks shared by every entry point (CPU, CUDA, streaming, out-of-core).

Each check takes what a user passed and either returns it in the layout and
dtype the kernels need or raises ``TypeError`` (wrong kind of thing) or
``ValueError`` (right kind, wrong value) naming the argument; and the way back,
results in the caller's dtype (:func:`deliver`).  Nothing here computes
attention: the engine (:mod:`racecpu.engine`) and the frontends call these
before and after it.  The parallel NaN/Inf count and the 16-bit conversions
are kernels (:mod:`racecpu._kernels`): this module and the engine are the two
that import them (``docs/design.md``, "Map of the engine").
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import warnings
from dataclasses import dataclass

import numpy as np

from . import _fork
from . import config
from ._arrays import ForeignArrayError, as_numpy
from ._kernels import BFLOAT16, FLOAT16, count_nonfinite, narrow, widen
from ._kernels.runtime import read_only
from ._memory import POOL


def half_format(dtype):
    """The 16-bit format of ``dtype`` (:mod:`._kernels.convert`'s ``FLOAT16`` or
    ``BFLOAT16``, ml_dtypes' bfloat16 matched by name), or None for any other dtype."""
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return FLOAT16
    if dtype.itemsize == 2 and dtype.name == "bfloat16":
        return BFLOAT16
    return None


def dtypes(*arrays):
    """(compute dtype, output dtype) of float inputs.

    16-bit inputs (float16, bfloat16) compute in float32 and return their own
    dtype when they all share it; mixed 16-bit dtypes return float32; with a
    float32/float64 input the widest of those computes and is returned.
    """
    dts = [np.dtype(getattr(a, "dtype", a)) for a in arrays]
    wide = [dt for dt in dts if half_format(dt) is None]
    if wide:
        dt = np.result_type(*wide)
        return dt, dt
    f32 = np.dtype(np.float32)
    return f32, (dts[0] if all(dt == dts[0] for dt in dts) else f32)


def widened(x, cdt):
    """``x`` (any float dtype) as a read-only C-contiguous array of the compute dtype
    ``cdt``: ``x`` itself (a read-only view) where it already is one; 16-bit ``x``
    widened to float32 on every core into a pooled array (NumPy converts float16 a
    value at a time and bfloat16 through ml_dtypes)."""
    fmt = half_format(x.dtype)
    if fmt is None or cdt != np.float32:
        return read_only(np.ascontiguousarray(x, dtype=cdt))
    x = read_only(np.ascontiguousarray(x))  # a copy of a strided x (torch's expanded grads) too: one signature
    y = POOL.empty(x.shape, np.float32)
    widen(x.reshape(-1).view(np.uint16), y.reshape(-1).view(np.uint32), fmt)
    return read_only(y)


def narrowed(x, dtype, out=None):
    """Float32 ``x`` (C-contiguous) in the 16-bit ``dtype``, on every core, as an
    array from the pool (as the NumPy API's float32 results are) or written into
    ``out`` (C-contiguous, of that dtype and shape)."""
    if out is None:
        out = POOL.empty(x.shape, np.uint16).view(dtype)
    narrow(x.reshape(-1).view(np.uint32), out.reshape(-1).view(np.uint16), half_format(dtype))
    return out


def check_array(name, x, check_finite, min_ndim=2):
    """Float array check; returns (array, output dtype, compute dtype), the array a
    read-only view (:func:`read_only`: the kernels compile for read-only inputs only).

    Every CPU entry point checks its first array here first, so this is also
    where a forked child that cannot run the kernels is refused (:mod:`racecpu._fork`).
    """
    _fork.check()
    try:
        x = as_numpy(name, x)
    except ForeignArrayError:
        raise
    except Exception as exc:  # ragged lists and the like
        raise TypeError(f"{name} must be an array of floats: {exc}") from None
    if (x.dtype.kind != "f" or x.dtype.itemsize > 8) and half_format(x.dtype) is None:
        raise TypeError(f"{name} must be a float16, bfloat16, float32 or float64 array, got dtype {x.dtype}; "
                        f"pass {name}.astype(np.float32)")
    if x.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dims (..., N, d), got shape {x.shape}")
    if check_finite and not all_finite(x):
        raise ValueError(f"{name} contains NaN or Inf (pass check_finite=False to skip this check)")
    cdt = np.dtype(np.float32) if half_format(x.dtype) is not None else x.dtype
    return read_only(x), x.dtype, cdt


def check_planes(planes, d, cdt):
    _fork.check()  # the out-of-core entry points check no array with check_array
    planes = np.asarray(planes)
    if half_format(planes.dtype) is not None:
        planes = planes.astype(np.float32)
    if planes.dtype.kind not in "fiu" or planes.dtype.kind == "b":
        raise TypeError(f"planes must be a float array (L, P, d), got dtype {planes.dtype}")
    if planes.ndim != 3:
        raise ValueError(f"planes must have shape (L, P, d), got shape {planes.shape}")
    L, P, pd = planes.shape
    if pd != d:
        raise ValueError(f"planes have head dim {pd} but the inputs have head dim {d} "
                         f"(planes shape {planes.shape})")
    if L < 1 or not 1 <= P <= config.MAX_PLANES:
        raise ValueError(f"planes need L >= 1 tables and 1 <= P <= {config.MAX_PLANES} planes, got shape {planes.shape}")
    if d < 1:
        raise ValueError(f"head dim must be >= 1, got planes shape {planes.shape}")
    if not np.isfinite(planes).all():
        raise ValueError("planes contain NaN or Inf")
    with np.errstate(over="ignore"):
        cast = np.ascontiguousarray(planes, dtype=cdt)
    if not np.isfinite(cast).all():  # finite planes that overflow the compute dtype (float64 -> float32)
        raise ValueError(f"planes are too large for the compute dtype {np.dtype(cdt)} "
                         f"(max |planes| = {np.abs(planes).max():.3g}); scale them down or pass float64 inputs")
    return read_only(cast)


def planes_grad_dtype(planes_dtype, cdt):
    """The dtype of the planes' gradient: the planes' own float dtype, the compute dtype ``cdt``
    for integer planes."""
    pdt = np.dtype(planes_dtype)
    return pdt if pdt.kind == "f" else np.dtype(cdt)


def check_beta(beta):
    if isinstance(beta, (bool, np.bool_)) or not isinstance(beta, (numbers.Real, np.ndarray, np.generic)):
        raise TypeError(f"beta must be a positive finite float, got {type(beta).__name__} {beta!r}")
    b = np.asarray(beta)
    if b.ndim != 0 or b.dtype.kind not in "fiu":
        raise TypeError(f"beta must be a scalar float, got {b.dtype} array of shape {b.shape}")
    b = float(b)
    if not np.isfinite(b) or b <= 0:
        raise ValueError(f"beta must be finite and > 0, got {b}")
    return b


def _exponent_bits(dtype):
    """(unsigned int type, mask of the exponent bits) of a float dtype, or None."""
    fmt = half_format(dtype)
    if fmt is not None:
        return np.uint16, 0x7C00 if fmt == FLOAT16 else 0x7F80
    return {np.dtype(np.float32): (np.uint32, 0x7F800000),
            np.dtype(np.float64): (np.uint64, 0x7FF0000000000000)}.get(np.dtype(dtype))


def all_finite(x):
    """np.isfinite(x).all(), on every core and without a temporary for big float arrays."""
    bits = _exponent_bits(x.dtype)
    if x.size < 1 << 16 or bits is None or not x.flags.c_contiguous:
        if half_format(x.dtype) == BFLOAT16:
            x = x.astype(np.float32)
        return bool(np.isfinite(x).all())
    ut, mask = bits
    return count_nonfinite(x.reshape(-1).view(ut), ut(mask)) == 0


@dataclass(frozen=True)
class Args:
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
    given: tuple  # q, k, v flattened to (G, N, d) in their own dtypes: q, k, v themselves unless 16-bit
    group: int = 1  # query heads per key/value head (grouped-query attention): k and v have G // group groups

    @property
    def kept(self):
        """q, k, v as a backward keeps them: the caller's 16-bit arrays rather than their widened
        copies (half the memory held until the backward, which widens them again), else the
        compute-dtype arrays."""
        return tuple(given if half_format(given.dtype) is not None else x
                     for given, x in zip(self.given, (self.q, self.k, self.v)))


def kv_lead(lead, group):
    """The leading dims of k and v: q's with the head axis (the last) ``group`` times smaller
    (grouped-query attention, :func:`check_args`)."""
    return lead[:-1] + (lead[-1] // group,) if group > 1 else lead


def check_args(q, k, v, planes, beta, causal, key_mask, grouped=False):
    """Cross-argument checks on already-checked q, k, v (anything with shape and dtype).

    Shared with racecpu.cuda, which passes zero-stride stand-ins of device
    arrays.  ``grouped``: k and v may have fewer heads than q (grouped-query
    attention: q's head axis, the one before the sequence axis, is ``group``
    times theirs, every other leading axis equal; query head h reads key/value
    head h // group).  Returns (compute dtype, output dtype, lead, G, planes,
    beta, group), ``lead`` q's leading dims and ``G`` their product.
    """
    cdt, odt = dtypes(q, k, v)
    lead = q.shape[:-2]
    klead = k.shape[:-2]
    group = 1
    if klead != lead or v.shape[:-2] != lead:
        if (grouped and v.shape[:-2] == klead and len(klead) == len(lead) >= 1 and klead[:-1] == lead[:-1]
                and klead[-1] >= 1 and lead[-1] >= 1 and lead[-1] % klead[-1] == 0):  # 0 query heads: no group
            group = lead[-1] // klead[-1]
        elif grouped:
            raise ValueError(f"k and v must have q's leading dims, or (grouped-query attention) the same leading "
                             f"dims but a head axis (the one before the tokens) that divides q's, got shapes "
                             f"q {q.shape}, k {k.shape}, v {v.shape}")
        else:
            raise ValueError(f"q, k, v must have the same leading dims, got shapes q {q.shape}, k {k.shape}, "
                             f"v {v.shape}")
    nq, d = q.shape[-2:]
    nk = k.shape[-2]
    if k.shape[-1] != d:
        raise ValueError(f"q and k must have the same head dim, got shapes q {q.shape} and k {k.shape}")
    if v.shape[-2] != nk:
        raise ValueError(f"k and v must have the same number of tokens, got shapes k {k.shape} and v {v.shape}")
    if causal and nq != nk:
        raise ValueError(f"causal attention needs as many queries as keys, got shapes q {q.shape} and k {k.shape}")
    planes = check_planes(planes, d, cdt)
    beta = check_beta(beta)
    G = int(np.prod(lead, dtype=np.int64))
    if key_mask is not None:
        m = np.asarray(key_mask)
        if m.dtype != np.bool_:
            raise TypeError(f"key_mask must be a bool array, got dtype {m.dtype}")
        if m.shape != klead + (nk,):
            raise ValueError(f"key_mask must have shape {klead + (nk,)} (k's leading dims + (Nk,)), got {m.shape}")
    return cdt, odt, lead, G, planes, beta, group


#: A (B, N, H, d) array passed for (B, H, N, d) shows as thousands of "heads" of a few
#: "tokens": :func:`warn_if_heads_and_tokens_swapped` warns from these sizes on (no model has
#: 512 heads of 128 tokens or fewer, and RACE over so few tokens would gain nothing).
SWAPPED_MIN_HEADS, SWAPPED_MAX_TOKENS, SWAPPED_RATIO = 512, 128, 32

_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def _caller_stacklevel():
    """The ``stacklevel`` of the first frame outside racecpu (the user's call), for warnings."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def warn_if_heads_and_tokens_swapped(name, x):
    """Warn (UserWarning) where ``x`` of 4 dims or more looks like (B, N, H, d) passed for
    (B, H, N, d): many "heads" of a few "tokens" (the SWAPPED_* sizes).  Nothing in the
    numbers can tell the two apart, so this is a warning, and only where the shape makes the
    mistake likely; a 3-dim (H, N, d) array may be a flattened batch of short sequences and
    is never warned of."""
    if x.ndim < 4:
        return
    heads, tokens = x.shape[-3], x.shape[-2]
    if heads >= SWAPPED_MIN_HEADS and tokens <= SWAPPED_MAX_TOKENS and heads >= SWAPPED_RATIO * tokens:
        warnings.warn(f"{name} has shape {tuple(x.shape)}: racecpu reads it as (..., H, N, d), {heads} heads of "
                      f"{tokens} tokens each. If it is (B, N, H, d), pass {name}.transpose(0, 2, 1, 3) (and the "
                      f"same for the other inputs); to silence this, filter UserWarnings whose message starts "
                      f"with '{name} has shape'", UserWarning, stacklevel=_caller_stacklevel())


def prepare(q, k, v, planes, beta, causal, key_mask, check_finite, defer=False, grouped=False):
    """Check and lay out the arguments.  ``defer``: the NaN/Inf checks of q, k
    and v are left to :func:`check_derived`, after the kernels read them.
    ``grouped``: k and v may have fewer heads (see :func:`check_args`)."""
    eager = check_finite and not defer
    q, qdt, _ = check_array("q", q, eager)
    warn_if_heads_and_tokens_swapped("q", q)
    passed = [("q", q)]
    try:
        k, kdt, _ = check_array("k", k, eager)
        passed.append(("k", k))
        v, vdt, _ = check_array("v", v, eager)
        passed.append(("v", v))
        cdt, odt, lead, G, planes, beta, group = check_args(q, k, v, planes, beta, causal, key_mask, grouped)
    except (TypeError, ValueError):
        if check_finite and not eager:  # errors in the eager order: q's NaN before anything about k
            for name, x in passed:
                check_array(name, x, True)
        raise
    nk = k.shape[-2]
    Gk = G // group
    if key_mask is None:
        mask = read_only(np.ones((Gk, nk), dtype=np.bool_))
    else:
        mask = read_only(np.ascontiguousarray(np.asarray(key_mask).reshape(Gk, nk)))

    given = tuple(x.reshape((n,) + x.shape[-2:]) for x, n in ((q, G), (k, Gk), (v, Gk)))
    return Args(*(widened(x, cdt) for x in given), mask, planes, beta, lead, odt, (qdt, kdt, vdt),
                bool(causal), bool(check_finite), given, group)


#: Why a finite v or grad_out whose sums are not finite is an error (:func:`check_derived`).
def sums_overflow(cdt):
    """What a non-finite float64 sum of a finite input means: the kernels' sums overflowed the
    compute dtype ``cdt`` (float32 partials, for 16-bit and float32 inputs) before reaching float64."""
    return f"its weighted sums overflow {np.dtype(cdt)}"


#: Finite float64 sums within this factor (times L) of the compute dtype's largest value are close
#: enough to it that the kernels' products (a readout adds L tables' shares; a chunk's running
#: state sums before its float64 carry) may have overflowed: the results are then checked.
OVERFLOW_MARGIN = 64


def check_narrowed(check_finite, named):
    """Float16 gradients narrowed from float32 (``(name, array)`` pairs): a value beyond
    float16's largest (65504) became Inf in the narrowing, which no float64 sum shows; raise
    ValueError naming it.  A pass over the float16 results, in float16 calls only (bfloat16
    has float32's range)."""
    if not check_finite:
        return
    for name, x in named:
        if x.dtype == np.float16 and not all_finite(x):
            raise ValueError(f"the gradients overflow float16: {name} has entries beyond float16's largest value "
                             f"({float(np.finfo(np.float16).max):g}); scale grad_out (or v) down or pass float32")


def max_abs(sums):
    """``max |sums|`` as a float (0 for an empty array; NaN where ``sums`` holds one, infinite
    where it holds an infinity, so ``math.isfinite`` of it is ``all_finite(sums)``): what
    :func:`check_results` compares.  As ``max(max, -min)``: two passes and no temporary, where
    ``np.abs`` wrote a copy of the sums (page faults on fresh memory at every call)."""
    if not sums.size:
        return 0.0
    hi, lo = float(sums.max()), float(sums.min())  # NumPy's max and min propagate NaN
    return max(hi, -lo) if hi == hi and lo == lo else math.nan


def check_results(check_finite, named, cdt, L, results):
    """The overflow that the float64 sums cannot show.

    ``named``: ``(name, x, big)`` per input, ``big`` the largest magnitude of the float64
    sums derived from ``x`` (:func:`max_abs`); ``results`` the call's outputs in the compute
    dtype ``cdt``.  Only where some ``big * OVERFLOW_MARGIN * L`` reaches the largest value
    of ``cdt`` are the results read (a pass over them, so never in an ordinary call); a
    non-finite one raises ValueError naming the last such input (in the backward, products
    of v's sums with grad_out can overflow where neither's own sums do), as
    :func:`check_derived` does for an overflow it sees.
    """
    if not check_finite:
        return
    limit = float(np.finfo(cdt).max) / (OVERFLOW_MARGIN * L)
    near = [(name, x) for name, x, big in named if big >= limit]
    if not near or all(all_finite(r) for r in results):
        return
    name, x = near[-1]
    raise ValueError(f"{name} is too large: the attention's sums overflow {np.dtype(cdt)} "
                     f"(max |{name}| = {float(np.abs(x).max()):.3g}); scale it down"
                     f"{' or pass float64' if np.dtype(cdt) != np.float64 else ''}")


def check_derived(check_finite, *named):
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
        if not all_finite(x):
            raise ValueError(f"{name} contains NaN or Inf (pass check_finite=False to skip this check)")
        raise ValueError(f"{name} is too large: {overflow} (max |{name}| = {np.abs(x).max():.3g}); "
                         f"scale it down{' or pass float64' if x.dtype != np.float64 else ''}")


def check_out(name, out, shape, dtype, reads):
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


def check_grad_buffers(g, out, out_shape, shapes, in_dtypes, reads, check_finite):
    """A backward's ``grad_out`` checked against the output's shape ``out_shape`` and its
    ``out`` buffers ``(dq, dk, dv)`` (each checked against ``shapes``, ``in_dtypes`` and the
    ``(name, array)`` pairs ``reads`` it reads, or None); raises in the eager order (with
    ``check_finite``, grad_out's NaN first)."""
    try:
        if g.shape != out_shape:
            raise ValueError(f"grad_out must have the output's shape {out_shape}, got {g.shape}")
        if out is None:
            return (None, None, None)
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            got = (f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list))
                   else type(out).__name__)
            raise TypeError(f"out must be a tuple of three arrays (dq, dk, dv), got {got}")
        reads = [("grad_out", g)] + list(reads)
        checked = []
        for name, buf, shape, dt in zip(("dq", "dk", "dv"), out, shapes, in_dtypes):
            checked.append(check_out(f"out {name}", buf, shape, dt, reads))
            reads.append((f"out {name}", buf))
        return tuple(checked)
    except (TypeError, ValueError):
        check_array("grad_out", g, check_finite)
        raise


def deliver(result, out, shape, dtype):
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

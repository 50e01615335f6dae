"""Numba CPU kernels of RACE attention (no argument checking here: see attention.py).

Layout.  Every (batch, head) pair is a *group* ``g``.  Arrays are C-contiguous:
``x (G, N, d)``, ``v (G, N, dv)``, planes ``W (L, P, d)``.  The soft hash of
all tables of one token is one row ``phi (F,)`` with ``F = L * R``, table ``l``
at ``phi[l*R:(l+1)*R]``; its tanh projections are ``t (L * P,)``.

Work is split into *chunks* of at most ``chunk`` consecutive tokens of one
group, and :func:`run_tasks` runs all (group, chunk) tasks in one ``prange``
loop, so a single head still uses every core.  Each task keeps its sketch
``(A, B)`` (``A (F,)``, ``B (F, dv)``) in the compute dtype for at most
``chunk`` tokens; sums across chunks are carried in float64, so no long sum
drifts in float32.  Partial sketches are per chunk, not per thread: results
do not depend on the thread count.  Tasks run with subnormal floats flushed
to zero (:data:`FLUSH_SUBNORMALS`).

The causal scan runs in *segments* of consecutive chunks around an explicit
carried state (:func:`scan_segments`: one per group where the groups alone
share the threads evenly, else a few per group): (1) the chunk totals of the
chunks before the last segment, in parallel (:func:`sketch_chunks`), (2) an
exclusive scan of the totals in float64 (:func:`exclusive_scan`), (3) every
segment scanned from its carried-in state, carrying it on through its own
chunks (:func:`causal_fwd`), SCAN_BLOCK tokens per step, each step a few
small matrix products.  The carries are the same, bit for bit, however many
segments.  The backward is exact: prefix states are rebuilt by rescanning
from the stored carries and suffix sums by a reverse scan; nothing is
obtained by subtracting from a total.  With one segment per group, both run
in one pass, chunk by chunk (:func:`causal_bwd`).

Forward and backward of each step stand side by side.
"""

from __future__ import annotations

import functools
import inspect
import math
import platform
import warnings

import numba
import numpy as np
import scipy.linalg.cython_blas  # noqa: F401  (the BLAS that np.dot in these kernels calls)
from numba import njit, prange, types
from numba._dispatcher import compute_fingerprint
from numba.core import cgutils
from numba.extending import intrinsic, overload
from llvmlite import ir
from numba.core.errors import NumbaPerformanceWarning

# Callers that pass views ('A' layout at compile time) make Numba warn about
# np.dot on non-contiguous arrays; the row blocks it gets are contiguous.
warnings.filterwarnings("ignore", message=r".*np\.v?dot\(\) is faster on contiguous arrays",
                        category=NumbaPerformanceWarning)

from ._simd import (COMB_ROWS, COMB_VECTORS, TILE_ROWS, VECTOR_BYTES, comb_tile, comb_tile_lines, comb_tile_pieces,
                    dot_tile_cols, dot_tile_cols1, dot_tile_rows, prefetch_lines, stream_fence)
from . import config
from .config import DEN_FLOOR

# Reassociation lets LLVM vectorise the dv-long inner loops and dot products.
# No 'nnan'/'ninf': the guards below must see real comparisons.
_FM = {"contract", "reassoc", "nsz", "arcp"}
# error_model="numpy": with Python's model every float division carries a
# zero check that raises, and that branch stops LLVM from vectorising the loop.
_JIT = dict(cache=True, fastmath=_FM, nogil=True, error_model="numpy")
_PJIT = dict(_JIT, parallel=True)

_blas_controller = None


#: Below this many tokens (all groups together) a kernel runs on the calling
#: thread: waking the sleeping workers (OMP_WAIT_POLICY=PASSIVE, see
#: racecpu/__init__.py) costs more than such calls' work.  2-core VM, 4 heads:
#: a decode step took 182 us on 2 threads and 43 us on one, ``extend`` by 64
#: tokens per head 541 us and 276 us; the two break even at ~1024 tokens.
#: 512 keeps the loss small where many cores would have helped.
SERIAL_TOKENS = config.SERIAL_TOKENS  # moved to racecpu.config


def blas_tasks(kernel):
    """Run a parallel kernel whose tasks call BLAS (``np.dot``) with BLAS on one thread.

    Every core already runs its own prange task; a multi-threaded sgemm
    inside each would oversubscribe the cores (10-50x slower on a busy
    machine).  The limit (threadpoolctl, ~13 us) is skipped when the
    kernel's ``chunk`` is too short to reach BLAS, so decode steps stay cheap,
    and calls on fewer than SERIAL_TOKENS tokens (the kernel's first argument
    is ``(G, n, ...)``) do not wake the other threads at all.
    """
    chunk_at = list(inspect.signature(kernel).parameters).index("chunk")

    def call(args, kw):
        global _blas_controller
        if args[chunk_at] < BLAS_ROWS:
            return kernel(*args, **kw)
        if _blas_controller is None:
            from threadpoolctl import ThreadpoolController
            _blas_controller = ThreadpoolController()
        with _blas_controller.limit(limits=1, user_api="blas"):
            return kernel(*args, **kw)

    @functools.wraps(kernel)
    def run(*args, **kw):
        if args[0].shape[0] * args[0].shape[1] >= config.SERIAL_TOKENS:
            return call(args, kw)
        threads = numba.get_num_threads()
        numba.set_num_threads(1)
        try:
            return call(args, kw)
        finally:
            numba.set_num_threads(threads)

    return run


#: Tasks run with subnormal floats flushed to zero (x86-64: the FTZ and DAZ
#: bits of MXCSR, set before each task and the thread's own value put back
#: after it).  Products of two small soft-hash probabilities (phi_q . phi_k,
#: the backward's phi_k . phi_q / den) land in float32's subnormal range
#: (below 1.2e-38), where every multiply or FMA takes a microcode assist of
#: ~100 cycles: an 8 x 8 step block of them took 4-10 us instead of 0.1-0.2.
#: Flushed, such a term is 0 instead of a subnormal that has already lost
#: most of its bits, beside sums > DEN_FLOOR = 1e-30 (smaller ones give
#: zeros anyway).  Elsewhere (AArch64, ...) the platform's default stands.
FLUSH_SUBNORMALS = platform.machine().lower() in ("x86_64", "amd64")
_MXCSR_FTZ_DAZ = 0x8040  # bit 15: flush results to zero; bit 6: inputs as zero


def _mxcsr(builder, name, slot):
    """Call LLVM's ``llvm.x86.sse.<name>`` (stmxcsr / ldmxcsr) on the i32 ``slot``."""
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p]),
                                        f"llvm.x86.sse.{name}")
    builder.call(fn, [builder.bitcast(slot, i8p)])


@intrinsic
def _call_task(typingctx, addr, t, args):
    """Call the compiled function at ``addr`` as ``f(t, *args)`` (Numba's native calling convention),
    with subnormals flushed to zero during the call (FLUSH_SUBNORMALS)."""
    argtypes = (t,) + tuple(args)

    def codegen(context, builder, sig, llargs):
        fnty = context.call_conv.get_function_type(types.none, argtypes)
        fn = builder.inttoptr(llargs[0], fnty.as_pointer())
        vals = [llargs[1], *cgutils.unpack_tuple(builder, llargs[2], len(args))]
        if FLUSH_SUBNORMALS:
            i32 = ir.IntType(32)
            saved, flush = cgutils.alloca_once(builder, i32), cgutils.alloca_once(builder, i32)
            _mxcsr(builder, "stmxcsr", saved)
            builder.store(builder.or_(builder.load(saved), ir.Constant(i32, _MXCSR_FTZ_DAZ)), flush)
            _mxcsr(builder, "ldmxcsr", flush)
        status, _ = context.call_conv.call_function(builder, fn, types.none, argtypes, vals)
        if FLUSH_SUBNORMALS:  # the thread's own mode back, before an error is passed on too
            _mxcsr(builder, "ldmxcsr", saved)
        with cgutils.if_unlikely(builder, status.is_error):
            context.call_conv.return_status_propagate(builder, status)
        return context.get_dummy_value()

    return types.none(addr, t, args), codegen


@njit(**_PJIT)
def _run_tasks(addr, ntasks, args):
    for t in prange(ntasks):
        _call_task(addr, np.int64(t), args)
        stream_fence()  # the task's streamed stores (combine_rows) done before the join


_task_runners = {}  # (task, fingerprint of the argument types) -> (task address, compiled _run_tasks)


def run_tasks(task, ntasks, *args):
    """Run the jitted ``task(t, *args)`` for every ``t`` in ``range(ntasks)`` on all threads.

    The parallel loop calls ``task`` through its address.  As a plain
    callee, Numba links the task's whole call tree into the loop's module and
    optimises it and generates its machine code twice more (the gufunc and
    its wrapper): that was half of the cold compile (67 s -> 29 s).  Each
    task is compiled once, on its own.  Unlike a Numba first-class function
    (same call, but resolved from Python on every call: ~50 us), the address
    and the compiled loop are looked up once per argument types, by the
    fingerprint Numba's own dispatcher keys its type cache with (0.3 us for
    all arguments; ``numba.typeof`` takes ~9 us per array).  It does not see
    alignment: code compiled for aligned arrays is run on unaligned ones,
    which x86-64 and AArch64 load and store alike.
    """
    key = (task, compute_fingerprint(args))
    runner = _task_runners.get(key)
    if runner is None:
        argtypes = tuple(numba.typeof(a) for a in args)
        cres = task.get_compile_result(types.none(types.int64, *argtypes))
        addr = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)
        sig = (types.intp, types.int64, types.Tuple(argtypes))
        _run_tasks.compile(sig)
        runner = _task_runners[key] = addr, _run_tasks.overloads[sig].entry_point
    addr, entry = runner
    entry(addr, ntasks, args)


# ---------------------------------------------------------------------------
# input check
# ---------------------------------------------------------------------------

@njit(**_JIT)
def _count_nonfinite_run(bits, exp_mask):
    cnt = 0
    for i in range(bits.size):
        cnt += (bits[i] & exp_mask) == exp_mask
    return cnt


@njit(**_PJIT)
def count_nonfinite(bits, exp_mask):
    """Number of NaN/Inf values in a float array viewed as unsigned ints.

    A value is NaN or Inf iff its exponent bits are all set; counting that
    with integer ops vectorises and runs on every core, where
    ``np.isfinite(x).all()`` builds a bool temporary on one core (it cost
    ~65 ns per 128-float row, a fifth of a whole forward).
    """
    n = bits.size
    nb = (n + 65535) // 65536
    total = 0
    for blk in prange(nb):
        total += _count_nonfinite_run(bits[blk * 65536:min(n, blk * 65536 + 65536)], exp_mask)
    return total


# ---------------------------------------------------------------------------
# soft hash of one token: forward and backward
# ---------------------------------------------------------------------------

_LOG2E = 1.4426950408889634
_LN2_HI = 0.693147180369123816490  # ln 2 split so k * _LN2_HI is exact (Cody-Waite)
_LN2_LO = 1.90821492927058770002e-10
_EXP_MIN = -708.0  # exp(x) for x below is returned as ~3e-308, not 0


@intrinsic
def _pow2(typingctx, k, like):
    """2.0**k in the float type of ``like``, for an integer k of that type's
    normal exponents, by writing k + bias into the exponent bits: SIMD integer
    ops where selecting the powers 2**-(2**i) by the bits of -k took a
    multiply and a blend each (float32 exp 0.94 -> 0.36 ns per value)."""
    mant, bias, width = (23, 127, 32) if like == types.float32 else (52, 1023, 64)
    if not isinstance(k, types.Integer) or k.bitwidth < width:
        return None  # the callers pass int(k), an int64

    def codegen(context, builder, sig, args):
        it = ir.IntType(width)
        v = args[0]  # int(k): an int64, cut to the float's width for float32
        v = builder.trunc(v, it) if v.type.width > width else v
        e = builder.shl(builder.add(v, ir.Constant(it, bias)), ir.Constant(it, mant))
        return builder.bitcast(e, context.get_value_type(sig.return_type))
    return like(k, like), codegen


@njit(inline="always", **_JIT)
def _exp_neg_f64(x):
    """exp(x), x <= 0, float64: x = k ln2 + g, exp(g) by its Taylor series to
    degree 13 (|g| <= ln2/2), times 2**k (k >= -1022, a normal)."""
    x = x if x > _EXP_MIN else _EXP_MIN
    k = float(int(x * _LOG2E - 0.5))  # round to nearest: truncation of y - 1/2 for y <= 0
    g = (x - k * _LN2_HI) - k * _LN2_LO
    p = 1.0 + g * (1.0 + g * (1 / 2 + g * (1 / 6 + g * (1 / 24 + g * (1 / 120 + g * (1 / 720 + g * (
        1 / 5040 + g * (1 / 40320 + g * (1 / 362880 + g * (1 / 3628800 + g * (1 / 39916800 + g * (
            1 / 479001600 + g * (1 / 6227020800)))))))))))))
    return p * _pow2(int(k), x)


# float32 constants (globals are frozen with their type, so the arithmetic stays float32)
_f = np.float32
_LOG2E_F, _HALF_F, _ONE_F, _ZERO_F = _f(_LOG2E), _f(0.5), _f(1.0), _f(0.0)
_LN2_HI_F, _LN2_LO_F = _f(0.693359375), _f(-2.12194440e-4)  # Cody-Waite split of ln 2 (Cephes expf)
_EXP_MIN_F = _f(-87.0)  # above the smallest normal float32, 2**-126 ~ exp(-87.3)
_EXP_C_F = tuple(_f(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                                4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1))


@njit(inline="always", **_JIT)
def _exp_neg_f32(x):
    """exp(x), x <= 0, float32, ~1 ulp: Cephes' expf polynomial (degree 7 in
    all) after the same range reduction; 16 lanes per SIMD op, a third of the
    float64 cost, for the hash of float32 inputs."""
    c0, c1, c2, c3, c4, c5 = _EXP_C_F
    under = x < _EXP_MIN_F  # 0 below, as float64's ~1e-308 is once stored in float32
    x = x if x > _EXP_MIN_F else _EXP_MIN_F
    k = _f(int(x * _LOG2E_F - _HALF_F))  # round to nearest, as in _exp_neg_f64; k >= -126
    g = (x - k * _LN2_HI_F) - k * _LN2_LO_F
    p = (((((c0 * g + c1) * g + c2) * g + c3) * g + c4) * g + c5) * (g * g) + g + _ONE_F
    return _ZERO_F if under else p * _pow2(int(k), x)


def exp_neg(x):
    """exp(x) for x <= 0, branch-free so that loops over it vectorise.

    libm's exp is a scalar call (~9 ns); this is ~0.6 ns per float64 value
    in a SIMD loop and ~0.4 ns per float32 value: the precision follows the
    argument's type (see the overload below).  Relative error: float32 <= 3
    ulp, and 0 below -87; float64 ~1 ulp near 0 growing to ~110 ulp (2.4e-14)
    near -708 (fastmath reassociates the Cody-Waite reduction), and ~3e-308
    below (tests/test_race.py).
    """
    return float(np.exp(min(x, 0.0)))


# Not cached: the cached callers hold this code, and Numba makes these lambdas at
# typing time, caching them under whatever module name and cache directory are
# current then (benchmarks/ab.py's other checkout wrote one here as
# racecpu_ab_other, which broke the next 'import racecpu').
@overload(exp_neg, jit_options=dict(_JIT, cache=False))
def _exp_neg_typed(x):
    if x == types.float32:
        return lambda x: _exp_neg_f32(x)
    return lambda x: _exp_neg_f64(x)


#: |u| below which tanh(u) is its series to u**9 (truncation < 1e-16 relative):
#: above it (1 - e)/(1 + e) loses < 3e-15 (float64), < 2e-6 (float32, where
#: 2 beta t is then >= 0.16 beta and the logistic is flat for large beta).
_TANH_SERIES_MAX = 0.04

#: Tokens hashed together: the tanh/logistic step vectorises across them.
HASH_BLOCK = 32


#: :func:`hash_block`'s prefetch schedule, in 32nds of the lines: issued by
#: the end of the tanh/logistic loop (in four pieces), of the rows of t and of
#: the corners; the rows of phi issue the rest.
_PF_MATH, _PF_T, _PF_CORNERS = 12, 20, 24


@njit(**_JIT)
def _prefetch_to(addr, done, target):
    """:func:`racecpu._simd.prefetch_lines` of lines done..target of ``addr``; returns the new count."""
    if target > done:
        prefetch_lines(addr, done, target - done)
        return target
    return done


@njit(**_JIT)
def hash_block(x, W, beta, keep, U, a, b, ph, t, phi, ahead=0, lines=0):
    """phi_l(x) and t for a block of rows ``x (T, d)``, every table.

    softmax_r(beta t.v_r) = prod_p sigmoid(2 beta t_p v_{r,p}) (DESIGN.md), so
    per plane we need a = sigmoid(2 beta t) and 1 - a, and t = tanh(W x).
    Both come from one exp each of a non-positive argument, so nothing can
    overflow for any beta.  Plane 0 is the most significant bit of the corner
    index.  Rows with ``keep[j]`` False (masked keys) get phi = 0 (t is still
    written).  A projection that is NaN or +-Inf gives t = NaN (see
    attention._check_derived); returns how many, counted over the block in
    L1 (a pass over t's rows afterwards cost ~5 ns per row).  ``U``, ``a``, ``b`` (T * L * P values) and
    ``ph`` (T * L * 2**P) are scratch in the planes' dtype, which sets the
    precision of the tanh/logistic math (float32 inputs: float32, ~1e-7
    absolute in t and phi, the rounding of storing them); only their first
    T * L * P (T * L * 2**P) values are used.  Every step runs
    over all T tokens at once, plane-major, and each value is stored to
    ``t``/``phi`` once at the end (per-token corner products read back from
    phi were a quarter of the hash).  On return ``ph[:F * T]`` holds phi^T
    (F, T), masked rows zero, for :func:`hash_sketch_range`; ``t`` or ``phi``
    with no rows (a forward that keeps no residuals) are not written, which
    saves ~8 ns per row in cache (t ~3, phi ~5).

    ``lines`` 64-byte lines from address ``ahead`` (the next block's rows)
    are prefetched into L2, spread over the math after the projection: one
    core reads memory at ~40 ns per 512-byte row (12.8 GB/s on this VM), and
    without them the math after the projection leaves the memory idle
    (:func:`hash_range` over 2^21 rows, one thread: 107-110 -> 93-95 ns per
    row; rows in cache: 67-71 -> 70-72).  All lines at once at the start of
    the block gained nothing: a core keeps ~16 lines in flight.
    """
    T, d = x.shape
    L, P, _ = W.shape
    R = 1 << P
    LP = L * P
    # Constants in the scratch dtype: a float64 literal would promote float32 math.
    c = np.empty(8, U.dtype)
    c[0], c[1], c[2], c[3] = -2.0, -2.0 * beta, 1.0, _TANH_SERIES_MAX
    c[4], c[5], c[6], c[7] = -1 / 3, 2 / 15, -17 / 315, 62 / 2835
    m2, m2beta, one, small, c3, c5, c7, c9 = c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]
    dot_rows(W.reshape(LP, d), x, U[:LP * T].reshape(LP, T).T)  # plane-major: U[m * T + j]
    done = 0  # lines prefetched so far (schedule: _PF_MATH, _PF_T, _PF_CORNERS)
    n = T * LP
    for piece in range(4):
        done = _prefetch_to(ahead, done, lines * _PF_MATH * (piece + 1) // 128)
        # Unsigned bounds: a signed index that LLVM cannot prove >= 0 gets
        # Numba's wraparound select, and the loop is not vectorised (2.5x slower).
        for s in range(np.uint64(n * piece // 4), np.uint64(n * (piece + 1) // 4)):  # SIMD over the block
            u = U[s]
            bad = u - u  # 0, or NaN when u is NaN/Inf: see the end of the loop
            au = abs(u)
            e2 = exp_neg(m2 * au)
            th = (one - e2) / (one + e2)
            # Near 0, 1 - e2 cancels: ~1 ulp of 1 absolute, which 2 beta t turns into
            # ~2 beta ulp in the logistic (float32, beta = 1e4: 1e-3).  The series is
            # exact to < 1 ulp there, in either dtype.
            u2 = u * u
            ts = au + au * u2 * (c3 + u2 * (c5 + u2 * (c7 + u2 * c9)))
            th = ts if au < small else th
            th = th if u >= 0 else -th
            e = exp_neg(m2beta * abs(th))
            hi = one / (one + e)  # sigmoid(2 beta |t|)
            lo = e * hi           # sigmoid(-2 beta |t|), without the cancellation of 1 - hi
            a[s] = hi if th >= 0 else lo  # sigmoid(2 beta t)
            b[s] = lo if th >= 0 else hi  # 1 - sigmoid(2 beta t)
            # A non-finite projection leaves NaN in t (phi is computed as if it were
            # clamped): a NaN/Inf anywhere in x makes every W x non-finite, so the
            # caller's NaN/Inf check reads t (L*P values per row) instead of x (d).
            U[s] = th if bad == 0 else bad
    nan = 0  # in a loop of its own: counted in the loop above, it was not vectorised
    for s in range(np.uint64(0), np.uint64(n)):
        nan += U[s] != U[s]
    # t or phi with no rows (a forward that keeps no residuals): those loops are
    # skipped and the loops before them issue their share of the prefetches.
    pf_t = _PF_T if t.shape[0] else _PF_MATH
    pf_c = _PF_CORNERS if phi.shape[0] else 32
    if t.shape[0]:
        for j in range(T):
            done = _prefetch_to(ahead, done, lines * (_PF_MATH + (_PF_T - _PF_MATH) * (j + 1) // T) // 32)
            for m in range(LP):
                t[j, m] = U[m * T + j]
    # Corner f = l R + r of table l: the product over planes p of a (bit p of r
    # set) or b, a row of T tokens at a time.
    for f in range(L * R):
        done = _prefetch_to(ahead, done, lines * (pf_t + (pf_c - pf_t) * (f + 1) // (L * R)) // 32)
        l = f // R
        r = f - l * R
        row = ph[f * T:(f + 1) * T]
        for p in range(P):
            src = a if (r >> (P - 1 - p)) & 1 else b
            col = src[(l * P + p) * T:(l * P + p + 1) * T]
            if p == 0:
                for j in range(T):
                    row[j] = col[j]
            else:
                for j in range(T):
                    row[j] *= col[j]
    for j in range(T):  # ph is phi^T for callers that read it (hash_sketch_range)
        if not keep[j]:
            for f in range(L * R):
                ph[f * T + j] = 0.0
    if phi.shape[0]:  # the loops keep the block's length as their bound (faster, see benchmarks/README)
        for j in range(T):
            done = _prefetch_to(ahead, done, lines * (_PF_CORNERS + (32 - _PF_CORNERS) * (j + 1) // T) // 32)
            for f in range(L * R):
                phi[j, f] = ph[f * T + j]  # masked rows: zero in ph already
    return nan


#: Tokens per SIMD block of :func:`hash_rows_du`.
DU_BLOCK = 64


@njit(**_JIT)
def hash_rows_du(dphi, phi, t, P, beta, du):
    """Back through softmax over corners and tanh, every row of ``dphi (n, F)``.

    dz = phi * (dphi - phi.dphi);  s = C^T dz;  du = beta s (1 - t^2) is the
    cotangent of the projections W x, written to ``du (n, L*P)``; ``dphi``
    (float64) is overwritten.  Returns the rows' share sum s.t of dbeta.

    Each table's rows are first gathered into (R, tokens) blocks so that every
    loop runs over tokens: per token the work is a few dozen flops over
    tiny R-long rows, which one token at a time cannot vectorise (~7x slower).
    dz = phi dphi - phi (phi.dphi);  s_p = sum_r v_{r,p} dz_r.
    """
    n, F = dphi.shape
    R = 1 << P
    L = F // R
    T = DU_BLOCK
    ph = np.empty((R, T), phi.dtype)  # phi's values exactly, in half the bytes for float32
    z = np.empty((R, T))
    dot = np.empty(T)
    s = np.empty(T)
    dbeta = 0.0
    for j0 in range(0, n, T):
        m = min(T, n - j0)
        for l in range(L):
            base = l * R
            for j in range(m):  # a token's R values are contiguous: read them in order
                for r in range(R):
                    ph[r, j] = phi[j0 + j, base + r]
                    z[r, j] = dphi[j0 + j, base + r]
            for j in range(m):
                dot[j] = 0.0
            for r in range(R):
                for j in range(m):
                    e = ph[r, j] * z[r, j]
                    z[r, j] = e
                    dot[j] += e
            for r in range(R):
                for j in range(m):
                    z[r, j] -= ph[r, j] * dot[j]
            for p in range(P):
                shift = P - 1 - p
                for j in range(m):
                    s[j] = 0.0
                for r in range(R):
                    sign = 1.0 if (r >> shift) & 1 else -1.0  # corner coordinate v_{r,p}
                    for j in range(m):
                        s[j] += sign * z[r, j]
                c = l * P + p
                for j in range(m):
                    th = t[j0 + j, c]
                    dbeta += s[j] * th
                    du[j0 + j, c] = beta * s[j] * (1.0 - th * th)
    return dbeta


@njit(**_JIT)
def hash_bwd_rows(dphi, phi, t, W, beta, dx):
    """dx = (cotangent of the projections) W for rows with soft-hash cotangents
    ``dphi (n, F)`` (float64, overwritten); returns their share of dbeta.
    The hash backward runs SIMD over the rows, then :func:`combine_rows` gives
    dx, streamed (a result of the backward, not read again)."""
    L, P, d = W.shape
    du = np.empty((dphi.shape[0], L * P), W.dtype)
    acc = hash_rows_du(dphi, phi, t, P, beta, du)
    combine_rows(du, W.reshape(L * P, d), dx, True)
    return acc


@njit(**_JIT)
def hash_scratch(W):
    """:func:`hash_block`'s scratch ``(U, a, b, ph)`` for HASH_BLOCK rows, in the planes' dtype."""
    L, P, _ = W.shape
    m = HASH_BLOCK * L * P
    return np.empty(m, W.dtype), np.empty(m, W.dtype), np.empty(m, W.dtype), np.empty((HASH_BLOCK * L) << P, W.dtype)


@njit(**_JIT)
def add_rows(A, rows):
    """A += the sum of the rows of ``rows (n, F)``, one row at a time (A: float64)."""
    for j in range(rows.shape[0]):
        for f in range(rows.shape[1]):
            A[f] += rows[j, f]


@njit(**_JIT)
def hash_range(x, lo, hi, W, beta, keep, t, phi):
    """:func:`hash_block` over rows lo..hi of ``x (N, d)``, HASH_BLOCK rows at a
    time; returns the NaNs it left in t (:func:`hash_block`)."""
    U, a, b, ph = hash_scratch(W)
    # The next block's rows are prefetched during each block where x's rows are contiguous.
    row = x.shape[1] * x.itemsize
    flat = x.strides[1] == x.itemsize and x.strides[0] == row
    nan = 0
    for b0 in range(lo, hi, HASH_BLOCK):
        b1 = min(b0 + HASH_BLOCK, hi)
        lines = (min(b1 + HASH_BLOCK, hi) - b1) * row // 64 if flat else 0
        nan += hash_block(x[b0:b1], W, beta, keep[b0:b1], U, a, b, ph, t[b0:b1], phi[b0:b1],
                          x.ctypes.data + b1 * row, lines)
    return nan


#: Rows (rounded up to whole hash blocks) that :func:`hash_sketch_range` sums
#: in v's dtype before the sum moves to float64: attention.CHUNK, the
#: longest such run anywhere, while the non-causal forward's tasks are longer.
SKETCH_RUN = 1024


@njit(**_JIT)
def hash_sketch_range(x, v, lo, hi, W, beta, keep, t, phi, A, total):
    """:func:`hash_range` of rows lo..hi of ``x (N, d)``, summing the sketch of
    each block as soon as it is hashed: ``A`` (float64) += their rows of phi,
    and ``total`` (float64, overwritten) = phi^T v over rows lo..hi of
    ``v (N, dv)``, summed in v's dtype as :func:`span_totals` does for runs of
    SKETCH_RUN rows (whole blocks), the runs' sums in float64.  Returns
    the NaNs left in t (:func:`hash_block`).  Both sums read each block's
    phi^T from the hash's scratch, so ``t`` and ``phi`` may have no rows (a
    forward with no backward: nothing is written to them) and the sums are
    the same bits either way.

    The keys' rows and v's both stream from memory, at ~40 ns per 512-byte
    row and core here: each block's product (:func:`combine_rows`, phi^T as
    X) prefetches the next block's rows of v while the hash prefetches its
    rows of x, so every read is under math (an sgemm per 256 rows after the
    hash read v with nothing in flight: 190 -> 166 ns per key, one thread).
    For the non-causal sketch, whose product order no scan has to match.
    """
    F = phi.shape[1]
    dv = v.shape[1]
    U, a, b, ph = hash_scratch(W)
    tmp = np.empty((F, dv), v.dtype)
    acc = np.zeros((F, dv), v.dtype)
    rx = x.shape[1] * x.itemsize
    rv = dv * v.itemsize
    flat = (x.strides[1] == x.itemsize and x.strides[0] == rx
            and v.strides[1] == v.itemsize and v.strides[0] == rv)
    nan = 0
    total[:, :] = 0.0
    run = lo  # first row of the run in acc
    for b0 in range(lo, hi, HASH_BLOCK):
        b1 = min(b0 + HASH_BLOCK, hi)
        nxt = (min(b1 + HASH_BLOCK, hi) - b1) if flat else 0
        nan += hash_block(x[b0:b1], W, beta, keep[b0:b1], U, a, b, ph, t[b0:b1], phi[b0:b1],
                          x.ctypes.data + b1 * rx, nxt * rx // 64)
        m = b1 - b0
        P = ph[:F * m].reshape(F, m)  # phi^T of the block, masked keys zero (see hash_block)
        for f in range(F):  # the block's column sums (SIMD over its tokens), then A
            s = 0.0
            for j in range(m):
                s += P[f, j]
            A[f] += s
        combine_rows(P, v[b0:b1], tmp, False, v.ctypes.data + b1 * rv, nxt * rv // 64)
        add_into(acc, tmp)
        if b1 - run >= SKETCH_RUN or b1 == hi:  # the run summed in v's dtype ends: into float64
            for f in range(F):
                for c in range(dv):
                    total[f, c] += acc[f, c]
                    acc[f, c] = 0.0
            run = b1
    return nan


@njit(**_JIT)
def _hash_rows_task(blk, x, W, beta, keep, t, phi):
    hash_range(x, blk * 1024, min(x.shape[0], blk * 1024 + 1024), W, beta, keep, t, phi)


def soft_hash_rows(x, W, beta, t, phi):
    """phi and t of every row of ``x (N, d)`` (the public ``soft_buckets``)."""
    n = x.shape[0]
    run_tasks(_hash_rows_task, (n + 1023) // 1024, x, W, beta, np.ones(n, np.bool_), t, phi)


@njit(**_JIT)
def residual_rows(res, g, lo, hi):
    """Rows lo..hi of group ``g`` of a residual ``res (G, N, ...)``, or scratch
    for them where the caller keeps none (``res`` has no rows: a forward with
    no backward, which then writes no phi, t or den to memory)."""
    if res.shape[1] == 0:
        return np.empty((hi - lo,) + res.shape[2:], res.dtype)
    return res[g, lo:hi]


@njit(**_JIT)
def hash_chunk(x, g, lo, hi, W, beta, keep, t_res, phi_res):
    """:func:`hash_range` of rows lo..hi of group ``g`` of ``x (G, N, d)`` into
    their rows of the residuals ``t_res``, ``phi_res`` (phi: or scratch, see
    :func:`residual_rows`; t: not written where ``t_res`` has no rows).
    Returns ``(phi, t, nan)``, ``nan`` the NaNs in t: the hash leaves one per
    projection of a row with a NaN/Inf (attention._check_derived)."""
    phi, t = residual_rows(phi_res, g, lo, hi), t_res[g, lo:hi]  # t: no rows where none is kept
    return phi, t, hash_range(x[g, lo:hi], 0, hi - lo, W, beta, keep, t, phi)


# ---------------------------------------------------------------------------
# per-token readout of a sketch: forward and backward
# ---------------------------------------------------------------------------

@njit(**_JIT)
def combine_rows(X, S, out, stream=False, ahead=0, lines=0):
    """out[j] = sum_f X[j, f] S[f, :] for every row j, overwriting ``out``.

    Register tiles (:func:`racecpu._simd.comb_tile`: COMB_ROWS rows of X by
    COMB_VECTORS vectors of S's columns) where S's and out's rows are
    contiguous (X's elements are read one at a time), and
    :func:`_combine_rows_loop` at the edges.  ``stream``: a result that
    nothing reads soon (a kernel's output rows, at scale far larger than
    the caches) is written with non-temporal stores, whole vectors where
    out's rows start on one (racecpu's own results: page-aligned), else in
    16-byte pieces where they start on 16 bytes (2-row tiles, see
    :func:`racecpu._simd._comb_tile`; :func:`_run_tasks` fences them
    after each task).  Streamed in one call over many rows:
    an atomic, such as Numba's reference counts in a call with arrays,
    waits for the streamed stores in flight (batches of 16 rows between
    such calls were written at half the rate).  ``lines`` 64-byte lines
    from address ``ahead`` are prefetched into L2, spread over the plain
    tiles (:func:`hash_sketch_range`: the next block's rows of v).
    """
    n, F = X.shape
    dv = S.shape[1]
    lanes = VECTOR_BYTES // X.itemsize
    width = COMB_VECTORS * lanes
    c1 = dv - dv % width
    n1 = 0  # rows done by tiles
    if c1 > 0 and S.strides[1] == S.itemsize and out.strides[1] == out.itemsize:
        line = lanes * out.itemsize  # bytes of one stored vector
        if stream and out.ctypes.data % line == 0 and out.strides[0] % line == 0:
            n1 = n - n % COMB_ROWS
            for i in range(0, n1, COMB_ROWS):
                for c in range(0, c1, width):
                    comb_tile_lines(X, S, out, i, c)
        elif stream and out.ctypes.data % 16 == 0 and out.strides[0] % 16 == 0:
            n1 = n - n % 2
            for i in range(0, n1, 2):
                for c in range(0, c1, width):
                    comb_tile_pieces(X, S, out, i, c)
        else:
            n1 = n - n % COMB_ROWS
            tiles = (n1 // COMB_ROWS) * (c1 // width)
            done = 0
            for i in range(0, n1, COMB_ROWS):
                for c in range(0, c1, width):
                    comb_tile(X, S, out, i, c)
                    done = _prefetch_to(ahead, done, lines * ((i // COMB_ROWS) * (c1 // width) + c // width + 1)
                                        // tiles)
    if n1 == 0:
        _combine_rows_loop(X, S, out)
        return
    if c1 < dv:
        _combine_rows_loop(X[:n1], S[:, c1:], out[:n1, c1:])
    if n1 < n:
        _combine_rows_loop(X[n1:], S, out[n1:])


@njit(**_JIT)
def _combine_rows_loop(X, S, out):
    """:func:`combine_rows` by loops: eight rows of S per sweep over out[j],
    the first sweep assigning, so that the dv-long loop is bound by FMAs,
    not by reloading and storing out[j] once per row of S (2.8x faster)."""
    n, F = X.shape
    dv = S.shape[1]
    for j in range(n):
        w = X[j]
        o = out[j]
        f = 0
        if F >= 8:
            w0, w1, w2, w3, w4, w5, w6, w7 = w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]
            s0, s1, s2, s3, s4, s5, s6, s7 = S[0], S[1], S[2], S[3], S[4], S[5], S[6], S[7]
            for c in range(dv):
                o[c] = (((w0 * s0[c] + w1 * s1[c]) + (w2 * s2[c] + w3 * s3[c]))
                        + ((w4 * s4[c] + w5 * s5[c]) + (w6 * s6[c] + w7 * s7[c])))
            f = 8
        else:
            for c in range(dv):
                o[c] = 0.0
        while f + 8 <= F:
            w0, w1, w2, w3, w4, w5, w6, w7 = w[f], w[f + 1], w[f + 2], w[f + 3], w[f + 4], w[f + 5], w[f + 6], w[f + 7]
            s0, s1, s2, s3, s4, s5, s6, s7 = S[f], S[f + 1], S[f + 2], S[f + 3], S[f + 4], S[f + 5], S[f + 6], S[f + 7]
            for c in range(dv):
                o[c] += (((w0 * s0[c] + w1 * s1[c]) + (w2 * s2[c] + w3 * s3[c]))
                         + ((w4 * s4[c] + w5 * s5[c]) + (w6 * s6[c] + w7 * s7[c])))
            f += 8
        while f < F:
            wf = w[f]
            sf = S[f]
            for c in range(dv):
                o[c] += wf * sf[c]
            f += 1


@njit(**_JIT)
def dot_rows(S, X, Y):
    """Y[j, f] = S[f, :] . X[j, :] for every row j of ``X (n, dv)`` and f of ``S (F, dv)``.

    ``Y (n, F)`` may be float64 or strided (the projection writes its
    transpose); the sums run in X's dtype.  Register tiles
    (:func:`racecpu._simd.dot_tile_rows` / ``dot_tile_cols``: TILE_ROWS rows
    of X by a few rows of S) where rows are contiguous, dv is a whole number
    of vectors and Y is contiguous along either axis; :func:`_dot_rows_loop`
    for the edges (last rows of X or of S) and everything else.
    """
    F, dv = S.shape
    n = X.shape[0]
    lanes = VECTOR_BYTES // X.itemsize
    ms = lanes // TILE_ROWS
    n1 = n - n % TILE_ROWS  # rows of X in tiles
    f1 = F - F % ms  # rows of S in tiles
    by_row = Y.strides[1] == Y.itemsize
    if (n1 == 0 or f1 == 0 or dv == 0 or dv % lanes or X.strides[1] != X.itemsize
            or S.strides[1] != S.itemsize or not (by_row or Y.strides[0] == Y.itemsize)):
        _dot_rows_loop(S, X, Y)
        return
    for j in range(0, n1, TILE_ROWS):
        for f in range(0, f1, ms):
            if by_row:
                dot_tile_rows(S, X, Y, j, f)
            else:
                dot_tile_cols(S, X, Y, j, f)
    # The last rows of S: one at a time where Y's columns are contiguous.
    n2 = 0 if by_row else n - n % lanes
    for j in range(0, n2, lanes):
        for f in range(f1, F):
            dot_tile_cols1(S, X, Y, j, f)
    if f1 < F and n2 < n1:
        _dot_rows_loop(S[f1:], X[n2:n1], Y[n2:n1, f1:])
    if n1 < n:
        _dot_rows_loop(S, X[n1:], Y[n1:])


@njit(**_JIT)
def _dot_rows_loop(S, X, Y):
    """:func:`dot_rows` by loops.  Two rows of X and four of S per sweep, each product with
    its own accumulator: every load feeds two FMAs and the horizontal sums
    overlap (the hash's 9 planes: 45 vs 53 ns per row against eight rows of
    S and one of X; 2.4x one product at a time).  A whole block per call,
    not a row: the call per row cost ~15 ns of a ~60 ns row.
    """
    F, dv = S.shape
    n = X.shape[0]
    if dv == 0:
        for j in range(n):
            for f in range(F):
                Y[j, f] = 0.0
        return
    for j in range(0, n, 2):
        x = X[j]
        u = X[j + 1] if j + 1 < n else x  # an odd last row is summed twice, stored once
        y = Y[j]
        zx = x[0] - x[0]  # typed zeros (NaN with a non-finite row, whose sums are NaN anyway)
        zu = u[0] - u[0]
        f = 0
        while f + 4 <= F:
            a0 = a1 = a2 = a3 = zx
            b0 = b1 = b2 = b3 = zu
            s0, s1, s2, s3 = S[f], S[f + 1], S[f + 2], S[f + 3]
            for c in range(dv):
                xc = x[c]
                uc = u[c]
                a0 += s0[c] * xc
                a1 += s1[c] * xc
                a2 += s2[c] * xc
                a3 += s3[c] * xc
                b0 += s0[c] * uc
                b1 += s1[c] * uc
                b2 += s2[c] * uc
                b3 += s3[c] * uc
            y[f], y[f + 1], y[f + 2], y[f + 3] = a0, a1, a2, a3
            if j + 1 < n:
                z = Y[j + 1]
                z[f], z[f + 1], z[f + 2], z[f + 3] = b0, b1, b2, b3
            f += 4
        while f < F:
            a = zx
            b = zu
            for c in range(dv):
                a += S[f, c] * x[c]
                b += S[f, c] * u[c]
            y[f] = a
            if j + 1 < n:
                Y[j + 1, f] = b
            f += 1


@njit(**_JIT)
def outer_add(w, x, B):
    """B += sum_j w[j, :]^T x[j, :] (rank-1 updates), eight rows j per sweep over B."""
    n = w.shape[0]
    F, dv = B.shape
    j = 0
    while j + 8 <= n:
        x0, x1, x2, x3, x4, x5, x6, x7 = x[j], x[j + 1], x[j + 2], x[j + 3], x[j + 4], x[j + 5], x[j + 6], x[j + 7]
        for f in range(F):
            w0, w1, w2, w3 = w[j, f], w[j + 1, f], w[j + 2, f], w[j + 3, f]
            w4, w5, w6, w7 = w[j + 4, f], w[j + 5, f], w[j + 6, f], w[j + 7, f]
            for c in range(dv):
                B[f, c] += (((w0 * x0[c] + w1 * x1[c]) + (w2 * x2[c] + w3 * x3[c]))
                            + ((w4 * x4[c] + w5 * x5[c]) + (w6 * x6[c] + w7 * x7[c])))
        j += 8
    while j < n:
        xj = x[j]
        for f in range(F):
            wf = w[j, f]
            for c in range(dv):
                B[f, c] += wf * xj[c]
        j += 1


#: Rows from which a rank-k update goes to BLAS (np.dot: single-threaded sgemm,
#: see blas_one_thread) rather than :func:`outer_add`; below it, call overhead
#: wins.  The causal steps' rank-8 updates (SCAN_BLOCK) are faster in sgemm:
#: causal fwd+bwd 796 against 901 ns per token-head through outer_add.
BLAS_ROWS = 8
#: Rows per sgemm of the non-causal queries' chunk totals of dB
#: (:func:`span_totals`): one sgemm over a whole 1024-token chunk ran 1.8x
#: slower than four of 256.
BLAS_SPAN = 256
#: ``span`` of :func:`sketch_chunks` for totals that no scan has to match:
#: each hash block's product as soon as it is hashed (:func:`hash_sketch_range`).
SKETCH_FUSED = 0


@njit(**_JIT)
def step_product(w, x, out):
    """out = w^T x for ``w (m, F)``, ``x (m, dv)``, overwriting ``out (F, dv)``:
    sgemm from BLAS_ROWS rows, :func:`outer_add` below (call overhead wins)."""
    if w.shape[0] >= BLAS_ROWS and out.shape[1] > 0:
        np.dot(w.T, x, out)
    else:
        out[:] = 0.0
        outer_add(w, x, out)


@njit(**_JIT)
def add_product(w, x, S, tmp, total, track):
    """S += w^T x (one scan step's state update; ``tmp`` (F, dv) holds the
    product), and ``total`` += the same product when ``track`` (one chunk's
    sum, in the compute dtype as S: a float64 total cost 35 ns more per token,
    one thread, its 24 KB pushing the step's arrays out of L1)."""
    step_product(w, x, tmp)
    F, dv = S.shape
    if track:  # one pass over tmp for both sums
        for f in range(F):
            for c in range(dv):
                t = tmp[f, c]
                S[f, c] += t
                total[f, c] += t
    else:
        for f in range(F):
            for c in range(dv):
                S[f, c] += tmp[f, c]


@njit(**_JIT)
def add_into(acc, tmp):
    """acc += tmp for two (F, dv) arrays: the sum of a chunk's products."""
    F, dv = acc.shape
    for f in range(F):
        for c in range(dv):
            acc[f, c] += tmp[f, c]


@njit(**_JIT)
def span_totals(w, x, span, reverse, total, tmp):
    """total (float64) = w^T x, one :func:`step_product` per ``span`` rows
    (aligned at row 0; the last span first when ``reverse``).

    The span products are summed in the compute dtype of ``tmp`` (a chunk's
    rows at most, as the scans' states), and that sum is written to ``total``
    as float64.  With span = SCAN_BLOCK these are, bit for bit, the chunk
    totals that a segment's scan tracks step by step (:func:`add_product`,
    :func:`_carry_on`), so the causal scans carry identical states however
    many segments they run in.
    """
    n = w.shape[0]
    F, dv = total.shape
    acc = np.zeros((F, dv), tmp.dtype)
    nb = (n + span - 1) // span
    for b in range(nb):
        bi = nb - 1 - b if reverse else b
        j0 = bi * span
        j1 = min(j0 + span, n)
        step_product(w[j0:j1], x[j0:j1], tmp)
        add_into(acc, tmp)
    for f in range(F):
        for c in range(dv):
            total[f, c] = acc[f, c]


@njit(**_JIT)
def readout_rows(phiq, A, S, L, den, out):
    """out_i = (phiq_i S) / (phiq_i . A) with the 1/L of both, den_i = phiq_i . A / L, every row.

    A is float64; S is (F, dv) in the compute dtype.  Rows whose den is at
    most DEN_FLOOR get zeros (see hashing.DEN_FLOOR).  The rows of phiq are
    scaled first, so that out is written once, streamed
    (:func:`combine_rows`): an sgemm and a pass scaling its result read and
    wrote every row of out twice.
    """
    n, F = phiq.shape
    w = np.empty((n, F), phiq.dtype)
    for i in range(n):
        dn = 0.0
        for f in range(F):
            dn += phiq[i, f] * A[f]
        dn /= L
        den[i] = dn
        inv = 1.0 / (L * dn) if dn > DEN_FLOOR else 0.0  # the floor: zeros
        for f in range(F):
            w[i, f] = phiq[i, f] * inv
    combine_rows(w, S, out, True)


@njit(**_JIT)
def dphi_from_y(phiq, A, den, L, dphi, wq):
    """Cotangent of one row of :func:`readout_rows` w.r.t. phiq, once ``dphi``
    (float64) holds y = S g; returns dden.

    dden = -(phiq . y) / (L den^2),  dphiq = y / (L den) + A dden / L
    (overwriting ``dphi``), and the weights ``wq = phiq / (L den)`` with which
    g enters dB (dB += wq g^T).  Rows at the DEN_FLOOR get zeros.
    """
    F = phiq.shape[0]
    if den <= DEN_FLOOR:
        for f in range(F):
            dphi[f] = 0.0
            wq[f] = 0.0
        return 0.0
    inv = 1.0 / (L * den)
    phiy = 0.0
    for f in range(F):
        phiy += phiq[f] * dphi[f]
    dden = -phiy * inv / den
    for f in range(F):
        dphi[f] = dphi[f] * inv + A[f] * dden / L
        wq[f] = phiq[f] * inv
    return dden


# ---------------------------------------------------------------------------
# chunk bookkeeping
# ---------------------------------------------------------------------------

@njit(**_JIT)
def _bounds(task, nc, chunk, n):
    g = task // nc
    c = task - g * nc
    lo = c * chunk
    hi = min(lo + chunk, n)
    return g, c, lo, hi


def spread_order(G, nc, t0, t1):
    """Order of the ``G * nc`` (group, chunk) tasks of a parallel kernel in which
    the chunks ``t0 <= c < t1`` of every group cost more (they also sum a
    product total): those and the others each spread evenly over the order.
    ``prange`` hands every thread a contiguous share of the tasks, so in group
    and chunk order one thread would get all the costly chunks of one head.
    """
    heavy = np.zeros((G, nc), np.bool_)
    heavy[:, t0:t1] = True
    heavy = heavy.ravel()
    key = np.empty(G * nc)
    for m in (heavy, ~heavy):
        count = np.count_nonzero(m)
        key[m] = (np.arange(count) + 0.5) / max(count, 1)
    return np.argsort(key, kind="stable")


@njit(**_JIT)
def segment_start(s, segments, nc):
    """First chunk of segment ``s`` of ``segments`` over ``nc`` chunks (``nc`` for s = segments;
    see :func:`scan_segments`)."""
    return s * nc // segments


@njit(**_JIT)
def _exclusive_step(part, out, acc):
    """out = acc, then acc += part (one chunk of an exclusive scan; ``out`` may be ``part``)."""
    for e in range(acc.shape[0]):
        x = part[e]  # read before the write
        out[e] = acc[e]
        acc[e] += x


@njit(**_JIT)
def _scan_chunks(part, segments, reverse, out):
    """out[g, c] = sum of part[g, c'] over c' < c (c' > c: ``reverse``), in chunk
    order, for the first chunk c (in scan order) of each segment only."""
    G, nc, E = part.shape
    acc = np.empty(E)
    for g in range(G):
        acc[:] = 0.0
        for i in range(segments):
            s = segments - 1 - i if reverse else i
            c0 = segment_start(s, segments, nc)
            c1 = segment_start(s + 1, segments, nc)
            for j in range(c1 - c0):
                c = c1 - 1 - j if reverse else c0 + j
                if j > 0:
                    for e in range(E):
                        acc[e] += part[g, c, e]
                elif i == segments - 1:  # the last segment: no total of it is summed (nor read)
                    for e in range(E):
                        out[g, c, e] = acc[e]
                    break
                else:
                    _exclusive_step(part[g, c], out[g, c], acc)


def exclusive_scan(part, reverse=False, out=None, segments=None):
    """Exclusive prefix (or suffix, ``reverse``) sums over axis 1 of float64 ``part (G, nc, ...)``.

    Sums run in chunk order, as ``np.cumsum`` would.  ``out`` (optional, like
    ``part``) may be ``part`` itself: the scan then allocates nothing.  At
    2^20 tokens x 4 heads the partials are 100 MB; np.cumsum through
    temporaries took 70-150 ns per token-head, this one pass ~3 (memory-bound
    and short: one thread, no parallel kernel to compile).  ``segments``
    (default: one per chunk): only the sums at the first chunk, in scan
    order, of each segment (:func:`scan_segments`) are written, and only the
    chunks of the other segments are read (those :func:`sketch_chunks` and
    :func:`causal_queries_bwd` sum with their ``totals``); the same bits.
    """
    if out is None:
        out = np.empty_like(part)
    if part.size:
        G, nc = part.shape[:2]
        _scan_chunks(part.reshape(G, nc, -1), nc if segments is None else segments, reverse,
                     out.reshape(G, nc, -1))
    return out


# ---------------------------------------------------------------------------
# sketch of keys: forward (chunk totals) and its cotangent (per key)
# ---------------------------------------------------------------------------

@njit(**_JIT)
def _sketch_chunks_task(task, order, k, v, mask, W, beta, chunk, span, t0, t1, phik, tk, partA, partB, nan):
    """One (group, chunk) task of :func:`sketch_chunks` (run by :func:`run_tasks`;
    loops inlined into a prange body were not vectorised)."""
    G, n, _ = k.shape
    nc = partA.shape[1]
    F = phik.shape[2]
    g, c, lo, hi = _bounds(order[task], nc, chunk, n)
    if span == SKETCH_FUSED:
        # phik, tk with no rows (a forward with no backward): hash_block writes none
        nan[task] = hash_sketch_range(k[g, lo:hi], v[g, lo:hi], 0, hi - lo, W, beta, mask[g, lo:hi],
                                      tk[g, lo:hi], phik[g, lo:hi], partA[g, c], partB[g, c])
        return
    phi, _, nan[task] = hash_chunk(k, g, lo, hi, W, beta, mask[g, lo:hi], tk, phik)
    add_rows(partA[g, c], phi)
    if t0 <= c < t1:
        span_totals(phi, v[g, lo:hi], span, False, partB[g, c], np.empty((F, v.shape[2]), v.dtype))


@blas_tasks
def sketch_chunks(k, v, mask, W, beta, chunk, phik, tk, partA, partB, span=None, totals=None):
    """Hash every key and sum its sketch per chunk.

    Writes ``phik (G, Nk, F)`` and ``tk (G, Nk, L*P)`` (masked keys: phi = 0;
    either may have no rows, when nothing reads it later: see
    :func:`residual_rows`), adds the chunk totals of A to ``partA (G, nc, F)`` (float64, zeros on
    entry) and writes those of B to ``partB (G, nc, F, dv)`` (float64).
    Non-causal attention sums them; the causal scan carries them.  ``span``: rows per product of the B totals (default
    SCAN_BLOCK, the causal scans' steps, see :func:`span_totals`), or
    SKETCH_FUSED: each block's product as soon as it is hashed
    (:func:`hash_sketch_range`; faster, where no scan has to match).  ``totals``: the chunks ``(c0, c1)``
    of every group whose B totals are summed (default all; the causal forward
    needs those before its last segment, see :func:`scan_segments`).
    Returns the number of NaNs in the keys' t (see :func:`hash_block`).
    """
    G, nc = partA.shape[:2]
    t0, t1 = (0, nc) if totals is None else totals
    nan = np.zeros(G * nc, np.int64)
    run_tasks(_sketch_chunks_task, G * nc, spread_order(G, nc, t0, t1), k, v, mask, W, beta, chunk,
              SCAN_BLOCK if span is None else span, t0, t1, phik, tk, partA, partB, nan)
    return int(nan.sum())


@njit(**_JIT)
def _keys_bwd_task(task, v, phik, tk, dA, dB, W, beta, chunk, dk, dv_out, dbeta_part):
    """One (group, chunk) task of :func:`keys_bwd` (run by :func:`run_tasks`;
    loops inlined into a prange body were not vectorised)."""
    G, n, _ = v.shape
    F = phik.shape[2]
    nc = dbeta_part.shape[1]
    g, c, lo, hi = _bounds(task, nc, chunk, n)
    DPHI = np.empty((hi - lo, F), np.float64)
    combine_rows(phik[g, lo:hi], dB[g], dv_out[g, lo:hi], True)  # dv_j = dB^T phik_j (masked keys: 0)
    dot_rows(dB[g], v[g, lo:hi], DPHI)  # dphik_j = dB v_j + dA
    for j in range(hi - lo):
        for f in range(F):
            DPHI[j, f] += dA[g, f]
    dbeta_part[g, c] = hash_bwd_rows(DPHI, phik[g, lo:hi], tk[g, lo:hi], W, beta, dk[g, lo:hi])


@blas_tasks
def keys_bwd(v, phik, tk, dA, dB, W, beta, chunk, dk, dv_out, dbeta_part):
    """Non-causal cotangents of every key from the summed (dA, dB)."""
    G, nc = dbeta_part.shape[:2]
    run_tasks(_keys_bwd_task, G * nc, v, phik, tk, dA, dB, W, beta, chunk, dk, dv_out, dbeta_part)


# ---------------------------------------------------------------------------
# non-causal readout of queries: forward and backward
# ---------------------------------------------------------------------------

@njit(**_JIT)
def _queries_fwd_task(task, keep, q, W, beta, chunk, A, B, phiq, tq, den, out, nan):
    """One (group, chunk) task of :func:`queries_fwd` (run by :func:`run_tasks`;
    loops inlined into a prange body were not vectorised)."""
    G, n, _ = q.shape
    L = W.shape[0]
    nc = (n + chunk - 1) // chunk
    g, c, lo, hi = _bounds(task, nc, chunk, n)
    phi, _, nan[task] = hash_chunk(q, g, lo, hi, W, beta, keep[lo:hi], tq, phiq)
    readout_rows(phi, A[g], B[g], L, residual_rows(den, g, lo, hi), out[g, lo:hi])


@blas_tasks
def queries_fwd(q, W, beta, chunk, A, B, phiq, tq, den, out):
    """Hash every query and read the summed sketch ``A (G, F)``, ``B (G, F, dv)``.

    ``phiq``, ``tq``, ``den`` may have no rows (:func:`residual_rows`).
    Returns the number of NaNs in the queries' t (see :func:`hash_block`).
    """
    G, n, _ = q.shape
    keep = np.ones(n, np.bool_)  # queries are never masked
    nan = np.zeros(G * ((n + chunk - 1) // chunk), np.int64)
    run_tasks(_queries_fwd_task, nan.size, keep, q, W, beta, chunk, A, B, phiq, tq, den, out, nan)
    return int(nan.sum())


@njit(**_JIT)
def _query_bwd_buffers(grad, F, n):
    """Per-task buffers of a query chunk's backward: ``wq`` (F,), the weights
    ``wblock (n, F)`` of g in dB, ``dA`` (F,) and the dphi rows ``DPHI (n, F)``."""
    return (np.empty(F, np.float64), np.empty((n, F), grad.dtype),
            np.zeros(F, np.float64), np.empty((n, F), np.float64))


@njit(**_JIT)
def queries_chunk_end(g, c, lo, hi, grad, phiq, tq, wblock, DPHI, dA, W, beta, dq, partdA, partdB, span):
    """End of a query chunk's backward (causal or not); returns the chunk's hash share of dbeta.

    The chunk totals to ``partdA``, and to ``partdB`` (float64) the
    chunk's dB = sum_i wq_i g_i^T by :func:`span_totals` over
    ``span`` rows (last span first, as the reverse scan meets them; span 0:
    none), then the hash backward of every query (``DPHI`` holds dphi rows)
    with dq (:func:`hash_bwd_rows`).
    """
    partdA[g, c] = dA
    if span > 0:
        span_totals(wblock, grad[g, lo:hi], span, True, partdB[g, c],
                    np.empty((wblock.shape[1], grad.shape[2]), grad.dtype))
    return hash_bwd_rows(DPHI, phiq[g, lo:hi], tq[g, lo:hi], W, beta, dq[g, lo:hi])


@njit(**_JIT)
def _queries_bwd_task(task, grad, phiq, tq, den, A, B, W, beta, chunk, dq, partdA, partdB, dbeta_part):
    """One (group, chunk) task of :func:`queries_bwd` (run by :func:`run_tasks`;
    loops inlined into a prange body were not vectorised)."""
    G, n, dv = grad.shape
    L = W.shape[0]
    F = phiq.shape[2]
    nc = partdA.shape[1]
    g, c, lo, hi = _bounds(task, nc, chunk, n)
    wq, wblock, dA, DPHI = _query_bwd_buffers(grad, F, hi - lo)
    dot_rows(B[g], grad[g, lo:hi], DPHI)  # y_i = B g_i, turned into dphi_i in place
    for i in range(lo, hi):
        dden = dphi_from_y(phiq[g, i], A[g], den[g, i], L, DPHI[i - lo], wq)
        for f in range(F):
            dA[f] += phiq[g, i, f] * dden / L
            wblock[i - lo, f] = wq[f]
    dbeta_part[g, c] = queries_chunk_end(g, c, lo, hi, grad, phiq, tq, wblock, DPHI, dA, W, beta,
                                         dq, partdA, partdB, BLAS_SPAN)


@blas_tasks
def queries_bwd(grad, phiq, tq, den, A, B, W, beta, chunk, dq, partdA, partdB, dbeta_part):
    """Non-causal cotangents of every query, and chunk sums of (dA, dB)."""
    G, nc = partdA.shape[:2]
    run_tasks(_queries_bwd_task, G * nc, grad, phiq, tq, den, A, B, W, beta, chunk, dq, partdA, partdB, dbeta_part)


# ---------------------------------------------------------------------------
# causal scan: forward (rescan from carries) and backward (two rescans)
# ---------------------------------------------------------------------------

#: Tokens per step of the causal scans.  A step is a few small matrix
#: products (BLAS runs them at ~100 GFLOP/s; the dot-shaped ones, X S^T over
#: dv-long rows, and the forward's readouts run in the register tiles of
#: :func:`dot_rows` and :func:`combine_rows`): queries read the state from
#: before the step, plus the step's own keys through a triangular
#: (SCAN_BLOCK, SCAN_BLOCK) block, and the state takes one rank-SCAN_BLOCK
#: update.  The state's products cost the same per token at any step size,
#: the triangular block's grow with it and the calls' overhead shrinks: 8
#: (causal fwd+bwd 1.4 % and fwd 3.9 % faster than 16, ``ab.py`` at 2^19;
#: 32 and 4 slower, 12 not told from 16).  Per-token vector loops instead ran
#: at 8-40 GFLOP/s.
SCAN_BLOCK = 8


@njit(**_JIT)
def _zero_above(M):
    """Zero the strict upper triangle of square ``M`` (keep j <= i)."""
    m = M.shape[0]
    for i in range(m):
        for j in range(i + 1, m):
            M[i, j] = 0.0


@njit(**_JIT)
def _zero_below(M):
    """Zero the strict lower triangle of square ``M`` (keep j >= i)."""
    m = M.shape[0]
    for i in range(1, m):
        for j in range(i):
            M[i, j] = 0.0


#: Length F of phi's rows from which a step's scores phi_i . phi_j go to BLAS:
#: below, its NT sgemm takes the copying path (~220 ns per 8 x 8 block of
#: F = 24 against ~115 here, one thread); from 32 on it is as fast or faster.
BLAS_SCORE_F = 32


@njit(**_JIT)
def step_scores(X, Y, out, lower):
    """out[i, j] = X[i] . Y[j] where j <= i (``lower``) or j >= i (not), 0 elsewhere.

    The triangular scores of a scan step between rows of phi (``X (m, F)``,
    ``Y (k, F)``, ``out (m, k)``).  Four rows of Y per sweep over a row of X
    (each load of X feeds four FMAs; the masked entries of a sweep are
    overwritten with zeros); np.dot + a mask from BLAS_SCORE_F columns.
    Not :func:`dot_rows` (the same product, Y = X S^T): built for dv-long
    rows, it took 195-200 ns on an 8 x 8 block of F = 24 against ~115 here,
    and computes the masked half too.
    """
    m, F = X.shape
    k = Y.shape[0]
    if F >= BLAS_SCORE_F:
        np.dot(X, Y.T, out)
        if lower:
            _zero_above(out)
        else:
            _zero_below(out)
        return
    for i in range(m):
        x = X[i]
        o = out[i]
        lo, hi = (0, min(i + 1, k)) if lower else (i, k)
        j = lo - lo % 4
        while j < hi and j + 4 <= k:
            y0, y1, y2, y3 = Y[j], Y[j + 1], Y[j + 2], Y[j + 3]
            a0 = a1 = a2 = a3 = x[0] - x[0]  # typed zeros (NaN with a non-finite row, whose sums are NaN anyway)
            for f in range(F):
                xf = x[f]
                a0 += xf * y0[f]
                a1 += xf * y1[f]
                a2 += xf * y2[f]
                a3 += xf * y3[f]
            o[j], o[j + 1], o[j + 2], o[j + 3] = a0, a1, a2, a3
            j += 4
        while j < hi:
            y0 = Y[j]
            a0 = x[0] - x[0]
            for f in range(F):
                a0 += x[f] * y0[f]
            o[j] = a0
            j += 1
        for j in range(lo):
            o[j] = 0.0
        for j in range(hi, k):
            o[j] = 0.0


@njit(**_JIT)
def _step_buffers(like, F, m):
    """Scratch of one scan step of ``m`` tokens in the compute dtype of ``like``:
    two (m, m), three (m, F), one (m, dv) and the state increment (F, dv)."""
    dv = like.shape[-1]
    dt = like.dtype
    return (np.zeros((m, m), dt), np.zeros((m, m), dt), np.zeros((m, F), dt), np.zeros((m, F), dt),
            np.zeros((m, F), dt), np.zeros((m, dv), dt), np.zeros((F, dv), dt))


def scan_segments(G, nc, n):
    """Segments per group of the causal scans of ``G`` groups of ``n`` tokens in ``nc`` chunks.

    A segment is a run of consecutive chunks that one task scans in order,
    carrying the state itself (:func:`causal_fwd`, :func:`causal_keys_bwd`);
    only its first carry comes from the chunk totals of the segments before
    it (after it: the reverse scan), and every total costs a sgemm per token.
    So: one segment per group (no totals at all) where the groups alone share
    the threads evenly, else the fewest that do, ``threads / gcd(G, threads)``
    (one head on 2 threads: 2, the totals of half the chunks; the backward's,
    of a third: :func:`causal_bwd_split`), at most one per chunk.  Results do
    not depend on it, bit for bit (:func:`span_totals`).
    """
    threads = numba.get_num_threads() if G * n >= config.SERIAL_TOKENS else 1
    return max(1, min(nc, threads // math.gcd(G, threads)))


@njit(**_JIT)
def _segment(task, segments, nc):
    """Group and chunk range ``[c0, c1)`` of causal scan task ``task`` (:func:`segment_start`)."""
    g = task // segments
    s = task - g * segments
    return g, segment_start(s, segments, nc), segment_start(s + 1, segments, nc)


@njit(**_JIT)
def _carry_on(carry, g, c, dst, total, final):
    """carry[g, dst] = carry[g, c] + total (``final[g]`` when dst is past the
    chunks; float64 + the compute dtype) and total = 0: a segment's next
    carry, summed as :func:`exclusive_scan` sums the chunk totals."""
    F, dv = total.shape
    to = carry[g, dst] if 0 <= dst < carry.shape[1] else final[g]
    for f in range(F):
        for cc in range(dv):
            to[f, cc] = carry[g, c, f, cc] + total[f, cc]
            total[f, cc] = 0.0


@njit(**_JIT)
def _causal_fwd_task(task, segments, keep, q, v, phik, carryA, carryB, W, beta, chunk, phiq, tq, den, out, final, nan):
    """One segment of :func:`causal_fwd` (run by :func:`run_tasks`; loops inlined
    into a prange body were not vectorised)."""
    G, n, _ = q.shape
    L = W.shape[0]
    nc = carryA.shape[1]
    F = phik.shape[2]
    dv = v.shape[2]
    g, c0, c1 = _segment(task, segments, nc)
    last = c1 == nc and final.shape[0] > 0  # this segment writes the total to final
    track = last or c1 - c0 > 1
    total = np.zeros((F, dv), v.dtype)  # the chunk's sum of state updates, for the next carry
    for c in range(c0, c1):
        lo = c * chunk
        hi = min(lo + chunk, n)
        phi, _, bad = hash_chunk(q, g, lo, hi, W, beta, keep[lo:hi], tq, phiq)
        nan[task] += bad
        dnc = residual_rows(den, g, lo, hi)
        A = carryA[g, c].copy()
        S = carryB[g, c].astype(v.dtype)  # the carried-in state, in the compute dtype
        H, _, _, _, _, X, dS = _step_buffers(v, F, min(SCAN_BLOCK, hi - lo))
        for i0 in range(lo, hi, SCAN_BLOCK):
            i1 = min(i0 + SCAN_BLOCK, hi)
            m = i1 - i0
            if m != H.shape[0]:  # the chunk's last, shorter step
                H, _, _, _, _, X, dS = _step_buffers(v, F, m)
            Pq, Pk, V, O = phi[i0 - lo:i1 - lo], phik[g, i0:i1], v[g, i0:i1], out[g, i0:i1]
            step_scores(Pq, Pk, H, True)  # H_ij = phiq_i . phik_j, kept for j <= i
            if dv > 0:
                combine_rows(Pq, S, O)
                combine_rows(H, V, X)
            for i in range(m):
                dn = 0.0
                for f in range(F):
                    dn += Pq[i, f] * A[f]
                for j in range(i + 1):
                    dn += H[i, j]
                dn /= L
                dnc[i0 - lo + i] = dn
                inv = 1.0 / (L * dn) if dn > DEN_FLOOR else 0.0  # the floor: zeros
                for cc in range(dv):
                    O[i, cc] = (O[i, cc] + X[i, cc]) * inv
            add_rows(A, Pk)
            add_product(Pk, V, S, dS, total, track)
        if c + 1 < c1 or last:
            _carry_on(carryB, g, c, c + 1, total, final)


@blas_tasks
def causal_fwd(q, v, phik, carryA, carryB, W, beta, chunk, phiq, tq, den, out, final=None, segments=None):
    """Scan every segment of chunks from its carried-in state; query i sees keys j <= i.

    ``carryA (G, nc, F)``, ``carryB (G, nc, F, dv)`` (float64) hold the state
    (A, B) summed over all keys before each chunk; of B, only the carry at
    the first chunk of each of the ``segments`` per group (default: one per
    chunk) is read, and the scan writes the others, bit for bit those of the
    chunk totals (:func:`span_totals`).  Per step of SCAN_BLOCK tokens with
    state B before it: out = (Phiq B + tril(Phiq Phik^T) V) / ..., then
    B += Phik^T V.  ``final (G, F, dv)`` (float64) given: the total B too.
    ``phiq``, ``tq``, ``den`` may have no rows (:func:`residual_rows`).
    Returns the number of NaNs in the queries' t (see :func:`hash_block`).
    """
    G, nc = carryA.shape[:2]
    keep = np.ones(q.shape[1], np.bool_)  # queries are never masked
    segments = nc if segments is None else segments
    nan = np.zeros(G * segments, np.int64)
    run_tasks(_causal_fwd_task, G * segments, segments, keep, q, v, phik, carryA, carryB, W, beta, chunk,
              phiq, tq, den, out, np.zeros((0, 0, 0)) if final is None else final, nan)
    return int(nan.sum())


@njit(**_JIT)
def _causal_queries_bwd_chunk(g, c, t0, t1, grad, v, phik, phiq, tq, den, carryA, carryB, W, beta, chunk, dq, dden_out, partdA, partdB, dbeta_part):
    """Chunk ``c`` of group ``g`` of :func:`causal_queries_bwd`."""
    G, n, dv = grad.shape
    L = W.shape[0]
    F = phik.shape[2]
    lo = c * chunk
    hi = min(lo + chunk, n)
    A = carryA[g, c].copy()
    S = carryB[g, c].astype(v.dtype)  # the carried-in state, in the compute dtype
    wq, wblock, dA, DPHI = _query_bwd_buffers(grad, F, hi - lo)
    M, _, _, Y, Z, _, dS = _step_buffers(v, F, min(SCAN_BLOCK, hi - lo))
    for i0 in range(lo, hi, SCAN_BLOCK):
        i1 = min(i0 + SCAN_BLOCK, hi)
        m = i1 - i0
        if m != M.shape[0]:  # the chunk's last, shorter step
            M, _, _, Y, Z, _, dS = _step_buffers(v, F, m)
        Pq, Pk, V, Gb = phiq[g, i0:i1], phik[g, i0:i1], v[g, i0:i1], grad[g, i0:i1]
        if dv > 0:  # y_i = B_i g_i = B g_i + sum_{j<=i} phik_j (v_j . g_i)
            dot_rows(S, Gb, Y)
            dot_rows(V, Gb, M)  # M_ij = g_i . v_j, kept for j <= i
            _zero_above(M)
            np.dot(M, Pk, Z)
        for i in range(m):
            dphi = DPHI[i0 + i - lo]  # the hash backward runs once per chunk, SIMD over tokens
            for f in range(F):
                A[f] += Pk[i, f]
                dphi[f] = Y[i, f] + Z[i, f]
            dden = dphi_from_y(Pq[i], A, den[g, i0 + i], L, dphi, wq)
            dden_out[g, i0 + i] = dden
            for f in range(F):
                dA[f] += Pq[i, f] * dden / L
                wblock[i0 + i - lo, f] = wq[f]
        add_product(Pk, V, S, dS, dS, False)  # (no total to track)
    dbeta_part[g, c] = queries_chunk_end(g, c, lo, hi, grad, phiq, tq, wblock, DPHI, dA, W, beta,
                                         dq, partdA, partdB, SCAN_BLOCK if t0 <= c < t1 else 0)


@njit(**_JIT)
def _causal_queries_bwd_task(task, order, t0, t1, grad, v, phik, phiq, tq, den, carryA, carryB, W, beta, chunk, dq, dden_out, partdA, partdB, dbeta_part):
    """One (group, chunk) task of :func:`causal_queries_bwd` (run by :func:`run_tasks`;
    loops inlined into a prange body were not vectorised)."""
    nc = carryA.shape[1]
    g, c, _, _ = _bounds(order[task], nc, chunk, grad.shape[1])
    _causal_queries_bwd_chunk(g, c, t0, t1, grad, v, phik, phiq, tq, den, carryA, carryB, W, beta, chunk,
                              dq, dden_out, partdA, partdB, dbeta_part)


@blas_tasks
def causal_queries_bwd(grad, v, phik, phiq, tq, den, carryA, carryB, W, beta, chunk,
                       dq, dden_out, partdA, partdB, dbeta_part, totals=None):
    """Backward pass 1: rebuild prefix states by rescanning; cotangents of queries.

    Per step with state B before it: Y = G B^T + tril(G V^T) Phik, whose rows
    are y_i = B_i g_i.  Also stores dden per query and the chunk totals of
    (dA, dB) for the reverse scan (``partdA``, ``partdB``: written, not added),
    those of dB for the chunks ``totals = (c0, c1)`` of every group only
    (default all; :func:`causal_keys_bwd` needs those after its first segment).
    """
    G, nc = carryA.shape[:2]
    t0, t1 = (0, nc) if totals is None else totals
    run_tasks(_causal_queries_bwd_task, G * nc, spread_order(G, nc, t0, t1), t0, t1, grad, v, phik, phiq, tq, den,
              carryA, carryB, W, beta, chunk, dq, dden_out, partdA, partdB, dbeta_part)


@njit(**_JIT)
def _causal_keys_bwd_task(task, segments, grad, v, phik, tk, phiq, den, dden, carrydA, carrydB, W, beta, chunk, dk, dv_out, dbeta_part, final):
    """One segment of :func:`causal_keys_bwd` (run by :func:`run_tasks`; loops
    inlined into a prange body were not vectorised)."""
    dv = grad.shape[2]
    nc = carrydA.shape[1]
    F = phik.shape[2]
    g, c0, c1 = _segment(task, segments, nc)
    last = c0 == 0 and final.shape[0] > 0  # this segment writes the total to final
    total = np.zeros((F, dv), grad.dtype)  # the chunk's sum of dB updates, for the next carry
    for ci in range(c1 - c0):
        _causal_keys_bwd_chunk(g, c1 - 1 - ci, c0, last or c1 - c0 > 1, last, grad, v, phik, tk, phiq, den, dden,
                               carrydA, carrydB, W, beta, chunk, dk, dv_out, dbeta_part, final, total)


@njit(**_JIT)
def _causal_keys_bwd_chunk(g, c, c0, track, last, grad, v, phik, tk, phiq, den, dden, carrydA, carrydB, W, beta, chunk, dk, dv_out, dbeta_part, final, total):
    """Chunk ``c`` of group ``g`` of :func:`causal_keys_bwd`, in a segment from
    chunk ``c0``: its dB total is summed in ``total`` when ``track``, and
    carried on to chunk c - 1 (``final`` for the first chunk if ``last``)."""
    G, n, dv = grad.shape
    L = W.shape[0]
    F = phik.shape[2]
    ddv = np.zeros(SCAN_BLOCK, np.float64)
    lo = c * chunk
    hi = min(lo + chunk, n)
    dA = carrydA[g, c].copy()
    dB = carrydB[g, c].astype(grad.dtype)  # the carried-in state, in the compute dtype
    DPHI = np.empty((hi - lo, F), np.float64)
    nb = (hi - lo + SCAN_BLOCK - 1) // SCAN_BLOCK
    M, M2, wb, Y, Z, X, dS = _step_buffers(grad, F, min(SCAN_BLOCK, hi - lo))
    for bi in range(nb - 1, -1, -1):
        i0 = lo + bi * SCAN_BLOCK
        i1 = min(i0 + SCAN_BLOCK, hi)
        m = i1 - i0
        if m != M.shape[0]:  # the chunk's last, shorter step
            M, M2, wb, Y, Z, X, dS = _step_buffers(grad, F, m)
        Pq, Pk, V, Gb, dV = phiq[g, i0:i1], phik[g, i0:i1], v[g, i0:i1], grad[g, i0:i1], dv_out[g, i0:i1]
        for i in range(m):
            dn = den[g, i0 + i]
            inv = 1.0 / (L * dn) if dn > DEN_FLOOR else 0.0
            ddv[i] = dden[g, i0 + i] / L if dn > DEN_FLOOR else 0.0
            for f in range(F):
                wb[i, f] = Pq[i, f] * inv  # the weights wq_i of g_i in dB
        if dv > 0:
            # dphik_j = dB v_j + sum_{i>=j} wq_i (g_i . v_j) + dA_j, dB from after the step
            dot_rows(dB, V, Y)
            dot_rows(Gb, V, M)  # M_ji = v_j . g_i, kept for i >= j
            _zero_below(M)
            np.dot(M, wb, Z)
            # dv_j = dB^T phik_j + sum_{i>=j} (wq_i . phik_j) g_i
            np.dot(Pk, dB, dV)
            step_scores(Pk, wb, M2, False)  # M2_ji = phik_j . wq_i, kept for i >= j
            np.dot(M2, Gb, X)
            for j in range(m):
                for cc in range(dv):
                    dV[j, cc] += X[j, cc]
        for j in range(m - 1, -1, -1):
            for f in range(F):
                dA[f] += Pq[j, f] * ddv[j]
                DPHI[i0 + j - lo, f] = Y[j, f] + Z[j, f] + dA[f]
        add_product(wb, Gb, dB, dS, total, track)
    dbeta_part[g, c] = hash_bwd_rows(DPHI, phik[g, lo:hi], tk[g, lo:hi], W, beta, dk[g, lo:hi])
    if c - 1 >= c0 or last:
        _carry_on(carrydB, g, c, c - 1, total, final)


@blas_tasks
def causal_keys_bwd(grad, v, phik, tk, phiq, den, dden, carrydA, carrydB, W, beta, chunk,
                    dk, dv_out, dbeta_part, final=None, segments=None):
    """Backward pass 2: suffix sums over queries i >= j by a reverse rescan.

    Per step with dB from after it (queries past the step):
    dPhik = V dB^T + triu(V G^T) Wq + dA (suffix sums),
    dV = Phik dB + triu(Phik Wq^T) G, then dB += Wq^T G.

    Each of the ``segments`` per group (default: one per chunk) scans its
    chunks last to first from the dB carry of its last chunk and writes the
    others, and ``final (G, F, dv)``, if given, gets the total dB, as
    :func:`causal_fwd` does for B.
    """
    G, nc = carrydA.shape[:2]
    segments = nc if segments is None else segments
    run_tasks(_causal_keys_bwd_task, G * segments, segments, grad, v, phik, tk, phiq, den, dden, carrydA, carrydB,
              W, beta, chunk, dk, dv_out, dbeta_part, np.zeros((0, 0, 0)) if final is None else final)


@njit(**_JIT)
def _causal_bwd_chunks(g, cs, grad, v, phik, tk, phiq, tq, den, carryA, carryB, W, beta, chunk, dq, dk, dv_out, dden,
                       partdA, partdB, dbq, dbk, acc, total, last, final):
    """Chunks ``nc - 1`` down to ``cs`` of group ``g`` in one pass: each one's
    queries' backward and then its keys' backward, the reverse carries summed
    on the way as :func:`exclusive_scan` sums them (dA in ``acc``).  Chunk
    cs's dB is left in ``total``, not carried on, unless ``last`` (cs = 0,
    ``final`` gets the total dB)."""
    nc = carryA.shape[1]
    acc[:] = 0.0
    partdB[g, nc - 1] = 0.0  # no dB after the last chunk
    for c in range(nc - 1, cs - 1, -1):
        _causal_queries_bwd_chunk(g, c, nc, nc, grad, v, phik, phiq, tq, den, carryA, carryB, W, beta, chunk,
                                  dq, dden, partdA, partdB, dbq)
        _exclusive_step(partdA[g, c], partdA[g, c], acc)  # the chunk's dA total -> its carry
        _causal_keys_bwd_chunk(g, c, cs, last or nc > 1, last, grad, v, phik, tk, phiq, den, dden,
                               partdA, partdB, W, beta, chunk, dk, dv_out, dbk, final, total)


@njit(**_JIT)
def _causal_bwd_task(g, grad, v, phik, tk, phiq, tq, den, carryA, carryB, W, beta, chunk, dq, dk, dv_out, dden,
                     partdA, partdB, dbq, dbk, final):
    """Group ``g`` of :func:`causal_bwd`."""
    F = phik.shape[2]
    _causal_bwd_chunks(g, 0, grad, v, phik, tk, phiq, tq, den, carryA, carryB, W, beta, chunk, dq, dk, dv_out, dden,
                       partdA, partdB, dbq, dbk, np.zeros(F), np.zeros((F, grad.shape[2]), grad.dtype),
                       final.shape[0] > 0, final)


@blas_tasks
def causal_bwd(grad, v, phik, tk, phiq, tq, den, carryA, carryB, W, beta, chunk, dq, dk, dv_out, dden,
               partdA, partdB, dbq, dbk, final=None):
    """:func:`causal_queries_bwd`, :func:`exclusive_scan` of the carries and
    :func:`causal_keys_bwd` in one pass, for one segment per group
    (:func:`scan_segments`): each chunk's keys' backward follows its queries'
    backward while the chunk's rows of ``v`` and ``grad`` are still in cache
    (a chunk's 1024 of each: 1 MB, against L2 caches of 1-2 MB per core),
    instead of reading them from memory again in a second pass.  The same
    bits as the three calls; ``partdA``, ``partdB`` end as their carries.
    """
    G = grad.shape[0]
    run_tasks(_causal_bwd_task, G, grad, v, phik, tk, phiq, tq, den, carryA, carryB, W, beta, chunk, dq, dk,
              dv_out, dden, partdA, partdB, dbq, dbk, np.zeros((0, 0, 0)) if final is None else final)


#: Share of the chunks that :func:`causal_bwd_split` runs in one pass, while
#: the other task runs the queries' backward of the rest: with both threads
#: busy, one pass cost ~1080 ns per token and the queries' ~510 (2^20 tokens,
#: one head), so 510 / (1080 + 510) balances the two.
SPLIT_TAIL = 0.32


@njit(**_JIT)
def _causal_bwd_split_task(task, cs, grad, v, phik, tk, phiq, tq, den, carryA, carryB, W, beta, chunk, dq, dk,
                           dv_out, dden, partdA, partdB, dbq, dbk, tailA, tailB):
    """Task of :func:`causal_bwd_split`: even, group ``task // 2``'s chunks
    ``[cs, nc)`` in one pass, with their dA and dB sums in ``tailA``,
    ``tailB``; odd, the queries' backward of its chunks ``[0, cs)``, with the
    dB totals of the keys' second segment, ``[cs // 2, cs)``."""
    g = task // 2
    if task % 2 == 0:
        total = np.zeros((phik.shape[2], grad.shape[2]), grad.dtype)
        _causal_bwd_chunks(g, cs, grad, v, phik, tk, phiq, tq, den, carryA, carryB, W, beta, chunk, dq, dk, dv_out,
                           dden, partdA, partdB, dbq, dbk, tailA[g], total, False, tailB)
        _carry_on(partdB, g, cs, -1, total, tailB)  # tailB[g]: the dB carry of chunk cs - 1
    else:
        for c in range(cs):
            _causal_queries_bwd_chunk(g, c, segment_start(1, 2, cs), cs, grad, v, phik, phiq, tq, den,
                                      carryA, carryB, W, beta, chunk, dq, dden, partdA, partdB, dbq)


@njit(**_JIT)
def _split_carries(partdA, partdB, tailA, tailB, cs):
    """Reverse carries of chunks ``c < cs`` (in place of their totals), summed on from
    the sums of chunks ``>= cs``, ``tailA``, ``tailB``: dA of every chunk, dB of the
    last chunks of the keys' two segments (``partdB`` flat: (G, nc, F * dv))."""
    m = segment_start(1, 2, cs)
    for g in range(partdA.shape[0]):
        acc = tailA[g].copy()
        for c in range(cs - 1, -1, -1):
            _exclusive_step(partdA[g, c], partdA[g, c], acc)
        acc = tailB[g].copy()
        for c in range(cs - 1, m - 1, -1):  # the totals of the second segment's chunks
            _exclusive_step(partdB[g, c], partdB[g, c], acc)
        partdB[g, m - 1] = acc


@blas_tasks
def causal_bwd_split(grad, v, phik, tk, phiq, tq, den, carryA, carryB, W, beta, chunk, dq, dk, dv_out, dden,
                     partdA, partdB, dbq, dbk, final=None):
    """:func:`causal_bwd` on two tasks per group, for two segments per group
    (:func:`scan_segments`); the same bits.

    The last chunks, ``[cs, nc)`` with nc - cs ~ SPLIT_TAIL * nc, need no
    carry: one task runs them in one pass while the other runs the queries'
    backward of the chunks before them, with the dB totals of
    ``[cs // 2, cs)``; then :func:`causal_keys_bwd` runs ``[0, cs)`` in two
    segments from the first task's carries.  Against the three calls over
    two segments of ``nc / 2`` (totals of half the chunks, every keys' chunk
    read again in a second pass), a third of the chunks takes the one pass
    and a third pays totals.  Needs nc >= 3.
    """
    G, nc = carryA.shape[:2]
    if nc < 3:
        raise ValueError(f"causal_bwd_split needs 3 chunks or more, got {nc}")
    cs = nc - min(nc - 2, max(1, round(config.SPLIT_TAIL * nc)))
    F, dv = partdB.shape[2:]
    tailA, tailB = np.zeros((G, F)), np.zeros((G, F, dv))
    run_tasks(_causal_bwd_split_task, 2 * G, cs, grad, v, phik, tk, phiq, tq, den, carryA, carryB, W, beta,
              chunk, dq, dk, dv_out, dden, partdA, partdB, dbq, dbk, tailA, tailB)
    _split_carries(partdA, partdB.reshape(G, nc, F * dv), tailA, tailB.reshape(G, F * dv), cs)
    causal_keys_bwd(grad, v, phik, tk, phiq, den, dden, partdA[:, :cs], partdB[:, :cs], W, beta, chunk,
                    dk, dv_out, dbk, final=final, segments=2)


def chunk_length(n, G, F, dv):
    """Chunk length: CHUNK tokens unless the float64 partials would outgrow their budget."""
    from . import config
    per_chunk = G * F * (dv + 1) * 8
    max_chunks = max(1, config.PARTIAL_BUDGET // max(per_chunk, 1))
    return max(config.CHUNK, -(-n // max_chunks), 1)


def sketch_task_length(chunk, n, G):
    """Task length of the non-causal forward: up to SKETCH_CHUNKS chunks, while
    every thread keeps at least 8 tasks."""
    from . import config
    tasks = G * n // (8 * numba.get_num_threads())
    return max(chunk, min(config.SKETCH_CHUNKS * chunk, tasks // chunk * chunk))

"""RACE attention kernels against the dense O(N^2) reference, finite differences and properties."""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import racecpu
from racecpu import config
from racecpu._kernels.bundles import Hash
from racecpu import reference as ref

from .util import fd_check, nan_pool, rel_err


def make(rng, lead=(2,), nq=9, nk=None, d=6, dv=5, P=3, L=3, dtype=np.float64, seed=0):
    nk = nq if nk is None else nk
    q = rng.standard_normal(lead + (nq, d)).astype(dtype)
    k = rng.standard_normal(lead + (nk, d)).astype(dtype)
    v = rng.standard_normal(lead + (nk, dv)).astype(dtype)
    W = racecpu.hyperplanes(d, P, L, seed=seed, dtype=dtype)
    return q, k, v, W


def f64(*xs):
    return [np.asarray(x, dtype=np.float64) for x in xs]


# ---------------------------------------------------------------------------
# forward and backward against the dense reference
# ---------------------------------------------------------------------------

SHAPES = [  # lead, nq, nk, d, dv, P, L
    ((), 1, 1, 3, 2, 1, 1),
    ((2,), 9, 9, 6, 5, 3, 3),
    ((2, 3), 7, 7, 4, 8, 2, 5),
    ((1,), 13, 13, 5, 5, 6, 2),
    ((3,), 5, 5, 8, 3, 4, 8),
]
CROSS = [((2,), 4, 11, 6, 7, 3, 3), ((1, 2), 12, 3, 4, 2, 5, 1)]


CASES = [(s, c) for s in SHAPES + CROSS for c in (False, True) if not (c and s[1] != s[2])]  # causal: Nq == Nk


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 1e-5)])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("shape,causal", CASES)
def test_forward_and_backward_match_dense_reference(rng, shape, causal, masked, dtype, tol):
    lead, nq, nk, d, dv, P, L = shape
    q, k, v, W = make(rng, lead, nq, nk, d, dv, P, L, dtype)
    mask = rng.random(lead + (nk,)) > 0.3 if masked else None
    beta = 1.7
    out, res = racecpu.race_attention_fwd(q, k, v, W, beta, causal=causal, key_mask=mask)
    assert out.dtype == dtype and out.shape == lead + (nq, dv)
    want, wres = ref.race_attention_dense_fwd(*f64(q, k, v, W), beta, causal=causal, key_mask=mask)
    assert rel_err(out, want) < tol
    g = rng.standard_normal(out.shape).astype(dtype)
    got = racecpu.race_attention_bwd(res, g)
    expect = ref.race_attention_dense_bwd(wres, f64(g)[0])
    for name, a, b in zip(("dq", "dk", "dv", "dbeta"), got, expect):
        if name != "dbeta":
            assert a.dtype == dtype and a.shape == np.shape(b)
        # gradients that are exactly 0 (N = 1: the output is v whatever q is) leave only noise
        assert rel_err(a, b, floor=1e-3) < 10 * tol, name


@given(lead=st.lists(st.integers(1, 3), min_size=0, max_size=2), nq=st.integers(1, 20), nk=st.integers(1, 20),
       d=st.integers(1, 9), dv=st.integers(1, 9), P=st.integers(1, 6), L=st.integers(1, 8),
       beta=st.floats(0.05, 30.0), causal=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_forward_matches_dense_reference_hypothesis(lead, nq, nk, d, dv, P, L, beta, causal, seed):
    rng = np.random.default_rng(seed)
    if causal:
        nk = nq
    q, k, v, W = make(rng, tuple(lead), nq, nk, d, dv, P, L, np.float64, seed)
    out = racecpu.race_attention(q, k, v, W, beta, causal=causal)
    want = ref.race_attention_dense(q, k, v, W, beta, causal=causal)
    assert rel_err(out, want) < 1e-10


def test_chunked_work_matches_reference(rng, monkeypatch):
    # Several chunks per head exercise the float64 carries and the chunk scans.
    from racecpu import attention
    monkeypatch.setattr(config, "CHUNK", 7)
    for causal in (False, True):
        q, k, v, W = make(rng, (2,), 40, 40, 5, 4, 3, 2)
        mask = rng.random((2, 40)) > 0.2
        out, res = racecpu.race_attention_fwd(q, k, v, W, 2.0, causal=causal, key_mask=mask)
        assert res.chunk == 7
        want, wres = ref.race_attention_dense_fwd(q, k, v, W, 2.0, causal=causal, key_mask=mask)
        assert rel_err(out, want) < 1e-10
        g = rng.standard_normal(out.shape)
        for a, b in zip(racecpu.race_attention_bwd(res, g), ref.race_attention_dense_bwd(wres, g)):
            assert rel_err(a, b) < 1e-10


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 1e-5)])
@pytest.mark.parametrize("causal", [False, True])
def test_blas_and_loop_paths_match_reference(rng, monkeypatch, causal, dtype, tol):
    # Non-causal, chunks of 24 tokens reach the sgemm path of the sums (>=
    # BLAS_ROWS rows), the last chunk of 5 the loop path: both in one call,
    # with masked keys.  Causal, the steps of SCAN_BLOCK tokens stay below
    # BLAS_ROWS (loops) and the chunks end on a shorter step.
    from racecpu import _kernels
    monkeypatch.setattr(config, "CHUNK", 24)
    assert 5 < _kernels.BLAS_ROWS <= 24 and _kernels.SCAN_BLOCK < _kernels.BLAS_ROWS
    nk = 53 if causal else 29
    q, k, v, W = make(rng, (2,), 53, nk, 6, 7, 3, 3, dtype)
    mask = rng.random((2, nk)) > 0.25
    out, res = racecpu.race_attention_fwd(q, k, v, W, 2.5, causal=causal, key_mask=mask)
    want, wres = ref.race_attention_dense_fwd(*f64(q, k, v, W), 2.5, causal=causal, key_mask=mask)
    assert rel_err(out, want) < tol
    g = rng.standard_normal(out.shape).astype(dtype)
    for name, a, b in zip(("dq", "dk", "dv", "dbeta"), racecpu.race_attention_bwd(res, g),
                          ref.race_attention_dense_bwd(wres, f64(g)[0])):
        assert rel_err(a, b, floor=1e-3) < 10 * tol, name


@pytest.mark.parametrize("chunk,group", [(7, 1), (28, 1), (28, 3)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_causal_scans_agree_bit_for_bit_over_segment_counts(rng, monkeypatch, chunk, group, dtype):
    # One task per group scanning all its chunks (no chunk totals of B and
    # dB; the backward in one pass, causal_bwd), a few segments each from
    # carries summed from the totals of the chunks before (after) it, or one
    # task per chunk (three backward calls), or two segments whose
    # backward runs its last chunks in one pass (causal_bwd_split, with the
    # fewest, a third and all but two of the chunks in that pass): the same
    # carries, so the same results to the last bit, and all match the
    # reference, with no value read that the kernels did not write.  Chunks
    # of 28 take whole steps and end on a shorter one (28 = 3 * 8 + 4); 7 is
    # one short step.  group 3: grouped-query attention, three query heads
    # per key/value head scanned together (the reference: k, v repeated).
    from racecpu import _kernels, plan
    assert chunk % _kernels.SCAN_BLOCK  # (a last, shorter step)
    monkeypatch.setattr(config, "CHUNK", chunk)
    nan_pool(monkeypatch)  # uninitialised memory is NaN: a value read before written shows
    q, k, v, W = make(rng, (3,), 124, 124, 6, 5, 3, 2, dtype)
    q = np.concatenate([q] + [make(rng, (3,), 124, 124, 6, 5, 3, 2, dtype)[0] for _ in range(group - 1)])
    mask = rng.random((3, 124)) > 0.2
    g = rng.standard_normal((3 * group, 124, 5)).astype(dtype)
    rep = (lambda x: np.repeat(x, group, axis=0))
    want, wres = ref.race_attention_dense_fwd(*f64(q, rep(k), rep(v), W), 2.0, causal=True, key_mask=rep(mask))
    wgrads = list(ref.race_attention_dense_bwd(wres, f64(g)[0]))
    wgrads[1:3] = [x.reshape((3, group) + x.shape[1:]).sum(1) for x in wgrads[1:3]]  # dk, dv summed per group
    nc = -(-124 // chunk)
    split = _kernels.causal_bwd_split  # the engine calls the route the plan picks
    tails = []  # SPLIT_TAIL of each causal_bwd_split call

    def spy(*args, **kw):
        tails.append(config.SPLIT_TAIL)
        return split(*args, **kw)
    monkeypatch.setattr(_kernels, "causal_bwd_split", spy)
    runs = []
    setups = [(1, None), (2, 0.01), (2, 0.32), (2, 0.99), (3, None), (nc, None)]
    for seg, tail in setups:
        if tail is not None:
            monkeypatch.setattr(config, "SPLIT_TAIL", tail)
        # the forward's segments and the backward's route, both the plan's
        monkeypatch.setattr(plan, "scan_segments", lambda G, nc, n, seg=seg: seg)
        out, res = racecpu.race_attention_fwd(q, k, v, W, 2.0, causal=True, key_mask=mask)
        grads = racecpu.race_attention_bwd(res, g)
        tol = 1e-5 if dtype == np.float32 else 1e-10
        assert rel_err(out, want) < tol
        for name, a, b in zip(("dq", "dk", "dv", "dbeta"), grads, wgrads):
            assert rel_err(a, b, floor=1e-3) < 10 * tol, (seg, name)
        runs.append((out, res.A, res.B, *grads))
        # the forward alone (no residuals kept) gives the same bits and reads nothing unwritten
        np.testing.assert_array_equal(racecpu.race_attention(q, k, v, W, 2.0, causal=True, key_mask=mask), out)
    assert len(runs) == len(setups) and tails == [0.01, 0.32, 0.99]
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forward_alone_keeps_no_residuals(rng, monkeypatch, causal, dtype):
    # race_attention is race_attention_fwd's output, bit for bit, without the per-token
    # residuals (soft buckets, projections, denominators) in memory; the causal scan
    # alone keeps the keys' buckets, which it reads after the keys' pass.
    from racecpu._memory import POOL
    monkeypatch.setattr(config, "CHUNK", 16)
    G, n, F, LP = 6, 100, 2 ** 3 * 2, 3 * 2
    q, k, v, W = make(rng, (2, 3), n, n, 5, 4, 3, 2, dtype)
    mask = rng.random((2, 3, n)) > 0.2
    want = racecpu.race_attention_fwd(q, k, v, W, 2.0, causal=causal, key_mask=mask)[0]
    shapes = []
    for kind in ("empty", "zeros"):
        def record(shape, dtype=np.float64, f=getattr(POOL, kind)):
            shapes.append(tuple(shape))
            return f(shape, dtype)
        monkeypatch.setattr(POOL, kind, record)
    out = racecpu.race_attention(q, k, v, W, 2.0, causal=causal, key_mask=mask)
    np.testing.assert_array_equal(out, want)
    per_token = [s for s in shapes if len(s) >= 2 and s[:2] == (G, n) and s[2:] != (4,)]  # all but out
    assert per_token == ([(G, n, F)] if causal else [])


@pytest.mark.parametrize("G, threads, want", [(1, 2, 2), (2, 2, 1), (3, 2, 2), (4, 2, 1), (1, 4, 4), (2, 4, 2),
                                              (6, 4, 2), (3, 1, 1)])
def test_scan_segments_share_threads_evenly(monkeypatch, G, threads, want):
    # G * segments tasks are a multiple of the threads, with the fewest
    # segments (chunk totals) that make them so; never more than the chunks.
    import numba
    from racecpu import plan
    monkeypatch.setattr(numba, "get_num_threads", lambda: threads)
    monkeypatch.setattr(config, "SERIAL_TOKENS", 512)  # conftest sets 0
    assert plan.scan_segments(G, 64, 2 ** 16) == want
    assert (G * want) % threads == 0
    assert plan.scan_segments(G, 1, 2 ** 16) == 1
    assert plan.scan_segments(G, 64, 8) == 1  # below SERIAL_TOKENS: one thread


@pytest.mark.parametrize("G, nc, t0, t1", [(1, 10, 0, 5), (1, 9, 4, 9), (3, 7, 0, 4), (2, 8, 0, 0), (2, 8, 0, 8),
                                           (1, 1024, 0, 512)])
def test_spread_order_spreads_costly_chunks_over_every_threads_share(G, nc, t0, t1):
    # prange hands each thread a contiguous share of the tasks: each share of
    # the order gets its part of the chunks that also sum a total.
    from racecpu._kernels import spread_order
    order = spread_order(G, nc, t0, t1)
    np.testing.assert_array_equal(np.sort(order), np.arange(G * nc))
    heavy = np.isin(order % nc, np.arange(t0, t1))
    for threads in (2, 3, 4):
        for share in np.array_split(heavy, threads):
            assert abs(share.sum() - heavy.sum() * share.size / heavy.size) <= 1


@pytest.mark.parametrize("causal", [False, True])
def test_small_calls_run_on_one_thread(rng, monkeypatch, causal):
    # Below SERIAL_TOKENS tokens the kernels run on the calling thread; partial
    # sums are per chunk, not per thread, so results are bit-identical.
    import numba
    from racecpu import _kernels
    monkeypatch.setattr(config, "CHUNK", 16)  # several chunks: carries and BLAS steps
    q, k, v, W = make(rng, (2,), 50, 50, 8, 8, 3, 2, np.float32)
    g = rng.standard_normal((2, 50, 8)).astype(np.float32)
    threads, calls = numba.get_num_threads(), []
    set_threads = numba.set_num_threads
    monkeypatch.setattr(numba, "set_num_threads", lambda n: (calls.append(n), set_threads(n)))
    runs = []
    for serial in (0, 10**9):  # parallel, then one thread
        monkeypatch.setattr(config, "SERIAL_TOKENS", serial)
        out, res = racecpu.race_attention_fwd(q, k, v, W, 2.0, causal=causal)
        runs.append((out, *racecpu.race_attention_bwd(res, g)))
    assert 1 in calls and numba.get_num_threads() == threads
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    # The thread count comes back when the kernel raises.
    with pytest.raises(Exception):
        with _kernels.task_threads(1, 1):  # as the engine runs a kernel: the call fails inside
            _kernels.causal_fwd(None, None)
    assert numba.get_num_threads() == threads


def test_run_tasks_compiles_per_argument_types():
    # run_tasks reuses a compiled loop per fingerprint of the argument types: a
    # loop compiled for other types would read these arrays wrongly.
    from numba import njit
    from racecpu._kernels import run_tasks

    @njit
    def task(t, src, scale, dst):
        for j in range(src.shape[1]):
            dst[t, j] = src[t, j] * scale + t

    base = np.arange(40.0).reshape(8, 5)
    wide = np.zeros((8, 10))
    wide[:, ::2] = base
    readonly = base.copy()
    readonly.flags.writeable = False
    for src, scale, dtype in [(base, 2.0, np.float64), (base.astype(np.float32), 2.0, np.float32),
                              (base.astype(np.float32), 3, np.float64), (wide[:, ::2], 0.5, np.float64),
                              (np.asfortranarray(base), 2.0, np.float32), (readonly, 1.5, np.float64)]:
        dst = np.full(src.shape, np.nan, dtype)
        run_tasks(task, src.shape[0], src, scale, dst)
        np.testing.assert_array_equal(dst, (base * scale + np.arange(8)[:, None]).astype(dtype))
    dst = np.zeros((8, 5))
    run_tasks(task, 0, base, 1.0, dst)  # no tasks: nothing written
    assert not dst.any()


def test_run_tasks_runs_every_task_through_one_parallel_loop():
    # One compiled prange loop for every task and argument types (runtime._run_tasks, called
    # through its symbol), scalars of every kind passed through the trampolines.
    from numba import njit
    from racecpu._kernels import run_tasks, runtime

    @njit
    def task(t, src, dst, flag, shift, scale):
        dst[t] = (src[t] * scale if flag else src[t]) + shift

    for src in (np.arange(6.0), np.arange(6, dtype=np.float32), np.arange(6)):
        for flag in (True, False):
            dst = np.zeros(6, src.dtype)
            run_tasks(task, 6, src, dst, flag, 7, 2.0)
            np.testing.assert_array_equal(dst, (src * 2.0 if flag else src) + 7)
    assert len(runtime._run_tasks.impl.overloads) == 1


def test_tasks_borrow_their_arrays_without_counting_references():
    # run_tasks hands each task its arrays with a null meminfo (runtime._meminfo_slots): Numba then
    # counts no references on them (atomics that both threads would fight over), views of them
    # borrow too, and what a task allocates keeps its own count.  The caller's arrays are untouched.
    import sys
    from collections import namedtuple

    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic
    from racecpu._kernels import run_tasks

    @intrinsic
    def meminfo_of(typingctx, arr):
        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            return builder.ptrtoint(ary.meminfo, ir.IntType(64))
        return types.int64(arr), codegen

    Pair = namedtuple("Pair", "src dst")

    @njit
    def task(t, pair, seen):
        row = pair.src[t]  # a view: borrowed as well
        own = np.ones(3)  # allocated by the task: counted
        seen[t, 0] = meminfo_of(pair.src)
        seen[t, 1] = meminfo_of(row)
        seen[t, 2] = meminfo_of(own) != 0
        seen[t, 3] = meminfo_of(seen)
        pair.dst[t] = row.sum() + own.sum()

    src = np.arange(12.0).reshape(4, 3)
    dst = np.zeros(4)
    seen = np.full((4, 4), -1, np.int64)
    counts = [sys.getrefcount(a) for a in (src, dst, seen)]
    run_tasks(task, 4, Pair(src, dst), seen)
    np.testing.assert_array_equal(seen, [[0, 0, 1, 0]] * 4)
    np.testing.assert_array_equal(dst, src.sum(axis=1) + 3)
    np.testing.assert_array_equal(src, np.arange(12.0).reshape(4, 3))
    assert [sys.getrefcount(a) for a in (src, dst, seen)] == counts


def test_run_tasks_tells_apart_long_argument_lists():
    # Many arguments in a bundle, the strided one first: Numba 0.59's compute_fingerprint
    # garbled the first bytes of a key this long, and a strided call after a contiguous
    # one then ran the contiguous code (it read the wrong rows; found in CI at the floors).
    from collections import namedtuple

    from numba import njit
    from racecpu._kernels import run_tasks

    Bundle = namedtuple("Bundle", "src pad0 pad1 pad2 pad3 pad4 pad5")

    @njit
    def task(t, bundle, dst):
        for j in range(bundle.src.shape[1]):
            dst[t, j] = bundle.src[t, j]

    base = np.arange(40.0).reshape(8, 5)
    wide = np.zeros((8, 10))
    wide[:, ::2] = base
    pads = [np.zeros((2, 3))] * 6
    for src in (base, wide[:, ::2], base.copy(), wide[:, ::2], np.asfortranarray(base)):
        dst = np.full((8, 5), np.nan)
        run_tasks(task, 8, Bundle(src, *pads), dst)
        np.testing.assert_array_equal(dst, base)


@pytest.mark.parametrize("reverse", [False, True])
def test_exclusive_scan_sums_in_chunk_order(rng, reverse):
    # The carries of the causal scan: np.cumsum's sums, in the same order (bit for bit).
    from racecpu import _kernels as K
    part = rng.standard_normal((3, 37, 5, 30))
    x = part[:, ::-1] if reverse else part
    want = np.zeros_like(x)
    want[:, 1:] = np.cumsum(x[:, :-1], axis=1)
    want = want[:, ::-1] if reverse else want
    before = part.copy()
    np.testing.assert_array_equal(K.exclusive_scan(part, reverse), want)
    np.testing.assert_array_equal(part, before)
    assert K.exclusive_scan(part, reverse, part) is part  # in place
    np.testing.assert_array_equal(part, want)
    assert K.exclusive_scan(np.zeros((2, 0, 4)), reverse).shape == (2, 0, 4)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("segments", [1, 2, 5, 37])
def test_exclusive_scan_of_segments_writes_their_first_carries_only(rng, reverse, segments):
    # Segments' carried-in states: the full scan's values at each segment's first
    # chunk in scan order, bit for bit; the last segment's totals (never summed
    # by the kernels: NaN here) are not read, and no other chunk is written.
    from racecpu import _kernels as K
    part = rng.standard_normal((3, 37, 5, 30))
    want = K.exclusive_scan(part, reverse)
    firsts = [K.segment_start(s + reverse, segments, 37) - reverse for s in range(segments)]
    last = range(K.segment_start(0 if reverse else segments - 1, segments, 37),
                 K.segment_start(1 if reverse else segments, segments, 37))
    part[:, list(last)] = np.nan
    out = part.copy()
    assert K.exclusive_scan(part, reverse, out, segments=segments) is out
    np.testing.assert_array_equal(out[:, firsts], want[:, firsts])
    rest = np.setdiff1d(np.arange(37), firsts)
    np.testing.assert_array_equal(out[:, rest], part[:, rest])


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_finite_differences(rng, causal):
    q, k, v, W = make(rng, (2,), 5, 5, 4, 3, 2, 2)
    mask = np.array([[True, True, False, True, True], [False, True, True, True, True]])

    def f(q, k, v, beta):
        return racecpu.race_attention(q, k, v, W, beta, causal=causal, key_mask=mask)

    out, res = racecpu.race_attention_fwd(q, k, v, W, 1.3, causal=causal, key_mask=mask)
    g = rng.standard_normal(out.shape)
    fd_check(f, (q, k, v, 1.3), g, racecpu.race_attention_bwd(res, g))


def test_dbeta_sums_over_heads(rng):
    q, k, v, W = make(rng, (3,), 6, 6, 4, 3)
    out, res = racecpu.race_attention_fwd(q, k, v, W, 2.0)
    g = rng.standard_normal(out.shape)
    total = racecpu.race_attention_bwd(res, g)[3]
    per_head = sum(racecpu.race_attention_bwd(racecpu.race_attention_fwd(q[h], k[h], v[h], W, 2.0)[1], g[h])[3]
                   for h in range(3))
    assert total == pytest.approx(per_head, rel=1e-12)


# ---------------------------------------------------------------------------
# soft buckets
# ---------------------------------------------------------------------------

def test_soft_buckets_match_softmax_over_corners(rng):
    x = rng.standard_normal((2, 7, 5))
    W = racecpu.hyperplanes(5, 4, 3, seed=2, dtype=np.float64)
    phi = racecpu.soft_buckets(x, W, 1.9)
    assert phi.shape == (2, 7, 3, 16)
    np.testing.assert_allclose(phi, ref.soft_buckets_dense(x, W, 1.9)[0], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(phi.sum(-1), 1.0, rtol=1e-12)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-6)])
@pytest.mark.parametrize("L,P", [(3, 3), (2, 2), (3, 1), (1, 5)])
def test_hash_range_blocks_match_softmax_over_corners(rng, dtype, tol, L, P):
    # The kernels hash HASH_BLOCK rows at a time, prefetching the next block's
    # rows where they are contiguous: ranges that start and end inside blocks,
    # a short last block, strided rows (no prefetch) and masked rows.  t and phi
    # are moved from the hash's scratch in square blocks (transpose_tile) and the
    # values past the last whole one singly: L * P and L * 2**P below, at and
    # above a block's side, and strided rows of t and phi (no blocks).
    from racecpu import _kernels as K
    n, d = 3 * K.HASH_BLOCK + 5, 16
    big = rng.standard_normal((n, 2 * d)).astype(dtype)
    W = racecpu.hyperplanes(d, P, L, seed=4, dtype=dtype)
    keep = rng.random(n) < 0.8
    phi_ref, t_ref = ref.soft_buckets_dense(big[:, ::2].astype(np.float64), W.astype(np.float64), 2.5)
    phi_ref = np.where(keep[:, None], phi_ref.reshape(n, -1), 0.0)
    for x in (big[:, ::2], np.ascontiguousarray(big[:, ::2])):
        t = np.full((n, L * P), np.nan, dtype)
        phi = np.full((n, L << P), np.nan, dtype)
        for lo, hi in ((0, 7), (7, 40), (40, n)):
            assert K.hash_range(x, lo, hi, Hash(W, 2.5), keep, t, phi) == 0
        np.testing.assert_allclose(t, t_ref.reshape(n, -1), rtol=tol, atol=tol)
        np.testing.assert_allclose(phi, phi_ref, rtol=tol, atol=tol)
        # t with no rows (a forward that keeps none): phi's bits are the same, and
        # nothing is written through the empty view (boundscheck is off)
        phi2, spare = np.full_like(phi, np.nan), np.full_like(t, np.nan)
        for lo, hi in ((0, 7), (7, 40), (40, n)):
            assert K.hash_range(x, lo, hi, Hash(W, 2.5), keep, spare[:0], phi2) == 0
        np.testing.assert_array_equal(phi2, phi)
        assert np.isnan(spare).all()
        # t and phi whose rows are strided get the same bits, one value at a time
        wide_t, wide_phi = np.full((n, 2 * L * P), np.nan, dtype), np.full((n, 2 * (L << P)), np.nan, dtype)
        for lo, hi in ((0, 7), (7, 40), (40, n)):
            assert K.hash_range(x, lo, hi, Hash(W, 2.5), keep, wide_t[:, ::2], wide_phi[:, ::2]) == 0
        np.testing.assert_array_equal(wide_t[:, ::2], t)
        np.testing.assert_array_equal(wide_phi[:, ::2], phi)
        assert np.isnan(wide_t[:, 1::2]).all() and np.isnan(wide_phi[:, 1::2]).all()
        # It counts the NaNs it leaves in t: one per projection of a row with a NaN or an Inf.
        bad = x.copy()
        bad[3, 1], bad[50, 0] = np.nan, -np.inf
        assert sum(K.hash_range(bad, lo, hi, Hash(W, 2.5), keep, t, phi) for lo, hi in ((0, 7), (7, 40), (40, n))) == 2 * L * P
        assert np.isnan(t).sum() == 2 * L * P and np.isnan(t[[3, 50]]).all()
        assert sum(K.hash_range(bad, lo, hi, Hash(W, 2.5), keep, t[:0], phi[:0]) for lo, hi in ((0, 7), (7, 40), (40, n))) \
            == 2 * L * P  # counted with no rows of t written


@pytest.mark.parametrize("src,dst", [(np.float32, np.float32), (np.float64, np.float64), (np.float32, np.float64),
                                     (np.float64, np.float32)])
def test_transpose_tile_moves_one_square_block(src, dst):
    import numba

    from racecpu._kernels.tiles import transpose_side, transpose_tile

    @numba.njit
    def move(X, Y, i0, j0):
        transpose_tile(X, Y, i0, j0)

    k = transpose_side(np.dtype(src))
    X = np.arange(19 * 23, dtype=src).reshape(19, 23)
    for i0, j0 in ((0, 0), (3, 5), (19 - k, 23 - k)):
        Y = np.full((25, 21), -1.0, dst)
        move(X, Y, i0, j0)
        want = np.full_like(Y, -1.0)
        want[j0:j0 + k, i0:i0 + k] = X[i0:i0 + k, j0:j0 + k].T
        np.testing.assert_array_equal(Y, want)  # that block, nothing else


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-6)])
@pytest.mark.parametrize("L,P", [(3, 3), (2, 2), (3, 1), (1, 4)])
def test_hash_rows_du_matches_the_softmax_backward(rng, dtype, tol, L, P):
    # du = beta (C^T dz) (1 - t^2), dz = phi (dphi - phi . dphi) per table, against NumPy:
    # whole DU_BLOCKs and a short last one, corners (R) below, at and above the
    # register transposes' side, and strided rows (no transposes); dbeta = sum s t.
    from racecpu.config import DU_BLOCK
    from racecpu._kernels.hash import hash_rows_du

    n, R, beta = 2 * DU_BLOCK + 5, 1 << P, 1.7
    phi = rng.dirichlet(np.ones(R), size=(n, L)).reshape(n, L * R).astype(dtype)
    t = np.tanh(rng.standard_normal((n, L * P))).astype(dtype)
    dphi = rng.standard_normal((n, L * R))
    C = racecpu.corners(P).astype(np.float64)  # (R, P), +-1
    ph = phi.astype(np.float64).reshape(n, L, R)
    dz = ph * (dphi.reshape(n, L, R) - (ph * dphi.reshape(n, L, R)).sum(-1, keepdims=True))
    s_ = (dz @ C).reshape(n, L * P)
    want_du = beta * s_ * (1 - t.astype(np.float64) ** 2)
    want_dbeta = (s_ * t).sum()
    du = np.full((n, L * P), np.nan, dtype)
    got = hash_rows_du(dphi.copy(), phi, t, P, beta, du)
    np.testing.assert_allclose(du, want_du, rtol=tol, atol=tol)
    np.testing.assert_allclose(got, want_dbeta, rtol=1e-10, atol=1e-10)
    wide = [np.zeros((a.shape[0], 2 * a.shape[1]), a.dtype) for a in (phi, t, dphi)]
    for w, a in zip(wide, (phi, t, dphi)):
        w[:, ::2] = a
    du2 = np.full((n, 2 * L * P), np.nan, dtype)
    got2 = hash_rows_du(wide[2][:, ::2], wide[0][:, ::2], wide[1][:, ::2], P, beta, du2[:, ::2])
    np.testing.assert_allclose(du2[:, ::2], want_du, rtol=tol, atol=tol)
    np.testing.assert_allclose(got2, want_dbeta, rtol=1e-10, atol=1e-10)
    assert np.isnan(du2[:, 1::2]).all()


def test_hash_sketch_range_moves_its_sums_to_float64_every_run(rng):
    # Ranges longer than SKETCH_RUN (the non-causal forward's tasks): the
    # product is summed in float32 for SKETCH_RUN rows at a time, the runs in
    # float64, so a long range is as close to the float64 sum as one run.
    from racecpu import _kernels as K
    n, d, dv, L, P = 2 * K.SKETCH_RUN + 3 * K.HASH_BLOCK + 5, 16, 32, 3, 3
    x = rng.standard_normal((n, d)).astype(np.float32)
    v = (rng.standard_normal((n, dv)) + 3.0).astype(np.float32)  # a mean: the sums grow with n
    W = racecpu.hyperplanes(d, P, L, seed=4)
    keep = np.ones(n, np.bool_)
    phi_ref, _ = ref.soft_buckets_dense(x.astype(np.float64), W.astype(np.float64), 2.5)
    phi_ref = phi_ref.reshape(n, -1)
    A, total = np.zeros(L << P), np.full((L << P, dv), np.nan)
    t, phi = np.empty((0, L * P), np.float32), np.empty((0, L << P), np.float32)
    assert K.hash_sketch_range(x, v, 0, n, Hash(W, 2.5), keep, t, phi, A, total) == 0
    want = phi_ref.T @ v.astype(np.float64)
    np.testing.assert_allclose(A, phi_ref.sum(0), rtol=1e-6)
    np.testing.assert_allclose(total, want, rtol=2e-6, atol=1e-3)
    # the runs' float64 sum: each run as a range of its own, added in float64
    parts = []
    for lo in range(0, n, K.SKETCH_RUN):
        part = np.empty_like(total)
        K.hash_sketch_range(x, v, lo, min(n, lo + K.SKETCH_RUN), Hash(W, 2.5), keep, t, phi, np.zeros(L << P), part)
        parts.append(part)
    np.testing.assert_array_equal(total, sum(parts[1:], parts[0]))


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 3e-5)])
def test_hash_sketch_range_sums_each_block_as_hashed(rng, dtype, tol):
    # The non-causal keys' sketch: phi summed into A and phi^T v into the
    # total block by block, the product in combine tiles (dv: whole tiles and
    # an edge) that prefetch the next block's rows of v; ranges that start
    # and end inside blocks, strided rows (no prefetch), masked rows.
    from racecpu import _kernels as K
    n, d, dv, L, P = 3 * K.HASH_BLOCK + 5, 16, 83, 3, 3
    big = rng.standard_normal((n, 2 * d)).astype(dtype)
    bigv = rng.standard_normal((n, 2 * dv)).astype(dtype)
    W = racecpu.hyperplanes(d, P, L, seed=4, dtype=dtype)
    keep = rng.random(n) < 0.8
    phi_ref, t_ref = ref.soft_buckets_dense(big[:, ::2].astype(np.float64), W.astype(np.float64), 2.5)
    phi_ref = np.where(keep[:, None], phi_ref.reshape(n, -1), 0.0)
    for x, v in ((big[:, ::2], bigv[:, ::2]), (np.ascontiguousarray(big[:, ::2]), np.ascontiguousarray(bigv[:, ::2]))):
        t = np.full((n, L * P), np.nan, dtype)
        phi = np.full((n, L << P), np.nan, dtype)
        A = np.full(L << P, 0.5)
        A_ref = A.copy()
        A_bare = A.copy()
        for lo, hi in ((0, 7), (7, 40), (40, n)):
            total = np.full((L << P, dv), np.nan)
            assert K.hash_sketch_range(x, v, lo, hi, Hash(W, 2.5), keep, t, phi, A, total) == 0
            A_ref += phi_ref[lo:hi].sum(0)
            np.testing.assert_allclose(A, A_ref, rtol=tol, atol=tol)
            np.testing.assert_allclose(total, phi_ref[lo:hi].T @ v[lo:hi].astype(np.float64), rtol=tol, atol=tol)
            # t and phi with no rows (a forward that keeps no residuals): the same bits
            bare, spare_t, spare_phi = np.full_like(total, np.nan), np.full_like(t, np.nan), np.full_like(phi, np.nan)
            assert K.hash_sketch_range(x, v, lo, hi, Hash(W, 2.5), keep, spare_t[:0], spare_phi[:0], A_bare, bare) == 0
            np.testing.assert_array_equal(A_bare, A)
            np.testing.assert_array_equal(bare, total)
            assert np.isnan(spare_t).all() and np.isnan(spare_phi).all()  # nothing written through them
        np.testing.assert_allclose(t, t_ref.reshape(n, -1), rtol=tol, atol=tol)
        np.testing.assert_allclose(phi, phi_ref, rtol=tol, atol=tol)
        bad = x.copy()
        bad[40, 2] = np.inf
        assert K.hash_sketch_range(bad, v, 0, n, Hash(W, 2.5), keep, t, phi, A, total) == L * P


def test_corner_order_is_itertools_product(rng):
    P = 4
    assert np.array_equal(racecpu.corners(P), np.array(list(itertools.product([-1, 1], repeat=P))))
    # At large beta, all mass sits on the corner sign(W x), indexed in that order.
    x = rng.standard_normal((20, 6))
    W = racecpu.hyperplanes(6, P, 2, seed=5, dtype=np.float64)
    phi = racecpu.soft_buckets(x, W, 1e4)
    corners = [tuple(c) for c in itertools.product([-1, 1], repeat=P)]
    for i in range(20):
        for l in range(2):
            r = corners.index(tuple(np.sign(W[l] @ x[i]).astype(int)))
            assert phi[i, l, r] > 0.999


@pytest.mark.parametrize("dtype,lo,tol", [(np.float64, -708.0, 1e-13), (np.float32, -87.0, 3e-7)])
def test_exp_neg_matches_numpy_in_its_dtype(dtype, lo, tol):
    # The soft hash's exp: float32 inputs get the float32 polynomial, float64 the float64 one.
    # float64 loses ~100 ulp near -708: fastmath reassociates the Cody-Waite reduction.
    from numba import njit
    from racecpu._kernels import exp_neg

    @njit
    def run(x, out):
        for i in range(x.shape[0]):
            out[i] = exp_neg(x[i])

    x = np.concatenate([-np.geomspace(1e-8, -lo, 20001), np.linspace(lo, 0.0, 20001)]).astype(dtype)
    out = np.empty_like(x)
    run(x, out)
    want = np.exp(x.astype(np.float64))
    assert np.max(np.abs(out / want - 1)) < tol
    far = np.array([lo - 1, -1e4, -np.inf], dtype)  # float64: clamped, tiny and positive; float32: 0
    run(far, out[:3])
    if dtype == np.float64:
        assert np.all((out[:3] > 0) & (out[:3] <= np.exp(lo) * 1.01))
    else:
        np.testing.assert_array_equal(out[:3], 0.0)


@pytest.mark.parametrize("n", [1, 2, 7, 40])
@pytest.mark.parametrize("F", [1, 3, 8, 9, 24])
@pytest.mark.parametrize("d", [24, 29, 33, 56, 128])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_block_products_match_numpy(rng, n, F, d, dtype):
    # The kernels' small products: dot_rows (Y = X S^T) and combine_rows (X S, plain
    # or streamed stores), through their register tiles (racecpu._kernels.tiles) and the loops
    # at the edges: rows of X past the last tile (n = 7, 40 not a multiple of 4), rows
    # of S past it (F = 9); rows not a whole number of vectors (d = 33) and too few
    # rows for any tile (n = 1, F = 1) go to the loops; columns past the last tile in
    # one-vector tiles (d = 24: no whole tile, d = 56: one and some vectors), a half vector past
    # the last whole one (float32 at 16 lanes: d = 24, 56, and 29 with 5 columns past it for the
    # loops; a half of 8 lanes: AVX-512 only); into outputs strided both ways,
    # of another dtype, and (streamed) with rows on 64 bytes (whole-vector stores),
    # on 16 bytes only (16-byte pieces, 2-row tiles) and not on 16 bytes.
    from racecpu._kernels import combine_rows, dot_rows

    X = rng.standard_normal((n, d)).astype(dtype)
    S = rng.standard_normal((F, d)).astype(dtype)
    want = X.astype(np.float64) @ S.T.astype(np.float64)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for Y in (np.full((F, n), np.nan).T,  # float64, contiguous along rows of X (the projection's)
              np.full((n, F), np.nan, dtype),  # contiguous along rows of S
              np.full((n, 2 * F), np.nan)[:, ::2]):  # neither: the loops
        dot_rows(S, X, Y)
        np.testing.assert_allclose(Y, want, rtol=tol, atol=tol)
    W = rng.standard_normal((n, F)).astype(dtype)
    want = W.astype(np.float64) @ S.astype(np.float64)
    other = np.float64 if dtype == np.float32 else np.float32

    def placed(dt, offset, cols=d):  # rows of ``cols`` values starting ``offset`` bytes past 64
        nbytes = n * cols * np.dtype(dt).itemsize
        buf = np.empty(nbytes + 128, np.uint8)
        start = (-buf.ctypes.data) % 64 + offset
        out = buf[start:start + nbytes].view(dt).reshape(n, cols)
        out.fill(np.nan)
        return out

    for stream in (False, True):
        for out in (placed(dtype, 0), placed(other, 0), placed(dtype, 16), placed(dtype, 0, 2 * d)[:, :d],
                    np.full((n, d), np.nan, dtype),
                    np.full((n, d), np.nan, other),
                    np.full(n * d + 1, np.nan, dtype)[1:].reshape(n, d),  # rows off 16 bytes: plain stores
                    np.full((n, 2 * d), np.nan, dtype)[:, ::2]):  # strided: combine_rows's loops
            combine_rows(W, S, out, stream)
            np.testing.assert_allclose(out, want, rtol=max(tol, np.finfo(out.dtype).eps * 10),
                                       atol=max(tol, np.finfo(out.dtype).eps * 10))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tn_product_matches_numpy(rng, dtype):
    # tn_product (U^T X, the planes' gradient): transposed tiles 8, 4 and 2 vectors
    # wide (d = 128, 96, 80, 33 reach each width in both dtypes), their single-row
    # siblings for the last rows (m = 1, 3, 9, 24), the loop for the last columns
    # (d = 33, 80) and for a strided X; a strided U, out of another dtype, no rows.
    from racecpu._kernels import tn_product

    other = np.float64 if dtype == np.float32 else np.float32
    tol = 1e-4 if dtype == np.float32 else 1e-12
    for n in (0, 1, 7, 300):
        for m in (1, 3, 9, 24):
            for d in (33, 80, 96, 128):
                U = rng.standard_normal((n, m)).astype(dtype)
                X = rng.standard_normal((n, d)).astype(dtype)
                want = U.T.astype(np.float64) @ X.astype(np.float64)
                for Us, Xs, out in ((U, X, np.full((m, d), np.nan, dtype)),
                                    (U, X, np.full((m, d), np.nan, other)),
                                    (np.asfortranarray(U), X, np.full((m, d), np.nan)),
                                    (U, np.repeat(X, 2, axis=1)[:, ::2], np.full((m, d), np.nan, dtype))):
                    tn_product(Us, Xs, out)
                    t = max(tol, 10 * np.finfo(out.dtype).eps)
                    np.testing.assert_allclose(out, want, rtol=t, atol=t * max(1.0, np.sqrt(n)),
                                               err_msg=f"n={n} m={m} d={d} out {out.dtype}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_step_product_matches_numpy(rng, dtype):
    # A scan step's state update w^T x (racecpu._kernels.products.step_product): the
    # transposed tiles TN_ACC / 2 rows tall and two vectors wide, one-row tiles for the
    # last rows (F = 6, 25), loops for the columns past the last tile (dv = 33, 72) and
    # for strided rows of x; a strided w; no rows (zeros), and sgemm from BLAS_ROWS rows.
    from racecpu._kernels.products import step_product
    from racecpu.config import BLAS_ROWS

    tol = 1e-5 if dtype == np.float32 else 1e-12
    for m in (0, 1, 5, 8, BLAS_ROWS):
        for F in (1, 6, 24, 25):
            for dv in (1, 33, 64, 72):
                w = rng.standard_normal((m, 2 * F)).astype(dtype)[:, ::2]
                x = rng.standard_normal((m, dv)).astype(dtype)
                want = w.T.astype(np.float64) @ x.astype(np.float64)
                for xs in (x, np.repeat(x, 2, axis=1)[:, ::2]):
                    out = np.full((F, dv), np.nan, dtype)
                    step_product(w, xs, out)
                    np.testing.assert_allclose(out, want, rtol=tol, atol=tol, err_msg=f"m={m} F={F} dv={dv}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_add_product_adds_the_step_product_bit_for_bit(rng, dtype):
    # S += w^T x, and total += the same when tracked (racecpu._kernels.products.add_product):
    # the add tiles keep each element's sum in a register and add it to S (and total),
    # and must give the bits of step_product's rounded product added after it, which
    # the causal scans' carries rely on (the same bits however many segments). The
    # tiles ADD_ROWS rows tall, one-row tiles for the last rows (F = 6, 25), loops past
    # the last tile's columns (dv = 33, 72), strided rows of x, a strided w, no rows,
    # and BLAS from BLAS_ROWS rows; S and total left alone outside F x dv.
    from racecpu._kernels.products import add_product, step_product
    from racecpu.config import BLAS_ROWS

    for m in (0, 1, 5, 8, BLAS_ROWS):
        for F in (1, 6, 24, 25, 128):
            for dv in (1, 33, 64, 72):
                w = rng.standard_normal((m, 2 * F)).astype(dtype)[:, ::2]
                x = rng.standard_normal((m, dv)).astype(dtype)
                for xs in (x, np.repeat(x, 2, axis=1)[:, ::2]):
                    product = np.empty((F, dv), dtype)
                    step_product(w, xs, product)
                    for track in (False, True):
                        S0 = rng.standard_normal((F, dv)).astype(dtype)
                        T0 = rng.standard_normal((F, dv)).astype(dtype)
                        S, T, tmp = S0.copy(), T0.copy(), np.full((F, dv), np.nan, dtype)
                        add_product(w, xs, S, tmp, T if track else tmp, track)
                        where = f"m={m} F={F} dv={dv} track={track} x contiguous={xs is x}"
                        np.testing.assert_array_equal(S, S0 + product, err_msg=where)
                        np.testing.assert_array_equal(T, T0 + product if track else T0, err_msg=where)
                        want = S0.astype(np.float64) + w.T.astype(np.float64) @ x.astype(np.float64)
                        np.testing.assert_allclose(S, want, rtol=1e-4 if dtype == np.float32 else 1e-12,
                                                   atol=1e-4 if dtype == np.float32 else 1e-12, err_msg=where)


@pytest.mark.parametrize("m", [1, 3, 5, 8])
@pytest.mark.parametrize("F", [1, 6, 24, 40, 128])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_step_scores_match_numpy(rng, m, F, dtype):
    # The causal steps' triangular scores X Y^T: the loop below SCORE_TILE_F
    # columns (four rows of Y per sweep, then one at a time; rows past the
    # diagonal computed and overwritten with zeros), dot_rows' tiles and a mask
    # from it (F = 40, 128); every entry written.
    from racecpu._kernels import SCORE_TILE_F, step_scores

    assert 24 < SCORE_TILE_F <= 40
    X = rng.standard_normal((m, F)).astype(dtype)
    Y = rng.standard_normal((m, F)).astype(dtype)
    full = X.astype(np.float64) @ Y.T.astype(np.float64)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for lower, want in ((True, np.tril(full)), (False, np.triu(full))):
        out = np.full((m, m), np.nan, dtype)
        step_scores(X, Y, out, lower)
        np.testing.assert_allclose(out, want, rtol=tol, atol=tol)
    X[m // 2] = np.nan  # a non-finite row spreads along its own products only
    out = np.zeros((m, m), dtype)
    step_scores(X, Y, out, True)
    assert np.isnan(out[m // 2, :m // 2 + 1]).all() and not out[m // 2, m // 2 + 1:].any()
    assert np.isfinite(np.delete(out, m // 2, axis=0)).all()


def test_tasks_flush_subnormals_and_give_the_threads_mode_back():
    # run_tasks' tasks flush subnormal results (and inputs) to zero on x86-64
    # (FLUSH_SUBNORMALS); the calling thread and Numba's workers get their own
    # mode back, so code run after them on any thread still sees subnormals.
    import numba
    from numba import njit, prange
    from racecpu._kernels import FLUSH_SUBNORMALS, run_tasks

    @njit
    def product(t, x, y, out):
        out[t] = x[t] * y[t]

    @njit(parallel=True)
    def products(x, y, out):
        for t in prange(x.shape[0]):
            out[t] = x[t] * y[t]

    small = np.full(64, 1e-20, np.float32)
    tiny = np.float32(1e-20) * np.float32(1e-20)  # 1e-40: subnormal in float32
    assert 0 < tiny < np.finfo(np.float32).tiny
    out = np.full(64, np.nan, np.float32)
    run_tasks(product, 64, small, small, out)  # a subnormal result: flushed
    np.testing.assert_array_equal(out, 0.0 if FLUSH_SUBNORMALS else tiny)
    big = np.full(64, 1e30, np.float32)
    run_tasks(product, 64, np.full(64, tiny), big, out)  # a subnormal input: read as zero
    np.testing.assert_array_equal(out, 0.0 if FLUSH_SUBNORMALS else tiny * big)
    assert (tiny * big > 0).all()
    for threads in sorted({1, numba.get_num_threads()}):
        numba.set_num_threads(threads)
        try:
            run_tasks(product, 64, small, small, out)
            products(small, small, out)  # the same threads, outside run_tasks
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        np.testing.assert_array_equal(out, tiny)
        assert np.float32(1e-20) * np.float32(1e-20) == tiny  # NumPy on this thread


def test_soft_buckets_dtypes(rng):
    W = racecpu.hyperplanes(4, 2, 2)
    x = rng.standard_normal((3, 4))
    assert racecpu.soft_buckets(x.astype(np.float32), W).dtype == np.float32
    assert racecpu.soft_buckets(x.astype(np.float16), W).dtype == np.float16
    with pytest.raises(TypeError, match="x must be a float"):
        racecpu.soft_buckets(np.ones((3, 4), dtype=int), W)


# ---------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------

def test_causal_output_ignores_the_future(rng):
    q, k, v, W = make(rng, (2,), 30, 30, 6, 4)
    out = racecpu.race_attention(q, k, v, W, causal=True)
    t = 17
    q2, k2, v2 = q.copy(), k.copy(), v.copy()
    q2[:, t + 1:] = rng.standard_normal(q2[:, t + 1:].shape)
    k2[:, t + 1:] *= -3
    v2[:, t + 1:] += 100
    out2 = racecpu.race_attention(q2, k2, v2, W, causal=True)
    np.testing.assert_array_equal(out[:, :t + 1], out2[:, :t + 1])
    assert not np.allclose(out[:, t + 1:], out2[:, t + 1:])


def test_noncausal_permutation_symmetry(rng):
    q, k, v, W = make(rng, (), 12, 15, 5, 3)
    out = racecpu.race_attention(q, k, v, W)
    pq, pk = rng.permutation(12), rng.permutation(15)
    np.testing.assert_allclose(racecpu.race_attention(q[pq], k, v, W), out[pq], rtol=1e-13)
    np.testing.assert_allclose(racecpu.race_attention(q, k[pk], v[pk], W), out, rtol=1e-11)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("beta", [1e-3, 1.0, 8.0, 200.0])
def test_outputs_are_convex_combinations_of_values(rng, causal, beta):
    q, k, v, W = make(rng, (2,), 40, 40, 8, 6)
    out, res = racecpu.race_attention_fwd(q, k, v, W, beta, causal=causal)
    for h in range(2):
        for i in range(40):
            if res.den[h, i] <= racecpu.DEN_FLOOR:  # no key shares a bucket: the documented zero row
                assert beta > 100 and np.all(out[h, i] == 0)
                continue
            vis = v[h, : i + 1] if causal else v[h]
            assert np.all(out[h, i] >= vis.min(0) - 1e-12) and np.all(out[h, i] <= vis.max(0) + 1e-12)
    assert (res.den > racecpu.DEN_FLOOR).mean() > 0.5


def test_masking_the_tail_equals_dropping_it(rng):
    q, k, v, W = make(rng, (2,), 6, 14, 5, 4)
    mask = np.zeros((2, 14), bool)
    mask[:, :9] = True
    a = racecpu.race_attention(q, k, v, W, key_mask=mask)
    b = racecpu.race_attention(q, k[:, :9], v[:, :9], W)
    np.testing.assert_allclose(a, b, rtol=1e-12)


def test_converges_to_angular_attention_as_beta_and_L_grow(rng):
    # Theorem 1: error = O(P / beta) + O(sqrt(log N / L)) against angular attention with gamma = P.
    P = 2
    q = rng.standard_normal((1, 24, 8))
    k = rng.standard_normal((1, 24, 8))
    v = rng.standard_normal((1, 24, 4))
    want = ref.angular_attention(q, k, v, gamma=P)
    errs = []
    for L, beta in [(16, 8.0), (128, 40.0), (1024, 200.0)]:
        W = racecpu.hyperplanes(8, P, L, seed=7, dtype=np.float64)
        errs.append(np.sqrt(np.mean((racecpu.race_attention(q, k, v, W, beta) - want) ** 2)))
    # each 8x more tables (and sharper buckets) cuts the error by about sqrt(8)
    assert errs[2] < errs[1] / 2 < errs[0] / 4
    assert errs[2] < 0.02


# ---------------------------------------------------------------------------
# robustness: extreme beta, zero vectors, empty inputs, dtypes, layouts
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("beta", [1e-8, 1e-3, 1e3, 1e6])
@pytest.mark.parametrize("causal", [False, True])
def test_finite_for_extreme_beta_and_zero_vectors(rng, dtype, beta, causal):
    q, k, v, W = make(rng, (2,), 16, 16, 6, 4, dtype=dtype)
    q[0, :4] = 0
    k[1, 3:9] = 0
    out, res = racecpu.race_attention_fwd(q, k, v, W, beta, causal=causal)
    grads = racecpu.race_attention_bwd(res, np.ones_like(out))
    assert np.isfinite(out).all()
    for gr in grads:
        assert np.isfinite(gr).all()


def test_zero_vectors_hash_uniformly():
    W = racecpu.hyperplanes(5, 3, 2, dtype=np.float64)
    np.testing.assert_allclose(racecpu.soft_buckets(np.zeros((1, 5)), W, 4.0), 1 / 8)


def test_query_without_key_mass_outputs_zeros(rng):
    q, k, v, W = make(rng, (2,), 4, 6, 5, 3)
    mask = np.ones((2, 6), bool)
    mask[1] = False
    out, res = racecpu.race_attention_fwd(q, k, v, W, key_mask=mask)
    assert np.all(out[1] == 0) and np.all(res.den[1] == 0)
    dq, dk, dv, _ = racecpu.race_attention_bwd(res, np.ones_like(out))
    assert np.all(dq[1] == 0) and np.all(dk[1] == 0) and np.all(dv[1] == 0)


@pytest.mark.parametrize("causal", [False, True])
def test_empty_sequences(rng, causal):
    W = racecpu.hyperplanes(4)
    z = np.zeros((2, 0, 4), np.float32)
    out, res = racecpu.race_attention_fwd(z, z, np.zeros((2, 0, 3), np.float32), W, causal=causal)
    assert out.shape == (2, 0, 3) and out.dtype == np.float32
    dq, dk, dv, db = racecpu.race_attention_bwd(res, out)
    assert dq.shape == (2, 0, 4) and dk.shape == (2, 0, 4) and dv.shape == (2, 0, 3) and db == 0.0
    # queries but no keys: nothing to attend to
    out = racecpu.race_attention(np.ones((3, 4)), np.zeros((0, 4)), np.zeros((0, 2)), W)
    assert out.shape == (3, 2) and np.all(out == 0)


def test_dtype_rules(rng):
    q, k, v, W = make(rng, (1,), 5, 5, 4, 3, dtype=np.float32)
    assert racecpu.race_attention(q, k, v, W).dtype == np.float32
    h = racecpu.race_attention(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), W)
    assert h.dtype == np.float16
    np.testing.assert_allclose(h, racecpu.race_attention(*(x.astype(np.float16).astype(np.float32)
                                                           for x in (q, k, v)), W), rtol=2e-3, atol=2e-3)
    mixed, res = racecpu.race_attention_fwd(q, k, v.astype(np.float64), W)
    assert mixed.dtype == np.float64
    dq, dk, dv, _ = racecpu.race_attention_bwd(res, np.ones_like(mixed))
    assert dq.dtype == np.float32 and dv.dtype == np.float64


@pytest.mark.parametrize("bad", [np.int64, np.bool_, np.complex128])
def test_non_float_inputs_are_type_errors(rng, bad):
    q, k, v, W = make(rng, (1,), 5, 5, 4, 3)
    with pytest.raises(TypeError, match="k must be a float16, bfloat16, float32 or float64 array.*astype"):
        racecpu.race_attention(q, k.astype(bad), v, W)


def test_inputs_not_modified_and_any_layout_works(rng):
    q, k, v, W = make(rng, (2,), 10, 10, 6, 4)
    want = racecpu.race_attention(q, k, v, W, causal=True)
    qf = np.asfortranarray(q)
    kbig = np.zeros((2, 20, 12))
    kbig[:, ::2, ::2] = k
    ks = kbig[:, ::2, ::2]
    vr = v.copy()
    vr.flags.writeable = False
    copies = [qf.copy(), ks.copy(), vr.copy(), W.copy()]
    got = racecpu.race_attention(qf, ks, vr, W, causal=True)
    np.testing.assert_allclose(got, want, rtol=1e-13)
    for before, after in zip(copies, [qf, ks, vr, W]):
        np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_out_buffers_get_exactly_the_fresh_results(rng, causal, dtype):
    # NaN-filled buffers: any element the kernels skipped would show.  Head 1
    # has every key masked (den floor: zeros), and chunks are short so tails
    # and several chunks per head are written.
    q, k, v, W = make(rng, (2,), 37, 37, 6, 5, dtype=dtype)
    mask = np.ones((2, 37), bool)
    mask[1] = False
    mask[0, 3:9] = False
    g = rng.standard_normal(v.shape).astype(dtype)
    want, res = racecpu.race_attention_fwd(q, k, v, W, causal=causal, key_mask=mask)
    want_grads = racecpu.race_attention_bwd(res, g)
    out = np.full(want.shape, np.nan, dtype)
    got, res = racecpu.race_attention_fwd(q, k, v, W, causal=causal, key_mask=mask, out=out)
    assert got is out
    np.testing.assert_array_equal(out, want)
    bufs = tuple(np.full(x.shape, np.nan, dtype) for x in (q, k, v))
    grads = racecpu.race_attention_bwd(res, g, out=bufs)
    assert all(a is b for a, b in zip(grads, bufs)) and grads[3] == want_grads[3]
    for a, b in zip(grads[:3], want_grads[:3]):
        np.testing.assert_array_equal(a, b)
    # a strided buffer, and float16 (computed in float32), are filled by a copy
    strided = np.full((2, 5, 37), np.nan, dtype).transpose(0, 2, 1)
    np.testing.assert_array_equal(racecpu.race_attention(q, k, v, W, causal=causal, key_mask=mask, out=strided),
                                  want)
    h = [x.astype(np.float16) for x in (q, k, v)]
    h16 = np.full(want.shape, np.nan, np.float16)
    assert racecpu.race_attention(*h, W, causal=causal, out=h16) is h16
    np.testing.assert_array_equal(h16, racecpu.race_attention(*h, W, causal=causal))


def test_out_buffers_without_queries_or_keys_are_zeroed(rng):
    W = racecpu.hyperplanes(4)
    q = np.ones((3, 4))
    out = np.full((3, 2), np.nan)
    _, res = racecpu.race_attention_fwd(q, np.zeros((0, 4)), np.zeros((0, 2)), W, out=out)
    assert np.all(out == 0)
    bufs = (np.full((3, 4), np.nan), np.empty((0, 4)), np.empty((0, 2)))
    dq, _, _, db = racecpu.race_attention_bwd(res, np.ones((3, 2)), out=bufs)
    assert dq is bufs[0] and np.all(dq == 0) and db == 0.0


def test_bad_out_buffers(rng):
    q, k, v, W = make(rng, (2,), 6, 6, 4, 3)
    out, res = racecpu.race_attention_fwd(q, k, v, W)
    for bad, err, msg in [
        (np.empty((2, 6, 4)), ValueError, r"out must have shape \(2, 6, 3\)"),
        (np.empty((2, 6, 3), np.float32), TypeError, "out must have dtype float64"),
        ([[0.0] * 3] * 6, TypeError, "out must be a NumPy array"),
        (np.broadcast_to(np.empty(3), (2, 6, 3)), ValueError, "out is read-only"),
        (v, ValueError, "out must not share memory with v"),
    ]:
        with pytest.raises(err, match=msg):
            racecpu.race_attention(q, k, v, W, out=bad)
    g = np.ones_like(out)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    with pytest.raises(TypeError, match="tuple of three arrays"):
        racecpu.race_attention_bwd(res, g, out=dq)
    with pytest.raises(ValueError, match="out dv must not share memory with the forward's v"):
        racecpu.race_attention_bwd(res, g, out=(dq, dk, v))
    with pytest.raises(ValueError, match="out dk must not share memory with out dq"):
        racecpu.race_attention_bwd(res, g, out=(dq, dq, dv))
    with pytest.raises(ValueError, match="out dv must not share memory with grad_out"):
        racecpu.race_attention_bwd(res, g, out=(dq, dk, g))
    with pytest.raises(ValueError, match=r"out dk must have shape \(2, 6, 4\)"):
        racecpu.race_attention_bwd(res, g, out=(dq, dk[:, :5], dv))


def test_residuals_are_linear_in_N(rng):
    # No (N, L, R, dv) array and no N x N array is kept for the backward.
    N, dv, P, L = 64, 16, 3, 3
    q, k, v, W = make(rng, (1,), N, N, 8, dv, P, L)
    F = L * 2 ** P
    for causal in (False, True):
        _, res = racecpu.race_attention_fwd(q, k, v, W, causal=causal)
        arrays = [a for a in vars(res).values() if isinstance(a, np.ndarray)]
        assert max(a.size for a in arrays if a is not res.v) <= N * F


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------

def test_bad_inputs(rng):
    q, k, v, W = make(rng, (2,), 5, 5, 4, 3)
    ra = racecpu.race_attention
    with pytest.raises(ValueError, match=r"same leading dims.*\(3, 5, 4\)"):
        ra(q, k[:1].repeat(3, 0), v, W)
    with pytest.raises(ValueError, match="same head dim"):
        ra(q, k[..., :3], v, W)
    with pytest.raises(ValueError, match="same number of tokens"):
        ra(q, k, v[:, :4], W)
    with pytest.raises(ValueError, match="planes have head dim 3"):
        ra(q, k, v, W[..., :3])
    with pytest.raises(ValueError, match="at least 2 dims"):
        ra(q[0, 0], k, v, W)
    with pytest.raises(ValueError, match="causal attention needs as many queries as keys"):
        ra(q[:, :3], k, v, W, causal=True)
    for bad in (np.nan, np.inf):
        q2 = q.copy()
        q2[1, 2, 3] = bad
        with pytest.raises(ValueError, match="q contains NaN or Inf"):
            ra(q2, k, v, W)
    v2 = v.copy()
    v2[0, 0, 0] = np.nan
    assert np.isnan(ra(q, k, v2, W, check_finite=False)).any()  # the check is what catches it
    for beta in (0.0, -1.0, np.nan, np.inf):
        with pytest.raises(ValueError, match="beta must be finite and > 0"):
            ra(q, k, v, W, beta)
    with pytest.raises(TypeError, match="beta"):
        ra(q, k, v, W, "2")
    with pytest.raises(TypeError, match="key_mask must be a bool"):
        ra(q, k, v, W, key_mask=np.ones((2, 5)))
    with pytest.raises(ValueError, match=r"key_mask must have shape \(2, 5\)"):
        ra(q, k, v, W, key_mask=np.ones((2, 4), bool))
    with pytest.raises(ValueError, match="planes must have shape"):
        ra(q, k, v, W[0])
    out, res = racecpu.race_attention_fwd(q, k, v, W)
    with pytest.raises(ValueError, match=r"grad_out must have the output's shape \(2, 5, 3\)"):
        racecpu.race_attention_bwd(res, out[:, :4])
    g = np.ones_like(out)
    g[0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="grad_out contains NaN"):
        racecpu.race_attention_bwd(res, g)
    with pytest.raises(TypeError, match="residuals must come from race_attention_fwd"):
        racecpu.race_attention_bwd((1, 2), out)


@given(st.lists(st.sampled_from([0.0, -0.0, 1.5, -2.25, 3e38, -3e38, np.inf, -np.inf, np.nan]), max_size=12),
       st.integers(0, 2**31 - 1))
def test_max_abs_is_the_largest_magnitude_and_shows_nonfinite_values(values, seed):
    # What the overflow checks compare and what the derived NaN/Inf checks read
    # (math.isfinite of it is all_finite), taken without np.abs's copy.
    from racecpu._checks import all_finite, max_abs
    x = np.random.default_rng(seed).standard_normal(len(values) + 3)
    x[:len(values)] = values
    x = x[np.random.default_rng(seed).permutation(x.size)].reshape(-1, 1)
    got = max_abs(x)
    want = float(np.abs(x).max())
    assert got == want or (np.isnan(got) and np.isnan(want))
    assert math.isfinite(got) == all_finite(x)
    assert max_abs(np.empty((0, 3))) == 0.0


def _forward_with_residuals(*args, **kw):
    return racecpu.race_attention_fwd(*args, **kw)[0]


@pytest.mark.parametrize("forward", [racecpu.race_attention, _forward_with_residuals])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nonfinite_inputs_found_from_what_the_kernels_derive(rng, forward, causal, dtype):
    # q and k are checked from the NaNs the kernels count in t, v from the sketch's sums
    # and grad_out from dB, after the kernels (racecpu._checks.check_derived): the same
    # errors, in the same order, as checking first; with residuals kept or not.
    q, k, v, W = make(rng, (2, 3), 700, 700, 16, 8, 3, 3, dtype)
    mask = rng.random((2, 3, 700)) > 0.5
    orig = [x.copy() for x in (q, k, v)]
    for name, bad_arrays in (("q", "q"), ("k", "k"), ("q", "qkv"), ("k", "kv"), ("v", "v")):
        for bad in (np.nan, np.inf, -np.inf):
            args = {"q": q.copy(), "k": k.copy(), "v": v.copy()}
            for a in bad_arrays:
                args[a][tuple(rng.integers(0, n) for n in args[a].shape)] = bad
            with pytest.raises(ValueError, match=f"{name} contains NaN or Inf"):
                forward(args["q"], args["k"], args["v"], W, causal=causal, key_mask=mask)
    q2 = q.copy()
    q2[1, 2, 3, 4] = np.nan
    for bad_args in ({"k": k.astype(int)}, {"v": v[:, :1]}, {"planes": W[..., :3]}):  # q's NaN comes first
        a = {"q": q2, "k": k, "v": v, "planes": W, **bad_args}
        with pytest.raises(ValueError, match="q contains NaN or Inf"):
            forward(a["q"], a["k"], a["v"], a["planes"], causal=causal)
    v2 = v.copy()
    v2[0, 1, 2, 3] = np.inf
    with pytest.raises(ValueError, match="v contains NaN or Inf"):  # v's Inf before the bad planes
        forward(q, k, v2, W[..., :3], causal=causal)
    masked = np.nonzero(~mask[0, 0])[0][0]
    for name, x in (("k", k), ("v", v)):  # a masked key is still checked
        x2 = x.copy()
        x2[0, 0, masked, 0] = np.nan
        a = {"k": k, "v": v, name: x2}
        with pytest.raises(ValueError, match=f"{name} contains NaN or Inf"):
            forward(q, a["k"], a["v"], W, causal=causal, key_mask=mask)
    out, res = racecpu.race_attention_fwd(q, k, v, W, causal=causal, key_mask=mask)
    for bad in (np.nan, np.inf, -np.inf):
        g = np.ones_like(out)
        g[tuple(rng.integers(0, n) for n in g.shape)] = bad
        with pytest.raises(ValueError, match="grad_out contains NaN or Inf"):
            racecpu.race_attention_bwd(res, g)
        bufs = tuple(np.empty_like(x) for x in (q, k, v))
        with pytest.raises(ValueError, match="grad_out contains NaN or Inf"):  # before the bad buffer
            racecpu.race_attention_bwd(res, g, out=bufs[:2] + (bufs[2][..., :1],))
        with pytest.raises(ValueError, match="grad_out contains NaN or Inf"):
            racecpu.race_attention_bwd(res, g, out=bufs)
    g = np.ones_like(out)
    g[0, 0, 0, 0] = np.nan
    res_unchecked = racecpu.race_attention_fwd(q, k, v, W, causal=causal, check_finite=False)[1]
    assert np.isnan(racecpu.race_attention_bwd(res_unchecked, g)[0]).any()  # the check is what catches it
    for x, o in zip((q, k, v), orig):
        np.testing.assert_array_equal(x, o)


def test_projection_overflow_is_an_error(rng):
    # |q| ~ 3e38 is finite in float32, but W q overflows: the soft hash is meaningless.
    q, k, v, W = make(rng, (1,), 40, 40, 8, 4, 3, 2, np.float32)
    assert np.abs(W[0, 0]).max() > 1.0  # so every order of the sum W[0, 0] . q overflows
    q[0, 5] = np.float32(3.4e38) * np.sign(W[0, 0])
    with pytest.raises(ValueError, match="q is too large: its projections onto the planes overflow float32"):
        racecpu.race_attention(q, k, v, W)
    racecpu.race_attention(q, k, v, W, check_finite=False)  # unchecked: no error
    racecpu.race_attention(*f64(q, k, v, W))  # float64 has the range


@pytest.mark.parametrize("causal", [False, True])
def test_sums_overflow_is_an_error(rng, causal):
    # v and grad_out are checked from the float64 sums the kernels form: finite values
    # whose sums overflow float64 would give Inf/NaN outputs, so they are an error too.
    q, k, v, W = f64(*make(rng, (2,), 300, 300, 8, 4, 3, 2))
    with pytest.raises(ValueError, match=r"v is too large: its weighted sums overflow float64 \(max \|v\| = 1e\+308\); scale it down$"):
        racecpu.race_attention(q, k, np.full_like(v, 1e308), W, causal=causal)
    if not causal:  # dB = sum_i g_i phiq_i / (L den_i): many queries on few keys make it large
        q, k, v, W = f64(*make(rng, (2,), 3000, 10, 8, 4, 3, 2))
    out, res = racecpu.race_attention_fwd(q, k, v, W, causal=causal)
    with pytest.raises(ValueError, match="grad_out is too large: its weighted sums overflow float64"):
        racecpu.race_attention_bwd(res, np.full_like(out, 1e308))
    racecpu.race_attention_bwd(res, np.full_like(out, 1e300))  # large, but its sums fit


def test_hyperplanes():
    W = racecpu.hyperplanes(16, 4, 5, seed=3)
    assert W.shape == (5, 4, 16) and W.dtype == np.float32
    np.testing.assert_array_equal(W, np.random.default_rng(3).standard_normal((5, 4, 16)).astype(np.float32))
    np.testing.assert_array_equal(W, racecpu.hyperplanes(16, 4, 5, seed=3))
    assert racecpu.hyperplanes(4, dtype=np.float64).dtype == np.float64
    for kwargs in ({"num_planes": 0}, {"num_planes": 17}, {"num_tables": 0}):
        with pytest.raises(ValueError):
            racecpu.hyperplanes(8, **kwargs)
    with pytest.raises(ValueError, match="head_dim"):
        racecpu.hyperplanes(0)
    with pytest.raises(TypeError, match="num_planes must be an int"):
        racecpu.hyperplanes(8, 2.5)


def test_race_attention_layer(rng):
    att = racecpu.RaceAttention(6, num_planes=2, num_tables=4, beta=3.0, seed=9)
    assert att.planes.shape == (4, 2, 6) and "num_tables=4" in repr(att)
    q, k, v, _ = make(rng, (2,), 8, 8, 6, 5)
    out, res = att.fwd(q, k, v, causal=True)
    np.testing.assert_array_equal(out, att(q, k, v, causal=True))
    np.testing.assert_allclose(out, ref.race_attention_dense(q, k, v, att.planes.astype(np.float64), 3.0,
                                                             causal=True), rtol=1e-6)
    assert len(att.bwd(res, np.ones_like(out))) == 4
    with pytest.raises(ValueError, match="beta"):
        racecpu.RaceAttention(6, beta=0)


def test_cli_version(capsys):
    from racecpu.cli import main
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert racecpu.__version__ in capsys.readouterr().out

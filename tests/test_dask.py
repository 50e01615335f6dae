"""racecpu.sketches (the public sketch algebra) and racecpu.dask (the same forward and
backward as Dask graphs), held to the in-memory API: float64 1e-12, float32 1e-5.

The Dask tests run under the threaded scheduler and on a real
``distributed.LocalCluster`` of 2 worker processes x 1 thread (module-scoped); the test that
kills a worker process mid-compute starts a cluster of its own.
"""

import importlib
import sys

import numpy as np
import pytest

import racecpu
from racecpu import sketches as S

from .util import nan_pool

TOL = {np.float64: 1e-12, np.float32: 1e-5}


def close(got, want, dtype, what=""):
    """Max error relative to the largest value of ``want`` (gradients grow with the sequence)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(1.0, float(np.abs(want).max()) if want.size else 1.0)
    err = float(np.abs(got - want).max()) / scale if want.size else 0.0
    assert err <= TOL[dtype], f"{what}: error {err:.3g} > {TOL[dtype]}"
    return err


def data(rng, lead, nq, nk, d, dv, dtype, masked):
    q, k, v, g = (rng.standard_normal(lead + s).astype(dtype) for s in ((nq, d), (nk, d), (nk, dv), (nq, dv)))
    m = rng.random(lead + (nk,)) > 0.3 if masked else None
    return q, k, v, g, m


# ---------------------------------------------------------------------------
# the sketch algebra
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_sketch_add_sum_readout(rng, dtype):
    W = racecpu.hyperplanes(16, dtype=dtype)
    q, k, v, g, m = data(rng, (2, 3), 40, 70, 16, 8, dtype, True)
    cuts = [(0, 30), (30, 31), (31, 70)]
    parts = [racecpu.sketch(k[..., a:b, :], v[..., a:b, :], W, 4.0, key_mask=m[..., a:b]) for a, b in cuts]
    whole = racecpu.sketch(k, v, W, 4.0, key_mask=m)
    assert isinstance(whole, racecpu.Sketch) and whole.A.shape == (2, 3, 3, 8) and whole.B.shape == (2, 3, 3, 8, 8)
    assert whole.A.dtype == whole.B.dtype == np.float64 and whole.dtype == dtype
    total = sum(parts)
    added = parts[0] + parts[1] + parts[2]
    np.testing.assert_allclose(total.A, whole.A, rtol=TOL[dtype])
    np.testing.assert_allclose(added.B, whole.B, rtol=TOL[dtype], atol=TOL[dtype])
    ref = racecpu.race_attention(q, k, v, W, 4.0, key_mask=m)
    out = racecpu.readout(q, total)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    close(out, ref, dtype, "readout")
    close(racecpu.readout(q, whole), ref, dtype, "readout whole")


def test_sketch_mismatch_raises(rng):
    W = racecpu.hyperplanes(16)
    k = rng.standard_normal((5, 16)).astype(np.float32)
    s = racecpu.sketch(k, k, W)
    assert (s + racecpu.sketch(k, k, W.astype(np.float64))).A.shape == s.A.shape  # planes compared by value
    with pytest.raises(ValueError, match="other planes"):
        s + racecpu.sketch(k, k, racecpu.hyperplanes(16, seed=1))
    with pytest.raises(ValueError, match="beta"):
        s + racecpu.sketch(k, k, W, 3.0)
    with pytest.raises(ValueError, match="shapes"):
        s + racecpu.sketch(k[None], k[None], W)
    with pytest.raises(TypeError):
        s + 1.5
    with pytest.raises(ValueError, match="leading dims"):
        racecpu.readout(k[None], s)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_sketch_backward_composes(rng, dtype):
    W = racecpu.hyperplanes(16, dtype=dtype)
    q, k, v, g, m = data(rng, (2,), 50, 70, 16, 8, dtype, True)
    _, res = racecpu.race_attention_fwd(q, k, v, W, 4.0, key_mask=m)
    ref = racecpu.race_attention_bwd(res, g)
    sk = sum(racecpu.sketch(k[:, a:b], v[:, a:b], W, 4.0, key_mask=m[:, a:b]) for a, b in ((0, 30), (30, 70)))
    rq = [S.readout_bwd(q[:, a:b], sk, g[:, a:b]) for a, b in ((0, 20), (20, 50))]
    dsk = sum(r[1] for r in rq)
    rk = [S.sketch_bwd(k[:, a:b], v[:, a:b], dsk, key_mask=m[:, a:b]) for a, b in ((0, 30), (30, 70))]
    close(np.concatenate([r[0] for r in rq], 1), ref[0], dtype, "dq")
    close(np.concatenate([r[0] for r in rk], 1), ref[1], dtype, "dk")
    close(np.concatenate([r[1] for r in rk], 1), ref[2], dtype, "dv")
    close(sum(r[2] for r in rq + rk), ref[3], dtype, "dbeta")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_causal_blocks_compose(rng, dtype):
    W = racecpu.hyperplanes(16, dtype=dtype)
    q, k, v, g, m = data(rng, (2,), 70, 70, 16, 8, dtype, True)
    ref, res = racecpu.race_attention_fwd(q, k, v, W, 4.0, causal=True, key_mask=m)
    rg = racecpu.race_attention_bwd(res, g)
    cuts = [(0, 25), (25, 26), (26, 70)]
    states, outs = [None], []
    for a, b in cuts:
        o, st = S.causal_block(q[:, a:b], k[:, a:b], v[:, a:b], W, 4.0, states[-1], key_mask=m[:, a:b])
        outs.append(o)
        states.append(st)
    close(np.concatenate(outs, 1), ref, dtype, "causal out")
    np.testing.assert_allclose(states[-1].B, racecpu.sketch(k, v, W, 4.0, key_mask=m).B,
                               rtol=TOL[dtype], atol=TOL[dtype])
    # reverse scan of the states' cotangents
    dfinal, grads = None, [None] * 3
    for i in range(2, -1, -1):
        a, b = cuts[i]
        args = (q[:, a:b], k[:, a:b], v[:, a:b], W, 4.0, g[:, a:b], states[i])
        grads[i] = S.causal_block_bwd(*args, dfinal, key_mask=m[:, a:b])
        part = S.causal_block_dstate(*args, key_mask=m[:, a:b])
        # from the block's output, with no rescan: the same up to rounding
        fast = S.causal_block_dstate(*args, key_mask=m[:, a:b], out=outs[i])
        close(fast.A, part.A, dtype, "dA from out")
        close(fast.B, part.B, dtype, "dB from out")
        total = part + (0 if dfinal is None else dfinal)
        np.testing.assert_array_equal(grads[i][4].B, total.B)
        dfinal = total
    for j, name in enumerate(("dq", "dk", "dv")):
        close(np.concatenate([x[j] for x in grads], 1), rg[j], dtype, name)
    close(sum(x[3] for x in grads), rg[3], dtype, "dbeta")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("lead", [(1,), (3,)])
def test_block_backward_in_one_pass_equals_the_two_passes(rng, monkeypatch, dtype, lead):
    """A block of several chunks on one task per group (a Dask worker's thread) runs the
    backward in one pass from the cotangent of its final state; where the groups do not
    share the threads evenly it runs the queries' and keys' passes apart.  Both give the
    gradients and the cotangent of the initial state, over chunks and a key mask, with no
    value read that the kernels did not write (the result pool's new memory is NaN)."""
    import racecpu.engine as E
    from racecpu import _kernels as K
    nan_pool(monkeypatch)
    W = racecpu.hyperplanes(16, dtype=dtype)
    q, k, v, g, m = data(rng, lead, 2600, 2600, 16, 8, dtype, True)  # 3 chunks
    st0 = S.sketch(k[..., :300, :], v[..., :300, :], W, 4.0, dtype=dtype)
    s1 = S.sketch(q[..., :300, :], v[..., :300, :] * 0.5, W, 4.0, dtype=dtype)  # from the blocks after
    _, _, fwd = S.causal_block(q, k, v, W, 4.0, st0, key_mask=m, keep=True)
    routes, one_pass = [], K.causal_bwd
    monkeypatch.setattr(K, "causal_bwd", lambda *a, **kw: routes.append("one-pass") or one_pass(*a, **kw))
    got = {}
    for segments in (1, 2):
        monkeypatch.setattr(E, "scan_segments", lambda G, nc, n, s=segments: s)
        got[segments] = S.causal_block_bwd(q, k, v, W, 4.0, g, st0, s1, key_mask=m, forward=fwd)
    assert routes == ["one-pass"]
    for name, x, y in zip(("dq", "dk", "dv", "dbeta"), got[1], got[2]):
        close(x, y, dtype, name)
    close(got[1][4].A, got[2][4].A, dtype, "dinitial A")
    close(got[1][4].B, got[2][4].B, dtype, "dinitial B")
    # and the cotangent of the initial state is dfinal plus what the block's outputs send back
    part = S.causal_block_dstate(q, k, v, W, 4.0, g, st0, key_mask=m, forward=fwd)
    close(got[1][4].B, (part + s1).B, dtype, "dinitial B = dstate + dfinal")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_block_that_scans_its_state_equals_the_default(rng, dtype):
    """causal_block(scan=True), the fused Dask scan's block: its keys' pass sums only the B totals
    its segments need (none on one thread, half the chunks' on two), its scan sums the state from
    the carried-in one.  Output, state and gradients equal the default's up to rounding; a
    backward that recomputes that forward gives the bits of one that reads its rows."""
    import numba
    W = racecpu.hyperplanes(16, dtype=dtype)
    q, k, v, g, m = data(rng, (2,), 3000, 3000, 16, 8, dtype, True)
    st0 = S.sketch(k[:, :400], v[:, :400], W, 4.0, dtype=dtype)
    o1, s1, f1 = S.causal_block(q, k, v, W, 4.0, st0, key_mask=m, keep=True)
    want = S.causal_block_bwd(q, k, v, W, 4.0, g, st0, s1, key_mask=m, forward=f1)
    before = numba.get_num_threads()
    try:
        for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(threads)
            o2, s2, f2 = S.causal_block(q, k, v, W, 4.0, st0, key_mask=m, keep=True, scan=True)
            close(o2, o1, dtype, "out")
            np.testing.assert_array_equal(s2.A, s1.A)
            close(s2.B, s1.B, dtype, "final B")
            got = S.causal_block_bwd(q, k, v, W, 4.0, g, st0, s1, key_mask=m, forward=f2)
            for name, x, y in zip(("dq", "dk", "dv", "dbeta"), got, want):
                close(x, y, dtype, name)
            close(got[4].B, want[4].B, dtype, "dinitial B")
            again = S.causal_block_bwd(q, k, v, W, 4.0, g, st0, s1, key_mask=m, scan=True)
            for x, y in zip(again[:3], got[:3]):
                np.testing.assert_array_equal(x, y)
    finally:
        numba.set_num_threads(before)
    _, keys = S.causal_block_keys(k, v, W, 4.0, key_mask=m, dtype=dtype)
    with pytest.raises(ValueError, match="scan=True"):
        S.causal_block(q, k, v, W, 4.0, st0, key_mask=m, keys=keys, scan=True)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_kept_forward_gives_the_same_bits(rng, dtype, tmp_path):
    """A block whose keys were hashed by causal_block_keys, and whose backward reads the forward's
    kept rows (in memory or saved to a file), gives the bits of the block computed from scratch;
    the backward does not write into the rows it is given (a second backward: the same bits)."""
    W = racecpu.hyperplanes(16, dtype=dtype)
    q, k, v, g, m = data(rng, (2,), 300, 300, 16, 8, dtype, True)
    st0 = S.sketch(k[:, :40], v[:, :40], W, 4.0, dtype=dtype)
    total, keys = S.causal_block_keys(k, v, W, 4.0, key_mask=m, dtype=dtype)
    o1, s1 = S.causal_block(q, k, v, W, 4.0, st0, key_mask=m)
    o2, s2, fw = S.causal_block(q, k, v, W, 4.0, st0, key_mask=m, keys=keys, keep=True)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(s1.B, s2.B)
    np.testing.assert_array_equal((st0 + total).B, s2.B)  # summed per chunk as the scan sums it
    args = (q, k, v, W, 4.0, g, st0)
    dst = S.causal_block_dstate(*args, key_mask=m, out=o1)
    np.testing.assert_array_equal(S.causal_block_dstate(*args, key_mask=m, out=o1, forward=fw).B, dst.B)
    close(S.causal_block_dstate(*args, key_mask=m, forward=fw).B, dst.B, dtype, "dstate from rows")
    want = S.causal_block_bwd(*args, dst, key_mask=m)
    loaded = S.BlockForward.load(fw.save(tmp_path / "rows.npz"))
    assert loaded.nbytes >= fw.step.rows.phiq.nbytes
    for forward in (fw, fw, loaded):
        got = S.causal_block_bwd(*args, dst, key_mask=m, forward=forward)
        for x, y in zip(got[:3] + (got[4].B,), want[:3] + (want[4].B,)):
            np.testing.assert_array_equal(x, y)
        assert got[3] == want[3]
    with pytest.raises(ValueError, match="made for a block"):
        S.causal_block_bwd(q[:, :10], k[:, :10], v[:, :10], W, 4.0, g[:, :10], st0, key_mask=m[:, :10], forward=fw)
    with pytest.raises(TypeError, match="causal_block_keys"):
        S.causal_block(q, k, v, W, 4.0, st0, keys=fw)
    _, lean = S.causal_block_keys(k, v, W, 4.0, key_mask=m, dtype=dtype, keep=False)
    with pytest.raises(ValueError, match="keep=True"):
        S.causal_block(q, k, v, W, 4.0, st0, key_mask=m, keys=lean, keep=True)


def test_dstate_from_out_checks_it(rng):
    W = racecpu.hyperplanes(16)
    q, k, v, g, m = data(rng, (2,), 30, 30, 16, 8, np.float32, False)
    out, _ = S.causal_block(q, k, v, W, 4.0)
    with pytest.raises(ValueError, match="out must have the block's output shape"):
        S.causal_block_dstate(q, k, v, W, 4.0, g, out=out[:, :-1])
    with pytest.raises(TypeError, match="at least as precise"):
        S.causal_block_dstate(q, k, v, W, 4.0, g, out=out.astype(np.float16))


def test_state_round_trip(rng):
    W = racecpu.hyperplanes(16)
    x = rng.standard_normal((2, 12, 16)).astype(np.float32)
    out, st = S.causal_block(x[:, :8], x[:, :8], x[:, :8], W, 8.0)
    rs = S.state_from_sketch(st, count=8)
    o2 = rs.extend(x[:, 8:], x[:, 8:], x[:, 8:])
    _, st2 = S.causal_block(x[:, 8:], x[:, 8:], x[:, 8:], W, 8.0, S.sketch_from_state(S.state_from_sketch(st)))
    full = racecpu.race_attention(x, x, x, W, 8.0, causal=True)
    np.testing.assert_allclose(o2, full[:, 8:], atol=1e-5)
    np.testing.assert_allclose(S.sketch_from_state(rs).B, st2.B, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# racecpu.dask
# ---------------------------------------------------------------------------

da = pytest.importorskip("dask.array")
import dask  # noqa: E402

import racecpu.dask as rd  # noqa: E402

CASES = [  # (causal, masked, dtype)
    (False, False, np.float64), (False, True, np.float32), (True, False, np.float32), (True, True, np.float64),
]


def dask_inputs(rng, causal, masked, dtype):
    lead, nq, nk = (2, 2), 70, (70 if causal else 90)
    q, k, v, g, m = data(rng, lead, nq, nk, 16, 8, dtype, masked)
    Q = da.from_array(q, chunks=(1, 2, (20, 1, 49), 8))  # uneven; the last axis rechunked to one
    K = da.from_array(k, chunks=(2, 1, (33, 37) if causal else (40, 50), 16))
    V = da.from_array(v, chunks=(2, 2, 30, 8))
    G = da.from_array(g, chunks=(2, 2, 35, 8))
    M = None if m is None else da.from_array(m, chunks=(1, 1, 45))
    return (q, k, v, g, m), (Q, K, V, G, M)


def check_against_numpy(rng, causal, masked, dtype, compute):
    W = racecpu.hyperplanes(16, dtype=dtype)
    (q, k, v, g, m), (Q, K, V, G, M) = dask_inputs(rng, causal, masked, dtype)
    out, res = rd.race_attention_fwd(Q, K, V, W, 4.0, causal=causal, key_mask=M)
    grads = rd.race_attention_bwd(res, G)
    assert out.chunks[-2] == (20, 1, 49) and grads[3].shape == ()
    got = compute(out, *grads)
    ref, r = racecpu.race_attention_fwd(q, k, v, W, 4.0, causal=causal, key_mask=m)
    want = (ref,) + racecpu.race_attention_bwd(r, g)
    errs = {}
    for name, x, y in zip(("out", "dq", "dk", "dv", "dbeta"), got, want):
        assert np.shape(x) == np.shape(y) and np.asarray(x).dtype == np.asarray(y).dtype, name
        errs[name] = close(x, y, dtype, name)
    return errs


@pytest.mark.parametrize("causal,masked,dtype", CASES)
def test_dask_threaded_equals_numpy(rng, causal, masked, dtype):
    with dask.config.set(scheduler="threads"):
        check_against_numpy(rng, causal, masked, dtype, dask.compute)


def test_dask_float16_causal_reads_the_kept_rows(rng):
    """16-bit outputs are narrower than the compute dtype: each block's cotangent to its state
    then comes from the kept rows (the queries' backward pass), not from its output."""
    W = racecpu.hyperplanes(16)
    (q, k, v, g), (Q, K, V, G) = _sequence_inputs(rng, 3, np.float16, per_block=30)
    out, res = rd.race_attention_fwd(Q, K, V, W, 4.0, causal=True)
    with dask.config.set(scheduler="threads"):
        got = dask.compute(out, *rd.race_attention_bwd(res, G))
    ref, r = racecpu.race_attention_fwd(q, k, v, W, 4.0, causal=True)
    for name, x, y in zip(("out", "dq", "dk", "dv", "dbeta"), got, (ref,) + racecpu.race_attention_bwd(r, g)):
        assert np.asarray(x).dtype == np.asarray(y).dtype, name
        y = np.asarray(y, np.float64)
        assert np.abs(np.asarray(x, np.float64) - y).max() <= 2e-3 * max(1.0, np.abs(y).max()), name

def test_dask_race_attention_lazy(rng):
    W = racecpu.hyperplanes(16)
    (q, k, v, _, _), (Q, K, V, _, _) = dask_inputs(rng, True, False, np.float32)
    out = rd.race_attention(Q, K, V, W, causal=True)
    assert isinstance(out, da.Array)
    with dask.config.set(scheduler="sync"):
        close(out.compute(), racecpu.race_attention(q, k, v, W, causal=True), np.float32, "out")


def _sequence_inputs(rng, blocks, dtype, per_block=8):
    n = blocks * per_block
    q, k, v, g, _ = data(rng, (2,), n, n, 16, 8, dtype, False)
    return (q, k, v, g), tuple(da.from_array(x, chunks=(1, per_block, x.shape[-1])) for x in (q, k, v, g))


@pytest.mark.parametrize("blocks", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_tree_scan_equals_the_chain_and_numpy(rng, blocks, causal):
    # and the fused scan (each block's forward from its predecessor's final state, each
    # backward from its successor's cotangent): the same results up to rounding
    for dtype in (np.float64, np.float32):
        W = racecpu.hyperplanes(16, dtype=dtype)
        (q, k, v, g), (Q, K, V, G) = _sequence_inputs(rng, blocks, dtype)
        ref, r = racecpu.race_attention_fwd(q, k, v, W, 4.0, causal=causal)
        want = (ref,) + racecpu.race_attention_bwd(r, g)
        got = {}
        for scan in ("tree", "chain", "fused"):
            out, res = rd.race_attention_fwd(Q, K, V, W, 4.0, causal=causal, scan=scan)
            with dask.config.set(scheduler="threads"):
                got[scan] = dask.compute(out, *rd.race_attention_bwd(res, G))
            for name, x, y in zip(("out", "dq", "dk", "dv", "dbeta"), got[scan], want):
                close(x, y, dtype, f"{scan} {name} ({blocks} blocks, {np.dtype(dtype).name})")
        for other in ("chain", "fused"):
            for name, x, y in zip(("out", "dq", "dk", "dv", "dbeta"), got["tree"], got[other]):
                close(x, y, dtype, f"tree vs {other} {name}")


def _depth(graph, key, memo):
    """Longest path (in tasks) from ``key`` down to a task of no racecpu dependency."""
    from dask.core import get_dependencies
    if key not in memo:
        deps = [d for d in get_dependencies(graph, key) if isinstance(d, str) and d.startswith("race-")]
        memo[key] = 1 + max((_depth(graph, d, memo) for d in deps), default=0)
    return memo[key]


def test_tree_scan_is_logarithmically_deep(rng):
    """Critical path of the causal forward+backward at 64 blocks: the tree's carries are at most
    ~2 log2(64) additions deep, the chain's 63; both scans, forward and reverse."""
    W = racecpu.hyperplanes(16)
    _, (Q, K, V, G) = _sequence_inputs(rng, 64, np.float32)
    depth = {}
    for scan in ("tree", "chain", "fused", "auto"):
        _, res = rd.race_attention_fwd(Q, K, V, W, causal=True, scan=scan)
        dq = rd.race_attention_bwd(res, G)[0]
        graph = dict(dq.__dask_graph__())
        memo = {}
        depth[scan] = max(_depth(graph, key, memo) for key in graph
                          if isinstance(key, str) and key.startswith("race-causal-bwd-"))
    # keys, total, carries, forward, dstate, reverse carries, gradients
    assert depth["tree"] <= 2 + 2 * (2 * 6) + 3, depth
    assert depth["chain"] >= 2 * 63, depth
    assert depth["fused"] >= 2 * 64, depth  # every forward after its predecessor, every backward after its successor
    # no distributed client: one block task at a time, so the 2 sequences fill it and "auto" fuses
    assert rd.block_slots() == 1 and depth["auto"] == depth["fused"]
    with pytest.raises(ValueError, match="scan must be one of"):
        rd.race_attention_fwd(Q, K, V, W, causal=True, scan="ring")


def test_auto_scan_fuses_where_the_sequences_fill_the_slots():
    assert rd.pick_scan("auto", 64, 4, 2) == "fused"
    assert rd.pick_scan("auto", 64, 2, 2) == "fused"
    assert rd.pick_scan("auto", 64, 1, 2) == "tree"
    assert rd.pick_scan("auto", rd.CHAIN_BLOCKS, 1, 2) == "chain"
    assert rd.pick_scan("auto", 1, 1, 1) == "fused"
    for scan in ("tree", "chain", "fused"):
        assert rd.pick_scan(scan, 64, 1, 8) == scan
        assert rd.pick_scan(scan, 64, 4, 2, held=10 ** 12, memory=1) == scan  # as asked, whatever the memory
    assert rd.block_slots() == 1 and rd.block_slots(4) == 1  # no distributed client
    assert rd.slot_memory() is None


def test_auto_scan_fuses_only_where_the_held_results_fit():
    # A slot's sequences hold their results until their chains end: 3 sequences on 2 slots put 2 on one.
    share = rd.FUSED_MEMORY_SHARE
    fits = int(share * 1000) // 2
    assert rd.pick_scan("auto", 64, 3, 2, held=fits, memory=1000) == "fused"
    assert rd.pick_scan("auto", 64, 3, 2, held=fits + 1, memory=1000) == "tree"
    assert rd.pick_scan("auto", rd.CHAIN_BLOCKS, 3, 2, held=fits + 1, memory=1000) == "chain"
    assert rd.pick_scan("auto", 64, 2, 2, held=int(share * 1000), memory=1000) == "fused"  # one a slot
    assert rd.pick_scan("auto", 64, 2, 2, held=10 ** 15, memory=None) == "fused"  # no limit known


@pytest.mark.parametrize("scan", ["tree", "fused"])
@pytest.mark.parametrize("keep_rows,spill", [(True, False), (True, True), (False, False)])
def test_no_block_forward_runs_twice(rng, monkeypatch, tmp_path, keep_rows, spill, scan):
    """Count the engine's passes over each block in a causal forward+backward graph: every
    block's keys are hashed once and its queries scanned once (kept rows, in memory or spilled
    to files); without kept rows each gradient task runs its block's forward again.  The fused
    scan's keys' pass sums no chunk's B (on one thread): the block's scan sums its state."""
    from racecpu import engine
    calls = {"advance_keys": 0, "advance": 0}
    segmented = []
    for name in calls:
        def counted(*a, _f=getattr(engine, name), _n=name, **kw):
            calls[_n] += 1
            if _n == "advance_keys":
                segmented.append(kw.get("segmented", False))
            return _f(*a, **kw)
        monkeypatch.setattr(engine, name, counted)
    W = racecpu.hyperplanes(16)
    (q, k, v, g), (Q, K, V, G) = _sequence_inputs(rng, 5, np.float32, per_block=40)
    out, res = rd.race_attention_fwd(Q, K, V, W, causal=True, keep_rows=keep_rows,
                                     rows_dir=tmp_path if spill else None, scan=scan)
    with dask.config.set(scheduler="sync"):
        got = dask.compute(out, *rd.race_attention_bwd(res, G))
    blocks = 2 * 5
    recomputed = 0 if keep_rows else blocks
    assert calls == {"advance_keys": blocks + recomputed, "advance": blocks + recomputed}, calls
    assert set(segmented) == {scan == "fused"}
    assert len(list(tmp_path.glob("*.npz"))) == (blocks if spill else 0)
    ref, r = racecpu.race_attention_fwd(q, k, v, W, causal=True)
    for x, y in zip(got, (ref,) + racecpu.race_attention_bwd(r, g)):
        close(x, y, np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_non_causal_keys_are_hashed_once(rng, monkeypatch, dtype):
    """A non-causal forward+backward graph hashes each block's keys once: the sketch task keeps
    their soft buckets for the block's gradient task (the same bits as hashing them again, with a
    key mask), and without kept rows each gradient task hashes its keys again."""
    from racecpu import engine
    hashed = []

    def counted(*a, _f=engine._hash_keys, **kw):
        hashed.append(a[0].shape)
        return _f(*a, **kw)
    monkeypatch.setattr(engine, "_hash_keys", counted)
    W = racecpu.hyperplanes(16, dtype=dtype)
    q, k, v, g, m = data(rng, (2,), 60, 90, 16, 8, dtype, True)
    Q, K, V, G = (da.from_array(x, chunks=(1, 30, x.shape[-1])) for x in (q, k, v, g))
    M = da.from_array(m, chunks=(1, 30))
    got = {}
    for keep in (True, False):
        hashed.clear()
        out, res = rd.race_attention_fwd(Q, K, V, W, key_mask=M, keep_rows=keep)
        with dask.config.set(scheduler="sync"):
            got[keep] = dask.compute(out, *rd.race_attention_bwd(res, G))
        assert len(hashed) == (0 if keep else 2 * 3), hashed  # 2 heads x 3 key blocks hashed again
    for x, y in zip(got[True], got[False]):
        np.testing.assert_array_equal(x, y)
    ref, r = racecpu.race_attention_fwd(q, k, v, W, key_mask=m)
    for x, y in zip(got[True], (ref,) + racecpu.race_attention_bwd(r, g)):
        close(x, y, dtype)


def test_kept_rows_are_sized_by_their_arrays(rng):
    """Dask's memory accounting sees a block's kept rows at their arrays' size, not as a small object."""
    from dask.sizeof import sizeof
    W = racecpu.hyperplanes(16)
    k, v = rng.standard_normal((2, 64, 16)).astype(np.float32), rng.standard_normal((2, 64, 8)).astype(np.float32)
    _, keys = S.sketch_kept(k, v, W)
    _, fwd = S.causal_block_keys(k, v, W)
    for rows in (keys, fwd):
        assert rows.nbytes > 2 * 64 * 24 * 4
        assert rows.nbytes <= sizeof(rows) <= rows.nbytes + 1000
        assert sizeof((None, rows)) >= rows.nbytes  # as a task's tuple of results


def test_kept_keys_are_checked(rng):
    """``sketch_bwd(keys=)`` takes only what ``sketch_kept`` made of keys of the same shape."""
    W = racecpu.hyperplanes(16)
    k, v = rng.standard_normal((2, 2, 40, 16)).astype(np.float32), rng.standard_normal((2, 2, 40, 8)).astype(np.float32)
    sk, keys = S.sketch_kept(k, v, W)
    ref = S.sketch(k, v, W)
    np.testing.assert_array_equal(sk.A, ref.A)
    np.testing.assert_array_equal(sk.B, ref.B)
    assert keys.nbytes == 2 * 2 * 40 * (24 + 9) * 4
    np.testing.assert_array_equal(S.sketch_bwd(k, v, sk, keys=keys)[0], S.sketch_bwd(k, v, sk)[0])
    with pytest.raises(TypeError, match="KeptKeys"):
        S.sketch_bwd(k, v, sk, keys=sk)
    with pytest.raises(ValueError, match="leading dims"):
        S.sketch_bwd(k[0], v[0], S.sketch(k[0], v[0], W), keys=keys)
    with pytest.raises(ValueError, match="kept rows"):
        S.sketch_bwd(k[:, :, :30], v[:, :, :30], sk, keys=keys)


def test_sketches_travel_without_their_planes(rng):
    """What crosses between tasks is a sketch's sums and a digest of its planes; a task given
    other planes than the sketch's refuses it."""
    import pickle
    W = racecpu.hyperplanes(128)
    k, v = (rng.standard_normal((1, 50, 128)).astype(np.float32) for _ in range(2))
    sk = racecpu.sketch(k, v, W)
    wire = rd._wire(sk)
    assert len(pickle.dumps(wire)) < sk.nbytes + 1000 < len(pickle.dumps(sk))
    np.testing.assert_array_equal(rd._sketch(wire, W).B, sk.B)
    with pytest.raises(ValueError, match="other planes"):
        rd._sketch(wire, racecpu.hyperplanes(128, seed=1))


def test_readout_tasks_read_only_their_block_and_the_sketch(rng):
    """Graph-level check: every readout task depends on one query block and one summed sketch,
    every causal block on its own q, k, v blocks and one carried state."""
    W = racecpu.hyperplanes(16)
    _, (Q, K, V, _, _) = dask_inputs(rng, False, False, np.float32)
    out = rd.race_attention(Q, K, V, W)
    graph = dict(out.__dask_graph__())
    from dask.core import get_dependencies
    readouts = [key for key in graph if isinstance(key, str) and key.startswith("race-readout-")]
    assert len(readouts) == Q.numblocks[0] * Q.numblocks[1] * Q.numblocks[2]
    for key in readouts:
        deps = get_dependencies(graph, key)
        assert len(deps) == 2, deps
        assert sum(isinstance(dep, str) and dep.startswith("race-sum-") for dep in deps) == 1


# The functions this module sends to worker processes travel by value: the workers cannot
# import the tests (pytest imports them with --import-mode=importlib, the tree is not on their path).
cloudpickle = pytest.importorskip("cloudpickle")
cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: Seconds any one cluster operation may take: a cluster that lost its workers fails the test, not the suite.
TIMEOUT = 300


def _gather(client, futures):
    """The futures' results, waiting at most TIMEOUT seconds for them."""
    import distributed
    distributed.wait(futures, timeout=TIMEOUT)
    return client.gather(futures)


@pytest.fixture(scope="module")
def client():
    distributed = pytest.importorskip("distributed")
    # No work stealing: on a loaded machine the scheduler moves queued tasks (and then their
    # inputs) to an idle worker, which measures the machine's load, not what racecpu's graph sends.
    with dask.config.set({"distributed.scheduler.work-stealing": False}), \
            distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                     silence_logs=40) as cluster, distributed.Client(cluster) as c:
        yield c


@pytest.mark.parametrize("causal,masked,dtype", CASES)
def test_dask_cluster_equals_numpy(rng, client, causal, masked, dtype):
    errs = check_against_numpy(rng, causal, masked, dtype, lambda *xs: _gather(client, client.compute(list(xs))))
    print(causal, masked, np.dtype(dtype).name, {k: f"{v:.2g}" for k, v in errs.items()})


@pytest.mark.parametrize("blocks", [7, pytest.param(64, marks=pytest.mark.slow)])
def test_the_same_bits_on_one_and_two_workers(rng, client, blocks):
    """The graph fixes the order of every sum: one worker (the synchronous scheduler) and two
    worker processes give the same bits, causal (tree and fused scans; the fused one at 7 blocks
    only: its 64 blocks a sequence run one after another, ~40 s here) and not."""
    W = racecpu.hyperplanes(16)
    _, (Q, K, V, G) = _sequence_inputs(rng, blocks, np.float32)
    for causal, scan in ((False, "auto"), (True, "tree")) + (((True, "fused"),) if blocks < 64 else ()):
        out, res = rd.race_attention_fwd(Q, K, V, W, causal=causal, scan=scan)
        xs = [out, *rd.race_attention_bwd(res, G)]
        with dask.config.set(scheduler="sync"):
            one = dask.compute(*xs)
        two = _gather(client, client.compute(xs))
        for a, b in zip(one, two):
            np.testing.assert_array_equal(a, b)


def test_block_slots_of_a_cluster(rng, client):
    """2 single-threaded workers run 2 block tasks at once: "auto" fuses the scan for 2 sequences
    and scans 1 sequence's blocks by a tree (more blocks than CHAIN_BLOCKS)."""
    assert rd.block_slots() == 2 and rd.block_slots(threads=1) == 2
    W = racecpu.hyperplanes(16)
    _, (Q, K, V, G) = _sequence_inputs(rng, 16, np.float32)
    assert rd.race_attention_fwd(Q, K, V, W, causal=True)[1].scan == "fused"
    assert rd.race_attention_fwd(Q[:1], K[:1], V[:1], W, causal=True)[1].scan == "tree"
    # Each worker's memory limit over its one slot; results that would not fit take the tree.
    limits = [w["memory_limit"] for w in client.scheduler_info()["workers"].values()]
    assert rd.slot_memory() == min(limits) > 0 and rd.slot_memory(threads=1) == min(limits)
    n, d, dv = Q.shape[-2], Q.shape[-1], V.shape[-1]
    held = n * (dv + d) * 4 + n * (d + dv) * 4  # out and dq, dk and dv of one sequence, float32
    share = held / min(limits) * (1 + 1e-9)  # the share at which one sequence per slot just fits
    old = rd.FUSED_MEMORY_SHARE
    try:
        rd.FUSED_MEMORY_SHARE = share
        assert rd.race_attention_fwd(Q, K, V, W, causal=True)[1].scan == "fused"
        rd.FUSED_MEMORY_SHARE = share * 0.99
        assert rd.race_attention_fwd(Q, K, V, W, causal=True)[1].scan == "tree"
        # race_attention, which no backward follows, counts its output alone
        assert _scan_of(rd.race_attention(Q, K, V, W, causal=True)) == "fused"
        rd.FUSED_MEMORY_SHARE = n * dv * 4 / min(limits) * 0.99
        assert _scan_of(rd.race_attention(Q, K, V, W, causal=True)) == "tree"
    finally:
        rd.FUSED_MEMORY_SHARE = old


def _scan_of(out):
    """The causal scan a forward's graph runs: the tree (and chain) have a keys' pass, the fused scan none."""
    keys = [k for k in dict(out.__dask_graph__()) if isinstance(k, str)]
    assert any(k.startswith("race-causal-") for k in keys)
    return "tree" if any(k.startswith("race-keys-") for k in keys) else "fused"


def _incoming(dask_worker):
    return [dict(keys=e["keys"], total=e["total"]) for e in dask_worker.transfer_incoming_log]


def _numba_threads():
    import numba
    return numba.get_num_threads()


@pytest.mark.parametrize("causal", [False, True])
def test_dask_cluster_bytes_moved_per_block(client, causal):
    """What moves between workers: sketches, not rows.  Each block's q, k, v, g are views of
    one stacked block, so the scheduler keeps them on one worker; what racecpu's tasks
    send to each other is at most 2x the state's size per block."""
    rng = np.random.default_rng(7)
    lead, n, d, nb = (2,), 4096, 16, 8
    W = racecpu.hyperplanes(d)
    X = da.from_array(rng.standard_normal((4,) + lead + (n, d)).astype(np.float32), chunks=(4, 2, n // nb, d))
    Q, K, V, G = X[0], X[1], X[2], X[3]
    client.run(lambda dask_worker: dask_worker.transfer_incoming_log.clear())
    out, res = rd.race_attention_fwd(Q, K, V, W, causal=causal)
    grads = rd.race_attention_bwd(res, G)
    distributed = pytest.importorskip("distributed")
    kept = client.persist([out, *grads])  # not compute: its final concatenation moves every block to one worker
    distributed.wait(kept, timeout=TIMEOUT)
    logs = client.run(_incoming)
    del kept
    moved = {}
    for entries in logs.values():
        for e in entries:
            for key, nbytes in e["keys"].items():
                name = key if isinstance(key, str) else key[0]
                moved[name] = moved.get(name, 0) + nbytes
    ours = sum(b for name, b in moved.items() if name.startswith("race-") and not rd.holds_rows(name))
    rows = sum(b for name, b in moved.items() if not name.startswith("race-") or rd.holds_rows(name))
    state = int(np.prod(lead)) * 24 * (d + 1) * 8
    print(f"causal={causal}: {ours / nb:.0f} B of sketches per block moved (forward + backward) (state {state} B), "
          f"{rows / nb:.0f} B of rows per block (the scheduler's load balancing of tiny blocks)")
    assert ours / (2 * nb) <= 2 * state  # per block and pass (forward, backward)


@pytest.mark.parametrize("scan", ["tree", "fused"])
def test_causal_backward_tasks_read_only_their_block(scan):
    """Graph-level check that no row needs to cross between workers in the causal backward: every
    dstate and causal-bwd task reads the q, k, v, grad_out blocks of one sequence block, the
    dstate task also that block's forward task (its output and rows; the forward task reads the
    same blocks), the gradient task that task's rows, and otherwise only sketches (fused: the
    carry from the forward before it and the cotangent from the backward after it; no dstate)."""
    from dask.core import get_dependencies
    rng = np.random.default_rng(3)
    X = da.from_array(rng.standard_normal((4, 2, 64, 16)).astype(np.float32), chunks=(1, 1, (20, 12, 32), 16))
    Q, K, V, G = X[0], X[1], X[2], X[3]
    _, res = rd.race_attention_fwd(Q, K, V, racecpu.hyperplanes(16), causal=True, scan=scan)
    graph = dict(rd.race_attention_bwd(res, G)[0].__dask_graph__())
    counts = {"race-dstate-": 0, "race-causal-bwd-": 0}
    for key in graph:
        if not (isinstance(key, str) and key.startswith(("race-dstate-", "race-causal-bwd-"))):
            continue
        deps = get_dependencies(graph, key)
        blocks = {d[1:] for d in deps if isinstance(d, tuple)}
        assert len(blocks) == 1 and sum(isinstance(d, tuple) for d in deps) == 4, deps
        for d in deps:
            if isinstance(d, str) and d.startswith("race-fwd-"):  # the rows of the block's forward task
                d, = (x for x in get_dependencies(graph, d) if x.startswith("race-causal-"))
            if isinstance(d, str) and d.startswith("race-causal-"):  # the forward task of the same block
                assert {x[1:] for x in get_dependencies(graph, d) if isinstance(x, tuple)} == blocks
            elif isinstance(d, str):
                assert d.startswith(("race-sketch-", "race-carry-", "race-rcarry-", "race-dstate-")), d
        counts["race-dstate-" if key.startswith("race-dstate-") else "race-causal-bwd-"] += 1
    # 2 heads x 3 blocks (no dstate for the first; none fused)
    assert counts == {"race-dstate-": 0 if scan == "fused" else 2 * 2, "race-causal-bwd-": 2 * 3}


@pytest.mark.parametrize("causal,scan", [(False, "auto"), (True, "tree"), (True, "fused")])
def test_every_task_runs_once_when_stores_and_dbeta_compute_together(rng, client, causal, scan):
    """``client.compute([da.store(..., compute=False), dbeta])`` optimizes the store (a Delayed) and
    dbeta (an Array) apart; a task they share that Dask fused into a chain in one of them would
    run twice under two keys (it did: every block's backward ran twice in the benchmark and the
    demo).  Count each racecpu task in the task stream: every block's, once."""
    distributed = pytest.importorskip("distributed")
    W = racecpu.hyperplanes(16)
    _, (Q, K, V, G, _) = dask_inputs(rng, causal, False, np.float32)
    out, res = rd.race_attention_fwd(Q, K, V, W, causal=causal, scan=scan)
    dq, dk, dv, dbeta = rd.race_attention_bwd(res, G)
    # NumPy targets (the workers write into copies): a Delayed store, with nothing the workers cannot import
    work = [da.store([dq, dk, dv], [np.empty(x.shape, x.dtype) for x in (dq, dk, dv)], lock=False, compute=False),
            dbeta]
    with distributed.get_task_stream(client) as ts:
        _gather(client, client.compute(work))
    counts = {}
    for t in ts.data:
        name = _key_name(t["key"])
        for kind in ("race-causal-bwd", "race-causal-", "race-readout-bwd", "race-sketch-bwd", "race-dstate",
                     "race-sketch-"):
            if name.startswith(kind):
                counts[kind] = counts.get(kind, 0) + 1
                break
    nq, nk = (res.q.numblocks, res.k.numblocks)
    lead = nq[0] * nq[1]
    if causal:
        want = {"race-causal-bwd": lead * nq[2], "race-causal-": lead * nq[2]}
        if scan == "tree":  # the last block's total carries into nothing (fused: no totals, no dstate)
            want.update({"race-dstate": lead * (nq[2] - 1), "race-sketch-": lead * (nq[2] - 1)})
    else:
        want = {"race-readout-bwd": lead * nq[2], "race-sketch-bwd": lead * nk[2], "race-sketch-": lead * nk[2]}
    assert counts == want


def test_worker_tasks_use_the_worker_threads(client):
    def probe(x):
        rd._set_threads(None)
        return np.array([_numba_threads()])
    got = _gather(client, client.compute(da.from_array(np.zeros(2), chunks=1).map_blocks(probe, dtype=int)))
    assert set(got.tolist()) == {1}


def test_worker_tasks_keep_the_pool_across_kinds_of_calls(client):
    """After a racecpu task, a worker's result pool no longer ages by calls and keeps at most
    half the worker's memory limit idle."""
    limits = client.run(lambda dask_worker: dask_worker.memory_manager.memory_limit)
    for addr in limits:  # what every racecpu task runs first, on each worker (a racecpu function: importable there)
        _gather(client, [client.submit(rd._set_threads, None, workers=[addr], pure=False)])
    pools = client.run(lambda: (lambda p: (p.age_by_calls, p.limit))(importlib.import_module("racecpu._memory").POOL))
    for addr, (ageing, limit) in pools.items():
        assert ageing is False and limit <= limits[addr] // 2


def _key_name(key):
    return key if isinstance(key, str) else key[0]


#: Seconds the killed-worker test waits for any one step (a restarted worker imports racecpu
#: and loads its Numba kernels); it normally takes a few seconds in all.
KILL_TIMEOUT = 120


@pytest.mark.slow
def test_dask_cluster_survives_a_killed_worker():
    """A worker process killed (SIGKILL) while the cluster runs racecpu's tasks: its nanny
    restarts it, the scheduler recomputes what it held or was running, and the forward and
    backward still equal the in-memory API.  On a cluster of its own (the module's keeps its
    workers)."""
    import logging
    import os
    import signal
    import time
    distributed = pytest.importorskip("distributed")
    lead, n, d, nb = (2,), 1 << 16, 32, 16
    W = racecpu.hyperplanes(d, dtype=np.float64)
    # Inputs drawn per block by the tasks that use them (no rows in the graph); a block's
    # q, k, v, g are views of one stacked block.
    X = da.random.default_rng(3).standard_normal((4,) + lead + (n, d), chunks=(4,) + lead + (n // nb, d))
    Q, K, V, G = X[0], X[1], X[2], X[3]
    out, res = rd.race_attention_fwd(Q, K, V, W, causal=True)
    grads = rd.race_attention_bwd(res, G)
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                       silence_logs=logging.CRITICAL)
    try:
        with distributed.Client(cluster, set_as_default=False, timeout=KILL_TIMEOUT) as c:
            c.wait_for_workers(2, timeout=KILL_TIMEOUT)
            pids = c.run(os.getpid)  # {address: pid}
            t0 = time.perf_counter()
            futures = c.compute([out, *grads])
            deadline = time.monotonic() + KILL_TIMEOUT
            while True:  # until a racecpu task runs (or waits to run) on some worker
                busy = sorted(w for w, keys in c.processing().items()
                              if any(_key_name(key).startswith("race-") for key in keys))
                if busy:
                    break
                assert not all(f.done() for f in futures), "the compute ended before any race- task was seen"
                assert time.monotonic() < deadline, "no race- task processing"
                time.sleep(0.005)
            victim = busy[0]
            os.kill(pids[victim], signal.SIGKILL)
            t_kill = time.perf_counter() - t0
            pending = sum(not f.done() for f in futures)
            assert pending, "the compute ended before the kill"
            got = [f.result(timeout=KILL_TIMEOUT) for f in futures]
            t_done = time.perf_counter() - t0
            # The scheduler removed the killed worker (unexpectedly) and the nanny started another.
            while True:
                removed = [msg for _, msg in c.get_events("all")
                           if isinstance(msg, dict) and msg.get("action") == "remove-worker"
                           and msg.get("worker") == victim]
                after = c.run(os.getpid) if removed else {}
                if len(after) == 2 and victim not in after:
                    break
                assert time.monotonic() < deadline + KILL_TIMEOUT, f"no restarted worker: {after}, {removed}"
                time.sleep(0.05)
            assert pids[victim] not in after.values() and set(after.values()) != set(pids.values())
            assert len(removed) == 1 and not removed[0]["expected"], removed
            lost = {_key_name(key) for key in removed[0]["processing-tasks"] | removed[0]["lost-computed-tasks"]}
            assert lost, "the killed worker neither ran nor held anything"
    finally:
        cluster.close(timeout=KILL_TIMEOUT)
    print(f"killed {victim} at {t_kill:.2f} s with {pending} of {len(futures)} results pending, "
          f"results at {t_done:.2f} s; it lost {len(lost)} keys, {sum(x.startswith('race-') for x in lost)} of racecpu")
    x = X.compute(scheduler="sync")
    ref, r = racecpu.race_attention_fwd(x[0], x[1], x[2], W, causal=True)
    want = (ref,) + racecpu.race_attention_bwd(r, x[3])
    for name, a, b in zip(("out", "dq", "dk", "dv", "dbeta"), got, want):
        assert np.shape(a) == np.shape(b) and np.asarray(a).dtype == np.asarray(b).dtype, name
        close(a, b, np.float64, name)


def test_zarr_in_and_out(rng, tmp_path):
    zarr = pytest.importorskip("zarr")
    W = racecpu.hyperplanes(16)
    q, k, v, _, _ = data(rng, (2,), 64, 64, 16, 8, np.float32, False)
    for name, x in (("q", q), ("k", k), ("v", v)):
        z = zarr.open_array(str(tmp_path / name), mode="w", shape=x.shape, chunks=(2, 16, 16), dtype=x.dtype)
        z[...] = x
    Q, K, V = (da.from_zarr(str(tmp_path / name)) for name in "qkv")
    out = rd.race_attention(Q, K, V, W, causal=True)
    with dask.config.set(scheduler="threads"):
        out.to_zarr(str(tmp_path / "out"))
    close(zarr.open_array(str(tmp_path / "out"), mode="r")[...], racecpu.race_attention(q, k, v, W, causal=True),
          np.float32, "zarr out")


# ---------------------------------------------------------------------------
# block_placement: a block's tasks on its worker, sketches crossing only between runs of blocks
# ---------------------------------------------------------------------------

def _causal_graph(rng, heads, blocks, scan, b=32, d=8):
    """A causal forward+backward graph over ``heads`` sequences of ``blocks`` blocks: the graph (a
    dict), its dependencies and the input chunks' keys -> (head, block)."""
    from dask.core import flatten, get_deps
    x = rng.standard_normal((4, heads, blocks * b, d))
    q, k, v, g = (da.from_array(a, chunks=(1, b, d)) for a in x)
    out, res = rd.race_attention_fwd(q, k, v, racecpu.hyperplanes(d), causal=True, scan=scan)
    graph = {}
    for c in (out,) + rd.race_attention_bwd(res, g):
        graph.update(dict(c.__dask_graph__()))
    block_of = {key: key[1:3] for a in (q, k, v, g) for key in flatten(a.__dask_keys__())}
    return graph, get_deps(graph)[0], block_of


def _name(key):
    return key[0] if isinstance(key, tuple) else key


@pytest.mark.parametrize("scan,heads,blocks", [("tree", 1, 8), ("tree", 1, 64), ("chain", 1, 16), ("tree", 3, 5),
                                               ("fused", 4, 4)])
def test_block_placement_keeps_blocks_on_their_workers(rng, scan, heads, blocks):
    """Every task that reads one block's rows is placed on that block's worker, the blocks (head-major)
    in contiguous runs of equal length; no rows cross; sketches cross only where a scan passes from one
    worker's run to the next: at most 2 log2(blocks) + 2 per scan, with dbeta's tree besides (the demo's
    phases, placed by Dask, moved 1.2-2.0 states per block and pass)."""
    graph, deps, block_of = _causal_graph(rng, heads, blocks, scan)
    workers = ["tcp://w0:1", "tcp://w1:1"]
    p = rd.block_placement(graph, block_of, workers)
    n = heads * blocks
    run = {pos: workers[i * 2 // n] for i, pos in enumerate(sorted(set(block_of.values())))}
    readers = [k for k in graph if _name(k).startswith("race-") and any(d in block_of for d in deps[k])]
    assert len(readers) >= 2 * n  # a forward and a backward per block at least
    for key in readers:  # its block: the input chunks it reads
        mine = {block_of[d] for d in deps[key] if d in block_of}
        assert len(mine) == 1, key
        assert p(key) == [run[mine.pop()]], key
        assert p.priority(key) < 0
    assert all(len(p(k)) == 1 for k in graph if _name(k).startswith("race-"))  # sums too: none left to Dask
    crossed = rows = 0
    for key, ds in deps.items():
        for dep in ds:
            if p(key) != p(dep) and len(p(key)) == len(p(dep)) == 1:
                if rd.holds_rows(_name(dep)) or dep in block_of:
                    rows += 1
                else:  # a sketch, or a block's share of dbeta
                    crossed += 1
    assert rows == 0
    scans = 0 if scan == "fused" else 2  # the forward's carries and the backward's reverse carries
    bound = scans * (2 * int(np.ceil(np.log2(blocks))) + 2) + heads * (-(-n // rd.FAN_IN) + 1)  # + dbeta's tree
    assert crossed <= bound, (crossed, bound)


def test_block_placement_priorities_order_and_pickle(rng):
    """A block's tasks before later blocks' (-(index + 1)), a sum of sketches first (0); one worker takes
    everything; the placement survives pickling (the scheduler calls it); unknown keys may go anywhere."""
    import pickle
    graph, deps, block_of = _causal_graph(rng, 1, 4, "tree")
    p = rd.block_placement(graph, block_of, ["tcp://only:1"])
    assert all(p(k) == ["tcp://only:1"] for k in graph)
    order = sorted(set(block_of.values()))
    for key, pos in block_of.items():
        assert p.priority(key) == -(order.index(pos) + 1)
    sums = [k for k in graph if _name(k).startswith("race-carry-")]
    assert sums and all(p.priority(k) == 0 for k in sums)
    q = pickle.loads(pickle.dumps(p))
    assert all(q(k) == p(k) and q.priority(k) == p.priority(k) for k in graph)
    assert q("not-a-key") == ["tcp://only:1"] and q.priority("not-a-key") == 0
    with pytest.raises(ValueError, match="at least one worker"):
        rd.block_placement(graph, block_of, [])
    with pytest.raises(ValueError, match="not in the graph"):
        rd.block_placement(graph, {("nope", 0, 0, 0): (0, 0)}, ["tcp://only:1"])

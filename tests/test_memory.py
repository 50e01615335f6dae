"""The pool that reuses the memory of racecpu's results: reuse, safety, limits."""

import numpy as np
import pytest

import racecpu
from racecpu._memory import POOL, BufferPool


def addr(x):
    return x.__array_interface__["data"][0]


def test_a_dropped_block_is_reused_and_a_viewed_one_is_not():
    pool = BufferPool(1 << 30)
    a = pool.empty((256, 1024), np.float32)
    p = addr(a)
    view = a[3:5, ::2].T  # keeps the block: only the view is left after del
    del a
    view[...] = 7.0
    b = pool.empty((256, 1024), np.float32)
    assert addr(b) != p
    b[...] = 1.0
    assert np.all(view == 7.0)
    exported = memoryview(view)  # a buffer export holds the block too
    del view
    assert addr(pool.empty((256, 1024), np.float32)) != p
    del exported
    c = pool.empty((1024, 256), np.float32)  # same bytes, other shape
    assert addr(c) == p and c.shape == (1024, 256) and c.flags.c_contiguous
    assert pool.stats()["hits"] == 1 and pool.stats()["misses"] == 3


def test_sizes_dtypes_and_slack():
    pool = BufferPool(1 << 30)
    a = pool.empty((1 << 18,), np.float64)  # 2 MiB
    p = addr(a)
    del a
    small = pool.empty((1 << 18,), np.float32)  # 1 MiB: would waste half the block
    assert addr(small) != p
    del small
    z = pool.zeros((1 << 18,), np.float32)
    assert z.dtype == np.float32 and not z.any()
    big = pool.empty((int(1.2 * (1 << 18)),), np.float32)  # 1.2 MiB <= 2 MiB? no: > 25% slack
    assert addr(big) != p
    near = pool.empty((1 << 18) - 1000, np.float64)  # a little smaller: reuses it
    assert addr(near) == p and near.dtype == np.float64


def test_small_arrays_and_a_zero_limit_bypass_the_pool():
    pool = BufferPool(1 << 30)
    x = pool.empty((10,), np.float32)
    assert x.base is None and not pool._blocks
    off = BufferPool(0)
    y = off.empty((1 << 20,), np.float32)
    assert y.base is None and not off._blocks
    capped = BufferPool(2 << 20)  # more than the limit could never be kept idle
    z = capped.empty((1 << 20,), np.float32)
    assert z.base is None and not capped._blocks


def test_idle_blocks_age_out_and_respect_the_limit():
    pool = BufferPool(3 << 20)
    a, b = pool.empty((1 << 20,), np.uint8), pool.empty((2 << 20,), np.uint8)
    kept = pool.empty((1 << 20,), np.uint8)
    del a, b
    assert pool.stats()["idle_bytes"] == 3 << 20 and pool.stats()["live_bytes"] == 1 << 20
    for _ in range(BufferPool.MAX_IDLE_CALLS):
        pool.tick()
    assert pool.stats()["idle_bytes"] == 3 << 20  # a live block's age does not count
    pool.tick()
    assert pool.stats()["idle_bytes"] == 0 and pool.stats()["live_bytes"] == 1 << 20
    del kept
    assert pool.release() == 1 << 20 and pool.stats()["idle_bytes"] == 0
    # A new block lets older idle ones go where the limit would be passed.
    c = pool.empty((2 << 20,), np.uint8)
    del c
    d = pool.empty((3 << 20,), np.uint8)
    assert pool.stats()["idle_bytes"] == 0 and pool.stats()["live_bytes"] == 3 << 20
    del d
    pool.tick()
    assert pool.stats()["idle_bytes"] == 3 << 20


def test_a_training_step_of_many_layers_reuses_every_block():
    # Each layer's forward keeps a block (its residuals) until its backward, in reverse order,
    # one call each: a block waits idle for about a step (2 L calls) before the same layer
    # asks for it again.  After the first step nothing is faulted in afresh.
    layers = 24
    pool = BufferPool(1 << 40)
    for step in range(3):
        kept = []
        for _ in range(layers):
            pool.tick()
            kept.append(pool.empty((1 << 20,), np.uint8))
        for _ in range(layers):
            pool.tick()
            kept.pop()
        assert pool.stats()["misses"] == layers, step
    assert pool.stats()["hits"] == 2 * layers


def test_without_ageing_by_calls_only_the_limit_releases():
    pool = BufferPool(3 << 20)
    pool.age_by_calls = False
    a, b = pool.empty((1 << 20,), np.uint8), pool.empty((2 << 20,), np.uint8)
    del a, b
    for _ in range(10 * BufferPool.MAX_IDLE_CALLS):
        pool.tick()
    assert pool.stats()["idle_bytes"] == 3 << 20
    c = pool.empty((1 << 20,), np.uint8)  # reuses the 1 MiB block, however old
    assert pool.stats()["hits"] == 1
    del c
    pool.limit = 2 << 20
    pool.tick()  # the limit still applies: the oldest idle blocks go first
    assert pool.stats()["idle_bytes"] <= 2 << 20


def test_results_kept_by_the_caller_are_never_overwritten(rng):
    # One call's outputs and gradients, and views of them, stay as they were
    # while later calls of the same shapes reuse what was dropped.
    q, k, v, g = (rng.standard_normal((2, 64, 8)) for _ in range(4))
    W = racecpu.hyperplanes(8, 3, 3, seed=0, dtype=np.float64)
    for causal in (False, True):
        out, res = racecpu.race_attention_fwd(q, k, v, W, causal=causal)
        grads = racecpu.race_attention_bwd(res, g)[:3]
        saved = [x.copy() for x in (out,) + grads]
        view = grads[1][1, ::3]
        saved_view = view.copy()
        del res
        for _ in range(3):
            o2, r2 = racecpu.race_attention_fwd(2 * q, -k, v[::-1].copy(), W, causal=causal)
            racecpu.race_attention_bwd(r2, -g)
            del o2, r2
        for x, s in zip((out,) + grads, saved):
            np.testing.assert_array_equal(x, s)
        del grads
        for _ in range(2):
            racecpu.race_attention_bwd(racecpu.race_attention_fwd(q, k, v, W, causal=causal)[1], g)
        np.testing.assert_array_equal(view, saved_view)
        # And a repeat on reused blocks gives the same numbers, zero-initialised sums included.
        np.testing.assert_array_equal(racecpu.race_attention(q, k, v, W, causal=causal), saved[0])
    assert POOL.stats()["hits"] > 0


@pytest.mark.parametrize("causal", [False, True])
def test_residuals_kept_while_later_calls_run_give_the_same_backward(rng, causal):
    # A forward of one chunk keeps its sketch as a view of the chunk totals (no sum of one
    # value); those are 1 MiB here (G F dv float64), so they come from the pool, and the
    # later calls of the same shape must not get the memory the residuals still read.
    G, n, d, dv = 16, 48, 8, 64
    q, k, g = rng.standard_normal((G, n, d)), rng.standard_normal((G, n, d)), rng.standard_normal((G, n, dv))
    v = rng.standard_normal((G, n, dv))
    W = racecpu.hyperplanes(d, 5, 4, seed=1, dtype=np.float64)  # F = 128
    out, res = racecpu.race_attention_fwd(q, k, v, W, causal=causal)
    want = [x.copy() for x in racecpu.race_attention_bwd(res, g)[:3]]
    for i in range(3):
        racecpu.race_attention_bwd(racecpu.race_attention_fwd(-q, 2 * k, v + i, W, causal=causal)[1], g)
    for x, w in zip(racecpu.race_attention_bwd(res, g)[:3], want):
        np.testing.assert_array_equal(x, w)


def test_public_limit_and_release(monkeypatch):
    monkeypatch.setattr(POOL, "limit", POOL.limit)
    monkeypatch.setattr(POOL, "_blocks", [])
    before = POOL.limit
    x = POOL.empty((1 << 20,), np.float32)
    del x
    assert racecpu.pool_stats()["idle_bytes"] == 4 << 20
    old = racecpu.set_pool_limit(0)  # off: what is idle goes at once
    assert old == before
    assert racecpu.pool_stats()["idle_bytes"] == 0 and racecpu.pool_stats()["limit"] == 0
    y = POOL.empty((1 << 20,), np.float32)
    assert y.base is None
    racecpu.set_pool_limit(1 << 30)
    z = POOL.empty((1 << 20,), np.float32)
    del z
    assert racecpu.release_memory() == 4 << 20
    for bad in (-1, 1.5, "1", True):
        with pytest.raises(ValueError, match="non-negative integer"):
            racecpu.set_pool_limit(bad)


def test_the_environment_sets_the_default_limit(monkeypatch):
    from racecpu import _memory
    monkeypatch.setenv("RACECPU_POOL_BYTES", "2e9")
    assert _memory._default_limit() == 2_000_000_000
    monkeypatch.setenv("RACECPU_POOL_BYTES", "lots")
    with pytest.warns(RuntimeWarning, match="RACECPU_POOL_BYTES"):
        assert _memory._default_limit() == _memory.physical_memory() // 2
    monkeypatch.delenv("RACECPU_POOL_BYTES")
    assert 0 < _memory._default_limit()


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_FREE"), reason="no MADV_FREE on this platform")
def test_idle_blocks_can_be_marked_free():
    # MADV_FREE works on private anonymous mappings only; the pool ignores its
    # OSError (old kernels), so check that the call really succeeds on a block.
    import mmap
    pool = BufferPool(1 << 30)
    a = pool.empty((1 << 20,), np.float32)
    a[:] = 1.0
    pool._blocks[0].mem.madvise(mmap.MADV_FREE)
    del a
    assert pool.stats()["idle_bytes"] == 4 << 20


def test_small_idle_blocks_are_advised_after_some_calls_and_large_ones_at_once(monkeypatch):
    """MADV_FREE costs a system call and a TLB flush per block: a block under ADVISE_NOW_BYTES
    that a loop hands back and asks for again within ADVISE_AFTER_CALLS calls is never marked;
    one left idle that long is marked once, at a tick; a block of ADVISE_NOW_BYTES or more is
    marked as it falls idle."""
    advised = []
    monkeypatch.setattr(BufferPool, "_advise", staticmethod(lambda b: (advised.append(b.size),
                                                                       setattr(b, "advised", True))))
    pool = BufferPool(1 << 30)
    pool.ADVISE_AFTER_CALLS, pool.ADVISE_NOW_BYTES = 3, 8 << 20
    for _ in range(10):  # a loop: released and asked for again at the next call
        pool.tick()
        a = pool.empty((1 << 20,), np.float32)  # 4 MiB
        del a
    assert advised == [] and pool.stats()["hits"] == 9
    for _ in range(2):
        pool.tick()
    assert advised == []
    pool.tick()   # idle for three calls now
    assert advised == [4 << 20]
    for _ in range(5):
        pool.tick()
    assert advised == [4 << 20]   # once
    b = pool.empty((1 << 20,), np.float32)   # handed out again: marked again after its next release
    del b
    for _ in range(3):
        pool.tick()
    assert advised == [4 << 20, 4 << 20]
    big = pool.empty((2 << 20,), np.float32)  # 8 MiB: marked at release
    del big
    assert advised == [4 << 20, 4 << 20, 8 << 20]
    for _ in range(5):
        pool.tick()
    assert len(advised) == 3

"""Packed sequences (``cu_seqlens``): several sequences on one axis, each attending only within itself.

The oracle is a call per sequence, in float64 to 1e-10: forward, every
gradient, dbeta and the planes' gradient (summed over the sequences).
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import racecpu
from racecpu import config
from racecpu.packing import CHUNK_OVERHEAD, packed_chunks, padded_layout

from .util import nan_pool


def _offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _separate(q, k, v, W, beta, g, cu, causal, mask=None):
    """Forward and gradients of one call per sequence, concatenated on the sequence axis."""
    outs, grads = [], [[], [], []]
    dbeta, dW = 0.0, np.zeros_like(W)
    for s in range(cu.size - 1):
        sl = slice(cu[s], cu[s + 1])
        if cu[s] == cu[s + 1]:
            continue
        m = None if mask is None else mask[..., sl]
        y, res = racecpu.race_attention_fwd(q[..., sl, :], k[..., sl, :], v[..., sl, :], W, beta, causal=causal,
                                            key_mask=m)
        dq, dk, dv, db, dw = racecpu.race_attention_bwd(res, g[..., sl, :], dplanes=True)
        outs.append(y)
        for acc, x in zip(grads, (dq, dk, dv)):
            acc.append(x)
        dbeta += db
        dW += dw
    return (np.concatenate(outs, -2), *(np.concatenate(x, -2) for x in grads), dbeta, dW)


def _check(got, want, tol=1e-10):
    for name, a, b in zip(("out", "dq", "dk", "dv", "dbeta", "dplanes"), got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=tol, err_msg=name)


def _inputs(rng, lead, kv_lead, n, d, dv):
    q = rng.standard_normal(lead + (n, d))
    k = rng.standard_normal(kv_lead + (n, d))
    v = rng.standard_normal(kv_lead + (n, dv))
    g = rng.standard_normal(lead + (n, dv))
    return q, k, v, g


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", [[5, 0, 70, 1030, 1], [64, 64, 128], [300], [1, 1, 1], [0, 40, 0]])
def test_packed_equals_a_call_per_sequence(causal, lengths):
    rng = np.random.default_rng(len(lengths))
    cu = _offsets(lengths)
    q, k, v, g = _inputs(rng, (2, 3), (2, 3), int(cu[-1]), 12, 5)
    W = racecpu.hyperplanes(12, 3, 3, seed=1, dtype=np.float64)
    want = _separate(q, k, v, W, 2.5, g, cu, causal)
    copies = [x.copy() for x in (q, k, v, g, cu)]
    y, res = racecpu.race_attention_fwd(q, k, v, W, 2.5, causal=causal, cu_seqlens=cu)
    _check((y,) + racecpu.race_attention_bwd(res, g, dplanes=True), want)
    # the forward alone: the same bits; nothing given is modified
    np.testing.assert_array_equal(racecpu.race_attention(q, k, v, W, 2.5, causal=causal, cu_seqlens=cu), y)
    for a, b in zip((q, k, v, g, cu), copies):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("causal", [False, True])
def test_packed_with_grouped_heads_and_key_mask(causal):
    rng = np.random.default_rng(7)
    cu = _offsets([90, 33, 200])
    n = int(cu[-1])
    q, k, v, g = _inputs(rng, (2, 4), (2, 2), n, 8, 4)
    mask = rng.random((2, 2, n)) > 0.3
    W = racecpu.hyperplanes(8, 2, 4, seed=3, dtype=np.float64)
    rep = lambda x: np.repeat(x, 2, axis=1)  # noqa: E731 - grouped heads as repeated k, v
    want = list(_separate(q, rep(k), rep(v), W, 4.0, g, cu, causal, rep(mask)))
    want[2:4] = [x.reshape(2, 2, 2, n, -1).sum(2) for x in want[2:4]]
    y, res = racecpu.race_attention_fwd(q, k, v, W, 4.0, causal=causal, key_mask=mask, cu_seqlens=cu)
    _check((y,) + racecpu.race_attention_bwd(res, g, dplanes=True), want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_packed_scans_agree_over_segments_and_backward_routes(rng, monkeypatch, dtype):
    # The causal scan restarts at each sequence however its chunks are split
    # into segments (carries from the chunk totals, or carried by the task)
    # and by every backward route (one pass; split, with few and many chunks
    # in its pass; queries' and keys' passes): the same bits, equal to a call
    # per sequence, with no value read that the kernels did not write.
    from racecpu import _kernels, plan
    monkeypatch.setattr(config, "CHUNK", 16)  # chunks of 16: sequences start on every few
    nan_pool(monkeypatch)
    cu = _offsets([20, 16, 3, 50, 0, 31])
    n = int(cu[-1])
    q, k, v, g = (x.astype(dtype) for x in _inputs(rng, (1,), (1,), n, 6, 3))
    W = racecpu.hyperplanes(6, 3, 2, seed=0, dtype=dtype)
    want = _separate(*(x.astype(np.float64) for x in (q, k, v)), W.astype(np.float64), 2.0,
                     g.astype(np.float64), cu, True)
    split = _kernels.causal_bwd_split  # the engine calls the route the plan picks
    tails = []

    def spy(*args, **kw):
        tails.append(config.SPLIT_TAIL)
        return split(*args, **kw)
    monkeypatch.setattr(_kernels, "causal_bwd_split", spy)
    runs = []
    nc = packed_chunks(cu, n, 16).chunks.seq.size
    assert nc == 10  # 2 + 1 + 1 + 4 + 2 chunks of at most 16
    for seg, tail in [(1, None), (2, 0.01), (2, 0.32), (2, 0.99), (3, None), (nc, None)]:
        if tail is not None:
            monkeypatch.setattr(config, "SPLIT_TAIL", tail)
        monkeypatch.setattr(plan, "scan_segments", lambda G, nc, n, seg=seg: seg)
        y, res = racecpu.race_attention_fwd(q, k, v, W, 2.0, causal=True, cu_seqlens=cu)
        got = (y,) + racecpu.race_attention_bwd(res, g, dplanes=True)
        _check(got, want, 1e-4 if dtype == np.float32 else 1e-10)
        runs.append(got)
    assert tails == [0.01, 0.32, 0.99]
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            np.testing.assert_array_equal(a, b)


def test_out_buffers_and_16_bit_inputs(rng):
    cu = _offsets([100, 37, 64])
    n = int(cu[-1])
    q, k, v, g = (x.astype(np.float32) for x in _inputs(rng, (2,), (2,), n, 8, 4))
    W = racecpu.hyperplanes(8, 3, 3, seed=2)
    y, res = racecpu.race_attention_fwd(q, k, v, W, cu_seqlens=cu)
    out = np.empty_like(y)
    assert racecpu.race_attention(q, k, v, W, cu_seqlens=cu, out=out) is out
    np.testing.assert_array_equal(out, y)
    bufs = tuple(np.empty_like(x) for x in (q, k, v))
    grads = racecpu.race_attention_bwd(res, g, out=bufs)
    assert all(a is b for a, b in zip(grads, bufs))
    np.testing.assert_array_equal(grads[0], racecpu.race_attention_bwd(res, g)[0])
    # float16 in, float16 out; computed in float32 from the same values
    h = [x.astype(np.float16) for x in (q, k, v, g)]
    yh, resh = racecpu.race_attention_fwd(*h[:3], W, cu_seqlens=cu)
    y32, res32 = racecpu.race_attention_fwd(*(x.astype(np.float32) for x in h[:3]), W, cu_seqlens=cu)
    assert yh.dtype == np.float16
    np.testing.assert_array_equal(yh, y32.astype(np.float16))
    for a, b in zip(racecpu.race_attention_bwd(resh, h[3]), racecpu.race_attention_bwd(res32, h[3].astype(np.float32))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(np.asarray(a).dtype))


@pytest.mark.parametrize("cu, match", [
    ([1, 10], "run from 0"),
    ([0, 9], "run from 0"),
    ([0, 6, 4, 10], "must not decrease"),
    ([[0, 10]], "1-D"),
    ([0], "1-D with at least two"),
    ([0.0, 10.0], "integers"),
])
def test_bad_cu_seqlens(rng, cu, match):
    q, k, v, _ = _inputs(rng, (1,), (1,), 10, 4, 2)
    W = racecpu.hyperplanes(4, 2, 2)
    with pytest.raises((ValueError, TypeError), match=match):
        racecpu.race_attention(q, k, v, W, cu_seqlens=np.array(cu))


def test_packing_needs_one_sequence_axis_for_q_and_kv(rng):
    q = rng.standard_normal((1, 10, 4))
    k, v = rng.standard_normal((1, 12, 4)), rng.standard_normal((1, 12, 2))
    with pytest.raises(ValueError, match="same sequence length"):
        racecpu.race_attention(q, k, v, racecpu.hyperplanes(4, 2, 2), cu_seqlens=np.array([0, 10]))


def test_overflow_in_an_early_sequence_is_reported(rng):
    # the causal scan restarts at each sequence, so its total only covers the
    # last: a v whose float64 sums overflow in the first must still raise
    cu = _offsets([30, 30])
    q, k, v, g = _inputs(rng, (1,), (1,), 60, 4, 2)
    v[0, :30] = 1e308
    W = racecpu.hyperplanes(4, 2, 2)
    for causal in (False, True):
        with pytest.raises(ValueError, match="v .*overflow"):
            racecpu.race_attention(q, k, v, W, causal=causal, cu_seqlens=cu)
    y, res = racecpu.race_attention_fwd(q, k, np.ones_like(v), W, causal=True, cu_seqlens=cu)
    g[0, :30] = 1e308
    with pytest.raises(ValueError, match="grad_out .*overflow"):
        racecpu.race_attention_bwd(res, g)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=40), st.sampled_from([7, 64, 1024]))
def test_packed_chunks(lengths, chunk):
    # chunks cover the tokens in order, none longer than chunk or across two
    # sequences, and a sequence has as few as its length allows
    cu = _offsets(lengths)
    n = int(cu[-1])
    pk = packed_chunks(cu, n, chunk)
    cuts, seq = pk.chunks
    assert cuts[0] == 0 and cuts[-1] == n and np.all(np.diff(cuts) > 0) and np.all(np.diff(cuts) <= chunk)
    nonempty = [s for s in range(len(lengths)) if lengths[s]]
    np.testing.assert_array_equal(np.bincount(seq, minlength=len(nonempty)),
                                  [-(-lengths[s] // chunk) for s in nonempty])
    for c in range(seq.size):
        s = nonempty[seq[c]]
        assert cu[s] <= cuts[c] < cuts[c + 1] <= cu[s + 1]
    np.testing.assert_array_equal(cuts[pk.first], cu[nonempty])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=40))
def test_padded_layout(lengths):
    # racecpu.cuda's layout: every non-empty sequence starts on a chunk, in
    # order, with no row shared; the chunk is the cheapest by the cost model
    cu = _offsets(lengths)
    n = int(cu[-1])
    pk = padded_layout(cu, n)
    rows = np.arange(n) if pk.rows is None else pk.rows
    assert pk.padded >= n and rows.size == n
    assert np.all(np.diff(rows) > 0) and (n == 0 or rows[-1] < pk.padded)
    nonempty = [s for s in range(len(lengths)) if lengths[s]]
    firsts = rows[cu[nonempty]] if n else np.zeros(0, np.int64)
    np.testing.assert_array_equal(firsts % pk.chunk, 0)
    np.testing.assert_array_equal(firsts // pk.chunk, pk.first)
    for s, lo in enumerate(pk.first):  # every chunk of a sequence maps to it
        hi = pk.first[s + 1] if s + 1 < pk.first.size else pk.seq.size
        np.testing.assert_array_equal(pk.seq[lo:hi], s)
    for causal in (False, True):
        pc = padded_layout(cu, n, causal=causal)
        cost = {c: padded_layout(cu, n, min_chunk=c, max_chunk=c).padded * (1 + CHUNK_OVERHEAD[causal] / c)
                for c in (1024, 512, 256, 128, 64)}
        assert cost[pc.chunk] == min(cost.values())


def test_autograd_op_and_layer_take_packed_sequences(rng):
    from racecpu.autograd import Tensor
    from racecpu.autograd import functional as F
    from racecpu.autograd.nn import MultiHeadAttention
    cu = _offsets([40, 0, 57, 31])
    n = int(cu[-1])
    q, k, v, g = _inputs(rng, (2, 2), (2, 2), n, 6, 6)
    W = racecpu.hyperplanes(6, 2, 3, seed=4, dtype=np.float64)
    want = _separate(q, k, v, W, 3.0, g, cu, True)
    # a beta per head (the heads one at a time) and learnable planes: the same as a call per sequence
    for beta in (Tensor(np.float64(3.0), requires_grad=True), Tensor(np.full(2, 3.0), requires_grad=True)):
        ts = [Tensor(x, requires_grad=True) for x in (q, k, v, W)]
        out = F.race_attention(*ts[:3], ts[3], beta, causal=True, cu_seqlens=cu)
        (out * Tensor(g)).sum().backward()
        _check((out.data, ts[0].grad, ts[1].grad, ts[2].grad, beta.grad.sum(), ts[3].grad), want)
    # the layer: each packed sequence's output is that of the sequence alone
    mha = MultiHeadAttention(12, 2, causal=True, dtype=np.float64, seed=1)
    x = rng.standard_normal((1, n, 12))
    y = mha(Tensor(x), cu_seqlens=cu).data
    for s in range(cu.size - 1):
        if cu[s] < cu[s + 1]:
            alone = mha(Tensor(x[:, cu[s]:cu[s + 1]])).data
            np.testing.assert_allclose(y[:, cu[s]:cu[s + 1]], alone, rtol=0, atol=1e-10)
    # the per-bucket mean too: the layer, and the op's gradients (planes and a beta a head included)
    mha = MultiHeadAttention(12, 2, causal=True, dtype=np.float64, seed=1, estimator="bucket_mean")
    y = mha(Tensor(x), cu_seqlens=cu).data
    for s in range(cu.size - 1):
        if cu[s] < cu[s + 1]:
            alone = mha(Tensor(x[:, cu[s]:cu[s + 1]])).data
            np.testing.assert_allclose(y[:, cu[s]:cu[s + 1]], alone, rtol=0, atol=1e-10)
    from racecpu.autograd import check_grad
    small = _offsets([5, 0, 7])
    qs, ks, vs = (Tensor(a) for a in _inputs(rng, (1, 2), (1, 2), 12, 4, 3)[:3])
    Ws = Tensor(racecpu.hyperplanes(4, 2, 2, seed=6, dtype=np.float64), requires_grad=True)
    check_grad(lambda q, k, v, W, b: F.race_attention_bucket_mean(q, k, v, W, b, causal=True, cu_seqlens=small),
               qs, ks, vs, Ws, Tensor(np.array([0.8, 2.0])))
    with pytest.raises(NotImplementedError, match="cu_seqlens"):
        MultiHeadAttention(12, 2, causal=True, attention="softmax")(Tensor(x), cu_seqlens=cu)


def test_torch_and_jax_ops_take_packed_sequences(rng):
    cu = _offsets([33, 70, 0, 25])
    n = int(cu[-1])
    q, k, v, g = _inputs(rng, (2,), (2,), n, 8, 4)
    W = racecpu.hyperplanes(8, 3, 3, seed=0, dtype=np.float64)
    want = _separate(q, k, v, W, 3.0, g, cu, True)
    torch = pytest.importorskip("torch")
    import racecpu.torch as rt
    ts = [torch.tensor(x, requires_grad=True) for x in (q, k, v, W)]
    beta = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    out = rt.race_attention(*ts[:3], ts[3], beta, causal=True, cu_seqlens=torch.tensor(cu))
    out.backward(torch.tensor(g))
    _check((out.detach().numpy(), ts[0].grad.numpy(), ts[1].grad.numpy(), ts[2].grad.numpy(), beta.grad.item(),
            ts[3].grad.numpy()), want)
    jax = pytest.importorskip("jax")
    import racecpu.jax as rj
    jax.config.update("jax_enable_x64", True)
    try:
        f = lambda q, k, v, W, b: (rj.race_attention(q, k, v, W, b, causal=True, learn_planes=True,  # noqa: E731
                                                     cu_seqlens=cu) * g).sum()
        grads = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))(q, k, v, W, 3.0)
        y = rj.race_attention(q, k, v, W, 3.0, causal=True, cu_seqlens=cu)
        _check((np.asarray(y),) + tuple(np.asarray(x) for x in (grads[0], grads[1], grads[2], grads[4], grads[3])),
               want)
    finally:
        jax.config.update("jax_enable_x64", False)

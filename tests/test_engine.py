"""The middle of the house: the plan, the backend contract, the estimator seam, and the engine as
the one road from every frontend to the kernels."""

import numpy as np
import pytest

import racecpu
from racecpu import backend, bucket_mean, config, engine, plan
from racecpu import reference as ref
from racecpu.packing import packed_chunks, padded_layout

from .util import fd_check, rel_err


def _plan(**kw):
    args = dict(G=4, group=1, nq=5000, nk=5000, d=16, dv=16, L=3, P=3, causal=True)
    args.update(kw)
    return plan.make_plan(**args)


# ---------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------

def test_plan_chunks_as_the_chunk_model_says(monkeypatch):
    monkeypatch.setattr(config, "CHUNK", 1024)
    p = _plan()
    assert (p.chunk, p.task, p.ncq, p.nck, p.Gk, p.F, p.LP) == (1024, 1024, 5, 5, 4, 24, 9)
    # non-causal: the keys' sketch runs in tasks of up to SKETCH_CHUNKS chunks (sized for TASK_THREADS threads)
    long = _plan(causal=False, G=64, nq=2 ** 16, nk=2 ** 16)
    assert long.task == plan.sketch_task_length(long.chunk, 2 ** 16, 64) == config.SKETCH_CHUNKS * long.chunk
    assert long.nck_task == -(-2 ** 16 // long.task) and long.segments == 1
    # a backend's own model: whole tiles, its own budget, packed sequences padded
    gpu = plan.ChunkModel(base=1000, budget=2 ** 30, multiple=64, padded=True)
    assert gpu.length(5000, 4, 24, 16) == 1024
    cu = np.array([0, 100, 100, 3000, 5000])
    pc = _plan(model=gpu, cu_seqlens=cu)
    want = padded_layout(cu, 5000, min_chunk=64, max_chunk=1000, multiple=64, causal=True)
    assert (pc.packing.chunk, pc.packing.padded) == (want.chunk, want.padded)
    np.testing.assert_array_equal(pc.packing.seq, want.seq)
    assert pc.chunk == want.chunk and pc.ncq == want.seq.size
    # the CPU's packed chunks: every sequence from its own first token
    pk = _plan(cu_seqlens=cu, causal=False)
    assert pk.task == pk.chunk == 1024 and pk.nck == packed_chunks(cu, 5000, 1024).chunks.seq.size
    with pytest.raises(ValueError, match="cu_seqlens packs q, k and v alike"):
        _plan(nk=4000, cu_seqlens=cu)
    # the float64 partials' budget makes chunks longer
    monkeypatch.setattr(config, "PARTIAL_BUDGET", 4 * 24 * 17 * 8 * 2)  # two chunks' partials
    assert _plan().chunk == 2500


@pytest.mark.parametrize("seg, nc, route", [(1, 5, "one-pass"), (2, 5, "split"), (2, 2, "segments"),
                                            (3, 5, "segments"), (5, 5, "segments")])
def test_plan_picks_the_causal_backward_route(monkeypatch, seg, nc, route):
    monkeypatch.setattr(config, "CHUNK", 1000)
    monkeypatch.setattr(plan, "scan_segments", lambda G, nck, n: seg)
    p = _plan(nq=1000 * nc, nk=1000 * nc)
    assert (p.segments, p.route) == (seg, route)
    assert (_plan(causal=False).segments, _plan(causal=False).route) == (1, "segments")


def test_a_backward_keeps_the_forwards_chunks_and_takes_its_own_route(monkeypatch):
    monkeypatch.setattr(config, "CHUNK", 1000)
    monkeypatch.setattr(plan, "scan_segments", lambda G, nck, n: 1)
    p = _plan(cu_seqlens=np.array([0, 2500, 5000]))
    monkeypatch.setattr(config, "CHUNK", 64)  # a later call would chunk otherwise: the backward does not
    monkeypatch.setattr(plan, "scan_segments", lambda G, nck, n: 2)
    b = p.rescheduled()
    assert (b.chunk, b.packing, b.nck) == (p.chunk, p.packing, p.nck)
    assert (p.route, b.route, b.segments) == ("one-pass", "split", 2)


# ---------------------------------------------------------------------------
# the backend contract
# ---------------------------------------------------------------------------

class _DeviceArray:
    """Stands for an array in GPU memory: it exports __cuda_array_interface__."""
    __cuda_array_interface__ = {}


def test_backend_for_goes_by_what_an_array_is():
    for x in (np.zeros((2, 3)), [[1.0, 2.0]], np.float32(1.0), np.memmap):
        assert backend.backend_for(x) is backend.CPU
    torch = pytest.importorskip("torch")
    assert backend.backend_for(torch.zeros(2, 3)) is backend.CPU
    assert backend.backend_for(torch.zeros(2, 3, requires_grad=True)) is backend.CPU
    pytest.importorskip("numba.cuda")
    from racecpu import cuda
    assert backend.backend_for(_DeviceArray()) is cuda.BACKEND


def test_residuals_record_their_backend_and_estimator(rng):
    q = rng.standard_normal((2, 20, 4))
    W = racecpu.hyperplanes(4, 2, 2)
    for estimator, cls in (("ratio", engine.Residuals), ("bucket_mean", bucket_mean.Residuals)):
        _, res = racecpu.race_attention_fwd(q, q, q, W, estimator=estimator)
        assert isinstance(res, cls) and (res.backend, res.estimator) == ("cpu", estimator)
        assert backend.backend_of(res) is backend.CPU
    with pytest.raises(TypeError, match="residuals must come from race_attention_fwd"):
        racecpu.race_attention_bwd(object(), q)
    pytest.importorskip("numba.cuda")
    from racecpu import cuda
    assert backend.backend_of(type("R", (), {"backend": "cuda"})()) is cuda.BACKEND
    # every estimator of the CPU runs on the GPU too (test_cuda.py); a wrong name is refused before
    # any device is touched, in the CPU's words
    assert cuda.ESTIMATORS == tuple(backend.ESTIMATORS)
    with pytest.raises(ValueError, match=r"estimator must be one of \('ratio', 'bucket_mean'\), got 'mean'"):
        cuda.BACKEND.forward(q, q, q, W, 2.0, estimator="mean")
    with pytest.raises(ValueError, match=r"estimator must be one of \('ratio', 'bucket_mean'\), got 'mean'"):
        racecpu.race_attention(q, q, q, W, estimator="mean")


# ---------------------------------------------------------------------------
# the estimator seam: the per-bucket mean behind the NumPy API
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_bucket_mean_through_the_api_equals_the_oracle(rng, causal):
    q, k, v, g = (rng.standard_normal((2, 3, 30, 5)) for _ in range(4))
    W = racecpu.hyperplanes(5, 3, 2, seed=1, dtype=np.float64)
    mask = rng.random((2, 3, 30)) > 0.3
    out, res = racecpu.race_attention_fwd(q, k, v, W, 1.5, causal=causal, key_mask=mask, estimator="bucket_mean")
    want, wres = ref.race_attention_bucket_mean_fwd(q, k, v, W, 1.5, causal=causal, key_mask=mask)
    assert rel_err(out, want) < 1e-12
    np.testing.assert_array_equal(racecpu.race_attention(q, k, v, W, 1.5, causal=causal, key_mask=mask,
                                                         estimator="bucket_mean"), out)
    for a, b in zip(racecpu.race_attention_bwd(res, g), ref.race_attention_bucket_mean_bwd(wres, g)):
        assert rel_err(a, b) < 1e-11
    # and its gradients are those of its own forward
    small = [x[:1, :1, :6] for x in (q, k, v, g, mask)]

    def f(q, k, v):
        return racecpu.race_attention(q, k, v, W, 1.5, causal=causal, key_mask=small[4], estimator="bucket_mean")
    _, res = racecpu.race_attention_fwd(*small[:3], W, 1.5, causal=causal, key_mask=small[4], estimator="bucket_mean")
    fd_check(f, small[:3], small[3], racecpu.race_attention_bwd(res, small[3])[:3], rtol=1e-5)


def test_bucket_mean_takes_grouped_heads_16_bit_inputs_and_out_buffers(rng):
    q, g = rng.standard_normal((2, 6, 24, 4)), rng.standard_normal((2, 6, 24, 3))
    k, v = rng.standard_normal((2, 2, 24, 4)), rng.standard_normal((2, 2, 24, 3))
    W = racecpu.hyperplanes(4, 2, 2, dtype=np.float64)
    rep = (lambda x: np.repeat(x, 3, axis=1))
    out, res = racecpu.race_attention_fwd(q, k, v, W, causal=True, estimator="bucket_mean")
    want, wres = racecpu.race_attention_fwd(q, rep(k), rep(v), W, causal=True, estimator="bucket_mean")
    np.testing.assert_array_equal(out, want)
    dq, dk, dv, db = racecpu.race_attention_bwd(res, g)
    wq, wk, wv, wb = racecpu.race_attention_bwd(wres, g)
    np.testing.assert_array_equal(dq, wq)
    for a, b in ((dk, wk), (dv, wv)):  # a key/value head's gradient sums its query heads'
        assert rel_err(a, b.reshape(2, 2, 3, 24, -1).sum(2)) < 1e-13
    assert db == pytest.approx(wb, rel=1e-12)
    half = [x.astype(np.float16) for x in (q, k, v)]
    o16, r16 = racecpu.race_attention_fwd(*half, W.astype(np.float32), estimator="bucket_mean")
    o32 = racecpu.race_attention(*(x.astype(np.float32) for x in half), W.astype(np.float32),
                                 estimator="bucket_mean")
    assert o16.dtype == np.float16 and rel_err(o16, o32) < 1e-3
    assert [x.dtype for x in racecpu.race_attention_bwd(r16, g.astype(np.float16))[:3]] == [np.float16] * 3
    buf = np.empty_like(out)
    assert racecpu.race_attention(q, k, v, W, causal=True, out=buf, estimator="bucket_mean") is buf
    np.testing.assert_array_equal(buf, out)
    bufs = tuple(np.empty_like(x) for x in (q, k, v))
    got = racecpu.race_attention_bwd(res, g, out=bufs)
    assert all(a is b for a, b in zip(got, bufs))
    att = racecpu.RaceAttention(4, 2, 2, estimator="bucket_mean")
    assert "bucket_mean" in repr(att) and att.fwd(q, k, v)[1].estimator == "bucket_mean"


def test_bucket_mean_says_what_it_cannot_do(rng):
    q = rng.standard_normal((1, 16, 4))
    W = racecpu.hyperplanes(4, 2, 2)
    with pytest.raises(ValueError, match="estimator must be one of"):
        racecpu.race_attention(q, q, q, W, estimator="mean")
    with pytest.raises(ValueError, match="estimator must be one of"):
        racecpu.RaceAttention(4, estimator=None)
    with pytest.raises(ValueError, match="cu_seqlens must run from 0 to the sequence length 16"):
        racecpu.race_attention(q, q, q, W, cu_seqlens=[0, 8, 15], estimator="bucket_mean")
    with pytest.raises(ValueError, match="same sequence length, got 16 and 12"):
        racecpu.race_attention(q, q[:, :12], q[:, :12], W, cu_seqlens=[0, 8, 16], estimator="bucket_mean")
    _, res = racecpu.race_attention_fwd(q, q, q, W, estimator="bucket_mean")
    with pytest.raises(ValueError, match="grad_out must have the output's shape"):
        racecpu.race_attention_bwd(res, q[:, :3])
    bad = q.copy()
    bad[0, 3, 1] = np.nan
    with pytest.raises(ValueError, match="q contains NaN"):
        racecpu.race_attention(bad, q, q, W, estimator="bucket_mean")
    with pytest.raises(ValueError, match="grad_out contains NaN"):
        racecpu.race_attention_bwd(res, bad)


def test_torch_op_takes_the_estimator(rng):
    torch = pytest.importorskip("torch")
    import racecpu.torch as rt
    q, k, v = (torch.tensor(rng.standard_normal((2, 3, 20, 4)), requires_grad=True) for _ in range(3))
    W = racecpu.hyperplanes(4, 2, 2, dtype=np.float64)
    out = rt.race_attention(q, k, v, W, 2.0, causal=True, estimator="bucket_mean")
    out.sum().backward()
    want, res = racecpu.race_attention_fwd(*(x.detach().numpy() for x in (q, k, v)), W, 2.0, causal=True,
                                           estimator="bucket_mean")
    np.testing.assert_array_equal(out.detach().numpy(), want)
    np.testing.assert_array_equal(q.grad.numpy(), racecpu.race_attention_bwd(res, np.ones_like(want))[0])
    assert "bucket_mean" in repr(rt.RaceAttention(4, estimator="bucket_mean"))


# ---------------------------------------------------------------------------
# every frontend reaches the kernels through the engine
# ---------------------------------------------------------------------------

def _spy(monkeypatch, name):
    calls = []
    real = getattr(engine, name)

    def spy(*args, **kw):
        calls.append(name)
        return real(*args, **kw)
    monkeypatch.setattr(engine, name, spy)
    return calls


def test_streaming_sketches_and_out_of_core_call_the_engines_blocks(rng, monkeypatch):
    from racecpu import outofcore, sketches
    from racecpu.streaming import RaceState
    q, k, v = (rng.standard_normal((2, 40, 4)).astype(np.float32) for _ in range(3))
    W = racecpu.hyperplanes(4, 2, 2)
    calls = _spy(monkeypatch, "advance")
    st = RaceState(W, 2.0, batch_shape=(2,), dv=4)
    st.extend(q[:, :30], k[:, :30], v[:, :30])
    st.step(q[:, 30], k[:, 30], v[:, 30])  # one token: the same engine function, its buffers reused
    sketches.causal_block(q, k, v, W, 2.0)
    outofcore.race_attention_fwd_ooc(q, k, v, W, 2.0, causal=True, out=np.zeros_like(v), block=16, progress=False)
    assert calls == ["advance"] * (3 + 3)
    sketched, read = _spy(monkeypatch, "sketch_keys"), _spy(monkeypatch, "readout")
    sketches.readout(q, sketches.sketch(k, v, W, 2.0))
    outofcore.race_attention_fwd_ooc(q, k, v, W, 2.0, out=np.zeros_like(v), block=16, progress=False)
    assert (len(sketched), len(read)) == (1 + 3, 1 + 3)


def test_one_token_steps_equal_one_causal_call_and_reuse_their_buffers(rng):
    from racecpu.streaming import RaceState
    q, k, v = (rng.standard_normal((3, 50, 8)) for _ in range(3))
    W = racecpu.hyperplanes(8, 3, 2, dtype=np.float64)
    st = RaceState(W, 2.0, batch_shape=(3,), dv=8, dtype=np.float64)
    outs = np.stack([st.step(q[:, i], k[:, i], v[:, i]) for i in range(50)], axis=1)
    assert rel_err(outs, racecpu.race_attention(q, k, v, W, 2.0, causal=True)) < 1e-13
    work = st._work  # the workspace the engine took its buffers from, one per name
    before = {name: buf.ctypes.data for name, buf in work._store.items()}
    st.step(q[:, 0], k[:, 0], v[:, 0])
    assert {name: buf.ctypes.data for name, buf in work._store.items()} == before


def test_set_state_continues_a_stream(rng):
    from racecpu.streaming import RaceState
    q, k, v = (rng.standard_normal((2, 30, 4)) for _ in range(3))
    W = racecpu.hyperplanes(4, 2, 2, dtype=np.float64)
    a = RaceState(W, 2.0, batch_shape=(2,), dv=4, dtype=np.float64)
    a.extend(q[:, :20], k[:, :20], v[:, :20])
    b = RaceState(W, 2.0, batch_shape=(2,), dv=4, dtype=np.float64)
    A, B = a.A, a.B
    b.set_state(A, B, count=20)
    A[...] = 0  # b keeps copies
    assert b.count == 20
    np.testing.assert_array_equal(b.extend(q[:, 20:], k[:, 20:], v[:, 20:]), a.extend(q[:, 20:], k[:, 20:], v[:, 20:]))
    with pytest.raises(ValueError, match="the state needs A of shape"):
        b.set_state(A[:1], B)
    with pytest.raises(ValueError, match="count must be an int >= 0"):
        b.set_state(a.A, a.B, count=-1)

"""The planes' gradient (``race_attention_bwd(..., dplanes=True)``): finite differences,
the dense reference, thread counts, and the backward without it."""

import numba
import numpy as np
import pytest

import racecpu
from racecpu import config
from racecpu import reference as ref

from .util import fd_grad, rel_err

SHAPES = [  # lead, n, d, dv, P, L
    ((2,), 19, 5, 3, 2, 2),
    ((1,), 13, 4, 2, 1, 3),   # P = 1
    ((2,), 11, 3, 4, 3, 1),   # L = 1
    ((), 9, 4, 3, 1, 1),      # P = L = 1, no leading axis
]


def make(rng, lead, n, d, dv, P, L, dtype=np.float64):
    q, k = (rng.standard_normal(lead + (n, d)).astype(dtype) for _ in range(2))
    v = rng.standard_normal(lead + (n, dv)).astype(dtype)
    W = rng.standard_normal((L, P, d)).astype(dtype)
    mask = rng.random(lead + (n,)) > 0.25
    return q, k, v, W, mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_dplanes_matches_finite_differences(rng, monkeypatch, shape, causal):
    monkeypatch.setattr(config, "CHUNK", 7)  # several chunks: the per-chunk shares and their sum
    lead, n, d, dv, P, L = shape
    q, k, v, W, mask = make(rng, lead, n, d, dv, P, L)
    beta = 1.5
    out, res = racecpu.race_attention_fwd(q, k, v, W, beta, causal=causal, key_mask=mask)
    g = rng.standard_normal(out.shape)
    *_, dW = racecpu.race_attention_bwd(res, g, dplanes=True)
    assert dW.shape == W.shape and dW.dtype == np.float64

    def f(Wx):
        return racecpu.race_attention(q, k, v, Wx, beta, causal=causal, key_mask=mask)
    num = fd_grad(f, (W,), 0, g)
    assert rel_err(dW, num) < 1e-7


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_dplanes_matches_dense_reference(rng, monkeypatch, shape, causal):
    monkeypatch.setattr(config, "CHUNK", 5)
    lead, n, d, dv, P, L = shape
    q, k, v, W, mask = make(rng, lead, n, d, dv, P, L)
    out, res = racecpu.race_attention_fwd(q, k, v, W, 2.0, causal=causal, key_mask=mask)
    _, wres = ref.race_attention_dense_fwd(q, k, v, W, 2.0, causal=causal, key_mask=mask)
    g = rng.standard_normal(out.shape)
    got = racecpu.race_attention_bwd(res, g, dplanes=True)
    want = ref.race_attention_dense_bwd(wres, g, dplanes=True)
    assert len(got) == len(want) == 5
    for name, a, b in zip(("dq", "dk", "dv", "dbeta", "dplanes"), got, want):
        assert rel_err(a, b, floor=1e-3) < 1e-10, name


@pytest.mark.parametrize("causal", [False, True])
def test_dense_reference_dplanes_matches_finite_differences(rng, causal):
    q, k, v, W, mask = make(rng, (2,), 6, 3, 2, 2, 2)
    out, wres = ref.race_attention_dense_fwd(q, k, v, W, 1.3, causal=causal, key_mask=mask)
    g = rng.standard_normal(out.shape)
    dW = ref.race_attention_dense_bwd(wres, g, dplanes=True)[4]
    num = fd_grad(lambda Wx: ref.race_attention_dense(q, k, v, Wx, 1.3, causal=causal, key_mask=mask), (W,), 0, g)
    assert rel_err(dW, num) < 1e-7


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_dplanes_same_bits_at_any_thread_count(rng, monkeypatch, causal, dtype):
    monkeypatch.setattr(config, "CHUNK", 16)  # several chunks, so that routes and task orders differ
    q, k, v, W, mask = make(rng, (3,), 150, 8, 8, 3, 3, dtype)
    out, res = racecpu.race_attention_fwd(q, k, v, W, 2.0, causal=causal, key_mask=mask)
    g = rng.standard_normal(out.shape).astype(dtype)
    results = []
    for threads in sorted({1, 2, numba.config.NUMBA_NUM_THREADS}):
        numba.set_num_threads(threads)
        try:
            results.append(racecpu.race_attention_bwd(res, g, dplanes=True))
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("causal", [False, True])
def test_without_dplanes_the_old_four_gradients(rng, monkeypatch, causal):
    monkeypatch.setattr(config, "CHUNK", 7)
    q, k, v, W, mask = make(rng, (2,), 19, 5, 3, 2, 2, np.float32)
    out, res = racecpu.race_attention_fwd(q, k, v, W.astype(np.float64), 1.5, causal=causal, key_mask=mask)
    g = rng.standard_normal(out.shape).astype(np.float32)
    old = racecpu.race_attention_bwd(res, g)
    new = racecpu.race_attention_bwd(res, g, dplanes=True)
    assert len(old) == 4 and len(new) == 5
    for a, b in zip(old, new[:4]):
        np.testing.assert_array_equal(a, b)
    # the planes' own dtype (float64) though the kernels compute in float32
    assert new[4].dtype == np.float64 and new[4].shape == W.shape
    _, wres = ref.race_attention_dense_fwd(q, k, v, W, 1.5, causal=causal, key_mask=mask)
    assert rel_err(new[4], ref.race_attention_dense_bwd(wres, g, dplanes=True)[4]) < 1e-4


def test_dplanes_without_queries_or_keys_is_zero(rng):
    q, k, v, W, _ = make(rng, (2,), 0, 4, 3, 2, 2)
    out, res = racecpu.race_attention_fwd(q, k, v, W, 1.5)
    *_, dW = racecpu.race_attention_bwd(res, np.zeros(out.shape), dplanes=True)
    assert dW.shape == W.shape and not dW.any()


# ---------------------------------------------------------------------------
# autograd: planes as a Tensor, learn_planes=True
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_autograd_planes_tensor_gets_its_gradient(rng, causal, per_head):
    from racecpu.autograd import Tensor
    from racecpu.autograd import functional as F
    q, k, v, W, mask = make(rng, (1, 2), 9, 4, 3, 2, 2)
    beta = Tensor(np.array([1.3, 1.7]), requires_grad=True) if per_head else Tensor(np.array(1.5), requires_grad=True)
    ts = [Tensor(x, requires_grad=True) for x in (q, k, v, W)]
    assert F.check_grad(lambda q_, k_, v_, W_: F.race_attention(q_, k_, v_, W_, beta, causal=causal, key_mask=mask),
                        *ts) < 1e-6
    # a constant Tensor (or array) of planes: no gradient asked for, none given
    Wc = Tensor(W)
    F.race_attention(ts[0], ts[1], ts[2], Wc, 1.5, causal=causal).sum().backward()
    assert Wc.grad is None


@pytest.mark.parametrize("causal", [False, True])
def test_learn_planes_train_step_changes_the_planes(causal):
    from racecpu.autograd import nn
    from racecpu.autograd.optim import AdamW
    m = nn.MultiHeadAttention(8, 2, causal=causal, num_planes=2, num_tables=2, learn_planes=True, seed=1)
    assert isinstance(m.planes, nn.Parameter) and any(p is m.planes for p in m.parameters())
    assert "planes" in m.state_dict()
    before = m.planes.data.copy()
    x = np.random.default_rng(0).standard_normal((2, 12, 8)).astype(np.float32)
    opt = AdamW(m.parameters(), lr=1e-2)
    (m(x) ** 2).sum().backward()
    assert m.planes.grad is not None and m.planes.grad.shape == before.shape and np.abs(m.planes.grad).max() > 0
    opt.step()
    assert not np.array_equal(m.planes.data, before)
    fixed = nn.MultiHeadAttention(8, 2, causal=causal, num_planes=2, num_tables=2, seed=1)
    assert not isinstance(fixed.planes, nn.Parameter)
    fixed.load_state_dict(m.state_dict())  # the same names either way
    with pytest.raises(ValueError, match="learn_planes"):
        nn.MultiHeadAttention(8, 2, attention="softmax", learn_planes=True)

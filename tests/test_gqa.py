"""Grouped-query (and multi-query) attention: k and v with fewer heads than q.

The oracle is the same call with k and v repeated per query head (and the
gradients of the repeated heads summed back), in float64 to 1e-10.
"""

import numpy as np
import pytest

import racecpu
from racecpu.autograd import Tensor
from racecpu.autograd import functional as F
from racecpu.autograd.nn import MultiHeadAttention


def _inputs(rng, B, Hq, Hk, N, d, dv, dtype=np.float64):
    q = rng.standard_normal((B, Hq, N, d)).astype(dtype)
    k = rng.standard_normal((B, Hk, N, d)).astype(dtype)
    v = rng.standard_normal((B, Hk, N, dv)).astype(dtype)
    g = rng.standard_normal((B, Hq, N, dv)).astype(dtype)
    return q, k, v, g


def _rep(x, group):
    return np.repeat(x, group, axis=1)


def _fold(x, group):
    """Gradients of repeated heads summed back onto their key/value head."""
    return x.reshape(x.shape[:1] + (x.shape[1] // group, group) + x.shape[2:]).sum(2)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Hq,Hk", [(8, 2), (4, 1), (3, 3)])
def test_grouped_equals_repeated_kv(causal, Hq, Hk):
    rng = np.random.default_rng(Hq + Hk)
    q, k, v, g = _inputs(rng, 2, Hq, Hk, 700, 16, 8)
    mask = rng.random((2, Hk, 700)) > 0.25
    W = racecpu.hyperplanes(16, 3, 3, seed=1)
    group = Hq // Hk
    y, res = racecpu.race_attention_fwd(q, k, v, W, 2.5, causal=causal, key_mask=mask)
    y_r, res_r = racecpu.race_attention_fwd(q, _rep(k, group), _rep(v, group), W, 2.5, causal=causal,
                                            key_mask=_rep(mask, group))
    np.testing.assert_allclose(y, y_r, rtol=0, atol=1e-10)
    np.testing.assert_array_equal(racecpu.race_attention(q, k, v, W, 2.5, causal=causal, key_mask=mask), y)
    dq, dk, dv, dbeta, dW = racecpu.race_attention_bwd(res, g, dplanes=True)
    rq, rk, rv, rbeta, rW = racecpu.race_attention_bwd(res_r, g, dplanes=True)
    assert dk.shape == k.shape and dv.shape == v.shape and dq.shape == q.shape
    np.testing.assert_allclose(dq, rq, rtol=0, atol=1e-10)
    np.testing.assert_allclose(dk, _fold(rk, group), rtol=0, atol=1e-10)
    np.testing.assert_allclose(dv, _fold(rv, group), rtol=0, atol=1e-10)
    assert dbeta == pytest.approx(rbeta, rel=1e-10, abs=1e-10)
    np.testing.assert_allclose(dW, rW, rtol=1e-10, atol=1e-10)


def test_grouped_finite_differences_of_dk():
    """dk of a shared key/value head is the derivative of the whole group's output."""
    rng = np.random.default_rng(5)
    q, k, v, g = _inputs(rng, 1, 4, 2, 40, 6, 3)
    W = racecpu.hyperplanes(6, 2, 3, seed=0)
    _, res = racecpu.race_attention_fwd(q, k, v, W, 1.5)
    dk = racecpu.race_attention_bwd(res, g)[1]
    eps = 1e-6
    for idx in [(0, 0, 3, 1), (0, 1, 17, 4), (0, 1, 39, 0)]:
        kp, km = k.copy(), k.copy()
        kp[idx] += eps
        km[idx] -= eps
        fd = (np.vdot(racecpu.race_attention(q, kp, v, W, 1.5), g)
              - np.vdot(racecpu.race_attention(q, km, v, W, 1.5), g)) / (2 * eps)
        assert dk[idx] == pytest.approx(fd, rel=1e-6, abs=1e-8)


def test_grouped_out_buffers_16_bit_and_errors():
    rng = np.random.default_rng(2)
    q, k, v, g = _inputs(rng, 1, 6, 2, 300, 16, 8, np.float32)
    W = racecpu.hyperplanes(16, 3, 3, seed=0)
    _, res = racecpu.race_attention_fwd(q, k, v, W, causal=True)
    bufs = (np.empty_like(q), np.empty_like(k), np.empty_like(v))
    got = racecpu.race_attention_bwd(res, g, out=bufs)
    assert all(a is b for a, b in zip(got[:3], bufs))
    for a, b in zip(got[:3], racecpu.race_attention_bwd(res, g)[:3]):
        np.testing.assert_array_equal(a, b)
    y16 = racecpu.race_attention(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), W)
    assert y16.dtype == np.float16 and y16.shape == (1, 6, 300, 8)
    with pytest.raises(ValueError, match="divides q's"):
        racecpu.race_attention(q, k[:, :1].repeat(4, axis=1), v[:, :1].repeat(4, axis=1), W)  # 6 % 4
    np.testing.assert_allclose(racecpu.race_attention(q[0], k[0, :1], v[0, :1], W),  # multi-query, no batch axis
                               racecpu.race_attention(q[0], k[0, :1].repeat(6, 0), v[0, :1].repeat(6, 0), W),
                               rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="divides q's"):
        racecpu.race_attention(q, np.concatenate([k, k]), np.concatenate([v, v]), W)  # the batch axes differ
    with pytest.raises(ValueError, match="divides q's"):
        racecpu.race_attention(q, k, v[:, :1], W)  # k and v disagree
    with pytest.raises(ValueError, match="k's leading dims"):
        racecpu.race_attention(q, k, v, W, key_mask=np.ones((1, 6, 300), bool))


@pytest.mark.parametrize("causal", [False, True])
def test_autograd_op_and_multihead_n_kv_heads(causal):
    rng = np.random.default_rng(3)
    q, k, v, g = _inputs(rng, 2, 4, 2, 50, 8, 8)
    W = racecpu.hyperplanes(8, 2, 3, seed=0)
    for beta in (Tensor(np.array(2.0), requires_grad=True), Tensor(np.array([1.0, 2.0, 3.0, 4.0]), requires_grad=True)):
        tq, tk, tv = (Tensor(x, requires_grad=True) for x in (q, k, v))
        (F.race_attention(tq, tk, tv, W, beta, causal=causal) * g).sum().backward()
        rk, rv = (Tensor(_rep(x, 2), requires_grad=True) for x in (k, v))
        rq, rbeta = Tensor(q, requires_grad=True), Tensor(beta.data.copy(), requires_grad=True)
        (F.race_attention(rq, rk, rv, W, rbeta, causal=causal) * g).sum().backward()
        np.testing.assert_allclose(tq.grad, rq.grad, atol=1e-10, rtol=0)
        np.testing.assert_allclose(tk.grad, _fold(rk.grad, 2), atol=1e-10, rtol=0)
        np.testing.assert_allclose(tv.grad, _fold(rv.grad, 2), atol=1e-10, rtol=0)
        np.testing.assert_allclose(beta.grad, rbeta.grad, rtol=1e-10, atol=1e-12)
    x = Tensor(rng.standard_normal((2, 30, 32)))
    for attention in ("race", "softmax", "linear"):
        mha = MultiHeadAttention(32, 8, n_kv_heads=2, attention=attention, causal=causal, seed=0, dtype=np.float64)
        assert mha.k.weight.shape[-1] * mha.k.weight.shape[0] == 32 * 8  # d_model x (2 heads x 4)
        out = mha(x)
        assert out.shape == (2, 30, 32)
        out.sum().backward()
        assert mha.k.weight.grad is not None and np.abs(mha.k.weight.grad).sum() > 0
    with pytest.raises(ValueError, match="n_kv_heads must divide"):
        MultiHeadAttention(32, 8, n_kv_heads=3)


def test_torch_and_jax_ops_take_grouped_kv():
    torch = pytest.importorskip("torch")
    import racecpu.torch as rt
    rng = np.random.default_rng(4)
    q, k, v, _ = _inputs(rng, 1, 4, 1, 20, 6, 5)
    W = torch.from_numpy(racecpu.hyperplanes(6, 2, 2, seed=0))
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: rt.race_attention(a, b, c, W, 1.7, causal=True), (tq, tk, tv),
                                    eps=1e-6, atol=1e-7, rtol=1e-5)


def test_jax_op_takes_grouped_kv():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    import racecpu.jax as rj
    rng = np.random.default_rng(6)
    q, k, v, g = _inputs(rng, 1, 4, 2, 30, 6, 5)
    W = racecpu.hyperplanes(6, 2, 2, seed=0)
    grads = jax.grad(lambda q, k, v: (rj.race_attention(q, k, v, W, 1.7, causal=True) * g).sum(),
                     argnums=(0, 1, 2))(q, k, v)
    _, res = racecpu.race_attention_fwd(q, k, v, W, 1.7, causal=True)
    for got, want in zip(grads, racecpu.race_attention_bwd(res, g)[:3]):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_race_state_keeps_one_state_per_kv_head(tmp_path):
    """RaceState(kv_heads=...): blocks and single tokens equal one grouped causal call;
    the state is per key/value head and survives save/load."""
    from racecpu.streaming import RaceState
    rng = np.random.default_rng(7)
    q, k, v, _ = _inputs(rng, 2, 6, 2, 90, 8, 5)
    W = racecpu.hyperplanes(8, 3, 3, seed=0)
    want = racecpu.race_attention(q, k, v, W, 2.0, causal=True)
    st = RaceState(W, 2.0, batch_shape=(2, 6), dv=5, dtype=np.float64, kv_heads=2)
    assert st.kv_batch_shape == (2, 2) and st.A.shape[:2] == (2, 2) and "kv_heads=2" in repr(st)
    outs = [st.extend(q[:, :, :40], k[:, :, :40], v[:, :, :40])]
    for i in range(40, 50):
        outs.append(st.step(q[:, :, i], k[:, :, i], v[:, :, i])[:, :, None])
    st.save(tmp_path / "s.npz")
    st2 = RaceState.load(tmp_path / "s.npz", planes=W, beta=2.0)
    assert st2.kv_batch_shape == (2, 2) and st2.count == 50
    outs.append(st2.extend(q[:, :, 50:], k[:, :, 50:], v[:, :, 50:]))
    np.testing.assert_allclose(np.concatenate(outs, axis=2), want, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="kv_batch_shape"):
        st2.extend(q[:, :, :3], np.repeat(k[:, :, :3], 3, axis=1), np.repeat(v[:, :, :3], 3, axis=1))
    with pytest.raises(ValueError, match="kv_heads must divide"):
        RaceState(W, 2.0, batch_shape=(2, 6), dv=5, kv_heads=4)


"""racecpu.autograd: every op against central finite differences (float64), and the engine itself."""

import numpy as np
import pytest

import racecpu
from racecpu import reference
from racecpu.autograd import Tensor, check_grad, no_grad
from racecpu.autograd import functional as F
from racecpu.autograd.tensor import op


def rand(*shape, seed=0, positive=False):
    x = np.random.default_rng(seed).standard_normal(shape)
    return Tensor(np.abs(x) + 0.5 if positive else x)


# ---------------------------------------------------------------------------
# elementwise, broadcasting, reductions, shapes
# ---------------------------------------------------------------------------

BINARY = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "radd_scalar": lambda a, b: 2.0 + a * b,
    "rsub_scalar": lambda a, b: 1.0 - a * b,
    "rdiv_scalar": lambda a, b: 3.0 / b + a,
}


@pytest.mark.parametrize("name", sorted(BINARY))
@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((3, 1), (1, 4)), ((2, 1, 4), (3, 1))])
def test_binary_broadcasting(name, shapes):
    a = rand(*shapes[0], seed=1)
    b = rand(*shapes[1], seed=2, positive=True)
    check_grad(BINARY[name], a, b)


@pytest.mark.parametrize("shapes", [((3, 4), (4, 2)), ((2, 3, 4), (4, 5)), ((2, 3, 4), (2, 4, 5)),
                                    ((1, 3, 4), (2, 4, 2)), ((2, 1, 3, 4), (3, 4, 2))])
def test_matmul(shapes):
    check_grad(lambda a, b: a @ b, rand(*shapes[0], seed=1), rand(*shapes[1], seed=2))


def test_matmul_with_ndarray_and_rejects_vectors():
    a, w = rand(3, 4), np.random.default_rng(1).standard_normal((4, 2))
    check_grad(lambda a: a @ w, a)
    check_grad(lambda a: w.T @ a.T, a)
    with pytest.raises(ValueError, match="ndim >= 2"):
        a @ np.ones(4)


@pytest.mark.parametrize("p", [2, 3, 0.5, -1.5])
def test_pow(p):
    check_grad(lambda a: a ** p, rand(3, 4, positive=True))


def test_pow_rejects_tensor_exponent():
    with pytest.raises(TypeError, match="exponent"):
        rand(2) ** rand(2)


@pytest.mark.parametrize("fn", ["exp", "tanh", "sigmoid", "silu", "relu", "elu", "gelu", "neg"])
def test_unary(fn):
    x = rand(4, 5)
    x.data[np.abs(x.data) < 1e-3] = 0.1  # keep relu/elu away from the kink
    f = (lambda a: -a) if fn == "neg" else (lambda a: getattr(a, fn)())
    check_grad(f, x)


def test_log():
    check_grad(lambda a: a.log(), rand(3, 4, positive=True))


def test_unary_values():
    x = np.linspace(-6, 6, 101)
    t = Tensor(x)
    np.testing.assert_allclose(t.sigmoid().data, 1 / (1 + np.exp(-x)), rtol=1e-12)
    np.testing.assert_allclose(t.relu().data, np.maximum(x, 0))
    np.testing.assert_allclose(t.elu().data, np.where(x > 0, x, np.expm1(x)), atol=1e-15)
    from scipy.special import erf
    np.testing.assert_allclose(t.gelu().data, 0.5 * x * (1 + erf(x / np.sqrt(2))), atol=1e-3)
    np.testing.assert_allclose(t.silu().data, x / (1 + np.exp(-x)), rtol=1e-12, atol=1e-15)
    big = Tensor(np.array([-1000.0, 1000.0], dtype=np.float32)).sigmoid().data
    assert np.isfinite(big).all() and big.dtype == np.float32
    big = Tensor(np.array([-1000.0, 1000.0], dtype=np.float32)).silu().data
    np.testing.assert_array_equal(big, [0, 1000])
    assert big.dtype == np.float32


@pytest.mark.parametrize("axis,keepdims", [(None, False), (0, False), (1, True), ((0, 2), False), (-1, True)])
def test_sum_mean(axis, keepdims):
    x = rand(2, 3, 4)
    check_grad(lambda a: a.sum(axis=axis, keepdims=keepdims), x)
    check_grad(lambda a: a.mean(axis=axis, keepdims=keepdims), x)
    np.testing.assert_allclose(x.mean(axis=axis, keepdims=keepdims).data, x.data.mean(axis=axis, keepdims=keepdims))


def test_reshape_transpose_swapaxes():
    x = rand(2, 3, 4)
    check_grad(lambda a: a.reshape(6, 4) * 2.0, x)
    check_grad(lambda a: a.reshape((4, 6)), x)
    check_grad(lambda a: a.transpose(2, 0, 1), x)
    check_grad(lambda a: a.transpose(), x)
    check_grad(lambda a: a.T, x)
    check_grad(lambda a: a.swapaxes(0, 2), x)


@pytest.mark.parametrize("idx", [np.s_[1], np.s_[:, 1:3], np.s_[..., ::2], np.s_[None, 0, 1:],
                                 (np.array([0, 1, 0]),), (np.array([2, 0, 2, 2]), slice(None))])
def test_getitem(idx):
    """Basic and fancy indexing; repeated fancy indices must accumulate."""
    check_grad(lambda a: a[idx], rand(3, 4))


def test_getitem_repeated_index_accumulates():
    x = Tensor(np.arange(3.0), requires_grad=True)
    x[np.array([1, 1, 2])].sum().backward()
    np.testing.assert_array_equal(x.grad, [0, 2, 1])


# ---------------------------------------------------------------------------
# normalisations, embedding, losses, dropout
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("axis", [-1, 0])
def test_softmax_log_softmax(axis):
    x = rand(3, 5)
    check_grad(lambda a: F.softmax(a, axis), x)
    check_grad(lambda a: F.log_softmax(a, axis), x)
    e = np.exp(x.data)
    np.testing.assert_allclose(F.softmax(x, axis).data, e / e.sum(axis, keepdims=True), rtol=1e-12)
    np.testing.assert_allclose(F.log_softmax(Tensor(x.data + 1000), axis).data,
                               np.log(e / e.sum(axis, keepdims=True)), rtol=1e-10)


def test_layer_norm():
    x, w, b = rand(2, 3, 6, seed=1), rand(6, seed=2), rand(6, seed=3)
    check_grad(lambda x, w, b: F.layer_norm(x, w, b), x, w, b)
    check_grad(lambda x: F.layer_norm(x), x)
    y = F.layer_norm(x).data
    np.testing.assert_allclose(y.mean(-1), 0, atol=1e-12)
    np.testing.assert_allclose(y.var(-1), 1, rtol=1e-4)


def test_embedding_repeated_indices():
    idx = np.array([[0, 2, 2], [3, 0, 2]])
    check_grad(lambda w: F.embedding(w, idx), rand(4, 3))
    w = Tensor(np.zeros((4, 2)), requires_grad=True)
    F.embedding(w, idx).sum().backward()
    np.testing.assert_array_equal(w.grad[:, 0], [2, 0, 3, 1])
    with pytest.raises(ValueError, match="indices must lie"):
        F.embedding(w, np.array([4]))
    with pytest.raises(TypeError, match="integer"):
        F.embedding(w, np.array([0.0]))


def test_cross_entropy():
    logits = rand(2, 3, 5)
    t = np.array([[1, 4, -100], [0, -100, 2]])
    check_grad(lambda z: F.cross_entropy(z, t), logits)
    z = logits.data.reshape(-1, 5)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    tt = t.ravel()
    keep = tt != -100
    expected = -logp[np.arange(6)[keep], tt[keep]].mean()
    np.testing.assert_allclose(F.cross_entropy(logits, t).data, expected, rtol=1e-12)
    with pytest.raises(ValueError, match="targets must have shape"):
        F.cross_entropy(logits, t[0])
    with pytest.raises(ValueError, match="targets must lie"):
        F.cross_entropy(logits, np.full((2, 3), 5))


@pytest.mark.parametrize("K", [1, 3, 8])
def test_causal_conv1d(K):
    """Against a direct loop (K=8 is longer than the sequence) and finite differences."""
    x, w = rand(2, 6, 3, seed=1), rand(K, 3, seed=2)
    want = np.zeros_like(x.data)
    for t in range(6):
        for i in range(min(K, t + 1)):
            want[:, t] += w.data[i] * x.data[:, t - i]
    np.testing.assert_allclose(F.causal_conv1d(x, w).data, want, rtol=1e-12, atol=1e-12)
    check_grad(F.causal_conv1d, x, w)
    with pytest.raises(ValueError, match="weight must have shape"):
        F.causal_conv1d(x, rand(3, 4))


def test_dropout_seeded():
    x = rand(50, 40)
    y1 = F.dropout(x, 0.3, np.random.default_rng(7)).data
    y2 = F.dropout(x, 0.3, np.random.default_rng(7)).data
    np.testing.assert_array_equal(y1, y2)
    kept = y1 != 0
    assert 0.6 < kept.mean() < 0.8
    np.testing.assert_allclose(y1[kept], x.data[kept] / 0.7)
    assert F.dropout(x, 0.3, np.random.default_rng(0), training=False) is x
    check_grad(lambda a: F.dropout(a, 0.5, np.random.default_rng(3)), rand(4, 5))
    with pytest.raises(ValueError, match="dropout probability"):
        F.dropout(x, 1.0, np.random.default_rng(0))


# ---------------------------------------------------------------------------
# attention ops
# ---------------------------------------------------------------------------

def qkv(nq=5, nk=5, d=4, dv=3, lead=(2,), seed=0):
    return rand(*lead, nq, d, seed=seed), rand(*lead, nk, d, seed=seed + 1), rand(*lead, nk, dv, seed=seed + 2)


@pytest.mark.parametrize("causal", [False, True])
def test_race_attention_grad(causal):
    q, k, v = qkv()
    planes = racecpu.hyperplanes(4, 3, 2, seed=3, dtype=np.float64)
    beta = Tensor(np.array(1.5))
    check_grad(lambda q, k, v, b: F.race_attention(q, k, v, planes, b, causal=causal), q, k, v, beta, atol=1e-6)
    check_grad(lambda q, k, v: F.race_attention(q, k, v, planes, 2.0, causal=causal), q, k, v)


def test_race_attention_key_mask_and_cross_lengths():
    q, k, v = qkv(nq=3, nk=6)
    mask = np.array([[True, False, True, True, False, True], [False, True, True, True, True, True]])
    planes = racecpu.hyperplanes(4, 2, 3, seed=1, dtype=np.float64)
    check_grad(lambda q, k, v: F.race_attention(q, k, v, planes, 1.0, key_mask=mask), q, k, v)
    out = F.race_attention(q, k, v, planes, 1.0, key_mask=mask).data
    np.testing.assert_allclose(out, reference.race_attention_dense(q.data, k.data, v.data, planes, 1.0,
                                                                    key_mask=mask), rtol=1e-10)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_race_attention_matches_library_backward(dtype, causal):
    """Through autograd (with beta a Tensor) the gradients are exactly race_attention_bwd's."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 3, 9, 8)).astype(dtype) for _ in range(3))
    g = rng.standard_normal((2, 3, 9, 8)).astype(dtype)
    planes = racecpu.hyperplanes(8, seed=2, dtype=dtype)
    out_ref, res = racecpu.race_attention_fwd(q, k, v, planes, 4.0, causal=causal)
    dq, dk, dv, dbeta = racecpu.race_attention_bwd(res, g)
    tq, tk, tv = (Tensor(a, requires_grad=True) for a in (q, k, v))
    beta = Tensor(np.array(4.0, dtype), requires_grad=True)
    out = F.race_attention(tq, tk, tv, planes, beta, causal=causal)
    np.testing.assert_array_equal(out.data, out_ref)
    out.backward(g)
    for got, want in ((tq.grad, dq), (tk.grad, dk), (tv.grad, dv)):
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(beta.grad, dbeta, rtol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_race_attention_per_head_beta(causal):
    """beta of shape (H,): each head equals a scalar-beta call with its own beta; gradients check."""
    q, k, v = qkv(lead=(2, 3))
    planes = racecpu.hyperplanes(4, 2, 2, seed=4, dtype=np.float64)
    beta = Tensor(np.array([0.7, 1.5, 3.0]))
    out = F.race_attention(q, k, v, planes, beta, causal=causal).data
    for h, b in enumerate(beta.data):
        np.testing.assert_array_equal(out[:, h], F.race_attention(q[:, h], k[:, h], v[:, h], planes, float(b),
                                                                  causal=causal).data)
    check_grad(lambda q, k, v, b: F.race_attention(q, k, v, planes, b, causal=causal), q, k, v, beta)


def test_race_attention_beta_must_be_scalar():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="scalar"):
        F.race_attention(q, k, v, racecpu.hyperplanes(4, dtype=np.float64), Tensor(np.ones(2)))
    with pytest.raises(ValueError, match="scalar"):  # (H,) must match q's head axis
        F.race_attention(rand(2, 3, 5, 4), rand(2, 3, 5, 4), rand(2, 3, 5, 4),
                         racecpu.hyperplanes(4, dtype=np.float64), Tensor(np.ones(2)))


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_angular_attention_grad(causal):
    q, k, v = qkv()
    check_grad(lambda q, k, v: F.softmax_attention(q, k, v, causal=causal), q, k, v)
    check_grad(lambda q, k, v: F.angular_attention(q, k, v, 3, causal=causal), q, k, v)
    np.testing.assert_allclose(F.softmax_attention(q, k, v, causal=causal).data,
                               reference.softmax_attention(q.data, k.data, v.data, causal=causal))


def linear_dense(q, k, v, causal, mask=None):
    """Independent O(N^2) statement of elu+1 linear attention."""
    f = lambda x: np.where(x > 0, x + 1, np.exp(x))  # noqa: E731
    S = f(q) @ np.swapaxes(f(k), -1, -2)
    if causal:
        S = S * np.tril(np.ones(S.shape[-2:]))
    if mask is not None:
        S = S * mask[..., None, :]
    return (S @ v) / S.sum(-1, keepdims=True)


@pytest.mark.parametrize("causal,chunk", [(False, 64), (True, 64), (True, 2), (True, 3)])
def test_linear_attention(causal, chunk):
    """Chunk sizes that divide N, do not divide it, and exceed it."""
    q, k, v = qkv(nq=7, nk=7)
    check_grad(lambda q, k, v: F.linear_attention(q, k, v, causal=causal, chunk=chunk), q, k, v)
    np.testing.assert_allclose(F.linear_attention(q, k, v, causal=causal, chunk=chunk).data,
                               linear_dense(q.data, k.data, v.data, causal), rtol=1e-12)


def test_linear_attention_key_mask_and_errors():
    q, k, v = qkv(nq=3, nk=5)
    mask = np.array([[True, False, True, True, False], [False, True, True, True, True]])
    check_grad(lambda q, k, v: F.linear_attention(q, k, v, key_mask=mask), q, k, v)
    np.testing.assert_allclose(F.linear_attention(q, k, v, key_mask=mask).data,
                               linear_dense(q.data, k.data, v.data, False, mask), rtol=1e-12)
    with pytest.raises(ValueError, match="Nq == Nk"):
        F.linear_attention(q, k, v, causal=True)
    with pytest.raises(ValueError, match="key_mask"):
        F.linear_attention(q, k, v, key_mask=mask[:, :3])


# ---------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------

def test_grad_accumulates_over_uses_and_calls():
    x = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    y = x * x + x          # x used three times
    y.sum().backward()
    np.testing.assert_allclose(x.grad, 2 * x.data + 1)
    (x * 3.0).sum().backward()   # accumulates like PyTorch
    np.testing.assert_allclose(x.grad, 2 * x.data + 4)


def test_deep_graph_does_not_recurse():
    x = Tensor(np.ones(2), requires_grad=True)
    y = x
    for _ in range(5000):
        y = y * 1.0
    y.sum().backward()
    np.testing.assert_array_equal(x.grad, [1, 1])


def test_backward_errors_and_no_grad_detach():
    x = Tensor(np.ones(3), requires_grad=True)
    with pytest.raises(ValueError, match="grad must be given"):
        (x * 2.0).backward()
    with pytest.raises(ValueError, match="shape"):
        (x * 2.0).backward(np.ones(2))
    with pytest.raises(RuntimeError, match="does not require grad"):
        Tensor(np.ones(1)).backward()
    with no_grad():
        assert not (x * 2.0).requires_grad
    assert not x.detach().requires_grad
    assert (x * 2.0).requires_grad


def test_float32_stays_float32():
    x = Tensor(np.ones((2, 3), np.float32), requires_grad=True)
    y = ((x * 2.5 + 1.0) / 3.0) ** 2
    y = F.layer_norm(y.gelu() @ np.ones((3, 2), np.float32))
    assert y.dtype == np.float32
    y.sum().backward()
    assert x.grad.dtype == np.float32


def test_inputs_not_mutated():
    a = np.random.default_rng(0).standard_normal((3, 4))
    a0 = a.copy()
    x = Tensor(a, requires_grad=True)
    check_grad(lambda t: (t * t).sum(axis=0), x)
    ((x + 1.0) * x).sum().backward()
    np.testing.assert_array_equal(a, a0)


def test_check_grad_catches_wrong_gradient():
    def bad_square(t):
        return op(t.data ** 2, (t,), lambda g: (g * t.data,))  # missing factor 2
    with pytest.raises(AssertionError, match="gradient of argument 0"):
        check_grad(bad_square, rand(3))
    with pytest.raises(TypeError, match="float64"):
        check_grad(lambda t: t, Tensor(np.ones(2, np.float32)))

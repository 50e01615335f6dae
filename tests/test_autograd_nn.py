"""racecpu.autograd.nn and .optim: modules (gradients, causality, masks, state dicts) and AdamW."""

import numpy as np
import pytest

from racecpu.autograd import Tensor, check_grad
from racecpu.autograd import functional as F
from racecpu.autograd import nn, optim

ATT = ["race", "softmax", "angular", "linear"]


def x64(*shape, seed=0):
    return Tensor(np.random.default_rng(seed).standard_normal(shape))


def test_linear_layernorm_embedding_grads():
    lin = nn.Linear(4, 3, seed=1, dtype=np.float64)
    check_grad(lambda x, w, b: x @ w + b, x64(2, 5, 4), lin.weight, lin.bias)
    np.testing.assert_allclose(lin(x64(2, 5, 4)).data, x64(2, 5, 4).data @ lin.weight.data + lin.bias.data)
    ln = nn.LayerNorm(4, dtype=np.float64)
    ln.weight.data = np.random.default_rng(2).standard_normal(4)
    check_grad(lambda x, w, b: F.layer_norm(x, w, b), x64(3, 4), ln.weight, ln.bias)
    emb = nn.Embedding(6, 3, dtype=np.float64)
    check_grad(lambda w: F.embedding(w, np.array([[1, 5, 1]])), emb.weight)
    assert emb(np.array([[1, 5]])).shape == (1, 2, 3)


@pytest.mark.parametrize("attention", ATT)
@pytest.mark.parametrize("causal", [True, False])
def test_multihead_attention_grad(attention, causal):
    """Input and every parameter (incl. RACE's log-beta) against finite differences."""
    mha = nn.MultiHeadAttention(4, 2, attention=attention, causal=causal, num_planes=2, num_tables=2, beta=1.5,
                                seed=3, dtype=np.float64)
    params = mha.parameters()
    names = [n for n, _ in mha.named_parameters()]
    assert ("log_beta" in names) == (attention == "race")
    x = x64(2, 5, 4)

    def f(x, *ps):
        return mha(x)
    check_grad(f, x, *params)


@pytest.mark.parametrize("attention", ["race", "softmax"])
def test_multihead_attention_conv_and_per_head_beta_grad(attention):
    """Short convolution on q, k, v (with SiLU) and per-head beta: every parameter against finite differences."""
    mha = nn.MultiHeadAttention(4, 2, attention=attention, num_planes=2, num_tables=2, beta=1.5, beta_per_head=True,
                                conv_size=3, seed=3, dtype=np.float64)
    names = [n for n, _ in mha.named_parameters()]
    assert {"conv_q", "conv_k", "conv_v"} <= set(names)
    if attention == "race":
        assert mha.log_beta.shape == (2,) and mha.current_beta() == pytest.approx([1.5, 1.5])
    check_grad(lambda x, *ps: mha(x), x64(2, 5, 4), *mha.parameters())
    with pytest.raises(ValueError, match="causal"):
        nn.MultiHeadAttention(4, 2, causal=False, conv_size=3)


def test_race_beta_fixed_and_buffers():
    mha = nn.MultiHeadAttention(8, 2, attention="race", train_beta=False, beta=3.0, dtype=np.float64)
    assert "log_beta" not in dict(mha.named_parameters()) and mha.current_beta() == 3.0
    # the layers' default P and L (racecpu.hashing.LAYER_NUM_TABLES, LAYER_NUM_PLANES)
    assert "planes" in mha.state_dict() and mha.state_dict()["planes"].shape == (4, 5, 4)
    with pytest.raises(ValueError, match="attention must be one of"):
        nn.MultiHeadAttention(8, 2, attention="flash")
    with pytest.raises(ValueError, match="divisible"):
        nn.MultiHeadAttention(9, 2)


@pytest.mark.parametrize("conv_size", [0, 4])
@pytest.mark.parametrize("attention", ATT)
def test_lm_is_causal(attention, conv_size):
    model = nn.TransformerLM(11, 8, 2, 2, attention=attention, max_len=16, conv_size=conv_size, seed=0)
    toks = np.random.default_rng(0).integers(0, 11, (2, 10))
    out = model(toks).data
    assert out.shape == (2, 10, 11) and out.dtype == np.float32
    toks2 = toks.copy()
    toks2[:, 6:] = (toks2[:, 6:] + 1) % 11
    out2 = model(toks2).data
    np.testing.assert_allclose(out2[:, :6], out[:, :6], rtol=1e-5, atol=1e-6)
    assert not np.allclose(out2[:, 6:], out[:, 6:])
    with pytest.raises(ValueError, match="max_len"):
        model(np.zeros((1, 17), np.int64))


@pytest.mark.parametrize("attention", ATT)
def test_classifier_ignores_padding(attention):
    model = nn.TransformerClassifier(9, 3, 8, 2, 1, attention=attention, seed=1)
    rng = np.random.default_rng(1)
    toks = rng.integers(1, 9, (2, 7))
    mask = np.ones((2, 7), bool)
    mask[0, 5:] = False
    out = model(toks, key_mask=mask).data
    toks2 = toks.copy()
    toks2[0, 5:] = 0
    np.testing.assert_allclose(model(toks2, key_mask=mask).data, out, rtol=1e-5, atol=1e-6)
    assert out.shape == (2, 3)


def test_state_dict_npz_round_trip(tmp_path):
    a = nn.TransformerLM(7, 8, 2, 2, attention="race", max_len=12, seed=0)
    b = nn.TransformerLM(7, 8, 2, 2, attention="race", max_len=12, seed=1)
    toks = np.random.default_rng(0).integers(0, 7, (2, 12))
    a.blocks[0].attn.log_beta.data = np.asarray(np.log(3.0), np.float32)
    assert not np.allclose(a(toks).data, b(toks).data)
    path = tmp_path / "model.npz"
    a.save(path)
    b.load(path)
    np.testing.assert_array_equal(a(toks).data, b(toks).data)
    sd = a.state_dict()
    assert "blocks.1.attn.q.weight" in sd and "blocks.0.attn.planes" in sd and "head.bias" in sd
    sd["head.bias"][:] = 99  # a copy: the model is untouched
    assert not np.any(a.head.bias.data == 99)
    bad = dict(sd)
    del bad["head.bias"]
    with pytest.raises(ValueError, match="missing"):
        b.load_state_dict(bad)
    bad = dict(sd, **{"head.bias": np.zeros(3)})
    with pytest.raises(ValueError, match="shape"):
        b.load_state_dict(bad)


def test_parameters_and_train_eval():
    model = nn.TransformerLM(5, 8, 2, 2, attention="softmax", dropout=0.5, seed=0)
    names = [n for n, _ in model.named_parameters()]
    assert len(names) == len(set(names)) == len(model.parameters())
    assert model.num_parameters() == sum(p.size for p in model.parameters())
    toks = np.zeros((1, 6), np.int64)
    model.eval()
    assert not model.blocks[1].training
    np.testing.assert_array_equal(model(toks).data, model(toks).data)
    model.train()
    assert model.blocks[0].training
    assert not np.array_equal(model(toks).data, model(toks).data)  # dropout active


# ---------------------------------------------------------------------------
# optim
# ---------------------------------------------------------------------------

def test_adamw_matches_formula():
    rng = np.random.default_rng(0)
    w = nn.Parameter(rng.standard_normal((2, 3)))
    b = nn.Parameter(rng.standard_normal(3))
    opt = optim.AdamW([w, b], lr=0.1, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.5)
    ref = {id(p): [p.data.copy(), 0.0, 0.0] for p in (w, b)}
    for t in range(1, 4):
        grads = {id(p): rng.standard_normal(p.shape) for p in (w, b)}
        for p in (w, b):
            p.grad = grads[id(p)]
        opt.step()
        for p in (w, b):
            x, m, v = ref[id(p)]
            g = grads[id(p)]
            m = 0.8 * m + 0.2 * g
            v = 0.9 * v + 0.1 * g * g
            step = (m / (1 - 0.8 ** t)) / (np.sqrt(v / (1 - 0.9 ** t)) + 1e-8)
            if p.ndim >= 2:
                step = step + 0.5 * x
            ref[id(p)] = [x - 0.1 * step, m, v]
            np.testing.assert_allclose(p.data, ref[id(p)][0], rtol=1e-12)


def test_adamw_minimises_quadratic_and_validates():
    w = nn.Parameter(np.array([3.0, -2.0]))
    opt = optim.AdamW([w], lr=0.1, weight_decay=0.0)
    for _ in range(300):
        opt.zero_grad()
        ((w - 1.0) ** 2).sum().backward()
        opt.step()
    np.testing.assert_allclose(w.data, [1, 1], atol=1e-2)
    with pytest.raises(ValueError):
        optim.AdamW([], lr=0.1)
    with pytest.raises(ValueError):
        optim.AdamW([w], lr=-1)


def test_schedule_and_clipping():
    lrs = [optim.warmup_linear_decay(s, 100, 1.0, warmup_frac=0.1) for s in range(100)]
    np.testing.assert_allclose(lrs[:10], np.arange(1, 11) / 10)
    assert lrs[10] == pytest.approx(1.0 - 0 / 90) and lrs[-1] == pytest.approx(1 / 90)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    p, q = nn.Parameter(np.zeros(2)), nn.Parameter(np.zeros(1))
    p.grad, q.grad = np.array([3.0, 0.0]), np.array([4.0])
    assert optim.clip_grad_norm([p, q], 1.0) == pytest.approx(5.0)
    np.testing.assert_allclose(np.concatenate([p.grad, q.grad]), [0.6, 0, 0.8])
    assert optim.clip_grad_norm([p, q], 10.0) == pytest.approx(1.0)

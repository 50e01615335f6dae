"""The per-bucket-mean estimator of the authors' released code (reference.race_attention_bucket_mean)."""

import numpy as np
import pytest

import racecpu
from racecpu import bucket_mean as bm
from racecpu import reference as ref

from .util import fd_check, fd_grad, rel_err


def _data(rng, lead=(2,), nq=5, nk=6, d=4, dv=3):
    return (rng.standard_normal(lead + (nq, d)), rng.standard_normal(lead + (nk, d)),
            rng.standard_normal(lead + (nk, dv)))


def _hard_buckets(x, planes):
    """SimHash: one-hot (N, L, R) of the corner sign(W_l x) in corners() order."""
    C = racecpu.corners(planes.shape[1])
    idx = np.argmax(np.sign(np.einsum("nd,lpd->nlp", x, planes)) @ C.T, axis=-1)
    return np.eye(len(C))[idx]


def test_matches_the_per_bucket_formula(rng):
    q, k, v = _data(rng, lead=(), nq=5, nk=5)
    W = racecpu.hyperplanes(4, 3, 2, seed=1, dtype=np.float64)
    pq, _ = ref.soft_buckets_dense(q, W, 1.5)
    pk, _ = ref.soft_buckets_dense(k, W, 1.5)
    A, B = pk.sum(0), np.einsum("jlr,jc->lrc", pk, v)
    expect = np.einsum("ilr,lrc->ic", pq, B / (A[..., None] + 1e-6))
    np.testing.assert_allclose(ref.race_attention_bucket_mean(q, k, v, W, 1.5), expect, rtol=1e-12)
    expect = np.stack([np.einsum("lr,lrc->c", pq[i], np.einsum("jlr,jc->lrc", pk[:i + 1], v[:i + 1])
                                 / (pk[:i + 1].sum(0)[..., None] + 1e-6)) for i in range(5)])
    np.testing.assert_allclose(ref.race_attention_bucket_mean(q, k, v, W, 1.5, causal=True), expect, rtol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_matches_finite_differences(rng, causal):
    q, k, v = _data(rng, nk=5)
    W = racecpu.hyperplanes(4, 3, 2, seed=1, dtype=np.float64)
    mask = np.array([[True, False, True, True, True], [True, True, True, True, False]])

    def f(q, k, v, beta):
        return ref.race_attention_bucket_mean(q, k, v, W, beta, causal=causal, key_mask=mask)

    out, res = ref.race_attention_bucket_mean_fwd(q, k, v, W, 1.5, causal=causal, key_mask=mask)
    g = rng.standard_normal(out.shape)
    fd_check(f, (q, k, v, 1.5), g, ref.race_attention_bucket_mean_bwd(res, g))


def test_float32_follows_float64(rng):
    q, k, v = _data(rng, nk=5)
    W = racecpu.hyperplanes(4, 3, 2, seed=1, dtype=np.float64)
    o64 = ref.race_attention_bucket_mean(q, k, v, W, 1.5, causal=True)
    o32 = ref.race_attention_bucket_mean(*(a.astype(np.float32) for a in (q, k, v)), W, 1.5, causal=True)
    assert o32.dtype == np.float32
    np.testing.assert_allclose(o32, o64, rtol=1e-4, atol=1e-5)


def test_causal_output_ignores_later_keys(rng):
    q, k, v = _data(rng, nk=5)
    W = racecpu.hyperplanes(4, 3, 3, seed=2, dtype=np.float64)
    out = ref.race_attention_bucket_mean(q, k, v, W, 2.0, causal=True)
    for i in range(4):
        k2, v2 = k.copy(), v.copy()
        k2[:, i + 1:] = rng.standard_normal(k2[:, i + 1:].shape)
        v2[:, i + 1:] = rng.standard_normal(v2[:, i + 1:].shape)
        out2 = ref.race_attention_bucket_mean(q, k2, v2, W, 2.0, causal=True)
        np.testing.assert_array_equal(out2[:, :i + 1], out[:, :i + 1])
        assert not np.allclose(out2[:, i + 1:], out[:, i + 1:])


def test_key_permutation_and_masked_keys(rng):
    q, k, v = _data(rng, nk=7)
    W = racecpu.hyperplanes(4, 2, 3, seed=3, dtype=np.float64)
    mask = rng.random((2, 7)) > 0.3
    out = ref.race_attention_bucket_mean(q, k, v, W, 1.0, key_mask=mask)
    perm = rng.permutation(7)
    np.testing.assert_allclose(ref.race_attention_bucket_mean(q, k[:, perm], v[:, perm], W, 1.0,
                                                              key_mask=mask[:, perm]), out, rtol=1e-12)
    for b in range(2):  # a masked key is the same as no key
        kept = ref.race_attention_bucket_mean(q[b], k[b, mask[b]], v[b, mask[b]], W, 1.0)
        np.testing.assert_allclose(kept, out[b], rtol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_output_scales_with_the_number_of_tables(rng, causal):
    q, k, v = _data(rng, nk=5)
    W = racecpu.hyperplanes(4, 3, 2, seed=4, dtype=np.float64)
    one = ref.race_attention_bucket_mean(q, k, v, W, 1.5, causal=causal)
    two = ref.race_attention_bucket_mean(q, k, v, np.concatenate([W, W]), 1.5, causal=causal)
    np.testing.assert_allclose(two, 2 * one, rtol=1e-12)
    # the paper's ratio does not change when the tables are duplicated
    r1 = ref.race_attention_dense(q, k, v, W, 1.5, causal=causal)
    np.testing.assert_allclose(ref.race_attention_dense(q, k, v, np.concatenate([W, W]), 1.5, causal=causal), r1,
                               rtol=1e-12)


def test_small_beta_gives_L_times_the_mean_value(rng):
    q, k, v = _data(rng, lead=(), nq=4, nk=9)
    L = 5
    W = racecpu.hyperplanes(4, 3, L, seed=5, dtype=np.float64)
    out = ref.race_attention_bucket_mean(q, k, v, W, 1e-7, eps=1e-12)
    np.testing.assert_allclose(out, np.broadcast_to(L * v.mean(0), out.shape), rtol=1e-5)
    causal = ref.race_attention_bucket_mean(q[:4], k[:4], v[:4], W, 1e-7, causal=True, eps=1e-12)
    prefix_means = np.cumsum(v[:4], 0) / np.arange(1, 5)[:, None]
    np.testing.assert_allclose(causal, L * prefix_means, rtol=1e-5)


def test_large_beta_gives_the_sum_over_tables_of_the_hard_bucket_mean(rng):
    q, k, v = _data(rng, lead=(), nq=6, nk=40, d=5)
    W = racecpu.hyperplanes(5, 2, 4, seed=6, dtype=np.float64)
    hq, hk = _hard_buckets(q, W), _hard_buckets(k, W)
    counts = hk.sum(0)                                    # (L, R) keys per bucket
    sums = np.einsum("jlr,jc->lrc", hk, v)
    means = np.where(counts[..., None] > 0, sums / np.maximum(counts, 1)[..., None], 0)
    expect = np.einsum("ilr,lrc->ic", hq, means)          # empty bucket: that table adds 0
    out = ref.race_attention_bucket_mean(q, k, v, W, 1e6, eps=1e-12)
    np.testing.assert_allclose(out, expect, atol=1e-6)


# ---------------------------------------------------------------------------
# racecpu.bucket_mean: the same estimator from per-bucket (prefix) sums, linear in N
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("block", [4, 64])  # the causal form's blocks: several with a partial one, or one
def test_linear_time_version_equals_the_oracle(rng, monkeypatch, causal, masked, block):
    from racecpu import bucket_mean as bm
    monkeypatch.setattr(bm, "BLOCK", block)
    q, k, v = _data(rng, lead=(2, 3), nq=11, nk=11 if causal else 9, d=6, dv=4)
    W = racecpu.hyperplanes(6, 3, 4, seed=2, dtype=np.float64)
    mask = rng.random((2, 3, k.shape[-2])) > 0.4 if masked else None
    if masked:
        mask[0, 0] = False  # a row of queries that sees no key: zeros in both
    before = [a.copy() for a in (q, k, v)]
    o1, r1 = ref.race_attention_bucket_mean_fwd(q, k, v, W, 1.7, causal=causal, key_mask=mask)
    o2, r2 = bm.race_attention_bucket_mean_fwd(q, k, v, W, 1.7, causal=causal, key_mask=mask)
    np.testing.assert_allclose(o2, o1, rtol=1e-12, atol=1e-13)
    if masked:
        np.testing.assert_array_equal(o2[0, 0], 0.0)
    g = rng.standard_normal(o1.shape)
    for a, b in zip(bm.race_attention_bucket_mean_bwd(r2, g), ref.race_attention_bucket_mean_bwd(r1, g)):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)
    for a, b in zip((q, k, v), before):
        np.testing.assert_array_equal(a, b)


def test_linear_time_version_broadcasts_and_keeps_float32(rng, monkeypatch):
    from racecpu import bucket_mean as bm
    monkeypatch.setattr(bm, "BLOCK", 3)
    q, _, _ = _data(rng, lead=(2, 1), nq=8, d=4)
    _, k, v = _data(rng, lead=(1, 3), nk=8, d=4)
    W = racecpu.hyperplanes(4, 2, 3, seed=5, dtype=np.float64)
    for causal in (False, True):
        o, res = bm.race_attention_bucket_mean_fwd(q, k, v, W, 2.5, causal=causal)
        o_ref, res_ref = ref.race_attention_bucket_mean_fwd(q, k, v, W, 2.5, causal=causal)
        np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-13)
        g = rng.standard_normal(o.shape)
        for a, b in zip(bm.race_attention_bucket_mean_bwd(res, g), ref.race_attention_bucket_mean_bwd(res_ref, g)):
            np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)
        o32 = bm.race_attention_bucket_mean(*(a.astype(np.float32) for a in (q, k, v)), W, 2.5, causal=causal)
        assert o32.dtype == np.float32
        np.testing.assert_allclose(o32, o, rtol=1e-4, atol=1e-5)


def test_linear_time_version_rejects_bad_shapes(rng):
    from racecpu import bucket_mean as bm
    q, k, v = _data(rng, nq=5, nk=6)
    W = racecpu.hyperplanes(4, 2, 2, seed=5, dtype=np.float64)
    with pytest.raises(ValueError, match="Nq == Nk"):
        bm.race_attention_bucket_mean(q, k, v, W, 1.0, causal=True)
    with pytest.raises(ValueError, match="disagree"):
        bm.race_attention_bucket_mean(q, k, v[:, :5], W, 1.0)
    with pytest.raises(TypeError):
        bm.race_attention_bucket_mean(q.astype(int), k.astype(int), v.astype(int), W, 1.0)


# ---------------------------------------------------------------------------
# autograd op, attention module, training
# ---------------------------------------------------------------------------

def _t(*shape, seed=0):
    from racecpu.autograd import Tensor
    return Tensor(np.random.default_rng(seed).standard_normal(shape))


@pytest.mark.parametrize("causal", [False, True])
def test_autograd_op_gradients(causal):
    from racecpu.autograd import Tensor, check_grad
    from racecpu.autograd import functional as F
    q, k, v = _t(2, 5, 4, seed=1), _t(2, 5, 4, seed=2), _t(2, 5, 3, seed=3)
    planes = racecpu.hyperplanes(4, 3, 2, seed=3, dtype=np.float64)
    beta = Tensor(np.array(1.5))
    check_grad(lambda q, k, v, b: F.race_attention_bucket_mean(q, k, v, planes, b, causal=causal), q, k, v, beta)
    mask = np.array([[True, False, True, True, True], [True, True, True, True, False]])
    check_grad(lambda q, k, v: F.race_attention_bucket_mean(q, k, v, planes, 2.0, causal=causal, key_mask=mask),
               q, k, v)
    out = F.race_attention_bucket_mean(q, k, v, planes, 2.0, causal=causal, key_mask=mask).data
    np.testing.assert_allclose(out, ref.race_attention_bucket_mean(q.data, k.data, v.data, planes, 2.0,
                                                                   causal=causal, key_mask=mask), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("causal", [False, True])
def test_planes_gradient_matches_finite_differences_of_the_oracle(rng, causal):
    """dplanes=True with the per-bucket mean, through the NumPy API (grouped heads, a key mask, a
    length that is no whole block): against central differences of the O(N^2) oracle in
    float64, in the planes' dtype (float32 planes given for float64 inputs), dq, dk, dv, dbeta
    unchanged by asking for it; the linear-time functions' own share the same numbers."""
    q = rng.standard_normal((2, 2, 70, 4))
    k, v = rng.standard_normal((2, 1, 70, 4)), rng.standard_normal((2, 1, 70, 3))
    mask = rng.random((2, 1, 70)) > 0.2
    W = racecpu.hyperplanes(4, 3, 2, seed=2, dtype=np.float64)
    out, res = racecpu.race_attention_fwd(q, k, v, W, 1.5, causal=causal, key_mask=mask, estimator="bucket_mean")
    g = rng.standard_normal(out.shape)
    got = racecpu.race_attention_bwd(res, g, dplanes=True)
    plain = racecpu.race_attention_bwd(res, g)
    assert len(got) == 5 and got[4].shape == W.shape and got[4].dtype == np.float64
    for a, b in zip(got[:4], plain):
        np.testing.assert_array_equal(a, b)
    kr, vr, mr = (np.repeat(x, 2, axis=1) for x in (k, v, mask))  # the oracle has no grouped heads

    def f(Wx):
        return ref.race_attention_bucket_mean(q, kr, vr, Wx, 1.5, causal=causal, key_mask=mr)
    num = fd_grad(f, (W,), 0, g)
    assert rel_err(got[4], num) < 1e-6
    _, r32 = racecpu.race_attention_fwd(q, k, v, W.astype(np.float32), 1.5, causal=causal, key_mask=mask,
                                        estimator="bucket_mean")
    dW32 = racecpu.race_attention_bwd(r32, g, dplanes=True)[4]
    assert dW32.dtype == np.float32 and rel_err(dW32, got[4]) < 1e-5
    from racecpu.bucket_mean import race_attention_bucket_mean_bwd, race_attention_bucket_mean_fwd
    _, inner = race_attention_bucket_mean_fwd(q, kr, vr, W, 1.5, causal=causal, key_mask=mr)
    assert rel_err(race_attention_bucket_mean_bwd(inner, g, dplanes=True)[4], got[4]) < 1e-12


@pytest.mark.parametrize("causal", [False, True])
def test_packed_sequences_are_a_call_per_sequence(rng, causal):
    """cu_seqlens with the per-bucket mean: out equal to the O(N^2) oracle on each sequence alone
    (an empty one, grouped heads, a key mask), the gradients to the NumPy API's calls per
    sequence, dbeta and the planes' gradient their sums."""
    cu = np.array([0, 9, 9, 40, 70], np.int32)
    q = rng.standard_normal((2, 2, 70, 4))
    k, v = rng.standard_normal((2, 1, 70, 4)), rng.standard_normal((2, 1, 70, 3))
    mask = rng.random((2, 1, 70)) > 0.2
    W = racecpu.hyperplanes(4, 3, 2, seed=5, dtype=np.float64)
    kw = dict(causal=causal, estimator="bucket_mean")
    out, res = racecpu.race_attention_fwd(q, k, v, W, 1.5, key_mask=mask, cu_seqlens=cu, **kw)
    g = rng.standard_normal(out.shape)
    got = racecpu.race_attention_bwd(res, g, dplanes=True)
    want = [np.zeros_like(x) for x in (q, k, v)] + [0.0, np.zeros_like(W)]
    for a, b in zip(cu[:-1], cu[1:]):
        if a == b:
            continue
        part = (Ellipsis, slice(a, b), slice(None))
        o, r = racecpu.race_attention_fwd(q[part], k[part], v[part], W, 1.5, key_mask=mask[..., a:b], **kw)
        dense = ref.race_attention_bucket_mean(q[part], np.repeat(k[part], 2, 1), np.repeat(v[part], 2, 1), W, 1.5,
                                               causal=causal, key_mask=np.repeat(mask[..., a:b], 2, 1))
        assert rel_err(out[part], dense) < 1e-12
        np.testing.assert_array_equal(out[part], o)
        dq, dk, dv, db, dW = racecpu.race_attention_bwd(r, g[part], dplanes=True)
        want[0][part], want[1][part], want[2][part] = dq, dk, dv
        want[3] += db
        want[4] += dW
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert got[3] == pytest.approx(want[3], rel=1e-12)
    assert rel_err(got[4], want[4]) < 1e-12
    np.testing.assert_array_equal(racecpu.race_attention(q, k, v, W, 1.5, key_mask=mask, cu_seqlens=cu, **kw), out)


def test_packed_linear_time_function_broadcasts_leading_axes(rng):
    """race_attention_bucket_mean with cu_seqlens: k's leading axes wider than q's and v's
    broadcast as without packing, each sequence equal to its own call."""
    q, v = rng.standard_normal((3, 20, 4)), rng.standard_normal((3, 20, 2))
    k = rng.standard_normal((2, 3, 20, 4))
    W = racecpu.hyperplanes(4, 2, 2, seed=1, dtype=np.float64)
    cu = [0, 8, 20]
    out = bm.race_attention_bucket_mean(q, k, v, W, 1.5, causal=True, cu_seqlens=cu)
    assert out.shape == (2, 3, 20, 2)
    for a, b in zip(cu[:-1], cu[1:]):
        np.testing.assert_array_equal(out[..., a:b, :], bm.race_attention_bucket_mean(
            q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], W, 1.5, causal=True))


def test_autograd_op_planes_gradient():
    from racecpu.autograd import Tensor, check_grad
    from racecpu.autograd import functional as F
    q, k, v = _t(2, 3, 9, 4, seed=1), _t(2, 3, 9, 4, seed=2), _t(2, 3, 9, 3, seed=3)
    planes = Tensor(racecpu.hyperplanes(4, 2, 2, seed=4, dtype=np.float64), requires_grad=True)
    check_grad(lambda q, W: F.race_attention_bucket_mean(q, k, v, W, 1.5, causal=True), q, planes)
    beta = Tensor(np.array([0.7, 1.5, 3.0]))   # one temperature a head: heads one at a time
    check_grad(lambda W, b: F.race_attention_bucket_mean(q, k, v, W, b), planes, beta)


def test_autograd_op_per_head_beta():
    from racecpu.autograd import Tensor, check_grad
    from racecpu.autograd import functional as F
    q, k, v = _t(2, 3, 5, 4, seed=1), _t(2, 3, 5, 4, seed=2), _t(2, 3, 5, 3, seed=3)
    planes = racecpu.hyperplanes(4, 2, 2, seed=4, dtype=np.float64)
    beta = Tensor(np.array([0.7, 1.5, 3.0]))
    out = F.race_attention_bucket_mean(q, k, v, planes, beta, causal=True).data
    for h, b in enumerate(beta.data):
        np.testing.assert_allclose(out[:, h], ref.race_attention_bucket_mean(q.data[:, h], k.data[:, h],
                                                                             v.data[:, h], planes, b, causal=True),
                                   rtol=1e-12, atol=1e-13)
    check_grad(lambda q, k, v, b: F.race_attention_bucket_mean(q, k, v, planes, b, causal=True), q, k, v, beta)
    with pytest.raises(ValueError, match="scalar"):
        F.race_attention_bucket_mean(q, k, v, planes, Tensor(np.ones(2)))


@pytest.mark.parametrize("causal", [True, False])
def test_attention_module_with_the_bucket_mean(causal):
    from racecpu.autograd import check_grad, nn
    mha = nn.MultiHeadAttention(4, 2, attention="race", estimator="bucket_mean", causal=causal, num_planes=2,
                                num_tables=2, beta=1.5, seed=3, dtype=np.float64)
    assert "log_beta" in dict(mha.named_parameters())
    check_grad(lambda x, *ps: mha(x), _t(2, 5, 4), *mha.parameters())
    other = nn.MultiHeadAttention(4, 2, attention="race", causal=causal, num_planes=2, num_tables=2, beta=1.5,
                                  seed=3, dtype=np.float64)
    assert not np.allclose(mha(_t(2, 5, 4)).data, other(_t(2, 5, 4)).data)  # the estimator is really switched
    with pytest.raises(ValueError, match="estimator"):
        nn.MultiHeadAttention(4, 2, estimator="mean")


def test_lm_with_the_bucket_mean_is_causal():
    from racecpu.autograd import nn
    lm = nn.TransformerLM(11, 8, 2, 1, estimator="bucket_mean", max_len=12, seed=1, dtype=np.float64)
    toks = np.random.default_rng(0).integers(0, 11, (2, 12))
    out = lm(toks).data
    toks2 = toks.copy()
    toks2[:, 7:] = (toks2[:, 7:] + 1) % 11
    np.testing.assert_allclose(lm(toks2).data[:, :7], out[:, :7], rtol=1e-12)


@pytest.mark.parametrize("estimator", ["ratio", "bucket_mean"])
def test_tiny_model_trains_with_either_estimator(estimator):
    import argparse

    from racecpu.apps import train as T
    p = argparse.ArgumentParser()
    T.add_arguments(p)
    args = p.parse_args(["--task", "mqar", "--attention", "race", "--estimator", estimator, "--steps", "40",
                         "--batch-size", "8", "--seq-len", "16", "--d-model", "16", "--n-layers", "1",
                         "--num-pairs", "2", "--eval-every", "20", "--eval-size", "8", "--lr", "1e-2"])
    cfg = T.config_from_args(args)
    assert cfg["estimator"] == estimator
    assert T.build_model(cfg).blocks[0].attn.estimator == estimator
    res = T.train(cfg, progress=False)
    loss = np.asarray(res["history"]["loss"])
    assert np.isfinite(loss).all() and loss[-10:].mean() < 0.8 * loss[:5].mean()
    assert np.isfinite(res["val_accuracy"]) and res["beta"][0] > 0


# ---------------------------------------------------------------------------
# validation experiment (racecpu/validation/estimators.py)
# ---------------------------------------------------------------------------

def test_estimator_terms_match_the_references(rng):
    from racecpu.apps.validation import estimators as E
    q, k, v = _data(rng, lead=(), nq=7, nk=9, d=5)
    W = racecpu.hyperplanes(5, 3, 4, seed=7, dtype=np.float64)
    num, den, bm = E.table_terms(q, k, v, W, 1.3)
    np.testing.assert_allclose(num[:2].sum(0) / den[:2].sum(0)[:, None],
                               ref.race_attention_dense(q, k, v, W[:2], 1.3), rtol=1e-12)
    np.testing.assert_allclose(bm.sum(0), ref.race_attention_bucket_mean(q, k, v, W, 1.3), rtol=1e-12)
    hard, hnum, hcnt = E.hard_table_terms(q, k, v, W, chunk=3)
    np.testing.assert_allclose(hard.sum(0), ref.race_attention_bucket_mean(q, k, v, W, 1e6, eps=1e-12), atol=1e-6)
    hq, hk = _hard_buckets(q, W), _hard_buckets(k, W)
    np.testing.assert_array_equal(hcnt, np.einsum("ilr,jlr->li", hq, hk))


def test_estimator_experiment_quick(tmp_path):
    from racecpu.apps.validation import estimators as E
    res = E.run("quick", out_dir=str(tmp_path), show_progress=False)
    verdicts = {c.key: c.holds for c in res.claims}
    assert verdicts["E1"] and verdicts["E2"] and verdicts["E3"] and verdicts["E5"]
    assert verdicts["E4"] in (True, None)
    bias = res.values["ratio_bias"]  # the ratio's bias at finite L falls like 1/L
    assert verdicts["E7"] and bias[0]["bias"] > 3 * bias[0]["noise"] and bias[1]["bias"] < 0.7 * bias[0]["bias"]
    assert verdicts["E9"] is None and verdicts["E10"] is None  # measured: N and beta sweeps
    assert [r["N"] for r in res.values["n_sweep"]] == [128, 256, 512]
    assert all(0 < r["ratio_vs_angular"] < 0.2 for r in res.values["n_sweep"])
    assert (tmp_path / "estimators.png").exists() and len(res.tables["estimators.csv"]) == 2 * 4 * 4

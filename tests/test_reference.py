"""The oracles themselves: their backward against central finite differences."""

import numpy as np
import pytest

import racecpu
from racecpu import reference as ref

from .util import fd_check


def _data(rng, lead=(2,), nq=5, nk=6, d=4, dv=3):
    return (rng.standard_normal(lead + (nq, d)), rng.standard_normal(lead + (nk, d)),
            rng.standard_normal(lead + (nk, dv)))


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_backward_matches_finite_differences(rng, causal):
    q, k, v = _data(rng, nk=5)
    mask = rng.random((2, 5)) > 0.3
    f = lambda q, k, v: ref.softmax_attention(q, k, v, causal=causal, key_mask=mask)  # noqa: E731
    out, res = ref.softmax_attention_fwd(q, k, v, causal=causal, key_mask=mask)
    g = rng.standard_normal(out.shape)
    fd_check(f, (q, k, v), g, ref.softmax_attention_bwd(res, g))


@pytest.mark.parametrize("causal", [False, True])
def test_angular_backward_matches_finite_differences(rng, causal):
    q, k, v = _data(rng, nk=5)
    f = lambda q, k, v: ref.angular_attention(q, k, v, 3.0, causal=causal)  # noqa: E731
    out, res = ref.angular_attention_fwd(q, k, v, 3.0, causal=causal)
    g = rng.standard_normal(out.shape)
    fd_check(f, (q, k, v), g, ref.angular_attention_bwd(res, g))


@pytest.mark.parametrize("causal", [False, True])
def test_race_dense_backward_matches_finite_differences(rng, causal):
    q, k, v = _data(rng, nk=5)
    W = racecpu.hyperplanes(4, 3, 2, seed=1, dtype=np.float64)
    mask = np.array([[True, False, True, True, True], [True, True, True, True, False]])

    def f(q, k, v, beta):
        return ref.race_attention_dense(q, k, v, W, beta, causal=causal, key_mask=mask)

    out, res = ref.race_attention_dense_fwd(q, k, v, W, 1.5, causal=causal, key_mask=mask)
    g = rng.standard_normal(out.shape)
    fd_check(f, (q, k, v, 1.5), g, ref.race_attention_dense_bwd(res, g))


def test_softmax_matches_textbook_formula(rng):
    q, k, v = _data(rng, lead=(), nq=4, nk=7)
    s = q @ k.T / np.sqrt(4)
    p = np.exp(s) / np.exp(s).sum(1, keepdims=True)
    np.testing.assert_allclose(ref.softmax_attention(q, k, v), p @ v, rtol=1e-12)


def test_angular_kernel_formula(rng):
    q, k, v = _data(rng, lead=(), nq=3, nk=4)
    cos = (q @ k.T) / np.linalg.norm(q, axis=1)[:, None] / np.linalg.norm(k, axis=1)[None]
    s = (1 - np.arccos(cos) / np.pi) ** 2.5
    np.testing.assert_allclose(ref.angular_attention(q, k, v, 2.5), s @ v / s.sum(1, keepdims=True), rtol=1e-12)


def test_race_kernel_is_product_of_collision_factors(rng):
    # docs/design.md section 2: phi(q).phi(k) = prod_p [a_p(q) a_p(k) + (1-a_p(q))(1-a_p(k))], a_p = sigmoid(2 beta t_p).
    W = racecpu.hyperplanes(5, 4, 1, seed=3, dtype=np.float64)
    q, k = rng.standard_normal((1, 5)), rng.standard_normal((1, 5))
    beta = 0.7
    aq = 1 / (1 + np.exp(-2 * beta * np.tanh(W[0] @ q[0])))
    ak = 1 / (1 + np.exp(-2 * beta * np.tanh(W[0] @ k[0])))
    expect = np.prod(aq * ak + (1 - aq) * (1 - ak))
    np.testing.assert_allclose(ref.race_kernel_dense(q, k, W, beta)[0, 0], expect, rtol=1e-13)

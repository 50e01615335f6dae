"""Finite inputs never give a silent non-finite result, and shape mistakes raise where they are made (issue 58).

Oracles: the dense float64 reference (:func:`racecpu.reference.race_attention_dense`), and the
property that an attention output is a convex combination of the rows of ``v``.
"""

import numpy as np
import pytest

import racecpu
from racecpu import reference as R


def _problem(dt, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((2, 40, 6)).astype(dt) for _ in range(3))
    return q, k, v, racecpu.hyperplanes(6, 3, 2, dtype=np.float64 if dt == np.float64 else np.float32)


@pytest.mark.parametrize("dt,big", [(np.float32, 2e38), (np.float64, 1.2e308)])
def test_v_near_the_dtype_maximum_raises_naming_v_where_it_would_overflow(dt, big):
    """One row of v near the dtype's maximum: the causal forward used to return inf without a
    word; now it raises naming v, and the non-causal one stays finite and within max |v|."""
    q, k, v, W = _problem(dt)
    v[0, 3] = big
    with pytest.raises(ValueError, match=r"v is too large: the attention's sums overflow " + np.dtype(dt).name):
        racecpu.race_attention(q, k, v, W, causal=True)
    out = racecpu.race_attention(q, k, v, W, causal=False)
    assert np.isfinite(out).all() and np.abs(out).max() <= np.abs(v).max()  # a convex combination of v's rows
    want = R.race_attention_dense(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), W.astype(np.float64),
                                  racecpu.DEFAULT_BETA)
    assert np.abs(out - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("causal", [False, True])
def test_huge_finite_grad_out_raises_naming_grad_out_and_float32(causal):
    """grad_out of 3e37 in float32: the backward used to return NaN in dq, dk and dbeta
    (non-causal) or blame float64 (causal); now both raise naming grad_out and float32."""
    q, k, v, W = _problem(np.float32)
    out, res = racecpu.race_attention_fwd(q, k, v, W, causal=causal)
    with pytest.raises(ValueError, match=r"grad_out is too large: .* overflow float32"):
        racecpu.race_attention_bwd(res, np.full(out.shape, 3e37, np.float32))
    # the same gradient scaled into range is finite (the error is the overflow, not the values)
    grads = racecpu.race_attention_bwd(res, np.full(out.shape, 3e30, np.float32))
    assert all(np.isfinite(g).all() for g in grads[:3]) and np.isfinite(grads[3])


def test_without_check_finite_the_overflow_is_not_looked_for():
    """check_finite=False skips the checks (the documented contract): no error, whatever comes out."""
    q, k, v, W = _problem(np.float32)
    v[0, 3] = 2e38
    racecpu.race_attention(q, k, v, W, causal=True, check_finite=False)


def test_zero_query_heads_with_key_heads_is_a_value_error():
    """q with 0 heads and k, v with 2 (grouped-query shapes) used to raise ZeroDivisionError."""
    q = np.zeros((1, 0, 5, 4), np.float32)
    k = np.zeros((1, 2, 5, 4), np.float32)
    with pytest.raises(ValueError, match="head axis"):
        racecpu.race_attention(q, k, k, racecpu.hyperplanes(4))


def test_out_of_the_wrong_length_says_what_it_got():
    """out=(dq, dk) used to say only "...got tuple"."""
    q = np.zeros((1, 5, 4), np.float32)
    out, res = racecpu.race_attention_fwd(q, q, q, racecpu.hyperplanes(4))
    with pytest.raises(TypeError, match=r"tuple of three arrays \(dq, dk, dv\), got a tuple of 2"):
        racecpu.race_attention_bwd(res, out, out=(np.zeros_like(q), np.zeros_like(q)))


def test_bfloat16_overflow_blames_the_float32_sums():
    """16-bit inputs are summed in float32: an overflow there is named float32, not float64."""
    ml = pytest.importorskip("ml_dtypes")
    q, k, v, W = _problem(np.float32)
    v[:, :] = 3e38
    with pytest.raises(ValueError, match="overflow float32"):
        racecpu.race_attention(q.astype(ml.bfloat16), k.astype(ml.bfloat16), v.astype(ml.bfloat16), W)

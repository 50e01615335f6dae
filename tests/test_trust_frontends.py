"""Trust of the JAX and Dask frontends: bad arguments raise racecpu's own
errors where they are given (at trace time, at graph-building time), not from
inside a host callback or a compute."""

import numpy as np
import pytest

import racecpu

D, DV, N = 4, 3, 6


def _qkv(lead=(2,), n=N, d=D, dv=DV, dtype=np.float32):
    rng = np.random.default_rng(0)
    return (rng.standard_normal(lead + (n, d)).astype(dtype), rng.standard_normal(lead + (n, d)).astype(dtype),
            rng.standard_normal(lead + (n, dv)).astype(dtype))


# ---------------------------------------------------------------------------
# racecpu.jax
# ---------------------------------------------------------------------------

@pytest.fixture
def rj():
    pytest.importorskip("jax")
    import racecpu.jax as rj
    return rj


PLANES = racecpu.hyperplanes(D, 2, 3, seed=0)


def _jax_bad_calls():
    q, k, v = _qkv()
    cu_dec = np.array([0, 4, 2, N], np.int32)
    return {
        "head dim": ((q, k[..., :3], v), {}, ValueError, "q and k must have the same head dim"),
        "negative beta": ((q, k, v, PLANES, -1.0), {}, ValueError, r"beta must be finite and > 0, got -1.0"),
        "nan beta": ((q, k, v, PLANES, np.float32("nan")), {}, ValueError, "beta must be finite and > 0"),
        "bool beta": ((q, k, v, PLANES, True), {}, TypeError, "beta must be a positive finite float"),
        "two betas": ((q, k, v, PLANES, [1.0, 2.0]), {}, ValueError, r"beta must have one element.*\(2,\)"),
        "decreasing cu_seqlens": ((q, k, v, PLANES), {"cu_seqlens": cu_dec}, ValueError,
                                  "cu_seqlens must not decrease, got 4 then 2"),
        "cu_seqlens end": ((q, k, v, PLANES), {"cu_seqlens": np.array([0, 2], np.int32)}, ValueError,
                           "cu_seqlens must run from 0 to the sequence length 6"),
        "float cu_seqlens": ((q, k, v, PLANES), {"cu_seqlens": np.array([0.0, 6.0])}, TypeError,
                             "cu_seqlens must hold integers"),
        "int q": ((q.astype(np.int32), k, v), {}, TypeError, "q must be a float16, bfloat16, float32 or float64"),
        "1-d v": ((q, k, v[0, :, 0]), {}, ValueError, "v must have at least 2 dims"),
        "k, v tokens": ((q, k, v[:, :4]), {}, ValueError, "k and v must have the same number of tokens"),
        "causal lengths": ((q, k[:, :4], v[:, :4]), {"causal": True}, ValueError,
                           "causal attention needs as many queries as keys"),
        "planes head dim": ((q, k, v, racecpu.hyperplanes(5, 2, 3, seed=0)), {}, ValueError,
                            "planes have head dim 5"),
        "key_mask shape": ((q, k, v), {"key_mask": np.ones((2, 5), bool)}, ValueError, "key_mask must have shape"),
        "packed lengths": ((q, k[:, :4], v[:, :4]), {"cu_seqlens": np.array([0, 6], np.int32)}, ValueError,
                           "cu_seqlens packs q, k and v alike"),
    }


def _call(rj, args, kwargs):
    if len(args) == 3:
        args = args + (PLANES,)
    return rj.race_attention(*args, **kwargs)


@pytest.mark.parametrize("case", list(_jax_bad_calls()))
def test_jax_bad_arguments_raise_numpy_errors_eagerly(rj, case):
    args, kwargs, exc, match = _jax_bad_calls()[case]
    with pytest.raises(exc, match=match):
        _call(rj, args, kwargs)


@pytest.mark.parametrize("case", ["head dim", "int q", "1-d v", "k, v tokens", "causal lengths", "key_mask shape",
                                  "packed lengths", "two betas"])
def test_jax_bad_shapes_raise_at_trace_time(rj, case):
    # eval_shape traces with abstract arrays and never runs the callback: the check must come from the shapes
    import jax
    args, kwargs, exc, match = _jax_bad_calls()[case]
    args = args if len(args) > 3 else args + (PLANES,)
    q, k, v, planes = (jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype) for x in args[:4])
    rest = args[4:]
    if rest:
        rest = (jax.ShapeDtypeStruct(np.shape(rest[0]), np.float32),)
    with pytest.raises(exc, match=match):
        jax.eval_shape(lambda *a: rj.race_attention(*a, **kwargs), q, k, v, planes, *rest)


def test_jax_traced_cu_seqlens_checked_by_shape_and_dtype(rj):
    import jax
    q, k, v = _qkv()
    f = jax.jit(lambda cu: rj.race_attention(q, k, v, PLANES, cu_seqlens=cu))
    with pytest.raises(TypeError, match="cu_seqlens must hold integers"):
        f(np.array([0.0, 6.0], np.float32))
    with pytest.raises(ValueError, match="cu_seqlens must be 1-D"):
        f(np.array([[0, 6]], np.int32))
    # a traced, valid one runs; its values are checked by the callback (below)
    np.testing.assert_allclose(f(np.array([0, 2, N], np.int32)),
                               racecpu.race_attention(q, k, v, PLANES, cu_seqlens=[0, 2, N]), rtol=1e-6, atol=1e-6)


def test_jax_jit_with_concrete_bad_beta_raises_at_trace_time(rj):
    import jax
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="beta must be finite and > 0"):
        jax.eval_shape(lambda q: rj.race_attention(q, k, v, PLANES, -2.0), q)


def test_jax_data_errors_reach_the_user_through_the_callback(rj):
    # NaN in traced data (and a traced bad beta or cu_seqlens) is only seen on the host: JAX wraps the
    # callback's ValueError in a RuntimeError (JaxRuntimeError) whose message ends with racecpu's text.
    import jax
    q, k, v = _qkv()
    qn = q.copy()
    qn[0, 1, 2] = np.nan
    with pytest.raises(RuntimeError, match=r"(?s)ValueError: q contains NaN or Inf"):
        np.asarray(jax.jit(lambda q: rj.race_attention(q, k, v, PLANES))(qn))
    with pytest.raises(RuntimeError, match=r"(?s)ValueError: beta must be finite and > 0"):
        np.asarray(jax.jit(lambda b: rj.race_attention(q, k, v, PLANES, b))(-1.0))
    with pytest.raises(RuntimeError, match=r"(?s)ValueError: cu_seqlens must not decrease"):
        np.asarray(jax.jit(lambda cu: rj.race_attention(q, k, v, PLANES, cu_seqlens=cu))(
            np.array([0, 4, 2, N], np.int32)))


def test_jax_valid_one_element_beta_and_gqa_still_run(rj):
    import jax
    q, k, v = _qkv(lead=(4,))
    want = racecpu.race_attention(q, k[:2], v[:2], PLANES, 2.0)
    got = jax.jit(lambda q, k, v, b: rj.race_attention(q, k, v, PLANES, b))(q, k[:2], v[:2], np.array([2.0]))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # traced planes and beta under grad: checked by shape alone
    dW, db = jax.grad(lambda W, b: rj.race_attention(q, k, v, W, b, learn_planes=True).sum(), argnums=(0, 1))(
        PLANES.astype(np.float32), 2.0)
    assert dW.shape == PLANES.shape and np.isfinite(db)


# ---------------------------------------------------------------------------
# racecpu.dask
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("fn", ["race_attention", "race_attention_fwd"])
@pytest.mark.parametrize("threads, exc", [("two", TypeError), (True, TypeError), (2.0, TypeError),
                                          (0, ValueError), (-3, ValueError)])
def test_dask_bad_threads_raise_when_given(fn, threads, exc):
    pytest.importorskip("dask.array")
    import racecpu.dask as rd
    q, k, v = _qkv()
    with pytest.raises(exc, match="threads"):
        getattr(rd, fn)(q, k, v, PLANES, threads=threads)


@pytest.mark.parametrize("threads", [None, 1, np.int64(2)])
def test_dask_good_threads_accepted(threads):
    pytest.importorskip("dask.array")
    import dask
    import racecpu.dask as rd
    q, k, v = _qkv()
    out = rd.race_attention(q, k, v, PLANES, threads=threads)
    with dask.config.set(scheduler="synchronous"):
        np.testing.assert_allclose(out.compute(), racecpu.race_attention(q, k, v, PLANES), rtol=1e-5, atol=1e-6)

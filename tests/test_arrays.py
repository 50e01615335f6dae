"""Other libraries' arrays through the NumPy API: torch CPU tensors and JAX arrays in, the same kind out.

The results must equal the NumPy API's bit for bit (the same kernels on the same numbers), come back
in the caller's array type (torch without a copy of racecpu's result), and a torch tensor that
requires grad is refused with a message that points at racecpu.torch.
"""

import numpy as np
import pytest

import racecpu

pytest.importorskip("array_api_compat")


def _problem(dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, g = (rng.standard_normal((2, 70, 8)).astype(dtype) for _ in range(4))
    return q, k, v, g, racecpu.hyperplanes(8, seed=1)


def _numpy_reference(q, k, v, g, W, causal):
    out, res = racecpu.race_attention_fwd(q, k, v, W, 4.0, causal=causal)
    return (out,) + racecpu.race_attention_bwd(res, g, dplanes=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_torch_cpu_tensors_in_torch_tensors_out(causal, dtype):
    torch = pytest.importorskip("torch")
    q, k, v, g, W = _problem(dtype)
    want = _numpy_reference(q, k, v, g, W, causal)
    tq, tk, tv, tg = (torch.from_numpy(x) for x in (q, k, v, g))
    out, res = racecpu.race_attention_fwd(tq, tk, tv, W, 4.0, causal=causal)
    dq, dk, dv, dbeta, dW = racecpu.race_attention_bwd(res, tg, dplanes=True)
    for name, got, ref in zip(("out", "dq", "dk", "dv", "dplanes"), (out, dq, dk, dv, dW),
                              (want[0], want[1], want[2], want[3], want[5])):
        assert isinstance(got, torch.Tensor), name
        assert got.dtype == torch.from_numpy(ref).dtype, name
        np.testing.assert_array_equal(got.numpy(), ref, err_msg=name)
    assert dbeta == want[4]
    alone = racecpu.race_attention(tq, tk, tv, W, 4.0, causal=causal)
    assert isinstance(alone, torch.Tensor) and torch.equal(alone, out)
    for t, x in zip((tq, tk, tv, tg), (q, k, v, g)):  # inputs untouched
        np.testing.assert_array_equal(t.numpy(), x)


def test_torch_results_share_racecpus_memory_and_out_stays_numpy():
    torch = pytest.importorskip("torch")
    q, k, v, _, W = _problem()
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    import array_api_compat

    from racecpu._arrays import namespace_of, to_namespace
    xp = namespace_of(tq)
    assert array_api_compat.is_torch_namespace(xp)
    a = np.arange(6.0).reshape(2, 3)
    t = to_namespace(xp, a)  # what the public functions return a result through
    assert isinstance(t, torch.Tensor) and np.shares_memory(t.numpy(), a)
    buf = np.empty(q.shape[:-1] + (8,), np.float32)
    assert racecpu.race_attention(tq, tk, tv, W, out=buf) is buf  # out= given: that buffer comes back


def test_torch_tensor_that_requires_grad_is_refused_with_a_pointer_to_racecpu_torch():
    torch = pytest.importorskip("torch")
    q, k, v, _, W = _problem()
    tq = torch.from_numpy(q).requires_grad_()
    with pytest.raises(TypeError, match=r"q is a torch tensor that requires grad.*racecpu\.torch"):
        racecpu.race_attention(tq, k, v, W)
    with pytest.raises(TypeError, match=r"v is a torch tensor that requires grad"):
        racecpu.race_attention_fwd(q, k, torch.from_numpy(v).requires_grad_(), W)


@pytest.mark.parametrize("causal", [False, True])
def test_jax_arrays_in_jax_arrays_out(causal):
    jnp = pytest.importorskip("jax.numpy")
    import jax
    q, k, v, g, W = _problem(np.float32, seed=3)
    want = _numpy_reference(q, k, v, g, W, causal)
    jq, jk, jv, jg = (jnp.asarray(x) for x in (q, k, v, g))
    out, res = racecpu.race_attention_fwd(jq, jk, jv, W, 4.0, causal=causal)
    dq, dk, dv, dbeta = racecpu.race_attention_bwd(res, jg)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), want[:4]):
        assert isinstance(got, jax.Array), name
        np.testing.assert_array_equal(np.asarray(got), ref, err_msg=name)
    assert dbeta == want[4]
    assert isinstance(racecpu.race_attention(jq, jk, jv, W, 4.0, causal=causal), jax.Array)


class _DLPackOnly:
    """An array that speaks only DLPack (no ``__array__``)."""

    def __init__(self, a):
        self._a = a
        self.shape, self.dtype = a.shape, a.dtype

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_dlpack_only_inputs_are_read_and_numpy_comes_back():
    q, k, v, _, W = _problem()
    got = racecpu.race_attention(_DLPackOnly(q), _DLPackOnly(k), _DLPackOnly(v), W, causal=True)
    assert type(got) is np.ndarray
    np.testing.assert_array_equal(got, racecpu.race_attention(q, k, v, W, causal=True))


def test_numpy_and_lists_are_unchanged():
    q, k, v, _, W = _problem(np.float64)
    assert type(racecpu.race_attention(q, k, v, W)) is np.ndarray
    assert type(racecpu.race_attention(q.tolist(), k.tolist(), v.tolist(), W)) is np.ndarray

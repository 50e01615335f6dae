"""racecpu.jax: the custom_vjp against the NumPy API, under jit, grad and vmap."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import racecpu  # noqa: E402
import racecpu.jax as rj  # noqa: E402


@pytest.fixture(autouse=True)
def _x64():
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", False)


def _inputs(lead=(2, 3), n=12, d=8, dv=5, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal(lead + (n, d)).astype(dtype) for _ in range(2))
    v = rng.standard_normal(lead + (n, dv)).astype(dtype)
    planes = racecpu.hyperplanes(d, 2, 3, seed=seed, dtype=np.float64)
    mask = rng.random(lead + (n,)) > 0.2
    g = rng.standard_normal(lead + (n, dv)).astype(dtype)
    return q, k, v, planes, mask, g


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_grads_equal_numpy_api_float64(causal, masked):
    q, k, v, planes, mask, g = _inputs()
    mask = mask if masked else None

    def loss(q, k, v, beta):
        return jnp.vdot(rj.race_attention(q, k, v, planes, beta, causal=causal, key_mask=mask), g)

    out = jax.jit(lambda q, k, v: rj.race_attention(q, k, v, planes, 3.0, causal=causal, key_mask=mask))(q, k, v)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, 3.0)
    ref, res = racecpu.race_attention_fwd(q, k, v, planes, 3.0, causal=causal, key_mask=mask)
    dq, dk, dv, dbeta = racecpu.race_attention_bwd(res, g)
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-10)
    for got, want in zip(grads, (dq, dk, dv, dbeta)):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


def test_vmap_equals_leading_dims():
    q, k, v, planes, mask, g = _inputs(lead=(3,))
    f = jax.jit(jax.vmap(lambda q, k, v, m: rj.race_attention(q, k, v, planes, 2.0, causal=True, key_mask=m)))
    np.testing.assert_allclose(f(q, k, v, mask), racecpu.race_attention(q, k, v, planes, 2.0, causal=True,
                                                                          key_mask=mask), rtol=0, atol=1e-12)
    # the gradient of a vmapped loss, and a vmapped beta
    betas = jnp.array([1.0, 2.0, 4.0])
    dq = jax.grad(lambda q, b: jax.vmap(lambda q, k, v, b: rj.race_attention(q, k, v, planes, b).sum())(
        q, k, v, b).sum(), argnums=(0, 1))(q, betas)
    for i, b in enumerate([1.0, 2.0, 4.0]):
        _, res = racecpu.race_attention_fwd(q[i], k[i], v[i], planes, b)
        want = racecpu.race_attention_bwd(res, np.ones((12, 5)))
        np.testing.assert_allclose(dq[0][i], want[0], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(dq[1][i], want[3], rtol=1e-10)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_low_precision_dtypes(dtype):
    q, k, v, planes, _, g = _inputs(dtype=np.float32)
    qd, kd, vd = (jnp.asarray(x, dtype=dtype) for x in (q, k, v))
    out = rj.race_attention(qd, kd, vd, planes)
    assert out.dtype == dtype
    want = racecpu.race_attention(*(np.asarray(x, dtype=np.float32) for x in (qd, kd, vd)), planes)
    np.testing.assert_array_equal(np.asarray(out, dtype=np.float32), np.asarray(want.astype(dtype), np.float32))
    dq = jax.grad(lambda q: rj.race_attention(q, kd, vd, planes).astype(jnp.float32).sum())(qd)
    assert dq.dtype == dtype


def test_example_train_step_runs():
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "jax_train_step.py"
    spec = importlib.util.spec_from_file_location("jax_train_step", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    losses = mod.main(steps=8, verbose=False)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


@pytest.mark.parametrize("causal", [False, True])
def test_learn_planes_gradient_equals_numpy_api(causal):
    q, k, v, planes, _, g = _inputs()

    def loss(planes, learn):
        return jnp.vdot(rj.race_attention(q, k, v, planes, 2.0, causal=causal, learn_planes=learn), g)

    dW = jax.jit(jax.grad(lambda W: loss(W, True)))(jnp.asarray(planes))
    _, res = racecpu.race_attention_fwd(q, k, v, planes, 2.0, causal=causal)
    want = racecpu.race_attention_bwd(res, g, dplanes=True)[4]
    np.testing.assert_allclose(dW, want, rtol=1e-10, atol=1e-12)
    assert np.abs(want).sum() > 0
    np.testing.assert_array_equal(jax.grad(lambda W: loss(W, False))(jnp.asarray(planes)), 0)

"""16-bit inputs (float16, ml_dtypes' bfloat16): the bit conversions against NumPy and
ml_dtypes, and the API against float32 computation on the widened inputs."""

import numpy as np
import pytest

import racecpu
from racecpu._checks import dtypes, half_format
from racecpu._kernels import convert

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
FORMATS = [(convert.BFLOAT16, BF16), (convert.FLOAT16, F16)]


@pytest.mark.parametrize("fmt,dt", FORMATS, ids=["bfloat16", "float16"])
def test_widen_every_16_bit_pattern(fmt, dt):
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(h.size, np.float32)
    convert.widen(h, out.view(np.uint32), fmt)
    ref = h.view(dt).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(out.view(np.uint32)[~nan], ref.view(np.uint32)[~nan])  # signed zeros, subnormals


@pytest.mark.parametrize("fmt,dt", FORMATS, ids=["bfloat16", "float16"])
def test_narrow_rounds_like_numpy(fmt, dt):
    """Random float32 bit patterns, every float32 around float16's subnormal range and
    overflow threshold (ties among them), and the special values."""
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 2 ** 32, size=1 << 20, dtype=np.uint64).astype(np.uint32),
             np.arange(0x33000000 - 4096, 0x39000000, 61, dtype=np.uint32),   # 2^-26 .. 2^-13
             np.arange(0x477F0000, 0x47810000, dtype=np.uint32),              # 65280 .. 66048
             np.arange(0x3F800000, 0x3F820000, dtype=np.uint32),              # every tie near 1
             np.array([0, 0x7F800000, 0x7FC00000, 0x7F800001, 0x7F7FFFFF, 1, 0x00800000, 0x7F7F8000], np.uint32)]
    bits = np.concatenate(parts)
    bits = np.concatenate([bits, bits | np.uint32(0x80000000)])
    with np.errstate(all="ignore"):
        ref = bits.view(np.float32).astype(dt)
    out = np.empty(bits.size, np.uint16)
    convert.narrow(bits, out, fmt)
    nan = np.isnan(ref.astype(np.float32))
    assert np.array_equal(np.isnan(out.view(dt).astype(np.float32)), nan)
    np.testing.assert_array_equal(out[~nan], ref.view(np.uint16)[~nan])


def test_dtype_rules():
    f32, f64 = np.dtype(np.float32), np.dtype(np.float64)
    assert dtypes(BF16, BF16, BF16) == (f32, BF16)
    assert dtypes(F16, F16) == (f32, F16)
    assert dtypes(BF16, F16) == (f32, f32)      # no common 16-bit type
    assert dtypes(BF16, f32) == (f32, f32)
    assert dtypes(F16, f64) == (f64, f64)
    assert half_format(BF16) == convert.BFLOAT16 and half_format(F16) == convert.FLOAT16
    assert half_format(f32) is None and half_format(np.dtype(np.int16)) is None


def _inputs(shape, dt, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape).astype(dt) for _ in range(4))


@pytest.mark.parametrize("dt", [BF16, F16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
def test_16_bit_equals_float32_on_the_widened_inputs(dt, causal):
    """Output and every gradient: the float32 computation on the same (widened)
    values, rounded to the input's dtype, bit for bit; inputs untouched."""
    q, k, v, g = _inputs((2, 3, 600, 32), dt)
    W = racecpu.hyperplanes(32, 3, 3, seed=1)
    keep = [x.copy() for x in (q, k, v, g)]
    y, res = racecpu.race_attention_fwd(q, k, v, W, 3.0, causal=causal)
    y32, res32 = racecpu.race_attention_fwd(*(x.astype(np.float32) for x in (q, k, v)), W, 3.0, causal=causal)
    assert y.dtype == dt and y.shape == y32.shape
    np.testing.assert_array_equal(y.view(np.uint16), y32.astype(dt).view(np.uint16))
    np.testing.assert_array_equal(racecpu.race_attention(q, k, v, W, 3.0, causal=causal).view(np.uint16),
                                  y.view(np.uint16))
    # the residuals hold the caller's 16-bit arrays, not float32 copies
    assert res.v.dtype == dt and np.shares_memory(res.v, v) and np.shares_memory(res.q, q)
    grads = racecpu.race_attention_bwd(res, g, dplanes=True)
    ref = racecpu.race_attention_bwd(res32, g.astype(np.float32), dplanes=True)
    for a, b in zip(grads[:3], ref[:3]):
        assert a.dtype == dt
        np.testing.assert_array_equal(a.view(np.uint16), b.astype(dt).view(np.uint16))
    assert grads[3] == ref[3]
    np.testing.assert_array_equal(grads[4], ref[4])
    for x, x0 in zip((q, k, v, g), keep):
        np.testing.assert_array_equal(x.view(np.uint16), x0.view(np.uint16))


def test_16_bit_out_buffers_and_strided_input():
    q, k, v, g = _inputs((3, 500, 16), BF16)
    W = racecpu.hyperplanes(16, 2, 4, seed=2)
    qs = np.asfortranarray(q)  # not C-contiguous: widened through a contiguous copy
    out = np.empty((3, 500, 16), BF16)
    y = racecpu.race_attention(qs, k, v, W, out=out)
    assert y is out
    np.testing.assert_array_equal(out.view(np.uint16), racecpu.race_attention(q, k, v, W).view(np.uint16))
    _, res = racecpu.race_attention_fwd(q, k, v, W)
    bufs = tuple(np.empty((3, 500, 16), BF16) for _ in range(3))
    dq, dk, dv, _ = racecpu.race_attention_bwd(res, g, out=bufs)
    assert dq is bufs[0] and dv is bufs[2]
    for a, b in zip((dq, dk, dv), racecpu.race_attention_bwd(res, g)[:3]):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


def test_16_bit_nan_is_refused_and_mixed_dtypes():
    q, k, v, _ = _inputs((2, 300, 16), BF16)
    W = racecpu.hyperplanes(16, 3, 2, seed=0)
    bad = k.copy()
    bad[1, 7, 3] = np.nan
    with pytest.raises(ValueError, match="k contains NaN"):
        racecpu.race_attention(q, bad, v, W)
    y = racecpu.race_attention(q, k.astype(np.float16), v, W)  # bfloat16 with float16: float32 out
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, racecpu.race_attention(*(x.astype(np.float32) for x in (q, k, v)), W))
    assert racecpu.race_attention(q, k, v.astype(np.float64), W).dtype == np.float64
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64"):
        racecpu.race_attention(q.view(np.int16), k, v, W)


def test_torch_bfloat16_crosses_without_a_copy():
    torch = pytest.importorskip("torch")
    q, k, v, _ = _inputs((2, 400, 16), np.float32)
    W = racecpu.hyperplanes(16, 3, 3, seed=0)
    tq, tk, tv = (torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v))
    y = racecpu.race_attention(tq, tk, tv, W)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
    ref = racecpu.race_attention(*(t.view(torch.int16).numpy().view(BF16) for t in (tq, tk, tv)), W)
    np.testing.assert_array_equal(y.view(torch.int16).numpy(), ref.view(np.int16))

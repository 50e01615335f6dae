"""racecpu.cuda against the CPU path, under Numba's CUDA simulator when there is no GPU.

The simulator must be switched on before ``numba.cuda`` is first imported, so
this module sets ``numba.core.config.ENABLE_CUDASIM`` at import (what
``NUMBA_ENABLE_CUDASIM=1`` does) unless ``RACECPU_TEST_GPU=1`` asks for the
real device.  The simulator runs every
CUDA thread as a Python thread: sizes here are tiny, with 4 threads per block
and 8-token chunks so that every kernel crosses tiles and chunks.
"""

import importlib.util
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import racecpu
from racecpu import reference

if importlib.util.find_spec("numba_cuda") is None:
    pytest.skip("numba-cuda is not installed (pip install 'racecpu[test]' or 'numba-cuda>=0.30')",
                allow_module_level=True)

_GPU = os.environ.get("RACECPU_TEST_GPU") == "1"
if not _GPU and "numba.cuda" not in sys.modules:
    # numba.cuda reads the flag from numba.core.config, which other test modules have
    # loaded already.  Set the attribute, not the environment: numba re-reads its
    # config when NUMBA_* variables change, and a change after import breaks the
    # CPU dispatchers of this same process (numba 0.68).
    import numba.core.config

    numba.core.config.ENABLE_CUDASIM = 1

from numba import cuda  # noqa: E402

if not cuda.is_available():
    pytest.skip("numba.cuda sees no GPU and the simulator is off (numba.cuda was imported before "
                "tests/test_cuda.py could enable it): run NUMBA_ENABLE_CUDASIM=1 pytest tests/test_cuda.py",
                allow_module_level=True)

import racecpu.cuda as rc  # noqa: E402

TOL = {np.float32: 1e-5, np.float64: 1e-10}


@pytest.fixture(scope="module", autouse=True)
def simulator_threads():
    """Under the simulator: shared arrays allocated under a lock, and a short GIL switch interval.

    numba-cuda's simulator (0.30) finds a block's shared array by the line that declares it,
    with a look-up and an insert that two of its Python threads can interleave: each then gets
    an array of its own, and a kernel that exchanges values through shared memory reads
    garbage (seen once in 10 runs of the fused hash at a 1 us switch interval).  Its look-up
    also walks the whole stack with source lines, per thread and call.  Here it is the same
    look-up by the caller's frame, under a lock.  The simulator's block manager polls its
    threads holding the GIL, so at Python's default 5 ms switch interval every
    ``syncthreads`` waits several intervals: 0.1 ms made the fused hash ~12x faster.
    """
    if _GPU:
        yield
        return
    import threading

    from numba.core import types
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    from numba.np.numpy_support import as_dtype

    lock = threading.Lock()
    original = FakeCUDAShared.array

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory, or the simulator's error
            return original(self, shape, dtype, alignment)
        frame = sys._getframe(1)
        where = (frame.f_code.co_filename, frame.f_lineno)
        with lock:
            found = self._allocations.get(where)
            if found is None:
                found = self._allocations[where] = np.empty(
                    shape, as_dtype(dtype) if isinstance(dtype, types.Type) else dtype)
        return found

    interval = sys.getswitchinterval()
    FakeCUDAShared.array = array
    sys.setswitchinterval(1e-4)
    try:
        yield
    finally:
        FakeCUDAShared.array = original
        sys.setswitchinterval(interval)


@pytest.fixture(autouse=True, params=["tiles", "chunkwise"])
def small_tiles(request, monkeypatch):
    """Each test on both formulations (:data:`racecpu.cuda.PATH`; the chunkwise one runs on
    NumPy under the simulator, on CuPy on a GPU), with 4 threads per block and 8-token chunks:
    several tiles per chunk, several chunks per head, and 4-token scan chunks and partials."""
    monkeypatch.setattr(rc, "PATH", request.param)
    monkeypatch.setattr(rc, "THREADS", 4)
    monkeypatch.setattr(rc, "CHUNK", 8)
    monkeypatch.setattr(rc, "SCAN_CHUNK", 4)
    monkeypatch.setattr(rc, "SUM_CHUNK", 4)
    monkeypatch.setattr(rc.CudaOps, "SCAN_THREADS", 16)  # scans of several chunks per segment
    monkeypatch.setattr(rc.CudaOps, "FUSED_CHUNK", 8)    # fused blocks of 2 tiles of 4 tokens
    monkeypatch.setattr(rc.CudaOps, "FUSED_TILE", 4)
    monkeypatch.setattr(rc.CudaOps, "HASH_THREADS", 32)  # a warp per block: the simulator's threads are slow
    # The simulator runs the fused kernels' barriers and exchanges slowly: the API tests take the
    # array form at their sizes (FUSED_MIN_TOKENS) and the cuBLAS hash; the fused tests below switch
    # the kernels on and compare them with it.
    monkeypatch.setattr(rc.CudaOps, "FUSED_HASH", False)
    return request.param


#: For tests that do not read rc.PATH (the fused kernels' tests call racecpu.chunkwise directly,
#: the PTX check compiles every kernel): run once, not under both of small_tiles' paths.
_ONCE = pytest.mark.parametrize("small_tiles", ["chunkwise"], indirect=True)


def host(x):
    return x if isinstance(x, np.ndarray) else x.copy_to_host()


def _address(a):
    """Where a device array's data starts (under the simulator: that of the NumPy array it wraps)."""
    if hasattr(a, "__cuda_array_interface__"):
        return a.__cuda_array_interface__["data"][0]
    return a._ary.__array_interface__["data"][0]


def assert_close(got, want, rtol, what=""):
    """Max-norm relative error: max |got - want| <= rtol * max |want|."""
    got, want = np.asarray(host(got), np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    scale = max(np.max(np.abs(want), initial=0.0), 1e-30)
    err = np.max(np.abs(got - want), initial=0.0) / scale
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:g}"


def problem(rng, lead, nq, nk, d, dv, dtype, masked=True):
    q = rng.standard_normal(lead + (nq, d)).astype(dtype)
    k = rng.standard_normal(lead + (nk, d)).astype(dtype)
    v = rng.standard_normal(lead + (nk, dv)).astype(dtype)
    mask = rng.random(lead + (nk,)) > 0.25 if masked else None
    return q, k, v, mask


def compare(q, k, v, planes, beta, causal, mask, rtol, g=None):
    out, res = rc.race_attention_fwd(q, k, v, planes, beta, causal=causal, key_mask=mask)
    ref, rres = racecpu.race_attention_fwd(q, k, v, planes, beta, causal=causal, key_mask=mask)
    assert out.dtype == ref.dtype
    assert_close(out, ref, rtol, "out")
    if g is None:
        g = np.random.default_rng(7).standard_normal(ref.shape).astype(ref.dtype)
    grads = rc.race_attention_bwd(res, g)
    want = racecpu.race_attention_bwd(rres, g)
    for name, a, b in zip(("dq", "dk", "dv"), grads[:3], want[:3]):
        assert a.dtype == b.dtype, name
        assert_close(a, b, rtol, name)
    assert isinstance(grads[3], float)
    assert abs(grads[3] - want[3]) <= rtol * max(abs(want[3]), 1e-3), (grads[3], want[3])
    return out, grads


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_cpu_with_key_mask(rng, dtype, causal):
    # 21 tokens = 3 chunks of 8 (the last partial), each 2 tiles of 4; 2 x 2 heads
    q, k, v, mask = problem(rng, (2, 2), 21, 21, 5, 3, dtype)
    planes = racecpu.hyperplanes(5, 2, 3, seed=1)
    compare(q, k, v, planes, 1.5, causal, mask, TOL[dtype])


@pytest.mark.parametrize("causal", [False, True])
def test_matches_cpu_wide_values_default_beta(rng, causal):
    # dv + 1 > threads per block: the column phase loops; default beta (8) and P = 3
    q, k, v, _ = problem(rng, (1,), 13, 13, 6, 9, np.float64)
    planes = racecpu.hyperplanes(6, 3, 2, seed=2)
    compare(q, k, v, planes, racecpu.DEFAULT_BETA, causal, None, TOL[np.float64])


def test_noncausal_more_keys_than_queries(rng):
    q, k, v, mask = problem(rng, (2,), 7, 26, 4, 3, np.float32)
    planes = racecpu.hyperplanes(4, 3, 2, seed=3)
    compare(q, k, v, planes, 4.0, False, mask, TOL[np.float32])


def test_matches_dense_oracle(rng):
    """Independent of the CPU kernels: the O(N^2) dense statement of the same estimator."""
    q, k, v, _ = problem(rng, (2,), 11, 11, 4, 3, np.float64, masked=False)
    planes = racecpu.hyperplanes(4, 2, 3, seed=4)
    for causal in (False, True):
        out = rc.race_attention(q, k, v, planes, 2.0, causal=causal)
        want = reference.race_attention_dense(q, k, v, planes, 2.0, causal=causal)
        assert_close(out, want, 1e-10, f"causal={causal}")


def test_float16_in_float16_out(rng):
    q, k, v, mask = problem(rng, (2,), 10, 10, 4, 3, np.float16)
    planes = racecpu.hyperplanes(4, 2, 2, seed=5)
    out, grads = compare(q, k, v, planes, 2.0, True, mask, 1e-3)
    assert out.dtype == np.float16 and all(x.dtype == np.float16 for x in grads[:3])


@_ONCE
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_heads_in_segments_match_cpu(rng, causal, fused, monkeypatch):
    """racecpu.cuda.WORKSPACE too small for one head: the chunkwise form cuts each head into
    segments of 8 tokens, and float16 inputs keep their projections, not their buckets
    (KEEP_BUCKETS None); out and gradients still equal the CPU path's, with the array form or the
    fused kernels."""
    monkeypatch.setattr(rc, "WORKSPACE", 1)
    monkeypatch.setattr(rc, "SCAN_CHUNK", 4)
    monkeypatch.setattr(rc, "SUM_CHUNK", 8)
    monkeypatch.setattr(rc.CudaOps, "FUSED_CHUNK", 8)
    monkeypatch.setattr(rc.CudaOps, "FUSED_MIN_TOKENS", 0 if fused else 2 ** 30)
    q, k, v, mask = problem(rng, (2,), 21, 21, 4, 3, np.float16)
    planes = racecpu.hyperplanes(4, 2, 2, seed=5)
    _, res = rc.race_attention_fwd(q, k, v, planes, 2.0, causal=causal, key_mask=mask)
    assert res.state["slab"] == (1, 8) and res.state["phiq"] is None and res.state["uq"] is not None
    compare(q, k, v, planes, 2.0, causal, mask, 1e-3)


@_ONCE
@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_bits_equal_the_float32_call_rounded(rng, causal, monkeypatch):
    """racecpu.cuda.Bfloat16: bfloat16 q, k, v and grad_out as uint16 patterns on the device give
    Bfloat16 out, dq, dk, dv whose bits are those of the float32 call on the same (exactly
    widened) values rounded by ml_dtypes, and dbeta equal; out near the CPU path's on ml_dtypes
    arrays; a NaN pattern is refused by the finiteness check and float bits with an error that says
    why; the tile kernels (``PATH = "tiles"``) give the bits of their own float32 call rounded."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf = np.dtype(ml_dtypes.bfloat16)
    q, k, v, mask = problem(rng, (2,), 21, 21, 4, 3, np.float32)
    g = rng.standard_normal((2, 21, 3)).astype(np.float32)
    q, k, v, g = (x.astype(bf) for x in (q, k, v, g))
    planes = racecpu.hyperplanes(4, 2, 2, seed=5)

    def bits(x):
        return rc.Bfloat16(cuda.to_device(x.view(np.uint16)))

    out, res = rc.race_attention_fwd(bits(q), bits(k), bits(v), planes, 2.0, causal=causal, key_mask=mask)
    assert isinstance(out, rc.Bfloat16) and out.shape == (2, 21, 3) and out.dtype == bf
    grads = rc.race_attention_bwd(res, bits(g))
    wide = [cuda.to_device(x.astype(np.float32)) for x in (q, k, v, g)]
    o32, r32 = rc.race_attention_fwd(*wide[:3], planes, 2.0, causal=causal, key_mask=mask)
    want = (o32,) + rc.race_attention_bwd(r32, wide[3])
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out,) + grads[:3], want):
        assert isinstance(a, rc.Bfloat16) and host(a.bits).dtype == np.int16, name
        np.testing.assert_array_equal(host(a.bits).view(np.uint16), host(b).astype(bf).view(np.uint16), err_msg=name)
    assert grads[3] == want[3]
    ref = racecpu.race_attention(q, k, v, planes, 2.0, causal=causal, key_mask=mask)
    assert_close(host(out.bits).view(bf).astype(np.float32), ref.astype(np.float32), 1e-2, "out against the CPU")
    bad = q.copy()
    bad[1, 3, 2] = np.nan
    with pytest.raises(ValueError, match="q contains NaN or Inf"):
        rc.race_attention_fwd(bits(bad), bits(k), bits(v), planes, 2.0, causal=causal)
    with pytest.raises(TypeError, match="int16 or uint16"):
        rc.Bfloat16(cuda.to_device(np.zeros(3, np.float32)))
    # the tile kernels read the bits in their kernels and round their results the same way
    monkeypatch.setattr(rc, "PATH", "tiles")
    out, res = rc.race_attention_fwd(bits(q), bits(k), bits(v), planes, 2.0, causal=causal, key_mask=mask)
    grads = rc.race_attention_bwd(res, bits(g))
    o32, r32 = rc.race_attention_fwd(*wide[:3], planes, 2.0, causal=causal, key_mask=mask)
    want = (o32,) + rc.race_attention_bwd(r32, wide[3])
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out,) + grads[:3], want):
        assert isinstance(a, rc.Bfloat16), name
        np.testing.assert_array_equal(host(a.bits).view(np.uint16), host(b).astype(bf).view(np.uint16), err_msg=name)
    assert grads[3] == want[3]


@_ONCE
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_tiles_read_and_write_16_bit_in_their_dtype(rng, causal, half, monkeypatch):
    """The tile kernels (``PATH = "tiles"``, and every call with packed sequences) read 16-bit q,
    k, v and grad_out in their dtype and write out, dq, dk, dv in theirs: the bits of their own
    float32 call on the same (exactly widened) values, each rounded once, with dplanes and dbeta
    equal, for grouped heads, a key mask and packed sequences; and on the way no 16-bit array is
    widened or cast (every cast and bfloat16 widening recorded: only the float64 sketches are
    cast); v is kept by reference."""
    from racecpu import chunkwise
    monkeypatch.setattr(rc, "PATH", "tiles")
    if half == "bfloat16":
        dt = np.dtype(pytest.importorskip("ml_dtypes").bfloat16)

        def dev16(x):
            return rc.Bfloat16(cuda.to_device(np.ascontiguousarray(x).view(np.uint16)))

        def bits(a):
            assert isinstance(a, rc.Bfloat16)
            return host(a.bits).view(np.uint16)
    else:
        dt = np.dtype(np.float16)
        dev16 = cuda.to_device

        def bits(a):
            assert host(a).dtype == np.float16
            return host(a).view(np.uint16)
    q = rng.standard_normal((2, 30, 4)).astype(dt)
    k, v = (rng.standard_normal((1, 30, 4)).astype(dt) for _ in range(2))   # two query heads a key/value head
    mask = rng.random((1, 30)) > 0.25
    g = rng.standard_normal((2, 30, 4)).astype(dt)
    planes = racecpu.hyperplanes(4, 2, 2, seed=5)
    casts = []
    real_cast, real_astype = rc._Device.cast, chunkwise.Bfloat16Bits.astype
    monkeypatch.setattr(rc._Device, "cast", lambda self, a, *args: casts.append(np.dtype(a.dtype)) or
                        real_cast(self, a, *args))
    monkeypatch.setattr(chunkwise.Bfloat16Bits, "astype", lambda self, *args, **kw: casts.append("bfloat16") or
                        real_astype(self, *args, **kw))
    for cu in (None, np.array([0, 5, 5, 19, 27, 30], np.int32)):
        casts.clear()
        v_dev = dev16(v)
        out, res = rc.race_attention_fwd(dev16(q), dev16(k), v_dev, planes, 2.0, causal=causal, key_mask=mask,
                                         cu_seqlens=cu)
        got = rc.race_attention_bwd(res, dev16(g), dplanes=True)
        assert set(casts) <= {np.dtype(np.float64)}, (cu, casts)
        if cu is None:   # the caller's v (the same memory) is what the backward reads
            v_bits = v_dev.bits if half == "bfloat16" else v_dev
            assert _address(res.v) == _address(v_bits)
        wide = [cuda.to_device(x.astype(np.float32)) for x in (q, k, v, g)]
        o32, r32 = rc.race_attention_fwd(*wide[:3], planes, 2.0, causal=causal, key_mask=mask, cu_seqlens=cu)
        want = (o32,) + rc.race_attention_bwd(r32, wide[3], dplanes=True)
        for name, a, b in zip(("out", "dq", "dk", "dv"), (out,) + got[:3], want):
            np.testing.assert_array_equal(bits(a), host(b).astype(dt).view(np.uint16), err_msg=f"{name}, cu={cu}")
        assert got[3] == want[4]
        np.testing.assert_array_equal(host(got[4]), host(want[5]), err_msg="dplanes")
        ref = racecpu.race_attention(q, k, v, planes, 2.0, causal=causal, key_mask=mask, cu_seqlens=cu)
        assert_close(bits(out).view(dt).astype(np.float32), ref.astype(np.float32), 1e-2, "out against the CPU")
    # the public soft hash reads x as it is too
    phi = rc.soft_buckets(dev16(q), planes, 2.0)
    np.testing.assert_array_equal(bits(phi), host(rc.soft_buckets(wide[0], planes, 2.0)).astype(dt).view(np.uint16))


@_ONCE
@pytest.mark.parametrize("causal", [False, True])
def test_forward_alone_keeps_no_residuals(rng, causal, monkeypatch):
    """rc.race_attention (and the backend's forward with residuals=False) runs the chunkwise
    forward with nothing kept for a backward, and gives race_attention_fwd's out to the bit."""
    from racecpu import chunkwise
    q, k, v, mask = problem(rng, (2,), 21, 21, 4, 3, np.float32)
    planes = racecpu.hyperplanes(4, 2, 2, seed=5)
    asked = []
    real = chunkwise.forward
    monkeypatch.setattr(chunkwise, "forward", lambda *a, **kw: asked.append(kw["residuals"]) or real(*a, **kw))
    out = rc.race_attention(q, k, v, planes, 2.0, causal=causal, key_mask=mask)
    alone, none = rc.BACKEND.forward(q, k, v, planes, 2.0, causal=causal, key_mask=mask, residuals=False)
    want, _ = rc.race_attention_fwd(q, k, v, planes, 2.0, causal=causal, key_mask=mask)
    assert asked == [False, False, True] and none is None
    np.testing.assert_array_equal(host(out), host(want))
    np.testing.assert_array_equal(host(alone), host(want))


def test_soft_buckets_match_cpu(rng):
    x = rng.standard_normal((2, 9, 5))
    planes = racecpu.hyperplanes(5, 3, 2, seed=6)
    for dtype in (np.float32, np.float64):
        got = rc.soft_buckets(x.astype(dtype), planes, 3.0)
        want = racecpu.soft_buckets(x.astype(dtype), planes, 3.0)
        assert got.shape == want.shape == (2, 9, 2, 8) and got.dtype == want.dtype
        assert_close(got, want, TOL[dtype], str(dtype))
        assert_close(host(got).sum(-1), np.ones((2, 9, 2)), TOL[dtype], "rows sum to 1")


def test_fully_masked_and_underflowing_rows_follow_the_den_guard(rng):
    """Rows with den <= DEN_FLOOR give zeros and pass zero gradient, as on the CPU; never NaN."""
    q, k, v, mask = problem(rng, (2,), 9, 9, 4, 3, np.float32)
    mask[0] = False                      # head 0: every key masked
    mask[1, :5] = False                  # head 1: causal prefixes with no key at all
    planes = racecpu.hyperplanes(4, 3, 2, seed=7)
    for causal in (False, True):
        out, grads = compare(q, k, v, planes, 1e4, causal, mask, TOL[np.float32])
        assert np.all(host(out)[0] == 0)
        assert all(np.isfinite(host(x)).all() for x in (out,) + tuple(grads[:3]))


def test_device_inputs_give_device_outputs_and_are_not_mutated(rng):
    q, k, v, mask = problem(rng, (2,), 10, 10, 4, 3, np.float32)
    planes = racecpu.hyperplanes(4, 2, 2, seed=8)
    dq, dk, dv, dm, dp = (cuda.to_device(x) for x in (q, k, v, mask, planes))
    out, res = rc.race_attention_fwd(dq, dk, dv, dp, 2.0, causal=True, key_mask=dm)
    assert cuda.devicearray.is_cuda_ndarray(out)
    g = cuda.to_device(np.ones(out.shape, np.float32))
    grads = rc.race_attention_bwd(res, g)
    assert all(cuda.devicearray.is_cuda_ndarray(x) for x in grads[:3])
    ref = racecpu.race_attention(q, k, v, planes, 2.0, causal=True, key_mask=mask)
    assert_close(out, ref, TOL[np.float32], "out")
    for a, b in zip((dq, dk, dv, dm, dp), (q, k, v, mask, planes)):
        np.testing.assert_array_equal(a.copy_to_host(), b)


def test_top_level_keeps_numpy_on_the_cpu(rng):
    q, k, v, _ = problem(rng, (1,), 6, 6, 4, 2, np.float64)
    planes = racecpu.hyperplanes(4, 2, 2)
    assert isinstance(racecpu.race_attention(q, k, v, planes), np.ndarray)


def test_numpy_api_sends_cupy_input_and_gpu_residuals_to_the_gpu(rng, monkeypatch):
    """racecpu.race_attention_fwd with ``q`` in GPU memory calls racecpu.cuda's forward (CuPy is not
    here: a stand-in that exports ``__cuda_array_interface__``, and a recording forward);
    race_attention_bwd with the GPU forward's residuals runs racecpu.cuda's backward (for real, on
    the simulator)."""
    q, k, v, _ = problem(rng, (2,), 10, 10, 4, 3, np.float64)
    planes = racecpu.hyperplanes(4, 2, 2, seed=8)
    g = rng.standard_normal(q.shape[:-1] + (3,))
    out, res = rc.race_attention_fwd(*(cuda.to_device(x) for x in (q, k, v)), planes, 2.0, causal=True)
    grads = racecpu.race_attention_bwd(res, cuda.to_device(g))
    assert all(cuda.devicearray.is_cuda_ndarray(x) for x in grads[:3])
    ref = racecpu.race_attention_bwd(racecpu.race_attention_fwd(q, k, v, planes, 2.0, causal=True)[1], g)
    for name, a, b in zip(("dq", "dk", "dv"), grads, ref):
        assert_close(a, b, TOL[np.float64], name)
    assert abs(grads[3] - ref[3]) <= 1e-9 * max(1.0, abs(ref[3]))
    dW = racecpu.race_attention_bwd(res, cuda.to_device(g), dplanes=True)[4]
    assert_close(dW, racecpu.race_attention_bwd(racecpu.race_attention_fwd(q, k, v, planes, 2.0, causal=True)[1], g,
                                                dplanes=True)[4], TOL[np.float64], "dplanes")
    with pytest.raises(TypeError, match="out is for NumPy"):
        racecpu.race_attention_bwd(res, cuda.to_device(g), out=(q, k, v))

    stand_in = type("ndarray", (), {"__cuda_array_interface__": {}})()
    calls = []
    monkeypatch.setattr(rc, "race_attention_fwd", lambda *a, **kw: calls.append((a, kw)) or ("out", "res"))
    assert racecpu.race_attention_fwd(stand_in, k, v, planes, 2.0, causal=True) == ("out", "res")
    assert calls == [((stand_in, k, v, planes, 2.0), dict(causal=True, key_mask=None, check_finite=True,
                                                          cu_seqlens=None, planes_grad=True))]
    with pytest.raises(TypeError, match="out is for NumPy"):
        racecpu.race_attention_fwd(stand_in, k, v, planes, out=np.empty(3))


def test_empty_inputs(rng):
    planes = racecpu.hyperplanes(4, 2, 2)
    q = np.zeros((0, 5, 4), np.float32)
    out, res = rc.race_attention_fwd(q, q, q, planes)
    assert out.shape == (0, 5, 4)
    assert rc.race_attention_bwd(res, np.zeros((0, 5, 4), np.float32))[3] == 0.0
    q = rng.standard_normal((2, 3, 4)).astype(np.float32)
    k = np.zeros((2, 0, 4), np.float32)
    out, res = rc.race_attention_fwd(q, k, k, planes)
    assert out.shape == (2, 3, 4) and not host(out).any()
    dq, dk, dv, dbeta = rc.race_attention_bwd(res, np.ones((2, 3, 4), np.float32))
    assert not host(dq).any() and dk.shape == (2, 0, 4) and dbeta == 0.0


# ---------------------------------------------------------------------------
# errors: the same type and message as the CPU functions, in the same order
# ---------------------------------------------------------------------------

def _args(rng):
    q, k, v, mask = problem(rng, (2,), 6, 6, 4, 3, np.float32)
    return dict(q=q, k=k, v=v, planes=racecpu.hyperplanes(4, 2, 2), beta=2.0, causal=False, key_mask=mask)


def _bad(name, value=None, **extra):
    def edit(a):
        a = dict(a)
        if name is not None:
            a[name] = value(a) if callable(value) else value
        a.update(extra)
        return a
    return edit


BAD = {
    "int q": _bad("q", lambda a: a["q"].astype(np.int32)),
    "1-d k": _bad("k", lambda a: a["k"][0, 0]),
    "nan v": _bad("v", lambda a: np.where(np.arange(3) == 1, np.nan, a["v"]).astype(np.float32)),
    "nan q and int k (q first)": _bad("q", lambda a: a["q"] * np.nan, k=np.zeros((2, 6, 4), np.int64)),
    "lead dims": _bad("v", lambda a: a["v"][:1]),
    "head dim": _bad("k", lambda a: a["k"][..., :3]),
    "tokens": _bad("v", lambda a: a["v"][:, :5]),
    "causal Nq != Nk": _bad("q", lambda a: a["q"][:, :5], causal=True),
    "planes head dim": _bad("planes", racecpu.hyperplanes(3, 2, 2)),
    "planes rank": _bad("planes", np.zeros((2, 4))),
    "planes nan": _bad("planes", lambda a: a["planes"] * np.nan),
    "beta zero": _bad("beta", 0.0),
    "beta bool": _bad("beta", True),
    "mask dtype": _bad("key_mask", lambda a: a["key_mask"].astype(np.int8)),
    "mask shape": _bad("key_mask", lambda a: a["key_mask"][:, :5]),
}


def _raised(fn, a):
    with pytest.raises((TypeError, ValueError)) as exc:
        fn(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("planes"), a.pop("beta"), **a)
    return exc.type, str(exc.value)


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("case", list(BAD))
def test_errors_match_cpu(rng, case, on_device):
    a = BAD[case](_args(rng))
    want = _raised(racecpu.race_attention_fwd, dict(a))
    if on_device:
        a = {n: cuda.to_device(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x for n, x in a.items()}
    assert _raised(rc.race_attention_fwd, a) == want


def test_backward_errors(rng):
    a = _args(rng)
    out, res = rc.race_attention_fwd(a["q"], a["k"], a["v"], a["planes"], a["beta"])
    _, rres = racecpu.race_attention_fwd(a["q"], a["k"], a["v"], a["planes"], a["beta"])
    for g in (np.ones((2, 6, 2), np.float32), np.full(out.shape, np.nan, np.float32),
              cuda.to_device(np.full(out.shape, np.inf, np.float32))):
        with pytest.raises(ValueError) as got:
            rc.race_attention_bwd(res, g)
        with pytest.raises(ValueError) as want:
            racecpu.race_attention_bwd(rres, host(g))
        assert str(got.value) == str(want.value)
    with pytest.raises(TypeError, match="racecpu.cuda.race_attention_fwd"):
        rc.race_attention_bwd(rres, np.ones(out.shape, np.float32))
    with pytest.raises(TypeError, match="must be an array of floats|float16, bfloat16, float32 or float64|float16, float32 or float64"):
        rc.soft_buckets(cuda.to_device(np.zeros((3, 4), np.int32)), a["planes"])


def test_check_finite_false_skips_the_scan(rng):
    a = _args(rng)
    q = a["q"].copy()
    q[0, 0, 0] = np.inf
    out = rc.race_attention(cuda.to_device(q), a["k"], a["v"], a["planes"], check_finite=False)
    assert out.shape == (2, 6, 3)


# ---------------------------------------------------------------------------
# the real compiler: every kernel must lower to PTX for a GPU (no GPU needed)
# ---------------------------------------------------------------------------

_PTX_TARGETS = [((8, 0), "float32"), ((8, 0), "float64"), ((9, 0), "float32"), ((9, 0), "float64")]

_PTX = textwrap.dedent("""
    import sys, types, numpy as np
    import numba.cuda.dispatcher as disp
    from numba import cuda, types as nt
    from racecpu.cuda import _kernels as K
    from racecpu.cuda import THREADS
    from racecpu.cuda._chunk_kernels import make_chunk_kernels, make_hash_kernels
    A = lambda dt, nd: nt.Array(dt, nd, "C")
    d, b, i, h = nt.float64, nt.boolean, nt.int64, nt.float16
    for target in sys.argv[1:]:
        cc_s, dtype = target.split(":")
        cc = tuple(int(c) for c in cc_s.split("."))
        # device functions ask the current GPU for its compute capability: answer for this target
        disp.get_current_device = lambda cc=cc: types.SimpleNamespace(compute_capability=cc)
        f = getattr(nt, dtype)  # the compute dtype; partial sums and beta are float64 whatever it is
        k = K.make_kernels(3, 3, THREADS, np.dtype(dtype))

        def tile_sigs(x):  # as racecpu.cuda launches them, with q, k, v, grad_out and results of type x
            return {
                "soft_hash_rows": (A(x, 2), A(f, 3), d, A(f, 2), A(f, 2)),
                "sketch_chunks": (A(x, 3), A(x, 3), A(b, 2), A(f, 3), d, i, A(f, 3), A(f, 3), A(d, 4)),
                "queries_fwd": (A(x, 3), A(f, 3), d, A(f, 4), A(i, 1), i, i, A(f, 3), A(f, 3), A(d, 2), A(x, 3)),
                "queries_bwd": (A(x, 3), A(f, 3), A(f, 3), A(d, 2), A(f, 4), A(i, 1), i, A(f, 3), d, i, A(x, 3),
                                A(d, 2), A(d, 2), A(d, 4), A(d, 1), b, A(d, 3)),
                "keys_bwd": (A(x, 3), A(f, 3), A(f, 3), A(f, 4), A(i, 1), i, A(f, 3), d, A(x, 3), A(x, 3),
                             A(d, 1), b, A(d, 3)),
                "causal_fwd": (A(x, 3), A(x, 3), A(f, 3), A(d, 4), i, A(f, 3), d, i, A(f, 3), A(f, 3), A(f, 3),
                               A(d, 2), A(x, 3)),
                "causal_queries_bwd": (A(x, 3), A(x, 3), A(f, 3), A(f, 3), A(f, 3), A(d, 2), A(d, 4), i, A(f, 3), d,
                                       i, A(f, 3), A(x, 3), A(d, 2), A(d, 2), A(d, 4), A(d, 1), b, A(d, 3)),
                "causal_keys_bwd": (A(x, 3), A(x, 3), A(f, 3), A(f, 3), A(f, 3), A(d, 2), A(d, 2), A(d, 4), i,
                                    A(f, 3), d, i, A(f, 3), A(x, 3), A(x, 3), A(d, 1), b, A(d, 3)),
            }
        sigs = tile_sigs(f)
        fns = [(k[n].py_func, s) for n, s in sigs.items()] + [
            (K.sum_chunks.py_func, (A(d, 3), A(i, 1), A(d, 3))),
            (K.plane_sums.py_func, (A(d, 2), A(f, 2), i, A(d, 2))),
            (K.scan_chunks.py_func, (A(d, 3), A(i, 1), A(d, 3), b)),
            (K.scatter_rows.py_func, (A(f, 3), A(i, 1), A(f, 3))), (K.scatter_rows.py_func, (A(b, 3), A(i, 1), A(b, 3))),
            (K.gather_rows.py_func, (A(f, 3), A(i, 1), A(f, 3))),
            (K.fold_groups.py_func, (A(f, 2), A(f, 2), i)),
            (K.cast_copy.py_func, (A(h, 1), A(f, 1))), (K.cast_copy.py_func, (A(f, 1), A(h, 1))),
            (K.cast_copy.py_func, (A(f, 1), A(d, 1))), (K.cast_copy.py_func, (A(d, 1), A(f, 1))),
            (K.flag_nonfinite.py_func, (A(f, 1), A(nt.int32, 1))), (K.fill.py_func, (A(b, 1), b)),
            # the chunkwise form's fused steps (racecpu.cuda.CudaOps)
            (K.hash_from_u.py_func, (A(f, 2), d, i, A(f, 2))),
            (K.hash_du_rows.py_func, (A(f, 2), A(f, 2), A(f, 2), d, i, A(f, 2), A(f, 2))),
            (K.segment_sums.py_func, (A(f, 3), i, A(d, 3))),
            (K.segment_scan.py_func, (A(f, 3), A(d, 3), i, b, A(f, 3)))]
        # the fused chunk kernels (racecpu.cuda._chunk_kernels), at the GPU's sizes: F = 24, dv <= 128
        ck = make_chunk_kernels(24, 16, 128, dtype)
        fns += [(ck["chunk_states"].py_func, (A(f, 3), A(f, 2), A(f, 3), A(f, 2), i, i, A(f, 4))),
                (ck["readout"].py_func, (A(f, 3), A(f, 3), A(f, 3), A(f, 4), i, i, b, d, A(f, 3), A(f, 2))),
                (ck["queries_bwd"].py_func, (A(f, 3), A(f, 3), A(f, 3), A(f, 3), A(f, 2), A(f, 4), i,
                                             A(f, 3), A(f, 2))),
                (ck["keys_bwd"].py_func, (A(f, 3), A(f, 3), A(f, 3), A(f, 3), A(f, 2), A(f, 2), A(f, 4), i,
                                          A(f, 3), A(f, 3))),
                (ck["nc_queries_bwd"].py_func, (A(f, 3), A(f, 3), A(f, 2), A(f, 4), i, A(f, 3), A(f, 2), A(f, 4))),
                (ck["nc_keys_bwd"].py_func, (A(f, 3), A(f, 3), A(f, 4), i, A(f, 3), A(f, 3)))]
        cb = make_chunk_kernels(24, 16, 128, dtype, True)  # CudaOps.FUSED_BLOCKED's build
        fns += [(cb["queries_bwd"].py_func, (A(f, 3), A(f, 3), A(f, 3), A(f, 3), A(f, 2), A(f, 4), i,
                                             A(f, 3), A(f, 2))),
                (cb["keys_bwd"].py_func, (A(f, 3), A(f, 3), A(f, 3), A(f, 3), A(f, 2), A(f, 2), A(f, 4), i,
                                          A(f, 3), A(f, 3)))]
        hk = make_hash_kernels(3, 3, dtype)  # the shuffle build (the simulator runs the shared-memory one)
        fns += [(hk["hash_rows"].py_func, (A(f, 2), A(f, 2), d, A(f, 2), A(f, 2))),
                (hk["hash_rows_bwd"].py_func, (A(f, 2), A(f, 2), A(f, 2), A(f, 2), d, A(f, 2), A(f, 1))),
                (hk["hash_from_u"].py_func, (A(f, 2), d, A(f, 2), A(f, 2)))]
        if dtype == "float32":  # 16-bit inputs and results read and written as they are (load, store)
            for x in (h, nt.uint16):   # float16, and bfloat16 bits
                fns += [(k[n].py_func, s) for n, s in tile_sigs(x).items()]
                fns += [(K.plane_sums.py_func, (A(d, 2), A(x, 2), i, A(d, 2)))]
            fns += [(K.flag_nonfinite.py_func, (A(h, 1), A(nt.int32, 1)))]
        for fn, sig in fns:
            ptx, _ = cuda.compile_ptx(fn, sig, cc=cc)
            assert ".entry" in ptx and f".target sm_{cc[0]}{cc[1]}" in ptx, (fn.__name__, sig, cc)
        print("compiled", len(fns), "for", target, flush=True)
""")


@pytest.fixture(scope="module")
def ptx_run():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    targets = [f"{cc[0]}.{cc[1]}:{dt}" for cc, dt in _PTX_TARGETS]
    return subprocess.run([sys.executable, "-c", _PTX, *targets], env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
@_ONCE  # one test, so one process compiles (a module fixture runs once per xdist worker)
def test_kernels_compile_to_ptx(ptx_run):
    """Lower every kernel with the real CUDA compiler (NVVM), which the simulator never runs:
    for sm_80 and sm_90, float32 and float64 compute, with the signatures the host code launches
    (and, with float32 compute, the tile kernels on float16 and bfloat16-bit arrays)."""
    p = ptx_run
    if p.returncode and ("libnvvm" in p.stderr or "libnvrtc" in p.stderr or "NVVM" in p.stderr):
        if os.environ.get("RACECPU_REQUIRE_PTX") == "1":  # .ci/cuda-ptx.sh: installed, so a skip is a failure
            pytest.fail("NVVM/NVRTC not found although RACECPU_REQUIRE_PTX=1:\n" + p.stderr[-3000:])
        pytest.skip("the CUDA compiler libraries (NVVM/NVRTC) are not installed: pip install "
                    "'cuda-toolkit[nvvm,nvrtc,cudart]==13.*' (or run .ci/cuda-ptx.sh) to run this check")
    count = {"float32": 36 + 2 * 9 + 1, "float64": 36}  # float32 compute: the 16-bit builds too
    missing = [(cc, dtype) for cc, dtype in _PTX_TARGETS
               if f"compiled {count[dtype]} for {cc[0]}.{cc[1]}:{dtype}" not in p.stdout]
    assert not missing, f"not compiled for {missing}:\n" + p.stdout + p.stderr[-3000:]


@pytest.mark.slow
def test_gpu_benchmark_runs_and_checks(capsys):
    """The GPU benchmark's code path at toy size (timings under the simulator mean nothing)."""
    from racecpu.apps import cuda_bench as bench
    errs = bench.check_against_cpu(n=20, heads=1, head_dim=4, causal=True)
    assert set(errs) == {"out", "dq", "dk", "dv"} and max(errs.values()) < 1e-5
    rows = bench.run_benchmark(log2ns=(4,), heads=1, head_dim=4, causal=(True,), threads=(None, 8), repeats=1,
                               sdpa=False, check=False, progress=False)
    both = bench.run_benchmark(log2ns=(4,), heads=1, head_dim=4, causal=(False,), repeats=1, sdpa=False, check=False,
                               progress=False, paths=("chunkwise", "tiles"))
    assert [r["path"] for r in both] == ["chunkwise", "tiles"] and all(r["GBps"] > 0 for r in both), both
    assert [r["threads"] for r in rows] == [4, 8] and all(r["median_ms"] > 0 for r in rows), rows
    assert "fwd+bwd" in bench.format_rows(rows)
    pytest.importorskip("ml_dtypes")
    half = bench.run_benchmark(log2ns=(4,), heads=1, head_dim=4, causal=(True,), repeats=1, sdpa=False, check=False,
                               progress=False, paths=("chunkwise",), dtypes=("float16", "bfloat16"))
    assert [r["dtype"] for r in half] == ["float16", "bfloat16"] and all(r["median_ms"] > 0 for r in half), half
    assert half[1]["GBps"] == pytest.approx(half[0]["GBps"] * half[0]["median_ms"] / half[1]["median_ms"])  # 2 B each
    assert "bfloat16" in bench.format_rows(half)
    odd = bench.run_benchmark(heads=1, head_dim=4, causal=(False,), repeats=1, sdpa=False, check=False,
                              progress=False, ns=(12,))
    assert [r["n"] for r in odd] == [12] and "N=12 " in bench.format_rows(odd)


_FAKE_AUTHORS = textwrap.dedent("""
    import torch

    class RaceCausalCuda(torch.nn.Module):  # their constructor and buffer; a dense causal stand-in
        def __init__(self, d_k, Kbits, L, M, device="cuda", seed=0):
            super().__init__()
            self.register_buffer("planes_T", torch.zeros((d_k, L * Kbits), device=device))

        def forward(self, Q, K, V):
            S = torch.tanh(Q @ self.planes_T) @ torch.tanh(K @ self.planes_T).transpose(-1, -2)
            return torch.softmax(S.masked_fill(torch.ones_like(S).triu(1).bool(), -1e9), -1) @ V
""")


def test_gpu_benchmark_times_the_authors_module(tmp_path):
    """--authors: their files found (or named when missing), their module timed at each causal N on
    racecpu's planes, and each causal racecpu row given its speed-up (a CPU stand-in for their
    module: their kernels need a GPU and nvcc)."""
    torch = pytest.importorskip("torch")
    from racecpu.apps import cuda_bench as bench
    with pytest.raises(FileNotFoundError, match="race_cuda_binding.cpp"):
        bench.load_authors(tmp_path)
    with pytest.raises(SystemExit) as stop:  # the command line says so before timing anything
        bench.main(["--authors", str(tmp_path), "--log2n", "4"])
    assert stop.value.code == 2
    for f in bench.AUTHORS_FILES:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text(_FAKE_AUTHORS if f.endswith("race_causal_cuda.py") else "")
    sys.modules.pop("race_causal_cuda", None)
    try:
        mod = bench.load_authors(tmp_path)
        times, peak = bench.time_authors(mod, 16, heads=1, head_dim=4, repeats=2, device="cpu")
        assert len(times) == 2 and min(times) > 0 and peak is None
        rows = bench.run_benchmark(log2ns=(4,), heads=1, head_dim=4, causal=(False, True), repeats=1, sdpa=False,
                                   check=False, progress=False, authors=mod, authors_device="cpu")
    finally:
        sys.modules.pop("race_causal_cuda", None)
        sys.path.remove(str(tmp_path / "scaling"))
    assert [(r["impl"], r["causal"]) for r in rows] == [("race-cuda", False), ("race-cuda", True),
                                                        ("authors-cuda", True)], rows
    assert "x_authors" not in rows[0] and rows[1]["x_authors"] == rows[2]["median_ms"] / rows[1]["median_ms"]
    assert "the authors' module" in bench.format_rows(rows)
    planes = racecpu.hyperplanes(4)  # their layout of racecpu's planes, as time_authors copies them
    m = mod.RaceCausalCuda(4, 3, 3, 1, device="cpu")
    m.planes_T.copy_(torch.from_numpy(np.ascontiguousarray(planes.reshape(-1, 4).T)))
    assert np.array_equal(m.planes_T.numpy()[:, 3 + 1], planes[1, 1])  # column l * P + p is plane (l, p)


@pytest.mark.parametrize("causal", [False, True])
def test_grouped_kv_matches_cpu(rng, causal):
    """Grouped-query k, v (4 query heads over 2): the CPU's results, gradients in k's and v's shapes."""
    q = rng.standard_normal((1, 4, 19, 4))
    k, v = (rng.standard_normal((1, 2, 19, 4)) for _ in range(2))
    mask = rng.random((1, 2, 19)) > 0.2
    compare(q, k, v, racecpu.hyperplanes(4, 2, 2, seed=0, dtype=np.float64), 2.0, causal, mask, 1e-10)
    with pytest.raises(ValueError, match="divides"):
        rc.race_attention_fwd(q, k[:, :1].repeat(3, 1), v[:, :1].repeat(3, 1), racecpu.hyperplanes(4, 2, 2))


@pytest.mark.parametrize("causal", [False, True])
def test_packed_sequences_match_cpu(rng, causal, monkeypatch):
    """cu_seqlens: the CPU's packed results (themselves a call per sequence), with sequences
    that do not end on a chunk (padding rows on the device), an empty one, and grouped heads."""
    cu = np.array([0, 5, 5, 19, 27, 30], np.int32)
    q = rng.standard_normal((2, 30, 4))
    k, v = (rng.standard_normal((1, 30, 4)) for _ in range(2))
    planes = racecpu.hyperplanes(4, 2, 2, seed=1, dtype=np.float64)
    g = rng.standard_normal((2, 30, 4))
    out, res = rc.race_attention_fwd(q, k, v, planes, 2.0, causal=causal, cu_seqlens=cu)
    ref, rres = racecpu.race_attention_fwd(q, k, v, planes, 2.0, causal=causal, cu_seqlens=cu)
    assert_close(out, ref, 1e-10, "out")
    for name, a, b in zip(("dq", "dk", "dv"), rc.race_attention_bwd(res, g)[:3], racecpu.race_attention_bwd(rres, g)):
        assert_close(a, b, 1e-10, name)
    assert_close(rc.race_attention(q, k, v, planes, 2.0, causal=causal, cu_seqlens=cu), ref, 1e-10, "forward alone")
    # the planes' gradient from the tile kernels' rows (padding rows, grouped heads, an empty
    # sequence), summed in blocks of 7 rows (the last one short)
    monkeypatch.setattr(rc, "_PLANE_ROWS", 7)
    got = rc.race_attention_bwd(res, g, dplanes=True)
    want = racecpu.race_attention_bwd(rres, g, dplanes=True)
    assert host(got[4]).dtype == np.float64 and got[4].shape == planes.shape
    assert_close(got[4], want[4], 1e-10, "dplanes")
    for name, a, b in zip(("dq", "dk", "dv"), got, rc.race_attention_bwd(res, g)):
        np.testing.assert_array_equal(host(a), host(b), err_msg=name)
    _, lean = rc.race_attention_fwd(q, k, v, planes, 2.0, causal=causal, cu_seqlens=cu, planes_grad=False)
    assert lean.q_in is None and lean.k_in is None
    with pytest.raises(ValueError, match="planes_grad=False"):
        rc.race_attention_bwd(lean, g, dplanes=True)
    with pytest.raises(ValueError, match="cu_seqlens must run from 0"):
        rc.race_attention(q, k, v, planes, cu_seqlens=np.array([0, 29]))


@_ONCE
@pytest.mark.parametrize("causal", [False, True])
def test_bucket_mean_matches_cpu_and_the_dense_oracle(rng, causal):
    """estimator="bucket_mean" on device arrays (racecpu.cuda's backend, as the NumPy API calls
    it; its backward reached through the NumPy API): grouped heads, a key mask, float16 q, a
    length that is no whole block; out against the O(N^2) oracle, out and the gradients against
    the CPU's call (the planes' gradient too), device arrays back in the inputs' dtypes; packed
    sequences as the CPU's."""
    q, k, v, mask = problem(rng, (2, 2), 70, 70, 4, 3, np.float32)
    k, v, mask = (np.ascontiguousarray(x[:, :1]) for x in (k, v, mask))   # two query heads a key/value head
    q = q.astype(np.float16)
    planes = racecpu.hyperplanes(4, 2, 2, seed=4)
    g = rng.standard_normal(q.shape[:-1] + (3,)).astype(np.float32)
    kw = dict(causal=causal, key_mask=mask, estimator="bucket_mean")
    dev = [cuda.to_device(x) for x in (q, k, v)]
    out, res = rc.BACKEND.forward(*dev, planes, 2.0, **kw)
    assert cuda.devicearray.is_cuda_ndarray(out) and res.backend == "cuda" and res.estimator == "bucket_mean"
    dense = reference.race_attention_bucket_mean(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                                 planes.astype(np.float64), 2.0, causal=causal, key_mask=mask)
    assert_close(out, dense, 1e-4, "out against the dense oracle")
    ref, rres = racecpu.race_attention_fwd(q, k, v, planes, 2.0, **kw)
    assert host(out).dtype == ref.dtype
    assert_close(out, ref, 1e-5, "out")
    got = racecpu.race_attention_bwd(res, cuda.to_device(g))
    want = racecpu.race_attention_bwd(rres, g)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert host(a).dtype == b.dtype and a.shape == b.shape, name
        assert_close(a, b, 1e-5, name)
    assert abs(got[3] - want[3]) <= 1e-5 * abs(want[3])
    alone, none = rc.BACKEND.forward(*dev, planes, 2.0, residuals=False, **kw)
    assert none is None
    assert_close(alone, ref, 1e-5, "forward alone")
    dW = racecpu.race_attention_bwd(res, cuda.to_device(g), dplanes=True)[4]
    assert host(dW).dtype == np.float32 and dW.shape == planes.shape
    assert_close(dW, racecpu.race_attention_bwd(rres, g, dplanes=True)[4], 1e-5, "dplanes")
    # packed sequences: a call per sequence, as on the CPU
    cu = np.array([0, 30, 30, 70])
    out, res = rc.BACKEND.forward(*dev, planes, 2.0, cu_seqlens=cu, **kw)
    ref, rres = racecpu.race_attention_fwd(q, k, v, planes, 2.0, cu_seqlens=cu, **kw)
    assert_close(out, ref, 1e-5, "packed out")
    for name, a, b in zip(("dq", "dk", "dv", "dbeta", "dplanes"), racecpu.race_attention_bwd(res, cuda.to_device(g),
                                                                                          dplanes=True),
                          racecpu.race_attention_bwd(rres, g, dplanes=True)):
        assert_close(np.asarray(a) if name == "dbeta" else a, b, 1e-5, "packed " + name)
    with pytest.raises(ValueError, match="cu_seqlens must run from 0"):
        rc.BACKEND.forward(*dev, planes, 2.0, cu_seqlens=np.array([0, 30, 69]), **kw)


@pytest.mark.parametrize("threads", [1, 7, 2 ** 20])
@pytest.mark.parametrize("reverse", [False, True])
def test_chunkwise_kernels_match_array_ops(rng, threads, reverse, monkeypatch):
    """racecpu.cuda.CudaOps (the fused hash, its backward and the blocked float64 scan, one to
    every chunk per segment) against racecpu.chunkwise.ArrayOps, the same steps in NumPy."""
    from racecpu import chunkwise
    monkeypatch.setattr(rc.CudaOps, "SCAN_THREADS", threads)
    ops, ref = rc.CudaOps(np, rc._Device(False)), chunkwise.ArrayOps(np)
    part = rng.standard_normal((2, 11, 5)).astype(np.float32)
    assert_close(ops.exclusive_scan(part, reverse, np.float32), ref.exclusive_scan(part, reverse, np.float32), 1e-6,
                 "scan")
    planes = racecpu.hyperplanes(6, 3, 2, seed=1)
    x = rng.standard_normal((9, 6)).astype(np.float32)
    (phi, t), (phi_r, t_r) = ops.soft_hash(x, planes, 3.0), ref.soft_hash(x, planes, 3.0)
    assert_close(phi, phi_r, 1e-6, "phi")
    assert_close(t, t_r, 1e-6, "t")
    dphi = rng.standard_normal(phi.shape).astype(np.float32)
    (du, db), (du_r, db_r) = ops.hash_du(dphi, phi, t, 3.0, 2, 3), ref.hash_du(dphi, phi, t, 3.0, 2, 3)
    assert_close(du, du_r, 1e-5, "du")
    assert abs(float(db) - float(db_r)) <= 1e-5 * abs(float(db_r))


@_ONCE
@pytest.mark.parametrize("causal", [False, True])
def test_planes_gradient_matches_cpu(rng, causal, monkeypatch):
    """dplanes=True on the GPU (the chunkwise form: grouped heads, a key mask, float16 q with
    float32 k and v, float64 planes given for float32 compute) against the CPU's, with dq, dk,
    dv, dbeta unchanged by asking for it; q and k kept by reference, not copied, and not kept at
    all after ``planes_grad=False`` (the tile kernels' planes' gradient, which packed sequences
    run: test_packed_sequences_match_cpu)."""
    monkeypatch.setattr(rc.CudaOps, "FUSED_MIN_TOKENS", 0)   # the fused kernels' path too
    q, k, v, mask = problem(rng, (2, 2), 13, 13, 4, 3, np.float32)
    k, v, mask = (np.ascontiguousarray(x[:, :1]) for x in (k, v, mask))   # two query heads a key/value head
    q = q.astype(np.float16)
    planes = racecpu.hyperplanes(4, 2, 2, seed=3, dtype=np.float64)
    g = rng.standard_normal(q.shape[:-1] + (3,)).astype(np.float32)
    dev = [cuda.to_device(x) for x in (q, k, v)]
    out, res = rc.race_attention_fwd(*dev, planes, 2.0, causal=causal, key_mask=mask)
    assert res.state["q_in"] is dev[0] and res.state["k_in"] is dev[1]
    got = racecpu.race_attention_bwd(res, cuda.to_device(g), dplanes=True)
    plain = racecpu.race_attention_bwd(res, cuda.to_device(g))
    _, rres = racecpu.race_attention_fwd(q, k, v, planes.astype(np.float32), 2.0, causal=causal, key_mask=mask)
    want = racecpu.race_attention_bwd(rres, g, dplanes=True)
    assert len(got) == 5 and host(got[4]).dtype == np.float64 and got[4].shape == planes.shape
    assert_close(got[4], want[4], 1e-4, "dplanes")
    for name, a, b in zip(("dq", "dk", "dv"), got, plain):
        np.testing.assert_array_equal(host(a), host(b), err_msg=name)
    assert got[3] == plain[3]
    # a forward told that no planes' gradient will be asked keeps no q, k (racecpu.torch's hint)
    _, lean = rc.BACKEND.forward(*dev, planes, 2.0, causal=causal, key_mask=mask, planes_grad=False)
    assert lean.state["q_in"] is None and lean.state["k_in"] is None
    for a, b in zip(rc.BACKEND.backward(lean, cuda.to_device(g))[:3], plain):
        np.testing.assert_array_equal(host(a), host(b))
    with pytest.raises(ValueError, match="planes_grad=False"):
        rc.BACKEND.backward(lean, cuda.to_device(g), dplanes=True)


@_ONCE
@pytest.mark.parametrize("P,L,lanes", [(3, 2, 8), (3, 3, 2), (6, 1, 8), (2, 17, 4)])
def test_hash_pass_after_cublas_matches_the_array_form(rng, P, L, lanes, monkeypatch):
    """The soft hash's pass after cuBLAS's projections (``HASH_LANES`` lanes a row where
    ``hash_fits``; else a thread per (row, table): 64 corners, 34 projections) and its backward
    (a thread per (row, projection)) against the array form, into fresh arrays and into given
    ones (the rows around them untouched); an output that is no C-contiguous view is refused."""
    from racecpu import chunkwise
    monkeypatch.setattr(rc.CudaOps, "HASH_LANES", lanes)
    ops, ref = rc.CudaOps(np, rc._Device(False)), chunkwise.ArrayOps(np)
    d, F, LP = 6, L * 2 ** P, L * P
    planes = racecpu.hyperplanes(d, P, L, seed=1)
    x = rng.standard_normal((2, 37, d)).astype(np.float32)       # 74 rows: the last block part full
    phi_r, t_r = ref.soft_hash(x, planes, 3.0)
    phi, t = ops.soft_hash(x, planes, 3.0)
    assert phi.shape == (2, 37, F) and t.shape == (2, 37, LP)
    assert_close(phi, phi_r, 1e-6, "phi")
    assert_close(t, t_r, 1e-6, "t")
    phi_o, t_o = np.full((3, 37, F), np.nan, np.float32), np.full((3, 37, LP), np.nan, np.float32)
    got = ops.soft_hash(x, planes, 3.0, phi_out=phi_o[1:], t_out=t_o[1:])
    assert np.shares_memory(got[0], phi_o) and np.shares_memory(got[1], t_o)
    np.testing.assert_array_equal(phi_o[1:], phi)
    np.testing.assert_array_equal(t_o[1:], t)
    assert np.isnan(phi_o[0]).all() and np.isnan(t_o[0]).all()
    with pytest.raises(ValueError, match="C-contiguous"):
        ops.soft_hash(x, planes, 3.0, phi_out=np.empty((2, F, 37), np.float32).transpose(0, 2, 1))
    rows = (rng.standard_normal((74, F)).astype(np.float32), phi.reshape(74, F), t.reshape(74, LP))
    (du, db), (du_r, db_r) = ops.hash_du(*rows, 3.0, L, P), ref.hash_du(*rows, 3.0, L, P)
    assert_close(du, du_r, 1e-5, "du")
    assert abs(float(db) - float(db_r)) <= 1e-5 * abs(float(db_r))


@_ONCE
@pytest.mark.parametrize("dtype,causal,group,blocked,tile,gemm",
                         [(dt, c, gr, True, 4, True) for dt in (np.float64, np.float32) for c in (False, True)
                          for gr in (1, 2)]
                         + [(np.float64, True, 1, False, 4, True), (np.float64, True, 1, True, 8, True),
                            (np.float32, True, 1, True, 16, True)]
                         + [(dt, c, gr, True, 4, False) for dt, gr in ((np.float64, 1), (np.float32, 2))
                            for c in (False, True)])
def test_fused_chunk_kernels_match_the_array_form(rng, dtype, causal, group, blocked, tile, gemm, monkeypatch):
    """racecpu.cuda.CudaOps' fused readout and causal backward (racecpu.cuda._chunk_kernels) against
    racecpu.chunkwise's array expressions on NumPy: masked keys (some queries see no mass), a length
    that is not a whole number of chunks or tiles, grouped query heads (the backward's fallback),
    the fused non-causal backward (off by default),
    the backward's products blocked or a thread per output, tiles of 4 (8 of tile_products'
    threads a row, 2 outputs each) and 8 (one chunk a tile, 4 outputs a thread), the chunks'
    states and the non-causal readout by batched products (``gemm``) or by the ``chunk_states``
    and ``readout`` kernels, and a float16 ``out`` (the compute dtype's, cast). The hash is the
    cuBLAS one here (the fused hash has its own test below)."""
    from racecpu import chunkwise
    monkeypatch.setattr(rc.CudaOps, "FUSED_MIN_TOKENS", 0)
    monkeypatch.setattr(rc.CudaOps, "STATES_BY_GEMM", gemm)
    monkeypatch.setattr(rc.CudaOps, "READOUT_BY_GEMM", gemm)
    monkeypatch.setattr(rc.CudaOps, "FUSED_BLOCKED", blocked)
    monkeypatch.setattr(rc.CudaOps, "FUSED_NONCAUSAL", True)
    monkeypatch.setattr(rc.CudaOps, "FUSED_TILE", tile)
    G, N, d, dv = 2 * group, 21, 5, 3
    q = rng.standard_normal((G, N, d)).astype(dtype)
    k = rng.standard_normal((2, N, d)).astype(dtype)
    v = rng.standard_normal((2, N, dv)).astype(dtype)
    g = rng.standard_normal((G, N, dv)).astype(dtype)
    mask = rng.random((2, N)) > 0.3
    mask[:, :3] = False
    planes = racecpu.hyperplanes(d, 2, 2, seed=0, dtype=dtype)
    ops = rc.CudaOps(np, rc._Device(False))
    assert ops._fused_bwd_fits(8, dv, 1, dtype) and not ops._fused_bwd_fits(8, dv, 2, dtype)
    kw = dict(causal=causal, key_mask=mask, group=group, chunk=4)
    out, res = chunkwise.forward(np, q, k, v, planes, 2.0, ops=ops, **kw)
    ref, rres = chunkwise.forward(np, q, k, v, planes, 2.0, **kw)
    tol = TOL[dtype] / 10
    assert_close(out, ref, tol, "out")
    assert_close(res["D"], rres["D"], tol, "D")
    out16, _ = chunkwise.forward(np, q, k, v, planes, 2.0, ops=ops, out_dtype=np.float16, **kw)
    np.testing.assert_array_equal(out16, out.astype(np.float16))
    got, want = chunkwise.backward(np, res, g, ops=ops), chunkwise.backward(np, rres, g)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert_close(a, b, tol, name)
    # dbeta is one sum over every row of terms built from those arrays, some of opposite signs: its
    # relative error is the arrays' times a cancellation factor (1.04e-6 in float32 on an H200,
    # where the fused multiply-adds round otherwise than NumPy), so it gets the unreduced TOL
    assert abs(got[3] - want[3]) <= TOL[dtype] * abs(want[3])


@pytest.mark.slow
@_ONCE
@pytest.mark.parametrize("blocked", [False, True])
def test_fused_backward_at_the_gpus_block_shape(rng, blocked, monkeypatch):
    """The fused causal kernels at the shape a GPU runs them (F = 24 from P = L = 3, dv = 128: a
    block of 128 threads, tiles of 16; tile_products' blocks of 4 rows by 3 outputs), which the
    small cases above never build: against racecpu.chunkwise's array form, float32, with a last
    tile of 8 tokens and two chunks of 32."""
    from racecpu import chunkwise
    monkeypatch.setattr(rc.CudaOps, "FUSED_MIN_TOKENS", 0)
    monkeypatch.setattr(rc.CudaOps, "FUSED_BLOCKED", blocked)
    monkeypatch.setattr(rc.CudaOps, "FUSED_CHUNK", 32)
    monkeypatch.setattr(rc.CudaOps, "FUSED_TILE", 16)  # the default, which small_tiles sets to 4
    N, d, dv = 56, 8, 128
    q, k = (rng.standard_normal((1, N, d)).astype(np.float32) for _ in range(2))
    v, g = (rng.standard_normal((1, N, dv)).astype(np.float32) for _ in range(2))
    planes = racecpu.hyperplanes(d, 3, 3, seed=0, dtype=np.float32)
    ops = rc.CudaOps(np, rc._Device(False))
    assert ops._threads(dv) == 128 and rc.CudaOps.FUSED_TILE == 16
    kw = dict(causal=True, chunk=8)
    out, res = chunkwise.forward(np, q, k, v, planes, 2.0, ops=ops, **kw)
    ref, rres = chunkwise.forward(np, q, k, v, planes, 2.0, **kw)
    assert_close(out, ref, TOL[np.float32] / 10, "out")
    got, want = chunkwise.backward(np, res, g, ops=ops), chunkwise.backward(np, rres, g)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert_close(a, b, TOL[np.float32] / 10, name)


@pytest.mark.parametrize("F,T,tpb", [(F, T, tpb) for F in (6, 8, 24, 32, 64) for T in (1, 3, 4, 8, 16, 32)
                                      for tpb in (32, 64, 128) if T <= tpb])
def test_tile_blocks_cover_every_output_within_the_buffers(F, T, tpb):
    """tile_products' and tile_proj's register blocks (racecpu.cuda._chunk_kernels.tile_layout):
    every (row, output) pair of a tile product in exactly one block, blocks of at most 24 sums,
    the rows they read within the shared xs (its padding included) and their partial sums within
    the shared buffer; as many blocks as the threads take at once where the 24 sums allow."""
    from racecpu.cuda._chunk_kernels import KSPLIT, tile_layout
    pair, proj, xs_rows, red = tile_layout(F, T, tpb)
    for (RB, QB, NR, NQB, RS), Q0, Q in ((pair, 0, T + F), (proj, T, F)):
        assert RB * NR == T and RB * QB <= 24 and NQB * QB >= Q > (NQB - 1) * QB
        covered = np.zeros((T, Q), np.int64)
        for blk in range(NR * NQB):
            r0, q0 = (blk % NR) * RB, (blk // NR) * QB
            covered[r0:r0 + RB, q0:min(q0 + QB, Q)] += 1
            assert Q0 + q0 + QB <= xs_rows                        # the rows of xs a block reads
            assert (r0 + RB - 1) * RS + (q0 + QB - 1) * KSPLIT + KSPLIT - 1 < red
        assert (covered == 1).all()
        assert NR * NQB <= tpb // KSPLIT or RB * QB * 2 > 24 or QB == 1


def two_heads(rng, N, d, dv):
    """Two key/value heads of ``N`` tokens in float64: ``q, k, v, g``, a key mask, planes (P = L = 2)."""
    q, k = (rng.standard_normal((2, N, d)) for _ in range(2))
    v, g = (rng.standard_normal((2, N, dv)) for _ in range(2))
    return q, k, v, g, rng.random((2, N)) > 0.3, racecpu.hyperplanes(d, 2, 2, seed=0, dtype=np.float64)


def count_states(monkeypatch):
    """Record each ``CudaOps._states`` call's direction (reverse or not) in a list; returns it and the
    unpatched method."""
    calls = []
    states = rc.CudaOps._states
    monkeypatch.setattr(rc.CudaOps, "_states", lambda self, *a: calls.append(a[6]) or states(self, *a))   # a[6]: reverse
    return calls, states


@_ONCE
@pytest.mark.parametrize("gemm", [True, False])
def test_causal_backward_reads_the_forwards_prefix_states(rng, gemm, monkeypatch):
    """The fused causal forward keeps its chunks' prefix states (chunkwise.PrefixStates) and the
    backward reads them instead of summing and scanning again: one states pass in the backward
    (the suffix one) and the same gradients, to the bit, as a backward that remakes them; states
    of another chunk length are remade; a forward in slabs of one head keeps every head's."""
    from racecpu import chunkwise
    monkeypatch.setattr(rc.CudaOps, "FUSED_MIN_TOKENS", 0)
    monkeypatch.setattr(rc.CudaOps, "STATES_BY_GEMM", gemm)
    Gk, N, d, dv = 2, 21, 5, 3                                   # chunks of 8: 8, 8 and 5 tokens
    q, k, v, g, mask, planes = two_heads(rng, N, d, dv)
    ops = rc.CudaOps(np, rc._Device(False))
    calls, states = count_states(monkeypatch)
    kw = dict(causal=True, key_mask=mask, chunk=4, ops=ops)
    _, res = chunkwise.forward(np, q, k, v, planes, 2.0, **kw)
    prefix = res["prefix"]
    assert isinstance(prefix, chunkwise.PrefixStates) and prefix.chunk == 8
    assert prefix.states.shape == (Gk, 3, 8, dv + 1) and calls == [False]
    phik = res["phik"]
    np.testing.assert_array_equal(prefix.states, states(ops, phik, None, v, None, 8, dv, False))
    calls.clear()
    kept = chunkwise.backward(np, res, g, ops=ops)
    assert calls == [True]                                       # the suffix states alone
    calls.clear()
    remade = chunkwise.backward(np, dict(res, prefix=None), g, ops=ops)
    assert calls == [False, True]
    for a, b in zip(kept, remade):
        np.testing.assert_array_equal(a, b)
    monkeypatch.setattr(rc.CudaOps, "FUSED_CHUNK", 4)            # the kept states are of chunks of 8
    calls.clear()
    other = chunkwise.backward(np, res, g, ops=ops)
    assert calls == [False, True]
    for name, a, b in zip(("dq", "dk", "dv"), other, kept):
        assert_close(a, b, 1e-10, name)
    assert abs(other[3] - kept[3]) <= 1e-10 * abs(kept[3])
    monkeypatch.setattr(rc.CudaOps, "FUSED_CHUNK", 8)
    _, res1 = chunkwise.forward(np, q, k, v, planes, 2.0, workspace=1, **kw)   # a slab per head
    np.testing.assert_array_equal(res1["prefix"].states, prefix.states)


@_ONCE
@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_kernels_in_segments_match_one_pass(rng, causal, keep, monkeypatch):
    """A head cut into segments of 8 tokens (workspace 1; chunks of 8 for the fused kernels, 4 for
    the array form): the fused forward and backward carry the causal state (B, A) forward and
    (dB, dA) backward across segments, keep every segment's prefix states for the backward (which
    then sums and scans only the suffix states, one pass a segment), and equal the array form in
    one pass; non-causal through the fused readout and backward kernels; buckets kept or remade
    from the projections (float64, 1e-12)."""
    from racecpu import chunkwise
    monkeypatch.setattr(rc.CudaOps, "FUSED_MIN_TOKENS", 0)
    monkeypatch.setattr(rc.CudaOps, "FUSED_CHUNK", 8)
    monkeypatch.setattr(rc.CudaOps, "READOUT_BY_GEMM", False)
    monkeypatch.setattr(rc.CudaOps, "FUSED_NONCAUSAL", True)
    Gk, N, d, dv = 2, 29, 5, 3                                   # segments of 8, 8, 8 and 5 tokens
    q, k, v, g, mask, planes = two_heads(rng, N, d, dv)
    ops = rc.CudaOps(np, rc._Device(False))
    calls, _ = count_states(monkeypatch)
    kw = dict(causal=causal, key_mask=mask, chunk=4, sum_chunk=8)
    out, res = chunkwise.forward(np, q, k, v, planes, 2.0, ops=ops, workspace=1, keep_buckets=keep, **kw)
    assert res["slab"] == (1, 8)
    if causal:
        assert res["prefix"].states.shape == (Gk, 4, 8, dv + 1) and calls == [False] * 8
    calls.clear()
    got = chunkwise.backward(np, res, g, ops=ops, q=q, k=k)
    assert calls == ([True] * 8 if causal else [])
    ref, rres = chunkwise.forward(np, q, k, v, planes, 2.0, **kw)
    want = chunkwise.backward(np, rres, g, q=q, k=k)
    assert_close(out, ref, 1e-12, "out")
    for name, a, b in zip(("dq", "dk", "dv", "dbeta", "dplanes"), got, want):
        if name == "dbeta":
            assert abs(a - b) <= 1e-12 * abs(b), (a, b)
        else:
            assert_close(a, b, 1e-12, name)


@_ONCE
@pytest.mark.parametrize("causal", [False, True])
def test_fused_kernels_take_more_features_than_threads(rng, causal, monkeypatch):
    """F = L * 2**P = 64 features against 32 threads a block (dv = 3): the kernels' per-feature work
    (key mass, its prefix, dA) strides over the features instead of one thread each."""
    from racecpu import chunkwise
    monkeypatch.setattr(rc.CudaOps, "FUSED_MIN_TOKENS", 0)
    monkeypatch.setattr(rc.CudaOps, "FUSED_NONCAUSAL", True)
    G, N, d, dv = 2, 13, 5, 3
    q, k, v, g = (rng.standard_normal((G, N, e)) for e in (d, d, dv, dv))
    planes = racecpu.hyperplanes(d, 5, 2, seed=0, dtype=np.float64)   # P = 5, L = 2
    ops = rc.CudaOps(np, rc._Device(False))
    assert ops._threads(dv) < 64 and ops._fused_bwd_fits(64, dv, 1, np.float64)
    out, res = chunkwise.forward(np, q, k, v, planes, 2.0, causal=causal, chunk=4, ops=ops)
    ref, rres = chunkwise.forward(np, q, k, v, planes, 2.0, causal=causal, chunk=4)
    assert_close(out, ref, 1e-12, "out")
    for name, a, b in zip(("dq", "dk", "dv"), chunkwise.backward(np, res, g, ops=ops), chunkwise.backward(np, rres, g)):
        assert_close(a, b, 1e-12, name)


@_ONCE
def test_fused_tiles_longer_than_a_block_are_refused():
    """A tile's per-token steps take a thread per token: T > TPB is a ValueError naming both."""
    with pytest.raises(ValueError, match=r"T = 64 tokens needs 1 <= T <= TPB = 32"):
        rc.make_chunk_kernels(8, 64, 32, "float64")


@_ONCE
@pytest.mark.parametrize("threshold,fused", [(22, False), (21, True)])
def test_fused_kernels_from_fused_min_tokens(rng, monkeypatch, threshold, fused):
    """Below CudaOps.FUSED_MIN_TOKENS tokens per head the array expressions run (the first fused
    kernels lost to them at 2^16 on an H200), from it the fused kernels; the same numbers either way."""
    from racecpu import chunkwise
    built = []
    real = rc.make_chunk_kernels
    monkeypatch.setattr(rc, "make_chunk_kernels", lambda *a: built.append(a) or real(*a))
    monkeypatch.setattr(rc.CudaOps, "FUSED_MIN_TOKENS", threshold)
    q, k, v, _ = problem(rng, (2,), 21, 21, 4, 3, np.float64, masked=False)
    planes = racecpu.hyperplanes(4, 2, 2, seed=0, dtype=np.float64)
    g = rng.standard_normal(v.shape)
    out, res = chunkwise.forward(np, q, k, v, planes, 2.0, causal=True, ops=rc.CudaOps(np, rc._Device(False)))
    grads = chunkwise.backward(np, res, g, ops=rc.CudaOps(np, rc._Device(False)))
    ref, rres = chunkwise.forward(np, q, k, v, planes, 2.0, causal=True)
    assert bool(built) == fused
    assert_close(out, ref, 1e-12, "out")
    for a, b in zip(grads[:3], chunkwise.backward(np, rres, g)[:3]):
        assert_close(a, b, 1e-12, "grad")


# Under the simulator (a block of 32 Python threads, ~1 s) five of the cases; on a GPU
# (RACECPU_TEST_GPU=1) every dtype and lane count.  Lanes per row: 8 (the default), 2 (more
# corners per lane), 32 (clamped to a table's 2**P corners).
_HASH_CASES = ([(dt, P, L, d, g) for dt in (np.float64, np.float32) for g in (8, 2, 32)
                for P, L, d in ((3, 3, 40), (4, 4, 9), (3, 8, 5), (5, 1, 3), (1, 2, 7))]
               if _GPU else [(np.float32, 3, 3, 40, 8), (np.float64, 4, 4, 9, 2), (np.float32, 3, 8, 5, 32),
                             (np.float64, 5, 1, 3, 8), (np.float32, 1, 2, 7, 8)])


@_ONCE
@pytest.mark.parametrize("dtype,P,L,d,lanes", _HASH_CASES)
def test_fused_hash_matches_the_array_form(rng, dtype, P, L, d, lanes, monkeypatch):
    """The soft hash and its backward with the projection fused in, ``lanes`` lanes per row, against
    racecpu.chunkwise's array expressions: tables wider than a warp (F = 64, 32 corners of one
    table), more projections than d, one plane set, two corners per table (fewer than the lanes
    asked for), rows that do not fill the last block."""
    from racecpu import chunkwise
    monkeypatch.setattr(rc.CudaOps, "FUSED_HASH", True)
    monkeypatch.setattr(rc.CudaOps, "HASH_LANES", lanes)
    planes = racecpu.hyperplanes(d, P, L, seed=1, dtype=dtype)
    x = rng.standard_normal((11 if _GPU else 5, d)).astype(dtype)
    ops, ref = rc.CudaOps(np, rc._Device(False)), chunkwise.ArrayOps(np)
    (phi, t), (phi_r, t_r) = ops.soft_hash(x, planes, 3.0), ref.soft_hash(x, planes, 3.0)
    tol = TOL[dtype]  # float32: the projection's sum over d=40 runs in another order than the GEMM's
    assert_close(phi, phi_r, tol, "phi")
    assert_close(t, t_r, tol, "t")
    dphi = rng.standard_normal(phi.shape).astype(dtype)
    dx, dx_r = np.full_like(x, np.nan), np.full_like(x, np.nan)
    db, db_r = ops.hash_dx(dphi, phi_r, t_r, planes, 3.0, dx), ref.hash_dx(dphi, phi_r, t_r, planes, 3.0, dx_r)
    assert_close(dx, dx_r, tol, "dx")
    # dbeta sums terms s t with |s| <= 2 sum_r |phi dphi| per table and plane: a scale for its error
    assert abs(float(db) - float(db_r)) <= tol * 2 * P * float(np.abs(dphi * phi_r).sum())


def test_no_cuda_driver_is_a_runtime_error_naming_is_available_and_the_extras(rng, monkeypatch):
    """Where numba.cuda finds no driver, the first call says how to check and what to install."""
    from numba.cuda.cudadrv.error import CudaSupportError  # the simulator's class under the simulator

    def no_driver(*args, **kwargs):
        raise CudaSupportError("Error at driver init: CUDA driver library cannot be found.")

    monkeypatch.setattr(rc.cuda, "default_stream", no_driver)
    q, k, v, _ = problem(rng, (1,), 9, 9, 4, 3, np.float32, masked=False)
    planes = racecpu.hyperplanes(4, 2, 2, seed=0)
    for call in (lambda: rc.race_attention(q, k, v, planes), lambda: rc.soft_buckets(q, planes)):
        with pytest.raises(RuntimeError, match=r"no usable CUDA driver.*racecpu\.cuda\.is_available\(\)") as exc:
            call()
        assert 'pip install "racecpu[cuda]"' in str(exc.value) and '"racecpu[cuda13]"' in str(exc.value)
        assert isinstance(exc.value.__cause__, CudaSupportError)

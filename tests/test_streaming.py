"""RaceState: block splits equal one causal pass, decode steps, save/load, corrupt files."""

import io
import zipfile

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import racecpu
from racecpu import reference as ref
from racecpu.config import CHUNK
from racecpu.streaming import FORMAT_VERSION, RaceState

TOL = {np.float64: 1e-12, np.float32: 1e-5}


def make(rng, lead=(2,), n=40, d=6, dv=5, P=3, L=3, dtype=np.float64):
    q, k = (rng.standard_normal(lead + (n, d)).astype(dtype) for _ in range(2))
    v = rng.standard_normal(lead + (n, dv)).astype(dtype)
    return q, k, v, racecpu.hyperplanes(d, P, L, seed=1, dtype=dtype)


def stream(state, q, k, v, cuts):
    """Feed tokens in blocks [cuts[i], cuts[i+1]); blocks of one token go through step()."""
    outs = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        if b - a == 1:
            outs.append(state.step(q[..., a, :], k[..., a, :], v[..., a, :])[..., None, :])
        else:
            outs.append(state.extend(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :]))
    return np.concatenate(outs, axis=-2)


@given(st.lists(st.integers(1, 59), max_size=8), st.sampled_from([np.float64, np.float32]))
def test_any_split_equals_one_causal_pass(cut_points, dtype):
    rng = np.random.default_rng(len(cut_points))
    n = 60
    q, k, v, W = make(rng, lead=(2, 3), n=n, dtype=dtype)
    cuts = sorted({0, n, *cut_points})
    state = RaceState(W, 4.0, batch_shape=(2, 3), dv=5, dtype=dtype)
    out = stream(state, q, k, v, cuts)
    full = racecpu.race_attention(q, k, v, W, 4.0, causal=True)
    assert out.dtype == dtype and out.shape == full.shape
    np.testing.assert_allclose(out, full, rtol=TOL[dtype], atol=TOL[dtype])
    assert state.count == n
    if dtype == np.float64:  # and against the independent dense O(N^2) oracle
        np.testing.assert_allclose(out, ref.race_attention_dense(q, k, v, W, 4.0, causal=True), rtol=1e-12,
                                   atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_splits_across_kernel_chunks(rng, dtype):
    n = 2 * CHUNK + 300
    q, k, v, W = make(rng, lead=(2,), n=n, d=4, dv=3, P=2, L=2, dtype=dtype)
    cuts = [0, 1, 2, 700, CHUNK, CHUNK + 1, 2 * CHUNK + 17, n]
    state = RaceState(W, 8.0, batch_shape=(2,), dv=3, dtype=dtype)
    out = stream(state, q, k, v, cuts)
    full = racecpu.race_attention(q, k, v, W, 8.0, causal=True)
    np.testing.assert_allclose(out, full, rtol=TOL[dtype], atol=TOL[dtype])
    # the state is the full-sequence sketch, summed in float64
    phik = racecpu.soft_buckets(k.astype(np.float64), W.astype(np.float64), 8.0).reshape(2, n, -1)
    np.testing.assert_allclose(state.A, phik.sum(1), rtol=1e-6 if dtype == np.float32 else 1e-12)
    np.testing.assert_allclose(state.B, np.einsum("gnf,gnc->gfc", phik, v.astype(np.float64)),
                               rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-4 if dtype == np.float32 else 1e-12)


def test_steps_on_strided_views_and_copies_equal_one_causal_pass(rng):
    # q[..., i, :] of a (batch, n, d) array is a strided view: views and contiguous copies
    # alternate here (a stale compiled loop for the other layout once gave wrong rows).
    q, k, v, W = make(rng, lead=(2, 3), n=8)
    state = RaceState(W, 4.0, batch_shape=(2, 3), dv=5, dtype=np.float64)
    outs = []
    for i in range(8):
        step = [x[..., i, :] for x in (q, k, v)]
        outs.append(state.step(*(step if i % 2 == 0 else [x.copy() for x in step])))
    np.testing.assert_allclose(np.stack(outs, axis=-2), racecpu.race_attention(q, k, v, W, 4.0, causal=True),
                               rtol=1e-12, atol=1e-12)


def test_state_size_is_constant_and_inputs_untouched(rng):
    q, k, v, W = make(rng, n=50)
    copies = [x.copy() for x in (q, k, v)]
    state = RaceState(W, 8.0, batch_shape=(2,), dv=5, dtype=np.float64)
    size = state.nbytes
    assert size == 2 * 24 * (5 + 1) * 8
    state.extend(q, k, v)
    state.step(q[:, 0], k[:, 0], v[:, 0])
    assert state.nbytes == size and state.count == 51
    for x, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(x, c)
    A = state.A
    A[0, 0] = 123.0  # a copy: the state is not touched
    assert state.A[0, 0] != 123.0


def test_empty_block_and_empty_batch(rng):
    q, k, v, W = make(rng, n=5)
    state = RaceState(W, 8.0, batch_shape=(2,), dv=5, dtype=np.float64)
    assert state.extend(q[:, :0], k[:, :0], v[:, :0]).shape == (2, 0, 5) and state.count == 0
    empty = RaceState(W, 8.0, batch_shape=(0,), dv=5)
    assert empty.step(np.zeros((0, 6)), np.zeros((0, 6)), np.zeros((0, 5))).shape == (0, 5)


def test_bad_inputs_leave_state_unchanged(rng):
    q, k, v, W = make(rng, n=8)
    state = RaceState(W, 8.0, batch_shape=(2,), dv=5, dtype=np.float64)
    state.extend(q[:, :4], k[:, :4], v[:, :4])
    A, B = state.A.copy(), state.B.copy()
    bad = q[:, 4:].copy()
    bad[0, 1, 2] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        state.extend(bad, k[:, 4:], v[:, 4:])
    with pytest.raises(ValueError, match="NaN"):
        state.step(bad[:, 1], k[:, 5], v[:, 5])
    with pytest.raises(ValueError, match="batch_shape"):
        state.extend(q[:1, 4:], k[:1, 4:], v[:1, 4:])
    with pytest.raises(ValueError, match="dv"):
        state.extend(q[:, 4:], k[:, 4:], v[:, 4:, :3])
    with pytest.raises(ValueError, match="shape"):
        state.step(q[:, 4], k[:, 4], v[:, 4, :3])
    with pytest.raises(TypeError, match="float"):
        state.extend(q[:, 4:].astype(int), k[:, 4:], v[:, 4:])
    np.testing.assert_array_equal(state.A, A)
    np.testing.assert_array_equal(state.B, B)
    assert state.count == 4
    with pytest.raises(ValueError, match="beta"):
        RaceState(W, -1.0, batch_shape=(2,), dv=5)
    with pytest.raises(ValueError, match="dv"):
        RaceState(W, 1.0, batch_shape=(2,), dv=0)
    with pytest.raises(TypeError, match="dtype"):
        RaceState(W, 1.0, batch_shape=(2,), dv=5, dtype=np.float16)


# ---------------------------------------------------------------------------
# save / load
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_save_resume_is_bit_for_bit(rng, tmp_path, dtype):
    q, k, v, W = make(rng, lead=(3,), n=70, dtype=dtype)
    full = RaceState(W, 8.0, batch_shape=(3,), dv=5, dtype=dtype)
    o_full = stream(full, q, k, v, [0, 30, 31, 32, 70])

    part = RaceState(W, 8.0, batch_shape=(3,), dv=5, dtype=dtype)
    o1 = stream(part, q, k, v, [0, 30, 31])
    part.save(tmp_path / "s.npz")
    resumed = RaceState.load(tmp_path / "s.npz", planes=W, beta=8.0)
    assert resumed.count == 31 and resumed.dtype == dtype and resumed.batch_shape == (3,)
    o2 = stream(resumed, q[:, 31:], k[:, 31:], v[:, 31:], [0, 1, 39])
    np.testing.assert_array_equal(np.concatenate([o1, o2], axis=1), o_full)
    np.testing.assert_array_equal(resumed.A, full.A)
    np.testing.assert_array_equal(resumed.B, full.B)
    assert not list(tmp_path.glob("*.tmp*"))


def _saved(tmp_path, rng):
    q, k, v, W = make(rng, n=10)
    state = RaceState(W, 8.0, batch_shape=(2,), dv=5, dtype=np.float64)
    state.extend(q, k, v)
    path = tmp_path / "state.npz"
    state.save(path)
    return path, W


def _rewrite(path, **changes):
    with np.load(path) as z:
        d = {key: z[key] for key in z.files}
    d.update(changes)
    for key in [key for key, val in changes.items() if val is None]:
        del d[key]
    np.savez(path, **d)


def test_truncated_and_corrupt_files(rng, tmp_path):
    path, W = _saved(tmp_path, rng)
    raw = path.read_bytes()
    for n in (0, 10, len(raw) // 2, len(raw) - 1):
        path.write_bytes(raw[:n])
        with pytest.raises(ValueError, match="truncated or corrupt"):
            RaceState.load(path)
    # flip one byte inside the stored B array: the zip CRC-32 catches it
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        info = zf.getinfo("B.npy")
    pos = info.header_offset + 30 + len(info.filename) + len(info.extra) + info.compress_size // 2
    bad = bytearray(raw)
    bad[pos] ^= 0xFF
    path.write_bytes(bytes(bad))
    with pytest.raises(ValueError, match="truncated or corrupt"):
        RaceState.load(path)
    with pytest.raises(ValueError, match="cannot read"):
        RaceState.load(tmp_path / "missing.npz")


def test_version_format_and_mismatch_errors(rng, tmp_path):
    path, W = _saved(tmp_path, rng)
    RaceState.load(path, planes=W, beta=8.0)  # fine as saved
    with pytest.raises(ValueError, match="different planes"):
        RaceState.load(path, planes=W + 1e-3, beta=8.0)
    with pytest.raises(ValueError, match="different planes"):
        RaceState.load(path, planes=W[:2])
    with pytest.raises(ValueError, match="beta"):
        RaceState.load(path, planes=W, beta=8.5)

    _rewrite(path, version=np.array(FORMAT_VERSION + 1))
    with pytest.raises(ValueError, match="version"):
        RaceState.load(path)
    path, W = _saved(tmp_path, rng)
    _rewrite(path, format=np.array("something.else"))
    with pytest.raises(ValueError, match="not a RaceState"):
        RaceState.load(path)
    path, W = _saved(tmp_path, rng)
    _rewrite(path, count=None)
    with pytest.raises(ValueError, match="missing"):
        RaceState.load(path)
    path, W = _saved(tmp_path, rng)
    _rewrite(path, A=np.zeros((3, 24)))
    with pytest.raises(ValueError, match="inconsistent"):
        RaceState.load(path)
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="missing"):
        RaceState.load(tmp_path / "other.npz")

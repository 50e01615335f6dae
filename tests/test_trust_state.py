"""Hostile inputs to RaceState and the out-of-core checkpoints: clear errors, bounded memory.

Grouped heads with no query head, saved states whose declared sizes, token
count or numbers cannot be trusted, malformed ``batch_shape``, and a
``checkpoint=`` path or checkpoint entries of the wrong kind.
"""

import os
import tracemalloc
import zipfile

import numpy as np
import pytest

import racecpu
from racecpu._blocks import CheckpointWarning
from racecpu.outofcore import race_attention_fwd_ooc
from racecpu.streaming import RaceState

from .test_outofcore import inputs, outputs, run_ooc

D, DV = 4, 3


@pytest.fixture(scope="module")
def W():
    return racecpu.hyperplanes(D, 3, 2, seed=1, dtype=np.float64)  # P=3 planes, L=2 tables: F = 16


def _fields(st):
    """What RaceState.save writes, as a dict (to edit before np.savez)."""
    d = dict(format=np.array("racecpu.RaceState"), version=np.array(1), planes=st.planes,
             beta=np.array(st.beta), dtype=np.array(st.dtype.name),
             batch_shape=np.array(st.batch_shape, dtype=np.int64), count=np.array(st.count), A=st._A, B=st._B)
    if st.kv_batch_shape != st.batch_shape:
        d["kv_heads"] = np.array(st.kv_batch_shape[-1], dtype=np.int64)
    return d


def _npy_header(shape, descr="<f8"):
    """The magic and header of a .npy file declaring ``shape`` (no data)."""
    import io
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, dict(descr=descr, fortran_order=False, shape=shape))
    return buf.getvalue()


# ---------------------------------------------------------------------------
# 1. grouped heads with zero query heads
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("batch_shape", [(0,), (3, 0)])
def test_state_with_zero_query_heads_and_kv_heads_raises_value_error(W, batch_shape):
    with pytest.raises(ValueError, match=r"kv_heads must divide .*0 query heads.*kv_heads=2"):
        RaceState(W, 8.0, batch_shape=batch_shape, dv=DV, dtype=np.float64, kv_heads=2)


def test_ooc_zero_query_heads_with_kv_heads_raises_value_error(W):
    q, k, v = np.zeros((0, 5, D)), np.zeros((2, 5, D)), np.zeros((2, 5, DV))
    with pytest.raises(ValueError, match=r"q has 0 heads and k, v have 2.*q \(0, 5, 4\)"):
        race_attention_fwd_ooc(q, k, v, W, 8.0, out=np.zeros((0, 5, DV)), progress=False)


# ---------------------------------------------------------------------------
# 2.-3. saved files: sizes checked against the bytes present, finite state, sane count
# ---------------------------------------------------------------------------

def test_load_checks_declared_value_dim_before_allocating(W, tmp_path):
    """A 3 KB file whose B declares (0, 16, 400_000): a state of batch_shape (13,) and that dv
    would be 666 MB.  Rejected (naming B) before anything of that size is allocated."""
    d = _fields(RaceState(W, 8.0, batch_shape=(13,), dv=DV, dtype=np.float64))
    path = tmp_path / "s.npz"
    np.savez(path, **{key: val for key, val in d.items() if key != "B"})
    with zipfile.ZipFile(path, "a") as zf:
        zf.writestr("B.npy", _npy_header((0, 16, 400_000)))
    assert os.path.getsize(path) < 8192
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as err:
            RaceState.load(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20
    err.match(r"s\.npz.*\bB\b.*\(0, 16, 400000\)")


@pytest.mark.parametrize("field, bad", [("A", np.nan), ("B", np.inf), ("B", -np.inf)])
def test_load_rejects_non_finite_state(W, tmp_path, field, bad):
    st = RaceState(W, 8.0, batch_shape=(2,), dv=DV, dtype=np.float64)
    d = _fields(st)
    d[field] = d[field].copy()
    d[field].reshape(-1)[5] = bad
    path = tmp_path / "s.npz"
    np.savez(path, **d)
    with pytest.raises(ValueError, match=rf"s\.npz.*\b{field}\b.*NaN or Inf"):
        RaceState.load(path)


@pytest.mark.parametrize("count", [np.array(2 ** 64 - 1, dtype=np.uint64), np.array(2 ** 62 + 1, dtype=np.int64),
                                   np.array(-1, dtype=np.int64)])
def test_load_rejects_absurd_token_count(W, tmp_path, count):
    d = _fields(RaceState(W, 8.0, batch_shape=(2,), dv=DV, dtype=np.float64))
    d["count"] = count
    path = tmp_path / "s.npz"
    np.savez(path, **d)
    with pytest.raises(ValueError, match=r"s\.npz.*token count"):
        RaceState.load(path)


def test_load_accepts_largest_sane_token_count(W, tmp_path):
    st = RaceState(W, 8.0, batch_shape=(2,), dv=DV, dtype=np.float64)
    st.set_state(st.A + 1.0, st.B, count=2 ** 62)
    st.save(tmp_path / "s.npz")
    got = RaceState.load(tmp_path / "s.npz")
    assert got.count == 2 ** 62 and np.array_equal(got.A, st.A)


# ---------------------------------------------------------------------------
# 4. batch_shape
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["ab", (2.5,), (2.0,), (True,), (np.bool_(True),), (2, None), 2.5, None,
                                 ("3",), [np.float64(2)]])
def test_batch_shape_of_non_integers_raises_type_error(W, bad):
    with pytest.raises(TypeError, match=r"batch_shape must be .*non-negative int"):
        RaceState(W, 8.0, batch_shape=bad, dv=DV)


@pytest.mark.parametrize("bad", [(-1,), (2, -3), -1, np.int64(-2)])
def test_negative_batch_shape_raises_value_error(W, bad):
    with pytest.raises(ValueError, match=r"batch_shape must .*non-negative"):
        RaceState(W, 8.0, batch_shape=bad, dv=DV)


@pytest.mark.parametrize("shape, want", [((), ()), (3, (3,)), (np.int64(3), (3,)), ([2, np.int32(3)], (2, 3)),
                                         (np.array([2, 3]), (2, 3)), ((np.uint8(0), 4), (0, 4))])
def test_batch_shape_of_integers_is_accepted(W, shape, want):
    st = RaceState(W, 8.0, batch_shape=shape, dv=DV)
    assert st.batch_shape == want and all(type(s) is int for s in st.batch_shape)
    assert st.A.shape == want + (16,)


# ---------------------------------------------------------------------------
# 5. out-of-core checkpoint paths
# ---------------------------------------------------------------------------

LEAD, N, BLOCK = (2,), 60, 20


@pytest.fixture(scope="module")
def ooc(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ooc")
    x = inputs(tmp, np.random.default_rng(3), LEAD, N, N, D, DV, np.float32)
    W = racecpu.hyperplanes(D, 2, 2, seed=3)
    o = outputs(tmp, LEAD, N, N, D, DV, np.float32, tag="_clean")
    dbeta = run_ooc(x, o, W, True, BLOCK)
    return x, W, dbeta, {key: np.array(val) for key, val in o.items()}


def test_ooc_checkpoint_naming_a_regular_file_raises_clear_error(ooc, tmp_path):
    x, W, _, _ = ooc
    ck = tmp_path / "ck"
    ck.write_text("not a directory")
    o = outputs(tmp_path, LEAD, N, N, D, DV, np.float32)
    with pytest.raises(ValueError, match=r"checkpoint .*ck.* not a directory"):
        race_attention_fwd_ooc(x["q"], x["k"], x["v"], W, 8.0, causal=True, out=o["out"], block=BLOCK,
                               checkpoint=ck, progress=False)
    assert ck.read_text() == "not a directory"  # left alone


@pytest.mark.parametrize("victim", ["fwd_causal.json", "fwd_causal.state0.npy", "bwd_causal.state1.npy",
                                    "bwd_causal.json"])
def test_ooc_checkpoint_entry_replaced_by_folder_restarts(ooc, tmp_path, victim):
    """A folder where a manifest or state file should be is a damaged checkpoint: the pass restarts."""
    x, W, dbeta, want = ooc
    ck = tmp_path / "ck"
    o = outputs(tmp_path, LEAD, N, N, D, DV, np.float32)
    run_ooc(x, o, W, True, BLOCK, checkpoint=ck)
    os.remove(ck / victim)
    (ck / victim).mkdir()
    (ck / victim / "inside").write_text("x")
    with pytest.warns(CheckpointWarning, match="restarts"):
        got = run_ooc(x, o, W, True, BLOCK, checkpoint=ck)
    assert got == dbeta
    for name in want:
        np.testing.assert_array_equal(o[name], want[name], err_msg=name)
    assert (ck / victim).is_file()


@pytest.mark.parametrize("kind", ["folder", "link"])
def test_ooc_stale_manifest_tmp_is_replaced_not_written_through(ooc, tmp_path, kind):
    x, W, dbeta, want = ooc
    ck = tmp_path / "ck"
    ck.mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    if kind == "folder":
        (ck / "fwd_causal.json.tmp").mkdir()
    else:
        os.symlink(outside, ck / "fwd_causal.json.tmp")
    o = outputs(tmp_path, LEAD, N, N, D, DV, np.float32)
    assert run_ooc(x, o, W, True, BLOCK, checkpoint=ck) == dbeta
    np.testing.assert_array_equal(o["out"], want["out"])
    assert outside.read_text() == "keep" and (ck / "fwd_causal.json").is_file()

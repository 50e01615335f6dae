"""Out-of-core RACE on zarr arrays and other array-likes that slice (not only memmaps).

Inputs may be any object with ``shape``, ``dtype`` and ``__getitem__``, outputs
any with ``__setitem__`` (a writable ``zarr.Array``): the results are the bits
of ndarray inputs and outputs, read-only outputs are refused, and an
interrupted checkpointed run with zarr arguments resumes to the same bits.
"""

import json
import warnings

import numpy as np
import pytest

import racecpu
from racecpu import _blocks as blocks
from racecpu._blocks import CheckpointWarning
from racecpu.outofcore import race_attention_bwd_ooc, race_attention_fwd_ooc

from .test_outofcore import TOL, Interrupt, StopAfter, run_ooc

zarr = pytest.importorskip("zarr")

LEAD, N, D, DV, BLOCK = (2, 3), 200, 16, 8, 64  # 4 blocks a pass, the last one short
SHAPES = {"q": LEAD + (N, D), "k": LEAD + (N, D), "v": LEAD + (N, DV), "g": LEAD + (N, DV),
          "out": LEAD + (N, DV), "dq": LEAD + (N, D), "dk": LEAD + (N, D), "dv": LEAD + (N, DV)}


class Sliceable:
    """The least an input must be: shape, dtype and __getitem__ (a tuple of slices)."""

    def __init__(self, a):
        self._a = a
        self.shape, self.dtype = a.shape, a.dtype

    def __getitem__(self, index):
        assert isinstance(index, tuple) and all(isinstance(i, slice) for i in index)
        return self._a[index].tolist()  # not even an ndarray: what np.asarray takes


class Writable(Sliceable):
    """The least a checkpointed output must be: also __setitem__ (a tuple of slices)."""

    def __setitem__(self, index, value):
        assert isinstance(index, tuple) and all(isinstance(i, slice) for i in index)
        self._a[index] = value


def arrays(rng, dtype):
    return {name: rng.standard_normal(SHAPES[name]).astype(dtype) for name in ("q", "k", "v", "g")}


def zarr_inputs(tmp_path, x, chunks=(1, 3, 64, None)):
    """``x`` in zarr arrays (chunks along the tokens aligned to the blocks), then reopened read-only."""
    for name, a in x.items():
        z = zarr.create_array(store=tmp_path / f"{name}.zarr", shape=a.shape, dtype=a.dtype,
                              chunks=chunks[:-1] + (a.shape[-1],))
        z[...] = a
    return open_inputs(tmp_path, x)


def open_inputs(tmp_path, names=("q", "k", "v", "g")):
    return {name: zarr.open_array(tmp_path / f"{name}.zarr", mode="r") for name in names}


def zarr_outputs(tmp_path, dtype, tag="", chunks=(2, 1, 40)):
    """Writable zarr outputs, chunked across heads and not aligned to the blocks (partial-chunk writes)."""
    return {name: zarr.create_array(store=tmp_path / f"{name}{tag}.zarr", shape=SHAPES[name], dtype=dtype,
                                    chunks=chunks + (SHAPES[name][-1],), overwrite=True)
            for name in ("out", "dq", "dk", "dv")}


def reopen(tmp_path, tag="", mode="r+"):
    return {name: zarr.open_array(tmp_path / f"{name}{tag}.zarr", mode=mode) for name in ("out", "dq", "dk", "dv")}


def ndarray_outputs(dtype):
    return {name: np.zeros(SHAPES[name], dtype) for name in ("out", "dq", "dk", "dv")}


def read(o):
    return {name: np.asarray(a[...]) for name, a in o.items()}


def assert_same_bits(got, want):
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_zarr_matches_ndarrays_and_in_memory(tmp_path, rng, dtype, causal):
    """zarr inputs and outputs (checkpointed, so the inputs are digested) give the bits of ndarrays."""
    W = racecpu.hyperplanes(D, 3, 2, seed=2, dtype=dtype)
    x = arrays(rng, dtype)
    want = ndarray_outputs(dtype)
    dbeta_want = run_ooc(x, want, W, causal, BLOCK)
    z = zarr_outputs(tmp_path, dtype)
    dbeta = run_ooc(zarr_inputs(tmp_path, x), z, W, causal, BLOCK, checkpoint=tmp_path / "ck")
    assert_same_bits(read(z), want)
    assert dbeta == dbeta_want
    for p in (tmp_path / "ck").glob("*.json"):
        assert json.loads(p.read_text())["complete"]

    out, res = racecpu.race_attention_fwd(x["q"], x["k"], x["v"], W, 8.0, causal=causal)
    grads = racecpu.race_attention_bwd(res, x["g"])
    tol = TOL[dtype]
    for name, ref in zip(("out", "dq", "dk", "dv"), (out,) + grads[:3]):
        np.testing.assert_allclose(z[name][...], ref, rtol=tol, atol=tol * max(1.0, np.abs(ref).max()),
                                   err_msg=name)
    assert dbeta == pytest.approx(grads[3], rel=1e-9 if dtype == np.float64 else 1e-5, abs=1e-9)


def test_outputs_cast_to_zarr_dtype(tmp_path, rng):
    """float64 compute into float32 zarr outputs: the bits of float32 ndarray outputs (one cast)."""
    W = racecpu.hyperplanes(D, 3, 2, seed=2)
    x = arrays(rng, np.float64)
    want = ndarray_outputs(np.float32)
    z = zarr_outputs(tmp_path, np.float32)
    assert run_ooc(x, z, W, True, BLOCK) == run_ooc(x, want, W, True, BLOCK)
    assert_same_bits(read(z), want)


@pytest.mark.parametrize("causal", [True, False])
def test_generic_array_likes(tmp_path, rng, causal):
    """An object with only shape, dtype and __getitem__ (returning lists) is an input; one with
    __setitem__ too is an output, checkpointed or not."""
    W = racecpu.hyperplanes(D, 3, 2, seed=2)
    x = arrays(rng, np.float32)
    want = ndarray_outputs(np.float32)
    dbeta_want = run_ooc(x, want, W, causal, BLOCK)
    for ck in (None, tmp_path / "ck"):
        o = {name: Writable(a) for name, a in ndarray_outputs(np.float32).items()}
        dbeta = run_ooc({name: Sliceable(a) for name, a in x.items()}, o, W, causal, BLOCK, checkpoint=ck)
        assert_same_bits({name: a._a for name, a in o.items()}, want)
        assert dbeta == dbeta_want


def test_dask_inputs(rng):
    da = pytest.importorskip("dask.array")
    W = racecpu.hyperplanes(D, 3, 2, seed=2)
    x = arrays(rng, np.float32)
    want = ndarray_outputs(np.float32)
    dbeta_want = run_ooc(x, want, W, True, BLOCK)
    o = ndarray_outputs(np.float32)
    assert run_ooc({k: da.from_array(a, chunks=(1, 3, 50, -1)) for k, a in x.items()}, o, W, True, BLOCK) \
        == dbeta_want
    assert_same_bits(o, want)


def test_identity(tmp_path, rng):
    """What a checkpoint key holds for zarr and array-like arguments."""
    x = arrays(rng, np.float32)
    z = zarr_inputs(tmp_path, {"q": x["q"]})["q"]
    ident = blocks.identity(z)
    assert ident[:5] == ["zarr", "file://" + str((tmp_path / "q.zarr").resolve()), list(SHAPES["q"]), "float32",
                         [1, 3, 64, D]]
    assert blocks.identity(z, digest=False) == ident[:5]
    content = blocks.identity(Sliceable(x["q"]))[-1]
    assert ident[-1] == content  # small: both read in one go
    x["q"][1, 2, 199, 15] += 1.0
    assert blocks.identity(Sliceable(x["q"]))[-1] != content


def test_digest_reads_bounded_blocks(tmp_path, rng, monkeypatch):
    """The content digest reads DIGEST_BYTES at a time along the tokens (whole chunks for zarr)."""
    x = arrays(rng, np.float32)
    row = int(np.prod(LEAD)) * D * 4
    monkeypatch.setattr(blocks, "DIGEST_BYTES", 50 * row)
    seen = []

    class Recording(Sliceable):
        def __getitem__(self, index):
            seen.append(index[-2])
            return super().__getitem__(index)

    blocks.content_digest(Recording(x["q"]))
    assert seen == [slice(lo, min(lo + 50, N)) for lo in range(0, N, 50)]
    z = zarr_inputs(tmp_path, {"q": x["q"]})["q"]  # 64 tokens a chunk: one chunk a read
    assert blocks._digest_rows(z) == 64
    monkeypatch.setattr(blocks, "DIGEST_BYTES", 130 * row)
    assert blocks._digest_rows(z) == 128


def test_identity_without_digest_and_of_outputs(tmp_path, rng):
    """Without a checkpoint (no digest) and as outputs, a generic array-like is its id, a zarr
    array its location, shape and dtype (the same when reopened by path)."""
    x = arrays(rng, np.float32)
    a, w = Sliceable(x["q"]), Writable(x["q"])
    assert blocks.identity(a, digest=False) == ["arraylike", "Sliceable", list(SHAPES["q"]), "float32", id(a)]
    assert blocks.identity(w, written=True) == ["arraylike", "Writable", list(SHAPES["q"]), "float32", id(w)]
    out = zarr_outputs(tmp_path, np.float32)["out"]
    assert blocks.identity(out, written=True) == ["zarr", "file://" + str((tmp_path / "out.zarr").resolve()),
                                                  list(SHAPES["out"]), "float32"]
    assert blocks.identity(reopen(tmp_path)["out"], written=True) == blocks.identity(out, written=True)


def test_bad_outputs(tmp_path, rng):
    W = racecpu.hyperplanes(D, 3, 2, seed=2)
    x = arrays(rng, np.float32)
    zarr_outputs(tmp_path, np.float32)
    ro = reopen(tmp_path, mode="r")
    with pytest.raises(ValueError, match="out is a read-only Array"):
        race_attention_fwd_ooc(x["q"], x["k"], x["v"], W, out=ro["out"], progress=False)
    good = reopen(tmp_path)
    res = race_attention_fwd_ooc(x["q"], x["k"], x["v"], W, out=good["out"], block=BLOCK, progress=False)
    with pytest.raises(ValueError, match="dk is a read-only Array"):
        race_attention_bwd_ooc(res, x["g"], dq=good["dq"], dk=ro["dk"], dv=good["dv"], progress=False)
    wrong = zarr.create_array(store=tmp_path / "wrong.zarr", shape=LEAD + (N, D), dtype=np.float32)
    with pytest.raises(ValueError, match="out must have shape"):
        race_attention_fwd_ooc(x["q"], x["k"], x["v"], W, out=wrong, progress=False)
    ints = zarr.create_array(store=tmp_path / "ints.zarr", shape=SHAPES["out"], dtype=np.int32)
    with pytest.raises(TypeError, match="out must be a float array"):
        race_attention_fwd_ooc(x["q"], x["k"], x["v"], W, out=ints, progress=False)
    with pytest.raises(TypeError, match="out must be an np.memmap, ndarray, writable zarr.Array"):
        race_attention_fwd_ooc(x["q"], x["k"], x["v"], W, out=Sliceable(np.zeros(SHAPES["out"], np.float32)),
                               progress=False)
    with pytest.raises(TypeError, match="q must be an np.memmap, ndarray, row source .* or array-like"):
        race_attention_fwd_ooc(type("NoIndex", (), dict(shape=SHAPES["q"], dtype=np.float32))(), x["k"], x["v"],
                               W, out=good["out"], progress=False)


@pytest.mark.parametrize("causal", [True, False])
def test_interrupted_zarr_runs_resume_bit_for_bit(tmp_path, rng, monkeypatch, causal):
    """Interrupted checkpointed runs on zarr inputs and outputs, each rerun opening the stores
    afresh by path (as a restarted script does), end in the bits of an uninterrupted run."""
    W = racecpu.hyperplanes(D, 3, 2, seed=3)
    x = arrays(rng, np.float32)
    clean = ndarray_outputs(np.float32)
    dbeta_clean = run_ooc(x, clean, W, causal, BLOCK)
    zx = zarr_inputs(tmp_path, x)
    zarr_outputs(tmp_path, np.float32)
    ck = tmp_path / "ck"
    total = (2 if causal else 4) * -(-N // BLOCK)
    done = 0
    for stop in (3, 2, 4):  # interrupt in different passes; each rerun resumes where the last stopped
        if done + stop >= total:
            break
        with pytest.raises(Interrupt):
            run_ooc(zx, reopen(tmp_path), W, causal, BLOCK, checkpoint=ck, progress=StopAfter(stop))
        done += stop
        states = [json.loads(p.read_text()) for p in ck.glob("*.json")]
        assert not all(s["complete"] for s in states) and sum(s["done"] for s in states) == done

    # an interrupt in the middle of a block (half its rows written): that block is not recorded
    def failing_store(x, lead, lo, hi, data):
        half = (hi - lo) // 2
        store(x, lead, lo, lo + half, data[:, :half])
        raise Interrupt

    store = blocks.store_block
    monkeypatch.setattr(blocks, "store_block", failing_store)
    with pytest.raises(Interrupt):
        run_ooc(zx, reopen(tmp_path), W, causal, BLOCK, checkpoint=ck)
    monkeypatch.setattr(blocks, "store_block", store)
    assert sum(json.loads(p.read_text())["done"] for p in ck.glob("*.json")) == done
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)  # same stores, same contents: a clean resume
        dbeta = run_ooc(open_inputs(tmp_path), reopen(tmp_path), W, causal, BLOCK, checkpoint=ck)
    assert_same_bits(read(reopen(tmp_path, mode="r")), clean)
    assert dbeta == dbeta_clean


def test_changed_zarr_input_or_recreated_output_restarts(tmp_path, rng):
    """The content digest sees an input changed in place; the checksums see a recreated output."""
    W = racecpu.hyperplanes(D, 3, 2, seed=3)
    x = arrays(rng, np.float32)
    zx = zarr_inputs(tmp_path, x)
    zarr_outputs(tmp_path, np.float32)
    ck = tmp_path / "ck"
    with pytest.raises(Interrupt):
        run_ooc(zx, reopen(tmp_path), W, True, BLOCK, checkpoint=ck, progress=StopAfter(3))
    # the same store, one number changed: the forward must restart
    zarr.open_array(tmp_path / "k.zarr", mode="r+")[1, 2, 150, 3] = 0.5
    x["k"][1, 2, 150, 3] = 0.5
    clean = ndarray_outputs(np.float32)
    dbeta_clean = run_ooc(x, clean, W, True, BLOCK)
    with warnings.catch_warnings(record=True) as w, pytest.raises(Interrupt):
        warnings.simplefilter("always", CheckpointWarning)
        run_ooc(zx, reopen(tmp_path), W, True, BLOCK, checkpoint=ck, progress=StopAfter(2))
    assert [str(r.message) for r in w if issubclass(r.category, CheckpointWarning)] and \
        "(differing: k)" in str(w[0].message)
    # the outputs recreated (empty: read as zeros) at the same place: the done blocks are recomputed
    zarr_outputs(tmp_path, np.float32)
    with pytest.warns(CheckpointWarning, match="outputs of done block 0"):
        dbeta = run_ooc(zx, reopen(tmp_path), W, True, BLOCK, checkpoint=ck)
    assert_same_bits(read(reopen(tmp_path, mode="r")), clean)
    assert dbeta == dbeta_clean

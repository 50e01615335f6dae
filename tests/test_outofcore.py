"""Out-of-core RACE: chunked memmap fwd/bwd equal the in-memory API; checkpoints resume cleanly.

The block engine under it (racecpu._blocks) is tested here through it; the
demo and its seeded inputs are in test_ooc_demo.py.
"""

import json

import numpy as np
import pytest

import racecpu
from racecpu import _blocks as blocks
from racecpu.apps.ooc_demo import SeededArray
from racecpu.outofcore import race_attention_bwd_ooc, race_attention_fwd_ooc

TOL = {np.float64: 1e-12, np.float32: 2e-6}


def memmap(path, shape, dtype):
    return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)


def inputs(tmp_path, rng, lead, nq, nk, d, dv, dtype):
    arrays = {"q": rng.standard_normal(lead + (nq, d)), "k": rng.standard_normal(lead + (nk, d)),
              "v": rng.standard_normal(lead + (nk, dv)), "g": rng.standard_normal(lead + (nq, dv))}
    out = {}
    for name, a in arrays.items():
        m = memmap(tmp_path / f"{name}.npy", a.shape, dtype)
        m[...] = a
        m.flush()
        out[name] = np.lib.format.open_memmap(tmp_path / f"{name}.npy", mode="r")
    return out


def outputs(tmp_path, lead, nq, nk, d, dv, dtype, tag=""):
    return {"out": memmap(tmp_path / f"out{tag}.npy", lead + (nq, dv), dtype),
            "dq": memmap(tmp_path / f"dq{tag}.npy", lead + (nq, d), dtype),
            "dk": memmap(tmp_path / f"dk{tag}.npy", lead + (nk, d), dtype),
            "dv": memmap(tmp_path / f"dv{tag}.npy", lead + (nk, dv), dtype)}


def run_ooc(x, o, W, causal, block, checkpoint=None, beta=8.0, progress=False, commit_every=0):
    res = race_attention_fwd_ooc(x["q"], x["k"], x["v"], W, beta, causal=causal, out=o["out"], block=block,
                                 checkpoint=checkpoint, commit_every=commit_every, progress=progress)
    return race_attention_bwd_ooc(res, x["g"], dq=o["dq"], dk=o["dk"], dv=o["dv"], checkpoint=checkpoint,
                                  commit_every=commit_every, progress=progress)


CASES = [  # lead, nq, nk, block, causal
    ((2,), 2500, 2500, 700, True),      # blocks not aligned to the kernels' chunks
    ((2, 2), 300, 300, 64, True),
    ((1,), 3000, 3000, 1024, True),
    ((2,), 900, 2300, 500, False),      # Nq != Nk
    ((3,), 1100, 1100, 1024, False),
    ((), 50, 50, 7, True),
]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("lead,nq,nk,block,causal", CASES)
def test_matches_in_memory(tmp_path, rng, dtype, lead, nq, nk, block, causal):
    d, dv = 5, 4
    W = racecpu.hyperplanes(d, 3, 2, seed=2, dtype=dtype)
    x = inputs(tmp_path, rng, lead, nq, nk, d, dv, dtype)
    o = outputs(tmp_path, lead, nq, nk, d, dv, dtype)
    dbeta = run_ooc(x, o, W, causal, block, checkpoint=tmp_path / "ck")
    out, res = racecpu.race_attention_fwd(np.asarray(x["q"]), np.asarray(x["k"]), np.asarray(x["v"]), W, 8.0,
                                          causal=causal)
    grads = racecpu.race_attention_bwd(res, np.asarray(x["g"]))
    tol = TOL[dtype]
    for name, want in zip(("out", "dq", "dk", "dv"), (out,) + grads[:3]):
        assert o[name].dtype == dtype
        np.testing.assert_allclose(o[name], want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()),
                                   err_msg=name)
    assert dbeta == pytest.approx(grads[3], rel=1e-9 if dtype == np.float64 else 1e-5, abs=1e-9)
    for p in (tmp_path / "ck").glob("*.json"):
        assert json.loads(p.read_text())["complete"]


def test_in_memory_arrays_and_seeded_inputs(rng):
    """ndarray outputs and SeededArray inputs (no checkpoint) also work."""
    lead, n, d = (2,), 1500, 4
    q, k, v, g = (SeededArray(lead + (n, d), seed=s, tile=333) for s in range(4))
    W = racecpu.hyperplanes(d, 2, 3, seed=0)
    out = np.zeros(lead + (n, d), np.float32)
    res = race_attention_fwd_ooc(q, k, v, W, 6.0, causal=True, out=out, block=400, progress=False)
    dq, dk, dv = (np.zeros(lead + (n, d), np.float32) for _ in range(3))
    dbeta = race_attention_bwd_ooc(res, g, dq=dq, dk=dk, dv=dv, progress=False)
    o_ref, r_ref = racecpu.race_attention_fwd(np.asarray(q), np.asarray(k), np.asarray(v), W, 6.0, causal=True)
    grads = racecpu.race_attention_bwd(r_ref, np.asarray(g))
    for got, want in zip((out, dq, dk, dv), (o_ref,) + grads[:3]):
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())
    assert dbeta == pytest.approx(grads[3], rel=1e-5)


class Interrupt(Exception):
    pass


class StopAfter:
    """A 'progress bar' that interrupts the run after n computed (and recorded) blocks."""

    def __init__(self, n):
        self.n = n

    def update(self, k=1):
        self.n -= k
        if self.n <= 0:
            raise Interrupt

    def resumed(self, k):
        pass


@pytest.mark.parametrize("causal", [True, False])
def test_interrupted_runs_resume_bit_for_bit(tmp_path, rng, monkeypatch, causal):
    lead, n, d, dv, block = (2,), 1200, 4, 3, 100
    W = racecpu.hyperplanes(d, 3, 2, seed=3)
    x = inputs(tmp_path, rng, lead, n, n, d, dv, np.float32)
    clean = outputs(tmp_path, lead, n, n, d, dv, np.float32, tag="_clean")
    dbeta_clean = run_ooc(x, clean, W, causal, block)

    o = outputs(tmp_path, lead, n, n, d, dv, np.float32)
    ck = tmp_path / "ck"
    total = (2 if causal else 4) * (n // block)
    done = 0
    for stop in (5, 6, 6, 11):  # interrupt in different passes; each rerun resumes where the last stopped
        if done + stop >= total:
            break
        with pytest.raises(Interrupt):
            run_ooc(x, o, W, causal, block, checkpoint=ck, progress=StopAfter(stop))
        done += stop
        states = [json.loads(p.read_text()) for p in ck.glob("*.json")]
        assert not all(s["complete"] for s in states) and sum(s["done"] for s in states) == done
    # an interrupt in the middle of a block (outputs half written): that block is not recorded
    def failing_store(x, lead, lo, hi, data):
        store(x, lead, lo, hi, data[:1])  # the first head only, then the process dies
        raise Interrupt

    store = blocks.store_block
    monkeypatch.setattr(blocks, "store_block", failing_store)
    with pytest.raises(Interrupt):
        run_ooc(x, o, W, causal, block, checkpoint=ck)
    monkeypatch.setattr(blocks, "store_block", store)
    states = [json.loads(p.read_text()) for p in ck.glob("*.json")]
    assert sum(s["done"] for s in states) == done
    # with rare commits (the default) an interrupt loses the uncommitted blocks, which are recomputed
    with pytest.raises(Interrupt):
        run_ooc(x, o, W, causal, block, checkpoint=ck, progress=StopAfter(3), commit_every=3600)
    states = [json.loads(p.read_text()) for p in ck.glob("*.json")]
    assert sum(s["done"] for s in states) == done
    dbeta = run_ooc(x, o, W, causal, block, checkpoint=ck)
    for name in o:
        np.testing.assert_array_equal(o[name], clean[name], err_msg=name)
    assert dbeta == dbeta_clean

    # a rerun with a different beta must not reuse the checkpoint: it restarts and equals a fresh run
    fresh = outputs(tmp_path, lead, n, n, d, dv, np.float32, tag="_fresh")
    dbeta_fresh = run_ooc(x, fresh, W, causal, block, beta=3.0)
    assert run_ooc(x, o, W, causal, block, checkpoint=ck, beta=3.0) == dbeta_fresh
    for name in o:
        np.testing.assert_array_equal(o[name], fresh[name], err_msg=name)


def test_bad_arguments(tmp_path, rng):
    x = inputs(tmp_path, rng, (2,), 20, 20, 4, 3, np.float32)
    W = racecpu.hyperplanes(4, 2, 2)
    good = np.zeros((2, 20, 3), np.float32)
    with pytest.raises(ValueError, match="shape"):
        race_attention_fwd_ooc(x["q"], x["k"], x["v"], W, out=np.zeros((2, 20, 4), np.float32), progress=False)
    with pytest.raises(ValueError, match="mode"):
        race_attention_fwd_ooc(x["q"], x["k"], x["v"], W, out=x["g"], progress=False)
    with pytest.raises(ValueError, match="causal"):
        race_attention_fwd_ooc(x["q"][:, :10], x["k"], x["v"], W, causal=True, out=good[:, :10], progress=False)
    with pytest.raises(TypeError, match="float32 or float64"):
        race_attention_fwd_ooc(np.zeros((2, 20, 4), np.int64), x["k"], x["v"], W, out=good, progress=False)
    with pytest.raises(ValueError, match="block"):
        race_attention_fwd_ooc(x["q"], x["k"], x["v"], W, out=good, block=0, progress=False)
    bad = np.array(x["q"])
    bad[1, 7, 0] = np.inf
    with pytest.raises(ValueError, match="NaN or Inf in tokens"):
        race_attention_fwd_ooc(bad, x["k"], x["v"], W, out=good, block=5, progress=False)
    with pytest.raises(TypeError, match="race_attention_fwd_ooc"):
        race_attention_bwd_ooc(None, x["g"], dq=good, dk=good, dv=good)


def _rss_file():
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("RssFile:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def test_release_drops_mapped_pages_but_keeps_writes(tmp_path):
    """The bounded-RAM mechanism: pages of memmaps leave the resident set, written data stays."""
    if _rss_file() is None:
        pytest.skip("needs /proc/self/status (Linux)")
    n = 64 * 2 ** 20 // 4
    a = np.lib.format.open_memmap(tmp_path / "a.npy", mode="w+", dtype=np.float32, shape=(n,))
    a[:] = 1.5  # dirty every page of the shared mapping
    before = _rss_file()
    blocks.release_pages(a)
    after = _rss_file()
    assert before - after > 48 * 2 ** 20
    assert float(a[::4096].sum()) == 1.5 * len(a[::4096])  # re-read from the page cache / file
    del a
    assert float(np.load(tmp_path / "a.npy", mmap_mode="r")[-1]) == 1.5


@pytest.mark.parametrize("causal", [False, True])
def test_grouped_kv_matches_in_memory(tmp_path, rng, causal):
    # k and v with 2 heads for q's 6 (grouped-query attention): the in-memory
    # grouped call's output and gradients, with blocks not on the chunks
    n, d, dv = 1300, 8, 5
    x = {"q": rng.standard_normal((1, 6, n, d)), "k": rng.standard_normal((1, 2, n, d)),
         "v": rng.standard_normal((1, 2, n, dv)), "g": rng.standard_normal((1, 6, n, dv))}
    o = {"out": memmap(tmp_path / "out.npy", (1, 6, n, dv), np.float64),
         "dq": memmap(tmp_path / "dq.npy", (1, 6, n, d), np.float64),
         "dk": memmap(tmp_path / "dk.npy", (1, 2, n, d), np.float64),
         "dv": memmap(tmp_path / "dv.npy", (1, 2, n, dv), np.float64)}
    W = racecpu.hyperplanes(d, 3, 3, seed=2, dtype=np.float64)
    dbeta = run_ooc(x, o, W, causal, block=500)
    y, res = racecpu.race_attention_fwd(x["q"], x["k"], x["v"], W, 8.0, causal=causal)
    want = racecpu.race_attention_bwd(res, x["g"])
    for name, a, b in zip(("out", "dq", "dk", "dv"), (o["out"], o["dq"], o["dk"], o["dv"]), (y,) + want[:3]):
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=1e-10, err_msg=name)
    assert dbeta == pytest.approx(want[3], rel=1e-10, abs=1e-10)
    with pytest.raises(ValueError, match="divides q's"):
        race_attention_fwd_ooc(x["q"], x["k"][:, :1].repeat(4, 1), x["v"][:, :1].repeat(4, 1), W,
                               out=o["out"])

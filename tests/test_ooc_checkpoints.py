"""Out-of-core checkpoints that cannot resume into wrong results (issue 40, item 6).

Each damage a checkpoint can meet on disk (an output file reopened ``'w+'``,
a truncated state file, an edited manifest, random byte flips) must end in
the bits of an uninterrupted run, with a CheckpointWarning that says why the
pass restarted, or a clear error; never in silently wrong numbers.

``RACECPU_CKPT_FUZZ=<n>`` runs ``n`` random corruptions instead of a few.
"""

import json
import os
import warnings

import numpy as np
import pytest

import racecpu
from racecpu._blocks import CheckpointWarning

from .test_outofcore import Interrupt, StopAfter, inputs, run_ooc

LEAD, N, D, DV, BLOCK = (2,), 240, 4, 3, 40  # 6 blocks a pass


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ck")
    x = inputs(tmp, np.random.default_rng(7), LEAD, N, N, D, DV, np.float32)
    W = racecpu.hyperplanes(D, 3, 2, seed=3)
    clean = {}
    for causal in (True, False):
        o = outputs(tmp, LEAD, N, N, D, DV, np.float32, tag=f"_clean{causal}")
        clean[causal] = (run_ooc(x, o, W, causal, BLOCK), {k: np.array(v) for k, v in o.items()})
    return tmp, x, W, clean


def reopen(tmp, tag, mode):
    """The outputs opened by (str) path, as a script that restarts does (same shapes and dtypes)."""
    shapes = {"out": LEAD + (N, DV), "dq": LEAD + (N, D), "dk": LEAD + (N, D), "dv": LEAD + (N, DV)}
    return {k: np.lib.format.open_memmap(os.path.join(tmp, f"{k}{tag}.npy"), mode=mode, dtype=np.float32, shape=s)
            for k, s in shapes.items()}


def outputs(tmp, lead, nq, nk, d, dv, dtype, tag=""):
    return reopen(tmp, tag, "w+")


def interrupted(tmp, x, W, causal, ck, stop, tag):
    o = outputs(tmp, LEAD, N, N, D, DV, np.float32, tag=tag)
    with pytest.raises(Interrupt):
        run_ooc(x, o, W, causal, BLOCK, checkpoint=ck, progress=StopAfter(stop))
    return o


def assert_clean(got, dbeta, clean):
    dbeta_clean, want = clean
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert dbeta == dbeta_clean


def resume(x, o, W, causal, ck, match):
    with pytest.warns(CheckpointWarning, match=match):
        return run_ooc(x, o, W, causal, BLOCK, checkpoint=ck)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("where", ["forward", "backward", "complete"])
def test_outputs_reopened_w_plus(setup, tmp_path, causal, where):
    """Reopening the outputs with 'w+' zeroes the done blocks: the pass must notice and recompute."""
    tmp, x, W, clean = setup
    ck = tmp_path / "ck"
    # blocks a pass: 6; causal: forward, backward; non-causal: sketch, readout, queries, keys
    stop = {"forward": 3 if causal else 8, "backward": 8 if causal else 20, "complete": None}[where]
    if stop is None:
        run_ooc(x, outputs(tmp_path, LEAD, N, N, D, DV, np.float32), W, causal, BLOCK, checkpoint=ck)
    else:
        interrupted(tmp_path, x, W, causal, ck, stop, "")
    o = reopen(tmp_path, "", "w+")
    assert_clean(o, resume(x, o, W, causal, ck, "outputs of done block 0"), clean[causal])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cut", [1, 200, -8])  # into the header, into the rows, the last 8 bytes
def test_truncated_state_file(setup, tmp_path, causal, cut):
    tmp, x, W, clean = setup
    ck = tmp_path / "ck"
    o = interrupted(tmp_path, x, W, causal, ck, 4, "")
    path = ck / ("fwd_causal.state1.npy" if causal else "fwd_sketch.state1.npy")
    size = path.stat().st_size
    os.truncate(path, cut if cut > 0 else size + cut)
    assert_clean(o, resume(x, o, W, causal, ck, "state file .* damaged"), clean[causal])
    assert path.stat().st_size == size


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("edit", ["more", "fewer", "more, checksum redone"])
def test_edited_manifest(setup, tmp_path, causal, edit):
    tmp, x, W, clean = setup
    ck = tmp_path / "ck"
    o = interrupted(tmp_path, x, W, causal, ck, 3, "")
    path = ck / ("fwd_causal.json" if causal else "fwd_sketch.json")
    rec = json.loads(path.read_text())
    rec["done"] += 2 if edit.startswith("more") else -2
    match = "checksum does not match"
    if "redone" in edit:  # someone who knows the format: the per-block checksums still disagree
        from racecpu._blocks import _json_digest
        rec["sum"] = _json_digest({k: v for k, v in rec.items() if k != "sum"})
        match = "fields are inconsistent"
    path.write_text(json.dumps(rec))
    assert_clean(o, resume(x, o, W, causal, ck, match), clean[causal])


def test_damaged_state_row(setup, tmp_path):
    """A changed number inside a state row (size intact) is caught by its checksum."""
    tmp, x, W, clean = setup
    ck = tmp_path / "ck"
    o = interrupted(tmp_path, x, W, True, ck, 4, "")
    m = np.load(ck / "fwd_causal.state0.npy", mmap_mode="r+")
    m[2, 0, 0] += 1.0
    m.flush()
    del m
    assert_clean(o, resume(x, o, W, True, ck, "state row 2"), clean[True])


def test_clean_resume_warns_nothing(setup, tmp_path):
    tmp, x, W, clean = setup
    ck = tmp_path / "ck"
    o = interrupted(tmp_path, x, W, True, ck, 5, "")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        assert_clean(o, run_ooc(x, o, W, True, BLOCK, checkpoint=ck), clean[True])


def test_random_corruption_fuzz(setup, tmp_path):
    """Flip random bytes in the manifests and state files of an interrupted run: the rerun
    ends in the uninterrupted bits or a clear error (ValueError/OSError), never wrong numbers."""
    tmp, x, W, clean = setup
    trials = int(os.environ.get("RACECPU_CKPT_FUZZ", "40"))
    rng = np.random.default_rng(2024)
    counts = dict(cases=0, correct=0, errors=0, wrong=0, warned=0)
    for t in range(trials):
        causal = bool(t % 2)
        ck = tmp_path / f"ck{t}"
        o = interrupted(tmp_path, x, W, causal, ck, int(rng.integers(1, 11)), f"_{t}")
        files = sorted(p for p in ck.iterdir() if p.suffix in (".json", ".npy"))
        for _ in range(int(rng.integers(1, 4))):
            p = files[rng.integers(len(files))]
            b = bytearray(p.read_bytes())
            if b:
                # a state file's first half: the header and rows a resume would use
                i = int(rng.integers(len(b) if p.suffix == ".json" else len(b) // 2))
                b[i] ^= 1 << int(rng.integers(8))
                p.write_bytes(bytes(b))
        counts["cases"] += 1
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always", CheckpointWarning)
            try:
                dbeta = run_ooc(x, o, W, causal, BLOCK, checkpoint=ck)
            except (ValueError, OSError):
                counts["errors"] += 1
                continue
        counts["warned"] += any(issubclass(r.category, CheckpointWarning) for r in w)
        dbeta_clean, want = clean[causal]
        ok = dbeta == dbeta_clean and all(np.array_equal(o[k], want[k]) for k in want)
        counts["correct" if ok else "wrong"] += 1
        for k in list(o):
            del o[k]
    print("checkpoint corruption fuzz:", counts)
    assert counts["wrong"] == 0 and counts["correct"] + counts["errors"] == trials

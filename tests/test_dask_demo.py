"""``racecpu demo --dask`` as a new user runs it: any ``--tokens``, 4 heads by default, the disk checked first.

The runs go to one module-scoped ``LocalCluster`` (2 single-threaded worker
processes, as in test_dask.py) through ``--dask ADDRESS``, in this process:
a cluster per run would cost its start-up each time.  The demo's own
``LocalCluster`` is run by test_cli.py's ``demo --dask`` test.
"""

import argparse
import collections
import json
import os

import numpy as np
import pytest

from racecpu.cli import main

distributed = pytest.importorskip("distributed")
zarr = pytest.importorskip("zarr")

from racecpu.apps import dask_demo  # noqa: E402  (needs dask)

_Usage = collections.namedtuple("_Usage", "total used free")


@pytest.fixture(scope="module")
def scheduler():
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                  silence_logs=40) as cluster:
        yield cluster.scheduler_address


@pytest.mark.parametrize("tokens", [1, 1000])
def test_demo_dask_runs_at_any_tokens_with_4_heads(scheduler, tmp_path, capsys, tokens):
    """Fewer tokens than the default block: one block per head (no carries: distributed's persist of
    none raised "No collections provided"), 4 heads as in the in-memory demo, every token checked."""
    d = str(tmp_path / "dd")
    rc = main(["demo", "--dask", scheduler, "--tokens", str(tokens), "--head-dim", "16", "--dask-dir", d, "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    doc = json.loads(out.out)
    assert doc["ok"] and doc["heads"] == 4 and doc["tokens"] == tokens
    assert doc["block"] == tokens and doc["blocks"] == 4  # one block per head, not a 262,144-token chunk
    assert doc["check_tokens"] == tokens  # out and dq of every token against the in-memory API
    assert doc["check_max_abs_err_out"] < 1e-5 and doc["check_max_abs_err_dq"] < 1e-5
    # The results take what the refusal's estimate says, exactly with zarr 3's layout (the padding of a
    # block longer than the sequence would have been 4 heads x 4 x 262,144 x 16 x 4 bytes = 256 MiB).
    assert doc["disk_bytes"] <= dask_demo.disk_needed(tokens, 4, 16, tokens)[0] < 2 ** 20 + 20 * tokens * 16 * 16
    for name in ("out", "dq", "dk", "dv"):
        z = zarr.open_array(os.path.join(d, name), mode="r")
        assert z.shape == (4, tokens, 16) and z.chunks == (1, tokens, 16) and np.isfinite(z[...]).all()
    assert np.abs(zarr.open_array(os.path.join(d, "dv"), mode="r")[...]).max() > 0
    assert "delete it when done" in out.err and d in out.err  # human text on stderr under --json
    # the forward's rows went from phase 2 to phase 4 in files, deleted at the end
    assert 0 < doc["rows_bytes"] <= dask_demo.rows_needed(tokens, 4, 16) + 4 * 4096 * 8
    assert not os.path.exists(os.path.join(d, "rows"))


@pytest.mark.parametrize("scan", ["fused", "tree"])
def test_demo_dask_runs_every_block_task_once(scheduler, tmp_path, scan):
    """Several blocks per head: every block's forward task and backward task run once in the whole
    demo, on the worker of its head, with either scan (a fused scan run through the tree's four
    phases ran every block's but each head's last twice: a phase that kept only the carries, then
    one for the outputs or gradients), and every token's out and dq equal the in-memory API's."""
    tokens, block, heads = 2500, 1024, 2  # three blocks per head, the last one short
    with distributed.Client(scheduler) as client, distributed.get_task_stream(client) as ts:
        m = dask_demo.demo(tokens=tokens, heads=heads, dim=16, directory=str(tmp_path / "dd"), scheduler=scheduler,
                           block=block, progress=False, scan=scan)
    runs, seen = collections.Counter(), set()
    for t in ts.data:
        name = t["key"] if isinstance(t["key"], str) else t["key"][0]
        kind = ("backward" if name.startswith("race-causal-bwd-") else "forward" if name.startswith("race-causal-")
                else None)
        for s in t["startstops"]:  # the stream may report one run twice: counted once
            if kind is not None and s["action"] == "compute" and (name, s["start"]) not in seen:
                seen.add((name, s["start"]))
                runs[kind] += 1
    blocks = heads * 3
    assert m["scan"] == scan and m["blocks"] == blocks
    assert runs == {"forward": blocks, "backward": blocks}
    assert [label for label, _ in m["phases"]] == (["outputs", "gradients"] if scan == "fused" else [
        "forward states", "outputs, dstates", "reverse carries", "gradients"])
    assert m["seconds_total"] >= sum(sec for _, sec in m["phases"]) > 0
    assert m["check_tokens"] == tokens
    assert m["check_max_abs_err_out"] < 1e-5 and m["check_max_abs_err_dq"] < 1e-5
    # Each head's blocks placed on one worker (racecpu.dask.block_placement): no sketch crosses, only
    # dbeta's shares (a float each); placed by Dask, 1.2-2.0 states per block and pass crossed.
    assert m["bytes_moved_sketches"] < m["state_bytes"], m["bytes_moved_sketches"]
    assert m["bytes_moved_other"] < 4096  # no rows: no task ran away from its block's inputs


def test_pick_block():
    B = dask_demo.MAX_BLOCK
    assert [dask_demo.pick_block(n) for n in (1, 1000, B, B + 1, 3 * B - 5)] == [1, 1000, B, B // 2 + 1, B - 1]
    assert dask_demo.pick_block(1000, 4096) == 1000 and dask_demo.pick_block(20000, 4096) == 4096


def test_result_arrays_write_every_chunk_without_comparing_it(tmp_path):
    """The demo's zarr arrays write a chunk as given: zarr's default compares every chunk with the
    fill value first (a temporary as large as the chunk) and writes none of an all-zero one."""
    z = dask_demo._zarr_array(zarr, str(tmp_path / "z"), (1, 8, 4), (1, 4, 4))
    z[:, :4] = 0.0
    z[:, 4:] = 1.5
    back = zarr.open_array(str(tmp_path / "z"), mode="r")
    assert back[0, :4].tolist() == [[0.0] * 4] * 4 and (back[0, 4:] == 1.5).all()
    chunks = [f for _, _, files in os.walk(tmp_path / "z") for f in files if f != "zarr.json" and f != ".zarray"]
    assert len(chunks) == 2  # the zero chunk is on disk too


def test_disk_needed_counts_the_padded_last_chunk():
    one = dask_demo.disk_needed(4096, 1, 16, 4096)[0]
    padded = dask_demo.disk_needed(4097, 1, 16, 4096)[0]
    assert padded - one >= 4 * 4096 * 16 * 4  # a second full chunk per array
    total, per_head = dask_demo.disk_needed(2 ** 18, 4, 128, 2 ** 18)
    assert 16 * 2 ** 18 * 128 <= per_head < 16 * 2 ** 18 * 128 * 1.001 and 4 * per_head < total < 4 * per_head + 2 ** 20


def _fake_disk(monkeypatch, free):
    monkeypatch.setattr(dask_demo.shutil, "disk_usage", lambda path: _Usage(10 * free + 1, 9 * free, free))


class _Started(Exception):
    pass


def _no_cluster(*args, **kwargs):
    raise _Started


def test_demo_dask_refuses_what_the_disk_does_not_hold(tmp_path, capsys, monkeypatch):
    """Exit 2 and one error line naming the bytes needed and free, before a cluster starts or a folder is made."""
    d = str(tmp_path / "dd")
    need = dask_demo.disk_needed(262144, 4, 128, 262144)[0]
    rows = dask_demo.rows_needed(262144, 4, 128)  # the forward's rows, on disk while the demo runs
    assert 272 * 262144 * 4 < rows < 300 * 262144 * 4
    free = need + rows + dask_demo.DISK_MARGIN - 1
    _fake_disk(monkeypatch, free)
    monkeypatch.setattr(dask_demo, "demo", _no_cluster)
    rc = main(["demo", "--dask", "--tokens", "262144", "--dask-dir", d])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("racecpu demo: error: --dask: ") and err.count("\n") == 1 and "Traceback" not in err
    assert f"{need:,} bytes" in err and f"{free:,} bytes" in err and f"{rows:,} more" in err and "4 head(s)" in err
    assert not os.path.exists(d)

    # One byte more and it starts (here: the stand-in for the cluster's demo).
    _fake_disk(monkeypatch, free + 1)
    with pytest.raises(_Started):
        main(["demo", "--dask", "--tokens", "262144", "--dask-dir", d])

    # An earlier run's results there are replaced: their bytes count as free.
    os.makedirs(os.path.join(d, "dk"), exist_ok=True)
    with open(os.path.join(d, "dk", "0"), "wb") as f:
        f.write(os.urandom(2 ** 20))  # not zeros: a compressing filesystem would store none
    _fake_disk(monkeypatch, free + 1 - 2 ** 20)
    with pytest.raises(_Started):
        main(["demo", "--dask", "--tokens", "262144", "--dask-dir", d])


def test_demo_dask_defaults_to_4_heads_and_says_what_it_writes():
    from racecpu.apps import demo
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    assert p.parse_args(["--dask"]).heads == 4 and p.parse_args(["--dask", "--heads", "2"]).heads == 2
    text = " ".join(p.format_help().split())
    assert "out, dq, dk, dv as zarr" in text and "bytes per head" in text and "--dask-dir" in text
    assert "delete the folder when done" in text and "as many as the disk holds" not in text

"""Issue 59's tools: the PyTorch trainer (benchmarks/torch_train.py) and the map's cells and frontier
(benchmarks/defaults_map.py), at tiny sizes."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).parents[1] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"race_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _doc(att, seed, acc, ms, P=3, L=3, beta=8.0, **cfg):
    return {"task": "mqar", "attention": att, "val_accuracy": acc, "time_per_step_ms": ms,
            "beta": [beta, beta] if att == "race" else None,
            "config": dict(num_planes=P, num_tables=L, beta=beta, seed=seed, **cfg)}


def test_cells_group_seeds_and_the_frontier_keeps_only_undominated_cells():
    dm = _load("defaults_map")
    docs = [_doc("softmax", s, 1.0, 300) for s in range(3)]
    docs += [_doc("race", s, a, ms) for s, a, ms in ((0, 0.6, 200), (1, 0.7, 220), (2, 0.2, 210))]
    docs += [_doc("race", 0, 0.9, 250, P=4, L=4), _doc("race", 0, 0.5, 260, P=5, L=8, beta=4.0)]
    docs += [_doc("race", 0, 0.8, 230, softmax_layers=[0])]
    rows = {r["cell"]: r for r in dm.cells(docs)}
    assert sorted(rows) == ["race P3 L3 b8", "race P4 L4 b8", "race P5 L8 b4", "race+softmax@0 P3 L3 b8", "softmax"]
    default = rows["race P3 L3 b8"]
    assert (default["seeds"], default["metric"], default["low"], default["high"]) == (3, 0.6, 0.2, 0.7)
    assert default["ms_per_step"] == 210
    assert {r["cell"]: r["ms_per_step"] for r in dm.cells(docs, cost_seed=1)}["race P3 L3 b8"] == 220
    assert {r["cell"]: r["ms_per_step"] for r in dm.cells(docs, cost_seed=1)}["race P4 L4 b8"] == 250  # no seed 1
    front = [r["cell"] for r in dm.frontier(list(rows.values()), True)]
    # P5 L8 (0.5 at 260 ms) is beaten by cheaper cells; softmax is a reference, never on the frontier
    assert front == ["race P3 L3 b8", "race+softmax@0 P3 L3 b8", "race P4 L4 b8"]
    # lower is better (bits per character): the same cells once the metric's sign is flipped
    bpc = [dict(r, metric=-r["metric"]) for r in rows.values()]
    assert [r["cell"] for r in dm.frontier(bpc, False)] == front


def test_map_script_writes_table_csv_and_plot(tmp_path):
    dm = _load("defaults_map")
    for i, d in enumerate([_doc("race", s, 0.5 + 0.1 * s, 200) for s in range(3)] + [_doc("linear", 0, 0.4, 250)]):
        (tmp_path / f"run{i}.json").write_text(json.dumps(d))
    assert dm.main([str(tmp_path), "--out", str(tmp_path / "map")]) == 0
    md = (tmp_path / "map.md").read_text()
    assert "| race P3 L3 b8 | 3 | 0.600 | 0.500 | 0.700 | 200 | 1.00 |  |" in md
    assert (tmp_path / "map.csv").read_text().count("\n") == 3
    assert (tmp_path / "map.png").stat().st_size > 0


def test_torch_linear_attention_is_the_causal_quadratic_form():
    torch = pytest.importorskip("torch")
    tt = _load("torch_train")
    g = torch.Generator().manual_seed(0)
    for n in (1, 63, 64, 200):  # within a chunk, exactly one, and padded
        q, k, v = (torch.randn(2, 3, n, 5, generator=g, dtype=torch.float64) for _ in range(3))
        fq, fk = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
        a = (fq @ fk.transpose(-1, -2)).tril()
        ref = (a @ v) / a.sum(-1, keepdim=True)
        assert torch.allclose(tt.linear_attention(q, k, v), ref, rtol=1e-12, atol=1e-12)


def test_torch_trainer_runs_every_attention_and_a_hybrid(capsys):
    pytest.importorskip("torch")
    tt = _load("torch_train")
    tiny = ["--task", "mqar", "--tokens", "32", "--num-pairs", "4", "--vocab-size", "16", "--batch-size", "2",
            "--d-model", "16", "--steps", "2", "--eval-every", "2", "--eval-size", "4", "--json", "--quiet"]
    for extra in (["--attention", "softmax"], ["--attention", "linear"], ["--num-planes", "2", "--beta", "2"],
                  ["--beta-per-head", "--fixed-beta"], ["--softmax-layers", "0"],
                  ["--estimator", "bucket_mean"]):
        assert tt.main(tiny + extra) == 0
        res = json.loads(capsys.readouterr().out)
        assert res["steps"] == 2 and 0 <= res["val_accuracy"] <= 1 and np.isfinite(res["val_loss"])
        assert res["trainer"] == "torch" and res["time_per_step_ms"] > 0
    # the last runs: a fixed per-head beta stays at its start; the hybrid's layer 0 has none
    assert tt.main(tiny + ["--beta-per-head", "--fixed-beta", "--beta", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["beta"] == pytest.approx([3.0] * 4)
    assert tt.main(tiny + ["--softmax-layers", "0", "--beta", "5"]) == 0
    assert json.loads(capsys.readouterr().out)["beta"] == pytest.approx([5.0], rel=0.1)


def test_cost_script_reports_every_setting_with_its_state_and_kept_bytes(tmp_path, capsys):
    dc = _load("defaults_cost")
    out = tmp_path / "cost.md"
    assert dc.main(["--tokens", "96", "--heads", "1", "--dims", "8", "--settings", "2x1,3x2", "--rounds", "1",
                    "--out", str(out)]) == 0
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| 8 ")]
    assert [(int(r[1]), int(r[2]), int(r[3])) for r in rows] == [(2, 1, 4), (3, 2, 16)]
    assert float(rows[0][5]) == 1.0 and float(rows[1][7]) == pytest.approx(16 * 9 * 8 / 1024, abs=0.05)  # L 2^P (dv + 1) float64
    assert 0 < float(rows[0][6]) < float(rows[1][6])  # more buckets, more kept per token


def test_every_layer_starts_from_the_layer_defaults_and_the_functions_keep_theirs():
    # One place for the layers' P, L and starting beta (racecpu.hashing); the functions that take planes keep
    # DEFAULT_BETA, and hyperplanes() the paper's P = L = 3 (docs/concepts.md, "Two sets of defaults").
    import inspect

    import racecpu
    from racecpu.apps import train
    from racecpu.autograd import nn
    from racecpu.hashing import LAYER_BETA, LAYER_NUM_PLANES, LAYER_NUM_TABLES

    assert (LAYER_NUM_PLANES, LAYER_NUM_TABLES, LAYER_BETA) == (5, 4, 2.0)
    att = racecpu.RaceAttention(8)
    assert (att.num_planes, att.num_tables, att.beta) == (5, 4, 2.0)
    mha = nn.MultiHeadAttention(8, 2)
    assert mha.planes.shape == (4, 5, 4) and mha.current_beta() == pytest.approx(2.0)
    for cls in (nn.TransformerLM, nn.TransformerClassifier):
        params = inspect.signature(cls).parameters
        assert (params["num_planes"].default, params["num_tables"].default, params["beta"].default) == (5, 4, 2.0)
    import argparse
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    a = p.parse_args([])
    assert (a.num_planes, a.num_tables, a.beta) == (5, 4, 2.0)
    assert racecpu.hyperplanes(8).shape == (3, 3, 8)
    assert inspect.signature(racecpu.race_attention).parameters["beta"].default == racecpu.DEFAULT_BETA == 8.0
    torch = pytest.importorskip("torch")
    import racecpu.torch as rt
    t = rt.RaceAttention(8)
    assert tuple(t.planes.shape) == (4, 5, 8) and t.beta.item() == 2.0 and t.beta.dtype == torch.float32

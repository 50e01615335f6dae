"""racecpu.apps.tasks, racecpu.apps.train and the ``racecpu train`` command (tiny sizes)."""

import json

import numpy as np
import pytest

from racecpu.apps import tasks
from racecpu.apps import train as T
from racecpu.autograd import nn
from racecpu.cli import main


def test_mqar_batch_structure():
    V, n, N = 20, 3, 16
    toks, tgt = tasks.mqar_batch(np.random.default_rng(0), 8, N, V, n)
    assert toks.shape == tgt.shape == (8, N)
    nk = (V - 1) // 2
    for row, trow in zip(toks, tgt):
        keys, vals = row[0:2 * n:2], row[1:2 * n:2]
        assert len(set(keys)) == n and keys.min() >= 1 and keys.max() <= nk
        assert vals.min() > nk and vals.max() < V
        q = np.flatnonzero(trow != tasks.IGNORE)
        assert len(q) == n and (q >= 2 * n).all()
        pairs = dict(zip(keys, vals))
        for p in q:  # the target of a query key is the value paired with it, and follows it
            assert trow[p] == pairs[row[p]] == row[p + 1]
        rest = np.setdiff1d(np.arange(2 * n, N), np.concatenate([q, q + 1]))
        assert (row[rest] == 0).all()
    again, _ = tasks.mqar_batch(np.random.default_rng(0), 8, N, V, n)
    np.testing.assert_array_equal(toks, again)
    with pytest.raises(ValueError, match="num_pairs"):
        tasks.mqar_batch(np.random.default_rng(0), 1, 64, 8, 4)
    with pytest.raises(ValueError, match="seq_len"):
        tasks.mqar_batch(np.random.default_rng(0), 1, 10, 20, 3)


def test_char_corpus_deterministic_split():
    train, val = tasks.char_corpus()
    assert len(train) > 10 * 2 ** 10 and len(val) > 2 ** 10
    assert train.max() < len(tasks.CHARS) and train.min() >= 0
    files = tasks.stdlib_files()
    assert files == sorted(files) and any(f.endswith("os.py") for f in files)
    assert tasks.decode(tasks.encode("Return the\tvalue.\n")) == "Return the\x7fvalue.\n"
    text = tasks.extract_text('"""Module doc."""\n# a comment\ndef f():\n    """Func doc."""\n    x = "not a doc"\n')
    assert "Module doc." in text and "Func doc." in text and "a comment" in text and "not a doc" not in text
    x, y = tasks.char_eval_windows(val, 4, 32)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    x2, _ = tasks.char_eval_windows(val, 4, 32)
    np.testing.assert_array_equal(x, x2)


def test_token_shift_keeps_causality():
    model = nn.TransformerLM(9, 8, 2, 1, attention="race", token_shift=True, max_len=12)
    toks = np.random.default_rng(0).integers(0, 9, (2, 12))
    out = model(toks).data
    toks2 = toks.copy()
    toks2[:, 7] = (toks2[:, 7] + 1) % 9
    out2 = model(toks2).data
    np.testing.assert_allclose(out2[:, :7], out[:, :7], rtol=1e-5, atol=1e-6)
    assert not np.allclose(out2[:, 8], out[:, 8])  # position 8 sees token 7 through the shift


def _args(*extra):
    import argparse
    p = argparse.ArgumentParser()
    T.add_arguments(p)
    return p.parse_args(list(extra))


def test_config_short_conv_and_per_head_beta():
    """chars defaults to a width-4 convolution on q, k, v for every attention; flags override per task."""
    for att in nn.ATTENTIONS:
        cfg = T.config_from_args(_args("--task", "chars"), att)
        assert cfg["conv_size"] == 4 and cfg["conv_act"]
        names = dict(T.build_model(dict(cfg, d_model=8, n_layers=1)).named_parameters())
        assert names["blocks.0.attn.conv_q"].shape == (4, 8)
    assert T.config_from_args(_args("--task", "mqar"))["conv_size"] == 0
    cfg = T.config_from_args(_args("--task", "chars", "--conv-size", "0", "--beta-per-head"))
    model = T.build_model(dict(cfg, d_model=8, n_layers=1))
    assert "blocks.0.attn.conv_q" not in dict(model.named_parameters())
    assert model.blocks[0].attn.log_beta.shape == (cfg["n_heads"],)


@pytest.mark.parametrize("task,attention", [("mqar", "race"), ("chars", "linear")])
def test_training_loss_decreases(task, attention):
    cfg = T.config_from_args(_args("--task", task, "--attention", attention, "--steps", "40", "--batch-size", "8",
                                   "--seq-len", "16", "--d-model", "16", "--n-layers", "1", "--num-pairs", "2",
                                   "--eval-every", "20", "--eval-size", "8", "--lr", "1e-2"))
    res = T.train(cfg, progress=False)
    loss = np.asarray(res["history"]["loss"])
    assert loss[-10:].mean() < 0.8 * loss[:5].mean()
    assert len(res["history"]["eval"]) == 2 and res["time_per_step_ms"] > 0
    metric = "val_accuracy" if task == "mqar" else "val_bpc"
    assert np.isfinite(res[metric])
    if attention == "race":
        assert len(res["beta"]) == 1 and res["beta"][0] > 0


def test_cli_json(capsys):
    rc = main(["train", "--task", "mqar", "--attention", "softmax", "--steps", "3", "--batch-size", "2",
               "--seq-len", "16", "--d-model", "8", "--n-layers", "1", "--num-pairs", "2", "--eval-size", "4",
               "--quiet", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)  # exactly one JSON document on stdout
    assert res["attention"] == "softmax" and res["steps"] == 3 and 0 <= res["val_accuracy"] <= 1


@pytest.mark.parametrize("attention", ["race", "softmax"])
def test_attention_inputs_are_what_each_layer_reads(attention):
    from racecpu.autograd import functional as F
    model = nn.TransformerLM(11, 8, 2, 2, attention=attention, conv_size=2, token_shift=True, seed=3,
                             dtype=np.float64)
    tokens = np.random.default_rng(0).integers(0, 11, (3, 12))
    layers = T.attention_inputs(model, tokens)
    assert "forward" not in vars(model.blocks[0].attn)  # the capture is gone
    assert len(layers) == 2 and all(a.shape == (3, 2, 12, 4) for qkv in layers for a in qkv)
    # layer 0's attention on the captured q, k, v, then its projection, is what the block adds to x
    x = model.tok(tokens) + model.pos(np.arange(12)) + model.prev(
        np.concatenate([np.full((3, 1), 11), tokens[:, :-1]], axis=1))
    blk = model.blocks[0]
    q, k, v = layers[0]
    if attention == "race":
        o = F.race_attention(q, k, v, blk.attn.planes, blk.attn.log_beta.exp(), causal=True)
    else:
        o = F.softmax_attention(q, k, v, causal=True)
    o = blk.attn.proj(o.transpose(0, 2, 1, 3).reshape(3, 12, 8))
    np.testing.assert_allclose(o.data, blk.attn(blk.ln1(x)).data, rtol=1e-12, atol=1e-12)
    scale = 4 ** -0.5 if attention == "race" else 1.0  # RACE's q as its hash sees it
    np.testing.assert_allclose(q, blk.attn.project(blk.ln1(x))[0].data, rtol=1e-12)
    np.testing.assert_allclose(q / scale, blk.attn._conv(blk.attn.q(blk.ln1(x)), blk.attn.conv_q).data
                               .reshape(3, 12, 2, 4).transpose(0, 2, 1, 3), rtol=1e-12)


def test_cli_save_qkv(tmp_path):
    path = tmp_path / "qkv.npz"
    rc = main(["train", "--task", "chars", "--steps", "2", "--batch-size", "2", "--tokens", "16", "--d-model", "8",
               "--layers", "1", "--eval-size", "9", "--quiet", "--out", str(tmp_path), "--save-qkv", str(path)])
    assert rc == 0
    with np.load(path) as f:
        assert {n: f[n].shape for n in f.files} == {n: (1, 8, 2, 16, 4) for n in "qkv"}
    from racecpu.apps.validation import data
    q, k, v = data.npz_dataset(str(path))(16, 0, 0, np.random.default_rng(0))
    assert q.shape == (16, 4) and np.isfinite(q).all()


@pytest.mark.parametrize("flags", [["--steps", "0"], ["--tokens", "-3"], ["--beta", "-1"], ["--num-planes", "40"],
                                   ["--lr", "nan"], ["--tokens", "8", "--num-pairs", "4"]])
def test_cli_bad_flags_are_usage_errors(flags, capsys):
    with pytest.raises(SystemExit) as exc:
        rc = main(["train", *flags])
        raise SystemExit(rc)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_cli_compare_writes_outputs(tmp_path, capsys):
    rc = main(["train", "--compare", "--task", "mqar", "--steps", "2", "--batch-size", "2", "--seq-len", "16",
               "--d-model", "8", "--n-layers", "1", "--num-pairs", "2", "--eval-size", "4", "--quiet",
               "--out", str(tmp_path)])
    assert rc == 0
    for ext in ("csv", "md", "png", "json"):
        assert (tmp_path / f"mqar_compare.{ext}").stat().st_size > 0
    md = (tmp_path / "mqar_compare.md").read_text()
    assert "conv_size=0" in md
    assert all(f"| {a} |" in md for a in nn.ATTENTIONS)


def test_cli_timing_table(tmp_path, capsys):
    rc = main(["train", "--timing", "--timing-lengths", "16,32", "--d-model", "8", "--n-layers", "1",
               "--out", str(tmp_path), "--json"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)["timing"]
    assert [r["seq_len"] for r in rows] == [16, 32]
    assert all(r["race_ms"] > 0 and r["softmax_ms"] > 0 and r["linear_ms"] > 0 for r in rows)
    assert "| 32 |" in (tmp_path / "step_timing.md").read_text()

"""The benchmark suite: its roofline model, its peers' math, and one tiny end-to-end run."""

import csv
import os

import numpy as np
import pytest

import racecpu
from racecpu.apps import bench
from racecpu.cli import main


def test_roofline_counts_by_hand():
    # d = dv = 128, P = L = 3 (F = 24, L*P = 9), float32, per token-head:
    # fwd bytes 4 (256 + 256 + 48 + 18) + 8; flops 4*9*128 + 4*24*128
    assert bench.roofline_counts("fwd", 128, 128, 3, 3) == (2320, 16896)
    # bwd bytes 4 (256 + 384 + 48 + 18) + 8 = 2832; flops 4*9*128 + 8*24*128 = 29184
    assert bench.roofline_counts("fwdbwd", 128, 128, 3, 3) == (2320 + 2832, 16896 + 29184)
    assert bench.roofline_counts("fwd", 64, 32, 2, 1, itemsize=8)[0] == 8 * (128 + 64 + 8 + 4) + 8
    with pytest.raises(ValueError, match="mode"):
        bench.roofline_counts("bwd", 128, 128, 3, 3)


def _case(rng, G=3, n=40, d=8, dv=5):
    q, k = rng.standard_normal((2, G, n, d))
    return q, k, rng.standard_normal((G, n, dv)), rng.standard_normal((G, n, dv)), \
        racecpu.hyperplanes(d, 3, 2, dtype=np.float64)


@pytest.mark.parametrize("causal", [False, True])
def test_numpy_statement_is_race_attention(rng, causal):
    q, k, v, g, W = _case(rng)
    out, res = racecpu.race_attention_fwd(q, k, v, W, 2.0, causal=causal)
    grads = racecpu.race_attention_bwd(res, g)[:3]
    out2, res2 = bench.numpy_race_fwd(q, k, v, W, 2.0, causal)
    np.testing.assert_allclose(out2, out, rtol=1e-10, atol=1e-12)
    for a, b in zip(bench.numpy_race_bwd(res2, g), grads):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_torch_statement_is_race_attention(rng, causal):
    torch = pytest.importorskip("torch")
    q, k, v, g, W = _case(rng)
    out, res = racecpu.race_attention_fwd(q, k, v, W, 2.0, causal=causal)
    grads = racecpu.race_attention_bwd(res, g)[:3]
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    o = bench.torch_race(tq, tk, tv, torch.tensor(W), 2.0, causal)
    o.backward(torch.tensor(g))
    np.testing.assert_allclose(o.detach().numpy(), out, rtol=1e-10, atol=1e-12)
    for t, b in zip((tq, tk, tv), grads):
        np.testing.assert_allclose(t.grad.numpy(), b, rtol=1e-10, atol=1e-12)


def test_predictions_scale_and_skip_the_cumsum_statements():
    shape = (1, 4, 2 ** 16, 128, 128)
    io = bench.io_bytes("fwdbwd", shape, 4)
    assert io == 4 * 2 ** 16 * 8 * 128 * 4
    race = bench.predict_peak("race", "fwdbwd", True, shape, 24, 9, 4)
    cum = bench.predict_peak("numpy-vec", "fwdbwd", True, shape, 24, 9, 4)
    assert io < race < 1.3 * io + 2 ** 30
    assert cum > 8 * 2 ** 30  # (N, F, dv) prefix states: 6 GiB each at this size
    seen = bench._Seen(n=1024, median_s=0.5, peak=3 * 2 ** 20 + 100, base=100)
    t, m = bench._extrapolate(seen, "race", 4096)
    assert t == pytest.approx(2.0) and m == 12 * 2 ** 20 + 100
    assert bench._extrapolate(seen, "sdpa", 4096)[0] == pytest.approx(8.0)  # quadratic


def test_bad_flags_exit_2(capsys):
    assert main(["bench", "--min-log2n", "3", "--out", "/nonexistent"]) == 2
    assert "--min-log2n" in capsys.readouterr().err
    assert main(["bench", "--impls", "race,flash", "--out", "/nonexistent"]) == 2
    assert "choose from" in capsys.readouterr().err
    assert main(["bench", "--sections", "scaling,feature", "--out", "/nonexistent"]) == 2
    assert "features" in capsys.readouterr().err  # the valid names are listed
    assert main(["bench", "--sections", "features", "--features-log2n", "5", "--out", "/nonexistent"]) == 2
    assert "--features-log2n" in capsys.readouterr().err


def test_cuda_unavailable_says_so(capsys, tmp_path):
    if bench._cuda_problem() is None:
        pytest.skip("a GPU is usable here")
    assert main(["bench", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "--device cuda" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_suite_runs_end_to_end(tmp_path, capsys):
    rc = main(["bench", "--min-log2n", "8", "--max-log2n", "8", "--heads", "1", "--dim", "16", "--repeats", "1",
               "--no-torch", "--no-cold", "--out", str(tmp_path), "--tag", "t"])
    assert rc == 0
    with open(tmp_path / "t.csv") as f:
        rows = list(csv.DictReader(f))
    machine = {r["impl"]: float(r["value"]) for r in rows if r["section"] == "machine"}
    for when in ("start", "end"):
        assert machine[f"sgemm@{when}"] > 0.1 and machine[f"copy-1thread@{when}"] > 0.1  # GFLOP/s, GB/s
    scaling = [r for r in rows if r["section"] == "scaling"]
    assert {(r["impl"], r["mode"], r["causal"]) for r in scaling} == {
        (i, m, c) for i in ("race", "race-out", "numpy-vec") for m in ("fwd", "fwdbwd") for c in ("0", "1")}
    for r in scaling:
        assert r["status"] == "ok", r
        assert r["n"] == "256" and int(r["calls"]) == 1
        tpc = float(r["median_s"]) / 256 * 1e9
        assert float(r["ns_per_token_head"]) == pytest.approx(tpc, rel=1e-3)
        assert float(r["ns_per_token_head"]) > float(r["roof_ns"]) * float(r["roof_frac"]) * 0.999
        assert int(r["peak_rss_bytes"]) > int(r["io_bytes"]) > 0
    threads = [r for r in rows if r["section"] == "threads"]
    speedups = {(r["impl"], r["causal"]) for r in threads if r["unit"].startswith("speedup")}
    assert speedups == {(i, c) for i in ("race", "race-out") for c in ("0", "1")}
    # the reference without a head split: as many heads as threads, one per thread
    cores = os.cpu_count() or 1
    ref = [r for r in threads if r["note"] == "one head per thread"]
    assert {(r["causal"], r["heads"], r["threads"], bool(r["value"])) for r in ref} == (
        {(c, str(cores), str(cores), v) for c in ("0", "1") for v in (False, True)} if cores > 1 else set())
    compile_ = {r["impl"]: float(r["value"]) for r in rows if r["section"] == "compile"}
    assert 0 < compile_["warm:import"] <= compile_["warm:first-result"] <= compile_["warm:all-kernels"]
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (tmp_path / "t.txt").read_text()
    out = capsys.readouterr()
    assert "ns/tok-head" in text and text.strip() in out.out
    assert "bench:" not in out.err  # no progress bar: stderr is not a terminal


@pytest.mark.slow
def test_features_section_pairs_each_feature_with_its_baseline(tmp_path, capsys):
    # --sections features alone, at a tiny N: the six (feature, causal) pairs, each with its baseline.
    rc = main(["bench", "--quick", "--sections", "features", "--features-log2n", "9", "--dim", "16",
               "--repeats", "2", "--out", str(tmp_path), "--tag", "f"])
    assert rc == 0
    with open(tmp_path / "f.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["section"] for r in rows} == {"machine", "features"}  # the default sections did not run
    feats = {(r["impl"], r["causal"]): r for r in rows if r["section"] == "features"}
    names = [name for name, *_ in bench.FEATURES]
    assert names == ["gqa", "packed", "dplanes"]
    assert set(feats) == {(i, c) for n in names for i in (n, f"{n}-baseline") for c in ("0", "1")}
    for (impl, causal), r in feats.items():
        assert r["status"] == "ok", r
        assert r["n"] == "512" and int(r["calls"]) == 2
        assert r["mode"] == ("bwd" if impl.startswith("dplanes") else "fwdbwd")
        heads = 32 if impl.startswith("gqa") else 4
        assert r["heads"] == str(heads)
        med = float(r["median_s"])
        assert med > 0 and float(r["min_s"]) > 0
        assert float(r["ns_per_token_head"]) == pytest.approx(med / (heads * 512) * 1e9, rel=1e-3)
    targets = {name: target for name, _, target, _ in bench.FEATURES}
    for name in names:
        for causal in ("0", "1"):
            r, b = feats[(name, causal)], feats[(f"{name}-baseline", causal)]
            ratio = float(r["value"])
            assert np.isfinite(ratio) and ratio > 0
            assert ratio == pytest.approx(float(r["median_s"]) / float(b["median_s"]), rel=1e-3)
            met = ratio <= targets[name]
            assert r["note"].startswith("target met" if met else "target missed")
            assert f"target <= {targets[name]}" in r["unit"]
    text = (tmp_path / "f.txt").read_text()
    assert "features:" in text and "ns/tok-head" in text and "targets met" in text
    assert text.strip() in capsys.readouterr().out


@pytest.mark.slow
def test_train_section_reports_each_shape_and_mode(tmp_path, capsys):
    # --sections train at one small shape (--train-shapes): a per-call cap between RACE's predicted time
    # (its roof, ~0.2 ms; a 1e-4 s cap at 1,024 tokens was too tight when other work shared the machine and
    # its measured bandwidth fell) and SDPA's (its flops at the SGEMM rate, ~7 ms at ~150 GFLOP/s) skips
    # SDPA without starting torch; a machine fast enough to fit SDPA under it measures it instead.
    import json

    rc = main(["bench", "--quick", "--sections", "train", "--train-shapes", "1x1x4096x16", "--repeats", "2",
               "--max-call-seconds", "1e-3", "--out", str(tmp_path), "--tag", "tr", "--json"])
    assert rc == 0
    out = capsys.readouterr().out
    doc = json.loads(out)
    train = doc["train"]
    assert [(t["batch"], t["heads"], t["n"], t["d"], t["mode"], t["causal"]) for t in train] == [
        (1, 1, 4096, 16, m, c) for m, c in bench.CONFIGS]
    torch_here = bench._torch_ok("cpu")
    machine = {r["impl"]: float(r["value"]) for r in doc["rows"] if r["section"] == "machine"}
    bw = max(v for k, v in machine.items() if k.startswith("copy"))  # the best of start and end
    sgemm = max(v for k, v in machine.items() if k.startswith("sgemm"))
    for t in train:
        assert t["race_status"] == "ok" and t["race_ns"] > 0
        b, f = bench.roofline_counts(t["mode"], 16, 16, 3, 3)
        roofs = dict(memory=b / bw, compute=f / sgemm)  # ns: bytes / (GB/s), flops / (GFLOP/s)
        assert t["roof_ns"] == pytest.approx(max(roofs.values()), rel=5e-3)
        assert roofs[t["bound"]] == max(roofs.values())
        assert t["roof_multiple"] == pytest.approx(t["race_ns"] / t["roof_ns"], rel=1e-9)
        if t["sdpa_ns"] is None:
            assert t["sdpa_over_race"] is None
            assert t["sdpa_status"].startswith("skip(time)" if torch_here else "not run")
        else:
            assert t["sdpa_over_race"] == pytest.approx(t["sdpa_ns"] / t["race_ns"], rel=1e-9)
    rows = [r for r in doc["rows"] if r["section"] == "train"]
    race = {(r["mode"], r["causal"]): r for r in rows if r["impl"] == "race"}
    assert len(race) == 4 and all(r["unit"] == "x roof (measured / roof)" for r in race.values())
    for t in train:  # the JSON record is the CSV row's numbers
        r = race[(t["mode"], int(t["causal"]))]
        assert float(r["ns_per_token_head"]) == t["race_ns"]
        assert float(r["roof_ns"]) == pytest.approx(t["roof_ns"], abs=0.01)
    text = (tmp_path / "tr.txt").read_text()
    assert "train shapes" in text and "x roof" in text and "sdpa/race" in text
    assert "train" in (tmp_path / "tr.csv").read_text()
    assert main(["bench", "--sections", "train", "--train-shapes", "1x1x1024", "--out", "/nonexistent"]) == 2
    assert "--train-shapes" in capsys.readouterr().err


@pytest.mark.slow
def test_memory_cap_skips_and_still_reports(tmp_path):
    rc = main(["bench", "--impls", "race", "--min-log2n", "8", "--max-log2n", "9", "--mem-cap-gib", "0.01",
               "--no-cold", "--out", str(tmp_path), "--tag", "s"])
    assert rc == 0
    with open(tmp_path / "s.csv") as f:
        rows = list(csv.DictReader(f))
    scaling = [r for r in rows if r["section"] == "scaling"]
    assert len(scaling) == 8 and all(r["status"] == "skip(mem)" for r in scaling)
    assert not [r for r in rows if r["section"] == "threads"]
    text = (tmp_path / "s.txt").read_text()
    assert "skip(mem): predicted peak" in text and "thread scaling skipped" in text
    assert (tmp_path / "s.png").stat().st_size > 0


@pytest.mark.slow
def test_floor_script_writes_its_table(tmp_path):
    # benchmarks/floor.py (the achievable-floor arithmetic of the speed issue) at a tiny size.
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "floor.py"
    spec = importlib.util.spec_from_file_location("race_floor", path)
    floor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(floor)
    out = tmp_path / "floor.txt"
    assert floor.main(["--log2n", "10", "--heads", "1", "--repeats", "1", "--copy-mib", "16", "--wait", "0",
                       "--out", str(out)]) == 0
    text = out.read_text()
    for row in ("hash projection", "causal update", "soft-hash math, bwd", "fwd+bwd", "keys_bwd",
                "causal_keys_bwd", "public fwd+bwd (no out=)", "public causal fwd+bwd (out= buffers)",
                "no out= / reused floor", "out= buffers / reused floor", "causal fwd+bwd: no out= / reused floor",
                "taken back = pages freed 0 s before"):
        assert row in text
    floors = {}  # mode -> products, hash, memory, 1st touch, floor, taken back, floor, reused floor
    for line in text.splitlines():
        words = line.split()
        if words[:1] in (["fwd"], ["bwd"], ["fwd+bwd"], ["causal"]) and len(words) in (9, 10) \
                and ":" not in line:
            floors[" ".join(words[:-8])] = [float(x) for x in words[-8:]]
    assert sorted(floors) == sorted(c + m for c in ("", "causal ") for m in ("fwd", "bwd", "fwd+bwd"))
    for c in ("", "causal "):
        fwd, bwd, both = (floors[c + m] for m in ("fwd", "bwd", "fwd+bwd"))
        assert all(x > 0 for x in fwd[:2] + bwd[:1])  # products and the hash math cost something
        assert both[0] == pytest.approx(fwd[0] + bwd[0], abs=0.15)  # the products add up
    assert floors["causal fwd+bwd"][0] > floors["fwd+bwd"][0]  # the scans need more products
    with pytest.raises(SystemExit):
        floor.main(["--log2n", "3"])


def test_ab_script_compares_two_checkouts():
    # benchmarks/ab.py against this checkout itself: same code, so the results of the two sides
    # must agree exactly (a side that did not write its buffers would leave np.empty garbage).
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    script = root / "benchmarks" / "ab.py"
    run = subprocess.run([sys.executable, str(script), str(root), "--log2n", "10", "--heads", "1", "--rounds", "1",
                          "--repeats", "1"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    text = run.stdout
    assert text.count("max |B - A| / max |A| over out, dq, dk, dv: 0.00e+00") == 2, text
    rows = [line.split() for line in text.splitlines() if "B/A" in line]
    assert [r[0] for r in rows] == ["fwd", "fwdbwd"] * 2
    for r in rows:
        a, b = float(r[2]), float(r[4])
        assert a > 0 and b > 0 and float(r[6]) == pytest.approx(b / a, abs=2e-3)  # one round: its ratio is B/A
    bad = subprocess.run([sys.executable, str(script), str(root / "tests")], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "not a racecpu checkout" in bad.stderr



@pytest.mark.slow
def test_step_products_ab_compares_two_checkouts():
    # benchmarks/step_products.py --against this checkout itself: the same products in two
    # modules, so every row must say the same bits (a side whose loop did not call its product
    # would leave the output as it was), with both sides' times and their ratio.
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    script = root / "benchmarks" / "step_products.py"
    run = subprocess.run([sys.executable, str(script), "--against", str(root), "--rounds", "2", "--calls", "10"],
                         capture_output=True, text=True, timeout=900, cwd=root)
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith(("combine_rows", "dot_rows", "add_product",
                                                                         "step_scores"))]
    assert len(rows) == 7, run.stdout
    for line in rows:
        m = re.search(r"([0-9.]+) +([0-9.]+)  ([0-9.]+) \(([0-9.]+)\.\.([0-9.]+)\) +(same|DIFFER)$", line)
        assert m and m.group(6) == "same", line
        a, b, median, q1, q3 = (float(m.group(i)) for i in range(1, 6))
        assert a > 0 and b > 0 and q1 <= median <= q3, line

def test_profile_script_names_compiled_functions(tmp_path):
    # benchmarks/perf_profile.py's part that does not need perf: Numba's mangled names shortened,
    # and a perf JIT map with the address of every function compiled for a module's dispatchers.
    import importlib.util
    import types
    from pathlib import Path

    import numba

    path = Path(__file__).parents[1] / "benchmarks" / "perf_profile.py"
    spec = importlib.util.spec_from_file_location("race_profile", path)
    prof = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prof)
    mangled = "_ZN7racecpu8_kernels8dot_rowsB3v55B114c8tJTIeFIjxB2IKSgI4CrvQCk0Z4yRYcWsCAgXrKFt1X1ep5xVXqE5ArrayI"
    assert prof.short_name(mangled) == "racecpu._kernels.dot_rows[v55]"
    assert prof.short_name("_ZN5numba2np6linalg5dot_312_3clocals_3e12_3clambda_3eB3v25B1xE") \
        == "numba.np.linalg.dot_3.<locals>.<lambda>[v25]"
    assert prof.short_name("sgemm_kernel_SKYLAKEX") == "sgemm_kernel_SKYLAKEX"

    @numba.njit  # not cached: its IR lists the functions compiled
    def outer(x):
        return x * 2.0 + 1.0

    assert outer(1.0) == 3.0
    found = prof.compiled_functions([types.SimpleNamespace(outer=outer, other=1)])
    names = [prof.short_name(n) for n in found.values()]
    assert any(n.split("[")[0].endswith("<locals>.outer") for n in names), names
    assert all(isinstance(addr, int) and addr > 0 for addr in found)
    assert prof.compiled_functions([], [outer, 1]) == found  # dispatchers given directly (racecpu's by-address kernels)
    mapfile = tmp_path / "perf.map"
    assert prof.write_perf_map(found, mapfile) == len(found)
    lines = [line.split(" ", 2) for line in mapfile.read_text().splitlines()]
    starts = [int(s, 16) for s, _, _ in lines]
    assert starts == sorted(found) and all(int(size, 16) > 0 for _, size, _ in lines)
    assert {name for _, _, name in lines} == set(found.values())
    with pytest.raises(SystemExit):
        prof.main(["--log2n", "2"])


def test_bad_impls_leave_no_output_folder_behind(tmp_path, monkeypatch, capsys):
    # the default output folder (racecpu-bench-<time> in the current directory) is made only
    # once the arguments are good
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--impls", "foo"]) == 2
    assert "choose from" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_cuda_steps_recommends_only_switches_that_win_in_every_mode():
    """benchmarks/cuda_steps.py's recommendation (what the next GPU lease should switch on): a variant
    counts only where its forward+backward beats the defaults' by 2 % in each mode it was timed in,
    and per switch the best such variant's value."""
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "cuda_steps.py")
    spec = importlib.util.spec_from_file_location("cuda_steps", path)
    steps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(steps)
    rows = [dict(variant="defaults", causal=True, fwdbwd_ms=100.0), dict(variant="defaults", causal=False, fwdbwd_ms=50.0),
            # faster causal, slower non-causal: not recommended
            dict(variant="hash", causal=True, FUSED_HASH=True, fwdbwd_ms=80.0),
            dict(variant="hash", causal=False, FUSED_HASH=True, fwdbwd_ms=51.0),
            dict(variant="c512", causal=True, FUSED_CHUNK=512, fwdbwd_ms=95.0),
            dict(variant="c256", causal=True, FUSED_CHUNK=256, fwdbwd_ms=90.0),
            dict(variant="c128", causal=True, FUSED_CHUNK=128, fwdbwd_ms=99.0),   # within 2 %
            # another N (the short rows): never against the defaults' times
            dict(variant="2^16: fused", causal=True, short=True, FUSED_MIN_TOKENS=0, fwdbwd_ms=5.0),
            dict(variant="2^16: fused", causal=False, short=True, FUSED_MIN_TOKENS=0, fwdbwd_ms=5.0)]
    assert steps.recommend(rows) == {"FUSED_CHUNK": dict(value=256, gain=round(100 / 90, 3), variant="c256")}
    assert steps.recommend(rows[:2]) == {}

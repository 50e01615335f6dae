"""The command line: the demo checks itself; flags, --json, --quiet and exit statuses behave as documented."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from racecpu.cli import main


def _racecpu(*args, timeout=900, env=None):  # a cold kernel cache compiles first: minutes on 2 loaded cores
    """``python -m racecpu ARGS`` in a subprocess against the racecpu the tests import."""
    import racecpu
    e = dict(os.environ, **(env or {}))
    e["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(racecpu.__file__)),
                                       e.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "racecpu", *args], capture_output=True, text=True,
                          timeout=timeout, env=e)


def test_demo_small_runs_and_checks_itself():
    r = _racecpu("demo", "--tokens", "3000", "--heads", "2", "--head-dim", "16", "--samples", "6", "--causal")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ns/th" in r.stdout and "first call" in r.stdout and "steady" in r.stdout
    assert "peak RSS" in r.stdout
    assert "all outputs and gradients finite: True" in r.stdout
    err = float(r.stdout.split("float64): ")[1].split()[0])
    assert err < 1e-4


def test_demo_dask_runs_on_a_local_cluster_and_writes_zarr(tmp_path):
    """``demo --dask``: a LocalCluster of worker processes, results as zarr, the first tokens checked."""
    pytest.importorskip("distributed")
    zarr = pytest.importorskip("zarr")
    r = _racecpu("demo", "--dask", "--tokens", "20000", "--heads", "2", "--head-dim", "16", "--block", "4096",
                 "--dask-dir", str(tmp_path / "st"), "--quiet", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["workers"] >= 1 and doc["heads"] == 2 and doc["blocks"] == 10
    assert doc["check_max_abs_err_out"] < 1e-5 and doc["check_max_abs_err_dq"] < 1e-5
    # racecpu's tasks send each other sketches only: at most 2 states per block in each of the two passes
    # (rows may still move when Dask's work stealing places a task away from its inputs).
    assert doc["bytes_moved_sketches"] / doc["blocks"] <= 2 * 2 * doc["state_bytes"]
    for name in ("out", "dq", "dk", "dv"):
        z = zarr.open_array(str(tmp_path / "st" / name), mode="r")
        assert z.shape == (2, 20000, 16) and np.isfinite(z[...]).all()
    assert np.abs(zarr.open_array(str(tmp_path / "st" / "dk"), mode="r")[...]).max() > 0


def test_demo_json_is_one_document(capsys):
    rc = main(["demo", "--tokens", "512", "--heads", "1", "--head-dim", "8", "--samples", "4", "--repeats", "1",
               "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    doc = json.loads(out.out)  # the whole of stdout
    assert doc["command"] == "demo" and doc["ok"] and doc["tokens"] == 512
    assert doc["steady_state"]["ns_per_token_head"] > 0 and doc["first_call"]["forward_s"] > 0
    assert "RACE attention demo" in out.err  # human text on stderr


def test_demo_refuses_what_does_not_fit(capsys):
    rc = main(["demo", "--tokens", str(2 ** 24), "--max-memory-gib", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "needs about" in err and "--out-of-core" in err


def test_quiet_prints_nothing(capsys):
    assert main(["demo", "--tokens", "256", "--heads", "1", "--head-dim", "8", "--samples", "2", "--repeats", "1",
                 "--quiet"]) == 0
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


@pytest.mark.parametrize("argv", [
    ["demo", "--num-planes", "40"], ["demo", "--planes", "0"], ["demo", "--beta", "-1"], ["demo", "--beta", "inf"],
    ["demo", "--tokens", "0"], ["demo", "--samples", "0"], ["demo", "--heads", "x"], ["demo", "--tokens", "8"],
    ["bench", "--num-tables", "0"], ["bench", "--head-dim", "-2"], ["train", "--steps", "0"],
    ["validate", "--seed", "-1"], ["info", "--bogus"],
])
def test_bad_flags_are_usage_errors(argv, capsys):
    """Exit status 2 and one 'error:' line, never a traceback (demo --tokens 8 < --samples 32)."""
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_old_flag_names_still_work():
    import argparse

    from racecpu.apps import demo
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    a = p.parse_args(["--planes", "4", "--tables", "2", "--dim", "16"])
    assert (a.num_planes, a.num_tables, a.head_dim) == (4, 2, 16)
    assert "--planes" not in p.format_help()  # hidden aliases


def test_info_json(capsys):
    assert main(["info", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    for key in ("racecpu", "versions", "numba_threads", "threading_layer", "kernel_cache_dir", "simd_vector_bytes",
                "cpu_name", "pool"):
        assert key in doc
    assert doc["versions"]["numpy"] and doc["versions"]["numba"] and doc["simd_vector_bytes"] in (16, 32, 64)


def test_warmup_shares_its_steps_between_processes(capsys):
    from racecpu.apps.warmup import warmup
    names = [list(warmup(part=i, parts=3)) for i in range(3)]  # loads what the suite's warm-up compiled
    assert sorted(sum(names, [])) == sorted(warmup(part=0, parts=1))
    assert names[2] == ["float32 non-causal", "float64 soft_buckets, RaceState"]
    for part, parts in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="part"):
            warmup(part=part, parts=parts)
    with pytest.raises(SystemExit) as exc:
        main(["warmup", "--jobs", "0"])
    assert exc.value.code == 2 and "--jobs" in capsys.readouterr().err


def test_python_dash_m_racecpu():
    r = _racecpu("--version", timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("racecpu ")
    r = _racecpu("--help", timeout=120)
    assert r.returncode == 0 and all(c in r.stdout for c in ("demo", "bench", "info", "warmup"))


def test_console_script():
    """The installed ``racecpu`` script (skipped when it is not on PATH, e.g. tests run from a source tree)."""
    exe = shutil.which("racecpu")
    if exe is None:
        pytest.skip("the racecpu console script is not on PATH (pip install the package)")
    r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("racecpu ")
    r = subprocess.run([exe, "info", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["command"] == "info"


def test_plots_leave_pyplot_alone(tmp_path):
    """Library plotting selects no backend and registers no pyplot figure (checked in a clean process)."""
    pytest.importorskip("matplotlib")
    code = ("import matplotlib; matplotlib.rcParams['font.size'] = 13; b = matplotlib.get_backend(); "
            "from racecpu.apps.validation import run_all; "
            f"run_all({str(tmp_path)!r}, quick=True, only=['kernel']); "
            "import matplotlib.pyplot as plt; "
            "assert matplotlib.get_backend() == b, (b, matplotlib.get_backend()); "
            "assert matplotlib.rcParams['font.size'] == 13; assert not plt.get_fignums(); print('ok')")
    import racecpu
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(racecpu.__file__)), MPLBACKEND="")
    env.pop("MPLBACKEND")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
    assert not r.stderr.strip() or "it/s" not in r.stderr  # no progress bars unless asked

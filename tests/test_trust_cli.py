"""Hostile inputs: an ``--out`` that cannot be made, ``NUMBA_DISABLE_JIT=1``, a bad ``seed``.

Each is refused (or works) with a sentence that names what to change, before any work starts.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import racecpu
from racecpu.cli import main


def _no_work(*args, **kwargs):
    raise AssertionError("the subcommand started its work before checking --out")


@pytest.fixture
def no_work(monkeypatch):
    """Make the subcommands' work fail loudly, so that only a check made before it can pass."""
    from racecpu.apps import train
    from racecpu.apps import validation
    monkeypatch.setattr(train, "train", _no_work)
    monkeypatch.setattr(train, "build_model", _no_work)
    monkeypatch.setattr(validation, "run_all", _no_work)


def _bad_outs(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    outs = {"an existing file": str(afile), "under a file": str(afile / "sub")}
    if os.path.isdir("/proc"):
        outs["under /proc"] = "/proc/racecpu-no-such-folder/out"
    if os.geteuid() != 0:  # root writes in read-only folders
        ro = tmp_path / "readonly"
        ro.mkdir()
        ro.chmod(0o555)
        outs["in a read-only folder"] = str(ro / "out")
    return outs


@pytest.mark.parametrize("argv", [["validate", "--quick"], ["bench", "--quick"],
                                  ["train", "--timing", "--timing-lengths", "16"],
                                  ["train", "--compare", "--steps", "1"], ["train", "--steps", "1"]],
                         ids=" ".join)
def test_out_that_cannot_be_made_is_a_usage_error_before_any_work(argv, tmp_path, capsys, no_work):
    for what, out in _bad_outs(tmp_path).items():
        t0 = time.perf_counter()
        rc = main([*argv, "--out", out])
        err = capsys.readouterr().err
        assert rc == 2, what
        assert f"racecpu {argv[0]}: error: --out {out}" in err and "Traceback" not in err, (what, err)
        assert time.perf_counter() - t0 < 10, what
    assert sorted(os.listdir(tmp_path)) == sorted(p for p in ("afile", "readonly") if (tmp_path / p).exists())


def test_out_check_leaves_no_folder_behind(tmp_path, capsys, no_work):
    """A good --out is checked by making it; a run that stops on another usage error leaves nothing there."""
    rc = main(["validate", "--quick", "--datasets", "no-such-data", "--out", str(tmp_path / "a" / "b")])
    assert rc == 2 and "--datasets" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_validation_script_reports_bad_out_as_usage_error(tmp_path, capsys, no_work):
    """``python -m racecpu.apps.validation`` (the validation/ scripts) exits 2 through argparse."""
    from racecpu.apps import validation
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit) as exc:
        validation.main(["--quick", "--out", str(tmp_path / "afile")])
    assert exc.value.code == 2 and "--out" in capsys.readouterr().err


def test_numba_disable_jit_works_or_is_refused_in_words():
    """Numba's debugging switch: racecpu gives the JIT's numbers (slowly), or its import says to unset it."""
    code = ("import json, numpy as np, racecpu\n"
            "rng = np.random.default_rng(0)\n"
            "q, k, v = (rng.standard_normal((5, 4)) for _ in range(3))\n"
            "p = racecpu.hyperplanes(4, 2, 2, seed=0, dtype=np.float64)\n"
            "print(json.dumps(racecpu.race_attention(q, k, v, p, causal=True).tolist()))\n")
    env = dict(os.environ, NUMBA_DISABLE_JIT="1",
               PYTHONPATH=os.path.dirname(os.path.dirname(racecpu.__file__)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    if r.returncode:
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("ImportError: racecpu") and "unset NUMBA_DISABLE_JIT" in last, r.stderr[-3000:]
        return
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((5, 4)) for _ in range(3))
    want = racecpu.race_attention(q, k, v, racecpu.hyperplanes(4, 2, 2, seed=0, dtype=np.float64), causal=True)
    np.testing.assert_allclose(np.array(json.loads(r.stdout)), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed, error", [(-1, ValueError), (1.5, TypeError), ("x", TypeError)])
def test_hyperplanes_bad_seed_error_names_seed(seed, error):
    with pytest.raises(error, match=r"seed must be .*int.*Generator.*got") as exc:
        racecpu.hyperplanes(8, seed=seed)
    assert repr(seed) in str(exc.value)


def test_hyperplanes_accepts_what_default_rng_accepts():
    want = racecpu.hyperplanes(8, seed=3)
    assert np.array_equal(racecpu.hyperplanes(8, seed=np.random.default_rng(3)), want)
    assert np.array_equal(racecpu.hyperplanes(8, seed=np.int64(3)), want)
    assert racecpu.hyperplanes(8, seed=None).shape == (3, 3, 8)

"""The same bits however the kernels were loaded and however many threads run them (issue: trust)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import racecpu
from racecpu import config


_RUN = """
import sys, numpy as np, racecpu

def run(path):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 5000, 32)) for _ in range(3))
    W = racecpu.hyperplanes(32, seed=0, dtype=np.float64)
    out, res = racecpu.race_attention_fwd(q, k, v, W, 8.0, causal=True)
    dq, dk, dv, dbeta = racecpu.race_attention_bwd(res, np.ones_like(out))
    np.savez(path, out=out, dq=dq, dk=dk, dv=dv, dbeta=dbeta)

if __name__ == "__main__":
    run(sys.argv[1])
"""


def _run_in_subprocess(tmp_path, cache, name):
    out = tmp_path / f"{name}.npz"
    # the racecpu this process imported (the installed one, or the source tree), not the cwd's
    path = os.pathsep.join([str(Path(racecpu.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _RUN, str(out)], cwd=tmp_path, capture_output=True, text=True,
                       env=dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=path), timeout=900)
    assert r.returncode == 0, r.stderr
    return np.load(out)


def _assert_same_bits(a, b):
    for name in ("out", "dq", "dk", "dv", "dbeta"):
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_a_task_compiled_beside_cached_callees_gives_the_cached_bits(tmp_path):
    # Numba links each callee into its callers' modules as a weak copy, and the
    # JIT bound every module's calls to the first copy loaded in the process:
    # one task compiled in a process that loaded its callees from the cache
    # ran other copies than a process that loaded everything, and dq differed
    # in the last bits (float64 causal, 5000 tokens).  The kernels now keep
    # their own copies (racecpu._kernels._jit._install_own_copies).
    import shutil

    from racecpu._kernels._jit import cache_dir, cache_tag
    if cache_dir() is None:
        pytest.skip("no kernel cache in this process")
    scope = {"__name__": "run"}
    exec(_RUN, scope)
    scope["run"](tmp_path / "here.npz")  # in this process, whichever way its kernels came
    here = np.load(tmp_path / "here.npz")
    cache = tmp_path / "cache"
    copy = cache / "racecpu" / cache_tag()  # where a process with NUMBA_CACHE_DIR=cache looks
    shutil.copytree(cache_dir(), copy)
    cached = _run_in_subprocess(tmp_path, cache, "cached")  # everything from the cache
    for f in copy.glob("causal._causal_bwd_split_task-*"):
        f.unlink()
    recompiled = _run_in_subprocess(tmp_path, cache, "recompiled")  # one task compiled beside cached callees
    _assert_same_bits(cached, recompiled)
    _assert_same_bits(here, cached)


@pytest.mark.slow  # compiles every kernel in a fresh cache, three processes
def test_a_compiling_process_and_a_cached_one_give_the_same_bits(tmp_path):
    # The first process compiles every kernel into an empty cache, the next
    # ones load them; before the kernels kept their own copies of their
    # callees (see above) the backward's bits differed (dbeta
    # 0.5929382497939775 vs ...772, and dq).
    runs = [_run_in_subprocess(tmp_path, tmp_path / "cache", f"run{i}") for i in range(3)]
    for other in runs[1:]:
        _assert_same_bits(runs[0], other)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_results_do_not_depend_on_the_thread_count(rng, monkeypatch, causal, dtype):
    # The non-causal forward's task length used to follow the thread count,
    # and with it the order of its float64 sums: 2 vs 1 threads differed in
    # most of out (one head, 32,768 tokens, float64).  Also as if on 16 cores.
    import numba
    monkeypatch.setattr(config, "SERIAL_TOKENS", 512)
    q, k, v = (rng.standard_normal((1, 32768, 16)).astype(dtype) for _ in range(3))
    W = racecpu.hyperplanes(16, seed=1, dtype=dtype)
    g = rng.standard_normal((1, 32768, 16)).astype(dtype)
    runs = []
    for threads in range(1, numba.config.NUMBA_NUM_THREADS + 1):
        with racecpu.threads(threads):
            out, res = racecpu.race_attention_fwd(q, k, v, W, 4.0, causal=causal)
            runs.append((out, *racecpu.race_attention_bwd(res, g)))
    real = numba.get_num_threads
    monkeypatch.setattr(numba, "get_num_threads", lambda: 16)  # how a 16-core machine sizes its work
    out, res = racecpu.race_attention_fwd(q, k, v, W, 4.0, causal=causal)
    monkeypatch.setattr(numba, "get_num_threads", real)
    runs.append((out, *racecpu.race_attention_bwd(res, g)))
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            np.testing.assert_array_equal(a, b)

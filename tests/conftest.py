import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# Numba compiles on first use: no per-example deadline; few examples keep the suite fast.
settings.register_profile("racecpu", deadline=None, max_examples=15, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "racecpu"))


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


@pytest.fixture(autouse=True)
def _parallel_kernels(monkeypatch):
    # Calls below SERIAL_TOKENS tokens run on one thread (no wake-up of the
    # workers); the tests' inputs are all that small.  Keep them on the parallel
    # path they were written for; test_small_calls_run_on_one_thread checks the
    # serial path against it.
    from racecpu import config
    monkeypatch.setattr(config, "SERIAL_TOKENS", 0)


@pytest.fixture(autouse=True)
def _pool_every_result(monkeypatch):
    # racecpu reuses the memory of results of 1 MiB or more once they are
    # dropped; the tests' arrays are all smaller.  Pool every one of them, so
    # that the whole suite runs on reused blocks and would see one handed out
    # while an array still views it.
    from racecpu._memory import POOL
    monkeypatch.setattr(POOL, "MIN_BYTES", 0)


def pytest_configure(config):
    # With xdist, every worker would compile the same kernel signatures on first use, each
    # paying the whole compile time.  The controller has them compiled once, its share of
    # them by each of as many processes as there are workers, into the kernel cache the
    # workers then load from (racecpu warmup --jobs).  RACECPU_TEST_PREWARM=0 turns it off.
    workers = getattr(config.option, "numprocesses", None)
    if hasattr(config, "workerinput") or not isinstance(workers, int) or workers < 2:
        return
    if os.environ.get("RACECPU_TEST_PREWARM", "1") == "0":
        return
    import subprocess
    import sys
    import time

    import racecpu
    from racecpu._kernels._jit import shared_cache_dir
    if shared_cache_dir() is None:
        return
    t0 = time.perf_counter()
    here = os.path.dirname(os.path.dirname(os.path.abspath(racecpu.__file__)))  # this racecpu, not a copy in cwd
    r = subprocess.run([sys.executable, "-m", "racecpu", "warmup", "--jobs", str(workers), "--quiet"],
                       capture_output=True, text=True, cwd=here)
    config._racecpu_prewarm = (r.returncode, time.perf_counter() - t0, r.stderr[-2000:])


def pytest_collection_modifyitems(config, items):
    # `pytest -q` leaves out the tests marked slow (15 s or more each: ~6 min of the whole) so
    # that the everyday suite stays within 10 minutes on 2 cores; `pytest -q -m slow` runs them
    # (CI runs both).  A -m or -k expression, a test named by its id (path::name) or
    # RACECPU_TEST_GPU=1 (the GPU runs, where the slow CUDA tests are the point) keeps them:
    # whoever picks tests by name means those tests.
    if config.option.markexpr or config.option.keyword \
            or os.environ.get("RACECPU_TEST_GPU") == "1" \
            or any("::" in str(a) for a in config.args):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


def pytest_report_header(config):
    import racecpu
    lines = [f"racecpu {racecpu.__version__} imported from {os.path.dirname(racecpu.__file__)}"]
    if hasattr(config, "_racecpu_prewarm"):
        rc, seconds, err = config._racecpu_prewarm
        lines.append(f"kernels compiled or loaded by {config.option.numprocesses} warm-up processes in {seconds:.0f} s"
                     + ("" if rc == 0 else f" (failed, exit status {rc}: the workers compile what they need)\n{err}"))
    return lines

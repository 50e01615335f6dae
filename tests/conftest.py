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


def pytest_report_header(config):
    import racecpu
    return f"racecpu {racecpu.__version__} imported from {os.path.dirname(racecpu.__file__)}"

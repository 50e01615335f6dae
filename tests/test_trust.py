"""Trust (issue 40): aliasing of every input, damaged or hostile state files,
atomic saves, the pool's environment and memory limits, and fork safety."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import racecpu

ROOT = Path(__file__).resolve().parents[1]


def _planes_buffer(d, dtype=np.float64):
    """Hyperplanes (3, 3, d) that are a view at the start of a bigger buffer."""
    W = racecpu.hyperplanes(d, 3, 3, seed=0, dtype=dtype)
    buf = np.zeros(W.size + 64, dtype)
    planes = buf[:W.size].reshape(W.shape)
    planes[...] = W
    return buf, planes


@pytest.mark.parametrize("fn", ["race_attention", "race_attention_fwd"])
def test_out_overlapping_planes_is_rejected(rng, fn):
    d, dv, n = 6, 5, 9
    buf, planes = _planes_buffer(d)
    q, k, v = rng.standard_normal((n, d)), rng.standard_normal((n, d)), rng.standard_normal((n, dv))
    before = planes.copy()
    out = buf[:n * dv].reshape(n, dv)
    with pytest.raises(ValueError, match="out must not share memory with planes"):
        getattr(racecpu, fn)(q, k, v, planes, 4.0, out=out)
    np.testing.assert_array_equal(planes, before)


@pytest.mark.parametrize("which", [0, 1, 2])
def test_backward_out_overlapping_planes_is_rejected(rng, which):
    d, dv, n = 6, 5, 9
    buf, planes = _planes_buffer(d)
    q, k, v = rng.standard_normal((n, d)), rng.standard_normal((n, d)), rng.standard_normal((n, dv))
    before = planes.copy()
    y, res = racecpu.race_attention_fwd(q, k, v, planes, 4.0, causal=True)
    outs = [np.empty((n, d)), np.empty((n, d)), np.empty((n, dv))]
    outs[which] = buf[:outs[which].size].reshape(outs[which].shape)
    name = ("dq", "dk", "dv")[which]
    with pytest.raises(ValueError, match=f"out {name} must not share memory with planes"):
        racecpu.race_attention_bwd(res, np.ones_like(y), out=tuple(outs))
    np.testing.assert_array_equal(planes, before)


# ---------------------------------------------------------------------------
# RaceState files: atomic saves, hostile and damaged files
# ---------------------------------------------------------------------------

def _state(count=3, lead=(2,), d=4, dv=3, dtype=np.float64, seed=0):
    from racecpu.streaming import RaceState
    rng = np.random.default_rng(seed)
    W = racecpu.hyperplanes(d, 3, 3, seed=0, dtype=dtype)
    st = RaceState(W, 8.0, batch_shape=lead, dv=dv, dtype=dtype)
    if count:
        st.extend(*(rng.standard_normal(lead + (count, n)) for n in (d, d, dv)))
    return st


def test_save_is_atomic_across_threads(tmp_path):
    import threading
    import time

    from racecpu.streaming import RaceState
    states = {n: _state(n, seed=n) for n in (3, 5)}
    path = tmp_path / "s.npz"
    states[3].save(path)
    errors, loads = [], [0]
    stop = time.monotonic() + 1.0

    def saver(st):
        try:
            while time.monotonic() < stop:
                st.save(path)
        except Exception as exc:  # noqa: BLE001 (collected, asserted below)
            errors.append(exc)

    def loader():
        try:
            while time.monotonic() < stop:
                got = RaceState.load(path)
                want = states[got.count]
                np.testing.assert_array_equal(got.A, want.A)
                np.testing.assert_array_equal(got.B, want.B)
                loads[0] += 1
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=saver, args=(st,)) for st in states.values()]
    threads.append(threading.Thread(target=loader))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [], errors[:3]
    assert loads[0] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.npz"]  # no temporary left behind


def _assert_same_state(a, b):
    assert (a.count, a.beta, a.dtype, a.batch_shape) == (b.count, b.beta, b.dtype, b.batch_shape)
    np.testing.assert_array_equal(a.planes, b.planes)
    np.testing.assert_array_equal(a.A, b.A)
    np.testing.assert_array_equal(a.B, b.B)


def test_single_byte_flips_load_equal_or_raise_value_error(tmp_path):
    from racecpu.streaming import RaceState
    st = _state(4)
    good = tmp_path / "good.npz"
    st.save(good)
    raw = good.read_bytes()
    path = tmp_path / "bad.npz"
    equal = errors = 0
    for pos in range(0, len(raw), 7):
        for flip in (0x01, 0xFF):
            bad = bytearray(raw)
            bad[pos] ^= flip
            path.write_bytes(bytes(bad))
            try:
                got = RaceState.load(path)
            except ValueError:
                errors += 1
                continue
            _assert_same_state(got, st)
            equal += 1
    assert errors > 0 and equal + errors == 2 * len(range(0, len(raw), 7))


def _fields(st):
    return dict(format=np.array("racecpu.RaceState"), version=np.array(1), planes=st.planes,
                beta=np.array(st.beta), dtype=np.array(st.dtype.name),
                batch_shape=np.array(st.batch_shape, dtype=np.int64), count=np.array(st.count),
                A=st._A, B=st._B)


@pytest.mark.parametrize("change, match", [
    (dict(count=np.array(3.7)), "count"),
    (dict(batch_shape=np.array([2 ** 32, 2 ** 32], dtype=np.int64)), "batch_shape"),
    (dict(A=None), "missing"),
    (dict(beta=np.array("x")), "beta"),
])
def test_bad_entries_raise_value_error(tmp_path, change, match):
    from racecpu.streaming import RaceState
    d = _fields(_state(2))
    d.update(change)
    d = {key: val for key, val in d.items() if val is not None}
    path = tmp_path / "s.npz"
    np.savez(path, **d)
    with pytest.raises(ValueError, match=match):
        RaceState.load(path)


def _npy_header(shape, descr="<f8"):
    """The bytes of a .npy file's magic and header declaring ``shape`` (no data)."""
    import io
    from numpy.lib import format as npformat
    buf = io.BytesIO()
    npformat.write_array_header_1_0(buf, dict(descr=descr, fortran_order=False, shape=shape))
    return buf.getvalue()


def test_huge_declared_shape_raises_value_error(tmp_path):
    import zipfile

    from racecpu.streaming import RaceState
    d = _fields(_state(2))
    path = tmp_path / "s.npz"
    np.savez(path, **{key: val for key, val in d.items() if key != "B"})
    with zipfile.ZipFile(path, "a") as zf:  # a B that declares 2**70 bytes and holds none
        zf.writestr("B.npy", _npy_header((2 ** 40, 24, 2 ** 27)))
    with pytest.raises(ValueError, match="more than"):
        RaceState.load(path)
    # A whose header says (2**33, 2**31) float64: its int64 byte count wraps to 0
    np.savez(path, **{key: val for key, val in d.items() if key != "A"})
    with zipfile.ZipFile(path, "a") as zf:
        zf.writestr("A.npy", _npy_header((2 ** 33, 2 ** 31)))
    with pytest.raises(ValueError):
        RaceState.load(path)


def test_zip_bomb_entry_raises_value_error(tmp_path):
    import zipfile

    from racecpu.streaming import RaceState
    d = _fields(_state(2))
    path = tmp_path / "s.npz"
    np.savez(path, **{key: val for key, val in d.items() if key != "B"})
    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_DEFLATED) as zf:
        with zf.open("B.npy", "w", force_zip64=True) as f:  # 256 MiB of zeros, ~256 KiB compressed
            f.write(_npy_header((2, 24, 2 ** 21 // 3)))
            block = bytes(1 << 20)
            for _ in range(256):
                f.write(block)
    assert path.stat().st_size < 1 << 20
    with pytest.raises(ValueError, match="compressed entry B"):
        RaceState.load(path)


def test_load_refuses_fifos_and_devices(tmp_path):
    import os
    import subprocess
    import sys
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    fifo = tmp_path / "fifo.npz"
    os.mkfifo(fifo)
    code = ("import sys; from racecpu.streaming import RaceState\n"
            "for p in sys.argv[1:]:\n"
            "    try:\n        RaceState.load(p)\n    except ValueError as e:\n        print('ValueError', e)\n")
    targets = [str(fifo), str(tmp_path)] + (["/dev/zero"] if os.path.exists("/dev/zero") else [])
    r = subprocess.run([sys.executable, "-c", code, *targets], capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(racecpu.__file__)))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("ValueError") == len(targets), r.stdout
    assert "not a regular file" in r.stdout


def test_constructor_rejects_impossible_shapes():
    from racecpu.streaming import RaceState
    W = racecpu.hyperplanes(4, 3, 3)
    with pytest.raises(ValueError, match="bytes"):
        RaceState(W, 8.0, batch_shape=(2 ** 32, 2 ** 32), dv=3)
    with pytest.raises(ValueError, match="bytes"):
        RaceState(W, 8.0, batch_shape=(2 ** 40,), dv=3)


def test_loaded_state_steps_in_place(tmp_path):
    from racecpu.streaming import RaceState
    st = _state(3)
    st.save(tmp_path / "s.npz")
    got = RaceState.load(tmp_path / "s.npz")
    x = np.ones((2, 4))
    np.testing.assert_array_equal(got.step(x, x, x[:, :3]), st.step(x, x, x[:, :3]))
    _assert_same_state(got, st)


# ---------------------------------------------------------------------------
# the pool's environment and memory limits; planes that overflow
# ---------------------------------------------------------------------------

def _run_python(code, env=None, timeout=120):
    import os
    import subprocess
    import sys
    full = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          cwd=os.path.dirname(os.path.dirname(racecpu.__file__)), env=full)


@pytest.mark.parametrize("value", ["inf", "-5", "nan", "lots"])
def test_bad_pool_bytes_warn_and_use_the_default(monkeypatch, value):
    from racecpu import _memory
    monkeypatch.setenv("RACECPU_POOL_BYTES", value)
    with pytest.warns(RuntimeWarning, match="RACECPU_POOL_BYTES"):
        assert _memory._default_limit() == _memory.physical_memory() // 2


def test_pool_bytes_is_read_at_first_use_not_at_import():
    code = ("import os, warnings, racecpu\n"
            "os.environ['RACECPU_POOL_BYTES'] = '12345'\n"
            "print(racecpu.pool_stats()['limit'])\n")
    r = _run_python(code, env={"RACECPU_POOL_BYTES": "inf"})  # inf at import: neither read nor fatal
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["12345"]


def test_pool_raises_memory_error_under_an_address_space_limit():
    import sys
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc and sets RLIMIT_AS")
    code = ("import resource, numpy as np\n"
            "from racecpu._memory import POOL, proc_status\n"
            "POOL.limit = 8 << 30\n"
            "resource.setrlimit(resource.RLIMIT_AS, (proc_status('VmSize') + (256 << 20),) * 2)\n"
            "try:\n"
            "    POOL.empty((1 << 30,), np.float32)\n"
            "except MemoryError as e:\n"
            "    print('MemoryError', e)\n")
    r = _run_python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("MemoryError"), r.stdout


def test_planes_that_overflow_float32_are_blamed(rng):
    q = rng.standard_normal((9, 6)).astype(np.float32)
    W = racecpu.hyperplanes(6, 3, 3, dtype=np.float64) * 1e39
    with pytest.raises(ValueError, match="planes are too large for the compute dtype float32"):
        racecpu.race_attention(q, q, q, W, 4.0)


# ---------------------------------------------------------------------------
# fork
# ---------------------------------------------------------------------------

_FORK_SCRIPT = """
import multiprocessing, os, sys
import numpy as np
import racecpu
q = np.random.default_rng(0).standard_normal((2, 64, 8))
W = racecpu.hyperplanes(8)
def attend(_):
    return racecpu.race_attention(q, q, q, W, causal=True)
want = racecpu.race_attention(q, q, q, W, causal=True) if sys.argv[1] == "after" else None
pid = os.fork()
if pid == 0:
    try:
        got = attend(0)
        print("child ok", want is None or np.array_equal(got, want), flush=True)
    except RuntimeError as e:
        print("child RuntimeError", "spawn" in str(e), flush=True)
    os._exit(0)
print("child exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
if want is not None:
    import numba
    from numba.np.ufunc import omppool
    layer = numba.threading_layer()
    print("layer", layer, layer == "omp" and omppool.openmp_vendor == "GNU", flush=True)
if sys.argv[1] == "after":
    with multiprocessing.get_context("fork").Pool(1) as pool:
        try:
            pool.map(attend, [0])
            print("pool ok", flush=True)
        except RuntimeError as e:
            print("pool RuntimeError", "spawn" in str(e), flush=True)
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork here")
def test_a_child_forked_after_a_call_gets_an_error_not_a_crash_or_hang():
    import os
    import subprocess
    import sys
    try:
        r = subprocess.run([sys.executable, "-c", _FORK_SCRIPT, "after"], capture_output=True, text=True,
                           timeout=120, cwd=os.path.dirname(os.path.dirname(racecpu.__file__)))
    except subprocess.TimeoutExpired:
        pytest.fail("a forked child or fork pool hung")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "child exit 0" in lines, (lines, r.stderr)
    # where the layer survives fork (TBB, workqueue) the child computes; under GNU OpenMP it is refused
    refused = lines[2].endswith("True")  # "layer omp True" where Numba runs on GNU OpenMP
    assert lines[0] == ("child RuntimeError True" if refused else "child ok True"), lines
    assert lines[-1] == ("pool RuntimeError True" if refused else "pool ok"), lines


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork here")
def test_a_child_forked_before_any_call_computes():
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _FORK_SCRIPT, "before"], capture_output=True, text=True,
                       timeout=120, cwd=os.path.dirname(os.path.dirname(racecpu.__file__)))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["child ok True", "child exit 0"], (r.stdout, r.stderr)


# ---------------------------------------------------------------------------
# item 8: threads of the caller, the workqueue layer and BLAS's limit
# ---------------------------------------------------------------------------

_CONCURRENT = """
import threading, numpy as np, racecpu
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((2, 3000, 16)).astype(np.float32) for _ in range(3))
W = racecpu.hyperplanes(16)
want = racecpu.race_attention(q, k, v, W, causal=True)
errors = []
def work():
    try:
        for _ in range(4):
            out, res = racecpu.race_attention_fwd(q, k, v, W, causal=True)
            racecpu.race_attention_bwd(res, out)
            assert np.array_equal(out, want)
    except BaseException as exc:
        errors.append(repr(exc))
ts = [threading.Thread(target=work) for _ in range(2)]
[t.start() for t in ts]; [t.join() for t in ts]
import numba
print(numba.threading_layer(), "errors", errors)
"""


def test_two_threads_under_the_workqueue_layer_take_turns_instead_of_aborting():
    env = dict(os.environ, NUMBA_THREADING_LAYER="workqueue")
    r = subprocess.run([sys.executable, "-c", _CONCURRENT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.split()[:3] == ["workqueue", "errors", "[]"], r.stdout


def test_blas_limit_is_restored_after_concurrent_calls(rng):
    import threading
    from threadpoolctl import threadpool_info, threadpool_limits
    blas = [i for i in threadpool_info() if i["user_api"] == "blas"]
    if not blas:
        pytest.skip("no BLAS seen by threadpoolctl")
    q, k, v = (rng.standard_normal((2, 3000, 16)).astype(np.float32) for _ in range(3))
    W = racecpu.hyperplanes(16)
    with threadpool_limits(limits=2, user_api="blas"):
        before = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
        barrier = threading.Barrier(2)

        def work():
            barrier.wait()
            for _ in range(3):
                out, res = racecpu.race_attention_fwd(q, k, v, W, causal=True)
                racecpu.race_attention_bwd(res, out)
        ts = [threading.Thread(target=work) for _ in range(2)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        after = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
    assert after == before


def test_tokens_and_heads_swapped_is_warned_of_where_the_shape_makes_it_likely():
    # (B, N, H, d) passed for (B, H, N, d): 1,024 "heads" of 4 "tokens".  The warning points
    # at the caller's line; the transposed array, a 3-dim one and an ordinary shape pass silently.
    import warnings

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 1024, 4, 8)).astype(np.float32)
    W = racecpu.hyperplanes(8, seed=0)
    with pytest.warns(UserWarning, match=r"transpose\(0, 2, 1, 3\)") as rec:
        racecpu.race_attention(x, x, x, W)
    assert [w.filename for w in rec] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
        racecpu.race_attention(y, y, y, W)
        racecpu.race_attention(x[0], x[0], x[0], W)
        z = rng.standard_normal((2, 16, 256, 8)).astype(np.float32)
        racecpu.race_attention(z, z, z, W)

"""Trust (issue 40): aliasing of every input, damaged or hostile state files,
atomic saves, the pool's environment and memory limits, and fork safety."""

import numpy as np
import pytest

import racecpu


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

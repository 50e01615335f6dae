"""The out-of-core demo (racecpu.apps.ooc_demo): seeded inputs, resumes, self-check."""

import numpy as np
import pytest

import racecpu
from racecpu.apps.ooc_demo import SeededArray, demo


def test_seeded_array_is_slice_independent():
    a = SeededArray((2, 3, 1000, 4), seed=7, tile=128)
    full = np.asarray(a)
    assert full.shape == (2, 3, 1000, 4) and full.dtype == np.float32
    np.testing.assert_array_equal(a.rows(4, 100, 517), full[1, 1, 100:517])
    np.testing.assert_array_equal(np.concatenate([a.rows(0, 0, 129), a.rows(0, 129, 1000)]), full[0, 0])
    assert abs(float(full.std()) - 1.0) < 0.05
    assert not np.array_equal(np.asarray(SeededArray((1, 50, 4), seed=8)), np.asarray(SeededArray((1, 50, 4), seed=9)))
    # into a given array (the Dask demo's block), a view with strides of its own included
    into = np.full((2, 417, 4), np.nan, np.float32)
    assert np.shares_memory(a.rows(4, 100, 517, out=into[1]), into)  # returned: out itself
    np.testing.assert_array_equal(into[1], full[1, 1, 100:517])
    assert np.isnan(into[0]).all()  # nothing written outside out
    with pytest.raises(ValueError, match="shape"):
        a.rows(4, 100, 517, out=np.empty((416, 4), np.float32))


@pytest.mark.parametrize("causal", [True, False])
def test_demo_small_resumes_and_checks(tmp_path, causal):
    kw = dict(tokens=2100, heads=2, dim=8, directory=tmp_path / "demo", causal=causal, block=512,
              progress=False, disk_margin=0)
    m = demo(**kw)
    assert m["blocks_computed"] == m["blocks_total"] and m["check_max_abs_err"] < 1e-5
    assert m["peak_rss_bytes"] > 0 and m["disk_bytes"] >= m["output_bytes"]
    # the results equal the in-memory API on the same (seeded) inputs
    q, k, v, g = (np.asarray(SeededArray((2, 2100, 8), seed=i)) for i in range(4))
    W = racecpu.hyperplanes(8, 3, 3, seed=0)
    out, res = racecpu.race_attention_fwd(q, k, v, W, causal=causal)
    grads = racecpu.race_attention_bwd(res, g)
    for name, want in zip(("out", "dq", "dk", "dv"), (out,) + grads[:3]):
        got = np.load(tmp_path / "demo" / f"{name}.npy")
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max(), err_msg=name)
    assert m["dbeta"] == pytest.approx(grads[3], rel=1e-5)
    again = demo(**kw)  # complete: nothing recomputed, same answer
    assert again["blocks_computed"] == 0 and again["dbeta"] == m["dbeta"]
    # other arguments in the same directory: clean restart
    other = demo(**dict(kw, tokens=1000))
    assert other["blocks_computed"] == other["blocks_total"]
    assert np.load(tmp_path / "demo" / "out.npy").shape == (2, 1000, 8)
    with pytest.raises(RuntimeError, match="not enough disk"):
        demo(**dict(kw, tokens=3000, disk_margin=2 ** 60))

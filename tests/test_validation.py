"""racecpu.apps.validation: the quick run's fitted slopes and trends, and its building blocks.

The quick run (module fixture, ~20 s) must reproduce the two laws the paper's
Theorem 1 is about: the L^-1/2 variance rate and a bias that falls with beta
(kernel level: like 1/beta, within the paper's bound).  The building blocks are
checked against independent computations: the exact expected kernel against
symmetry identities, the SimHash limit and Monte Carlo with racecpu.soft_buckets;
the dense angular kernel against racecpu.reference.angular_attention.
"""

import os

import numpy as np
import pytest

import racecpu
from racecpu.apps.validation import data, run_all, stats, theory
from racecpu.reference import angular_attention


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("validation")
    results = run_all(str(out), quick=True, show_progress=False)
    return out, {r.name: r for r in results}


# ---------------------------------------------------------------------------
# the quick run
# ---------------------------------------------------------------------------

def test_quick_run_writes_report_csvs_and_plots(quick):
    out, res = quick
    files = set(os.listdir(out))
    assert "REPORT.md" in files
    for r in res.values():
        assert set(r.tables) <= files and set(r.figures) <= files
        assert r.claims
    report = (out / "REPORT.md").read_text()
    for r in res.values():
        for c in r.claims:
            assert c.key in report
    assert sum(f.endswith(".png") for f in files) >= 4
    assert all(os.path.getsize(out / f) < 400_000 for f in files if f.endswith(".png"))


def test_quick_l_slope_is_minus_one_half(quick):
    _, res = quick
    fits = res["theorem"].values["fits"]
    for causal in (False, True):
        f = fits["L", ("clustered", causal)]
        assert -0.62 < f.slope < -0.40, f
        assert f.lo <= f.slope <= f.hi and f.hi - f.lo < 0.1


def test_quick_kernel_bias_falls_like_one_over_beta_within_bound(quick):
    _, res = quick
    summary = res["kernel"].values["summary"]
    for P in (1, 3):
        s = sorted((x for x in summary if x["P"] == P), key=lambda x: x["beta"])
        exact = [x["max_abs_bias_exact"] for x in s]
        mc = [x["max_abs_bias_mc"] for x in s]
        assert np.all(np.diff(exact) < 0) and np.all(np.diff(mc) < 0)      # bias -> 0 as beta grows
        assert all(x["max_abs_bias_exact"] <= x["bound"] for x in s)        # the paper's bound
        assert all(x["max_z_mean"] < 5 and x["max_z_bias"] < 5 for x in s)  # MC agrees with quadrature
        f = res["kernel"].values["bias_fit"][P]
        assert -1.1 < f.slope < -0.9, f
    vf = res["kernel"].values["var_fit"]
    assert -1.1 < vf.slope < -0.9


def test_quick_output_bias_term_falls_with_beta(quick):
    _, res = quick
    rows = res["theorem"].tables["theorem_beta.csv"]
    for causal in (False, True):
        b = [r["bias_term"] for r in rows if r["causal"] == causal]
        assert len(b) >= 5 and np.all(np.diff(b) < 0)
    f = res["theorem"].values["fits"]["beta", ("clustered", False, 3)]
    assert f.slope < -1.5


def test_cli_validate_with_npz_hook(tmp_path):
    from racecpu.cli import main
    rng = np.random.default_rng(0)
    path = tmp_path / "qkv.npz"
    np.savez(path, q=rng.standard_normal((2, 300, 8)), k=rng.standard_normal((2, 300, 8)),
             v=rng.standard_normal((2, 300, 4)))
    out = tmp_path / "out"
    rc = main(["validate", "--quick", "--only", "assumptions", "softmax", "estimators", "--datasets", "isotropic",
               "--qkv", str(path), "--out", str(out), "--no-progress"])
    assert rc == 0
    report = (out / "REPORT-softmax-assumptions-estimators.md").read_text()
    assert "npz:qkv" in report
    assert "| E8 | npz:qkv (a trained model's q, k, v" in report  # both estimators on the file's q, k (d = 8)
    rows = (out / "estimators.csv").read_text().splitlines()
    assert any(r.startswith("npz:qkv,raw,3,") for r in rows)
    rows = (out / "assumptions.csv").read_text().splitlines()
    assert any(r.startswith("npz:qkv,256,") for r in rows) and not any(",512," in r for r in rows)
    assert main(["validate", "--quick", "--qkv", str(tmp_path / "missing.npz"), "--out", str(out)]) == 2


# ---------------------------------------------------------------------------
# building blocks
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("beta", [0.5, 3.0, 40.0, 500.0])
def test_plane_collision_identities(beta):
    theta, f = theory.plane_collision(beta)
    # independent projections at theta = pi/2: 2 E[a] E[a] = 1/2 exactly, for every beta
    assert abs(np.interp(np.pi / 2, theta, f) - 0.5) < 1e-9
    # symmetry theta -> pi - theta: f(pi - theta) = 1 - f(theta)
    assert np.allclose(f + f[::-1], 1.0, atol=1e-9)
    # the soft collision is no larger than the hard one near theta = 0 and decreasing in theta
    assert np.all(np.diff(f) <= 1e-12)


def test_expected_kernel_limits():
    theta = np.linspace(0, np.pi, 41)
    for beta in (64.0, 1024.0):
        for P in (1, 3):
            e = theory.expected_kernel(theta, beta, P)
            assert np.max(np.abs(e - (1 - theta / np.pi) ** P)) <= P / (np.sqrt(2 * np.pi) * beta) * 1.05
            # leading term at theta = 0: 1 - P / (sqrt(2 pi) beta)
            assert abs((1 - e[0]) * beta / P - 1 / np.sqrt(2 * np.pi)) < 0.02


def test_expected_kernel_matches_soft_buckets_monte_carlo():
    d, P, T, beta = 5, 2, 40000, 2.5
    theta = np.array([0.0, 0.7, 2.0, np.pi])
    q = np.zeros((1, d))
    q[0, 0] = 1
    k = np.zeros((theta.size, d))
    k[:, 0], k[:, 1] = np.cos(theta), np.sin(theta)
    planes = racecpu.hyperplanes(d, P, T, seed=7, dtype=np.float64)
    per_table = np.einsum("tr,ntr->nt", racecpu.soft_buckets(q, planes, beta)[0], racecpu.soft_buckets(k, planes, beta))
    se = per_table.std(1) / np.sqrt(T)
    assert np.all(np.abs(per_table.mean(1) - theory.expected_kernel(theta, beta, P)) < 4.5 * se + 1e-12)


def test_angular_kernel_matches_reference_attention(rng):
    q, k, v = rng.standard_normal((7, 4)), 3 * rng.standard_normal((9, 4)), rng.standard_normal((9, 2))
    S = theory.angular_kernel(q, k, 2.5)
    np.testing.assert_allclose((S @ v) / S.sum(1, keepdims=True), angular_attention(q, k, v, 2.5), rtol=1e-12)
    assert S.shape == (7, 9) and np.all((S >= 0) & (S <= 1))


def test_bias_bound_and_lemma_requirement():
    assert theory.bias_bound(3, 10.0) == pytest.approx(12 / (np.sqrt(2 * np.pi) * 10) + 6 * np.exp(-20 * np.tanh(1)))
    assert theory.lemma_l_requirement(0.1, 100, 0.1) == pytest.approx(200 * np.log(2e5))


def test_loglog_fit_and_bootstrap(rng):
    x = np.array([1.0, 2, 4, 8, 16, 32])
    assert stats.loglog_fit(x, 3 * x ** -0.5) == pytest.approx((-0.5, np.log(3)))
    noisy = 2 * x ** -1.0 * np.exp(0.05 * rng.standard_normal((20, x.size)))
    f = stats.bootstrap_fit(x, noisy, seed=1)
    assert f.lo < -1.0 < f.hi and f.hi - f.lo < 0.1 and f.covers(f.slope)
    with pytest.raises(ValueError):
        stats.loglog_fit(x, -x)
    with pytest.raises(ValueError):
        stats.bootstrap_fit(x, noisy[:1])


@pytest.mark.parametrize("name", ["isotropic", "clustered", "near_duplicate"])
def test_datasets_are_seeded_and_documented(name):
    a = data.make_qkv(name, 2000, 16, 8, [3, 1])
    b = data.make_qkv(name, 2000, 16, 8, [3, 1])
    c = data.make_qkv(name, 2000, 16, 8, [3, 2])
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and not np.array_equal(a[0], c[0])
    q, k, v = a
    assert q.shape == (2000, 16) and k.shape == (2000, 16) and v.shape == (2000, 8)
    # E ||v||^2 = 1 (the group part of structured values varies per draw: average draws)
    msq = np.mean([np.mean(np.sum(data.make_qkv(name, 200, 4, 8, s)[2] ** 2, 1)) for s in range(40)])
    assert abs(msq - 1) < 0.08
    assert np.allclose(np.linalg.norm(data.unit_rows(q), axis=1), 1)
    assert name in data.__doc__


def test_npz_dataset_and_registry(tmp_path, rng):
    path = tmp_path / "m.npz"
    np.savez(path, q=rng.standard_normal((3, 50, 6)), k=rng.standard_normal((3, 50, 6)), v=rng.standard_normal((3, 50, 2)))
    make = data.npz_dataset(str(path))
    q, k, v = make(20, 999, 999, np.random.default_rng(0))
    assert q.shape == (20, 6) and v.shape == (20, 2)
    with pytest.raises(ValueError, match="50 tokens"):
        make(51, 6, 2, np.random.default_rng(0))
    np.savez(tmp_path / "bad.npz", q=np.zeros((5, 3)))
    with pytest.raises(ValueError, match="missing"):
        data.npz_dataset(str(tmp_path / "bad.npz"))
    with pytest.raises(ValueError, match="unknown data set"):
        data.make_qkv("nope", 4, 2, 2, 0)
    with pytest.raises(TypeError):
        data.register_dataset("x", 3)

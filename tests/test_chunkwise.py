"""racecpu.chunkwise (the ratio estimator in chunkwise matrix form) with ``xp = numpy``.

The oracles are independent of the module: :mod:`racecpu.reference`'s dense
O(N^2) RACE attention (explicit softmax over corners, the full kernel matrix)
for values and gradients, central finite differences for ``dbeta``, and
properties that need no oracle at all (slab boundaries, causality, the
``DEN_FLOOR`` rule, dtypes and untouched inputs).  Sizes are tiny, with
8-token chunks and 8-row partials so that every scan crosses several chunks
and every sketch sums several partials.
"""

import numpy as np
import pytest

import racecpu
from racecpu import chunkwise as cw
from racecpu import reference

L, P, D, DV = 2, 3, 4, 3
CHUNK = 8
SUM_CHUNK = 8
BETA = 1.3


def assert_close(got, want, rtol, what=""):
    """Max-norm relative error: max |got - want| <= rtol * max |want| (as tests/test_cuda.py)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.all(np.isfinite(got)), f"{what}: not finite"
    scale = max(np.max(np.abs(want), initial=0.0), 1e-30)
    err = np.max(np.abs(got - want), initial=0.0) / scale
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:g}"


def assert_scalar_close(got, want, rtol, what="dbeta"):
    assert isinstance(got, float), (what, type(got))
    assert abs(got - want) <= rtol * max(abs(want), 1e-3), (what, got, want)


def problem(rng, lead_q, lead_k, nq, nk, dtype=np.float64, masked=True):
    """``q (G, nq, D)``, ``k (Gk, nk, D)``, ``v (Gk, nk, DV)`` and a ``(Gk, nk)`` key mask (or None)."""
    q = rng.standard_normal((lead_q, nq, D)).astype(dtype)
    k = rng.standard_normal((lead_k, nk, D)).astype(dtype)
    v = rng.standard_normal((lead_k, nk, DV)).astype(dtype)
    mask = rng.random((lead_k, nk)) > 0.25 if masked else None
    return q, k, v, mask


def planes64():
    return racecpu.hyperplanes(D, P, L, seed=3).astype(np.float64)


def dense(q, k, v, W, beta, causal, mask, group, g):
    """The dense oracle on grouped-query inputs: ``(out, dq, dk, dv, dbeta, dW)``, with k, v and the mask
    repeated per query head and dk, dv summed over each key/value head's group."""
    Gk, nk = k.shape[:2]
    kr, vr = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
    mr = None if mask is None else np.repeat(mask, group, axis=0)
    out, res = reference.race_attention_dense_fwd(q, kr, vr, W, beta, causal=causal, key_mask=mr)
    dq, dk, dv, db, dW = reference.race_attention_dense_bwd(res, g, dplanes=True)
    dk = dk.reshape(Gk, group, nk, -1).sum(1)
    dv = dv.reshape(Gk, group, nk, -1).sum(1)
    return out, dq, dk, dv, db, dW


def chunkwise(q, k, v, W, beta, causal, mask, group, g, **kw):
    """The module under test: ``(out, dq, dk, dv, dbeta, dW)``."""
    out, res = cw.forward(np, q, k, v, W, beta, causal=causal, key_mask=mask, group=group,
                          chunk=CHUNK, sum_chunk=SUM_CHUNK, **kw)
    return (out,) + cw.backward(np, res, g, q=q, k=k)


NAMES = ("out", "dq", "dk", "dv", "dbeta", "dW")


# ---------------------------------------------------------------------------
# 1. the soft hash
# ---------------------------------------------------------------------------

def test_soft_hash_matches_dense_softmax_over_corners(rng):
    """soft_hash (logistic factorisation) and soft_hash_bwd (dx, dbeta, dW) against
    reference.soft_buckets_dense / soft_buckets_dense_bwd (explicit softmax over corners), float64, 1e-12."""
    W = planes64()
    x = rng.standard_normal((3, 5, D))
    phi, t = cw.soft_hash(np, x, W, BETA)
    pr, tr = reference.soft_buckets_dense(x, W, BETA)
    assert phi.shape == (3, 5, L * 2 ** P) and t.shape == (3, 5, L * P)
    assert_close(phi, pr.reshape(3, 5, -1), 1e-12, "phi")
    assert_close(t, tr.reshape(3, 5, -1), 1e-12, "t")

    dphi = rng.standard_normal(phi.shape)
    dx, db = cw.soft_hash_bwd(np, dphi, phi, t, W, BETA)
    dxr, dbr = reference.soft_buckets_dense_bwd(dphi.reshape(pr.shape), pr, tr, W, BETA)
    assert_close(dx, dxr, 1e-12, "dx")
    assert abs(float(db) - dbr) <= 1e-12 * max(abs(dbr), 1.0), (float(db), dbr)

    dx2, db2, dW = cw.soft_hash_bwd(np, dphi, phi, t, W, BETA, x)
    _, _, dWr = reference.soft_buckets_dense_bwd(dphi.reshape(pr.shape), pr, tr, W, BETA, x)
    assert dW.shape == W.shape
    assert_close(dW, dWr, 1e-12, "dW")
    assert np.array_equal(dx2, dx) and float(db2) == float(db)


@pytest.mark.parametrize("beta,scale", [(1e4, 1.0), (1.0, 1e4), (1e4, 1e4), (1e-8, 1.0)])
def test_soft_hash_extreme_inputs_stay_finite(rng, beta, scale):
    """Large beta and/or large |x| (saturated tanh, exp(-|z|) underflowing to 0) and a tiny beta: phi is
    finite, in [0, 1], sums to 1 per table, and equals the (max-shifted) dense softmax to 1e-12
    absolute; the backward is finite."""
    W = planes64()
    x = scale * rng.standard_normal((7, D))
    phi, t = cw.soft_hash(np, x, W, beta)
    assert np.all(np.isfinite(phi)) and np.all(np.isfinite(t))
    assert np.all(phi >= 0) and np.all(phi <= 1)
    np.testing.assert_allclose(phi.reshape(7, L, -1).sum(-1), 1.0, rtol=0, atol=1e-12)
    pr, _ = reference.soft_buckets_dense(x, W, beta)
    np.testing.assert_allclose(phi, pr.reshape(7, -1), rtol=0, atol=1e-12)
    dx, db, dW = cw.soft_hash_bwd(np, rng.standard_normal(phi.shape), phi, t, W, beta, x)
    assert np.all(np.isfinite(dx)) and np.isfinite(float(db)) and np.all(np.isfinite(dW))


# ---------------------------------------------------------------------------
# 2. forward and backward against the dense oracle
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("n", [37, 32])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_dense_reference(rng, causal, group, masked, n):
    """out, dq, dk, dv, dbeta and dplanes against reference.race_attention_dense_fwd/_bwd(dplanes=True)
    in float64 (max-norm relative 1e-10): causal or not, grouped-query (group 2: k, v repeated per query
    head for the oracle, its dk, dv summed per group), with a key mask or none, N a multiple of the
    8-token chunk (32) or not (37), 8-row partials of the non-causal sketch."""
    Gk = 2
    q, k, v, mask = problem(rng, Gk * group, Gk, n, n, masked=masked)
    W = planes64()
    g = rng.standard_normal((Gk * group, n, DV))
    got = chunkwise(q, k, v, W, BETA, causal, mask, group, g)
    want = dense(q, k, v, W, BETA, causal, mask, group, g)
    for name, a, b in zip(NAMES, got, want):
        if name == "dbeta":
            assert_scalar_close(a, b, 1e-10)
        else:
            assert a.dtype == np.float64, name
            assert_close(a, b, 1e-10, name)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("group", [1, 2])
def test_noncausal_nq_differs_from_nk(rng, group, masked):
    """Non-causal with 7 queries and 26 keys (4 partials of 8 rows, the last short) against the dense
    oracle, float64, 1e-10."""
    Gk = 2
    q, k, v, mask = problem(rng, Gk * group, Gk, 7, 26, masked=masked)
    W = planes64()
    g = rng.standard_normal((Gk * group, 7, DV))
    got = chunkwise(q, k, v, W, BETA, False, mask, group, g)
    want = dense(q, k, v, W, BETA, False, mask, group, g)
    assert got[0].shape == (Gk * group, 7, DV) and got[2].shape == (Gk, 26, D)
    for name, a, b in zip(NAMES, got, want):
        if name == "dbeta":
            assert_scalar_close(a, b, 1e-10)
        else:
            assert_close(a, b, 1e-10, name)


# ---------------------------------------------------------------------------
# 3. slabs
# ---------------------------------------------------------------------------

def one_head_bytes(n, group, causal):
    """The workspace one whole key/value head of ``n`` tokens takes, by the module's own estimate."""
    return n * cw.ArrayOps(np).bytes_per_token(n, group, D, DV, L, P, CHUNK, np.dtype(np.float64), False, True, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_slab_boundaries_change_nothing(rng, causal):
    """A budget of one whole key/value head per slab, and one of two (the last slab short), give
    bitwise the results of the default 2**31 (all three heads in one slab): forward output,
    residuals, dq, dk and dv.  No oracle: the property is that slabs of whole heads are independent.

    dbeta and dplanes are sums over every head, accumulated slab by slab (a Python float and ``dW +=``
    per slab), so the slab split changes their order of summation: they are compared to 1e-14
    relative, not bitwise (they differ in the last bits, about 4e-16 relative, on this problem)."""
    Gk, group, n = 3, 2, 21
    q, k, v, mask = problem(rng, Gk * group, Gk, n, n)
    W = planes64()
    g = rng.standard_normal((Gk * group, n, DV))
    kw = dict(causal=causal, key_mask=mask, group=group, chunk=CHUNK, sum_chunk=SUM_CHUNK)
    assert cw.slab_heads(Gk, 100, 1) == 1 and cw.slab_heads(Gk, 100, 250) == 2 and cw.slab_heads(Gk, 100, 2 ** 31) == 3
    runs = []
    head = one_head_bytes(n, group, causal)
    for ws, slab in ((2 ** 31, (3, n)), (head, (1, n)), (int(2.5 * head), (2, n))):
        out, res = cw.forward(np, q, k, v, W, BETA, workspace=ws, **kw)
        assert res["slab"] == slab and res["carries"] is None
        runs.append((out, res, cw.backward(np, res, g, q=q, k=k)))
    (out0, res0, gr0) = runs[0]
    for out, res, gr in runs[1:]:
        assert np.array_equal(out, out0)
        for key in ("phiq", "tq", "phik", "tk", "D"):
            assert np.array_equal(res[key], res0[key]), key
        for name, a, b in zip(NAMES[1:4], gr, gr0):
            assert np.array_equal(a, b), name
        assert_scalar_close(gr[3], gr0[3], 1e-14)
        assert_close(gr[4], gr0[4], 1e-14, "dW")


def test_slab_shape_cuts_a_head_that_does_not_fit():
    """slab_shape: whole heads where one fits (as many as fit), else one head a slab in equal
    segments of whole granules within the budget, the last one shorter, never below a granule."""
    assert cw.slab_shape(4, 100, 10, 10 ** 9, 8) == (4, 100)
    assert cw.slab_shape(4, 100, 10, 2500, 8) == (2, 100)
    assert cw.slab_shape(4, 100, 10, 1000, 8) == (1, 100)
    assert cw.slab_shape(4, 100, 10, 999, 8) == (1, 56)           # 2 segments of <= 96 tokens: 56 + 44
    assert cw.slab_shape(4, 1000, 10, 2000, 8) == (1, 200)        # 5 segments of 200
    assert cw.slab_shape(4, 100, 10, 1, 8) == (1, 8)              # the least: a granule
    assert cw.slab_shape(2, 5, 10, 1, 8) == (1, 5)                # a head shorter than a granule
    assert cw._segments(21, 8) == [(0, 8), (8, 16), (16, 21)] and cw._segments(0, 8) == [(0, 0)]


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_segments_match_dense_reference(rng, causal, group, keep):
    """A workspace too small for one head cuts each into segments of 8 tokens (21 and 37: the last one
    short): out, dq, dk, dv, dbeta and dplanes still equal the dense oracle (float64, 1e-10), the
    causal state carried across segments forward and its cotangent backward; non-causal with 7
    queries against 37 keys besides; with the buckets kept or remade from the projections."""
    Gk = 2
    for nq, nk in ((37, 37), (21, 21)) if causal else ((37, 37), (7, 37)):
        q, k, v, mask = problem(rng, Gk * group, Gk, nq, nk)
        W = planes64()
        g = rng.standard_normal((Gk * group, nq, DV))
        out, res = cw.forward(np, q, k, v, W, BETA, causal=causal, key_mask=mask, group=group, chunk=CHUNK,
                              sum_chunk=SUM_CHUNK, workspace=1, keep_buckets=keep)
        assert res["slab"] == (1, 8)
        assert (res["carries"] is not None) == causal and (res["phiq"] is None) == (not keep)
        got = (out,) + cw.backward(np, res, g, q=q, k=k)
        want = dense(q, k, v, W, BETA, causal, mask, group, g)
        for name, a, b in zip(NAMES, got, want):
            if name == "dbeta":
                assert_scalar_close(a, b, 1e-10)
            else:
                assert_close(a, b, 1e-10, name)


@pytest.mark.parametrize("workspace", [1, 2 ** 31])
@pytest.mark.parametrize("causal", [False, True])
def test_projections_kept_give_the_buckets_kept(rng, causal, workspace):
    """keep_buckets=False keeps the projections (L * P a row, no phi or t) and the backward remakes
    the buckets from them, masked keys zeroed again: out, dq, dk, dv, dbeta and dplanes equal, to the
    bit, those of a forward that kept the buckets, in one slab and in segments; float32."""
    Gk, group, n = 2, 2, 29
    q, k, v, mask = problem(rng, Gk * group, Gk, n, n, dtype=np.float32)
    W = racecpu.hyperplanes(D, P, L, seed=3)
    g = rng.standard_normal((Gk * group, n, DV)).astype(np.float32)
    runs = []
    for keep in (True, False):
        out, res = cw.forward(np, q, k, v, W, BETA, causal=causal, key_mask=mask, group=group, chunk=CHUNK,
                              sum_chunk=SUM_CHUNK, workspace=workspace, keep_buckets=keep)
        kept = [key for key in ("phiq", "tq", "phik", "tk", "uq", "uk") if res[key] is not None]
        assert kept == (["phiq", "tq", "phik", "tk"] if keep else ["uq", "uk"])
        runs.append((out,) + cw.backward(np, res, g, q=q, k=k))
    for name, a, b in zip(NAMES, *runs):
        assert np.array_equal(a, b), name


# ---------------------------------------------------------------------------
# 4. dtypes
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_float32_agrees_with_float64(rng, causal):
    """float32 inputs and planes: output and gradients within 1e-5 (max-norm relative) of the same
    problem in float64 (itself checked against the dense oracle above), in float32."""
    Gk, group, n = 2, 2, 37
    q, k, v, mask = problem(rng, Gk * group, Gk, n, n, dtype=np.float32)
    W32 = racecpu.hyperplanes(D, P, L, seed=3)
    assert W32.dtype == np.float32
    g = rng.standard_normal((Gk * group, n, DV)).astype(np.float32)
    got = chunkwise(q, k, v, W32, BETA, causal, mask, group, g)
    want = chunkwise(*(a.astype(np.float64) for a in (q, k, v, W32)), BETA, causal, mask, group,
                     g.astype(np.float64))
    for name, a, b in zip(NAMES, got, want):
        if name == "dbeta":
            assert_scalar_close(a, b, 1e-5)
        else:
            assert a.dtype == np.float32, name
            assert_close(a, b, 1e-5, name)


@pytest.mark.parametrize("causal", [False, True])
def test_float16_inputs_out_dtype_and_inputs_untouched(rng, causal):
    """float16 q, k, v (and a float16 grad) with float32 planes: out_dtype=np.float16 gives a float16
    ``out`` (within float16 rounding of the float64 result), the gradients are float32, ``out`` aliases
    no input, and no input (q, k, v, mask, planes, grad) is modified by the forward or the backward."""
    Gk, group, n = 2, 2, 19
    q, k, v, mask = problem(rng, Gk * group, Gk, n, n, dtype=np.float16)
    W = racecpu.hyperplanes(D, P, L, seed=3)
    g = rng.standard_normal((Gk * group, n, DV)).astype(np.float16)
    inputs = (q, k, v, mask, W, g)
    before = [a.copy() for a in inputs]
    out, res = cw.forward(np, q, k, v, W, BETA, causal=causal, key_mask=mask, group=group,
                          chunk=CHUNK, sum_chunk=SUM_CHUNK, out_dtype=np.float16)
    assert out.dtype == np.float16 and out.shape == (Gk * group, n, DV)
    assert not any(np.shares_memory(out, a) for a in inputs)
    grads = cw.backward(np, res, g, q=q, k=k)
    for name, a in zip(NAMES[1:], grads):
        if name != "dbeta":
            assert a.dtype == np.float32, name
            assert np.all(np.isfinite(a)), name
    for a, b in zip(inputs, before):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    want = chunkwise(*(a.astype(np.float64) for a in (q, k, v, W)), BETA, causal, mask, group,
                     g.astype(np.float64))[0]
    assert_close(out, want, 2e-3, "out (float16)")


@pytest.mark.parametrize("workspace", [1, 2 ** 31])
@pytest.mark.parametrize("causal", [False, True])
def test_grad_dtypes_cast_each_slab_as_the_whole(rng, causal, workspace):
    """``grad_dtypes``: dq, dk, dv in the given dtypes (a slab at a time with one key/value head
    per slab, once at the end with one slab), equal to the compute dtype's gradients cast, to the
    bit; the planes' gradient and dbeta unchanged."""
    Gk, group, n = 3, 2, 19
    q, k, v, mask = problem(rng, Gk * group, Gk, n, n, dtype=np.float16)
    W = racecpu.hyperplanes(D, P, L, seed=3)
    g = rng.standard_normal((Gk * group, n, DV)).astype(np.float16)
    _, res = cw.forward(np, q, k, v, W, BETA, causal=causal, key_mask=mask, group=group, chunk=CHUNK,
                        sum_chunk=SUM_CHUNK, workspace=workspace)
    assert (cw.slab_heads(Gk, 1, workspace) < Gk) == (workspace == 1)
    want = cw.backward(np, res, g, q=q, k=k)
    dtypes = (np.float16, np.float64, np.float16)
    got = cw.backward(np, res, g, q=q, k=k, grad_dtypes=dtypes)
    for name, a, b, dt in zip(("dq", "dk", "dv"), got, want, dtypes):
        assert a.dtype == dt, name
        np.testing.assert_array_equal(a, b.astype(dt), err_msg=name)
    assert got[3] == want[3]
    np.testing.assert_array_equal(got[4], want[4])


# ---------------------------------------------------------------------------
# 5. the DEN_FLOOR rule
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_fully_masked_head_outputs_and_passes_zero(rng, causal, group):
    """A key mask hiding every key of key/value head 0: its query heads output exactly 0 and get dq = 0,
    its keys and values get dk = dv = 0 (rows with D <= L * DEN_FLOOR), nothing is NaN, and the other
    head still equals the dense oracle (float64, 1e-10)."""
    Gk, n = 2, 13
    q, k, v, mask = problem(rng, Gk * group, Gk, n, n)
    mask[0] = False
    W = planes64()
    g = rng.standard_normal((Gk * group, n, DV))
    out, dq, dk, dv, db, dW = chunkwise(q, k, v, W, BETA, causal, mask, group, g)
    for name, a in zip(NAMES, (out, dq, dk, dv, db, dW)):
        assert np.all(np.isfinite(a)), name
    assert np.all(out[:group] == 0) and np.all(dq[:group] == 0)
    assert np.all(dk[0] == 0) and np.all(dv[0] == 0)
    want = dense(q, k, v, W, BETA, causal, mask, group, g)
    for name, a, b in zip(NAMES, (out, dq, dk, dv, db, dW), want):
        if name == "dbeta":
            assert_scalar_close(a, b, 1e-10)
        else:
            assert_close(a, b, 1e-10, name)


# ---------------------------------------------------------------------------
# 6. causality
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("t", [1, 8, 13, 36])
def test_causal_output_ignores_later_keys(rng, t):
    """Causal forward: replacing k, v (and the key mask) at positions >= t leaves out[:, :t] bitwise
    unchanged, for t inside a chunk (1, 13, 36) and on a chunk boundary (8).  No oracle: causality."""
    Gk, group, n = 2, 2, 37
    q, k, v, mask = problem(rng, Gk * group, Gk, n, n)
    W = planes64()
    kw = dict(causal=True, group=group, chunk=CHUNK, sum_chunk=SUM_CHUNK)
    out, _ = cw.forward(np, q, k, v, W, BETA, key_mask=mask, **kw)
    k2, v2, m2 = k.copy(), v.copy(), mask.copy()
    k2[:, t:] = 10 * rng.standard_normal(k2[:, t:].shape)
    v2[:, t:] = 10 * rng.standard_normal(v2[:, t:].shape)
    m2[:, t:] = ~m2[:, t:]
    out2, _ = cw.forward(np, q, k2, v2, W, BETA, key_mask=m2, **kw)
    assert np.array_equal(out2[:, :t], out[:, :t])
    assert not np.array_equal(out2[:, t:], out[:, t:])


# ---------------------------------------------------------------------------
# 7. dbeta by finite differences
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_dbeta_matches_finite_differences(rng, causal, group):
    """backward's dbeta against the central difference (h = 1e-6) of sum(out * g) over beta, computed
    with the module's own forward only (independent of the reference), float64, relative 1e-5."""
    Gk, n = 2, 21
    q, k, v, mask = problem(rng, Gk * group, Gk, n, n)
    W = planes64()
    g = rng.standard_normal((Gk * group, n, DV))

    def f(beta):
        out, _ = cw.forward(np, q, k, v, W, beta, causal=causal, key_mask=mask, group=group,
                            chunk=CHUNK, sum_chunk=SUM_CHUNK)
        return float(np.sum(out * g))

    _, res = cw.forward(np, q, k, v, W, BETA, causal=causal, key_mask=mask, group=group,
                        chunk=CHUNK, sum_chunk=SUM_CHUNK)
    db = cw.backward(np, res, g)[3]
    h = 1e-6
    fd = (f(BETA + h) - f(BETA - h)) / (2 * h)
    assert abs(db - fd) <= 1e-5 * max(abs(fd), 1e-3), (db, fd)


# ---------------------------------------------------------------------------
# 8. memory
# ---------------------------------------------------------------------------

def traced_call(q, k, v, g, causal, workspace, keep, group=1):
    """A forward and backward under tracemalloc, 16-bit results: ``(peak, held, res)``, ``held`` the
    bytes the call's results and residuals hold (out, dq, dk, dv and the residual arrays)."""
    import tracemalloc
    W = racecpu.hyperplanes(q.shape[-1], 3, 3, seed=0)
    dt = q.dtype
    cw.forward(np, q[:1, :64], k[:1, :64], v[:1, :64], W, 1.0, causal=causal, out_dtype=dt)   # imports, if any
    tracemalloc.start()
    try:
        out, res = cw.forward(np, q, k, v, W, 1.0, causal=causal, workspace=workspace, out_dtype=dt,
                              keep_buckets=keep, group=group)
        grads = cw.backward(np, res, g, grad_dtypes=(dt,) * 3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    kept = [x for key, x in res.items() if key not in ("v", "mask", "planes") and hasattr(x, "nbytes")]
    if res["prefix"] is not None:
        kept.append(res["prefix"].states)
    return peak, out.nbytes + sum(x.nbytes for x in kept) + sum(x.nbytes for x in grads[:3]), res


@pytest.mark.parametrize("causal", [False, True])
def test_long_16bit_call_peaks_within_the_issue_bound(rng, causal):
    """Issue 55's memory bound on the array form (the GPU path's allocations, on NumPy): float16 q, k,
    v and cotangent, 4 heads of 8,192 tokens, d = dv = 128, the projections kept instead of the
    buckets and a workspace of 6 % of the eight arrays (q, k, v, grad, out, dq, dk, dv): the peak of
    a forward and backward, the caller's four inputs included, is at most 1.15x the eight arrays,
    and the temporaries beyond what the call returns and keeps stay within the workspace."""
    G, n, d = 4, 8192, 128
    q, k, v, g = (rng.standard_normal((G, n, d)).astype(np.float16) for _ in range(4))
    eight = 8 * q.nbytes
    ws = int(0.06 * eight)
    peak, held, res = traced_call(q, k, v, g, causal, ws, keep=False)
    assert res["slab"][0] == 1 and res["slab"][1] < n                     # segments of one head
    assert (4 * q.nbytes + peak) / eight <= 1.15, (4 * q.nbytes + peak) / eight
    assert peak - held <= ws, (peak - held) / ws


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_segments_stay_within_the_workspace(rng, causal, keep):
    """Budgets of segments of 64 to 2,048 tokens (the least a head allows: the causal chunk, the
    sketch's partial), float16 inputs with float32 compute, grouped query heads, d = 32: the temporaries of a forward and backward beyond what
    the call returns and keeps never exceed the workspace (tracemalloc)."""
    G, group, n, d = 4, 2, 4096, 32
    q, g = (rng.standard_normal((G, n, d)).astype(np.float16) for _ in range(2))
    k, v = (rng.standard_normal((G // group, n, d)).astype(np.float16) for _ in range(2))
    per = cw.ArrayOps(np).bytes_per_token(n, group, d, d, 3, 3, 64, np.dtype(np.float32), True, keep, causal)
    for tokens in (64, 256, 1024) if causal else (1024, 2048):
        ws = per * tokens
        peak, held, res = traced_call(q, k, v, g, causal, ws, keep, group)
        assert res["slab"] == (1, tokens)
        assert peak - held <= ws, (tokens, (peak - held) / ws)


# ---------------------------------------------------------------------------
# 9. bfloat16 as bits
# ---------------------------------------------------------------------------

def test_bfloat16_bits_widen_exactly_and_round_to_nearest_even(rng):
    """Bfloat16Bits against ml_dtypes: every bfloat16 pattern (NaN aside) widens to the float32
    ml_dtypes gives, and float32 values (ties, near-overflow, Inf, NaN, subnormals) round as
    ml_dtypes' astype does; views share the bits; reshape and astype to float64."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf = np.dtype(ml_dtypes.bfloat16)
    pats = np.arange(2 ** 16, dtype=np.uint16)
    vals = pats.view(bf)
    keep = (pats & 0x7FFF) <= 0x7F80                           # not NaN
    w = cw.Bfloat16Bits(np, pats.copy())
    assert w.dtype == bf and w.shape == (2 ** 16,) and w.nbytes == 2 ** 17
    np.testing.assert_array_equal(w.astype(np.float32)[keep], vals[keep].astype(np.float32))
    finite = cw.Bfloat16Bits(np, pats[keep][:2 ** 15].copy())
    np.testing.assert_array_equal(finite.reshape(128, 256).astype(np.float64).ravel(),
                                  vals[keep][:2 ** 15].astype(np.float64))
    x = np.concatenate([(rng.standard_normal(4096) * 10.0 ** rng.integers(-40, 37, 4096)).astype(np.float32),
                        np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, 3.3895e38, 3.4e38, np.inf, -np.inf, 1e-41,
                                  -0.0, np.nan], np.float32)])
    out = cw.Bfloat16Bits.empty(np, x.shape)
    out[...] = x
    want = x.astype(bf)
    fin = ~np.isnan(x)
    assert x.dtype == np.float32 and fin.sum() == x.size - 1
    np.testing.assert_array_equal(out.bits[fin], want.view(np.uint16)[fin])
    assert ((out.bits[~fin] & 0x7FFF) > 0x7F80).all()                 # NaN stays NaN
    view = out[:10]
    view[...] = np.zeros(10, np.float32)
    assert (out.bits[:10] == 0).all()
    with pytest.raises(TypeError, match="uint16"):
        cw.Bfloat16Bits(np, np.zeros(3, np.int16))


@pytest.mark.parametrize("workspace", [1, 2 ** 31])
@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_bits_in_and_out_equal_float32_rounded(rng, causal, workspace):
    """q, k, v and the cotangent as Bfloat16Bits (the GPU's form of bfloat16), out and dq, dk, dv
    asked in bfloat16: to the bit, the float32 call on the same (exactly widened) values with
    its results rounded by ml_dtypes, in one slab and in segments; the inputs' bits untouched."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf = np.dtype(ml_dtypes.bfloat16)
    Gk, group, n = 2, 2, 29
    q, k, v, mask = problem(rng, Gk * group, Gk, n, n, dtype=np.float32)
    g = rng.standard_normal((Gk * group, n, DV)).astype(np.float32)
    q, k, v, g = (x.astype(bf) for x in (q, k, v, g))
    W = racecpu.hyperplanes(D, P, L, seed=3)
    bits = [cw.Bfloat16Bits(np, x.view(np.uint16).copy()) for x in (q, k, v, g)]
    kw = dict(causal=causal, key_mask=mask, group=group, chunk=CHUNK, sum_chunk=SUM_CHUNK, workspace=workspace)
    out, res = cw.forward(np, *bits[:3], W, BETA, out_dtype=bf, keep_buckets=False, **kw)
    grads = cw.backward(np, res, bits[3], grad_dtypes=(bf,) * 3)
    wide = [x.astype(np.float32) for x in (q, k, v, g)]
    out32, res32 = cw.forward(np, *wide[:3], W, BETA, keep_buckets=False, **kw)
    want = (out32,) + cw.backward(np, res32, wide[3])
    assert res["slab"] == res32["slab"] and (res["slab"][1] < n) == (workspace == 1)
    for name, a, b in zip(NAMES, (out,) + grads, want):
        if name == "dbeta":
            assert a == b
        else:
            assert isinstance(a, cw.Bfloat16Bits) and a.dtype == bf, name
            np.testing.assert_array_equal(a.bits, b.astype(bf).view(np.uint16), err_msg=name)
    for x, b in zip((q, k, v, g), bits):
        np.testing.assert_array_equal(b.bits, x.view(np.uint16))


@pytest.mark.parametrize("workspace", [1, 2 ** 31])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_alone_keeps_nothing(rng, causal, workspace):
    """residuals=False (inference): ``(out, None)``, out equal to the bit to a forward that keeps
    the projections (the same segments), in one slab and in segments; and for float16 inputs at
    4 heads x 4,096 tokens x 128 its peak, inputs included, is under 1.1x q, k, v and out
    (tracemalloc; a forward with residuals kept is ~1.2x there)."""
    import tracemalloc
    Gk, group, n = 2, 2, 29
    q, k, v, mask = problem(rng, Gk * group, Gk, n, n, dtype=np.float32)
    W = racecpu.hyperplanes(D, P, L, seed=3)
    kw = dict(causal=causal, key_mask=mask, group=group, chunk=CHUNK, sum_chunk=SUM_CHUNK, workspace=workspace)
    out, res = cw.forward(np, q, k, v, W, BETA, residuals=False, **kw)
    want, wres = cw.forward(np, q, k, v, W, BETA, keep_buckets=False, **kw)
    assert res is None and np.array_equal(out, want)
    G, n, d = 4, 4096, 128
    q, k, v = (rng.standard_normal((G, n, d)).astype(np.float16) for _ in range(3))
    four = 4 * q.nbytes
    W = racecpu.hyperplanes(d, 3, 3, seed=0)
    peaks = []
    for keep in (False, True):
        tracemalloc.start()
        try:
            cw.forward(np, q, k, v, W, 1.0, causal=causal, workspace=int(0.05 * four), out_dtype=np.float16,
                       residuals=keep)
            peaks.append((3 * q.nbytes + tracemalloc.get_traced_memory()[1]) / four)
        finally:
            tracemalloc.stop()
    assert peaks[0] <= 1.1 and peaks[0] < peaks[1], peaks

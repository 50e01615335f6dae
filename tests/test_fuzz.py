"""Fuzz target for the public functions (issue 40): shapes, dtypes, layouts, masks, beta, aliasing.

Every case ends in one of two outcomes: a ``TypeError``/``ValueError`` whose
message names the argument that was made wrong, or a result equal to
:mod:`racecpu.reference` (float64 1e-10 relative, float32 1e-4, float16 2e-2)
with every input unchanged.  At most one argument is made wrong per case, so
an error can be checked against it.

``RACECPU_FUZZ_EXAMPLES=<n>`` sets the examples per function (default 25);
the outcome counts are printed at the end (``pytest -s``).
"""

import os
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import racecpu
from racecpu import reference as R

EXAMPLES = int(os.environ.get("RACECPU_FUZZ_EXAMPLES", "25"))
COUNTS = Counter()
TOL = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 1e-4, np.dtype(np.float16): 2e-2}
WRONG_DTYPES = [np.int64, np.bool_, np.complex128, object]


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    print("\nfuzz outcomes:", dict(sorted(COUNTS.items())))


def layout(data, a, name):
    """``a`` as C, Fortran, a strided view or read-only (same values)."""
    kind = data.draw(st.sampled_from(["C", "F", "strided", "readonly"]), label=f"{name} layout")
    if kind == "F":
        return np.asfortranarray(a)
    if kind == "strided" and a.ndim:
        big = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
        big[..., ::2] = a
        return big[..., ::2]
    if kind == "readonly":
        a = a.copy()
        a.setflags(write=False)
    return a


def draw_case(data, with_mask=True):
    lead = tuple(data.draw(st.lists(st.integers(0, 2), max_size=2), label="lead"))
    causal = data.draw(st.booleans(), label="causal")
    nk = data.draw(st.integers(0, 40), label="Nk")
    nq = nk if causal else data.draw(st.integers(0, 40), label="Nq")
    d, dv = data.draw(st.integers(1, 9), label="d"), data.draw(st.integers(0, 7), label="dv")
    L, P = data.draw(st.integers(1, 3), label="L"), data.draw(st.integers(1, 4), label="P")
    dt = np.dtype(data.draw(st.sampled_from([np.float16, np.float32, np.float64]), label="dtype"))
    seed = data.draw(st.integers(0, 2 ** 16), label="seed")
    rng = np.random.default_rng(seed)
    args = {"q": rng.standard_normal(lead + (nq, d)).astype(dt), "k": rng.standard_normal(lead + (nk, d)).astype(dt),
            "v": rng.standard_normal(lead + (nk, dv)).astype(dt),
            "planes": racecpu.hyperplanes(d, P, L, seed=seed, dtype=dt if dt != np.float16 else np.float32)}
    mask = data.draw(st.sampled_from(["none", "random", "false"]) if with_mask else st.just("none"), label="mask")
    args["key_mask"] = None if mask == "none" else (rng.random(lead + (nk,)) < 0.7 if mask == "random"
                                                     else np.zeros(lead + (nk,), bool))
    for name in ("q", "k", "v", "planes"):
        args[name] = layout(data, args[name], name)
    beta = data.draw(st.one_of(st.floats(1e-8, 1e6), st.sampled_from([0.0, -1.0, np.nan, np.inf, True])),
                     label="beta")
    bad = None
    if isinstance(beta, bool) or not (beta > 0 and np.isfinite(beta)):
        bad = "beta"
    elif data.draw(st.booleans(), label="wrong dtype"):
        bad = data.draw(st.sampled_from(["q", "k", "v", "planes"]), label="wrong dtype arg")
        wdt = data.draw(st.sampled_from(WRONG_DTYPES), label="wrong dtype kind")
        args[bad] = args[bad].astype(wdt)
    return args, beta, causal, bad


def overlapping_out(data, args, shape, dtype):
    """An ``out`` of ``shape`` sharing memory with one input (name, array), or (None, None)."""
    victims = [n for n in ("q", "k", "v", "planes", "key_mask") if args[n] is not None and args[n].size
               and args[n].flags.writeable and args[n].dtype == dtype and args[n].flags.c_contiguous]
    size = int(np.prod(shape))
    if not victims or size == 0 or not data.draw(st.booleans(), label="alias out"):
        return None, None
    name = data.draw(st.sampled_from(victims), label="alias victim")
    a = args[name]
    buf = np.zeros(a.size + size, dtype)
    buf[:a.size] = a.reshape(-1)
    args[name] = buf[:a.size].reshape(a.shape)
    start = data.draw(st.integers(0, a.size - 1), label="alias offset")
    return name, buf[start:start + size].reshape(shape)


def snapshot(args):
    return {n: (None if a is None or isinstance(a, float) else np.array(a, copy=True)) for n, a in args.items()}


def assert_unchanged(before, args, skip=()):
    for n, a in before.items():
        if a is not None and n not in skip:
            assert np.array_equal(np.asarray(args[n]), a, equal_nan=a.dtype.kind in "fc"), f"{n} was modified"


def close(got, want, dt):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    tol = TOL.get(np.dtype(dt), 1e-4)
    scale = max(1.0, float(np.abs(want).max())) if want.size else 1.0
    return got.shape == want.shape and bool(np.all(np.abs(got - want) <= tol * scale + tol * np.abs(want)))


def outcome(fn, bad, func):
    """Run ``fn``; an error must be a TypeError/ValueError naming ``bad`` (or one naming an
    argument when the case made none wrong: a shape limit). Returns the result or None."""
    try:
        return fn()
    except (TypeError, ValueError) as e:
        COUNTS[f"{func}: error" + ("" if bad is not None else " (no argument made wrong)")] += 1
        if bad is not None:
            assert bad in str(e), f"{type(e).__name__} does not name {bad!r}: {e}"
        return None


def expected_dtype(args):
    return np.result_type(*(args[n].dtype for n in ("q", "k", "v")), np.float32)


@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_race_attention(data):
    args, beta, causal, bad = draw_case(data)
    dt = expected_dtype(args) if bad in (None, "beta") else None
    alias, out = overlapping_out(data, args, args["q"].shape[:-1] + (args["v"].shape[-1],), dt) \
        if dt is not None else (None, None)
    if alias is not None and bad is None:
        bad = "out"
    before = snapshot(args)
    got = outcome(lambda: racecpu.race_attention(args["q"], args["k"], args["v"], args["planes"], beta,
                                                 causal=causal, key_mask=args["key_mask"], out=out),
                  bad, "race_attention")
    assert_unchanged(before, args)
    if got is None:
        return
    want = R.race_attention_dense(*(np.asarray(args[n], np.float64) for n in ("q", "k", "v", "planes")), beta,
                                  causal=causal, key_mask=args["key_mask"])
    ok = close(got, want, got.dtype)
    COUNTS["race_attention: " + ("correct" if ok else "wrong")] += 1
    assert ok, f"differs from the reference (bad={bad})"


@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_fwd_bwd(data):
    args, beta, causal, bad = draw_case(data)
    before = snapshot(args)
    r = outcome(lambda: racecpu.race_attention_fwd(args["q"], args["k"], args["v"], args["planes"], beta,
                                                   causal=causal, key_mask=args["key_mask"]), bad, "fwd")
    assert_unchanged(before, args)
    if r is None:
        return
    out, res = r
    g = np.random.default_rng(1).standard_normal(out.shape).astype(out.dtype)
    gargs = {"grad_out": g}
    shapes = [args[n].shape for n in ("q", "k", "v")]
    dts = [args[n].dtype for n in ("q", "k", "v")]
    bufs, gbad = None, None
    how = data.draw(st.sampled_from(["none", "fresh", "grad_out", "each other"]), label="bwd out")
    sizes = [int(np.prod(s)) for s in shapes]
    if how == "fresh":
        bufs = tuple(np.zeros(s, t) for s, t in zip(shapes, dts))
    elif how == "grad_out" and g.size and sizes[0] and dts[0] == g.dtype:
        buf = np.zeros(g.size + sizes[0], g.dtype)
        buf[:g.size] = g.reshape(-1)
        gargs["grad_out"] = buf[:g.size].reshape(g.shape)
        bufs = (buf[g.size // 2:g.size // 2 + sizes[0]].reshape(shapes[0]),) + tuple(
            np.zeros(s, t) for s, t in zip(shapes[1:], dts[1:]))
        gbad = "out"
    elif how == "each other" and sizes[0] and sizes[1] and dts[0] == dts[1]:
        buf = np.zeros(sizes[0] + sizes[1], dts[0])
        bufs = (buf[:sizes[0]].reshape(shapes[0]), buf[sizes[0] - 1:sizes[0] - 1 + sizes[1]].reshape(shapes[1]),
                np.zeros(shapes[2], dts[2]))
        gbad = "out"
    gbefore = snapshot(gargs)
    got = outcome(lambda: racecpu.race_attention_bwd(res, gargs["grad_out"], out=bufs), gbad, "bwd")
    assert_unchanged(gbefore, gargs)
    assert_unchanged(before, args)
    want_out, wres = R.race_attention_dense_fwd(*(np.asarray(args[n], np.float64) for n in ("q", "k", "v", "planes")),
                                                beta, causal=causal, key_mask=args["key_mask"])
    ok = close(out, want_out, out.dtype)
    if got is not None:
        want = R.race_attention_dense_bwd(wres, np.asarray(g, np.float64))
        ok = ok and all(close(a, b, a.dtype) for a, b in zip(got[:3], want[:3]))
        # dbeta sums over every element: compare relative to the sum of magnitudes it adds up
        ok = ok and abs(got[3] - want[3]) <= TOL.get(np.dtype(out.dtype), 1e-4) * max(1.0, abs(want[3])) * 10
    COUNTS["fwd/bwd: " + ("correct" if ok else "wrong")] += 1
    assert ok, f"differs from the reference (bad={bad}, bwd out={how})"


@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_soft_buckets(data):
    args, beta, _, bad = draw_case(data, with_mask=False)
    if bad in ("k", "v"):
        bad = None
    before = snapshot(args)
    got = outcome(lambda: racecpu.soft_buckets(args["q"], args["planes"], beta),
                  "x" if bad == "q" else bad, "soft_buckets")
    assert_unchanged(before, args)
    if got is None:
        return
    want, _ = R.soft_buckets_dense(np.asarray(args["q"], np.float64), np.asarray(args["planes"], np.float64), beta)
    ok = close(got, want, got.dtype)
    COUNTS["soft_buckets: " + ("correct" if ok else "wrong")] += 1
    assert ok, f"differs from the reference (bad={bad})"


@settings(max_examples=EXAMPLES, deadline=None)
@given(data=st.data())
def test_extreme_magnitudes(data):
    """Finite inputs of any magnitude up to their dtype's largest value (q, k, v and grad_out,
    each scaled by a drawn power of ten): the call either raises the documented ValueError naming
    the input that is too large, or returns finite results, equal to the float64 reference where
    that reference is finite (issue 58)."""
    args, beta, causal, _ = draw_case(data)
    if not (isinstance(beta, float) and beta > 0 and np.isfinite(beta)):
        beta = 1.0
    for name in ("q", "k", "v", "planes"):  # only magnitudes are wrong here
        args[name] = np.asarray(args[name], dtype=args[name].dtype if args[name].dtype.kind == "f" else np.float32)
    dt = np.result_type(*(args[n].dtype for n in ("q", "k", "v")))
    top = float(np.finfo(dt).max)
    scales = {n: top ** data.draw(st.floats(0, 1), label=f"{n} magnitude") for n in ("q", "k", "v", "g")}

    def scaled(a, s, dtype):  # a * s in dtype, the overflowing entries at dtype's largest value
        with np.errstate(over="ignore", invalid="ignore"):
            big = np.asarray(a, np.float64) * s
        return np.clip(np.nan_to_num(big), -np.finfo(dtype).max, np.finfo(dtype).max).astype(dtype)

    for n in ("q", "k", "v"):
        args[n] = scaled(args[n], scales[n], args[n].dtype)
    names = ("q", "k", "v", "grad_out")
    try:
        out, res = racecpu.race_attention_fwd(args["q"], args["k"], args["v"], args["planes"], beta, causal=causal,
                                              key_mask=args["key_mask"])
        g = scaled(np.random.default_rng(2).standard_normal(out.shape), scales["g"], out.dtype)
        got = racecpu.race_attention_bwd(res, g)
    except ValueError as e:
        assert any(f"{n} is too large" in str(e) for n in names) or "gradients overflow float16" in str(e), str(e)
        COUNTS["magnitudes: documented error"] += 1
        return
    results = (out,) + tuple(got[:3])
    assert all(np.isfinite(np.asarray(x, np.float64)).all() for x in results) and np.isfinite(got[3]), \
        "finite inputs gave a non-finite result without an error"
    want_out, wres = R.race_attention_dense_fwd(*(np.asarray(args[n], np.float64) for n in ("q", "k", "v", "planes")),
                                                beta, causal=causal, key_mask=args["key_mask"])
    want_dv = R.race_attention_dense_bwd(wres, np.asarray(g, np.float64))[2]
    # out (a convex combination of v's rows) and dv (of grad_out's) are compared on the scale of the
    # input they combine, which rounding errors follow when the combination cancels; dq and dk
    # subtract terms of size |g| |v| that cancel exactly when the exact gradient is small, so at these
    # magnitudes only their finiteness is asserted (test_fwd_bwd compares them at ordinary ones)
    for x, w, scale in ((out, want_out, args["v"]), (got[2], want_dv, g)):
        if np.isfinite(w).all() and w.size:
            tol = TOL.get(np.dtype(x.dtype), 1e-4)
            ref = max(1.0, float(np.abs(w).max()), float(np.abs(np.asarray(scale, np.float64)).max(initial=0)))
            assert np.abs(np.asarray(x, np.float64) - w).max() <= tol * ref, "differs from the reference"
    COUNTS["magnitudes: finite and correct"] += 1

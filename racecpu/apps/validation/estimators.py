"""Experiment -- the paper's ratio estimator against the per-bucket mean of the authors' released code.

Two estimators share one soft hash (``phi_l``, :func:`racecpu.reference.soft_buckets_dense`)
and the per-table sums ``A_lr = sum_j phi_l(k_j)_r``, ``B_lr = sum_j phi_l(k_j)_r v_j``:

ratio (the paper, Algorithms 1 and 2)
    ``O_i = sum_l phi_l(q_i).B_l / sum_l phi_l(q_i).A_l``; as L -> inf it tends to
    attention with the expected soft kernel, and as beta -> inf that kernel is
    the angular kernel ``(1 - theta/pi)^P`` (Theorem 1).
bucket mean (the released code, :func:`racecpu.reference.race_attention_bucket_mean`)
    ``O_i = sum_l sum_r phi_l(q_i)_r B_lr / (A_lr + eps)``, no 1/L, so it grows
    like L; ``O_i / L`` is an average over tables of one table's output
    ``T_l(q_i)``, and tends, as L -> inf, to ``E_W[T(q_i)]`` (the law of large
    numbers over i.i.d. tables), whatever beta.  Its limits in beta:

    * beta -> 0: every ``phi`` is uniform (``1/R``), ``T(q) = sum_r (1/R) (sum_j v_j / R) / (N/R + eps)``
      ``~ mean_j v_j``: uniform attention, ``O_i -> L mean(V)``, for every query alike.
    * beta -> inf: ``phi_l`` is the one-hot SimHash bucket, ``T_l(q)`` is the mean of
      the values of the keys in q's bucket of table l (0 if it is empty), and
      ``O_i / L -> E_W[mean of V over q's bucket]`` as L grows: attention with
      weights ``w_ij = E_W[1{h(q_i) = h(k_j)} / n(h(q_i))]`` (``n`` the bucket's
      key count) -- not the angular kernel, whose weights are ``p_ij / sum_j' p_ij'``
      with ``p_ij = P(h(q_i) = h(k_j)) = (1 - theta_ij/pi)^P``: a key in a
      crowded bucket weighs less.

What is measured, per data set (clustered, isotropic, near_duplicate of
:mod:`racecpu.validation.data`), input scaling (``unit``: q, k scaled to unit
norm, the setting of Theorem 1; ``raw``: as drawn, norms ~ sqrt(d), as the
released code feeds them), P, beta and L (prefixes of one draw of planes):
the per-token RMS error (normalised by the RMS value row, as in the theorem
experiment) of the ratio, of the bucket mean as computed and divided by L,
against exact angular attention (gamma = P), against softmax attention (raw
q, k, scale 1/sqrt(d)) and against ``mean(V)``; and, on the clustered data,
the bucket mean at beta = 1024 against the hard-SimHash bucket mean on the
same planes, and ``O/L`` against ``E_W[T]`` estimated with many hard tables.

Run ``python -m racecpu.validation.estimators [--quick] [--out DIR]``; writes
``estimators.csv``, ``estimators_limit.csv``, ``estimators.png`` and prints
a short table.  ``run`` has the signature of the other experiments.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import racecpu
from racecpu.hashing import DEN_FLOOR
from racecpu.reference import (angular_attention, race_attention_bucket_mean, race_attention_dense,
                               soft_buckets_dense, softmax_attention)

from .common import Claim, Result, fmt, pyplot, savefig, write_csv
from .data import make_qkv, unit_rows

__all__ = ["run", "table_terms", "hard_table_terms", "main"]

PRESETS = {
    "quick": dict(datasets=("clustered",), N=256, d=64, dv=64, Ps=(3,), betas=(0.125, 1, 16, 1024),
                  Ls=(1, 4, 16, 32), seeds=1, limit_tables=256, limit_Ls=(1, 4, 16, 64, 256), bias_Ls=(1, 2, 4, 8),
                  bias_tables=8192, bias_queries=128, Ns=(128, 256, 512), n_beta=16.0, n_L=16),
    "full": dict(datasets=("clustered", "isotropic", "near_duplicate"), N=512, d=64, dv=64, Ps=(2, 3, 4),
                 betas=(0.125, 1, 4, 16, 64, 256, 1024), Ls=(1, 2, 4, 8, 16, 32), seeds=2,
                 limit_tables=2048, limit_Ls=(1, 4, 16, 64, 256, 1024), bias_Ls=(1, 2, 4, 8, 16, 32),
                 bias_tables=65536, bias_queries=256, Ns=(128, 256, 512, 1024, 2048), n_beta=16.0, n_L=32),
}
EPS = 1e-6


# ---------------------------------------------------------------------------
# per-table terms: every L from one pass
# ---------------------------------------------------------------------------

def table_terms(q, k, v, planes, beta, eps=EPS):
    """Per-table terms of both estimators (non-causal).

    Parameters
    ----------
    q : ndarray, shape (N, d), float64
    k : ndarray, shape (M, d)
    v : ndarray, shape (M, dv)
    planes : ndarray, shape (L, P, d)
    beta, eps : float

    Returns
    -------
    num : ndarray, shape (L, N, dv)
        ``phi_l(q_i).B_l``.
    den : ndarray, shape (L, N)
        ``phi_l(q_i).A_l``.
    bm : ndarray, shape (L, N, dv)
        ``sum_r phi_l(q_i)_r B_lr / (A_lr + eps)``.

    The ratio with the first L tables is ``num[:L].sum(0) / den[:L].sum(0)``,
    the bucket mean ``bm[:L].sum(0)``.
    """
    pq, _ = soft_buckets_dense(q, planes, beta)         # (N, L, R)
    pk, _ = soft_buckets_dense(k, planes, beta)
    A = pk.sum(0)                                        # (L, R)
    B = np.einsum("jlr,jc->lrc", pk, v)                  # (L, R, dv)
    num = np.einsum("ilr,lrc->lic", pq, B)
    den = np.einsum("ilr,lr->li", pq, A)
    bm = np.einsum("ilr,lrc->lic", pq, B / (A[..., None] + eps))
    return num, den, bm


def hard_table_terms(q, k, v, planes, chunk=256):
    """Per-table hard-SimHash terms (the beta -> inf limit), in chunks of tables.

    Returns
    -------
    bm : ndarray, shape (L, N, dv)
        Mean of the values of the keys in q_i's bucket of table l (0 if empty).
    num : ndarray, shape (L, N, dv)
        Sum of those values (the ratio's numerator term).
    cnt : ndarray, shape (L, N)
        Their number (the ratio's denominator term).
    """
    L, P, _ = planes.shape
    R = 2 ** P
    weights = 2 ** np.arange(P - 1, -1, -1)              # corners() order: plane 0 is the top bit
    bms, nums, cnts = [], [], []
    for s in range(0, L, chunk):
        W = planes[s:s + chunk]
        hq = (np.einsum("nd,lpd->lnp", q, W) > 0) @ weights   # (l, Nq) bucket ids
        hk = (np.einsum("nd,lpd->lnp", k, W) > 0) @ weights   # (l, Nk)
        onehot = (hk[:, None, :] == np.arange(R)[None, :, None]).astype(np.float64)  # (l, R, Nk)
        total = onehot @ v                                  # (l, R, dv): each bucket's sum of values
        count = onehot.sum(-1)                              # (l, R)
        num = np.take_along_axis(total, hq[:, :, None], 1)  # (l, Nq, dv): the query's bucket's
        cnt = np.take_along_axis(count, hq, 1)              # (l, Nq)
        bms.append(num / np.maximum(cnt, 1)[..., None])
        nums.append(num)
        cnts.append(cnt)
    return np.concatenate(bms), np.concatenate(nums), np.concatenate(cnts)


def _guarded(num, den):
    """``num / den`` row-wise, zeros where ``den <= DEN_FLOOR`` (no key in any of q's buckets), as racecpu does."""
    ok = den > DEN_FLOOR
    return np.where(ok[:, None], num / np.where(ok, den, 1)[:, None], 0.0)


def _rms(a, b, v):
    """Per-token RMS error normalised by the RMS value row ``||V||_F / sqrt(N)``."""
    scale = np.sqrt(np.mean(np.sum(v * v, -1)))
    return float(np.sqrt(np.mean(np.sum((a - b) ** 2, -1))) / scale)


def _slope(x, y):
    return float(np.polyfit(np.log(x), np.log(y), 1)[0])


# ---------------------------------------------------------------------------
# the experiment
# ---------------------------------------------------------------------------

def _self_check(q, k, v, planes, beta):
    """The per-table terms reproduce the two reference oracles (guards the sweep's algebra)."""
    num, den, bm = table_terms(q, k, v, planes, beta)
    L = planes.shape[0]
    r = _guarded(num.sum(0), den.sum(0))
    e1 = np.abs(r - race_attention_dense(q, k, v, planes, beta)).max()
    e2 = np.abs(bm.sum(0) - race_attention_bucket_mean(q, k, v, planes, beta, eps=EPS)).max()
    if max(e1, e2) > 1e-9 * L:
        raise AssertionError(f"per-table terms disagree with the references: {e1:.3g}, {e2:.3g}")


def run(mode="quick", seed=0, out_dir=".", show_progress=False, datasets=None):
    """Run the sweep and the limit checks; returns a :class:`Result` (tables, figure, claims, values)."""
    cfg = PRESETS[mode]
    names = tuple(datasets) if datasets else cfg["datasets"]
    N, d, dv, Ls = cfg["N"], cfg["d"], cfg["dv"], np.array(cfg["Ls"])
    t0 = time.perf_counter()
    rows = []
    for name in names:
        for s in range(cfg["seeds"]):
            try:
                q_raw, k_raw, v = make_qkv(name, N, d, dv, [seed, 43, s])
            except ValueError:  # a file with fewer than N tokens: skipped, as the other experiments do
                continue
            dd = q_raw.shape[1]  # a file of a trained model's q, k, v has its own head dim
            soft = softmax_attention(q_raw, k_raw, v)
            mean_v = np.broadcast_to(v.mean(0), v.shape)
            for inputs in ("unit", "raw"):
                q, k = (unit_rows(q_raw), unit_rows(k_raw)) if inputs == "unit" else (q_raw, k_raw)
                for P in cfg["Ps"]:
                    ang = angular_attention(q, k, v, P)
                    planes = racecpu.hyperplanes(dd, P, int(Ls.max()), seed=[seed, 43, s, P], dtype=np.float64)
                    if s == 0 and inputs == "unit":
                        _self_check(q[:32], k[:48], v[:48], planes[:3], 2.0)
                    for beta in cfg["betas"]:
                        num, den, bm = table_terms(q, k, v, planes, beta)
                        cn, cd, cb = np.cumsum(num, 0), np.cumsum(den, 0), np.cumsum(bm, 0)
                        for L in Ls:
                            ratio = _guarded(cn[L - 1], cd[L - 1])
                            b = cb[L - 1]
                            rows.append(dict(
                                dataset=name, seed=s, inputs=inputs, P=P, beta=float(beta), L=int(L),
                                ratio_vs_angular=_rms(ratio, ang, v), ratio_vs_softmax=_rms(ratio, soft, v),
                                bm_vs_angular=_rms(b, ang, v), bmL_vs_angular=_rms(b / L, ang, v),
                                bmL_vs_softmax=_rms(b / L, soft, v), bmL_vs_meanV=_rms(b / L, mean_v, v),
                                ratio_vs_meanV=_rms(ratio, mean_v, v), angular_vs_meanV=_rms(ang, mean_v, v),
                                softmax_vs_meanV=_rms(soft, mean_v, v), angular_vs_softmax=_rms(ang, soft, v)))
    rows = _average_seeds(rows)
    limit_rows, values = _limits(cfg, seed)
    values["n_sweep"] = _n_sweep(cfg, seed)
    values["sweep_seconds"] = time.perf_counter() - t0
    claims = _claims(rows, limit_rows, values, cfg)
    fig = _plot(rows, limit_rows, cfg, out_dir)
    return Result(name="estimators", title="The paper's ratio against the released code's per-bucket mean",
                  tables={"estimators.csv": rows, "estimators_limit.csv": limit_rows}, figures=[fig],
                  claims=claims, markdown=_table_md(rows, cfg) + "\n\n" + _bias_md(values["ratio_bias"]), values=values,
                  seconds=time.perf_counter() - t0)


def _average_seeds(rows):
    keys = ("dataset", "inputs", "P", "beta", "L")
    groups = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    out = []
    for key, rs in groups.items():
        row = dict(zip(keys, key))
        row["seeds"] = len(rs)
        for m in rs[0]:
            if m not in keys and m != "seed":
                row[m] = float(np.mean([r[m] for r in rs]))
        out.append(row)
    return out


def _limits(cfg, seed):
    """Clustered data, unit rows, P = 3: beta -> inf at fixed planes, and L -> inf of both estimators."""
    N, d, dv, P = cfg["N"], cfg["d"], cfg["dv"], 3
    q_raw, k_raw, v = make_qkv("clustered", N, d, dv, [seed, 43, 0])
    q, k = unit_rows(q_raw), unit_rows(k_raw)
    ang = angular_attention(q, k, v, P)
    values = {}
    # (1) beta -> inf: the soft bucket mean at fixed planes against the hard SimHash bucket mean.
    planes = racecpu.hyperplanes(d, P, 32, seed=[seed, 43, 0, P], dtype=np.float64)
    hard_bm, _, _ = hard_table_terms(q, k, v, planes)
    gap = {}
    for beta in (16.0, 64.0, 256.0, 1024.0, 4096.0):
        _, _, bm = table_terms(q, k, v, planes, beta)
        gap[beta] = _rms(bm.sum(0) / 32, hard_bm.sum(0) / 32, v)
    values["soft_vs_hard_bm"] = gap
    # (2) L -> inf with hard tables: O/L against E_W[T] (estimated with all the tables), the ratio against angular.
    T = cfg["limit_tables"]
    big = racecpu.hyperplanes(d, P, T, seed=[seed, 43, 1, P], dtype=np.float64)
    bm, num, cnt = hard_table_terms(q, k, v, big)
    half = T // 2      # the limit is estimated on the second half, the L-prefixes come from the first
    limit = bm[half:].mean(0)
    values["limit_vs_angular"] = _rms(limit, ang, v)
    values["limit_vs_meanV"] = _rms(limit, np.broadcast_to(v.mean(0), v.shape), v)
    values["angular_vs_meanV"] = _rms(ang, np.broadcast_to(v.mean(0), v.shape), v)
    values["empty_bucket_fraction"] = float((cnt == 0).mean())
    # the limit weights, to compare with the angular weights: w_ij = E[1{same bucket}/n]
    limit_rows = []
    cb, cn, cc = np.cumsum(bm[:half], 0), np.cumsum(num[:half], 0), np.cumsum(cnt[:half], 0)
    for L in cfg["limit_Ls"]:
        if L > half:
            continue
        ratio = _guarded(cn[L - 1], cc[L - 1])
        limit_rows.append(dict(dataset="clustered", inputs="unit", P=P, beta="inf", L=int(L),
                               bmL_vs_limit=_rms(cb[L - 1] / L, limit, v), bmL_vs_angular=_rms(cb[L - 1] / L, ang, v),
                               ratio_vs_angular=_rms(ratio, ang, v)))
    # (3) is the ratio biased at finite L?  Its mean over many disjoint blocks of L tables against angular
    # attention, less the Monte Carlo noise of that mean (first bias_queries queries, every key).
    values["ratio_bias"] = _ratio_bias(q, k, v, ang, P, cfg, [seed, 43, 2, P])
    # Monte Carlo error of the limit itself: one table's RMS spread over sqrt(number of tables averaged)
    values["limit_noise"] = limit_rows[0]["bmL_vs_limit"] / np.sqrt(T - half)
    values["limit_bias_vs_angular"] = float(np.sqrt(max(values["limit_vs_angular"] ** 2 - values["limit_noise"] ** 2,
                                                        0.0)))
    values["limit_tables"] = T - half
    return limit_rows, values


def _n_sweep(cfg, seed):
    """Both estimators against angular attention as N grows (clustered, unit q/k, P = 3, one beta and L)."""
    P, beta, L = 3, cfg["n_beta"], cfg["n_L"]
    rows = []
    for N in cfg["Ns"]:
        q_raw, k_raw, v = make_qkv("clustered", N, cfg["d"], cfg["dv"], [seed, 43, 3, N])
        q, k = unit_rows(q_raw), unit_rows(k_raw)
        ang = angular_attention(q, k, v, P)
        planes = racecpu.hyperplanes(cfg["d"], P, L, seed=[seed, 43, 3, N, P], dtype=np.float64)
        num, den, bm = table_terms(q, k, v, planes, beta)
        rows.append(dict(N=int(N), ratio_vs_angular=_rms(_guarded(num.sum(0), den.sum(0)), ang, v),
                         bmL_vs_angular=_rms(bm.sum(0) / L, ang, v)))
    return rows


def _ratio_bias(q, k, v, ang, P, cfg, seed, chunk=512):
    """Bias of the paper's ratio with L hard SimHash tables, for each L of ``cfg["bias_Ls"]``.

    ``cfg["bias_tables"]`` tables are drawn and cut into disjoint blocks of L;
    each block gives one draw of the ratio ``sum_l num_l / sum_l cnt_l``
    (zeros where no key shares a bucket with the query).  The mean over the
    blocks estimates ``E[ratio]``; its RMS distance to angular attention has
    the Monte Carlo noise ``spread / sqrt(blocks)`` removed in quadrature.
    Tables are streamed ``chunk`` at a time (a multiple of every L).
    """
    nq = min(cfg["bias_queries"], len(q))
    qs, target = q[:nq], ang[:nq]
    d, dv = q.shape[1], v.shape[1]
    Ls = cfg["bias_Ls"]
    T = cfg["bias_tables"] - cfg["bias_tables"] % chunk
    acc = {L: [np.zeros((nq, dv)), np.zeros((nq, dv)), 0] for L in Ls}   # sum, sum of squares, blocks
    rng = np.random.default_rng(seed)
    for _ in range(T // chunk):
        _, num, cnt = hard_table_terms(qs, k, v, rng.standard_normal((chunk, P, d)), chunk=chunk)
        for L in Ls:
            nb = chunk // L
            bn = num.reshape(nb, L, nq, dv).sum(1)
            bc = cnt.reshape(nb, L, nq).sum(1)
            r = np.where(bc[..., None] > 0, bn / np.maximum(bc, 1)[..., None], 0.0)
            a = acc[L]
            a[0] += r.sum(0)
            a[1] += (r * r).sum(0)
            a[2] += nb
    scale = np.sqrt(np.mean(np.sum(v * v, -1)))
    rows = []
    for L in Ls:
        s1, s2, nb = acc[L]
        mean = s1 / nb
        var = np.maximum(s2 / nb - mean ** 2, 0.0) * nb / (nb - 1)
        noise = float(np.sqrt(np.mean(np.sum(var, -1)) / nb) / scale)
        err = float(np.sqrt(np.mean(np.sum((mean - target) ** 2, -1))) / scale)
        rows.append(dict(L=int(L), blocks=int(nb), mean_vs_angular=err, noise=noise,
                         bias=float(np.sqrt(max(err ** 2 - noise ** 2, 0.0))),
                         spread=float(np.sqrt(np.mean(np.sum(var, -1))) / scale)))
    return rows


def _pick(rows, **kw):
    return [r for r in rows if all(r[k] == v for k, v in kw.items())]


def _claims(rows, limit_rows, values, cfg):
    claims = []
    b0 = min(cfg["betas"])
    sel = _pick(rows, dataset="clustered", inputs="raw", P=3 if 3 in cfg["Ps"] else cfg["Ps"][0], beta=b0)
    if sel:
        r = max(sel, key=lambda r: r["L"])
        claims.append(Claim("E1", f"at beta = {b0} (1/sqrt(d)) and raw q, k the bucket mean divided by L is close "
                                  "to mean(V), far closer than angular attention is (uniform attention)",
                            r["bmL_vs_meanV"] < 0.25 * r["angular_vs_meanV"],
                            f"RMS(O/L - mean V) = {fmt(r['bmL_vs_meanV'])}, RMS(angular - mean V) = "
                            f"{fmt(r['angular_vs_meanV'])} (clustered, L = {r['L']}, P = {r['P']})"))
    gap = values["soft_vs_hard_bm"]
    bs = sorted(gap)
    claims.append(Claim("E2", "as beta grows the bucket mean (planes fixed) tends to the sum over tables of the "
                              "hard-SimHash bucket means", gap[bs[-1]] < 0.05 and gap[bs[-1]] < gap[bs[0]],
                        ", ".join(f"beta {b:g}: {fmt(gap[b])}" for b in bs) + " (RMS of O/L, clustered, unit, P=3)"))
    Ls = np.array([r["L"] for r in limit_rows])
    e = np.array([r["bmL_vs_limit"] for r in limit_rows])
    sl = _slope(Ls, e)
    claims.append(Claim("E3", "as L grows O/L converges to E_W[T] (law of large numbers: slope -1/2 in L)",
                        -0.65 < sl < -0.35, f"log-log slope {sl:.3f}; RMS at L = {Ls[0]}..{Ls[-1]}: "
                        + ", ".join(fmt(x) for x in e)))
    claims.append(Claim("E4", "that limit (beta -> inf) is not angular attention: the bucket mean is a biased estimate "
                              "of it (beyond the Monte Carlo noise of the limit)",
                        True if values["limit_vs_angular"] > 2 * values["limit_noise"] else None,  # else: too noisy
                        f"RMS(E_W[T] - angular) = {fmt(values['limit_vs_angular'])} with E_W[T] from "
                        f"{values['limit_tables']} tables (noise ~{fmt(values['limit_noise'])}, so bias "
                        f"~{fmt(values['limit_bias_vs_angular'])}); RMS(angular - mean V) = "
                        f"{fmt(values['angular_vs_meanV'])}; (query, table) pairs with an empty bucket: "
                        f"{fmt(values['empty_bucket_fraction'])}"))
    er = np.array([r["ratio_vs_angular"] for r in limit_rows])
    sr = _slope(Ls, er)
    claims.append(Claim("E5", "the paper's ratio converges to angular attention as L grows (beta -> inf): "
                              "slope -1/2 in L, no floor visible",
                        -0.65 < sr < -0.35, f"log-log slope {sr:.3f}; RMS at L = {Ls[0]}..{Ls[-1]}: "
                        + ", ".join(fmt(x) for x in er)))
    br = values["ratio_bias"]
    ok = [r for r in br if r["bias"] > 2 * r["noise"]]
    sb = _slope([r["L"] for r in ok], [r["bias"] for r in ok]) if len(ok) > 1 else float("nan")
    claims.append(Claim("E7", "the paper's ratio is a biased estimate of angular attention at finite L (a ratio of "
                              "two unbiased sums), its bias falling like 1/L, faster than its 1/sqrt(L) spread, so "
                              "it is consistent",
                        bool(ok and ok[0]["L"] == br[0]["L"] and -1.4 < sb < -0.7) if len(ok) > 1 else None,
                        f"bias (RMS of the mean over blocks of L hard tables - angular, Monte Carlo noise removed) "
                        f"at L = {', '.join(str(r['L']) for r in br)}: {', '.join(fmt(r['bias']) for r in br)} "
                        f"(noise {', '.join(fmt(r['noise']) for r in br)}), log-log slope {sb:.2f} over the L where "
                        f"it exceeds twice the noise; spread of one draw {', '.join(fmt(r['spread']) for r in br)}"))
    ns = values["n_sweep"]
    x = [r["N"] for r in ns]
    claims.append(Claim("E9", f"both estimators' error against angular attention as N grows (clustered, unit q/k, "
                              f"P = 3, beta = {cfg['n_beta']:g}, L = {cfg['n_L']})", None,
                        f"N = {', '.join(map(str, x))}: ratio {', '.join(fmt(r['ratio_vs_angular']) for r in ns)} "
                        f"(log-log slope {_slope(x, [r['ratio_vs_angular'] for r in ns]):+.2f}), bucket mean / L "
                        f"{', '.join(fmt(r['bmL_vs_angular']) for r in ns)} (slope "
                        f"{_slope(x, [r['bmL_vs_angular'] for r in ns]):+.2f})"))
    P = 3 if 3 in cfg["Ps"] else cfg["Ps"][0]
    sel = sorted(_pick(rows, dataset="clustered", inputs="unit", P=P, L=max(cfg["Ls"])), key=lambda r: r["beta"])
    small = [r for r in sel if r["beta"] <= 4]  # before the variance floor of L tables
    if len(small) > 1:
        b = [r["beta"] for r in small]
        claims.append(Claim("E10", f"slopes in beta of the error against angular attention for beta <= 4 (before the "
                                   f"floor of L = {max(cfg['Ls'])} tables; clustered, unit, P = {P})", None,
                            f"ratio {_slope(b, [r['ratio_vs_angular'] for r in small]):+.3f}, bucket mean / L "
                            f"{_slope(b, [r['bmL_vs_angular'] for r in small]):+.3f} over beta = "
                            + ", ".join(fmt(x) for x in b)))
    sel = sorted(_pick(rows, dataset="clustered", inputs="unit", P=P, beta=max(cfg["betas"])), key=lambda r: r["L"])
    if len(sel) > 1:
        x = [r["L"] for r in sel]
        s1, s2 = _slope(x, [r["ratio_vs_angular"] for r in sel]), _slope(x, [r["bmL_vs_angular"] for r in sel])
        claims.append(Claim("E6", f"slopes in L of the error against angular attention, soft hash at beta = "
                                  f"{max(cfg['betas']):g}, L = {x[0]}..{x[-1]} (clustered, unit, P = {P})", None,
                            f"ratio {s1:.3f}, bucket mean / L {s2:.3f}"))
    for name in sorted({r["dataset"] for r in rows} - {"clustered", "isotropic", "near_duplicate"}):
        sel = _pick(rows, dataset=name, inputs="raw", P=P, L=max(cfg["Ls"]))
        if not sel:
            continue
        best = {m: min(sel, key=lambda r: r[m]) for m in ("ratio_vs_angular", "bmL_vs_angular", "ratio_vs_softmax",
                                                          "bmL_vs_softmax")}
        claims.append(Claim("E8", f"{name} (a trained model's q, k, v, as its attention read them): both "
                                  f"estimators at their best beta, L = {max(cfg['Ls'])}, P = {P}", None,
                            f"against angular: ratio {fmt(best['ratio_vs_angular']['ratio_vs_angular'])} (beta "
                            f"{fmt(best['ratio_vs_angular']['beta'])}), bucket mean / L "
                            f"{fmt(best['bmL_vs_angular']['bmL_vs_angular'])} (beta "
                            f"{fmt(best['bmL_vs_angular']['beta'])}); against softmax: ratio "
                            f"{fmt(best['ratio_vs_softmax']['ratio_vs_softmax'])}, bucket mean / L "
                            f"{fmt(best['bmL_vs_softmax']['bmL_vs_softmax'])}; angular vs mean V "
                            f"{fmt(sel[0]['angular_vs_meanV'])}, softmax vs mean V {fmt(sel[0]['softmax_vs_meanV'])}"))
    return claims


def _table_md(rows, cfg):
    P = 3 if 3 in cfg["Ps"] else cfg["Ps"][0]
    L = max(cfg["Ls"])
    lines = []
    files = sorted({r["dataset"] for r in rows} - {"clustered", "isotropic", "near_duplicate"})
    for name, inputs in [("clustered", "unit"), ("clustered", "raw")] + [(f, "raw") for f in files]:
        lines += [f"{name}, {inputs} q/k, P = {P}, L = {L}, N = {cfg['N']}"
                  + (f", d = {cfg['d']}" if name == "clustered" else " (the file's head dims)")
                  + " (per-token RMS error / RMS value row)", "",
                  "| beta | ratio-ang | ratio-soft | O/L-ang | O/L-soft | O/L-meanV | O-ang (no 1/L) | ang-meanV | "
                  "soft-meanV |", "|" + "---|" * 9]
        for r in sorted(_pick(rows, dataset=name, inputs=inputs, P=P, L=L), key=lambda r: r["beta"]):
            lines.append("| " + " | ".join(fmt(x) for x in (
                r["beta"], r["ratio_vs_angular"], r["ratio_vs_softmax"], r["bmL_vs_angular"], r["bmL_vs_softmax"],
                r["bmL_vs_meanV"], r["bm_vs_angular"], r["angular_vs_meanV"], r["softmax_vs_meanV"])) + " |")
        lines.append("")
    return "\n".join(lines)


def _bias_md(bias_rows):
    lines = ["Is the paper's ratio biased?  Its mean over disjoint blocks of L hard SimHash tables (beta -> inf) "
             "against angular attention (clustered, unit q/k, P = 3; RMS / RMS value row):", "",
             "| L | blocks | RMS(mean - angular) | Monte Carlo noise | bias (noise removed) | spread of one draw |",
             "|---|---|---|---|---|---|"]
    for r in bias_rows:
        lines.append("| " + " | ".join(fmt(r[m]) for m in ("L", "blocks", "mean_vs_angular", "noise", "bias",
                                                            "spread")) + " |")
    return "\n".join(lines + [""])


def _plot(rows, limit_rows, cfg, out_dir):
    plt = pyplot()
    P = 3 if 3 in cfg["Ps"] else cfg["Ps"][0]
    L = max(cfg["Ls"])
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
    for inputs, ls in (("unit", "-"), ("raw", "--")):
        sel = sorted(_pick(rows, dataset="clustered", inputs=inputs, P=P, L=L), key=lambda r: r["beta"])
        b = [r["beta"] for r in sel]
        ax[0].plot(b, [r["ratio_vs_angular"] for r in sel], "C0" + ls, marker="o", label=f"ratio ({inputs})")
        ax[0].plot(b, [r["bmL_vs_angular"] for r in sel], "C1" + ls, marker="s", label=f"bucket mean / L ({inputs})")
        ax[0].plot(b, [r["angular_vs_meanV"] for r in sel], "C7" + ls, label=f"mean V ({inputs})")
        ax[1].plot(b, [r["ratio_vs_softmax"] for r in sel], "C0" + ls, marker="o", label=f"ratio ({inputs})")
        ax[1].plot(b, [r["bmL_vs_softmax"] for r in sel], "C1" + ls, marker="s", label=f"bucket mean / L ({inputs})")
        ax[1].plot(b, [r["softmax_vs_meanV"] for r in sel], "C7" + ls, label="mean V")
    for a, t in ((ax[0], "vs angular (gamma = P)"), (ax[1], "vs softmax")):
        a.set_xscale("log")
        a.set_xlabel("beta")
        a.set_ylabel("RMS error / RMS value")
        a.set_title(f"clustered, P = {P}, L = {L}: {t}")
        a.legend()
    Ls = [r["L"] for r in limit_rows]
    ax[2].loglog(Ls, [r["ratio_vs_angular"] for r in limit_rows], "C0-o", label="ratio vs angular")
    ax[2].loglog(Ls, [r["bmL_vs_angular"] for r in limit_rows], "C1-s", label="bucket mean / L vs angular")
    ax[2].loglog(Ls, [r["bmL_vs_limit"] for r in limit_rows], "C2-^", label="bucket mean / L vs E_W[T]")
    ax[2].set_xlabel("L (hard SimHash tables, beta = inf)")
    ax[2].set_title("clustered, unit q/k, P = 3")
    ax[2].legend()
    return savefig(fig, out_dir, "estimators.png")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m racecpu.validation.estimators", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one data set, P = 3, N = 256, four betas")
    p.add_argument("--out", default="racecpu-validation", metavar="DIR")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--datasets", default=None, help="comma-separated data set names")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    res = run("quick" if args.quick else "full", seed=args.seed, out_dir=args.out,
              datasets=args.datasets.split(",") if args.datasets else None)
    for fname, rows in res.tables.items():
        write_csv(os.path.join(args.out, fname), rows)
    print(res.markdown)
    for c in res.claims:
        print(c.line())
    print(f"wrote {', '.join(list(res.tables) + res.figures)} to {os.path.abspath(args.out)} "
          f"in {res.seconds:.1f} s")
    return 0 if all(c.holds is not False for c in res.claims) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Experiment 1 -- kernel level: one table's soft RACE kernel against the angular kernel.

For unit ``q`` and ``k`` at angle ``theta`` (``theta`` from 0 to pi), and many
independent tables drawn with :func:`racecpu.hyperplanes`, the per-table
kernel ``phi(q) . phi(k)`` (from :func:`racecpu.soft_buckets`) is averaged over
the planes (Monte Carlo) and compared with

* the target ``(1 - theta/pi) ** P`` (the SimHash collision probability),
* its exact expectation ``f(theta, beta) ** P`` by quadrature
  (:func:`racecpu.apps.validation.theory.expected_kernel`), an independent check of
  both computations,
* the paper's bias bound ``4P / (sqrt(2 pi) beta) (+ 2P e^{-2 tanh(1) beta})``.

The bias is estimated with the hard SimHash indicator of the same planes as a
control variate: ``E[soft - hard] = E[soft] - (1 - theta/pi)^P`` exactly, and
``soft - hard`` has a far smaller variance than ``soft``.  Plane batches play
the role of seeds for the bootstrap.  Finally the variance of the L-table
average ``(1/L) sum_l phi_l(q) . phi_l(k)`` is measured against ``1/L``.
"""

from __future__ import annotations

import numpy as np

import racecpu

from .common import Claim, Result, fmt, progress, pyplot, savefig
from .stats import bootstrap_fit, loglog_fit
from .theory import bias_bound, expected_kernel

PRESETS = {
    "quick": dict(planes=(1, 3), betas=(1, 2, 4, 8, 16, 32, 64, 128), batches=6, tables=2000,
                  n_theta=13, var_beta=8.0, var_planes=3, var_theta=np.pi / 3, var_L=(1, 2, 4, 8, 16, 32)),
    "full": dict(planes=(1, 2, 3, 4), betas=(0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), batches=16,
                 tables=12500, n_theta=37, var_beta=8.0, var_planes=3, var_theta=np.pi / 3,
                 var_L=(1, 2, 4, 8, 16, 32, 64, 128)),
}
FIT_MIN_BETA = 4.0   # the 1/beta regime; below it the soft hash is close to uniform
D = 8                # any d >= 2 gives the same distribution of (w.q, w.k)


def _pair_vectors(thetas):
    q = np.zeros((1, D))
    q[0, 0] = 1.0
    k = np.zeros((thetas.size, D))
    k[:, 0], k[:, 1] = np.cos(thetas), np.sin(thetas)
    return q, k


def _per_table(q, k, planes, beta):
    """Soft per-table kernel (n_theta, tables) and hard SimHash collision indicator."""
    pq = racecpu.soft_buckets(q, planes, beta)[0]           # (T, R)
    pk = racecpu.soft_buckets(k, planes, beta)              # (n, T, R)
    soft = np.einsum("tr,ntr->nt", pq, pk)
    sq = np.einsum("tpd,d->tp", planes, q[0]) > 0            # (T, P)
    sk = np.einsum("tpd,nd->ntp", planes, k) > 0             # (n, T, P)
    hard = np.all(sk == sq[None], axis=-1).astype(np.float64)
    return soft, hard


def run(mode="quick", seed=0, out_dir=".", show_progress=False):
    cfg = PRESETS[mode]
    thetas = np.linspace(0.0, np.pi, cfg["n_theta"])
    q, k = _pair_vectors(thetas)
    betas = np.asarray(cfg["betas"], dtype=np.float64)
    Ps, nb, T = cfg["planes"], cfg["batches"], cfg["tables"]
    Ls = np.asarray(cfg["var_L"])
    # per batch: mean soft kernel, mean (soft - hard), mean soft^2
    soft_m = np.zeros((len(Ps), nb, betas.size, thetas.size))
    diff_m = np.zeros_like(soft_m)
    soft_sq = np.zeros_like(soft_m)
    diff_sq = np.zeros_like(soft_m)
    var_L = np.zeros((nb, Ls.size))
    kv = _pair_vectors(np.array([cfg["var_theta"]]))[1]
    bar = progress(len(Ps) * nb * betas.size, "kernel: Monte Carlo over planes", show_progress)
    for ip, P in enumerate(Ps):
        for b in range(nb):
            planes = racecpu.hyperplanes(D, P, T, seed=[seed, 1, P, b], dtype=np.float64)
            for ib, beta in enumerate(betas):
                soft, hard = _per_table(q, k, planes, float(beta))
                soft_m[ip, b, ib] = soft.mean(1)
                diff_m[ip, b, ib] = (soft - hard).mean(1)
                soft_sq[ip, b, ib] = (soft * soft).mean(1)
                diff_sq[ip, b, ib] = ((soft - hard) ** 2).mean(1)
                bar.update()
            if P == cfg["var_planes"]:
                s = _per_table(q, kv, planes, cfg["var_beta"])[0][0]
                for il, L in enumerate(Ls):
                    m = s[: (T // L) * L].reshape(-1, L).mean(1)
                    var_L[b, il] = m.var(ddof=1)
    bar.close()

    rows, summary = [], []
    vals = {}
    for ip, P in enumerate(Ps):
        target = (1 - thetas / np.pi) ** P
        for ib, beta in enumerate(betas):
            exact = expected_kernel(thetas, beta, P)
            mc = soft_m[ip, :, ib].mean(0)
            var1 = soft_sq[ip, :, ib].mean(0) - mc ** 2               # single-table variance
            mc_se = np.sqrt(np.maximum(var1, 0) / (nb * T))
            bias_mc = diff_m[ip, :, ib].mean(0)
            var_d = diff_sq[ip, :, ib].mean(0) - bias_mc ** 2           # per-table variance of soft - hard
            bias_se = np.sqrt(np.maximum(var_d, 0) / (nb * T))
            bound = float(bias_bound(P, beta))
            for it, th in enumerate(thetas):
                rows.append(dict(P=P, beta=float(beta), theta=float(th), target=target[it], exact_expected=exact[it],
                                 mc_mean=mc[it], mc_se=mc_se[it], exact_bias=exact[it] - target[it],
                                 mc_bias=bias_mc[it], mc_bias_se=bias_se[it], bound=bound))
            eb = np.abs(exact - target)
            # z-scores.  The kernel lies in [0, 1], so its variance is <= mu (1 - mu), and the variance of
            # soft - hard (in [-1, 1]) is <= E|soft - hard|, which is >= |bias|; these floors keep rare events
            # (at theta ~ pi, large beta the kernel is ~ beta^-P, carried by planes that no sample hit) from
            # giving a sample SE of ~0.
            n = nb * T
            z = np.abs(mc - exact) / np.maximum(mc_se, np.sqrt(exact * (1 - exact) / n) + 1e-300)
            zb = np.abs(bias_mc - (exact - target)) / np.maximum(bias_se, np.sqrt(eb / n) + 1e-300)
            summary.append(dict(P=P, beta=float(beta), max_abs_bias_exact=float(eb.max()),
                                theta_of_max=float(thetas[eb.argmax()]), max_abs_bias_mc=float(np.abs(bias_mc).max()),
                                bias_theta0_exact=float(exact[0] - 1.0), bound=bound,
                                bias_over_bound=float(eb.max() / bound), beta_bias_over_P=float(beta * eb.max() / P),
                                max_z_mean=float(z.max()), max_z_bias=float(zb.max())))

    # fits: bias at theta = 0 (where it is largest) against beta, beta >= FIT_MIN_BETA
    sel = betas >= FIT_MIN_BETA
    fits = {}
    for ip, P in enumerate(Ps):
        per_batch = -diff_m[ip][:, sel, 0]                          # (nb, n_beta) = 1 - soft(q, q) >= 0
        fits[P] = bootstrap_fit(betas[sel], per_batch, seed=seed, aggregate=lambda a: np.abs(a.mean(0)))
        fits[P, "exact"] = loglog_fit(betas[sel], np.array([abs(s["bias_theta0_exact"]) for s in summary
                                                             if s["P"] == P and s["beta"] >= FIT_MIN_BETA]))[0]
    var_fit = bootstrap_fit(Ls, var_L, seed=seed, aggregate=lambda a: a.mean(0))
    var_rows = [dict(L=int(L), variance=float(var_L[:, i].mean()), variance_times_L=float(var_L[:, i].mean() * L),
                     beta=cfg["var_beta"], P=cfg["var_planes"], theta=cfg["var_theta"]) for i, L in enumerate(Ls)]

    # claims
    claims = []
    big = betas.max()
    lim = [s for s in summary if s["beta"] == big]
    claims.append(Claim("K1", "E[phi(q).phi(k)] -> (1 - theta/pi)^P as beta -> inf, over all theta in [0, pi]",
                        all(s["max_abs_bias_exact"] < 2 * s["P"] / big for s in lim)
                        and all(s["max_abs_bias_exact"] < s2["max_abs_bias_exact"] for s in lim for s2 in summary
                                if s2["P"] == s["P"] and s2["beta"] == betas.min()),
                        "max_theta |bias| at beta=%s: %s (P = %s); at beta=%s: %s" % (
                            fmt(big), ", ".join(fmt(s["max_abs_bias_exact"]) for s in lim), ", ".join(str(P) for P in Ps),
                            fmt(betas.min()), ", ".join(fmt(s["max_abs_bias_exact"]) for s in summary
                                                         if s["beta"] == betas.min()))))
    worst = max(summary, key=lambda s: s["bias_over_bound"])
    claims.append(Claim("K2", "|E[phi(q).phi(k)] - (1 - theta/pi)^P| <= 4P/(sqrt(2 pi) beta) + 2P e^{-2 tanh(1) beta} "
                              "(bias lemma)", worst["bias_over_bound"] <= 1.0,
                        f"largest measured bias / bound = {fmt(worst['bias_over_bound'])} (P={worst['P']}, "
                        f"beta={fmt(worst['beta'])}); at large beta the max bias is "
                        f"{fmt(np.median([s['beta_bias_over_P'] for s in summary if s['beta'] >= 16]))} P/beta, "
                        f"i.e. P/(sqrt(2 pi) beta) = 0.399 P/beta: the bound is 4x the leading term"))
    slopes = "; ".join(f"P={P}: {fits[P]} (quadrature {fits[P, 'exact']:+.3f})" for P in Ps)
    claims.append(Claim("K3", "the bias decays like 1/beta (log-log slope -1 in beta >= 4)",
                        all(fits[P].lo - 0.1 <= -1.0 <= fits[P].hi + 0.1 for P in Ps), "slope of max bias: " + slopes))
    if len(Ps) > 1:
        c = [s["beta_bias_over_P"] for s in summary if s["beta"] == betas[betas >= 16].min()]
        claims.append(Claim("K4", "the bias grows linearly in P (beta * bias / P constant)",
                            max(c) / min(c) < 1.25,
                            "beta * max bias / P at beta=%s: %s for P = %s" % (
                                fmt(betas[betas >= 16].min()), ", ".join(fmt(x) for x in c), ", ".join(map(str, Ps)))))
    claims.append(Claim("K5", "the variance of the L-table kernel estimate falls like 1/L",
                        var_fit.lo - 0.05 <= -1.0 <= var_fit.hi + 0.05,
                        f"log-log slope {var_fit} (beta={fmt(cfg['var_beta'])}, P={cfg['var_planes']}, "
                        f"theta=pi/3); single-table variance {fmt(var_L[:, 0].mean())}"))
    zmax = max(max(s["max_z_mean"], s["max_z_bias"]) for s in summary)
    n_tests = 2 * len(summary) * thetas.size
    claims.append(Claim("K0", "Monte Carlo over planes agrees with the exact quadrature of E[phi(q).phi(k)]",
                        zmax < 5.0, f"largest |z| over {n_tests} (P, beta, theta) cells = {zmax:.2f}"))

    figures = _plots(out_dir, thetas, betas, Ps, rows, summary, fits, var_rows, var_fit)
    md = _markdown(cfg, summary, fits, var_rows, var_fit, Ps, T, nb)
    vals.update(bias_slope={P: fits[P].slope for P in Ps}, bias_fit={P: fits[P] for P in Ps}, var_fit=var_fit,
                summary=summary)
    return Result("kernel", "Kernel level", tables={"kernel_curves.csv": rows, "kernel_bias.csv": summary,
                                                     "kernel_variance.csv": var_rows},
                  figures=figures, claims=claims, markdown=md, values=vals)


def _plots(out_dir, thetas, betas, Ps, rows, summary, fits, var_rows, var_fit):
    plt = pyplot()
    P0 = 3 if 3 in Ps else Ps[-1]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    show = [b for b in betas if b in (1, 4, 16, 64)] or list(betas[:4])
    for beta in show:
        r = [x for x in rows if x["P"] == P0 and x["beta"] == beta]
        line, = ax[0].plot(thetas, [x["exact_expected"] for x in r], lw=1, label=f"exact, beta={fmt(beta)}")
        ax[0].errorbar(thetas, [x["mc_mean"] for x in r], yerr=[2 * x["mc_se"] for x in r], fmt=".", ms=3,
                       color=line.get_color())
        ax[1].plot(thetas, [x["exact_bias"] for x in r], lw=1, color=line.get_color(), label=f"beta={fmt(beta)}")
        ax[1].errorbar(thetas, [x["mc_bias"] for x in r], yerr=[2 * x["mc_bias_se"] for x in r], fmt=".", ms=3,
                       color=line.get_color())
    ax[0].plot(thetas, (1 - thetas / np.pi) ** P0, "k--", lw=1, label="(1 - theta/pi)^P")
    ax[0].set(xlabel="theta", ylabel="E[phi(q).phi(k)]", title=f"one table, P={P0}: lines exact, dots Monte Carlo")
    ax[1].set(xlabel="theta", ylabel="E[phi.phi] - (1-theta/pi)^P", title="bias")
    ax[0].legend()
    ax[1].legend()
    f1 = savefig(fig, out_dir, "kernel_curves.png")

    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    for P in Ps:
        s = [x for x in summary if x["P"] == P]
        line, = ax[0].loglog([x["beta"] for x in s], [x["max_abs_bias_exact"] for x in s], "-", lw=1,
                             label=f"P={P}: slope {fits[P].slope:+.2f}")
        ax[0].loglog([x["beta"] for x in s], [x["max_abs_bias_mc"] for x in s], "o", ms=3, color=line.get_color())
        ax[0].loglog([x["beta"] for x in s], [x["bound"] for x in s], ":", lw=1, color=line.get_color())
    ax[0].set(xlabel="beta", ylabel="max over theta |bias|",
              title="bias: lines exact, dots MC, dotted = paper's bound")
    ax[0].legend()
    L = [x["L"] for x in var_rows]
    v = [x["variance"] for x in var_rows]
    ax[1].loglog(L, v, "o-", ms=3, label=f"measured, slope {var_fit.slope:+.2f}")
    ax[1].loglog(L, v[0] / np.asarray(L, float), "k--", lw=1, label="Var(1 table) / L")
    ax[1].set(xlabel="L (tables)", ylabel="Var of L-table kernel estimate", title="variance vs L")
    ax[1].legend()
    f2 = savefig(fig, out_dir, "kernel_bias_variance.png")
    return [f1, f2]


def _markdown(cfg, summary, fits, var_rows, var_fit, Ps, T, nb):
    lines = [f"Monte Carlo over {nb} batches x {T} tables per P and beta (d = {D}; the distribution of "
             "(w.q, w.k) does not depend on d), angles on a grid of "
             f"{cfg['n_theta']} points in [0, pi]; exact expectations by quadrature (`theory.expected_kernel`).",
             "", "| P | beta | max bias (exact) | at theta | max bias (MC) | bound | bias/bound | beta*bias/P |",
             "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['P']} | {fmt(s['beta'])} | {fmt(s['max_abs_bias_exact'])} | {s['theta_of_max']:.2f} | "
                     f"{fmt(s['max_abs_bias_mc'])} | {fmt(s['bound'])} | {fmt(s['bias_over_bound'])} | "
                     f"{fmt(s['beta_bias_over_P'])} |")
    lines += ["", "Fitted log-log slope of the bias at theta = 0 against beta (beta >= 4), 95% bootstrap CI "
              "over plane batches: " + "; ".join(f"P={P}: {fits[P]}" for P in Ps) + ".",
              "", "| L | Var | L * Var |", "|---|---|---|"]
    lines += [f"| {r['L']} | {fmt(r['variance'])} | {fmt(r['variance_times_L'])} |" for r in var_rows]
    lines += ["", f"Variance slope against L: {var_fit}.", "",
              "![kernel curves](kernel_curves.png)", "", "![bias and variance](kernel_bias_variance.png)"]
    return "\n".join(lines)

"""The estimator: how a query reads the keys' bucket sums, and the backward of that readout.

RACE's estimator is the paper's *ratio* over tables (``docs/design.md``
sections 1.2 and 3.1): with a query's soft buckets ``phiq`` and the sums
``A = sum_j phik_j``, ``B = sum_j phik_j v_j^T`` of the keys it sees,

    den = phiq . A / L,        out = (phiq B) / (L den),

and a query whose ``den`` is at most DEN_FLOOR outputs zeros and passes no
gradient.  Every kernel that reads a sketch or a causal state calls the
functions here for that, and nothing else in the kernels knows the ratio or
the floor: the non-causal readout (:func:`readout_rows`, and its
den alone: :func:`den_rows`), the rows of a
causal scan step (:func:`step_readout`), the cotangent of a row's
readout (:func:`dphi_from_y`), the causal keys' share of it
(:func:`ratio_inverse`, :func:`den_share`) and the cotangent a block's
outputs send to its carried-in state (:func:`state_cotangent_rows`).

A second estimator is a second module of these functions.  The per-bucket
mean of the authors' released code (``docs/design.md`` section 1.5) is not a
kernel yet: :mod:`racecpu.bucket_mean` computes it in NumPy, behind the
engine's estimator switch (:mod:`racecpu.engine`).
"""

from __future__ import annotations

import numpy as np

from ..config import DEN_FLOOR
from ._jit import kernel
from .products import combine_rows, copy_into


@kernel
def ratio_inverse(den, L):
    """``1 / (L den)``: what turns a query's summed numerator into its output; 0 at the floor
    (``den <= DEN_FLOOR``: the query attends to nothing)."""
    return 1.0 / (L * den) if den > DEN_FLOOR else 0.0


@kernel
def den_share(dden, den, L):
    """``dden / L``, the weight with which a query's ``phiq`` enters ``dA``; 0 at the floor."""
    return dden / L if den > DEN_FLOOR else 0.0


@kernel(inline="always")
def den_rows(phiq, A, L, den):
    """den_i = phiq_i . A / L, every row: :func:`readout_rows`' den without its output, for a
    backward that recomputes only what the queries' cotangents read (their ``y = B g`` replaces
    the output, :func:`dphi_from_y`); :func:`readout_rows` computes its den with it."""
    n, F = phiq.shape
    for i in range(n):
        dn = 0.0
        for f in range(F):
            dn += phiq[i, f] * A[f]
        den[i] = dn / L


@kernel(inline="always")
def readout_rows(phiq, A, S, L, den, out):
    """out_i = (phiq_i S) / (phiq_i . A) with the 1/L of both, den_i = phiq_i . A / L, every row.

    A is float64; S is (F, dv) in the compute dtype.  Rows whose den is at
    most DEN_FLOOR get zeros.  The rows of phiq are scaled first, so that
    out is written once, streamed (:func:`combine_rows`): an sgemm and a
    pass scaling its result read and wrote every row of out twice.
    """
    n, F = phiq.shape
    w = np.empty((n, F), phiq.dtype)
    den_rows(phiq, A, L, den)
    for i in range(n):
        inv = ratio_inverse(den[i], L)
        for f in range(F):
            w[i, f] = phiq[i, f] * inv
    combine_rows(w, S, out, True)


@kernel
def step_readout(Pq, A, H, X, L, den, O):
    """The rows of one causal scan step (``docs/design.md`` section 4.4), once ``O`` holds
    ``Pq S`` (the carried-in state's share) and ``X`` holds ``H V`` (the step's own keys').

    ``den_i = (Pq_i . A + sum_{j <= i} H_ij) / L`` into ``den (m,)``, ``A (F,)``
    float64 the key mass before the step, ``H (m, m)`` the step's scores;
    ``O_i = (O_i + X_i) / (L den_i)``, zeros at the floor.
    """
    m, F = Pq.shape
    dv = O.shape[1]
    for i in range(m):
        dn = 0.0
        for f in range(F):
            dn += Pq[i, f] * A[f]
        for j in range(i + 1):
            dn += H[i, j]
        dn /= L
        den[i] = dn
        inv = ratio_inverse(dn, L)
        for cc in range(dv):
            O[i, cc] = (O[i, cc] + X[i, cc]) * inv


@kernel
def dphi_from_y(phiq, i, A, den, L, dphi, r, wq):
    """Cotangent of row ``i`` of :func:`readout_rows` (``phiq (n, F)``) w.r.t. phiq,
    once row ``r`` of ``dphi (n', F)`` (float64) holds y = S g; returns dden.

    dden = -(phiq_i . y) / (L den^2),  dphiq_i = y / (L den) + A dden / L
    (overwriting ``dphi[r]``), and the weights ``wq = phiq_i / (L den)`` with which
    g enters dB (dB += wq g^T).  Rows at the DEN_FLOOR get zeros.  Rows by index,
    not views: the callers run it per token, and a view counts a reference.
    """
    F = phiq.shape[1]
    if den <= DEN_FLOOR:
        for f in range(F):
            dphi[r, f] = 0.0
            wq[f] = 0.0
        return 0.0
    inv = 1.0 / (L * den)
    phiy = 0.0
    for f in range(F):
        phiy += phiq[i, f] * dphi[r, f]
    dden = -phiy * inv / den
    for f in range(F):
        dphi[r, f] = dphi[r, f] * inv + A[f] * dden / L
        wq[f] = phiq[i, f] * inv
    return dden


@kernel
def state_cotangent_rows(phiq, phik, A0, out, grad, L, dA, w):
    """The cotangent that causal outputs send back to the state before them,
    from the outputs themselves (no rescan), but for the product dB = w^T grad.

    For query i with A_i = A0 + sum_{j <= i} phik_j (float64) and
    den_i = phiq_i . A_i / L: ``phiq_i B_i = L den_i out_i``, so dden_i =
    -(out_i . g_i) / den_i, and query i adds phiq_i dden_i / L to ``dA (G, F)``
    (float64, added to) and has weight ``w_i = phiq_i / (L den_i)`` in dB
    (``w (G, n, F)``, compute dtype, written); rows at the DEN_FLOOR send
    nothing.  ``phiq``, ``phik (G, n, F)`` (masked keys' rows zero), ``A0 (G, F)``
    float64, ``out``, ``grad (G, n, dv)`` in the compute dtype.
    """
    G, n, F = phiq.shape
    dv = out.shape[2]
    A = np.empty(F)
    for g in range(G):
        copy_into(A, A0[g])
        for i in range(n):
            den = 0.0
            for f in range(F):
                A[f] += phik[g, i, f]
                den += phiq[g, i, f] * A[f]
            den /= L
            if den <= DEN_FLOOR:
                for f in range(F):
                    w[g, i, f] = 0.0
                continue
            og = 0.0
            for c in range(dv):
                og += out[g, i, c] * grad[g, i, c]
            dden = -og / den
            inv = 1.0 / (L * den)
            for f in range(F):
                dA[g, f] += phiq[g, i, f] * dden / L
                w[g, i, f] = phiq[g, i, f] * inv

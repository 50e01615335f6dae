"""Closed forms and exact expectations the experiments compare against.

* :func:`angular_kernel` -- the target kernel ``S_ij = (1 - theta_ij/pi) ** gamma``
  (the similarity matrix inside :func:`racecpu.reference.angular_attention`,
  which exposes only the attention output).
* :func:`expected_kernel` -- the exact expectation over the hyperplanes of one
  table's RACE kernel ``E[phi(q) . phi(k)]`` for unit-norm ``q, k``, by
  quadrature.  The soft hash factorises over planes (docs/design.md section 2), so
  with ``a_p(x) = sigmoid(2 beta tanh(w_p . x))`` and independent planes::

      E[phi(q) . phi(k)] = f(theta, beta) ** P,
      f = E[a(q) a(k) + (1 - a(q)) (1 - a(k))] = 2 E[a(q) a(k)]

  (``E a = 1/2`` by symmetry), where ``(w . q, w . k)`` is a standard bivariate
  normal pair with correlation ``cos theta``, whatever ``d >= 2``.  Writing the
  pair in polar form ``w = r (cos alpha, sin alpha)`` in the plane of ``q, k``
  (``r`` Rayleigh, ``alpha`` uniform), ``f(theta)`` is for every ``r`` a circular
  autocorrelation in ``alpha``, computed for all ``theta`` at once by FFT.  As
  ``beta -> inf``, ``f -> 1 - theta/pi`` (SimHash); the experiments check both
  this limit and the Monte-Carlo estimates over planes against it.
* :func:`bias_bound` -- the paper's bound on ``|E[phi(q).phi(k)] - S_ij|``.
"""

from __future__ import annotations

import functools

import numpy as np
from scipy.special import expit

__all__ = ["angular_kernel", "plane_collision", "expected_kernel", "bias_bound", "lemma_l_requirement"]


def angular_kernel(q, k, gamma):
    """``(1 - arccos(cos(q_i, k_j)) / pi) ** gamma`` as an ``(Nq, Nk)`` float64 matrix."""
    from .data import unit_rows
    c = np.clip(unit_rows(q) @ unit_rows(k).T, -1.0, 1.0)
    return (1.0 - np.arccos(c) / np.pi) ** float(gamma)


@functools.lru_cache(maxsize=64)
def plane_collision(beta, n_angle=2 ** 15, n_radius=96, r_max=9.0):
    """Per-plane soft collision ``f(theta, beta)`` on a grid of angles.

    Parameters
    ----------
    beta : float
        Soft-hash temperature (> 0).
    n_angle : int
        Points of the uniform grid in ``alpha`` (power of two); the grid step
        ``2 pi / n_angle`` must resolve the soft step of width ``~1/beta``.
    n_radius : int
        Gauss-Legendre nodes per radial piece (``[0, 1]`` and ``[1, r_max]``).

    Returns
    -------
    theta : ndarray, shape (n_angle // 2 + 1,)
        Angles ``0 .. pi``.
    f : ndarray, same shape
        ``E_w[a(q) a(k) + (1 - a(q)) (1 - a(k))]`` for unit ``q, k`` at angle theta.
    """
    beta = float(beta)
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    alpha = 2 * np.pi * np.arange(n_angle) / n_angle
    x, w = np.polynomial.legendre.leggauss(n_radius)
    pieces = [(0.0, 1.0), (1.0, r_max)]
    r = np.concatenate([(a + b) / 2 + (b - a) / 2 * x for a, b in pieces])
    wr = np.concatenate([(b - a) / 2 * w for a, b in pieces]) * r * np.exp(-r * r / 2)  # Rayleigh density
    wr /= wr.sum()
    cos_a = np.cos(alpha)
    acc = np.zeros(n_angle // 2 + 1)
    for s in range(0, r.size, 16):
        g = expit(2 * beta * np.tanh(r[s:s + 16, None] * cos_a[None, :]))
        spec = np.fft.rfft(g, axis=1)
        acc += (wr[s:s + 16, None] * (spec.real ** 2 + spec.imag ** 2)).sum(0)
    corr = np.fft.irfft(acc, n_angle) / n_angle  # mean over alpha of g(alpha) g(alpha + m step)
    f = 2 * corr[: n_angle // 2 + 1]
    return alpha[: n_angle // 2 + 1].copy(), np.clip(f, 0.0, 1.0)


def _grid_for(beta):
    # the soft step in alpha has width ~ 1/(2 beta r); keep >= ~8 grid points across it at r ~ 1
    n = 2 ** int(np.clip(np.ceil(np.log2(16 * np.pi * beta)), 13, 17))
    return n


def expected_kernel(theta, beta, num_planes):
    """Exact ``E_W[phi(q) . phi(k)] = f(theta, beta) ** P`` for unit vectors at angle ``theta``."""
    grid, f = plane_collision(float(beta), _grid_for(beta))
    return np.interp(np.asarray(theta, dtype=np.float64), grid, f) ** int(num_planes)


def bias_bound(num_planes, beta):
    """The paper's per-entry bias bound ``4P/(sqrt(2 pi) beta) + 2P exp(-2 tanh(1) beta)``.

    This is the last display of the proof of the bias lemma (appendix), whose
    ``O(P e^{-c beta})`` term is ``2 P e^{-c beta}``, ``c = 2 tanh(1)``.  (The
    lemma's statement writes its constant as ``(4/sqrt(2 pi)) e^{-1/2} ~ 0.97``
    instead of 2; the first term, the one that matters, is the same.)
    """
    P, beta = float(num_planes), np.asarray(beta, dtype=np.float64)
    return 4 * P / (np.sqrt(2 * np.pi) * beta) + 2 * P * np.exp(-2 * np.tanh(1.0) * beta)


def lemma_l_requirement(c1, n, delta=0.1):
    """Tables the concentration lemma for E needs: ``L >= 2 / C1^2 log(2 N^2 / delta)``."""
    return 2.0 / c1 ** 2 * np.log(2.0 * n ** 2 / delta)

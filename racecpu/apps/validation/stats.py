"""Fits with bootstrap confidence intervals over seeds."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Fit", "rms_over_seeds", "loglog_fit", "bootstrap_fit"]


@dataclass(frozen=True)
class Fit:
    """A fitted slope with a bootstrap confidence interval."""
    slope: float
    lo: float
    hi: float
    intercept: float

    def __str__(self):
        return f"{self.slope:+.3f} [{self.lo:+.3f}, {self.hi:+.3f}]"

    def covers(self, value):
        return self.lo <= value <= self.hi


def rms_over_seeds(errors, axis=0):
    """Root of the mean square over seeds: the RMS error an experiment measures."""
    e = np.asarray(errors, dtype=np.float64)
    return np.sqrt(np.mean(e * e, axis=axis))


def loglog_fit(x, y):
    """Least-squares ``log y = slope * log x + intercept``; returns ``(slope, intercept)``."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or x.size < 2:
        raise ValueError(f"need two 1-d arrays of equal length >= 2, got shapes {x.shape} and {y.shape}")
    if np.any(x <= 0) or np.any(y <= 0):
        raise ValueError("log-log fit needs positive x and y")
    slope, intercept = np.polyfit(np.log(x), np.log(y), 1)
    return float(slope), float(intercept)


def bootstrap_fit(x, per_seed, *, n_boot=2000, seed=0, level=0.95, aggregate=rms_over_seeds):
    """Log-log slope of ``aggregate(per_seed)`` against ``x`` with a percentile bootstrap CI.

    Parameters
    ----------
    x : array_like, shape (m,)
    per_seed : array_like, shape (n_seeds, ...)
        Measurements per seed; seeds (axis 0) are resampled with replacement.
    aggregate : callable, default :func:`rms_over_seeds`
        Maps a ``(n_seeds, ...)`` array to the fitted curve, shape ``(m,)``.
    """
    per_seed = np.asarray(per_seed, dtype=np.float64)
    x = np.asarray(x, dtype=np.float64)
    if per_seed.ndim < 2 or per_seed.shape[0] < 2:
        raise ValueError(f"per_seed must have shape (n_seeds >= 2, ...), got {per_seed.shape}")
    slope, intercept = loglog_fit(x, aggregate(per_seed))
    rng = np.random.default_rng(seed)
    n = per_seed.shape[0]
    boots = np.empty(n_boot)
    for b in range(n_boot):
        boots[b] = loglog_fit(x, aggregate(per_seed[rng.integers(n, size=n)]))[0]
    a = (1 - level) / 2
    lo, hi = np.quantile(boots, [a, 1 - a])
    return Fit(slope, float(lo), float(hi), intercept)

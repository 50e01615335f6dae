"""Shared test helpers."""

import numpy as np


def nan_pool(monkeypatch):
    """Make racecpu's result pool hand out float memory filled with NaN (for the rest of the
    test), so that a value a kernel reads before it writes it shows in the results."""
    from racecpu._memory import POOL
    empty = POOL.empty

    def nan_empty(shape, dtype=np.float64):
        x = empty(shape, dtype)
        if x.dtype.kind == "f":
            x.fill(np.nan)
        return x
    monkeypatch.setattr(POOL, "empty", nan_empty)


def fd_grad(f, args, i, g, eps=1e-6):
    """Central finite-difference gradient of <g, f(*args)> w.r.t. args[i] (float64)."""
    x = args[i]
    if np.isscalar(x) or np.ndim(x) == 0:
        plus = list(args)
        minus = list(args)
        plus[i], minus[i] = float(x) + eps, float(x) - eps
        return float(np.sum(g * (f(*plus) - f(*minus))) / (2 * eps))
    x = np.array(x, dtype=np.float64)
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        ap, am = list(args), list(args)
        ap[i], am[i] = xp, xm
        grad[idx] = np.sum(g * (f(*ap) - f(*am))) / (2 * eps)
    return grad


def fd_check(f, args, g, analytic, rtol=1e-6, atol=1e-8):
    """Assert every analytic gradient equals the central finite difference."""
    for i, an in enumerate(analytic):
        num = fd_grad(f, args, i, g)
        scale = max(np.max(np.abs(num)), 1e-3)
        np.testing.assert_allclose(an, num, rtol=rtol, atol=atol + rtol * scale,
                                   err_msg=f"gradient of argument {i}")


def rel_err(a, b, floor=1e-300):
    """max |a - b| / max(max |b|, floor); ``floor`` keeps exact zeros from dividing noise by noise."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b), initial=0.0) / max(np.max(np.abs(b), initial=0.0), floor))

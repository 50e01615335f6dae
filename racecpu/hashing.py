"""Hyperplanes, hypercube corners and the soft LSH bucket map of RACE attention.

The soft hash of the paper (Algorithm 1) maps a vector ``x`` and one hash table
``W_l`` (P hyperplanes) to a probability vector over the ``R = 2**P`` corners of
the hypercube {-1, +1}^P::

    t = tanh(W_l x)                               (P,)
    phi_l(x)_r = softmax_r(beta * t . v_r)        (R,)

Corner ``r`` has ``v_{r,p} = +1`` iff bit ``P-1-p`` of ``r`` is set, i.e. the
order of ``itertools.product([-1, 1], repeat=P)``.  This order is public.
"""

from __future__ import annotations

import numbers

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from . import engine
from ._checks import check_array, check_beta, check_planes
from .config import DEFAULT_BETA, DEN_FLOOR, MAX_PLANES

__all__ = ["hyperplanes", "corners", "soft_buckets", "DEFAULT_BETA", "DEN_FLOOR", "MAX_PLANES", "LAYER_NUM_PLANES",
           "LAYER_NUM_TABLES", "LAYER_BETA"]

#: The defaults of the attention layers (``racecpu.torch.RaceAttention``, ``racecpu.RaceAttention``,
#: ``racecpu.autograd.nn``'s layers and models, ``racecpu train``): P hyperplanes per table, L tables
#: and beta's starting value, chosen from the map of docs/choosing.md (issue 59).  Trained on
#: multi-query recall, P = L = 3 with beta starting at 8 recalled worse than linear attention;
#: P = 5, L = 4 from beta 2 reached 0.9x softmax's level on the hard recall task (median of three
#: seeds), where P = L = 4 stopped at 0.74; at long contexts its attention costs 2-2.9x that of
#: P = L = 4 (docs/choosing.md gives the cheaper choice and its price).  A softer start matters
#: because the soft hash's gradients vanish as beta grows (tanh saturates) and beta, although
#: trained, rarely leaves the region it starts in.  The functions that take planes keep
#: ``DEFAULT_BETA`` (8): untrained, a sharper hash estimates the angular kernel closer.
LAYER_NUM_PLANES = 5
LAYER_NUM_TABLES = 4
LAYER_BETA = 2.0

def hyperplanes(head_dim: int, num_planes: int = 3, num_tables: int = 3, *,
                seed: int | np.random.Generator | None = 0, dtype: DTypeLike = np.float32) -> np.ndarray:
    """Draw the random hyperplanes of ``num_tables`` hash tables.

    Parameters
    ----------
    head_dim : int
        Dimension ``d`` of queries and keys.
    num_planes : int, default 3
        Hyperplanes per table ``P`` (1..16); each table has ``R = 2**P`` buckets.
    num_tables : int, default 3
        Number of independent hash tables ``L`` (>= 1).
    seed : int >= 0 or numpy.random.Generator, default 0
        Seed for ``numpy.random.default_rng`` (which also takes None, a
        sequence of such ints, a SeedSequence or a BitGenerator).
    dtype : dtype, default float32

    Returns
    -------
    planes : ndarray, shape (L, P, d)
        i.i.d. N(0, 1) entries.
    """
    for name, val, lo, hi in (("head_dim", head_dim, 1, None), ("num_planes", num_planes, 1, MAX_PLANES),
                              ("num_tables", num_tables, 1, None)):
        if isinstance(val, (bool, np.bool_)) or not isinstance(val, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(val).__name__} {val!r}")
        if val < lo or (hi is not None and val > hi):
            rng_txt = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            raise ValueError(f"{name} must be {rng_txt}, got {val}")
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    try:
        rng = np.random.default_rng(seed)
    except (TypeError, ValueError) as exc:
        error = ValueError if isinstance(exc, ValueError) else TypeError
        raise error(f"seed must be an int >= 0 or a numpy.random.Generator (or anything else "
                    f"numpy.random.default_rng takes), got {seed!r}") from exc
    return rng.standard_normal((int(num_tables), int(num_planes), int(head_dim))).astype(dtype)


def corners(num_planes: int) -> np.ndarray:
    """The ``(2**P, P)`` matrix of hypercube corners in the public order.

    Row ``r`` has ``+1`` in column ``p`` iff bit ``P-1-p`` of ``r`` is set
    (the order of ``itertools.product([-1, 1], repeat=P)``).
    """
    p = int(num_planes)
    r = np.arange(2 ** p)[:, None]
    bits = (r >> (p - 1 - np.arange(p))[None, :]) & 1
    return (2 * bits - 1).astype(np.float64)


def soft_buckets(x: ArrayLike, planes: ArrayLike, beta: float = DEFAULT_BETA) -> np.ndarray:
    """Soft bucket probabilities ``phi_l(x)`` of every vector and table.

    Parameters
    ----------
    x : array_like, shape (..., N, d)
        Queries or keys (at least 2 dims).
    planes : array_like, shape (L, P, d)
    beta : float, default ``DEFAULT_BETA``
        Temperature (> 0).

    Returns
    -------
    phi : ndarray, shape (..., N, L, 2**P)
        Rows sum to 1 over the last axis; corner order as :func:`corners`.
        float32/float64 follow ``x``; float16 is computed in float32 and
        returned as float16.
    """
    x, out_dtype, cdt = check_array("x", x, check_finite=True)
    planes = check_planes(planes, x.shape[-1], cdt)
    beta = check_beta(beta)
    L, P, _ = planes.shape
    R = 2 ** P
    lead = x.shape[:-1]
    flat = np.ascontiguousarray(x.reshape(-1, x.shape[-1]), dtype=cdt)
    phi = np.empty((flat.shape[0], L * R), dtype=cdt)
    t = np.empty((flat.shape[0], L * P), dtype=cdt)
    if flat.shape[0]:
        engine.soft_hash(flat, planes, beta, t, phi)
    return phi.reshape(lead + (L, R)).astype(out_dtype, copy=False)

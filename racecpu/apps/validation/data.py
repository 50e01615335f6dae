"""Seeded data sets for the validation experiments.

Every data set is a function ``make(n, d, dv, rng) -> (q, k, v)`` returning
float64 arrays ``q (n, d)``, ``k (n, d)``, ``v (n, dv)``.  Queries and keys
come *raw* (each coordinate of unit variance, so norms are about ``sqrt(d)``):
softmax attention depends on their norms.  Experiments that work in the
setting of Theorem 1 (unit-norm queries and keys) call :func:`unit_rows`.
Values have ``E ||v_j||^2 = 1`` (entries of variance ``1/dv``), so an RMS
error of the attention output is relative to the size of one value row; in
the structured data sets a key's value is correlated with its group, as in a
trained model (half the variance from the group, half noise).

Built-in data sets
------------------
isotropic
    q, k i.i.d. N(0, I_d).  Angles between query and key concentrate around
    pi/2 as d grows: the easy, nearly flat case.
clustered
    8 cluster centres c_m ~ N(0, I_d) shared by queries and keys; every token
    picks a centre uniformly and adds N(0, 0.5**2 I_d) noise.  Same-cluster
    pairs are at small angles, other pairs near pi/2: a structured kernel.
    A key's value is its cluster's value vector plus noise.
near_duplicate
    keys are 4 base directions b_m ~ N(0, I_d) plus N(0, 0.05**2 I_d) noise
    (near-duplicates: angles between keys of one group ~0.05 rad); half of the
    queries are near-duplicates of the bases too, the other half isotropic.
    Stresses the kernel near theta = 0 and rows dominated by few key groups.
    A key's value is its base's value vector plus noise.

Hook for learned queries and keys: :func:`npz_dataset` turns an ``.npz`` file
with arrays ``q``, ``k``, ``v`` of shape ``(..., N, d)`` (for example dumped
from a model trained with ``racecpu.autograd``) into a data set, and
:func:`register_dataset` adds any ``make`` function; ``racecpu validate --qkv
FILE`` does both.
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["DATASETS", "register_dataset", "npz_dataset", "make_qkv", "unit_rows"]


def _values(n, dv, rng):
    return rng.standard_normal((n, dv)) / np.sqrt(dv)


def _group_values(groups, n_groups, dv, rng):
    """Half the variance shared within a group, half noise: E ||v||^2 = 1."""
    u = rng.standard_normal((n_groups, dv))
    return (u[groups] + rng.standard_normal((groups.size, dv))) / np.sqrt(2 * dv)


def isotropic(n, d, dv, rng):
    """q, k i.i.d. standard normal (see module docstring)."""
    q = rng.standard_normal((n, d))
    k = rng.standard_normal((n, d))
    return q, k, _values(n, dv, rng)


def clustered(n, d, dv, rng, n_clusters=8, spread=0.5):
    """Queries and keys drawn around ``n_clusters`` shared random centres."""
    centres = rng.standard_normal((n_clusters, d))
    q = centres[rng.integers(n_clusters, size=n)] + spread * rng.standard_normal((n, d))
    ck = rng.integers(n_clusters, size=n)
    k = centres[ck] + spread * rng.standard_normal((n, d))
    return q, k, _group_values(ck, n_clusters, dv, rng)


def near_duplicate(n, d, dv, rng, n_bases=4, noise=0.05):
    """Keys: near-duplicates of ``n_bases`` directions; queries: half near them, half isotropic."""
    bases = rng.standard_normal((n_bases, d))
    kb = rng.integers(n_bases, size=n)
    k = bases[kb] + noise * rng.standard_normal((n, d))
    q = rng.standard_normal((n, d))
    near = rng.random(n) < 0.5
    q[near] = bases[rng.integers(n_bases, size=int(near.sum()))] + noise * rng.standard_normal((int(near.sum()), d))
    return q, k, _group_values(kb, n_bases, dv, rng)


#: name -> make(n, d, dv, rng) -> (q, k, v)
DATASETS = {"isotropic": isotropic, "clustered": clustered, "near_duplicate": near_duplicate}


def register_dataset(name, make):
    """Add a data set ``make(n, d, dv, rng) -> (q, k, v)`` under ``name``."""
    if not callable(make):
        raise TypeError(f"make must be callable, got {type(make).__name__}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    DATASETS[name] = make
    return name


def npz_dataset(path):
    """A data set reading ``q``, ``k``, ``v`` (shape ``(..., N, d)``) from an ``.npz`` file.

    The returned ``make(n, d, dv, rng)`` ignores ``d`` and ``dv`` (the file's
    head dims are used), picks one (batch, head) slice at random and returns
    ``n`` consecutive tokens starting at a random offset.  It raises
    ValueError if the file holds fewer than ``n`` tokens; experiments skip such
    sizes.
    """
    with np.load(path) as f:
        missing = {"q", "k", "v"} - set(f.files)
        if missing:
            raise ValueError(f"{path}: missing arrays {sorted(missing)} (need q, k, v)")
        q, k, v = (np.asarray(f[a], dtype=np.float64) for a in ("q", "k", "v"))
    if q.ndim < 2 or q.shape != k.shape or q.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"{path}: need q, k (..., N, d) of equal shape and v (..., N, dv), "
                         f"got {q.shape}, {k.shape}, {v.shape}")
    q, k, v = (a.reshape((-1,) + a.shape[-2:]) for a in (q, k, v))

    def make(n, d, dv, rng):
        total = q.shape[1]
        if n > total:
            raise ValueError(f"{os.path.basename(path)} has {total} tokens, {n} requested")
        g = int(rng.integers(q.shape[0]))
        s = int(rng.integers(total - n + 1))
        return q[g, s:s + n].copy(), k[g, s:s + n].copy(), v[g, s:s + n].copy()

    make.fixed_dims = True
    return make


def make_qkv(name, n, d, dv, seed):
    """Draw data set ``name`` with ``numpy.random.default_rng(seed)``; float64 copies."""
    try:
        make = DATASETS[name]
    except KeyError:
        raise ValueError(f"unknown data set {name!r}; known: {sorted(DATASETS)}") from None
    q, k, v = make(int(n), int(d), int(dv), np.random.default_rng(seed))
    return (np.asarray(q, dtype=np.float64), np.asarray(k, dtype=np.float64), np.asarray(v, dtype=np.float64))


def unit_rows(x):
    """Rows scaled to unit Euclidean norm (zero rows stay zero)."""
    x = np.asarray(x, dtype=np.float64)
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.where(n > 0, n, 1.0)

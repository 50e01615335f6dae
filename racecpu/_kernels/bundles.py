"""The named bundles of arrays that the kernels pass around.

Numba compiles a ``NamedTuple`` argument into a struct whose fields are
read at no cost, so a kernel takes a few meaningful bundles instead of
twenty positional arrays.  Shapes use ``G`` groups (batch x head), ``Nq``
queries, ``Nk`` keys, ``F = L * 2**P`` soft-hash values per token, ``LP = L * P``
projections per token, ``nc`` chunks; "compute dtype" is float32 or float64.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Hash(NamedTuple):
    """What defines the soft hash: planes ``W (L, P, d)`` in the compute dtype and ``beta`` (> 0)."""

    W: np.ndarray
    beta: float


class HashScratch(NamedTuple):
    """Scratch of :func:`racecpu._kernels.hash.hash_block` for HASH_BLOCK rows, in the planes' dtype:
    ``U``, ``a``, ``b`` (HASH_BLOCK * LP values) and ``ph`` (HASH_BLOCK * F values)."""

    U: np.ndarray
    a: np.ndarray
    b: np.ndarray
    ph: np.ndarray


class Rows(NamedTuple):
    """Per-token residual rows, compute dtype except ``den`` (float64).

    ``phiq (G, Nq, F)``, ``tq (G, Nq, LP)``, ``phik (G, Nk, F)``, ``tk (G, Nk, LP)``,
    ``den (G, Nq)``.  Any of them may have no rows (shape ``(G, 0, ...)``) where
    nothing reads it later: the kernels then keep those rows in per-chunk
    scratch (:func:`racecpu._kernels.hash.residual_rows`).
    """

    phiq: np.ndarray
    tq: np.ndarray
    phik: np.ndarray
    tk: np.ndarray
    den: np.ndarray


class Sums(NamedTuple):
    """A sketch ``(A, B)`` or its cotangent ``(dA, dB)``, float64 unless said otherwise.

    Per group ``A (G, F)``, ``B (G, F, dv)``, or per chunk ``(G, nc, F)``,
    ``(G, nc, F, dv)``: chunk totals, or the carries (exclusive prefix or
    suffix sums) at every chunk's start.
    """

    A: np.ndarray
    B: np.ndarray


class PlanesGrad(NamedTuple):
    """What the planes' gradient reads and writes: the forward's rows
    ``q (G, Nq, d)``, ``k (G, Nk, d)`` (compute dtype) and the per-chunk
    shares ``dWq (G, ncq, LP, d)``, ``dWk (G, nck, LP, d)`` (float64, each
    chunk's ``du^T x`` over its query or key rows, summed by the caller).

    ``dWq`` and ``dWk`` with no rows per chunk (``(G, nc, 0, d)``, as the
    engine passes them when no planes' gradient is asked for): not
    computed, and q and k are not read.
    """

    q: np.ndarray
    k: np.ndarray
    dWq: np.ndarray
    dWk: np.ndarray


class Grads(NamedTuple):
    """What a backward writes: ``dq (G, Nq, d)``, ``dk (Gk, Nk, d)``, ``dv (Gk, Nk, dv)``
    (compute dtype; ``Gk`` key/value groups, ``G // Gk`` query groups each
    under grouped-query attention), ``dden (G, Nq)`` (float64, the causal
    passes' cotangent of each denominator), the per-chunk shares of dbeta
    ``dbq (G, ncq)``, ``dbk (Gk, nck)`` (float64, summed by the caller) and
    the :class:`PlanesGrad` (per-chunk shares of the planes' gradient, or none)."""

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dden: np.ndarray
    dbq: np.ndarray
    dbk: np.ndarray
    planes: PlanesGrad


class Chunks(NamedTuple):
    """How a sequence axis is cut into chunks: chunk ``c`` is rows
    ``cuts[c] <= i < cuts[c + 1]`` (``cuts (nc + 1,)`` int64) of packed sequence
    ``seq[c]`` (``(nc,)`` int64; one sequence: zeros).  Unpacked, every chunk
    but the last has the same length (:func:`racecpu._kernels.scan.even_chunks`)."""

    cuts: np.ndarray
    seq: np.ndarray


class Forward(NamedTuple):
    """What every task of a causal scan reads or writes: queries ``q (G, N, d)``,
    values ``v (Gk, N, dv)``, the :class:`Hash`, the :class:`Rows` (``phik``
    read; ``phiq``, ``tq``, ``den`` written where kept), ``out (G, N, dv)`` and
    the :class:`Chunks` (each chunk's rows and packed sequence: the scan
    restarts at each)."""

    q: np.ndarray
    v: np.ndarray
    hsh: Hash
    rows: Rows
    out: np.ndarray
    chunks: Chunks


class Backward(NamedTuple):
    """What every task of a backward reads or writes: ``grad (G, Nq, dv)``
    (the output's cotangent), ``v (Gk, Nk, dv)``, the forward's :class:`Rows`,
    the :class:`Hash`, the :class:`Grads` to write and the :class:`Chunks`
    (each chunk's rows and packed sequence: the sketch it reads, where the
    scans restart).  Made once per call by the engine and handed to every
    backward kernel of it."""

    grad: np.ndarray
    v: np.ndarray
    rows: Rows
    hsh: Hash
    grads: Grads
    chunks: Chunks


class QueryScratch(NamedTuple):
    """Per-task scratch of a query chunk's backward: ``wq (F,)`` float64, the
    weights ``wblock (n, F)`` with which the chunk's g enter dB (compute
    dtype), the chunk's ``dA (F,)`` float64 and its dphi rows ``DPHI (n, F)``
    float64."""

    wq: np.ndarray
    wblock: np.ndarray
    dA: np.ndarray
    DPHI: np.ndarray


class Spread(NamedTuple):
    """An ``order (G * nc,)`` of (group, chunk) tasks that spreads the costly
    chunks ``t0 <= c < t1`` of every group (they also sum a product total)
    evenly over every thread's share (:func:`racecpu._kernels.scan.spread_order`)."""

    order: np.ndarray
    t0: int
    t1: int

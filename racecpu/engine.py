"""The CPU engine: the one caller of racecpu's Numba kernels.

Every CPU computation of racecpu's kernels goes through here (``docs/design.md``,
"Map of the engine"):

* **whole calls** -- :func:`forward` and :func:`backward` of the paper's ratio
  estimator, which the CPU backend (:data:`racecpu.backend.CPU`) runs for the
  NumPy API (:mod:`racecpu.attention`, and through it :mod:`racecpu.torch`,
  :mod:`racecpu.jax`, :mod:`racecpu.autograd`): checks, a :class:`racecpu.plan.Plan`,
  the kernels in the plan's order, the outputs in the caller's dtype, and
  the :class:`Residuals` the backward reads;
* **blocks** -- what the block-wise frontends compose (:mod:`racecpu.sketches`,
  :mod:`racecpu.streaming`, :mod:`racecpu.outofcore`, and through the
  sketches :mod:`racecpu.dask`): a block of keys' sketch (:func:`sketch_keys`),
  its readout by queries (:func:`readout`), both backwards
  (:func:`readout_bwd`, :func:`keys_bwd`), a causal block from a carried
  state (:func:`advance`), its backward with a carried cotangent
  (:func:`advance_bwd`) and the cotangent its outputs send to the state
  (:func:`state_cotangent`); and the soft hash alone (:func:`soft_hash`).

Block functions take arrays already checked and laid out as the kernels
want them: C-contiguous ``q (G, n, d)``, ``k (Gk, n, d)``, ``v (Gk, n, dv)``
in the compute dtype (float32 or float64), planes ``(L, P, d)`` in the same
dtype, float64 sketches and states ``A (Gk, F)``, ``B (Gk, F, dv)``.  They
never write into their inputs; every array they return is new or comes from
the caller's *workspace*, a callable ``work(name, shape, dtype, zero=False)``
(:class:`racecpu._memory.Buffers`, which reuses one buffer per name; default
:func:`pool_work`, racecpu's result pool).  With ``check_finite`` they raise
ValueError, as the NumPy API does, on NaN/Inf in what they read (found from
what the kernels derived: ``racecpu._checks.check_derived``).

The estimator -- how a query reads the keys' sums -- is a seam: the kernels'
:mod:`racecpu._kernels.readout` computes the paper's ratio, which every
function here computes; another estimator is another whole-call forward and
backward beside these (the per-bucket mean: :mod:`racecpu.bucket_mean`, in
NumPy), chosen by the CPU backend (:data:`racecpu.backend.ESTIMATORS`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np

from . import _fork
from . import _kernels as K
from ._arrays import namespace_of, to_namespace
from ._checks import (OVERFLOW_MARGIN, all_finite, check_array, check_derived, check_grad_buffers, check_narrowed,
                      check_out, check_results, deliver, kv_lead, max_abs, planes_grad_dtype, prepare, sums_overflow,
                      widened)
from ._kernels import set_threads, threads  # noqa: F401  (racecpu's: the kernels' thread count)
from ._memory import POOL
from .packing import sequence_sums
from .plan import Plan, cpu_chunk_model, make_plan, scan_segments

__all__ = ["forward", "backward", "Residuals", "Advanced", "KeyRows", "soft_hash", "group_sum", "sketch_keys",
           "readout", "readout_bwd", "keys_bwd", "KeyPass", "advance_keys",
           "state_after", "advance", "advance_bwd", "state_cotangent", "pool_work"]

#: The rows a causal block's backward reads besides ``phik`` (which every causal forward keeps):
#: :func:`advance`'s default ``keep``, and what a kept forward holds.
BACKWARD_ROWS = ("phiq", "tq", "tk", "den")

#: Why a finite q or k whose tanh projections are NaN is an error.
PROJECTIONS_OVERFLOW = "its projections onto the planes overflow {}"


# ---------------------------------------------------------------------------
# workspaces and the kernels' bundles
# ---------------------------------------------------------------------------

def pool_work(name, shape, dtype, zero=False):
    """The default workspace: every buffer from racecpu's result pool (README, "Memory")."""
    return POOL.zeros(shape, dtype) if zero else POOL.empty(shape, dtype)


def _none(G, dtype, width=None):
    """A residual with no rows, ``(G, 0, width)`` (``(G, 0)`` for width None): the kernels
    keep such rows in per-chunk scratch, or (gradients) write nothing there."""
    return np.empty((G, 0) if width is None else (G, 0, width), dtype)


def _rows(G, Gk, nq, nk, F, LP, cdt, work, keep=("phiq", "tq", "phik", "tk", "den")):
    """The kernels' :class:`Rows`: ``phiq``, ``tq``, ``den`` of ``nq`` rows in ``G`` groups and
    ``phik``, ``tk`` of ``nk`` rows in ``Gk`` groups, those named in ``keep`` from ``work``
    (``den`` zeroed), the others with no rows."""
    def rows(name, g, n, width, dt):
        if name not in keep:
            return _none(g, dt, width)
        return work(name, (g, n) if width is None else (g, n, width), dt, zero=name == "den")
    return K.Rows(rows("phiq", G, nq, F, cdt), rows("tq", G, nq, LP, cdt), rows("phik", Gk, nk, F, cdt),
                  rows("tk", Gk, nk, LP, cdt), rows("den", G, nq, None, np.float64))


def _no_planes_grad(cdt, G, Gk, ncq, nck, d):
    """A :class:`PlanesGrad` that computes nothing: shares with no rows, never read rows."""
    return K.PlanesGrad(_none(G, cdt, d), _none(Gk, cdt, d), np.empty((G, ncq, 0, d)), np.empty((Gk, nck, 0, d)))


def _grads(cdt, G, Gk, d, dv, ncq, nck, *, dq=None, dk=None, dv_=None, dden=None, dbq=None, dbk=None, planes=None):
    """The kernels' :class:`Grads`; what a call does not compute has no rows (and is not written)."""
    return K.Grads(_none(G, cdt, d) if dq is None else dq, _none(Gk, cdt, d) if dk is None else dk,
                   _none(Gk, cdt, dv) if dv_ is None else dv_, _none(G, np.float64) if dden is None else dden,
                   np.empty((G, 0)) if dbq is None else dbq, np.empty((Gk, 0)) if dbk is None else dbk,
                   _no_planes_grad(cdt, G, Gk, ncq, nck, d) if planes is None else planes)


def _cuts(packing, n, length):
    """The kernels' :class:`Chunks` of ``n`` tokens: the packed sequences' chunks, or chunks of ``length``."""
    if packing is not None:
        return K.Chunks(*packing.chunks)
    return K.even_chunks(n, length)


def _chunk_sum(part):
    """``part (G, nc, ...)`` summed over its chunks (axis 1), in chunk order.  With one chunk,
    the view of it: a sum of one value is that value (the same bits), and the reduction and
    the fresh result it wrote were a visible share of a short call's fixed cost."""
    return part[:, 0] if part.shape[1] == 1 else part.sum(1)


def _on_threads(tokens, chunk, n):
    """Where a kernel call of ``tokens`` tokens in all, ``n`` per group, in chunks of ``chunk``
    runs (:func:`racecpu._kernels.task_threads`); a group shorter than a chunk has chunks of
    ``n`` tokens, which is what decides whether BLAS can be reached."""
    return K.task_threads(tokens, min(chunk, n))


def _sketch_per_sequence(A, B):
    """A sketch ``A (G, F)``, ``B (G, F, dv)`` as the kernels read it: one per packed sequence (S = 1)."""
    return K.Sums(A[:, None], B[:, None])


def _repeat(x, group):
    """``x (Gk, ...)`` with each group repeated ``group`` times along axis 0 (``x`` itself for 1),
    into memory from the pool (a training loop does not fault fresh pages in for it every step)."""
    if group == 1:
        return x
    y = POOL.empty((x.shape[0] * group,) + x.shape[1:], x.dtype)
    y.reshape((x.shape[0], group) + x.shape[1:])[...] = x[:, None]
    return y


def _once(work, key, make):
    """``make()``, once per ``key`` where the workspace keeps what it made
    (:meth:`racecpu._memory.Buffers.memo`: a decode loop), else every call."""
    memo = getattr(work, "memo", None)
    return make() if memo is None else memo(key, make)


def _check_hash(check_finite, name, x, nan):
    check_derived(check_finite, (name, x, nan == 0, PROJECTIONS_OVERFLOW.format(x.dtype)))


# ---------------------------------------------------------------------------
# blocks
# ---------------------------------------------------------------------------

def soft_hash(x, planes, beta, t, phi):
    """The soft hash of every row of ``x (M, d)``: ``phi (M, F)`` and ``t (M, L*P)`` written
    (planes in x's dtype; the public :func:`racecpu.soft_buckets`)."""
    K.soft_hash_rows(x, K.Hash(planes, beta), t, phi)


def group_sum(x, group):
    """``x (Gk * group, ...)`` summed over each run of ``group`` along axis 0, on every core
    (``x`` itself for 1): what a key/value head's query heads send it."""
    return K.group_sum(x, group)


class KeyRows(NamedTuple):
    """A non-causal block of keys' rows as :func:`sketch_keys` (``keep=True``) hashed them and
    :func:`keys_bwd` reads them: soft buckets ``phik (Gk, n, F)`` and projections ``tk (Gk, n,
    L P)``, k's compute dtype (``2 (F + L P) * itemsize`` bytes a key: 132 at float32, P = L = 3)."""

    phik: np.ndarray
    tk: np.ndarray


def sketch_keys(k, v, mask, planes, beta, *, check_finite=False, keep=False, work=pool_work):
    """The non-causal sketch of a block of keys: ``(A (Gk, F), B (Gk, F, dv), rows)``, A and B
    float64 new arrays.

    Summed per task of the whole call's forward (:attr:`racecpu.plan.Plan.task`); ``mask
    (Gk, n)`` bool leaves keys out.  ``keep``: ``rows`` are the keys' soft buckets ``phik
    (Gk, n, F)`` and projections ``tk (Gk, n, L P)`` in k's dtype, from ``work``, which
    :func:`keys_bwd` reads instead of hashing the keys again; else ``rows`` is None.
    ``check_finite``: k's NaN/Inf, and v's (from B), raise ValueError.
    """
    Gk, nk, d = k.shape
    dv = v.shape[2]
    L, P, _ = planes.shape
    plan = make_plan(G=Gk, group=1, nq=0, nk=nk, d=d, dv=dv, L=L, P=P, causal=False)
    F = plan.F
    rows = _rows(Gk, Gk, 0, nk if keep else 0, F, plan.LP, k.dtype, work, keep=("phik", "tk") if keep else ())
    kept = KeyRows(rows.phik, rows.tk) if keep else None
    if not (Gk and nk):
        return np.zeros((Gk, F)), np.zeros((Gk, F, dv)), kept
    partA, partB = np.zeros((Gk, plan.nck_task, F)), np.empty((Gk, plan.nck_task, F, dv))
    with _on_threads(Gk * nk, plan.task, nk):
        nan = K.sketch_chunks(k, v, mask, K.Hash(planes, beta), _cuts(None, nk, plan.task), rows,
                              K.Sums(partA, partB), span=K.SKETCH_FUSED)
    A, B = _chunk_sum(partA), _chunk_sum(partB)
    check_derived(check_finite, ("k", k, nan == 0, PROJECTIONS_OVERFLOW.format(k.dtype)),
                  ("v", v, all_finite(B), sums_overflow(k.dtype)))
    return A, B, kept


def _readout_rows(q, A, Bc, hsh, chunk, rows, out):
    """Queries' hash and readout of the sketch ``A (G, F)`` (float64), ``Bc (G, F, dv)`` (q's
    dtype); the NaN count."""
    G, nq, _ = q.shape
    with _on_threads(G * nq, chunk, nq):
        return K.queries_fwd(q, hsh, _cuts(None, nq, chunk), _sketch_per_sequence(A, Bc), rows, out)


def readout(q, A, B, planes, beta, *, check_finite=False, work=pool_work):
    """Non-causal attention of queries ``q (G, n, d)`` against the sketch ``A (G, F)``,
    ``B (G, F, dv)`` (float64): ``out (G, n, dv)`` in q's dtype, from ``work("out")``.

    ``check_finite``: q's NaN/Inf raise ValueError.
    """
    G, nq, d = q.shape
    F, dv = B.shape[1:]
    L, P, _ = planes.shape
    out = work("out", (G, nq, dv), q.dtype)
    if G and nq:
        chunk = cpu_chunk_model().length(nq, G, F, dv)
        rows = _rows(G, G, 0, 0, F, L * P, q.dtype, work, keep=())
        _check_hash(check_finite, "q", q, _readout_rows(q, A, B.astype(q.dtype), K.Hash(planes, beta), chunk, rows,
                                                         out))
    return out


def readout_bwd(q, A, B, grad, planes, beta, *, check_finite=False, work=pool_work):
    """Backward of :func:`readout` (the queries' hash and den recomputed): ``(dq (G, n, d), dA (G, F),
    dB (G, F, dv), dbeta)``, dq from ``work("dq")``, dA and dB new float64 arrays.

    ``grad (G, n, dv)``: the cotangent of the output.  ``check_finite``: q's and grad's
    NaN/Inf raise ValueError.
    """
    G, nq, d = q.shape
    F, dv = B.shape[1:]
    L, P, _ = planes.shape
    cdt = q.dtype
    dq = work("dq", (G, nq, d), cdt)
    if not (G and nq):
        check_array("grad_out", grad, check_finite)
        dq[...] = 0
        return dq, np.zeros((G, F)), np.zeros((G, F, dv)), 0.0
    chunk = cpu_chunk_model().length(nq, G, F, dv)
    nc = -(-nq // chunk)
    hsh, Bc = K.Hash(planes, beta), B.astype(cdt)
    rows = _rows(G, G, nq, 0, F, L * P, cdt, work, keep=("phiq", "tq", "den"))
    # the queries' hash and den only: their backward reads y = B g, not the output (no F x dv product per row)
    _check_hash(check_finite, "q", q, _readout_rows(q, A, Bc, hsh, chunk, rows, np.empty((G, 0, dv), cdt)))
    pdA, pdB = work("pdA", (G, nc, F), np.float64, zero=True), work("pdB", (G, nc, F, dv), np.float64)
    dbq = work("dbq", (G, nc), np.float64, zero=True)
    chunks = _cuts(None, nq, chunk)
    grads = _grads(cdt, G, G, d, dv, nc, nc, dq=dq, dbq=dbq)
    with _on_threads(G * nq, chunk, nq):
        K.queries_bwd(K.Backward(grad, _none(G, cdt, dv), rows, hsh, grads, chunks), _sketch_per_sequence(A, Bc),
                      K.Sums(pdA, pdB))
    dA, dB = pdA.sum(1), pdB.sum(1)  # fresh arrays: pdA and pdB are the workspace's, reused by the next call
    check_derived(check_finite, ("grad_out", grad, all_finite(dB), sums_overflow(cdt)))
    return dq, dA, dB, float(dbq.sum())


def _hash_keys(k, v, mask, hsh, chunk, rows):
    """Soft-hash every row of ``k (Gk, n, d)`` into ``rows.phik`` (and ``rows.tk``), masked
    rows zero, with no sketch summed (the keys' sketch without totals); the NaN count."""
    Gk, n, _ = k.shape
    nc = -(-n // chunk)
    with _on_threads(Gk * n, chunk, n):
        return K.sketch_chunks(k, v, mask, hsh, _cuts(None, n, chunk), rows,
                               K.Sums(np.zeros((Gk, nc, rows.phik.shape[2])), np.empty((Gk, nc, 0, 0))),
                               totals=(0, 0))


def keys_bwd(k, v, mask, dA, dB, planes, beta, *, check_finite=False, work=pool_work, rows=None):
    """Backward of a block of keys' sketch: ``(dk (Gk, n, d), dv (Gk, n, dv), dbeta)`` from the
    sketch's cotangent ``dA (Gk, F)``, ``dB (Gk, F, dv)`` (float64), from ``work("dk")``,
    ``work("dv")``.  Masked keys get zeros.  ``check_finite``: k's NaN/Inf raise ValueError.

    ``rows``: the :class:`KeyRows` that :func:`sketch_keys` (``keep=True``)
    made of the same ``k``, ``mask`` and planes, read instead of hashing the keys again (the
    same bits); k's values are then not read (its NaN/Inf were checked by that sketch).
    """
    Gk, nk, d = k.shape
    dv = v.shape[2]
    L, P, _ = planes.shape
    F = L * 2 ** P
    cdt = k.dtype
    dk, dv_ = work("dk", (Gk, nk, d), cdt), work("dv", (Gk, nk, dv), cdt)
    if not (Gk and nk):
        dk[...] = 0
        dv_[...] = 0
        return dk, dv_, 0.0
    chunk = cpu_chunk_model().length(nk, Gk, F, dv)
    nc = -(-nk // chunk)
    hsh = K.Hash(planes, beta)
    if rows is None:
        rows = _rows(Gk, Gk, 0, nk, F, L * P, cdt, work, keep=("phik", "tk"))
        _check_hash(check_finite, "k", k, _hash_keys(k, v, mask, hsh, chunk, rows))
    else:
        if rows.phik.shape != (Gk, nk, F) or rows.tk.shape != (Gk, nk, L * P) or rows.phik.dtype != cdt:
            raise ValueError(f"the kept rows are of {rows.phik.shape[:2]} keys in {rows.phik.dtype}, not of this "
                             f"block's {(Gk, nk)} in {cdt}")
        rows = _rows(Gk, Gk, 0, 0, F, L * P, cdt, work, keep=())._replace(phik=rows.phik, tk=rows.tk)
    dbk = work("dbk", (Gk, nc), np.float64, zero=True)
    with _on_threads(Gk * nk, chunk, nk):
        K.keys_bwd(v, rows, _sketch_per_sequence(dA, dB.astype(cdt)), hsh, _cuts(None, nk, chunk),
                   _grads(cdt, Gk, Gk, d, dv, nc, nc, dk=dk, dv_=dv_, dbk=dbk))
    return dk, dv_, float(dbk.sum())


class Advanced(NamedTuple):
    """What :func:`advance` returns: the state after the block ``A (Gk, F)``,
    ``B (Gk, F, dv)`` float64 (new arrays); what a backward of the block
    reads: the ``chunk`` length, the carried-in state of every chunk
    ``carryA (Gk, nc, F)``, ``carryB (Gk, nc, F, dv)`` and the ``rows`` the
    kernels derived (soft buckets, projections, denominators); the NaN
    counts of the queries' and the keys' tanh projections."""

    A: np.ndarray
    B: np.ndarray
    chunk: int
    carryA: np.ndarray
    carryB: np.ndarray
    rows: K.Rows
    nan_q: int
    nan_k: int

    def to_arrays(self):
        """Its fields as a dict of named arrays (for ``np.savez``: no pickle needed)."""
        d = {f"rows_{f}": getattr(self.rows, f) for f in K.Rows._fields}
        return dict(d, A=self.A, B=self.B, carryA=self.carryA, carryB=self.carryB,
                    ints=np.array([self.chunk, self.nan_q, self.nan_k], np.int64))

    @classmethod
    def from_arrays(cls, d):
        """The :class:`Advanced` of :meth:`to_arrays`'s dict ``d`` (its arrays by reference)."""
        chunk, nan_q, nan_k = (int(x) for x in d["ints"])
        return cls(d["A"], d["B"], chunk, d["carryA"], d["carryB"], K.Rows(*(d[f"rows_{f}"] for f in K.Rows._fields)),
                   nan_q, nan_k)


def _causal_rows(G, Gk, n, F, LP, cdt, work, keep):
    return _rows(G, Gk, n, n, F, LP, cdt, work, keep=("phik",) + tuple(keep))


class KeyPass(NamedTuple):
    """What :func:`advance_keys` returns: a causal block's keys hashed and summed per
    chunk, which :func:`advance` scans the block's queries against.  ``chunk``: the
    chunk length; ``chunks``: the kernels' chunk grid; ``rows``: the kernels' rows
    for the whole block (the keys' ``phik``/``tk`` written, the queries' rows still
    to be written); ``partA (Gk, nc, F)``, ``partB (Gk, nc, F, dv)`` float64: each
    chunk's total; ``nan_k``: the NaN count of the keys' tanh projections; ``G``:
    the query groups the rows were made for."""

    chunk: int
    chunks: object
    rows: K.Rows
    partA: np.ndarray
    partB: np.ndarray
    nan_k: int
    G: int
    segments: int = 0


def advance_keys(k, v, planes, beta, G, *, mask=None, keep=BACKWARD_ROWS, check_finite=False,
                 work=pool_work, segmented=False):
    """The keys' half of :func:`advance`: hash a causal block's keys and sum each chunk.

    ``k (Gk, n, d)``, ``v (Gk, n, dv)`` as for :func:`advance`; ``G``: the
    query groups that will read them (``Gk`` divides ``G``).  Returns a
    :class:`KeyPass`; ``state_after(pass, A0, B0)`` is the state after the
    block without its queries, and ``advance(..., keys=pass)`` finishes the
    block with the same bits as an :func:`advance` that hashes the keys
    itself.  ``mask``, ``keep`` and ``work`` as for :func:`advance` (the rows
    of the queries are made here too, so that the pass holds every row a
    backward reads).  ``check_finite``: k's and v's NaN/Inf raise ValueError.
    ``segmented``: for :func:`advance`'s ``scan=True`` only: the B totals of
    the chunks before the scan's last segment alone (``segments`` says how
    many), the others not written.
    """
    _fork.check()
    Gk, n, d = k.shape
    dv = v.shape[2]
    L, P, _ = planes.shape
    F = L * 2 ** P
    cdt = k.dtype
    model = cpu_chunk_model()

    def setup():  # what depends on the shapes alone: made once per shape in a decode loop's workspace
        chunk = model.length(n, G, F, dv)
        return (chunk, -(-n // chunk), _cuts(None, n, chunk), _causal_rows(G, Gk, n, F, L * P, cdt, work, keep),
                np.ones((Gk, n), np.bool_))
    chunk, nc, chunks, rows, ones = _once(work, ("advance", model, G, Gk, n, F, L * P, dv, cdt, keep), setup)
    mask = ones if mask is None else mask
    partA = work("partA", (Gk, nc, F), np.float64, zero=True)
    partB = work("partB", (Gk, nc, F, dv), np.float64, zero=True)
    seg = scan_segments(Gk, nc, n) if segmented else 0
    totals = (0, K.segment_start(seg - 1, seg, nc)) if segmented else None
    with _on_threads(Gk * n, chunk, n):
        nan_k = K.sketch_chunks(k, v, mask, K.Hash(planes, beta), chunks, rows, K.Sums(partA, partB), totals=totals)
    check_derived(check_finite, ("k", k, nan_k == 0, PROJECTIONS_OVERFLOW.format(cdt)),
                  ("v", v, segmented or all_finite(partB), sums_overflow(cdt)))  # segmented: checked after the scan
    return KeyPass(chunk, chunks, rows, partA, partB, nan_k, G, seg)


def state_after(keys, A0, B0):
    """The state after a causal block, ``A0 + sum of its chunks`` (new float64 arrays;
    one chunk: its total itself, as :func:`advance` adds it)."""
    return A0 + _chunk_sum(keys.partA), B0 + _chunk_sum(keys.partB)


def advance(q, k, v, planes, beta, A0, B0, out, *, mask=None, keep=BACKWARD_ROWS,
            check_finite=False, work=pool_work, keys=None, scan=False):
    """Causal attention of a block of tokens from a carried state; the state after it.

    ``q (G, n, d)``, ``k (Gk, n, d)``, ``v (Gk, n, dv)`` (``Gk`` divides ``G``:
    query group g reads key group ``g // (G // Gk)``), ``A0 (Gk, F)``, ``B0 (Gk,
    F, dv)`` float64: the state before the block (read only).  Writes the
    outputs to ``out (G, n, dv)`` and returns :class:`Advanced`.  The chunk
    grid and float64 carries are those of the whole call's causal forward,
    with ``(A0, B0)`` added to every chunk's carried-in state.  ``mask (Gk, n)``
    bool leaves keys out (default: every key counts).  The rows the kernels
    derive (soft buckets, projections, denominators) are taken from
    ``work`` by name, those named in ``keep`` with every row (a backward
    reads them), the others only per chunk; ``phik`` always has every row.
    ``keys``: the block's :class:`KeyPass` from :func:`advance_keys` (same
    ``k``, ``v``, ``mask``, ``keep``), so that the keys are not hashed again
    (its rows are written into and returned); ``k`` is then not read.
    ``check_finite``: q's, k's and v's NaN/Inf raise ValueError.

    ``scan``: the state summed by the scan itself, as the whole call's
    forward sums it, rather than from every chunk's total summed first by
    the keys' pass (no ``keys``): the B totals of only the chunks before the
    scan's last segment (:func:`racecpu.plan.scan_segments`; on one thread,
    none), so about a sgemm per token less.  The state after the block is the
    scan's, and the carries of a block after the first differ from the
    default's by rounding: they are summed from ``B0`` on, not added to it.
    """
    G, n, d = q.shape
    L, P, _ = planes.shape
    cdt = q.dtype
    if scan and keys is not None:
        raise ValueError("advance(scan=True) makes its own keys' pass: no keys=")
    if keys is None:
        keys = advance_keys(k, v, planes, beta, G, mask=mask, keep=keep, work=work, segmented=scan)
    else:
        _fork.check()
    chunk, rows, partA, partB = keys.chunk, keys.rows, keys.partA, keys.partB
    nc, seg = partA.shape[1], keys.segments or None  # scan: the scan's segments; else one per chunk
    if nc == 1:  # one chunk: its carried-in state is the state itself (0 + A0 would be the same number)
        carryA, carryB = A0[:, None], B0[:, None]
    else:
        carryA = K.exclusive_scan(partA)
        carryA += A0[:, None]
        if scan:  # each segment's first carry, from B0 on; the scan writes the rest
            carryB = K.exclusive_scan(partB, out=partB, segments=seg)
            for s in range(seg):
                carryB[:, K.segment_start(s, seg, nc)] += B0
        else:
            carryB = K.exclusive_scan(partB)
            carryB += B0[:, None]
    B1 = np.empty_like(B0) if scan else None
    with _on_threads(G * n, chunk, n):
        nan_q = K.causal_fwd(K.Forward(q, v, K.Hash(planes, beta), rows, out, keys.chunks), K.Sums(carryA, carryB),
                             final=B1, segments=seg)
    if scan:  # B: the scan's; A: as state_after sums it
        A1 = A0 + _chunk_sum(partA)
    else:
        A1, B1 = state_after(keys, A0, B0)  # the chunk totals' float64 sum
    if check_finite:
        ov = PROJECTIONS_OVERFLOW.format(cdt)
        check_derived(True, ("q", q, nan_q == 0, ov), ("k", k, keys.nan_k == 0, ov),
                      ("v", v, all_finite(B1), sums_overflow(cdt)))
        check_results(True, (("v", v, max_abs(B1)),), cdt, L, (out,))
    return Advanced(A1, B1, chunk, carryA, carryB, rows, nan_q, keys.nan_k)


def advance_bwd(q, k, v, grad, planes, beta, A0, B0, dA1=None, dB1=None, *, mask=None, queries_only=False,
                check_finite=False, work=pool_work, step=None, scan=False):
    """Backward of :func:`advance` (its forward recomputed from the block and its state).

    ``grad (G, n, dv)``: the cotangent of the block's output; ``dA1 (Gk, F)``,
    ``dB1 (Gk, F, dv)`` float64: the cotangent of the state after the block
    (the reverse carry from every later block; None: zero, the last block).
    Returns ``(dq, dk, dv, dbeta, dA0, dB0)``: the rows' gradients (from
    ``work``), the block's share of dbeta, and the cotangent of the state
    before the block (new float64 arrays: ``dA1, dB1`` plus what the block's
    queries send back).  ``queries_only``: only ``(dA0, dB0)`` (the queries'
    pass alone).  ``check_finite``: q's, k's, v's and grad's NaN/Inf raise
    ValueError.  ``step``: the block's forward, an :class:`Advanced` of
    :func:`advance` with the default ``keep`` on these arguments and a
    workspace of its own (its rows are read, not written), so that the
    forward is not recomputed; q's, k's and v's values are then not checked
    again.  ``scan``: a recomputed forward is :func:`advance`'s with
    ``scan=True`` (as the block's forward was made).
    """
    G, n, d = q.shape
    Gk, _, dv = v.shape
    L, P, _ = planes.shape
    F = L * 2 ** P
    cdt = q.dtype
    sA = np.zeros((Gk, F)) if dA1 is None else dA1
    sB = np.zeros((Gk, F, dv)) if dB1 is None else dB1
    # the kernels write every row (on either route), as the whole call's backward relies on: no zeroing
    dq, dk, dv_ = (work(name, (g, n, x), cdt) for name, g, x in (("dq", G, d), ("dk", Gk, d), ("dv", Gk, dv)))
    if not (G and n):
        check_array("grad_out", grad, check_finite)
        dA0, dB0 = sA.copy(), sB.copy()
        return (dA0, dB0) if queries_only else (dq, dk, dv_, 0.0, dA0, dB0)
    if step is None:
        step = advance(q, k, v, planes, beta, A0, B0, work("out", (G, n, dv), cdt), mask=mask,
                       check_finite=check_finite, work=work, scan=scan)
    chunk, nc = step.chunk, step.carryA.shape[1]
    pdA = work("pdA", (Gk, nc, F), np.float64, zero=True)
    pdB = work("pdB", (Gk, nc, F, dv), np.float64, zero=True)
    dbq, dbk = work("dbq", (G, nc), np.float64, zero=True), work("dbk", (Gk, nc), np.float64, zero=True)
    grads = _grads(cdt, G, Gk, d, dv, nc, nc, dq=dq, dk=dk, dv_=dv_, dden=work("dden", (G, n), np.float64, zero=True),
                   dbq=dbq, dbk=dbk)
    bwd = K.Backward(grad, v, step.rows, K.Hash(planes, beta), grads, _cuts(None, n, chunk))
    if not queries_only and scan_segments(Gk, nc, n) == 1:
        # One task per group (a Dask worker's one thread): the one-pass route, whose reverse
        # carries start from (sA, sB) and which sums no dB total per chunk twice, as the
        # whole call's backward runs there (docs/performance.md, "one-pass block backward").
        dA0, dB0 = sA.copy(), np.empty_like(sB)
        with _on_threads(G * n, chunk, n):
            K.causal_bwd(bwd, K.Sums(step.carryA, step.carryB), K.Sums(pdA, pdB), final=dB0,
                         ends=K.Sums(dA0, sB))
        check_derived(check_finite, ("grad_out", grad, all_finite(dB0), sums_overflow(cdt)))
        return dq, dk, dv_, float(dbq.sum() + dbk.sum()), dA0, dB0
    with _on_threads(G * n, chunk, n):
        K.causal_queries_bwd(bwd, K.Sums(step.carryA, step.carryB), K.Sums(pdA, pdB))
    dA0, dB0 = sA + _chunk_sum(pdA), sB + _chunk_sum(pdB)
    check_derived(check_finite, ("grad_out", grad, all_finite(dB0), sums_overflow(cdt)))
    if queries_only:
        return dA0, dB0
    cdA, cdB = K.exclusive_scan(pdA, reverse=True), K.exclusive_scan(pdB, reverse=True)
    cdA += sA[:, None]
    cdB += sB[:, None]
    with _on_threads(G * n, chunk, n):
        K.causal_keys_bwd(bwd, K.Sums(cdA, cdB))
    return dq, dk, dv_, float(dbq.sum() + dbk.sum()), dA0, dB0


def state_cotangent(q, k, mask, out, grad, planes, beta, A0, *, check_finite=False, rows=None):
    """The cotangent a causal block's outputs send to its carried-in state ``A0 (G, F)``,
    from the outputs ``out (G, n, dv)`` themselves (no rescan; ``docs/design.md`` section
    3.4): ``(dA (G, F), dB (G, F, dv))`` float64, new arrays.

    ``rows``: the block's forward's rows (:attr:`Advanced.rows`, ``phiq`` and
    ``phik`` of every row), read instead of hashing ``q`` and ``k`` again (which
    are then not read).  ``check_finite``: k's, q's and grad's NaN/Inf raise
    ValueError, in that order (q's and k's only where they are hashed here).
    """
    G, n, d = q.shape
    dv = grad.shape[2]
    L, P, _ = planes.shape
    F = L * 2 ** P
    cdt = q.dtype
    dA, dB = np.zeros((G, F)), np.zeros((G, F, dv))
    if not (G and n):
        return dA, dB
    if rows is not None:
        phiq, phik = rows.phiq, rows.phik
    else:
        chunk = cpu_chunk_model().length(n, G, F, dv)
        hsh = K.Hash(planes, beta)
        phi = {}
        for name, x, m in (("k", k, mask), ("q", q, np.ones((G, n), np.bool_))):  # masked keys: phi = 0
            phi[name] = POOL.empty((G, n, F), cdt)
            r = K.Rows(_none(G, cdt, F), _none(G, cdt, L * P), phi[name], _none(G, cdt, L * P), _none(G, np.float64))
            _check_hash(check_finite, name, x, _hash_keys(x, grad, m, hsh, chunk, r))
        phiq, phik = phi["q"], phi["k"]
    check_array("grad_out", grad, check_finite)
    w = POOL.empty((G, n, F), cdt)
    K.state_cotangent_rows(phiq, phik, A0, out, grad, L, dA, w)
    for h in range(G):
        dB[h] = np.dot(w[h].T, grad[h])  # one product over the block in the compute dtype (BLAS)
    check_derived(check_finite, ("grad_out", grad, all_finite(dB), sums_overflow(cdt)))
    return dA, dB


# ---------------------------------------------------------------------------
# whole calls of the ratio estimator (the CPU backend runs them)
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Residuals:
    """What :func:`racecpu.race_attention_bwd` needs from the forward (treat as opaque).

    Holds O(N * L * R) numbers per head (soft buckets, tanh projections, the
    denominators) plus the O(L * R * dv) sketch or, for causal attention, the
    carried state at every chunk start.  ``v``, ``q`` and ``k`` are kept by
    reference (flattened to ``(G, N, d)``: the caller's own arrays where
    those are C-contiguous in the compute dtype or are 16-bit, which the
    backward widens again): do not modify them between forward and backward.
    Only the planes' gradient (``race_attention_bwd(..., dplanes=True)``)
    reads ``q`` and ``k``.  They record the backend that made them and runs
    their backward (:attr:`backend`, :func:`racecpu.backend.backend_of`) and
    their estimator (:attr:`estimator`).
    """

    backend: ClassVar[str] = "cpu"
    estimator: ClassVar[str] = "ratio"

    plan: Plan           # the forward's plan: shapes, chunks, packed sequences
    planes: np.ndarray
    beta: float
    v: np.ndarray        # (Gk, Nk, dv), compute dtype or 16-bit; Gk = G // group
    phiq: np.ndarray     # (G, Nq, F)
    tq: np.ndarray       # (G, Nq, L*P)
    phik: np.ndarray     # (Gk, Nk, F)
    tk: np.ndarray       # (Gk, Nk, L*P)
    den: np.ndarray      # (G, Nq) float64
    A: np.ndarray        # (Gk, F) total ((Gk, S, F) per packed sequence), or (Gk, nc, F) carries
                         # when causal; float64
    B: np.ndarray        # (Gk, F, dv) total ((Gk, S, F, dv) packed), or (Gk, nc, F, dv) carries when causal
    q: np.ndarray        # (G, Nq, d), compute dtype or 16-bit, for the planes' gradient only
    k: np.ndarray        # (Gk, Nk, d), compute dtype or 16-bit, for the planes' gradient only
    lead: tuple
    in_dtypes: tuple
    out_dtype: np.dtype
    planes_dtype: np.dtype  # the dtype the planes were given in (their gradient's)
    check_finite: bool
    namespace: object = None  # the array-API namespace of the forward's q (None: NumPy), for the gradients
    sums_max: float = 0.0  # max |v's float64 sums| in the forward: the backward's products with grad_out may overflow

    causal = property(lambda self: self.plan.causal)
    chunk = property(lambda self: self.plan.chunk, doc="Tokens per chunk of the backward (the carries').")
    group = property(lambda self: self.plan.group, doc="Query heads per key/value head.")
    packing = property(lambda self: self.plan.packing, doc="Packed sequences (cu_seqlens), or None.")

    @property
    def out_shape(self):
        return self.lead + (self.phiq.shape[1], self.v.shape[2])

    @property
    def kv_lead(self):
        """The leading dims of k and v (fewer heads than q's under grouped-query attention)."""
        return kv_lead(self.lead, self.group)


def target(out, shape, cdt):
    """Where a kernel writes a result of ``shape`` in the compute dtype: the
    caller's buffer ``out`` when it is C-contiguous in that dtype, else an
    array from the pool (README, "Memory")."""
    if out is not None and out.dtype == cdt and out.flags.c_contiguous:
        return out.reshape(shape)
    return POOL.empty(shape, cdt)


def forward(q, k, v, planes, beta, *, causal=False, key_mask=None, check_finite=True, out=None, cu_seqlens=None,
            residuals=True):
    """The NumPy API's forward on the CPU (:func:`racecpu.race_attention_fwd`): ``(out, Residuals)``,
    or ``(out, None)`` with ``residuals=False``: the soft buckets, projections and
    denominators that only the backward reads then stay in per-chunk scratch (the kernels
    get rows with none) and are never written to memory.  The causal scan still keeps the
    keys' phi (it reads them after the keys' pass).  ``out`` is in q's array type (its
    array-API namespace) unless written into the ``out`` buffer."""
    POOL.tick()
    a = prepare(q, k, v, planes, beta, causal, key_mask, check_finite, defer=True, grouped=True)
    if out is not None:
        out = check_out("out", out, a.lead + (a.q.shape[1], a.v.shape[2]), a.out_dtype,
                        [("q", q), ("k", k), ("v", v), ("planes", planes), ("key_mask", key_mask)])
    G, nq, d = a.q.shape
    Gk, nk, dv = a.v.shape
    L, P, _ = a.planes.shape
    plan = make_plan(G=G, group=a.group, nq=nq, nk=nk, d=d, dv=dv, L=L, P=P, causal=a.causal, cu_seqlens=cu_seqlens)
    F, LP, group, pk, cdt = plan.F, plan.LP, plan.group, plan.packing, a.q.dtype
    length = plan.task  # the keys' tasks and the queries' chunks (causal: the chunk)
    nck = plan.nck_task
    rq, rk = (nq, nk) if residuals else (0, 0)  # rows kept of the queries' and keys' residuals
    phik = POOL.empty((Gk, nk if causal else rk, F), cdt)
    tk = POOL.empty((Gk, rk, LP), cdt)
    seg = plan.segments
    partA = POOL.zeros((Gk, nck, F))
    partB = POOL.empty((Gk, nck, F, dv), np.float64)  # the kernels write every value read (causal: the carries)
    phiq = POOL.empty((G, rq, F), cdt)
    tq = POOL.empty((G, rq, LP), cdt)
    den = POOL.zeros((G, rq))
    o = target(out, (G, nq, dv), cdt)  # the kernels write every row
    hsh, rows = K.Hash(a.planes, a.beta), K.Rows(phiq, tq, phik, tk, den)
    kchunks, qchunks = _cuts(pk, nk, length), _cuts(pk, nq, length)
    nan_q = nan_k = 0  # NaNs in the hashes' t: a NaN/Inf in q or k, or an overflow
    if Gk and nk:
        # causal: the B totals of the chunks before the last segment give the segments' carries
        with _on_threads(Gk * nk, length, nk):
            nan_k = K.sketch_chunks(a.k, a.v, a.mask, hsh, kchunks, rows, K.Sums(partA, partB),
                                    span=K.SCAN_BLOCK if causal else K.SKETCH_FUSED,
                                    totals=(0, K.segment_start(seg - 1, seg, nck)) if causal else None)
    if causal:
        seq = None if pk is None else kchunks.seq
        A = K.exclusive_scan(partA, out=partA, seq=seq)
        B = K.exclusive_scan(partB, out=partB, segments=seg, seq=seq)  # the segments' first carries; the scan the rest
        # grouped-query attention: one scan per key/value head, read by its whole group of query heads
        sums_v = POOL.zeros((Gk, F, dv))  # the scan's total of B, for the check of v
        if G and nq:
            with _on_threads(G * nq, length, nq):
                nan_q = K.causal_fwd(K.Forward(a.q, a.v, hsh, rows, o, qchunks), K.Sums(A, B), final=sums_v,
                                     segments=seg)
    else:
        # packed: a sketch per sequence, (Gk, S, F) and (Gk, S, F, dv)
        if pk is None:
            A, B = _chunk_sum(partA), _chunk_sum(partB)
        else:
            A, B = sequence_sums(partA, pk), sequence_sums(partB, pk)
        sums_v = B
        if G and nq:  # grouped-query attention: each query head reads its key/value head's sketch
            sketch = K.Sums(_repeat(A, group), _repeat(B.astype(cdt), group))
            if pk is None:
                sketch = _sketch_per_sequence(*sketch)
            with _on_threads(G * nq, length, nq):
                nan_q = K.queries_fwd(a.q, hsh, qchunks, sketch, rows, o)
    overflow = PROJECTIONS_OVERFLOW.format(cdt)
    # packed and causal: the scan restarts, its total is the last sequence's; the output shows the others'
    v_sums = max_abs(sums_v)  # finite exactly where the sums are: one pass serves both checks
    finite_v = math.isfinite(v_sums) and not (causal and pk is not None and not all_finite(o))
    check_derived(a.check_finite, ("q", a.q, nan_q == 0, overflow), ("k", a.k, nan_k == 0, overflow),
                  ("v", a.v, finite_v, sums_overflow(cdt)))
    check_results(a.check_finite, (("v", a.v, v_sums),), cdt, plan.L, (o,))
    y = deliver(o, out, a.lead + (nq, dv), a.out_dtype)
    xp = namespace_of(q)  # results in q's array type (torch, JAX, ...), unless written into out
    if out is None:
        y = to_namespace(xp, y)
    if not residuals:
        return y, None
    kq, kk, kv = a.kept
    return y, Residuals(plan=plan, planes=a.planes, beta=a.beta, v=kv, phiq=phiq, tq=tq, phik=phik, tk=tk, den=den,
                        A=A, B=B, q=kq, k=kk, lead=a.lead, in_dtypes=a.in_dtypes, out_dtype=a.out_dtype,
                        planes_dtype=planes_grad_dtype(np.asarray(planes).dtype, cdt), check_finite=a.check_finite,
                        namespace=xp, sums_max=v_sums)


def backward(residuals, grad_out, *, out=None, dplanes=False):
    """The NumPy API's backward on the CPU (:func:`racecpu.race_attention_bwd`):
    ``(dq, dk, dv, dbeta[, dplanes])``, dq, dk, dv in the inputs' shapes and dtypes, in the
    forward's q's array type unless written into ``out`` buffers."""
    POOL.tick()
    r = residuals
    if not isinstance(r, Residuals):
        raise TypeError(f"residuals must come from race_attention_fwd, got {type(r).__name__}")
    g, _, _ = check_array("grad_out", grad_out, False)  # NaN/Inf: from what the kernels sum (below)
    plan = r.plan.rescheduled()  # the forward's chunks; the route for the threads this call has
    G, nq, F = r.phiq.shape
    Gk, nk, dv = r.v.shape
    d, LP = plan.d, plan.LP
    shapes = (r.lead + (nq, d), r.kv_lead + (nk, d), r.kv_lead + (nk, dv))
    out = check_grad_buffers(g, out, r.out_shape, shapes, r.in_dtypes,
                             [("the forward's v", r.v), ("planes", r.planes)], r.check_finite)
    cdt = r.phiq.dtype
    g = widened(g.reshape(G, nq, dv), cdt)
    v = widened(r.v, cdt)
    pk, chunk = plan.packing, plan.chunk
    ncq, nck = plan.ncq, plan.nck
    hsh, rows = K.Hash(r.planes, r.beta), K.Rows(r.phiq, r.tq, r.phik, r.tk, r.den)
    # The kernels write every row; without queries or keys they do not run.
    dq = target(out[0], (G, nq, d), cdt)
    dk, dv_ = (target(buf, (Gk,) + shape[-2:], cdt) for buf, shape in zip(out[1:], shapes[1:]))
    dbeta = 0.0
    dW = np.zeros((LP, d))
    if not (G and nq and nk):
        check_array("grad_out", g, r.check_finite)  # no kernel sums it
        for x in (dq, dk, dv_):
            x[...] = 0
    else:
        if dplanes:  # per-chunk shares, summed below in a fixed order
            pg = K.PlanesGrad(widened(r.q, cdt), widened(r.k, cdt), POOL.empty((G, ncq, LP, d), np.float64),
                              POOL.empty((Gk, nck, LP, d), np.float64))
        else:
            pg = _no_planes_grad(cdt, G, Gk, ncq, nck, d)
        # the chunk totals of (dA, dB): per query head, or per key/value head (summed over
        # its group) from the causal scan, which runs the group's query heads together
        Gd = Gk if plan.causal else G
        partdA = POOL.zeros((Gd, ncq, F))
        partdB = POOL.empty((Gd, ncq, F, dv), np.float64)  # the kernels write every value read
        dbq = POOL.zeros((G, ncq))
        dbk = POOL.zeros((Gk, nck))
        chunks = _cuts(pk, nq, chunk)
        if plan.causal:
            dB = POOL.zeros((Gk, F, dv))  # the scan's total of dB, for the check of grad_out
            grads = K.Grads(dq, dk, dv_, POOL.zeros((G, nq)), dbq, dbk, pg)
            _causal_backward(plan, K.Backward(g, v, rows, hsh, grads, chunks), K.Sums(r.A, r.B),
                             K.Sums(partdA, partdB), dB)
            # packed: the reverse scan restarts, its total is the first sequence's; dv shows the others'
            db_max = max_abs(dB)
            finite = math.isfinite(db_max) and (pk is None or all_finite(dv_))
            check_derived(r.check_finite, ("grad_out", g, finite, sums_overflow(cdt)))
        else:
            grads = _grads(cdt, G, Gk, d, dv, ncq, nck, dq=dq, dk=dk, dv_=dv_, dbq=dbq, dbk=dbk, planes=pg)
            sketch = K.Sums(_repeat(r.A, plan.group), _repeat(r.B.astype(cdt), plan.group))
            if pk is None:
                sketch = _sketch_per_sequence(*sketch)
            with _on_threads(G * nq, chunk, nq):
                K.queries_bwd(K.Backward(g, v, rows, hsh, grads, chunks), sketch, K.Sums(partdA, partdB))
            # a key/value head's sketch was read by its whole group (packed: one sketch per sequence)
            per_seq = _chunk_sum if pk is None else (lambda x: sequence_sums(x, pk))
            dB = K.group_sum(per_seq(partdB), plan.group)
            db_max = max_abs(dB)
            # before the keys' backward
            check_derived(r.check_finite, ("grad_out", g, math.isfinite(db_max), sums_overflow(cdt)))
            dsum = K.Sums(K.group_sum(per_seq(partdA), plan.group), dB.astype(cdt))
            if pk is None:
                dsum = _sketch_per_sequence(*dsum)
            with _on_threads(Gk * nk, chunk, nk):
                K.keys_bwd(v, rows, dsum, hsh, _cuts(pk, nk, chunk), grads)
        # the backward multiplies v's sums by grad_out (y = B g): their product near the limit counts too
        check_results(r.check_finite, (("v", r.v, r.sums_max), ("grad_out", g, db_max),
                                       ("grad_out", g, r.sums_max * db_max * OVERFLOW_MARGIN)), cdt, plan.L,
                      (dq, dk, dv_))
        dbeta = float(dbq.sum() + dbk.sum())
        if dplanes:
            dW = pg.dWq.sum((0, 1)) + pg.dWk.sum((0, 1))
    xp = r.namespace  # in the forward's array type, unless written into out buffers
    delivered = [deliver(x, buf, shape, dt) for x, buf, shape, dt in zip((dq, dk, dv_), out, shapes, r.in_dtypes)]
    check_narrowed(r.check_finite, zip(("dq", "dk", "dv"), delivered))
    grads = tuple(to_namespace(xp if buf is None else None, y) for y, buf in zip(delivered, out)) + (dbeta,)
    if not dplanes:
        return grads
    return grads + (to_namespace(xp, dW.reshape(r.planes.shape).astype(r.planes_dtype)),)


def _causal_backward(plan, bwd, carry, partd, final):
    """The causal backward by the plan's route; every route gives the same bits
    (``docs/design.md`` section 4.5)."""
    G, nq = bwd.grad.shape[:2]
    nck = carry.A.shape[1]
    seg = plan.segments
    with _on_threads(G * nq, plan.chunk, nq):
        if plan.route == "one-pass":
            K.causal_bwd(bwd, carry, partd, final=final)
        elif plan.route == "split":
            K.causal_bwd_split(bwd, carry, partd, final=final)
        else:
            # the dB totals of the chunks after the first segment give the reverse segments' carries
            K.causal_queries_bwd(bwd, carry, partd, totals=(K.segment_start(1, seg, nck), nck))
            seq = None if plan.packing is None else bwd.chunks.seq
            dcarry = K.Sums(K.exclusive_scan(partd.A, True, partd.A, seq=seq),  # in place
                            K.exclusive_scan(partd.B, True, partd.B, segments=seg, seq=seq))  # the segments' last
            K.causal_keys_bwd(bwd, dcarry, final=final, segments=seg)

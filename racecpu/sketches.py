"""Mergeable RACE sketches: the primitives that block-wise and distributed RACE attention compose.

Non-causal RACE attention of queries ``q`` over keys ``k`` with values ``v``
reads one *sketch* of the keys per (batch, head) group::

    A = sum_j phi(k_j)            (L, R)        R = 2**P soft buckets per table
    B = sum_j phi(k_j) v_j^T      (L, R, dv)
    out_i = (phi(q_i) . B) / (phi(q_i) . A)

A sketch is a sum over keys, so the sketch of a sequence is the sum of the
sketches of its blocks, and a sketch is ``L * R * (dv + 1)`` float64 numbers
per group whatever the number of keys.  This module makes that algebra
public:

* :func:`sketch` -- the :class:`Sketch` of a block of keys; sketches add with
  ``+`` and :func:`sum`;
* :func:`readout` -- non-causal attention of queries against a sketch;
  ``readout(q, sketch(k, v, W, beta))`` equals
  ``race_attention(q, k, v, W, beta)`` up to float rounding (the chunk totals
  are summed in another order);
* :func:`causal_block` -- causal attention of a block of tokens given the
  sketch of every token before it (the carried *state*, itself a
  :class:`Sketch`); returns the state after the block;
* the backward of each: :func:`readout_bwd`, :func:`sketch_bwd`,
  :func:`causal_block_bwd` (given the incoming state and the cotangent of the
  outgoing one), and :func:`causal_block_dstate` (the cotangent a block sends
  back to its incoming state, without the rows' gradients);
* :func:`state_from_sketch` / :func:`sketch_from_state` -- conversions to
  and from :class:`racecpu.RaceState` for streaming decode;
* for drivers that hand a block's work from task to task (:mod:`racecpu.dask`):
  :func:`sketch_kept` (a block's sketch and its keys' soft buckets,
  :class:`KeptKeys`, which ``sketch_bwd(..., keys=)`` reads instead of
  hashing the keys again), :func:`causal_block_keys` (a causal block's
  keys hashed once: its sketch, and what ``causal_block(..., keys=)`` reads) and :class:`BlockForward`
  (``causal_block(..., keep=True)``'s rows, which ``causal_block_bwd`` and
  ``causal_block_dstate`` read with ``forward=`` instead of recomputing the
  forward; saved to and loaded from ``.npz`` files).

Every function checks its arguments and calls the CPU engine's block
operations (:mod:`racecpu.engine`), the same kernels as
:func:`racecpu.race_attention` with the same float64 sketches;
:mod:`racecpu.dask` builds its task graphs from them.  A cotangent of a sketch (``dA, dB``) is also a :class:`Sketch`:
cotangents from several query blocks add the same way.

``racecpu.sketch`` is :func:`sketch`; the module is ``racecpu.sketches``.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from . import engine
from ._checks import check_array, check_beta, check_planes, dtypes, prepare
from ._memory import POOL
from .config import DEFAULT_BETA
from .streaming import RaceState

__all__ = ["Sketch", "sketch", "sketch_kept", "KeptKeys", "readout", "readout_bwd", "sketch_bwd", "causal_block",
           "causal_block_bwd", "causal_block_dstate", "causal_block_keys", "BlockForward", "state_from_sketch",
           "sketch_from_state", "planes_digest"]


def planes_digest(planes):
    """A digest of hyperplanes by value: shape and float64 values (so float32
    planes and the same values in float64 have the same digest)."""
    p = np.asarray(planes)
    h = hashlib.sha256(repr(p.shape).encode())
    h.update(np.ascontiguousarray(p, dtype=np.float64).tobytes())
    return h.hexdigest()


def _compute_dtype(*dts):
    """float16 computes in float32 (as in :func:`racecpu.race_attention`)."""
    dt = np.result_type(*dts)
    return np.dtype(np.float32) if dt == np.float16 else dt


@dataclass(frozen=True, eq=False)
class Sketch:
    """The RACE sketch of a set of keys, or the cotangent of one; adds with ``+`` and :func:`sum`.

    Parameters
    ----------
    A : ndarray, shape (..., L, R), float64
        ``sum_j phi(k_j)`` per group; ``...`` are the inputs' leading
        (batch, head) dims.  Cast to C-contiguous float64 (kept by reference
        when it already is).
    B : ndarray, shape (..., L, R, dv), float64
        ``sum_j phi(k_j) v_j^T``.
    planes : ndarray, shape (L, P, d)
        The hyperplanes it was built with (``R = 2**P``).
    beta : float
        The soft-hash temperature it was built with.
    dtype : {float32, float64}
        The compute dtype the keys were hashed in.  A readout computes in
        this dtype or wider (that of its queries).
    in_dtype : dtype, optional
        The inputs' dtype (float16 where they were; default ``dtype``); a
        readout returns ``result_type(q, in_dtype)``.

    Notes
    -----
    Treat a sketch as immutable: ``+`` returns a new one and never writes
    into its operands' arrays; the functions here never write into a
    sketch they are given.  Two sketches add when their planes are equal by
    value (:func:`planes_digest`), their beta equal and their shapes equal;
    otherwise ``+`` raises ValueError.  ``0 + s`` is ``s`` (so ``sum`` works).
    """

    A: np.ndarray
    B: np.ndarray
    planes: np.ndarray
    beta: float
    dtype: np.dtype = np.dtype(np.float32)
    in_dtype: np.dtype = None
    digest: str = field(default=None, compare=False)

    def __post_init__(self):
        A = np.ascontiguousarray(self.A, dtype=np.float64)
        B = np.ascontiguousarray(self.B, dtype=np.float64)
        planes = np.asarray(self.planes)
        if planes.ndim != 3:
            raise ValueError(f"planes must have shape (L, P, d), got shape {planes.shape}")
        L, P, _ = planes.shape
        R = 2 ** P
        if A.ndim < 2 or A.shape[-2:] != (L, R):
            raise ValueError(f"A must have shape (..., L, R) = (..., {L}, {R}) for planes {planes.shape}, "
                             f"got {A.shape}")
        if B.ndim != A.ndim + 1 or B.shape[:-1] != A.shape:
            raise ValueError(f"B must have shape A.shape + (dv,) = {A.shape} + (dv,), got {B.shape}")
        dtype = np.dtype(self.dtype)
        if dtype not in (np.float32, np.float64):
            raise TypeError(f"dtype must be float32 or float64, got {dtype}")
        in_dtype = dtype if self.in_dtype is None else np.dtype(self.in_dtype)
        object.__setattr__(self, "A", A)
        object.__setattr__(self, "B", B)
        object.__setattr__(self, "planes", planes)
        object.__setattr__(self, "beta", check_beta(self.beta))
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "in_dtype", in_dtype)
        if self.digest is None:
            object.__setattr__(self, "digest", planes_digest(planes))

    # -- shape ----------------------------------------------------------------
    @property
    def lead(self):
        """Leading (batch, head) dims."""
        return self.A.shape[:-2]

    @property
    def dv(self):
        return self.B.shape[-1]

    @property
    def head_dim(self):
        return self.planes.shape[2]

    @property
    def nbytes(self):
        """Bytes of ``A`` and ``B`` (independent of the number of keys)."""
        return self.A.nbytes + self.B.nbytes

    def __repr__(self):
        L, P, d = self.planes.shape
        return (f"Sketch(lead={self.lead}, L={L}, P={P}, d={d}, dv={self.dv}, beta={self.beta}, "
                f"dtype={self.dtype.name})")

    def _flat(self):
        """``A (G, F)``, ``B (G, F, dv)``: views in the kernels' layout."""
        G = math.prod(self.lead)
        F = self.A.shape[-2] * self.A.shape[-1]
        return self.A.reshape(G, F), self.B.reshape(G, F, self.dv)

    def _like(self, A, B, dtype=None, in_dtype=None):
        return Sketch(A, B, self.planes, self.beta, self.dtype if dtype is None else dtype,
                      self.in_dtype if in_dtype is None else in_dtype, self.digest)

    def check_compatible(self, other, what="sketch"):
        """Raise ValueError unless ``other`` has the same planes (by value), beta and shapes."""
        if not isinstance(other, Sketch):
            raise TypeError(f"{what} must be a racecpu.Sketch, got {type(other).__name__}")
        if other.digest != self.digest:
            raise ValueError(f"{what} was built with other planes (shapes {other.planes.shape} and "
                             f"{self.planes.shape}, or other values)")
        if other.beta != self.beta:
            raise ValueError(f"{what} was built with beta={other.beta}, not {self.beta}")
        if other.A.shape != self.A.shape or other.B.shape != self.B.shape:
            raise ValueError(f"{what} has shapes A {other.A.shape}, B {other.B.shape}; expected "
                             f"A {self.A.shape}, B {self.B.shape}")

    def __add__(self, other):
        if isinstance(other, (int, np.integer)) and not isinstance(other, bool) and other == 0:
            return self
        if not isinstance(other, Sketch):
            return NotImplemented
        self.check_compatible(other, "the other sketch")
        return self._like(self.A + other.A, self.B + other.B, np.promote_types(self.dtype, other.dtype),
                          np.promote_types(self.in_dtype, other.in_dtype))

    __radd__ = __add__

    @classmethod
    def zeros(cls, planes, beta=DEFAULT_BETA, *, lead=(), dv, dtype=np.float32):
        """The sketch of no keys (the causal state before the first token)."""
        L, P, _ = np.shape(planes)
        lead = tuple(int(s) for s in lead)
        return cls(np.zeros(lead + (L, 2 ** P)), np.zeros(lead + (L, 2 ** P, int(dv))), planes, beta, dtype)


# ---------------------------------------------------------------------------
# internals
# ---------------------------------------------------------------------------

def _keys(k, v, planes, beta, key_mask, check_finite, dtype):
    """Checked keys and values ``(G, n, d)``, ``(G, n, dv)``, mask, planes, beta, lead, cdt, in dtype."""
    k, _, _ = check_array("k", k, False)
    a = prepare(k[..., :0, :], k, v, planes, beta, False, key_mask, check_finite, defer=True)
    cdt = a.k.dtype if dtype is None else np.dtype(dtype)
    if cdt not in (np.float32, np.float64):
        raise TypeError(f"dtype must be float32 or float64, got {cdt}")
    kk, vv = (np.ascontiguousarray(x, dtype=cdt) for x in (a.k, a.v))
    W = check_planes(planes, kk.shape[2], cdt)
    return kk, vv, a.mask, W, a.beta, a.lead, cdt, dtypes(*a.in_dtypes[1:])[1]


def _check_state(state, what, planes, beta, lead, dv):
    ref = Sketch(np.zeros(lead + (planes.shape[0], 2 ** planes.shape[1])),
                 np.zeros(lead + (planes.shape[0], 2 ** planes.shape[1], dv)), planes, beta)
    ref.check_compatible(state, what)


def _flat_state(state, G, F, dv):
    if state is None:
        return np.zeros((G, F)), np.zeros((G, F, dv))
    return state._flat()


def _grad(name, g, shape):
    """``grad_out`` checked: a float array of the output's ``shape`` (its NaN/Inf are found
    later, from what the kernels sum)."""
    g, _, _ = check_array(name, g, False)
    if g.shape != shape:
        raise ValueError(f"{name} must have the output's shape {shape}, got {g.shape}")
    return g


# ---------------------------------------------------------------------------
# non-causal
# ---------------------------------------------------------------------------

def sketch(k: ArrayLike, v: ArrayLike, planes: ArrayLike, beta: float = DEFAULT_BETA, *,
           key_mask: ArrayLike | None = None, dtype: DTypeLike | None = None, check_finite: bool = True) -> Sketch:
    """The RACE sketch of a block of keys.

    Parameters
    ----------
    k : array_like, shape (..., Nk, d)
    v : array_like, shape (..., Nk, dv)
        float16/32/64; any number of leading (batch, head) dims, the same for both.
    planes : array_like, shape (L, P, d)
    beta : float, default ``DEFAULT_BETA``
    key_mask : bool array, shape (..., Nk), optional
        False keys contribute nothing.
    dtype : {float32, float64}, optional
        Compute dtype of the keys' hash (default: that of ``k`` and ``v``,
        float16 in float32).  Pass the dtype a whole attention call would
        use (``result_type(q, k, v)``) to reproduce it.
    check_finite : bool, default True
        Raise ValueError on NaN/Inf in k or v, or sums that overflow.

    Returns
    -------
    Sketch
        New float64 arrays ``A (..., L, R)``, ``B (..., L, R, dv)``; nothing
        aliases the inputs.
    """
    return _sketch_keys(k, v, planes, beta, key_mask, dtype, check_finite, False)[0]


def _sketch_keys(k, v, planes, beta, key_mask, dtype, check_finite, keep):
    """:func:`sketch`, and with ``keep`` the keys' :class:`KeptKeys` (else None)."""
    POOL.tick()  # a public call: the pool ages its idle blocks, as racecpu.race_attention's calls do
    k, v, mask, W, beta, lead, cdt, in_dt = _keys(k, v, planes, beta, key_mask, check_finite, dtype)
    dv = v.shape[2]
    L, P, _ = W.shape
    A, B, rows = engine.sketch_keys(k, v, mask, W, beta, check_finite=check_finite, keep=keep)
    R = 2 ** P
    st = Sketch(A.reshape(lead + (L, R)), B.reshape(lead + (L, R, dv)), np.asarray(planes), beta, cdt, in_dt)
    return st, (KeptKeys(rows, lead) if keep else None)


@dataclass(frozen=True, eq=False)
class KeptKeys:
    """A block of keys as :func:`sketch_kept` hashed them, for :func:`sketch_bwd` (``keys=``) to
    read instead of hashing them again.  Treat as opaque (:mod:`racecpu.dask` hands them from a
    block's forward task to its backward task); use one only with the keys, key mask, planes and
    dtype it was made from.  Holds ``2 (F + L P) * itemsize`` bytes per key and group (132 at
    float32, P = L = 3)."""

    rows: engine.KeyRows
    lead: tuple

    @property
    def nbytes(self):
        """Bytes of the arrays it holds (what it costs a worker to keep it)."""
        return sum(x.nbytes for x in self.rows)


def sketch_kept(k: ArrayLike, v: ArrayLike, planes: ArrayLike, beta: float = DEFAULT_BETA, *,
                key_mask: ArrayLike | None = None, dtype: DTypeLike | None = None,
                check_finite: bool = True) -> tuple[Sketch, KeptKeys]:
    """:func:`sketch`, and the keys' soft buckets that :func:`sketch_bwd` reads: ``(sketch, keys)``.

    Arguments and ``sketch`` as :func:`sketch` (the same bits); pass ``keys`` to
    ``sketch_bwd(k, v, dsketch, keys=keys)`` with the same ``k``, ``v``, ``key_mask`` and
    ``dtype``, which then does not hash the keys again (the same bits as without it).
    """
    return _sketch_keys(k, v, planes, beta, key_mask, dtype, check_finite, True)


def _queries(q, sk):
    """q checked against the sketch: ``(q (G, n, d), planes, compute dtype, output dtype)``."""
    POOL.tick()  # readout and readout_bwd: a public call
    if not isinstance(sk, Sketch):
        raise TypeError(f"sketch must be a racecpu.Sketch, got {type(sk).__name__}")
    q, qdt, _ = check_array("q", q, False)
    if q.shape[:-2] != sk.lead:
        raise ValueError(f"q has leading dims {q.shape[:-2]} but the sketch has {sk.lead}")
    d = q.shape[-1]
    cdt = _compute_dtype(q.dtype, sk.dtype)
    odt = np.result_type(qdt, sk.in_dtype)
    W = check_planes(sk.planes, d, cdt)
    G = math.prod(sk.lead)
    qf = np.ascontiguousarray(q.reshape(G, q.shape[-2], d), dtype=cdt)
    return qf, W, cdt, odt


def readout(q: ArrayLike, sketch: Sketch, *, check_finite: bool = True) -> np.ndarray:
    """Non-causal RACE attention of queries against a sketch of keys.

    Parameters
    ----------
    q : array_like, shape (..., Nq, d)
        Leading dims those of the sketch.
    sketch : Sketch
    check_finite : bool, default True
        Raise ValueError on NaN/Inf in q (or on q whose projections overflow).

    Returns
    -------
    out : ndarray, shape (..., Nq, dv)
        A new array in ``result_type(q, sketch.in_dtype)``, computed in the
        wider of q's and the sketch's compute dtypes.  ``readout(q, sketch(k,
        v, W, beta))`` equals ``race_attention(q, k, v, W, beta)`` up to
        rounding (the same kernels; the keys' chunk totals summed in another
        order).  A query whose buckets hold no key mass gets zeros.
    """
    qf, W, cdt, odt = _queries(q, sketch)
    nq, dv = qf.shape[1], sketch.dv
    A, B = sketch._flat()
    o = engine.readout(qf, A, B, W, sketch.beta, check_finite=check_finite)
    return o.reshape(sketch.lead + (nq, dv)).astype(odt, copy=False)


def readout_bwd(q: ArrayLike, sketch: Sketch, grad_out: ArrayLike, *,
                check_finite: bool = True) -> tuple[np.ndarray, Sketch]:
    """Backward of :func:`readout`.

    Parameters
    ----------
    q, sketch :
        As for :func:`readout` (the forward is recomputed from them).
    grad_out : array_like, shape (..., Nq, dv)
        Cotangent of the readout's output.

    Returns
    -------
    dq : ndarray, shape of q, dtype of q
    dsketch : Sketch
        Cotangent of the sketch, ``dA (..., L, R)``, ``dB (..., L, R, dv)``
        float64, with the sketch's planes and beta: the cotangents of several
        query blocks against one sketch add with ``+``.  Feed the total to
        :func:`sketch_bwd`.
    dbeta : float
        The queries' share of the gradient w.r.t. beta (the keys' share comes
        from :func:`sketch_bwd`).
    """
    qdt = np.asarray(q).dtype
    qf, W, cdt, odt = _queries(q, sketch)
    G, nq, d = qf.shape
    L, P, _ = W.shape
    g = _grad("grad_out", grad_out, sketch.lead + (nq, sketch.dv))
    g = np.ascontiguousarray(g.reshape(G, nq, sketch.dv), dtype=cdt)
    A, B = sketch._flat()
    dq, dA, dB, dbeta = engine.readout_bwd(qf, A, B, g, W, sketch.beta, check_finite=check_finite)
    R = 2 ** P
    ds = sketch._like(dA.reshape(sketch.lead + (L, R)), dB.reshape(sketch.lead + (L, R, sketch.dv)), cdt)
    return dq.reshape(np.shape(q)).astype(qdt if qdt.kind == "f" else cdt, copy=False), ds, dbeta


def sketch_bwd(k: ArrayLike, v: ArrayLike, dsketch: Sketch, *, key_mask: ArrayLike | None = None,
               dtype: DTypeLike | None = None, check_finite: bool = True,
               keys: KeptKeys | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """Backward of :func:`sketch`: the keys' and values' cotangents from the sketch's.

    Parameters
    ----------
    k, v, key_mask, dtype, check_finite :
        As given to :func:`sketch` (its planes and beta are ``dsketch``'s).
    dsketch : Sketch
        Cotangent of the sketch (e.g. the sum of :func:`readout_bwd`'s over
        every query block).
    keys : KeptKeys, optional
        What :func:`sketch_kept` made of the same keys: read instead of
        hashing them again (the same bits; k's NaN/Inf were checked there).

    Returns
    -------
    dk, dv : ndarray
        Shapes and dtypes of k and v (masked keys: zeros).  New arrays.
    dbeta : float
        The keys' share of the gradient w.r.t. beta.
    """
    if not isinstance(dsketch, Sketch):
        raise TypeError(f"dsketch must be a racecpu.Sketch, got {type(dsketch).__name__}")
    kdt, vdt = np.asarray(k).dtype, np.asarray(v).dtype
    POOL.tick()
    k, v, mask, W, beta, lead, cdt, _ = _keys(k, v, dsketch.planes, dsketch.beta, key_mask, check_finite, dtype)
    nk, d = k.shape[1:]
    dv = v.shape[2]
    _check_state(dsketch, "dsketch", W, beta, lead, dv)
    dA, dB = dsketch._flat()
    if keys is not None:
        if not isinstance(keys, KeptKeys):
            raise TypeError(f"keys must be a racecpu.sketches.KeptKeys, got {type(keys).__name__}")
        if keys.lead != lead:
            raise ValueError(f"keys were kept for leading dims {keys.lead}, not {lead}")
    dk, dv_, dbeta = engine.keys_bwd(k, v, mask, dA, dB, W, beta, check_finite=check_finite,
                                     rows=None if keys is None else keys.rows)
    return (dk.reshape(lead + (nk, d)).astype(kdt if kdt.kind == "f" else cdt, copy=False),
            dv_.reshape(lead + (nk, dv)).astype(vdt if vdt.kind == "f" else cdt, copy=False), dbeta)


# ---------------------------------------------------------------------------
# causal
# ---------------------------------------------------------------------------

def _causal_args(q, k, v, planes, beta, key_mask, check_finite, state, what="initial_state"):
    a = prepare(q, k, v, planes, beta, True, key_mask, check_finite, defer=True)
    G, n, _ = a.q.shape
    dv = a.v.shape[2]
    L, P, _ = a.planes.shape
    F = L * 2 ** P
    if state is not None:
        _check_state(state, what, a.planes, a.beta, a.lead, dv)
    return a, G, n, dv, L, P, F


def causal_block(q: ArrayLike, k: ArrayLike, v: ArrayLike, planes: ArrayLike, beta: float = DEFAULT_BETA,
                 initial_state: Sketch | None = None, *, key_mask: ArrayLike | None = None,
                 check_finite: bool = True, keys: BlockForward | None = None, keep: bool = False,
                 scan: bool = False) -> tuple:
    """Causal RACE attention of a block of tokens after everything before it.

    Parameters
    ----------
    q, k : array_like, shape (..., n, d)
    v : array_like, shape (..., n, dv)
        The block's tokens (q and k the same length).
    planes, beta, key_mask, check_finite :
        As for :func:`racecpu.race_attention`.
    initial_state : Sketch, optional
        The sketch of every key before the block (same planes, beta, leading
        dims, dv); default none (the block starts the sequence).
    keys : BlockForward, optional
        From :func:`causal_block_keys` on the same k, v, key_mask: the keys
        are not hashed again (same bits).  It is used up: its rows become the
        result's.
    keep : bool, default False
        Also return the block's :class:`BlockForward` (its rows), for
        ``causal_block_bwd(..., forward=)`` and ``causal_block_dstate(...,
        forward=)``.
    scan : bool, default False
        Sum the block's state in its own scan, as the whole call's forward
        does, instead of summing every chunk of its keys first
        (:func:`racecpu.engine.advance`'s ``scan``): about a sgemm per token
        less where the block runs on one thread.  Not with ``keys``.  The
        results differ from the default's by rounding where an
        ``initial_state`` is given; give the backward the same ``scan``
        unless it gets ``forward=``.

    Returns
    -------
    out : ndarray, shape (..., n, dv)
        Query i sees the initial state and the block's keys j <= i; dtype as
        :func:`racecpu.race_attention`.  A new array.
    final_state : Sketch
        ``initial_state + sketch(k, v)``: the state the next block starts from.
    forward : BlockForward
        Only with ``keep``.

    Notes
    -----
    Splitting a sequence into blocks and chaining them through the state
    equals one ``race_attention(..., causal=True)`` over the whole sequence
    up to rounding (the state is float64; float32 blocks cast the carry to
    float32 at every chunk start, as the whole call does).
    """
    POOL.tick()
    a, G, n, dv, L, P, F = _causal_args(q, k, v, planes, beta, key_mask, check_finite, initial_state)
    cdt = a.q.dtype
    A0, B0 = _flat_state(initial_state, G, F, dv)
    o = POOL.empty((G, n, dv), cdt)
    A1, B1 = A0.copy(), B0.copy()
    kp = _check_keys(keys, G, n, dv, F)
    if scan and keys is not None:
        raise ValueError("causal_block(scan=True) sums the keys in its scan: not with keys=")
    if keep and kp is not None and kp.rows.phiq.shape[1] != n:
        raise ValueError("keep=True needs keys made with causal_block_keys(..., keep=True)")
    step = None
    if G and n:
        step = engine.advance(a.q, a.k, a.v, a.planes, a.beta, A0, B0, o, mask=a.mask,
                              keep=engine.BACKWARD_ROWS if keep else (),
                              check_finite=a.check_finite, keys=kp, scan=scan)
        A1, B1 = step.A, step.B
    R = 2 ** P
    st = Sketch(A1.reshape(a.lead + (L, R)), B1.reshape(a.lead + (L, R, dv)), np.asarray(planes), a.beta, cdt,
                dtypes(*a.in_dtypes)[1])
    o = o.reshape(a.lead + (n, dv)).astype(a.out_dtype, copy=False)
    return (o, st, BlockForward(None, step, a.lead)) if keep else (o, st)


def _check_keys(keys, G, n, dv, F):
    """The engine's key pass of ``keys`` (a :class:`BlockForward` of :func:`causal_block_keys`, or None)
    after checking that it is one for a block of these shapes."""
    if keys is None:
        return None
    if not isinstance(keys, BlockForward) or keys.step is not None:
        raise TypeError(f"keys must come from racecpu.sketches.causal_block_keys, got {type(keys).__name__}")
    kp = keys.keys
    if kp is None:
        return None
    if kp.rows.phik.shape != (G, n, F) or kp.partB.shape[-1] != dv:
        raise ValueError(f"keys were made for a block of {kp.rows.phik.shape[:2]} (groups, tokens), "
                         f"not {(G, n)}")
    return kp


@dataclass(frozen=True, eq=False)
class BlockForward:
    """A causal block's forward as its backward reads it: what :func:`causal_block_keys`
    and :func:`causal_block` (``keep=True``) hand on, so that the block's keys are hashed
    once and :func:`causal_block_bwd` and :func:`causal_block_dstate` do not recompute the
    forward.  Treat as opaque (:mod:`racecpu.dask` hands them from task to task); use
    one only with the block and state it was made for.

    ``keys``: the keys hashed and summed per chunk (:class:`racecpu.engine.KeyPass`),
    ``step``: the block's forward (:class:`racecpu.engine.Advanced`, None until
    :func:`causal_block` ran), ``lead``: the inputs' leading dims.  Holds the kernels'
    rows of the whole block (soft buckets, projections, denominators: about
    ``(2 F + 2 L P) * itemsize + 8`` bytes per token and group, 272 at float32,
    P = L = 3) and each chunk's float64 carry.
    """

    keys: engine.KeyPass | None
    step: engine.Advanced | None
    lead: tuple

    def save(self, path):
        """Write a :func:`causal_block` forward (``keep=True``) to ``path`` (an ``.npz`` file, no pickle;
        written to a temporary name and renamed, so a reader never sees half a file).  Returns ``path``."""
        if self.step is None and self.keys is not None:
            raise ValueError("only a forward of causal_block(..., keep=True) can be saved, not a key pass")
        arrays = {} if self.step is None else self.step.to_arrays()
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as fh:
            np.savez(fh, lead=np.array(self.lead, np.int64), **arrays)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path):
        """The forward that :meth:`save` wrote to ``path``."""
        with np.load(path, allow_pickle=False) as z:
            d = {name: z[name] for name in z.files}
        lead = tuple(int(x) for x in d.pop("lead"))
        return cls(None, engine.Advanced.from_arrays(d) if d else None, lead)

    @property
    def nbytes(self):
        """Bytes of the arrays it holds (what it costs a worker to keep it)."""
        parts = [] if self.keys is None else [*self.keys.rows, self.keys.partA, self.keys.partB]
        if self.step is not None and (self.keys is None or self.step.rows is not self.keys.rows):
            parts += [*self.step.rows]
        if self.step is not None:
            parts += [self.step.carryA, self.step.carryB]
        return sum(x.nbytes for x in parts)


def causal_block_keys(k: ArrayLike, v: ArrayLike, planes: ArrayLike, beta: float = DEFAULT_BETA, *,
                      key_mask: ArrayLike | None = None, dtype: DTypeLike | None = None, keep: bool = True,
                      check_finite: bool = True) -> tuple[Sketch, BlockForward]:
    """The keys' half of a causal block: their sketch and what :func:`causal_block` reads
    so as not to hash them again.

    Arguments as :func:`sketch` (``dtype``: the compute dtype of the whole block,
    ``result_type(q, k, v)``, float16 in float32).  Returns ``(sketch, keys)``:
    ``sketch`` equals :func:`sketch` of the block up to rounding (it is summed
    per chunk as the causal scan sums it, so ``initial_state + sketch`` is the
    ``final_state`` of :func:`causal_block` bit for bit), ``keys`` goes to
    ``causal_block(..., keys=keys)`` with the same k, v, key_mask.  ``keep``
    (default True): make the rows a backward reads for every token (else only
    the keys' soft buckets, and ``causal_block(..., keys=keys, keep=True)``
    raises ValueError).
    """
    POOL.tick()
    kk, vv, mask, W, beta, lead, cdt, in_dt = _keys(k, v, planes, beta, key_mask, check_finite, dtype)
    G, n, _ = kk.shape
    dv = vv.shape[2]
    L, P, _ = W.shape
    F, R = L * 2 ** P, 2 ** P
    A, B = np.zeros((G, F)), np.zeros((G, F, dv))
    kp = None
    if G and n:
        kp = engine.advance_keys(kk, vv, W, beta, G, mask=mask, check_finite=check_finite,
                                 keep=engine.BACKWARD_ROWS if keep else ())
        A, B = engine.state_after(kp, A, B)
    st = Sketch(A.reshape(lead + (L, R)), B.reshape(lead + (L, R, dv)), np.asarray(planes), beta, cdt, in_dt)
    return st, BlockForward(kp, None, lead)


def _causal_backward(q, k, v, planes, beta, grad_out, initial_state, dfinal_state, key_mask, check_finite,
                     queries_only, forward=None, scan=False):
    POOL.tick()
    a, G, n, dv, L, P, F = _causal_args(q, k, v, planes, beta, key_mask, check_finite, initial_state)
    if dfinal_state is not None:
        _check_state(dfinal_state, "dfinal_state", a.planes, a.beta, a.lead, dv)
    cdt = a.q.dtype
    d = a.q.shape[2]
    g = _grad("grad_out", grad_out, a.lead + (n, dv))
    g = np.ascontiguousarray(g.reshape(G, n, dv), dtype=cdt)
    A0, B0 = _flat_state(initial_state, G, F, dv)
    sA, sB = _flat_state(dfinal_state, G, F, dv)
    got = engine.advance_bwd(a.q, a.k, a.v, g, a.planes, a.beta, A0, B0, sA, sB, mask=a.mask,
                             queries_only=queries_only, check_finite=a.check_finite,
                             step=_check_forward(forward, G, n, dv, F), scan=scan)
    dA0, dB0 = got[-2:]
    R = 2 ** P
    dstate = Sketch(dA0.reshape(a.lead + (L, R)), dB0.reshape(a.lead + (L, R, dv)), np.asarray(planes), a.beta,
                    cdt, dtypes(*a.in_dtypes)[1])
    if queries_only:
        return dstate
    dq, dk, dv_, dbeta = got[:4]
    qdt, kdt, vdt = a.in_dtypes
    return (dq.reshape(a.lead + (n, d)).astype(qdt, copy=False), dk.reshape(a.lead + (n, d)).astype(kdt, copy=False),
            dv_.reshape(a.lead + (n, dv)).astype(vdt, copy=False), dbeta, dstate)


def causal_block_bwd(q: ArrayLike, k: ArrayLike, v: ArrayLike, planes: ArrayLike, beta: float, grad_out: ArrayLike,
                     initial_state: Sketch | None = None, dfinal_state: Sketch | None = None, *,
                     key_mask: ArrayLike | None = None, check_finite: bool = True,
                     forward: BlockForward | None = None, scan: bool = False) -> tuple:
    """Backward of :func:`causal_block` (the forward is recomputed from the block and its state,
    unless given).

    Parameters
    ----------
    q, k, v, planes, beta, initial_state, key_mask, check_finite :
        As given to :func:`causal_block`.
    grad_out : array_like, shape (..., n, dv)
        Cotangent of the block's output.
    dfinal_state : Sketch, optional
        Cotangent of the block's final state: the reverse carry from every
        later block, i.e. the sum of their :func:`causal_block_dstate` (default
        zero: the last block).
    forward : BlockForward, optional
        ``causal_block(..., keep=True)``'s on these arguments: its rows are
        read instead of recomputing the forward (not checked against the
        arguments beyond its shapes: another block's gives a wrong result).
    scan : bool, default False
        As given to :func:`causal_block` (how a recomputed forward sums the
        state; unused with ``forward``).

    Returns
    -------
    dq, dk, dv : ndarray
        New arrays, shapes and dtypes of q, k, v.
    dbeta : float
        The block's share of the gradient w.r.t. beta.
    dinitial_state : Sketch
        Cotangent of ``initial_state``: ``dfinal_state`` plus what the
        block's outputs send back (:func:`causal_block_dstate`).
    """
    return _causal_backward(q, k, v, planes, beta, grad_out, initial_state, dfinal_state, key_mask,
                            check_finite, False, forward, scan)


def _check_forward(forward, G, n, dv, F):
    """The engine's :class:`racecpu.engine.Advanced` of ``forward`` (a :class:`BlockForward`
    of ``causal_block(..., keep=True)``, or None) after checking its shapes."""
    if forward is None:
        return None
    if not isinstance(forward, BlockForward) or (forward.step is None and forward.keys is not None):
        raise TypeError("forward must come from racecpu.sketches.causal_block(..., keep=True), got "
                        f"{type(forward).__name__}")
    st = forward.step
    if st is None:  # a block of no rows
        return None
    if st.rows.phiq.shape != (G, n, F) or st.carryB.shape[-1] != dv:
        raise ValueError(f"forward was made for a block of {st.rows.phiq.shape[:2]} (groups, tokens), not {(G, n)}")
    return st


def causal_block_dstate(q: ArrayLike, k: ArrayLike, v: ArrayLike, planes: ArrayLike, beta: float, grad_out: ArrayLike,
                        initial_state: Sketch | None = None, *, key_mask: ArrayLike | None = None,
                        check_finite: bool = True, out: ArrayLike | None = None,
                        forward: BlockForward | None = None) -> Sketch:
    """The cotangent a block's outputs send back to its initial state, without dq, dk, dv.

    Equals ``causal_block_bwd(..., dfinal_state=None)[4]`` (up to rounding
    with ``out``) and costs the forward and the queries' backward of the
    block only, or, given the block's output, its soft hash and one product.
    A distributed backward sums these over the blocks after each block (a
    reverse scan) to get each block's ``dfinal_state``.  Arguments as
    :func:`causal_block_bwd`, and:

    out : array_like, shape (..., n, dv), optional
        The block's output, :func:`causal_block`'s for these arguments (not
        checked: another array gives a wrong result).  With it the block is
        not rescanned: query i sends ``dB += w_i g_i^T`` and ``dA += phiq_i
        dden_i / L`` with ``w_i = phiq_i / (L den_i)`` and ``dden_i = -(out_i
        . g_i) / den_i`` (``phiq_i B_i = L den_i out_i``; ``docs/design.md``
        section 3.4), ``den_i`` from the prefix sums of the keys' soft
        buckets.  Needs a float dtype at least as precise as the compute
        dtype (float16 or bfloat16 outputs of a float32 computation: pass
        none).
    forward : BlockForward, optional
        ``causal_block(..., keep=True)``'s on these arguments: the soft
        hashes are read from it (with ``out``), or (without) the queries'
        backward pass runs on its rows, not on a recomputed forward.

    Returns
    -------
    Sketch
        ``dA (..., L, R)``, ``dB (..., L, R, dv)`` float64.
    """
    if out is None:
        return _causal_backward(q, k, v, planes, beta, grad_out, initial_state, None, key_mask, check_finite, True,
                                forward)
    POOL.tick()
    a, G, n, dv, L, P, F = _causal_args(q, k, v, planes, beta, key_mask, check_finite, initial_state)
    cdt = a.q.dtype
    g = _grad("grad_out", grad_out, a.lead + (n, dv))
    o, _, _ = check_array("out", out, False)
    if o.shape != g.shape:
        raise ValueError(f"out must have the block's output shape {g.shape}, got {o.shape}")
    if o.dtype.kind != "f" or o.dtype.itemsize < np.dtype(cdt).itemsize:
        raise TypeError(f"out must be a float array at least as precise as the compute dtype {cdt}, got {o.dtype}")
    g = np.ascontiguousarray(g.reshape(G, n, dv), dtype=cdt)
    o = np.ascontiguousarray(o.reshape(G, n, dv), dtype=cdt)
    A0, _ = _flat_state(initial_state, G, F, dv)
    st = _check_forward(forward, G, n, dv, F)
    dA, dB = engine.state_cotangent(a.q, a.k, a.mask, o, g, a.planes, a.beta, A0, check_finite=a.check_finite,
                                    rows=None if st is None else st.rows)
    R = 2 ** P
    return Sketch(dA.reshape(a.lead + (L, R)), dB.reshape(a.lead + (L, R, dv)), np.asarray(planes), a.beta, cdt,
                  dtypes(*a.in_dtypes)[1])


# ---------------------------------------------------------------------------
# RaceState
# ---------------------------------------------------------------------------

def state_from_sketch(sketch, count=0):
    """A :class:`racecpu.RaceState` that continues a stream from ``sketch``.

    ``count`` is the number of tokens the sketch summarises (recorded only).
    The state's arrays are copies.
    """
    if not isinstance(sketch, Sketch):
        raise TypeError(f"sketch must be a racecpu.Sketch, got {type(sketch).__name__}")
    st = RaceState(sketch.planes, sketch.beta, batch_shape=sketch.lead, dv=sketch.dv, dtype=sketch.dtype)
    L, R = sketch.A.shape[-2:]
    st.set_state(sketch.A.reshape(sketch.lead + (L * R,)), sketch.B.reshape(sketch.lead + (L * R, sketch.dv)),
                 int(count))
    return st


def sketch_from_state(state):
    """The :class:`Sketch` of everything a :class:`racecpu.RaceState` has seen (copies)."""
    L, P, _ = state.planes.shape
    lead = state.batch_shape + (L, 2 ** P)
    return Sketch(state.A.reshape(lead), state.B.reshape(lead + (state.dv,)), state.planes, state.beta, state.dtype)

"""RACE attention: the public NumPy API.

Each function here says what it computes and sends the call to the backend
of its inputs (:func:`racecpu.backend.backend_for`): the CPU engine
(:mod:`racecpu.engine`: argument checks, the plan, the kernels, the
residuals) for NumPy and what converts to it, racecpu.cuda for arrays in GPU
memory.  A backward runs where its forward ran (:func:`racecpu.backend.backend_of`).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from ._checks import check_beta
from .backend import backend_for, backend_of, check_estimator
from .config import DEFAULT_BETA
from .engine import Residuals
from .hashing import LAYER_BETA, LAYER_NUM_PLANES, LAYER_NUM_TABLES, hyperplanes

__all__ = ["race_attention", "race_attention_fwd", "race_attention_bwd", "RaceAttention", "Residuals"]


def race_attention_fwd(q: ArrayLike, k: ArrayLike, v: ArrayLike, planes: ArrayLike, beta: float = DEFAULT_BETA, *,
                       causal: bool = False, key_mask: ArrayLike | None = None, check_finite: bool = True,
                       out: np.ndarray | None = None, cu_seqlens: ArrayLike | None = None,
                       estimator: str = "ratio") -> tuple[np.ndarray, Residuals]:
    """RACE attention forward; returns ``(out, residuals)`` for :func:`race_attention_bwd`.

    Arguments are those of :func:`race_attention`, which computes the same
    ``out`` (bit for bit) without keeping residuals.  ``q`` in GPU memory
    (CuPy, ...) runs on the GPU (:func:`racecpu.cuda.race_attention_fwd`:
    device arrays out, and residuals whose backward runs there too).
    """
    return backend_for(q).forward(q, k, v, planes, beta, causal=causal, key_mask=key_mask, check_finite=check_finite,
                                  cu_seqlens=cu_seqlens, out=out, residuals=True, estimator=estimator)


def race_attention_bwd(residuals: Residuals, grad_out: ArrayLike, *,
                       out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                       dplanes: bool = False) -> tuple:
    """RACE attention backward.

    Parameters
    ----------
    residuals : Residuals
        From :func:`race_attention_fwd`.  Those of a forward on the GPU run
        the backward there (:func:`racecpu.cuda.race_attention_bwd`: device
        arrays out; ``out`` and ``dplanes`` are not available there).
    grad_out : array_like, shape like the forward's output
        Cotangent of the output.
    out : tuple of three ndarrays, optional
        Buffers ``(dq, dk, dv)`` to write the gradients into, each with the
        shape and dtype of its input (see :func:`race_attention`'s ``out``).
    dplanes : bool, default False
        Also return the gradient w.r.t. the planes (learnable hash planes).
        Without it nothing of that gradient is computed.

    Returns
    -------
    dq, dk, dv : ndarray
        Gradients, each in the dtype of its input (the ``out`` buffers if
        given), in the array type of the forward's ``q`` (see
        :func:`race_attention`'s ``out``).
    dbeta : float
        Gradient w.r.t. beta, summed over every batch, head and token.
    dplanes : ndarray, shape (L, P, d)
        Only with ``dplanes=True``: the gradient w.r.t. the planes, summed
        over every batch, head, query and key (``docs/design.md`` section
        3.3), in the dtype the planes were given in (the compute dtype for
        integer planes); each chunk's share is one product in
        the compute dtype, the shares are summed in float64 in a fixed
        order, so the bits do not depend on the thread count.
    """
    return backend_of(residuals).backward(residuals, grad_out, out=out, dplanes=dplanes)


def race_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, planes: ArrayLike, beta: float = DEFAULT_BETA, *,
                   causal: bool = False, key_mask: ArrayLike | None = None, check_finite: bool = True,
                   out: np.ndarray | None = None, cu_seqlens: ArrayLike | None = None,
                   estimator: str = "ratio") -> np.ndarray:
    """RACE attention: linear-time soft-LSH estimate of sharpened angular attention.

    The forward alone: it keeps none of the residuals that
    :func:`race_attention_fwd` returns for the backward (the per-token soft
    buckets, projections and denominators stay in per-chunk scratch), so it
    writes less memory and needs less; the output is the same, bit for bit.

    Parameters
    ----------
    q : array_like, shape (..., Nq, d)
    k : array_like, shape (..., Nk, d)
    v : array_like, shape (..., Nk, dv)
        Any number (>= 0) of leading batch/head dims, the same for q, k, v;
        or, for grouped-query (multi-query) attention, k and v with a head
        axis (the one before the tokens) ``group`` times smaller than q's,
        every other leading axis equal: query head h reads key/value head
        ``h // group``, whose keys are hashed and sketched (causal: whose
        state is scanned) once for the group and whose gradients sum over
        it; equal to repeating k and v ``group`` times.
        NumPy arrays, or any array with ``__array__`` or DLPack (torch CPU
        tensors without grad, JAX CPU arrays, ...), read without a copy where
        the library allows; ``q`` in GPU memory (CuPy, ...) runs on the GPU
        (:mod:`racecpu.cuda`).
    planes : array_like, shape (L, P, d)
        Hyperplanes from :func:`racecpu.hyperplanes` (cast to the compute dtype).
    beta : float, default ``DEFAULT_BETA``
        Soft-hash temperature (> 0); larger is closer to hard SimHash buckets.
    causal : bool, default False
        Query i sees keys j <= i (needs Nq == Nk).
    key_mask : bool array, shape (..., Nk), optional
        k's leading dims: False keys contribute nothing.
    check_finite : bool, default True
        Raise ValueError on NaN/Inf in q, k, v, on q or k so large that
        their projections onto the planes overflow, and on v so large that
        the sketch's float64 sums overflow.  The inputs are checked after the
        kernels, from what they derived (q and k from their hash, 9 values
        per token at P = L = 3 instead of d; v from the sketch): no extra
        pass over them, but ``out`` may have been written when it raises.
        :func:`race_attention_bwd` checks ``grad_out`` the same way.
    out : ndarray, shape (..., Nq, dv), optional
        Buffer for the result, in the result's dtype; it must not share
        memory with q, k, v, planes or key_mask.  Without one, the result's memory comes from
        racecpu's pool, which reuses that of dropped results so that a loop
        does not fault fresh pages in every call (README, "Memory").  A
        C-contiguous float32/float64 buffer is written directly.
    cu_seqlens : 1-D int array, optional
        Packed sequences (flash-attn's convention): the offsets
        ``0, n1, n1 + n2, ..., N`` of the sequences on the sequence axis
        (Nq == Nk == N; empty sequences allowed).  Each attends only within
        itself: the causal scan restarts at each, the non-causal sketch is
        per sequence; equal to a call per sequence.  The same for every
        leading index.
    estimator : {"ratio", "bucket_mean"}, default "ratio"
        How a query reads the keys' bucket sums (``docs/design.md`` sections
        1.2 and 1.5): ``ratio``, the paper's (Algorithms 1 and 2), on the
        kernels; ``bucket_mean``, the per-bucket mean of the authors'
        released code (:func:`racecpu.bucket_mean.race_attention_bucket_mean`,
        computed in NumPy: slower, more memory, and on the CPU only; no
        ``cu_seqlens``, no planes' gradient).  The backward follows the
        forward's.

    Returns
    -------
    out : ndarray, shape (..., Nq, dv)
        In ``q``'s array type when it is not NumPy and ``out`` is not given
        (its array-API namespace through array-api-compat: a torch CPU
        tensor sharing racecpu's result, a JAX array, ...); else NumPy.
        float32/float64 follow the inputs; float16 computes in float32 and
        returns float16.  A query whose buckets hold no key mass
        (``den <= DEN_FLOOR``, e.g. every key masked) gets zeros.
    """
    return backend_for(q).forward(q, k, v, planes, beta, causal=causal, key_mask=key_mask, check_finite=check_finite,
                                  cu_seqlens=cu_seqlens, out=out, residuals=False, estimator=estimator)[0]


class RaceAttention:
    """A RACE attention layer holding its hyperplanes.

    Parameters
    ----------
    head_dim : int
    num_planes : int, default ``LAYER_NUM_PLANES`` (5)
    num_tables : int, default ``LAYER_NUM_TABLES`` (4)
    beta : float, default ``LAYER_BETA`` (2)
        The layers' defaults (docs/choosing.md); a function called with planes
        of its own defaults to ``DEFAULT_BETA`` (8) instead.
    seed : int, default 0
    dtype : dtype, default float32
        dtype of the stored planes (cast to the inputs' compute dtype on use).
    estimator : {"ratio", "bucket_mean"}, default "ratio"
        See :func:`race_attention`.

    Examples
    --------
    >>> import numpy as np, racecpu
    >>> att = racecpu.RaceAttention(64)
    >>> x = np.random.default_rng(0).standard_normal((2, 128, 64), dtype=np.float32)
    >>> att(x, x, x, causal=True).shape
    (2, 128, 64)
    """

    def __init__(self, head_dim: int, num_planes: int = LAYER_NUM_PLANES, num_tables: int = LAYER_NUM_TABLES,
                 beta: float = LAYER_BETA, seed: int | None = 0, dtype: DTypeLike = np.float32,
                 estimator: str = "ratio"):
        self.planes = hyperplanes(head_dim, num_planes, num_tables, seed=seed, dtype=dtype)
        self.beta = check_beta(beta)
        self.estimator = check_estimator(estimator)

    @property
    def head_dim(self):
        return self.planes.shape[2]

    @property
    def num_planes(self):
        return self.planes.shape[1]

    @property
    def num_tables(self):
        return self.planes.shape[0]

    def __repr__(self):
        return (f"RaceAttention(head_dim={self.head_dim}, num_planes={self.num_planes}, "
                f"num_tables={self.num_tables}, beta={self.beta}"
                + (f", estimator={self.estimator!r})" if self.estimator != "ratio" else ")"))

    def __call__(self, q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = False,
                 key_mask: ArrayLike | None = None, check_finite: bool = True,
                 out: np.ndarray | None = None, cu_seqlens: ArrayLike | None = None) -> np.ndarray:
        return race_attention(q, k, v, self.planes, self.beta, causal=causal, key_mask=key_mask,
                              check_finite=check_finite, out=out, cu_seqlens=cu_seqlens, estimator=self.estimator)

    def fwd(self, q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = False,
            key_mask: ArrayLike | None = None, check_finite: bool = True,
            out: np.ndarray | None = None, cu_seqlens: ArrayLike | None = None) -> tuple[np.ndarray, Residuals]:
        return race_attention_fwd(q, k, v, self.planes, self.beta, causal=causal, key_mask=key_mask,
                                  check_finite=check_finite, out=out, cu_seqlens=cu_seqlens, estimator=self.estimator)

    def bwd(self, residuals: Residuals, grad_out: ArrayLike, *,
            out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None, dplanes: bool = False) -> tuple:
        return race_attention_bwd(residuals, grad_out, out=out, dplanes=dplanes)

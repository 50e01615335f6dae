"""Backends: what runs a call, chosen by the type of its arrays.

A *backend* computes RACE attention on one kind of memory.  Two exist:

* the CPU (:data:`CPU`): NumPy arrays and everything that converts to them
  without a copy (torch CPU tensors, JAX CPU arrays, objects with
  ``__array__`` or DLPack), computed by the CPU engine's kernels
  (:mod:`racecpu.engine`) or, for the per-bucket mean, in NumPy
  (:mod:`racecpu.bucket_mean`): :data:`ESTIMATORS`;
* racecpu.cuda (``racecpu.cuda.BACKEND``): arrays in GPU memory, i.e. any
  object exporting ``__cuda_array_interface__`` (CuPy arrays, numba device
  arrays, torch CUDA tensors), imported on the first such call, so that the
  CPU path never loads numba.cuda.

Every frontend that takes arrays picks the backend here (:func:`backend_for`:
the NumPy API of :mod:`racecpu.attention` and :mod:`racecpu.torch`), and a
backward runs on the backend its residuals record (their ``backend`` name,
:func:`backend_of`).  A new backend implements :class:`Backend`, records its
name in its residuals and is named in :func:`backend_for` and
:func:`backend_of`; a new estimator is a whole-call forward and backward named
in :data:`ESTIMATORS` (``docs/design.md``, "Map of the engine").
"""

from __future__ import annotations

from typing import Protocol

from . import bucket_mean, engine
from ._arrays import on_device
from .plan import ChunkModel, cpu_chunk_model

__all__ = ["Backend", "CpuBackend", "CPU", "ESTIMATORS", "backend_for", "backend_of", "check_estimator"]

#: The estimators the CPU computes, by name: the module whose ``forward`` and ``backward`` are
#: the NumPy API's whole calls with it (``docs/design.md`` sections 1.2 and 1.5).
ESTIMATORS = {"ratio": engine, "bucket_mean": bucket_mean}


class Backend(Protocol):
    """What a backend provides: the NumPy API's forward and backward on its memory, and how
    it cuts sequences into chunks (the plan's chunk model, :func:`racecpu.plan.make_plan`).

    ``forward`` takes :func:`racecpu.race_attention_fwd`'s arguments (and
    ``residuals``: False computes the output alone, as
    :func:`racecpu.race_attention`; ``planes_grad``: False promises that the
    backward will not ask for the planes' gradient, so that the residuals
    need not keep ``q`` and ``k``) and returns ``(out, residuals or None)``;
    the residuals it returns record its ``name`` (their ``backend``
    attribute).  ``backward`` takes :func:`racecpu.race_attention_bwd`'s.
    Either raises TypeError or NotImplementedError for what it cannot do
    (``out`` buffers are the CPU's alone).
    """

    name: str

    def chunk_model(self) -> ChunkModel: ...

    def forward(self, q, k, v, planes, beta, *, causal, key_mask, check_finite, cu_seqlens, out, residuals,
                estimator, planes_grad) -> tuple: ...

    def backward(self, residuals, grad_out, *, out, dplanes) -> tuple: ...


def check_estimator(estimator):
    """``estimator`` if it names one of :data:`ESTIMATORS`; ValueError otherwise."""
    if not isinstance(estimator, str) or estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {tuple(ESTIMATORS)}, got {estimator!r}")
    return estimator


class CpuBackend:
    """The CPU backend: the whole calls of each estimator (:data:`ESTIMATORS`) on NumPy arrays
    and what converts to them; the residuals say which estimator made them."""

    name = "cpu"

    def chunk_model(self) -> ChunkModel:
        """config.CHUNK tokens, config.PARTIAL_BUDGET (read per call)."""
        return cpu_chunk_model()

    def forward(self, q, k, v, planes, beta, *, causal=False, key_mask=None, check_finite=True, cu_seqlens=None,
                out=None, residuals=True, estimator="ratio", planes_grad=True):
        """:func:`racecpu.race_attention_fwd` (``residuals=False``: :func:`racecpu.race_attention`);
        ``planes_grad`` changes nothing here (the residuals hold views of ``q`` and ``k``, no copies)."""
        return ESTIMATORS[check_estimator(estimator)].forward(
            q, k, v, planes, beta, causal=causal, key_mask=key_mask, check_finite=check_finite, out=out,
            cu_seqlens=cu_seqlens, residuals=residuals)

    def backward(self, residuals, grad_out, *, out=None, dplanes=False):
        """:func:`racecpu.race_attention_bwd` of residuals this backend made (anything else:
        TypeError)."""
        # each estimator's backward checks that the residuals are its own
        estimator = ESTIMATORS.get(getattr(residuals, "estimator", None), engine)
        return estimator.backward(residuals, grad_out, out=out, dplanes=dplanes)

    def __repr__(self):
        return "racecpu.backend.CPU"


#: The CPU backend.
CPU = CpuBackend()


def backend_for(x) -> Backend:
    """The backend that computes on arrays like ``x``: racecpu.cuda's for arrays in GPU
    memory (:func:`racecpu._arrays.on_device`), else the CPU's."""
    if on_device(x):
        from . import cuda  # needs numba-cuda; raises ImportError saying so where it is missing
        return cuda.BACKEND
    return CPU


def backend_of(residuals) -> Backend:
    """The backend whose name ``residuals`` record (the CPU's for anything else, which then
    raises TypeError saying what residuals it takes)."""
    if getattr(residuals, "backend", "cpu") == "cuda":
        from . import cuda
        return cuda.BACKEND
    return CPU

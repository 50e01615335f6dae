"""Backends: what runs a call, chosen by the type of its arrays.

A *backend* computes RACE attention on one kind of memory.  Two exist:

* the CPU engine (:data:`racecpu.engine.CPU`): NumPy arrays and everything
  that converts to them without a copy (torch CPU tensors, JAX CPU arrays,
  objects with ``__array__`` or DLPack);
* racecpu.cuda (``racecpu.cuda.BACKEND``): arrays in GPU memory, i.e. any
  object exporting ``__cuda_array_interface__`` (CuPy arrays, numba device
  arrays, torch CUDA tensors), imported on the first such call, so that the
  CPU path never loads numba.cuda.

Every frontend that takes arrays picks the backend here (:func:`backend_for`:
the NumPy API of :mod:`racecpu.attention` and :mod:`racecpu.torch`), and a
backward runs on the backend its residuals record (:func:`backend_of`).  A
new backend implements :class:`Backend` and is named in :func:`backend_for`
(``docs/design.md``, "Map of the engine").
"""

from __future__ import annotations

from typing import Protocol

from . import engine
from ._arrays import on_device
from .plan import ChunkModel

__all__ = ["Backend", "backend_for", "backend_of"]


class Backend(Protocol):
    """What a backend provides: the NumPy API's forward and backward on its memory, and how
    it cuts sequences into chunks (the plan's chunk model, :func:`racecpu.plan.make_plan`).

    ``forward`` takes :func:`racecpu.race_attention_fwd`'s arguments (and
    ``residuals``: False computes the output alone, as
    :func:`racecpu.race_attention`) and returns ``(out, residuals or None)``;
    the residuals it returns record it (their ``backend`` attribute).
    ``backward`` takes :func:`racecpu.race_attention_bwd`'s.  Either raises
    TypeError or NotImplementedError for what it cannot do (``out`` buffers
    and the planes' gradient are the CPU's alone).
    """

    name: str

    def chunk_model(self) -> ChunkModel: ...

    def forward(self, q, k, v, planes, beta, *, causal, key_mask, check_finite, cu_seqlens, out,
                residuals) -> tuple: ...

    def backward(self, residuals, grad_out, *, out, dplanes) -> tuple: ...


def backend_for(x) -> Backend:
    """The backend that computes on arrays like ``x``: racecpu.cuda's for arrays in GPU
    memory (:func:`racecpu._arrays.on_device`), else the CPU engine's."""
    if on_device(x):
        from . import cuda  # needs numba-cuda; raises ImportError saying so where it is missing
        return cuda.BACKEND
    return engine.CPU


def backend_of(residuals) -> Backend:
    """The backend that made ``residuals`` (the CPU's for anything else: it raises TypeError)."""
    return getattr(residuals, "backend", engine.CPU)

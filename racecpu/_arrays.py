"""Other libraries' arrays at the NumPy API's boundary.

Inputs that are not NumPy arrays become NumPy arrays without a copy where
their library allows it (``__array__``, else DLPack): a torch CPU tensor or a
JAX CPU array shares its memory.  Results go back into the caller's array
type through its array-API namespace (``array-api-compat``): a torch CPU
tensor wraps racecpu's result without a copy (``torch.from_numpy``), other
libraries get ``xp.asarray(result)``.  bfloat16 crosses as ml_dtypes'
bfloat16 (a view of the same memory), where ml_dtypes is installed.  Arrays in GPU
memory never reach here (:func:`on_device`: the public functions send them to
:mod:`racecpu.cuda`).  A leaf module: NumPy and, only when a foreign array
arrives, array-api-compat.  A library's array type is recognised by ``isinstance``
against the library's own class, looked up only where the library is already
imported (an array of it cannot exist otherwise).
"""

from __future__ import annotations

import sys

import numpy as np


class ForeignArrayError(TypeError):
    """An input that the NumPy API cannot take as it is (the message says what to do instead)."""


def _instance_of(x, module, cls):
    """Whether ``x`` is an instance of ``module.cls``, without importing ``module``."""
    mod = sys.modules.get(module)
    t = getattr(mod, cls, None) if mod is not None else None
    return isinstance(t, type) and isinstance(x, t)


def is_torch(x):
    """Whether ``x`` is a torch tensor."""
    return _instance_of(x, "torch", "Tensor")


def is_cupy(x):
    """Whether ``x`` is a CuPy array."""
    return _instance_of(x, "cupy", "ndarray")


def on_device(x):
    """Whether ``x`` lives in GPU memory: it exports ``__cuda_array_interface__`` (CuPy
    arrays, numba device arrays, torch CUDA tensors).  A torch CUDA tensor that requires
    grad refuses to export (RuntimeError) and counts too."""
    try:
        return hasattr(x, "__cuda_array_interface__")
    except RuntimeError:
        return is_torch(x)


def bfloat16():
    """ml_dtypes' bfloat16 NumPy dtype, or None where ml_dtypes is not installed."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def torch_to_numpy(t):
    """A NumPy view of CPU tensor ``t`` (detached), bfloat16 as ml_dtypes' bfloat16;
    None for a bfloat16 tensor where ml_dtypes is missing."""
    import torch
    t = t.detach()
    if t.dtype == torch.bfloat16:
        bf16 = bfloat16()
        return None if bf16 is None else t.view(torch.int16).numpy().view(bf16)
    return t.resolve_conj().resolve_neg().numpy()


def numpy_to_torch(a):
    """``torch.from_numpy(a)`` (shares ``a``'s memory), ml_dtypes' bfloat16 as torch.bfloat16."""
    import torch
    if a.dtype.itemsize == 2 and a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def as_numpy(name, x):
    """``x`` as a NumPy array (no copy where its library allows).

    Raises
    ------
    ForeignArrayError
        For a torch tensor that requires grad (its gradient cannot flow
        through NumPy: use :mod:`racecpu.torch`) or that is not on the CPU.
    """
    if isinstance(x, np.ndarray):
        return x
    if is_torch(x):
        if getattr(x, "requires_grad", False):
            raise ForeignArrayError(
                f"{name} is a torch tensor that requires grad, and the NumPy API cannot carry its gradient: use "
                f"racecpu.torch.race_attention (an op with autograd), or pass {name}.detach()")
        device = getattr(x, "device", None)
        if getattr(device, "type", "cpu") != "cpu":
            raise ForeignArrayError(f"{name} is a torch tensor on {device}: use racecpu.torch.race_attention, "
                                    f"which runs CUDA tensors on the GPU, or pass {name}.cpu()")
        a = torch_to_numpy(x)
        if a is None:
            raise ForeignArrayError(f"{name} is a bfloat16 torch tensor: NumPy needs ml_dtypes for bfloat16 "
                                    f"(pip install ml_dtypes), or pass {name}.float()")
        return a
    if not hasattr(x, "__array__") and hasattr(x, "__dlpack__"):
        return np.from_dlpack(x)
    return np.asarray(x)


def namespace_of(x):
    """The array-API namespace that results should be returned in, or None for NumPy.

    None also for lists, scalars and anything array-api-compat does not know
    (or when it is not installed): those get NumPy arrays back, as before.
    """
    if isinstance(x, (np.ndarray, np.generic)) or not hasattr(x, "shape"):
        return None
    try:
        import array_api_compat
        return array_api_compat.array_namespace(x)
    except (ImportError, TypeError):
        return None


def to_namespace(xp, a):
    """``a`` (a NumPy array, or None) in namespace ``xp`` (None: ``a`` itself)."""
    if xp is None or a is None:
        return a
    import array_api_compat
    if array_api_compat.is_torch_namespace(xp):
        return numpy_to_torch(a)  # shares a's memory, as racecpu.torch does with its results
    return xp.asarray(a)

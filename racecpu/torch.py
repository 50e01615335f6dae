"""racecpu.torch: RACE attention as a PyTorch op with autograd.

``race_attention`` is registered with :func:`torch.library.custom_op` as
``racecpu::race_attention`` (forward, returning the output and an opaque
residual handle) and ``racecpu::race_attention_bwd`` (backward), with
``register_autograd`` and ``register_fake``: gradients flow to ``q``, ``k``,
``v`` and to ``beta`` when it is a tensor that requires grad, and
``torch.compile`` sees both as opaque ops (no graph break).  Eager calls on
plain tensors run the same forward and backward bodies as a plain
:class:`torch.autograd.Function` instead (the residuals on its context, no
handle), which skips the custom op's dispatch; torch.compile, fake and meta
tensors, tensor subclasses and ``torch.func`` transforms take the ops.

CPU tensors cross to :mod:`racecpu`'s NumPy API without a copy both ways
(``Tensor.numpy()`` views, ``torch.from_numpy`` of the results) when their
dtype is float16/32/64, or bfloat16 where ml_dtypes is installed (viewed as
ml_dtypes' bfloat16; the NumPy API widens 16-bit inputs to float32 on every
core and narrows its results).  Without ml_dtypes, bfloat16 is converted to
float32 (one copy of ``q, k, v`` and ``grad_out``) and the results back (one
copy each), into memory from racecpu's pool so that a training loop does not
fault fresh pages in for them every step.

The residuals
-------------
:func:`racecpu.race_attention_bwd` needs the :class:`racecpu.Residuals`
object of the forward, which is not a tensor.  The forward op keeps it in a
module-level table under an integer key and returns that key as a 0-dim
int64 "handle" tensor; autograd saves the handle for the backward op, which
looks the residuals up.  The entry is dropped when the handle tensor dies
(``weakref.finalize``), i.e. when the autograd graph that saved it is freed
(after ``backward()`` without ``retain_graph``, or when the output is
dropped without a backward), so residuals live exactly as long as a
``save_for_backward`` tensor would.  Recomputing the forward in the backward
instead would cost one more forward per step; the table costs nothing.
When no input needs a gradient (inference, ``torch.no_grad()``), the forward
keeps no residuals (:func:`racecpu.race_attention`) and the handle is -1.

Each call runs on the backend of its tensors (:func:`racecpu.backend.backend_for`):
CPU tensors on the CPU engine, CUDA tensors on :mod:`racecpu.cuda`
(``__cuda_array_interface__``, results back through ``torch.as_tensor``).
"""

import contextlib
import functools
import itertools
import threading
import weakref
from typing import Optional

import numpy as np
import torch
from torch import nn

from ._arrays import numpy_to_torch, torch_to_numpy
from ._memory import POOL
from .backend import backend_for, backend_of, check_estimator
from .hashing import DEFAULT_BETA, LAYER_BETA, LAYER_NUM_PLANES, LAYER_NUM_TABLES, hyperplanes

__all__ = ["race_attention", "RaceAttention"]

#: How bfloat16 CUDA tensors cross to racecpu.cuda: "float32" (a float32 copy of each, whole: the
#: form timed on an H200) or "bits" (``racecpu.cuda.Bfloat16`` of their int16 view: widened a
#: segment at a time by the chunkwise form, an element at a time by the tile kernels, results
#: returned in bfloat16, no whole copies).  "float32" until a GPU has run "bits" through torch:
#: racecpu.cuda's side is tested on Numba's simulator, this crossing is not.
CUDA_BFLOAT16 = "float32"

_RESIDUALS = {}          # handle -> the residuals of the forward's backend (CPU or racecpu.cuda)
_KEYS = itertools.count()
_LOCK = threading.Lock()
_NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)


# ---------------------------------------------------------------------------
# crossing between torch and the array API
# ---------------------------------------------------------------------------

def _to_numpy(t):
    """A NumPy view of CPU tensor ``t`` (no copy for float16/32/64, bool, and
    bfloat16 where ml_dtypes is installed; else bfloat16 is converted to
    float32, a copy)."""
    a = torch_to_numpy(t)
    if a is None:
        return _pooled(t.shape, torch.float32).copy_(t.detach()).numpy()
    return a


def _pooled(shape, dtype):
    """An uninitialised CPU tensor from racecpu's memory pool (README, "Memory"):
    converted copies reuse the pages of dropped ones instead of faulting fresh
    pages in every call."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(POOL.empty(shape, np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(POOL.empty(shape, torch.empty((), dtype=dtype).numpy().dtype))


def _from_numpy(a, dtype, device):
    """``a`` (the array API's result) as a tensor of ``dtype``: a view of the
    same memory when the dtypes agree (CPU), else a converted copy."""
    if device.type == "cuda":
        bits = getattr(a, "bits", None)   # racecpu.cuda.Bfloat16: int16 patterns of bfloat16 results
        if bits is not None and dtype == torch.bfloat16:
            return torch.as_tensor(bits, device=device).view(torch.bfloat16)
        t = torch.as_tensor(a, device=device)
    else:
        t = numpy_to_torch(np.asarray(a))
        if t.dtype != dtype:
            return _pooled(t.shape, dtype).copy_(t)
    return t if t.dtype == dtype else t.to(dtype)


def _to_device_array(t, bits=False):
    """CUDA tensor ``t`` as racecpu.cuda takes it (``__cuda_array_interface__``): detached,
    bfloat16 as float32 (CuPy and numba.cuda have no bfloat16), or with ``bits`` as
    ``racecpu.cuda.Bfloat16`` of its int16 view (no copy)."""
    t = t.detach()
    if t.dtype != torch.bfloat16:
        return t
    if bits:
        from .cuda import Bfloat16
        return Bfloat16(t.view(torch.int16))
    return t.to(torch.float32)


def _bits_crossing():
    """Whether bfloat16 CUDA tensors cross as bits (:data:`CUDA_BFLOAT16`)."""
    if CUDA_BFLOAT16 not in ("float32", "bits"):
        raise ValueError(f"racecpu.torch.CUDA_BFLOAT16 must be 'float32' or 'bits', got {CUDA_BFLOAT16!r}")
    return CUDA_BFLOAT16 == "bits"


def _backend(t):
    """(backend, to_array): the backend that runs tensors like ``t``
    (:func:`racecpu.backend.backend_for`) and how a tensor crosses to it."""
    if t.device.type not in ("cpu", "cuda"):
        raise NotImplementedError(f"racecpu.torch supports CPU and CUDA tensors, got device {t.device}")
    try:
        backend = backend_for(t.detach())
    except ImportError as exc:
        raise NotImplementedError(f"racecpu.torch on CUDA tensors needs racecpu.cuda: {exc}") from exc
    return backend, (_to_numpy if t.device.type == "cpu" else _to_device_array)


@contextlib.contextmanager
def _torch_threads_kept():
    """Restore torch's intra-op thread count after racecpu's kernels ran.

    When torch is loaded first, Numba's OpenMP layer binds to torch's libgomp,
    and each of racecpu's parallel regions sets that runtime's thread count
    (``omp_set_num_threads``) to Numba's: a model that ran torch on one thread
    would run its next torch ops on all of them."""
    n = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)


def _drop(key):
    with _LOCK:
        _RESIDUALS.pop(key, None)


# ---------------------------------------------------------------------------
# the ops
# ---------------------------------------------------------------------------

def _forward_impl(q, k, v, planes, beta, causal, key_mask, keep_residuals, cu_seqlens, estimator, planes_grad):
    """The forward on the tensors' backend: ``(out tensor, residuals or None)``; what both the
    custom op and the eager path (:class:`_EagerRace`) run."""
    backend, to_array = _backend(q)
    if to_array is _to_device_array and _bits_crossing():
        to_array = functools.partial(_to_device_array, bits=True)
    args = (to_array(q), to_array(k), to_array(v), to_array(planes), float(beta))
    kw = {"causal": causal, "key_mask": None if key_mask is None else to_array(key_mask), "estimator": estimator}
    if cu_seqlens is not None:  # offsets: read on the host on either device
        kw["cu_seqlens"] = cu_seqlens.detach().cpu().numpy()
    with _torch_threads_kept():
        out, res = backend.forward(*args, residuals=keep_residuals, planes_grad=planes_grad, **kw)
    return _from_numpy(out, v.dtype, q.device), res


@torch.library.custom_op("racecpu::race_attention", mutates_args=())
def _race_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, planes: torch.Tensor,
                       beta: torch.Tensor, causal: bool, key_mask: Optional[torch.Tensor],
                       keep_residuals: bool, cu_seqlens: Optional[torch.Tensor] = None, estimator: str = "ratio",
                       planes_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    out, res = _forward_impl(q, k, v, planes, beta, causal, key_mask, keep_residuals, cu_seqlens, estimator,
                             planes_grad)
    if keep_residuals:
        with _LOCK:
            key = next(_KEYS)
            _RESIDUALS[key] = res
        handle = torch.tensor(key, dtype=torch.int64)
        weakref.finalize(handle, _drop, key)
    else:
        handle = torch.tensor(-1, dtype=torch.int64)
    return out, handle


@_race_attention_op.register_fake
def _(q, k, v, planes, beta, causal, key_mask, keep_residuals, cu_seqlens=None, estimator="ratio", planes_grad=True):
    out = q.new_empty(q.shape[:-1] + v.shape[-1:], dtype=v.dtype)  # C-contiguous, as the real one
    return out, torch.empty((), dtype=torch.int64)


@torch.library.custom_op("racecpu::race_attention_bwd", mutates_args=())
def _race_attention_bwd_op(handle: torch.Tensor, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, planes: torch.Tensor, dplanes: bool
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    key = int(handle)
    with _LOCK:
        res = _RESIDUALS.get(key)
    if res is None:
        raise RuntimeError("racecpu::race_attention_bwd: the forward's residuals are gone (the forward ran "
                           "without any input requiring grad, or its graph was freed)")
    return _backward_impl(res, grad_out, q, k, v, planes, dplanes)


def _backward_impl(res, grad_out, q, k, v, planes, dplanes):
    """The backward from the forward's residuals: ``(dq, dk, dv, dbeta, dW)`` tensors (``dW`` a
    placeholder without ``dplanes``); what both the custom op and the eager path run."""
    _, to_array = _backend(grad_out)
    if to_array is _to_device_array and _bits_crossing():   # the cotangent crosses as the forward's inputs
        to_array = functools.partial(_to_device_array, bits=True)
    dev = grad_out.device
    with _torch_threads_kept():
        if dplanes:
            dq, dk, dv, dbeta, dW = backend_of(res).backward(res, to_array(grad_out), dplanes=True)
            dW = _from_numpy(np.ascontiguousarray(dW) if isinstance(dW, np.ndarray) else dW, planes.dtype, dev)
        else:
            dq, dk, dv, dbeta = backend_of(res).backward(res, to_array(grad_out))
            dW = planes.new_zeros(())  # a placeholder: autograd is given None
    return (_from_numpy(dq, q.dtype, dev), _from_numpy(dk, k.dtype, dev), _from_numpy(dv, v.dtype, dev),
            torch.tensor(dbeta, dtype=torch.float64, device=dev), dW)


@_race_attention_bwd_op.register_fake
def _(handle, grad_out, q, k, v, planes, dplanes):
    # the real gradients are C-contiguous whatever the inputs' strides
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            grad_out.new_empty((), dtype=torch.float64), planes.new_empty(planes.shape if dplanes else ()))


def _setup_context(ctx, inputs, output):
    q, k, v, planes, beta = inputs[:5]
    _, handle = output
    # q, k, v only give the gradients' dtypes and shapes (and are views, so saving them costs nothing)
    ctx.save_for_backward(handle, q, k, v, planes)
    ctx.beta_meta = (beta.shape, beta.dtype)


def _gradients(ctx, grads):
    """Autograd's tuple from the backward's ``(dq, dk, dv, dbeta, dW)``: None where not asked."""
    dq, dk, dv, dbeta, dW = grads
    need = ctx.needs_input_grad
    shape, dtype = ctx.beta_meta
    dbeta = dbeta.reshape(shape).to(dtype) if need[4] else None
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
            dW if need[3] else None, dbeta, None, None, None, None, None, None)


def _zero_cotangent(grad_out, q, v):
    return torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=v.dtype, device=v.device) if grad_out is None else grad_out


def _backward(ctx, grad_out, _grad_handle):
    handle, q, k, v, planes = ctx.saved_tensors
    grad_out = _zero_cotangent(grad_out, q, v)
    return _gradients(ctx, _race_attention_bwd_op(handle, grad_out, q, k, v, planes, bool(ctx.needs_input_grad[3])))


_race_attention_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerRace(torch.autograd.Function):
    """The op's forward and backward as a plain autograd function, for eager calls on plain
    tensors: the residuals live on the autograd context instead of behind a handle, and the
    custom op's dispatch, most of what the op cost beyond the NumPy API at small calls, is
    skipped (the performance log's "the torch op's eager path").  torch.compile, fake and meta
    tensors, tensor subclasses and torch.func transforms take the custom op, which they need."""

    @staticmethod
    def forward(ctx, q, k, v, planes, beta, causal, key_mask, cu_seqlens, estimator, planes_grad):
        out, res = _forward_impl(q, k, v, planes, beta, causal, key_mask, True, cu_seqlens, estimator, planes_grad)
        ctx.res = res
        ctx.save_for_backward(q, k, v, planes)
        ctx.beta_meta = (beta.shape, beta.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, planes = ctx.saved_tensors
        grads = _backward_impl(ctx.res, _zero_cotangent(grad_out, q, v), q, k, v, planes,
                               bool(ctx.needs_input_grad[3]))
        return _gradients(ctx, grads)[:10]


def _eager(*tensors):
    """Whether a call may take :class:`_EagerRace`: not compiling, no torch.func transform, and
    plain tensors on a real device."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    return all(t is None or (type(t) in (torch.Tensor, nn.Parameter) and t.device.type != "meta") for t in tensors)


# ---------------------------------------------------------------------------
# the public function and module
# ---------------------------------------------------------------------------

def race_attention(q, k, v, planes, beta=DEFAULT_BETA, *, causal=False, key_mask=None, cu_seqlens=None,
                   estimator="ratio"):
    """RACE attention on torch tensors, differentiable (see :func:`racecpu.race_attention`).

    Parameters
    ----------
    q : Tensor, shape (..., Nq, d)
    k : Tensor, shape (..., Nk, d)
    v : Tensor, shape (..., Nk, dv)
        The same leading (batch, head) dims; float16, bfloat16, float32 or
        float64, all on one device (CPU; CUDA through :mod:`racecpu.cuda`).
        Any strides (a non-contiguous CPU tensor is viewed, not copied).
    planes : Tensor or array_like, shape (L, P, d)
        Hyperplanes (:func:`racecpu.hyperplanes`); cast to the compute
        dtype.  A tensor that requires grad (learnable planes) gets the
        gradient of :func:`racecpu.race_attention_bwd`'s ``dplanes=True``,
        in its own dtype (on CUDA too, packed sequences included).
    beta : float or Tensor with one element
        Soft-hash temperature (> 0).  A tensor that requires grad gets the
        gradient summed over every batch, head and token, in its own dtype
        and shape.
    causal : bool
        Query i sees keys j <= i (needs Nq == Nk).
    key_mask : bool Tensor, shape (..., Nk), optional
        False keys contribute nothing.
    cu_seqlens : int Tensor or array_like, shape (S + 1,), optional
        Packed sequences (flash-attn's offsets ``0, n1, n1 + n2, ..., N``),
        each attending only within itself.
    estimator : {"ratio", "bucket_mean"}
        As :func:`racecpu.race_attention`'s (on CUDA tensors too).

    Returns
    -------
    out : Tensor, shape (..., Nq, dv), dtype of ``v``
        float16 computes in float32 (as the NumPy API does), bfloat16 in
        float32 with its inputs converted (copies); float32/float64 on the CPU
        are the NumPy API's result without a copy (``out.numpy()`` is it).  It
        aliases no input.  Gradients come in the dtype of their input.

    Notes
    -----
    Inputs are never modified.  While a graph that holds this op's output is
    alive, the forward's residuals keep a reference to ``v``'s memory: do not
    modify ``v`` in place before the backward (autograd's version check does
    not see it).
    """
    if not isinstance(planes, torch.Tensor):
        planes = torch.as_tensor(np.asarray(planes), device=q.device)
    if not isinstance(beta, torch.Tensor):
        beta = torch.tensor(float(beta), dtype=torch.float64)
    if beta.numel() != 1:
        raise ValueError(f"beta must have one element, got shape {tuple(beta.shape)}")
    if beta.device != q.device and beta.device.type != "cpu":
        beta = beta.cpu()
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, planes, beta))
    if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = torch.as_tensor(np.asarray(cu_seqlens))
    # planes_grad: without learnable planes the GPU's residuals need not keep q and k (on CUDA,
    # bfloat16 ones are float32 copies made for racecpu.cuda)
    estimator, planes_grad = check_estimator(estimator), bool(planes.requires_grad)
    if _eager(q, k, v, planes, beta, key_mask, cu_seqlens):
        if not keep:   # nothing to differentiate: the forward alone, no graph
            return _forward_impl(q, k, v, planes, beta, bool(causal), key_mask, False, cu_seqlens, estimator,
                                 planes_grad)[0]
        return _EagerRace.apply(q, k, v, planes, beta, bool(causal), key_mask, cu_seqlens, estimator, planes_grad)
    out, _ = _race_attention_op(q, k, v, planes, beta, bool(causal), key_mask, keep, cu_seqlens, estimator,
                                planes_grad)
    return out


class RaceAttention(nn.Module):
    """RACE attention as an ``nn.Module``, called like ``F.scaled_dot_product_attention``.

    Holds the ``(L, P, d)`` planes as a buffer (saved in the state dict, moved
    by ``.to()``, not trained; a parameter with ``learn_planes=True``) and
    ``beta`` as a parameter (trained unless ``learn_beta=False``).

    Parameters
    ----------
    head_dim : int
        ``d`` of q and k.
    num_planes, num_tables : int, default 5, 4
        ``P`` and ``L`` (``racecpu.hashing.LAYER_NUM_PLANES``, ``LAYER_NUM_TABLES``).
    beta : float, default 2
        Initial soft-hash temperature (> 0; ``LAYER_BETA``).  These
        defaults come from training runs (docs/choosing.md): P = L = 3 from
        beta 8, the defaults before, recalled worse than linear attention.
    seed : int
        Seed of :func:`racecpu.hyperplanes`.
    learn_beta : bool
        Whether ``beta`` requires grad.
    learn_planes : bool
        Whether the planes are a trained parameter (learnable hash planes,
        CPU only) instead of a buffer.
    dtype : torch.dtype
        dtype of the planes and of ``beta``.
    estimator : {"ratio", "bucket_mean"}
        As :func:`racecpu.race_attention`'s.

    Examples
    --------
    In a multi-head block, in place of ``F.scaled_dot_product_attention(q, k,
    v, is_causal=True)`` with ``q, k, v`` of shape ``(B, H, N, d)``::

        self.attn = RaceAttention(d)
        y = self.attn(q, k, v, is_causal=True)
    """

    def __init__(self, head_dim, num_planes=LAYER_NUM_PLANES, num_tables=LAYER_NUM_TABLES, beta=LAYER_BETA, seed=0,
                 learn_beta=True,
                 dtype=torch.float32, learn_planes=False, estimator="ratio"):
        super().__init__()
        self.estimator = check_estimator(estimator)
        planes = torch.from_numpy(hyperplanes(head_dim, num_planes, num_tables, seed=seed, dtype=np.float64)).to(dtype)
        if learn_planes:
            self.planes = nn.Parameter(planes)
        else:
            self.register_buffer("planes", planes)
        self.beta = nn.Parameter(torch.tensor(float(beta), dtype=dtype), requires_grad=learn_beta)

    def extra_repr(self):
        L, P, d = self.planes.shape
        return f"head_dim={d}, num_planes={P}, num_tables={L}" + (
            f", estimator={self.estimator!r}" if self.estimator != "ratio" else "")

    def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *,
                key_mask=None, cu_seqlens=None):
        """``(..., Nq, d), (..., Nk, d), (..., Nk, dv) -> (..., Nq, dv)``.

        ``attn_mask``, ``dropout_p`` and ``scale`` are SDPA's arguments that
        RACE has no equivalent of: anything but their defaults raises
        ``NotImplementedError``.  Use ``key_mask`` (bool ``(..., Nk)``, False
        = padding) for padding masks, ``cu_seqlens`` for packed sequences.
        """
        if attn_mask is not None:
            raise NotImplementedError("RaceAttention takes no attn_mask; use is_causal and key_mask")
        if dropout_p:
            raise NotImplementedError("RaceAttention has no attention dropout")
        if scale is not None:
            raise NotImplementedError("RaceAttention has no scale (beta plays the temperature's part)")
        return race_attention(query, key, value, self.planes, self.beta, causal=is_causal, key_mask=key_mask,
                              cu_seqlens=cu_seqlens, estimator=self.estimator)

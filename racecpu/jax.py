"""racecpu.jax: RACE attention as a differentiable JAX function (CPU).

:func:`race_attention` is a :func:`jax.custom_vjp` whose forward and
backward call :mod:`racecpu`'s NumPy API through :func:`jax.pure_callback`:
it works under ``jit``, ``grad`` (reverse mode only: no ``jvp``/``jacfwd``)
and ``vmap`` (each mapped element is one host call, ``vmap_method=
"sequential"``; put batch and head dims in the leading dims of ``q, k, v``
instead where you can, which is one call).

Residuals: a callback cannot hand a Python object (:class:`racecpu.Residuals`)
to the backward, so the forward keeps ``q, k, v, planes, beta, key_mask``
and the backward's callback runs :func:`racecpu.race_attention_fwd` again
before :func:`racecpu.race_attention_bwd` (one extra forward per backward;
the gradients are the NumPy API's, bit for bit).  The forward itself calls
:func:`racecpu.race_attention`, which keeps no residuals.

The arrays cross to the host as the callback's NumPy arrays (on the CPU
backend, XLA's buffers).  float16 and bfloat16 (ml_dtypes, which JAX
ships with) compute in float32 as in the NumPy API: widened and narrowed on
every core, results in the inputs' dtype.

Errors.  :func:`race_attention` checks what it can see when it is called (under
``jit``, at trace time) with the NumPy API's own checks, run on zero-stride
stand-ins of the arrays' shapes and dtypes: it raises the NumPy API's
TypeError or ValueError there, before any callback.  Values inside traced
arrays (NaN in ``q``, a traced ``beta`` or ``cu_seqlens``) are seen only by
the callback, when the computation runs: JAX then raises its own
``JaxRuntimeError`` (a RuntimeError) whose message ends with racecpu's error.
"""

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from . import attention as _api
from ._checks import check_args, check_array, half_format
from .hashing import DEFAULT_BETA
from .plan import make_plan

__all__ = ["race_attention"]


def _host(x):
    return np.asarray(x)


def _packed(cu):
    """cu_seqlens from its callback array: none has no offsets (a real one has two or more)."""
    return None if cu.size == 0 else _host(cu)


def _fwd_host(causal, has_mask, q, k, v, planes, beta, mask, cu):
    out = _api.race_attention(_host(q), _host(k), _host(v), _host(planes), float(beta), causal=causal,
                              key_mask=mask if has_mask else None, cu_seqlens=_packed(cu))
    return out.astype(v.dtype, copy=False)


def _bwd_host(causal, has_mask, learn_planes, q, k, v, planes, beta, mask, cu, g):
    _, res = _api.race_attention_fwd(_host(q), _host(k), _host(v), _host(planes), float(beta), causal=causal,
                                     key_mask=mask if has_mask else None, cu_seqlens=_packed(cu))
    if learn_planes:
        dq, dk, dv, dbeta, dW = _api.race_attention_bwd(res, _host(g), dplanes=True)
        dW = np.asarray(dW).astype(planes.dtype, copy=False)
    else:
        dq, dk, dv, dbeta = _api.race_attention_bwd(res, _host(g))
        dW = np.broadcast_to(np.zeros((), planes.dtype), planes.shape)  # constants: no memory
    return (dq.astype(q.dtype, copy=False), dk.astype(k.dtype, copy=False), dv.astype(v.dtype, copy=False),
            np.asarray(dbeta, dtype=beta.dtype), dW)


def _traced(x):
    return isinstance(x, jax.core.Tracer)


def _stand_in(x):
    """Zero-stride NumPy array of ``x``'s shape and dtype (no memory, no data read)."""
    shape = tuple(int(s) for s in x.shape)
    return np.lib.stride_tricks.as_strided(np.zeros((), np.dtype(x.dtype)), shape=shape, strides=(0,) * len(shape))


def _beta_to_check(beta):
    """What :func:`racecpu._checks.check_args` checks of ``beta``: a Python or NumPy scalar
    as given (a bool is an error), a concrete array's one element, or a valid stand-in for
    a traced ``beta``, which is checked by its shape and dtype alone."""
    if isinstance(beta, numbers.Real) or (isinstance(beta, np.generic) and half_format(beta.dtype) is None):
        return beta
    b = _stand_in(beta) if _traced(beta) else np.asarray(beta)
    if b.size != 1:  # jnp's reshape would say "cannot reshape"
        raise ValueError(f"beta must have one element (a positive finite float), got shape {b.shape}")
    if half_format(b.dtype) is not None:  # a bfloat16 beta, as the float it becomes here
        b = b.astype(np.float32)
    if not _traced(beta):
        return b.reshape(())
    if b.dtype.kind not in "fiu":
        raise TypeError(f"beta must be a scalar float, got {b.dtype} array of shape {b.shape}")
    return 1.0


def _check(q, k, v, planes, beta, causal, mask, cu):
    """The NumPy API's argument checks at trace time, on stand-ins of the traced arrays.

    ``planes`` and a concrete ``cu`` are checked by value (small, and not
    traced data); a traced ``cu`` by shape and dtype."""
    qs, ks, vs = (check_array(name, _stand_in(x), False)[0] for name, x in (("q", q), ("k", k), ("v", v)))
    W = _stand_in(planes) if _traced(planes) else np.asarray(planes)
    _, _, _, G, W, _, group = check_args(qs, ks, vs, W, _beta_to_check(beta), causal,
                                         None if mask is None else _stand_in(mask), grouped=True)
    if cu is None:
        return
    nq, nk = qs.shape[-2], ks.shape[-2]
    if _traced(cu):
        dt = np.dtype(cu.dtype)
        cu = np.zeros(cu.shape, np.int64 if dt.kind in "iu" else dt)
        if cu.ndim == 1 and cu.size >= 2:
            cu[-1] = max(nq, nk)  # valid offsets: only the shape and dtype are checked
    else:
        cu = np.asarray(cu)
    # the plan the callback makes checks the offsets against the sequence lengths
    make_plan(G=G, group=group, nq=nq, nk=nk, d=qs.shape[-1], dv=vs.shape[-1], L=W.shape[0], P=W.shape[1],
              causal=causal, cu_seqlens=cu)


def _sds(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _race(causal, has_mask, learn_planes, q, k, v, planes, beta, mask, cu):
    shape = jax.ShapeDtypeStruct(q.shape[:-1] + v.shape[-1:], v.dtype)
    return jax.pure_callback(functools.partial(_fwd_host, causal, has_mask), shape, q, k, v, planes, beta, mask,
                             cu, vmap_method="sequential")


def _race_fwd(causal, has_mask, learn_planes, q, k, v, planes, beta, mask, cu):
    return (_race(causal, has_mask, learn_planes, q, k, v, planes, beta, mask, cu),
            (q, k, v, planes, beta, mask, cu))


def _race_bwd(causal, has_mask, learn_planes, saved, g):
    q, k, v, planes, beta, mask, cu = saved
    dq, dk, dv, dbeta, dW = jax.pure_callback(functools.partial(_bwd_host, causal, has_mask, learn_planes),
                                              (_sds(q), _sds(k), _sds(v), _sds(beta), _sds(planes)), q, k, v,
                                              planes, beta, mask, cu, g, vmap_method="sequential")
    # without learn_planes the planes' cotangent is zero; the mask and offsets are integral (float0 cotangents)
    return (dq, dk, dv, dW, dbeta, np.zeros(mask.shape, dtype=jax.dtypes.float0),
            np.zeros(cu.shape, dtype=jax.dtypes.float0))


_race.defvjp(_race_fwd, _race_bwd)


def race_attention(q, k, v, planes, beta=DEFAULT_BETA, *, causal=False, key_mask=None, learn_planes=False,
                   cu_seqlens=None):
    """RACE attention on JAX arrays (see :func:`racecpu.race_attention`), differentiable in reverse mode.

    Parameters
    ----------
    q : jax.Array, shape (..., Nq, d)
    k : jax.Array, shape (..., Nk, d)
    v : jax.Array, shape (..., Nk, dv)
        The same leading dims; float16, bfloat16, float32 or float64 (float64
        needs ``jax_enable_x64``).
    planes : array_like, shape (L, P, d)
        From :func:`racecpu.hyperplanes`.  Constants (zero cotangent) unless
        ``learn_planes``.
    beta : float or scalar array
        Soft-hash temperature (> 0); differentiable (its cotangent is the
        NumPy API's ``dbeta``, in ``beta``'s dtype).
    causal : bool (static)
        Query i sees keys j <= i (needs Nq == Nk).
    key_mask : bool array, shape (..., Nk), optional
        False keys contribute nothing.
    learn_planes : bool (static)
        The planes' cotangent is :func:`racecpu.race_attention_bwd`'s
        ``dplanes`` (learnable hash planes; costs the backward ~15-20 %).
    cu_seqlens : int array, shape (S + 1,), optional
        Packed sequences (flash-attn's offsets ``0, n1, ..., N``), each
        attending only within itself; may be traced.

    Returns
    -------
    out : jax.Array, shape (..., Nq, dv), dtype of ``v``
        A new array (it aliases nothing).  Gradients come in the dtype of
        their input.

    Raises
    ------
    TypeError, ValueError
        When called (under ``jit``: at trace time), the NumPy API's errors
        for dtypes and shapes of ``q, k, v, planes, key_mask, cu_seqlens``
        (and concrete ``planes``' values); for a ``beta`` that is not one positive
        finite number (``ValueError`` for more than one element); for offsets
        that do not run from 0 to N without decreasing.  A traced ``beta``
        or ``cu_seqlens`` is checked by shape and dtype only.
    jax.errors.JaxRuntimeError
        NaN or Inf in ``q, k, v`` (or the cotangent), and bad values of a
        traced ``beta`` or ``cu_seqlens``, are found by the host callback
        when the computation runs; JAX reports the callback's ValueError as
        this RuntimeError, its message ending with racecpu's text.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    planes = jnp.asarray(planes)
    has_mask = key_mask is not None
    mask = jnp.asarray(key_mask, dtype=bool) if has_mask else jnp.zeros((0,), dtype=bool)
    cu = jnp.zeros((0,), dtype=jnp.int32) if cu_seqlens is None else jnp.asarray(cu_seqlens)
    _check(q, k, v, planes, beta, bool(causal), mask if has_mask else None, None if cu_seqlens is None else cu)
    beta = jnp.asarray(beta, dtype=jnp.result_type(float)).reshape(())
    return _race(bool(causal), has_mask, bool(learn_planes), q, k, v, planes, beta, mask, cu)

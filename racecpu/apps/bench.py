"""``racecpu bench``: the benchmark suite (speed, roofline, memory, threads, compile cost, features).

What it measures
----------------
1. **This machine's limits**, at the start of every run: stream copy bandwidth
   (``numpy.copyto`` of a 1 GiB float32 array, 256 MiB with ``--quick``; read +
   write bytes over time, best of 1 thread and ``--threads`` Python threads on
   halves) and the SGEMM rate
   (``numpy`` float32 ``2048 x 2048`` matmul with ``--threads`` BLAS threads).
   Both are the best of several repeats, measured at the start and again at the
   end of the run (the roof uses the best; a drift over 20 % is flagged as a
   noisy machine): a roof, not a typical value.
2. **Scaling** over ``N = 2**min_log2n .. 2**max_log2n``: forward and
   forward+backward, causal and not, of ``racecpu.race_attention`` (the forward
   alone, keeping no residuals, as the torch peers run under ``no_grad``) and
   ``race_attention_fwd`` / ``race_attention_bwd`` (``race``; ``race-out`` is the same call writing into
   ``out=`` buffers allocated once per measurement, as a training loop would) against,
   in the same run and back to back (the order of
   implementations rotates), a vectorised NumPy statement of the same math
   (:func:`numpy_race_fwd`, :func:`numpy_race_bwd`) and, with torch installed, a
   vectorised torch statement with autograd (:func:`torch_race`) and
   ``torch.nn.functional.scaled_dot_product_attention`` (SDPA).
3. **Thread scaling**: RACE forward+backward at batch = 1, heads = 1, largest N,
   ``NUMBA_NUM_THREADS`` = 1 and ``--threads``, both ``race`` and ``race-out``
   (fresh outputs reuse the previous call's dropped results through racecpu's
   pool, so only the first call's page faults, untimed, differ between them);
   and, as the reference of what the threads reach on independent work, ``race``
   with as many heads as threads (one head per thread: no head split over
   threads, whose causal scans then need chunk totals for their carries).
4. **Compile / first-call cost**: a fresh process with an empty ``NUMBA_CACHE_DIR``
   (cold: compiles every kernel the public API uses in float32) and a fresh
   process with that now warm cache (time from ``import racecpu`` to the first
   result, and to all results).
5. **Features** (only when named: ``--sections features`` or e.g.
   ``--sections scaling,features``; not with ``--device cuda``): three features
   against their baselines at one ``N = 2**--features-log2n`` (default 2**16,
   2**12 with ``--quick``), batch 1, d, dv, P, L and dtype of the suite:
   grouped-query attention (q with 32 heads, k and v with 8) against k and v
   repeated to 32 heads beforehand (the repeat untimed), forward+backward;
   64 equal packed sequences (``cu_seqlens``) against one sequence of the same N,
   4 heads, forward+backward; ``race_attention_bwd(..., dplanes=True)`` against
   the plain backward, 4 heads, the backward alone (one untimed forward shared).
   Causal and not.  Each (feature, causal) is one fresh process that times the
   feature and its baseline on the same inputs, alternately (which goes first
   alternates), after one untimed call of each at full size; ratio = median
   feature time / median baseline time (with ``--rounds``, the calls of that many
   processes pooled), against the targets (<= 0.7, <= 1.1, <= 1.15), each
   reported as met or missed with the measured ratio.
6. **Train** (only when named: ``--sections train``; not in the default set, as its
   SDPA forward+backward at 16K tokens and RACE at ``(1, 4, 2**20, 128)`` take
   minutes): the shapes people train at, :data:`TRAIN_SHAPES` ``(B, H, N, d)``,
   dv = d, P, L and dtype of the suite (default 3, 3, float32; ``--train-shapes``
   replaces the list, e.g. to drop the 2**20 one), forward and forward+backward,
   causal and not: ``race`` (as in scaling) and ``sdpa`` (``is_causal=True`` when
   causal), each in its own process like a scaling measurement (median of the
   timed calls), skipped by the same memory and per-call time caps (time predicted
   from the roof for RACE and from ``B H N^2 d`` flops at the SGEMM rate for SDPA,
   scaled by the measured / predicted of the shape before).  Reported: ns per
   token-head, the roof of this shape (below) at this run's bandwidth and SGEMM
   rate, the multiple of the roof (measured / roof), SDPA's ns per token-head and
   SDPA time / RACE time ("-" where SDPA did not run: no torch, or a cap).

Every measurement runs in a fresh subprocess (``python -c``): it warms up on a tiny
input (compile / cache load / thread pools), resets its RSS high-water
mark (``/proc/self/clear_refs``), makes its inputs, makes one untimed call at full
size (unless a call is predicted to take over 10 s), times ``--repeats`` calls
(fewer when they exceed ``--budget-seconds``; at least one) and reports the median
and ``VmHWM``.  Memory ratio = peak RSS / bytes of (q, k, v, out, grad_out, dq,
dk, dv) for forward+backward and of (q, k, v, out) for the forward; the peak
includes the interpreter (~0.1 GB, ~0.3 GB with torch), negligible at large N.
With ``--device cuda`` (``racecpu.cuda`` on CuPy arrays, SDPA on torch CUDA
tensors) only machine limits (CuPy copy and float32 matmul) and scaling run
(other sections asked for are skipped with a note),
and the ratio uses the device peak (CuPy pool / ``torch.cuda``).

Skips (said in the table, the CSV and the log): before each measurement its
peak memory and its time per call are predicted, from a static model for the
first size and by extrapolating the previous size's measurement (memory above
the interpreter's: linear in N for every implementation; time: linear, SDPA
quadratic).  A measurement predicted above ``--mem-cap-gib`` (default 90 % of
MemAvailable at start; 3 GiB with ``--quick``) or ``--max-call-seconds``
(default 60 s) per call is skipped, and so are all larger N of that
configuration.  The causal cumsum statements hold ``(N, F, dv)`` prefix states
(NumPy ~2.5x, torch ~4.5x ``N * F * dv * 4`` bytes per head for fwd+bwd) and hit
the memory cap first (N ~ 2**15 at 4 heads and 12 GiB); SDPA forward+backward
is quadratic (~12 s at 16k, ~3 min at 64k on this machine) and hits the time cap.

Roofline (per token-head; itemsize ``s`` = 4 for float32)
--------------------------------------------------------
Notation: head dim ``d``, value dim ``dv``, ``L`` tables of ``P`` planes, ``R = 2**P``
buckets, ``F = L * R`` soft-bucket features per token.  Per token and head the
algorithm (Algorithms 1, 2 and the backward of docs/design.md section 3) must move:

forward
    reads q, k (``2 d s``), v (``dv s``); writes out (``dv s``) and the residuals
    phi of q and k (``2 F s``), t of q and k (``2 L P s``), den (8, float64)::

        bytes_fwd = s (2 d + 2 dv + 2 F + 2 L P) + 8

backward
    reads grad_out (``dv s``), v (``dv s``), phi and t of q and k
    (``2 F s + 2 L P s``), den (8); writes dq, dk (``2 d s``), dv (``dv s``)::

        bytes_bwd = s (2 d + 3 dv + 2 F + 2 L P) + 8

and must compute (multiply-add = 2 flops; tanh, sigmoid and O(F P) softmax
terms are not counted):

forward
    hash of q and of k: ``2 L P d`` each; sketch of a key ``B += phi v^T``:
    ``2 F dv``; readout of a query ``phi B``: ``2 F dv``::

        flops_fwd = 4 L P d + 4 F dv

backward
    per query ``y = B g`` (``2 F dv``), ``dB += phi g^T`` (``2 F dv``), ``dq = W^T du``
    (``2 L P d``); per key ``dphi = dB v`` (``2 F dv``), ``dv = dB^T phi``
    (``2 F dv``), ``dk = W^T du`` (``2 L P d``)::

        flops_bwd = 4 L P d + 8 F dv        (~2x the forward)

At d = dv = 128, P = L = 3 (F = 24): 2,320 + 2,832 = 5,152 bytes and
16,896 + 29,184 = 46,080 flops per token-head for forward+backward.  With
~40 GB/s and ~200 GFLOP/s that is 129 ns (memory) vs 230 ns (compute): the
kernels are compute-bound, roof = max(bytes / bandwidth, flops / SGEMM rate).
Causal attention has the same counts: a sequential scan costs nothing extra.
A scan in segments (what lets one head use two cores) sums the chunk totals of
all segments but one: ``2 F dv`` flops (6,144) per token of those chunks, in
the forward and in the backward; at one head on 2 threads, half the tokens.
The roofline does not include them, so it is a lower bound on time.  Fractions are ``roof / measured`` (1 = at the roof).  The roof uses
the SGEMM rate, which fused per-token loops can rarely reach; it is what the
machine could do, not a promise.

Peers measured in the same run compute the same function (``numpy-vec``,
``torch-vec``; tests check them against :mod:`racecpu`) or softmax attention of
the same shapes (``sdpa``).  Ratios in the table are peer time / RACE time.
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

__all__ = ["add_arguments", "run", "roofline_counts", "numpy_race_fwd", "numpy_race_bwd", "torch_race"]

#: Implementations by device, in table order.
IMPLS = {"cpu": ("race", "race-out", "numpy-vec", "torch-vec", "sdpa"), "cuda": ("race-cuda", "sdpa-cuda")}
TORCH_IMPLS = {"torch-vec", "sdpa", "sdpa-cuda"}
CONFIGS = (("fwd", False), ("fwd", True), ("fwdbwd", False), ("fwdbwd", True))
#: Thread scaling runs both: fresh outputs (what a plain call gets) and out= buffers allocated once.
THREAD_IMPLS = ("race", "race-out")
#: Sections that --sections may name, in the order they run (the machine's always runs).
SECTIONS = ("scaling", "threads", "compile", "features", "train")
#: The train section's shapes (B, H, N, d), dv = d (--train-shapes replaces them).
TRAIN_SHAPES = ((8, 8, 1024, 64), (4, 8, 4096, 64), (1, 16, 16384, 64), (1, 4, 4096, 128), (1, 4, 2 ** 20, 128))
#: The features section: (feature, what is timed, target of feature time / baseline time, what the pair is).
FEATURES = (
    ("gqa", "fwdbwd", 0.7, "32 query heads over 8 key/value heads vs k, v repeated to 32 heads (repeat untimed)"),
    ("packed", "fwdbwd", 1.1, "64 equal packed sequences (cu_seqlens) vs one sequence of the same N, 4 heads"),
    ("dplanes", "bwd", 1.15, "race_attention_bwd(dplanes=True) vs without, backward only (one shared forward), "
                             "4 heads"),
)
#: Query and key/value heads of the grouped-query pair; heads of the other two pairs; packed sequences.
GQA_HEADS = (32, 8)
FEATURE_HEADS = 4
PACKED_SEQS = 64
_MARK = "@@racecpu-bench@@"
#: Calls predicted to take at most this long get one untimed call at full size first.
_FULL_WARMUP_S = 10.0
_GIB = 2 ** 30


# ---------------------------------------------------------------------------
# roofline model
# ---------------------------------------------------------------------------

def roofline_counts(mode, d, dv, planes, tables, itemsize=4):
    """Bytes and flops per token-head of RACE attention (module docstring).

    Parameters
    ----------
    mode : {"fwd", "fwdbwd"}
    d, dv : int
        Head and value dims.
    planes, tables : int
        ``P`` and ``L``.
    itemsize : int
        Bytes per element of the inputs (4 for float32).

    Returns
    -------
    bytes, flops : int
        The same for causal and non-causal attention.
    """
    if mode not in ("fwd", "fwdbwd"):
        raise ValueError(f"mode must be 'fwd' or 'fwdbwd', got {mode!r}")
    F, LP, s = tables * 2 ** planes, tables * planes, itemsize
    b = s * (2 * d + 2 * dv + 2 * F + 2 * LP) + 8
    f = 4 * LP * d + 4 * F * dv
    if mode == "fwdbwd":
        b += s * (2 * d + 3 * dv + 2 * F + 2 * LP) + 8
        f += 4 * LP * d + 8 * F * dv
    return b, f


def _cpu():
    """The CPU as LLVM names it and the kernels' vector width: tunings measured with AVX-512
    (64-byte vectors) and with AVX2 (32) differ (docs/performance.md, "exp_neg")."""
    from racecpu._kernels._jit import host_cpu_name
    from racecpu._kernels.tiles import VECTOR_BYTES
    return f"{host_cpu_name() or 'cpu unknown'}, {VECTOR_BYTES}-byte vectors"


def io_bytes(mode, shape, itemsize):
    """Bytes of (q, k, v, out) [+ (grad_out, dq, dk, dv)] for ``shape = (B, H, N, d, dv)``."""
    B, H, n, d, dv = shape
    per = 2 * d + 2 * dv if mode == "fwd" else 4 * d + 4 * dv
    return B * H * n * per * itemsize


# ---------------------------------------------------------------------------
# the vectorised statements (the peers that compute the same function)
# ---------------------------------------------------------------------------

def numpy_race_fwd(q, k, v, planes, beta, causal=False):
    """RACE attention as a vectorised NumPy statement: phi matrices and matmuls.

    ``q, k (G, N, d)``, ``v (G, N, dv)``.  Non-causal: ``B = Phi_k^T V``,
    ``out = Phi_q B / Phi_q A``.  Causal: the cumulative-sum formulation, which
    materialises the ``(G, N, F, dv)`` prefix states.  Soft buckets come from
    :func:`racecpu.reference.soft_buckets_dense` (explicit softmax over corners).
    Returns ``(out, residuals)``.
    """
    from racecpu.hashing import DEN_FLOOR
    from racecpu.reference import soft_buckets_dense

    L = planes.shape[0]
    G, n, _ = q.shape
    pq, tq = soft_buckets_dense(q, planes, beta)
    pk, tk = soft_buckets_dense(k, planes, beta)
    Pq, Pk = pq.reshape(G, n, -1), pk.reshape(G, k.shape[1], -1)
    if causal:
        A = np.cumsum(Pk, axis=1)
        B = Pk[..., :, None] * v[..., None, :]
        np.cumsum(B, axis=1, out=B)  # in place: one (G, N, F, dv) array, not two
        num = np.einsum("gnf,gnfc->gnc", Pq, B) / L
        den = np.einsum("gnf,gnf->gn", Pq, A) / L
    else:
        A = Pk.sum(1)
        B = np.swapaxes(Pk, 1, 2) @ v
        num = Pq @ B / L
        den = (Pq @ A[..., None])[..., 0] / L
    safe = np.where(den > DEN_FLOOR, den, np.inf)  # rows with no key mass: 0 out, 0 gradient
    out = num / safe[..., None]
    return out, (planes, beta, causal, v, pq, tq, pk, tk, A, B, safe, out)


def numpy_race_bwd(residuals, g):
    """Backward of :func:`numpy_race_fwd` (docs/design.md section 3); returns ``(dq, dk, dv)``.

    Causal: suffix sums over queries as reversed cumulative sums.
    """
    from racecpu.reference import soft_buckets_dense_bwd

    planes, beta, causal, v, pq, tq, pk, tk, A, B, safe, out = residuals
    L = planes.shape[0]
    G, n = pq.shape[:2]
    Pq, Pk = pq.reshape(G, n, -1), pk.reshape(G, v.shape[1], -1)
    dnum = g / safe[..., None]
    dden = -np.einsum("gnc,gnc->gn", g, out) / safe
    if causal:
        dPq = (np.einsum("gnfc,gnc->gnf", B, dnum) + A * dden[..., None]) / L
        dB = Pq[..., :, None] * (dnum[..., None, :] / L)
        rev = dB[:, ::-1]
        np.cumsum(rev, axis=1, out=rev)  # suffix sums over queries i >= j, in place
        dA = np.cumsum((Pq * dden[..., None])[:, ::-1], axis=1)[:, ::-1] / L
        dPk = np.einsum("gnfc,gnc->gnf", dB, v) + dA
        dv = np.einsum("gnfc,gnf->gnc", dB, Pk)
    else:
        dPq = (dnum @ np.swapaxes(B, 1, 2) + dden[..., None] * A[:, None, :]) / L
        dB = np.swapaxes(Pq, 1, 2) @ dnum / L
        dA = np.einsum("gnf,gn->gf", Pq, dden) / L
        dPk = v @ np.swapaxes(dB, 1, 2) + dA[:, None, :]
        dv = Pk @ dB
    dq, _ = soft_buckets_dense_bwd(dPq.reshape(pq.shape), pq, tq, planes, beta)
    dk, _ = soft_buckets_dense_bwd(dPk.reshape(pk.shape), pk, tk, planes, beta)
    return dq.astype(v.dtype), dk.astype(v.dtype), dv.astype(v.dtype)


def torch_race(q, k, v, planes, beta, causal=False):
    """RACE attention as a vectorised torch statement (differentiable by autograd).

    ``q, k (G, N, d)``, ``v (G, N, dv)``, ``planes (L, P, d)`` torch tensors.  The
    soft hash is the softmax over corners; causal is the cumsum formulation.
    """
    import torch

    from racecpu.hashing import DEN_FLOOR, corners

    L, P, _ = planes.shape
    C = torch.as_tensor(corners(P), dtype=q.dtype)

    def phi(x):
        t = torch.tanh(torch.einsum("gnd,lpd->gnlp", x, planes))
        return torch.softmax(beta * (t @ C.T), dim=-1).reshape(x.shape[0], x.shape[1], -1)

    Pq, Pk = phi(q), phi(k)
    if causal:
        A = Pk.cumsum(1)
        B = (Pk[..., :, None] * v[..., None, :]).cumsum(1)
        num = torch.einsum("gnf,gnfc->gnc", Pq, B) / L
        den = (Pq * A).sum(-1) / L
    else:
        num = Pq @ (Pk.transpose(1, 2) @ v) / L
        den = Pq @ Pk.sum(1)[..., None] / L
        den = den[..., 0]
    safe = torch.where(den > DEN_FLOOR, den, torch.full_like(den, math.inf))
    return num / safe[..., None]


# ---------------------------------------------------------------------------
# child processes: one measurement each
# ---------------------------------------------------------------------------

from .._memory import peak_rss as _peak_rss  # noqa: E402
from .._memory import proc_status as _proc_status  # noqa: E402
from .._memory import reset_peak_rss as _reset_peak  # noqa: E402
from .demo import available_memory  # noqa: E402


def _random_rows(rng, B, H, n, last, dt):
    """A ``(B, H, n, last)`` array of random normal rows in ``dt``; beyond 4096
    tokens the first 4096 repeat (cheap to make at 2**20; the kernels' cost does
    not depend on the values)."""
    blk = min(n, 4096)
    a = rng.standard_normal((B, H, blk, last)).astype(dt)
    if blk == n:
        return a
    out = np.empty((B, H, n, last), dt)
    for i in range(0, n, blk):
        m = min(blk, n - i)
        out[:, :, i:i + m] = a[:, :, :m]
    return out


def _inputs(spec, n):
    """q, k, v (B, H, n, d|dv) and grad_out (fwdbwd) in the spec's dtype (:func:`_random_rows`)."""
    B, H, d, dv = spec["batch"], spec["heads"], spec["d"], spec["dv"]
    dt = np.dtype(spec["dtype"])
    rng = np.random.default_rng(spec["seed"])

    def make(last):
        return _random_rows(rng, B, H, n, last, dt)

    arrs = [make(d), make(d), make(dv)]
    arrs.append(make(dv) if spec["mode"] == "fwdbwd" else None)
    return arrs


def _planes(spec):
    import racecpu
    return racecpu.hyperplanes(spec["d"], spec["planes"], spec["tables"], seed=spec["seed"] + 1,
                               dtype=spec["dtype"])


def _setup(spec, n):
    """Inputs and a zero-argument callable running one forward (+ backward) of ``spec['impl']``.

    The callable returns nothing, so everything it allocates is freed between calls.
    Also returns a ``sync`` callable (device implementations) or None.
    """
    impl, mode, causal, beta = spec["impl"], spec["mode"], spec["causal"], spec["beta"]
    q, k, v, g = _inputs(spec, n)
    B, H = q.shape[:2]

    if impl in ("race", "race-out"):
        import racecpu
        W = _planes(spec)

        check = spec.get("check_finite", True)
        # race-out: buffers written once here, so the calls find their pages mapped
        out_buf = np.ones_like(v) if impl == "race-out" else None
        grads = tuple(np.ones_like(x) for x in (q, k, v)) if impl == "race-out" and g is not None else None

        def call():
            if g is None:  # the forward alone keeps no residuals
                racecpu.race_attention(q, k, v, W, beta, causal=causal, check_finite=check, out=out_buf)
                return
            out, res = racecpu.race_attention_fwd(q, k, v, W, beta, causal=causal, check_finite=check,
                                                  out=out_buf)
            racecpu.race_attention_bwd(res, g, out=grads)
        return call, None

    if impl == "numpy-vec":
        W = _planes(spec)
        flat = [None if x is None else x.reshape(B * H, n, -1) for x in (q, k, v, g)]

        def call():
            out, res = numpy_race_fwd(*flat[:3], W, beta, causal)
            if g is not None:
                numpy_race_bwd(res, flat[3])
        return call, None

    if impl in ("torch-vec", "sdpa", "sdpa-cuda"):
        import torch
        torch.set_num_threads(spec["threads"])
        dev = "cuda" if impl == "sdpa-cuda" else "cpu"
        tq, tk, tv = (torch.from_numpy(x).to(dev) for x in (q, k, v))
        tg = None if g is None else torch.from_numpy(g).to(dev)
        del q, k, v, g
        sync = torch.cuda.synchronize if dev == "cuda" else None
        if tg is not None:
            for t in (tq, tk, tv):
                t.requires_grad_(True)
        if impl == "torch-vec":
            W = torch.from_numpy(_planes(spec))

            def f(a, b, c):
                return torch_race(a.reshape(B * H, n, -1), b.reshape(B * H, n, -1), c.reshape(B * H, n, -1),
                                  W, beta, causal)
        else:
            import torch.nn.functional as Fnn

            def f(a, b, c):
                return Fnn.scaled_dot_product_attention(a, b, c, is_causal=causal)

        def call():
            if tg is None:
                with torch.no_grad():
                    f(tq, tk, tv)
                return
            for t in (tq, tk, tv):
                t.grad = None
            f(tq, tk, tv).backward(tg.reshape(B * H, n, -1) if impl == "torch-vec" else tg)
            for t in (tq, tk, tv):
                t.grad = None
        return call, sync

    if impl == "race-cuda":
        import cupy as cp

        from racecpu import cuda as rcuda
        W = _planes(spec)  # host planes: tiny, copied by racecpu.cuda
        dq, dk, dvv = (cp.asarray(x) for x in (q, k, v))
        dg = None if g is None else cp.asarray(g)
        del q, k, v, g

        def call():
            out, res = rcuda.race_attention_fwd(dq, dk, dvv, W, beta, causal=causal)
            if dg is not None:
                rcuda.race_attention_bwd(res, dg)
        return call, cp.cuda.Device().synchronize

    raise ValueError(f"unknown implementation {impl!r}")


def _device_peak(impl):
    """Peak device bytes where the implementation keeps them (CuPy pool / torch.cuda), else None."""
    if impl == "race-cuda":
        import cupy as cp
        return int(cp.get_default_memory_pool().total_bytes())
    if impl == "sdpa-cuda":
        import torch
        return int(torch.cuda.max_memory_allocated())
    return None


def _measure(spec):
    """Child side of one measurement: warm up small, then time ``repeats`` calls at ``n``."""
    n = spec["n"]
    t0 = time.perf_counter()
    call, sync = _setup(spec, min(n, 128))  # compile / load cache / start thread pools
    call()
    if sync:
        sync()
    del call, sync
    warm_s = time.perf_counter() - t0
    reset = _reset_peak()
    base = _proc_status("VmRSS")
    call, sync = _setup(spec, n)
    if spec.get("full_warmup"):  # first call at a new size pays one-time costs (BLAS buffers, page cache)
        call()
        if sync:
            sync()
    times = []
    while len(times) < spec["repeats"]:
        t = time.perf_counter()
        call()
        if sync:
            sync()
        times.append(time.perf_counter() - t)
        if sum(times) > spec["budget_s"]:
            break
    layer = None
    if spec["impl"] in ("race", "race-out"):
        import numba
        layer = numba.threading_layer()
    return dict(times=times, peak_rss=_peak_rss(), base_rss=base, peak_reset=reset, warm_s=warm_s,
                device_peak=_device_peak(spec["impl"]), threading_layer=layer)


def _feature_setup(spec, n):
    """The pair of one features measurement at ``n`` tokens: two zero-argument callables
    ``(feature, baseline)`` on the same inputs, each returning nothing (module docstring, section 5)."""
    import racecpu

    feat, causal, beta, check = spec["feature"], spec["causal"], spec["beta"], spec["check_finite"]
    d, dv, dt = spec["d"], spec["dv"], np.dtype(spec["dtype"])
    rng = np.random.default_rng(spec["seed"])
    W = _planes(spec)
    if feat == "gqa":
        hq, hkv = GQA_HEADS
        q, g = _random_rows(rng, 1, hq, n, d, dt), _random_rows(rng, 1, hq, n, dv, dt)
        k, v = _random_rows(rng, 1, hkv, n, d, dt), _random_rows(rng, 1, hkv, n, dv, dt)
        kr, vr = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)  # made once, untimed

        def fwdbwd(kk, vv):
            _, res = racecpu.race_attention_fwd(q, kk, vv, W, beta, causal=causal, check_finite=check)
            racecpu.race_attention_bwd(res, g)
        return (lambda: fwdbwd(k, v)), (lambda: fwdbwd(kr, vr))
    H = FEATURE_HEADS
    q, k = _random_rows(rng, 1, H, n, d, dt), _random_rows(rng, 1, H, n, d, dt)
    v, g = _random_rows(rng, 1, H, n, dv, dt), _random_rows(rng, 1, H, n, dv, dt)
    if feat == "packed":
        cu = np.linspace(0, n, PACKED_SEQS + 1).round().astype(np.int32)

        def packed(cu_seqlens):
            _, res = racecpu.race_attention_fwd(q, k, v, W, beta, causal=causal, check_finite=check,
                                                cu_seqlens=cu_seqlens)
            racecpu.race_attention_bwd(res, g)
        return (lambda: packed(cu)), (lambda: packed(None))
    if feat == "dplanes":
        _, res = racecpu.race_attention_fwd(q, k, v, W, beta, causal=causal, check_finite=check)  # untimed, shared

        def bwd(dplanes):
            racecpu.race_attention_bwd(res, g, dplanes=dplanes)
        return (lambda: bwd(True)), (lambda: bwd(False))
    raise ValueError(f"unknown feature {feat!r}")


def _features(spec):
    """Child side of one features measurement: warm both members up small, make one untimed call
    of each at ``n``, then ``repeats`` rounds calling both, alternately first."""
    n = spec["n"]
    t0 = time.perf_counter()
    for call in _feature_setup(spec, min(n, 128)):  # compile / load cache / start thread pools
        call()
    warm_s = time.perf_counter() - t0
    reset = _reset_peak()
    base_rss = _proc_status("VmRSS")
    pair = _feature_setup(spec, n)
    for call in pair:  # the first call at full size pays one-time costs (page faults, pool)
        call()
    times = ([], [])  # feature, baseline
    for r in range(spec["repeats"]):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            t = time.perf_counter()
            pair[i]()
            times[i].append(time.perf_counter() - t)
        if sum(times[0]) + sum(times[1]) > 2 * spec["budget_s"]:
            break
    import numba
    return dict(times=times[0], base_times=times[1], peak_rss=_peak_rss(), base_rss=base_rss, peak_reset=reset,
                warm_s=warm_s, threading_layer=numba.threading_layer())


def best_time(f, reps):
    """Seconds of the fastest of ``reps`` calls of ``f()``, after one untimed call."""
    f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return min(ts)


def _machine(spec):
    """Child side of the machine-limits measurement (copy bandwidth, SGEMM)."""
    from concurrent.futures import ThreadPoolExecutor

    threads, reps = spec["threads"], spec["repeats"]

    def best(f):
        return best_time(f, reps)

    if spec["device"] == "cuda":
        import cupy as cp
        a = cp.ones(2 ** 28, cp.float32)
        b = cp.empty_like(a)
        sync = cp.cuda.Device().synchronize

        def copy():
            cp.copyto(b, a)
            sync()
        bw = 2 * a.nbytes / best(copy)
        m = 8192
        A = cp.random.standard_normal((m, m), dtype=cp.float32)

        def mm():
            A @ A
            sync()
        return dict(copy_1t=bw, copy_nt=bw, sgemm=2 * m ** 3 / best(mm))

    # 1 GiB (256 MiB with --quick): at 256 MiB two threads measured 25-38 GB/s
    # here, at 1 GiB 47-54 GB/s, the rate the kernels' multi-GiB arrays see.
    a = np.ones(2 ** spec.get("copy_log2", 28), np.float32)
    b = np.ones_like(a)  # touched: page faults are not bandwidth
    bw1 = 2 * a.nbytes / best(lambda: np.copyto(b, a))
    bwn = bw1
    if threads > 1:
        parts = [slice(i * a.size // threads, (i + 1) * a.size // threads) for i in range(threads)]
        with ThreadPoolExecutor(threads) as ex:
            bwn = 2 * a.nbytes / best(lambda: list(ex.map(lambda s: np.copyto(b[s], a[s]), parts)))
    del a, b
    m = 2048
    A = np.random.default_rng(0).standard_normal((m, m)).astype(np.float32)
    C = np.empty_like(A)
    sgemm = 2 * m ** 3 / best(lambda: np.matmul(A, A, out=C))
    return dict(copy_1t=bw1, copy_nt=bwn, sgemm=sgemm)


def _compile_child(t0):
    """Child side of the compile-cost measurement; ``t0`` taken before ``import racecpu``."""
    import racecpu
    t_import = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((1, 1, 256, 64)).astype(np.float32) for _ in range(4))
    W = racecpu.hyperplanes(64)
    out, res = racecpu.race_attention_fwd(q, k, v, W)
    t_first = time.perf_counter() - t0
    racecpu.race_attention_bwd(res, g)
    out, res = racecpu.race_attention_fwd(q, k, v, W, causal=True)
    racecpu.race_attention_bwd(res, g)
    racecpu.soft_buckets(q, W)
    return dict(import_s=t_import, first_s=t_first, all_s=time.perf_counter() - t0)


def _child_main():
    """Entry point of a measurement subprocess: JSON spec on stdin, JSON result on stdout."""
    spec = json.loads(sys.stdin.read())
    kind = spec.pop("kind")
    try:
        res = {"measure": _measure, "machine": _machine, "features": _features}[kind](spec)
        res["ok"] = True
    except MemoryError:
        res = dict(ok=False, error="MemoryError")
    except Exception as exc:  # reported by the parent as a failed measurement
        res = dict(ok=False, error=f"{type(exc).__name__}: {exc}")
    print(_MARK + json.dumps(res), flush=True)


def _spawn(code, payload, env, timeout):
    """Run ``python -c code`` with ``payload`` on stdin; returns (result dict, wall seconds)."""
    t = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-c", code], input=json.dumps(payload), env=env,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(ok=False, error=f"timed out after {timeout:.0f} s"), time.perf_counter() - t
    wall = time.perf_counter() - t
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):]), wall
    if p.returncode < 0:
        why = f"killed by signal {-p.returncode}" + (" (out of memory?)" if p.returncode == -9 else "")
    else:
        why = f"exit code {p.returncode}"
    tail = " | ".join(p.stderr.strip().splitlines()[-3:])
    return dict(ok=False, error=f"{why}: {tail}"[:300]), wall


def _env(threads, cache_dir=None):
    env = dict(os.environ)
    for var in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = str(cache_dir)
    return env


_CHILD = "from racecpu.apps.bench import _child_main; _child_main()"
_COMPILE_CHILD = ("import time; t0 = time.perf_counter()\n"
                  "from racecpu.apps.bench import _compile_child, _MARK; import json\n"
                  "print(_MARK + json.dumps(_compile_child(t0)), flush=True)")


# ---------------------------------------------------------------------------
# predictions (what to skip)
# ---------------------------------------------------------------------------

def predict_peak(impl, mode, causal, shape, F, LP, itemsize):
    """Static estimate of a measurement's peak RSS in bytes (before anything is measured)."""
    B, H, n, d, dv = shape
    tok = B * H * n
    io = io_bytes(mode, shape, itemsize)
    phi = tok * F * itemsize
    state = tok * F * dv * itemsize  # the (N, F, dv) prefix states of the cumsum statements
    base = 0.35 * _GIB if impl in TORCH_IMPLS else 0.15 * _GIB
    if impl.startswith("race"):
        extra = 2 * phi + tok * (2 * LP * itemsize + 8) + tok * max(d, dv)
    elif impl.startswith("sdpa"):
        extra = tok * (d + dv) * itemsize
    else:
        extra = (16 if impl == "torch-vec" else 12) * phi + 2 * tok * dv * itemsize
        if causal:
            extra += state * {("numpy-vec", "fwd"): 1.5, ("numpy-vec", "fwdbwd"): 2.5,
                              ("torch-vec", "fwd"): 2.2, ("torch-vec", "fwdbwd"): 4.5}[impl, mode]
    return base + io + extra


@dataclass
class _Seen:
    """Last successful measurement of one (impl, mode, causal): for extrapolation."""
    n: int
    median_s: float
    peak: int
    base: int


def sdpa_flops(mode, causal, shape):
    """Flops of softmax attention for ``shape = (B, H, N, d)`` (dv = d): the forward's two
    ``N x N x d`` products, ``4 N^2 d`` per head; the backward's five (one recomputes the
    scores) ``10 N^2 d``; half of it causal.  A lower bound on SDPA's time at the SGEMM rate."""
    B, H, n, d = shape
    f = 4 * B * H * n * n * d * (1 if mode == "fwd" else 3.5)
    return f / 2 if causal else f


def _extrapolate(seen, impl, n):
    """(predicted seconds per call, predicted peak bytes) at ``n`` from a smaller measurement."""
    r = n / seen.n
    t = seen.median_s * r ** (2 if impl.startswith("sdpa") else 1)
    mem = seen.base + max(seen.peak - seen.base, 0) * r
    return t, mem


# ---------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------

def add_arguments(parser):
    from ..cli import add_common_arguments, add_race_arguments, positive_float, positive_int

    g = add_race_arguments(parser, heads=4, head_dim=128, causal=False, seed=False)
    g.add_argument("--batch", type=positive_int, default=1, help="batch size B (default 1)")
    g.add_argument("--value-dim", type=positive_int, default=None, help="value dim dv (default: --head-dim)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (Numba kernels) or cuda (racecpu.cuda with CuPy; needs a GPU)")
    s = parser.add_argument_group("sizes and repeats")
    s.add_argument("--min-log2n", type=int, default=10, help="smallest N = 2**this (default 10)")
    s.add_argument("--max-log2n", type=int, default=None, help="largest N = 2**this (default 20; 14 with --quick)")
    s.add_argument("--large", action="store_true", help="go up to N = 2**22 (needs --heads 1 to fit 24 GiB)")
    s.add_argument("--features-log2n", type=int, default=None,
                   help="N = 2**this for the features section (default 16; 12 with --quick)")
    s.add_argument("--quick", action="store_true",
                   help="small run: N <= 2**14, 3 repeats, 3 GiB memory cap (for a busy machine)")
    s.add_argument("--repeats", type=positive_int, default=None, help="timed calls per measurement (default 5; 3 with --quick)")
    s.add_argument("--rounds", type=positive_int, default=1,
                   help="fresh processes per measurement, alternating implementations (default 1)")
    s.add_argument("--budget-seconds", type=positive_float, default=60.0,
                   help="stop repeating once a measurement's calls took this long (default 60)")
    s.add_argument("--max-call-seconds", type=positive_float, default=60.0,
                   help="skip a configuration predicted to take longer per call (default 60)")
    s.add_argument("--mem-cap-gib", type=positive_float, default=None,
                   help="skip a measurement predicted to peak above this (default 90%% of MemAvailable; 3 with --quick)")
    s.add_argument("--threads", type=positive_int, default=None, help="threads for every implementation (default: all cores)")
    o = parser.add_argument_group("what to run and where to write")
    o.add_argument("--no-torch", action="store_true", help="skip the torch peers even if torch is installed")
    o.add_argument("--impls", default=None,
                   help="comma-separated subset of race,race-out,numpy-vec,torch-vec,sdpa (cuda: race-cuda,sdpa-cuda); "
                        "e.g. --impls race to time the kernels alone")
    o.add_argument("--no-check-finite", action="store_true",
                   help="call RACE with check_finite=False (default: the library default, True)")
    o.add_argument("--no-cold", action="store_true",
                   help="skip the cold-compile measurement (~1 min); the warm-cache one uses the default cache")
    o.add_argument("--sections", default="scaling,threads,compile",
                   help="comma-separated sections to run besides the machine's, from " + ",".join(SECTIONS)
                        + " (default scaling,threads,compile; features and train only when named, e.g. "
                          "--sections features or --sections scaling,train)")
    o.add_argument("--train-shapes", default=None,
                   help="shapes of the train section, comma-separated BxHxNxd (dv = d), e.g. 8x8x1024x64,1x4x4096x128 "
                        "(default: the five of TRAIN_SHAPES, up to 1x4x1048576x128)")
    o.add_argument("--tag", default=None, help="file stem of the outputs (default 'bench' or 'bench-quick')")
    add_common_arguments(parser, out=True)


def _loadavg():
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def _settings(args):
    """Resolved settings (dict) from parsed flags; raises ValueError on bad values."""
    from racecpu.hashing import DEFAULT_BETA, MAX_PLANES

    cores = os.cpu_count() or 1
    st = dict(
        batch=args.batch, heads=args.heads, d=args.head_dim, dv=args.value_dim or args.head_dim,
        planes=args.num_planes, tables=args.num_tables, beta=DEFAULT_BETA if args.beta is None else args.beta, dtype=args.dtype,
        device=args.device, threads=args.threads or cores,
        min_log2n=args.min_log2n,
        features_log2n=(getattr(args, "features_log2n", None)
                        if getattr(args, "features_log2n", None) is not None else (12 if args.quick else 16)),
        max_log2n=args.max_log2n if args.max_log2n is not None else (14 if args.quick else 22 if args.large else 20),
        repeats=args.repeats or (3 if args.quick else 5), rounds=args.rounds,
        budget_s=args.budget_seconds, max_call_s=args.max_call_seconds,
        seed=0, quick=args.quick, no_cold=args.no_cold, check_finite=not args.no_check_finite,
        train_shapes=_train_shapes(getattr(args, "train_shapes", None)),
    )
    for name, flag in (("batch", "batch"), ("heads", "heads"), ("d", "head-dim"), ("dv", "value-dim"),
                       ("tables", "num-tables"), ("repeats", "repeats"), ("rounds", "rounds"), ("threads", "threads")):
        if st[name] < 1:
            raise ValueError(f"--{flag} must be >= 1, got {st[name]}")
    if not 1 <= st["planes"] <= MAX_PLANES:
        raise ValueError(f"--num-planes must be 1..{MAX_PLANES}, got {st['planes']}")
    if not 4 <= st["min_log2n"] <= st["max_log2n"] <= 26:
        raise ValueError(f"need 4 <= --min-log2n <= --max-log2n <= 26, got {st['min_log2n']}, {st['max_log2n']}")
    if not 6 <= st["features_log2n"] <= 26:
        raise ValueError(f"need 6 <= --features-log2n <= 26 (its {PACKED_SEQS} packed sequences), "
                         f"got {st['features_log2n']}")
    if not st["beta"] > 0:
        raise ValueError(f"--beta must be > 0, got {st['beta']}")
    if st["threads"] > cores:
        raise ValueError(f"--threads {st['threads']} exceeds the {cores} cores of this machine")
    avail = available_memory()
    if args.mem_cap_gib is not None:
        cap = args.mem_cap_gib * _GIB
    elif args.quick:
        cap = 3 * _GIB
    else:
        cap = 0.9 * avail if avail else 16 * _GIB
    st["mem_cap"] = cap
    st["mem_available"] = avail
    return st


def _train_shapes(text):
    """``--train-shapes`` (``BxHxNxd,...``) as a tuple of (B, H, N, d); None gives TRAIN_SHAPES."""
    if text is None:
        return TRAIN_SHAPES
    try:
        shapes = tuple(tuple(int(x) for x in s.lower().split("x")) for s in text.split(",") if s.strip())
    except ValueError:
        shapes = ()
    if not shapes or any(len(s) != 4 or min(s) < 1 for s in shapes):
        raise ValueError(f"--train-shapes {text!r}: want comma-separated BxHxNxd, e.g. 8x8x1024x64")
    return shapes


def _torch_ok(device):
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return device == "cpu" or bool(torch.cuda.is_available())


def _cuda_problem():
    """None if racecpu.cuda can run on a GPU here, else a one-line reason."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        return "NUMBA_ENABLE_CUDASIM is set (the CUDA simulator is not a GPU to benchmark)"
    try:
        import cupy as cp
        from racecpu import cuda as rcuda
    except Exception as exc:
        return f"cannot import racecpu.cuda and cupy ({type(exc).__name__}: {exc})"
    try:
        if not (rcuda.is_available() and cp.cuda.runtime.getDeviceCount() > 0):
            return "no usable GPU"
    except Exception as exc:
        return f"no usable GPU ({type(exc).__name__}: {exc})"
    return None


def run(args):
    """Run the suite; returns 0, or 2 when the requested device is unavailable."""
    from ..cli import output_dir, require

    try:
        st = _settings(args)
    except ValueError as exc:
        print(f"racecpu bench: {exc}", file=sys.stderr)
        return 2
    if st["device"] == "cuda":
        why = _cuda_problem()
        if why:
            print(f"racecpu bench --device cuda: {why}. Install the 'cuda' extra on a machine with an NVIDIA GPU, "
                  f"or run without --device cuda.", file=sys.stderr)
            return 2
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    if not sections or set(sections) - set(SECTIONS):
        print(f"racecpu bench: --sections {args.sections!r}: choose from {','.join(SECTIONS)}", file=sys.stderr)
        return 2
    require("matplotlib", "racecpu bench (its plots)", "bench")
    tag = args.tag or ("bench-quick" if args.quick else "bench")
    use_torch = not args.no_torch and _torch_ok(st["device"])
    impls = [i for i in IMPLS[st["device"]] if use_torch or i not in TORCH_IMPLS]
    if args.impls:
        wanted = [w.strip() for w in args.impls.split(",") if w.strip()]
        bad = [w for w in wanted if w not in IMPLS[st["device"]]]
        if bad or not wanted:
            print(f"racecpu bench: --impls {args.impls!r}: choose from {','.join(IMPLS[st['device']])}",
                  file=sys.stderr)
            return 2
        missing = [w for w in wanted if w not in impls]
        if missing:
            print(f"racecpu bench: {','.join(missing)} need torch (pip install 'racecpu[bench]'); skipping them",
                  file=sys.stderr)
        impls = [i for i in impls if i in wanted]
        if not impls:
            return 2
    out_dir = Path(output_dir(args, "bench"))  # made only once the arguments are good: no empty folder
    return _Suite(st, impls, out_dir, tag, args).run()


class _Suite:
    def __init__(self, st, impls, out_dir, tag, args):
        self.st, self.impls, self.out_dir, self.tag, self.args = st, impls, out_dir, tag, args
        self.notes = []
        self.rows = []
        self.machine = {}
        self.machine_runs = {}
        self.layer = None
        self.argv = " ".join([Path(sys.argv[0]).name] + sys.argv[1:]) if sys.argv else "?"
        self.ns = [2 ** e for e in range(st["min_log2n"], st["max_log2n"] + 1)]
        self.F = st["tables"] * 2 ** st["planes"]
        self.LP = st["tables"] * st["planes"]
        self.itemsize = np.dtype(st["dtype"]).itemsize
        wanted = [x.strip() for x in getattr(args, "sections", "scaling,threads,compile").split(",")]
        self.sections = ["machine"] + [x for x in SECTIONS if x in wanted]
        self.dropped = []  # sections asked for that this device does not run
        if st["device"] == "cuda":
            self.dropped = [x for x in self.sections if x not in ("machine", "scaling")]
            self.sections = [x for x in self.sections if x in ("machine", "scaling")]
        self.progress = getattr(args, "progress", False)

    # -- helpers ---------------------------------------------------------
    def _note(self, text):
        self.notes.append(text)
        self.bar.write(f"note: {text}")

    def _spec(self, **kw):
        st = self.st
        spec = dict(kind="measure", batch=st["batch"], heads=st["heads"], d=st["d"], dv=st["dv"],
                    planes=st["planes"], tables=st["tables"], beta=st["beta"], dtype=st["dtype"],
                    threads=st["threads"], repeats=st["repeats"], budget_s=st["budget_s"], seed=st["seed"],
                    device=st["device"], check_finite=st["check_finite"])
        spec.update(kw)
        return spec

    def _row(self, section, **kw):
        st = self.st
        row = dict(section=section, impl="", mode="", causal="", n="", batch=st["batch"], heads=st["heads"],
                   d=st["d"], dv=st["dv"], planes=st["planes"], tables=st["tables"], dtype=st["dtype"],
                   threads=st["threads"], status="ok", note="", calls="", median_s="", min_s="",
                   ns_per_token_head="", roof_ns="", bound="", roof_frac="", peak_rss_bytes="", io_bytes="",
                   mem_ratio="", device_peak_bytes="", value="", unit="")
        row.update(kw)
        self.rows.append(row)
        return row

    def _timeout(self, predicted_s):
        st = self.st
        per = max(predicted_s or 0.0, st["max_call_s"])
        return 120 + per * 2 + min(per * st["repeats"], st["budget_s"] + per)

    # -- sections --------------------------------------------------------
    def run(self):
        from tqdm import tqdm

        st = self.st
        n_scaling = len(self.ns) * len(CONFIGS) * len(self.impls) * st["rounds"] if "scaling" in self.sections else 0
        n_threads = self._thread_runs() if "threads" in self.sections else 0
        n_compile = (1 if st["no_cold"] else 2) if "compile" in self.sections else 0
        n_features = 2 * len(FEATURES) * st["rounds"] if "features" in self.sections else 0
        n_train = (len(st["train_shapes"]) * len(CONFIGS) * len(self._train_impls()) * st["rounds"]
                   if "train" in self.sections else 0)
        total = 2 + n_scaling + n_threads + n_compile + n_features + n_train
        t0 = time.perf_counter()
        self.started = datetime.now(timezone.utc)
        self.load = [_loadavg()]
        cap_txt = f"{st['mem_cap'] / _GIB:.1f} GiB"
        print(f"racecpu bench: {', '.join(self.impls)}; N = 2^{st['min_log2n']}..2^{st['max_log2n']}, "
              f"B={st['batch']} H={st['heads']} d={st['d']} dv={st['dv']} P={st['planes']} L={st['tables']} "
              f"{st['dtype']}, {st['threads']} threads, {st['repeats']} repeats; caps {cap_txt}, "
              f"{st['max_call_s']:.0f} s/call; sections {','.join(self.sections[1:]) or 'none'}"
              + (f" (features at N = 2^{st['features_log2n']})" if "features" in self.sections else "")
              + (" (train shapes " + ", ".join("x".join(map(str, s)) for s in st["train_shapes"]) + ")"
                 if "train" in self.sections else ""), flush=True)
        if self.load[0] > 0.5:
            print(f"warning: load average {self.load[0]:.1f} before starting: other work is running, "
                  "absolute timings will be noisy", flush=True)
        with tqdm(total=total, desc="bench", unit="run", file=sys.stderr, dynamic_ncols=True,
                  disable=not self.progress) as self.bar:
            for sec in self.dropped:
                self._note(f"{sec} section skipped: --device cuda runs the machine limits and scaling only"
                           + (" (the features are timed on the CPU kernels; cu_seqlens and dplanes=True are not "
                              "implemented on the GPU)" if sec == "features" else ""))
            self._machine_section("start")
            if "scaling" in self.sections:
                self._scaling_section()
            if "threads" in self.sections:
                self._threads_section()
            if "compile" in self.sections:
                self._compile_section()
            if "features" in self.sections:
                self._features_section()
            if "train" in self.sections:
                self._train_section()
            self._machine_section("end")
        self.load.append(_loadavg())
        self.elapsed = time.perf_counter() - t0
        return self._write()

    def _machine_section(self, when):
        """Copy bandwidth and SGEMM, at the start and at the end; the roof is the best of both."""
        st = self.st
        self.bar.set_description(f"machine limits ({when})")
        res, _ = _spawn(_CHILD, dict(kind="machine", threads=st["threads"], repeats=5, device=st["device"],
                                     copy_log2=26 if st["quick"] else 28),
                        _env(st["threads"]), timeout=600)
        self.bar.update()
        if not res.get("ok"):
            if when == "start":
                raise RuntimeError(f"machine-limits measurement failed: {res.get('error')}")
            self._note(f"machine limits at the end: failed ({res.get('error')})")
            return
        for key in ("copy_1t", "copy_nt", "sgemm"):
            self.machine_runs.setdefault(key, []).append(res[key])
        m = {k: max(v) for k, v in self.machine_runs.items()}
        self.machine = dict(m, bandwidth=max(m["copy_1t"], m["copy_nt"]))
        self._row("machine", impl=f"copy-1thread@{when}", value=f"{res['copy_1t'] / 1e9:.2f}", unit="GB/s")
        self._row("machine", impl=f"copy-{st['threads']}threads@{when}", value=f"{res['copy_nt'] / 1e9:.2f}",
                  unit="GB/s")
        self._row("machine", impl=f"sgemm@{when}", value=f"{res['sgemm'] / 1e9:.1f}", unit="GFLOP/s")
        if when == "end":
            for key, what, unit in (("copy_1t", "copy bandwidth", "GB/s"), ("sgemm", "SGEMM rate", "GFLOP/s")):
                a, b = self.machine_runs[key][0], self.machine_runs[key][-1]
                if abs(a - b) > 0.2 * max(a, b):
                    self._note(f"{what} moved from {a / 1e9:.1f} to {b / 1e9:.1f} {unit} during the run: "
                               "the machine was not quiet; trust ratios more than absolute numbers")

    def _roof(self, mode, d=None, dv=None):
        """(roof ns per token-head, bound) at the suite's d, dv or the given ones."""
        b, f = roofline_counts(mode, d or self.st["d"], dv or self.st["dv"], self.st["planes"], self.st["tables"],
                               self.itemsize)
        tb, tf = b / self.machine["bandwidth"], f / self.machine["sgemm"]
        return max(tb, tf) * 1e9, ("memory" if tb >= tf else "compute")

    def _scaling_section(self):
        st = self.st
        seen, dead = {}, {}
        order = list(self.impls)
        for n in self.ns:
            shape = (st["batch"], st["heads"], n, st["d"], st["dv"])
            results = {}
            for rnd in range(st["rounds"]):
                for ci, (mode, causal) in enumerate(CONFIGS):
                    k = (len(self.ns) * rnd + ci + n.bit_length()) % len(order)
                    for impl in order[k:] + order[:k]:  # rotate who goes first
                        key = (impl, mode, causal)
                        label = f"{impl} {mode}{' causal' if causal else ''} N=2^{n.bit_length() - 1}"
                        self.bar.set_description(label)
                        if key in dead:
                            results.setdefault(key, dict(skip=dead[key]))
                            self.bar.update()
                            continue
                        pred_t = None
                        if key in seen:  # measured at a smaller N: extrapolate that
                            pred_t, pred_mem = _extrapolate(seen[key], impl, n)
                        else:
                            pred_mem = predict_peak(impl, mode, causal, shape, self.F, self.LP, self.itemsize)
                        why = None
                        if pred_mem > st["mem_cap"]:
                            why = (f"skip(mem): predicted peak {pred_mem / _GIB:.1f} GiB > cap "
                                   f"{st['mem_cap'] / _GIB:.1f} GiB")
                        elif pred_t is not None and pred_t > st["max_call_s"]:
                            why = f"skip(time): predicted {pred_t:.0f} s per call > cap {st['max_call_s']:.0f} s"
                        if why:
                            dead[key] = why
                            results[key] = dict(skip=why)
                            self._note(f"{label}: {why} (and larger N)")
                            self.bar.update()
                            continue
                        spec = self._spec(impl=impl, mode=mode, causal=causal, n=n,
                                          full_warmup=pred_t is None or pred_t <= _FULL_WARMUP_S)
                        res, wall = _spawn(_CHILD, spec, _env(st["threads"]), self._timeout(pred_t))
                        self.bar.update()
                        if not res.get("ok"):
                            why = f"failed: {res.get('error')}"
                            dead[key] = f"skip: failed at N=2^{n.bit_length() - 1}"
                            results[key] = dict(skip=why)
                            self._note(f"{label}: {why}")
                            continue
                        acc = results.setdefault(key, dict(times=[], peak_rss=0, base_rss=None, device_peak=None))
                        if "skip" in acc:
                            continue
                        acc["times"] += res["times"]
                        acc["peak_rss"] = max(acc["peak_rss"], res["peak_rss"] or 0)
                        acc["base_rss"] = res["base_rss"] if acc["base_rss"] is None else acc["base_rss"]
                        acc["device_peak"] = res.get("device_peak")
                        self.layer = self.layer or res.get("threading_layer")
                        if not res.get("peak_reset"):
                            acc["peak_note"] = "peak includes warm-up (no clear_refs)"
            for (impl, mode, causal), acc in results.items():
                self._scaling_row(impl, mode, causal, n, shape, acc, seen)

    def _scaling_row(self, impl, mode, causal, n, shape, acc, seen):
        st = self.st
        tokheads = st["batch"] * st["heads"] * n
        io = io_bytes(mode, shape, self.itemsize)
        if "skip" in acc:
            self._row("scaling", impl=impl, mode=mode, causal=int(causal), n=n, status=acc["skip"].split(":")[0],
                      note=acc["skip"], io_bytes=io)
            return
        med = statistics.median(acc["times"])
        seen[(impl, mode, causal)] = _Seen(n, med, acc["peak_rss"], acc["base_rss"] or 0)
        row = self._row("scaling", impl=impl, mode=mode, causal=int(causal), n=n, calls=len(acc["times"]),
                        median_s=f"{med:.6g}", min_s=f"{min(acc['times']):.6g}",
                        ns_per_token_head=f"{med / tokheads * 1e9:.2f}", peak_rss_bytes=acc["peak_rss"],
                        io_bytes=io, note=acc.get("peak_note", ""),
                        # device runs: the device's peak, not the host's
                        mem_ratio=f"{(acc.get('device_peak') or acc['peak_rss']) / io:.3f}",
                        device_peak_bytes=acc.get("device_peak") or "")
        if not impl.startswith("sdpa"):  # the RACE roofline applies to every statement of RACE
            row["roof_frac"] = "pending"  # filled in by _write, once both machine measurements are in

    def _thread_runs(self):
        """Processes the thread section spawns: each THREAD_IMPLS at 1 and all threads, and the
        reference (one head per thread) when there is more than one, causal and not, per round."""
        st = self.st
        return (len(THREAD_IMPLS) * len({1, st["threads"]}) + (st["threads"] > 1)) * 2 * st["rounds"]

    def _threads_section(self):
        st = self.st
        fits = [n for n in self.ns if predict_peak("race", "fwdbwd", False, (1, 1, n, st["d"], st["dv"]), self.F,
                                                   self.LP, self.itemsize) <= st["mem_cap"]]
        counts = sorted({1, st["threads"]})
        if not fits:
            self._note(f"thread scaling skipped: even N=2^{st['min_log2n']} at one head is predicted above the "
                       f"{st['mem_cap'] / _GIB:.1f} GiB cap")
            self.bar.update(self._thread_runs())
            return
        n = fits[-1]
        shape = (1, 1, n, st["d"], st["dv"])
        T = counts[-1]
        # The reference: as many heads as threads, one per thread, no head split over threads (so no
        # chunk totals for the threads' carries); "race" only, where it fits.
        ref = T > 1 and predict_peak("race", "fwdbwd", True, (1, T, n, st["d"], st["dv"]), self.F, self.LP,
                                     self.itemsize) <= st["mem_cap"]
        if T > 1 and not ref:
            self._note(f"thread scaling: {T} heads at N=2^{n.bit_length() - 1} (one per thread) predicted above the "
                       f"{st['mem_cap'] / _GIB:.1f} GiB cap; not run")
            self.bar.update(2 * st["rounds"])
        runs = [(impl, th, 1) for impl in THREAD_IMPLS for th in counts] + ([("race", T, T)] if ref else [])
        got = {}
        for rnd in range(st["rounds"]):
            for causal in (False, True):
                for impl, th, heads in (runs if (rnd + causal) % 2 == 0 else runs[::-1]):
                    self.bar.set_description(f"threads={th} {impl} fwdbwd{' causal' if causal else ''} "
                                             f"N=2^{n.bit_length() - 1} heads={heads}")
                    spec = self._spec(impl=impl, mode="fwdbwd", causal=causal, n=n, batch=1, heads=heads,
                                      threads=th, full_warmup=True)
                    res, _ = _spawn(_CHILD, spec, _env(th), self._timeout(None))
                    self.bar.update()
                    acc = got.setdefault((causal, impl, th, heads), dict(times=[], peak=0, err=None))
                    if res.get("ok"):
                        acc["times"] += res["times"]
                        acc["peak"] = max(acc["peak"], res["peak_rss"] or 0)
                    else:
                        acc["err"] = res.get("error")
        io = io_bytes("fwdbwd", shape, self.itemsize)
        for causal in (False, True):
            for impl in THREAD_IMPLS:
                meds = {}
                row = dict(impl=impl, mode="fwdbwd", causal=int(causal), n=n, batch=1, heads=1)
                for th in counts:
                    acc = got.get((causal, impl, th, 1))
                    if not acc or not acc["times"]:
                        err = acc["err"] if acc else "not run"
                        self._row("threads", **row, threads=th, status="failed", note=str(err))
                        continue
                    meds[th] = statistics.median(acc["times"])
                    self._row("threads", **row, threads=th, calls=len(acc["times"]), median_s=f"{meds[th]:.6g}",
                              ns_per_token_head=f"{meds[th] / n * 1e9:.2f}", peak_rss_bytes=acc["peak"], io_bytes=io,
                              mem_ratio=f"{acc['peak'] / io:.3f}")
                if len(meds) == 2:
                    self._row("threads", **row, threads=counts[-1], value=f"{meds[1] / meds[counts[-1]]:.3f}",
                              unit=f"speedup {counts[-1]} vs 1 thread")
                acc = got.get((causal, impl, T, T))
                if impl != "race" or not acc:
                    continue
                row = dict(row, heads=T, threads=T, note="one head per thread")
                if not acc["times"]:
                    self._row("threads", **row, status="failed", note=str(acc["err"]))
                    continue
                med = statistics.median(acc["times"])  # one call: T heads
                self._row("threads", **row, calls=len(acc["times"]), median_s=f"{med:.6g}",
                          ns_per_token_head=f"{med / (T * n) * 1e9:.2f}", peak_rss_bytes=acc["peak"], io_bytes=T * io,
                          mem_ratio=f"{acc['peak'] / (T * io):.3f}")
                if len(meds) == 2:
                    self._row("threads", **row, value=f"{meds[1] * T / med:.3f}",
                              unit=f"speedup {T} heads on {T} threads vs 1 head on 1 thread")

    def _compile_section(self):
        st = self.st
        env = _env(st["threads"])
        tmp = None
        try:
            if not st["no_cold"]:
                tmp = tempfile.mkdtemp(prefix="racecpu-numba-cache-")
                env = _env(st["threads"], tmp)
                self.bar.set_description("cold compile (empty cache)")
                self._compile_run("cold", env)
            self.bar.set_description("warm cache first call")
            self._compile_run("warm", env)
        finally:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)

    def _compile_run(self, which, env):
        res, wall = _spawn(_COMPILE_CHILD, {}, env, timeout=900)
        self.bar.update()
        if "import_s" not in res:
            self._row("compile", impl=which, status="failed", note=res.get("error", ""))
            return
        cache = "empty NUMBA_CACHE_DIR" if which == "cold" else (
            "cache warmed by the cold run" if not self.st["no_cold"] else "default cache")
        for name, val in (("import", res["import_s"]), ("first-result", res["first_s"]),
                          ("all-kernels", res["all_s"]), ("process-wall", wall)):
            self._row("compile", impl=f"{which}:{name}", value=f"{val:.3f}", unit="s", note=cache)

    def _feature_peak(self, feat, causal, n):
        """Predicted peak RSS of one features measurement (both members' inputs live at once)."""
        st, s = self.st, self.itemsize
        if feat == "gqa":
            hq, hkv = GQA_HEADS
            shape = (1, hq, n, st["d"], st["dv"])
            extra = hkv * n * (st["d"] + st["dv"]) * s  # k, v at their own heads beside the repeated ones
        else:
            shape = (1, FEATURE_HEADS, n, st["d"], st["dv"])
            extra = io_bytes("fwd", shape, s) if feat == "packed" else 0  # room for a packed copy
        return predict_peak("race", "fwdbwd", causal, shape, self.F, self.LP, s) + extra

    def _features_section(self):
        """Each feature against its baseline: one process per (feature, causal) and round, timing both
        members alternately on the same inputs; rows of both, the feature's with the ratio."""
        st = self.st
        n = 2 ** st["features_log2n"]
        got = {}
        for rnd in range(st["rounds"]):
            for feat, mode, _, _ in FEATURES:
                for causal in ((False, True) if rnd % 2 == 0 else (True, False)):
                    label = f"features: {feat} {mode}{' causal' if causal else ''} N=2^{st['features_log2n']}"
                    self.bar.set_description(label)
                    acc = got.setdefault((feat, causal), dict(times=[], base=[], peak=0, err=None, skip=None))
                    pred = self._feature_peak(feat, causal, n)
                    if pred > st["mem_cap"]:
                        acc["skip"] = (f"skip(mem): predicted peak {pred / _GIB:.1f} GiB > cap "
                                       f"{st['mem_cap'] / _GIB:.1f} GiB")
                        if rnd == 0:
                            self._note(f"{label}: {acc['skip']}")
                        self.bar.update()
                        continue
                    spec = self._spec(kind="features", feature=feat, causal=causal, n=n, batch=1,
                                      heads=GQA_HEADS[0] if feat == "gqa" else FEATURE_HEADS)
                    per = st["max_call_s"]  # 4 untimed calls, then repeats of both up to the budget each
                    res, _ = _spawn(_CHILD, spec, _env(st["threads"]), 120 + 4 * per + 2 * (st["budget_s"] + per))
                    self.bar.update()
                    if not res.get("ok"):
                        acc["err"] = res.get("error")
                        self._note(f"{label}: failed: {acc['err']}")
                        continue
                    acc["times"] += res["times"]
                    acc["base"] += res["base_times"]
                    acc["peak"] = max(acc["peak"], res["peak_rss"] or 0)
                    self.layer = self.layer or res.get("threading_layer")
        missed, met = [], 0
        for feat, mode, target, what in FEATURES:
            heads = GQA_HEADS[0] if feat == "gqa" else FEATURE_HEADS
            base_what = {"gqa": f"k, v repeated to {heads} heads", "packed": "one sequence, no cu_seqlens",
                         "dplanes": "race_attention_bwd without dplanes"}[feat]
            for causal in (False, True):
                acc = got[(feat, causal)]
                row = dict(mode=mode, causal=int(causal), n=n, batch=1, heads=heads)
                if not acc["times"]:
                    status, why = ("skip(mem)", acc["skip"]) if acc["skip"] else ("failed", str(acc["err"]))
                    self._row("features", impl=feat, **row, status=status, note=why)
                    self._row("features", impl=f"{feat}-baseline", **row, status=status, note=why)
                    missed.append(f"{feat} {'causal' if causal else 'non-causal'} not measured ({status})")
                    continue
                tokheads = heads * n
                meds = [statistics.median(acc[k]) for k in ("times", "base")]
                ratio = meds[0] / meds[1]
                pair_ratios = [a / b for a, b in zip(acc["times"], acc["base"])]  # one per round of calls
                ok = ratio <= target
                mode_txt = f"{feat} {'causal' if causal else 'non-causal'}"
                if ok:
                    met += 1
                else:
                    missed.append(f"{mode_txt} {ratio:.4f} > {target}")
                for impl, times, med in ((feat, acc["times"], meds[0]), (f"{feat}-baseline", acc["base"], meds[1])):
                    if impl == feat:
                        extra = dict(value=f"{ratio:.4f}", unit=f"time / {feat}-baseline time, target <= {target}",
                                     note=f"target {'met' if ok else 'missed'} ({ratio:.4f} "
                                          f"{'<=' if ok else '>'} {target}); per-call ratios "
                                          f"{min(pair_ratios):.3f}..{max(pair_ratios):.3f}; {what}")
                    else:
                        extra = dict(note=f"baseline of {feat}: {base_what}")
                    self._row("features", impl=impl, **row, calls=len(times), median_s=f"{med:.6g}",
                              min_s=f"{min(times):.6g}", ns_per_token_head=f"{med / tokheads * 1e9:.2f}",
                              peak_rss_bytes=acc["peak"] or "", **extra)
        total = 2 * len(FEATURES)
        self._note(f"features at N=2^{st['features_log2n']}: targets met {met} of {total}"
                   + (f"; missed: {', '.join(missed)}" if missed else ""))

    def _train_impls(self):
        return [i for i in ("race", "sdpa") if i in self.impls]

    def _train_section(self):
        """RACE and SDPA at each of the train shapes, forward and forward+backward, causal and not
        (module docstring, section 6): one process per measurement, as in scaling; rows ``train``."""
        st = self.st
        impls = self._train_impls()
        if "sdpa" not in impls:
            self._note("train: sdpa not run (torch not installed, --no-torch or --impls): its columns read '-'")
        scale = {}  # (impl, mode, causal) -> measured / predicted seconds of the last shape measured
        for B, H, n, d in st["train_shapes"]:
            shape = (B, H, n, d, d)
            tokheads = B * H * n
            got = {}
            for rnd in range(st["rounds"]):
                for ci, (mode, causal) in enumerate(CONFIGS):
                    for impl in (impls if (rnd + ci) % 2 == 0 else impls[::-1]):  # alternate who goes first
                        key = (impl, mode, causal)
                        label = f"train {impl} {mode}{' causal' if causal else ''} B={B} H={H} N={n} d={d}"
                        self.bar.set_description(label)
                        acc = got.setdefault(key, dict(times=[], peak=0, skip=None))
                        if acc["skip"]:
                            self.bar.update()
                            continue
                        # lower bounds (the roof; SDPA's flops at the SGEMM rate), times what the last shape
                        # measured over its own bound: skips what the caps rule out before spending it
                        model = (sdpa_flops(mode, causal, (B, H, n, d)) / self.machine["sgemm"] if impl == "sdpa"
                                 else self._roof(mode, d, d)[0] * tokheads * 1e-9)
                        pred_t = model * scale.get(key, 1.0)
                        pred_mem = predict_peak(impl, mode, causal, shape, self.F, self.LP, self.itemsize)
                        if pred_mem > st["mem_cap"]:
                            acc["skip"] = (f"skip(mem): predicted peak {pred_mem / _GIB:.1f} GiB > cap "
                                           f"{st['mem_cap'] / _GIB:.1f} GiB")
                        elif pred_t > st["max_call_s"]:
                            acc["skip"] = (f"skip(time): predicted {pred_t:.0f} s per call > cap "
                                           f"{st['max_call_s']:.0f} s")
                        else:
                            spec = self._spec(impl=impl, mode=mode, causal=causal, n=n, batch=B, heads=H, d=d,
                                              dv=d, full_warmup=pred_t <= _FULL_WARMUP_S)
                            res, _ = _spawn(_CHILD, spec, _env(st["threads"]), self._timeout(pred_t))
                            if res.get("ok"):
                                acc["times"] += res["times"]
                                acc["peak"] = max(acc["peak"], res["peak_rss"] or 0)
                                scale[key] = statistics.median(acc["times"]) / model
                                self.layer = self.layer or res.get("threading_layer")
                            else:
                                acc["skip"] = f"failed: {res.get('error')}"
                        self.bar.update()
                        if acc["skip"] and not acc["times"]:
                            self._note(f"{label}: {acc['skip']}")
            meds = {key: statistics.median(acc["times"]) for key, acc in got.items() if acc["times"]}
            for (impl, mode, causal), acc in got.items():
                race = meds.get(("race", mode, causal))
                if impl == "sdpa" and acc["times"] and race:
                    acc["ratio"] = dict(value=f"{meds[impl, mode, causal] / race:.3f}", unit="time / race time")
                row = dict(impl=impl, mode=mode, causal=int(causal), n=n, batch=B, heads=H, d=d, dv=d,
                           io_bytes=io_bytes(mode, shape, self.itemsize))
                if not acc["times"]:
                    self._row("train", **row, status=acc["skip"].split(":")[0], note=acc["skip"])
                    continue
                med = statistics.median(acc["times"])
                self._row("train", **row, calls=len(acc["times"]), median_s=f"{med:.6g}",
                          min_s=f"{min(acc['times']):.6g}", ns_per_token_head=f"{med / tokheads * 1e9:.2f}",
                          peak_rss_bytes=acc["peak"], mem_ratio=f"{acc['peak'] / row['io_bytes']:.3f}",
                          roof_frac="pending" if impl == "race" else "", **acc.get("ratio", {}))

    def _train_summary(self):
        """The train section as one record per (shape, mode, causal), ``--json``'s ``train``: ns per
        token-head of RACE and SDPA (None where not measured), the roof, RACE / roof, SDPA / RACE."""
        by = {(r["impl"], r["batch"], r["heads"], r["n"], r["d"], r["mode"], r["causal"]): r
              for r in self.rows if r["section"] == "train"}
        out = []
        for B, H, n, d in self.st["train_shapes"]:
            for mode, causal in CONFIGS:
                r, s = (by.get((impl, B, H, n, d, mode, int(causal))) for impl in ("race", "sdpa"))
                race, sdpa = (float(x["ns_per_token_head"]) if x and x["status"] == "ok" else None for x in (r, s))
                roof, bound = self._roof(mode, d, d)
                out.append(dict(batch=B, heads=H, n=n, d=d, mode=mode, causal=causal, race_ns=race, roof_ns=roof,
                                bound=bound, roof_multiple=None if race is None else race / roof, sdpa_ns=sdpa,
                                sdpa_over_race=None if race is None or sdpa is None else sdpa / race,
                                race_status=r["note"] or r["status"] if r else "not run",
                                sdpa_status=s["note"] or s["status"] if s else "not run"))
        return out

    def _train_table(self):
        head = ["B", "H", "N", "d", "mode", "causal", "race ns/tok-head", "roof ns", "x roof",
                "sdpa ns/tok-head", "sdpa/race"]

        def num(x, fmt):
            return "-" if x is None else format(x, fmt)

        table = [[t["batch"], t["heads"], t["n"], t["d"], t["mode"], "yes" if t["causal"] else "no",
                  num(t["race_ns"], ".1f") if t["race_ns"] is not None else t["race_status"].split(":")[0],
                  f"{t['roof_ns']:.1f}", num(t["roof_multiple"], ".2f"), num(t["sdpa_ns"], ".1f"),
                  num(t["sdpa_over_race"], ".1f")] for t in self.train]
        widths = [max(len(h), *(len(str(t[i])) for t in table)) if table else len(h) for i, h in enumerate(head)]
        fmt = "  ".join(f"{{:>{w}}}" for w in widths)
        m = self.machine
        out = [f"train shapes (dv = d, P={self.st['planes']} L={self.st['tables']} {self.st['dtype']}): ns per "
               f"token-head, median of the calls; roof at copy {m['bandwidth'] / 1e9:.1f} GB/s and SGEMM "
               f"{m['sgemm'] / 1e9:.1f} GFLOP/s; x roof = race / roof; sdpa/race = SDPA time / RACE time; "
               "'-' = not measured (see notes)",
               fmt.format(*head), fmt.format(*("-" * w for w in widths))]
        out += [fmt.format(*(str(x) for x in t)) for t in table]
        return "\n".join(out)

    # -- outputs ---------------------------------------------------------
    def _write(self):
        for row in self.rows:
            if row["roof_frac"] == "pending":
                roof, bound = self._roof(row["mode"], row["d"], row["dv"])
                ns = float(row["ns_per_token_head"])
                row.update(roof_ns=f"{roof:.2f}", bound=bound, roof_frac=f"{roof / ns:.3f}")
                if row["section"] == "train":
                    row.update(value=f"{ns / roof:.3f}", unit="x roof (measured / roof)")
        self.train = self._train_summary() if "train" in self.sections else None
        csv_path = self.out_dir / f"{self.tag}.csv"
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(self.rows[0]))
            w.writeheader()
            w.writerows(self.rows)
        text = self._report()
        txt_path = self.out_dir / f"{self.tag}.txt"
        txt_path.write_text(text)
        print(text)
        png_path = self.out_dir / f"{self.tag}.png"
        self._plot(png_path)
        print(f"wrote {csv_path}, {txt_path}, {png_path}")
        self.args.result = dict(out=str(self.out_dir), csv=str(csv_path), txt=str(txt_path), png=str(png_path),
                                rows=self.rows, notes=self.notes, settings={k: v for k, v in self.st.items()})
        if self.train is not None:
            self.args.result["train"] = self.train
        return 0

    def _versions(self):
        import numba
        out = [f"python {platform.python_version()}", f"numpy {np.__version__}", f"numba {numba.__version__}"]
        if any(i in TORCH_IMPLS for i in self.impls):
            import torch
            out.append(f"torch {torch.__version__}")
        return ", ".join(out)

    def _report(self):
        st, m = self.st, self.machine
        lines = [
            f"command: {self.argv}",
            f"{self.started:%Y-%m-%d %H:%M UTC}, {platform.node()}, {os.cpu_count()} cores ({_cpu()}), "
            f"{self._versions()}; "
            f"took {self.elapsed / 60:.1f} min",
            f"setting: B={st['batch']} H={st['heads']} d={st['d']} dv={st['dv']} P={st['planes']} "
            f"L={st['tables']} beta={st['beta']} {st['dtype']}, check_finite={st['check_finite']}, "
            f"{st['threads']} threads, median of "
            f"<= {st['repeats']} calls x {st['rounds']} round(s); caps: {st['mem_cap'] / _GIB:.1f} GiB peak, "
            f"{st['max_call_s']:.0f} s per call",
            f"machine (best of start and end): copy {m['copy_1t'] / 1e9:.1f} GB/s (1 thread), "
            f"{m['copy_nt'] / 1e9:.1f} GB/s ({st['threads']} threads); SGEMM {m['sgemm'] / 1e9:.1f} GFLOP/s; "
            f"load average {self.load[0]:.1f} before, {self.load[-1]:.1f} after",
            f"numba threading layer {self.layer or '?'}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}",
        ]
        for mode in ("fwd", "fwdbwd"):
            b, f = roofline_counts(mode, st["d"], st["dv"], st["planes"], st["tables"], self.itemsize)
            roof, bound = self._roof(mode)
            lines.append(f"roofline {mode}: {b} B and {f} flop per token-head -> {b / m['bandwidth'] * 1e9:.1f} ns "
                         f"(memory) vs {f / m['sgemm'] * 1e9:.1f} ns (compute): roof {roof:.1f} ns, {bound}-bound")
        if any(r["section"] == "scaling" for r in self.rows):
            lines += ["", self._scaling_table()]
        thr = [r for r in self.rows if r["section"] == "threads"]
        if thr:
            lines += ["", "thread scaling (fwdbwd, B=1 H=1; race-out: into out= buffers allocated once; "
                          "H = threads: one head per thread, none split over threads):"]
            split = {(r["impl"], r["causal"], r["threads"]): float(r["ns_per_token_head"])
                     for r in thr if r["heads"] == 1 and r["status"] == "ok" and not r["value"]}
            for r in thr:
                c = f"{r['impl']} {'causal' if r['causal'] else 'non-causal'}"
                if r["heads"] != 1:
                    c += f" H={r['heads']}"
                if r["value"]:
                    lines.append(f"  N={r['n']} {c}: {r['unit']} = {r['value']}")
                elif r["status"] == "ok":
                    extra = ""
                    one = split.get((r["impl"], r["causal"], r["threads"]))
                    if r["heads"] != 1 and one is not None:
                        extra = f"; one head split over them costs {one - float(r['ns_per_token_head']):+.2f}"
                    lines.append(f"  N={r['n']} {c} {r['threads']} thread(s): {r['ns_per_token_head']} ns/token-head, "
                                 f"mem ratio {r['mem_ratio']}{extra}")
                else:
                    lines.append(f"  N={r['n']} {c} {r['threads']} thread(s): {r['note']}")
        comp = [r for r in self.rows if r["section"] == "compile"]
        if comp:
            lines += ["", "compile / first call (seconds from before `import racecpu`):"]
            for r in comp:
                lines.append(f"  {r['impl']:<22} {r['value'] or r['status']:>8} {r['unit']}  ({r['note']})")
        if any(r["section"] == "features" for r in self.rows):
            lines += ["", self._features_table()]
        if self.train is not None:
            lines += ["", self._train_table()]
        if self.notes:
            lines += ["", "notes:"] + [f"  {t}" for t in self.notes]
        return "\n".join(lines) + "\n"

    def _scaling_table(self):
        rows = [r for r in self.rows if r["section"] == "scaling"]
        by = {(r["impl"], r["mode"], r["causal"], r["n"]): r for r in rows}
        race = self.impls[0]
        peers = self.impls[1:]
        head = ["mode", "causal", "N", f"{race} ns/tok-head", "roof ns", "roof frac", "mem ratio"]
        head += [f"x {p}" for p in peers] + [f"{p} mem" for p in peers]
        table = []
        for mode, causal in (("fwd", False), ("fwd", True), ("fwdbwd", False), ("fwdbwd", True)):
            for n in self.ns:
                r = by.get((race, mode, int(causal), n))
                if r is None:
                    continue
                ok = r["status"] == "ok"
                line = [mode, "yes" if causal else "no", f"2^{n.bit_length() - 1}",
                        r["ns_per_token_head"] if ok else r["status"], r["roof_ns"], r["roof_frac"],
                        r["mem_ratio"] if ok else ""]
                ratios, mems = [], []
                for p in peers:
                    pr = by.get((p, mode, int(causal), n))
                    if pr is None:
                        ratios.append("")
                        mems.append("")
                    elif pr["status"] != "ok":
                        ratios.append(pr["status"])
                        mems.append("")
                    else:
                        ratios.append(f"{float(pr['median_s']) / float(r['median_s']):.1f}" if ok else "")
                        mems.append(pr["mem_ratio"])
                table.append(line + ratios + mems)
        widths = [max(len(h), *(len(str(t[i])) for t in table)) if table else len(h) for i, h in enumerate(head)]
        fmt = "  ".join(f"{{:>{w}}}" for w in widths)
        out = ["scaling: ns per token-head of RACE, its roofline fraction, peak RSS / io bytes; "
               "'x peer' = peer time / RACE time (same run)",
               fmt.format(*head), fmt.format(*("-" * w for w in widths))]
        out += [fmt.format(*t) for t in table]
        return "\n".join(out)

    def _features_table(self):
        rows = [r for r in self.rows if r["section"] == "features"]
        by = {(r["impl"], r["causal"]): r for r in rows}
        head = ["feature", "timed", "causal", "N", "heads", "feature s", "baseline s", "feature ns/tok-head",
                "baseline ns/tok-head", "ratio", "target", "met"]
        table = []
        for feat, mode, target, _ in FEATURES:
            for causal in (0, 1):
                r, b = by.get((feat, causal)), by.get((f"{feat}-baseline", causal))
                if r is None:
                    continue
                line = [feat, mode, "yes" if causal else "no", f"2^{int(r['n']).bit_length() - 1}", r["heads"]]
                if r["status"] != "ok" or b is None:
                    table.append(line + [r["status"], "", "", "", "", f"<= {target}", "not measured"])
                    continue
                met = float(r["value"]) <= target
                table.append(line + [r["median_s"], b["median_s"], r["ns_per_token_head"], b["ns_per_token_head"],
                                     r["value"], f"<= {target}", "yes" if met else "NO"])
        widths = [max(len(h), *(len(str(t[i])) for t in table)) if table else len(h) for i, h in enumerate(head)]
        fmt = "  ".join(f"{{:>{w}}}" for w in widths)
        out = ["features: each against its baseline in one process, calls alternating, median of the calls; "
               "ns per query token-head; ratio = feature time / baseline time",
               fmt.format(*head), fmt.format(*("-" * w for w in widths))]
        out += [fmt.format(*(str(x) for x in t)) for t in table]
        out += [f"  {feat}: {what}" for feat, _, _, what in FEATURES]
        return "\n".join(out)

    def _plot_threads(self, ax_speed, ax_ns):
        """Thread scaling: speedup over one thread (target line) and ns per token-head, as bars per setup."""
        thr = [r for r in self.rows if r["section"] == "threads" and r["status"] == "ok"]
        if not thr:
            for ax in (ax_speed, ax_ns):
                ax.axis("off")
            ax_speed.text(0.5, 0.5, "thread scaling not run", ha="center", va="center", transform=ax_speed.transAxes)
            return
        T = max(int(r["threads"]) for r in thr)
        speedup = {(r["impl"], r["heads"], r["causal"]): float(r["value"]) for r in thr if r["value"]}
        per_head = {(r["impl"], r["heads"], r["causal"], int(r["threads"])): float(r["ns_per_token_head"])
                    for r in thr if not r["value"]}
        setups = [(impl, 1, f"{impl}, 1 head", (1, T)) for impl in THREAD_IMPLS]
        setups.append(("race", T, f"race, {T} heads (one per thread)", (T,)))
        modes = [(0, "non-causal"), (1, "causal")]
        width = 0.8 / len(setups)
        for k, (impl, heads, label, counts) in enumerate(setups):
            x = np.arange(len(modes)) + (k - (len(setups) - 1) / 2) * width
            speed = [speedup.get((impl, heads, c), np.nan) for c, _ in modes]
            ax_speed.bar(x, speed, width, color=f"C{k}", label=label)
            for xi, v in zip(x, speed):
                if np.isfinite(v):
                    ax_speed.text(xi, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
            sub = width / len(counts)  # one bar per thread count within the setup's slot
            for i, th in enumerate(counts):
                ns = [per_head.get((impl, heads, c, th), np.nan) for c, _ in modes]
                ax_ns.bar(x + (i - (len(counts) - 1) / 2) * sub, ns, sub, color=f"C{k}", hatch="//" if th > 1 else "",
                          label=f"{label}, {th} thread{'s' if th > 1 else ''}")
        ax_speed.axhline(1.8, color="k", ls=":", lw=1, label="1.8x target")
        ax_speed.axhline(T, color="gray", ls="-", lw=0.5)
        ax_speed.set_ylabel(f"speedup, {T} threads vs 1 thread with 1 head")
        ax_speed.set_title(f"thread scaling, forward+backward (N=2^{int(thr[0]['n']).bit_length() - 1})")
        ax_ns.set_ylabel("ns per token-head")
        ax_ns.set_title("thread scaling: time per token-head")
        ax_speed.set_ylim(0, T * 1.3)  # room for the legend above the bars
        ax_ns.set_ylim(0, ax_ns.get_ylim()[1] * 1.5)
        for ax, ncol in ((ax_speed, 2), (ax_ns, 1)):
            ax.set_xticks(np.arange(len(modes)), [m for _, m in modes])
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(fontsize=7, loc="upper left", ncol=ncol)

    def _plot(self, path):
        # A Figure on an Agg canvas: pyplot's backend and figures are left as the caller has them.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        rows = [r for r in self.rows if r["section"] == "scaling" and r["status"] == "ok"]
        fig = Figure(figsize=(21, 9), constrained_layout=True)
        FigureCanvasAgg(fig)
        axes = fig.subplots(2, 4)
        colors = dict(zip(IMPLS["cpu"] + IMPLS["cuda"], ("C0", "C4", "C1", "C2", "C3", "C0", "C3")))
        st = self.st
        tok = st["batch"] * st["heads"]
        for i, mode in enumerate(("fwd", "fwdbwd")):
            for j, causal in enumerate((0, 1)):
                ax = axes[i, j]
                for impl in self.impls:
                    pts = sorted((r["n"], float(r["median_s"])) for r in rows
                                 if r["impl"] == impl and r["mode"] == mode and r["causal"] == causal)
                    if pts:
                        ax.plot(*zip(*pts), "o-", color=colors[impl], label=impl)
                roof, _ = self._roof(mode)
                ns = np.array(self.ns, dtype=float)
                ax.plot(ns, ns * tok * roof * 1e-9, "k--", lw=1, label="RACE roofline")
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xlabel("N (tokens)")
                ax.set_ylabel("seconds per call")
                ax.set_title(f"{'forward' if mode == 'fwd' else 'forward+backward'}, "
                             f"{'causal' if causal else 'non-causal'}")
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize=8)
            ax = axes[i, 2]
            for impl in self.impls:
                for causal, style in ((0, "o-"), (1, "s--")):
                    pts = sorted((r["n"], float(r["mem_ratio"])) for r in rows
                                 if r["impl"] == impl and r["mode"] == mode and r["causal"] == causal)
                    if pts:
                        ax.plot(*zip(*pts), style, color=colors[impl],
                                label=f"{impl}{' causal' if causal else ''}")
            ax.axhline(1.25, color="k", ls=":", lw=1, label="1.25x target")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("N (tokens)")
            ax.set_ylabel("peak RSS / bytes of inputs, outputs, grads")
            ax.set_title(f"memory, {'forward' if mode == 'fwd' else 'forward+backward'}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        self._plot_threads(axes[0, 3], axes[1, 3])
        fig.suptitle(f"racecpu bench: B={st['batch']} H={st['heads']} d={st['d']} dv={st['dv']} P={st['planes']} "
                     f"L={st['tables']} {st['dtype']}, {st['threads']} threads "
                     f"(copy {self.machine['bandwidth'] / 1e9:.0f} GB/s, SGEMM {self.machine['sgemm'] / 1e9:.0f} GFLOP/s)")
        fig.savefig(path, dpi=110)

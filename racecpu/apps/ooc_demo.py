"""The out-of-core demo (``racecpu demo --out-of-core DIR``) and its seeded inputs.

:func:`demo` runs :func:`racecpu.outofcore.race_attention_fwd_ooc` and
``_bwd_ooc`` over millions of tokens with inputs that are never stored:
:class:`SeededArray` generates them block by block from a seed, so the only
disk used is the results' and the checkpoint's.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np

from .. import _blocks as blocks
from .._memory import peak_rss as _peak_rss
from .._memory import reset_peak_rss as _reset_peak_rss
from ..attention import race_attention_bwd, race_attention_fwd
from ..hashing import DEFAULT_BETA, hyperplanes
from ..outofcore import BLOCK, noncausal_rows, race_attention_bwd_ooc, race_attention_fwd_ooc

__all__ = ["SeededArray", "demo"]


# ---------------------------------------------------------------------------
# inputs generated on the fly
# ---------------------------------------------------------------------------

class SeededArray:
    """A read-only array of pseudo-random N(0, scale^2) numbers, generated on demand.

    Fresh normals cost ~30 ns each here, more than the attention itself at
    d = 128, so rows are windows of a fixed pool of ``pool`` standard normals
    (from ``default_rng(seed)``): tile ``t`` (``tile`` tokens) of group ``g`` is
    the window at an offset drawn from ``default_rng([seed, g, t])``.  Any
    slice along the token axis gives the same numbers however the array is
    sliced.  A row source of :mod:`racecpu._blocks` (it has ``rows`` and
    ``checkpoint_key``), so :mod:`racecpu.outofcore` reads it block by block;
    :func:`demo` streams inputs that would not fit on disk this way.

    Parameters
    ----------
    shape : tuple, (..., N, d)
    dtype : float dtype, default float32
    seed : int, default 0
    scale : float, default 1.0
    tile : int, default 4096
    pool : int, default 2**22
    """

    ndim = property(lambda self: len(self.shape))

    def __init__(self, shape, dtype=np.float32, seed=0, scale=1.0, tile=4096, pool=2 ** 22):
        self.shape = tuple(int(s) for s in shape)
        if len(self.shape) < 2:
            raise ValueError(f"shape must be (..., N, d), got {self.shape}")
        self.dtype = np.dtype(dtype)
        self.seed, self.scale, self.tile, self.pool = int(seed), float(scale), int(tile), int(pool)
        self._values = None

    def __repr__(self):
        return (f"SeededArray(shape={self.shape}, dtype={self.dtype.name}, seed={self.seed}, "
                f"scale={self.scale}, tile={self.tile}, pool={self.pool})")

    def __len__(self):
        return self.shape[0]

    def _tile(self, g, t):
        n, d = self.shape[-2:]
        span = self.tile * d
        if self._values is None:  # the pool, extended so that every window is contiguous
            base = np.random.default_rng(self.seed).standard_normal(self.pool) * self.scale
            self._values = np.concatenate([base, base[:span]]).astype(self.dtype)
        rows = min(self.tile, n - t * self.tile)
        off = int(np.random.default_rng([self.seed, g, t]).integers(self.pool))
        return self._values[off:off + rows * d].reshape(rows, d)

    def rows(self, g, lo, hi, out=None):
        """Rows ``lo:hi`` of flat group ``g`` as an ndarray (hi - lo, d), written into ``out``
        (an array of that shape, any dtype; returned) where given, else a new array."""
        n, d = self.shape[-2:]
        lo, hi = max(0, lo), min(n, hi)
        if out is None:
            out = np.empty((max(hi - lo, 0), d), self.dtype)
        elif out.shape != (max(hi - lo, 0), d):
            raise ValueError(f"out must have shape {(max(hi - lo, 0), d)}, got {out.shape}")
        for t in range(lo // self.tile, -(-hi // self.tile)):
            a, b = max(lo, t * self.tile), min(hi, (t + 1) * self.tile)
            out[a - lo:b - lo] = self._tile(g, t)[a - t * self.tile:b - t * self.tile]
        return out

    def checkpoint_key(self):
        """What identifies the numbers (for checkpoint resumes): everything they are drawn from."""
        return [list(self.shape), self.dtype.name, self.seed, self.scale, self.tile, self.pool]

    def __array__(self, dtype=None, copy=None):
        lead = self.shape[:-2]
        G = int(np.prod(lead, dtype=np.int64))
        a = np.stack([self.rows(g, 0, self.shape[-2]) for g in range(G)]) if G else \
            np.empty((0,) + self.shape[-2:], self.dtype)
        a = a.reshape(self.shape)
        return a if dtype is None else a.astype(dtype)


# ---------------------------------------------------------------------------
# the 8M-token demo (racecpu demo --out-of-core DIR)
# ---------------------------------------------------------------------------

_DEMO_OUTPUTS = ("out", "dq", "dk", "dv")


def _disk_used(directory):
    total = 0
    for root, _, files in os.walk(directory):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def demo(tokens=8388608, heads=4, dim=128, directory="racecpu-ooc", causal=True, *, seed=0, num_planes=3,
         num_tables=3, beta=DEFAULT_BETA, block=BLOCK, store_dtype=np.float32, check=True, progress=True,
         commit_every=30.0, disk_margin=4 * 2 ** 30):
    """One out-of-core RACE forward + backward over ``tokens`` tokens; returns metrics.

    The inputs ``q, k, v`` and the cotangent ``grad_out`` (each heads x tokens
    x dim, float32) are :class:`SeededArray` streams -- generated per block
    from ``seed``, never stored -- while the four results ``out, dq, dk, dv``
    are written to ``.npy`` memmaps in ``directory`` (4 x heads x tokens x dim
    x 4 bytes: 64 GiB at 8M tokens, 4 heads, d = 128).  Progress is
    checkpointed in ``directory/checkpoint``: rerunning with the same
    arguments resumes; with other arguments the directory's demo files are
    discarded and the run restarts.

    Parameters
    ----------
    tokens, heads, dim : int
    directory : path
    causal : bool, default True
    seed, num_planes, num_tables, beta, block :
        Input seed, hash shape, temperature and tokens per block.
    store_dtype : dtype, default float32
        dtype of the result files (computation is float32 regardless).
    check : bool, default True
        Compare the first ``min(tokens, 4096)`` tokens of ``out`` (and, when
        causal, ``dq``, which for those tokens depends on nothing later)
        with the in-memory :func:`racecpu.race_attention_fwd`/``_bwd``.
    progress : bool, default True
        One tqdm bar (with ETA) over every block of every pass.
    commit_every : float, default 30
        Seconds between checkpoint commits (an interrupt loses at most this).
    disk_margin : int, default 4 GiB
        Refuse to start unless this much disk stays free after the results.

    Returns
    -------
    dict
        tokens, heads, dim, causal, block, seconds_forward, seconds_backward,
        seconds_total, ns_per_token_head, blocks_computed, blocks_total,
        peak_rss_bytes, disk_bytes, output_bytes, dbeta, check_max_abs_err,
        directory, files.
    """
    for name, val in (("tokens", tokens), ("heads", heads), ("dim", dim)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
            raise ValueError(f"{name} must be an int >= 1, got {val!r}")
    block = blocks.check_block(block)
    store_dtype = np.dtype(store_dtype)
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    config = dict(version=blocks.FORMAT_VERSION, tokens=int(tokens), heads=int(heads), dim=int(dim),
                  causal=bool(causal), seed=int(seed), num_planes=int(num_planes), num_tables=int(num_tables),
                  beta=float(beta), block=block, store_dtype=store_dtype.name)
    cfg_path = os.path.join(directory, "demo.json")
    ckpt = os.path.join(directory, "checkpoint")
    paths = {n: os.path.join(directory, f"{n}.npy") for n in _DEMO_OUTPUTS}
    try:
        with open(cfg_path) as fh:
            old = json.load(fh).get("config")
    except (OSError, ValueError):
        old = None
    if old != config:  # another demo (or none) lived here: restart cleanly
        for p in list(paths.values()) + [cfg_path]:
            if os.path.exists(p):
                os.remove(p)
        shutil.rmtree(ckpt, ignore_errors=True)

    shape = (heads, tokens, dim)
    nbytes = int(np.prod(shape, dtype=np.int64)) * store_dtype.itemsize
    missing = sum(nbytes - (os.stat(p).st_blocks * 512 if os.path.exists(p) else 0) for p in paths.values())
    free = shutil.disk_usage(directory).free
    if free < max(missing, 0) + disk_margin:
        raise RuntimeError(f"not enough disk in {directory!r}: the results need {missing / 2 ** 30:.1f} GiB "
                           f"more, plus a {disk_margin / 2 ** 30:.1f} GiB margin, but {free / 2 ** 30:.1f} GiB "
                           f"are free (try fewer tokens or store_dtype=float16)")

    outs = {}
    for n, p in paths.items():
        try:
            outs[n] = np.lib.format.open_memmap(p, mode="r+")
            if outs[n].shape != shape or outs[n].dtype != store_dtype:
                raise ValueError
        except (OSError, ValueError):
            outs[n] = np.lib.format.open_memmap(p, mode="w+", dtype=store_dtype, shape=shape)
        # reserve the blocks now: a full disk must fail here, not as SIGBUS on a mapped page later
        with open(p, "r+b") as fh:
            os.posix_fallocate(fh.fileno(), 0, os.fstat(fh.fileno()).st_size)
    tmp = cfg_path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(dict(config=config, complete=False), fh)
    os.replace(tmp, cfg_path)

    q, k, v, g = (SeededArray(shape, np.float32, seed=4 * seed + i) for i in range(4))
    planes = hyperplanes(dim, num_planes, num_tables, seed=seed)
    nb = -(-tokens // block)
    total = (2 if causal else 4) * nb
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=total, desc=f"out-of-core fwd+bwd, {tokens} tokens x {heads} heads", unit="block",
                   smoothing=0.05)

    # compile every kernel signature first (a tiny run), so the timings below are the work itself
    tiny = (heads, min(tokens, 64), dim)
    w_out = {n: np.zeros(tiny, np.float32) for n in _DEMO_OUTPUTS}
    w_res = race_attention_fwd_ooc(*(SeededArray(tiny, seed=i) for i in range(3)), planes, beta, causal=causal,
                                   out=w_out["out"], block=32, progress=False)
    race_attention_bwd_ooc(w_res, SeededArray(tiny, seed=3), dq=w_out["dq"], dk=w_out["dk"], dv=w_out["dv"],
                           progress=False)
    del w_out, w_res

    counter = _Counter(bar)
    reset = _reset_peak_rss()
    rss0 = _peak_rss()
    t0 = time.perf_counter()
    try:
        res = race_attention_fwd_ooc(q, k, v, planes, beta, causal=causal, out=outs["out"], block=block,
                                     checkpoint=ckpt, commit_every=commit_every, check_finite=False,
                                     progress=counter)
        t1 = time.perf_counter()
        dbeta = race_attention_bwd_ooc(res, g, dq=outs["dq"], dk=outs["dk"], dv=outs["dv"], checkpoint=ckpt,
                                       commit_every=commit_every, progress=counter)
        t2 = time.perf_counter()
    finally:
        if bar is not None:
            bar.close()
    peak = _peak_rss()

    err = None
    if check:
        n0 = min(tokens, 4096)
        qs, ks, vs, gs = (np.asarray(x.rows(0, 0, n0))[None] for x in (q, k, v, g))
        if causal:
            o_ref, r_ref = race_attention_fwd(qs, ks, vs, planes, beta, causal=True)
            dq_ref = race_attention_bwd(r_ref, gs)[0]
            err = max(float(np.abs(outs["out"][0, :n0] - o_ref[0]).max()),
                      float(np.abs(outs["dq"][0, :n0] - dq_ref[0]).max()))
        else:  # every query sees every key: check the first queries against the full key sketch
            err = float(np.abs(outs["out"][0, :n0].astype(np.float64)
                               - noncausal_rows(qs[0], res.A[0], res.B[0], planes, beta)).max())
        blocks.release_pages(*outs.values())

    for x in outs.values():
        x.flush()
    with open(tmp, "w") as fh:
        json.dump(dict(config=config, complete=True, dbeta=dbeta), fh)
    os.replace(tmp, cfg_path)
    secs = t2 - t0
    return dict(tokens=int(tokens), heads=int(heads), dim=int(dim), causal=bool(causal), block=block,
                seconds_forward=t1 - t0, seconds_backward=t2 - t1, seconds_total=secs,
                ns_per_token_head=secs / (tokens * heads) * 1e9,
                blocks_computed=counter.computed, blocks_total=total,
                peak_rss_bytes=peak, peak_rss_reset=reset, rss_before_bytes=rss0,
                disk_bytes=_disk_used(directory), output_bytes=4 * nbytes, dbeta=dbeta,
                check_max_abs_err=err, directory=directory, files=sorted(paths.values()))


class _Counter:
    """Feeds one bar from every pass and counts the blocks actually computed."""

    def __init__(self, bar):
        self.bar, self.computed = bar, 0

    def update(self, n=1):  # a block computed now
        self.computed += n
        if self.bar is not None:
            self.bar.update(n)

    def resumed(self, n):  # blocks recorded by an earlier run
        if self.bar is not None:
            self.bar.update(n)

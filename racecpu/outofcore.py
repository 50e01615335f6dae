"""RACE attention over sequences larger than RAM (chunked, on ``np.memmap``).

:func:`race_attention_fwd_ooc` and :func:`race_attention_bwd_ooc` compute
exactly what :func:`racecpu.race_attention_fwd` / ``_bwd`` compute, but read
their inputs and write their outputs one *block* of tokens at a time, so peak
RAM is ``O(block * heads * (d + dv))`` whatever the sequence length.  Inputs
are any arrays sliceable along the token axis -- ``np.memmap``, ``ndarray``
or :class:`SeededArray` (deterministic pseudo-random data generated per
block, for demos) -- and outputs go into caller-supplied ``out=`` arrays
(``np.memmap`` opened ``'r+'``/``'w+'``, or ``ndarray``).  After every block
the pages of memory-mapped arguments are dropped from this process
(``madvise(MADV_DONTNEED)``; written data stays in the file), so mapped files
do not pile up in the resident set.

Passes (each a scan over blocks that carries a small float64 state):

* non-causal forward: a sketch pass over keys (running sums ``A, B``), then an
  output pass over queries;
* causal forward: one pass carrying the prefix state ``(A, B)``; the state at
  every block boundary is kept (``O(L R dv)`` per block) for the backward;
* non-causal backward: a pass over queries (``dq`` and running sums
  ``dA, dB``), then a pass over keys (``dk, dv``);
* causal backward: one reverse pass carrying the suffix sums ``(dA, dB)``;
  each block recomputes its forward from the stored boundary state.

Checkpoints.  With ``checkpoint=DIR`` every pass records, after each block
whose outputs are flushed to disk, the carried state (``.npy`` row) and then a
manifest (JSON, replaced atomically).  Rerunning with the same arguments and
``DIR`` resumes after the last recorded block, giving the same bits as an
uninterrupted run; if anything in the arguments changed (shapes, planes,
beta, block, output files, input files' size/mtime) the pass restarts from
the first block.  A pass is reported complete only by its manifest.

Not supported here: ``key_mask`` and float16 compute (pass float32).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import time
from dataclasses import dataclass

import numpy as np

from . import _kernels as K
from ._checks import check_beta as _check_beta, check_planes as _check_planes
from .config import CHUNK
_chunk = K.chunk_length
from ._memory import peak_rss as _peak_rss
from ._memory import reset_peak_rss as _reset_peak_rss
from .hashing import DEFAULT_BETA, hyperplanes
from .streaming import advance

__all__ = ["race_attention_fwd_ooc", "race_attention_bwd_ooc", "OocResiduals", "SeededArray", "demo", "BLOCK"]

#: Default tokens per block (per head); a multiple of ``CHUNK`` so the chunk
#: grid is that of the in-memory kernels.  At 4 heads, d = dv = 128, float32
#: the backward's block buffers take about 0.5 GiB.
BLOCK = 32 * CHUNK

_VERSION = 1


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
    sliced.  Used by :func:`demo` to stream inputs that would not fit on disk.

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

    def rows(self, g, lo, hi):
        """Rows ``lo:hi`` of flat group ``g`` as an ndarray (hi - lo, d)."""
        n, d = self.shape[-2:]
        lo, hi = max(0, lo), min(n, hi)
        out = np.empty((max(hi - lo, 0), d), self.dtype)
        for t in range(lo // self.tile, -(-hi // self.tile)):
            a, b = max(lo, t * self.tile), min(hi, (t + 1) * self.tile)
            out[a - lo:b - lo] = self._tile(g, t)[a - t * self.tile:b - t * self.tile]
        return out

    def __array__(self, dtype=None, copy=None):
        lead = self.shape[:-2]
        G = int(np.prod(lead, dtype=np.int64))
        a = np.stack([self.rows(g, 0, self.shape[-2]) for g in range(G)]) if G else \
            np.empty((0,) + self.shape[-2:], self.dtype)
        a = a.reshape(self.shape)
        return a if dtype is None else a.astype(dtype)


# ---------------------------------------------------------------------------
# block I/O
# ---------------------------------------------------------------------------

def _mmap_of(x):
    b = x
    while b is not None and not isinstance(b, mmap.mmap):
        b = getattr(b, "base", None)
    return b


def _release(*arrays):
    """Drop the pages of memory-mapped arrays from this process's resident set."""
    for x in arrays:
        if isinstance(x, np.memmap) and x.mode != "c":
            m = _mmap_of(x)
            if m is not None and len(m):
                m.madvise(mmap.MADV_DONTNEED)


def _read(x, lead, g, lo, hi, buf):
    """Rows lo:hi of flat group g of ``x (..., N, d)`` into ``buf (hi - lo, d)``."""
    if isinstance(x, SeededArray):
        buf[...] = x.rows(g, lo, hi)
    else:
        buf[...] = x[np.unravel_index(g, lead) + (slice(lo, hi),)]


def _write(x, lead, g, lo, hi, data):
    x[np.unravel_index(g, lead) + (slice(lo, hi),)] = data


def _check_input(name, x):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array (np.memmap, ndarray or SeededArray), got {type(x).__name__}")
    if not isinstance(x, (np.ndarray, SeededArray)):
        raise TypeError(f"{name} must be an np.memmap, ndarray or SeededArray, got {type(x).__name__}")
    dt = np.dtype(x.dtype)
    if dt not in (np.float32, np.float64):
        raise TypeError(f"{name} must be float32 or float64, got {dt}")
    if len(x.shape) < 2:
        raise ValueError(f"{name} must have at least 2 dims (..., N, d), got shape {x.shape}")
    return dt


def _check_out(name, x, shape):
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be an np.memmap or ndarray, got {type(x).__name__}")
    if isinstance(x, np.memmap) and x.mode not in ("r+", "w+"):
        raise ValueError(f"{name} is an np.memmap opened with mode {x.mode!r}; open it with 'r+' or 'w+'")
    if not x.flags.writeable:
        raise ValueError(f"{name} is read-only")
    if x.dtype.kind != "f":
        raise TypeError(f"{name} must be a float array, got dtype {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def _identity(x, written=False, digest=True):
    """What a checkpoint must match for a resume to be valid (``digest``: hash in-RAM inputs)."""
    if isinstance(x, SeededArray):
        return ["seeded", list(x.shape), x.dtype.name, x.seed, x.scale, x.tile, x.pool]
    if isinstance(x, np.memmap) and isinstance(x.filename, str):
        ident = ["memmap", os.path.realpath(x.filename), int(x.offset), list(x.shape), x.dtype.name,
                 list(x.strides)]
        if not written:
            st = os.stat(x.filename)
            ident += [st.st_size, st.st_mtime_ns]
        return ident
    tag = hashlib.sha256(np.ascontiguousarray(x)).hexdigest() if digest and not written else id(x)
    return ["array", list(x.shape), x.dtype.name, tag]


# ---------------------------------------------------------------------------
# the block scan with optional checkpoints
# ---------------------------------------------------------------------------

class _Scan:
    """One pass over ``nb`` blocks carrying float64 arrays ``state`` and a scalar.

    ``states[i]`` is the carried state before the i-th processed block
    (``states[nb]`` the final one).  With a checkpoint directory the states
    live in ``.npy`` files there and a JSON manifest records how many blocks
    are done; otherwise they live in RAM.
    """

    def __init__(self, directory, name, key, nb, shapes, commit_every=0.0):
        self.name, self.nb, self.dir = name, nb, directory
        self.commit_every, self._last = float(commit_every), time.monotonic()
        self.key = json.loads(json.dumps(dict(key, version=_VERSION, pass_=name, blocks=nb)))
        self.done, self.scalar = 0, 0.0
        if directory is None:
            self.states = [np.zeros((nb + 1,) + s) for s in shapes]
            return
        os.makedirs(directory, exist_ok=True)
        self.manifest = os.path.join(directory, f"{name}.json")
        paths = [os.path.join(directory, f"{name}.state{i}.npy") for i in range(len(shapes))]
        rec = None
        try:
            with open(self.manifest) as fh:
                rec = json.load(fh)
        except (OSError, ValueError):
            pass
        if rec is not None and rec.get("key") == self.key and all(os.path.exists(p) for p in paths):
            try:
                self.states = [np.lib.format.open_memmap(p, mode="r+") for p in paths]
                if [s.shape for s in self.states] != [(nb + 1,) + s for s in shapes]:
                    raise ValueError("state file shapes")
                self.done, self.scalar = int(rec["done"]), float(rec["scalar"])
                return
            except (OSError, ValueError, KeyError, TypeError):
                pass
        # fresh start: invalidate the manifest first, then (re)create the state files
        if os.path.exists(self.manifest):
            os.remove(self.manifest)
        self.states = [np.lib.format.open_memmap(p, mode="w+", dtype=np.float64, shape=(nb + 1,) + s)
                       for p, s in zip(paths, shapes)]
        self._commit()

    @property
    def complete(self):
        return self.done == self.nb

    def state(self, i):
        return [np.array(s[i]) for s in self.states]

    def record(self, new_state, scalar, outputs):
        """After block ``done`` is written: store the state; commit at most every ``commit_every`` s.

        A commit flushes the outputs and states to disk and only then
        replaces the manifest, so a recorded block is always on disk; blocks
        after the last commit are recomputed by a rerun.
        """
        i = self.done + 1
        for s, a in zip(self.states, new_state):
            s[i] = a
        self.scalar = scalar
        self.done = i
        if self.dir is not None and (self.complete or time.monotonic() - self._last >= self.commit_every):
            for x in outputs:
                if isinstance(x, np.memmap):
                    x.flush()
            for s in self.states:
                s.flush()
            self._commit()
            self._last = time.monotonic()
        _release(*self.states)

    def _commit(self):
        rec = dict(key=self.key, done=self.done, scalar=self.scalar, complete=self.complete)
        tmp = self.manifest + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(rec, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.manifest)


def _bar(progress, total, desc):
    """(bar, owned): a tqdm bar, the caller's bar, or None."""
    if progress is True:
        from tqdm.auto import tqdm
        return tqdm(total=total, desc=desc, unit="block"), True
    if progress:  # a bar the caller owns (e.g. one bar over several passes)
        return progress, False
    return None, False


def _run(scan, blocks, body, progress, desc, outputs, inputs):
    """Run ``body(lo, hi, state) -> (new_state, dscalar)`` over blocks not yet done."""
    bar, owned = _bar(progress, scan.nb, desc)
    try:
        if bar is not None and scan.done:  # blocks done by an earlier, interrupted run
            getattr(bar, "resumed", bar.update)(scan.done)
        while not scan.complete:
            lo, hi = blocks[scan.done]
            new_state, ds = body(lo, hi, scan.state(scan.done))
            scan.record(new_state, scan.scalar + ds, outputs)
            _release(*inputs, *outputs)
            if bar is not None:
                bar.update(1)
    finally:
        if owned:
            bar.close()
    return scan.state(scan.nb), scan.scalar


class _Buffers:
    """Reusable flat buffers, viewed as C-contiguous arrays of the block's shape."""

    def __init__(self):
        self._store = {}

    def __call__(self, name, shape, dtype, zero=False):
        size = int(np.prod(shape, dtype=np.int64))
        dtype = np.dtype(dtype)
        buf = self._store.get(name)
        if buf is None or buf.size < size or buf.dtype != dtype:
            buf = self._store[name] = np.empty(size, dtype)
        a = buf[:size].reshape(shape)
        if zero:
            a.fill(0)
        return a


def _blocks(n, block, reverse=False):
    b = [(lo, min(lo + block, n)) for lo in range(0, n, block)]
    return b[::-1] if reverse else b


# ---------------------------------------------------------------------------
# residuals, forward and backward
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class OocResiduals:
    """What :func:`race_attention_bwd_ooc` needs from :func:`race_attention_fwd_ooc`.

    References to the inputs (they must not change in between) and the
    carried float64 state: the sketch totals ``(A (G, F), B (G, F, dv))``
    (non-causal) or the prefix state at every block boundary (causal).
    """
    q: object
    k: object
    v: object
    planes: np.ndarray
    beta: float
    causal: bool
    block: int
    lead: tuple
    nq: int
    nk: int
    cdt: np.dtype
    check_finite: bool
    A: np.ndarray
    B: np.ndarray
    key: dict


def _load_block(x, name, lead, lo, hi, bufs, cdt, check_finite):
    G = int(np.prod(lead, dtype=np.int64))
    a = bufs(name, (G, hi - lo, x.shape[-1]), cdt)
    for g in range(G):
        _read(x, lead, g, lo, hi, a[g])
    if check_finite and not np.isfinite(a).all():
        raise ValueError(f"{name} contains NaN or Inf in tokens {lo}:{hi} (pass check_finite=False to skip)")
    return a


def _store_block(x, lead, lo, hi, data):
    for g in range(data.shape[0]):
        _write(x, lead, g, lo, hi, data[g])


def race_attention_fwd_ooc(q, k, v, planes, beta=DEFAULT_BETA, *, causal=False, out, block=BLOCK,
                           checkpoint=None, commit_every=30.0, check_finite=True, progress=True):
    """Chunked RACE attention forward for inputs larger than RAM.

    Parameters
    ----------
    q, k : np.memmap, ndarray or SeededArray, shape (..., Nq, d), (..., Nk, d)
    v : same kinds, shape (..., Nk, dv)
        float32 or float64 (the compute dtype is their common type).
    planes, beta, causal :
        As for :func:`racecpu.race_attention`.
    out : np.memmap ('r+'/'w+') or ndarray, shape (..., Nq, dv)
        Receives the output (cast to its dtype).
    block : int, default BLOCK
        Tokens per head read at a time; peak RAM grows linearly with it.
    checkpoint : path, optional
        Directory recording progress; a rerun with the same arguments resumes.
    commit_every : float, default 30
        Seconds between checkpoint commits (each flushes the outputs to disk;
        0 commits after every block).  A pass's last block always commits.
    check_finite : bool, default True
    progress : bool or tqdm bar, default True

    Returns
    -------
    OocResiduals
        For :func:`race_attention_bwd_ooc`; the output is in ``out``.
    """
    cdt = np.result_type(*(_check_input(n, x) for n, x in (("q", q), ("k", k), ("v", v))))
    lead = tuple(q.shape[:-2])
    if tuple(k.shape[:-2]) != lead or tuple(v.shape[:-2]) != lead:
        raise ValueError(f"q, k, v must have the same leading dims, got shapes q {q.shape}, k {k.shape}, v {v.shape}")
    (nq, d), (nk, dk_), (nv, dv) = q.shape[-2:], k.shape[-2:], v.shape[-2:]
    if dk_ != d:
        raise ValueError(f"q and k must have the same head dim, got shapes q {q.shape} and k {k.shape}")
    if nv != nk:
        raise ValueError(f"k and v must have the same number of tokens, got shapes k {k.shape} and v {v.shape}")
    if causal and nq != nk:
        raise ValueError(f"causal attention needs as many queries as keys, got shapes q {q.shape} and k {k.shape}")
    planes = _check_planes(planes, d, cdt)
    beta = _check_beta(beta)
    block = _check_block(block)
    _check_out("out", out, lead + (nq, dv))
    G = int(np.prod(lead, dtype=np.int64))
    L, P, _ = planes.shape
    F = L * 2 ** P
    ck = checkpoint is not None
    key = dict(q=_identity(q, digest=ck), k=_identity(k, digest=ck), v=_identity(v, digest=ck),
               out=_identity(out, written=True),
               planes=hashlib.sha256(planes.tobytes()).hexdigest(), beta=beta, causal=bool(causal),
               block=block, cdt=np.dtype(cdt).name)
    bufs = _Buffers()
    ckdir = None if checkpoint is None else os.fspath(checkpoint)
    shapes = [(G, F), (G, F, dv)]
    ones = np.ones(G * block, np.bool_)  # key mask: every key counts

    if causal:
        def body(lo, hi, state):
            n = hi - lo
            qb = _load_block(q, "q", lead, lo, hi, bufs, cdt, check_finite)
            kb = _load_block(k, "k", lead, lo, hi, bufs, cdt, check_finite)
            vb = _load_block(v, "v", lead, lo, hi, bufs, cdt, check_finite)
            ob = bufs("out", (G, n, dv), cdt)
            A1, B1 = advance(qb, kb, vb, planes, beta, state[0], state[1], ob,
                             phik=bufs("phik", (G, n, F), cdt), tk=bufs("tk", (G, n, L * P), cdt),
                             phiq=bufs("phiq", (G, n, F), cdt), tq=bufs("tq", (G, n, L * P), cdt),
                             den=bufs("den", (G, n), np.float64))
            _store_block(out, lead, lo, hi, ob)
            return (A1, B1), 0.0

        scan = _Scan(ckdir, "fwd_causal", key, -(-nk // block), shapes, commit_every)
        _run(scan, _blocks(nk, block), body, progress, "forward (causal)", [out], [q, k, v])
        A, B = scan.states
    else:
        def sketch(lo, hi, state):
            n = hi - lo
            kb = _load_block(k, "k", lead, lo, hi, bufs, cdt, check_finite)
            vb = _load_block(v, "v", lead, lo, hi, bufs, cdt, check_finite)
            chunk = _chunk(n, G, F, dv)
            nc = -(-n // chunk)
            partA = bufs("partA", (G, nc, F), np.float64, zero=True)
            partB = bufs("partB", (G, nc, F, dv), np.float64, zero=True)
            K.sketch_chunks(kb, vb, ones[:G * n].reshape(G, n), planes, beta, chunk,
                            bufs("phik", (G, n, F), cdt), bufs("tk", (G, n, L * P), cdt), partA, partB,
                            span=K.SKETCH_FUSED)
            return (state[0] + partA.sum(1), state[1] + partB.sum(1)), 0.0

        scan = _Scan(ckdir, "fwd_sketch", key, -(-nk // block), shapes, commit_every)
        (A, B), _ = _run(scan, _blocks(nk, block), sketch, progress, "forward: key sketch", [], [k, v])
        Bc = B.astype(cdt)

        def readout(lo, hi, state):
            n = hi - lo
            qb = _load_block(q, "q", lead, lo, hi, bufs, cdt, check_finite)
            ob = bufs("out", (G, n, dv), cdt)
            K.queries_fwd(qb, planes, beta, _chunk(n, G, F, dv), A, Bc, bufs("phiq", (G, n, F), cdt),
                          bufs("tq", (G, n, L * P), cdt), bufs("den", (G, n), np.float64), ob)
            _store_block(out, lead, lo, hi, ob)
            return (), 0.0

        scan2 = _Scan(ckdir, "fwd_readout", dict(key, sketch=scan.key), -(-nq // block), [], commit_every)
        _run(scan2, _blocks(nq, block), readout, progress, "forward: queries", [out], [q])
    return OocResiduals(q, k, v, planes, beta, bool(causal), block, lead, nq, nk, np.dtype(cdt), check_finite,
                        np.asarray(A), np.asarray(B), key)


def _check_block(block):
    if isinstance(block, (bool, np.bool_)) or not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"block must be an int >= 1, got {block!r}")
    return int(block)


def race_attention_bwd_ooc(res, grad_out, *, dq, dk, dv, checkpoint=None, commit_every=30.0, progress=True):
    """Chunked RACE attention backward for inputs larger than RAM.

    Parameters
    ----------
    res : OocResiduals
        From :func:`race_attention_fwd_ooc` (its inputs must be unchanged).
    grad_out : np.memmap, ndarray or SeededArray, shape (..., Nq, dv)
    dq, dk, dv : np.memmap ('r+'/'w+') or ndarray
        Receive the gradients, shapes of q, k, v.
    checkpoint : path, optional
        Directory recording progress (may be the forward's); a rerun resumes.
    commit_every : float, default 30
        Seconds between checkpoint commits (see :func:`race_attention_fwd_ooc`).
    progress : bool or tqdm bar, default True

    Returns
    -------
    dbeta : float
        Gradient w.r.t. beta summed over every head and token.
    """
    if not isinstance(res, OocResiduals):
        raise TypeError(f"res must come from race_attention_fwd_ooc, got {type(res).__name__}")
    r = res
    _check_input("grad_out", grad_out)
    lead, nq, nk, cdt, block = r.lead, r.nq, r.nk, r.cdt, r.block
    d, dvdim = r.q.shape[-1], r.v.shape[-1]
    if tuple(grad_out.shape) != lead + (nq, dvdim):
        raise ValueError(f"grad_out must have the output's shape {lead + (nq, dvdim)}, got {tuple(grad_out.shape)}")
    for name, x, shape in (("dq", dq, r.q.shape), ("dk", dk, r.k.shape), ("dv", dv, r.v.shape)):
        _check_out(name, x, shape)
    G = int(np.prod(lead, dtype=np.int64))
    L, P, _ = r.planes.shape
    F = L * 2 ** P
    planes, beta, cf = r.planes, r.beta, r.check_finite
    key = dict(fwd=r.key, g=_identity(grad_out, digest=checkpoint is not None), dq=_identity(dq, True),
               dk=_identity(dk, True),
               dv=_identity(dv, True))
    bufs = _Buffers()
    ckdir = None if checkpoint is None else os.fspath(checkpoint)
    shapes = [(G, F), (G, F, dvdim)]
    if G == 0 or nq == 0 or nk == 0:
        for x in (dq, dk, dv):
            x[...] = 0
        return 0.0

    if r.causal:
        blocks = _blocks(nk, block, reverse=True)
        nb = len(blocks)

        def body(lo, hi, state):
            n = hi - lo
            b = lo // block
            qb = _load_block(r.q, "q", lead, lo, hi, bufs, cdt, cf)
            kb = _load_block(r.k, "k", lead, lo, hi, bufs, cdt, cf)
            vb = _load_block(r.v, "v", lead, lo, hi, bufs, cdt, cf)
            gb = _load_block(grad_out, "grad_out", lead, lo, hi, bufs, cdt, cf)
            phik, tk = bufs("phik", (G, n, F), cdt), bufs("tk", (G, n, L * P), cdt)
            phiq, tq = bufs("phiq", (G, n, F), cdt), bufs("tq", (G, n, L * P), cdt)
            den = bufs("den", (G, n), np.float64)
            ob = bufs("out", (G, n, dvdim), cdt)
            _, _, chunk, cA, cB = advance(qb, kb, vb, planes, beta, np.array(r.A[b]), np.array(r.B[b]), ob,
                                          phik=phik, tk=tk, phiq=phiq, tq=tq, den=den, return_carries=True)
            nc = cA.shape[1]
            dqb = bufs("dq", (G, n, d), cdt, zero=True)
            dkb = bufs("dk", (G, n, d), cdt, zero=True)
            dvb = bufs("dv", (G, n, dvdim), cdt, zero=True)
            dden = bufs("dden", (G, n), np.float64, zero=True)
            pdA = bufs("pdA", (G, nc, F), np.float64, zero=True)
            pdB = bufs("pdB", (G, nc, F, dvdim), np.float64, zero=True)
            dbq = bufs("dbq", (G, nc), np.float64, zero=True)
            dbk = bufs("dbk", (G, nc), np.float64, zero=True)
            K.causal_queries_bwd(gb, vb, phik, phiq, tq, den, cA, cB, planes, beta, chunk,
                                 dqb, dden, pdA, pdB, dbq)
            sA = K.exclusive_scan(pdA, reverse=True)
            sB = K.exclusive_scan(pdB, reverse=True)
            sA += state[0][:, None]
            sB += state[1][:, None]
            K.causal_keys_bwd(gb, vb, phik, tk, phiq, den, dden, sA, sB, planes, beta, chunk,
                              dkb, dvb, dbk)
            for x, a in ((dq, dqb), (dk, dkb), (dv, dvb)):
                _store_block(x, lead, lo, hi, a)
            return (state[0] + pdA.sum(1), state[1] + pdB.sum(1)), float(dbq.sum() + dbk.sum())

        scan = _Scan(ckdir, "bwd_causal", key, nb, shapes, commit_every)
        _, dbeta = _run(scan, blocks, body, progress, "backward (causal, reverse)", [dq, dk, dv],
                        [r.q, r.k, r.v, grad_out])
        return dbeta

    A, Bc = r.A, r.B.astype(cdt)

    def queries(lo, hi, state):
        n = hi - lo
        chunk = _chunk(n, G, F, dvdim)
        nc = -(-n // chunk)
        qb = _load_block(r.q, "q", lead, lo, hi, bufs, cdt, cf)
        gb = _load_block(grad_out, "grad_out", lead, lo, hi, bufs, cdt, cf)
        phiq, tq = bufs("phiq", (G, n, F), cdt), bufs("tq", (G, n, L * P), cdt)
        den = bufs("den", (G, n), np.float64)
        K.queries_fwd(qb, planes, beta, chunk, A, Bc, phiq, tq, den, bufs("out", (G, n, dvdim), cdt))
        dqb = bufs("dq", (G, n, d), cdt, zero=True)
        pdA = bufs("pdA", (G, nc, F), np.float64, zero=True)
        pdB = bufs("pdB", (G, nc, F, dvdim), np.float64, zero=True)
        dbq = bufs("dbq", (G, nc), np.float64, zero=True)
        K.queries_bwd(gb, phiq, tq, den, A, Bc, planes, beta, chunk, dqb, pdA, pdB, dbq)
        _store_block(dq, lead, lo, hi, dqb)
        return (state[0] + pdA.sum(1), state[1] + pdB.sum(1)), float(dbq.sum())

    scan = _Scan(ckdir, "bwd_queries", key, -(-nq // block), shapes, commit_every)
    (dA, dB), dbeta_q = _run(scan, _blocks(nq, block), queries, progress, "backward: queries", [dq],
                             [r.q, grad_out])
    dBc = dB.astype(cdt)

    def keys(lo, hi, state):
        n = hi - lo
        chunk = _chunk(n, G, F, dvdim)
        nc = -(-n // chunk)
        kb = _load_block(r.k, "k", lead, lo, hi, bufs, cdt, cf)
        vb = _load_block(r.v, "v", lead, lo, hi, bufs, cdt, cf)
        phik, tk = bufs("phik", (G, n, F), cdt), bufs("tk", (G, n, L * P), cdt)
        for g in range(G):
            K.soft_hash_rows(kb[g], planes, beta, tk[g], phik[g])
        dkb = bufs("dk", (G, n, d), cdt, zero=True)
        dvb = bufs("dv", (G, n, dvdim), cdt, zero=True)
        dbk = bufs("dbk", (G, nc), np.float64, zero=True)
        K.keys_bwd(vb, phik, tk, dA, dBc, planes, beta, chunk, dkb, dvb, dbk)
        for x, a in ((dk, dkb), (dv, dvb)):
            _store_block(x, lead, lo, hi, a)
        return (), float(dbk.sum())

    scan2 = _Scan(ckdir, "bwd_keys", dict(key, queries=scan.key), -(-nk // block), [], commit_every)
    _, dbeta_k = _run(scan2, _blocks(nk, block), keys, progress, "backward: keys", [dk, dv], [r.k, r.v])
    return dbeta_q + dbeta_k


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
    from . import race_attention_bwd, race_attention_fwd

    for name, val in (("tokens", tokens), ("heads", heads), ("dim", dim)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
            raise ValueError(f"{name} must be an int >= 1, got {val!r}")
    block = _check_block(block)
    store_dtype = np.dtype(store_dtype)
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    config = dict(version=_VERSION, tokens=int(tokens), heads=int(heads), dim=int(dim), causal=bool(causal),
                  seed=int(seed), num_planes=int(num_planes), num_tables=int(num_tables), beta=float(beta),
                  block=block, store_dtype=store_dtype.name)
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
                               - _noncausal_rows(qs[0], res.A[0], res.B[0], planes, beta)).max())
        _release(*outs.values())

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


def _noncausal_rows(q, A, B, planes, beta):
    """Reference readout of rows ``q (n, d)`` from a summed sketch, via soft_buckets."""
    from .hashing import soft_buckets
    L = planes.shape[0]
    phi = soft_buckets(q, planes, beta).reshape(len(q), -1).astype(np.float64)
    den = phi @ A / L
    return (phi @ B / L) / den[:, None]

"""Checkpointed scans over blocks of tokens, for arrays larger than RAM.

The engine under :mod:`racecpu.outofcore`; it knows nothing of attention.  A
*pass* is a loop over blocks of rows (tokens) that carries a small float64
state from block to block: :func:`run` calls ``body(lo, hi, state) ->
(new_state, dscalar)`` for each block not yet done, and :class:`Scan` keeps
the state before every block, in RAM or, with a checkpoint directory, in
``.npy`` files there and a JSON manifest that says how many blocks are done.
A rerun whose arguments have the same identity (:func:`identity`) resumes
after the last recorded block and gives the same bits as an uninterrupted run.

Inputs (*stores* read block by block) are ``np.ndarray`` / ``np.memmap`` of
shape ``(..., N, d)`` or a *row source*: any object with

* ``shape`` ``(..., N, d)`` and ``dtype`` (float32 or float64);
* ``rows(g, lo, hi)``: rows ``lo:hi`` of flat group ``g`` as an ndarray
  ``(hi - lo, d)``, the same numbers however the rows are split;
* ``checkpoint_key()``: a JSON-serialisable value that changes whenever the
  contents may (a resume is valid only under the same key).

Outputs are ``np.ndarray`` or ``np.memmap`` opened ``'r+'``/``'w+'``.  After
every block the pages of memory-mapped arguments are dropped from this
process (``madvise(MADV_DONTNEED)``; written data stays in the file), so mapped
files do not pile up in the resident set.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import time

import numpy as np

#: Checkpoint format; a manifest written under another version is not resumed.
FORMAT_VERSION = 1


# ---------------------------------------------------------------------------
# stores: checks, identity, block I/O
# ---------------------------------------------------------------------------

def is_row_source(x):
    """Whether ``x`` is a row source (see the module docstring) rather than an array."""
    return not isinstance(x, np.ndarray) and callable(getattr(x, "rows", None)) \
        and callable(getattr(x, "checkpoint_key", None))


def check_store_input(name, x):
    """An input read block by block: ndarray, np.memmap or row source, float32/64,
    at least 2 dims ``(..., N, d)``.  Returns its dtype (it is not copied or cast)."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array (np.memmap, ndarray or row source), got {type(x).__name__}")
    if not (isinstance(x, np.ndarray) or is_row_source(x)):
        raise TypeError(f"{name} must be an np.memmap, ndarray or row source (an object with rows() and "
                        f"checkpoint_key(), e.g. racecpu.apps.ooc_demo.SeededArray), got {type(x).__name__}")
    dt = np.dtype(x.dtype)
    if dt not in (np.float32, np.float64):
        raise TypeError(f"{name} must be float32 or float64, got {dt}")
    if len(x.shape) < 2:
        raise ValueError(f"{name} must have at least 2 dims (..., N, d), got shape {x.shape}")
    return dt


def check_store_out(name, x, shape):
    """An output written block by block: ndarray or np.memmap opened ``'r+'``/``'w+'``,
    writeable, of exactly ``shape`` and any float dtype (results are cast to it).

    Unlike :func:`racecpu._checks.check_out` the dtype is free and aliasing is
    not checked: blocks are computed in buffers and only then stored.
    """
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


def check_block(block):
    """Tokens per block: an int >= 1."""
    if isinstance(block, (bool, np.bool_)) or not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"block must be an int >= 1, got {block!r}")
    return int(block)


def identity(x, written=False, digest=True):
    """What a checkpoint must match for a resume to be valid.

    A memmap is its file, offset, layout and (unless ``written``: an output,
    which the pass itself changes) the file's size and mtime; an in-RAM array
    is a SHA-256 of its bytes when ``digest`` (a checkpointed run) and its
    ``id`` otherwise; a row source is its ``checkpoint_key()``.
    """
    if is_row_source(x):
        return ["source", type(x).__name__, x.checkpoint_key()]
    if isinstance(x, np.memmap) and isinstance(x.filename, str):
        ident = ["memmap", os.path.realpath(x.filename), int(x.offset), list(x.shape), x.dtype.name,
                 list(x.strides)]
        if not written:
            st = os.stat(x.filename)
            ident += [st.st_size, st.st_mtime_ns]
        return ident
    tag = hashlib.sha256(np.ascontiguousarray(x)).hexdigest() if digest and not written else id(x)
    return ["array", list(x.shape), x.dtype.name, tag]


def _mmap_of(x):
    b = x
    while b is not None and not isinstance(b, mmap.mmap):
        b = getattr(b, "base", None)
    return b


def release_pages(*arrays):
    """Drop the pages of memory-mapped arrays from this process's resident set.

    Written pages stay in the page cache and reach the file; copy-on-write
    maps (mode ``'c'``) are skipped, since dropping them would lose writes.
    """
    for x in arrays:
        if isinstance(x, np.memmap) and x.mode != "c":
            m = _mmap_of(x)
            if m is not None and len(m):
                m.madvise(mmap.MADV_DONTNEED)


def load_block(x, name, lead, lo, hi, bufs, cdt, check_finite):
    """Rows ``lo:hi`` of every group of ``x (*lead, N, d)`` as ``(G, hi - lo, d)`` in
    ``cdt``, in the buffer ``bufs(name)`` (valid until that name is asked for again)."""
    G = int(np.prod(lead, dtype=np.int64))
    a = bufs(name, (G, hi - lo, x.shape[-1]), cdt)
    for g in range(G):
        if is_row_source(x):
            a[g] = x.rows(g, lo, hi)
        else:
            a[g] = x[np.unravel_index(g, lead) + (slice(lo, hi),)]
    if check_finite and not np.isfinite(a).all():
        raise ValueError(f"{name} contains NaN or Inf in tokens {lo}:{hi} (pass check_finite=False to skip)")
    return a


def store_block(x, lead, lo, hi, data):
    """Write ``data (G, hi - lo, d)`` into rows ``lo:hi`` of ``x (*lead, N, d)`` (cast to its dtype)."""
    for g in range(data.shape[0]):
        x[np.unravel_index(g, lead) + (slice(lo, hi),)] = data[g]


class Buffers:
    """Reusable flat buffers by name, viewed as C-contiguous arrays of the block's shape.

    The last block of a pass is shorter; reusing the first block's memory
    keeps a pass at one allocation per name.
    """

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


def block_ranges(n, block, reverse=False):
    """``[(lo, hi), ...]`` covering ``0:n`` in steps of ``block`` (last first if ``reverse``)."""
    b = [(lo, min(lo + block, n)) for lo in range(0, n, block)]
    return b[::-1] if reverse else b


# ---------------------------------------------------------------------------
# the scan with optional checkpoints
# ---------------------------------------------------------------------------

class Scan:
    """One pass over ``nb`` blocks carrying float64 arrays of ``shapes`` and a scalar.

    ``states[i]`` is the carried state before the i-th processed block
    (``states[nb]`` the final one).  With a checkpoint ``directory`` the
    states live in ``{name}.state{i}.npy`` files there and ``{name}.json``
    records ``key`` and how many blocks are done; a manifest with another key
    (or unreadable state files) restarts the pass.  Without one they live in RAM.
    """

    def __init__(self, directory, name, key, nb, shapes, commit_every=0.0):
        self.name, self.nb, self.dir = name, nb, directory
        self.commit_every, self._last = float(commit_every), time.monotonic()
        self.key = json.loads(json.dumps(dict(key, version=FORMAT_VERSION, pass_=name, blocks=nb)))
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
        release_pages(*self.states)

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


def run(scan, blocks, body, progress, desc, outputs, inputs):
    """Run ``body(lo, hi, state) -> (new_state, dscalar)`` over the blocks ``scan`` has not done.

    Parameters
    ----------
    scan : Scan
    blocks : list of (lo, hi)
        In processing order, ``len(blocks) == scan.nb``.
    body : callable
        Computes one block, stores its outputs, returns the state after it
        and what it adds to the scalar.
    progress : bool or bar
        ``True``: a tqdm bar; a bar object: ``update(n)`` per block computed
        and, if it has one, ``resumed(n)`` for blocks an earlier run did.
    desc : str
        The tqdm bar's label.
    outputs, inputs : sequences of arrays
        Flushed (outputs) at commits; pages of both released after each block.

    Returns
    -------
    (state, scalar)
        The final carried state (list of arrays) and scalar.
    """
    bar, owned = _bar(progress, scan.nb, desc)
    try:
        if bar is not None and scan.done:  # blocks done by an earlier, interrupted run
            getattr(bar, "resumed", bar.update)(scan.done)
        while not scan.complete:
            lo, hi = blocks[scan.done]
            new_state, ds = body(lo, hi, scan.state(scan.done))
            scan.record(new_state, scan.scalar + ds, outputs)
            release_pages(*inputs, *outputs)
            if bar is not None:
                bar.update(1)
    finally:
        if owned:
            bar.close()
    return scan.state(scan.nb), scan.scalar

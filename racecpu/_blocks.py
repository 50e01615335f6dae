"""Checkpointed scans over blocks of tokens, for arrays larger than RAM.

The engine under :mod:`racecpu.outofcore`; it knows nothing of attention.  A
*pass* is a loop over blocks of rows (tokens) that carries a small float64
state from block to block: :func:`run` calls ``body(lo, hi, state) ->
(new_state, dscalar)`` for each block not yet done, and :class:`Scan` keeps
the state before every block, in RAM or, with a checkpoint directory, in
``.npy`` files there and a JSON manifest that says how many blocks are done.
A rerun whose arguments have the same identity (:func:`identity`) resumes
after the last recorded block and gives the same bits as an uninterrupted run.

Inputs (*stores* read block by block) are, of shape ``(..., N, d)`` and
dtype float32 or float64:

* ``np.ndarray`` / ``np.memmap``, read one head at a time;
* a *row source*: any object with

  * ``shape`` ``(..., N, d)`` and ``dtype`` (float32 or float64);
  * ``rows(g, lo, hi)``: rows ``lo:hi`` of flat group ``g`` as an ndarray
    ``(hi - lo, d)``, the same numbers however the rows are split;
  * ``checkpoint_key()``: a JSON-serialisable value that changes whenever the
    contents may (a resume is valid only under the same key);

* an *array-like*: any other object with ``shape``, ``dtype`` (a NumPy dtype)
  and ``__getitem__`` taking a tuple of one slice per dimension and returning
  what ``np.asarray`` takes (a ``zarr.Array``, a dask array, an h5py
  dataset...), read one block of tokens of every head per call.

Outputs are ``np.ndarray``, ``np.memmap`` opened ``'r+'``/``'w+'``, or an
array-like with ``shape``, a float ``dtype`` and ``__setitem__`` taking a
tuple of one slice per dimension (a ``zarr.Array`` opened writable; one with
``read_only`` true is refused), plus ``__getitem__`` when checkpointing (the
checksums read the written blocks back).  An array-like output is given a
fresh array, already cast to its dtype, per block (it may keep it).

Identity (:func:`identity`: what a checkpoint's key holds, so that a resume
is valid only onto the same arguments):

* memmap (input): file, offset, shape, dtype, strides, file size and mtime;
* in-RAM ndarray (input): a SHA-256 of its bytes (its ``id`` without a
  checkpoint);
* row source: its ``checkpoint_key()``;
* ``zarr.Array`` (input): its store location (a local store by its real
  path), shape, dtype and chunks, and a SHA-256 of its contents;
* other array-like (input): type, shape, dtype and a SHA-256 of its contents;
* outputs: a memmap by its file, offset and layout; a ``zarr.Array`` by its
  store location, shape and dtype; anything else by its ``id`` (valid in this
  process only).  The outputs' contents are checked by per-block checksums.

The content digests of zarr and array-like inputs are taken only for a
checkpointed run (``digest=True``): they cost one extra read pass over each
such input, ``DIGEST_BYTES`` at a time along the token axis (so memory stays
bounded).  Without a checkpoint a zarr input is identified by its location,
shape, dtype and chunks, another array-like by its ``id``.

After every block the pages of memory-mapped arguments are dropped from this
process (``madvise(MADV_DONTNEED)``; written data stays in the file), so mapped
files do not pile up in the resident set.  At a checkpoint commit memmap
outputs are flushed (``msync``) and array-like outputs with a ``flush()``
method have it called; a zarr array's writes are in its store when
``__setitem__`` returns.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import stat
import sys
import time
import warnings

import numpy as np

#: Checkpoint format; a manifest written under another version is not resumed.
#: 2: per-block checksums of the outputs and states, and of the manifest itself.
FORMAT_VERSION = 2

#: Bytes read at a time (rounded to whole rows and, for zarr, whole chunks along
#: the token axis) by the content digest of a zarr or array-like input.
DIGEST_BYTES = 64 * 2 ** 20


class CheckpointWarning(RuntimeWarning):
    """A checkpoint did not match what is on disk (or the arguments); its pass restarts."""


# ---------------------------------------------------------------------------
# stores: checks, identity, block I/O
# ---------------------------------------------------------------------------

def is_row_source(x):
    """Whether ``x`` is a row source (see the module docstring) rather than an array."""
    return not isinstance(x, np.ndarray) and callable(getattr(x, "rows", None)) \
        and callable(getattr(x, "checkpoint_key", None))


def is_zarr(x):
    """Whether ``x`` is a ``zarr.Array`` (without importing zarr: one exists only if it is)."""
    zarr = sys.modules.get("zarr")
    cls = getattr(zarr, "Array", None) if zarr is not None else None
    return isinstance(cls, type) and isinstance(x, cls)


def is_array_like(x):
    """Whether ``x`` is read as an array-like: neither an ndarray nor a row source,
    with ``shape``, ``dtype`` and ``__getitem__``."""
    return not isinstance(x, np.ndarray) and not is_row_source(x) and hasattr(x, "shape") \
        and hasattr(x, "dtype") and callable(getattr(x, "__getitem__", None))


def _np_dtype(name, x):
    try:
        return np.dtype(x.dtype)
    except TypeError:
        raise TypeError(f"{name}.dtype must be a NumPy dtype, got {x.dtype!r}") from None


def _rows_of(x, lo, hi):
    """The index of rows ``lo:hi`` of every group of ``x (..., N, d)``: a tuple of slices."""
    return (slice(None),) * (len(x.shape) - 2) + (slice(lo, hi), slice(None))


def read_rows(x, lo, hi, name="array"):
    """Rows ``lo:hi`` of every group of the array-like ``x (..., N, d)`` as an ndarray
    ``(..., hi - lo, d)`` in ``x.dtype`` (one ``__getitem__`` call)."""
    a = np.asarray(x[_rows_of(x, lo, hi)], dtype=np.dtype(x.dtype))
    want = tuple(x.shape[:-2]) + (hi - lo, x.shape[-1])
    if a.shape != want:
        raise ValueError(f"{name}[..., {lo}:{hi}, :] returned shape {a.shape}, expected {want}")
    return a


def check_store_input(name, x):
    """An input read block by block: ndarray, np.memmap, row source or array-like
    (``shape``, ``dtype``, ``__getitem__``), float32/64, at least 2 dims ``(..., N, d)``.
    Returns its dtype (it is not copied or cast)."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array (np.memmap, ndarray, zarr.Array, row source or array-like with "
                        f"shape, dtype and __getitem__), got {type(x).__name__}")
    if not (isinstance(x, np.ndarray) or is_row_source(x) or is_array_like(x)):
        raise TypeError(f"{name} must be an np.memmap, ndarray, row source (an object with rows() and "
                        f"checkpoint_key(), e.g. racecpu.apps.ooc_demo.SeededArray) or array-like with "
                        f"__getitem__ (e.g. a zarr.Array), got {type(x).__name__}")
    dt = _np_dtype(name, x)
    if dt not in (np.float32, np.float64):
        raise TypeError(f"{name} must be float32 or float64, got {dt}")
    if len(x.shape) < 2:
        raise ValueError(f"{name} must have at least 2 dims (..., N, d), got shape {tuple(x.shape)}")
    return dt


def check_store_out(name, x, shape, readback=False):
    """An output written block by block: ndarray or np.memmap opened ``'r+'``/``'w+'``,
    writeable, or an array-like with ``__setitem__`` (and ``__getitem__`` if
    ``readback``: a checkpointed run reads the written blocks back), not
    ``read_only`` (a zarr array opened ``'r'``); of exactly ``shape`` and any
    float dtype (results are cast to it).

    Unlike :func:`racecpu._checks.check_out` the dtype is free and aliasing is
    not checked: blocks are computed in buffers and only then stored.
    """
    if not isinstance(x, np.ndarray):
        if not (hasattr(x, "shape") and hasattr(x, "dtype") and callable(getattr(x, "__setitem__", None))):
            raise TypeError(f"{name} must be an np.memmap, ndarray, writable zarr.Array or array-like with shape, "
                            f"dtype and __setitem__, got {type(x).__name__}")
        if readback and not callable(getattr(x, "__getitem__", None)):
            raise TypeError(f"{name} must also have __getitem__ with a checkpoint (its blocks are read back "
                            f"for their checksums), got {type(x).__name__}")
        for attr in ("read_only", "readonly"):
            ro = getattr(x, attr, False)
            if isinstance(ro, (bool, np.bool_)) and ro:
                raise ValueError(f"{name} is a read-only {type(x).__name__} ({attr}=True); open it writable "
                                 f"(e.g. zarr mode 'r+' or 'a')")
    else:
        if isinstance(x, np.memmap) and x.mode not in ("r+", "w+"):
            raise ValueError(f"{name} is an np.memmap opened with mode {x.mode!r}; open it with 'r+' or 'w+'")
        if not x.flags.writeable:
            raise ValueError(f"{name} is read-only")
    dt = _np_dtype(name, x)
    if dt.kind != "f":
        raise TypeError(f"{name} must be a float array, got dtype {dt}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def check_block(block):
    """Tokens per block: an int >= 1."""
    if isinstance(block, (bool, np.bool_)) or not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"block must be an int >= 1, got {block!r}")
    return int(block)


def _zarr_location(x):
    """Where a ``zarr.Array`` lives: ``file://`` and the real path for a local store, else its store URL."""
    sp = getattr(x, "store_path", None)
    store, path = (sp.store, sp.path) if sp is not None else (getattr(x, "store", None), getattr(x, "path", ""))
    root = getattr(store, "root", None)
    if isinstance(root, (str, os.PathLike)):
        return "file://" + os.path.realpath(os.path.join(os.fspath(root), path or ""))
    return str(sp) if sp is not None else f"{type(store).__name__}:{id(store)}/{path}"


def _digest_rows(x):
    """Rows read at a time by :func:`content_digest`: about ``DIGEST_BYTES``, whole zarr chunks."""
    row = max(1, int(np.prod(x.shape[:-2], dtype=np.int64)) * int(x.shape[-1]) * np.dtype(x.dtype).itemsize)
    rows = max(1, DIGEST_BYTES // row)
    chunks = getattr(x, "chunks", None) if is_zarr(x) else None
    if isinstance(chunks, tuple) and len(chunks) == len(x.shape) and int(chunks[-2]) > 0:
        c = int(chunks[-2])
        rows = max(c, rows // c * c)
    return rows


def content_digest(x):
    """SHA-256 of an array-like's contents, read ``(..., rows, d)`` at a time along the
    token axis (:func:`read_rows`), each block's C-order bytes in ``x.dtype`` in turn."""
    h = hashlib.sha256()
    n, rows = int(x.shape[-2]), _digest_rows(x)
    for lo in range(0, n, rows):
        h.update(np.ascontiguousarray(read_rows(x, lo, min(lo + rows, n))).view(np.uint8).reshape(-1))
    return h.hexdigest()


def identity(x, written=False, digest=True):
    """What a checkpoint must match for a resume to be valid.

    A memmap is its file, offset, layout and (unless ``written``: an output,
    which the pass itself changes) the file's size and mtime; an in-RAM array
    is a SHA-256 of its bytes when ``digest`` (a checkpointed run) and its
    ``id`` otherwise; a row source is its ``checkpoint_key()``.  A
    ``zarr.Array`` is its store location, shape and dtype, and as an input
    also its chunks and, when ``digest``, a SHA-256 of its contents; another
    array-like is its type, shape, dtype and, as an input with ``digest``, a
    SHA-256 of its contents, else its ``id``.  The content digests read the
    input once (:func:`content_digest`, bounded memory).
    """
    if is_row_source(x):
        return ["source", type(x).__name__, x.checkpoint_key()]
    if isinstance(x, np.memmap) and isinstance(x.filename, (str, os.PathLike)):  # open_memmap(Path) keeps the Path
        ident = ["memmap", os.path.realpath(os.fspath(x.filename)), int(x.offset), list(x.shape), x.dtype.name,
                 list(x.strides)]
        if not written:
            st = os.stat(os.fspath(x.filename))
            ident += [st.st_size, st.st_mtime_ns]
        return ident
    if isinstance(x, np.ndarray):
        tag = hashlib.sha256(np.ascontiguousarray(x)).hexdigest() if digest and not written else id(x)
        return ["array", list(x.shape), x.dtype.name, tag]
    shape, dtype = [int(s) for s in x.shape], np.dtype(x.dtype).name
    if is_zarr(x):
        ident = ["zarr", _zarr_location(x), shape, dtype]
        if not written:
            chunks = getattr(x, "chunks", None)
            ident.append([int(c) for c in chunks] if isinstance(chunks, tuple) else None)
            if digest:
                ident.append(content_digest(x))
        return ident
    tag = content_digest(x) if digest and not written else id(x)
    return ["arraylike", type(x).__name__, shape, dtype, tag]


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
    ``cdt``, in the buffer ``bufs(name)`` (a :class:`racecpu._memory.Buffers`; valid until that
    name is asked for again).

    An ndarray or row source is read one group at a time, an array-like in one
    ``__getitem__`` call for every group (:func:`read_rows`).
    """
    G = int(np.prod(lead, dtype=np.int64))
    a = bufs(name, (G, hi - lo, x.shape[-1]), cdt)
    if is_array_like(x):
        a[...] = read_rows(x, lo, hi, name).reshape(a.shape)
    else:
        for g in range(G):
            if is_row_source(x):
                a[g] = x.rows(g, lo, hi)
            else:
                a[g] = x[np.unravel_index(g, lead) + (slice(lo, hi),)]
    if check_finite and not np.isfinite(a).all():
        raise ValueError(f"{name} contains NaN or Inf in tokens {lo}:{hi} (pass check_finite=False to skip)")
    return a


def store_block(x, lead, lo, hi, data):
    """Write ``data (G, hi - lo, d)`` into rows ``lo:hi`` of ``x (*lead, N, d)`` (cast to its dtype).

    An ndarray is written one group at a time; an array-like gets one fresh
    array ``(*lead, hi - lo, d)`` in its dtype, in one ``__setitem__`` call.
    """
    if isinstance(x, np.ndarray):
        for g in range(data.shape[0]):
            x[np.unravel_index(g, lead) + (slice(lo, hi),)] = data[g]
    else:
        x[_rows_of(x, lo, hi)] = np.array(data.reshape(tuple(lead) + data.shape[1:]), dtype=np.dtype(x.dtype))


def block_ranges(n, block, reverse=False):
    """``[(lo, hi), ...]`` covering ``0:n`` in steps of ``block`` (last first if ``reverse``)."""
    b = [(lo, min(lo + block, n)) for lo in range(0, n, block)]
    return b[::-1] if reverse else b


# ---------------------------------------------------------------------------
# the scan with optional checkpoints
# ---------------------------------------------------------------------------

def _digest(*arrays):
    """A 128-bit BLAKE2b of the bytes of ``arrays`` (C order), as hex."""
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(np.ascontiguousarray(a).view(np.uint8).reshape(-1))
    return h.hexdigest()


def _json_digest(value):
    return hashlib.blake2b(json.dumps(value, sort_keys=True).encode(), digest_size=16).hexdigest()


def block_digest(outputs, lo, hi):
    """Checksum of rows ``lo:hi`` of every output ``(..., N, d)`` (all groups, their dtypes' bytes);
    an array-like output is read back (:func:`read_rows`)."""
    return _digest(*(x[..., lo:hi, :] if isinstance(x, np.ndarray) else read_rows(x, lo, hi) for x in outputs))


def _open_state(path, shape):
    """A state file checked before use: a regular file holding a C-order little-endian
    float64 ``.npy`` of exactly ``shape`` and exactly its size (never zero-extended).

    Returns ``(offset, read-only memmap)``; raises ``ValueError`` saying what is wrong.
    """
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} is not a regular file")
    with open(path, "rb") as fh:
        try:
            version = np.lib.format.read_magic(fh)
            read = {(1, 0): np.lib.format.read_array_header_1_0,
                    (2, 0): np.lib.format.read_array_header_2_0}.get(version)
            if read is None:
                raise ValueError(f".npy version {version}")
            hshape, fortran, dtype = read(fh)
        except Exception as e:  # numpy parses the header with ast: a damaged one raises SyntaxError, TokenError...
            raise ValueError(f"{path} has a damaged .npy header ({type(e).__name__}: {e})") from None
        offset = fh.tell()
    if dtype != np.dtype("<f8") or fortran or tuple(hshape) != tuple(shape):
        raise ValueError(f"{path} holds {dtype} {hshape} (fortran={fortran}), expected float64 {tuple(shape)}")
    want = offset + 8 * int(np.prod(shape, dtype=np.int64))
    if st.st_size != want:
        raise ValueError(f"{path} has {st.st_size} bytes, expected {want} (truncated or extended)")
    return offset, np.memmap(path, mode="r", dtype="<f8", shape=tuple(shape), offset=offset)


def _discard(path):
    """Remove ``path`` if it is anything but a regular file (a link, folder with its
    contents, FIFO...): the checkpoint's own names are then written afresh, never through it."""
    if os.path.lexists(path) and (os.path.islink(path) or not os.path.isfile(path)):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


class Scan:
    """One pass over ``nb`` blocks carrying float64 arrays of ``shapes`` and a scalar.

    ``states[i]`` is the carried state before the i-th processed block
    (``states[nb]`` the final one).  Without a checkpoint ``directory`` they
    live in RAM.  With one, they live in ``{name}.state{i}.npy`` files there
    and ``{name}.json`` (the manifest) records ``key``, how many blocks are
    done, the scalar, a checksum of each recorded state row and of each done
    block's outputs, and a checksum of the manifest itself.

    A resume trusts nothing on disk: the manifest's checksum and key, each
    state file's header and exact size (opened read-only first, never
    zero-extended), the checksum of every recorded state row and (in
    :func:`run`, which knows the outputs) of every done block's outputs are
    checked, and on any mismatch the pass restarts from the first block with
    a :class:`CheckpointWarning` that says why.  A folder, link or special
    file where the manifest or a state file belongs counts as damaged: the
    restart removes it (a folder with its contents) and writes the file.
    Checking every done block's outputs costs one read of what the pass has
    written so far, far less than the pass (which reads the larger inputs
    and computes), and is the only check that sees a file reopened ``'w+'``,
    truncated, or partly overwritten: boundary rows or file identity (path,
    inode, mtime) would not see the last.
    """

    def __init__(self, directory, name, key, nb, shapes, commit_every=0.0):
        self.name, self.nb, self.dir = name, nb, directory
        self.commit_every, self._last = float(commit_every), time.monotonic()
        self.key = json.loads(json.dumps(dict(key, version=FORMAT_VERSION, pass_=name, blocks=nb)))
        self.done, self.scalar = 0, 0.0
        self.shapes = [(nb + 1,) + tuple(s) for s in shapes]
        self.state_sums, self.out_sums = [], []
        if directory is None:
            self.states = [np.zeros(s) for s in self.shapes]
            return
        os.makedirs(directory, exist_ok=True)
        self.manifest = os.path.join(directory, f"{name}.json")
        self.paths = [os.path.join(directory, f"{name}.state{i}.npy") for i in range(len(shapes))]
        reason = self._resume()
        if reason is not None:
            self.restart(reason)

    def _resume(self):
        """Take up the recorded progress if everything checks; else the reason why not (None: resumed)."""
        try:
            st = os.stat(self.manifest)
        except OSError:
            return ""  # no checkpoint yet: a first run, nothing to warn about
        try:
            if not stat.S_ISREG(st.st_mode) or st.st_size > 2 ** 30:
                raise ValueError("not a regular file of a sane size")
            with open(self.manifest, "rb") as fh:
                rec = json.loads(fh.read().decode())
            if not isinstance(rec, dict) or rec.get("sum") != _json_digest({k: v for k, v in rec.items()
                                                                           if k != "sum"}):
                raise ValueError("its checksum does not match its contents")
        except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            return f"the manifest is unreadable or damaged ({e})"
        if rec.get("key") != self.key:
            old = rec.get("key") if isinstance(rec.get("key"), dict) else {}
            diff = sorted(k for k in set(old) | set(self.key) if old.get(k) != self.key.get(k))
            return f"it was written for other arguments (differing: {', '.join(diff)})"
        done, scalar, ssums, osums = (rec.get(k) for k in ("done", "scalar", "states", "outputs"))
        if not (isinstance(done, int) and not isinstance(done, bool) and 0 <= done <= self.nb
                and isinstance(scalar, float) and isinstance(ssums, list) and isinstance(osums, list)
                and len(ssums) == done + 1 and len(osums) == done
                and all(isinstance(x, str) for x in ssums + osums)):
            return "the manifest's fields are inconsistent"
        try:
            opened = [_open_state(p, s) for p, s in zip(self.paths, self.shapes)]
        except (OSError, ValueError) as e:
            return f"a state file is missing or damaged ({e})"
        for i in range(done + 1):
            if _digest(*(m[i] for _, m in opened)) != ssums[i]:
                return f"state row {i} does not match its checksum"
        # checked and of the right size: writable from here on (r+ cannot extend it)
        self.states = [np.memmap(p, mode="r+", dtype="<f8", shape=s, offset=off)
                       for p, s, (off, _) in zip(self.paths, self.shapes, opened)]
        self.done, self.scalar, self.state_sums, self.out_sums = done, scalar, ssums, osums
        return None

    def restart(self, reason=""):
        """Forget any progress: warn with ``reason`` (if any), invalidate the manifest first,
        then recreate the state files and commit zero blocks done."""
        if reason:
            warnings.warn(f"checkpoint {self.manifest}: {reason}; pass {self.name!r} restarts from the first block",
                          CheckpointWarning, stacklevel=3)
        _discard(self.manifest)
        if os.path.lexists(self.manifest):
            os.remove(self.manifest)
        for p in self.paths:  # a link, folder or special file is replaced, not written through
            _discard(p)
        self.states = [np.lib.format.open_memmap(p, mode="w+", dtype=np.float64, shape=s)
                       for p, s in zip(self.paths, self.shapes)]
        self.done, self.scalar = 0, 0.0
        self.state_sums, self.out_sums = [_digest(*(s[0] for s in self.states))], []
        self._commit()

    def verify_outputs(self, blocks, outputs):
        """Check every done block's outputs against its checksum; restart the pass if one differs."""
        if self.dir is None:
            return
        for i in range(self.done):
            if block_digest(outputs, *blocks[i]) != self.out_sums[i]:
                lo, hi = blocks[i]
                self.restart(f"the outputs of done block {i} (tokens {lo}:{hi}) do not match their checksum "
                             f"(an output file reopened 'w+', truncated or changed)")
                return

    def digest(self):
        """Checksum of this pass's recorded states and outputs (None without a checkpoint):
        what a later pass that uses its state must match."""
        if self.dir is None:
            return None
        return _json_digest([self.state_sums, self.out_sums])

    @property
    def complete(self):
        return self.done == self.nb

    def state(self, i):
        return [np.array(s[i]) for s in self.states]

    def record(self, new_state, scalar, outputs, lo, hi):
        """After block ``done`` (tokens ``lo:hi``) is written: store the state and the
        checksums of it and of the block's outputs; commit at most every ``commit_every`` s.

        A commit flushes the outputs (memmaps, and array-likes with a
        ``flush()``) and states to disk and only then replaces the manifest,
        so a recorded block is always on disk; blocks after the last commit
        are recomputed by a rerun.
        """
        i = self.done + 1
        for s, a in zip(self.states, new_state):
            s[i] = a
        if self.dir is not None:
            self.state_sums = self.state_sums[:i] + [_digest(*(s[i] for s in self.states))]
            self.out_sums = self.out_sums[:i - 1] + [block_digest(outputs, lo, hi)]
        self.scalar = scalar
        self.done = i
        if self.dir is not None and (self.complete or time.monotonic() - self._last >= self.commit_every):
            for x in outputs:
                if isinstance(x, np.memmap) or (not isinstance(x, np.ndarray)
                                                and callable(getattr(x, "flush", None))):
                    x.flush()
            for s in self.states:
                s.flush()
            self._commit()
            self._last = time.monotonic()
        release_pages(*self.states)

    def _commit(self):
        rec = dict(key=self.key, done=self.done, scalar=float(self.scalar), complete=self.complete,
                   states=self.state_sums, outputs=self.out_sums)
        rec["sum"] = _json_digest(rec)
        tmp = self.manifest + ".tmp"
        _discard(tmp)  # a link there would be written through
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
    scan.verify_outputs(blocks, outputs)
    bar, owned = _bar(progress, scan.nb, desc)
    try:
        if bar is not None and scan.done:  # blocks done by an earlier, interrupted run
            getattr(bar, "resumed", bar.update)(scan.done)
        while not scan.complete:
            lo, hi = blocks[scan.done]
            new_state, ds = body(lo, hi, scan.state(scan.done))
            scan.record(new_state, scan.scalar + ds, outputs, lo, hi)
            release_pages(*inputs, *outputs)
            if bar is not None:
                bar.update(1)
    finally:
        if owned:
            bar.close()
    return scan.state(scan.nb), scan.scalar

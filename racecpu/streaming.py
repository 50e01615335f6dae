"""Streaming (decode) RACE attention: a causal state of constant size.

Causal RACE attention reads, for query ``i``, the sketch of every key ``j <= i``:
``A = sum_j phi(K_j)`` (F,) and ``B = sum_j phi(K_j) V_j^T`` (F, dv), with
``F = L * 2**P``.  That pair is the whole memory of the past, so a decoder only
keeps ``(A, B)`` per (batch, head) -- ``L * R * (dv + 1)`` numbers whatever
the context length -- and each new token costs ``O(L * R * dv + L * P * d)``.

Precision.  The state ``(A, B)`` is always float64, whatever the compute
dtype, so it does not drift over millions of tokens.  Within one call the new
tokens are hashed and summed in the compute dtype in chunks of at most
``racecpu.config.CHUNK`` tokens, each chunk starting from the float64
state cast to the compute dtype -- exactly as :func:`racecpu.race_attention`
does -- and chunk totals are added to the state in float64 (both are the
engine's causal block, :func:`racecpu.engine.advance`).  Any split of a
sequence into ``extend``/``step`` calls therefore equals one causal
``race_attention`` over the whole sequence up to rounding (float64: ~1e-15;
float32: ~1e-6 relative), and saving then resuming a stream is bit for bit the
same as never stopping (the float64 state is stored exactly).
"""

from __future__ import annotations

import errno
import math
import os
import secrets
import stat
import threading
import zipfile

import numpy as np
from numpy.typing import ArrayLike, DTypeLike
from numpy.lib import format as npformat

from . import _fork
from . import engine
from ._checks import check_beta, check_planes, prepare
from ._memory import Buffers, physical_memory

__all__ = ["RaceState", "FORMAT", "FORMAT_VERSION"]

#: Tag and version stored in every saved state; :meth:`RaceState.load`
#: refuses anything else.
FORMAT = "racecpu.RaceState"
FORMAT_VERSION = 1

#: The largest token count :meth:`RaceState.load` accepts (far beyond any real stream;
#: a larger one is a damaged or hostile file).
_MAX_COUNT = 2 ** 62

_KEYS = ("format", "version", "planes", "beta", "dtype", "batch_shape", "count", "A", "B")


class RaceState:
    """Causal RACE attention state for streaming and autoregressive decoding.

    Parameters
    ----------
    planes : array_like, shape (L, P, d)
        Hyperplanes (e.g. from :func:`racecpu.hyperplanes`), cast to ``dtype``.
    beta : float
        Soft-hash temperature (> 0).
    batch_shape : tuple of int, or int, default ()
        Leading (batch, head) dims of every input: non-negative Python or
        NumPy integers (not bools; any other entry raises TypeError, a
        negative one ValueError); an int ``n`` means ``(n,)``.
    dv : int
        Value dimension.
    kv_heads : int, optional
        Grouped-query attention: k and v have ``kv_heads`` heads on the last
        axis of ``batch_shape`` (q has ``batch_shape[-1]``, a multiple >= 1), and
        the state is kept once per key/value head (``batch_shape[-1] //
        kv_heads`` times smaller), read by each of its query heads.
    dtype : {float32, float64}, default float32
        Compute dtype: inputs are cast to it and outputs returned in it.  The
        carried state is float64 regardless (see the module docstring).

    Attributes
    ----------
    A : ndarray, shape kv_batch_shape + (F,), float64
        Sum of the soft buckets of every key seen so far (a copy);
        ``kv_batch_shape`` is ``batch_shape`` with ``kv_heads`` heads.
    B : ndarray, shape kv_batch_shape + (F, dv), float64
        Sum of ``phi(k) v^T`` over every key seen so far (a copy).
    count : int
        Number of tokens seen so far (the same for every batch element).

    Examples
    --------
    >>> import numpy as np, racecpu
    >>> from racecpu.streaming import RaceState
    >>> W = racecpu.hyperplanes(16)
    >>> x = np.random.default_rng(0).standard_normal((2, 10, 16), dtype=np.float32)
    >>> st = RaceState(W, 8.0, batch_shape=(2,), dv=16)
    >>> o1 = st.extend(x[:, :7], x[:, :7], x[:, :7])
    >>> o2 = st.step(x[:, 7], x[:, 7], x[:, 7])          # one token: shape (2, 16)
    >>> full = racecpu.race_attention(x[:, :8], x[:, :8], x[:, :8], W, 8.0, causal=True)
    >>> bool(np.allclose(o2, full[:, 7], atol=1e-5)), st.count
    (True, 8)
    """

    def __init__(self, planes: ArrayLike, beta: float, *, batch_shape: tuple[int, ...] | int = (), dv: int,
                 dtype: DTypeLike = np.float32, kv_heads: int | None = None):
        self._configure(planes, beta, batch_shape, dv, dtype, kv_heads)
        G, F = math.prod(self._kv_shape), self._F
        self._A = np.zeros((G, F))
        self._B = np.zeros((G, F, int(dv)))
        self._count = 0

    def _configure(self, planes, beta, batch_shape, dv, dtype, kv_heads):
        """Check the arguments and set everything but the state (``load`` checks a file's
        arrays against this before taking them, so nothing is allocated from its sizes)."""
        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise TypeError(f"dtype must be float32 or float64, got {dtype}")
        p = np.asarray(planes)
        if p.ndim != 3:
            raise ValueError(f"planes must have shape (L, P, d), got shape {p.shape}")
        self._planes = check_planes(p, p.shape[2], dtype)
        self._planes.flags.writeable = False
        self._beta = check_beta(beta)
        self._batch_shape = _check_shape("batch_shape", batch_shape)
        if isinstance(dv, (bool, np.bool_)) or not isinstance(dv, (int, np.integer)) or dv < 1:
            raise ValueError(f"dv must be an int >= 1, got {dv!r}")
        self._dtype = dtype
        self._kv_shape, self._group = self._batch_shape, 1
        if kv_heads is not None:
            heads = self._batch_shape[-1] if self._batch_shape else None
            # heads == 0: 0 % kv_heads == 0, but no group size would do (0 query heads per kv head)
            if (isinstance(kv_heads, (bool, np.bool_)) or not isinstance(kv_heads, (int, np.integer))
                    or not heads or kv_heads < 1 or heads % kv_heads):
                got = "no head axis" if heads is None else f"{heads} query heads"
                raise ValueError(f"kv_heads must divide the head axis (the last of batch_shape "
                                 f"{self._batch_shape}) into groups of at least one query head, got {got} "
                                 f"and kv_heads={kv_heads!r}")
            self._kv_shape = self._batch_shape[:-1] + (int(kv_heads),)
            self._group = heads // int(kv_heads)
        L, P, _ = self._planes.shape
        self._F = L * 2 ** P
        G = math.prod(self._kv_shape)  # Python ints: no int64 wrap-around
        nbytes = G * self._F * (int(dv) + 1) * 8
        if nbytes > _max_state_bytes():
            raise ValueError(f"a state of batch_shape {self._batch_shape}, {self._F} buckets and dv={int(dv)} "
                             f"needs {nbytes} bytes, more than this machine's memory ({_max_state_bytes()} bytes)")

    # -- read-only properties -------------------------------------------------
    planes = property(lambda self: self._planes, doc="Hyperplanes (L, P, d) in the compute dtype.")
    beta = property(lambda self: self._beta, doc="Soft-hash temperature.")
    batch_shape = property(lambda self: self._batch_shape, doc="Leading dims of q (and of k, v unless grouped).")
    kv_batch_shape = property(lambda self: self._kv_shape, doc="Leading dims of k and v (and of the state).")
    dtype = property(lambda self: self._dtype, doc="Compute dtype.")
    count = property(lambda self: self._count, doc="Tokens seen so far.")

    @property
    def dv(self):
        return self._B.shape[2]

    @property
    def head_dim(self):
        return self._planes.shape[2]

    @property
    def A(self):
        return self._A.reshape(self._kv_shape + self._A.shape[1:]).copy()

    @property
    def B(self):
        return self._B.reshape(self._kv_shape + self._B.shape[1:]).copy()

    @property
    def nbytes(self):
        """Bytes of the carried state (independent of the context length)."""
        return self._A.nbytes + self._B.nbytes

    def __repr__(self):
        L, P, d = self._planes.shape
        return (f"RaceState(L={L}, P={P}, d={d}, dv={self.dv}, beta={self._beta}, "
                f"batch_shape={self._batch_shape}, "
                + (f"kv_heads={self._kv_shape[-1]}, " if self._group > 1 else "")
                + f"dtype={self._dtype.name}, count={self._count})")

    def copy(self) -> RaceState:
        """An independent copy (same planes, beta, state and count)."""
        new = object.__new__(RaceState)
        new.__dict__.update(self.__dict__)
        new.__dict__.pop("_work", None)
        new._A, new._B = self._A.copy(), self._B.copy()
        return new

    # -- streaming --------------------------------------------------------------
    def extend(self, q: ArrayLike, k: ArrayLike, v: ArrayLike, *, check_finite: bool = True) -> np.ndarray:
        """Causal RACE attention of a block of new tokens given everything before.

        Parameters
        ----------
        q : array_like, shape batch_shape + (n, d)
        k : array_like, shape kv_batch_shape + (n, d)
        v : array_like, shape kv_batch_shape + (n, dv)
        check_finite : bool, default True
            Raise ValueError on NaN/Inf (a NaN would poison the state forever).

        Returns
        -------
        out : ndarray, shape batch_shape + (n, dv), in the compute dtype
            Row ``i`` attends to every earlier token and to new tokens ``<= i``.
            The state then includes the n new keys.
        """
        q, k, v = (self._cast(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
        a = prepare(q, k, v, self._planes, self._beta, True, None, check_finite, grouped=True)
        if a.lead != self._batch_shape or k.shape[:-2] != self._kv_shape:
            raise ValueError(f"inputs have leading dims q {a.lead}, k {k.shape[:-2]} but the state has batch_shape "
                             f"{self._batch_shape}" + (f" and kv_batch_shape {self._kv_shape}" if self._group > 1
                                                       else ""))
        if a.v.shape[2] != self.dv:
            raise ValueError(f"v has value dim {a.v.shape[2]} but the state has dv={self.dv}")
        G, n, _ = a.q.shape
        out = np.zeros((G, n, self.dv), self._dtype)
        if G and n:
            step = engine.advance(a.q, a.k, a.v, self._planes, self._beta, self._A, self._B, out, keep=())
            self._A, self._B = step.A, step.B
        self._count += n
        return out.reshape(self._batch_shape + (n, self.dv))

    def step(self, q: ArrayLike, k: ArrayLike, v: ArrayLike, *, check_finite: bool = True) -> np.ndarray:
        """One new token: ``q`` of shape batch_shape + (d,), ``k`` kv_batch_shape + (d,), ``v``
        kv_batch_shape + (dv,).

        Returns the attention output, shape batch_shape + (dv,).  Same as
        ``extend`` with a block of one token.
        """
        _fork.check()  # a state built before a fork steps without check_array
        q, k, v = (self._cast(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
        want = {"q": self._batch_shape + (self.head_dim,), "k": self._kv_shape + (self.head_dim,),
                "v": self._kv_shape + (self.dv,)}
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.shape != want[name]:
                where = "batch_shape" if name == "q" or self._group == 1 else "kv_batch_shape"
                raise ValueError(f"{name} must have shape {where} + ({'dv' if name == 'v' else 'd'},) = "
                                 f"{want[name]}, got {x.shape}")
            if check_finite and not np.isfinite(x).all():
                raise ValueError(f"{name} contains NaN or Inf (pass check_finite=False to skip this check)")
        Gk = self._A.shape[0]
        G = Gk * self._group
        if G:
            # C-contiguous like extend's inputs, so a view (q[..., i, :]) runs the same compiled code
            q, k, v = (np.ascontiguousarray(x.reshape(n, 1, -1)) for x, n in ((q, G), (k, Gk), (v, Gk)))
            out = self._step(q, k, v)
        else:
            out = np.empty((0, self.dv), self._dtype)
        self._count += 1
        return out.reshape(self._batch_shape + (self.dv,))

    def _step(self, q, k, v):
        """:func:`racecpu.engine.advance` of one token, its buffers reused from step to step."""
        work = self.__dict__.get("_work")
        if work is None:
            work = self._work = Buffers()
        out = np.empty((q.shape[0], 1, self.dv), self._dtype)
        step = engine.advance(q, k, v, self._planes, self._beta, self._A, self._B, out, keep=(), work=work)
        self._A, self._B = step.A, step.B
        return out

    def set_state(self, A: ArrayLike, B: ArrayLike, count: int = 0) -> None:
        """Continue the stream from the state ``(A, B)`` of ``count`` tokens (stored as float64 copies).

        ``A`` of shape ``kv_batch_shape + (F,)``, ``B`` of ``kv_batch_shape + (F,
        dv)``, as the properties :attr:`A` and :attr:`B` give them (e.g. another
        state's, or a :class:`racecpu.Sketch`'s flattened over its tables).
        """
        G, F = self._A.shape
        A, B = np.asarray(A, dtype=np.float64), np.asarray(B, dtype=np.float64)
        if A.shape != self._kv_shape + (F,) or B.shape != self._kv_shape + (F, self.dv):
            raise ValueError(f"the state needs A of shape {self._kv_shape + (F,)} and B of shape "
                             f"{self._kv_shape + (F, self.dv)}, got {A.shape} and {B.shape}")
        if isinstance(count, (bool, np.bool_)) or not isinstance(count, (int, np.integer)) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        self._A, self._B = A.reshape(G, F).copy(), B.reshape(G, F, self.dv).copy()
        self._count = int(count)

    def _cast(self, name, x):
        x = np.asarray(x)
        if x.dtype.kind != "f":
            raise TypeError(f"{name} must be a float array, got dtype {x.dtype}")
        return x.astype(self._dtype, copy=False)

    # -- persistence ------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write the state to ``path`` (npz), atomically.

        The file is written under a unique temporary name in the same
        directory, flushed to disk and renamed over ``path``, so concurrent
        saves from threads or processes never interleave and a reader sees
        either the old file or a complete new one.

        The file holds a format tag and version, the planes, beta, dtype,
        batch_shape, the token count and the float64 state, so a loaded state
        resumes the stream bit for bit.
        """
        path = os.fspath(path)
        data = dict(format=np.array(FORMAT), version=np.array(FORMAT_VERSION), planes=self._planes,
                    beta=np.array(self._beta), dtype=np.array(self._dtype.name),
                    batch_shape=np.array(self._batch_shape, dtype=np.int64), count=np.array(self._count),
                    A=self._A, B=self._B)
        if self._group > 1:
            data["kv_heads"] = np.array(self._kv_shape[-1], dtype=np.int64)
        _write_atomic(path, lambda fh: np.savez(fh, **data))

    @classmethod
    def load(cls, path: str | os.PathLike, *, planes: ArrayLike | None = None,
             beta: float | None = None) -> RaceState:
        """Read a state written by :meth:`save`.

        Parameters
        ----------
        path : str or path-like
        planes, beta : optional
            The hyperplanes and temperature the caller will use; if given they
            must equal the stored ones exactly (after casting to the stored
            dtype), since a state built with other planes would give silently
            wrong outputs.

        Raises
        ------
        ValueError
            If the file is not a regular file (a FIFO or device is refused
            without reading it), truncated or corrupt, of another format or
            version, inconsistent, declares entries larger than a state of its
            shape (or than this machine's memory) holds, holds a state with
            NaN or Inf or a token count outside ``[0, 2**62]``, or was
            made with other planes/beta than those passed.  Nothing is read
            beyond the sizes the stored shapes allow, and nothing is allocated
            for the state until its stored arrays have been read and found to
            have the shapes the stored planes and batch_shape give.  The
            message names the file and the offending field.
        """
        path = os.fspath(path)
        try:
            fh = _open_regular(path)
        except OSError as exc:
            raise ValueError(f"cannot read RaceState file {path!r}: {exc}") from None
        try:
            with fh:
                d = _read_state(fh)
        except _Invalid as exc:
            raise ValueError(f"{path!r}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 -- whatever a damaged zip or .npy raises (zlib, struct, ...)
            raise ValueError(f"{path!r} is not a valid RaceState file (truncated or corrupt?): "
                             f"{type(exc).__name__}: {exc}") from None
        # Every check runs before the state is taken, and nothing is allocated from the stored
        # sizes: A and B must have the shapes the stored planes and batch_shape give, so their
        # bytes were all in the file (dv, read off B's shape, included).
        st = cls.__new__(cls)
        try:
            dtype = np.dtype(str(d["dtype"]))
            kv = d.get("kv_heads")
            A, B = d["A"], d["B"]
            st._configure(d["planes"], float(d["beta"]), tuple(int(s) for s in d["batch_shape"]),
                          int(B.shape[-1]), dtype, None if kv is None else int(kv))
            G, F = math.prod(st._kv_shape), st._F
            for name, x, want in (("A", A, (G, F)), ("B", B, (G, F, int(B.shape[-1])))):
                if x.shape != want or x.dtype != np.float64:
                    raise _Invalid(f"inconsistent RaceState file: field {name} is {x.dtype} of shape {x.shape}, "
                                   f"but planes {st._planes.shape} and batch_shape {st._batch_shape}"
                                   + (f" (kv_heads {st._kv_shape[-1]})" if st._group > 1 else "")
                                   + f" need float64 of shape {want}")
            if d["planes"].dtype != dtype:
                raise _Invalid(f"inconsistent RaceState file: field planes is {d['planes'].dtype}, "
                               f"but field dtype says {dtype}")
            for name, x in (("A", A), ("B", B)):
                if not np.isfinite(x).all():
                    raise _Invalid(f"corrupt RaceState file: field {name} contains NaN or Inf")
            count = int(d["count"])
            if not 0 <= count <= _MAX_COUNT:
                raise _Invalid(f"corrupt RaceState file: field count holds the token count {count}, "
                               f"not in [0, {_MAX_COUNT}]")
        except _Invalid as exc:
            raise ValueError(f"{path!r}: {exc}") from None
        except (ValueError, TypeError, OverflowError) as exc:  # the constructor's checks of what was stored
            raise ValueError(f"{path!r}: inconsistent RaceState file: {exc}") from None
        if planes is not None:
            p = np.asarray(planes)
            if p.shape != st._planes.shape or not np.array_equal(p.astype(dtype), st._planes):
                raise ValueError(f"{path!r} was saved with different planes than those passed "
                                 f"(stored shape {st._planes.shape}, passed {p.shape})")
        if beta is not None and check_beta(beta) != st._beta:
            raise ValueError(f"{path!r} was saved with beta={st._beta}, but beta={beta} was passed")
        st._A = np.ascontiguousarray(A)
        st._B = np.ascontiguousarray(B)
        st._count = count
        return st


def _write_atomic(path, write):
    """Write ``path`` through ``write(fh)`` on a unique temporary file in its
    directory: flush, fsync, rename over ``path``, then fsync the directory
    (where the platform allows) so the rename itself is durable."""
    directory = os.path.dirname(os.path.abspath(path))
    # Unique per call (pid, thread and random token); O_EXCL never reuses a name; mode 0o666 less the
    # umask, as open() would give (mkstemp's 0o600 would change the saved file's permissions).
    tmp = f"{path}.{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:  # Windows cannot open a directory
        return
    try:
        os.fsync(dfd)
    except OSError:  # some file systems do not sync directories
        pass
    finally:
        os.close(dfd)


#: Bytes of one .npy header that :func:`_read_state` accepts (NumPy writes < 200 here).
_HEADER_BYTES = 1 << 16
#: Bytes of the small entries (format tag, version, beta, dtype, batch_shape, count).
_SMALL_BYTES = 4096
#: Compressed entries (``save`` never writes one) may expand to at most this many bytes.
_MAX_INFLATED = 64 << 20


def _max_state_bytes():
    """The largest state :class:`RaceState` builds or loads: the machine's physical memory."""
    return physical_memory()


def _open_regular(path):
    """``path`` opened for binary reading if it is a regular file; OSError otherwise.

    A FIFO, device (``/dev/zero``) or directory is refused before it is read:
    stat first, then open without blocking (a FIFO swapped in between does not
    hang the open) and check the opened file again."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise OSError(errno.EINVAL, "not a regular file")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _read_entry(zf, names, key, max_bytes, kinds, ndim=None):
    """One .npy entry of a saved state, reading at most ``max_bytes`` of data.

    The entry's declared size is checked before it is opened, and the shape in
    its header (product in Python ints) before its data are read, so a damaged
    or hostile file cannot make this read or allocate more than a state of the
    accepted shape holds.  Reading the data to its end checks the CRC-32."""
    info = zf.getinfo(names[key])
    if info.compress_type != zipfile.ZIP_STORED and info.file_size > _MAX_INFLATED:
        raise _Invalid(f"corrupt RaceState file: compressed entry {key} declares {info.file_size} bytes")
    if info.file_size > max_bytes + _HEADER_BYTES:
        raise _Invalid(f"inconsistent or corrupt RaceState file: entry {key} declares {info.file_size} bytes, "
                       f"more than the {max_bytes} it can hold")
    with zf.open(info) as f:
        version = npformat.read_magic(f)
        if version == (1, 0):
            shape, fortran, dt = npformat.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dt = npformat.read_array_header_2_0(f)
        else:
            raise _Invalid(f"corrupt RaceState file: entry {key} has .npy version {version}")
        if dt.hasobject or dt.kind not in kinds or (ndim is not None and len(shape) != ndim):
            raise _Invalid(f"inconsistent or corrupt RaceState file: entry {key} has dtype {dt} and "
                           f"shape {shape}")
        nbytes = math.prod(shape) * dt.itemsize
        if nbytes > max_bytes:
            raise _Invalid(f"inconsistent or corrupt RaceState file: entry {key} has shape {shape} "
                           f"({nbytes} bytes), more than the {max_bytes} bytes it can hold")
        data = bytearray()  # writable, so the loaded state's arrays are; grows only as data arrive
        while len(data) < nbytes:
            chunk = f.read(min(nbytes - len(data), 1 << 24))
            if not chunk:
                break
            data += chunk
        if len(data) != nbytes or f.read(1):
            raise _Invalid(f"corrupt RaceState file: entry {key}'s data do not match its shape {shape}")
    x = np.frombuffer(data, dt) if nbytes else np.zeros(0, dt)
    return x.reshape(shape, order="F" if fortran else "C")


def _read_state(fh):
    """The entries of a saved state (``_KEYS``) from an open file, bounded as
    :func:`_read_entry` says; raises ``_Invalid`` or whatever the zip or .npy
    parsing raises."""
    with zipfile.ZipFile(fh) as zf:
        names = {}
        for name in zf.namelist():  # np.savez names entries key + ".npy"
            if name.endswith(".npy"):
                names.setdefault(name[:-4], name)
        if "format" in names:
            tag = _read_entry(zf, names, "format", _SMALL_BYTES, "U", 0)
            if str(tag) != FORMAT:
                raise _Invalid(f"not a RaceState file (format tag {str(tag)!r})")
        missing = [key for key in _KEYS if key not in names]
        if missing:
            raise _Invalid(f"missing entries {missing}")
        version = _read_entry(zf, names, "version", _SMALL_BYTES, "iu", 0)
        if int(version) != FORMAT_VERSION:
            raise _Invalid(f"format version {int(version)}, but this racecpu reads version "
                           f"{FORMAT_VERSION} only")
        d = dict(format=tag, version=version)
        d["dtype"] = _read_entry(zf, names, "dtype", _SMALL_BYTES, "U", 0)
        d["beta"] = _read_entry(zf, names, "beta", _SMALL_BYTES, "f", 0)
        d["count"] = _read_entry(zf, names, "count", _SMALL_BYTES, "iu", 0)
        d["batch_shape"] = _read_entry(zf, names, "batch_shape", _SMALL_BYTES, "iu", 1)
        limit = _max_state_bytes()
        d["planes"] = planes = _read_entry(zf, names, "planes", limit, "f", 3)
        L, P, _ = planes.shape
        batch_shape = [int(s) for s in d["batch_shape"]]
        if any(s < 0 for s in batch_shape) or P > 62:
            raise _Invalid(f"inconsistent RaceState file: batch_shape {batch_shape}, planes {planes.shape}")
        nA = math.prod(batch_shape) * L * 2 ** P * 8  # Python ints: no int64 wrap-around
        if nA > limit:
            raise _Invalid(f"inconsistent RaceState file: batch_shape {tuple(batch_shape)} and planes "
                           f"{planes.shape} need a {nA}-byte state, more than this machine's memory")
        if "kv_heads" in names:  # a grouped-query state
            d["kv_heads"] = _read_entry(zf, names, "kv_heads", _SMALL_BYTES, "iu", 0)
        d["A"] = _read_entry(zf, names, "A", nA, "f", 2)
        d["B"] = _read_entry(zf, names, "B", limit - nA, "f", 3)
        return d


class _Invalid(Exception):
    pass


def _is_int(x):
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_shape(name, shape):
    """``shape`` as a tuple of Python ints: an int, or a sequence of Python or NumPy
    integers (not bools, floats or strings), each >= 0."""
    entries = (shape,) if _is_int(shape) else \
        tuple(shape) if np.iterable(shape) and not isinstance(shape, (str, bytes)) else None
    if entries is None or not all(_is_int(s) for s in entries):
        raise TypeError(f"{name} must be a tuple of non-negative ints (or one int), got {shape!r}")
    if any(s < 0 for s in entries):
        raise ValueError(f"{name} must be a tuple of non-negative ints, got {shape!r}")
    return tuple(int(s) for s in entries)

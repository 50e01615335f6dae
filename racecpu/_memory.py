"""Resident-memory readings of this process (used by the demo, out-of-core runs and the
benchmarks) and the pool that reuses the memory of racecpu's large results."""

from __future__ import annotations

import ctypes
import math
import mmap
import errno
import os
import threading
import warnings
import weakref

import numpy as np


def proc_status(field):
    """Bytes of a ``/proc/self/status`` field (``VmRSS``, ``VmHWM``), or None off Linux."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss():
    """Peak resident set size in bytes: VmHWM (resettable), else ru_maxrss, else None."""
    hwm = proc_status("VmHWM")
    if hwm is not None:
        return hwm
    try:
        import resource  # not on Windows: imported here so that importing racecpu does not need it
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss():
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------
# the pool of racecpu's large results
# ---------------------------------------------------------------------------

def physical_memory():
    """Bytes of physical memory (8 GiB where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 8 << 30


class _Block:
    """An anonymous mapping the pool hands out; each hand-out is a *lease*, a
    ctypes view of it that every array made from it keeps alive."""

    __slots__ = ("mem", "size", "lease_type", "idle", "last", "advised")

    def __init__(self, size, call):
        self.size = size
        try:
            self.mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)  # private: MADV_FREE needs it
        except OSError as exc:  # ENOMEM: out of address space (ulimit -v) or memory, as np.empty would say
            if exc.errno == errno.ENOMEM:
                raise MemoryError(f"racecpu cannot allocate {size} bytes for a result: {exc}") from None
            raise
        try:  # what NumPy asks for its own large arrays
            self.mem.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):  # no transparent huge pages here
            pass
        self.lease_type = type("_Lease", (ctypes.c_char * size,), {})
        self.idle, self.last, self.advised = False, call, False


class BufferPool:
    """Reuses the memory of racecpu's large results once the caller has dropped them.

    NumPy hands a large array's pages back to the kernel when it is freed, so
    every call on long inputs faults its results (``out``, ``dq``, ``dk``,
    ``dv`` and the residuals) in afresh.  On a VM that returns freed memory to
    its host that cost more than the kernels did (README, "Memory").  The pool
    hands out arrays on blocks it keeps.  Every array made from a hand-out
    (views, reshapes, memoryviews) keeps its lease alive; when the last one
    dies the block is idle, and the next request of about its size (at most
    25% larger) reuses it.  An idle block's pages are marked ``MADV_FREE``:
    the kernel may take them back when memory runs short (a later write then
    faults fresh pages in, as without the pool), and otherwise they are
    reused as they are.  Blocks of at least ``ADVISE_NOW_BYTES`` are marked
    when they fall idle; smaller ones at the first :meth:`tick` that finds
    them idle for ``ADVISE_AFTER_CALLS`` calls, so that the blocks a loop of
    calls hands back and asks for again skip the system call and the TLB
    flush it costs (a few percent of a call of 4,096 tokens; the
    performance log's "idle blocks advised late").

    Idle blocks are released when they have not been reused for
    ``MAX_IDLE_CALLS`` calls (:meth:`tick`; unless ``age_by_calls`` is False,
    as in a Dask worker, whose tasks interleave calls of several kinds), when
    idle bytes would exceed ``limit``, and by :meth:`release`.  Arrays below ``MIN_BYTES`` or above
    ``limit`` (so every one while it is 0), and every one where ``mmap`` has no
    private anonymous mappings (Windows), come from ``np.empty`` as before.
    """

    MIN_BYTES = 1 << 20
    #: A training step of L layers makes 2 L calls, and a layer's blocks wait idle for about a step
    #: (freed by its backward, asked for again by its next forward): at 4, a 12-layer step faulted
    #: ~55 of its blocks in afresh (docs/performance.md, "idle calls").  The limit still bounds them.
    MAX_IDLE_CALLS = 128
    #: Calls a block under :attr:`ADVISE_NOW_BYTES` stays idle before its pages are marked
    #: ``MADV_FREE``: a training step of up to 16 layers reuses its blocks before.
    ADVISE_AFTER_CALLS = 32
    #: Blocks of at least this size are marked ``MADV_FREE`` as soon as they fall idle: what may
    #: stay resident and unmarked after a program's last call is the smaller blocks of its last
    #: ``ADVISE_AFTER_CALLS`` calls.
    ADVISE_NOW_BYTES = 64 << 20

    def __init__(self, limit=None):
        self._limit = None if limit is None else int(limit)
        self._blocks = []
        self._call = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        #: Whether :meth:`tick` releases blocks idle for more than MAX_IDLE_CALLS calls (the limit applies always).
        self.age_by_calls = True

    @property
    def limit(self):
        """Bytes of idle memory the pool may keep; without one given, resolved
        at first use from ``RACECPU_POOL_BYTES`` or half the physical memory."""
        if self._limit is None:
            self._limit = _default_limit()
        return self._limit

    @limit.setter
    def limit(self, nbytes):
        self._limit = int(nbytes)

    def _released(self, block):
        # The last array on the block died (any thread, no lock: plain stores).
        if block.size >= self.ADVISE_NOW_BYTES:
            self._advise(block)
        block.last = self._call
        block.idle = True

    @staticmethod
    def _advise(block):
        """Mark an idle block's pages ``MADV_FREE`` (once; a hand-out clears the mark)."""
        if hasattr(mmap, "MADV_FREE"):
            try:
                block.mem.madvise(mmap.MADV_FREE)
            except OSError:  # a kernel without it: the pages stay as they are
                pass
        block.advised = True

    def _drop_idle(self, keep_bytes, max_age=None):
        """Release idle blocks, oldest first, until at most ``keep_bytes`` stay idle;
        also every idle block unused for more than ``max_age`` calls.  A dropped
        block is unmapped when its last reference goes (a lease being torn down
        may still export it)."""
        kept, drop = 0, set()
        for b in sorted((b for b in self._blocks if b.idle), key=lambda b: b.last, reverse=True):
            if kept + b.size > keep_bytes or (max_age is not None and self._call - b.last > max_age):
                drop.add(b)
            else:
                kept += b.size
        if drop:
            self._blocks = [b for b in self._blocks if b not in drop]

    def empty(self, shape, dtype):
        """An uninitialised C-contiguous array, on a reused block where one fits."""
        dtype = np.dtype(dtype)
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if not max(self.MIN_BYTES, 1) <= nbytes <= self.limit or not hasattr(mmap, "MAP_PRIVATE"):
            return np.empty(shape, dtype)
        with self._lock:
            best = None
            for b in self._blocks:
                if b.idle and nbytes <= b.size <= nbytes + nbytes // 4 and (best is None or b.size < best.size):
                    best = b
            if best is None:
                self.misses += 1
                # Idle blocks that would still fit under the limit beside the new one stay.
                self._drop_idle(max(self.limit - nbytes, 0))
                best = _Block(-(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE, self._call)
                self._blocks.append(best)
            else:
                self.hits += 1
            best.idle = best.advised = False
            lease = best.lease_type.from_buffer(best.mem)
            weakref.finalize(lease, self._released, best).atexit = False
        return np.frombuffer(lease, dtype, count=nbytes // dtype.itemsize).reshape(shape)

    def zeros(self, shape, dtype=np.float64):
        """Like :meth:`empty`, filled with zeros."""
        x = self.empty(shape, dtype)
        x.fill(0)
        return x

    def tick(self):
        """Start of a public call: age the idle blocks, apply the limit, and mark ``MADV_FREE``
        the blocks idle for ``ADVISE_AFTER_CALLS`` calls."""
        with self._lock:
            self._call += 1
            self._drop_idle(self.limit, self.MAX_IDLE_CALLS if self.age_by_calls else None)
            for b in self._blocks:
                if b.idle and not b.advised and self._call - b.last >= self.ADVISE_AFTER_CALLS:
                    self._advise(b)

    def set_limit(self, nbytes):
        """Set ``limit`` (releasing idle blocks beyond it); returns the previous one."""
        with self._lock:
            old, self.limit = self.limit, int(nbytes)
            self._drop_idle(self.limit)
            return old

    def release(self):
        """Release every idle block; returns the bytes released."""
        with self._lock:
            before = sum(b.size for b in self._blocks)
            self._drop_idle(0)
            return before - sum(b.size for b in self._blocks)

    def stats(self):
        """Bytes held (``live``: some array still uses them, ``idle``: reusable), the limit, hits and misses."""
        with self._lock:
            idle = sum(b.size for b in self._blocks if b.idle)
            live = sum(b.size for b in self._blocks) - idle
            return dict(live_bytes=live, idle_bytes=idle, limit=self.limit, hits=self.hits, misses=self.misses)


def _default_limit():
    """``RACECPU_POOL_BYTES`` (a finite number >= 0 of bytes, e.g. ``2e9``), else
    half the physical memory.  A bad value is warned about and ignored: an
    environment variable should not make ``import racecpu`` fail."""
    env = os.environ.get("RACECPU_POOL_BYTES")
    if env:
        try:
            value = float(env)
            if not math.isfinite(value) or value < 0:
                raise ValueError
            return int(value)
        except ValueError:
            warnings.warn(f"RACECPU_POOL_BYTES must be a finite number of bytes >= 0, got {env!r}; "
                          f"using the default (half the physical memory)", RuntimeWarning, stacklevel=2)
    return physical_memory() // 2


#: The pool of racecpu's results.  Its limit is resolved at first use (see
#: :attr:`BufferPool.limit`), so importing racecpu reads no environment.
POOL = BufferPool()


def set_pool_limit(nbytes: int) -> int:
    """Set how many bytes of idle result memory racecpu may keep for reuse.

    racecpu keeps the memory of the large arrays it returns (outputs,
    gradients, residuals) after you drop them, so that the next call on
    inputs of about the same size does not fault fresh pages in (README,
    "Memory").  Idle memory unused for 128 calls (a training step of 64
    layers) is released at the next call.  The default limit is half the
    physical memory, or the environment variable ``RACECPU_POOL_BYTES`` read
    at first use (a bad value is warned about and ignored).

    Parameters
    ----------
    nbytes : int
        The new limit; 0 turns reuse off (and releases what is idle).

    Returns
    -------
    int
        The previous limit.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative integer, got {nbytes!r}")
    return POOL.set_limit(nbytes)


def release_memory() -> int:
    """Release the idle result memory racecpu keeps for reuse; returns the bytes released."""
    return POOL.release()


def pool_stats() -> dict:
    """What racecpu's result pool holds: ``live_bytes``, ``idle_bytes``, ``limit``, ``hits``, ``misses``."""
    return POOL.stats()


# ---------------------------------------------------------------------------
# workspaces
# ---------------------------------------------------------------------------

class Buffers:
    """A workspace: reusable flat buffers by name, viewed as C-contiguous arrays of the shape asked for.

    ``buffers(name, shape, dtype, zero=False)`` returns an array of ``shape``
    and ``dtype`` on the buffer kept under ``name`` (grown when too small;
    zero-filled with ``zero``), valid until that name is asked for again.  A
    loop over blocks (an out-of-core pass, a decode loop) keeps one
    allocation per name: its last, shorter block reuses the first one's
    memory (the engine's functions take one, :mod:`racecpu.engine`).
    :meth:`memo` keeps what a loop would otherwise rebuild every call from
    the same shapes.
    """

    def __init__(self):
        self._store = {}
        self._memo = {}

    def memo(self, key, make):
        """``make()``, made once per ``key`` (hashable: the shapes, dtypes and settings it
        depends on) and kept with the buffers."""
        try:
            return self._memo[key]
        except KeyError:
            value = self._memo[key] = make()
            return value

    def __call__(self, name, shape, dtype, zero=False):
        size = math.prod(shape)  # Python ints: no overflow, and cheap for the few dims of a shape
        dtype = np.dtype(dtype)
        buf = self._store.get(name)
        if buf is None or buf.size < size or buf.dtype != dtype:
            buf = self._store[name] = np.empty(size, dtype)
        a = buf[:size].reshape(shape)
        if zero:
            a.fill(0)
        return a

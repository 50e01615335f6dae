"""How every CPU kernel is compiled and cached.

:func:`kernel` is ``numba.njit`` with the kernels' options and a cache of
racecpu's own:

* **Keyed to every kernel source.**  Numba's own cache checks only the
  file of the function it compiles, but a kernel inlines code from its
  siblings (the register tiles of :mod:`.tiles`, the constants of
  :mod:`racecpu.config`): editing one of those alone would load stale
  machine code.  Here every entry is stamped with a digest of all of
  ``racecpu/_kernels/*.py``, ``racecpu/config.py`` and the Numba and
  llvmlite versions, so any edit recompiles everything.
* **Found wherever it can be written**: ``$NUMBA_CACHE_DIR`` when set, else
  ``__pycache__`` beside the sources, else the user's cache directory, else
  a private temporary directory; where none is writable the kernels compile
  in every process (one warning), and ``import racecpu`` never fails.
* **Never fatal**: an entry that cannot be read (a truncated or corrupt
  file) is compiled again and overwritten.

* **Each kernel runs its own copies of its callees**, so its bits do not
  depend on what the process compiled or loaded before it
  (:func:`_install_own_copies`).

The cache only changes where compiled code comes from, never what it
computes.  Only functions made by :func:`kernel` use this cache.  One thing
touches Numba itself: from the first kernel compilation on, a wrapper around
Numba's ``CPUCodeLibrary._optimize_final_module`` that acts only while a
racecpu kernel compiles; other Numba code in the process compiles as before.

The kernels cannot run as plain Python (they call compiled tasks by address
and use Numba intrinsics), so ``import racecpu`` refuses ``NUMBA_DISABLE_JIT=1``
with an ImportError that says so.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
import tempfile
import warnings
from pathlib import Path

import llvmlite
import numba
from numba.core import config as numba_config
from numba.core.caching import CompileResultCacheImpl, FunctionCache, _CacheLocator
from numba.core.errors import NumbaPerformanceWarning

if numba_config.DISABLE_JIT:
    raise ImportError("racecpu's kernels need Numba's JIT compiler and cannot run as plain Python, "
                      "but NUMBA_DISABLE_JIT is set: unset NUMBA_DISABLE_JIT (or set it to 0) to use racecpu")

#: Fast-math flags of every kernel.  Reassociation lets LLVM vectorise the
#: dv-long inner loops and dot products.  No 'nnan'/'ninf': the guards must
#: see real comparisons.
FASTMATH = frozenset({"contract", "reassoc", "nsz", "arcp"})

#: Options of every kernel.  error_model="numpy": with Python's model every
#: float division carries a zero check that raises, and that branch stops
#: LLVM from vectorising the loop.
OPTIONS = dict(fastmath=set(FASTMATH), nogil=True, error_model="numpy")

_SOURCES = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def source_digest():
    """SHA-256 over every kernel source file, racecpu/config.py and the compiler versions."""
    h = hashlib.sha256()
    files = sorted(_SOURCES.glob("*.py")) + [_SOURCES.parent / "config.py"]
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(f"numba {numba.__version__} llvmlite {llvmlite.__version__}".encode())
    return h.hexdigest()


def _writable(path):
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError:
        return False


def _user_cache_home():
    if sys.platform == "win32":
        return os.environ.get("LOCALAPPDATA") or os.path.expanduser("~\\AppData\\Local")
    if sys.platform == "darwin":
        return os.path.expanduser("~/Library/Caches")
    return os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")


def cache_tag():
    """The name that tells this checkout's kernels apart from another's in a shared cache."""
    return "kernels-" + hashlib.sha1(str(_SOURCES).encode()).hexdigest()[:12]


def shared_cache_dir():
    """The first writable of ``$NUMBA_CACHE_DIR/racecpu-<tag>``, ``racecpu/_kernels/__pycache__``
    and ``<user cache>/racecpu/<tag>``: where every process of this checkout finds the
    kernels another compiled; None if none is writable.  ``<tag>`` tells checkouts apart
    (a hash of this package's path)."""
    tag = cache_tag()
    candidates = []
    if numba_config.CACHE_DIR:
        candidates.append(Path(numba_config.CACHE_DIR) / f"racecpu-{tag}")
    candidates.append(_SOURCES / "__pycache__")
    candidates.append(Path(_user_cache_home()) / "racecpu" / tag)
    for path in candidates:
        if _writable(path):
            return str(path)
    return None


@functools.lru_cache(maxsize=None)
def cache_dir():
    """The directory the kernels are cached in, or None (no writable place: no cache).

    :func:`shared_cache_dir`, else a new private temporary directory (kept by
    this process alone).
    """
    shared = shared_cache_dir()
    if shared is not None:
        return shared
    try:
        return tempfile.mkdtemp(prefix="racecpu-kernels-")
    except OSError:
        warnings.warn("racecpu: no writable directory for the compiled kernels' cache; they are "
                      "compiled in every process (set NUMBA_CACHE_DIR to a writable directory)",
                      RuntimeWarning, stacklevel=3)
        return None


class _KernelLocator(_CacheLocator):
    """Numba cache locator of racecpu's kernels (see the module docstring)."""

    def __init__(self, py_func, path):
        self._lineno = py_func.__code__.co_firstlineno
        self._path = path

    def ensure_cache_path(self):
        os.makedirs(self._path, exist_ok=True)

    def get_cache_path(self):
        return self._path

    def get_source_stamp(self):
        return source_digest()

    def get_disambiguator(self):
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file):
        path = cache_dir()
        return None if path is None else cls(py_func, path)


class _KernelCacheImpl(CompileResultCacheImpl):
    _locator_classes = [_KernelLocator]


class _KernelCache(FunctionCache):
    """A FunctionCache that locates entries with :class:`_KernelLocator` and
    recompiles, rather than fails, on an entry it cannot load."""

    _impl_class = _KernelCacheImpl

    def load_overload(self, sig, target_context):
        try:
            return super().load_overload(sig, target_context)
        except Exception:  # a corrupt or foreign entry: compile again (and overwrite it)
            return None

    def save_overload(self, sig, data):
        with contextlib.suppress(OSError):  # a full or read-only disk costs a compile, nothing more
            super().save_overload(sig, data)


@contextlib.contextmanager
def quiet_compilation():
    """Silence Numba's note on np.dot with views while the kernels compile.

    Callers that pass views ('A' layout at compile time) make Numba warn
    that np.dot is faster on contiguous arrays; the row blocks the kernels
    hand it are contiguous.  Scoped to racecpu's own compilations.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*np\.v?dot\(\) is faster on contiguous arrays",
                                category=NumbaPerformanceWarning)
        yield


_compiling = 0  # > 0 while a kernel compiles (under Numba's global compiler lock)
_own_copies_installed = False


def _install_own_copies():
    """Make every kernel's module run its own copies of the functions it calls.

    Numba links a callee into each caller's module as a ``linkonce_odr``
    copy, which object code marks weak; the JIT's linker then binds every
    module's calls of that symbol to the first copy loaded in the process.
    Copies optimised in different modules differ in their last bits under
    ``reassoc``, so which copy ran depended on load order: a process that
    compiled the kernels and one that loaded them from the cache gave other
    backward bits (docs/performance.md, "own copies of callees").  Made
    internal, the copies are the ones each module was optimised and cached
    with.  Installed at the first kernel compilation and active only while
    one runs: other Numba code in the process is untouched.
    """
    global _own_copies_installed
    if _own_copies_installed:
        return
    import llvmlite.binding as llvm
    from numba.core.codegen import CPUCodeLibrary

    optimize = CPUCodeLibrary._optimize_final_module

    @functools.wraps(optimize)
    def optimize_with_own_copies(self):
        if _compiling:
            for fn in self._final_module.functions:
                if not fn.is_declaration and fn.linkage == llvm.Linkage.linkonce_odr:
                    fn.linkage = "internal"
        return optimize(self)

    CPUCodeLibrary._optimize_final_module = optimize_with_own_copies
    _own_copies_installed = True


@contextlib.contextmanager
def _kernel_compilation():
    """The scope of one kernel's compilation: the np.dot note silenced, callees' copies own."""
    global _compiling
    _install_own_copies()
    _compiling += 1
    try:
        with quiet_compilation():
            yield
    finally:
        _compiling -= 1


def kernel(fn=None, *, parallel=False, inline="never", cache=True):
    """``numba.njit`` with the kernels' options (:data:`OPTIONS`) and racecpu's cache.

    Use as ``@kernel`` or ``@kernel(parallel=True)`` / ``@kernel(inline="always")``.
    ``cache=False`` for functions Numba makes at typing time.
    """
    def wrap(f):
        disp = numba.njit(parallel=parallel, inline=inline, **OPTIONS)(f)
        if cache and cache_dir() is not None:
            disp._cache = _KernelCache(f)
        compile_ = disp.compile

        def compile_kernel(sig):
            with _kernel_compilation():
                return compile_(sig)
        disp.compile = compile_kernel
        return disp

    return wrap if fn is None else wrap(fn)

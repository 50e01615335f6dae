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
* **One per machine and user, found by every process**: the first writable
  of ``$NUMBA_CACHE_DIR/racecpu/<tag>``, ``<user cache>/racecpu/<tag>``
  (``$XDG_CACHE_HOME`` or ``~/.cache`` on Linux), ``__pycache__/<tag>``
  beside the sources and ``<tmp>/racecpu-<user>/<tag>`` (made private to the
  user), ``<tag>`` naming racecpu's version, the sources' digest and the
  CPU: an install, a ``PYTHONPATH=.`` clone of the same sources, and a
  read-only install with a read-only HOME all find the kernels one process
  compiled.  Where none is writable the kernels compile in every process
  (one warning), and ``import racecpu`` never fails.
* **Announced**: the first compilation in a process prints one line on
  stderr (:func:`announce_compilation`), whatever entry point called the
  kernel; ``RACECPU_QUIET_COMPILE=1`` silences it.
* **Never fatal**: an entry that cannot be read (a truncated or corrupt
  file) is compiled again and overwritten.

* **Each kernel runs its own copies of its callees**, so its bits do not
  depend on what the process compiled or loaded before it
  (:func:`_install_own_copies`).

* **Entries name the kernels they call by symbol** (``kernel(by_address=True)``,
  :mod:`._link`), which are compiled or loaded and registered before the
  entry's machine code is loaded.

The cache only changes where compiled code comes from, never what it
computes.  Only functions made by :func:`kernel` use this cache.  Two things
touch Numba and LLVM: from the first kernel compilation on, a wrapper around
Numba's ``CPUCodeLibrary._optimize_final_module`` that acts only while a
racecpu kernel compiles (other Numba code in the process compiles as
before); and the ``racecpu.call.*`` symbols :mod:`._link` adds to the JIT's
symbol table as kernels compile or load.

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
from numba.core import sigutils
from numba.core.caching import CompileResultCacheImpl, FunctionCache, _CacheLocator
from numba.core.errors import NumbaPerformanceWarning

from . import _link

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


def _user_id():
    """This user's number (POSIX) or name: what tells users' temporary caches apart."""
    if hasattr(os, "getuid"):
        return str(os.getuid())
    try:
        import getpass
        return getpass.getuser()
    except Exception:  # no user name known (Windows service accounts and the like)
        return "user"


def _private_temp_root():
    """``<tmp>/racecpu-<user>``, made with mode 0700; None unless it is a real directory of
    this user that nobody else can write.  Numba's cache entries are pickles: a folder
    another user could write would let them choose the code this process runs."""
    root = Path(tempfile.gettempdir()) / f"racecpu-{_user_id()}"
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        st = os.lstat(root)
    except OSError:
        return None
    import stat
    if not stat.S_ISDIR(st.st_mode):
        return None
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        return None
    return root


def host_cpu_name():
    """The host CPU as LLVM names it (``znver3``, ``skylake-avx512``): what the kernels are
    compiled for; None where LLVM cannot tell."""
    import llvmlite.binding as llvm
    try:
        return llvm.get_host_cpu_name()
    except Exception:  # an LLVM build that cannot tell
        return None


def _cpu_name():
    """:func:`host_cpu_name` as a path component (the index still keys entries by CPU where
    LLVM cannot tell)."""
    name = host_cpu_name() or "cpu"
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name) or "cpu"


def _package_version():
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("racecpu")
    except PackageNotFoundError:  # the source tree on sys.path, not installed
        return "src"


@functools.lru_cache(maxsize=None)
def cache_tag():
    """``kernels-<version>-<digest>-<cpu>``: the folder name of this racecpu's kernels in a
    shared cache.  The same sources share it wherever they are installed (a clone on
    ``PYTHONPATH`` and its install), other sources or another CPU get their own."""
    return f"kernels-{_package_version()}-{source_digest()[:12]}-{_cpu_name()}"


#: How many tags' folders a cache root keeps: a new one removes the least recently
#: made beyond these (each edit of the kernels' sources makes a new tag, ~8 MB each).
KEPT_TAGS = 6


def _prune_old_tags(root, keep):
    """Remove all but the ``KEPT_TAGS`` newest ``kernels-*`` folders of ``root`` (``keep`` stays).
    A process still reading a removed folder compiles what it cannot load: never an error."""
    import shutil
    try:
        olds = sorted((p for p in Path(root).iterdir() if p.name.startswith("kernels-") and p.name != keep),
                      key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return
    for p in olds[KEPT_TAGS - 1:]:
        shutil.rmtree(p, ignore_errors=True)


def cache_candidates():
    """Where the kernels' cache may go, in order (see the module docstring); the temporary
    one only where ``<tmp>/racecpu-<user>`` is this user's private directory."""
    tag = cache_tag()
    roots = []
    if numba_config.CACHE_DIR:
        roots.append(Path(numba_config.CACHE_DIR) / "racecpu")
    roots.append(Path(_user_cache_home()) / "racecpu")
    roots.append(_SOURCES / "__pycache__")
    private = _private_temp_root()
    if private is not None:
        roots.append(private)
    return [root / tag for root in roots]


def shared_cache_dir():
    """The first writable of :func:`cache_candidates` (four places, in order): where every process of this user
    finds the kernels another compiled; None if none is writable."""
    for path in cache_candidates():
        new = not path.exists()
        if _writable(path):
            if new:
                _prune_old_tags(path.parent, path.name)
            return str(path)
    return None


@functools.lru_cache(maxsize=None)
def cache_dir():
    """The directory the kernels are cached in (:func:`shared_cache_dir`), or None with a
    warning: no writable place, the kernels compile in every process."""
    shared = shared_cache_dir()
    if shared is None:
        warnings.warn("racecpu: no writable directory for the compiled kernels' cache; they are "
                      "compiled in every process (set NUMBA_CACHE_DIR to a writable directory)",
                      RuntimeWarning, stacklevel=3)
    return shared


_announced = False  # whether this process has printed its line (announce_compilation)


def _first_float_dtype(types):
    """The name of the first float32/float64 array's dtype among Numba ``types`` (tuples and
    the kernels' bundles searched depth first), or None."""
    for t in types:
        if hasattr(t, "ndim") and str(getattr(t, "dtype", "")) in ("float32", "float64"):
            return str(t.dtype)
        inner = getattr(t, "types", None)
        if isinstance(inner, tuple):
            found = _first_float_dtype(inner)
            if found:
                return found
    return None


def announce_compilation(sig=None):
    """Print, once per process, the line that says the kernels compile now (on 2 cores ~25 s
    for a non-causal call, ~35 s for a causal one) and where they will be kept; silent with
    ``RACECPU_QUIET_COMPILE=1``.

    Called as a kernel misses the cache, whichever entry point (NumPy API, torch, JAX,
    the CLI) called it.  ``sig``: the kernel's argument types, for the dtype named.
    """
    global _announced
    if _announced:
        return
    _announced = True
    if os.environ.get("RACECPU_QUIET_COMPILE", "0") not in ("", "0"):
        return
    dtype = _first_float_dtype(sig or ())
    what = f" for {dtype}" if dtype else ""
    where = cache_dir()
    kept = f"then cached in {where}" if where else "not cached: no writable directory"
    print(f"racecpu: compiling RACE kernels{what} (first use on this machine, ~25-35 s; {kept}) ...",
          file=sys.stderr, flush=True)


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
    """Cache entries that carry the kernels their code calls by symbol (:mod:`._link`), which are
    compiled or loaded and registered before that code is loaded."""

    _locator_classes = [_KernelLocator]

    def reduce(self, cres):
        return _link.linked_callees(cres.library), super().reduce(cres)

    def rebuild(self, target_context, payload):
        callees, data = payload
        _link.relink(callees)
        return super().rebuild(target_context, data)


class _KernelCache(FunctionCache):
    """A FunctionCache that locates entries with :class:`_KernelLocator` and
    recompiles, rather than fails, on an entry it cannot load."""

    _impl_class = _KernelCacheImpl

    def load_overload(self, sig, target_context):
        try:
            loaded = super().load_overload(sig, target_context)
        except Exception:  # a corrupt or foreign entry: compile again (and overwrite it)
            loaded = None
        if loaded is None:
            announce_compilation(sigutils.normalize_signature(sig)[0])
        return loaded

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


def kernel(fn=None, *, parallel=False, inline="never", cache=True, by_address=False, readonly=(), any_layout=(),
           refcounts=True):
    """``numba.njit`` with the kernels' options (:data:`OPTIONS`) and racecpu's cache.

    Use as ``@kernel`` or ``@kernel(parallel=True)`` / ``@kernel(inline="always")``.
    ``cache=False`` for functions Numba makes at typing time.  ``by_address=True``: other
    kernels call it through a symbol, so it is compiled once per argument types instead of
    again inside every caller (:mod:`._link`); ``readonly`` names the array parameters it
    only reads, passed read-only whatever the caller has (one compilation for both), and
    ``any_layout`` those passed in layout 'A' whatever the caller has.

    ``refcounts=False`` (with ``by_address``): compiled without Numba's reference counts
    (``_nrt=False``), for a leaf that allocates nothing and keeps no array past its return:
    its arrays are its caller's, borrowed for the call, and counting each of them up on
    entry and down on exit cost atomics on every call (docs/performance.md, "no reference
    counts in the products").  An allocation in it fails to compile; the kernels it calls
    keep their own counts (every kernel sets the flag, so none inherits it from its first
    caller, as Numba would otherwise have it).
    """
    if not refcounts and not by_address:
        raise ValueError("refcounts=False applies to kernels made with by_address=True")
    if not by_address and (readonly or any_layout):
        raise ValueError("readonly= and any_layout= apply to kernels made with by_address=True")
    if by_address and inline != "never":
        raise ValueError("a kernel called through its symbol cannot be inlined: by_address=True with inline=")
    if by_address:
        def wrap_by_address(f):
            impl = _compiled_kernel(f, parallel, "never", cache, refcounts)
            return _link.by_address(impl, numba.njit(inline="always", **OPTIONS), readonly, any_layout)
        return wrap_by_address if fn is None else wrap_by_address(fn)

    def wrap(f):
        return _compiled_kernel(f, parallel, inline, cache, True)

    return wrap if fn is None else wrap(fn)


def _compiled_kernel(f, parallel, inline, cache, nrt):
    """The dispatcher of :func:`kernel`: ``f`` jitted with OPTIONS and Numba's ``_nrt`` flag
    ``nrt`` (reference counts), cached in racecpu's cache and announcing its compilations."""
    # _nrt always given: Numba lets a kernel that does not set it inherit it from the kernel
    # that compiles it first, so one without reference counts would pass that on.
    disp = numba.njit(parallel=parallel, inline=inline, _nrt=nrt, **OPTIONS)(f)
    cached = cache and cache_dir() is not None
    if cached:
        disp._cache = _KernelCache(f)  # announces the compilations it cannot spare
    compile_ = disp.compile

    def compile_kernel(sig):
        if not cached:
            args, _ = sigutils.normalize_signature(sig)
            if tuple(args) not in disp.overloads:
                announce_compilation(args)
        with _kernel_compilation():
            return compile_(sig)
    disp.compile = compile_kernel
    return disp

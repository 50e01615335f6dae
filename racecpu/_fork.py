"""Fork safety: a clear error in a child that cannot run racecpu's kernels.

Numba runs ``prange`` loops on a threading layer chosen at the first parallel
call.  Where that is OpenMP built with GNU's libgomp (Linux wheels when TBB is
not installed), the pool of worker threads does not survive ``fork``: a child
forked after the parent ran any parallel kernel is killed by Numba (SIGTERM,
"fork() called from a process already using GNU OpenMP") at its first
parallel call, even on one thread, and ``multiprocessing.Pool`` with the fork
start method then waits forever for the dead worker's result.  There is no
safe path for such a child (the compiled kernels are linked to that layer), so
racecpu refuses to run there with :class:`RuntimeError` instead; a pool's
worker then reports the error to the parent.  A child forked before the first
parallel call, or under the fork-safe TBB and workqueue layers, is unaffected.
"""

from __future__ import annotations

import os
import sys

__all__ = ["check"]

#: Set in a child forked after the parent started GNU OpenMP's thread pool (and
#: inherited by its own children, whose copy of that pool is as broken).
_UNSAFE = False


def _pool_is_gnu_openmp():
    """Whether this process has started Numba's threading layer on GNU OpenMP."""
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    if parallel is None or not getattr(parallel, "_is_initialized", False):
        return False
    if getattr(parallel, "_threading_layer", None) != "omp":
        return False
    omppool = sys.modules.get("numba.np.ufunc.omppool")
    return getattr(omppool, "openmp_vendor", "GNU") == "GNU"


def _after_fork_in_child():
    global _UNSAFE
    if not _UNSAFE:
        try:
            _UNSAFE = _pool_is_gnu_openmp()
        except Exception:  # noqa: BLE001 -- never fail a fork; unknown state is treated as safe
            _UNSAFE = False


_REGISTERED = False


def check():
    """Raise RuntimeError where this process cannot run racecpu's CPU kernels (see the module docstring).

    The first call registers the after-fork hook (nothing is registered at
    import: a child forked before any racecpu call has nothing to fear).
    """
    global _REGISTERED
    if not _REGISTERED:
        _REGISTERED = True
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_after_fork_in_child)
    if _UNSAFE:
        raise RuntimeError(
            "racecpu cannot run in a process forked after it (or anything using Numba's GNU OpenMP threading "
            "layer) ran in the parent: OpenMP's threads do not survive fork, and Numba kills such a child at "
            "its first parallel call.  Use the 'spawn' or 'forkserver' start method "
            "(multiprocessing.get_context('spawn')), or fork before the first racecpu call")

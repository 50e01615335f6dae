"""Running a kernel's (group, chunk) tasks on every core.

:func:`run_tasks` runs ``task(t, *args)`` for every task ``t`` in one
``prange`` loop, with subnormal floats flushed to zero while a task runs
(:data:`FLUSH_SUBNORMALS`) and its arrays borrowed from the caller (no
reference counts on them: :func:`_meminfo_slots`); :func:`task_threads` is where a kernel call runs:
with BLAS on one thread inside its tasks, and calls on fewer than
``config.SERIAL_TOKENS`` tokens on the calling thread alone.  Also the
parallel NaN/Inf count of the input check (:func:`count_nonfinite`).
"""

from __future__ import annotations

import contextlib
import itertools
import numbers
import os
import platform
import threading

import numba
import numpy as np
import scipy.linalg.cython_blas  # noqa: F401  (the BLAS that np.dot in the kernels calls)
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.core.compiler_lock import global_compiler_lock
from numba.extending import intrinsic

from .. import config
from ..config import BLAS_ROWS
from ._jit import kernel
from .tiles import stream_fence


_blas_controller = None
_threads_started = False


def read_only(x):
    """``x`` as a read-only array (a view of it where it is writable; no copy).

    Every array the kernels only read reaches them read-only: Numba compiles a
    kernel once per argument types, and a read-only array (JAX hands them, so does
    a memory-mapped file opened for reading) is another type than a writable one,
    so inputs of both kinds would compile every kernel twice (a minute or more).
    """
    if x.flags.writeable:
        x = x.view()
        x.flags.writeable = False
    return x


def start_threads():
    """Start Numba's threading layer (once), with OpenMP's wait policy from ``config.WAIT_POLICY``.

    GNU OpenMP reads ``OMP_WAIT_POLICY`` when it is loaded, which Numba does
    the first time it starts its threads.  Its default spins idle workers
    for a while after every parallel region, which on a shared or busy
    machine makes small calls tens of times slower (docs/performance.md, "OMP
    wait policy").  So the variable is set, unless the user set it, only
    while this call loads the runtime, and removed again: nothing else in
    the process, and no child process, sees it.  Where Numba's threads were
    started before (by the user or another library), the policy stays theirs.
    """
    global _threads_started
    if _threads_started:
        return
    _threads_started = True
    policy = config.WAIT_POLICY
    if not policy or "OMP_WAIT_POLICY" in os.environ:
        numba.get_num_threads()  # starts the threading layer
        return
    os.environ["OMP_WAIT_POLICY"] = policy
    try:
        numba.get_num_threads()
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)


def set_threads(n: int) -> int:
    """Set how many threads racecpu's kernels use in the calling thread; returns the previous count.

    Numba keeps the count per calling thread, so other threads of the
    program keep theirs.  Results are the same bits at any count.

    Parameters
    ----------
    n : int
        1 to ``numba.config.NUMBA_NUM_THREADS`` (the most Numba started,
        set by the environment variable ``NUMBA_NUM_THREADS``).
    """
    start_threads()
    most = numba.config.NUMBA_NUM_THREADS
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 1 <= n <= most:
        raise ValueError(f"n must be an integer from 1 to {most} (NUMBA_NUM_THREADS), got {n!r}")
    previous = numba.get_num_threads()
    numba.set_num_threads(int(n))
    return previous


@contextlib.contextmanager
def threads(n: int):
    """Context manager: racecpu's kernels use ``n`` threads in the calling thread inside the block.

    >>> import racecpu
    >>> with racecpu.threads(1):
    ...     pass  # calls here run on one core
    """
    previous = set_threads(n)
    try:
        yield
    finally:
        numba.set_num_threads(previous)


_blas_lock = threading.Lock()
_blas_users = 0
_blas_saved = ()  # (controller, thread count found) of each BLAS the first call in limited


def _blas_libraries():
    """threadpoolctl's controllers of the BLAS libraries loaded, found on first use."""
    global _blas_controller
    if _blas_controller is None:
        # Imported on first use: importing threadpoolctl sets an environment
        # variable (KMP_DUPLICATE_LIB_OK), which importing racecpu must not.
        from threadpoolctl import ThreadpoolController
        _blas_controller = ThreadpoolController().select(user_api="blas").lib_controllers
    return _blas_controller


@contextlib.contextmanager
def _blas_on_one_thread():
    """BLAS limited to one thread while any racecpu call in any thread needs it.

    threadpoolctl's limit restores what it found on entry, so two calls that
    overlap in two threads would leave BLAS on one thread for good (the
    second finds the first one's limit and restores it last).  The limit is
    taken by the first call in and given back by the last one out.  Through
    the libraries' controllers directly (a few microseconds), where
    threadpoolctl's ``limit`` re-read every library's state (info, version)
    on each of a call's eight kernels (docs/performance.md, "a call's fixed cost").
    """
    global _blas_users, _blas_saved
    with _blas_lock:
        if _blas_users == 0:
            saved = []
            for lib in _blas_libraries():
                n = lib.get_num_threads()
                if n != 1:
                    lib.set_num_threads(1)
                    saved.append((lib, n))
            _blas_saved = tuple(saved)
        _blas_users += 1
    try:
        yield
    finally:
        with _blas_lock:
            _blas_users -= 1
            if _blas_users == 0:
                for lib, n in _blas_saved:
                    lib.set_num_threads(n)
                _blas_saved = ()


_launch_lock = threading.Lock()
_serialize = None


def parallel_region():
    """A lock around a parallel launch where the threading layer cannot run two at once.

    Numba's ``workqueue`` layer (used where neither OpenMP nor TBB is
    available) aborts the process when two threads launch parallel work
    together; there racecpu's calls from several threads take turns.
    """
    global _serialize
    if _serialize is None:
        _serialize = _launch_lock if numba.threading_layer() == "workqueue" else contextlib.nullcontext()
    return _serialize


class task_threads:
    """Where a kernel call of ``tokens`` tokens (all groups) in chunks of ``chunk`` runs: a
    context manager (``with task_threads(tokens, chunk): kernel(...)``).

    Every core already runs its own prange task; a multi-threaded sgemm
    inside each would oversubscribe the cores (docs/performance.md, "BLAS on
    one thread"), so BLAS runs on one thread while the call runs.  The limit
    (threadpoolctl) is skipped when a chunk is too short to reach BLAS
    (``chunk < BLAS_ROWS``), so decode steps stay cheap, and calls on fewer
    than SERIAL_TOKENS tokens do not wake the other threads at all.  The
    thread counts are given back however the call ends.  A class rather than
    a generator: a decode step enters two of these, and a generator's
    context costs several microseconds more.
    """

    __slots__ = ("tokens", "chunk", "_threads", "_blas")

    def __init__(self, tokens, chunk):
        self.tokens, self.chunk = tokens, chunk
        self._threads = self._blas = None

    def __enter__(self):
        start_threads()
        if self.tokens < config.SERIAL_TOKENS:
            self._threads = numba.get_num_threads()
            numba.set_num_threads(1)
        if self.chunk >= BLAS_ROWS:
            blas = _blas_on_one_thread()
            try:
                blas.__enter__()
            except BaseException:
                self._restore()
                raise
            self._blas = blas
        return self

    def __exit__(self, *exc):
        try:
            if self._blas is not None:
                self._blas.__exit__(*exc)
        finally:
            self._restore()
        return False

    def _restore(self):
        if self._threads is not None:
            numba.set_num_threads(self._threads)
            self._threads = None


#: Tasks run with subnormal floats flushed to zero (x86-64: the FTZ and DAZ
#: bits of MXCSR, set before each task and the thread's own value put back
#: after it).  Products of two small soft-hash probabilities (phi_q . phi_k,
#: the backward's phi_k . phi_q / den) land in float32's subnormal range
#: (below 1.2e-38), where every multiply or FMA takes a microcode assist of
#: ~100 cycles (docs/performance.md, "flush subnormals").
#: Flushed, such a term is 0 instead of a subnormal that has already lost
#: most of its bits, beside sums > DEN_FLOOR = 1e-30 (smaller ones give
#: zeros anyway).  Elsewhere (AArch64, ...) the platform's default stands.
FLUSH_SUBNORMALS = platform.machine().lower() in ("x86_64", "amd64")


_MXCSR_FTZ_DAZ = 0x8040  # bit 15: flush results to zero; bit 6: inputs as zero


def _mxcsr(builder, name, slot):
    """Call LLVM's ``llvm.x86.sse.<name>`` (stmxcsr / ldmxcsr) on the i32 ``slot``."""
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p]),
                                        f"llvm.x86.sse.{name}")
    builder.call(fn, [builder.bitcast(slot, i8p)])


@intrinsic
def _call_task(typingctx, addr, t, args):
    """Call the compiled function at ``addr`` as ``f(t, *args)`` (Numba's native calling convention),
    with subnormals flushed to zero during the call (FLUSH_SUBNORMALS)."""
    argtypes = (t,) + tuple(args)

    def codegen(context, builder, sig, llargs):
        fnty = context.call_conv.get_function_type(types.none, argtypes)
        fn = builder.inttoptr(llargs[0], fnty.as_pointer())
        vals = [llargs[1], *cgutils.unpack_tuple(builder, llargs[2], len(args))]
        if FLUSH_SUBNORMALS:
            i32 = ir.IntType(32)
            saved, flush = cgutils.alloca_once(builder, i32), cgutils.alloca_once(builder, i32)
            _mxcsr(builder, "stmxcsr", saved)
            builder.store(builder.or_(builder.load(saved), ir.Constant(i32, _MXCSR_FTZ_DAZ)), flush)
            _mxcsr(builder, "ldmxcsr", flush)
        status, _ = context.call_conv.call_function(builder, fn, types.none, argtypes, vals)
        if FLUSH_SUBNORMALS:  # the thread's own mode back, before an error is passed on too
            _mxcsr(builder, "ldmxcsr", saved)
        with cgutils.if_unlikely(builder, status.is_error):
            context.call_conv.return_status_propagate(builder, status)
        return context.get_dummy_value()

    return types.none(addr, t, args), codegen


@kernel(parallel=True, by_address=True)
def _run_tasks(addr, ntasks, args):
    """Call ``addr(t, *args)`` for t in range(ntasks) on every thread: the one parallel loop,
    compiled once (``addr``: a trampoline of :func:`_trampoline`, ``args``: its packed
    arguments' address)."""
    for t in prange(ntasks):
        _call_task(addr, np.int64(t), args)
        stream_fence()  # the task's streamed stores (combine_rows) done before the join


@intrinsic
def _packed(typingctx, args):
    """The address of a stack copy of ``args`` (a flat tuple) as the arguments of a call pass
    them (Numba's calling convention: each value flattened to its LLVM members, in order),
    valid while the calling function runs."""
    def codegen(context, builder, sig, llargs):
        argtypes = tuple(args)
        vals = cgutils.unpack_tuple(builder, llargs[0], len(argtypes))
        flat = list(context.get_arg_packer(argtypes).as_arguments(builder, vals))
        slot = cgutils.alloca_once(builder, ir.LiteralStructType([v.type for v in flat]))
        for i, v in enumerate(flat):
            builder.store(v, cgutils.gep_inbounds(builder, slot, 0, i))
        return builder.ptrtoint(slot, context.get_value_type(types.intp))

    return types.intp(args), codegen


@kernel
def _launch(tramp, ntasks, args):
    """Run the tasks: ``args`` packed on this frame's stack, the trampoline ``tramp`` unpacks
    them for each task (:func:`_trampoline`)."""
    _run_tasks(tramp, ntasks, (_packed(args),))


_trampolines = itertools.count()


def _trampoline(task_addr, argtypes, flat_types):
    """A function ``f(t, packed)`` in Numba's calling convention that calls the task at
    ``task_addr``, compiled for ``(int64, *argtypes)``, with the arguments :func:`_packed`
    stored at address ``packed`` (``flat_types``: the leaves of ``argtypes``, as packed).

    Written in LLVM IR, not by Numba: a few loads and a call, generated in about a
    millisecond, once per task and argument types in each process.  Returns the library
    (keep it alive) and the function's address.
    """
    from numba.core.registry import cpu_target
    context = cpu_target.target_context
    task_type = context.call_conv.get_function_type(types.none, (types.int64, *argtypes))
    own_type = context.call_conv.get_function_type(types.none, (types.int64, types.intp))
    packed = list(context.get_arg_packer(flat_types).argument_types)
    if [str(t) for t in task_type.args[3:]] != [str(t) for t in packed]:  # never expected: a crash otherwise
        raise TypeError(f"packed arguments {packed} differ from the task's {task_type.args[3:]}")
    name = f"racecpu_trampoline_{next(_trampolines)}"
    module = context.create_module(name)
    fn = ir.Function(module, own_type, name)
    ret, excinfo, t, address = fn.args
    builder = ir.IRBuilder(fn.append_basic_block())
    slot = builder.inttoptr(address, ir.LiteralStructType(packed).as_pointer())
    vals = [builder.load(cgutils.gep_inbounds(builder, slot, 0, i)) for i in range(len(packed))]
    for i in _meminfo_slots(context, flat_types):  # the task borrows every array: no counts on them
        vals[i] = ir.Constant(packed[i], None)
    task = builder.inttoptr(ir.Constant(ir.IntType(64), task_addr), task_type.as_pointer())
    builder.ret(builder.call(task, [ret, excinfo, t, *vals]))
    with global_compiler_lock:  # Numba's code generation is not thread-safe
        library = context.codegen().create_library(name)
        library.add_ir_module(module)
        library.finalize()
        return library, library.get_pointer_to_function(name)


def _meminfo_slots(context, flat_types):
    """The positions of the arrays' meminfo pointers among the flattened arguments of ``flat_types``.

    Numba counts references to an array through its meminfo, with an atomic on every new view
    (each step's rows) and at every call that keeps one; the tasks of one call on all threads
    count on the same few meminfos, and each atomic then moves their cache line between cores
    (docs/performance.md, "tasks borrow their arrays").  A task returns nothing and keeps no
    array past its return, and :func:`run_tasks`' caller holds every argument until the tasks
    end, so a task may take them with a null meminfo, which Numba's counting skips; what a task
    allocates keeps its own.  (An array's members flatten to the meminfo first, then the rest.)
    """
    slots, pos = [], 0
    for ty in flat_types:
        members = context.get_arg_packer((ty,)).argument_types
        if isinstance(ty, types.Array):
            if not isinstance(members[0], ir.PointerType):  # never expected: a crash otherwise
                raise TypeError(f"{ty} does not flatten to its meminfo first: {members}")
            slots.append(pos)
        pos += len(members)
    return slots


_task_runners = {}  # (task, key of the argument types) -> (trampoline address, compiled _launch, library)

# The array flags that Numba's type of an array depends on, alignment aside (see run_tasks): its
# layout ('C', 'F' or 'A') and whether it is read-only.
_TYPE_FLAGS = 0x1 | 0x2 | 0x400  # NPY_ARRAY_C_CONTIGUOUS, NPY_ARRAY_F_CONTIGUOUS, NPY_ARRAY_WRITEABLE


def _flatten(args, leaves, key):
    """Append the arrays and scalars of ``args`` (nested tuples, the bundles, flattened, in
    order) to ``leaves``, and to ``key`` what their Numba types depend on: each array's dtype,
    ndim and type flags, each scalar's Python type, and each tuple's class and length.

    Not ``numba._dispatcher.compute_fingerprint``: up to Numba 0.59 at least, it returns
    corrupted leading bytes once a fingerprint passes ~40 bytes, so two calls whose first
    arguments differ in layout could share a key and one run code compiled for the other.
    """
    for a in args:
        if isinstance(a, np.ndarray):
            leaves.append(a)
            key.append((a.dtype, a.ndim, a.flags.num & _TYPE_FLAGS))
        elif isinstance(a, tuple):
            key.append((type(a), len(a)))
            _flatten(a, leaves, key)
        else:
            leaves.append(a)
            key.append(type(a))


def run_tasks(task, ntasks, *args):
    """Run the jitted ``task(t, *args)`` for every ``t`` in ``range(ntasks)`` on all threads.

    Parameters
    ----------
    task : Numba dispatcher
        Compiled for ``(int64, *types of args)``; returns nothing and keeps no
        array of ``args`` (nor a view of one) past its return: it gets them
        borrowed, with no reference counted (:func:`_meminfo_slots`).
    ntasks : int
    *args
        Arrays, scalars and (named) tuples of them (:mod:`racecpu._kernels.bundles`).

    The parallel loop calls ``task`` through its address, so each task is
    compiled once, on its own, instead of being linked, optimised and
    generated again inside every parallel loop that calls it (docs/performance.md,
    "run_tasks by address"); the loop itself is compiled once for every task
    (:func:`_run_tasks`).  Per task and argument types, looked up by a key of
    what the types depend on (:func:`_flatten`), :func:`_launch` gets the
    arguments' leaves as one flat tuple and packs them on its stack, and a
    trampoline (:func:`_trampoline`) unpacks them for each task: Numba's
    calling convention passes a tuple argument as its flattened members, so
    the task gets the call it was compiled for.  Alignment is not part of the key: code compiled for aligned
    arrays runs on unaligned ones, which x86-64 and AArch64 load and store alike.
    """
    start_threads()
    leaves, key = [], [task]
    _flatten(args, leaves, key)
    key, flat = tuple(key), tuple(leaves)
    runner = _task_runners.get(key)
    if runner is None:
        argtypes = tuple(numba.typeof(a) for a in args)
        cres = task.get_compile_result(types.none(types.int64, *argtypes))
        addr = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)
        flat_types = tuple(numba.typeof(a) for a in flat)
        library, tramp = _trampoline(addr, argtypes, flat_types)
        sig = (types.intp, types.int64, types.Tuple(flat_types))
        _launch.compile(sig)
        runner = _task_runners[key] = tramp, _launch.overloads[sig].entry_point, library
    tramp, entry, _ = runner
    with parallel_region():
        entry(tramp, ntasks, flat)


@kernel
def _count_nonfinite_run(bits, exp_mask):
    cnt = 0
    for i in range(bits.size):
        cnt += (bits[i] & exp_mask) == exp_mask
    return cnt


@kernel(parallel=True)
def _count_nonfinite(bits, exp_mask):
    """Number of NaN/Inf values in a float array viewed as unsigned ints.

    A value is NaN or Inf iff its exponent bits are all set; counting that
    with integer ops vectorises and runs on every core, where
    ``np.isfinite(x).all()`` builds a bool temporary on one core
    (docs/performance.md, "count_nonfinite").
    """
    n = bits.size
    nb = (n + 65535) // 65536
    total = 0
    for blk in prange(nb):
        total += _count_nonfinite_run(bits[blk * 65536:min(n, blk * 65536 + 65536)], exp_mask)
    return total


def count_nonfinite(bits, exp_mask):
    """:func:`_count_nonfinite` (the number of NaN/Inf values of a float array viewed as
    unsigned ints ``bits``, ``exp_mask`` the exponent bits) on Numba's threads."""
    start_threads()
    with parallel_region():
        return _count_nonfinite(bits, exp_mask)

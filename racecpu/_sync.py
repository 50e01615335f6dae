"""Atomic flags for kernels whose tasks hand work to each other (``_kernels.causal_bwd_pair``).

Numba has no atomics on the CPU; these intrinsics emit LLVM's atomic
instructions on one int64 element of an array: an acquire load, a release
store (what one task wrote before the store is seen by the task whose load
sees the store) and a compare-and-swap that claims a job for one task only.
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def _element(context, builder, arrty, arr, index):
    ary = context.make_array(arrty)(context, builder, value=arr)
    return cgutils.get_item_pointer(context, builder, arrty, ary, [index])


def _check(arr):
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        raise TypeError("atomic flags are int64 array elements")


@intrinsic
def load_acquire(typingctx, arr, index):
    """``arr[index]``, read atomically; later reads see what the writer wrote before its release."""
    _check(arr)

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_element(context, builder, sig.args[0], *args), "acquire", 8)
    return types.int64(arr, index), codegen


@intrinsic
def store_release(typingctx, arr, index, value):
    """``arr[index] = value`` atomically, after every write before it."""
    _check(arr)

    def codegen(context, builder, sig, args):
        val = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.store_atomic(val, _element(context, builder, sig.args[0], args[0], args[1]), "release", 8)
        return context.get_dummy_value()
    return types.none(arr, index, value), codegen


@intrinsic
def swap_if(typingctx, arr, index, expected, value):
    """``arr[index] = value`` if it holds ``expected``, atomically; True if so (a claim won)."""
    _check(arr)

    def codegen(context, builder, sig, args):
        ptr = _element(context, builder, sig.args[0], args[0], args[1])
        old, new = (context.cast(builder, a, t, types.int64) for a, t in zip(args[2:], sig.args[2:]))
        return builder.extract_value(builder.cmpxchg(ptr, old, new, "acq_rel", "acquire"), 1)
    return types.boolean(arr, index, expected, value), codegen


@intrinsic
def spin_pause(typingctx):
    """A spin-wait's pause (x86 ``pause``: the other hyperthread runs, the loop's exit is
    not mispredicted); nothing elsewhere."""
    def codegen(context, builder, sig, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.none(), codegen

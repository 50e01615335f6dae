"""Kernels that other kernels call through a symbol, compiled once.

Numba links a kernel's callees into the caller's module and runs LLVM's
optimisation and code generation over them again there, then again in
the caller's caller: a product such as :func:`.products.combine_rows` was
optimised and turned into machine code once on its own and once more at
every level of every kernel above it: about a third of the cold compile
(docs/performance.md, "First contact (issue 57)").  A kernel made with
``kernel(by_address=True)`` is compiled once per argument types, and its
callers call it through an external symbol of their own naming
(``racecpu.call.<module>.<name>.<digest of the types>``) that the process's
JIT linker resolves to the compiled code (``llvmlite.binding.add_symbol``).

A caller loaded from racecpu's cache names the symbols it calls in its
cache entry (:func:`linked_callees`); they are compiled or loaded and
registered (:func:`relink`) before its machine code is loaded, because
an unresolved symbol there would be a crash, not an error.

The call is Numba's native calling convention, the one a linked callee
gets: errors raised in the callee propagate to the caller.  Only the
cost of a call (a few ns) and inlining across it are lost; the kernels
marked this way do microseconds of work per call.  The bits are those
of the callee compiled on its own, the same in every caller.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect

import llvmlite.binding as llvm
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

PREFIX = "racecpu.call."

_IMPLS = {}  # (module, qualname) -> the compiled kernel (a Numba dispatcher) behind a wrapper
_SYMBOLS = {}  # symbol -> (module, qualname, argument types, return type), registered in this process


def _origin(f):
    """(name of the module that defines ``f``, its qualified name): where :func:`relink` finds it."""
    return f.__globals__["__name__"], f.__qualname__


def _symbol(impl, argtypes):
    module, qualname = _origin(impl.py_func)
    digest = hashlib.sha256(repr(tuple(str(t) for t in argtypes)).encode()).hexdigest()[:20]
    return f"{PREFIX}{module}.{qualname}.{digest}"


def _register(impl, argtypes):
    """Compile (or load) ``impl`` for ``argtypes``, point its symbol at it; the symbol and the
    return type."""
    sym = _symbol(impl, argtypes)
    entry = _SYMBOLS.get(sym)
    if entry is None:
        impl.compile(argtypes)
        cres = impl.overloads[argtypes]
        llvm.add_symbol(sym, cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name))
        entry = _SYMBOLS[sym] = (*_origin(impl.py_func), argtypes, cres.signature.return_type)
    return sym, entry[3]


def linked_callees(library):
    """The callees a compiled library calls by symbol, as (symbol, module, qualname, argument
    types): what :func:`relink` needs before that library's machine code can be loaded again."""
    out = []
    for fn in library._final_module.functions:
        if fn.is_declaration and fn.name.startswith(PREFIX):
            module, qualname, argtypes, _ = _SYMBOLS[fn.name]  # registered when the call was typed
            out.append((fn.name, module, qualname, argtypes))
    return out


def relink(callees):
    """Compile or load, and register, the callees of a library about to be loaded from the cache.

    Raises LookupError where a symbol would not be the one the cached code calls (the cache then
    compiles the library again): loading it anyway would crash the process.
    """
    for sym, module, qualname, argtypes in callees:
        importlib.import_module(module)
        impl = _IMPLS[module, qualname]
        argtypes = tuple(argtypes)
        if _symbol(impl, argtypes) != sym:
            raise LookupError(f"{sym} is not the symbol of {qualname}{argtypes} in this process")
        _register(impl, argtypes)


def _caller(impl, readonly, any_layout):
    """An intrinsic ``call((args...))`` that calls ``impl`` through its symbol.  Literal
    arguments are passed as their plain types, the arrays at positions ``readonly`` as read-only
    and those at ``any_layout`` as layout 'A' (one signature whatever the caller's are: the casts
    change the type, not the data)."""

    def as_callee(i, t):
        t = types.unliteral(t)
        if isinstance(t, types.Array):
            if i in readonly and t.mutable:
                t = t.copy(readonly=True)
            if i in any_layout and t.layout != "A":
                t = t.copy(layout="A")
        return t

    @intrinsic
    def call(typingctx, packed):
        args = tuple(packed)
        argtypes = tuple(as_callee(i, t) for i, t in enumerate(args))
        sym, restype = _register(impl, argtypes)

        def codegen(context, builder, sig, llargs):
            vals = [context.cast(builder, v, a, t)
                    for v, a, t in zip(cgutils.unpack_tuple(builder, llargs[0], len(args)), args, argtypes)]
            fnty = context.call_conv.get_function_type(restype, argtypes)
            fn = cgutils.get_or_insert_function(builder.module, fnty, sym)
            status, res = context.call_conv.call_function(builder, fn, restype, argtypes, vals)
            with cgutils.if_unlikely(builder, status.is_error):
                context.call_conv.return_status_propagate(builder, status)
            return res

        return restype(packed), codegen

    return call


def by_address(impl, njit_inline, readonly=(), any_layout=()):
    """A function with ``impl``'s signature, defaults and docstring whose calls from kernels go
    through ``impl``'s symbol; ``njit_inline`` compiles it with Numba's IR-level inlining, so the
    wrapper itself leaves no trace.  ``readonly``: names of array parameters the kernel only reads;
    ``any_layout``: names of array parameters its code takes in layout 'A' whatever the caller
    has (where contiguity buys nothing: one compilation for all).
    """
    f = impl.py_func
    params = list(inspect.signature(f).parameters)
    unknown = (set(readonly) | set(any_layout)) - set(params)
    if unknown:
        raise ValueError(f"{f.__qualname__} has no parameters {sorted(unknown)}")
    _IMPLS[_origin(f)] = impl
    names = ", ".join(params)
    positions = [frozenset(i for i, p in enumerate(params) if p in which) for which in (readonly, any_layout)]
    namespace = {"_call": _caller(impl, *positions)}
    exec(f"def {f.__name__}({names}):\n    return _call(({names},))\n", namespace)
    wrapper = functools.update_wrapper(namespace[f.__name__], f, updated=())
    del wrapper.__wrapped__  # the wrapper's own signature is f's: nothing to unwrap
    wrapper.__defaults__ = f.__defaults__
    disp = njit_inline(wrapper)
    disp.impl = impl
    return disp

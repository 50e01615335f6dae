"""Kernels called through a symbol (racecpu._kernels._link): the same results as a linked call,
errors that reach the caller, one compilation for read-only and writable arguments, and cache
entries that name what they call."""

import numpy as np
import pytest

from racecpu._kernels import _jit, _link
from racecpu._kernels import products


@_jit.kernel(by_address=True, readonly=("b",), cache=False)
def _scaled_sum(a, b, scale=2.0):
    """a += scale * b; returns sum(a); raises on a negative scale."""
    if scale < 0:
        raise ValueError("negative scale")
    s = 0.0
    for i in range(a.shape[0]):
        a[i] += scale * b[i]
        s += a[i]
    return s


@_jit.kernel(cache=False)
def _caller(a, b, scale):
    return _scaled_sum(a, b) + _scaled_sum(a, b, scale)


def test_a_call_by_symbol_computes_what_the_function_does_with_its_defaults():
    a, b = np.arange(5.0), np.linspace(-1, 1, 5)
    want_a = a + 2.0 * b
    want = want_a.sum()
    want_a = want_a + 0.5 * b
    want += want_a.sum()
    got = _caller(a, b, 0.5)
    np.testing.assert_allclose(got, want, rtol=1e-15)
    np.testing.assert_allclose(a, want_a, rtol=1e-15)


def test_an_error_in_the_callee_reaches_the_caller():
    with pytest.raises(ValueError, match="negative scale"):
        _caller(np.zeros(3), np.ones(3), -1.0)


def test_read_only_and_writable_arguments_share_one_compilation():
    b = np.ones(4)
    frozen = b.copy()
    frozen.flags.writeable = False
    _caller(np.zeros(4), b, 1.0)
    _caller(np.zeros(4), frozen, 1.0)
    assert len(_scaled_sum.impl.overloads) == 1
    (argtypes,) = _scaled_sum.impl.overloads
    assert not argtypes[1].mutable and argtypes[0].mutable


def test_the_wrapper_keeps_the_name_docstring_and_defaults():
    assert _scaled_sum.py_func.__qualname__ == "_scaled_sum"
    assert _scaled_sum.__doc__.startswith("a += scale * b")
    assert _scaled_sum.py_func.__defaults__ == (2.0,)
    with pytest.raises(ValueError, match="no parameters"):
        _jit.kernel(by_address=True, readonly=("nope",))(lambda a: a)
    with pytest.raises(ValueError, match="by_address"):
        _jit.kernel(readonly=("a",))
    with pytest.raises(ValueError, match="inlined"):
        _jit.kernel(by_address=True, inline="always")


def test_a_compiled_library_names_the_kernels_it_calls_by_symbol():
    # A product that calls another product's loops names nothing; one that another kernel calls
    # through its symbol is named by that kernel's library, with its argument types.
    X = np.ones((3, 8), np.float32)
    S = np.ones((8, 16), np.float32)
    out = np.empty((3, 16), np.float32)
    products.combine_rows(X, S, out)  # the wrapper compiled from Python: it calls the symbol
    np.testing.assert_allclose(out, X @ S)
    cres = next(iter(products.combine_rows.overloads.values()))
    callees = _link.linked_callees(cres.library)
    assert [(m, q) for _, m, q, _ in callees] == [("racecpu._kernels.products", "combine_rows")]
    sym, module, qualname, argtypes = callees[0]
    assert not argtypes[0].mutable  # X passed read-only (readonly=("X", "S"))
    _link.relink(callees)  # what a cache load does: nothing to compile, the same symbol
    with pytest.raises(LookupError):  # an entry whose symbol this process would name otherwise
        _link.relink([(sym + "x", module, qualname, argtypes)])



@_jit.kernel(cache=False)
def _allocating_total(n):
    """The sum of a fresh array of n ones: needs Numba's reference counts (an allocation)."""
    return np.ones(n).sum()


@_jit.kernel(by_address=True, cache=False)
def _rows_counted(a, t):
    """a[i, :] += t for every row, through a view of each row (a view counts a reference)."""
    for i in range(a.shape[0]):
        row = a[i]
        row += t


@_jit.kernel(by_address=True, refcounts=False, cache=False)
def _rows_uncounted(a, t):
    """:func:`_rows_counted` without reference counts, element by element (a symbol names one
    function: two kernels made from one Python function would share it)."""
    for i in range(a.shape[0]):
        row = a[i]
        for j in range(row.shape[0]):
            row[j] += t


@_jit.kernel(by_address=True, refcounts=False, cache=False)
def _uncounted_leaf(a, n):
    """a[i, :] += the sum of n ones, for every row, without reference counts of its own."""
    _rows_uncounted(a, _allocating_total(n))


@_jit.kernel(cache=False)
def _calls_both(a, n):
    _uncounted_leaf(a, n)
    _rows_counted(a, 1.0)
    return a.sum()


def test_a_kernel_without_reference_counts_calls_one_that_keeps_them():
    # kernel(refcounts=False) compiles a leaf with _nrt=False: its own views count nothing (the
    # same code with counts does). A kernel it compiles first (here one that allocates) keeps its
    # counts: every kernel sets the flag, else Numba would pass the caller's False on and the
    # allocation would not compile.
    a = np.zeros((2, 3))
    assert _calls_both(a, 3) == 24.0
    np.testing.assert_array_equal(a, 4.0)
    uncounted = next(iter(_rows_uncounted.impl.inspect_llvm().values()))
    counted = next(iter(_rows_counted.impl.inspect_llvm().values()))
    assert "NRT_incref" in counted or "NRT_decref" in counted
    assert "NRT_incref" not in uncounted and "NRT_decref" not in uncounted
    with pytest.raises(ValueError, match="by_address"):
        _jit.kernel(refcounts=False)(lambda a: a)

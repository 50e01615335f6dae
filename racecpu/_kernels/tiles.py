"""Register tiles of the kernels' thin products, written as LLVM vector IR.

Numba's loops reach the hash projection (``(n, d) x (d, L*P)``), the
cotangents ``y = S g`` (``(n, dv) x (dv, F)``) and ``dx = du W``
(``(n, L*P) x (L*P, d)``) only through LLVM's auto-vectoriser, which keeps
each dot product's partial sums in 256-bit vectors and sums every one of
them across its lanes on its own.  These intrinsics hold a whole tile of
outputs in VECTOR_BYTES-byte vectors (64 with AVX-512: 16 float32 or 8
float64 lanes; 32 otherwise) and, for dot products, sum a tile's partial
sums across lanes together, in one tree of shuffles (docs/performance.md,
"dot tiles" and "combine tiles").  Transposed combine tiles (``tn_*``) give
``X^T S``, the planes' gradient ``du^T x`` ("planes' gradient").

``comb_tile_lines`` and ``comb_tile_pieces`` write their outputs with
non-temporal stores (whole vectors, or 16-byte pieces of them): the
kernels' results (out, dq, dk, dv) are written once and not read again
by them, and at scale a plain store first reads every line it writes.

The tiles compute in the dtype of ``X``; ``S`` is converted to it on load,
``Y`` from it on store.  Callers (``products.dot_rows``,
``products.combine_rows``, ``products.tn_product``) pick the tiles, check the layouts they need and
handle the edges with plain loops.

``prefetch_lines`` asks for lines of memory ahead of their use (the soft
hash's next block of rows, ``hash.hash_block``).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic



def _vector_bytes():
    """64 where the CPU Numba compiles for has AVX-512, else 32: a tile of
    16 64-byte vectors would take 32 of AVX2's 16 vector registers."""
    from numba.core import config
    if config.CPU_FEATURES:  # NUMBA_CPU_FEATURES: what the code is compiled for
        return 64 if "+avx512f" in config.CPU_FEATURES else 32
    if config.CPU_NAME and config.CPU_NAME != "host":
        return 32
    try:
        import llvmlite.binding as ll
        return 64 if ll.get_host_cpu_features().get("avx512f") else 32
    except Exception:  # no feature list on this platform
        return 32


#: Bytes of one vector of a tile.
VECTOR_BYTES = _vector_bytes()
#: Rows of X in a dot-product tile; it has VECTOR_BYTES / itemsize outputs, so
#: TILE_ROWS rows times (lanes / TILE_ROWS) rows of S (4 x 4 for float32).
TILE_ROWS = 4
#: Vectors of S's columns in a combine tile, for each of its rows of X.
COMB_VECTORS = 4
#: Rows of X in a combine tile: 4 x COMB_VECTORS accumulators take 16 of
#: AVX-512's 32 vector registers and hide the FMAs' latency (docs/performance.md,
#: "combine tiles"); AVX2 has 16 registers in all, so 2 rows there.
COMB_ROWS = 4 if VECTOR_BYTES == 64 else 2


def _lanes(dtype):
    return VECTOR_BYTES // (dtype.bitwidth // 8)


def _float(context, dtype):
    return context.get_data_type(dtype)


def _convert(builder, value, to):
    """fpext / fptrunc of a scalar or vector float to the float type (or vector of it) ``to``."""
    frm = value.type.element if isinstance(value.type, ir.VectorType) else value.type
    dst = to.element if isinstance(to, ir.VectorType) else to
    if frm == dst:
        return value
    wider = isinstance(dst, ir.DoubleType)
    return builder.fpext(value, to) if wider else builder.fptrunc(value, to)


class _Arrays:
    """Element pointers into Numba arrays by (row, column), from their byte strides."""

    def __init__(self, context, builder, arrtypes, values):
        self.builder = builder
        self.arrays = [context.make_array(t)(context, builder, v) for t, v in zip(arrtypes, values)]
        self.strides = [cgutils.unpack_tuple(builder, a.strides) for a in self.arrays]
        self.intp = context.get_value_type(types.intp)

    def const(self, v):
        return ir.Constant(self.intp, v)

    def ptr(self, i, row, col, ty):
        b = self.builder
        st = self.strides[i]
        off = b.add(b.mul(row, st[0]), b.mul(col, st[1]))
        base = b.bitcast(self.arrays[i].data, ir.IntType(8).as_pointer())
        return b.bitcast(b.gep(base, [off]), ty.as_pointer())


def _tile_intrinsic(emit):
    """A Numba intrinsic ``tile(A, B, C, o0, o1)`` over three float arrays and two
    intp offsets (other argument types: Numba's typing error) whose body is
    ``emit(context, builder, sig, arr, o0, o1)``, ``arr`` an :class:`_Arrays` of A, B, C."""

    @intrinsic
    def tile(typingctx, A, B, C, o0, o1):
        if not all(isinstance(a, types.Array) and isinstance(a.dtype, types.Float) for a in (A, B, C)):
            return None

        def codegen(context, builder, sig, args):
            emit(context, builder, sig, _Arrays(context, builder, sig.args[:3], args[:3]), *args[3:])
            return context.get_dummy_value()

        return types.void(A, B, C, types.intp, types.intp), codegen

    return tile


def _fma(builder, vty):
    suffix = "v%d%s" % (vty.count, "f64" if isinstance(vty.element, ir.DoubleType) else "f32")
    fnty = ir.FunctionType(vty, [vty] * 3)
    return cgutils.get_or_insert_function(builder.module, fnty, "llvm.fma." + suffix)


def _accumulators(builder, vty, count):
    zero = ir.Constant(vty, [ir.Constant(vty.element, 0.0)] * vty.count)
    return [cgutils.alloca_once_value(builder, zero) for _ in range(count)]


def tree_order(lanes):
    """Input order of :func:`tree_sum`: lane ``i`` of its result sums input ``tree_order(lanes)[i]``."""
    return _tree(None, [None] * lanes, lanes)[1]


def tree_sum(builder, vectors):
    """One vector whose lane i is the sum of the lanes of ``vectors[tree_order(n)[i]]``,
    for n vectors of n lanes: log2(n) levels, each adding the halves of pairs
    of vectors (two shuffles and an add per pair), n - 1 adds in all against
    n * log2(n) for summing each vector across its lanes on its own."""
    return _tree(builder, vectors, len(vectors))[0]


def _tree(builder, vectors, n):
    cur = [(v, [i]) for i, v in enumerate(vectors)]  # (vector, the input each group of lanes sums)
    width = n
    while width > 1:
        h = width // 2
        nxt = []
        for (a, ga), (b, gb) in zip(cur[0::2], cur[1::2]):
            lo, hi, groups = [], [], []
            for g in range(n // width):  # group g (width lanes) of a and of b -> two groups of h lanes
                base = g * width
                lo += list(range(base, base + h)) + list(range(n + base, n + base + h))
                hi += list(range(base + h, base + width)) + list(range(n + base + h, n + base + width))
                groups += [ga[g], gb[g]]
            s = None
            if builder is not None:
                mask = lambda idx: ir.Constant(ir.VectorType(ir.IntType(32), n), idx)  # noqa: E731
                s = builder.fadd(builder.shuffle_vector(a, b, mask(lo)),
                                 builder.shuffle_vector(a, b, mask(hi)), flags=("fast",))
            nxt.append((s, groups))
        cur = nxt
        width = h
    return cur[0]


def _dot_tile(by_row, single=False):
    """Intrinsic ``tile(S, X, Y, j0, m0)``: Y[j0 + r, m0 + m] = S[m0 + m, :] . X[j0 + r, :]
    for r < TILE_ROWS, m < lanes / TILE_ROWS (``single``: r < lanes, m = 0);
    the rows' length a multiple of the lanes.

    ``by_row``: Y's columns are contiguous (each row of X gets one vector
    store); else Y's rows are (each row of S gets one).
    """

    def emit(context, builder, sig, arr, j0v, m0v):  # arrays S, X, Y
        dv = cgutils.unpack_tuple(builder, arr.arrays[0].shape)[1]
        fty = _float(context, sig.args[1].dtype)
        n = _lanes(sig.args[1].dtype)
        rows, cols = (n, 1) if single else (TILE_ROWS, n // TILE_ROWS)
        vty = ir.VectorType(fty, n)
        sty = ir.VectorType(_float(context, sig.args[0].dtype), n)
        fma = _fma(builder, vty)
        acc = _accumulators(builder, vty, rows * cols)  # acc[r * cols + m]; promoted to registers
        steps = builder.udiv(dv, arr.const(n))
        with cgutils.for_range(builder, steps) as loop:
            c = builder.mul(loop.index, arr.const(n))
            xs = [builder.load(arr.ptr(1, builder.add(j0v, arr.const(r)), c, vty), align=1)
                  for r in range(rows)]
            for m in range(cols):
                s = builder.load(arr.ptr(0, builder.add(m0v, arr.const(m)), c, sty), align=1)
                s = _convert(builder, s, vty)
                for r in range(rows):
                    a = acc[r * cols + m]
                    builder.store(builder.call(fma, [xs[r], s, builder.load(a)]), a)
        # lane i of the sum holds output i (row-major: i = r cols + m, else i = m rows + r)
        order = tree_order(n)
        inputs = [None] * n
        for i in range(n):
            r, m = divmod(i, cols) if by_row else divmod(i, rows)[::-1]
            inputs[order[i]] = builder.load(acc[r * cols + m])
        total = tree_sum(builder, inputs)
        yty = _float(context, sig.args[2].dtype)
        width, count = (cols, rows) if by_row else (rows, cols)
        part_ty = ir.VectorType(yty, width)
        for o in range(count):
            idx = ir.Constant(ir.VectorType(ir.IntType(32), width), list(range(o * width, (o + 1) * width)))
            part = _convert(builder, builder.shuffle_vector(total, total, idx), part_ty)
            if by_row:
                p = arr.ptr(2, builder.add(j0v, arr.const(o)), m0v, part_ty)
            else:
                p = arr.ptr(2, j0v, builder.add(m0v, arr.const(o)), part_ty)
            builder.store(part, p, align=1)

    return _tile_intrinsic(emit)


#: Dot-product tiles storing along Y's rows / along Y's columns (see :func:`_dot_tile`).
dot_tile_rows = _dot_tile(True)
dot_tile_cols = _dot_tile(False)
#: One row of S by a vector's worth of rows of X, storing along Y's columns
#: (the 9th plane of the hash's 9, where TILE_ROWS x 4 tiles cover 8).
dot_tile_cols1 = _dot_tile(False, single=True)


def _store_stream(builder, arr, i, row, col, value, whole):
    """Store vector ``value`` at (row, col) of array ``i`` of ``arr`` (an :class:`_Arrays`)
    with non-temporal stores: whole (``whole``: the address must be on the
    vector's size) or as 16-byte pieces (the address must be on 16 bytes)."""
    size = 8 if isinstance(value.type.element, ir.DoubleType) else 4
    piece = value.type.count if whole else 16 // size
    align = piece * size
    pty = ir.VectorType(value.type.element, piece)
    nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
    for q in range(0, value.type.count, piece):
        part = value
        if not whole:
            idx = ir.Constant(ir.VectorType(ir.IntType(32), piece), list(range(q, q + piece)))
            part = builder.shuffle_vector(value, value, idx)
        p = arr.ptr(i, row, builder.add(col, arr.const(q)), pty)
        builder.store(part, p, align=align).set_metadata("nontemporal", nontemporal)


def _combine_sums(context, builder, sig, arr, i0v, c0v, rows, cols, transposed, split=1):
    """The sums of a combine tile (:func:`_comb_tile`) over arrays 0 (X) and 1 (S) of ``arr``,
    in X's dtype: ``rows * cols`` accumulators (row-major, promoted to registers) and the lanes
    of a vector (of 1/``split`` of VECTOR_BYTES).  Each element is a chain of FMAs from zero
    over S's rows in order."""
    fty = _float(context, sig.args[0].dtype)
    n = _lanes(sig.args[0].dtype) // split
    vty = ir.VectorType(fty, n)
    sty = ir.VectorType(_float(context, sig.args[1].dtype), n)
    fma = _fma(builder, vty)
    acc = _accumulators(builder, vty, rows * cols)
    K = cgutils.unpack_tuple(builder, arr.arrays[0].shape)[0 if transposed else 1]
    undef = ir.Constant(vty, ir.Undefined)
    splat = ir.Constant(ir.VectorType(ir.IntType(32), n), [0] * n)
    with cgutils.for_range(builder, K) as loop:
        k = loop.index
        s = [_convert(builder, builder.load(arr.ptr(1, k, builder.add(c0v, arr.const(v * n)), sty), align=1),
                      vty) for v in range(cols)]
        for r in range(rows):
            i = builder.add(i0v, arr.const(r))
            x = builder.load(arr.ptr(0, k, i, fty) if transposed else arr.ptr(0, i, k, fty))
            xb = builder.shuffle_vector(builder.insert_element(undef, x, ir.Constant(ir.IntType(32), 0)),
                                        undef, splat)
            for v in range(cols):
                a = acc[r * cols + v]
                builder.store(builder.call(fma, [xb, s[v], builder.load(a)]), a)
    return acc, n


def _comb_tile(rows, store, cols=COMB_VECTORS, transposed=False, split=1):
    """Intrinsic ``tile(X, S, out, i0, c0)``: out[i0 + r, c0:c0 + w] = X[i0 + r, :] S[:, c0:c0 + w]
    for r < ``rows``, w = ``cols`` vectors (overwriting): per row of S, its w
    columns are loaded once and feed every row.  ``transposed``: X is read
    as its transpose, out[i0 + r, c0:c0 + w] = X[:, i0 + r]^T S[:, c0:c0 + w]
    (``X (K, >= i0 + rows)``, a row of X's elements per row of S).

    ``store``: ``"plain"``, or out written with non-temporal stores,
    ``"pieces"`` of 16 bytes (out's rows must start on 16 bytes) or
    ``"lines"``, whole vectors (out's rows must start on a vector: lanes
    of X times out's itemsize); :func:`stream_fence`
    orders them.  They skip the read of each line that a plain store makes
    before writing it, so a result that is only written, not read again
    soon, goes out faster.  Pieces leave lines part-written while a tile's
    rows are in flight, so they take 2-row tiles; whole aligned vectors
    complete a line per store (docs/performance.md, "streamed stores").  ``split``: vectors of
    1/split of VECTOR_BYTES (the half vector past a row's last whole one).
    """

    def emit(context, builder, sig, arr, i0v, c0v):  # arrays X, S, out
        acc, n = _combine_sums(context, builder, sig, arr, i0v, c0v, rows, cols, transposed, split)
        oty = ir.VectorType(_float(context, sig.args[2].dtype), n)
        for r in range(rows):
            row = builder.add(i0v, arr.const(r))
            for v in range(cols):
                val = _convert(builder, builder.load(acc[r * cols + v]), oty)
                col = builder.add(c0v, arr.const(v * n))
                if store == "plain":
                    builder.store(val, arr.ptr(2, row, col, oty), align=1)
                else:
                    _store_stream(builder, arr, 2, row, col, val, store == "lines")

    return _tile_intrinsic(emit)


#: Combine tiles with plain stores, non-temporal 16-byte pieces and whole
#: non-temporal vectors (see :func:`_comb_tile`).
comb_tile = _comb_tile(COMB_ROWS, "plain")
comb_tile_pieces = _comb_tile(2, "pieces")
comb_tile_lines = _comb_tile(COMB_ROWS, "lines")
#: Their one-vector siblings, for the columns past the last whole tile: rows of
#: F = 24 values (the causal steps' ``M Phik``) are no tile wide, and LLVM's
#: vectoriser, unrolled four vectors deep, left a loop that short scalar.
comb_vec = _comb_tile(COMB_ROWS, "plain", 1)
#: Rows of X in a taller one-vector tile: 8 accumulators, as many FMAs in flight as a whole
#: combine tile has, where COMB_ROWS' 2 (AVX2) each wait on the last FMA's result
#: (docs/performance.md, "tall one-vector tiles").
VEC_ROWS = 8
comb_vec_tall = _comb_tile(VEC_ROWS, "plain", 1)
#: Half-vector tiles, for a row's half vector past its last whole one: F = 24 float32 columns are
#: 16 + 8 at AVX-512's 16 lanes, and the loops took the 8 one value at a time.
comb_half_tall = _comb_tile(VEC_ROWS, "plain", 1, split=2)
comb_half = _comb_tile(COMB_ROWS, "plain", 1, split=2)
comb_vec_pieces = _comb_tile(2, "pieces", 1)
comb_vec_lines = _comb_tile(COMB_ROWS, "lines", 1)

#: Accumulators of a transposed combine tile (``out = X^T S``: the planes'
#: gradient ``du^T x``, X = du with L*P columns, S the chunk's rows of q or k):
#: 16 of AVX-512's 32 vector registers, 8 of AVX2's 16.
TN_ACC = 16 if VECTOR_BYTES == 64 else 8
#: Transposed combine tiles 8, 4 and 2 vectors wide (TN_ACC / width rows of
#: out), and one row of out by 8, 4 and 2 vectors for the last rows.  Wide
#: first: a tile of 8 vectors reads whole 512-byte rows of float32 x at d = 128
#: in order, which memory streams; tiles of 2 vectors read every row in four
#: strided passes, 1.5x slower from memory though faster in cache
#: (docs/performance.md, "planes' gradient").
tn_tile8 = _comb_tile(TN_ACC // 8, "plain", 8, True)
tn_tile4 = _comb_tile(TN_ACC // 4, "plain", 4, True)
tn_tile2 = _comb_tile(TN_ACC // 2, "plain", 2, True)
tn_row8 = _comb_tile(1, "plain", 8, True)
tn_row4 = _comb_tile(1, "plain", 4, True)
tn_row2 = _comb_tile(1, "plain", 2, True)


def _tn_add_tile(rows, targets):
    """Intrinsic ``tile(w, x, S, T, f0, c0)``: a transposed combine tile two
    vectors wide, ``t = w[:, f0 + r]^T x[:, c0:c0 + 2 lanes]`` for r < ``rows``
    (each element summed from zero over w's rows in order, as ``tn_tile2`` sums it), added
    to ``S[f0 + r, c0:...]`` and, with ``targets`` 2, to ``T``'s same elements,
    in their dtype: a scan step's state update and its chunk total
    (:func:`racecpu._kernels.products.add_product`) without storing ``t`` and
    reading it back, the same bits as ``tn_tile2`` then ``S += t``."""

    @intrinsic
    def tile(typingctx, w, x, S, T, f0, c0):
        if not all(isinstance(a, types.Array) and isinstance(a.dtype, types.Float) for a in (w, x, S, T)):
            return None

        def codegen(context, builder, sig, args):
            arr = _Arrays(context, builder, sig.args[:4], args[:4])
            f0v, c0v = args[4], args[5]
            acc, n = _combine_sums(context, builder, sig, arr, f0v, c0v, rows, 2, True)
            for r in range(rows):
                row = builder.add(f0v, arr.const(r))
                for v in range(2):
                    col = builder.add(c0v, arr.const(v * n))
                    t = builder.load(acc[r * 2 + v])
                    for i in range(2, 2 + targets):
                        oty = ir.VectorType(_float(context, sig.args[i].dtype), n)
                        p = arr.ptr(i, row, col, oty)
                        old = builder.load(p, align=1)
                        tt = _convert(builder, t, oty)
                        builder.store(builder.fadd(old, tt), p, align=1)
            return context.get_dummy_value()

        return types.void(w, x, S, T, types.intp, types.intp), codegen

    return tile


#: Rows of an add tile (two vectors wide): 12 accumulators of AVX2's 16 vector registers (two
#: more hold the row of x, one the broadcast), a third more work per load of x than the 8 of
#: ``tn_tile2``, with a scan step's 8 FMAs per accumulator (docs/performance.md, "add tiles");
#: 16 of AVX-512's 32.
ADD_ROWS = 8 if VECTOR_BYTES == 64 else 6
#: Transposed tiles whose product is added to one array (``S``; ``T`` unused) or to two (``S``
#: and ``T``) instead of stored, ADD_ROWS rows or one: see :func:`_tn_add_tile`.
tn_add_tile = _tn_add_tile(ADD_ROWS, 1)
tn_add_row = _tn_add_tile(1, 1)
tn_add2_tile = _tn_add_tile(ADD_ROWS, 2)
tn_add2_row = _tn_add_tile(1, 2)


#: Bytes of the blocks :func:`transpose_tile` moves (8 float32 or 4 float64 a side): 32, not
#: VECTOR_BYTES, so the hash's F = 24 soft buckets (P = 3) take whole blocks on AVX-512 too.
TRANSPOSE_BYTES = 32


def transpose_side(dtype):
    """The side of :func:`transpose_tile`'s square blocks for ``dtype`` (a NumPy float dtype)."""
    return TRANSPOSE_BYTES // dtype.itemsize


@intrinsic
def transpose_tile(typingctx, X, Y, i0, j0):
    """Y[j0 + b, i0 + a] = X[i0 + a, j0 + b] for a, b < k (:func:`transpose_side` of X's
    dtype): k vector loads of X's rows, log2(k) rounds of interleaving shuffles and k vector
    stores into Y's rows, where a loop of scalar loads and stores took one of each per value
    (the soft hash's plane-major scratch into the rows of t and phi: docs/performance.md,
    "hash stores").  Both arrays' rows must be contiguous (strides[1] == itemsize); Y's
    dtype may differ from X's (converted on store)."""
    if not (isinstance(X, types.Array) and isinstance(Y, types.Array) and X.ndim == 2 and Y.ndim == 2
            and isinstance(X.dtype, types.Float) and isinstance(Y.dtype, types.Float)
            and isinstance(i0, types.Integer) and isinstance(j0, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        arr = _Arrays(context, builder, sig.args[:2], args[:2])
        i0v, j0v = (context.cast(builder, v, t, types.intp) for v, t in zip(args[2:], sig.args[2:]))
        fty = _float(context, sig.args[0].dtype)
        k = TRANSPOSE_BYTES // (sig.args[0].dtype.bitwidth // 8)
        vty = ir.VectorType(fty, k)
        oty = ir.VectorType(_float(context, sig.args[1].dtype), k)
        rows = [builder.load(arr.ptr(0, builder.add(i0v, arr.const(a)), j0v, vty), align=1) for a in range(k)]
        # Each round interleaves row a with row a + k/2 (low halves, then high): after
        # log2(k) rounds row b holds column b.
        half = k // 2
        lo = ir.Constant(ir.VectorType(ir.IntType(32), k), [i // 2 + (k if i % 2 else 0) for i in range(k)])
        hi = ir.Constant(ir.VectorType(ir.IntType(32), k), [half + i // 2 + (k if i % 2 else 0) for i in range(k)])
        for _ in range(k.bit_length() - 1):
            nxt = []
            for a in range(half):
                nxt += [builder.shuffle_vector(rows[a], rows[a + half], lo),
                        builder.shuffle_vector(rows[a], rows[a + half], hi)]
            rows = nxt
        for b in range(k):
            builder.store(_convert(builder, rows[b], oty), arr.ptr(1, builder.add(j0v, arr.const(b)), i0v, oty),
                          align=1)
        return context.get_dummy_value()

    return types.void(X, Y, i0, j0), codegen


@intrinsic
def stream_fence(typingctx):
    """A full memory fence: the non-temporal stores before it (weakly ordered
    on x86) are seen by other threads before anything stored after it; once
    per task, after its streamed rows."""
    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def prefetch_lines(typingctx, addr, first, count):
    """Prefetch the 64-byte lines ``first .. first + count - 1`` from address
    ``addr`` (an integer: no array, so no reference counts) into L2
    (``llvm.prefetch``, locality 2: ``prefetcht1`` on x86).  A hint: it never
    faults, and does nothing where the target has no prefetch instruction."""
    if not all(isinstance(a, types.Integer) for a in (addr, first, count)):
        return None

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        i32 = ir.IntType(32)
        i8p = ir.IntType(8).as_pointer()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        base, first, count = (context.cast(builder, v, t, types.int64) for v, t in zip(args, sig.args))
        with cgutils.for_range(builder, count) as loop:
            line = builder.add(first, loop.index)
            a = builder.add(base, builder.mul(line, ir.Constant(i64, 64)))
            # rw = 0 (read), locality 2, cache type 1 (data)
            builder.call(fn, [builder.inttoptr(a, i8p), ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(addr, first, count), codegen

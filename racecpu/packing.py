"""Packed sequences: several documents on one sequence axis, each attending only within itself.

``cu_seqlens`` follows flash-attn and flash-linear-attention: the int32
offsets ``0, n1, n1 + n2, ..., N`` of the packed sequences on the sequence
axis.  The kernels see each sequence start at a chunk boundary: a sequence
whose length is not a multiple of the chunk is followed by masked padding
rows up to the next one (none after the last), so that the causal scans
restart at the first chunk of every sequence and the non-causal queries of
a chunk read their own sequence's sketch, both by the chunk's index into
``seq`` (``docs/design.md``, "packed sequences").  The chunk is the longest
power of two from config.CHUNK down to :data:`MIN_CHUNK` whose padding
stays within 1/32 of the tokens; where the sequences already start at chunk
boundaries nothing is copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import config

#: The shortest chunk packing picks (shorter ones cost more per token than the padding they save).
MIN_CHUNK = 64

#: The padding packing accepts for a longer chunk, as a fraction of the tokens.
PAD_FRACTION = 1 / 32


@dataclass(frozen=True)
class Packing:
    """Where each packed sequence lies in the kernels' layout (treat as opaque).

    ``n`` tokens on the caller's axis, ``padded`` rows on the kernels'
    (``padded >= n``); ``rows (n,)`` int64 is each token's row there (None
    where the rows are the tokens: nothing to copy); ``seq (nc,)`` int64 is
    each chunk's sequence, counting the non-empty ones only, ``first (S,)``
    int64 each one's first chunk.
    """

    cu_seqlens: np.ndarray
    n: int
    chunk: int
    padded: int
    rows: np.ndarray | None
    seq: np.ndarray
    first: np.ndarray

    @property
    def sequences(self):
        """The number of non-empty sequences (sketches per head, non-causal)."""
        return self.first.size


def check_cu_seqlens(cu_seqlens, n):
    """``cu_seqlens`` as int64 after checking it: 1-D, integer, 0 first, ``n`` last, non-decreasing."""
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least two offsets (0, ..., N), got shape {cu.shape}")
    if cu.dtype.kind not in "iu":
        raise TypeError(f"cu_seqlens must hold integers (int32 offsets, as flash-attn's), got {cu.dtype}")
    cu = cu.astype(np.int64)
    if cu[0] != 0 or cu[-1] != n:
        raise ValueError(f"cu_seqlens must run from 0 to the sequence length {n}, got {cu[0]} .. {cu[-1]}")
    if np.any(np.diff(cu) < 0):
        at = int(np.argmax(np.diff(cu) < 0))
        raise ValueError(f"cu_seqlens must not decrease, got {cu[at]} then {cu[at + 1]} at offsets {at}, {at + 1}")
    return cu


def _padded_length(lengths, chunk):
    """Rows of the layout in which every sequence but the last starts at a multiple of ``chunk``."""
    if lengths.size == 0:
        return 0
    return int((-(-lengths[:-1] // chunk) * chunk).sum() + lengths[-1])


def packing(cu_seqlens, n, min_chunk=MIN_CHUNK, max_chunk=None, multiple=1):
    """The :class:`Packing` of sequences with offsets ``cu_seqlens`` over ``n`` tokens.

    ``min_chunk``: the shortest chunk the kernels may use (the float64
    partials' budget, :func:`racecpu._kernels.budget_chunk`; at least
    :data:`MIN_CHUNK`); ``max_chunk`` the longest tried (default
    config.CHUNK), halved from there; ``multiple``: every chunk tried is one
    of it (racecpu.cuda: whole tiles).
    """
    cu = check_cu_seqlens(cu_seqlens, n)
    lengths = np.diff(cu)
    lengths = lengths[lengths > 0]

    def whole(c):
        return -(-c // multiple) * multiple
    chunk = whole(max(config.CHUNK if max_chunk is None else max_chunk, min_chunk))
    while _padded_length(lengths, chunk) - n > n * PAD_FRACTION:
        shorter = whole(chunk // 2)
        if shorter >= chunk or shorter < max(MIN_CHUNK, min_chunk):
            break
        chunk = shorter
    padded = _padded_length(lengths, chunk)
    starts = np.zeros(lengths.size, np.int64)  # each non-empty sequence's first row in the layout
    starts[1:] = np.cumsum(-(-lengths[:-1] // chunk) * chunk)
    first = starts // chunk
    nc = -(-padded // chunk)
    seq = np.zeros(nc, np.int64)
    if first.size > 1:
        seq[first[1:]] = 1
        seq = np.cumsum(seq)
    rows = None
    if padded != n:
        rows = np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(n)
    return Packing(cu, n, chunk, padded, rows, seq, first)


def pack(x, pk, fill=0):
    """``x (G, n, ...)`` in the kernels' layout ``(G, padded, ...)``: ``x`` itself where
    nothing moves, else a copy with ``fill`` in the padding rows."""
    if pk.rows is None:
        return x
    y = np.full((x.shape[0], pk.padded) + x.shape[2:], fill, x.dtype)
    y[:, pk.rows] = x
    return y


def unpack(y, pk, out=None):
    """The tokens' rows of ``y (G, padded, ...)``: ``(G, n, ...)`` (``y`` itself where nothing moved)."""
    if pk.rows is None:
        if out is not None:
            out[...] = y
            return out
        return y
    return np.take(y, pk.rows, axis=1, out=out)


def sequence_sums(part, pk):
    """``part (G, nc, ...)``, one total per chunk, summed per sequence: ``(G, S, ...)`` float64."""
    if part.shape[1] == 0:
        return np.zeros((part.shape[0], pk.sequences) + part.shape[2:])
    return np.add.reduceat(part, pk.first, axis=1)

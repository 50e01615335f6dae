"""Packed sequences: several documents on one sequence axis, each attending only within itself.

``cu_seqlens`` follows flash-attn and flash-linear-attention: the int32
offsets ``0, n1, n1 + n2, ..., N`` of the packed sequences on the sequence
axis.  The CPU kernels cut the axis into chunks that never straddle two
sequences (:func:`packed_chunks`: each sequence in chunks of the usual
length, its last one shorter), so the causal scans restart at the first
chunk of every sequence and the non-causal queries of a chunk read their
own sequence's sketch, both by the chunk's index into ``seq``
(``docs/design.md``, "packed sequences"); nothing is copied or padded.
:mod:`racecpu.cuda`, whose kernels walk whole tiles, lays the sequences out
padded to whole chunks instead (:func:`padded_layout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import config

#: The shortest chunk :func:`padded_layout` picks.
MIN_CHUNK = 64

#: What a chunk costs beyond its tokens, in tokens' worth of work, non-causal and causal: the
#: float64 partials of every chunk (F * (dv + 1) each, written, summed and, in the backward,
#: written again) and the per-task setup.  Fitted to forward+backward times of racecpu's CPU
#: kernels, 4 heads of 65,536 tokens at d = dv = 128, P = L = 3 on 2 cores, every sequence one
#: chunk long (chunks of 64, 128, 256, 512, 1024 tokens: non-causal 4.3, 2.2, 1.4, 1.17, 1.05x one
#: sequence; causal 1.22, 1.15, 1.09, 1.06, 1.05x); used for racecpu.cuda's padded layout, where
#: it has not been measured.
CHUNK_OVERHEAD = {False: 150, True: 20}


def check_packed_lengths(nq, nk):
    """ValueError unless q and k have one sequence length (``cu_seqlens`` packs q, k and v alike)."""
    if nq != nk:
        raise ValueError(f"cu_seqlens packs q, k and v alike: they need the same sequence length, got {nq} and {nk}")


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


class Cuts(NamedTuple):
    """How a sequence axis is cut into chunks: chunk ``c`` is rows ``cuts[c] <= i <
    cuts[c + 1]`` (``cuts (nc + 1,)`` int64) of packed sequence ``seq[c]`` (``(nc,)``
    int64).  The engine hands them to the kernels as their ``Chunks`` bundle."""

    cuts: np.ndarray
    seq: np.ndarray


@dataclass(frozen=True)
class Packing:
    """Packed sequences as the CPU kernels take them (treat as opaque).

    ``chunks``: the :class:`Cuts` of the ``n`` tokens (chunk c is rows
    ``cuts[c] .. cuts[c + 1]`` of sequence ``seq[c]``, counting the
    non-empty sequences only); ``first (S,)`` int64 each sequence's first
    chunk.
    """

    cu_seqlens: np.ndarray
    n: int
    chunk: int
    chunks: Cuts
    first: np.ndarray

    @property
    def sequences(self):
        """The number of non-empty sequences (sketches per head, non-causal)."""
        return self.first.size


def _lengths(cu):
    lengths = np.diff(cu)
    return lengths[lengths > 0]


def packed_chunks(cu_seqlens, n, chunk):
    """The :class:`Packing` of sequences with offsets ``cu_seqlens`` over ``n`` tokens:
    each non-empty sequence in chunks of ``chunk`` tokens, its last one shorter."""
    cu = check_cu_seqlens(cu_seqlens, n)
    lengths = _lengths(cu)
    per = -(-lengths // chunk)  # chunks per sequence
    first = np.cumsum(per) - per
    seq = np.repeat(np.arange(lengths.size, dtype=np.int64), per)
    k = np.arange(seq.size, dtype=np.int64) - first[seq]  # chunk within its sequence
    starts = np.cumsum(lengths) - lengths
    cuts = np.append(starts[seq] + k * chunk, n).astype(np.int64)
    return Packing(cu, n, chunk, Cuts(cuts, seq), first.astype(np.int64))


def sequence_sums(part, pk):
    """``part (G, nc, ...)``, one total per chunk, summed per sequence: ``(G, S, ...)`` float64."""
    if part.shape[1] == 0:
        return np.zeros((part.shape[0], pk.sequences) + part.shape[2:])
    return np.add.reduceat(part, pk.first, axis=1)


@dataclass(frozen=True)
class PaddedLayout:
    """Packed sequences padded to whole chunks (racecpu.cuda).

    ``padded`` rows (``>= n``): every non-empty sequence starts at a multiple
    of ``chunk``, padding rows after each but the last; ``rows (n,)`` int64 is
    each token's row (None where the rows are the tokens); ``seq (nc,)`` each
    chunk's sequence, ``first (S,)`` each sequence's first chunk.
    """

    n: int
    chunk: int
    padded: int
    rows: np.ndarray | None
    seq: np.ndarray
    first: np.ndarray


def _padded_length(lengths, chunk):
    """Rows of the layout in which every sequence but the last starts at a multiple of ``chunk``."""
    if lengths.size == 0:
        return 0
    return int((-(-lengths[:-1] // chunk) * chunk).sum() + lengths[-1])


def padded_layout(cu_seqlens, n, min_chunk=MIN_CHUNK, max_chunk=None, multiple=1, causal=False):
    """The :class:`PaddedLayout` of sequences with offsets ``cu_seqlens`` over ``n`` tokens.

    The chunk is the one of ``max_chunk`` (default config.CHUNK), its half,
    its quarter, ... down to ``min_chunk`` (the float64 partials' budget) or
    :data:`MIN_CHUNK`, that costs least by the model ``padded rows * (1 +
    CHUNK_OVERHEAD[causal] / chunk)`` (the longer on a tie); ``multiple``:
    every chunk tried is one of it (racecpu.cuda: whole tiles).
    """
    cu = check_cu_seqlens(cu_seqlens, n)
    lengths = _lengths(cu)

    def whole(c):
        return -(-c // multiple) * multiple

    def cost(c):
        return _padded_length(lengths, c) * (1 + CHUNK_OVERHEAD[bool(causal)] / c)
    chunk = candidate = whole(max(config.CHUNK if max_chunk is None else max_chunk, min_chunk))
    while True:
        shorter = whole(candidate // 2)
        if shorter >= candidate or shorter < max(MIN_CHUNK, min_chunk):
            break
        candidate = shorter
        if cost(candidate) < cost(chunk):
            chunk = candidate
    padded = _padded_length(lengths, chunk)
    starts = np.zeros(lengths.size, np.int64)  # each non-empty sequence's first row in the layout
    starts[1:] = np.cumsum(-(-lengths[:-1] // chunk) * chunk)
    first = starts // chunk
    seq = np.zeros(-(-padded // chunk), np.int64)
    if first.size > 1:
        seq[first[1:]] = 1
        seq = np.cumsum(seq)
    rows = None
    if padded != n:
        rows = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(n)
    return PaddedLayout(n, chunk, padded, rows, seq, first)

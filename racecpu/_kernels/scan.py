"""How tokens are split into chunks, tasks and segments, and the scans that carry sums between them.

A *chunk* is the unit of parallel work and the longest run summed in the
compute dtype; sums across chunks are float64.  A *segment* is a run of
consecutive chunks that one task of the causal scan scans in order, carrying
the state itself; its first carry comes from a float64 exclusive scan of the
chunk totals before it (:func:`exclusive_scan`).  How long the chunks are and
how many segments a scan has is the plan's decision (:mod:`racecpu.plan`);
the helpers here turn it into task bounds.  ``docs/design.md`` (glossary)
defines the words.
"""

from __future__ import annotations

import numpy as np

from ._jit import kernel
from .bundles import Chunks


@kernel
def task_bounds(task, chunks):
    """Group, chunk and rows ``[lo, hi)`` of (group, chunk) task ``task`` (:class:`Chunks`)."""
    nc = chunks.seq.shape[0]
    g = task // nc
    c = task - g * nc
    return g, c, chunks.cuts[c], chunks.cuts[c + 1]


def even_chunks(n, chunk):
    """The :class:`Chunks` of ``n`` tokens of one sequence in chunks of ``chunk`` (the last shorter)."""
    nc = -(-n // chunk)
    return Chunks(np.minimum(np.arange(nc + 1, dtype=np.int64) * chunk, n), np.zeros(nc, np.int64))


def spread_order(G, nc, t0, t1):
    """Order of the ``G * nc`` (group, chunk) tasks of a parallel kernel in which
    the chunks ``t0 <= c < t1`` of every group cost more (they also sum a
    product total): those and the others each spread evenly over the order.
    ``prange`` hands every thread a contiguous share of the tasks, so in group
    and chunk order one thread would get all the costly chunks of one head.
    """
    heavy = np.zeros((G, nc), np.bool_)
    heavy[:, t0:t1] = True
    heavy = heavy.ravel()
    key = np.empty(G * nc)
    for m in (heavy, ~heavy):
        count = np.count_nonzero(m)
        key[m] = (np.arange(count) + 0.5) / max(count, 1)
    return np.argsort(key, kind="stable")


@kernel
def segment_start(s, segments, nc):
    """First chunk of segment ``s`` of ``segments`` over ``nc`` chunks (``nc`` for s = segments;
    see :func:`scan_segments`)."""
    return s * nc // segments


@kernel
def restarts(seq, c):
    """Whether chunk ``c`` begins a packed sequence after the first, where the scans
    restart from zero: ``seq (nc,)`` holds each chunk's sequence (false outside ``0 < c < nc``)."""
    return c > 0 and c < seq.shape[0] and seq[c] != seq[c - 1]


@kernel
def exclusive_step(part, out, acc):
    """out = acc, then acc += part (one chunk of an exclusive scan; ``out`` may be ``part``)."""
    for e in range(acc.shape[0]):
        x = part[e]  # read before the write
        out[e] = acc[e]
        acc[e] += x


@kernel
def _scan_chunks(part, segments, reverse, seq, out):
    """out[g, c] = sum of part[g, c'] over c' < c (c' > c: ``reverse``) of c's
    packed sequence (``seq``), in chunk order, for the first chunk c (in scan
    order) of each segment only."""
    G, nc, E = part.shape
    acc = np.empty(E)
    for g in range(G):
        acc[:] = 0.0
        for i in range(segments):
            s = segments - 1 - i if reverse else i
            c0 = segment_start(s, segments, nc)
            c1 = segment_start(s + 1, segments, nc)
            for j in range(c1 - c0):
                c = c1 - 1 - j if reverse else c0 + j
                if restarts(seq, c + 1 if reverse else c):
                    acc[:] = 0.0
                if j > 0:
                    for e in range(E):
                        acc[e] += part[g, c, e]
                elif i == segments - 1:  # the last segment: no total of it is summed (nor read)
                    for e in range(E):
                        out[g, c, e] = acc[e]
                    break
                else:
                    exclusive_step(part[g, c], out[g, c], acc)


def exclusive_scan(part, reverse=False, out=None, segments=None, seq=None):
    """Exclusive prefix (or suffix, ``reverse``) sums over axis 1 of float64 ``part (G, nc, ...)``.

    Sums run in chunk order, as ``np.cumsum`` would.  ``out`` (optional, like
    ``part``) may be ``part`` itself: the scan then allocates nothing (one
    pass on one thread, where np.cumsum went through temporaries:
    docs/performance.md, "exclusive scan").  ``segments``
    (default: one per chunk): only the sums at the first chunk, in scan
    order, of each segment (:func:`scan_segments`) are written, and only the
    chunks of the other segments are read (those :func:`sketch_chunks` and
    :func:`causal_queries_bwd` sum with their ``totals``); the same bits.
    ``seq`` (optional, int64 ``(nc,)``): each chunk's packed sequence; the
    sums restart at every sequence (default: one sequence).
    """
    if out is None:
        out = np.empty_like(part)
    if part.size:
        G, nc = part.shape[:2]
        _scan_chunks(part.reshape(G, nc, -1), nc if segments is None else segments, reverse,
                     np.zeros(nc, np.int64) if seq is None else seq, out.reshape(G, nc, -1))
    return out


@kernel
def segment_chunks(task, segments, nc):
    """Group and chunk range ``[c0, c1)`` of causal scan task ``task`` (:func:`segment_start`)."""
    g = task // segments
    s = task - g * segments
    return g, segment_start(s, segments, nc), segment_start(s + 1, segments, nc)


@kernel
def carry_on(carry, g, c, dst, total, final, reset):
    """carry[g, dst] = carry[g, c] + total (``final[g]`` when dst is past the
    chunks; float64 + the compute dtype), or 0 where ``reset`` (dst is in
    the next packed sequence), and total = 0: a segment's next carry, summed
    as :func:`exclusive_scan` sums the chunk totals."""
    F, dv = total.shape
    to = carry[g, dst] if 0 <= dst < carry.shape[1] else final[g]
    for f in range(F):
        if reset:
            for cc in range(dv):
                to[f, cc] = 0.0
        else:
            for cc in range(dv):
                to[f, cc] = carry[g, c, f, cc] + total[f, cc]
        for cc in range(dv):
            total[f, cc] = 0.0

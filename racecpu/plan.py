"""The plan of one call: how its tokens are cut into chunks, tasks and segments.

A :class:`Plan` is made once per forward or backward call (:func:`make_plan`)
from the shapes and flags of its arguments and the chunk model of the
backend that runs it (:class:`ChunkModel`), and read by everything below:
the CPU engine (:mod:`racecpu.engine`), which turns it into kernel calls, and
racecpu.cuda, which takes its chunks and packed layout from it.  It decides;
it computes nothing.  The tunables it reads are in :mod:`racecpu.config`
(read per call); the words (chunk, task, segment, route) are defined in
``docs/design.md`` (glossary).

The same bits come out whatever the plan's thread-dependent decisions
(segments, backward route): they change only how the work is scheduled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import numba

from . import config
from .packing import Packing, PaddedLayout, check_packed_lengths, packed_chunks, padded_layout

__all__ = ["ChunkModel", "Plan", "make_plan", "scan_segments", "sketch_task_length", "ROUTES"]

#: The causal backward's routes (:attr:`Plan.route`; ``docs/design.md`` section 4.5).
ROUTES = ("one-pass", "split", "segments")


class ChunkModel(NamedTuple):
    """How a backend cuts a sequence into chunks.

    ``base`` tokens per chunk, unless the float64 partials of every chunk,
    ``G * F * (dv + 1) * 8`` bytes each, would outgrow ``budget`` bytes in
    all; every chunk a multiple of ``multiple`` tokens (racecpu.cuda: whole
    tiles).  ``padded``: packed sequences are laid out padded to whole chunks
    (:func:`racecpu.packing.padded_layout`, racecpu.cuda) rather than cut
    where they begin (:func:`racecpu.packing.packed_chunks`, the CPU).
    """

    base: int
    budget: int
    multiple: int = 1
    padded: bool = False

    def budget_chunk(self, n, G, F, dv):
        """The shortest chunk of ``n`` tokens (a multiple of ``multiple``) whose float64
        partials stay within the budget (at least 1)."""
        per_chunk = G * F * (dv + 1) * 8
        max_chunks = max(1, self.budget // max(per_chunk, 1))
        return _whole(max(-(-n // max_chunks), 1), self.multiple)

    def length(self, n, G, F, dv):
        """Tokens per chunk: ``base`` (whole multiples) unless the partials outgrow the budget."""
        return max(_whole(self.base, self.multiple), self.budget_chunk(n, G, F, dv))


def _whole(n, multiple):
    return -(-n // multiple) * multiple


def cpu_chunk_model():
    """The CPU kernels' chunk model: config.CHUNK tokens, config.PARTIAL_BUDGET (read per call)."""
    return ChunkModel(int(config.CHUNK), int(config.PARTIAL_BUDGET))


def scan_segments(G, nc, n):
    """Segments per group of the causal scans of ``G`` groups of ``n`` tokens in ``nc`` chunks.

    A segment is a run of consecutive chunks that one task scans in order,
    carrying the state itself; only its first carry comes from the chunk
    totals of the segments before it (after it: the reverse scan), and every
    total costs a sgemm per token.  So: one segment per group (no totals at
    all) where the groups alone share the threads evenly, else the fewest
    that do, ``threads / gcd(G, threads)`` (one head on 2 threads: 2, the
    totals of half the chunks; the backward's, of a third: the split route),
    at most one per chunk.  Results do not depend on it, bit for bit.
    """
    threads = numba.get_num_threads() if G * n >= config.SERIAL_TOKENS else 1
    return max(1, min(nc, threads // math.gcd(G, threads)))


def sketch_task_length(chunk, n, G):
    """Task length of the non-causal forward: up to SKETCH_CHUNKS chunks, while
    each of config.TASK_THREADS threads would keep at least 8 tasks.

    The tasks' float64 partials are summed in task order, so the task length
    sets the bits of the result: it is sized for a fixed thread count, not
    for ``numba.get_num_threads()``, so that results do not depend on the
    thread count or the machine (docs/performance.md, "sketch tasks").
    """
    tokens = G * n // (8 * config.TASK_THREADS)
    return max(chunk, min(config.SKETCH_CHUNKS * chunk, tokens // chunk * chunk))


@dataclass(frozen=True)
class Plan:
    """How one call's work is cut (treat as read-only; made by :func:`make_plan`).

    Shapes: ``G`` query groups (batch x head), ``group`` query groups per
    key/value group (``Gk = G // group``), ``nq`` queries and ``nk`` keys per
    group, head dim ``d``, value dim ``dv``, ``L`` tables of ``P`` planes.

    Decisions:

    * ``chunk``: tokens per chunk of the backward, of the causal forward's
      carries and of packed sequences (the residuals are laid out by it);
    * ``task``: tokens per task of the non-causal forward's keys' sketch (a
      multiple of ``chunk``; ``chunk`` when causal or packed);
    * ``packing``: packed sequences (:class:`racecpu.packing.Packing` on the
      CPU, :class:`racecpu.packing.PaddedLayout` on the GPU), or None;
    * ``segments``: segments per key/value group of the causal scans (1
      non-causal; :func:`scan_segments`);
    * ``route``: the causal backward's route, one of :data:`ROUTES`: one pass
      per group (one segment), ``split`` (two segments, three chunks or
      more), else ``segments`` (the queries' pass, a reverse scan of the
      totals, the keys' pass in segments).
    """

    G: int
    group: int
    nq: int
    nk: int
    d: int
    dv: int
    L: int
    P: int
    causal: bool
    chunk: int
    task: int
    packing: Packing | PaddedLayout | None
    segments: int
    route: str

    @property
    def Gk(self):
        """Key/value groups."""
        return self.G // self.group

    @property
    def F(self):
        """Soft-bucket values per token, ``L * 2**P``."""
        return self.L * 2 ** self.P

    @property
    def LP(self):
        """Tanh projections per token."""
        return self.L * self.P

    @property
    def ncq(self):
        """Chunks of the queries (of ``chunk`` tokens, or those of the packed sequences)."""
        return self._chunks(self.nq, self.chunk)

    @property
    def nck(self):
        """Chunks of the keys."""
        return self._chunks(self.nk, self.chunk)

    @property
    def nck_task(self):
        """Tasks of the non-causal forward's keys' sketch (of ``task`` tokens)."""
        return self._chunks(self.nk, self.task)

    def _chunks(self, n, length):
        if isinstance(self.packing, Packing):
            return self.packing.chunks.seq.size
        if isinstance(self.packing, PaddedLayout):
            return self.packing.seq.size
        return -(-n // length)

    def rescheduled(self):
        """This plan with its thread-dependent decisions (``segments``, ``route``) taken again
        now: a backward runs on the forward's chunks with the threads it has."""
        return replace(self, **_schedule(self.causal, self.Gk, self.nck, self.nk))


def _schedule(causal, Gk, nck, nk):
    if not causal:
        return dict(segments=1, route="segments")
    seg = scan_segments(Gk, nck, nk)
    route = "one-pass" if seg == 1 else "split" if seg == 2 and nck >= 3 else "segments"
    return dict(segments=seg, route=route)


def make_plan(*, G, group, nq, nk, d, dv, L, P, causal, model=None, cu_seqlens=None):
    """The :class:`Plan` of a call on these shapes, chunked by ``model`` (default: the
    CPU's, :func:`cpu_chunk_model`).

    ``cu_seqlens``: packed sequences (checked here: q, k and v alike, offsets
    from 0 to the sequence length, non-decreasing); laid out as ``model``
    says.  Raises ValueError for packed sequences of unequal q and k lengths.
    """
    model = cpu_chunk_model() if model is None else model
    F = L * 2 ** P
    Gk = G // group
    n = max(nq, nk)
    packing = None
    if cu_seqlens is not None:
        check_packed_lengths(nq, nk)
        if model.padded:
            packing = padded_layout(cu_seqlens, n, min_chunk=max(model.multiple, model.budget_chunk(n, G, F, dv)),
                                    max_chunk=model.base, multiple=model.multiple, causal=causal)
        else:
            packing = packed_chunks(cu_seqlens, n, model.length(n, G, F, dv))
        chunk = task = packing.chunk  # every packed sequence starts a chunk (its last one shorter)
    else:
        chunk = model.length(n, G, F, dv)
        task = chunk if causal else sketch_task_length(chunk, n, G)
    plan = Plan(G=G, group=group, nq=nq, nk=nk, d=d, dv=dv, L=L, P=P, causal=bool(causal), chunk=chunk, task=task,
                packing=packing, segments=1, route="segments")
    return replace(plan, **_schedule(plan.causal, Gk, plan.nck, nk))

"""The keys' sketch, per chunk: every key hashed, its ``(A, B)`` summed per chunk.

``A = sum_j phi(k_j)`` and ``B = sum_j phi(k_j) v_j^T`` over the keys of each
chunk, as float64 chunk totals (Algorithm 1 of the paper; ``docs/design.md``
sections 1 and 4).  Both paths start here: the non-causal forward sums the
totals into one sketch (:mod:`.noncausal` reads it), the causal forward scans
them into carries (:mod:`.causal`).  Without totals it is the keys' soft hash
alone (the backward of a block whose forward kept no rows).
"""

from __future__ import annotations

import numpy as np

from ..config import SCAN_BLOCK
from ._jit import kernel
from .bundles import Spread
from .hash import hash_chunk, hash_sketch_range
from .products import add_rows, span_totals
from .runtime import run_tasks
from .scan import spread_order, task_bounds

#: ``span`` of :func:`sketch_chunks` for totals that no scan has to match:
#: each hash block's product as soon as it is hashed (:func:`hash_sketch_range`).
SKETCH_FUSED = 0


@kernel
def _sketch_chunks_task(task, spread, k, v, mask, hsh, chunks, span, rows, part, nan):
    """One (group, chunk) task of :func:`sketch_chunks` (run by :func:`run_tasks`)."""
    partA, partB = part
    F = rows.phik.shape[2]
    g, c, lo, hi = task_bounds(spread.order[task], chunks)
    if span == SKETCH_FUSED:
        # phik, tk with no rows (a forward with no backward): hash_block writes none
        nan[task] = hash_sketch_range(k[g, lo:hi], v[g, lo:hi], 0, hi - lo, hsh, mask[g, lo:hi],
                                      rows.tk[g, lo:hi], rows.phik[g, lo:hi], partA[g, c], partB[g, c])
        return
    phi, _, nan[task] = hash_chunk(k, g, lo, hi, hsh, mask[g, lo:hi], rows.tk, rows.phik)
    add_rows(partA[g, c], phi)
    if spread.t0 <= c < spread.t1:
        span_totals(phi, v[g, lo:hi], span, False, partB[g, c], np.empty((F, v.shape[2]), v.dtype))


def sketch_chunks(k, v, mask, hsh, chunks, rows, part, span=SCAN_BLOCK, totals=None):
    """Hash every key and sum its sketch per chunk.

    Parameters
    ----------
    k : (G, Nk, d), v : (G, Nk, dv)
        Keys and values, C-contiguous, compute dtype.
    mask : bool (G, Nk)
        False keys get phi = 0 (t is still written).
    hsh : Hash
    chunks : Chunks
        Each chunk's rows (packed sequences start a chunk each); ``part``
        has one total per chunk.
    rows : Rows
        Only ``phik`` and ``tk`` are written (either may have no rows: a
        forward with no backward keeps none).
    part : Sums
        Out: ``A (G, nc, F)`` float64, zeros on entry (the chunk totals are
        added); ``B (G, nc, F, dv)`` float64 (written for the chunks of
        ``totals``, not read).
    span : int, default SCAN_BLOCK
        Rows per product of the B totals: SCAN_BLOCK, the causal scans'
        steps (:func:`racecpu._kernels.products.span_totals`: the same bits
        as a scan tracks them); SKETCH_FUSED: each hash block's product as
        soon as it is hashed (:func:`racecpu._kernels.hash.hash_sketch_range`),
        where no scan has to match.
    totals : (int, int), optional
        The chunks ``[c0, c1)`` of every group whose B totals are summed
        (default all; the causal forward needs those before its last
        segment; ``(0, 0)``: none, the keys' soft hash alone).

    Returns
    -------
    int
        The number of NaNs in the keys' t: a NaN/Inf in k, or a projection
        that overflowed (see :func:`racecpu._kernels.hash.hash_block`).
    """
    partA = part.A
    G, nc = partA.shape[:2]
    t0, t1 = (0, nc) if totals is None else totals
    nan = np.zeros(G * nc, np.int64)
    run_tasks(_sketch_chunks_task, G * nc, Spread(spread_order(G, nc, t0, t1), t0, t1), k, v, mask, hsh, chunks,
              span, rows, part, nan)
    return int(nan.sum())

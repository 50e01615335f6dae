"""Numba CPU kernels of RACE attention (no argument checking: see racecpu._checks).

Only the engine (:mod:`racecpu.engine`) calls them, and :mod:`racecpu._checks`
for the parallel NaN/Inf count and the 16-bit conversions of its checks
(``docs/design.md``, "Map of the engine").  The map: each operation, its
forward and backward kernels, their CUDA mirror in
:mod:`racecpu.cuda._kernels`, and the tests that hold them to the O(N^2)
references of :mod:`racecpu.reference` (``docs/design.md`` states the math;
its glossary defines chunk, task, segment, step, block, tile, span, run).

============================  ==========================  ===============================  ==============================  =======================
operation                     forward                     backward                         CUDA mirror                     tests
============================  ==========================  ===============================  ==============================  =======================
soft hash (Algorithm 1)       hash.hash_block             hash.hash_rows_du,               soft_hash_rows                  test_race: soft hash,
                              (hash_range, hash_chunk)    hash.hash_bwd_rows                                               exp_neg, tanh
planes' gradient (dplanes)    --                          hash.hash_bwd_rows_dw (per                                       test_planes_grad
                                                          chunk, in the hash backward:
                                                          products.tn_product)
keys' sketch, per chunk       sketch.sketch_chunks        noncausal.keys_bwd               sketch_chunks, keys_bwd         test_race: gradients
the estimator (ratio, floor)  readout.readout_rows,       readout.dphi_from_y,             readout_row, readout_row_bwd,   test_race: vs reference,
                              readout.step_readout        readout.ratio_inverse,           causal_readout_row,             DEN_FLOOR
                                                          readout.den_share                causal_readout_row_bwd
non-causal readout            noncausal.queries_fwd       noncausal.queries_bwd            queries_fwd, queries_bwd        test_race: vs reference
                                                          (queries_chunk_end)
causal scan (Algorithm 2)     causal.causal_fwd           causal.causal_bwd |              causal_fwd, causal_queries_bwd, test_race: causal,
                                                          causal_bwd_split |               causal_keys_bwd                 segments, split
                                                          causal_queries_bwd +
                                                          causal_keys_bwd
carries between chunks        scan.exclusive_scan         scan.exclusive_scan (reverse)    scan_chunks                     test_race: scans
a block's carried-in state    --                          readout.state_cotangent_rows     --                              test_dask: causal
from its outputs                                                                                                           blocks compose
============================  ==========================  ===============================  ==============================  =======================

The modules, bottom up (each imports only those above it):

* :mod:`._jit` -- compile options and the kernels' cache (keyed to every source here).
* :mod:`.tiles` -- register tiles of the thin products and prefetches, as LLVM IR.
* :mod:`.runtime` -- running (group, chunk) tasks on all threads (:func:`run_tasks`),
  where a call runs (:func:`task_threads`: BLAS on one thread inside the tasks,
  small calls on the calling thread), subnormals flushed, and the parallel
  NaN/Inf count of the input check.
* :mod:`.convert` -- 16-bit floats (bfloat16, float16) to float32 and back,
  on the bits, on every core (16-bit inputs compute in float32).
* :mod:`.groups` -- grouped-query attention's per-query-head values summed
  over each key/value group, on every core.
* :mod:`.expmath` -- a branch-free exp of non-positive arguments that vectorises.
* :mod:`.bundles` -- the named bundles of arrays the kernels take.
* :mod:`.products` -- the small matrix products every kernel is made of.
* :mod:`.hash` -- the soft hash of a block of rows and its backward.
* :mod:`.scan` -- chunk bounds of tasks and segments, and the float64
  exclusive scans of chunk totals that carry state between them.
* :mod:`.readout` -- the estimator: how a query reads the keys' sums (the
  paper's ratio and its DEN_FLOOR), and its backward.
* :mod:`.sketch` -- the keys' sketch per chunk (both paths start there).
* :mod:`.noncausal` -- the readout of a summed sketch by the queries, and both
  backwards.
* :mod:`.causal` -- the causal scan and its backward's three routes.

Layout of every array: each (batch, head) pair is a *group* ``g``; arrays are
C-contiguous ``x (G, N, d)``, ``v (G, N, dv)``, planes ``W (L, P, d)``.  Under
grouped-query attention keys and values have ``Gk`` groups (``G // Gk`` query
groups each); the causal kernels run per key/value group (:mod:`.causal`).  The
soft hash of all tables of one token is one row ``phi (F,)``, ``F = L * R``,
table ``l`` at ``phi[l*R:(l+1)*R]``; its tanh projections are ``t (L * P,)``.
"""

from .bundles import Backward, Chunks, Forward, Grads, Hash, PlanesGrad, Rows, Sums
from .causal import causal_bwd, causal_bwd_split, causal_fwd, causal_keys_bwd, causal_queries_bwd
from .convert import BFLOAT16, FLOAT16, narrow, widen
from .expmath import exp_neg
from .groups import fold_groups, group_sum
from .hash import hash_block, hash_range, hash_rows_du, hash_sketch_range, soft_hash_rows
from .noncausal import keys_bwd, queries_bwd, queries_fwd
from .products import combine_rows, dot_rows, step_scores, tn_product
from .readout import state_cotangent_rows
from .runtime import FLUSH_SUBNORMALS, count_nonfinite, run_tasks, set_threads, task_threads, threads
from .scan import even_chunks, exclusive_scan, segment_start, spread_order
from .sketch import SKETCH_FUSED, sketch_chunks
from ..config import BLAS_ROWS, SCORE_TILE_F, HASH_BLOCK, SCAN_BLOCK, SKETCH_RUN

__all__ = [
    "Backward", "Chunks", "Forward", "Grads", "Hash", "PlanesGrad", "Rows", "Sums",
    "causal_bwd", "causal_bwd_split", "causal_fwd", "causal_keys_bwd", "causal_queries_bwd",
    "BFLOAT16", "FLOAT16", "narrow", "widen",
    "exp_neg", "fold_groups", "group_sum", "hash_block", "hash_range", "hash_rows_du", "hash_sketch_range",
    "soft_hash_rows", "keys_bwd", "queries_bwd", "queries_fwd", "combine_rows", "dot_rows", "step_scores",
    "tn_product", "state_cotangent_rows", "FLUSH_SUBNORMALS", "count_nonfinite", "run_tasks", "set_threads",
    "task_threads", "threads", "even_chunks", "exclusive_scan", "segment_start", "spread_order", "SKETCH_FUSED",
    "sketch_chunks", "BLAS_ROWS", "SCORE_TILE_F", "HASH_BLOCK", "SCAN_BLOCK", "SKETCH_RUN",
]

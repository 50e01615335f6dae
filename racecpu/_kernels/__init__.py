"""Numba CPU kernels of RACE attention (no argument checking: see racecpu._checks).

The map: each operation, its forward and backward kernels, their CUDA
mirror in :mod:`racecpu.cuda._kernels`, and the tests that hold them to the
O(N^2) references of :mod:`racecpu.reference` (``docs/design.md`` states the
math; its glossary defines chunk, task, segment, step, block, tile, span, run).

============================  ==========================  ===============================  ==============================  =======================
operation                     forward                     backward                         CUDA mirror                     tests
============================  ==========================  ===============================  ==============================  =======================
soft hash (Algorithm 1)       hash.hash_block             hash.hash_rows_du,               soft_hash_rows                  test_race: soft hash,
                              (hash_range, hash_chunk)    hash.hash_bwd_rows                                               exp_neg, tanh
planes' gradient (dplanes)    --                          hash.hash_bwd_rows_dw (per                                       test_planes_grad
                                                          chunk, in the hash backward:
                                                          products.tn_product)
keys' sketch, per chunk       noncausal.sketch_chunks     noncausal.keys_bwd               sketch_chunks, keys_bwd         test_race: gradients
non-causal readout            noncausal.queries_fwd       noncausal.queries_bwd            queries_fwd, queries_bwd        test_race: vs reference
                              (readout_rows)              (dphi_from_y, queries_chunk_end)
causal scan (Algorithm 2)     causal.causal_fwd           causal.causal_backward:          causal_fwd, causal_queries_bwd, test_race: causal,
                                                          causal_bwd | causal_bwd_split |  causal_keys_bwd                 segments, split
                                                          causal_queries_bwd +
                                                          causal_keys_bwd
carries between chunks        scan.exclusive_scan         scan.exclusive_scan (reverse)    scan_chunks                     test_race: scans
a block's carried-in state    --                          causal.state_cotangent_rows      --                              test_dask: causal
from its outputs                                          (sketches.causal_block_dstate)                                   blocks compose
============================  ==========================  ===============================  ==============================  =======================

The modules, bottom up (each imports only those above it):

* :mod:`._jit` -- compile options and the kernels' cache (keyed to every source here).
* :mod:`.tiles` -- register tiles of the thin products and prefetches, as LLVM IR.
* :mod:`.runtime` -- running (group, chunk) tasks on all threads (:func:`run_tasks`),
  BLAS kept on one thread inside them (:func:`blas_tasks`), subnormals flushed,
  and the parallel NaN/Inf count of the input check.
* :mod:`.convert` -- 16-bit floats (bfloat16, float16) to float32 and back,
  on the bits, on every core (16-bit inputs compute in float32).
* :mod:`.groups` -- grouped-query attention's per-query-head gradients summed
  over each key/value group, on every core.
* :mod:`.expmath` -- a branch-free exp of non-positive arguments that vectorises.
* :mod:`.products` -- the small matrix products every kernel is made of.
* :mod:`.hash` -- the soft hash of a block of rows and its backward.
* :mod:`.scan` -- how tokens are split into chunks, tasks and segments, and the
  float64 exclusive scans of chunk totals that carry state between them.
* :mod:`.noncausal` -- keys' sketches per chunk, the readout of a sketch by
  queries, and both backwards.
* :mod:`.causal` -- the causal scan, its backward, and the choice between the
  three backward routes (:func:`causal_backward`).

Layout of every array: each (batch, head) pair is a *group* ``g``; arrays are
C-contiguous ``x (G, N, d)``, ``v (G, N, dv)``, planes ``W (L, P, d)``.  Under
grouped-query attention keys and values have ``Gk`` groups (``G // Gk`` query
groups each); the causal kernels run per key/value group (:mod:`.causal`).  The
soft hash of all tables of one token is one row ``phi (F,)``, ``F = L * R``,
table ``l`` at ``phi[l*R:(l+1)*R]``; its tanh projections are ``t (L * P,)``.
"""

from .causal import (causal_backward, causal_bwd, causal_bwd_split, causal_fwd, causal_keys_bwd, causal_queries_bwd,
                     state_cotangent_rows)
from .expmath import exp_neg
from .groups import fold_groups, group_sum
from .hash import hash_block, hash_range, hash_rows_du, hash_sketch_range, soft_hash_rows
from .noncausal import SKETCH_FUSED, keys_bwd, queries_bwd, queries_fwd, sketch_chunks
from .products import combine_rows, dot_rows, step_scores, tn_product
from .runtime import FLUSH_SUBNORMALS, count_nonfinite, run_tasks
from .scan import (budget_chunk, chunk_length, exclusive_scan, scan_segments, segment_start, sketch_task_length, spread_order)
from ..config import BLAS_ROWS, BLAS_SCORE_F, HASH_BLOCK, SCAN_BLOCK, SKETCH_RUN

__all__ = [
    "causal_backward", "causal_bwd", "causal_bwd_split", "causal_fwd", "causal_keys_bwd", "causal_queries_bwd",
    "state_cotangent_rows",
    "exp_neg", "fold_groups", "group_sum", "hash_block", "hash_range", "hash_rows_du", "hash_sketch_range", "soft_hash_rows",
    "SKETCH_FUSED", "keys_bwd", "queries_bwd", "queries_fwd", "sketch_chunks", "combine_rows", "dot_rows",
    "step_scores", "tn_product", "FLUSH_SUBNORMALS", "count_nonfinite", "run_tasks", "budget_chunk", "chunk_length", "exclusive_scan",
    "scan_segments", "segment_start", "sketch_task_length", "spread_order",
    "BLAS_ROWS", "BLAS_SCORE_F", "HASH_BLOCK", "SCAN_BLOCK", "SKETCH_RUN",
]

"""Every tunable of racecpu, in one place.

Each setting is marked with when it takes effect:

* **read per call**: the library reads ``racecpu.config.NAME`` each time a
  function runs, so assigning a new value (or ``monkeypatch`` in a test)
  changes the next call.  They change how work is split, never the math.
* **compiled in**: frozen into the Numba kernels when they are compiled.
  Edit this file to change one; the kernels' cache is keyed to a digest of
  this file and every kernel source (:mod:`racecpu._kernels._jit`), so the
  next import recompiles instead of loading stale machine code.

Why each value is what it is, with the measurements, is in
``docs/performance.md`` under the entry named in its comment.  This module
imports nothing from racecpu: it is the bottom of the import graph.
"""

from __future__ import annotations

# ---------------------------------------------------------------------------
# semantics (public constants, re-exported by racecpu)
# ---------------------------------------------------------------------------

#: Default soft-hash temperature.  The bias of the estimator is O(P / beta)
#: (Theorem 1) while its gradients vanish as beta grows; 8 keeps the bias term
#: small for P <= 4 and the hash still trainable.  The paper trains beta.
#: (read per call, as a default argument value: read at import)
DEFAULT_BETA = 8.0

#: Guard on the attention denominator.  ``den`` (the estimated kernel mass a
#: query sees) is positive in exact arithmetic but can underflow to 0 when a
#: query's buckets hold no key mass (large beta, masked keys).  Rows with
#: ``den <= DEN_FLOOR`` output zeros and pass zero gradient, as a query that
#: attends to nothing.  (compiled in)
DEN_FLOOR = 1e-30

#: Largest number of hyperplanes per table (R = 2**16 buckets).  (read per call)
MAX_PLANES = 16

# ---------------------------------------------------------------------------
# how work is split (read per call)
# ---------------------------------------------------------------------------

#: Tokens per chunk: the unit of parallel work and the longest run summed in
#: the compute dtype before a sum moves to float64.  (read per call)
CHUNK = 1024

#: Cap in bytes on the float64 chunk partials (G * nc * F * (dv + 1) * 8);
#: above it chunks grow, which only matters for very large P.  (read per call)
PARTIAL_BUDGET = 256 * 2 ** 20

#: Chunks per task of the non-causal forward, while each of TASK_THREADS
#: threads would keep at least eight tasks (docs/performance.md, "sketch
#: tasks").  (read per call)
SKETCH_CHUNKS = 4

#: The thread count the non-causal forward's tasks are sized for.  A fixed
#: number, not the threads of this machine: the task length sets the order
#: in which float64 partials are summed, so results are the same bits at any
#: thread count.  (read per call)
TASK_THREADS = 64

#: Below this many tokens (all groups together) a kernel runs on the calling
#: thread: waking the other threads costs more than such calls' work
#: (docs/performance.md, "serial tokens").  (read per call)
SERIAL_TOKENS = 512

#: Share of the chunks that ``causal_bwd_split`` runs in one pass while the
#: other task runs the queries' backward of the rest (docs/performance.md,
#: "split backward").  (read per call)
SPLIT_TAIL = 0.32

# ---------------------------------------------------------------------------
# kernel shapes (compiled in)
# ---------------------------------------------------------------------------

#: Tokens hashed together: the tanh/logistic step vectorises across them.
#: (compiled in)
HASH_BLOCK = 32

#: Tokens per SIMD block of the soft hash's backward.  (compiled in)
DU_BLOCK = 64

#: Rows (rounded up to whole hash blocks) that the non-causal keys' sketch
#: sums in v's dtype before the sum moves to float64; equal to CHUNK's
#: default, the longest such run anywhere.  (compiled in)
SKETCH_RUN = 1024

#: Tokens per step of the causal scans (docs/performance.md, "scan block").
#: (compiled in)
SCAN_BLOCK = 8

#: Rows from which a rank-k state update goes to BLAS (np.dot) rather than
#: racecpu's own register tiles (docs/performance.md, "BLAS rows", "step
#: product tiles").  (compiled in)
BLAS_ROWS = 16

#: Rows per sgemm of the non-causal queries' chunk totals of dB
#: (docs/performance.md, "BLAS span").  (compiled in)
BLAS_SPAN = 256

#: Length F of phi's rows from which a scan step's scores go to dot_rows'
#: register tiles rather than the triangular loop (docs/performance.md,
#: "step scores").  (compiled in)
SCORE_TILE_F = 32

#: |u| below which tanh(u) is its series to u**9 (truncation < 1e-16
#: relative); above it (1 - e)/(1 + e) loses < 3e-15 (float64), < 2e-6
#: (float32).  (compiled in)
TANH_SERIES_MAX = 0.04

#: The soft hash's prefetch schedule, in 32nds of the next block's lines:
#: issued by the end of the tanh/logistic loop, of the rows of t and of the
#: corners; the rows of phi issue the rest (docs/performance.md, "hash
#: prefetch").  (compiled in)
PREFETCH_MATH, PREFETCH_T, PREFETCH_CORNERS = 12, 20, 24

#: OpenMP's wait policy for Numba's worker threads: "PASSIVE" (idle workers
#: sleep), "ACTIVE" (they spin), or None (the runtime's default).  Read once,
#: when racecpu first starts Numba's threads, and only where the environment
#: sets no OMP_WAIT_POLICY itself (racecpu._kernels.runtime.start_threads).
WAIT_POLICY = "PASSIVE"

# ---------------------------------------------------------------------------
# environment variables (read once, when first needed)
# ---------------------------------------------------------------------------

#: Environment variable with the result pool's limit in bytes (default: half
#: the physical memory).  Read when the pool is first used.
POOL_BYTES_ENV = "RACECPU_POOL_BYTES"

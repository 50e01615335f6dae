"""A/B of two racecpu checkouts in one process, calls alternating.

On a shared, noisy machine the same code measured in two processes an hour
apart differs by up to 1.3x, which hides any change smaller than that.  This
script imports this checkout's racecpu (A) and another checkout's (B, e.g. a
``git worktree`` of the change) side by side in one process, gives both the
same inputs and ``out=`` buffers allocated once (no page faults: the kernels
are compared, not the allocator), and alternates them call by call, A first
in even rounds and B first in odd ones.  It reports medians per side and the
median of the per-round ratios B/A, with their range: a change is real when
that range stays on one side of 1.

    git worktree add /tmp/b HEAD && (edit /tmp/b)
    python benchmarks/ab.py /tmp/b [--log2n 18] [--heads 4] [--dim 128] [--planes 3] [--tables 3]
                                   [--rounds 7] [--repeats 3] [--aligned]

It also prints the largest difference between A's and B's results
(relative to the largest |value| of A's), which a pure speed change keeps
at float32 rounding.  B's kernels compile on its first run, into a cache
directory apart (see :func:`load`).  Both sides' inputs, outputs and
residuals are alive at once: at 2^20 tokens and 4 heads that is more than
24 GiB (killed for memory on this machine), so A/B there at --log2n 19.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import numba
import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]


def load(tree, name):
    """Import the racecpu package of checkout ``tree`` as module ``name``.

    Under any name but ``racecpu`` its kernels are cached in a directory of
    their own (``<tmp>/racecpu-ab-cache``): Numba's cache records the module
    name, and a checkout whose own cache held kernels compiled as
    ``racecpu_ab_other`` failed to load them when imported as ``racecpu``
    (ModuleNotFoundError).
    """
    pkg = Path(tree).resolve() / "racecpu"
    if not (pkg / "__init__.py").is_file():
        raise SystemExit(f"{tree} is not a racecpu checkout (no racecpu/__init__.py)")
    spec = importlib.util.spec_from_file_location(name, pkg / "__init__.py", submodule_search_locations=[str(pkg)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    cache_dir = numba.config.CACHE_DIR
    if name != "racecpu":  # the decorators pick the cache directory as the modules are imported
        numba.config.CACHE_DIR = str(Path(tempfile.gettempdir()) / "racecpu-ab-cache")
    try:
        spec.loader.exec_module(mod)
    finally:
        numba.config.CACHE_DIR = cache_dir
    return mod


def empty_like(x, align=None):
    """``np.empty_like(x)``, or (``align``) a C-contiguous array like it starting on
    ``align`` bytes.  NumPy places large arrays 16 bytes past a page; racecpu's own
    results start on a page, where its kernels stream whole 64-byte vectors."""
    if align is None:
        return np.empty_like(x)
    buf = np.empty(x.nbytes + align, np.uint8)
    start = (-buf.ctypes.data) % align
    return buf[start:start + x.nbytes].view(x.dtype).reshape(x.shape)


def side(rc, q, k, v, g, planes, causal, align=None):
    """Forward and forward+backward calls of racecpu module ``rc`` into buffers it owns
    (on ``align`` bytes, see :func:`empty_like`)."""
    out = empty_like(q, align)
    grads = tuple(empty_like(x, align) for x in (q, k, v))

    def fwd():  # the forward alone, as inference runs it
        rc.race_attention(q, k, v, planes, causal=causal, out=out)

    def fwdbwd():
        res = rc.race_attention_fwd(q, k, v, planes, causal=causal, out=out)[1]
        rc.race_attention_bwd(res, g, out=grads)

    return {"fwd": fwd, "fwdbwd": fwdbwd}, (out,) + grads


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("other", help="path of the other checkout (B)")
    p.add_argument("--log2n", type=int, default=18)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--planes", type=int, default=3, help="hyperplanes per table P (default 3)")
    p.add_argument("--tables", type=int, default=3, help="tables L (default 3)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--repeats", type=int, default=3,
                   help="timed calls per side and round (after an untimed one); the best counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--aligned", action="store_true",
                   help="out= buffers on 64 bytes, as racecpu's own results (default: where NumPy puts them)")
    a = p.parse_args(argv)
    if a.rounds < 1 or a.repeats < 1:
        p.error("--rounds and --repeats must be >= 1")

    A = load(ROOT, "racecpu")
    # This checkout against itself: one import.  A second one compiles afresh into a cache of
    # its own, and kernels compiled in a process and the same kernels loaded from Numba's cache
    # differed in the last bits (the causal dq at 2^10: 4e-15 relative, same inputs).
    B = A if Path(a.other).resolve() == ROOT.resolve() else load(a.other, "racecpu_ab_other")
    from racecpu.apps.bench import best_time  # this checkout's (A is imported as racecpu)
    n, H = 1 << a.log2n, a.heads
    rng = np.random.default_rng(a.seed)
    q, k, v, g = (rng.standard_normal((H, n, a.dim), dtype=np.float32) for _ in range(4))
    planes = A.hyperplanes(a.dim, a.planes, a.tables, seed=a.seed)
    print(f"A: {Path(A.__file__).parents[1]}\nB: {Path(B.__file__).parents[1]}\n"
          f"N = 2^{a.log2n}, {H} heads, d = dv = {a.dim}, P = {a.planes}, L = {a.tables}, float32; "
          f"{a.rounds} rounds, best of {a.repeats} calls per side and round; ns per token-head")
    for causal in (False, True):
        align = 64 if a.aligned else None
        fa, outs_a = side(A, q, k, v, g, planes, causal, align)
        fb, outs_b = side(B, q, k, v, g, planes, causal, align)
        fa["fwdbwd"]()  # compile / load caches, and the results to compare
        fb["fwdbwd"]()
        diff = max(float(np.abs(x - y).max() / max(np.abs(x).max(), 1e-30)) for x, y in zip(outs_a, outs_b))
        times = {m: ([], []) for m in fa}
        for r in tqdm(range(a.rounds), desc="causal" if causal else "non-causal", leave=False):
            for m in fa:
                order = ((0, fa), (1, fb)) if r % 2 == 0 else ((1, fb), (0, fa))
                for i, f in order:
                    times[m][i].append(best_time(f[m], a.repeats) / (n * H) * 1e9)
        print(f"{'causal' if causal else 'non-causal'} (max |B - A| / max |A| over out, dq, dk, dv: {diff:.2e})")
        for m, (ta, tb) in times.items():
            ratio = np.array(tb) / np.array(ta)
            print(f"  {m:7s} A {np.median(ta):8.1f}  B {np.median(tb):8.1f}  "
                  f"B/A {np.median(ratio):.3f} (rounds: {ratio.min():.3f} .. {ratio.max():.3f})")


if __name__ == "__main__":
    main()

"""The modules one public call passes through, and how often it crosses between them.

Traces (``sys.setprofile``) one warmed-up call of the NumPy API and prints,
for the forward and for the backward apart:

* the *path*: every call from one racecpu module into another, in order,
  as ``caller -> callee.function`` (calls within a module and calls into
  compiled kernels, which the profiler does not see, are not listed);
* the *round trips*: per pair of modules, how many times control went from
  one into the other and came back.

    python benchmarks/call_path.py [--causal | --no-causal] [--dtype float32] [--path]

Run it from the checkout whose racecpu it should trace (``PYTHONPATH=.``).
"""

from __future__ import annotations

import argparse
import collections
import sys

import numpy as np


def trace(fn):
    """Run ``fn()``; returns the cross-module calls ``[(caller module, callee module, function)]``."""
    calls = []

    def prof(frame, event, arg):
        if event != "call":
            return
        callee = frame.f_globals.get("__name__", "")
        back = frame.f_back
        caller = back.f_globals.get("__name__", "") if back is not None else ""
        if callee.startswith("racecpu") and caller.startswith("racecpu") and callee != caller:
            calls.append((caller, callee, frame.f_code.co_name))

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def report(title, calls, show_path):
    print(f"## {title}: {len(calls)} calls across modules")
    if show_path:
        for caller, callee, name in calls:
            print(f"  {caller} -> {callee}.{name}")
    pairs = collections.Counter(tuple(sorted((a, b))) for a, b, _ in calls)
    for (a, b), n in sorted(pairs.items(), key=lambda kv: -kv[1]):
        print(f"  {n:3d}  {a} <-> {b}")
    modules = sorted({m for a, b, _ in calls for m in (a, b)})
    print(f"  modules: {', '.join(modules)}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--shape", default="1,4,4096,64", help="B,H,N,d")
    ap.add_argument("--path", action="store_true", help="list every cross-module call")
    args = ap.parse_args(argv)
    import racecpu
    B, H, N, d = (int(s) for s in args.shape.split(","))
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((B, H, N, d)).astype(args.dtype) for _ in range(4))
    W = racecpu.hyperplanes(d)
    out, res = racecpu.race_attention_fwd(q, k, v, W, causal=args.causal)  # compile, warm the pool
    racecpu.race_attention_bwd(res, g)
    box = {}
    fwd = trace(lambda: box.update(res=racecpu.race_attention_fwd(q, k, v, W, causal=args.causal)[1]))
    bwd = trace(lambda: racecpu.race_attention_bwd(box["res"], g))
    print(f"racecpu from {racecpu.__file__}; {'causal' if args.causal else 'non-causal'} {args.dtype} "
          f"{(B, H, N, d)}")
    report("forward", fwd, args.path)
    report("backward", bwd, args.path)


if __name__ == "__main__":
    main()

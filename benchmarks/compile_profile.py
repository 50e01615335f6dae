"""Where a cold compile goes: seconds per kernel, for one path of the demo.

Run in a fresh process with an empty kernel cache (the script makes one in a temporary
folder unless ``NUMBA_CACHE_DIR`` is set): imports racecpu, then a float32 (or float64)
forward and backward at 4 heads x (4 chunks + 5) tokens x d = 64, causal or not, the call the
demo compiles with.  Every Numba compilation is recorded (``numba:compile`` events) with its
time less the compilations nested in it (its callees typed on the way), summed per function.

    python benchmarks/compile_profile.py [--causal] [--dtype float64] [--top 20] [--signatures] [--phases]

``--phases`` also sums the time of LLVM's phases over every compilation: the function passes,
Numba's cheap and full module passes (the full O3 pipeline over each library with its callees'
copies linked in) and machine-code generation; the rest is Numba's typing and lowering in Python.

docs/performance.md, "First contact (issue 57): where the cold compile goes", quotes it.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    p.add_argument("--top", type=int, default=20, help="functions listed (default 20)")
    p.add_argument("--signatures", action="store_true", help="also list every compilation with its argument types")
    p.add_argument("--phases", action="store_true", help="also sum the seconds of LLVM's phases (see above)")
    args = p.parse_args(argv)
    if "racecpu" in sys.modules:
        raise SystemExit("run in a fresh process")
    if not os.environ.get("NUMBA_CACHE_DIR"):
        os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="racecpu-compile-profile-")
    t0 = time.perf_counter()
    import numpy as np
    from numba.core import event

    phases = _time_llvm_phases() if args.phases else None

    records = []  # (function, argument types, inclusive s, exclusive s)

    class Recorder(event.Listener):
        def __init__(self):
            self.stack = []

        def on_start(self, ev):
            self.stack.append((ev.data["dispatcher"], ev.data["args"], time.perf_counter(), []))

        def on_end(self, ev):
            disp, types, start, nested = self.stack.pop()
            inclusive = time.perf_counter() - start
            if self.stack:
                self.stack[-1][3].append(inclusive)
            fn = disp.py_func
            records.append((f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}", str(types), inclusive,
                            inclusive - sum(nested)))

    event.register("numba:compile", Recorder())
    import racecpu
    from racecpu.config import CHUNK

    t_import = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    dt = np.dtype(args.dtype)
    q, k, v, g = (rng.standard_normal((4, 4 * CHUNK + 5, 64)).astype(dt) for _ in range(4))
    W = racecpu.hyperplanes(64, 3, 3, seed=0, dtype=dt)
    t1 = time.perf_counter()
    out, res = racecpu.race_attention_fwd(q, k, v, W, 8.0, causal=args.causal)
    t2 = time.perf_counter()
    racecpu.race_attention_bwd(res, g)
    t3 = time.perf_counter()
    print(f"{args.dtype} {'causal' if args.causal else 'non-causal'}: import {t_import:.1f} s, forward "
          f"{t2 - t1:.1f} s, backward {t3 - t2:.1f} s, in all {t3 - t0:.1f} s; {len(records)} compilations "
          f"(cache {os.environ['NUMBA_CACHE_DIR']})")
    per = collections.defaultdict(lambda: [0, 0.0])
    for name, _, _, excl in records:
        per[name][0] += 1
        per[name][1] += excl
    print(f"{'function':45} {'count':>5} {'seconds':>8}")
    for name, (count, excl) in sorted(per.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"{name:45} {count:5d} {excl:8.2f}")
    if args.signatures:
        for name, types, _, excl in records:
            print(f"{excl:6.2f}  {name} {types}")
    if phases is not None:
        llvm = sum(phases.values())
        print("LLVM phases, seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items())
              + f"; in all {llvm:.1f} of {t3 - t0:.1f} (the rest: Numba's typing and lowering, imports, the calls)")


def _time_llvm_phases():
    """Wrap Numba's codegen so that the seconds of each LLVM phase add up in the returned dict."""
    import collections

    from numba.core import codegen

    seconds = collections.OrderedDict((k, 0.0) for k in ("function passes", "module passes (cheap)",
                                                           "module passes (full)", "machine code"))

    def timed(fn, key):
        def run(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                seconds[key] += time.perf_counter() - t
        return run

    codegen.CPUCodeLibrary._optimize_functions = timed(codegen.CPUCodeLibrary._optimize_functions, "function passes")
    codegen.JITCodeLibrary._finalize_specific = timed(codegen.JITCodeLibrary._finalize_specific, "machine code")
    make_mpm = codegen.CPUCodegen._module_pass_manager

    def module_pass_manager(self, **kw):
        pm, pb = make_mpm(self, **kw)
        key = "module passes (cheap)" if kw.get("cost") == "cheap" else "module passes (full)"

        class Timed:
            run = staticmethod(timed(pm.run, key))
        return Timed(), pb

    codegen.CPUCodegen._module_pass_manager = module_pass_manager
    return seconds


if __name__ == "__main__":
    main()

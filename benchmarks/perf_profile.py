"""Where a RACE call spends its time, per compiled function, with Linux ``perf``.

``perf`` sees Numba's machine code as anonymous JIT memory (``[JIT] tid ...``
plus an address).  This script compiles racecpu's kernels afresh in this
process (a temporary ``NUMBA_CACHE_DIR``: code loaded from the on-disk cache
carries no list of its functions), writes the start address of every
compiled function to ``/tmp/perf-<pid>.map`` (the file perf reads for JIT
symbols), runs the chosen call in a loop, and samples this process with
``perf record -p`` while it does.  It prints the functions that took the
largest share of the samples, their Numba names shortened
(``racecpu._kernels.dot_rows[v55]``: the version tells two specialisations of
one function apart), and the call's ns per token-head.

    python benchmarks/perf_profile.py [--mode fwd|fwdbwd|causal-fwd|causal-fwdbwd] [--log2n 18]
                                 [--heads 4] [--batch 1] [--dim 128] [--planes 3] [--tables 3]
                                 [--threads 2] [--seconds 10] [--top 25] [--dplanes]

It needs ``perf`` (linux-tools) and a kernel that lets this user sample
(``/proc/sys/kernel/perf_event_paranoid``); without them it says so and stops.
The compile takes about a minute.  BLAS (OpenBLAS's ``sgemm_*``) and Numba's
runtime (``NRT_incref``/``NRT_decref``: reference counts of array views) show
under their own names.  What it showed on this machine: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time


def short_name(mangled):
    """``racecpu._kernels.dot_rows[v55]`` from Numba's Itanium-style mangled
    name ``_ZN7racecpu8_kernels8dot_rowsB3v55B...E5Array...``; other names as given."""
    if not mangled.startswith("_ZN"):
        return mangled
    parts, i, version = [], 3, ""
    while i < len(mangled) and mangled[i].isdigit():
        j = i
        while j < len(mangled) and mangled[j].isdigit():
            j += 1
        n = int(mangled[i:j])
        parts.append(mangled[j:j + n])
        i = j + n
        m = re.match(r"B\d+(v\d+)", mangled[i:])  # the ABI tag: the function's version
        if m:
            version = m.group(1)
            break
    if not parts:
        return mangled
    name = ".".join(p.replace("_3clocals_3e", "<locals>").replace("_3clambda_3e", "<lambda>") for p in parts)
    return f"{name}[{version}]" if version else name


def compiled_functions(modules, dispatchers=()):
    """{address: mangled name} of every function compiled so far for the Numba
    dispatchers found in ``modules`` and given in ``dispatchers`` (each with its
    callees linked into it)."""
    from numba.core.registry import CPUDispatcher

    found, owners = {}, {}
    objs = [obj for mod in modules for obj in vars(mod).values()] + list(dispatchers)
    for obj in objs:
        if isinstance(obj, CPUDispatcher):
            for cres in list(obj.overloads.values()):
                lib = cres.library
                for fn in lib._final_module.functions:  # empty for code loaded from the cache
                    if fn.is_declaration:
                        continue
                    addr = lib.get_pointer_to_function(fn.name)
                    if addr:
                        found[addr] = fn.name
                        if fn.name.startswith("NRT_"):
                            owners.setdefault(addr, set()).add(lib.name)
    # Numba's runtime has a copy in every library: name its owner.  A name several libraries
    # export resolves to one copy for all of them (the first loaded), which none owns alone.
    for addr, libs in owners.items():
        found[addr] += f"@{next(iter(libs))}" if len(libs) == 1 else "@shared"
    return found


def write_perf_map(functions, path):
    """Write ``functions`` ({address: name}) as perf's JIT symbol map: ``start size name``
    per line, each function taken to end where the next one starts (at most 1 MiB; Numba's
    runtime functions at most 256 bytes: they are a few instructions, and code after one that
    this map does not name, such as a function loaded from the cache, was counted as theirs)."""
    addrs = sorted(functions)
    with open(path, "w") as f:
        for i, a in enumerate(addrs):
            size = addrs[i + 1] - a if i + 1 < len(addrs) and addrs[i + 1] - a < 1 << 20 else 4096
            if functions[a].startswith("NRT_"):
                size = min(size, 256)
            f.write(f"{a:x} {size:x} {functions[a]}\n")
    return len(addrs)


def _sample(perf, call, data, seconds, threads):
    """Run ``call`` in a loop on a thread while ``perf record`` samples this
    process for ``seconds``; returns the calls' times and perf's report by symbol.
    ``threads``: Numba's thread count, set in that thread (Numba keeps it per
    calling thread: set in the main thread, the loop ran on the default)."""
    import numba

    done = threading.Event()
    times = []

    def loop():
        numba.set_num_threads(threads)
        while not done.is_set():
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)

    worker = threading.Thread(target=loop)
    worker.start()
    try:
        rec = subprocess.run([perf, "record", "-q", "-F", "2000", "-o", data, "-p", str(os.getpid()), "--",
                              "sleep", str(seconds)], capture_output=True, text=True)
    finally:
        done.set()
        worker.join()
    if rec.returncode != 0 or not os.path.exists(data):
        raise SystemExit(f"perf record failed (perf_event_paranoid?): {rec.stderr.strip()[-500:]}")
    rep = subprocess.run([perf, "report", "-i", data, "--sort", "sym", "--stdio", "--percent-limit", "0.3"],
                         capture_output=True, text=True)
    return times, rep.stdout


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("fwd", "fwdbwd", "causal-fwd", "causal-fwdbwd"), default="causal-fwdbwd")
    p.add_argument("--log2n", type=int, default=18)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dim", type=int, default=128, help="head dim d = dv (default 128)")
    p.add_argument("--planes", type=int, default=3, help="hyperplanes per table P (default 3)")
    p.add_argument("--tables", type=int, default=3, help="tables L (default 3)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=10.0, help="how long perf samples")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--dplanes", action="store_true", help="the backward also returns the planes' gradient")
    a = p.parse_args(argv)
    if not 4 <= a.log2n <= 24:
        p.error("--log2n must be in 4..24")
    perf = shutil.which("perf")
    if perf is None:
        raise SystemExit("perf is not installed (linux-tools)")

    if "numba" in sys.modules:
        raise SystemExit("run perf_profile.py as a script: Numba was already imported with another cache")
    cache = tempfile.mkdtemp(prefix="racecpu-profile-")
    os.environ["NUMBA_CACHE_DIR"] = cache  # before Numba is imported: compile afresh, keep the IR
    import numba
    import numpy as np

    import racecpu
    from racecpu import _kernels

    threads = min(a.threads, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(threads)
    n, heads, d = 1 << a.log2n, a.heads * a.batch, a.dim
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((a.batch, a.heads, n, d), dtype=np.float32) for _ in range(4))
    planes = rng.standard_normal((a.tables, a.planes, d)).astype(np.float32)
    out = np.empty_like(q)
    grads = tuple(np.empty_like(x) for x in (q, k, v))
    causal = a.mode.startswith("causal")

    def call():
        if a.mode.endswith("fwdbwd"):
            res = racecpu.race_attention_fwd(q, k, v, planes, causal=causal, out=out)[1]
            racecpu.race_attention_bwd(res, g, out=grads, dplanes=a.dplanes)
        else:
            racecpu.race_attention(q, k, v, planes, causal=causal, out=out)

    mapfile = f"/tmp/perf-{os.getpid()}.map"
    try:
        print(f"compiling ({a.mode}) ...", flush=True)
        call()
        call()
        from racecpu._kernels import _link  # the kernels called through a symbol (kernel(by_address=True))
        mods = [m for name, m in sorted(sys.modules.items()) if name.startswith(_kernels.__name__)]
        nmap = write_perf_map(compiled_functions(mods, _link._IMPLS.values()), mapfile)
        times, report = _sample(perf, call, os.path.join(cache, "perf.data"), a.seconds, threads)
    finally:  # the map and the fresh cache are of this run only
        if os.path.exists(mapfile):
            os.remove(mapfile)
        shutil.rmtree(cache, ignore_errors=True)
    ns = float(np.median(times)) * 1e9 / (n * heads) if times else float("nan")
    print(f"{a.mode}: B = {a.batch}, N = 2^{a.log2n}, {a.heads} heads, d = {d}, P = {a.planes}, L = {a.tables}, "
          f"{a.threads} threads: {ns:.1f} ns per token-head "
          f"(median of {len(times)} calls); {nmap} compiled functions named")
    shown = 0
    for line in report.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+\[[.k]\]\s+(\S+)", line)
        if m and shown < a.top:
            print(f"  {float(m.group(1)):6.2f} %  {short_name(m.group(2))}")
            shown += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

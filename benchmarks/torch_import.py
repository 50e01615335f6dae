"""Does importing torch slow racecpu down? The same call in fresh processes, alternating.

    python benchmarks/torch_import.py [--tokens 4096] [--heads 4] [--dim 128] [--rounds 6] [--reps 30]

Each round starts one process per variant, in turn, and each process times
``--reps`` causal forward+backward calls of the NumPy API (after two warm-up
calls) and reports their median in ns per token-head:

- ``alone``: racecpu only;
- ``torch first``: ``import torch`` before racecpu (Numba's OpenMP layer then
  binds to the libgomp torch loaded, which read the environment before racecpu
  could set its passive wait policy);
- ``torch first, passive``: the same with ``OMP_WAIT_POLICY=PASSIVE`` in the
  environment of the process, so that torch's libgomp reads it;
- ``torch after``: racecpu's threads started first, then ``import torch``;
- ``torch first, active``: torch first with ``OMP_WAIT_POLICY=ACTIVE`` (idle
  threads spin without end), to see what spinning costs here.

Prints each variant's median over the rounds and its ratio to ``alone``, and
which libgomp the process has mapped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, sys, time
a = json.loads(sys.argv[1])
if a["torch"] == "first":
    import torch
import numpy as np
import racecpu
rng = np.random.default_rng(0)
shape = (1, a["heads"], a["tokens"], a["dim"])
q, k, v, g = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
planes = racecpu.hyperplanes(a["dim"], 3, 3, seed=0)
def call():
    out, res = racecpu.race_attention_fwd(q, k, v, planes, causal=True)
    racecpu.race_attention_bwd(res, g)
call()
if a["torch"] == "after":
    import torch
call()
times = []
for _ in range(a["reps"]):
    t = time.perf_counter()
    call()
    times.append(time.perf_counter() - t)
times.sort()
gomp = sorted({line.split()[-1] for line in open("/proc/self/maps") if "gomp" in line})
print(json.dumps({"ns": times[len(times) // 2] * 1e9 / (a["tokens"] * a["heads"]), "gomp": gomp}))
"""

VARIANTS = {  # name: (torch, OMP_WAIT_POLICY in the child's environment or None)
    "alone": (None, None),
    "torch first": ("first", None),
    "torch first, passive": ("first", "PASSIVE"),
    "torch after": ("after", None),
    "torch first, active": ("first", "ACTIVE"),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args(argv)
    args = {"tokens": a.tokens, "heads": a.heads, "dim": a.dim, "reps": a.reps}
    seen = {name: [] for name in VARIANTS}
    gomp = {}
    for r in range(a.rounds):
        for name, (torch, policy) in VARIANTS.items():
            env = dict(os.environ)
            env.pop("OMP_WAIT_POLICY", None)
            if policy:
                env["OMP_WAIT_POLICY"] = policy
            out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(dict(args, torch=torch))], env=env,
                                 capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"{name}: {out.stderr[-2000:]}")
            rec = json.loads(out.stdout.strip().splitlines()[-1])
            seen[name].append(rec["ns"])
            gomp[name] = rec["gomp"]
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.0f}" for n, v in seen.items()), flush=True)
    base = statistics.median(seen["alone"])
    print(f"\ncausal fwd+bwd, N = {a.tokens}, {a.heads} heads, d = {a.dim}: median ns per token-head over "
          f"{a.rounds} rounds of {a.reps} calls")
    for name, v in seen.items():
        med = statistics.median(v)
        print(f"  {name:22s} {med:8.1f}  ({min(v):.0f}-{max(v):.0f})  x{med / base:.3f}  libgomp: "
              + (", ".join(gomp[name]) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

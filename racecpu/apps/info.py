"""``racecpu info``: what a bug report needs -- versions, threads, kernel cache, SIMD width, memory pool."""

from __future__ import annotations

import os
import platform
import sys

from ..cli import add_common_arguments

ENV_VARS = ("NUMBA_NUM_THREADS", "NUMBA_THREADING_LAYER", "NUMBA_CACHE_DIR", "RACECPU_POOL_BYTES",
            "OMP_NUM_THREADS", "OMP_WAIT_POLICY")


def add_arguments(p):
    p.add_argument("--no-call", action="store_true",
                   help="skip the tiny call that starts the thread pool (threading layer then 'not started')")
    add_common_arguments(p)


def _version(name):
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return None


def collect(call=True):
    """The facts ``racecpu info`` prints, as a dict (JSON-serialisable)."""
    import numba
    import numpy as np

    import racecpu
    from .._kernels import tiles
    from .._kernels._jit import cache_dir, host_cpu_name

    layer = "not started"
    if call:
        q = np.ones((1, 8, 4), np.float32)
        W = racecpu.hyperplanes(4, 2, 1, seed=0)
        racecpu.race_attention(q, q, q, W)
        try:
            layer = numba.threading_layer()
        except ValueError:
            layer = "not started"
    return dict(
        racecpu=racecpu.__version__,
        python=sys.version.split()[0],
        platform=platform.platform(),
        machine=platform.machine(),
        versions={n: _version(n) for n in ("numpy", "numba", "llvmlite", "scipy", "tqdm", "threadpoolctl",
                                           "matplotlib", "torch", "jax", "numba-cuda", "cupy")},
        cpu_count=os.cpu_count(),
        numba_threads=numba.get_num_threads(),
        numba_max_threads=numba.config.NUMBA_NUM_THREADS,
        threading_layer=layer,
        kernel_cache_dir=cache_dir(),
        simd_vector_bytes=tiles.VECTOR_BYTES,
        cpu_name=host_cpu_name(),
        pool=racecpu.pool_stats(),
        environment={k: os.environ.get(k) for k in ENV_VARS},
        package_dir=os.path.dirname(racecpu.__file__),
    )


def run(args):
    info = collect(call=not args.no_call)
    args.result = info
    width = 20
    print(f"{'racecpu':{width}}{info['racecpu']}  ({info['package_dir']})")
    print(f"{'python':{width}}{info['python']}  {info['platform']}")
    for name, ver in info["versions"].items():
        print(f"{name:{width}}{ver or '-'}")
    print(f"{'threads':{width}}{info['numba_threads']} of {info['numba_max_threads']} (NUMBA_NUM_THREADS; "
          f"{info['cpu_count']} CPUs), threading layer {info['threading_layer']}")
    print(f"{'kernel cache':{width}}{info['kernel_cache_dir'] or 'none (compiled in every process)'}")
    print(f"{'SIMD width':{width}}{info['simd_vector_bytes']} bytes (CPU {info['cpu_name']}, as LLVM names it)")
    pool = info["pool"]
    print(f"{'result pool':{width}}" + ", ".join(f"{k} {v}" for k, v in pool.items()))
    for k, v in info["environment"].items():
        if v is not None:
            print(f"{'$' + k:{width}}{v}")
    return 0

"""Timing helper shared by the side-by-side benchmark scripts (gqa.py, packed.py)."""

import time

import numpy as np


def alternate(calls, reps):
    """Warm every call once (compile, pool), then ``reps`` rounds calling each in turn.

    ``calls``: name -> zero-argument callable.  Returns ``(times, medians)``:
    each name's seconds per round, and their medians.
    """
    for call in calls.values():
        call()
    times = {name: [] for name in calls}
    for _ in range(reps):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    return times, {n: float(np.median(t)) for n, t in times.items()}


def rounds_text(times):
    """``name: t1 t2 ...; name: ...`` (seconds, 3 decimals)."""
    return "; ".join(f"{n}: {' '.join(f'{t:.3f}' for t in ts)}" for n, ts in times.items())

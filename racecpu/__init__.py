"""racecpu: RACE attention in linear time on CPUs (NumPy in, NumPy out).

RACE attention (Algorithms 1 and 2 of the paper) replaces softmax attention by
the sharpened angular kernel ``(1 - theta/pi) ** P``, estimated with soft LSH
bucket sketches over ``L`` hash tables of ``P`` hyperplanes each.
"""

import os as _os
from importlib.metadata import PackageNotFoundError, version as _version

# Numba's OpenMP layer spins its workers after every parallel region by default;
# on a shared or busy machine that turned a 0.4 ms call into 24 ms.  Sleep
# instead (the kernels are coarse, so the wake-up cost is negligible).  Set the
# variable yourself before importing racecpu to choose otherwise.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from . import reference
from ._memory import pool_stats, release_memory, set_pool_limit
from .attention import RaceAttention, Residuals, race_attention, race_attention_bwd, race_attention_fwd
from .hashing import DEFAULT_BETA, DEN_FLOOR, corners, hyperplanes, soft_buckets
from .streaming import RaceState
from . import sketch  # a callable module: racecpu.sketch(k, v, planes) is racecpu.sketch.sketch
from .sketch import Sketch, readout

try:
    __version__ = _version("racecpu")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.1.0"

__all__ = [
    "hyperplanes", "corners", "soft_buckets", "race_attention", "race_attention_fwd", "race_attention_bwd",
    "RaceAttention", "Residuals", "RaceState", "reference", "DEFAULT_BETA", "DEN_FLOOR", "__version__",
    "set_pool_limit", "release_memory", "pool_stats", "sketch", "Sketch", "readout",
]

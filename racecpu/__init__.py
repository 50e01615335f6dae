"""racecpu: RACE attention in linear time on CPUs (NumPy in, NumPy out).

RACE attention (Algorithms 1 and 2 of the paper) replaces softmax attention by
the sharpened angular kernel ``(1 - theta/pi) ** P``, estimated with soft LSH
bucket sketches over ``L`` hash tables of ``P`` hyperplanes each.

Importing racecpu changes nothing outside it: no environment variable, no
warning filter, no thread is started.  Numba's threads start with the first
call (see :func:`racecpu.set_threads` and ``racecpu.config.WAIT_POLICY``).
"""

from importlib.metadata import PackageNotFoundError, version as _version

from . import config, reference
from ._memory import pool_stats, release_memory, set_pool_limit
from .attention import RaceAttention, Residuals, race_attention, race_attention_bwd, race_attention_fwd
from .config import DEFAULT_BETA, DEN_FLOOR
from .engine import set_threads, threads
from .hashing import corners, hyperplanes, soft_buckets
from .streaming import RaceState
from .sketches import Sketch, readout, sketch

try:
    __version__ = _version("racecpu")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.1.0"

__all__ = [
    "hyperplanes", "corners", "soft_buckets", "race_attention", "race_attention_fwd", "race_attention_bwd",
    "RaceAttention", "Residuals", "RaceState", "reference", "config", "DEFAULT_BETA", "DEN_FLOOR",
    "__version__", "set_pool_limit", "release_memory", "pool_stats", "set_threads", "threads",
    "sketch", "Sketch", "readout",
]

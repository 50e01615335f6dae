"""Resident-memory readings of this process (used by the demo, out-of-core runs and the benchmarks)."""

from __future__ import annotations

import resource


def proc_status(field):
    """Bytes of a ``/proc/self/status`` field (``VmRSS``, ``VmHWM``), or None off Linux."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss():
    """Peak resident set size in bytes: VmHWM (resettable), else ru_maxrss."""
    hwm = proc_status("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss():
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False

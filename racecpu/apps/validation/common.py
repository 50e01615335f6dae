"""Results, claims, CSV and plotting helpers shared by the experiments."""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Claim", "Result", "write_csv", "pyplot", "progress", "fmt"]


@dataclass
class Claim:
    """One checked statement: ``holds`` is True, False, or None (measured, nothing claimed)."""
    key: str
    statement: str
    holds: bool | None
    measured: str

    @property
    def verdict(self):
        return {True: "holds", False: "does not hold", None: "measured"}[self.holds]

    def line(self):
        return f"**{self.key}** {self.statement}: **{self.verdict}** -- {self.measured}"


@dataclass
class Result:
    """What one experiment hands to the report: CSV tables, figures, claims, markdown."""
    name: str
    title: str
    tables: dict = field(default_factory=dict)     # csv name -> list of row dicts
    figures: list = field(default_factory=list)    # file names inside the output dir
    claims: list = field(default_factory=list)
    markdown: str = ""
    values: dict = field(default_factory=dict)     # numbers tests and the report read
    seconds: float = 0.0


def fmt(x, digits=3):
    """Compact number for tables: 3 significant digits, scientific when small or large."""
    x = float(x)
    if x == 0 or not np.isfinite(x):
        return f"{x:g}"
    if 1e-3 <= abs(x) < 1e4:
        return f"{x:.{digits}g}"
    return f"{x:.{max(digits - 1, 1)}e}"


def write_csv(path, rows):
    """Write a list of dicts (same keys) as CSV; floats with 6 significant digits."""
    if not rows:
        return
    keys = list(rows[0])
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(keys)
        for r in rows:
            w.writerow([f"{v:.6g}" if isinstance(v, (float, np.floating)) else v for v in (r[k] for k in keys)])


STYLE = {"figure.dpi": 90, "savefig.dpi": 90, "font.size": 9, "axes.grid": True, "grid.alpha": 0.3,
         "legend.fontsize": 7}


class _Figures:
    """The part of ``matplotlib.pyplot`` the experiments use, without pyplot's global state.

    Figures are :class:`matplotlib.figure.Figure` objects on an Agg canvas: no
    backend is selected and no figure is registered with pyplot, so a caller's
    interactive session is left as it was.  :func:`style` holds the rcParams.
    """

    def __init__(self, matplotlib):
        self._mpl = matplotlib

    @property
    def rcParams(self):
        return self._mpl.rcParams

    def subplots(self, *args, figsize=None, **kw):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=figsize)
        FigureCanvasAgg(fig)
        return fig, fig.subplots(*args, **kw)


def pyplot():
    """A pyplot-like figure factory on an Agg canvas (no display needed; pyplot's state untouched)."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("racecpu validate draws its plots with matplotlib: pip install matplotlib") from None
    return _Figures(matplotlib)


def style():
    """A context in which the experiments' rcParams hold; the caller's are restored on exit."""
    import contextlib
    try:
        import matplotlib
    except ImportError:
        return contextlib.nullcontext()
    return matplotlib.rc_context(STYLE)


def savefig(fig, out_dir, name):
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path)
    return name


def progress(total, desc, enabled=True):
    """A tqdm bar (a silent one when ``enabled`` is False)."""
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, dynamic_ncols=True)

"""The chart of ``kvbridge bench --scale --plot``: log-log panels side by side, each with named
series of (x, y) points, drawn with matplotlib (its Agg renderer; no display needed)."""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass, field

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

#: what ``save`` writes, by the file name's extension
FORMATS = ("svg", "png", "pdf")


@dataclass(frozen=True)
class Panel:
    """One chart: a title, axis labels and ``series`` (name -> points, x and y > 0)."""

    title: str
    xlabel: str
    ylabel: str
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


def figure(panels: list[Panel], *, note: str = "") -> Figure:
    """``panels`` side by side on log-log axes (one line with a marker per point for each
    series, a legend with the series names), ``note`` in small print under them."""
    if not panels:
        raise ValueError("a chart needs at least one panel")
    fig = Figure(figsize=(4.6 * len(panels), 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, p in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels, strict=True):
        pts = [pt for s in p.series.values() for pt in s]
        if not pts:
            raise ValueError(f"panel {p.title!r} has no points")
        if any(x <= 0 or y <= 0 for x, y in pts):
            raise ValueError(f"panel {p.title!r}: log axes need x and y > 0")
        for name, s in p.series.items():
            if not s:
                continue
            xs, ys = zip(*sorted(s), strict=True)
            ax.plot(xs, ys, marker="o", markersize=4, linewidth=2, label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(p.title, fontsize=11, fontweight="bold")
        ax.set_xlabel(p.xlabel)
        ax.set_ylabel(p.ylabel)
        ax.grid(True, which="major", color="#dddddd")
        ax.legend(fontsize=8, loc="upper left")
    if note:
        fig.supxlabel(textwrap.fill(note, 60 * len(panels)), fontsize=8, color="#555555")
    return fig


def save(panels: list[Panel], path: str, *, note: str = "") -> None:
    """Write the chart to ``path``: SVG, PNG or PDF by its extension (SVG text stays text)."""
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext not in FORMATS:
        raise ValueError(f"cannot write a chart to {path!r}: name it .svg, .png or .pdf")
    fig = figure(panels, note=note)
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "kvbridge"}):
        fig.savefig(path, format=ext, dpi=120, facecolor="white")

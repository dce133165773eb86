"""A small SVG line chart on log-log axes, for ``kvbridge bench --scale --plot`` (no plotting
dependency): panels side by side, each with named series of (x, y) points."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf")


@dataclass(frozen=True)
class Panel:
    """One chart: a title, axis labels and ``series`` (name -> points, x and y > 0)."""

    title: str
    xlabel: str
    ylabel: str
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


def _decades(lo: float, hi: float) -> tuple[int, int]:
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    return a, max(b, a + 1)


def _fmt(e: int) -> str:
    v = 10.0 ** e
    return f"{v:g}" if -3 <= e <= 4 else f"1e{e}"


def _panel_svg(p: Panel, x0: float, w: float, h: float) -> list[str]:
    pts = [pt for s in p.series.values() for pt in s]
    if not pts:
        raise ValueError(f"panel {p.title!r} has no points")
    if any(x <= 0 or y <= 0 for x, y in pts):
        raise ValueError(f"panel {p.title!r}: log axes need x and y > 0")
    xa, xb = _decades(min(x for x, _ in pts), max(x for x, _ in pts))
    ya, yb = _decades(min(y for _, y in pts), max(y for _, y in pts))
    left, right, top, bottom = x0 + 70, x0 + w - 20, 40, h - 50

    def sx(x: float) -> float:
        return left + (math.log10(x) - xa) / (xb - xa) * (right - left)

    def sy(y: float) -> float:
        return bottom - (math.log10(y) - ya) / (yb - ya) * (bottom - top)

    out = [f'<text x="{(left + right) / 2:.1f}" y="22" text-anchor="middle" font-size="14" '
           f'font-weight="bold">{escape(p.title)}</text>',
           f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="none" stroke="#444"/>']
    for e in range(xa, xb + 1):
        x = sx(10.0 ** e)
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke="#ddd"/>')
        out.append(f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle" font-size="11">{_fmt(e)}</text>')
    for e in range(ya, yb + 1):
        y = sy(10.0 ** e)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11">{_fmt(e)}</text>')
    out.append(f'<text x="{(left + right) / 2:.1f}" y="{h - 12}" text-anchor="middle" '
               f'font-size="12">{escape(p.xlabel)}</text>')
    out.append(f'<text x="{x0 + 16}" y="{(top + bottom) / 2:.1f}" text-anchor="middle" font-size="12" '
               f'transform="rotate(-90 {x0 + 16} {(top + bottom) / 2:.1f})">{escape(p.ylabel)}</text>')
    for i, (name, s) in enumerate(p.series.items()):
        colour = _COLOURS[i % len(_COLOURS)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in sorted(s))
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        out.extend(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{colour}"/>' for x, y in s)
        ly = top + 14 + 16 * i
        out.append(f'<line x1="{left + 10}" y1="{ly - 4}" x2="{left + 28}" y2="{ly - 4}" stroke="{colour}" '
                   f'stroke-width="2"/><text x="{left + 34}" y="{ly}" font-size="11">{escape(name)}</text>')
    return out


def svg(panels: list[Panel], *, width: int = 460, height: int = 340, note: str = "") -> str:
    """The SVG document: ``panels`` side by side, ``note`` in small print under them."""
    total_h = height + (20 if note else 0)
    body: list[str] = []
    for i, p in enumerate(panels):
        body.extend(_panel_svg(p, i * width, width, height))
    if note:
        body.append(f'<text x="10" y="{height + 12}" font-size="11" fill="#555">{escape(note)}</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width * len(panels)}" height="{total_h}" '
            f'font-family="sans-serif">\n<rect width="100%" height="100%" fill="white"/>\n'
            + "\n".join(body) + "\n</svg>\n")

"""The one plot of `kvyard bench route`: TTFT p90 against request rate, a line per
policy, as a dependency-free SVG (matplotlib is not installed here)."""
from __future__ import annotations

import math
from html import escape
from pathlib import Path

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf")
W, H, L, R, T, B = 720, 420, 70, 200, 30, 50  # size and margins (left, right, top, bottom)


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    for m in (1, 2, 5, 10):
        if (hi - lo) / (step * m) <= n:
            step *= m
            break
    start = math.floor(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step) + 2) if start + i * step <= hi * 1.0001]


def svg(series: dict[str, list[tuple[float, float]]], title: str,
        xlabel: str = "request rate (req/s)", ylabel: str = "TTFT p90 (s)") -> str:
    pts = [p for s in series.values() for p in s if not math.isnan(p[1])]
    if not pts:
        pts = [(0.0, 0.0), (1.0, 1.0)]
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y1 = max(p[1] for p in pts) * 1.05 or 1.0
    x1 = x1 if x1 > x0 else x0 + 1

    def sx(x: float) -> float:
        return L + (x - x0) / (x1 - x0) * (W - L - R)

    def sy(y: float) -> float:
        return H - B - y / y1 * (H - T - B)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2 - R / 2}" y="18" text-anchor="middle" font-size="14">'
           f'{escape(title)}</text>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>']
    for x in _ticks(x0, x1):
        out.append(f'<text x="{sx(x):.1f}" y="{H - B + 16}" text-anchor="middle">{x:g}</text>')
    for y in _ticks(0.0, y1):
        out.append(f'<line x1="{L}" y1="{sy(y):.1f}" x2="{W - R}" y2="{sy(y):.1f}" '
                   f'stroke="#ddd"/><text x="{L - 6}" y="{sy(y) + 4:.1f}" '
                   f'text-anchor="end">{y:.3g}</text>')
    out.append(f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">'
               f'{escape(xlabel)}</text>')
    out.append(f'<text transform="translate(16,{(T + H - B) / 2}) rotate(-90)" '
               f'text-anchor="middle">{escape(ylabel)}</text>')
    for i, (name, s) in enumerate(series.items()):
        c = COLORS[i % len(COLORS)]
        good = [(x, y) for x, y in s if not math.isnan(y)]
        if good:
            d = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in good)
            out.append(f'<polyline points="{d}" fill="none" stroke="{c}" stroke-width="2"/>')
            out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{c}"/>'
                    for x, y in good]
        ly = T + 16 * i + 10
        out.append(f'<line x1="{W - R + 10}" y1="{ly}" x2="{W - R + 30}" y2="{ly}" '
                   f'stroke="{c}" stroke-width="2"/><text x="{W - R + 36}" y="{ly + 4}">'
                   f'{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def write_ttft_plot(policies: dict[str, dict], path: Path, title: str) -> Path:
    """From the bench's JSON `policies` (each with `by_rate` rows)."""
    series = {name: [(row["rate"], row["ttft_p90"]) for row in p.get("by_rate", [])]
              for name, p in policies.items() if p.get("by_rate")}
    path.write_text(svg(series, title))
    return path

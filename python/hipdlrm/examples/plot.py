"""A small line-plot rasteriser that writes PNG files with the standard library only (zlib).

The training example must leave a plot behind on machines without matplotlib (CI, the GPU machine), so
it draws its own: panels of line series with axes, tick labels, a title and a legend, in a built-in
5x7 pixel font, encoded as an 8-bit RGB PNG.
"""
from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

Color = Tuple[int, int, int]

# One color per series, in order (colorblind-friendly blue, orange, green, purple).
SERIES_COLORS: Tuple[Color, ...] = ((31, 119, 180), (230, 120, 20), (44, 160, 44), (148, 103, 189))
_BLACK: Color = (0, 0, 0)
_GRID: Color = (225, 225, 225)
_WHITE: Color = (255, 255, 255)

# 5x7 glyphs: seven rows, top to bottom, bit 4 is the leftmost column. Upper case is drawn as lower case.
_FONT: Dict[str, Tuple[int, ...]] = {
    "0": (0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E), "1": (0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E),
    "2": (0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F), "3": (0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E),
    "4": (0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02), "5": (0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E),
    "6": (0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E), "7": (0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08),
    "8": (0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E), "9": (0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C),
    "a": (0x00, 0x00, 0x0E, 0x01, 0x0F, 0x11, 0x0F), "b": (0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1E),
    "c": (0x00, 0x00, 0x0E, 0x10, 0x10, 0x11, 0x0E), "d": (0x01, 0x01, 0x0D, 0x13, 0x11, 0x11, 0x0F),
    "e": (0x00, 0x00, 0x0E, 0x11, 0x1F, 0x10, 0x0E), "f": (0x06, 0x09, 0x08, 0x1C, 0x08, 0x08, 0x08),
    "g": (0x0F, 0x11, 0x11, 0x0F, 0x01, 0x11, 0x0E), "h": (0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11),
    "i": (0x04, 0x00, 0x0C, 0x04, 0x04, 0x04, 0x0E), "j": (0x02, 0x00, 0x06, 0x02, 0x02, 0x12, 0x0C),
    "k": (0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12), "l": (0x0C, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E),
    "m": (0x00, 0x00, 0x1A, 0x15, 0x15, 0x11, 0x11), "n": (0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11),
    "o": (0x00, 0x00, 0x0E, 0x11, 0x11, 0x11, 0x0E), "p": (0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10),
    "q": (0x0F, 0x11, 0x11, 0x0F, 0x01, 0x01, 0x01), "r": (0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10),
    "s": (0x00, 0x00, 0x0E, 0x10, 0x0E, 0x01, 0x1E), "t": (0x08, 0x08, 0x1C, 0x08, 0x08, 0x09, 0x06),
    "u": (0x00, 0x00, 0x11, 0x11, 0x11, 0x13, 0x0D), "v": (0x00, 0x00, 0x11, 0x11, 0x11, 0x0A, 0x04),
    "w": (0x00, 0x00, 0x11, 0x11, 0x15, 0x15, 0x0A), "x": (0x00, 0x00, 0x11, 0x0A, 0x04, 0x0A, 0x11),
    "y": (0x11, 0x11, 0x11, 0x0F, 0x01, 0x11, 0x0E), "z": (0x00, 0x00, 0x1F, 0x02, 0x04, 0x08, 0x1F),
    ".": (0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C), ",": (0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08),
    "-": (0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00), "+": (0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00),
    "/": (0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00), ":": (0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00),
    "(": (0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02), ")": (0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08),
    "%": (0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03), "=": (0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00),
    "_": (0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F), " ": (0x00,) * 7,
}
# Letters with a descender: their seven rows start two rows lower (at the x-height).
_DESCENDERS = frozenset("gpqy")
_GLYPH_W = 5


class Canvas:
    """An RGB pixel buffer with the few drawing primitives a line plot needs."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(_WHITE * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i:i + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Fills the rectangle with corners (x0, y0) and (x1, y1), both included."""
        for y in range(max(0, y0), min(self.height, y1 + 1)):
            for x in range(max(0, x0), min(self.width, x1 + 1)):
                self.set(x, y, color)

    def line(self, x0: float, y0: float, x1: float, y1: float, color: Color, width: int = 1) -> None:
        """A straight segment (Bresenham), `width` pixels thick."""
        xa, ya, xb, yb = round(x0), round(y0), round(x1), round(y1)
        dx, dy = abs(xb - xa), -abs(yb - ya)
        sx, sy = (1 if xa < xb else -1), (1 if ya < yb else -1)
        err = dx + dy
        lo, hi = -((width - 1) // 2), width // 2
        while True:
            for oy in range(lo, hi + 1):
                for ox in range(lo, hi + 1):
                    self.set(xa + ox, ya + oy, color)
            if xa == xb and ya == yb:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                xa += sx
            if e2 <= dx:
                err += dx
                ya += sy

    def text(self, x: int, y: int, s: str, color: Color = _BLACK, scale: int = 2, anchor: str = "left") -> None:
        """Draws `s` with its top edge at y; `anchor` ("left", "center", "right") places it around x."""
        w = text_width(s, scale)
        if anchor == "center":
            x -= w // 2
        elif anchor == "right":
            x -= w
        for ch in s.lower():
            rows = _FONT.get(ch, _FONT[" "])
            top = y + (2 * scale if ch in _DESCENDERS else 0)
            for r, bits in enumerate(rows):
                for c in range(_GLYPH_W):
                    if bits & (1 << (_GLYPH_W - 1 - c)):
                        self.rect(x + c * scale, top + r * scale, x + (c + 1) * scale - 1,
                                  top + (r + 1) * scale - 1, color)
            x += (_GLYPH_W + 1) * scale

    def png(self) -> bytes:
        """The canvas as a PNG file: one IDAT of unfiltered 8-bit RGB scanlines."""
        stride = 3 * self.width
        raw = b"".join(b"\x00" + bytes(self.pixels[y * stride:(y + 1) * stride]) for y in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
                + chunk(b"IEND", b""))


def text_width(s: str, scale: int = 2) -> int:
    return max(0, len(s) * (_GLYPH_W + 1) * scale - scale)


def nice_ticks(lo: float, hi: float, count: int = 5) -> List[float]:
    """About `count` round tick values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    if not hi > lo:
        hi = lo + (abs(lo) if lo else 1.0)
    raw = (hi - lo) / max(1, count)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks = []
    t = first
    while t <= hi + 1e-9 * step:
        ticks.append(round(t, 12))
        t += step
    return ticks


def format_number(v: float) -> str:
    """Short tick labels: 0.512, 12k, 1.5m."""
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.3g}m"
    if a >= 1e4:
        return f"{v / 1e3:.3g}k"
    return f"{v:.4g}"


class Panel:
    """One plot area: series of (x, y) points drawn as lines, with axes, ticks, a title and a legend."""

    def __init__(self, title: str, x_label: str, y_label: str) -> None:
        self.title, self.x_label, self.y_label = title, x_label, y_label
        self.series: List[Tuple[str, Sequence[float], Sequence[float]]] = []

    def add(self, name: str, xs: Sequence[float], ys: Sequence[float]) -> None:
        if len(xs) != len(ys):
            raise ValueError(f"series {name!r}: {len(xs)} x values but {len(ys)} y values")
        finite = [(x, y) for x, y in zip(xs, ys) if math.isfinite(x) and math.isfinite(y)]
        self.series.append((name, [p[0] for p in finite], [p[1] for p in finite]))

    def draw(self, canvas: Canvas, left: int, top: int, width: int, height: int) -> None:
        """Draws into the box (left, top, width, height) of the canvas, axes labels included."""
        x0, y0 = left + 90, top + 26           # plot area: leaves room for tick labels and the title
        canvas.text(max(x0, left + text_width(self.y_label) + 24), top, self.title)
        x1, y1 = left + width - 10, top + height - 46
        points = [(x, y) for _, xs, ys in self.series for x, y in zip(xs, ys)]
        if points:
            xmin, xmax = min(p[0] for p in points), max(p[0] for p in points)
            ymin, ymax = min(p[1] for p in points), max(p[1] for p in points)
        else:
            xmin, xmax, ymin, ymax = 0.0, 1.0, 0.0, 1.0
        if xmax <= xmin:
            xmax = xmin + 1.0
        pad = (ymax - ymin) * 0.05 or max(abs(ymax) * 0.05, 1e-6)
        ymin, ymax = ymin - pad, ymax + pad

        def px(x: float) -> float:
            return x0 + (x - xmin) / (xmax - xmin) * (x1 - x0)

        def py(y: float) -> float:
            return y1 - (y - ymin) / (ymax - ymin) * (y1 - y0)

        for t in nice_ticks(ymin, ymax):
            if ymin <= t <= ymax:
                canvas.line(x0, py(t), x1, py(t), _GRID)
                canvas.text(x0 - 6, round(py(t)) - 7, format_number(t), anchor="right")
        for t in nice_ticks(xmin, xmax):
            if xmin <= t <= xmax:
                canvas.line(px(t), y0, px(t), y1, _GRID)
                canvas.text(round(px(t)), y1 + 6, format_number(t), anchor="center")
        canvas.line(x0, y0, x0, y1, _BLACK)
        canvas.line(x0, y1, x1, y1, _BLACK)
        canvas.text((x0 + x1) // 2, y1 + 26, self.x_label, anchor="center")
        canvas.text(left, top, self.y_label)

        for k, ((name, xs, ys), color) in enumerate(zip(self.series, SERIES_COLORS)):
            width = 3 if k == 0 else 1     # a thin line over a thick one: both stay visible where they agree
            for i in range(1, len(xs)):
                canvas.line(px(xs[i - 1]), py(ys[i - 1]), px(xs[i]), py(ys[i]), color, width=width)
            if len(xs) == 1:
                canvas.rect(round(px(xs[0])) - 2, round(py(ys[0])) - 2, round(px(xs[0])) + 2, round(py(ys[0])) + 2,
                            color)
        legend_x = x1
        for (name, _, _), color in reversed(list(zip(self.series, SERIES_COLORS))):
            legend_x -= text_width(name)
            canvas.text(legend_x, top, name)
            canvas.rect(legend_x - 30, top + 6, legend_x - 8, top + 8, color)
            legend_x -= 46


def write_png(path: Path, panels: Sequence[Panel], width: int = 960, panel_height: int = 340) -> Path:
    """Stacks the panels vertically into one PNG at `path` and returns the path."""
    canvas = Canvas(width, panel_height * len(panels) + 10)
    for i, panel in enumerate(panels):
        panel.draw(canvas, 10, 10 + i * panel_height, width - 20, panel_height - 10)
    path = Path(path)
    path.write_bytes(canvas.png())
    return path

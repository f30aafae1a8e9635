"""Drawing: boxes, text and lines in pixel coordinates, measured, and written as SVG or PNG.

Every picture of explain (the flow, a passage, a diff, a comparison) is a `Drawing`: a list
of primitives and a canvas size. Two small backends draw it: plain SVG text, and matplotlib
for PNG. Text is measured with the font the PNG uses (matplotlib's DejaVu Sans, which the
SVG names first), so that a layout can make room for its longest label instead of cutting
it at the canvas's edge; `text_extent` is what the tests check every label against.
A primitive may carry a `key`, so that tests can find the parts of a picture by name.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

from ...errors import GlassError

BLUE, BLUE_BG = "#1f6fd1", "#e8f1fc"
ORANGE, ORANGE_BG = "#d9631e", "#fdf0e6"
GRAY, GRAY_BG, INK, MUTED, RED, GREEN = "#6b7280", "#f3f4f6", "#111827", "#4b5563", "#b91c1c", "#15803d"
PURPLE = "#7c3aed"
SANS = "DejaVu Sans, Helvetica, Arial, sans-serif"
MONO = "DejaVu Sans Mono, Menlo, Consolas, monospace"
MARGIN = 20  # pixels kept free at the canvas's edges


@dataclass
class Rect:
    x: float
    y: float
    w: float
    h: float
    fill: str = "white"
    stroke: str = GRAY
    dash: bool = False
    width: float = 1.5
    key: str = ""


@dataclass
class Text:
    x: float
    y: float
    text: str
    size: float = 13
    bold: bool = False
    color: str = INK
    anchor: str = "start"  # start | middle | end
    mono: bool = False
    key: str = ""


@dataclass
class Line:
    points: list[tuple[float, float]]
    color: str = GRAY
    dash: bool = False
    arrow: bool = True
    width: float = 1.5
    key: str = ""


@dataclass
class Drawing:
    items: list = field(default_factory=list)
    width: float = 0
    height: float = 0

    def add(self, item) -> None:
        self.items.append(item)

    def keyed(self, prefix: str) -> list:
        """The primitives whose key starts with `prefix`, in drawing order."""
        return [it for it in self.items if it.key.startswith(prefix)]

    def fit_canvas(self, min_width: float, bottom: float) -> "Drawing":
        """Size the canvas: at least `min_width` wide, wide enough for every text and box, `bottom` + margin tall."""
        right = max([min_width - MARGIN] + [_right_edge(it) for it in self.items])
        self.width, self.height = int(right + MARGIN), int(bottom + MARGIN)
        return self


def _right_edge(item) -> float:
    if isinstance(item, Text):
        return text_extent(item)[1]
    if isinstance(item, Rect):
        return item.x + item.w
    return max(x for x, _ in item.points)


@functools.lru_cache(maxsize=8192)
def text_width(text: str, size: float, bold: bool = False, mono: bool = False) -> float:
    """Pixels `text` takes at `size` px in the PNG's font (DejaVu Sans or DejaVu Sans Mono)."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextToPath

    prop = FontProperties(family="monospace" if mono else "sans-serif", weight="bold" if bold else "normal",
                          size=size)
    width, _, _ = TextToPath().get_text_width_height_descent(drawable(text), prop, ismath=False)
    return width


def text_extent(t: Text) -> tuple[float, float]:
    """(left, right) of a text in pixels, from its anchor and measured width."""
    w = text_width(t.text, t.size, t.bold, t.mono)
    left = {"start": t.x, "middle": t.x - w / 2, "end": t.x - w}[t.anchor]
    return left, left + w


def fit(text: str, width: float, size: float, bold: bool = False, mono: bool = False) -> str:
    """`text`, cut with an ellipsis until it fits in `width` pixels."""
    if text_width(text, size, bold, mono) <= width:
        return text
    lo, hi = 0, len(text)
    while lo < hi:  # the longest prefix that fits with its ellipsis
        mid = (lo + hi + 1) // 2
        if text_width(text[:mid] + "…", size, bold, mono) <= width:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo] + "…"


def wrap(text: str, width: float, size: float, bold: bool = False, max_lines: int = 99) -> list[str]:
    """`text` broken at spaces into lines of at most `width` pixels; a longer word is broken where
    it must; past `max_lines`, the last line ends in an ellipsis."""
    lines: list[str] = []
    for word in text.split(" "):
        if lines and text_width(f"{lines[-1]} {word}", size, bold) <= width:
            lines[-1] += f" {word}"
            continue
        while True:
            piece = fit(word, width, size, bold)
            if piece == word:
                lines.append(word)
                break
            lines.append(piece[:-1])  # the ellipsis is not needed: the word goes on below
            word = word[len(piece) - 1:]
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] = fit(lines[-1] + " …", width, size, bold) if text_width(lines[-1] + " …", size, bold) > width \
            else lines[-1] + " …"
    return lines


# XML 1.0 forbids the C0 controls other than tab, newline and return, lone surrogates and
# U+FFFE/U+FFFF; a prompt may hold any of them. They are drawn as Python writes them (\x00,
# \ud800), and so are tab, newline, return and DEL, which would break a line or draw nothing.
_DRAWABLE = {c: repr(chr(c))[1:-1] for c in (*range(0x20), 0x7F, *range(0xD800, 0xE000), 0xFFFE, 0xFFFF)}


def header(d: Drawing, title: str, lines: list[str], width: float, x0: float = 30, y: float = 34) -> float:
    """A picture's header, the same for every picture: the title, then each line wrapped to the canvas,
    muted. Returns the y of the last line."""
    d.add(Text(x0, y, title, 18, True))
    for line in lines:
        for part in wrap(line, width - 2 * x0, 12):
            y += 18
            d.add(Text(x0, y, part, 12, color=MUTED))
    return y


def drawable(text: str) -> str:
    """`text` with every control character, and every character XML forbids, written as its escape."""
    return text.translate(_DRAWABLE)


def to_svg(d: Drawing) -> str:
    w, h = d.width, d.height
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
           f'font-family="{SANS}">',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
           f'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="{GRAY}"/></marker></defs>',
           f'<rect width="{w}" height="{h}" fill="white"/>']
    for it in d.items:
        if isinstance(it, Rect):
            dash = ' stroke-dasharray="5 4"' if it.dash else ""
            stroke = f'stroke="{it.stroke}" stroke-width="{it.width}"' if it.width else 'stroke="none"'
            out.append(f'<rect x="{it.x:.1f}" y="{it.y:.1f}" width="{it.w:.1f}" height="{it.h:.1f}" rx="6" '
                       f'fill="{it.fill}" {stroke}{dash}/>')
        elif isinstance(it, Text):
            font = f' font-family="{MONO}"' if it.mono else ""
            weight = ' font-weight="bold"' if it.bold else ""
            out.append(f'<text x="{it.x:.1f}" y="{it.y:.1f}" font-size="{it.size}" fill="{it.color}" '
                       f'text-anchor="{it.anchor}"{font}{weight}>{escape(drawable(it.text))}</text>')
        else:
            pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in it.points)
            dash = ' stroke-dasharray="6 4"' if it.dash else ""
            marker = ' marker-end="url(#arrow)"' if it.arrow else ""
            out.append(f'<polyline points="{pts}" fill="none" stroke="{it.color}" stroke-width="{it.width}"{dash}{marker}/>')
    out.append("</svg>")
    return "\n".join(out)


def figure(d: Drawing, scale: float = 2.0):
    """The drawing as a matplotlib Figure, (width * scale, height * scale) pixels."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import FancyBboxPatch
    except ImportError:
        raise GlassError("PNG output needs matplotlib: pip install 'glassgpt[plot]' (or use --format svg)") from None
    fig = Figure(figsize=(d.width / 100, d.height / 100), dpi=100 * scale)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, d.width)
    ax.set_ylim(d.height, 0)
    ax.axis("off")
    px_to_pt = 72 / 100  # the figure is 100 px per inch at scale 1
    for it in d.items:
        if isinstance(it, Rect):
            ax.add_patch(FancyBboxPatch((it.x, it.y), it.w, it.h, boxstyle="round,pad=0,rounding_size=6",
                                        facecolor=it.fill, edgecolor=it.stroke if it.width else "none",
                                        linewidth=it.width * px_to_pt, linestyle="--" if it.dash else "-"))
        elif isinstance(it, Text):
            ax.text(it.x, it.y, drawable(it.text), fontsize=it.size * px_to_pt, color=it.color,
                    ha={"start": "left", "middle": "center", "end": "right"}[it.anchor], va="baseline",
                    fontweight="bold" if it.bold else "normal", family="monospace" if it.mono else "sans-serif",
                    parse_math=False)  # a prompt with two $ signs is text, not a formula
        else:
            style = "--" if it.dash else "-"
            if it.arrow:
                ax.annotate("", xy=it.points[-1], xytext=it.points[-2],
                            arrowprops={"arrowstyle": "-|>", "color": it.color, "lw": it.width * px_to_pt,
                                        "linestyle": style})
            else:
                xs, ys = zip(*it.points)
                ax.plot(xs, ys, color=it.color, linewidth=it.width * px_to_pt, linestyle=style)
    return fig


def save_png(d: Drawing, path: str, scale: float = 2.0) -> tuple[int, int]:
    """Draw `d` into a PNG file: its (width, height) in pixels."""
    figure(d, scale).savefig(path, dpi=100 * scale)
    return int(round(d.width * scale)), int(round(d.height * scale))

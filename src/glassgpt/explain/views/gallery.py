"""The views of a Gallery (gallery.py): the text, the picture (cards side by side, each block drawn as its norms,
attention and feed-forward sit) and the notebook cell; and the text of compare.py's Changes (what changed from GPT-2).
"""

from __future__ import annotations

from html import escape

from ..compare import Changes
from ..gallery import Card, Gallery, cache_bytes
from . import draw
from .notebook import figure_html
from .draw import BLUE, BLUE_BG, GRAY, GRAY_BG, GREEN, INK, MUTED, ORANGE, ORANGE_BG, PURPLE, Drawing, Line, Rect, Text

CARD_W, GAP, PER_ROW = 300.0, 20.0, 4
LAYER_COLOURS = {"F": BLUE, "S": ORANGE, "L": PURPLE}  # full, sliding, linear


def size(n: int) -> str:
    """Bytes in the unit a reader reads them in: 36.0 KiB, 1.50 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if n >= 10 * scale or unit == "GiB" else f"{n / scale:.1f} {unit}"
    return f"{n} B"


def count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n:,}"


def cache_line(c: Card, tokens: int) -> str:
    grows = f"{size(c.kv_bytes_per_token)} per token" if c.kv_bytes_per_token else "nothing per token"
    fixed = f" + {size(c.fixed_bytes)} once full (windows, states)" if c.fixed_bytes else ""
    return f"{grows}{fixed}; {size(cache_bytes(c, tokens))} at {tokens:,} tokens"


# --- the text view --------------------------------------------------------------------------

def gallery_text(g: Gallery, **_options) -> str:
    lines = [f"the architecture gallery: {len(g.cards)} models at their real shapes, read from their descriptions "
             f"(cache in {g.dtype}, one sequence)", "",
             f"  {'model':<16} {'params':>9} {'per token':>10}  {'layers':<12} {'KV/token':>10} {'fixed':>10} "
             f"{f'at {g.tokens:,}':>11}"]
    for c in g.cards:
        lines.append(f"  {c.name:<16} {count(c.params):>9} {count(c.active_params):>10}  {c.pattern:<12} "
                     f"{size(c.kv_bytes_per_token):>10} {size(c.fixed_bytes):>10} {size(cache_bytes(c, g.tokens)):>11}")
    lines.append("  (layers: F full attention, S sliding window, L linear attention; the unit that repeats)")
    for c in g.cards:
        lines += ["", f"{c.name}  ({c.source})",
                  f"  shape       {c.shape['n_layers']} layers, d {c.shape['emb_dim']:,}, vocab "
                  f"{c.shape['vocab_size']:,}, context {c.shape['context_length']:,}",
                  f"  embedding   {c.embedding}", f"  positions   {c.positions}",
                  f"  norm        {c.norm}, placed {c.placement}"]
        lines += [f"  {'attention' if i == 0 else '':<11} {layer['attention']}" for i, layer in enumerate(c.layers)]
        lines += [f"  ff          {c.feed_forward}", f"  head        {c.head}",
                  f"  parameters  {c.params:,}" + (f" ({c.active_params:,} read per token)"
                                                    if c.active_params != c.params else ""),
                  f"  cache       {cache_line(c, g.tokens)}"]
        if c.changes:
            lines.append("  from GPT-2  " + "; ".join(r["change"] for r in c.changes))
    return "\n".join(lines)


# --- the picture ----------------------------------------------------------------------------

def gallery_layout(g: Gallery, **_options) -> Drawing:
    """The cards in rows of PER_ROW: each its name, its block, its layer strip and its figures."""
    d = Drawing()
    columns = min(PER_ROW, len(g.cards))
    width = 2 * 30 + columns * CARD_W + (columns - 1) * GAP
    y = draw.header(d, "glassgpt · the architecture gallery",
                    [f"{len(g.cards)} models at their real shapes, drawn from their descriptions; cache in {g.dtype}, "
                     f"one sequence of {g.tokens:,} tokens"], width)
    top, bottom = y + 24, y + 24
    for i, c in enumerate(g.cards):
        if i and i % columns == 0:
            top = bottom + GAP
        x = 30 + (i % columns) * (CARD_W + GAP)
        bottom = max(bottom, _card(d, c, g.tokens, x, top))
    return d.fit_canvas(width, bottom + 10)


def _card(d: Drawing, c: Card, tokens: int, x: float, y: float) -> float:
    """One card from (x, y); returns its bottom."""
    top, inner = y, CARD_W - 20
    d.add(Text(x + 10, y + 22, c.name, 15, True, key=f"card:{c.key}"))
    d.add(Text(x + 10, y + 38, f"{count(c.params)} parameters" + (f", {count(c.active_params)} per token"
                                                                   if c.active_params != c.params else ""), 11,
               color=MUTED))
    y = _block(d, c, x + 10, y + 52, inner)
    y = _strip(d, c, x + 10, y + 8, inner)
    lines = [c.embedding, c.positions, c.norm, c.feed_forward, c.head, *[g["attention"] for g in c.layers]]
    for line, colour in [(line, INK) for line in lines] + [(cache_line(c, tokens), BLUE)]:
        for part in draw.wrap(line, inner, 10):
            y += 14
            d.add(Text(x + 10, y, part, 10, color=colour))
    y += 12
    d.add(Rect(x, top, CARD_W, y - top, fill="none", stroke=GRAY, width=1))
    return y


def _block(d: Drawing, c: Card, x: float, y: float, w: float) -> float:
    """The block, input at the top: the norms where they sit (placement), the attention, the feed-forward and
    the residual adds."""
    att = {"L": "linear attention", "S": "attention (sliding)", "F": "attention"}
    kinds = " / ".join(dict.fromkeys(att[ch] for ch in c.pattern.split(" ")[0]))
    ff = "experts" if "experts" in c.feed_forward else c.feed_forward.split(" ")[0]
    norm, attention, mlp = (c.norm, GRAY_BG, GRAY), (kinds, BLUE_BG, BLUE), (ff, ORANGE_BG, ORANGE)
    steps = {"pre": [norm, attention, "+", norm, mlp, "+"], "post": [attention, norm, "+", mlp, norm, "+"],
             "sandwich": [norm, attention, norm, "+", norm, mlp, norm, "+"], "parallel": [norm, "||", "+"]}[c.placement]
    for step in steps:
        if step == "+":  # the residual add
            d.add(Text(x + w / 2, y + 10, "+ residual", 10, color=GREEN, anchor="middle"))
            y += 16
        elif step == "||":  # attention and feed-forward side by side, both reading the one norm's output
            half = (w - 70) / 2
            _box(d, attention, x + 30, half, y)
            y = _box(d, mlp, x + 40 + half, half, y)
        else:
            y = _box(d, step, x + 30, w - 60, y)
    return y


def _box(d: Drawing, step: tuple[str, str, str], x: float, w: float, y: float) -> float:
    """A box of one line of text (its words, fill and stroke) at y; returns the y below it and its arrow."""
    text, fill, stroke = step
    d.add(Rect(x, y, w, 20, fill=fill, stroke=stroke, width=1))
    d.add(Text(x + w / 2, y + 14, draw.fit(text, w - 8, 10), 10, anchor="middle"))
    d.add(Line([(x + w / 2, y + 20), (x + w / 2, y + 26)], arrow=False, width=1))
    return y + 26


def _strip(d: Drawing, c: Card, x: float, y: float, w: float) -> float:
    """Every layer as a square, coloured by its type (full, sliding, linear), in order."""
    letters = _letters(c.pattern)
    side = min(12.0, (w - 4) / max(1, len(letters)) - 1)
    for i, ch in enumerate(letters):
        d.add(Rect(x + i * (side + 1), y, side, side, fill=LAYER_COLOURS.get(ch, GRAY), stroke=LAYER_COLOURS.get(ch, GRAY),
                   width=0, key=f"layer:{c.key}:{i}"))
    d.add(Text(x, y + side + 13, f"{len(letters)} layers: " + ", ".join(
        f"{g['count']} {g['layer_type'].removesuffix('_attention')}" for g in c.layers), 10, color=MUTED))
    return y + side + 16


def _letters(pattern: str) -> str:
    unit, _, times = pattern.partition(" x")
    return unit * (int(times) if times else 1)


def gallery_html(g: Gallery) -> str:
    text = gallery_text(g).splitlines()
    return figure_html(gallery_layout(g), text[:len(g.cards) + 4])


def changes_text(c: Changes, **_options) -> str:
    """Each change from GPT-2: what it is, then GPT-2's way and the model's."""
    lines = [f"what changed from GPT-2 to {c.name} (read from both models' descriptions)"]
    for r in c.rows:
        lines += ["", r["change"], f"  GPT-2   {r['gpt2']}", f"  {c.name:<7} {r['model']}"]
    return "\n".join(lines)


def changes_html(c: Changes) -> str:
    return f"<pre>{escape(changes_text(c))}</pre>"

"""The views of a Comparison (compare.py): the text, and the picture of both models' bars, each with
the other model's probability marked.
"""

from __future__ import annotations

from itertools import zip_longest

from ..compare import Comparison
from ..notation import token
from .draw import GRAY, MUTED, ORANGE, PURPLE, Drawing, Line, Rect, Text, header

BAR_W = 300


# --- the text view --------------------------------------------------------------------------

def comparison_text(c: Comparison) -> str:
    a, b = c.a, c.b
    lines = [f"the next token of A = {a['name']} and B = {b['name']} after {c.prompt!r}"]
    lines += [f"note: {n}" for n in c.notes]
    if c.tokens_b is not None:
        for name, tokens in (("A", c.tokens), ("B", c.tokens_b)):
            lines.append(f"{name} reads {len(tokens)} tokens: " + " ".join(repr(t["text"]) for t in tokens))
    if c.kl_ab is not None:
        lines.append(f"KL(A || B) = {c.kl_ab:.4f} nats · KL(B || A) = {c.kl_ba:.4f} nats "
                     "(0 when both give every token the same probability)")
    lines.append(f"next token: A {a['next_token']['text']!r} (p {a['next_token']['prob']:.4f}) · "
                 f"B {b['next_token']['text']!r} (p {b['next_token']['prob']:.4f})")
    lines += ["", f"  {'rank':>4}  {'A: top tokens':<18} {'p in A':>8} {'p in B':>8}   │  {'B: top tokens':<18} "
                  f"{'p in B':>8} {'p in A':>8}"]
    other = lambda p: f"{p:>8.4f}" if p is not None else f"{'-':>8}"  # noqa: E731
    for k, (x, y) in enumerate(zip_longest(a["top"], b["top"]), 1):
        left = f"{token(x['text']):<18} {x['prob']:>8.4f} {other(x['other_prob'])}" if x else " " * 36
        right = f"{token(y['text']):<18} {y['prob']:>8.4f} {other(y['other_prob'])}" if y else ""
        lines.append(f"  {k:>4}  {left}   │  {right}".rstrip())
    lines += ["", "logit lens at the last position: the top token after each block, in A and in B"]
    lens = lambda x: f"{token(x['text']):<18} {x['prob']:.4f}" if x else f"{'(no such block)':<25}"  # noqa: E731
    for k, (x, y) in enumerate(zip_longest(a["lens_last"], b["lens_last"])):
        lines.append(f"  trf_blocks.{k:<3} A {lens(x)}   B {lens(y)}".rstrip())
    for side, name in ((a, "A"), (b, "B")):
        row = side["head_top"]
        if row:
            lines.append(f"{name}'s top token {row['text']!r}: logit {row['logit']:.3f} = h · W[id] with |W[id]| "
                         f"{row['w_norm']:.3f}, cos(h, W[id]) {row['cos']:.4f}")
    return "\n".join(lines)


# --- the picture ----------------------------------------------------------------------------

def comparison_layout(c: Comparison, width: float = 1040) -> Drawing:
    """Both models' top tokens as bars from 0 to 1, each with a tick at the other model's probability."""
    d = Drawing()
    kl = (f"KL(A || B) = {c.kl_ab:.4f} nats · KL(B || A) = {c.kl_ba:.4f} nats" if c.kl_ab is not None
          else "no KL divergence: each model reads the text with its own tokenizer" if c.tokens_b is not None
          else "no KL divergence: the two heads score different things")
    y = header(d, f"glassgpt · A = {c.a['name']} · B = {c.b['name']}",
               [f"prompt “{c.prompt}”", kl] + [f"note: {n}" for n in c.notes], width)
    return d.fit_canvas(width, bar_columns(d, c, y + 30, width) + 10)


def bar_columns(d: Drawing, c: Comparison, y: float, width: float) -> float:
    """A's bars on the left, B's on the right, from `y`; returns the bottom."""
    bottom = y
    for k, (side, color, other) in enumerate(((c.a, ORANGE, "B"), (c.b, PURPLE, "A"))):
        bottom = max(bottom, _bar_column(d, side, 30 + k * (width / 2), y, color, other))
    return bottom


def _bar_column(d: Drawing, side: dict, x: float, y: float, color: str, other: str) -> float:
    d.add(Text(x, y, f"{side['name']}: its top {len(side['top'])} next tokens", 13, True, color))
    y += 10
    label_w = 150
    for k, t in enumerate(side["top"]):
        y += 22
        d.add(Text(x + label_w - 8, y + 11, token(t["text"], 20), 12, anchor="end", mono=True))
        d.add(Rect(x + label_w, y, BAR_W, 14, "white", GRAY, width=0.5))
        d.add(Rect(x + label_w, y, max(2.0, BAR_W * t["prob"]), 14, color, color, width=0, key=f"bar:{side['name']}:{k}"))
        if t["other_prob"] is not None:
            tick = x + label_w + BAR_W * t["other_prob"]
            d.add(Line([(tick, y - 3), (tick, y + 17)], "#111827", arrow=False, width=2))
        d.add(Text(x + label_w + BAR_W + 8, y + 11, f"{t['prob']:.3f}", 11, color=MUTED, mono=True))
    y += 34
    d.add(Text(x, y, f"bars: probability 0 to 1 in {side['name']}; the black tick: the same token in {other}", 11,
               color=MUTED))
    return y

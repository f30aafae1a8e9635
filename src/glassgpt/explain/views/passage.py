"""The views of a Passage (passage.py): the text with each token marked by the probability the model
gave it, then the positions it got most wrong; and the same as a picture.
"""

from __future__ import annotations


from ..notation import token
from ..passage import Passage
from .draw import GRAY, INK, MUTED, ORANGE, RED, Drawing, Rect, Text, fit, header, text_width

# Probability bands, shared by the text and the picture: (lower bound, name, ANSI colour, fill colour).
BANDS = [(0.5, "p >= 0.5", "\033[38;5;35m", "#bbf7d0"), (0.1, "p >= 0.1", "", "#fef9c3"),
         (0.01, "p >= 0.01", "\033[38;5;208m", "#fed7aa"), (0.0, "p < 0.01", "\033[38;5;160m", "#fecaca")]

def band(prob: float | None) -> tuple[float, str, str, str]:
    return next(b for b in BANDS if prob is None or prob >= b[0])


# --- the text view --------------------------------------------------------------------------

def passage_text(p: Passage, color: bool = False) -> str:
    """The passage with each token marked by the probability the model gave it, then the worst positions."""
    name = p.model["name"]
    lines = [f"glassgpt explain --passage · model {name} · {len(p.tokens):,} tokens · loss {p.loss:.3f} "
             f"(perplexity {p.perplexity:,.1f}): the probability of each true next token"]
    if p.model["random_weights"]:
        lines.append("RANDOM WEIGHTS: the probabilities are noise (a trained model is surprised in fewer places)")
    lines += [f"note: {note}" for note in p.notes]
    if color:
        lines.append("  " + "  ".join(f"{code}{label}\033[0m" for _, label, code, _ in BANDS if code) + "  (else p >= 0.1)")
        body = "".join(f"{band(t['prob'])[2]}{t['text']}\033[0m" if band(t["prob"])[2] else t["text"] for t in p.tokens)
    else:
        lines.append("  tokens the model gave p < 0.01 are in «»")
        body = "".join(f"«{t['text']}»" if t["prob"] is not None and t["prob"] < 0.01 else t["text"] for t in p.tokens)
    lines += ["", body, "", f"the {len(p.worst)} positions it got most wrong (lowest probability of the true token):",
              f"  {'pos':>6}  {'true token':<18} {'p':>9}   {'it expected':<18} {'p':>7}   after"]
    for i in p.worst:
        t, e = p.tokens[i], p.tokens[i]["expected"]
        before = "".join(x["text"] for x in p.tokens[max(0, i - 6):i])
        lines.append(f"  {i:>6}  {token(t['text']):<18} {t['prob']:>9.2e}   {token(e['text']):<18} {e['prob']:>7.4f}"
                     f"   …{before[-40:]!r}")
    return "\n".join(lines)


# --- the picture ----------------------------------------------------------------------------

def passage_layout(p: Passage, width: float = 1040) -> Drawing:
    """Tokens as chips coloured by probability, wrapped like text, then the worst positions."""
    d = Drawing()
    x0, y, right = 30, 34, width - 30
    y = header(d, f"glassgpt · {p.model['name']} · how likely each true next token was",
               [f"{len(p.tokens):,} tokens · loss {p.loss:.3f} nats per token · perplexity {p.perplexity:,.1f}"]
               + [f"note: {n}" for n in p.notes], width, x0, y)
    y += 16
    x = x0
    for k, (_, label, _, fill) in enumerate(BANDS):
        d.add(Rect(x, y, 14, 14, fill, GRAY, width=1))
        d.add(Text(x + 20, y + 12, label, 11, color=MUTED))
        x += 110
    d.add(Text(x, y + 12, "(the first token has no prediction)", 11, color=MUTED))
    y += 30
    y = _chips(d, p, x0, y, right)
    y += 26
    d.add(Text(x0, y, "most wrong: the true token, the probability it got, and what the model expected", 13, True))
    for i in p.worst:
        t, e = p.tokens[i], p.tokens[i]["expected"]
        y += 19
        d.add(Text(x0, y, f"{i:>5}  {token(t['text'], 20):<20} p {t['prob']:.1e}   expected "
                          f"{token(e['text'], 20):<20} p {e['prob']:.3f}", 11, mono=True, color=RED, key="worst"))
    return d.fit_canvas(width, y + 10)


def _chips(d: Drawing, p: Passage, x0: float, y: float, right: float) -> float:
    """The passage as wrapped chips, one per token, filled by its probability band; returns the bottom."""
    x, line_h = x0, 24
    for i, t in enumerate(p.tokens):
        parts = t["text"].split("\n")
        for part_no, part in enumerate(parts):
            if part_no:  # a newline in the token: what follows starts a new line
                x, y = x0, y + line_h
            if not part and (part_no or len(parts) == 1 and t["text"]):
                continue
            # A token of newlines only is drawn as one ↵ where the line ends; an empty token as ∅.
            label = "↵" if not part and len(parts) > 1 else fit(part.replace(" ", "·") or "∅", right - x0 - 6, 12,
                                                                  mono=True)
            w = text_width(label, 12, mono=True) + 6
            if x + w > right:
                x, y = x0, y + line_h
            d.add(Rect(x, y, w, 20, band(t["prob"])[3], ORANGE if i in p.worst else GRAY,
                       width=2 if i in p.worst else 0.5, key=f"chip:{i}"))
            d.add(Text(x + 3, y + 15, label, 12, mono=True, color=INK))
            x += w + 2
    return y + line_h

"""The views of a Why (why.py): the terminal text, the picture, and a notebook's HTML.

Text: the top parts by what they add, the blocks x heads grid with the feed-forward column, the
prompt with each token's two shares (direct and causal), and the patching grids. Picture: the
same grid as a heatmap (blue adds to the logit, red takes away), the prompt as a strip of
coloured tokens, and the patching grid. HTML: the picture and the key lines, for `_repr_html_`.
Any other described model's DescribedWhy (FamilyWhy; query heads reading shared key/value groups, a
mixture's routed experts) has its own text, at the end, and the same picture.
"""

from __future__ import annotations

from html import escape

from ..why import Why
from ..why import FamilyWhy
from .draw import BLUE, GRAY, INK, MUTED, RED, Drawing, Rect, Text, fit, header, text_width, to_svg
from ..notation import token
from .text import BOLD, DIM, painter

CELL = 34  # a heatmap cell, in pixels
WHAT_SUMS = ("final_norm's scale frozen at the last position (as TransformerLens does), so the parts are an exact "
             "sum: each is what that part wrote into the residual stream, read through final_norm and out_head")


def metric_name(w: Why) -> str:
    """logit[' know'], or logit[' know'] - logit[' the']."""
    a = f"logit[{token(w.target['text'], 24)}]"
    return a if w.versus is None else f"{a} - logit[{token(w.versus['text'], 24)}]"


def top_parts(parts: list[dict], n: int) -> list[dict]:
    return sorted(parts, key=lambda p: -abs(p["value"]))[:n]


def headline(w: Why) -> str:
    what = "class" if w.kind == "class" else "next token"
    return f"why {token(w.target['text'], 24)} ({what}) after {w.prompt!r}: {metric_name(w)} = {w.metric:+.4f}"


# --- text ---------------------------------------------------------------------------------------

def why_text(w: Why, color: bool = False, top: int = 12) -> str:
    c = painter(color)
    lines = [c(BOLD, headline(w)), c(DIM, WHAT_SUMS), ""]
    lines += _parts_lines(w.parts, top, f"the {top} parts that move {metric_name(w)} most", w.metric)
    if w.contrast is not None:
        r = w.contrast["versus"]
        diff = w.target["logit"] - r["logit"]
        lines += [""] + _parts_lines(w.contrast["parts"], min(top, 6),
                                     f"why {token(w.target['text'])} and not the runner-up {token(r['text'])} "
                                     f"(logit difference {diff:+.4f}; --versus picks another)", diff)
    lines += ["", *_grid_lines(w), "", *_source_lines(w)]
    if w.patch is not None:
        lines += ["", *patch_lines(w.patch)]
    return "\n".join(lines)


def _parts_lines(parts: list[dict], n: int, title: str, total: float) -> list[str]:
    shown = top_parts(parts, n)
    most = max(abs(p["value"]) for p in shown) or 1.0
    lines = [title + ":"]
    for p in shown:
        bar = "█" * max(1, round(12 * abs(p["value"]) / most))
        lines.append(f"  {p['name']:<28} {p['value']:>+9.4f}  {bar if p['value'] > 0 else '-' + bar}")
    rest = sum(p["value"] for p in parts) - sum(p["value"] for p in shown)
    lines.append(f"  {f'the other {len(parts) - len(shown)} parts':<28} {rest:>+9.4f}   "
                 f"(all {len(parts)} sum to {sum(p['value'] for p in parts):+.4f}; the model's is {total:+.4f})")
    return lines


def _grid_lines(w: Why) -> list[str]:
    n_heads = len(w.heads[0])
    lines = ["each head's term (blocks x heads) and each feed-forward's (ff):",
             "        " + "".join(f"{'h' + str(j):>7}" for j in range(n_heads)) + f"{'ff':>9}"]
    for i, row in enumerate(w.heads):
        lines.append(f"  {'b' + str(i):<6}" + "".join(f"{v:>+7.2f}" for v in row) + f"{w.ff[i]:>+9.2f}")
    return lines


def _source_lines(w: Why) -> list[str]:
    lines = ["which prompt tokens: direct (each head's term split over the tokens it attends to, summed over heads) "
             "and causal (the prompt run again without the token)",
             f"  {'pos':>4}  {'token':<18} {'direct':>9}   {'causal: p change':>17} {'logit change':>13}"]
    for s in w.sources:
        cause = s["causal"]
        if cause["prob_change"] is None:
            tail = f"   {cause['how']}"
        else:
            tail = f"   {cause['prob_change']:>+17.4f} {cause['logit_change']:>+13.4f}"
        lines.append(f"  {s['position']:>4}  {token(s['text']):<18} {s['direct']:>+9.4f}{tail}")
    lines.append(f"  note: {w.notes[-1]}")
    return lines


def expert_lines(w: Why) -> list[str]:
    """A mixture of experts' routes: per block, the last token's chosen experts with their renormalised weights
    and their parts of the logit, then every token's experts (the JSON's `experts` holds the same)."""
    routes = getattr(w, "experts", None)
    if not routes:
        return []
    lines = ["", "experts (per block: the last token's routed experts, their weights and their parts; then each "
             "token's)"]
    parts = {p["name"]: p["value"] for p in w.parts}
    for i, block in enumerate(routes):
        if block is None:
            continue
        names = [f"trf_blocks.{i}.ff.expert.{r['expert']}" for r in block[-1]]
        last = ", ".join(f"e{r['expert']} w {r['weight']:.3f} ({parts.get(name, 0.0):+.4f})"
                         for r, name in zip(block[-1], names))
        lines.append(f"  block {i}: {last}  = ff {w.ff[i]:+.4f}")
        lines.append("    " + " | ".join(f"{token(tok['text'])} " + " ".join(f"e{r['expert']} {r['weight']:.2f}"
                                                                              for r in row)
                                         for tok, row in zip(w.tokens, block)))
    return lines


def patch_lines(patch: dict) -> list[str]:
    a, b = token(patch["clean_top"]["text"]), token(patch["versus"]["text"])
    cols = [token(t, 9) for t in patch["positions"]]
    lines = [f"activation patching from {patch['corrupted']!r}: the fraction of logit[{a}] - logit[{b}] restored "
             f"(clean {patch['m_clean']:+.3f}, corrupted {patch['m_corrupted']:+.3f}) by the clean input of each "
             "block at each position",
             "  " + " " * 16 + "".join(f"{c:>10}" for c in cols)]
    for name, row in zip(patch["blocks"], patch["grid"]):
        lines.append(f"  {name:<16}" + "".join(f"{round(v, 2) + 0.0:>10.2f}" for v in row))
    lines.append("each head's output (all positions) patched: blocks x heads")
    for name, row in zip(patch["heads"]["blocks"], patch["heads"]["grid"]):
        lines.append(f"  {name:<16}" + "".join(f"{round(v, 2) + 0.0:>7.2f}" for v in row))
    return lines


# --- the picture --------------------------------------------------------------------------------

def shade(value: float, most: float) -> str:
    """White at 0, blue for what adds, red for what takes away, in proportion to |value| / most."""
    t = min(1.0, abs(value) / most) if most > 0 else 0.0
    end = (31, 111, 209) if value >= 0 else (185, 28, 28)
    r, g, b = (round(255 + (e - 255) * t) for e in end)
    return f"#{r:02x}{g:02x}{b:02x}"


def why_layout(w: Why, width: float = 1040) -> Drawing:
    d = Drawing()
    x0 = 30
    y = header(d, f"glassgpt · why {token(w.target['text'], 24)}", [headline(w), WHAT_SUMS], width)
    y = _heatmap(d, w, x0, y + 30)
    y = _strip(d, w, x0, y + 26, width - x0)
    if w.patch is not None:
        y = _patch_map(d, w.patch, x0, y + 26)
    return d.fit_canvas(width, y)


def _heatmap(d: Drawing, w: Why, x0: float, y: float) -> float:
    d.add(Text(x0, y, f"each head's term in {metric_name(w)} (blocks x heads), and each feed-forward's", 13, True))
    most = max([abs(v) for row in w.heads for v in row] + [abs(v) for v in w.ff]) or 1.0
    top = y + 24
    for j in range(len(w.heads[0])):
        d.add(Text(x0 + 70 + j * CELL + CELL / 2, top - 6, f"h{j}", 10, color=MUTED, anchor="middle"))
    ff_x = x0 + 70 + len(w.heads[0]) * CELL + 10
    d.add(Text(ff_x + CELL / 2, top - 6, "ff", 10, color=MUTED, anchor="middle"))
    for i, row in enumerate(w.heads):
        cy = top + i * CELL
        d.add(Text(x0, cy + CELL / 2 + 4, f"block {i}", 11, color=MUTED))
        for j, v in enumerate(row):
            d.add(Rect(x0 + 70 + j * CELL, cy, CELL - 2, CELL - 2, shade(v, most), GRAY, width=0.3, key=f"head:{i}.{j}"))
        d.add(Rect(ff_x, cy, CELL - 2, CELL - 2, shade(w.ff[i], most), GRAY, width=0.3, key=f"ff:{i}"))
    return top + len(w.heads) * CELL


def _strip(d: Drawing, w: Why, x0: float, y: float, right: float) -> float:
    d.add(Text(x0, y, "the prompt, each token coloured by its direct share (through attention); "
                      "under it, the logit change when it is removed", 13, True))
    most = max(abs(s["direct"]) for s in w.sources) or 1.0
    x, y = x0, y + 12
    for s in w.sources:
        label = fit(s["text"].replace(" ", "·") or "∅", 160, 12, mono=True)
        cause = s["causal"]["logit_change"]
        below = "" if cause is None else f"{cause:+.2f}"
        cw = max(text_width(label, 12, mono=True), text_width(below, 10)) + 8
        if x + cw > right:
            x, y = x0, y + 44
        d.add(Rect(x, y, cw, 22, shade(s["direct"], most), GRAY, width=0.5, key=f"source:{s['position']}"))
        d.add(Text(x + 4, y + 16, label, 12, mono=True, color=INK))
        d.add(Text(x + 4, y + 36, below, 10, color=RED if (cause or 0) < 0 else BLUE))
        x += cw + 4
    return y + 44


def _patch_map(d: Drawing, patch: dict, x0: float, y: float) -> float:
    d.add(Text(x0, y, f"patching from {patch['corrupted']!r}: the fraction restored by the clean input of each "
                      "block at each position", 13, True))
    top, col = y + 24, 70
    for j, t in enumerate(patch["positions"]):
        d.add(Text(x0 + 110 + j * col + col / 2, top - 6, fit(repr(t), col - 4, 10, mono=True), 10, color=MUTED,
                   anchor="middle", mono=True))
    for i, (name, row) in enumerate(zip(patch["blocks"], patch["grid"])):
        cy = top + i * 22
        d.add(Text(x0, cy + 15, name, 11, color=MUTED))
        for j, v in enumerate(row):
            d.add(Rect(x0 + 110 + j * col, cy, col - 2, 20, shade(v, 1.0), GRAY, width=0.3, key=f"patch:{i}.{j}"))
            d.add(Text(x0 + 110 + j * col + col / 2, cy + 14, f"{round(v, 2) + 0.0:.2f}", 10, anchor="middle",
                       color="white" if abs(v) > 0.6 else INK))
    return top + len(patch["grid"]) * 22


def why_svg(w: Why) -> str:
    return to_svg(why_layout(w))


def why_html(w: Why) -> str:
    """A notebook's view: the picture, then the top parts and the prompt's shares as text."""
    return f"<div>{why_svg(w)}<pre>{escape(why_text(w, top=8))}</pre></div>"


# --- a model whose query heads read shared key/value groups (Qwen3, Llama 3.2) ----------------------

def render_family_why_text(w: FamilyWhy, top: int = 12, **_options) -> str:
    """The attribution in the terminal: the exact sum, the top parts, the heads grid with the key/value groups,
    the prompt tokens' shares (each with the query head it went through most) and the patching grids."""
    t = w.target
    lines = [f"{w.architecture or w.family}: why {t['text']!r} (id {t['id']}) after "
             + " ".join(repr(s["text"]) for s in w.tokens[-8:]),
             f"{metric_name(w)} {w.metric:+.4f} = sum of {len(w.parts)} parts {w.total:+.4f} "
             f"(final_norm's 1/rms frozen at the last position: rms {w.rms:.4g}; its weight folded into out_head)",
             "", *_family_parts(w.parts, top, f"top parts (of {len(w.parts)})")]
    if w.contrast is not None:
        r = w.contrast["versus"]
        lines += ["", *_family_parts(w.contrast["parts"], min(top, 6),
                                     f"why {token(t['text'])} and not the runner-up {token(r['text'])} (logit "
                                     f"difference {t['logit'] - r['logit']:+.4f}; --versus picks another)")]
    n_heads = len(w.groups)
    lines += ["", "heads (blocks x query heads; g = the key/value group each head read)",
              "  block " + "".join(f"{f'h{j} g{w.groups[j]}':>10}" for j in range(n_heads)) + f"{'ff':>10}"]
    for i, row in enumerate(w.heads):
        lines.append(f"  {i:>5} " + "".join(f"{v:>+10.3f}" for v in row) + f"{w.ff[i]:>+10.3f}")
    pos = next((p for p in w.parts if p["name"] == "pos_emb"), None)
    lines.append(f"  tok_emb {w.parts[0]['value']:+.3f}; " + (f"pos_emb {pos['value']:+.3f}" if pos else
                                                               "no pos_emb: positions entered as RoPE inside each attention"))
    lines += [*expert_lines(w), "", *_family_sources(w)]
    if w.patch is not None:
        lines += ["", *patch_lines(w.patch)]
    return "\n".join(lines)


def _family_parts(parts: list[dict], n: int, title: str) -> list[str]:
    lines = [title]
    for p in top_parts(parts, n):
        group = f"  (read key/value group {p['group']})" if "group" in p else ""
        lines.append(f"  {p['name']:<28} {p['value']:+9.4f}{group}")
    return lines


def _family_sources(w: FamilyWhy) -> list[str]:
    """Each prompt token's direct share, the query head it went through most, and its causal share."""
    lines = ["which prompt tokens: direct (each query head's term split over the tokens it attends to, summed "
             "over heads) and causal (the prompt run again without the token)",
             f"  {'pos':>4}  {'token':<18} {'direct':>9}   {'most through (its share)':<30}"
             f"{'causal: p change':>17} {'logit change':>13}"]
    for s in w.sources:
        j = s["position"]
        i, h = max(((i, h) for i in range(len(w.heads)) for h in range(len(w.by_source[i]))),
                   key=lambda ih: abs(w.by_source[ih[0]][ih[1]][j]))
        group = f" (kv group {w.groups[h]})" if h < len(w.groups) else ""
        through = f"b{i} h{h}{group} {w.by_source[i][h][j]:+.4f}"
        cause = s["causal"]
        tail = (f"   {cause['how']}" if cause["prob_change"] is None
                else f"{cause['prob_change']:>+17.4f} {cause['logit_change']:>+13.4f}")
        lines.append(f"  {j:>4}  {token(s['text']):<18} {s['direct']:>+9.4f}   {through:<30}{tail}")
    lines.append(f"  note: {w.notes[-1]}")
    return lines


def family_why_html(w: FamilyWhy) -> str:
    """A notebook cell: the picture (the heads grid, the prompt strip, the patching grid), then the text."""
    return f"<div>{why_svg(w)}<pre>{escape(render_family_why_text(w, top=8))}</pre></div>"

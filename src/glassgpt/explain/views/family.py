"""The views of explain's Qwen3/Llama results: a FamilyTrace and what changed from GPT-2 (explain/family.py), and
a FamilyWhy (explain/why.py), whose picture is GPT-2's Why picture (views/why.py)."""

from __future__ import annotations

import html

from ..family import FAMILY_NAMES, FamilyTrace, GPT2Changes
from ..notation import clip, token
from ..why import FamilyWhy
from . import draw
from .draw import GRAY, GREEN, INK, MUTED, Drawing, Line, Rect, Text
from .text import attention_lines, head_lines, lens_lines, painter
from .why import expert_lines, metric_name, patch_lines, top_parts, why_svg

TRANSITION = "#b45309"  # the two stages where the width changes (V -> d, d -> V), as the GPT-2 picture marks them


def _shape(shape) -> str:
    return "[" + ", ".join(f"{s:,}" for s in shape) + "]"


def render_family_text(tr: FamilyTrace, attention_layer: int | None = None, heatmap: str | None = None,
                       **_options) -> str:
    """The flow, the four answers, RoPE and the groups, the next tokens; then, as GPT-2's text view has them,
    the head's dot products, `attention_layer`'s heads (if the trace has the weights) and the logit lens."""
    cfg, a, att = tr.config, tr.answers, tr.attention
    V, d, h, g = cfg["vocab_size"], cfg["emb_dim"], cfg["n_heads"], len(tr.attention["groups"])
    name = FAMILY_NAMES[tr.family]
    lines = [f"{name}: {cfg['n_layers']} blocks, d {d:,}, V {V:,}, {h} query heads, {g} key/value groups",
             "tokens: " + " ".join(repr(t) for t in tr.tokens), ""]
    for s in tr.stages:
        lines.append(f"  {s['name']:<18} {_shape(s['shape']):<24} {s['module']:<34} {s['note']}")
    lines += ["", "the four questions"]
    lines.append(f"  1. Where does {V:,} become {d:,}?  At tok_emb: ids -> {_shape(tr.stages[1]['shape'])}, a lookup "
                 f"in the {_shape(a['vocab_to_hidden']['weight_shape'])} weight. Every block then stays {d:,} wide.")
    lines.append(f"  2. Where does {d:,} become {V:,}?  At out_head: -> logits {_shape(tr.stages[-1]['shape'])}, "
                 f"x @ W.T with W {_shape(a['hidden_to_vocab']['weight_shape'])}.")
    e = a["one_hot"]
    proof = "yes: the lookup and one_hot(ids) @ W are identical here" if e["equal_one_hot_matmul"] and \
        e["equal_linear"] else f"not bit for bit here (max difference {e['max_abs_diff']:.3g})"
    lines.append(f"  3. Is nn.Embedding an nn.Linear on one-hot vectors?  {proof}; the lookup skips the zeros.")
    if a["tied"]:
        tie = (f"one tensor: out_head.weight and tok_emb.weight share their storage (the same data_ptr), "
               f"{tr.params['total']:,} parameters, {tr.params['total_untied']:,} if untied")
    elif a["equal_values"]:
        tie = ("two tensors with equal values: a copy, not a tie (different data_ptr; the book's loader copies "
               "the embedding), so training would move them apart")
    else:
        tie = f"two separate tensors (untied): {tr.params['total']:,} parameters"
    lines.append(f"  4. Are there weight matrices for both, and are they shared?  {tie}.")
    lines += ["", "where positions enter"]
    scaled = ", with Llama 3's frequency scaling" if att["rope_scaled"] else ""
    layers, dims, hd = att.get("rope_layers"), att.get("rope_dims"), att["q_shape"][-1]
    inside = "every attention" if layers is None or len(layers) == tr.config["n_layers"] else (
        f"the full attentions (layers {', '.join(map(str, layers))}; the linear ones have no position signal: their "
        "convolution and state see the order itself)")
    pairs = "each pair of dimensions (i, i + hd/2)" if not dims or dims == hd else (
        f"each pair (i, i + {dims // 2}) of the first {dims} of {hd} dimensions (the other {hd - dims} unturned)")
    lines.append(f"  No pos_emb: tok_emb's output is the same for a token wherever it stands. Inside {inside} "
                 f"the queries and keys (not the values) are rotated by RoPE, base {att['rope_base']:,.0f}{scaled}, "
                 f"{pairs} turning by an angle that grows with the position.")
    if att.get("sliding_layers"):  # Gemma 3: the base above is the full layers'
        lines.append(f"  Sliding layers {att['sliding_layers']}: each query sees only the last {att['window']:,} "
                     f"positions, and RoPE turns them with base {att['rope_local_base']:,.0f}; the other layers see "
                     "every earlier position.")
    if att["qk_norm"]:
        lines.append("  QK-norm: each query and key head is RMS-normed before the rotation.")
    lines += ["", "the heads"]
    lines.append(f"  queries {_shape(att['q_shape'])}, keys and values {_shape(att['kv_shape'])}: {h} query heads "
                 f"share {g} key/value heads, {att['group_size']} each (repeat_interleave):")
    lines.append("  " + "  ".join(f"kv{j}: q{grp[0]}..q{grp[-1]}" for j, grp in enumerate(att["groups"])))
    if tr.next_tokens:
        lines += ["", "next token"]
        lines += [f"  {t['text']!r:<16} {t['prob']:.4f}" for t in tr.next_tokens]
    c = painter(False)
    if tr.head:
        head_lines(tr.head, a["hidden_to_vocab"]["weight_shape"], V, lines, c)
    if attention_layer is not None and tr.attention_weights:
        attention_lines(tr.attention_weights, attention_layer, heatmap, lines, c,
                        "kvN: the key/value group the query head reads (repeat_interleave); its queries and keys "
                        "were RoPE-rotated (and QK-normed in Qwen3) before the softmax")
    if tr.logit_lens:
        lens_lines(tr.logit_lens, tr.tokens, lines, c)
    return "\n".join(lines)


def render_changes_text(changes: GPT2Changes, **_options) -> str:
    rows, family = changes.rows, changes.family
    lines = [f"what changed from GPT-2 to {FAMILY_NAMES[family]} (the book's ch05/07_gpt_to_llama order)", ""]
    for r in rows:
        lines.append(f"{r['change']}")
        lines.append(f"  GPT-2   {r['gpt2_params']:>13,}  {r['gpt2']}")
        lines.append(f"  {FAMILY_NAMES[family]:<7} {r['family_params']:>13,}  {r['family']}")
    return "\n".join(lines)


def family_layout(tr: FamilyTrace, width: float = 980, **_options) -> Drawing:
    """The flow top to bottom, one box per stage with its shape, and the key/value groups beside the attention."""
    cfg, att = tr.config, tr.attention
    d = Drawing()
    d.add(Text(20, 30, f"{FAMILY_NAMES[tr.family]}: {cfg['n_layers']} blocks, d {cfg['emb_dim']:,}, "
                       f"V {cfg['vocab_size']:,}", size=16, bold=True, color=INK))
    x, y, w, h = 20.0, 50.0, 560.0, 40.0
    for i, s in enumerate(tr.stages):
        changes_width = s["name"] in ("tok_emb", "out_head")
        d.add(Rect(x, y, w, h, fill="white", stroke=TRANSITION if changes_width else GRAY, key=f"stage:{s['name']}"))
        d.add(Text(x + 10, y + 17, f"{s['name']}  {_shape(s['shape'])}", size=13, bold=True, mono=True))
        d.add(Text(x + 10, y + 33, draw.fit(s["note"], w - 20, 11), size=11, color=MUTED))
        if i:
            d.add(Line([(x + w / 2, y - 14), (x + w / 2, y)]))
        y += h + 14
    # the groups: each key/value head and the query heads that read it (repeat_interleave)
    gx, gy = x + w + 40, 50.0
    d.add(Text(gx, gy + 12, f"{cfg['n_heads']} query heads, {len(tr.attention['groups'])} key/value heads", size=13, bold=True))
    for j, group in enumerate(att["groups"]):
        row = gy + 28 + j * 26
        d.add(Rect(gx, row, 52, 20, fill="#eef2ff", key=f"kv:{j}"))
        d.add(Text(gx + 26, row + 14, f"kv{j}", size=11, anchor="middle", mono=True))
        d.add(Text(gx + 62, row + 14, "  ".join(f"q{q}" for q in group), size=11, mono=True, color=MUTED))
    d.add(Text(gx, gy + 48 + len(att["groups"]) * 26, "RoPE turns q and k in every block; no pos_emb", size=11,
               color=MUTED))
    if tr.head:
        y = _dot_products(d, tr.head, x, y, w)
    return d.fit_canvas(width, y)


def _dot_products(d: Drawing, hd: dict, x: float, y: float, w: float) -> float:
    """The top logits as the dot products they are, h · W[id] with h final_norm's (RMSNorm) output, under the flow."""
    rows = hd["rows"][:3]
    height = 74 + 16 * len(rows)
    d.add(Rect(x, y, w, height, fill="white", stroke=TRANSITION, dash=True, key="dot_products"))
    d.add(Text(x + 10, y + 17, f"each logit is a dot product: logit[id] = h · W[id], |h| = {hd['h_norm']:.2f}", size=12,
               bold=True, mono=True))
    d.add(Text(x + 10, y + 33, f"{'':<16}{'logit':>9}{'|W[id]|':>10}{'cos(h, W[id])':>15}", size=11, color=MUTED,
               mono=True))
    row_y = y + 33
    for row in rows:
        row_y += 16
        d.add(Text(x + 10, row_y, f"{clip(repr(row['text']), 15):<16}{row['logit']:>9.3f}{row['w_norm']:>10.3f}"
                                  f"{row['cos']:>15.4f}", size=11, mono=True, key="dot_row"))
    d.add(Text(x + 10, row_y + 18, draw.fit(hd["tying_note"], w - 20, 11), size=11, color=MUTED))
    d.add(Text(x + 10, row_y + 34, f"checked: every logit equals out_head's (max |diff| {hd['max_abs_diff']:.0e})",
               size=11, color=GREEN))
    return y + height + 14


def family_html(result: FamilyTrace | GPT2Changes) -> str:
    """A notebook cell: the picture (a FamilyTrace's), then the text view as it reads in the terminal."""
    svg = draw.to_svg(result.picture()) if isinstance(result, FamilyTrace) else ""
    return f"{svg}<pre>{html.escape(result.to_text())}</pre>"


def render_family_why_text(w: FamilyWhy, top: int = 12, **_options) -> str:
    """The attribution in the terminal: the exact sum, the top parts, the heads grid with the key/value groups,
    the prompt tokens' shares (each with the query head it went through most) and the patching grids."""
    t = w.target
    lines = [f"{FAMILY_NAMES.get(w.family, w.family)}: why {t['text']!r} (id {t['id']}) after "
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
    return f"<div>{why_svg(w)}<pre>{html.escape(render_family_why_text(w, top=8))}</pre></div>"

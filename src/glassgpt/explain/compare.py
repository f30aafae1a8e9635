"""Two models on one prompt: their next-token distributions side by side, and how far apart they are.

    compare(model_a, model_b, tokenizer, "Every effort moves you") -> Comparison

For each model: its top-k next tokens with their probability under both models, the logit
lens's top token at the last position after every block, and the head's dot product for its
top token (trace.py, head.py). Between them: the KL divergences KL(A || B) = sum p_A log(p_A /
p_B) and KL(B || A), in nats; 0 when the distributions are the same, and large where one model
is sure of a token the other thinks unlikely. Models whose heads differ (a language model
and a classifier) have no KL: their outputs are not over the same ids.

Views: `comparison_text` and `comparison_layout` (the picture: both models' bars, each with
the other model's probability marked).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from itertools import zip_longest
from typing import Any

import torch

from ..adopt import adopt
from ..model import GPTModel
from ..prompt import encode, fit_prompt, keep_for
from ..tokenizer import Tokenizer
from .views.draw import GRAY, MUTED, ORANGE, PURPLE, Drawing, Line, Rect, Text, header
from .views.notation import token
from .trace import About, TraceOptions, trace_with_logits

BAR_W = 300


@dataclass
class Comparison:
    prompt: str
    tokens: list[dict[str, Any]]
    a: dict[str, Any]                 # name, next_token, top (with other_prob), lens_last, head_top
    b: dict[str, Any]
    kl_ab: float | None               # KL(A || B) in nats
    kl_ba: float | None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def kl_divergence(log_p: torch.Tensor, log_q: torch.Tensor) -> float:
    """KL(P || Q) = sum p (log p - log q), in nats, from log probabilities over the same ids."""
    return float((log_p.exp() * (log_p - log_q)).sum().clamp_min(0.0))


def compare(model_a: GPTModel, model_b: GPTModel, tokenizer: Tokenizer, text: str, about_a: About | None = None,
            about_b: About | None = None, top_k: int = 10) -> Comparison:
    """Trace `text` through both models and set their next-token distributions side by side."""
    about_a, about_b = about_a or About("A"), about_b or About("B")
    limit = min(adopt(model_a).cfg.context_length, adopt(model_b).cfg.context_length)
    prompt = fit_prompt(encode(tokenizer, text), limit, keep_for(adopt(model_a).cfg.num_classes))
    model_a, model_b = adopt(model_a, prompt.ids), adopt(model_b, prompt.ids)  # a reader's modules, read in place
    options = TraceOptions(top_k=top_k, logit_lens=True, embedding_check=False)
    runs = [trace_with_logits(m, tokenizer, ids=prompt.ids, options=options, about=ab)  # one forward pass each
            for m, ab in ((model_a, about_a), (model_b, about_b))]
    traces = [tr for tr, _ in runs]
    logps = [last.double().log_softmax(-1).cpu() for _, last in runs]
    same_ids = logps[0].shape == logps[1].shape
    notes = [prompt.note] if prompt.note else []
    if not same_ids:
        notes.append(f"the two heads score different things ({logps[0].numel():,} and {logps[1].numel():,} outputs): "
                     "no KL divergence between them")
    sides = [_side(tr, ab, logps[1 - k] if same_ids else None)
             for k, (tr, ab) in enumerate(zip(traces, (about_a, about_b)))]
    kl = (kl_divergence(logps[0], logps[1]), kl_divergence(logps[1], logps[0])) if same_ids else (None, None)
    return Comparison(traces[0].prompt, traces[0].tokens, sides[0], sides[1], kl[0], kl[1], notes)


def _side(tr, about: About, other: torch.Tensor | None) -> dict[str, Any]:
    top = [dict(t, other_prob=float(other[t["id"]].exp()) if other is not None else None)
           for t in tr.next_token["top"]]
    lens = [dict(layer["top"][-1], layer=layer["layer"]) for layer in tr.logit_lens["layers"]]
    return {"name": about.name, "next_token": {k: tr.next_token[k] for k in ("id", "text", "prob")}, "top": top,
            "lens_last": lens, "head_top": tr.head["rows"][0] if tr.head else None, "layout": tr.model["layout"]}


# --- the text view --------------------------------------------------------------------------

def comparison_text(c: Comparison) -> str:
    a, b = c.a, c.b
    lines = [f"the next token of A = {a['name']} and B = {b['name']} after {c.prompt!r}"]
    lines += [f"note: {n}" for n in c.notes]
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
    for x, y in zip(a["lens_last"], b["lens_last"]):
        lines.append(f"  trf_blocks.{x['layer']:<3} A {token(x['text']):<18} {x['prob']:.4f}   "
                     f"B {token(y['text']):<18} {y['prob']:.4f}")
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

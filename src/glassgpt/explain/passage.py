"""Where the model is surprised: the probability it gave each true next token of a text.

    passage(model, tokenizer, text) -> Passage

Position i's probability is softmax(logits[i - 1])[ids[i]]: what the model, having read
tokens 0..i-1, gave the token that really came next (the first token has none). The mean
of -log p is the text's cross-entropy, the loss training lowers; exp of it the perplexity.
A text longer than context_length is read in windows that overlap by half, and each token
is scored in the window where it has at least half a context before it, as strided
perplexity is computed (so no token is scored with only a few tokens of context). Each window is
one recording (record.py) that keeps nothing but the logits, so a long passage reports its progress
block by block and can be cancelled, as a trace can.

Views: `passage_text` (the text with each token marked by its probability, then the
positions the model got most wrong) and `passage_layout` (the same as a picture).
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..adopt import adopt
from ..device import evaluating
from ..errors import PromptError
from ..model import GPTModel
from ..prompt import encode
from ..tokenizer import Tokenizer
from .views.draw import GRAY, INK, MUTED, ORANGE, RED, Drawing, Rect, Text, fit, header, text_width
from .views.notation import token
from .record import Progress, Recorder, record
from .trace import About

# Probability bands, shared by the text and the picture: (lower bound, name, ANSI colour, fill colour).
BANDS = [(0.5, "p >= 0.5", "\033[38;5;35m", "#bbf7d0"), (0.1, "p >= 0.1", "", "#fef9c3"),
         (0.01, "p >= 0.01", "\033[38;5;208m", "#fed7aa"), (0.0, "p < 0.01", "\033[38;5;160m", "#fecaca")]
WORST = 10


@dataclass
class Passage:
    model: dict[str, Any]
    tokens: list[dict[str, Any]]       # id, text, prob (None for the first), expected (the model's top token)
    loss: float                        # mean -log p over the scored tokens (nats)
    perplexity: float
    worst: list[int]                   # positions of the lowest probabilities, lowest first
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.inference_mode()
def passage(model: GPTModel, tokenizer: Tokenizer, text: str, about: About | None = None, worst: int = WORST,
            progress: Progress | None = None, cancel: threading.Event | None = None) -> Passage:
    """Score every token of `text` (at least two tokens) under `model`; see the module's docstring.

    progress(step, done, total) is called after each block of each window; `cancel`, once set, stops it."""
    model = adopt(model, encode(tokenizer, text)[:adopt(model).cfg.context_length])
    if model.cfg.num_classes is not None:
        raise PromptError("a classifier predicts no next tokens: give --passage a language model")
    ids = encode(tokenizer, text)
    if len(ids) < 2:
        raise PromptError("the passage is one token: give a text of two tokens or more (each is scored on those before)")
    about = about or About()
    scored, notes = _score(model, ids, progress, cancel)
    tokens = [{"id": ids[0], "text": tokenizer.decode([ids[0]]), "prob": None, "expected": None}]
    for i in range(1, len(ids)):
        prob, top_id, top_prob = scored[i]
        tokens.append({"id": ids[i], "text": tokenizer.decode([ids[i]]), "prob": prob,
                       "expected": {"id": top_id, "text": tokenizer.decode([top_id]), "prob": top_prob}})
    nll = [-math.log(max(t["prob"], 1e-45)) for t in tokens[1:]]
    loss = sum(nll) / len(nll)
    order = sorted(range(1, len(ids)), key=lambda i: tokens[i]["prob"])[:worst]
    return Passage({"name": about.name, "random_weights": about.random_weights, "config": model.cfg.to_dict()},
                   tokens, loss, math.exp(loss), order, notes)


def _score(model: GPTModel, ids: list[int], progress: Progress | None,
           cancel: threading.Event | None) -> tuple[dict[int, tuple[float, int, float]], list[str]]:
    """{position: (p of the true token, the top id, its p)} for positions 1.., window by window."""
    ctx, n = model.cfg.context_length, len(ids)
    device = model.tok_emb.weight.device
    windows = [(0, min(n, ctx), 1)]  # (start, end, first position scored)
    stride = max(1, ctx // 2)
    while windows[-1][1] < n:
        end = min(n, windows[-1][1] + stride)
        windows.append((end - ctx, end, windows[-1][1]))
    scored: dict[int, tuple[float, int, float]] = {}
    rec = Recorder(frozenset(), len(windows) * model.cfg.n_layers, cancel, progress)  # keeps only the logits
    with evaluating(model):
        for start, end, first in windows:
            x = torch.tensor([ids[start:end]], device=device)
            # The logits at the positions just before each scored one: [t, V] -> [scored, V].
            logits = record(model, x, rec)[0, first - start - 1:end - start - 1].float()
            target = x[0, first - start:end - start]
            lse = logits.logsumexp(dim=-1)
            prob = (logits.gather(1, target[:, None])[:, 0] - lse).exp()
            top, top_id = logits.max(dim=-1)
            top_prob = (top - lse).exp()
            for k, pos in enumerate(range(first, end)):
                scored[pos] = (float(prob[k]), int(top_id[k]), float(top_prob[k]))
    notes = []
    if len(windows) > 1:
        notes.append(f"the passage is {n:,} tokens, more than context_length {ctx:,}: it was read in {len(windows)} "
                     f"windows of {ctx:,} overlapping by {ctx - stride:,}, each token scored with at least "
                     f"{ctx - stride:,} tokens before it")
    return scored, notes


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

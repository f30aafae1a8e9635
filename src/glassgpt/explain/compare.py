"""Two models on one prompt: their next-token distributions side by side, and how far apart they are.

    compare(model_a, model_b, tokenizer, "Every effort moves you") -> Comparison

For each model: its top-k next tokens with their probability under both models, the logit
lens's top token at the last position after every block, and the head's dot product for its
top token (trace.py, head.py). Between them: the KL divergences KL(A || B) = sum p_A log(p_A /
p_B) and KL(B || A), in nats; 0 when the distributions are the same, and large where one model
is sure of a token the other thinks unlikely. Models whose heads differ (a language model
and a classifier) have no KL: their outputs are not over the same ids.

Its views (views/compare.py): the text, and the picture of both models' bars, each with the other
model's probability marked.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..adopt import adopt, check_computable
from ..model import GPTModel
from ..prompt import encode, fit_prompt, keep_for
from ..tokenizer import Tokenizer
from .trace import About, TraceOptions, trace_with_logits
from .result import Result



@dataclass
class Comparison(Result):
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
    check_computable(model_a, tokenizer)
    check_computable(model_b, tokenizer)
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

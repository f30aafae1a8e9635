"""Two models on one prompt: their next-token distributions side by side, and how far apart they are.

    compare(model_a, model_b, tokenizer, "Every effort moves you") -> Comparison

For each model: its top-k next tokens with their probability under both models, the logit
lens's top token at the last position after every block, and the head's dot product for its
top token (trace.py, head.py). Between them: the KL divergences KL(A || B) = sum p_A log(p_A /
p_B) and KL(B || A), in nats; 0 when the distributions are the same, and large where one model
is sure of a token the other thinks unlikely. Models whose heads differ (a language model
and a classifier) have no KL: their outputs are not over the same ids.

Qwen3 and Llama 3.2 models (families/) are compared the same way, their logit lens read
through their own final_norm (RMSNorm) and out_head, and beside a GPT-2 too. Two models whose
tokenizers differ each read the text with their own (`tokenizer_b`): the tokens and the ids
differ, so there is no KL divergence, and a note says so.

Its views (views/compare.py): the text, and the picture of both models' bars, each with the other
model's probability marked.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..adopt import adopt, check_computable
from ..families import is_family_model
from ..model import GPTModel
from ..prompt import encode, fit_prompt, keep_for
from ..tokenizer import Tokenizer
from .head import head_products
from .trace import About, TraceOptions, layout_line, trace_with_logits
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
    tokens_b: list[dict[str, Any]] | None = None  # B's own tokens, when its tokenizer reads the text otherwise

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def kl_divergence(log_p: torch.Tensor, log_q: torch.Tensor) -> float:
    """KL(P || Q) = sum p (log p - log q), in nats, from log probabilities over the same ids."""
    return float((log_p.exp() * (log_p - log_q)).sum().clamp_min(0.0))


def compare(model_a: GPTModel, model_b: GPTModel, tokenizer: Tokenizer, text: str, about_a: About | None = None,
            about_b: About | None = None, top_k: int = 10, tokenizer_b: Tokenizer | None = None) -> Comparison:
    """Trace `text` through both models and set their next-token distributions side by side. `tokenizer_b`:
    B's own tokenizer, where it is not A's (each model then reads the text its own way)."""
    about_a, about_b = about_a or About("A"), about_b or About("B")
    own = tokenizer_b is not None and not same_tokenizer(tokenizer, tokenizer_b)
    tokenizers = (tokenizer, tokenizer_b if own else tokenizer)
    check_computable(model_a, tokenizers[0])
    check_computable(model_b, tokenizers[1])
    cfgs = adopt(model_a).cfg, adopt(model_b).cfg
    limits = [c.context_length for c in cfgs] if own else [min(c.context_length for c in cfgs)] * 2
    keeps = [keep_for(c.num_classes) for c in cfgs] if own else [keep_for(cfgs[0].num_classes)] * 2  # one prompt
    prompts = [fit_prompt(encode(tok, text), limit, keep) for tok, limit, keep in zip(tokenizers, limits, keeps)]
    models = [adopt(m, p.ids) for m, p in zip((model_a, model_b), prompts)]  # a reader's modules, read in place
    runs = [_run(m, tok, p.ids, top_k, ab)  # one forward pass each
            for m, tok, p, ab in zip(models, tokenizers, prompts, (about_a, about_b))]
    logps = [last.double().log_softmax(-1).cpu() for _, last in runs]
    same_ids = not own and logps[0].shape == logps[1].shape
    notes = list(dict.fromkeys(p.note for p in prompts if p.note))
    if own:
        notes.append(f"each model reads the text with its own tokenizer (A: {tokenizers[0].name}, "
                     f"{len(prompts[0].ids)} tokens; B: {tokenizers[1].name}, {len(prompts[1].ids)} tokens): their "
                     "outputs are not over the same ids, so no KL divergence between them")
    elif not same_ids:
        notes.append(f"the two heads score different things ({logps[0].numel():,} and {logps[1].numel():,} outputs): "
                     "no KL divergence between them")
    sides = [dict(run, name=ab.name, top=[dict(t, other_prob=float(logps[1 - k][t["id"]].exp()) if same_ids else None)
                                          for t in run["top"]])
             for k, ((run, _), ab) in enumerate(zip(runs, (about_a, about_b)))]
    kl = (kl_divergence(logps[0], logps[1]), kl_divergence(logps[1], logps[0])) if same_ids else (None, None)
    token_lists = [[{"id": i, "text": tok.decode([i])} for i in p.ids] for tok, p in zip(tokenizers, prompts)]
    return Comparison(tokenizers[0].decode(prompts[0].ids), token_lists[0], sides[0], sides[1], kl[0], kl[1], notes,
                      token_lists[1] if own else None)


def same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether two tokenizers read text alike: the same name and size, and the same bytes for ids spread over
    the vocabulary (no text is needed, which a character tokenizer might not cover)."""
    if (a.name, a.n_vocab) != (b.name, b.n_vocab):
        return False
    ids = sorted({*range(0, a.n_vocab, max(1, a.n_vocab // 256)), a.n_vocab - 1})
    return all(a.token_bytes(i) == b.token_bytes(i) for i in ids)


def _run(model, tokenizer: Tokenizer, ids: list[int], top_k: int, about: About) -> tuple[dict[str, Any], torch.Tensor]:
    """One model's side of the comparison (its top tokens, the logit lens's top token at the last position after
    every block, the head's dot product for its top token, its layout), and its last logits [V]."""
    if is_family_model(model):
        return _family_run(model, tokenizer, ids, top_k)
    options = TraceOptions(top_k=top_k, logit_lens=True, embedding_check=False)
    tr, last = trace_with_logits(model, tokenizer, ids=ids, options=options, about=about)
    return {"next_token": {k: tr.next_token[k] for k in ("id", "text", "prob")}, "top": tr.next_token["top"],
            "lens_last": [dict(layer["top"][-1], layer=layer["layer"]) for layer in tr.logit_lens["layers"]],
            "head_top": tr.head["rows"][0] if tr.head else None, "layout": tr.model["layout"]}, last


@torch.inference_mode()
def _family_run(model, tokenizer: Tokenizer, ids: list[int], top_k: int) -> tuple[dict[str, Any], torch.Tensor]:
    """_run for a Qwen3 or Llama model: the logit lens sends each block's output at the last position through
    the model's own final_norm (RMSNorm) and out_head, as GPT-2's lens does through LayerNorm."""
    seen: list[torch.Tensor] = []
    handles = [block.register_forward_hook(lambda module, inputs, out: seen.append(out[0, -1]))
               for block in model.trf_blocks]
    handles.append(model.final_norm.register_forward_hook(lambda module, inputs, out: seen.append(out[0, -1])))
    try:
        last = model(torch.tensor([ids], device=model.tok_emb.weight.device))[0, -1].float()  # [V]
    finally:
        for h in handles:
            h.remove()
    *blocks, h = seen  # each block's output [d], then final_norm's [d]

    def label(i: int) -> str:  # Qwen3 pads its 151,669 ids to 151,936 rows
        return tokenizer.decode([i]) if i < tokenizer.n_vocab else f"<row {i}: no token>"

    probs = last.softmax(-1)
    top = [{"id": int(i), "text": label(int(i)), "prob": float(p)}
           for p, i in zip(*probs.topk(min(top_k, probs.numel())))]
    lens = []
    for layer, x in enumerate(blocks):
        p = model.out_head(model.final_norm(x)).float().softmax(-1)  # [d] -> [V]
        j = int(p.argmax())
        lens.append({"id": j, "text": label(j), "prob": float(p[j]), "layer": layer})
    head = head_products(model, h, last, [top[0]["id"]], ids, label)
    return {"next_token": {k: top[0][k] for k in ("id", "text", "prob")}, "top": top, "lens_last": lens,
            "head_top": head["rows"][0], "layout": layout_line(model.cfg)}, last

"""The head as a dot product: logit[id] = h · W[id] (+ bias[id]), checked against out_head.

h is the last position's final vector (final_norm's output there, [d]: GPT-2's LayerNorm, the
RMSNorm of Qwen3 and Llama 3) and W is
out_head.weight ([V, d]). The model predicts the token whose row W[id] has the largest dot
product with h. With tying (GPT-2), W *is* tok_emb.weight: the row that scores id at the
output is the very row that embedded id at the input. Untied (the book's GPT_CONFIG_124M),
the two rows are separate tensors, and their cosine says how far apart training drew them.

A dot product is |h| · |W[id]| · cos(h, W[id]); |h| is the same for every id, so the logits
rank ids by |W[id]| · cos. Ranking by the cosine alone (the rows that point most nearly
where h points) drops the rows' lengths, and gives another order: a long row can win the
logits while pointing less exactly at h.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..kinds import describe

NEAREST = 5  # tokens listed by cosine


def head_products(model: nn.Module, h: torch.Tensor, logits: torch.Tensor, top_ids: Sequence[int],
                  prompt_ids: Sequence[int], label: Callable[[int], str]) -> dict[str, Any]:
    """The dot products behind `logits` ([V], out_head's output at the last position) for the
    `top_ids`, from h ([d], final_norm's output there); JSON-ready."""
    logits = logits.float()
    described = describe(model).head
    out_head = model.get_submodule(described.path)  # found through the description
    W = out_head.weight.float()  # [V, d]
    bias = out_head.bias.float() if out_head.bias is not None else None
    h = h.float()
    dots = W @ h  # [V, d] @ [d] -> [V]
    recomputed = dots + bias if bias is not None else dots
    scale = described.logit_scale or 1.0  # Tiny Aya's logits are the products times logit_scale
    recomputed = recomputed * scale
    if described.softcap:  # Gemma 4's logits are softcap * tanh(products / softcap)
        recomputed = torch.tanh(recomputed / described.softcap) * described.softcap
    row_norms = _row_norms(out_head.weight)  # [V]
    h_norm = float(h.norm())
    cos = dots / (row_norms * h_norm).clamp_min(1e-30)  # [V]
    rows = [_row(j, label(j), dots, bias, logits, row_norms, cos) for j in top_ids]
    nearest = cos.topk(min(NEAREST, cos.numel())).indices.tolist()
    out = {
        "h_norm": h_norm, "has_bias": bias is not None,
        "max_abs_diff": float((recomputed - logits.float()).abs().max()),  # over all V ids, not the top only
        "rows": rows,
        "nearest": [{"id": j, "text": label(j), "cos": float(cos[j]), "logit_rank": r}
                    for j, r in zip(nearest, _ranks(logits, nearest))],
        "kind": "classes" if model.cfg.num_classes is not None else "tokens",
    }
    if scale != 1.0:
        out["logit_scale"] = scale
    if getattr(model.cfg, "family", None):  # Qwen3, Llama 3: h is their RMSNorm's output
        out["family"] = model.cfg.family
    if model.cfg.num_classes is None:
        out.update(_tying(model, W, prompt_ids, logits, rows, label))
    out["tying_note"] = tying_note(out)
    return out


def tying_note(hd: dict[str, Any]) -> str:
    """What W is, in the one sentence every view (text, picture, page) shows."""
    if hd["kind"] == "classes":
        return "W is the classifier's own [classes, d] weight"
    if hd["tied"]:
        storage = "one storage" if hd["shares_storage"] else "NOT one storage"
        return (f"tied: W is tok_emb.weight ({storage}), so W[id] is the very row that embedded id at the input: "
                "the model predicts the token whose embedding its last vector most resembles (by dot product)")
    whose = " (the book's layout)" if hd.get("family") is None else ""  # GPT-2's: the book's GPT_CONFIG_124M
    return (f"untied{whose}: W is its own tensor; tok_emb.weight[id] embedded id at the input, "
            "out_head.weight[id] scores it at the output, and training sets the two apart")


def _row_norms(weight: torch.Tensor) -> torch.Tensor:
    """|W[id]| for every row, [V] float32: computed once per weight tensor and kept on it, again only
    after it changes (its `_version` counts in-place updates), so that a served model's traces do not
    each pass over W twice."""
    try:
        version = weight._version
    except RuntimeError:  # a tensor made under inference_mode keeps no version: nothing to cache by
        return weight.detach().float().norm(dim=1)
    cached = getattr(weight, "_glassgpt_row_norms", None)
    if cached is not None and cached[0] == version:
        return cached[1]
    norms = weight.detach().float().norm(dim=1)
    weight._glassgpt_row_norms = (version, norms)  # one tuple swapped in whole: safe across threads
    return norms


def _row(j: int, text: str, dots, bias, logits, row_norms, cos) -> dict[str, Any]:
    return {"id": j, "text": text, "dot": float(dots[j]), "bias": float(bias[j]) if bias is not None else 0.0,
            "logit": float(logits[j]), "w_norm": float(row_norms[j]), "cos": float(cos[j])}


def _ranks(scores: torch.Tensor, ids: Sequence[int]) -> list[int]:
    """Each id's rank by `scores` [V]: 1 + how many ids score higher (ties share a rank)."""
    if not ids:
        return []
    picked = scores[torch.tensor(ids, device=scores.device)]
    return ((scores[None, :] > picked[:, None]).sum(dim=1) + 1).tolist()


def _tying(model: nn.Module, W: torch.Tensor, prompt_ids: Sequence[int], logits: torch.Tensor,
           rows: list[dict], label: Callable[[int], str]) -> dict[str, Any]:
    """Tied: out_head's rows are tok_emb's own (one storage); where the prompt's tokens rank.
    Untied: each top token's two rows, and their cosine."""
    anatomy = describe(model)
    emb, head = model.get_submodule(anatomy.embedding.path).weight, model.get_submodule(anatomy.head.path).weight
    tied = anatomy.head.tied  # by storage
    out: dict[str, Any] = {"tied": tied, "shares_storage": emb.data_ptr() == head.data_ptr() and emb.shape == head.shape}
    seen = list(dict.fromkeys(int(i) for i in prompt_ids))
    out["prompt_ranks"] = [{"id": j, "text": label(j), "logit": float(logits[j]), "rank": r}
                           for j, r in zip(seen, _ranks(logits, seen))]
    if not tied:
        E = emb.float()
        for row in rows:
            e = E[row["id"]]
            row["emb_norm"] = float(e.norm())
            row["cos_emb_head"] = float(e @ W[row["id"]] / (e.norm() * W[row["id"]].norm()).clamp_min(1e-30))
    return out


def logit_lens_of(model: nn.Module, residuals: list[torch.Tensor], logits: torch.Tensor, label,
                  step: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The top token (or class) at every position after every block: out_head(final_norm(residual)), through the
    model's own final_norm (GPT-2's LayerNorm; RMSNorm in Qwen3 and Llama) and out_head, tied or not.

    residuals: each block's output `[b, t, d]`; logits: the model's own `[b, t, V]`. Only each row's top
    is needed: its id is the max of the logits, its probability exp(max - logsumexp(logits)), so no
    softmax over [t, V] is kept. After the last block the lens is the model's own output, so those
    logits are reused. step: called with `logit_lens.N` after each block (a trace's progress).
    """
    anatomy = describe(model)
    final_norm, out_head = model.get_submodule(anatomy.final_norm.path), model.get_submodule(anatomy.head.path)
    layers = []
    n = len(residuals)
    for i, resid in enumerate(residuals):
        lens = (logits[0] if i == n - 1 else out_head(final_norm(resid))[0]).float()  # [t, V]
        top, idx = lens.max(dim=-1)  # [t, V] -> [t]
        prob = (top - lens.logsumexp(dim=-1)).exp()
        layers.append({"layer": i, "top": [{"id": int(j), "text": label(int(j)), "prob": float(q)}
                                           for q, j in zip(prob, idx)]})
        if step is not None:
            step(f"logit_lens.{i}")
    return {"layers": layers}

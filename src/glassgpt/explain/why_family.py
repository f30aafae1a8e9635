"""why for Qwen3 and Llama 3.2: the next token's logit as an exact sum of parts, the prompt tokens' shares,
and activation patching, in the fields of GPT-2's answer (why_result.Why), so the same views show it.

    why(qwen3_model, tokenizer, "Every effort moves you") -> FamilyWhy   (why.py hands a family model here)

The parts. The last position's residual x (final_norm's input) is the sum of what every part
wrote into it: tok_emb (no pos_emb: positions entered as RoPE inside each attention), each
block's attention and each block's feed-forward. final_norm is RMSNorm, x * weight / rms with
rms = sqrt(mean(x^2) + eps). With rms frozen at that position (as TransformerLens freezes
LayerNorm's scale) and the weight folded into out_head's rows, each logit is linear in x:

    logit[a] - logit[b] = sum over parts of  part @ ((W[a] - W[b]) * final_norm.weight) / rms

(without b: logit[a] alone). out_proj has no bias, so an attention's output splits over the
query heads: head j's term is its context (its hd values of out_proj's input) times its slice of
out_proj. Head j read key/value group j // group_size (repeat_interleave); its part names it.

Which prompt tokens, GPT-2's two answers:
- direct: head j's context at the last position is sum_src attn_j[src] * v_g[src], the values of
  its group g, so its term splits exactly over the sources; attn_j is the last query's row,
  from the rotated query and keys (QK-norm and RoPE applied by the model's own modules);
- causal: each shortened prompt run again whole, batched (without token j the later tokens move
  one position down, and RoPE turns their keys by the new position).

Activation patching (a corrupted prompt of the same length): the clean block input at each
(block, position), and each query head's context at all positions, copied into the corrupted
run; the blocks from there on run again, the glass model's own, at positions 0..t-1.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..device import evaluating
from ..errors import TraceCancelled
from ..kinds import describe
from ..prompt import Prompt
from ..tokenizer import Tokenizer
from .trace import RecordingCache, attention_of
from .why_result import (ATTENTION_IS_NOT, Why, check_id, corrupted_ids, first_difference, labeller, patch_pair,
                         runner_up, sources_of, versus_id)

REMOVAL_TOKENS = 4096  # the shortened prompts run this many tokens at most per forward pass


@dataclass(kw_only=True)
class FamilyWhy(Why):
    """A Why of a Qwen3/Llama model, with what grouped-query attention and RMSNorm add."""

    family: str
    groups: list[int]                      # [n_heads]: the key/value group each query head read
    rms: float                             # final_norm's rms at the last position, frozen
    total: float                           # the sum of the parts (the model's own number is `metric`)

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, **super().to_dict(), "groups": self.groups, "rms": self.rms,
                "total": self.total}


@torch.inference_mode()
def why_family(model: nn.Module, tokenizer: Tokenizer, prompt: Prompt, target: int | None = None,
               versus: str | int | None = None, patch: str | None = None, top_k: int = 10,
               cancel: threading.Event | None = None) -> FamilyWhy:
    """why.py's `why` for a Qwen3Model or Llama3Model: the same choices of A, B and the corrupted prompt."""
    # (why() has refused a model whose blocks are not pre-norm: these sums split the pre-norm residual stream)
    cfg, ids = model.cfg, prompt.ids
    label = labeller(model, tokenizer, None)
    with evaluating(model):
        seen, last = record_family(model, ids, cancel)
        a = int(last.argmax()) if target is None else check_id(target, cfg.out_dim, "target")
        b = versus_id(model, tokenizer, versus, None, last, a)
        result = attribute_family(model, seen, a, b)
        contrast = None
        if b is None:  # why A and not the runner-up: the same sum for the difference
            r = runner_up(last, a)
            contrast = {"versus": {"id": r, "text": label(r), "logit": float(last[r])},
                        "parts": attribute_family(model, seen, a, r)["parts"]}
        causal = remove_each_family(model, seen, ids, last, a, cancel)
        patched = None if patch is None else patch_grid_family(model, tokenizer, seen, ids, last, patch, b, label,
                                                              cancel)
    top = last.softmax(-1).topk(min(top_k, cfg.out_dim))
    return FamilyWhy(
        prompt=tokenizer.decode(ids), tokens=[{"id": i, "text": tokenizer.decode([i])} for i in ids], kind="token",
        target={"id": a, "text": label(a), "logit": float(last[a])},
        versus=None if b is None else {"id": b, "text": label(b), "logit": float(last[b])},
        parts=result["parts"], heads=result["heads"], ff=result["ff"], by_source=result["by_source"],
        sources=sources_of(ids, result["by_source"], causal, tokenizer),
        metric=float(last[a] - (last[b] if b is not None else 0.0)),
        candidates=[{"id": int(i), "text": label(int(i)), "prob": float(p)} for p, i in zip(top.values, top.indices)],
        contrast=contrast, patch=patched, notes=([prompt.note] if prompt.note else []) + [ATTENTION_IS_NOT],
        family=cfg.family, groups=[j // cfg.group_size for j in range(cfg.n_heads)], rms=result["rms"],
        total=sum(p["value"] for p in result["parts"]))


def record_family(model: nn.Module, ids: list[int], cancel: threading.Event | None) -> tuple[dict, torch.Tensor]:
    """One forward pass, keeping every position of what the analyses read, under the stage names:
    tok_emb's output, each block's input, its queries (before QK-norm and RoPE), its rotated keys and values
    (`att.kv`, what a KV cache is handed: [1, g, t, hd] each), out_proj's input (the heads' contexts) and the
    feed-forward's output, and final_norm's input. Returns (seen, the last position's logits [V] in float32)."""
    if cancel is not None and cancel.is_set():
        raise TraceCancelled("the trace was cancelled")
    seen: dict[str, Any] = {}

    def keep_output(name: str):
        return lambda module, inputs, output: seen.__setitem__(name, output.detach())

    def keep_input(name: str):
        return lambda module, inputs: seen.__setitem__(name, inputs[0].detach())

    anatomy, part = describe(model), model.get_submodule  # the modules, found through the description
    handles = [part(anatomy.embedding.path).register_forward_hook(keep_output("tok_emb")),
               part(anatomy.final_norm.path).register_forward_pre_hook(keep_input("final_norm"))]
    for i, block in enumerate(anatomy.blocks):
        p, att = f"trf_blocks.{i}", block.attention
        handles += [part(block.path).register_forward_pre_hook(keep_input(p)),
                    part(att.query.path).register_forward_hook(keep_output(f"{p}.att.W_query")),
                    part(att.out.path).register_forward_pre_hook(keep_input(f"{p}.att.out_proj")),
                    part(block.ff.path).register_forward_hook(keep_output(f"{p}.ff"))]
    cache = RecordingCache()
    try:
        batch = torch.tensor([ids], device=part(anatomy.embedding.path).weight.device)  # [1, t]
        logits = model(batch, cache, last_only=True)  # [1, 1, V]
    finally:
        for h in handles:
            h.remove()
    for i, kv in cache.seen.items():
        seen[f"trf_blocks.{i}.att.kv"] = kv
    return seen, logits[0, -1].float()


def direction(model: nn.Module, x_last: torch.Tensor, a: int, b: int | None) -> tuple[torch.Tensor, float]:
    """(c, rms): logit[a] - logit[b] = part . c summed over the parts, with final_norm's rms frozen at x_last.
    The final norm and the head are read through the description: its weight's name, its eps, and its kind
    (w * x / rms, or Gemma's (1 + w) * x / rms)."""
    anatomy = describe(model)
    final = anatomy.final_norm
    if final.kind not in ("rmsnorm", "rmsnorm_plus_one"):
        raise ValueError(f"the rotary attribution reads an RMSNorm before the head; {final.path} is {final.kind}")
    head = model.get_submodule(anatomy.head.path).weight
    w = head[a].double() - (head[b].double() if b is not None else 0)  # [d]
    x = x_last.double()
    rms = float(torch.sqrt(x.pow(2).mean() + final.eps))
    scale = getattr(model.get_submodule(final.path), final.weight).double()
    return w * (scale if final.kind == "rmsnorm" else 1 + scale) / rms, rms  # [d]


def attribute_family(model: nn.Module, seen: dict, a: int, b: int | None) -> dict[str, Any]:
    """The parts of logit[a] (- logit[b]) at the last position, each query head split over the source tokens."""
    cfg = model.cfg
    h, hd, gs = cfg.n_heads, cfg.head_dim_value, cfg.group_size
    c, rms = direction(model, seen["final_norm"][0, -1], a, b)
    t = seen["tok_emb"].shape[1]
    cos, sin = model.rope.at(0, t, seen["tok_emb"].device)  # [t, hd]: the angles of the positions it ran at
    parts = [{"name": "tok_emb", "value": float(seen["tok_emb"][0, -1].double() @ c)}]
    heads, ff, by_source = [], [], []
    for i, block in enumerate(describe(model).blocks):
        p, att = f"trf_blocks.{i}", model.get_submodule(block.attention.path)
        wc = (model.get_submodule(block.attention.out.path).weight.double().T @ c).view(h, hd)  # [h, hd]: each unit's
        attn = last_row_attention(att, seen, p, cos, sin)  # [h, t]
        v = seen[f"{p}.att.kv"][1][0].double().repeat_interleave(gs, dim=0)  # [g, t, hd] -> [h, t, hd]
        shares = attn * (v * wc.unsqueeze(1)).sum(-1)  # [h, t]: head j's term, split over the sources
        context = seen[f"{p}.att.out_proj"][0, -1].double().view(h, hd)  # the model's own context, [h, hd]
        head_terms = (context * wc).sum(-1)  # [h]
        heads.append([float(x) for x in head_terms])
        ff.append(float(seen[f"{p}.ff"][0, -1].double() @ c))
        by_source.append(shares.tolist())
        parts += [{"name": f"{p}.att.head.{j}", "value": heads[-1][j], "group": j // gs} for j in range(h)]
        parts.append({"name": f"{p}.ff", "value": ff[-1]})
    return {"parts": parts, "heads": heads, "ff": ff, "by_source": by_source, "rms": rms}


def last_row_attention(att: nn.Module, seen: dict, p: str, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The last query's attention weights over the sources, [h, t] (trace.py's attention_of: its query through
    QK-norm (Qwen3) and RoPE at the last position, against the recorded rotated keys)."""
    q = seen[f"{p}.att.W_query"][:, -1:]  # [1, 1, h*hd]
    return attention_of(att, q, seen[f"{p}.att.kv"][0], cos[-1:], sin[-1:])[0, :, 0].double()  # every source


def remove_each_family(model: nn.Module, seen: dict, ids: list[int], last: torch.Tensor, a: int,
                       cancel: threading.Event | None = None) -> list[dict[str, Any]] | str:
    """The prompt run again without each token: the change in the target's probability and logit.

    The shortened prompts are all t-1 tokens long, so they run as one batch (in batches of at most
    REMOVAL_TOKENS tokens); without the last token, the clean run's position t-2 is the answer."""
    t = len(ids)
    if t == 1:
        return "the prompt is one token: there is nothing to remove"
    shortened = [ids[:j] + ids[j + 1:] for j in range(t - 1)]
    rows = max(1, REMOVAL_TOKENS // (t - 1))
    logit, prob = [], []
    for start in range(0, t - 1, rows):
        if cancel is not None and cancel.is_set():
            raise TraceCancelled("the trace was cancelled")
        batch = torch.tensor(shortened[start:start + rows], device=model.tok_emb.weight.device)  # [rows, t-1]
        out = model(batch, last_only=True)[:, -1].float()  # [rows, V]
        logit.append(out[:, a])
        prob.append(out.softmax(-1)[:, a])
    without_last = model.out_head(model.final_norm(seen["final_norm"][:, -2])).float()  # [1, V]
    logit.append(without_last[:, a])
    prob.append(without_last.softmax(-1)[:, a])
    logit, prob = torch.cat(logit), torch.cat(prob)  # [t]
    p0 = last.softmax(-1)[a]
    return [{"how": "removed", "prob_change": float(prob[j] - p0), "logit_change": float(logit[j] - last[a])}
            for j in range(t)]


def patch_grid_family(model: nn.Module, tokenizer: Tokenizer, clean: dict, ids: list[int], last: torch.Tensor,
                      corrupted_text: str, versus: int | None, label, cancel) -> dict[str, Any]:
    """why.py's patch_grid for a family model: the same metric, rows and columns (block inputs x positions,
    then blocks x query heads), each value (m_patched - m_corrupted) / (m_clean - m_corrupted)."""
    n = model.cfg.n_layers
    bad = corrupted_ids(tokenizer, ids, corrupted_text)
    corrupt, bad_last = record_family(model, bad, cancel)
    a, b, m_clean, m_bad = patch_pair(last, bad_last, versus, label)
    w = (model.out_head.weight[a] - model.out_head.weight[b]).double()  # only logit[A] - logit[B] is read
    restored = lambda x: ((x.double() @ w) - m_bad) / (m_clean - m_bad)  # noqa: E731  (final_norm's outputs)
    first = first_difference(ids, bad)
    grid = [[0.0] * first + restored(_patched_resid(model, clean, corrupt, i, first, cancel)).tolist()
            for i in range(n + 1)]
    heads = [restored(_patched_heads(model, clean, corrupt, i, cancel)).tolist() for i in range(n)]
    blocks = [f"trf_blocks.{i}" for i in range(n)]
    return {"corrupted": tokenizer.decode(bad), "clean_top": {"id": a, "text": label(a)},
            "versus": {"id": b, "text": label(b)}, "m_clean": m_clean, "m_corrupted": m_bad,
            "blocks": blocks + ["final_norm"], "positions": [tokenizer.decode([i]) for i in ids], "grid": grid,
            "heads": {"blocks": blocks, "grid": heads}}


def _block_input(seen: dict, i: int, n_layers: int) -> torch.Tensor:
    """The recorded input of block i, or for i = n_layers the input of final_norm: [1, t, d]."""
    return seen[f"trf_blocks.{i}"] if i < n_layers else seen["final_norm"]


def _patched_resid(model: nn.Module, clean: dict, corrupt: dict, i: int, first: int, cancel) -> torch.Tensor:
    """final_norm's output at the last position, [t - first, d]: run j with the clean input of block i (or of
    final_norm) at position first + j, the rest corrupted."""
    n = model.cfg.n_layers
    bad = _block_input(corrupt, i, n)  # [1, t, d]
    x = bad.repeat(bad.shape[1] - first, 1, 1)  # [t - first, t, d]: one run per patched position
    j = torch.arange(x.shape[0])
    x[j, j + first] = _block_input(clean, i, n)[0, first:]
    return model.final_norm(_through(model, x, i, cancel)[:, -1])  # [t - first, d]


def _patched_heads(model: nn.Module, clean: dict, corrupt: dict, i: int, cancel) -> torch.Tensor:
    """final_norm's output at the last position, [h, d]: run j with query head j's clean context (its hd values
    of out_proj's input, at every position) in block i, the rest corrupted."""
    h, hd = model.cfg.n_heads, model.cfg.head_dim_value
    clean_context = clean[f"trf_blocks.{i}.att.out_proj"][0].view(-1, h, hd)  # [t, h*hd] -> [t, h, hd]

    def swap(module, inputs):
        context = inputs[0].view(h, -1, h, hd).clone()  # [h runs, t, h, hd]: the corrupted run's
        runs = torch.arange(h)
        context[runs, :, runs] = clean_context.transpose(0, 1)  # run j: head j's context from the clean run
        return (context.view(h, -1, h * hd),)
    handle = model.trf_blocks[i].att.out_proj.register_forward_pre_hook(swap)
    try:
        x = _block_input(corrupt, i, model.cfg.n_layers).repeat(h, 1, 1)  # [h, t, d]
        return model.final_norm(_through(model, x, i, cancel)[:, -1])  # [h, d]
    finally:
        handle.remove()


def _through(model: nn.Module, x: torch.Tensor, start: int, cancel) -> torch.Tensor:
    """The blocks from `start` on (start = n_layers: none), from `x`, their input `[b, t, d]`, at positions 0..t-1."""
    cos, sin = model.rope.at(0, x.shape[1], x.device)  # [t, hd]
    for block in model.trf_blocks[start:]:
        if cancel is not None and cancel.is_set():
            raise TraceCancelled("the trace was cancelled")
        x = block(x, cos, sin)
    return x

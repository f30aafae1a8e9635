"""Why this token: which parts of the model, and which prompt tokens, made the chosen logit.

    why(model, tokenizer, "Every effort moves you") -> Why

One analysis for every described model (glassgpt.describe: GPT-2, Qwen3, Llama 3.2, chapter 4's variants,
Qwen3 MoE, Gemma 3, OLMo 3, Tiny Aya, Qwen3.5, Gemma 4), reading only the description, never a model's family.

The parts. The last position's residual x (final_norm's input) is the sum of what every part wrote into
the stream: the embedding (tok_emb, times its scale where it has one; pos_emb where positions are
learned) and, in each block, its attention and its feed-forward. Each part's write is what it adds to the
stream, whatever the norms' placement:
    pre       x + att(norm(x)), x + ff(norm(x))             the write: att's output, ff's output
    post      x + norm(att(x)), x + norm(ff(x))             (OLMo 3) the post-norm's output
    sandwich  x + norm(att(norm(x))), the same around ff    (Gemma 3) the post-norm's output
    parallel  x + att(norm(x)) + ff(norm(x))                (Tiny Aya) att's output and ff's output
With final_norm's denominator frozen at that position (LayerNorm's 1 / sqrt(var + eps), RMSNorm's 1 / rms,
as TransformerLens's `apply_ln_to_stack` freezes it), each logit is an exact sum: one term per part, plus
final_norm's shift and out_head's bias where they exist; the head's logit scale multiplies every term, and
a softcap (cap * tanh(z / cap)) scales each by its logit's capped / uncapped ratio, so the sum stays exact.
A part behind a post-norm is split the same way, that norm's denominator frozen at its own input.
Gemma 4's blocks write a third part, their per-layer input (x + norm(projection(gelu_tanh(gate(x)) * its
slice))), and multiply their whole output by a stored number s_i (layer_scalar): the stream at the end is
(s_0 ... s_{L-1}) emb + sum_i (s_i ... s_{L-1}) (att_i + ff_i + per_layer_i), so every write of block i (and
the embedding, with block 0's) is read along c times the product of the scales from its block on, and the parts
still sum to the logit exactly.

Inside a part: an attention's write splits over its query heads (head j's context, its slice of out_proj's
input, times its slice of out_proj; out_proj's bias is a part of its own); a mixture of experts' write
splits over the experts the router chose for the last token, each weighted by its renormalised routing
weight (the softmax over the chosen k scores), so the experts sum to the block's feed-forward part.

Which prompt tokens, two answers, each what it says:
- direct: a head's context at the last position is sum_src attn[src] * v[src], so its term splits exactly
  over the source tokens (attention weights alone are not this: they leave out what each value vector
  carries and where W_O sends it). The split is read from the model itself: one more pass in which copy s
  of the prompt keeps only source s's values (every block fed the clean run's input), so no attention
  formula is written twice. A linear attention (Qwen3.5's Gated DeltaNet) normalises its output, which is
  not linear in the values: its terms are not split (zeros, and a note says so);
- causal: the prompt with each token removed, run again: the change in the target's probability and logit.

Activation patching (`patch`, a corrupted prompt of the same length): the clean residual stream at each
(block input, position) copied into the corrupted run, and each head's context (all positions) likewise;
the value is the fraction of the clean logit difference restored.

GPT-2's shape (learned positions, pre-norm blocks of multi-head attention and a GELU MLP, as glassgpt's
GPTModel computes it) runs its re-runs on the engine's fused twin: the removals feed only the tokens after
each removed one, on the clean run's keys and values before it (packed), and the patched runs start from the
corrupted run's recorded block inputs. Every other model re-runs whole, its own forward with taps.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import anatomy as an
from ..adopt import adopt, check_computable
from ..device import evaluating
from ..engine.fused import fused
from ..errors import GlassError, TraceCancelled
from ..kinds import describe
from ..prompt import Prompt, Reading, check_ids, encode, fit_for, reading_line
from ..tokenizer import Tokenizer
from .record import Recorder, record
from .why_result import (ATTENTION_IS_NOT, Why, check_id, corrupted_ids, first_difference, labeller, patch_pair,
                         runner_up, sources_of, versus_id)

REMOVAL_TOKENS = 4096  # the shortened prompts (and the direct split's copies) run this many tokens per pass at most
LINEAR_NOT_SPLIT = ("a linear attention's output is normalised after its state is read, so it is not a sum over the "
                    "source tokens: its heads' terms are not split over the prompt (their rows are zeros)")


@torch.inference_mode()
def why(model: nn.Module, tokenizer: Tokenizer, text: str | None = None, versus: str | int | None = None,
        patch: str | None = None, *, ids: list[int] | None = None, target: int | None = None,
        labels: list[str] | None = None, top_k: int = 10, cancel: threading.Event | None = None,
        reading: Reading | None = None) -> Why:
    """Attribute the top next token's logit (or `target`'s, an id) to the model's parts and the prompt's tokens.

    versus: a token (text, or an id) to explain logit[target] - logit[versus] instead; a
    classifier is always explained against a second class (the runner-up by default).
    patch: a corrupted prompt with as many tokens, for the activation-patching grids.
    reading: where a classifier reads a text (prompt.Reading; the book's recipe pads), as trace's About says.
    GPT-2's shape gives a Why; every other described model a DescribedWhy, the same fields plus its key/value
    groups, its frozen final denominator and, for a mixture of experts, each token's routed experts.
    """
    describe(model)  # what it is made of; one line for an object of no kind glassgpt reads
    check_computable(model, tokenizer if ids is None else None)  # ids given are checked as they are
    cfg = adopt(model, described=True).cfg
    num_classes = getattr(cfg, "num_classes", None)
    ids = check_ids(ids, min(tokenizer.n_vocab, cfg.vocab_size)) if ids is not None else encode(tokenizer, text)
    prompt = fit_for(ids, cfg.context_length, num_classes, reading)
    model = adopt(model, [prompt.ids], described=True)  # a reader's module, read in place; its own logits checked once
    anatomy = describe(model)
    if not runs_on_the_fused_twin(anatomy):
        return why_described(model, anatomy, tokenizer, prompt, target=target, versus=versus, patch=patch,
                             top_k=top_k, cancel=cancel)
    label = labeller(model, tokenizer, labels)
    with evaluating(model):
        seen, logits = record_run(model, prompt.ids, cancel)
        last = logits[0, -1].float()  # [V]
        a = int(last.argmax()) if target is None else check_id(target, cfg.out_dim, "target")
        b = versus_id(model, tokenizer, versus, labels, last, a)
        result = attribute(model, seen, prompt.ids, a, b)
        contrast = None
        if b is None and cfg.out_dim > 1:  # why A and not the runner-up: the same sum for the difference
            r = runner_up(last, a)
            contrast = {"versus": {"id": r, "text": label(r), "logit": float(last[r])},
                        "parts": attribute(model, seen, prompt.ids, a, r)["parts"]}
        sources = sources_of(prompt.ids, result["by_source"], remove_each(model, seen, prompt.ids, last, a, cancel),
                           tokenizer)
        patched = None if patch is None else patch_grid(model, tokenizer, seen, prompt.ids, last, patch,
                                                       b if versus is not None else None, label, cancel)
    top = last.softmax(-1).topk(min(top_k, cfg.out_dim))
    return Why(
        prompt=tokenizer.decode(prompt.ids), tokens=[{"id": i, "text": tokenizer.decode([i])} for i in prompt.ids],
        kind="class" if cfg.num_classes is not None else "token",
        target={"id": a, "text": label(a), "logit": float(last[a])},
        versus=None if b is None else {"id": b, "text": label(b), "logit": float(last[b])},
        parts=result["parts"], heads=result["heads"], ff=result["ff"], by_source=result["by_source"],
        sources=sources, metric=float(last[a] - (last[b] if b is not None else 0.0)),
        candidates=[{"id": int(i), "text": label(int(i)), "prob": float(p)} for p, i in zip(top.values, top.indices)],
        contrast=contrast, patch=patched,
        notes=[n for n in (prompt.note, reading_line(cfg.num_classes, reading, prompt)) if n] + [ATTENTION_IS_NOT])


def runs_on_the_fused_twin(anatomy: an.Anatomy) -> bool:
    """GPT-2's shape, which the engine's fused twin (engine/fused.py) runs: learned positions, pre-norm blocks of
    multi-head attention (one key/value group a head, no window, no latent) and a GELU MLP, an untouched head."""
    return (anatomy.positions.kind == "learned" and anatomy.embedding.scale is None
            and anatomy.head.logit_scale is None and anatomy.head.softcap is None
            and all(b.placement == "pre" and b.ff.kind == "gelu_mlp" and b.attention.kind == "causal"
                    and b.attention.n_kv_groups == b.attention.n_heads and b.attention.window is None
                    and b.attention.latent is None for b in anatomy.blocks))


# --- GPT-2's shape, on the fused twin ------------------------------------------------------------------

def record_run(model: nn.Module, ids: list[int], cancel: threading.Event | None) -> tuple[dict, torch.Tensor]:
    """One forward pass, keeping what every analysis here reads, under the stage names."""
    keep = {"tok_emb", "pos_emb"}
    for i in range(model.cfg.n_layers):
        p = f"trf_blocks.{i}"
        keep.update((p, f"{p}.att.W_query", f"{p}.att.W_key", f"{p}.att.W_value", f"{p}.att.out_proj",
                     f"{p}.ff.layers.2"))
    rec = Recorder(frozenset(keep), model.cfg.n_layers, cancel)
    batch = torch.tensor([ids], device=model.tok_emb.weight.device)  # [b=1, t]
    logits = record(model, batch, rec, last_only=True)  # [1, 1, V]: only the last position is explained
    return rec.seen, logits


def direction(model: nn.Module, x_last: torch.Tensor, a: int, b: int | None) -> tuple[torch.Tensor, float, float]:
    """(c, shift term, bias term) with logit[a] - logit[b] = part . c summed over the parts, + the two terms.

    final_norm(x) = scale * (x - mean x) / sigma + shift with sigma frozen at x_last, so a part p
    adds scale * (p - mean p) / sigma . w, with w = W[a] - W[b]: that is p . c for the centred c
    below (centering is a projection, so it can move from p onto the direction).
    """
    head, norm = model.out_head, model.final_norm
    w = head.weight[a].double() - (head.weight[b].double() if b is not None else 0)  # [d]: two rows, not all of W
    x = x_last.double()
    sigma = torch.sqrt(x.var(unbiased=False) + norm.eps)
    g = norm.scale.double() * w
    c = (g - g.mean()) / sigma  # [d]
    shift = float(norm.shift.double() @ w)
    bias = 0.0
    if head.bias is not None:
        bias = float(head.bias[a].double() - (head.bias[b].double() if b is not None else 0))
    return c, shift, bias


def attribute(model: nn.Module, seen: dict, ids: list[int], a: int, b: int | None) -> dict[str, Any]:
    """The parts of logit[a] (- logit[b]) at the last position, each head split over the source tokens."""
    cfg = model.cfg
    h, hd = cfg.n_heads, cfg.head_dim
    x_last = seen[f"trf_blocks.{cfg.n_layers - 1}"][1][0, -1]  # final_norm's input there, [d]
    c, shift, bias = direction(model, x_last, a, b)
    parts = [{"name": "tok_emb", "value": float(seen["tok_emb"][0, -1].double() @ c)},
             {"name": "pos_emb", "value": float(seen["pos_emb"][-1].double() @ c)}]
    heads, ff, by_source = [], [], []
    for i, blk in enumerate(model.trf_blocks):
        p = f"trf_blocks.{i}"
        wc = blk.att.out_proj.weight.double().T @ c  # [d]: what each context unit adds, through W_O
        attn = _last_row_attention(blk.att, seen, p, h)  # [h, t]
        v = _split(seen[f"{p}.att.W_value"], h)[0].double()  # [h, t, hd]
        per_source = attn.unsqueeze(-1) * (v * wc.view(h, 1, hd))  # [h, t, hd]
        shares = per_source.sum(-1)  # [h, t]
        context = seen[f"{p}.att.out_proj"][0][0, -1].double().view(h, hd)  # the model's own context, [h, hd]
        head_terms = (context * wc.view(h, hd)).sum(-1)  # [h]
        ff_term = float(seen[f"{p}.ff.layers.2"][1][0, -1].double() @ c)
        parts += [{"name": f"{p}.att.head.{j}", "value": float(head_terms[j])} for j in range(h)]
        parts.append({"name": f"{p}.att.bias", "value": float(blk.att.out_proj.bias.double() @ c)})
        parts.append({"name": f"{p}.ff", "value": ff_term})
        heads.append([float(x) for x in head_terms])
        ff.append(ff_term)
        by_source.append(shares.tolist())
    parts.append({"name": "final_norm.shift", "value": shift})
    if model.out_head.bias is not None:
        parts.append({"name": "out_head.bias", "value": bias})
    return {"parts": parts, "heads": heads, "ff": ff, "by_source": by_source}


def _split(x: torch.Tensor, h: int) -> torch.Tensor:
    b, t, d = x.shape
    return x.view(b, t, h, d // h).transpose(1, 2)  # [b, t, d] -> [b, h, t, hd]


def _last_row_attention(att: nn.Module, seen: dict, p: str, h: int) -> torch.Tensor:
    """The last query's attention weights over the sources, by the model's own formula (its `attend`, over
    values that are the identity: weights @ I, exactly): [h, t]."""
    q = _split(seen[f"{p}.att.W_query"][:, -1:], h).float()  # [1, h, 1, hd]
    k = _split(seen[f"{p}.att.W_key"], h).float()  # [1, h, t, hd]
    return att.attend(q, k, torch.eye(k.shape[2], dtype=q.dtype, device=q.device))[0, :, 0].double()  # weights @ I


def remove_each(model: nn.Module, seen: dict, ids: list[int], last: torch.Tensor, a: int,
                cancel: threading.Event | None = None) -> list[dict[str, Any]] | str:
    """The prompt run once more with each token removed: the change in the target's probability and logit.

    Without token j, positions 0..j-1 hold what they held in the clean run, so only the tokens
    after j run again, at positions j, j+1, ..., attending to the clean run's recorded keys and
    values before j and to their own. The shortened prompts' remaining tokens run packed in one
    sequence (several, past context_length): t(t-1)/2 tokens instead of t(t-1), on the fused twin
    (equal to the model within float rounding; tests/test_why.py holds them to a plain re-run within
    1e-5). Without the last token, the clean run's position t-2 is the answer.
    """
    t = len(ids)
    if t == 1:
        return "the prompt is one token: there is nothing to remove"
    packs, size = [[]], 0
    for j in range(t - 1):  # greedily, each pack at most context_length tokens
        if size + t - 1 - j > model.cfg.context_length:
            packs, size = packs + [[]], 0
        packs[-1].append(j)
        size += t - 1 - j
    without_last = seen[f"trf_blocks.{model.cfg.n_layers - 1}"][1][0, -2:-1]  # the clean run's position t-2, [1, d]
    x = torch.cat([_run_without(model, seen, ids, js, cancel) for js in packs] + [without_last])  # [t, d]
    removed = model.out_head(model.final_norm(x)).float()  # [t, V]
    prob = last.softmax(-1)[a]
    return [{"how": "removed", "prob_change": float(removed[j].softmax(-1)[a] - prob),
             "logit_change": float(removed[j, a] - last[a])} for j in range(t)]


def _run_without(model: nn.Module, seen: dict, ids: list[int], removed: list[int], cancel) -> torch.Tensor:
    """final_norm's input at the last position `[len(removed), d]` of the prompt without token j, for each j in
    `removed`: one forward pass over their remaining tokens packed side by side, each at its own positions.

    The pass runs on the engine's fused twin of the model (engine/fused.py: the same weights, F.layer_norm
    and F.gelu for the book's formulas, equal within float rounding), whose attention is swapped, block by
    block, for `_own_attention`: each packed prompt attends to the clean run's keys and values and its own."""
    t, device, n = len(ids), model.tok_emb.weight.device, model.cfg.n_layers
    spans, tokens, positions = [], [], []
    for j in removed:
        spans.append((len(tokens), j))  # prompt j's tokens start here in the pack
        tokens += ids[j + 1:]
        positions += range(j, t - 1)
    pack, pos = torch.tensor([tokens], device=device), torch.tensor(positions, device=device)
    twin = fused(model)  # shares every weight; has no taps, and its own modules to swap `attend` on
    x = twin.drop_emb(twin.tok_emb(pack) + twin.pos_emb(pos))  # [1, T, d]: the embeddings, as forward adds them
    for i, block in enumerate(twin.trf_blocks):
        block.att.attend = _own_attention(model.trf_blocks[i].att.attend, seen, f"trf_blocks.{i}.att", spans, t,
                                          model.cfg.n_heads, device)
    x = _through(twin, x, 0, cancel)  # [1, T, d]
    ends = [s + t - 2 - j for s, j in spans]  # each shortened prompt's last position in the pack
    return x[0, ends]


def _own_attention(own_attend, clean: dict, p: str, spans: list, t: int, h: int, device: torch.device):
    """An `attend` for the pack: the context each packed prompt's queries get from the clean run's keys and
    values before its removed token and from its own, by the model's formula, in place of the pack's plain
    causal attention (`own_attend`: the glass block's, softmax(q k^T / sqrt(hd)) @ v under the causal mask).

    Every shortened prompt has t-1 positions: the clean run's before j, the pack's from j on. Gathered so
    from the two runs (`src`, into their concatenation), the prompts attend as one batch under the usual
    causal mask; `back` picks the pack's positions out again (those before j are the clean run's, unused)."""
    src = torch.tensor([[i if i < j else t + s + i - j for i in range(t - 1)] for s, j in spans], device=device)
    back = torch.tensor([r * (t - 1) + i for r, (s, j) in enumerate(spans) for i in range(j, t - 1)], device=device)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # each [1, h, T, hd]
        q, k, v = (torch.cat([_split(clean[f"{p}.{w}"], h)[0], own[0]], 1)[:, src]
                   for w, own in (("W_query", q), ("W_key", k), ("W_value", v)))  # [h, t + T, hd] -> [h, n, t-1, hd]
        return own_attend(q, k, v).flatten(1, 2)[:, back].unsqueeze(0)  # [h, n, t-1, hd] -> [1, h, T, hd]
    return attend


def patch_grid(model: nn.Module, tokenizer: Tokenizer, clean: dict, ids: list[int], last: torch.Tensor,
              corrupted_text: str, versus: int | None, label, cancel) -> dict[str, Any]:
    """The clean run's block inputs (and heads' outputs) copied one at a time into the corrupted run.

    m = logit[A] - logit[B], A the clean top token, B the corrupted run's top (or `versus`); each
    value is (m_patched - m_corrupted) / (m_clean - m_corrupted). Row b patches block b's input,
    the last row final_norm's input. The patched runs start from the corrupted run's recorded input
    of the patched block, so only the blocks from there on run again (on the fused twin, as the
    removals do), and read only out_head's rows A and B.
    """
    cfg = model.cfg
    bad = corrupted_ids(tokenizer, ids, corrupted_text)
    corrupt, bad_logits = record_run(model, bad, cancel)
    a, b, m_clean, m_bad = patch_pair(last, bad_logits[0, -1].float(), versus, label)
    head = model.out_head
    w = (head.weight[a] - head.weight[b]).double()  # only logit[A] - logit[B] is read: two rows of out_head
    shift = 0.0 if head.bias is None else float(head.bias[a].double() - head.bias[b].double())
    restored = lambda h: ((h.double() @ w + shift) - m_bad) / (m_clean - m_bad)  # noqa: E731
    first = first_difference(ids, bad)
    grid = [[0.0] * first + restored(_patched_resid(model, clean, corrupt, i, first, cancel)).tolist()
            for i in range(cfg.n_layers + 1)]
    heads = [restored(_patched_heads(model, clean, corrupt, i, cancel)).tolist() for i in range(cfg.n_layers)]
    return {"corrupted": tokenizer.decode(bad), "clean_top": {"id": a, "text": label(a)},
            "versus": {"id": b, "text": label(b)}, "m_clean": m_clean, "m_corrupted": m_bad,
            "blocks": [f"trf_blocks.{i}" for i in range(cfg.n_layers)] + ["final_norm"],
            "positions": [tokenizer.decode([i]) for i in ids], "grid": grid,
            "heads": {"blocks": [f"trf_blocks.{i}" for i in range(cfg.n_layers)], "grid": heads}}


def _block_input(seen: dict, i: int, n_layers: int) -> torch.Tensor:
    """The recorded input of block i, or for i = n_layers the input of final_norm: [1, t, d]."""
    return seen[f"trf_blocks.{i}"][0] if i < n_layers else seen[f"trf_blocks.{n_layers - 1}"][1]


def _patched_resid(model: nn.Module, clean: dict, corrupt: dict, i: int, first: int, cancel) -> torch.Tensor:
    """final_norm's output at the last position, [t - first, d]: run j with the clean input of block i at
    position first + j, the rest corrupted."""
    n = model.cfg.n_layers
    bad = _block_input(corrupt, i, n)  # [1, t, d]
    x = bad.repeat(bad.shape[1] - first, 1, 1)  # [t - first, t, d]: one run per patched position
    j = torch.arange(x.shape[0])
    x[j, j + first] = _block_input(clean, i, n)[0, first:]
    twin = fused(model)
    return twin.final_norm(_through(twin, x, i, cancel)[:, -1])  # [t - first, d]


def _patched_heads(model: nn.Module, clean: dict, corrupt: dict, i: int, cancel) -> torch.Tensor:
    """final_norm's output at the last position, [h, d]: run j with head j's clean context (its slice of
    out_proj's input, all positions) in block i."""
    h = model.cfg.n_heads
    twin = fused(model)
    att = twin.trf_blocks[i].att
    clean_context = _split(clean[f"trf_blocks.{i}.att.out_proj"][0], h)[0]  # [1, t, d] -> [h, t, hd]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        context = type(att).attend(att, q, k, v)  # [h runs, h heads, t, hd]: the corrupted run's
        heads = torch.arange(h)
        context[heads, heads] = clean_context  # run j: head j's context from the clean run
        return context
    att.attend = attend
    x = _block_input(corrupt, i, model.cfg.n_layers).repeat(h, 1, 1)  # [h, t, d]
    return twin.final_norm(_through(twin, x, i, cancel)[:, -1])  # [h, d]


def _through(twin: torch.nn.Module, x: torch.Tensor, start: int, cancel) -> torch.Tensor:
    """The blocks from `start` on (start = n_layers: none) of the fused twin, from `x`, their input `[b, t, d]`."""
    for block in twin.trf_blocks[start:]:
        if cancel is not None and cancel.is_set():
            raise TraceCancelled("the trace was cancelled")
        x = block(x)
    return x


# --- every other described model: its own forward, with taps ------------------------------------------

@dataclass(kw_only=True)
class DescribedWhy(Why):
    """A Why of any described model but GPT-2's shape: what grouped-query attention, its norms and experts add."""

    family: str                            # what it is (its config's family, or the description's name)
    groups: list[int]                      # [n_heads]: the key/value group each query head read
    rms: float                             # final_norm's denominator at the last position, frozen (rms, or sigma)
    total: float                           # the sum of the parts (the model's own number is `metric`)
    experts: list[Any] | None = None       # [n_layers]: None, or each token's routed experts [{"expert", "weight"}]
    architecture: str = ""                 # what it is for a reader: the description's name ("Llama 3.2")

    def to_dict(self) -> dict[str, Any]:
        out = {"family": self.family, "architecture": self.architecture, **super().to_dict(), "groups": self.groups, "rms": self.rms, "total": self.total}
        if self.experts is not None:
            out["experts"] = self.experts
        return out


FamilyWhy = DescribedWhy  # its name before why_family.py was merged here


def why_described(model: nn.Module, anatomy: an.Anatomy, tokenizer: Tokenizer, prompt: Prompt,
                  target: int | None = None, versus: str | int | None = None, patch: str | None = None,
                  top_k: int = 10, cancel: threading.Event | None = None) -> DescribedWhy:
    """why() for a model read through its description: the same choices of A, B and the corrupted prompt."""
    ids, out_dim = prompt.ids, anatomy.head.out_features
    label = labeller(model, tokenizer, None)
    with evaluating(model):
        seen, last = record_parts(model, ids, cancel)
        a = int(last.argmax()) if target is None else check_id(target, out_dim, "target")
        b = versus_id(model, tokenizer, versus, None, last, a)
        shares = split_over_sources(model, seen, ids, cancel)
        result = attribute_parts(model, seen, a, b, shares)
        contrast = None
        if b is None:  # why A and not the runner-up: the same sum for the difference
            r = runner_up(last, a)
            contrast = {"versus": {"id": r, "text": label(r), "logit": float(last[r])},
                        "parts": attribute_parts(model, seen, a, r, shares)["parts"]}
        causal = remove_each_rerun(model, seen, ids, last, a, cancel)
        patched = None if patch is None else patch_grid_rerun(model, tokenizer, seen, ids, last, patch, b, label,
                                                             cancel)
    top = last.softmax(-1).topk(min(top_k, out_dim))
    first = next((blk.attention for blk in anatomy.blocks if blk.attention.kind == "causal"), anatomy.blocks[0].attention)
    size = max(1, first.n_heads // first.n_kv_groups)
    linear = any(blk.attention.kind == "linear" for blk in anatomy.blocks)
    return DescribedWhy(
        prompt=tokenizer.decode(ids), tokens=[{"id": i, "text": tokenizer.decode([i])} for i in ids], kind="token",
        target={"id": a, "text": label(a), "logit": float(last[a])},
        versus=None if b is None else {"id": b, "text": label(b), "logit": float(last[b])},
        parts=result["parts"], heads=result["heads"], ff=result["ff"], by_source=result["by_source"],
        sources=sources_of(ids, result["by_source"], causal, tokenizer),
        metric=float(last[a] - (last[b] if b is not None else 0.0)),
        candidates=[{"id": int(i), "text": label(int(i)), "prob": float(p)} for p, i in zip(top.values, top.indices)],
        contrast=contrast, patch=patched,
        notes=([prompt.note] if prompt.note else []) + ([LINEAR_NOT_SPLIT] if linear else []) + [ATTENTION_IS_NOT],
        family=getattr(model.cfg, "family", anatomy.name), architecture=anatomy.name, groups=[j // size for j in range(first.n_heads)],
        rms=result["rms"], total=sum(p["value"] for p in result["parts"]), experts=seen.get("routes"))


class _Stop(Exception):
    """Raised by a tap once a pass has given what it was run for (the head is not run)."""


def _module(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _last_only(model: nn.Module, anatomy: an.Anatomy):
    """A tap on the head that hands it the last position only: `[b, t, d] -> [b, 1, d]` (logits of one row)."""
    return _module(model, anatomy.head.path).register_forward_pre_hook(lambda m, args: (args[0][:, -1:], *args[1:]))


def record_parts(model: nn.Module, ids: list[int], cancel: threading.Event | None) -> tuple[dict, torch.Tensor]:
    """One forward pass, keeping, under the stage names, every position of what the attribution reads: each
    block's input (`trf_blocks.i`) and final_norm's input, the embedding's output (and the learned positions'),
    each attention's output and its write into the stream (`.att`, `.att.write`: after its post-norm, where it
    has one), out_proj's input (the heads' contexts, `.att.out_proj`), the feed-forward's input, output and
    write (`.ff.in`, `.ff`, `.ff.write`), a per-layer input's write (`.per_layer.write`, Gemma 4), and a
    mixture's routes (`routes`: each token's chosen experts and their renormalised weights). Returns (seen, the
    last position's logits [V] in float32)."""
    if cancel is not None and cancel.is_set():
        raise TraceCancelled("the trace was cancelled")
    anatomy, seen = describe(model), {}

    def keep_output(name: str):
        return lambda module, inputs, output: seen.__setitem__(name, output.detach())

    def keep_input(name: str):
        return lambda module, inputs: seen.__setitem__(name, inputs[0].detach())

    part = lambda path: _module(model, path)  # noqa: E731  (the modules, found through the description)
    handles = [part(anatomy.embedding.path).register_forward_hook(keep_output("tok_emb")),
               part(anatomy.final_norm.path).register_forward_pre_hook(keep_input("final_norm")), _last_only(model, anatomy)]
    if anatomy.positions.kind == "learned":
        handles.append(part(anatomy.positions.path).register_forward_hook(keep_output("pos_emb")))
    for i, block in enumerate(anatomy.blocks):
        p, att, ff = f"trf_blocks.{i}", block.attention, block.ff
        handles += [part(block.path).register_forward_pre_hook(keep_input(p)),
                    part(att.path).register_forward_hook(keep_output(f"{p}.att")),
                    part(att.out.path).register_forward_pre_hook(keep_input(f"{p}.att.out_proj")),
                    part(ff.path).register_forward_pre_hook(keep_input(f"{p}.ff.in")),
                    part(ff.path).register_forward_hook(keep_output(f"{p}.ff"))]
        for role, name in (("attn_out", "att"), ("ff_out", "ff")):
            if block.norm(role) is not None:
                handles.append(part(block.norm(role).path).register_forward_hook(keep_output(f"{p}.{name}.write")))
        if block.per_layer_input is not None:  # Gemma 4: its write is the norm on the gated per-layer input
            handles.append(part(block.per_layer_input.norm.path).register_forward_hook(
                keep_output(f"{p}.per_layer.write")))
        if ff.experts is not None:
            handles.append(part(ff.experts.router.path).register_forward_hook(keep_output(f"{p}.ff.router")))
    try:
        batch = torch.tensor([ids], device=_device(model))  # [1, t]
        logits = model(batch)  # [1, 1, V]: the head saw the last position only
    finally:
        for h in handles:
            h.remove()
    for i, block in enumerate(anatomy.blocks):  # without a post-norm, a part's write is its output
        for name in ("att", "ff"):
            seen.setdefault(f"trf_blocks.{i}.{name}.write", seen[f"trf_blocks.{i}.{name}"])
    if any(block.ff.experts is not None for block in anatomy.blocks):
        seen["routes"] = [None if block.ff.experts is None else _routes(seen[f"trf_blocks.{i}.ff.router"][0],
                                                                        block.ff.experts.per_token)
                          for i, block in enumerate(anatomy.blocks)]
    return seen, logits[0, -1].float()


def _routes(scores: torch.Tensor, k: int) -> list[list[dict[str, Any]]]:
    """Each token's chosen experts, best first, with their weights: the softmax over its k largest router scores
    (renormalised over the chosen k, so they sum to 1), as the mixture computes them. scores: `[t, E]`."""
    top, chosen = torch.topk(scores.float(), k, dim=-1)  # [t, k]
    weights = torch.softmax(top, dim=-1)
    return [[{"expert": int(e), "weight": float(w)} for e, w in zip(row_e, row_w)]
            for row_e, row_w in zip(chosen.tolist(), weights.tolist())]


def stream_writes(model: nn.Module, seen: dict, position: int = -1) -> list[tuple[str, torch.Tensor]]:
    """What each part wrote into the residual stream at `position`, `[d]` each, in float64, as it reaches the end:
    the embedding (tok_emb, and pos_emb where positions are learned) and every block's attention, feed-forward
    and per-layer input, each times the blocks' output scales from its block on (gains). Their sum is
    final_norm's input there (tests/test_why_models.py holds it so for every described model)."""
    anatomy = describe(model)
    gain = gains(model, anatomy)
    start = seen["trf_blocks.0"][0, position].double()  # the first block's input: the embedding, scaled, plus positions
    writes = []
    if "pos_emb" in seen:
        pos = seen["pos_emb"].reshape(-1, start.shape[-1])[position].double()  # [t, d] (or [1, t, d])
        writes += [("tok_emb", (start - pos) * gain[0]), ("pos_emb", pos * gain[0])]
    else:
        writes.append(("tok_emb", start * gain[0]))
    for i, block in enumerate(anatomy.blocks):
        names = ("att", "ff") + (("per_layer",) if block.per_layer_input is not None else ())
        writes += [(f"trf_blocks.{i}.{name}", seen[f"trf_blocks.{i}.{name}.write"][0, position].double() * gain[i])
                   for name in names]
    return writes


def gains(model: nn.Module, anatomy: an.Anatomy) -> list[float]:
    """Per block, what multiplies its writes on their way to the end: the product of the output scales of it and
    of every block after it (Gemma 4's layer_scalar; 1.0 where a block has none)."""
    scales = [1.0 if b.output_scale is None else float(getattr(_module(model, b.path), b.output_scale).double())
              for b in anatomy.blocks]
    out, running = [], 1.0
    for scale in reversed(scales):
        running *= scale
        out.append(running)
    return out[::-1]


def frozen_norm(norm: an.Norm, module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """(c, shift, denominator): norm(y) . g = y . c + shift for every y, with the norm's denominator frozen at
    x (`[d]`); g is `[d]`. LayerNorm: scale * (y - mean y) / sigma + shift, and centering is a projection, so
    it moves from y onto c; RMSNorm: w * y / rms, or (1 + w) * y / rms."""
    w = getattr(module, norm.weight).double()
    x = x.double()
    if norm.kind == "layernorm":
        denominator = torch.sqrt(x.var(unbiased=False) + norm.eps)
        v = w * g
        c = (v - v.mean()) / denominator
    else:
        denominator = torch.sqrt(x.pow(2).mean() + norm.eps)
        c = (w if norm.kind == "rmsnorm" else 1 + w) * g / denominator
    shift = 0.0 if norm.bias is None else float(getattr(module, norm.bias).double() @ g)
    return c, shift, float(denominator)


def readout(model: nn.Module, x_last: torch.Tensor, a: int, b: int | None) -> tuple[torch.Tensor, list[dict], float]:
    """(c, constant parts, the frozen denominator): logit[a] - logit[b] = x . c + the constants, for the x at the
    last position (final_norm's input, x_last), through final_norm, out_head, its logit scale and its softcap."""
    anatomy = describe(model)
    head = anatomy.head
    head_module, norm_module = _module(model, head.path), _module(model, anatomy.final_norm.path)
    y = norm_module(x_last.unsqueeze(0))[0].double()  # final_norm's output, by the model's own module
    c, constants, denominator = torch.zeros_like(x_last, dtype=torch.float64), {}, 0.0
    for sign, i in ((1.0, a), (-1.0, b)):
        if i is None:
            continue
        w = head_module.weight[i].double()
        bias = 0.0 if getattr(head_module, "bias", None) is None else float(head_module.bias[i].double())
        scale = head.logit_scale or 1.0
        z = scale * (float(y @ w) + bias)  # the logit before the cap
        ratio = 1.0 if not head.softcap or z == 0 else head.softcap * float(torch.tanh(torch.tensor(z / head.softcap))) / z
        ci, shift, denominator = frozen_norm(anatomy.final_norm, norm_module, x_last, w * scale * ratio)
        c += sign * ci
        constants["final_norm.shift"] = constants.get("final_norm.shift", 0.0) + sign * shift
        constants["out_head.bias"] = constants.get("out_head.bias", 0.0) + sign * scale * ratio * bias
    parts = [{"name": "final_norm.shift", "value": constants["final_norm.shift"]}] if anatomy.final_norm.bias else []
    if getattr(head_module, "bias", None) is not None:
        parts.append({"name": "out_head.bias", "value": constants["out_head.bias"]})
    return c, parts, denominator


def _behind(model: nn.Module, norm: an.Norm | None, y: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The direction a part's output is read along (and the post-norm's shift term): c itself, or through the
    part's post-norm with its denominator frozen at the part's output y (`[d]`)."""
    if norm is None:
        return c, 0.0
    c_in, shift, _ = frozen_norm(norm, _module(model, norm.path), y, c)
    return c_in, shift


def head_layout(att: an.Attention) -> tuple[int, int]:
    """(heads, each head's width in out_proj's input): query heads, or a linear attention's value heads."""
    n = att.state.value_heads if att.kind == "linear" and att.state is not None else att.n_heads
    return n, att.out.in_features // n


def attribute_parts(model: nn.Module, seen: dict, a: int, b: int | None, shares: dict) -> dict[str, Any]:
    """The parts of logit[a] (- logit[b]) at the last position: the embedding, each query head, out_proj's bias,
    each feed-forward (or each routed expert), each per-layer input, the constants; each head split over the
    sources (`shares`: split_over_sources's contexts)."""
    anatomy = describe(model)
    c, constants, denominator = readout(model, seen["final_norm"][0, -1], a, b)
    parts = [{"name": name, "value": float(v @ c)} for name, v in stream_writes(model, seen)
             if name in ("tok_emb", "pos_emb")]
    heads, ff, by_source = [], [], []
    t = seen["trf_blocks.0"].shape[1]
    c_end, gain = c, gains(model, anatomy)
    for i, block in enumerate(anatomy.blocks):
        p, att = f"trf_blocks.{i}", block.attention
        c = c_end * gain[i]  # block i's writes reach the end times the output scales from it on
        n, width = head_layout(att)
        size = max(1, att.n_heads // att.n_kv_groups)
        c_att, shift = _behind(model, block.norm("attn_out"), seen[f"{p}.att"][0, -1], c)
        out = _module(model, att.out.path)
        wc = (out.weight.double().T @ c_att).view(n, width)  # [n, width]: what each context unit adds
        context = seen[f"{p}.att.out_proj"][0, -1].double().view(n, width)  # the model's own contexts
        head_terms = (context * wc).sum(-1)  # [n]
        heads.append([float(x) for x in head_terms])
        parts += [{"name": f"{p}.att.head.{j}", "value": heads[-1][j]}
                  | ({"group": j // size} if att.kind == "causal" else {}) for j in range(n)]
        if getattr(out, "bias", None) is not None:
            parts.append({"name": f"{p}.att.bias", "value": float(out.bias.double() @ c_att)})
        if block.norm("attn_out") is not None and block.norm("attn_out").bias is not None:
            parts.append({"name": f"{p}.att.norm.shift", "value": shift})
        rows = shares.get(i)  # [t, n * width], or None: a linear attention, not split
        by_source.append([[0.0] * t for _ in range(n)] if rows is None else _split_terms(rows, wc).tolist())
        c_ff, ff_shift = _behind(model, block.norm("ff_out"), seen[f"{p}.ff"][0, -1], c)
        ff.append(float(seen[f"{p}.ff"][0, -1].double() @ c_ff) + ff_shift)
        if block.ff.experts is None:
            parts.append({"name": f"{p}.ff", "value": ff[-1]})
        else:
            parts += expert_parts(model, block.ff, seen[f"{p}.ff.in"][0, -1], seen["routes"][i][-1], c_ff, p)
            if ff_shift:
                parts.append({"name": f"{p}.ff.norm.shift", "value": ff_shift})
        if block.per_layer_input is not None:  # Gemma 4: the block's per-layer input, gated, projected and normed
            parts.append({"name": f"{p}.per_layer", "value": float(seen[f"{p}.per_layer.write"][0, -1].double() @ c)})
    return {"parts": parts + constants, "heads": heads, "ff": ff, "by_source": by_source, "rms": denominator}


def _split_terms(contexts: torch.Tensor, wc: torch.Tensor) -> torch.Tensor:
    """Each head's term split over the sources: contexts `[t, n * width]` (source s's share of every head's
    context) times each head's slice of out_proj, `[n, width]` -> `[n, t]`."""
    n, width = wc.shape
    return (contexts.double().view(-1, n, width) * wc).sum(-1).T


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def expert_parts(model: nn.Module, ff: an.FeedForward, x: torch.Tensor, route: list[dict], c: torch.Tensor,
                 p: str) -> list[dict[str, Any]]:
    """Each expert the router chose for the last token as a part: its weight times its output (`[d]`), read
    along c; expert e's matrices are expert 0's paths with e for 0 (anatomy.Experts)."""
    def matrix(lin: an.Linear, e: int) -> nn.Module:
        return _module(model, f"{lin.path.rpartition('.')[0]}.{e}")

    act = ACTIVATIONS[ff.activation]
    parts = []
    for chosen in route:
        e, weight = chosen["expert"], chosen["weight"]
        h = act(matrix(ff.gate, e)(x)) * matrix(ff.up, e)(x)  # [d] -> [m]
        y = matrix(ff.down, e)(h).double()  # [m] -> [d]
        parts.append({"name": f"{p}.ff.expert.{e}", "value": float(weight * (y @ c)), "weight": weight})
    return parts


def split_over_sources(model: nn.Module, seen: dict, ids: list[int], cancel: threading.Event | None) -> dict:
    """Each attention's contexts at the last position split over the sources: {block: `[t, out_proj's in]`}.

    One more pass of t copies of the prompt: every block is fed the clean run's input, and in copy s every
    value projection keeps source s's values alone, so out_proj's input at the last position is source s's share
    (sum_src attn[src] v[src] is linear in the values; the weights come from the unchanged queries and keys).
    A linear attention (a normalised state) is left out. Runs in passes of at most REMOVAL_TOKENS tokens."""
    anatomy = describe(model)
    t, device = len(ids), _device(model)
    causal = [i for i, blk in enumerate(anatomy.blocks) if blk.attention.kind == "causal"]
    if not causal:
        return {}
    got: dict[int, list[torch.Tensor]] = {i: [] for i in causal}
    rows = max(1, REMOVAL_TOKENS // t)
    for start in range(0, t, rows):
        sources = torch.arange(start, min(t, start + rows), device=device)  # copy r keeps source sources[r]
        keep = (torch.arange(t, device=device)[None, :] == sources[:, None]).unsqueeze(-1)  # [r, t, 1]
        handles = [_module(model, anatomy.final_norm.path).register_forward_pre_hook(_raise_stop)]
        for i, block in enumerate(anatomy.blocks):
            handles.append(_module(model, block.path).register_forward_pre_hook(
                _clean_input(seen[f"trf_blocks.{i}"], cancel)))
            if i in causal:
                value = block.attention.value
                handles.append(_module(model, value.path).register_forward_hook(
                    lambda m, inputs, out, rows_=value.rows: _only_source(out, keep, rows_)))
                handles.append(_module(model, block.attention.out.path).register_forward_pre_hook(
                    lambda m, args, i=i: got[i].append(args[0][:, -1].detach())))
        try:
            model(torch.tensor([ids] * len(sources), device=device))
        except _Stop:
            pass
        finally:
            for h in handles:
                h.remove()
    return {i: torch.cat(found) for i, found in got.items()}


def _clean_input(clean: torch.Tensor, cancel: threading.Event | None):
    """A block's forward pre-hook: its input is the clean run's (`[1, t, d]`), in every copy."""
    def feed(module, args):
        _check_cancel(cancel)
        return (clean.repeat(args[0].shape[0], 1, 1), *args[1:])
    return feed


def _raise_stop(module, args):
    raise _Stop


def _check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise TraceCancelled("the trace was cancelled")


def _cancelled(cancel: threading.Event | None):
    """A block's forward pre-hook that stops a re-run once `cancel` is set."""
    return lambda module, args: _check_cancel(cancel)


def _only_source(out: torch.Tensor, keep: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    """A value projection's output with, in copy r, every position but its source zeroed (only the value rows of a
    fused projection: `rows`)."""
    if rows is None:
        return out * keep
    out = out.clone()
    out[..., rows[0]:rows[1]] = out[..., rows[0]:rows[1]] * keep
    return out


def remove_each_rerun(model: nn.Module, seen: dict, ids: list[int], last: torch.Tensor, a: int,
                      cancel: threading.Event | None = None) -> list[dict[str, Any]] | str:
    """The prompt run again without each token: the change in the target's probability and logit.

    The shortened prompts are all t-1 tokens long, so they run as one batch (in batches of at most
    REMOVAL_TOKENS tokens), the head reading their last position only."""
    t = len(ids)
    if t == 1:
        return "the prompt is one token: there is nothing to remove"
    anatomy = describe(model)
    shortened = [ids[:j] + ids[j + 1:] for j in range(t)]
    rows = max(1, REMOVAL_TOKENS // (t - 1))
    logit, prob = [], []
    handles = [_last_only(model, anatomy)] + [_module(model, blk.path).register_forward_pre_hook(_cancelled(cancel))
                                              for blk in anatomy.blocks]
    try:
        for start in range(0, t, rows):
            _check_cancel(cancel)
            batch = torch.tensor(shortened[start:start + rows], device=_device(model))  # [rows, t-1]
            out = model(batch)[:, -1].float()  # [rows, V]
            logit.append(out[:, a])
            prob.append(out.softmax(-1)[:, a])
    finally:
        for h in handles:
            h.remove()
    logit, prob = torch.cat(logit), torch.cat(prob)  # [t]
    p0 = last.softmax(-1)[a]
    return [{"how": "removed", "prob_change": float(prob[j] - p0), "logit_change": float(logit[j] - last[a])}
            for j in range(t)]


def patch_grid_rerun(model: nn.Module, tokenizer: Tokenizer, clean: dict, ids: list[int], last: torch.Tensor,
                     corrupted_text: str, versus: int | None, label, cancel) -> dict[str, Any]:
    """patch_grid's grids, by re-running the model's own forward: the same metric, rows and columns (block
    inputs x positions, then blocks x heads), each value (m_patched - m_corrupted) / (m_clean - m_corrupted)."""
    anatomy = describe(model)
    n = anatomy.n_layers
    bad = corrupted_ids(tokenizer, ids, corrupted_text)
    corrupt, bad_last = record_parts(model, bad, cancel)
    a, b, m_clean, m_bad = patch_pair(last, bad_last, versus, label)
    restored = lambda logits: ((logits[:, a] - logits[:, b]).double() - m_bad) / (m_clean - m_bad)  # noqa: E731
    first = first_difference(ids, bad)
    grid = []
    for i in range(n + 1):  # row i patches block i's input; the last row final_norm's
        path = anatomy.blocks[i].path if i < n else anatomy.final_norm.path
        x_clean = clean[f"trf_blocks.{i}" if i < n else "final_norm"]

        def swap(module, args, x_clean=x_clean):  # run j: position first + j from the clean run
            x = args[0].clone()
            j = torch.arange(x.shape[0], device=x.device)
            x[j, j + first] = x_clean[0, first:]
            return (x, *args[1:])
        grid.append([0.0] * first + restored(_run_patched(model, anatomy, bad, len(bad) - first, path, swap,
                                                          cancel)).tolist())
    heads = []
    for i, block in enumerate(anatomy.blocks):
        n_heads, width = head_layout(block.attention)
        context = clean[f"trf_blocks.{i}.att.out_proj"]  # [1, t, n * width]

        def swap(module, args, context=context, n_heads=n_heads, width=width):  # run j: head j's clean context
            x = args[0].clone().view(n_heads, -1, n_heads, width)  # [runs, t, heads, width]
            runs = torch.arange(n_heads, device=x.device)
            x[runs, :, runs] = context[0].view(-1, n_heads, width).transpose(0, 1)
            return (x.view(n_heads, -1, n_heads * width), *args[1:])
        heads.append(restored(_run_patched(model, anatomy, bad, n_heads, block.attention.out.path, swap,
                                           cancel)).tolist())
    blocks = [f"trf_blocks.{i}" for i in range(n)]
    return {"corrupted": tokenizer.decode(bad), "clean_top": {"id": a, "text": label(a)},
            "versus": {"id": b, "text": label(b)}, "m_clean": m_clean, "m_corrupted": m_bad,
            "blocks": blocks + ["final_norm"], "positions": [tokenizer.decode([i]) for i in ids], "grid": grid,
            "heads": {"blocks": blocks, "grid": heads}}


def _run_patched(model: nn.Module, anatomy: an.Anatomy, ids: list[int], runs: int, path: str, swap,
                 cancel) -> torch.Tensor:
    """The last position's logits `[runs, V]` of `runs` copies of `ids`, with `swap` replacing the input of the
    module at `path` (a forward pre-hook)."""
    handles = [_module(model, path).register_forward_pre_hook(swap), _last_only(model, anatomy)]
    handles += [_module(model, blk.path).register_forward_pre_hook(_cancelled(cancel)) for blk in anatomy.blocks]
    try:
        _check_cancel(cancel)
        return model(torch.tensor([ids] * runs, device=_device(model)))[:, -1].float()
    finally:
        for h in handles:
            h.remove()


def attention_rows(model: nn.Module, ids: list[int]) -> dict[int, torch.Tensor]:
    """The last query's attention weights over the sources `[h, t]` of every (ungated) softmax attention, read
    from the model as split_over_sources reads the shares: copy s's values are 1 at source s and 0 elsewhere."""
    anatomy = describe(model)
    with evaluating(model), torch.inference_mode():
        seen, _ = record_parts(model, ids, None)
        ones = {}
        handles = []
        for i, block in enumerate(anatomy.blocks):
            if block.attention.kind == "causal":
                handles.append(_module(model, block.attention.value.path).register_forward_hook(
                    lambda m, inputs, out: torch.ones_like(out)))
        try:
            contexts = split_over_sources(model, seen, ids, None)
        finally:
            for h in handles:
                h.remove()
        for i, rows in contexts.items():
            n, width = head_layout(anatomy.blocks[i].attention)
            ones[i] = rows.double().view(len(ids), n, width)[..., 0].T  # [h, t]: each unit holds the weight
    return ones

"""Why this token: which parts of the model, and which prompt tokens, made the chosen logit.

    why(model, tokenizer, "Every effort moves you") -> Why

The last position's final vector is final_norm(x), and x is the sum of what every part wrote
into the residual stream: tok_emb, pos_emb, and in each block its attention (one term per
head, each head's slice of out_proj, plus out_proj's bias) and its feed-forward. With
final_norm's scale frozen at that position (its 1 / sqrt(var + eps), as TransformerLens's
`apply_ln_to_stack` freezes it), each logit is an exact sum: one term per part, plus
final_norm's shift and out_head's bias. `parts` lists those terms for logit[target], or for
logit[target] - logit[versus].

Which prompt tokens, two answers, each what it says:
- direct: a head's output at the last position is sum_src attn[src] * (v[src] @ W_O[head]),
  so its term splits exactly over the source tokens (attention weights alone are not this:
  they leave out what each value vector carries and where W_O sends it);
- causal: the prompt with each token removed, run again: the change in the target's
  probability and logit. Only the tokens after the removed one run again, on the clean run's
  keys and values before it, and on the engine's fused kernels.

Activation patching (`patch`, a corrupted prompt of the same length): the clean residual
stream at each (block input, position) copied into the corrupted run, and each head's output
(all positions) likewise; the value is the fraction of the clean logit difference restored.
Everything is computed from one recording of each run (record.py, under the stage names);
the patched runs start from the corrupted run's recorded block inputs.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..adopt import adopt, check_computable
from ..device import evaluating
from ..engine.fused import fused
from ..errors import GlassError, TraceCancelled
from ..kinds import describe
from ..model import GPTModel, attention_weights
from ..prompt import Reading, check_ids, encode, fit_for, reading_line
from ..tokenizer import Tokenizer
from .record import Recorder, record
from .why_family import why_family
from .why_result import (ATTENTION_IS_NOT, Why, check_id, corrupted_ids, first_difference, labeller, patch_pair,
                         runner_up, sources_of, versus_id)

@torch.inference_mode()
def why(model: GPTModel, tokenizer: Tokenizer, text: str | None = None, versus: str | int | None = None,
        patch: str | None = None, *, ids: list[int] | None = None, target: int | None = None,
        labels: list[str] | None = None, top_k: int = 10, cancel: threading.Event | None = None,
        reading: Reading | None = None) -> Why:
    """Attribute the top next token's logit (or `target`'s, an id) to the model's parts and the prompt's tokens.

    versus: a token (text, or an id) to explain logit[target] - logit[versus] instead; a
    classifier is always explained against a second class (the runner-up by default).
    patch: a corrupted prompt with as many tokens, for the activation-patching grids.
    reading: where a classifier reads a text (prompt.Reading; the book's recipe pads), as trace's About says.
    A model whose description (glassgpt.describe) puts the positions inside the attention (RoPE: Qwen3 and
    Llama 3.2, glassgpt's, the book's or transformers') is answered by why_family.py, with the same fields: its parts through RMSNorm, one per query head, each naming the key/value group it read.
    """
    anatomy = describe(model)  # what it is made of; one line for an object of no kind glassgpt reads
    placements = sorted({b.placement for b in anatomy.blocks} - {"pre"})
    if placements:  # the attribution follows each block's residual x + sublayer(norm(x)) (why.py's, why_family.py's)
        raise GlassError(f"why splits the logit over pre-norm blocks; {anatomy.name}'s are {placements[0]}-norm: "
                         "use glassgpt trace (explain) for it")
    check_computable(model, tokenizer if ids is None else None)  # ids given are checked as they are
    cfg = adopt(model).cfg
    ids = check_ids(ids, min(tokenizer.n_vocab, cfg.vocab_size)) if ids is not None else encode(tokenizer, text)
    prompt = fit_for(ids, cfg.context_length, cfg.num_classes, reading)
    model = adopt(model, [prompt.ids])  # a reader's module, read in place; its own logits checked once
    if anatomy.positions.kind != "learned":  # positions inside the attention: the rotary attribution
        return why_family(model, tokenizer, prompt, target=target, versus=versus, patch=patch, top_k=top_k,
                          cancel=cancel)
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


def record_run(model: GPTModel, ids: list[int], cancel: threading.Event | None) -> tuple[dict, torch.Tensor]:
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


def direction(model: GPTModel, x_last: torch.Tensor, a: int, b: int | None) -> tuple[torch.Tensor, float, float]:
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


def attribute(model: GPTModel, seen: dict, ids: list[int], a: int, b: int | None) -> dict[str, Any]:
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
        attn = _last_row_attention(seen, p, h)  # [h, t]
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


def _last_row_attention(seen: dict, p: str, h: int) -> torch.Tensor:
    """The last query's attention weights over the sources, by the model's own formula: [h, t]."""
    q = _split(seen[f"{p}.att.W_query"][:, -1:], h).float()  # [1, h, 1, hd]
    k = _split(seen[f"{p}.att.W_key"], h).float()  # [1, h, t, hd]
    return attention_weights(q, k)[0, :, 0].double()  # the last query sees every source


def remove_each(model: GPTModel, seen: dict, ids: list[int], last: torch.Tensor, a: int,
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


def _run_without(model: GPTModel, seen: dict, ids: list[int], removed: list[int], cancel) -> torch.Tensor:
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
        block.att.attend = _own_attention(seen, f"trf_blocks.{i}.att", spans, t, model.cfg.n_heads, device)
    x = _through(twin, x, 0, cancel)  # [1, T, d]
    ends = [s + t - 2 - j for s, j in spans]  # each shortened prompt's last position in the pack
    return x[0, ends]


def _own_attention(clean: dict, p: str, spans: list, t: int, h: int, device: torch.device):
    """An `attend` for the pack: the context each packed prompt's queries get from the clean run's keys and
    values before its removed token and from its own, by the model's formula, in place of the pack's plain
    causal attention.

    Every shortened prompt has t-1 positions: the clean run's before j, the pack's from j on. Gathered so
    from the two runs (`src`, into their concatenation), the prompts attend as one batch under the usual
    causal mask; `back` picks the pack's positions out again (those before j are the clean run's, unused)."""
    src = torch.tensor([[i if i < j else t + s + i - j for i in range(t - 1)] for s, j in spans], device=device)
    back = torch.tensor([r * (t - 1) + i for r, (s, j) in enumerate(spans) for i in range(j, t - 1)], device=device)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # each [1, h, T, hd]
        q, k, v = (torch.cat([_split(clean[f"{p}.{w}"], h)[0], own[0]], 1)[:, src]
                   for w, own in (("W_query", q), ("W_key", k), ("W_value", v)))  # [h, t + T, hd] -> [h, n, t-1, hd]
        return (attention_weights(q, k) @ v).flatten(1, 2)[:, back].unsqueeze(0)  # [h, n, t-1, hd] -> [1, h, T, hd]
    return attend


def patch_grid(model: GPTModel, tokenizer: Tokenizer, clean: dict, ids: list[int], last: torch.Tensor,
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


def _patched_resid(model: GPTModel, clean: dict, corrupt: dict, i: int, first: int, cancel) -> torch.Tensor:
    """final_norm's output at the last position, [t - first, d]: run j with the clean input of block i at
    position first + j, the rest corrupted."""
    n = model.cfg.n_layers
    bad = _block_input(corrupt, i, n)  # [1, t, d]
    x = bad.repeat(bad.shape[1] - first, 1, 1)  # [t - first, t, d]: one run per patched position
    j = torch.arange(x.shape[0])
    x[j, j + first] = _block_input(clean, i, n)[0, first:]
    twin = fused(model)
    return twin.final_norm(_through(twin, x, i, cancel)[:, -1])  # [t - first, d]


def _patched_heads(model: GPTModel, clean: dict, corrupt: dict, i: int, cancel) -> torch.Tensor:
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

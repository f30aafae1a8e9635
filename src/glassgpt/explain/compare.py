"""Two models on one prompt: their next-token distributions side by side, and how far apart they are.

    compare(model_a, model_b, tokenizer, "Every effort moves you") -> Comparison

For each model: its top-k next tokens with their probability under both models, the logit
lens's top token at the last position after every block, and the head's dot product for its
top token (trace.py, head.py). Between them: the KL divergences KL(A || B) = sum p_A log(p_A /
p_B) and KL(B || A), in nats; 0 when the distributions are the same, and large where one model
is sure of a token the other thinks unlikely. Models whose heads differ (a language model
and a classifier) have no KL: their outputs are not over the same ids.

Every other described model (Qwen3, Llama 3.2, Gemma 3 and 4, OLMo 3, Tiny Aya, Qwen3.5) is compared the
same way, found through its description: its logit lens read through its own final norm and head (with
its logit scale or softcap), and beside a GPT-2 too. Two models whose
tokenizers differ each read the text with their own (`tokenizer_b`): the tokens and the ids
differ, so there is no KL divergence, and a note says so.

Its views (views/compare.py): the text, and the picture of both models' bars, each with the other
model's probability marked.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from .. import anatomy as an
from ..adopt import adopt, check_computable, module_logits
from ..kinds import describe
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


def compare(model_a: nn.Module, model_b: nn.Module, tokenizer: Tokenizer, text: str, about_a: About | None = None,
            about_b: About | None = None, top_k: int = 10, tokenizer_b: Tokenizer | None = None) -> Comparison:
    """Trace `text` through both models and set their next-token distributions side by side. `tokenizer_b`:
    B's own tokenizer, where it is not A's (each model then reads the text its own way)."""
    about_a, about_b = about_a or About("A"), about_b or About("B")
    own = tokenizer_b is not None and not same_tokenizer(tokenizer, tokenizer_b)
    tokenizers = (tokenizer, tokenizer_b if own else tokenizer)
    check_computable(model_a, tokenizers[0])
    check_computable(model_b, tokenizers[1])
    cfgs = adopt(model_a, described=True).cfg, adopt(model_b, described=True).cfg
    limits = [c.context_length for c in cfgs] if own else [min(c.context_length for c in cfgs)] * 2
    keeps = [keep_for(c.num_classes) for c in cfgs] if own else [keep_for(cfgs[0].num_classes)] * 2  # one prompt
    prompts = [fit_prompt(encode(tok, text), limit, keep) for tok, limit, keep in zip(tokenizers, limits, keeps)]
    models = [adopt(m, p.ids, described=True)  # a reader's modules read in place; chapter 4's variants as they are
              for m, p in zip((model_a, model_b), prompts)]
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
    if describe(model).positions.kind != "learned":  # RoPE or none: read through the description
        return _described_run(model, tokenizer, ids, top_k)
    options = TraceOptions(top_k=top_k, logit_lens=True, embedding_check=False)
    tr, last = trace_with_logits(model, tokenizer, ids=ids, options=options, about=about)
    return {"next_token": {k: tr.next_token[k] for k in ("id", "text", "prob")}, "top": tr.next_token["top"],
            "lens_last": [dict(layer["top"][-1], layer=layer["layer"]) for layer in tr.logit_lens["layers"]],
            "head_top": tr.head["rows"][0] if tr.head else None, "layout": tr.model["layout"]}, last


@torch.inference_mode()
def _described_run(model, tokenizer: Tokenizer, ids: list[int], top_k: int) -> tuple[dict[str, Any], torch.Tensor]:
    """_run for a model whose positions are not GPT-2's (Qwen3, Llama, Gemma 3 and 4, OLMo 3, Tiny Aya, Qwen3.5),
    found through its description: the logit lens sends each block's output at the last position through the
    model's own final norm and head (its logit scale and softcap too), as GPT-2's lens does through LayerNorm."""
    anatomy = describe(model)
    blocks = [model.get_submodule(b.path) for b in anatomy.blocks]
    final_norm, out_head = model.get_submodule(anatomy.final_norm.path), model.get_submodule(anatomy.head.path)
    seen: list[torch.Tensor] = []

    def keep(module, inputs, out):  # (transformers' layers may return a tuple)
        seen.append((out[0] if isinstance(out, tuple) else out)[0, -1])

    handles = [block.register_forward_hook(keep) for block in blocks]
    handles.append(final_norm.register_forward_hook(keep))
    try:
        last = module_logits(model, torch.tensor([ids], device=out_head.weight.device))[0, -1].float()  # [V]
    finally:
        for h in handles:
            h.remove()
    *outputs, h = seen[:len(blocks)] + seen[-1:]  # each block's output [d], then the final norm's [d]

    def label(i: int) -> str:  # Qwen3 pads its 151,669 ids to 151,936 rows
        return tokenizer.decode([i]) if i < tokenizer.n_vocab else f"<row {i}: no token>"

    def head(x: torch.Tensor) -> torch.Tensor:  # the model's own head on a [d] vector: [V] logits
        logits = out_head(final_norm(x)).float()
        if anatomy.head.logit_scale is not None:
            logits = logits * anatomy.head.logit_scale
        if anatomy.head.softcap is not None:
            logits = torch.tanh(logits / anatomy.head.softcap) * anatomy.head.softcap
        return logits

    probs = last.softmax(-1)
    top = [{"id": int(i), "text": label(int(i)), "prob": float(p)}
           for p, i in zip(*probs.topk(min(top_k, probs.numel())))]
    lens = []
    for layer, x in enumerate(outputs):
        p = head(x).softmax(-1)  # [d] -> [V]
        j = int(p.argmax())
        lens.append({"id": j, "text": label(j), "prob": float(p[j]), "layer": layer})
    products = head_products(model, h, last, [top[0]["id"]], ids, label)
    cfg = getattr(model, "cfg", None)
    layout = (layout_line(cfg) if getattr(cfg, "family", None) in ("qwen3", "llama3") else
              f"{anatomy.name}: {'out_head tied to tok_emb.weight' if anatomy.head.tied else 'its own out_head (untied)'}")
    return {"next_token": {k: top[0][k] for k in ("id", "text", "prob")}, "top": top, "lens_last": lens,
            "head_top": products["rows"][0], "layout": layout}, last


# --- what changed from GPT-2, read from the two descriptions (anatomy.py) ---------------------------------

PLACEMENT_WORDS = {
    "pre": "pre-norm: x + att(norm1(x)), then x + ff(norm2(x))",
    "post": "post-norm: x + norm(att(x)), then x + norm(ff(x)) (the norms after each sublayer, before the add)",
    "sandwich": "sandwich: a norm before and after att, and before and after ff (four a block)",
    "parallel": "parallel: x + att(norm(x)) + ff(norm(x)), one norm read by both, attention and feed-forward side by side"}
NORM_WORDS = {"layernorm": "LayerNorm: (x - mean) / std * scale + shift",
              "rmsnorm": "RMSNorm: x / rms(x) * weight (no mean, no shift)",
              "rmsnorm_plus_one": "RMSNorm with (1 + weight): x / rms(x) * (1 + weight)"}
FF_WORDS = {"gelu_mlp": "GELU MLP: down(gelu(up(x)))", "swiglu": "SwiGLU: down(silu(gate(x)) * up(x))",
            "geglu": "GeGLU: down(gelu_tanh(gate(x)) * up(x))",
            "moe": "a router picks experts, each a SwiGLU: down(silu(gate(x)) * up(x))"}


@dataclass
class Changes(Result):
    """What changed from GPT-2 to a model (`name`): what_changed's rows, read from the two live models' descriptions."""

    name: str
    rows: list[dict[str, str]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def changes_of(model: nn.Module, gpt2: nn.Module) -> Changes:
    """What changed from the GPT-2 `gpt2` to `model`, any model glassgpt describes (kinds.describe): each row read
    from the two modules' descriptions, so it says what the module holds."""
    anatomy = describe(model)
    return Changes(anatomy.name, what_changed(anatomy, describe(gpt2)))


def what_changed(model: an.Anatomy, gpt2: an.Anatomy) -> list[dict[str, str]]:
    """What `model` does otherwise than GPT-2, one row per change (what, change, gpt2, model), each read from the
    two descriptions: the embedding's scale, the position signal (and layers with none), the norm and where it
    sits, the attention's heads, sliding against full layers and their RoPE bases, linear attention and its state,
    QK-norm, a value norm, layers reusing earlier layers' keys and values, the feed-forward (GeGLU, SwiGLU,
    experts), per-layer inputs, a stored scale on each block's output, the head's tie, its logit scale and its
    softcap."""
    rows: list[dict[str, str]] = []

    def row(what: str, change: str, before: str, after: str) -> None:
        rows.append({"what": what, "change": change, "gpt2": before, "model": after})

    e, g0, blocks = model.embedding, gpt2.blocks[0], model.blocks
    if e.scale:
        row("embedding_scale", "the embedding is scaled", "tok_emb's rows as they are",
            f"tok_emb's rows times sqrt({e.emb_dim}) = {e.scale:.2f}")
    _positions_rows(model, gpt2, row)
    norm, g_norm = model.final_norm, gpt2.final_norm
    if (norm.kind, norm.bias is None) != (g_norm.kind, g_norm.bias is None):
        unshifted = norm.kind == "layernorm" and norm.bias is None
        row("norm", f"the norm: {_norm_name(g_norm)} -> {_norm_name(norm)}", NORM_WORDS[g_norm.kind],
            "LayerNorm without a shift: (x - mean) / std * weight" if unshifted else NORM_WORDS[norm.kind])
    if blocks[0].placement != g0.placement:
        row("placement", f"norm placement: {g0.placement} -> {blocks[0].placement}", PLACEMENT_WORDS[g0.placement],
            PLACEMENT_WORDS[blocks[0].placement])
    _attention_rows(model, gpt2, row)
    if blocks[0].attention.v_norm is not None:
        v = blocks[0].attention.v_norm
        row("value_norm", "the values are normed", "v = x @ W_value",
            "v = x @ W_value, then x / rms(x) per head" + (" (no weight)" if v.weight is None else " times a weight"))
    shared = [b for b in blocks if b.attention.kv_shared_from is not None]
    if shared:
        row("kv_shared", "layers reuse earlier layers' keys and values", "every layer computes and caches its own",
            f"the last {len(shared)} of {model.n_layers} layers compute no keys or values: each attends over the "
            "last earlier layer's of its type, and keeps no cache")
    ff = blocks[0].ff
    if ff.kind != g0.ff.kind:
        experts = ff.experts
        row("experts" if experts else ff.kind, f"feed-forward: {g0.ff.kind} -> {ff.kind}", FF_WORDS[g0.ff.kind],
            FF_WORDS[ff.kind] + (f": {experts.per_token} of {experts.n_experts} experts of width {ff.hidden_dim:,} "
                                 "run for each token, weighted by the router's softmax" if experts else ""))
    pl = e.per_layer_inputs
    if pl is not None:
        row("per_layer_inputs", "per-layer inputs", "one embedding, added once",
            f"a second table [{pl.vocab_size:,}, {pl.n_layers} x {pl.dim}] gives each token a vector of {pl.dim} per "
            "layer, gated, projected and normed into that block's stream")
    if any(b.output_scale is not None for b in blocks):
        row("output_scale", "each block's output is scaled", "x_out = x + att + ff",
            f"x_out = (x + att + ff{' + per-layer input' if pl is not None else ''}) * {blocks[0].output_scale}, "
            "one stored number per block")
    h = model.head
    if h.tied != gpt2.head.tied:
        row("tie", "the head's tie", "out_head is tok_emb (tied)" if gpt2.head.tied else "out_head has its own weights",
            "out_head is tok_emb (tied)" if h.tied else "out_head has its own weights (untied)")
    if h.logit_scale:
        row("logit_scale", "the logits are scaled", "logits = h @ W.T", f"logits = (h @ W.T) * {h.logit_scale:g}")
    if h.softcap:
        row("softcap", "the logits are capped", "logits = h @ W.T",
            f"logits = {h.softcap:g} * tanh((h @ W.T) / {h.softcap:g}): never past +-{h.softcap:g}")
    return rows


def _positions_rows(model: an.Anatomy, gpt2: an.Anatomy, row) -> None:
    attention = [b for b in model.blocks if b.attention.kind != "linear"]
    rotated = [b for b in attention if b.attention.rope is not None]
    if model.positions.kind != gpt2.positions.kind and rotated:
        bases = sorted({b.attention.rope.base for b in rotated})
        partial = {b.attention.rope.rotary_dim for b in rotated} - {None, rotated[0].attention.head_dim}
        scaling = sorted({b.attention.rope.scaling for b in rotated} - {None})
        row("positions", "learned positions -> RoPE",
            f"pos_emb [{gpt2.positions.context_length:,}, {gpt2.embedding.emb_dim:,}] added to the embedding, once",
            f"no pos_emb: RoPE turns q and k inside {len(rotated)} of {model.n_layers} layers (base "
            f"{' and '.join(f'{b:,.0f}' for b in bases)})"
            + (f", on {min(partial)} of each head's {rotated[0].attention.head_dim} dims" if partial else "")
            + (f", {' and '.join(scaling)} frequency scaling" if scaling else ""))
    unrotated = [b for b in attention if b.attention.rope is None]
    if model.positions.kind != "learned" and unrotated:
        row("no_positions", "layers without any position signal", "every position is in the residual (pos_emb)",
            f"{len(unrotated)} {_layer_words(unrotated)} layers have no position signal at all: no RoPE, no pos_emb; "
            "only the causal mask orders the tokens")


def _attention_rows(model: an.Anatomy, gpt2: an.Anatomy, row) -> None:
    g_att = gpt2.blocks[0].attention
    attention = [b.attention for b in model.blocks if b.attention.kind != "linear"]
    if attention and any(a.n_kv_groups != a.n_heads for a in attention):
        a = attention[0]
        row("groups", "multi-head -> grouped-query attention",
            f"{g_att.n_heads} heads, each its own keys and values",
            f"{a.n_heads} query heads share {a.n_kv_groups} key/value head{'s' * (a.n_kv_groups > 1)} of "
            f"{a.head_dim} ({a.n_heads // a.n_kv_groups} query heads a group): a KV cache {a.n_heads // a.n_kv_groups}x "
            "smaller than one head each")
    sliding = [b for b in model.blocks if b.attention.window]
    if sliding:
        full = [b for b in model.blocks if b.attention.kind != "linear" and not b.attention.window]
        bases = lambda bs: ", ".join(sorted({f"RoPE base {b.attention.rope.base:,.0f}" if b.attention.rope  # noqa: E731
                                              else "no RoPE" for b in bs}))
        row("sliding", "sliding and full layers", "every layer attends to every earlier position",
            f"{len(sliding)} sliding layers (window {sliding[0].attention.window:,}; {bases(sliding)}) and "
            f"{len(full)} full layer{'s' * (len(full) != 1)} ({bases(full) if full else 'none'}): a sliding layer's cache keeps its "
            "window only")
    linear = [b.attention for b in model.blocks if b.attention.kind == "linear"]
    if linear:
        a, st = linear[0], linear[0].state
        state = st.value_heads * a.head_dim * st.value_head_dim
        row("linear_attention", "linear attention and its state", "softmax attention over a KV cache that grows "
            "with every token",
            f"{len(linear)} of {model.n_layers} layers are linear attention ({st.rule.replace('_', ' ')} rule): "
            f"a state of [{st.value_heads}, {a.head_dim}, {st.value_head_dim}] ({state:,} numbers) and the last "
            f"{st.conv_kernel - 1} inputs of a short convolution, the same size at any length")
    normed = [a for a in attention if a.q_norm is not None]
    if normed and g_att.q_norm is None:
        a = normed[0]
        row("qk_norm", "QK-norm", "queries and keys as the matrices make them",
            f"each query and key head normed on its own (over hd = {a.head_dim}) before RoPE" if a.q_norm.dim == a.head_dim
            else f"the queries and the keys normed over the whole projection ({a.q_norm.dim:,} and {a.k_norm.dim:,} "
                 "wide, all heads at once) before RoPE")


def _norm_name(n: an.Norm) -> str:
    return {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm", "rmsnorm_plus_one": "RMSNorm (1 + weight)"}[n.kind] + (
        " without a shift" if n.kind == "layernorm" and n.bias is None else "")


def _layer_words(blocks) -> str:
    return " and ".join(dict.fromkeys(b.layer_type.removesuffix("_attention") for b in blocks))

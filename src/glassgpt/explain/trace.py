"""The trace: one prompt's way through the live model, as plain data.

    trace(model, tokenizer, "Every effort moves you") -> Trace

runs the prompt through the model once, with the taps of record.py, and keeps what the real
tensors looked like at each stage: ids [b, t] -> tok_emb [b, t, d] -> + pos_emb [t, d] ->
trf_blocks (one opened up: heads [b, h, t, hd], attention weights [b, h, t, t], feed-forward
[b, t, 4d]) -> final_norm -> out_head logits [b, t, V] -> last position [b, V] -> softmax ->
next token, and the head's logits as dot products (head.py). The two stages where the width
changes are marked `vocab->hidden` (tok_emb) and `hidden->vocab` (out_head; `hidden->classes`
for a classifier), with the weight matrix behind each.

A Trace is data (`to_dict` for JSON); text.py and diagram.py describe it. What to trace is a
`TraceOptions`; what the weights cannot say about the model (its name, random or trained, its
labels) is an `About`. Same shape letters as model.py: b, t, d, h, hd, V.
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from .. import anatomy as an
from ..adopt import adopt, adopted_from, adopted_kind, check_computable, is_added, own_parameters
from ..config import GPTConfig
from ..device import evaluating
from ..errors import PromptError
from ..families import FAMILY_CONFIGS, FamilyConfig
from ..adopt import family_line
from ..formats.source import About, Source  # what the weights cannot tell: a Source's about()
from ..kinds import describe
from ..memory import parameter_table
from ..model import INIT_SCHEMES, GPTModel, LayerNorm, attention_weights, init_name
from ..prompt import Reading, check_ids, encode, fit_for, reading_line
from ..tokenizer import Tokenizer
from ..variants import gpt2_config, kv_bytes_per_token
from .check import check_embedding_is_linear
from .family import FamilyTrace, rotary_trace
from .head import head_products, logit_lens_of  # noqa: F401 (logit_lens_of: read here by earlier callers)
from .notation import trained_line
from .options import TRACE_OPTIONS, TraceOptions, check
from .record import Progress, Recorder, record
from .result import Result, view

VOCAB_TO_HIDDEN = "vocab->hidden"
HIDDEN_TO_VOCAB = "hidden->vocab"
HIDDEN_TO_CLASSES = "hidden->classes"
OPENAI_LAYOUT = "OpenAI's GPT-2 layout: qkv biases, and out_head is tok_emb.weight (tied)"


def trace_options(values: Any, **changes: Any) -> TraceOptions:
    """TraceOptions from an object that holds the options under their names (parsed flags, a web request)."""
    return TraceOptions(**{o.name: getattr(values, o.name) for o in TRACE_OPTIONS if not o.view_only} | changes)


@dataclass
class Stage:
    name: str                       # stable: tokens, tok_emb, pos_emb, embeddings, trf_blocks.N, ...
    module: str                     # what computes it, e.g. "nn.Embedding(50257, 768)"
    shape: list[int]                # the real output tensor's shape
    dtype: str
    weight_shape: list[int] | None = None
    params: int = 0                 # parameters of the module that computes this stage
    transition: str | None = None   # vocab->hidden, hidden->vocab, hidden->classes, or None
    note: str = ""
    parent: str | None = None       # set for the stages inside an opened-up block
    input_shape: list[int] | None = None
    shared_with: str | None = None  # "tok_emb.weight" when out_head's weight is the same tensor


@dataclass
class Trace(Result):
    model: dict[str, Any]
    prompt: str
    tokens: list[dict[str, Any]]
    stages: list[Stage]
    params: dict[str, Any]
    next_token: dict[str, Any]
    head: dict[str, Any] | None = None           # the logits as dot products (head.py)
    embedding_check: dict[str, Any] | None = None
    logit_lens: dict[str, Any] | None = None
    attention: dict[str, Any] | None = None
    modules: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # e.g. what was kept of a prompt over the context

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["stages"] = [{k: v for k, v in asdict(s).items() if v is not None} for s in self.stages]
        return {k: v for k, v in out.items() if v is not None}

    def to_text(self, color: bool = False, attention_layer: int | None = None, heatmap: str | None = None) -> str:
        """The terminal view (views/text.py)."""
        return view(self, "text")(self, color=color, attention_layer=attention_layer, heatmap=heatmap)


# --- the trace --------------------------------------------------------------------

def trace(model: nn.Module, tokenizer: Tokenizer, text: str | None = None, *, ids: list[int] | None = None,
          options: TraceOptions | None = None, about: About | Source | None = None,
          cancel: threading.Event | None = None, progress: Progress | None = None) -> Trace | FamilyTrace:
    """Run `text` (or token `ids`) through `model` once and record every stage from the real tensors.
    (trace_with_logits: the same, and the last position's logits from the same forward pass.)

    model: any model object glassgpt.describe reads (glassgpt's, the book's, nanoGPT's, transformers'),
    read in place. Where its description puts the positions inside the attention (RoPE: Qwen3, Llama 3.2)
    the result is the rotary trace (family.py's FamilyTrace: its stages, heads and groups; `about`,
    `cancel` and `progress` are not read there yet); with learned positions, a Trace.

    ids: token ids instead of text, e.g. a prompt extended one generated token at a time
    (re-encoding the decoded text could merge pieces differently).
    A prompt longer than context_length is cut as prompt.py says, and `Trace.notes` says so.
    cancel: set it from another thread to stop the trace at its next module (raises TraceCancelled).
    progress: called as progress(step, done, total) after each block, lens layer and check.

    Traces of one model may run at the same time in different threads; the model is only read.
    """
    return trace_with_logits(model, tokenizer, text, ids=ids, options=options, about=about, cancel=cancel,
                             progress=progress)[0]


@torch.inference_mode()
def trace_with_logits(model: nn.Module, tokenizer: Tokenizer, text: str | None = None, *,
                      ids: list[int] | None = None, options: TraceOptions | None = None,
                      about: About | Source | None = None,
                      cancel: threading.Event | None = None, progress: Progress | None = None
                      ) -> tuple[Trace | FamilyTrace, torch.Tensor]:
    """trace(...), and the last position's logits `[V]` (or `[classes]`) of its one forward pass."""
    opt, named = options or TraceOptions(), about
    about = about.about() if isinstance(about, Source) else about or About()  # a Source says its About
    anatomy = describe(model)  # what it is made of; one line for an object of no kind glassgpt reads
    check_computable(model, tokenizer if ids is None else None)  # ids given are checked as they are
    cfg = adopt(model, described=True).cfg
    prompt = _prompt(cfg, tokenizer, text, ids, opt, about.reading)
    model = adopt(model, [prompt.ids], described=True)  # a reader's module, read in place; its own logits checked once
    if anatomy.positions.kind != "learned":  # positions inside the attention: its stages are the rotary trace's
        return rotary_trace(model, tokenizer, top_k=opt.top_k, ids=prompt.ids, attention=opt.attention,
                            logit_lens=opt.logit_lens)
    if named is None and adopted_kind(model):
        about = replace(about, name=adopted_kind(model))
    anatomy = describe(model)  # the glass model's parts: their paths are the stage names
    batch = torch.tensor([prompt.ids], device=model.get_submodule(anatomy.embedding.path).weight.device)  # [b=1, t]
    rec = Recorder(_kept_tensors(anatomy, opt), cfg.n_layers * (2 if opt.logit_lens else 1) + opt.embedding_check,
                   cancel, progress)
    with evaluating(model):  # a served model is already in eval mode, so concurrent traces never flip it
        logits = record(model, batch, rec)  # [b, t, V]
    label = _labeller(cfg, tokenizer, about.labels)
    stages = _input_stages(model, anatomy, tokenizer, rec.seen, batch.shape)
    stages += _block_stages(model, anatomy, rec.seen, opt) + _output_stages(model, anatomy, rec.seen, logits, opt)
    probs = _probs(logits[:, -1, :], opt.temperature)  # [b, V]
    top = probs[0].topk(min(opt.top_k, cfg.out_dim))
    top_list = [{"id": int(i), "text": label(int(i)), "prob": float(p)} for p, i in zip(top.values, top.indices)]
    stages.append(_pick_stage(cfg, top_list[0]))
    text = tokenizer.decode(prompt.ids)
    changed = changed_parts(anatomy)
    result = Trace(
        model=model_facts(model, tokenizer, about), prompt=text,
        tokens=[{"id": i, "text": tokenizer.decode([i])} for i in prompt.ids], stages=stages,
        params=_live_params(model) if changed else _params(model),
        next_token=_next_token(cfg, top_list, text, opt.temperature),
        modules=_live_modules(model, anatomy) if changed else parameter_table(model.cfg)["modules"],
        head=head_products(model, rec.seen["final_norm"][0, -1], logits[0, -1], [t["id"] for t in top_list],
                           prompt.ids, label),
        notes=[n for n in (adopted_from(model), prompt.note, reading_line(cfg.num_classes, about.reading, prompt)) if n]
        + ([f"the description's changes from GPT-2: {'; '.join(changed)}", kv_line(cfg, logits.dtype)] if changed else []))
    if opt.attention:
        result.attention = {"shape": [cfg.n_layers, cfg.n_heads, len(prompt.ids), len(prompt.ids)],  # the data's own
                            "tokens": [tk["text"] for tk in result.tokens],
                            "layers": [_attention_of(rec.seen, block)[0].tolist() for block in anatomy.blocks]}
    if opt.logit_lens:
        result.logit_lens = logit_lens_of(model, [rec.seen[block.path][1] for block in anatomy.blocks], logits, label,
                                          rec.step)
    if opt.embedding_check:
        rec.check()
        result.embedding_check = check_embedding_is_linear(model, batch, timing=opt.timing)
        rec.step("embedding_check")
    return result, logits[0, -1]


def _prompt(cfg: GPTConfig, tokenizer: Tokenizer, text: str | None, ids: list[int] | None, opt: TraceOptions,
            reading: Reading | None):
    """The ids to trace, cut to context_length as every command cuts them (and a classifier's padded as
    it was trained); the options checked."""
    ids = check_ids(ids, min(tokenizer.n_vocab, cfg.vocab_size)) if ids is not None else encode(tokenizer, text)
    if not 0 <= opt.block < cfg.n_layers:
        raise PromptError(f"block {opt.block} does not exist: choose 0..{cfg.n_layers - 1}")
    if not 0 < opt.temperature < math.inf:
        raise PromptError(f"temperature must be a positive number for the probabilities, got {opt.temperature}")
    check(TRACE_OPTIONS, opt)
    return fit_for(ids, cfg.context_length, cfg.num_classes, reading)


def _kept_tensors(anatomy: an.Anatomy, opt: TraceOptions) -> frozenset[str]:
    """The taps whose tensors this trace keeps: the flow, the opened block, and the attention asked for."""
    opened = anatomy.blocks[opt.block]
    ff = opened.ff
    keep = {anatomy.embedding.path, anatomy.positions.path, "embeddings", anatomy.final_norm.path,
            *(n.path for n in opened.norms), ff.up.path, ff.activation_path, ff.down.path}
    if ff.experts is not None:  # a mixture of experts: the router's scores and the whole feed-forward
        keep.update((ff.path, ff.experts.router.path))
    for block in anatomy.blocks:
        keep.add(block.path)
        if opt.attention or block.index == opt.block:
            att = block.attention
            keep.update(lin.path for lin in (att.query, att.key, att.value, att.out, att.latent) if lin)
    return frozenset(keep - {None})


def changed_parts(anatomy: an.Anatomy) -> list[str]:
    """What a model's description changes in GPT-2's attention and feed-forward (chapter 4's variants), one
    phrase each; empty for GPT-2's own parts, whose trace is GPT-2's unchanged."""
    changed: dict[str, None] = {}
    for block in anatomy.blocks:
        att, ff = block.attention, block.ff
        if att.n_kv_groups != att.n_heads:
            changed[f"{att.n_kv_groups} key/value groups shared by {att.n_heads} query heads"] = None
        if att.latent is not None:
            changed[f"keys and values made from a cached {att.latent.out_features}-wide latent"] = None
        if att.window is not None:
            windows = [b.index for b in anatomy.blocks if b.attention.window is not None]
            changed[f"a window of {att.window} in layers {', '.join(map(str, windows))} (the others full)"] = None
        if ff.experts is not None:
            changed[f"{ff.experts.n_experts} experts, {ff.experts.per_token} per token"] = None
    return list(changed)


def kv_line(cfg: GPTConfig, dtype: torch.dtype) -> str:
    """A variant's KV-cache bytes per token at a full context, beside GPT-2's of the same shape."""
    mine, gpt2 = kv_bytes_per_token(cfg, dtype), kv_bytes_per_token(gpt2_config(cfg), dtype)
    return (f"KV cache: {mine:,.0f} bytes per token ({_dtype(torch.empty(0, dtype=dtype))}, at "
            f"{cfg.context_length:,} tokens) where GPT-2 of this shape keeps {gpt2:,.0f} ({mine / gpt2:.0%})")


def _live_params(model: nn.Module) -> dict[str, Any]:
    """The totals from the live module (a variant's parts are not GPT-2's table): parameters() yields a tied matrix once."""
    total = own_parameters(model)
    untied = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    return {"total": total, "total_untied": untied, "tied": untied != total}


def _live_modules(model: nn.Module, anatomy: an.Anatomy) -> list[dict[str, Any]]:
    """parameter_table's rows, counted on the live module: the embeddings, the blocks, the final norm, the head."""
    part, n = model.get_submodule, anatomy.n_layers
    rows = [{"name": p, "shape": str(list(part(p).weight.shape)), "params": own_parameters(part(p)), "note": ""}
            for p in (anatomy.embedding.path, anatomy.positions.path) if p]
    per_block = own_parameters(part(anatomy.blocks[0].path))
    rows.append({"name": f"{anatomy.blocks_path} (x{n})", "shape": "", "params": own_parameters(part(anatomy.blocks_path)),
                 "note": f"{per_block:,} in block 0"})
    rows += [{"name": p, "shape": str(list(part(p).weight.shape if hasattr(part(p), "weight") else part(p).scale.shape)),
              "params": own_parameters(part(p)), "note": ""} for p in (anatomy.final_norm.path, anatomy.head.path)]
    return rows


def _params(model: GPTModel) -> dict[str, Any]:
    """The totals with and without tying; for a reader's module built without some biases, its own
    tensors only (the zeros glassgpt added are not its parameters), and a note that says so."""
    table = parameter_table(model.cfg)
    params = {"total": table["total"], "total_untied": table["total_untied"], "tied": table["tied"]}
    added = model.num_parameters() - own_parameters(model)
    if added:
        params.update(total=params["total"] - added, total_untied=params["total_untied"] - added,
                      note=f"the module's own tensors: not the {added:,} zero biases glassgpt added where it has none")
    return params


def _labeller(cfg: GPTConfig, tokenizer: Tokenizer, labels: list[str] | None):
    if cfg.num_classes is None:
        return lambda i: tokenizer.decode([i])
    return lambda i: labels[i] if labels and i < len(labels) else f"class {i}"


def model_facts(model: GPTModel, tokenizer: Tokenizer, about: About) -> dict[str, Any]:
    """What a trace says of its model: its name, config, dtype, layout, a random model's initialisation,
    and which parts its training run trained and left frozen."""
    cfg = model.cfg
    emb = model.get_submodule(describe(model).embedding.path).weight
    facts = {"name": about.name, "random_weights": about.random_weights, "config": cfg.to_dict(),
             "dtype": _dtype(emb), "device": str(emb.device),
             "tokenizer": tokenizer.name, "n_vocab": tokenizer.n_vocab, "labels": about.labels,
             "layout": layout_line(cfg), "notes": list(about.notes)}
    if about.random_weights and init_name(about.init or "") in INIT_SCHEMES:
        facts["init"] = INIT_SCHEMES[init_name(about.init)]
    if about.trained:  # as the run that finetuned it recorded
        facts["trained"] = {"parts": about.trained, "line": trained_line(about.trained)}
    return facts


def layout_line(cfg: GPTConfig | FamilyConfig) -> str:
    """Which layout the parameters follow, in one short line: OpenAI's GPT-2, the book's, or between (or a
    Qwen3/Llama model's shapes)."""
    if isinstance(cfg, FAMILY_CONFIGS):
        return f"{cfg.family}: {family_line(cfg)}"
    bias = "qkv biases" if cfg.qkv_bias else "no qkv biases"
    if cfg.num_classes is not None:
        return f"a classifier: out_head [{cfg.num_classes}, {cfg.emb_dim}] with a bias in place of the vocabulary head; {bias}"
    if cfg.qkv_bias and cfg.tie_embeddings:
        return OPENAI_LAYOUT
    head = "out_head tied to tok_emb.weight" if cfg.tie_embeddings else "its own out_head (untied)"
    whose = "the book's layout (GPT_CONFIG_124M)" if not cfg.qkv_bias and not cfg.tie_embeddings else "not OpenAI's layout"
    return f"{whose}: {bias}, {head}; OpenAI's GPT-2 has qkv biases and ties out_head to tok_emb.weight"


# --- stages -------------------------------------------------------------------------

def _module_name(module: nn.Module) -> str:
    if isinstance(module, nn.Embedding):
        return f"nn.Embedding({module.num_embeddings}, {module.embedding_dim})"
    if isinstance(module, nn.Linear):
        bias = "" if module.bias is not None and not is_added(module.bias) else ", bias=False"
        return f"nn.Linear({module.in_features}, {module.out_features}{bias})"
    if isinstance(module, LayerNorm):
        return f"LayerNorm({module.scale.shape[0]})"
    if isinstance(module, nn.GELU):
        return f"nn.GELU(approximate={module.approximate!r})"
    return type(module).__name__


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _tensor_stage(name: str, module: str, t: torch.Tensor, **kw: Any) -> Stage:
    return Stage(name=name, module=module, shape=list(t.shape), dtype=_dtype(t), **kw)


def _weight_stage(name: str, module: nn.Module, out: torch.Tensor, **kw: Any) -> Stage:
    weight = getattr(module, "weight", None)
    return _tensor_stage(name, _module_name(module), out, weight_shape=list(weight.shape) if weight is not None else None,
                         params=own_parameters(module), **kw)


def _input_stages(model: nn.Module, anatomy: an.Anatomy, tokenizer: Tokenizer, seen: dict, bt: torch.Size) -> list[Stage]:
    """tokens -> tok_emb (vocab -> hidden) -> pos_emb -> embeddings."""
    cfg, (b, t) = model.cfg, bt
    emb, pos = anatomy.embedding.path, anatomy.positions.path
    pieces = "one id per character" if tokenizer.name == "char" else "one id per BPE piece"
    return [
        Stage("tokens", f"tokenizer ({tokenizer.name}, {tokenizer.n_vocab:,} tokens)", [b, t], "int64", note=pieces),
        _weight_stage(emb, model.get_submodule(emb), seen[emb], transition=VOCAB_TO_HIDDEN, input_shape=[b, t],
                      note=f"each id selects one row of the [{cfg.vocab_size}, {cfg.emb_dim}] weight "
                           "(= one_hot(ids) @ W)"),
        _weight_stage(pos, model.get_submodule(pos), seen[pos], input_shape=[t],
                      note=f"one learned row per position 0..{t - 1}, the same for every sequence"),
        _tensor_stage("embeddings", f"{emb} + {pos}, then drop_emb (Dropout p={cfg.drop_rate})",
                      seen["embeddings"], note="[t, d] broadcasts over the batch"),
    ]


def _block_stages(model: nn.Module, anatomy: an.Anatomy, seen: dict, opt: TraceOptions) -> list[Stage]:
    """One stage per block; the opened block's inside follows it."""
    stages = []
    for block in anatomy.blocks:
        x_in, x_out = seen[block.path]
        stages.append(_tensor_stage(block.path, "TransformerBlock", x_out,
                                    params=own_parameters(model.get_submodule(block.path)), input_shape=list(x_in.shape),
                                    note=f"x + att(norm1(x)), then x + ff(norm2(x)): the width stays "
                                         f"{model.cfg.emb_dim}"))
        if block.index == opt.block:
            stages += _opened_block(model, block, seen)
    return stages


def _attention_of(seen: dict, block: an.Block) -> torch.Tensor:
    """A block's attention weights from its tapped projections, by the model's own formula: [b, h, t, t]."""
    att = block.attention
    q, k = seen[att.query.path].float(), seen[att.key.path].float()
    b, t, _ = q.shape
    q = q.view(b, t, att.n_heads, att.head_dim).transpose(1, 2)  # [b, t, d] -> [b, h, t, hd]
    k = _heads(k, att.n_kv_groups, att.head_dim).repeat_interleave(att.n_heads // att.n_kv_groups, dim=1)
    attn = attention_weights(q, k)
    if att.window is not None:  # the causal softmax kept to the last `window` positions, renormalised:
        pos = torch.arange(t, device=attn.device)  # the same as a softmax over the window alone
        attn = attn * ((pos[:, None] - pos[None, :]) < att.window)
        attn = attn / attn.sum(dim=-1, keepdim=True)
    return attn


def _heads(x: torch.Tensor, n: int, hd: int) -> torch.Tensor:
    b, t, _ = x.shape
    return x.view(b, t, n, hd).transpose(1, 2)  # [b, t, n * hd] -> [b, n, t, hd]


def _opened_block(model: nn.Module, block: an.Block, seen: dict) -> list[Stage]:
    """The inside of one block, each stage from its tapped tensor, each module found through the description."""
    p, att, ff, part = block.path, block.attention, block.ff, model.get_submodule
    norm1, norm2 = block.norm("attn_in").path, block.norm("ff_in").path
    q = seen[att.query.path]
    b, t, d = q.shape
    h, hd = att.n_heads, att.head_dim
    attn = _attention_of(seen, block)
    context_in, out_proj_out = seen[att.out.path]
    v = _heads(seen[att.value.path].float(), att.n_kv_groups, hd).repeat_interleave(h // att.n_kv_groups, dim=1)
    # The recomputed weights must reproduce what the model gave out_proj: a check, not a decoration.
    attn_error = float(((attn @ v).transpose(1, 2).reshape(b, t, d) - context_in.float()).abs().max())
    inside = [_weight_stage(norm1, part(norm1), seen[norm1][1], parent=p)]
    if att.latent is not None:  # latent attention: what the cache keeps, and what keys and values are made from
        inside.append(_weight_stage(att.latent.path, part(att.latent.path), seen[att.latent.path], parent=p,
                                    note=f"the latent [b, t, {att.latent.out_features}]: all the KV cache keeps of "
                                         f"this token, where GPT-2 keeps a key and a value of {d} each"))
    for lin, what in ((att.query, "queries"), (att.key, "keys"), (att.value, "values")):
        made = f" from the latent" if att.latent is not None and lin is not att.query else ""
        inside.append(_weight_stage(lin.path, part(lin.path), seen[lin.path], parent=p, note=what + made,
                                    input_shape=[b, t, lin.in_features] if made else None))
    g, window = att.n_kv_groups, att.window
    inside.append(Stage(f"{att.path}.heads", "view + transpose", [b, h, t, hd], _dtype(q), parent=p, input_shape=[b, t, d],
                        note=f"q, k, v each split into {h} heads of {hd}" if g == h else f"q split into {h} heads of {hd}"))
    if g != h:
        inside.append(Stage(f"{att.path}.kv_heads", f"view + transpose, repeat_interleave({h // g})", [b, g, t, hd],
                            _dtype(q), parent=p, input_shape=[b, t, g * hd],
                            note=f"k and v split into {g} groups of {hd} (what the cache keeps), each repeated for its "
                                 f"{h // g} query heads -> [b, {h}, t, {hd}]"))
    rows = "tokens 0..j" if window is None else f"tokens max(0, j - {window - 1})..j, its window of {window}"
    mask = "causal mask" if window is None else f"causal mask, window {window}"
    inside += [
        _tensor_stage(f"{att.path}.attn_weights", f"softmax(q @ k.T / sqrt({hd}) + {mask})", attn, parent=p,
                      note=f"row j: how much token j attends to {rows} (rows sum to 1; "
                           f"matches the model's own to {attn_error:.1e})"),
        _tensor_stage(f"{att.path}.context", "attn_weights @ v, heads merged", context_in, parent=p,
                      input_shape=[b, h, t, hd], note="[b, h, t, hd] -> [b, t, d]"),
        _weight_stage(att.out.path, part(att.out.path), out_proj_out, parent=p),
        _tensor_stage(f"{p}.shortcut1", "x + att(norm1(x))", seen[norm2][0], parent=p,
                      note="residual connection (what norm2 reads)"),
        _weight_stage(norm2, part(norm2), seen[norm2][1], parent=p),
    ]
    if ff.experts is not None:
        inside += _expert_stages(part, ff, seen, p)
    else:
        inside += [
            _weight_stage(ff.up.path, part(ff.up.path), seen[ff.up.path][1], parent=p,
                          note=f"expand to {ff.hidden_dim // d} x {d} = {ff.hidden_dim}"),
            _weight_stage(ff.activation_path, part(ff.activation_path), seen[ff.activation_path][1], parent=p),
            _weight_stage(ff.down.path, part(ff.down.path), seen[ff.down.path][1], parent=p, note=f"project back to {d}"),
        ]
    inside.append(_tensor_stage(f"{p}.shortcut2", "x + ff(norm2(x))", seen[p][1], parent=p,
                                note="residual connection; the block's output"))
    return inside


def _expert_stages(part, ff: an.FeedForward, seen: dict, p: str) -> list[Stage]:
    """A mixture of experts: the router's scores, the k experts each token is routed to, their weighted sum."""
    ex, (x, out) = ff.experts, seen[ff.path]
    scores = seen[ex.router.path]  # [b, t, E]
    top = scores.topk(ex.per_token, dim=-1)
    chosen = top.indices  # [b, t, k]
    per_token = " ".join("+".join(map(str, c)) for c in chosen[0].tolist())
    counts = torch.bincount(chosen.flatten(), minlength=ex.n_experts).tolist()
    return [
        _weight_stage(ex.router.path, part(ex.router.path), scores, parent=p,
                      note=f"one score per expert, {ex.n_experts} experts"),
        Stage(f"{ff.path}.routing", f"topk(scores, {ex.per_token}), softmax over the {ex.per_token}", list(chosen.shape),
              "int64", parent=p, input_shape=list(scores.shape),
              note=f"experts per token: {per_token}; tokens per expert: {counts}"),
        _tensor_stage(ff.path, f"{type(part(ff.path)).__name__} ({ex.n_experts} experts, each down({ff.activation}(gate(x)) * up(x)))", out,
                      parent=p, input_shape=list(x.shape), params=own_parameters(part(ff.path)),
                      note=f"each token: its {ex.per_token} experts' outputs ({x.shape[-1]} -> {ff.hidden_dim} -> "
                           f"{x.shape[-1]}) weighted by their probabilities"),
    ]


def _output_stages(model: nn.Module, anatomy: an.Anatomy, seen: dict, logits: torch.Tensor,
                   opt: TraceOptions) -> list[Stage]:
    """final_norm -> out_head (hidden -> vocab, or classes) -> last_logits -> probs."""
    cfg, norm, head, emb = model.cfg, anatomy.final_norm.path, anatomy.head.path, anatomy.embedding.path
    final, last = seen[norm], logits[:, -1, :]
    is_classifier = cfg.num_classes is not None
    per = "class" if is_classifier else "vocabulary entry"
    tied = f"; W is the same tensor as {emb}.weight (weight tying)" if anatomy.head.tied else ""
    return [
        _weight_stage(norm, model.get_submodule(norm), final),
        _weight_stage(head, model.get_submodule(head), logits,
                      transition=HIDDEN_TO_CLASSES if is_classifier else HIDDEN_TO_VOCAB, input_shape=list(final.shape),
                      shared_with=f"{emb}.weight" if anatomy.head.tied else None,
                      note=f"logits = x @ W.T: one score per {per} at every position{tied}"),
        _tensor_stage("last_logits", "logits[:, -1, :]", last,
                      note="the class is read from the last position, the only one that has seen the whole text"
                      if is_classifier else "only the last position's logits predict what comes next"),
        Stage("probs", f"softmax(last_logits / {opt.temperature:g})", list(last.shape), "float32",
              note=f"{cfg.out_dim:,} probabilities that sum to 1"),
    ]


def _pick_stage(cfg: GPTConfig, chosen: dict) -> Stage:
    if cfg.num_classes is not None:
        return Stage("label", "argmax over the classes", [1], "int64", note=f"id {chosen['id']} -> {chosen['text']!r}")
    return Stage("next_token", "argmax (greedy; sampling would draw from probs)", [1], "int64",
                 note=f"id {chosen['id']} -> {chosen['text']!r}")


def _next_token(cfg: GPTConfig, top: list[dict], text: str, temperature: float) -> dict[str, Any]:
    chosen, is_classifier = top[0], cfg.num_classes is not None
    return {"top": top, "id": chosen["id"], "text": chosen["text"], "prob": chosen["prob"],
            "kind": "class" if is_classifier else "token", "temperature": temperature,
            "text_after": text + ("" if is_classifier else chosen["text"])}


def _probs(last: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(last / temperature) in float32 `[b, V]`; refuses scores that would make it NaN."""
    if not torch.isfinite(last).all():
        raise PromptError("the model's scores (logits) are not finite (NaN or inf): its weights are broken, "
                          "e.g. saved by a training run that diverged; load an earlier checkpoint")
    scaled = last.float() / temperature
    if not torch.isfinite(scaled).all():
        largest = float(last.float().abs().max())
        raise PromptError(f"temperature {temperature:g} is too small: last_logits / {temperature:g} overflows float32 "
                          f"(the largest |logit| is {largest:.3g}); use {max(largest, 1.0) / 1e37:.0e} or more "
                          "(a temperature this small already puts all the probability on the top token)")
    return scaled.softmax(dim=-1)

"""The trace: one prompt's way through the live model, as plain data.

    trace(model, tokenizer, "Every effort moves you") -> Trace

runs the prompt through the model once, with the taps of record.py, and keeps what the real
tensors looked like at each stage: ids [b, t] -> tok_emb [b, t, d] -> + pos_emb [t, d] ->
trf_blocks (one opened up: heads [b, h, t, hd], attention weights [b, h, t, t], feed-forward
[b, t, 4d]) -> final_norm -> out_head logits [b, t, V] -> last position [b, V] -> softmax ->
next token, and the head's logits as dot products (head.py). The two stages where the width
changes are marked `vocab->hidden` (tok_emb) and `hidden->vocab` (out_head; `hidden->classes`
for a classifier), with the weight matrix behind each.

A model whose positions enter inside the attention (RoPE: Qwen3, Llama 3.2, Gemma 3, Qwen3.5, OLMo 3, Tiny
Aya, Gemma 4) gets the rotary trace at the end of this file, the same Trace type holding its stages, the four
answers, the key/value groups and RoPE, under the same options. The modules, sizes and formulas come from the
model's description (anatomy.py) and formulas.py, never from a model file. A Trace is data (`to_dict` for JSON); text.py and diagram.py describe it. What to trace is a
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
from ..adopt import adopt, adopted_from, adopted_kind, check_computable, family_line, is_added, own_parameters
from ..config import INIT_SCHEMES, FamilyConfig, GPTConfig, init_name
from ..device import evaluating
from ..errors import GlassError, PromptError
from ..formats.source import About, Source  # what the weights cannot tell: a Source's about()
from ..kinds import describe
from ..memory import parameter_table
from ..prompt import Reading, check_ids, encode, fit_for, reading_line
from ..tokenizer import Tokenizer
from ..variants import gpt2_config, kv_bytes_per_token
from .check import check_embedding_is_linear
from .formulas import attention_weights, rope_tables, rotate
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
    dtype: str = ""                 # (the rotary flow's stages say none)
    weight_shape: list[int] | None = None
    params: int = 0                 # parameters of the module that computes this stage
    transition: str | None = None   # vocab->hidden, hidden->vocab, hidden->classes, or None
    note: str = ""
    parent: str | None = None       # set for the stages inside an opened-up block
    input_shape: list[int] | None = None
    shared_with: str | None = None  # "tok_emb.weight" when out_head's weight is the same tensor

    def __getitem__(self, key: str) -> Any:
        """stage["name"], as a rotary trace's stages were read when they were dicts."""
        return getattr(self, key)


ROTARY_ONLY = ("positions", "weights", "answers", "block", "temperature")  # not in a learned-positions trace's JSON


@dataclass
class Trace(Result):
    """One prompt's way through any model glassgpt.describe reads, the result of both paths.

    `positions` (the description's: "learned", "rope" or "none") says which flow `stages` holds: with learned
    positions, tok_emb + pos_emb and every module of the opened block; with positions inside the attention, the
    rotary flow (ids, tok_emb, queries, keys and values, the groups, ff, final_norm, out_head), its heads and
    where positions enter in `attention`, its four answers in `answers`. The rest reads alike for both: the
    model's facts, the tokens, the next token and its top_k, the head's dot products, the logit lens, the notes."""

    model: dict[str, Any]
    prompt: str
    tokens: list[dict[str, Any]]
    stages: list[Stage]
    params: dict[str, Any]
    next_token: dict[str, Any]
    head: dict[str, Any] | None = None           # the logits as dot products (head.py)
    embedding_check: dict[str, Any] | None = None
    logit_lens: dict[str, Any] | None = None
    attention: dict[str, Any] | None = None      # learned: the weights, when asked; rotary: the heads and RoPE
    modules: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # e.g. what was kept of a prompt over the context
    positions: str = "learned"
    weights: dict[str, Any] | None = None        # rotary: the attention weights, when asked (learned: `attention`)
    answers: dict[str, Any] | None = None        # rotary: the four questions, as facts
    block: int = 0                               # the block opened up (rotary: whose shapes the stages show)
    temperature: float = 1.0                     # what the last logits were divided by before the softmax
    experts: dict[str, Any] | None = None        # rotary, a mixture: the opened block's routing, token by token

    @property
    def rotary(self) -> bool:
        """Positions enter inside the attention (RoPE: Qwen3, Llama 3.2, ...), not as a learned pos_emb."""
        return self.positions != "learned"

    @property
    def attention_weights(self) -> dict[str, Any] | None:
        """Every layer's attention weights, when asked: shape [n_layers, h, t, t], tokens, layers (and groups)."""
        return self.weights if self.rotary else self.attention

    @property
    def next_tokens(self) -> list[dict[str, Any]]:
        """The top_k next tokens, most probable first: id, text, prob."""
        return self.next_token["top"]

    @property
    def family(self) -> str | None:
        return self.model.get("family")

    @property
    def config(self) -> dict[str, Any]:
        return self.model["config"]

    @property
    def about(self) -> dict[str, Any]:
        """What the weights cannot tell: name, random_weights, notes."""
        return {k: self.model.get(k) for k in ("name", "random_weights", "notes")}

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    def to_dict(self) -> dict[str, Any]:
        """The JSON: each kind with the keys its page and the CLI read (a rotary trace's as its own part, named)."""
        out = asdict(self)
        if self.rotary:
            return {"family": self.family, "config": out["model"]["config"], "tokens": [t["text"] for t in self.tokens],
                    "stages": [{k: s[k] for k in ("name", "module", "shape", "note")} for s in out["stages"]],
                    "attention": out["attention"], "answers": out["answers"], "params": out["params"],
                    "next_tokens": out["next_token"]["top"], "head": out["head"], "logit_lens": out["logit_lens"],
                    "attention_weights": out["weights"], "about": self.about, "block": self.block,
                    "temperature": self.temperature, "notes": out["notes"]}
        out["stages"] = [{k: v for k, v in asdict(s).items() if v is not None} for s in self.stages]
        return {k: v for k, v in out.items() if v is not None and k not in ROTARY_ONLY}

    def to_text(self, color: bool = False, attention_layer: int | None = None, heatmap: str | None = None) -> str:
        """The terminal view (views/text.py)."""
        return view(self, "text")(self, color=color, attention_layer=attention_layer, heatmap=heatmap)


# --- the trace --------------------------------------------------------------------

def trace(model: nn.Module, tokenizer: Tokenizer, text: str | None = None, *, ids: list[int] | None = None,
          options: TraceOptions | None = None, about: About | Source | None = None,
          cancel: threading.Event | None = None, progress: Progress | None = None) -> Trace:
    """Run `text` (or token `ids`) through `model` once and record every stage from the real tensors.
    (trace_with_logits: the same, and the last position's logits from the same forward pass.)

    model: any model object glassgpt.describe reads (glassgpt's, the book's, nanoGPT's, transformers'),
    read in place. Where its description puts the positions inside the attention (RoPE: Qwen3, Llama 3.2, ...)
    the Trace holds the rotary flow (below: its stages, heads and groups, under the same options, `about`,
    `cancel` and `progress`); with learned positions, GPT-2's.

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
                      ) -> tuple[Trace, torch.Tensor]:
    """trace(...), and the last position's logits `[V]` (or `[classes]`) of its one forward pass."""
    opt, named = options or TraceOptions(), about
    about = about.about() if isinstance(about, Source) else about or About()  # a Source says its About
    anatomy = describe(model)  # what it is made of; one line for an object of no kind glassgpt reads
    check_computable(model, tokenizer if ids is None else None)  # ids given are checked as they are
    cfg = adopt(model, described=True).cfg
    prompt = _prompt(cfg, tokenizer, text, ids, opt, about.reading)
    model = adopt(model, [prompt.ids], described=True)  # a reader's module, read in place; its own logits checked once
    if named is None and adopted_kind(model):
        about = replace(about, name=adopted_kind(model))
    if anatomy.positions.kind != "learned":  # positions inside the attention: its stages are the rotary trace's
        result, last = rotary_trace(model, tokenizer, ids=prompt.ids, options=opt, about=about, cancel=cancel,
                                    progress=progress)
        result.notes = [n for n in (adopted_from(model), prompt.note) if n]
        return result, last
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
        + ([f"the description's changes from GPT-2: {'; '.join(changed)}", kv_line(cfg, logits.dtype)] if changed else []),
        block=opt.block, temperature=opt.temperature)
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


def _params(model: nn.Module) -> dict[str, Any]:
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


def model_facts(model: nn.Module, tokenizer: Tokenizer, about: About) -> dict[str, Any]:
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
    if not isinstance(cfg, GPTConfig):  # a rotary model's config (Qwen3's, Llama's, Gemma 3's)
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

def _module_name(module: nn.Module, norm: an.Norm | None = None) -> str:
    """How the module is built, in one call: torch's own modules by their arguments, a norm by its description."""
    if norm is not None and norm.kind == "layernorm":
        return f"LayerNorm({norm.dim})"
    if isinstance(module, nn.Embedding):
        return f"nn.Embedding({module.num_embeddings}, {module.embedding_dim})"
    if isinstance(module, nn.Linear):
        bias = "" if module.bias is not None and not is_added(module.bias) else ", bias=False"
        return f"nn.Linear({module.in_features}, {module.out_features}{bias})"
    if isinstance(module, nn.GELU):
        return f"nn.GELU(approximate={module.approximate!r})"
    return type(module).__name__


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _tensor_stage(name: str, module: str, t: torch.Tensor, **kw: Any) -> Stage:
    return Stage(name=name, module=module, shape=list(t.shape), dtype=_dtype(t), **kw)


def _weight_stage(name: str, module: nn.Module, out: torch.Tensor, norm: an.Norm | None = None, **kw: Any) -> Stage:
    weight = getattr(module, "weight", None)
    return _tensor_stage(name, _module_name(module, norm), out, weight_shape=list(weight.shape) if weight is not None else None,
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
    """A block's attention weights from its tapped projections, by the formula its description states (the
    scale, the causal edge, a window): [b, h, t, t]."""
    att = block.attention
    q, k = seen[att.query.path].float(), seen[att.key.path].float()
    b, t, _ = q.shape
    q = q.view(b, t, att.n_heads, att.head_dim).transpose(1, 2)  # [b, t, d] -> [b, h, t, hd]
    k = _heads(k, att.n_kv_groups, att.head_dim).repeat_interleave(att.n_heads // att.n_kv_groups, dim=1)
    return attention_weights(att, q, k)


def _heads(x: torch.Tensor, n: int, hd: int) -> torch.Tensor:
    b, t, _ = x.shape
    return x.view(b, t, n, hd).transpose(1, 2)  # [b, t, n * hd] -> [b, n, t, hd]


def _opened_block(model: nn.Module, block: an.Block, seen: dict) -> list[Stage]:
    """The inside of one block, each stage from its tapped tensor, each module found through the description."""
    p, att, ff, part = block.path, block.attention, block.ff, model.get_submodule
    n1, n2 = block.norm("attn_in"), block.norm("ff_in")
    norm1, norm2 = n1.path, n2.path
    q = seen[att.query.path]
    b, t, d = q.shape
    h, hd = att.n_heads, att.head_dim
    attn = _attention_of(seen, block)
    context_in, out_proj_out = seen[att.out.path]
    v = _heads(seen[att.value.path].float(), att.n_kv_groups, hd).repeat_interleave(h // att.n_kv_groups, dim=1)
    # The recomputed weights must reproduce what the model gave out_proj: a check, not a decoration.
    attn_error = float(((attn @ v).transpose(1, 2).reshape(b, t, d) - context_in.float()).abs().max())
    inside = [_weight_stage(norm1, part(norm1), seen[norm1][1], n1, parent=p)]
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
        _weight_stage(norm2, part(norm2), seen[norm2][1], n2, parent=p),
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
        _weight_stage(norm, model.get_submodule(norm), final, anatomy.final_norm),
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


# --- positions inside the attention (RoPE: Qwen3, Llama 3.2, Gemma 3, Qwen3.5, OLMo 3, Tiny Aya) ---------
# What it records, from the real tensors of one forward pass (record.py's taps, and a recording cache that
# the attention hands its rotated keys and values to): ids [b, t] -> tok_emb [b, t, d] (no pos_emb is added)
# -> each block's queries [b, h, t, hd] and keys/values [b, g, t, hd], shared by h // g query heads ->
# final_norm -> out_head logits [b, t, V] -> the next token. Then the four answers for this model: where V
# becomes d and back, the one-hot proof on the live weights (check.py), the weight shapes, and whether the
# head is tied, told by storage (`data_ptr`), never by equal values: the book's loader copies the embedding
# into the head, which gives equal values in two tensors. Beside the flow, as for GPT-2: the head's logits as
# dot products (head.py), the logit lens, and with `attention` every query head's causal weights, from its
# queries through QK-norm and RoPE against the rotated keys of the group it reads (`attention_of`), checked
# against what each layer's own attention gave its out projection.

FAMILY_NAMES = {"qwen3": "Qwen3", "llama3": "Llama 3", "gemma3": "Gemma 3", "qwen3_5": "Qwen3.5", "olmo3": "OLMo 3",
                "tiny_aya": "Tiny Aya", "gemma4": "Gemma 4"}


FamilyTrace = Trace  # the rotary trace's result, by its earlier name: one type for every model


class RecordingCache:
    """What GroupedQueryAttention hands a KV cache: its rotated keys and values, kept to be read."""

    def __init__(self) -> None:
        self.pos, self.seen = 0, {}

    def layer(self, i: int) -> "RecordingCache._Layer":
        return RecordingCache._Layer(self, i)

    def advance(self, t: int) -> None:
        self.pos += t

    class _Layer:
        def __init__(self, cache: "RecordingCache", i: int):
            self.cache, self.i = cache, i

        def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.cache.seen[self.i] = (k.detach(), v.detach())
            return k, v

        def read(self) -> tuple[None, None]:
            """A linear attention's convolution inputs and state (Qwen3.5): none before the first token."""
            return None, None

        def write(self, conv: torch.Tensor, state: torch.Tensor) -> None:
            """(one forward pass from position 0: the state it ends with is not read again)"""


def family_trace(model: nn.Module, tokenizer: Tokenizer, text: str | None = None, top_k: int = 5, *,
                 ids: list[int] | None = None, attention: bool = False, logit_lens: bool = False) -> Trace:
    """Run `text` (or its token `ids`, as the web page sends them) through a Qwen3Model or Llama3Model once
    and keep what each stage looked like; with `attention`, every query head's weights, with `logit_lens`, the
    top token after every block (as GPT-2's trace takes them: TraceOptions' attention and logit_lens)."""
    opt = TraceOptions(top_k=top_k, attention=attention, logit_lens=logit_lens)
    return rotary_trace(model, tokenizer, text, ids=ids, options=opt)[0]


@torch.inference_mode()
def rotary_trace(model: nn.Module, tokenizer: Tokenizer, text: str | None = None, *, ids: list[int] | None = None,
                 options: TraceOptions | None = None, about: About | None = None,
                 cancel: threading.Event | None = None, progress: Progress | None = None
                 ) -> tuple[Trace, torch.Tensor]:
    """family_trace(...) under every TraceOptions (top_k, temperature, block, logit_lens, attention,
    embedding_check), `about`, `cancel` and `progress` as trace() reads them; and the last position's logits
    `[V]` of its one forward pass. The modules and sizes are found through the model's description, not by its
    family."""
    opt, about = options or TraceOptions(), about or About()
    cfg, anatomy = model.cfg, describe(model)
    if opt.attention:
        _check_weights_traceable(anatomy)
    device = model.get_submodule(anatomy.embedding.path).weight.device
    ids = torch.tensor([encode(tokenizer, text) if ids is None else ids], device=device)  # [1, t]
    opened = anatomy.blocks[opt.block]
    # the block whose keys and values are read: the opened one, or the first with any (Qwen3.5's linear-attention
    # blocks keep a state, no keys)
    keyed = opt.block if opened.attention.kind == "causal" else _first_causal(anatomy)
    att = anatomy.blocks[keyed].attention
    keep = {anatomy.embedding.path, anatomy.final_norm.path, anatomy.head.path, att.query.path, att.key.path,
            _ff_in(opened.ff).path}
    keep |= {block.path for block in anatomy.blocks} if opt.logit_lens else set()
    keep |= {p for block in anatomy.blocks for p in (block.attention.query.path, block.attention.out.path)
             } if opt.attention else set()
    rec = Recorder(frozenset(keep), anatomy.n_layers * (2 if opt.logit_lens else 1) + opt.embedding_check, cancel,
                   progress)
    cache = RecordingCache()
    with evaluating(model):
        logits = record(model, ids, rec, cache=cache)  # [1, t, V]
    seen = rec.seen
    k, v = cache.seen[keyed if att.kv_shared_from is None else att.kv_shared_from]  # [1, g, t, hd], rotated (a kv-shared
    # layer keeps none: it reads its source layer's)
    b, t = ids.shape
    # the sizes as the description gives them, from a block with keys and values (every such block has the same;
    # Qwen3.5's linear-attention blocks have sizes of their own)
    h, g, V, n_layers = att.n_heads, att.n_kv_groups, anatomy.embedding.vocab_size, anatomy.n_layers
    q_shape = (b, h, t, att.head_dim)
    label = lambda i: _text(tokenizer, i)  # noqa: E731
    probs = _probs(logits[:, -1, :], opt.temperature)[0]  # [V]
    top = probs.topk(min(opt.top_k, V))
    next_tokens = [{"id": int(i), "text": label(int(i)), "prob": float(p)} for p, i in zip(top.values, top.indices)]
    tokens = [{"id": int(i), "text": tokenizer.decode([int(i)])} for i in ids[0]]
    groups = [j // (h // g) for j in range(h)]
    tr = _rotary_result(model, tokenizer, about, opt, ids, tokens, next_tokens)
    tr.stages = [Stage(**stage) for stage in _rotary_stages(anatomy, att, opened.ff, seen, q_shape, list(k.shape),
                                                            linear_stages(anatomy, b))]
    tr.attention = _heads_and_positions(anatomy, att, q_shape, list(k.shape)) | _opened_kind(anatomy, opened, keyed)
    if opened.ff.experts:
        tr.experts = routed_experts(opened.ff, seen[opened.ff.experts.router.path][0], tokens)
    tr.head = head_products(model, seen[anatomy.final_norm.path][0, -1], logits[0, -1],
                            [n["id"] for n in next_tokens], ids[0].tolist(), label)
    if opt.logit_lens:  # each block's output through this model's final_norm (RMSNorm) and out_head
        tr.logit_lens = logit_lens_of(model, [seen[block.path][1] for block in anatomy.blocks], logits, label,
                                      rec.step)
    if opt.attention:
        tr.weights = {"shape": [n_layers, h, t, t], "tokens": [tk["text"] for tk in tokens], "groups": groups,
                      "layers": _attention_layers(model, anatomy, seen, cache.seen)}
    if opt.embedding_check:
        rec.check()
        tr.answers["one_hot"] = tr.embedding_check = check_embedding_is_linear(model, ids, timing=False)
        rec.step("embedding_check")
    return tr, logits[0, -1]


def _rotary_result(model: nn.Module, tokenizer: Tokenizer, about: About, opt: TraceOptions, ids: torch.Tensor,
                   tokens: list[dict[str, Any]], next_tokens: list[dict[str, Any]]) -> Trace:
    """The rotary trace's Trace before its stages, heads and panels: the model's facts, the tokens, the next token
    and its top_k, the parameters, the four answers (the one-hot proof added where asked)."""
    cfg, text = model.cfg, tokenizer.decode(ids[0].tolist())
    return Trace(
        model={"name": about.name, "random_weights": about.random_weights, "notes": list(about.notes),
               "family": cfg.family, "config": cfg.to_dict()},
        prompt=text, tokens=tokens, stages=[], params=parameter_table(cfg),
        next_token={"top": next_tokens, **next_tokens[0], "kind": "token", "temperature": opt.temperature,
                    "text_after": text + next_tokens[0]["text"]},
        positions=describe(model).positions.kind, answers=four_answers(model, ids, one_hot=False), block=opt.block,
        temperature=opt.temperature)


def _check_weights_traceable(anatomy: an.Anatomy) -> None:
    """Refuse, in one line, the attention weights attention_of cannot compute for this model."""
    linear = [block.index for block in anatomy.blocks if block.attention.kind == "linear"]
    if linear:  # Qwen3.5's Gated DeltaNet layers: a state, no weights over the positions
        raise GlassError(f"{anatomy.name}'s layers {', '.join(map(str, linear))} are linear attention (a state, no "
                         "attention weights over the positions): trace it without --attention")


def _heads_and_positions(anatomy: an.Anatomy, att: an.Attention, q_shape: tuple, kv_shape: list[int]
                         ) -> dict[str, Any]:
    """The heads (q and k/v shapes, which query heads share each key/value group) and where positions enter (the
    RoPE base of a full layer, its scaling, QK-norm, the sliding layers, which layers and dimensions RoPE turns)."""
    h, g = att.n_heads, att.n_kv_groups
    ropes = [blk.attention.rope for blk in anatomy.blocks if blk.attention.rope is not None]
    full = [blk.attention.rope for blk in anatomy.blocks if blk.attention.rope is not None and blk.attention.window is None]
    rope = (full or ropes or [None])[0]  # a full layer's (Gemma 3's sliding layers have a base of their own)
    return {"q_shape": list(q_shape), "kv_shape": kv_shape, "group_size": h // g,
            "groups": [list(range(j * (h // g), (j + 1) * (h // g))) for j in range(g)],
            "qk_norm": att.q_norm is not None, **_qk_norm_span(att), "rope_base": rope.base if rope else None,
            "rope_scaled": any(r.scaling is not None for r in ropes), **_sliding_layers(anatomy),
            **rope_reach(anatomy), **_kv_shared(anatomy)}


def _opened_kind(anatomy: an.Anatomy, opened: an.Block, keyed: int) -> dict[str, Any]:
    """Whether every block's attention is alike (kind, window, RoPE and its base), and what the opened one is:
    "linear", "sliding" or "full", with or without RoPE, and the block whose keys and values the table shows."""
    def kind(att: an.Attention) -> tuple:
        return att.kind, att.window, None if att.rope is None else (att.rope.base, att.rope.rotary_dim, att.rope.scaling)
    att = opened.attention
    return {"blocks_alike": len({kind(block.attention) for block in anatomy.blocks}) == 1,
            "opened": {"kind": "linear" if att.kind == "linear" else "sliding" if att.window is not None else "full",
                       "window": att.window, "rope": att.rope is not None, "keyed_block": keyed}}


def _qk_norm_span(att: an.Attention) -> dict[str, Any]:
    """What the QK-norm spans, from the widths of its norms: each head (`head_dim` wide: Qwen3, Gemma) or the whole
    projection at once (h*hd and g*hd wide: OLMo 3's, before the split into heads); {} without QK-norm."""
    if att.q_norm is None:
        return {}
    per_head = att.q_norm.dim == att.head_dim
    return {"qk_norm_per_head": per_head, "qk_norm_dims": [att.q_norm.dim, att.k_norm.dim if att.k_norm else None]}


def _ff_in(ff: an.FeedForward) -> an.Linear:
    """The feed-forward's first matrix whose output every token passes: a mixture's router (an expert may see no
    token), else the gate (SwiGLU, GeGLU) or the up projection."""
    return ff.experts.router if ff.experts else ff.gate or ff.up


def _kv_shared(anatomy: an.Anatomy) -> dict[str, Any]:
    """The layers that reuse another layer's keys and values (Gemma 4's last num_kv_shared_layers), each with its
    source layer, and the RoPE scalings by name ("proportional": Gemma 4's partial RoPE); {} for neither."""
    shared = {b.index: b.attention.kv_shared_from for b in anatomy.blocks if b.attention.kv_shared_from is not None}
    ropes = [b.attention.rope for b in anatomy.blocks if b.attention.rope is not None]
    scalings = sorted({rope.scaling for rope in ropes if rope.scaling})
    partial = [rope for rope in ropes if rope.scaling == "proportional"]
    return ({"kv_shared_from": shared} if shared else {}) | ({"rope_scalings": scalings} if scalings else {}) | (
        {"proportional_dims": [partial[0].rotary_dim, partial[0].head_dim]} if partial else {})


def _sliding_layers(anatomy: an.Anatomy) -> dict[str, Any]:
    """Which layers see only a window (Gemma 3's, OLMo 3's and Tiny Aya's sliding layers), the window and their own
    RoPE base; {} if none."""
    sliding = [b for b in anatomy.blocks if b.attention.window is not None]
    if not sliding:
        return {}
    rope = sliding[0].attention.rope
    return {"sliding_layers": [b.index for b in sliding], "window": sliding[0].attention.window,
            "rope_local_base": rope.base if rope is not None else None}


def _attention_layers(model: nn.Module, anatomy: an.Anatomy, seen: dict, seen_kv: dict) -> list:
    """Every layer's `[h, t, t]` weights (as lists), from its recorded W_query output and the rotated keys its cache
    was handed (a kv-shared layer's: its source layer's), each by its own description (RoPE base, window, scale);
    each checked against the context its own attention gave the out projection."""
    layers = []
    for block in anatomy.blocks:
        att = block.attention
        k, v = seen_kv[att.kv_shared_from if att.kv_shared_from is not None else block.index]  # [b, g, s, hd]
        attn = attention_of(model, att, seen[att.query.path], k)  # [b, h, t, s]
        if att.output_gate is None:  # (a gated context is not the weights' alone)
            _check_context(anatomy, block.index, attn, v, seen[att.out.path][0])
        layers.append(attn[0].tolist())
    return layers


def _check_context(anatomy: an.Anatomy, i: int, attn: torch.Tensor, v: torch.Tensor, context: torch.Tensor) -> None:
    """Refuse weights that do not give the context the layer's own attention handed its out projection `[b, t, h*hd]`:
    the description does not say how this attention weighs its positions."""
    b, h, t, _ = attn.shape
    mine = (attn @ v.float().repeat_interleave(h // v.shape[1], dim=1)).transpose(1, 2).reshape(b, t, -1)  # [b, t, h*hd]
    error, size = float((mine - context.float()).abs().max()), max(1.0, float(context.float().abs().max()))
    if not error <= (1e-4 if context.dtype in (torch.float32, torch.float64) else 3e-2) * size:
        raise GlassError(f"{anatomy.name}'s layer {i}: the attention weights its description gives do not reproduce "
                         f"its own attention (max difference {error:.3g}): trace it without --attention")


def rope_reach(anatomy: an.Anatomy) -> dict[str, Any]:
    """Which layers RoPE turns, and how many of a head's dimensions (Qwen3.5: the full layers, 64 of 256; Tiny Aya:
    the sliding layers only, its full layers have no positions)."""
    turned = [block for block in anatomy.blocks if block.attention.rope is not None]
    linear = [block.index for block in anatomy.blocks if block.attention.kind == "linear"]
    unturned = [block.index for block in anatomy.blocks if block.attention.kind != "linear"
                and block.attention.rope is None]  # Tiny Aya's full layers: no position signal at all
    others = {"linear_layers": linear, "unrotated_layers": unturned}
    if not turned:
        return {"rope_layers": [], **others}
    rope = turned[0].attention.rope
    windows = {block.attention.window is not None for block in turned}
    return {"rope_layers": [block.index for block in turned], "rope_dims": rope.rotary_dim or rope.head_dim,
            "rope_layer_kind": ("sliding" if windows == {True} else "full" if windows == {False} else None), **others}


def linear_stages(anatomy: an.Anatomy, b: int) -> list[dict[str, Any]]:
    """The linear-attention blocks (Qwen3.5's Gated DeltaNet), from the description: what they keep in place of
    keys and values. None for a model without them."""
    linear = [block for block in anatomy.blocks if block.attention.kind == "linear"]
    if not linear:
        return []
    att, state = linear[0].attention, linear[0].attention.state
    return [{"name": "linear attention", "module": att.path, "shape": [b, state.value_heads, att.head_dim,
                                                                      state.value_head_dim],
             "note": f"{len(linear)} of {anatomy.n_layers} blocks (layers {', '.join(str(x.index) for x in linear)}) "
                     f"keep no keys or values: a causal convolution over {state.conv_kernel} tokens, then a state "
                     f"[{att.head_dim}, {state.value_head_dim}] per value head, decayed and corrected by the gated "
                     "delta rule at each token; the same size at any length"}]


def _first_causal(anatomy: an.Anatomy) -> int:
    """The first block with keys and values (Qwen3.5's first three are linear attention: a state, no keys)."""
    return next(i for i, block in enumerate(anatomy.blocks) if block.attention.kind == "causal")


def _rotary_stages(anatomy: an.Anatomy, att: an.Attention, ff: an.FeedForward, seen: dict, q_shape: tuple,
                   kv_shape: list[int], linear: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stages in the order the forward pass ran them, with the shapes the taps saw in the opened block (`att`:
    its attention, or the first with keys and values), the sizes and kinds from the model's description."""
    b, h, t, hd = q_shape
    g, d, V = att.n_kv_groups, anatomy.embedding.emb_dim, anatomy.embedding.vocab_size
    ff_in = seen[_ff_in(ff).path]  # the router's output; a gate's or up's (input, output)
    scale = anatomy.embedding.scale
    return [
        {"name": "ids", "module": "", "shape": [b, t], "note": "token ids"},
        {"name": "tok_emb", "module": "tok_emb", "shape": list(seen[anatomy.embedding.path].shape),
         "note": f"vocab -> hidden: row lookup in the {[V, d]} weight"
                 + (f", times sqrt({d}) = {scale:.2f}" if scale is not None else "") + "; no pos_emb is added"},
        {"name": "queries", "module": "trf_blocks.N.att.W_query", "shape": list(q_shape),
         "note": f"{list(seen[att.query.path].shape)} split into {h} heads, "
                 + ("RoPE-rotated" if att.rope is not None else "not rotated (this layer has no RoPE)")},
        {"name": "keys, values", "module": "trf_blocks.N.att.W_key, W_value", "shape": kv_shape,
         "note": f"{list(seen[att.key.path].shape)} split into {g} heads; the cache keeps these"},
        {"name": "repeat_interleave", "module": "", "shape": list(q_shape),
         "note": f"each key/value head serves {h // g} neighbouring query heads"},
        *linear,  # Qwen3.5's linear-attention blocks, where it has them
        {"name": "ff", "module": "trf_blocks.N.ff", "shape": list((ff_in if ff.experts else ff_in[1]).shape),
         "note": _ff_note(ff, d)},
        {"name": "final_norm", "module": "final_norm", "shape": list(seen[anatomy.final_norm.path].shape),
         "note": {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}.get(anatomy.final_norm.kind, anatomy.final_norm.kind)},
        {"name": "out_head", "module": "out_head", "shape": list(seen[anatomy.head.path].shape),
         "note": f"hidden -> vocab: x @ W.T with W {[V, d]}"},
    ]


def routed_experts(ff: an.FeedForward, scores: torch.Tensor, tokens: list[dict[str, Any]]) -> dict[str, Any]:
    """Which experts each token ran in a mixture, from its router's scores `[t, n_experts]`: the top `per_token`
    (largest first), each weighted by the softmax over the chosen scores alone (they sum to 1, as the glass
    mixture weighs them)."""
    top = scores.float().topk(ff.experts.per_token, dim=-1)  # [t, k]
    weights = torch.softmax(top.values, dim=-1)  # [t, k]
    return {"module": ff.path, "n_experts": ff.experts.n_experts, "per_token": ff.experts.per_token,
            "tokens": [{"text": tk["text"], "experts": ids, "weights": w}
                       for tk, ids, w in zip(tokens, top.indices.tolist(), weights.tolist())]}


def _ff_note(ff: an.FeedForward, d: int) -> str:
    """The feed-forward in one line, from its description: a mixture's routing, GeGLU's or SwiGLU's formula."""
    if ff.experts:
        return (f"router gate: {ff.experts.n_experts} expert scores; each token runs its top {ff.experts.per_token} "
                f"SwiGLU experts, {d} -> {ff.hidden_dim} -> {d}, weighted by the softmax of their scores")
    name = {"geglu": "GeGLU", "swiglu": "SwiGLU"}.get(ff.kind, ff.kind)
    return f"{name}: fc3({ff.activation}(fc1(x)) * fc2(x)), {d} -> {ff.hidden_dim} -> {d}"


def attention_of(model: nn.Module, att: an.Attention, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Attention weights `[b, h, tq, s]` in float32, by the layer's description: the queries `q` (W_query's output
    `[b, tq, h*hd]`, the last tq of the s positions) through the layer's own QK-norm module (over each head, or
    over the whole projection as OLMo 3's) and the described RoPE, against the rotated keys a cache is handed
    (`[b, g, s, hd]`), each query head reading its group's (repeat_interleave)."""
    b, tq, _ = q.shape
    h, hd, s = att.n_heads, att.head_dim, k.shape[-2]
    q_norm = model.get_submodule(att.q_norm.path) if att.q_norm is not None else None
    if q_norm is not None and att.q_norm.dim != hd:  # the whole projection, before it is split into heads
        q = q_norm(q)
    q = q.view(b, tq, h, hd).transpose(1, 2)  # [b, tq, h*hd] -> [b, h, tq, hd]
    if q_norm is not None and att.q_norm.dim == hd:
        q = q_norm(q)
    q = q.float()
    if att.rope is not None:
        cos, sin = (table[s - tq:].float().to(q.device) for table in rope_tables(att.rope, s))  # [tq, rotary_dim]
        q = rotate(q, cos, sin, att.rope.pairs)
    k = k.float().repeat_interleave(h // k.shape[1], dim=1)  # [b, g, s, hd] -> [b, h, s, hd]
    return attention_weights(att, q, k)


def _text(tokenizer: Tokenizer, token_id: int) -> str:
    """The token's text; a row of tok_emb past the tokenizer's ids (Qwen3 pads 151,669 ids to 151,936 rows) says so."""
    return tokenizer.decode([token_id]) if token_id < tokenizer.n_vocab else f"<row {token_id}: no token>"


def four_answers(model: nn.Module, ids: torch.Tensor, one_hot: bool = True) -> dict[str, Any]:
    """The four questions as facts on the live model: the two transitions, the one-hot proof (None where
    `one_hot` is off: TraceOptions' embedding_check), the tie."""
    anatomy = describe(model)
    emb, head = model.get_submodule(anatomy.embedding.path).weight, model.get_submodule(anatomy.head.path).weight
    one_storage = emb.data_ptr() == head.data_ptr() and emb.shape == head.shape
    equal_values = bool(emb.shape == head.shape and torch.equal(emb, head))
    return {"vocab_to_hidden": {"module": anatomy.embedding.path, "weight_shape": list(emb.shape)},
            "hidden_to_vocab": {"module": anatomy.head.path, "weight_shape": list(head.shape)},
            "one_hot": check_embedding_is_linear(model, ids, timing=False) if one_hot else None,
            "tied": one_storage, "equal_values": equal_values}


# --- what changed from GPT-2 (explain --compare gpt2) ---------------------------------------------

def _count(*modules_or_params) -> int:
    """Parameters of these modules and tensors, each tensor once (a tied one is one tensor)."""
    unique = {}
    for m in modules_or_params:
        for p in (m.parameters() if isinstance(m, nn.Module) else [m]):
            unique[id(p)] = p
    return sum(p.numel() for p in unique.values())


def _shapes(module: nn.Module) -> str:
    return ", ".join(f"{name or 'weight'} {list(p.shape)}" for name, p in module.named_parameters())


@dataclass
class GPT2Changes(Result):
    """What changed from GPT-2 to a Qwen3/Llama model: one row per stage, with both models' shapes and counts."""

    family: str
    rows: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def changes_from_gpt2(model: nn.Module, gpt2: nn.Module) -> GPT2Changes:
    """GPT-2 and a Qwen3/Llama model stage by stage, in the order of the book's GPT-to-Llama bonus chapter
    (ch05/07_gpt_to_llama), with shapes and parameter counts read from the two live models."""
    g_blk, f_blk = gpt2.trf_blocks[0], model.trf_blocks[0]
    g_att, f_att = g_blk.att, f_blk.att
    n_g, n_f = len(gpt2.trf_blocks), len(model.trf_blocks)
    cfg = model.cfg
    g_norms = [m for blk in gpt2.trf_blocks for m in (blk.norm1, blk.norm2)] + [gpt2.final_norm]
    f_norms = [m for blk in model.trf_blocks for m in (blk.norm1, blk.norm2)] + [model.final_norm]
    rows = [
        {"change": "LayerNorm -> RMSNorm", "gpt2": f"norm1: {_shapes(g_blk.norm1)} (subtracts the mean, adds a shift)",
         "family": f"norm1: {_shapes(f_blk.norm1)} (divides by the root mean square only, in float32)",
         "gpt2_params": _count(*g_norms), "family_params": _count(*f_norms)},
        {"change": "GELU -> SwiGLU",
         "gpt2": f"ff.layers.0 {list(g_blk.ff.layers[0].weight.shape)}, GELU, ff.layers.2 "
                 f"{list(g_blk.ff.layers[2].weight.shape)}, with biases",
         "family": f"silu(fc1 {list(f_blk.ff.fc1.weight.shape)}) * fc2 {list(f_blk.ff.fc2.weight.shape)}, then fc3 "
                   f"{list(f_blk.ff.fc3.weight.shape)}, no biases",
         "gpt2_params": n_g * _count(g_blk.ff), "family_params": n_f * _count(f_blk.ff)},
        {"change": "pos_emb -> RoPE", "gpt2": f"pos_emb {list(gpt2.pos_emb.weight.shape)} added to tok_emb's output",
         "family": f"no weights: cos/sin tables {list(model.rope.cos.shape)} rotate q and k inside every attention",
         "gpt2_params": _count(gpt2.pos_emb), "family_params": 0},
        {"change": "multi-head -> grouped-query attention",
         "gpt2": f"{g_att.n_heads} heads: W_query {list(g_att.W_query.weight.shape)}, W_key "
                 f"{list(g_att.W_key.weight.shape)}, W_value {list(g_att.W_value.weight.shape)}",
         "family": f"{cfg.n_heads} query heads, {cfg.n_kv_groups} key/value heads: W_query "
                   f"{list(f_att.W_query.weight.shape)}, W_key {list(f_att.W_key.weight.shape)}, W_value "
                   f"{list(f_att.W_value.weight.shape)}",
         "gpt2_params": n_g * _count(g_att), "family_params": n_f * _count(f_att.W_query, f_att.W_key, f_att.W_value,
                                                                            f_att.out_proj)},
        {"change": "QK-norm", "gpt2": "none",
         "family": f"q_norm, k_norm: {_shapes(f_att.q_norm)} each, before RoPE" if f_att.q_norm is not None
         else "none (Llama 3 has none)",
         "gpt2_params": 0, "family_params": n_f * (_count(f_att.q_norm, f_att.k_norm) if f_att.q_norm is not None else 0)},
        {"change": "the head", "gpt2": _head_words(gpt2), "family": _head_words(model),
         "gpt2_params": 0 if _tied(gpt2) else _count(gpt2.out_head),
         "family_params": 0 if _tied(model) else _count(model.out_head)},
    ]
    rows.append({"change": "total", "gpt2": f"{n_g} blocks, d {gpt2.tok_emb.weight.shape[1]}",
                 "family": f"{n_f} blocks, d {cfg.emb_dim}", "gpt2_params": _count(gpt2),
                 "family_params": _count(model)})
    return GPT2Changes(cfg.family, rows)


def _tied(model: nn.Module) -> bool:
    return model.out_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()


def _head_words(model: nn.Module) -> str:
    w = list(model.out_head.weight.shape)
    return f"out_head {w}, " + ("tok_emb's own storage (tied)" if _tied(model) else "its own weights (untied)")

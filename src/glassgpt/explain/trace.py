"""explain: record, from the live model, every shape on the way from text to the next token.

    trace(model, tokenizer, "Every effort moves you") -> Trace

runs the prompt through the model once with forward hooks on its modules and keeps
what the real tensors looked like at each stage: ids [b, t] -> tok_emb [b, t, d] ->
+ pos_emb [t, d] -> trf_blocks (one opened up: heads [b, h, t, hd], attention
weights [b, h, t, t], feed-forward [b, t, 4d]) -> final_norm -> out_head logits
[b, t, V] -> last position [b, V] -> softmax -> next token. The two stages where the
width changes are marked `vocab->hidden` (tok_emb) and `hidden->vocab` (out_head;
`hidden->classes` for a classifier), with the weight matrix behind each.

A Trace renders itself as text (`to_text`) and JSON (`to_dict`); `explain_diagram.py`
draws it as SVG/PNG. Same shape letters as model.py: b, t, d, h, hd, V.

Recording (record.py) is separate: taps on the model's modules hand each tensor to the
current trace's recorder, so traces of one model can run side by side.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import GPTConfig
from ..errors import PromptError
from ..memory import parameter_table as config_parameter_table
from ..model import GPTModel, LayerNorm, attention_weights
from ..tokenizer import Tokenizer
from .record import Progress, Recorder, record

VOCAB_TO_HIDDEN = "vocab->hidden"
HIDDEN_TO_VOCAB = "hidden->vocab"
HIDDEN_TO_CLASSES = "hidden->classes"


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
class Trace:
    model: dict[str, Any]
    prompt: str
    tokens: list[dict[str, Any]]
    stages: list[Stage]
    params: dict[str, Any]
    next_token: dict[str, Any]
    embedding_check: dict[str, Any] | None = None
    logit_lens: dict[str, Any] | None = None
    attention: dict[str, Any] | None = None
    modules: list[dict[str, Any]] = field(default_factory=list)

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["stages"] = [{k: v for k, v in asdict(s).items() if v is not None} for s in self.stages]
        return {k: v for k, v in out.items() if v is not None}

    def to_text(self, color: bool = False, attention_layer: int | None = None, heatmap: str | None = None) -> str:
        """The terminal view; with `attention_layer`, also that layer's attention per head (and where
        its `heatmap` PNG went)."""
        from .text import render_text
        return render_text(self, color=color, attention_layer=attention_layer, heatmap=heatmap)


# --- parameters and memory ------------------------------------------------------

def _module_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def parameter_table(model: GPTModel) -> dict[str, Any]:
    """Per-module parameter counts, and the totals with and without weight tying (memory.py
    computes them from the config: `glassgpt info` prints the same table without weights)."""
    return config_parameter_table(model.cfg)


def memory_needs(cfg: GPTConfig, dtype: torch.dtype, batch_size: int = 1, seq_len: int | None = None) -> dict[str, Any]:
    """Bytes a model needs for inference and for training (weights, grads, AdamW, activations)."""
    from ..memory import memory_needs as _needs
    return _needs(cfg, dtype, batch_size, seq_len)


# --- the trace --------------------------------------------------------------------

def _module_name(module: nn.Module) -> str:
    if isinstance(module, nn.Embedding):
        return f"nn.Embedding({module.num_embeddings}, {module.embedding_dim})"
    if isinstance(module, nn.Linear):
        bias = "" if module.bias is not None else ", bias=False"
        return f"nn.Linear({module.in_features}, {module.out_features}{bias})"
    if isinstance(module, LayerNorm):
        return f"LayerNorm({module.scale.shape[0]})"
    if isinstance(module, nn.GELU):
        return f"nn.GELU(approximate={module.approximate!r})"
    return type(module).__name__


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _weight_stage(name: str, module: nn.Module, out: torch.Tensor, **kw: Any) -> Stage:
    weight = getattr(module, "weight", None)
    return Stage(name=name, module=_module_name(module), shape=_shape(out), dtype=_dtype(out),
                 weight_shape=list(weight.shape) if weight is not None else None,
                 params=_module_params(module), **kw)


# --- recording: taps on the model, one recorder per trace ---------------------------

# --- the trace --------------------------------------------------------------------

@torch.inference_mode()
def trace(model: GPTModel, tokenizer: Tokenizer, text: str | None = None, top_k: int = 10,
          temperature: float = 1.0, block: int = 0, logit_lens: bool = False, attention: bool = False,
          embedding_check: bool = True, model_name: str | None = None,
          random_weights: bool = False, labels: list[str] | None = None, ids: list[int] | None = None,
          timing: bool = True, cancel: threading.Event | None = None, progress: Progress | None = None) -> Trace:
    """Run `text` (or token `ids`) through `model` once and record every stage from the real tensors.

    block: which of the trf_blocks to open up (its norms, heads, attention, feed-forward).
    temperature: divides the last logits before the softmax (the `probs` stage).
    labels: class names, for a model whose out_head is a classifier.
    ids: token ids instead of text, e.g. a prompt extended one generated token at a time
    (re-encoding the decoded text could merge pieces differently).
    timing: time the embedding check's lookup and matmul (off: only check that they are equal).
    cancel: set it from another thread to stop the trace at its next module (raises TraceCancelled).
    progress: called as progress(step, done, total) after each block, lens layer and check.

    Traces of one model may run at the same time in different threads; the model is only read.
    """
    cfg = model.cfg
    if ids is not None:
        ids_list = [int(i) for i in ids]
        bad = [i for i in ids_list if not 0 <= i < min(tokenizer.n_vocab, cfg.vocab_size)]
        if bad:
            raise PromptError(f"token id {bad[0]} is out of range: valid ids are 0..{min(tokenizer.n_vocab, cfg.vocab_size) - 1}")
        text = tokenizer.decode(ids_list)
    elif not text:
        raise PromptError("the prompt is empty: give some text, e.g. \"Every effort moves you\"")
    else:
        ids_list = tokenizer.encode(text)
    if not ids_list:
        raise PromptError("the prompt encodes to no tokens: give some text")
    if len(ids_list) > cfg.context_length:
        raise PromptError(f"the prompt is {len(ids_list):,} tokens but context_length is {cfg.context_length:,}: shorten it")
    if not 0 <= block < cfg.n_layers:
        raise PromptError(f"block {block} does not exist: choose 0..{cfg.n_layers - 1}")
    if not 0 < temperature < math.inf:
        raise PromptError(f"temperature must be a positive number for the probabilities, got {temperature}")
    device = model.tok_emb.weight.device
    ids = torch.tensor([ids_list], device=device)  # [b=1, t]
    b, t = ids.shape

    opened = (f"{block}.norm1", f"{block}.norm2", f"{block}.ff.layers.0", f"{block}.ff.layers.1", f"{block}.ff.layers.2")
    keep = {"tok_emb", "pos_emb", "embeddings", "final_norm", *opened}
    for i in range(cfg.n_layers):
        keep.add(f"trf_blocks.{i}")
        if attention or i == block:
            keep.update((f"{i}.q", f"{i}.k", f"{i}.v", f"{i}.out_proj"))
    rec = Recorder(frozenset(keep), cfg.n_layers * (2 if logit_lens else 1) + embedding_check, cancel, progress)
    was_training = model.training
    if was_training:  # a model being served is already in eval mode, so concurrent traces never flip it
        model.eval()
    try:
        logits = record(model, ids, rec)  # [b, t, V]
    finally:
        if was_training:
            model.train()
    seen = rec.seen
    last = logits[:, -1, :]  # [b, t, V] -> [b, V]
    probs = _probs(last, temperature)  # [b, V]

    V = cfg.out_dim
    is_classifier = cfg.num_classes is not None
    tokens = [{"id": i, "text": tokenizer.decode([i])} for i in ids_list]
    stages = [Stage("tokens", f"tokenizer ({tokenizer.name}, {tokenizer.n_vocab:,} tokens)", [b, t], "int64",
                    note="one id per BPE piece" if tokenizer.name != "char" else "one id per character")]
    stages.append(_weight_stage(
        "tok_emb", model.tok_emb, seen["tok_emb"], transition=VOCAB_TO_HIDDEN, input_shape=[b, t],
        note=f"each id selects one row of the [{cfg.vocab_size}, {cfg.emb_dim}] weight (= one_hot(ids) @ W)"))
    stages.append(_weight_stage("pos_emb", model.pos_emb, seen["pos_emb"], input_shape=[t],
                                note=f"one learned row per position 0..{t - 1}, the same for every sequence"))
    stages.append(Stage("embeddings", f"tok_emb + pos_emb, then drop_emb (Dropout p={cfg.drop_rate})",
                        _shape(seen["embeddings"]), _dtype(seen["embeddings"]),
                        note="[t, d] broadcasts over the batch"))
    hd, h = cfg.head_dim, cfg.n_heads
    attn_all: list[torch.Tensor] = []
    for i, blk in enumerate(model.trf_blocks):
        x_in, x_out = seen[f"trf_blocks.{i}"]
        stages.append(Stage(f"trf_blocks.{i}", "TransformerBlock", _shape(x_out), _dtype(x_out),
                            params=_module_params(blk), input_shape=_shape(x_in),
                            note="x + att(norm1(x)), then x + ff(norm2(x)): the width stays " + str(cfg.emb_dim)))
        if attention or i == block:
            attn_all.append(_attention_weights(seen[f"{i}.q"], seen[f"{i}.k"], h, hd))
        if i == block:
            stages += _block_stages(blk, i, seen, attn_all[-1], cfg)

    final = seen["final_norm"]
    stages.append(_weight_stage("final_norm", model.final_norm, final))
    transition = HIDDEN_TO_CLASSES if is_classifier else HIDDEN_TO_VOCAB
    tied = model.tied
    stages.append(_weight_stage(
        "out_head", model.out_head, logits, transition=transition, input_shape=_shape(final),
        shared_with="tok_emb.weight" if tied else None,
        note=("x @ W.T: one score per " + ("class" if is_classifier else "vocabulary entry") + " at every position"
              + ("; W is the same tensor as tok_emb.weight (weight tying)" if tied else ""))))
    stages.append(Stage("last_logits", "logits[:, -1, :]", _shape(last), _dtype(last),
                        note="the class is read from the last position, the only one that has seen the whole text"
                        if is_classifier else "only the last position's scores predict what comes next"))
    stages.append(Stage("probs", f"softmax(last_logits / {temperature:g})", _shape(probs), _dtype(probs),
                        note=f"{V:,} probabilities that sum to 1"))
    top = probs[0].topk(min(top_k, V))
    def label(i: int) -> str:
        if is_classifier:
            return labels[i] if labels and i < len(labels) else f"class {i}"
        return tokenizer.decode([i])
    top_list = [{"id": int(i), "text": label(int(i)), "prob": float(p)} for p, i in zip(top.values, top.indices)]
    chosen = top_list[0]
    stages.append(Stage("label" if is_classifier else "next_token",
                        "argmax over the classes" if is_classifier else "argmax (greedy; sampling would draw from probs)",
                        [b], "int64", note=f"id {chosen['id']} -> {chosen['text']!r}"))
    next_token = {"top": top_list, "id": chosen["id"], "text": chosen["text"], "prob": chosen["prob"],
                  "kind": "class" if is_classifier else "token", "temperature": temperature,
                  "text_after": text + ("" if is_classifier else chosen["text"])}

    table = parameter_table(model)
    result = Trace(
        model={"name": model_name or "custom", "random_weights": random_weights, "config": cfg.to_dict(),
               "dtype": _dtype(model.tok_emb.weight), "device": str(device),
               "tokenizer": tokenizer.name, "n_vocab": tokenizer.n_vocab, "labels": labels},
        prompt=text, tokens=tokens, stages=stages,
        params={"total": table["total"], "total_untied": table["total_untied"], "tied": table["tied"]},
        next_token=next_token, modules=table["modules"])
    if attention:
        result.attention = {"shape": [cfg.n_layers, b, h, t, t], "tokens": [tk["text"] for tk in tokens],
                            "layers": [a[0].tolist() for a in attn_all]}
    if logit_lens:
        result.logit_lens = _logit_lens(model, seen, logits, label, rec)
    if embedding_check:
        rec.check()
        result.embedding_check = check_embedding_is_linear(model, ids, timing=timing)
        rec.step("embedding_check")
    return result


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


def _attention_weights(q: torch.Tensor, k: torch.Tensor, h: int, hd: int) -> torch.Tensor:
    """The model's own `attention_weights` on the hooked projections, in float32: [b, h, t, t]."""
    b, t, _ = q.shape
    q = q.float().view(b, t, h, hd).transpose(1, 2)  # [b, t, d] -> [b, h, t, hd]
    k = k.float().view(b, t, h, hd).transpose(1, 2)
    return attention_weights(q, k)


def _block_stages(blk: nn.Module, i: int, seen: dict, attn: torch.Tensor, cfg: GPTConfig) -> list[Stage]:
    """The inside of one block, each stage from its hooked tensor."""
    p = f"trf_blocks.{i}"
    b, t, d = seen[f"{i}.q"].shape
    h, hd = cfg.n_heads, cfg.head_dim
    context_in, out_proj_out = seen[f"{i}.out_proj"]
    v = seen[f"{i}.v"].float().view(b, t, h, hd).transpose(1, 2)
    # The recomputed weights must reproduce what SDPA gave out_proj: a check, not a decoration.
    recomputed = (attn @ v).transpose(1, 2).reshape(b, t, d)
    attn_error = float((recomputed - context_in.float()).abs().max())
    x_in = seen[f"trf_blocks.{i}"][0]
    stages = [_weight_stage(f"{p}.norm1", blk.norm1, seen[f"{i}.norm1"][1], parent=p)]
    for name, key, what in (("W_query", "q", "queries"), ("W_key", "k", "keys"), ("W_value", "v", "values")):
        stages.append(_weight_stage(f"{p}.att.{name}", getattr(blk.att, name), seen[f"{i}.{key}"], parent=p, note=what))
    stages.append(Stage(f"{p}.att.heads", "view + transpose", [b, h, t, hd], _dtype(seen[f"{i}.q"]), parent=p,
                        input_shape=[b, t, d], note=f"q, k, v each split into {h} heads of {hd}"))
    stages.append(Stage(f"{p}.att.attn_weights", f"softmax(q @ k.T / sqrt({hd}) + causal mask)", _shape(attn),
                        "float32", parent=p,
                        note=f"row j: how much token j attends to tokens 0..j (rows sum to 1; matches SDPA to {attn_error:.1e})"))
    stages.append(Stage(f"{p}.att.context", "attn_weights @ v, heads merged", _shape(context_in), _dtype(context_in),
                        parent=p, input_shape=[b, h, t, hd], note=f"[b, h, t, hd] -> [b, t, d]"))
    stages.append(_weight_stage(f"{p}.att.out_proj", blk.att.out_proj, out_proj_out, parent=p))
    stages.append(Stage(f"{p}.shortcut1", "x + att(norm1(x))", _shape(x_in), _dtype(x_in), parent=p,
                        note="residual connection"))
    stages.append(_weight_stage(f"{p}.norm2", blk.norm2, seen[f"{i}.norm2"][1], parent=p))
    stages.append(_weight_stage(f"{p}.ff.layers.0", blk.ff.layers[0], seen[f"{i}.ff.layers.0"][1], parent=p,
                                note=f"expand to 4 x {d} = {4 * d}"))
    stages.append(_weight_stage(f"{p}.ff.layers.1", blk.ff.layers[1], seen[f"{i}.ff.layers.1"][1], parent=p))
    stages.append(_weight_stage(f"{p}.ff.layers.2", blk.ff.layers[2], seen[f"{i}.ff.layers.2"][1], parent=p,
                                note=f"project back to {d}"))
    stages.append(Stage(f"{p}.shortcut2", "x + ff(norm2(x))", _shape(x_in), _dtype(x_in), parent=p,
                        note="residual connection; the block's output"))
    return stages


def _logit_lens(model: GPTModel, seen: dict, logits: torch.Tensor, label, rec: Recorder) -> dict[str, Any]:
    """The top token (or class) at every position after every block: out_head(final_norm(residual)).

    Only each row's top is needed: its id is the max of the logits, its probability
    exp(max - logsumexp(logits)), so no softmax over [t, V] is kept. After the last block
    the lens is the model's own output, so those logits are reused.
    """
    layers = []
    n = model.cfg.n_layers
    for i in range(n):
        resid = seen[f"trf_blocks.{i}"][1]  # [b, t, d]
        lens = logits[0] if i == n - 1 else model.out_head(model.final_norm(resid))[0]  # [t, V]
        lens = lens.float()
        top, idx = lens.max(dim=-1)  # [t, V] -> [t]
        prob = (top - lens.logsumexp(dim=-1)).exp()
        layers.append({"layer": i, "top": [{"id": int(j), "text": label(int(j)), "prob": float(q)}
                                           for q, j in zip(prob, idx)]})
        rec.step(f"logit_lens.{i}")
    return {"layers": layers}


@torch.inference_mode()
def check_embedding_is_linear(model: GPTModel, ids: torch.Tensor, repeats: int = 5, timing: bool = True,
                              budget_ms: float = 250.0) -> dict[str, Any]:
    """Show on the live weights that an embedding lookup is a matmul with one-hot vectors.

    tok_emb(ids) == one_hot(ids, V) @ W == nn.Linear(V, d, bias=False) with weight W.T,
    exactly (each output sums one weight and V - 1 zeros). The lookup skips the zeros.
    timing: also time both ways, up to `repeats` runs each (fewer when they would take
    over `budget_ms`: a long prompt's one-hot matmul is timed once).
    """
    W = model.tok_emb.weight  # [V, d]
    V, d = W.shape
    lookup = model.tok_emb(ids)  # [b, t, d]
    one_hot = F.one_hot(ids, V).to(W.dtype)  # [b, t] -> [b, t, V]
    via_matmul = one_hot @ W  # [b, t, V] @ [V, d] -> [b, t, d]
    linear = nn.Linear(V, d, bias=False, device=W.device, dtype=W.dtype)
    linear.weight = nn.Parameter(W.t(), requires_grad=False)  # a view of the same numbers, [d, V]
    via_linear = linear(one_hot)
    del one_hot, linear

    n = ids.numel()
    check = {
        "equal_one_hot_matmul": bool(torch.equal(lookup, via_matmul)),
        "equal_linear": bool(torch.equal(lookup, via_linear)),
        "max_abs_diff": float((lookup - via_matmul).abs().max()),
        "weight_shape": [V, d],
        "linear": f"nn.Linear({V}, {d}, bias=False), weight = tok_emb.weight.T [{d}, {V}]",
        "lookup_bytes": n * d * W.element_size(),
        "one_hot_bytes": n * V * W.element_size(),
        "matmul_flops": 2 * n * V * d,
        "useful_fraction": 1 / V,
    }
    if timing:  # the check above warmed both paths up
        check["lookup_ms"] = _median_ms(lambda: model.tok_emb(ids), repeats, budget_ms)
        check["matmul_ms"] = _median_ms(lambda: F.one_hot(ids, V).to(W.dtype) @ W, repeats, budget_ms)
    return check


def _median_ms(fn: Callable[[], Any], repeats: int, budget_ms: float) -> float:
    """Median milliseconds of fn() over `repeats` runs, stopping early once they add up to `budget_ms`."""
    times: list[float] = []
    while not times or (len(times) < repeats and sum(times) < budget_ms):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)

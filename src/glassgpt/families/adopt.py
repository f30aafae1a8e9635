"""A Qwen3 or Llama 3 module, taken as it is: the glass model of its family over the module's own tensors.

    family_layout(module) -> (kind, FamilyConfig, tensors in the book's names, stages) or None

Also the bonus notebooks' classes: Qwen3Model with the MoE notebook's MoEFeedForward, and the Gemma 3
notebook's Gemma3Model (its cfg dict read as a Gemma3Config; its names are gemma3.py's).

The kinds: the book's `Qwen3Model` / `Llama3Model` (`llms_from_scratch.qwen3` / `llama3`) and their
KV-cache variants (`kv_cache.qwen3` / `llama3`, `kv_cache_batched.qwen3`), or a reader's copy with
the book's names; transformers' `Qwen3ForCausalLM` / `LlamaForCausalLM` (its names mapped to the
book's, no transposes: both store nn.Linear's [out, in]). The config is read from the tensors'
shapes and the module's attributes: heads from the attention's `num_heads` / `num_kv_groups` /
`head_dim` (the book's) or the module's transformers config; RoPE's base and Llama 3's scaling
from the book's `cfg` dict or that config. `build_family_glass` makes the glass model with every
parameter a view of the module's storage: nothing is copied (adopt.py checks its logits).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import GlassError
from . import build_model
from .config import FamilyConfig, RopeFreq
from .gemma3 import Gemma3Config

# transformers' names inside one decoder layer -> the book's (families/layers.py), the same [out, in] matrices
HF_LAYER_NAMES = {"self_attn.q_proj.weight": "att.W_query.weight", "self_attn.k_proj.weight": "att.W_key.weight",
                  "self_attn.v_proj.weight": "att.W_value.weight", "self_attn.o_proj.weight": "att.out_proj.weight",
                  "mlp.gate_proj.weight": "ff.fc1.weight", "mlp.up_proj.weight": "ff.fc2.weight",
                  "mlp.down_proj.weight": "ff.fc3.weight"}
HF_NORMS = {"self_attn.q_norm": "att.q_norm", "self_attn.k_norm": "att.k_norm", "input_layernorm": "norm1",
            "post_attention_layernorm": "norm2"}
HF_FAMILIES = {"qwen3": "qwen3", "llama": "llama3"}


def family_layout(module: nn.Module) -> tuple[str, FamilyConfig, dict[str, torch.Tensor], dict[str, str]] | None:
    """What a Qwen3 or Llama 3 module holds, in the book's names; None if `module` is neither kind."""
    children = dict(module.named_children())
    if {"tok_emb", "trf_blocks", "final_norm", "out_head"} <= set(children) and "pos_emb" not in children \
            and hasattr(module.trf_blocks[0].att, "num_kv_groups"):
        return _book_family(module)
    if {"tok_emb", "blocks", "final_norm", "out_head"} <= set(children) and "layer_types" in (
            getattr(module, "cfg", None) or {}):
        return _notebook_gemma3(module)
    inner = children.get("model")
    if inner is not None and "lm_head" in children and {"embed_tokens", "layers", "norm"} <= set(
            dict(inner.named_children())) and getattr(getattr(module, "config", None), "model_type", None):
        return _hf_family(module)
    return None


def _book_family(module: nn.Module):
    att, ff, norm = module.trf_blocks[0].att, module.trf_blocks[0].ff, module.final_norm
    family = "qwen3" if hasattr(norm, "scale") else "llama3"  # the book's RMSNorm (`scale`) or torch.nn.RMSNorm
    book = getattr(module, "cfg", None)
    book = book if isinstance(book, dict) else {}
    vocab, d = module.tok_emb.weight.shape
    cos = getattr(module, "cos", None)
    context = book.get("context_length") or (cos.shape[0] if isinstance(cos, torch.Tensor) else None)
    if "rope_base" not in book or context is None:
        raise GlassError(f"{type(module).__name__} keeps no `cfg` dict with rope_base and context_length (the book's "
                         "classes do): glassgpt cannot tell its RoPE; build it as the book's Qwen3Model(cfg) does")
    rope_freq = book.get("rope_freq")
    hd = att.head_dim
    moe = {}
    if isinstance(ff.fc1, nn.ModuleList):  # the MoE notebook's MoEFeedForward: one fc1, fc2, fc3 per expert
        moe = {"num_experts": len(ff.fc1), "num_experts_per_tok": ff.num_experts_per_tok,
               "moe_hidden_dim": ff.fc1[0].weight.shape[0]}
    cfg = _config(module, family=family, vocab_size=vocab, context_length=int(context), emb_dim=d, **moe,
                  n_heads=att.num_heads, n_layers=len(module.trf_blocks),
                  hidden_dim=moe["moe_hidden_dim"] if moe else ff.fc1.weight.shape[0],
                  n_kv_groups=att.num_kv_groups, rope_base=float(book["rope_base"]),
                  head_dim=None if family == "llama3" and hd == d // att.num_heads else hd,
                  qk_norm=getattr(att, "q_norm", None) is not None,
                  rope_freq=RopeFreq(**rope_freq) if rope_freq else None,
                  tie_embeddings=_same_storage(module.out_head.weight, module.tok_emb.weight),
                  norm_eps=_book_eps(book, family))
    tensors = dict(module.named_parameters(remove_duplicate=False))
    stages = {s: s for s in ("tok_emb", "final_norm", "out_head")}
    for i in range(cfg.n_layers):
        stages.update({f"trf_blocks.{i}{s}": f"trf_blocks.{i}{s}" for s in ("", ".norm1", ".att", ".norm2", ".ff")})
    source = type(module).__module__
    kind = (f"the book's {type(module).__name__}" + (f" ({source.removeprefix('llms_from_scratch.')})"
                                                     if "kv_cache" in source else "")
            if source.startswith("llms_from_scratch") else f"{type(module).__name__} with the book's names (a reader's copy)")
    return kind, cfg, tensors, stages


def _notebook_gemma3(module: nn.Module):
    """The Gemma 3 notebook's Gemma3Model (or the KV-cache notebook's): its cfg dict is the config, its names are
    glassgpt's."""
    fields = {f.name for f in Gemma3Config.__dataclass_fields__.values()}
    try:
        cfg = Gemma3Config(**{k: v for k, v in module.cfg.items() if k in fields},
                           tie_embeddings=_same_storage(module.out_head.weight, module.tok_emb.weight),
                           norm_eps=_eps(module.final_norm, 1e-6))
    except TypeError as err:  # a key the notebook's dict always has is missing
        raise GlassError(f"{type(module).__name__}'s cfg is not the Gemma 3 notebook's config dict: {err}") from None
    except GlassError as err:
        raise GlassError(f"{type(module).__name__}: {err}") from None
    stages = {s: s for s in ("tok_emb", "final_norm", "out_head")}
    stages.update({f"trf_blocks.{i}": f"blocks.{i}" for i in range(cfg.n_layers)})
    kind = ("the Gemma 3 notebook's Gemma3Model" if type(module).__name__ == "Gemma3Model"
            else f"{type(module).__name__} with the Gemma 3 notebook's names (a reader's copy)")
    return kind, cfg, dict(module.named_parameters(remove_duplicate=False)), stages


def _hf_family(module: nn.Module):
    hf = module.config
    model_type = hf.model_type
    if model_type == "gemma3_text":
        return _hf_gemma3(module)
    if model_type not in HF_FAMILIES:
        raise GlassError(f"{type(module).__name__} is a {model_type} model: glassgpt adopts transformers' "
                         "Qwen3ForCausalLM (qwen3), LlamaForCausalLM (llama) and GPT2LMHeadModel (gpt2)")
    family = HF_FAMILIES[model_type]
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    rope_base = rope.get("rope_theta", getattr(hf, "rope_theta", None) or 10_000.0)
    rope_freq = None
    if rope.get("rope_type", rope.get("type", "default")) == "llama3":
        rope_freq = RopeFreq(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                             high_freq_factor=float(rope["high_freq_factor"]),
                             original_context_length=int(rope["original_max_position_embeddings"]))
    elif rope.get("rope_type", rope.get("type", "default")) != "default":
        raise GlassError(f"{type(module).__name__}'s RoPE scaling {rope.get('rope_type')!r} is not Llama 3's: "
                         "glassgpt has only that one")
    inner, first = module.model, module.model.layers[0]
    vocab, d = inner.embed_tokens.weight.shape
    hd = getattr(hf, "head_dim", None) or d // hf.num_attention_heads
    cfg = _config(module, family=family, vocab_size=vocab, context_length=hf.max_position_embeddings, emb_dim=d,
                  n_heads=hf.num_attention_heads, n_layers=len(inner.layers),
                  hidden_dim=first.mlp.gate_proj.weight.shape[0],
                  n_kv_groups=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
                  rope_base=float(rope_base), head_dim=None if family == "llama3" and hd == d // hf.num_attention_heads
                  else hd, qk_norm=hasattr(first.self_attn, "q_norm"), rope_freq=rope_freq,
                  tie_embeddings=_same_storage(module.lm_head.weight, inner.embed_tokens.weight),
                  norm_eps=float(hf.rms_norm_eps))
    norm = "scale" if family == "qwen3" else "weight"  # the glass RMSNorm's name in each family
    tensors = {"tok_emb.weight": inner.embed_tokens.weight, f"final_norm.{norm}": inner.norm.weight,
               "out_head.weight": module.lm_head.weight}
    stages = {"tok_emb": "model.embed_tokens", "final_norm": "model.norm", "out_head": "lm_head"}
    for i, layer in enumerate(inner.layers):
        for name, p in layer.named_parameters():
            owner = name.rpartition(".")[0]
            if name in HF_LAYER_NAMES:
                tensors[f"trf_blocks.{i}.{HF_LAYER_NAMES[name]}"] = p
            elif owner in HF_NORMS:
                tensors[f"trf_blocks.{i}.{HF_NORMS[owner]}.{norm}"] = p
            else:
                raise GlassError(f"{type(module).__name__} has a tensor glassgpt's {family} does not: "
                                 f"model.layers.{i}.{name} {list(p.shape)}")
        stages.update({f"trf_blocks.{i}": f"model.layers.{i}", f"trf_blocks.{i}.norm1": f"model.layers.{i}.input_layernorm",
                       f"trf_blocks.{i}.att": f"model.layers.{i}.self_attn", f"trf_blocks.{i}.ff": f"model.layers.{i}.mlp",
                       f"trf_blocks.{i}.norm2": f"model.layers.{i}.post_attention_layernorm"})
    return f"transformers' {type(module).__name__}", cfg, tensors, stages


GEMMA3_HF_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                   "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm")


def _hf_gemma3(module: nn.Module):
    """transformers' Gemma3ForCausalLM: its config's fields as the notebook's keys, its tensors by gemma3.py's names
    (its Gemma3RMSNorm is (1 + weight) too)."""
    hf, inner = module.config, module.model
    for field in ("attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention"):
        if getattr(hf, field, None):
            raise GlassError(f"{type(module).__name__} sets {field} ({getattr(hf, field)!r}): the notebook's "
                             "Gemma3Model has none")
    rope = getattr(hf, "rope_parameters", None) or {}
    for kind in ("full_attention", "sliding_attention"):
        if rope.get(kind, {}).get("rope_type", "default") != "default":
            raise GlassError(f"{type(module).__name__}'s {kind} layers scale RoPE ({rope[kind]['rope_type']!r}): the "
                             "notebook's Gemma3Model turns them by plain RoPE")
    vocab, d = inner.embed_tokens.weight.shape
    try:
        cfg = Gemma3Config(vocab_size=vocab, context_length=hf.max_position_embeddings, emb_dim=d,
                           n_heads=hf.num_attention_heads, n_layers=len(inner.layers), hidden_dim=hf.intermediate_size,
                           head_dim=hf.head_dim, n_kv_groups=hf.num_key_value_heads,
                           rope_local_base=float(rope.get("sliding_attention", {}).get("rope_theta", 10_000.0)),
                           rope_base=float(rope.get("full_attention", {}).get("rope_theta", 1_000_000.0)),
                           sliding_window=hf.sliding_window, layer_types=list(hf.layer_types),
                           query_pre_attn_scalar=hf.query_pre_attn_scalar,
                           tie_embeddings=_same_storage(module.lm_head.weight, inner.embed_tokens.weight),
                           norm_eps=float(hf.rms_norm_eps))
    except GlassError as err:
        raise GlassError(f"{type(module).__name__}: {err}") from None
    tensors = {"tok_emb.weight": inner.embed_tokens.weight, "final_norm.scale": inner.norm.weight,
               "out_head.weight": module.lm_head.weight}
    stages = {"tok_emb": "model.embed_tokens", "final_norm": "model.norm", "out_head": "lm_head"}
    ours = {theirs: f"att.{mine}" for theirs, mine in (("self_attn.q_proj", "W_query"), ("self_attn.k_proj", "W_key"),
            ("self_attn.v_proj", "W_value"), ("self_attn.o_proj", "out_proj"))}
    ours |= {"mlp.gate_proj": "ff.fc1", "mlp.up_proj": "ff.fc2", "mlp.down_proj": "ff.fc3",
             "self_attn.q_norm": "att.q_norm", "self_attn.k_norm": "att.k_norm"}
    for i, layer in enumerate(inner.layers):
        for name, p in layer.named_parameters():
            owner = name.rpartition(".")[0]
            if owner not in ours and owner not in GEMMA3_HF_NORMS:
                raise GlassError(f"{type(module).__name__} has a tensor glassgpt's gemma3 does not: "
                                 f"model.layers.{i}.{name} {list(p.shape)}")
            leaf = "scale" if owner in GEMMA3_HF_NORMS else "weight"
            tensors[f"blocks.{i}.{ours.get(owner, owner)}.{leaf}"] = p
        stages[f"trf_blocks.{i}"] = f"model.layers.{i}"
    return f"transformers' {type(module).__name__}", cfg, tensors, stages


def _config(module: nn.Module, **fields: Any) -> FamilyConfig:
    try:
        return FamilyConfig(**fields)
    except GlassError as err:
        raise GlassError(f"{type(module).__name__}: {err}") from None


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Tied is told by storage, never by equal values (a copied embedding is not a tie)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride())


def _book_eps(book: dict, family: str) -> float:
    """The norms' eps as the config says it (the book's classes write it in: Qwen3 1e-6, Llama 3 1e-5), not as a
    norm module holds it: check (verify.py) compares the module's against it."""
    eps = book.get("norm_eps", book.get("rms_norm_eps"))
    return float(eps) if isinstance(eps, (int, float)) else (1e-6 if family == "qwen3" else 1e-5)


def _eps(norm: nn.Module, default: float) -> float:
    eps = getattr(norm, "eps", None)
    return float(eps) if isinstance(eps, (int, float)) else default


def build_family_glass(module: nn.Module, cfg: FamilyConfig, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """The glass model of `cfg` whose every parameter is a view of `tensors` (the module's storage)."""
    with torch.device("meta"):
        glass = build_model(cfg)
    for name, tensor in tensors.items():
        if name == "out_head.weight" and cfg.tie_embeddings:
            continue
        owner, _, leaf = name.rpartition(".")
        try:
            target = glass.get_submodule(owner)
        except AttributeError:
            target = None
        expected = getattr(target, leaf, None)
        if not isinstance(expected, torch.Tensor):
            raise GlassError(f"{type(module).__name__} has a tensor glassgpt's {cfg.family} does not: {name} "
                             f"{list(tensor.shape)}")
        if expected.shape != tensor.shape:
            raise GlassError(f"{type(module).__name__}: {name} is {list(tensor.shape)} but its config wants "
                             f"{list(expected.shape)}")
        setattr(target, leaf, nn.Parameter(tensor.detach(), requires_grad=False))  # a view: nothing copied
    glass.tie_weights()
    missing = [n for n, p in glass.named_parameters() if p.is_meta]
    if missing:
        raise GlassError(f"{type(module).__name__} has no tensor for glassgpt's {missing[0]}: it looks for the "
                         "book's names (tok_emb, trf_blocks, final_norm, out_head) or transformers' (model.layers, lm_head)")
    return glass.eval()


def family_line(cfg: FamilyConfig) -> str:
    """The config in one line, for `adopted_from`."""
    return (f"vocab_size {cfg.vocab_size}, emb_dim {cfg.emb_dim}, {cfg.n_layers} layers, {cfg.n_heads} query heads "
            f"sharing {cfg.n_kv_groups} key/value groups of {cfg.head_dim_value}, "
            f"{'tied head' if cfg.tie_embeddings else 'own head'}")

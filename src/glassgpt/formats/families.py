"""Qwen3 and Llama 3.2 files, both ways: a Hugging Face folder and the book's .pth with its config JSON.

    load_family(spec)            a folder with config.json (`architectures`) and model.safetensors, or
                                 sharded model-0000x-of-0000n.safetensors with model.safetensors.index.json;
                                 or the book's state dict (model.pth) with model.json (its config dict) beside
    export_family_hf(model, dir)     config.json + model.safetensors that transformers loads
    export_family_book(model, path)  model.pth (the book's state dict) + model.json (its config)

Hugging Face's names live only in `hf_names` below, with the book's beside them: every matrix is
stored as the book's nn.Linear stores it (no transposes, unlike GPT-2's Conv1D). A tied head is
stored once, as `model.embed_tokens.weight`, with `tie_word_embeddings` saying so, and is rebuilt
as one Parameter (the book's `load_weights_into_qwen` copies it into a second one instead).

Checked before anything is built: the architecture (one line naming it and the families covered),
the config (FamilyConfig's own checks: heads, head_dim, groups), every tensor's name and shape.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import save_file
from torch import nn

from ..errors import CheckpointError, ConfigError, GlassError, TokenizerError
from ..families import (BONUS_MODELS, FAMILIES, FamilyConfig, Gemma3Config, Qwen3_5Config, RopeFreq, build_model,
                        is_family_model)
from ..families.bonus_hf import HF_BONUS, bonus_config_from_hf, bonus_hf_names
from .checks import on_meta
from .family_tokenizers import family_tokenizer
from .files import atomic_write, read_json, read_safetensors

# transformers' class name -> the family that reads it
HF_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3", "LlamaForCausalLM": "llama3",
                    "Gemma3ForCausalLM": "gemma3", "Qwen3_5ForCausalLM": "qwen3_5"} | HF_BONUS
COVERED = ", ".join(f"{arch} ({family})" for arch, family in HF_ARCHITECTURES.items())


def hf_architecture(raw: dict[str, Any]) -> str | None:
    archs = raw.get("architectures")
    return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None


def is_family_folder(path: str | os.PathLike) -> bool:
    """Whether `path` is a Hugging Face folder this module reads: config.json naming an architecture
    other than GPT-2's (an uncovered one is then refused by `config_from_hf`, in its own words)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        raw = read_json(config, kind="config")  # (its size checked first: a 1 GiB file is not read)
    except (OSError, GlassError):
        return False
    arch = hf_architecture(raw) if isinstance(raw, dict) else None
    return arch is not None and arch != "GPT2LMHeadModel"


def config_from_hf(raw: dict[str, Any], source: str = "config.json") -> FamilyConfig | Gemma3Config:
    """The config of a transformers config.json (one of HF_ARCHITECTURES)."""
    arch = hf_architecture(raw)
    if arch == "Gemma3ForConditionalGeneration" or (arch in HF_ARCHITECTURES and raw.get("vision_config")):
        raise CheckpointError(f"{source} is Gemma 3's vision model ({arch}: a SigLIP vision tower before the text "
                              "model): glassgpt reads the text models, Gemma3ForCausalLM (model_type gemma3_text, "
                              "gemma-3-270m and gemma-3-1b)")
    if arch == "Qwen3_5ForConditionalGeneration":
        raise CheckpointError(f"{source} is a vision-language model ({arch}, with a vision tower): glassgpt reads "
                              "text models; save its text model as Qwen3_5ForCausalLM and open that folder")
    if arch not in HF_ARCHITECTURES:
        raise CheckpointError(f"{source} is a {arch or 'model with no architectures entry'}"
                              f"{' (' + str(raw.get('model_type')) + ')' if raw.get('model_type') else ''}: "
                              f"glassgpt covers {COVERED} and GPT2LMHeadModel (gpt2)")
    family = HF_ARCHITECTURES[arch]
    if family == "gemma3":
        return gemma3_config_from_hf(raw, source)
    if family == "qwen3_5":
        return qwen3_5_config_from_hf(raw, source)
    quant = raw.get("quantization_config")
    if quant:  # FP8, AWQ, GPTQ, bitsandbytes: packed weights and scales in place of the matrices
        method = quant.get("quant_method", "quantized") if isinstance(quant, dict) else "quantized"
        raise CheckpointError(f"{source} describes {method} weights (quantization_config): glassgpt reads float "
                              f"weights (float32, bfloat16, float16): use the model's unquantized repository")
    if family in BONUS_MODELS:  # OLMo 3, Tiny Aya: their own configs (families/bonus_hf.py)
        return bonus_config_from_hf(raw, source)
    rope = raw.get("rope_parameters") or {}  # transformers 5 keeps rope_theta and the scaling here
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type") == "llama3" else None)
    rope_base = raw.get("rope_theta", rope.get("rope_theta", 10_000.0))
    try:
        rope_freq = None
        if scaling:
            if scaling.get("rope_type", scaling.get("type")) != "llama3":
                raise ConfigError(f"{source}: rope scaling {scaling!r} is not Llama 3's: glassgpt has only that one")
            rope_freq = RopeFreq(factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
                                 high_freq_factor=float(scaling["high_freq_factor"]),
                                 original_context_length=int(scaling["original_max_position_embeddings"]))
        head_dim = raw.get("head_dim")
        if family == "llama3" and head_dim == raw["hidden_size"] // raw["num_attention_heads"]:
            head_dim = None  # Llama's own rule, as the book's config dicts leave it
        return FamilyConfig(
            family=family, vocab_size=raw["vocab_size"], context_length=raw["max_position_embeddings"],
            emb_dim=raw["hidden_size"], n_heads=raw["num_attention_heads"], n_layers=raw["num_hidden_layers"],
            hidden_dim=raw["intermediate_size"], n_kv_groups=raw.get("num_key_value_heads", raw["num_attention_heads"]),
            rope_base=float(rope_base), head_dim=head_dim,
            qk_norm=family == "qwen3", rope_freq=rope_freq, tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            norm_eps=float(raw.get("rms_norm_eps", 1e-6)), **moe_from_hf(raw, arch, source))
    except KeyError as e:
        raise CheckpointError(f"{source} has no {e.args[0]!r}: it is not a whole {arch} config") from None
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def gemma3_config_from_hf(raw: dict[str, Any], source: str) -> Gemma3Config:
    """Gemma3ForCausalLM's config.json as the notebook's GEMMA3_CONFIG keys; a field asking for what the notebook's
    Gemma3Model does not do (softcapping, a RoPE scaling, bidirectional attention, another activation) is refused
    by its name."""
    refused = {"attn_logit_softcapping": "a softcap on the attention scores",
               "final_logit_softcapping": "a softcap on the logits",
               "use_bidirectional_attention": "attention to later positions too"}
    for field, what in refused.items():
        if raw.get(field):
            raise ConfigError(f"{source}: {field} is {raw[field]!r} ({what}): the notebook's Gemma3Model has none")
    if raw.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ConfigError(f"{source}: hidden_activation is {raw['hidden_activation']!r}: the notebook's GeGLU gates "
                          "with GELU's tanh form (gelu_pytorch_tanh)")
    if raw.get("attention_bias"):
        raise ConfigError(f"{source}: attention_bias is true: the notebook's attention has no biases")
    rope = raw.get("rope_parameters") or {}  # transformers 5: one entry per layer type
    bases = {}
    for kind, old_name, default in (("full_attention", "rope_theta", 1_000_000.0),
                                    ("sliding_attention", "rope_local_base_freq", 10_000.0)):
        params = rope.get(kind) or ((raw.get("rope_scaling") or {}) if kind == "full_attention" else {})
        scaling = params.get("rope_type", params.get("type", "default"))
        if scaling != "default":
            raise ConfigError(f"{source}: the {kind} layers' RoPE has rope_type {scaling!r} (rope_scaling): the "
                              "notebook's Gemma3Model turns them by plain RoPE")
        bases[kind] = float((rope.get(kind) or {}).get("rope_theta", raw.get(old_name, default)))
    try:
        n = raw["num_hidden_layers"]
        types = raw.get("layer_types") or [  # older configs: every sliding_window_pattern-th layer is full
            "full_attention" if (i + 1) % raw.get("sliding_window_pattern", 6) == 0 else "sliding_attention"
            for i in range(n)]
        return Gemma3Config(
            vocab_size=raw["vocab_size"], context_length=raw["max_position_embeddings"], emb_dim=raw["hidden_size"],
            n_heads=raw["num_attention_heads"], n_layers=n, hidden_dim=raw["intermediate_size"],
            head_dim=raw.get("head_dim", 256), n_kv_groups=raw.get("num_key_value_heads", raw["num_attention_heads"]),
            rope_local_base=bases["sliding_attention"], rope_base=bases["full_attention"],
            sliding_window=raw.get("sliding_window", 4096), layer_types=types,
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar", 256),
            tie_embeddings=bool(raw.get("tie_word_embeddings", True)), norm_eps=float(raw.get("rms_norm_eps", 1e-6)))
    except KeyError as e:
        raise CheckpointError(f"{source} has no {e.args[0]!r}: it is not a whole Gemma3ForCausalLM config") from None
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def qwen3_5_config_from_hf(raw: dict[str, Any], source: str) -> Qwen3_5Config:
    """The Qwen3_5Config of a transformers Qwen3_5ForCausalLM config.json; a field it sets to what the glass
    file does not implement is named in one line."""
    rope = raw.get("rope_parameters") or {}
    unimplemented = {"attention_bias": raw.get("attention_bias", False) is not False,
                     "hidden_act": raw.get("hidden_act", "silu") != "silu",
                     "rope_parameters.rope_type": rope.get("rope_type", "default") != "default",
                     "rope_scaling": bool(raw.get("rope_scaling")),
                     "quantization_config": bool(raw.get("quantization_config"))}
    for field, set_to_other in unimplemented.items():
        if set_to_other:
            top, _, leaf = field.partition(".")
            value = rope.get(leaf) if leaf else raw.get(top)
            raise ConfigError(f"{source}: {field} is {value!r}, which glassgpt's Qwen3.5 does not implement (it has "
                              f"{QWEN3_5_IMPLEMENTS[field]}): run this model with transformers")
    try:
        return Qwen3_5Config(
            family="qwen3_5", vocab_size=raw["vocab_size"], context_length=raw["max_position_embeddings"],
            emb_dim=raw["hidden_size"], n_heads=raw["num_attention_heads"], n_layers=raw["num_hidden_layers"],
            hidden_dim=raw["intermediate_size"], n_kv_groups=raw.get("num_key_value_heads", raw["num_attention_heads"]),
            rope_base=float(rope.get("rope_theta", raw.get("rope_theta", 10_000.0))), head_dim=raw.get("head_dim", 256),
            qk_norm=True, tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))),
            linear_conv_kernel_dim=raw.get("linear_conv_kernel_dim", 4),
            linear_key_head_dim=raw.get("linear_key_head_dim", 128),
            linear_value_head_dim=raw.get("linear_value_head_dim", 128),
            linear_num_key_heads=raw.get("linear_num_key_heads", 16),
            linear_num_value_heads=raw.get("linear_num_value_heads", 32),
            layer_types=raw.get("layer_types") or [
                "full_attention" if (i + 1) % raw.get("full_attention_interval", 4) == 0 else "linear_attention"
                for i in range(raw["num_hidden_layers"])])
    except KeyError as e:
        raise CheckpointError(f"{source} has no {e.args[0]!r}: it is not a whole Qwen3_5ForCausalLM config") from None
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def qwen3_5_config_to_hf(cfg: Qwen3_5Config) -> dict[str, Any]:
    return {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.context_length, "hidden_size": cfg.emb_dim,
            "num_attention_heads": cfg.n_heads, "num_hidden_layers": cfg.n_layers, "intermediate_size": cfg.hidden_dim,
            "num_key_value_heads": cfg.n_kv_groups, "head_dim": cfg.head_dim_value, "rms_norm_eps": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base,
                                "partial_rotary_factor": cfg.partial_rotary_factor},
            "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim, "linear_key_head_dim": cfg.linear_key_head_dim,
            "linear_value_head_dim": cfg.linear_value_head_dim, "linear_num_key_heads": cfg.linear_num_key_heads,
            "linear_num_value_heads": cfg.linear_num_value_heads, "layer_types": list(cfg.layer_types),
            "torch_dtype": "float32"}


QWEN3_5_IMPLEMENTS = {"attention_bias": "no biases", "hidden_act": "silu", "rope_parameters.rope_type":
                      "the default RoPE", "rope_scaling": "no RoPE scaling",
                      "quantization_config": "float weights"}


def moe_from_hf(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    """Qwen3MoeForCausalLM's experts as the MoE notebook's keys; what its MoEFeedForward does not do is refused
    by the field that asks for it (dense blocks between sparse ones, routing weights not renormalised)."""
    experts = raw.get("num_experts", raw.get("num_local_experts"))  # transformers 5 writes num_local_experts
    if arch != "Qwen3MoeForCausalLM":
        if experts:
            raise ConfigError(f"{source}: num_experts is {experts} but {arch} has no experts: it is not a {arch} config")
        return {}
    if raw.get("mlp_only_layers"):
        raise ConfigError(f"{source}: mlp_only_layers {raw['mlp_only_layers']} gives some blocks a dense feed-forward; "
                          "the MoE notebook's Qwen3Model has experts in every block")
    if raw.get("decoder_sparse_step", 1) != 1:
        raise ConfigError(f"{source}: decoder_sparse_step {raw['decoder_sparse_step']} gives some blocks a dense "
                          "feed-forward; the MoE notebook's Qwen3Model has experts in every block")
    if not raw.get("norm_topk_prob", False):
        raise ConfigError(f"{source}: norm_topk_prob is false (the chosen experts' weights are not renormalised); "
                          "the MoE notebook's MoEFeedForward renormalises them, as the released Qwen3 MoE models do")
    return {"num_experts": experts, "num_experts_per_tok": raw["num_experts_per_tok"],
            "moe_hidden_dim": raw["moe_intermediate_size"]}


def config_to_hf(cfg: FamilyConfig | Gemma3Config) -> dict[str, Any]:
    """The config.json that transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM / LlamaForCausalLM /
    Gemma3ForCausalLM reads for `cfg`."""
    if cfg.family == "qwen3_5":
        return qwen3_5_config_to_hf(cfg)
    if cfg.family == "gemma3":
        return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": cfg.vocab_size,
                "max_position_embeddings": cfg.context_length, "hidden_size": cfg.emb_dim,
                "num_attention_heads": cfg.n_heads, "num_hidden_layers": cfg.n_layers,
                "intermediate_size": cfg.hidden_dim, "head_dim": cfg.head_dim, "num_key_value_heads": cfg.n_kv_groups,
                "rope_theta": cfg.rope_base, "rope_local_base_freq": cfg.rope_local_base,
                "sliding_window": cfg.sliding_window, "layer_types": list(cfg.layer_types),
                "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim, "rms_norm_eps": cfg.norm_eps,
                "tie_word_embeddings": cfg.tie_embeddings, "hidden_activation": "gelu_pytorch_tanh",
                "attention_bias": False, "torch_dtype": "float32"}
    arch = "Qwen3MoeForCausalLM" if cfg.moe else next(a for a, f in HF_ARCHITECTURES.items() if f == cfg.family)
    raw = {"architectures": [arch], "model_type": "qwen3_moe" if cfg.moe else cfg.family.replace("llama3", "llama"),
           "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.context_length, "hidden_size": cfg.emb_dim,
           "num_attention_heads": cfg.n_heads, "num_hidden_layers": cfg.n_layers, "intermediate_size": cfg.hidden_dim,
           "num_key_value_heads": cfg.n_kv_groups, "head_dim": cfg.head_dim_value, "rope_theta": cfg.rope_base,
           "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
           "attention_bias": False, "torch_dtype": "float32"}
    if cfg.rope_freq is not None:
        raw["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope_freq.factor,
                               "low_freq_factor": cfg.rope_freq.low_freq_factor,
                               "high_freq_factor": cfg.rope_freq.high_freq_factor,
                               "original_max_position_embeddings": cfg.rope_freq.original_context_length}
    if cfg.moe:
        raw.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   moe_intermediate_size=cfg.moe_hidden_dim, norm_topk_prob=True, decoder_sparse_step=1,
                   mlp_only_layers=[])
    return raw


def hf_names(cfg: FamilyConfig | Gemma3Config) -> list[tuple[str, str]]:
    """(the book's name, Hugging Face's name) of every stored tensor; a tied head is stored once."""
    if cfg.family in BONUS_MODELS:
        return bonus_hf_names(cfg)
    if cfg.family == "gemma3":
        return gemma3_hf_names(cfg)
    if cfg.family == "qwen3_5":
        return qwen3_5_hf_names(cfg)
    norm = "scale" if cfg.family == "qwen3" else "weight"  # the book's RMSNorm (Qwen3) or torch.nn.RMSNorm (Llama)
    names = [("tok_emb.weight", "model.embed_tokens.weight")]
    for i in range(cfg.n_layers):
        b, h = f"trf_blocks.{i}", f"model.layers.{i}"
        names += [(f"{b}.att.W_query.weight", f"{h}.self_attn.q_proj.weight"),
                  (f"{b}.att.W_key.weight", f"{h}.self_attn.k_proj.weight"),
                  (f"{b}.att.W_value.weight", f"{h}.self_attn.v_proj.weight"),
                  (f"{b}.att.out_proj.weight", f"{h}.self_attn.o_proj.weight")]
        if cfg.qk_norm:
            names += [(f"{b}.att.q_norm.scale", f"{h}.self_attn.q_norm.weight"),
                      (f"{b}.att.k_norm.scale", f"{h}.self_attn.k_norm.weight")]
        names.append((f"{b}.norm1.{norm}", f"{h}.input_layernorm.weight"))
        if cfg.moe:  # the router, then each expert's SwiGLU (the notebook's fc1[e], fc2[e], fc3[e])
            names.append((f"{b}.ff.gate.weight", f"{h}.mlp.gate.weight"))
            for e in range(cfg.num_experts):
                names += [(f"{b}.ff.fc1.{e}.weight", f"{h}.mlp.experts.{e}.gate_proj.weight"),
                          (f"{b}.ff.fc2.{e}.weight", f"{h}.mlp.experts.{e}.up_proj.weight"),
                          (f"{b}.ff.fc3.{e}.weight", f"{h}.mlp.experts.{e}.down_proj.weight")]
        else:
            names += [(f"{b}.ff.fc1.weight", f"{h}.mlp.gate_proj.weight"),  # the gate: silu(fc1(x))
                      (f"{b}.ff.fc2.weight", f"{h}.mlp.up_proj.weight"),
                      (f"{b}.ff.fc3.weight", f"{h}.mlp.down_proj.weight")]
        names.append((f"{b}.norm2.{norm}", f"{h}.post_attention_layernorm.weight"))
    names.append((f"final_norm.{norm}", "model.norm.weight"))
    if not cfg.tie_embeddings:
        names.append(("out_head.weight", "lm_head.weight"))
    return names


def gemma3_hf_names(cfg: Gemma3Config) -> list[tuple[str, str]]:
    """The notebook's load_weights_into_gemma, as a table: (its name, Hugging Face's)."""
    names = [("tok_emb.weight", "model.embed_tokens.weight")]
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}", f"model.layers.{i}"
        names += [(f"{b}.att.{ours}.weight", f"{h}.self_attn.{theirs}.weight")
                  for ours, theirs in (("W_query", "q_proj"), ("W_key", "k_proj"), ("W_value", "v_proj"),
                                       ("out_proj", "o_proj"))]
        if cfg.qk_norm:
            names += [(f"{b}.att.q_norm.scale", f"{h}.self_attn.q_norm.weight"),
                      (f"{b}.att.k_norm.scale", f"{h}.self_attn.k_norm.weight")]
        names += [(f"{b}.ff.fc1.weight", f"{h}.mlp.gate_proj.weight"), (f"{b}.ff.fc2.weight", f"{h}.mlp.up_proj.weight"),
                  (f"{b}.ff.fc3.weight", f"{h}.mlp.down_proj.weight")]
        names += [(f"{b}.{norm}.scale", f"{h}.{norm}.weight") for norm in
                  ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                   "post_feedforward_layernorm")]
    names.append(("final_norm.scale", "model.norm.weight"))
    if not cfg.tie_embeddings:
        names.append(("out_head.weight", "lm_head.weight"))
    return names


QWEN3_5_LINEAR = ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight", "in_proj_qkv.weight",
                  "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")  # the same leaves in both


def qwen3_5_hf_names(cfg: Qwen3_5Config) -> list[tuple[str, str]]:
    """Qwen3.5's (the notebook's name, transformers' name) pairs: token_mixer is linear_attn or self_attn by layer."""
    names = [("tok_emb.weight", "model.embed_tokens.weight")]
    for i, layer_type in enumerate(cfg.layer_types):
        b, h = f"trf_blocks.{i}", f"model.layers.{i}"
        if layer_type == "linear_attention":
            names += [(f"{b}.token_mixer.{leaf}", f"{h}.linear_attn.{leaf}") for leaf in QWEN3_5_LINEAR]
        else:
            names += [(f"{b}.token_mixer.{ours}.weight", f"{h}.self_attn.{theirs}.weight") for ours, theirs in
                      (("W_query", "q_proj"), ("W_key", "k_proj"), ("W_value", "v_proj"), ("out_proj", "o_proj"))
                      + ((("q_norm", "q_norm"), ("k_norm", "k_norm")) if cfg.qk_norm else ())]
        names += [(f"{b}.norm1.weight", f"{h}.input_layernorm.weight"),
                  (f"{b}.ff.fc1.weight", f"{h}.mlp.gate_proj.weight"),
                  (f"{b}.ff.fc2.weight", f"{h}.mlp.up_proj.weight"),
                  (f"{b}.ff.fc3.weight", f"{h}.mlp.down_proj.weight"),
                  (f"{b}.norm2.weight", f"{h}.post_attention_layernorm.weight")]
    names.append(("final_norm.weight", "model.norm.weight"))
    if not cfg.tie_embeddings:
        names.append(("out_head.weight", "lm_head.weight"))
    return names


def book_config(family: str, values: dict[str, Any], tie_embeddings: bool) -> FamilyConfig | Gemma3Config:
    """The config of a book's or notebook's config dict for `family`."""
    if family == "gemma3":
        return Gemma3Config.from_book_dict(values, tie_embeddings=tie_embeddings)
    if family == "qwen3_5":
        return Qwen3_5Config.from_book_dict(family, values, tie_embeddings=tie_embeddings)
    return FamilyConfig.from_book_dict(family, values, tie_embeddings=tie_embeddings)


def is_family_spec(spec: object) -> bool:
    """Whether `load_model(spec)` is this module's: a Qwen3/Llama (or uncovered) HF folder, or the book's
    Qwen3/Llama .pth with its config JSON beside it (told by its `n_kv_groups`, without reading the weights)."""
    if not isinstance(spec, (str, os.PathLike)):
        return False
    path = Path(spec)
    if path.is_dir():
        return is_family_folder(path)
    side = book_config_path(path)
    if path.suffix in (".pth", ".pt") and path.is_file() and side.is_file():
        try:
            keys = read_json(side, kind="config")
            return "n_kv_groups" in keys or ("n_kv_heads" in keys and "layer_types" in keys)  # the bonus notebooks'
        except (OSError, GlassError):
            return False
    return False


def load_family(spec: str | os.PathLike, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """The glass model of a Hugging Face Qwen3/Llama folder or of the book's .pth (see the module's docstring)."""
    return (load_hf_family if Path(spec).is_dir() else load_book_family)(spec, device, dtype)


def read_family_config(spec: str | os.PathLike) -> FamilyConfig:
    """The FamilyConfig of `load_family(spec)`, read without loading any weights."""
    if Path(spec).is_dir():
        return read_hf_config(spec)
    values = read_json(book_config_path(spec), what=f"the config of {spec}", kind="config")
    return config_from_book(values)  # (the weights are not read)


def config_from_book(values: dict[str, Any]) -> FamilyConfig | Gemma3Config:
    """The config of a notebook's config dict, the model told by its keys (_book_family). The tie: the dict's
    `tie_embeddings` (OLMo 3's and Tiny Aya's `tie_word_embeddings`), else Gemma 3's tied, the others' untied."""
    family = _book_family(values)
    if family in BONUS_MODELS:  # OLMo 3's and Tiny Aya's notebook dicts (tie_word_embeddings, if any, among them)
        return BONUS_MODELS[family][1].from_dict(values)
    values = dict(values)
    tie = bool(values.pop("tie_embeddings", family == "gemma3"))
    return book_config(family, values, tie)


def _book_family(values: dict[str, Any]) -> str:
    """Which model a book's or notebook's config dict is for: the family it names, else told by its keys (the
    OLMo 3 and Tiny Aya notebooks' `n_kv_heads`: Tiny Aya's norms have layer_norm_eps, OLMo 3's rms_norm_eps)."""
    named = values.get("family")
    if named in BOOK_CLASSES:
        return named
    if "linear_num_key_heads" in values:  # Qwen3.5's notebook (its layer_types too: told before Gemma 3)
        return "qwen3_5"
    if "n_kv_heads" in values:
        return "tiny_aya" if "layer_norm_eps" in values else "olmo3"
    return "gemma3" if "layer_types" in values else "qwen3" if "qk_norm" in values else "llama3"


def config_origin(spec: str | os.PathLike) -> str:
    """Where `read_family_config(spec)` took the config from, and which values nothing in it said (the first line
    a command says of a model of the book's or its notebooks' classes)."""
    path = Path(spec)
    if path.is_dir():
        return f"config: {path / 'config.json'} ({read_family_config(spec).family})"
    values = read_json(book_config_path(spec), what=f"the config of {spec}", kind="config")
    family = _book_family(values)  # (one the weights contradict is refused when they are read)
    defaults = {"qwen3": (("norm_eps", 1e-6), ("tie_embeddings", False)),
                "llama3": (("norm_eps", 1e-5), ("tie_embeddings", False))}.get(family, ())
    assumed = [f"{k} {v}" for k, v in defaults if k not in values]
    return (f"config: {book_config_path(spec).name} beside {path.name}, the book's {BOOK_CLASSES[family]} dict"
            + (f"; assumed, as the book's code has them: {', '.join(assumed)}" if assumed else ""))


def load_family_tokenizer(spec: str | os.PathLike):
    """The tokenizer saved in the model's folder (or beside its .pth), checked against its vocabulary."""
    cfg = read_family_config(spec)
    folder = Path(spec) if Path(spec).is_dir() else Path(spec).parent
    tokenizer = family_tokenizer(folder, cfg.family, cfg.vocab_size)
    if tokenizer is None:
        wanted = "tokenizer.model" if cfg.family == "llama3" else "tokenizer.json"
        where = f"{Path(spec).name}'s folder {folder.resolve()}" if folder != Path(spec) else str(folder)
        raise TokenizerError(f"{where} has no {wanted}: put the model's own {wanted} beside its weights, or give "
                             f"it with --tokenizer FILE (tokenizer=FILE), or read the prompt with GPT-2's "
                             f"(--tokenizer gpt2)")
    return tokenizer


# --- reading ------------------------------------------------------------------------------------

def hf_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a folder's model.safetensors, or of every shard model.safetensors.index.json names."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, what="the shards' index", kind="index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map: it does not say which shard holds which tensor")
        for shard in sorted(set(weight_map.values())):
            if Path(shard).name != shard or not (path / shard).is_file():
                raise CheckpointError(f"{index} names the shard {shard!r}, which is not in {path}: download it again")
            yield from read_safetensors(path / shard)
    elif (path / "model.safetensors").is_file():
        yield from read_safetensors(path / "model.safetensors")
    else:
        raise CheckpointError(f"{path} has config.json but no model.safetensors or model.safetensors.index.json: "
                              "download the weights too (only safetensors are read: nothing is unpickled)")


def read_hf_config(path: str | os.PathLike) -> FamilyConfig:
    path = Path(path)
    return config_from_hf(read_json(path / "config.json", kind="config"), str(path / "config.json"))


def load_hf_family(path: str | os.PathLike, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32) -> nn.Module:
    """The glass model of a Hugging Face Qwen3 or Llama folder, in eval mode."""
    path = Path(path)
    cfg = read_hf_config(path)
    family_tokenizer(path, cfg.family, cfg.vocab_size)  # another model's tokenizer: refused before the weights are read
    book_name = {hf: book for book, hf in hf_names(cfg)}
    state = {}
    for name, tensor in hf_tensors(path):
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue  # some tied checkpoints store the head anyway: it is tok_emb's
        if cfg.family == "qwen3_5" and name.startswith("mtp."):
            continue  # Qwen3.5's multi-token prediction head: not the next-token model (transformers skips it too)
        if name not in book_name:
            raise CheckpointError(f"{path} holds {name!r}, which a {cfg.family} model of this config has not: "
                                  f"its config.json does not describe these weights")
        state[book_name[name]] = tensor
    return model_from_book_state(cfg, state, str(path), device, dtype)


def model_from_book_state(cfg: FamilyConfig, state: dict[str, torch.Tensor], source: str,
                          device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """The glass model of `cfg` holding `state` (the book's names), every name and shape checked first."""
    with on_meta():  # (no initial weights drawn: nothing to draw into)
        model = build_model(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    # glassgpt's tensor readers rename GPT-2's old norm1.weight to norm1.scale (files.upgrade_name): a family whose
    # RMSNorm keeps `weight` (Llama 3, Qwen3.5), read from glassgpt's own checkpoint, gets its names back
    state = {weight_name(k, expected): v for k, v in state.items()}
    if cfg.tie_embeddings:
        expected.pop("out_head.weight")
        state = {k: v for k, v in state.items() if k != "out_head.weight"}
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{source} lacks {len(missing)} tensor(s) of a {cfg.family} model ({missing[0]}, ...): "
                              "the file is incomplete or of another model")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise CheckpointError(f"{source} holds {unexpected[0]!r}, which a {cfg.family} model of this config has not")
    for name, shape in expected.items():
        if tuple(state[name].shape) != tuple(shape):
            raise CheckpointError(f"{source}: {name} is {list(state[name].shape)} but the config makes it "
                                  f"{list(shape)}: the config does not describe these weights")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    return model.to(device=device, dtype=dtype).eval()


def weight_name(name: str, expected: dict[str, Any]) -> str:
    head, _, leaf = name.rpartition(".")
    return f"{head}.weight" if leaf == "scale" and name not in expected and f"{head}.weight" in expected else name


def family_of_state(state: dict[str, Any]) -> str | None:
    """Which family a book state dict is, told by its names: QK-norm and `scale` are Qwen3's, `norm1.weight` Llama's,
    post-feed-forward norms in `blocks` OLMo 3's (`weight`; Gemma 3's are `scale`), one `input_layernorm` per block
    in `trf_blocks` Tiny Aya's, a `token_mixer` Qwen3.5's."""
    if any(k.startswith("trf_blocks.0.token_mixer.") for k in state):  # Qwen3.5's notebook
        return "qwen3_5"
    if "blocks.0.post_feedforward_layernorm.weight" in state:
        return "olmo3"
    if "trf_blocks.0.input_layernorm.weight" in state:
        return "tiny_aya"
    if "trf_blocks.0.norm1.scale" in state:
        return "qwen3"
    if "trf_blocks.0.norm1.weight" in state:
        return "llama3"
    if "blocks.0.input_layernorm.scale" in state:
        return "gemma3"
    return None


BOOK_CLASSES = {"qwen3": "Qwen3Model (llms_from_scratch.qwen3)", "llama3": "Llama3Model (llms_from_scratch.llama3)",
                "gemma3": "Gemma3Model (the notebook standalone-gemma3)",
                "qwen3_5": "Qwen3_5Model (the notebook qwen3.5)",
                "olmo3": "Olmo3Model (the notebook standalone-olmo3)",
                "tiny_aya": "TinyAyaModel (the notebook standalone-tiny-aya)"}
# What a family's tensors cannot tell, and where the book's config dict keeps it.
UNTOLD = {"qwen3": ("context_length", "rope_base"),
          "llama3": ("n_heads", "n_kv_groups", "context_length", "rope_base", "rope_freq"),
          "qwen3_5": ("n_heads", "n_kv_groups", "context_length", "rope_base", "partial_rotary_factor",
                      "linear_num_key_heads", "linear_num_value_heads", "layer_types")}


def what_state_tells(state: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(family, the config values its tensors fix) for the book's Qwen3/Llama state dict, told by its names and
    shapes alone; None for another one. Qwen3's q_norm is a head wide, so its head counts are told too; Llama's
    are not (W_query is emb_dim square whatever the head count)."""
    family = family_of_state(state)
    # GPT-2's norms are `scale` too: the book's next models add no pos_emb and feed SwiGLU's fc1, fc2, fc3
    if family not in UNTOLD or "tok_emb.weight" not in state or "pos_emb.weight" in state \
            or "trf_blocks.0.ff.fc1.weight" not in state:
        return None
    blocks = {int(k.split(".")[1]) for k in state if k.startswith("trf_blocks.") and k.split(".")[1].isdigit()}
    vocab_size, emb_dim = state["tok_emb.weight"].shape
    told: dict[str, Any] = {"vocab_size": vocab_size, "emb_dim": emb_dim, "n_layers": max(blocks, default=-1) + 1}
    if (ff := state.get("trf_blocks.0.ff.fc1.weight")) is not None:
        told["hidden_dim"] = ff.shape[0]
    q, k = state.get("trf_blocks.0.att.W_query.weight"), state.get("trf_blocks.0.att.W_key.weight")
    qn = state.get("trf_blocks.0.att.q_norm.scale")
    if family == "qwen3" and q is not None and k is not None and qn is not None:
        head_dim = qn.shape[0]
        told.update(head_dim=head_dim, n_heads=q.shape[0] // head_dim, n_kv_groups=k.shape[0] // head_dim,
                    qk_norm=True)
    head = state.get("out_head.weight")
    told["tie_embeddings"] = head is None or head.data_ptr() == state["tok_emb.weight"].data_ptr()
    return family, told


def untold_config(state: dict[str, Any], path: str | os.PathLike) -> str | None:
    """The one line for the book's Qwen3/Llama state dict without its config JSON: the model its keys and shapes
    match, what they tell, what they cannot, and the file to write; None when it matches neither."""
    found = what_state_tells(state)
    if found is None:
        return None
    family, told = found
    told_text = ", ".join(f"{k} {v:,}" if isinstance(v, int) and not isinstance(v, bool) else f"{k} {v}"
                          for k, v in told.items())
    side = book_config_path(path)
    return (f"{path} looks like the book's {BOOK_CLASSES[family]} by its keys and shapes; they tell {told_text}, "
            f"but not {', '.join(UNTOLD[family])}: put the config dict the model was built with as JSON in "
            f"{side.name} beside it (glassgpt export --format book writes both)")


def read_book_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # weights only: nothing unpickled
    except Exception as e:  # torch raises many kinds for a file that is not a state dict
        raise CheckpointError(f"cannot read {path} as a state dict: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict")
    return state


def _same_storage(state: dict[str, torch.Tensor], a: str, b: str) -> bool:
    """Whether two tensors of a loaded state dict were one tensor when saved (torch.save keeps the sharing)."""
    return a in state and b in state and state[a].data_ptr() == state[b].data_ptr()


def book_config_path(path: str | os.PathLike) -> Path:
    return Path(path).with_suffix(".json")


def load_book_family(path: str | os.PathLike, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32) -> nn.Module:
    """The glass model of the book's Qwen3Model / Llama3Model state dict, with its config JSON beside it
    (model.json for model.pth: the book's config dict, `dtype` as a string, plus `tie_embeddings`)."""
    state = read_book_state(path)
    family = family_of_state(state)
    if family is None:
        raise CheckpointError(f"{path} is not a state dict of the book's Qwen3Model or Llama3Model "
                              "(no trf_blocks.0.norm1.scale or .weight) or of the notebooks' Gemma3Model, Olmo3Model "
                              "or TinyAyaModel (no blocks.0.input_layernorm.scale, blocks.0.post_feedforward_layernorm"
                              ".weight or trf_blocks.0.input_layernorm.weight)")
    side = book_config_path(path)
    if not side.is_file():
        raise CheckpointError(f"{path} needs its config: the book's config dict as JSON in {side} "
                              f"(glassgpt export --format book writes both)")
    values = read_json(side, what=f"the config of {path}", kind="config")
    if family in BONUS_MODELS:  # the notebook's config dict, its dtype as a string
        try:
            cfg = BONUS_MODELS[family][1].from_dict(values)
        except ConfigError as e:
            raise ConfigError(f"{side}: {e}") from None
        return model_from_book_state(cfg, state, str(path), device, dtype)
    # The notebooks' models keep an out_head of their own; Gemma's loader ties it when the weights have no lm_head
    tie = bool(values.pop("tie_embeddings", family == "gemma3" and _same_storage(state, "out_head.weight",
                                                                                 "tok_emb.weight")))
    cfg = book_config(family, values, tie)
    return model_from_book_state(cfg, state, str(path), device, dtype)


# --- writing ------------------------------------------------------------------------------------

def export_family_hf(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write `path/config.json` + `path/model.safetensors` that transformers' Qwen3ForCausalLM or
    LlamaForCausalLM loads (`from_pretrained(path)`)."""
    if not is_family_model(model):
        raise CheckpointError(f"{type(model).__name__} is not one of {', '.join(c.__name__ for c in FAMILIES.values())}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    own = model.state_dict()
    tensors = {hf: own[book].detach().contiguous().clone() for book, hf in hf_names(model.cfg)}
    atomic_write(path / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(config_to_hf(model.cfg), indent=2)))
    atomic_write(path / "model.safetensors", lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    return path


def export_family_book(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write the book's state dict (`path`, e.g. model.pth) and its config dict beside it (model.json)."""
    if not is_family_model(model):
        raise CheckpointError(f"{type(model).__name__} is not one of {', '.join(c.__name__ for c in FAMILIES.values())}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # the book's Qwen3Model keeps a head
    dtype = str(model.tok_emb.weight.dtype).removeprefix("torch.")
    values = model.cfg.to_book_dict(dtype) | {"tie_embeddings": model.cfg.tie_embeddings}
    atomic_write(path, lambda tmp: torch.save(state, tmp))
    atomic_write(book_config_path(path), lambda tmp: Path(tmp).write_text(json.dumps(values, indent=2)))
    return path

"""transformers' names for the book's bonus models: OLMo 3 (Olmo3ForCausalLM), Tiny Aya (Cohere2ForCausalLM) and
Gemma 4 (Gemma4ForCausalLM, the dense text model).

    bonus_config_from_hf(raw, source)   a transformers config dict -> Olmo3Config, TinyAyaConfig or Gemma4Config
    bonus_hf_names(cfg)                 (the notebook's name, transformers' name) of every stored tensor
    bonus_glass(module)                 transformers' module as the glass model over its own tensors (None: not one)
    HF_LAYER_NAMES[family]              inside one decoder layer: transformers' module -> the notebook's

The one place these models' Hugging Face names live (formats/families.py reads folders through it,
kinds.py describes transformers' modules through it). What the glass files do not implement is refused in
one line naming the config field: a RoPE scaling other than YaRN (OLMo 3's full layers) or any scaling on
Tiny Aya, sliding layers of another RoPE than the full ones', a softcap, an activation other than SiLU; Gemma 4's
MoE block, keys-as-values, bidirectional attention, a RoPE other than the notebook's (gemma4_config_from_hf).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError
from .gemma4 import Gemma4Config
from .olmo3 import Olmo3Config
from .tiny_aya import TinyAyaConfig

HF_BONUS = {"Olmo3ForCausalLM": "olmo3", "Cohere2ForCausalLM": "tiny_aya", "Gemma4ForCausalLM": "gemma4"}
HF_MODEL_TYPES = {"olmo3": "olmo3", "cohere2": "tiny_aya", "gemma4_text": "gemma4"}
BLOCKS = {"olmo3": "blocks", "tiny_aya": "trf_blocks", "gemma4": "blocks"}  # the notebooks' ModuleList names
HF_LAYER_NAMES = {
    "olmo3": {"self_attn.q_proj": "att.W_query", "self_attn.k_proj": "att.W_key", "self_attn.v_proj": "att.W_value",
              "self_attn.o_proj": "att.out_proj", "self_attn.q_norm": "att.q_norm", "self_attn.k_norm": "att.k_norm",
              "mlp.gate_proj": "ff.fc1", "mlp.up_proj": "ff.fc2", "mlp.down_proj": "ff.fc3",
              "post_attention_layernorm": "post_attention_layernorm",
              "post_feedforward_layernorm": "post_feedforward_layernorm", "self_attn": "att", "mlp": "ff"},
    "tiny_aya": {"self_attn.q_proj": "att.W_query", "self_attn.k_proj": "att.W_key", "self_attn.v_proj": "att.W_value",
                 "self_attn.o_proj": "att.out_proj", "mlp.gate_proj": "ff.fc1", "mlp.up_proj": "ff.fc2",
                 "mlp.down_proj": "ff.fc3", "input_layernorm": "input_layernorm", "self_attn": "att", "mlp": "ff"},
    "gemma4": {f"self_attn.{m}": f"att.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
              | {f"mlp.{m}": f"mlp.{m}" for m in ("gate_proj", "up_proj", "down_proj")}
              | {m: m for m in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                "post_feedforward_layernorm", "per_layer_input_gate", "per_layer_projection",
                                "post_per_layer_input_norm")} | {"self_attn": "att", "mlp": "mlp"},
}
# modules with no weight of their own (so not in the tables of stored tensors above): the description's paths only
HF_WEIGHTLESS = {"gemma4": {"self_attn.v_norm": "att.v_norm"}}
HF_TOP = {"model.embed_tokens": "tok_emb", "model.norm": "final_norm", "lm_head": "out_head",
          "model.embed_tokens_per_layer": "embed_tokens_per_layer",
          "model.per_layer_model_projection": "per_layer_model_projection",
          "model.per_layer_projection_norm": "per_layer_projection_norm"}
UNIMPLEMENTED = ("attn_logit_softcapping", "final_logit_softcapping", "use_qk_norm", "partial_rotary_factor")


def _layer_types(raw: dict[str, Any], n_layers: int) -> list[str]:
    """The config's layer_types, or transformers' default for it: every fourth layer full."""
    pattern = raw.get("sliding_window_pattern", 4)
    return raw.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                      for i in range(n_layers)]


def _rope(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(full layers' RoPE parameters, sliding layers'), from transformers 5's rope_parameters (one dict, or one
    per layer type) or the older rope_theta and rope_scaling."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {"rope_type": "default"})
        sliding = dict(params.get("sliding_attention") or {"rope_type": "default"})
    else:
        full = dict(params) | dict(raw.get("rope_scaling") or {})
        sliding = {"rope_type": "default"}
    theta = raw.get("rope_theta", 10_000.0)
    full.setdefault("rope_theta", theta)
    sliding.setdefault("rope_theta", full["rope_theta"])
    for part in (full, sliding):
        part["rope_type"] = part.get("rope_type", part.get("type", "default"))
    return full, sliding


def bonus_config_from_hf(raw: dict[str, Any], source: str = "config.json") -> Olmo3Config | TinyAyaConfig:
    """The glass config of an Olmo3ForCausalLM, Cohere2ForCausalLM or Gemma4ForCausalLM config.json."""
    archs = raw.get("architectures") or []
    family = HF_BONUS.get(archs[0] if archs else "") or HF_MODEL_TYPES.get(raw.get("model_type", ""))
    if family == "gemma4":
        return gemma4_config_from_hf(raw, source)
    for field in UNIMPLEMENTED:
        if raw.get(field):
            raise ConfigError(f"{source}: {field} = {raw[field]!r} is not implemented in glassgpt's {family}: it "
                              f"reads configs without it")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act = {raw['hidden_act']!r} is not implemented: the glass file's "
                          "feed-forward is SwiGLU (silu)")
    full, sliding = _rope(raw)
    try:
        n_layers, heads = raw["num_hidden_layers"], raw["num_attention_heads"]
        common = dict(vocab_size=raw["vocab_size"], context_length=raw["max_position_embeddings"],
                      emb_dim=raw["hidden_size"], n_heads=heads, n_layers=n_layers,
                      hidden_dim=raw["intermediate_size"], head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
                      n_kv_heads=raw.get("num_key_value_heads") or heads, sliding_window=raw.get("sliding_window"),
                      layer_types=_layer_types(raw, n_layers), attention_bias=bool(raw.get("attention_bias", False)),
                      eos_token_id=_one_id(raw.get("eos_token_id")), pad_token_id=_one_id(raw.get("pad_token_id")))
        if family == "olmo3":
            return Olmo3Config(**common, rope_base=float(full["rope_theta"]), **_olmo3_rope(full, sliding, source),
                               rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                               tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)))
        if full["rope_type"] != "default":
            raise ConfigError(f"rope_parameters.rope_type = {full['rope_type']!r} is not implemented: Tiny Aya's "
                              "glass file has plain RoPE")
        return TinyAyaConfig(**common, rope_base=float(full["rope_theta"]),
                             layer_norm_eps=float(raw.get("layer_norm_eps", 1e-5)),
                             logit_scale=float(raw.get("logit_scale", 1.0)),
                             tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
                             bos_token_id=_one_id(raw.get("bos_token_id")))
    except KeyError as e:
        raise CheckpointError(f"{source} has no {e.args[0]!r}: it is not a whole {archs[0] if archs else family} "
                              "config") from None
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def _olmo3_rope(full: dict[str, Any], sliding: dict[str, Any], source: str) -> dict[str, Any]:
    """The Olmo3Config RoPE fields of the full layers' parameters; the sliding layers' must be plain at that base."""
    if sliding["rope_type"] != "default":
        raise ConfigError(f"rope_parameters.sliding_attention.rope_type = {sliding['rope_type']!r} is not implemented: "
                          "OLMo 3's sliding layers turn at the plain rate")
    if float(sliding["rope_theta"]) != float(full["rope_theta"]):
        raise ConfigError(f"rope_parameters.sliding_attention.rope_theta = {sliding['rope_theta']} differs from the "
                          f"full layers' {full['rope_theta']}: OLMo 3's glass file has one rope_base")
    kind = full["rope_type"]
    if kind == "default":
        return {}
    if kind != "yarn":
        raise ConfigError(f"rope_parameters.full_attention.rope_type = {kind!r} is not implemented: OLMo 3's glass "
                          "file has YaRN and plain RoPE")
    for field in ("mscale", "mscale_all_dim"):
        if full.get(field):
            raise ConfigError(f"rope_parameters.full_attention.{field} is not implemented (YaRN's attention factor is "
                              "read as given, or 0.1 ln(factor) + 1)")
    if full.get("truncate") is False:
        raise ConfigError("rope_parameters.full_attention.truncate = false is not implemented: YaRN's ramp is rounded "
                          "to whole dimensions, as the notebook does")
    factor = float(full["factor"])
    attention_factor = full.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return dict(rope_type="yarn", rope_factor=factor, rope_attention_factor=float(attention_factor),
                rope_orig_max=int(full["original_max_position_embeddings"]),
                beta_fast=float(full.get("beta_fast") or 32.0), beta_slow=float(full.get("beta_slow") or 1.0))


def gemma4_config_from_hf(raw: dict[str, Any], source: str = "config.json") -> Gemma4Config:
    """Gemma4ForCausalLM's config.json (model_type gemma4_text) as the notebook's keys. A field asking for what the
    notebook's Gemma4DenseModel does not do is refused by its name; the full layers' head size is read from
    per_layer_config (transformers 5 writes it there) or global_head_dim."""
    refused = {"enable_moe_block": "a mixture of experts beside the MLP (the 26B-A4B)",
               "attention_k_eq_v": "keys reused as values (the 26B and 31B)",
               "use_bidirectional_attention": "attention to later positions too",
               "attention_bias": "biases in the attention's matrices",
               "quantization_config": "quantized weights"}
    for field, what in refused.items():
        if raw.get(field):
            raise ConfigError(f"{source}: {field} is {raw[field]!r} ({what}): the notebook's Gemma4DenseModel has none")
    if raw.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ConfigError(f"{source}: hidden_activation is {raw['hidden_activation']!r}: the notebook's GeGLU gates "
                          "with GELU's tanh form (gelu_pytorch_tanh)")
    try:
        n, hd, g = raw["num_hidden_layers"], raw.get("head_dim", 256), raw.get("num_key_value_heads", 1)
        types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
        if isinstance(types, list) and types and types[-1] != "full_attention":
            raise ConfigError(f"{source}: layer_types ends with {types[-1]!r}: transformers' Gemma 4 makes the last "
                              "layer full_attention whatever the list says; correct the list")
        rope = raw.get("rope_parameters") or {}
        sliding = rope.get("sliding_attention") or {"rope_type": "default", "rope_theta": 10_000.0}
        full = rope.get("full_attention") or {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                              "rope_theta": 1_000_000.0}
        if sliding.get("rope_type", "default") != "default":
            raise ConfigError(f"{source}: rope_parameters.sliding_attention.rope_type is {sliding['rope_type']!r}: "
                              "the notebook's sliding layers turn by plain RoPE")
        if full.get("rope_type", "default") not in ("default", "proportional"):
            raise ConfigError(f"{source}: rope_parameters.full_attention.rope_type is {full['rope_type']!r}: the "
                              "notebook's full layers turn by plain or proportional RoPE")
        for kind, part in (("sliding_attention", sliding), ("full_attention", full)):
            if float(part.get("factor", 1.0)) != 1.0:
                raise ConfigError(f"{source}: rope_parameters.{kind}.factor is {part['factor']!r}: the notebook's "
                                  "RoPE divides no frequency")
        global_hd = _gemma4_global_head_dim(raw, types, hd, g, source)
        return Gemma4Config(
            vocab_size=raw["vocab_size"], emb_dim=raw["hidden_size"], hidden_dim=raw["intermediate_size"], n_layers=n,
            n_heads=raw["num_attention_heads"], head_dim=hd, n_kv_heads=g, global_head_dim=global_hd,
            context_length=raw["max_position_embeddings"], sliding_window=raw.get("sliding_window", 512),
            layer_types=types, vocab_size_per_layer_input=raw.get("vocab_size_per_layer_input", 262_144),
            hidden_size_per_layer_input=raw.get("hidden_size_per_layer_input", 256) or 0,
            num_kv_shared_layers=raw.get("num_kv_shared_layers", 0),
            use_double_wide_mlp=bool(raw.get("use_double_wide_mlp", False)),
            rope_local_base=float(sliding.get("rope_theta", 10_000.0)),
            rope_global_base=float(full.get("rope_theta", 1_000_000.0)),
            rope_global_type=full.get("rope_type", "default"),
            rope_global_partial_rotary_factor=float(full.get("partial_rotary_factor") or 1.0),
            layer_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            final_logit_softcap=raw.get("final_logit_softcapping"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            pad_token_id=_one_id(raw.get("pad_token_id")))
    except KeyError as e:
        raise CheckpointError(f"{source} has no {e.args[0]!r}: it is not a whole Gemma4ForCausalLM config") from None
    except ConfigError as e:
        raise ConfigError(e.args[0] if str(e).startswith(source) else f"{source}: {e}") from None


def _gemma4_global_head_dim(raw: dict[str, Any], types: list[str], hd: int, g: int, source: str) -> int:
    """The full layers' head size: per_layer_config's (one entry per layer that differs from the base config), or
    global_head_dim (transformers' default 512); what else per_layer_config changes is refused by its name."""
    overrides = raw.get("per_layer_config")
    if not overrides:
        return int(raw.get("global_head_dim", 512))
    try:  # keyed by the layer's index as a string, zero-padded to the widest ("04" of 35 layers)
        overrides = {int(k): v for k, v in overrides.items()}
    except (TypeError, ValueError, AttributeError):
        raise ConfigError(f"{source}: per_layer_config is {overrides!r}: transformers keys it by layer index") from None
    sizes = set()
    for i, layer_type in enumerate(types):
        own = overrides.get(i) or {}
        for key, value in own.items():
            if key not in ("head_dim", "num_key_value_heads") or (key == "num_key_value_heads" and value != g):
                raise ConfigError(f"{source}: per_layer_config.{i}.{key} is {value!r}: the notebook's Gemma 4 gives "
                                  "every layer the same key/value heads and changes only the full layers' head_dim")
        size = own.get("head_dim", hd)
        if layer_type == "sliding_attention" and size != hd:
            raise ConfigError(f"{source}: per_layer_config.{i}.head_dim is {size} in a sliding layer: the notebook's "
                              f"sliding layers have head_dim {hd}")
        if layer_type == "full_attention":
            sizes.add(size)
    if len(sizes) > 1:
        raise ConfigError(f"{source}: per_layer_config gives the full layers head sizes {sorted(sizes)}: the notebook "
                          "has one global_head_dim")
    return sizes.pop() if sizes else int(raw.get("global_head_dim", 512))


def gemma4_hf_names(cfg: Gemma4Config) -> list[tuple[str, str]]:
    """The notebook's load_weights_into_gemma4_dense as a table: (its name, transformers' name). The kv-shared layers'
    k_proj, v_proj and k_norm are not here (transformers has none; gemma4_unread lists them); layer_scalar is a
    buffer, stored with the weights."""
    names = [("tok_emb.weight", "model.embed_tokens.weight")]
    if cfg.hidden_size_per_layer_input:
        names += [(f"{m}.weight", f"model.{m}.weight") for m in ("embed_tokens_per_layer", "per_layer_model_projection",
                                                                 "per_layer_projection_norm")]
    unread = {ours for ours, _ in gemma4_unread(cfg)}
    for i in range(cfg.n_layers):
        for hf, ours in HF_LAYER_NAMES["gemma4"].items():
            name = f"blocks.{i}.{ours}.weight"
            no_per_layer = "per_layer" in hf and not cfg.hidden_size_per_layer_input
            if hf in ("self_attn", "mlp") or name in unread or no_per_layer:
                continue
            names.append((name, f"model.layers.{i}.{hf}.weight"))
        names.append((f"blocks.{i}.layer_scalar", f"model.layers.{i}.layer_scalar"))
    names.append(("final_norm.weight", "model.norm.weight"))
    if not cfg.tie_word_embeddings:
        names.append(("out_head.weight", "lm_head.weight"))
    return names


def gemma4_unread(cfg: Gemma4Config) -> list[tuple[str, str]]:
    """The tensors the notebook builds in every kv-shared layer and no forward pass reads (k_proj, v_proj, k_norm):
    (its name, the released checkpoints' name). transformers' own files leave them out."""
    return [(f"blocks.{i}.att.{m}.weight", f"model.layers.{i}.self_attn.{m}.weight")
            for i, src in enumerate(cfg.kv_shared_from) if src is not None for m in ("k_proj", "v_proj", "k_norm")]


def bonus_unread(cfg, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (the notebook's names) with zeros for each tensor a forward pass never reads that the file left out
    (Gemma 4's kv-shared layers' k_proj, v_proj, k_norm, absent from transformers' files); others as they are."""
    if getattr(cfg, "family", None) != "gemma4":
        return state
    d, g = cfg.emb_dim, cfg.n_kv_heads
    state = dict(state)
    for ours, _ in gemma4_unread(cfg):
        hd = cfg.head_dim_of(cfg.layer_types[int(ours.split(".")[1])])
        state.setdefault(ours, torch.zeros((hd,) if ".k_norm." in ours else (g * hd, d)))
    return state


def _one_id(value: Any) -> int | None:
    if isinstance(value, list):
        return value[0] if value else None
    return value if isinstance(value, int) else None


def bonus_hf_names(cfg: Olmo3Config | TinyAyaConfig | Gemma4Config) -> list[tuple[str, str]]:
    """(the notebook's name, transformers' name) of every stored tensor; a tied head is stored once."""
    if cfg.family == "gemma4":
        return gemma4_hf_names(cfg)
    names = [("tok_emb.weight", "model.embed_tokens.weight")]
    layer = HF_LAYER_NAMES[cfg.family]
    for i in range(cfg.n_layers):
        for hf, ours in layer.items():
            if hf in ("self_attn", "mlp"):
                continue
            leaves = ("weight", "bias") if hf.endswith("_proj") and hf.startswith("self_attn") and cfg.attention_bias \
                else ("weight",)
            names += [(f"{BLOCKS[cfg.family]}.{i}.{ours}.{leaf}", f"model.layers.{i}.{hf}.{leaf}") for leaf in leaves]
    names.append(("final_norm.weight", "model.norm.weight"))
    if not cfg.tie_word_embeddings:
        names.append(("out_head.weight", "lm_head.weight"))
    return names


def gemma4_config_to_hf(cfg: Gemma4Config) -> dict[str, Any]:
    """The config.json transformers' Gemma4ForCausalLM reads for `cfg` (gemma4_config_from_hf's inverse)."""
    full = {"rope_type": cfg.rope_global_type, "rope_theta": cfg.rope_global_base}
    if cfg.rope_global_type == "proportional":
        full["partial_rotary_factor"] = cfg.rope_global_partial_rotary_factor
    return {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "vocab_size": cfg.vocab_size,
            "vocab_size_per_layer_input": cfg.vocab_size_per_layer_input, "hidden_size": cfg.emb_dim,
            "intermediate_size": cfg.hidden_dim, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "global_head_dim": cfg.global_head_dim, "max_position_embeddings": cfg.context_length,
            "sliding_window": cfg.sliding_window, "layer_types": list(cfg.layer_types),
            "hidden_size_per_layer_input": cfg.hidden_size_per_layer_input,
            "num_kv_shared_layers": cfg.num_kv_shared_layers, "use_double_wide_mlp": cfg.use_double_wide_mlp,
            "final_logit_softcapping": cfg.final_logit_softcap, "tie_word_embeddings": cfg.tie_word_embeddings,
            "rms_norm_eps": cfg.layer_norm_eps, "pad_token_id": cfg.pad_token_id,
            "hidden_activation": "gelu_pytorch_tanh",
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_base},
                                "full_attention": full}}


def bonus_config_to_hf(cfg: Olmo3Config | TinyAyaConfig | Gemma4Config) -> dict[str, Any]:
    """The config.json transformers reads for `cfg` (written by export; the tests build theirs with transformers)."""
    if cfg.family == "gemma4":
        return gemma4_config_to_hf(cfg)
    arch = next(a for a, f in HF_BONUS.items() if f == cfg.family)
    raw = {"architectures": [arch], "model_type": {"olmo3": "olmo3", "tiny_aya": "cohere2"}[cfg.family],
           "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.context_length, "hidden_size": cfg.emb_dim,
           "num_attention_heads": cfg.n_heads, "num_hidden_layers": cfg.n_layers, "intermediate_size": cfg.hidden_dim,
           "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "sliding_window": cfg.sliding_window,
           "layer_types": list(cfg.layer_types), "attention_bias": cfg.attention_bias, "hidden_act": "silu",
           "tie_word_embeddings": cfg.tie_word_embeddings, "torch_dtype": "float32"}
    if cfg.family == "olmo3":
        full = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_base}
        if cfg.rope_type == "yarn":
            full |= {"factor": cfg.rope_factor, "attention_factor": cfg.rope_attention_factor,
                     "original_max_position_embeddings": cfg.rope_orig_max, "beta_fast": cfg.beta_fast,
                     "beta_slow": cfg.beta_slow}
        raw |= {"rms_norm_eps": cfg.rms_norm_eps,
                "rope_parameters": {"full_attention": full,
                                    "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_base}}}
    else:
        raw |= {"layer_norm_eps": cfg.layer_norm_eps, "logit_scale": cfg.logit_scale,
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base}}
    return raw


_GLASS: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, nn.Module]]" = weakref.WeakKeyDictionary()


def bonus_glass(module: nn.Module) -> nn.Module | None:
    """transformers' Olmo3ForCausalLM, Cohere2ForCausalLM or Gemma4ForCausalLM as the glass model whose every
    parameter is a view of the module's own tensor (nothing copied; Gemma 4's never-read shared-layer tensors are
    zeros), made once per module (again if its tensors were replaced); None for any other module. adopt.py checks
    its logits against the module's once."""
    config = getattr(module, "config", None)
    family = HF_MODEL_TYPES.get(getattr(config, "model_type", None))
    if family is None or not isinstance(getattr(module, "lm_head", None), nn.Module):
        return None
    fingerprint = tuple((p.data_ptr(), p.dtype, p.device) for p in module.parameters())
    found = _GLASS.get(module)
    if found is not None and found[0] == fingerprint:
        return found[1]
    from . import build_model
    cfg = bonus_config_from_hf(config.to_dict() | {"architectures": [type(module).__name__]}, type(module).__name__)
    own = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers())
    with torch.device("meta"):
        glass = build_model(cfg)
    for ours, theirs in bonus_hf_names(cfg):
        owner, _, leaf = ours.rpartition(".")
        if leaf in glass.get_submodule(owner)._buffers:  # Gemma 4's layer_scalar
            glass.get_submodule(owner)._buffers[leaf] = own[theirs].detach()
            continue
        setattr(glass.get_submodule(owner), leaf, nn.Parameter(own[theirs].detach(), requires_grad=False))
    weight = module.lm_head.weight
    for ours, zeros in bonus_unread(cfg, {}).items():  # never read: zeros beside the module's tensors
        owner, _, leaf = ours.rpartition(".")
        setattr(glass.get_submodule(owner), leaf, nn.Parameter(zeros.to(weight), requires_grad=False))
    glass.tie_weights()
    glass.adopted_kind = f"transformers' {type(module).__name__}"
    glass.adopted_from = f"{glass.adopted_kind}, read in place as glassgpt's {type(glass).__name__}"
    _GLASS[module] = (fingerprint, glass.eval())
    return glass

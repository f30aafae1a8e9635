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

from ..errors import CheckpointError, ConfigError, TokenizerError
from ..families import BONUS_MODELS, FAMILIES, FamilyConfig, RopeFreq, build_model, is_family_model, raise_moe
from ..families.bonus_hf import HF_BONUS, bonus_config_from_hf, bonus_hf_names
from .checks import on_meta
from .family_tokenizers import family_tokenizer
from .files import atomic_write, read_json, read_safetensors

# transformers' class name -> the family that reads it
HF_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama3"} | HF_BONUS
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
        raw = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    arch = hf_architecture(raw) if isinstance(raw, dict) else None
    return arch is not None and arch != "GPT2LMHeadModel"


def config_from_hf(raw: dict[str, Any], source: str = "config.json") -> FamilyConfig:
    """The FamilyConfig of a transformers config.json (Qwen3ForCausalLM or LlamaForCausalLM)."""
    arch = hf_architecture(raw)
    if raw.get("num_experts"):  # Qwen3MoeForCausalLM: a router and experts in place of the feed-forward
        raise_moe(raw)
    if arch not in HF_ARCHITECTURES:
        raise CheckpointError(f"{source} is a {arch or 'model with no architectures entry'}"
                              f"{' (' + str(raw.get('model_type')) + ')' if raw.get('model_type') else ''}: "
                              f"glassgpt covers {COVERED} and GPT2LMHeadModel (gpt2)")
    family = HF_ARCHITECTURES[arch]
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
            norm_eps=float(raw.get("rms_norm_eps", 1e-6)))
    except KeyError as e:
        raise CheckpointError(f"{source} has no {e.args[0]!r}: it is not a whole {arch} config") from None
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def config_to_hf(cfg: FamilyConfig) -> dict[str, Any]:
    """The config.json that transformers' Qwen3ForCausalLM / LlamaForCausalLM reads for `cfg`."""
    arch = next(a for a, f in HF_ARCHITECTURES.items() if f == cfg.family)
    raw = {"architectures": [arch], "model_type": cfg.family.replace("llama3", "llama"),
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
    return raw


def hf_names(cfg: FamilyConfig) -> list[tuple[str, str]]:
    """(the book's name, Hugging Face's name) of every stored tensor; a tied head is stored once."""
    if cfg.family in BONUS_MODELS:
        return bonus_hf_names(cfg)
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
        names += [(f"{b}.norm1.{norm}", f"{h}.input_layernorm.weight"),
                  (f"{b}.ff.fc1.weight", f"{h}.mlp.gate_proj.weight"),  # the gate: silu(fc1(x))
                  (f"{b}.ff.fc2.weight", f"{h}.mlp.up_proj.weight"),
                  (f"{b}.ff.fc3.weight", f"{h}.mlp.down_proj.weight"),
                  (f"{b}.norm2.{norm}", f"{h}.post_attention_layernorm.weight")]
    names.append((f"final_norm.{norm}", "model.norm.weight"))
    if not cfg.tie_embeddings:
        names.append(("out_head.weight", "lm_head.weight"))
    return names


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
            keys = json.loads(side.read_text(encoding="utf-8"))
            return "n_kv_groups" in keys or ("n_kv_heads" in keys and "layer_types" in keys)  # the bonus notebooks'
        except (OSError, ValueError):
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
    values = read_json(book_config_path(spec), what=f"the config of {spec}")
    if "n_kv_heads" in values:  # a bonus notebook's dict: OLMo 3's has rms_norm_eps, Tiny Aya's layer_norm_eps
        return BONUS_MODELS["tiny_aya" if "layer_norm_eps" in values else "olmo3"][1].from_dict(values)
    tie = bool(values.pop("tie_embeddings", False))
    return FamilyConfig.from_book_dict("qwen3" if "qk_norm" in values else "llama3", values, tie_embeddings=tie)


def load_family_tokenizer(spec: str | os.PathLike):
    """The tokenizer saved in the model's folder (or beside its .pth), checked against its vocabulary."""
    cfg = read_family_config(spec)
    folder = Path(spec) if Path(spec).is_dir() else Path(spec).parent
    tokenizer = family_tokenizer(folder, cfg.family, cfg.vocab_size)
    if tokenizer is None:
        wanted = "tokenizer.json" if cfg.family != "llama3" else "tokenizer.model"
        raise TokenizerError(f"{folder} has no {wanted}: put the model's own {wanted} beside its weights")
    return tokenizer


# --- reading ------------------------------------------------------------------------------------

def hf_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a folder's model.safetensors, or of every shard model.safetensors.index.json names."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, what="the shards' index").get("weight_map")
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
    return config_from_hf(read_json(path / "config.json"), str(path / "config.json"))


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


def family_of_state(state: dict[str, Any]) -> str | None:
    """Which family a book state dict is, told by its names: QK-norm and `scale` are Qwen3's, `norm1.weight` Llama's,
    post-feed-forward norms in `blocks` OLMo 3's, one `input_layernorm` per block Tiny Aya's."""
    if "blocks.0.post_feedforward_layernorm.weight" in state:
        return "olmo3"
    if "trf_blocks.0.input_layernorm.weight" in state:
        return "tiny_aya"
    if "trf_blocks.0.norm1.scale" in state:
        return "qwen3"
    if "trf_blocks.0.norm1.weight" in state:
        return "llama3"
    return None


def read_book_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # weights only: nothing unpickled
    except Exception as e:  # torch raises many kinds for a file that is not a state dict
        raise CheckpointError(f"cannot read {path} as a state dict: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict")
    return state


def book_config_path(path: str | os.PathLike) -> Path:
    return Path(path).with_suffix(".json")


def load_book_family(path: str | os.PathLike, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32) -> nn.Module:
    """The glass model of the book's Qwen3Model / Llama3Model state dict, with its config JSON beside it
    (model.json for model.pth: the book's config dict, `dtype` as a string, plus `tie_embeddings`)."""
    state = read_book_state(path)
    family = family_of_state(state)
    if family is None:
        raise CheckpointError(f"{path} is not a state dict of the book's Qwen3Model, Llama3Model, Olmo3Model or "
                              "TinyAyaModel (no trf_blocks.0.norm1.scale or .weight, blocks.0.post_feedforward_layernorm"
                              ".weight or trf_blocks.0.input_layernorm.weight)")
    side = book_config_path(path)
    if not side.is_file():
        raise CheckpointError(f"{path} needs its config: the book's config dict as JSON in {side} "
                              f"(glassgpt export --format book writes both)")
    values = read_json(side, what=f"the config of {path}")
    if family in BONUS_MODELS:  # the notebook's config dict, its dtype as a string
        try:
            cfg = BONUS_MODELS[family][1].from_dict(values)
        except ConfigError as e:
            raise ConfigError(f"{side}: {e}") from None
        return model_from_book_state(cfg, state, str(path), device, dtype)
    tie = bool(values.pop("tie_embeddings", False))
    cfg = FamilyConfig.from_book_dict(family, values, tie_embeddings=tie)
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

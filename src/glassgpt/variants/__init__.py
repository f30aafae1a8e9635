"""Chapter 4's variants on the GPT base, one glass file each, as the book's repository has them.

    gqa.py  grouped-query attention (ch04/04_gqa): g key/value heads shared by the h query heads
    mla.py  multi-head latent attention (ch04/05_mla): a c-wide latent cached, keys and values made from it
    swa.py  sliding-window attention (ch04/06_swa): a query sees the last W tokens; the cache keeps W
    moe.py  a mixture of experts (ch04/07_moe): E SwiGLU feed-forwards, k of them per token
    base.py what they keep of GPT-2: the model, the block, the repository's cache API, greedy generation

    cfg = GQAConfig(emb_dim=768, n_heads=12, n_layers=12, n_kv_groups=4)
    model = build_model(cfg)                      # gqa.GPTModel, by the config's type
    ids = generate_text_simple_cached(model, prompt_ids, 20)
    kv_bytes_per_token(cfg, torch.bfloat16), kv_bytes_per_token(gpt2_config(cfg), torch.bfloat16)

Each model runs `model(ids, use_cache=True)` and `model.reset_kv_cache()` as the repository's do;
`glassgpt.generate` drives them through that cache (generate.py's OwnCacheSteps); the engine's native step does not.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..config import GPTConfig
from ..errors import ConfigError
from . import gqa, mla, moe, swa
from .base import CachedGPTModel, generate_text_simple_cached, mha_kv_cache_bytes
from .gqa import GQAConfig, GroupedQueryAttention
from .mla import MLAConfig, MultiHeadLatentAttention
from .moe import MoEConfig, MoEFeedForward
from .swa import MultiHeadAttentionWithSWA, SWAConfig

# Each variant's config type, and its glass file.
VARIANTS = {GQAConfig: gqa, MLAConfig: mla, SWAConfig: swa, MoEConfig: moe}
CONFIGS = {cfg.variant: cfg for cfg in VARIANTS}  # "gqa" -> GQAConfig, ...: what a config JSON's "variant" names

__all__ = ["CachedGPTModel", "GQAConfig", "GroupedQueryAttention", "MLAConfig", "MoEConfig", "MoEFeedForward",
           "MultiHeadAttentionWithSWA", "MultiHeadLatentAttention", "SWAConfig", "VARIANTS", "build_model", "config_from_dict", "random_model",
           "generate_text_simple_cached", "gpt2_config", "kv_bytes_per_token", "kv_cache_bytes", "variant_of"]


def own_fields(cfg_type: type) -> set[str]:
    """The fields a variant's config adds to GPT-2's (GQAConfig: n_kv_groups)."""
    return {f.name for f in dataclasses.fields(cfg_type)} - {f.name for f in dataclasses.fields(GPTConfig)}


def variant_named(values: dict) -> str | None:
    """The variant a config dict is for: the one its "variant" names, else the one whose fields it holds (the
    repository's GPT_CONFIG_124M, as its script builds it, names none); None for GPT-2's fields alone."""
    if "variant" in values:
        named = values["variant"]
        if named not in CONFIGS:
            raise ConfigError(f"variant {named!r} is not one of chapter 4's: {', '.join(CONFIGS)} (or leave variant out "
                              "for GPT-2)")
        return named
    told = {name: sorted(own_fields(cfg) & set(values)) for name, cfg in CONFIGS.items()}
    told = {name: fields for name, fields in told.items() if fields}
    if len(told) > 1:
        raise ConfigError("the config holds fields of " + " and ".join(f"{name} ({', '.join(fields)})"
                                                                     for name, fields in told.items())
                          + ": chapter 4's variants swap one part each; keep one variant's fields")
    return next(iter(told), None)


def config_from_dict(values: dict) -> GPTConfig | None:
    """The variant's config of a config dict (variant_named), or None for a dict of GPT-2's fields."""
    named = variant_named(values)
    return None if named is None else CONFIGS[named].from_dict(values)


def build_model(cfg: GPTConfig) -> CachedGPTModel:
    """The glass model of the variant `cfg` configures, with PyTorch's default initialisation (as the repository's)."""
    return VARIANTS[type(cfg)].GPTModel(cfg)


def random_model(cfg: GPTConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> CachedGPTModel:
    """The glass model of `cfg` in eval mode, drawn as the repository's scripts draw it (`torch.manual_seed(seed)`,
    then `GPTModel(cfg)`: PyTorch's defaults), on the CPU and then moved; the caller's RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(cfg)
    return model.to(device=device, dtype=dtype).eval()


def gpt2_config(cfg: GPTConfig) -> GPTConfig:
    """The same shape with GPT-2's own parts: the GPTConfig fields of a variant's config."""
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    return GPTConfig(**{k: v for k, v in dataclasses.asdict(cfg).items() if k in fields})


def kv_cache_bytes(cfg: GPTConfig, dtype: torch.dtype, num_tokens: int, batch_size: int = 1) -> int:
    """Bytes the KV cache of `cfg`'s model holds after `num_tokens` tokens of `batch_size` sequences
    (GPT-2's multi-head attention for a plain GPTConfig)."""
    if type(cfg) is GPTConfig:
        return mha_kv_cache_bytes(cfg, dtype, num_tokens, batch_size)
    return VARIANTS[type(cfg)].kv_cache_bytes(cfg, dtype, num_tokens, batch_size)


def kv_bytes_per_token(cfg: GPTConfig, dtype: torch.dtype) -> float:
    """KV-cache bytes per token at a full context (cfg.context_length tokens): exact for GPT-2, GQA, MLA
    and MoE, which keep the same per token; for sliding windows, the average (a window layer keeps W)."""
    return kv_cache_bytes(cfg, dtype, cfg.context_length) / cfg.context_length


def variant_of(model: nn.Module) -> str | None:
    """The variant file's name ("gqa", ...) of one of these models; None for any other module."""
    for module in VARIANTS.values():
        if type(model) is module.GPTModel:
            return module.__name__.rpartition(".")[2]
    return None

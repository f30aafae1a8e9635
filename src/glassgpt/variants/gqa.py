"""GPT-2 with grouped-query attention (the book repository's ch04/04_gqa, gpt_with_kv_gqa.py).

Shape legend (base.py's, plus one letter):
    b batch   t new tokens   s positions attended   d emb_dim   h n_heads   hd head size = d // h
    g  n_kv_groups: the key/value heads, each shared by h // g neighbouring query heads

    x [b, t, d] --W_query--> [b, h, t, hd]
                --W_key----> [b, g, t, hd]  --cache--> [b, g, s, hd] --repeat_interleave--> [b, h, s, hd]
                --W_value--> [b, g, t, hd]  --cache--> [b, g, s, hd] --repeat_interleave--> [b, h, s, hd]
    softmax(q k^T / sqrt(hd)), causal -> @ v -> [b, t, h * hd] --out_proj--> [b, t, d]

Only g key and value heads are computed and cached: the KV cache shrinks by h / g. With g = h it
is GPT-2's multi-head attention; with g = 1, multi-query attention. The rest is GPT-2's (base.py,
model.py). The repository's names: `GroupedQueryAttention`, its `num_kv_groups` and `group_size`,
the config key `n_kv_groups`; its out_proj has no bias.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from .. import anatomy as an
from ..errors import ConfigError
from ..model import FeedForward, attention_weights
from .base import CachedGPTModel, TransformerBlock, VariantConfig, append_to_cache, describe_gpt_base, element_bytes


@dataclass(frozen=True)
class GQAConfig(VariantConfig):
    variant = "gqa"
    n_kv_groups: int = 4  # g: key/value heads; n_heads must be a multiple of it

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.n_kv_groups, int) or self.n_kv_groups < 1 or self.n_heads % self.n_kv_groups:
            raise ConfigError(f"n_kv_groups must divide n_heads ({self.n_heads}), got {self.n_kv_groups!r}")

    @property
    def kv_heads(self) -> tuple[int, int]:
        return self.n_kv_groups, self.head_dim


class GroupedQueryAttention(nn.Module):
    """Causal attention with h query heads sharing g key/value heads (the repository's GQA)."""

    def __init__(self, cfg: GQAConfig):
        super().__init__()
        d = cfg.emb_dim
        self.d_out = d
        self.num_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.num_kv_groups = cfg.n_kv_groups
        self.group_size = cfg.n_heads // cfg.n_kv_groups
        self.W_key = nn.Linear(d, self.num_kv_groups * self.head_dim, bias=cfg.qkv_bias)    # [b, t, d] -> [b, t, g*hd]
        self.W_value = nn.Linear(d, self.num_kv_groups * self.head_dim, bias=cfg.qkv_bias)  # [b, t, d] -> [b, t, g*hd]
        self.W_query = nn.Linear(d, d, bias=cfg.qkv_bias)
        self.out_proj = nn.Linear(d, d, bias=False)
        self.dropout = nn.Dropout(cfg.drop_rate)
        self.register_buffer("cache_k", None, persistent=False)  # [b, g, s, hd]: g heads, not h copies
        self.register_buffer("cache_v", None, persistent=False)

    def forward(self, x: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        """`[b, t, d] -> [b, t, d]`; with `use_cache`, x holds the tokens after those cached."""
        b, t, _ = x.shape
        q = self.W_query(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)     # [b, h, t, hd]
        k = self.W_key(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)   # [b, g, t, hd]
        v = self.W_value(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)  # [b, g, t, hd]
        if use_cache:
            k, v = append_to_cache(self, k, v)  # [b, g, s, hd]
        # Query heads 0..group_size-1 share key head 0, the next group_size key head 1, ...:
        # repeat_interleave gives [K1, K1, K2, K2]; repeat would give [K1, K2, K1, K2].
        k = k.repeat_interleave(self.group_size, dim=1)  # [b, g, s, hd] -> [b, h, s, hd]
        v = v.repeat_interleave(self.group_size, dim=1)
        attn_weights = self.dropout(attention_weights(q, k))  # [b, h, t, s], causal, / sqrt(hd)
        context = (attn_weights @ v).transpose(1, 2).reshape(b, t, self.d_out)  # [b, h, t, hd] -> [b, t, d]
        return self.out_proj(context)

    def reset_cache(self) -> None:
        self.cache_k, self.cache_v = None, None


class GPTModel(CachedGPTModel):
    """GPT-2 whose attention is grouped-query: ids `[b, t]` -> logits `[b, t, V]` (base.CachedGPTModel)."""

    def make_block(self, cfg: GQAConfig, i: int) -> TransformerBlock:
        return TransformerBlock(cfg, GroupedQueryAttention(cfg), FeedForward(cfg))


def describe(cfg: GQAConfig) -> an.Anatomy:
    """This file's model as data (anatomy.py): GPT-2's, with g key/value groups, W_key and W_value [g * hd, d]."""
    d, kv = cfg.emb_dim, cfg.n_kv_groups * cfg.head_dim

    def attention(b: an.Block) -> an.Attention:
        att = b.attention
        return replace(att, n_kv_groups=cfg.n_kv_groups, key=replace(att.key, out_features=kv),
                       value=replace(att.value, out_features=kv), out=replace(att.out, bias=False))

    return describe_gpt_base(cfg, "GPT-2 with grouped-query attention", ("n_kv_groups",), attention=attention)


def kv_cache_bytes(cfg: GQAConfig, dtype: torch.dtype, num_tokens: int, batch_size: int = 1) -> int:
    """A key and a value of each of the g groups, per token and layer: GPT-2's times g / h."""
    return batch_size * num_tokens * cfg.n_layers * 2 * cfg.n_kv_groups * cfg.head_dim * element_bytes(dtype)


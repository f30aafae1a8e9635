"""GPT-2 with multi-head latent attention (the book repository's ch04/05_mla, gpt_with_kv_mla.py).

Shape legend (base.py's, plus one letter):
    b batch   t new tokens   s positions attended   d emb_dim   h n_heads   hd head size = d // h
    c  latent_dim: the compressed key/value vector of a token (default max(16, d // 8))

    x [b, t, d] --W_query--> q [b, h, t, hd]
                --W_DKV----> latent [b, t, c] --cache--> [b, s, c] --W_UK--> k [b, h, s, hd]
                                                                   --W_UV--> v [b, h, s, hd]
    softmax(q k^T / sqrt(hd)), causal -> @ v -> [b, t, d] --out_proj--> [b, t, d]

DeepSeek-V2's idea, as the repository writes it (without DeepSeek's decoupled RoPE key, since
GPT-2 has no RoPE): keys and values are not cached, a c-wide latent is, and W_UK / W_UV expand it
again at every step. The cache holds c numbers per token and layer where GPT-2's holds 2d. Keys
are then W_UK W_DKV x: multi-head attention whose key and value projections have rank at most c
(tests/test_variants.py checks exactly that). The rest is GPT-2's (base.py, model.py).
The repository's names: `MultiHeadLatentAttention`, `W_DKV`, `W_UK`, `W_UV`, `latent_dim`, `cache_c_kv`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from .. import anatomy as an
from ..errors import ConfigError
from ..model import FeedForward, attention_weights
from .base import CachedGPTModel, TransformerBlock, VariantConfig, describe_gpt_base, element_bytes


@dataclass(frozen=True)
class MLAConfig(VariantConfig):
    variant = "mla"
    latent_dim: int | None = None  # c; None: the repository's default, max(16, emb_dim // 8)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.latent_dim is None:
            object.__setattr__(self, "latent_dim", max(16, self.emb_dim // 8))
        if not isinstance(self.latent_dim, int) or isinstance(self.latent_dim, bool) or self.latent_dim < 1:
            raise ConfigError(f"latent_dim must be a positive integer, got {self.latent_dim!r}")


class MultiHeadLatentAttention(nn.Module):
    """Causal multi-head attention whose keys and values come from a cached c-wide latent."""

    def __init__(self, cfg: MLAConfig):
        super().__init__()
        d = cfg.emb_dim
        self.d_out = d
        self.num_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.latent_dim = cfg.latent_dim
        self.W_query = nn.Linear(d, d, bias=cfg.qkv_bias)                         # per-head queries
        self.W_DKV = nn.Linear(d, self.latent_dim, bias=cfg.qkv_bias)   # [b, t, d] -> [b, t, c]: down
        self.W_UK = nn.Linear(self.latent_dim, d, bias=cfg.qkv_bias)    # [b, s, c] -> [b, s, d]: keys
        self.W_UV = nn.Linear(self.latent_dim, d, bias=cfg.qkv_bias)    # [b, s, c] -> [b, s, d]: values
        self.out_proj = nn.Linear(d, d)
        self.dropout = nn.Dropout(cfg.drop_rate)
        self.register_buffer("cache_c_kv", None, persistent=False)  # [b, s, c]

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [b, t, d] -> [b, h, t, hd]

    def forward(self, x: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        """`[b, t, d] -> [b, t, d]`; with `use_cache`, x holds the tokens after those cached."""
        b, t, _ = x.shape
        q = self.split_heads(self.W_query(x))
        latent = self.W_DKV(x)  # [b, t, c]: all that is kept of this step's keys and values
        if use_cache:
            if self.cache_c_kv is not None:
                latent = torch.cat([self.cache_c_kv, latent], dim=1)  # [b, s - t, c] -> [b, s, c]
            self.cache_c_kv = latent
        k = self.split_heads(self.W_UK(latent))  # [b, s, c] -> [b, h, s, hd]: expanded again at every step
        v = self.split_heads(self.W_UV(latent))
        attn_weights = self.dropout(attention_weights(q, k))  # [b, h, t, s], causal, / sqrt(hd)
        context = (attn_weights @ v).transpose(1, 2).reshape(b, t, self.d_out)  # [b, h, t, hd] -> [b, t, d]
        return self.out_proj(context)

    def reset_cache(self) -> None:
        self.cache_c_kv = None


class GPTModel(CachedGPTModel):
    """GPT-2 whose attention caches a latent: ids `[b, t]` -> logits `[b, t, V]` (base.CachedGPTModel)."""

    def make_block(self, cfg: MLAConfig, i: int) -> TransformerBlock:
        return TransformerBlock(cfg, MultiHeadLatentAttention(cfg), FeedForward(cfg))


def describe(cfg: MLAConfig) -> an.Anatomy:
    """This file's model as data (anatomy.py): GPT-2's, whose attention caches the latent W_DKV makes
    (Attention.latent, [c, d]), keys and values made from it by W_UK and W_UV ([d, c])."""
    d, c = cfg.emb_dim, cfg.latent_dim

    def attention(b: an.Block) -> an.Attention:
        att = b.attention
        return replace(att, latent=an.Linear(f"{att.path}.W_DKV", d, c, cfg.qkv_bias),
                       key=an.Linear(f"{att.path}.W_UK", c, d, cfg.qkv_bias),
                       value=an.Linear(f"{att.path}.W_UV", c, d, cfg.qkv_bias))

    return describe_gpt_base(cfg, "GPT-2 with multi-head latent attention", ("latent_dim",), attention=attention)


def kv_cache_bytes(cfg: MLAConfig, dtype: torch.dtype, num_tokens: int, batch_size: int = 1) -> int:
    """One c-wide latent per token and layer (where GPT-2 keeps a key and a value of d each)."""
    return batch_size * num_tokens * cfg.n_layers * cfg.latent_dim * element_bytes(dtype)

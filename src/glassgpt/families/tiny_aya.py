"""Tiny Aya (Cohere's 3.35B, transformers' Cohere2) as the book's notebook ch05/15_tiny-aya/standalone-tiny-aya.ipynb
writes it.

    ids [b, t]  --tok_emb-->  [b, t, d]        (vocab -> hidden; no pos_emb)
    trf_blocks: n_layers x TransformerBlock    x + att(input_layernorm(x)) + ff(input_layernorm(x)): one norm,
                                               attention and feed-forward side by side ("parallel"), both added
    final_norm                [b, t, d]
    out_head  -->  logits     [b, t, V]        (hidden -> vocab; tied to tok_emb), times logit_scale

Tiny Aya: V = 262,144, d = 2,048, 36 blocks, 16 query heads of 128 sharing 4 key/value heads, SwiGLU to
11,008, three sliding layers (window 4,096) to every full one, RoPE base 50,000. What it changes from Qwen3:
  - the parallel block: attention and the feed-forward read the same normed x, and both outputs are added
    to the residual stream at once (GPT-J's layout), where Qwen3 feeds the feed-forward attention's result;
  - CohereLayerNorm: LayerNorm's mean and variance, a `weight` and no bias (RMSNorm subtracts no mean);
  - positions only in the sliding layers: their queries and keys are rotated (RoPE pairs neighbouring
    dimensions 2i and 2i+1, not halves), while the full layers get no position signal at all: they see
    every earlier token, in no order but what the sliding layers wrote into the residual stream;
  - the logits times `logit_scale` (1.0 in Tiny Aya, 0.0625 in Command R7B).

The state dict's names are the notebook's, so its TinyAyaModel's state dict loads as it is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import anatomy as an
from ..config import known_fields
from ..errors import ConfigError, PromptError
from .layers import FeedForward, RopeTables, describe_swiglu
from .sliding import LayerTypesConfig, WindowKVCache, attention_weights, check_layer_types


@dataclass(frozen=True)
class TinyAyaConfig(LayerTypesConfig):
    """The notebook's TINY_AYA_CONFIG keys (its `dtype` is not a field: the weights carry theirs)."""

    vocab_size: int
    context_length: int
    emb_dim: int
    n_heads: int
    n_layers: int
    hidden_dim: int
    head_dim: int
    n_kv_heads: int
    sliding_window: int
    layer_types: tuple[str, ...]
    rope_base: float
    layer_norm_eps: float = 1e-5
    logit_scale: float = 1.0
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    attention_dropout: float = 0.0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers", "hidden_dim", "head_dim",
                     "n_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        object.__setattr__(self, "layer_types", check_layer_types(self.layer_types, self.n_layers, self.sliding_window))
        if self.head_dim % 2:
            raise ConfigError(f"head_dim is {self.head_dim} but RoPE rotates pairs of dimensions: make it even")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads}): each "
                              "key/value head serves the same number of query heads")
        if not self.rope_base > 0:
            raise ConfigError(f"rope_base must be positive, got {self.rope_base!r}")
        if not 0 < self.layer_norm_eps < 1:
            raise ConfigError(f"layer_norm_eps must be in (0, 1), got {self.layer_norm_eps!r}")

    family = "tiny_aya"

    @property
    def kv_heads(self) -> tuple[int, int]:
        """What a KV cache keeps per token and layer: g key/value heads of hd (rotated in sliding layers)."""
        return self.n_kv_heads, self.head_dim

    @property
    def tie_embeddings(self) -> bool:
        """tie_word_embeddings, under the name the Qwen3/Llama readers ask for."""
        return self.tie_word_embeddings

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TinyAyaConfig":
        """From the notebook's dict (its `dtype` dropped) or this config's own to_dict."""
        values = {k: v for k, v in values.items() if k != "dtype"}
        return cls(**known_fields(cls, values, ConfigError, "Tiny Aya config field"))


# --- the pieces ------------------------------------------------------------------------------------

class CohereLayerNorm(nn.Module):
    """LayerNorm without a bias: `weight` * (x - mean) / sqrt(var + eps), in float32, returned in x's dtype."""

    def __init__(self, emb_dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(emb_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.to(torch.float32)
        mean = x.mean(dim=-1, keepdim=True)
        variance = (x - mean).pow(2).mean(dim=-1, keepdim=True)
        x = (x - mean) * torch.rsqrt(variance + self.eps)
        return (self.weight.to(torch.float32) * x).to(input_dtype)


def compute_rope_params(head_dim: int, theta_base: float, context_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[context_length, hd]`, each pair's angle written twice side by side (2i, 2i+1: neighbours)."""
    pairs = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu")
    inv_freq = 1.0 / (theta_base ** (pairs / head_dim))  # [hd/2]
    positions = torch.arange(context_length, dtype=torch.float32, device="cpu")
    angles = positions[:, None] * inv_freq[None, :]  # [context_length, hd/2]
    angles = torch.repeat_interleave(angles, 2, dim=1)  # [context_length, hd]: a0 a0 a1 a1 ...
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turn each pair (x[2i], x[2i+1]) by its position's angle, in float32: `[b, h, t, hd]`, same shape and dtype.
    cos, sin: `[t, hd]`, rounded to x's dtype first (as transformers' Cohere2 does)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x_float = x.float()
    rotated = torch.stack((-x_float[..., 1::2], x_float[..., ::2]), dim=-1).flatten(-2)  # (-x1, x0, -x3, x2, ...)
    return ((x_float * cos) + (rotated * sin)).to(dtype=x.dtype)


class GroupedQueryAttention(nn.Module):
    """Grouped-query attention: RoPE and a window on sliding layers; a full layer has neither."""

    def __init__(self, cfg: TinyAyaConfig, attn_type: str):
        super().__init__()
        d, hd = cfg.emb_dim, cfg.head_dim
        self.num_heads, self.num_kv_groups, self.head_dim = cfg.n_heads, cfg.n_kv_heads, hd
        self.group_size = cfg.n_heads // cfg.n_kv_heads
        self.d_out = cfg.n_heads * hd
        self.attn_type = attn_type
        self.sliding_window = cfg.sliding_window if attn_type == "sliding_attention" else None
        self.W_query = nn.Linear(d, self.d_out, bias=cfg.attention_bias)  # [b, t, d] -> [b, t, h*hd]
        self.W_key = nn.Linear(d, cfg.n_kv_heads * hd, bias=cfg.attention_bias)  # [b, t, d] -> [b, t, g*hd]
        self.W_value = nn.Linear(d, cfg.n_kv_heads * hd, bias=cfg.attention_bias)  # [b, t, d] -> [b, t, g*hd]
        self.out_proj = nn.Linear(self.d_out, d, bias=cfg.attention_bias)  # [b, t, h*hd] -> [b, t, d]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        b, t, _ = x.shape
        queries = self.W_query(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)    # [b, h, t, hd]
        keys = self.W_key(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)     # [b, g, t, hd]
        values = self.W_value(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        if self.attn_type == "sliding_attention":  # positions enter here, and only in these layers
            queries, keys = apply_rope(queries, cos, sin), apply_rope(keys, cos, sin)
        if cache is not None:
            keys, values = cache.update(keys, values)  # [b, g, s, hd]; a sliding layer keeps its window only
        keys = keys.repeat_interleave(self.group_size, dim=1)      # [b, g, s, hd] -> [b, h, s, hd]
        values = values.repeat_interleave(self.group_size, dim=1)
        attn_weights = attention_weights(queries, keys, self.sliding_window)  # [b, h, t, s]
        context = (attn_weights @ values).transpose(1, 2).reshape(b, t, self.d_out)  # [b, t, h*hd]
        return self.out_proj(context)


class TransformerBlock(nn.Module):
    """Parallel block: x + att(input_layernorm(x)) + ff(input_layernorm(x)), one norm for both."""

    def __init__(self, cfg: TinyAyaConfig, attn_type: str):
        super().__init__()
        self.attn_type = attn_type
        self.att = GroupedQueryAttention(cfg, attn_type)
        self.ff = FeedForward(cfg)
        self.input_layernorm = CohereLayerNorm(cfg.emb_dim, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        normed = self.input_layernorm(x)
        return x + self.att(normed, cos, sin, cache) + self.ff(normed)


class TinyAyaModel(nn.Module):
    def __init__(self, cfg: TinyAyaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)  # [V, d]: vocab -> hidden
        self.trf_blocks = nn.ModuleList(TransformerBlock(cfg, attn_type) for attn_type in cfg.layer_types)
        self.final_norm = CohereLayerNorm(cfg.emb_dim, eps=cfg.layer_norm_eps)
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)  # hidden -> vocab
        self.logit_scale = cfg.logit_scale
        self.rope = RopeTables(*compute_rope_params(cfg.head_dim, cfg.rope_base, cfg.context_length))  # float32
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.out_head.weight = self.tok_emb.weight

    @property
    def tied(self) -> bool:
        """Told by storage: one Parameter for both, not two with equal values."""
        return self.out_head.weight is self.tok_emb.weight

    def kv_cache(self, batch_size: int, max_len: int | None = None, device=None,
                 dtype: torch.dtype = torch.float32) -> WindowKVCache:
        """A cache for `forward(ids, cache)`: full layers keep every position, sliding ones their window."""
        return WindowKVCache(self.cfg.windows, self.cfg.kv_heads, batch_size, max_len or self.cfg.context_length,
                             device, dtype)

    def forward(self, in_idx: torch.Tensor, cache=None, last_only: bool = False) -> torch.Tensor:
        """Token ids `[b, t]` (int64) -> logits `[b, t, V]` in the weights' dtype (`[b, 1, V]` with last_only).
        cache: a kv_cache() holding the tokens before `in_idx` (at positions cache.pos ...); None: whole sequences."""
        t = in_idx.shape[1]
        start = 0 if cache is None else cache.pos
        if start + t > self.cfg.context_length:
            raise PromptError(f"input is {start + t:,} tokens but context_length is {self.cfg.context_length:,}: "
                              "shorten it (generation keeps only the last context_length tokens)")
        x = self.tok_emb(in_idx)  # [b, t] -> [b, t, d]
        cos, sin = self.rope.at(start, t, x.device)  # [t, hd]: read by the sliding layers only
        for i, block in enumerate(self.trf_blocks):
            x = block(x, cos, sin, None if cache is None else cache.layer(i))
        if cache is not None:
            cache.advance(t)
        x = self.final_norm(x)
        if last_only:
            x = x[:, -1:]  # [b, t, d] -> [b, 1, d]
        return self.out_head(x) * self.logit_scale  # [b, t, d] -> [b, t, V]


CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(TinyAyaConfig))


def describe(cfg: TinyAyaConfig) -> an.Anatomy:
    """This file's model as data (anatomy.py): parallel blocks under one bias-free LayerNorm, RoPE (neighbouring
    pairs) and a window in the sliding layers, no position signal in the full ones, SwiGLU, a scaled tied head."""
    d, h, g, hd, eps = cfg.emb_dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.layer_norm_eps

    def block(i: int, layer_type: str) -> an.Block:
        p, bias, sliding = f"trf_blocks.{i}", cfg.attention_bias, layer_type == "sliding_attention"
        att = an.Attention(f"{p}.att", "causal", h, g, hd,
                           query=an.Linear(f"{p}.att.W_query", d, h * hd, bias),
                           key=an.Linear(f"{p}.att.W_key", d, g * hd, bias),
                           value=an.Linear(f"{p}.att.W_value", d, g * hd, bias),
                           out=an.Linear(f"{p}.att.out_proj", h * hd, d, bias),
                           rope=an.Rope(cfg.rope_base, hd, pairs="neighbours") if sliding else None,
                           window=cfg.sliding_window if sliding else None)
        norms = (an.Norm(f"{p}.input_layernorm", "layernorm", d, eps, role="attn_in"),)
        return an.Block(i, p, "parallel", norms, att, describe_swiglu(cfg, p), layer_type=layer_type)

    return an.Anatomy(name="Tiny Aya", source="glassgpt's TinyAyaModel",
                      embedding=an.Embedding("tok_emb", cfg.vocab_size, d),
                      positions=an.Positions("rope", cfg.context_length),
                      blocks=tuple(block(i, t) for i, t in enumerate(cfg.layer_types)),
                      final_norm=an.Norm("final_norm", "layernorm", d, eps, role="final"),
                      head=an.Head("out_head", cfg.vocab_size, cfg.tie_word_embeddings,
                                   logit_scale=None if cfg.logit_scale == 1.0 else cfg.logit_scale),
                      config_fields=CONFIG_FIELDS, decoding="twin")

"""OLMo 3 (7B, 32B) as the book's notebook ch05/13_olmo3/standalone-olmo3.ipynb writes it.

    ids [b, t]  --tok_emb-->  [b, t, d]        (vocab -> hidden; no pos_emb)
    blocks: n_layers x TransformerBlock        x + post_attention_layernorm(att(x)),
                                               then x + post_feedforward_layernorm(ff(x)); RoPE inside att
    final_norm                [b, t, d]
    out_head  -->  logits     [b, t, V]        (hidden -> vocab; its own matrix)

OLMo 3 7B: V = 100,278, d = 4,096, 32 blocks, 32 heads of 128 (32 key/value heads; the 32B shares 8),
SwiGLU to 11,008, three sliding layers (window 4,096) to every full one, RoPE base 500,000 with YaRN.
What it changes from Qwen3 (qwen3.py), stage by stage:
  - the norms move after the sublayers (the "reordered" post-norm): the residual stream itself is never
    normed inside a block, only what attention and the feed-forward add to it;
  - QK-norm over the whole projection (one RMSNorm of h*hd values for the queries, of g*hd for the keys),
    before the heads are split, where Qwen3 norms each head's hd values;
  - sliding and full layers by `layer_types` (sliding.py);
  - YaRN on the full layers' RoPE: slow rotations slowed by `rope_factor`, fast ones kept, a ramp between
    (beta_fast, beta_slow), and cos and sin scaled by `rope_attention_factor`. The sliding layers turn at the
    plain rate: transformers' Olmo3 applies the scaling to "full_attention" only (its rope_parameters per
    layer type), and so does this file; the notebook scales every layer, which differs from it wherever
    rope_type is "yarn" (the released 7B and 32B), and nowhere in the notebook's own tests (rope_type "default").

The state dict's names are the notebook's (`blocks.{i}.att.W_query`, `post_attention_layernorm`, ...), so its
Olmo3Model's state dict loads as it is. The pieces shared with Qwen3 are layers.py's (shape legend there).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import anatomy as an
from ..config import known_fields
from ..errors import ConfigError, PromptError
from .layers import FeedForward, RopeTables, apply_rope, describe_swiglu, rms_norm
from .sliding import LayerTypesConfig, WindowKVCache, attention_weights, check_layer_types

ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class Olmo3Config(LayerTypesConfig):
    """The notebook's OLMO3_CONFIG_7B keys (its `dtype` is not a field: the weights carry theirs)."""

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
    rope_type: str = "default"          # "yarn": the full layers' frequencies scaled (see the module docstring)
    rope_attention_factor: float = 1.0  # YaRN's scale of cos and sin
    rope_factor: float = 1.0
    rope_orig_max: int = 8192           # the context the model was first trained at
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    attention_dropout: float = 0.0
    tie_word_embeddings: bool = False   # not in the notebook's dicts (OLMo 3 keeps its own out_head)
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers", "hidden_dim", "head_dim",
                     "n_kv_heads", "rope_orig_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        object.__setattr__(self, "layer_types", check_layer_types(self.layer_types, self.n_layers, self.sliding_window))
        if self.head_dim % 2:
            raise ConfigError(f"head_dim is {self.head_dim} but RoPE rotates pairs of dimensions: make it even")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads}): each "
                              "key/value head serves the same number of query heads")
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope_type {self.rope_type!r} is not implemented: OLMo 3's glass file has "
                              f"{' and '.join(ROPE_TYPES)}")
        if not self.rope_base > 0 or not self.rope_factor > 0:
            raise ConfigError(f"rope_base and rope_factor must be positive, got {self.rope_base!r}, "
                              f"{self.rope_factor!r}")
        if not 0 < self.rms_norm_eps < 1:
            raise ConfigError(f"rms_norm_eps must be in (0, 1), got {self.rms_norm_eps!r}")

    family = "olmo3"

    @property
    def kv_heads(self) -> tuple[int, int]:
        """What a KV cache keeps per token and layer: g key/value heads of hd (after RoPE)."""
        return self.n_kv_heads, self.head_dim

    @property
    def tie_embeddings(self) -> bool:
        """tie_word_embeddings, under the name the Qwen3/Llama readers ask for."""
        return self.tie_word_embeddings

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "Olmo3Config":
        """From the notebook's dict (its `dtype` and `qk_norm` dropped) or this config's own to_dict."""
        values = {k: v for k, v in values.items() if k not in ("dtype", "qk_norm")}
        return cls(**known_fields(cls, values, ConfigError, "OLMo 3 config field"))


# --- the pieces ------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """The notebook's RMSNorm: `weight` * x / rms(x), in float32 (layers.rms_norm's formula)."""

    def __init__(self, emb_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(emb_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def yarn_inv_freq(cfg: Olmo3Config) -> torch.Tensor:
    """YaRN's frequencies `[hd/2]`: pair i turns at base^(-2i/hd) where it turns often within rope_orig_max
    positions (more than beta_fast turns: kept), at that / rope_factor where it turns seldom (fewer than
    beta_slow: interpolated), and a linear blend between."""
    hd, base = cfg.head_dim, cfg.rope_base
    pos_freqs = base ** (torch.arange(0, hd, 2, dtype=torch.float32, device="cpu") / hd)

    def correction_dim(turns: float) -> float:  # the pair index that turns `turns` times in rope_orig_max positions
        return hd * math.log(cfg.rope_orig_max / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(cfg.beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.beta_slow)), hd - 1)
    ramp = (torch.arange(hd // 2, dtype=torch.float32, device="cpu") - low) / ((high - low) or 0.001)
    keep = 1 - ramp.clamp(0, 1)  # 1: the original frequency, 0: divided by rope_factor
    return (1.0 / (cfg.rope_factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def compute_rope_params(cfg: Olmo3Config, layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[context_length, hd]` of a layer type: plain RoPE, or YaRN on the full layers."""
    hd = cfg.head_dim
    yarn = cfg.rope_type == "yarn" and layer_type == "full_attention"
    plain = 1.0 / (cfg.rope_base ** (torch.arange(0, hd, 2, dtype=torch.float32, device="cpu") / hd))  # [hd/2]
    inv_freq = yarn_inv_freq(cfg) if yarn else plain
    positions = torch.arange(cfg.context_length, dtype=torch.float32, device="cpu")
    angles = positions[:, None] * inv_freq[None, :]  # [context_length, hd/2]
    angles = torch.cat([angles, angles], dim=1)  # split halves, as layers.apply_rope pairs them
    factor = cfg.rope_attention_factor if yarn else 1.0
    return torch.cos(angles) * factor, torch.sin(angles) * factor


class GroupedQueryAttention(nn.Module):
    """Grouped-query attention with QK-norm over the whole projection, RoPE, and a window on sliding layers."""

    def __init__(self, cfg: Olmo3Config, attn_type: str):
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
        self.q_norm = RMSNorm(self.d_out, eps=cfg.rms_norm_eps)  # all h*hd values of a token at once
        self.k_norm = RMSNorm(cfg.n_kv_heads * hd, eps=cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        """`[b, t, d] -> [b, t, d]`. cos, sin: `[t, hd]`, this layer type's angles for these tokens' positions."""
        b, t, _ = x.shape
        queries = self.q_norm(self.W_query(x))  # normed before the split into heads
        keys = self.k_norm(self.W_key(x))
        values = self.W_value(x)
        queries = queries.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)    # [b, h, t, hd]
        keys = keys.view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)      # [b, g, t, hd]
        values = values.view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)  # [b, g, t, hd]
        queries, keys = apply_rope(queries, cos, sin), apply_rope(keys, cos, sin)
        if cache is not None:
            keys, values = cache.update(keys, values)  # [b, g, s, hd]; a sliding layer keeps its window only
        keys = keys.repeat_interleave(self.group_size, dim=1)      # [b, g, s, hd] -> [b, h, s, hd]
        values = values.repeat_interleave(self.group_size, dim=1)
        attn_weights = attention_weights(queries, keys, self.sliding_window)  # [b, h, t, s]
        context = (attn_weights @ values).transpose(1, 2).reshape(b, t, self.d_out)  # [b, t, h*hd]
        return self.out_proj(context)


class TransformerBlock(nn.Module):
    """Post-norm block: x + post_attention_layernorm(att(x)), then x + post_feedforward_layernorm(ff(x))."""

    def __init__(self, cfg: Olmo3Config, attn_type: str):
        super().__init__()
        self.attn_type = attn_type
        self.att = GroupedQueryAttention(cfg, attn_type)
        self.ff = FeedForward(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.emb_dim, eps=cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.emb_dim, eps=cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.att(x, cos, sin, cache))
        x = x + self.post_feedforward_layernorm(self.ff(x))
        return x


class Olmo3Model(nn.Module):
    def __init__(self, cfg: Olmo3Config):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)  # [V, d]: vocab -> hidden
        self.blocks = nn.ModuleList(TransformerBlock(cfg, attn_type) for attn_type in cfg.layer_types)
        self.final_norm = RMSNorm(cfg.emb_dim, eps=cfg.rms_norm_eps)
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)  # hidden -> vocab
        # Angles per layer type, float32 whatever the weights (not buffers: see layers.RopeTables)
        self.rope = {kind: RopeTables(*compute_rope_params(cfg, kind)) for kind in set(cfg.layer_types)}
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
        angles = {kind: table.at(start, t, x.device) for kind, table in self.rope.items()}  # [t, hd] each
        for i, block in enumerate(self.blocks):
            x = block(x, *angles[block.attn_type], None if cache is None else cache.layer(i))
        if cache is not None:
            cache.advance(t)
        x = self.final_norm(x)
        if last_only:
            x = x[:, -1:]  # [b, t, d] -> [b, 1, d]
        return self.out_head(x)  # [b, t, d] -> [b, t, V]


CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(Olmo3Config))


def describe_rope(cfg: Olmo3Config, layer_type: str) -> an.Rope:
    if cfg.rope_type == "yarn" and layer_type == "full_attention":
        values = tuple((k, float(getattr(cfg, k))) for k in ("rope_factor", "rope_attention_factor", "rope_orig_max",
                                                              "beta_fast", "beta_slow"))
        return an.Rope(cfg.rope_base, cfg.head_dim, scaling="yarn", scaling_values=values)
    return an.Rope(cfg.rope_base, cfg.head_dim)


def describe(cfg: Olmo3Config) -> an.Anatomy:
    """This file's model as data (anatomy.py): RoPE in every attention (YaRN on the full layers), post-norm
    blocks, QK-norm over the whole projection, a window on the sliding layers, SwiGLU, an untied head."""
    d, h, g, hd, eps = cfg.emb_dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rms_norm_eps

    def block(i: int, layer_type: str) -> an.Block:
        p, bias = f"blocks.{i}", cfg.attention_bias
        att = an.Attention(f"{p}.att", "causal", h, g, hd,
                           query=an.Linear(f"{p}.att.W_query", d, h * hd, bias),
                           key=an.Linear(f"{p}.att.W_key", d, g * hd, bias),
                           value=an.Linear(f"{p}.att.W_value", d, g * hd, bias),
                           out=an.Linear(f"{p}.att.out_proj", h * hd, d, bias), rope=describe_rope(cfg, layer_type),
                           window=cfg.sliding_window if layer_type == "sliding_attention" else None,
                           q_norm=an.Norm(f"{p}.att.q_norm", "rmsnorm", h * hd, eps, role="q_norm"),
                           k_norm=an.Norm(f"{p}.att.k_norm", "rmsnorm", g * hd, eps, role="k_norm"))
        norms = (an.Norm(f"{p}.post_attention_layernorm", "rmsnorm", d, eps, role="attn_out"),
                 an.Norm(f"{p}.post_feedforward_layernorm", "rmsnorm", d, eps, role="ff_out"))
        return an.Block(i, p, "post", norms, att, describe_swiglu(cfg, p), layer_type=layer_type)

    return an.Anatomy(name="OLMo 3", source="glassgpt's Olmo3Model",
                      embedding=an.Embedding("tok_emb", cfg.vocab_size, d),
                      positions=an.Positions("rope", cfg.context_length),
                      blocks=tuple(block(i, t) for i, t in enumerate(cfg.layer_types)),
                      final_norm=an.Norm("final_norm", "rmsnorm", d, eps, role="final"),
                      head=an.Head("out_head", cfg.vocab_size, cfg.tie_word_embeddings), config_fields=CONFIG_FIELDS,
                      blocks_path="blocks", decoding="twin")

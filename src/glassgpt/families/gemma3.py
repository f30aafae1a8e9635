"""Gemma 3 (the text models, 270M to 27B) as the book's bonus notebook ch05/12_gemma3 writes it.

    ids [b, t]  --tok_emb-->  [b, t, d]  x sqrt(d)   (vocab -> hidden, then scaled: 262,144 -> 640 in 270M)
    blocks: n_layers x TransformerBlock               a norm on each side of att and of ff (four per block)
    final_norm                [b, t, d]
    out_head  -->  logits     [b, t, V]               (hidden -> vocab; tied to tok_emb)

What it changes from Qwen3 (qwen3.py; shape legend in layers.py), stage by stage:
  - the embedding is multiplied by sqrt(emb_dim) (25.3 in 270M), so that its rows, drawn small,
    start the residual stream at the size the blocks' outputs have;
  - RMSNorm multiplies by (1 + scale), its `scale` starting at zero (Gemma stores it zero-centred);
  - "sandwich" blocks: x + post_attention_layernorm(att(input_layernorm(x))), then
    x + post_feedforward_layernorm(ff(pre_feedforward_layernorm(x)));
  - the scores are scaled by query_pre_attn_scalar^-0.5 (256 in 270M, its head_dim) where Qwen3
    divides by sqrt(hd);
  - GeGLU: fc3(gelu_tanh(fc1(x)) * fc2(x)), SwiGLU's shape with GELU's tanh form as the gate;
  - two kinds of layer, by `layer_types`: "sliding_attention" layers see only the last
    `sliding_window` positions (512 in 270M) and turn q and k with RoPE base `rope_local_base`
    (10,000); "full_attention" layers (every sixth) see every earlier position, RoPE base
    `rope_base` (1,000,000). A KV cache keeps only a window's keys for the sliding layers.

The class, parameter and config names are the notebook's (`blocks`, `input_layernorm`, `scale`,
GEMMA3_CONFIG_270M's keys), so its Gemma3Model's state dict loads as it is.
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
from .layers import RopeTables, apply_rope, compute_rope_params

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class Gemma3Config:
    """The notebook's GEMMA3_CONFIG_270M, field for field (its `dtype` aside: the weights carry theirs)."""

    vocab_size: int              # V: 262,144
    context_length: int          # longest input; rows of both RoPE tables
    emb_dim: int                 # d: 640 in 270M
    n_heads: int                 # h: query heads
    n_layers: int
    hidden_dim: int              # GeGLU's inner width
    head_dim: int                # hd: 256 in 270M (not emb_dim // n_heads)
    n_kv_groups: int             # g: key/value heads
    rope_local_base: float       # RoPE's base in the sliding layers: 10,000
    rope_base: float             # RoPE's base in the full layers: 1,000,000
    sliding_window: int          # a sliding layer's query sees this many positions, itself included
    layer_types: tuple[str, ...]  # one per layer: "sliding_attention" or "full_attention"
    query_pre_attn_scalar: float | None = None  # scores times this^-0.5; None: head_dim
    qk_norm: bool = True         # Gemma 3 norms every query and key head
    tie_embeddings: bool = True  # out_head.weight is tok_emb.weight (every released Gemma 3)
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers", "hidden_dim", "head_dim",
                     "n_kv_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim is {self.head_dim} but RoPE rotates pairs of dimensions: choose an even head_dim")
        if self.n_heads % self.n_kv_groups:
            raise ConfigError(f"n_heads ({self.n_heads}) must be divisible by n_kv_groups ({self.n_kv_groups}): each "
                              "key/value group serves the same number of query heads")
        window = self.sliding_window
        if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
            raise ConfigError(f"sliding_window is {window!r}: a sliding layer's query would see no position, not even "
                              "its own; give a positive window (512 in Gemma 3 270M)")
        if not isinstance(self.layer_types, (list, tuple)):
            raise ConfigError(f"layer_types must be a list of {' or '.join(LAYER_TYPES)}, got {self.layer_types!r}")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))  # a JSON list, or the notebook's
        if len(self.layer_types) != self.n_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries but n_layers is {self.n_layers}: give "
                              "one per layer")
        wrong = [t for t in self.layer_types if t not in LAYER_TYPES]
        if wrong:
            raise ConfigError(f"layer_types holds {wrong[0]!r}: each entry is one of {', '.join(LAYER_TYPES)}")
        for name in ("rope_local_base", "rope_base"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.query_pre_attn_scalar is not None and not self.query_pre_attn_scalar > 0:
            raise ConfigError(f"query_pre_attn_scalar must be positive, got {self.query_pre_attn_scalar!r}")
        if not 0 < self.norm_eps < 1:
            raise ConfigError(f"norm_eps must be in (0, 1), got {self.norm_eps!r}")
        for name in ("qk_norm", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")

    # What the rest of glassgpt reads off a family's config (FamilyConfig has the same).
    family = property(lambda self: "gemma3")
    head_dim_value = property(lambda self: self.head_dim)
    group_size = property(lambda self: self.n_heads // self.n_kv_groups)
    kv_heads = property(lambda self: (self.n_kv_groups, self.head_dim))
    out_dim = property(lambda self: self.vocab_size)
    num_classes = property(lambda self: None)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per layer, how many positions its KV cache must keep: the window (sliding), or None (all)."""
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @property
    def scaling(self) -> float:
        """The scores' factor: query_pre_attn_scalar^-0.5 (head_dim^-0.5 without one)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"family": "gemma3", "layer_types": list(self.layer_types)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "Gemma3Config":
        values = {k: v for k, v in values.items() if k not in ("family", "dtype")}
        return cls(**known_fields(cls, values, ConfigError, "config field"))

    def to_book_dict(self, dtype=None) -> dict[str, Any]:
        """The notebook's config dict (GEMMA3_CONFIG_270M's keys), `dtype` as given."""
        book = {k: v for k, v in self.to_dict().items() if k not in ("family", "tie_embeddings", "norm_eps")}
        return book | {"dtype": dtype}

    @classmethod
    def from_book_dict(cls, book: dict[str, Any], tie_embeddings: bool = True) -> "Gemma3Config":
        values = {k: v for k, v in book.items() if k != "dtype"}
        if values.get("family", "gemma3") != "gemma3":  # glassgpt's own field: it may say so, when it agrees
            raise ConfigError(f"book config field family is {values['family']!r}, and the weights are a gemma3 "
                              "model's (family 'gemma3'): correct family or leave it out")
        values.pop("family", None)
        return cls(tie_embeddings=tie_embeddings, **known_fields(cls, values, ConfigError, "book config field"))


GEMMA3_270M = Gemma3Config(vocab_size=262_144, context_length=32_768, emb_dim=640, n_heads=4, n_layers=18,
                           hidden_dim=2048, head_dim=256, n_kv_groups=1, rope_local_base=10_000.0,
                           rope_base=1_000_000.0, sliding_window=512,
                           layer_types=(("sliding_attention",) * 5 + ("full_attention",)) * 3,
                           query_pre_attn_scalar=256)


# --- the model -------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + scale), in float32; `scale` starts at zero, so the norm starts as 1."""

    def __init__(self, emb_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x_f = x.float()
        var = x_f.pow(2).mean(dim=-1, keepdim=True)
        x_norm = x_f * torch.rsqrt(var + self.eps)
        return (x_norm * (1.0 + self.scale.float())).to(input_dtype)

    def extra_repr(self) -> str:
        return f"{self.scale.shape[0]}, eps={self.eps}"


class FeedForward(nn.Module):
    """GeGLU: fc3(gelu_tanh(fc1(x)) * fc2(x)). fc1 is the gate (gate_proj), fc2 the up (up_proj)."""

    def __init__(self, cfg: Gemma3Config):
        super().__init__()
        self.fc1 = nn.Linear(cfg.emb_dim, cfg.hidden_dim, bias=False)  # [b, t, d] -> [b, t, f]
        self.fc2 = nn.Linear(cfg.emb_dim, cfg.hidden_dim, bias=False)  # [b, t, d] -> [b, t, f]
        self.fc3 = nn.Linear(cfg.hidden_dim, cfg.emb_dim, bias=False)  # [b, t, f] -> [b, t, d]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(nn.functional.gelu(self.fc1(x), approximate="tanh") * self.fc2(x))


class GroupedQueryAttention(nn.Module):
    """Qwen3's grouped-query attention with QK-norm, scaled by query_pre_attn_scalar^-0.5, and, in a sliding
    layer, each query seeing only the last `window` positions."""

    def __init__(self, cfg: Gemma3Config, window: int | None):
        super().__init__()
        d, hd = cfg.emb_dim, cfg.head_dim
        self.num_heads, self.num_kv_groups, self.group_size = cfg.n_heads, cfg.n_kv_groups, cfg.group_size
        self.head_dim, self.d_out = hd, cfg.n_heads * hd
        self.window = window  # None: a full layer
        self.scaling = cfg.scaling
        self.W_query = nn.Linear(d, self.d_out, bias=False)                 # [b, t, d] -> [b, t, h*hd]
        self.W_key = nn.Linear(d, cfg.n_kv_groups * hd, bias=False)          # [b, t, d] -> [b, t, g*hd]
        self.W_value = nn.Linear(d, cfg.n_kv_groups * hd, bias=False)        # [b, t, d] -> [b, t, g*hd]
        self.out_proj = nn.Linear(self.d_out, d, bias=False)                # [b, t, h*hd] -> [b, t, d]
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, eps=cfg.norm_eps)
            self.k_norm = RMSNorm(hd, eps=cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def attention_weights(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """softmax(q @ k.T * scaling) over the positions each query may see: `[b, h, t, hd]`, `[b, h, s, hd]` ->
        `[b, h, t, s]`. The queries are the last t of the s positions the keys hold, in order."""
        t, s = queries.shape[-2], keys.shape[-2]
        attn_scores = (queries * self.scaling) @ keys.transpose(-2, -1)  # [b, h, t, s]
        attn_scores = attn_scores.masked_fill(hidden_positions(t, s, self.window, queries.device), -torch.inf)
        return torch.softmax(attn_scores, dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        """`[b, t, d] -> [b, t, d]`. cos, sin: `[t, hd]`, this layer's RoPE at these tokens' positions. `cache`: this
        layer's part of a KVCache, which keeps the rotated keys (a sliding layer's: only the last window's)."""
        b, t, _ = x.shape
        queries = self.W_query(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)    # [b, h, t, hd]
        keys = self.W_key(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)     # [b, g, t, hd]
        values = self.W_value(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)  # [b, g, t, hd]
        if self.q_norm is not None:
            queries = self.q_norm(queries)
            keys = self.k_norm(keys)
        queries = apply_rope(queries, cos, sin)
        keys = apply_rope(keys, cos, sin)
        if cache is not None:
            keys, values = cache.update(keys, values)  # [b, g, s, hd]: the earlier positions it keeps, then these
        keys = keys.repeat_interleave(self.group_size, dim=1)      # [b, g, s, hd] -> [b, h, s, hd]
        values = values.repeat_interleave(self.group_size, dim=1)  # [b, g, s, hd] -> [b, h, s, hd]
        attn_weights = self.attention_weights(queries, keys)  # [b, h, t, s]
        context = (attn_weights @ values).transpose(1, 2).reshape(b, t, self.d_out)  # [b, h, t, hd] -> [b, t, h*hd]
        return self.out_proj(context)


def hidden_positions(t: int, s: int, window: int | None, device: torch.device) -> torch.Tensor:
    """`[t, s]`, True where query i (at position s - t + i) may not look at key j: j after it, or (with a
    window) j at least `window` positions before it (the notebook's mask_local = future | far past)."""
    query_pos = torch.arange(s - t, s, device=device)[:, None]  # [t, 1]
    key_pos = torch.arange(s, device=device)[None, :]          # [1, s]
    hidden = key_pos > query_pos
    if window is not None:
        hidden |= query_pos - key_pos >= window
    return hidden


class TransformerBlock(nn.Module):
    """A norm before and after each sublayer: x + post(att(pre(x))), then the same around ff."""

    def __init__(self, cfg: Gemma3Config, attn_type: str):
        super().__init__()
        self.attn_type = attn_type
        self.sliding_window = cfg.sliding_window
        self.att = GroupedQueryAttention(cfg, cfg.sliding_window if attn_type == "sliding_attention" else None)
        self.ff = FeedForward(cfg)
        self.input_layernorm = RMSNorm(cfg.emb_dim, eps=cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.emb_dim, eps=cfg.norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.emb_dim, eps=cfg.norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.emb_dim, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.att(self.input_layernorm(x), cos, sin, cache))
        x = x + self.post_feedforward_layernorm(self.ff(self.pre_feedforward_layernorm(x)))
        return x


class Gemma3Model(nn.Module):
    def __init__(self, cfg: Gemma3Config):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)  # [V, d]: vocab -> hidden
        self.blocks = nn.ModuleList(TransformerBlock(cfg, attn_type) for attn_type in cfg.layer_types)
        self.final_norm = RMSNorm(cfg.emb_dim, eps=cfg.norm_eps)
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)  # hidden -> vocab
        # Two RoPE tables: the sliding layers' (base rope_local_base) and the full layers' (rope_base).
        self.rope_local = RopeTables(*compute_rope_params(cfg.head_dim, cfg.rope_local_base, cfg.context_length))
        self.rope = RopeTables(*compute_rope_params(cfg.head_dim, cfg.rope_base, cfg.context_length))
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.cfg.tie_embeddings:
            self.out_head.weight = self.tok_emb.weight

    @property
    def tied(self) -> bool:
        return self.out_head.weight is self.tok_emb.weight

    def rope_of(self, i: int) -> RopeTables:
        """Block i's RoPE tables: the local ones in a sliding layer, the global ones in a full layer."""
        return self.rope_local if self.cfg.layer_types[i] == "sliding_attention" else self.rope

    def forward(self, in_idx: torch.Tensor, cache=None, last_only: bool = False) -> torch.Tensor:
        """Token ids `[b, t]` (int64) -> logits `[b, t, V]` in the weights' dtype (`[b, 1, V]` with last_only).

        cache: a KVCache (engine/cache.py) holding the tokens before `in_idx`, at positions cache.pos ...
        """
        t = in_idx.shape[1]
        start = 0 if cache is None else cache.pos
        if start + t > self.cfg.context_length:
            raise PromptError(f"input is {start + t:,} tokens but context_length is {self.cfg.context_length:,}: "
                              "shorten it (generation keeps only the last context_length tokens)")
        x = self.tok_emb(in_idx) * (self.cfg.emb_dim ** 0.5)  # [b, t] -> [b, t, d], times sqrt(d)
        for i, block in enumerate(self.blocks):
            cos, sin = self.rope_of(i).at(start, t, x.device)  # [t, hd]: this layer's angles
            x = block(x, cos, sin, None if cache is None else cache.layer(i))
        if cache is not None:
            cache.advance(t)
        x = self.final_norm(x)
        if last_only:
            x = x[:, -1:]  # [b, t, d] -> [b, 1, d]
        return self.out_head(x)  # [b, t, d] -> [b, t, V]


# --- as data (anatomy.py) --------------------------------------------------------------------------

CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(Gemma3Config))


def describe(cfg: Gemma3Config) -> an.Anatomy:
    """This file's model as data: a scaled embedding, sandwich blocks of (1 + weight) RMSNorms, sliding and full
    attention with their own RoPE bases, GeGLU."""
    d, h, g, hd, f = cfg.emb_dim, cfg.n_heads, cfg.n_kv_groups, cfg.head_dim, cfg.hidden_dim

    def norm(path: str, role: str, dim: int = d) -> an.Norm:
        return an.Norm(path, "rmsnorm_plus_one", dim, cfg.norm_eps, weight="scale", role=role)

    def block(i: int, attn_type: str) -> an.Block:
        p, sliding = f"blocks.{i}", attn_type == "sliding_attention"
        qk = {f"{x}_norm": norm(f"{p}.att.{x}_norm", f"{x}_norm", hd) for x in ("q", "k")} if cfg.qk_norm else {}
        att = an.Attention(f"{p}.att", "causal", h, g, hd, query=an.Linear(f"{p}.att.W_query", d, h * hd, False),
                           key=an.Linear(f"{p}.att.W_key", d, g * hd, False),
                           value=an.Linear(f"{p}.att.W_value", d, g * hd, False),
                           out=an.Linear(f"{p}.att.out_proj", h * hd, d, False),
                           rope=an.Rope(cfg.rope_local_base if sliding else cfg.rope_base, hd),
                           window=cfg.sliding_window if sliding else None, scale=cfg.scaling, **qk)
        ff = an.FeedForward(f"{p}.ff", "geglu", f, "gelu_tanh", up=an.Linear(f"{p}.ff.fc2", d, f, False),
                            down=an.Linear(f"{p}.ff.fc3", f, d, False), gate=an.Linear(f"{p}.ff.fc1", d, f, False))
        norms = (norm(f"{p}.input_layernorm", "attn_in"), norm(f"{p}.post_attention_layernorm", "attn_out"),
                 norm(f"{p}.pre_feedforward_layernorm", "ff_in"), norm(f"{p}.post_feedforward_layernorm", "ff_out"))
        return an.Block(i, p, "sandwich", norms, att, ff, layer_type=attn_type)

    return an.Anatomy(name="Gemma 3", source="glassgpt's Gemma3Model",
                      embedding=an.Embedding("tok_emb", cfg.vocab_size, d, scale=math.sqrt(d)),
                      positions=an.Positions("rope", cfg.context_length),
                      blocks=tuple(block(i, t) for i, t in enumerate(cfg.layer_types)),
                      final_norm=norm("final_norm", "final"), head=an.Head("out_head", cfg.vocab_size, cfg.tie_embeddings),
                      config_fields=CONFIG_FIELDS, blocks_path="blocks", exports=("pth", "hf"),
                      decoding="twin")

"""Gemma 4 E2B and E4B (the dense text models) as the book's notebook ch05/17_gemma4/standalone-gemma4.ipynb
writes them.

    ids [b, t]  --tok_emb-->  [b, t, d]  x sqrt(d)          (262,144 -> 1,536 in E2B)
            \\--embed_tokens_per_layer--> [b, t, L, p]       one small vector per layer (p = 256), mixed with a
                                                              projection of the embedding: the per-layer inputs
    blocks: n_layers x Gemma4DenseBlock                     sandwich norms around att and mlp, then the per-layer
                                                              input's gated add, all times layer_scalar
    final_norm                [b, t, d]
    out_head  -->  logits     [b, t, V]  30 tanh(./30)      (tied to tok_emb; softcapped)

What it adds to Gemma 3 (gemma3.py; shape legend in layers.py), stage by stage:
  - per-layer embeddings (`hidden_size_per_layer_input`, the "E" of E2B): a second embedding table gives each
    token L vectors of p, one per layer; each is added to the normed projection of the token's embedding, and
    block i mixes in its own after the feed-forward: x + norm(per_layer_projection(gelu_tanh(gate(x)) * that));
  - the last `num_kv_shared_layers` layers compute no keys or values: each attends over the keys and values
    of the last earlier layer of its own type (20 of E2B's 35 layers), and, with `use_double_wide_mlp`, has a
    feed-forward twice as wide;
  - the values are RMS-normed too, by a norm without any weight (v_norm), and the scores are not scaled
    (QK-norm fixes their size: the scaling is 1);
  - RMSNorm is weight * x / rms(x) (Gemma 3's was (1 + weight));
  - every block's output is multiplied by `layer_scalar`, one stored number per block;
  - the full layers have heads of `global_head_dim` (512, the sliding ones 256) and proportional partial
    RoPE: only the first rope_global_partial_rotary_factor (a quarter) of each head's pairs turn, at
    base^(-2i/512), the others stay still;
  - the logits are capped softly: cap * tanh(logits / cap), cap = final_logit_softcap (30).

The class, parameter, buffer and config names are the notebook's (`blocks.{i}.att.q_proj`, `mlp.gate_proj`,
`layer_scalar`, `embed_tokens_per_layer`, its get_gemma4_dense_config keys), so its Gemma4DenseModel's state
dict loads as it is. Like the notebook, every block builds k_proj, v_proj and k_norm, and the kv-shared layers
never read theirs (transformers' Gemma4 does not build them; the released checkpoints store them). The
forward is the notebook's with reuse_shared_kv=True, as its generation and its KV-cache twin run it and as
transformers does; its reuse_shared_kv=False (each shared layer's own unused keys) matches neither.
Not implemented, refused by the config: attention_k_eq_v and num_global_kv_heads (the 26B/31B models), a
local RoPE other than the plain one, the MoE block.
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
from .gemma3 import hidden_positions
from .layers import RopeTables, apply_rope
from .sliding import LayerTypesConfig, WindowKVCache, check_layer_types

ROPE_GLOBAL_TYPES = ("default", "proportional")


@dataclass(frozen=True)
class Gemma4Config(LayerTypesConfig):
    """The notebook's get_gemma4_dense_config keys (its `dtype` is not a field: the weights carry theirs)."""

    vocab_size: int                   # V: 262,144
    emb_dim: int                      # d: 1,536 in E2B
    hidden_dim: int                   # GeGLU's inner width (twice that in a double-wide kv-shared layer)
    n_layers: int                     # L
    n_heads: int                      # h
    head_dim: int                     # a sliding layer's head size: 256
    n_kv_heads: int                   # g, in every layer
    global_head_dim: int              # a full layer's head size: 512
    context_length: int
    sliding_window: int
    layer_types: tuple[str, ...]
    vocab_size_per_layer_input: int = 262_144
    hidden_size_per_layer_input: int = 0   # p; 0: no per-layer inputs
    num_kv_shared_layers: int = 0          # the last this many layers reuse earlier layers' keys and values
    use_double_wide_mlp: bool = False
    attention_k_eq_v: bool = False         # the larger Gemma 4s' keys-as-values: not implemented
    num_global_kv_heads: int | None = None  # read only with attention_k_eq_v
    rope_local_base: float = 10_000.0
    rope_local_type: str = "default"
    rope_global_base: float = 1_000_000.0
    rope_global_type: str = "proportional"
    rope_global_partial_rotary_factor: float = 0.25
    layer_norm_eps: float = 1e-6
    final_logit_softcap: float | None = None
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "emb_dim", "hidden_dim", "n_layers", "n_heads", "head_dim", "n_kv_heads",
                     "global_head_dim", "context_length", "vocab_size_per_layer_input"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        object.__setattr__(self, "layer_types", check_layer_types(self.layer_types, self.n_layers, self.sliding_window))
        for name in ("head_dim", "global_head_dim"):
            if getattr(self, name) % 2:
                raise ConfigError(f"{name} is {getattr(self, name)} but RoPE rotates pairs of dimensions: make it even")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads}): each "
                              "key/value head serves the same number of query heads")
        for name in ("hidden_size_per_layer_input", "num_kv_shared_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be an integer of 0 or more, got {value!r}")
        if self.num_kv_shared_layers >= self.n_layers:
            raise ConfigError(f"num_kv_shared_layers is {self.num_kv_shared_layers} of {self.n_layers} layers: some "
                              "layer before the shared ones must compute the keys and values they reuse")
        first = self.first_kv_shared_layer
        missing = sorted(set(self.layer_types[first:]) - set(self.layer_types[:first]))
        if missing:
            raise ConfigError(f"the kv-shared layers ({first} on) include {missing[0]} layers but no earlier layer is "
                              f"one: each reuses the keys and values of the last earlier layer of its type")
        if self.attention_k_eq_v:
            raise ConfigError("attention_k_eq_v is true (keys reused as values, the 26B and 31B models): the "
                              "notebook's Gemma4DenseModel has separate k_proj and v_proj")
        if self.rope_local_type != "default":
            raise ConfigError(f"rope_local_type {self.rope_local_type!r} is not implemented: the sliding layers turn "
                              "by plain RoPE")
        if self.rope_global_type not in ROPE_GLOBAL_TYPES:
            raise ConfigError(f"rope_global_type {self.rope_global_type!r} is not implemented: glassgpt's Gemma 4 has "
                              f"{' and '.join(ROPE_GLOBAL_TYPES)}")
        if not 0 < self.rope_global_partial_rotary_factor <= 1:
            raise ConfigError(f"rope_global_partial_rotary_factor must be in (0, 1], got "
                              f"{self.rope_global_partial_rotary_factor!r}")
        for name in ("rope_local_base", "rope_global_base"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.final_logit_softcap is not None and not self.final_logit_softcap > 0:
            raise ConfigError(f"final_logit_softcap must be positive or null, got {self.final_logit_softcap!r}")
        if not 0 < self.layer_norm_eps < 1:
            raise ConfigError(f"layer_norm_eps must be in (0, 1), got {self.layer_norm_eps!r}")

    family = "gemma4"

    @property
    def first_kv_shared_layer(self) -> int:
        """The first layer that reuses keys and values (n_layers when none does)."""
        return self.n_layers - self.num_kv_shared_layers

    @property
    def kv_shared_from(self) -> tuple[int | None, ...]:
        """Per layer, the layer whose keys and values it attends over (None: its own): the last layer of its type
        before the first shared one (the notebook's kv_shared_layer_index)."""
        first, types = self.first_kv_shared_layer, self.layer_types
        source = {t: max(j for j in range(first) if types[j] == t) for t in set(types[first:])}
        return tuple(source[t] if i >= first else None for i, t in enumerate(types))

    def head_dim_of(self, layer_type: str) -> int:
        return self.head_dim if layer_type == "sliding_attention" else self.global_head_dim

    def hidden_dim_of(self, i: int) -> int:
        return self.hidden_dim * (2 if self.use_double_wide_mlp and i >= self.first_kv_shared_layer else 1)

    @property
    def kv_heads(self) -> list[tuple[int, int] | None]:
        """Per layer, what its KV cache keeps per token: (g, its head size); None for a layer that keeps none
        (a kv-shared layer reads its source's)."""
        return [None if src is not None else (self.n_kv_heads, self.head_dim_of(t))
                for t, src in zip(self.layer_types, self.kv_shared_from)]

    @property
    def tie_embeddings(self) -> bool:
        return self.tie_word_embeddings

    @property
    def rope_base(self) -> float:
        """The full layers' base (what `info` names; the sliding layers' is rope_local_base)."""
        return self.rope_global_base

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "Gemma4Config":
        """From the notebook's dict or this config's own to_dict. Its `dtype`, and the keys its tests pass but the
        notebook never reads (qk_norm, n_kv_groups, query_pre_attn_scalar), are dropped."""
        values = {k: v for k, v in values.items()
                  if k not in ("dtype", "family", "qk_norm", "n_kv_groups", "query_pre_attn_scalar")}
        return cls(**known_fields(cls, values, ConfigError, "Gemma 4 config field"))


def get_gemma4_dense_config(model_size: str = "E2B") -> Gemma4Config:
    """The notebook's two configs: E2B (35 layers, 20 kv-shared with double-wide MLPs) and E4B (42, 18 shared)."""
    size = model_size.upper()
    if size not in ("E2B", "E4B"):
        raise ConfigError(f"Gemma 4 dense size {model_size!r} is not one of E2B, E4B")
    e2b = size == "E2B"
    d = 1536 if e2b else 2560
    return Gemma4Config(vocab_size=262_144, emb_dim=d, hidden_dim=4 * d, n_layers=35 if e2b else 42, n_heads=8,
                        head_dim=256, n_kv_heads=1 if e2b else 2, global_head_dim=512, context_length=131_072,
                        sliding_window=512, layer_types=(("sliding_attention",) * (4 if e2b else 5)
                                                         + ("full_attention",)) * 7,
                        hidden_size_per_layer_input=256, num_kv_shared_layers=20 if e2b else 18,
                        use_double_wide_mlp=e2b, final_logit_softcap=30.0)


# --- the pieces ------------------------------------------------------------------------------------

def compute_rope_params(head_dim: int, theta_base: float, context_length: int, rope_type: str = "default",
                        partial_rotary_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[context_length, hd]` (float32). "proportional": only the first
    int(partial_rotary_factor * hd // 2) pairs turn, pair i at theta_base^(-2i/hd) (hd, not the turned width, in
    the exponent); the rest have frequency 0 (cos 1, sin 0: left as they are)."""
    if rope_type == "proportional":
        rope_angles = int(partial_rotary_factor * head_dim // 2)
        turned = 1.0 / (theta_base ** (torch.arange(0, 2 * rope_angles, 2, dtype=torch.float32, device="cpu")
                                       / head_dim))
        inv_freq = torch.cat([turned, torch.zeros(head_dim // 2 - rope_angles, device="cpu")])  # [hd/2]
    else:
        inv_freq = 1.0 / (theta_base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
    positions = torch.arange(context_length, dtype=torch.float32, device="cpu")
    angles = positions[:, None] * inv_freq[None, :]  # [context_length, hd/2]
    angles = torch.cat([angles, angles], dim=1)  # split halves, as layers.apply_rope pairs them
    return torch.cos(angles), torch.sin(angles)


class Gemma4RMSNorm(nn.Module):
    """x / rms(x), times `weight` (with_scale) or nothing (the value norm), in float32."""

    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.with_scale = with_scale
        if with_scale:
            self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_float = x.float()
        x_norm = x_float * torch.pow(x_float.pow(2).mean(dim=-1, keepdim=True) + self.eps, -0.5)
        if self.with_scale:
            x_norm = x_norm * self.weight.float()
        return x_norm.to(dtype=x.dtype)


class Gemma4FeedForward(nn.Module):
    """GeGLU: down_proj(gelu_tanh(gate_proj(x)) * up_proj(x)); twice as wide in a double-wide kv-shared layer."""

    def __init__(self, cfg: Gemma4Config, layer_idx: int):
        super().__init__()
        f = cfg.hidden_dim_of(layer_idx)
        self.gate_proj = nn.Linear(cfg.emb_dim, f, bias=False)  # [b, t, d] -> [b, t, f]
        self.up_proj = nn.Linear(cfg.emb_dim, f, bias=False)    # [b, t, d] -> [b, t, f]
        self.down_proj = nn.Linear(f, cfg.emb_dim, bias=False)  # [b, t, f] -> [b, t, d]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma4Attention(nn.Module):
    """Grouped-query attention with QK-norm, a weightless value norm, unscaled scores, and a window in a sliding
    layer; a kv-shared layer attends over the keys and values its source layer attended over."""

    def __init__(self, cfg: Gemma4Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = cfg.layer_types[layer_idx]
        self.is_sliding = self.layer_type == "sliding_attention"
        self.window = cfg.sliding_window if self.is_sliding else None
        self.head_dim = hd = cfg.head_dim_of(self.layer_type)
        self.num_heads, self.num_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.num_key_value_groups = cfg.n_heads // cfg.n_kv_heads
        d = cfg.emb_dim
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=False)     # [b, t, d] -> [b, t, h*hd]
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)  # [b, t, d] -> [b, t, g*hd]
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)  # [b, t, d] -> [b, t, g*hd]
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=False)     # [b, t, h*hd] -> [b, t, d]
        self.q_norm = Gemma4RMSNorm(hd, eps=cfg.layer_norm_eps)
        self.k_norm = Gemma4RMSNorm(hd, eps=cfg.layer_norm_eps)
        self.v_norm = Gemma4RMSNorm(hd, eps=cfg.layer_norm_eps, with_scale=False)
        self.kv_shared_layer_index = cfg.kv_shared_from[layer_idx]
        self.is_kv_shared_layer = self.kv_shared_layer_index is not None
        # the last layer of each type before the shared ones keeps its keys and values for them
        self.store_full_length_kv = layer_idx in set(cfg.kv_shared_from) - {None}

    def attention_weights(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """softmax(q @ k.T) (no 1/sqrt(hd): QK-norm sets the scale) over what each query may see, in float32:
        `[b, h, t, hd]`, `[b, h, s, hd]` -> `[b, h, t, s]`; the queries are the last t of the s positions."""
        t, s = queries.shape[-2], keys.shape[-2]
        attn_scores = queries @ keys.transpose(-2, -1)  # [b, h, t, s]
        attn_scores = attn_scores.masked_fill(hidden_positions(t, s, self.window, queries.device), -torch.inf)
        return torch.softmax(attn_scores.float(), dim=-1).to(queries.dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None,
                shared_kv: dict | None = None) -> torch.Tensor:
        """`[b, t, d] -> [b, t, d]`. cos, sin: `[t, hd]`, this layer type's angles at these tokens' positions.
        cache: this layer's part of a KV cache (None in a kv-shared layer); shared_kv: the forward pass's
        {layer: (keys, values)}, which a source layer writes and a kv-shared layer reads."""
        b, t, _ = x.shape
        queries = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [b, h, t, hd]
        queries = apply_rope(self.q_norm(queries), cos, sin)
        if self.is_kv_shared_layer:
            keys, values = shared_kv[self.kv_shared_layer_index]  # [b, g, s, hd]: what that layer attended over
        else:
            keys = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)    # [b, g, t, hd]
            values = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [b, g, t, hd]
            keys = apply_rope(self.k_norm(keys), cos, sin)
            values = self.v_norm(values)
            if cache is not None:
                keys, values = cache.update(keys, values)  # [b, g, s, hd]; a sliding layer keeps its window only
            if self.store_full_length_kv and shared_kv is not None:
                shared_kv[self.layer_idx] = (keys, values)
        keys = keys.repeat_interleave(self.num_key_value_groups, dim=1)      # [b, g, s, hd] -> [b, h, s, hd]
        values = values.repeat_interleave(self.num_key_value_groups, dim=1)  # [b, g, s, hd] -> [b, h, s, hd]
        attn_weights = self.attention_weights(queries, keys)  # [b, h, t, s]
        context = (attn_weights @ values).transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return self.o_proj(context)  # [b, t, h*hd] -> [b, t, d]


class Gemma4DenseBlock(nn.Module):
    """x + post(att(pre(x))), x + post(mlp(pre(x))), then x + norm(proj(gelu_tanh(gate(x)) * per_layer_input)),
    all times layer_scalar."""

    def __init__(self, cfg: Gemma4Config, layer_idx: int):
        super().__init__()
        d, eps = cfg.emb_dim, cfg.layer_norm_eps
        self.layer_idx = layer_idx
        self.layer_type = cfg.layer_types[layer_idx]
        self.att = Gemma4Attention(cfg, layer_idx)
        self.mlp = Gemma4FeedForward(cfg, layer_idx)
        self.input_layernorm = Gemma4RMSNorm(d, eps=eps)
        self.post_attention_layernorm = Gemma4RMSNorm(d, eps=eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(d, eps=eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(d, eps=eps)
        self.register_buffer("layer_scalar", torch.ones(1), persistent=True)  # a trained number, stored per block
        self.hidden_size_per_layer_input = p = cfg.hidden_size_per_layer_input
        if p:
            self.per_layer_input_gate = nn.Linear(d, p, bias=False)  # [b, t, d] -> [b, t, p]
            self.per_layer_projection = nn.Linear(p, d, bias=False)  # [b, t, p] -> [b, t, d]
            self.post_per_layer_input_norm = Gemma4RMSNorm(d, eps=eps)

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                cache=None, shared_kv: dict | None = None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.att(self.input_layernorm(x), cos, sin, cache, shared_kv))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        if self.hidden_size_per_layer_input:
            gate = nn.functional.gelu(self.per_layer_input_gate(x), approximate="tanh")  # [b, t, p]
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gate * per_layer_input))
        return x * self.layer_scalar.to(dtype=x.dtype)


class Gemma4DenseModel(nn.Module):
    def __init__(self, cfg: Gemma4Config):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim, padding_idx=cfg.pad_token_id)  # [V, d]
        self.blocks = nn.ModuleList(Gemma4DenseBlock(cfg, i) for i in range(cfg.n_layers))
        self.final_norm = Gemma4RMSNorm(cfg.emb_dim, eps=cfg.layer_norm_eps)
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)  # hidden -> vocab
        self.hidden_size_per_layer_input = p = cfg.hidden_size_per_layer_input
        if p:
            L = cfg.n_layers
            self.embed_tokens_per_layer = nn.Embedding(cfg.vocab_size_per_layer_input, L * p,
                                                       padding_idx=cfg.pad_token_id)  # [V', L*p]
            self.per_layer_model_projection = nn.Linear(cfg.emb_dim, L * p, bias=False)  # [b, t, d] -> [b, t, L*p]
            self.per_layer_projection_norm = Gemma4RMSNorm(p, eps=cfg.layer_norm_eps)
        # float32 angles whatever the weights' dtype (not buffers: see layers.RopeTables)
        self.rope_local = RopeTables(*compute_rope_params(cfg.head_dim, cfg.rope_local_base, cfg.context_length))
        self.rope_global = RopeTables(*compute_rope_params(cfg.global_head_dim, cfg.rope_global_base,
                                                           cfg.context_length, cfg.rope_global_type,
                                                           cfg.rope_global_partial_rotary_factor))
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.out_head.weight = self.tok_emb.weight

    @property
    def tied(self) -> bool:
        return self.out_head.weight is self.tok_emb.weight

    def rope_of(self, i: int) -> RopeTables:
        return self.rope_local if self.cfg.layer_types[i] == "sliding_attention" else self.rope_global

    def kv_cache(self, batch_size: int, max_len: int | None = None, device=None,
                 dtype: torch.dtype = torch.float32) -> WindowKVCache:
        """A cache for `forward(ids, cache)`: full layers keep every position, sliding ones their window, the
        kv-shared layers nothing (they read their source layer's)."""
        return WindowKVCache(self.cfg.windows, self.cfg.kv_heads, batch_size, max_len or self.cfg.context_length,
                             device, dtype)

    def per_layer_inputs(self, in_idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """`[b, t, L, p]`: each token's own per-layer vectors (times sqrt(p)) and the normed projection of its
        embedding x (times d^-0.5), summed and times 2^-0.5 (the notebook's get_ and project_per_layer_inputs)."""
        if not self.hidden_size_per_layer_input:
            return None
        shape = (*in_idx.shape, self.cfg.n_layers, self.hidden_size_per_layer_input)
        own = (self.embed_tokens_per_layer(in_idx) * self.hidden_size_per_layer_input ** 0.5).reshape(shape)
        projected = (self.per_layer_model_projection(x) * self.cfg.emb_dim ** -0.5).reshape(shape)
        return (self.per_layer_projection_norm(projected) + own) * 2.0 ** -0.5

    def forward(self, in_idx: torch.Tensor, cache=None, last_only: bool = False) -> torch.Tensor:
        """Token ids `[b, t]` (int64) -> logits `[b, t, V]` in the weights' dtype (`[b, 1, V]` with last_only).
        cache: a kv_cache() holding the tokens before `in_idx` (at positions cache.pos ...); None: whole sequences."""
        t = in_idx.shape[1]
        start = 0 if cache is None else cache.pos
        if start + t > self.cfg.context_length:
            raise PromptError(f"input is {start + t:,} tokens but context_length is {self.cfg.context_length:,}: "
                              "shorten it (generation keeps only the last context_length tokens)")
        x = self.tok_emb(in_idx) * self.cfg.emb_dim ** 0.5  # [b, t] -> [b, t, d], times sqrt(d)
        per_layer = self.per_layer_inputs(in_idx, x)       # [b, t, L, p]
        angles = {"sliding_attention": self.rope_local.at(start, t, x.device),
                  "full_attention": self.rope_global.at(start, t, x.device)}
        shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, block in enumerate(self.blocks):
            own_cache = None if cache is None or block.att.is_kv_shared_layer else cache.layer(i)
            x = block(x, None if per_layer is None else per_layer[:, :, i], *angles[block.layer_type], own_cache,
                      shared_kv)
        if cache is not None:
            cache.advance(t)
        x = self.final_norm(x)
        if last_only:
            x = x[:, -1:]  # [b, t, d] -> [b, 1, d]
        logits = self.out_head(x)  # [b, t, d] -> [b, t, V]
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


Gemma4Model = Gemma4DenseModel


# --- as data (anatomy.py) --------------------------------------------------------------------------

CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(Gemma4Config))


def describe(cfg: Gemma4Config) -> an.Anatomy:
    """This file's model as data: a scaled embedding with per-layer embeddings, sandwich blocks of RMSNorms,
    sliding and full attention (their own head sizes and RoPE, proportional and partial in the full layers),
    kv-shared layers (their keys, values and the norms on them their source's), the weightless value norm, GeGLU,
    the per-layer inputs, layer_scalar times each block's output, a softcapped tied head."""
    d, h, g, eps = cfg.emb_dim, cfg.n_heads, cfg.n_kv_heads, cfg.layer_norm_eps
    pl, L = cfg.hidden_size_per_layer_input, cfg.n_layers

    def norm(path: str, role: str, dim: int = d) -> an.Norm:
        return an.Norm(path, "rmsnorm", dim, eps, role=role)

    def rope(layer_type: str) -> an.Rope:
        if layer_type == "sliding_attention":
            return an.Rope(cfg.rope_local_base, cfg.head_dim)
        hd = cfg.global_head_dim
        if cfg.rope_global_type == "default":
            return an.Rope(cfg.rope_global_base, hd)
        turned = 2 * int(cfg.rope_global_partial_rotary_factor * hd // 2)
        return an.Rope(cfg.rope_global_base, hd, rotary_dim=turned, scaling="proportional",
                       scaling_values=(("partial_rotary_factor", float(cfg.rope_global_partial_rotary_factor)),))

    def block(i: int, layer_type: str) -> an.Block:
        p, hd, f = f"blocks.{i}", cfg.head_dim_of(layer_type), cfg.hidden_dim_of(i)
        src = cfg.kv_shared_from[i]
        kv = f"blocks.{i if src is None else src}.att"  # a kv-shared layer's keys come from its source's matrices
        att = an.Attention(f"{p}.att", "causal", h, g, hd, query=an.Linear(f"{p}.att.q_proj", d, h * hd, False),
                           key=an.Linear(f"{kv}.k_proj", d, g * hd, False),
                           value=an.Linear(f"{kv}.v_proj", d, g * hd, False),
                           out=an.Linear(f"{p}.att.o_proj", h * hd, d, False), rope=rope(layer_type),
                           window=cfg.sliding_window if layer_type == "sliding_attention" else None,
                           q_norm=norm(f"{p}.att.q_norm", "q_norm", hd), k_norm=norm(f"{kv}.k_norm", "k_norm", hd),
                           v_norm=an.Norm(f"{kv}.v_norm", "rmsnorm", hd, eps, weight=None, role="v_norm"),
                           scale=1.0, kv_shared_from=src)
        ff = an.FeedForward(f"{p}.mlp", "geglu", f, "gelu_tanh", up=an.Linear(f"{p}.mlp.up_proj", d, f, False),
                            down=an.Linear(f"{p}.mlp.down_proj", f, d, False),
                            gate=an.Linear(f"{p}.mlp.gate_proj", d, f, False))
        norms = (norm(f"{p}.input_layernorm", "attn_in"), norm(f"{p}.post_attention_layernorm", "attn_out"),
                 norm(f"{p}.pre_feedforward_layernorm", "ff_in"), norm(f"{p}.post_feedforward_layernorm", "ff_out"))
        own = an.PerLayerInput(an.Linear(f"{p}.per_layer_input_gate", d, pl, False),
                               an.Linear(f"{p}.per_layer_projection", pl, d, False),
                               norm(f"{p}.post_per_layer_input_norm", "per_layer")) if pl else None
        return an.Block(i, p, "sandwich", norms, att, ff, layer_type=layer_type, per_layer_input=own,
                        output_scale="layer_scalar")

    return an.Anatomy(name="Gemma 4", source="glassgpt's Gemma4DenseModel",
                      embedding=an.Embedding("tok_emb", cfg.vocab_size, d, scale=math.sqrt(d),
                                             per_layer="embed_tokens_per_layer" if pl else None,
                                             per_layer_inputs=an.PerLayerInputs(
                                                 cfg.vocab_size_per_layer_input, pl, L,
                                                 an.Linear("per_layer_model_projection", d, L * pl, False),
                                                 norm("per_layer_projection_norm", "per_layer", pl)) if pl else None),
                      positions=an.Positions("rope", cfg.context_length),
                      blocks=tuple(block(i, t) for i, t in enumerate(cfg.layer_types)),
                      final_norm=norm("final_norm", "final"),
                      head=an.Head("out_head", cfg.vocab_size, cfg.tie_word_embeddings,
                                   softcap=cfg.final_logit_softcap),
                      config_fields=CONFIG_FIELDS, blocks_path="blocks", decoding="kv_cache")

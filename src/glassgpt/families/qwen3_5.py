"""Qwen3.5 (the text model of Qwen3.5 0.8B) as the book's `ch05/16_qwen3.5` notebook writes it.

    ids [b, t]  --tok_emb-->  [b, t, d]        (no pos_emb)
    trf_blocks: n_layers x TransformerBlock    x + token_mixer(norm1(x)), then x + ff(norm2(x))
        token_mixer, by cfg.layer_types[i]:
          "linear_attention"  Qwen3_5GatedDeltaNet: a short causal convolution, then the gated
                              delta rule, which keeps one [dk, dv] matrix per head instead of a KV cache
          "full_attention"    GroupedQueryAttention with an output gate and RoPE on the first
                              partial_rotary_factor of each head's dimensions
    final_norm                [b, t, d]
    out_head  -->  logits     [b, t, V]        (tied to tok_emb in 0.8B)

Qwen3.5 0.8B: V = 248,320, d = 1,024, 24 blocks (three linear, then one full, six times), full
attention with 8 query heads of 256 sharing 2 key/value heads, RoPE base 10,000,000 on 64 of the 256
dimensions; linear attention with 16 heads of 128; SwiGLU to 3,584. Every RMSNorm scales by
(1 + weight), its weight starting at zero, except the gated norm inside the linear attention.

What changed from Qwen3 (qwen3.py), stage by stage:
  - three of four attentions are linear: a state S [dk, dv] per head, decayed by exp(g) and corrected
    by the delta rule at every token (S += k (beta (v - S^T k))^T), read by the query (o = S^T q);
    its cost per token and its memory do not grow with the sequence;
  - the full attentions' W_query is twice as wide: per head, hd query rows then hd gate rows, and
    the context is multiplied by sigmoid(gate) before out_proj;
  - RoPE turns only the first rotary_dim dimensions of each head; the rest pass unturned.

Shape legend (layers.py's), plus: c conv_dim (2 * hk * dk + hv * dv: q, k and v before the
convolution), hk / hv the linear attention's key and value heads, dk / dv their sizes.
The state dict's names are the notebook's, so its Qwen3_5Model's state dict loads as it is.
Leaves out: the vision tower, multi-token prediction (`mtp`), and any RoPE scaling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import anatomy as an
from ..errors import ConfigError, PromptError
from ..model import attention_weights
from ..config import FamilyConfig
from .layers import FeedForward, RopeTables, apply_rope, compute_rope_params, describe_swiglu

LAYER_TYPES = ("full_attention", "linear_attention")


@dataclass(frozen=True)
class Qwen3_5Config(FamilyConfig):
    """FamilyConfig's fields (family "qwen3_5"; the notebook's `rms_norm_eps` is `norm_eps`) and the notebook's own."""

    partial_rotary_factor: float = 0.25  # RoPE turns int(head_dim * this) dimensions of each head
    linear_conv_kernel_dim: int = 4      # the short convolution's width (taps over this and earlier tokens)
    linear_key_head_dim: int = 128       # dk
    linear_value_head_dim: int = 128     # dv
    linear_num_key_heads: int = 16       # hk: query and key heads of the linear attention
    linear_num_value_heads: int = 16     # hv: value heads (and states); hv // hk share each key head
    layer_types: tuple[str, ...] | None = None  # one per layer; None: every layer full_attention (the notebook's)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.family != "qwen3_5":
            raise ConfigError(f"a Qwen3_5Config has family 'qwen3_5', got {self.family!r}")
        for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_num_key_heads", "linear_num_value_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                              f"linear_num_key_heads ({self.linear_num_key_heads}): each key head serves whole "
                              "value heads")
        if not (isinstance(self.partial_rotary_factor, (int, float)) and 0 < self.partial_rotary_factor <= 1):
            raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor!r}")
        types = ("full_attention",) * self.n_layers if self.layer_types is None else self.layer_types
        if not isinstance(types, (list, tuple)):
            raise ConfigError(f"layer_types must be a list of {', '.join(LAYER_TYPES)}, got {types!r}")
        if len(types) != self.n_layers:
            raise ConfigError(f"layer_types has {len(types)} entries but n_layers is {self.n_layers}: give one "
                              f"layer type per layer")
        wrong = [t for t in types if t not in LAYER_TYPES]
        if wrong:
            raise ConfigError(f"layer_types holds {wrong[0]!r}: each must be one of {', '.join(LAYER_TYPES)}")
        object.__setattr__(self, "layer_types", tuple(types))

    @property
    def rms_norm_eps(self) -> float:
        """The notebook's name for norm_eps."""
        return self.norm_eps

    @property
    def rotary_dim(self) -> int:
        """How many of each full-attention head's hd dimensions RoPE turns (the notebook's rule: even, at least 2)."""
        rotary_dim = int(self.head_dim_value * self.partial_rotary_factor)
        return max(2, rotary_dim - rotary_dim % 2)

    @property
    def conv_dim(self) -> int:
        """c: the channels the short convolution mixes, q, k and v of the linear attention side by side."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    def to_book_dict(self, dtype=None) -> dict[str, Any]:
        """The notebook's config dict (`QWEN3_5_CONFIG`) for these sizes, `dtype` as given."""
        return {"vocab_size": self.vocab_size, "context_length": self.context_length, "emb_dim": self.emb_dim,
                "n_heads": self.n_heads, "n_layers": self.n_layers, "hidden_dim": self.hidden_dim,
                "head_dim": self.head_dim_value, "qk_norm": self.qk_norm, "n_kv_groups": self.n_kv_groups,
                "rope_base": self.rope_base, "partial_rotary_factor": self.partial_rotary_factor,
                "rms_norm_eps": self.norm_eps, "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
                "linear_key_head_dim": self.linear_key_head_dim, "linear_value_head_dim": self.linear_value_head_dim,
                "linear_num_key_heads": self.linear_num_key_heads,
                "linear_num_value_heads": self.linear_num_value_heads, "dtype": dtype,
                "layer_types": list(self.layer_types)}

    @classmethod
    def from_book_dict(cls, family: str, book: dict[str, Any], tie_embeddings: bool | None = None) -> "Qwen3_5Config":
        """A config from the notebook's dict (its `dtype` dropped, its `rms_norm_eps` as norm_eps)."""
        values = {k: v for k, v in book.items() if k != "dtype"}
        values["norm_eps"] = values.pop("rms_norm_eps", 1e-6)
        values.setdefault("qk_norm", True)
        return super().from_book_dict("qwen3_5", values, tie_embeddings)


# --- the pieces --------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """Qwen3.5's RMSNorm: (1 + weight) * x / rms(x), in float32; `weight` starts at zero (so the scale at one)."""

    def __init__(self, emb_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_float = x.float()
        x_norm = x_float * torch.rsqrt(x_float.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x_norm * (1.0 + self.weight.float())).to(x.dtype)


class RMSNormGated(nn.Module):
    """The linear attention's output norm: weight * x / rms(x) (a plain weight, starting at one), times silu(gate)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x_float = x.float()
        x_norm = x_float * torch.rsqrt(x_float.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        x_norm = self.weight * x_norm.to(x.dtype)  # transformers' order of roundings, for bf16
        return (x_norm * F.silu(gate.float())).to(x.dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first rotary_dim (= cos.shape[-1]) dimensions of each head `[b, h, t, hd]`; the rest pass
    as they are."""
    rotary_dim = cos.shape[-1]
    return torch.cat([apply_rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)


class GroupedQueryAttention(nn.Module):
    """Qwen3's grouped-query attention (QK-norm, RoPE), with an output gate and partial RoPE.

    W_query gives 2 * hd rows per head: hd of queries, then hd of a gate; the context of each head
    is multiplied by sigmoid(gate) before out_proj, so a head can switch itself off for a token.
    """

    def __init__(self, cfg: Qwen3_5Config):
        super().__init__()
        d, hd = cfg.emb_dim, cfg.head_dim_value
        self.num_heads = cfg.n_heads
        self.num_kv_groups = cfg.n_kv_groups
        self.group_size = cfg.group_size
        self.head_dim = hd
        self.d_out = cfg.n_heads * hd
        self.W_query = nn.Linear(d, self.d_out * 2, bias=False)              # [b, t, d] -> [b, t, h*2hd]
        self.W_key = nn.Linear(d, cfg.n_kv_groups * hd, bias=False)           # [b, t, d] -> [b, t, g*hd]
        self.W_value = nn.Linear(d, cfg.n_kv_groups * hd, bias=False)         # [b, t, d] -> [b, t, g*hd]
        self.out_proj = nn.Linear(self.d_out, d, bias=False)                 # [b, t, h*hd] -> [b, t, d]
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, eps=cfg.norm_eps)
            self.k_norm = RMSNorm(hd, eps=cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        """`[b, t, d] -> [b, t, d]`. cos, sin: `[t, rotary_dim]`. `cache`: this layer's keys and values so far."""
        b, t, _ = x.shape
        q_and_gate = self.W_query(x).view(b, t, self.num_heads, self.head_dim * 2)
        queries, gate = torch.chunk(q_and_gate, 2, dim=-1)  # [b, t, h, hd] each
        gate = gate.reshape(b, t, self.d_out)
        queries = queries.transpose(1, 2)  # [b, h, t, hd]
        keys = self.W_key(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)     # [b, g, t, hd]
        values = self.W_value(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)  # [b, g, t, hd]
        if self.q_norm is not None:
            queries = self.q_norm(queries)
            keys = self.k_norm(keys)
        queries = apply_partial_rope(queries, cos, sin)
        keys = apply_partial_rope(keys, cos, sin)
        if cache is not None:
            keys, values = cache.update(keys, values)  # [b, g, s, hd]
        keys = keys.repeat_interleave(self.group_size, dim=1)      # [b, g, s, hd] -> [b, h, s, hd]
        values = values.repeat_interleave(self.group_size, dim=1)
        attn_weights = attention_weights(queries, keys)  # [b, h, t, s], causal, / sqrt(hd)
        context = (attn_weights @ values).transpose(1, 2).reshape(b, t, self.d_out)  # [b, t, h*hd]
        context = context * torch.sigmoid(gate)  # the output gate
        return self.out_proj(context)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / |x| over the last dimension (flash-linear-attention's form: eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, one token at a time, in float32: (outputs `[b, t, hv, dv]`, the last state).

    q, k: `[b, t, hv, dk]` (unit length); v: `[b, t, hv, dv]`; g (log decay, <= 0), beta (in (0, 1)): `[b, t, hv]`;
    state: `[b, hv, dk, dv]`, zeros where None. For each token: S <- exp(g) S; the value S predicts for k,
    S^T k, is corrected toward v by beta (the delta rule: S <- S + k (beta (v - S^T k))^T); the output is S^T q.
    """
    b, t, hv, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (x.float().transpose(1, 2) for x in (q, k, v, g, beta))  # heads first: [b, hv, t, ...]
    q = q * dk ** -0.5
    state = torch.zeros(b, hv, dk, dv, dtype=torch.float32, device=v.device) if state is None else state.float()
    out = torch.empty(b, hv, t, dv, dtype=torch.float32, device=v.device)
    for i in range(t):
        state = state * g[:, :, i].exp()[..., None, None]            # forget a little: [b, hv, dk, dv]
        k_i = k[:, :, i]                                              # [b, hv, dk]
        predicted = (state * k_i[..., None]).sum(dim=-2)              # S^T k: [b, hv, dv]
        delta = (v[:, :, i] - predicted) * beta[:, :, i, None]        # how far off, times the step size
        state = state + k_i[..., None] * delta[..., None, :]          # a rank-one correction
        out[:, :, i] = (state * q[:, :, i, :, None]).sum(dim=-2)      # S^T q: [b, hv, dv]
    return out.transpose(1, 2), state                                 # [b, t, hv, dv]


class Qwen3_5GatedDeltaNet(nn.Module):
    """Linear attention: q, k, v through a short causal convolution, then the gated delta rule's state.

    Per token: in_proj_qkv gives c channels (hk query heads, hk key heads, hv value heads), each mixed
    with its own last linear_conv_kernel_dim inputs (conv1d, depthwise) and silu'd; in_proj_b the step
    size beta = sigmoid(b) and in_proj_a the decay g = -exp(A_log) * softplus(a + dt_bias) of each value
    head; in_proj_z the gate of the output norm. The cache keeps the convolution's last kernel - 1 inputs
    and the [dk, dv] state of every head: the same bytes at token 10 as at token 100,000.
    """

    def __init__(self, cfg: Qwen3_5Config, layer_idx: int = 0):
        super().__init__()
        d = cfg.emb_dim
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_kernel_size = cfg.linear_conv_kernel_dim
        self.conv_dim = cfg.conv_dim
        # Depthwise (one filter per channel). Its padding is the notebook's; forward pads on the left itself,
        # with zeros or with the cached inputs of the tokens before.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel_size, groups=self.conv_dim,
                                padding=self.conv_kernel_size - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.num_v_heads).uniform_(0.01, 16)))
        self.norm = RMSNormGated(self.head_v_dim, eps=cfg.norm_eps)
        self.out_proj = nn.Linear(self.value_dim, d, bias=False)          # [b, t, hv*dv] -> [b, t, d]
        self.in_proj_qkv = nn.Linear(d, self.conv_dim, bias=False)        # [b, t, d] -> [b, t, c]
        self.in_proj_z = nn.Linear(d, self.value_dim, bias=False)         # [b, t, d] -> [b, t, hv*dv]
        self.in_proj_b = nn.Linear(d, self.num_v_heads, bias=False)       # [b, t, d] -> [b, t, hv]
        self.in_proj_a = nn.Linear(d, self.num_v_heads, bias=False)       # [b, t, d] -> [b, t, hv]

    def causal_conv(self, x: torch.Tensor, before: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """silu(conv1d) over `x` `[b, c, t]`, each output seeing its token and the kernel - 1 before: `before`
        (the cache's `[b, c, kernel - 1]`) or zeros. Returns (outputs `[b, c, t]`, the last kernel - 1 inputs)."""
        width = self.conv_kernel_size - 1
        if before is None:
            before = x.new_zeros(x.shape[0], x.shape[1], width)
        padded = torch.cat([before.to(x.dtype), x], dim=-1)  # [b, c, width + t]
        out = F.conv1d(padded, self.conv1d.weight, groups=self.conv_dim)  # [b, c, t]
        return F.silu(out), padded[:, :, padded.shape[-1] - width:]

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        """`[b, t, d] -> [b, t, d]`. `cache`: this layer's convolution inputs and state (`read()`, `write(...)`)."""
        b, t, _ = x.shape
        conv_before, state = (None, None) if cache is None else cache.read()
        mixed_qkv, conv_after = self.causal_conv(self.in_proj_qkv(x).transpose(1, 2), conv_before)  # [b, c, t]
        query, key, value = torch.split(mixed_qkv.transpose(1, 2), [self.key_dim, self.key_dim, self.value_dim], -1)
        query = query.reshape(b, t, self.num_k_heads, self.head_k_dim)
        key = key.reshape(b, t, self.num_k_heads, self.head_k_dim)
        value = value.reshape(b, t, self.num_v_heads, self.head_v_dim)
        beta = self.in_proj_b(x).sigmoid()  # [b, t, hv]: how far each token moves the state
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # [b, t, hv], <= 0
        if self.num_v_heads > self.num_k_heads:  # each key head serves hv // hk neighbouring value heads
            query = query.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
            key = key.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
        query, key = l2norm(query.float()), l2norm(key.float())
        out, state = gated_delta_rule(query, key, value, g, beta, state)  # [b, t, hv, dv]
        if cache is not None:
            cache.write(conv_after, state)
        z = self.in_proj_z(x).reshape(b, t, self.num_v_heads, self.head_v_dim)
        out = self.norm(out.to(x.dtype), z).reshape(b, t, self.value_dim)
        return self.out_proj(out)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + token_mixer(norm1(x)), then x + ff(norm2(x)); the mixer by `layer_type`."""

    def __init__(self, cfg: Qwen3_5Config, layer_type: str, layer_idx: int):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "full_attention":
            self.token_mixer = GroupedQueryAttention(cfg)
        else:
            self.token_mixer = Qwen3_5GatedDeltaNet(cfg, layer_idx)
        self.ff = FeedForward(cfg)
        self.norm1 = RMSNorm(cfg.emb_dim, eps=cfg.norm_eps)
        self.norm2 = RMSNorm(cfg.emb_dim, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        if self.layer_type == "full_attention":
            x = x + self.token_mixer(self.norm1(x), cos, sin, cache)
        else:
            x = x + self.token_mixer(self.norm1(x), cache)
        return x + self.ff(self.norm2(x))


class Qwen3_5Model(nn.Module):
    def __init__(self, cfg: Qwen3_5Config):
        super().__init__()
        if not isinstance(cfg, Qwen3_5Config):
            raise ConfigError(f"a Qwen3.5 model needs a Qwen3_5Config (its linear attention's sizes and layer_types), "
                              f"got {type(cfg).__name__}")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)  # [V, d]
        self.trf_blocks = nn.ModuleList(TransformerBlock(cfg, layer_type, i) for i, layer_type in
                                        enumerate(cfg.layer_types))
        self.final_norm = RMSNorm(cfg.emb_dim, eps=cfg.norm_eps)
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)
        cos, sin = compute_rope_params(cfg.rotary_dim, cfg.rope_base, cfg.context_length)
        self.rope = RopeTables(cos, sin)  # [context_length, rotary_dim] each, float32
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.cfg.tie_embeddings:
            self.out_head.weight = self.tok_emb.weight

    @property
    def tied(self) -> bool:
        return self.out_head.weight is self.tok_emb.weight

    def forward(self, in_idx: torch.Tensor, cache=None, last_only: bool = False) -> torch.Tensor:
        """Token ids `[b, t]` (int64) -> logits `[b, t, V]` in the weights' dtype (`[b, 1, V]` with last_only).

        cache: a HybridCache (engine/hybrid_cache.py) holding the tokens before `in_idx`: keys and values of
        the full layers, the convolution inputs and state of the linear ones; None for whole sequences.
        """
        t = in_idx.shape[1]
        start = 0 if cache is None else cache.pos
        if start + t > self.cfg.context_length:
            raise PromptError(f"input is {start + t:,} tokens but context_length is {self.cfg.context_length:,}: "
                              "shorten it (generation keeps only the last context_length tokens)")
        x = self.tok_emb(in_idx)  # [b, t] -> [b, t, d]
        cos, sin = self.rope.at(start, t, x.device)  # [t, rotary_dim]
        for i, block in enumerate(self.trf_blocks):
            x = block(x, cos, sin, None if cache is None else cache.layer(i))
        if cache is not None:
            cache.advance(t)
        x = self.final_norm(x)
        if last_only:
            x = x[:, -1:]
        return self.out_head(x)  # [b, t, d] -> [b, t, V]


# --- what the cache keeps, from the config -------------------------------------------------------

def state_bytes(cfg: Qwen3_5Config, weight_bytes: int = 4) -> int:
    """Bytes the linear layers keep per sequence, whatever its length: each layer's float32 state
    `[hv, dk, dv]` and its convolution's last kernel - 1 inputs `[c, kernel - 1]` (in the weights' dtype)."""
    linear = cfg.layer_types.count("linear_attention")
    per_layer = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4 \
        + cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * weight_bytes
    return linear * per_layer


def kv_bytes_per_token(cfg: Qwen3_5Config, weight_bytes: int = 4) -> int:
    """Bytes the full layers' KV cache grows by per token and sequence: keys and values of g groups of hd."""
    return cfg.layer_types.count("full_attention") * 2 * cfg.n_kv_groups * cfg.head_dim_value * weight_bytes


def cache_bytes(cfg: Qwen3_5Config, tokens: int, batch_size: int = 1, weight_bytes: int = 4) -> int:
    """The whole cache for `batch_size` sequences of `tokens`: the states, plus the KV bytes per token times tokens."""
    return batch_size * (state_bytes(cfg, weight_bytes) + tokens * kv_bytes_per_token(cfg, weight_bytes))


# --- as data (anatomy.py) ---------------------------------------------------------------------------

def describe(cfg: Qwen3_5Config) -> an.Anatomy:
    """This file's model as data: pre-norm blocks of (1 + w) RMSNorms, each with its layer type's attention
    (linear: a recurrent state; full: gated, with partial RoPE), SwiGLU, a tied or own head."""
    def norm(path: str, role: str, dim: int = cfg.emb_dim) -> an.Norm:
        return an.Norm(path, "rmsnorm_plus_one", dim, cfg.norm_eps, role=role)

    blocks = []
    for i, layer_type in enumerate(cfg.layer_types):
        p = f"trf_blocks.{i}"
        att = describe_linear(cfg, p) if layer_type == "linear_attention" else describe_gated(cfg, p, norm)
        blocks.append(an.Block(i, p, "pre", (norm(f"{p}.norm1", "attn_in"), norm(f"{p}.norm2", "ff_in")), att,
                               describe_swiglu(cfg, p), layer_type=layer_type))
    return an.Anatomy(name="Qwen3.5", source="glassgpt's Qwen3_5Model",
                      embedding=an.Embedding("tok_emb", cfg.vocab_size, cfg.emb_dim),
                      positions=an.Positions("rope", cfg.context_length), blocks=tuple(blocks),
                      final_norm=norm("final_norm", "final"),
                      head=an.Head("out_head", cfg.vocab_size, cfg.tie_embeddings), config_fields=CONFIG_FIELDS,
                      exports=("pth", "hf"), decoding="twin")


def describe_gated(cfg: Qwen3_5Config, p: str, norm) -> an.Attention:
    """A full layer's attention: W_query's rows hold, per head, hd query rows then hd gate rows."""
    d, h, g, hd = cfg.emb_dim, cfg.n_heads, cfg.n_kv_groups, cfg.head_dim_value
    a = f"{p}.token_mixer"
    qk = {f"{x}_norm": norm(f"{a}.{x}_norm", f"{x}_norm", hd) for x in ("q", "k")} if cfg.qk_norm else {}
    return an.Attention(a, "causal", h, g, hd,
                        query=an.Linear(f"{a}.W_query", d, h * hd, False, head_rows=(2 * hd, 0, hd)),
                        key=an.Linear(f"{a}.W_key", d, g * hd, False),
                        value=an.Linear(f"{a}.W_value", d, g * hd, False),
                        out=an.Linear(f"{a}.out_proj", h * hd, d, False),
                        rope=an.Rope(cfg.rope_base, hd, rotary_dim=cfg.rotary_dim),
                        output_gate=an.Linear(f"{a}.W_query", d, h * hd, False, head_rows=(2 * hd, hd, 2 * hd)),
                        **qk)


def describe_linear(cfg: Qwen3_5Config, p: str) -> an.Attention:
    """A linear layer: q, k and v are row slices of in_proj_qkv; hk heads of dk for q and k, hv of dv for v."""
    d, hk, dk = cfg.emb_dim, cfg.linear_num_key_heads, cfg.linear_key_head_dim
    a, key_dim = f"{p}.token_mixer", hk * dk
    state = an.RecurrentState(
        rule="gated_delta", value_heads=cfg.linear_num_value_heads, value_head_dim=cfg.linear_value_head_dim,
        conv=f"{a}.conv1d", conv_kernel=cfg.linear_conv_kernel_dim, conv_channels=cfg.conv_dim,
        gate=an.Linear(f"{a}.in_proj_z", d, cfg.value_dim, False),
        beta=an.Linear(f"{a}.in_proj_b", d, cfg.linear_num_value_heads, False),
        decay=an.Linear(f"{a}.in_proj_a", d, cfg.linear_num_value_heads, False),
        norm=an.Norm(f"{a}.norm", "rmsnorm", cfg.linear_value_head_dim, cfg.norm_eps, role="gated_out"))
    qkv = f"{a}.in_proj_qkv"
    return an.Attention(a, "linear", hk, hk, dk,
                        query=an.Linear(qkv, d, key_dim, False, rows=(0, key_dim)),
                        key=an.Linear(qkv, d, key_dim, False, rows=(key_dim, 2 * key_dim)),
                        value=an.Linear(qkv, d, cfg.value_dim, False, rows=(2 * key_dim, cfg.conv_dim)),
                        out=an.Linear(f"{a}.out_proj", cfg.value_dim, d, False), state=state)


CONFIG_FIELDS = ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers", "hidden_dim", "head_dim",
                 "qk_norm", "n_kv_groups", "rope_base", "partial_rotary_factor", "rms_norm_eps",
                 "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                 "linear_num_value_heads", "layer_types", "tie_embeddings")

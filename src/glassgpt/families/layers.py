"""The pieces Qwen3 and Llama 3 share, as the book's `llms_from_scratch.qwen3` / `llama3` write them.

Shape legend (model.py's, plus two letters):
    b  batch size     t  new tokens     s  positions attended (t, or the cache's so far)
    d  emb_dim        h  query heads    g  key/value groups (n_kv_groups)    hd  head_dim
    f  hidden_dim (SwiGLU's inner width)

What GPT-2 (model.py) has and these do not, stage by stage (the book's ch05/07_gpt_to_llama):
  - LayerNorm -> RMSNorm: no mean subtracted, no shift; computed in float32 whatever the weights'
    dtype (the book's `qwen3_compatible=True`, and what torch.nn.RMSNorm does in the Llama file);
  - pos_emb -> RoPE: no position vector is added to the embeddings; inside every attention the
    queries and keys are rotated by an angle that grows with the position (`apply_rope`);
  - multi-head -> grouped-query attention: h query heads, but only g key/value heads, each
    shared by h // g neighbouring query heads (`repeat_interleave`, never `repeat`);
  - GELU -> SwiGLU: silu(fc1(x)) * fc2(x), then fc3, no biases anywhere.

The formulas are the book's, operation for operation, so the same float32 weights and ids give
its logits bit for bit (tests/test_families.py). `attention_weights` is GPT-2's own (model.py).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import anatomy as an
from ..model import attention_weights
from ..config import FamilyConfig, RopeFreq


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension, in float32; returned in x's dtype."""
    input_dtype = x.dtype
    x = x.to(torch.float32)  # bf16 squares and means lose the small components: always float32
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    norm_x = x * torch.rsqrt(variance + eps)
    return (norm_x * weight).to(input_dtype)


class RMSNorm(nn.Module):
    """The book's RMSNorm (qwen3.py, qwen3_compatible=True): a `scale` per dimension, no shift."""

    def __init__(self, emb_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(emb_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.scale, self.eps)

    def extra_repr(self) -> str:
        return f"{self.scale.shape[0]}, eps={self.eps}"


def compute_rope_params(head_dim: int, theta_base: float, context_length: int,
                        freq_config: RopeFreq | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's angles, `[context_length, hd]` each (float32).

    Pair i of a head (dimensions i and i + hd/2) turns at inv_freq[i] = theta_base^(-2i/hd)
    radians per position: the first pairs fast, the last slowly. Llama 3's `freq_config`
    slows the slow ones (wavelength above original_context_length / low_freq_factor) by
    `factor`, keeps the fast ones, and blends between, so the model reaches 128k tokens.
    """
    inv_freq = 1.0 / (theta_base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu")[: head_dim // 2].float()
                                     / head_dim))  # [hd/2]
    if freq_config is not None:
        inv_freq = scale_llama3_frequencies(inv_freq, freq_config)
    positions = torch.arange(context_length, dtype=torch.float32, device="cpu")
    angles = positions[:, None] * inv_freq[None, :]  # [context_length, hd/2]
    angles = torch.cat([angles, angles], dim=1)  # [context_length, hd]: both halves of a pair turn alike
    return torch.cos(angles), torch.sin(angles)


def scale_llama3_frequencies(inv_freq: torch.Tensor, fc: RopeFreq) -> torch.Tensor:
    """Llama 3's frequency scaling, the book's formula: low frequencies / factor, high ones kept, a blend between."""
    low_freq_wavelen = fc.original_context_length / fc.low_freq_factor
    high_freq_wavelen = fc.original_context_length / fc.high_freq_factor
    wavelen = 2 * torch.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / fc.factor, inv_freq)
    smooth_factor = (fc.original_context_length / wavelen - fc.low_freq_factor) / (
        fc.high_freq_factor - fc.low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * (inv_freq / fc.factor) + smooth_factor * inv_freq
    is_medium_freq = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


class RopeTables:
    """cos and sin of every position (compute_rope_params), kept in float32 on whatever device asks.

    Not buffers: `model.to(torch.bfloat16)` would round the angles of far positions to a few
    bits, and they are no weights (the same for every model of this head size and base).
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin  # [context_length, hd] each

    def at(self, start: int, t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of positions start .. start + t - 1: `[t, hd]` each, on `device`."""
        if self.cos.device != device:
            self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self.cos[start:start + t], self.sin[start:start + t]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head's pairs (x[i], x[i + hd/2]) by its position's angle: `[b, h, t, hd]`, same shape.

    `cos`, `sin`: `[t, hd]`, the rows of the positions x holds. Split halves, as the book and
    Hugging Face's checkpoints pair the dimensions (Meta's originals pair neighbours instead;
    their converted weights are permuted so that halves are right).
    """
    hd = x.shape[-1]
    x1 = x[..., : hd // 2]  # first half
    x2 = x[..., hd // 2:]  # second half
    rotated = torch.cat((-x2, x1), dim=-1)
    x_rotated = (x * cos) + (rotated * sin)  # [b, h, t, hd] * [t, hd]: float32, as the tables are
    return x_rotated.to(dtype=x.dtype)


class GroupedQueryAttention(nn.Module):
    """Causal attention with h query heads sharing g key/value heads, RoPE on q and k (the book's GQA).

    With `qk_norm` (Qwen3) each query and key head is RMS-normed over its hd values before the
    rotation. Queries, keys and values have no biases; nor has out_proj.
    """

    def __init__(self, cfg: FamilyConfig, keys_first: bool = False):
        """`keys_first`: create W_key and W_value before W_query, as the book's Llama 3.2 does, so that
        `torch.manual_seed(s)` then the model draws the book's initial weights (Qwen3: the query first)."""
        super().__init__()
        d, hd = cfg.emb_dim, cfg.head_dim_value
        self.num_heads = cfg.n_heads
        self.num_kv_groups = cfg.n_kv_groups
        self.group_size = cfg.group_size
        self.head_dim = hd
        self.d_out = cfg.n_heads * hd
        if not keys_first:
            self.W_query = nn.Linear(d, self.d_out, bias=False)            # [b, t, d] -> [b, t, h*hd]
        self.W_key = nn.Linear(d, cfg.n_kv_groups * hd, bias=False)         # [b, t, d] -> [b, t, g*hd]
        self.W_value = nn.Linear(d, cfg.n_kv_groups * hd, bias=False)       # [b, t, d] -> [b, t, g*hd]
        if keys_first:
            self.W_query = nn.Linear(d, self.d_out, bias=False)
        self.out_proj = nn.Linear(self.d_out, d, bias=False)               # [b, t, h*hd] -> [b, t, d]
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, eps=cfg.norm_eps)
            self.k_norm = RMSNorm(hd, eps=cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        """`[b, t, d] -> [b, t, d]`. cos, sin: `[t, hd]` for these tokens' positions. `cache`: this
        layer's part of a KVCache (engine/cache.py), which keeps the g rotated key heads, not h copies."""
        b, t, _ = x.shape
        queries = self.W_query(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)    # [b, h, t, hd]
        keys = self.W_key(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)     # [b, g, t, hd]
        values = self.W_value(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)  # [b, g, t, hd]
        if self.q_norm is not None:  # before the rotation: RoPE keeps the norm, the norm would not keep RoPE
            queries = self.q_norm(queries)
            keys = self.k_norm(keys)
        queries = apply_rope(queries, cos, sin)  # positions enter here, and only here
        keys = apply_rope(keys, cos, sin)
        if cache is not None:
            keys, values = cache.update(keys, values)  # [b, g, s, hd]: the earlier tokens' too
        # Query heads 0..group_size-1 share key head 0, the next group_size share key head 1, ...:
        # repeat_interleave gives [K1, K1, K2, K2]; repeat would give [K1, K2, K1, K2].
        keys = keys.repeat_interleave(self.group_size, dim=1)      # [b, g, s, hd] -> [b, h, s, hd]
        values = values.repeat_interleave(self.group_size, dim=1)  # [b, g, s, hd] -> [b, h, s, hd]
        attn_weights = attention_weights(queries, keys)  # [b, h, t, s], causal, / sqrt(hd)
        context = (attn_weights @ values).transpose(1, 2).reshape(b, t, self.d_out)  # [b, h, t, hd] -> [b, t, h*hd]
        return self.out_proj(context)


class FeedForward(nn.Module):
    """SwiGLU: fc3(silu(fc1(x)) * fc2(x)). fc1 is the gate (HF's gate_proj), fc2 the up (up_proj)."""

    def __init__(self, cfg: FamilyConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.emb_dim, cfg.hidden_dim, bias=False)  # [b, t, d] -> [b, t, f]
        self.fc2 = nn.Linear(cfg.emb_dim, cfg.hidden_dim, bias=False)  # [b, t, d] -> [b, t, f]
        self.fc3 = nn.Linear(cfg.hidden_dim, cfg.emb_dim, bias=False)  # [b, t, f] -> [b, t, d]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fc1 = self.fc1(x)
        x_fc2 = self.fc2(x)
        return self.fc3(nn.functional.silu(x_fc1) * x_fc2)


# --- these pieces as data (anatomy.py), for the model files' describe(cfg) ------------------------

def describe_rope(cfg: FamilyConfig) -> an.Rope:
    """RoPE as compute_rope_params turns q and k: split halves, every dimension, Llama 3's scaling if set."""
    scaling = None if cfg.rope_freq is None else "llama3"
    values = () if cfg.rope_freq is None else tuple((k, float(v)) for k, v in vars(cfg.rope_freq).items())
    return an.Rope(cfg.rope_base, cfg.head_dim_value, scaling=scaling, scaling_values=values)


def describe_attention(cfg: FamilyConfig, p: str, norm_leaf: str) -> an.Attention:
    """GroupedQueryAttention of block path `p`; its QK-norms' parameter is `norm_leaf`."""
    d, h, g, hd = cfg.emb_dim, cfg.n_heads, cfg.n_kv_groups, cfg.head_dim_value
    qk = {}
    if cfg.qk_norm:
        qk = {f"{x}_norm": an.Norm(f"{p}.att.{x}_norm", "rmsnorm", hd, cfg.norm_eps, weight=norm_leaf, role=f"{x}_norm")
              for x in ("q", "k")}
    return an.Attention(f"{p}.att", "causal", h, g, hd,
                        query=an.Linear(f"{p}.att.W_query", d, h * hd, False),
                        key=an.Linear(f"{p}.att.W_key", d, g * hd, False),
                        value=an.Linear(f"{p}.att.W_value", d, g * hd, False),
                        out=an.Linear(f"{p}.att.out_proj", h * hd, d, False), rope=describe_rope(cfg), **qk)


def describe_swiglu(cfg: FamilyConfig, p: str) -> an.FeedForward:
    d, f = cfg.emb_dim, cfg.hidden_dim
    return an.FeedForward(f"{p}.ff", "swiglu", f, "silu", up=an.Linear(f"{p}.ff.fc2", d, f, False),
                          down=an.Linear(f"{p}.ff.fc3", f, d, False), gate=an.Linear(f"{p}.ff.fc1", d, f, False))


CONFIG_FIELDS = ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers", "hidden_dim", "n_kv_groups",
                 "rope_base", "head_dim", "qk_norm", "rope_freq", "tie_embeddings", "norm_eps")

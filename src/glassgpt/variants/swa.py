"""GPT-2 with sliding-window attention (the book repository's ch04/06_swa, gpt_with_kv_swa.py).

Shape legend (base.py's, plus one letter):
    b batch   t new tokens   s positions attended   d emb_dim   h n_heads   hd head size = d // h
    W  sliding_window_size: a query sees itself and the W - 1 tokens before it, no further back

    GPT-2's attention (model.py), with two changes in a window layer:
    - the mask: query j (at position p) also drops every key at p - W or earlier;
    - the cache: after each step only the last W keys and values are kept, [b, h, min(s, W), hd]
      (a chunk of t new tokens attends over up to W + t - 1: its first query's window and the chunk).

Which layers have the window: the repository's K:1 schedule, `sliding_window_stride` = K: K window
layers, then one full layer, repeated (K = 2: window, window, full, window, ...); 0 puts no window
anywhere, a negative K one in every layer. The memory estimator's `--swa_ratio K:1` is the same
schedule. A window layer's cache stops growing at W tokens; a full layer's grows with the text.
The repository's names: `MultiHeadAttentionWithSWA`, the config keys `sliding_window_size` and
`sliding_window_stride`. The rest is GPT-2's (base.py, model.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .. import anatomy as an
from ..config import GPTConfig
from ..errors import ConfigError
from ..model import FeedForward
from .base import (CachedGPTModel, MultiHeadAttention, TransformerBlock, VariantConfig, append_to_cache,
                   describe_gpt_base, element_bytes)


@dataclass(frozen=True)
class SWAConfig(VariantConfig):
    variant = "swa"
    sliding_window_size: int = 1024  # W: the positions a query sees, itself included
    sliding_window_stride: int = 2   # K: K window layers, then one full layer; 0 none, < 0 all

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.sliding_window_size, int) or self.sliding_window_size < 1:
            raise ConfigError(f"sliding_window_size must be a positive integer, got {self.sliding_window_size!r}")
        if not isinstance(self.sliding_window_stride, int) or isinstance(self.sliding_window_stride, bool):
            raise ConfigError(f"sliding_window_stride must be an integer (K window layers per full one; 0 none, "
                              f"negative all), got {self.sliding_window_stride!r}")


def layer_windows(cfg: SWAConfig) -> list[int | None]:
    """Each layer's window: sliding_window_size, or None for a full-attention layer (the K:1 schedule)."""
    k = cfg.sliding_window_stride
    if k <= 0:
        return [None if k == 0 else cfg.sliding_window_size] * cfg.n_layers
    return [cfg.sliding_window_size if i % (k + 1) < k else None for i in range(cfg.n_layers)]


def window_attention_weights(q: torch.Tensor, k: torch.Tensor, window: int) -> torch.Tensor:
    """model.attention_weights with a window: softmax(q k^T / sqrt(hd)) over the last `window` positions.

    `q` is `[b, h, t, hd]`, `k` `[b, h, s, hd]`, the queries the last t of the s positions: query j
    sits at s - t + j, and sees key i when 0 <= (s - t + j) - i < window.
    """
    t, s, hd = q.shape[-2], k.shape[-2], q.shape[-1]
    attn_scores = q @ k.transpose(-2, -1)  # [b, h, t, hd] @ [b, h, hd, s] -> [b, h, t, s]
    future = torch.ones(t, s, dtype=torch.bool, device=q.device).triu(diagonal=s - t + 1)
    too_old = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t - window)
    attn_scores = attn_scores.masked_fill(future | too_old, -torch.inf)
    return torch.softmax(attn_scores / hd**0.5, dim=-1)


class MultiHeadAttentionWithSWA(MultiHeadAttention):
    """GPT-2's causal attention (base.MultiHeadAttention); with a window, sliding, and its cache kept to it."""

    def __init__(self, cfg: GPTConfig, sliding_window_size: int | None = None):
        super().__init__(cfg)
        self.sliding_window_size = sliding_window_size  # None: full attention, as GPT-2's

    def update(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached keys and values, then these (`[b, h, t, hd]`): what this step attends over."""
        k, v = append_to_cache(self, k_new, v_new)  # [b, h, s, hd]
        if self.sliding_window_size is None:
            return k, v
        w, t = self.sliding_window_size, k_new.shape[2]
        self.cache_k, self.cache_v = k[:, :, -w:], v[:, :, -w:]  # the next token sees no further back
        return k[:, :, -(w + t - 1):], v[:, :, -(w + t - 1):]  # the chunk's first query sees w - 1 before it

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.sliding_window_size is None:
            return super().attend(q, k, v)
        attn_weights = self.dropout(window_attention_weights(q, k, self.sliding_window_size))  # [b, h, t, s]
        return attn_weights @ v  # [b, h, t, s] @ [b, h, s, hd] -> [b, h, t, hd]


class GPTModel(CachedGPTModel):
    """GPT-2 with sliding-window attention in the K:1 schedule: ids `[b, t]` -> logits `[b, t, V]`."""

    def make_block(self, cfg: SWAConfig, i: int) -> TransformerBlock:
        return TransformerBlock(cfg, MultiHeadAttentionWithSWA(cfg, layer_windows(cfg)[i]), FeedForward(cfg))


def describe(cfg: SWAConfig) -> an.Anatomy:
    """This file's model as data (anatomy.py): GPT-2's, each layer's window by the K:1 schedule (layer_windows)."""
    windows = layer_windows(cfg)
    return describe_gpt_base(cfg, "GPT-2 with sliding-window attention", ("sliding_window_size", "sliding_window_stride"),
                             attention=lambda b: replace(b.attention, window=windows[b.index]),
                             layer_type=lambda b: "full_attention" if windows[b.index] is None else "sliding_attention")


def kv_cache_bytes(cfg: SWAConfig, dtype: torch.dtype, num_tokens: int, batch_size: int = 1) -> int:
    """GPT-2's key and value of every head, per token, of min(num_tokens, W) tokens in a window layer
    and of all num_tokens in a full one."""
    kept = sum(num_tokens if w is None else min(num_tokens, w) for w in layer_windows(cfg))
    return batch_size * kept * 2 * cfg.n_heads * cfg.head_dim * element_bytes(dtype)

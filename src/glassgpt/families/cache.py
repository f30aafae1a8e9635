"""The KV cache of a grouped-query model: the g key/value heads of every token so far, rotated.

    cache = KVCache(cfg, batch_size, max_len)
    model(prompt_ids, cache)       # fills positions 0..t-1 of every layer
    model(next_id, cache)          # one token at position t, attending over 0..t

The same interface as GPT-2's (engine/cache.py: `pos`, `layer(i).update(k, v)`, `advance(t)`),
with `[b, g, max_len, hd]` per layer: the cache holds the n_kv_groups heads before
`repeat_interleave`, which is what grouped-query attention saves (8 heads, not 16, in Qwen3
0.6B). Keys are stored after RoPE: a token's rotation depends only on its own position.
"""

from __future__ import annotations

import torch

from ..errors import PromptError
from .config import FamilyConfig


class KVCache:
    def __init__(self, cfg: FamilyConfig, batch_size: int, max_len: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        max_len = max_len or cfg.context_length
        shape = (batch_size, cfg.n_kv_groups, max_len, cfg.head_dim_value)
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.layers = [LayerCache(self, i) for i in range(cfg.n_layers)]
        self.max_len = max_len
        self.pos = 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    def reset(self) -> None:
        self.pos = 0

    def layer(self, i: int) -> "LayerCache":
        return self.layers[i]

    def advance(self, t: int) -> None:
        """The model has written t new positions into every layer."""
        self.pos += t

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `k`, `v` ([b, g, t, hd]) of `layer` at the current position; return all so far ([b, g, s, hd])."""
        end = self.pos + k.shape[2]
        if end > self.max_len:
            raise PromptError(f"the KV cache holds {self.max_len:,} positions but {end:,} are needed: "
                              "make the KVCache with a larger max_len")
        self.k[layer][:, :, self.pos:end] = k
        self.v[layer][:, :, self.pos:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class LayerCache:
    """One layer's view of a KVCache: what `GroupedQueryAttention.forward` calls `update` on."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.update(self.index, k, v)

"""The cache of a hybrid model (Qwen3.5): keys and values for its full layers, a state for its linear ones.

    cache = cache_for(cfg, batch_size, max_len)   # a HybridCache where cfg has linear layers, else a KVCache
    model(prompt_ids, cache)                      # fills it
    model(next_id, cache)                         # one token: the full layers append, the linear ones update

A full-attention layer's `cache.layer(i)` is a KVCache's (`update(k, v)` appends and returns all keys and
values so far). A linear layer's `read()` gives (its convolution's last kernel - 1 inputs `[b, c, kernel - 1]`,
its state `[b, hv, dk, dv]`), both None before the first token, and `write(conv, state)` replaces them:
what it keeps does not grow with the sequence (families/qwen3_5.py's state_bytes counts it).
"""

from __future__ import annotations

import torch

from .cache import KVCache, LayerCache


class HybridCache(KVCache):
    """A KVCache over the full layers only (no tensors for the linear ones), and the linear layers' states."""

    def __init__(self, cfg, batch_size: int, max_len: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        super().__init__(cfg, batch_size, max_len, device, dtype)
        self.linear = [t == "linear_attention" for t in cfg.layer_types]
        for i in range(cfg.n_layers):
            if self.linear[i]:  # keys and values of a layer that has none: nothing allocated
                self.k[i] = self.v[i] = torch.empty(0, device=device, dtype=dtype)
        self.conv: list[torch.Tensor | None] = [None] * cfg.n_layers
        self.state: list[torch.Tensor | None] = [None] * cfg.n_layers

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v) + sum(t.nbytes for t in self.conv + self.state if t is not None)

    def reset(self) -> None:
        super().reset()
        self.conv = [None] * len(self.conv)
        self.state = [None] * len(self.state)

    def layer(self, i: int):
        return LinearLayerCache(self, i) if self.linear[i] else LayerCache(self, i)


class LinearLayerCache:
    """One linear layer's view of a HybridCache: what Qwen3_5GatedDeltaNet.forward reads and writes."""

    def __init__(self, cache: HybridCache, index: int):
        self.cache, self.index = cache, index

    def read(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.cache.conv[self.index], self.cache.state[self.index]

    def write(self, conv: torch.Tensor, state: torch.Tensor) -> None:
        self.cache.conv[self.index], self.cache.state[self.index] = conv, state


def cache_for(cfg, batch_size: int, max_len: int | None = None, device: torch.device | str | None = None,
              dtype: torch.dtype = torch.float32) -> KVCache:
    """The cache generate gives `cfg`'s model: a HybridCache where some layer is linear attention, else a KVCache."""
    if "linear_attention" in (getattr(cfg, "layer_types", None) or ()):
        return HybridCache(cfg, batch_size, max_len, device, dtype)
    return KVCache(cfg, batch_size, max_len, device=device, dtype=dtype)

"""The KV cache: keys and values of the tokens so far, so that a decoding step feeds only the new one.

    cache = KVCache(cfg, batch_size, max_len)
    model(prompt_ids, cache)       # fills positions 0..t-1 of every layer
    model(next_id, cache)          # one token: appends position t, attends over 0..t

`GPTModel.forward(in_idx, cache)` reads `cache.pos` (where the new tokens go), hands block i
`cache.layer(i)`, whose `update(k, v)` writes the new keys and values and returns all of
them, and calls `cache.advance(t)` when every block has run.
"""

from __future__ import annotations

import torch

from ..config import GPTConfig
from ..errors import PromptError


class KVCache:
    """Keys and values of every layer, allocated once and written in place.

    `k[layer]` and `v[layer]` are `[b, h, max_len, hd]` (`[b, g, max_len, hd]` for a grouped-query
    model: its key/value groups, `cfg.kv_heads`); positions `[0, pos)` are filled.
    Appending never reallocates or concatenates, so a decode step costs the same at
    token 10 as at token 1,000 (apart from attention itself).

    One tensor per layer, not one `[n_layers, ...]` tensor: torch.compile turns a write
    into a slice of a graph input into a copy of that whole input, so with one shared
    tensor every layer's write copied all layers' caches (n_layers^2 copies per step).
    """

    def __init__(self, cfg: GPTConfig, batch_size: int, max_len: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        max_len = max_len or cfg.context_length
        heads, head_dim = cfg.kv_heads  # GPT-2: every head; Qwen3/Llama: the key/value groups
        # A sliding-window layer (Gemma 3's) keeps only its last `window` positions, in a ring: slot pos % window.
        self.windows = getattr(cfg, "windows", None) or (None,) * cfg.n_layers
        shapes = [(batch_size, heads, max_len if w is None else min(w, max_len), head_dim) for w in self.windows]
        # Uninitialised on purpose: only positions [0, pos) are ever read, and zeroing a
        # full-context cache (75 MB for gpt2 at batch 1 in float32) costs more than a short reply.
        self.k = [torch.empty(shape, device=device, dtype=dtype) for shape in shapes]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for shape in shapes]
        self.max_len = max_len
        self.pos = 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    def reset(self) -> None:
        self.pos = 0

    def layer(self, i: int) -> "LayerCache":
        # Made at each call, not kept: a kept list would be a reference cycle (cache -> layer -> cache), and a
        # finished generate's cache would then live on until the garbage collector ran (graphs.py holds
        # its cache weakly, to know when one is done).
        return LayerCache(self, i)

    def advance(self, t: int) -> None:
        """The model has written t new positions into every layer."""
        self.pos += t

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `k`, `v` ([b, h, t, hd]) of `layer` at the current position; return all keys/values so far."""
        end = self.pos + k.shape[2]
        if end > self.max_len:
            raise PromptError(f"the KV cache holds {self.max_len:,} positions but {end:,} are needed: "
                              "make the KVCache with a larger max_len")
        if self.windows[layer] is not None:
            return self._update_ring(layer, k, v)
        self.k[layer][:, :, self.pos:end] = k
        self.v[layer][:, :, self.pos:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


    def _update_ring(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A sliding layer's update: keep the last `slots` positions (position p in slot p % slots) and return the
        kept earlier ones, in position order, then the t new ones: the last s positions before `end`, as a full
        layer's are (one new token: the kept slots in any order, every one of them in its window)."""
        ring_k, ring_v = self.k[layer], self.v[layer]
        slots, t, p = ring_k.shape[2], k.shape[2], self.pos
        if t == 1:
            ring_k[:, :, p % slots], ring_v[:, :, p % slots] = k[:, :, 0], v[:, :, 0]
            return ring_k[:, :, :min(p + 1, slots)], ring_v[:, :, :min(p + 1, slots)]
        kept = torch.arange(p - min(p, slots), p, device=k.device) % slots  # the slots of the kept positions, in order
        keys, values = torch.cat([ring_k[:, :, kept], k], dim=2), torch.cat([ring_v[:, :, kept], v], dim=2)
        n = min(t, slots)  # the new positions that stay: the last n
        last = torch.arange(p + t - n, p + t, device=k.device) % slots
        ring_k[:, :, last], ring_v[:, :, last] = k[:, :, t - n:], v[:, :, t - n:]
        return keys, values


class LayerCache:
    """One layer's view of a KVCache: what `MultiHeadAttention.forward` calls `update` on."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.update(self.index, k, v)

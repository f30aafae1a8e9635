"""Sliding and full attention layers, and the KV cache that keeps each as much as it reads.

    check_layer_types(layer_types, n_layers, sliding_window)   a config's list, checked in one line each
    attention_weights(q, k, window)    softmax(q @ k.T / sqrt(hd)) over what a query may see  [b, h, t, s]
    WindowKVCache(...)                 full layers keep every position, sliding layers their last window

OLMo 3 (olmo3.py) and Tiny Aya (tiny_aya.py) interleave two kinds of layer, named by the config's
`layer_types`, as transformers and the book's notebooks name them:
  - "full_attention": each query sees itself and every earlier position (GPT-2's causal mask);
  - "sliding_attention": each query sees itself and the `sliding_window - 1` positions before it,
    nothing further back (the notebooks' `mask_local`: future OR far past, i - j >= sliding_window).

A sliding layer never reads further back than its window, so its cache can forget the rest: that
is what makes a 64k context affordable when three layers in four slide over 4,096 positions.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from ..errors import ConfigError, PromptError

LAYER_TYPES = ("sliding_attention", "full_attention")


class LayerTypesConfig:
    """What the bonus notebooks' configs (OLMo 3, Tiny Aya, Gemma 4) share beyond their own fields: each layer's
    window from `layer_types` and `sliding_window`, a language model's head (no classes), and the dict they are
    saved as (`layer_types` a list, as the notebook writes it)."""

    @property
    def windows(self) -> list[int | None]:
        """Each layer's window (None: a full layer)."""
        return [self.sliding_window if t == "sliding_attention" else None for t in self.layer_types]

    @property
    def num_classes(self) -> None:
        return None

    @property
    def out_dim(self) -> int:
        return self.vocab_size

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"layer_types": list(self.layer_types)}


def check_layer_types(layer_types: object, n_layers: int, sliding_window: object) -> tuple[str, ...]:
    """`layer_types` as a tuple, or a one-line ConfigError for a list of the wrong length or kind, or a window
    that is not a positive integer."""
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != n_layers:
        got = f"{len(layer_types)} entries" if isinstance(layer_types, (list, tuple)) else repr(layer_types)
        raise ConfigError(f"layer_types must list one entry per layer ({n_layers}), got {got}: give each layer "
                          f"{' or '.join(map(repr, LAYER_TYPES))}")
    unknown = [t for t in layer_types if t not in LAYER_TYPES]
    if unknown:
        raise ConfigError(f"layer_types holds {unknown[0]!r}: each layer is {' or '.join(map(repr, LAYER_TYPES))}")
    if not isinstance(sliding_window, int) or isinstance(sliding_window, bool) or sliding_window <= 0:
        raise ConfigError(f"sliding_window must be a positive integer (how many positions a sliding layer's query "
                          f"sees, itself included), got {sliding_window!r}")
    return tuple(layer_types)


def attention_weights(q: torch.Tensor, k: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """softmax(q @ k.T / sqrt(hd)) `[b, h, t, s]` for queries `[b, h, t, hd]` at the last t of the s positions
    whose keys are `[b, h, s, hd]`. Query j (at position s - t + j) sees no later position and, with a `window`,
    none `window` or more positions back."""
    t, s, hd = q.shape[-2], k.shape[-2], q.shape[-1]
    attn_scores = (q @ k.transpose(-2, -1)) * hd**-0.5  # [b, h, t, hd] @ [b, h, hd, s] -> [b, h, t, s]
    ones = torch.ones(t, s, dtype=torch.bool, device=q.device)
    masked = ones.triu(diagonal=s - t + 1)  # the future
    if window is not None:
        masked |= ones.tril(diagonal=s - t - window)  # the far past: query - key >= window
    return torch.softmax(attn_scores.masked_fill(masked, -torch.inf), dim=-1)


class WindowKVCache:
    """Keys and values of every layer: a full layer's in one tensor allocated for `max_len` positions, a
    sliding layer's trimmed to its last `window` after each update (the queries of the new tokens still see
    every key they need: the update returns the kept ones and the new ones together).

    The protocol the glass models call (engine/cache.py's KVCache keeps the same): `pos` (where the new tokens
    go), `layer(i).update(k, v)` (write, and return every key and value the layer attends over), `advance(t)`.
    """

    def __init__(self, windows: Sequence[int | None], kv_heads, batch_size: int, max_len: int,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        """kv_heads: (g, hd) of every layer, or one (g, hd) per layer (Gemma 4's full layers have wider heads;
        None for a layer that keeps nothing, its kv-shared layers)."""
        self.windows = list(windows)  # None: a full layer
        per_layer = kv_heads if isinstance(kv_heads, list) else [kv_heads] * len(self.windows)
        self.shapes = [None if kv is None else (batch_size, kv[0], max_len, kv[1]) for kv in per_layer]
        self.device, self.dtype, self.max_len = device, dtype, max_len
        self.reset()

    def reset(self) -> None:
        self.pos = 0
        self.k: list[torch.Tensor | None] = [None] * len(self.windows)
        self.v: list[torch.Tensor | None] = [None] * len(self.windows)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v if t is not None)

    def layer(self, i: int) -> "_LayerCache":
        return _LayerCache(self, i)

    def advance(self, t: int) -> None:
        self.pos += t

    def update(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `k`, `v` (`[b, g, t, hd]`) of layer i; return the keys and values it attends over `[b, g, s, hd]`."""
        end = self.pos + k.shape[2]
        if end > self.max_len:
            raise PromptError(f"the KV cache holds {self.max_len:,} positions but {end:,} are needed: "
                              "make the cache with a larger max_len")
        window = self.windows[i]
        if window is None:  # a full layer: written in place, never reallocated
            if self.k[i] is None:
                self.k[i] = torch.empty(self.shapes[i], device=self.device, dtype=self.dtype)
                self.v[i] = torch.empty(self.shapes[i], device=self.device, dtype=self.dtype)
            self.k[i][:, :, self.pos:end] = k
            self.v[i][:, :, self.pos:end] = v
            return self.k[i][:, :, :end], self.v[i][:, :, :end]
        if self.k[i] is not None:
            k, v = torch.cat([self.k[i], k], dim=2), torch.cat([self.v[i], v], dim=2)
        keep_k, keep_v = k[:, :, -window:], v[:, :, -window:]  # what the next query can still see
        if k.shape[2] > window + 1:  # a prompt past the window: copied, so that no view keeps the rest alive
            keep_k, keep_v = keep_k.clone(), keep_v.clone()
        self.k[i], self.v[i] = keep_k, keep_v
        return k, v


class _LayerCache:
    def __init__(self, cache: WindowKVCache, index: int):
        self.cache, self.index = cache, index

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.update(self.index, k, v)

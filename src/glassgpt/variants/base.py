"""What chapter 4's variants keep of GPT-2: the model around the block, the block, its cache, generation.

Shape legend (model.py's, plus two letters):
    b  batch size     t  new tokens     s  positions attended (t, or the cache's so far plus t)
    d  emb_dim        h  n_heads        hd head size = d // h        V  vocab_size

Each of the book repository's `ch04/04_gqa` ... `07_moe` scripts is GPT-2 with one part swapped,
and a KV cache kept inside the attention modules, driven by `model(ids, use_cache=True)` and
`model.reset_kv_cache()`. This file is that common frame, written once: `CachedGPTModel` (the
book's `tok_emb`, `pos_emb`, `drop_emb`, `trf_blocks`, `final_norm`, `out_head`), the
pre-LayerNorm `TransformerBlock` whose attention and feed-forward a variant hands in, glassgpt's
own `MultiHeadAttention` (model.py) with the repository's cache API, and the repository's greedy
`generate_text_simple_cached`. LayerNorm, GELU and the feed-forward are model.py's.

The variant files (gqa.py, mla.py, swa.py, moe.py) hold what each one changes, and its KV-cache
bytes beside GPT-2's (`mha_kv_cache_bytes`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from .. import anatomy as an
from .. import model as gpt2
from ..config import GPTConfig, from_fields
from ..errors import ConfigError, PromptError


@dataclass(frozen=True)
class VariantConfig(GPTConfig):
    """GPTConfig with the defaults of the repository's scripts (their GPT_CONFIG_124M): no query/key/value
    biases and an out_head of its own, so that a state dict their GPTModel saved loads as it is."""

    qkv_bias: bool = False
    tie_embeddings: bool = False
    variant: ClassVar[str] = ""  # its glass file: "gqa", "mla", "swa" or "moe", as a config JSON names it

    def to_dict(self) -> dict[str, Any]:
        """The fields, after the variant's name: a config JSON that `from_dict` (and `--model FILE.json`) reads back."""
        return {"variant": self.variant} | dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "VariantConfig":
        """This variant's config from a dict of its fields (the repository's GPT_CONFIG_124M), which may name it."""
        values = dict(values)
        named = values.pop("variant", cls.variant)
        if named != cls.variant:
            raise ConfigError(f"variant is {named!r}, and these are {cls.variant}'s fields: correct variant")
        return from_fields(cls, values, ConfigError, "config field")


def describe_gpt_base(cfg: GPTConfig, name: str, fields: tuple[str, ...],
                      attention: Callable[[an.Block], an.Attention] | None = None,
                      ff: Callable[[an.Block], an.FeedForward] | None = None,
                      layer_type: Callable[[an.Block], str] | None = None) -> an.Anatomy:
    """GPT-2's description (model.describe) with the part a variant swaps, block by block: the variant
    file's describe(cfg) says only what it changes (its attention or its feed-forward) and its config fields."""

    def block(b: an.Block) -> an.Block:
        return replace(b, attention=attention(b) if attention else b.attention, ff=ff(b) if ff else b.ff,
                       layer_type=layer_type(b) if layer_type else b.layer_type)

    anatomy = gpt2.describe(cfg)
    return replace(anatomy, name=name, source=f"glassgpt's variants ({name})",
                   blocks=tuple(block(b) for b in anatomy.blocks), config_fields=anatomy.config_fields + fields,
                   exports=(), decoding="own_cache")  # GPT-2's writers know its parts only


def check_language_model(cfg: GPTConfig) -> None:
    """The variants have a language-model head only (no classifier)."""
    if cfg.num_classes is not None:
        raise ConfigError(f"num_classes={cfg.num_classes}: chapter 4's variants have a language-model head only; "
                          "leave num_classes unset")


def append_to_cache(module: nn.Module, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append this step's keys and values (`[b, heads, t, hd]`) to `module.cache_k` / `cache_v`; all of them back."""
    if module.cache_k is None:
        module.cache_k, module.cache_v = k_new, v_new
    else:
        module.cache_k = torch.cat([module.cache_k, k_new], dim=2)  # [b, heads, s - t, hd] -> [b, heads, s, hd]
        module.cache_v = torch.cat([module.cache_v, v_new], dim=2)
    return module.cache_k, module.cache_v


class MultiHeadAttention(gpt2.MultiHeadAttention):
    """glassgpt's chapter-3 attention (model.py), with the repository's cache: `forward(x, use_cache)`.

    model.py's forward hands its keys and values to `cache.update(k, v)` and attends over what that
    returns; here the module is its own cache, keeping `cache_k` and `cache_v` (`[b, h, s, hd]`).
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg)
        self.register_buffer("cache_k", None, persistent=False)
        self.register_buffer("cache_v", None, persistent=False)

    def forward(self, x: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        """`[b, t, d] -> [b, t, d]`; with `use_cache`, x holds the tokens after those cached."""
        return super().forward(x, self if use_cache else None)

    def update(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return append_to_cache(self, k_new, v_new)

    def reset_cache(self) -> None:
        self.cache_k, self.cache_v = None, None


class TransformerBlock(nn.Module):
    """model.py's pre-LayerNorm block, x + att(norm1(x)) then x + ff(norm2(x)), with the variant's att and ff."""

    def __init__(self, cfg: GPTConfig, att: nn.Module, ff: nn.Module):
        super().__init__()
        self.norm1 = gpt2.LayerNorm(cfg.emb_dim)
        self.att = att
        self.norm2 = gpt2.LayerNorm(cfg.emb_dim)
        self.ff = ff
        self.drop_shortcut = nn.Dropout(cfg.drop_rate)

    def forward(self, x: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        x = x + self.drop_shortcut(self.att(self.norm1(x), use_cache=use_cache))
        x = x + self.drop_shortcut(self.ff(self.norm2(x)))
        return x


class CachedGPTModel(nn.Module):
    """GPT-2 (model.py's GPTModel) with a block of the variant's making and the repository's cache API.

    A variant file subclasses it and says what its block `i` is (`make_block`). `current_pos` counts
    the tokens cached so far: the next token's position, for `pos_emb`.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        check_language_model(cfg)
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)     # [V, d]: vocab -> hidden
        self.pos_emb = nn.Embedding(cfg.context_length, cfg.emb_dim)  # [context_length, d]
        self.drop_emb = nn.Dropout(cfg.drop_rate)
        self.trf_blocks = nn.ModuleList(self.make_block(cfg, i) for i in range(cfg.n_layers))
        self.final_norm = gpt2.LayerNorm(cfg.emb_dim)
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)  # hidden -> vocab
        if cfg.tie_embeddings:
            self.out_head.weight = self.tok_emb.weight
        self.current_pos = 0

    def make_block(self, cfg: GPTConfig, i: int) -> TransformerBlock:
        raise NotImplementedError("a variant says what its blocks are")

    def forward(self, in_idx: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        """Token ids `[b, t]` (int64) -> logits `[b, t, V]` in the weights' dtype.

        use_cache: `in_idx` holds the tokens after those already cached (positions current_pos ...),
        whose keys and values every attention keeps; False, as in the book, for whole sequences.
        """
        b, t = in_idx.shape
        start = self.current_pos if use_cache else 0
        if start + t > self.cfg.context_length:
            raise PromptError(f"input reaches position {start + t:,} but context_length is "
                              f"{self.cfg.context_length:,}: shorten it, or call reset_kv_cache() and feed the last "
                              "context_length tokens")
        x = self.tok_emb(in_idx)  # [b, t] -> [b, t, d]
        x = self.drop_emb(x + self.pos_emb(torch.arange(start, start + t, device=in_idx.device)))  # + [t, d]
        for block in self.trf_blocks:
            x = block(x, use_cache=use_cache)
        if use_cache:
            self.current_pos += t
        x = self.final_norm(x)
        return self.out_head(x)  # [b, t, d] -> [b, t, V]

    def reset_kv_cache(self) -> None:
        for block in self.trf_blocks:
            block.att.reset_cache()
        self.current_pos = 0


@torch.no_grad()
def generate_text_simple_cached(model: CachedGPTModel, idx: torch.Tensor, max_new_tokens: int,
                                context_size: int | None = None, use_cache: bool = True) -> torch.Tensor:
    """Greedy generation, the repository's loop: ids `[b, t]` -> `[b, t + max_new_tokens]`.

    With the cache: the prompt (its last context_size tokens) once, then only each new token.
    Without it: the whole sequence (its last context_size tokens) at every step, as chapter 4 does.
    """
    if idx.dim() != 2 or idx.shape[1] == 0:
        raise PromptError(f"the prompt must be ids [batch, tokens] with at least one token, got shape {list(idx.shape)}")
    model.eval()
    ctx_len = context_size or model.cfg.context_length
    if use_cache:
        model.reset_kv_cache()
        logits = model(idx[:, -ctx_len:], use_cache=True)
        for step in range(max_new_tokens):
            next_idx = logits[:, -1].argmax(dim=-1, keepdim=True)  # [b, V] -> [b, 1]
            idx = torch.cat([idx, next_idx], dim=1)
            if step < max_new_tokens - 1:  # (no forward pass for a token after the last)
                logits = model(next_idx, use_cache=True)  # only the new token: [b, 1]
    else:
        for _ in range(max_new_tokens):
            logits = model(idx[:, -ctx_len:])
            next_idx = logits[:, -1].argmax(dim=-1, keepdim=True)
            idx = torch.cat([idx, next_idx], dim=1)
    return idx


def element_bytes(dtype: torch.dtype) -> int:
    """Bytes per number of `dtype` (4 for float32, 2 for bfloat16 and float16, 1 for int8)."""
    return dtype.itemsize


def mha_kv_cache_bytes(cfg: GPTConfig, dtype: torch.dtype, num_tokens: int, batch_size: int = 1) -> int:
    """GPT-2's KV cache (multi-head attention): a key and a value of every head, per token and layer."""
    return batch_size * num_tokens * cfg.n_layers * 2 * cfg.n_heads * cfg.head_dim * element_bytes(dtype)

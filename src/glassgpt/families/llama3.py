"""Llama 3.2 (1B, 3B) as the book's `llms_from_scratch.llama3.Llama3Model` writes it.

    ids [b, t]  --tok_emb-->  [b, t, d]        (vocab -> hidden: a row of a [V, d] matrix; no pos_emb)
    trf_blocks: n_layers x TransformerBlock    x + att(norm1(x)), then x + ff(norm2(x)); RoPE inside att
    final_norm                [b, t, d]
    out_head  -->  logits     [b, t, V]        (hidden -> vocab; tied to tok_emb in 1B and 3B)

Llama 3.2 1B: V = 128,256, d = 2,048, 16 blocks, 32 query heads of 64 sharing 8 key/value heads,
SwiGLU to 8,192, RoPE base 500,000 with Llama 3's frequency scaling (layers.py). What differs from
Qwen3 (qwen3.py): no QK-norm, head_dim = emb_dim // n_heads, eps 1e-5, and the book's norms are
torch.nn.RMSNorm, whose parameter is `weight` (not `scale`): the state dict's names are the book's.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import anatomy as an
from ..errors import PromptError
from ..config import FamilyConfig
from .layers import (CONFIG_FIELDS, FeedForward, GroupedQueryAttention, RopeTables, compute_rope_params, describe_attention,
                     describe_swiglu, rms_norm)


class RMSNorm(nn.Module):
    """torch.nn.RMSNorm as the book's Llama3Model uses it: the formula of layers.rms_norm, its `weight`."""

    def __init__(self, emb_dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(emb_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class TransformerBlock(nn.Module):
    """Pre-norm block: x + att(norm1(x)), then x + ff(norm2(x)). Width stays d. No dropout."""

    def __init__(self, cfg: FamilyConfig):
        super().__init__()
        self.att = GroupedQueryAttention(cfg, keys_first=True)  # the book's order of creation
        self.ff = FeedForward(cfg)
        self.norm1 = RMSNorm(cfg.emb_dim, eps=cfg.norm_eps)
        self.norm2 = RMSNorm(cfg.emb_dim, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        x = x + self.att(self.norm1(x), cos, sin, cache)
        x = x + self.ff(self.norm2(x))
        return x


class Llama3Model(nn.Module):
    def __init__(self, cfg: FamilyConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)  # [V, d]: vocab -> hidden
        self.trf_blocks = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.final_norm = RMSNorm(cfg.emb_dim, eps=cfg.norm_eps)
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)  # hidden -> vocab
        cos, sin = compute_rope_params(cfg.head_dim_value, cfg.rope_base, cfg.context_length, cfg.rope_freq)
        self.rope = RopeTables(cos, sin)  # [context_length, hd] each, float32 whatever the weights' dtype
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make `out_head.weight` the very same Parameter as `tok_emb.weight` (if the config ties them)."""
        if self.cfg.tie_embeddings:
            self.out_head.weight = self.tok_emb.weight

    @property
    def tied(self) -> bool:
        """Told by storage: one Parameter for both, not two with equal values."""
        return self.out_head.weight is self.tok_emb.weight

    def forward(self, in_idx: torch.Tensor, cache=None, last_only: bool = False) -> torch.Tensor:
        """Token ids `[b, t]` (int64) -> logits `[b, t, V]` in the weights' dtype (`[b, 1, V]` with last_only).

        cache: a KVCache (engine/cache.py) holding the tokens before `in_idx`, which are then at
        positions cache.pos ...; None, as in the book, for whole sequences.
        """
        t = in_idx.shape[1]
        start = 0 if cache is None else cache.pos
        if start + t > self.cfg.context_length:
            raise PromptError(f"input is {start + t:,} tokens but context_length is {self.cfg.context_length:,}: "
                              "shorten it (generation keeps only the last context_length tokens)")
        x = self.tok_emb(in_idx)  # [b, t] -> [b, t, d]: no position added; RoPE turns q and k in each block
        cos, sin = self.rope.at(start, t, x.device)  # [t, hd]: these tokens' angles
        for i, block in enumerate(self.trf_blocks):
            x = block(x, cos, sin, None if cache is None else cache.layer(i))
        if cache is not None:
            cache.advance(t)
        x = self.final_norm(x)
        if last_only:
            x = x[:, -1:]  # [b, t, d] -> [b, 1, d]
        return self.out_head(x)  # [b, t, d] -> [b, t, V]: x @ out_head.weight.T


def describe(cfg: FamilyConfig) -> an.Anatomy:
    """This file's model as data (anatomy.py): no learned positions, RoPE in every attention, pre-RMSNorm
    blocks (the norms' parameter is `weight`), grouped-query attention and SwiGLU."""
    def norm(path: str, role: str, dim: int = cfg.emb_dim) -> an.Norm:
        return an.Norm(path, "rmsnorm", dim, cfg.norm_eps, weight="weight", role=role)

    blocks = tuple(an.Block(i, f"trf_blocks.{i}", "pre",
                            (norm(f"trf_blocks.{i}.norm1", "attn_in"), norm(f"trf_blocks.{i}.norm2", "ff_in")),
                            describe_attention(cfg, f"trf_blocks.{i}", "weight"),
                            describe_swiglu(cfg, f"trf_blocks.{i}")) for i in range(cfg.n_layers))
    return an.Anatomy(name="Llama 3.2", source="glassgpt's Llama3Model",
                      embedding=an.Embedding("tok_emb", cfg.vocab_size, cfg.emb_dim),
                      positions=an.Positions("rope", cfg.context_length), blocks=blocks,
                      final_norm=norm("final_norm", "final"),
                      head=an.Head("out_head", cfg.vocab_size, cfg.tie_embeddings), config_fields=CONFIG_FIELDS,
                      exports=("pth", "hf"), decoding="twin")

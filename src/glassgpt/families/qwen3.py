"""Qwen3 (dense: 0.6B to 32B) as the book's `llms_from_scratch.qwen3.Qwen3Model` writes it.

    ids [b, t]  --tok_emb-->  [b, t, d]        (vocab -> hidden: a row of a [V, d] matrix; no pos_emb)
    trf_blocks: n_layers x TransformerBlock    x + att(norm1(x)), then x + ff(norm2(x)); RoPE inside att
    final_norm                [b, t, d]
    out_head  -->  logits     [b, t, V]        (hidden -> vocab; tied to tok_emb in 0.6B to 4B)

Qwen3 0.6B: V = 151,936, d = 1,024, 28 blocks, 16 query heads of 128 sharing 8 key/value heads,
QK-norm, SwiGLU to 3,072, RoPE base 1,000,000. The pieces are in layers.py (shape legend there);
the state dict's names are the book's, so its Qwen3Model's state dict loads as it is.

The mixture-of-experts models (the bonus notebook standalone-qwen3-moe.ipynb; Qwen3 30B-A3B: 48
blocks of 128 experts, 8 run per token) differ in one place: `ff` is a MoEFeedForward, a router
(`gate`) and `num_experts` SwiGLU experts (`fc1[e]`, `fc2[e]`, `fc3[e]`, the notebook's names), of
which each token runs its top `num_experts_per_tok`, weighted by the softmax of their router scores.
A token reads only its experts' weights, so decoding one token reads 8 of the 128.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import anatomy as an
from ..errors import PromptError
from ..config import FamilyConfig
from .layers import (CONFIG_FIELDS, FeedForward, GroupedQueryAttention, RMSNorm, RopeTables, compute_rope_params,
                     describe_attention, describe_swiglu)


class MoEFeedForward(nn.Module):
    """A router and `num_experts` SwiGLU experts; each token runs its top `num_experts_per_tok` (k of E).

    weights = softmax of the k largest router scores (renormalised over the chosen k, so they sum to 1);
    out = sum over the chosen e of weight_e * fc3[e](silu(fc1[e](x)) * fc2[e](x)). Letters: E experts,
    k per token, m = moe_hidden_dim, n = b * t tokens.
    """

    def __init__(self, cfg: FamilyConfig):
        super().__init__()
        d, m = cfg.emb_dim, cfg.moe_hidden_dim
        self.num_experts_per_tok = cfg.num_experts_per_tok
        self.num_experts = cfg.num_experts
        self.emb_dim = d
        self.gate = nn.Linear(d, cfg.num_experts, bias=False)  # the router: [b, t, d] -> [b, t, E] scores
        self.fc1 = nn.ModuleList(nn.Linear(d, m, bias=False) for _ in range(cfg.num_experts))  # gates
        self.fc2 = nn.ModuleList(nn.Linear(d, m, bias=False) for _ in range(cfg.num_experts))  # ups
        self.fc3 = nn.ModuleList(nn.Linear(m, d, bias=False) for _ in range(cfg.num_experts))  # downs

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's chosen experts and their weights: `[b, t, d]` -> (ids `[b, t, k]`, weights `[b, t, k]`)."""
        scores = self.gate(x)  # [b, t, d] -> [b, t, E]
        top_scores, top_ids = torch.topk(scores, self.num_experts_per_tok, dim=-1)  # [b, t, k], largest first
        return top_ids, torch.softmax(top_scores, dim=-1)  # softmax over the k alone: they sum to 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        top_ids, top_weights = self.route(x)
        x_flat = x.reshape(b * t, d)                          # [n, d]
        ids_flat = top_ids.reshape(b * t, -1)                 # [n, k]
        weights_flat = top_weights.reshape(b * t, -1)         # [n, k]
        out = torch.zeros_like(x_flat)
        for e in torch.unique(ids_flat).tolist():  # only the experts some token chose: their weights alone are read
            token, slot = (ids_flat == e).nonzero(as_tuple=True)  # the tokens that chose e, and at which rank
            h = x_flat[token]                                     # [n_e, d]
            expert_out = self.fc3[e](nn.functional.silu(self.fc1[e](h)) * self.fc2[e](h))  # [n_e, m] -> [n_e, d]
            out.index_add_(0, token, expert_out * weights_flat[token, slot, None])
        return out.view(b, t, d)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + att(norm1(x)), then x + ff(norm2(x)). Width stays d. No dropout."""

    def __init__(self, cfg: FamilyConfig):
        super().__init__()
        self.att = GroupedQueryAttention(cfg)
        self.ff = MoEFeedForward(cfg) if cfg.moe else FeedForward(cfg)
        self.norm1 = RMSNorm(cfg.emb_dim, eps=cfg.norm_eps)
        self.norm2 = RMSNorm(cfg.emb_dim, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        x = x + self.att(self.norm1(x), cos, sin, cache)
        x = x + self.ff(self.norm2(x))
        return x


class Qwen3Model(nn.Module):
    def __init__(self, cfg: FamilyConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)  # [V, d]: vocab -> hidden
        self.trf_blocks = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.final_norm = RMSNorm(cfg.emb_dim, eps=cfg.norm_eps)
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)  # hidden -> vocab
        cos, sin = compute_rope_params(cfg.head_dim_value, cfg.rope_base, cfg.context_length)
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
    blocks (the norms' parameter is `scale`), grouped-query attention and SwiGLU."""
    def norm(path: str, role: str, dim: int = cfg.emb_dim) -> an.Norm:
        return an.Norm(path, "rmsnorm", dim, cfg.norm_eps, weight="scale", role=role)

    ff = describe_moe if cfg.moe else describe_swiglu
    blocks = tuple(an.Block(i, f"trf_blocks.{i}", "pre",
                            (norm(f"trf_blocks.{i}.norm1", "attn_in"), norm(f"trf_blocks.{i}.norm2", "ff_in")),
                            describe_attention(cfg, f"trf_blocks.{i}", "scale"),
                            ff(cfg, f"trf_blocks.{i}")) for i in range(cfg.n_layers))
    return an.Anatomy(name="Qwen3 MoE" if cfg.moe else "Qwen3", source="glassgpt's Qwen3Model",
                      embedding=an.Embedding("tok_emb", cfg.vocab_size, cfg.emb_dim),
                      positions=an.Positions("rope", cfg.context_length), blocks=blocks,
                      final_norm=norm("final_norm", "final"),
                      head=an.Head("out_head", cfg.vocab_size, cfg.tie_embeddings),
                      config_fields=CONFIG_FIELDS + (MOE_FIELDS if cfg.moe else ()), exports=("pth", "hf"),
                      decoding="twin")


MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_hidden_dim")


def describe_moe(cfg: FamilyConfig, p: str) -> an.FeedForward:
    """MoEFeedForward of block path `p`: the router `gate`, and expert 0's matrices as up/down/gate (expert e's
    are the same paths with e for 0: `ff.fc1.e`, `ff.fc2.e`, `ff.fc3.e`)."""
    d, m = cfg.emb_dim, cfg.moe_hidden_dim
    experts = an.Experts(router=an.Linear(f"{p}.ff.gate", d, cfg.num_experts, False), n_experts=cfg.num_experts,
                         per_token=cfg.num_experts_per_tok, path=f"{p}.ff")
    return an.FeedForward(f"{p}.ff", "moe", m, "silu", up=an.Linear(f"{p}.ff.fc2.0", d, m, False),
                          down=an.Linear(f"{p}.ff.fc3.0", m, d, False), gate=an.Linear(f"{p}.ff.fc1.0", d, m, False),
                          experts=experts)

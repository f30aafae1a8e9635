"""GPT-2 with a mixture of experts in place of the feed-forward (the book repository's ch04/07_moe, gpt_with_kv_moe.py).

Shape legend (base.py's, plus three letters):
    b batch   t tokens   d emb_dim   n = b * t tokens side by side
    E  num_experts    k  num_experts_per_tok (top-k)    f  hidden_dim (each expert's inner width)

    x [b, t, d] --gate--> scores [b, t, E] --top-k--> k experts per token, softmax over their k scores
    expert e (SwiGLU, as the repository's): fc3[e](silu(fc1[e](x)) * fc2[e](x)), [n_e, d] -> [n_e, f] -> [n_e, d]
    out[token] = sum over its k experts of prob * expert(x[token])          [b, t, d]

The block holds E feed-forwards where GPT-2 has one, and each token runs through k of them: many
parameters, few of them active per token. The attention is GPT-2's, so the KV cache is GPT-2's too
(the repository's memory_estimator_moe.py counts parameters, not cache: `ff_parameters`).
The repository's names: `MoEFeedForward`, `gate`, `fc1`, `fc2`, `fc3`, config keys `num_experts`,
`num_experts_per_tok`, `hidden_dim`. Its dense `num_experts = 0` case is GPT-2 itself (model.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import anatomy as an
from ..errors import ConfigError
from .base import CachedGPTModel, MultiHeadAttention, TransformerBlock, VariantConfig, describe_gpt_base, mha_kv_cache_bytes


@dataclass(frozen=True)
class MoEConfig(VariantConfig):
    variant = "moe"
    num_experts: int = 8          # E: feed-forwards per block
    num_experts_per_tok: int = 2  # k: of them, the ones each token runs through
    hidden_dim: int | None = None  # f: an expert's inner width; None: 4 * emb_dim, GPT-2's

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden_dim is None:
            object.__setattr__(self, "hidden_dim", 4 * self.emb_dim)
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ConfigError(f"num_experts must be a positive integer, got {self.num_experts!r} "
                              "(a dense feed-forward is GPT-2's own model)")
        if not isinstance(self.num_experts_per_tok, int) or not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok must be between 1 and num_experts ({self.num_experts}), "
                              f"got {self.num_experts_per_tok!r}")
        if not isinstance(self.hidden_dim, int) or self.hidden_dim < 1:
            raise ConfigError(f"hidden_dim must be a positive integer, got {self.hidden_dim!r}")


class MoEFeedForward(nn.Module):
    """A router (`gate`) and E SwiGLU experts; each token's output, its k chosen experts' weighted sum."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.num_experts_per_tok = cfg.num_experts_per_tok
        self.emb_dim = cfg.emb_dim
        d, f = cfg.emb_dim, cfg.hidden_dim
        self.gate = nn.Linear(d, cfg.num_experts, bias=False)  # [b, t, d] -> [b, t, E]: one score per expert
        self.fc1 = nn.ModuleList(nn.Linear(d, f, bias=False) for _ in range(cfg.num_experts))
        self.fc2 = nn.ModuleList(nn.Linear(d, f, bias=False) for _ in range(cfg.num_experts))
        self.fc3 = nn.ModuleList(nn.Linear(f, d, bias=False) for _ in range(cfg.num_experts))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e, SwiGLU: `[n, d] -> [n, f] -> [n, d]`."""
        return self.fc3[e](nn.functional.silu(self.fc1[e](x)) * self.fc2[e](x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[b, t, d] -> [b, t, d]`, each token by itself (so a KV cache changes nothing here)."""
        b, t, d = x.shape
        scores = self.gate(x)  # [b, t, E]
        topk_scores, topk_indices = torch.topk(scores, self.num_experts_per_tok, dim=-1)  # [b, t, k]
        topk_probs = torch.softmax(topk_scores, dim=-1)  # over the k chosen only: they sum to 1
        x_flat = x.reshape(b * t, d)  # [b, t, d] -> [n, d]
        chosen = topk_indices.reshape(b * t, -1)  # [n, k]
        probs = topk_probs.reshape(b * t, -1)
        out = torch.zeros_like(x_flat)
        for e in range(self.num_experts):
            # The tokens routed to expert e, and in which of their k slots (an expert is chosen once at most).
            token_idx, slot = (chosen == e).nonzero(as_tuple=True)
            if token_idx.numel() == 0:
                continue
            expert_out = self.expert(e, x_flat[token_idx])  # [n_e, d]
            out.index_add_(0, token_idx, expert_out * probs[token_idx, slot].unsqueeze(-1))
        return out.reshape(b, t, d)  # [n, d] -> [b, t, d]


class GPTModel(CachedGPTModel):
    """GPT-2 whose feed-forward is a mixture of experts: ids `[b, t]` -> logits `[b, t, V]`."""

    def make_block(self, cfg: MoEConfig, i: int) -> TransformerBlock:
        return TransformerBlock(cfg, MultiHeadAttention(cfg), MoEFeedForward(cfg))


def describe(cfg: MoEConfig) -> an.Anatomy:
    """This file's model as data (anatomy.py): GPT-2's, whose feed-forward is E SwiGLU experts behind a
    router; up, gate and down name expert 0 (fc2.0, fc1.0, fc3.0), expert j's are fc2.j, fc1.j, fc3.j."""
    d, f, e = cfg.emb_dim, cfg.hidden_dim, cfg.num_experts

    def ff(b: an.Block) -> an.FeedForward:
        p = f"{b.path}.ff"
        return an.FeedForward(p, "moe", f, "silu", up=an.Linear(f"{p}.fc2.0", d, f, False),
                              down=an.Linear(f"{p}.fc3.0", f, d, False), gate=an.Linear(f"{p}.fc1.0", d, f, False),
                              experts=an.Experts(an.Linear(f"{p}.gate", d, e, False), e, cfg.num_experts_per_tok, p))

    return describe_gpt_base(cfg, "GPT-2 with a mixture of experts",
                             ("num_experts", "num_experts_per_tok", "hidden_dim"), ff=ff)


def kv_cache_bytes(cfg: MoEConfig, dtype: torch.dtype, num_tokens: int, batch_size: int = 1) -> int:
    """GPT-2's: the experts change the feed-forward, not what attention keeps."""
    return mha_kv_cache_bytes(cfg, dtype, num_tokens, batch_size)


def ff_parameters(cfg: MoEConfig) -> dict[str, int]:
    """A block's feed-forward parameters: each expert's (3 d f, SwiGLU), the router's (d E), all of
    them, and those one token runs through (the router and k experts)."""
    per_expert = 3 * cfg.emb_dim * cfg.hidden_dim
    router = cfg.emb_dim * cfg.num_experts
    return {"per_expert": per_expert, "router": router, "total": cfg.num_experts * per_expert + router,
            "active_per_token": router + cfg.num_experts_per_tok * per_expert}

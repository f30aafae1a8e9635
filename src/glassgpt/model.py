"""GPT-2 as the book draws it: the forward pass and nothing else.

Shape legend (used in every comment and in explain.py):
    b  batch size            t  tokens in the input       d  emb_dim (768 for gpt2)
    h  n_heads               hd head size = d // h        V  vocab_size (50,257)

The whole model in one line per stage:
    ids [b, t]  --tok_emb-->  [b, t, d]      (vocab -> hidden: a row lookup in a [V, d] matrix)
              +  pos_emb      [t, d]
    trf_blocks: n_layers x TransformerBlock, each [b, t, d] -> [b, t, d]
    final_norm                [b, t, d]
    out_head  -->  logits     [b, t, V]      (hidden -> vocab: x @ W.T with a [V, d] matrix)

With `tie_embeddings` (GPT-2's choice) `out_head.weight` *is* `tok_emb.weight`.

Follows the book's chapters 3 and 4, with its names (`LayerNorm.scale`/`shift`,
`W_query`, `ff.layers`, ...), so a state dict saved by the book's `GPTModel` fits
this one (weights.py), and OpenAI's GPT-2 (pre-LayerNorm blocks, GELU with the tanh
approximation, learned absolute positions). Each piece is written the way the book
writes it, next to the fused PyTorch call that computes the same numbers faster.

Leaves out everything that only makes it faster: the KV cache, one-token decoding
steps, blocked CPU attention, int8 weights, torch.compile and the chunked loss live
in `glassgpt.engine`, which runs these same modules and is tested equal to them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import GPTConfig
from .errors import PromptError


class LayerNorm(nn.Module):
    """scale * (x - mean) / sqrt(var + eps) + shift over the last dimension (the book's LayerNorm).

    `F.layer_norm` computes exactly this (biased variance, eps inside the root) in one kernel.
    """

    def __init__(self, emb_dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.scale.shape, self.scale, self.shift, self.eps)

    def extra_repr(self) -> str:
        return f"{self.scale.shape[0]}, eps={self.eps}"


def attention_weights(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """softmax(q @ k.T / sqrt(hd)), each query seeing only itself and earlier tokens: `[b, h, t, t]`.

    The book's chapter 3, step by step. `q`, `k` are `[b, h, t, hd]`; row j of the result
    says how much token j draws from tokens 0..j (the row sums to 1).
    """
    t, hd = q.shape[-2], q.shape[-1]
    attn_scores = q @ k.transpose(-2, -1)  # [b, h, t, hd] @ [b, h, hd, t] -> [b, h, t, t]
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(diagonal=1)
    attn_scores = attn_scores.masked_fill(future, float("-inf"))  # token j may not look at j+1..
    return torch.softmax(attn_scores / math.sqrt(hd), dim=-1)


class MultiHeadAttention(nn.Module):
    """Causal self-attention with `n_heads` heads of size `head_dim` (the book's chapter 3).

    `fused` picks how the heads attend: `F.scaled_dot_product_attention` (True, the default:
    one kernel, flash attention on GPUs) or the book's written-out steps (False); both give
    the same numbers, apart from float rounding and the random pattern of attention dropout.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.emb_dim
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.W_query = nn.Linear(d, d, bias=cfg.qkv_bias)
        self.W_key = nn.Linear(d, d, bias=cfg.qkv_bias)
        self.W_value = nn.Linear(d, d, bias=cfg.qkv_bias)
        self.out_proj = nn.Linear(d, d)
        self.dropout = nn.Dropout(cfg.drop_rate)
        self.fused = True

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # [b, t, d] -> [b, h, t, hd]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.split_heads(self.W_query(x))  # each head attends in its own hd-wide slice
        k = self.split_heads(self.W_key(x))
        v = self.split_heads(self.W_value(x))
        if self.fused:
            context = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout.p if self.training else 0.0)
        else:
            attn_weights = self.dropout(attention_weights(q, k))  # [b, h, t, t]
            context = attn_weights @ v  # [b, h, t, t] @ [b, h, t, hd] -> [b, h, t, hd]
        context = context.transpose(1, 2).reshape(b, t, d)  # [b, h, t, hd] -> [b, t, d]: heads side by side
        return self.out_proj(context)


class FeedForward(nn.Module):
    """d -> 4d -> d with GELU between: the only place the width grows inside a block."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(cfg.emb_dim, 4 * cfg.emb_dim),  # [b, t, d] -> [b, t, 4d]
            # The book's GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), GPT-2's "gelu_new".
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * cfg.emb_dim, cfg.emb_dim),  # [b, t, 4d] -> [b, t, d]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: x + att(norm1(x)), then x + ff(norm2(x)). Width stays d."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm1 = LayerNorm(cfg.emb_dim)
        self.att = MultiHeadAttention(cfg)
        self.norm2 = LayerNorm(cfg.emb_dim)
        self.ff = FeedForward(cfg)
        self.drop_shortcut = nn.Dropout(cfg.drop_rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_shortcut(self.att(self.norm1(x)))
        x = x + self.drop_shortcut(self.ff(self.norm2(x)))
        return x


class GPTModel(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)     # [V, d]: vocab -> hidden
        self.pos_emb = nn.Embedding(cfg.context_length, cfg.emb_dim)  # [context_length, d]
        self.drop_emb = nn.Dropout(cfg.drop_rate)
        self.trf_blocks = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.final_norm = LayerNorm(cfg.emb_dim)
        if cfg.num_classes is None:
            self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)  # hidden -> vocab
        else:
            self.out_head = nn.Linear(cfg.emb_dim, cfg.num_classes)  # hidden -> classes
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make `out_head.weight` the very same Parameter as `tok_emb.weight` (if the config ties them)."""
        if self.cfg.tie_embeddings:
            self.out_head.weight = self.tok_emb.weight

    @property
    def tied(self) -> bool:
        return self.out_head.weight is self.tok_emb.weight

    def reset_parameters(self, seed: int | None = None) -> None:
        """GPT-2's initialisation: N(0, 0.02) weights, zero biases, LayerNorm scale 1 and shift 0,
        and residual projections scaled by 1/sqrt(2 * n_layers) so the residual stream's
        variance does not grow with depth."""
        gen = None
        if seed is not None:
            device = self.tok_emb.weight.device
            gen = torch.Generator(device=device).manual_seed(seed)
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith("out_proj.weight") or name.endswith("layers.2.weight"):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.cfg.n_layers), generator=gen)
            elif p.dim() >= 2:
                nn.init.normal_(p, 0.0, std, generator=gen)
            elif name.endswith(".scale"):
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)

    def num_parameters(self, count_tied_twice: bool = False) -> int:
        """Parameters as PyTorch stores them (a tied matrix once), or as if untied."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a shared tensor once
        if count_tied_twice and self.tied:
            n += self.out_head.weight.numel()
        return n

    def forward(self, in_idx: torch.Tensor) -> torch.Tensor:
        """Token ids `[b, t]` (int64) -> logits `[b, t, V]` in the weights' dtype."""
        b, t = in_idx.shape
        if t > self.cfg.context_length:
            raise PromptError(
                f"input is {t:,} tokens but context_length is {self.cfg.context_length:,}: "
                "shorten it (generation keeps only the last context_length tokens)"
            )
        x = self.tok_emb(in_idx)  # [b, t] -> [b, t, d]: row in_idx[i, j] of the [V, d] matrix
        x = self.drop_emb(x + self.pos_emb(torch.arange(t, device=in_idx.device)))  # + [t, d], for every row
        for block in self.trf_blocks:
            x = block(x)
        x = self.final_norm(x)
        return self.out_head(x)  # [b, t, d] -> [b, t, V]: x @ out_head.weight.T

"""GPT-2, written the way the book draws it, and the forward pass and nothing else.

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

Follows the book's chapter 4 and OpenAI's GPT-2 (pre-LayerNorm blocks, GELU with
the tanh approximation, learned absolute positions). Attention runs through
`scaled_dot_product_attention`, which picks a fused kernel (flash attention on
GPUs); on a CPU a one-token step and a long bfloat16 prompt attend with plain
matmuls instead, which measured faster there. A `KVCache` lets generation process
one new token per step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import GPTConfig
from .errors import PromptError


class KVCache:
    """Keys and values of every layer, allocated once and written in place.

    `k[layer]` and `v[layer]` are `[b, h, max_len, hd]`; positions `[0, pos)` are filled.
    Appending never reallocates or concatenates, so a decode step costs the same at
    token 10 as at token 1,000 (apart from attention itself).

    One tensor per layer, not one `[n_layers, ...]` tensor: torch.compile turns a write
    into a slice of a graph input into a copy of that whole input, so with one shared
    tensor every layer's write copied all layers' caches (n_layers^2 copies per step).
    """

    def __init__(self, cfg: GPTConfig, batch_size: int, max_len: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        max_len = max_len or cfg.context_length
        shape = (batch_size, cfg.n_heads, max_len, cfg.head_dim)
        # Uninitialised on purpose: only positions [0, pos) are ever read, and zeroing a
        # full-context cache (75 MB for gpt2 at batch 1 in float32) costs more than a short reply.
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.max_len = max_len
        self.pos = 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    def reset(self) -> None:
        self.pos = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `k`, `v` ([b, h, t, hd]) at the current position; return all keys/values so far."""
        end = self.pos + k.shape[2]
        self.k[layer][:, :, self.pos:end] = k
        self.v[layer][:, :, self.pos:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


ATTENTION_BLOCK = 128


def attention_in_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        block: int = ATTENTION_BLOCK) -> torch.Tensor:
    """Causal attention written out as the book's chapter 3 does it, a block of queries at a time.

    `q` `[b, h, t, hd]` holds the last t of the positions in `k`, `v` `[b, h, start + t, hd]`
    (start > 0 when earlier keys come from a KV cache); returns `[b, h, t, hd]`. Queries
    `s..e-1` see keys `0..start+e-1` only, so a block multiplies against the keys it can see
    and skips the rest: with 128-query blocks a 512-token prompt computes 5/8 of the full
    `t x t` scores, and each block's scores stay small enough to sit in the CPU's cache while
    they are softmaxed (in float32). A one-token decoding step is one block of one query,
    which sees every key: no mask at all.

    Used on a CPU outside training, where it measured faster than PyTorch's fused kernel
    (an AVX512-BF16 CPU without AMX; benchmarks/RESULTS.md): for a one-token step, whose
    fused set-up alone costs ~40 us per layer, and for bfloat16 prompts of 128+ tokens
    without gradients (1.5x the fused kernel on its own, ~5% of a 512-token gpt2 prefill;
    256-query blocks were slower than the fused kernel). Everywhere else
    `scaled_dot_product_attention` runs.
    """
    t, hd = q.shape[-2], q.shape[-1]
    start = k.shape[-2] - t
    blocks = []
    for s in range(0, t, block):
        e = min(s + block, t)
        scores = (q[..., s:e, :] @ k[..., :start + e, :].transpose(-1, -2)).float() * (1.0 / math.sqrt(hd))
        if e - s > 1:  # query start+i may not see keys after it; a lone query sees all it is given
            future = torch.ones(e - s, start + e, dtype=torch.bool, device=q.device).triu(diagonal=start + s + 1)
            scores.masked_fill_(future, float("-inf"))
        blocks.append(scores.softmax(dim=-1).to(v.dtype) @ v[..., :start + e, :])
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=-2)


class MultiHeadAttention(nn.Module):
    """Causal self-attention with `n_heads` heads of size `head_dim`, as in the book's chapter 3."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.emb_dim
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.W_query = nn.Linear(d, d, bias=cfg.qkv_bias)
        self.W_key = nn.Linear(d, d, bias=cfg.qkv_bias)
        self.W_value = nn.Linear(d, d, bias=cfg.qkv_bias)
        self.out_proj = nn.Linear(d, d)
        self.drop_rate = cfg.drop_rate

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        b, t, d = x.shape
        # [b, t, d] -> [b, h, t, hd]: each head attends in its own hd-wide slice.
        q = self.W_query(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.W_key(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.W_value(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)

        start = 0
        if cache is not None:
            start = cache.pos
            k, v = cache.update(layer, k, v)  # [b, h, start + t, hd]
        # softmax(q @ k.T / sqrt(hd), causal) @ v: fused by SDPA, except on a CPU outside
        # training for a one-token step or a long bfloat16 prompt without gradients, where
        # the same sums written out measured faster (see attention_in_blocks).
        if q.device.type == "cpu" and not self.training and (
                t == 1 or (t >= ATTENTION_BLOCK and q.dtype == torch.bfloat16 and not torch.is_grad_enabled())):
            context = attention_in_blocks(q, k, v)
        else:
            # A single new query sees every cached key: no mask. Several see up to their own
            # position. (Plain `if`s, `t` tested first: a one-token step never looks at the
            # cache position, so torch.compile keeps it symbolic instead of recompiling per step.)
            mask, causal = None, False
            if t > 1:
                if start == 0:
                    causal = True
                else:  # new queries sit at positions start..start+t-1
                    mask = torch.ones(t, start + t, dtype=torch.bool, device=x.device).tril(diagonal=start)
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, dropout_p=self.drop_rate if self.training else 0.0,
            )  # [b, h, t, hd]
        context = context.transpose(1, 2).reshape(b, t, d)  # [b, h, t, hd] -> [b, t, d]
        return self.out_proj(context)


class FeedForward(nn.Module):
    """d -> 4d -> d with GELU between: the only place the width grows inside a block."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(cfg.emb_dim, 4 * cfg.emb_dim),  # [b, t, d] -> [b, t, 4d]
            nn.GELU(approximate="tanh"),               # GPT-2's "gelu_new"
            nn.Linear(4 * cfg.emb_dim, cfg.emb_dim),  # [b, t, 4d] -> [b, t, d]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: x + attn(norm1(x)), then x + ff(norm2(x)). Width stays d."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.emb_dim, eps=1e-5)
        self.att = MultiHeadAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.emb_dim, eps=1e-5)
        self.ff = FeedForward(cfg)
        self.drop_shortcut = nn.Dropout(cfg.drop_rate)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        x = x + self.drop_shortcut(self.att(self.norm1(x), cache, layer))
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
        self.final_norm = nn.LayerNorm(cfg.emb_dim, eps=1e-5)
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
        """GPT-2's initialisation: N(0, 0.02) weights, zero biases, and residual
        projections scaled by 1/sqrt(2 * n_layers) so the residual stream's variance
        does not grow with depth."""
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
            elif "norm" in name and name.endswith("weight"):
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)

    def num_parameters(self, count_tied_twice: bool = False) -> int:
        """Parameters as PyTorch stores them (a tied matrix once), or as if untied."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a shared tensor once
        if count_tied_twice and self.tied:
            n += self.out_head.weight.numel()
        return n

    def forward(self, in_idx: torch.Tensor, cache: KVCache | None = None,
                last_only: bool = False) -> torch.Tensor:
        """Token ids `[b, t]` (int64) -> logits `[b, t, V]` in the weights' dtype.

        `cache`: keys/values of earlier tokens; `in_idx` then holds only the new ones,
        placed at positions `cache.pos ...`, and the cache advances by t.
        `last_only`: apply `out_head` to the last position only (`[b, 1, V]`), as
        generation needs; it saves a [t, d] x [d, V] matmul.
        """
        b, t = in_idx.shape
        start = cache.pos if cache is not None else 0
        if start + t > self.cfg.context_length:
            raise PromptError(
                f"input is {start + t:,} tokens but context_length is {self.cfg.context_length:,}: "
                "shorten it (generation keeps only the last context_length tokens)"
            )
        if cache is not None and start + t > cache.max_len:
            raise PromptError(f"the KV cache holds {cache.max_len:,} positions but {start + t:,} are needed: "
                              "make the KVCache with a larger max_len")
        x = self.tok_emb(in_idx)  # [b, t] -> [b, t, d]: row in_idx[i, j] of the [V, d] matrix
        positions = torch.arange(start, start + t, device=in_idx.device)
        x = self.drop_emb(x + self.pos_emb(positions))  # + [t, d], broadcast over the batch
        for layer, block in enumerate(self.trf_blocks):
            x = block(x, cache, layer)
        if cache is not None:
            cache.pos += t
        x = self.final_norm(x)
        if last_only:
            x = x[:, -1:]
        return self.out_head(x)  # [b, t, d] -> [b, t, V]: x @ out_head.weight.T

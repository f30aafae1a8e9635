"""Attention for the engine: the book's causal attention over a KV cache, in the fastest form per case.

`attend(q, k, v)` takes queries for the last t of the positions that `k`, `v` hold (the
earlier ones come from a KV cache) and returns the same context as the glass model's
`MultiHeadAttention`, by one of two paths:
  - "sdpa": `F.scaled_dot_product_attention` (flash attention on GPUs);
  - "blocks": the sums written out, a block of queries at a time (`attention_in_blocks`).
    For a one-token decoding step that is one block of one query, which sees every key, so
    no mask and none of the fused kernel's set-up; for a long prompt, each block of queries
    multiplies only the keys it may see, and its scores stay in the CPU's cache while they
    are softmaxed in float32.
Which is faster depends on the CPU (benchmarks/RESULTS.md: the blocks won long bfloat16
prompts on an AMD EPYC and lost them on a Xeon), so on a CPU, without dropout, a decoding
step takes `decode_path`, a prompt of `ATTENTION_BLOCK`+ tokens without gradients
`prompt_path`, and a sequence of up to `ATTENTION_BLOCK` tokens with gradients (training)
`train_path`, each measured per machine by autotune.py (on a Xeon, SDPA's bfloat16 backward
took 12 ms where the written-out sums took 3.5 ms, for 8 sequences of 72 tokens); everything
else runs SDPA.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

ATTENTION_BLOCK = 128


PATHS = ("sdpa", "blocks")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
           decode_path: str = "blocks", prompt_path: str = "sdpa", train_path: str = "sdpa") -> torch.Tensor:
    """Causal attention of `q` `[b, h, t, hd]`, the last t positions of `k`, `v` `[b, h, start + t, hd]`."""
    t = q.shape[-2]
    start = k.shape[-2] - t
    if q.device.type == "cpu" and dropout_p == 0.0 and (
            (t == 1 and decode_path == "blocks")
            or (t >= ATTENTION_BLOCK and prompt_path == "blocks" and not torch.is_grad_enabled())
            or (1 < t <= ATTENTION_BLOCK and train_path == "blocks" and torch.is_grad_enabled())):
        return attention_in_blocks(q, k, v)
    # One new query sees every cached key: no mask. Several see up to their own position.
    # (Plain `if`s, `t` tested first: a one-token step never looks at the cache position,
    # so torch.compile keeps it symbolic instead of recompiling at every step.)
    mask, causal = None, False
    if t > 1:
        if start == 0:
            causal = True
        else:  # the new queries sit at positions start..start+t-1
            mask = torch.ones(t, start + t, dtype=torch.bool, device=q.device).tril(diagonal=start)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout_p)


def attention_in_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        block: int = ATTENTION_BLOCK) -> torch.Tensor:
    """The book's attention (scores, causal mask, softmax, context), `block` queries at a time.

    Queries `s..e-1` sit at positions `start+s..start+e-1` and see keys `0..start+e-1` only,
    so each block multiplies against the keys it can see and skips the rest (a 512-token
    prompt in 128-query blocks computes 5/8 of the `t x t` scores). Scores are softmaxed in
    float32. Returns `[b, h, t, hd]`.
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



def attend_packed(attend: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  index: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """`attend` over packed `q`, `k`, `v` `[1, h, N, hd]` (packing.py): the N positions scattered to their
    rows, `[b, h, t, hd]` (zeros where a row was cut: only that row's later positions could see them, and
    they are not computed), attended causally row by row, and the kept positions' context gathered back."""
    h, hd = q.shape[1], q.shape[-1]

    def scatter(x: torch.Tensor) -> torch.Tensor:  # [1, h, N, hd] -> [b, h, t, hd], laid out as split_heads'
        rows = x.new_zeros(b * t, h, hd).index_copy(0, index, x[0].transpose(0, 1))
        return rows.view(b, t, h, hd).transpose(1, 2)

    context = attend(scatter(q), scatter(k), scatter(v))  # [b, h, t, hd]
    kept = context.transpose(1, 2).reshape(b * t, h, hd).index_select(0, index)  # [N, h, hd]
    return kept.transpose(0, 1).unsqueeze(0)  # [1, h, N, hd]

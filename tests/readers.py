"""Models a reader brings, written for the tests: a nanoGPT-style GPT, a reader's copy of the book's
GPTModel with the book's names (no mask buffer), and copies of the book's GPTModel with one planted
mistake each (the book's own classes from llms_from_scratch, subclassed; nothing is copied into src/).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from llms_from_scratch import ch03, ch04

BOOK_TINY = {"vocab_size": 50257, "context_length": 32, "emb_dim": 64, "n_heads": 4, "n_layers": 2,
             "drop_rate": 0.1, "qkv_bias": False}
PROMPT = [6109, 3626, 6100, 345]  # "Every effort moves you"


# --- nanoGPT's GPT, as its model.py writes it (the parts a forward pass needs) -------------------

class NanoLayerNorm(nn.Module):
    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd: int, bias: bool):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool):
        super().__init__()
        self.ln_1 = NanoLayerNorm(n_embd, bias)
        self.attn = CausalSelfAttention(n_embd, n_head, bias)
        self.ln_2 = NanoLayerNorm(n_embd, bias)
        self.mlp = MLP(n_embd, bias)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab_size=50304, block_size=32, n_layer=2, n_head=4, n_embd=64, bias=True):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd), drop=nn.Dropout(0.0),
            h=nn.ModuleList([Block(n_embd, n_head, bias) for _ in range(n_layer)]),
            ln_f=NanoLayerNorm(n_embd, bias)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02 if not name.endswith("c_proj.weight") else 0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx, targets=None):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x[:, [-1], :]), None  # inference: the last position only, as nanoGPT returns


# --- a reader's copy with the book's names, its mask computed on the fly (no buffer) ---------------

class MyAttention(ch03.MultiHeadAttention):
    """The book's attention, with the planted mistake `bug` (None: none) and no mask buffer."""

    bug: str | None = None

    def forward(self, x):
        b, t, _ = x.shape
        split = ((lambda y: y.view(b, self.num_heads, t, self.head_dim)) if self.bug == "view_no_transpose"
                 else (lambda y: y.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)))
        keys, queries, values = split(self.W_key(x)), split(self.W_query(x)), split(self.W_value(x))
        scores = queries @ keys.transpose(2, 3)
        mask = torch.ones(t, t, dtype=torch.bool).triu(0 if self.bug == "mask_diagonal" else 1)
        if self.bug == "mask_wrong_side":
            mask = torch.ones(t, t, dtype=torch.bool).tril(-1)
        if self.bug != "no_mask":
            scores = scores.masked_fill(mask, -torch.inf)
        scale = 1.0 if self.bug == "no_scale" else keys.shape[-1] ** 0.5
        weights = torch.softmax(scores / scale, dim=-2 if self.bug == "softmax_dim" else -1)
        weights = F.dropout(weights, 0.5) if self.bug == "dropout" else self.dropout(weights)
        context = weights @ values
        context = context.reshape(b, t, self.d_out) if self.bug == "view_no_transpose" \
            else context.transpose(1, 2).reshape(b, t, self.d_out)
        return self.out_proj(context)


class MyLayerNorm(ch04.LayerNorm):
    bug: str | None = None

    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=self.bug == "unbiased_var")
        eps = 0.0 if self.bug == "no_eps" else self.eps
        return self.scale * (x - mean) / torch.sqrt(var + eps) + self.shift


class MyBlock(ch04.TransformerBlock):
    bug: str | None = None

    def forward(self, x):
        shortcut = x
        x = self.drop_resid(self.att(self.norm1(x)))
        x = x if self.bug == "no_shortcut" else x + shortcut
        return x + self.drop_resid(self.ff(self.norm2(x)))


class MyGPT(ch04.GPTModel):
    """A reader's copy: the book's GPTModel with its names, one planted mistake `bug` (None: none)."""

    def __init__(self, cfg, bug: str | None = None):
        super().__init__(cfg)
        self.bug = bug
        for blk in self.trf_blocks:
            blk.__class__ = type("Block", (MyBlock,), {"bug": bug})
            blk.att.__class__ = type("Attention", (MyAttention,), {"bug": bug})
            del blk.att.mask  # the reader computes the mask on the fly
            for norm in (blk.norm1, blk.norm2):
                norm.__class__ = type("Norm", (MyLayerNorm,), {"bug": bug})
            if bug == "exact_gelu":
                blk.ff.layers[1] = nn.GELU()
        if bug == "no_eps":  # embeddings this small make eps matter: var ~ 1e-6 against eps 1e-5
            with torch.no_grad():
                self.tok_emb.weight.mul_(1e-3)
                self.pos_emb.weight.mul_(1e-3)

    def forward(self, in_idx):
        t = in_idx.shape[1]
        start = 1 if self.bug == "pos_from_1" else 0
        x = self.tok_emb(in_idx) + self.pos_emb(torch.arange(start, start + t, device=in_idx.device))
        x = self.trf_blocks(self.drop_emb(x))
        return self.out_head(self.final_norm(x))


def book_model(seed: int = 123, **overrides) -> ch04.GPTModel:
    torch.manual_seed(seed)
    return ch04.GPTModel({**BOOK_TINY, **overrides})


def my_model(bug: str | None = None, seed: int = 123) -> MyGPT:
    torch.manual_seed(seed)
    return MyGPT(BOOK_TINY, bug)

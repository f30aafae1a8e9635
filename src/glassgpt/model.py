"""GPT-2 as the book draws it: the forward pass and nothing else.

Shape legend (used in every comment and in explain/):
    b  batch size            t  tokens in the input       d  emb_dim (768 for gpt2)
    h  n_heads               hd head size = d // h        V  vocab_size (50,257)

The whole model in one line per stage:
    ids [b, t]  --tok_emb-->  [b, t, d]      (vocab -> hidden: a row lookup in a [V, d] matrix)
              +  pos_emb      [t, d]
    trf_blocks: n_layers x TransformerBlock, each [b, t, d] -> [b, t, d]
    final_norm                [b, t, d]
    out_head  -->  logits     [b, t, V]      (hidden -> vocab: x @ W.T with a [V, d] matrix)

With `tie_embeddings` (GPT-2's choice) `out_head.weight` *is* `tok_emb.weight`.

Follows the book's chapters 3 and 4, with its names (`LayerNorm.scale`/`shift`, `W_query`,
`ff.layers`, ...) and its formulas as it writes them: its LayerNorm, its GELU, its attention
with dropout on the attention weights. So a state dict saved by the book's `GPTModel` fits
this one, and the same weights, inputs and seed give the book's numbers bit for bit, in
training too (tests/test_book.py). The architecture is OpenAI's GPT-2: pre-LayerNorm
blocks, GELU with the tanh approximation, learned absolute positions.

The one addition is `cache`, as in the book's bonus chapter on the KV cache: generation
passes the engine's cache (engine/cache.py) so that a step feeds only the new tokens,
whose keys and values are appended to those of the tokens before them.

Leaves out everything that only makes it faster: the fused kernels (F.layer_norm, the
fused GELU, scaled_dot_product_attention), int8 weights, torch.compile and the chunked
loss live in `glassgpt.engine`, which runs these same blocks and is tested equal to them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from . import anatomy as an
from .config import INIT_ALIASES, INIT_SCHEMES, GPTConfig, init_name  # noqa: F401 (the schemes init_weights draws)
from .errors import PromptError

# The book's constant, computed as the book computes it: float32's sqrt of float32(2 / pi),
# one unit in the last place away from float32(math.sqrt(2 / pi)).
SQRT_2_OVER_PI = torch.sqrt(torch.tensor(2.0 / torch.pi, dtype=torch.float32))

class LayerNorm(nn.Module):
    """scale * (x - mean) / sqrt(var + eps) + shift over the last dimension (the book's LayerNorm)."""

    def __init__(self, emb_dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)  # biased: divides by d, as GPT-2 does
        norm_x = (x - mean) / torch.sqrt(var + self.eps)
        return self.scale * norm_x + self.shift

    def extra_repr(self) -> str:
        return f"{self.scale.shape[0]}, eps={self.eps}"


class GELU(nn.Module):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): the book's GELU, GPT-2's "gelu_new"."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1 + torch.tanh(SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3))))


def attention_weights(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """softmax(q @ k.T / sqrt(hd)), each query seeing only itself and earlier tokens: `[b, h, t, s]`.

    The book's chapter 3, step by step. `q` is `[b, h, t, hd]`, `k` is `[b, h, s, hd]`: the
    queries are the last t of the s positions (s = t without a cache). Row j of the result
    says how much query j draws from each position it may see (the row sums to 1).
    """
    t, s, hd = q.shape[-2], k.shape[-2], q.shape[-1]
    attn_scores = q @ k.transpose(-2, -1)  # [b, h, t, hd] @ [b, h, hd, s] -> [b, h, t, s]
    # Query j sits at position s - t + j and may not look at the positions after it.
    future = torch.ones(t, s, dtype=torch.bool, device=q.device).triu(diagonal=s - t + 1)
    attn_scores = attn_scores.masked_fill(future, -torch.inf)
    return torch.softmax(attn_scores / hd**0.5, dim=-1)


class MultiHeadAttention(nn.Module):
    """Causal self-attention with `n_heads` heads of size `head_dim` (the book's chapter 3)."""

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

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # [b, t, d] -> [b, h, t, hd]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The heads' context `[b, h, t, hd]`: attention weights, dropped out, times the values."""
        attn_weights = self.dropout(attention_weights(q, k))  # [b, h, t, s]
        return attn_weights @ v  # [b, h, t, s] @ [b, h, s, hd] -> [b, h, t, hd]

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        """`[b, t, d] -> [b, t, d]`. `cache`: this layer's part of the engine's KV cache, or None."""
        b, t, d = x.shape
        # Keys before queries, as the book computes them: backward adds the three gradients
        # into x in the reverse order, so this order decides the last bit of every update.
        k = self.split_heads(self.W_key(x))  # each head attends in its own hd-wide slice
        q = self.split_heads(self.W_query(x))
        v = self.split_heads(self.W_value(x))
        if cache is not None:
            k, v = cache.update(k, v)  # the earlier tokens' keys and values, then these: [b, h, s, hd]
        context = self.attend(q, k, v)
        context = context.transpose(1, 2).reshape(b, t, d)  # [b, h, t, hd] -> [b, t, d]: heads side by side
        return self.out_proj(context)


class FeedForward(nn.Module):
    """d -> 4d -> d with GELU between: the only place the width grows inside a block."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(cfg.emb_dim, 4 * cfg.emb_dim),  # [b, t, d] -> [b, t, 4d]
            GELU(),
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

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        x = x + self.drop_shortcut(self.att(self.norm1(x), cache))
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
        # (a head wrapped by the book's LoRA has no weight of its own, and is never tied)
        return getattr(self.out_head, "weight", None) is self.tok_emb.weight

    def reset_parameters(self, seed: int | None = None, scheme: str = "gpt2") -> None:
        """Draw random weights by `scheme` (INIT_SCHEMES), seeded, whatever the RNG's state.

        "gpt2": N(0, 0.02) weights, zero biases, LayerNorm scale 1 and shift 0, and residual
        projections scaled by 1/sqrt(2 * n_layers) so the residual stream's variance does not
        grow with depth.
        "pytorch-default": what `torch.manual_seed(seed); GPTModel(cfg)` draws in the book's code: each
        nn.Embedding's and nn.Linear's own default initialisation, in the order the book builds
        them (the same order as here), from the CPU generator: N(0, 1) embeddings, Kaiming-uniform
        weights and uniform biases. The weights must be on the CPU.
        """
        scheme = init_name(scheme)
        if scheme == "pytorch-default":
            if self.tok_emb.weight.device.type != "cpu":
                raise ValueError("the book's initialisation draws from the CPU generator: build on the CPU, then move")
            with torch.random.fork_rng(devices=[]):
                if seed is not None:
                    torch.manual_seed(seed)
                for module in self.modules():
                    if isinstance(module, (nn.Embedding, nn.Linear)):
                        module.reset_parameters()
                    elif isinstance(module, LayerNorm):
                        nn.init.ones_(module.scale)
                        nn.init.zeros_(module.shift)
            return
        if scheme != "gpt2":
            raise ValueError(f"unknown initialisation {scheme!r}: choose one of {sorted(INIT_SCHEMES)}")
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.tok_emb.weight.device).manual_seed(seed)
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

    def forward(self, in_idx: torch.Tensor, cache=None, last_only: bool = False) -> torch.Tensor:
        """Token ids `[b, t]` (int64) -> logits `[b, t, V]` in the weights' dtype.

        cache: the engine's KVCache holding the tokens before `in_idx` (which then holds only
        the new tokens, at positions cache.pos ...); None, as in the book, for whole sequences.
        last_only: logits of the last position only, `[b, 1, V]`: all that generation reads,
        without the [t, d] x [d, V] matmul of the other positions.
        """
        b, t = in_idx.shape
        start = 0 if cache is None else cache.pos
        if start + t > self.cfg.context_length:
            raise PromptError(
                f"input is {start + t:,} tokens but context_length is {self.cfg.context_length:,}: "
                "shorten it (generation keeps only the last context_length tokens)"
            )
        x = self.tok_emb(in_idx)  # [b, t] -> [b, t, d]: row in_idx[i, j] of the [V, d] matrix
        x = self.drop_emb(x + self.pos_emb(torch.arange(start, start + t, device=in_idx.device)))  # + [t, d]
        for i, block in enumerate(self.trf_blocks):
            x = block(x, None if cache is None else cache.layer(i))
        if cache is not None:
            cache.advance(t)
        x = self.final_norm(x)
        if last_only:
            x = x[:, -1:]  # [b, t, d] -> [b, 1, d]
        return self.out_head(x)  # [b, t, d] -> [b, t, V]: x @ out_head.weight.T


def describe(cfg: GPTConfig) -> an.Anatomy:
    """This file's model as data (anatomy.py): learned positions, pre-LayerNorm blocks of multi-head
    attention and a GELU MLP, the book's names. The tie is the config's; glassgpt.describe(model) tells
    a live model's by storage."""
    d, h, hd, f = cfg.emb_dim, cfg.n_heads, cfg.head_dim, 4 * cfg.emb_dim

    def layer_norm(path: str, role: str) -> an.Norm:
        return an.Norm(path, "layernorm", d, 1e-5, weight="scale", bias="shift", role=role)

    def block(i: int) -> an.Block:
        p = f"trf_blocks.{i}"
        att = an.Attention(f"{p}.att", "causal", h, h, hd,
                           query=an.Linear(f"{p}.att.W_query", d, d, cfg.qkv_bias),
                           key=an.Linear(f"{p}.att.W_key", d, d, cfg.qkv_bias),
                           value=an.Linear(f"{p}.att.W_value", d, d, cfg.qkv_bias),
                           out=an.Linear(f"{p}.att.out_proj", d, d, True))
        ff = an.FeedForward(f"{p}.ff", "gelu_mlp", f, "gelu_tanh", up=an.Linear(f"{p}.ff.layers.0", d, f, True),
                            down=an.Linear(f"{p}.ff.layers.2", f, d, True), activation_path=f"{p}.ff.layers.1")
        return an.Block(i, p, "pre", (layer_norm(f"{p}.norm1", "attn_in"), layer_norm(f"{p}.norm2", "ff_in")), att, ff)

    classes = cfg.num_classes is not None
    return an.Anatomy(
        name="GPT-2", source="glassgpt's GPTModel",
        embedding=an.Embedding("tok_emb", cfg.vocab_size, d, dropout="drop_emb"),
        positions=an.Positions("learned", cfg.context_length, "pos_emb"),
        blocks=tuple(block(i) for i in range(cfg.n_layers)),
        final_norm=layer_norm("final_norm", "final"),
        head=an.Head("out_head", cfg.out_dim, cfg.tie_embeddings, bias=classes),
        config_fields=("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers", "drop_rate", "qkv_bias",
                       "tie_embeddings", "num_classes"),
        exports=("pth", "hf", "gguf"), decoding="engine")

"""CUDA graphs for the decoding step: one replay per token in place of a launch per operation.

    step = GraphStep(fast, cache)   # fast: the engine's fused twin; cache: a KVCache on a GPU
    logits = step(ids)              # ids [b] at cache.pos -> logits [b, V]; cache.pos += 1

On a GPU a batch-1 step of gpt2 is a few hundred small kernels, each launched from Python, and the
launches take longer than the kernels. A CUDA graph records the launches once and replays them with
one call. A graph replays the same kernels on the same addresses, so the step it records has the
same shapes at every position (`static_step`):
  - the position is a tensor (`pos`), read on the device: the position embedding's row, the
    cache write (`index_copy_`), and the mask;
  - attention reads the whole cache, `max_len` positions, with the positions after this token
    masked: a softmax weight of exactly 0 for each, so the context is the sliced attention's
    (tests/test_graphs.py, which runs `static_step` on a CPU against the engine's forward);
  - the cache's positions after the filled ones are zeroed once, so the masked positions hold numbers,
    never the NaN that uninitialised memory can (0 x NaN would be NaN).

The step's tensors are the first cache's own. A later KVCache it is given (`adopt`) is copied into
them and then points at them, so one graph serves every `generate` call of the same batch size and
cache length; a cache it had before, if anything still holds it, gets copies of its own back and goes
on correctly without it.

It runs a GPTModel whose blocks are the book's (plain Linear layers, MultiHeadAttention), in eval
mode, on a CUDA device; `why_not` says why not otherwise, and the engine's forward runs instead.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import PromptError
from ..model import GPTModel, MultiHeadAttention, TransformerBlock
from .cache import KVCache
from .linear import is_plain
from .step import linears


def why_not(model: nn.Module, cache: KVCache) -> str | None:
    """Why a CUDA graph cannot run `model`'s decoding step on `cache` (one line), or None where it can."""
    if not isinstance(model, GPTModel):
        return f"it runs GPTModel only, not {type(model).__name__}"
    if cache.k[0].device.type != "cuda":
        return "it runs on a CUDA device only"
    if model.training and model.cfg.drop_rate > 0:
        return "the model is in training mode (dropout)"
    blocks = model.trf_blocks
    if not all(isinstance(b, TransformerBlock) and isinstance(b.att, MultiHeadAttention) for b in blocks):
        return "its blocks are not the book's TransformerBlock"
    if not all(is_plain(m) for m in linears(model)):
        return "its Linear layers are not all plain nn.Linear (LoRA, int8 and int4 layers are not)"
    if cache.k[0].dtype != model.tok_emb.weight.dtype:
        return "the KV cache's dtype is not the model's"
    return None


class GraphStep:
    """One decoding step over `fast` (the engine's fused twin of a GPTModel) and `cache`, recorded once as a
    CUDA graph (`capture`) or run as PyTorch operations (capture=False: the same step, for a CPU's tests)."""

    def __init__(self, fast: GPTModel, cache: KVCache, capture: bool = True, compiled: bool = False):
        self.fast = fast
        b, max_len = cache.k[0].shape[0], cache.max_len
        device = cache.k[0].device
        self.max_len = max_len
        self.ids = torch.zeros(b, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.positions = torch.arange(max_len, device=device)
        # The first cache's own tensors become the step's (no second copy of a cache that can be gigabytes),
        # their unfilled positions zeroed.
        self.k, self.v = list(cache.k), list(cache.v)
        for t in self.k + self.v:
            t[:, :, cache.pos:].zero_()
        self.anchor = fast.tok_emb.weight.data_ptr()
        self._cache = weakref.ref(cache)
        self.run = torch.compile(self.static_step, fullgraph=True) if compiled else self.static_step
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        if capture:
            self.capture()

    def stale(self) -> bool:
        """Whether the model's weights were replaced since the graph was recorded (it reads them by address)."""
        return self.fast.tok_emb.weight.data_ptr() != self.anchor

    @property
    def cache(self) -> KVCache | None:
        """The cache the step now runs on (held weakly: a finished generate's cache is not kept alive)."""
        return self._cache()

    def adopt(self, cache: KVCache) -> None:
        """Make `cache` (same batch and length) this step's: its filled positions copied into the step's tensors,
        the rest zeroed, and `cache.k`/`cache.v` pointed at them; the cache held before, if still in use, keeps
        a copy."""
        before = self.cache
        if before is cache:
            return
        if before is not None:  # the previous cache goes on with tensors of its own
            before.k = [t.clone() for t in self.k]
            before.v = [t.clone() for t in self.v]
        pos = cache.pos
        for mine, theirs in zip(self.k + self.v, cache.k + cache.v):
            if mine is not theirs:
                mine[:, :, :pos].copy_(theirs[:, :, :pos])
                mine[:, :, pos:].zero_()
        cache.k, cache.v = list(self.k), list(self.v)
        self._cache = weakref.ref(cache)

    def static_step(self) -> torch.Tensor:
        """The engine's one-token forward with every shape fixed: logits `[b, V]` for `self.ids` at `self.pos`."""
        m = self.fast
        x = m.tok_emb(self.ids)[:, None, :] + m.pos_emb(self.pos)  # [b, 1, d]
        visible = (self.positions <= self.pos).view(1, 1, 1, -1)  # [1, 1, 1, max_len]: this token and before
        for i, block in enumerate(m.trf_blocks):
            att, h = block.att, block.norm1(x)
            b, t, d = h.shape
            k, q, v = att.split_heads(att.W_key(h)), att.split_heads(att.W_query(h)), att.split_heads(att.W_value(h))
            self.k[i].index_copy_(2, self.pos, k)
            self.v[i].index_copy_(2, self.pos, v)
            context = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=visible)
            x = x + att.out_proj(context.transpose(1, 2).reshape(b, t, d))
            x = x + block.ff(block.norm2(x))
        return m.out_head(m.final_norm(x))[:, -1]

    def capture(self) -> None:
        """Record the step as a CUDA graph: two warm-up runs on a side stream (cuBLAS's and, compiled, inductor's
        set-up happen there), then the recording. The warm-ups write keys and values at the next position,
        which the first real step overwrites."""
        self.pos.fill_(self.cache.pos)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.run()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids `[b]` at position `cache.pos` -> logits `[b, V]`, in a buffer the next step overwrites."""
        cache = self.cache
        if cache.pos >= self.max_len:  # the engine refills a full cache before it steps
            raise PromptError(f"the KV cache holds {self.max_len:,} positions, all filled")
        self.ids.copy_(ids.reshape(-1))
        self.pos.fill_(cache.pos)
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits
        else:
            logits = self.run()
        cache.advance(1)
        return logits

"""The engine's forward pass: the glass model's modules, with a KV cache and the fast attention.

    Engine(model)(ids, cache, last_only=True) -> logits [b, 1, V]

`Engine` holds a `GPTModel` and calls its own modules (tok_emb, the norms, W_query, ...,
ff, out_head), so it has no weights of its own and int8 layers swapped into the model
(int8.py) run here too. What it adds:
  - a `KVCache`: keys and values of earlier tokens, so a decoding step feeds one token;
  - `attention.attend` in place of the model's attention (the same sums, faster per case);
  - `last_only`: `out_head` on the last position only, the one generation reads;
  - `compile_for_generation`: torch.compile with the options that measured fastest.
tests/test_engine.py proves it equal to `GPTModel.forward`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import GPTConfig
from ..errors import PromptError
from ..model import GPTModel
from .attention import attend
from .int8 import is_quantized


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


class Engine(nn.Module):
    """A GPTModel's forward pass with a KV cache, fast attention and the head on the last position."""

    def __init__(self, model: GPTModel):
        super().__init__()
        self.model = model

    @property
    def cfg(self) -> GPTConfig:
        return self.model.cfg

    def forward(self, in_idx: torch.Tensor, cache: KVCache | None = None, last_only: bool = False) -> torch.Tensor:
        """Token ids `[b, t]` (int64) -> logits `[b, t, V]` (`[b, 1, V]` with `last_only`).

        With a `cache`, `in_idx` holds only the new tokens, placed at positions
        `cache.pos ...`, and the cache advances by t.
        """
        m = self.model
        b, t = in_idx.shape
        start = cache.pos if cache is not None else 0
        if start + t > m.cfg.context_length:
            raise PromptError(f"input is {start + t:,} tokens but context_length is {m.cfg.context_length:,}: "
                              "shorten it (generation keeps only the last context_length tokens)")
        if cache is not None and start + t > cache.max_len:
            raise PromptError(f"the KV cache holds {cache.max_len:,} positions but {start + t:,} are needed: "
                              "make the KVCache with a larger max_len")
        x = m.tok_emb(in_idx)  # [b, t] -> [b, t, d]
        x = m.drop_emb(x + m.pos_emb(torch.arange(start, start + t, device=in_idx.device)))
        for layer, block in enumerate(m.trf_blocks):
            att, h = block.att, block.norm1(x)
            q, k, v = att.split_heads(att.W_query(h)), att.split_heads(att.W_key(h)), att.split_heads(att.W_value(h))
            if cache is not None:
                k, v = cache.update(layer, k, v)  # [b, h, start + t, hd]
            context = attend(q, k, v, att.dropout.p if m.training else 0.0)  # [b, h, t, hd]
            x = x + block.drop_shortcut(att.out_proj(context.transpose(1, 2).reshape(b, t, -1)))
            x = x + block.drop_shortcut(block.ff(block.norm2(x)))
        if cache is not None:
            cache.pos += t
        x = m.final_norm(x)
        if last_only:
            x = x[:, -1:]  # generation reads only the last position: skip a [t, d] x [d, V] matmul
        return m.out_head(x)


def as_engine(model: nn.Module) -> nn.Module:
    """`model` if it is already an Engine (compiled or not), else an Engine over it."""
    return Engine(model) if isinstance(model, GPTModel) else model


def compile_for_generation(model: GPTModel) -> nn.Module:
    """An Engine over `model`, wrapped by torch.compile for `generate`/`stream` (same results).

    The first call compiles twice (the prompt, then the one-token step, whose cache
    position stays symbolic), which takes tens of seconds on a CPU; later steps run
    the fused code. Graphs are made for the first batch size and prompt length; other
    sizes get dynamic-shape graphs, which run slower on a CPU (one size per process is
    the fast case). Every compiled model and batch size adds graphs for the same
    `forward` code, so the recompile limit is raised above dynamo's default of 8, past
    which it would silently fall back to eager.

    The options (measured on the benchmark CPUs, benchmarks/RESULTS.md):
    - no `freezing`: inductor's freezing treats the weights as constants and pre-packs them
      for the CPU's matmul library, which gained nothing measurable in decoding (48.0 against
      48.9 tokens/s for gpt2 in float32), while a later process then redoes most of what
      inductor's on-disk cache otherwise serves: a second `glassgpt generate --compile` took
      16 s to its first token with freezing and 6 s without. For int8 weights (int8.py) it would also constant-fold `weight.float()` into a
      float32 copy, read as 4 bytes per weight instead of 1.
    - int8 weights: a low `realize_opcount_threshold`, so that a LayerNorm's output is
      computed once and stored, not recomputed inside every dot product of the matmul that
      reads it.
    - no guards on the model's modules. Each step would otherwise check every parameter and
      buffer before running (~0.5 ms of an ~8 ms int8 step). The price is that changing the
      model's modules after compiling is not noticed; generation changes nothing, and a
      changed model should be compiled again.
    """
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    options: dict = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe, "freezing": False}
    if is_quantized(model):
        options.update(realize_opcount_threshold=4)
    return torch.compile(Engine(model), options=options)

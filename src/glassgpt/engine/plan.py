"""What every native decoding step shares (step.py's NativeStep and RopeStep, described_step.py's DescribedStep):
a plan of addresses handed to one C++ call a token, kept pointing at the model's tensors and its KV cache.

    PlannedStep          the call, its plan, its buffers and the cache it decodes into
    stamp(model)         what a plan of `model` depends on beyond its cache
    shape_of(cache)      what a plan's buffers depend on in a cache
    rope_turns_whole_heads(att), whole_linears(att, ff)   conditions the RoPE plans share
"""

from __future__ import annotations

import torch
from torch import nn

from .. import anatomy as an
from ..errors import PromptError
from . import native
from .cache import KVCache


def rope_turns_whole_heads(att: an.Attention, pairs: tuple[str, ...] = ("halves",)) -> bool:
    """Whether `att`'s RoPE turns each whole query and key head, its dimensions paired as one of `pairs` says."""
    rope = att.rope
    return rope.pairs in pairs and rope.rotary_dim in (None, att.head_dim) and set(rope.rotates) == {"q", "k"}


def whole_linears(att: an.Attention, ff: an.FeedForward) -> bool:
    """Whether a block's Linears are bias-free modules of their own (not slices of a fused one, not transposed)."""
    return not any(lin.bias or lin.rows is not None or lin.transposed or lin.head_rows is not None
                   for lin in (att.query, att.key, att.value, att.out, ff.gate, ff.up, ff.down))


def batch_of(cache: KVCache) -> int:
    """The batch a cache holds (its first layer with keys: a HybridCache keeps none for its linear layers)."""
    return next((k.shape[0] for k in cache.k if k.dim() == 4), 0)


def stamp(model: nn.Module) -> tuple:
    """What a plan of `model` depends on beyond its cache: each module's class and train/eval mode, and each
    tensor's identity and address (a step keeps the tensors it was planned over alive, so a replaced one
    cannot reuse an old one's identity or memory). A model whose stamp is unchanged needs no new plan."""
    return (tuple((type(m), m.training) for m in model.modules()),
            tuple((id(t), t.data_ptr()) for t in (*model.parameters(), *model.buffers())))


def shape_of(cache: KVCache) -> tuple:
    """What a plan's buffers and scratch depend on in a cache: its layers, batch, length and dtype."""
    return len(cache.k), cache.k[0].shape, cache.k[0].dtype, cache.max_len


class PlannedStep:
    """A decoding step in one native call whose plan holds the addresses of a model's tensors and its cache's
    (NativeStep for GPT-2's plan, RopeStep for RoPE's): `entry` names the library's function, the subclass
    writes `plan`, `buffers` (with "logits"), `ids` and `threads`."""

    entry: str  # the library's function
    anchor: tuple[torch.Tensor, int] | None = None  # a weight of the model, and its address when planned
    header: int
    layer_fields: int  # the plan: `header` entries, then this many per block, the cache's two last

    @staticmethod
    def library():
        """The built kernels holding `entry`, as a ctypes library; None where there are none (`status` says why)."""
        return native.library()

    @staticmethod
    def status() -> str:
        return native.status()

    def addr(self, t: torch.Tensor | None) -> int:
        """The address of `t` for the plan (0 for None), keeping its memory alive as long as the step (an
        alias of the storage: if `t` itself moves, pages.py, the plan still reads what it was given)."""
        if t is None:
            return 0
        self.keep.append(t.detach())
        return t.data_ptr()

    def watch(self, t: torch.Tensor) -> None:
        """Note where one of the model's weights is now (its token embedding): `stale` compares."""
        self.anchor = (t, t.data_ptr())

    def stale(self) -> bool:
        """Whether the model's tensors moved since the plan was written (pages.py): the step still reads
        the old copies, correctly, but the engine plans again so that they can go."""
        return self.anchor is not None and self.anchor[0].data_ptr() != self.anchor[1]

    def point_at(self, cache: KVCache) -> None:
        """Write `cache`'s keys and values into the plan (each block's last two fields) and decode into it from
        now on. The step holds `cache`, not its tensors: the next cache takes its place (`takes`)."""
        slots = self.plan[self.header:].view(len(cache.k), self.layer_fields)[:, -2:]
        slots.copy_(torch.tensor([[k.data_ptr(), v.data_ptr()] for k, v in zip(cache.k, cache.v)], dtype=torch.int64))
        self.cache, self.cache_shape = cache, shape_of(cache)

    def takes(self, cache: KVCache) -> bool:
        """Whether `cache` has the shape the plan was written for (its batch, length, dtype and layers decide the
        buffers and scratch), so that `point_at` can move the step onto it instead of planning again."""
        return (shape_of(cache) == self.cache_shape
                and all(t.is_contiguous() and t.device.type == "cpu" for t in (*cache.k, *cache.v)))

    def greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, list[float]] | None:
        """The greedy pick of each row of `logits` where they are this step's last logits: the ids `[b]` (a
        tensor of their own) and each row's largest logit (NaN where the row holds a NaN), as the step found
        them while the logits were in cache (step.h's greedy_rows, the first largest as torch.max takes it);
        None for other logits."""
        if logits is not self.buffers["logits"]:
            return None
        return self.buffers["best"].clone(), self.buffers["best_value"].tolist()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids `[b]` at position `cache.pos` -> logits `[b, V]` float32, in a buffer the next step overwrites."""
        cache = self.cache
        if cache.pos >= cache.max_len:  # the engine refills a full cache before it steps
            raise PromptError(f"the KV cache holds {cache.max_len:,} positions, all filled")
        self.ids.copy_(ids.reshape(-1))
        getattr(self.lib, self.entry)(self.plan.data_ptr(), self.ids.data_ptr(), cache.pos, self.threads)
        cache.advance(1)
        return self.buffers["logits"]

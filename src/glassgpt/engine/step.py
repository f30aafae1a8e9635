"""The native decoding step: one C++ call per new token runs the whole model (kernels/step.cpp).

    step = native_step(model, cache)      # a NativeStep, or None with the reason in `why_not(model, cache)`
    logits = step(ids)                    # ids [b] int64 at cache.pos -> logits [b, V] float32; cache.pos += 1

The step reads the glass model's own tensors and the KVCache's (their addresses are written
once into a plan; nothing is copied), and writes into buffers made once per NativeStep: a
step allocates nothing. It covers a GPTModel on the CPU in eval mode whose Linear layers are
all plain float32 or all bfloat16 `nn.Linear`s (a fused twin's GemvLinear is one: the same
layer), or all `Int8Linear`s, or all `Int4Linear`s (int8.py, int4.py), for a batch of 1 to
`MAX_BATCH`. Anything else (a LoRA layer, float16, a larger batch, a GPU) returns None, and
the engine runs its PyTorch forward instead.

The residual stream, LayerNorm, attention and GELU run in float32 whatever the weights (the
PyTorch engine rounds them to the weights' dtype at each operation), so bfloat16, int8 and int4
logits differ from the engine's by those roundings; float32 differs by the order of the sums
(tests/test_step.py states each tolerance).
"""

from __future__ import annotations

import operator
import struct

import torch
from torch import nn

from ..errors import PromptError
from ..model import GPTModel
from . import native
from .cache import KVCache
from .int4 import Int4Linear
from .int8 import Int8Linear
from .linear import is_plain

MAX_BATCH = 8
KINDS = {"float32": 0, "bfloat16": 1, "int8": 2, "int4": 3}
# kernels/step.cpp's plan: HEADER entries, then LAYER_FIELDS per block, in its enums' order.
HEADER, LAYER_FIELDS = 32, 24
HEADER_FIELDS = ("kind", "params_bf16", "layers", "d", "heads", "vocab", "max_len", "batch", "group", "tok_emb",
                 "pos_emb", "fn_scale", "fn_shift", "head_w", "head_s", "head_b", "x", "q", "att", "ff", "logits",
                 "scratch", "scratch_bytes", "eps_bits", "profile", "best", "best_value")
# Where one thread's time goes, with `profile()` on (kernels/step.cpp's Phase, in order).
PHASES = ("embedding", "LayerNorm and rounding inputs", "q/k/v products and cache write", "attention",
          "output projection", "feed-forward up + GELU", "feed-forward down", "head", "waiting for the other threads")
LINEARS = ("att.W_query", "att.W_key", "att.W_value", "att.out_proj", "ff.layers.0", "ff.layers.2")


def linears(model: GPTModel) -> list[nn.Module]:
    """Every Linear the step multiplies by: each block's six, then the head."""
    return [layer for block in model.trf_blocks for layer in _SIX(block)] + [model.out_head]


_SIX = operator.attrgetter(*LINEARS)  # a block's six, by the names above (get_submodule, 3x slower, made a step ~1 ms)


def kind_of(model: GPTModel) -> str | None:
    """"float32", "bfloat16", "int8" or "int4" where every Linear is of one kind the step runs; else None."""
    layers = linears(model)
    dtype = model.tok_emb.weight.dtype
    if all(is_plain(m) and m.weight.dtype == dtype for m in layers):
        return {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(dtype)
    if all(type(m) is Int8Linear and m.scales.dtype == dtype for m in layers):
        return "int8"
    if all(type(m) is Int4Linear and m.scales_mins.dtype == dtype for m in layers):
        return "int4" if len({m.group_size for m in layers}) == 1 else None
    return None


def why_not(model: nn.Module, cache: KVCache) -> str | None:
    """Why the native step cannot run `model` on `cache` (one line), or None where it can."""
    if not isinstance(model, GPTModel):
        return f"it runs GPTModel only, not {type(model).__name__}"
    weight = model.tok_emb.weight
    if weight.device.type != "cpu":
        return "it runs on the CPU only"
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return f"it runs float32 and bfloat16 weights, not {weight.dtype}"
    if model.training and model.cfg.drop_rate > 0:
        return "the model is in training mode (dropout)"
    if kind_of(model) is None:
        return "its Linear layers are not all of one kind it runs (float32, bfloat16, int8 or int4)"
    if not all(t.is_contiguous() for t in [*model.parameters(), *model.buffers(), *cache.k, *cache.v]):
        return ("some of its tensors are not contiguous (e.g. transformers' Conv1D weights, which glassgpt reads "
                "in place as transposed views)")
    if not 1 <= cache.k[0].shape[0] <= MAX_BATCH:
        return f"it runs batches of 1 to {MAX_BATCH}, not {cache.k[0].shape[0]}"
    if cache.k[0].dtype != weight.dtype:
        return "the KV cache's dtype is not the model's"
    if len({m.eps for m in model.modules() if hasattr(m, "eps")}) != 1:
        return "its LayerNorms have different eps"
    if native.library() is None:
        return f"glassgpt's kernels are not available: {native.status()}"
    return None


def stamp(model: nn.Module) -> tuple:
    """What a plan of `model` depends on beyond its cache: each module's class and train/eval mode, and each
    tensor's identity and address (a step keeps the tensors it was planned over alive, so a replaced one
    cannot reuse an old one's identity or memory). A model whose stamp is unchanged needs no new plan."""
    return (tuple((type(m), m.training) for m in model.modules()),
            tuple((id(t), t.data_ptr()) for t in (*model.parameters(), *model.buffers())))


def shape_of(cache: KVCache) -> tuple:
    """What a plan's buffers and scratch depend on in a cache: its layers, batch, length and dtype."""
    return len(cache.k), cache.k[0].shape, cache.k[0].dtype, cache.max_len


def native_step(model: nn.Module, cache: KVCache) -> "NativeStep | None":
    """A NativeStep over `model` and `cache`, or None where `why_not` has a reason."""
    return None if why_not(model, cache) is not None else NativeStep(model, cache)


class PlannedStep:
    """A decoding step in one native call whose plan holds the addresses of a model's tensors and its cache's
    (this file's NativeStep for GPT-2, family.py's FamilyStep for Qwen3 and Llama 3): `entry` names the
    library's function, the subclass writes `plan`, `buffers` (with "logits"), `ids` and `threads`."""

    entry = "gg_step"
    anchor: tuple[torch.Tensor, int] | None = None  # a weight of the model, and its address when planned
    layer_fields = LAYER_FIELDS  # the plan: HEADER entries, then this many per block, the cache's two last

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
        slots = self.plan[HEADER:].view(len(cache.k), self.layer_fields)[:, -2:]
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


class NativeStep(PlannedStep):
    """One decoding step in one native call, over `model`'s tensors and `cache`'s (module docstring)."""

    def __init__(self, model: GPTModel, cache: KVCache):
        self.lib = native.library()
        cfg, d = model.cfg, model.cfg.emb_dim
        b, max_len = cache.k[0].shape[0], cache.max_len
        kind = kind_of(model)
        layers = linears(model)
        vocab = model.out_head.out_features
        threads = max(torch.get_num_threads(), 1)
        scratch_bytes = self.lib.gg_step_scratch_bytes(b, d, max_len)
        f32 = dict(dtype=torch.float32)
        self.buffers = {"x": torch.empty(b, d, **f32), "q": torch.empty(b, d, **f32), "att": torch.empty(b, d, **f32),
                        "ff": torch.empty(b, 4 * d, **f32), "logits": torch.empty(b, vocab, **f32),
                        "scratch": torch.empty(threads * scratch_bytes + 64, dtype=torch.uint8),
                        "best": torch.empty(b, dtype=torch.int64), "best_value": torch.empty(b, **f32)}
        self.threads = threads
        self.keep = list(self.buffers.values())  # every tensor whose address is in the plan stays alive
        self.watch(model.tok_emb.weight)
        header = dict(kind=KINDS[kind], params_bf16=int(model.tok_emb.weight.dtype == torch.bfloat16),
                      layers=cfg.n_layers, d=d, heads=cfg.n_heads, vocab=vocab, max_len=max_len, batch=b,
                      group=layers[0].group_size if kind == "int4" else 0,
                      tok_emb=self.addr(model.tok_emb.weight), pos_emb=self.addr(model.pos_emb.weight),
                      fn_scale=self.addr(model.final_norm.scale), fn_shift=self.addr(model.final_norm.shift),
                      scratch_bytes=scratch_bytes,
                      eps_bits=struct.unpack("<i", struct.pack("<f", model.final_norm.eps))[0])
        header.update({name: self.addr(t) for name, t in self.buffers.items()})
        header["scratch"] = (header["scratch"] + 63) // 64 * 64
        head = self.linear(model.out_head)
        header.update(head_w=head[0], head_s=head[1], head_b=head[2])
        header["profile"] = 0
        plan = [header[name] for name in HEADER_FIELDS] + [0] * (HEADER - len(HEADER_FIELDS))
        for i, block in enumerate(model.trf_blocks):
            fields = [self.addr(t) for t in (block.norm1.scale, block.norm1.shift, block.norm2.scale, block.norm2.shift)]
            for layer in layers[6 * i:6 * i + 6]:
                fields += self.linear(layer)
            fields += [0, 0]  # the cache's keys and values: point_at
            plan += fields
        assert len(plan) == HEADER + LAYER_FIELDS * cfg.n_layers
        self.plan = torch.tensor(plan, dtype=torch.int64)
        self.ids = torch.empty(b, dtype=torch.int64)
        self.stamp = stamp(model)
        self.point_at(cache)

    def linear(self, m: nn.Module) -> list[int]:
        """(weight, scales, bias) addresses of one Linear of any kind the step runs."""
        if isinstance(m, Int4Linear):
            return [self.addr(m.packed), self.addr(m.scales_mins), self.addr(m.bias)]
        if isinstance(m, Int8Linear):
            return [self.addr(m.weight), self.addr(m.scales), self.addr(m.bias)]
        return [self.addr(m.weight), 0, self.addr(m.bias)]

    def profile(self) -> torch.Tensor:
        """Seconds per phase (`PHASES`) of the first thread, added up by every later step (benchmarks/decode_profile.py)."""
        self.phases = torch.zeros(len(PHASES), dtype=torch.float64)
        self.plan[HEADER_FIELDS.index("profile")] = self.phases.data_ptr()
        return self.phases

"""Decoding Qwen3 and Llama 3 fast: the native step, or the glass model's forward with glassgpt's gemv kernel.

    steps = family_steps(model)   # prefill(ids, cache), decode_one(ids, cache): generate's seams
    step = family_step(model, cache)  # the native step (kernels/family_step.cpp), or None: why_not says why

At batch 1 each new token multiplies one row by every weight, so a step's time is the time to
read the weights (2.4 GB per token for Qwen3 0.6B in float32). PyTorch's matmul reads them below
the memory's bandwidth on some CPUs; the gemv kernel (linear.py, kernels/gemv.cpp) at it. The
twin is the glass model again, module by module, whose nn.Linears are GemvLinear over the very same
Parameters (nothing copied; RoPE's tables, the config and the hooks shared), each given the kernel where autotune's measurement
on this machine found it faster for that shape (the rest, and every prompt of more than
GEMV_MAX_ROWS tokens, run F.linear as the glass model does). Everything else is the glass model's
own code, so the prompt's logits are the glass model's bit for bit, and each decoded token's within
the kernel's rounding (tests/test_family_adopt.py).

The native step (`FamilyStep`) runs a whole decoding step in one C++ call, as engine/step.py does
for GPT-2: no Python between the 28 blocks of Qwen3 0.6B, whose ~200 small operators per token
otherwise cost as much as reading the weights. It keeps the residual stream, the norms, RoPE,
attention and SwiGLU in float32 whatever the weights, so its float32 logits differ from the glass
model's by the order of the sums and its bfloat16 ones by the glass model's roundings
(tests/test_family_step.py states each tolerance). Which of the two decodes is measured once per
process and shape on this machine (`decode_one`). Leaves out: int8 and int4 family weights.
"""

from __future__ import annotations

import struct
import weakref

import torch
from torch import nn

from . import native
from .autotune import PRECISIONS, STEP_BUDGET_S, STEP_REPEATS, Choices, linear_candidates, machine_key, measure
from .cache import KVCache
from .linear import GemvLinear, is_plain
from .step import MAX_BATCH, PlannedStep


_TWINS: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, FamilySteps]]" = weakref.WeakKeyDictionary()
_WINNERS: dict[tuple, dict[str, str]] = {}


class FamilySteps:
    """`prefill` and `decode_one` (generate.py's seams) on a family model's twin, or its native step."""

    def __init__(self, model: nn.Module, twin: nn.Module):
        self._model = weakref.ref(model)  # weakly: family_steps keeps these per model, and must not keep the model
        self.twin = twin
        self.step: FamilyStep | None = None  # the native step over the last cache decode_one was given

    @property
    def model(self) -> nn.Module:
        return self._model()

    def prefill(self, ids: torch.Tensor, cache) -> torch.Tensor:
        cache.reset()
        return self.twin(ids, cache, last_only=True)[:, -1]

    def decode_one(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """One new token per row, `[b]` at `cache.pos` -> its logits `[b, V]` (the native step's are
        float32, in a buffer the next step overwrites)."""
        step = self.step
        if step is None or step.cache is not cache or step.stale():
            chosen = native_step_chosen(self.model, self.twin)
            if chosen and step is not None and not step.stale() and step.takes(cache):
                step.point_at(cache)  # a cache of the same shape: family_steps planned this model's current tensors
            else:
                self.step = family_step(self.model, cache) if chosen else None
        if self.step is not None:
            return self.step(ids)
        return self.twin(ids[:, None], cache, last_only=True)[:, -1]

    def greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, list[float]] | None:
        """The native step's own greedy pick of `logits` where it made them (step.py's PlannedStep.greedy), else None."""
        return self.step.greedy(logits) if self.step is not None else None


def family_steps(model: nn.Module) -> FamilySteps:
    """The steps of `model`'s twin, made once per model (again if its tensors were replaced)."""
    fingerprint = tuple((p.data_ptr(), p.dtype, p.device) for p in model.parameters())
    found = _TWINS.get(model)
    if found is None or found[0] != fingerprint:
        found = (fingerprint, FamilySteps(model, gemv_twin(model)))
        _TWINS[model] = found
    return found[1]


def gemv_twin(model: nn.Module) -> nn.Module:
    """`model` again, module by module, over the same Parameters (and RoPE tables, config and hooks), with
    each nn.Linear a GemvLinear; nothing is copied or made again."""
    twin = _shallow_copy(model)
    weight = model.tok_emb.weight
    precision = str(weight.dtype).removeprefix("torch.")
    ops = native.load() if weight.device.type == "cpu" and precision in ("float32", "bfloat16") else None
    if ops is not None:
        winners = _winners({(m.out_features, m.in_features) for m in twin.modules() if isinstance(m, GemvLinear)},
                           precision, ops)
        for m in twin.modules():
            if isinstance(m, GemvLinear) and winners.get(f"linear {m.out_features}x{m.in_features}") == "glassgpt":
                m.gemv = ops.gemv
    return twin


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object of `module`'s class (GemvLinear for an nn.Linear) sharing its Parameters,
    buffers and attributes, with its submodules copied the same way."""
    twin = (GemvLinear if type(module) is nn.Linear else type(module)).__new__(
        GemvLinear if type(module) is nn.Linear else type(module))
    twin.__dict__ = module.__dict__.copy()
    twin._parameters = dict(module._parameters)  # the same Parameter objects
    twin._modules = {name: None if child is None else _shallow_copy(child) for name, child in module._modules.items()}
    return twin


def _winners(shapes: set[tuple[int, int]], precision: str, ops) -> dict[str, str]:
    """For each (out, in): "glassgpt" or "torch", whichever multiplied one row faster here (timed once per process)."""
    assert precision in PRECISIONS
    key = (machine_key(), precision, tuple(sorted(shapes)))
    if key not in _WINNERS:
        choices = Choices(key[0], precision)
        with torch.random.fork_rng(devices=[]):  # random inputs: a seeded run draws the same with or without this
            for out, inp in sorted(shapes):
                measure(choices, f"linear {out}x{inp}", linear_candidates((out, inp), precision, ops))
        _WINNERS[key] = choices.winners
    return _WINNERS[key]


def why_not(model: nn.Module, cache: KVCache) -> str | None:
    """Why the native step cannot run `model` on `cache` (one line), or None where it can."""
    cfg = getattr(model, "cfg", None)
    if getattr(cfg, "family", None) not in ("qwen3", "llama3"):
        return f"it runs Qwen3 and Llama 3 models only, not {type(model).__name__}"
    if getattr(cfg, "num_experts", 0):
        return "it runs dense feed-forwards only, not a mixture of experts (the glass MoEFeedForward decodes it)"
    weight = model.tok_emb.weight
    if weight.device.type != "cpu":
        return "it runs on the CPU only"
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return f"it runs float32 and bfloat16 weights, not {weight.dtype}"
    linears = _linears(model)
    if not all(is_plain(m) and m.weight.dtype == weight.dtype and m.bias is None for m in linears):
        return "its Linear layers are not all plain, bias-free and of the embedding's dtype (a LoRA layer, int8 or int4)"
    if cfg.head_dim_value % 2 or cfg.n_heads % cfg.n_kv_groups:
        return "its heads are not pairs of dimensions in whole groups"
    tensors = [*model.parameters(), model.rope.cos, model.rope.sin, *cache.k, *cache.v]
    if not all(t.is_contiguous() for t in tensors) or model.rope.cos.dtype != torch.float32:
        return "some of its tensors are not contiguous"
    if not 1 <= cache.k[0].shape[0] <= MAX_BATCH:
        return f"it runs batches of 1 to {MAX_BATCH}, not {cache.k[0].shape[0]}"
    if cache.k[0].dtype != weight.dtype or cache.k[0].shape[1:] != (cfg.n_kv_groups, cache.max_len, cfg.head_dim_value):
        return "the KV cache is not of the model's dtype and key/value groups"
    if cache.max_len > model.rope.cos.shape[0]:
        return "the KV cache is longer than RoPE's tables"
    if native.library() is None:
        return f"glassgpt's kernels are not available: {native.status()}"
    return None


def family_step(model: nn.Module, cache: KVCache) -> "FamilyStep | None":
    """A FamilyStep over `model` and `cache`, or None where `why_not` has a reason."""
    return None if why_not(model, cache) is not None else FamilyStep(model, cache)


def _linears(model: nn.Module) -> list[nn.Module]:
    """Each block's seven Linears (W_query, W_key, W_value, out_proj, fc1, fc2, fc3), then the head."""
    return [m for block in model.trf_blocks for m in (block.att.W_query, block.att.W_key, block.att.W_value,
                                                      block.att.out_proj, block.ff.fc1, block.ff.fc2, block.ff.fc3)
            ] + [model.out_head]


def _norm_weight(norm: nn.Module) -> torch.Tensor:
    """An RMSNorm's per-dimension weight: `scale` in the book's Qwen3, `weight` in its Llama 3 (torch.nn.RMSNorm's name)."""
    return norm.scale if hasattr(norm, "scale") else norm.weight


# kernels/family_step.cpp's plan: HEADER entries, then LAYER_FIELDS per block, in its enums' order.
HEADER, LAYER_FIELDS = 32, 27
HEADER_FIELDS = ("params_bf16", "layers", "d", "heads", "groups", "head_dim", "hidden", "vocab", "max_len", "batch",
                 "tok_emb", "rope_cos", "rope_sin", "fn_scale", "head_w", "head_s", "head_b", "x", "q", "keys", "att",
                 "ff", "logits", "scratch", "scratch_bytes", "eps_bits", "qk_norm", "best", "best_value")


class FamilyStep(PlannedStep):
    """One decoding step of a Qwen3 or Llama 3 model in one native call, over its tensors and `cache`'s
    (their addresses are written once into a plan; nothing is copied, and a step allocates nothing)."""

    entry = "gg_family_step"
    layer_fields = LAYER_FIELDS

    def __init__(self, model: nn.Module, cache: KVCache):
        self.lib = native.library()
        cfg = model.cfg
        d, hd, f, vocab = cfg.emb_dim, cfg.head_dim_value, cfg.hidden_dim, model.out_head.out_features
        b, max_len = cache.k[0].shape[0], cache.max_len
        dq, dkv = cfg.n_heads * hd, cfg.n_kv_groups * hd
        self.threads = max(torch.get_num_threads(), 1)
        scratch_bytes = self.lib.gg_family_step_scratch_bytes(b, max(d, dq, f), f, max_len)
        f32 = dict(dtype=torch.float32)
        self.buffers = {"x": torch.empty(b, d, **f32), "q": torch.empty(b, dq, **f32), "keys": torch.empty(b, dkv, **f32),
                        "att": torch.empty(b, dq, **f32), "ff": torch.empty(b, f, **f32),
                        "logits": torch.empty(b, vocab, **f32),
                        "scratch": torch.empty(self.threads * scratch_bytes + 64, dtype=torch.uint8),
                        "best": torch.empty(b, dtype=torch.int64), "best_value": torch.empty(b, **f32)}
        self.keep = list(self.buffers.values())  # every tensor whose address is in the plan stays alive
        self.watch(model.tok_emb.weight)
        eps = {m.eps for m in model.modules() if hasattr(m, "eps")}
        assert len(eps) == 1, "every RMSNorm of a family model has the config's eps"
        header = dict(params_bf16=int(model.tok_emb.weight.dtype == torch.bfloat16), layers=cfg.n_layers, d=d,
                      heads=cfg.n_heads, groups=cfg.n_kv_groups, head_dim=hd, hidden=f, vocab=vocab, max_len=max_len,
                      batch=b, tok_emb=self.addr(model.tok_emb.weight), rope_cos=self.addr(model.rope.cos),
                      rope_sin=self.addr(model.rope.sin), fn_scale=self.addr(_norm_weight(model.final_norm)),
                      head_w=self.addr(model.out_head.weight), head_s=0, head_b=0, scratch_bytes=scratch_bytes,
                      eps_bits=struct.unpack("<i", struct.pack("<f", eps.pop()))[0], qk_norm=int(cfg.qk_norm))
        header.update({name: self.addr(t) for name, t in self.buffers.items()})
        header["scratch"] = (header["scratch"] + 63) // 64 * 64
        plan = [header[name] for name in HEADER_FIELDS] + [0] * (HEADER - len(HEADER_FIELDS))
        linears = _linears(model)
        for i, block in enumerate(model.trf_blocks):
            att = block.att
            fields = [self.addr(_norm_weight(block.norm1)), self.addr(_norm_weight(block.norm2)),
                      self.addr(_norm_weight(att.q_norm)) if att.q_norm is not None else 0,
                      self.addr(_norm_weight(att.k_norm)) if att.k_norm is not None else 0]
            for layer in linears[7 * i:7 * i + 7]:
                fields += [self.addr(layer.weight), 0, 0]
            fields += [0, 0]  # the cache's keys and values: point_at
            plan += fields
        assert len(plan) == HEADER + LAYER_FIELDS * cfg.n_layers
        self.plan = torch.tensor(plan, dtype=torch.int64)
        self.ids = torch.empty(b, dtype=torch.int64)
        self.point_at(cache)


_STEP_WINNERS: dict[tuple, str] = {}


def native_step_chosen(model: nn.Module, twin: nn.Module) -> bool:
    """Whether the native step decodes `model` here: it and the twin each decode position 1 of a scratch
    cache, timed once per process, machine, precision and shape (autotune's `measure`), the faster kept."""
    cfg, weight = model.cfg, model.tok_emb.weight
    key = (machine_key(), str(weight.dtype), cfg.to_dict().__repr__())
    if key not in _STEP_WINNERS:
        scratch = KVCache(cfg, 1, 4, dtype=weight.dtype)
        if why_not(model, scratch) is not None:
            return False
        step, token = FamilyStep(model, scratch), torch.zeros(1, dtype=torch.long)

        def at(call):
            def run():
                scratch.pos = 1
                call()
            return run
        choices = Choices(key[0], str(weight.dtype).removeprefix("torch."))
        with torch.inference_mode():
            twin(token[:, None], scratch, last_only=True)  # position 0 filled: each candidate decodes position 1
            measure(choices, "step", {"native": at(lambda: step(token)),
                                      "engine": at(lambda: twin(token[:, None], scratch, last_only=True))},
                    STEP_BUDGET_S, STEP_REPEATS)
        _STEP_WINNERS[key] = choices.winners["step"]
    return _STEP_WINNERS[key] == "native"

"""The native decoding step: one C++ call per new token runs the whole model, for every model it covers.

    step = native_step(model, cache)      # a NativeStep, RopeStep or DescribedStep, or None with the reason in `why_not(model, cache)`
    logits = step(ids)                    # ids [b] int64 at cache.pos -> logits [b, V] float32; cache.pos += 1

Which plan runs is read from the model's description (anatomy.py, `kinds.describe`), never from its
family, and the plan's tensors are found through the description's paths:

    learned positions, pre-LayerNorm blocks of multi-head attention and a tanh-GELU MLP (GPT-2)
        -> NativeStep, kernels/step.cpp
    RoPE, pre-RMSNorm blocks of grouped-query attention (QK-norm or not) and SwiGLU (Qwen3, Llama 3)
        -> RopeStep, kernels/family_step.cpp (AVX-512)
    at batch 1, attention blocks with RMSNorms or LayerNorms before and/or after each sublayer or one before both,
    RoPE or none, a window, a scaled embedding, SwiGLU, GeGLU or SwiGLU experts, a logit scale, gated attention and
    Gated DeltaNet layers (Gemma 3, OLMo 3, Tiny Aya, Qwen3.5, a Qwen3 MoE; Qwen3 and Llama 3 without AVX-512)
        -> DescribedStep, kernels/described_step.cpp (AVX2: described_step.py)

A model described otherwise (per-layer inputs, shared keys, a softcap, ...) gets
one line naming the part that differs, and the engine runs its PyTorch forward instead.

Each step reads the model's own tensors and the KVCache's (their addresses are written once into a
plan; nothing is copied), and writes into buffers made once per step: a step allocates nothing.
NativeStep covers a model on the CPU in eval mode whose Linear layers are all plain float32 or all
bfloat16 `nn.Linear`s (a fused twin's GemvLinear is one: the same layer), or all `Int8Linear`s, or
all `Int4Linear`s (int8.py, int4.py); RopeStep plain, bias-free float32 or bfloat16 ones; both for a
batch of 1 to `MAX_BATCH`. Anything else (a LoRA layer, float16, a larger batch, a GPU) returns None.

The residual stream, the norms, RoPE, attention and the activations run in float32 whatever the
weights (the PyTorch forward rounds them to the weights' dtype at each operation), so bfloat16, int8
and int4 logits differ from the glass model's by those roundings; float32 differs by the order of
the sums (tests/test_step.py and tests/test_family_step.py state each tolerance).
"""

from __future__ import annotations

import operator
import struct

import torch
from torch import nn

from .. import anatomy as an
from ..errors import GlassError
from ..kinds import describe
from . import native
from .cache import KVCache
from .described_step import DescribedStep
from .described_step import differs as differs_from_described
from .int4 import Int4Linear
from .int8 import Int8Linear
from .linear import is_plain
from .plan import PlannedStep, batch_of, rope_turns_whole_heads, shape_of, stamp, whole_linears  # noqa: F401

MAX_BATCH = 8
KINDS = {"float32": 0, "bfloat16": 1, "int8": 2, "int4": 3}
# kernels/step.cpp's plan: HEADER entries, then LAYER_FIELDS per block, in its enums' order.
HEADER, LAYER_FIELDS = 32, 24
HEADER_FIELDS = ("kind", "params_bf16", "layers", "d", "heads", "vocab", "max_len", "batch", "group", "tok_emb",
                 "pos_emb", "fn_scale", "fn_shift", "head_w", "head_s", "head_b", "x", "q", "att", "ff", "logits",
                 "scratch", "scratch_bytes", "eps_bits", "profile", "best", "best_value")
# kernels/family_step.cpp's plan: ROPE_HEADER entries, then ROPE_LAYER_FIELDS per block, in its enums' order.
ROPE_HEADER, ROPE_LAYER_FIELDS = 32, 27
ROPE_HEADER_FIELDS = ("params_bf16", "layers", "d", "heads", "groups", "head_dim", "hidden", "vocab", "max_len",
                      "batch", "tok_emb", "rope_cos", "rope_sin", "fn_scale", "head_w", "head_s", "head_b", "x", "q",
                      "keys", "att", "ff", "logits", "scratch", "scratch_bytes", "eps_bits", "qk_norm", "best",
                      "best_value")
# Where one thread's time goes, with `profile()` on (kernels/step.cpp's Phase, in order).
PHASES = ("embedding", "LayerNorm and rounding inputs", "q/k/v products and cache write", "attention",
          "output projection", "feed-forward up + GELU", "feed-forward down", "head", "waiting for the other threads")
LINEARS = ("att.W_query", "att.W_key", "att.W_value", "att.out_proj", "ff.layers.0", "ff.layers.2")
PLANS = ("learned positions, pre-LayerNorm, multi-head attention and a tanh-GELU MLP (GPT-2's)",
         "RoPE, pre-RMSNorm, grouped-query attention and SwiGLU (Qwen3's and Llama 3's)",
         "and, at batch 1, attention blocks with RoPE or none, norms before, after or around each sublayer, and "
         "SwiGLU, GeGLU or SwiGLU experts, or Gated DeltaNet layers (Gemma 3's, OLMo 3's, Tiny Aya's, Qwen3.5's, a Qwen3 "
         "MoE's)")


def linears(model: nn.Module) -> list[nn.Module]:
    """Every Linear a GPT-2 plan multiplies by, under the glass model's names: each block's six, then the head."""
    return [layer for block in model.trf_blocks for layer in _SIX(block)] + [model.out_head]


_SIX = operator.attrgetter(*LINEARS)  # a block's six, by the names above (get_submodule, 3x slower, made a step ~1 ms)


def kind_of(model: nn.Module) -> str | None:
    """"float32", "bfloat16", "int8" or "int4" where every Linear of a GPT-2 plan is of one kind the step
    runs; else None."""
    return _kind(linears(model), model.tok_emb.weight.dtype)


def _kind(layers: list[nn.Module], dtype: torch.dtype) -> str | None:
    if all(is_plain(m) and m.weight.dtype == dtype for m in layers):
        return {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(dtype)
    if all(type(m) is Int8Linear and m.scales.dtype == dtype for m in layers):
        return "int8"
    if all(type(m) is Int4Linear and m.scales_mins.dtype == dtype for m in layers):
        return "int4" if len({m.group_size for m in layers}) == 1 else None
    return None


# The plan a description asks for.

def plan_of(anatomy: an.Anatomy) -> tuple[type[PlannedStep] | None, str]:
    """(NativeStep or RopeStep, "") for a description one of the plans covers; else (None, the part that differs)."""
    learned = _differs_from_learned(anatomy)
    if learned is None:
        return NativeStep, ""
    rope = _differs_from_rope(anatomy)
    if rope is None and native.library() is not None:  # (the AVX-512 build; else the described step runs it)
        return RopeStep, ""
    described = differs_from_described(anatomy)
    if described is None:
        return DescribedStep, ""
    return None, described if anatomy.positions.kind == "rope" else learned


def _differs_from_learned(a: an.Anatomy) -> str | None:
    """The first part of `a` that kernels/step.cpp does not compute, or None."""
    if a.positions.kind != "learned":
        return f"positions are {a.positions.kind}, not learned"
    if a.embedding.scale is not None or a.embedding.per_layer is not None:
        return "embedding is scaled or has per-layer embeddings"
    for block in a.blocks:
        att, ff = block.attention, block.ff
        if block.placement != "pre" or any(n.kind != "layernorm" or n.bias is None for n in block.norms):
            return f"block {block.index}'s norms are not one LayerNorm before attention and one before the feed-forward"
        if att.kind != "causal" or att.n_kv_groups != att.n_heads or att.rope is not None or att.window is not None:
            return f"block {block.index}'s attention is not multi-head attention over every earlier position"
        if any(x is not None for x in (att.q_norm, att.k_norm, att.scale, att.softcap, att.kv_shared_from,
                                       att.latent, att.output_gate)):
            return f"block {block.index}'s attention has parts GPT-2's has not (a QK-norm, a scale, a cap, a latent)"
        if ff.kind != "gelu_mlp" or ff.activation != "gelu_tanh" or ff.hidden_dim != 4 * a.embedding.emb_dim:
            return f"block {block.index}'s feed-forward is {ff.kind}, not a tanh-GELU MLP of 4 x emb_dim"
    if a.final_norm.kind != "layernorm" or a.head.logit_scale is not None or a.head.softcap is not None:
        return "final norm or head is not GPT-2's"
    return None


def _differs_from_rope(a: an.Anatomy) -> str | None:
    """The first part of `a` that kernels/family_step.cpp does not compute, or None."""
    if a.embedding.scale is not None or a.embedding.per_layer is not None:
        return "embedding is scaled (sqrt(emb_dim)) or has per-layer embeddings"
    for block in a.blocks:
        att, ff = block.attention, block.ff
        if block.placement != "pre" or any(n.kind != "rmsnorm" for n in block.norms):
            return (f"block {block.index}'s norms are {block.placement} {block.norms[0].kind}, not one RMSNorm before "
                    "attention and one before the feed-forward")
        if att.kind != "causal" or att.rope is None or att.window is not None:
            return f"block {block.index}'s attention is not causal attention with RoPE over every earlier position"
        if not rope_turns_whole_heads(att):
            return f"block {block.index}'s RoPE turns part of a head, or pairs neighbours"
        if any(x is not None for x in (att.scale, att.softcap, att.kv_shared_from, att.latent, att.output_gate)):
            return f"block {block.index}'s attention has a scale, a cap, shared keys, a latent or an output gate"
        if (att.q_norm is None) != (att.k_norm is None) or any(
                n is not None and n.kind != "rmsnorm" for n in (att.q_norm, att.k_norm)):
            return f"block {block.index}'s QK-norm is not an RMSNorm of both queries and keys"
        if ff.kind != "swiglu" or ff.activation != "silu":
            return f"block {block.index}'s feed-forward is {ff.kind}, not SwiGLU (a mixture of experts decodes in PyTorch)"
        if not whole_linears(att, ff):
            return f"block {block.index}'s Linear layers have biases or are read as slices of others"
    if a.final_norm.kind != "rmsnorm" or a.head.bias or a.head.logit_scale is not None or a.head.softcap is not None:
        return "final norm is not an RMSNorm, or its head has a bias, a scale or a cap"
    return None


def _described(model: nn.Module) -> an.Anatomy | str:
    """`model`'s description, or why it has none (one line)."""
    try:
        return describe(model)
    except GlassError:
        return f"it runs the models glassgpt describes, not {type(model).__name__}"


def why_not(model: nn.Module, cache: KVCache) -> str | None:
    """Why the native step cannot run `model` on `cache` (one line), or None where one of the plans can."""
    anatomy = _described(model)
    if isinstance(anatomy, str):
        return anatomy
    plan, differs = plan_of(anatomy)
    if plan is None:
        return f"it runs {', '.join(PLANS)}; {anatomy.name}'s {differs}"
    weight = model.get_submodule(anatomy.embedding.path).weight
    if weight.device.type != "cpu":
        return "it runs on the CPU only"
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return f"it runs float32 and bfloat16 weights, not {weight.dtype}"
    if model.training and any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()):
        return "the model is in training mode (dropout)"
    reason = plan.why_not(model, anatomy, cache)
    if reason is not None:
        return reason
    if not 1 <= batch_of(cache) <= MAX_BATCH:
        return f"it runs batches of 1 to {MAX_BATCH}, not {batch_of(cache)}"
    if plan.library() is None:
        return f"glassgpt's kernels are not available: {plan.status()}"
    return None


def native_step(model: nn.Module, cache: KVCache) -> "PlannedStep | None":
    """The step of `model`'s plan over `model` and `cache`, or None where `why_not` has a reason."""
    if why_not(model, cache) is not None:
        return None
    anatomy = describe(model)
    return plan_of(anatomy)[0](model, cache, anatomy)


def _module(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path)


def _norm_weight(model: nn.Module, norm: an.Norm) -> torch.Tensor:
    """A norm's per-dimension weight, by its description's leaf (the book's `scale`, torch's `weight`)."""
    return getattr(_module(model, norm.path), norm.weight)


def _eps_bits(eps: float) -> int:
    return struct.unpack("<i", struct.pack("<f", eps))[0]


class NativeStep(PlannedStep):
    """One decoding step of GPT-2's plan in one native call, over `model`'s tensors and `cache`'s (module docstring)."""

    entry = "gg_step"
    header = HEADER
    layer_fields = LAYER_FIELDS

    @staticmethod
    def why_not(model: nn.Module, anatomy: an.Anatomy, cache: KVCache) -> str | None:
        """What in `model` or `cache` kernels/step.cpp cannot read, beyond its description (why_not)."""
        if [lin.path for lin in anatomy.linears()] != [f"{b.path}.{name}" for b in anatomy.blocks for name in LINEARS]:
            return "its modules are not named as glassgpt's GPTModel names them: adopt it first (glassgpt.adopt)"
        weight = model.tok_emb.weight
        if kind_of(model) is None:
            return "its Linear layers are not all of one kind it runs (float32, bfloat16, int8 or int4)"
        if not all(t.is_contiguous() for t in [*model.parameters(), *model.buffers(), *cache.k, *cache.v]):
            return ("some of its tensors are not contiguous (e.g. transformers' Conv1D weights, which glassgpt reads "
                    "in place as transposed views)")
        if cache.k[0].dtype != weight.dtype:
            return "the KV cache's dtype is not the model's"
        att = anatomy.blocks[0].attention
        if len(cache.k) != anatomy.n_layers or cache.k[0].shape[1:] != (att.n_heads, cache.max_len, att.head_dim):
            return "the KV cache is not of the model's layers and heads"
        if len({m.eps for m in model.modules() if hasattr(m, "eps")}) != 1:
            return "its LayerNorms have different eps"
        return None

    def __init__(self, model: nn.Module, cache: KVCache, anatomy: an.Anatomy | None = None):
        anatomy = anatomy or describe(model)
        self.lib = native.library()
        d, n_layers = anatomy.embedding.emb_dim, anatomy.n_layers
        b, max_len = cache.k[0].shape[0], cache.max_len
        kind = kind_of(model)
        layers = linears(model)
        head_module = _module(model, anatomy.head.path)
        vocab = head_module.out_features
        threads = max(torch.get_num_threads(), 1)
        scratch_bytes = self.lib.gg_step_scratch_bytes(b, d, max_len)
        f32 = dict(dtype=torch.float32)
        self.buffers = {"x": torch.empty(b, d, **f32), "q": torch.empty(b, d, **f32), "att": torch.empty(b, d, **f32),
                        "ff": torch.empty(b, 4 * d, **f32), "logits": torch.empty(b, vocab, **f32),
                        "scratch": torch.empty(threads * scratch_bytes + 64, dtype=torch.uint8),
                        "best": torch.empty(b, dtype=torch.int64), "best_value": torch.empty(b, **f32)}
        self.threads = threads
        self.keep = list(self.buffers.values())  # every tensor whose address is in the plan stays alive
        tok_emb = _module(model, anatomy.embedding.path).weight
        final_norm = _module(model, anatomy.final_norm.path)
        self.watch(tok_emb)
        header = dict(kind=KINDS[kind], params_bf16=int(tok_emb.dtype == torch.bfloat16),
                      layers=n_layers, d=d, heads=anatomy.blocks[0].attention.n_heads, vocab=vocab, max_len=max_len,
                      batch=b, group=layers[0].group_size if kind == "int4" else 0,
                      tok_emb=self.addr(tok_emb), pos_emb=self.addr(_module(model, anatomy.positions.path).weight),
                      fn_scale=self.addr(_norm_weight(model, anatomy.final_norm)),
                      fn_shift=self.addr(getattr(final_norm, anatomy.final_norm.bias)),
                      scratch_bytes=scratch_bytes, eps_bits=_eps_bits(final_norm.eps))
        header.update({name: self.addr(t) for name, t in self.buffers.items()})
        header["scratch"] = (header["scratch"] + 63) // 64 * 64
        head = self.linear(head_module)
        header.update(head_w=head[0], head_s=head[1], head_b=head[2])
        header["profile"] = 0
        plan = [header[name] for name in HEADER_FIELDS] + [0] * (HEADER - len(HEADER_FIELDS))
        for i, block in enumerate(anatomy.blocks):
            norm1, norm2 = block.norm("attn_in"), block.norm("ff_in")
            fields = [self.addr(t) for t in (_norm_weight(model, norm1), getattr(_module(model, norm1.path), norm1.bias),
                                             _norm_weight(model, norm2), getattr(_module(model, norm2.path), norm2.bias))]
            for layer in layers[6 * i:6 * i + 6]:
                fields += self.linear(layer)
            fields += [0, 0]  # the cache's keys and values: point_at
            plan += fields
        assert len(plan) == HEADER + LAYER_FIELDS * n_layers
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


def _rope_linears(model: nn.Module, block: an.Block) -> list[nn.Module]:
    """A block's seven Linears in family_step.cpp's order: query, key, value, out, gate (fc1), up (fc2), down (fc3)."""
    att, ff = block.attention, block.ff
    return [_module(model, lin.path) for lin in (att.query, att.key, att.value, att.out, ff.gate, ff.up, ff.down)]


class RopeStep(PlannedStep):
    """One decoding step of RoPE's plan (Qwen3, Llama 3) in one native call, over the model's tensors and
    `cache`'s (their addresses are written once into a plan; nothing is copied, and a step allocates nothing).
    RoPE's angles are the model's own tables (`model.rope.cos`, `.sin`: float32 `[context_length, hd]`)."""

    entry = "gg_family_step"
    header = ROPE_HEADER
    layer_fields = ROPE_LAYER_FIELDS

    @staticmethod
    def why_not(model: nn.Module, anatomy: an.Anatomy, cache: KVCache) -> str | None:
        """What in `model` or `cache` kernels/family_step.cpp cannot read, beyond its description (why_not)."""
        weight = _module(model, anatomy.embedding.path).weight
        layers = [m for block in anatomy.blocks for m in _rope_linears(model, block)] + \
            [_module(model, anatomy.head.path)]
        if not all(is_plain(m) and m.weight.dtype == weight.dtype and m.bias is None for m in layers):
            return "its Linear layers are not all plain, bias-free and of the embedding's dtype (a LoRA layer, int8 or int4)"
        att = anatomy.blocks[0].attention
        h, g, hd = att.n_heads, att.n_kv_groups, att.head_dim
        if any((b.attention.n_heads, b.attention.n_kv_groups, b.attention.head_dim, b.ff.hidden_dim)
               != (h, g, hd, anatomy.blocks[0].ff.hidden_dim) for b in anatomy.blocks):
            return "its blocks are not all of one shape"
        if hd % 2 or h % g:
            return "its heads are not pairs of dimensions in whole groups"
        rope = getattr(model, "rope", None)
        if rope is None or not isinstance(getattr(rope, "cos", None), torch.Tensor):
            return "it keeps no RoPE tables of its own (`model.rope.cos`, `.sin`)"
        tensors = [*model.parameters(), rope.cos, rope.sin, *cache.k, *cache.v]
        if not all(t.is_contiguous() for t in tensors) or rope.cos.dtype != torch.float32:
            return "some of its tensors are not contiguous"
        if cache.k[0].dtype != weight.dtype or cache.k[0].shape[1:] != (g, cache.max_len, hd):
            return "the KV cache is not of the model's dtype and key/value groups"
        if cache.max_len > rope.cos.shape[0]:
            return "the KV cache is longer than RoPE's tables"
        if len({n.eps for n in anatomy.norms()}) != 1:
            return "its RMSNorms have different eps"
        return None

    def __init__(self, model: nn.Module, cache: KVCache, anatomy: an.Anatomy | None = None):
        anatomy = anatomy or describe(model)
        self.lib = native.library()
        first = anatomy.blocks[0]
        d, hd, f = anatomy.embedding.emb_dim, first.attention.head_dim, first.ff.hidden_dim
        h, g = first.attention.n_heads, first.attention.n_kv_groups
        tok_emb, head = _module(model, anatomy.embedding.path).weight, _module(model, anatomy.head.path)
        vocab = head.out_features
        b, max_len = cache.k[0].shape[0], cache.max_len
        dq, dkv = h * hd, g * hd
        self.threads = max(torch.get_num_threads(), 1)
        scratch_bytes = self.lib.gg_family_step_scratch_bytes(b, max(d, dq, f), f, max_len)
        f32 = dict(dtype=torch.float32)
        self.buffers = {"x": torch.empty(b, d, **f32), "q": torch.empty(b, dq, **f32), "keys": torch.empty(b, dkv, **f32),
                        "att": torch.empty(b, dq, **f32), "ff": torch.empty(b, f, **f32),
                        "logits": torch.empty(b, vocab, **f32),
                        "scratch": torch.empty(self.threads * scratch_bytes + 64, dtype=torch.uint8),
                        "best": torch.empty(b, dtype=torch.int64), "best_value": torch.empty(b, **f32)}
        self.keep = list(self.buffers.values())  # every tensor whose address is in the plan stays alive
        self.watch(tok_emb)
        eps = {n.eps for n in anatomy.norms()}
        assert len(eps) == 1, "every RMSNorm of the model has the config's eps (RopeStep.why_not)"
        header = dict(params_bf16=int(tok_emb.dtype == torch.bfloat16), layers=anatomy.n_layers, d=d,
                      heads=h, groups=g, head_dim=hd, hidden=f, vocab=vocab, max_len=max_len,
                      batch=b, tok_emb=self.addr(tok_emb), rope_cos=self.addr(model.rope.cos),
                      rope_sin=self.addr(model.rope.sin), fn_scale=self.addr(_norm_weight(model, anatomy.final_norm)),
                      head_w=self.addr(head.weight), head_s=0, head_b=0, scratch_bytes=scratch_bytes,
                      eps_bits=_eps_bits(eps.pop()), qk_norm=int(first.attention.q_norm is not None))
        header.update({name: self.addr(t) for name, t in self.buffers.items()})
        header["scratch"] = (header["scratch"] + 63) // 64 * 64
        plan = [header[name] for name in ROPE_HEADER_FIELDS] + [0] * (ROPE_HEADER - len(ROPE_HEADER_FIELDS))
        for block in anatomy.blocks:
            att = block.attention
            fields = [self.addr(_norm_weight(model, block.norm("attn_in"))),
                      self.addr(_norm_weight(model, block.norm("ff_in"))),
                      self.addr(_norm_weight(model, att.q_norm)) if att.q_norm is not None else 0,
                      self.addr(_norm_weight(model, att.k_norm)) if att.k_norm is not None else 0]
            for layer in _rope_linears(model, block):
                fields += [self.addr(layer.weight), 0, 0]
            fields += [0, 0]  # the cache's keys and values: point_at
            plan += fields
        assert len(plan) == ROPE_HEADER + ROPE_LAYER_FIELDS * anatomy.n_layers
        self.plan = torch.tensor(plan, dtype=torch.int64)
        self.ids = torch.empty(b, dtype=torch.int64)
        self.stamp = stamp(model)
        self.point_at(cache)



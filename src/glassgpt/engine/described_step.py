"""The described step: one C++ call per new token for every model its description lays out as RoPE attention
blocks, on any CPU with AVX2 and FMA (kernels/described_step.cpp).

    differs(anatomy)                -> None where the plan computes every part of the description, else the first part
    DescribedStep(model, cache)     a PlannedStep (step.py): step(ids [1]) -> logits [1, V] float32; cache.pos += 1

What it covers, read off the description alone (anatomy.py): RMSNorms (w or 1 + w) before and/or after each
sublayer (pre, post, sandwich), grouped-query attention with RoPE over the whole head (the model's own tables,
one pair a layer: Gemma 3's sliding and full bases), QK-norm per head or over the whole projection (OLMo 3), a
sliding window kept in the KV cache's ring, a scale of the scores, an embedding scaled by a number, SwiGLU,
GeGLU, or a mixture of SwiGLU experts (top k by the router's scores, a softmax over those k). So Qwen3, Llama
3, Gemma 3, OLMo 3 and a Qwen3 MoE each decode with it; Tiny Aya's parallel block, Qwen3.5's linear layers,
Gemma 4's per-layer inputs and a softcap are refused by `differs`, which names the part, and the twin runs them.

Why: at batch 1 a token's time is reading the weights, and the twin reads them at the memory's rate (the gemv
kernel), but runs ~130 small PyTorch operators a block around them (norms, RoPE, the cache's writes, masks):
~10 ms a token for Gemma 3 270M, a fifth of its step. Here they are a few microseconds each, in one call.

The residual stream, norms, RoPE, attention and activations are float32 whatever the weights (the glass model
rounds each to bfloat16 in a bfloat16 model), so its bfloat16 logits differ from the glass model's by those
roundings; float32 logits by the order of the sums (tests/test_described_step.py states each tolerance).
Batch 1 only: a larger batch decodes in the twin.
"""

from __future__ import annotations

import struct

import torch
from torch import nn

from .. import anatomy as an
from . import native
from .linear import is_plain
from .plan import PlannedStep, rope_turns_whole_heads, stamp, whole_linears

# kernels/described_step.cpp's plan: HEADER entries, then LAYER_FIELDS per block, in its enums' order.
HEADER = 32
HEADER_FIELDS = ("bf16", "layers", "d", "vocab", "tok_emb", "emb_scale", "final_norm", "final_plus_one", "eps",
                 "head", "x", "h", "q", "k", "v", "att", "gate", "up", "out", "logits", "pairs", "scores", "router",
                 "best", "best_value", "max_len")
LAYER_FIELD_NAMES = ("heads", "groups", "head_dim", "hidden", "slots", "ring", "scale", "plus_one", "qk_whole",
                     "rope_cos", "rope_sin", "attn_in", "attn_out", "ff_in", "ff_out", "q_norm", "k_norm", "wq", "wk",
                     "wv", "wo", "fc1", "fc2", "fc3", "act", "router", "experts", "top_k", "expert_w", "kcache", "vcache")
LAYER_FIELDS = len(LAYER_FIELD_NAMES)
NORM_BITS = ("attn_in", "attn_out", "ff_in", "ff_out", "q_norm", "k_norm")  # the plan's plus_one bits, in order
ACTS = {"silu": 0, "gelu_tanh": 1}
MAX_TOP_K = 64


def differs(a: an.Anatomy) -> str | None:
    """The first part of `a` that kernels/described_step.cpp does not compute, or None."""
    if a.positions.kind != "rope":
        return f"its positions are {a.positions.kind}, not RoPE"
    if a.embedding.per_layer is not None:
        return "it has per-layer embeddings"
    for block in a.blocks:
        att, ff, i = block.attention, block.ff, block.index
        if block.placement not in ("pre", "post", "sandwich"):
            return f"block {i}'s norms are {block.placement}, not before and/or after each sublayer"
        if block.per_layer_input is not None or block.output_scale is not None:
            return f"block {i} has a per-layer input or a scale of its output"
        if any(n.kind not in ("rmsnorm", "rmsnorm_plus_one") or n.weight is None for n in block.norms):
            return f"block {i}'s norms are not RMSNorms with a weight"
        if att.kind != "causal" or att.rope is None:
            return f"block {i}'s attention is not causal attention with RoPE"
        if not rope_turns_whole_heads(att):
            return f"block {i}'s RoPE turns part of a head, or pairs neighbours"
        if any(x is not None for x in (att.softcap, att.kv_shared_from, att.latent, att.output_gate, att.v_norm)):
            return f"block {i}'s attention has a cap, shared keys, a latent, an output gate or a value norm"
        if (att.q_norm is None) != (att.k_norm is None) or any(
                n is not None and (n.kind not in ("rmsnorm", "rmsnorm_plus_one") or n.weight is None)
                for n in (att.q_norm, att.k_norm)):
            return f"block {i}'s QK-norm is not an RMSNorm with a weight on both queries and keys"
        if att.head_dim % 2 or att.n_heads % att.n_kv_groups:
            return f"block {i}'s heads are not pairs of dimensions in whole groups"
        if ff.kind not in ("swiglu", "geglu", "moe") or ff.activation not in ACTS or ff.gate is None:
            return f"block {i}'s feed-forward is {ff.kind} ({ff.activation}), not SwiGLU, GeGLU or SwiGLU experts"
        if ff.kind == "moe" and (ff.experts is None or ff.experts.per_token > MAX_TOP_K or ff.experts.router.bias):
            return f"block {i}'s experts are not {MAX_TOP_K} or fewer a token from a bias-free router"
        if not whole_linears(att, ff):
            return f"block {i}'s Linear layers have biases or are read as slices of others"
    if a.final_norm.kind not in ("rmsnorm", "rmsnorm_plus_one") or a.final_norm.weight is None:
        return "its final norm is not an RMSNorm with a weight"
    if a.head.bias or a.head.logit_scale is not None or a.head.softcap is not None:
        return "its head has a bias, a logit scale or a cap"
    return None


def rope_tables(model: nn.Module, block: an.Block):
    """The RoPE tables block `block` reads in the glass model (`rope_of(i)`, a table per layer type, or one), or None."""
    if hasattr(model, "rope_of"):
        return model.rope_of(block.index)
    rope = getattr(model, "rope", None)
    return rope.get(block.layer_type) if isinstance(rope, dict) else rope


def _double_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _module(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path)


def _norm_weight(model: nn.Module, norm: an.Norm | None) -> torch.Tensor | None:
    return None if norm is None else getattr(_module(model, norm.path), norm.weight)


def _eps(model: nn.Module, anatomy: an.Anatomy) -> set[float]:
    """Every norm's eps as its module holds it (the description's is the config's)."""
    held = [getattr(_module(model, n.path), "eps", None) for n in anatomy.norms()]
    return {n.eps if eps is None else float(eps) for n, eps in zip(anatomy.norms(), held)}


def _expert_linears(model: nn.Module, ff: an.FeedForward) -> list[list[nn.Module]]:
    """Each expert's (gate, up, down) modules: expert 0's paths with their last index 0 as j (anatomy.Experts)."""
    return [[_module(model, an.expert_path(lin.path, j)) for lin in (ff.gate, ff.up, ff.down)]
            for j in range(ff.experts.n_experts)]



class DescribedStep(PlannedStep):
    """One decoding step of a described RoPE model in one native call (module docstring), over the model's tensors
    and `cache`'s: their addresses are written once into a plan; nothing is copied, and a step allocates nothing."""

    entry = "gg_described_step"
    header = HEADER
    layer_fields = LAYER_FIELDS
    @staticmethod
    def library():
        """Either build (described_step.cpp is written for AVX2, and both hold it), or None."""
        return native.described_library()

    @staticmethod
    def status() -> str:
        return native.gemv_status()

    @staticmethod
    def why_not(model: nn.Module, anatomy: an.Anatomy, cache) -> str | None:
        """What in `model` or `cache` kernels/described_step.cpp cannot read, beyond its description (step.why_not)."""
        weight = _module(model, anatomy.embedding.path).weight
        if cache.k[0].shape[0] != 1:
            return f"it runs a batch of 1, not {cache.k[0].shape[0]}"
        layers = [_module(model, anatomy.head.path)]
        for block in anatomy.blocks:
            att, ff = block.attention, block.ff
            layers += [_module(model, lin.path) for lin in (att.query, att.key, att.value, att.out)]
            if ff.kind == "moe":
                layers += [_module(model, ff.experts.router.path)] + sum(_expert_linears(model, ff), [])
            else:
                layers += [_module(model, lin.path) for lin in (ff.gate, ff.up, ff.down)]
        if not all(is_plain(m) and m.weight.dtype == weight.dtype and m.bias is None for m in layers):
            return "its Linear layers are not all plain, bias-free and of the embedding's dtype (a LoRA layer, int8 or int4)"
        norms = [_norm_weight(model, n) for n in anatomy.norms()]
        if any(w is None or w.dtype != weight.dtype for w in norms):
            return "its norms' weights are not of the embedding's dtype"
        if len(_eps(model, anatomy)) != 1:
            return "its RMSNorms have different eps"
        tables = [rope_tables(model, block) for block in anatomy.blocks]
        if any(not isinstance(getattr(t, "cos", None), torch.Tensor) for t in tables):
            return "it keeps no RoPE tables of its own (`model.rope`, or `model.rope_of(i)`)"
        if len(cache.k) != anatomy.n_layers:
            return "the KV cache is not of the model's layers"
        for block, t, k in zip(anatomy.blocks, tables, cache.k):
            att = block.attention
            if t.cos.dtype != torch.float32 or t.cos.shape != t.sin.shape or t.cos.shape[1] != att.head_dim:
                return "its RoPE tables are not float32 rows of a whole head"
            if cache.max_len > t.cos.shape[0]:
                return "the KV cache is longer than RoPE's tables"
            slots = cache.max_len if att.window is None else min(att.window, cache.max_len)
            if k.dtype != weight.dtype or k.shape != (1, att.n_kv_groups, slots, att.head_dim):
                return f"the KV cache of block {block.index} is not of the model's dtype, key/value groups and window"
        tensors = [*model.parameters(), *(t for tab in tables for t in (tab.cos, tab.sin)), *cache.k, *cache.v]
        if not all(t.is_contiguous() and t.device.type == "cpu" for t in tensors):
            return "some of its tensors are not contiguous"
        return None

    def __init__(self, model: nn.Module, cache, anatomy: an.Anatomy | None = None):
        from ..kinds import describe
        anatomy = anatomy or describe(model)
        self.lib = native.described_library()
        blocks = anatomy.blocks
        d = anatomy.embedding.emb_dim
        tok_emb, head = _module(model, anatomy.embedding.path).weight, _module(model, anatomy.head.path)
        vocab, max_len = head.out_features, cache.max_len
        widest_q = max(b.attention.n_heads * b.attention.head_dim for b in blocks)
        widest_kv = max(b.attention.n_kv_groups * b.attention.head_dim for b in blocks)
        widest_ff = max(b.ff.hidden_dim for b in blocks)
        experts = max((b.ff.experts.n_experts for b in blocks if b.ff.kind == "moe"), default=0)
        self.threads = max(torch.get_num_threads(), 1)
        f32 = dict(dtype=torch.float32)
        self.buffers = {"x": torch.empty(d, **f32), "h": torch.empty(max(d, widest_q), **f32),
                        "q": torch.empty(widest_q, **f32), "k": torch.empty(widest_kv, **f32),
                        "v": torch.empty(widest_kv, **f32), "att": torch.empty(widest_q, **f32),
                        "gate": torch.empty(widest_ff, **f32), "up": torch.empty(widest_ff, **f32),
                        "out": torch.empty(d, **f32), "logits": torch.empty(1, vocab, **f32),
                        "pairs": torch.empty(d + max(d, widest_q, widest_ff), **f32),
                        "scores": torch.empty(self.threads * max_len, **f32), "router": torch.empty(experts + d, **f32),
                        "best": torch.empty(1, dtype=torch.int64), "best_value": torch.empty(1, **f32)}
        self.keep = list(self.buffers.values())  # every tensor whose address is in the plan stays alive
        self.watch(tok_emb)
        final = anatomy.final_norm
        header = dict(bf16=int(tok_emb.dtype == torch.bfloat16), layers=anatomy.n_layers, d=d, vocab=vocab,
                      tok_emb=self.addr(tok_emb), emb_scale=_double_bits(anatomy.embedding.scale or 0.0),
                      final_norm=self.addr(_norm_weight(model, final)), final_plus_one=int(final.kind == "rmsnorm_plus_one"),
                      eps=_double_bits(_eps(model, anatomy).pop()), head=self.addr(head.weight), max_len=max_len)
        header.update({name: self.addr(t) for name, t in self.buffers.items()})
        plan = [header[name] for name in HEADER_FIELDS] + [0] * (HEADER - len(HEADER_FIELDS))
        for block in blocks:
            att, ff = block.attention, block.ff
            tables = rope_tables(model, block)
            norms = {role: block.norm(role) for role in ("attn_in", "attn_out", "ff_in", "ff_out")}
            norms.update(q_norm=att.q_norm, k_norm=att.k_norm)
            fields = dict(heads=att.n_heads, groups=att.n_kv_groups, head_dim=att.head_dim,
                          hidden=ff.hidden_dim, slots=max_len if att.window is None else min(att.window, max_len),
                          ring=int(att.window is not None), scale=_double_bits(att.scale or att.head_dim ** -0.5),
                          plus_one=sum(1 << i for i, role in enumerate(NORM_BITS)
                                       if norms[role] is not None and norms[role].kind == "rmsnorm_plus_one"),
                          qk_whole=int(att.q_norm is not None and att.q_norm.dim != att.head_dim),
                          rope_cos=self.addr(tables.cos), rope_sin=self.addr(tables.sin),
                          wq=self.linear(att.query, model), wk=self.linear(att.key, model),
                          wv=self.linear(att.value, model), wo=self.linear(att.out, model), act=ACTS[ff.activation],
                          kcache=0, vcache=0)  # the cache's keys and values: point_at
            fields.update({role: self.addr(_norm_weight(model, n)) for role, n in norms.items()})
            if ff.kind == "moe":
                table = torch.tensor([m.weight.data_ptr() for trio in _expert_linears(model, ff) for m in trio],
                                     dtype=torch.int64)
                self.keep += [m.weight.detach() for trio in _expert_linears(model, ff) for m in trio]
                fields.update(router=self.linear(ff.experts.router, model), experts=ff.experts.n_experts,
                              top_k=ff.experts.per_token, expert_w=self.addr(table), fc1=0, fc2=0, fc3=0)
            else:
                fields.update(fc1=self.linear(ff.gate, model), fc2=self.linear(ff.up, model),
                              fc3=self.linear(ff.down, model), router=0, experts=0, top_k=0, expert_w=0)
            plan += [fields[name] for name in LAYER_FIELD_NAMES]
        assert len(plan) == HEADER + LAYER_FIELDS * anatomy.n_layers
        self.plan = torch.tensor(plan, dtype=torch.int64)
        self.ids = torch.empty(1, dtype=torch.int64)
        self.stamp = stamp(model)
        self.point_at(cache)

    def linear(self, lin: an.Linear, model: nn.Module) -> int:
        return self.addr(_module(model, lin.path).weight)

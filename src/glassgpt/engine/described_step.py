"""The described step: one C++ call per new token for every model its description lays out as attention blocks,
on any CPU with AVX2 and FMA (kernels/described_step.cpp).

    differs(anatomy)                -> None where the plan computes every part of the description, else the first part
    DescribedStep(model, cache)     a PlannedStep (plan.py): step(ids [1]) -> logits [1, V] float32; cache.pos += 1

What it covers, read off the description alone (anatomy.py): RMSNorms (w or 1 + w) or shift-free LayerNorms before
and/or after each sublayer (pre, post, sandwich) or one before both (parallel: Tiny Aya); grouped-query attention
with RoPE over the whole head, its dimensions paired as halves or neighbours (the model's own tables, one pair a
layer: Gemma 3's sliding and full bases), or without positions (Tiny Aya's full layers); QK-norm per head or over
the whole projection (OLMo 3); a sliding window kept in the KV cache's ring; a scale of the scores; an embedding
scaled by a number; SwiGLU, GeGLU, or a mixture of SwiGLU experts (top k by the router's scores, a softmax over
those k); a scale of the logits; and Qwen3.5's hybrid stack: its gated full attention (each head's gate rows in
W_query, RoPE on the first quarter of each head) and its linear layers (Gated DeltaNet: the short convolution and
the gated delta rule on a float32 state, both kept in tensors of the step's own that it hands the HybridCache).
So Qwen3, Llama 3, Gemma 3, OLMo 3, Tiny Aya, Qwen3.5 and a Qwen3 MoE each decode with it; Gemma 4's per-layer
inputs and shared keys, and a softcap, are refused by `differs`, which names the part, and the twin runs them.

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
from dataclasses import replace

import torch
from torch import nn

from .. import anatomy as an
from . import native
from .linear import is_plain
from .plan import PlannedStep, batch_of, rope_turns_whole_heads, stamp, whole_linears

# kernels/described_step.cpp's plan: HEADER entries, then LAYER_FIELDS per block, in its enums' order.
HEADER = 32
HEADER_FIELDS = ("bf16", "layers", "d", "vocab", "tok_emb", "emb_scale", "final_norm", "final_kind", "eps",
                 "head", "x", "h", "q", "k", "v", "att", "gate", "up", "out", "logits", "pairs", "scores", "router",
                 "best", "best_value", "max_len", "logit_scale", "resid", "linear_scratch")
LAYER_FIELD_NAMES = ("heads", "groups", "head_dim", "hidden", "slots", "ring", "scale", "norm_kinds", "qk_whole",
                     "rope_cos", "rope_sin", "attn_in", "attn_out", "ff_in", "ff_out", "q_norm", "k_norm", "wq", "wk",
                     "wv", "wo", "fc1", "fc2", "fc3", "act", "router", "experts", "top_k", "expert_w", "neighbours",
                     "parallel", "rotary", "gated", "linear", "in_qkv", "in_z", "in_b", "in_a", "conv_w", "a_log",
                     "dt_bias", "gated_norm", "key_heads", "value_heads", "key_dim", "value_dim", "conv_kernel", "conv",
                     "state", "kcache", "vcache")
LAYER_FIELDS = len(LAYER_FIELD_NAMES)
NORM_ROLES = ("attn_in", "attn_out", "ff_in", "ff_out", "q_norm", "k_norm")  # the plan's norm_kinds, 2 bits each
NORM_KINDS = {"rmsnorm": 0, "rmsnorm_plus_one": 1, "layernorm": 2}
ACTS = {"silu": 0, "gelu_tanh": 1}
MAX_TOP_K = 64
MAX_VALUE_DIM = 512  # a linear layer's value head width (kernels/described_step.cpp's stack buffer)


def differs(a: an.Anatomy) -> str | None:
    """The first part of `a` that kernels/described_step.cpp does not compute, or None."""
    if a.positions.kind != "rope":
        return f"positions are {a.positions.kind}, not RoPE"
    if a.embedding.per_layer is not None:
        return "embedding has per-layer embeddings"
    for block in a.blocks:
        att, ff, i = block.attention, block.ff, block.index
        if block.placement == "parallel" and [n.role for n in block.norms] != ["attn_in"]:
            return f"block {i} is parallel with norms other than one before both sublayers"
        if block.per_layer_input is not None or block.output_scale is not None:
            return f"block {i} has a per-layer input or a scale of its output"
        if any(not _norm_runs(n) for n in block.norms):
            return f"block {i}'s norms are not RMSNorms or shift-free LayerNorms with a weight"
        if att.kind == "linear":
            why = _linear_differs(att)
            if why:
                return f"block {i}'s linear attention {why}"
        elif att.kind != "causal":
            return f"block {i}'s attention is not causal attention"
        if att.rope is not None and not _rope_runs(att):
            return f"block {i}'s RoPE turns an odd part of a head, or pairs neighbours in part of one"
        if any(x is not None for x in (att.softcap, att.kv_shared_from, att.latent, att.v_norm)):
            return f"block {i}'s attention has a cap, shared keys, a latent or a value norm"
        if att.output_gate is not None and not _gate_in_query(att):
            return f"block {i}'s output gate is not the second half of each head's rows of W_query"
        if (att.q_norm is None) != (att.k_norm is None) or any(
                n is not None and not _norm_runs(n) for n in (att.q_norm, att.k_norm)):
            return f"block {i}'s QK-norm is not a norm with a weight on both queries and keys"
        if att.head_dim % 2 or att.n_heads % att.n_kv_groups:
            return f"block {i}'s heads are not pairs of dimensions in whole groups"
        if ff.kind not in ("swiglu", "geglu", "moe") or ff.activation not in ACTS or ff.gate is None:
            return f"block {i}'s feed-forward is {ff.kind} ({ff.activation}), not SwiGLU, GeGLU or SwiGLU experts"
        if ff.kind == "moe" and (ff.experts is None or ff.experts.per_token > MAX_TOP_K or ff.experts.router.bias):
            return f"block {i}'s experts are not {MAX_TOP_K} or fewer a token from a bias-free router"
        if att.kind != "linear" and not whole_linears(replace(att, query=replace(att.query, head_rows=None)), ff):
            return f"block {i}'s Linear layers have biases or are read as slices of others"
    if not _norm_runs(a.final_norm):
        return "final norm is not an RMSNorm or a shift-free LayerNorm with a weight"
    if a.head.bias or a.head.softcap is not None:
        return "head has a bias or a cap"
    return None


def _rope_runs(att: an.Attention) -> bool:
    """Whole heads in halves or neighbours, or (Qwen3.5) an even first part of each head in halves."""
    rope = att.rope
    if rope.rotary_dim not in (None, att.head_dim):
        return rope.pairs == "halves" and rope.rotary_dim % 2 == 0 and set(rope.rotates) == {"q", "k"}
    return rope_turns_whole_heads(att, pairs=("halves", "neighbours"))


def _gate_in_query(att: an.Attention) -> bool:
    """Qwen3.5's gated attention: W_query's rows hold, per head, hd query rows then hd gate rows."""
    hd, gate, query = att.head_dim, att.output_gate, att.query
    return (gate.path == query.path and query.head_rows == (2 * hd, 0, hd) and gate.head_rows == (2 * hd, hd, 2 * hd)
            and not query.bias and query.rows is None and not query.transposed)


def _linear_differs(att: an.Attention) -> str | None:
    """What of a linear layer the step does not compute (Qwen3.5's Gated DeltaNet), or None."""
    st = att.state
    if st is None or st.rule != "gated_delta":
        return "is not a gated delta rule"
    if st.value_heads % att.n_heads or st.value_head_dim > MAX_VALUE_DIM or st.norm.kind != "rmsnorm":
        return f"has value heads that are not whole groups of its key heads, wider than {MAX_VALUE_DIM}, or another norm"
    if st.conv_channels != 2 * att.n_heads * att.head_dim + st.value_heads * st.value_head_dim:
        return "convolves other channels than its queries, keys and values"
    if any(lin.bias or lin.transposed for lin in (att.query, att.out, st.gate, st.beta, st.decay)):
        return "has Linear layers with biases or transposed"
    return None


def _linear_scratch(att: an.Attention) -> int:
    """Floats a linear layer's step needs beside the plan's buffers: its c channels, z, beta, g and the heads' outputs."""
    st = att.state
    return st.conv_channels + 2 * st.value_heads * st.value_head_dim + 2 * st.value_heads


def _norm_runs(n: an.Norm) -> bool:
    """Whether the step computes norm `n`: an RMSNorm (w or 1 + w) or a LayerNorm without a shift, with a weight."""
    return n.kind in NORM_KINDS and n.weight is not None and n.bias is None


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
        if batch_of(cache) != 1:
            return f"it runs a batch of 1, not {batch_of(cache)}"
        layers = [_module(model, anatomy.head.path)]
        for block in anatomy.blocks:
            att, ff = block.attention, block.ff
            layers += [_module(model, lin.path) for lin in (att.query, att.key, att.value, att.out)]
            if att.state is not None:
                layers += [_module(model, lin.path) for lin in (att.state.gate, att.state.beta, att.state.decay)]
            if ff.kind == "moe":
                layers += [_module(model, ff.experts.router.path)] + sum(_expert_linears(model, ff), [])
            else:
                layers += [_module(model, lin.path) for lin in (ff.gate, ff.up, ff.down)]
        if not all(is_plain(m) and m.weight.dtype == weight.dtype and m.bias is None for m in layers):
            return "its Linear layers are not all plain, bias-free and of the embedding's dtype (a LoRA layer, int8 or int4)"
        norms = [_norm_weight(model, n) for n in anatomy.norms()]
        if any(w is None or w.dtype != weight.dtype for w in norms):
            return "its norms' weights are not of the embedding's dtype"
        linear = [b.attention for b in anatomy.blocks if b.attention.kind == "linear"]
        if linear and not hasattr(cache, "state"):
            return "its linear layers need a HybridCache (engine/hybrid_cache.py's cache_for)"
        if len(_eps(model, anatomy) | {_module(model, a.state.norm.path).eps for a in linear}) != 1:
            return "its RMSNorms have different eps"
        tables = [rope_tables(model, block) if block.attention.rope else None for block in anatomy.blocks]
        if any(not isinstance(getattr(t, "cos", None), torch.Tensor) for t, b in zip(tables, anatomy.blocks)
               if b.attention.rope):
            return "it keeps no RoPE tables of its own (`model.rope`, or `model.rope_of(i)`)"
        if len(cache.k) != anatomy.n_layers:
            return "the KV cache is not of the model's layers"
        for block, t, k in zip(anatomy.blocks, tables, cache.k):
            att = block.attention
            if att.kind == "linear":
                continue
            if t is not None and (t.cos.dtype != torch.float32 or t.cos.shape != t.sin.shape
                                  or t.cos.shape[1] != (att.rope.rotary_dim or att.head_dim)):
                return "its RoPE tables are not float32 rows of the dimensions it turns"
            if t is not None and cache.max_len > t.cos.shape[0]:
                return "the KV cache is longer than RoPE's tables"
            slots = cache.max_len if att.window is None else min(att.window, cache.max_len)
            if k.dtype != weight.dtype or k.shape != (1, att.n_kv_groups, slots, att.head_dim):
                return f"the KV cache of block {block.index} is not of the model's dtype, key/value groups and window"
        tensors = [*model.parameters(), *(t for tab in tables if tab is not None for t in (tab.cos, tab.sin)),
                   *(k for k, b in zip(cache.k + cache.v, 2 * anatomy.blocks) if b.attention.kind != "linear")]
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
        widest_q = max(b.attention.n_heads * b.attention.head_dim * (2 if b.attention.output_gate else 1)
                       for b in blocks)
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
                        "best": torch.empty(1, dtype=torch.int64), "best_value": torch.empty(1, **f32),
                        "resid": torch.empty(d, **f32), "linear_scratch": torch.empty(max(
                            (_linear_scratch(b.attention) for b in blocks if b.attention.kind == "linear"), default=1),
                            **f32)}
        self.keep = list(self.buffers.values())  # every tensor whose address is in the plan stays alive
        self.own: list[tuple[torch.Tensor, torch.Tensor]] = []  # each linear layer's convolution inputs and state
        self.linear_layers = [b.index for b in blocks if b.attention.kind == "linear"]
        self.watch(tok_emb)
        final = anatomy.final_norm
        header = dict(bf16=int(tok_emb.dtype == torch.bfloat16), layers=anatomy.n_layers, d=d, vocab=vocab,
                      tok_emb=self.addr(tok_emb), emb_scale=_double_bits(anatomy.embedding.scale or 0.0),
                      final_norm=self.addr(_norm_weight(model, final)), final_kind=NORM_KINDS[final.kind],
                      logit_scale=_double_bits(anatomy.head.logit_scale or 0.0),
                      eps=_double_bits(_eps(model, anatomy).pop()), head=self.addr(head.weight), max_len=max_len)
        header.update({name: self.addr(t) for name, t in self.buffers.items()})
        plan = [header[name] for name in HEADER_FIELDS] + [0] * (HEADER - len(HEADER_FIELDS))
        for block in blocks:
            att, ff = block.attention, block.ff
            tables = rope_tables(model, block) if att.rope else None
            norms = {role: block.norm(role) for role in ("attn_in", "attn_out", "ff_in", "ff_out")}
            norms.update(q_norm=att.q_norm, k_norm=att.k_norm)
            fields = dict(heads=att.n_heads, groups=att.n_kv_groups, head_dim=att.head_dim,
                          hidden=ff.hidden_dim, slots=max_len if att.window is None else min(att.window, max_len),
                          ring=int(att.window is not None), scale=_double_bits(att.scale or att.head_dim ** -0.5),
                          norm_kinds=sum(NORM_KINDS[norms[role].kind] << 2 * i for i, role in enumerate(NORM_ROLES)
                                         if norms[role] is not None),
                          neighbours=int(att.rope is not None and att.rope.pairs == "neighbours"),
                          parallel=int(block.placement == "parallel"),
                          qk_whole=int(att.q_norm is not None and att.q_norm.dim != att.head_dim),
                          rope_cos=self.addr(tables.cos) if att.rope else 0,
                          rope_sin=self.addr(tables.sin) if att.rope else 0,
                          rotary=(att.rope.rotary_dim or att.head_dim) if att.rope else 0,
                          gated=int(att.output_gate is not None), linear=int(att.kind == "linear"),
                          wq=self.linear(att.query, model), wk=self.linear(att.key, model),
                          wv=self.linear(att.value, model), wo=self.linear(att.out, model), act=ACTS[ff.activation],
                          kcache=0, vcache=0)  # the cache's keys and values: point_at
            fields.update(self.linear_fields(model, att, cache.k[0].dtype))
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

    def linear_fields(self, model: nn.Module, att: an.Attention, dtype: torch.dtype) -> dict[str, int]:
        """A linear layer's fields (Qwen3.5's Gated DeltaNet): its matrices and parameters, and the step's own
        convolution buffer `[1, c, kernel - 1]` and float32 state `[1, hv, dk, dv]`, which `__call__` hands the
        cache (the glass model and the twin read and write them there)."""
        names = ("in_qkv", "in_z", "in_b", "in_a", "conv_w", "a_log", "dt_bias", "gated_norm", "key_heads",
                 "value_heads", "key_dim", "value_dim", "conv_kernel", "conv", "state")
        if att.kind != "linear":
            return dict.fromkeys(names, 0)
        st, mixer = att.state, _module(model, att.path)
        conv = torch.zeros(1, st.conv_channels, st.conv_kernel - 1, dtype=dtype)
        state = torch.zeros(1, st.value_heads, att.head_dim, st.value_head_dim, dtype=torch.float32)
        self.own.append((conv, state))
        return dict(in_qkv=self.linear(att.query, model), in_z=self.linear(st.gate, model),
                    in_b=self.linear(st.beta, model), in_a=self.linear(st.decay, model),
                    conv_w=self.addr(_module(model, st.conv).weight), a_log=self.addr(mixer.A_log),
                    dt_bias=self.addr(mixer.dt_bias), gated_norm=self.addr(_norm_weight(model, st.norm)),
                    key_heads=att.n_heads, value_heads=st.value_heads, key_dim=att.head_dim,
                    value_dim=st.value_head_dim, conv_kernel=st.conv_kernel, conv=self.addr(conv),
                    state=self.addr(state))

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """PlannedStep's call, the linear layers' convolution inputs and states first moved into the step's own
        tensors where the cache holds others (a prompt's, written by the glass forward), and the cache pointed at
        them: the step updates them in place, and whatever reads the cache next reads what it wrote."""
        if self.own:
            cache = self.cache
            for i, (conv, state) in zip(self.linear_layers, self.own):
                if cache.state[i] is not state:
                    if cache.state[i] is None:
                        conv.zero_(), state.zero_()
                    else:
                        conv.copy_(cache.conv[i]), state.copy_(cache.state[i])
                    cache.conv[i], cache.state[i] = conv, state
        return super().__call__(ids)

"""How many bytes a model needs, from its config alone: weights, KV cache, training state.

    memory_needs(cfg, dtype, batch_size, seq_len) -> {"weights": bytes, "kv_cache": ..., ...}
    parameter_table(cfg) -> the parameters of every module, as `glassgpt info` prints them
    architecture_notes(cfg) -> what `info` says about the attention, the positions and the tie
    available_memory() -> Free(ram, swap): what this machine has free now (MemAvailable, SwapFree)
    training_fit / inference_fit(cfg, ..., free) -> None, a note (only swap would be touched), or a
        ConfigError with the figure and the nearest settings that fit: what the commands check first
    with_margin(need) -> what a run of that estimate is let have: need x 1.2 + 512 MiB (MARGIN)

Every figure is read from the model's description (anatomy.py, as its glass file declares it:
kinds.describe_config), never from its family: the matrices and norms it lists, the key/value heads
its attention keeps (grouped-query attention's saving), RoPE's float32 cos/sin tables where positions
are rotary, a gated feed-forward's extra hidden tensors. The config adds what a description does not
hold (drop_rate).

One estimate (memory_needs) and one comparison (fits: the estimate with its margin against
MemAvailable) serve every command: `info` prints both, generate, explain and serve refuse a model
and sequence that would not fit before anything is allocated (inference_fit), train and finetune a
run (training_fit), and formats.check_buildable refuses, for any caller of the library, weights
that would not fit even in swap. GLASSGPT_MEMORY_AVAILABLE (bytes, or a size such as 22.2GiB)
stands for MemAvailable, with no swap, where it is set: for tests and fault drills.

A back-of-the-envelope count that follows what the forward pass keeps and what AdamW stores, so it
tells a reader whether gpt2-xl fits before they load it. tests/test_memory.py holds GPT-2's to within
20% of the peak that PyTorch's allocator records for a real generation and real training steps on a
CPU; the process needs some more for the allocator's own slack. Where the engine runs attention
through a fused kernel (SDPA keeps q, k, v and its output, never the [t, t] scores), training counts
that; a glass attention keeps its [b, h, t, t] weights. No activation checkpointing.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, replace
from typing import Any

import torch

from . import anatomy as an
from .config import GPTConfig
from .engine.attention import ATTENTION_BLOCK
from .errors import ConfigError, GlassError
from .kinds import describe_config

INT8 = "int8"  # weight-only int8 (engine/int8.py): Linear weights 1 byte, the rest bfloat16
INT4 = "int4"  # 4-bit groups (engine/int4.py): Linear weights half a byte + a scale and a minimum per group
QUANTIZED = (INT8, INT4)


MOST_BLOCKS = 512  # described one by one up to this; past it, one block stands for every layer


def described(cfg) -> tuple[an.Anatomy, int]:
    """The description of `cfg` and how many layers each of its blocks stands for (1; a config that claims
    more than MOST_BLOCKS layers, such as a million, is counted from one block, which every model of so many
    layers described so far repeats, so that an estimate stays a few milliseconds). A config that lists its
    layers' types (Gemma 3, OLMo 3, Tiny Aya, Qwen3.5) holds every layer already and is described whole."""
    if cfg.n_layers <= MOST_BLOCKS or getattr(cfg, "layer_types", None):
        return describe_config(cfg), 1
    return describe_config(replace(cfg, n_layers=1)), cfg.n_layers


def engine_runs(anatomy: an.Anatomy) -> bool:
    """Whether the engine's kernels (fused attention, int8 and int4 Linear layers) run this model: the
    learned-position block they were written for, GPT-2's own (every head its own keys and values, no window
    or latent, the GELU MLP); a rotary model, or one of chapter 4's variants of that block, runs its glass code."""
    return anatomy.positions.kind == "learned" and all(
        b.attention.n_kv_groups == b.attention.n_heads and b.attention.window is None and b.attention.latent is None
        and b.ff.kind == "gelu_mlp" for b in anatomy.blocks)


def kv_beside_gpt2(cfg, dtype: torch.dtype | str) -> str | None:
    """One line for a model on GPT-2's config whose attention or feed-forward differs (chapter 4's variants): its
    KV cache per token at a full context beside GPT-2's of the same shape. None for GPT-2 itself and for a model
    on a config of its own (Qwen3, Llama, ...: `architecture_notes` says their heads and groups)."""
    if not isinstance(cfg, GPTConfig) or engine_runs(described(cfg)[0]):
        return None
    gpt2 = GPTConfig(**{f: getattr(cfg, f) for f in GPTConfig.__dataclass_fields__})  # the same shape, GPT-2's parts
    t = cfg.context_length
    ours, theirs = (memory_needs(c, dtype, 1, t)["kv_cache"] / t for c in (cfg, gpt2))
    name, _ = _dtype_size(dtype)
    return (f"KV cache: {ours:,.0f} bytes per token ({name}, over a full context of {t:,} tokens) where "
            f"GPT-2 of this shape keeps {theirs:,.0f} ({ours / theirs:.0%})")


@dataclass(frozen=True)
class ModuleShape:
    """One module's parameters, from the description: its weight's shape and its bias's length."""
    name: str
    weight: tuple[int, ...]
    bias: int
    kind: str  # "embedding", "norm", "linear" or "other" (a convolution's filters, a vector of its own)
    note: str = ""
    tied: bool = False  # the weight is another module's tensor, counted there

    @property
    def weight_params(self) -> int:
        return 0 if self.tied else math.prod(self.weight)

    @property
    def params(self) -> int:
        return self.weight_params + self.bias


NORM_NOTES = {"rmsnorm": "RMSNorm: a scale, no shift", "rmsnorm_plus_one": "RMSNorm: x / rms(x) * (1 + scale)"}


def _norm(norm: an.Norm, note: str = "") -> ModuleShape:
    note = note or (NORM_NOTES.get(norm.kind, "") if norm.role in ("attn_in", "final") else "")
    return ModuleShape(norm.path, (norm.dim,), norm.dim if norm.bias is not None else 0, "norm", note)


def _linear(lin: an.Linear, note: str = "") -> ModuleShape:
    return ModuleShape(lin.path, (lin.out_features, lin.in_features), lin.out_features if lin.bias else 0,
                       "linear", note)


def block_modules(block: an.Block) -> list[ModuleShape]:
    """The modules of one block, in the order its forward meets them (matrices that share one module, such as
    q, k and v as row slices of a fused projection, are one row)."""
    att, ff = block.attention, block.ff
    rows = [_norm(n) for n in block.norms if n.role == "attn_in"]
    rows += _state_modules(att) if att.state is not None else _attention_modules(att)
    rows += [_norm(n, "on att's output, before the residual add" if n.role == "attn_out" else "")
             for n in block.norms if n.role in ("attn_out", "ff_in")]
    if ff.experts is not None:  # E experts' matrices; a token reads k of them
        E, k = ff.experts.n_experts, ff.experts.per_token
        rows.append(_linear(ff.experts.router, f"the router: a score per expert; each token runs its top {k}"))
        rows += [ModuleShape(lin.path.rpartition(".")[0], (E, lin.out_features, lin.in_features), 0, "linear",
                             f"{E} experts' {what}") for lin, what in ((ff.gate, "gates"), (ff.up, "ups"),
                                                                       (ff.down, "downs, back to d"))]
    else:
        if ff.gate is not None:
            rows.append(_linear(ff.gate, f"gate: {ff.activation}({ff.gate.path.rpartition('.')[2]}(x))"))
        rows += [_linear(ff.up, f"times {ff.up.path.rpartition('.')[2]}(x)" if ff.gate else ""),
                 _linear(ff.down, "back to d" if ff.gate else "")]
    rows += [_norm(n, "on ff's output, before the residual add") for n in block.norms if n.role == "ff_out"]
    if block.per_layer_input is not None:  # Gemma 4: x + norm(projection(gelu_tanh(gate(x)) * its input))
        own = block.per_layer_input
        rows += [_linear(own.gate, "gate on the block's per-layer input"), _linear(own.projection, "back to d"),
                 _norm(own.norm)]
    return _merged(rows)


def _attention_modules(att: an.Attention) -> list[ModuleShape]:
    """Softmax attention's matrices and QK-norms (an output gate: rows of the query's module, per head)."""
    h, g, hd = att.n_heads, att.n_kv_groups, att.head_dim
    grouped = g < h
    query = (f"per head: {hd} query rows, then {hd} gate rows" if att.output_gate is not None
             else f"{h} query heads of {hd}" if grouped else "")
    rows = [_linear(att.query, query)] + ([_linear(att.output_gate)] if att.output_gate is not None else [])
    rows += [_linear(att.key, f"{g} key heads, each shared by {h // g} query heads" if grouped else ""),
             _linear(att.value, f"{g} value heads" if grouped else ""), _linear(att.out)]
    per = "head dimension" if att.q_norm is None or att.q_norm.dim == hd else "dimension of the whole projection"
    rows += [_norm(n, f"QK-norm: one scale per {per}" if n.role == "q_norm" else "")
             for n in (att.q_norm, att.k_norm) if n]
    return rows


def _state_modules(att: an.Attention) -> list[ModuleShape]:
    """A linear attention's modules (anatomy.RecurrentState): q, k and v before the short convolution, the
    convolution (one filter of conv_kernel per channel), the output norm's gate, the step size's and the decay's
    matrices with the decay's two vectors per value head (the gated delta rule's A_log and dt_bias), the gated
    output norm and the output matrix."""
    st = att.state
    return [_linear(att.query, "q, k and v of the linear attention, before the short convolution"),
            _linear(att.key), _linear(att.value),
            ModuleShape(st.conv, (st.conv_channels, 1, st.conv_kernel), 0, "other", "the short causal convolution: one filter "
               "per channel"),
            _linear(st.gate, "the output norm's gate"), _linear(st.beta, "the delta rule's step size"),
            _linear(st.decay, "the state's decay"),
            ModuleShape(f"{att.path}.A_log", (st.value_heads,), 0, "other", "the decay's rate, one per value head"),
            ModuleShape(f"{att.path}.dt_bias", (st.value_heads,), 0, "other", "the decay's bias, one per value head"),
            _norm(st.norm, "the gated output norm, one per value head"), _linear(att.out)]


def _merged(rows: list[ModuleShape]) -> list[ModuleShape]:
    """One row per module: matrices described as row slices of the same module are stacked."""
    merged: dict[str, ModuleShape] = {}
    for row in rows:
        seen = merged.get(row.name)
        merged[row.name] = row if seen is None else replace(
            seen, weight=(seen.weight[0] + row.weight[0],) + seen.weight[1:], bias=seen.bias + row.bias,
            note=seen.note or row.note)
    return list(merged.values())


def model_modules(cfg) -> tuple[list[ModuleShape], list[list[ModuleShape]], list[ModuleShape], int]:
    """(before the blocks, each block's modules, after the blocks, the layers each block stands for), as the
    description lists them."""
    anatomy, repeat = described(cfg)
    emb, head, d = anatomy.embedding, anatomy.head, anatomy.embedding.emb_dim
    rotary = anatomy.positions.kind == "rope"
    everywhere = all(b.attention.rope is not None for b in anatomy.blocks)
    scaled = f", times sqrt({d})" if emb.scale else ""
    before = [ModuleShape(emb.path, (emb.vocab_size, d), 0, "embedding", f"vocab -> hidden{scaled}"
                          + (f" (no pos_emb: RoPE turns q and k in {'each' if everywhere else 'some'} attention)"
                             if rotary else ""))]
    if anatomy.positions.kind == "learned":
        before.append(ModuleShape(anatomy.positions.path, (anatomy.positions.context_length, d), 0, "embedding",
                                  "one row per position"))
    if emb.per_layer_inputs is not None:  # Gemma 4: a vector of p per token and layer
        pl = emb.per_layer_inputs
        before += [ModuleShape(emb.per_layer, (pl.vocab_size, pl.n_layers * pl.dim), 0, "embedding",
                               f"vocab -> {pl.n_layers} per-layer inputs of {pl.dim}"),
                   _linear(pl.projection, "the scaled embedding, projected to every layer's input"),
                   _norm(pl.norm, "on each layer's projected input")]
    what = "hidden -> vocab" if head.out_features == emb.vocab_size and not head.bias else "hidden -> classes"
    if head.tied:
        head_row = ModuleShape(head.path, (head.out_features, d), 0, "linear",
                               f"{what}: the same tensor as {emb.path}.weight, counted once", tied=True)
    else:
        head_row = ModuleShape(head.path, (head.out_features, d), head.out_features if head.bias else 0, "linear", what)
    return before, [block_modules(b) for b in anatomy.blocks], [_norm(anatomy.final_norm), head_row], repeat


def parameter_table(cfg) -> dict[str, Any]:
    """Per-module parameter counts and the totals with and without weight tying, from the
    config alone (no weights are built): what `glassgpt info` and `explain` print. Blocks of one set of
    modules are one group of rows (trf_blocks.N.*); where the layer types hold different modules (Qwen3.5's
    linear and full attention), a group per type, named by its letter (trf_blocks.L.*, trf_blocks.F.*)."""
    before, blocks, after, repeat = model_modules(cfg)
    anatomy, _ = described(cfg)
    in_blocks = repeat * sum(m.params for block in blocks for m in block)
    total = sum(m.params for m in before + after) + in_blocks
    tied = sum(math.prod(m.weight) for m in after if m.tied)
    where = anatomy.blocks_path
    groups: dict[tuple, tuple[str, list[ModuleShape], int]] = {}  # the modules' shapes -> a layer type, its modules, count
    for block, modules in zip(anatomy.blocks, blocks):
        shapes = tuple((m.name.split(".", 2)[2], m.weight, m.bias) for m in modules)
        layer_type, first, count = groups.get(shapes, (block.layer_type, modules, 0))
        groups[shapes] = (layer_type, first, count + repeat)
    rows = [_row(m.name, m) for m in before]
    for layer_type, modules, count in groups.values():
        letter = "N" if len(groups) == 1 else layer_type[0].upper()
        rows += [_row(f"{where}.{letter}.{m.name.split('.', 2)[2]}", m, m.note or "in each block") for m in modules]
        per_block = sum(m.params for m in modules)
        name = f"{where} (x{count})" if len(groups) == 1 else f"{where} ({count} x {layer_type})"
        rows.append({"name": name, "shape": "", "params": count * per_block, "note": f"{per_block:,} per block"})
    rows += [_row(m.name, m) for m in after]
    return {"modules": rows, "total": total, "total_untied": total + tied, "tied": tied > 0}


def _row(name: str, module: ModuleShape, note: str | None = None) -> dict[str, Any]:
    return {"name": name, "shape": str(list(module.weight)), "params": module.params,
            "note": module.note if note is None else note}


def parameter_counts(cfg) -> dict[str, int]:
    """Parameters by kind: `linear` (the matrices of the blocks and the head), `other` (the rest)."""
    before, blocks, after, repeat = model_modules(cfg)
    def linear(modules: list[ModuleShape]) -> int:
        return sum(m.weight_params for m in modules if m.kind == "linear")
    def total(modules: list[ModuleShape]) -> int:
        return sum(m.params for m in modules)
    n_linear = repeat * sum(linear(b) for b in blocks) + linear(after)
    return {
        "linear": n_linear,
        "other": total(before) + repeat * sum(total(b) for b in blocks) + total(after) - n_linear,
        "head_rows": after[-1].weight[0],  # the int8 head needs its own copy when tied
    }


def architecture_notes(cfg) -> list[str]:
    """What `info` says about a model with rotary positions, in a line each: its attention's heads and groups,
    its layers' kinds (sliding and full, linear and full), where RoPE turns and where it does not, QK-norm, norms
    other than one before each sublayer, a scaled embedding, experts, a scaled head, the tie. An empty list for
    learned positions (GPT-2's notes are its loader's)."""
    anatomy, _ = described(cfg)
    if anatomy.positions.kind != "rope":
        return []
    block = next((b for b in anatomy.blocks if b.attention.state is None), anatomy.blocks[0])  # a softmax layer
    att, ff = block.attention, block.ff
    h, g, hd, d = att.n_heads, att.n_kv_groups, att.head_dim, anatomy.embedding.emb_dim
    gated = ", its output gated by sigmoid(x @ gate)" if att.output_gate is not None else ""
    notes = [f"{anatomy.name}: {h} query heads of {hd} share {g} key/value groups ({h // g} per group){gated}"]
    notes += _layer_notes(anatomy.blocks)
    if anatomy.embedding.scale:
        notes.append(f"{anatomy.embedding.path}'s rows are multiplied by sqrt({d}) = {anatomy.embedding.scale:.2f}")
    if att.q_norm is not None:
        notes.append("QK-norm: each query and key head is RMS-normed before RoPE" if att.q_norm.dim == hd else
                     "QK-norm: the whole query and key projections are RMS-normed before RoPE")
    if any(n.kind == "rmsnorm_plus_one" for n in anatomy.norms()):
        notes.append("every RMSNorm scales by (1 + weight)")
    if block.placement != "pre":
        count = f"{len(block.norms)} norm{'s' if len(block.norms) > 1 else ''}"
        notes.append(f"{count} a block ({block.placement}: "
                     + ", ".join(n.role.replace("_", " ") for n in block.norms) + f"); {ff.kind}")
    if ff.experts is not None:
        notes.append(f"mixture of experts: a router picks {ff.experts.per_token} of {ff.experts.n_experts} "
                     f"{ff.activation} experts (width {ff.hidden_dim}) for each token, weighted by the softmax of "
                     "their scores")
    shared = [b for b in anatomy.blocks if b.attention.kv_shared_from is not None]
    if shared:  # Gemma 4's last layers
        notes.append(f"{len(shared)} kv-shared layers ({shared[0].index} on): no keys or values of their own, each "
                     "attends over the last earlier layer's of its type, and keeps no cache")
    if anatomy.embedding.per_layer_inputs is not None:
        pl = anatomy.embedding.per_layer_inputs
        notes.append(f"per-layer inputs: {anatomy.embedding.per_layer} gives each token {pl.n_layers} vectors of "
                     f"{pl.dim}, one added into each block (gated, projected, normed)")
    if anatomy.head.logit_scale:
        notes.append(f"the logits are multiplied by {anatomy.head.logit_scale:g}")
    if anatomy.head.softcap:
        notes.append(f"the logits are capped softly: {anatomy.head.softcap:g} tanh(logits / {anatomy.head.softcap:g})")
    notes.append(f"{anatomy.head.path} is {anatomy.embedding.path} (tied)" if anatomy.head.tied
                 else f"{anatomy.head.path} has its own weights (untied)")
    return notes


def _layer_kind(block: an.Block) -> str:
    att = block.attention
    return "linear" if att.state is not None else "sliding" if att.window else "full"


def _layer_notes(blocks: tuple[an.Block, ...]) -> list[str]:
    """The layers' kinds and where RoPE turns the queries and keys, from each block's attention."""
    kinds = [_layer_kind(b) for b in blocks]
    notes = []
    linear = [b.attention for b in blocks if b.attention.state is not None]
    if linear:
        st, dk = linear[0].state, linear[0].head_dim
        notes.append(f"{len(linear)} linear-attention layers ({st.rule.replace('_', ' ')} rule: {st.value_heads} "
                     f"states of [{dk}, {st.value_head_dim}] per sequence, a convolution over {st.conv_kernel} "
                     f"tokens), {kinds.count('full')} full")
    sliding = [b.attention for b in blocks if b.attention.window]
    if sliding:
        notes.append(f"{len(sliding)} sliding layers (window {sliding[0].window:,}), {kinds.count('full')} full")
    ropes: dict[tuple, list[str]] = {}  # each RoPE as said once -> the kinds of layer it turns in
    for kind, block in zip(kinds, blocks):
        rope = block.attention.rope
        if rope is not None:
            said = [f"base {rope.base:,.0f}"]
            if rope.scaling:
                values = dict(rope.scaling_values)
                factor = values.get("factor", values.get("rope_factor"))
                said.append(f"{rope.scaling} scaling" + (f" x{factor:g}" if factor is not None else ""))
            if rope.rotary_dim and rope.rotary_dim < rope.head_dim:
                said.append(f"on {rope.rotary_dim} of {rope.head_dim} dimensions")
            if rope.pairs != "halves":
                said.append(f"{rope.pairs} paired")
            ropes.setdefault(tuple(said), [])
            ropes[tuple(said)] += [kind] if kind not in ropes[tuple(said)] else []
    unrotated = sum(b.attention.rope is None for b in blocks)
    if len(ropes) == 1 and not unrotated:
        notes.append(f"no pos_emb: RoPE ({', '.join(next(iter(ropes)))}) turns the queries and keys inside every "
                     "attention")
    else:
        notes.append("no pos_emb: RoPE (" + "; ".join(f"{', '.join(said)} in the {' and '.join(where)} layers"
                                                       for said, where in ropes.items()) + ")"
                     + (f"; {unrotated} layer{'s' if unrotated > 1 else ''} without any position signal"
                        if unrotated else ""))
    return notes


def memory_needs(cfg, dtype: torch.dtype | str = torch.float32, batch_size: int = 1,
                 seq_len: int | None = None, prompt_attention: str = "sdpa") -> dict[str, Any]:
    """Bytes for inference (weights + KV cache + working buffers) and for training as
    `glassgpt train --dtype DTYPE` runs it (float32 master weights, their gradients and
    AdamW's two moments, plus, below float32, the engine's low-precision copy of the weights
    and its gradients; saved activations), for `batch_size` sequences of `seq_len` tokens
    (default: context_length). `dtype` is the weights' dtype for inference and the compute
    dtype for training (a torch dtype, its name, or "int8"/"int4" for quantized decoding).
    `prompt_attention`: the engine's path for long prompts on a CPU ("sdpa" or "blocks", as
    engine/autotune.py chose it)."""
    anatomy, repeat = described(cfg)
    name, size = _dtype_size(dtype)
    quantized = name in QUANTIZED
    if quantized and not engine_runs(anatomy):
        raise GlassError(f"{name} weights are the engine's, for learned-position models (engine/): use float32 or "
                         f"bfloat16 for a {anatomy.name} model")
    seq_len = seq_len or cfg.context_length
    b, t, n = batch_size, seq_len, cfg.n_layers
    d, V = anatomy.embedding.emb_dim, anatomy.head.out_features
    counts = parameter_counts(cfg)
    n_params = counts["linear"] + counts["other"]
    act = 2 if quantized else size  # int8 and int4 run their activations in bfloat16
    fused = engine_runs(anatomy)  # the engine's attention keeps no [t, t] scores; a glass one keeps them

    if name == INT8:  # every Linear 1 byte a weight and a bfloat16 scale a row; a tied head gets a copy of its own
        head_copy = V * d if anatomy.head.tied else 0
        scale_rows = repeat * sum(lin.out_features for lin in anatomy.linears()) + V
        weights = counts["linear"] + head_copy + 2 * scale_rows + 2 * counts["other"]
    elif name == INT4:
        weights = _int4_bytes(anatomy, repeat, V, d) + 2 * counts["other"]
    else:
        weights = n_params * size
    ropes = {(r.base, r.rotary_dim or r.head_dim) for r in (blk.attention.rope for blk in anatomy.blocks) if r}
    rope = sum(2 * anatomy.positions.context_length * hd * 4 for _, hd in ropes)  # float32 cos and sin, each base
    kv_kept = kv_cache = states = working = activations = 0
    for block in anatomy.blocks:
        att, ff = block.attention, block.ff
        h, g, hd, f = att.n_heads, att.n_kv_groups, att.head_dim, ff.hidden_dim
        if att.state is not None:  # a linear attention keeps a float32 state and its convolution's last inputs
            st = att.state
            states += repeat * b * (st.value_heads * hd * st.value_head_dim * 4
                                    + st.conv_channels * (st.conv_kernel - 1) * act)
        elif att.kv_shared_from is None:  # (a kv-shared layer reads another layer's keys and values, keeps none)
            kept = t if att.window is None else min(t, att.window)  # a sliding layer keeps its window
            kv_kept += repeat * kept
            # latent attention (MLA) keeps one c-wide latent a position, from which keys and values are made
            kv_cache += repeat * b * kept * (att.latent.out_features if att.latent else 2 * g * hd) * act
        # A forward's transient peak: in the feed-forward, the residual stream, the norm's output, the hidden
        # tensors (before and after the activation; a gated one's gate, up, activation and product; for
        # experts, those of the k a token runs) and the block's output; or a glass attention's [b, h, t, t]
        # scores and weights. A prompt of ATTENTION_BLOCK+ tokens that the engine attends a block of queries
        # at a time (engine/attention.py): one block's float32 scores and their softmax.
        hidden = (4 if ff.gate is not None else 2) * (ff.experts.per_token if ff.experts else 1)
        scores = 0 if fused or att.state is not None else 2 * b * h * t * t * act  # a state: no [t, t] scores
        block_working = max(scores, b * t * (3 * d + hidden * f) * act)
        if fused and prompt_attention == "blocks" and t >= ATTENTION_BLOCK:
            block_working += b * h * ATTENTION_BLOCK * t * (4 + 4)
        working = max(working, block_working)
        # Saved for backward, per token: each norm's input and output, q, k, v (and the rotated q, k; an output
        # gate), the attention's output and its [b, t, h*hd] reshape, the feed-forward's hidden tensors, and the
        # dropout masks where drop_rate > 0 (1 byte each, 3 of width d); a glass attention's [b, h, t, t] too.
        qkv = sum(lin.out_features for lin in (att.query, att.key, att.value, att.output_gate) if lin)
        rotated = (h + g) * hd if att.rope else 0
        per_token = (2 * len(block.norms) * d + qkv + rotated + 2 * att.out.in_features + hidden * f) * act \
            + (3 * d if getattr(cfg, "drop_rate", 0) > 0 else 0)
        activations += repeat * (b * t * per_token + scores)
    kv_cache += states
    working += b * V * 4  # the last position's float32 logits
    inference = weights + rope + kv_cache + working

    # train.py keeps the weights, their gradients and AdamW's state in float32; below float32
    # forward and backward run on a copy of the weights in `dtype` (engine/mixed.py), whose
    # gradients exist beside the master's while they are widened into them.
    copy = n_params * size if size < 4 else 0
    master = n_params * 4 + copy
    gradients = n_params * 4 + copy
    adamw_state = 2 * n_params * 4  # exp_avg and exp_avg_sq, float32
    # The head: final_norm's output, the logits, and their gradient (engine/loss.py never widens all
    # of them to float32: it works a few rows at a time and writes the gradient in their dtype).
    activations += b * t * d * act + b * t * (2 * d * act + 2 * V * act)
    training = master + gradients + adamw_state + activations if not quantized else 0

    linear = [blk for blk in anatomy.blocks if blk.attention.state is not None]
    att = next((blk.attention for blk in anatomy.blocks if blk.attention.state is None), anatomy.blocks[0].attention)
    h, g, hd = att.n_heads, att.n_kv_groups, att.head_dim
    notes = {
        "weights": f"{n_params:,} parameters" + (f" ({name} Linear weights + bfloat16 rest)" if quantized
                                                  else f" x {size} bytes ({name})"),
        "kv_cache": (f"{states // b:,} bytes of linear-attention state per sequence, whatever its length, + "
                     if states else "")
                    + ((f"latents: {n} layers x {b} x {t} tokens x {att.latent.out_features} x {act} bytes (keys and "
                        f"values of {g * hd} each are made from them at every step)") if att.latent else
                       (f"keys and values: 2 x {n - len(linear)} layers x {b} x {t} tokens x {g * hd} x {act} bytes"
                        + (f" ({g} groups of {hd}: {h // g}x smaller than {h} heads would need)" if g < h else ""))
                       if kv_kept == (n - len(linear)) * t else
                       f"keys and values: 2 x {kv_kept:,} positions over {n} layers (a sliding layer keeps its "
                       f"window) x {b} x {g} groups x {hd} x {act} bytes"),
        "inference": "weights + " + (f"RoPE's float32 cos/sin ({rope / 2**20:.0f} MiB) + " if rope else "")
                     + "KV cache + one forward's temporaries (the feed-forward's"
                     + ("" if fused else ", or one layer's [b, h, t, t] attention") + ", and the last logits)",
        "gradients": "one float32 gradient per parameter" + (f", and the {name} copy's while it is widened"
                                                            if copy else ""),
        "adamw_state": "AdamW's exp_avg and exp_avg_sq: two float32 copies of the parameters",
        "activations": "kept for backward: the norms' inputs and outputs, q, k, v, the attention's output and the "
                       "feed-forward's hidden tensors per token and block"
                       + ("" if fused else ", the [b, h, t, t] attention weights")
                       + f", plus the [b, t, V] logits and their gradient ({b} x {t} tokens, "
                       + ("SDPA, " if fused else "") + "no checkpointing)",
        "training": ("float32 weights" + (f" and their {name} copy" if copy else "")
                     + " + gradients + AdamW state + activations") if not quantized
                    else f"{name} is for inference only",
    }
    needs = {"dtype": name, "batch_size": b, "seq_len": t, "parameters": n_params,
             "weights": weights, "kv_cache": kv_cache, "inference": inference,
             "gradients": gradients if not quantized else 0, "adamw_state": adamw_state if not quantized else 0,
             "activations": activations if not quantized else 0, "training": training, "notes": notes}
    if rope:
        needs["rope_tables"] = rope
    return needs


def _int4_bytes(anatomy: an.Anatomy, repeat: int, V: int, d: int) -> int:
    """What engine/int4.py stores for every Linear's weight (the head's too): rows padded to blocks of 16,
    half a byte per weight, a bfloat16 scale and minimum per row and group of GROUP_SIZE columns."""
    from .engine.int4 import GROUP_SIZE
    shapes = [(lin.out_features, lin.in_features) for lin in anatomy.linears()] * repeat + [(V, d)]
    total = 0
    for out, inp in shapes:
        rows = -(-out // 16) * 16
        total += rows * inp // 2 + rows * (inp // GROUP_SIZE) * 2 * 2
    return total


def _dtype_size(dtype: torch.dtype | str) -> tuple[str, int]:
    if isinstance(dtype, str):
        if dtype in QUANTIZED:
            return dtype, 1
        from .device import DTYPES
        if dtype not in DTYPES:
            raise GlassError(f"unknown dtype {dtype!r}: use float32, bfloat16, float16, int8 or int4")
        dtype = DTYPES[dtype]
    return str(dtype).removeprefix("torch."), torch.empty((), dtype=dtype).element_size()


# --- what this machine has free, and whether a run fits in it ---------------------------------

# Each token a generation keeps: its id in the [b, t + max_new_tokens] int64 buffer (generate.py's
# `seq`), and in the CLI's list of new ids (a Python int and its list slot).
TOKEN_BYTES = 8 + 8 + 32


@dataclass(frozen=True)
class Free:
    """The memory a run can take now: `ram` without swapping (Linux's MemAvailable, or the GPU's free
    memory), `swap` beyond it (SwapFree), and where the figures come from."""
    ram: int
    swap: int
    source: str


MEMORY_VARIABLE = "GLASSGPT_MEMORY_AVAILABLE"
UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}


def available_memory(device: torch.device | str | None = None) -> Free:
    """What this machine (or the GPU `device`) has free now: MemAvailable, not MemTotal, since other
    processes' memory is not ours to take; GLASSGPT_MEMORY_AVAILABLE instead where it is set (tests fake
    this function or set it)."""
    faked = os.environ.get(MEMORY_VARIABLE)
    if faked is not None:
        return Free(parse_size(faked, MEMORY_VARIABLE), 0, MEMORY_VARIABLE)
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return Free(free, 0, f"free on {device}")
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
        return Free(info["MemAvailable"], info.get("SwapFree", 0), "MemAvailable")
    except (OSError, KeyError, ValueError, IndexError):
        pass
    try:
        return Free(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), 0, "free pages")
    except (ValueError, OSError, AttributeError):
        return Free(1 << 40, 0, "unknown: taken as a terabyte")


def parse_size(text: str, what: str) -> int:
    """Bytes from "23837466624", "22.2GiB", "512M" or "1.5 TB" (binary units: a K is 1,024); a ConfigError for
    anything else, naming `what`."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if match is None or float(match.group(1)) * UNITS[match.group(2).lower()] >= 2**63:
        raise ConfigError(f"{what}={text!r} is not an amount of memory: give bytes or a size such as 22.2GiB, "
                          "or unset it")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def gib(n: int | float) -> str:
    return f"{n / 2**30:,.1f} GiB"


# The estimate is held to within 20% of PyTorch's measured peak (tests/test_memory.py), and the process has more
# than its tensors (the interpreter, torch's libraries: ~230 MiB before any model, and the allocator's slack): a
# run is let start only where its estimate with this margin fits.
MARGIN_FRACTION, MARGIN_BYTES = 0.2, 512 * 2**20
MARGIN = f"the estimate x {1 + MARGIN_FRACTION:g} + {MARGIN_BYTES // 2**20} MiB"


def with_margin(need: int) -> int:
    """What a run whose estimate is `need` bytes is let have: `need` and its margin (MARGIN)."""
    return int(need * (1 + MARGIN_FRACTION)) + MARGIN_BYTES


def fits(need: int, free: Free) -> bool:
    """Whether an estimate of `need` bytes, with its margin, fits in the memory available without swapping."""
    return with_margin(need) <= free.ram


def largest(lo: int, hi: int, ok) -> int | None:
    """The largest n in [lo, hi] for which ok(n) holds, ok being true up to some n and false after (or None):
    a few dozen estimates, whatever a config claims."""
    if hi < lo or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def fit_note(need: int, free: Free, what: str, nearest: str) -> str | None:
    """None when `need` bytes fit, with their margin, in `free.ram`; a note when only swap would be touched; else a
    ConfigError (one line: the figure, its margin, what is available, and `nearest`, the closest settings that fit)."""
    if fits(need, free):
        return None
    asked = f"{what} needs {gib(need)}, {gib(with_margin(need))} with the margin ({MARGIN})"
    if with_margin(need) <= free.ram + free.swap:
        return (f"{asked}, and {gib(free.ram)} is available ({free.source}): the other "
                f"{gib(with_margin(need) - free.ram)} will come from swap, which runs many times slower ({nearest})")
    raise ConfigError(f"{asked}, and this machine has {gib(free.ram)} available ({free.source})"
                      + (f" and {gib(free.swap)} of swap" if free.swap else "") + f": {nearest}, or free memory")


def training_fit(cfg: GPTConfig, dtype: torch.dtype | str, batch_size: int, seq_len: int, free: Free,
                 model_flags: bool = True, frozen: bool = False) -> str | None:
    """Whether training `cfg` (weights, gradients, AdamW's state and one batch's activations, as
    `memory_needs` counts them) fits in `free`: see `fit_note`. The nearest config that fits: the
    largest --batch-size, else (`model_flags`: the command can change the architecture) the most
    --n-layers at --batch-size 1. `frozen`: most weights are frozen (LoRA, a last block), so their
    gradients and AdamW state are left out of the count (a lower bound then)."""
    def total(c: GPTConfig, b: int) -> int:
        m = memory_needs(c, dtype, b, seq_len)
        return m["training"] - (m["gradients"] + m["adamw_state"] if frozen else 0)

    need = memory_needs(cfg, dtype, batch_size, seq_len)
    per_row = memory_needs(cfg, dtype, 1, seq_len)["activations"]
    fixed = total(cfg, 1) - per_row
    if fits(fixed + per_row, free):
        most = largest(1, max(1, batch_size - 1), lambda b: fits(fixed + b * per_row, free))
        nearest = f"--batch-size {most:,} fits"
    else:
        layers = largest(1, cfg.n_layers - 1, lambda n: fits(total(replace(cfg, n_layers=n), 1), free))
        nearest = (f"--n-layers {layers} fits at --batch-size 1" if layers and model_flags else
                   "a smaller model (fewer --n-layers or a smaller --emb-dim)" if model_flags else
                   "even --batch-size 1 does not fit: a smaller model, or LoRA (--lora-rank 8) to train fewer weights")
    parts = (f"{'weights' if frozen else 'weights, gradients and AdamW state'} {gib(fixed)}, the activations "
             f"of one batch of {batch_size:,} x {seq_len:,} tokens {gib(need['activations'])}")
    return fit_note(fixed + need["activations"], free, f"training a model of n_layers {cfg.n_layers:,}, emb_dim {cfg.emb_dim:,} ({parts})",
                    nearest)


def inference_need(cfg: GPTConfig, dtype: torch.dtype | str, tokens: int) -> int:
    """Bytes to run `cfg` on a sequence of `tokens` tokens: the weights, a KV cache of up to context_length,
    one forward's temporaries, and TOKEN_BYTES for every token kept."""
    return memory_needs(cfg, dtype, 1, max(1, min(tokens, cfg.context_length)))["inference"] + tokens * TOKEN_BYTES


def inference_fit(cfg: GPTConfig, dtype: torch.dtype | str, tokens: int, free: Free,
                  tokens_flag: str = "--max-new-tokens", new_tokens: int = 0) -> str | None:
    """Whether running `cfg` on a sequence of `tokens` tokens (the prompt and `new_tokens` new ones) fits
    in `free` (inference_need, with its margin). The nearest that fits: fewer new tokens, else a smaller dtype."""
    need = inference_need(cfg, dtype, tokens)
    if fits(need, free):
        return None
    prompt = tokens - new_tokens
    most = largest(0, new_tokens - 1, lambda n: fits(inference_need(cfg, dtype, prompt + n), free)) \
        if new_tokens else None
    if most is not None:
        nearest = f"{tokens_flag} {most:,} fits"
    else:
        name = _dtype_size(dtype)[0]
        quantized = (INT8, INT4) if engine_runs(described(cfg)[0]) else ()  # the engine's kernels' models
        smaller = [d for d in ("bfloat16",) + quantized if d != name
                   and fits(inference_need(cfg, d, tokens), free) and _dtype_size(d)[1] <= _dtype_size(dtype)[1]]
        nearest = f"--dtype {smaller[0]} fits" if smaller else "a smaller model"
    parameters = memory_needs(cfg, dtype, 1, 1)["parameters"]
    what = (f"running a model of n_layers {cfg.n_layers:,}, emb_dim {cfg.emb_dim:,} ({parameters:,} parameters) in "
            f"{_dtype_size(dtype)[0]} on "
            f"{tokens:,} tokens (weights, KV cache and {TOKEN_BYTES} bytes per token kept)")
    return fit_note(need, free, what, nearest)

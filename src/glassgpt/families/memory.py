"""How many bytes a Qwen3 or Llama 3.2 model needs, from its FamilyConfig alone (memory.py's, for GPT-2).

    family_parameter_table(cfg)  the parameters of every module, as `glassgpt info` prints them
    family_memory_needs(cfg, dtype, batch_size, seq_len)  weights, KV cache, training state

What differs from GPT-2's count: the KV cache holds g = n_kv_groups heads of hd, not d per token
(grouped-query attention's saving); RoPE's cos/sin tables are float32 [context_length, hd] each;
and the glass attention keeps its [b, h, t, t] weights for backward (no fused kernel here).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..config import FamilyConfig
from .gemma3 import Gemma3Config


def gemma3_modules(cfg: Gemma3Config) -> tuple[list[tuple], list[tuple], list[tuple]]:
    """family_modules for Gemma 3: four norms a block, GeGLU, the scaled embedding."""
    d, hd, f, V, h, g = cfg.emb_dim, cfg.head_dim, cfg.hidden_dim, cfg.vocab_size, cfg.n_heads, cfg.n_kv_groups
    norm = "RMSNorm: x / rms(x) * (1 + scale)"
    block = [("input_layernorm", (d,), norm, False),
             ("att.W_query", (h * hd, d), f"{h} query heads of {hd}", False),
             ("att.W_key", (g * hd, d), f"{g} key heads, each shared by {h // g} query heads", False),
             ("att.W_value", (g * hd, d), f"{g} value heads", False),
             ("att.out_proj", (d, h * hd), "", False)]
    if cfg.qk_norm:
        block += [("att.q_norm", (hd,), "QK-norm: one scale per head dimension", False), ("att.k_norm", (hd,), "", False)]
    block += [("post_attention_layernorm", (d,), "on att's output, before the residual add", False),
              ("pre_feedforward_layernorm", (d,), "", False),
              ("ff.fc1", (f, d), "GeGLU's gate: gelu_tanh(fc1(x))", False),
              ("ff.fc2", (f, d), "GeGLU's up: times fc2(x)", False),
              ("ff.fc3", (d, f), "back to d", False),
              ("post_feedforward_layernorm", (d,), "on ff's output, before the residual add", False)]
    head_note = "hidden -> vocab: the same tensor as tok_emb.weight, counted once" if cfg.tie_embeddings \
        else "hidden -> vocab"
    return ([("tok_emb", (V, d), f"vocab -> hidden, times sqrt({d}) (no pos_emb: RoPE in each attention)", False)],
            block, [("final_norm", (d,), norm, False), ("out_head", (V, d), head_note, cfg.tie_embeddings)])


def family_modules(cfg: FamilyConfig | Gemma3Config) -> tuple[list[tuple], list[tuple], list[tuple]]:
    """(before the blocks, one block, after the blocks) as (name, weight shape, note, tied) rows."""
    if cfg.family == "gemma3":
        return gemma3_modules(cfg)
    d, hd, f, V = cfg.emb_dim, cfg.head_dim_value, cfg.hidden_dim, cfg.vocab_size
    h, g = cfg.n_heads, cfg.n_kv_groups
    block = [("norm1", (d,), "RMSNorm: a scale, no shift", False),
             ("att.W_query", (h * hd, d), f"{h} query heads of {hd}", False),
             ("att.W_key", (g * hd, d), f"{g} key heads, each shared by {h // g} query heads", False),
             ("att.W_value", (g * hd, d), f"{g} value heads", False),
             ("att.out_proj", (d, h * hd), "", False)]
    if cfg.qk_norm:
        block += [("att.q_norm", (hd,), "QK-norm: one scale per head dimension", False),
                  ("att.k_norm", (hd,), "", False)]
    block += [("norm2", (d,), "", False)]
    if cfg.moe:  # E experts' matrices, each [m, d] or [d, m]; a token reads k of them
        E, k, m = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_hidden_dim
        block += [("ff.gate", (E, d), f"the router: a score per expert; each token runs its top {k}", False),
                  ("ff.fc1", (E, m, d), f"{E} experts' SwiGLU gates, [{m}, {d}] each", False),
                  ("ff.fc2", (E, m, d), f"{E} experts' ups", False),
                  ("ff.fc3", (E, d, m), f"{E} experts' downs, back to d", False)]
    else:
        block += [("ff.fc1", (f, d), "SwiGLU's gate: silu(fc1(x))", False),
                  ("ff.fc2", (f, d), "SwiGLU's up: times fc2(x)", False),
                  ("ff.fc3", (d, f), "back to d", False)]
    head_note = "hidden -> vocab: the same tensor as tok_emb.weight, counted once" if cfg.tie_embeddings \
        else "hidden -> vocab"
    return ([("tok_emb", (V, d), "vocab -> hidden (no pos_emb: RoPE turns q and k in each attention)", False)],
            block,
            [("final_norm", (d,), "", False), ("out_head", (V, d), head_note, cfg.tie_embeddings)])


def family_parameter_table(cfg: FamilyConfig) -> dict[str, Any]:
    """Per-module parameter counts and the totals with and without the tie (memory.parameter_table's form)."""
    before, block, after = family_modules(cfg)

    def row(name, shape, note, tied):
        return {"name": name, "shape": str(list(shape)), "params": 0 if tied else math.prod(shape), "note": note}

    per_block = sum(math.prod(shape) for _, shape, _, _ in block)
    blocks = "blocks" if cfg.family == "gemma3" else "trf_blocks"  # the notebooks' names
    rows = [row(*m) for m in before] + [row(f"{blocks}.N.{m[0]}", *m[1:]) for m in block]
    rows.append({"name": f"{blocks} (x{cfg.n_layers})", "shape": "", "params": cfg.n_layers * per_block,
                 "note": f"{per_block:,} per block"})
    rows += [row(*m) for m in after]
    total = sum(r["params"] for r in rows if not r["name"].startswith(f"{blocks}.N."))
    tied = cfg.vocab_size * cfg.emb_dim if cfg.tie_embeddings else 0
    return {"modules": rows, "total": total, "total_untied": total + tied, "tied": cfg.tie_embeddings}


def family_memory_needs(cfg: FamilyConfig, dtype: torch.dtype, batch_size: int = 1,
                        seq_len: int | None = None) -> dict[str, Any]:
    """Bytes for inference (weights, RoPE tables, KV cache, one forward's temporaries) and for training
    (float32 weights, gradients and AdamW's two moments, plus a low-precision copy below float32, and
    the activations backward keeps), for `batch_size` sequences of `seq_len` tokens (default: context)."""
    name = str(dtype).removeprefix("torch.")
    size = torch.empty((), dtype=dtype).element_size()
    t = seq_len or cfg.context_length
    b, d, n, f, V = batch_size, cfg.emb_dim, cfg.n_layers, cfg.hidden_dim, cfg.vocab_size
    hd, h, g = cfg.head_dim_value, cfg.n_heads, cfg.n_kv_groups
    n_params = family_parameter_table(cfg)["total"]
    weights = n_params * size
    rope = 2 * cfg.context_length * hd * 4
    kept = sum(t if w is None else min(t, w) for w in getattr(cfg, "windows", (None,) * n))  # a sliding layer: its window
    kv_cache = 2 * kept * b * g * hd * size
    # The glass attention's [b, h, t, t] scores and weights (one layer at a time), or the feed-forward's
    # residual, norm2's output, fc1, fc2, silu and their product, with RMSNorm's float32 [b, t, d];
    # then the last position's float32 logits.
    scores = 2 * b * h * t * t * size
    working = max(scores, b * t * (2 * d + 4 * f) * size + b * t * d * 4) + b * V * 4
    inference = weights + rope + kv_cache + working
    copy = n_params * size if size < 4 else 0
    master, gradients, adamw_state = n_params * 4 + copy, n_params * 4 + copy, 2 * n_params * 4
    # Per token and block: norm1 in/out, q, k, v and their rotated q, k, the context, norm2 in/out,
    # fc1, fc2, silu, product; per block the [b, h, t, t] scores and weights; then the logits and their gradient.
    per_token_block = (4 * d + 3 * h * hd + 3 * g * hd + 4 * f) * size
    activations = b * t * n * per_token_block + 2 * n * b * h * t * t * size + 2 * b * t * V * size
    training = master + gradients + adamw_state + activations
    notes = {
        "weights": f"{n_params:,} parameters x {size} bytes ({name})",
        "kv_cache": f"keys and values: 2 x {n} layers x {b} x {t} tokens x {g} groups x {hd} x {size} bytes "
                    f"({h // g}x smaller than {h} heads would need)" if kept == n * t else
                    f"keys and values: 2 x {kept:,} positions over {n} layers (a sliding layer keeps its window) "
                    f"x {b} x {g} groups x {hd} x {size} bytes",
        "inference": f"weights + RoPE's float32 cos/sin ({rope / 2**20:.0f} MiB) + KV cache + one forward's "
                     f"temporaries (a prompt of {t:,} tokens: one layer's [b, h, t, t] attention, "
                     f"{scores / 2**30:.2f} GiB; pass --seq-len for shorter ones)",
        "gradients": "one float32 gradient per parameter" + (f", and the {name} copy's" if copy else ""),
        "adamw_state": "AdamW's exp_avg and exp_avg_sq: two float32 copies of the parameters",
        "activations": f"kept for backward: ~(4d + 3h*hd + 3g*hd + 4f) per token per block, the [b, h, t, t] "
                       f"attention weights, and the logits ({b} x {t} tokens, no checkpointing)",
        "training": "float32 weights" + (f" and their {name} copy" if copy else "")
                    + " + gradients + AdamW state + activations",
    }
    return {"dtype": name, "batch_size": b, "seq_len": t, "parameters": n_params, "weights": weights,
            "rope_tables": rope, "kv_cache": kv_cache, "inference": inference, "gradients": gradients,
            "adamw_state": adamw_state, "activations": activations, "training": training, "notes": notes}


def family_notes(cfg: FamilyConfig) -> list[str]:
    """What `info` says about the architecture, in a line each."""
    if cfg.family == "gemma3":
        full = cfg.layer_types.count("full_attention")
        return [f"Gemma 3: {cfg.n_heads} query heads of {cfg.head_dim} share {cfg.n_kv_groups} key/value groups",
                f"tok_emb's rows are multiplied by sqrt({cfg.emb_dim}) = {cfg.emb_dim ** 0.5:.2f}",
                f"{cfg.n_layers - full} sliding layers (window {cfg.sliding_window}, RoPE base "
                f"{cfg.rope_local_base:,.0f}) and {full} full layers (RoPE base {cfg.rope_base:,.0f})",
                "four RMSNorms a block, (1 + scale): before and after att, before and after ff; GeGLU",
                "out_head is tok_emb (tied)" if cfg.tie_embeddings else "out_head has its own weights (untied)"]
    name = {"qwen3": "Qwen3", "llama3": "Llama 3"}[cfg.family]
    notes = [f"{name}: {cfg.n_heads} query heads of {cfg.head_dim_value} share {cfg.n_kv_groups} key/value groups "
             f"({cfg.group_size} per group)",
             f"no pos_emb: RoPE (base {cfg.rope_base:,.0f}"
             + (f", Llama 3's frequency scaling x{cfg.rope_freq.factor:g}" if cfg.rope_freq else "")
             + ") turns the queries and keys inside every attention"]
    if cfg.qk_norm:
        notes.append("QK-norm: each query and key head is RMS-normed before RoPE")
    if cfg.moe:
        notes.append(f"mixture of experts: a router picks {cfg.num_experts_per_tok} of {cfg.num_experts} SwiGLU "
                     f"experts (width {cfg.moe_hidden_dim}) for each token, weighted by the softmax of their scores")
    notes.append("out_head is tok_emb (tied)" if cfg.tie_embeddings else "out_head has its own weights (untied)")
    return notes

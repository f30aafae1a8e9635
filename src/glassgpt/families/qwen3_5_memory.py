"""How many parameters and bytes a Qwen3.5 model needs, from its config (families/memory.py's, for its hybrid stack).

The parameter rows are read from one block of each layer type built on the meta device (no weights drawn),
so a row cannot drift from the module. What the cache keeps differs from Qwen3's: the full layers' keys and
values grow with every token (kv_bytes_per_token), the linear layers' states do not (state_bytes).
"""

from __future__ import annotations

from typing import Any

import torch

from .qwen3_5 import Qwen3_5Config, TransformerBlock, cache_bytes, kv_bytes_per_token, state_bytes

NOTES = {"norm1": "RMSNorm (1 + weight)", "token_mixer.W_query": "per head: hd query rows, then hd gate rows",
         "token_mixer.in_proj_qkv": "q, k and v of the linear attention, before the short convolution",
         "token_mixer.conv1d": "the short causal convolution: one filter per channel",
         "token_mixer.in_proj_z": "the output norm's gate", "token_mixer.in_proj_b": "the delta rule's step size",
         "token_mixer.in_proj_a": "the state's decay", "ff.fc1": "SwiGLU's gate: silu(fc1(x))"}


def block_rows(cfg: Qwen3_5Config, layer_type: str, letter: str) -> list[dict[str, Any]]:
    with torch.device("meta"):
        block = TransformerBlock(cfg, layer_type, 0)
    return [{"name": f"trf_blocks.{letter}.{name.removesuffix('.weight')}", "shape": str(list(p.shape)),
             "params": p.numel(), "note": NOTES.get(name.removesuffix(".weight"), "")}
            for name, p in block.named_parameters()]


def qwen3_5_parameter_table(cfg: Qwen3_5Config) -> dict[str, Any]:
    """Per-module parameter counts (a linear block's rows as trf_blocks.L, a full block's as trf_blocks.F)."""
    V, d = cfg.vocab_size, cfg.emb_dim
    rows = [{"name": "tok_emb", "shape": str([V, d]), "params": V * d, "note": "vocab -> hidden (no pos_emb)"}]
    for layer_type, letter in (("linear_attention", "L"), ("full_attention", "F")):
        count = cfg.layer_types.count(layer_type)
        if count:
            block = block_rows(cfg, layer_type, letter)
            per_block = sum(r["params"] for r in block)
            rows += block + [{"name": f"trf_blocks ({count} x {layer_type})", "shape": "", "params": count * per_block,
                              "note": f"{per_block:,} per block"}]
    head_note = "the same tensor as tok_emb.weight, counted once" if cfg.tie_embeddings else "hidden -> vocab"
    rows += [{"name": "final_norm", "shape": str([d]), "params": d, "note": ""},
             {"name": "out_head", "shape": str([V, d]), "params": 0 if cfg.tie_embeddings else V * d,
              "note": head_note}]
    total = sum(r["params"] for r in rows if not r["name"].startswith(("trf_blocks.L.", "trf_blocks.F.")))
    tied = V * d if cfg.tie_embeddings else 0
    return {"modules": rows, "total": total, "total_untied": total + tied, "tied": cfg.tie_embeddings}


def qwen3_5_memory_needs(cfg: Qwen3_5Config, dtype: torch.dtype, batch_size: int = 1,
                         seq_len: int | None = None) -> dict[str, Any]:
    """Bytes for inference: weights, RoPE's tables, the cache (states + KV), one forward's largest temporary."""
    name = str(dtype).removeprefix("torch.")
    size = torch.empty((), dtype=dtype).element_size()
    b, t = batch_size, seq_len or cfg.context_length
    n_params = qwen3_5_parameter_table(cfg)["total"]
    weights = n_params * size
    rope = 2 * cfg.context_length * cfg.rotary_dim * 4
    cache = cache_bytes(cfg, t, b, size)
    scores = 2 * b * cfg.n_heads * t * t * size
    working = max(scores, b * t * (2 * cfg.emb_dim + 4 * cfg.hidden_dim) * size) + b * cfg.vocab_size * 4
    notes = {"weights": f"{n_params:,} parameters x {size} bytes ({name})",
             "kv_cache": f"{state_bytes(cfg, size):,} bytes of linear-attention state per sequence, whatever its "
                         f"length, + {kv_bytes_per_token(cfg, size):,} bytes of keys and values per token "
                         f"({cfg.layer_types.count('full_attention')} full layers)",
             "inference": "weights + RoPE's float32 cos/sin + the cache + one forward's temporaries"}
    copy = n_params * size if size < 4 else 0
    master, gradients, adamw_state = n_params * 4 + copy, n_params * 4 + copy, 2 * n_params * 4
    # An estimate: per token and block the block's widest tensors (norms, q/k/v or the convolution's channels,
    # the feed-forward's four), the full layers' [b, h, t, t] weights, and the logits with their gradient.
    per_token_block = (4 * cfg.emb_dim + 3 * cfg.conv_dim + 4 * cfg.hidden_dim) * size
    activations = b * t * cfg.n_layers * per_token_block + cfg.layer_types.count("full_attention") * scores \
        + 2 * b * t * cfg.vocab_size * size
    notes.update(gradients="one float32 gradient per parameter", adamw_state="AdamW's two float32 moments",
                 activations="an estimate: each block's widest tensors per token, the full layers' attention "
                             "weights and the logits", training="float32 weights + gradients + AdamW + activations")
    return {"dtype": name, "batch_size": b, "seq_len": t, "parameters": n_params, "weights": weights,
            "rope_tables": rope, "kv_cache": cache, "inference": weights + rope + cache + working, "notes": notes,
            "gradients": gradients, "adamw_state": adamw_state, "activations": activations,
            "training": master + gradients + adamw_state + activations}


def qwen3_5_notes(cfg: Qwen3_5Config) -> list[str]:
    """What `info` says about the architecture, in a line each."""
    linear, full = cfg.layer_types.count("linear_attention"), cfg.layer_types.count("full_attention")
    return [f"Qwen3.5: {linear} linear-attention layers (Gated DeltaNet: {cfg.linear_num_value_heads} states of "
            f"[{cfg.linear_key_head_dim}, {cfg.linear_value_head_dim}], a convolution over "
            f"{cfg.linear_conv_kernel_dim} tokens) and {full} full-attention layers",
            f"full attention: {cfg.n_heads} gated query heads of {cfg.head_dim_value} share {cfg.n_kv_groups} "
            f"key/value groups; RoPE (base {cfg.rope_base:,.0f}) on {cfg.rotary_dim} of {cfg.head_dim_value} "
            "dimensions",
            "every RMSNorm scales by (1 + weight)",
            "out_head is tok_emb (tied)" if cfg.tie_embeddings else "out_head has its own weights (untied)"]

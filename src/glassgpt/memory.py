"""How many bytes a GPT-2 needs, from its config alone: weights, KV cache, training state.

    memory_needs(cfg, dtype, batch_size, seq_len) -> {"weights": bytes, "kv_cache": ..., ...}
    parameter_table(cfg) -> the parameters of every module, as `glassgpt info` prints them
    available_memory() -> Free(ram, swap): what this machine has free now (MemAvailable, SwapFree)
    training_fit / inference_fit(cfg, ..., free) -> None, a note (only swap would be touched), or a
        ConfigError with the figure and the nearest settings that fit: what the commands check first
    with_margin(need) -> what a run of that estimate is let have: need x 1.2 + 512 MiB (MARGIN)

One estimate (memory_needs) and one comparison (fits: the estimate with its margin against
MemAvailable) serve every command: `info` prints both, generate, explain and serve refuse a model
and sequence that would not fit before anything is allocated (inference_fit), train and finetune a
run (training_fit), and formats.check_buildable refuses, for any caller of the library, weights
that would not fit even in swap. GLASSGPT_MEMORY_AVAILABLE (bytes, or a size such as 22.2GiB)
stands for MemAvailable, with no swap, where it is set: for tests and fault drills.

A back-of-the-envelope count that follows what the forward pass keeps (model.py) and
what AdamW stores, so it tells a reader whether gpt2-xl fits before they load it.
tests/test_memory.py holds it to within 20% of the peak that PyTorch's allocator
records for a real generation and real training steps on a CPU; the process needs some
more for the allocator's own slack. Training counts the activations that backward
needs when attention runs through a fused kernel (SDPA keeps q, k, v and its output,
never the [t, t] scores) and no activation checkpointing.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, replace
from typing import Any

import torch

from .config import GPTConfig
from .engine.attention import ATTENTION_BLOCK
from .errors import ConfigError, GlassError
from .families import BONUS_CONFIGS, BONUS_MODELS, FAMILY_CONFIGS, build_model
from .families.memory import family_memory_needs, family_parameter_table

INT8 = "int8"  # weight-only int8 (engine/int8.py): Linear weights 1 byte, the rest bfloat16
INT4 = "int4"  # 4-bit groups (engine/int4.py): Linear weights half a byte + a scale and a minimum per group
QUANTIZED = (INT8, INT4)


@dataclass(frozen=True)
class ModuleShape:
    """One module's parameters, from the config: its weight's shape and its bias's length."""
    name: str
    weight: tuple[int, ...]
    bias: int
    kind: str  # "embedding", "norm" (weight and bias) or "linear"
    note: str = ""
    tied: bool = False  # the weight is another module's tensor, counted there

    @property
    def weight_params(self) -> int:
        return 0 if self.tied else math.prod(self.weight)

    @property
    def params(self) -> int:
        return self.weight_params + self.bias


def block_modules(cfg: GPTConfig) -> list[ModuleShape]:
    """The modules of one TransformerBlock (model.py), in order."""
    d = cfg.emb_dim
    qkv_bias = d if cfg.qkv_bias else 0
    return [ModuleShape("norm1", (d,), d, "norm"),
            ModuleShape("att.W_query", (d, d), qkv_bias, "linear"),
            ModuleShape("att.W_key", (d, d), qkv_bias, "linear"),
            ModuleShape("att.W_value", (d, d), qkv_bias, "linear"),
            ModuleShape("att.out_proj", (d, d), d, "linear"),
            ModuleShape("norm2", (d,), d, "norm"),
            ModuleShape("ff.layers.0", (4 * d, d), 4 * d, "linear"),   # d -> 4d
            ModuleShape("ff.layers.2", (d, 4 * d), d, "linear")]       # 4d -> d


def model_modules(cfg: GPTConfig) -> tuple[list[ModuleShape], list[ModuleShape], list[ModuleShape]]:
    """(before the blocks, one block, after the blocks), as model.py builds them."""
    d = cfg.emb_dim
    if cfg.num_classes is not None:
        head = ModuleShape("out_head", (cfg.out_dim, d), cfg.out_dim, "linear", "hidden -> classes")
    elif cfg.tie_embeddings:  # GPT-2's choice: the head *is* tok_emb
        head = ModuleShape("out_head", (cfg.out_dim, d), 0, "linear",
                      "hidden -> vocab: the same tensor as tok_emb.weight, counted once", tied=True)
    else:
        head = ModuleShape("out_head", (cfg.out_dim, d), 0, "linear", "hidden -> vocab")
    return ([ModuleShape("tok_emb", (cfg.vocab_size, d), 0, "embedding", "vocab -> hidden"),
             ModuleShape("pos_emb", (cfg.context_length, d), 0, "embedding", "one row per position")],
            block_modules(cfg),
            [ModuleShape("final_norm", (d,), d, "norm"), head])


def parameter_table(cfg: GPTConfig) -> dict[str, Any]:
    """Per-module parameter counts and the totals with and without weight tying, from the
    config alone (no weights are built): what `glassgpt info` and `explain` print."""
    if isinstance(cfg, FAMILY_CONFIGS):  # Qwen3, Llama 3.2, Gemma 3 (families/memory.py)
        return family_parameter_table(cfg)
    if getattr(cfg, "family", None) in BONUS_MODELS:
        return bonus_parameter_table(cfg)
    before, block, after = model_modules(cfg)
    per_block = sum(m.params for m in block)
    total = sum(m.params for m in before + after) + cfg.n_layers * per_block
    tied = sum(math.prod(m.weight) for m in after if m.tied)
    rows = [_row(m.name, m) for m in before] + [_row(f"trf_blocks.N.{m.name}", m, "in each block") for m in block]
    rows.append({"name": f"trf_blocks (x{cfg.n_layers})", "shape": "", "params": cfg.n_layers * per_block,
                 "note": f"{per_block:,} per block"})
    rows += [_row(m.name, m) for m in after]
    return {"modules": rows, "total": total, "total_untied": total + tied, "tied": tied > 0}


def bonus_parameter_table(cfg) -> dict[str, Any]:
    """A bonus model's (OLMo 3, Tiny Aya) parameters by top-level part, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = build_model(cfg)
    rows = [{"name": name, "shape": "", "params": sum(p.numel() for p in part.parameters()), "note": ""}
            for name, part in model.named_children()]
    total = sum(p.numel() for p in model.parameters())  # a tied head counted once
    untied = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    return {"modules": rows, "total": total, "total_untied": untied, "tied": untied > total}


def bonus_memory_needs(cfg, dtype: torch.dtype | str, batch_size: int = 1, seq_len: int | None = None) -> dict[str, Any]:
    """A bonus model's inference bytes: weights, the KV cache (a sliding layer keeps its window: min(window, t)
    positions), RoPE's float32 tables, and one layer's [b, h, t, s] scores with the last position's logits.
    Training them is not covered: its fields count the float32 weights, gradients and AdamW state alone."""
    name, size = _dtype_size(dtype)
    if name in QUANTIZED:
        raise GlassError(f"{name} weights are GPT-2's (engine/): use float32 or bfloat16 for a {cfg.family} model")
    b, t = batch_size, seq_len or cfg.context_length
    n_params = bonus_parameter_table(cfg)["total"]
    # (g, hd) of every layer, or per layer: Gemma 4's full layers have wider heads, its kv-shared layers keep none
    per_layer = cfg.kv_heads if isinstance(cfg.kv_heads, list) else [cfg.kv_heads] * cfg.n_layers
    kv_cache = sum(2 * b * (t if w is None else min(w, t)) * kv[0] * kv[1] * size
                   for w, kv in zip(cfg.windows, per_layer) if kv is not None)
    sizes = sorted({kv for kv in per_layer if kv is not None})
    rope = sum(2 * 2 * cfg.context_length * hd * 4 for hd in {hd for _, hd in sizes})  # a table per head size
    working = 2 * b * cfg.n_heads * t * t * size + b * cfg.vocab_size * 4
    weights = n_params * size
    inference = weights + rope + kv_cache + working
    gradients, adamw_state = n_params * 4, 2 * n_params * 4
    notes = {"weights": f"{n_params:,} parameters x {size} bytes ({name})",
             "kv_cache": f"keys and values of {' or '.join(f'{g} groups x {hd}' for g, hd in sizes)}: every position "
                         f"in the full layers, the last {cfg.sliding_window:,} in the sliding ones"
                         + (f", none in the {per_layer.count(None)} kv-shared layers" if None in per_layer else ""),
             "inference": "weights + RoPE's float32 cos/sin + KV cache + one layer's [b, h, t, t] attention and the "
                          "last position's float32 logits",
             "gradients": "one float32 gradient per parameter", "adamw_state": "AdamW's two float32 moments",
             "activations": "not counted: training these models is not covered",
             "training": "float32 weights + gradients + AdamW state (activations not counted)"}
    return {"dtype": name, "batch_size": b, "seq_len": t, "parameters": n_params, "weights": weights,
            "rope_tables": rope, "kv_cache": kv_cache, "inference": inference, "gradients": gradients,
            "adamw_state": adamw_state, "activations": 0, "training": n_params * 4 + gradients + adamw_state,
            "notes": notes}


def bonus_notes(cfg) -> list[str]:
    """What `info` says about a bonus model's architecture, a line each, read from its description."""
    from .kinds import GLASS
    anatomy = GLASS[cfg.family](cfg)
    att = anatomy.blocks[0].attention
    kinds = [b.layer_type for b in anatomy.blocks]
    rope = {b.attention.rope.scaling or "plain" for b in anatomy.blocks if b.attention.rope is not None}
    unrotated = sum(b.attention.rope is None for b in anatomy.blocks)
    return [f"{anatomy.name}: {att.n_heads} query heads of {att.head_dim} share {att.n_kv_groups} key/value groups",
            f"{kinds.count('sliding_attention')} sliding layers (window {cfg.sliding_window:,}), "
            f"{kinds.count('full_attention')} full; norms placed {anatomy.blocks[0].placement}",
            f"RoPE ({', '.join(sorted(rope))}, base {cfg.rope_base:,.0f})"
            + (f"; {unrotated} layers without any position signal" if unrotated else " in every layer"),
            "out_head is tok_emb (tied)" if cfg.tie_word_embeddings else "out_head has its own weights (untied)"]


def _row(name: str, module: ModuleShape, note: str | None = None) -> dict[str, Any]:
    return {"name": name, "shape": str(list(module.weight)), "params": module.params,
            "note": module.note if note is None else note}


def parameter_counts(cfg: GPTConfig) -> dict[str, int]:
    """Parameters by kind: `linear` (the matrices of the blocks and the head), `other` (the rest)."""
    before, block, after = model_modules(cfg)
    def linear(modules: list[ModuleShape]) -> int:
        return sum(m.weight_params for m in modules if m.kind == "linear")
    def total(modules: list[ModuleShape]) -> int:
        return sum(m.params for m in modules)
    n_linear = cfg.n_layers * linear(block) + linear(after)
    return {
        "linear": n_linear,
        "other": total(before) + cfg.n_layers * total(block) + total(after) - n_linear,
        "head_rows": cfg.out_dim,  # the int8 head needs its own copy when tied
    }


def memory_needs(cfg: GPTConfig, dtype: torch.dtype | str = torch.float32, batch_size: int = 1,
                 seq_len: int | None = None, prompt_attention: str = "sdpa") -> dict[str, Any]:
    """Bytes for inference (weights + KV cache + working buffers) and for training as
    `glassgpt train --dtype DTYPE` runs it (float32 master weights, their gradients and
    AdamW's two moments, plus, below float32, the engine's low-precision copy of the weights
    and its gradients; saved activations), for `batch_size` sequences of `seq_len` tokens
    (default: context_length). `dtype` is the weights' dtype for inference and the compute
    dtype for training (a torch dtype, its name, or "int8"/"int4" for quantized decoding).
    `prompt_attention`: the engine's path for long prompts on a CPU ("sdpa" or "blocks", as
    engine/autotune.py chose it)."""
    if isinstance(cfg, FAMILY_CONFIGS):  # Qwen3, Llama 3.2, Gemma 3 (families/memory.py)
        name, _ = _dtype_size(dtype)
        if name in QUANTIZED:
            raise GlassError(f"{name} weights are GPT-2's (engine/): use float32 or bfloat16 for a {cfg.family} model")
        return family_memory_needs(cfg, getattr(torch, name), batch_size, seq_len)
    if getattr(cfg, "family", None) in BONUS_MODELS:
        return bonus_memory_needs(cfg, dtype, batch_size, seq_len)
    seq_len = seq_len or cfg.context_length
    b, t, d, n = batch_size, seq_len, cfg.emb_dim, cfg.n_layers
    counts = parameter_counts(cfg)
    n_params = counts["linear"] + counts["other"]
    name, size = _dtype_size(dtype)
    act = 2 if name in QUANTIZED else size  # int8 and int4 run their activations in bfloat16

    d_head = cfg.out_dim * d if cfg.tie_embeddings else 0  # a tied head gets a quantized copy of its own
    if name == INT8:
        scale_rows = n * (3 * d + d + 4 * d + d) + cfg.out_dim
        weights = counts["linear"] + d_head + 2 * scale_rows + 2 * counts["other"]
    elif name == INT4:
        weights = _int4_bytes(cfg) + 2 * counts["other"]
    else:
        weights = n_params * size
    kv_cache = 2 * n * b * t * d * act
    # A forward's transient peak is in the feed-forward: the residual stream, norm2's output,
    # the [b, t, 4d] hidden before and after GELU, and the block's output (11 x d per token),
    # then the last position's float32 logits. A prompt of ATTENTION_BLOCK+ tokens that the
    # engine attends a block of queries at a time (engine/attention.py): add one block's
    # float32 scores and their float32 softmax.
    working = b * t * 11 * d * act + b * cfg.out_dim * 4
    if prompt_attention == "blocks" and t >= ATTENTION_BLOCK:
        working += b * cfg.n_heads * ATTENTION_BLOCK * t * (4 + 4)
    inference = weights + kv_cache + working

    # train.py keeps the weights, their gradients and AdamW's state in float32; below float32
    # forward and backward run on a copy of the weights in `dtype` (engine/mixed.py), whose
    # gradients exist beside the master's while they are widened into them.
    copy = n_params * size if size < 4 else 0
    master = n_params * 4 + copy
    gradients = n_params * 4 + copy
    adamw_state = 2 * n_params * 4  # exp_avg and exp_avg_sq, float32
    # Saved for backward, per token and block: norm1 in/out, q, k, v, attention out,
    # its [b, t, d] reshape, norm2 in/out (9d), ff hidden before and after GELU (8d),
    # plus the dropout masks when drop_rate > 0 (1 byte each, 3 of width d).
    per_token_block = 17 * d * act + (3 * d if cfg.drop_rate > 0 else 0)
    # The head: final_norm's output, the logits, and their gradient (engine/loss.py never widens all
    # of them to float32: it works a few rows at a time and writes the gradient in their dtype).
    head_acts = b * t * (2 * d * act + 2 * cfg.out_dim * act)
    activations = b * t * n * per_token_block + b * t * d * act + head_acts
    quantized = name in QUANTIZED
    training = master + gradients + adamw_state + activations if not quantized else 0

    notes = {
        "weights": f"{n_params:,} parameters" + (f" ({name} Linear weights + bfloat16 rest)" if quantized
                                                  else f" x {size} bytes ({name})"),
        "kv_cache": f"keys and values: 2 x {n} layers x {b} x {t} tokens x {d} x {act} bytes",
        "inference": "weights + KV cache + one forward's temporaries (11 x d per token, last logits)",
        "gradients": "one float32 gradient per parameter" + (f", and the {name} copy's while it is widened"
                                                            if copy else ""),
        "adamw_state": "AdamW's exp_avg and exp_avg_sq: two float32 copies of the parameters",
        "activations": f"kept for backward: ~17 x d per token per block, plus the [b, t, V] logits "
                       f"and their gradient ({b} x {t} tokens, SDPA, no checkpointing)",
        "training": ("float32 weights" + (f" and their {name} copy" if copy else "")
                     + " + gradients + AdamW state + activations") if not quantized
                    else f"{name} is for inference only",
    }
    return {"dtype": name, "batch_size": b, "seq_len": t, "parameters": n_params,
            "weights": weights, "kv_cache": kv_cache, "inference": inference,
            "gradients": gradients if not quantized else 0, "adamw_state": adamw_state if not quantized else 0,
            "activations": activations if not quantized else 0, "training": training, "notes": notes}


def _int4_bytes(cfg: GPTConfig) -> int:
    """What engine/int4.py stores for every Linear's weight (the head's too): rows padded to blocks of 16,
    half a byte per weight, a bfloat16 scale and minimum per row and group of GROUP_SIZE columns."""
    from .engine.int4 import GROUP_SIZE
    d = cfg.emb_dim
    total = 0
    for out, inp in [(d, d)] * 4 * cfg.n_layers + [(4 * d, d), (d, 4 * d)] * cfg.n_layers + [(cfg.out_dim, d)]:
        rows = -(-out // 16) * 16
        total += rows * inp // 2 + rows * (inp // GROUP_SIZE) * 2 * 2
    return total


def _dtype_size(dtype: torch.dtype | str) -> tuple[str, int]:
    if isinstance(dtype, str):
        if dtype in QUANTIZED:
            return dtype, 1
        from .device import DTYPES
        from .errors import GlassError
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
        quantized = () if isinstance(cfg, FAMILY_CONFIGS + BONUS_CONFIGS) else (INT8, INT4)  # the engine's, GPT-2's only
        smaller = [d for d in ("bfloat16",) + quantized if d != name
                   and fits(inference_need(cfg, d, tokens), free) and _dtype_size(d)[1] <= _dtype_size(dtype)[1]]
        nearest = f"--dtype {smaller[0]} fits" if smaller else "a smaller model"
    parameters = memory_needs(cfg, dtype, 1, 1)["parameters"]
    what = (f"running a model of n_layers {cfg.n_layers:,}, emb_dim {cfg.emb_dim:,} ({parameters:,} parameters) in "
            f"{_dtype_size(dtype)[0]} on "
            f"{tokens:,} tokens (weights, KV cache and {TOKEN_BYTES} bytes per token kept)")
    return fit_note(need, free, what, nearest)

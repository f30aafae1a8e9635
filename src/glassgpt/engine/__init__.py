"""The fast engine: the glass model's own weights, run the quick way.

`glassgpt.model` is GPT-2 as the book writes it and nothing else. Everything here only
makes the same computation faster, and tests/test_engine.py proves each piece equal to
the glass model (the same greedy tokens in float32; stated tolerances in bfloat16/int8):

    fused.py      the glass model's LayerNorm, GELU and attention as fused kernels, on a twin
                  that shares the model's weights
    cache.py      the KV cache: keys and values of earlier tokens, written in place
    decode.py     Engine(model): the glass model's forward on the fused twin, with the cache
                  and the head on the last position; the decoding seam (prefill, prepare, decode_one,
                  decode_n) that generate.py calls; compile_for_generation (torch.compile);
                  TwinSteps, the same seam for Qwen3 and Llama 3: the glass model's twin with the
                  gemv kernel where it won, or the native step
    step.py       the native decoding step: one C++ call per new token for the whole model, its plan
                  read from the model's description (kernels/step.cpp for GPT-2's, family_step.cpp
                  for RoPE, RMSNorm and SwiGLU: Qwen3, Llama 3), over the model's own tensors
    graphs.py     on a GPU, the decoding step recorded once as a CUDA graph and replayed per token
    attention.py  the causal attention over cached keys: SDPA, or written out in blocks
                  of queries where that measured faster on a CPU
    linear.py     a Linear whose product at a few rows runs glassgpt's matrix-vector kernel
    int8.py       int8 weight-only Linear layers for CPU decoding
    int4.py       4-bit group-wise Linear layers for CPU decoding
    native.py     glassgpt's C++ kernels (kernels/gemv.cpp, step.cpp, ops.cpp): built once per machine
                  with the system's g++, loaded as torch operators; PyTorch's where they cannot be
    autotune.py   which kernel, attention path and decoding step run here: timed once for the
                  model's shapes, the choice kept per CPU
    compiling.py  torch.compile for one command: inductor's caches under glassgpt's cache root, and
                  whether compiling pays for a generation's length, from what it cost and saved here
    advice.py     the dtype and flags to use on this CPU, in words, from autotune's records (`info`)
    loss.py       cross-entropy a few rows at a time (no float32 copy of the logits)
    mixed.py      bfloat16 training with a float32 master copy (no casts per activation)

generate.py runs every cached generation of GPT-2 through `Engine`, of Qwen3 and Llama 3 through
decode.py's TwinSteps; training uses `loss.py` and
`mixed.py`.
model.py imports nothing from here: `GPTModel` alone is a complete, correct GPT-2 that
trains, and `generate(..., use_cache=False)` runs the book's loop on it.
"""

from .cache import KVCache
from .decode import Engine, as_engine, compile_for_generation
from .fused import fused, is_fused
from .int4 import Int4Linear, is_int4, quantize_int4
from .int8 import Int8Linear, is_quantized, quantize_int8
from .loss import cross_entropy
from .mixed import LowPrecisionCopy

__all__ = ["Engine", "KVCache", "fused", "is_fused", "as_engine", "compile_for_generation", "Int8Linear", "is_quantized",
           "quantize_int8", "Int4Linear", "is_int4", "quantize_int4", "cross_entropy", "LowPrecisionCopy"]

"""Int8 weight-only quantization, for decoding on a CPU.

Generating one token at a time reads every weight once per token and does little
arithmetic with it, so its speed is set by the bytes of weights read: float32 reads
4 bytes per parameter, bfloat16 2, int8 1. Here every `nn.Linear` of the blocks and
the output head keeps its weight as int8 with one scale per output row
(symmetric, per channel: `w ~ w_int8 * scale`), and multiplies with PyTorch's own
int8 weight-only kernel (`torch._weight_int8pack_mm`, the one gpt-fast and torchao
use), or glassgpt's own (`torch.ops.glassgpt.gemv_q8`, kernels/gemv.cpp: the activations
rounded to int16, int16 x int8 products summed in int32) where autotune.py measured it
faster; compiled at batch 1 without glassgpt's kernel, the products are written out so that
inductor fuses them (see `Int8Linear.forward`). Activations stay bfloat16. Embeddings and LayerNorms are left as they are:
a lookup reads one row per token, not the matrix.

The module names (`att.W_query`, `ff.layers.0`, `out_head`, ...) do not change, so
hooks and the explain view see the same model; the state_dict does change (int8
`weight` plus `scales`), so a quantized model is for running, not for saving.
Quality cost: see `benchmarks/RESULTS.md` (perplexity before and after) and
`tests/test_engine.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..model import GPTModel
from .linear import QUANTIZED_GEMV_MAX_ROWS, needs_grad, replace_linears

# Above this many rows the int8 kernel (a matrix-vector product at heart) loses to
# dequantizing the weight once and running a bfloat16 matmul (measured on an
# AVX-512 CPU: int8 wins at 1-16 rows, bfloat16 at 64 and more). Off the CPU the
# weight is always dequantized: this mode is for CPU decoding.
INT8_KERNEL_MAX_ROWS = 16


class Int8Linear(nn.Module):
    """`y = x @ (w_int8 * scale).T + bias`, holding only the int8 weight and the scales."""

    gemv = None  # glassgpt's kernel, where autotune.py chose it for this layer

    def __init__(self, linear: nn.Linear, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        w = linear.weight.detach()
        amax = w.abs().amax(dim=1).float().clamp(min=1e-12)  # one scale per output row
        scales = (amax / 127.0).to(dtype)
        # Quantize with the scale as stored (rounded to `dtype`), rounded up where needed so
        # that the row's largest weight still fits in 127 steps: every weight is then within
        # half a step of its int8 value.
        scales = torch.where(scales.float() * 127.0 < amax, torch.nextafter(scales, scales.new_tensor(float("inf"))), scales)
        q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        for i in range(0, w.shape[0], 2048):  # in slices: no float32 copy of a whole matrix
            q[i:i + 2048] = torch.round(w[i:i + 2048].float() / scales[i:i + 2048].float()[:, None]).clamp(-127, 127)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)  # the kernels take [rows, in] only
        # glassgpt's kernel and torch._weight_int8pack_mm: a CPU, x in the scales' dtype, and no gradient asked
        # (neither has a backward)
        packed = x2.dtype == self.scales.dtype and x2.device.type == "cpu" and not needs_grad(x, self.bias)
        if self.gemv is not None and x2.shape[0] <= QUANTIZED_GEMV_MAX_ROWS and packed:
            y = self.gemv(x2.contiguous(), self.weight, self.scales, self.bias)
        elif x2.shape[0] == 1 and torch.compiler.is_compiling():
            # One row under torch.compile (batch-1 decoding): written as the dot products it
            # is, inductor emits one fused loop that reads each int8 weight once, widens it in
            # registers and accumulates in float32: ~20 GB/s of weights on the benchmark CPU,
            # against ~14 for the int8 kernel. (compile_for_generation turns off freezing for
            # int8 models, which would fold `weight.float()` into a float32 copy.)
            y = (x2.float()[:, None, :] * self.weight.float()).sum(-1) * self.scales.float()
            if self.bias is not None:
                y = y + self.bias.float()
            y = y.to(x.dtype)
        elif x2.shape[0] <= INT8_KERNEL_MAX_ROWS and packed:
            y = torch._weight_int8pack_mm(x2.contiguous(), self.weight, self.scales)
            if self.bias is not None:
                y = y + self.bias
        else:
            w = self.weight.to(x.dtype) * self.scales.to(x.dtype)[:, None]
            y = F.linear(x2, w, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weight-only"


def quantize_int8(model: GPTModel, dtype: torch.dtype = torch.bfloat16) -> GPTModel:
    """Swap every Linear of the blocks and the output head for an `Int8Linear`, in place.

    The rest of the model (embeddings, LayerNorms, the KV cache) runs in `dtype`. Returns the
    same model, in eval mode. The tied output head gets its own int8 copy of `tok_emb.weight`
    (a quarter of its float32 size); `tok_emb` stays as is.
    """
    return replace_linears(model, dtype, lambda linear: Int8Linear(linear, dtype))


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, Int8Linear) for m in model.modules())

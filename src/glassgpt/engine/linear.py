"""A Linear layer whose matrix-vector product at decoding runs glassgpt's own kernel.

    GemvLinear: nn.Linear with the same weight and bias; `y = x @ W.T + b`

Decoding feeds one token per sequence, so each Linear multiplies a few rows by its whole
weight: the step's time is the time to read the weights. PyTorch's matmul for that shape
(MKL or oneDNN) streamed float32 weights at a third of the memory's bandwidth on one
benchmark CPU (an AMD EPYC) and bfloat16 ones at half of float32's speed on another (a Xeon
without AMX): the gemv kernel (kernels/gemv.cpp) reads them at the bandwidth on both
(benchmarks/RESULTS.md). On a CPU without AVX-512 the kernel is its AVX2 build (kernels/gemv_avx2.cpp,
native.gemv_ops), where MKL's float32 product used one of two cores. Which one runs is measured once per machine (autotune.py), which
sets `gemv` on each layer to the kernel (`torch.ops.glassgpt.gemv`) where it won, else None.

Only the product changes: the kernel runs for up to `GEMV_MAX_ROWS` rows of float32 or
bfloat16 on a CPU when no gradient is needed (up to autotune.PROMPT_ROWS, a short prompt,
where it measured the kernel faster at that many rows), and F.linear runs otherwise (training,
long prompts, GPUs). The fused twin (fused.py) swaps each nn.Linear for this subclass; the glass
model keeps its own. tests/test_engine.py checks it equal to F.linear.
"""

from __future__ import annotations

import ctypes
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

# Rows up to which the gemv kernel beats a matmul (it reads the weight once per 4 rows of x;
# past a dozen rows, oneDNN's blocked matmul, on AMX where there is one, is faster).
GEMV_MAX_ROWS = 8
# For int8 and int4 weights the alternative is to dequantize the whole weight first, so the
# kernel wins up to a longer prompt (a 16-token prompt dequantized every weight of gpt2 in
# PyTorch: several ms per generated token of a 64-token reply).
QUANTIZED_GEMV_MAX_ROWS = 32


def rows(x: torch.Tensor) -> int:
    """The number of vectors in `x` `[..., in]` (b x t for activations `[b, t, in]`)."""
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def needs_grad(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or any(p is not None and p.requires_grad for p in params))


def is_plain(m: nn.Module) -> bool:
    """An nn.Linear computing x W^T + b and nothing else: nn.Linear itself or the fused twin's GemvLinear
    (not a LoRA layer or another subclass), which the native steps may read by its weight alone."""
    return type(m) in (nn.Linear, GemvLinear)


class GemvLinear(nn.Linear):
    gemv = None  # the kernel, where autotune.py chose it for this layer; None: F.linear
    max_rows = GEMV_MAX_ROWS  # the most rows the kernel takes (autotune.py raises it where it measured a gain)
    pad_to = 64  # on a GPU, in training: outputs padded to a multiple of this (`padded_linear`); None: never

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., in] -> [..., out]` in x's dtype."""
        if (self.gemv is not None and x.device.type == "cpu" and x.dtype == self.weight.dtype
                and rows(x) <= self.max_rows and not needs_grad(x, self.weight, self.bias)):
            y = self.gemv(x.reshape(-1, self.in_features).contiguous(), self.weight, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        if (self.pad_to and x.device.type == "cuda" and self.out_features % self.pad_to
                and self.out_features >= PAD_MIN_OUT and needs_grad(x, self.weight, self.bias)):
            return padded_linear(x, self.weight, self.bias, self.pad_to)
        return F.linear(x, self.weight, self.bias)


PAD_MIN_OUT = 4096  # only the wide layers, GPT-2's 50,257-wide head: padding a narrow one saves nothing


def padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, multiple: int) -> torch.Tensor:
    """F.linear(x, weight, bias) computed with the output width rounded up to `multiple`, the extra outputs
    (zero rows of the weight) sliced off. The same products, each output one dot product as before; what
    changes is the layout: 50,257 bfloat16 outputs a row is not a whole number of 16-byte vectors, and the GPU's
    matrix kernels for that width ran slower than for 50,304 (benchmarks/RESULTS.md). Costs a copy of the
    weight per call, so it runs in training only, where the product is over thousands of rows."""
    out = weight.shape[0]
    pad = -out % multiple
    y = F.linear(x, F.pad(weight, (0, 0, 0, pad)), None if bias is None else F.pad(bias, (0, pad)))
    return y[..., :out]


def replace_linears(model: nn.Module, dtype: torch.dtype, make: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """Swap every nn.Linear of `model` for `make(linear)`, in place, the rest cast to `dtype`; eval mode.

    For the quantized layers (int8.py, int4.py), which keep only their own copy of each weight."""
    model.to(dtype)
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, make(child))
    release_freed_memory()
    return model.eval()


def release_freed_memory() -> None:
    """Give the freed float weights back to the OS: glibc keeps freed heap pages, so without
    this a gpt2 process stays ~170 MB (gpt2-xl ~2 GB) larger than its int8 weights need."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, Windows, musl): nothing to do
        pass

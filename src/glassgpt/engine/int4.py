"""4-bit weights in groups, for decoding on a CPU: an eighth of float32's bytes per token.

Each weight row is cut into groups of `group_size` columns (32 by default), and each group
keeps 16 levels between its smallest and largest weight: `w ~ q * scale + min`, q in 0..15,
one bfloat16 scale and minimum per row and group (asymmetric, like llama.cpp's q4_1; 5 bits
per weight with the scales at groups of 32). Every `nn.Linear` of the blocks and the output
head becomes an `Int4Linear`; embeddings and LayerNorms stay bfloat16, as for int8 (int8.py).

Storage is the layout the kernel reads (kernels/gemv.cpp, `q4`): rows in blocks of 16 and,
per block, 64-byte units that hold 8 columns of all 16 rows, two per byte:

    packed       [ceil(N / 16), K / 8, 64] uint8: unit u, byte 4j + i -> row j, columns
                 8u + i (low nibble) and 8u + 4 + i (high nibble)
    scales_mins  [ceil(N / 16), K / group_size, 2, 16]: per block and group, the 16 rows'
                 scales, then their minimums

Decoding multiplies with the kernel (`torch.ops.glassgpt.gemv_q4`, where autotune.py chose
it), which rounds the activations to int8 per group, as llama.cpp's q4_0 x q8_0 product does;
so do prompts, at any length where autotune measured the kernel faster than the PyTorch path at
512 rows (`max_rows`; on the AMD EPYC 1.75-6.3x). Elsewhere longer inputs, and machines
without the kernel, dequantize the weight and run F.linear (`Int4Linear.dequantized`: the
pure-PyTorch path, which tests/test_engine.py checks against the kernel). Quality: perplexity
before and after in benchmarks/RESULTS.md and tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import GPTConfig
from ..errors import ConfigError
from ..model import GPTModel
from .linear import QUANTIZED_GEMV_MAX_ROWS, needs_grad, replace_linears, rows

GROUP_SIZE = 32
GROUP_SIZES = (16, 32, 64, 128, 256)  # what the kernel takes: multiples of 8 that divide the width


def quantize_groups(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`w` `[N, K]` -> (q `[N, K]` uint8 in 0..15, scale `[N, K/g]`, min `[N, K/g]`), both float32."""
    n, k = w.shape
    groups = w.float().view(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = ((groups - lo[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    return q.view(n, k), scale, lo


def pack(q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype):
    """(packed, scales_mins) in the kernel's layout (module docstring), rows padded to a multiple of 16."""
    n, k = q.shape
    nb, g = (n + 15) // 16, scale.shape[1]
    padded = q.new_zeros(nb * 16, k)
    padded[:n] = q
    v = padded.view(nb, 16, k // 8, 2, 4)  # [block, row j, unit u, low/high nibble, i]
    packed = (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).permute(0, 2, 1, 3).reshape(nb, k // 8, 64)
    sm = scale.new_zeros(nb * 16, 2, g)
    sm[:n, 0], sm[:n, 1] = scale, mins
    scales_mins = sm.view(nb, 16, 2, g).permute(0, 3, 2, 1).contiguous().to(dtype)  # [block, group, 2, 16]
    return packed.contiguous(), scales_mins


def unpack(packed: torch.Tensor, scales_mins: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack`'s inverse: (q `[n, K]`, scale `[n, K/g]`, min `[n, K/g]`)."""
    nb, units, _ = packed.shape
    v = packed.view(nb, units, 16, 4).permute(0, 2, 1, 3)  # [block, row j, unit u, i]
    q = torch.stack([v & 15, v >> 4], dim=3).reshape(nb * 16, units * 8)  # [block * 16, u * 8 + half * 4 + i]
    sm = scales_mins.permute(0, 3, 2, 1).reshape(nb * 16, 2, -1)  # [rows, scale/min, group]
    return q[:n], sm[:n, 0], sm[:n, 1]


class Int4Linear(nn.Module):
    """`y = x @ W.T + bias` with W held as 4-bit groups (module docstring)."""

    gemv = None  # the kernel, where autotune.py chose it for this layer; None: dequantize, F.linear
    max_rows = QUANTIZED_GEMV_MAX_ROWS  # the most rows the kernel takes (autotune.py lifts it where it measured a gain)

    def __init__(self, linear: nn.Linear, group_size: int = GROUP_SIZE, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features, self.group_size = linear.in_features, linear.out_features, group_size
        q, scale, mins = quantize_groups(linear.weight.detach(), group_size)
        packed, scales_mins = pack(q, scale, mins, dtype)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_mins", scales_mins)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight `[out, in]` as the kernel sees it: q * scale + min, in `dtype`."""
        q, scale, mins = unpack(self.packed, self.scales_mins, self.out_features)
        g = self.group_size
        w = q.view(self.out_features, -1, g).to(dtype) * scale[..., None].to(dtype) + mins[..., None].to(dtype)
        return w.view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., in] -> [..., out]` in x's dtype."""
        x2 = x.reshape(-1, self.in_features)
        if (self.gemv is not None and x.device.type == "cpu" and x.dtype == self.scales_mins.dtype
                and rows(x) <= self.max_rows and not needs_grad(x, self.bias)):  # (the kernel has no backward)
            y = self.gemv(x2.contiguous(), self.packed, self.scales_mins, self.bias, self.out_features, self.group_size)
        else:
            y = F.linear(x2, self.dequantized(x.dtype), self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"4-bit weight in groups of {self.group_size}")


def check_group_size(cfg: GPTConfig, group_size: int = GROUP_SIZE) -> None:
    """Refuse a model whose Linear layers' widths (emb_dim, 4 x emb_dim) are not whole groups, naming the sizes that would be."""
    d = cfg.emb_dim
    widths = [d, 4 * d]
    bad = [w for w in widths if w % group_size]
    if group_size not in GROUP_SIZES or bad:
        fits = [g for g in GROUP_SIZES if all(w % g == 0 for w in widths)]
        near = sorted({e for e in (d - d % group_size, d - d % group_size + group_size) if e > 0})
        raise ConfigError(
            f"--dtype int4 cuts each weight row into groups of {group_size} columns, but this model's layers are "
            f"{', '.join(map(str, bad or widths))} wide: it needs an emb_dim that is a multiple of {group_size} "
            f"(such as {' or '.join(map(str, near))}, not {d})"
            + (f", or a group size of {' or '.join(map(str, fits))}" if fits else ""))


def quantize_int4(model: GPTModel, group_size: int = GROUP_SIZE, dtype: torch.dtype = torch.bfloat16) -> GPTModel:
    """Swap every Linear of the blocks and the output head for an `Int4Linear`, in place.

    The rest of the model (embeddings, LayerNorms, the KV cache) runs in `dtype`. Returns the
    same model, in eval mode; the tied head gets its own 4-bit copy of `tok_emb.weight`.
    """
    check_group_size(model.cfg, group_size)
    return replace_linears(model, dtype, lambda linear: Int4Linear(linear, group_size, dtype))


def is_int4(model: nn.Module) -> bool:
    return any(isinstance(m, Int4Linear) for m in model.modules())

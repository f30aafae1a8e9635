"""Where the model runs and in what precision: `--device` and `--dtype` resolved once.

`auto` picks CUDA when present, and bfloat16 where the hardware runs it natively
(CUDA GPUs with bf16 support, CPUs with AVX512-BF16 or AMX); float32 elsewhere.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from .errors import GlassError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise GlassError(f"unknown device {device!r}: use cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise GlassError("--device cuda was asked for but no CUDA GPU is available: use --device cpu")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if bf16_is_fast(device) else torch.float32
    if dtype not in DTYPES:
        raise GlassError(f"unknown dtype {dtype!r}: use float32, bfloat16, float16 or auto")
    return DTYPES[dtype]


def bf16_is_fast(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()

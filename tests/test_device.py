"""--device and --dtype: what `auto` resolves to."""

from __future__ import annotations

import torch

from glassgpt import device


def test_auto_dtype_is_bfloat16_only_where_a_bf16_matmul_measured_faster(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    monkeypatch.setattr(device, "cpu_bf16_speedup", lambda: 2.2)  # an AMD EPYC with AVX512-BF16
    assert device.resolve_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(device, "cpu_bf16_speedup", lambda: 0.53)  # a Xeon VM with the flag and no AMX
    assert device.resolve_dtype("auto", cpu) == torch.float32
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"avx2"}))  # no bf16 instructions at all
    monkeypatch.setattr(device, "cpu_bf16_speedup", lambda: 5.0)
    assert device.resolve_dtype("auto", cpu) == torch.float32


def test_the_bf16_speedup_is_a_positive_ratio_measured_once():
    device.cpu_bf16_speedup.cache_clear()
    ratio = device.cpu_bf16_speedup(n=64, repeats=2)
    assert ratio > 0
    assert device.cpu_bf16_speedup(n=64, repeats=2) == ratio  # cached: measured once per process

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


def test_the_bf16_speedup_is_the_ratio_of_the_two_matmul_times_measured_once(monkeypatch):
    """float32's best time over bfloat16's best time, each the fastest of `repeats` runs, measured once."""
    # A clock whose ticks give float32 runs of 3 and 2 units, then bfloat16 runs of 1 and 4.
    ticks = iter([0, 3, 3, 5, 5, 6, 6, 10])
    monkeypatch.setattr(device.time, "perf_counter", lambda: next(ticks))
    device.cpu_bf16_speedup.cache_clear()
    try:
        assert device.cpu_bf16_speedup(n=64, repeats=2) == 2.0  # best 2 against best 1
        assert device.cpu_bf16_speedup(n=64, repeats=2) == 2.0  # cached: the clock is not read again
    finally:
        device.cpu_bf16_speedup.cache_clear()

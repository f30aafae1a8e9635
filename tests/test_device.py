"""--device and --dtype: what `auto` resolves to."""

from __future__ import annotations

import os

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


def test_a_wide_model_takes_the_cores_other_work_leaves_free_and_at_least_one():
    assert device.pick_threads(768, 2, busy=0.0)[0] == 2   # a quiet machine: every core
    assert device.pick_threads(768, 2, busy=0.3)[0] == 2   # a little noise is not a busy core
    assert device.pick_threads(768, 2, busy=1.0)[0] == 1   # one core spinning elsewhere: 2 threads ran 10x slower
    assert device.pick_threads(768, 2, busy=2.0)[0] == 1   # never zero
    assert device.pick_threads(1600, 16, busy=3.2)[0] == 13
    assert device.pick_threads(128, 16, busy=0.0)[0] == 1  # a small model's ops are too short to share


def test_busy_cores_is_between_none_and_this_process_s_cores():
    busy = device.busy_cores(window=0.02)
    assert 0.0 <= busy <= len(os.sched_getaffinity(0)) + 1e-9

"""Where the model runs and in what precision: `--device` and `--dtype` resolved once.

`auto` picks CUDA when present, and bfloat16 where the hardware runs it fast (CUDA GPUs
with bf16 support; CPUs with AVX512-BF16 or AMX on which a bf16 matmul measured faster
than a float32 one); float32 elsewhere.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
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
    """CUDA: whether the GPU runs bfloat16. CPU: whether a bfloat16 matmul measured faster than
    float32's here. The flags alone do not tell: a 2-core Xeon VM with AVX512-BF16 but no AMX ran
    bf16 matmuls at half float32's speed, an AMD EPYC with the same flag at twice it."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags()) and cpu_bf16_speedup() > 1.1


@functools.lru_cache(maxsize=1)
def cpu_bf16_speedup(n: int = 512, repeats: int = 5) -> float:
    """How much faster an n x n bfloat16 matmul runs than a float32 one on this CPU (~30 ms, once)."""
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        a @ b  # the first call picks and loads the kernel
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        best[dtype] = min(times)
    return best[torch.float32] / best[torch.bfloat16]


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


SMALL_EMB_DIM = 512  # narrower models run one CPU thread unless told otherwise


def pick_threads(emb_dim: int, cores: int, busy: float | None = None) -> tuple[int, str]:
    """(intra-op CPU threads, why) for a model `emb_dim` wide on a machine with `cores` threads
    of which `busy` are taken by other work (default: measured now, `busy_cores`).

    Every thread of an op waits for the slowest at the op's end, so one thread that must share
    its core with another process stalls all of them. On this repo's 2-core machine
    (benchmarks/bench_threads.py, GPT-2 124M, 32 new tokens, interleaved runs): quiet, 2 threads
    made 39.8-43.4 new tokens/s against 1 thread's 23.1-23.7; with one other process spinning a
    core, 2 threads made 2.0-3.2 against 1 thread's 22.9-23.8, ten times slower. So a wide model
    takes the cores that are free now (at least 1); a small model's ops take microseconds,
    so its threads spend their time waiting for each other, and it takes 1 (the README's
    Shakespeare model, emb_dim 128: 13.8-16.2 steps/s on 1 thread, 0.6-3.5 on 2 when busy).
    """
    if emb_dim < SMALL_EMB_DIM:
        return 1, f"small model, emb_dim {emb_dim} < {SMALL_EMB_DIM}"
    busy = busy_cores() if busy is None else busy
    free = max(1, min(cores, cores - math.floor(busy + 0.5)))
    if free < cores:
        return free, f"{cores} cores, {busy:.1f} busy with other work now"
    return cores, "all cores, none busy with other work now"


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity: a container's or taskset's share, not the
    machine's count), at least 1: the most intra-op threads glassgpt runs. More would only wait for
    each other, and OpenMP and the native step size their threads' stacks and scratch by the count
    (`--threads 99999` crashed the process before it was capped here)."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def busy_cores(window: float = 0.05) -> float:
    """How many of this process's cores other work keeps busy: the machine's busy fraction over
    `window` seconds, from /proc/stat, while this process sleeps (else the 1-minute load average)."""
    def counters() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        return sum(ticks), ticks[3] + ticks[4]

    mine = usable_cores()
    try:
        total0, idle0 = counters()
        time.sleep(window)
        total1, idle1 = counters()
    except (OSError, ValueError):
        try:
            return min(float(mine), os.getloadavg()[0] * mine / (os.cpu_count() or mine))
        except OSError:
            return 0.0
    elapsed = total1 - total0
    return mine * (1 - (idle1 - idle0) / elapsed) if elapsed > 0 else 0.0


@contextlib.contextmanager
def evaluating(model: torch.nn.Module):
    """`model` in eval mode inside the block (no dropout), in its own mode again after.

    A model already in eval mode is left alone, so the threads that share a served model
    never see its mode flip."""
    was_training = model.training
    if was_training:
        model.eval()
    try:
        yield model
    finally:
        if was_training:
            model.train()

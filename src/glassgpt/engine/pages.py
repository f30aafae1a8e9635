"""Weights on 2 MB pages for a long decoding run: one TLB entry per 2 MB instead of per 4 KB.

    moved = huge_pages(model.parameters())   # bytes now on 2 MB pages (0 where the OS cannot)

A decoding step reads every weight once per token, so at batch 1 it streams the whole model
through the memory system. On 4 KB pages that stream crosses a page, and misses the TLB, every
1,024 float32 weights. Linux can back the same memory with 2 MB pages in place: MADV_HUGEPAGE
marks the range, MADV_COLLAPSE (Linux 6.1+) moves it onto 2 MB pages now rather than whenever
khugepaged gets to it. The addresses and values do not change, so nothing that holds the tensors
(the native step's plan, an adopted module) notices.

Measured on the AMD EPYC (2 cores, THP "madvise"; benchmarks/RESULTS.md): the native gpt2 step
20-23 ms a token in float32 before, 16-19 ms after, and bfloat16 10.5 -> 9.4 ms; the collapse
itself took 0.8 s for gpt2's 497 MB (about 1.6 s a GB: copying the pages). It pays for itself
after about 200 tokens whatever the model's size (a 300-token gpt2 run came out between 6% slower
and 11% faster, within the machine's noise), so the engine asks for it only where a decoding run
has room for MIN_TOKENS more tokens (the KV cache's free positions), and every call after the
first finds the pages already large (a millisecond). Only ranges of whole 2 MB pages inside a
tensor move: for gpt2, 326 MB of the 497.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Iterable

import torch

MIN_TOKENS = 512  # a run this long repays the collapse with room to spare (measured above)
HUGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
_libc: list = []


def _madvise():
    if not _libc:
        libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
        if libc is not None:
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.madvise.restype = ctypes.c_int
        _libc.append(libc)
    return None if _libc[0] is None else _libc[0].madvise


def huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Move the whole 2 MB pages inside each CPU tensor onto huge pages; the bytes moved (0 where the OS
    cannot: another system, an older kernel, THP turned off). Values and addresses stay as they are."""
    madvise = _madvise()
    if madvise is None:
        return 0
    moved, seen = 0, set()
    for t in tensors:
        if t.device.type != "cpu" or t.nbytes < HUGE or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        lo = (t.data_ptr() + HUGE - 1) // HUGE * HUGE
        hi = (t.data_ptr() + t.nbytes) // HUGE * HUGE
        if hi > lo and madvise(lo, hi - lo, MADV_HUGEPAGE) == 0 and madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
            moved += hi - lo
    return moved


def for_run(model: torch.nn.Module, cache) -> int:
    """huge_pages of `model`'s weights where `cache` has room for MIN_TOKENS more tokens, else nothing (0)."""
    if cache.max_len - cache.pos < MIN_TOKENS:
        return 0
    return huge_pages([*model.parameters(), *model.buffers()])

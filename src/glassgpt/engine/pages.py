"""A model's weights on 2 MB pages, for long generations on the CPU.

    moved = move_to_large_pages(model)   # bytes moved (0: not here, or not worth it)

A decoding step reads every weight once per token. On 4 KB pages that is one page-table entry
per 4 KB read (124,000 for gpt2 in float32, every token), and the TLB misses cost read
bandwidth; on 2 MB pages it is 512 times fewer. Measured in one process on the AMD EPYC (Zen 5),
the same gpt2 weights on both kinds of page, native steps in alternation (benchmarks/RESULTS.md,
"2 MB pages"): float32 1.07-1.14x, bfloat16 1.06-1.22x, int8 1.08-1.15x, int4 1.12-1.17x.

Moving costs a copy of the weights into fresh memory (and, where the kernel has few free 2 MB
blocks, its compaction). That pays only for a long enough run: `PAYS_AT` new tokens, which
generate.py checks before it moves anything.

Every parameter and buffer of at least `MIN_BYTES` is copied into one private anonymous mapping
that the kernel is asked (madvise MADV_HUGEPAGE) to back with 2 MB pages, and each tensor's
`.data` is swapped for its copy: the same Parameter and buffer objects, the same values, new
addresses. Anything that shares the objects (the engine's fused twin, an optimizer) follows; a
native step planned before the move keeps the old storage alive (engine/step.py: PlannedStep.addr)
and is planned again (`stale()`). Linux only, where transparent huge pages are `always` or
`madvise`; elsewhere, or with too little free memory for the copy, nothing moves.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path

import torch
from torch import nn

HUGE = 2 << 20
MIN_BYTES = 1 << 20  # smaller tensors (biases, norms) stay where they are
PAYS_AT = 512  # new tokens (batch x max_new_tokens) from which the move pays for itself (module docstring)
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def mode() -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise" or "never"), or None off Linux."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def available() -> bool:
    """Whether a mapping can be asked for 2 MB pages here."""
    return sys.platform.startswith("linux") and hasattr(mmap, "MAP_PRIVATE") and mode() in ("always", "madvise")


def free_bytes() -> int:
    """MemAvailable, in bytes (0 where unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _round(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def movable(model: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers a move would copy: each once (a tied head is its embedding), on the CPU,
    contiguous, of at least MIN_BYTES, not on large pages already."""
    seen: dict[int, torch.Tensor] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if (id(t) not in seen and t.device.type == "cpu" and t.is_contiguous() and t.nbytes >= MIN_BYTES
                and not getattr(t, "_glassgpt_large_pages", False)):
            seen[id(t)] = t
    return list(seen.values())


def move_to_large_pages(model: nn.Module) -> int:
    """Copy `model`'s large tensors onto 2 MB pages (module docstring); the bytes moved, 0 where none."""
    tensors = movable(model)
    total = _round(sum(_round(t.nbytes, 64) for t in tensors), HUGE)
    if not tensors or not available() or free_bytes() < total * 1.25:
        return 0
    buf = mmap.mmap(-1, total + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    start = (-base) % HUGE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(base + start, total, MADV_HUGEPAGE) != 0:
        return 0
    libc.madvise(base + start, total, MADV_POPULATE_WRITE)  # the pages now, in one call (Linux 5.14+)
    offset = start
    with torch.no_grad():
        for t in tensors:
            # A storage of its own for each tensor, each holding `buf` for as long as it lives (torch.save writes
            # a view's whole storage: one shared arena would be written whole for every tensor saved alone).
            new = torch.frombuffer(buf, dtype=torch.uint8, count=t.nbytes, offset=offset).view(t.dtype).view(t.shape)
            new.copy_(t)
            t.data = new  # the old storage goes once nothing else holds it
            t._glassgpt_large_pages = True
            offset += _round(t.nbytes, 64)
    return offset - start

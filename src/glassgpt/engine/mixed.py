"""bfloat16 training with a float32 master copy: the model trains in bf16, AdamW updates in fp32.

Autocast (`torch.autocast(dtype=bfloat16)`) keeps the weights in float32 and casts at
every use: each Linear casts its weight and its input to bf16, while embeddings,
LayerNorm and the residual additions stay float32, so the activations cross between
the two precisions several times per block, at every step. Here instead:

    master  the float32 model: what the optimizer updates, what checkpoints save
    compute a bf16 copy of it that runs forward and backward, activations bf16 throughout

and once per optimizer step the bf16 gradients are widened into the master's `.grad`
(`grads_to_master`) and, after the optimizer step, the new float32 weights are rounded
into the copy (`refresh`). Two casts of the weights per step, none per activation.
The precision is the usual mixed-precision recipe: updates are accumulated in float32,
so small steps are not lost to bf16 rounding of the weights.

Leaves out: FSDP (which has its own mixed-precision policy) and float16, which needs
loss scaling; train.py uses autocast for those.
"""

from __future__ import annotations

import copy
import ctypes

import torch
from torch import nn


class LowPrecisionCopy:
    """A `dtype` copy of `master` for forward and backward; `master` keeps the float32 weights."""

    def __init__(self, master: nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.master = master
        self.module = copy.deepcopy(master).to(dtype)  # deepcopy keeps tied weights tied
        self.pairs = [(m, c) for m, c in zip(master.parameters(), self.module.parameters()) if m.requires_grad]
        for _, c in self.pairs:
            c.requires_grad_(True)
        self.grads: dict[nn.Parameter, torch.Tensor] = {}  # each master's float32 gradient, allocated once

    @torch.no_grad()
    def grads_to_master(self) -> None:
        """Add the copy's gradients, widened to float32, into the master's `.grad`; clear the copy's.

        Call it after every micro-step's backward, so that accumulation happens in float32;
        under DistributedDataParallel, whose all-reduce must see the whole accumulated
        gradient, once after the last micro-step.
        """
        widen, into = [], []  # one foreach copy for all: on a GPU, one launch per group of tensors, not per tensor
        for m, c in self.pairs:
            if c.grad is None:
                continue
            if m.grad is None:  # (zero_grad set it to None): widen into the same buffer as every step
                grad = self.grads.get(m)
                if grad is None:
                    grad = self.grads[m] = torch.empty_like(m)
                m.grad = grad  # a fresh tensor each step would page-fault its memory in again
                widen.append(c.grad)
                into.append(grad)
            else:
                m.grad.add_(c.grad)
            c.grad = None
        if into:
            torch._foreach_copy_(into, widen)

    @torch.no_grad()
    def refresh(self) -> None:
        """Round the master's (updated) weights into the copy."""
        torch._foreach_copy_([c for _, c in self.pairs], [m for m, _ in self.pairs])


def keep_freed_memory() -> bool:
    """Have glibc keep the memory this process frees for its next allocations, instead of unmapping it.

    A training step allocates and frees the same large tensors at every step (the gradients of the
    [V, d] embedding and head, the logits). Each is above glibc's mmap threshold, so each is mapped
    anew, and the kernel faults in and zeroes its pages again, step after step: in chapter 7's bf16
    step at GPT-2's size, 0.3 s of 1.4 s went to that (torch.profiler: `copy_` and `fill_` into fresh
    tensors). With malloc's mmap off and trimming only past 2 GB, freed blocks stay in the heap and
    the next step reuses them; the numbers are untouched. The price: memory freed during training
    stays with the process. Returns whether it took (glibc only; elsewhere nothing changes)."""
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # malloc.h
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):  # not glibc (macOS, Windows, musl)
        return False

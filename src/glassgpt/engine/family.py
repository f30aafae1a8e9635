"""Decoding Qwen3 and Llama 3 fast: the glass model's forward with glassgpt's gemv kernel where it won.

    steps = family_steps(model)   # prefill(ids, cache), decode_one(ids, cache): generate's seams

At batch 1 each new token multiplies one row by every weight, so a step's time is the time to
read the weights (2.4 GB per token for Qwen3 0.6B in float32). PyTorch's matmul reads them below
the memory's bandwidth on some CPUs; the gemv kernel (linear.py, kernels/gemv.cpp) at it. The
twin is the glass model again, module by module, whose nn.Linears are GemvLinear over the very same
Parameters (nothing copied; RoPE's tables, the config and the hooks shared), each given the kernel where autotune's measurement
on this machine found it faster for that shape (the rest, and every prompt of more than
GEMV_MAX_ROWS tokens, run F.linear as the glass model does). Everything else is the glass model's
own code, so the prompt's logits are the glass model's bit for bit, and each decoded token's within
the kernel's rounding (tests/test_family_adopt.py). Leaves out: the native step, int8 and int4.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from . import native
from .autotune import PRECISIONS, Choices, linear_candidates, machine_key, measure
from .linear import GemvLinear

_TWINS: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, FamilySteps]]" = weakref.WeakKeyDictionary()
_WINNERS: dict[tuple, dict[str, str]] = {}


class FamilySteps:
    """`prefill` and `decode_one` (generate.py's seams) on a family model's twin."""

    def __init__(self, twin: nn.Module):
        self.twin = twin

    def prefill(self, ids: torch.Tensor, cache) -> torch.Tensor:
        cache.reset()
        return self.twin(ids, cache, last_only=True)[:, -1]

    def decode_one(self, ids: torch.Tensor, cache) -> torch.Tensor:
        return self.twin(ids[:, None], cache, last_only=True)[:, -1]


def family_steps(model: nn.Module) -> FamilySteps:
    """The steps of `model`'s twin, made once per model (again if its tensors were replaced)."""
    fingerprint = tuple((p.data_ptr(), p.dtype, p.device) for p in model.parameters())
    found = _TWINS.get(model)
    if found is None or found[0] != fingerprint:
        found = (fingerprint, FamilySteps(gemv_twin(model)))
        _TWINS[model] = found
    return found[1]


def gemv_twin(model: nn.Module) -> nn.Module:
    """`model` again, module by module, over the same Parameters (and RoPE tables, config and hooks), with
    each nn.Linear a GemvLinear; nothing is copied or made again."""
    twin = _shallow_copy(model)
    weight = model.tok_emb.weight
    precision = str(weight.dtype).removeprefix("torch.")
    ops = native.load() if weight.device.type == "cpu" and precision in ("float32", "bfloat16") else None
    if ops is not None:
        winners = _winners({(m.out_features, m.in_features) for m in twin.modules() if isinstance(m, GemvLinear)},
                           precision, ops)
        for m in twin.modules():
            if isinstance(m, GemvLinear) and winners.get(f"linear {m.out_features}x{m.in_features}") == "glassgpt":
                m.gemv = ops.gemv
    return twin


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object of `module`'s class (GemvLinear for an nn.Linear) sharing its Parameters,
    buffers and attributes, with its submodules copied the same way."""
    twin = (GemvLinear if type(module) is nn.Linear else type(module)).__new__(
        GemvLinear if type(module) is nn.Linear else type(module))
    twin.__dict__ = module.__dict__.copy()
    twin._parameters = dict(module._parameters)  # the same Parameter objects
    twin._modules = {name: None if child is None else _shallow_copy(child) for name, child in module._modules.items()}
    return twin


def _winners(shapes: set[tuple[int, int]], precision: str, ops) -> dict[str, str]:
    """For each (out, in): "glassgpt" or "torch", whichever multiplied one row faster here (timed once per process)."""
    assert precision in PRECISIONS
    key = (machine_key(), precision, tuple(sorted(shapes)))
    if key not in _WINNERS:
        choices = Choices(key[0], precision)
        with torch.random.fork_rng(devices=[]):  # random inputs: a seeded run draws the same with or without this
            for out, inp in sorted(shapes):
                measure(choices, f"linear {out}x{inp}", linear_candidates((out, inp), precision, ops))
        _WINNERS[key] = choices.winners
    return _WINNERS[key]

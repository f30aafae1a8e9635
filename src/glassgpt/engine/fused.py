"""The glass model's blocks with fused kernels: the same sums in fewer, faster calls.

model.py writes LayerNorm, GELU and attention out as the book does, a few tensor
operations each. Here each is one PyTorch kernel that computes the same function:

    LayerNorm            -> FusedLayerNorm:  F.layer_norm (biased variance, eps inside the root)
    GELU                 -> FusedGELU:       F.gelu(approximate="tanh"), or glassgpt's kernel of the
                                             same formula where autotune.py measured it faster
    MultiHeadAttention   -> FusedAttention:  its `attend` only, by attention.attend
                                             (scaled_dot_product_attention, or the CPU's faster forms)
    nn.Linear            -> GemvLinear:      its product at a few rows, by glassgpt's kernel
                                             where autotune.py measured it faster (linear.py)

Each fused class is a subclass that overrides only that computation, so the projections,
the head split, the blocks and GPTModel.forward stay model.py's own code. The results
equal the glass model's within float rounding (tests/test_engine.py: 1e-5 in float32),
not bit for bit: the fused kernels add in another order. The book's numbers, exactly,
come from the glass model itself.

`fused(model)` returns a twin that shares every parameter and buffer of `model` (no copy
of the weights; training the twin trains the model) but has none of its hooks, so the
explain view's taps never slow generation down; `fused(model, in_place=True)` swaps the
classes of a model that is the caller's own (a training run's, before FSDP wraps it).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..model import GELU, LayerNorm, MultiHeadAttention
from .attention import attend, attend_packed
from .linear import GemvLinear, needs_grad

# nn.Module's hook dictionaries: a twin starts with empty ones.
_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
          "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


class FusedLayerNorm(LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.scale.shape, self.scale, self.shift, self.eps)


class FusedGELU(GELU):
    kernel = None  # glassgpt's gelu_tanh, where autotune.py measured it faster than F.gelu (it has no backward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.kernel is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
                and not needs_grad(x) and not torch.compiler.is_compiling()):  # (compiled: inductor fuses its own)
            return self.kernel(x.contiguous())
        return F.gelu(x, approximate="tanh")


class FusedAttention(MultiHeadAttention):
    decode_path, prompt_path, train_path = "blocks", "sdpa", "sdpa"  # attention.PATHS; autotune.py sets them
    packing = None  # (index, b, t) while packing.py runs packed rows through the blocks

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.packing is not None:
            return attend_packed(self._attend, q, k, v, *self.packing)
        return self._attend(q, k, v)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend(q, k, v, self.dropout.p if self.training else 0.0, self.decode_path, self.prompt_path,
                      self.train_path)


FUSED: dict[type, type] = {LayerNorm: FusedLayerNorm, GELU: FusedGELU, MultiHeadAttention: FusedAttention,
                           nn.Linear: GemvLinear}


def fused(model: nn.Module, in_place: bool = False) -> nn.Module:
    """`model` with every glass LayerNorm, GELU and attention computed by a fused kernel.

    By default a twin sharing `model`'s parameters and buffers (and its train/eval mode at
    this moment); with `in_place`, `model` itself, changed.
    """
    if in_place:
        for module in model.modules():
            module.__class__ = FUSED.get(type(module), type(module))
        return model
    return _twin(model)


def _twin(module: nn.Module) -> nn.Module:
    twin = _shallow_copy(module)  # the same attributes, the same Parameter and buffer objects
    state = twin.__dict__
    state["_parameters"] = dict(module._parameters)
    state["_buffers"] = dict(module._buffers)
    state["_modules"] = {name: _twin(child) for name, child in module._modules.items()}
    for name in _HOOKS:
        if name in state:
            state[name] = type(state[name])()
    twin.__class__ = FUSED.get(type(module), type(module))
    return twin


def _shallow_copy(module: nn.Module) -> nn.Module:
    """copy.copy(module), without its detour through __reduce_ex__ (most of an Engine's making: ~4 ms of a
    `generate` call for gpt2) where the class copies as nn.Module does: a new object with the same __dict__."""
    cls = type(module)
    if (cls.__reduce_ex__ is object.__reduce_ex__ and cls.__getstate__ is nn.Module.__getstate__
            and cls.__setstate__ is nn.Module.__setstate__ and getattr(cls, "__copy__", None) is None):
        twin = object.__new__(cls)
        twin.__dict__.update(module.__getstate__())
        return twin
    return copy.copy(module)


def is_fused(model: nn.Module) -> bool:
    return any(type(m) in FUSED.values() for m in model.modules())

"""One token's mixture of experts, without the batch's bookkeeping: the twin's MoE feed-forward at decoding.

    one_token_experts(twin)    every MoE feed-forward of a twin (decode.py's gemv_twin) decodes through OneTokenExperts

The glass MoEFeedForward (families/qwen3.py) serves any batch: it finds the experts some token chose
(`torch.unique`), and for each the tokens that chose it (`nonzero`), gathers their rows, runs the expert and
adds the weighted rows back (`index_add_`). At decoding there is one token: its k experts are the router's k
ids, and the token is the whole batch. OneTokenExperts runs just those k experts (nothing else of the
experts' weights is read), in the glass model's order (ascending expert id, as `torch.unique` gives them),
each output weighted and summed as index_add_ sums it, so its logits are the glass model's bit for bit
(tests/test_bonus_models.py); some 40 small operators a block fewer. Every other shape runs the glass forward.
"""

from __future__ import annotations

import torch
from torch import nn


class OneTokenExperts:
    """Mixed into the twin's copy of a MoE feed-forward (its own class first in the order): its forward for one
    token, the glass forward for more. Reads the glass module's router (`route`) and experts (`fc1`, `fc2`, `fc3`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        if b * t != 1:
            return super().forward(x)
        top_ids, top_weights = self.route(x)  # [1, 1, k] each
        x_flat = x.reshape(1, d)
        out = None
        for e, weight in sorted(zip(top_ids.flatten().tolist(), top_weights.flatten().tolist())):
            expert_out = self.fc3[e](nn.functional.silu(self.fc1[e](x_flat)) * self.fc2[e](x_flat))  # [1, d]
            expert_out = expert_out * weight  # the routing weight, exact as a Python float in any dtype here
            out = expert_out if out is None else out.add_(expert_out)
        return out.view(b, t, d)


_CLASSES: dict[tuple[type, type], type] = {}


def mix_in(module: nn.Module, mixin: type) -> bool:
    """Make `module` (a twin's copy) an instance of `mixin` first, then its own class: the mixin's forward for the
    case it takes, its own for the rest. False where it is one already."""
    cls = type(module)
    if issubclass(cls, mixin):
        return False
    if (mixin, cls) not in _CLASSES:
        _CLASSES[mixin, cls] = type(f"OneToken{cls.__name__}", (mixin, cls), {})
    module.__class__ = _CLASSES[mixin, cls]
    return True


def one_token_experts(twin: nn.Module, anatomy) -> int:
    """Give every MoE feed-forward of `twin` (its description `anatomy`) OneTokenExperts' forward; returns how many."""
    return sum(mix_in(twin.get_submodule(block.ff.path), OneTokenExperts) for block in anatomy.blocks
               if block.ff.kind == "moe" and block.ff.experts is not None)

"""Any GPT-2-shaped nn.Module, taken as it is: a glassgpt GPTModel over the module's own tensors.

    adopt(module, ids) -> GPTModel

The seam every function that takes a model goes through (explain, why, generate, eval, diff):
the book's GPTModel, a reader's copy of it, nanoGPT's GPT, transformers' GPT2LMHeadModel or
glassgpt's own. Nothing is copied: the returned model's parameters are views of the module's.

(Stub: glassgpt's own GPTModel, or an engine running one, passes through; the other kinds are
issue 24's work.)
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import GlassError
from .model import GPTModel


def adopt(module: nn.Module, ids: torch.Tensor | None = None) -> GPTModel:
    """`module` as a glassgpt GPTModel sharing its tensors; `ids` (`[b, t]`): a prompt on which,
    the first time a module is seen, its own logits are checked against glassgpt's forward."""
    if isinstance(module, GPTModel):
        return module
    inner = getattr(module, "model", None)
    if isinstance(inner, GPTModel):  # an engine, compiled or not, runs a GPTModel
        return inner
    raise GlassError(f"{type(module).__name__} is not a model glassgpt can read yet")

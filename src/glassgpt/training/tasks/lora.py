"""LoRA (Hu et al. 2021; book appendix E): train a rank-r update beside each frozen weight.

`apply_lora` replaces the attention and feed-forward `nn.Linear`s of a GPTModel by
`LoRALinear`: W x + (B A x) * alpha / r, with A [r, in] (Kaiming-uniform), B [out, r]
(zeros, so training starts at the base model), and freezes everything else except a
classifier head. For GPT-2 124M at r = 8 that is about 1.3M trainable parameters
instead of 124M. `merge_lora` folds B A * scale into W and puts plain `nn.Linear`s
back, so a merged model costs nothing extra at inference. (The book stores A as
[in, r] and B as [r, out]; we keep the paper's orientation, in which B @ A already has
nn.Linear's [out, in] weight shape.)

`merged_model` is what training writes as the loadable checkpoint (examples.py's
tasks return it from `checkpoint_model`): a plain GPTModel that shares every unwrapped
tensor with the training model and holds merged copies of the wrapped weights, so
`latest/` and `best/` have the plain state_dict keys and load with `load_model` like
any checkpoint. The training model's own tensors (frozen base weights, unmerged, and
the adapters) go beside it for resume (checkpoint.py). Without adapters
`merged_model` returns the model itself.

`replace_linear_with_lora` is the book's own (appendix E, `--recipe book`): `BookLoRALinear` on
every nn.Linear, the classifier head included, in the order the book walks `named_children`, each A
drawn from torch's global generator as its LoRALayer draws it ([in, r], Kaiming-uniform), B [r, out]
zeros, and y = linear(x) + alpha * (x @ A @ B): the scale is alpha, not alpha / r. It freezes nothing
itself (the book freezes every weight before it). Same weights and seed, the book's outputs and,
after AdamW steps, its weights, bit for bit (tests/test_lora.py).

Leaves out: QLoRA, LoRA on the embeddings, dropout on the adapter input.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...errors import GlassError
from ...families import FamilyConfig
from ...model import GPTModel
from ...formats.families import model_from_book_state
from ...formats.glassgpt import model_from_state

LORA_TARGETS = ("att.W_query", "att.W_key", "att.W_value", "att.out_proj", "ff.layers.0", "ff.layers.2",
                "ff.fc1", "ff.fc2", "ff.fc3")  # GPT-2's feed-forward, then SwiGLU's (Qwen3, Llama 3)


class LoRALinear(nn.Module):
    """y = linear(x) + (x @ A.T @ B.T) * alpha / rank: a rank-r update of a frozen nn.Linear."""

    def __init__(self, linear: nn.Linear, rank: int, alpha: float, generator: torch.Generator | None = None):
        super().__init__()
        self.linear = linear
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        w = linear.weight
        self.lora_A = nn.Parameter(torch.empty(rank, linear.in_features, device=w.device, dtype=w.dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5), generator=generator)  # nn.Linear's own init
        self.lora_B = nn.Parameter(torch.zeros(linear.out_features, rank, device=w.device, dtype=w.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [.., in] -> [.., r] -> [.., out]: never forms the [out, in] product B @ A.
        return self.linear(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scale

    def delta_weight(self) -> torch.Tensor:
        return (self.lora_B @ self.lora_A) * self.scale  # [out, r] @ [r, in] -> [out, in]


class BookLoRALinear(LoRALinear):
    """The book's LinearWithLoRA: y = linear(x) + alpha * (x @ A @ B), A [in, r], B [r, out]."""

    def __init__(self, linear: nn.Linear, rank: int, alpha: float):
        nn.Module.__init__(self)  # not LoRALinear's: A's shape, its draw and the scale differ
        self.linear = linear
        self.rank, self.alpha, self.scale = rank, alpha, alpha
        w = linear.weight
        self.lora_A = nn.Parameter(torch.empty(linear.in_features, rank, device=w.device, dtype=w.dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # LoRALayer's: torch's global generator
        self.lora_B = nn.Parameter(torch.zeros(rank, linear.out_features, device=w.device, dtype=w.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.alpha * (x @ self.lora_A @ self.lora_B)  # [.., in] -> [.., r] -> [.., out]

    def delta_weight(self) -> torch.Tensor:
        return (self.lora_A @ self.lora_B * self.alpha).T  # [in, r] @ [r, out] -> [out, in]


def replace_linear_with_lora(model: nn.Module, rank: int, alpha: float) -> nn.Module:
    """The book's replace_linear_with_lora: every nn.Linear below `model` becomes a BookLoRALinear,
    depth first in `named_children` order (the order of the random draws). Returns `model`."""
    _check(rank, alpha)
    if has_lora(model):
        raise GlassError("the model already has LoRA adapters: merge them first (merge_lora)")
    if isinstance(model, GPTModel) and model.out_head.weight is model.tok_emb.weight:
        raise GlassError("the book's LoRA adapts out_head too, whose weight is tok_emb's in this model (OpenAI's "
                         "tied layout), so no merged model could hold it: use a model of the book's layout "
                         "(gpt2-book, or the book's model.pth), or glassgpt's LoRA (without --recipe book)")
    _wrap_every_linear(model, rank, alpha)
    return model


def _wrap_every_linear(module: nn.Module, rank: int, alpha: float) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, BookLoRALinear(child, rank, alpha))
        else:
            _wrap_every_linear(child, rank, alpha)


def _lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]


def has_lora(model: nn.Module) -> bool:
    return bool(_lora_modules(model))


def apply_lora(model: GPTModel, rank: int, alpha: float, seed: int = 0) -> GPTModel:
    """Wrap the attention and feed-forward linears in LoRALinear (in place) and freeze the rest.

    Only the adapters stay trainable, plus `out_head` when the model is a classifier
    (its head is new and has to be learned).
    """
    _check(rank, alpha)
    if has_lora(model):
        raise GlassError("the model already has LoRA adapters: merge them first (merge_lora)")
    model.requires_grad_(False)
    gen = torch.Generator(device=model.tok_emb.weight.device).manual_seed(seed)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name.endswith(LORA_TARGETS):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, LoRALinear(module, rank, alpha, gen))
    if model.cfg.num_classes is not None:
        model.out_head.requires_grad_(True)
    return model


def _check(rank: int, alpha: float) -> None:
    if not isinstance(rank, int) or rank < 1:
        raise GlassError(f"--lora-rank must be a positive integer, got {rank!r}")
    if not alpha > 0:
        raise GlassError(f"--lora-alpha must be > 0, got {alpha!r}")


@torch.no_grad()
def merge_lora(model: GPTModel) -> GPTModel:
    """Fold each adapter into its weight (W += B A * scale) and restore plain nn.Linears, in place."""
    for name, module in _lora_modules(model):
        w = module.linear.weight
        w.add_(module.delta_weight().to(w.dtype))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, module.linear)
    return model


@torch.no_grad()
def merged_model(model: GPTModel) -> GPTModel:
    """A plain GPTModel with the adapters folded in, leaving `model` untouched.

    It shares every tensor that LoRA does not wrap with `model`; only the wrapped
    weights are new (merged) tensors. Without adapters, `model` itself is returned.
    """
    wrapped = _lora_modules(model)
    if not wrapped:
        return model
    state = {}
    for key, value in model.state_dict().items():
        state[key.replace(".linear.", ".")] = value
    for name, module in wrapped:
        w = module.linear.weight
        state[f"{name}.weight"] = w + module.delta_weight().to(w.dtype)
    state = {k: v for k, v in state.items() if not k.rsplit(".", 1)[-1].startswith("lora_")}
    if isinstance(model.cfg, FamilyConfig):  # Qwen3 or Llama 3: the glass model of its family
        like = model.tok_emb.weight
        return model_from_book_state(model.cfg, state, "the merged model", like.device, like.dtype).train(model.training)
    return model_from_state(model.cfg, state).train(model.training)


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters only: {"<module>.lora_A": [r, in], "<module>.lora_B": [out, r], ...} ([in, r] and
    [r, out] for the book's)."""
    return {k: v for k, v in model.state_dict().items() if k.rsplit(".", 1)[-1].startswith("lora_")}


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Parameters (a tied tensor once), or only those with requires_grad."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)

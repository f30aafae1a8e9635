"""Two models' weights, tensor by tensor: what training or finetuning changed, and what it left alone.

    diff_weights(model_a, model_b) -> WeightDiff

For every tensor of the state dict, the relative change ||B - A|| / ||A|| (Frobenius norms;
1 means the change is as large as the tensor itself) and whether it moved at all (any
element differs: a frozen tensor is bit for bit the same). Tensors are grouped as the book
draws the model: tok_emb, pos_emb, each of trf_blocks (norm1, att, norm2, ff), final_norm,
out_head. A finetuned classifier's head, [classes, d] where the language model's was [V, d],
is reported as replaced. Models of other shapes are refused, naming the first tensor that
differs.

Its views (views/diff.py): a table, and a grid (one row per block, one cell per
tensor, coloured by the change on a log scale, blank where nothing moved).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..adopt import adopt, check_computable
from ..config import GPTConfig
from ..errors import GlassError
from ..model import GPTModel
from .notation import shape
from .result import Result

HEAD = ("out_head.weight", "out_head.bias")
# A block's tensors as the book draws the block, with the short labels of the picture's columns.
BLOCK_PARTS = [("norm1", ("scale", "shift")), ("att.W_query", ("weight", "bias")), ("att.W_key", ("weight", "bias")),
               ("att.W_value", ("weight", "bias")), ("att.out_proj", ("weight", "bias")),
               ("norm2", ("scale", "shift")), ("ff.layers.0", ("weight", "bias")), ("ff.layers.2", ("weight", "bias"))]


@dataclass
class TensorChange:
    name: str
    group: str                # tok_emb, pos_emb, trf_blocks.N, final_norm, out_head
    shape: list[int]
    rel_change: float | None  # ||B - A|| / ||A||; None when A is all zeros (a bias that started at 0) and B is not
    change: float             # ||B - A||
    moved: bool               # False: bit for bit the same
    max_abs: float            # the largest |B - A| of one element
    tied_to: str | None = None  # "tok_emb.weight" for a tied out_head.weight


@dataclass
class WeightDiff(Result):
    a: str
    b: str
    tensors: list[TensorChange]
    replaced: dict[str, Any] | None = None   # the head, when B's is a classifier's (or A's)
    notes: list[str] = field(default_factory=list)

    @property
    def moved(self) -> list[str]:
        return [t.name for t in self.tensors if t.moved]

    @property
    def unmoved(self) -> list[str]:
        return [t.name for t in self.tensors if not t.moved]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "moved": self.moved, "unmoved": self.unmoved}


def group_of(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "trf_blocks" else parts[0]


@torch.inference_mode()
def diff_weights(model_a: GPTModel, model_b: GPTModel, name_a: str = "A", name_b: str = "B") -> WeightDiff:
    """Compare every tensor of two models of the same shapes (B's head may be a new classifier's)."""
    check_computable(model_a)
    check_computable(model_b)
    model_a, model_b = adopt(model_a), adopt(model_b)  # a reader's modules, read in place
    sa, sb = model_a.state_dict(), model_b.state_dict()
    replaced = None
    if model_a.cfg.num_classes != model_b.cfg.num_classes:
        replaced = {"a": {k: list(sa[k].shape) for k in HEAD if k in sa},
                    "b": {k: list(sb[k].shape) for k in HEAD if k in sb}}
    sa, sb = _comparable(sa, sb, name_a, name_b, replaced is not None)
    tensors = []
    for name, a in sa.items():
        a, b = a.detach().float().cpu(), sb[name].detach().float().cpu()
        moved = not torch.equal(a, b)
        change = float((b - a).norm()) if moved else 0.0
        norm_a = float(a.norm())
        rel = change / norm_a if norm_a > 0 else (None if moved else 0.0)
        tied = "tok_emb.weight" if name == "out_head.weight" and model_a.tied and model_b.tied else None
        tensors.append(TensorChange(name, group_of(name), list(a.shape), rel, change, moved,
                                    float((b - a).abs().max()) if moved else 0.0, tied))
    notes = []
    if model_a.cfg.n_heads != model_b.cfg.n_heads:
        notes.append(f"the head counts differ ({model_a.cfg.n_heads} and {model_b.cfg.n_heads}): the same shapes, "
                     "split into heads another way")
    return WeightDiff(name_a, name_b, tensors, replaced, notes)


def check_same_shapes(cfg_a: GPTConfig, cfg_b: GPTConfig, name_a: str = "A", name_b: str = "B") -> None:
    """diff's check from the configs alone, before any weights load (the models are built on the meta device)."""
    with torch.device("meta"):
        sa, sb = GPTModel(cfg_a).state_dict(), GPTModel(cfg_b).state_dict()
    _comparable(sa, sb, name_a, name_b, cfg_a.num_classes != cfg_b.num_classes)


def _comparable(sa: dict, sb: dict, name_a: str, name_b: str, new_head: bool) -> tuple[dict, dict]:
    """The two state dicts without a replaced head; refused in one line naming the first tensor that the
    two models do not share, with both shapes."""
    if new_head:
        sa = {k: v for k, v in sa.items() if k not in HEAD}
        sb = {k: v for k, v in sb.items() if k not in HEAD}
    for name in list(sa) + [k for k in sb if k not in sa]:
        got_a = shape(list(sa[name].shape)) if name in sa else "missing"
        got_b = shape(list(sb[name].shape)) if name in sb else "missing"
        if got_a != got_b:
            raise GlassError(f"{name_a} and {name_b} have different shapes: {name} is {got_a} in {name_a} and {got_b} "
                             f"in {name_b}: diff compares models of the same config (sizes, qkv_bias, context_length)")
    return sa, sb

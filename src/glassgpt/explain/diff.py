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

Every other described model (Qwen3, Llama 3.2, Gemma 3, OLMo 3, Tiny Aya, Qwen3.5, chapter 4's variants) is
diffed the same way under its own names (kinds.describe says which model it is and where its blocks are:
tok_emb, trf_blocks.N or blocks.N, final_norm, out_head; no pos_emb where RoPE has no weights). Two models
that are not the same described model are refused in one line naming both. Settings that no tensor holds
(rope_base, the head split, norm_eps, a window, layer_types) are compared too: a difference there changes
the predictions beyond what the weights say, and a note names it.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..adopt import adopt, check_computable
from ..errors import GlassError
from ..formats.checks import on_meta
from ..kinds import describe, glass_model
from .notation import shape
from .result import Result

HEAD = ("out_head.weight", "out_head.bias")
# A block's tensors as the book draws the block, with the short labels of the picture's columns.
BLOCK_PARTS = [("norm1", ("scale", "shift")), ("att.W_query", ("weight", "bias")), ("att.W_key", ("weight", "bias")),
               ("att.W_value", ("weight", "bias")), ("att.out_proj", ("weight", "bias")),
               ("norm2", ("scale", "shift")), ("ff.layers.0", ("weight", "bias")), ("ff.layers.2", ("weight", "bias"))]
# A Qwen3 or Llama block's, in the same order (RMSNorm's weight is `scale` in the book's Qwen3, `weight` in Llama;
# only Qwen3 has q_norm and k_norm): views/diff.py keeps the columns that the model has.
FAMILY_BLOCK_PARTS = [("norm1", ("scale", "weight")), ("att.W_query", ("weight",)), ("att.W_key", ("weight",)),
                      ("att.W_value", ("weight",)), ("att.q_norm", ("scale",)), ("att.k_norm", ("scale",)),
                      ("att.out_proj", ("weight",)), ("norm2", ("scale", "weight")), ("ff.fc1", ("weight",)),
                      ("ff.fc2", ("weight",)), ("ff.fc3", ("weight",))]
# Fields that a tensor's storage tells, not its values: the tie has a note of its own.
TIE_FIELDS = ("tie_embeddings", "tie_word_embeddings")


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
    family: str | None = None                # the config's family ("qwen3", "gemma3", ...) of two such models; None: GPT-2
    model: str = "GPT-2"                     # which described model both are (kinds.describe's name)
    blocks: str = "trf_blocks"               # where their blocks are: each block's tensors are grouped under it

    @property
    def moved(self) -> list[str]:
        return [t.name for t in self.tensors if t.moved]

    @property
    def unmoved(self) -> list[str]:
        return [t.name for t in self.tensors if not t.moved]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "moved": self.moved, "unmoved": self.unmoved}


def group_of(name: str, blocks: str = "trf_blocks") -> str:
    """The group a tensor is shown in: its block (`trf_blocks.3`), else its top-level module (`tok_emb`)."""
    if name.startswith(blocks + "."):
        return f"{blocks}.{name[len(blocks) + 1:].split('.')[0]}"
    return name.split(".")[0]


def block_index(group: str) -> int | None:
    """3 for a block's group (`trf_blocks.3`, `blocks.3`); None for any other."""
    found = re.fullmatch(r".+\.(\d+)", group)
    return int(found.group(1)) if found else None


@torch.inference_mode()
def diff_weights(model_a: nn.Module, model_b: nn.Module, name_a: str = "A", name_b: str = "B") -> WeightDiff:
    """Compare every tensor of two models of the same shapes (B's head may be a new classifier's)."""
    check_computable(model_a)
    check_computable(model_b)
    anatomy_a, anatomy_b = _described(model_a), _described(model_b)
    check_same_kind(anatomy_a, anatomy_b, name_a, name_b)
    if anatomy_a.name == "GPT-2":
        return _diff_gpt2(adopt(model_a), adopt(model_b), name_a, name_b)  # a reader's modules, read in place
    sa, sb = _comparable(model_a.state_dict(), model_b.state_dict(), name_a, name_b, False, True)
    head, emb = f"{anatomy_a.head.path}.weight", f"{anatomy_a.embedding.path}.weight"
    tied = emb if anatomy_a.head.tied and anatomy_b.head.tied else None
    notes = _unseen_settings(model_a.cfg, model_b.cfg, name_a, name_b)
    if anatomy_a.head.tied != anatomy_b.head.tied:  # told by storage: one Parameter for both, or two tensors
        yes, own = (name_a, name_b) if anatomy_a.head.tied else (name_b, name_a)
        notes.append(f"{head} is {emb}'s own storage in {yes} (tied) and a tensor of its own in {own}: its row "
                     "compares their values")
    tensors = [_change(name, a, sb[name], anatomy_a.blocks_path, tied if name == head else None)
               for name, a in sa.items()]
    return WeightDiff(name_a, name_b, tensors, None, notes, getattr(model_a.cfg, "family", None), anatomy_a.name,
                      anatomy_a.blocks_path)


def _diff_gpt2(model_a: nn.Module, model_b: nn.Module, name_a: str, name_b: str) -> WeightDiff:
    sa, sb = model_a.state_dict(), model_b.state_dict()
    replaced = None
    if model_a.cfg.num_classes != model_b.cfg.num_classes:
        replaced = {"a": {k: list(sa[k].shape) for k in HEAD if k in sa},
                    "b": {k: list(sb[k].shape) for k in HEAD if k in sb}}
    sa, sb = _comparable(sa, sb, name_a, name_b, replaced is not None)
    tied = "tok_emb.weight" if model_a.tied and model_b.tied else None
    tensors = [_change(name, a, sb[name], "trf_blocks", tied if name == "out_head.weight" else None)
               for name, a in sa.items()]
    notes = []
    if model_a.cfg.n_heads != model_b.cfg.n_heads:
        notes.append(f"the head counts differ ({model_a.cfg.n_heads} and {model_b.cfg.n_heads}): the same shapes, "
                     "split into heads another way")
    return WeightDiff(name_a, name_b, tensors, replaced, notes, None)


def _change(name: str, a: torch.Tensor, b: torch.Tensor, blocks: str, tied: str | None) -> TensorChange:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    moved = not torch.equal(a, b)
    change = float((b - a).norm()) if moved else 0.0
    norm_a = float(a.norm())
    rel = change / norm_a if norm_a > 0 else (None if moved else 0.0)
    return TensorChange(name, group_of(name, blocks), list(a.shape), rel, change, moved,
                        float((b - a).abs().max()) if moved else 0.0, tied)


def _described(model: nn.Module):
    """kinds.describe; a GPT module it does not name is read by adopt first (its one line if neither reads it)."""
    try:
        return describe(model)
    except GlassError:
        return describe(adopt(model))


def kind_name(anatomy) -> str:
    """GPT-2, Qwen3, Gemma 3, ...: which described model an anatomy is."""
    return anatomy.name


def check_same_kind(anatomy_a, anatomy_b, name_a: str = "A", name_b: str = "B") -> None:
    """Refuse, in one line, two models of different kinds (GPT-2, Qwen3, Gemma 3, ...): their tensors have other names."""
    if kind_name(anatomy_a) != kind_name(anatomy_b):
        raise GlassError(f"{name_a} is a {kind_name(anatomy_a)} model and {name_b} is a {kind_name(anatomy_b)} model: "
                         "diff compares two models of one family and one shape (explain --compare sets different "
                         "models side by side)")


def _unseen_settings(cfg_a: Any, cfg_b: Any, name_a: str, name_b: str) -> list[str]:
    """A note naming the config fields that differ although no tensor shows it (the shapes are equal by now)."""
    if not dataclasses.is_dataclass(cfg_a) or type(cfg_a) is not type(cfg_b):
        return []
    differ = [f"{f.name} {getattr(cfg_a, f.name)} in {name_a} and {getattr(cfg_b, f.name)} in {name_b}"
              for f in dataclasses.fields(cfg_a)
              if f.name not in TIE_FIELDS and getattr(cfg_a, f.name) != getattr(cfg_b, f.name)]
    if not differ:
        return []
    return [f"the configs differ where no tensor shows it ({'; '.join(differ)}): the same tensors compute "
            "otherwise, so the predictions differ beyond the weights' changes"]


def check_same_shapes(cfg_a: Any, cfg_b: Any, name_a: str = "A", name_b: str = "B") -> None:
    """diff's check from the configs alone, before any weights load (the models are built on the meta device)."""
    with on_meta():  # (no initial weights drawn: nothing to draw into)
        model_a, model_b = glass_model(cfg_a), glass_model(cfg_b)
    anatomy_a, anatomy_b = describe(model_a), describe(model_b)
    check_same_kind(anatomy_a, anatomy_b, name_a, name_b)
    _comparable(model_a.state_dict(), model_b.state_dict(), name_a, name_b,
                getattr(cfg_a, "num_classes", None) != getattr(cfg_b, "num_classes", None), anatomy_a.name != "GPT-2")


def _comparable(sa: dict, sb: dict, name_a: str, name_b: str, new_head: bool,
                family: bool = False) -> tuple[dict, dict]:
    """The two state dicts without a replaced head; refused in one line naming the first tensor that the
    two models do not share, with both shapes."""
    if new_head:
        sa = {k: v for k, v in sa.items() if k not in HEAD}
        sb = {k: v for k, v in sb.items() if k not in HEAD}
    for name in list(sa) + [k for k in sb if k not in sa]:
        got_a = shape(list(sa[name].shape)) if name in sa else "missing"
        got_b = shape(list(sb[name].shape)) if name in sb else "missing"
        if got_a != got_b:
            fields = "sizes, heads, key/value groups, head_dim" if family else "sizes, qkv_bias, context_length"
            raise GlassError(f"{name_a} and {name_b} have different shapes: {name} is {got_a} in {name_a} and {got_b} "
                             f"in {name_b}: diff compares models of the same config ({fields})")
    return sa, sb

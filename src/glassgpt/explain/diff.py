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

Qwen3 and Llama 3.2 (families/) are diffed the same way under the book's names (tok_emb,
trf_blocks.N.att.W_query, q_norm, ff.fc1/fc2/fc3, final_norm, out_head; no pos_emb). Two models of
different families, or a family model and a GPT-2, are refused in one line naming the first
difference. Settings that no tensor holds (rope_base, the head split, norm_eps) are compared too:
a difference there changes the predictions beyond what the weights say, and a note names it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..adopt import adopt, check_computable
from ..config import GPTConfig
from ..errors import GlassError
from ..families import FamilyConfig, build_model, is_family_model
from ..formats.checks import on_meta
from ..model import GPTModel
from .trace import FAMILY_NAMES
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
# The settings of a family's config that no tensor holds: equal shapes, yet another computation.
UNSEEN_SETTINGS = ("n_heads", "n_kv_groups", "rope_base", "rope_freq", "norm_eps", "context_length")


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
    family: str | None = None                # "qwen3" or "llama3" for two family models; None: GPT-2

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
    check_same_kind(model_a.cfg, model_b.cfg, name_a, name_b)
    sa, sb = model_a.state_dict(), model_b.state_dict()
    replaced = None
    if model_a.cfg.num_classes != model_b.cfg.num_classes:
        replaced = {"a": {k: list(sa[k].shape) for k in HEAD if k in sa},
                    "b": {k: list(sb[k].shape) for k in HEAD if k in sb}}
    sa, sb = _comparable(sa, sb, name_a, name_b, replaced is not None, is_family_model(model_a))
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
    family = model_a.cfg.family if is_family_model(model_a) else None
    notes = []
    if family is not None:
        notes += _unseen_settings(model_a.cfg, model_b.cfg, name_a, name_b)
        if model_a.tied != model_b.tied:  # told by storage: one Parameter for both, or two tensors
            tied, own = (name_a, name_b) if model_a.tied else (name_b, name_a)
            notes.append(f"out_head.weight is tok_emb.weight's own storage in {tied} (tied) and a tensor of its own "
                         f"in {own}: its row compares their values")
    elif model_a.cfg.n_heads != model_b.cfg.n_heads:
        notes.append(f"the head counts differ ({model_a.cfg.n_heads} and {model_b.cfg.n_heads}): the same shapes, "
                     "split into heads another way")
    return WeightDiff(name_a, name_b, tensors, replaced, notes, family)


def kind_name(cfg: GPTConfig | FamilyConfig) -> str:
    """GPT-2, Qwen3 or Llama 3: which model a config builds."""
    return FAMILY_NAMES[cfg.family] if isinstance(cfg, FamilyConfig) else "GPT-2"


def check_same_kind(cfg_a: GPTConfig | FamilyConfig, cfg_b: GPTConfig | FamilyConfig, name_a: str = "A",
                    name_b: str = "B") -> None:
    """Refuse, in one line, two models of different kinds (GPT-2, Qwen3, Llama 3): their tensors have other names."""
    if kind_name(cfg_a) != kind_name(cfg_b):
        raise GlassError(f"{name_a} is a {kind_name(cfg_a)} model and {name_b} is a {kind_name(cfg_b)} model: diff "
                         "compares two models of one family and one shape (explain --compare sets different models "
                         "side by side)")


def _unseen_settings(cfg_a: FamilyConfig, cfg_b: FamilyConfig, name_a: str, name_b: str) -> list[str]:
    """A note naming the settings that differ although no tensor shows it."""
    differ = [f"{k} {getattr(cfg_a, k)} in {name_a} and {getattr(cfg_b, k)} in {name_b}" for k in UNSEEN_SETTINGS
              if getattr(cfg_a, k) != getattr(cfg_b, k)]
    if not differ:
        return []
    return [f"the configs differ where no tensor shows it ({'; '.join(differ)}): the same tensors compute "
            "otherwise, so the predictions differ beyond the weights' changes"]


def check_same_shapes(cfg_a: GPTConfig | FamilyConfig, cfg_b: GPTConfig | FamilyConfig, name_a: str = "A",
                      name_b: str = "B") -> None:
    """diff's check from the configs alone, before any weights load (the models are built on the meta device)."""
    check_same_kind(cfg_a, cfg_b, name_a, name_b)
    family = isinstance(cfg_a, FamilyConfig)
    with on_meta():  # (no initial weights drawn: nothing to draw into)
        sa, sb = ((build_model if family else GPTModel)(cfg).state_dict() for cfg in (cfg_a, cfg_b))
    _comparable(sa, sb, name_a, name_b, cfg_a.num_classes != cfg_b.num_classes, family)


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

"""Two models' weights, tensor by tensor: what training or finetuning changed, and what it left alone.

    diff_weights(model_a, model_b) -> WeightDiff

For every tensor of the state dict, the relative change ||B - A|| / ||A|| (Frobenius norms;
1 means the change is as large as the tensor itself) and whether it moved at all (any
element differs: a frozen tensor is bit for bit the same). Tensors are grouped as the book
draws the model: tok_emb, pos_emb, each of trf_blocks (norm1, att, norm2, ff), final_norm,
out_head. A finetuned classifier's head, [classes, d] where the language model's was [V, d],
is reported as replaced. Models of other shapes are refused, naming the first tensor that
differs.

Views: `diff_text` (a table) and `diff_layout` (a grid: one row per block, one cell per
tensor, coloured by the change on a log scale, blank where nothing moved).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..adopt import adopt
from ..config import GPTConfig
from ..errors import GlassError
from ..model import GPTModel
from .views.draw import GRAY, INK, MUTED, ORANGE, Drawing, Rect, Text, header, wrap
from .compare import bar_columns
from .views.notation import shape

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
class WeightDiff:
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


# --- the text view --------------------------------------------------------------------------

def _bar(rel: float | None) -> str:
    """Four characters per factor of 10, from 1e-6 (none) to 1 (24): a log scale."""
    if rel is None or rel <= 0:
        return ""
    return "█" * max(1, min(24, round(4 * (math.log10(min(rel, 1.0)) + 6))))


def _value(t: TensorChange) -> str:
    if not t.moved:
        return "did not move"
    return f"{t.rel_change:.2e}" if t.rel_change is not None else f"from 0 by {t.change:.1e}"


def diff_text(d: WeightDiff) -> str:
    lines = [f"glassgpt diff: how far each tensor moved from A = {d.a} to B = {d.b}",
             "  ||B - A|| / ||A||, grouped as the book draws the model; bars on a log scale (4 per factor of 10, "
             "full at 1)"]
    lines += [f"note: {n}" for n in d.notes]
    groups: dict[str, list[TensorChange]] = {}
    for t in d.tensors:
        groups.setdefault(t.group, []).append(t)
    still: list[str] = []  # a run of groups where nothing moved, shown as one line

    def flush() -> None:
        if still:
            span = still[0] if len(still) == 1 else f"{still[0]} .. {still[-1]}"
            n = sum(len(groups[g]) for g in still)
            lines.append(f"  {span}: did not move (none of its {n} tensors)")
            still.clear()

    for group, tensors in groups.items():
        if not any(t.moved for t in tensors):
            still.append(group)
            continue
        flush()
        lines.append(f"  {group}")
        for t in tensors:
            short = t.name[len(group) + 1:] or t.name
            value = _value(t)
            tied = f"  (= {t.tied_to}, tied)" if t.tied_to else ""
            lines.append(f"    {short:<24} {shape(t.shape):<16} {value:>16}  {_bar(t.rel_change)}{tied}")
    flush()
    if d.replaced:
        lines.append(f"  out_head: replaced, {_head_shapes(d.replaced['a'])} in A and {_head_shapes(d.replaced['b'])} "
                     "in B (a new head: nothing to compare it with)")
    lines += ["", summary(d)]
    return "\n".join(lines)


def _head_shapes(shapes: dict[str, list[int]]) -> str:
    return " + ".join(f"{k.split('.')[-1]} {shape(v)}" for k, v in shapes.items())


def summary(d: WeightDiff) -> str:
    """One line: which groups moved (with how many of their tensors), and which did not move at all."""
    moved: dict[str, int] = {}
    for t in d.tensors:
        if t.moved:
            moved[t.group] = moved.get(t.group, 0) + 1
    still = [g for g in dict.fromkeys(t.group for t in d.tensors) if g not in moved]
    head = "; out_head was replaced" if d.replaced else ""
    what = ", ".join(f"{g} ({n})" for g, n in moved.items()) or "nothing"
    return (f"moved: {len(d.moved)} of {len(d.tensors)} tensors: {what}{head}. "
            f"Did not move at all: {_runs(still) or 'nothing'}.")


def _runs(groups: list[str]) -> str:
    """tok_emb, pos_emb, trf_blocks.0 .. trf_blocks.10 (consecutive blocks joined)."""
    out: list[list[str]] = []
    for g in groups:
        if out and g.startswith("trf_blocks.") and out[-1][-1].startswith("trf_blocks.") and \
                int(g.split(".")[1]) == int(out[-1][-1].split(".")[1]) + 1:
            out[-1].append(g)
        else:
            out.append([g])
    return ", ".join(run[0] if len(run) == 1 else f"{run[0]} .. {run[-1]}" for run in out)


# --- the picture ----------------------------------------------------------------------------

CELL_W, CELL_H, LABEL_W = 44, 20, 130


def diff_layout(d: WeightDiff, comparison=None, width: float = 1040) -> Drawing:
    """The grid of changes (and, given a Comparison, both models' next tokens below it)."""
    out = Drawing()
    y = header(out, f"glassgpt diff · A = {d.a} · B = {d.b}",
               ["||B - A|| / ||A|| per tensor, as the book draws the model; darker is a larger change, "
                "blank: did not move at all"] + [f"note: {n}" for n in d.notes], width)
    moved = [t.rel_change for t in d.tensors if t.moved and t.rel_change]
    scale = (math.log10(min(moved)), math.log10(max(moved))) if moved else (0.0, 0.0)
    y = _grid(out, d, 30, y + 30, scale)
    y = _legend(out, 30, y + 10, scale)
    for part in wrap(summary(d), width - 60, 12):
        y += 18
        out.add(Text(30, y, part, 12, color=INK, key="summary"))
    if comparison is not None:
        y = bar_columns(out, comparison, y + 40, width)
        kl = (f"KL(A || B) = {comparison.kl_ab:.4f} nats, KL(B || A) = {comparison.kl_ba:.4f} nats on "
              f"“{comparison.prompt}”" if comparison.kl_ab is not None else "no KL: the heads score different things")
        y += 20
        out.add(Text(30, y, kl, 12, color=MUTED))
    return out.fit_canvas(width, y + 10)


def _colour(rel: float | None, scale: tuple[float, float]) -> str:
    """White to orange on a log scale between the smallest and largest change; a change from 0 is the darkest."""
    lo, hi = scale
    f = 1.0 if hi <= lo or rel is None else (math.log10(rel) - lo) / (hi - lo)
    f = 0.15 + 0.85 * min(1.0, max(0.0, f))
    r, g, b = (round(255 + (c - 255) * f) for c in (217, 99, 30))  # white -> ORANGE
    return f"#{r:02x}{g:02x}{b:02x}"


def _cell(out: Drawing, x: float, y: float, t: TensorChange | None, scale) -> None:
    if t is None:
        return  # this model has no such tensor (no qkv biases)
    fill = _colour(t.rel_change, scale) if t.moved else "white"
    out.add(Rect(x, y, CELL_W - 4, CELL_H - 4, fill, GRAY, width=0.5, key=f"cell:{t.name}:{'moved' if t.moved else 'still'}"))


def _grid(out: Drawing, d: WeightDiff, x0: float, y: float, scale) -> float:
    by_name = {t.name: t for t in d.tensors}
    x = x0 + LABEL_W
    for module, params in BLOCK_PARTS:  # two header lines: the module over its columns, then each tensor
        out.add(Text(x + CELL_W - 2, y, module.replace("att.", "").replace("ff.layers.", "ff."), 10, True, MUTED,
                     anchor="middle"))
        for k, param in enumerate(params):
            out.add(Text(x + k * CELL_W + CELL_W / 2 - 2, y + 13, {"weight": "W", "bias": "b"}.get(param, param), 9,
                         color=MUTED, anchor="middle"))
        x += CELL_W * len(params)
    y += 22
    blocks = sorted({t.group for t in d.tensors if t.group.startswith("trf_blocks.")}, key=lambda g: int(g.split(".")[1]))
    for group in ["tok_emb", "pos_emb"] + blocks + ["final_norm", "out_head"]:
        if group.startswith("trf_blocks."):
            names = [f"{group}.{m}.{p}" for m, ps in BLOCK_PARTS for p in ps]
        else:
            names = [n for n in by_name if by_name[n].group == group]
        out.add(Text(x0 + LABEL_W - 8, y + 12, group, 11, anchor="end", mono=True))
        for k, name in enumerate(names):
            _cell(out, x0 + LABEL_W + k * CELL_W, y, by_name.get(name), scale)
        if group == "out_head" and d.replaced:
            out.add(Text(x0 + LABEL_W, y + 12, f"replaced: {_head_shapes(d.replaced['a'])} → "
                                               f"{_head_shapes(d.replaced['b'])}", 11, color=ORANGE, bold=True))
        y += CELL_H
    return y


def _legend(out: Drawing, x: float, y: float, scale) -> float:
    lo, hi = scale
    out.add(Text(x, y + 12, "change:", 11, color=MUTED))
    for k in range(6):
        value = 10 ** (lo + (hi - lo) * k / 5)
        out.add(Rect(x + 60 + k * 70, y, 24, 14, _colour(value, scale), GRAY, width=0.5))
        out.add(Text(x + 88 + k * 70, y + 12, f"{value:.0e}", 10, color=MUTED))
    out.add(Rect(x + 60 + 6 * 70, y, 24, 14, "white", GRAY, width=0.5))
    out.add(Text(x + 88 + 6 * 70, y + 12, "did not move", 10, color=MUTED))
    return y + 20

"""The views of a WeightDiff (diff.py): a table, its summary, and the picture (one row per block, one
cell per tensor, coloured by the change on a log scale, blank where nothing moved).
"""

from __future__ import annotations

import math

from ..diff import BLOCK_PARTS, FAMILY_BLOCK_PARTS, TensorChange, WeightDiff, block_index
from ..notation import shape
from .compare import bar_columns
from .draw import GRAY, INK, MUTED, ORANGE, Drawing, Rect, Text, header, wrap



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
    of = f" (two {d.model} models)" if d.model != "GPT-2" else ""
    lines = [f"glassgpt diff: how far each tensor moved from A = {d.a} to B = {d.b}{of}",
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


def block_parts(d: WeightDiff) -> list[tuple[str, tuple[str, ...]]]:
    """The grid's columns: GPT-2's block as the book draws it, a Qwen3/Llama block's tensors in the book's order,
    or any other model's first block's tensors in its own order."""
    if d.model == "GPT-2":
        return BLOCK_PARTS
    first = f"{d.blocks}.0."
    names = [t.name[len(first):] for t in d.tensors if t.name.startswith(first)]
    parts = [(m, tuple(p for p in ps if f"{m}.{p}" in names)) for m, ps in FAMILY_BLOCK_PARTS]
    parts = [(m, ps) for m, ps in parts if ps]
    if sum(len(ps) for _, ps in parts) == len(names):
        return parts
    found: dict[str, list[str]] = {}
    for name in names:
        module, _, param = name.rpartition(".")
        found.setdefault(module, []).append(param)
    return [(m, tuple(ps)) for m, ps in found.items()]


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
        if out and block_index(g) is not None and block_index(out[-1][-1]) is not None and \
                block_index(g) == block_index(out[-1][-1]) + 1:
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
    parts = block_parts(d)
    for module, params in parts:  # two header lines: the module over its columns, then each tensor
        out.add(Text(x + CELL_W * len(params) / 2 - 2, y, module.replace("att.", "").replace("ff.layers.", "ff."),
                     10 if len(params) > 1 else 9, True, MUTED, anchor="middle"))
        for k, param in enumerate(params):
            out.add(Text(x + k * CELL_W + CELL_W / 2 - 2, y + 13, {"weight": "W", "bias": "b"}.get(param, param)
                         if module.startswith(("att.", "ff.")) or d.model == "GPT-2" else param, 9,
                         color=MUTED, anchor="middle"))
        x += CELL_W * len(params)
    y += 22
    groups = list(dict.fromkeys(t.group for t in d.tensors))  # as the state dict orders them
    groups += ["out_head"] if "out_head" not in groups else []  # (a replaced head: its row says so)
    for group in groups:  # no pos_emb row for a RoPE model: RoPE has no weights
        if block_index(group) is not None:
            names = [f"{group}.{m}.{p}" for m, ps in parts for p in ps]
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

"""The pieces, seen: a text's sliding windows (explain --windows, show(GPTDatasetV1, text)), and a checked
piece's picture in a notebook: the attention weights as the reader's class produced them beside
glassgpt's, the windows the reader's dataset made beside the book's, and the finding. show(piece,
input) is the notebook's one call for a whole model or any piece.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...tokenizer import get_tokenizer
from ..pieces import DEFAULT_TEXT, check, is_whole_model, is_dataset_class, sliding_windows
from ..pieces.data import SlidingWindows, check_windows, loader_windows, windows_of
from ..pieces.report import PieceResult
from . import draw
from .draw import BLUE, BLUE_BG, GRAY, GREEN, INK, MUTED, ORANGE, ORANGE_BG, RED, Drawing, Rect, Text
from .notebook import figure_html, show as show_model

MAX_SHOWN = 12  # windows drawn or printed; the rest are counted


def windows_text(w: SlidingWindows) -> str:
    """The terminal view of a text's windows: each window's tokens, inputs and targets."""
    lines = [f"sliding windows: {len(w.ids)} tokens, max_length {w.max_length}, stride {w.stride} -> "
             f"{len(w.inputs)} windows (GPTDatasetV1)", _overlap_line(w), ""]
    for k, (x, y) in enumerate(zip(w.inputs[:MAX_SHOWN], w.targets[:MAX_SHOWN])):
        start = k * w.stride
        lines.append(f"window {k}: tokens {start}..{start + w.max_length - 1}")
        lines.append(f"  inputs  {x}  {_words(w, x)}")
        lines.append(f"  targets {y}  {_words(w, y)}")
    if len(w.inputs) > MAX_SHOWN:
        lines.append(f"... and {len(w.inputs) - MAX_SHOWN} more windows")
    lines.append("each target is the input one token later: position j of a window learns to predict token j + 1")
    return "\n".join(lines)


def _overlap_line(w: SlidingWindows) -> str:
    if w.overlap > 0:
        return f"overlap: each window shares {w.overlap} input tokens with the next (stride < max_length)"
    if w.overlap == 0:
        return "overlap: none; every token is in exactly one window's inputs (stride == max_length)"
    return f"overlap: none, and {-w.overlap} tokens between windows are in no input (stride > max_length)"


def _words(w: SlidingWindows, ids: list[int]) -> str:
    return " ".join(repr(w.tokens[w.ids.index(i)]) if i in w.ids else str(i) for i in ids)


def windows_html(w: SlidingWindows) -> str:
    return figure_html(windows_layout(w), windows_text(w).splitlines()[:2])


def windows_layout(w: SlidingWindows, reader: Any = None, width: float = 1040) -> Drawing:
    """The token row, then one row per window: inputs in blue, targets in orange, one token later.
    `reader`: the reader's windows (data.Windows), drawn red where they differ from the book's."""
    d = Drawing()
    d.add(Text(20, 28, f"max_length {w.max_length}, stride {w.stride}, overlap {max(w.overlap, 0)}", size=14,
               bold=True))
    cell, x0, y = 34.0, 20.0, 44.0
    n = min(len(w.ids), int((width - 2 * x0) // cell))
    for j in range(n):
        d.add(Rect(x0 + j * cell, y, cell - 2, 22, fill="white", stroke=GRAY, width=1, key=f"token:{j}"))
        d.add(Text(x0 + j * cell + cell / 2 - 1, y + 15, draw.fit(w.tokens[j].strip() or "␣", cell - 4, 10),
                   size=10, anchor="middle", mono=True))
    for k in range(min(len(w.inputs), MAX_SHOWN)):
        y += 30
        start = k * w.stride
        mine = reader.inputs[k] if reader is not None and k < len(reader.inputs) else None
        for j in range(w.max_length):
            for row, fill, stroke, off in (("in", BLUE_BG, BLUE, 0), ("target", ORANGE_BG, ORANGE, 1)):
                col = start + j + off
                if col >= n:
                    continue
                wrong = mine is not None and row == "in" and (j >= len(mine) or mine[j] != w.inputs[k][j])
                d.add(Rect(x0 + col * cell, y + (0 if row == "in" else 12), cell - 2, 10, fill=fill,
                           stroke=RED if wrong else stroke, width=2 if wrong else 1, key=f"window:{k}:{row}:{j}"))
        d.add(Text(x0 + min(start + w.max_length + 1, n) * cell + 6, y + 16, f"window {k}", size=11, color=MUTED))
    d.add(Text(20, y + 46, "blue: inputs; orange: targets (the same tokens, one later)", size=12, color=MUTED))
    return d.fit_canvas(width, y + 52)


def attention_layout(result: PieceResult, width: float = 1040) -> Drawing:
    """The reader's attention weights (first batch row, each head) beside glassgpt's, NaN cells in red."""
    d = Drawing()
    d.add(Text(20, 28, f"glassgpt check: {result.kind}", size=16, bold=True))
    mine, book = result.views["reader_weights"], result.views["book_weights"]
    y = 50.0
    for title, weights, x0 in (("yours", mine, 20.0), ("glassgpt's", book, width / 2)):
        d.add(Text(x0, y, title, size=13, bold=True, color=INK))
        if weights is None:
            d.add(Text(x0, y + 20, "no softmax was seen", size=12, color=MUTED))
            continue
        grids = _grids(weights)
        cell = min(22.0, (width / 2 - 40) / max(1, sum(g.shape[-1] + 1 for g in grids)))
        for h, grid in enumerate(grids):
            gx = x0 + h * (grid.shape[-1] + 1) * cell
            for i in range(grid.shape[0]):
                for j in range(grid.shape[1]):
                    v = float(grid[i, j])
                    fill = RED if v != v else _blue(v)
                    d.add(Rect(gx + j * cell, y + 10 + i * cell, cell - 1, cell - 1, fill=fill, stroke=fill, width=0,
                               key=f"{title}:{h}:{i}:{j}"))
    rows = max(g.shape[0] for g in _grids(book))
    bottom = y + 10 + rows * 22 + 20
    d.add(Text(20, bottom, draw.fit(result.finding, width - 40, 13), size=13, color=RED if not result.ok else GREEN))
    d.add(Text(20, bottom + 18, "darker: more weight; red: NaN; one square per (query row, key column), "
                                "each head its own grid", size=11, color=MUTED))
    return d.fit_canvas(width, bottom + 24)


def _grids(weights: torch.Tensor) -> list[torch.Tensor]:
    w = weights.detach().double()
    while w.dim() > 3:
        w = w[0]  # the first batch row
    return [w] if w.dim() == 2 else list(w)


def _blue(v: float) -> str:
    v = min(max(v, 0.0), 1.0)
    r, g, b = (int(255 - (255 - c) * v) for c in (31, 111, 209))
    return f"#{r:02x}{g:02x}{b:02x}"


def piece_layout(result: PieceResult, width: float = 1040) -> Drawing:
    if result.views.get("reader_weights") is not None and "book_weights" in result.views:
        return attention_layout(result, width)
    if result.views.get("windows"):
        first = result.views["windows"][-1 if result.ok else len(result.views["windows"]) - 1]
        book = first["book"]
        w = SlidingWindows("", first["ids"], [get_tokenizer("gpt2").decode([i]) for i in first["ids"]],
                           first["max_length"], first["stride"], book.inputs, book.targets)
        return windows_layout(w, first["reader"], width)
    d = Drawing()
    d.add(Text(20, 28, f"glassgpt check: {result.kind}", size=16, bold=True))
    d.add(Text(20, 54, draw.fit(result.finding, width - 40, 13), size=13, color=GREEN if result.ok else RED))
    return d.fit_canvas(width, 60)


def piece_html(result: PieceResult) -> str:
    return figure_html(piece_layout(result), result.to_text().splitlines())


def show(piece: Any, input: Any = None, tokenizer: Any = None) -> Any:
    """In a notebook, any piece as a picture: a whole model's trace of the text `input`; a dataset class
    (or create_dataloader_v1) with a text, its windows beside the book's; a text alone, the book's
    windows (`input`: {"max_length": .., "stride": ..}); any other piece checked and drawn (attention
    weights as its softmax returned them, beside glassgpt's), on `input` (a tensor) or the book's input."""
    if isinstance(piece, str):
        return sliding_windows(piece, **(input or {}), tokenizer=tokenizer)
    if isinstance(piece, nn.Module) and is_whole_model(piece):
        return show_model(piece, input or DEFAULT_TEXT, tokenizer)
    if isinstance(input, str) and isinstance(piece, type) and is_dataset_class(piece):
        return check_windows(lambda text, tok, L, s: windows_of(piece(text, tok, L, s)), piece.__name__, input)
    if isinstance(input, str) and getattr(piece, "__name__", "") == "create_dataloader_v1":
        return check_windows(lambda text, _tok, L, s: loader_windows(piece(text, batch_size=2, max_length=L,
                                                                            stride=s, shuffle=False)),
                             piece.__name__, input, batch_size=2)
    return check(piece, inputs=input if torch.is_tensor(input) else None)

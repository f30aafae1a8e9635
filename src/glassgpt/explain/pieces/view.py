"""The pieces, seen: a text's sliding windows (explain --windows, show(GPTDatasetV1, text)), and a checked
piece's picture in a notebook: the attention weights as the reader's class produced them beside
glassgpt's, the windows the reader's dataset made beside the book's, and the finding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...tokenizer import Tokenizer, get_tokenizer
from .. import draw
from ..draw import BLUE, BLUE_BG, GRAY, GREEN, INK, MUTED, ORANGE, ORANGE_BG, RED, Drawing, Rect, Text
from ..notebook import figure_html
from .data import book_windows
from .report import PieceError, PieceResult

MAX_SHOWN = 12  # windows drawn or printed; the rest are counted


@dataclass
class SlidingWindows:
    """GPTDatasetV1's windows over a text: window k's inputs are ids[k*stride : k*stride + max_length],
    its targets the same one token later."""

    text: str
    ids: list[int]
    tokens: list[str]
    max_length: int
    stride: int
    inputs: list[list[int]]
    targets: list[list[int]]

    @property
    def overlap(self) -> int:
        """Tokens each window shares with the next one's inputs (negative: tokens no input holds)."""
        return self.max_length - self.stride

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "ids": self.ids, "tokens": self.tokens, "max_length": self.max_length,
                "stride": self.stride, "overlap": self.overlap, "inputs": self.inputs, "targets": self.targets}

    def to_text(self) -> str:
        lines = [f"sliding windows: {len(self.ids)} tokens, max_length {self.max_length}, stride {self.stride} -> "
                 f"{len(self.inputs)} windows (GPTDatasetV1)", self._overlap_line(), ""]
        for k, (x, y) in enumerate(zip(self.inputs[:MAX_SHOWN], self.targets[:MAX_SHOWN])):
            start = k * self.stride
            lines.append(f"window {k}: tokens {start}..{start + self.max_length - 1}")
            lines.append(f"  inputs  {x}  {self._words(x)}")
            lines.append(f"  targets {y}  {self._words(y)}")
        if len(self.inputs) > MAX_SHOWN:
            lines.append(f"... and {len(self.inputs) - MAX_SHOWN} more windows")
        lines.append("each target is the input one token later: position j of a window learns to predict token j + 1")
        return "\n".join(lines)

    def _overlap_line(self) -> str:
        if self.overlap > 0:
            return f"overlap: each window shares {self.overlap} input tokens with the next (stride < max_length)"
        if self.overlap == 0:
            return "overlap: none; every token is in exactly one window's inputs (stride == max_length)"
        return f"overlap: none, and {-self.overlap} tokens between windows are in no input (stride > max_length)"

    def _words(self, ids: list[int]) -> str:
        return " ".join(repr(self.tokens[self.ids.index(i)]) if i in self.ids else str(i) for i in ids)

    def _repr_html_(self) -> str:
        return figure_html(windows_layout(self), self.to_text().splitlines()[:2])


def sliding_windows(text: str, max_length: int = 4, stride: int | None = None,
                    tokenizer: Tokenizer | None = None) -> SlidingWindows:
    """The book's windows over `text` (GPT-2's tokenizer unless one is given); stride defaults to max_length."""
    stride = max_length if stride is None else stride
    if max_length < 1 or stride < 1:
        raise PieceError(f"max_length {max_length} and stride {stride} must be at least 1")
    tok = tokenizer or get_tokenizer("gpt2")
    ids = tok.encode(text, allowed_special={"<|endoftext|>"})
    if len(ids) <= max_length:
        raise PieceError(f"the text is {len(ids)} tokens: a window needs max_length + 1 = {max_length + 1} "
                         f"(its targets run one token further); give a longer text or a smaller max_length")
    w = book_windows(ids, max_length, stride)
    return SlidingWindows(text, ids, [tok.decode([i]) for i in ids], max_length, stride, w.inputs, w.targets)


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


PieceResult._repr_html_ = piece_html

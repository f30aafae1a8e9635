"""What a piece check found, and the comparisons every piece shares.

A PieceResult holds the kind of piece, the first thing that differs from glassgpt's formula (the
output, a row of the attention weights, a position, a window, a token), the known mistake that
reproduces it, and one sentence. The comparisons are NaN-aware: a NaN in the reader's numbers is
never a match, except against a formula with a mistake that makes the same NaN in the same place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ...errors import GlassError
from ..result import Result

# A piece matches when max |reader - glassgpt| <= RTOL * max |glassgpt| (float32 against float64:
# rounding stays some 10x below it, every known mistake far above it).
RTOL = 1e-5


class PieceError(GlassError):
    """A piece glassgpt cannot check: not a kind it knows, or it cannot be built or run."""


@dataclass
class PieceResult(Result):
    """What `check(piece)` found: the first thing that differs (None: none) and one sentence. Its text is
    to_text here; its picture and notebook cell are views/pieces.py's."""

    kind: str
    fed: str                                 # what the piece was given, in words
    stage: str | None = None                 # "output", "attention weights", "windows", "tokens", ...
    where: str | None = None                 # "row 0", "position 3", "window 1", "token 5"
    mistake: str | None = None               # the key of the known mistake that reproduces it
    prop: str | None = None                  # the property of the formula that breaks (properties.py's key)
    finding: str = ""
    lines: list[str] = field(default_factory=list)        # what was compared, one line each
    views: dict[str, Any] = field(default_factory=dict)   # what show() draws: the reader's and the book's

    @property
    def ok(self) -> bool:
        return self.stage is None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "fed": self.fed, "ok": self.ok, "stage": self.stage, "where": self.where,
                "mistake": self.mistake, "property": self.prop, "finding": self.finding, "lines": self.lines}

    def to_text(self) -> str:
        head = [f"glassgpt check: {self.kind}", f"  fed {self.fed}"]
        return "\n".join(head + [f"  {line}" for line in self.lines] + ["", self.finding])


def as_double(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64)


def tolerance(want: torch.Tensor) -> float:
    finite = want[torch.isfinite(want)]
    return RTOL * max(float(finite.abs().max()) if finite.numel() else 0.0, 1e-30)


def same(got: torch.Tensor, want: torch.Tensor, tol: float | None = None) -> bool:
    """got equals want to `tol` (default: RTOL of want's scale), NaN matching NaN and inf the same inf."""
    if tuple(got.shape) != tuple(want.shape):
        return False
    got, want = as_double(got), as_double(want)
    tol = tolerance(want) if tol is None else tol
    both = (got == want) | (got.isnan() & want.isnan())
    close = torch.where(both, torch.zeros_like(got), (got - want).abs())
    return bool((torch.nan_to_num(close, nan=math.inf) <= tol).all())


def largest_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = as_double(got), as_double(want)
    both = (got == want) | (got.isnan() & want.isnan())
    diff = torch.where(both, torch.zeros_like(got), (got - want).abs())
    return float(torch.nan_to_num(diff, nan=math.inf).max()) if diff.numel() else 0.0


def first_row_that_differs(got: torch.Tensor, want: torch.Tensor) -> tuple[int, ...]:
    """The index (all but the last dim) of the first row of got that differs from want, rows in the
    order of positions: for [b, h, t, s] weights the lowest query t first, then the batch and head."""
    got, want = as_double(got), as_double(want)
    both = (got == want) | (got.isnan() & want.isnan())
    bad = ~both & ~((got - want).abs() <= tolerance(want))  # NaN differences count as differing
    rows = bad.any(-1)  # [..., t]
    if rows.dim() == 0:
        return ()
    by_position = rows.movedim(-1, 0).reshape(rows.shape[-1], -1)  # [t, rest]
    hit = torch.nonzero(by_position)
    if not hit.numel():
        return ()
    t, rest = int(hit[0, 0]), int(hit[0, 1])
    lead = torch.unravel_index(torch.tensor(rest), rows.shape[:-1]) if rows.dim() > 1 else ()
    return (*[int(i) for i in lead], t)


def reproducing(got: torch.Tensor, variants: dict[str, Callable[[], torch.Tensor | None]]) -> str | None:
    """The first known mistake whose formula gives the reader's numbers (NaNs in the same places)."""
    for name, fn in variants.items():
        try:
            want = fn()
        except Exception:  # a mistake that cannot run on these shapes reproduces nothing
            continue
        if want is not None and same(got, want):
            return name
    return None


def non_finite(t: torch.Tensor) -> str | None:
    if bool(torch.isnan(t).any()):
        return "NaN"
    if bool(torch.isinf(t).any()):
        return "inf"
    return None


def found(result: PieceResult, broken, mistake: str | None, lines: dict[str, str], prefix: str = "") -> PieceResult:
    """Fill in `result` from a broken property (properties.Broken) and the catalogue's mistake that
    reproduces it (its line, from `lines`), if one does."""
    result.stage, result.where, result.prop, result.mistake = broken.stage, broken.where, broken.prop, mistake
    result.finding = prefix + broken.words + (f". The line: {lines[mistake]}" if mistake else "")
    return result


def run_reader(what: str, fn: Callable[[], Any]) -> Any:
    """fn() (the reader's own code), its failure turned into one line that says where."""
    try:
        return fn()
    except GlassError:
        raise
    except Exception as err:
        raise PieceError(f"{what} failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                         ) from None

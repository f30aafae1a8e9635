"""How every view of explain writes a shape, a token and a number: one spelling for all of them."""

from __future__ import annotations

from typing import Sequence


def shape(dims: Sequence[int] | None) -> str:
    """[1, 4, 768]; "" for no shape."""
    return "[" + ", ".join(str(n) for n in dims) + "]" if dims is not None else ""


def clip(text: str, n: int) -> str:
    """`text` cut to n characters, the last one an ellipsis when something was cut."""
    return text if len(text) <= n else text[: n - 1] + "…"


def token(text: str, n: int = 18) -> str:
    """A token as Python writes it (' know', '\\n'), so that its spaces show: clipped to n."""
    return clip(repr(text), n)


def numel(dims: Sequence[int] | None) -> int:
    n = 1
    for s in dims or []:
        n *= s
    return n


def rank(n: int) -> str:
    """1st, 2nd, 3rd, 11th, 3,102nd."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n:,}{suffix}"

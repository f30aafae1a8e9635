"""How every view of explain writes a shape, a token and a number: one spelling for all of them."""

from __future__ import annotations

from typing import Sequence


def shape(dims: Sequence[int] | None) -> str:
    """[1, 4, 768]; "" for no shape."""
    return "[" + ", ".join(str(n) for n in dims) + "]" if dims is not None else ""


def sizes(dims: Sequence[int]) -> str:
    """[1, 151,936]: a shape with its thousands marked, as the rotary trace's views write it."""
    return "[" + ", ".join(f"{n:,}" for n in dims) + "]"


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


# What a finetuning run did to each part, as its checkpoint records it (training's trained_parts).
TRAINED_STATES = {"trained": "trained", "lora": "trained through LoRA (merged)", "partly trained": "partly trained",
                  "frozen": "frozen"}


def parts(names: Sequence[str]) -> str:
    """tok_emb, trf_blocks.0..10, out_head: consecutive blocks as one range."""
    out: list = []  # a name, or [first, last] of a run of blocks
    for name in names:
        i = int(name.split(".")[1]) if name.startswith("trf_blocks.") else None
        if i is not None and out and isinstance(out[-1], list) and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append(name if i is None else [i, i])
    return ", ".join(x if isinstance(x, str) else f"trf_blocks.{x[0]}" + (f"..{x[1]}" if x[1] > x[0] else "")
                     for x in out)


def trained_line(trained: dict[str, str]) -> str:
    """'trained: trf_blocks.11, final_norm, out_head; frozen: tok_emb, pos_emb, trf_blocks.0..10'."""
    groups = {state: [p for p, s in trained.items() if s == state] for state in TRAINED_STATES}
    return "; ".join(f"{label}: {parts(groups[state])}" for state, label in TRAINED_STATES.items() if groups[state])

"""What a model memorised: the longest spans of a text found word for word in the training data.

    copied_spans(pieces, data, first_new) -> [Span, ...], longest first

`pieces` is the text as its tokens decode, one string per token (prompt and generated);
a span is a run of whole tokens whose text occurs in `data` exactly. A chapter-5 model
trained on one short story recites it: its spans run for dozens of tokens, where a model
that generalises copies a few words at a time.

For each start token the longest match is found by extending while the text still occurs;
the end never moves back (a span's tail is also in the data), so the search makes about two
substring searches per token, each a scan of `data` (milliseconds per megabyte).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

MIN_TOKENS = 4  # shorter runs are common phrases, not recitation


@dataclass
class Span:
    start: int           # first token of the span (0 = the prompt's first)
    end: int             # one past its last token
    text: str
    new_tokens: int      # how many of its tokens the model generated (not the prompt's)
    offset: int          # where the text first occurs in the data, in characters
    line: int            # that offset's line, counted from 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def copied_spans(pieces: Sequence[str], data: str, first_new: int, min_tokens: int = MIN_TOKENS,
                 most: int = 5) -> list[Span]:
    """The `most` longest spans of at least `min_tokens` tokens that occur in `data` and hold at least one
    generated token (index >= first_new), without overlaps, longest first."""
    starts = [0]
    for piece in pieces:
        starts.append(starts[-1] + len(piece))
    text = "".join(pieces)
    n = len(pieces)
    longest: list[tuple[int, int]] = []  # for each start token, the longest (start, end) found in the data
    end = 0
    for i in range(n):
        end = max(end, i)
        while end < n and text[starts[i]:starts[end + 1]] in data:
            end += 1
        longest.append((i, end))
    chosen: list[tuple[int, int]] = []
    for i, j in sorted(longest, key=lambda s: (s[0] - s[1], s[0])):  # longest first
        if j - i < min_tokens or j <= first_new or any(i < b and a < j for a, b in chosen):
            continue
        chosen.append((i, j))
        if len(chosen) == most:
            break
    spans = []
    for i, j in chosen:
        found = text[starts[i]:starts[j]]
        offset = data.find(found)
        spans.append(Span(i, j, found, j - max(i, first_new), offset, data.count("\n", 0, offset) + 1))
    return spans

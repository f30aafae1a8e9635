"""A prompt, checked in one place for every command: text (or ids) -> the ids the model reads.

    p = fit_prompt(tokenizer.encode(text), limit=cfg.context_length)
    p.ids    what the model sees          p.note   None, or what was cut and what was kept

One rule for every command (generate, explain, chat, classify, the web page and its API): a
prompt longer than the model reads at once is cut to fit, never refused, and `note` says so.
A language model keeps the end, since the next token follows it (generation then slides its
window along, as the book's `generate` does with `idx[:, -context_size:]`); a classifier keeps
the start, as `finetune classify` cut its training texts (and the book's `classify_review`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

from .errors import PromptError
from .tokenizer import Tokenizer

EXAMPLE = "\"Every effort moves you\""


@dataclass(frozen=True)
class Prompt:
    ids: list[int]          # the ids the model reads
    total: int              # tokens in the whole prompt
    start: int              # where `ids` begins in the whole prompt
    note: str | None = None  # set when the prompt was cut


def check_text(text: str | None) -> str:
    """Refuse an empty prompt (before any model loads, so the error comes at once)."""
    if not text:
        raise PromptError(f"the prompt is empty: give some text, e.g. {EXAMPLE}")
    return text


def encode(tokenizer: Tokenizer, text: str | None) -> list[int]:
    """The ids of a non-empty prompt that encodes to at least one token."""
    ids = tokenizer.encode(check_text(text))
    if not ids:
        raise PromptError("the prompt encodes to no tokens: give some text")
    return ids


def check_ids(ids: Sequence[int], n_vocab: int) -> list[int]:
    """Token ids given as they are (the web page's Append and Undo): each in 0..n_vocab - 1."""
    ids = [int(i) for i in ids]
    if not ids:
        raise PromptError(f"the prompt is empty: give some text, e.g. {EXAMPLE}")
    bad = next((i for i in ids if not 0 <= i < n_vocab), None)
    if bad is not None:
        raise PromptError(f"token id {bad} is out of range: valid ids are 0..{n_vocab - 1}")
    return ids


def fit_prompt(ids: Sequence[int], limit: int, keep: Literal["last", "first"] = "last",
               why: str = "its context_length") -> Prompt:
    """`ids` cut to at most `limit` tokens, keeping the last (a language model) or the first (a
    classifier); `why` names the limit in the note, e.g. "this server's --max-prompt-tokens"."""
    ids = list(ids)
    total = len(ids)
    if total <= limit:
        return Prompt(ids, total, 0)
    start = total - limit if keep == "last" else 0
    what = (f"the last {limit:,} (tokens {start:,}..{total - 1:,})" if keep == "last"
            else f"the first {limit:,} (tokens 0..{limit - 1:,})")
    note = (f"the prompt is {total:,} tokens, more than the {limit:,} the model reads at once ({why}): "
            f"it saw {what}")
    return Prompt(ids[start:start + limit], total, start, note)


def keep_for(num_classes: int | None) -> Literal["last", "first"]:
    """Which end of a long prompt a model reads: a classifier the start, a language model the end."""
    return "first" if num_classes is not None else "last"

"""A prompt, checked in one place for every command: text (or ids) -> the ids the model reads.

    p = fit_prompt(tokenizer.encode(text), limit=cfg.context_length)
    p.ids    what the model sees          p.note   None, or what was cut and what was kept

One rule for every command (generate, explain, chat, classify, the web page and its API): a
prompt longer than the model reads at once is cut to fit, never refused, and `note` says so.
A language model keeps the end, since the next token follows it (generation then slides its
window along, as the book's `generate` does with `idx[:, -context_size:]`); a classifier keeps
the start, as `finetune classify` cut its training texts (and the book's `classify_review`).

A classifier is read where it was trained to be read (`Reading`, from its checkpoint's record):
glassgpt's recipe at the last real token; the book's chapter 6 at the last position of the text
padded with 50256 to the length it was trained at, padding included. `classify`, `explain`,
`--why` and the web page all take the ids and the one line that says so from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

from .errors import PromptError
from .tokenizer import Tokenizer

EXAMPLE = "\"Every effort moves you\""


ALPACA_PREAMBLE = ("Below is an instruction that describes a task. "
                   "Write a response that appropriately completes the request.")


def format_prompt(instruction: str, input: str = "") -> str:
    """The Alpaca prompt, up to and including "### Response:\n" (the book's format_input, then its
    response header)."""
    text = f"{ALPACA_PREAMBLE}\n\n### Instruction:\n{instruction}"
    if input:
        text += f"\n\n### Input:\n{input}"
    return text + "\n\n### Response:\n"


PAD_ID = 50256  # <|endoftext|>: what the book's SpamDataset and classify_review pad with
# Said of a classifier in a .pth, which records nothing of how it was trained.
BOOK_FILE_HINT = ("a classifier trained by the book's code reads the last position of its padded length (glassgpt "
                  "classify and explain read it so with --recipe book --max-length N)")


@dataclass(frozen=True)
class Prompt:
    ids: list[int]          # the ids the model reads
    total: int              # tokens in the whole prompt
    start: int              # where `ids` begins in the whole prompt
    note: str | None = None  # set when the prompt was cut
    padding: int = 0        # pad ids appended after the text (a classifier read as the book reads it)


def check_text(text: str | None) -> str:
    """Refuse an empty prompt (before any model loads, so the error comes at once)."""
    if not text:
        raise PromptError(f"the prompt is empty: give some text, e.g. {EXAMPLE}")
    return text


def encode(tokenizer: Tokenizer, text: str | None, allowed_special: Iterable[str] = ()) -> list[int]:
    """The ids of a non-empty prompt that encodes to at least one token; `<|endoftext|>` in it is plain
    text unless `allowed_special` names it (tiktoken's allowed_special)."""
    ids = tokenizer.encode(check_text(text), allowed_special)
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


@dataclass(frozen=True)
class Reading:
    """Where a classifier reads a text, as it was trained: `length` is the most tokens it was
    finetuned on (None: its context_length); `padded`: the text cut and padded with PAD_ID to
    `length` and the last position read, padding included (the book's SpamDataset and
    classify_review), else the text cut and its last real token read (glassgpt's recipe)."""

    length: int | None = None
    padded: bool = False

    def fit(self, ids: Sequence[int], context_length: int, limit: int | None = None,
            why: str | None = None) -> Prompt:
        """The ids the classifier reads: the text's first tokens (at most `limit`, e.g. a server's
        limit), then for a padded reading PAD_ID up to `length`."""
        length = self.length or context_length
        if not self.padded:
            length = min(length, context_length)
        elif length > context_length:
            raise PromptError(f"the classifier was trained on {length:,} tokens, more than its context_length "
                              f"{context_length:,}: give a --max-length of at most {context_length:,}")
        most = min(length, limit or length)
        why = why or ("the length it was finetuned on" if self.length else "its context_length")
        cut = fit_prompt(ids, most, keep="first", why=why)
        if not self.padded:
            return cut
        padding = length - len(cut.ids)
        return Prompt(cut.ids + [PAD_ID] * padding, cut.total, cut.start, cut.note, padding)

    def line(self, prompt: Prompt) -> str:
        """Which position the class is read at, in one line."""
        last = len(prompt.ids) - 1
        if not self.padded:
            return f"the classifier reads the last real token (position {last}), with no padding"
        return (f"the classifier reads the last position, padding included (position {last}), as the book's "
                f"classify_review reads it: the text cut or padded with {PAD_ID} to the {len(prompt.ids):,} tokens it "
                "was trained on")


def classifier_reading(trained: dict | None, padded: bool = False, length: int | None = None
                       ) -> tuple[Reading, list[str]]:
    """How `classify` and `explain` read a classifier, from its checkpoint's record of how it was
    finetuned (`trained`: meta.json's "finetune"; a run of the book's recipe records its
    `padded_length`). `padded`/`length`: what the reader asked for (`classify --recipe book
    --max-length N`). Returns the reading and the notes that say why it differs from the record."""
    trained = trained or {}
    recorded = trained.get("padded_length")
    notes = []
    if padded and trained and recorded is None:
        notes.append("it was finetuned by glassgpt's recipe, on the last real token; --recipe book reads the last "
                     "position, padding included")
    if padded or recorded is not None:
        length = length or recorded
        if length is None:
            raise PromptError("the model does not record the length the book padded its texts to: pass --max-length "
                              "N (train_dataset.max_length in the book's notebook)")
        return Reading(length, padded=True), notes
    return Reading(trained.get("max_length")), notes


def fit_for(ids: Sequence[int], context_length: int, num_classes: int | None, reading: Reading | None = None,
            limit: int | None = None, why: str | None = None) -> Prompt:
    """The ids a model reads of a prompt: a language model its last tokens, a classifier as `reading` says."""
    if num_classes is None:
        return fit_prompt(ids, limit or context_length, "last", why or "its context_length")
    return (reading or Reading()).fit(ids, context_length, limit, why)


def reading_line(num_classes: int | None, reading: Reading | None, prompt: Prompt) -> str | None:
    """For a classifier, the one line that says which position it reads; None for a language model."""
    return None if num_classes is None else (reading or Reading()).line(prompt)

"""Chapter 2's pieces, as the reader wrote them: a tokenizer, and the sliding windows of GPTDatasetV1.

Tokenizers: the book's SimpleTokenizerV1/V2 (a vocabulary `str_to_int` over the text split on
punctuation and spaces; V2 adds <|unk|> and <|endoftext|>) against the same split written here
over the reader's own vocabulary; a tiktoken-style `encode`/`decode` against GPT-2's ids and the
round trip. Windows: input k is ids[k * stride : k * stride + max_length], its target the same
shifted by one token; a GPTDatasetV1 class is built on the opening of the book's text with
max_length 4 and strides 1 and 4, create_dataloader_v1 is called as the book calls it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ...tokenizer import Tokenizer, get_tokenizer
from ..result import Result
from . import properties
from .properties import Broken
from .report import PieceError, PieceResult, found, run_reader

# The opening of the book's text, Edith Wharton's "The Verdict" (1908).
BOOK_TEXT = ("I HAD always thought Jack Gisburn rather a cheap genius--though a good fellow enough--so it was no "
             "great surprise to me to hear that, in the height of his glory, he had dropped his painting, married "
             "a rich widow, and established himself in a villa on the Riviera.")
V1_TEXT = '"It\'s the last he painted, you know," Mrs. Gisburn said with pardonable pride.'
V2_TEXT = "Hello, do you like tea? <|endoftext|> In the sunlit terraces of the palace."
SPLIT = r'([,.:;?_!"()\']|--|\s)'  # the book's split: punctuation, double dashes, spaces
SETTINGS = [(4, 1), (4, 4)]  # (max_length, stride): the book's two examples

MISTAKES = {
    "drops_unk": "encode leaves out the words it does not know: map each to <|unk|>, "
                 "item if item in self.str_to_int else \"<|unk|>\"",
    "drops_endoftext": "encode leaves out <|endoftext|>: keep it as one token (add it to the vocabulary, and "
                       "pass allowed_special={\"<|endoftext|>\"} to tiktoken)",
    "stride_skips": "the windows step by stride + 1, so one token between windows is in no input: "
                    "for i in range(0, len(token_ids) - max_length, stride)",
    "not_shifted": "the targets are the inputs, not shifted: target_chunk = token_ids[i + 1:i + max_length + 1]",
    "max_length_plus_1": "each window holds max_length + 1 tokens: input_chunk = token_ids[i:i + max_length]",
    "max_length_minus_1": "each window holds max_length - 1 tokens: input_chunk = token_ids[i:i + max_length]",
}


# --- tokenizers -----------------------------------------------------------------------------------

def simple_encode(text: str, vocab: dict[str, int], mistake: str | None = None) -> list[int]:
    """The book's SimpleTokenizer encode over `vocab` (V2's <|unk|> when the vocabulary has it)."""
    words = [w.strip() for w in re.split(SPLIT, text) if w.strip()]
    if mistake == "drops_endoftext":
        words = [w for w in words if w != "<|endoftext|>"]
    if "<|unk|>" in vocab:
        words = [w for w in words if w in vocab] if mistake == "drops_unk" else \
            [w if w in vocab else "<|unk|>" for w in words]
    return [vocab[w] for w in words]


def simple_decode(ids: Sequence[int], vocab: dict[str, int]) -> str:
    words = {i: w for w, i in vocab.items()}
    return re.sub(r'\s+([,.?!"()\'])', r"\1", " ".join(words[i] for i in ids))


def check_tokenizer(tok: Any, kind: str) -> PieceResult:
    vocab = getattr(tok, "str_to_int", None)
    if isinstance(vocab, dict):
        return _check_simple(tok, vocab)
    return _check_tiktoken_style(tok, kind)


def _check_simple(tok: Any, vocab: dict[str, int]) -> PieceResult:
    v2 = "<|unk|>" in vocab
    kind = "SimpleTokenizerV2" if v2 else "SimpleTokenizerV1"
    text = V2_TEXT if v2 else V1_TEXT
    if not v2 and any(w.strip() not in vocab for w in re.split(SPLIT, text) if w.strip()):
        text = " ".join(list(vocab)[:8])  # a V1 vocabulary of another text: words it knows
    result = PieceResult(kind, f"{text!r}, over your own vocabulary ({len(vocab):,} entries)")
    got = run_reader(f"{type(tok).__name__}.encode", lambda: list(tok.encode(text)))
    want = simple_encode(text, vocab)
    result.views = {"reader_ids": got, "book_ids": want}
    result.lines.append(f"encode: {len(got)} ids, glassgpt's split gives {len(want)}")
    if got != want:
        variants = {m: (lambda m=m: simple_encode(text, vocab, m)) for m in ("drops_unk", "drops_endoftext")}
        broken = words_broken(got, want, text, vocab)
        if broken is not None:
            return found(result, broken, next((m for m, fn in variants.items() if fn() == got), None), MISTAKES)
        return _ids_differ(result, got, want, variants, {i: w for w, i in vocab.items()})
    back = run_reader(f"{type(tok).__name__}.decode", lambda: tok.decode(want))
    if back != simple_decode(want, vocab):
        return _text_differs(result, "decode", back, simple_decode(want, vocab))
    result.lines.append("decode: the same text as glassgpt's join")
    result.finding = f"{kind} gives the book's ids and text" + (" (unknown words as <|unk|>, <|endoftext|> kept)."
                                                               if v2 else ".")
    return result


def words_broken(got: list[int], want: list[int], text: str, vocab: dict[str, int]) -> Broken | None:
    """A SimpleTokenizer's properties on the reader's ids: each is an id of the vocabulary; at the first
    token that differs, the book's word there is a punctuation mark split off on its own, <|endoftext|>
    kept as one token, or a word the vocabulary lacks read as <|unk|>."""
    words = {i: w for w, i in vocab.items()}
    bad = next((k for k, i in enumerate(got) if i not in words), None)
    if bad is not None:
        return Broken("ids_in_vocabulary", "tokens", f"token {bad}", f"token {bad} is {got[bad]}, no id of your "
                      f"vocabulary (str_to_int's values): encode gives self.str_to_int[s] for each word")
    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if k >= len(want):
        return Broken("token_count", "tokens", f"token {k}", f"your encode gives {len(got)} ids for the text's "
                      f"{len(want)} words and punctuation marks, the extra from token {k} on ({got[k]} "
                      f"{words[got[k]]!r}): one id per word of the split, [self.str_to_int[s] for s in preprocessed]")
    book, yours = words[want[k]], (repr(words[got[k]]) if k < len(got) else "nothing")
    if book == "<|endoftext|>":
        return Broken("special_token", "tokens", f"token {k}", f"token {k} should be <|endoftext|>, kept as one "
                      f"token ({want[k]}), yours is {yours}")
    if book == "<|unk|>":
        word = [w.strip() for w in re.split(SPLIT, text) if w.strip()][k]
        return Broken("unknown_word", "tokens", f"token {k}", f"word {k} of the text, {word!r}, is not in your "
                      f"vocabulary, so the book's encode reads it as '<|unk|>' ({want[k]}); yours gives {yours}")
    if re.fullmatch(SPLIT, book):
        return Broken("split", "tokens", f"token {k}", f"token {k} should be {book!r}, a punctuation mark split off "
                      f"the word before it, yours is {yours}: split on punctuation, double dashes and spaces, "
                      f"re.split(r'{SPLIT}', text)")
    case = k < len(got) and words[got[k]].lower() == book.lower()
    return Broken("lookup", "tokens", f"token {k}", f"word {k} of the text, {book!r}, is in your vocabulary as "
                  f"{want[k]}, yours gives {yours}" + (" (the same word in another case)" if case else "") +
                  ": each word is looked up as the text writes it, self.str_to_int[s]")


def _check_tiktoken_style(tok: Any, kind: str) -> PieceResult:
    gpt2 = get_tokenizer("gpt2")
    text = V2_TEXT.replace("palace.", "someunknownPlace.")  # the book's example for BPE's unknown words
    result = PieceResult(kind, f"{text!r}, against GPT-2's BPE")

    def encode():
        try:
            return list(tok.encode(text, allowed_special={"<|endoftext|>"}))
        except TypeError:  # an encode without tiktoken's allowed_special
            return list(tok.encode(text))
    got = run_reader(f"{type(tok).__name__}.encode", encode)
    want = gpt2.encode(text, allowed_special={"<|endoftext|>"})
    result.views = {"reader_ids": got, "book_ids": want}
    if got != want:
        variants = {"drops_endoftext": lambda: [i for i in want if i != gpt2.eot_id]}
        broken = bpe_broken(got, want, text, gpt2)
        if broken is not None:
            return found(result, broken, next((m for m, fn in variants.items() if fn() == got), None), MISTAKES)
        return _ids_differ(result, got, want, variants, None, gpt2)
    result.lines.append(f"encode: GPT-2's {len(want)} ids")
    back = run_reader(f"{type(tok).__name__}.decode", lambda: tok.decode(want))
    if back != text:
        return _text_differs(result, "decode", back, text)
    result.lines.append("decode(encode(text)) gives the text back")
    result.finding = f"{kind} gives GPT-2's ids, <|endoftext|> as 50256, and the text back."
    return result


def bpe_broken(got: list[int], want: list[int], text: str, gpt2) -> Broken | None:
    """A byte-level BPE's properties on the reader's ids for `text`: every id is in GPT-2's vocabulary;
    <|endoftext|> is one token, 50256; GPT-2's decode of the ids gives the text back (else the character
    where it first does not); the text is split as GPT-2's merges split it (else the first token that is not)."""
    bad = next((k for k, i in enumerate(got) if not 0 <= int(i) < gpt2.n_vocab), None)
    if bad is not None:
        return Broken("ids_in_vocabulary", "tokens", f"token {bad}", f"token {bad} is {got[bad]}, outside GPT-2's "
                      f"vocabulary of {gpt2.n_vocab:,} ids (0 to {gpt2.n_vocab - 1})")
    eot = gpt2.eot_id
    if eot in want and eot not in got:
        k = want.index(eot)
        c = text.index("<|endoftext|>")
        if gpt2.decode(got) == text:
            a, b = _token_at(got, c, gpt2), _token_at(got, c + len("<|endoftext|>") - 1, gpt2)
            return Broken("special_token", "tokens", f"token {a}", f"<|endoftext|> (character {c}) is read as "
                          f"{b - a + 1} ordinary tokens {got[a:b + 1]}, where it is one special token, {eot}: "
                          f"tokenizer.encode(text, allowed_special={{\"<|endoftext|>\"}})")
        return Broken("special_token", "tokens", f"token {k}", f"<|endoftext|> (character {c}) gives no token, "
                      f"where it is one special token, {eot}")
    back = gpt2.decode(got)
    if back != text:
        c = next((i for i, (a, b) in enumerate(zip(back, text)) if a != b), min(len(back), len(text)))
        k = _token_at(got, c, gpt2)
        return Broken("round_trip", "tokens", f"character {c}", f"your ids do not give the text back: GPT-2's decode "
                      f"reads {back[max(0, c - 10):c + 10]!r} where the text is {text[max(0, c - 10):c + 10]!r}, "
                      f"first at character {c} (token {k}); encode must keep every character, spaces included")
    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    c = len(gpt2.decode(want[:k]))
    yours = f"{got[k]} {gpt2.decode([got[k]])!r}" if k < len(got) else "nothing"
    book = f"{want[k]} {gpt2.decode([want[k]])!r}" if k < len(want) else "nothing"
    return Broken("merges", "tokens", f"token {k}", f"your ids spell the text, but split it otherwise from token {k} "
                  f"(character {c}): yours {yours}, GPT-2's {book}; GPT-2 splits the text into words with its "
                  f"pattern, then merges each word's bytes by its ranks: tiktoken.get_encoding(\"gpt2\")")


def _token_at(ids: list[int], c: int, gpt2) -> int:
    """The index of the token among `ids` whose text holds character c."""
    seen = 0
    for k, i in enumerate(ids):
        seen += len(gpt2.decode([i]))
        if seen > c:
            return k
    return len(ids)


def _ids_differ(result: PieceResult, got: list[int], want: list[int], variants: dict, words: dict | None,
                bpe=None) -> PieceResult:
    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    show = (lambda i: repr(words.get(i, "?"))) if words else (lambda i: repr(bpe.decode([i])))
    yours = f"{got[k]} {show(got[k])}" if k < len(got) else "nothing"
    book = f"{want[k]} {show(want[k])}" if k < len(want) else "nothing"
    result.stage, result.where = "tokens", f"token {k}"
    result.mistake = next((m for m, fn in variants.items() if fn() == got), None)
    what = f"token {k} first differs: yours is {yours}, the book's {book}"
    result.finding = f"{what}: {MISTAKES[result.mistake]}" if result.mistake else \
        f"{what}; it keeps what was checked (ids of the vocabulary, one per word, punctuation split off, " \
        f"<|endoftext|> kept, unknown words as <|unk|>), and no known mistake reproduces it: compare your encode " \
        f"with the book's"
    return result


def _text_differs(result: PieceResult, stage: str, got: str, want: str) -> PieceResult:
    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    result.stage, result.where = stage, f"character {k}"
    result.finding = (f"decode gives {got[max(0, k - 10):k + 10]!r} where the book's gives "
                      f"{want[max(0, k - 10):k + 10]!r} (character {k}): join the words with spaces, then remove "
                      f"the space before punctuation, re.sub(r'\\s+([,.?!\"()\\'])', r'\\1', text)")
    return result


# --- sliding windows ------------------------------------------------------------------------------

@dataclass
class Windows:
    inputs: list[list[int]]
    targets: list[list[int]]


def book_windows(ids: Sequence[int], max_length: int, stride: int, mistake: str | None = None) -> Windows:
    """The book's windows over `ids` (or with `mistake`)."""
    length = max_length + {"max_length_plus_1": 1, "max_length_minus_1": -1}.get(mistake, 0)
    step = stride + 1 if mistake == "stride_skips" else stride
    starts = range(0, len(ids) - max_length, step)
    shift = 0 if mistake == "not_shifted" else 1
    return Windows([list(ids[i:i + length]) for i in starts], [list(ids[i + shift:i + shift + length]) for i in starts])


@dataclass
class SlidingWindows(Result):
    """GPTDatasetV1's windows over a text: window k's inputs are ids[k*stride : k*stride + max_length],
    its targets the same one token later. Its text, picture and notebook cell: views/pieces.py."""

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


def windows_of(dataset: Any) -> Windows:
    pairs = [dataset[k] for k in range(len(dataset))]
    return Windows([_ids(x) for x, _ in pairs], [_ids(y) for _, y in pairs])


def loader_windows(loader: Any) -> Windows:
    w = Windows([], [])
    for x, y in loader:
        w.inputs += [_ids(row) for row in x]
        w.targets += [_ids(row) for row in y]
    return w


def _ids(t: Any) -> list[int]:
    return [int(i) for i in (t.tolist() if torch.is_tensor(t) else t)]


def check_windows(make: Callable[[str, Any, int, int], Windows], kind: str, text: str = BOOK_TEXT,
                  settings: Sequence[tuple[int, int]] = SETTINGS, batch_size: int | None = None) -> PieceResult:
    """`make(text, tokenizer, max_length, stride)` gives the reader's windows; each setting against the book's."""
    tok = get_tokenizer("gpt2")
    ids = tok.encode(text, allowed_special={"<|endoftext|>"})
    result = PieceResult(kind, f"{len(ids)} tokens of the book's text, (max_length, stride) = "
                               f"{', '.join(map(str, settings))}")
    for max_length, stride in settings:
        got = run_reader(f"{kind} with max_length={max_length}, stride={stride}",
                         lambda: make(text, tok, max_length, stride))
        want = book_windows(ids, max_length, stride)
        if batch_size:  # a loader with drop_last keeps whole batches only
            want = Windows(want.inputs[:len(got.inputs)], want.targets[:len(got.targets)]) \
                if len(got.inputs) == len(want.inputs) // batch_size * batch_size else want
        result.views.setdefault("windows", []).append({"max_length": max_length, "stride": stride, "ids": ids,
                                                       "reader": got, "book": want})
        result.lines.append(f"max_length {max_length}, stride {stride}: {len(got.inputs)} windows, the book's "
                            f"{len(want.inputs)}")
        if (got.inputs, got.targets) != (want.inputs, want.targets):
            return _windows_differ(result, ids, got, want, max_length, stride, tok)
    result.finding = (f"{kind} makes the book's windows: max_length tokens each, stride apart, targets shifted by "
                      f"one token.")
    return result


def _windows_differ(result, ids, got: Windows, want: Windows, max_length: int, stride: int, tok) -> PieceResult:
    k = next((i for i in range(min(len(got.inputs), len(want.inputs)))
              if (got.inputs[i], got.targets[i]) != (want.inputs[i], want.targets[i])), None)
    mistake = None
    for m in ("stride_skips", "not_shifted", "max_length_plus_1", "max_length_minus_1"):
        v = book_windows(ids, max_length, stride, m)
        if (v.inputs[:len(got.inputs)], v.targets[:len(got.targets)]) == (got.inputs, got.targets):
            mistake = m
            break
    result.stage, result.mistake = "windows", mistake
    if k is None:
        result.where = "the number of windows"
        what = f"you make {len(got.inputs)} windows, the book {len(want.inputs)}"
    else:
        part = "inputs" if got.inputs[k] != want.inputs[k] else "targets"
        result.where = f"window {k}"
        what = (f"window {k}'s {part} first differ (max_length {max_length}, stride {stride}): yours "
                f"{getattr(got, part)[k]}, the book's {getattr(want, part)[k]}")
    broken = properties.shift_broken(got.inputs, got.targets) if got.inputs else None
    if broken is None:  # where the windows sit: said after both windows are shown
        broken = properties.window_starts(ids, got.inputs, max_length, stride) or \
            properties.window_targets(ids, got.inputs, got.targets, max_length, stride)
        if broken is not None:
            broken.words = f"{what}; {broken.words}"
    if broken is not None:
        return found(result, broken, mistake, MISTAKES)
    result.finding = f"{what}: {MISTAKES[mistake]}" if mistake else \
        f"{what}; it keeps what was checked (targets shifted by one, max_length tokens a window, each window a run " \
        f"of the text's ids at k * stride, the number of windows, each target), and no known mistake reproduces " \
        f"it: compare your __init__'s loop with the book's GPTDatasetV1"
    return result


def check_windows_alone(w: Windows, kind: str) -> PieceResult:
    """What the windows alone must satisfy: targets are the inputs shifted by one token, and every
    window is as long as the first (the text, max_length and stride are not needed)."""
    n = len(w.inputs[0]) if w.inputs else 0
    result = PieceResult(kind, f"its own {len(w.inputs)} windows of {n} tokens (no text given: checked on what "
                               f"the windows alone must satisfy)")
    result.views["windows"] = [{"max_length": n, "stride": None, "ids": [], "reader": w, "book": w}]
    if not w.inputs:
        raise PieceError(f"the {kind} holds no windows: the text is shorter than max_length + 1 tokens")
    k = properties.target_shift(w.inputs, w.targets)
    result.lines.append(f"targets = inputs shifted by {k if k is not None else 'no one k'} token(s)")
    uneven = next((i for i, (x, y) in enumerate(zip(w.inputs, w.targets)) if len(x) != n or len(y) != n), None)
    broken = properties.shift_broken(w.inputs, w.targets)
    if broken is None and uneven is not None:
        broken = properties.Broken("window_length", "windows", f"window {uneven}", f"window {uneven} holds "
                                   f"{len(w.inputs[uneven])} inputs and {len(w.targets[uneven])} targets, window 0 "
                                   f"{n}: every window holds max_length tokens")
    if broken is not None:
        return found(result, broken, "not_shifted" if k == 0 else None, MISTAKES)
    result.finding = (f"{kind}'s targets are its inputs shifted by one token in each of its {len(w.inputs)} windows "
                      f"(to compare them with the book's windows too, give text=, max_length= and stride=).")
    return result


def check_dataset_class(cls: type) -> PieceResult:
    return check_windows(lambda text, tok, L, s: windows_of(cls(text, tok, L, s)), cls.__name__)


def check_loader_function(fn: Callable) -> PieceResult:
    """create_dataloader_v1(txt, batch_size, max_length, stride, shuffle=False), as the book calls it."""
    def make(text, _tok, L, s):
        return loader_windows(fn(text, batch_size=2, max_length=L, stride=s, shuffle=False))
    return check_windows(make, fn.__name__, batch_size=2)


def check_dataset(obj: Any, kind: str, text: str | None, max_length: int | None, stride: int | None) -> PieceResult:
    """A dataset or loader the reader already built: its windows against the book's over `text`; without
    the text (and max_length, stride), what its windows alone must satisfy."""
    windows = loader_windows(obj) if kind == "DataLoader" else windows_of(obj)
    if text is None or max_length is None or stride is None:
        return check_windows_alone(windows, kind)
    return check_windows(lambda *_: windows, kind, text, [(max_length, stride)],
                         batch_size=getattr(obj, "batch_size", None) if kind == "DataLoader" else None)

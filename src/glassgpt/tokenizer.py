"""Tokenizers: text <-> token ids.

- `gpt2`: OpenAI's byte-level BPE (50,257 tokens, `<|endoftext|>` = 50256), built
  offline from the two vocabulary files shipped in `glassgpt/vocab` (checked by
  sha256) and run by tiktoken's engine, so ids are exactly tiktoken's `gpt2`.
- `char`: one id per distinct character of a text, for small experiments.
- a learned byte-level BPE (see `train_bpe`), saved to a JSON file and loaded
  with `get_tokenizer(path)`.

Every tokenizer has `encode`, `decode`, `decode_bytes`, `n_vocab`, `eot_id`, and
`to_dict()` so that a checkpoint can carry the tokenizer it was trained with.
"""

from __future__ import annotations

import base64
import hashlib
import heapq
import json
from collections import Counter
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import tiktoken

from .errors import TokenizerError

ENDOFTEXT = "<|endoftext|>"
# GPT-2's pre-tokenizer: contractions, letters, numbers, punctuation, whitespace.
# Text is split with it first; BPE merges never cross these pieces.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
VOCAB_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}


def check_fits(tokenizer: "Tokenizer", vocab_size: int, fix: str = "pass the model's own tokenizer") -> None:
    """Refuse a tokenizer with more ids than the model has rows of tok_emb (an id past them would
    index out of range): `fix` says what to do about it."""
    if tokenizer.n_vocab > vocab_size:
        raise TokenizerError(f"the tokenizer has {tokenizer.n_vocab:,} tokens but the model's vocab_size is "
                             f"{vocab_size:,}: {fix}")


class Tokenizer:
    """Common interface. Subclasses set `name`, `n_vocab`, `eot_id`."""

    name: str
    n_vocab: int
    eot_id: int | None

    def encode(self, text: str, allowed_special: Iterable[str] = ()) -> list[int]:
        raise NotImplementedError

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        # A token can end in the middle of a multi-byte character; show it as U+FFFD.
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self.decode_bytes([token_id])

    def to_dict(self) -> dict:
        raise NotImplementedError

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), ensure_ascii=False))

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:
            raise TokenizerError(
                f"token id {bad[0]} is out of range for the {self.name} tokenizer "
                f"(valid ids are 0..{self.n_vocab - 1})"
            )
        return ids


class TiktokenTokenizer(Tokenizer):
    """A byte-level BPE run by tiktoken: GPT-2's, or one learned by `train_bpe`."""

    def __init__(self, encoding: tiktoken.Encoding, spec: dict, source: str = "GPT-2's vocabulary"):
        self._enc = encoding
        self._spec = spec
        self._source = source
        self.name = encoding.name
        self.n_vocab = encoding.n_vocab
        self.eot_id = encoding._special_tokens.get(ENDOFTEXT)
        # Bind the engine's methods directly: no Python work is added per call.
        self.encode_ordinary = encoding.encode_ordinary
        self.encode_batch = encoding.encode_ordinary_batch

    def encode(self, text: str, allowed_special: Iterable[str] = ()) -> list[int]:
        # `<|endoftext|>` typed by a user is plain text unless the caller allows it.
        try:
            if not allowed_special:
                return self._enc.encode_ordinary(text)
            if allowed_special == "all":  # tiktoken's spelling for every special token
                return self._enc.encode(text, allowed_special="all", disallowed_special=())
            if isinstance(allowed_special, str):
                allowed_special = {allowed_special}
            return self._enc.encode(text, allowed_special=set(allowed_special), disallowed_special=())
        except BaseException as e:  # tiktoken's regex engine panics where a pattern backtracks past its limit
            if type(e).__name__ != "PanicException":
                raise
            raise TokenizerError(f"{self._source}: the tokenizer's pattern gave up on this text ({str(e)[-60:]}): "
                                 "its repeated alternatives backtrack without end; use GPT-2's pattern") from None

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        try:
            return self._enc.decode_bytes(ids)
        except (KeyError, OverflowError, ValueError, TypeError):
            return self._enc.decode_bytes(self._check_ids(ids))  # raises with the bad id

    def token_bytes(self, token_id: int) -> bytes:
        self._check_ids([token_id])
        return self._enc.decode_single_token_bytes(token_id)

    def to_dict(self) -> dict:
        return self._spec


class CharTokenizer(Tokenizer):
    """One id per character, ids in sorted character order (as nanoGPT's shakespeare_char)."""

    def __init__(self, chars: Iterable[str]):
        self.chars = sorted(set(chars))
        if not self.chars:
            raise TokenizerError("a char tokenizer needs a non-empty text to take its characters from")
        self.name = "char"
        self.n_vocab = len(self.chars)
        self.eot_id = None
        self._stoi = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls(set(text))

    def encode(self, text: str, allowed_special: Iterable[str] = ()) -> list[int]:
        try:
            return [self._stoi[c] for c in text]
        except KeyError as e:
            raise TokenizerError(
                f"character {e.args[0]!r} is not in this char tokenizer's vocabulary of "
                f"{self.n_vocab} characters: use only characters seen in training"
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in self._check_ids(ids))

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return self.decode(ids).encode("utf-8")

    def to_dict(self) -> dict:
        return {"type": "char", "chars": "".join(self.chars)}


def get_tokenizer(spec: str = "gpt2", text: str | None = None) -> Tokenizer:
    """`"gpt2"`, or `"char"` with `text`. A saved tokenizer .json file is read by
    `glassgpt.get_tokenizer` (formats/), which ends in `tokenizer_from_dict`."""
    if spec == "gpt2":
        return _gpt2()
    if spec == "char":
        if text is None:
            raise TokenizerError("get_tokenizer('char') needs text=... to take its characters from")
        return CharTokenizer.from_text(text)
    raise TokenizerError(f"unknown tokenizer {spec!r}: use gpt2, char, or the path of a tokenizer .json file")


def tokenizer_from_dict(spec: dict, source: str = "tokenizer spec") -> Tokenizer:
    """The tokenizer that `to_dict()` described, its fields checked (a file's tokenizer.json is a stranger's)."""
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "gpt2":
        return _gpt2()
    if kind == "char":
        if not isinstance(spec.get("chars"), str) or not spec["chars"]:
            raise TokenizerError(f"{source}: chars must be a non-empty string, got {spec.get('chars')!r}")
        return CharTokenizer(spec["chars"])
    if kind == "bpe":
        return _bpe_from_dict(spec, source)
    if kind == "file":  # a model's own tokenizer file (family_tokenizers.file_identity): the file is the tokenizer
        raise TokenizerError(f"{source} names the tokenizer file {spec.get('file')!r}, not its contents: give "
                             f"--tokenizer PATH of that file")
    raise TokenizerError(f"{source} has unknown tokenizer type {kind!r}: expected gpt2, char or bpe")


@lru_cache(maxsize=1)
def _gpt2() -> TiktokenTokenizer:
    ranks = _gpt2_ranks()
    enc = tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: 50256},
        explicit_n_vocab=50257,
    )
    return TiktokenTokenizer(enc, {"type": "gpt2"})


def _read_vocab_file(name: str) -> bytes:
    data = resources.files("glassgpt").joinpath("vocab").joinpath(name).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != VOCAB_SHA256[name]:
        raise TokenizerError(
            f"glassgpt/vocab/{name} has sha256 {digest[:12]}..., expected {VOCAB_SHA256[name][:12]}...: "
            "the package is damaged, reinstall glassgpt"
        )
    return data


def gpt2_byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters.

    encoder.json and vocab.bpe spell tokens in these characters (a space is 'Ġ'),
    so that every token is a printable string.
    """
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    mapping = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


def gpt2_vocab() -> tuple[list[str], list[str]]:
    """GPT-2's tokens in id order, as encoder.json spells them (a space is 'Ġ'), and its merges
    ("Ġ t", ...) in vocab.bpe's order: what llama.cpp's GPT-2 tokenizer takes (formats/gguf.py)."""
    encoder = json.loads(_read_vocab_file("encoder.json"))
    merges = [line for line in _read_vocab_file("vocab.bpe").decode("utf-8").split("\n")[1:] if line]
    return sorted(encoder, key=encoder.get), merges


def _gpt2_ranks() -> dict[bytes, int]:
    """token bytes -> rank, from encoder.json, whose order is vocab.bpe's merge order (tiktoken merges by
    rank; both files are pinned by VOCAB_SHA256, and tests/test_tokenizer.py checks that they agree)."""
    to_bytes = {ord(c): b for b, c in gpt2_byte_to_unicode().items()}  # str.translate: one char per byte
    encoder = json.loads(_read_vocab_file("encoder.json"))
    return {tok.translate(to_bytes).encode("latin-1"): i for tok, i in encoder.items() if tok != ENDOFTEXT}


def _bpe_from_dict(spec: dict, source: str = "tokenizer spec") -> TiktokenTokenizer:
    raw = spec.get("tokens")
    if not isinstance(raw, list) or len(raw) < 256 or not all(isinstance(t, str) for t in raw):
        raise TokenizerError(f"{source}: tokens must be a list of at least 256 base64 strings (the 256 bytes "
                             f"first), got {type(raw).__name__} of {len(raw) if isinstance(raw, list) else 0}")
    for key in ("name", "pattern"):
        if not isinstance(spec.get(key, ""), str):
            raise TokenizerError(f"{source}: {key} must be a string, got {spec[key]!r}")
    try:
        tokens = [base64.b64decode(t, validate=True) for t in raw]
    except ValueError:
        raise TokenizerError(f"{source}: tokens holds a string that is not base64") from None
    if len(set(tokens)) != len(tokens):
        raise TokenizerError(f"{source}: tokens holds the same bytes twice: the file is corrupt")
    ranks = {tok: i for i, tok in enumerate(tokens)}
    _check_merges(tokens, ranks, source)
    pattern = spec.get("pattern", GPT2_PATTERN)
    check_pattern(pattern, source)
    try:
        enc = tiktoken.Encoding(name=spec.get("name", "bpe"), pat_str=pattern,
                                mergeable_ranks=ranks, special_tokens={ENDOFTEXT: len(tokens)})
    except ValueError as e:  # a pattern that is not a regex, a vocabulary tiktoken refuses
        raise TokenizerError(f"{source}: tiktoken cannot build this tokenizer ({e})") from None
    tokenizer = TiktokenTokenizer(enc, spec, source)
    for sample in PATTERN_SAMPLES:  # tiktoken's own regex engine, on the texts the pattern was tried on
        ids = tokenizer.encode(sample)
        if tokenizer.decode_bytes(ids) != sample.encode("utf-8"):
            raise TokenizerError(f"{source}: pattern {_shown(pattern)} drops text: {sample[:24]!r} encodes to "
                                 f"{len(ids)} tokens that read back as {tokenizer.decode(ids)[:24]!r}; a pattern must "
                                 "match every character (GPT-2's ends in |\\s)")
    return tokenizer


# Texts every pattern must split whole and quickly: prose of several scripts, then runs of one kind
# of character, where a pattern's nested alternatives backtrack without end.
PATTERN_SAMPLES = ["Every effort moves you, 1,234 times -- isn't it? \u00dcber na\u00efve \u65e5\u672c\u8a9e \U0001f642\n\n\t x  ",
                   "a" * 64 + "c", "1" * 64 + "x", " " * 64 + "x", "!" * 64 + "x", "\n" * 64 + "x"]
PATTERN_TIME_LIMIT_S = 0.5


def check_pattern(pattern: object, source: str = "tokenizer spec") -> None:
    """Refuse, naming `source` and its field, a pre-tokenizer pattern that is not a non-empty regular
    expression, or that takes over PATTERN_TIME_LIMIT_S to split a sample text (catastrophic backtracking)."""
    import regex  # tiktoken's own dependency; the `re` module lacks \p{L}

    if not isinstance(pattern, str) or not pattern:
        raise TokenizerError(f"{source}: pattern must be a non-empty regular expression, got {pattern!r}: "
                             "use GPT-2's (leave the field out)")
    try:
        compiled = regex.compile(pattern)
    except regex.error as e:
        raise TokenizerError(f"{source}: pattern {_shown(pattern)} is not a regular expression ({e})") from None
    for sample in PATTERN_SAMPLES:
        try:
            pieces = compiled.findall(sample, timeout=PATTERN_TIME_LIMIT_S)
        except TimeoutError:
            raise TokenizerError(f"{source}: pattern {_shown(pattern)} takes over {PATTERN_TIME_LIMIT_S:g} s to split "
                                 f"the {len(sample)} characters {sample[:12]!r}...: its repeated alternatives backtrack "
                                 "without end; simplify it, or use GPT-2's (leave the field out)") from None
        if sample and not "".join(p if isinstance(p, str) else "".join(p) for p in pieces):
            raise TokenizerError(f"{source}: pattern {_shown(pattern)} matches nothing of {sample[:24]!r}, so every "
                                 "text would encode to no tokens; use GPT-2's (leave the field out)")


def _shown(pattern: str) -> str:
    return repr(pattern if len(pattern) <= 40 else pattern[:37] + "...")


def _check_merges(tokens: list[bytes], ranks: dict[bytes, int], source: str) -> None:
    """The 256 single bytes first; every later token the merge of two tokens before it (BPE's order)."""
    first = tokens[:256]
    if sorted(first) != [bytes([b]) for b in range(256)]:
        missing = next(b for b in range(256) if bytes([b]) not in first)
        raise TokenizerError(f"{source}: tokens must start with the 256 single bytes, in any order; byte {missing} "
                             "is not among the first 256: the file is corrupt")
    for rank in range(256, len(tokens)):
        tok = tokens[rank]
        if not any(ranks.get(tok[:i], rank) < rank and ranks.get(tok[i:], rank) < rank for i in range(1, len(tok))):
            raise TokenizerError(f"{source}: tokens[{rank}] ({tok!r}) is not the merge of two earlier tokens, so BPE "
                                 "can never produce it: the merges are inconsistent (the file is corrupt)")


# --- learning a byte-level BPE from a corpus -----------------------------------------

def train_bpe(text_or_files: str | Path | Iterable[str | Path], vocab_size: int,
              pattern: str = GPT2_PATTERN, name: str | None = None) -> TiktokenTokenizer:
    """Learn a byte-level BPE of `vocab_size` tokens (`<|endoftext|>` included) from a corpus.

    `text_or_files`: the text itself (a `str`), or a `Path` / list of paths of UTF-8 files.
    As GPT-2 does: the text is first cut into pieces by `pattern` (words with their
    leading space, numbers, punctuation runs, whitespace); the 256 single bytes are
    tokens 0..255, so any text round-trips; then, repeatedly, the most frequent
    adjacent pair of tokens inside a piece becomes a new token. Merges never cross
    pieces. The result is run by tiktoken, like GPT-2's own tokenizer.

    Speed: each distinct piece is counted once with its frequency, and pair counts are
    updated only for the pieces that contain the merged pair (a heap finds the most
    frequent pair). Ties go to the pair of smaller token ids, so training is
    deterministic. Training stops early if no pair occurs twice.
    """
    if not isinstance(vocab_size, int) or vocab_size < 257:
        raise TokenizerError(f"vocab_size must be at least 257 (256 bytes + <|endoftext|>), got {vocab_size!r}")
    pieces = _count_pieces(text_or_files, pattern)
    tokens = [bytes([b]) for b in range(256)]
    words = [list(piece) for piece in pieces]  # each distinct piece as a list of token ids
    freqs = list(pieces.values())
    rank_of = {tok: i for i, tok in enumerate(tokens)}

    pair_counts: dict[tuple[int, int], int] = {}
    where: dict[tuple[int, int], set[int]] = {}  # pair -> pieces that (may) contain it
    for w, (word, freq) in enumerate(zip(words, freqs)):
        for pair in zip(word, word[1:]):
            pair_counts[pair] = pair_counts.get(pair, 0) + freq
            where.setdefault(pair, set()).add(w)
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)

    while len(tokens) < vocab_size - 1 and heap:
        neg_count, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg_count:
            continue  # a stale entry: the count changed since it was pushed
        if -neg_count < 2:
            break
        merged = tokens[pair[0]] + tokens[pair[1]]
        # Two merge paths can spell the same bytes ("ab"+"c", "a"+"bc"); tiktoken keys
        # tokens by bytes, so the second path reuses the first one's id.
        new_id = rank_of.get(merged)
        if new_id is None:
            new_id = rank_of[merged] = len(tokens)
            tokens.append(merged)
        changed: set[tuple[int, int]] = set()
        for w in where.pop(pair):
            word, freq = words[w], freqs[w]
            if len(word) < 2:
                continue
            for old in zip(word, word[1:]):
                pair_counts[old] -= freq
                changed.add(old)
            words[w] = word = _merge_pair(word, pair, new_id)
            for new in zip(word, word[1:]):
                pair_counts[new] = pair_counts.get(new, 0) + freq
                where.setdefault(new, set()).add(w)
                changed.add(new)
        pair_counts.pop(pair, None)
        for p in changed:
            count = pair_counts.get(p, 0)
            if count > 0:
                heapq.heappush(heap, (-count, p))
            else:
                pair_counts.pop(p, None)

    spec = {"type": "bpe", "name": name or f"bpe-{len(tokens) + 1}", "pattern": pattern,
            "tokens": [base64.b64encode(t).decode("ascii") for t in tokens]}
    return _bpe_from_dict(spec)


def _merge_pair(word: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    out, i, n = [], 0, len(word)
    while i < n:
        if i < n - 1 and word[i] == pair[0] and word[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def _count_pieces(text_or_files: str | Path | Iterable[str | Path], pattern: str) -> Counter[bytes]:
    """How often each distinct pre-tokenized piece (as UTF-8 bytes) occurs in the corpus."""
    try:
        import regex  # the `re` module lacks \p{L}; GPT-2's own encoder uses `regex` too
    except ImportError:
        raise TokenizerError("training a BPE needs the regex package: pip install regex") from None
    check_pattern(pattern, "train_bpe's pattern")
    split = regex.compile(pattern).findall
    counts: Counter[str] = Counter()
    if isinstance(text_or_files, str):
        counts.update(split(text_or_files))
    else:
        files = [text_or_files] if isinstance(text_or_files, Path) else list(text_or_files)
        for path in files:
            try:
                with open(path, encoding="utf-8", newline="") as f:
                    for block in iter_text_blocks(f):  # memory stays flat on a large corpus
                        counts.update(split(block))
            except UnicodeDecodeError as e:
                raise TokenizerError(f"{path} is not UTF-8 text (byte {e.object[e.start]:#04x}): "
                                     "convert it to UTF-8") from None
    if not counts:
        raise TokenizerError("the corpus is empty: a BPE needs some text to learn from")
    return Counter({piece.encode("utf-8"): n for piece, n in counts.items()})


def iter_text_blocks(lines: Iterable[str], block_chars: int = 1 << 20) -> Iterator[str]:
    """Join lines into blocks of about `block_chars` that encode exactly like the whole text.

    A block is cut just before the newline that precedes a line starting with a
    non-space character. Mid-text, GPT-2's pattern splits a whitespace run before a
    word into "the run minus its last character" and "that last character", and the
    cut falls exactly between the two; so no pre-tokenized piece spans a boundary and
    encoding block by block gives the ids of encoding the whole text, while holding
    one block in memory. Open files with `newline=""` so that line ends stay as they are.
    """
    block: list[str] = []
    size = 0
    for line in lines:
        if (size >= block_chars and line[:1] and not line[0].isspace()
                and block and block[-1].endswith("\n")):
            text = "".join(block)
            if len(text) > 1:
                yield text[:-1]
                block, size = ["\n"], 1
        block.append(line)
        size += len(line)
    if block:
        yield "".join(block)

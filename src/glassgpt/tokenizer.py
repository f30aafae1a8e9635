"""Tokenizers: text <-> token ids.

- `gpt2`: OpenAI's byte-level BPE (50,257 tokens, `<|endoftext|>` = 50256), built
  offline from the two vocabulary files shipped in `glassgpt/data` (checked by
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
import json
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Iterable, Sequence

import tiktoken

from .errors import GlassError

ENDOFTEXT = "<|endoftext|>"
# GPT-2's pre-tokenizer: contractions, letters, numbers, punctuation, whitespace.
# Text is split with it first; BPE merges never cross these pieces.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
VOCAB_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}


class TokenizerError(GlassError):
    pass


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

    def __init__(self, encoding: tiktoken.Encoding, spec: dict):
        self._enc = encoding
        self._spec = spec
        self.name = encoding.name
        self.n_vocab = encoding.n_vocab
        self.eot_id = encoding._special_tokens.get(ENDOFTEXT)
        # Bind the engine's methods directly: no Python work is added per call.
        self.encode_ordinary = encoding.encode_ordinary
        self.encode_batch = encoding.encode_ordinary_batch

    def encode(self, text: str, allowed_special: Iterable[str] = ()) -> list[int]:
        # `<|endoftext|>` typed by a user is plain text unless the caller allows it.
        if not allowed_special:
            return self._enc.encode_ordinary(text)
        return self._enc.encode(text, allowed_special=set(allowed_special), disallowed_special=())

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
    """`"gpt2"`, `"char"` (with `text`), or the path of a saved tokenizer JSON file."""
    if spec == "gpt2":
        return _gpt2()
    if spec == "char":
        if text is None:
            raise TokenizerError("get_tokenizer('char') needs text=... to take its characters from")
        return CharTokenizer.from_text(text)
    path = Path(spec)
    if path.is_file():
        return tokenizer_from_file(path)
    raise TokenizerError(f"unknown tokenizer {spec!r}: use gpt2, char, or the path of a tokenizer .json file")


def tokenizer_from_file(path: str | Path) -> Tokenizer:
    path = Path(path)
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot read tokenizer file {path}: {e}") from None
    return tokenizer_from_dict(spec, source=str(path))


def tokenizer_from_dict(spec: dict, source: str = "tokenizer spec") -> Tokenizer:
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "gpt2":
        return _gpt2()
    if kind == "char":
        return CharTokenizer(spec["chars"])
    if kind == "bpe":
        return _bpe_from_dict(spec)
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
    data = resources.files("glassgpt").joinpath("data").joinpath(name).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != VOCAB_SHA256[name]:
        raise TokenizerError(
            f"glassgpt/data/{name} has sha256 {digest[:12]}..., expected {VOCAB_SHA256[name][:12]}...: "
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


def _gpt2_ranks() -> dict[bytes, int]:
    """token bytes -> rank, from encoder.json, checked against the merge order in vocab.bpe."""
    char_to_byte = {c: b for b, c in gpt2_byte_to_unicode().items()}

    def to_bytes(token: str) -> bytes:
        return bytes(char_to_byte[c] for c in token)

    encoder = json.loads(_read_vocab_file("encoder.json"))
    ranks = {to_bytes(tok): i for tok, i in encoder.items() if tok != ENDOFTEXT}
    # tiktoken merges by rank, so ranks must follow the merge order of vocab.bpe.
    merges = _read_vocab_file("vocab.bpe").decode("utf-8").split("\n")[1:-1]
    for rank, line in enumerate(merges, start=256):
        first, second = line.split()
        if ranks.get(to_bytes(first) + to_bytes(second)) != rank:
            raise TokenizerError("encoder.json and vocab.bpe disagree: reinstall glassgpt")
    return ranks


def _bpe_from_dict(spec: dict) -> TiktokenTokenizer:
    tokens = [base64.b64decode(t) for t in spec["tokens"]]
    ranks = {tok: i for i, tok in enumerate(tokens)}
    specials = {ENDOFTEXT: len(tokens)}
    enc = tiktoken.Encoding(
        name=spec.get("name", "bpe"),
        pat_str=spec.get("pattern", GPT2_PATTERN),
        mergeable_ranks=ranks,
        special_tokens=specials,
    )
    return TiktokenTokenizer(enc, spec)

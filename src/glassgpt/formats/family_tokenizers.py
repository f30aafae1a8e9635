"""The tokenizers of Qwen3, Llama 3 and Gemma 3, and the chat formats the book's tokenizer classes apply.

    Qwen3Tokenizer(path)     tokenizer.json, run by Hugging Face's `tokenizers` library (an extra:
                             pip install glassgpt[families]); its chat wrap with the thinking switch
    Llama3Tokenizer(path)    tokenizer.model (base64 token and rank per line), run by tiktoken, with
                             Meta's special tokens after the ranks; ChatFormat's header and eot ids
    GemmaTokenizer(path)     Gemma 3's tokenizer.json (SentencePiece pieces), the bonus notebook's GemmaTokenizer
    family_tokenizer(dir, cfg)   the folder's own, checked against the model's vocabulary first

Both follow the book's classes (llms_from_scratch.qwen3.Qwen3Tokenizer, llama3.Llama3Tokenizer and
ChatFormat) and give their ids (tests/test_family_tokenizers.py), behind glassgpt's Tokenizer
interface (encode, decode_bytes, token_bytes), so that generate's streaming decode works as for GPT-2.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Iterable, Sequence

import tiktoken

from ..errors import TokenizerError
from ..tokenizer import Tokenizer, gpt2_byte_to_unicode
from .files import check_size

QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<think>", "</think>")
QWEN_SPLIT = re.compile(r"(<\|[^>]+?\|>|<think>|</think>)")

# Meta's pattern, as the book's Llama3Tokenizer passes it to tiktoken.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIALS = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<|start_header_id|>": 6,
                   "<|end_header_id|>": 7, "<|eot_id|>": 9}  # offsets after the ranks; the rest are reserved


# Where a model folder keeps each family's tokenizer (Meta's repositories: in original/), in the order tried.
TOKENIZER_FILES = {"qwen3": ("tokenizer.json",), "llama3": ("tokenizer.model", "original/tokenizer.model"),
                   "gemma3": ("tokenizer.json",),
                   "qwen3_5": ("tokenizer.json",),  # Qwen3.5: Qwen's byte-level BPE and specials, 248k ids
                   "olmo3": ("tokenizer.json",), "tiny_aya": ("tokenizer.json",)}
GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>")
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback: one byte a piece


class Qwen3Tokenizer(Tokenizer):
    """Qwen3's byte-level BPE from tokenizer.json; special tokens in the text are split out first."""

    def __init__(self, path: str | os.PathLike):
        self.file = Path(path)  # the file it is: a checkpoint keeps a copy (formats/glassgpt.py save_model)
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise TokenizerError("reading Qwen3's tokenizer.json needs the tokenizers library: "
                                 "pip install 'glassgpt[families]'") from None
        check_size(path, "tokenizer", TokenizerError)  # before the library reads it whole
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises its own Exception for a bad file
            raise TokenizerError(f"cannot read {path} as a tokenizer.json: {str(e).splitlines()[0][:200]}") from None
        self.name = "qwen3"
        self.specials = {t: i for t in QWEN_SPECIALS if (i := self._tok.token_to_id(t)) is not None}
        if "<|endoftext|>" not in self.specials:
            raise TokenizerError(f"{path} has no <|endoftext|> token: it is not Qwen3's tokenizer.json")
        self.n_vocab = self._tok.get_vocab_size(with_added_tokens=True)
        self.eot_id = self.specials["<|endoftext|>"]
        self._unbyte = {c: b for b, c in gpt2_byte_to_unicode().items()}

    def encode(self, text: str, allowed_special: Iterable[str] = ()) -> list[int]:
        """The ids of `text`; the special tokens in it are read as specials (as the book's class does)."""
        stripped = text.strip()
        if stripped in self.specials and "\n" not in stripped:
            return [self.specials[stripped]]
        ids = []
        for part in filter(None, QWEN_SPLIT.split(text)):
            ids.extend([self.specials[part]] if part in self.specials else self._tok.encode(part).ids)
        return ids

    def chat(self, user_message: str, add_generation_prompt: bool = True, thinking: bool = False) -> list[int]:
        """The ids of Qwen3's chat wrap of one user message, the book's `_wrap_chat`: with the
        generation prompt, thinking off puts an empty <think></think> block where the reply begins."""
        text = f"<|im_start|>user\n{user_message}<|im_end|>\n"
        if add_generation_prompt:
            text += "<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n")
        return self.encode(text)

    def token_bytes(self, token_id: int) -> bytes:
        self._check_ids([token_id])
        token = self._tok.id_to_token(token_id)
        if token in self.specials or token is None:
            return (token or "").encode("utf-8")
        return bytes(self._unbyte[c] for c in token)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return b"".join(self.token_bytes(i) for i in self._check_ids(ids))

    def to_dict(self) -> dict:
        return file_identity(self)


class GemmaTokenizer(Tokenizer):
    """Gemma 3's SentencePiece BPE from tokenizer.json (the notebook's GemmaTokenizer): its encode adds what the
    file's post-processor adds (<bos>); pieces mark a space with U+2581 and fall back to <0xHH> bytes."""

    def __init__(self, path: str | os.PathLike):
        self.file = Path(path)  # the file it is: a checkpoint keeps a copy (formats/glassgpt.py save_model)
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise TokenizerError("reading Gemma's tokenizer.json needs the tokenizers library: "
                                 "pip install 'glassgpt[families]'") from None
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises its own Exception for a bad file
            raise TokenizerError(f"cannot read {path} as a tokenizer.json: {str(e).splitlines()[0][:200]}") from None
        self.name = "gemma3"
        self.specials = {t: i for t in GEMMA_SPECIALS if (i := self._tok.token_to_id(t)) is not None}
        if "<eos>" not in self.specials or "<bos>" not in self.specials:
            raise TokenizerError(f"{path} has no <bos> or <eos> token: it is not Gemma's tokenizer.json")
        self.n_vocab = self._tok.get_vocab_size(with_added_tokens=True)
        self.eot_id = self.specials.get("<end_of_turn>", self.specials["<eos>"])  # where the notebook stops

    def encode(self, text: str, allowed_special: Iterable[str] = ()) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def chat(self, user_message: str, add_generation_prompt: bool = True) -> list[int]:
        """The notebook's apply_chat_template of one user message: its turn, then the model's turn opened."""
        text = f"<start_of_turn>user\n{user_message}<end_of_turn>\n"
        return self.encode(text + ("<start_of_turn>model\n" if add_generation_prompt else ""))

    def token_bytes(self, token_id: int) -> bytes:
        self._check_ids([token_id])
        piece = self._tok.id_to_token(token_id) or ""
        byte = BYTE_PIECE.fullmatch(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        return piece.encode("utf-8") if piece in self.specials else piece.replace("\u2581", " ").encode("utf-8")

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return b"".join(self.token_bytes(i) for i in self._check_ids(ids))

    def to_dict(self) -> dict:
        return file_identity(self)


class Llama3Tokenizer(Tokenizer):
    """Llama 3's tiktoken BPE from tokenizer.model; special tokens numbered after the ranks, as Meta's."""

    def __init__(self, path: str | os.PathLike):
        self.file = Path(path)  # the file it is: a checkpoint keeps a copy (formats/glassgpt.py save_model)
        from tiktoken.load import load_tiktoken_bpe
        check_size(path, "tokenizer", TokenizerError)  # before tiktoken reads it whole
        try:
            ranks = load_tiktoken_bpe(str(path))
        except Exception as e:  # base64 or format errors, in tiktoken's words
            raise TokenizerError(f"cannot read {path} as a tokenizer.model (base64 token, rank per line): "
                                 f"{str(e).splitlines()[0][:200]}") from None
        first = len(ranks)  # 128,000 in Meta's file
        self.specials = {name: first + offset for name, offset in LLAMA3_SPECIALS.items()}
        free = [first + o for o in range(256) if first + o not in self.specials.values()]
        self.specials.update({f"<|reserved_special_token_{k}|>": i for k, i in enumerate(free)})
        self._enc = tiktoken.Encoding(name=Path(path).name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                      special_tokens=self.specials)
        self.name = "llama3"
        self.n_vocab = self._enc.n_vocab
        self.eot_id = self.specials["<|eot_id|>"]

    def encode(self, text: str, allowed_special: Iterable[str] = ()) -> list[int]:
        """Plain text: a special token typed in it is refused, as tiktoken (and the book) do by default."""
        return self._enc.encode(text, allowed_special=set(allowed_special) if allowed_special != "all" else "all")

    def chat(self, user_message: str, system_message: str = "You are a helpful assistant.") -> list[int]:
        """The book's ChatFormat.encode: begin_of_text, the system and user turns, the assistant header."""
        s = self.specials

        def header(role: str) -> list[int]:
            return [s["<|start_header_id|>"]] + self.encode(role) + [s["<|end_header_id|>"]] + self.encode("\n\n")

        return ([s["<|begin_of_text|>"]] + header("system") + self.encode(system_message) + [s["<|eot_id|>"]]
                + header("user") + self.encode(user_message) + [s["<|eot_id|>"]] + header("assistant"))

    def token_bytes(self, token_id: int) -> bytes:
        self._check_ids([token_id])
        return self._enc.decode_single_token_bytes(token_id)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return self._enc.decode_bytes(self._check_ids(ids))

    def to_dict(self) -> dict:
        return file_identity(self)


# The bonus notebooks' tokenizer classes (OlmoTokenizer, TinyAyaTokenizer): their end token and chat wrap.
BONUS_EOS = {"olmo3": ("<|endoftext|>", "<end_of_turn>"), "tiny_aya": ("<EOS_TOKEN>",)}
BONUS_CHAT = {"olmo3": "<|im_start|>user\n{}\n<|im_end|>\n<|im_start|>assistant\n",
              "tiny_aya": "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|USER_TOKEN|>{}<|END_OF_TURN_TOKEN|>"
                          "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>"}


class TokenizerJson(Tokenizer):
    """A bonus model's tokenizer.json as its notebook reads it: `encode` is the tokenizers library's (its
    special tokens in the text read as specials), the end token and the chat wrap the notebook's."""

    def __init__(self, path: str | os.PathLike, family: str):
        self.file = Path(path)  # the file it is: a checkpoint keeps a copy (formats/glassgpt.py save_model)
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise TokenizerError("reading a tokenizer.json needs the tokenizers library: "
                                 "pip install 'glassgpt[families]'") from None
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises its own Exception for a bad file
            raise TokenizerError(f"cannot read {path} as a tokenizer.json: {str(e).splitlines()[0][:200]}") from None
        self.name = family
        self.specials = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}
        self.n_vocab = self._tok.get_vocab_size(with_added_tokens=True)
        self.eot_id = next((self.specials[t] for t in BONUS_EOS[family] if t in self.specials), None)
        self._unbyte = {c: b for b, c in gpt2_byte_to_unicode().items()}

    def encode(self, text: str, allowed_special: Iterable[str] = ()) -> list[int]:
        return self._tok.encode(text).ids

    def chat(self, user_message: str) -> list[int]:
        """The ids of the notebook's apply_chat_template(user_message)."""
        return self.encode(BONUS_CHAT[self.name].format(user_message))

    def token_bytes(self, token_id: int) -> bytes:
        self._check_ids([token_id])
        token = self._tok.id_to_token(token_id)
        if token in self.specials or token is None:
            return (token or "").encode("utf-8")
        if all(c in self._unbyte for c in token):  # byte-level BPE: one character per byte
            return bytes(self._unbyte[c] for c in token)
        return self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return b"".join(self.token_bytes(i) for i in self._check_ids(ids))

    def to_dict(self) -> dict:
        return file_identity(self)


def file_identity(tokenizer: Tokenizer) -> dict:
    """A tokenizer that is its file (tokenizer.json, tokenizer.model), as a dict: its name, its file's name and
    sha256 (what a token cache's key and a run's record hold); a checkpoint keeps the file itself."""
    digest = hashlib.sha256()
    with open(tokenizer.file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return {"type": "file", "name": tokenizer.name, "file": tokenizer.file.name, "sha256": digest.hexdigest()}


def check_vocabulary(tokenizer: Tokenizer, vocab_size: int, source: str) -> None:
    """Refuse, before anything runs, a tokenizer with ids the model has no rows for (Qwen3's 151,669
    ids fit its 151,936 rows; the rows past them are padding)."""
    if tokenizer.n_vocab > vocab_size:
        raise TokenizerError(f"{source} has {tokenizer.n_vocab:,} tokens but the model's vocab_size is "
                             f"{vocab_size:,}: it is another model's tokenizer; use the one saved with these weights")


def tokenizer_file(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer in one file, told by what the file is: a tokenizer.model (base64 token and rank per
    line: Llama 3's) or a Hugging Face tokenizer.json (a `model` entry: Qwen3's byte-level BPE). A
    tokenizer .json that glassgpt saved is formats.get_tokenizer's."""
    path = Path(path)
    if not path.is_file():
        raise TokenizerError(f"--tokenizer {path}: no such file: give gpt2, a tokenizer.json or a tokenizer.model")
    return (Llama3Tokenizer if path.suffix == ".model" else Qwen3Tokenizer)(path)


def family_tokenizer(path: str | os.PathLike, family: str, vocab_size: int) -> Tokenizer | None:
    """The tokenizer in a model folder (tokenizer.json for Qwen3, Qwen3.5, Gemma 3, OLMo 3 and Tiny Aya;
    tokenizer.model or original/tokenizer.model for Llama 3), checked against the model's vocabulary; None when the
    folder has none."""
    path = Path(path)
    make = {"qwen3": Qwen3Tokenizer, "llama3": Llama3Tokenizer, "gemma3": GemmaTokenizer,
            "qwen3_5": Qwen3Tokenizer}.get(family)
    if family in BONUS_EOS:  # OLMo 3, Tiny Aya: their tokenizer.json as the notebooks read it
        make = lambda file: TokenizerJson(file, family)  # noqa: E731
    for file in (path / name for name in TOKENIZER_FILES[family]):
        if file.is_file():
            tokenizer = make(file)
            check_vocabulary(tokenizer, vocab_size, str(file))
            return tokenizer
    return None

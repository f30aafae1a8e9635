"""Text files -> token ids cached on disk -> `context_length` windows to train on.

    files (a file, a folder of .txt files, or a glob)
      -> checked (UTF-8, no NUL bytes, not empty) and hashed
      -> tokenized once into `tokens-<key>.bin` (uint16 when the vocabulary fits, else
         uint32), memory-mapped, so a corpus larger than RAM works
      -> split: the first 90% of the tokens train, the last 10% validate (as nanoGPT)
      -> windows: x = ids[o : o + t], y = ids[o + 1 : o + t + 1]

The cache key is the sha256 of every file's contents (in order) and of the
tokenizer's spec, so changing either tokenizes again; paths are not part of it, so
moving a corpus keeps its cache. Files are joined with `<|endoftext|>` when the
tokenizer has one. `TextTask` is what `fit` (loop.py) trains on: random windows keyed
by (seed, step, sample index), so a step's batch is the same on resume and under any
split of the global batch over ranks and micro-steps; and a fixed, evenly spaced set
of validation windows, the same for training and for `glassgpt eval`. Without a count
(`eval_batches=None`) they are as many as score every held-out token once, at most
`EVAL_BATCHES` batches: on a small split more windows would score the same tokens again.

Leaves out: document-aware packing, shuffled shards, streaming from the network.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch
from torch import nn

from ...adopt import adopt
from ...errors import CheckpointError, DataError
from ...formats.files import create_file, open_to_write, read_json, special_file
from ...generate import generate
from ...engine.loss import cross_entropy
from ...formats import get_tokenizer
from ...tokenizer import ENDOFTEXT, CharTokenizer, Tokenizer, TiktokenTokenizer, iter_text_blocks
from ..loop.loop import evaluate_loss
from ..loop.task import Task

CACHE_FORMAT = 1
READ_BYTES = 1 << 20
EVAL_BATCHES = 20  # the most evaluation batches when no count is given


# --- finding and checking files -----------------------------------------------------

def resolve_files(spec: str | os.PathLike) -> list[Path]:
    """The files that `--data` names: one file, every *.txt under a folder, or a glob."""
    text = str(spec)
    if any(c in text for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file())
        if not files:
            raise DataError(f"no file matches {text!r}: check the pattern (quote it so the shell "
                            "does not expand it)")
        return files
    path = Path(text)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise DataError(f"{path} holds no .txt files: pass a file, or a glob such as '{path}/**/*.md'")
        return files
    kind = special_file(path)
    if kind:
        raise DataError(f"--data {text} is {kind}, not a text file: pass a file, a folder of .txt files or a glob")
    raise DataError(f"--data {text}: no such file or directory")


def scan_file(path: Path, on_text=None) -> str:
    """Check that `path` is non-empty UTF-8 text without NUL bytes; return its sha256.

    `on_text(chunk)` receives the decoded text as it is read (to collect characters).
    """
    digest = hashlib.sha256()
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    offset = 0
    with open(path, "rb") as f:
        while chunk := f.read(READ_BYTES):
            digest.update(chunk)
            nul = chunk.find(b"\x00")
            if nul >= 0:
                raise DataError(f"{path} looks binary (a NUL byte at byte {offset + nul:,}): "
                                "glassgpt trains on UTF-8 text files")
            pending = len(decoder.getstate()[0])
            try:
                text = decoder.decode(chunk)
            except UnicodeDecodeError as e:
                at = offset - pending + e.start
                raise DataError(f"{path} is not UTF-8 text (byte {e.object[e.start]:#04x} at byte {at:,}): "
                                "convert it to UTF-8, e.g. iconv -f latin1 -t utf-8") from None
            if on_text is not None:
                on_text(text)
            offset += len(chunk)
    if offset == 0:
        raise DataError(f"{path} is empty: give files with some text")
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8 text (it ends inside a multi-byte character): "
                        "convert it to UTF-8") from None
    return digest.hexdigest()


def read_blocks(path: Path) -> Iterator[str]:
    """The text of a checked file, in blocks that tokenize exactly like the whole text."""
    with open(path, encoding="utf-8", newline="") as f:
        yield from iter_text_blocks(f)


def build_tokenizer(spec: str, files: list[Path]) -> Tokenizer:
    """`gpt2`, a tokenizer .json file (glassgpt's, or a model's own tokenizer.json), a tokenizer.model (Llama 3's),
    or `char`: the characters of these files."""
    if spec != "char" and Path(spec).is_file():  # what the file is: glassgpt's .json, or a model's own file
        from ...formats.source import read_tokenizer_spec  # (formats imports training's pieces)
        return read_tokenizer_spec(spec)
    if spec != "char":
        return get_tokenizer(spec)
    chars: set[str] = set()
    for path in files:
        scan_file(path, chars.update)
    return CharTokenizer(chars)


# --- tokenizing once, into a memory-mapped cache --------------------------------------

@dataclass
class TokenCache:
    path: Path   # the .bin file
    key: str
    n_tokens: int
    dtype: str

    def ids(self) -> np.ndarray:
        """All token ids, memory-mapped (read-only)."""
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))


def token_dtype(n_vocab: int) -> str:
    return "uint16" if n_vocab <= 1 << 16 else "uint32"


def cache_key(file_hashes: list[str], tokenizer: Tokenizer, allow_special: bool = False) -> str:
    spec = {"format": CACHE_FORMAT, "files": file_hashes, "tokenizer": tokenizer.to_dict()}
    if allow_special:  # (only then: the keys of plain-text caches stay what they were)
        spec["allowed_special"] = [ENDOFTEXT]
    spec = json.dumps(spec, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(spec.encode("utf-8")).hexdigest()


def tokenize_files(files: list[Path], tokenizer: Tokenizer, cache_dir: str | os.PathLike,
                   progress=None, expect_key: str | None = None, allow_special: bool = False) -> TokenCache:
    """Token ids of `files` (joined by `<|endoftext|>` if the tokenizer has one), cached in `cache_dir`.
    `<|endoftext|>` written in a file is plain text, unless `allow_special` reads it as its token.

    A cache hit costs one read of the files (to hash them). Writing is atomic: the
    .bin is written under a temporary name, then its .json record; a cache without
    its record is never used, and temporary files that a killed process left are
    removed by the next one. `progress(n_files_done)` is called after each file.
    `expect_key`: the cache key (the data's fingerprint) that a resumed run recorded;
    other files are refused before anything is tokenized.
    """
    cache_dir = Path(cache_dir)
    hashes = [scan_file(p) for p in files]
    key = cache_key(hashes, tokenizer, allow_special)
    if expect_key is not None and key != expect_key:
        raise DataError(f"the data changed since the run started ({len(files)} file(s) now, whose sha256 "
                        "differ from the run's record), so --resume could not continue it exactly: restore "
                        "the files, or start a new run from its weights with --init RUN_DIR")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with _lock(cache_dir / ".lock"):  # ranks of a torchrun job on one machine tokenize once
            for orphan in cache_dir.glob(".tokens-*.tmp"):  # a killed process's (we hold the lock)
                orphan.unlink(missing_ok=True)
            return _read_cache(cache_dir, key) or _write_cache(files, tokenizer, cache_dir, key, progress,
                                                               allow_special)
    except OSError as e:  # a full disk, a file-size limit, a read-only disk
        raise DataError(f"could not write the token cache in {cache_dir} ({e.strerror or e}): free some space "
                        "or pass --cache-dir on a writable disk") from None


def _write_cache(files: list[Path], tokenizer: Tokenizer, cache_dir: Path, key: str, progress,
                 allow_special: bool = False) -> TokenCache:
    dtype = token_dtype(tokenizer.n_vocab)
    bin_path = cache_dir / f"tokens-{key[:16]}.bin"
    tmp = bin_path.with_name(f".{bin_path.name}.{os.getpid()}.tmp")
    n_tokens = 0
    try:
        with create_file(tmp) as out:
            for i, path in enumerate(files):
                if i and tokenizer.eot_id is not None:
                    out.write(np.array([tokenizer.eot_id], dtype=dtype).tobytes())
                    n_tokens += 1
                for ids in _encode_file(path, tokenizer, allow_special):
                    out.write(ids.astype(dtype, copy=False).tobytes())
                    n_tokens += len(ids)
                if progress is not None:
                    progress(i + 1)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, bin_path)
    finally:  # also on Ctrl-C or SIGTERM (the command line turns SIGTERM into an exception)
        tmp.unlink(missing_ok=True)
    record = {"format": CACHE_FORMAT, "key": key, "n_tokens": n_tokens, "dtype": dtype,
              "files": [str(p) for p in files], "tokenizer": tokenizer.to_dict().get("type")}
    tmp_json = bin_path.with_name(f".{bin_path.stem}.json.{os.getpid()}.tmp")
    try:
        with create_file(tmp_json) as out:
            out.write(json.dumps(record, indent=1).encode())
        os.replace(tmp_json, bin_path.with_suffix(".json"))
    finally:
        tmp_json.unlink(missing_ok=True)
    return TokenCache(bin_path, key, n_tokens, dtype)


def _read_cache(cache_dir: Path, key: str) -> TokenCache | None:
    bin_path = cache_dir / f"tokens-{key[:16]}.bin"
    try:
        record = read_json(bin_path.with_suffix(".json"))
    except CheckpointError:  # missing or damaged: tokenize again
        return None
    if record.get("key") != key or record.get("format") != CACHE_FORMAT or not bin_path.is_file():
        return None
    dtype = record["dtype"]
    if bin_path.stat().st_size != record["n_tokens"] * np.dtype(dtype).itemsize:
        return None  # truncated: tokenize again
    return TokenCache(bin_path, key, record["n_tokens"], dtype)


def _encode_file(path: Path, tokenizer: Tokenizer, allow_special: bool = False) -> Iterator[np.ndarray]:
    if allow_special and not isinstance(tokenizer, CharTokenizer):  # (a block never splits the token: no newline)
        for block in read_blocks(path):
            yield np.array(tokenizer.encode(block, allowed_special={ENDOFTEXT}), dtype=np.int64)
    elif isinstance(tokenizer, CharTokenizer):
        # One vectorised lookup per block instead of a dict lookup per character.
        codes = np.array([ord(c) for c in tokenizer.chars], dtype=np.uint32)
        for block in read_blocks(path):
            points = np.frombuffer(block.encode("utf-32-le"), dtype=np.uint32)
            ids = np.searchsorted(codes, points).clip(max=len(codes) - 1)
            unknown = codes[ids] != points
            if unknown.any():
                char = chr(int(points[int(np.argmax(unknown))]))
                raise DataError(f"{path} has the character {char!r}, which is not in the char tokenizer's "
                                f"{len(codes)} characters: train a new char tokenizer on this data")
            yield ids
    elif isinstance(tokenizer, TiktokenTokenizer):
        batch: list[str] = []
        for block in read_blocks(path):
            batch.append(block)
            if len(batch) == 8:
                yield from (np.array(ids, dtype=np.int64) for ids in tokenizer.encode_batch(batch))
                batch = []
        if batch:
            yield from (np.array(ids, dtype=np.int64) for ids in tokenizer.encode_batch(batch))
    else:
        for block in read_blocks(path):
            yield np.array(tokenizer.encode(block), dtype=np.int64)


@contextlib.contextmanager
def _lock(path: Path):
    try:
        import fcntl
    except ImportError:  # Windows: no lock; the atomic rename still keeps the cache whole
        yield
        return
    with open_to_write(path, "a", DataError) as f:  # never through a link
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --- the split and the windows ----------------------------------------------------------

def split_ids(ids: np.ndarray, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(train, val): the first `1 - val_fraction` of the tokens and the rest. Views, no copy."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_train = int(len(ids) * (1.0 - val_fraction))
    return ids[:n_train], ids[n_train:]


def load_corpus(spec: str | os.PathLike, tokenizer: Tokenizer | str, cache_dir: str | os.PathLike,
                val_fraction: float = 0.1) -> tuple[Tokenizer, np.ndarray, np.ndarray]:
    """(tokenizer, train ids, val ids) for `--data spec`; `tokenizer` may be a spec string."""
    files = resolve_files(spec)
    if isinstance(tokenizer, str):
        tokenizer = build_tokenizer(tokenizer, files)
    cache = tokenize_files(files, tokenizer, cache_dir)
    train, val = split_ids(cache.ids(), val_fraction)
    return tokenizer, train, val


def covering_windows(n_tokens: int, context_length: int) -> int:
    """Windows of `context_length` predictions that, side by side, score every token after the
    first of `n_tokens` (the targets): ceil((n_tokens - 1) / context_length)."""
    return -(-(n_tokens - 1) // context_length)


def window_batch(ids: np.ndarray, offsets: Iterable[int], length: int) -> dict[str, torch.Tensor]:
    """{"input_ids": [b, t], "targets": [b, t]} int64: windows at `offsets`, targets shifted by one."""
    rows = np.stack([np.asarray(ids[o:o + length + 1], dtype=np.int64) for o in offsets])
    rows = torch.from_numpy(rows)  # [b, t + 1]
    return {"input_ids": rows[:, :-1], "targets": rows[:, 1:]}


def text_task(files: list[Path], tokenizer: Tokenizer, data: dict, cfg, run_dir: Path, expect: str | None = None
              ) -> tuple["TextTask", str, str]:
    """glassgpt's pretraining task for a run: (TextTask, the data's fingerprint, the line that says what
    the data holds). `data`: the run's record (cache_dir, val_fraction, context_length, sample_prompt);
    `expect`: on a resume, the fingerprint the data must still have."""
    t0 = time.perf_counter()
    # A run records its cache relative to itself; older runs recorded it relative to where they started.
    cache_dir = run_dir / data["cache_dir"] if "fingerprint" in data or data["cache_dir"] == "cache" else data["cache_dir"]
    cache = tokenize_files(files, tokenizer, cache_dir, expect_key=expect, allow_special=data.get("allow_special", False))
    train, val = split_ids(cache.ids(), data["val_fraction"])
    line = (f"data: {len(files)} file(s), {cache.n_tokens:,} tokens ({len(train):,} train, {len(val):,} val), "
            f"tokenizer {tokenizer.name} ({tokenizer.n_vocab:,} tokens), cached in {cache.path} "
            f"({time.perf_counter() - t0:.1f} s)")
    task = TextTask(train, val, data["context_length"], cfg.batch_size, tokenizer=tokenizer, seed=cfg.seed,
                    eval_batches=cfg.eval_batches, sample_tokens=cfg.sample_tokens,
                    sample_prompt=data.get("sample_prompt"), allow_special=data.get("allow_special", False))
    return task, cache.key, line


class TextTask(Task):
    """Next-token prediction on windows of a token array (see loop.Task).

    Training sample `i` of step `s` starts at a random offset drawn from a generator
    seeded with (seed, s, i), where i = (micro * world + rank) * batch_size + row:
    the batch of a step is a function of the step alone, and a global batch of
    B * K * W windows is the same whether it is run as B x K micro-steps x W ranks
    or any other factoring with the same product.
    """

    def __init__(self, train: np.ndarray, val: np.ndarray, context_length: int, batch_size: int,
                 tokenizer: Tokenizer | None = None, seed: int = 1337, eval_batches: int | None = EVAL_BATCHES,
                 sample_tokens: int = 40, sample_prompt: str | None = None, allow_special: bool = False):
        self.train, self.val = train, val
        self.context_length, self.batch_size, self.seed = context_length, batch_size, seed
        self.tokenizer, self.sample_tokens, self.n_eval_batches = tokenizer, sample_tokens, eval_batches
        need = context_length + 1
        if len(train) < need:
            raise DataError(f"the training split has {len(train):,} tokens, fewer than context_length + 1 "
                            f"= {need:,}: give more text or a smaller --context-length")
        if len(val) and len(val) < need:
            raise DataError(f"the validation split has {len(val):,} tokens, fewer than context_length + 1 "
                            f"= {need:,}: raise --val-fraction, give more text or a smaller --context-length")
        if sample_prompt is not None and tokenizer is not None:
            self.sample_prompt_ids = tokenizer.encode(sample_prompt, {ENDOFTEXT} if allow_special else ())
        else:  # the first few tokens of held-out text, so every sample starts the same way
            source = val if len(val) else train
            self.sample_prompt_ids = [int(i) for i in source[:max(1, min(8, context_length // 2))]]

    def steps_per_epoch(self, grad_accum: int = 1, world: int = 1) -> int:
        """Steps that see as many windows as the training split holds side by side (for --epochs)."""
        windows = len(self.train) // self.context_length
        return max(1, -(-windows // (self.batch_size * grad_accum * world)))

    def train_batch(self, step: int, micro: int, rank: int, world: int) -> dict[str, torch.Tensor]:
        first = (micro * world + rank) * self.batch_size
        high = len(self.train) - self.context_length  # exclusive: the target needs one more token
        offsets = [np.random.default_rng([self.seed, step, i]).integers(high)
                   for i in range(first, first + self.batch_size)]
        return window_batch(self.train, offsets, self.context_length)

    def eval_offsets(self) -> np.ndarray:
        """`eval_batches * batch_size` window starts spread evenly over the validation split;
        without `eval_batches`, the windows that cover it (at most EVAL_BATCHES batches of them)."""
        if not len(self.val):
            return np.zeros(0, dtype=np.int64)
        if self.n_eval_batches is None:  # the first window starts at 0, the last ends at the split's end
            n = min(EVAL_BATCHES * self.batch_size, covering_windows(len(self.val), self.context_length))
        else:
            n = self.n_eval_batches * self.batch_size
        return np.linspace(0, len(self.val) - self.context_length - 1, n).round().astype(np.int64)

    def eval_batches(self) -> Iterable[dict[str, torch.Tensor]]:
        offsets = self.eval_offsets()
        for start in range(0, len(offsets), self.batch_size):
            yield window_batch(self.val, offsets[start:start + self.batch_size], self.context_length)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(batch["input_ids"])  # [b, t, V]
        return cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())

    def tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["input_ids"].numel()

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        return {}

    def sample(self, model: torch.nn.Module) -> str | None:
        if self.tokenizer is None or self.sample_tokens == 0:
            return None
        out = generate(model, self.sample_prompt_ids, self.sample_tokens, temperature=0.8, top_k=200, seed=self.seed)
        return self.tokenizer.decode(out[0].tolist())


def evaluate_text(model: nn.Module, ids, context_length: int, batch_size: int = 8, eval_batches: int | None = None,
                  dtype: str | None = None) -> tuple[float | None, int]:
    """The Python function behind `glassgpt eval`: the mean next-token loss over windows of
    `context_length` tokens of `ids` (a 1-D array of token ids), and how many windows that was:
    `eval_batches * batch_size` windows evenly spaced, or (None) just enough to cover the text once.
    `model` is any model adopt.py reads (glassgpt's, the book's GPTModel, nanoGPT's, transformers'),
    checked once on the first window."""
    task = TextTask(ids, ids, context_length, batch_size, seed=0, eval_batches=eval_batches)
    model = adopt(model, [int(i) for i in ids[:context_length]], described=True)  # its own forward gives the logits
    return evaluate_loss(model, task, dtype), len(task.eval_offsets())

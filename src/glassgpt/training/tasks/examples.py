"""What both finetuning tasks share: reading data files, holding out validation records,
padding, batches in shuffled epochs, which weights train, and how fast.

The tasks themselves are classify.py (the book's chapter 6) and instruct.py (chapter 7).
Batches depend only on (step, micro, rank, world): the examples are read as one endless
stream of seeded shuffles, so an interrupted run resumes exactly without a data cursor.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from ...errors import DataError, GlassError
from ...model import GPTModel
from ...tokenizer import Tokenizer
from .lora import apply_lora, merged_model
from ..loop.task import Task


# --- reading data files --------------------------------------------------------------

# The formats `read_records` takes: one list for --help and the README.
DATA_FORMATS = "CSV (.csv), TSV (.tsv), a JSON list (.json) or JSON Lines (.jsonl)"


@dataclass
class Records:
    """The records of a data file, in file order, and where each one is."""

    path: Path
    values: list[Any]                          # a dict per CSV row; any JSON value (None: not valid JSON)
    lines: list[int | None]                    # the line each record starts on (None inside a JSON list)
    problems: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # (index, why) of unparsed lines

    def where(self, i: int) -> str:
        """What an error message names: 'data.csv:7', the line as the file counts it (from 1), or
        'data.json record 3 of 40' inside a JSON list (counting from 1 too)."""
        line = self.lines[i]
        return f"{self.path}:{line}" if line is not None else f"{self.path} record {i + 1} of {len(self.values)}"


def read_records(path: str | Path) -> Records:
    """The records of a CSV/TSV, JSON list or JSONL file (see DATA_FORMATS).

    Record indices count from 0 in file order. A JSONL line that is not valid JSON is
    kept as None and listed in `problems` (the caller decides whether to skip it); a
    CSV row with more or fewer fields than the header is an error naming its line.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}): save it as UTF-8") from None
    if not text.strip():
        raise DataError(f"{path} is empty: it needs at least one record")
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv") or (suffix not in (".json", ".jsonl") and text.lstrip()[0] not in "[{"):
        return _read_csv(path, text, "\t" if suffix == ".tsv" else ",")
    if text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} is not valid JSON (line {e.lineno}: {e.msg})") from None
        if not isinstance(values, list) or not values:
            raise DataError(f"{path} holds an empty list: it needs at least one record")
        return Records(path, values, [None] * len(values))
    records = Records(path, [], [])
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        records.lines.append(number)
        try:
            records.values.append(json.loads(line))
        except json.JSONDecodeError as e:
            records.problems.append((len(records.values), f"not valid JSON ({e.msg})"))
            records.values.append(None)
    return records


def _read_csv(path: Path, text: str, delimiter: str) -> Records:
    # StringIO, not splitlines(): a quoted field may hold newlines.
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    header = next(reader)
    records = Records(path, [], [])
    start = reader.line_num + 1  # the line the next row starts on
    for fields in reader:
        line, start = start, reader.line_num + 1
        if not fields:
            continue  # a blank line
        if len(fields) != len(header):
            sep = "a tab" if delimiter == "\t" else "a comma"
            raise DataError(f"{path}:{line}: the row has {len(fields)} fields but the header has {len(header)} "
                            f"({', '.join(header)}): quote a field that holds {sep}, or fix the row")
        records.values.append(dict(zip(header, fields)))
        records.lines.append(line)
    if not records.values:
        raise DataError(f"{path} has a header line but no rows")
    return records


def holdout(n: int, fraction: float, seed: int = 0, min_train: int = 1) -> tuple[list[int], list[int]]:
    """(train, val) record indices, in file order: a seeded random `fraction` (at least one) held out."""
    n_val = max(1, round(n * fraction))
    if n - n_val < min_train:
        raise DataError(f"{n} usable record(s) are too few to hold out {fraction:.0%} for validation: "
                        "add records or pass --val FILE")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[n_val:]), sorted(order[:n_val])


def pad_id_of(tokenizer: Tokenizer) -> int:
    """`<|endoftext|>` where the tokenizer has one, else 0: padding is never attended to anyway."""
    return tokenizer.eot_id if tokenizer.eot_id is not None else 0


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad id lists to one length: (ids [b, t] int64, lengths [b] int64)."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    ids = torch.full((len(seqs), int(lengths.max())), pad_id, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, :len(s)] = torch.as_tensor(s, dtype=torch.long)
    return ids, lengths


# --- how fast to learn -----------------------------------------------------------------

BOOK_LR = 5e-5  # the book's finetuning learning rate (chapter 6: GPT-2 124M; chapter 7: 355M)


def default_lr(emb_dim: int) -> float:
    """The book's 5e-5 at GPT-2's widths (emb_dim >= 768); 5e-5 x 768 / emb_dim for narrower models.

    AdamW moves each weight by about lr per step, so a logit of the new head moves by
    about lr x emb_dim: a narrower model needs a larger lr to learn in as many steps.
    Measured on a 24-row question/statement CSV (last block trainable, 5 epochs = 15
    steps of 8): random-init models 32, 64, 256 and 768 wide classify every training row
    with this rule; at 5e-5 the 32- and 64-wide ones do not (val loss 0.64 -> 0.63).
    """
    return BOOK_LR * max(1.0, 768 / emb_dim)


# --- which weights train -------------------------------------------------------------

def freeze(model: GPTModel, trainable: str = "last-block") -> None:
    """Set requires_grad: `all`, `head`, `last-block` or `last-N-blocks`.

    `final_norm` and `out_head` are always trainable: the head is new, and the norm
    scales what the head sees (the book trains both with the last block).
    """
    n_layers = model.cfg.n_layers
    if trainable == "all":
        n_blocks = n_layers
    elif trainable == "head":
        n_blocks = 0
    elif trainable == "last-block":
        n_blocks = 1
    elif m := re.fullmatch(r"last-(\d+)-blocks", trainable):
        n_blocks = int(m.group(1))
        if not 1 <= n_blocks <= n_layers:
            raise GlassError(f"--trainable {trainable}: the model has {n_layers} blocks; choose 1..{n_layers}")
    else:
        raise GlassError(f"unknown --trainable {trainable!r}: use all, head, last-block or last-N-blocks")
    for p in model.parameters():
        p.requires_grad_(trainable == "all")
    for block in list(model.trf_blocks)[n_layers - n_blocks:]:
        block.requires_grad_(True)
    model.final_norm.requires_grad_(True)
    model.out_head.requires_grad_(True)


def set_trainable(model: GPTModel, settings: dict[str, Any], seed: int) -> None:
    """LoRA adapters (settings' lora_rank, lora_alpha), or `freeze` to settings' trainable."""
    if settings["lora_rank"]:
        apply_lora(model, settings["lora_rank"], settings["lora_alpha"], seed)
    else:
        freeze(model, settings["trainable"])


def finetune_defaults(n_train: int, emb_dim: int, batch_size: int, grad_accum: int, world: int, epochs: float,
                      max_steps: int | None, sample_tokens: int) -> dict[str, Any]:
    """glassgpt's finetuning settings for a run: `epochs` of steps (unless `max_steps`), lr by
    `default_lr`, a tenth of the steps (at most 100) of warm-up, one evaluation per epoch (at most 100 steps)."""
    per_epoch = steps_per_epoch(n_train, batch_size, grad_accum, world)
    max_steps = max_steps or max(1, math.ceil(epochs * per_epoch))
    return {"lr": default_lr(emb_dim), "max_steps": max_steps, "warmup_steps": min(100, max_steps // 10),
            "eval_every": min(100, per_epoch), "sample_tokens": sample_tokens}


# --- batches that depend only on (step, micro, rank, world) ---------------------------

@functools.lru_cache(maxsize=8)
def _permutation(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    # (mod 2**64: a seed up to 2**64 - 1 stays in manual_seed's range; smaller seeds draw as before)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**64)
    return tuple(torch.randperm(n, generator=gen).tolist())


def sample_indices(n: int, batch_size: int, batch_number: int, seed: int) -> list[int]:
    """Examples of global micro-batch `batch_number`: a new seeded shuffle every epoch.

    The examples are read as one endless stream of shuffled epochs, so a batch may
    straddle two epochs and every example is seen once per epoch. Nothing here keeps
    state, which is what makes an interrupted run resume exactly.
    """
    out = []
    for p in range(batch_number * batch_size, (batch_number + 1) * batch_size):
        epoch, i = divmod(p, n)
        out.append(_permutation(n, seed, epoch)[i])
    return out


def steps_per_epoch(n: int, batch_size: int, grad_accum: int = 1, world: int = 1) -> int:
    return max(1, math.ceil(n / (batch_size * grad_accum * world)))


class ExampleStream(Task):
    """What both tasks share: global micro-batch numbers, evaluation batches, checkpoints."""

    n_train: int
    n_val: int

    def __init__(self, batch_size: int, grad_accum: int, seed: int, eval_batches: int | None):
        if batch_size < 1 or grad_accum < 1:
            raise GlassError(f"batch_size and grad_accum must be positive, got {batch_size}, {grad_accum}")
        self.batch_size, self.grad_accum, self.seed = batch_size, grad_accum, seed
        self.n_eval_batches = eval_batches

    def _train_indices(self, step: int, micro: int, rank: int, world: int) -> list[int]:
        # grad_accum must be the loop's (TrainConfig.grad_accum): batch numbers then never repeat.
        number = (step * self.grad_accum + micro) * world + rank
        return sample_indices(self.n_train, self.batch_size, number, self.seed)

    def _val_chunks(self, limit: int | None) -> Iterator[list[int]]:
        for k, start in enumerate(range(0, self.n_val, self.batch_size)):
            if limit is not None and k >= limit:
                return
            yield list(range(start, min(start + self.batch_size, self.n_val)))

    def checkpoint_model(self, model: GPTModel) -> GPTModel:
        """What train.fit writes as the loadable checkpoint: with LoRA, the merged model.

        fit then keeps the training model's own tensors (base + adapters) in
        train_model.safetensors beside it, and `--resume` reads those.
        """
        return merged_model(model)


"""The book's chapter 7, as its code runs it: `glassgpt finetune instruct --recipe book`.

    instruction-data.json -> the first 85% train, the next 10% test, the rest validation
         -> format_input(entry) + "\\n\\n### Response:\\n" + output, encoded as one text
                                                  (InstructionDataset: tiktoken gpt2)
         -> custom_collate_fn: one 50256 appended, padded with 50256 to the batch's longest + 1,
            inputs [:-1] and targets [1:], every target pad but the first -100, cut at 1024

`BookInstructionTask` is chapter 5's `BookTask` (ch05.py) with chapter 7's batches: the same
DataLoader draws (batch 8, shuffle and drop_last on train), `train_model_simple`'s evaluations
and, after each epoch, its 50-token greedy sample of `format_input(val_data[0])`. With the book's
recipe (plain AdamW, lr 5e-5, weight decay 0.1, every weight trained) the run prints the book's
lines and ends with its weights, bit for bit. `respond` then answers each test record as the
notebook does (greedy, 256 new tokens, stopping at 50256), for instruction-data-with-response.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ...device import evaluating
from ...errors import DataError, TrainError
from ...formats.files import atomic_write
from ...engine.packing import packed_loss
from ...generate import generate
from ...tokenizer import Tokenizer
from .ch05 import BookTask, book_loss
from ..tasks.examples import read_records

PAD_ID = 50256            # custom_collate_fn's pad_token_id, also its end of text
ALLOWED_MAX_LENGTH = 1024  # the notebook's partial(custom_collate_fn, allowed_max_length=1024)
RESPONSE_TOKENS = 256     # the notebook's max_new_tokens for the test set's responses
RESPONSES_FILE = "instruction-data-with-response.json"
# The notebook's settings: drop_rate 0.0, batch 8, 2 epochs, eval_freq 5, eval_iter 5, torch.manual_seed(123),
# AdamW(lr=0.00005, weight_decay=0.1) with torch's betas, generate_and_print_sample's 50 tokens.
DEFAULTS = {"lr": 5e-5, "weight_decay": 0.1, "batch_size": 8, "eval_every": 5, "eval_batches": 5, "seed": 123,
            "beta1": 0.9, "beta2": 0.999, "sample_tokens": 50}
EPOCHS = 2


def format_input(entry: dict[str, str]) -> str:
    """The book's format_input: the Alpaca preamble, the instruction, and the input if there is one."""
    text = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
            f"request.\n\n### Instruction:\n{entry['instruction']}")
    return text + (f"\n\n### Input:\n{entry['input']}" if entry.get("input") else "")


def read_instruction_data(path: str | Path) -> list[dict[str, Any]]:
    """The records of instruction-data.json; one without `instruction` or `output` text is an error naming it."""
    records = read_records(path)
    for i, rec in enumerate(records.values):
        missing = [k for k in ("instruction", "output") if not isinstance(rec, dict) or not isinstance(rec.get(k), str)]
        if missing:
            raise DataError(f"{records.where(i)} has no {missing[0]!r} text: every record needs 'instruction' and "
                            "'output' (and 'input', which may be empty), as the book's format_input reads them")
    return records.values


def split(data: list[Any]) -> dict[str, list[Any]]:
    """The notebook's split: {"train": the first 85%, "test": the next 10%, "val": the rest}."""
    n_train, n_test = int(len(data) * 0.85), int(len(data) * 0.1)
    return {"train": data[:n_train], "test": data[n_train:n_train + n_test], "val": data[n_train + n_test:]}


def encode(tokenizer: Tokenizer, entry: dict[str, str]) -> list[int]:
    """InstructionDataset's ids of one record: prompt and response encoded as one text."""
    return tokenizer.encode(format_input(entry) + f"\n\n### Response:\n{entry['output']}")


def collate(batch: list[list[int]], pad_id: int = PAD_ID, ignore_index: int = -100,
            allowed_max_length: int | None = ALLOWED_MAX_LENGTH) -> dict[str, torch.Tensor]:
    """custom_collate_fn: {"input_ids", "targets"} [b, t] int64 (see the module docstring)."""
    longest = max(len(item) + 1 for item in batch)
    inputs, targets = [], []
    for item in batch:
        padded = item + [pad_id] * (longest - len(item))  # the record, its one end of text, the padding
        x, y = torch.tensor(padded[:-1]), torch.tensor(padded[1:])
        pads = torch.nonzero(y == pad_id).squeeze()
        if pads.numel() > 1:
            y[pads[1:]] = ignore_index
        inputs.append(x[:allowed_max_length])
        targets.append(y[:allowed_max_length])
    return {"input_ids": torch.stack(inputs), "targets": torch.stack(targets)}


class BookInstructionTask(BookTask):
    """Chapter 7's loaders, evaluation and samples for `fit` (see the module docstring).

    Its rows are record numbers ([n, 1]), so chapter 5's loaders draw and cut them as they do windows."""

    def __init__(self, encoded: dict[str, list[list[int]]], start_context: str, batch_size: int, eval_batches: int,
                 tokenizer: Tokenizer, sample_tokens: int = 50, exact: bool = True,
                 test_records: list[dict[str, Any]] = ()):
        self.test_records = list(test_records)  # answered after training, into RESPONSES_FILE
        self.examples = encoded["train"] + encoded["val"]
        n_train = len(encoded["train"])
        numbers = lambda start, n: torch.arange(start, start + n).view(-1, 1)
        super().__init__(numbers(0, n_train), numbers(n_train, len(encoded["val"])), batch_size, eval_batches,
                         tokenizer, sample_tokens, exact, start_context)

    def _batch(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        return collate([self.examples[i] for i in rows[:, 0].tolist()])

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """calc_loss_batch; off the exact run, over the positions the loss reads only (engine/packing.py)."""
        packed = None if self.exact else packed_loss(model, batch["input_ids"], batch["targets"])
        return book_loss(model, batch) if packed is None else packed


def respond(model: nn.Module, tokenizer: Tokenizer, entry: dict[str, str], max_new_tokens: int = RESPONSE_TOKENS,
            exact: bool = True) -> str:
    """The notebook's model_response: greedy after format_input(entry), stopping at 50256, the prompt
    and "### Response:" taken off, stripped."""
    prompt = format_input(entry)
    ids = tokenizer.encode(prompt)
    out = generate(model, ids, max_new_tokens, eos_id=PAD_ID, use_cache=not exact)[0].tolist()
    if out and out[-1] == PAD_ID and len(out) > len(ids):  # the book's generate stops before the eos token
        out = out[:-1]
    return tokenizer.decode(out)[len(prompt):].replace("### Response:", "").strip()


def write_responses(model: nn.Module, tokenizer: Tokenizer, test: list[dict[str, Any]], path: str | Path,
                    exact: bool = True, progress: Callable[[str, int, int], None] | None = None) -> Path:
    """The test records with their "model_response", as the notebook's json.dump(test_data, file, indent=4).

    progress(step, done, total) after each record, as the notebook's tqdm over the test set."""
    answered = []
    with evaluating(model):  # no dropout; and in eval mode the engine may decode with glassgpt's kernels
        for k, entry in enumerate(test, 1):
            answered.append({**entry, "model_response": respond(model, tokenizer, entry, exact=exact)})
            if progress is not None:
                progress(f"record {k}", k, len(test))
    path, text = Path(path), json.dumps(answered, indent=4)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text), TrainError)  # never through a link
    return path


def prepare(model: nn.Module, tokenizer: Tokenizer, data: str | Path, seed: int = 123, batch_size: int = 8,
            eval_batches: int = 5, sample_tokens: int = 50, exact: bool = True, new: bool = True
            ) -> tuple[nn.Module, BookInstructionTask]:
    """The notebook's chapter 7 up to `train_model_simple`: the split, the datasets, every weight
    trained, and `torch.manual_seed(seed)` as the notebook seeds before its optimizer and loop.
    The task keeps the test records. `new=False`: a resumed run (its generator comes from
    the checkpoint)."""
    parts = split(read_instruction_data(data))
    if len(parts["train"]) < batch_size or not parts["val"]:
        raise DataError(f"{data} has {sum(map(len, parts.values()))} records: the book's split keeps 85% for "
                        f"training, which needs one batch of {batch_size}, and leaves 5% for validation, which "
                        "needs one record: give more records or a smaller --batch-size")
    encoded = {part: [encode(tokenizer, entry) for entry in parts[part]] for part in ("train", "val")}
    context = model.cfg.context_length  # (at 1,024 or more, custom_collate_fn cuts a longer record, as the book's)
    for part, rows in encoded.items():
        for k, ids in enumerate(rows):
            if context < ALLOWED_MAX_LENGTH and len(ids) > context:
                number = k if part == "train" else len(parts["train"]) + len(parts["test"]) + k
                raise DataError(f"{data} record {number + 1} of {sum(map(len, parts.values()))} is {len(ids):,} tokens, longer than the model's "
                                f"context_length {model.cfg.context_length:,}: shorten it or remove it")
    model.requires_grad_(True)
    if new:
        torch.manual_seed(seed)
    task = BookInstructionTask(encoded, format_input(parts["val"][0]), batch_size, eval_batches, tokenizer,
                               sample_tokens, exact, parts["test"])
    return model, task

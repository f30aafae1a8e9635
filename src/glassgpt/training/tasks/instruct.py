"""Instruction finetuning, the book's chapter 7: Alpaca records, the loss on the response only.

Records (`instruction`, optional `input`, `output`) are formatted with the Alpaca template,
each ends with one `<|endoftext|>`, batches are padded to their longest, and the targets of
the prompt and of the padding are -100 (cross-entropy's ignore_index), so the loss counts
exactly the response tokens and that one eot.

Leaves out: chat templates other than Alpaca.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from ...device import evaluating
from ...engine.loss import IGNORE_INDEX, cross_entropy
from ...engine.packing import packed_loss
from ...errors import DataError, GlassError
from ...generate import generate
from ...model import GPTModel
from ...prompt import ALPACA_PREAMBLE, format_prompt  # noqa: F401  (the Alpaca template lives with the prompts)
from ...tokenizer import Tokenizer
from .examples import ExampleStream, holdout, read_records, set_trainable


def check_instruction_record(rec: Any) -> str | None:
    """Why a record is not a usable Alpaca record, or None if it is."""
    if not isinstance(rec, dict):
        return f"a {type(rec).__name__}, not an object"
    for field in ("instruction", "output"):
        if field not in rec:
            return f"missing {field!r}"
        if not isinstance(rec[field], str) or not rec[field].strip():
            return f"{field!r} is empty or not text"
    if rec.get("input") is not None and not isinstance(rec["input"], str):
        return "'input' is not text"
    return None


def load_instruction_records(path: str | Path, on_bad: str = "skip"
                             ) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
    """(usable records, [(index, reason)] of malformed ones); on_bad="error" raises on the first.

    Each usable record is {"index", "instruction", "input" ("" when absent), "output"}.
    """
    if on_bad not in ("skip", "error"):
        raise GlassError(f"on_bad must be 'skip' or 'error', got {on_bad!r}")
    records = read_records(path)
    bad = dict(records.problems)
    for i, rec in enumerate(records.values):
        if i not in bad and (reason := check_instruction_record(rec)) is not None:
            bad[i] = reason
    problems = sorted(bad.items())
    if problems and on_bad == "error":
        i, reason = problems[0]
        raise DataError(f"{records.where(i)} is malformed ({reason}); {len(problems)} bad record(s) in all: "
                        "fix them or pass --on-bad-record skip")
    good = [{"index": i, "instruction": r["instruction"], "input": r.get("input") or "", "output": r["output"]}
            for i, r in enumerate(records.values) if i not in bad]
    if not good:
        raise DataError(f"{path} has no usable record (need 'instruction' and 'output' text in each)")
    return good, problems


def encode_instruction(tokenizer: Tokenizer, rec: dict[str, str], max_length: int) -> tuple[list[int], int]:
    """(prompt + response + eot ids, prompt length), cut so the model input fits max_length.

    The prompt and the response are encoded separately so the boundary between them is
    exact. The model reads ids[:-1] and predicts ids[1:], hence max_length + 1 ids.
    """
    if tokenizer.eot_id is None:
        raise DataError("instruction finetuning ends each response with <|endoftext|>, which this "
                        "tokenizer does not have: use a model with the gpt2 tokenizer or a learned BPE")
    prompt = tokenizer.encode(format_prompt(rec["instruction"], rec.get("input", "")))
    if len(prompt) >= max_length:
        raise DataError(f"the prompt is {len(prompt):,} tokens, but the model takes {max_length:,}: "
                        "shorten the instruction or raise --max-length")
    ids = prompt + tokenizer.encode(rec["output"]) + [tokenizer.eot_id]
    return ids[:max_length + 1], len(prompt)


def encode_instructions(tokenizer: Tokenizer, records: Sequence[dict[str, Any]], max_length: int,
                        on_bad: str = "skip") -> tuple[list[tuple[list[int], int]], list[tuple[int, str]]]:
    """Encode records (see `encode_instruction`); a prompt too long to fit is a bad record too."""
    examples, problems = [], []
    for k, rec in enumerate(records):
        try:
            examples.append(encode_instruction(tokenizer, rec, max_length))
        except DataError as e:
            if tokenizer.eot_id is None:
                raise
            index = rec.get("index", k)
            if on_bad == "error":
                raise DataError(f"record {index + 1}: {e}; or pass --on-bad-record skip") from None
            problems.append((index, str(e).split(":")[0]))
    return examples, problems


def collate_instructions(examples: Sequence[tuple[Sequence[int], int]], pad_id: int,
                         ignore_index: int = IGNORE_INDEX) -> dict[str, torch.Tensor]:
    """Pad (ids, prompt_len) examples to the batch's longest: {"input_ids", "targets"} [b, t] int64.

    Position j predicts ids[j + 1]. Targets are kept only where ids[j + 1] is a response
    token or the closing eot (j >= prompt_len - 1); prompt and padding get ignore_index.
    """
    t = max(len(ids) for ids, _ in examples) - 1
    inputs = torch.full((len(examples), t), pad_id, dtype=torch.long)
    targets = torch.full((len(examples), t), ignore_index, dtype=torch.long)
    for row, (ids, prompt_len) in enumerate(examples):
        ids = torch.as_tensor(ids, dtype=torch.long)
        n = len(ids) - 1
        inputs[row, :n] = ids[:-1]
        targets[row, prompt_len - 1:n] = ids[prompt_len:]
    return {"input_ids": inputs, "targets": targets}


class InstructionTask(ExampleStream):
    """Next-token cross-entropy on the response tokens only."""

    def __init__(self, train: list[tuple[list[int], int]], val: list[tuple[list[int], int]],
                 pad_id: int, batch_size: int = 8, grad_accum: int = 1, seed: int = 0,
                 eval_batches: int | None = None, tokenizer: Tokenizer | None = None,
                 sample_records: Sequence[dict[str, str]] = (), sample_tokens: int = 64):
        super().__init__(batch_size, grad_accum, seed, eval_batches)
        self.train, self.val, self.pad_id = train, val, pad_id
        self.n_train, self.n_val = len(train), len(val)
        self.tokenizer, self.sample_records, self.sample_tokens = tokenizer, list(sample_records), sample_tokens
        self.sample_prompt_ids = None  # the snapshots' prompt: the first sample record's Alpaca prompt
        if tokenizer is not None and self.sample_records:
            rec = self.sample_records[0]
            self.sample_prompt_ids = tokenizer.encode(format_prompt(rec["instruction"], rec.get("input", "")))

    def train_batch(self, step: int, micro: int, rank: int, world: int) -> dict[str, torch.Tensor]:
        idx = self._train_indices(step, micro, rank, world)
        return collate_instructions([self.train[i] for i in idx], self.pad_id)

    def eval_batches(self) -> Iterable[dict[str, torch.Tensor]]:
        for idx in self._val_chunks(self.n_eval_batches):
            yield collate_instructions([self.val[i] for i in idx], self.pad_id)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        packed = packed_loss(model, batch["input_ids"], batch["targets"])  # the positions the loss reads only
        if packed is not None:
            return packed
        logits = model(batch["input_ids"])  # [b, t, V]
        targets = batch["targets"].to(logits.device)
        return cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)

    def tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["targets"] != IGNORE_INDEX).sum())

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {}

    def sample(self, model: nn.Module) -> str | None:
        if self.tokenizer is None or not self.sample_records or not self.sample_tokens:
            return None
        rec = self.sample_records[0]
        with evaluating(model):
            answer = respond(model, self.tokenizer, rec["instruction"], rec.get("input", ""),
                             max_new_tokens=self.sample_tokens)
        return f"{rec['instruction']!r} -> {answer!r}"


def respond(model: GPTModel, tokenizer: Tokenizer, instruction: str, input: str = "",
            max_new_tokens: int = 256, temperature: float = 0.0, top_k: int | None = None,
            top_p: float | None = None, seed: int | None = None) -> str:
    """The model's answer to an instruction: generation after the Alpaca prompt, up to eot."""
    prompt = tokenizer.encode(format_prompt(instruction, input))
    out = generate(model, prompt, max_new_tokens, temperature, top_k, top_p,
                   eos_id=tokenizer.eot_id, seed=seed)[0, len(prompt):].tolist()
    if tokenizer.eot_id in out:
        out = out[:out.index(tokenizer.eot_id)]
    return tokenizer.decode(out).strip()


def prepare_instructions(model: GPTModel, tokenizer: Tokenizer, settings: dict[str, Any], max_length: int, seed: int):
    """glassgpt's instruction run: (model, {"train", "val"} examples, cfg -> InstructionTask, the lines
    that say what the data holds and which records were skipped). `settings`: data, val, val_fraction,
    on_bad_record, trainable or lora_rank/lora_alpha."""
    if model.cfg.num_classes is not None:
        raise DataError(f"{settings['model']} is a classifier: instruction finetuning needs a language model")
    on_bad = settings["on_bad_record"]
    records, problems = load_instruction_records(settings["data"], on_bad)
    lines = []
    if settings["val"]:
        val_records, val_problems = load_instruction_records(settings["val"], on_bad)
        lines += skipped_line(settings["val"], val_problems)
    else:
        train_idx, val_idx = holdout(len(records), settings["val_fraction"], seed)
        records, val_records = [records[i] for i in train_idx], [records[i] for i in val_idx]
    train, long_train = encode_instructions(tokenizer, records, max_length, on_bad)
    val, long_val = encode_instructions(tokenizer, val_records, max_length, on_bad)
    lines += skipped_line(settings["data"], sorted(problems + long_train + (long_val if not settings["val"] else [])))
    if settings["val"]:
        lines += skipped_line(settings["val"], long_val)
    if not train or not val:
        raise DataError("no training or no validation record is left after skipping bad ones: fix the data")
    set_trainable(model, settings, seed)
    response_tokens = sum(len(ids) - p for ids, p in train)
    cut = sum(ids[-1] != tokenizer.eot_id for ids, _ in train + val)
    lines.append(f"data: {len(train):,} train, {len(val):,} val records; {response_tokens:,} response tokens "
                 f"to learn; max_length {max_length:,}" + (f" ({cut:,} responses cut to fit)" if cut else ""))

    def make_task(cfg) -> InstructionTask:
        return InstructionTask(train, val, tokenizer.eot_id, cfg.batch_size, cfg.grad_accum, cfg.seed,
                                  cfg.eval_batches, tokenizer, val_records[:1], cfg.sample_tokens)
    return model, {"train": train, "val": val}, make_task, lines


def skipped_line(path, problems: list[tuple[int, str]]) -> list[str]:
    """The line that lists the malformed records skipped in `path` (none: no line); records count from 1."""
    if not problems:
        return []
    shown = "; ".join(f"record {i + 1} ({why})" for i, why in problems[:5])
    more = f"; and {len(problems) - 5:,} more" if len(problems) > 5 else ""
    return [f"skipped {len(problems):,} malformed record(s) of {path}: {shown}{more}"]

"""Finetuning: a classifier head (book ch. 6), instruction following (ch. 7), LoRA (appendix E).

Classification swaps the emb_dim -> vocab_size `out_head` for emb_dim -> num_classes
(`to_classifier`) and trains on the *last real token's* output: texts are right-padded
with `<|endoftext|>` and the logits are gathered at index length - 1 of each row.
Causal attention means a token never sees the padding that follows it, so padding
cannot change a prediction. `freeze` keeps the last block(s), `final_norm` and the
head trainable, as the book does.

Instruction finetuning formats Alpaca records (`instruction`, optional `input`,
`output`) with the Alpaca template, ends each with one `<|endoftext|>`, pads per
batch, and sets the targets of the prompt and the padding to -100 (cross-entropy's
ignore_index), so the loss counts exactly the response tokens and that one eot.

LoRA (appendix E) lives in lora.py; either task trains a LoRA-wrapped model as is.
Both tasks' `checkpoint_model` returns `lora.merged_model(model)`, so `latest/` and
`best/` load with `load_model` like any checkpoint, while train.fit keeps the frozen
base and the adapters beside them for `--resume`, which rebuilds the LoRA model (same
rank and alpha) and continues on exactly the base it started from.

Leaves out: multi-label classification, chat templates other than Alpaca.
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
from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import DataError, GlassError
# The LoRA names stay importable from here (glassgpt.finetune.apply_lora, ...), as before lora.py.
from .lora import (LORA_TARGETS, LoRALinear, apply_lora, count_parameters, has_lora,  # noqa: F401
                   lora_state_dict, merge_lora, merged_model)
from ..engine.loss import IGNORE_INDEX, cross_entropy
from ..formats.glassgpt import model_from_state
from ..model import GPTModel
from ..tokenizer import Tokenizer


ALPACA_PREAMBLE = ("Below is an instruction that describes a task. "
                   "Write a response that appropriately completes the request.")


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
        """'data.csv:7 (record 5)': what an error message names."""
        line = self.lines[i]
        return f"{self.path}:{line} (record {i})" if line is not None else f"{self.path} record {i}"


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


# --- classification: data ------------------------------------------------------------

@dataclass
class ClassificationData:
    texts: list[str]
    labels: list[int]        # indices into label_names
    label_names: list[str]


def load_classification_data(path: str | Path, text_column: str = "text", label_column: str = "label",
                             label_names: Sequence[str] | None = None) -> ClassificationData:
    """Texts and labels from a data file (see DATA_FORMATS).

    Without `label_names` the labels are the distinct values found, sorted (numbers
    numerically); with them (a validation file), a label outside them is an error.
    A record without a usable text or label is an error naming its file and line.
    """
    records = read_records(path)
    if records.problems:
        i, reason = records.problems[0]
        raise DataError(f"{records.where(i)} is {reason}: fix the line or remove it")
    texts, raw_labels = [], []
    for i, rec in enumerate(records.values):
        where = records.where(i)
        if not isinstance(rec, dict):
            raise DataError(f"{where} is a {type(rec).__name__}, not an object with "
                            f"{text_column!r} and {label_column!r} fields")
        for column in (text_column, label_column):
            if column not in rec:
                raise DataError(f"{path}: {'column' if i == 0 else f'{where} has no field'} {column!r}"
                                f"{' is missing' if i == 0 else ''}; available: {sorted(map(str, rec))} "
                                f"(choose with --{'text' if column == text_column else 'label'}-column)")
        text = rec[text_column]
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{where} has an empty or non-text {text_column!r} ({text!r})")
        texts.append(text)
        raw_labels.append(_label_name(rec[label_column], where, label_column))
    if label_names is None:
        label_names = _sorted_labels(set(raw_labels))
        if len(label_names) < 2:
            raise DataError(f"{path}: every record has the label {label_names[0]!r}: a classifier needs "
                            "at least two classes")
    label_names = list(label_names)
    index = {name: k for k, name in enumerate(label_names)}
    for i, label in enumerate(raw_labels):
        if label not in index:
            raise DataError(f"{records.where(i)} has the label {label!r}, which the training data does not "
                            f"have (labels: {label_names})")
    return ClassificationData(texts, [index[label] for label in raw_labels], label_names)


MISSING_LABELS = {"", "nan", "null", "none", "n/a", "na"}  # how spreadsheets and pandas write "no value"


def _label_name(label: Any, where: str, column: str) -> str:
    """A label as a class name; a missing value (None, NaN, "nan", "") is an error, not a new class."""
    if isinstance(label, float) and label.is_integer():
        label = int(label)
    bad = (label is None or isinstance(label, (dict, list))
           or (isinstance(label, float) and not math.isfinite(label))
           or (isinstance(label, str) and label.strip().lower() in MISSING_LABELS))
    if bad:
        raise DataError(f"{where} has no usable label in {column!r} ({label!r}): give every record a label, "
                        "or remove the record")
    return str(label).strip()


def _sorted_labels(labels: set[str]) -> list[str]:
    if all(re.fullmatch(r"-?\d+", s) for s in labels):
        return sorted(labels, key=int)
    return sorted(labels)


def holdout(n: int, fraction: float, seed: int = 0, min_train: int = 1) -> tuple[list[int], list[int]]:
    """(train, val) record indices, in file order: a seeded random `fraction` (at least one) held out."""
    n_val = max(1, round(n * fraction))
    if n - n_val < min_train:
        raise DataError(f"{n} usable record(s) are too few to hold out {fraction:.0%} for validation: "
                        "add records or pass --val FILE")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[n_val:]), sorted(order[:n_val])


def split_validation(data: ClassificationData, fraction: float, seed: int = 0
                     ) -> tuple[ClassificationData, ClassificationData]:
    """(train, val) ClassificationData: see `holdout`."""
    pick = lambda idx: ClassificationData([data.texts[i] for i in idx], [data.labels[i] for i in idx],
                                          data.label_names)
    train_idx, val_idx = holdout(len(data.texts), fraction, seed, min_train=2)
    train, val = pick(train_idx), pick(val_idx)
    if len(set(train.labels)) < 2:
        raise DataError("after holding out validation records the training data has a single class: "
                        "add records or pass --val FILE")
    return train, val


def encode_texts(tokenizer: Tokenizer, texts: Sequence[str], max_length: int) -> list[list[int]]:
    """Token ids of each text, cut to its first `max_length` tokens (as the book does)."""
    out = []
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text)
        if not ids:
            raise DataError(f"text {i} ({text[:40]!r}) encodes to no tokens")
        out.append(ids[:max_length])
    return out


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


# --- classification: model -----------------------------------------------------------

def to_classifier(model: GPTModel, num_classes: int, seed: int = 0) -> GPTModel:
    """The same model with `out_head` replaced by a new nn.Linear(emb_dim, num_classes).

    The config becomes `replace(cfg, num_classes=C, tie_embeddings=False)`, so the
    result saves and reloads through `save_model`/`load_model` with no special case.
    The new head is N(0, 0.02) with a zero bias (GPT-2's init), seeded. A model that
    already has a head of that size is returned unchanged.
    """
    if model.cfg.num_classes == num_classes:
        return model
    cfg = dataclasses.replace(model.cfg, num_classes=num_classes, tie_embeddings=False)
    weight = model.tok_emb.weight
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("out_head.")}
    gen = torch.Generator(device=weight.device).manual_seed(seed)
    head_w = torch.empty(num_classes, cfg.emb_dim, device=weight.device, dtype=weight.dtype)
    state["out_head.weight"] = nn.init.normal_(head_w, 0.0, 0.02, generator=gen)
    state["out_head.bias"] = torch.zeros(num_classes, device=weight.device, dtype=weight.dtype)
    return model_from_state(cfg, state, "the classifier").train(model.training)


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


def last_token_logits(model: nn.Module, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Class logits at each row's last real token: ids [b, t], lengths [b] -> [b, C]."""
    logits = model(ids)                                        # [b, t, C]
    index = (lengths - 1).to(logits.device).view(-1, 1, 1).expand(-1, 1, logits.shape[-1])
    return logits.gather(1, index).squeeze(1)                  # [b, t, C] -> [b, C]


@torch.inference_mode()
def predict(model: GPTModel, tokenizer: Tokenizer, texts: Sequence[str], max_length: int | None = None,
            batch_size: int = 32) -> torch.Tensor:
    """Class probabilities [n, C] (float32) for each text."""
    max_length = min(max_length or model.cfg.context_length, model.cfg.context_length)
    seqs = encode_texts(tokenizer, texts, max_length)
    device = model.tok_emb.weight.device
    out = []
    for start in range(0, len(seqs), batch_size):
        ids, lengths = pad_batch(seqs[start:start + batch_size], pad_id_of(tokenizer))
        out.append(last_token_logits(model, ids.to(device), lengths).float().softmax(-1).cpu())
    return torch.cat(out)


def confusion_matrix(predicted: Sequence[int], actual: Sequence[int], num_classes: int) -> list[list[int]]:
    """matrix[actual][predicted] counts: the diagonal is what the classifier got right."""
    matrix = [[0] * num_classes for _ in range(num_classes)]
    for p, a in zip(predicted, actual):
        matrix[a][p] += 1
    return matrix


# --- batches that depend only on (step, micro, rank, world) ---------------------------

@functools.lru_cache(maxsize=8)
def _permutation(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
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


class _Stream:
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


# --- classification: the task for train.fit -------------------------------------------

class ClassificationTask(_Stream):
    """Cross-entropy on the last real token's class logits; accuracy on the validation set.

    Batches: {"input_ids" [b, t], "lengths" [b], "labels" [b]}, all int64 on the CPU.
    """

    perplexity = False  # a loss over classes, not tokens: train.fit reports no val_ppl

    def __init__(self, train_ids: list[list[int]], train_labels: list[int], val_ids: list[list[int]],
                 val_labels: list[int], label_names: Sequence[str], pad_id: int, batch_size: int = 8,
                 grad_accum: int = 1, seed: int = 0, eval_batches: int | None = None):
        super().__init__(batch_size, grad_accum, seed, eval_batches)
        self.train_ids, self.train_labels = train_ids, train_labels
        self.val_ids, self.val_labels = val_ids, val_labels
        self.label_names, self.pad_id = list(label_names), pad_id
        self.n_train, self.n_val = len(train_ids), len(val_ids)
        self.last_confusion: list[list[int]] | None = None

    def _batch(self, seqs: list[list[int]], labels: list[int], idx: list[int]) -> dict[str, torch.Tensor]:
        ids, lengths = pad_batch([seqs[i] for i in idx], self.pad_id)
        return {"input_ids": ids, "lengths": lengths, "labels": torch.tensor([labels[i] for i in idx])}

    def train_batch(self, step: int, micro: int, rank: int, world: int) -> dict[str, torch.Tensor]:
        return self._batch(self.train_ids, self.train_labels, self._train_indices(step, micro, rank, world))

    def eval_batches(self, everything: bool = False) -> Iterable[dict[str, torch.Tensor]]:
        """Validation batches in file order: the first `eval_batches` of them, or all."""
        for idx in self._val_chunks(None if everything else self.n_eval_batches):
            yield self._batch(self.val_ids, self.val_labels, idx)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = last_token_logits(model, batch["input_ids"], batch["lengths"])
        return F.cross_entropy(logits.float(), batch["labels"].to(logits.device))

    def tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["lengths"].sum())

    @torch.no_grad()
    def predictions(self, model: nn.Module, everything: bool = False) -> list[int]:
        """Predicted class of each validation text in the evaluation batches (or all)."""
        device = next(model.parameters()).device
        out = []
        for batch in self.eval_batches(everything):
            logits = last_token_logits(model, batch["input_ids"].to(device), batch["lengths"])
            out += logits.argmax(-1).tolist()
        return out

    def evaluate(self, model: nn.Module, everything: bool = False) -> dict[str, float]:
        """{"val_accuracy": ...} over the evaluation batches, or the whole validation set."""
        was_training = model.training
        model.eval()
        predicted = self.predictions(model, everything)
        model.train(was_training)
        actual = self.val_labels[:len(predicted)]
        self.last_confusion = confusion_matrix(predicted, actual, len(self.label_names))
        right = sum(p == a for p, a in zip(predicted, actual))
        return {"val_accuracy": right / max(1, len(predicted))}

    def sample(self, model: nn.Module) -> str | None:
        return None


# --- instruction finetuning ------------------------------------------------------------

def format_prompt(instruction: str, input: str = "") -> str:
    """The Alpaca prompt, up to and including "### Response:\\n" (the book's format_input)."""
    text = f"{ALPACA_PREAMBLE}\n\n### Instruction:\n{instruction}"
    if input:
        text += f"\n\n### Input:\n{input}"
    return text + "\n\n### Response:\n"


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
                raise DataError(f"record {index}: {e}; or pass --on-bad-record skip") from None
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


class InstructionTask(_Stream):
    """Next-token cross-entropy on the response tokens only."""

    def __init__(self, train: list[tuple[list[int], int]], val: list[tuple[list[int], int]],
                 pad_id: int, batch_size: int = 8, grad_accum: int = 1, seed: int = 0,
                 eval_batches: int | None = None, tokenizer: Tokenizer | None = None,
                 sample_records: Sequence[dict[str, str]] = (), sample_tokens: int = 64):
        super().__init__(batch_size, grad_accum, seed, eval_batches)
        self.train, self.val, self.pad_id = train, val, pad_id
        self.n_train, self.n_val = len(train), len(val)
        self.tokenizer, self.sample_records, self.sample_tokens = tokenizer, list(sample_records), sample_tokens

    def train_batch(self, step: int, micro: int, rank: int, world: int) -> dict[str, torch.Tensor]:
        idx = self._train_indices(step, micro, rank, world)
        return collate_instructions([self.train[i] for i in idx], self.pad_id)

    def eval_batches(self) -> Iterable[dict[str, torch.Tensor]]:
        for idx in self._val_chunks(self.n_eval_batches):
            yield collate_instructions([self.val[i] for i in idx], self.pad_id)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(batch["input_ids"])  # [b, t, V]
        targets = batch["targets"].to(logits.device)
        return cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)

    def tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["targets"] != IGNORE_INDEX).sum())

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {}

    def sample(self, model: nn.Module) -> str | None:
        if self.tokenizer is None or not self.sample_records:
            return None
        rec = self.sample_records[0]
        was_training = model.training
        model.eval()
        answer = respond(model, self.tokenizer, rec["instruction"], rec.get("input", ""),
                         max_new_tokens=self.sample_tokens)
        model.train(was_training)
        return f"{rec['instruction']!r} -> {answer!r}"


def respond(model: GPTModel, tokenizer: Tokenizer, instruction: str, input: str = "",
            max_new_tokens: int = 256, temperature: float = 0.0, top_k: int | None = None,
            top_p: float | None = None, seed: int | None = None) -> str:
    """The model's answer to an instruction: generation after the Alpaca prompt, up to eot."""
    from ..generate import generate

    prompt = tokenizer.encode(format_prompt(instruction, input))
    out = generate(model, prompt, max_new_tokens, temperature, top_k, top_p,
                   eos_id=tokenizer.eot_id, seed=seed)[0, len(prompt):].tolist()
    if tokenizer.eot_id in out:
        out = out[:out.index(tokenizer.eot_id)]
    return tokenizer.decode(out).strip()

"""Classification finetuning, the book's chapter 6: a classifier head on the last real token.

`to_classifier` swaps the emb_dim -> vocab_size `out_head` for emb_dim -> num_classes and
training reads the *last real token's* output: texts are right-padded with `<|endoftext|>`
and the logits are gathered at index length - 1 of each row. Causal attention means a token
never sees the padding that follows it, so padding cannot change a prediction. `freeze`
(examples.py) keeps the last block(s), `final_norm` and the head trainable, as the book does.

Leaves out: multi-label classification.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ...device import evaluating
from ...errors import DataError
from ...formats.glassgpt import model_from_state
from ...model import GPTModel
from ...tokenizer import Tokenizer
from .examples import ExampleStream, holdout, pad_batch, pad_id_of, read_records, set_trainable


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


# --- classification: the task for train.fit -------------------------------------------

class ClassificationTask(ExampleStream):
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
        with evaluating(model):
            predicted = self.predictions(model, everything)
        actual = self.val_labels[:len(predicted)]
        self.last_confusion = confusion_matrix(predicted, actual, len(self.label_names))
        right = sum(p == a for p, a in zip(predicted, actual))
        return {"val_accuracy": right / max(1, len(predicted))}


# --- classification: glassgpt's run, set up -------------------------------------------

def prepare_classifier(model: GPTModel, tokenizer: Tokenizer, settings: dict[str, Any], max_length: int, seed: int):
    """glassgpt's classification run: (classifier, {"train", "val"} ids, cfg -> ClassificationTask, the
    lines that say what the data holds). `settings`: data, val, val_fraction, text_column,
    label_column, trainable or lora_rank/lora_alpha, and on a resumed run its labels."""
    cols = dict(text_column=settings["text_column"], label_column=settings["label_column"])
    if settings["val"]:
        train = load_classification_data(settings["data"], **cols)
        val = load_classification_data(settings["val"], label_names=train.label_names, **cols)
    else:
        train, val = split_validation(load_classification_data(settings["data"], **cols),
                                      settings["val_fraction"], seed)
    if settings.get("labels") and settings["labels"] != train.label_names:
        raise DataError(f"the data's labels {train.label_names} differ from the run's {settings['labels']}: "
                        "resume with the data the run was started with")
    settings["labels"] = train.label_names
    if settings.get("names") and len(settings["names"]) != len(train.label_names):
        raise DataError(f"--labels names {len(settings['names'])} classes, but the data has {len(train.label_names)}: "
                        f"{train.label_names}: give one name for each, in that order")
    train_ids = encode_texts(tokenizer, train.texts, max_length)
    val_ids = encode_texts(tokenizer, val.texts, max_length)
    model = to_classifier(model, len(train.label_names), seed)
    set_trainable(model, settings, seed)
    counts = [train.labels.count(k) for k in range(len(train.label_names))]
    longest = max(len(tokenizer.encode(t)) for t in train.texts + val.texts)
    line = (f"data: {len(train.texts):,} train, {len(val.texts):,} val texts; {len(train.label_names)} labels "
            + ", ".join(f"{name} ({n:,})" for name, n in zip(train.label_names, counts))
            + f"; longest text {longest:,} tokens, max_length {max_length:,}")

    def make_task(cfg) -> ClassificationTask:
        return ClassificationTask(train_ids, train.labels, val_ids, val.labels, train.label_names,
                                  pad_id_of(tokenizer), cfg.batch_size, cfg.grad_accum, cfg.seed,
                                  cfg.eval_batches)
    return model, {"train": train_ids, "val": val_ids}, make_task, [line]

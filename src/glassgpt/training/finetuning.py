"""A finetuning run from plain values: what it is made of, the model and task it starts from, and its report.

    settings = new_settings("classify", model="gpt2", data="train.csv")   # the run's record
    settings = resumed_settings(checkpoint, run_dir, "classify")           # a resume's, its data checked
    model, tokenizer = start_model(source)
    model, data, make_task, lines = prepare_glassgpt("classify", model, tokenizer, settings, seed)
    model, task, line = prepare_book("classify", model, tokenizer, settings, cfg, new=True)
    report = classification_report(model, task, run_dir)                    # confusion.json and .png

`glassgpt finetune` (cli/finetune.py) turns its flags into these calls and prints what they return;
from Python the same calls, then `fit`, run the same run.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..errors import GlassError
from .. import formats
from ..formats import load_meta
from ..tokenizer import check_fits
from .book import ch06 as book_ch06
from .book import ch07 as book_ch07
from .tasks.classify import ClassificationTask, prepare_classifier
from .loop.compute import exact
from .loop.config import TrainConfig
from .tasks.data import scan_file
from .tasks.instruct import prepare_instructions
from .loop.metrics import save_confusion, save_confusion_png

# Each kind's defaults (the book's): the epochs a run takes and which weights train.
DEFAULTS = {
    "classify": {"epochs": 5, "trainable": "last-block"},
    "instruct": {"epochs": 2, "trainable": "all"},
}


def new_settings(kind: str, *, model: str, data: str, val: str | None = None, test: str | None = None,
                 val_fraction: float | None = None, max_length: int | None = None, recipe: str | None = None,
                 trainable: str | None = None, lora_rank: int | None = None, lora_alpha: float | None = None,
                 text_column: str | None = None, label_column: str | None = None, labels: list[str] | None = None,
                 on_bad_record: str | None = None) -> dict[str, Any]:
    """What a new run is made of, as its checkpoints record it (meta.json's "finetune"): the model, the
    files as absolute paths with their sha256 (a resume refuses data that changed), columns, LoRA."""
    if lora_rank is None and lora_alpha is not None:
        raise GlassError("--lora-alpha needs --lora-rank R")
    if lora_rank is not None and trainable is not None:
        raise GlassError("with --lora-rank only the adapters (and a classifier head) train: drop --trainable")
    for path in (data, val, test):
        if path is not None and not Path(path).is_file():
            raise GlassError(f"{path}: no such file")
    absolute = lambda p: str(Path(p).resolve()) if p else None  # noqa: E731
    settings = {"kind": kind, "model": absolute(model) if Path(model).exists() else model,
                "data": absolute(data), "val": absolute(val),
                "data_sha256": scan_file(Path(data)), "val_sha256": scan_file(Path(val)) if val else None,
                "val_fraction": 0.1 if val_fraction is None else val_fraction,
                "max_length": max_length, "recipe": recipe or "glassgpt",
                "test": absolute(test), "test_sha256": scan_file(Path(test)) if test else None,
                "trainable": None if lora_rank else (trainable or DEFAULTS[kind]["trainable"]),
                "lora_rank": lora_rank, "lora_alpha": (lora_alpha or float(lora_rank)) if lora_rank else None}
    if kind == "classify":
        settings.update(text_column=text_column or "text", label_column=label_column or "label", names=labels)
    else:
        settings["on_bad_record"] = on_bad_record or "skip"
    return settings


def resumed_settings(checkpoint: str | Path, run_dir: str | Path, kind: str) -> dict[str, Any]:
    """The settings run_dir's checkpoint recorded, with its data files checked unchanged since it started."""
    settings = load_meta(checkpoint).get("finetune")
    if not settings or settings.get("kind") != kind:
        made = f"glassgpt finetune {settings['kind']}" if settings else "glassgpt train"
        raise GlassError(f"{run_dir} was made by {made}, not glassgpt finetune {kind}: resume it with that")
    for name in ("data", "val", "test"):
        recorded = settings.get(f"{name}_sha256")
        if recorded and scan_file(Path(settings[name])) != recorded:
            raise GlassError(f"{settings[name]} changed since the run started (its sha256 differs from the run's "
                             "record), so --resume could not continue it exactly: restore it, or start a new "
                             f"finetuning run from this one's weights with --model {run_dir}")
    return settings


def start_model(source: str | Path | formats.Source):
    """(model, tokenizer) a run starts from (a spec, or a Source opened with its model flags), in float32 on
    the CPU; a tokenizer that does not fit is refused."""
    source = formats.open(source)
    model, tokenizer = source.load("cpu", "float32"), source.tokenizer()
    check_fits(tokenizer, model.cfg.vocab_size, "the checkpoint's tokenizer.json does not belong to it")
    return model, tokenizer


def prepare_glassgpt(kind: str, model, tokenizer, settings: dict[str, Any], seed: int):
    """glassgpt's recipe: (model, data, make_task(cfg), lines to show), texts cut at the run's max_length."""
    max_length = min(settings["max_length"] or model.cfg.context_length, model.cfg.context_length)
    prepare = prepare_classifier if kind == "classify" else prepare_instructions
    return prepare(model, tokenizer, settings, max_length, seed)


def prepare_book(kind: str, model, tokenizer, settings: dict[str, Any], cfg: TrainConfig, new: bool,
                 responses: int | None = None):
    """The book's chapter 6 or 7 (book/ch06.py, book/ch07.py): (model, task, the line on its data).
    Chapter 6 records its padded length and class names in `settings`; `responses`: chapter 7 answers
    only the first N test records."""
    if kind == "classify":
        adapt = book_ch06.book_lora(settings["lora_rank"], settings["lora_alpha"]) if settings["lora_rank"] else None
        model, task = book_ch06.prepare(model, tokenizer, settings["data"], settings["val"], settings["test"],
                                        settings["max_length"], cfg.seed, cfg.batch_size, cfg.eval_batches, new, adapt)
        settings.update(padded_length=task.max_length, labels=book_ch06.LABELS)
        task.reuse_frozen = not exact(cfg)  # the fast path computes the frozen blocks once per text
        sets = f"{len(task.train):,} train, {len(task.val):,} val" + (
            f", {len(task.test):,} test" if task.test is not None else "")
        return model, task, (f"data: {sets} texts padded with 50256 to {task.max_length:,} tokens (the longest "
                             f"training text, or --max-length), as SpamDataset pads them; the classifier reads "
                             f"{book_ch06.POSITION}")
    model, task = book_ch07.prepare(model, tokenizer, settings["data"], cfg.seed, cfg.batch_size,
                                    cfg.eval_batches, cfg.sample_tokens, exact(cfg), new)
    line = (f"data: {len(task.train):,} train, {len(task.test_records):,} test, {len(task.val):,} val records (the "
            "book's 85/10/5 split), formatted by format_input and padded by custom_collate_fn")
    if responses is not None and responses < len(task.test_records):
        task.test_records = task.test_records[:responses]
        line += f"; responses to the first {responses:,} test records only"
    return model, task, line


def book_steps(epochs: float, steps_per_epoch: int, max_steps: int | None = None) -> int:
    """A book recipe's steps: --max-steps, else its epochs over the task's batches."""
    return max_steps or max(1, math.ceil(epochs * steps_per_epoch))


def classification_report(model, task: ClassificationTask, run_dir: Path) -> dict[str, Any]:
    """The validation set scored on `model`: its accuracy and confusion matrix, saved as run_dir's
    confusion.json (and confusion.png where matplotlib is); returns the record, with the files written."""
    metrics = task.evaluate(model, everything=True)
    record = {"labels": task.label_names, "matrix": task.last_confusion, "accuracy": metrics["val_accuracy"],
              "n": task.n_val, "rows": "actual", "columns": "predicted"}
    save_confusion(record, run_dir / "confusion.json")
    png = save_confusion_png(record["matrix"], record["labels"], run_dir / "confusion.png")  # (None: no matplotlib)
    return {**record, "files": [run_dir / "confusion.json"] + ([png] if png else [])}

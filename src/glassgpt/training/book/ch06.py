"""The book's chapter 6, as its code runs it: `glassgpt finetune classify --recipe book`.

    train.csv (Label, Text) -> encode each Text      (SpamDataset: tiktoken gpt2)
         -> cut at max_length, or pad to the longest training text with 50256, and the
            validation and test texts to that same length
         -> the last position's logits, padding included  (model(input_batch)[:, -1, :])

`BookClassifierTask` is chapter 5's `BookTask` (ch05.py) with chapter 6's batches: the same
DataLoader draws from torch's global generator (batch 8, shuffle and drop_last on train), the
loss of `calc_loss_batch` on the last position, `evaluate_model`'s two losses every
`eval_freq` steps, and after each epoch `calc_accuracy_loader`'s line on `eval_iter` batches,
as `train_classifier_simple` prints it. `new_head` is the notebook's `torch.manual_seed(123);
model.out_head = torch.nn.Linear(emb_dim, num_classes)`. With the book's recipe (plain AdamW,
lr 5e-5, weight decay 0.1 on every parameter that trains) the run prints the book's lines and
ends with its weights, bit for bit, on the same machine and thread count. On the fast path (`--dtype
bfloat16`), where the embeddings and the first blocks are frozen and nothing random runs in them, their
output for each text is computed once and kept (`BookClassifierTask.logits`): the same function of the
same weights, without computing its frozen part again at every step, evaluation and epoch.

Appendix E (`--lora-rank R --lora-alpha A`) is the same notebook with `book_lora` in place of the
freezing: after the head and the accuracy cell of the untrained classifier (whose loaders draw from
torch's generator), every weight frozen, then `replace_linear_with_lora` on every nn.Linear, the
head included (lora.py), its A matrices drawn where the notebook draws them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import DataError
from ...formats.glassgpt import model_from_state
from ...model import GPTModel
from ...tokenizer import Tokenizer
from .ch05 import BookTask, loader_seed, shuffled
from ..tasks.examples import freeze, read_records
from ..tasks.lora import merged_model, replace_linear_with_lora

LABELS = ["not spam", "spam"]  # what classify_review prints for class 0 and class 1
POSITION = "the last position, padding included, as the book's classify_review reads it"
# The notebook's settings: BASE_CONFIG's drop_rate 0.0, batch 8, 5 epochs, eval_freq 50, eval_iter 5,
# torch.manual_seed(123), AdamW(lr=5e-5, weight_decay=0.1) with torch's betas.
DEFAULTS = {"lr": 5e-5, "weight_decay": 0.1, "batch_size": 8, "eval_every": 50, "eval_batches": 5, "seed": 123,
            "beta1": 0.9, "beta2": 0.999, "sample_tokens": 0}
EPOCHS = 5


@dataclass
class BookCSV:
    """A CSV in the book's layout: a Text and a Label column, the label a class index."""

    path: Path
    texts: list[str]
    labels: list[int]


def read_book_csv(path: str | Path, num_classes: int = 2) -> BookCSV:
    """The book's train.csv / validation.csv / test.csv; a label outside 0..num_classes-1 or an
    empty Text is an error naming the file and the line (as the file counts its lines)."""
    records = read_records(path)
    texts, labels = [], []
    for i, rec in enumerate(records.values):
        line = f"{records.path}:{records.lines[i]}"
        if not isinstance(rec, dict) or "Text" not in rec or "Label" not in rec:
            raise DataError(f"{records.path} needs the book's columns Label and Text (as SpamDataset reads them)")
        label, text = str(rec["Label"]).strip(), rec["Text"]
        if label not in {str(k) for k in range(num_classes)}:
            raise DataError(f"{line}: the Label is {rec['Label']!r}, but the book's classes are 0 (not spam) and 1 "
                            "(spam): fix the line or remove it")
        if not text.strip():
            raise DataError(f"{line}: the Text is empty: fix the line or remove it")
        texts.append(text)
        labels.append(int(label))
    return BookCSV(records.path, texts, labels)


def pad_texts(tokenizer: Tokenizer, texts: list[str], max_length: int | None, pad_id: int = 50256
              ) -> torch.Tensor:
    """SpamDataset's encoded_texts: cut at `max_length`, else the longest; padded with `pad_id`: [n, L]."""
    ids = [tokenizer.encode(text) for text in texts]
    length = max(len(x) for x in ids) if max_length is None else max_length
    return torch.tensor([x[:length] + [pad_id] * (length - len(x[:length])) for x in ids], dtype=torch.long)


def new_head(model: GPTModel, num_classes: int, seed: int) -> GPTModel:
    """The notebook's `torch.manual_seed(seed); model.out_head = nn.Linear(emb_dim, num_classes)`:
    the head drawn from torch's global generator, as nn.Linear initialises it."""
    torch.manual_seed(seed)
    head = nn.Linear(model.cfg.emb_dim, num_classes)
    cfg = dataclasses.replace(model.cfg, num_classes=num_classes, tie_embeddings=False)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("out_head.")}
    state["out_head.weight"], state["out_head.bias"] = head.weight.data, head.bias.data
    return model_from_state(cfg, state, "the classifier").train(model.training)


def freeze_as_chapter_6(model: GPTModel) -> None:
    """Every weight frozen, then the last block, final_norm and the head trainable."""
    freeze(model, "last-block")


def book_lora(rank: int, alpha: float) -> Callable[[GPTModel], None]:
    """Appendix E's cells after the head: every weight frozen, then replace_linear_with_lora(model,
    rank, alpha) on every nn.Linear (only the adapters train): an `adapt` for `prepare`."""
    def adapt(model: GPTModel) -> None:
        model.requires_grad_(False)
        replace_linear_with_lora(model, rank, alpha)
    return adapt


def accuracy_cell_draws(seed: int, with_test: bool) -> None:
    """What the notebook's accuracy cell on the untrained classifier draws from torch's generator:
    torch.manual_seed(seed), then a new iterator over the training loader (shuffled), the validation
    and the test loader. Appendix E draws LoRA's A matrices next, from where this leaves it."""
    torch.manual_seed(seed)
    shuffled(1)
    loader_seed()
    if with_test:
        loader_seed()


def last_position_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """model(input_batch)[:, -1, :]: [b, t] -> [b, C]."""
    return model(ids)[:, -1, :]


def unwrapped(model: nn.Module) -> nn.Module:
    """The GPTModel under DistributedDataParallel's and torch.compile's wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif type(model).__name__ == "DistributedDataParallel":
            model = model.module
        else:
            return model


def frozen_blocks(model: nn.Module) -> int:
    """How many leading blocks, with the embeddings, no gradient changes and no dropout draws from: their
    output is a function of the ids alone (chapter 6 freezes 11 of gpt2's 12). 0 where there is none, or
    where `model` is not a GPTModel's layout."""
    if not all(hasattr(model, name) for name in ("tok_emb", "pos_emb", "drop_emb", "trf_blocks", "final_norm",
                                                 "out_head")):
        return 0
    if model.training and any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()):
        return 0
    if any(p.requires_grad for p in [*model.tok_emb.parameters(), *model.pos_emb.parameters()]):
        return 0
    k = 0
    for block in model.trf_blocks:
        if any(p.requires_grad for p in block.parameters()):
            break
        k += 1
    return k


@torch.no_grad()
def run_frozen(glass: nn.Module, k: int, ids: torch.Tensor) -> torch.Tensor:
    """GPTModel.forward's first part: the embeddings and blocks 0..k-1, [b, t] -> [b, t, d]."""
    x = glass.tok_emb(ids) + glass.pos_emb(torch.arange(ids.shape[1], device=ids.device))
    x = glass.drop_emb(x)
    for block in glass.trf_blocks[:k]:
        x = block(x)
    return x


# What the frozen blocks' outputs may hold in memory, at most (beyond it they are computed each time).
FROZEN_ROWS_BYTES = 1 << 30


class BookClassifierTask(BookTask):
    """Chapter 6's loaders, evaluation and accuracy lines for `fit` (see the module docstring).

    Rows are the padded ids with the label appended, so chapter 5's loaders draw and cut them."""

    perplexity = False
    # The fast path's (finetuning.prepare_book sets it where the run is not the exact float32 one): the frozen
    # blocks' output for each text, computed once and kept (`logits`); the exact run computes everything, as the
    # book does, every time.
    reuse_frozen = False

    def __init__(self, data: dict[str, tuple[torch.Tensor, list[int]]], batch_size: int, eval_batches: int,
                 tokenizer: Tokenizer):
        """`data`: {"train", "val" and optionally "test"}: (padded ids [n, L], labels)."""
        self.frozen_rows: dict[bytes, torch.Tensor] = {}  # the text's ids -> the last frozen block's output [L, d]
        self.frozen_of: tuple | None = None  # (the weights' address, dtype, blocks) those outputs came from
        self.fast_model: nn.Module | None = None  # the model the run's steps and evaluations ran (reuse_frozen)
        rows = {part: torch.cat([x, torch.tensor(y, dtype=torch.long).view(-1, 1)], dim=1)
                for part, (x, y) in data.items()}
        super().__init__(rows["train"], rows["val"], batch_size, eval_batches, tokenizer, sample_tokens=0)
        self.test = rows.get("test")
        self.max_length = data["train"][0].shape[1]

    def _batch(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"input_ids": rows[:, :-1], "labels": rows[:, -1]}

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(self.logits(model, batch["input_ids"]), batch["labels"])

    def logits(self, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """last_position_logits; with `reuse_frozen`, from each text's output of the frozen blocks, kept from
        the first time the text was read (the embeddings and those blocks never change, and nothing random
        runs in them), then the trainable blocks, final_norm and the head on the last position. The same
        function of the same weights: only the frozen part is not computed again (tests/test_book_ch06.py)."""
        glass = unwrapped(model) if self.reuse_frozen else model
        k = frozen_blocks(glass) if self.reuse_frozen else 0
        if k == 0:
            return last_position_logits(model, ids)
        self.fast_model = model
        x = self.frozen_output(glass, k, ids)
        for block in glass.trf_blocks[k:]:
            x = block(x)
        return glass.out_head(glass.final_norm(x)[:, -1:])[:, -1, :]

    def frozen_output(self, glass: nn.Module, k: int, ids: torch.Tensor) -> torch.Tensor:
        """The output of blocks 0..k-1 for `ids` [b, L]: [b, L, d], each text's kept after its first time
        (while they fit in FROZEN_ROWS_BYTES; past that, computed every time)."""
        weight = glass.tok_emb.weight
        of = (weight.data_ptr(), weight.dtype, k)
        if of != self.frozen_of:
            self.frozen_rows, self.frozen_of = {}, of
        keys = [row.numpy().tobytes() for row in ids.cpu()]
        new = [i for i, key in enumerate(keys) if key not in self.frozen_rows and key not in keys[:i]]
        if new:
            row_bytes = ids.shape[1] * glass.cfg.emb_dim * weight.element_size()
            if (len(self.frozen_rows) + len(new)) * row_bytes > FROZEN_ROWS_BYTES:
                return run_frozen(glass, k, ids)
            x = run_frozen(glass, k, ids[new])
            for j, i in enumerate(new):
                self.frozen_rows[keys[i]] = x[j].clone()
        return torch.stack([self.frozen_rows[key] for key in keys])

    def accuracy(self, model: nn.Module, rows: torch.Tensor, shuffle: bool, limit: int | None) -> float:
        """calc_accuracy_loader: the share right over `limit` batches of a new iterator (None: all)."""
        device = next(model.parameters()).device
        right, n = 0, 0
        for batch in self._loader(rows, shuffle, limit):
            predicted = self.logits(model, batch["input_ids"].to(device)).argmax(-1)
            right += int((predicted.cpu() == batch["labels"]).sum())
            n += predicted.shape[0]
        return right / n

    def sample(self, model: nn.Module) -> str:
        """The line train_classifier_simple prints after each epoch."""
        train = self.accuracy(model, self.train, shuffle=True, limit=self.n_eval_batches)
        val = self.accuracy(model, self.val, shuffle=False, limit=self.n_eval_batches)
        return f"Training accuracy: {train * 100:.2f}% | Validation accuracy: {val * 100:.2f}%"

    def checkpoint_model(self, model: nn.Module) -> nn.Module:
        """Appendix E's adapters folded into their weights (lora.merged_model); else the model."""
        return merged_model(model)

    def final_accuracies(self, model: nn.Module) -> dict[str, float]:
        """The notebook's last cell: calc_accuracy_loader over every batch of each loader (with `reuse_frozen`,
        on the model the run's evaluations ran, which holds the final weights: the frozen blocks' outputs kept)."""
        if self.reuse_frozen and self.fast_model is not None:
            model = self.fast_model
        out = {"train": self.accuracy(model, self.train, shuffle=True, limit=None),
               "val": self.accuracy(model, self.val, shuffle=False, limit=None)}
        if self.test is not None:
            out["test"] = self.accuracy(model, self.test, shuffle=False, limit=None)
        return out


def prepare(model: GPTModel, tokenizer: Tokenizer, data: str | Path, val: str | Path, test: str | Path | None = None,
            max_length: int | None = None, seed: int = 123, batch_size: int = 8, eval_batches: int = 5,
            new: bool = True, adapt: Callable[[GPTModel], Any] | None = None) -> tuple[GPTModel, BookClassifierTask]:
    """The notebook's chapter 6 up to `train_classifier_simple`: the three SpamDatasets, the new head
    after `torch.manual_seed(seed)`, every weight frozen but the last block, final_norm and the head,
    and `torch.manual_seed(seed)` again, as the notebook seeds before its optimizer and loop.
    `new=False`: `model` is the run's classifier, resumed (its generator comes from the checkpoint).
    `adapt(model)` sets, in place, which weights train, after the head (and the accuracy cell's
    draws) and before the second seed (default: chapter 6's freezing; appendix E's: `book_lora`)."""
    csvs = {"train": read_book_csv(data), "val": read_book_csv(val), **({"test": read_book_csv(test)} if test else {})}
    if len(csvs["train"].texts) < batch_size:
        raise DataError(f"{data} has {len(csvs['train'].texts)} texts, fewer than one batch of {batch_size} (the "
                        "training loader drops a last short batch): give more texts or a smaller --batch-size")
    ids = {"train": pad_texts(tokenizer, csvs["train"].texts, max_length)}
    length = ids["train"].shape[1]
    if length > model.cfg.context_length:
        raise DataError(f"the longest text of {data} is {length:,} tokens, longer than the model's context_length "
                        f"{model.cfg.context_length:,}: pass --max-length {model.cfg.context_length} (or less)")
    for part in ("val", "test"):
        if part in csvs:
            ids[part] = pad_texts(tokenizer, csvs[part].texts, length)
    if new:
        model = new_head(model, len(LABELS), seed)
        accuracy_cell_draws(seed, "test" in csvs)
    (adapt or freeze_as_chapter_6)(model)
    if new:
        torch.manual_seed(seed)
    task = BookClassifierTask({part: (ids[part], csvs[part].labels) for part in csvs}, batch_size, eval_batches,
                              tokenizer)
    return model, task


def accuracy_lines(accuracies: dict[str, float]) -> list[str]:
    names = {"train": "Training", "val": "Validation", "test": "Test"}
    return [f"{names[k]} accuracy: {v * 100:.2f}%" for k, v in accuracies.items()]


def class_probs(model: nn.Module, ids: list[int]) -> torch.Tensor:
    """classify_review's probabilities of one text's ids (prompt.Reading's: cut, and padded for the
    book's reading), the last position read: [t] -> [C]."""
    model.eval()
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = last_position_logits(model, torch.tensor([ids], device=device))
    return logits[0].float().softmax(-1).cpu()

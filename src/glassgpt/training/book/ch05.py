"""The book's chapter 5, as its code runs it: `glassgpt train --recipe book`.

    text -> split by characters at 90%          (the notebook: split_idx = int(0.90 * len(text)))
         -> each part tokenized on its own      (create_dataloader_v1: tiktoken gpt2)
         -> windows of context_length + 1 ids, starting every `stride` tokens
                                                (GPTDatasetV1: range(0, len(ids) - max_length, stride))
         -> train: shuffled each epoch, drop_last; val: in order, every window

`BookTask` hands `fit` the batches that `DataLoader(shuffle=True, drop_last=True)` would, by
drawing from torch's global generator exactly what a DataLoader draws: at every new iterator
one int64 (its base seed), and for a shuffled loader another (its RandomSampler's seed), then
`randperm` with a generator seeded by it. So does its evaluation, which is `evaluate_model`'s:
`eval_batches` batches of a fresh iterator over the training windows, then over the validation
windows, in eval mode (the training loss first, as the book computes it). Dropout draws from
the same generator in the order the modules run. With the book's initialisation
(`torch.manual_seed(seed); GPTModel(cfg)`), plain AdamW and the loss as `calc_loss_batch`
computes it, the run prints chapter 5's numbers and ends with the book's weights, bit for bit,
on the same machine and thread count. A greedy 50-token sample follows each epoch, as
`generate_and_print_sample` prints it.

Exact resume: the checkpoint keeps torch's RNG state (checkpoint.py) and this epoch's order.
`loader_losses` is chapter 5's `calc_loss_loader` over every batch (`glassgpt eval --recipe book`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ...adopt import adopt
from ...engine.loss import cross_entropy
from ...errors import DataError
from ...generate import generate
from ...tokenizer import Tokenizer
from ..loop.compute import exact
from ..tasks.data import cache_key, scan_file
from ..loop.loop import evaluate_loss
from ..loop.task import Task

START_CONTEXT = "Every effort moves you"  # the book's start_context
SAMPLE_TOKENS = 50                        # generate_and_print_sample's max_new_tokens
LINE = "Ep {epoch} (Step {global_step:06d}): Train loss {train_eval_loss:.3f}, Val loss {val_loss:.3f}"


@dataclass(frozen=True)
class Notebook:
    """Chapter 5 with a next model: ch05/14_ch05_with_other_llms, which runs this chapter's loop on the
    Qwen3 or Llama 3.2 of the book's bonus code: windows of `train_context_length` tokens (the model
    keeps its context_length and vocabulary), the model's own out_head, 40 epochs; the rest as chapter 5
    (batch 2, AdamW lr 4e-4 and weight_decay 0.1, an evaluation every 5 steps over 5 batches, a greedy
    50-token sample after each epoch). The notebook builds its model in bfloat16 and reads the model's
    own tokenizer."""
    name: str          # the notebook's path in the book's repository
    model: str         # what it trains
    tokenizer: str     # the tokenizer it reads
    window: int = 256  # train_context_length
    epochs: int = 40   # num_epochs

    def describe(self, cfg, window: int, dtype: str, tokenizer: str, seed: int) -> str:
        """The note a run prints: what it keeps of the notebook, and where it differs."""
        tok = (f"the GPT-2 tokenizer and its vocab_size {cfg.vocab_size:,}, where the notebook reads "
               f"{self.tokenizer} (--tokenizer FILE)" if tokenizer == "gpt2" else f"the tokenizer {tokenizer}")
        return (f"chapter 5 as {self.name} trains {self.model}: windows of {window:,} tokens (train_context_length; "
                f"the model keeps context_length {cfg.context_length:,}), {'a tied' if cfg.tie_embeddings else 'its own'} "
                f"out_head, torch.manual_seed({seed}) then the model; the notebook's weights are bfloat16, this run "
                f"computes in {dtype}; {tok}")


NEXT_MODELS = {
    "qwen3": Notebook("ch05/14_ch05_with_other_llms/ch05-qwen3.ipynb", "Qwen3 0.6B", "Qwen3's tokenizer.json"),
    "llama3": Notebook("ch05/14_ch05_with_other_llms/ch05-llama32.ipynb", "Llama 3.2 1B",
                       "Llama 3's tokenizer.model"),
}


def next_model_notebook(recipe, cfg) -> Notebook | None:
    """The notebook a `train --recipe book` run of this config follows, or None (GPT-2: the chapter itself)."""
    if recipe.command != "train" or recipe.name != "book":
        return None
    return NEXT_MODELS.get(getattr(cfg, "family", None))


def split_text(text: str, val_fraction: float) -> tuple[str, str]:
    """(train, val) text: the split is by characters, as the notebook's `int(0.90 * len(text))`."""
    split = int((1.0 - val_fraction) * len(text))
    return text[:split], text[split:]


def windows(tokenizer: Tokenizer, text: str, context_length: int, stride: int, part: str) -> torch.Tensor:
    """GPTDatasetV1's windows of `text`: [n, context_length + 1] int64 (inputs, then the target's extra id)."""
    ids = tokenizer.encode(text, allowed_special={"<|endoftext|>"})
    starts = range(0, len(ids) - context_length, stride)
    if not starts:
        raise DataError(f"the {part} text is {len(ids):,} tokens, but one window needs context_length + 1 = "
                        f"{context_length + 1:,}: give more text, a smaller --context-length, or another "
                        "--val-fraction")
    return torch.tensor([ids[s:s + context_length + 1] for s in starts], dtype=torch.long)


def read_windows(files: list, tokenizer: Tokenizer, val_fraction: float, context_length: int, stride: int
                 ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The notebook's text -> split -> windows: (train windows, val windows, characters, training characters).
    Several files are joined with <|endoftext|>."""
    text = "<|endoftext|>".join(p.read_text(encoding="utf-8") for p in files)
    train_text, val_text = split_text(text, val_fraction)
    return (windows(tokenizer, train_text, context_length, stride, "training"),
            windows(tokenizer, val_text, context_length, stride, "validation"), len(text), len(train_text))


def loader_seed() -> int:
    """What a new DataLoader iterator draws from the global generator: its base seed (one int64)."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


def shuffled(n: int) -> list[int]:
    """A new iterator over a shuffled loader: the base seed, the RandomSampler's seed, its randperm."""
    loader_seed()
    sampler_seed = loader_seed()
    return torch.randperm(n, generator=torch.Generator().manual_seed(sampler_seed)).tolist()


def book_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """calc_loss_batch: cross-entropy of the logits against the targets (a float32 copy of
    bfloat16 logits is avoided: the engine's chunked loss, the same value to float32 rounding)."""
    logits = model(batch["input_ids"])  # [b, t, V]
    loss = F.cross_entropy if logits.dtype == torch.float32 else cross_entropy
    return loss(logits.flatten(0, 1), batch["targets"].flatten())


class BookTask(Task):
    """Chapter 5's loaders, evaluation and samples for `fit` (see the module docstring)."""

    perplexity = True

    def __init__(self, train: torch.Tensor, val: torch.Tensor, batch_size: int, eval_batches: int,
                 tokenizer: Tokenizer, sample_tokens: int = SAMPLE_TOKENS, exact: bool = True,
                 start_context: str = START_CONTEXT):
        if len(train) < batch_size:
            raise DataError(f"the training text has {len(train):,} window(s) of {train.shape[1] - 1:,} tokens, "
                            f"fewer than one batch of {batch_size}: give more text or a smaller --batch-size")
        self.train, self.val, self.batch_size, self.n_eval_batches = train, val, batch_size, eval_batches
        self.tokenizer, self.sample_tokens, self.exact = tokenizer, sample_tokens, exact
        self.context_length = train.shape[1] - 1
        self.steps_per_epoch = len(train) // batch_size  # drop_last=True
        self.sample_prompt_ids = tokenizer.encode(start_context, allowed_special={"<|endoftext|>"})
        self.epoch, self.order = -1, []  # the epoch whose order was drawn, and that order

    def _batch(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"input_ids": rows[:, :-1], "targets": rows[:, 1:]}

    def train_batch(self, step: int, micro: int, rank: int, world: int) -> dict[str, torch.Tensor]:
        epoch, i = divmod(step, self.steps_per_epoch)
        if epoch != self.epoch:  # `for input_batch, target_batch in train_loader:` starts an epoch
            self.epoch, self.order = epoch, shuffled(len(self.train))
        return self._batch(self.train[self.order[i * self.batch_size:(i + 1) * self.batch_size]])

    def _loader(self, rows: torch.Tensor, shuffle: bool, limit: int | None) -> Iterator[dict[str, torch.Tensor]]:
        """calc_loss_loader's batches: a new iterator (its draws), then `limit` batches (None: all)."""
        order = shuffled(len(rows)) if shuffle else (loader_seed(), list(range(len(rows))))[1]
        n_batches = len(rows) // self.batch_size if shuffle else -(-len(rows) // self.batch_size)
        for k in range(n_batches if limit is None else min(limit, n_batches)):
            yield self._batch(rows[order[k * self.batch_size:(k + 1) * self.batch_size]])

    def eval_batches(self) -> Iterable[dict[str, torch.Tensor]]:
        return self._loader(self.val, shuffle=False, limit=self.n_eval_batches)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return book_loss(model, batch)

    def tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["input_ids"].numel()

    def evaluate(self, model: nn.Module) -> dict[str, Any]:
        """evaluate_model's training loss (before the validation loss, as the book draws them)."""
        batches = self._loader(self.train, shuffle=True, limit=self.n_eval_batches)
        return {"epoch": self.epoch + 1, "train_eval_loss": evaluate_loss(model, self, batches=batches)}

    def sample_due(self, step: int, evaluated: bool) -> bool:
        """After each epoch, as train_model_simple calls generate_and_print_sample."""
        return step % self.steps_per_epoch == 0

    def sample(self, model: nn.Module) -> str | None:
        if not self.sample_tokens:
            return None
        # The book's generate_text_simple (the whole window at every step) when exact, else the KV cache.
        out = generate(model, self.sample_prompt_ids, self.sample_tokens, use_cache=not self.exact)
        return self.tokenizer.decode(out[0].tolist())

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "order": self.order}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.order = int(state["epoch"]), [int(i) for i in state["order"]]


def book_task(files: list, tokenizer: Tokenizer, data: dict, cfg, run_dir=None, expect: str | None = None
              ) -> tuple[BookTask, str, str]:
    """Chapter 5's task for a run: (BookTask, the data's fingerprint, the line that says what the data
    holds). `data`: the run's record (val_fraction, context_length, stride, sample_prompt); `expect`:
    on a resume, the fingerprint the data must still have."""
    fingerprint = cache_key([scan_file(p) for p in files], tokenizer)
    if expect is not None and fingerprint != expect:
        raise DataError("the data changed since the run started (its sha256 differs from the run's record), so "
                        "--resume could not continue it exactly: restore the files, or start a new run from its "
                        "weights with --init RUN_DIR")
    context, stride = data["context_length"], data["stride"]
    train, val, n_chars, n_train_chars = read_windows(files, tokenizer, data["val_fraction"], context, stride)
    task = BookTask(train, val, cfg.batch_size, cfg.eval_batches, tokenizer, cfg.sample_tokens, exact(cfg),
                    data.get("sample_prompt") or START_CONTEXT)
    line = (f"data: {len(files)} file(s), {n_chars:,} characters split at {n_train_chars:,}: {len(train):,} training "
            f"windows ({task.steps_per_epoch:,} batches of {cfg.batch_size} per epoch) and {len(val):,} validation "
            f"windows of {context:,} tokens at stride {stride:,}, as the book's create_dataloader_v1 makes them")
    return task, fingerprint, line


def loader_losses(model: nn.Module, task: BookTask, seed: int, dtype: str = "float32") -> dict[str, float]:
    """calc_loss_loader over every batch of the training and of the validation loader, after
    `torch.manual_seed(seed)` as the notebook seeds them: {"train": ..., "val": ...}. `model`: any
    model adopt.py reads, checked once on the first training window."""
    model = adopt(model, task.train[:1, :-1], described=True)  # its own forward gives the logits
    torch.manual_seed(seed)
    train = task._loader(task.train, shuffle=True, limit=None)
    val = task._loader(task.val, shuffle=False, limit=None)
    return {"train": evaluate_loss(model, task, dtype, train), "val": evaluate_loss(model, task, dtype, val)}

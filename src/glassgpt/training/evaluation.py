"""`glassgpt eval` from plain values: the loss of one split of a text, on glassgpt's windows or the book's.

    glassgpt_split_loss(model, tokenizer, files, context, 0.1, "val")   # windows evenly spaced over the split
    book_split_loss(model, tokenizer, files, context, 0.1, "train")     # the book's calc_loss_loader

Each returns {"loss", "perplexity", "split", "windows", "context_length", "tokens", "windows_text", ...}:
the numbers, and the line that says which windows were scored.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..errors import GlassError
from . import recipes
from .book import ch05
from .tasks.data import evaluate_text, split_ids, tokenize_files


def perplexity(loss: float) -> float | None:
    """exp(loss), or None where it would overflow (as Run.ppl says it)."""
    return math.exp(loss) if loss < 700 else None


def describe_windows(windows: int, context: int, split_tokens: int, split: str) -> str:
    """How the evaluation windows were drawn, in the words a reader would count them."""
    spread = f"{windows:,} windows of {context:,} tokens, evenly spaced over the {split_tokens:,} {split} tokens"
    if windows * context > split_tokens:
        return spread + f" (so they overlap: {windows * context:,} predictions scored)"
    return spread + f" ({windows * context:,} of them scored)"


def glassgpt_split_loss(model, tokenizer, files: list[Path], context: int, val_fraction: float, split: str,
                        batch_size: int = 8, eval_batches: int | None = None, dtype: str = "float32",
                        cache_dir: str | Path = "cache") -> dict:
    """The mean loss over windows of `context` tokens that cover `split` ("train" or "val") once."""
    cache = tokenize_files(files, tokenizer, cache_dir)
    train, val = split_ids(cache.ids(), val_fraction)
    if split == "val" and not len(val):
        raise GlassError("--val-fraction 0 leaves no validation split: pass --split train or a --val-fraction > 0")
    held = val if split == "val" else train
    loss, windows = evaluate_text(model, held, context, batch_size, eval_batches, dtype)
    return {"loss": loss, "perplexity": perplexity(loss), "split": split, "windows": windows,
            "context_length": context, "tokens": windows * context, "split_tokens": len(held),
            "windows_text": describe_windows(windows, context, len(held), split)}


def book_split_loss(model, tokenizer, files: list[Path], context: int, val_fraction: float, split: str,
                    stride: int | None = None, batch_size: int | None = None, seed: int | None = None,
                    dtype: str = "float32") -> dict:
    """The book's calc_loss_loader over its loader of `split`: windows every `stride` tokens from the start
    (the training loader drops a last short batch), with the book recipe's batch size and seed by default."""
    stride = stride or context
    parts = dict(zip(("train", "val"), ch05.read_windows(files, tokenizer, val_fraction, context, stride)))
    defaults = recipes.recipe("train", recipes.BOOK).defaults
    task = ch05.BookTask(parts["train"], parts["val"], batch_size or defaults["batch_size"], 1, tokenizer)
    loss = ch05.loader_losses(model, task, seed if seed is not None else defaults["seed"], dtype)[split]
    n = len(parts[split])
    used = n - n % task.batch_size if split == "train" else n
    return {"loss": loss, "perplexity": perplexity(loss), "split": split, "windows": used, "context_length": context,
            "stride": stride, "tokens": used * context,
            "windows_text": f"the book's calc_loss_loader: {used:,} windows of {context:,} tokens at stride {stride:,} "
                            f"from the start of the {split} text"}

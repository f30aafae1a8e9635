"""The book's appendix D, `train_model`: chapter 5's loop with a learning-rate warm-up, a cosine
decay and gradient clipping, to hold beside its listing (`llms_from_scratch.appendix_d`).

    lr of global_step g (from 0):
        g < warmup_steps:  initial_lr + g * (peak_lr - initial_lr) / warmup_steps
        else:              min_lr + (peak_lr - min_lr) * 0.5 * (1 + cos(pi * progress)),
                           progress = (g - warmup_steps) / (total_steps - warmup_steps)
    clipping:  clip_grad_norm_(max_norm=1.0) once g >= warmup_steps (the printed book's
               g > warmup_steps skipped the first step after the warm-up: orig_book_version)
    lines:     "Ep 1 (Iter 000000): Train loss 10.987, Val loss 10.950" every eval_freq steps,
               and a greedy 50-token sample after each epoch

The loaders, evaluation and samples are chapter 5's (ch05.BookTask: the loaders' draws from
torch's global generator, `evaluate_model`, `generate_and_print_sample`), so with the book's
initialisation, AdamW and the same windows the run prints the book's lines and ends with its
weights, bit for bit, on the same machine and thread count (tests/test_appendix_d.py).
`peak_lr` is the optimizer's lr, as the book reads it. `run_appendix_d` is the notebook's
section D.4 on a text; `train_run` runs train_model as `glassgpt train --recipe book-appendix-d`
(recipes.py) inside a run's lifecycle (its directory, lock, metrics and final checkpoint). The book's
loop has no place for mid-run checkpoints, resume, a stop that saves, other precisions or ranks,
so neither has the recipe.
"""

from __future__ import annotations

import math
import time
import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from ...config import GPTConfig
from ...errors import ConfigError
from ...model import GPTModel
from ...tokenizer import Tokenizer
from .ch05 import LINE, START_CONTEXT, BookTask, book_loss, split_text, windows
from ..loop.config import TrainConfig
from ..loop.faults import writing
from ..loop.loop import evaluate_loss
from ..loop.metrics import append_metrics

# The book's TransformerBlock registers att, ff, norm1, norm2; glassgpt's norm1, att, norm2, ff.
BOOK_BLOCK_ORDER = ("att", "ff", "norm1", "norm2")
ITER_LINE = LINE.replace("(Step ", "(Iter ")  # train_model counts "Iter" where train_model_simple counts "Step"
# The notebook's section D.4: AdamW at peak_lr 0.001 and weight decay 0.1, 15 epochs, 20% of the
# steps to warm up from 1e-5, a cosine down to 1e-5, eval_freq 5 on eval_iter 1 batch; chapter 5's
# loaders (batch 2, windows of the context length at its stride) and torch.manual_seed(123).
D4_SETTINGS = {"peak_lr": 0.001, "weight_decay": 0.1, "n_epochs": 15, "warmup_fraction": 0.2, "initial_lr": 1e-5,
               "min_lr": 1e-5, "eval_freq": 5, "eval_iter": 1, "batch_size": 2, "seed": 123, "orig_book_version": False}


def scheduled_lr(global_step: int, peak_lr: float, total_steps: int, warmup_steps: int, initial_lr: float,
          min_lr: float) -> float:
    """train_model's learning rate at `global_step` (see the module docstring), computed as it does."""
    if global_step < warmup_steps:  # linear warm-up
        lr_increment = (peak_lr - initial_lr) / warmup_steps
        return initial_lr + global_step * lr_increment
    progress = (global_step - warmup_steps) / (total_steps - warmup_steps)  # cosine annealing
    return min_lr + (peak_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def in_book_order(model: nn.Module) -> list[nn.Parameter]:
    """model.parameters() in the order of the book's GPTModel: clip_grad_norm_ adds up the squares
    of the per-tensor norms in that order, so the same order gives the book's total norm bit for bit."""
    named = [(name.split("."), p) for name, p in model.named_parameters()]
    first = {}  # where each block's parameters start
    for i, (parts, _) in enumerate(named):
        if parts[0] == "trf_blocks":
            first.setdefault(parts[1], i)

    def key(item: tuple[int, tuple[list[str], nn.Parameter]]) -> tuple[int, int, int]:
        i, (parts, _) = item
        if parts[0] == "trf_blocks" and parts[2] in BOOK_BLOCK_ORDER:
            return first[parts[1]], BOOK_BLOCK_ORDER.index(parts[2]), i
        return i, 0, i
    return [p for _, (_, p) in sorted(enumerate(named), key=key)]


@torch.no_grad()
def evaluate_model(model: nn.Module, task: BookTask) -> tuple[float, float]:
    """Chapter 5's evaluate_model: eval_iter batches of a new training iterator, then of the validation one."""
    train_loss = task.evaluate(model)["train_eval_loss"]
    return train_loss, evaluate_loss(model, task)


def train_model(model: nn.Module, task: BookTask, optimizer: torch.optim.Optimizer, n_epochs: int, eval_freq: int,
                warmup_steps: int, initial_lr: float = 3e-05, min_lr: float = 1e-6, orig_book_version: bool = False,
                log: Callable[[str], None] | None = None,
                on_step: Callable[[int, float, float, int], None] | None = None
                ) -> tuple[list[float], list[float], list[int], list[float]]:
    """Appendix D's train_model on `task`, which holds what the book passes beside the model:
    train_loader and val_loader (its windows and batch size), eval_iter (`task.n_eval_batches`),
    start_context and tokenizer (its samples); the device is the model's. `log` gets each line the
    book prints; `on_step(steps done, loss, lr, tokens seen)` follows each optimizer step (a progress
    bar's; the book's loop has none, and it changes no number). Returns (train_losses, val_losses,
    track_tokens_seen, track_lrs), as the book's."""
    if warmup_steps < 1:
        raise ConfigError(f"appendix D's train_model divides by warmup_steps, got {warmup_steps}: give 1 or more")
    train_losses, val_losses, track_tokens_seen, track_lrs = [], [], [], []
    tokens_seen, global_step = 0, -1
    peak_lr = optimizer.param_groups[0]["lr"]
    total_training_steps = task.steps_per_epoch * n_epochs
    device = next(model.parameters()).device
    parameters = in_book_order(model)
    for epoch in range(n_epochs):
        model.train()
        for _ in range(task.steps_per_epoch):
            batch = task.train_batch(global_step + 1, 0, 0, 1)  # the epoch's first batch draws its order
            optimizer.zero_grad()
            global_step += 1
            lr = scheduled_lr(global_step, peak_lr, total_training_steps, warmup_steps, initial_lr, min_lr)
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr
            track_lrs.append(lr)
            loss = book_loss(model, {k: v.to(device) for k, v in batch.items()})  # calc_loss_batch
            loss.backward()
            if global_step > warmup_steps if orig_book_version else global_step >= warmup_steps:
                torch.nn.utils.clip_grad_norm_(parameters, max_norm=1.0)
            optimizer.step()
            tokens_seen += task.tokens(batch)
            if on_step is not None:
                on_step(global_step + 1, loss.item(), lr, tokens_seen)
            if global_step % eval_freq == 0:
                train_loss, val_loss = evaluate_model(model, task)
                train_losses.append(train_loss)
                val_losses.append(val_loss)
                track_tokens_seen.append(tokens_seen)
                _say(log, ITER_LINE.format(epoch=epoch + 1, global_step=global_step, train_eval_loss=train_loss,
                                           val_loss=val_loss))
        _say(log, _sample(model, task))  # generate_and_print_sample
    return train_losses, val_losses, track_tokens_seen, track_lrs


def _sample(model: nn.Module, task: BookTask) -> str:
    """generate_and_print_sample's line: the greedy sample, in eval mode, on one line."""
    model.eval()
    with torch.no_grad():
        text = task.sample(model) or ""
    model.train()
    return text.replace("\n", " ")


def _say(log: Callable[[str], None] | None, line: str) -> None:
    if log is not None:
        log(line)


def run_appendix_d(model: GPTModel | GPTConfig, text: str, tokenizer: Tokenizer, *, context_length: int,
                   stride: int | None = None, val_fraction: float = 0.1, start_context: str = START_CONTEXT,
                   log: Callable[[str], None] | None = None, **settings) -> tuple[GPTModel, tuple]:
    """Section D.4 on `text`: torch.manual_seed(seed), the model (built here from a config, with the
    book's initialisation, as `GPTModel(GPT_CONFIG_124M)`; or as given), chapter 5's split and
    windows, AdamW, then train_model. D4_SETTINGS are the defaults (any may be given; `warmup_steps`
    overrides warmup_fraction). Returns (the model, train_model's four lists)."""
    unknown = sorted(set(settings) - set(D4_SETTINGS) - {"warmup_steps"})
    if unknown:
        raise ConfigError(f"appendix D has no setting {unknown[0]!r}: choose from {', '.join(D4_SETTINGS)}, "
                          "warmup_steps")
    s = {**D4_SETTINGS, **settings}
    train_text, val_text = split_text(text, val_fraction)
    stride = stride or context_length
    task = BookTask(windows(tokenizer, train_text, context_length, stride, "training"),
                    windows(tokenizer, val_text, context_length, stride, "validation"),
                    s["batch_size"], s["eval_iter"], tokenizer, start_context=start_context)
    torch.manual_seed(s["seed"])  # nothing draws from torch's generator between here and the first epoch
    if isinstance(model, GPTConfig):
        model = GPTModel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=s["peak_lr"], weight_decay=s["weight_decay"])
    total_steps = task.steps_per_epoch * s["n_epochs"]
    warmup_steps = s["warmup_steps"] if "warmup_steps" in s else int(s["warmup_fraction"] * total_steps)
    return model, train_model(model, task, optimizer, s["n_epochs"], s["eval_freq"], warmup_steps, s["initial_lr"],
                              s["min_lr"], s["orig_book_version"], log)


# --- as a recipe: `glassgpt train --recipe book-appendix-d` ------------------------------------------

# What the recipe sets itself: train_model clips at max_norm 1.0 after the warm-up, on one batch a
# step, in float32 on the model's own kernels, in one process.
RECIPE_SETTINGS = {"grad_clip": 1.0, "grad_accum": 1, "batch_tokens": None, "dtype": "float32", "compile": False,
                   "fsdp": False}
# ... and section D.4's choices, which a flag may change (warmup_steps None: 20% of the steps).
RECIPE_DEFAULTS = {"lr": D4_SETTINGS["peak_lr"], "min_lr": D4_SETTINGS["min_lr"], "warmup_steps": None,
                   "weight_decay": D4_SETTINGS["weight_decay"], "batch_size": D4_SETTINGS["batch_size"],
                   "eval_every": D4_SETTINGS["eval_freq"], "eval_batches": D4_SETTINGS["eval_iter"],
                   "seed": D4_SETTINGS["seed"], "beta1": 0.9, "beta2": 0.999, "sample_tokens": 50}


def settle(cfg: TrainConfig, steps_per_epoch: int) -> TrainConfig:
    """The settings that depend on the data: whole epochs (train_model's n_epochs), and the warm-up,
    20% of the steps as section D.4 computes it unless --warmup-steps was given."""
    if cfg.max_steps % steps_per_epoch:
        raise ConfigError(f"appendix D's train_model runs whole epochs of {steps_per_epoch:,} steps, and "
                          f"{cfg.max_steps:,} steps are not: give --epochs as a whole number")
    warmup = cfg.warmup_steps
    if warmup is None:
        warmup = int(D4_SETTINGS["warmup_fraction"] * cfg.max_steps)
    if warmup < 1:
        raise ConfigError(f"appendix D's train_model divides by warmup_steps, which is {warmup} for "
                          f"{cfg.max_steps:,} steps: give --warmup-steps 1 or more, or more --epochs")
    return dataclasses.replace(cfg, warmup_steps=warmup)


def train_run(run: Any) -> None:
    """train_model on a `Run` (run.py): its model, task and AdamW (the book's: lr the peak, decay on
    every parameter), each line the book prints handed to `run.say`; then its evaluations written to
    metrics.jsonl and the model saved as latest/ and best/. A signal stops it at once, with no
    checkpoint: train_model has no place to stop and save."""
    cfg, task = run.cfg, run.task
    run.stop.abort_at_once()
    start = time.perf_counter()

    def progress(step: int, loss: float, lr: float, tokens: int) -> None:  # the progress bar's step events
        if run.ranks.is_main:
            seconds = time.perf_counter() - start
            run.emit({"event": "step", "max_steps": cfg.max_steps, "step": step, "tokens": tokens, "train_loss": loss,
                      "lr": lr, "tokens_per_s": tokens / max(seconds, 1e-9), "elapsed_s": round(seconds, 3)})
    train_losses, val_losses, tokens_seen, lrs = train_model(
        run.model, task, run.optimizer, cfg.max_steps // task.steps_per_epoch, cfg.eval_every, cfg.warmup_steps,
        D4_SETTINGS["initial_lr"], cfg.final_lr, log=run.say, on_step=progress)
    for k, (train_loss, val_loss, tokens) in enumerate(zip(train_losses, val_losses, tokens_seen)):
        step = k * cfg.eval_every + 1  # after global_step k * eval_freq, counted from 1
        record = {"step": step, "tokens": tokens, "lr": lrs[step - 1], "epoch": (step - 1) // task.steps_per_epoch + 1,
                  "train_eval_loss": train_loss, **run.validation(val_loss)}
        if run.ranks.is_main:
            with writing(run.run_dir, "metrics.jsonl"):
                append_metrics(run.run_dir, record)
    run.step, run.tokens = cfg.max_steps, cfg.max_steps * cfg.batch_size * task.context_length
    run.last_train = train_losses[-1] if train_losses else None
    run.save(evaluated=bool(val_losses))

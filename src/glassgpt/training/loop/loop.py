"""The training loop, to hold beside the book's `train_model_simple`: batch, loss, backward, step,
evaluate, sample.

`train(run)` below is the whole loop. What to train on is a `Task` (pretraining:
`tasks/data.TextTask`; the book's chapter 5: `book/ch05.BookTask`; finetuning: `tasks/classify.py`,
`tasks/instruct.py`); how to train is a `TrainConfig` (config.py). Everything else a real run
needs stands around the loop in `run.py` and the parts it names: the model placed,
sharded, in its precision (compute.py), the ranks (distributed.py), checkpoints and when
to write them (checkpoint.py), the run directory and its lock (rundir.py), signals,
divergence and disk faults (faults.py), metrics.jsonl and the plot (metrics.py).

The loop never prints: each step is one record handed to `log` (the command line draws
a progress bar and prints the evaluations and samples from it; tests keep a list).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ...device import evaluating
from .snapshot import snapshot
from ...tokenizer import Tokenizer
from .compute import autocast, autocast_dtype
from .config import TrainConfig, evaluation_due
from .distributed import Distributed
from .run import Run
from .rundir import RunDir
from .task import Task


def fit(model: nn.Module, task: Task, cfg: TrainConfig, tokenizer: Tokenizer | None = None, *,
        log: Callable[[dict[str, Any]], None] | None = None, meta: dict[str, Any] | None = None,
        resume: bool = False, run_dir: RunDir | None = None, ranks: Distributed | None = None,
        loop: Callable[[Run], None] | None = None) -> dict[str, Any]:
    """Train `model` on `task` as `cfg` says; return the final metrics.

    `log(event)` receives {"event": "start" | "step" | "note" | "end", ...}: a "step" event is
    the step's metrics record, with the evaluation's and the sample's keys on the steps that
    have them. `meta` is saved in every checkpoint's meta.json. `resume=True` continues
    cfg.out/latest exactly. `run_dir` is a directory the caller has claimed (rundir.open_run_dir;
    else fit claims cfg.out itself) and `ranks` its place in a torchrun job (else read here).
    Returns {"step", "tokens", "train_loss", "val_loss", "val_ppl", "best_val_loss", "elapsed_s",
    "interrupted", "signal", "run_dir", "plot"}. `loop`: a recipe's own loop over the `Run`
    (recipes.Recipe.loop), in place of `train`.
    """
    with Run.open(model, task, cfg, tokenizer, meta or {}, log, resume, run_dir, ranks) as run:
        (loop or train)(run)
    return run.result


def train(run: Run) -> None:
    """The loop: train_model_simple's, with glassgpt's machinery behind the names of `run`."""
    task, cfg = run.task, run.cfg
    for step in range(run.step, cfg.max_steps):
        run.begin_step(step)  # the learning rate; glassgpt's recipe seeds this step's dropout
        for micro in range(cfg.grad_accum):
            batch = run.batch(step, micro)  # input_batch, target_batch
            last = micro == cfg.grad_accum - 1
            with run.compute.sync(last):  # (DDP: the gradients' all-reduce waits for the last micro-batch)
                with run.compute.autocast():
                    loss = task.loss(run.compute.forward, batch)  # calc_loss_batch
                run.compute.backward(loss, last)  # loss.backward()
            run.add_loss(loss)
        run.optimizer_step()  # optimizer.step(); optimizer.zero_grad()
        record = run.end_step(step)  # tokens seen, the loss over the ranks, a check that it is finite
        evaluated = evaluation_due(run.step, cfg)
        if evaluated:
            record.update(evaluate(run))  # evaluate_model
        if task.sample_due(run.step, evaluated):
            record["sample"] = sample(run)  # generate_and_print_sample
        run.log(record)
        run.save(evaluated)
        if run.stopping:
            break


@torch.no_grad()
def evaluate(run: Run) -> dict[str, Any]:
    """The task's metrics, the validation loss and a snapshot of the sample prompt, in eval mode."""
    run.check_weights_finite()
    model, task = run.compute.eval_model, run.task
    with evaluating(model), run.compute.autocast():
        metrics = task.evaluate(model)  # first: the book's evaluate_model draws its training batches first
        val = evaluate_loss(model, task)
        out = {**(run.validation(val) if val is not None else {}), **metrics}
        prompt = task.sample_prompt_ids
        if prompt and run.tokenizer is not None and model.cfg.num_classes is None:  # a language model's
            out["snapshot"] = snapshot(model, run.tokenizer, prompt, new_tokens=task.sample_tokens)
    return out


def sample(run: Run) -> str | None:
    model = run.compute.eval_model
    with evaluating(model), run.compute.autocast(), run.diverges_on_nonfinite("the sample's scores"):
        return run.task.sample(model)


@torch.no_grad()
def evaluate_loss(model: nn.Module, task: Task, dtype: str | None = None,
                  batches: Iterable[dict[str, torch.Tensor]] | None = None) -> float | None:
    """Mean task loss over `batches` (default: `task.eval_batches()`) in eval mode, as the book's
    calc_loss_loader adds them up; None if there are none. `dtype`: autocast to it here (None:
    as the caller set it)."""
    device = next(model.parameters()).device
    total, n = 0.0, 0
    with evaluating(model), (autocast(device, autocast_dtype(dtype, device)) if dtype else contextlib.nullcontext()):
        for batch in task.eval_batches() if batches is None else batches:
            total += float(task.loss(model, {k: v.to(device) for k, v in batch.items()}))
            n += 1
    return total / n if n else None



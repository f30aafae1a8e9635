"""training: the loop, its config, checkpoints and run directories, the pretraining and finetuning tasks, LoRA.

    loop.py         `fit(model, task, cfg)` and `train(run)`: the loop, in the book's order
    config.py       TrainConfig (every setting declared once), the two recipes, the lr schedule
    run.py          the machinery around the loop, behind the names it calls
    compute.py      the model as the step runs it: placed, sharded, bf16, fused, compiled, DDP; AdamW
    distributed.py  one process, or one rank of a torchrun job
    checkpoint.py   latest/ and best/, written whole, when to write them, resumed exactly
    rundir.py       one process at a time in a run directory; new run or resume, checked once
    faults.py       signals, divergence, disks that refuse a write
    metrics.py      metrics.jsonl (`read_metrics`), loss.png and a classifier's confusion.png
    data.py         text files -> cached token ids -> windows (glassgpt's pretraining task)
    task.py         Task, the base class of what the loop trains on; recipes.py the recipes' registry
    book.py         the book's chapter 5: its loaders, evaluation and samples (`--recipe book`)
    appendix_d.py   the book's appendix D: train_model (warm-up, cosine decay, clipping) on chapter 5's data
    book_ch06.py    the book's chapter 6 (`finetune classify --recipe book`); book_ch07.py its chapter 7
    examples.py     what the finetuning tasks share; classify.py (chapter 6), instruct.py (chapter 7)
    lora.py         LoRA adapters (appendix E); finetune.py names the finetuning API in one place
"""

from .config import TrainConfig
from .loop import evaluate_loss, evaluate_text, fit
from .task import Task
from .metrics import plot_run, read_metrics

__all__ = ["Task", "TrainConfig", "evaluate_loss", "evaluate_text", "fit", "plot_run", "read_metrics"]

"""training: the loop and its machinery, the tasks it trains on, the book's replays, and the recipes that pick them.

    loop/           the loop (`fit`, `train`), the Task it is handed, TrainConfig, and what stands around it:
                    placement and precision, ranks, checkpoints, the run directory, faults, metrics, snapshots
    tasks/          glassgpt's tasks: pretraining on text, classification, instructions; LoRA
    book/           the book's chapters 5, 6, 7 and appendix D, run as its code runs them (`--recipe book`)
    recipes.py      how a run trains, one object per regime, looked up by name
    finetuning.py   a finetuning run from plain values: its settings, the model and task it starts from, its report
    evaluation.py   `glassgpt eval` from plain values: one split's loss, on glassgpt's windows or the book's

Each folder imports only the folders listed above it (tests/test_layout.py).
"""

from .loop.config import TrainConfig
from .loop.loop import evaluate_loss, fit
from .loop.task import Task
from .loop.metrics import plot_run, read_metrics
from .tasks.data import evaluate_text

__all__ = ["Task", "TrainConfig", "evaluate_loss", "evaluate_text", "fit", "plot_run", "read_metrics"]

"""`Task`: what `fit` trains on, with the defaults every task shares.

The loop knows nothing of text, labels or instructions: a task hands it batches, a loss and
its metrics. A task overrides what it needs; what it leaves alone does what most tasks want
(sample at the evaluations, a per-token loss, no state to resume, the model saved as it is).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn


class Task:
    """What to train on (tasks/: data.TextTask, classify.py, instruct.py; book/: ch05.BookTask, ch06.BookClassifierTask, ...)."""

    perplexity = True            # False: a loss that is not per-token cross-entropy (no val_ppl)
    sample_prompt_ids: list[int] | None = None  # the prompt of the snapshots at the evaluations (None: none)
    sample_tokens = 0            # the tokens a snapshot generates past its prompt

    def train_batch(self, step: int, micro: int, rank: int, world: int) -> dict[str, torch.Tensor]:
        """Micro-batch `micro` of step `step` for `rank` of `world`."""
        raise NotImplementedError

    def eval_batches(self) -> Iterable[dict[str, torch.Tensor]]:
        """The validation batches of one evaluation (empty: no validation)."""
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """A scalar loss; `batch` is already on the model's device."""
        raise NotImplementedError

    def tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Tokens in a batch: for tokens/s and the x-axis of plots."""
        return int(batch["input_ids"].numel())

    def evaluate(self, model: nn.Module) -> dict[str, Any]:
        """Metrics beside the validation loss at an evaluation, e.g. accuracy."""
        return {}

    def sample_due(self, step: int, evaluated: bool) -> bool:
        """Whether step `step` (from 1) ends with `sample`: at the evaluations."""
        return evaluated

    def sample(self, model: nn.Module) -> str | None:
        """A line to show: a short generated sample (or the book's per-epoch line), or None."""
        return None

    def checkpoint_model(self, model: nn.Module) -> nn.Module:
        """What to save as the loadable model (LoRA's: the merged one)."""
        return model

    def state_dict(self) -> dict[str, Any] | None:
        """The task's own state, for an exact resume (the book's epoch order); None: none."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

"""What can stop a run, and how each stop ends: a signal, a run that diverges, a disk that refuses.

- Ctrl-C or SIGTERM (`StopRequests`): the step under way finishes, latest/ is saved and fit
  returns `interrupted`; a second signal aborts at once.
- Divergence: the loss is checked every step, the weights (and the validation loss) before
  every evaluation and save, so nothing non-finite is ever saved; the error names the
  checkpoints that survive and the setting to lower.
- A full disk, a file-size limit or a read-only disk while writing (`writing`): one line
  naming the file and what survives, never a traceback.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path
from typing import Any

from ...errors import TrainError
from .checkpoint import saved_checkpoints
from .config import TrainConfig


class StopRequests:
    """The first SIGINT/SIGTERM asks the loop to save and stop after this step; a second aborts."""

    def __init__(self) -> None:
        self.requested = False
        self.signal: int | None = None  # the first signal received
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.signal = True, signum

    def abort_at_once(self) -> None:
        """For a loop with no place to stop and save (appendix D's train_model): the first signal aborts."""
        self.requested = True

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def diverged(run_dir: Path, step: int, what: str, cfg: TrainConfig) -> TrainError:
    return TrainError(f"training diverged at step {step:,}: {what}; nothing non-finite was saved and "
                      f"{saved_checkpoints(run_dir)}. Lower --lr (now {cfg.lr:g}) or raise "
                      f"--warmup-steps (now {cfg.warmup_steps:,})")


@contextlib.contextmanager
def writing(run_dir: Path, what: str):
    """A full disk, a file-size limit or a read-only disk while writing `what`: one line, not a traceback."""
    try:
        yield
    except OSError as e:
        raise TrainError(f"could not write {run_dir / what} ({e.strerror or e}): {saved_checkpoints(run_dir)}; "
                         "free some space or give a writable run directory") from None

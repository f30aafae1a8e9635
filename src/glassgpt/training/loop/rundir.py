"""One process at a time in a run directory: `lock_run_dir(RUN_DIR)`.

A `with lock_run_dir(run_dir):` block holds an exclusive `flock` on RUN_DIR/.lock and
writes who holds it (pid, host, start time, command) into that file. A second
process that asks for the same run directory is refused with a `RunDirError`
naming the holder. The operating system drops the lock when the holding process
ends, however it ends (SIGKILL, a crash, a reboot), so there is no stale lock to
clean up. A run that is refused (or fails before writing anything) leaves the directory
as it found it: the lock file, and the directory itself, are removed if it made them.

`open_run_dir(RUN_DIR, resume)` is a run's whole claim on its directory, taken once by
whoever starts the run (the command line, or `fit` when called alone): it checks that
a new run does not overwrite an old one and that a resumed one is there, takes the
lock, checks again under it (another process may have started a run in between), and
puts back what a crash during a save left. Under torchrun only rank 0 locks and checks,
on its machine. No write leaves the run directory: the lock is opened with O_NOFOLLOW,
and a symbolic link where the run will write (`WRITTEN`) is refused in one line naming it.
Leaves out: Windows (no fcntl; there is no lock there) and shared file systems whose
`flock` does not reach other machines.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ...errors import GlassError, RunDirError
from ...formats.files import open_to_write, read_json, refuse_link
from .checkpoint import recover_checkpoints
from .config import TrainConfig

LOCK_NAME = ".lock"

RUN_MARKERS = ("train_config.json", "metrics.jsonl", "latest", "best")
# What a run writes, renames or removes in its directory: a symbolic link at any of these is refused.
WRITTEN = (LOCK_NAME, "train_config.json", "metrics.jsonl", "loss.png", "latest", "best", ".latest.old", ".best.old")


@dataclass(frozen=True)
class RunDir:
    """A run directory that this process holds (or, on ranks > 0, follows): what `fit` writes to."""

    path: Path
    resume: bool


@contextlib.contextmanager
def open_run_dir(run_dir: str | os.PathLike, resume: bool, is_main: bool = True) -> Iterator[RunDir]:
    """Claim RUN_DIR for a new run (`resume=False`) or for continuing one, for the `with` block."""
    path = Path(run_dir)
    if resume and not path.is_dir():  # before the lock would create it
        check_out_dir(path, resume)
    with lock_run_dir(path) if is_main else contextlib.nullcontext():
        if is_main:
            check_out_dir(path, resume)
            refuse_links(path)
            if resume:
                recover_checkpoints(path)
        yield RunDir(path, resume)


def check_out_dir(run_dir: Path, resume: bool) -> None:
    """Refuse to start a new run over an old one, or to resume a run that is not there."""
    if resume:
        if not any((run_dir / m).exists() for m in ("train_config.json", "latest", "best", ".latest.old")):
            raise RunDirError(f"{run_dir} is not a training run (no train_config.json, latest/ or best/): "
                              "nothing to resume")
        return
    if run_dir.is_file():
        raise RunDirError(f"--out {run_dir} is a file: give a directory for the run")
    found = [m for m in RUN_MARKERS if (run_dir / m).exists()]
    if found:
        raise RunDirError(f"{run_dir} already holds a training run ({found[0]}): pass --resume {run_dir} "
                          "to continue it, or another --out for a new run")


def refuse_links(run_dir: Path) -> None:
    """Refuse a run directory where a file the run writes is a symbolic link (the run would write
    through it, or replace it): before training, not at the first save."""
    for name in WRITTEN:
        refuse_link(run_dir / name, RunDirError)


@contextlib.contextmanager
def lock_run_dir(run_dir: str | os.PathLike) -> Iterator[Path]:
    """Hold RUN_DIR's lock for the `with` block (creating RUN_DIR); refuse if another process holds it."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        raise RunDirError(f"{run_dir} is a file: give a directory for the run")
    had_dir, had_lock = run_dir.is_dir(), (run_dir / LOCK_NAME).exists()
    lock_file = _acquire(run_dir)
    try:
        yield run_dir
    except BaseException:
        _leave_as_found(run_dir, had_dir, had_lock)  # a refused run leaves no trace
        raise
    finally:
        lock_file.close()  # closing the file releases the lock


def _leave_as_found(run_dir: Path, had_dir: bool, had_lock: bool) -> None:
    """Remove the lock file (and the directory) this process created, if the run wrote nothing
    else there. Done while the lock is held, so no other process holds the removed file."""
    try:
        if not had_lock and [p.name for p in run_dir.iterdir()] == [LOCK_NAME]:
            (run_dir / LOCK_NAME).unlink()
        if not had_dir and not any(run_dir.iterdir()):
            run_dir.rmdir()
    except OSError:  # a directory that cannot be tidied keeps a harmless, unlocked .lock
        pass


def _acquire(run_dir: Path):
    try:
        import fcntl
    except ImportError:  # Windows: no lock
        return open(os.devnull, "w")
    path = run_dir / LOCK_NAME
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock_file = open_to_write(path, "a+", RunDirError)  # never through a link
    except OSError as e:
        raise RunDirError(f"cannot write to {run_dir} ({e.strerror}): give a run directory on a writable "
                          "disk") from None
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock_file.seek(0)
        holder = describe_holder(lock_file.read())
        lock_file.close()
        raise RunDirError(f"{run_dir} is in use by another glassgpt process ({holder}): wait for it to end "
                          "or stop it, or pass another run directory") from None
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "command": " ".join(sys.argv)}
    try:
        lock_file.seek(0)
        lock_file.truncate()
        lock_file.write(json.dumps(record) + "\n")
        lock_file.flush()
    except OSError as e:
        lock_file.close()
        raise RunDirError(f"cannot write to {run_dir} ({e.strerror}): give a run directory on a writable "
                          "disk with free space") from None
    return lock_file


def describe_holder(text: str) -> str:
    """'pid 123 on host, since 2024-05-01T10:00:00+00:00' from a lock file's record."""
    try:
        record = json.loads(text)
        return f"pid {record['pid']} on {record['host']}, since {record['started']}"
    except (ValueError, TypeError, KeyError):
        return "it has not said which yet"


def saved_train_config(run_dir: str | os.PathLike, checkpoint: str | os.PathLike | None = None
                       ) -> tuple[dict[str, Any], str | None]:
    """(a run's TrainConfig values, None), from RUN_DIR/train_config.json; when that file is
    damaged or gone, (the copy in the checkpoint's train_state.json, a note that says so)."""
    path = Path(run_dir) / "train_config.json"
    problem = _valid_train_config(path, lambda values: values)
    if not isinstance(problem, str):
        return problem, None
    ckpt = Path(checkpoint) if checkpoint is not None else Path(run_dir) / "latest"
    copy = _valid_train_config(ckpt / "train_state.json", lambda state: state["train_config"])
    if isinstance(copy, str):
        raise RunDirError(f"{path} is {problem}, and {ckpt} holds no copy of the run's settings: they are lost; "
                          "start a new run (--init RUN_DIR keeps the weights)")
    return copy, f"{path} is {problem}: using the copy saved in {ckpt}"


def _valid_train_config(path: Path, pick) -> dict[str, Any] | str:
    """The TrainConfig values `pick(the JSON in path)` gives if TrainConfig takes them, else what was wrong."""
    if not path.is_file():
        return "missing"
    try:
        values = pick(read_json(path))
        TrainConfig.from_dict(values)
        return values
    except (ValueError, TypeError, KeyError, AttributeError, GlassError) as e:
        return f"damaged ({type(e).__name__}: {str(e)[:80]})"

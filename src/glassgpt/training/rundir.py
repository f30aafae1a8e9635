"""One process at a time in a run directory: `lock_run_dir(RUN_DIR)`.

A `with lock_run_dir(run_dir):` block holds an exclusive `flock` on RUN_DIR/.lock and
writes who holds it (pid, host, start time, command) into that file. A second
process that asks for the same run directory is refused with a `RunDirError`
naming the holder. The operating system drops the lock when the holding process
ends, however it ends (SIGKILL, a crash, a reboot), so there is no stale lock to
clean up: the file may stay behind, the lock does not.

The lock is re-entrant within a process: the command line takes it before it looks
at the run directory and `train.fit` takes it again around the loop. Leaves out:
Windows (no fcntl; there is no lock there) and shared file systems whose `flock`
does not reach other machines (under torchrun only rank 0 locks, on its machine).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
from pathlib import Path
from typing import Iterator

from ..errors import RunDirError

LOCK_NAME = ".lock"

_held: dict[Path, list] = {}  # resolved run dir -> [open lock file, depth]


@contextlib.contextmanager
def lock_run_dir(run_dir: str | os.PathLike) -> Iterator[Path]:
    """Hold RUN_DIR's lock for the `with` block (creating RUN_DIR); refuse if another process holds it."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        raise RunDirError(f"{run_dir} is a file: give a directory for the run")
    key = run_dir.resolve()
    if key in _held:  # this process holds it already
        _held[key][1] += 1
        try:
            yield run_dir
        finally:
            _held[key][1] -= 1
        return
    lock_file = _acquire(run_dir)
    _held[key] = [lock_file, 1]
    try:
        yield run_dir
    finally:
        del _held[key]
        lock_file.close()  # closing the file releases the lock


def _acquire(run_dir: Path):
    try:
        import fcntl
    except ImportError:  # Windows: no lock
        return open(os.devnull, "w")
    path = run_dir / LOCK_NAME
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock_file = open(path, "a+", encoding="utf-8")
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

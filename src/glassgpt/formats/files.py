"""Reading and writing files safely: checked JSON and tensor reads, and writes that never leave half a file.

Every reader of a stranger's file goes through here, so that a file that cannot be
read is one `CheckpointError` naming it (never a traceback), and every writer goes
through `atomic_write`, so that a crash never leaves a half-written file under a
real name.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return value


def checkpoint_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from model.safetensors (memory-mapped) or pytorch_model.bin."""
    st, binfile = path / "model.safetensors", path / "pytorch_model.bin"
    if st.is_file():
        try:
            with safe_open(st, framework="pt", device="cpu") as f:
                names = list(f.keys())
                for name in names:
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{st} is truncated or corrupt ({e}): save or download it again") from None
    elif binfile.is_file():
        try:
            state = torch.load(binfile, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # pickle errors come in many types; none may escape as a traceback
            raise CheckpointError(f"{binfile} cannot be read safely ({type(e).__name__}: {e}); "
                                  "convert it to model.safetensors") from None
        yield from state.items()
    else:
        raise CheckpointError(f"{path} has config.json but no model.safetensors or pytorch_model.bin")


def atomic_write(dest: Path, write: Callable[[str], Any]) -> None:
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


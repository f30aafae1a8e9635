"""Reading and writing files safely: checked JSON and tensor reads, and writes that never leave half a file.

Every reader of a stranger's file goes through here, so that a file that cannot be
read is one error naming it (never a traceback), and so that nothing is allocated
before the file shows it holds what it claims: a safetensors header is checked
against the file's size, tensor by tensor, before any tensor is read. Every writer
goes through `atomic_write`, so that a crash never leaves a half-written file under
a real name.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError, GlassError

MAX_JSON_BYTES = 64 << 20      # config, tokenizer, meta and state files are kilobytes to a few megabytes
MAX_HEADER_BYTES = 100 << 20   # safetensors' own limit on its JSON header
SAFETENSORS_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}


def read_json(path: str | os.PathLike, error: type[GlassError] = CheckpointError, what: str = "") -> dict[str, Any]:
    """The JSON object in `path`; else one `error` that names the file (and `what` it is for)."""
    path = Path(path)
    label = f"{path}{f' ({what})' if what else ''}"
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise error(f"{label} is {size:,} bytes, more than any GPT-2 JSON file holds "
                        f"({MAX_JSON_BYTES >> 20} MiB): it is not the file it should be")
        value = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise error(f"{label} does not exist") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise error(f"cannot read {label}: {str(e) or type(e).__name__}") from None
    if not isinstance(value, dict):
        raise error(f"{label} must hold a JSON object, not a {type(value).__name__}")
    return value


# --- safetensors ------------------------------------------------------------------------------

def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} from a safetensors file's header, after checking that the header
    fits in the file and that each tensor's data_offsets hold exactly its shape's bytes."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is {size} bytes: too short for a safetensors file")
            n = struct.unpack("<Q", head)[0]  # the header's length, then the header, then the data
            if n > min(size - 8, MAX_HEADER_BYTES):
                raise CheckpointError(f"{path}: its first 8 bytes say the header is {n:,} bytes, but the file has "
                                      f"{size - 8:,} after them: it is truncated or not a safetensors file")
            header = json.loads(f.read(n).decode("utf-8"))
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: its header is not JSON ({e}): the file is corrupt") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: its header is not a JSON object: the file is corrupt")
    data_bytes = size - 8 - n
    return {name: _entry_shape(path, name, entry, data_bytes)
            for name, entry in header.items() if name != "__metadata__"}


def _entry_shape(path: Path, name: str, entry: Any, data_bytes: int) -> tuple[int, ...]:
    """The shape of one header entry {"dtype", "shape", "data_offsets"}, checked against the file."""
    if not isinstance(entry, dict):
        raise CheckpointError(f"{path}: header entry {name!r} is not an object: the file is corrupt")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype!r}, not one safetensors defines")
    if not _ints(shape, 0):
        raise CheckpointError(f"{path}: tensor {name!r} has shape {shape!r}: a shape is a list of sizes >= 0")
    if not _ints(offsets, 0) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise CheckpointError(f"{path}: tensor {name!r} has data_offsets {offsets!r}: they must be [begin, end]")
    need = math.prod(shape) * SAFETENSORS_DTYPES[dtype]
    if offsets[1] - offsets[0] != need:
        raise CheckpointError(f"{path}: tensor {name!r} is {list(shape)} {dtype} ({need:,} bytes), but its "
                              f"data_offsets {offsets} hold {offsets[1] - offsets[0]:,} bytes: the header lies")
    if offsets[1] > data_bytes:
        raise CheckpointError(f"{path}: tensor {name!r} ends at byte {offsets[1]:,} of the data, but the file holds "
                              f"{data_bytes:,}: it is truncated; save or download it again")
    return tuple(shape)


def _ints(value: Any, low: int) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= low for v in value)


def read_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a safetensors file, memory-mapped, read one at a time (so a check
    holds one tensor, not the file), after `safetensors_shapes` has checked its header."""
    safetensors_shapes(path)
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in list(f.keys()):
                yield name, f.get_tensor(name)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{path} is truncated or corrupt ({e}): save or download it again") from None


# --- a checkpoint directory's weights ---------------------------------------------------------

def weights_file(path: Path) -> Path:
    """model.safetensors, else pytorch_model.bin, of a checkpoint directory."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).is_file():
            return path / name
    raise CheckpointError(f"{path} has config.json but no model.safetensors or pytorch_model.bin")


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """{name: shape} of a checkpoint directory's weights, read without reading the tensors."""
    file = weights_file(path)
    if file.suffix == ".safetensors":
        return safetensors_shapes(file)
    return {name: tuple(t.shape) for name, t in _load_bin(file).items()}


def checkpoint_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from model.safetensors (memory-mapped) or pytorch_model.bin."""
    file = weights_file(path)
    if file.suffix == ".safetensors":
        yield from read_safetensors(file)
    else:
        yield from _load_bin(file).items()


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # pickle errors come in many types; none may escape as a traceback
        raise CheckpointError(f"{file} cannot be read safely ({type(e).__name__}: {e}); "
                              "convert it to model.safetensors") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{file} holds a {type(state).__name__} of other things than tensors, "
                              "not a state dict: convert it to model.safetensors")
    return state


def atomic_write(dest: Path, write: Callable[[str], Any]) -> None:
    """`write(tmp)` a temporary file beside `dest`, then rename it into place, with the permissions
    a plain open() would have given (mkstemp's are owner-only)."""
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _umask() -> int:
    """This process's umask, read without changing it (Linux's /proc), else the usual 022."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022

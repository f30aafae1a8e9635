"""Reading and writing files safely: checked JSON and tensor reads, and writes that never leave half a file.

Every reader of a stranger's file goes through here, so that a file that cannot be
read is one error naming it (never a traceback), and so that nothing is allocated
before the file shows it holds what it claims: a safetensors header is checked
against the file's size, tensor by tensor, before any tensor is read. A directory
that another process may replace while it is read (a training run's best/) is opened
once (`OpenDir`) and its files read relative to that handle. Every writer goes through
`atomic_write` or `open_to_write`, so that a crash never leaves a half-written file
under a real name and no write follows a symbolic link out of the directory it is for.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import stat
import struct
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError, GlassError

# The largest file of each kind that glassgpt reads, checked before a byte of it is parsed (read_limited):
# each limit is far above the largest real file of its kind, so that a file past it is not one.
#   kind          limit     what it covers (the largest real one)
FILE_LIMITS = {
    "config": 1 << 20,      # config.json, hparams.json, the book's .json beside a .pth, check --config (~1 KB)
    "tokenizer": 64 << 20,  # tokenizer.json (glassgpt's BPE ~1 MB; Qwen3's 11 MB), Llama 3's tokenizer.model (2 MB)
    "meta": 16 << 20,       # meta.json, train_state.json, a data cache's record, a run's config (kilobytes)
    "index": 64 << 20,      # model.safetensors.index.json (a 32B model's ~100 KB), TensorFlow's .index (18 KB)
    "header": 100 << 20,    # a safetensors file's JSON header: safetensors' own limit
}
FILE_KINDS = {"config": "a config JSON", "tokenizer": "a tokenizer file", "meta": "a meta or state JSON",
              "index": "an index of weights", "header": "a safetensors header"}
MAX_HEADER_BYTES = FILE_LIMITS["header"]
SAFETENSORS_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}


def too_big(label: str, size: int, kind: str) -> str:
    """The one line that refuses a file past its kind's limit (FILE_LIMITS), with both sizes."""
    return (f"{label} is {size:,} bytes, more than {FILE_KINDS[kind]} may be (at most {FILE_LIMITS[kind]:,} bytes): "
            "it is not the file it should be; check the path, or copy the file again")


def check_size(path: str | os.PathLike | DirFile, kind: str, error: type[GlassError] = CheckpointError,
               label: str | None = None) -> None:
    """Refuse `path` when its size on disk is past its kind's limit (FILE_LIMITS), before it is opened."""
    size = (path if isinstance(path, DirFile) else Path(path)).stat().st_size
    if size > FILE_LIMITS[kind]:
        raise error(too_big(label or str(path), size, kind))


def read_limited(path: str | os.PathLike | DirFile, kind: str, error: type[GlassError] = CheckpointError,
                 label: str | None = None) -> bytes:
    """The bytes of `path`, a file of `kind`: its size is checked before it is read, and no more than its
    limit is read (a file that grows meanwhile, a FIFO or device whose size says nothing, is refused)."""
    path = path if isinstance(path, DirFile) else Path(path)
    label = label or str(path)
    limit = FILE_LIMITS[kind]
    check_size(path, kind, error, label)
    with path.open("rb") if isinstance(path, DirFile) else _open_plain(path, error, label) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise error(f"{label} holds more than {limit:,} bytes, more than {FILE_KINDS[kind]} may be: it is not the "
                    "file it should be; check the path, or copy the file again")
    return data


def _open_plain(path: Path, error: type[GlassError], label: str) -> BinaryIO:
    """`path` opened to read, when it is a plain file: a FIFO or a device is refused, not waited on."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    mode_bits = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode_bits):
        os.close(fd)
        raise error(f"{label} is {path_kind(mode_bits)}, not a file: give the file itself")
    return os.fdopen(fd, "rb")


def read_json(path: str | os.PathLike | DirFile, error: type[GlassError] = CheckpointError,
              what: str = "", kind: str = "meta") -> dict[str, Any]:
    """The JSON object in `path`, a file of `kind` (FILE_LIMITS: its size checked before it is read); else one
    `error` that names the file (and `what` it is for)."""
    path = path if isinstance(path, DirFile) else Path(path)
    label = f"{path}{f' ({what})' if what else ''}"
    try:
        value = json.loads(read_limited(path, kind, error, label).decode("utf-8"))
    except FileNotFoundError:
        raise error(f"{label} does not exist") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise error(f"cannot read {label}: {str(e) or type(e).__name__}") from None
    if not isinstance(value, dict):
        raise error(f"{label} must hold a JSON object, not a {type(value).__name__}")
    return value


# --- a directory read as one, whatever happens to its path meanwhile ------------------------------

class OpenDir:
    """A directory opened once (O_DIRECTORY), whose files are opened relative to that handle
    (openat): a rename of its path while it is read, such as a training run putting a new best/
    in place, cannot mix the files of two saves. Messages still name the path. Files that are
    symbolic links are read through (a checkpoint may be links to files kept elsewhere).
    Where the OS has no openat (Windows), files are opened by path."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.fd = (os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
                   if os.open in os.supports_dir_fd else None)

    def __truediv__(self, name: str) -> DirFile:
        return DirFile(self, name)

    def __str__(self) -> str:
        return str(self.path)

    def identity(self) -> tuple[int, int]:
        """(device, inode) of the directory that was opened, to tell whether its path still names it."""
        st = os.fstat(self.fd) if self.fd is not None else os.stat(self.path)
        return st.st_dev, st.st_ino

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> OpenDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DirFile:
    """The file `name` of an OpenDir, read through the directory's handle; str() is its path."""

    def __init__(self, directory: OpenDir, name: str) -> None:
        self.dir, self.name = directory, name
        self.suffix = Path(name).suffix

    def __str__(self) -> str:
        return str(self.dir.path / self.name)

    def stat(self) -> os.stat_result:
        return os.stat(self.name, dir_fd=self.dir.fd) if self.dir.fd is not None else os.stat(self.dir.path / self.name)

    def is_file(self) -> bool:
        try:
            return stat.S_ISREG(self.stat().st_mode)
        except OSError:
            return False

    def open(self, mode: str = "rb") -> BinaryIO:
        """Opened to read, in binary; a FIFO or a device in the checkpoint's place is refused, not waited on."""
        assert mode == "rb", "a checkpoint's files are only read here"
        if self.dir.fd is None:
            return open(self.dir.path / self.name, "rb")
        fd = os.open(self.name, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), dir_fd=self.dir.fd)
        mode_bits = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode_bits):
            os.close(fd)
            raise CheckpointError(f"{self} is {path_kind(mode_bits)}, not a file: give a checkpoint of plain files")
        return os.fdopen(fd, "rb")

    def read_bytes(self) -> bytes:
        with self.open() as f:
            return f.read()


def path_kind(mode: int) -> str:
    """What a file's st_mode says it is, in words: 'a FIFO (named pipe)', 'a character device', ..."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a file"), (stat.S_ISLNK, "a symbolic link"),
             (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((words for test, words in kinds if test(mode)), "not a file")


def special_file(path: str | os.PathLike) -> str | None:
    """'a FIFO (named pipe)', 'a socket', 'a character device' or 'a block device' when `path`
    (followed through links) is one of those, else None (a file, a directory, or nothing there)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return None if stat.S_ISREG(mode) or stat.S_ISDIR(mode) else path_kind(mode)


# --- safetensors ------------------------------------------------------------------------------

def upgrade_name(name: str) -> str:
    """A tensor name of a checkpoint saved before glassgpt's LayerNorms took the book's names
    (`norm1.weight`/`.bias` -> `norm1.scale`/`.shift`, also in an optimizer's `NAME/exp_avg`);
    other names unchanged. Every reader of tensor files here applies it, so no caller needs to."""
    name, slash, field = name.partition("/")
    head, _, leaf = name.rpartition(".")
    if head.endswith(("norm1", "norm2", "final_norm")) and leaf in ("weight", "bias"):
        name = f"{head}.{'scale' if leaf == 'weight' else 'shift'}"
    return name + slash + field


def safetensors_shapes(path: Path | DirFile) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} from a safetensors file's header, after checking that the header
    fits in the file and that each tensor's data_offsets hold exactly its shape's bytes."""
    try:
        with path.open("rb") as f:
            return {upgrade_name(name): shape for name, shape in _header_shapes(f, path).items()}
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None


def _header_shapes(f: BinaryIO, path: Path | DirFile) -> dict[str, tuple[int, ...]]:
    """`safetensors_shapes` of the open file `f` (its size and header read from the same file)."""
    size = os.fstat(f.fileno()).st_size
    try:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is {size} bytes: too short for a safetensors file")
        n = struct.unpack("<Q", head)[0]  # the header's length, then the header, then the data
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointError(f"{path}: its first 8 bytes say the header is {n:,} bytes, but the file has "
                                  f"{size - 8:,} after them: it is truncated or not a safetensors file")
        header = json.loads(f.read(n).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: its header is not JSON ({e}): the file is corrupt") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: its header is not a JSON object: the file is corrupt")
    data_bytes = size - 8 - n
    return {name: _entry_shape(path, name, entry, data_bytes)
            for name, entry in header.items() if name != "__metadata__"}


def _entry_shape(path: Path | DirFile, name: str, entry: Any, data_bytes: int) -> tuple[int, ...]:
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


def read_safetensors(path: Path | DirFile) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a safetensors file, memory-mapped, read one at a time (so a check
    holds one tensor, not the file), after `safetensors_shapes` has checked its header. The
    file is opened once: the header checked and the tensors mapped are those of one file."""
    try:
        f = path.open("rb")
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    with f:
        try:
            _header_shapes(f, path)
            with safe_open(same_file(f, path), framework="pt", device="cpu") as tensors:
                for name in list(tensors.keys()):
                    yield upgrade_name(name), tensors.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{path} is truncated or corrupt ({e}): save or download it again") from None


def same_file(f: BinaryIO, path: Path | DirFile) -> str:
    """A path that opens the very file that `f` holds open, even if its name was replaced or removed
    since (Linux's /proc/self/fd, macOS's /dev/fd); elsewhere, `path` itself."""
    for fds in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(fds):
            return f"{fds}/{f.fileno()}"
    return str(path)


# --- a checkpoint directory's weights ---------------------------------------------------------

def weights_file(path: Path | OpenDir) -> Path | DirFile:
    """model.safetensors, else pytorch_model.bin, of a checkpoint directory."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).is_file():
            return path / name
    raise CheckpointError(f"{path} has config.json but no model.safetensors or pytorch_model.bin")


def tensor_shapes(path: Path | OpenDir) -> dict[str, tuple[int, ...]]:
    """{name: shape} of a checkpoint directory's weights, read without reading the tensors."""
    file = weights_file(path)
    if file.suffix == ".safetensors":
        return safetensors_shapes(file)
    return {name: tuple(t.shape) for name, t in _load_bin(file).items()}


def checkpoint_tensors(path: Path | OpenDir) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from model.safetensors (memory-mapped) or pytorch_model.bin."""
    file = weights_file(path)
    if file.suffix == ".safetensors":
        yield from read_safetensors(file)
    else:
        yield from _load_bin(file).items()


def _load_bin(file: Path | DirFile) -> dict[str, torch.Tensor]:
    try:
        with file.open("rb") as f:
            state = torch.load(same_file(f, file), map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # pickle errors come in many types; none may escape as a traceback
        raise CheckpointError(f"{file} cannot be read safely ({type(e).__name__}: {e}); "
                              "convert it to model.safetensors") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{file} holds a {type(state).__name__} of other things than tensors, "
                              "not a state dict: convert it to model.safetensors")
    return {upgrade_name(name): tensor for name, tensor in state.items()}


# --- writing: whole files, and never through a link ----------------------------------------------

def atomic_write(dest: Path, write: Callable[[str], Any], error: type[GlassError] = CheckpointError) -> None:
    """`write(tmp)` a temporary file beside `dest`, then rename it into place, with the permissions
    a plain open() would have given (mkstemp's are owner-only). A symbolic link at `dest` is refused
    (`error`): the rename would replace the link, and the caller meant the file it points to."""
    refuse_link(Path(dest), error)
    clean_leftovers(dest)
    tmp = str(temp_path(dest))
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~process_umask())
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# --- what a killed write leaves: .NAME.PID.XXXXXXXX.tmp beside NAME ---------------------------------

def temp_path(dest: Path, directory: bool = False) -> Path:
    """A new temporary file (or directory) beside `dest`, named `.NAME.PID.XXXXXXXX.tmp`: its name says
    what it is for and which process writes it, so that a later write can clean it once that process died."""
    if directory:
        return Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.{os.getpid()}.", suffix=".tmp"))
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.{os.getpid()}.", suffix=".tmp")
    os.close(fd)
    return Path(tmp)


def leftover_of(path: Path) -> tuple[str, int | None] | None:
    """(NAME, PID) when `path` is a temporary file or directory that a write of NAME made (PID None: one
    made before temporary names held the process id); else None."""
    name = Path(path).name
    if not (name.startswith(".") and name.endswith(".tmp")):
        return None
    parts = name[1:-4].split(".")
    if len(parts) >= 3 and parts[-2].isdigit() and _random_part(parts[-1]):
        return ".".join(parts[:-2]), int(parts[-2])
    if len(parts) >= 2 and _random_part(parts[-1]):
        return ".".join(parts[:-1]), None
    return None


def _random_part(text: str) -> bool:
    return len(text) == 8 and all(c.isalnum() or c == "_" for c in text)


def leftovers(dest: Path) -> list[Path]:
    """The temporary files and directories that writes of `dest` left beside it when their process was
    killed (kill -9, a power cut): those whose process no longer runs."""
    dest = Path(dest)
    try:
        candidates = list(dest.parent.glob(f".{glob_escape(dest.name)}.*.tmp"))
    except OSError:
        return []
    found = []
    for path in candidates:
        owner = leftover_of(path)
        if owner is not None and owner[0] == dest.name and not _running(owner[1]):
            found.append(path)
    return sorted(found)


def glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _running(pid: int | None) -> bool:
    if pid is None:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def refuse_leftover(path: Path) -> None:
    """One line when `path` (a model a reader passed) is a temporary file or directory a write left."""
    owner = leftover_of(path) if os.path.lexists(path) else None
    if owner is not None:
        raise CheckpointError(f"{path} is a temporary {'directory' if Path(path).is_dir() else 'file'} that a write "
                              f"of {owner[0]} left when it was interrupted, not a model: run that export again (it "
                              f"removes this), then pass {owner[0]}")


def clean_leftovers(dest: Path) -> list[Path]:
    """Remove what killed writes of `dest` left (see `leftovers`); returns what was removed."""
    removed = []
    for path in leftovers(dest):
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path)
        except FileNotFoundError:  # another write cleaned it first
            pass
    return removed


def refuse_link(path: Path, error: type[GlassError] = CheckpointError) -> None:
    """One `error` naming `path` when it is a symbolic link, where glassgpt is about to write."""
    if os.path.islink(path):
        raise error(f"{path} is a symbolic link (to {os.readlink(path)}): glassgpt never writes through a link, "
                    "so that no write leaves the directory it is for; remove the link, or give another directory")


def create_file(path: Path) -> BinaryIO:
    """A new file at `path`, opened to write in binary: exclusive (O_EXCL), so neither an earlier file
    nor a symbolic link there is ever written through (FileExistsError)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    return os.fdopen(os.open(path, flags, 0o666), "wb")


def open_to_write(path: Path, mode: str = "a", error: type[GlassError] = CheckpointError):
    """`open(path, mode)` ("a" or "a+", text) for a file written in place, created if missing. Refused
    with one `error` naming it: a symbolic link (O_NOFOLLOW: the link is never followed), a FIFO,
    device or socket, and a file with other names (a hard link would carry the write elsewhere)."""
    flags = os.O_CREAT | os.O_APPEND | (os.O_RDWR if "+" in mode else os.O_WRONLY)
    flags |= getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(path):
            refuse_link(path, error)
        raise
    st = os.fstat(fd)
    problem = (f"{path_kind(st.st_mode)}, not a file" if not stat.S_ISREG(st.st_mode) else
               f"a file with {st.st_nlink} names (hard links), so writing it would change the others"
               if st.st_nlink > 1 else None)
    if problem:
        os.close(fd)
        raise error(f"{path} is {problem}: glassgpt writes only plain files of its own there; remove it")
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return os.fdopen(fd, mode, encoding="utf-8")


def process_umask() -> int:
    """This process's umask, read without changing it (Linux's /proc), else the usual 022."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022

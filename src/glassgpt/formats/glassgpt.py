"""glassgpt's own checkpoint directory, both ways, and the one way a model is built from tensors.

    DIR/config.json         GPTConfig's fields (glassgpt's names), with the version that wrote it
    DIR/model.safetensors   the state dict (a tied head stored once, as tok_emb.weight)
    DIR/tokenizer.json      the tokenizer, when it is not GPT-2's
    DIR/meta.json           extra facts: label names, the training step, the data
    DIR/train_state.json    only in a training checkpoint (training/checkpoint.py): the loop's
                            state and the sha256 of every other file, checked before loading

A training run replaces best/ and latest/ while others read them (`serve --model RUN_DIR`
while it trains). `read_checkpoint` reads one whole: the directory is opened once and every
file read relative to it, a model's reader hashes the model's files only (not the optimizer's
moments), and a read that fails because a save replaced the directory meanwhile is made again.

`model_from_state` is the one way a model is built from tensors: each name and shape is checked
against the config (checks.expected_shapes, from a one-block model), then a GPTModel is built on
the meta device (checks.meta_model) and the tensors are assigned into it, so nothing is copied.
`assign_model` feeds it tensors read one at a time, each converted to the device and dtype as it
comes, so loading never holds two copies of the weights; every format (this one, Hugging Face's,
the book's, the TensorFlow folder, GGUF), every training checkpoint, LoRA's merge and the
classifier head go through it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

import torch
from safetensors.torch import save_file

from ..config import GPTConfig
from ..errors import CheckpointError, ConfigError, GlassError, TokenizerError
from ..families import FamilyConfig, Qwen3_5Config
from ..model import GPTModel
from ..tokenizer import Tokenizer, tokenizer_from_dict
from ..variants import config_from_dict as variant_config_from_dict
from ..version import __version__
from .checks import GLASSGPT, check_sizes, expected_shapes, meta_model
from .files import (DirFile, OpenDir, atomic_write, checkpoint_tensors, leftover_of, read_json, refuse_leftover, read_safetensors,
                    special_file, tensor_shapes, weights_file)
from .families import model_from_book_state
from .hf import HF, config_from_hf, hf_shapes, hf_to_glassgpt

# A run directory's checkpoints, in order of preference; `.NAME.old` is a complete checkpoint
# that a crash between the two renames of a save left (training/checkpoint.py), read without moving it.
CHECKPOINT_SUBDIRS = ("best", ".best.old", "latest", ".latest.old")
STATE_FORMAT = "glassgpt-train-state/1"
# What a reader of the model reads of a training checkpoint, and so all it hashes.
MODEL_FILES = ("config.json", "model.safetensors")
# How long a reader waits for a save under way: a 163M model's first save takes 7-20 s.
SAVE_WAIT_S = 30.0
T = TypeVar("T")


def resolve_checkpoint_dir(spec: str | os.PathLike) -> Path | None:
    """The directory that holds config.json for a local spec, or None if spec is not a local path."""
    path = Path(spec)
    refuse_leftover(path)
    moved = path.parent / f".{path.name}.old"
    if path.name in ("best", "latest"):
        for _ in range(3):  # a save swaps NAME and .NAME.old by renames while we look: look again
            if (path / "config.json").is_file():
                return path
            if (moved / "config.json").is_file():
                return moved  # a save between its two renames: the checkpoint before it, read where it is
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        for sub in CHECKPOINT_SUBDIRS:
            if (path / sub / "config.json").is_file():
                return path / sub
        temporary = sorted(p.name for p in path.iterdir() if leftover_of(p) is not None)
        if temporary:
            raise CheckpointError(f"{path} holds no config.json, only {', '.join(temporary[:2])}: what an export "
                                  "interrupted while it wrote here left; run the export again (it cleans them up)")
        raise CheckpointError(f"{path} holds no config.json (nor best/ or latest/ checkpoints): "
                              "pass a checkpoint directory or a run directory")
    if special_file(path):
        raise CheckpointError(f"{path} is {special_file(path)}, not a model file or directory: pass a checkpoint "
                              "or run directory, a .pth or a .gguf file")
    if path.exists():
        raise CheckpointError(f"{path} is a file: pass the directory that holds config.json and the weights")
    return None


def read_checkpoint(spec: str | os.PathLike, read: Callable[[OpenDir], T]) -> T:
    """`read(ckpt)` of the checkpoint directory that `spec` (a checkpoint or run directory) names,
    whole, while a training run may be saving over it: the directory is opened once and read
    through that handle. A read that fails while `spec` has come to name another directory (a
    save replaced it meanwhile) is made again, and a first save under way is waited for, both up
    to SAVE_WAIT_S; a read that fails on the directory `spec` still names is raised as it is."""
    deadline = time.monotonic() + SAVE_WAIT_S
    while True:
        try:
            return _read_once(spec, read)
        except _SaveUnderWay as e:
            if time.monotonic() > deadline:
                raise CheckpointError(f"{spec} was being saved while it was read, and no whole checkpoint was read "
                                      f"in {SAVE_WAIT_S:.0f} s (the last read: {e.error}): try again once the "
                                      "save is done") from None
        time.sleep(0.02)


class _SaveUnderWay(Exception):
    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _read_once(spec: str | os.PathLike, read: Callable[[OpenDir], T]) -> T:
    try:
        path = resolve_checkpoint_dir(spec)
    except CheckpointError as e:
        if any(Path(spec).glob(".*.tmp-*")):  # the run's first save, under way
            raise _SaveUnderWay(e) from None
        raise
    if path is None:
        raise CheckpointError(f"{spec}: no such file or directory")
    try:
        ckpt = OpenDir(path)
    except FileNotFoundError as e:  # removed between being found and being opened
        raise _SaveUnderWay(e) from None
    except OSError as e:
        raise CheckpointError(f"cannot read {path} ({e.strerror or e})") from None
    with ckpt:
        try:
            return read(ckpt)
        except (GlassError, OSError) as e:
            if _replaced(spec, ckpt):
                raise _SaveUnderWay(e) from None
            if isinstance(e, OSError):
                raise CheckpointError(f"cannot read {path}: {e.strerror or e} ({e.filename})") from None
            raise


def _replaced(spec: str | os.PathLike, ckpt: OpenDir) -> bool:
    """Whether `spec` now names another directory than `ckpt`, the one that was read."""
    try:
        now = resolve_checkpoint_dir(spec)
        st = os.stat(now) if now is not None else None
    except (GlassError, OSError):
        return True
    return st is None or (st.st_dev, st.st_ino) != ckpt.identity()


def read_checkpoint_file(spec: str | os.PathLike, name: str, read: Callable[[DirFile], T]) -> T | None:
    """`read(its file name)` of the checkpoint `spec` names, as `read_checkpoint` reads, checked against
    the sha256 that a training checkpoint recorded; None when it has no such file (trusted only while
    `spec` still names that directory: one being removed after a save loses its files one by one)."""
    def read_file(ckpt: OpenDir) -> T | None:
        if (ckpt / name).is_file():
            if (ckpt / "train_state.json").is_file():
                verify_checkpoint(ckpt, (name,))
            return read(ckpt / name)
        if _replaced(spec, ckpt):  # decided here, once: a second look may see another moment of the save
            raise _SaveUnderWay(CheckpointError(f"{ckpt}/{name} went away while it was read"))
        return None
    return read_checkpoint(spec, read_file)


def checkpoint_config(path: Path | OpenDir) -> tuple[GPTConfig, bool]:
    """(config, whether the tensors are in Hugging Face's layout) of a checkpoint directory,
    checked against its tensors' shapes (read from the header, not the tensors)."""
    raw = read_json(path / "config.json", kind="config")
    source = f"{path / 'config.json'}"
    shapes = tensor_shapes(path)
    weights = str(weights_file(path))
    if "n_embd" in raw or raw.get("model_type") == "gpt2":
        cfg = config_from_hf(raw, source)
        check_sizes(cfg, hf_shapes(shapes), HF, source, weights)
        return cfg, True
    cfg = config_from_values(raw, source)
    if not isinstance(cfg, FamilyConfig):  # a family's names and shapes are checked as its model is built
        check_sizes(cfg, shapes, GLASSGPT, source, weights)
    return cfg, False


def config_from_values(values: dict[str, Any], source: str, error: type[Exception] = CheckpointError) -> GPTConfig:
    """GPTConfig from glassgpt's own config.json fields (the book's names); errors name the file."""
    values = {k: v for k, v in values.items() if k != "glassgpt_version"}
    try:
        if "family" in values:  # a Qwen3, Llama 3 or Qwen3.5 model glassgpt trained or saved (families/)
            if values["family"] in ("qwen3", "llama3"):  # (a hand-written one may leave norm_eps: the book's)
                return FamilyConfig.from_book_dict(values["family"], values)
            return (Qwen3_5Config if values["family"] == "qwen3_5" else FamilyConfig).from_dict(values)
        return variant_config_from_dict(values) or GPTConfig.from_dict(values)  # chapter 4's variants (variants/)
    except ConfigError as e:
        raise error(f"{source}: {e}") from None


def read_config_file(path: str | os.PathLike) -> GPTConfig:
    """A config .json of glassgpt's fields (vocab_size, context_length, emb_dim, ...)."""
    return config_from_values(read_json(path, ConfigError, "a config file", kind="config"), str(path), ConfigError)


def read_tokenizer(path: str | os.PathLike | DirFile) -> Tokenizer:
    """A tokenizer saved with `Tokenizer.save` / a checkpoint's tokenizer.json."""
    return tokenizer_from_dict(read_json(path, TokenizerError, "a tokenizer file", kind="tokenizer"), source=str(path))


# meta.json's fields that glassgpt itself reads, and what each must be.
META_FIELDS = {"labels": (list, "a list of label names"), "finetune": (dict, "an object"), "data": (dict, "an object")}


def read_meta(path: Path | DirFile) -> dict[str, Any]:
    """meta.json, its fields that glassgpt reads checked for their kind."""
    meta = read_json(path)
    for key, (kind, what) in META_FIELDS.items():
        value = meta.get(key)
        if value is not None and not isinstance(value, kind):
            raise CheckpointError(f"{path}: {key} must be {what}, got {value!r}")
    if meta.get("labels") is not None and not all(isinstance(x, str) for x in meta["labels"]):
        raise CheckpointError(f"{path}: labels must be a list of strings, got {meta['labels']!r}")
    return meta


def load_checkpoint(spec: str | os.PathLike, device: torch.device, dtype: torch.dtype) -> GPTModel:
    """The model of the checkpoint that `spec` (a checkpoint or run directory) names, read whole."""
    return read_checkpoint(spec, lambda ckpt: _load_model(ckpt, device, dtype))


def _load_model(ckpt: OpenDir, device: torch.device, dtype: torch.dtype) -> GPTModel:
    if (ckpt / "train_state.json").is_file():  # a training checkpoint: its files' sha256, finite weights
        verify_checkpoint(ckpt, MODEL_FILES)
    cfg, hf_layout = checkpoint_config(ckpt)
    if isinstance(cfg, FamilyConfig):
        return model_from_book_state(cfg, dict(checkpoint_tensors(ckpt)), str(ckpt), device, dtype)
    if hf_layout:
        tensors = hf_to_glassgpt(checkpoint_tensors(ckpt), cfg)
    else:
        tensors = checkpoint_tensors(ckpt)
    return assign_model(cfg, tensors, device, dtype, source=str(ckpt))


# --- the one way a model is built from tensors ---------------------------------------------------

def check_tensor(name: str, shape: Iterable[int], expected: Mapping[str, torch.Size], source: str) -> None:
    if name not in expected:
        raise CheckpointError(f"{source}: unexpected tensor {name!r} {list(shape)} "
                              "that this config's model does not have")
    if tuple(shape) != tuple(expected[name]):
        raise CheckpointError(f"{source}: tensor {name!r} has shape {list(shape)} "
                              f"but the config needs {list(expected[name])}")


def model_from_state(cfg: GPTConfig, state: Mapping[str, torch.Tensor], source: str = "the state dict") -> GPTModel:
    """A GPTModel holding `state`'s tensors themselves, each name and shape checked: built on the
    meta device and assigned, so nothing is copied. A tied model's head is `tok_emb.weight`, so
    an `out_head.weight` in `state` is ignored. The model is left in training mode."""
    expected = expected_shapes(cfg)
    state = {k: v for k, v in state.items() if not (cfg.tie_embeddings and k == "out_head.weight")}
    for name, tensor in state.items():
        check_tensor(name, tensor.shape, expected, source)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{source}: tensor {missing[0]!r} {list(expected[missing[0]])} is missing "
                              f"({len(missing)} missing in all)")
    model = meta_model(cfg)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    return model


def assign_model(cfg: GPTConfig, tensors: Iterator[tuple[str, torch.Tensor]], device: torch.device,
                 dtype: torch.dtype, source: str) -> GPTModel:
    """`model_from_state` of tensors read one at a time, each checked before it is converted to
    `device` and `dtype`: peak memory stays near one copy of the weights. In eval mode."""
    expected = expected_shapes(cfg)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        check_tensor(name, tensor.shape, expected, source)
        state[name] = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None)
    return model_from_state(cfg, state, source).eval()


def save_model(model: GPTModel, path: str | os.PathLike, tokenizer: Tokenizer | None = None,
               meta: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint directory: config.json, model.safetensors, tokenizer.json, meta.json.

    Each file is written to a temporary name and renamed into place, so a crash
    never leaves a half-written file under a real name.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.tied:
        del state["out_head.weight"]  # the same tensor as tok_emb.weight; config.json says so
    atomic_write(path / "model.safetensors", lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    cfg = {"glassgpt_version": __version__, **model.cfg.to_dict()}
    atomic_write(path / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(cfg, indent=2)))
    file = getattr(tokenizer, "file", None)  # a model's own tokenizer.json or tokenizer.model: kept as it is
    if file is not None:
        data = Path(file).read_bytes()
        name = "tokenizer.model" if Path(file).suffix == ".model" else "tokenizer.json"
        atomic_write(path / name, lambda tmp: Path(tmp).write_bytes(data))
    elif tokenizer is not None:
        spec = json.dumps(tokenizer.to_dict(), ensure_ascii=False)
        atomic_write(path / "tokenizer.json", lambda tmp: Path(tmp).write_text(spec, encoding="utf-8"))
    if meta:
        atomic_write(path / "meta.json", lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2)))
    return path



def verify_checkpoint(path: str | os.PathLike | OpenDir, only: Sequence[str] | None = None) -> dict[str, Any]:
    """train_state.json of a complete checkpoint whose files match their sha256; else CheckpointError.
    `only`: check only those of its files (a reader of the model needs not hash the optimizer's)."""
    if not isinstance(path, OpenDir):
        if not Path(path).is_dir():
            raise CheckpointError(f"{path} is not a complete training checkpoint (no train_state.json): "
                                  "it was not finished being written")
        with OpenDir(path) as ckpt:
            return verify_checkpoint(ckpt, only)
    state_file = path / "train_state.json"
    if not state_file.is_file():
        raise CheckpointError(f"{path} is not a complete training checkpoint (no train_state.json): "
                              "it was not finished being written")
    state = read_json(state_file, what="this checkpoint cannot be resumed")
    if state.get("format") != STATE_FORMAT:
        raise CheckpointError(f"{state_file} has format {state.get('format')!r}, expected {STATE_FORMAT!r}")
    files = state.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise CheckpointError(f"{state_file}: files must map each file's name to its sha256, got {files!r:.80}")
    for name in files:  # names of files in this directory, never a path out of it
        if Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(f"{state_file}: files names {name!r}, which is not a file of this checkpoint")
    if not isinstance(state.get("step"), int) or isinstance(state["step"], bool) or state["step"] < 0:
        raise CheckpointError(f"{state_file}: step must be an integer >= 0, got {state.get('step')!r}")
    for name, digest in files.items():
        if only is not None and name not in only:
            continue
        try:
            actual = sha256(path / name)
        except FileNotFoundError:
            raise CheckpointError(f"{path}/{name} is missing: this checkpoint is incomplete") from None
        except OSError as e:
            raise CheckpointError(f"cannot read {path}/{name}: {e.strerror or e}") from None
        if actual != digest:
            raise CheckpointError(f"{path}/{name} is corrupt (its sha256 differs from the one recorded when "
                                  "it was saved): this checkpoint cannot be used")
    for name in ("model.safetensors", "train_model.safetensors"):
        # written by a version that saved a diverged run: refuse it by name
        if name in files and (only is None or name in only):
            bad = nonfinite_tensor(read_safetensors(path / name))
            if bad is not None:
                raise CheckpointError(f"{path}/{name}: tensor {bad!r} holds NaN or infinite values (training "
                                      "had diverged when it was saved): use an earlier checkpoint")
    return state


def nonfinite_tensor(tensors) -> str | None:
    """The name of the first floating-point tensor in (name, tensor) pairs that holds NaN or inf.

    Its smallest and largest values say it, in one read of the tensor: a NaN anywhere makes both NaN, an
    infinity is one of them. (`torch.isfinite(t).all()` also writes a bool per value: a check of the book's
    163M-parameter float32 model, made at every evaluation of a training run, took 0.86-0.97 s on one thread
    of an AMD EPYC against 0.04 s this way.)"""
    for name, t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t  # an FSDP shard: this rank's part
        if t.is_floating_point() and t.numel():
            low, high = torch.aminmax(t.detach())
            if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
                return name
    return None


def checkpoint_step(path: Path) -> int | None:
    """The step a complete checkpoint was saved at (from its train_state.json), or None."""
    try:
        step = read_json(path / "train_state.json").get("step")
    except CheckpointError:
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def sha256(path: Path | DirFile) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()

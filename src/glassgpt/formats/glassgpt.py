"""glassgpt's own checkpoint directory, both ways, and the one way a model is built from tensors.

    DIR/config.json         GPTConfig's fields (glassgpt's names), with the version that wrote it
    DIR/model.safetensors   the state dict (a tied head stored once, as tok_emb.weight)
    DIR/tokenizer.json      the tokenizer, when it is not GPT-2's
    DIR/meta.json           extra facts: label names, the training step, the data
    DIR/train_state.json    only in a training checkpoint (training/checkpoint.py): the loop's
                            state and the sha256 of every other file, checked before loading

`assign_model` builds a GPTModel on the meta device and assigns the given tensors into it
one at a time, checking each name and shape, so loading never holds two copies of the
weights; every format (this one, Hugging Face's, the book's, the TensorFlow folder) and
every training checkpoint goes through it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..config import GPTConfig, load_config
from ..errors import CheckpointError, ConfigError
from ..model import GPTModel
from ..tokenizer import Tokenizer
from ..version import __version__
from .files import atomic_write, checkpoint_tensors, read_json
from .hf import config_from_hf, hf_to_glassgpt

# A run directory's checkpoints, in order of preference; `.NAME.old` is a complete checkpoint
# that a crash between the two renames of a save left (training/checkpoint.py), read without moving it.
CHECKPOINT_SUBDIRS = ("best", ".best.old", "latest", ".latest.old")
STATE_FORMAT = "glassgpt-train-state/1"


def resolve_checkpoint_dir(spec: str | os.PathLike) -> Path | None:
    """The directory that holds config.json for a local spec, or None if spec is not a local path."""
    path = Path(spec)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        for sub in CHECKPOINT_SUBDIRS:
            if (path / sub / "config.json").is_file():
                return path / sub
        raise CheckpointError(f"{path} holds no config.json (nor best/ or latest/ checkpoints): "
                              "pass a checkpoint directory or a run directory")
    if path.exists():
        raise CheckpointError(f"{path} is a file: pass the directory that holds config.json and the weights")
    return None


def checkpoint_config(path: Path) -> tuple[GPTConfig, bool]:
    """(config, whether the tensors are in Hugging Face's layout) of a checkpoint directory."""
    raw = read_json(path / "config.json")
    if "n_embd" in raw or raw.get("model_type") == "gpt2":
        return config_from_hf(raw, path), True
    try:
        return load_config(path / "config.json"), False
    except ConfigError as e:
        raise CheckpointError(f"{path}/config.json is not a GPT-2 config: {e}") from None


def load_checkpoint(path: Path, device: torch.device, dtype: torch.dtype) -> GPTModel:
    if (path / "train_state.json").is_file():  # a training checkpoint: its files' sha256, finite weights
        verify_checkpoint(path)
    cfg, hf_layout = checkpoint_config(path)
    if hf_layout:
        tensors = hf_to_glassgpt(checkpoint_tensors(path), cfg)
    else:
        tensors = ((upgrade_name(name), t) for name, t in checkpoint_tensors(path))
    return assign_model(cfg, tensors, device, dtype, source=str(path))


def upgrade_name(name: str) -> str:
    """A tensor name of a checkpoint saved before glassgpt's LayerNorms took the book's names
    (`norm1.weight`/`.bias` -> `norm1.scale`/`.shift`); other names unchanged."""
    head, _, leaf = name.rpartition(".")
    if head.endswith(("norm1", "norm2", "final_norm")) and leaf in ("weight", "bias"):
        return f"{head}.{'scale' if leaf == 'weight' else 'shift'}"
    return name


def model_from_state(cfg: GPTConfig, state: dict[str, torch.Tensor]) -> GPTModel:
    """A GPTModel holding `state`'s tensors themselves: built on the meta device and
    assigned, so nothing is copied. A tied model's head is `tok_emb.weight`, so an
    `out_head.weight` in `state` is ignored. The model is left in training mode."""
    with torch.device("meta"):
        model = GPTModel(cfg)
    if model.tied:
        state = {k: v for k, v in state.items() if k != "out_head.weight"}
    model.load_state_dict(state, assign=True, strict=not model.tied)
    model.tie_weights()
    return model


def assign_model(cfg: GPTConfig, tensors: Iterator[tuple[str, torch.Tensor]], device: torch.device,
            dtype: torch.dtype, source: str) -> GPTModel:
    with torch.device("meta"):
        model = GPTModel(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if model.tied:
        expected.pop("out_head.weight")
    state: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name not in expected:
            raise CheckpointError(f"{source}: unexpected tensor {name!r} {list(tensor.shape)} "
                                  "that this config's model does not have")
        if tensor.shape != expected[name]:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {list(tensor.shape)} "
                                  f"but the config needs {list(expected[name])}")
        # One tensor converted at a time: peak memory stays near one copy of the weights.
        state[name] = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None)
    missing = sorted(set(expected) - set(state))
    if missing:
        name = missing[0]
        raise CheckpointError(f"{source}: tensor {name!r} {list(expected[name])} is missing "
                              f"({len(missing)} missing in all)")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    return model.eval()


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
    if tokenizer is not None:
        spec = json.dumps(tokenizer.to_dict(), ensure_ascii=False)
        atomic_write(path / "tokenizer.json", lambda tmp: Path(tmp).write_text(spec, encoding="utf-8"))
    if meta:
        atomic_write(path / "meta.json", lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2)))
    return path



def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """train_state.json of a complete checkpoint whose files match their sha256; else CheckpointError."""
    path = Path(path)
    state_file = path / "train_state.json"
    if not state_file.is_file():
        raise CheckpointError(f"{path} is not a complete training checkpoint (no train_state.json): "
                              "it was not finished being written")
    try:
        state = json.loads(state_file.read_text())
        files = state["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{state_file} is damaged ({e}): this checkpoint cannot be resumed") from None
    if state.get("format") != STATE_FORMAT:
        raise CheckpointError(f"{state_file} has format {state.get('format')!r}, expected {STATE_FORMAT!r}")
    for name, digest in files.items():
        if not (path / name).is_file():
            raise CheckpointError(f"{path}/{name} is missing: this checkpoint is incomplete")
        if sha256(path / name) != digest:
            raise CheckpointError(f"{path}/{name} is corrupt (its sha256 differs from the one recorded when "
                                  "it was saved): this checkpoint cannot be used")
    for name in ("model.safetensors", "train_model.safetensors"):
        if name in files:  # written by a version that saved a diverged run: refuse it by name
            bad = nonfinite_tensor(iter_tensors(path / name))
            if bad is not None:
                raise CheckpointError(f"{path}/{name}: tensor {bad!r} holds NaN or infinite values (training "
                                      "had diverged when it was saved): use an earlier checkpoint")
    return state


def nonfinite_tensor(tensors) -> str | None:
    """The name of the first floating-point tensor in (name, tensor) pairs that holds NaN or inf."""
    for name, t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t  # an FSDP shard: this rank's part
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def checkpoint_step(path: Path) -> int | None:
    """The step a complete checkpoint was saved at (from its train_state.json), or None."""
    try:
        step = json.loads((path / "train_state.json").read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def iter_tensors(path: Path):
    """(name, tensor) pairs read one at a time, so a check holds one tensor in memory, not the file."""
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{path} cannot be read ({e})") from None


"""glassgpt's own checkpoint directory, both ways, and the one way a model is built from tensors.

    DIR/config.json         GPTConfig's fields (glassgpt's names), with the version that wrote it
    DIR/model.safetensors   the state dict (a tied head stored once, as tok_emb.weight)
    DIR/tokenizer.json      the tokenizer, when it is not GPT-2's
    DIR/meta.json           extra facts: label names, the training step, the data
    DIR/train_state.json    only in a training checkpoint (training/checkpoint.py): the loop's
                            state and the sha256 of every other file, checked before loading

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
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch
from safetensors.torch import save_file

from ..config import GPTConfig
from ..errors import CheckpointError, ConfigError, TokenizerError
from ..model import GPTModel
from ..tokenizer import Tokenizer, tokenizer_from_dict
from ..version import __version__
from .checks import GLASSGPT, check_sizes, expected_shapes, meta_model
from .files import atomic_write, checkpoint_tensors, read_json, read_safetensors, tensor_shapes
from .hf import HF, config_from_hf, hf_shapes, hf_to_glassgpt

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
    """(config, whether the tensors are in Hugging Face's layout) of a checkpoint directory,
    checked against its tensors' shapes (read from the header, not the tensors)."""
    raw = read_json(path / "config.json")
    source = f"{path / 'config.json'}"
    shapes = tensor_shapes(path)
    weights = str(next(p for p in (path / "model.safetensors", path / "pytorch_model.bin") if p.is_file()))
    if "n_embd" in raw or raw.get("model_type") == "gpt2":
        cfg = config_from_hf(raw, source)
        check_sizes(cfg, hf_shapes(shapes), HF, source, weights)
        return cfg, True
    cfg = config_from_values(raw, source)
    check_sizes(cfg, {upgrade_name(k): v for k, v in shapes.items()}, GLASSGPT, source, weights)
    return cfg, False


def config_from_values(values: dict[str, Any], source: str, error: type[Exception] = CheckpointError) -> GPTConfig:
    """GPTConfig from glassgpt's own config.json fields (the book's names); errors name the file."""
    values = {k: v for k, v in values.items() if k != "glassgpt_version"}
    try:
        return GPTConfig.from_dict(values)
    except ConfigError as e:
        raise error(f"{source}: {e}") from None


def read_config_file(path: str | os.PathLike) -> GPTConfig:
    """A config .json of glassgpt's fields (vocab_size, context_length, emb_dim, ...)."""
    return config_from_values(read_json(path, ConfigError, "a config file"), str(path), ConfigError)


def read_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer saved with `Tokenizer.save` / a checkpoint's tokenizer.json."""
    return tokenizer_from_dict(read_json(path, TokenizerError, "a tokenizer file"), source=str(path))


# meta.json's fields that glassgpt itself reads, and what each must be.
META_FIELDS = {"labels": (list, "a list of label names"), "finetune": (dict, "an object"), "data": (dict, "an object")}


def read_meta(path: Path) -> dict[str, Any]:
    """meta.json, its fields that glassgpt reads checked for their kind."""
    meta = read_json(path)
    for key, (kind, what) in META_FIELDS.items():
        value = meta.get(key)
        if value is not None and not isinstance(value, kind):
            raise CheckpointError(f"{path}: {key} must be {what}, got {value!r}")
    if meta.get("labels") is not None and not all(isinstance(x, str) for x in meta["labels"]):
        raise CheckpointError(f"{path}: labels must be a list of strings, got {meta['labels']!r}")
    return meta


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
        if not (path / name).is_file():
            raise CheckpointError(f"{path}/{name} is missing: this checkpoint is incomplete")
        if sha256(path / name) != digest:
            raise CheckpointError(f"{path}/{name} is corrupt (its sha256 differs from the one recorded when "
                                  "it was saved): this checkpoint cannot be used")
    for name in ("model.safetensors", "train_model.safetensors"):
        if name in files:  # written by a version that saved a diverged run: refuse it by name
            bad = nonfinite_tensor(read_safetensors(path / name))
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
        step = read_json(path / "train_state.json").get("step")
    except CheckpointError:
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()

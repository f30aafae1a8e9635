"""Every file a reader brings, behind one `load_model(spec)`: the front door of glassgpt's formats.

`load_model(spec)` takes
  - a preset name (`gpt2`, `gpt2-medium`, ..., `gpt2-book`, ...): random weights, seeded;
  - a glassgpt checkpoint directory (glassgpt.py), or a training run directory holding
    `best/` or `latest/` checkpoints;
  - a directory in Hugging Face's GPT-2 layout (hf.py: `config.json` + `model.safetensors`,
    or `pytorch_model.bin`, read with `weights_only=True`: nothing is unpickled);
  - a hub id such as `openai-community/gpt2`, fetched with huggingface_hub and cached (hub.py);
  - the book's files: a state dict saved by its GPTModel (`model.pth`, book.py), or the
    OpenAI folder its gpt_download.py writes (`gpt2/124M/`, a TensorFlow checkpoint: openai.py);
  - a GGUF file in llama.cpp's GPT-2 layout (gguf.py), as `glassgpt export --format gguf` writes it;
  - Qwen3 and Llama 3.2 (families.py): a Hugging Face folder (Qwen3ForCausalLM, LlamaForCausalLM;
    sharded safetensors) or the book's .pth with its config .json; their glass models are
    glassgpt.families', not GPTModel, and their tokenizers family_tokenizers.py's.

Each reader checks its file before it builds anything from it (checks.py: the config's values,
the config against the tensors' shapes, in the file's own words), and every one of them ends in
`glassgpt.assign_model`, which checks every tensor's name and shape before the model is built.
Reading a file is this package's alone: `get_config` and `get_tokenizer` read the config and
tokenizer .json files that config.py and tokenizer.py, below this layer, never open.
"""

from __future__ import annotations

import difflib
import os
import re
import warnings
from pathlib import Path
from typing import Any, Iterator

import dataclasses

import torch
from torch import nn

from .. import config as _config, tokenizer as _tokenizer
from ..adopt import adopt
from ..config import PRESETS, GPTConfig, init_scheme
from ..device import resolve_device, resolve_dtype
from ..families import FAMILY_PRESETS, FamilyConfig, family_config, random_family_model
from ..errors import CheckpointError, ConfigError, RandomWeightsWarning
from ..model import GPTModel, init_name
from ..tokenizer import Tokenizer
from . import book, families, gguf, openai
from .checks import check_buildable, meta_model
from .glassgpt import (CHECKPOINT_SUBDIRS, assign_model, checkpoint_config, load_checkpoint, model_from_state,
                       read_checkpoint, read_checkpoint_file, read_config_file, read_meta, read_tokenizer,
                       resolve_checkpoint_dir, save_model)
from .files import leftovers, refuse_leftover, upgrade_name
from .hf import export_hf, hf_to_glassgpt
from .hub import download, try_download

__all__ = ["CHECKPOINT_SUBDIRS", "assign_model", "checkpoint_config", "checkpoint_dir", "download", "export_hf",
           "get_config", "get_tokenizer", "is_random_init", "load_checkpoint", "load_meta", "load_model",
           "load_tokenizer", "local_checkpoint_dir", "model_from_state", "random_model", "read_config",
           "resolve_checkpoint_dir", "save_model", "spec_kind", "upgrade_name"]

# What --model takes, for the one line that answers a spec that is none of them.
SPEC_KINDS = ("a checkpoint or run directory, the book's model.pth (any .pth state dict), its gpt2/124M "
              "folder, a .gguf file, or a Hugging Face id such as openai-community/gpt2")


def is_random_init(spec: str) -> bool:
    return spec in PRESETS or (str(spec).endswith(".json") and Path(spec).is_file())


def spec_kind(spec: Any) -> str:
    """Which kind of model `spec` names, the one dispatch every reader of specs goes through:
    "module" (an nn.Module in memory, read in place by adopt.py), "gguf" (a .gguf file),
    "random" (a preset or a config .json: random weights), "openai" (the book's gpt2/124M
    folder), "state_dict" (a .pth state dict such as the book's model.pth), or "checkpoint"
    (a glassgpt or Hugging Face directory, a run directory, or a hub id)."""
    if isinstance(spec, nn.Module):
        return "module"
    refuse_leftover(Path(spec))
    if gguf.is_gguf_file(spec):
        return "gguf"
    if is_random_init(str(spec)):
        return "random"
    if openai.is_openai_dir(spec):
        return "openai"
    return "state_dict" if book.is_state_dict_file(spec) else "checkpoint"


# The config fields a file's tensors fix; a config passed with a file must agree on each.
FIXED_BY_TENSORS = ("vocab_size", "context_length", "emb_dim", "n_layers", "qkv_bias", "tie_embeddings", "num_classes")


def load_model(spec: str | os.PathLike | nn.Module = "gpt2", device: str | torch.device | None = None,
               dtype: str | torch.dtype | None = None, seed: int = 0,
               config: GPTConfig | None = None, n_heads: int | None = None) -> GPTModel:
    """A GPTModel in eval mode from a preset, a local checkpoint, an HF directory, a hub id,
    the book's files, or an nn.Module in memory (read in place, on its own device and dtype).
    `n_heads` sets the head count of a book state dict (.pth), whose shapes cannot tell it
    (default: the JSON beside it, else GPT-2's 64 per head). `config` with a preset: random
    weights of that config; with a file: the file's weights, when the config fits them
    (FIXED_BY_TENSORS; its n_heads and drop_rate are used), else a ConfigError naming the field."""
    kind = spec_kind(spec)
    if kind == "module":
        return adopt(spec)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if families.is_family_spec(spec):  # Qwen3 or Llama 3.2 (families/): their own glass models
        if config is not None or n_heads is not None:
            raise ConfigError(f"{spec} is a Qwen3/Llama model whose config.json sets its own shapes: drop "
                              f"{'config=' if config is not None else 'n_heads (--n-heads)'}")
        return families.load_family(spec, dev, dt)
    spec = str(spec)
    _check_n_heads(spec, n_heads)
    if config is not None and kind != "random":
        return _load_with_config(spec, kind, config, dev, dt, n_heads)
    if config is not None:
        return random_model(config, dev, dt, seed)
    if kind == "gguf":
        cfg, tensors = gguf.read_gguf(spec)
        return assign_model(cfg, tensors, dev, dt, source=spec)
    if kind == "random":
        warnings.warn(f"{spec} has random weights (a preset, not trained): the shapes are real, the "
                      "probabilities and text are not. Load trained weights from a hub id such as "
                      "openai-community/gpt2 or from a checkpoint directory.", RandomWeightsWarning, stacklevel=2)
        return random_model(read_config(spec), dev, dt, seed, init_scheme(spec), source=spec)
    if kind in ("openai", "state_dict"):
        cfg, tensors = _book_source(spec, n_heads)
        return assign_model(cfg, tensors, dev, dt, source=spec)
    return load_checkpoint(checkpoint_dir(spec), dev, dt)


def _load_with_config(spec: str, kind: str, config: GPTConfig, dev: torch.device, dt: torch.dtype,
                      n_heads: int | None) -> GPTModel:
    """The file's own weights under `config`, or one line naming the first field they disagree on."""
    if n_heads is not None and n_heads != config.n_heads:
        raise ConfigError(f"n_heads is {n_heads} but the config says {config.n_heads}: give one of them")
    heads = config.n_heads if kind == "state_dict" else None  # a state dict's shapes cannot tell the head count
    file_cfg = read_config(spec, n_heads=heads)
    model = None
    if file_cfg is None:  # a hub id not fetched yet: its config comes with it
        model = load_model(spec, dev, dt)
        file_cfg = model.cfg
    for name in FIXED_BY_TENSORS + (() if kind == "state_dict" else ("n_heads",)):
        if getattr(file_cfg, name) != getattr(config, name):
            raise ConfigError(f"{spec} holds weights for {name} {getattr(file_cfg, name)!r} but the config says "
                              f"{getattr(config, name)!r}: fix the config's {name}, or drop config= to use the "
                              "file's own")
    model = model or load_model(spec, dev, dt, n_heads=heads)
    if config.drop_rate != model.cfg.drop_rate:  # not in the tensors: the config's is used
        model.cfg = dataclasses.replace(model.cfg, drop_rate=config.drop_rate)
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = config.drop_rate
    return model


def checkpoint_dir(spec: str | os.PathLike) -> Path:
    """The directory of a checkpoint spec: a local one as it is (a run directory too: its readers pick
    best/ or latest/ as they read), a hub id fetched into the cache."""
    spec = str(spec)
    if names_checkpoint(spec):
        return Path(spec)
    ckpt, where = None, ""
    if is_hub_id(spec):
        ckpt, reason = try_download(spec)
        where = (f" here or on the Hugging Face hub ({reason}): put its config.json and model.safetensors "
                 "in a directory and pass that, or")
    left = leftovers(Path(spec))
    if ckpt is None and left:
        raise CheckpointError(f"no model {spec!r}: beside it is only {left[0].name}, what an export or save of it "
                              "left when it was interrupted (its process is gone): run that export again")
    if ckpt is None:
        raise CheckpointError(f"no model {spec!r}{_near_miss(spec)}{where or ':'} use a preset "
                              f"({', '.join(PRESETS)}), {SPEC_KINDS}")
    return ckpt


def is_hub_id(spec: str) -> bool:
    """`owner/name` as the Hugging Face hub spells a repository; never a local-looking path or file name."""
    return (re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", spec) is not None
            and not spec.endswith((".pth", ".pt", ".bin", ".json", ".gguf", ".safetensors")))


def _near_miss(spec: str) -> str:
    """" (did you mean 'model.pth'?)" for a name one typo away from a file or folder beside it."""
    path = Path(spec)
    parent = path.parent if str(path.parent) else Path(".")
    try:
        names = [p.name for p in parent.iterdir()] if parent.is_dir() else []
    except OSError:
        return ""
    names += [name for name in PRESETS if parent == Path(".")]
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.8)
    if not close:
        return ""
    meant = str(parent / close[0]) if parent != Path(".") else close[0]
    return f" (did you mean {meant!r}?)"


def load_tokenizer(spec: str | os.PathLike = "gpt2") -> Tokenizer:
    """The tokenizer of a model spec: the one saved with a checkpoint (tokenizer.json), the OpenAI
    folder's or a GGUF file's own (each checked to be GPT-2's), else GPT-2's."""
    kind = spec_kind(spec)
    if families.is_family_spec(spec):
        return families.load_family_tokenizer(spec)
    if kind == "openai":
        return openai.openai_tokenizer(spec)
    if kind == "gguf":
        return gguf.gguf_tokenizer(spec)
    if names_checkpoint(spec):
        saved = read_checkpoint_file(spec, "tokenizer.json", read_tokenizer)
        if saved is not None:
            return saved
    return _tokenizer.get_tokenizer("gpt2")


def get_tokenizer(spec: str | os.PathLike = "gpt2", text: str | None = None) -> Tokenizer:
    """`"gpt2"`, `"char"` (with `text`), or the path of a saved tokenizer .json file."""
    if str(spec) not in ("gpt2", "char") and Path(spec).is_file():
        return read_tokenizer(spec)
    return _tokenizer.get_tokenizer(str(spec), text)


def get_config(spec: str | os.PathLike | GPTConfig, **overrides: Any) -> GPTConfig:
    """A preset by name, or a config from a JSON file, with field overrides applied (None: unchanged)."""
    if not isinstance(spec, (GPTConfig, FamilyConfig)) and str(spec) not in PRESETS and Path(spec).suffix == ".json":
        spec = read_config_file(spec)
    if isinstance(spec, FamilyConfig) or str(spec) in FAMILY_PRESETS:
        return _family_config(spec, overrides)
    return _config.get_config(spec if isinstance(spec, GPTConfig) else str(spec), **overrides)


def _family_config(spec: str | FamilyConfig, overrides: dict[str, Any]) -> FamilyConfig:
    """A Qwen3 or Llama 3 config (a preset or a config file's) with the overrides its fields take."""
    drop = overrides.pop("drop_rate", None)
    if drop:
        raise ConfigError(f"Qwen3 and Llama 3 have no dropout, so drop_rate {drop} cannot apply: drop --drop-rate")
    heads = overrides.get("n_heads")
    if heads is not None and overrides.get("n_kv_groups") is None:  # keep each group's share when it divides
        base = family_config(spec)
        overrides["n_kv_groups"] = base.n_kv_groups if heads % base.n_kv_groups == 0 else heads
    return family_config(spec, **overrides)


def load_meta(spec: str | os.PathLike) -> dict[str, Any]:
    """Extra facts saved with a checkpoint (label names, training step, ...), or {}."""
    if not names_checkpoint(spec):
        return {}
    return read_checkpoint_file(spec, "meta.json", read_meta) or {}


def class_labels(spec: str | os.PathLike) -> list[str] | None:
    """A classifier's class names: those its checkpoint records (meta.json), or those of
    `{"labels": [...]}` in the .json beside a .pth state dict; None if neither says."""
    labels = load_meta(spec).get("labels")
    if labels is None and book.is_state_dict_file(spec):
        labels = book.side_labels(spec)
    return labels


def local_checkpoint_dir(spec: str | os.PathLike) -> Path | None:
    """The local checkpoint directory a spec names, or None (a preset, config file, book file or hub id)."""
    if spec_kind(spec) != "checkpoint":
        return None
    return resolve_checkpoint_dir(spec)


def names_checkpoint(spec: str | os.PathLike) -> bool:
    """Whether `spec` is a local checkpoint or run directory: one that `read_checkpoint` reads (picking
    best/ or latest/ as it reads, and waiting for a run's first save under way)."""
    if spec_kind(spec) != "checkpoint":
        return False
    return Path(spec).is_dir() or resolve_checkpoint_dir(spec) is not None


def random_model(cfg: GPTConfig, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 init: str = "gpt2", source: str | None = None) -> GPTModel:
    """A GPTModel of `cfg` with random weights drawn by `init` (model.INIT_SCHEMES), in eval mode.

    The same seed gives the same weights whatever the RNG's state; "pytorch-default" draws on the CPU
    (as the book's code does) and then moves the weights to `device`. A config too big for this
    machine's memory is refused before anything is allocated."""
    if isinstance(cfg, FamilyConfig):  # Qwen3 or Llama 3: N(0, 0.02) matrices, norms at 1
        return random_family_model(cfg, seed, dtype, device)
    check_buildable(cfg, dtype, device, source or "the config")
    model = meta_model(cfg)
    model.to_empty(device="cpu" if init_name(init) == "pytorch-default" else device)
    model.tie_weights()
    model.reset_parameters(seed, init)
    return model.to(device=device, dtype=dtype).eval()


def read_config(spec: str | os.PathLike | nn.Module, n_heads: int | None = None) -> GPTConfig | None:
    """The GPTConfig that `load_model(spec, n_heads=n_heads)` would build, read without loading
    any weights (a preset, a config .json, a local checkpoint, or the book's files, whose
    tensors are only memory-mapped for their shapes); None for a hub id, whose config.json
    may not be here yet. Lets the CLI check flags against the model before loading it."""
    kind = spec_kind(spec)
    if kind == "module":
        return adopt(spec).cfg
    if families.is_family_spec(spec):
        return families.read_family_config(spec)
    if str(spec) in FAMILY_PRESETS:  # Qwen3 and Llama 3.2's sizes: for info, no weights
        return FAMILY_PRESETS[str(spec)]
    spec = str(spec)
    _check_n_heads(spec, n_heads)
    if kind == "random":
        return PRESETS[spec] if spec in PRESETS else read_config_file(spec)
    if kind == "gguf":
        return gguf.read_gguf(spec, tensors=False)[0]
    if kind == "openai":
        return openai.openai_config(spec)
    if kind == "state_dict":
        return book.config_from_state(book.read_state_dict(spec), spec, n_heads)
    if not names_checkpoint(spec):
        return None
    return read_checkpoint(spec, checkpoint_config)[0]


def _check_n_heads(spec: str, n_heads: int | None) -> None:
    if n_heads is not None and not book.is_state_dict_file(spec):
        raise ConfigError(f"n_heads (--n-heads) is for a state dict file such as model.pth, whose shapes "
                          f"cannot tell the head count; {spec!r} sets its own: drop it")


def _book_source(spec: str, n_heads: int | None) -> tuple[GPTConfig, Iterator[tuple[str, torch.Tensor]]]:
    """(config, glassgpt-named tensors) of the book's files: a state dict or the OpenAI folder."""
    if openai.is_openai_dir(spec):
        cfg = openai.openai_config(spec)
        return cfg, hf_to_glassgpt((openai.hf_name(name, w) for name, w in openai.openai_tensors(spec)), cfg)
    state = book.read_state_dict(spec)
    cfg = book.config_from_state(state, spec, n_heads)
    return cfg, book.glassgpt_tensors(state, cfg)


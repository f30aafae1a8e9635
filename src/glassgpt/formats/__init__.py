"""Every file a reader brings, behind one door: `open(spec)` resolves a spec once into a Source
(source.py) that knows its kind, config, notes, meta and checkpoint, and loads it; `load_model(spec)`
is `open(spec).load()`.

`open(spec)` takes
  - a preset name (`gpt2`, `gpt2-medium`, ..., `gpt2-book`, ...): random weights, seeded;
  - a glassgpt checkpoint directory (glassgpt.py), or a training run directory holding
    `best/` or `latest/` checkpoints (best/; a `--recipe book` run's final latest/: source.py);
  - a directory in Hugging Face's GPT-2 layout (hf.py: `config.json` + `model.safetensors`,
    or `pytorch_model.bin`, read with `weights_only=True`: nothing is unpickled);
  - a hub id such as `openai-community/gpt2` or `Qwen/Qwen3-0.6B`, fetched with huggingface_hub and cached
    (hub.py): its config.json first, which says the model, then only the files that model needs;
  - the book's files: a state dict saved by its GPTModel (`model.pth`, book.py), or the
    OpenAI folder its gpt_download.py writes (`gpt2/124M/`, a TensorFlow checkpoint: openai.py);
  - a GGUF file in llama.cpp's GPT-2 layout (gguf.py), as `glassgpt export --format gguf` writes it;
  - Qwen3 and Llama 3.2 (families.py): a Hugging Face folder (Qwen3ForCausalLM, LlamaForCausalLM;
    sharded safetensors) or the book's .pth with its config .json; their glass models are
    glassgpt.families', not GPTModel, and their tokenizers family_tokenizers.py's; their presets
    (`qwen3-0.6b`, ...) are their shapes with random weights.

Each reader checks its file before it builds anything from it (checks.py: the config's values,
the config against the tensors' shapes, in the file's own words), and every one of them ends in
`glassgpt.assign_model`, which checks every tensor's name and shape before the model is built.
Reading a file is this package's alone: `get_config` and `get_tokenizer` read the config and
tokenizer .json files that config.py and tokenizer.py, below this layer, never open.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from .. import config as _config, tokenizer as _tokenizer
from ..config import PRESETS, GPTConfig
from ..errors import CheckpointError, ConfigError
from ..families import FAMILY_CONFIGS, FAMILY_PRESETS, FamilyConfig, family_config, random_family_model
from ..model import GPTModel, init_name
from ..tokenizer import Tokenizer
from ..variants import VARIANTS, random_model as random_variant_model
from . import source as _source
from .checks import check_buildable, meta_model
from .glassgpt import (CHECKPOINT_SUBDIRS, assign_model, checkpoint_config, load_checkpoint, model_from_state,
                       read_checkpoint, read_config_file, read_tokenizer, resolve_checkpoint_dir, save_model)
from .files import leftovers, upgrade_name
from .hf import export_hf
from .hub import Repo, download, is_hub_id, try_fetch_config, try_fetch_files
from .source import FIXED_BY_TENSORS, About, Checkpoint, Note, Source, is_random_init, open  # noqa: A004
# (`open` is formats.open, left out of __all__ so that `from glassgpt.formats import *` keeps the builtin)

__all__ = ["About", "CHECKPOINT_SUBDIRS", "Checkpoint", "Note", "Source", "assign_model", "checkpoint_config",
           "checkpoint_dir", "download", "export_hf", "get_config", "get_tokenizer", "is_random_init", "load_checkpoint", "load_meta", "load_model",
           "load_tokenizer", "local_checkpoint_dir", "model_from_state", "random_model", "read_config",
           "resolve_checkpoint_dir", "save_model", "spec_kind", "upgrade_name"]

# What --model takes, for the one line that answers a spec that is none of them.
SPEC_KINDS = ("a checkpoint or run directory, the book's model.pth (any .pth state dict), its gpt2/124M "
              "folder, a .gguf file, or a Hugging Face id such as openai-community/gpt2")


def spec_kind(spec: Any) -> str:
    """Which kind of model `spec` names (source.resolve_kind): "module", "gguf", "random", "openai",
    "state_dict" or "checkpoint". A reader that goes on to read the model opens it once instead."""
    return _source.resolve_kind(spec)


def load_model(spec: str | os.PathLike | nn.Module = "gpt2", device: str | torch.device | None = None,
               dtype: str | torch.dtype | None = None, seed: int = 0,
               config: GPTConfig | None = None, n_heads: int | None = None) -> GPTModel:
    """A GPTModel in eval mode from a preset, a local checkpoint, an HF directory, a hub id,
    the book's files, or an nn.Module in memory (read in place, on its own device and dtype):
    `open(spec, n_heads=n_heads).load(device, dtype, seed=seed, config=config)`.
    `n_heads` sets the head count of a book state dict (.pth), whose shapes cannot tell it
    (default: the JSON beside it, else GPT-2's 64 per head). `config` with a preset: random
    weights of that config; with a file: the file's weights, when the config fits them
    (FIXED_BY_TENSORS; its n_heads and drop_rate are used), else a ConfigError naming the field."""
    return open(spec, n_heads=n_heads).load(device, dtype, seed=seed, config=config)


def checkpoint_dir(spec: str | os.PathLike | Source) -> Path:
    """The directory of a checkpoint spec: a local one (a run directory's best/, or a --recipe book run's
    latest/: source.py), a hub id fetched into the cache."""
    source = open(spec)
    return source.dir if source.is_local_checkpoint else fetch(source.name)


def fetch_repo(spec: str) -> Repo:
    """A hub id's config.json, fetched alone (hub.py: which model the repository holds, before any weights);
    else one line on what `spec` could have been (a typo beside it, an interrupted export's leftovers, the kinds
    --model takes)."""
    repo, reason = try_fetch_config(spec) if is_hub_id(spec) else (None, None)
    if repo is None:
        _no_model(spec, reason)
    return repo


def fetch(spec: str | Repo) -> Path:
    """The folder of a hub id's files in the cache: config.json, then the files its model needs (hub.REPO_FILES);
    else one line, as fetch_repo's."""
    repo = spec if isinstance(spec, Repo) else fetch_repo(spec)
    path, reason = try_fetch_files(repo)
    if path is None:
        _no_model(repo.repo_id, reason)
    return path


def _no_model(spec: str, hub_reason: str | None) -> NoReturn:
    where = "" if hub_reason is None else (f" here or on the Hugging Face hub ({hub_reason}): put its config.json "
                                           "and model.safetensors in a directory and pass that, or")
    left = leftovers(Path(spec))
    if left:
        raise CheckpointError(f"no model {spec!r}: beside it is only {left[0].name}, what an export or save of it "
                              "left when it was interrupted (its process is gone): run that export again")
    raise CheckpointError(f"no model {spec!r}{_near_miss(spec)}{where or ':'} use a preset "
                          f"({', '.join(PRESETS)}), {SPEC_KINDS}")


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


def load_tokenizer(spec: str | os.PathLike | Source = "gpt2") -> Tokenizer:
    """The tokenizer of a model spec (`open(spec).tokenizer()`): the one saved with a checkpoint
    (tokenizer.json), the OpenAI folder's or a GGUF file's own (each checked to be GPT-2's), else GPT-2's."""
    return open(spec).tokenizer()


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



def load_meta(spec: str | os.PathLike | Source) -> dict[str, Any]:
    """Extra facts saved with a checkpoint (label names, training step, ...), or {}: `open(spec).meta`."""
    return open(spec).meta


def class_labels(spec: str | os.PathLike | Source) -> list[str] | None:
    """A classifier's class names: those its checkpoint records (meta.json), or those of
    `{"labels": [...]}` in the .json beside a .pth state dict; None if neither says."""
    return open(spec).labels


def local_checkpoint_dir(spec: str | os.PathLike | Source) -> Path | None:
    """The local checkpoint directory a spec names (a run directory's best/, or a --recipe book run's
    latest/), or None (a preset, config file, book file or hub id)."""
    return open(spec).dir


def names_checkpoint(spec: str | os.PathLike | Source) -> bool:
    """Whether `spec` is a local checkpoint or run directory: one that `read_checkpoint` reads."""
    return open(spec).is_local_checkpoint


def random_model(cfg: GPTConfig, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 init: str = "gpt2", source: str | None = None) -> GPTModel:
    """A GPTModel of `cfg` with random weights drawn by `init` (model.INIT_SCHEMES), in eval mode (a family's
    config: its glass model, N(0, 0.02); a chapter-4 variant's: its glass model, PyTorch's defaults whatever `init`).

    The same seed gives the same weights whatever the RNG's state; "pytorch-default" draws on the CPU
    (as the book's code does) and then moves the weights to `device`. A config too big for this
    machine's memory is refused before anything is allocated."""
    check_buildable(cfg, dtype, device, source or "the config")
    if isinstance(cfg, FAMILY_CONFIGS):  # Qwen3, Llama 3, Gemma 3: N(0, 0.02) matrices, norms at 1
        return random_family_model(cfg, seed, dtype, device)
    if isinstance(cfg, tuple(VARIANTS)):  # chapter 4's variants: PyTorch's defaults, as the repository's scripts
        return random_variant_model(cfg, seed, dtype, device)
    model = meta_model(cfg)
    model.to_empty(device="cpu" if init_name(init) == "pytorch-default" else device)
    model.tie_weights()
    model.reset_parameters(seed, init)
    return model.to(device=device, dtype=dtype).eval()


def read_config(spec: str | os.PathLike | nn.Module | Source, n_heads: int | None = None) -> GPTConfig | None:
    """The GPTConfig that `load_model(spec, n_heads=n_heads)` would build, read without loading
    any weights (`open(spec).local_config()`); None for a hub id, whose config.json may not be here yet."""
    return open(spec, n_heads=n_heads).local_config()

"""A model, opened once: `formats.open(spec)` resolves what a `--model` string names, one time, into a
`Source` that every reader after it asks (the CLI, the web page, the Python API), so that nothing
below it dispatches on the string again.

    source = formats.open("model.pth", n_heads=4)
    source.kind, source.path        "state_dict", model.pth
    source.config                   read lazily: from the tensors, the JSON beside them, or the overrides
    source.notes()                  a Note for every value that was not read from the file itself
    source.checkpoint               a run directory's checkpoint: best/ or the final step, its step, its loss
    source.meta, .labels, .init, .trained, .classifier_reading(...), .about(...)
    source.load(device, dtype, quantize=...), source.tokenizer()

A run directory opens as `best/`, except a run made with `--recipe book`, which opens as its final
model (`latest/`), as the book's code ends with and saves; either way `checkpoint.line()` says which.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..adopt import adopt
from ..config import PRESETS, GPTConfig, init_scheme
from ..device import resolve_device, resolve_dtype
from ..errors import CheckpointError, ConfigError, RandomWeightsWarning, TokenizerError
from ..model import GPTModel
from ..prompt import Reading, classifier_reading
from ..tokenizer import Tokenizer, get_tokenizer
from ..families import FAMILY_PRESETS, FamilyConfig
from ..variants import VARIANTS
from . import book, families, gguf, openai
from .checks import check_buildable
from .family_tokenizers import check_vocabulary, tokenizer_file
from .files import read_json, refuse_leftover
from .glassgpt import (CHECKPOINT_SUBDIRS, assign_model, checkpoint_config, load_checkpoint, read_checkpoint,
                       read_checkpoint_file, read_config_file, read_meta, read_tokenizer, resolve_checkpoint_dir)
from .hf import hf_to_glassgpt
from .hub import PRESET_REPOS, Repo

# The config fields a file's tensors fix; a config passed with a file must agree on each.
FIXED_BY_TENSORS = ("vocab_size", "context_length", "emb_dim", "n_layers", "qkv_bias", "tie_embeddings", "num_classes")
QUANTIZED = ("int8", "int4")  # weight-only precisions: loaded in bfloat16, then quantized (engine/)
UNSEEN = "a state dict's shapes cannot tell the head count"


def is_random_init(spec: str) -> bool:
    """A preset (GPT-2's, the book's, or a Qwen3/Llama 3.2 size) or a config .json: random weights."""
    return spec in PRESETS or spec in FAMILY_PRESETS or (str(spec).endswith(".json") and Path(spec).is_file())


def resolve_kind(spec: Any) -> str:
    """Which kind of model `spec` names, the one dispatch on a spec: "module" (an nn.Module in memory,
    read in place by adopt.py), "gguf" (a .gguf file), "random" (a preset or a config .json: random
    weights), "openai" (the book's gpt2/124M folder), "family" (a Qwen3 or Llama 3.2 folder, or the book's
    .pth of one with its config beside it: formats/families.py), "state_dict" (a .pth state dict such as the
    book's model.pth), or "checkpoint" (a glassgpt or Hugging Face directory, a run directory, or a hub id:
    which model a hub id holds its config.json says, fetched when it is first needed, Source._repo)."""
    if isinstance(spec, nn.Module):
        return "module"
    refuse_leftover(Path(spec))
    if families.is_family_spec(spec):
        return "family"
    if gguf.is_gguf_file(spec):
        return "gguf"
    if is_random_init(str(spec)):
        return "random"
    if openai.is_openai_dir(spec):
        return "openai"
    return "state_dict" if book.is_state_dict_file(spec) else "checkpoint"


@dataclass(frozen=True)
class Note:
    """One config value that the file itself does not hold, where it came from instead. `assumed`:
    nothing said it (a rule or a default was used), so the numbers may be wrong; a command says so."""

    field: str
    value: Any
    reason: str
    assumed: bool = True

    def __str__(self) -> str:
        return f"{self.field} {self.value} {self.reason}"


@dataclass(frozen=True)
class Checkpoint:
    """Which checkpoint of a training run a source is: `name` "best" or "latest", at `step`, with the
    validation loss its run had measured last; `why` it was taken (a --recipe book run, or the only one)."""

    run: Path
    name: str
    path: Path
    step: int | None
    val_loss: float | None
    why: str
    other: tuple[str, int | None] | None = None  # the run's other checkpoint and its step

    def line(self) -> str:
        """'RUN opens as latest/, the final step 75, validation loss 0.4310 (...)': the first line a command prints."""
        step = "step ?" if self.step is None else f"step {self.step:,}"
        what = f"the final {step}" if self.name == "latest" else step
        loss = "no validation loss" if self.val_loss is None else f"validation loss {self.val_loss:.4f}"
        return f"{self.run} opens as {self.name}/, {what}, {loss} ({self.why})"


@dataclass(frozen=True)
class About:
    """What the weights cannot tell about a model: how to name it, where they came from, and how they are read."""

    name: str = "custom"
    random_weights: bool = False
    init: str | None = None        # a random model's initialisation: a key of model.INIT_SCHEMES
    labels: list[str] | None = None  # class names, for a classifier
    reading: Reading | None = None   # where a classifier reads a text, as its checkpoint records it was trained
    trained: dict[str, str] | None = None  # each part's "trained" / "frozen" / "lora" in its finetuning run
    notes: tuple[str, ...] = ()      # where config values came from that the file does not hold (Source.notes)


class Source:
    """A model spec resolved once (see the module docstring); build it with `formats.open`."""

    def __init__(self, spec: Any, *, n_heads: int | None = None, drop_rate: float | None = None,
                 context_length: int | None = None, tokenizer: str | None = None) -> None:
        self.kind = resolve_kind(spec)
        self.tokenizer_spec = None if tokenizer is None else str(tokenizer)  # --tokenizer: in place of the model's own
        if self.tokenizer_spec not in (None, "gpt2") and not Path(self.tokenizer_spec).is_file():
            raise TokenizerError(f"--tokenizer {self.tokenizer_spec}: no such file: give gpt2, a tokenizer.json or a "
                                 "tokenizer.model")
        self.module = spec if self.kind == "module" else None
        self.name = type(spec).__name__ if self.module is not None else str(spec)
        # The file or directory named (None: a module, a preset, or a hub id, whose fetched copy is `dir`).
        self.path = None if self.module is not None or self.name in PRESETS or not Path(self.name).exists() \
            else Path(self.name)
        self.n_heads, self.drop_rate, self.context_length = n_heads, drop_rate, context_length
        if self.kind == "family" and n_heads is not None:
            raise ConfigError(f"{self.name} is a Qwen3/Llama model whose config.json sets its own shapes: drop "
                              "n_heads (--n-heads)")
        if self.kind == "family" and drop_rate:
            raise ConfigError(f"Qwen3 and Llama 3 have no dropout, so drop_rate {drop_rate} cannot apply: drop "
                              "--drop-rate")
        if n_heads is not None and self.kind != "state_dict":
            raise ConfigError(f"n_heads (--n-heads) is for a state dict file such as model.pth, whose shapes "
                              f"cannot tell the head count; {self.name!r} sets its own: drop it")
        if drop_rate is not None and not 0 <= drop_rate < 1:
            raise ConfigError(f"drop_rate (--drop-rate) must be in [0, 1), got {drop_rate!r}")
        if context_length is not None and context_length < 1:
            raise ConfigError(f"context_length (--context-length) must be a positive integer, got {context_length!r}")

    def __repr__(self) -> str:
        return f"Source({self.name!r}, kind={self.kind!r})"

    # --- where the weights are ----------------------------------------------------------------

    @property
    def is_local_checkpoint(self) -> bool:
        """A checkpoint or run directory here (not a hub id to fetch)."""
        return self.kind == "checkpoint" and self._local_dir is not None

    @cached_property
    def _local_dir(self) -> Path | None:
        """The directory a local checkpoint spec names (a run directory: its checkpoint, see `checkpoint`)."""
        if self.kind != "checkpoint":
            return None
        path = Path(self.name)
        if path.is_dir():
            return self._run_checkpoint[0]
        return resolve_checkpoint_dir(path)

    @cached_property
    def _run_checkpoint(self) -> tuple[Path, Checkpoint | None]:
        return pick_checkpoint(Path(self.name))

    @property
    def checkpoint(self) -> Checkpoint | None:
        """For a run directory: the checkpoint it opens as (best/, or a --recipe book run's final model)."""
        if self.kind != "checkpoint" or not Path(self.name).is_dir():
            return None
        return self._run_checkpoint[1]

    @property
    def dir(self) -> Path | None:
        """The checkpoint directory a checkpoint spec resolves to (a run directory's best/ or latest/; a hub id's
        copy in the cache once fetched), or None (a preset, config file, book file, GGUF file, or module)."""
        return self._local_dir if self._local_dir is not None else self.__dict__.get("_fetched")

    @cached_property
    def _repo(self) -> Repo | None:
        """A hub id's repository, known by its config.json fetched alone, before any weights (hub.py); None for
        every other spec. A name that is nothing here or on the hub is answered in one line (formats.fetch_repo)."""
        if self.kind != "checkpoint" or self._local_dir is not None:
            return None
        from . import fetch_repo  # the hub's door, with its one-line answer for a name that is nothing
        return fetch_repo(self.name)

    @property
    def _hub_family(self) -> bool:
        """A hub id whose config.json names Qwen3ForCausalLM or LlamaForCausalLM (fetched to tell)."""
        return self._repo is not None and self._repo.family != "gpt2"

    @cached_property
    def _fetched(self) -> Path:
        """The directory of a checkpoint spec: a local one, or a hub id's files fetched into the cache (those
        its model needs: hub.REPO_FILES)."""
        from . import fetch
        return self._local_dir if self._local_dir is not None else fetch(self._repo)

    @property
    def _family_path(self) -> Path | str:
        """A Qwen3 or Llama model's folder or .pth: the spec's own, or a hub id's files fetched into the cache."""
        return self.name if self.kind == "family" else self._fetched

    # --- what it is -----------------------------------------------------------------------------

    @property
    def random_weights(self) -> bool:
        return self.kind == "random"

    @property
    def init(self) -> str | None:
        """A random model's initialisation scheme (model.INIT_SCHEMES); None for trained weights."""
        if not self.random_weights or self.name in FAMILY_PRESETS:
            return None
        return "pytorch-default" if isinstance(self.config, tuple(VARIANTS)) else init_scheme(self.name)

    @cached_property
    def _state(self) -> dict[str, torch.Tensor]:
        return book.read_state_dict(self.name)

    @cached_property
    def _side(self) -> tuple[dict[str, Any], Path | None]:
        return book.side_config(self.name) if self.kind == "state_dict" else ({}, None)

    @cached_property
    def config(self) -> GPTConfig:
        """The GPTConfig that `load()` builds, read without loading the weights (a book file's tensors are
        only memory-mapped for their shapes; a hub id is fetched), with the overrides applied."""
        if self.kind == "module":
            return adopt(self.module).cfg
        if self.kind == "family":
            return families.read_family_config(self.name)
        if self.name in FAMILY_PRESETS:  # Qwen3 and Llama 3.2's sizes, random weights
            return FAMILY_PRESETS[self.name]
        if self._hub_family:  # from its config.json alone: the memory is checked before the weights are fetched
            return families.config_from_hf(self._repo.raw, f"{self.name}'s config.json")
        if self.kind == "random":
            cfg = PRESETS[self.name] if self.name in PRESETS else read_config_file(self.name)
            given = {"drop_rate": self.drop_rate, "context_length": self.context_length}
            return dataclasses.replace(cfg, **{k: v for k, v in given.items() if v is not None})
        if self.kind == "gguf":
            cfg = gguf.read_gguf(self.name, tensors=False)[0]
        elif self.kind == "openai":
            cfg = openai.openai_config(self.name)
        elif self.kind == "state_dict":
            cfg = book.config_from_state(self._state, self.name, self.n_heads)
        else:
            cfg = read_checkpoint(self._fetched, checkpoint_config)[0]
        if self.context_length is not None and self.context_length > cfg.context_length:
            raise ConfigError(f"--context-length {self.context_length} is longer than the context_length "
                              f"{cfg.context_length} that {self.name}'s weights hold: give at most "
                              f"{cfg.context_length}")
        if self.drop_rate is not None:
            cfg = dataclasses.replace(cfg, drop_rate=self.drop_rate)
        return cfg

    def local_config(self) -> GPTConfig | None:
        """`config`, or None for a hub id not fetched: a command checks its flags with it before a slow load."""
        if self.kind == "checkpoint" and self._local_dir is None and "_fetched" not in self.__dict__ \
                and not ("_repo" in self.__dict__ and self._hub_family):
            return None
        return self.config

    def config_before_weights(self) -> GPTConfig | FamilyConfig | None:
        """`local_config()`, or a Qwen3 or Llama hub id's config read from its config.json alone (fetched, the
        cache first), so that a command checks the memory before the weights are downloaded; None for a GPT-2
        hub id, whose config is read with its weights."""
        cfg = self.local_config()
        if cfg is None and self._hub_family:
            return self.config
        return cfg

    def notes(self) -> list[Note]:
        """Where each config value that the file does not hold came from: a state dict's head count and dropout,
        the OpenAI folder's head count. Those with `assumed` set came from a rule or a default."""
        cfg = self.config
        if self.kind == "openai":
            return [Note("n_heads", cfg.n_heads, "from hparams.json", assumed=False)]
        if self.kind != "state_dict":
            return []
        side, side_path = self._side
        path = Path(self.name)
        if self.n_heads is not None:
            heads = Note("n_heads", cfg.n_heads, f"as given with --n-heads ({UNSEEN})", assumed=False)
        elif "n_heads" in side:
            heads = Note("n_heads", cfg.n_heads, f"from {side_path.name} beside the weights ({UNSEEN})", assumed=False)
        else:
            heads = Note("n_heads", cfg.n_heads, f"by GPT-2's rule, {book.GPT2_HEAD_DIM} per head ({UNSEEN}; pass "
                                                 "--n-heads if the model was built with another)")
        if self.drop_rate is not None:
            drop = Note("drop_rate", cfg.drop_rate, "as given with --drop-rate (a state dict cannot record dropout)",
                        assumed=False)
        elif "drop_rate" in side:
            drop = Note("drop_rate", cfg.drop_rate, f"from {side_path.name} beside the weights (a state dict cannot "
                                                    "record dropout)", assumed=False)
        else:
            drop = Note("drop_rate", cfg.drop_rate,
                        f"is assumed: a state dict cannot record dropout (the book trains with 0.1); pass --drop-rate "
                        f"P, or put {{\"n_heads\": {cfg.n_heads}, \"drop_rate\": 0.1}} in "
                        f"{path.with_suffix('.json').name} beside it, to train with dropout")
        return [heads, drop]

    def config_origin(self) -> str | None:
        """Where a Qwen3 or Llama model's config came from (which JSON, which values assumed); None for the others,
        whose `notes()`, checkpoint line or random-weights note say it."""
        return families.config_origin(self.name) if self.kind == "family" else None

    def assumed(self, field: str) -> bool:
        """Whether `field`'s value was assumed (a Note with `assumed` set names it)."""
        return any(n.field == field and n.assumed for n in self.notes())

    @cached_property
    def meta(self) -> dict[str, Any]:
        """Extra facts saved with a checkpoint (label names, training step, ...), or {}."""
        if not self.is_local_checkpoint:
            return {}
        return read_checkpoint_file(self._local_dir, "meta.json", read_meta) or {}

    @cached_property
    def labels(self) -> list[str] | None:
        """A classifier's class names: those its checkpoint records (meta.json), or those of `{"labels": [...]}`
        in the .json beside a .pth state dict; None if neither says."""
        labels = self.meta.get("labels")
        if labels is None and self.kind == "state_dict":
            labels = book.side_labels(self.name)
        return labels

    @property
    def trained(self) -> dict[str, str] | None:
        """Which parts its finetuning run trained, froze or adapted (meta.json's "trained")."""
        return self.meta.get("trained")

    @property
    def finetune(self) -> dict[str, Any]:
        """How its finetuning run was made (meta.json's "finetune"), or {}."""
        return self.meta.get("finetune") or {}

    def classifier_reading(self, padded: bool = False, length: int | None = None) -> tuple[Reading, list[str]]:
        """(reading, notes): how this classifier reads a text, as its checkpoint records it was finetuned, or
        with `padded` (--recipe book) [and `length`] as the book's classify_review reads it (prompt.py)."""
        if length is not None and not padded and "padded_length" not in self.finetune:
            raise ConfigError("--max-length is --recipe book's (the length the book padded to): drop it, or add "
                              "--recipe book")
        return classifier_reading(self.finetune, padded, length)

    def about(self, reading: Reading | None = None, labels: list[str] | None = None) -> About:
        """What a trace, the page and the comparison say of this model that its weights cannot."""
        return About(self.name, self.random_weights, self.init, labels if labels is not None else self.labels,
                     reading if reading is not None else self.classifier_reading()[0], self.trained,
                     tuple(str(n) for n in self.notes()))

    # --- loading ---------------------------------------------------------------------------------

    def load(self, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
             quantize: str | None = None, seed: int = 0, config: GPTConfig | None = None) -> GPTModel:
        """The GPTModel in eval mode. dtype "int8"/"int4" (or `quantize`): loaded in bfloat16, then its
        weights quantized (engine/). A module in memory is read in place, on its own device and dtype.
        `config` with a preset: random weights of that config; with a file: the file's weights, when
        the config fits them (FIXED_BY_TENSORS; its n_heads and drop_rate are used)."""
        if self.kind == "module":
            return adopt(self.module)
        if isinstance(dtype, str) and dtype in QUANTIZED:
            quantize, dtype = dtype, "bfloat16"
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        model = self._load(dev, dt, seed, config)
        if quantize is not None:
            from ..engine import quantize_int4, quantize_int8
            if quantize not in QUANTIZED:
                raise ConfigError(f"quantize must be one of {', '.join(QUANTIZED)}, got {quantize!r}")
            model = (quantize_int8 if quantize == "int8" else quantize_int4)(model)
        return model

    def _load(self, dev: torch.device, dt: torch.dtype, seed: int, config: GPTConfig | None) -> GPTModel:
        from . import random_model
        if self.kind == "family" or self._hub_family:  # Qwen3 or Llama 3.2 (families/): their own glass models
            if config is not None:
                raise ConfigError(f"{self.name} is a Qwen3/Llama model whose config.json sets its own shapes: drop "
                                  "config=")
            if self.drop_rate:
                raise ConfigError(f"Qwen3 and Llama 3 have no dropout, so drop_rate {self.drop_rate} cannot apply: "
                                  "drop --drop-rate")
            if self._hub_family and "_fetched" not in self.__dict__:  # before its weights are downloaded
                check_buildable(self.config, dt, dev, self.name)
            return families.load_family(self._family_path, dev, dt)
        if config is not None and self.kind == "random":
            return random_model(config, dev, dt, seed)
        if config is not None:
            return self._load_with_config(config, dev, dt)
        if self.kind == "random":
            warnings.warn(self._random_warning(), RandomWeightsWarning, stacklevel=4)
            return random_model(self.config, dev, dt, seed, self.init, source=self.name)
        if self.kind == "gguf":
            cfg, tensors = gguf.read_gguf(self.name)
            model = assign_model(cfg, tensors, dev, dt, source=self.name)
        elif self.kind == "openai":
            cfg = self.config
            tensors = hf_to_glassgpt((openai.hf_name(n, w) for n, w in openai.openai_tensors(self.name)), cfg)
            model = assign_model(cfg, tensors, dev, dt, source=self.name)
        elif self.kind == "state_dict":
            cfg = self.config
            model = assign_model(cfg, book.glassgpt_tensors(self._state, cfg), dev, dt, source=self.name)
        else:
            model = load_checkpoint(self._fetched, dev, dt)
        if self.drop_rate is not None:  # no tensor holds it: the override is the model's
            model = with_drop_rate(model, self.drop_rate)
        return model

    def _random_warning(self) -> str:
        if self.name in FAMILY_PRESETS:
            repo = PRESET_REPOS[self.name]
            return (f"{self.name} has random weights (a preset, not trained): every shape and weight matrix is "
                    f"{repo}'s, the probabilities and text are not, and the prompt is read with GPT-2's tokenizer "
                    f"(glassgpt ships none of Qwen3's or Llama's). Load {repo} (a hub id) or its folder for its "
                    "weights and tokenizer.")
        return (f"{self.name} has random weights (a preset, not trained): the shapes are real, the probabilities "
                "and text are not. Load trained weights from a hub id such as openai-community/gpt2 or from a "
                "checkpoint directory.")

    def _load_with_config(self, config: GPTConfig, dev: torch.device, dt: torch.dtype) -> GPTModel:
        """The file's own weights under `config`, or one line naming the first field they disagree on."""
        if self.n_heads is not None and self.n_heads != config.n_heads:
            raise ConfigError(f"n_heads is {self.n_heads} but the config says {config.n_heads}: give one of them")
        if self.kind == "state_dict":  # a state dict's shapes cannot tell the head count: the config's is used
            file_cfg = book.config_from_state(self._state, self.name, config.n_heads)
        else:
            file_cfg = self.config
        for name in FIXED_BY_TENSORS + (() if self.kind == "state_dict" else ("n_heads",)):
            if getattr(file_cfg, name) != getattr(config, name):
                raise ConfigError(f"{self.name} holds weights for {name} {getattr(file_cfg, name)!r} but the config "
                                  f"says {getattr(config, name)!r}: fix the config's {name}, or drop config= to use "
                                  "the file's own")
        if self.kind == "state_dict":
            model = assign_model(file_cfg, book.glassgpt_tensors(self._state, file_cfg), dev, dt, source=self.name)
        else:
            model = self._load(dev, dt, 0, None)
        return with_drop_rate(model, config.drop_rate)

    def tokenizer(self) -> Tokenizer:
        """The tokenizer given (`tokenizer=`, --tokenizer: checked against the model's vocabulary), else the one
        saved with a checkpoint (tokenizer.json), the OpenAI folder's or a GGUF file's own (each checked to be
        GPT-2's), a Qwen3 or Llama model's own beside its weights, else GPT-2's."""
        if self.tokenizer_spec is not None:
            tokenizer = read_tokenizer_spec(self.tokenizer_spec)
            check_vocabulary(tokenizer, self.config.vocab_size, f"--tokenizer {self.tokenizer_spec}")
            return tokenizer
        if self.kind == "family" or self._hub_family:
            return families.load_family_tokenizer(self._family_path)
        if self.kind == "openai":
            return openai.openai_tokenizer(self.name)
        if self.kind == "gguf":
            return gguf.gguf_tokenizer(self.name)
        if self.is_local_checkpoint:  # glassgpt's tokenizer.json, a model's own tokenizer.json, or tokenizer.model
            for name in ("tokenizer.json", "tokenizer.model"):
                saved = read_checkpoint_file(self._local_dir, name, _saved_tokenizer)
                if saved is not None:
                    if getattr(saved, "file", None) is not None:  # a model's own file: its ids fit this model?
                        check_vocabulary(saved, self.config.vocab_size, f"{self.name}'s {name}")
                    return saved
        return get_tokenizer("gpt2")


def _saved_tokenizer(file) -> Tokenizer:
    """A checkpoint's tokenizer file, by what it holds: glassgpt's own .json, or a copy of the model's file."""
    if file.suffix == ".json" and "model" not in read_json(file, TokenizerError, "a tokenizer file", kind="tokenizer"):
        return read_tokenizer(file)
    return tokenizer_file(str(file))


def read_tokenizer_spec(spec: str) -> Tokenizer:
    """What --tokenizer names: "gpt2", a tokenizer .json that glassgpt saved (`glassgpt tokenizer train`, a
    checkpoint's), a Hugging Face tokenizer.json (Qwen3's) or a tokenizer.model (Llama 3's), told by its content."""
    if str(spec) == "gpt2":
        return get_tokenizer("gpt2")
    path = Path(spec)
    if path.suffix == ".json" and "model" not in read_json(path, TokenizerError, "a tokenizer file", kind="tokenizer"):
        return read_tokenizer(path)
    return tokenizer_file(path)


def with_drop_rate(model: GPTModel, drop_rate: float) -> GPTModel:
    """`model` with its config's drop_rate and every nn.Dropout set to `drop_rate` (no tensor holds it)."""
    if model.cfg.drop_rate != drop_rate:
        model.cfg = dataclasses.replace(model.cfg, drop_rate=drop_rate)
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = drop_rate
    return model


def pick_checkpoint(path: Path) -> tuple[Path, Checkpoint | None]:
    """(the checkpoint directory a run directory opens as, what it is): best/, or the final latest/ of a run
    made with --recipe book, or the only one there is. A checkpoint directory itself: (path, None). A run
    with no checkpoint yet: (path, None), for `read_checkpoint` to wait on its first save or say so."""
    if (path / "config.json").is_file():
        return path, None
    # Named best/ or latest/ even when only .NAME.old is there (a save between its two renames): read_checkpoint
    # resolves the name at each read, so a save that replaces it meanwhile is read again, never half.
    found = {name: path / name.strip(".").removesuffix(".old") for name in CHECKPOINT_SUBDIRS
             if (path / name / "config.json").is_file()}
    best = found.get("best") or found.get(".best.old")
    latest = found.get("latest") or found.get(".latest.old")
    if best is None and latest is None:
        return path, None
    facts = {name: _train_facts(ckpt) for name, ckpt in (("best", best), ("latest", latest)) if ckpt is not None}
    book_run = any(meta_recipe == "book" for meta_recipe, _, _ in facts.values())
    if latest is not None and (book_run or best is None):
        name, chosen = "latest", latest
        why = ("a --recipe book run: its final model, as the book's code ends with and saves it"
               if book_run else "it has no best/")
    else:
        name, chosen = "best", best
        why = "the run's best validation loss" if latest is not None else "it has no latest/"
    _, step, loss = facts[name]
    other_name = "best" if name == "latest" else "latest"
    other = (other_name, facts[other_name][1]) if other_name in facts else None
    if other is not None and other[1] is not None:
        why += f"; {other_name}/ is step {other[1]:,}"
    return chosen, Checkpoint(path, name, chosen, step, loss, why, other)


def _train_facts(ckpt: Path) -> tuple[str | None, int | None, float | None]:
    """(recipe, step, last validation loss) a training checkpoint's meta.json records; Nones if it does not."""
    try:
        meta = read_checkpoint_file(ckpt, "meta.json", read_meta) or {}
    except CheckpointError:
        return None, None, None
    train = meta.get("train") if isinstance(meta.get("train"), dict) else {}
    made = meta.get("finetune") or meta.get("data") or {}
    recipe = made.get("recipe") if isinstance(made, dict) else None
    step = train.get("step") if isinstance(train.get("step"), int) else None
    loss = train.get("val_loss") if isinstance(train.get("val_loss"), (int, float)) else None
    return recipe, step, loss


def open(spec: Any = "gpt2", *, n_heads: int | None = None, drop_rate: float | None = None,
         context_length: int | None = None, tokenizer: str | None = None) -> Source:
    """The model `spec` names, resolved once: a preset, a config .json, a checkpoint or run directory, a Hugging
    Face directory or hub id, the book's .pth or gpt2/124M folder, a .gguf file, or an nn.Module in memory.
    `n_heads`: a state dict's head count, which its shapes cannot tell (else the JSON beside it, else GPT-2's
    rule, said in a Note); `drop_rate`: the dropout to build with; `context_length`: a preset's, or at most
    a file's own; `tokenizer`: "gpt2" or a tokenizer file, read in place of the model's own."""
    if isinstance(spec, Source):
        return spec
    return Source(spec, n_heads=n_heads, drop_rate=drop_rate, context_length=context_length, tokenizer=tokenizer)

"""Loading and saving weights: glassgpt checkpoints, Hugging Face GPT-2 layout, the hub.

`load_model(spec)` takes
  - a preset name (`gpt2`, `gpt2-medium`, ...): random GPT-2 initialisation, seeded;
  - a glassgpt checkpoint directory (`config.json` with glassgpt's field names,
    `model.safetensors`, optionally `tokenizer.json` and `meta.json`), or a training
    run directory holding `best/` or `latest/` checkpoints;
  - a directory in Hugging Face GPT-2 layout (`config.json` + `model.safetensors`, or
    `pytorch_model.bin`, read with `weights_only=True`: nothing is unpickled);
  - a hub id such as `openai-community/gpt2`, fetched with huggingface_hub and cached;
  - the book's files (book.py): a state dict saved by its GPTModel (`model.pth`), or the
    OpenAI folder its gpt_download.py writes (`gpt2/124M/`, a TensorFlow checkpoint).

Hugging Face's names and its Conv1D layout (weights stored [in, out], the transpose
of nn.Linear's [out, in]; query/key/value fused in one `c_attn`) appear only in the
mapping below. The model is built on the meta device and the loaded tensors are
assigned into it, so loading never holds two copies of the weights.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from . import __version__, book
from .config import PRESETS, GPTConfig, load_config
from .device import resolve_device, resolve_dtype
from .errors import CheckpointError, ConfigError
from .model import GPTModel
from .tokenizer import Tokenizer, get_tokenizer, tokenizer_from_file

# A run directory's checkpoints, in order of preference; `.NAME.old` is a complete checkpoint
# that a crash between the two renames of a save left (checkpoint.py), read without moving it.
CHECKPOINT_SUBDIRS = ("best", ".best.old", "latest", ".latest.old")


# --- resolving a spec -------------------------------------------------------------

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


class RandomWeightsWarning(UserWarning):
    """`load_model` built a preset (or a config file) with random weights, not trained ones."""


def is_random_init(spec: str) -> bool:
    return spec in PRESETS or (str(spec).endswith(".json") and Path(spec).is_file())


def load_model(spec: str | os.PathLike = "gpt2", device: str | torch.device | None = None,
               dtype: str | torch.dtype | None = None, seed: int = 0,
               config: GPTConfig | None = None, n_heads: int | None = None) -> GPTModel:
    """A GPTModel in eval mode from a preset, a local checkpoint, an HF directory, a hub id,
    or the book's files. `n_heads` sets the head count of a book state dict (.pth), whose
    shapes cannot tell it (default: the JSON beside it, else GPT-2's 64 per head)."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    spec = str(spec)
    _check_n_heads(spec, n_heads)
    if config is not None:
        return random_model(config, dev, dt, seed)
    if is_random_init(spec):
        warnings.warn(f"{spec} has random weights (a preset, not trained): the shapes are real, the "
                      "probabilities and text are not. Load trained weights from a hub id such as "
                      "openai-community/gpt2 or from a checkpoint directory.", RandomWeightsWarning, stacklevel=2)
        return random_model(read_config(spec), dev, dt, seed)
    if book.is_book_spec(spec):
        cfg, tensors = _book_source(spec, n_heads)
        return _assign(cfg, tensors, dev, dt, source=spec)
    return load_checkpoint(checkpoint_dir(spec), dev, dt)


def checkpoint_dir(spec: str | os.PathLike) -> Path:
    """The directory of a checkpoint spec: a local one as it is, a hub id fetched into the cache."""
    spec = str(spec)
    ckpt = resolve_checkpoint_dir(spec)
    if ckpt is None:
        if "/" not in spec or spec.startswith((".", "/")):
            raise CheckpointError(
                f"no model {spec!r}: use a preset ({', '.join(PRESETS)}), a checkpoint directory, "
                "or a Hugging Face id such as openai-community/gpt2")
        ckpt = download(spec)
    return ckpt


def load_tokenizer(spec: str | os.PathLike = "gpt2") -> Tokenizer:
    """The tokenizer saved with a checkpoint (tokenizer.json), the OpenAI folder's own
    (checked to be GPT-2's), else GPT-2's."""
    if book.is_openai_dir(spec):
        return book.openai_tokenizer(spec)
    ckpt = local_checkpoint_dir(spec)
    if ckpt is not None and (ckpt / "tokenizer.json").is_file():
        return tokenizer_from_file(ckpt / "tokenizer.json")
    return get_tokenizer("gpt2")


def load_meta(spec: str | os.PathLike) -> dict[str, Any]:
    """Extra facts saved with a checkpoint (label names, training step, ...), or {}."""
    ckpt = local_checkpoint_dir(spec)
    if ckpt is None or not (ckpt / "meta.json").is_file():
        return {}
    return _read_json(ckpt / "meta.json")


def local_checkpoint_dir(spec: str | os.PathLike) -> Path | None:
    """The local checkpoint directory a spec names, or None (a preset, config file, book file or hub id)."""
    if is_random_init(str(spec)) or book.is_book_spec(spec):
        return None
    return resolve_checkpoint_dir(spec)


def random_model(cfg: GPTConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> GPTModel:
    with torch.device("meta"):
        model = GPTModel(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    model.reset_parameters(seed)  # same seed, same weights, whatever the device's RNG state
    return model.to(dtype).eval()


# --- reading ----------------------------------------------------------------------

def read_config(spec: str | os.PathLike, n_heads: int | None = None) -> GPTConfig | None:
    """The GPTConfig that `load_model(spec, n_heads=n_heads)` would build, read without loading
    any weights (a preset, a config .json, a local checkpoint, or the book's files, whose
    tensors are only memory-mapped for their shapes); None for a hub id, whose config.json
    may not be here yet. Lets the CLI check flags against the model before loading it."""
    spec = str(spec)
    _check_n_heads(spec, n_heads)
    if spec in PRESETS:
        return PRESETS[spec]
    if is_random_init(spec):
        return load_config(spec)
    if book.is_openai_dir(spec):
        return book.openai_config(spec)
    if book.is_state_dict_file(spec):
        return book.config_from_state(book.read_state_dict(spec), spec, n_heads)
    ckpt = resolve_checkpoint_dir(spec)
    return _checkpoint_config(ckpt)[0] if ckpt is not None else None


def _checkpoint_config(path: Path) -> tuple[GPTConfig, bool]:
    """(config, whether the tensors are in Hugging Face's layout) of a checkpoint directory."""
    raw = _read_json(path / "config.json")
    if "n_embd" in raw or raw.get("model_type") == "gpt2":
        return config_from_hf(raw, path), True
    try:
        return load_config(path / "config.json"), False
    except ConfigError as e:
        raise CheckpointError(f"{path}/config.json is not a GPT-2 config: {e}") from None


def load_checkpoint(path: Path, device: torch.device, dtype: torch.dtype) -> GPTModel:
    if (path / "train_state.json").is_file():  # a training checkpoint: its files' sha256, finite weights
        from .checkpoint import verify_checkpoint  # (checkpoint.py builds on this module)
        verify_checkpoint(path)
    cfg, hf_layout = _checkpoint_config(path)
    if hf_layout:
        tensors = _hf_to_glassgpt(_read_tensors(path), cfg)
    else:
        tensors = ((upgrade_name(name), t) for name, t in _read_tensors(path))
    return _assign(cfg, tensors, device, dtype, source=str(path))


def _check_n_heads(spec: str, n_heads: int | None) -> None:
    if n_heads is not None and not book.is_state_dict_file(spec):
        raise ConfigError(f"n_heads (--n-heads) is for a state dict file such as model.pth, whose shapes "
                          f"cannot tell the head count; {spec!r} sets its own: drop it")


def _book_source(spec: str, n_heads: int | None) -> tuple[GPTConfig, Iterator[tuple[str, torch.Tensor]]]:
    """(config, glassgpt-named tensors) of the book's files: a state dict or the OpenAI folder."""
    if book.is_openai_dir(spec):
        cfg = book.openai_config(spec)
        return cfg, _hf_to_glassgpt((_openai_to_hf(name, w) for name, w in book.openai_tensors(spec)), cfg)
    state = book.read_state_dict(spec)
    cfg = book.config_from_state(state, spec, n_heads)
    return cfg, book.glassgpt_tensors(state, cfg)


def upgrade_name(name: str) -> str:
    """A tensor name of a checkpoint saved before glassgpt's LayerNorms took the book's names
    (`norm1.weight`/`.bias` -> `norm1.scale`/`.shift`); other names unchanged."""
    head, _, leaf = name.rpartition(".")
    if head.endswith(("norm1", "norm2", "final_norm")) and leaf in ("weight", "bias"):
        return f"{head}.{'scale' if leaf == 'weight' else 'shift'}"
    return name


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return value


def _read_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
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


def _assign(cfg: GPTConfig, tensors: Iterator[tuple[str, torch.Tensor]], device: torch.device,
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


# --- Hugging Face layout ----------------------------------------------------------

def config_from_hf(raw: dict, source: Path | str = "config.json") -> GPTConfig:
    if raw.get("model_type", "gpt2") != "gpt2":
        raise CheckpointError(f"{source} is a {raw['model_type']!r} model; glassgpt loads GPT-2 only")
    act = raw.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise CheckpointError(f"{source} uses activation {act!r}; glassgpt's GPT-2 uses the tanh GELU")
    # Switches of GPT2Config that change the maths; loading them as plain GPT-2 would be silently wrong.
    for field, gpt2_value in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                              ("layer_norm_epsilon", 1e-5)):
        if raw.get(field, gpt2_value) != gpt2_value:
            raise CheckpointError(f"{source} sets {field}={raw[field]!r}; glassgpt's GPT-2 needs "
                                  f"{gpt2_value!r}: this checkpoint is a GPT-2 variant it cannot run")
    try:
        return GPTConfig(
            vocab_size=raw["vocab_size"], context_length=raw["n_positions"], emb_dim=raw["n_embd"],
            n_heads=raw["n_head"], n_layers=raw["n_layer"], drop_rate=0.0, qkv_bias=True,
            tie_embeddings=raw.get("tie_word_embeddings", True),
        )
    except KeyError as e:
        raise CheckpointError(f"{source} lacks the GPT-2 field {e.args[0]!r}") from None


def config_to_hf(cfg: GPTConfig) -> dict:
    if cfg.num_classes is not None:
        raise CheckpointError("a classification model has no Hugging Face GPT2LMHeadModel layout; "
                              "save it with save_model instead")
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.context_length, "n_ctx": cfg.context_length,
        "n_embd": cfg.emb_dim, "n_head": cfg.n_heads, "n_layer": cfg.n_layers, "n_inner": None,
        "layer_norm_epsilon": 1e-5, "tie_word_embeddings": cfg.tie_embeddings,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "bos_token_id": min(50256, cfg.vocab_size - 1), "eos_token_id": min(50256, cfg.vocab_size - 1), "torch_dtype": "float32",
    }


def _hf_names(cfg: GPTConfig) -> list[tuple[str, str, Callable, Callable]]:
    """(hf name, glassgpt name, hf->glassgpt, glassgpt->hf) for every tensor except c_attn.

    Conv1D stores [in, out]; nn.Linear stores [out, in]: hence the transposes.
    """
    same = (lambda w: w, lambda w: w)
    transpose = (lambda w: w.t().contiguous(), lambda w: w.t().contiguous())
    table = [("wte.weight", "tok_emb.weight", *same), ("wpe.weight", "pos_emb.weight", *same),
             ("ln_f.weight", "final_norm.scale", *same), ("ln_f.bias", "final_norm.shift", *same)]
    for i in range(cfg.n_layers):
        h, g = f"h.{i}.", f"trf_blocks.{i}."
        table += [
            (h + "ln_1.weight", g + "norm1.scale", *same), (h + "ln_1.bias", g + "norm1.shift", *same),
            (h + "ln_2.weight", g + "norm2.scale", *same), (h + "ln_2.bias", g + "norm2.shift", *same),
            (h + "attn.c_proj.weight", g + "att.out_proj.weight", *transpose),
            (h + "attn.c_proj.bias", g + "att.out_proj.bias", *same),
            (h + "mlp.c_fc.weight", g + "ff.layers.0.weight", *transpose),
            (h + "mlp.c_fc.bias", g + "ff.layers.0.bias", *same),
            (h + "mlp.c_proj.weight", g + "ff.layers.2.weight", *transpose),
            (h + "mlp.c_proj.bias", g + "ff.layers.2.bias", *same),
        ]
    return table


def _openai_to_hf(name: str, w: torch.Tensor) -> tuple[str, torch.Tensor]:
    """OpenAI's TensorFlow names are Hugging Face's, spelled differently, and its convolution
    weights carry a leading 1: model/h0/attn/c_attn/w [1, d, 3d] -> h.0.attn.c_attn.weight [d, 3d];
    model/wte -> wte.weight; g/b (LayerNorm gain/bias) -> weight/bias."""
    parts = name.removeprefix("model/").split("/")
    if re.fullmatch(r"h\d+", parts[0]):
        parts[0] = f"h.{parts[0][1:]}"
    if parts[-1] in ("wte", "wpe"):
        parts.append("weight")
    else:
        parts[-1] = {"w": "weight", "g": "weight", "b": "bias"}.get(parts[-1], parts[-1])
    if parts[-1] == "weight" and w.dim() == 3 and w.shape[0] == 1:
        w = w[0]  # [1, in, out] -> Conv1D's [in, out]
    return ".".join(parts), w


def _hf_to_glassgpt(tensors: Iterator[tuple[str, torch.Tensor]], cfg: GPTConfig) -> Iterator[tuple[str, torch.Tensor]]:
    table = {hf: (ours, to_ours) for hf, ours, to_ours, _ in _hf_names(cfg)}
    for name, w in tensors:
        name = name.removeprefix("transformer.")
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # causal-mask buffers of old HF checkpoints, not weights
        if name == "lm_head.weight":
            if not cfg.tie_embeddings:
                yield "out_head.weight", w
            continue
        if name.endswith(".attn.c_attn.weight") or name.endswith(".attn.c_attn.bias"):
            # c_attn fuses query, key and value: [d, 3d] (Conv1D) -> three [d, d] Linear weights.
            prefix = "trf_blocks." + name.split(".")[1] + ".att."
            kind = name.rsplit(".", 1)[1]
            want = [cfg.emb_dim, 3 * cfg.emb_dim] if kind == "weight" else [3 * cfg.emb_dim]
            if list(w.shape) != want:
                raise CheckpointError(f"tensor {name!r} has shape {list(w.shape)} but the config needs {want}")
            for part, chunk in zip(("W_query", "W_key", "W_value"), w.split(cfg.emb_dim, dim=-1)):
                yield prefix + part + "." + kind, chunk.t().contiguous() if kind == "weight" else chunk.clone()
            continue
        if name not in table:
            raise CheckpointError(f"unexpected tensor {name!r} {list(w.shape)} in a GPT-2 checkpoint")
        ours, to_ours = table[name]
        yield ours, to_ours(w)


def hf_state_dict(model: GPTModel) -> dict[str, torch.Tensor]:
    """The model's weights under GPT2LMHeadModel's names and layouts."""
    cfg, sd = model.cfg, model.state_dict()
    out = {"transformer." + hf: to_hf(sd[ours]) for hf, ours, _, to_hf in _hf_names(cfg)}
    for i in range(cfg.n_layers):
        g = f"trf_blocks.{i}.att."
        out[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat(
            [sd[g + p + ".weight"] for p in ("W_query", "W_key", "W_value")], dim=0).t().contiguous()
        if cfg.qkv_bias:
            out[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat(
                [sd[g + p + ".bias"] for p in ("W_query", "W_key", "W_value")])
        else:
            out[f"transformer.h.{i}.attn.c_attn.bias"] = torch.zeros(3 * cfg.emb_dim, dtype=sd[g + "W_query.weight"].dtype)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["out_head.weight"]
    return {k: v.detach().contiguous().cpu() for k, v in out.items()}


def export_hf(model: GPTModel, path: str | os.PathLike) -> Path:
    """Write `path/config.json` + `path/model.safetensors` that transformers' GPT2LMHeadModel loads."""
    path = Path(path)
    cfg = config_to_hf(model.cfg)  # refuses a classifier before anything is written
    path.mkdir(parents=True, exist_ok=True)
    _atomic_write(path / "model.safetensors", lambda tmp: save_file(hf_state_dict(model), tmp, metadata={"format": "pt"}))
    _atomic_write(path / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(cfg, indent=2)))
    return path


# --- writing glassgpt checkpoints ---------------------------------------------------

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
    _atomic_write(path / "model.safetensors", lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    cfg = {"glassgpt_version": __version__, **model.cfg.to_dict()}
    _atomic_write(path / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(cfg, indent=2)))
    if tokenizer is not None:
        spec = json.dumps(tokenizer.to_dict(), ensure_ascii=False)
        _atomic_write(path / "tokenizer.json", lambda tmp: Path(tmp).write_text(spec, encoding="utf-8"))
    if meta:
        _atomic_write(path / "meta.json", lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2)))
    return path


def _atomic_write(dest: Path, write: Callable[[str], Any]) -> None:
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


# --- the hub ----------------------------------------------------------------------

def download(repo_id: str, progress: bool = True) -> Path:
    """Fetch a GPT-2 checkpoint (config.json + weights) from the Hugging Face hub into its cache."""
    hint = (f"put config.json and model.safetensors of {repo_id} in a directory "
            "and pass that directory as --model")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError(f"fetching {repo_id!r} needs huggingface_hub (pip install 'glassgpt[hub]'), or {hint}") from None
    if not progress:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    patterns = ["config.json", "model.safetensors"]
    last_error: Exception | None = None
    for local_only in (True, False):  # the cache first: no network needed for what is already here
        try:
            path = Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=local_only))
        except Exception as e:  # offline, unknown repo, auth: all end in the same one-line advice
            last_error = e
            continue
        if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
            return path
    reason = type(last_error).__name__ if last_error else "no model.safetensors in the repository"
    raise CheckpointError(f"could not fetch {repo_id!r} from the Hugging Face hub ({reason}; no network?): {hint}")

"""The book's own files, both ways: what its `GPTModel` saves, the OpenAI folder its
`gpt_download.py` writes, and the `cfg` dict its code builds a model from.

- A state dict file (`model.pth` from chapter 5, `model_and_optimizer.pth` with its
  `{"model_state_dict": ...}`, chapter 6's `review_classifier.pth`, chapter 7's
  `gpt2-medium355M-sft.pth`, the converted `gpt2-small-124M.pth`, ...). Its tensor names are
  glassgpt's, since model.py took the book's, except the causal-mask buffers
  `trf_blocks.N.att.mask`, which glassgpt builds on the fly. The config comes from the
  shapes; the head count, which no shape shows, follows GPT-2's rule (64 per head) unless
  `n_heads` is given or a JSON file beside the weights (`model.json` beside `model.pth`,
  or `config.json`) holds `n_heads`. Read with `torch.load(weights_only=True)` only.
- The OpenAI folder (`gpt2/124M/`) is openai.py's. Which kind a spec is ("state_dict", "openai", ...)
  is formats.open's to say, once (source.py); where each assumed value came from is its Source's notes().
- Back to the book: `book_state_dict(model)` and `book_cfg(cfg)`, for `glassgpt export --format pth`.
"""

from __future__ import annotations

import dataclasses
import pickle
import re
from pathlib import Path
from typing import Any, Iterator

import torch

from ..config import PRESETS, GPTConfig
from ..errors import CheckpointError, ConfigError
from ..memory import parameter_counts
from ..model import GPTModel
from .checks import field, meta_model
from .files import read_json

GPT2_HEAD_DIM = 64  # every GPT-2 size has heads of 64: the rule for a head count that shapes cannot tell
BOOK_CFG_KEYS = ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers", "drop_rate", "qkv_bias")


# --- which spec is a state dict ---------------------------------------------------------------

def is_state_dict_file(spec: str | Path) -> bool:
    """A file that is not a config .json: a state dict saved with torch.save. (A preset's
    name stays a preset, whatever lies in the working directory.)"""
    path = Path(spec)
    return str(spec) not in PRESETS and path.is_file() and path.suffix not in (".json", ".gguf")


# --- state dicts ----------------------------------------------------------------------------

def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a .pth file (or of its "model_state_dict" entry), memory-mapped.
    Nothing but tensors is ever unpickled, and every name must be one of the book's GPTModel."""
    path = Path(path)
    obj = _torch_load(path)
    if isinstance(obj, dict) and isinstance(obj.get("model_state_dict"), dict):
        obj = obj["model_state_dict"]  # model_and_optimizer.pth: the optimizer's state is not needed
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        keys = list(obj)[:5] if isinstance(obj, dict) else type(obj).__name__
        raise CheckpointError(f"{path} holds no state dict (found {keys}): save one with "
                              "torch.save(model.state_dict(), path)")
    from .families import untold_config  # the book's Qwen3 or Llama: named, with what its tensors cannot tell
    if (line := untold_config(obj, path)) is not None:
        raise CheckpointError(line)
    expected = _book_names()
    for name in obj:
        if re.sub(r"^trf_blocks\.\d+\.", "trf_blocks.N.", name) not in expected:
            raise CheckpointError(f"{path}: unexpected key {name!r} for the book's GPTModel, which has "
                                  "tok_emb.weight, pos_emb.weight, trf_blocks.N.att.W_query.weight, ..., "
                                  "final_norm.scale, out_head.weight: this state dict is another architecture's")
    return obj


def _torch_load(path: Path) -> Any:
    last: Exception | None = None
    for mmap in (True, False):  # mmap needs torch.save's zip format; a legacy file loads whole
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as e:
            if "global" not in str(e).lower():  # not code: bytes that are no pickle at all
                last = e
                continue
            found = re.search(r"global:? GLOBAL ([\w.]+)", str(e))
            what = f" (it refers to {found.group(1)})" if found else ""
            raise CheckpointError(f"{path} holds pickled code or objects other than tensors{what}, which "
                                  "glassgpt never unpickles: save the model's state_dict() instead") from None
        except Exception as e:  # a truncated zip, not a torch file at all: all end in one line
            last = e
    lines = [line for line in str(last).splitlines() if line.strip()]
    unpickler = [line for line in lines if "Unsupported" in line]  # torch's own reason, among its advice
    reason = (unpickler or lines or [type(last).__name__])[0]
    raise CheckpointError(f"{path} is truncated, corrupt or not a PyTorch file ({reason}): pass a state dict "
                          "saved with torch.save(model.state_dict(), path), or a checkpoint directory")


def _book_names() -> set[str]:
    """Every tensor name the book's GPTModel can have, blocks spelled trf_blocks.N."""
    names = set(meta_model(GPTConfig(vocab_size=2, context_length=2, emb_dim=2, n_heads=1, n_layers=1,
                                     tie_embeddings=False, num_classes=2)).state_dict())
    names.add("trf_blocks.0.att.mask")
    return {re.sub(r"^trf_blocks\.0\.", "trf_blocks.N.", n) for n in names}


def config_from_state(state: dict[str, torch.Tensor], source: str | Path,
                      n_heads: int | None = None) -> GPTConfig:
    """The GPTConfig whose model has exactly these tensors: sizes from the shapes, the head count
    from `n_heads`, else the JSON beside `source`, else GPT-2's rule."""
    for name in ("tok_emb.weight", "pos_emb.weight"):
        if name not in state:
            raise CheckpointError(f"{source} has no {name!r}: it is not a state dict of the book's GPTModel")
    _check_agree(state, source)
    vocab_size, emb_dim = state["tok_emb.weight"].shape
    blocks = {int(m.group(1)) for k in state if (m := re.match(r"trf_blocks\.(\d+)\.", k))}
    head = state.get("out_head.weight")
    num_classes = None
    if head is not None and (head.shape[0] != vocab_size or "out_head.bias" in state):
        if "out_head.bias" not in state:
            raise CheckpointError(f"{source}: out_head.weight is {list(head.shape)} but there is no "
                                  "out_head.bias: a classifier head (the book's chapter 6) has one")
        num_classes = head.shape[0]
    side, side_path = side_config(source)
    if n_heads is not None and side.get("n_heads") not in (None, n_heads):
        raise ConfigError(f"--n-heads {n_heads} but {side_path} beside {Path(source).name} says n_heads "
                          f"{side['n_heads']}: drop --n-heads, or fix the JSON")
    if n_heads is not None and emb_dim % n_heads:
        raise ConfigError(f"--n-heads {n_heads} does not divide emb_dim {emb_dim} of {source}: give one of "
                          f"{', '.join(str(h) for h in range(1, emb_dim + 1) if emb_dim % h == 0)}")
    heads = n_heads or side.get("n_heads") or gpt2_head_count(emb_dim, source)
    cfg = GPTConfig(
        vocab_size=vocab_size, context_length=state["pos_emb.weight"].shape[0], emb_dim=emb_dim,
        n_heads=heads, n_layers=max(blocks, default=-1) + 1, drop_rate=side.get("drop_rate", 0.0),
        qkv_bias="trf_blocks.0.att.W_query.bias" in state,
        # Tied only if saved so: the book's own models keep out_head apart from tok_emb.
        tie_embeddings=num_classes is None and (head is None or _same_tensor(head, state["tok_emb.weight"])),
        num_classes=num_classes,
    )
    for key in set(side) & {"vocab_size", "context_length", "emb_dim", "n_layers", "qkv_bias"}:
        if side[key] != getattr(cfg, key):
            raise CheckpointError(f"{side_path} says {key} {side[key]!r} but the weights in {source} have "
                                  f"{getattr(cfg, key)!r}: it belongs to another model; move it away")
    return cfg


def _check_agree(state: dict[str, torch.Tensor], source: str | Path) -> None:
    """Refuse tensors that disagree with each other on the sizes the config is read from
    (each other tensor's shape is checked against that config before the model is built)."""
    tok, pos = state["tok_emb.weight"], state["pos_emb.weight"]
    if tok.dim() != 2 or pos.dim() != 2 or tok.shape[1] != pos.shape[1]:
        raise CheckpointError(f"{source}: tok_emb.weight is {list(tok.shape)} and pos_emb.weight is "
                              f"{list(pos.shape)}: both must be [rows, emb_dim] of the same emb_dim")
    blocks = sorted({int(m.group(1)) for k in state if (m := re.match(r"trf_blocks\.(\d+)\.", k))})
    if blocks != list(range(len(blocks))):
        raise CheckpointError(f"{source} holds {len(blocks)} blocks numbered up to trf_blocks.{blocks[-1]}: the "
                              "book's GPTModel numbers its blocks 0..n_layers-1")
    for name, tensor in state.items():
        if not tensor.is_floating_point() and not name.endswith(".att.mask"):
            raise CheckpointError(f"{source}: tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')}: "
                                  "a GPTModel's weights are floating-point")


def gpt2_head_count(emb_dim: int, source: str | Path) -> int:
    if emb_dim % GPT2_HEAD_DIM:
        raise ConfigError(f"{source}: emb_dim {emb_dim} is not a multiple of {GPT2_HEAD_DIM}, so GPT-2's rule "
                          "(64 per head) cannot give the head count: pass --n-heads H (a divisor of "
                          f"{emb_dim}) or put {{\"n_heads\": H}} in {Path(source).with_suffix('.json').name} beside it")
    return emb_dim // GPT2_HEAD_DIM


def side_config(source: str | Path) -> tuple[dict[str, Any], Path | None]:
    """The book's cfg beside a .pth (`model.json` for `model.pth`, else `config.json`), if one
    holds n_heads; ({}, None) otherwise."""
    path = Path(source)
    for candidate in (path.with_suffix(".json"), path.parent / "config.json"):
        if not candidate.is_file():
            continue
        values = read_json(candidate, what=f"the cfg beside {path.name}", kind="config")
        if "n_heads" in values:
            field(values, "n_heads", str(candidate))
            for key in ("vocab_size", "context_length", "emb_dim", "n_layers"):
                field(values, key, str(candidate), default=None)
            field(values, "qkv_bias", str(candidate), bool, default=None)
            rate = field(values, "drop_rate", str(candidate), float, default=0.0)
            if not 0 <= rate < 1:
                raise CheckpointError(f"{candidate}: drop_rate must be in [0, 1), got {rate!r}")
            return values, candidate
    return {}, None


def side_labels(source: str | Path) -> list[str] | None:
    """The class names in the .json beside a .pth (`{"labels": ["ham", "spam"]}`), or None."""
    path = Path(source).with_suffix(".json")
    if not path.is_file():
        return None
    labels = read_json(path, what=f"the cfg beside {Path(source).name}", kind="config").get("labels")
    if labels is None:
        return None
    if not isinstance(labels, list) or not labels or not all(isinstance(x, str) and x for x in labels):
        raise CheckpointError(f"{path}: \"labels\" must be a list of class names, got {labels!r}")
    return labels


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when torch.save kept one tensor under two names (a tied model's state dict)."""
    return (a.shape == b.shape and a.storage_offset() == b.storage_offset()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def glassgpt_tensors(state: dict[str, torch.Tensor], cfg: GPTConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The state dict's tensors under glassgpt's names: the same, less the mask buffers
    (and the head of a tied model, which is tok_emb.weight)."""
    for name, tensor in state.items():
        if name.endswith(".att.mask") or (cfg.tie_embeddings and name == "out_head.weight"):
            continue
        yield name, tensor


# --- back to the book -------------------------------------------------------------------------

def book_cfg(cfg: GPTConfig) -> dict[str, Any]:
    """The dict the book's GPTModel(cfg) takes."""
    return {key: getattr(cfg, key) for key in BOOK_CFG_KEYS}


def book_state_dict(model: GPTModel) -> dict[str, torch.Tensor]:
    """The weights as the book's GPTModel names them, with its causal-mask buffers: one
    [context_length, context_length] tensor shared by every block (torch.save writes it
    once), and out_head.weight even when it is tok_emb.weight (written once too)."""
    state = {name: t.detach().cpu() for name, t in model.state_dict(keep_vars=False).items()}
    ctx = model.cfg.context_length
    mask = torch.triu(torch.ones(ctx, ctx), diagonal=1)  # 1 above the diagonal: the future
    for i in range(model.cfg.n_layers):
        state[f"trf_blocks.{i}.att.mask"] = mask
    return state


# --- what info and explain say -------------------------------------------------------------------

def layout_note(cfg: GPTConfig) -> str | None:
    """How this language model's parameters differ from OpenAI's GPT-2 of the same sizes,
    e.g. for the book's GPT_CONFIG_124M (gpt2-book): no qkv biases, its own out_head."""
    if cfg.num_classes is not None or (cfg.qkv_bias and cfg.tie_embeddings):
        return None
    d, V = cfg.emb_dim, cfg.vocab_size
    ways = []
    if not cfg.qkv_bias:
        ways.append(f"no qkv biases ({3 * d * cfg.n_layers:,} fewer)")
    if not cfg.tie_embeddings:
        ways.append(f"its own out_head [{V}, {d}] instead of tok_emb.weight ({V * d:,} more)")
    gpt2 = dataclasses.replace(cfg, qkv_bias=True, tie_embeddings=True)
    whose = "the book's GPT_CONFIG_124M layout, " if len(ways) == 2 else ""
    return (f"{whose}unlike OpenAI's GPT-2: {' and '.join(ways)}: "
            f"{_count(cfg):,} parameters, {_count(gpt2):,} in GPT-2's layout")


def _count(cfg: GPTConfig) -> int:
    counts = parameter_counts(cfg)
    return counts["linear"] + counts["other"]

"""The OpenAI folder that the book's gpt_download.py writes (`gpt2/124M/`), read without TensorFlow.

    checkpoint, hparams.json, model.ckpt.index, model.ckpt.data-00000-of-00001, encoder.json, vocab.bpe

The tensors come from tensorflow.py (a TensorFlow checkpoint decoded by hand); their
names are Hugging Face's spelled OpenAI's way (`model/h0/attn/c_attn/w`), so they map
onto glassgpt's through hf.py's table.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Iterator

import torch

from ..config import PRESETS, GPTConfig
from ..errors import CheckpointError
from ..tokenizer import VOCAB_SHA256, Tokenizer, get_tokenizer
from .checks import Spelling, check_sizes, field
from .files import read_json
from .tensorflow import read_index, read_tensors

OPENAI_FILES = ("hparams.json", "checkpoint")


def is_openai_dir(spec: str | Path) -> bool:
    """A folder as gpt_download.py writes it: a TensorFlow checkpoint and hparams.json, no config.json."""
    path = Path(spec)
    if str(spec) in PRESETS or not path.is_dir() or (path / "config.json").exists():
        return False
    return any((path / name).exists() for name in OPENAI_FILES) or any(path.glob("*.index"))


# How hparams.json and the TensorFlow checkpoint name GPT-2's sizes (checks.py words its errors so).
OPENAI = Spelling({"vocab_size": "n_vocab", "context_length": "n_ctx", "emb_dim": "n_embd", "n_layers": "n_layer"},
                  "model/wte", "model/wpe", r"model/h(\d+)/")


def openai_config(path: str | Path) -> GPTConfig:
    """GPT-2's config from the folder's hparams.json (n_vocab, n_ctx, n_embd, n_head, n_layer),
    checked against the shapes in the checkpoint's index (no tensor is read)."""
    hparams = Path(path) / "hparams.json"
    if not hparams.is_file():
        raise CheckpointError(f"{path} has no hparams.json: the OpenAI folder needs it for the model's sizes "
                              "(download it again with the book's gpt_download.py)")
    h = read_json(hparams, kind="config")
    sizes = {ours: field(h, theirs, str(hparams)) for ours, theirs in
             (("vocab_size", "n_vocab"), ("context_length", "n_ctx"), ("emb_dim", "n_embd"),
              ("n_heads", "n_head"), ("n_layers", "n_layer"))}
    if sizes["emb_dim"] % sizes["n_heads"]:
        raise CheckpointError(f"{hparams}: n_embd {sizes['emb_dim']} is not divisible by n_head {sizes['n_heads']}")
    cfg = GPTConfig(**sizes)
    prefix = _checkpoint_prefix(Path(path))
    shapes = {name: entry.shape for name, entry in read_index(prefix)[1].items()}
    check_sizes(cfg, shapes, OPENAI, str(hparams), f"{prefix}.index")
    return cfg


def openai_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(OpenAI's name, tensor) pairs, e.g. ("model/h0/attn/c_attn/w", [1, d, 3d])."""
    yield from read_tensors(_checkpoint_prefix(Path(path)))


def _checkpoint_prefix(path: Path) -> Path:
    """The checkpoint the folder's `checkpoint` file names (model_checkpoint_path: "model.ckpt"),
    else its one *.index file."""
    pointer = path / "checkpoint"
    if pointer.is_file():
        try:  # a few lines of text; more is not this file
            with open(pointer, "rb") as f:
                text = f.read(1 << 16).decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"cannot read {pointer}: {e}") from None
        found = re.search(r'^model_checkpoint_path:\s*"([^"]+)"', text, re.M)
        if found:
            prefix = Path(found.group(1))
            return prefix if prefix.is_absolute() else path / prefix
    indexes = sorted(path.glob("*.index"))
    if len(indexes) != 1:
        raise CheckpointError(f"{path} has {len(indexes)} *.index files and no `checkpoint` file naming one: "
                              "keep the model.ckpt.index and model.ckpt.data-* files that belong together")
    return indexes[0].with_suffix("")


def openai_tokenizer(path: str | Path) -> Tokenizer:
    """GPT-2's BPE, after checking that the folder's encoder.json and vocab.bpe are GPT-2's."""
    for name, digest in VOCAB_SHA256.items():
        file = Path(path) / name
        if file.is_file() and hashlib.sha256(file.read_bytes()).hexdigest() != digest:
            raise CheckpointError(f"{file} is not GPT-2's {name} (its sha256 differs): glassgpt runs GPT-2's "
                                  "BPE; download the folder again or remove the file to use GPT-2's")
    return get_tokenizer("gpt2")



def hf_name(name: str, w: torch.Tensor) -> tuple[str, torch.Tensor]:
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


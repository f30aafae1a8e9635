"""Hugging Face's GPT-2 layout, both ways: its config.json and its tensor names.

Hugging Face's names and its Conv1D layout (weights stored [in, out], the transpose
of nn.Linear's [out, in]; query/key/value fused in one `c_attn`) appear only in the
mapping below.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors.torch import save_file

from ..config import GPTConfig
from ..errors import CheckpointError
from ..model import GPTModel
from .checks import Spelling, expected_shapes, field
from .files import clean_leftovers, process_umask, refuse_link, temp_path


# How Hugging Face's config.json and tensors name GPT-2's sizes (checks.py words its errors so).
HF = Spelling({"vocab_size": "vocab_size", "context_length": "n_positions", "emb_dim": "n_embd",
               "n_layers": "n_layer"}, "wte.weight", "wpe.weight", r"h\.(\d+)\.")


def config_from_hf(raw: dict, source: Path | str = "config.json") -> GPTConfig:
    """GPTConfig from Hugging Face's GPT2Config fields, each checked for its kind and named as the file names it."""
    if raw.get("model_type", "gpt2") != "gpt2":
        raise CheckpointError(f"{source} is a {raw['model_type']!r} model; glassgpt loads GPT-2 only")
    act = raw.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise CheckpointError(f"{source} uses activation {act!r}; glassgpt's GPT-2 uses the tanh GELU")
    # Switches of GPT2Config that change the maths; loading them as plain GPT-2 would be silently wrong.
    for name, gpt2_value in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                             ("layer_norm_epsilon", 1e-5)):
        if raw.get(name, gpt2_value) != gpt2_value:
            raise CheckpointError(f"{source} sets {name}={raw[name]!r}; glassgpt's GPT-2 needs "
                                  f"{gpt2_value!r}: this checkpoint is a GPT-2 variant it cannot run")
    sizes = {ours: field(raw, theirs, str(source)) for ours, theirs in
             (("vocab_size", "vocab_size"), ("context_length", "n_positions"), ("emb_dim", "n_embd"),
              ("n_heads", "n_head"), ("n_layers", "n_layer"))}
    if raw.get("n_inner") not in (None, 4 * sizes["emb_dim"]):
        raise CheckpointError(f"{source} sets n_inner={raw['n_inner']!r}; glassgpt's GPT-2 needs None "
                              f"(4 x n_embd = {4 * sizes['emb_dim']})")
    if sizes["emb_dim"] % sizes["n_heads"]:
        raise CheckpointError(f"{source}: n_embd {sizes['emb_dim']} is not divisible by n_head {sizes['n_heads']}")
    tied = field(raw, "tie_word_embeddings", str(source), bool, default=True)
    return GPTConfig(**sizes, drop_rate=0.0, qkv_bias=True, tie_embeddings=tied)


def hf_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Tensor shapes under the names HF's GPT2Model uses (GPT2LMHeadModel's `transformer.` dropped)."""
    return {name.removeprefix("transformer."): shape for name, shape in shapes.items()}


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


def hf_to_glassgpt(tensors: Iterator[tuple[str, torch.Tensor]], cfg: GPTConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face's (name, tensor) pairs as glassgpt's; a tensor of the wrong shape is named as HF names it."""
    table = {hf: (ours, to_ours) for hf, ours, to_ours, _ in _hf_names(cfg)}
    ours_shapes = expected_shapes(cfg)
    expected = {hf: ours_shapes[ours] for hf, (ours, _) in table.items() if ours in ours_shapes}
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
        w = to_ours(w)
        if name in expected and w.shape != expected[name]:
            raise CheckpointError(f"tensor {name!r} has shape {list(to_ours(w).shape)} but the config needs "
                                  f"{list(to_ours(torch.empty(expected[name], device='meta')).shape)}")
        yield ours, w


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
    """Write `path/config.json` + `path/model.safetensors` that transformers' GPT2LMHeadModel loads.

    Whole or not at all: both files are written into a temporary directory beside `path`
    (`.NAME.PID.XXXXXXXX.tmp`, which the next export cleans if this one is killed), which is renamed
    to `path` at the end. Into a directory that exists, the two files are renamed in, each whole,
    and its other files are left as they are."""
    path = Path(path)
    cfg = config_to_hf(model.cfg)  # refuses a classifier before anything is written
    refuse_link(path)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} is a file: an export to Hugging Face's layout is a directory; give another name")
    path.parent.mkdir(parents=True, exist_ok=True)
    for name in (None, *EXPORT_FILES):  # what a killed export left: beside path, or inside it
        clean_leftovers(path if name is None else path / name)
    tmp = temp_path(path, directory=True)
    try:
        save_file(hf_state_dict(model), tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))  # last: config.json says the weights are whole
        for name in EXPORT_FILES:
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o777 & ~process_umask())
        if path.is_dir():
            for name in EXPORT_FILES:
                refuse_link(path / name)
                os.replace(tmp / name, path / name)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return path


EXPORT_FILES = ("model.safetensors", "config.json")  # in the order they are written


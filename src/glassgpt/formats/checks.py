"""The checks every reader runs before anything is built from a file: in the file's own words.

A stranger's file can claim anything. Three checks stand between it and an allocation:
  - each config value is of the right kind (`field`), named as the file names it
    (`n_embd` in Hugging Face's config.json, `n_ctx` in hparams.json);
  - the config agrees with the tensors' shapes, read from the file's header or index without
    reading the tensors (`check_sizes`): the token and position embeddings give vocab_size,
    emb_dim and context_length, the blocks in the file give n_layers, so a config.json that
    claims 100,000 layers beside two is refused before a single layer is built;
  - a model built from a config alone (a preset, a config .json: random weights) must fit
    in this machine's memory (`check_buildable`), so no terabyte is asked for.
What a model of a config holds comes from here too: `expected_shapes` (every tensor's shape,
from a one-block model) and `meta_model` (a model with shapes and no memory).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch.overrides import TorchFunctionMode

from ..config import GPTConfig
from ..errors import CheckpointError, ConfigError
from .. import memory
from ..memory import parameter_table
from ..model import GPTModel

GPT2_XL_PARAMETERS = 1_557_611_200


def field(raw: Mapping[str, Any], name: str, source: str, kind: type = int, default: Any = ...) -> Any:
    """raw[name], checked to be a positive int (kind=int), a bool or a number, else a CheckpointError
    that names the field as the file spells it."""
    if name not in raw:
        if default is not ...:
            return default
        raise CheckpointError(f"{source} lacks {name!r}")
    value = raw[name]
    if kind is int:
        ok, want = isinstance(value, int) and not isinstance(value, bool) and value > 0, "a positive integer"
    elif kind is bool:
        ok, want = isinstance(value, bool), "true or false"
    else:
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    if not ok:
        raise CheckpointError(f"{source}: {name} must be {want}, got {value!r}")
    return value


@dataclass(frozen=True)
class Spelling:
    """How one format names GPT-2's sizes and tensors, so that an error uses the file's own words."""
    fields: Mapping[str, str]  # GPTConfig field -> the config's name for it
    tok_emb: str               # the token embedding [vocab_size, emb_dim]
    pos_emb: str               # the position embedding [context_length, emb_dim]
    block: str                 # a regex whose group 1 is a block's index


GLASSGPT = Spelling({k: k for k in ("vocab_size", "context_length", "emb_dim", "n_layers")},
                    "tok_emb.weight", "pos_emb.weight", r"trf_blocks\.(\d+)\.")


def check_sizes(cfg: GPTConfig, shapes: Mapping[str, tuple[int, ...]], spelling: Spelling,
                config_source: str, weights_source: str) -> None:
    """Refuse a config whose sizes the tensors' shapes do not show."""
    f = spelling.fields
    for name, rows, rows_field in ((spelling.tok_emb, cfg.vocab_size, "vocab_size"),
                                   (spelling.pos_emb, cfg.context_length, "context_length")):
        shape = shapes.get(name)
        if shape is None:
            raise CheckpointError(f"{weights_source} has no tensor {name!r}: these are not GPT-2's weights")
        if tuple(shape) != (rows, cfg.emb_dim):
            raise CheckpointError(
                f"{config_source} says {f[rows_field]} {rows:,} and {f['emb_dim']} {cfg.emb_dim:,}, so {name} should "
                f"be {[rows, cfg.emb_dim]}, but in {weights_source} it is {list(shape)}: the config and the weights "
                "belong to different models")
    block_of = {name: int(m.group(1)) for name in shapes if (m := re.match(spelling.block, name))}
    past = sorted((i, name) for name, i in block_of.items() if i >= cfg.n_layers)
    if past:
        i, name = past[0]
        raise CheckpointError(f"{weights_source}: tensor {name!r} {list(shapes[name])} is in block {i}, but "
                              f"{config_source} says {f['n_layers']} {cfg.n_layers:,}: the config and the weights "
                              "belong to different models")
    missing = sorted(set(range(cfg.n_layers)) - set(block_of.values()))
    if missing:
        raise CheckpointError(f"{config_source} says {f['n_layers']} {cfg.n_layers:,}, but {weights_source} holds "
                              f"{cfg.n_layers - len(missing):,} blocks (none numbered {missing[0]}): the config and "
                              "the weights belong to different models")


def check_buildable(cfg: GPTConfig, dtype: torch.dtype, device: torch.device, source: str) -> None:
    """Refuse a model whose weights alone, with the estimate's margin (memory.with_margin), would not fit in this
    machine's memory even with swap, before any is asked for: the last guard for every caller of the library (the
    commands check the whole run first, memory.inference_fit and training_fit)."""
    params = parameter_table(cfg)["total"]  # GPT-2's, or a Qwen3/Llama config's (memory.py reads its description)
    need = memory.memory_needs(cfg, dtype, 1, 1)["weights"]
    free = memory.available_memory(device)
    if memory.with_margin(need) > free.ram + free.swap:
        raise ConfigError(
            f"{source}: n_layers {cfg.n_layers:,}, emb_dim {cfg.emb_dim:,} and vocab_size {cfg.vocab_size:,} "
            f"make {params:,} parameters, {memory.gib(need)} in {str(dtype).removeprefix('torch.')} "
            f"({memory.gib(memory.with_margin(need))} with the margin, {memory.MARGIN}), and this machine has "
            f"{memory.gib(free.ram + free.swap)} available ({free.source}{' and swap' if free.swap else ''}; GPT-2 XL "
            f"has {GPT2_XL_PARAMETERS:,} parameters): use smaller sizes")


# --- what a model of a config holds ---------------------------------------------------------

def meta_model(cfg: GPTConfig) -> GPTModel:
    """A GPTModel of `cfg` whose parameters have shapes but no memory (the meta device):
    the frame that tensors are assigned into, or that `to_empty` fills."""
    with on_meta():
        return GPTModel(cfg)


class on_meta(TorchFunctionMode):
    """`with on_meta():` builds modules on the meta device without drawing their initial weights.

    There is nothing to draw into, and the meta device's `normal_` runs through torch._refs,
    whose first call imports torch._dynamo: 1.5 s of every command's start-up on a CPU, for
    values that do not exist."""

    def __enter__(self):
        self.device = torch.device("meta")
        self.device.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self.device.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":  # normal_, uniform_, kaiming_uniform_, ...
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


def expected_shapes(cfg: GPTConfig) -> dict[str, torch.Size]:
    """{name: shape} of every tensor a model of `cfg` loads (a tied head is tok_emb.weight, so it
    has no entry of its own), from a one-block model: no model of cfg's size is built."""
    one = meta_model(dataclasses.replace(cfg, n_layers=1))
    shapes, block = {}, {}
    for name, t in one.state_dict().items():
        if name.startswith("trf_blocks.0."):
            block[name.removeprefix("trf_blocks.0.")] = t.shape
        else:
            shapes[name] = t.shape
    for i in range(cfg.n_layers):
        shapes.update({f"trf_blocks.{i}.{k}": v for k, v in block.items()})
    if cfg.tie_embeddings:
        shapes.pop("out_head.weight")
    return shapes

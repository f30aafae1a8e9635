"""GPTConfig and the GPT-2 presets.

Field names follow the book ("Build a Large Language Model (From Scratch)"):
`vocab_size`, `context_length`, `emb_dim`, `n_heads`, `n_layers`, `drop_rate`,
`qkv_bias`. Two fields are glassgpt's own: `tie_embeddings` (GPT-2 uses one
[vocab_size, emb_dim] matrix for both the token embedding and the output head)
and `num_classes` (set by classification finetuning, which swaps the
emb_dim -> vocab_size head for an emb_dim -> num_classes one).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257      # V: rows of tok_emb, columns of the logits
    context_length: int = 1024   # longest input; rows of pos_emb
    emb_dim: int = 768           # d: the width every transformer block keeps
    n_heads: int = 12            # h: attention heads; head size hd = d // h
    n_layers: int = 12           # number of transformer blocks
    drop_rate: float = 0.0       # dropout (GPT-2 trained with 0.1; 0 for inference)
    qkv_bias: bool = True        # GPT-2 has biases on the query/key/value projections
    tie_embeddings: bool = True  # out_head.weight is tok_emb.weight (one tensor)
    num_classes: int | None = None  # None: language-model head; else a classifier head

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.emb_dim % self.n_heads:
            raise ConfigError(
                f"emb_dim ({self.emb_dim}) must be divisible by n_heads ({self.n_heads}): "
                f"choose n_heads from {_divisors(self.emb_dim)}"
            )
        if not isinstance(self.drop_rate, (int, float)) or isinstance(self.drop_rate, bool) \
                or not 0.0 <= self.drop_rate < 1.0:
            raise ConfigError(f"drop_rate must be a number in [0, 1), got {self.drop_rate!r}")
        for name in ("qkv_bias", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.num_classes is not None:
            if not isinstance(self.num_classes, int) or self.num_classes < 2:
                raise ConfigError(f"num_classes must be an integer >= 2, got {self.num_classes!r}")
            if self.tie_embeddings:
                raise ConfigError("a classifier head cannot be tied to tok_emb: set tie_embeddings=False")

    @property
    def head_dim(self) -> int:
        return self.emb_dim // self.n_heads

    @property
    def kv_heads(self) -> tuple[int, int]:
        """What a KV cache keeps per token and layer: (key/value heads, head size); every head here."""
        return self.n_heads, self.head_dim

    @property
    def out_dim(self) -> int:
        """Width of the model's output: vocab_size for a language model, else num_classes."""
        return self.vocab_size if self.num_classes is None else self.num_classes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "GPTConfig":
        return from_fields(cls, values, ConfigError, "config field")


def from_fields(cls: type, values: dict[str, Any], error: type[Exception], what: str, given_by: str = "",
                **given: Any) -> Any:
    """The dataclass `cls` built from a dict read from a file, `values`, and the fields its caller knows
    otherwise, `given` (a family told by the weights' names): the one way a config dict becomes a config.
    Each key of `values` must be a field (known_fields); a field in both must hold the same value there,
    else `error` names the two and `given_by`, where the caller's value comes from ("the weights are ...")."""
    for name, value in given.items():
        if name in values and values[name] != value:
            raise error(f"{what} {name} is {values[name]!r}, and {given_by or 'its reader says otherwise'} "
                        f"({name} {value!r}): correct {name} or leave it out")
    rest = {k: v for k, v in values.items() if k not in given}
    return cls(**known_fields(cls, rest, error, what), **given)


def known_fields(cls: type, values: dict[str, Any], error: type[Exception], what: str) -> dict[str, Any]:
    """`values`, when every key is a field of the dataclass `cls`; else `error`, naming the others."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise error(f"unknown {what}(s) {unknown}: valid ones are {sorted(fields)}")
    return values


# GPT-2's published sizes. drop_rate is 0 here: these presets are for inference
# and finetuning; pass drop_rate=0.1 to train the way OpenAI did.
PRESETS: dict[str, GPTConfig] = {
    "gpt2": GPTConfig(emb_dim=768, n_layers=12, n_heads=12),          # 124M
    "gpt2-medium": GPTConfig(emb_dim=1024, n_layers=24, n_heads=16),  # 355M
    "gpt2-large": GPTConfig(emb_dim=1280, n_layers=36, n_heads=20),   # 774M
    "gpt2-xl": GPTConfig(emb_dim=1600, n_layers=48, n_heads=25),      # 1558M
}

# The book's GPT_CONFIG_124M (chapter 4) and its bigger siblings (chapter 5's model_configs):
# GPT-2's sizes, but no query/key/value biases, dropout 0.1, and an out_head of its own
# (163,009,536 parameters for gpt2-book, where gpt2 has 124,439,808).
BOOK_PRESETS = {f"{name}-book": dataclasses.replace(cfg, drop_rate=0.1, qkv_bias=False, tie_embeddings=False)
                for name, cfg in PRESETS.items()}
PRESETS.update(BOOK_PRESETS)


def init_scheme(spec: str) -> str:
    """How a preset's random weights are drawn (model.INIT_SCHEMES): "pytorch-default" for the book's
    presets, as `torch.manual_seed(seed); GPTModel(cfg)` draws them in its code, so that the
    untrained model prints the book's text; "gpt2" (GPT-2's) for every other preset or config."""
    return "pytorch-default" if str(spec) in BOOK_PRESETS else "gpt2"


def get_config(name: str | GPTConfig, **overrides: Any) -> GPTConfig:
    """A preset by name (or a GPTConfig), with field overrides applied (None leaves a field as it is).
    A config .json file is read by `glassgpt.get_config` (formats/), which ends here."""
    if isinstance(name, GPTConfig):
        base = name
    elif name in PRESETS:
        base = PRESETS[name]
    else:
        raise ConfigError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)} or a config .json file")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if not overrides:
        return base
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(f"unknown config field(s) {unknown}: valid fields are {sorted(fields)}")
    return dataclasses.replace(base, **overrides)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, min(n, 64) + 1) if n % k == 0]

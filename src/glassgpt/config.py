"""The models' configs and their presets: GPTConfig (GPT-2) and FamilyConfig (Qwen3, Llama 3.2; Qwen3.5's
Qwen3_5Config extends it beside its glass file).

Field names follow the book ("Build a Large Language Model (From Scratch)"):
`vocab_size`, `context_length`, `emb_dim`, `n_heads`, `n_layers`, `drop_rate`,
`qkv_bias`. Two fields are glassgpt's own: `tie_embeddings` (GPT-2 uses one
[vocab_size, emb_dim] matrix for both the token embedding and the output head)
and `num_classes` (set by classification finetuning, which swaps the
emb_dim -> vocab_size head for an emb_dim -> num_classes one).

FamilyConfig: one config type for the book's next models (Qwen3 and its MoE, Llama 3.2; built by
families/qwen3.py and llama3.py). Field names are the book's (`llms_from_scratch.qwen3.QWEN_CONFIG_06_B`,
`llama3.LLAMA32_CONFIG_1B`): `vocab_size`, `context_length`, `emb_dim`, `n_heads`, `n_layers`, `hidden_dim`, `head_dim`,
`n_kv_groups`, `rope_base`, `qk_norm`, `rope_freq`. What the book's dicts leave to the code is a
field here: `family` (which glass file builds it), `tie_embeddings` (the book's models keep an
out_head of their own; the published 0.6B, 1.7B, 1B and 3B weights tie it to tok_emb) and
`norm_eps` (1e-6 in Qwen3, 1e-5 in Llama 3). The book's `dtype` is not a field: the weights carry
their dtype, as GPTConfig's do.

Qwen3's mixture-of-experts models (the bonus notebook standalone-qwen3-moe.ipynb: 30B-A3B, 235B-A22B)
are the same family with the notebook's three keys: `num_experts` (0: dense), `num_experts_per_tok`
and `moe_hidden_dim` (each expert's SwiGLU width).
(Gemma 3's config, the bonus notebook's keys, is Gemma3Config beside its glass file, families/gemma3.py.)
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
        check_positive_ints(self, ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers"))
        if self.emb_dim % self.n_heads:
            raise ConfigError(
                f"emb_dim ({self.emb_dim}) must be divisible by n_heads ({self.n_heads}): "
                f"choose n_heads from {_divisors(self.emb_dim)}"
            )
        if not isinstance(self.drop_rate, (int, float)) or isinstance(self.drop_rate, bool) \
                or not 0.0 <= self.drop_rate < 1.0:
            raise ConfigError(f"drop_rate must be a number in [0, 1), got {self.drop_rate!r}")
        check_bools(self, ("qkv_bias", "tie_embeddings"))
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


def check_positive_ints(cfg: Any, names: tuple[str, ...], where: str = "") -> None:
    """A ConfigError naming the first of `names` that is not a positive integer in `cfg` (`where`: in what config)."""
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{name} must be a positive integer{where}, got {value!r}")


def check_bools(cfg: Any, names: tuple[str, ...]) -> None:
    """A ConfigError naming the first of `names` that is not true or false in `cfg`."""
    for name in names:
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(f"{name} must be true or false, got {getattr(cfg, name)!r}")


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


INIT_SCHEMES = {
    "gpt2": "GPT-2's initialisation: N(0, 0.02) weights, zero biases, residual projections scaled by "
            "1/sqrt(2 * n_layers)",
    "pytorch-default": "PyTorch's defaults, the book's initialisation, torch.manual_seed(seed); GPTModel(cfg): "
                       "N(0, 1) embeddings and Kaiming-uniform linear layers",
}
INIT_ALIASES = {"book": "pytorch-default"}  # another name a web client or a reader may say (CHANGELOG.md)


def init_name(scheme: str) -> str:
    """The INIT_SCHEMES key `scheme` names (an alias, or itself)."""
    return INIT_ALIASES.get(scheme, scheme)


def init_scheme(spec: str) -> str:
    """How a preset's random weights are drawn (INIT_SCHEMES): "pytorch-default" for the book's
    presets, as `torch.manual_seed(seed); GPTModel(cfg)` draws them in its code, so that the
    untrained model prints the book's text; "gpt2" (GPT-2's) for every other preset or config."""
    return "pytorch-default" if str(spec) in BOOK_PRESETS else "gpt2"


def get_config(name: str | GPTConfig, **overrides: Any) -> GPTConfig:
    """A preset by name (or a GPTConfig), with field overrides applied (None leaves a field as it is).
    A config .json file is read by `glassgpt.get_config` (formats/), which ends here."""
    if not isinstance(name, GPTConfig) and name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)} or a config .json file")
    return _overridden(name if isinstance(name, GPTConfig) else PRESETS[name], overrides)


def _overridden(base: Any, overrides: dict[str, Any]) -> Any:
    """`base` with the fields `overrides` gives (None leaves a field as it is); each must be one of its fields."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    known_fields(type(base), overrides, ConfigError, "config field")
    return dataclasses.replace(base, **overrides) if overrides else base


def _divisors(n: int, most: int = 64) -> list[int]:
    return [k for k in range(1, min(n, most) + 1) if n % k == 0]


# --- the book's next models: Qwen3 and Llama 3.2 (families/qwen3.py, llama3.py) ---------------------

FAMILY_NAMES = ("qwen3", "llama3", "qwen3_5")


@dataclass(frozen=True)
class RopeFreq:
    """Llama 3's RoPE frequency scaling (the book's `rope_freq`): slow rotations slowed by `factor`."""

    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context_length: int = 8192


@dataclass(frozen=True)
class FamilyConfig:
    family: str                  # "qwen3", "llama3" (or "qwen3_5": Qwen3_5Config): the glass file that builds it
    vocab_size: int              # V: rows of tok_emb, columns of the logits
    context_length: int          # longest input; rows of RoPE's cos/sin tables
    emb_dim: int                 # d: the width every block keeps
    n_heads: int                 # h: query heads
    n_layers: int                # number of transformer blocks
    hidden_dim: int              # SwiGLU's inner width (fc1, fc2: d -> hidden_dim; fc3 back)
    n_kv_groups: int             # g: key/value heads; h // g query heads share each
    rope_base: float             # RoPE's theta: 1,000,000 in Qwen3, 500,000 in Llama 3
    head_dim: int | None = None  # hd: None means emb_dim // n_heads (Llama's rule)
    qk_norm: bool = False        # RMSNorm on each query and key head before RoPE (Qwen3)
    rope_freq: RopeFreq | None = None  # Llama 3's frequency scaling; None: plain RoPE
    tie_embeddings: bool = False  # out_head.weight is tok_emb.weight (one tensor)
    norm_eps: float = 1e-6       # every RMSNorm's eps
    num_experts: int = 0         # Qwen3 MoE: feed-forwards per block a router picks from (0: one dense SwiGLU)
    num_experts_per_tok: int = 0  # how many of them each token runs (their outputs weighted, summed)
    moe_hidden_dim: int | None = None  # each expert's SwiGLU width (hidden_dim is then unused)

    def __post_init__(self) -> None:
        if self.family not in FAMILY_NAMES:
            raise ConfigError(f"family {self.family!r} is not covered: choose one of {', '.join(FAMILY_NAMES)}")
        check_positive_ints(self, ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers", "hidden_dim",
                                   "n_kv_groups"))
        if isinstance(self.rope_freq, dict):  # from a JSON file or the book's dict
            object.__setattr__(self, "rope_freq", from_fields(RopeFreq, self.rope_freq, ConfigError, "rope_freq field"))
        if self.head_dim is None and self.emb_dim % self.n_heads:
            raise ConfigError(f"emb_dim ({self.emb_dim}) must be divisible by n_heads ({self.n_heads}) when "
                              f"head_dim is not given: choose n_heads from {_divisors(self.emb_dim, 128)} or set head_dim")
        hd = self.head_dim_value
        if not isinstance(hd, int) or isinstance(hd, bool) or hd <= 0 or hd % 2:
            raise ConfigError(f"head_dim is {hd!r} but RoPE rotates pairs of dimensions, so it must be a positive "
                              f"even number: choose an even head_dim (or n_heads so that emb_dim // n_heads is even)")
        if self.n_heads % self.n_kv_groups:
            raise ConfigError(f"n_heads ({self.n_heads}) must be divisible by n_kv_groups ({self.n_kv_groups}): "
                              f"each key/value group serves the same number of query heads; choose n_kv_groups "
                              f"from {_divisors(self.n_heads, 128)}")
        if not self.rope_base > 0:
            raise ConfigError(f"rope_base must be positive, got {self.rope_base!r}")
        if not 0 < self.norm_eps < 1:
            raise ConfigError(f"norm_eps must be in (0, 1), got {self.norm_eps!r}")
        check_bools(self, ("qk_norm", "tie_embeddings"))
        if self.num_experts:
            self._check_experts()

    def _check_experts(self) -> None:
        if self.family != "qwen3":
            raise ConfigError(f"num_experts is {self.num_experts} but glassgpt's mixture of experts is Qwen3's: "
                              f"set num_experts to 0 for {self.family}")
        check_positive_ints(self, ("num_experts", "num_experts_per_tok", "moe_hidden_dim"),
                            " in a mixture-of-experts config")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                              f"({self.num_experts}): a token cannot run more experts than there are; choose "
                              f"1 to {self.num_experts}")

    @property
    def moe(self) -> bool:
        """Whether each block's feed-forward is a router over num_experts SwiGLU experts."""
        return self.num_experts > 0

    @property
    def kv_heads(self) -> tuple[int, int]:
        """What a KV cache keeps per token and layer: the g key/value groups (before repeat_interleave:
        8 heads, not 16, in Qwen3 0.6B), each of head size hd; keys are kept after RoPE."""
        return self.n_kv_groups, self.head_dim_value

    @property
    def head_dim_value(self) -> int:
        """hd: the given head_dim, else emb_dim // n_heads."""
        return self.emb_dim // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per key/value group."""
        return self.n_heads // self.n_kv_groups

    @property
    def out_dim(self) -> int:
        return self.vocab_size

    @property
    def num_classes(self) -> None:
        """Always None: these are language models (GPTConfig's field, which commands read)."""
        return None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "FamilyConfig":
        """A config from its own `to_dict` (the JSON glassgpt writes beside a family's weights)."""
        return from_fields(cls, values, ConfigError, "config field")

    def to_book_dict(self, dtype=None) -> dict[str, Any]:
        """The book's config dict (`QWEN_CONFIG_06_B`, `LLAMA32_CONFIG_1B`) for these sizes, `dtype` as given."""
        book = {"vocab_size": self.vocab_size, "context_length": self.context_length, "emb_dim": self.emb_dim,
                "n_heads": self.n_heads, "n_layers": self.n_layers, "hidden_dim": self.hidden_dim,
                "n_kv_groups": self.n_kv_groups, "rope_base": self.rope_base, "dtype": dtype}
        if self.family == "qwen3":
            book.update(head_dim=self.head_dim_value, qk_norm=self.qk_norm)
        else:
            book["rope_freq"] = None if self.rope_freq is None else dataclasses.asdict(self.rope_freq)
        if self.moe:  # the MoE notebook's QWEN3_CONFIG has no hidden_dim: its blocks have no dense SwiGLU
            del book["hidden_dim"]
            book.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                        moe_hidden_dim=self.moe_hidden_dim)
        return book

    @classmethod
    def from_book_dict(cls, family: str, book: dict[str, Any], tie_embeddings: bool | None = None) -> "FamilyConfig":
        """A config from the book's dict for `family`, as its weights tell it (its `dtype` is dropped: the weights
        carry theirs). The dict may name the family and the tie too (glassgpt's own fields), as long as it
        agrees with `family` and a `tie_embeddings` given here (None: the dict's, else untied)."""
        values = {k: v for k, v in book.items() if k != "dtype"}
        if "moe_intermediate_size" in values:  # llms_from_scratch.qwen3's name for the notebook's moe_hidden_dim
            values["moe_hidden_dim"] = values.pop("moe_intermediate_size")
        if values.get("num_experts") and "hidden_dim" not in values:  # the MoE notebook's dict: no dense width
            values["hidden_dim"] = values.get("moe_hidden_dim")
        values.setdefault("norm_eps", 1e-6 if family == "qwen3" else 1e-5)
        given = {"family": family} if tie_embeddings is None else {"family": family, "tie_embeddings": tie_embeddings}
        return from_fields(cls, values, ConfigError, "book config field", given_by=f"the weights are a {family} model's",
                           **given)


# The published sizes, from the book's dicts; the released weights of all four tie the head.
FAMILY_PRESETS: dict[str, FamilyConfig] = {
    "qwen3-0.6b": FamilyConfig(family="qwen3", vocab_size=151_936, context_length=40_960, emb_dim=1024, n_heads=16,
                               n_layers=28, hidden_dim=3072, head_dim=128, n_kv_groups=8, rope_base=1_000_000.0,
                               qk_norm=True, tie_embeddings=True, norm_eps=1e-6),
    "qwen3-1.7b": FamilyConfig(family="qwen3", vocab_size=151_936, context_length=40_960, emb_dim=2048, n_heads=16,
                               n_layers=28, hidden_dim=6144, head_dim=128, n_kv_groups=8, rope_base=1_000_000.0,
                               qk_norm=True, tie_embeddings=True, norm_eps=1e-6),
    "llama3.2-1b": FamilyConfig(family="llama3", vocab_size=128_256, context_length=131_072, emb_dim=2048,
                                n_heads=32, n_layers=16, hidden_dim=8192, n_kv_groups=8, rope_base=500_000.0,
                                rope_freq=RopeFreq(), tie_embeddings=True, norm_eps=1e-5),
    "llama3.2-3b": FamilyConfig(family="llama3", vocab_size=128_256, context_length=131_072, emb_dim=3072,
                                n_heads=24, n_layers=28, hidden_dim=8192, n_kv_groups=8, rope_base=500_000.0,
                                rope_freq=RopeFreq(), tie_embeddings=True, norm_eps=1e-5),
}


def family_config(name: str | FamilyConfig, **overrides: Any) -> FamilyConfig:
    """A family preset by name (or a FamilyConfig), with field overrides applied (None: unchanged)."""
    if not isinstance(name, FamilyConfig) and name not in FAMILY_PRESETS:
        raise ConfigError(f"unknown family preset {name!r}: choose one of {', '.join(FAMILY_PRESETS)}")
    return _overridden(name if isinstance(name, FamilyConfig) else FAMILY_PRESETS[name], overrides)


def moe_from_hf(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    """Qwen3MoeForCausalLM's experts as the MoE notebook's keys; what its MoEFeedForward does not do is refused
    by the field that asks for it (dense blocks between sparse ones, routing weights not renormalised)."""
    experts = raw.get("num_experts", raw.get("num_local_experts"))  # transformers 5 writes num_local_experts
    if arch != "Qwen3MoeForCausalLM":
        if experts:
            raise ConfigError(f"{source}: num_experts is {experts} but {arch} has no experts: it is not a {arch} config")
        return {}
    if raw.get("mlp_only_layers"):
        raise ConfigError(f"{source}: mlp_only_layers {raw['mlp_only_layers']} gives some blocks a dense feed-forward; "
                          "the MoE notebook's Qwen3Model has experts in every block")
    if raw.get("decoder_sparse_step", 1) != 1:
        raise ConfigError(f"{source}: decoder_sparse_step {raw['decoder_sparse_step']} gives some blocks a dense "
                          "feed-forward; the MoE notebook's Qwen3Model has experts in every block")
    if not raw.get("norm_topk_prob", False):
        raise ConfigError(f"{source}: norm_topk_prob is false (the chosen experts' weights are not renormalised); "
                          "the MoE notebook's MoEFeedForward renormalises them, as the released Qwen3 MoE models do")
    return {"num_experts": experts, "num_experts_per_tok": raw["num_experts_per_tok"],
            "moe_hidden_dim": raw["moe_intermediate_size"]}

"""The layer debugger: a reader's port against transformers, one line per layer, and the first cause.

    glassgpt.check(Qwen3Model, against="transformers")   # a class: built on a tiny random config
    glassgpt check my_llama.py:Llama3Model --against transformers

The book maintainer's layer debuggers (ch05/12_gemma3/tests/gemma3_layer_debugger.py, OLMo 3's,
Tiny Aya's) build a tiny random config, give the reader's model and transformers' the same weights,
hook every layer and print `[OK]` / `[DIFF]` / `[SHAPE]` per layer at rtol = atol = 1e-5. This does
the same for every model glassgpt describes: GPT-2, Llama 3.2, Qwen3 and its MoE, and the bonus Gemma 3,
OLMo 3, Tiny Aya, Qwen3.5 and Gemma 4, each against its transformers class; chapter 4's variants (GQA, MLA, SWA,
MoE), which have no transformers class, against glassgpt's glass variant of the same config. The port:
the book's classes, glassgpt's, or a reader's copy in memory (a class or a model; no file needed).
Where each part is comes from the model's description (kinds.py, anatomy.py: the glass file's
describe over the port's config, its paths as the port names them); the weights go from transformers'
names to the port's through the maps glassgpt already reads with (formats/hf.py's and
formats/families.py's tables, adopt.py's view of the port), never a second table, and the same table
says where each part sits in transformers' model. Then it says why, at the first layer that differs:

- the first part inside it that differs (its norms wherever the block places them, the q/k/v
  projections, q_norm/k_norm, the attention, the shortcut, the feed-forward, Gemma 4's per-layer input;
  tok_emb and pos_emb), hooked on both models (a Gemma 4 kv-shared layer's keys are its source layer's:
  no part of its own);
- the property that part breaks, and the catalogue's exact mistake where one reproduces the
  numbers: causes.py.

Loading a state dict into a port, and what goes wrong there, is loading.py's.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import anatomy as an
from .. import kinds
from ..adopt import evaluating_all, family_layout, module_logits, read_in_place
from ..config import FamilyConfig, GPTConfig, RopeFreq
from ..errors import GlassError
from ..families.bonus_hf import bonus_config_to_hf
from ..formats import families as family_formats, hf as gpt2_formats
from .causes import ABSENT, ATOL, HEAD_COPY, RTOL, Where, broken_property, catalogue, norm_property, position_property
from .result import Result

AGAINST = ("transformers",)
VARIANT_KEYS = ("gqa", "mla", "swa", "moe")  # chapter 4's: no transformers class, glassgpt's glass variant instead
LAYER_TYPES = ("sliding_attention", "full_attention")

TINY_GPT2 = {"vocab_size": 257, "context_length": 16, "emb_dim": 32, "n_heads": 4, "n_layers": 2,
             "drop_rate": 0.0, "qkv_bias": True}
_VARIANT = {"vocab_size": 257, "context_length": 16, "emb_dim": 32, "n_heads": 4, "n_layers": 2, "drop_rate": 0.0}
TINY_VALUES = {  # a tiny config of each glass file, its first layer the kind that is special (sliding, linear)
    "gemma3": {"vocab_size": 257, "context_length": 16, "emb_dim": 32, "n_heads": 4, "n_layers": 2, "hidden_dim": 48,
               "head_dim": 8, "n_kv_groups": 2, "rope_local_base": 10_000.0, "rope_base": 1_000_000.0,
               "sliding_window": 4, "layer_types": LAYER_TYPES, "query_pre_attn_scalar": 24},
    "olmo3": {"vocab_size": 257, "context_length": 16, "emb_dim": 32, "n_heads": 4, "n_layers": 2, "hidden_dim": 48,
              "head_dim": 8, "n_kv_heads": 2, "sliding_window": 4, "layer_types": LAYER_TYPES, "rope_base": 10_000.0},
    "tiny_aya": {"vocab_size": 257, "context_length": 16, "emb_dim": 32, "n_heads": 4, "n_layers": 2, "hidden_dim": 48,
                 "head_dim": 8, "n_kv_heads": 2, "sliding_window": 4, "layer_types": LAYER_TYPES,
                 "rope_base": 10_000.0},
    "qwen3_5": {"family": "qwen3_5", "vocab_size": 257, "context_length": 16, "emb_dim": 32, "n_heads": 4,
                "n_layers": 2, "hidden_dim": 48, "head_dim": 8, "n_kv_groups": 2, "rope_base": 1_000_000.0,
                "qk_norm": True, "layer_types": ("linear_attention", "full_attention"), "linear_conv_kernel_dim": 3,
                "linear_key_head_dim": 8, "linear_value_head_dim": 6, "linear_num_key_heads": 2,
                "linear_num_value_heads": 4, "partial_rotary_factor": 0.25},
    "gemma4": {"vocab_size": 257, "emb_dim": 32, "hidden_dim": 48, "n_layers": 4, "n_heads": 4, "head_dim": 8,
               "n_kv_heads": 2, "global_head_dim": 16, "context_length": 16, "sliding_window": 4,
               "layer_types": LAYER_TYPES * 2, "vocab_size_per_layer_input": 257, "hidden_size_per_layer_input": 8,
               "num_kv_shared_layers": 2, "use_double_wide_mlp": True, "final_logit_softcap": 30.0},
    "gqa": _VARIANT | {"n_kv_groups": 2},
    "mla": _VARIANT | {"latent_dim": 16},
    "swa": _VARIANT | {"sliding_window_size": 4, "sliding_window_stride": 1},
    "moe": _VARIANT | {"num_experts": 4, "num_experts_per_tok": 2, "hidden_dim": 48},
}
TINY = {"qwen3": FamilyConfig(family="qwen3", vocab_size=257, context_length=16, emb_dim=32, n_heads=4, n_layers=2,
                              hidden_dim=64, head_dim=8, n_kv_groups=2, rope_base=1_000_000.0, qk_norm=True,
                              norm_eps=1e-6),
        "llama3": FamilyConfig(family="llama3", vocab_size=257, context_length=16, emb_dim=32, n_heads=4,
                               n_layers=2, hidden_dim=64, n_kv_groups=2, rope_base=500_000.0, norm_eps=1e-5,
                               rope_freq=RopeFreq(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                  original_context_length=8)),
        "qwen3_moe": FamilyConfig(family="qwen3", vocab_size=257, context_length=16, emb_dim=32, n_heads=4,
                                  n_layers=2, hidden_dim=64, head_dim=8, n_kv_groups=2, rope_base=1_000_000.0,
                                  qk_norm=True, norm_eps=1e-6, num_experts=4, num_experts_per_tok=2,
                                  moe_hidden_dim=24)}


def tiny_config(key: str):
    """The tiny config the debugger builds a class of `key` on ("gpt2", a family, a variant; "qwen3_moe")."""
    if key in TINY:
        return TINY[key]
    if key == "gpt2":
        return GPTConfig(**TINY_GPT2)
    values = dict(TINY_VALUES[key])
    if key == "qwen3_5":  # a FamilyConfig with more fields: the fields it has
        import dataclasses
        names = {f.name for f in dataclasses.fields(kinds.config_type(key))}
        values = {k: v for k, v in values.items() if k in names}
    return kinds.config_type(key)(**values)


@dataclass
class LayerLine:
    """One line of the table: a layer (or a part inside one), ours against transformers'."""

    name: str
    status: str                     # "OK", "DIFF", "SHAPE" or "MISSING"
    max_diff: float | None = None
    mean_diff: float | None = None
    ours_shape: list[int] | None = None
    theirs_shape: list[int] | None = None
    note: str = ""                  # MISSING: which side never ran it

    @property
    def line(self) -> str:
        if self.status in ("OK", "DIFF"):
            return f"[{self.status}] {self.name}: max={self.max_diff:.2e}, mean={self.mean_diff:.2e}"
        if self.status == "SHAPE":
            return f"[SHAPE] {self.name}: ours={self.ours_shape}, hf={self.theirs_shape}"
        return f"[MISSING] {self.name}: {self.note}"


@dataclass
class LayerReport(Result):
    """What the layer debugger found: the table, the parts of the first layer that differs, and why."""

    kind: str
    reference: str
    config: str
    ids: list[int]
    layers: list[LayerLine]
    parts: list[LayerLine] = field(default_factory=list)
    layer: str | None = None        # the first layer that differs
    part: str | None = None         # the first part inside it that differs
    broken: str | None = None       # the property that part breaks
    mistake: str | None = None      # the catalogue's key, where one reproduces it
    cause: str | None = None        # the catalogue's sentence
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.layer is None

    @property
    def finding(self) -> str:
        if self.ok:
            worst = max((line.max_diff or 0.0) for line in self.layers)
            return (f"every layer matches {self.reference} (largest difference {worst:.2e}; "
                    f"rtol = atol = {RTOL:g})")
        first = next(line for line in self.layers if line.name == self.layer)
        text = f"first cause: {self.layer} is the first layer that differs from {self.reference}"
        text += f" ({_what(first)})"
        if self.part:
            text += f"; inside it, {self.part} first"
        if self.broken:
            text += f": {self.broken}"
        if self.cause:
            text += f". The catalogue: {self.cause}"
        return text + "."

    def to_dict(self) -> dict[str, Any]:
        lines = lambda ls: [vars(line) | {"line": line.line} for line in ls]  # noqa: E731
        return {"kind": self.kind, "reference": self.reference, "config": self.config, "ids": self.ids,
                "ok": self.ok, "layer": self.layer, "part": self.part, "property": self.broken,
                "mistake": self.mistake, "cause": self.cause, "finding": self.finding, "notes": self.notes,
                "layers": lines(self.layers), "parts": lines(self.parts)}

    def to_text(self) -> str:
        lines = [f"glassgpt check: {self.kind} against {self.reference}",
                 f"  {self.config}; ids {self.ids}; rtol = atol = {RTOL:g}"]
        lines += [line.line for line in self.layers]
        if self.parts:
            lines += ["", f"inside {self.layer}:"] + [line.line for line in self.parts]
        return "\n".join(lines + ["", self.finding] + [f"note: {n}" for n in self.notes])


def _what(line: LayerLine) -> str:
    if line.status == "DIFF":
        return f"max difference {line.max_diff:.2e}"
    if line.status == "SHAPE":
        return f"shape {line.ours_shape} where transformers' is {line.theirs_shape}"
    return line.note


# --- the entry point ------------------------------------------------------------------------------

def debug(target: nn.Module | type, config: Any = None, *, against: str = "transformers", seed: int = 0,
          ids: list[int] | None = None) -> LayerReport:
    """The layer debugger (see the module's docstring). `target`: a model glassgpt describes, or its class
    (built on a tiny random config, or on `config`: the book's dict for it, or a glassgpt config). `ids`:
    the prompt (default: 8 random ids). Both models get the same random weights (the reference's drawn
    with `seed`, then mapped into the port)."""
    if against not in AGAINST:
        raise GlassError(f"against={against!r}: the layer debugger compares with {', '.join(AGAINST)}")
    # an instance is copied: the weights mapped in are the reference's random ones, never written into the reader's
    model = build_port(target, config, seed) if isinstance(target, type) else copy.deepcopy(target)
    if not isinstance(model, nn.Module):
        raise GlassError(f"the layer debugger takes a model or its class, got {type(model).__name__}")
    port = port_side(model)
    ref, reference = reference_model(port.key, port.cfg, seed)
    map_weights(port, ref)
    port.refs = _reference_paths(port.glass, name_pairs(port.key, port.cfg, ref), ref)
    gen = torch.Generator().manual_seed(seed)
    if ids is None:
        ids = torch.randint(0, port.cfg.vocab_size, (min(8, port.cfg.context_length),), generator=gen).tolist()
    batch = torch.tensor([ids], device=next(model.parameters()).device)
    points = _points(port.glass)
    ours = _record(model, {name: (port.path(g), io, None) for name, g, io in points
                           if not port.fused(g)}, batch, port.kind)
    theirs_paths = {}
    for name, g, io in points:
        where = port.theirs(g)
        if where is not None:
            theirs_paths[name] = (where[0], io, where[1])
    theirs = _record(ref, theirs_paths, batch.cpu(), reference)
    layers = [_compare(name, ours.get(name), theirs.get(name), name in ours.get(ABSENT, ())) for name, _, _ in points
              if _is_layer(name)]
    report = LayerReport(port.kind, reference, config_line(port.key, port.cfg), list(ids), layers,
                         notes=_tie_notes(port.tensors) + _dtype_notes(port.tensors))
    first = next((line for line in layers if line.status != "OK"), None)
    if first is not None:
        report.layer = first.name
        _explain(report, model, port, points, ours, theirs, batch)
    return report


def _is_layer(name: str) -> bool:
    """The table's lines: embedding, each block (its path, "trf_blocks.0"), final_norm and logits."""
    return "." not in name or (name.count(".") == 1 and name.split(".")[1].isdigit())


# --- the port: built, described, and read in glassgpt's names -----------------------------------------

@dataclass
class Port:
    """The port as the debugger reads it: its glass file's key and config, its tensors by glassgpt's names
    (views, so a copy into them is a copy into the port), the glass description (glassgpt's paths) and
    where each glass path is in the port and in the reference."""

    key: str
    cfg: Any
    tensors: dict[str, torch.Tensor]
    glass: an.Anatomy
    kind: str
    ports: dict[str, tuple[str, tuple[int, int] | None]] = field(default_factory=dict)  # glass path -> port's
    refs: dict[str, tuple[str, Any]] = field(default_factory=dict)  # glass path -> the reference's (path, chunk)

    def path(self, g: str) -> str:
        return self.ports.get(g, (g, None))[0]

    def fused(self, g: str) -> bool:
        """A projection the port holds as rows of a fused matrix (GPT-2's c_attn, GPTModelFast's qkv): no line."""
        return self.ports.get(g, (g, None))[1] is not None

    def theirs(self, g: str) -> tuple[str, Any] | None:
        return self.refs.get(g)


def family_of_config(config: Any) -> str | None:
    """The glass file a config is for (kinds.config_key), or the book's dict's: Qwen3, Llama 3 or GPT-2."""
    key = kinds.config_key(config)
    if key is not None:
        return key
    if isinstance(config, dict):
        if "n_kv_groups" in config:
            return "qwen3" if "qk_norm" in config else "llama3"
        if "emb_dim" in config:
            return "gpt2"
    return None


def build_port(cls: type, config: Any = None, seed: int = 0) -> nn.Module:
    """`cls` built on `config` (or on a tiny config of its kind: told by the config, the glass class it
    extends, the class's name, or by which config builds a model glassgpt recognises), after
    torch.manual_seed(seed)."""
    if kinds.config_key(config) is not None:
        keys = [kinds.config_key(config)]
    else:
        keys = [k for k in ("gpt2", "qwen3", "llama3", "gemma3", "olmo3", "tiny_aya", "qwen3_5", "gemma4") + VARIANT_KEYS
                if issubclass(cls, kinds.glass_class(tiny_config(k)))]
        if not keys and family_of_config(config):
            keys = [family_of_config(config)]
        if not keys:
            name = cls.__name__.lower()
            keys = [f for f, word in (("qwen3", "qwen"), ("llama3", "llama"), ("gpt2", "gpt")) if word in name]
            keys = keys or ["gpt2", "qwen3", "llama3"]
    tried = []
    for key in keys:
        try:
            torch.manual_seed(seed)
            model = cls(_config_for(cls, key, config))
            if port_side(model).key == kinds.config_key(model_config(model, key, config)):
                return model.eval()
        except Exception as err:  # the reader's constructor: what it said, if no kind fits
            tried.append(f"{key}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    raise GlassError(f"{cls.__name__} could not be built as a GPT-2, Qwen3 or Llama 3 model glassgpt reads, nor as "
                     f"one of its bonus models or chapter 4's variants ({'; '.join(tried) or 'no config fits'}): "
                     "give its config (config=..., or --config cfg.json), the book's dict for it")


def model_config(model: nn.Module, key: str, config: Any):
    cfg = getattr(model, "cfg", None)
    return cfg if kinds.config_key(cfg) is not None else (config if kinds.config_key(config) else tiny_config(key))


def _config_for(cls: type, key: str, config: Any) -> Any:
    """The config `cls` takes: glassgpt's classes their config object, the book's (and a reader's) its dict."""
    glass = issubclass(cls, kinds.glass_class(tiny_config(key)))
    if key == "gpt2":
        if glass:
            return config if isinstance(config, GPTConfig) else GPTConfig(**{k: (config or TINY_GPT2)[k]
                                                                            for k in TINY_GPT2})
        if isinstance(config, GPTConfig):
            return {k: getattr(config, k) for k in TINY_GPT2}
        return dict(config or TINY_GPT2)
    if kinds.config_key(config) is not None:
        cfg = config
    elif isinstance(config, dict) and key in ("qwen3", "llama3"):
        cfg = FamilyConfig.from_book_dict(key, config)
    elif isinstance(config, dict):
        cfg = kinds.config_type(key)(**config)
    else:
        cfg = tiny_config(key)
    if glass:
        return cfg
    return dict(config) if isinstance(config, dict) else cfg.to_book_dict(torch.float32)


def port_side(model: nn.Module) -> Port:
    """The port read in glassgpt's names: glassgpt's class (or a reader's subclass of it), the book's
    classes and a reader's copy with their names (adopt.py's readers), nanoGPT's and transformers' GPT-2."""
    cfg = getattr(model, "cfg", None)
    key = kinds.config_key(cfg)
    if key is not None and isinstance(model, kinds.glass_class(cfg)):
        glass = kinds.glass_description(cfg)
        stored = dict(model.named_parameters(remove_duplicate=False))
        stored |= {n: b for n, b in model.named_buffers() if n.endswith("layer_scalar")}  # Gemma 4's: stored, not trained
        return Port(key, cfg, stored, glass,
                    f"glassgpt's {type(model).__name__}" if type(model) is kinds.glass_class(cfg) else
                    f"{type(model).__name__} (your subclass of glassgpt's {kinds.glass_class(cfg).__name__})")
    found = family_layout(model)
    if found is not None:
        kind, cfg, tensors, _ = found
        port = Port(kinds.config_key(cfg), cfg, tensors, kinds.glass_description(cfg), kind)
    else:
        glass_model, layout = read_in_place(model)
        port = Port("gpt2", glass_model.cfg, layout.tensors, kinds.glass_description(glass_model.cfg), layout.kind)
    try:
        port.ports = _paths_between(port.glass, kinds.describe(model))
    except GlassError:
        port.ports = {}  # the book's names: the glass paths themselves
    return port


def _paths_between(glass: an.Anatomy, other: an.Anatomy) -> dict[str, tuple[str, tuple[int, int] | None]]:
    """glass path -> (the other description's path, its rows where it is a slice of a fused matrix), walking the
    two descriptions of one config side by side."""
    found = {glass.embedding.path: (other.embedding.path, None), glass.final_norm.path: (other.final_norm.path, None),
             glass.head.path: (other.head.path, None)}
    if glass.positions.path and other.positions.path:
        found[glass.positions.path] = (other.positions.path, None)
    for g, o in zip(glass.blocks, other.blocks):
        found[g.path] = (o.path, None)
        for gn, on in zip(g.norms, o.norms):
            found[gn.path] = (on.path, None)
        ga, oa = g.attention, o.attention
        found[ga.path] = (oa.path, None)
        for name in ("query", "key", "value", "out"):
            gl, ol = getattr(ga, name), getattr(oa, name)
            found[gl.path] = (ol.path, ol.rows)
        for name in ("q_norm", "k_norm"):
            if getattr(ga, name) is not None and getattr(oa, name) is not None:
                found[getattr(ga, name).path] = (getattr(oa, name).path, None)
        found[g.ff.path] = (o.ff.path, None)
        for name in ("up", "down", "gate"):
            if getattr(g.ff, name) is not None and getattr(o.ff, name) is not None:
                found[getattr(g.ff, name).path] = (getattr(o.ff, name).path, getattr(o.ff, name).rows)
    return found


def config_line(key: str, cfg) -> str:
    if key == "gpt2":
        return (f"GPT-2: vocab_size {cfg.vocab_size}, emb_dim {cfg.emb_dim}, {cfg.n_layers} layers, "
                f"{cfg.n_heads} heads, qkv_bias {cfg.qkv_bias}")
    if key in VARIANT_KEYS:
        extra = {"gqa": lambda: f"{cfg.n_kv_groups} key/value groups", "mla": lambda: f"a latent of {cfg.latent_dim}",
                 "swa": lambda: f"window {cfg.sliding_window_size}, stride {cfg.sliding_window_stride}",
                 "moe": lambda: f"{cfg.num_experts} experts, {cfg.num_experts_per_tok} a token"}[key]()
        return (f"chapter 4's {key.upper()}: vocab_size {cfg.vocab_size}, emb_dim {cfg.emb_dim}, {cfg.n_layers} "
                f"layers, {cfg.n_heads} heads, {extra}")
    groups = getattr(cfg, "n_kv_groups", None) or getattr(cfg, "n_kv_heads", None)
    hd = getattr(cfg, "head_dim_value", None) or getattr(cfg, "head_dim", None)
    line = (f"{cfg.family}: vocab_size {cfg.vocab_size}, emb_dim {cfg.emb_dim}, {cfg.n_layers} layers, {cfg.n_heads} "
            f"query heads sharing {groups} key/value groups of {hd}")
    if getattr(cfg, "num_experts", 0):
        line += f", {cfg.num_experts} experts ({cfg.num_experts_per_tok} a token)"
    if getattr(cfg, "layer_types", None):
        line += f", layers {', '.join(t.removesuffix('_attention') for t in cfg.layer_types)}"
    return line


# --- the reference: transformers' model with the same random weights, or glassgpt's glass variant ----------

def reference_model(key: str, cfg, seed: int = 0) -> tuple[nn.Module, str]:
    """(the reference model of `cfg`, its name in the table). transformers' model (eager attention), every
    weight random: matrices N(0, 1/d), norms' weights around 1, biases small, so that every mistake moves the
    numbers well past 1e-5 (Qwen3.5: transformers' own initialisation moved by N(0, 0.05), as the delta
    rule's sums are ill-conditioned past that). Chapter 4's variants have no transformers class: glassgpt's
    glass variant of the same config, with the same draw."""
    if key in VARIANT_KEYS:
        torch.manual_seed(seed)
        ref = kinds.glass_model(cfg).float().eval()
        _randomise(ref, cfg.emb_dim, seed)
        return ref, (f"glassgpt's variants.{key} {type(ref).__name__} (chapter 4's {key.upper()} has no "
                     "transformers class)")
    try:
        import transformers
    except ImportError:
        raise GlassError("the layer debugger compares with transformers, which is not installed: "
                         "pip install transformers") from None
    if key == "gpt2":
        config = transformers.GPT2Config(**gpt2_formats.config_to_hf(cfg))
    else:
        raw = bonus_config_to_hf(cfg) if key in ("olmo3", "tiny_aya", "gemma4") else family_formats.config_to_hf(cfg)
        config = transformers.AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items()
                                                                         if k != "model_type"})
    config._attn_implementation = "eager"
    arch = config.architectures[0] if getattr(config, "architectures", None) else "GPT2LMHeadModel"
    torch.manual_seed(seed)
    hf = getattr(transformers, arch)(config).float().eval()
    if key == "qwen3_5":
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    else:
        _randomise(hf, cfg.emb_dim, seed)
    if key == "gpt2" and not cfg.qkv_bias:  # the port has none: the same computation with zeros
        with torch.no_grad():
            for blk in hf.transformer.h:
                blk.attn.c_attn.bias.zero_()
    return hf, f"transformers' {arch}"


def _randomise(module: nn.Module, d: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():  # a tied matrix is drawn once
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(d))
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.2)
        for name, b in module.named_buffers():  # Gemma 4's layer_scalar, away from 1 so that leaving it out shows
            if name.endswith("layer_scalar"):
                b.copy_(1.0 + torch.randn(b.shape, generator=gen) * 0.2)


def name_pairs(key: str, cfg, ref: nn.Module) -> list[tuple[str, str, Any]]:
    """(glassgpt's name, the reference's, which chunk) of every stored tensor: formats/hf.py's hf_to_glassgpt
    for GPT-2 (c_attn's thirds), formats/families.py's hf_names for the others, the same names for a variant."""
    state = ref.state_dict()
    if key in VARIANT_KEYS:
        return [(name, name, None) for name in state]
    if key == "gpt2":
        pairs = []
        for name, w in state.items():
            ours = [n for n, _ in gpt2_formats.hf_to_glassgpt(iter([(name, w)]), cfg)]
            pairs += [(n, name, (j, len(ours)) if len(ours) > 1 else None) for j, n in enumerate(ours)]
        return pairs
    return [(book, hf, None) for book, hf in family_formats.hf_names(cfg)]


def _their_tensor(state: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """A tensor of the reference's state by the table's name; transformers 5 keeps an MoE's experts fused
    (mlp.experts.gate_up_proj [E, 2m, d], down_proj [E, d, m]) where the table names each expert's matrix."""
    if name in state:
        return state[name]
    head, _, rest = name.partition(".mlp.experts.")
    if not rest:
        return None
    e, leaf = rest.split(".", 1)
    if leaf in ("gate_proj.weight", "up_proj.weight"):
        both = state[f"{head}.mlp.experts.gate_up_proj"][int(e)]
        return both.chunk(2, dim=0)[0 if leaf.startswith("gate") else 1]
    return state[f"{head}.mlp.experts.down_proj"][int(e)]


def map_weights(port: Port, ref: nn.Module) -> None:
    """Copy the reference's weights into the port's own tensors through glassgpt's maps."""
    state = ref.state_dict()
    pairs = name_pairs(port.key, port.cfg, ref)
    with torch.no_grad():
        if port.key == "gpt2":
            mapped = dict(gpt2_formats.hf_to_glassgpt(iter(state.items()), port.cfg))
        else:
            mapped = {ours: _their_tensor(state, theirs) for ours, theirs, _ in pairs}
        for name, w in mapped.items():
            target = port.tensors.get(name)
            if target is None:
                if name.endswith((".bias", ".shift")) and not bool(w.any()):
                    continue  # a zero bias the port was built without
                raise GlassError(f"{port.kind} has no tensor for {name} {list(w.shape)}, which the reference model "
                                 f"of this config has: {_names_hint(port.tensors)}")
            if target.shape != w.shape:
                raise GlassError(f"{port.kind}: {name} is {list(target.shape)} where the reference's (mapped) is "
                                 f"{list(w.shape)}: the config does not describe this port")
            target.copy_(w.to(target.dtype))


def _reference_paths(glass: an.Anatomy, pairs, ref: nn.Module) -> dict[str, tuple[str, Any]]:
    """glass path -> (the reference's module path, chunk): a tensor's module from the name table; a module
    holding others (an attention, a feed-forward, a block) as many levels above one of its matrices'."""
    modules = dict(ref.named_modules())
    direct: dict[str, tuple[str, Any]] = {}
    for ours, theirs, chunk in pairs:
        o, t = ours.rpartition(".")[0], theirs.rpartition(".")[0]
        if t in modules:
            direct.setdefault(o, (t, chunk))
    if "lm_head" in modules:
        direct.setdefault(glass.head.path, ("lm_head", None))

    def holding(children: list[str]) -> tuple[str, Any] | None:
        """The module holding these matrices: their paths' common prefix (one alone: its parent)."""
        paths = [direct[c][0].split(".") for c in children if c in direct]
        if not paths:
            return None
        common = paths[0][:-1] if len(paths) == 1 else [p[0] for p in zip(*paths) if len(set(p)) == 1]
        path = ".".join(common[:next((i for i, p in enumerate(zip(*paths)) if len(set(p)) > 1), len(common))])
        return (path, None) if path in modules else None

    found = dict(direct)
    for block in glass.blocks:
        att, ff = block.attention, block.ff
        att_children = [lin.path for lin in (att.query, att.key, att.value, att.out)
                        if lin.path.startswith(att.path + ".")]  # a kv-shared layer's keys: an earlier layer's
        if att.state is not None:
            att_children += [att.state.beta.path, att.state.decay.path]
        ff_children = [ff.up.path, ff.down.path] + ([ff.gate.path] if ff.gate else [])
        if ff.experts is not None:
            ff_children = [ff.experts.router.path]
        found.setdefault(att.path, holding(att_children))
        found.setdefault(ff.path, holding(ff_children))
        if found[att.path] and found[ff.path]:
            direct[att.path], direct[ff.path] = found[att.path], found[ff.path]
            found.setdefault(block.path, holding([att.path, ff.path]))
    return {k: v for k, v in found.items() if v is not None}


def _names_hint(tensors: dict[str, torch.Tensor]) -> str:
    return f"the port's tensors are {', '.join(list(tensors)[:4])}, ..."


def _dtype_notes(tensors: dict[str, torch.Tensor]) -> list[str]:
    dtype = next(iter(tensors.values())).dtype
    if dtype == torch.float32:
        return []
    return [f"the port computes in {str(dtype).removeprefix('torch.')}, the reference in float32: at rtol = "
            f"atol = {RTOL:g} its rounding alone differs; build it with dtype float32 to compare the formulas"]


def _tie_notes(tensors: dict[str, torch.Tensor]) -> list[str]:
    emb, head = tensors.get("tok_emb.weight"), tensors.get("out_head.weight")
    if emb is None or head is None or emb.shape != head.shape or emb.data_ptr() == head.data_ptr():
        return []
    if torch.equal(emb, head):
        return [HEAD_COPY.format(where="the port's out_head.weight")]
    return []


# --- where each layer and part is: read off the description ---------------------------------------------

def _points(glass: an.Anatomy) -> list[tuple[str, str, str]]:
    """(name, glass path, what): the table's layers, then each block's parts, in the order data flows;
    what: "in" or "out" of the module. A part's name is its path inside its block (norm1, att.W_query, ...),
    or shortcut1 (the first sum: the input of the feed-forward side) and output; hidden points end in "<in"
    (a sublayer's input, read to tell a norm's placement)."""
    first = glass.blocks[0].path
    points = [("embedding", first, "in")]
    points += [(b.path, b.path, "out") for b in glass.blocks]
    points += [("final_norm", glass.final_norm.path, "out"), ("logits", glass.head.path, "out")]
    points += [(f"embedding.{glass.embedding.path}", glass.embedding.path, "out")]
    if glass.positions.kind == "learned":
        points += [(f"embedding.{glass.positions.path}", glass.positions.path, "out")]
    for b in glass.blocks:
        att, ff = b.attention, b.ff
        rel = lambda path: path.removeprefix(b.path + ".")  # noqa: E731
        norm = lambda role: b.norm(role)  # noqa: E731
        parts = []
        if norm("attn_in"):
            parts.append((rel(norm("attn_in").path), norm("attn_in").path, "out"))
        shared = att.kv_shared_from is not None  # Gemma 4: its keys and values are an earlier layer's, no part here
        if att.kind != "linear":
            parts += [(rel(lin.path), lin.path, "out") for lin in (att.query, att.key, att.value)
                      if not (shared and lin is not att.query)]
            parts += [(rel(n.path), n.path, "out") for n in (att.q_norm, att.k_norm)
                      if n is not None and not (shared and n is att.k_norm)]
        if shared:  # the port's own key matrix in this layer, hooked on the port only: does its forward call it?
            parts.append((f"{rel(att.path)}<own-key", f"{att.path}.{att.key.path.rpartition('.')[2]}", "out"))
        parts.append((rel(att.path), att.path, "out"))
        if norm("attn_out"):
            parts.append((rel(norm("attn_out").path), norm("attn_out").path, "out"))
        if b.placement != "parallel":
            parts.append(("shortcut1", norm("ff_in").path if norm("ff_in") else ff.path, "in"))
        if norm("ff_in"):
            parts.append((rel(norm("ff_in").path), norm("ff_in").path, "out"))
        parts.append((rel(ff.path), ff.path, "out"))
        if norm("ff_out"):
            parts.append((rel(norm("ff_out").path), norm("ff_out").path, "out"))
        if b.per_layer_input is not None:  # Gemma 4: x + norm(projection(gelu_tanh(gate(x)) * its per-layer input))
            own = b.per_layer_input
            parts += [(rel(lin.path), lin.path, "out") for lin in (own.gate, own.projection, own.norm)]
        parts += [("output", b.path, "out"), (f"{rel(att.path)}<in", att.path, "in"), (f"{rel(ff.path)}<in", ff.path, "in")]
        points += [(f"{b.path}.{name}", path, what) for name, path, what in parts]
    return points


def _record(module: nn.Module, paths: dict[str, tuple[str, str, Any]], batch: torch.Tensor,
            kind: str) -> dict[str, torch.Tensor]:
    """{point: the tensor} of one forward pass (eval mode), the first call of each module kept. A chunk
    (j, n): the j-th of n equal slices of the output's last dimension (GPT-2's c_attn: q, k, v)."""
    seen: dict[str, Any] = {}
    handles = []
    for name, (path, io, chunk) in paths.items():
        try:
            sub = module.get_submodule(path)
        except AttributeError:
            seen.setdefault(ABSENT, set()).add(name)  # the port has no such module: a MISSING line
            continue

        def hook(_mod, args, kwargs, out, name=name, io=io, chunk=chunk):
            x = args[0] if args else kwargs.get("hidden_states", next((v for v in kwargs.values()
                                                                        if torch.is_tensor(v)), None))
            y = x if io == "in" else (out[0] if isinstance(out, (tuple, list)) else out)
            if chunk is not None:
                y = y.chunk(chunk[1], dim=-1)[chunk[0]]
            if torch.is_tensor(y):
                seen.setdefault(name, y.detach().double().clone())
        handles.append(sub.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.inference_mode(), evaluating_all(module):
            module_logits(module, batch)
    except GlassError:
        raise
    except Exception as err:  # the port's own forward failed: where, in one line
        raise GlassError(f"{kind}'s forward failed on a {list(batch.shape)} prompt: {type(err).__name__}: "
                         f"{err}") from None
    finally:
        for h in handles:
            h.remove()
    return seen


def _compare(name: str, ours: torch.Tensor | None, theirs: torch.Tensor | None, absent: bool = False) -> LayerLine:
    if ours is None or theirs is None:
        who = ("the reference has no such part" if theirs is None else
               "your port has no such module" if absent else "your forward never calls it")
        return LayerLine(name, "MISSING", note=who)
    ours, theirs = ours.cpu(), theirs.cpu()
    if ours.shape != theirs.shape and ours.squeeze().shape == theirs.squeeze().shape:
        ours, theirs = ours.squeeze(), theirs.squeeze()  # pos_emb's [t, d] against transformers' [1, t, d]
    if ours.shape != theirs.shape and ours.dim() == 4 and ours.transpose(1, 2).shape == theirs.shape:
        ours = ours.transpose(1, 2)  # a head's [b, h, t, hd] against transformers' [b, t, h, hd]
    if ours.shape != theirs.shape:
        return LayerLine(name, "SHAPE", ours_shape=list(ours.shape), theirs_shape=list(theirs.shape))
    diff = torch.nan_to_num((ours - theirs).abs(), nan=math.inf)
    close = bool(torch.allclose(ours, theirs, rtol=RTOL, atol=ATOL))
    return LayerLine(name, "OK" if close else "DIFF", float(diff.max()), float(diff.mean()),
                     list(ours.shape), list(theirs.shape))


# --- why: the first part, its property, the catalogue (causes.py) ------------------------------------

def _explain(report: LayerReport, model, port: Port, points, ours, theirs, batch) -> None:
    """The parts of the first layer that differs, the first of them that differs, and why (causes.py)."""
    layer = report.layer
    report.parts = [_compare(name.removeprefix(layer + "."), ours.get(name), theirs.get(name),
                             name in ours.get(ABSENT, ())) for name, g, _ in points if name.startswith(layer + ".")
                    and not name.endswith("<in") and not port.fused(g) and name in theirs]
    first = next((p for p in report.parts if p.status != "OK"), None)
    report.part = first.name if first else None
    block = next((b for b in port.glass.blocks if b.path == layer), None)
    where = Where(port.key, port.cfg, model, port.ports, layer, block, ours, theirs, batch,
                  "glassgpt's variant" if port.key in VARIANT_KEYS else "transformers")
    if block is not None and first is not None:
        report.broken = broken_property(where, first.name)
    elif report.part == port.glass.positions.path:
        report.broken = position_property(where, ours.get(f"embedding.{report.part}"))
    elif layer == "final_norm":
        last = port.glass.blocks[-1].path
        report.broken = norm_property(where, port.glass.final_norm, ours.get(last), ours.get("final_norm"))
    if port.key in ("gpt2", "qwen3", "llama3"):
        report.mistake, report.cause = catalogue(port.key, model, report.ids, layer, report.part)

"""The layer debugger: a reader's port against transformers, one line per layer, and the first cause.

    glassgpt.check(Qwen3Model, against="transformers")   # a class: built on a tiny random config
    glassgpt check my_llama.py:Llama3Model --against transformers

The book maintainer's layer debuggers (ch05/12_gemma3/tests/gemma3_layer_debugger.py, OLMo 3's,
Tiny Aya's) build a tiny random config, give the reader's model and transformers' the same weights,
hook every layer and print `[OK]` / `[DIFF]` / `[SHAPE]` per layer at rtol = atol = 1e-5. This does
the same for GPT-2, Llama 3.2 and Qwen3: the book's classes, glassgpt's, or a reader's copy in
memory (a class or a model; no file needed). The weights go from transformers' names to the port's
through the maps glassgpt already reads with (formats/hf.py's and formats/families.py's tables,
adopt.py's view of the port), never a second table. Then it says why, at the first layer that
differs:

- the first part inside it that differs (norm1, the q/k/v projections, q_norm/k_norm, the
  attention, the shortcut, norm2, the feed-forward; tok_emb and pos_emb), hooked on both models;
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

from ..adopt import evaluating_all, module_logits, read_in_place
from ..config import GPTConfig
from ..errors import GlassError
from ..families import FAMILIES, FamilyConfig, RopeFreq, is_family_model
from ..adopt import HF_LAYER_NAMES, HF_NORMS, family_layout
from ..formats import families as family_formats, hf as gpt2_formats
from ..model import GPTModel
from .causes import (ABSENT, ATOL, HEAD_COPY, RTOL, broken_property, catalogue, module_at, norm_property,
                     position_property)
from .result import Result

AGAINST = ("transformers",)

TINY_GPT2 = {"vocab_size": 257, "context_length": 16, "emb_dim": 32, "n_heads": 4, "n_layers": 2,
             "drop_rate": 0.0, "qkv_bias": True}
TINY = {"qwen3": FamilyConfig(family="qwen3", vocab_size=257, context_length=16, emb_dim=32, n_heads=4, n_layers=2,
                              hidden_dim=64, head_dim=8, n_kv_groups=2, rope_base=1_000_000.0, qk_norm=True,
                              norm_eps=1e-6),
        "llama3": FamilyConfig(family="llama3", vocab_size=257, context_length=16, emb_dim=32, n_heads=4,
                               n_layers=2, hidden_dim=64, n_kv_groups=2, rope_base=500_000.0, norm_eps=1e-5,
                               rope_freq=RopeFreq(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                  original_context_length=8))}
HF_CLASSES = {"gpt2": "GPT2LMHeadModel", "qwen3": "Qwen3ForCausalLM", "llama3": "LlamaForCausalLM"}


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
    """The layer debugger (see the module's docstring). `target`: a GPT-2, Qwen3 or Llama 3 model, or
    its class (built on a tiny random config, or on `config`: the book's dict for it, a GPTConfig or a
    FamilyConfig). `ids`: the prompt (default: 8 random ids). Both models get the same random weights
    (transformers' drawn with `seed`, then mapped into the port)."""
    if against not in AGAINST:
        raise GlassError(f"against={against!r}: the layer debugger compares with {', '.join(AGAINST)}")
    # an instance is copied: the weights mapped in are transformers' random ones, never written into the reader's
    model = build_port(target, config, seed) if isinstance(target, type) else copy.deepcopy(target)
    if not isinstance(model, nn.Module):
        raise GlassError(f"the layer debugger takes a model or its class, got {type(model).__name__}")
    family, cfg, tensors, stages, kind = port_side(model)
    hf = transformers_model(family, cfg, seed)
    map_weights(family, cfg, hf, tensors, kind)
    theirs_stages = _their_stages(hf)
    gen = torch.Generator().manual_seed(seed)
    if ids is None:
        ids = torch.randint(0, cfg.vocab_size, (min(8, cfg.context_length),), generator=gen).tolist()
    batch = torch.tensor([ids], device=next(model.parameters()).device)
    points = _points(family, cfg.n_layers)
    ours = _record(model, _paths(points, stages, family, "ours"), batch, kind)
    theirs = _record(hf, _paths(points, theirs_stages, family, "theirs"), batch.cpu(), HF_CLASSES[family])
    layers = [_compare(name, ours.get(name), theirs.get(name), name in ours.get(ABSENT, ())) for name, _, _ in points
              if "." not in name or (name.startswith("trf_blocks.") and name.count(".") == 1)]
    report = LayerReport(kind, f"transformers' {HF_CLASSES[family]}", config_line(family, cfg), list(ids), layers,
                         notes=_tie_notes(model, tensors) + _dtype_notes(tensors))
    first = next((line for line in layers if line.status != "OK"), None)
    if first is not None:
        report.layer = first.name
        _explain(report, model, family, cfg, stages, points, ours, theirs, batch)
    return report


# --- the port: built, and read in glassgpt's names --------------------------------------------------

def family_of_config(config: Any) -> str | None:
    if isinstance(config, GPTConfig):
        return "gpt2"
    if isinstance(config, FamilyConfig):
        return config.family
    if isinstance(config, dict):
        if "n_kv_groups" in config:
            return "qwen3" if "qk_norm" in config else "llama3"
        if "emb_dim" in config:
            return "gpt2"
    return None


def build_port(cls: type, config: Any = None, seed: int = 0) -> nn.Module:
    """`cls` built on `config` (or on a tiny config of its family: told by the config, the class's name,
    or by which config builds a model glassgpt recognises), after torch.manual_seed(seed)."""
    if issubclass(cls, GPTModel):
        families = ["gpt2"]
    elif issubclass(cls, tuple(FAMILIES.values())):
        families = [next(f for f, c in FAMILIES.items() if issubclass(cls, c))]
    elif family_of_config(config):
        families = [family_of_config(config)]
    else:
        name = cls.__name__.lower()
        families = [f for f, word in (("qwen3", "qwen"), ("llama3", "llama"), ("gpt2", "gpt")) if word in name]
        families = families or ["gpt2", "qwen3", "llama3"]
    tried = []
    for family in families:
        try:
            torch.manual_seed(seed)
            model = cls(_config_for(cls, family, config))
            if port_side(model)[0] == family:
                return model.eval()
        except Exception as err:  # the reader's constructor: what it said, if no family fits
            tried.append(f"{family}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    raise GlassError(f"{cls.__name__} could not be built as a GPT-2, Qwen3 or Llama 3 model glassgpt reads "
                     f"({'; '.join(tried) or 'no config fits'}): give its config (config=..., or --config "
                     "cfg.json), the book's dict for it")


def _config_for(cls: type, family: str, config: Any) -> Any:
    """The config `cls` takes: glassgpt's classes a GPTConfig or FamilyConfig, the book's (and a
    reader's) their config dict."""
    if family == "gpt2":
        if issubclass(cls, GPTModel):
            return config if isinstance(config, GPTConfig) else GPTConfig(**{k: (config or TINY_GPT2)[k]
                                                                            for k in TINY_GPT2})
        if isinstance(config, GPTConfig):
            return {k: getattr(config, k) for k in TINY_GPT2}
        return dict(config or TINY_GPT2)
    cfg = config if isinstance(config, FamilyConfig) else (
        FamilyConfig.from_book_dict(family, config) if isinstance(config, dict) else TINY[family])
    if issubclass(cls, tuple(FAMILIES.values())):
        return cfg
    return dict(config) if isinstance(config, dict) else cfg.to_book_dict(torch.float32)


def port_side(model: nn.Module):
    """(family, config, {glassgpt name: the port's tensor, a view}, {stage: the port's module path}, kind)."""
    if is_family_model(model):
        stages = {s: s for s in ("tok_emb", "final_norm", "out_head")}
        for i in range(model.cfg.n_layers):
            stages.update({f"trf_blocks.{i}{s}": f"trf_blocks.{i}{s}" for s in ("", ".norm1", ".att", ".norm2", ".ff")})
        return (model.cfg.family, model.cfg, dict(model.named_parameters(remove_duplicate=False)), stages,
                f"glassgpt's {type(model).__name__}")
    found = family_layout(model)
    if found is not None:
        kind, cfg, tensors, stages = found
        return cfg.family, cfg, tensors, stages, kind
    glass, layout = read_in_place(model)
    return "gpt2", glass.cfg, layout.tensors, layout.stages, layout.kind


def config_line(family: str, cfg) -> str:
    if family == "gpt2":
        return (f"GPT-2: vocab_size {cfg.vocab_size}, emb_dim {cfg.emb_dim}, {cfg.n_layers} layers, "
                f"{cfg.n_heads} heads, qkv_bias {cfg.qkv_bias}")
    return (f"{family}: vocab_size {cfg.vocab_size}, emb_dim {cfg.emb_dim}, {cfg.n_layers} layers, {cfg.n_heads} "
            f"query heads sharing {cfg.n_kv_groups} key/value groups of {cfg.head_dim_value}")


# --- transformers' model, with the same random weights ----------------------------------------------

def transformers_model(family: str, cfg, seed: int = 0) -> nn.Module:
    """transformers' model of `cfg` (eager attention), every weight random: matrices N(0, 1/d), norms'
    weights around 1, biases small, so that every mistake moves the numbers well past 1e-5."""
    try:
        import transformers
    except ImportError:
        raise GlassError("the layer debugger compares with transformers, which is not installed: "
                         "pip install transformers") from None
    if family == "gpt2":
        raw = gpt2_formats.config_to_hf(cfg)
        config = transformers.GPT2Config(**raw)
    else:
        raw = family_formats.config_to_hf(cfg)
        config = (transformers.Qwen3Config if family == "qwen3" else transformers.LlamaConfig)(**raw)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = getattr(transformers, HF_CLASSES[family])(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():  # a tied matrix is drawn once
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(cfg.emb_dim))
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.2)
        if family == "gpt2" and not cfg.qkv_bias:  # the port has none: the same computation with zeros
            for blk in hf.transformer.h:
                blk.attn.c_attn.bias.zero_()
    return hf


def map_weights(family: str, cfg, hf: nn.Module, tensors: dict[str, torch.Tensor], kind: str) -> None:
    """Copy transformers' weights into the port's own tensors, through glassgpt's maps (hf_to_glassgpt for
    GPT-2, with its Conv1D transposes and c_attn split; hf_names for Qwen3 and Llama 3)."""
    state = hf.state_dict()
    if family == "gpt2":
        pairs = gpt2_formats.hf_to_glassgpt(iter(state.items()), cfg)
    else:
        pairs = ((book, state[name]) for book, name in family_formats.hf_names(cfg))
    with torch.no_grad():
        for name, w in pairs:
            target = tensors.get(name)
            if target is None:
                if name.endswith((".bias", ".shift")) and not bool(w.any()):
                    continue  # a zero bias the port was built without
                raise GlassError(f"{kind} has no tensor for {name} {list(w.shape)}, which transformers' model "
                                 f"of this config has: {_names_hint(tensors)}")
            if target.shape != w.shape:
                raise GlassError(f"{kind}: {name} is {list(target.shape)} where transformers' (mapped) is "
                                 f"{list(w.shape)}: the config does not describe this port")
            target.copy_(w.to(target.dtype))


def _names_hint(tensors: dict[str, torch.Tensor]) -> str:
    return f"the port's tensors are {', '.join(list(tensors)[:4])}, ..."


def _their_stages(hf: nn.Module) -> dict[str, str]:
    found = family_layout(hf)
    if found is not None:
        return found[3]
    return read_in_place(hf)[1].stages


def _dtype_notes(tensors: dict[str, torch.Tensor]) -> list[str]:
    dtype = next(iter(tensors.values())).dtype
    if dtype == torch.float32:
        return []
    return [f"the port computes in {str(dtype).removeprefix('torch.')}, transformers' model in float32: at rtol = "
            f"atol = {RTOL:g} its rounding alone differs; build it with dtype float32 to compare the formulas"]


def _tie_notes(model: nn.Module, tensors: dict[str, torch.Tensor]) -> list[str]:
    emb, head = tensors.get("tok_emb.weight"), tensors.get("out_head.weight")
    if emb is None or head is None or emb.shape != head.shape or emb.data_ptr() == head.data_ptr():
        return []
    if torch.equal(emb, head):
        return [HEAD_COPY.format(where="the port's out_head.weight")]
    return []



# --- where each layer and part is, on both sides -----------------------------------------------------

def _points(family: str, n_layers: int) -> list[tuple[str, str, str]]:
    """(name, stage, what): the table's layers, then each block's parts, in the order data flows.
    what: "in" or "out" of the stage's module, or a part's recipe."""
    points = [("embedding", "trf_blocks.0", "in")]
    points += [(f"trf_blocks.{i}", f"trf_blocks.{i}", "out") for i in range(n_layers)]
    points += [("final_norm", "final_norm", "out"), ("logits", "out_head", "out")]
    points += [("embedding.tok_emb", "tok_emb", "out")] + ([("embedding.pos_emb", "pos_emb", "out")]
                                                           if family == "gpt2" else [])
    for i in range(n_layers):
        b = f"trf_blocks.{i}"
        parts = [("norm1", "norm1", "out"), ("att.W_query", "att", "q"), ("att.W_key", "att", "k"),
                 ("att.W_value", "att", "v")]
        if family == "qwen3":
            parts += [("att.q_norm", "att", "q_norm"), ("att.k_norm", "att", "k_norm")]
        parts += [("att", "att", "out"), ("shortcut1", "norm2", "in"), ("norm2", "norm2", "out"),
                  ("ff", "ff", "out"), ("output", "", "out")]
        points += [(f"{b}.{name}", f"{b}.{stage}".rstrip("."), what) for name, stage, what in parts]
    return points


def _paths(points, stages: dict[str, str], family: str, side: str) -> dict[str, tuple[str, str, Any]]:
    """{point: (module path, "in"/"out", how to read the recorded tensor)} on one side."""
    hf_sub = {book.removesuffix(".weight"): theirs.removesuffix(".weight") for theirs, book in HF_LAYER_NAMES.items()}
    hf_sub.update({book: theirs for theirs, book in HF_NORMS.items()})
    ours_sub = {"q": "W_query", "k": "W_key", "v": "W_value", "q_norm": "q_norm", "k_norm": "k_norm"}
    paths = {}
    for name, stage, what in points:
        if stage not in stages:
            continue
        path = stages[stage]
        if what in ("in", "out"):
            paths[name] = (path, what, None)
        elif side == "ours":
            paths[name] = (f"{path}.{ours_sub[what]}", "out", None)
        elif family == "gpt2":  # transformers' GPT-2 fuses q, k, v in one Conv1D: its thirds
            paths[name] = (f"{path}.c_attn", "out", "qkv".index(what))
        else:
            sub = hf_sub[f"att.{ours_sub[what]}"].removeprefix("self_attn.")
            paths[name] = (f"{path}.{sub}", "out", None)
    return paths


def _record(module: nn.Module, paths: dict[str, tuple[str, str, Any]], batch: torch.Tensor,
            kind: str) -> dict[str, torch.Tensor]:
    """{point: the tensor} of one forward pass (eval mode), the first call of each module kept."""
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for name, (path, io, third) in paths.items():
        try:
            sub = module.get_submodule(path)
        except AttributeError:
            seen.setdefault(ABSENT, set()).add(name)  # the port has no such module: a MISSING line
            continue

        def hook(_mod, args, kwargs, out, name=name, io=io, third=third):
            x = args[0] if args else kwargs.get("hidden_states", next((v for v in kwargs.values()
                                                                        if torch.is_tensor(v)), None))
            y = x if io == "in" else (out[0] if isinstance(out, (tuple, list)) else out)
            if third is not None:
                y = y.chunk(3, dim=-1)[third]
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
        who = ("transformers' model has no such part" if theirs is None else
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

def _explain(report: LayerReport, model, family, cfg, stages, points, ours, theirs, batch) -> None:
    """The parts of the first layer that differs, the first of them that differs, and why (causes.py)."""
    layer = report.layer
    fused = ("att.W_query", "att.W_key", "att.W_value")  # a port with one qkv matrix has none of these
    report.parts = [_compare(name.removeprefix(layer + "."), ours.get(name), theirs.get(name),
                             name in ours.get(ABSENT, ())) for name, _, _ in points if name.startswith(layer + ".")
                    and not (name in ours.get(ABSENT, ()) and name.endswith(fused))]
    first = next((p for p in report.parts if p.status != "OK"), None)
    report.part = first.name if first else None
    if layer.startswith("trf_blocks.") and first is not None:
        report.broken = broken_property(family, cfg, model, stages, layer, first.name, ours, theirs, batch)
    elif report.part == "pos_emb":
        report.broken = position_property(model, stages, ours.get("embedding.pos_emb"))
    elif layer == "final_norm":
        report.broken = norm_property(family, ours.get(f"trf_blocks.{cfg.n_layers - 1}"), ours.get("final_norm"),
                                      module_at(model, stages, "final_norm"), cfg)
    report.mistake, report.cause = catalogue(family, model, report.ids, layer, report.part)

"""The kinds of model object glassgpt reads, each described through its glass file and one name map.

    describe(model) -> Anatomy        glassgpt.describe: any kind below, with no copy of its weights
    describe_config(cfg) -> Anatomy   the same from a config alone, before any weights exist
    description_mismatches(model, anatomy) -> list[str]   where a description and its module disagree

A kind is found by its children's names, then described by its glass file's describe(cfg) (model.py,
families/qwen3.py, families/llama3.py, families/qwen3_5.py, olmo3.py, tiny_aya.py, and chapter 4's variants/gqa.py,
mla.py, swa.py, moe.py) over the config its tensors and attributes say (adopt.py's readers), with every path
mapped to the object's own names:
    glassgpt's GPTModel, Qwen3Model (and its MoE), Llama3Model,  the glass names
      Gemma3Model
    the book's GPTModel, Qwen3Model, Llama3Model (and the     the same names (the book's)
      kv_cache variants), a reader's copy with its names
    nanoGPT's GPT, transformers' GPT2LMHeadModel              transformer.h.{i}.attn.c_attn (q, k, v as row slices;
                                                              Conv1D stores [in, out])
    transformers' Qwen3ForCausalLM, LlamaForCausalLM          model.layers.{i}.self_attn.q_proj ...
    glassgpt's Olmo3Model, TinyAyaModel (the notebooks'       the glass names; transformers' through
      names); transformers' Olmo3ForCausalLM, Cohere2ForCausalLM   families/bonus_hf.py's map
Anything else is one UnreadableModelError line naming what was looked for and the kinds read.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from . import anatomy as an
from . import model as gpt2
from .adopt import KINDS_READ, LOOKED_FOR, config_of, family_layout, layout_of
from .config import FamilyConfig, GPTConfig
from .errors import GlassError, UnreadableModelError
from .families import BONUS_MODELS, FAMILIES, gemma3, gemma4, llama3, olmo3, qwen3, qwen3_5, tiny_aya
from .families import build_model as build_family
from .families.bonus_hf import BLOCKS, HF_LAYER_NAMES, HF_MODEL_TYPES, HF_TOP, HF_WEIGHTLESS, bonus_config_from_hf
from .variants import VARIANTS, variant_of
from .variants import build_model as build_variant

GLASS = {"qwen3": qwen3.describe, "llama3": llama3.describe, "gemma3": gemma3.describe, "qwen3_5": qwen3_5.describe,
         "olmo3": olmo3.describe, "tiny_aya": tiny_aya.describe, "gemma4": gemma4.describe}

# The name maps: a glass path inside block i (after "trf_blocks.{i}.") -> the object's own.
GPT2_HF = {"norm1": "ln_1", "norm2": "ln_2", "att": "attn", "att.out_proj": "attn.c_proj", "ff": "mlp",
           "ff.layers.0": "mlp.c_fc", "ff.layers.1": "mlp.act", "ff.layers.2": "mlp.c_proj"}
GPT2_QKV = ("att.W_query", "att.W_key", "att.W_value")  # row slices of attn.c_attn
GPT2_TOP = {"tok_emb": "transformer.wte", "pos_emb": "transformer.wpe", "final_norm": "transformer.ln_f",
            "out_head": "lm_head", "trf_blocks": "transformer.h"}
ROPE_HF = {"norm1": "input_layernorm", "norm2": "post_attention_layernorm", "att": "self_attn",
           "att.W_query": "self_attn.q_proj", "att.W_key": "self_attn.k_proj", "att.W_value": "self_attn.v_proj",
           "att.out_proj": "self_attn.o_proj", "att.q_norm": "self_attn.q_norm", "att.k_norm": "self_attn.k_norm",
           "ff": "mlp", "ff.fc1": "mlp.gate_proj", "ff.fc2": "mlp.up_proj", "ff.fc3": "mlp.down_proj"}
ROPE_TOP = {"tok_emb": "model.embed_tokens", "final_norm": "model.norm", "out_head": "lm_head", "trf_blocks": "model.layers"}
GEMMA3_HF = {"att": "self_attn", "att.W_query": "self_attn.q_proj", "att.W_key": "self_attn.k_proj",
             "att.W_value": "self_attn.v_proj", "att.out_proj": "self_attn.o_proj", "att.q_norm": "self_attn.q_norm",
             "att.k_norm": "self_attn.k_norm", "ff": "mlp", "ff.fc1": "mlp.gate_proj", "ff.fc2": "mlp.up_proj",
             "ff.fc3": "mlp.down_proj"} | {n: n for n in ("input_layernorm", "post_attention_layernorm",
                                                           "pre_feedforward_layernorm", "post_feedforward_layernorm")}
GEMMA3_TOP = ROPE_TOP | {"blocks": "model.layers"}


def describe_config(cfg) -> an.Anatomy:
    """What a model of `cfg` is made of, as its glass file declares it (a GPTConfig: model.py; a family's
    config: its family's file; a variant's: its file in variants/), before any weights exist: what memory.py
    counts bytes from."""
    return glass_description(cfg)


def describe(model: nn.Module) -> an.Anatomy:
    """What `model` is made of, each part named by its path in `model` (anatomy.py); one
    UnreadableModelError line for an object of no kind glassgpt reads."""
    if not isinstance(model, nn.Module):
        raise UnreadableModelError(f"a model must be an nn.Module, got {type(model).__name__}: glassgpt reads "
                                   f"{KINDS_READ}")
    if isinstance(model, gpt2.GPTModel):
        return _tied_by_storage(gpt2.describe(model.cfg), model)
    if variant_of(model):  # chapter 4's variants: their glass file's own describe (variants/)
        return _tied_by_storage(VARIANTS[type(model.cfg)].describe(model.cfg), model)
    for family, cls in FAMILIES.items():
        if isinstance(model, cls):
            return _tied_by_storage(GLASS[family](model.cfg), model)
    for family, (cls, _) in BONUS_MODELS.items():  # OLMo 3, Tiny Aya, Gemma 4
        if isinstance(model, cls):
            return _tied_by_storage(GLASS[family](model.cfg), model)
    return _tied_by_storage(_foreign(model), model)


def _foreign(model: nn.Module) -> an.Anatomy:
    bonus = _bonus_hf(model)
    if bonus is not None:
        return bonus
    try:
        found = family_layout(model)
    except (AttributeError, TypeError, KeyError, IndexError):
        found = None
    except UnreadableModelError:
        raise
    except GlassError as err:  # a transformers architecture not described, a book class without its cfg
        raise UnreadableModelError(f"{err}; glassgpt reads {KINDS_READ}") from None
    if found is not None:
        kind, cfg, _, stages = found
        anatomy = GLASS[cfg.family](cfg)
        if stages.get("tok_emb") == "tok_emb":  # the book's names: the glass file's own
            return replace(anatomy, source=kind)
        if getattr(cfg, "moe", False):  # transformers' experts fused, one 3-D tensor for all: no module per expert
            return replace(anatomy, source=f"{kind}, its fused experts read as the notebook's per-expert matrices "
                                           "(views of them): the paths are those of glassgpt.adopt(model)")
        if cfg.family == "gemma3":
            return an.renamed(anatomy, _mapper(GEMMA3_TOP, GEMMA3_HF), norm_leaves=("weight", None), source=kind)
        return an.renamed(anatomy, _mapper(ROPE_TOP, ROPE_HF), norm_leaves=("weight", None), source=kind)
    try:
        layout = layout_of(model)
        cfg = config_of(model, layout)
    except (AttributeError, TypeError, KeyError, IndexError, UnreadableModelError):
        raise UnreadableModelError(_unreadable(model)) from None
    anatomy = _as_read(replace(gpt2.describe(cfg), source=layout.kind), layout)
    if layout.stages.get("tok_emb") == "tok_emb":
        return _book_variants(model, anatomy, cfg.emb_dim)
    conv1d = layout.kind.startswith("transformers'")
    return an.renamed(anatomy, _gpt2_mapper(cfg.emb_dim, conv1d, model), norm_leaves=("weight", "bias"))


def _bonus_hf(model: nn.Module) -> an.Anatomy | None:
    """transformers' Olmo3ForCausalLM, Cohere2ForCausalLM or Gemma4ForCausalLM, described by the glass file over its
    config, every path mapped through families/bonus_hf.py's names; None for any other module."""
    config = getattr(model, "config", None)
    family = HF_MODEL_TYPES.get(getattr(config, "model_type", None))
    if family is None or "lm_head" not in dict(model.named_children()):
        return None
    cfg = bonus_config_from_hf(config.to_dict() | {"architectures": [type(model).__name__]}, type(model).__name__)
    inside = {ours: hf for hf, ours in (HF_LAYER_NAMES[family] | HF_WEIGHTLESS.get(family, {})).items()}
    top = {ours: hf for hf, ours in HF_TOP.items()} | {BLOCKS[family]: "model.layers", "trf_blocks": "model.layers"}
    return an.renamed(GLASS[family](cfg), _mapper(top, inside), norm_leaves=("weight", None),
                      source=f"transformers' {type(model).__name__}")


def _as_read(anatomy: an.Anatomy, layout) -> an.Anatomy:
    """GPT-2's description as this module has it: the biases and shifts it holds (glassgpt's forward adds
    zeros for the others), its norms' eps, and its GELU (exact erf in nanoGPT, the tanh form in the book's)."""
    has = layout.tensors

    def linear(lin: an.Linear) -> an.Linear:
        return replace(lin, bias=f"{lin.path}.bias" in has)

    def norm(n: an.Norm) -> an.Norm:
        return replace(n, eps=layout.eps, bias="shift" if f"{n.path}.shift" in has else None)

    def block(b: an.Block) -> an.Block:
        att, ff = b.attention, b.ff
        att = replace(att, query=linear(att.query), key=linear(att.key), value=linear(att.value), out=linear(att.out))
        ff = replace(ff, up=linear(ff.up), down=linear(ff.down), activation="gelu" if layout.exact_gelu else ff.activation)
        return replace(b, norms=tuple(norm(n) for n in b.norms), attention=att, ff=ff)

    return replace(anatomy, blocks=tuple(block(b) for b in anatomy.blocks), final_norm=norm(anatomy.final_norm),
                      head=replace(anatomy.head, bias="out_head.bias" in has))


def _unreadable(model: nn.Module) -> str:
    names = ", ".join(dict(model.named_children())) or "none"
    return (f"{type(model).__name__} is not a model glassgpt can describe: it looked for {LOOKED_FOR}, and this "
            f"module's top-level children are: {names}; glassgpt reads {KINDS_READ}")


def _mapper(top: dict[str, str], inside: dict[str, str]):
    def path_of(path: str) -> str:
        if path in top:
            return top[path]
        blocks, i, rest = (path.split(".", 2) + ["", ""])[:3]
        return f"{top['trf_blocks']}.{i}" + (f".{inside[rest]}" if rest else "")
    return path_of


def _gpt2_mapper(d: int, conv1d: bool, model: nn.Module):
    plain = _mapper(GPT2_TOP, GPT2_HF)

    def path_of(path: str):
        _, i, rest = (path.split(".", 2) + ["", ""])[:3]
        if rest in GPT2_QKV:
            j = GPT2_QKV.index(rest)
            return f"transformer.h.{i}.attn.c_attn", (j * d, (j + 1) * d), conv1d
        mapped = plain(path)
        if rest == "ff.layers.1":  # the activation: transformers' `act`, nanoGPT's `gelu`
            mlp = model.get_submodule(f"transformer.h.{i}.mlp")
            return f"transformer.h.{i}.mlp." + ("gelu" if hasattr(mlp, "gelu") else "act")
        if conv1d and rest in ("att.out_proj", "ff.layers.0", "ff.layers.2"):
            return mapped, None, True
        return mapped
    return path_of


def _book_variants(model: nn.Module, anatomy: an.Anatomy, d: int) -> an.Anatomy:
    """The book's GPTModel (its names already), or its GPTModelFast: one qkv matrix, `proj`, nn.LayerNorm."""
    if not hasattr(model.trf_blocks[0].att, "qkv"):
        return anatomy

    def path_of(path: str):
        head, _, leaf = path.rpartition(".att.")
        if leaf in ("W_query", "W_key", "W_value"):
            j = ("W_query", "W_key", "W_value").index(leaf)
            return f"{head}.att.qkv", (j * d, (j + 1) * d), False
        return f"{head}.att.proj" if leaf == "out_proj" else path
    return an.renamed(anatomy, path_of, norm_leaves=("weight", "bias"))


def _tied_by_storage(anatomy: an.Anatomy, model: nn.Module) -> an.Anatomy:
    """The head's tie as the live tensors have it (one storage), whatever the config said."""
    try:
        emb = model.get_submodule(anatomy.embedding.path).weight
        head = getattr(model.get_submodule(anatomy.head.path), "weight", None)
    except AttributeError:
        return anatomy
    tied = head is not None and same_storage(head, emb)
    return replace(anatomy, head=replace(anatomy.head, tied=tied))


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Tied is told by storage, never by equal values (a copied embedding is not a tie)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride())


# --- the description against its module ------------------------------------------------------------

def description_mismatches(model: nn.Module, anatomy: an.Anatomy) -> list[str]:
    """Each part where `anatomy` and `model` disagree, one line each: a path with no module, a matrix or
    norm of another shape, a bias where none is described (or none where one is), a tie the storage does
    not have, a norm whose formula (tried on a probe) is not the described kind, a head count that does
    not divide its matrices. Empty: they agree."""
    wrong: list[str] = []

    def module(path: str | None, what: str) -> nn.Module | None:
        try:
            return model.get_submodule(path)
        except (AttributeError, TypeError):
            wrong.append(f"{what}: no module at {path!r}")
            return None

    emb = module(anatomy.embedding.path, "embedding")
    e = anatomy.embedding
    if emb is not None and list(emb.weight.shape) != [e.vocab_size, e.emb_dim]:
        wrong.append(f"embedding {e.path}: weight {list(emb.weight.shape)}, described [{e.vocab_size}, {e.emb_dim}]")
    per_layer = e.per_layer_inputs
    if per_layer is not None:  # Gemma 4's second table: n_layers vectors of dim per token
        table = module(e.per_layer, "per-layer embeddings")
        if table is not None and list(table.weight.shape) != [per_layer.vocab_size, per_layer.n_layers * per_layer.dim]:
            wrong.append(f"per-layer embeddings {e.per_layer}: weight {list(table.weight.shape)}, described "
                         f"[{per_layer.vocab_size}, {per_layer.n_layers * per_layer.dim}]")
    if anatomy.positions.kind == "learned":
        pos = module(anatomy.positions.path, "positions")
        if pos is not None and list(pos.weight.shape) != [anatomy.positions.context_length, e.emb_dim]:
            wrong.append(f"positions {anatomy.positions.path}: weight {list(pos.weight.shape)}, described "
                         f"[{anatomy.positions.context_length}, {e.emb_dim}]")
    blocks = module(anatomy.blocks_path, "blocks")
    if blocks is not None and len(blocks) != anatomy.n_layers:
        wrong.append(f"blocks {anatomy.blocks_path}: {len(blocks)} blocks, described {anatomy.n_layers}")
    for lin in anatomy.linears():
        wrong += _linear_mismatches(module(lin.path, "matrix"), lin)
    for block in anatomy.blocks:
        att = block.attention
        if block.output_scale is not None:  # one stored number (Gemma 4's layer_scalar)
            scale = getattr(module(block.path, "block"), block.output_scale, None)
            if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
                wrong.append(f"block {block.path}: no one-number tensor {block.output_scale!r}, described as the "
                             "scale of its output")
        if att.query.out_features != att.n_heads * att.head_dim or att.key.out_features != att.n_kv_groups * att.head_dim:
            wrong.append(f"attention {att.path}: {att.n_heads} heads and {att.n_kv_groups} groups of {att.head_dim} "
                         f"do not fill W_query's {att.query.out_features} and W_key's {att.key.out_features} rows")
    for norm in anatomy.norms():
        wrong += _norm_mismatches(module(norm.path, "norm"), norm)
    head = module(anatomy.head.path, "head")
    if head is not None and emb is not None:
        w = getattr(head, "weight", None)
        if w is not None and list(w.shape) != [anatomy.head.out_features, e.emb_dim]:
            wrong.append(f"head {anatomy.head.path}: weight {list(w.shape)}, described [{anatomy.head.out_features}, "
                         f"{e.emb_dim}]")
        if w is not None and same_storage(w, emb.weight) != anatomy.head.tied:
            wrong.append(f"head {anatomy.head.path}: described {'tied' if anatomy.head.tied else 'untied'}, but its "
                         f"weight {'shares' if not anatomy.head.tied else 'does not share'} the embedding's storage")
    return wrong


def _linear_mismatches(mod: nn.Module | None, lin: an.Linear) -> list[str]:
    if mod is None:
        return []
    w = getattr(mod, "weight", None)
    if not isinstance(w, torch.Tensor):
        return [f"matrix {lin.path}: no weight"]
    w = w.t() if lin.transposed else w  # as nn.Linear stores it, [out, in]
    if lin.rows is not None:
        w = w[lin.rows[0]:lin.rows[1]]
    if lin.head_rows is not None and w.shape[0] % lin.head_rows[0] == 0:  # rows start..stop of every block
        block, start, stop = lin.head_rows
        w = w.reshape(-1, block, w.shape[-1])[:, start:stop].reshape(-1, w.shape[-1])
    where = lin.path + ("" if lin.rows is None else f"[{lin.rows[0]}:{lin.rows[1]}]")
    found = []
    if list(w.shape) != [lin.out_features, lin.in_features]:
        found.append(f"matrix {where}: [out, in] {list(w.shape)}, described [{lin.out_features}, {lin.in_features}]")
    has_bias = getattr(mod, "bias", None) is not None
    if has_bias != lin.bias:
        found.append(f"matrix {lin.path}: {'a' if has_bias else 'no'} bias, described {'with' if lin.bias else 'without'}")
    return found


def _norm_mismatches(mod: nn.Module | None, norm: an.Norm) -> list[str]:
    if mod is None:
        return []
    if norm.weight is None:  # x / rms(x) alone: the module holds no weight, and computes that on a probe
        held = [name for name, _ in mod.named_parameters()]
        if held:
            return [f"norm {norm.path}: holds {held[0]!r}, described without a weight"]
        kind = norm_kind_by_behaviour(mod, torch.ones(norm.dim), None, norm.eps)
        return [] if kind == norm.kind else [f"norm {norm.path}: computes {kind or 'none of ' + ', '.join(an.NORM_KINDS)}"
                                             f" on a probe, described a weightless {norm.kind}"]
    weight = getattr(mod, norm.weight, None)
    if not isinstance(weight, torch.Tensor) or list(weight.shape) != [norm.dim]:
        shape = list(weight.shape) if isinstance(weight, torch.Tensor) else None
        return [f"norm {norm.path}: its {norm.weight!r} is {shape}, described [{norm.dim}]"]
    bias = getattr(mod, norm.bias, None) if norm.bias else None
    if norm.bias and not isinstance(bias, torch.Tensor):
        return [f"norm {norm.path}: no {norm.bias!r}, described with a shift"]
    kind = norm_kind_by_behaviour(mod, weight, bias, norm.eps)
    if kind != norm.kind:
        return [f"norm {norm.path}: computes {kind or 'none of ' + ', '.join(an.NORM_KINDS)} on a probe, described "
                f"{norm.kind}"]
    return []


@torch.no_grad()
def norm_kind_by_behaviour(mod: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> str | None:
    """Which of anatomy.NORM_KINDS the module computes, told by running it on a probe with a mean of its own
    (so LayerNorm and RMSNorm part) against each formula over the module's own weight and bias."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, weight.shape[0], generator=gen) + 0.5).to(weight.device, weight.dtype)
    out = mod(x).double()
    xd, w = x.double(), weight.double()
    b = torch.zeros_like(w) if bias is None else bias.double()
    rms = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    centred = xd - xd.mean(-1, keepdim=True)
    candidates = {"layernorm": centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * w + b,
                  "rmsnorm": rms * w + b, "rmsnorm_plus_one": rms * (1 + w) + b}
    tol = 1e-3 if weight.dtype == torch.float32 or weight.dtype == torch.float64 else 5e-2
    for kind, expected in candidates.items():
        if torch.allclose(out, expected, atol=tol, rtol=tol):
            return kind
    return None


# --- the glass model of a config, and its description (what an analysis builds without naming a model file) ----

def config_key(cfg: object) -> str | None:
    """Which glass file a config is for: "gpt2", a family ("qwen3", "gemma3", "olmo3", ...) or chapter 4's
    variant ("gqa", "mla", "swa", "moe"); None for anything else."""
    if isinstance(cfg, tuple(VARIANTS)):
        return VARIANTS[type(cfg)].__name__.rpartition(".")[2]
    if isinstance(cfg, GPTConfig):
        return "gpt2"
    family = getattr(cfg, "family", None)
    return family if family in GLASS else None


def glass_model(cfg: object) -> nn.Module:
    """glassgpt's glass model of `cfg` (any config config_key knows), with PyTorch's default initialisation."""
    key = config_key(cfg)
    if key is None:
        raise GlassError(f"{type(cfg).__name__} is no config glassgpt builds a model of: {KINDS_READ}")
    if key == "gpt2":
        return gpt2.GPTModel(cfg)
    if key in ("gqa", "mla", "swa", "moe"):
        return build_variant(cfg)
    return build_family(cfg)


CONFIG_TYPES = {"gemma3": gemma3.Gemma3Config, "olmo3": olmo3.Olmo3Config, "tiny_aya": tiny_aya.TinyAyaConfig,
                "qwen3_5": qwen3_5.Qwen3_5Config, "gemma4": gemma4.Gemma4Config} | {
                    m.__name__.rpartition(".")[2]: c for c, m in VARIANTS.items()}


def config_type(key: str) -> type:
    """The config class of a glass file ("gpt2", a family, a variant): GPTConfig, FamilyConfig or its own."""
    return GPTConfig if key == "gpt2" else CONFIG_TYPES.get(key, FamilyConfig)


def glass_class(cfg: object) -> type:
    """The class glass_model builds for `cfg`."""
    key = config_key(cfg)
    if key == "gpt2":
        return gpt2.GPTModel
    if key in ("gqa", "mla", "swa", "moe"):
        return VARIANTS[type(cfg)].GPTModel
    return BONUS_MODELS[key][0] if key in BONUS_MODELS else FAMILIES[key]


def glass_description(cfg: object) -> an.Anatomy:
    """The glass file's own describe(cfg): the anatomy of glass_model(cfg), and of a reader's subclass of it."""
    key = config_key(cfg)
    if key == "gpt2":
        return gpt2.describe(cfg)
    if key in ("gqa", "mla", "swa", "moe"):
        return VARIANTS[type(cfg)].describe(cfg)
    return GLASS[key](cfg)

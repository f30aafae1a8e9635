"""check(piece): any piece of the book as the reader wrote it, against glassgpt's formula for it.

    glassgpt.check(MultiHeadAttention)                       # a class: built with the book's chapter-3 arguments
    glassgpt.check(MultiHeadAttention(768, 768, 1024, 0.0, 12))
    glassgpt.check(generate)                                 # a function: called as the book calls it
    glassgpt.check(model)                                    # a whole GPT: verify.py, stage by stage

What a piece is comes from its class or function name (the book's), then its constructor's
arguments, then what it holds (W_query and heads, scale and shift, encode and decode, windows).
Each kind's check lives beside its chapter: data.py (chapter 2), attention.py (3), layers.py
(4), functions.py (4 to 7), next_models.py (Qwen3, Llama 3.2), bonus_models.py (the bonus notebooks'
own pieces: Gemma 3, OLMo 3, Qwen3.5, Tiny Aya), qwen3_5_gemma4.py (Qwen3.5's gated attention, Gemma 4's
attention, norm and feed-forward, the partial RoPE tables); report.py holds what they share. Their pictures, and
show(piece, input), are views: views/pieces.py.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch
from torch import nn

from ...adopt import check_computable, read_in_place
from ...errors import GlassError
from ..debugger import LayerReport, debug
from ..verify import DEFAULT_TEXT
from ..verify import check as check_model, is_described_port  # GPT-2, or any other described model
from .attention import check_attention
from .data import check_dataset, check_dataset_class, check_loader_function, check_tokenizer
from .functions import CHECKS as FUNCTION_CHECKS, check_function
from .layers import check_block, check_feed_forward, check_gelu, check_layer_norm
from .cache import blocks_of, check_attention_cache, check_cache, has_attention_cache, has_cache_api
from .report import PieceError, PieceResult
from .data import SlidingWindows, sliding_windows
from .next_models import FAMILY_KINDS, check_apply_rope, check_gqa, check_moe, check_rms_norm, check_rope_params, check_swiglu
from .bonus_models import (BONUS_KINDS, PRESETS as BONUS_PRESETS, bonus_kind, check_cohere_layer_norm,
                           check_gated_delta_net, check_gemma_attention, check_geglu, check_olmo_attention,
                           check_rms_norm_plus_one, check_tiny_aya_attention, delta_adapter, family_of_class)
from .qwen3_5_gemma4 import (KINDS as GATED_KINDS, PRESETS as GATED_PRESETS, check_gemma4_attention,
                             check_gemma4_feed_forward, check_gemma4_rms_norm, check_partial_rope_params, check_qwen3_5_attention, is_layered_attention,
                             kind_of as gated_kind, layer_to_build)

GPT_CONFIG_124M = {"vocab_size": 50257, "context_length": 1024, "emb_dim": 768, "n_heads": 12, "n_layers": 12,
                   "drop_rate": 0.1, "qkv_bias": False}
_CH03_MHA = {"d_in": 3, "d_out": 2, "context_length": 6, "dropout": 0.0, "num_heads": 2}
# Tiny configs of the book's Qwen3 (and its mixture of experts) and Llama 3.2 dicts: a piece or a whole
# model of either builds from them in a moment (the book's own sizes take gigabytes).
QWEN3_TINY = {"vocab_size": 97, "context_length": 24, "emb_dim": 32, "n_heads": 4, "n_layers": 2, "hidden_dim": 48,
              "head_dim": 16, "qk_norm": True, "n_kv_groups": 2, "rope_base": 1_000_000.0, "dtype": torch.float32}
QWEN3_MOE_TINY = {**QWEN3_TINY, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24}
LLAMA3_TINY = {"vocab_size": 97, "context_length": 24, "emb_dim": 32, "n_heads": 4, "n_layers": 2, "hidden_dim": 48,
               "n_kv_groups": 2, "rope_base": 500_000.0, "dtype": torch.float32,
               "rope_freq": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_context_length": 4}}
# The book's constructor arguments for each class, in its chapters' examples.
PRESETS: dict[str, dict[str, Any]] = {
    "ch03": {"SelfAttention_v1": {"d_in": 3, "d_out": 2}, "SelfAttention_v2": {"d_in": 3, "d_out": 2},
             "CausalAttention": {"d_in": 3, "d_out": 2, "context_length": 6, "dropout": 0.0},
             "MultiHeadAttentionWrapper": _CH03_MHA, "MultiHeadAttention": _CH03_MHA},
    "ch04": {"MultiHeadAttention": {"d_in": 768, "d_out": 768, "context_length": 1024, "dropout": 0.0,
                                    "num_heads": 12},
             "LayerNorm": {"emb_dim": 5}, "GELU": {}, "FeedForward": GPT_CONFIG_124M,
             "TransformerBlock": GPT_CONFIG_124M, "GPTModel": GPT_CONFIG_124M},
    "qwen3": {"GroupedQueryAttention": QWEN3_TINY, "RMSNorm": {"emb_dim": 32}, "FeedForward": QWEN3_TINY,
              "MoEFeedForward": QWEN3_MOE_TINY, "Qwen3Model": QWEN3_TINY},
    "llama3": {"GroupedQueryAttention": LLAMA3_TINY, "RMSNorm": {"emb_dim": 32}, "FeedForward": LLAMA3_TINY,
               "Llama3Model": LLAMA3_TINY},
    **BONUS_PRESETS,  # the bonus notebooks' pieces: gemma3, olmo3, qwen3_5, tiny_aya
    "qwen3_5": {**BONUS_PRESETS["qwen3_5"], **GATED_PRESETS["qwen3_5"]},  # and its gated full attention
    "gemma4": GATED_PRESETS["gemma4"],
}
# A model's config names, as a piece's constructor names them (a piece built "with a config").
CONFIG_NAMES = {"d_in": "emb_dim", "d_out": "emb_dim", "num_heads": "n_heads", "num_kv_groups": "n_kv_groups",
                "head_dim": "head_dim", "qk_norm": "qk_norm", "dtype": "dtype", "emb_dim": "emb_dim",
                "context_length": "context_length", "dropout": "drop_rate", "qkv_bias": "qkv_bias"}
ATTENTION = ("SelfAttention_v1", "SelfAttention_v2", "CausalAttention", "MultiHeadAttentionWrapper", "MultiHeadAttention")
LAYERS = ("LayerNorm", "GELU", "FeedForward", "TransformerBlock", "GPTModel")
DATA = ("SimpleTokenizerV1", "SimpleTokenizerV2", "a tiktoken-style tokenizer (encode/decode)", "GPTDatasetV1",
        "a dataset or DataLoader of windows", "create_dataloader_v1")
KNOWN = (*DATA, *ATTENTION, *LAYERS, *FUNCTION_CHECKS, *FAMILY_KINDS, *BONUS_KINDS, *GATED_KINDS, "Qwen3Model",
         "Llama3Model")
HOW_TO_SAY = ("; say which by the book's class name (e.g. class GroupedQueryAttention), or build it with the "
              "book's arguments, which also name a bonus model's family: --args ch03, ch04, qwen3, llama3, gemma3, "
              "olmo3, qwen3_5 or tiny_aya (in Python, args=...); Gemma 4's attention: --args gemma4")
BONUS_CHECKS = {"RMSNorm (1 + weight)": check_rms_norm_plus_one, "GeGLU FeedForward": check_geglu,
                "Gemma 3 GroupedQueryAttention": check_gemma_attention,
                "OLMo 3 GroupedQueryAttention": check_olmo_attention,
                "Tiny Aya GroupedQueryAttention": check_tiny_aya_attention, "GatedDeltaNet": check_gated_delta_net,
                "CohereLayerNorm": check_cohere_layer_norm, "Qwen3.5 GroupedQueryAttention": check_qwen3_5_attention,
                "Gemma 4 Attention": check_gemma4_attention, "Gemma4RMSNorm": check_gemma4_rms_norm,
                "Gemma4FeedForward (GeGLU)": check_gemma4_feed_forward}
CFG_CLASSES = ("FeedForward", "TransformerBlock", "GPTModel")  # the classes built from one config dict


def known_kinds() -> str:
    return ", ".join(KNOWN) + HOW_TO_SAY


def check(piece: Any, text: str | None = None, ids: list[int] | None = None, *, args: Any = None,
          max_length: int | None = None, stride: int | None = None, inputs: torch.Tensor | None = None,
          against: str | None = None) -> PieceResult | LayerReport:
    """Check `piece` (a class, an instance, a function or a tokenizer of the book's chapters 2 to 7)
    against glassgpt's formula for it: see the module's docstring. A whole GPT model goes to
    verify.check(model, text, ids). A class is built with `args` (a dict of its constructor's
    arguments, or "ch03" / "ch04" for the book's; default: the book's for its chapter) after
    torch.manual_seed(123). A dataset already built needs the `text`, `max_length` and `stride`
    it was built with. `inputs`: a module's input instead of the book's. `against="transformers"`: the
    layer debugger (debugger.py) on a whole GPT-2, Qwen3 or Llama model or its class, `args` its config."""
    if against is not None:
        return debug(piece, args, against=against)
    if isinstance(piece, type):
        if is_dataset_class(piece):
            return check_dataset_class(piece)
        return check(build(piece, args), text, ids, inputs=inputs)
    if inspect.isfunction(piece) or inspect.ismethod(piece):
        return _check_callable(piece)
    if isinstance(piece, nn.Module):
        check_computable(piece)  # a NaN, inf or meta tensor is named before anything runs
    if isinstance(piece, nn.Module) and hasattr(piece, "tok_emb") and blocks_of(piece) is not None and \
            has_cache_api(piece):
        return _staged_then_cached(piece, text, ids)  # a model with the book's KV cache: cached against uncached
    if has_attention_cache(piece):
        return check_attention_cache(piece)
    kind = "a GPT model" if isinstance(piece, nn.Module) and is_described_port(piece) else identify(piece)
    if kind in ("GPTModel", "a GPT model"):
        return _with_part_property(piece, check_model(piece, text or DEFAULT_TEXT, ids))
    try:
        if kind in BONUS_CHECKS:
            return BONUS_CHECKS[kind](piece, inputs)
        if kind in FAMILY_KINDS:
            return {"GroupedQueryAttention": check_gqa, "RMSNorm": check_rms_norm, "SwiGLU FeedForward": check_swiglu,
                    "MoEFeedForward": check_moe}[kind](piece, inputs)
        if kind in ATTENTION:
            return check_attention(piece, kind, inputs)
        if kind in ("LayerNorm", "GELU", "FeedForward", "TransformerBlock"):
            return {"LayerNorm": check_layer_norm, "GELU": check_gelu, "FeedForward": check_feed_forward,
                    "TransformerBlock": check_block}[kind](piece, inputs)
    except AttributeError as err:  # a part of the book's names is missing
        raise PieceError(f"{type(piece).__name__} looks like the book's {kind} but has {err}") from None
    if kind == "tokenizer":
        return check_tokenizer(piece, type(piece).__name__)
    return check_dataset(piece, kind, text, max_length, stride)


def _with_part_property(model: nn.Module, result: Any) -> Any:
    """A whole model whose first differing stage no known mistake reproduces: that part (or its block, for
    a shortcut) checked alone on the book's inputs, so the finding names the property it breaks."""
    first = getattr(result, "first", None)
    if first is None or first.non_finite:
        return result
    name = first.name.rsplit(".", 1)[0] if ".shortcut" in first.name else first.name
    try:
        part = model.get_submodule(name)
        alone = check(part)
    except (AttributeError, GlassError):
        return result
    if isinstance(alone, PieceResult) and not alone.ok and alone.prop is not None:
        if result.mistake is None and getattr(result, "prop", None) is None:  # (a named line, or a property found
            # on the model's own tensors, keeps its finding; the part's property is noted beside it)
            head = re.split(r"; (?:it keeps what was checked|no known mistake)", result.finding)[0]
            result.finding = f"{head}; checked alone on the book's inputs, {name}: {alone.finding}"
        result.notes = [*result.notes, f"property broken: {alone.prop} ({alone.stage}, {alone.where})"]
    return result


def _staged_then_cached(model: nn.Module, text: str | None, ids: list[int] | None) -> Any:
    """A whole model with the book's KV cache: glassgpt's own described ones (chapter 4's variants) first stage by
    stage against their description (the result where a stage differs), then cached against uncached, its lines
    saying the stages matched; a reader's port, cached against uncached."""
    if not (is_described_port(model) and type(model).__module__.startswith("glassgpt.")):
        return check_cache(model, text, ids)
    staged = check_model(model, text or DEFAULT_TEXT, ids)
    if not staged.ok:
        return _with_part_property(model, staged)
    cached = check_cache(model, text, ids)
    cached.lines = [*cached.lines, f"stage by stage against its description: {staged.finding}"]
    return cached


def is_whole_model(m: Any) -> bool:
    """Whether `m` is a whole GPT that verify.py checks stage by stage (not one of its parts)."""
    if not isinstance(m, nn.Module):
        return False
    if type(m).__name__ in ATTENTION or type(m).__name__ in LAYERS[:-1]:
        return False
    if is_described_port(m):  # Qwen3, Gemma 3, OLMo 3, Tiny Aya, Qwen3.5, chapter 4's variants, ...
        return True
    try:
        read_in_place(m)
        return True
    except GlassError:
        return False


def identify(piece: Any) -> str:
    """The kind of `piece`, from its class name, then what it holds; a PieceError naming the known kinds."""
    name = type(piece).__name__
    if isinstance(piece, nn.Module):
        gated = gated_kind(piece)  # Qwen3.5's gated full attention, Gemma 4's: told by what they hold
        if gated is not None:
            return gated
        bonus = bonus_kind(piece)
        if bonus is not None:
            return bonus
        if all(hasattr(piece, n) for n in ("fc1", "fc2", "fc3")):
            return "MoEFeedForward" if hasattr(piece, "gate") else "SwiGLU FeedForward"
        if name in ATTENTION or name in LAYERS:
            return name
        if hasattr(piece, "num_kv_groups") and hasattr(piece, "W_query"):
            return "GroupedQueryAttention"
        if name == "RMSNorm" or (isinstance(piece, nn.RMSNorm)):
            return "RMSNorm"
        return _module_by_contents(piece, name)
    if callable(getattr(piece, "encode", None)) and callable(getattr(piece, "decode", None)):
        return "tokenizer"
    if isinstance(piece, torch.utils.data.DataLoader):
        return "DataLoader"
    if hasattr(piece, "__getitem__") and hasattr(piece, "__len__") and len(piece) and _is_pair(piece[0]):
        return "dataset"
    raise PieceError(f"{name} is no kind glassgpt check knows: it knows {known_kinds()}")


def _module_by_contents(m: nn.Module, name: str) -> str:
    children = dict(m.named_children())
    if isinstance(children.get("heads"), nn.ModuleList):
        return "MultiHeadAttentionWrapper"
    if hasattr(m, "W_query"):
        if hasattr(m, "out_proj"):
            return "MultiHeadAttention"
        if not isinstance(m.W_query, nn.Module):
            return "SelfAttention_v1"
        return "CausalAttention" if hasattr(m, "mask") or hasattr(m, "dropout") else "SelfAttention_v2"
    if {"att", "ff", "norm1", "norm2"} <= set(children):
        return "TransformerBlock"
    if hasattr(m, "scale") and hasattr(m, "shift"):
        return "LayerNorm"
    if isinstance(children.get("layers"), nn.Sequential):
        return "FeedForward"
    try:
        read_in_place(m)
        return "a GPT model"
    except GlassError:
        pass
    if not list(m.parameters()) and "gelu" in name.lower():
        return "GELU"
    raise PieceError(f"{name} is no kind glassgpt check knows (by its name, its constructor's arguments or what "
                     f"it holds): it knows {known_kinds()}")


def _is_pair(item: Any) -> bool:
    return isinstance(item, (tuple, list)) and len(item) == 2 and all(torch.is_tensor(t) for t in item)


def is_dataset_class(cls: type) -> bool:
    params = list(inspect.signature(cls.__init__).parameters)[1:]
    return cls.__name__ == "GPTDatasetV1" or params[:4] == ["txt", "tokenizer", "max_length", "stride"]


def _check_callable(fn) -> PieceResult:
    name = fn.__name__
    params = list(inspect.signature(fn).parameters)
    if name == "apply_rope" or params[:3] == ["x", "cos", "sin"]:
        return check_apply_rope(fn)
    if (name == "compute_rope_params" or params[:2] == ["head_dim", "theta_base"]) and \
            ("rope_type" in params or "partial_rotary_factor" in params):
        return check_partial_rope_params(fn)  # Gemma 4's or Qwen3.5's
    if name == "compute_rope_params" or params[:2] == ["head_dim", "theta_base"]:
        return check_rope_params(fn)
    if name in FUNCTION_CHECKS:
        return check_function(fn, name)
    if name == "create_dataloader_v1":
        return check_loader_function(fn)
    params = list(inspect.signature(fn).parameters)
    by_signature = {("model", "idx", "max_new_tokens", "context_size"): "generate_text_simple",
                    ("input_batch", "target_batch", "model", "device"): "calc_loss_batch",
                    ("batch", "pad_token_id", "ignore_index"): "custom_collate_fn", ("entry",): "format_input"}
    for head, kind in by_signature.items():
        if tuple(params[:len(head)]) == head:
            if kind == "generate_text_simple" and "temperature" in params:
                kind = "generate"
            return check_function(fn, kind)
    raise PieceError(f"the function {name} is no kind glassgpt check knows: it knows {known_kinds()}")


def preset_args(name: str, preset: str) -> Any:
    if preset not in PRESETS:
        raise PieceError(f"--args {preset!r}: give a JSON object of the constructor's arguments, or one of "
                         f"{', '.join(PRESETS)}")
    if name not in PRESETS[preset]:
        where = [p for p, classes in PRESETS.items() if name in classes]
        raise PieceError(f"{preset} has no arguments for {name}: " +
                         (f"use {' or '.join(where)}" if where else f"give them as JSON; {preset} has "
                          f"{', '.join(PRESETS[preset])}"))
    return PRESETS[preset][name]


def build(cls: type, args: Any = None, seed: int = 123) -> Any:
    """cls built as the book builds it: with `args` (a dict of its arguments, a model's config dict, or a
    preset's name), after torch.manual_seed(seed); a one-line PieceError when it cannot be. Without
    args: the book's for its chapter or model (the first preset it builds with)."""
    name = cls.__name__
    if args is None:
        kind = name if any(name in p for p in PRESETS.values()) else _kind_by_signature(cls)
        presets = [p for p in PRESETS if kind in PRESETS[p]] if kind else []
        if not presets:
            raise PieceError(f"{name} is no kind glassgpt check knows (by its name or its constructor's "
                             f"arguments): it knows {known_kinds()}")
        params = set(inspect.signature(cls.__init__).parameters)
        presets.sort(key=lambda p: p != "llama3" if "d_out" in params and "num_kv_groups" in params else 0)
        presets.sort(key=lambda p: p != family_of_class(cls))  # a bonus model's piece: its family's first
        errors = []
        for preset in presets:
            try:
                return build(cls, PRESETS[preset][kind], seed)
            except PieceError as err:
                errors.append(err)
        raise errors[0]
    family = family_of_class(cls, args)
    if isinstance(args, str):
        args = preset_args(_kind_by_signature(cls) or name, args)
    params = [p for p in inspect.signature(cls.__init__).parameters.values()][1:]
    delta = _kind_by_signature(cls) == "GatedDeltaNet" and isinstance(args, dict)
    layered = is_layered_attention(cls) and isinstance(args, dict)  # Gemma 4's attention: (cfg, layer_idx)
    one_config = len(params) == 1 and params[0].kind is params[0].POSITIONAL_OR_KEYWORD and (
        params[0].name in ("cfg", "config") or (isinstance(args, dict) and set(args) - {params[0].name}))
    if isinstance(args, dict) and not one_config and not delta and not layered:
        args = from_config(args, [p.name for p in params])
    torch.manual_seed(seed)
    try:
        if delta:  # the notebook's Qwen3_5GatedDeltaNet(config, layer_idx) reads attributes, not a dict
            built = cls(delta_adapter(args), 0)
        elif layered:  # its first full layer: the one with partial RoPE
            built = cls(args, layer_to_build(args))
        else:
            built = cls(args) if one_config or not isinstance(args, dict) else cls(**args)
        if isinstance(built, nn.Module):  # what it was built with: the bonus checks read the family and arguments
            built._glassgpt_family = family or family_of_class(cls, args)
            built._glassgpt_args = args if isinstance(args, dict) else None
        return _materialized(built, seed) if isinstance(built, nn.Module) else built
    except Exception as err:
        raise PieceError(f"{name}{inspect.signature(cls.__init__)} could not be built with {args}: "
                         f"{type(err).__name__}: {err}; pass its arguments as --args '{{...}}' or a preset, "
                         f"--args {', '.join(list(PRESETS)[:-1])} or {list(PRESETS)[-1]}") from None


def _materialized(module: nn.Module, seed: int) -> nn.Module:
    """A module built with weights on the meta device (the book's MoEFeedForward keeps its experts there
    until loaded) given seeded random ones, as its layers initialize themselves."""
    if not any(p.is_meta for p in module.parameters()):
        return module
    module.to_empty(device="cpu")
    torch.manual_seed(seed)
    for m in module.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    return module


def from_config(args: dict[str, Any], params: list[str]) -> dict[str, Any]:
    """A piece's own arguments from a model's config dict (emb_dim -> d_in, n_heads -> num_heads, ...),
    where `args` names none of its parameters but is a config; else `args` as given."""
    if set(args) <= set(params) or "emb_dim" not in args:
        return args
    return {p: args[CONFIG_NAMES[p]] for p in params if p in CONFIG_NAMES and CONFIG_NAMES[p] in args}


def _kind_by_signature(cls: type) -> str | None:
    params = tuple(list(inspect.signature(cls.__init__).parameters)[1:])
    if "GatedDeltaNet" in cls.__name__ or params[:2] == ("config", "layer_idx"):
        return "GatedDeltaNet"
    if cls.__name__ == "CohereLayerNorm":
        return "CohereLayerNorm"
    if "num_kv_groups" in params:
        return "GroupedQueryAttention"
    if params[:5] == ("d_in", "d_out", "context_length", "dropout", "num_heads"):
        return "MultiHeadAttention"  # or the wrapper: both take these; the instance tells them apart
    if params[:4] == ("d_in", "d_out", "context_length", "dropout"):
        return "CausalAttention"
    if params[:2] == ("d_in", "d_out"):
        return "SelfAttention_v2"
    if params == ("emb_dim",):
        return "LayerNorm"
    return None

"""The bonus models' own pieces, as the book's ch05 notebooks write them (12_gemma3, 13_olmo3, 15_tiny-aya,
16_qwen3.5), against glassgpt's formulas in float64 (the gated delta rule: families/qwen3_5.py's, float32).

    RMSNorm (1 + weight)          Gemma 3's and Qwen3.5's: x / rms(x) * (1 + weight), the weight starting at 0
    GeGLU FeedForward             Gemma 3's: fc3(gelu_tanh(fc1(x)) * fc2(x))
    Gemma 3 GroupedQueryAttention QK-norm per head, scores times query_pre_attn_scalar^-0.5, a sliding window
    OLMo 3 GroupedQueryAttention  QK-norm over the whole projection (h * hd values) before the split into heads
    Tiny Aya GroupedQueryAttention QK-norm a CohereLayerNorm per head, RoPE in its sliding layers only
    GatedDeltaNet                 Qwen3.5's linear attention: a short causal convolution, the gated delta rule
    CohereLayerNorm               Tiny Aya's: LayerNorm without a bias, weight * (x - mean) / sqrt(var + eps)

Which family a piece belongs to is read from what it was built with (a preset's name, a config's keys, its
constructor's parameters), then from the model class beside it in its file, then from what it holds (a
weight that starts at zero, `scaling`, a q_norm as wide as the whole projection). Where a piece differs,
the property its formula guarantees is checked first (properties.py), then a short catalogue names the line.
"""

from __future__ import annotations

import copy
import inspect
import math
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...families.layers import apply_rope, compute_rope_params
from . import properties
from .attention import _Softmaxes
from .next_models import _compare_out, _eval, _unexplained, check_rms_norm
from .properties import Broken
from .report import PieceResult, as_double, first_row_that_differs, found, run_reader, same

BONUS_KINDS = ("RMSNorm (1 + weight)", "GeGLU FeedForward", "Gemma 3 GroupedQueryAttention",
               "OLMo 3 GroupedQueryAttention", "Tiny Aya GroupedQueryAttention", "GatedDeltaNet", "CohereLayerNorm")
FAMILIES = ("gemma3", "olmo3", "tiny_aya", "qwen3_5")
SEED = 123
DELTA_RTOL = 1e-4  # the reader's float32 delta rule (chunked or token by token) against glassgpt's float32 one

# Tiny sizes of the notebooks' configs: each piece builds in a moment. Gemma 3's query_pre_attn_scalar (24)
# differs from its head_dim (16) here, so that a scale by head_dim^-0.5 shows (in 270M both are 256).
GEMMA3_TINY = {"vocab_size": 97, "context_length": 24, "emb_dim": 32, "n_heads": 4, "n_layers": 2,
               "hidden_dim": 48, "head_dim": 16, "qk_norm": True, "n_kv_groups": 2, "rope_local_base": 10_000.0,
               "rope_base": 1_000_000.0, "sliding_window": 3, "layer_types": ["sliding_attention", "full_attention"],
               "query_pre_attn_scalar": 24, "dtype": torch.float32}
OLMO3_TINY = {"vocab_size": 97, "context_length": 24, "emb_dim": 32, "n_heads": 4, "n_kv_heads": 2, "n_layers": 2,
              "hidden_dim": 48, "head_dim": 16, "attention_bias": False, "sliding_window": 3,
              "layer_types": ["sliding_attention", "full_attention"], "rms_norm_eps": 1e-6, "rope_base": 500_000.0,
              "rope_attention_factor": 1.0, "rope_orig_max": 8, "dtype": torch.float32}
QWEN3_5_TINY = {"vocab_size": 97, "context_length": 24, "emb_dim": 32, "n_heads": 4, "n_layers": 2,
                "hidden_dim": 48, "head_dim": 16, "qk_norm": True, "n_kv_groups": 2, "rope_base": 10_000_000.0,
                "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "linear_conv_kernel_dim": 4,
                "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
                "linear_num_value_heads": 4, "layer_types": ["linear_attention", "full_attention"],
                "dtype": torch.float32}
TINY_AYA_TINY = {"vocab_size": 97, "context_length": 24, "emb_dim": 32, "n_heads": 4, "n_layers": 2,
                 "hidden_dim": 48, "head_dim": 8, "n_kv_heads": 2, "layer_norm_eps": 1e-5, "logit_scale": 1.0,
                 "dtype": torch.float32}
PRESETS = {
    "gemma3": {"RMSNorm": {"emb_dim": 32}, "FeedForward": GEMMA3_TINY,
               "GroupedQueryAttention": {"d_in": 32, "num_heads": 4, "num_kv_groups": 2, "head_dim": 16,
                                         "qk_norm": True, "query_pre_attn_scalar": 24}},
    "olmo3": {"RMSNorm": {"emb_dim": 32}, "FeedForward": OLMO3_TINY,
              "GroupedQueryAttention": {"d_in": 32, "num_heads": 4, "num_kv_groups": 2, "head_dim": 16}},
    "qwen3_5": {"RMSNorm": {"emb_dim": 32}, "FeedForward": QWEN3_5_TINY, "GatedDeltaNet": QWEN3_5_TINY},
    "tiny_aya": {"CohereLayerNorm": {"emb_dim": 32}, "FeedForward": TINY_AYA_TINY,
                 "GroupedQueryAttention": {"d_in": 32, "num_heads": 4, "num_kv_groups": 2, "head_dim": 8,
                                           "qk_norm": True}},
}
# What marks a family: a key of its config dict or a constructor parameter (alone, or two together: OLMo 3's
# and Tiny Aya's attention both take attn_type), and its model class's name.
MARKS = {"query_pre_attn_scalar": "gemma3", "rope_local_base": "gemma3", "rope_attention_factor": "olmo3",
         "rope_orig_max": "olmo3", "logit_scale": "tiny_aya", "layer_norm_eps": "tiny_aya",
         "linear_conv_kernel_dim": "qwen3_5"}
PAIRED_MARKS = {("attn_type", "sliding_window"): "olmo3", ("attn_type", "qk_norm"): "tiny_aya"}
MODELS = {"Gemma3Model": "gemma3", "Olmo3Model": "olmo3", "TinyAyaModel": "tiny_aya", "Qwen3_5Model": "qwen3_5"}
PLUS_ONE = ("gemma3", "qwen3_5")  # the families whose RMSNorm scales by (1 + weight)


def _rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(SEED)) * scale


def _compare(result: PieceResult, got: torch.Tensor, want: torch.Tensor, unit: str = "position",
             tol: float | None = None) -> bool:
    return _compare_out(result, got, want, unit, "glassgpt's formula", tol)


# --- which family ---------------------------------------------------------------------------------------

def family_of_class(cls: type, args: Any = None) -> str | None:
    """The bonus family a class belongs to: a preset's name, a config's keys, its constructor's parameters,
    then the one model class of a family beside it in its module."""
    if isinstance(args, str):
        return args if args in FAMILIES else None
    keys = list(args) if isinstance(args, dict) else []
    try:
        keys += list(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        pass
    marked = {MARKS[k] for k in keys if k in MARKS} | {family for pair, family in PAIRED_MARKS.items()
                                                       if set(pair) <= set(keys)}
    if len(marked) == 1:
        return marked.pop()
    module = sys.modules.get(getattr(cls, "__module__", ""), None)
    own = [f.__globals__ for f in vars(cls).values() if inspect.isfunction(f)]  # a file check loaded by path
    names = vars(module) if module is not None else own[0] if own else {}
    beside = {family for name, family in MODELS.items() if isinstance(names.get(name), type)}
    return beside.pop() if len(beside) == 1 else None


def family_of(piece: Any) -> str | None:
    """What build() noted on the piece, else what its class says."""
    noted = getattr(piece, "_glassgpt_family", None)
    return noted if noted is not None else family_of_class(type(piece))


def bonus_kind(piece: nn.Module) -> str | None:
    """The bonus piece `piece` is, from its family and what it holds; None: not one of them."""
    name, family = type(piece).__name__, family_of(piece)
    if all(hasattr(piece, n) for n in ("in_proj_qkv", "conv1d", "A_log")):
        return "GatedDeltaNet"
    if name == "CohereLayerNorm":
        return "CohereLayerNorm"
    if all(hasattr(piece, n) for n in ("fc1", "fc2", "fc3")) and not hasattr(piece, "gate") and \
            family in ("gemma3",):
        return "GeGLU FeedForward"
    if hasattr(piece, "num_kv_groups") and hasattr(piece, "W_query"):
        q_norm = getattr(piece, "q_norm", None)
        weight = _norm_weight(q_norm) if q_norm is not None else None
        whole = weight is not None and int(piece.num_heads) > 1 and weight.numel() == piece.W_query.out_features
        if family == "olmo3" or whole or (hasattr(piece, "attn_type") and hasattr(piece, "sliding_window")):
            return "OLMo 3 GroupedQueryAttention"
        if family == "tiny_aya" or hasattr(piece, "attn_type"):
            return "Tiny Aya GroupedQueryAttention"
        if family == "gemma3" or hasattr(piece, "scaling"):
            return "Gemma 3 GroupedQueryAttention"
        return None
    if name == "RMSNorm" or isinstance(piece, nn.RMSNorm):
        weight = _norm_weight(piece)
        if family in PLUS_ONE or (weight is not None and not bool(weight.detach().any())):
            return "RMSNorm (1 + weight)"
    return None


def _norm_weight(norm: nn.Module) -> torch.Tensor | None:
    for name in ("scale", "weight"):
        w = getattr(norm, name, None)
        if isinstance(w, torch.Tensor):
            return w
    return None


# --- RMSNorm (1 + weight) ------------------------------------------------------------------------------

def _rms64(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    x = as_double(x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale


def check_rms_norm_plus_one(norm: nn.Module, x: torch.Tensor | None = None) -> PieceResult:
    weight = _norm_weight(norm)
    if weight is None:
        raise AttributeError("no scale (or weight): glassgpt reads the notebooks' names, scale or weight")
    d = weight.shape[-1]
    if x is None:
        x = torch.randn(2, d, generator=torch.Generator().manual_seed(SEED)) + 0.5
        x = torch.cat([x, x * 1e-3])
    eps = float(getattr(norm, "eps", None) or 1e-6)
    probe, given = norm, "your weight"
    if not bool(weight.detach().any()):  # zero, as built: a weight of its own shows how it scales
        probe, given = copy.deepcopy(norm), "a seeded random weight in [-0.3, 0.3) in place of your zeros"
        with torch.no_grad():
            _norm_weight(probe).copy_(_rand(d) * 0.6 - 0.3)
    w = as_double(_norm_weight(probe))
    result = PieceResult("RMSNorm (1 + weight)", f"[{', '.join(map(str, x.shape))}] inputs (torch.randn, seed 123, "
                                                 f"and the same 1e-3 smaller), eps {eps:g} (yours), {given}")
    got = run_reader(f"{type(norm).__name__}.forward", lambda: _eval(probe, x))
    if _compare(result, got, _rms64(x, 1 + w, eps), "row"):
        broken = _float32_inside(probe, x, eps)
        if broken is not None:
            result.stage, result.where = broken.stage, broken.where
            return found(result, broken, None, {})
        result.lines.append("in bfloat16: as computed in float32, then rounded")
        return result
    unit = _rms64(x, torch.ones_like(w), eps)
    if got.shape == unit.shape:
        for scale, words in ((w, "by the weight alone, not by (1 + weight)"), (torch.ones_like(w), "not at all: the "
                             "weight is not applied")):
            if same(got, unit * scale):
                return found(result, Broken("scale_plus_one", "output", result.where, f"each column is scaled "
                             f"{words} (first at {result.where}); Gemma and Qwen3.5 store the weight zero-centred "
                             f"(it starts at 0, the scale at 1): x_norm * (1.0 + self.scale.float())"), None, {})
    broken = properties.norm_rows(x, as_double(got) / (1 + w), True, eps)
    if broken is not None:
        return found(result, broken, None, {})
    return _unexplained(result, "its rows, divided by (1 + weight), keep unit mean square with eps inside the root")


LOW_PRECISION_SHARE = 0.01  # float32 in another order rounds to another bfloat16 in some 1e-5 of the outputs


def _float32_inside(norm: nn.Module, x: torch.Tensor, eps: float) -> Broken | None:
    """Fed bfloat16, the norm computes in float32 and rounds once at the end (the notebooks' x.float() ... .to(
    input_dtype)): its outputs are the float32 formula's rounded to bfloat16, but for a rare tie."""
    x16 = x.bfloat16()
    got = run_reader(f"{type(norm).__name__}.forward", lambda: _eval(norm, x16)).to(torch.bfloat16)
    w = _norm_weight(norm).detach().float()
    x32 = x16.float()
    want = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)).to(torch.bfloat16)
    differ = got != want
    if float(differ.float().mean()) <= LOW_PRECISION_SHARE:
        return None
    row = int(torch.nonzero(differ.any(-1))[0])
    return Broken("precision", "output", f"row {row}", f"fed bfloat16, {int(differ.sum())} of {differ.numel()} "
                  f"outputs differ from the float32 computation rounded to bfloat16 (first in row {row}): the norm is "
                  f"not computed in float32 throughout; compute it in float32, x_f = x.float(), and cast back at the "
                  f"end, out.to(input_dtype)")


# --- CohereLayerNorm ----------------------------------------------------------------------------------

def check_cohere_layer_norm(norm: nn.Module, x: torch.Tensor | None = None) -> PieceResult:
    weight = _norm_weight(norm)
    if weight is None:
        raise AttributeError("no weight: glassgpt reads the notebook's name, weight")
    d = weight.shape[-1]
    if x is None:
        x = torch.randn(2, d, generator=torch.Generator().manual_seed(SEED)) + 0.5
        x = torch.cat([x, x * 1e-3])
    eps = float(getattr(norm, "eps", None) or 1e-5)
    result = PieceResult("CohereLayerNorm", f"[{', '.join(map(str, x.shape))}] inputs (torch.randn + 0.5, seed 123, "
                                            f"and the same 1e-3 smaller), eps {eps:g} (yours)")
    got = run_reader(f"{type(norm).__name__}.forward", lambda: _eval(norm, x))
    h = as_double(x)
    centred = h - h.mean(-1, keepdim=True)
    want = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * as_double(weight)
    if _compare(result, got, want, "row"):
        return result
    broken = properties.norm_rows(x, as_double(got) / as_double(weight), False, eps)
    if broken is not None:
        return found(result, broken, None, {})
    return _unexplained(result, "its rows, divided by the weight, have mean 0 and unit variance with eps inside "
                                "the root: CohereLayerNorm has no bias to add")


# --- GeGLU --------------------------------------------------------------------------------------------

def _taps(modules: dict[str, nn.Module]):
    seen: dict[str, torch.Tensor] = {}

    def tap(name: str, take_input: bool):
        def hook(_m, args, out):  # returns None: the reader's numbers flow on unchanged
            seen.setdefault(name, (args[0] if take_input else out).detach().clone())
        return hook
    handles = [m.register_forward_hook(tap(n, n in ("fc3", "q_norm", "k_norm"))) for n, m in modules.items()]
    return seen, handles


def check_geglu(ff: nn.Module, x: torch.Tensor | None = None) -> PieceResult:
    d = ff.fc1.in_features
    x = _rand(2, 3, d) if x is None else x
    result = PieceResult("GeGLU FeedForward", f"torch.rand(2, 3, {d}) (seed 123)")
    hidden = (getattr(ff, "_glassgpt_args", None) or {}).get("hidden_dim")
    for layer in (ff.fc1, ff.fc2):
        broken = properties.width(layer.out_features, d, hidden, "hidden_dim, as built,") if hidden else None
        if broken is not None:
            return found(result, broken, None, {})
    seen, handles = _taps({"fc1": ff.fc1, "fc2": ff.fc2, "fc3": ff.fc3})
    try:
        got = run_reader(f"{type(ff).__name__}.forward", lambda: _eval(ff, x))
    finally:
        for handle in handles:
            handle.remove()
    h = as_double(x)
    gate, up = F.linear(h, as_double(ff.fc1.weight)), F.linear(h, as_double(ff.fc2.weight))
    want = F.linear(properties.ACTIVATIONS["GELU (the tanh form)"](gate) * up, as_double(ff.fc3.weight))
    if _compare(result, got, want):
        return result
    if len(seen) == 3:
        broken = geglu_inner(seen["fc1"], seen["fc2"], seen["fc3"])
        if broken is not None:
            return found(result, broken, None, {})
    return _unexplained(result, "fc3's input is gelu_tanh(fc1(x)) * fc2(x), so fc3 itself or what follows it "
                                "differs")


def geglu_inner(gate: torch.Tensor, up: torch.Tensor, inner: torch.Tensor) -> Broken | None:
    """fc3's input must be gelu(fc1(x), approximate="tanh") * fc2(x): which activation the reader's gate has."""
    g, u, a = as_double(gate), as_double(up), as_double(inner)
    want = properties.ACTIVATIONS["GELU (the tanh form)"](g) * u
    if a.shape != want.shape or same(a, want):
        return None
    pos = first_row_that_differs(a, want)[-1]
    line = "GeGLU's gate is GELU's tanh form: nn.functional.gelu(x_fc1, approximate=\"tanh\") * x_fc2"
    for name, act in properties.ACTIVATIONS.items():
        if name != "GELU (the tanh form)" and same(a, act(g) * u):
            return Broken("activation", "output", f"position {pos}", f"fc3's input is {name} of fc1(x) times "
                          f"fc2(x), not the tanh-form GELU (first at position {pos}): {line}")
    if same(a, properties.ACTIVATIONS["GELU (the tanh form)"](u) * g):
        return Broken("gate", "output", f"position {pos}", f"GELU is applied to fc2's output (the up) instead of "
                      f"fc1's (the gate) (first at position {pos}): {line}")
    return Broken("activation", "output", f"position {pos}", f"fc3's input is no activation of fc1(x) times fc2(x) "
                  f"glassgpt knows (first at position {pos}): {line}")


# --- grouped-query attention of Gemma 3, OLMo 3 and Tiny Aya ------------------------------------------------

def _qk_norm64(kind: str, n: nn.Module, v: torch.Tensor) -> torch.Tensor:
    w, eps = as_double(_norm_weight(n)), float(getattr(n, "eps", 1e-6) or 1e-6)
    if kind == "layer":
        v = v - v.mean(-1, keepdim=True)
        return _rms64(v, w, eps)  # the centred rows' mean square is their variance
    return _rms64(v, 1 + w if kind == "rms_plus_one" else w, eps)


def gqa64(att: nn.Module, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
          whole_norm: bool, qk: str, scaling: float, rope: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [b, t, d], q k^T unscaled with the hidden positions at -inf) in float64, with the reader's
    weights: QK-norm (`qk`: "rms", "rms_plus_one" or "layer", CohereLayerNorm's) per head (Gemma 3, Tiny Aya) or
    over the whole projection before the split (OLMo 3); RoPE where `rope` (Tiny Aya turns q and k in its sliding
    layers only)."""
    b, t, _ = x.shape
    h, g, hd = int(att.num_heads), int(att.num_kv_groups), int(att.head_dim)
    h64 = as_double(x)

    def lin(m: nn.Linear, v: torch.Tensor) -> torch.Tensor:
        return F.linear(v, as_double(m.weight), None if m.bias is None else as_double(m.bias))

    def norm(n: nn.Module, v: torch.Tensor) -> torch.Tensor:
        return _qk_norm64(qk, n, v)

    q, k, v = lin(att.W_query, h64), lin(att.W_key, h64), lin(att.W_value, h64)
    normed = getattr(att, "q_norm", None) is not None
    if normed and whole_norm:
        q, k = norm(att.q_norm, q), norm(att.k_norm, k)
    q = q.view(b, t, h, hd).transpose(1, 2)  # [b, t, h*hd] -> [b, h, t, hd]
    k = k.view(b, t, g, hd).transpose(1, 2)
    v = v.view(b, t, g, hd).transpose(1, 2)
    if normed and not whole_norm:
        q, k = norm(att.q_norm, q), norm(att.k_norm, k)
    if rope:
        q, k = apply_rope(q, cos.double(), sin.double()), apply_rope(k, cos.double(), sin.double())
    k, v = k.repeat_interleave(h // g, dim=1), v.repeat_interleave(h // g, dim=1)
    raw = (q @ k.transpose(-2, -1)).masked_fill(mask, -math.inf)  # [b, h, t, t]
    context = (torch.softmax(raw * scaling, dim=-1) @ v).transpose(1, 2).reshape(b, t, h * hd)
    return lin(att.out_proj, context), raw


def window_mask(t: int, window: int | None) -> torch.Tensor:
    """[t, t], True where query i may not read key j: after it, or `window` or more positions before it."""
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    hidden = j > i
    return hidden | (i - j >= window) if window is not None else hidden


GQA_LINES = {
    "scale_head_dim": "the scores are scaled by head_dim**-0.5 where Gemma 3 scales by query_pre_attn_scalar**-0.5: "
                      "self.scaling = query_pre_attn_scalar ** -0.5 when it is given",
    "rope_in_full_layer": "q and k are turned by RoPE in a full_attention layer, where Tiny Aya (Cohere) turns them "
                          "in its sliding_attention layers only: if self.attn_type == \"sliding_attention\": "
                          "queries = apply_rope(queries, cos, sin), and the same for keys",
}


def check_gemma_attention(att: nn.Module, x: torch.Tensor | None = None) -> PieceResult:
    args = getattr(att, "_glassgpt_args", None) or {}
    hd = int(att.head_dim)
    qpas = args.get("query_pre_attn_scalar", getattr(att, "query_pre_attn_scalar", None))
    if qpas is not None:
        scaling, said = float(qpas) ** -0.5, f"query_pre_attn_scalar {qpas:g} (as built)"
    elif "query_pre_attn_scalar" in args or not hasattr(att, "scaling"):
        scaling, said = hd ** -0.5, f"none given, so head_dim {hd}"
    else:  # an instance alone: its own scaling is all there is to go on
        scaling, said = float(att.scaling), f"your scaling {float(att.scaling):.4g} (its arguments unknown)"
    return _check_gqa(att, x, "Gemma 3 GroupedQueryAttention", whole_norm=False, qk="rms_plus_one",
                      scaling=scaling, window=3, said=said,
                      scale_words=(f"query_pre_attn_scalar**-0.5 = 1/sqrt({float(qpas):g})" if qpas else
                                   f"1/sqrt(head_dim) = 1/sqrt({hd})"))


def check_olmo_attention(att: nn.Module, x: torch.Tensor | None = None) -> PieceResult:
    hd = int(att.head_dim)
    window = getattr(att, "sliding_window", None)
    return _check_gqa(att, x, "OLMo 3 GroupedQueryAttention", whole_norm=True, qk="rms", scaling=hd ** -0.5,
                      window=window, scale_words=f"1/sqrt(head_dim) = 1/sqrt({hd})", said=f"head_dim {hd}")


def check_tiny_aya_attention(att: nn.Module, x: torch.Tensor | None = None) -> PieceResult:
    hd = int(att.head_dim)
    sliding = getattr(att, "attn_type", "full_attention") == "sliding_attention"
    return _check_gqa(att, x, "Tiny Aya GroupedQueryAttention", whole_norm=False, qk="layer", scaling=hd ** -0.5,
                      window=3 if sliding else None, scale_words=f"1/sqrt(head_dim) = 1/sqrt({hd})",
                      said=f"head_dim {hd}", rope=sliding)


def _check_gqa(att: nn.Module, x: torch.Tensor | None, kind: str, *, whole_norm: bool, qk: str, scaling: float,
               window: int | None, scale_words: str, said: str, rope: bool = True) -> PieceResult:
    d, t = att.W_query.in_features, 6
    x = _rand(2, t, d) if x is None else x
    t = x.shape[1]
    hd = int(att.head_dim)
    cos, sin = compute_rope_params(hd, 10_000.0, t)
    mask = window_mask(t, window)
    edge = f"the sliding window's mask (window {window})" if window else "the causal mask"
    turned = "glassgpt's RoPE tables (theta_base 10,000)" if rope else \
        "glassgpt's RoPE tables (theta_base 10,000), which a full_attention layer leaves unused"
    result = PieceResult(kind, f"torch.rand(2, {t}, {d}) (seed 123), {edge}, {turned}, the scores' factor from "
                               f"{said}")
    q_norm = getattr(att, "q_norm", None)
    for which in ("q_norm", "k_norm"):  # each norm alone first: a wrong norm would show as a wrong scale
        norm = getattr(att, which, None)
        alone_check = {"rms": check_rms_norm, "rms_plus_one": check_rms_norm_plus_one,
                       "layer": check_cohere_layer_norm}[qk]
        alone = alone_check(norm) if isinstance(norm, nn.Module) else None
        if alone is not None and not alone.ok:
            result.stage, result.where, result.prop, result.mistake = which, alone.where, alone.prop, alone.mistake
            result.finding = f"{which}, checked alone as {alone.kind}: {alone.finding}"
            result.lines.append(f"{which} alone: {alone.lines[-1] if alone.lines else alone.fed}")
            return result
    taps, handles = _taps({"q_norm": q_norm} if isinstance(q_norm, nn.Module) else {})
    mode = _Softmaxes()
    try:
        with torch.no_grad(), mode:
            got = run_reader(f"{type(att).__name__}.forward(x, mask, cos, sin)",
                             lambda: _eval(att, x, mask, cos, sin))
    finally:
        for handle in handles:
            handle.remove()
    if whole_norm and "q_norm" in taps:
        broken = _norm_span(taps["q_norm"], att)
        if broken is not None:
            result.stage = "q_norm"
            return found(result, broken, None, {})
    want, raw = gqa64(att, x, mask, cos, sin, whole_norm=whole_norm, qk=qk, scaling=scaling, rope=rope)
    if _compare(result, got, want):
        return result
    if mode.seen:
        scores, weights = mode.seen[0]
        for w in (mode.used[0] if mode.used else None, weights):
            if w is not None and w.shape[-1] == w.shape[-2] == t:
                broken = properties.attention_rows(w, True, window=window)
                if broken is not None:
                    return found(result, broken, None, {})
        broken = properties.named_scale(scores, raw, scaling, scale_words, {hd ** -0.5: f"1/sqrt(head_dim) = "
                                        f"1/sqrt({hd})", scaling ** 2: "scaled twice (the queries and the scores)"})
        if broken is not None:
            mistake = "scale_head_dim" if kind.startswith("Gemma") and \
                same(got, gqa64(att, x, mask, cos, sin, whole_norm=whole_norm, qk=qk, scaling=hd ** -0.5)[0]) and \
                abs(scaling - hd ** -0.5) > 1e-9 else None
            return found(result, broken, mistake, GQA_LINES)
    if not rope:
        broken = _position_free(att, x, mask, cos, sin)
        if broken is not None:
            turned = same(got, gqa64(att, x, mask, cos, sin, whole_norm=whole_norm, qk=qk, scaling=scaling)[0])
            return found(result, broken, "rope_in_full_layer" if turned else None, GQA_LINES)
    return _unexplained(result, "the attention weights keep softmax's properties (rows sum to 1, nothing after the "
                                "diagonal or outside the window, the scale): the difference lies in the norms, RoPE, "
                                "the values, the merge of the heads or out_proj")


def _position_free(att: nn.Module, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> Broken | None:
    """Without RoPE a score reads no position: fed one token at every position, each row's weights are equal."""
    same_token = x[:, :1].expand_as(x).contiguous()
    mode = _Softmaxes()
    with torch.no_grad(), mode:
        run_reader(f"{type(att).__name__}.forward(x, mask, cos, sin)", lambda: _eval(att, same_token, mask, cos, sin))
    if not mode.seen:
        return None
    w = as_double(mode.seen[0][1])  # [b, h, t, t]
    allowed = (~mask).double()
    even = allowed / allowed.sum(-1, keepdim=True)
    bad = ((w - even).abs() > 1e-4).any(-1)[0]  # [h, t]
    if not bool(bad.any()):
        return None
    head, row = (int(i) for i in torch.nonzero(bad.T)[0].flip(0))
    weights = w[0, head, row][allowed[row] > 0]
    return Broken("position_free", "attention weights", f"row {row} of head {head}", f"fed the same token at every "
                  f"position, row {row} of head {head} weighs its positions unequally ({float(weights.max()):.3g} "
                  f"to {float(weights.min()):.3g}): the scores depend on the positions, where "
                  f"Tiny Aya's full_attention layers give q and k no position at all (no RoPE)")


def _norm_span(normed_input: torch.Tensor, att: nn.Module) -> Broken | None:
    """OLMo 3's q_norm takes each token's whole query projection [b, t, h*hd]; per head its input is [..., hd]."""
    h, hd = int(att.num_heads), int(att.head_dim)
    width = normed_input.shape[-1]
    if width == h * hd or h == 1:
        return None
    heads = f" (its input is {list(normed_input.shape)}, split into heads)" if width == hd else \
        f" (its input is {list(normed_input.shape)})"
    return Broken("qk_norm_span", "q_norm", "every query", f"q_norm normalizes {width} numbers at a time{heads}: "
                  f"per head, where OLMo 3 normalizes each token's whole projection, all num_heads * head_dim = "
                  f"{h * hd} numbers at once, before the split into heads: q_norm = RMSNorm(self.d_out), "
                  f"k_norm = RMSNorm(num_kv_groups * head_dim), applied to W_query(x) and W_key(x) before .view")


# --- Qwen3.5's gated delta net ----------------------------------------------------------------------------

def delta_adapter(cfg: dict[str, Any]) -> Any:
    """The notebook's _Qwen3_5ConfigAdapter: its config dict under transformers' attribute names."""
    from types import SimpleNamespace
    return SimpleNamespace(hidden_size=cfg["emb_dim"], linear_num_value_heads=cfg["linear_num_value_heads"],
                           linear_num_key_heads=cfg["linear_num_key_heads"],
                           linear_key_head_dim=cfg["linear_key_head_dim"],
                           linear_value_head_dim=cfg["linear_value_head_dim"],
                           linear_conv_kernel_dim=cfg["linear_conv_kernel_dim"], hidden_act="silu",
                           rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), dtype=cfg.get("dtype"))


DELTA_LINES = {
    "conv_not_causal": "the short convolution keeps its last t outputs, which read later tokens: keep the first t "
                       "of conv1d(x) (padding kernel - 1 on both sides), self.conv1d(x)[..., :seq_len]",
    "decay_sign": "the decay's sign is flipped, so the state grows at every token: "
                  "g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)",
}


def _delta_config(net: nn.Module):
    from ...families.qwen3_5 import Qwen3_5Config
    d = net.in_proj_qkv.in_features
    eps = float(getattr(net, "layer_norm_epsilon", None) or getattr(net.norm, "variance_epsilon", None)
                or getattr(net.norm, "eps", 1e-6))
    return Qwen3_5Config(family="qwen3_5", vocab_size=2, context_length=64, emb_dim=d, n_heads=1, n_layers=1,
                         hidden_dim=1, n_kv_groups=1, rope_base=10_000.0, head_dim=2, norm_eps=eps,
                         linear_conv_kernel_dim=int(net.conv_kernel_size), linear_key_head_dim=int(net.head_k_dim),
                         linear_value_head_dim=int(net.head_v_dim), linear_num_key_heads=int(net.num_k_heads),
                         linear_num_value_heads=int(net.num_v_heads))


def delta_reference(net: nn.Module) -> nn.Module:
    """families/qwen3_5.py's Qwen3_5GatedDeltaNet holding the reader's weights."""
    from ...families import qwen3_5
    ref = qwen3_5.Qwen3_5GatedDeltaNet(_delta_config(net))
    ref.load_state_dict({k: v.detach().float() for k, v in net.state_dict().items()}, strict=False)
    return ref


def delta_mistake(ref: nn.Module, x: torch.Tensor, mistake: str) -> torch.Tensor:
    """Qwen3_5GatedDeltaNet.forward (no cache) with one catalogued mistake planted: the catalogue's formula."""
    from ...families.qwen3_5 import gated_delta_rule, l2norm
    b, t, _ = x.shape
    mixed = ref.in_proj_qkv(x).transpose(1, 2)  # [b, c, t]
    if mistake == "conv_not_causal":
        conv = F.conv1d(mixed, ref.conv1d.weight, padding=ref.conv_kernel_size - 1, groups=ref.conv_dim)
        mixed = F.silu(conv[..., -t:])  # the last t outputs: each reads kernel - 1 later tokens
    else:
        mixed = ref.causal_conv(mixed, None)[0]
    query, key, value = torch.split(mixed.transpose(1, 2), [ref.key_dim, ref.key_dim, ref.value_dim], -1)
    query = query.reshape(b, t, ref.num_k_heads, ref.head_k_dim)
    key = key.reshape(b, t, ref.num_k_heads, ref.head_k_dim)
    value = value.reshape(b, t, ref.num_v_heads, ref.head_v_dim)
    beta = ref.in_proj_b(x).sigmoid()
    g = -ref.A_log.float().exp() * F.softplus(ref.in_proj_a(x).float() + ref.dt_bias)
    if mistake == "decay_sign":
        g = -g  # exp(g) > 1: the state grows
    if ref.num_v_heads > ref.num_k_heads:
        query = query.repeat_interleave(ref.num_v_heads // ref.num_k_heads, dim=2)
        key = key.repeat_interleave(ref.num_v_heads // ref.num_k_heads, dim=2)
    out, _ = gated_delta_rule(l2norm(query.float()), l2norm(key.float()), value, g, beta)
    z = ref.in_proj_z(x).reshape(b, t, ref.num_v_heads, ref.head_v_dim)
    return ref.out_proj(ref.norm(out.to(x.dtype), z).reshape(b, t, ref.value_dim))


def check_gated_delta_net(net: nn.Module, x: torch.Tensor | None = None) -> PieceResult:
    missing = [n for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias",
                           "norm", "out_proj") if not hasattr(net, n)]
    if missing:
        raise AttributeError(f"no {', '.join(missing)}: glassgpt reads the notebook's names")
    d, t = net.in_proj_qkv.in_features, 6
    x = _rand(2, t, d) if x is None else x
    t = x.shape[1]
    # The decay rates A = exp(A_log) set to 0.1 ... 1 on a copy: a state that grows (a flipped decay) stays finite.
    probe = copy.deepcopy(net)
    with torch.no_grad():
        probe.A_log.copy_(torch.linspace(0.1, 1.0, probe.A_log.numel()).log())
    result = PieceResult("GatedDeltaNet", f"torch.rand(2, {t}, {d}) (seed 123), your weights with A_log set to "
                                          f"log(0.1 ... 1); then later positions changed, one at a time")
    got = run_reader(f"{type(net).__name__}.forward(x)", lambda: _eval(probe, x))
    with torch.no_grad():
        want = delta_reference(probe)(x.float())
    tol = DELTA_RTOL * max(float(want.abs().max()), 1e-30)
    if _compare(result, got, want, tol=tol):
        broken = _causal(probe, x, got, tol)
        if broken is None:
            result.lines.append("causal: no output at position p changes when a later input changes")
            return result
        return found(result, broken, None, DELTA_LINES)
    broken = _causal(probe, x, got, tol)
    mistake = None
    for name in DELTA_LINES:
        with torch.no_grad():
            if same(got, delta_mistake(delta_reference(probe), x.float(), name), tol):
                mistake = name
    if broken is None and mistake == "decay_sign":
        broken = Broken("decay", "output", result.where, f"the state grows at every token instead of fading "
                        f"(first at {result.where}): each token multiplies it by exp(g), which must be at most 1")
    if broken is not None:
        return found(result, broken, mistake, DELTA_LINES)
    return _unexplained(result, "it is causal (no output changes when a later input does): the difference lies in "
                                "the projections, the convolution's weights, beta, the decay, the norm or out_proj")


def _causal(net: nn.Module, x: torch.Tensor, got: torch.Tensor, tol: float) -> Broken | None:
    """Change the inputs after position p (p = 0, 1, ...): the outputs up to p must not move."""
    t = x.shape[1]
    for p in range(t - 1):
        changed = x.clone()
        changed[:, p + 1:] = _rand(*changed[:, p + 1:].shape) + 1.0
        out = _eval(net, changed)
        moved = (as_double(out[:, :p + 1]) - as_double(got[:, :p + 1])).abs().amax(dim=(0, 2))  # [p + 1]
        if bool((moved > tol).any()):
            first = int(torch.nonzero(moved > tol)[0])
            return Broken("causal", "output", f"position {first}", f"position {first}'s output changes when only "
                          f"the inputs after position {p} change (by {float(moved[first]):.3g}): an output must read "
                          f"its own token and earlier ones only; tokens meet in the short convolution and in the "
                          f"state, and the convolution must read a token and the kernel - 1 before it: keep the "
                          f"first seq_len outputs, self.conv1d(x)[..., :seq_len]")
    return None

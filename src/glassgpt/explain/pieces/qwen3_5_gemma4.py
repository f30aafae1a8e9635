"""Qwen3.5's gated full attention and Gemma 4's attention, as the book's ch05/16_qwen3.5 and 17_gemma4 notebooks
write them, against glassgpt's formulas in float64; and the two notebooks' compute_rope_params (partial RoPE).

    Qwen3.5 GroupedQueryAttention  W_query twice as wide (per head, hd queries then hd gate values), (1 + weight)
                                   QK-norm, RoPE on the first partial_rotary_factor of each head's dimensions,
                                   scores times head_dim^-0.5, out_proj(context * sigmoid(gate))
    Gemma 4 Attention              QK-norm (a plain weight), a value norm without a weight, unscaled scores (the
                                   norms set their size), a sliding window, or on a full layer proportional RoPE:
                                   the first quarter of each head's pairs turn, the rest have frequency 0
    Gemma4RMSNorm                  x / rms(x) times a plain weight (it starts at 1), or none (the value norm)
    Gemma4FeedForward              GeGLU under other names: down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))
    compute_rope_params            Qwen3.5's (tables rotary_dim wide) and Gemma 4's (rope_type "proportional")

The properties come first (properties.py's, and these: which dimensions RoPE turns, the gate's factors in (0, 1),
values normed so that a larger W_value changes nothing), then a catalogue names the line where one of its
mistakes reproduces the reader's output exactly.
"""

from __future__ import annotations

import copy
import inspect
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...families import gemma4
from ...families.layers import apply_rope, compute_rope_params
from . import properties
from .attention import _Softmaxes
from .bonus_models import SEED, _compare, _eval, _rand, _unexplained, check_rms_norm_plus_one, window_mask
from .next_models import _rope_table_property, check_rms_norm
from .properties import Broken
from .report import PieceError, PieceResult, as_double, first_row_that_differs, found, run_reader, same

QWEN3_5_ATTENTION = "Qwen3.5 GroupedQueryAttention"
GEMMA4_ATTENTION = "Gemma 4 Attention"
GEMMA4_NORM = "Gemma4RMSNorm"
GEMMA4_FF = "Gemma4FeedForward (GeGLU)"
KINDS = (QWEN3_5_ATTENTION, GEMMA4_ATTENTION, GEMMA4_NORM, GEMMA4_FF)
QWEN3_5_ROPE = {"theta_base": 10_000_000.0, "partial_rotary_factor": 0.25}  # the notebook's QWEN3_5_CONFIG
# A tiny get_gemma4_dense_config: layer 1 is a full layer, heads of global_head_dim 16, of which
# int(0.25 * 16 // 2) = 2 pairs turn.
GEMMA4_TINY = {"vocab_size": 97, "vocab_size_per_layer_input": 97, "emb_dim": 32, "hidden_dim": 48, "n_layers": 2,
               "n_heads": 4, "head_dim": 8, "n_kv_heads": 2, "num_global_kv_heads": None, "global_head_dim": 16,
               "context_length": 24, "sliding_window": 3, "layer_types": ["sliding_attention", "full_attention"],
               "hidden_size_per_layer_input": 8, "num_kv_shared_layers": 0, "use_double_wide_mlp": False,
               "attention_k_eq_v": False, "rope_local_base": 10_000.0, "rope_local_type": "default",
               "rope_global_base": 1_000_000.0, "rope_global_type": "proportional",
               "rope_global_partial_rotary_factor": 0.25, "layer_norm_eps": 1e-6, "final_logit_softcap": 30.0,
               "tie_word_embeddings": True, "pad_token_id": 0, "dtype": torch.float32}
PRESETS = {"qwen3_5": {"GroupedQueryAttention": {"d_in": 32, "num_heads": 4, "num_kv_groups": 2, "head_dim": 16,
                                                 "qk_norm": True}},
           "gemma4": {"Gemma4Attention": GEMMA4_TINY, "Gemma4RMSNorm": {"dim": 32},
                      "Gemma4FeedForward": GEMMA4_TINY}}
EVEN = 1e-5     # fed one token at every position, a row's scores are equal within this share of their largest
                # (float32 rounding some 1e-7; the same token gives bitwise equal scores where nothing turns)
SPAN_TOKENS = 16  # one token at 16 positions: a slow pair (base 1e6) turns far enough to show
SCALED = 4.0    # W_value (or W_query) times this: a normed projection leaves the output as it was ...
NORMED_RTOL = 1e-3  # ... within this share of the output's largest value (eps inside the root moves it ~1e-5)

LINES = {
    "gate_missing": "the output gate is left out: Qwen3.5 multiplies the context by sigmoid of the gate, the second "
                    "half of each head's W_query output: context = context * torch.sigmoid(gate), then out_proj",
    "gate_no_sigmoid": "the context is multiplied by the gate itself: context = context * torch.sigmoid(gate)",
    "rope_whole_head": "apply_rope turns the whole head: x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:] with "
                       "rot_dim = cos.shape[-1], and x_out = torch.cat([x_rotated, x_pass], dim=-1)",
    "v_norm_weight": "the value norm has a weight: self.v_norm = Gemma4RMSNorm(self.head_dim, eps=..., "
                     "with_scale=False)",
    "v_norm_missing": "the values are not normed: value = self.v_norm(value) after v_proj and the split into heads",
    "scale_head_dim": "the scores are scaled by head_dim**-0.5 where Gemma 4 leaves them unscaled (QK-norm sets "
                      "their size): attn_scores = query @ key.transpose(-1, -2)",
    "proportional_ignored": "rope_type \"proportional\" is ignored: rope_angles = int(partial_rotary_factor * head_dim "
                            "// 2) pairs turn, inv_freq = torch.cat([inv_freq_rotated, torch.zeros(nope_angles)])",
    "partial_ignored": "partial_rotary_factor is ignored: rotary_dim = int(head_dim * partial_rotary_factor), "
                       "the frequencies and the tables over rotary_dim",
}


def kind_of(piece: nn.Module) -> str | None:
    """Qwen3.5's attention (a W_query twice num_heads * head_dim wide) or Gemma 4's (a v_norm beside q_proj)."""
    if all(hasattr(piece, n) for n in ("W_query", "num_kv_groups", "num_heads", "head_dim")) and \
            isinstance(piece.W_query, nn.Linear) and \
            piece.W_query.out_features == 2 * int(piece.num_heads) * int(piece.head_dim):
        return QWEN3_5_ATTENTION
    if type(piece).__name__ == "Gemma4RMSNorm":
        return GEMMA4_NORM
    if all(hasattr(piece, n) for n in ("gate_proj", "up_proj", "down_proj")) and "Gemma4" in type(piece).__name__:
        return GEMMA4_FF  # (by its name too: Llama's and Qwen3's MLPs in transformers hold the same three layers)
    if all(hasattr(piece, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "head_dim")) and \
            (hasattr(piece, "v_norm") or hasattr(piece, "num_kv_heads")):  # (a v_norm left out is a finding)
        return GEMMA4_ATTENTION
    return None


def is_layered_attention(cls: type) -> bool:
    """Gemma 4's attention and feed-forward classes, built from the model's config and a layer's index:
    (cfg, layer_idx)."""
    params = tuple(list(inspect.signature(cls.__init__).parameters)[1:3])
    return params == ("cfg", "layer_idx") and ("Attention" in cls.__name__ or "FeedForward" in cls.__name__)


def layer_to_build(cfg: dict[str, Any]) -> int:
    """The first full layer (the one with partial RoPE), else layer 0."""
    types = list(cfg.get("layer_types") or [])
    return types.index("full_attention") if "full_attention" in types else 0


# --- which dimensions RoPE turns: one token at every position, some dimensions of q and k zeroed -------------

def _zeroed(att: nn.Module, q_rows: Callable[[int], list[int]], k_rows: Callable[[int], list[int]],
            q: nn.Linear, k: nn.Linear, n_q: int, n_k: int) -> nn.Module:
    probe = copy.deepcopy(att)
    with torch.no_grad():
        for name, rows_of, n in ((q, q_rows, n_q), (k, k_rows, n_k)):
            layer = probe.get_submodule(name)
            for head in range(n):
                layer.weight[rows_of(head)] = 0
    return probe


def _unevenness(att: nn.Module, x: torch.Tensor, tables: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                window: int | None) -> torch.Tensor:
    """[h, t]: the spread of each row's scores (the softmax's input) over the positions it may read, as a share of
    the largest score, fed x's first token at every position: then a score reads the positions only through what
    RoPE turns."""
    same_token = x[:, :1].expand(-1, SPAN_TOKENS, -1).contiguous()
    mask, (cos, sin) = window_mask(SPAN_TOKENS, window), tables(SPAN_TOKENS)
    mode = _Softmaxes()
    with torch.no_grad(), mode:
        run_reader(f"{type(att).__name__}.forward(x, mask, cos, sin)", lambda: _eval(att, same_token, mask, cos, sin))
    scores = as_double(mode.seen[0][0])[0]  # [h, t, t]
    allowed = ~mask
    high = scores.masked_fill(~allowed, -math.inf).amax(-1)
    low = scores.masked_fill(~allowed, math.inf).amin(-1)
    return (high - low) / max(float(scores[:, allowed].abs().max()), 1e-30)


def _rope_span(att: nn.Module, x, tables, window, q: str, k: str, q_stride: int, n_kv: int, hd: int,
               turned: list[int], words: str, fix: str) -> Broken | None:
    """Only the dimensions `turned` of each head may depend on the position: with q and k zeroed there, one token
    at every position gets equal weights; with q and k zeroed everywhere else, unequal ones."""
    h = int(att.num_heads)
    kept = [j for j in range(hd) if j not in turned]
    for zero, want_even in ((turned, True), (kept, False)):
        if not [j for j in range(hd) if j not in zero]:
            continue
        probe = _zeroed(att, lambda i: [i * q_stride + j for j in zero], lambda i: [i * hd + j for j in zero],
                        q, k, h, n_kv)
        uneven = _unevenness(probe, x, tables, window)
        if want_even and bool((uneven > EVEN).any()):
            head, row = (int(i) for i in torch.nonzero(uneven > EVEN)[0])
            return Broken("rope_span", "attention weights", f"row {row} of head {head}", f"with q and k kept to the "
                          f"dimensions RoPE must leave alone ({len(kept)} of each head's {hd}) and one token at "
                          f"every position, row {row} of head {head} scores its positions unequally (spread "
                          f"{float(uneven[head, row]):.3g} of the largest score): RoPE turns dimensions that {words}; "
                          f"{fix}")
        if not want_even and bool((uneven <= EVEN).all()):
            return Broken("rope_span", "attention weights", "every row", f"with q and k kept to the {len(turned)} "
                          f"dimensions of each head RoPE must turn and one token at every position, every row scores "
                          f"its positions equally: the scores read no position from them, where RoPE turns q and k "
                          f"there, each by its own position, so that a score reads how far apart the two are")
    return None


# --- Qwen3.5's gated attention -----------------------------------------------------------------------------

def rotary_dim(hd: int, factor: float) -> int:
    """The notebook's rule: int(head_dim * partial_rotary_factor), even, at least 2."""
    rot = int(hd * factor)
    return max(2, rot - rot % 2)


def qwen3_5_attention64(att: nn.Module, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        gate_fn: Callable | None = torch.sigmoid) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The notebook's forward in float64 with the reader's weights: (output [b, t, d], {"raw": q k^T with the
    hidden positions at -inf, "weights", "context" before the gate, "gate"}); gate_fn None: no gate."""
    b, t, _ = x.shape
    h, g, hd = int(att.num_heads), int(att.num_kv_groups), int(att.head_dim)
    h64 = as_double(x)
    q_and_gate = F.linear(h64, as_double(att.W_query.weight)).view(b, t, h, 2 * hd)
    q, gate = q_and_gate[..., :hd], q_and_gate[..., hd:].reshape(b, t, h * hd)
    k = F.linear(h64, as_double(att.W_key.weight)).view(b, t, g, hd).transpose(1, 2)
    v = F.linear(h64, as_double(att.W_value.weight)).view(b, t, g, hd).transpose(1, 2)
    q = q.transpose(1, 2)  # [b, t, h, hd] -> [b, h, t, hd]
    if getattr(att, "q_norm", None) is not None:
        from .bonus_models import _qk_norm64
        q, k = _qk_norm64("rms_plus_one", att.q_norm, q), _qk_norm64("rms_plus_one", att.k_norm, k)
    rot = cos.shape[-1]
    turn = lambda z: torch.cat([apply_rope(z[..., :rot], cos.double(), sin.double()), z[..., rot:]], -1)  # noqa: E731
    q, k = turn(q), turn(k)
    k, v = k.repeat_interleave(h // g, dim=1), v.repeat_interleave(h // g, dim=1)
    raw = (q @ k.transpose(-2, -1)).masked_fill(mask, -math.inf)  # [b, h, t, t]
    weights = torch.softmax(raw * hd ** -0.5, dim=-1)
    context = (weights @ v).transpose(1, 2).reshape(b, t, h * hd)
    gated = context if gate_fn is None else context * gate_fn(gate)
    out = F.linear(gated, as_double(att.out_proj.weight))
    return out, {"raw": raw, "weights": weights, "context": context, "gate": gate}


def check_qwen3_5_attention(att: nn.Module, x: torch.Tensor | None = None) -> PieceResult:
    args = getattr(att, "_glassgpt_args", None) or {}
    factor = float(args.get("partial_rotary_factor", QWEN3_5_ROPE["partial_rotary_factor"]))
    base = float(args.get("rope_base", QWEN3_5_ROPE["theta_base"]))
    d, t = att.W_query.in_features, 6
    x = _rand(2, t, d) if x is None else x
    t, hd = x.shape[1], int(att.head_dim)
    rot = rotary_dim(hd, factor)
    cos, sin = compute_rope_params(rot, base, t)  # [t, rot]: the first rot dimensions of each head turn
    mask = window_mask(t, None)
    result = PieceResult(QWEN3_5_ATTENTION, f"torch.rand(2, {t}, {d}) (seed 123), the causal mask, RoPE tables "
                                            f"{rot} wide (partial_rotary_factor {factor:g} of head_dim {hd}, "
                                            f"theta_base {base:,.0f})")
    for which in ("q_norm", "k_norm"):  # each norm alone first: a plain weight would show as a wrong scale
        norm = getattr(att, which, None)
        alone = check_rms_norm_plus_one(norm) if isinstance(norm, nn.Module) else None
        if alone is not None and not alone.ok:
            result.stage, result.where, result.prop, result.mistake = which, alone.where, alone.prop, alone.mistake
            result.finding = f"{which}, checked alone as {alone.kind}: {alone.finding}"
            return result
    gated_in: list[torch.Tensor] = []
    handle = att.out_proj.register_forward_pre_hook(lambda _m, a: gated_in.append(a[0].detach().clone()) and None)
    mode = _Softmaxes()
    try:
        with torch.no_grad(), mode:
            got = _eval(att, x, mask, cos, sin)
    except Exception as err:  # noqa: BLE001 - the reader's code: fed whole-head tables, does it run?
        handle.remove()
        return _whole_head(att, x, mask, result, err, hd, rot, factor, base)
    finally:
        handle.remove()
    want, parts = qwen3_5_attention64(att, x, mask, cos, sin)
    if _compare(result, got, want):
        return result
    held = []  # the properties checked and kept: what the closing sentence may say
    if mode.seen:
        broken = properties.attention_rows(mode.used[0] if mode.used else mode.seen[0][1], True)
        if broken is not None:
            return found(result, broken, None, LINES)
        held.append("the attention weights keep softmax's properties")
    if _rope_free_equal(att, x, mask, (torch.ones(t, rot), torch.zeros(t, rot)), qwen3_5_attention64):
        broken = _rope_span(att, x, lambda n: compute_rope_params(rot, base, n), None, "W_query", "W_key", 2 * hd,
                            int(att.num_kv_groups), hd, list(range(rot)), f"Qwen3.5 passes through (it turns the "
                            f"first {rot}, partial_rotary_factor {factor:g} of {hd})", "Qwen3.5's apply_rope turns "
                            "x[..., :rot_dim] (rot_dim = cos.shape[-1]) and passes x[..., rot_dim:] through")
        if broken is not None:
            return found(result, broken, None, LINES)
        held.append(f"RoPE turns the first {rot} dimensions only")
    if mode.seen:
        broken = properties.named_scale(mode.seen[0][0], parts["raw"], hd ** -0.5, f"1/sqrt(head_dim) = "
                                        f"1/sqrt({hd})", {})
        if broken is not None:
            return found(result, broken, None, LINES)
        if properties.fitted_scale(mode.seen[0][0], parts["raw"]) is not None:
            held.append(f"the scores are scaled by 1/sqrt({hd})")
    if gated_in and mode.seen and same(as_double(mode.seen[0][1]), parts["weights"]):
        broken = _gate(gated_in[0], parts["context"])
        if broken is not None:
            mistake = next((m for m, fn in (("gate_missing", None), ("gate_no_sigmoid", lambda g: g))
                            if same(got, qwen3_5_attention64(att, x, mask, cos, sin, fn)[0])), None)
            return found(result, broken, mistake, LINES)
        held.append("the gate's factors lie in (0, 1)")
    return _unexplained(result, ", ".join(held or ["no property glassgpt tests here breaks"]) +
                        ": the difference lies elsewhere (the projections' layout, the values, the gate, the merge of "
                        "the heads or out_proj)")


def _rope_free_equal(att: nn.Module, x: torch.Tensor, mask: torch.Tensor, still: tuple, formula: Callable) -> bool:
    """Fed tables that turn nothing (cos 1, sin 0), the piece equals the formula: all but RoPE is right, so its q
    and k dimensions are where the formula has them, and zeroing rows of W_query and W_key zeroes those."""
    got = run_reader(f"{type(att).__name__}.forward(x, mask, cos, sin)", lambda: _eval(att, x, mask, *still))
    return same(got, formula(att, x, mask, *still)[0])


def _whole_head(att, x, mask, result, err, hd, rot, factor, base) -> PieceResult:
    """The forward fails fed tables rot wide: where, fed tables as wide as the head, it runs and equals the formula
    with RoPE over the whole head, its RoPE turns all hd dimensions."""
    first = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    cos, sin = compute_rope_params(hd, base, x.shape[1])
    try:
        with torch.no_grad():
            got = _eval(att, x, mask, cos, sin)
    except Exception:  # noqa: BLE001 - it fails either way: its own failure is the finding
        raise PieceError(f"{type(att).__name__}.forward(x, mask, cos, sin) failed: {first}") from None
    whole = same(got, qwen3_5_attention64(att, x, mask, cos, sin)[0])  # the formula's RoPE over cos.shape[-1] = hd
    said = f"fed tables {hd} wide it runs and equals the formula with RoPE over all {hd} dimensions of each head" \
        if whole else f"fed tables {hd} wide it runs: its RoPE expects tables as wide as the head"
    result.stage, result.where = "RoPE", "every head"
    return found(result, Broken("rope_span", "RoPE", "every head", f"fed Qwen3.5's RoPE tables, {rot} wide "
                                f"(partial_rotary_factor {factor:g} of head_dim {hd}), the forward fails ({first}); "
                                f"{said}, where Qwen3.5 turns the first {rot} and passes the rest through"),
                 "rope_whole_head" if whole else None, LINES)


def _gate(gated: torch.Tensor, context: torch.Tensor) -> Broken | None:
    """out_proj's input over the ungated context: each factor must be sigmoid(gate), in (0, 1), and not all 1."""
    z, c = as_double(gated), as_double(context)
    if z.shape != c.shape:
        return None
    use = c.abs() > 1e-3 * float(c.abs().max())
    ratio = torch.where(use, z / torch.where(use, c, torch.ones_like(c)), torch.full_like(c, 0.5))
    outside = use & ((ratio <= 0) | (ratio >= 1))
    if not bool(outside.any()):
        return None
    pos = int(torch.nonzero(outside.any(-1).any(0))[0])
    if bool(((ratio - 1).abs() < 1e-4)[use].all()):  # float32 against float64: 1 within some 1e-6
        return Broken("output_gate", "out_proj input", f"position {pos}", "out_proj's input is the attention's "
                      "context itself, every factor 1: no gate multiplies it, where Qwen3.5 multiplies each value by "
                      "sigmoid of its gate, a factor between 0 and 1")
    value = float(ratio[..., pos, :][outside[..., pos, :]][0])
    return Broken("output_gate", "out_proj input", f"position {pos}", f"out_proj's input over the attention's "
                  f"context gives factors outside (0, 1) (first at position {pos}: {value:.3g}), where Qwen3.5 "
                  f"multiplies each value by sigmoid of its gate, a factor between 0 and 1")


# --- Gemma 4's attention ------------------------------------------------------------------------------------

def _gemma4_tables(att: nn.Module, args: dict[str, Any], t: int) -> tuple[torch.Tensor, torch.Tensor, str, list]:
    """(cos, sin, words, the dimensions that turn) for att's layer, as Gemma4DenseModel builds them."""
    hd = int(att.head_dim)
    if _sliding(att):
        base = float(args.get("rope_local_base", 10_000.0))
        cos, sin = gemma4.compute_rope_params(hd, base, t)
        return cos, sin, f"RoPE over all of head_dim {hd} (theta_base {base:,.0f})", list(range(hd))
    base = float(args.get("rope_global_base", 1_000_000.0))
    factor = float(args.get("rope_global_partial_rotary_factor", 0.25))
    cos, sin = gemma4.compute_rope_params(hd, base, t, "proportional", factor)
    pairs = int(factor * hd // 2)
    return cos, sin, (f"proportional RoPE (theta_base {base:,.0f}, partial_rotary_factor {factor:g}: {pairs} of "
                      f"{hd // 2} pairs turn)"), [*range(pairs), *range(hd // 2, hd // 2 + pairs)]


def _sliding(att: nn.Module) -> bool:
    return bool(getattr(att, "is_sliding", getattr(att, "layer_type", "") == "sliding_attention"))


def gemma4_attention64(att: nn.Module, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       scaling: float = 1.0, v_normed: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [b, t, d], q k^T with the hidden positions at -inf) in float64 with the reader's weights."""
    b, t, _ = x.shape
    h, g, hd = int(att.num_heads), int(att.num_kv_heads), int(att.head_dim)
    h64 = as_double(x)

    def rms(v: torch.Tensor, norm: nn.Module | None) -> torch.Tensor:
        eps = float(getattr(norm, "eps", 1e-6) or 1e-6)
        out = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
        w = getattr(norm, "weight", None)
        return out * as_double(w) if isinstance(w, torch.Tensor) and norm is not v_norm else out

    v_norm = getattr(att, "v_norm", None)

    q = F.linear(h64, as_double(att.q_proj.weight)).view(b, t, h, hd).transpose(1, 2)  # [b, h, t, hd]
    k = F.linear(h64, as_double(att.k_proj.weight)).view(b, t, g, hd).transpose(1, 2)
    v = F.linear(h64, as_double(att.v_proj.weight)).view(b, t, g, hd).transpose(1, 2)
    q = apply_rope(rms(q, att.q_norm), cos.double(), sin.double())
    k = apply_rope(rms(k, att.k_norm), cos.double(), sin.double())
    v = rms(v, v_norm) if v_normed else v
    k, v = k.repeat_interleave(h // g, dim=1), v.repeat_interleave(h // g, dim=1)
    raw = (q @ k.transpose(-2, -1)).masked_fill(mask, -math.inf)  # [b, h, t, t]
    context = (torch.softmax(raw * scaling, dim=-1) @ v).transpose(1, 2).reshape(b, t, h * hd)
    return F.linear(context, as_double(att.o_proj.weight)), raw


def check_gemma4_attention(att: nn.Module, x: torch.Tensor | None = None) -> PieceResult:
    missing = [n for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "num_heads",
                           "num_kv_heads", "head_dim") if not hasattr(att, n)]
    if missing:
        raise AttributeError(f"no {', '.join(missing)}: glassgpt reads the notebook's names")
    args = getattr(att, "_glassgpt_args", None) or {}
    d, t = att.q_proj.in_features, 6
    x = _rand(2, t, d) if x is None else x
    t, hd = x.shape[1], int(att.head_dim)
    cos, sin, turning, turned = _gemma4_tables(att, args, t)
    window = 3 if _sliding(att) else None
    mask = window_mask(t, window)
    edge = f"the sliding window's mask (window {window})" if window else "the causal mask (a full layer)"
    result = PieceResult(GEMMA4_ATTENTION, f"torch.rand(2, {t}, {d}) (seed 123), {edge}, {turning}")
    for which in ("q_norm", "k_norm"):
        alone = check_rms_norm(getattr(att, which))
        if not alone.ok:
            result.stage, result.where, result.prop, result.mistake = which, alone.where, alone.prop, alone.mistake
            result.finding = f"{which}, checked alone as {alone.kind}: {alone.finding}"
            return result
    mode = _Softmaxes()
    with torch.no_grad(), mode:
        got = run_reader(f"{type(att).__name__}.forward(x, mask, cos, sin)", lambda: _eval(att, x, mask, cos, sin))
    broken = _v_norm_weight(att, x, mask, cos, sin, got)
    if broken is not None:
        result.lines.append("v_norm's weight set to numbers of its own on a copy: the output moves")
        return found(result, broken, "v_norm_weight", LINES)
    want, raw = gemma4_attention64(att, x, mask, cos, sin)
    if _compare(result, got, want):
        return _and_sliding_layer(att, result, x)
    held = []  # the properties checked and kept: what the closing sentence may say
    if mode.seen:
        for w in (mode.used[0] if mode.used else None, mode.seen[0][1]):
            if w is not None and w.shape[-1] == w.shape[-2] == t:
                broken = properties.attention_rows(w, True, window=window)
                if broken is not None:
                    return found(result, broken, None, LINES)
        held.append("the attention weights keep softmax's properties")
    broken = _values_normed(att, x, mask, cos, sin, got)
    if broken is not None:
        missing = same(got, gemma4_attention64(att, x, mask, cos, sin, v_normed=False)[0])
        return found(result, broken, "v_norm_missing" if missing else None, LINES)
    held.append("the values are normed (a larger v_proj changes nothing)")
    if _rope_free_equal(att, x, mask, (torch.ones(t, hd), torch.zeros(t, hd)), gemma4_attention64):
        words = (f"Gemma 4 leaves alone (a full layer's proportional RoPE turns the first {len(turned) // 2} "
                 f"pairs of {hd // 2})")
        fix = (f"on a full layer only dimensions {_spans(turned)} turn: the proportional tables give the other "
               f"pairs frequency 0")  # (a sliding layer turns them all: only the other half of the test applies)
        broken = _rope_span(att, x, lambda n: _gemma4_tables(att, args, n)[:2], window, "q_proj", "k_proj", hd,
                            int(att.num_kv_heads), hd, turned, words, fix)
        if broken is not None:
            return found(result, broken, None, LINES)
        held.append("RoPE turns the dimensions it must, and no others")
    if mode.seen:
        broken = properties.named_scale(mode.seen[0][0], raw, 1.0, "1 (no scaling: QK-norm sets the scores' size)",
                                        {hd ** -0.5: f"1/sqrt(head_dim) = 1/sqrt({hd})"})
        if broken is not None:
            mistake = "scale_head_dim" if same(got, gemma4_attention64(att, x, mask, cos, sin, hd ** -0.5)[0]) \
                else None
            return found(result, broken, mistake, LINES)
        if properties.fitted_scale(mode.seen[0][0], raw) is not None:
            held.append("the scores are unscaled")
    return _unexplained(result, ", ".join(held) + ": the difference lies elsewhere (the projections' layout, the "
                                                  "QK-norm's place, RoPE's pairs, the merge of the heads or o_proj)")


def check_gemma4_rms_norm(norm: nn.Module, x: torch.Tensor | None = None) -> PieceResult:
    """Gemma 4's RMSNorm: x / rms(x) times a plain weight (it starts at 1), or nothing (with_scale=False, the value
    norm); a (1 + weight) scale, Gemma 3's, named before the general RMSNorm check."""
    w = getattr(norm, "weight", None)
    if isinstance(w, torch.Tensor):
        result = check_rms_norm(norm, x)
        if result.ok:
            result.kind = GEMMA4_NORM
            return result
        probe = _plus_one_probe(norm)
        if probe is not None:
            return probe
        result.kind = GEMMA4_NORM
        return result
    if x is None:  # no weight: any width will do; rows 1e-3 smaller show where eps sits
        x = torch.randn(2, 32, generator=torch.Generator().manual_seed(SEED)) + 0.5
        x = torch.cat([x, x * 1e-3])
    eps = float(getattr(norm, "eps", None) or 1e-6)
    result = PieceResult(GEMMA4_NORM, f"[{', '.join(map(str, x.shape))}] inputs (torch.randn + 0.5, seed 123, and "
                                      f"the same 1e-3 smaller), no weight (with_scale=False), eps {eps:g} (yours)")
    got = run_reader(f"{type(norm).__name__}.forward", lambda: _eval(norm, x))
    h = as_double(x)
    if _compare(result, got, h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps), "row"):
        return result
    broken = properties.norm_rows(x, as_double(got), True, eps)
    return found(result, broken, None, LINES) if broken is not None else \
        _unexplained(result, "its rows keep unit mean square with eps inside the root")


def _plus_one_probe(norm: nn.Module) -> PieceResult | None:
    """A weight set to 0.2 ... 0.6 on a copy: an output of x / rms(x) * (1 + weight) is Gemma 3's scale."""
    probe = copy.deepcopy(norm)
    d = probe.weight.numel()
    with torch.no_grad():
        probe.weight.copy_(torch.linspace(0.2, 0.6, d))
    x = _rand(4, d) + 0.5
    eps = float(getattr(norm, "eps", None) or 1e-6)
    got = run_reader(f"{type(norm).__name__}.forward", lambda: _eval(probe, x))
    h = as_double(x)
    unit = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if not same(got, unit * (1 + as_double(probe.weight))):
        return None
    result = PieceResult(GEMMA4_NORM, f"torch.rand(4, {d}) + 0.5 (seed 123), a weight 0.2 ... 0.6 in place of "
                                      f"yours, eps {eps:g} (yours)")
    result.lines.append("output against x / rms(x) * (1 + weight): equal")
    result.views = {"reader_out": got, "book_out": unit * as_double(probe.weight)}
    return found(result, Broken("scale_plus_one", "output", "row 0", "each column is scaled by (1 + weight), "
                                "Gemma 3's zero-centred scale, where Gemma 4's weight is the scale itself (it starts "
                                "at 1): x_norm * self.weight.float()"), None, LINES)


class _GeGLUNames(nn.Module):
    """Gemma 4's feed-forward under Gemma 3's names (fc1 the gate, fc2 the up, fc3 the down), the same modules:
    its own forward runs, and the GeGLU check's taps sit on its own layers."""

    def __init__(self, ff: nn.Module):
        super().__init__()
        self.ff, self.fc1, self.fc2, self.fc3 = ff, ff.gate_proj, ff.up_proj, ff.down_proj
        self._glassgpt_args = None  # its width depends on the layer (double-wide in kv-shared ones): not checked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(x)


def check_gemma4_feed_forward(ff: nn.Module, x: torch.Tensor | None = None) -> PieceResult:
    """Gemma 4's GeGLU (gate_proj, up_proj, down_proj): Gemma 3's check, the layers named as the reader names them."""
    from .bonus_models import check_geglu
    result = check_geglu(_GeGLUNames(ff), x)
    result.kind = GEMMA4_FF
    for old, new in (("x_fc1", "x_gate"), ("x_fc2", "x_up"), ("fc1", "gate_proj"), ("fc2", "up_proj"),
                     ("fc3", "down_proj")):
        result.finding = result.finding.replace(old, new)
        result.lines = [line.replace(old, new) for line in result.lines]
    result.finding = result.finding.replace("GeGLU FeedForward matches", f"{GEMMA4_FF} matches")
    return result


def _spans(dims: list[int]) -> str:
    half = len(dims) // 2
    return f"{dims[0]}-{dims[half - 1]} and {dims[half]}-{dims[-1]}" if half else "none"


def _and_sliding_layer(att: nn.Module, result: PieceResult, x: torch.Tensor) -> PieceResult:
    """A class glassgpt built at its first full layer: its first sliding layer built (seed 123) and checked too."""
    args = getattr(att, "_glassgpt_args", None) or {}
    types = list(args.get("layer_types") or [])
    if _sliding(att) or "sliding_attention" not in types:
        return result
    torch.manual_seed(123)
    layer = types.index("sliding_attention")
    sliding = run_reader(f"{type(att).__name__}(cfg, {layer})", lambda: type(att)(args, layer))
    sliding._glassgpt_args = args
    other = check_gemma4_attention(sliding, x)
    if not other.ok:
        other.finding = f"layer {layer} (sliding_attention): {other.finding}"
        other.fed = f"{type(att).__name__}(cfg, {layer}), {other.fed}"
        return other
    result.lines.append(f"layer {layer} (sliding_attention, window 3, RoPE over the whole head): matches too")
    return result


def _scaled_copy(att: nn.Module, name: str) -> nn.Module:
    probe = copy.deepcopy(att)
    with torch.no_grad():
        probe.get_submodule(name).weight.mul_(SCALED)
    return probe


def _values_normed(att, x, mask, cos, sin, got) -> Broken | None:
    """v_norm makes each value unit-RMS: v_proj's weight times SCALED leaves the output as it was."""
    moved = run_reader(f"{type(att).__name__}.forward", lambda: _eval(_scaled_copy(att, "v_proj"), x, mask, cos, sin))
    tol = NORMED_RTOL * max(float(as_double(got).abs().max()), 1e-30)
    if same(moved, got, tol):
        return None
    pos = first_row_that_differs(moved, got)[-1] if moved.shape == got.shape else 0
    ratio = float(as_double(moved).abs().max() / max(float(as_double(got).abs().max()), 1e-30))
    return Broken("values_normed", "v_norm", f"position {pos}", f"with v_proj's weight {SCALED:g} times larger the "
                  f"output changes (its largest value {ratio:.3g} times, first at position {pos}): the values are not "
                  f"RMS-normed, where Gemma 4 norms each head's values (v_norm, without a weight)")


def _v_norm_weight(att, x, mask, cos, sin, got) -> Broken | None:
    """Gemma 4's v_norm has no weight: where the reader's has one, set it to other numbers on a copy; if the output
    moves, the values are scaled by a weight a checkpoint does not hold."""
    norm = getattr(att, "v_norm", None)
    w = next((getattr(norm, n) for n in ("weight", "scale") if isinstance(getattr(norm, n, None), torch.Tensor)),
             None)
    if w is None:
        return None
    probe = copy.deepcopy(att)
    with torch.no_grad():
        next(getattr(probe.v_norm, n) for n in ("weight", "scale") if isinstance(getattr(probe.v_norm, n, None),
                                                                                  torch.Tensor)).copy_(
            _rand(w.numel()).view_as(w) + 0.5)
    moved = run_reader(f"{type(att).__name__}.forward", lambda: _eval(probe, x, mask, cos, sin))
    if same(moved, got):
        return None
    return Broken("value_norm_weight", "v_norm", "every value", f"v_norm holds a weight of {w.numel()} numbers that "
                  f"scales the values (set to a seeded random weight in [0.5, 1.5) on a copy, the output moves): "
                  f"Gemma 4's value norm has none, so a checkpoint holds no v_norm weight to load")


# --- the notebooks' compute_rope_params, partial ----------------------------------------------------------------

def check_partial_rope_params(fn: Callable, head_dim: int = 16, context_length: int = 8) -> PieceResult:
    """Gemma 4's (a rope_type parameter: "proportional" turns a share of the pairs) or Qwen3.5's
    (partial_rotary_factor: tables rotary_dim wide)."""
    params = inspect.signature(fn).parameters
    if "rope_type" in params:
        return _check_proportional(fn, head_dim, context_length)
    base, factor = QWEN3_5_ROPE["theta_base"], QWEN3_5_ROPE["partial_rotary_factor"]
    rot = rotary_dim(head_dim, factor)
    kwargs = dict(head_dim=head_dim, theta_base=base, context_length=context_length, partial_rotary_factor=factor)
    result = PieceResult("compute_rope_params (partial)", ", ".join(f"{k} {v:g}" for k, v in kwargs.items()))
    cos, sin = _tables(fn, kwargs)
    want_cos, want_sin = compute_rope_params(rot, base, context_length)
    if _compare(result, torch.stack((cos, sin)), torch.stack((as_double(want_cos), as_double(want_sin))),
                "dimension"):
        return result
    if cos.shape[-1] != rot:
        full = cos.shape == (context_length, head_dim) and same(cos, compute_rope_params(head_dim, base,
                                                                                          context_length)[0])
        return found(result, Broken("rope_span", "shape", "its shape", f"the tables are {list(cos.shape)}: RoPE "
                                    f"would turn {cos.shape[-1]} dimensions of each head, where Qwen3.5 turns "
                                    f"int(head_dim * partial_rotary_factor) = {rot} and passes the rest through"),
                     "partial_ignored" if full else None, LINES)
    return found(result, _rope_table_property(cos, sin, as_double(want_cos), rot, base, False), None, LINES)


def _tables(fn: Callable, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    out = run_reader(f"{fn.__name__}({kwargs})", lambda: fn(**kwargs))
    if not (isinstance(out, tuple) and len(out) == 2):
        raise PieceError(f"{fn.__name__} returned {type(out).__name__}: the notebook's returns (cos, sin)")
    return as_double(out[0]), as_double(out[1])


def _check_proportional(fn: Callable, hd: int, context_length: int) -> PieceResult:
    base, factor = 1_000_000.0, 0.25
    kwargs = dict(head_dim=hd, theta_base=base, context_length=context_length, rope_type="proportional",
                  partial_rotary_factor=factor)
    result = PieceResult("compute_rope_params (proportional)", f"head_dim {hd}, theta_base {base:,.0f}, "
                         f"context_length {context_length}, rope_type \"proportional\", partial_rotary_factor "
                         f"{factor:g}; then rope_type \"default\"")
    cos, sin = _tables(fn, kwargs)
    want = [as_double(v) for v in gemma4.compute_rope_params(hd, base, context_length, "proportional", factor)]
    if not _compare(result, torch.stack((cos, sin)), torch.stack(want), "dimension"):
        pairs = int(factor * hd // 2)
        if cos.shape == want[0].shape:
            moving = (sin[1].abs() > 1e-12) | ((cos[1] - 1).abs() > 1e-12)  # [hd]: which columns turn
            extra = [j for j in range(hd) if moving[j] and (pairs <= j % (hd // 2))]
            if extra:
                default = same(cos, as_double(gemma4.compute_rope_params(hd, base, context_length)[0]))
                return found(result, Broken("rope_span", "output", f"dimension {extra[0]}", f"with rope_type "
                                            f"\"proportional\" the tables turn {int(moving.sum()) // 2} of the "
                                            f"{hd // 2} pairs (dimension {extra[0]} has cos != 1 at position 1), "
                                            f"where Gemma 4's full layers turn the first int({factor:g} * {hd} // 2) "
                                            f"= {pairs} and give the rest frequency 0 (cos 1, sin 0)"),
                             "proportional_ignored" if default else None, LINES)
        return found(result, _rope_table_property(cos, sin, want[0], hd, base, False), None, LINES)
    kwargs.update(rope_type="default", theta_base=10_000.0)
    cos, sin = _tables(fn, kwargs)
    want = [as_double(v) for v in gemma4.compute_rope_params(hd, 10_000.0, context_length)]
    if _compare(result, torch.stack((cos, sin)), torch.stack(want), "dimension"):
        result.finding = f"{result.kind} matches glassgpt's formula (float64, both rope types)."
        return result
    return found(result, _rope_table_property(cos, sin, want[0], hd, 10_000.0, False), None, LINES)

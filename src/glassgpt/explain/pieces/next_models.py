"""The pieces of Qwen3 and Llama 3.2, as the reader wrote them (the book's `llms_from_scratch.qwen3` /
`llama3` names), against families/layers.py's formulas in float64.

GroupedQueryAttention (forward(x, mask, cos, sin)), RMSNorm, the SwiGLU FeedForward (fc1, fc2, fc3),
Qwen3's MoEFeedForward (a router `gate`, per-expert fc1/fc2/fc3, a softmax over each token's top-k
logits), apply_rope(x, cos, sin) and compute_rope_params(head_dim, theta_base, context_length). Each
runs on small seeded inputs; where it differs, the property its formula guarantees is checked first
(properties.py: rows of weights, the scale, the norm's mean square and eps, which dimensions RoPE
turns together and at which base), then verify.py's catalogue names the line.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...families import FamilyConfig, RopeFreq
from ...families.layers import GroupedQueryAttention, apply_rope, compute_rope_params, rms_norm
from ..verify import PORT_MISTAKES as FAMILY_MISTAKES, family_attention as _attention
from . import properties
from .attention import _Softmaxes
from .properties import Broken
from .report import PieceError, PieceResult, as_double, first_row_that_differs, found, largest_diff, run_reader, same

FAMILY_KINDS = ("GroupedQueryAttention", "RMSNorm", "SwiGLU FeedForward", "MoEFeedForward", "apply_rope",
                "compute_rope_params")
LINES = {name: words for name, (_, words) in FAMILY_MISTAKES.items()}
LINES.update({
    "moe_softmax_all": "the experts' weights are a softmax over all the experts' logits, then the top k taken: "
                       "take the top k logits first, then softmax over those k (topk_probs = softmax(topk_scores))",
    "moe_no_softmax": "the experts' outputs are weighted by their raw router logits: softmax the top-k logits first",
})
SEED = 123


def _rand(*shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(SEED))


def _compare_out(result: PieceResult, got: torch.Tensor, want: torch.Tensor, unit: str = "position",
                 against: str = "families/layers.py's in float64", tol: float | None = None) -> bool:
    """True when they match (within `tol`, a float32 comparison, where given); else the output's first differing
    `unit`, as a start for the finding."""
    shown = f"max |diff| {largest_diff(got, want):.3g}" if got.shape == want.shape else \
        f"shape {list(got.shape)}, glassgpt's {list(want.shape)}"
    result.lines.append(f"output against {against}: {shown}")
    result.views = {"reader_out": got, "book_out": want}
    if same(got, want, tol):
        result.finding = f"{result.kind} matches glassgpt's formula ({'float32' if tol else 'float64'}, your weights)."
        return True
    index = first_row_that_differs(got, want) if got.shape == want.shape else ()
    result.stage, result.where = "output", f"{unit} {index[-1]}" if index else "its shape"
    return False


def _unexplained(result: PieceResult, what: str) -> PieceResult:
    result.finding = f"the output first differs from glassgpt's at {result.where}; {what}"
    return result


# --- RMSNorm -------------------------------------------------------------------------------------------

def check_rms_norm(norm: nn.Module, x: torch.Tensor | None = None) -> PieceResult:
    weight = getattr(norm, "scale", getattr(norm, "weight", None))
    if weight is None:
        raise AttributeError("no scale (or weight): glassgpt reads the book's RMSNorm name, scale")
    d = weight.shape[-1]
    x = _norm_input(d) if x is None else x
    eps = float(getattr(norm, "eps", None) or 1e-6)
    result = PieceResult("RMSNorm", f"[{', '.join(map(str, x.shape))}] inputs (torch.randn, seed 123, and the same "
                                    f"1e-3 smaller), eps {eps:g} (yours)")
    got = run_reader(f"{type(norm).__name__}.forward", lambda: _eval(norm, x))
    shift = getattr(norm, "shift", None)
    want = rms_norm(as_double(x), as_double(weight), eps) + (as_double(shift) if shift is not None else 0)
    if _compare_out(result, got, want, "row"):
        return result
    z = (as_double(got) - (as_double(shift) if shift is not None else 0)) / as_double(weight)
    broken = properties.norm_rows(x, z, True, eps)
    if broken is not None:
        return found(result, broken, None, LINES)
    return _unexplained(result, "its rows keep unit mean square with eps inside the root: look at the scale")


def _norm_input(d: int) -> torch.Tensor:
    x = torch.randn(2, d, generator=torch.Generator().manual_seed(SEED)) + 0.5  # a mean that RMSNorm keeps
    return torch.cat([x, x * 1e-3])


# --- SwiGLU and mixture of experts -------------------------------------------------------------------------

SWIGLU_FORMS: dict[str, tuple[Callable, str]] = {
    "gate_up_swapped": (lambda g, u: F.silu(u) * g, "SiLU is applied to fc2's output (the up) instead of fc1's "
                                                   "(the gate): silu(fc1(x)) * fc2(x)"),
    "gelu": (lambda g, u: F.gelu(g, approximate="tanh") * u, "the gate goes through GELU where SwiGLU uses SiLU: "
                                                              "nn.functional.silu(fc1(x)) * fc2(x) (if it is Gemma "
                                                              "3's GeGLU, say so: --args gemma3)"),
    "gelu_exact": (lambda g, u: F.gelu(g) * u, "the gate goes through GELU where SwiGLU uses SiLU"),
    "no_activation": (lambda g, u: g * u, "there is no activation on the gate: silu(fc1(x)) * fc2(x)"),
    "no_up": (lambda g, u: F.silu(g), "fc2 (the up projection) is not multiplied in: silu(fc1(x)) * fc2(x)"),
    "added": (lambda g, u: F.silu(g) + u, "the gate and the up are added, not multiplied: silu(fc1(x)) * fc2(x)"),
    "relu": (lambda g, u: F.relu(g) * u, "the gate goes through ReLU where SwiGLU uses SiLU"),
}


def swiglu_inner(gate: torch.Tensor, up: torch.Tensor, inner: torch.Tensor) -> Broken | None:
    """fc3's input must be silu(fc1(x)) * fc2(x): the form of the reader's, at its first position."""
    g, u, a = as_double(gate), as_double(up), as_double(inner)
    want = F.silu(g) * u
    if a.shape == want.shape and same(a, want):
        return None
    pos = first_row_that_differs(a, want)[-1] if a.shape == want.shape else 0
    for name, (form, words) in SWIGLU_FORMS.items():
        if a.shape == want.shape and same(a, form(g, u)):
            return Broken("activation" if name != "gate_up_swapped" else "gate", "output", f"position {pos}",
                          f"fc3's input is not silu(fc1(x)) * fc2(x) (first at position {pos}): {words}")
    return Broken("activation", "output", f"position {pos}", f"fc3's input is not silu(fc1(x)) * fc2(x) (first at "
                  f"position {pos}): SwiGLU gates fc2's output by SiLU of fc1's, elementwise")


def _taps(modules: dict[str, nn.Module]):
    seen: dict[str, torch.Tensor] = {}

    def tap(name: str, take_input: bool):
        def hook(_m, args, out):  # returns None: the reader's numbers flow on unchanged
            seen.setdefault(name, (args[0] if take_input else out).detach().clone())
        return hook
    handles = [m.register_forward_hook(tap(n, n == "fc3")) for n, m in modules.items()]
    return seen, handles


def swiglu(ff: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = as_double(x)
    return F.linear(F.silu(F.linear(h, as_double(ff.fc1.weight))) * F.linear(h, as_double(ff.fc2.weight)),
                    as_double(ff.fc3.weight))


def check_swiglu(ff: nn.Module, x: torch.Tensor | None = None) -> PieceResult:
    d = ff.fc1.in_features
    x = _rand(2, 3, d) if x is None else x
    result = PieceResult("SwiGLU FeedForward", f"torch.rand(2, 3, {d}) (seed 123)")
    if ff.fc1.out_features != ff.fc2.out_features:
        return found(result, Broken("width", "shape", "fc1, fc2", f"fc1 is {ff.fc1.out_features} wide and fc2 "
                                    f"{ff.fc2.out_features}: both map emb_dim to hidden_dim"), None, LINES)
    seen, handles = _taps({"fc1": ff.fc1, "fc2": ff.fc2, "fc3": ff.fc3})
    try:
        got = run_reader(f"{type(ff).__name__}.forward", lambda: _eval(ff, x))
    finally:
        for h in handles:
            h.remove()
    if _compare_out(result, got, swiglu(ff, x)):
        return result
    broken = swiglu_inner(seen["fc1"], seen["fc2"], seen["fc3"]) if len(seen) == 3 else None
    if broken is not None:
        return found(result, broken, "gate_up_swapped" if broken.prop == "gate" else None, LINES)
    return _unexplained(result, "fc3's input is silu(fc1(x)) * fc2(x), so fc3 itself or what follows it differs")


def moe(ff: nn.Module, x: torch.Tensor, mistake: str | None = None) -> torch.Tensor:
    """Qwen3 MoE: each token's top-k router logits, softmaxed over those k, weight the k experts' SwiGLUs."""
    h = as_double(x)
    k = int(ff.num_experts_per_tok)
    logits = F.linear(h, as_double(ff.gate.weight))  # [b, t, E]
    if mistake == "moe_softmax_all":
        weights, chosen = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
    else:
        top, chosen = torch.topk(logits, k, dim=-1)  # [b, t, k]
        weights = top if mistake == "moe_no_softmax" else torch.softmax(top, dim=-1)
    out = torch.zeros_like(h)
    for e in range(len(ff.fc1)):
        g = F.linear(h, as_double(ff.fc1[e].weight))
        u = F.linear(h, as_double(ff.fc2[e].weight))
        expert = F.linear(F.silu(g) * u, as_double(ff.fc3[e].weight))  # [b, t, d]
        w = (weights * (chosen == e)).sum(-1, keepdim=True)  # [b, t, 1]: 0 where e was not chosen
        out = out + w * expert
    return out


def check_moe(ff: nn.Module, x: torch.Tensor | None = None) -> PieceResult:
    d = ff.gate.in_features
    x = _rand(2, 5, d) if x is None else x
    result = PieceResult("MoEFeedForward", f"torch.rand(2, 5, {d}) (seed 123), {len(ff.fc1)} experts, "
                                           f"{ff.num_experts_per_tok} per token")
    got = run_reader(f"{type(ff).__name__}.forward", lambda: _eval(ff, x))
    if _compare_out(result, got, moe(ff, x)):
        return result
    for mistake in ("moe_softmax_all", "moe_no_softmax"):
        if same(got, moe(ff, x, mistake)):
            words = ("each token's k expert weights sum to less than 1" if mistake == "moe_softmax_all" else
                     "each token's k expert weights are not a softmax (they do not sum to 1)")
            return found(result, Broken("router_weights", "output", result.where, f"{words} (first at "
                                        f"{result.where})"), mistake, LINES)
    return _unexplained(result, "it is no weighting of the top-k experts glassgpt knows: each token's output is "
                                "sum over its top-k experts of softmax(top-k router logits) * fc3(silu(fc1(x)) * fc2(x))")


# --- RoPE -------------------------------------------------------------------------------------------------

def check_apply_rope(fn: Callable, head_dim: int = 16, t: int = 6) -> PieceResult:
    """apply_rope(x, cos, sin): every unit vector e_i at every position, with glassgpt's tables: which
    dimension each turns into, by which angle, and whether lengths are kept."""
    cos, sin = compute_rope_params(head_dim, 10_000.0, t)
    x = torch.eye(head_dim)[None, :, None, :].expand(1, head_dim, t, head_dim).contiguous()  # head i holds e_i
    result = PieceResult("apply_rope", f"each unit vector e_i of a {head_dim}-wide head at positions 0..{t - 1}, "
                                       f"with glassgpt's cos and sin tables (theta_base 10,000)")
    got = run_reader(f"{fn.__name__}(x, cos, sin)", lambda: fn(x.clone(), cos, sin))
    want = apply_rope(x.double(), cos.double(), sin.double())
    if _compare_out(result, got, want):
        return result
    index = first_row_that_differs(got, want)
    i, p = (index[1], index[2]) if len(index) == 3 else (0, 0)
    result.where = f"dimension {i} at position {p}"
    lengths = as_double(got).norm(dim=-1)
    if not bool(((lengths - 1).abs() <= 1e-5).all()):
        bad = torch.nonzero((lengths - 1).abs() > 1e-5)[0].tolist()
        return found(result, Broken("rope_length", "output", f"dimension {bad[1]} at position {bad[2]}",
                                    f"e_{bad[1]} at position {bad[2]} comes out with length "
                                    f"{float(lengths[tuple(bad)]):.4g}: a rotation keeps each vector's length "
                                    f"(x * cos + rotated * sin, rotated = cat(-x2, x1))"), None, LINES)
    partners = properties.rope_pairs(got[0, :, 1, :])
    book = properties.rope_pairs(want[0, :, 1, :])
    if partners != book:
        return found(result, Broken("rope_pairs", "output", f"dimension {i} at position {p}",
                                    f"apply_rope turns {properties.pairing_words(partners)} together; the book "
                                    f"turns {properties.pairing_words(book)} (first at dimension {i}, position {p})"),
                     "rope_interleaved" if partners == [j ^ 1 for j in range(head_dim)] else None, LINES)
    if same(got, apply_rope(x.double(), cos.double(), -sin.double())):
        return found(result, Broken("rope_direction", "output", result.where, "apply_rope turns each pair the "
                                    "other way (the angle's sign is flipped): rotated = cat(-x2, x1), then "
                                    "x * cos + rotated * sin"), None, LINES)
    return _unexplained(result, "the pairs are the book's and lengths are kept, so the angle differs: each "
                                "position p turns pair i by p * inv_freq[i], cos and sin read at row p")


def check_rope_params(fn: Callable, head_dim: int = 16, context_length: int = 8) -> PieceResult:
    params = inspect.signature(fn).parameters
    scaled = "freq_config" in params
    base = 500_000.0 if scaled else 10_000.0
    freq = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_context_length": 4} \
        if scaled else None
    kwargs = dict(head_dim=head_dim, theta_base=base, context_length=context_length)
    result = PieceResult("compute_rope_params", f"head_dim {head_dim}, theta_base {base:,.0f}, context_length "
                                                f"{context_length}" + (f", freq_config {freq}" if freq else ""))
    out = run_reader(f"{fn.__name__}({kwargs})", lambda: fn(**kwargs, **({"freq_config": freq} if freq else {})))
    if not (isinstance(out, tuple) and len(out) == 2):
        raise PieceError(f"{fn.__name__} returned {type(out).__name__}: the book's returns (cos, sin)")
    cos, sin = (as_double(t) for t in out)
    want_cos, want_sin = (as_double(t) for t in compute_rope_params(head_dim, base, context_length,
                                                                      RopeFreq(**freq) if freq else None))
    got, want = torch.stack((cos, sin)), torch.stack((want_cos, want_sin))
    if _compare_out(result, got, want, "dimension"):
        return result
    if got.shape != want.shape:
        return found(result, Broken("rope_shape", "shape", "its shape", f"cos and sin are {list(cos.shape)}; the "
                                    f"book's are [context_length, head_dim] = [{context_length}, {head_dim}]"),
                     None, LINES)
    return found(result, _rope_table_property(cos, sin, want_cos, head_dim, base, scaled), None, LINES)


def _rope_table_property(cos, sin, want_cos, hd: int, base: float, scaled: bool) -> Broken:
    half = hd // 2
    if not torch.allclose(cos[:, :half], cos[:, half:]) and torch.allclose(cos[:, 0::2], cos[:, 1::2]):
        return Broken("rope_pairs", "output", "dimension 1", "the tables repeat each angle for neighbouring "
                      "dimensions (repeat_interleave), but apply_rope pairs dimension i with i + hd/2: "
                      "torch.cat([angles, angles], dim=1)")
    angle1 = torch.atan2(sin[1, :half], cos[1, :half])  # position 1: the angle is inv_freq itself
    p = next((q for q in range(cos.shape[0]) if not torch.allclose(cos[q], want_cos[q])), 0)
    fitted = properties.fitted_base(angle1, hd)
    book = compute_rope_params(hd, base, 2)[0]
    if scaled and fitted is not None and abs(fitted - base) <= 1e-3 * base:
        return Broken("rope_frequencies", "output", f"position {p}", f"the frequencies follow theta_base "
                      f"{fitted:,.0f} unscaled: Llama 3's frequency scaling is missing (apply freq_config: the "
                      f"slow pairs slowed by factor, the fast kept, a blend between)")
    if fitted is not None and abs(fitted - base) > 1e-3 * base:
        return Broken("rope_base", "output", f"position {p}", f"pair i turns at base^(-2i/hd) with base "
                      f"{fitted:,.6g}, not theta_base {base:,.0f}: theta_base ** (torch.arange(0, head_dim, 2) / head_dim)")
    if torch.allclose(torch.atan2(sin[0, :half], cos[0, :half]), torch.zeros(half, dtype=sin.dtype), atol=1e-6):
        return Broken("rope_frequencies", "output", f"position {p}", f"position {p}'s angles are not p * "
                      f"inv_freq (pair 0 turns {float(torch.atan2(sin[p, 0], cos[p, 0])):.4g} rad there; the book's "
                      f"{float(torch.acos(book[1, 0].double().clamp(-1, 1))) * p:.4g}): inv_freq[i] = "
                      f"1 / theta_base ** (2i / head_dim), angles = positions[:, None] * inv_freq[None, :]")
    return Broken("rope_positions", "output", "position 0", "position 0 is already turned: the positions run "
                  "0, 1, 2, ...: torch.arange(context_length)")


# --- grouped-query attention ---------------------------------------------------------------------------

def gqa_config(att: nn.Module) -> FamilyConfig:
    """What the formula needs, read off the reader's module (the book's attribute names)."""
    d_in = att.W_query.in_features
    q_norm = getattr(att, "q_norm", None)
    return FamilyConfig(family="qwen3" if q_norm is not None else "llama3", vocab_size=2, context_length=64,
                        emb_dim=d_in, n_heads=int(att.num_heads), n_layers=1, hidden_dim=1,
                        n_kv_groups=int(att.num_kv_groups), rope_base=10_000.0, head_dim=int(att.head_dim),
                        qk_norm=q_norm is not None, norm_eps=float(getattr(q_norm, "eps", 1e-6) or 1e-6))


def check_gqa(att: nn.Module, x: torch.Tensor | None = None) -> PieceResult:
    cfg = gqa_config(att)
    d, t = cfg.emb_dim, 6
    x = _rand(2, t, d) if x is None else x
    t = x.shape[1]
    cos, sin = compute_rope_params(cfg.head_dim_value, cfg.rope_base, t)
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    ref = GroupedQueryAttention(cfg).double()
    state = {k: v.double() for k, v in att.state_dict().items()}
    missing = ref.load_state_dict(state, strict=False).missing_keys
    if missing:
        raise AttributeError(f"no {', '.join(missing)}: glassgpt reads the book's names (W_query, W_key, W_value, "
                             f"out_proj, q_norm, k_norm)")
    result = PieceResult("GroupedQueryAttention", f"torch.rand(2, {t}, {d}) (seed 123), the causal mask, "
                                                  f"glassgpt's RoPE tables (theta_base 10,000)")
    mode = _Softmaxes()
    with torch.no_grad(), mode:
        got = run_reader(f"{type(att).__name__}.forward(x, mask, cos, sin)", lambda: _eval(att, x, mask, cos, sin))
    formula = _attention(ref, x, cfg, t)
    if _compare_out(result, got, formula(None)):
        return result
    mistake = _gqa_mistake(got, formula, cfg)
    broken = _gqa_property(ref, x, cos, sin, mode, cfg)
    if broken is not None:
        return found(result, broken, mistake, LINES)
    if mistake is not None:
        result.mistake = mistake
        result.finding = (f"the output first differs from glassgpt's at {result.where}, while the attention weights "
                          f"keep softmax's properties: {LINES[mistake]}")
        return result
    return _unexplained(result, "the attention weights keep softmax's properties (rows sum to 1, nothing after the "
                                "diagonal, the scale 1/sqrt(head_dim)): the difference comes after them, in the "
                                "values, the merge of the heads or out_proj")


def _gqa_mistake(got, formula, cfg) -> str | None:
    for name, (kind, _) in FAMILY_MISTAKES.items():
        if kind != "att" or name == "rope_base" or (name == "no_freq_scaling"):
            continue
        try:
            want = formula((name, None))
        except (RuntimeError, TypeError, AttributeError):
            continue
        if want.shape == got.shape and not torch.equal(want, formula(None)) and same(got, want):
            return name
    return None


def _gqa_property(ref, x, cos, sin, mode, cfg) -> Broken | None:
    if not mode.seen:
        return None
    scores, weights = mode.seen[0]
    used = mode.used[0] if mode.used else None
    for w in (used, weights):
        if w is not None and w.shape[-1] == w.shape[-2]:
            broken = properties.attention_rows(w, True)
            if broken is not None:
                return broken
    raw = _raw_scores(ref, x, cos, sin)
    return properties.score_scale(scores, raw, cfg.head_dim_value, cfg.n_heads * cfg.head_dim_value) \
        if scores.shape == raw.shape else None


def _raw_scores(ref, x, cos, sin) -> torch.Tensor:
    """q k^T of glassgpt's formula (QK-norm, RoPE, the groups repeated), the future at -inf, unscaled."""
    b, t, _ = x.shape
    h = as_double(x)
    q = ref.W_query(h).view(b, t, ref.num_heads, ref.head_dim).transpose(1, 2)
    k = ref.W_key(h).view(b, t, ref.num_kv_groups, ref.head_dim).transpose(1, 2)
    if ref.q_norm is not None:
        q, k = ref.q_norm(q), ref.k_norm(k)
    q, k = apply_rope(q, cos.double(), sin.double()), apply_rope(k, cos.double(), sin.double())
    k = k.repeat_interleave(ref.group_size, dim=1)
    return (q @ k.transpose(-2, -1)).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)


def _eval(module: nn.Module, *inputs: Any) -> torch.Tensor:
    was = module.training
    module.eval()
    try:
        with torch.no_grad():
            out = module(*inputs)
        return (out[0] if isinstance(out, tuple) else out).detach()
    finally:
        module.train(was)

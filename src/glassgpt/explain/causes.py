"""The first cause inside a layer that differs from transformers': the property its first part breaks,
and the catalogue's mistake. The layer debugger (debugger.py) finds the layer and the part; this says why.

Each property is measured on the port's own tensors, recorded by hooks on a forward pass, each part found
through the model's description (kinds.py, anatomy.py: the norm's kind, the block's placement, the
attention's window, RoPE and scale, the experts), never by the model's name:
- a norm: the formula it computes on a probe (kinds.norm_kind_by_behaviour: LayerNorm, RMSNorm, Gemma's
  (1 + weight) RMSNorm) against the one described; LayerNorm's rows (before scale and shift) have mean 0 and variance v / (v + eps), so a variance
  of (n - 1)/n is the unbiased one; RMSNorm's rows a mean square m / (m + eps), so it implies its eps;
- the attention: its softmax's input and output, read while it runs (a TorchFunctionMode): rows of
  weights that do not sum to 1, weight on a later position; the scores fitted to transformers' q k^T,
  rotated as transformers does, on neighbouring pairs, at another base or without Llama 3's scaling:
  the rotation that fits names RoPE's property, the factor the scale;
- a shortcut: the sum that is the sub-layer's output alone;
- the placement: what a sublayer reads (a norm before it where the block norms after, OLMo 3; the
  attention's sum where a parallel block feeds both the same normed input, Tiny Aya);
- a window: how many positions each query sees, against the described window;
- causality by perturbation (a linear attention has no weights to read: Qwen3.5's convolution);
- the experts' routing: the weights of each token's chosen experts, renormalised or not;
- the feed-forward's activation, fitted between its first matrices and its last;
- the positions: which rows of pos_emb the port adds.
Then the catalogue (verify.py's MISTAKES and DESCRIBED_MISTAKES, on the same weights and ids) names the
exact line where one of its mistakes reproduces the numbers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .. import anatomy as an
from ..adopt import evaluating_all, module_logits
from ..kinds import norm_kind_by_behaviour
from . import verify

RTOL = ATOL = 1e-5  # the maintainer's torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5)
ABSENT = "absent"  # in a recording: the points whose module the port does not have
HEAD_COPY = ("{where} holds the same numbers as tok_emb.weight but in separate storage: a copy, not a tie "
             "(training moves them apart); to tie them, assign model.out_head.weight = model.tok_emb.weight")
NORM_FORMULAS = {"layernorm": "LayerNorm, (x - mean) / std * scale + shift",
                 "rmsnorm": "RMSNorm, x / rms(x) * weight",
                 "rmsnorm_plus_one": "Gemma's RMSNorm, x / rms(x) * (1 + weight) (its weights stored around 0)"}


@dataclass
class Where:
    """What the debugger found, for the causes: the port (its glass file's key, config, model, and where each
    glass path is in it), the first layer that differs and its description, both recordings, the prompt."""

    key: str
    cfg: Any
    model: nn.Module
    ports: dict[str, tuple[str, Any]]
    layer: str
    block: an.Block | None
    ours: dict
    theirs: dict
    batch: torch.Tensor
    reference: str = "transformers"  # who the sentences compare with: "transformers", or "glassgpt's variant"

    def module(self, glass_path: str | None) -> nn.Module | None:
        """The port's module at a glass path (None: it has none)."""
        if glass_path is None:
            return None
        try:
            return self.model.get_submodule(self.ports.get(glass_path, (glass_path, None))[0])
        except AttributeError:
            return None

    def path(self, glass_path: str) -> str:
        return self.ports.get(glass_path, (glass_path, None))[0]

    def got(self, name: str) -> torch.Tensor | None:
        return self.ours.get(f"{self.layer}.{name}")

    def rel(self, path: str) -> str:
        return path.removeprefix(self.layer + ".")


def position_property(w: Where, got: torch.Tensor | None) -> str | None:
    """Which rows of pos_emb the port adds: the offset k where rows k..k+t-1 are what it used."""
    table = _param(w.module("pos_emb"), "weight")
    if got is None or table is None:
        return None
    got, table = got.reshape(-1, got.shape[-1])[: got.shape[-2]], table.detach().double()
    t = got.shape[0]
    for k in range(table.shape[0] - t + 1):
        if torch.allclose(got, table[k:k + t], rtol=RTOL, atol=ATOL):
            return (f"it adds the rows {k}..{k + t - 1} of pos_emb to the {t} tokens: the positions count from "
                    f"{k}, not 0 (torch.arange(num_tokens))")
    return None


def catalogue(family: str, model: nn.Module, ids: list[int], layer: str, part: str | None):
    """(the mistake's key, its sentence) from verify.py's catalogues, on the same
    weights and ids, where the stage it names is in the layer the table found."""
    try:
        result = verify.check(model, ids=ids) if family == "gpt2" else verify.check_family(model, ids)
    except Exception:  # noqa: BLE001  the catalogue reads the models it knows; another is no catalogue finding
        return None, None
    if result.mistake is None or result.first is None:
        return None, None
    stage = result.first.name
    if layer == "embedding":
        layer = ("tok_emb", "pos_emb", "embeddings")
    if not stage.startswith(layer):
        return None, None
    return result.mistake, re.sub(r"^\S+ is the first stage that differs[^:]*: ", "", result.finding).rstrip(".")


def broken_property(w: Where, part: str) -> str | None:
    """The property the first differing part of block `w.block` breaks, in the port's terms (None: none of
    the short set)."""
    block = w.block
    att, ff = block.attention, block.ff
    if w.got(part) is None:
        never = "your port has no such module" if f"{w.layer}.{part}" in w.ours.get(ABSENT, ()) else \
            "your forward never calls it"
        return f"{w.reference} runs {part} here ({_PURPOSE.get(part.rpartition('.')[2], 'this part')}) and {never}"
    norms = {w.rel(n.path): n for n in block.norms}
    if part in norms:
        norm = norms[part]
        x = {"attn_in": _block_input(w), "ff_in": w.got("shortcut1"), "attn_out": w.got(w.rel(att.path)),
             "ff_out": w.got(w.rel(ff.path))}.get(norm.role)
        return norm_property(w, norm, x, w.got(part))
    if part in ("shortcut1", "output"):
        x = _block_input(w) if part == "shortcut1" else w.got("shortcut1")
        after = block.norm("attn_out" if part == "shortcut1" else "ff_out")
        added = w.got(w.rel(after.path)) if after else w.got(w.rel((att if part == "shortcut1" else ff).path))
        if added is not None and x is not None and torch.allclose(w.got(part), added, rtol=RTOL, atol=ATOL):
            return ("the block's " + ("first" if part == "shortcut1" else "second") + " sum is the sub-layer's "
                    "output alone, without the block's input: the shortcut (x = x + shortcut) is missing")
        return _output_scale_property(w, block) if part == "output" else None
    sub = att if part.startswith(w.rel(att.path)) else ff if part.startswith(w.rel(ff.path)) else None
    if sub is not None:
        placed = placement_property(w, sub)
        if placed:
            return placed
    if part == w.rel(att.path) and att.kv_shared_from is not None and w.got(f"{part}<own-key") is not None:
        own = att.key.path.rpartition(".")[2]
        return (f"{w.layer} is kv-shared: it attends over the keys and values blocks.{att.kv_shared_from} computed, "
                f"but your forward calls its own {part}.{own}: it computes keys of its own ({w.reference}' "
                f"{w.layer} has no {own})")
    if part == w.rel(att.path):
        return attention_property(w, att)
    if part == w.rel(ff.path):
        return ff_property(w, ff)
    return None


def _output_scale_property(w: Where, described: an.Block) -> str | None:
    """The stored number a block's output is multiplied by (Block.output_scale: Gemma 4's layer_scalar): named only
    where the port's output times it is the reference's, every part before matching."""
    if described.output_scale is None:
        return None
    scalar = getattr(w.module(w.layer), described.output_scale, None)
    ours, theirs = w.got("output"), w.theirs.get(f"{w.layer}.output")
    if not torch.is_tensor(scalar) or ours is None or theirs is None or scalar.numel() != 1:
        return None
    s = float(scalar)
    if s != 1.0 and torch.allclose(ours.cpu() * s, theirs.cpu(), rtol=RTOL, atol=ATOL):
        name = described.output_scale
        return (f"its output times {w.layer}.{name} ({s:.4g}) is {w.reference}': the block's last step, "
                f"x * {name} (one stored number per block), is left out")
    return None


_PURPOSE = {"q_norm": "an RMSNorm over each query head, before RoPE",
            "k_norm": "an RMSNorm over each key head, before RoPE"}


def _block_input(w: Where) -> torch.Tensor | None:
    return w.ours.get("embedding") if w.block.index == 0 else w.ours.get(_previous(w.layer))


def _previous(layer: str) -> str:
    head, _, i = layer.rpartition(".")
    return f"{head}.{int(i) - 1}"


# --- the placement: what a sublayer reads ------------------------------------------------------------------

def placement_property(w: Where, sub: an.Attention | an.FeedForward) -> str | None:
    """Where the port's attention or feed-forward reads another input than the reference's: which of the
    port's own tensors it reads instead, told against the block's described placement."""
    name = w.rel(sub.path)
    mine, ref = w.got(f"{name}<in"), w.theirs.get(f"{w.layer}.{name}<in")
    if mine is None or ref is None or mine.shape != ref.shape or torch.allclose(mine, ref, rtol=RTOL, atol=ATOL):
        return None
    block = w.block
    is_att = isinstance(sub, an.Attention)
    if block.placement == "parallel" and not is_att:
        att_in = w.got(f"{w.rel(block.attention.path)}<in")
        if att_in is not None and not torch.allclose(mine, att_in, rtol=RTOL, atol=ATOL):
            return (f"{name} reads another input than the attention: the block runs them one after the other, where "
                    f"its described placement is parallel, both reading the same normed input: x + att(norm(x)) + "
                    f"ff(norm(x)), one norm ({w.rel(block.norms[0].path)}) for both")
    for norm in block.norms:
        normed = w.got(w.rel(norm.path))
        if normed is not None and normed.shape == mine.shape and torch.allclose(mine, normed, rtol=RTOL, atol=ATOL):
            if norm.role in ("attn_out", "ff_out"):
                return (f"{name} reads {w.rel(norm.path)}'s output: the norm runs before the sublayer, where this "
                        f"block's norms come after it ({block.placement}): x + {w.rel(norm.path)}"
                        f"({'att' if is_att else 'ff'}(x)), the sublayer reading x itself")
            return (f"{name} reads {w.rel(norm.path)}'s output, where this block ({block.placement}) feeds it "
                    "another input")
    return None


# --- norms ---------------------------------------------------------------------------------------------------

def norm_property(w: Where, norm: an.Norm, x, y) -> str | None:
    """The formula the port's norm computes (on a probe) against the described kind; then its output
    statistics against its input's: LayerNorm's rows (before scale and shift) have mean 0 and variance
    v / (v + eps); RMSNorm's (over its scale) a mean square m / (m + eps) and the input's mean left in.
    x, y: the norm's input and the port's output."""
    module = w.module(norm.path)
    if x is None or y is None or module is None:
        return None
    weight, bias = _param(module, "scale", "weight"), _param(module, "shift", "bias")
    if weight is None:
        return None
    found = norm_kind_by_behaviour(module, weight.detach(), None if bias is None else bias.detach(), norm.eps)
    if found is not None and found != norm.kind:
        if {found, norm.kind} == {"layernorm", "rmsnorm"} and found == "layernorm":
            return ("its rows come out with mean 0: it subtracts each row's mean, as LayerNorm does, where RMSNorm "
                    "only divides by the root mean square: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)")
        return f"it computes {NORM_FORMULAS[found]}, where the description has {NORM_FORMULAS[norm.kind]}"
    n = x.shape[-1]
    w_ = weight.detach().double()
    if norm.kind == "layernorm":
        shift = 0 if bias is None else bias.detach().double()
        z = (y - shift) / w_
        mean, var = z.mean(-1), z.var(-1, unbiased=False)
        if float(mean.abs().max()) > 1e-4:
            return f"its rows (before scale and shift) have mean up to {float(mean.abs().max()):.3g}, not 0"
        v = x.var(-1, unbiased=False)
        ratio = float((var * (v + norm.eps) / v).median())
        if abs(ratio - (n - 1) / n) < 1e-3:
            return (f"its rows have variance {ratio:.4f} x the right one, (n - 1)/n for n = {n}: it divides by the "
                    "unbiased variance (n - 1); LayerNorm divides by n (unbiased=False)")
        return _eps_sentence(float((v * (1 / var - 1)).median()), norm.eps, "variance", w.reference)
    z = y / (w_ + 1 if norm.kind == "rmsnorm_plus_one" else w_)
    m = x.pow(2).mean(-1)
    if float(z.mean(-1).abs().max()) < 1e-5 < float(x.mean(-1).abs().max()):
        return ("its rows come out with mean 0: it subtracts each row's mean, as LayerNorm does, where RMSNorm only "
                "divides by the root mean square: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)")
    return _eps_sentence(float((m * (1 / z.pow(2).mean(-1) - 1)).median()), norm.eps, "mean square", w.reference)


def _eps_sentence(eps: float, want: float, statistic: str, reference: str) -> str | None:
    if abs(eps - want) <= 0.5 * want:
        return None  # the statistics are a norm's: what differs is elsewhere (its scale, its shift)
    return (f"its rows' {statistic} implies eps = {eps:.2g} inside the root, where {reference}'s is {want:g}: "
            "torch.sqrt(var + eps), eps from the config")


def _param(module: nn.Module | None, *names: str) -> torch.Tensor | None:
    if module is None:
        return None
    return next((getattr(module, n) for n in names if isinstance(getattr(module, n, None), torch.Tensor)), None)


# --- attention ------------------------------------------------------------------------------------------------

class _Softmaxes(TorchFunctionMode):
    """The (input, output) of each softmax, only while `inside` is set (by hooks on one module)."""

    def __init__(self):
        super().__init__()
        self.inside, self.seen = False, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.inside and getattr(func, "__name__", "") == "softmax" and args and torch.is_tensor(out):
            self.seen.append((args[0].detach().double().clone(), out.detach().double().clone()))
        return out


def _softmaxes(model: nn.Module, path: str, batch: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    mode = _Softmaxes()
    sub = model.get_submodule(path)
    pre = sub.register_forward_pre_hook(lambda *a: setattr(mode, "inside", True))
    post = sub.register_forward_hook(lambda *a: setattr(mode, "inside", False))
    try:
        with torch.inference_mode(), evaluating_all(model), mode:
            module_logits(model, batch)
    finally:
        pre.remove()
        post.remove()
    return mode.seen


def attention_property(w: Where, att: an.Attention) -> str | None:
    """Causality (by perturbation, for a linear attention), rows of weights sum to 1, nothing on a later
    position, the window, the scores' scale, RoPE's pairs, the groups' sharing."""
    if att.kind == "linear":
        return causality_property(w, att)
    seen = _softmaxes(w.model, w.path(att.path), w.batch)
    if not seen:
        return causality_property(w, att)  # scaled_dot_product_attention or another kernel: no weights to read
    scores, weights = seen[0]
    weights = weights.reshape(-1, *weights.shape[-2:])  # [b*h, t, t]
    t = weights.shape[-1]
    sums = weights.sum(-1)
    if float((sums - 1).abs().max()) > 1e-6:
        bad = torch.nonzero((sums - 1).abs() > 1e-6)[0]
        return (f"row {int(bad[1])} of head {int(bad[0])}'s attention weights sums to {float(sums[tuple(bad)]):.3g}, "
                "not 1: take the softmax over the keys (dim=-1), after the mask")
    later = weights.triu(1)
    if float(later.abs().max()) > 0:
        bad = torch.nonzero(later > 0)[0]
        return (f"position {int(bad[1])} puts weight {float(weights[tuple(bad)]):.3g} on the later position "
                f"{int(bad[2])}: the causal mask is missing, or hides the earlier positions instead")
    if att.window is not None and t > att.window:
        seen_per_row = (weights > 0).sum(-1).amax(0)  # [t]: the positions each query puts weight on
        sees = int(seen_per_row.max())
        if sees != att.window:
            row = int(torch.nonzero(seen_per_row == sees)[0])
            words = ("every earlier position: the window is not applied" if sees == t else
                     f"the last {sees} positions, itself included")
            return (f"position {row} sees {words}, where the window is {att.window}: "
                    + ("off by one; " if abs(sees - att.window) == 1 else "")
                    + f"query i sees key j when 0 <= i - j < {att.window}")
    return _scale_and_rope(w, att, scores.reshape(-1, t, t))


def causality_property(w: Where, att: an.Attention) -> str | None:
    """Change the last position's input alone and see whether an earlier output moves: the property any
    causal token mixer keeps, read where there are no weights to read (a convolution, a recurrent state)."""
    module = w.module(att.path)
    if module is None:
        return None
    call: dict[str, Any] = {}

    def keep(_mod, args, kwargs):
        call.setdefault("args", (args, kwargs))
    handle = module.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with torch.inference_mode(), evaluating_all(w.model):
            module_logits(w.model, w.batch)
    finally:
        handle.remove()
    if "args" not in call or not call["args"][0]:
        return None
    args, kwargs = call["args"]
    x = args[0]
    t = x.shape[1]
    moved = x.clone()
    moved[:, -1] = moved[:, -1] + 1.0
    with torch.inference_mode(), evaluating_all(w.model):
        before, after = (module(y, *args[1:], **kwargs) for y in (x, moved))
    before, after = (o[0] if isinstance(o, (tuple, list)) else o for o in (before, after))
    change = (after[:, : t - 1] - before[:, : t - 1]).abs().amax(dim=(0, 2))  # [t - 1]
    if float(change.max()) <= 1e-6:
        return None
    p = int(torch.nonzero(change > 1e-6)[0])
    text = (f"it is not causal: its output at position {p} moves (by {float(change[p]):.3g}) when only position "
            f"{t - 1}'s input changes")
    if att.state is not None:
        k = att.state.conv_kernel
        text += (f"; its short convolution ({w.rel(att.state.conv)}, kernel {k}) must see its own token and the {k - 1} "
                 f"before it only: pad {k - 1} zeros on the left and none on the right, keeping the first t outputs")
    return text


def _scale_and_rope(w: Where, att: an.Attention, scores) -> str | None:
    """Fit the port's scores to q k^T, with q and k rotated as the reference rotates them or in one of the
    ways a port gets RoPE wrong (neighbouring pairs, another base, Llama 3's scaling left out), and the
    key/value groups shared as described or in turn: the rotation and sharing that fit name the property,
    the factor the scale. scores: [b*h, t, t], the softmax's input."""
    if att.output_gate is not None or (att.rope is not None and (att.rope.rotary_dim or
                                                                 att.rope.scaling not in (None, "llama3"))):
        return None  # a gate inside W_query, a partial or YaRN rotation: not fitted here
    # the reference's q and k (the port's agreed with them, or an earlier part would have differed)
    q, k = (w.theirs.get(f"{w.layer}.{w.rel((norm or lin).path)}")
            for norm, lin in ((att.q_norm, att.query), (att.k_norm, att.key)))
    if q is None or k is None:
        return None
    t, hd = scores.shape[-1], att.head_dim
    q, k = (y.reshape(y.shape[0], t, -1, hd).transpose(1, 2) for y in (q, k))  # [b, t, ...] -> [b, h, t, hd]
    group = q.shape[1] // k.shape[1]
    lower = torch.ones(t, t, dtype=torch.bool).tril()
    got = scores[:, lower]
    want = att.scale if att.scale is not None else 1 / math.sqrt(hd)
    sharings = [(k.repeat_interleave(group, dim=1), None)]
    if group > 1:
        sharings.append((k.repeat(1, group, 1, 1), (
            f"query head h reads key/value group h % {k.shape[1]}, where the {group} query heads of a group share "
            f"one: group h // {group}; expand the groups with repeat_interleave({group}, dim=1), not repeat")))
    for rotation, broken in _rotations(w, att, hd):
        for kk, shared in sharings:
            qr, kr = (q, kk) if rotation is None else rotation(q, kk, t)
            raw = (qr @ kr.transpose(-2, -1)).reshape(-1, t, t)[:, lower]
            c = float((got * raw).sum() / (raw * raw).sum())
            if float((got - c * raw).abs().max()) > 1e-4 * max(float(got.abs().max()), 1e-30):
                continue
            if broken or shared:
                return broken or shared
            if abs(c / want - 1) <= 1e-3:
                return None  # RoPE and the scale are right: what differs is elsewhere (the values, the merge)
            named = {1.0: "1 (not scaled at all)", math.sqrt(w.cfg.emb_dim): f"sqrt(emb_dim) = sqrt({w.cfg.emb_dim})"}
            what = next((v for key, v in named.items() if abs(1 / c - key) < 1e-3 * key), f"{1 / c:.4g}")
            meant = (f"sqrt(head_dim) = sqrt({hd})" if att.scale is None else
                     f"{1 / att.scale:.4g} (the described scale, 1 / {1 / att.scale:.4g})")
            return f"the scores are divided by {what} where the head size was meant: divide by {meant}"
    return None


def _rotations(w: Where, att: an.Attention, hd: int):
    """(rotate(q, k, t) or None, the property it breaks or None): the reference's first, then the wrong ones."""
    if att.rope is None:
        yield None, None
        return

    def rope(pairs=None, base=att.rope.base, scaled=True):
        def rotate(q, k, t):
            cos, sin = verify._rope_tables(att.rope, t, base, scaled)  # float64, the description's pairing
            turn = pairs or (lambda x, c, s: verify._rotate(x, c, s, att.rope.pairs))
            return turn(q, cos, sin), turn(k, cos, sin)
        return rotate

    yield rope(), None
    if att.rope.pairs == "halves":
        yield rope(pairs=verify._rope_interleaved), (
            f"RoPE rotates neighbouring pairs (x[0], x[1]), (x[2], x[3]), ... where {w.reference} rotates the halves "
            f"(x[i], x[i + {hd // 2}])")
    for base in verify.ROPE_BASES:
        if base != att.rope.base:
            yield rope(base=base), (f"RoPE turns at theta base {base:,.0f}, where the config's rope_base is "
                                    f"{att.rope.base:,.0f}")
    if att.rope.scaling == "llama3":
        yield rope(scaled=False), ("RoPE's frequencies are not scaled as Llama 3's are (rope_freq: factor, low and "
                                   "high frequency factors): the long wavelengths turn too fast")


# --- the feed-forward -------------------------------------------------------------------------------------------

def _hooked(w: Where, paths: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{glass path: (its module's input, output)} of one forward pass of the port, the first call each."""
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for path in paths:
        sub = w.module(path)
        if sub is None:
            continue

        def hook(_mod, args, out, path=path) -> None:  # (a hook that returned a value would replace the output)
            y = out[0] if isinstance(out, (tuple, list)) else out
            seen.setdefault(path, (args[0].detach().double(), y.detach().double()))
        hooks.append(sub.register_forward_hook(hook))
    try:
        with torch.inference_mode(), evaluating_all(w.model):
            module_logits(w.model, w.batch)
    finally:
        for h in hooks:
            h.remove()
    return seen


def ff_property(w: Where, ff: an.FeedForward) -> str | None:
    """The routing of a mixture of experts; else the activation, fitted between the first matrices and the last."""
    if ff.experts is not None:
        return routing_property(w, ff)
    paths = [ff.up.path, ff.down.path] + ([ff.gate.path] if ff.gate else [])
    seen = _hooked(w, paths)
    if any(p not in seen for p in paths):
        return None
    up, a = seen[ff.up.path][1], seen[ff.down.path][0]
    if ff.gate is None:
        forms = {"the tanh GELU": F.gelu(up, approximate="tanh"), "the exact GELU (erf)": F.gelu(up), "ReLU": F.relu(up)}
        if ff.activation == "gelu":
            forms = {"the exact GELU (erf)": forms.pop("the exact GELU (erf)")} | forms
        want = "GPT-2's tanh GELU" if ff.activation == "gelu_tanh" else ff.activation
    else:
        gate = seen[ff.gate.path][1]
        act = {"silu": F.silu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"), "gelu": F.gelu}[ff.activation]
        name = {"silu": "silu", "gelu_tanh": "gelu_tanh", "gelu": "gelu"}[ff.activation]
        forms = {f"{name}(gate(x)) * up(x)": act(gate) * up,
                 f"{name}(up(x)) * gate(x) (gate and up swapped)": act(up) * gate, f"{name}(gate(x)) alone": act(gate)}
        want = f"{'SwiGLU' if ff.kind == 'swiglu' else 'GeGLU'}, {name}(gate) * up"
    found = next((name for name, v in forms.items() if torch.allclose(a, v, rtol=1e-5, atol=1e-6)), None)
    if found is None or found == next(iter(forms)):
        return None
    return f"the activation is {found}, where {w.reference} uses {want}"


def routing_property(w: Where, ff: an.FeedForward) -> str | None:
    """Each token's weights over its chosen experts: the softmax over the top-k scores (they sum to 1), or
    over all experts before the top k are kept (they do not)."""
    ex = ff.experts
    router = ex.router.path
    seen = _hooked(w, [router, ff.path])
    if router not in seen or ff.path not in seen:
        return None
    x, scores = seen[router]
    got = seen[ff.path][1]
    x, scores, got = x.reshape(-1, x.shape[-1]), scores.reshape(-1, scores.shape[-1]), got.reshape(-1, got.shape[-1])

    def leaf(lin: an.Linear, e: int) -> nn.Module | None:
        """Expert e's matrix: expert 0's path with its last index 0 as e (anatomy.Experts)."""
        parts = lin.path.split(".")
        last = max(i for i, p in enumerate(parts) if p == "0")
        return w.module(".".join(parts[:last] + [str(e)] + parts[last + 1:]))

    def expert(e: int, h: torch.Tensor) -> torch.Tensor:
        up, down = leaf(ff.up, e), leaf(ff.down, e)
        lin = lambda m, v: F.linear(v, m.weight.double(), None if m.bias is None else m.bias.double())  # noqa: E731
        inner = F.silu(lin(leaf(ff.gate, e), h)) * lin(up, h) if ff.gate is not None else F.gelu(lin(up, h))
        return lin(down, inner)

    def mix(weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for slot in range(chosen.shape[1]):
            for e in chosen[:, slot].unique().tolist():
                rows = chosen[:, slot] == e
                out[rows] += weights[rows, slot, None] * expert(e, x[rows])
        return out

    k = ex.per_token
    with torch.inference_mode():
        top, chosen = scores.topk(k, dim=-1)
        right = mix(torch.softmax(top, -1), chosen)
        unnormed = torch.softmax(scores, -1).gather(-1, chosen)
        wrong = mix(unnormed, chosen)
    if torch.allclose(got, right, rtol=1e-5, atol=1e-6) or not torch.allclose(got, wrong, rtol=1e-5, atol=1e-6):
        return None
    total = float(unnormed.sum(-1).mean())
    return (f"each token's {k} routing weights sum to {total:.3g} on average, not 1: the softmax runs over all "
            f"{ex.n_experts} experts before the top {k} are kept; take the softmax over the {k} chosen scores (or "
            f"divide the kept weights by their sum)")

"""The first cause inside a layer that differs from transformers': the property its first part breaks,
and the catalogue's mistake. The layer debugger (debugger.py) finds the layer and the part; this says why.

Each property is measured on the port's own tensors, recorded by hooks on a forward pass:
- a norm: LayerNorm's rows (before scale and shift) have mean 0 and variance v / (v + eps), so a variance
  of (n - 1)/n is the unbiased one; RMSNorm's rows a mean square m / (m + eps), so it implies its eps;
- the attention: its softmax's input and output, read while it runs (a TorchFunctionMode): rows of
  weights that do not sum to 1, weight on a later position; the scores fitted to transformers' q k^T,
  rotated as transformers does, on neighbouring pairs, at another base or without Llama 3's scaling:
  the rotation that fits names RoPE's property, the factor the scale;
- a shortcut: the sum that is the sub-layer's output alone;
- the feed-forward's activation, fitted between its first matrices and its last;
- the positions: which rows of pos_emb the port adds.
Then the catalogue (verify.py's MISTAKES and DESCRIBED_MISTAKES, on the same weights and ids) names the
exact line where one of its mistakes reproduces the numbers.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..adopt import evaluating_all, module_logits
from ..families.layers import apply_rope, compute_rope_params
from . import verify

RTOL = ATOL = 1e-5  # the maintainer's torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5)
ABSENT = "absent"  # in a recording: the points whose module the port does not have
HEAD_COPY = ("{where} holds the same numbers as tok_emb.weight but in separate storage: a copy, not a tie "
             "(training moves them apart); to tie them, assign model.out_head.weight = model.tok_emb.weight")


def position_property(model: nn.Module, stages: dict[str, str], got: torch.Tensor | None) -> str | None:
    """Which rows of pos_emb the port adds: the offset k where rows k..k+t-1 are what it used."""
    table = _param(module_at(model, stages, "pos_emb"), "weight")
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
    result = verify.check(model, ids=ids) if family == "gpt2" else verify.check_family(model, ids)
    if result.mistake is None or result.first is None:
        return None, None
    stage = result.first.name
    if layer == "embedding":
        layer = ("tok_emb", "pos_emb", "embeddings")
    if not stage.startswith(layer):
        return None, None
    return result.mistake, re.sub(r"^\S+ is the first stage that differs[^:]*: ", "", result.finding).rstrip(".")


def module_at(model: nn.Module, stages: dict[str, str], stage: str) -> nn.Module | None:
    """The port's module for glassgpt's stage name (None: it has none)."""
    try:
        return model.get_submodule(stages[stage])
    except (AttributeError, KeyError):
        return None


def broken_property(family, cfg, model, stages, layer, part, ours, theirs, batch) -> str | None:
    """The property the first differing part breaks, in the port's terms (None: none of the short set)."""
    got = lambda name: ours.get(f"{layer}.{name}")  # noqa: E731
    if got(part) is None:
        never = "your port has no such module" if f"{layer}.{part}" in ours.get(ABSENT, ()) else \
            "your forward never calls it"
        return f"transformers runs {part} here ({_PURPOSE.get(part, 'this part')}) and {never}"
    if part in ("norm1", "norm2"):
        x = got("shortcut1") if part == "norm2" else _block_input(layer, ours)
        return norm_property(family, x, got(part), module_at(model, stages, f"{layer}.{part}"), cfg)
    if part in ("shortcut1", "output"):
        x = _block_input(layer, ours) if part == "shortcut1" else got("shortcut1")
        added = got("att") if part == "shortcut1" else got("ff")
        if added is not None and x is not None and torch.allclose(got(part), added, rtol=RTOL, atol=ATOL):
            return ("the block's " + ("first" if part == "shortcut1" else "second") + " sum is the sub-layer's "
                    "output alone, without the block's input: the shortcut (x = x + shortcut) is missing")
        return None
    if part == "att":
        return attention_property(family, cfg, model, stages, layer, theirs, batch)
    if part == "ff":
        return _ff_property(family, model, stages, layer, batch)
    return None


_PURPOSE = {"att.q_norm": "an RMSNorm over each query head, before RoPE",
            "att.k_norm": "an RMSNorm over each key head, before RoPE"}


def _block_input(layer: str, ours: dict) -> torch.Tensor | None:
    i = int(layer.split(".")[1])
    return ours.get("embedding") if i == 0 else ours.get(f"trf_blocks.{i - 1}")


def norm_property(family: str, x, y, norm: nn.Module | None, cfg) -> str | None:
    """A norm's output statistics against its input's: LayerNorm's rows (before scale and shift) have
    mean 0 and variance v / (v + eps); RMSNorm's (over its scale) a mean square m / (m + eps) and the
    input's mean left in. x, y: the norm's input and the port's output."""
    if x is None or y is None or norm is None:
        return None
    n = x.shape[-1]
    if family == "gpt2":
        scale, shift = _param(norm, "scale", "weight"), _param(norm, "shift", "bias")
        z = (y - (0 if shift is None else shift.detach().double())) / scale.detach().double()
        mean, var = z.mean(-1), z.var(-1, unbiased=False)
        if float(mean.abs().max()) > 1e-4:
            return f"its rows (before scale and shift) have mean up to {float(mean.abs().max()):.3g}, not 0"
        v = x.var(-1, unbiased=False)
        ratio = float((var * (v + GPT2_EPS) / v).median())
        if abs(ratio - (n - 1) / n) < 1e-3:
            return (f"its rows have variance {ratio:.4f} x the right one, (n - 1)/n for n = {n}: it divides by the "
                    "unbiased variance (n - 1); LayerNorm divides by n (unbiased=False)")
        return _eps_sentence(float((v * (1 / var - 1)).median()), GPT2_EPS, "variance")
    z = y / _param(norm, "scale", "weight").detach().double()
    m = x.pow(2).mean(-1)
    if float(z.mean(-1).abs().max()) < 1e-5 < float(x.mean(-1).abs().max()):
        return ("its rows come out with mean 0: it subtracts each row's mean, as LayerNorm does, where RMSNorm only "
                "divides by the root mean square: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)")
    return _eps_sentence(float((m * (1 / z.pow(2).mean(-1) - 1)).median()), cfg.norm_eps, "mean square")


GPT2_EPS = 1e-5  # GPT-2's layer_norm_epsilon, transformers' too


def _eps_sentence(eps: float, want: float, statistic: str) -> str | None:
    if abs(eps - want) <= 0.5 * want:
        return None  # the statistics are a norm's: what differs is elsewhere (its scale, its shift)
    return (f"its rows' {statistic} implies eps = {eps:.2g} inside the root, where transformers' is {want:g}: "
            "torch.sqrt(var + eps), eps from the config")


def norm_eps(norm: nn.Module) -> float:
    eps = getattr(norm, "eps", 1e-5)
    return float(eps) if isinstance(eps, (int, float)) else 1e-5


def _param(module: nn.Module, *names: str) -> torch.Tensor | None:
    return next((getattr(module, n) for n in names if isinstance(getattr(module, n, None), torch.Tensor)), None)


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


def attention_property(family, cfg, model, stages, layer, theirs, batch) -> str | None:
    """Rows of weights sum to 1, nothing on a later position, the scores' scale, RoPE's pairs."""
    seen = _softmaxes(model, stages[f"{layer}.att"], batch)
    if not seen:
        return None  # scaled_dot_product_attention or another kernel: no weights to read
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
    return _scale_and_rope(family, cfg, layer, theirs, scores.reshape(-1, t, t))


def _scale_and_rope(family, cfg, layer, theirs, scores) -> str | None:
    """Fit the port's scores to q k^T, with q and k rotated as transformers rotates them or in one of the
    ways a port gets RoPE wrong (neighbouring pairs, another base, Llama 3's scaling left out): the
    rotation that fits says RoPE's property, the factor the scale. scores: [b*h, t, t], the softmax's input."""
    # transformers' q and k (the port's agreed with them, or an earlier part would have differed):
    # [b, t, h*hd] from the projections, or [b, t, h, hd] from q_norm / k_norm
    q = theirs.get(f"{layer}.att.q_norm", theirs.get(f"{layer}.att.W_query"))
    k = theirs.get(f"{layer}.att.k_norm", theirs.get(f"{layer}.att.W_key"))
    if q is None or k is None:
        return None
    t = scores.shape[-1]
    hd = cfg.head_dim_value if family != "gpt2" else cfg.emb_dim // cfg.n_heads
    q, k = (y.reshape(y.shape[0], t, -1, hd).transpose(1, 2) for y in (q, k))  # [b, t, ...] -> [b, h, t, hd]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    lower = torch.ones(t, t, dtype=torch.bool).tril()
    got = scores[:, lower]
    for rotation, broken in _rotations(family, cfg, hd):
        qr, kr = (q, k) if rotation is None else rotation(q, k, t)
        raw = (qr @ kr.transpose(-2, -1)).reshape(-1, t, t)[:, lower]
        c = float((got * raw).sum() / (raw * raw).sum())
        if float((got - c * raw).abs().max()) > 1e-4 * max(float(got.abs().max()), 1e-30):
            continue
        if broken:
            return broken
        if abs(c * math.sqrt(hd) - 1) <= 1e-3:
            return None  # RoPE and the scale are right: what differs is elsewhere (the values, the merge)
        named = {1.0: "1 (not scaled at all)", math.sqrt(cfg.emb_dim): f"sqrt(emb_dim) = sqrt({cfg.emb_dim})"}
        what = next((v for key, v in named.items() if abs(1 / c - key) < 1e-3 * key), f"{1 / c:.4g}")
        return f"the scores are divided by {what} where the head size was meant: divide by sqrt(head_dim) = sqrt({hd})"
    return None


def _rotations(family, cfg, hd):
    """(rotate(q, k, t) or None, the property it breaks or None): transformers' first, then the wrong ones."""
    if family == "gpt2":
        yield None, None
        return

    def rope(pairs=apply_rope, base=cfg.rope_base, freq=cfg.rope_freq):
        def rotate(q, k, t):
            cos, sin = compute_rope_params(hd, base, t, freq)
            return pairs(q, cos.double(), sin.double()), pairs(k, cos.double(), sin.double())
        return rotate

    yield rope(), None
    yield rope(pairs=verify._rope_interleaved), (
        f"RoPE rotates neighbouring pairs (x[0], x[1]), (x[2], x[3]), ... where transformers rotates the halves "
        f"(x[i], x[i + {hd // 2}])")
    for base in verify.ROPE_BASES:
        if base != cfg.rope_base:
            yield rope(base=base), (f"RoPE turns at theta base {base:,.0f}, where the config's rope_base is "
                                    f"{cfg.rope_base:,.0f}")
    if cfg.rope_freq is not None:
        yield rope(freq=None), ("RoPE's frequencies are not scaled as Llama 3's are (rope_freq: factor, low and high "
                                "frequency factors): the long wavelengths turn too fast")


def _ff_property(family, model, stages, layer, batch) -> str | None:
    """The activation: what the port applies between its first matrices and its last, fitted."""
    ff = model.get_submodule(stages[f"{layer}.ff"])
    linears = [name for name, m in ff.named_modules() if isinstance(m, nn.Linear)]  # the book's layers.0 and .2
    if family == "gpt2" and len(linears) < 2:
        return None
    first, last = (linears[0], linears[-1]) if family == "gpt2" else ("fc1", "fc3")
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for name in (first, last) + (("fc2",) if family != "gpt2" else ()):
        try:
            sub = ff.get_submodule(name)
        except AttributeError:
            return None
        def hook(_mod, args, out, name=name) -> None:  # (a hook that returned a value would replace the output)
            seen.setdefault(name, (args[0].detach().double(), out.detach().double()))
        hooks.append(sub.register_forward_hook(hook))
    try:
        with torch.inference_mode(), evaluating_all(model):
            module_logits(model, batch)
    finally:
        for h in hooks:
            h.remove()
    if first not in seen or last not in seen:
        return None
    h, a = seen[first][1], seen[last][0]
    if family == "gpt2":
        forms = {"the tanh GELU": F.gelu(h, approximate="tanh"), "the exact GELU (erf)": F.gelu(h), "ReLU": F.relu(h)}
        want = "GPT-2's tanh GELU"
    else:
        up = seen["fc2"][1]
        forms = {"silu(fc1(x)) * fc2(x)": F.silu(h) * up, "silu(fc2(x)) * fc1(x) (gate and up swapped)":
                 F.silu(up) * h, "silu(fc1(x)) alone": F.silu(h)}
        want = "SwiGLU, silu(gate) * up"
    found = next((name for name, v in forms.items() if torch.allclose(a, v, rtol=1e-5, atol=1e-6)), None)
    if found is None or found == next(iter(forms)):
        return None
    return f"the activation is {found}, where transformers uses {want}"

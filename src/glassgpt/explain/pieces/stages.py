"""What each stage of a whole model must satisfy, checked on the reader's own recorded tensors.

verify.py finds the first stage that differs and tries its catalogue of exact mistakes; where none
reproduces the numbers, these properties say what the stage broke and where it first shows:

  tok_emb      position p holds row ids[p] of the table (else: which row it holds)
  pos_emb      position p holds row p (else: which row)
  embeddings   tok + pos, each once (the two factors fitted; a described model's token scale fitted)
  a norm       mean 0 (LayerNorm), unit variance or mean square, eps inside the root (properties.norm_rows)
  attention    with every token the same, every position gives one token's output (its weights sum to 1);
               position p's output stays the same when the tokens after it are cut off (nothing read later)
  feed-forward the activation between its layers, fitted on its own hidden numbers
  a shortcut   the input plus the part's output, each once (the two factors fitted)
  any stage    a factor: the output is c times the formula's

A described model's attention, feed-forward, shortcuts and post-norms are held to more, each measured by running
the reader's own part again through the call its model made (the last section): nothing read later or outside a
window, every earlier position read in a full layer, each row's sum, the scale, RoPE by i - j (or no position
signal), the activation, each shortcut, and where a post-norm's norm sits.

Each returns a properties.Broken (the property, the stage, where, one sentence) or None; CHECKED says, for a
stage none of them breaks, what was checked.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ... import anatomy as an
from ...adopt import evaluating_all
from .. import formulas
from .properties import ACTIVATIONS, Broken, activation, fitted_scale, norm_rows

CHECKED = {
    "tok_emb": "each position holds its token's row", "pos_emb": "position p holds row p",
    "embeddings": "tok_emb + pos_emb, each once", "norm": "mean 0, unit variance, eps inside the root",
    "att": "its weights summing to 1, nothing read after a position", "ff": "the activation between its layers",
    "shortcut": "the input plus the part's output, each once", "out_head": "a factor on the formula's logits",
    "head": "a factor on the formula's logits", "reads": "what its placement gives it",
    # a described model's, measured through the part's own call (the section at the end of this file)
    "described att": "nothing read after a position or outside its window, every earlier position read in a full "
                     "layer, each row summing to 1, and where its scores could be captured the scale "
                     "and RoPE's scores by i - j",
    "described ff": "the activation between its layers", "described shortcut": "the input plus each part's output, "
                                                                                "each once",
}


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> bool:
    got, want = got.double().reshape(want.shape), want.double()
    return bool(((got - want).abs() <= rel * max(float(want.abs().max()), 1e-30)).all())


def _first_position(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> int:
    """The first position (dim -2) where got and want differ beyond rel of want's scale."""
    got, want = got.double().reshape(want.shape), want.double()
    bad = ((got - want).abs() > rel * max(float(want.abs().max()), 1e-30)).any(-1)  # [..., t]
    hit = torch.nonzero(bad.reshape(-1, bad.shape[-1]).any(0))
    return int(hit[0]) if hit.numel() else 0


def _named(c: float, d: int) -> str:
    """A fitted factor in the model's terms where it is one of them (sqrt(emb_dim), emb_dim, ...)."""
    names = ((1.0, "1"), (math.sqrt(d), f"sqrt(emb_dim) = {math.sqrt(d):.4g}"), (float(d), f"emb_dim = {d}"),
             (1 / math.sqrt(d), f"1/sqrt(emb_dim) = {1 / math.sqrt(d):.4g}"), (0.0, "0"))
    for value, words in names:
        if abs(c - value) <= 1e-4 * max(abs(value), 1e-3):
            return words
    return f"{c:.4g}"


def fit_two(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[float, float] | None:
    """(alpha, beta) such that got = alpha * a + beta * b (least squares), or None when none fits."""
    y, A = got.double().reshape(-1), torch.stack([a.double().reshape(-1), b.double().reshape(-1)], 1)
    if y.numel() != A.shape[0]:
        return None
    coef = torch.linalg.lstsq(A, y[:, None]).solution[:, 0]
    alpha, beta = float(coef[0]), float(coef[1])
    return (alpha, beta) if _close(got.reshape(-1), alpha * A[:, 0] + beta * A[:, 1], 1e-4) else None


def factor(name: str, got: torch.Tensor, want: torch.Tensor, d: int) -> Broken | None:
    """Any stage: the reader's output is c times the formula's (c fitted over every number)."""
    g, w = got.double().reshape(-1), want.double().reshape(-1)
    if g.numel() != w.numel() or float((w * w).sum()) == 0:
        return None
    c = float((g * w).sum() / (w * w).sum())
    if abs(c - 1) <= 1e-4 or not _close(g, c * w, 1e-4):
        return None
    return Broken("factor", name, "every position", f"{name}'s output is {_named(c, d)} times the formula's at "
                  f"every position: something multiplies it by that factor")


def table_rows(name: str, got: torch.Tensor, table: torch.Tensor, rows: list[int], what: str) -> Broken | None:
    """Position p holds row rows[p] of `table` (an embedding lookup); else the row it holds, if any."""
    g, table = got.double().reshape(-1, table.shape[-1]), table.double()
    for p, want in enumerate(rows):
        if _close(g[p], table[want]):
            continue
        dist = (table - g[p]).abs().amax(-1)
        j = int(dist.argmin())
        if float(dist[j]) > 1e-5 * max(float(table[j].abs().max()), 1e-30):
            return None  # no row of the table: a factor or a sum says more
        whose = f"token {want}'s" if what == "token" else f"position {p}'s"
        how = "the embedding looks each id up, tok_emb(in_idx)" if what == "token" else \
            f"the positions run 0 to {len(rows) - 1}, pos_emb(torch.arange(seq_len))"
        return Broken("rows" if what == "token" else "positions", name, f"position {p}",
                      f"position {p} holds row {j} of {name}.weight, where {whose} is row {want}: {how}")
    return None


def embeddings_sum(got: torch.Tensor, tok: torch.Tensor, pos: torch.Tensor | None, scale: float, d: int
                   ) -> Broken | None:
    """The blocks read scale * tok + pos (pos: learned positions, else none): the factors fitted."""
    if pos is None:
        g, t = got.double().reshape(-1), tok.double().reshape(-1)
        alpha, beta = float((g * t).sum() / (t * t).sum()), 0.0
        if not _close(g, alpha * t, 1e-4):
            return None
    else:
        fit = fit_two(got, tok, pos.expand_as(tok))
        if fit is None:
            return None
        alpha, beta = fit
    if abs(alpha - scale) <= 1e-4 * max(scale, 1e-3) and abs(beta - (1.0 if pos is not None else 0.0)) <= 1e-4:
        return None
    pos_words = f" + {_named(beta, d)} x pos_emb" if pos is not None else ""
    want = ("tok_emb" if scale == 1.0 else f"{_named(scale, d)} x tok_emb") + (" + pos_emb" if pos is not None else "")
    p = _first_position(got, scale * tok.double() + (pos.double() if pos is not None else 0))
    return Broken("embeddings_sum", "embeddings", f"position {p}", f"the blocks read {_named(alpha, d)} x "
                  f"tok_emb{pos_words} (fitted on every position; first off at position {p}), where the formula "
                  f"gives {want}: x = tok_embeds + pos_embeds" + ("" if scale == 1.0 else ", the tokens' rows "
                                                                  f"times {_named(scale, d)}"))


def shortcut_sum(name: str, got: torch.Tensor, x: torch.Tensor, part: torch.Tensor, d: int) -> Broken | None:
    """A shortcut's output is its input plus the part's output, each once: the two factors fitted."""
    fit = fit_two(got, x, part)
    if fit is None:
        return None
    alpha, beta = fit
    if abs(alpha - 1) <= 1e-4 and abs(beta - 1) <= 1e-4:
        return None
    p = _first_position(got, x.double() + part.double())
    return Broken("shortcut", name, f"position {p}", f"{name} gives {_named(alpha, d)} x its input + "
                  f"{_named(beta, d)} x the part's output (fitted; first off at position {p}); the shortcut adds "
                  f"each once: x = x + shortcut")


def norm_stage(name: str, x: torch.Tensor, got: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None,
               rms: bool, eps: float) -> Broken | None:
    """A norm's output with its scale (and shift) taken off: mean 0 (LayerNorm), unit spread, eps inside."""
    if got.dtype not in (torch.float32, torch.float64) or bool((scale == 0).any()):
        return None
    z = (got.double() - (shift.double() if shift is not None else 0)) / scale.double()
    broken = norm_rows(x.reshape(-1, x.shape[-1]), z.reshape(-1, z.shape[-1]), rms, eps)
    if broken is not None:
        broken.stage = name
        broken.where = broken.where.replace("row", "position")  # one prompt: row r is position r
        broken.words = broken.words.replace("row ", "position ")
    return broken


def attention_module(name: str, att: nn.Module, x: torch.Tensor, got: torch.Tensor, cut_off: bool = True
                     ) -> Broken | None:
    """The reader's attention module, run again on its own input: with every token the same vector, a softmax
    over the keys gives every position one token's output (its weights sum to 1, whatever the mask or RoPE);
    and (cut_off: a module that masks by itself, called with x alone) position p's output stays the same when
    the tokens after it are cut off (nothing is read from a later position)."""
    t = x.shape[-2]
    try:
        with torch.no_grad():
            same = x[..., :1, :].expand_as(x).contiguous()
            out, one = att(same), att(x[..., :1, :])
            out, one = (o[0] if isinstance(o, (tuple, list)) else o for o in (out, one))
            if not _close(out, one.expand_as(out), 1e-4):
                p = _first_position(out, one.expand_as(out), 1e-4)
                return Broken("rows_sum_to_1", name, f"position {p}", f"with every token the same, position {p}'s "
                              f"output differs from one token's: its attention weights do not sum to 1 (a softmax "
                              f"over the keys, dim=-1, is the last step before attn_weights @ values)")
            for p in range(t - 1 if cut_off else 0):
                cut = att(x[..., :p + 1, :])
                cut = cut[0] if isinstance(cut, (tuple, list)) else cut
                if not _close(cut[..., p, :], got[..., p, :], 1e-4):
                    return Broken("no_future", name, f"position {p}", f"position {p}'s output changes when the "
                                  f"tokens after it are cut off: it reads a later position; fill the scores above "
                                  f"the diagonal, torch.triu(..., diagonal=1), with -inf before the softmax")
    except Exception:  # noqa: BLE001 - a module that needs more than its input: its properties go unchecked
        return None
    return None


def feed_forward_module(name: str, ff: nn.Module, x: torch.Tensor, act: str) -> Broken | None:
    """The activation between the reader's feed-forward layers, on its own hidden numbers (the first and the
    last nn.Linear hooked): `act` (properties.ACTIVATIONS' name), else the one that fits."""
    linears = [m for m in ff.modules() if isinstance(m, nn.Linear)]
    if len(linears) != 2:
        return None
    seen: dict[str, torch.Tensor] = {}
    hooks = [linears[0].register_forward_hook(lambda m, a, o: seen.setdefault("h", o.detach().clone())),
             linears[1].register_forward_hook(lambda m, a, o: seen.setdefault("a", a[0].detach().clone()))]
    try:
        with torch.no_grad():
            ff(x)
    except Exception:  # noqa: BLE001 - a module that needs more than its input
        return None
    finally:
        for h in hooks:
            h.remove()
    broken = activation(seen["h"], seen["a"], act) if len(seen) == 2 else None
    if broken is not None:
        broken.stage = name
    return broken


# --- a described model's parts, run again through their own call ------------------------------------------
# In the described models the mask, cos and sin come from outside the attention (the model's forward makes them
# and hands them to every block), so a part is run again with the arguments the model gave it, only its input
# changed (Call). Each property below is measured on the reader's own module, and a cause is named only where it
# is tested: the mask the model handed in is named only where the right mask in its place fixes the position.
#
#   attention    position p's output stays the same when a later position's input changes (causal); in a
#                sliding layer, when a position `window` or more back changes; in a full layer it changes
#                with every earlier one (nothing hidden); with every token the same, each head's context at
#                row p is its row's sum times the one value (read off what `out` reads, hooked); the scores are q k^T times the described scale (the
#                softmax's input, or scaled_dot_product_attention's q, k and scale, captured; the factor
#                fitted on the positions each query may read, within 1e-4); with every token the same, the
#                score of position i for key j depends on i - j alone and not on nothing (RoPE), or on
#                nothing (a layer the description gives no positions)
#   feed-forward the activation between its layers, on its own hidden numbers (its described up, gate and down
#                matrices hooked): within 1e-5 of the largest hidden number
#   a shortcut   the input plus each part's output, each once (fitted; a parallel block's three terms): missing,
#                or a part never added
#   a post-norm  (post and sandwich blocks) reads the sublayer's output, not the stream after the add (post-LN)

CHANGES = 1e-5      # an output "changes" beyond this fraction of its largest value (float32's rounding stays below)
SAME_SCORE = 1e-4   # two scores are "the same" within this fraction of the largest score (RoPE's tables round)
SOFTMAXES = (torch.softmax, F.softmax, torch.Tensor.softmax, torch.special.softmax)


class Call:
    """A part's own call as the model made it (its mask, cos, sin, ...), to run again on another input."""

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict):
        # a cache the model handed in (transformers' past_key_values) would grow with every call: none again
        fresh = lambda v: None if callable(getattr(v, "update", None)) and not isinstance(v, dict) else v  # noqa: E731
        self.module, self.args = module, tuple(fresh(a) for a in args)
        self.kwargs = {k: fresh(v) for k, v in kwargs.items()}
        # the input the hooks record: the first positional argument, else the first tensor keyword
        self.key = 0 if self.args else next((k for k, v in self.kwargs.items() if torch.is_tensor(v)), None)

    def __call__(self, x: torch.Tensor, **changed) -> torch.Tensor:
        args, kwargs = list(self.args), dict(self.kwargs)
        for key, value in ((self.key, x), *changed.items()):
            if isinstance(key, int) or (isinstance(key, str) and key.isdigit()):
                args[int(key)] = value
            else:
                kwargs[key] = value
        with torch.inference_mode(), evaluating_all(self.module):
            out = self.module(*args, **kwargs)
        return out[0] if isinstance(out, (tuple, list)) else out

    def masks(self, t: int) -> list[tuple[str, str, torch.Tensor]]:
        """(slot, parameter name, tensor) of each argument shaped like a mask over t positions, [..., n, n], n >= t."""
        try:
            names = list(inspect.signature(self.module.forward).parameters)
        except (TypeError, ValueError):
            names = []
        found = [(str(i), names[i] if i < len(names) else f"argument {i}", a) for i, a in enumerate(self.args)]
        found += [(k, k, v) for k, v in self.kwargs.items()]
        return [(slot, name, m) for slot, name, m in found if slot != str(self.key) and torch.is_tensor(m)
                and m.dim() >= 2 and m.shape[-1] == m.shape[-2] >= t and (m.dtype == torch.bool or m.is_floating_point())]


class _Scores(TorchFunctionMode):
    """The first attention scores a call computes: the input of its first softmax over the last dimension of a
    [b, h, t, s] tensor, or q k^T * scale of its first scaled_dot_product_attention (the key heads repeated)."""

    def __init__(self, t: int):
        super().__init__()
        self.t, self.scores = t, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.scores is None and func in SOFTMAXES:
            s, dim = args[0], args[1] if len(args) > 1 else kwargs.get("dim", -1)
            if torch.is_tensor(s) and s.dim() == 4 and s.shape[-2] == self.t and dim in (-1, 3):
                self.scores = s.detach().double().clone()
        elif self.scores is None and func is F.scaled_dot_product_attention:
            q, k = args[0].detach().double(), args[1].detach().double()
            scale = kwargs.get("scale", args[6] if len(args) > 6 else None)
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) if k.shape[-3] != q.shape[-3] else k
            self.scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
        return func(*args, **kwargs)


def _scores_of(call: Call, x: torch.Tensor) -> torch.Tensor | None:
    capture = _Scores(x.shape[-2])
    with capture:
        call(x)
    return capture.scores


def _changed(a: torch.Tensor, b: torch.Tensor, rel: float) -> torch.Tensor:
    """[t]: the positions (dim -2) where a and b differ beyond rel of b's largest value."""
    a, b = a.double(), b.double()
    return ((a - b).abs() > rel * max(float(b.abs().max()), 1e-30)).reshape(-1, *b.shape[-2:]).any(-1).any(0)


def _moved(x: torch.Tensor, j: int) -> torch.Tensor:
    """x with position j's input changed (its features rolled by one and grown), every other position kept."""
    moved = x.clone()
    moved[..., j, :] = x[..., j, :].roll(1, -1) * 1.5 + 0.1 * float(x.abs().max())
    return moved


def attention_call(name: str, call: Call, x: torch.Tensor, att: an.Attention, layer_type: str,
                   again: Callable | None, model: nn.Module, d: int) -> Broken | None:
    """The properties of a described attention (the section's list), in the order a reader would fix them.
    again(x, mistake): the description's formula on another input (("raw_scores", None): q k^T; ("context",
    None): what `out` reads)."""
    if att.kv_shared_from is not None:  # its keys and values come from another layer: its input alone moves q
        return None
    try:
        base = call(x)
        broken = _edges(name, call, x, base, att, layer_type)
        if broken is not None or att.kind != "causal" or again is None:
            return broken
        return (_rows_sum(name, call, x, att, again, model) or _scale(name, call, x, att, again, d)
                or _rope(name, call, x, att, layer_type, again))
    except Exception:  # noqa: BLE001 - a call that cannot run again: its properties go unchecked
        return None


def _edges(name: str, call: Call, x: torch.Tensor, base: torch.Tensor, att: an.Attention, layer_type: str
           ) -> Broken | None:
    """Which positions each position reads, by changing one input at a time: nothing later; in a sliding layer
    nothing `window` or more back; in a full (softmax) layer every earlier position."""
    t, window, found = x.shape[-2], att.window, {}
    for j in range(t):
        out = call(_moved(x, j))
        moved, same = _changed(out, base, CHANGES), ~_changed(out, base, 1e-12)
        later = [p for p in range(j) if moved[p]]
        far = [p for p in range(j + window, t) if moved[p]] if window else []
        blind = [p for p in range(j + 1, t) if same[p]] if window is None and att.kind == "causal" else []
        for kind, hits in (("no_future", later), ("window", far), ("reads_its_past", blind)):
            if hits and (kind not in found or hits[0] < found[kind][0]):
                found[kind] = (hits[0], j)
    if "no_future" in found:
        p, j = found["no_future"]
        return Broken("no_future", name, f"position {p}", f"position {p}'s output changes when the input at "
                      f"position {j}, a later one, changes: it reads a later position" +
                      _mask_cause(call, x, att, p, j, "fill the scores of the positions after each query, "
                                  "torch.triu(..., diagonal=1), with -inf before the softmax" if att.kind == "causal"
                                  else "a linear attention reads each token's own and earlier inputs only: its short "
                                  "convolution padded with kernel - 1 zeros before the tokens, none after, and the "
                                  "state updated one token at a time"))
    if "window" in found:
        p, j = found["window"]
        return Broken("window", name, f"position {p}", f"position {p}'s output changes when the input at "
                      f"position {j}, {p - j} back, changes: this {layer_type} layer reads outside its window of "
                      f"{window} (a query sees itself and the {window - 1} positions before it)" +
                      _mask_cause(call, x, att, p, j, f"hide the keys {window} or more positions back, query - key "
                                  f">= {window}, as well as the future"))
    if "reads_its_past" in found:
        p, j = found["reads_its_past"]
        return Broken("reads_its_past", name, f"position {p}", f"position {p}'s output stays the same when the input "
                      f"at position {j}, {p - j} back, changes: this {layer_type} layer hides an earlier position, "
                      f"where a full layer reads every position up to its own: apply the window only in the layers "
                      f"layer_types names sliding")
    return None


def _mask_cause(call: Call, x: torch.Tensor, att: an.Attention, p: int, j: int, fix: str) -> str:
    """': ' + the fix; where the mask is handed in from outside and the right one in its place stops position p
    reading position j, that mask is named as the cause."""
    t = x.shape[-2]
    for slot, param, mask in call.masks(t):
        n = mask.shape[-1]
        hidden = formulas.hidden(n, n, att.window, mask.device)
        flat = mask.reshape(-1, n, n)
        visible = flat[0, 0, 0]
        if mask.dtype == torch.bool:
            right = torch.where(hidden, ~visible, visible)
        else:
            low = float(flat.min())
            right = torch.where(hidden, torch.tensor(low if low < float(visible) else -math.inf), visible.double())
        right = right.to(mask.dtype).expand(mask.shape).clone()
        if not bool(flat[0, p, j] == visible):
            continue  # this mask does hide the pair: not the cause
        if not bool(_changed(call(_moved(x, j), **{slot: right}), call(x, **{slot: right}), CHANGES)[p]):
            return (f"; the mask handed to it from outside (its argument `{param}`, made by its caller) "
                    f"lets position {p} see position {j}, and the right mask in its place stops it: {fix}")
    return f": {fix}"


def _rows_sum(name: str, call: Call, x: torch.Tensor, att: an.Attention, again: Callable, model: nn.Module
             ) -> Broken | None:
    """With every token the same vector every value is the same, so each head's context at position p (what `out`
    reads, hooked) is its row's sum times the description's: the sum read off where it is one factor, per head."""
    if att.out.rows is not None or att.out.transposed:
        return None
    same = x[..., :1, :].expand_as(x).contiguous()
    seen: dict[str, torch.Tensor] = {}

    def hook(_m, args, _out) -> None:
        seen.setdefault("context", args[0].detach().double().clone())
    handle = model.get_submodule(att.out.path).register_forward_hook(hook)
    try:
        call(same)
    finally:
        handle.remove()
    got, want = seen.get("context"), again(same, ("context", None))
    if got is None or got.shape != want.shape or _close(got, want, 1e-4):
        return None
    b, t = got.shape[0], got.shape[1]
    got, want = got.reshape(b, t, att.n_heads, -1), want.reshape(b, t, att.n_heads, -1)
    sums = {}
    for p in range(t):
        for h in range(att.n_heads):
            g, w = got[:, p, h].reshape(-1), want[:, p, h].reshape(-1)
            sums[p, h] = float((g * w).sum() / (w * w).sum())
            if not _close(g, sums[p, h] * w, 1e-4):
                return None  # not one factor: something other than the weights' sum (the values) differs
    if max(sums.values()) - min(sums.values()) <= 1e-4 * max(abs(v) for v in sums.values()):
        return None  # one factor everywhere: the values scaled, as much as the weights (the factor check says it)
    p, h = next(key for key, total in sums.items() if abs(total - 1) > 1e-4)
    return Broken("rows_sum_to_1", name, f"row {p} of head {h}", f"with every token the same, row {p} of head {h}'s "
                  f"attention weights sum to {sums[p, h]:.4g}, not 1 (its context is {sums[p, h]:.4g} times the one "
                  f"value it reads, and other rows' other multiples): a softmax over the keys, dim=-1, is the last "
                  f"step before attn_weights @ values")


def _allowed(att: an.Attention, t: int, like: torch.Tensor) -> torch.Tensor:
    return (~formulas.hidden(t, t, att.window, like.device)).expand(like.shape)


def _scale(name: str, call: Call, x: torch.Tensor, att: an.Attention, again: Callable, d: int) -> Broken | None:
    """The reader's scores against the description's q k^T: the factor fitted on what each query may read."""
    scores = _scores_of(call, x)
    if scores is None or att.softcap is not None:
        return None
    raw = again(x, ("raw_scores", None)).to(scores.device)
    if raw.shape != scores.shape:
        return None
    use = _allowed(att, x.shape[-2], scores)
    c = fitted_scale(scores[use], raw[use])
    want = att.scale or att.head_dim ** -0.5
    if c is None or abs(c - want) <= 1e-4 * want:
        return None
    off = ((scores - want * raw).abs() > 1e-4 * float(scores[use].abs().max())) & use  # [b, h, t, s]
    p = int(torch.nonzero(off.reshape(-1, *off.shape[-2:]).any(0).any(-1))[0]) if bool(off.any()) else 0
    return Broken("scale", name, f"position {p}", f"the scores go into the softmax times {_scale_words(c, att, d)} "
                  f"(q k^T from the description, the factor fitted on every position a query may read; first off "
                  f"at position {p}), where {_scale_words(want, att, d, meant=True)} was meant")


def _scale_words(c: float, att: an.Attention, d: int, meant: bool = False) -> str:
    hd, width = att.head_dim, att.n_heads * att.head_dim
    names = [(hd ** -0.5, f"1/sqrt(head_dim) = 1/sqrt({hd})"), (d ** -0.5, f"1/sqrt(emb_dim) = 1/sqrt({d})"),
             (width ** -0.5, f"1/sqrt(d_out) = 1/sqrt({width}), the heads' whole width"),
             (1 / hd, f"1/head_dim = 1/{hd}, the head size itself, not its root"), (1.0, "1, not scaled at all")]
    if meant and att.scale is not None:
        names.insert(0, (att.scale, f"{att.scale:.4g} = 1/sqrt({att.scale ** -2:.4g}), the description's scale "
                                    "(query_pre_attn_scalar ** -0.5 where the config sets one)"))
    return next((words for value, words in names if abs(c - value) <= 1e-4 * value),
                f"{c:.4g} = 1/sqrt({c ** -2:.4g})")


def _rope(name: str, call: Call, x: torch.Tensor, att: an.Attention, layer_type: str, again: Callable
          ) -> Broken | None:
    """With every token the same, the score of position i for key j: a function of i - j alone and not a constant
    (RoPE turns q and k by their positions), the description's up to one factor; a constant where the layer has
    no positions."""
    t = x.shape[-2]
    same = x[..., :1, :].expand_as(x).contiguous()
    scores = _scores_of(call, same)
    if scores is None or att.softcap is not None:
        return None
    ok = _allowed(att, t, scores).reshape(-1, t, t)[0]
    tol = SAME_SCORE * float(scores[_allowed(att, t, scores)].abs().max())
    rows = scores.reshape(-1, t, t)  # [b*h, t, t]
    differ = lambda i, j, k, m: float((rows[:, i, j] - rows[:, k, m]).abs().max()) > tol  # noqa: E731
    if att.rope is None:
        hit = next(((i, j) for i in range(t) for j in range(i) if ok[i, j] and differ(i, j, i, i)), None)
        return hit and Broken("position_signal", name, f"position {hit[0]}", f"with every token the same, position "
                              f"{hit[0]} scores key {hit[1]} and key {hit[0]} differently: this {layer_type} layer "
                              f"turns its queries or keys by position, where the description gives it no positions "
                              f"(no RoPE here: leave cos and sin out of this layer)")
    hit = next(((i, j) for i in range(1, t) for j in range(1, i + 1) if ok[i, j] and ok[i - 1, j - 1]
                and differ(i, j, i - 1, j - 1)), None)
    if hit is not None:
        i, j = hit
        return Broken("rope_positions", name, f"position {i}", f"with every token the same, position {i}'s score for "
                      f"key {j} is {float(rows[0, i, j]):.4g} but position {i - 1}'s for key {j - 1} is "
                      f"{float(rows[0, i - 1, j - 1]):.4g} (head 0): with RoPE a score depends only on how far apart "
                      f"the two positions are; rotate the queries and the keys alike, each by its own position, "
                      f"apply_rope(queries, cos, sin) and apply_rope(keys, cos, sin)")
    if t > 1 and not any(differ(i, j, i, i) for i in range(t) for j in range(i) if ok[i, j]):
        return Broken("no_rope", name, "position 1", "with every token the same, every position scores every key it "
                      "reads alike (first at position 1): nothing turns the queries and keys by their positions, "
                      "where the description rotates them with RoPE in this layer: apply_rope(queries, cos, sin) and "
                      "apply_rope(keys, cos, sin)" + (", after the QK-norm" if att.q_norm is not None else ""))
    raw = again(same, ("raw_scores", None)).to(scores.device)
    use = _allowed(att, t, scores)
    if raw.shape != scores.shape or fitted_scale(scores[use], raw[use]) is not None:
        return None
    diagonal = torch.eye(t, dtype=torch.bool, device=scores.device).expand(scores.shape)  # key = query: no turn
    c = fitted_scale(scores[diagonal], raw[diagonal])
    if c is None:
        return None
    off = ((scores - c * raw).abs() > tol) & use
    i = int(torch.nonzero(off.reshape(-1, t, t).any(0).any(-1))[0])
    mirrored = not bool((((scores - c * raw.transpose(-2, -1)).abs() > tol) & use).any())  # key j - i where i - j
    said = ("the queries and keys are turned by their positions in reverse order (the last position's angles "
            "first)" if mirrored else f"the angles they are turned by are not the description's (position p turns "
            f"pair k by p * {att.rope.base:g}^(-2k/{att.rope.rotary_dim or att.rope.head_dim})"
            + (f", {att.rope.scaling}'s scaling" if att.rope.scaling else "") + ")")
    return Broken("rope_positions", name, f"position {i}", f"with every token the same, the scores depend on i - j "
                  f"alone but not as the description's RoPE makes them (first at position {i}): {said}"
                  + _tables_cause(call, same, att, raw))


def _tables_cause(call: Call, same: torch.Tensor, att: an.Attention, raw: torch.Tensor) -> str:
    """Where cos and sin are handed in from outside and the description's tables in their place give RoPE's
    scores, those arguments named as the cause; else the fix."""
    t, rd = same.shape[-2], att.rope.rotary_dim or att.rope.head_dim
    try:
        names = list(inspect.signature(call.module.forward).parameters)
    except (TypeError, ValueError):
        names = []
    tables = [(i, names[i] if i < len(names) else f"argument {i}", a) for i, a in enumerate(call.args)
              if i != call.key and torch.is_tensor(a) and a.dim() == 2 and a.shape[0] >= t and a.shape[-1] in (rd, att.head_dim)]
    if len(tables) == 2 and tables[0][2].shape == tables[1][2].shape:
        n, width = tables[0][2].shape
        cos, sin = formulas.rope_tables(att.rope, n)
        if cos.shape[-1] == width:
            like = tables[0][2]
            changed = {str(tables[0][0]): cos.to(like), str(tables[1][0]): sin.to(like)}
            capture = _Scores(t)
            with capture:
                call(same, **changed)
            got, use = capture.scores, _allowed(att, t, raw)
            if got is not None and fitted_scale(got[use], raw[use]) is not None:
                return (f"; the tables handed to it from outside (its arguments `{tables[0][1]}` and `{tables[1][1]}`, "
                        f"made by its caller) are not the description's: with its tables in their place the scores "
                        f"are RoPE's (row p holds cos and sin of position p's angles)")
    return ": turn the query and the key at position p by p's angles (cos and sin of row p)"


ACTIVATION_NAMES = {"silu": "SiLU", "gelu_tanh": "GELU (the tanh form)", "gelu": "the exact GELU (erf, nn.GELU())"}


def feed_forward_call(name: str, call: Call, x: torch.Tensor, ff: an.FeedForward, model: nn.Module, d: int
                      ) -> Broken | None:
    """A described feed-forward's activation, on its own hidden numbers: its up, gate and down matrices
    hooked (each a module of its own; fused matrices and experts go unchecked)."""
    lins = [ff.up, ff.down] + ([ff.gate] if ff.gate is not None else [])
    if ff.experts is not None or any(lin.rows or lin.head_rows or lin.transposed for lin in lins):
        return None
    seen: dict[str, torch.Tensor] = {}

    def keep(key: str, which: int):
        def hook(_m, args, out) -> None:  # returns nothing: a hook's return value would replace the output
            seen.setdefault(key, (args[0] if which == 0 else out).detach().double().clone())
        return hook
    hooks = [model.get_submodule(ff.up.path).register_forward_hook(keep("up", 1)),
             model.get_submodule(ff.down.path).register_forward_hook(keep("down", 0))]
    if ff.gate is not None:
        hooks.append(model.get_submodule(ff.gate.path).register_forward_hook(keep("gate", 1)))
    try:
        call(x)
    except Exception:  # noqa: BLE001 - a call that cannot run again
        return None
    finally:
        for h in hooks:
            h.remove()
    if len(seen) != len(hooks):
        return None
    a = seen["down"]  # (its width is the description's: kinds.describe reads hidden_dim off these matrices)
    want = ACTIVATION_NAMES.get(ff.activation)
    if want is None:
        return None
    leaf = lambda lin: lin.path.rpartition(".")[2]  # noqa: E731
    if ff.gate is None:
        broken = activation(seen["up"], a, want)
        formula = f"{leaf(ff.down)}(act({leaf(ff.up)}(x)))"
    else:  # act(gate) * up: the activation read off a / up where up is not near 0
        g, u = seen["gate"], seen["up"]
        keep_ = u.abs() > 1e-3 * float(u.abs().max())
        h, got = g[keep_], a[keep_] / u[keep_]
        broken = activation(h.reshape(1, -1), got.reshape(1, -1), want)
        if broken is not None:
            bad = ((a - ACTIVATIONS[want](g) * u).abs() > 1e-5 * float(a.abs().max()))
            p = int(torch.nonzero(bad.reshape(-1, *bad.shape[-2:]).any(0).any(-1))[0]) if bool(bad.any()) else 0
            broken.where = f"position {p}"
            broken.words = broken.words.replace("(first at position 0 of the hidden layer)",
                                                f"(first at position {p} of the hidden layer)")
        formula = f"{leaf(ff.down)}(act({leaf(ff.gate)}(x)) * {leaf(ff.up)}(x))"
    if broken is not None:
        broken.stage = name
        broken.words += f", on its own hidden numbers; the description's feed-forward is {formula} with act = {want}"
    return broken


def described_shortcut(name: str, got: torch.Tensor, terms: tuple[tuple[str, torch.Tensor], ...], around: str,
                       formula: str, d: int) -> Broken | None:
    """A described block's shortcut: its output is its input plus each part's output (normed, where the placement
    norms it), each once (terms: ("its input", x), then (the part's words, its output) for each part, a parallel
    block's two); the factors fitted, a shortcut missing or a part never added named."""
    y = got.double().reshape(-1)
    A = torch.stack([t.double().reshape(-1) for _, t in terms], 1)
    if A.shape[0] != y.numel():
        return None
    coef = torch.linalg.lstsq(A, y[:, None]).solution[:, 0]
    if not _close(y, A @ coef, 1e-4) or bool(((coef - 1).abs() <= 1e-4).all()):
        return None
    p = _first_position(got, sum(t.double() for _, t in terms))
    zero, one = (coef.abs() <= 1e-4).tolist(), ((coef - 1).abs() <= 1e-4).tolist()
    if zero[0] and all(one[1:]):
        said = f"the shortcut around {around} is missing: the stream after it is {around}'s output alone"
    elif one[0] and all(z or o for z, o in zip(zero[1:], one[1:])):
        said = " and ".join(words for (words, _), z in zip(terms[1:], zero[1:]) if z) + " is never added"
    else:
        said = "it gives " + " + ".join(f"{_named(float(c), d)} x {words}" for (words, _), c in zip(terms, coef)) + \
            " (fitted)"
    return Broken("shortcut", name, f"position {p}", f"{said} (first at position {p}); the block adds each once: "
                  f"x = {formula}")


def placement(name: str, got: torch.Tensor, want: torch.Tensor, options: tuple[tuple[str, torch.Tensor], ...]
              ) -> Broken | None:
    """What a part reads, where the placement gives it `want`: the option (words, tensor) it reads instead."""
    for words, tensor in options:
        if got.shape == tensor.shape and _close(got, tensor, 1e-5):
            p = _first_position(got, want)
            return Broken("placement", name, f"position {p}", words.format(p=p))
    return None

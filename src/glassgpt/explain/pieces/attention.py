"""Chapter 3's attention classes, as the reader wrote them, against glassgpt's attention formula.

SelfAttention_v1 (weights as nn.Parameter [d_in, d_out]), SelfAttention_v2 (nn.Linear),
CausalAttention, MultiHeadAttentionWrapper (a list of CausalAttention heads, concatenated) and
MultiHeadAttention (one projection split into heads, then out_proj). The reader's weights are read
under the book's names (W_query, W_key, W_value, out_proj, heads) and put into model.py's formula
in float64. The reader's own attention weights are recorded as its softmax returns them (a torch
function mode sees every softmax call), so a difference is placed at the row where it starts.

Two runs: eval mode (no dropout, same numbers twice or dropout is left on), then training mode
with every nn.Dropout at p = 0.5 and a fixed seed, against the formula with the same dropout mask
drawn from the same seed (where the dropout sits is only visible with it on).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ...model import attention_weights
from .properties import attention_rows, score_scale
from .report import (PieceResult, as_double, first_row_that_differs, found, largest_diff, non_finite, reproducing,
                     run_reader, same)

# The book's six 3-d embeddings of "Your journey starts with one step" (chapter 3).
BOOK_INPUTS = [[0.43, 0.15, 0.89], [0.55, 0.87, 0.66], [0.57, 0.85, 0.64],
               [0.22, 0.58, 0.33], [0.77, 0.25, 0.10], [0.05, 0.80, 0.55]]
TRAIN_P = 0.5  # the dropout rate of the training-mode run (the book's own dropout example)

MISTAKES = {
    "no_scale": "the scores are not divided by sqrt(head size): softmax(attn_scores / keys.shape[-1]**0.5, dim=-1)",
    "scale_d_out": "the scores are divided by sqrt(d_out), not by the head size sqrt(d_out / num_heads): "
                   "divide by keys.shape[-1]**0.5 after the split into heads",
    "softmax_dim": "the softmax runs over the queries (dim=-2), so the columns sum to 1: take it over the keys, "
                   "dim=-1, so each row of attention weights sums to 1",
    "no_mask": "there is no causal mask, so each token also reads the tokens after it: fill the scores above "
               "the diagonal, torch.triu(..., diagonal=1), with -inf before the softmax",
    "mask_wrong_side": "the mask hides the earlier tokens instead of the later ones: mask above the diagonal, "
                       "torch.triu(..., diagonal=1), not below it (tril)",
    "mask_diagonal": "every position is masked, including the diagonal, so the softmax of row 0 is 0 / 0: "
                     "torch.triu(..., diagonal=1) masks only the future and leaves each token itself",
    "view_no_transpose": "the heads are split with .view(b, num_heads, num_tokens, head_dim) and no transpose, "
                         "which mixes tokens into heads: .view(b, num_tokens, num_heads, head_dim).transpose(1, 2)",
    "concat_tokens": "the heads are concatenated along dim 1 (the tokens): torch.cat([...], dim=-1) puts them "
                     "side by side in each token's vector",
    "concat_batch": "the heads are concatenated along dim 0 (the batch): torch.cat([...], dim=-1) puts them "
                    "side by side in each token's vector",
    "dropout_before_softmax": "dropout is applied to the scores before the softmax (a dropped -inf is NaN, a "
                              "dropped score is 0, not 'ignored'): apply self.dropout to attn_weights, after "
                              "the softmax",
    "dropout_eval": "dropout is active in eval mode (two eval runs give different numbers): use nn.Dropout "
                    "modules, or F.dropout(x, p, training=self.training)",
}

CAUSAL_KINDS = ("CausalAttention", "MultiHeadAttentionWrapper", "MultiHeadAttention")


class _Softmaxes(TorchFunctionMode):
    """Records (input, output) of every softmax the reader's forward calls, and the weights it then
    multiplies the values by (the left operand of the next matmul of the softmax's shape): what the
    reader does to its weights after the softmax shows there."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.used: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name == "softmax" and args and torch.is_tensor(out):
            self.seen.append((args[0].detach().clone(), out.detach().clone()))
        elif name in ("matmul", "__matmul__", "bmm") and self.seen and len(self.used) < len(self.seen) and \
                len(args) >= 2 and torch.is_tensor(args[0]) and args[0].shape == self.seen[-1][1].shape:
            self.used.append(args[0].detach().clone())
        return out


def book_input(kind: str, d_in: int) -> torch.Tensor:
    """The book's inputs (two copies as a batch for the batched classes); random ones for another d_in."""
    if d_in == 3:
        x = torch.tensor(BOOK_INPUTS)
    else:
        x = torch.rand(6, d_in, generator=torch.Generator().manual_seed(123))
    return x if kind in ("SelfAttention_v1", "SelfAttention_v2") else torch.stack((x, x))


def _projections(att: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """{"q"/"k"/"v": (W [d_in, d_out], bias)} in float64, from nn.Parameter or nn.Linear."""
    out = {}
    for key, name in (("q", "W_query"), ("k", "W_key"), ("v", "W_value")):
        w = getattr(att, name, None)
        if w is None:
            raise AttributeError(f"no {name}: glassgpt reads the book's names (W_query, W_key, W_value)")
        if isinstance(w, nn.Linear):
            out[key] = (as_double(w.weight).T, as_double(w.bias) if w.bias is not None else None)
        else:
            out[key] = (as_double(w), None)
    return out


def formula(att: nn.Module, x: torch.Tensor, n_heads: int, causal: bool, mistake: str | None = None,
            drop: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention weights, output) of one attention module in float64, model.py's formula, or with
    `mistake`; `drop`: the dropout mask (0 or 1/(1-p)) of the training-mode run, or None."""
    W = _projections(att)
    x = as_double(x)
    q, k, v = ((x @ w + b if b is not None else x @ w) for w, b in (W["q"], W["k"], W["v"]))
    d_out, t = q.shape[-1], q.shape[-2]
    hd = d_out // n_heads
    if n_heads > 1:  # [b, t, d_out] -> [b, h, t, hd]
        b = q.shape[0]
        if mistake == "view_no_transpose":
            q, k, v = (y.reshape(b, n_heads, t, hd) for y in (q, k, v))
        else:
            q, k, v = (y.reshape(b, t, n_heads, hd).transpose(1, 2) for y in (q, k, v))
    if causal and mistake is None:
        weights = attention_weights(q, k)  # model.py's softmax(q k^T / sqrt(hd)) under the causal mask
    else:
        scores = q @ k.transpose(-2, -1)
        ones = torch.ones(t, t, dtype=torch.bool)
        mask = {"mask_wrong_side": ones.tril(-1), "mask_diagonal": ones.triu(0), "no_mask": None}.get(
            mistake, ones.triu(1) if causal else None)
        if mask is not None:
            scores = scores.masked_fill(mask, -torch.inf)
        if mistake == "dropout_before_softmax" and drop is not None:
            scores = scores * drop
        scale = {"no_scale": 1.0, "scale_d_out": d_out ** 0.5}.get(mistake, hd ** 0.5)
        weights = torch.softmax(scores / scale, dim=-2 if mistake == "softmax_dim" else -1)
    dropped = weights * drop if drop is not None and mistake != "dropout_before_softmax" else weights
    context = dropped @ v
    if n_heads > 1:  # [b, h, t, hd] -> [b, t, d_out]
        b = context.shape[0]
        context = context.reshape(b, t, d_out) if mistake == "view_no_transpose" else \
            context.transpose(1, 2).reshape(b, t, d_out)
    out_proj = getattr(att, "out_proj", None)
    if isinstance(out_proj, nn.Linear):
        context = context @ as_double(out_proj.weight).T + (as_double(out_proj.bias) if out_proj.bias is not None else 0)
    return weights, context


def raw_scores(att: nn.Module, x: torch.Tensor, kind: str, n_heads: int, causal: bool) -> torch.Tensor:
    """q k^T before any scale, in float64 ([b, h, t, t]; [.., t, t] for one head), the future at -inf
    where causal: what the reader's softmax input is, times its scale."""
    if kind == "MultiHeadAttentionWrapper":
        return torch.stack([raw_scores(h, x, "CausalAttention", 1, True) for h in att.heads], dim=1)
    W = _projections(att)
    h = as_double(x)
    q, k = ((h @ w + b if b is not None else h @ w) for w, b in (W["q"], W["k"]))
    t = q.shape[-2]
    if n_heads > 1:
        q, k = (y.reshape(y.shape[0], t, n_heads, -1).transpose(1, 2) for y in (q, k))
    scores = q @ k.transpose(-2, -1)
    if causal:
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -torch.inf)
    return scores


def wrapper_formula(att: nn.Module, x: torch.Tensor, mistake: str | None = None,
                    drops: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MultiHeadAttentionWrapper: each CausalAttention head, concatenated along the features
    (weights stacked as [b, h, t, t])."""
    heads = [formula(h, x, 1, True, None if mistake and mistake.startswith("concat") else mistake,
                     drops[i] if drops else None) for i, h in enumerate(att.heads)]
    dim = {"concat_tokens": 1, "concat_batch": 0}.get(mistake, -1)
    return torch.stack([w for w, _ in heads], dim=1), torch.cat([c for _, c in heads], dim=dim)


def heads_of(att: nn.Module, kind: str) -> int:
    if kind == "MultiHeadAttentionWrapper":
        return len(att.heads)
    return int(getattr(att, "num_heads", getattr(att, "n_heads", 1))) if kind == "MultiHeadAttention" else 1


def check_attention(att: nn.Module, kind: str, x: torch.Tensor | None = None) -> PieceResult:
    """Run the reader's attention `att` (a chapter-3 `kind`) on the book's input (or `x`) and compare."""
    d_in = _d_in(att)
    x = book_input(kind, d_in) if x is None else x
    causal = kind in CAUSAL_KINDS
    n_heads = heads_of(att, kind)

    def book(mistake=None, drops=None):
        if kind == "MultiHeadAttentionWrapper":
            return wrapper_formula(att, x, mistake, drops)
        return formula(att, x, n_heads, causal, mistake, drops[0] if drops else None)

    result = PieceResult(kind, f"{_shape(x)} inputs" + (" (the book's 'Your journey starts with one step')"
                                                           if d_in == 3 else " (torch.rand, seed 123)"))
    was_training = att.training
    try:
        att.eval()
        runs = [_run(att, x, kind) for _ in range(2)]
        weights, out = book()
        result.views = {"reader_weights": runs[0][0], "book_weights": weights, "reader_out": runs[0][1],
                        "book_out": out, "input": x}
        result.lines.append(f"eval mode: output {_shape(runs[0][1])} against glassgpt's {_shape(out)}, "
                            f"max |diff| {_diff_text(runs[0][1], out)}")
        if not same(runs[0][1], runs[1][1]):  # eval mode must give the same numbers twice
            _found(result, "output", "two eval runs", "dropout_eval")
            result.prop = "dropout_in_eval"
            return result
        d_out = out.shape[-1] if kind != "MultiHeadAttention" else _projections(att)["q"][0].shape[-1]
        hd = (_projections(att.heads[0])["q"][0].shape[-1] if kind == "MultiHeadAttentionWrapper"
              else d_out // n_heads)
        raw = raw_scores(att, x, kind, n_heads, causal)
        if not _judge(result, runs[0], (weights, out), lambda m: book(m), kind, causal, n_heads, "", raw, hd, d_out):
            return result
        drops = _train_run(att, x, kind, result)
        if drops is None:  # no nn.Dropout to switch on: nothing more to see
            result.finding = _ok_words(kind)
            return result
        reader, drop_masks = drops
        weights, out = book(None, drop_masks)
        result.lines.append(f"training mode, dropout p={TRAIN_P}, seed 123: max |diff| {_diff_text(reader[1], out)}")
        _judge(result, reader, (weights, out), lambda m: book(m, drop_masks), kind, causal, n_heads, "with dropout on, ")
        if result.ok:
            result.finding = _ok_words(kind)
        return result
    finally:
        att.train(was_training)


def _ok_words(kind: str) -> str:
    return f"{kind} matches glassgpt's attention formula (float64, your weights), in eval mode and with dropout on."


def _judge(result: PieceResult, reader, book, variant: Callable, kind: str, causal: bool, n_heads: int,
           prefix: str = "", raw: torch.Tensor | None = None, hd: int = 1, d_out: int = 1) -> bool:
    """True when the reader's (weights, output, scores, used weights) match the book's; else fill in the
    finding: the property of the formula that breaks first (properties.py), then the catalogue's line."""
    r_weights, r_out, r_scores, r_used = reader
    b_weights, b_out = book
    variants = {m: (lambda m=m: variant(m)[1]) for m in _candidates(kind, causal, n_heads)}
    weights_differ = r_weights is not None and tuple(r_weights.shape) == tuple(b_weights.shape) and \
        not same(r_weights, b_weights)
    if not weights_differ and same(r_out, b_out):
        return True
    mistake = reproducing(r_out, variants)
    if weights_differ:
        index = first_row_that_differs(r_weights, b_weights)
        bad = non_finite(r_weights[index]) if index else None
        if bad:
            where = f"row {index[-1]}" + (f" of head {index[1]}" if len(index) == 3 and n_heads > 1 else "")
            result.stage, result.where, result.mistake = "attention weights", where, mistake
            cause = _nan_cause(r_weights, index) if mistake is None else MISTAKES[mistake]
            result.finding = f"{prefix}{where} of the attention weights is {bad}: {cause}"
            return False
    broken = _broken_property(r_weights, r_scores, r_used, raw, causal, n_heads, hd, d_out, bool(prefix))
    if broken is not None:
        found(result, broken, mistake, MISTAKES, prefix)
        return False
    if weights_differ:
        index = first_row_that_differs(r_weights, b_weights)
        where = f"row {index[-1]}" + (f" of head {index[1]}" if len(index) == 3 and n_heads > 1 else "")
        return not _found(result, "attention weights", where, mistake, prefix)
    if tuple(r_out.shape) != tuple(b_out.shape):
        _found(result, "output", f"shape {_shape(r_out)}, glassgpt's {_shape(b_out)}", mistake, prefix)
        return False
    index = first_row_that_differs(r_out, b_out)
    return not _found(result, "output", f"position {index[-1]}" if index else "output", mistake, prefix)


def _candidates(kind: str, causal: bool, n_heads: int) -> list[str]:
    candidates = [m for m in MISTAKES if m not in ("dropout_eval",)]
    if not causal:
        candidates = [m for m in candidates if m not in ("no_mask", "mask_wrong_side", "mask_diagonal")]
    if kind != "MultiHeadAttention" or n_heads == 1:
        candidates = [m for m in candidates if m not in ("view_no_transpose", "scale_d_out")]
    if kind != "MultiHeadAttentionWrapper":
        candidates = [m for m in candidates if not m.startswith("concat")]
    return candidates


def _broken_property(weights, scores, used, raw, causal: bool, n_heads: int, hd: int, d_out: int,
                     training: bool):
    """The first property of softmax attention the reader's own tensors break: the weights it multiplies
    the values by (rows sum to 1, nothing after the diagonal: skipped with dropout on), then the scale."""
    heads = n_heads > 1
    if not training:
        for w in (used, weights):
            if w is not None and w.dim() >= 2 and w.shape[-1] == w.shape[-2]:
                broken = attention_rows(w, causal, heads=heads)
                if broken is not None:
                    return broken
    if scores is not None and raw is not None:
        return score_scale(scores, raw, hd, d_out)
    return None


def _found(result: PieceResult, stage: str, where: str, mistake: str | None, prefix: str = "") -> PieceResult:
    result.stage, result.where, result.mistake = stage, where, mistake
    if where.startswith("shape"):
        what = f"{prefix}the {stage} has {where}"
    else:
        what = f"{prefix}the {stage} first differ{'s' if stage == 'output' else ''} from glassgpt's at {where}"
    if mistake:
        result.finding = f"{what}: {MISTAKES[mistake]}"
    elif stage == "output":
        result.prop = "after_the_weights"
        result.finding = (f"{what}, while the attention weights keep softmax's properties (each row sums to 1, "
                          f"nothing after the diagonal, scores scaled by 1/sqrt(head size)): the difference comes "
                          f"after them, in the values, the merge of the heads or out_proj")
    else:
        result.prop = "scores"
        result.finding = (f"{what}, while they keep softmax's properties (each row sums to 1, nothing after the "
                          f"diagonal, one scale): the scores themselves differ, so the queries or the keys do "
                          f"(W_query, W_key, or the split into heads)")
    return result


def _nan_cause(weights: torch.Tensor, index: tuple[int, ...]) -> str:
    return ("a NaN in the weights comes from 0 / 0 (a softmax over a row that is all -inf) or from a NaN in "
            "the scores: print attn_scores at that row")


def _run(att: nn.Module, x: torch.Tensor, kind: str):
    """(the reader's attention weights as its softmax returned them, stacked [b, h, t, t] for the
    wrapper's heads; its output; the scores its softmax was given; the weights it multiplied the
    values by), the last three None where they were not seen."""
    mode = _Softmaxes()
    with torch.no_grad(), mode:
        out = run_reader(f"{type(att).__name__}.forward on a {_shape(x)} input", lambda: att(x))
    if not mode.seen:
        return None, out.detach(), None, None
    seen = [w for _, w in mode.seen]
    scores = [s for s, _ in mode.seen]
    used = mode.used if len(mode.used) == len(seen) else None
    if kind == "MultiHeadAttentionWrapper":
        def stacked(ts):
            return torch.stack(ts, dim=1) if ts and all(t.shape == ts[0].shape for t in ts) else None
        return stacked(seen), out.detach(), stacked(scores), stacked(used) if used else None
    return seen[0], out.detach(), scores[0], used[0] if used else None


def _train_run(att: nn.Module, x: torch.Tensor, kind: str, result: PieceResult):
    """The reader's (weights, output) in training mode with its nn.Dropout modules at p = TRAIN_P, and the
    dropout masks the same seed draws (one per dropout call, in order); None without nn.Dropout."""
    drops = [m for m in att.modules() if isinstance(m, nn.Dropout)]
    if not drops:
        return None
    saved = [m.p for m in drops]
    try:
        for m in drops:
            m.p = TRAIN_P
        att.train()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(123)
            reader = _run(att, x, kind)
        n_heads = len(att.heads) if kind == "MultiHeadAttentionWrapper" else 1
        shape = _weights_shape(att, x, kind)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(123)
            masks = [torch.nn.functional.dropout(torch.ones(shape, dtype=x.dtype), TRAIN_P, True).double()
                     for _ in range(n_heads)]
        return reader, masks
    finally:
        for m, p in zip(drops, saved):
            m.p = p
        att.eval()


def _weights_shape(att: nn.Module, x: torch.Tensor, kind: str) -> tuple[int, ...]:
    t = x.shape[-2]
    if kind == "MultiHeadAttention":
        return (x.shape[0], heads_of(att, kind), t, t)
    return (*x.shape[:-1], t)


def _d_in(att: nn.Module) -> int:
    first = att.heads[0] if hasattr(att, "heads") else att
    w = getattr(first, "W_query", None)
    if isinstance(w, nn.Linear):
        return w.in_features
    if torch.is_tensor(w):
        return w.shape[0]
    raise AttributeError("no W_query: glassgpt reads the book's names (W_query, W_key, W_value)")


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(n) for n in t.shape) + "]"


def _diff_text(got: torch.Tensor, want: torch.Tensor) -> str:
    if tuple(got.shape) != tuple(want.shape):
        return f"shapes differ ({_shape(got)} vs {_shape(want)})"
    bad = non_finite(got)
    return f"{bad} in yours" if bad else f"{largest_diff(got, want):.3g}"

"""What each piece's formula guarantees, checked on the reader's own tensors.

A catalogue of mistakes (MISTAKES beside each check) names a line, but only the lines someone
thought of. The properties below hold for every correct piece whatever its code looks like, so a
mistake nobody listed still breaks one of them, at a position that can be named:

  attention weights   each row sums to 1; no weight after the row's own position (causal), none
                      before its window; every position it may read gets some weight; the scores
                      are scaled by 1/sqrt(head size) (the factor is fitted, so 1/sqrt(d_out) is named)
  a norm              (output - shift) / scale has mean 0 (LayerNorm) and unit biased variance (or
                      unit mean square, RMSNorm), eps inside the root (fitted on rows of two scales)
  a feed-forward      its width, and the activation between the layers (fitted on the reader's own
                      hidden numbers: GELU's tanh form, exact GELU, ReLU, SiLU, none)
  a block             each shortcut present: norm2's input is x + att(...), the output is that + ff(...)
  windows             targets are the inputs shifted by k, k found from the windows alone
  RoPE                which dimensions turn together, at which frequencies (the base fitted)

Each function returns None when the property holds, else a Broken: the property (a key), the stage,
the position where it first shows, and one sentence in the reader's terms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

SUM_TOL = 1e-4  # a row of float32 attention weights sums to 1 within some 1e-6


@dataclass
class Broken:
    """A property of the formula that the reader's tensors break, and where it first shows."""

    prop: str    # "rows_sum_to_1", "no_future", "scale", ...
    stage: str   # "attention weights", "output", "windows", ...
    where: str   # "row 2 of head 0", "position 3", "window 0"
    words: str   # the property, broken, in the reader's terms


# --- attention weights -----------------------------------------------------------------------------

def _row_name(index: tuple[int, ...], heads: bool) -> str:
    """'row i of head h' for an index (..., h, i) of [b, h, t, s] weights; 'row i' for [b, t, s]."""
    return f"row {index[-1]}" + (f" of head {index[-2]}" if heads and len(index) >= 2 else "")


def attention_rows(weights: torch.Tensor, causal: bool, offset: int = 0, window: int | None = None,
                   heads: bool = True) -> Broken | None:
    """The properties of softmax attention on weights [..., t, s]: row i (query position offset + i)
    sums to 1, puts nothing after its position when causal (nor before its window), and some weight
    on every position it may read. Rows are visited in the order of positions."""
    w = weights.detach().double()
    t, s = w.shape[-2], w.shape[-1]
    rows = w.movedim(-2, 0).reshape(t, -1, s)  # [t, rest, s]
    lead = w.shape[:-2]
    for i in range(t):
        p = offset + i
        for r in range(rows.shape[1]):
            row = rows[i, r]
            index = (*[int(k) for k in torch.unravel_index(torch.tensor(r), lead)], i) if lead else (i,)
            where = _row_name(index, heads)
            broken = _one_row(row, p, s, causal, window, where, rows[:, r] if not causal or t == s else None)
            if broken:
                return broken
    return None


def _one_row(row: torch.Tensor, p: int, s: int, causal: bool, window: int | None, where: str,
             column_of: torch.Tensor | None) -> Broken | None:
    if not bool(torch.isfinite(row).all()):
        return None  # a NaN row: the NaN words (attention.py's) say more than any sum
    allowed = torch.ones(s, dtype=torch.bool)
    if causal:
        allowed[p + 1:] = False
    if window is not None:
        allowed[:max(0, p - window + 1)] = False
    total = float(row.sum())
    future = (row > 0) & ~allowed
    if abs(total - 1) > SUM_TOL:
        if column_of is not None and _columns_sum_to_1(column_of):
            return Broken("rows_sum_to_1", "attention weights", where,
                          f"{where} of the attention weights sums to {total:.4g}, not 1, but each column sums to "
                          f"1: the softmax runs over the queries (dim=-2); take it over the keys, dim=-1")
        masked_after = causal and not bool(future.any()) and total < 1
        cause = ("the future is zeroed after the softmax, so the row keeps only part of its weight: fill the "
                 "scores above the diagonal with -inf before the softmax, which then spreads each row's weight "
                 "over the positions it may read" if masked_after else
                 "something changes the weights after the softmax (each row of a softmax over the keys, dim=-1, "
                 "sums to 1): the softmax must be the last step before attn_weights @ values (dropout aside)")
        return Broken("rows_sum_to_1", "attention weights", where,
                      f"{where} of the attention weights sums to {total:.4g}, not 1: {cause}")
    if bool(future.any()):
        j = int(torch.nonzero(future)[0])
        edge = "after it (a later token)" if causal and j > p else f"outside its window of {window}"
        return Broken("no_future" if j > p else "window", "attention weights", where,
                      f"{where} (position {p}) puts weight {float(row[j]):.3g} on position {j}, {edge}: "
                      + ("fill the scores above the diagonal, torch.triu(..., diagonal=1), with -inf before the "
                         "softmax" if j > p else "mask the positions more than window - 1 before it"))
    starved = (row == 0) & allowed
    if causal and bool(starved.any()):
        j = int(torch.nonzero(starved)[0])
        return Broken("reads_its_past", "attention weights", where,
                      f"{where} (position {p}) puts no weight at all on position {j}, which it may read: the mask "
                      f"hides a position at or before the row's own (masked_fill where the mask is True, "
                      f"torch.triu(..., diagonal=1): only the positions after the row)")
    return None


def _columns_sum_to_1(block: torch.Tensor) -> bool:
    return bool(((block.sum(0) - 1).abs() <= SUM_TOL).all())


def fitted_scale(scores: torch.Tensor, raw: torch.Tensor) -> float | None:
    """c such that scores = c * raw on the finite entries (the reader's softmax input against q k^T),
    or None when no one factor fits."""
    scores, raw = scores.detach().double(), raw.detach().double()
    if scores.shape != raw.shape:
        return None
    use = torch.isfinite(scores) & torch.isfinite(raw) & (raw.abs() > 1e-6 * float(raw[torch.isfinite(raw)].abs().max()))
    if not bool(use.any()):
        return None
    c = float((scores[use] * raw[use]).sum() / (raw[use] ** 2).sum())
    residual = float((scores[use] - c * raw[use]).abs().max())
    return c if residual <= 1e-4 * max(float(scores[use].abs().max()), 1e-30) else None


def score_scale(scores: torch.Tensor, raw: torch.Tensor, head_dim: int, d_out: int) -> Broken | None:
    """The scores go into the softmax as q k^T / sqrt(head size): fit the reader's factor, and name it."""
    c = fitted_scale(scores, raw)
    want = 1 / math.sqrt(head_dim)
    if c is None or abs(c - want) <= 1e-4 * want:
        return None
    named = {1.0: "not scaled at all (a factor of 1)", 1 / math.sqrt(d_out): f"scaled by 1/sqrt(d_out) = "
             f"1/sqrt({d_out})", 1 / head_dim: f"divided by the head size {head_dim} itself, not its root"}
    said = next((words for value, words in named.items() if abs(c - value) <= 1e-4 * value), None)
    said = said or f"scaled by {c:.4g} (1/sqrt({1 / c ** 2:.4g}))"
    return Broken("scale", "attention weights", "every row",
                  f"the scores are {said}; the formula scales them by 1/sqrt(head size) = 1/sqrt({head_dim}): "
                  f"attn_scores / keys.shape[-1]**0.5, the head size after the split into heads")



def named_scale(scores: torch.Tensor, raw: torch.Tensor, want: float, want_words: str,
                known: dict[float, str]) -> Broken | None:
    """score_scale for a formula whose factor is not 1/sqrt(head size) (Gemma 3's query_pre_attn_scalar**-0.5):
    the reader's factor fitted, and named where it is one of `known` ({factor: words})."""
    c = fitted_scale(scores, raw)
    if c is None or abs(c - want) <= 1e-4 * want:
        return None
    named = {1.0: "not scaled at all (a factor of 1)", **known}
    said = next((words for value, words in named.items() if abs(c - value) <= 1e-4 * value), None)
    said = f"scaled by {said}" if said and not said.startswith(("not", "scaled")) else said
    said = said or f"scaled by {c:.4g} (1/sqrt({1 / c ** 2:.4g}))"
    return Broken("scale", "attention weights", "every row",
                  f"the scores are {said}; the formula scales them by {want_words} = {want:.4g}")

# --- norms -------------------------------------------------------------------------------------------

def norm_rows(x: torch.Tensor, z: torch.Tensor, rms: bool, eps: float) -> Broken | None:
    """z = (output - shift) / scale of a norm over x's last dimension, rows of two scales (1 and 1e-3):
    mean 0 (LayerNorm), unit biased variance or mean square, and eps inside the root."""
    x, z = x.detach().double(), z.detach().double()
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    z2 = z.reshape(-1, n)
    what = "mean square" if rms else "variance"
    for r in range(x2.shape[0]):
        xc = x2[r] if rms else x2[r] - x2[r].mean()
        spread = float((xc ** 2).mean())
        if not rms and abs(float(z2[r].mean())) > 1e-4 * max(1.0, float(z2[r].abs().max())):
            return Broken("norm_mean", "output", f"row {r}", f"row {r} of the normalized output has mean "
                          f"{float(z2[r].mean()):.3g}, not 0: subtract the mean, x - x.mean(dim=-1, keepdim=True)")
        if rms and abs(float(z2[r].mean())) < 1e-6 < abs(float(x2[r].mean())) * 1e-3:
            return Broken("norm_mean", "output", f"row {r}", f"row {r} of the normalized output has mean 0: "
                          "RMSNorm subtracts no mean (that is LayerNorm): x * torch.rsqrt(x.pow(2).mean(-1) + eps)")
        got = float((z2[r] ** 2).mean()) if rms else float(z2[r].var(unbiased=False))
        want = spread / (spread + eps)
        if abs(got - want) <= 1e-4 * want:
            continue
        return _norm_spread(r, got, spread, eps, n, what, x2, z2, rms)
    return None


def _norm_spread(r: int, got: float, spread: float, eps: float, n: int, what: str, x2, z2, rms: bool) -> Broken:
    where = f"row {r}"
    if abs(got - (n - 1) / n * spread / (spread + eps)) <= 1e-4 * got:
        return Broken("biased_variance", "output", where, f"row {r} of the normalized output has variance "
                      f"{got:.6g}, (n - 1) / n = {(n - 1) / n:.4g} of 1: the variance is divided by n - 1 (unbiased); the formula "
                      f"divides "
                      f"by n, x.var(dim=-1, keepdim=True, unbiased=False)")
    small = [k for k in range(x2.shape[0]) if float(_spread(x2[k], rms)) < 100 * eps] or [r]  # where eps shows
    inside = [float(_spread(x2[k], rms) / _zspread(z2[k], rms) - _spread(x2[k], rms)) for k in small]
    outside = [float((_spread(x2[k], rms) / _zspread(z2[k], rms)) ** 0.5 - _spread(x2[k], rms) ** 0.5)
               for k in small]
    if _consistent(outside) and not _consistent(inside):  # (before "no eps": outside, eps barely shows inside)
        return Broken("eps", "output", where, f"row {r}: eps = {outside[0]:.3g} is added outside the root "
                      f"(sqrt({what}) + eps); the formula adds it inside, torch.sqrt(var + eps)")
    if max(abs(e) for e in inside) <= 1e-2 * eps:
        return Broken("eps", "output", where, f"row {r} of the normalized output has {what} {got:.6g} where eps = "
                      f"{eps:g} gives {spread / (spread + eps):.6g}: there is no eps, so a row of (nearly) equal "
                      f"numbers is blown up to unit {what}: torch.sqrt(var + eps)")
    if _consistent(inside):
        return Broken("eps", "output", where, f"row {r}: eps is {inside[0]:.3g}, not {eps:g}: "
                      f"torch.sqrt(var + {eps:g})")
    return Broken("norm_variance", "output", where, f"row {r} of the normalized output has {what} {got:.6g}, "
                  f"not {spread / (spread + eps):.6g} (1, less what eps = {eps:g} takes): divide by "
                  f"torch.sqrt({what} + eps) of the same row")


def _spread(x: torch.Tensor, rms: bool) -> torch.Tensor:
    return (x ** 2).mean() if rms else x.var(unbiased=False)


def _zspread(z: torch.Tensor, rms: bool) -> torch.Tensor:
    return (z ** 2).mean() if rms else z.var(unbiased=False)


def _consistent(values: list[float]) -> bool:
    return all(v > 0 for v in values) and max(values) - min(values) <= 1e-2 * max(values)


# --- activations and widths ----------------------------------------------------------------------------

def _gelu_tanh(h: torch.Tensor) -> torch.Tensor:
    return 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "GELU (the tanh form)": _gelu_tanh, "the exact GELU (erf, nn.GELU())": F.gelu, "ReLU": F.relu,
    "SiLU": F.silu, "no activation (the identity)": lambda h: h, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
}


def activation(h: torch.Tensor, a: torch.Tensor, want: str) -> Broken | None:
    """a = act(h) elementwise, on the reader's own hidden numbers [..., t, f]: the activation named."""
    h, a = h.detach().double(), a.detach().double()
    expected = ACTIVATIONS[want](h)
    tol = 1e-5 * max(float(expected.abs().max()), 1e-30)
    if h.shape == a.shape and bool(((a - expected).abs() <= tol).all()):
        return None
    found = next((name for name, fn in ACTIVATIONS.items() if h.shape == a.shape
                  and bool(((a - fn(h)).abs() <= 1e-5 * max(float(fn(h).abs().max()), 1e-30)).all())), None)
    if h.shape != a.shape:
        return Broken("activation", "output", "its shape", f"the hidden layer has shape {list(a.shape)} "
                      f"after the activation and {list(h.shape)} before it: the activation keeps the shape")
    bad = ((a - expected).abs() > tol)
    pos = int(torch.nonzero(bad.reshape(-1, h.shape[-1]).any(-1))[0]) % (h.shape[-2] if h.dim() > 1 else 1)
    k = int(torch.nonzero(bad.reshape(-1))[0])
    said = f"it is {found}" if found else (f"it maps {float(h.reshape(-1)[k]):.4g} to {float(a.reshape(-1)[k]):.4g},"
                                           f" {want} to {float(expected.reshape(-1)[k]):.4g}")
    return Broken("activation", "output", f"position {pos}", f"the activation between the layers is not "
                  f"{want}: {said} (first at position {pos} of the hidden layer)")


def width(hidden: int, d: int, want: int, name: str) -> Broken | None:
    if hidden == want:
        return None
    return Broken("width", "shape", "its width", f"the hidden layer is {hidden} wide ({hidden / d:g} x "
                  f"emb_dim {d}); {name} is {want} wide")


# --- shortcuts ---------------------------------------------------------------------------------------

def shortcuts(x: torch.Tensor, a: torch.Tensor, mid: torch.Tensor, f: torch.Tensor, out: torch.Tensor
              ) -> Broken | None:
    """A pre-norm block: mid (norm2's input) = x + a (att's output), out = mid + f (ff's output)."""
    def close(p, q):
        p, q = p.double(), q.double()
        return p.shape == q.shape and bool(((p - q).abs() <= 1e-5 * max(float(q.abs().max()), 1e-30)).all())
    for which, inp, part, got, line in (("shortcut1", x, a, mid, "after self.att"),
                                        ("shortcut2", mid, f, out, "after self.ff")):
        if close(got, inp.double() + part.double()):
            continue
        said = "missing: it is the part's output alone" if close(got, part) else \
            "not the input plus the part's output"
        pos = _first_position(got, inp.double() + part.double())
        n = "first (around the attention)" if which == "shortcut1" else "second (around the feed forward)"
        return Broken(which, "output", f"position {pos}", f"the {n} shortcut is {said} (first at position "
                      f"{pos}): add the part's input back, x = x + shortcut {line}")
    return None


def _first_position(got: torch.Tensor, want: torch.Tensor) -> int:
    bad = ((got.double() - want).abs() > 1e-5 * max(float(want.abs().max()), 1e-30)).any(-1)  # [..., t]
    hit = torch.nonzero(bad.reshape(-1, bad.shape[-1]).any(0)) if bad.dim() else torch.tensor([[0]])
    return int(hit[0]) if hit.numel() else 0


# --- windows -----------------------------------------------------------------------------------------

def target_shift(inputs: list[list[int]], targets: list[list[int]]) -> int | None:
    """The shift k by which every window's targets are its inputs (target[j] = input[j + k] where both
    exist), found from the windows alone; None when no k fits every window."""
    n = len(inputs[0]) if inputs else 0
    for k in range(0, n):
        if all(list(y[:n - k]) == list(x[k:]) for x, y in zip(inputs, targets)):
            return k
    return None


def shift_broken(inputs: list[list[int]], targets: list[list[int]]) -> Broken | None:
    k = target_shift(inputs, targets)
    if k == 1:
        return None
    if k == 0:
        return Broken("shift", "windows", "window 0", f"the targets equal the inputs (shifted by 0, window 0: "
                      f"inputs {inputs[0]}, targets {targets[0]}): the model would learn to copy its input; shift "
                      f"them by one token, target_chunk = token_ids[i + 1:i + max_length + 1]")
    if k is not None:
        return Broken("shift", "windows", "window 0", f"the targets are the inputs shifted by {k} tokens, not 1 "
                      f"(window 0: inputs {inputs[0]}, targets {targets[0]}): the next token is one step on, "
                      f"target_chunk = token_ids[i + 1:i + max_length + 1]")
    w = next((w for w, (x, y) in enumerate(zip(inputs, targets)) if list(y[:-1]) != list(x[1:])), 0)
    return Broken("shift", "windows", f"window {w}", f"window {w}'s targets {targets[w]} are no shift of its inputs "
                  f"{inputs[w]}: each target is the token after its input, target_chunk = token_ids[i + 1:i + "
                  f"max_length + 1]")


def window_starts(ids: list[int], inputs: list[list[int]], max_length: int, stride: int) -> Broken | None:
    """Window k holds max_length tokens starting at token k * stride, and the windows run while a target
    remains (the last starts before len(ids) - max_length)."""
    starts = list(range(0, len(ids) - max_length, stride))
    book = [list(ids[i:i + max_length]) for i in starts]
    for k, window in enumerate(inputs):
        if k < len(book) and list(window) != book[k]:
            places = [book.index(list(w)) for w in inputs if list(w) in book]
            if len(places) == len(inputs) <= len(book) and places != sorted(places):  # the book's, reordered
                j = places[k]
                return Broken("order", "windows", f"window {k}", f"window {k} is the book's window {j} (from token "
                              f"{starts[j]}): every window is one of the book's, in another order; window k starts "
                              f"k * stride tokens in, and a loader asked for shuffle=False keeps that order, "
                              f"DataLoader(dataset, shuffle=shuffle)")
            break
    for k, window in enumerate(inputs):
        if len(window) != max_length:
            return Broken("window_length", "windows", f"window {k}", f"window {k} holds {len(window)} tokens, not "
                          f"max_length {max_length}: input_chunk = token_ids[i:i + max_length]")
        start = next((i for i in range(len(ids) - len(window) + 1) if ids[i:i + len(window)] == window), None)
        if start is None and k * stride < len(ids):
            j = next((j for j, (a, b) in enumerate(zip(window, ids[k * stride:])) if a != b), 0)
            return Broken("window_tokens", "windows", f"window {k}", f"window {k}'s token {j} is {window[j]}, not the "
                          f"text's token {k * stride + j}, {ids[k * stride + j]}: the window is no run of the ids "
                          f"GPT-2's tokenizer gives the text as it stands, token_ids = tokenizer.encode(txt), "
                          f"input_chunk = token_ids[i:i + max_length]")
        if start != k * stride:
            said = f"starts at token {start}" if start is not None else "is no run of the text's tokens"
            return Broken("stride", "windows", f"window {k}", f"window {k} {said}, not {k} x stride = {k * stride}: "
                          f"window k starts k * stride tokens in, for i in range(0, len(token_ids) - max_length, "
                          f"stride)")
    expected = len(range(0, len(ids) - max_length, stride))
    if len(inputs) != expected:
        return Broken("window_count", "windows", "the number of windows", f"there are {len(inputs)} windows; "
                      f"{len(ids)} tokens with max_length {max_length} and stride {stride} give {expected}: "
                      f"range(0, len(token_ids) - max_length, stride)")
    return None


def window_targets(ids: list[int], inputs: list[list[int]], targets: list[list[int]], max_length: int,
                   stride: int) -> Broken | None:
    """Window k's targets are the max_length tokens that follow token k * stride by one: their length, and
    each token (the last one too, which the shift of the inputs alone cannot see)."""
    for k, y in enumerate(targets[:len(inputs)]):
        if len(y) != max_length:
            return Broken("target_length", "windows", f"window {k}", f"window {k}'s targets hold {len(y)} tokens, "
                          f"not max_length {max_length}: target_chunk = token_ids[i + 1:i + max_length + 1]")
        want = list(ids[k * stride + 1:k * stride + 1 + max_length])
        if list(y) != want:
            j = next(i for i, (a, b) in enumerate(zip(y, want)) if a != b)
            return Broken("target_tokens", "windows", f"window {k}", f"window {k}'s target {j} is {y[j]}, not the "
                          f"text's token {k * stride + 1 + j}, {want[j]}: target_chunk = token_ids[i + 1:i + "
                          f"max_length + 1]")
    return None


# --- RoPE --------------------------------------------------------------------------------------------

def rope_pairs(turned: torch.Tensor) -> list[int]:
    """For turned[i] = the reader's RoPE of the unit vector e_i at position 1 ([hd, hd]): the partner
    of each dimension (the other dimension its rotation moves it into)."""
    partners = []
    for i in range(turned.shape[0]):
        moved = turned[i].double().abs().clone()
        moved[i] = 0
        partners.append(int(moved.argmax()) if float(moved.max()) > 1e-6 else i)
    return partners


def pairing_words(partners: list[int]) -> str:
    hd = len(partners)
    if all(partners[i] == (i + hd // 2) % hd for i in range(hd)):
        return "the halves (dimension i with i + hd/2)"
    if all(partners[i] == i ^ 1 for i in range(hd)):
        return "neighbours (dimension 2i with 2i + 1, Meta's interleaved layout)"
    if all(partners[i] == i for i in range(hd)):
        return "nothing (no dimension moves: no rotation at all)"
    return "dimensions " + ", ".join(f"{i}-{j}" for i, j in enumerate(partners) if i < j)


def fitted_base(inv_freq: torch.Tensor, head_dim: int) -> float | None:
    """theta_base such that inv_freq[i] = base^(-2i/hd), fitted on pair 1; None when one base fits no pair."""
    if inv_freq.numel() < 2 or float(inv_freq[1]) <= 0:
        return None
    base = float(inv_freq[1]) ** (-head_dim / 2)
    want = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64)[: head_dim // 2] / head_dim)
    return base if bool(((inv_freq.double() - want).abs() <= 1e-3 * want).all()) else None

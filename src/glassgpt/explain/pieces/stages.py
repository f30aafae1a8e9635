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

Each returns a properties.Broken (the property, the stage, where, one sentence) or None; CHECKED says, for a
stage none of them breaks, what was checked.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .properties import Broken, activation, norm_rows

CHECKED = {
    "tok_emb": "each position holds its token's row", "pos_emb": "position p holds row p",
    "embeddings": "tok_emb + pos_emb, each once", "norm": "mean 0, unit variance, eps inside the root",
    "att": "its weights summing to 1, nothing read after a position", "ff": "the activation between its layers",
    "shortcut": "the input plus the part's output, each once", "out_head": "a factor on the formula's logits",
    "head": "a factor on the formula's logits", "reads": "what its placement gives it",
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

"""What `why` answers (why.py), for every described model: the Why result,
and the choices it is about: the target A, the B of logit[A] - logit[B], and a corrupted prompt to patch from.

GPT-2's attribution and the described one fill the same fields, so both show through the same views
(views/why.py), and the JSON of any model's why reads as GPT-2's does (plus its key/value groups).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..errors import PromptError
from ..prompt import encode
from ..tokenizer import Tokenizer
from .result import Result, view

ATTENTION_IS_NOT = ("attention weights alone are neither answer: `direct` weighs each source by what its value "
                    "vector, through W_O and final_norm, adds to the logit; `causal` removes it and runs again")


@dataclass
class Why(Result):
    """One attribution, as plain data; `to_dict()` is the JSON's `why`."""

    prompt: str
    tokens: list[dict[str, Any]]
    kind: str                                   # "token" or "class"
    target: dict[str, Any]                      # {"id", "text", "logit"}
    versus: dict[str, Any] | None
    parts: list[dict[str, Any]]                 # [{"name", "value"}], summing to the metric
    heads: list[list[float]]                    # [n_layers][n_heads]: each head's term
    ff: list[float]                             # [n_layers]: each feed-forward's term
    by_source: list[list[list[float]]]          # [n_layers][n_heads][t]: each head's term split over sources
    sources: list[dict[str, Any]]
    metric: float                               # the true logit, or the true logit difference
    candidates: list[dict[str, Any]] = field(default_factory=list)  # the top tokens, to ask about another
    contrast: dict[str, Any] | None = None      # without versus: {"versus", "parts"} of logit[target] - logit[runner-up]
    patch: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("prompt", "tokens", "kind", "target", "versus", "metric", "parts",
                                             "sources", "heads", "ff", "by_source", "candidates", "contrast",
                                             "notes")}
        if self.patch is not None:
            out["patch"] = self.patch
        return out

    def to_text(self, color: bool = False, top: int = 12) -> str:
        """The terminal view (views/why.py)."""
        return view(self, "text")(self, color=color, top=top)


# --- A and B -------------------------------------------------------------------------------------

def labeller(model: nn.Module, tokenizer: Tokenizer, labels: list[str] | None) -> Callable[[int], str]:
    """The text of an id: a token's (a row of out_head past the tokenizer's ids says so: Qwen3 pads
    151,669 ids to 151,936 rows), or a classifier's class name."""
    if getattr(model.cfg, "num_classes", None) is None:  # (the bonus models' configs have no classifier head)
        return lambda i: tokenizer.decode([i]) if i < tokenizer.n_vocab else f"<row {i}: no token>"
    return lambda i: labels[i] if labels and i < len(labels) else f"class {i}"


def check_id(i: int, n: int, what: str) -> int:
    if not 0 <= int(i) < n:
        raise PromptError(f"{what} id {i} does not exist: choose 0..{n - 1:,}")
    return int(i)


def runner_up(last: torch.Tensor, a: int) -> int:
    """The highest-scoring id other than a."""
    others = last.clone()
    others[a] = -torch.inf
    return int(others.argmax())


def versus_id(model: nn.Module, tokenizer: Tokenizer, versus: str | int | None, labels: list[str] | None,
              last: torch.Tensor, a: int) -> int | None:
    """The id of B in logit[A] - logit[B]: as given, or for a classifier the runner-up class."""
    num_classes, out_dim = getattr(model.cfg, "num_classes", None), last.shape[-1]
    if versus is None:
        if num_classes is None:
            return None
        return runner_up(last, a)
    if isinstance(versus, int):
        return check_id(versus, out_dim, "--versus")
    if num_classes is not None:
        names = labels or [f"class {i}" for i in range(num_classes)]
        if versus in names:
            return names.index(versus)
        if versus.isdigit():
            return check_id(int(versus), out_dim, "--versus")
        raise PromptError(f"--versus {versus!r} is not a class of this classifier: choose one of {names}")
    pieces = tokenizer.encode(versus)
    if len(pieces) != 1:
        split = " + ".join(repr(tokenizer.decode([i])) for i in pieces) or "no tokens"
        raise PromptError(f"--versus {versus!r} is {len(pieces)} tokens ({split}), not one: give a single token, "
                          "e.g. with its leading space (' know')")
    return pieces[0]


# --- which prompt tokens ----------------------------------------------------------------------------

def sources_of(ids: list[int], by_source: list, causal: list | str, tokenizer: Tokenizer) -> list[dict[str, Any]]:
    """Each prompt token with its two shares: `direct` (by_source summed over blocks and heads) and `causal`."""
    direct = torch.tensor(by_source, dtype=torch.float64).sum(dim=(0, 1))  # [n_layers, h, t] -> [t]
    return [{"position": j, "id": i, "text": tokenizer.decode([i]), "direct": float(direct[j]),
             "causal": causal[j] if isinstance(causal, list) else {"how": causal, "prob_change": None,
                                                                    "logit_change": None}}
            for j, i in enumerate(ids)]


# --- activation patching: what the two runs are compared on -------------------------------------------

def corrupted_ids(tokenizer: Tokenizer, ids: list[int], corrupted_text: str) -> list[int]:
    """The corrupted prompt's ids, as many as the clean prompt's (patching copies position for position)."""
    bad = encode(tokenizer, corrupted_text)
    if len(bad) != len(ids):
        show = lambda xs: " ".join(repr(tokenizer.decode([i])) for i in xs)  # noqa: E731
        raise PromptError(f"--patch needs as many tokens as the prompt: the prompt is {len(ids)} ({show(ids)}), "
                          f"the corrupted prompt {len(bad)} ({show(bad)})")
    return bad


def patch_pair(last: torch.Tensor, bad_last: torch.Tensor, versus: int | None, label) -> tuple[int, int, float, float]:
    """(A, B, m_clean, m_corrupted): A the clean top token, B the corrupted run's top (or `versus`), m = logit[A] -
    logit[B] on each run; refused in one line where there is nothing for patching to restore."""
    a = int(last.argmax())
    b = int(bad_last.argmax()) if versus is None else versus
    if a == b:
        raise PromptError(f"both prompts' top token is {label(a)!r}, so logit[A] - logit[B] is 0 on both: "
                          "pass --versus TOKEN to measure against another token")
    m_clean, m_bad = float(last[a] - last[b]), float(bad_last[a] - bad_last[b])
    if abs(m_clean - m_bad) < 1e-6:
        raise PromptError(f"the clean and the corrupted prompt give the same logit difference ({m_clean:.4g}): "
                          "nothing for patching to restore; choose a corrupted prompt that changes the answer")
    return a, b, m_clean, m_bad


def first_difference(ids: list[int], bad: list[int]) -> int:
    """Before the first token the prompts differ in, both runs hold the same numbers: copying changes nothing."""
    return next(j for j, (x, y) in enumerate(zip(ids, bad)) if x != y)

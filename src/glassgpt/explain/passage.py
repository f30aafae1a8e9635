"""Where the model is surprised: the probability it gave each true next token of a text.

    passage(model, tokenizer, text) -> Passage

Position i's probability is softmax(logits[i - 1])[ids[i]]: what the model, having read
tokens 0..i-1, gave the token that really came next (the first token has none). The mean
of -log p is the text's cross-entropy, the loss training lowers; exp of it the perplexity.
A text longer than context_length is read in windows that overlap by half, and each token
is scored in the window where it has at least half a context before it, as strided
perplexity is computed (so no token is scored with only a few tokens of context). Each window is
one recording (record.py) that keeps nothing but the logits, so a long passage reports its progress
block by block and can be cancelled, as a trace can.

Its views (views/passage.py): the text (with each token marked by its probability, then the
positions the model got most wrong) and the same as a picture.
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..adopt import adopt, check_computable
from ..device import evaluating
from ..errors import PromptError
from ..kinds import describe
from ..prompt import encode
from ..tokenizer import Tokenizer
from .record import Progress, Recorder, record
from .trace import About
from .result import Result

WORST = 10


@dataclass
class Passage(Result):
    model: dict[str, Any]
    tokens: list[dict[str, Any]]       # id, text, prob (None for the first), expected (the model's top token)
    loss: float                        # mean -log p over the scored tokens (nats)
    perplexity: float
    worst: list[int]                   # positions of the lowest probabilities, lowest first
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.inference_mode()
def passage(model: nn.Module, tokenizer: Tokenizer, text: str, about: About | None = None, worst: int = WORST,
            progress: Progress | None = None, cancel: threading.Event | None = None) -> Passage:
    """Score every token of `text` (at least two tokens) under `model`; see the module's docstring.

    progress(step, done, total) is called after each block of each window; `cancel`, once set, stops it."""
    check_computable(model, tokenizer)
    model = adopt(model, encode(tokenizer, text)[:adopt(model, described=True).cfg.context_length], described=True)
    if model.cfg.num_classes is not None:
        raise PromptError("a classifier predicts no next tokens: give --passage a language model")
    ids = encode(tokenizer, text)
    if len(ids) < 2:
        raise PromptError("the passage is one token: give a text of two tokens or more (each is scored on those before)")
    about = about or About()
    scored, notes = _score(model, ids, progress, cancel)
    tokens = [{"id": ids[0], "text": tokenizer.decode([ids[0]]), "prob": None, "expected": None}]
    for i in range(1, len(ids)):
        prob, top_id, top_prob = scored[i]
        tokens.append({"id": ids[i], "text": tokenizer.decode([ids[i]]), "prob": prob,
                       "expected": {"id": top_id, "text": tokenizer.decode([top_id]), "prob": top_prob}})
    nll = [-math.log(max(t["prob"], 1e-45)) for t in tokens[1:]]
    loss = sum(nll) / len(nll)
    order = sorted(range(1, len(ids)), key=lambda i: tokens[i]["prob"])[:worst]
    return Passage({"name": about.name, "random_weights": about.random_weights, "config": model.cfg.to_dict()},
                   tokens, loss, math.exp(loss), order, notes)


def _score(model: nn.Module, ids: list[int], progress: Progress | None,
           cancel: threading.Event | None) -> tuple[dict[int, tuple[float, int, float]], list[str]]:
    """{position: (p of the true token, the top id, its p)} for positions 1.., window by window."""
    ctx, n = model.cfg.context_length, len(ids)
    device = model.get_submodule(describe(model).embedding.path).weight.device
    windows = [(0, min(n, ctx), 1)]  # (start, end, first position scored)
    stride = max(1, ctx // 2)
    while windows[-1][1] < n:
        end = min(n, windows[-1][1] + stride)
        windows.append((end - ctx, end, windows[-1][1]))
    scored: dict[int, tuple[float, int, float]] = {}
    rec = Recorder(frozenset(), len(windows) * model.cfg.n_layers, cancel, progress)  # keeps only the logits
    with evaluating(model):
        for start, end, first in windows:
            x = torch.tensor([ids[start:end]], device=device)
            # The logits at the positions just before each scored one: [t, V] -> [scored, V].
            logits = record(model, x, rec)[0, first - start - 1:end - start - 1].float()
            target = x[0, first - start:end - start]
            lse = logits.logsumexp(dim=-1)
            prob = (logits.gather(1, target[:, None])[:, 0] - lse).exp()
            top, top_id = logits.max(dim=-1)
            top_prob = (top - lse).exp()
            for k, pos in enumerate(range(first, end)):
                scored[pos] = (float(prob[k]), int(top_id[k]), float(top_prob[k]))
    notes = []
    if len(windows) > 1:
        notes.append(f"the passage is {n:,} tokens, more than context_length {ctx:,}: it was read in {len(windows)} "
                     f"windows of {ctx:,} overlapping by {ctx - stride:,}, each token scored with at least "
                     f"{ctx - stride:,} tokens before it")
    return scored, notes

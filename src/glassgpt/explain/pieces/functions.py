"""The functions of chapters 4 to 7, as the reader wrote them, against glassgpt's formulas.

Each is called as the book calls it, on a small model.py GPT (seeded, its logits spread so that
sampling and the last-token read make a difference) and the book's example inputs:
generate_text_simple and generate (the same seed before both: the same tokens must come out),
calc_loss_batch and calc_loss_loader (chapter 5: every position; chapter 6: the last token's
class), calc_accuracy_loader, custom_collate_fn (the book's three examples) and format_input.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ...config import GPTConfig
from ...generate import pick_next
from ...model import GPTModel
from ...prompt import format_prompt
from ...tokenizer import get_tokenizer
from .properties import Broken
from .report import PieceError, PieceResult, found, run_reader

PROMPT = "Hello, I am"  # the book's chapter 4 prompt
COLLATE_BATCH = [[0, 1, 2, 3, 4], [5, 6], [7, 8, 9]]  # the book's chapter 7 example
ENTRIES = [{"instruction": "Identify the correct spelling of the following word.", "input": "Ocassion",
            "output": "The correct spelling is 'Occasion.'"},
           {"instruction": "What is an antonym of 'complicated'?", "input": "",
            "output": "An antonym of 'complicated' is 'simple'."}]

MISTAKES = {
    "first_position": "it reads the logits of the first position, logits[:, 0, :]: the next token follows the "
                      "last one, logits[:, -1, :]",
    "temperature_after_softmax": "the temperature divides the probabilities after the softmax, where it changes "
                                 "nothing (multinomial renormalizes): divide the logits, softmax(logits / "
                                 "temperature)",
    "top_k_minus_1": "top-k keeps k - 1 tokens: keep every logit >= the k-th largest, "
                     "torch.where(logits < top_logits[:, -1], -inf, logits)",
    "not_flattened": "cross_entropy reads dim 1 of [b, t, V] logits as the classes: flatten both, "
                     "cross_entropy(logits.flatten(0, 1), target_batch.flatten())",
    "first_token": "it reads the first token's logits, model(input_batch)[:, 0, :]; the classifier was trained "
                   "on the last token, the only one that has seen the whole text: [:, -1, :]",
    "no_ignore_index": "the padding in the targets is left as 50256, so the loss learns to predict padding: "
                       "replace every padding token after the first with ignore_index (-100)",
    "first_eot_masked": "the first <|endoftext|> of each target is masked too, so the model never learns to end "
                        "its answer: keep the first padding token, mask only indices[1:]",
    "not_shifted": "the targets are the inputs, not shifted by one: targets = padded[1:]",
}


def book_model(num_classes: int | None = None, seed: int = 123, drop_rate: float = 0.0) -> GPTModel:
    """A small model.py GPT whose logits are spread (a random head gives near-uniform ones)."""
    cfg = GPTConfig(vocab_size=50257, context_length=8, emb_dim=32, n_heads=2, n_layers=1, drop_rate=drop_rate,
                    num_classes=num_classes, tie_embeddings=False)
    torch.manual_seed(seed)
    model = GPTModel(cfg).eval()
    with torch.no_grad():
        model.out_head.weight.mul_(40.0 if num_classes is None else 4.0)
    return model


# --- generation -----------------------------------------------------------------------------------

def generate_formula(model, idx: torch.Tensor, max_new_tokens: int, context_size: int, temperature: float = 0.0,
                     top_k: int | None = None, mistake: str | None = None) -> torch.Tensor:
    """The book's loop with glassgpt's pick_next (top-k cut, logits / temperature, softmax, multinomial)."""
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = model(idx[:, -context_size:])
        logits = logits[:, 0 if mistake == "first_position" else -1, :]
        k = top_k - 1 if mistake == "top_k_minus_1" and top_k else top_k
        t = 1.0 if mistake == "temperature_after_softmax" and temperature > 0 else temperature
        idx = torch.cat((idx, pick_next(logits, t, k).reshape(-1, 1)), dim=1)
    return idx


def check_generate(fn: Callable, kind: str) -> PieceResult:
    model = book_model()
    idx = torch.tensor([get_tokenizer("gpt2").encode(PROMPT)])
    ctx = model.cfg.context_length
    simple = kind == "generate_text_simple"
    settings = [dict(temperature=0.0, top_k=None)] if simple else \
        [dict(temperature=0.0, top_k=None), dict(temperature=0.5, top_k=None), dict(temperature=1.5, top_k=3)]
    n = 12
    result = PieceResult(kind, f"{PROMPT!r} ({idx.shape[1]} tokens), {n} new tokens, context_size {ctx}, "
                               f"a small model.py GPT, torch.manual_seed(123) before each run")
    for s in settings:
        def run(fn=fn, s=s):
            kwargs = {} if simple else s
            return fn(model, idx.clone(), max_new_tokens=n, context_size=ctx, **kwargs)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(123)
            got = run_reader(f"{kind}({_args(s, simple)})", run)

        def book(mistake=None, s=s):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(123)
                return generate_formula(model, idx.clone(), n, ctx, s["temperature"], s["top_k"], mistake)
        want = book()
        result.lines.append(f"{_args(s, simple)}: {'the same' if torch.equal(got, want) else 'other'} tokens")
        result.views.setdefault("runs", []).append({"settings": s, "reader": got.tolist(), "book": want.tolist()})
        if not torch.equal(got, want):
            mistakes = ["first_position"] + ([] if simple else ["temperature_after_softmax", "top_k_minus_1"])
            mistake = next((m for m in mistakes if _same_ids(got, book(m))), None)
            k = _first_token(got, want)
            result.stage, result.where, result.mistake = "tokens", f"new token {k - idx.shape[1]}", mistake
            what = (f"with {_args(s, simple)}, new token {k - idx.shape[1]} first differs: yours "
                    f"{_at(got, k)}, glassgpt's {_at(want, k)}")
            broken = prompt_kept(got, idx) or too_many(got, idx, n) or (
                greedy_pick(model, got, k, ctx, k - idx.shape[1]) if s["temperature"] == 0 else
                sampled_pick(model, got, k, ctx, k - idx.shape[1], s["top_k"]) or
                sampled_temperature(model, idx, got, n, ctx, s, k - idx.shape[1]))
            if broken is not None:
                return found(result, broken, mistake, MISTAKES)
            checked = ("the prompt kept, one token a turn, the argmax of the last position's logits" if
                       s["temperature"] == 0 else "the prompt kept, one token a turn, top-k, the temperature "
                       "fitted (0, 1, its inverse, its square)")
            result.finding = f"{what}: {MISTAKES[mistake]}" if mistake else \
                f"{what}; it keeps what was checked ({checked}), and no known mistake reproduces it: compare " \
                f"your loop with the book's generate"
            return result
    result.finding = f"{kind} picks the same tokens as glassgpt's formula" + \
        ("." if simple else ", greedy and sampled with the same seed.")
    return result


def greedy_pick(model, got: torch.Tensor, k: int, ctx: int, new: int) -> Broken | None:
    """Greedy decoding's property: token k is the argmax of the logits of the last position before it
    (the context cut to the last context_size tokens); else which position's argmax it is, if any."""
    if k >= got.shape[1]:
        return Broken("stops_early", "tokens", f"new token {new}", f"the loop stops after {new} new tokens: "
                      f"for _ in range(max_new_tokens) adds one token each turn")
    with torch.no_grad():
        logits = model(got[:, :k][:, -ctx:])  # [1, t, V]
    picks = logits[0].argmax(-1)  # each position's argmax
    token = int(got[0, k])
    if int(picks[-1]) == token:
        return None
    where = [p for p in range(picks.shape[0]) if int(picks[p]) == token]
    context = got[:, :k]
    crops = [(f"the first {ctx} tokens, idx[:, :context_size]", context[:, :ctx])] + \
        [(f"the last {c} tokens, not the last context_size = {ctx}", context[:, -c:]) for c in range(ctx - 1, 0, -1)]
    for said, crop in ([] if where else crops):
        if crop.shape[1] < context.shape[1] and not torch.equal(crop, context[:, -ctx:]):
            with torch.no_grad():
                if int(model(crop)[0, -1].argmax()) == token:
                    return Broken("context_crop", "tokens", f"new token {new}", f"new token {new} is {token}, the "
                                  f"argmax after the context is cut to {said}; the model reads the last "
                                  f"context_size tokens: idx_cond = idx[:, -context_size:]")
    said = (f"the argmax of position {where[0]}'s logits (of {picks.shape[0]})" if where else
            "the argmax of no position's logits")
    return Broken("greedy_argmax", "tokens", f"new token {new}", f"new token {new} is {token}, {said}; greedy "
                  f"decoding takes the argmax of the last position's, {int(picks[-1])}: "
                  f"torch.argmax(logits[:, -1, :], dim=-1)")


def prompt_kept(got: torch.Tensor, idx: torch.Tensor) -> Broken | None:
    """The output starts with the prompt: each new token is appended to idx, which is returned whole."""
    n = idx.shape[1]
    j = next((i for i in range(n) if i >= got.shape[1] or int(got[0, i]) != int(idx[0, i])), None)
    if j is None:
        return None
    yours = str(int(got[0, j])) if j < got.shape[1] else "nothing"
    return Broken("prompt_kept", "tokens", f"token {j} of the prompt", f"the output's token {j} is {yours} where the "
                  f"prompt's is {int(idx[0, j])}: generate returns the prompt followed by the new tokens, each "
                  f"appended to the context, idx = torch.cat((idx, idx_next), dim=1)")


def too_many(got: torch.Tensor, idx: torch.Tensor, n: int) -> Broken | None:
    """The loop adds max_new_tokens tokens, not more (fewer: greedy_pick's stops_early)."""
    extra = got.shape[1] - idx.shape[1] - n
    if extra <= 0:
        return None
    return Broken("new_tokens", "tokens", f"new token {n}", f"the output holds {n + extra} new tokens where "
                  f"max_new_tokens = {n}, the extra from new token {n} on: for _ in range(max_new_tokens) adds one "
                  f"token each turn")


def sampled_temperature(model, idx: torch.Tensor, got: torch.Tensor, n: int, ctx: int, s: dict,
                        new: int) -> Broken | None:
    """Sampling's temperature, fitted: the reader's tokens replayed with the same seed at the temperatures a
    slip gives (none, greedy, the inverse, the square); the one that gives them all is named."""
    temperature = s["temperature"]
    tries = [(1.0, "1: the temperature changes nothing"), (0.0, "0: greedy, the argmax, with no sampling"),
             (1 / temperature, f"{1 / temperature:g} = 1/{temperature:g}: the logits are multiplied by the "
                                f"temperature"),
             (temperature ** 2, f"{temperature ** 2:g} = {temperature:g}**2: the logits are divided by it twice")]
    for t, said in tries:
        if t == temperature:
            continue
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(123)
            ids = generate_formula(model, idx.clone(), n, ctx, t, s["top_k"])
        if _same_ids(ids, got):
            return Broken("temperature", "tokens", f"new token {new}", f"with temperature={temperature:g}, your "
                          f"tokens are those the same seed samples at temperature {said}; the formula divides the "
                          f"last position's logits by the temperature once, before the softmax: logits / "
                          f"temperature, then torch.multinomial(probs, num_samples=1)")
    return None


def sampled_pick(model, got: torch.Tensor, k: int, ctx: int, new: int, top_k: int | None) -> Broken | None:
    """Sampling's property that one seed can check: with top_k, token k is among the k largest logits of the
    last position before it."""
    if not top_k or k >= got.shape[1]:
        return None
    with torch.no_grad():
        logits = model(got[:, :k][:, -ctx:])[0, -1]
    token = int(got[0, k])
    rank = int((logits > logits[token]).sum())
    if rank < top_k:
        return None
    return Broken("top_k", "tokens", f"new token {new}", f"new token {new} is {token}, ranked {rank + 1} among the "
                  f"last position's logits, where top_k={top_k} keeps only the {top_k} largest: set the others to "
                  f"-inf before the softmax, torch.where(logits < top_logits[:, -1], -inf, logits)")


def _args(s: dict, simple: bool) -> str:
    return "greedy" if simple or s["temperature"] == 0 else \
        f"temperature={s['temperature']}" + (f", top_k={s['top_k']}" if s["top_k"] else "")


def _same_ids(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


def _first_token(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.shape[1], b.shape[1])
    diff = (a[:, :n] != b[:, :n]).any(0).nonzero()
    return int(diff[0]) if diff.numel() else n


def _at(ids: torch.Tensor, k: int) -> str:
    return str(ids[0, k].item()) if k < ids.shape[1] else "nothing (it stopped)"


# --- losses and accuracy ----------------------------------------------------------------------------

def lm_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The book's windows (max_length 4, stride 4) of its text, two batches of two."""
    from .data import BOOK_TEXT, book_windows
    ids = get_tokenizer("gpt2").encode(BOOK_TEXT)
    w = book_windows(ids, 4, 4)
    x, y = torch.tensor(w.inputs[:4]), torch.tensor(w.targets[:4])
    return [(x[:2], y[:2]), (x[2:], y[2:])]


def class_batches(model: GPTModel) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of random texts and labels on which reading the first token and the last give other
    accuracies (the first seed that does, so the two mistakes cannot look alike)."""
    for seed in range(100):
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(0, 50257, (16, 6), generator=g)
        y = torch.randint(0, 2, (16,), generator=g)
        with torch.no_grad():
            logits = model(x)
        if (logits[:, -1].argmax(-1) == y).sum() != (logits[:, 0].argmax(-1) == y).sum():
            return [(x[:8], y[:8]), (x[8:], y[8:])]
    raise AssertionError("no seed separates the first token from the last")


def loss_formula(model, x, y, chapter: int, mistake: str | None = None) -> torch.Tensor:
    with torch.no_grad():
        logits = model(x).double()
    if chapter == 6:
        return F.cross_entropy(logits[:, 0 if mistake == "first_token" else -1, :], y)
    if mistake == "not_flattened":
        return F.cross_entropy(logits, y)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def accuracy_formula(model, batches, mistake: str | None = None) -> float:
    right = seen = 0
    for x, y in batches:
        with torch.no_grad():
            logits = model(x)[:, 0 if mistake == "first_token" else -1, :]
        right += int((logits.argmax(-1) == y).sum())
        seen += len(y)
    return right / seen


def check_loss(fn: Callable, kind: str) -> PieceResult:
    """calc_loss_batch / calc_loss_loader: chapter 5's (every position) or chapter 6's (the last token's class)."""
    loader = kind == "calc_loss_loader"
    tries = []
    for chapter, model in ((5, book_model()), (6, book_model(num_classes=2))):
        batches = lm_batches() if chapter == 5 else class_batches(model)
        try:
            got = fn(batches, model, "cpu") if loader else fn(*batches[0], model, "cpu")
            got = float(got.detach() if torch.is_tensor(got) else got)
        except Exception as err:  # the reader's function on this chapter's batches
            got = err
        want = (sum(float(loss_formula(model, x, y, chapter)) for x, y in batches) / len(batches) if loader
                else float(loss_formula(model, *batches[0], chapter)))
        tries.append((chapter, model, batches, got, want))
        if isinstance(got, float) and abs(got - want) <= 1e-5 * abs(want):
            result = PieceResult(f"{kind} (chapter {chapter})", _fed(chapter, loader, batches),
                                 lines=[f"loss {got:.6f}, glassgpt's {want:.6f}"],
                                 finding=f"{kind} gives glassgpt's {'mean ' if loader else ''}cross-entropy "
                                         f"({'every position' if chapter == 5 else 'the last token'}).")
            broken = ignored_targets(fn, kind, model, batches, loader) if chapter == 5 else None
            if broken is not None:
                result.lines.append("the same batches with padding targets set to -100: another loss")
                return found(result, broken, None, MISTAKES)
            return result
    chapter, model, batches, got, want = next((t for t in tries if isinstance(t[3], float)), tries[0])
    result = PieceResult(f"{kind} (chapter {chapter})", _fed(chapter, loader, batches))
    result.stage = "loss"
    if isinstance(got, Exception):
        mistake = None
        try:
            loss_formula(model, *batches[0], chapter, "not_flattened")
        except Exception as err:
            mistake = "not_flattened" if type(err) is type(got) and str(err) == str(got) else None
        result.where = "the call"
        what = f"{kind} raised {type(got).__name__}: {str(got).splitlines()[0]}"
        if mistake is None:
            return found(result, Broken("runs", "loss", "the call", f"{what}, on chapter 5's batches ([b, t] "
                                        f"inputs and targets) and on chapter 6's ([b, t] inputs, [b] labels): it takes "
                                        f"(input_batch, target_batch, model, device) and returns the loss"), None,
                         MISTAKES)
    else:
        variants = {"first_token": lambda: loss_formula(model, *batches[0], chapter, "first_token")} \
            if chapter == 6 and not loader else {}
        mistake = next((m for m, fn_ in variants.items() if abs(float(fn_()) - got) <= 1e-5 * abs(got)), None)
        result.where = "the loss"
        what = f"the loss is {got:.6f}, glassgpt's {want:.6f}"
        result.lines.append(f"loss {got:.6f}, glassgpt's {want:.6f}")
        used = batches if loader else batches[:1]
        broken = loss_positions(model, used, got, chapter) or loss_count(model, used, got, chapter, loader) or \
            (loss_pairing(model, used, got) if chapter == 5 else None)
        if broken is not None:
            return found(result, broken, mistake, MISTAKES)
    result.mistake = mistake
    result.finding = f"{what}: {MISTAKES[mistake]}" if mistake else \
        f"{what}; it is no mean or sum of the cross-entropy over the positions checked (every position, the last, " \
        f"the first, all but the last or the first), over no other count, nor of targets paired in another order, " \
        f"and no known mistake reproduces it: compare with the book's {kind}"
    return result


def _cross_entropies(model, batches, chapter: int) -> list[torch.Tensor]:
    """Per batch, the cross-entropy at each position the formula averages over ([b, t], chapter 6 [b])."""
    per = []
    for x, y in batches:
        with torch.no_grad():
            logits = model(x).double()
        per.append(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape)
                   if chapter == 5 else F.cross_entropy(logits[:, -1], y, reduction="none"))
    return per


def loss_count(model, batches, got: float, chapter: int, loader: bool) -> Broken | None:
    """The mean's count: the summed cross-entropy divided by the number of positions it sums (the loader: the
    batch losses by the number of batches); the reader's divisor is fitted, and named when it is a whole number."""
    per = _cross_entropies(model, batches, chapter)
    n = per[0].numel()
    divisors = [("loader", sum(float(p.mean()) for p in per) / got, len(per))] if loader else []
    divisors.append(("batch", float(sum(float(p.sum()) for p in per) / len(per)) / got, n))
    for which, c, want in divisors:
        if abs(c - round(c)) > 1e-4 * max(c, 1) or round(c) == want or round(c) < 1:
            continue
        b, t = batches[0][0].shape
        if which == "loader":
            return Broken("loss_count", "loss", "the number of batches", f"the loss divides the sum of the "
                          f"{len(per)} batch losses by {round(c)}, not by the number of batches {len(per)}: "
                          f"total_loss / num_batches")
        what = f"the {b} x {t} positions" if chapter == 5 else f"the {b} examples' last positions"
        return Broken("loss_count", "loss", "the count", f"the loss divides the cross-entropy summed over {what} "
                      f"by {round(c)}, not by their count {want} (batch size {b}, {t} tokens a window): "
                      f"cross_entropy's mean, reduction='mean'")
    return None


def loss_pairing(model, batches, got: float) -> Broken | None:
    """Chapter 5's logits and targets flattened in the same order: position j of window i pairs with
    target [i, j]; the reader's loss matched against the targets read position by position instead."""
    value = 0.0
    for x, y in batches:
        with torch.no_grad():
            logits = model(x).double()
        if y.shape[0] == y.shape[1]:
            return None  # a square batch: its transpose is no other order to tell
        value += float(F.cross_entropy(logits.flatten(0, 1), y.transpose(0, 1).flatten()))
    if abs(value / len(batches) - got) > 1e-5 * abs(got):
        return None
    return Broken("loss_pairing", "loss", "window 0, position 1", f"the loss pairs the logits of window 0, "
                  f"position 1 with another window's target: the logits are flattened window by window, the "
                  f"targets position by position (target_batch.T); flatten both the same way, "
                  f"cross_entropy(logits.flatten(0, 1), target_batch.flatten())")


def ignored_targets(fn: Callable, kind: str, model, batches, loader: bool) -> Broken | None:
    """ignore_index: chapter 7 sets the padding targets to -100, which cross_entropy leaves out of the mean;
    the reader's loss on the same batches with the last two targets of window 1 set to -100."""
    masked = []
    for x, y in batches:
        y = y.clone()
        y[1, -2:] = -100
        masked.append((x, y))
    want = sum(float(loss_formula(model, x, y, 5)) for x, y in masked) / len(masked) if loader else \
        float(loss_formula(model, *masked[0], 5))
    try:
        got = fn(masked, model, "cpu") if loader else fn(*masked[0], model, "cpu")
        got = float(got.detach() if torch.is_tensor(got) else got)
    except Exception as err:  # the reader's function on targets holding -100
        got = err
    t = masked[0][1].shape[1]
    where = f"window 1, position {t - 2}"
    if isinstance(got, float) and abs(got - want) <= 1e-5 * abs(want):
        return None
    said = (f"it raises {type(got).__name__}: {str(got).splitlines()[0] if str(got) else ''}"
            if isinstance(got, Exception) else f"the loss is {got:.6f}, glassgpt's {want:.6f}")
    return Broken("ignore_index", "loss", where, f"with the targets of {where} and after set to -100 (chapter 7's "
                  f"padding), {said}: cross_entropy leaves the targets -100 out, its default ignore_index, and "
                  f"averages over the others; keep F.cross_entropy(logits.flatten(0, 1), target_batch.flatten())")


def loss_positions(model, batches, got: float, chapter: int) -> Broken | None:
    """Which positions the reader's loss averages over: the cross-entropy of each (window, position)
    is computed here, and the reader's number matched against the mean over each set of positions
    (chapter 5: every position of every window; chapter 6: the last position's class)."""
    per = []  # per batch: [b, t] cross-entropies (chapter 6: [b, t] against the label at every position)
    for x, y in batches:
        with torch.no_grad():
            logits = model(x).double()
        labels = y if chapter == 5 else y[:, None].expand(-1, logits.shape[1])
        per.append(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape))
    t = per[0].shape[1]
    sets = {"every position": slice(None), "the last position only": slice(t - 1, t),
            "the first position only": slice(0, 1), "every position but the last": slice(0, t - 1),
            "every position but the first": slice(1, t)}
    want = "every position" if chapter == 5 else "the last position only"
    for name, cut in sets.items():
        for how, reduce in (("averages", torch.mean), ("sums", torch.sum)):
            value = sum(float(reduce(p[:, cut])) for p in per) / len(per)
            if abs(value - got) <= 1e-5 * max(abs(got), 1e-12) and (name, how) != (want, "averages"):
                return Broken("loss_positions", "loss", name, f"the loss {how} the cross-entropy over {name} of "
                              f"each window (it equals that, {got:.6f}); chapter {chapter}'s averages over {want}" +
                              (": cross_entropy(logits.flatten(0, 1), target_batch.flatten())" if chapter == 5
                               else ": model(input_batch)[:, -1, :]"))
    return None


def _fed(chapter: int, loader: bool, batches) -> str:
    what = "the book's windows (max_length 4, stride 4)" if chapter == 5 else "random texts with labels 0/1"
    return f"{len(batches) if loader else 1} batch(es) of {what}, a small model.py GPT"


def check_accuracy(fn: Callable, kind: str) -> PieceResult:
    model = book_model(num_classes=2, drop_rate=0.5)  # dropout: a forward in training mode gives other numbers
    batches = class_batches(model)
    result = PieceResult(kind, "2 batches of 8 random texts with labels 0/1, a small model.py classifier "
                               "(drop_rate 0.5), given in eval mode")
    modes: list[bool] = []
    hook = model.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    try:
        got = float(run_reader(f"{kind}(loader, model, 'cpu')", lambda: fn(batches, model, "cpu")))
    finally:
        hook.remove()
        model.eval()
    want = accuracy_formula(model, batches)
    result.lines.append(f"accuracy {got:.4f}, glassgpt's {want:.4f}")
    if abs(got - want) <= 1e-9:
        result.finding = f"{kind} gives glassgpt's accuracy (the argmax of the last token's logits)."
        return result
    mistake = "first_token" if abs(got - accuracy_formula(model, batches, "first_token")) <= 1e-9 else None
    result.stage, result.where, result.mistake = "accuracy", "the accuracy", mistake
    what = f"the accuracy is {got:.4f}, glassgpt's {want:.4f}"
    if any(modes):
        k = modes.index(True)
        return found(result, Broken("eval_mode", "accuracy", f"batch {k}", f"{what}: the model runs in training mode "
                                    f"from batch {k} on (its forward sees model.training True), so dropout changes "
                                    f"the logits; the accuracy is measured in eval mode: model.eval() before the "
                                    f"loop"), mistake, MISTAKES)
    position = _accuracy_position(model, batches, got)
    if position is not None:
        return found(result, Broken("accuracy_position", "accuracy", f"position {position}", f"{what}: it is the "
                                    f"argmax accuracy of position {position}'s logits; the classifier reads the last "
                                    f"token's, model(input_batch)[:, -1, :]"), mistake, MISTAKES)
    broken = _accuracy_count(model, batches, got)
    if broken is not None:
        broken.words = f"{what}: {broken.words}"
        return found(result, broken, mistake, MISTAKES)
    result.finding = f"{what}: {MISTAKES[mistake]}" if mistake else \
        f"{what}; it keeps what was checked (eval mode, the argmax of one position's logits, the count of " \
        f"examples), and no known mistake reproduces it: compare with the book's calc_accuracy_loader"
    return result


def _accuracy_count(model, batches, got: float) -> Broken | None:
    """The accuracy's count: the right predictions (the last token's argmax) over the number of examples; the
    reader's divisor is fitted, and named when it is a whole number."""
    right = seen = 0
    for x, y in batches:
        with torch.no_grad():
            right += int((model(x)[:, -1, :].argmax(-1) == y).sum())
        seen += len(y)
    if got <= 0 or right == 0:
        return None
    c = right / got
    if abs(c - round(c)) > 1e-6 * c or round(c) == seen:
        return None
    return Broken("example_count", "accuracy", "the count", f"it is the {right} right predictions divided by "
                  f"{round(c)}, not by the number of examples {seen} ({len(batches)} batches of {len(batches[0][1])}): "
                  f"num_examples += predicted_labels.shape[0]")


def _accuracy_position(model, batches, got: float) -> int | None:
    """The position whose logits' argmax gives the reader's accuracy (not the last), if one does."""
    with torch.no_grad():
        logits = [(model(x), y) for x, y in batches]
    t, seen = logits[0][0].shape[1], sum(len(y) for _, y in logits)
    matches = [p for p in range(t - 1)
               if abs(sum(int((out[:, p].argmax(-1) == y).sum()) for out, y in logits) / seen - got) <= 1e-9]
    return matches[0] if len(matches) == 1 else None  # two positions alike would be a guess


# --- chapter 7 --------------------------------------------------------------------------------------

def collate_formula(batch, pad_token_id=50256, ignore_index=-100, allowed_max_length=None, mistake=None):
    """Pad each example with <|endoftext|> to the longest + 1; targets are the inputs shifted by one,
    their padding after the first <|endoftext|> set to ignore_index."""
    longest = max(len(item) + 1 for item in batch)
    inputs, targets = [], []
    for item in batch:
        padded = list(item) + [pad_token_id] * (longest - len(item))
        x, y = padded[:-1], list(padded[:-1] if mistake == "not_shifted" else padded[1:])
        first_pad = len(item) - (0 if mistake == "not_shifted" else 1)
        keep = first_pad if mistake == "first_eot_masked" else first_pad + 1
        if mistake != "no_ignore_index":
            y = y[:keep] + [ignore_index] * (len(y) - keep)
        if allowed_max_length is not None:
            x, y = x[:allowed_max_length], y[:allowed_max_length]
        inputs.append(x)
        targets.append(y)
    return torch.tensor(inputs), torch.tensor(targets)


def check_collate(fn: Callable, kind: str) -> PieceResult:
    runs: list[dict] = [{}, {"allowed_max_length": 4}]
    if "pad_token_id" in inspect.signature(fn).parameters:
        runs.append({"pad_token_id": 999})  # the padding token it is given, not 50256 written in
    result = PieceResult(kind, f"the book's batch {COLLATE_BATCH}, then again with " +
                         ", then ".join(f"{k}={v}" for r in runs[1:] for k, v in r.items()))
    for kwargs in runs:
        said = "".join(f", {k}={v}" for k, v in kwargs.items())
        got = run_reader(f"{kind}(batch{said})", lambda: fn([list(b) for b in COLLATE_BATCH], **kwargs))
        want = collate_formula(COLLATE_BATCH, **kwargs)
        result.views.setdefault("batches", []).append({"reader": [t.tolist() for t in got],
                                                       "book": [t.tolist() for t in want]})
        for part, g, w in (("inputs", got[0], want[0]), ("targets", got[1], want[1])):
            if g.shape != w.shape or not torch.equal(g.cpu(), w) or g.is_floating_point():
                mistake = next((m for m in ("no_ignore_index", "first_eot_masked", "not_shifted")
                                if all(torch.equal(a.cpu(), b) for a, b in
                                       zip(got, collate_formula(COLLATE_BATCH, mistake=m, **kwargs)))), None)
                broken = collate_broken(COLLATE_BATCH, got[0].cpu(), got[1].cpu(), kwargs.get("allowed_max_length"),
                                        kwargs.get("pad_token_id", 50256))
                if broken is not None:
                    return found(result, broken, mistake, MISTAKES)
                row, col = _first_cell(g, w)
                result.stage, result.where, result.mistake = part, f"row {row}, position {col}", mistake
                what = (f"the {part} first differ at row {row}, position {col}: yours {g.tolist()[row]}, "
                        f"the book's {w.tolist()[row]}")
                result.finding = f"{what}: {MISTAKES[mistake]}" if mistake else \
                    f"{what}; it keeps what was checked (integer ids, one row per example, the length, the " \
                    f"padding token, the shift by one, the first padding kept, -100 after it), and no known " \
                    f"mistake reproduces it: compare with the book's custom_collate_fn"
                return result
        result.lines.append(f"{kwargs or 'defaults'}: the book's inputs and targets")
    result.finding = f"{kind} pads with 50256, shifts the targets by one and masks the padding after the first " \
                     f"<|endoftext|> with -100, as the book's does."
    return result


def collate_broken(batch, inputs: torch.Tensor, targets: torch.Tensor, allowed_max_length: int | None,
                   pad_token_id: int = 50256, ignore_index: int = -100) -> Broken | None:
    """custom_collate_fn's properties on the reader's own batch, in the order the book writes them: one row
    per example, as long as the longest example (cut to allowed_max_length); each input row is its example
    then pad_token_id; each target row is the input shifted by one, its first padding token kept and every
    one after it ignore_index."""
    longest = max(len(item) for item in batch)
    length = longest if allowed_max_length is None else min(longest, allowed_max_length)
    for part, t in (("inputs", inputs), ("targets", targets)):
        if t.is_floating_point() or t.is_complex():
            return Broken("integer_ids", part, "the batch", f"the {part} are {str(t.dtype).removeprefix('torch.')}: "
                          f"token ids are whole numbers, torch.long (the embedding looks them up, cross_entropy "
                          f"reads the targets as class indices): torch.tensor(padded[:-1]) keeps them integers")
        if t.dim() != 2 or t.shape[0] != len(batch):
            return Broken("batch_shape", part, "the batch", f"the {part} are {list(t.shape)}: one row per "
                          f"example, [{len(batch)}, {length}], torch.stack(inputs_lst)")
        if t.shape[1] != length:
            cut = f", then cut to allowed_max_length={allowed_max_length}" if allowed_max_length else ""
            prop = "truncation" if allowed_max_length is not None and t.shape[1] > length else "padded_length"
            return Broken(prop, part, f"position {min(t.shape[1], length)}", f"the {part} are {t.shape[1]} long "
                          f"where they should be {length}: padded to the longest example ({longest} tokens){cut}"
                          + (", inputs[:allowed_max_length]" if prop == "truncation" else ""))
    for r, item in enumerate(batch):
        x, n = inputs[r].tolist(), len(item)
        for p in range(length):
            want = item[p] if p < n else pad_token_id
            if x[p] != want:
                prop, said = ("example", f"the example's own token {want}") if p < n else \
                    ("pad_id", f"the padding token {pad_token_id} (<|endoftext|>)")
                return Broken(prop, "inputs", f"row {r}, position {p}", f"input row {r} holds {x[p]} at position "
                              f"{p} where it should hold {said}: padded = item + [pad_token_id] * "
                              f"(longest - len(item)), inputs = padded[:-1]")
    for r, item in enumerate(batch):
        y, n = targets[r].tolist(), len(item)
        for p in range(length):
            if p < n - 1 and y[p] != item[p + 1]:
                k = next((j for j in range(-1, 3) if p + j < n and y[p] == item[p + j]), None)
                shown = "the input at the same position" if k == 0 else (
                    f"the example's token {p + k}" if k is not None else "no token of the example near it")
                return Broken("targets_shift", "targets", f"row {r}, position {p}", f"target row {r} holds {y[p]} "
                              f"at position {p}, {shown}; the targets are the inputs shifted by one, so it should "
                              f"be the next token {item[p + 1]}: targets = padded[1:]")
            if p == n - 1 and y[p] != pad_token_id:
                said = "it is masked with ignore_index" if y[p] == ignore_index else f"it holds {y[p]}"
                return Broken("first_pad_kept", "targets", f"row {r}, position {p}", f"target row {r} should keep "
                              f"the first padding token {pad_token_id} at position {p}, the end of its answer, but "
                              f"{said}: the model must learn to stop, so mask only the padding after it")
            if p >= n and y[p] != ignore_index:
                return Broken("ignore_index", "targets", f"row {r}, position {p}", f"target row {r} holds {y[p]} "
                              f"at position {p}, padding after the first {pad_token_id}, where it should hold "
                              f"ignore_index ({ignore_index}) so that the loss leaves it out: "
                              f"targets[indices[1:]] = ignore_index")
    return None


def _first_cell(g: torch.Tensor, w: torch.Tensor) -> tuple[int, int]:
    if g.shape != w.shape:
        return 0, min(g.shape[-1], w.shape[-1])
    cell = (g.cpu() != w).nonzero()[0]
    return int(cell[0]), int(cell[1])


def format_formula(entry: dict[str, Any]) -> str:
    """The book's format_input: glassgpt's Alpaca prompt without its response header."""
    return format_prompt(entry["instruction"], entry["input"]).removesuffix("\n\n### Response:\n")


def check_format(fn: Callable, kind: str) -> PieceResult:
    result = PieceResult(kind, "two of the book's entries, one with an input and one without")
    for entry in ENTRIES:
        got = run_reader(f"{kind}(entry)", lambda: fn(dict(entry)))
        want = format_formula(entry)
        if got != want:
            k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            which = "with an input" if entry["input"] else "without an input"
            result.stage, result.where = "text", f"character {k} of the entry {which}"
            result.finding = (f"the entry {which} first differs at character {k}: yours "
                              f"{got[max(0, k - 12):k + 12]!r}, the book's {want[max(0, k - 12):k + 12]!r}")
            return result
        result.lines.append(f"entry {'with' if entry['input'] else 'without'} an input: the book's text")
    result.finding = f"{kind} writes the book's Alpaca prompt, with and without an input."
    return result


CHECKS: dict[str, Callable[[Callable, str], PieceResult]] = {
    "generate_text_simple": check_generate, "generate": check_generate, "calc_loss_batch": check_loss,
    "calc_loss_loader": check_loss, "calc_accuracy_loader": check_accuracy, "custom_collate_fn": check_collate,
    "format_input": check_format,
}


def check_function(fn: Callable, kind: str) -> PieceResult:
    if kind not in CHECKS:
        raise PieceError(f"no check for the function {kind!r}")
    return CHECKS[kind](fn, kind)

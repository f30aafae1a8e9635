"""Generation: take the last position's logits, pick an id, append it, repeat.

    ids [b, t] -> model -> logits [b, 1, V] (last position only) -> pick -> id [b] -> append

Picking: temperature 0 is greedy (argmax); otherwise the logits, optionally cut to the
top-k ids, divided by the temperature, optionally cut to the smallest set whose
probability reaches top-p, then sampled with a seeded generator. With the same weights,
prompt, temperature, top-k and seed, that draws the very tokens the book's `generate`
draws after `torch.manual_seed(seed)` (tests/test_book.py), up to one difference: the
book stops *before* an `eos_id` and drops it, glassgpt keeps it as the last token.

By default the engine (`glassgpt.engine`; its TwinSteps for Qwen3 and Llama 3) runs the model
with a KV cache, so each step
feeds it one token; a model that keeps its cache inside its own modules (chapter 4's variants, the book
repository's `forward(ids, use_cache=True)` and `reset_kv_cache()`: `OwnCacheSteps`) decodes through that cache,
its forward in PyTorch, where and how far it reaches read from its description (kinds.describe); `use_cache=False` is the book's loop instead, the whole sequence
through the glass model at every step. Either way, when the sequence outgrows
`context_length` the model sees its last `context_length` tokens (a sliding window).
"""

from __future__ import annotations

import codecs
import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterable, Iterator, Sequence

import torch

from torch import nn

from .adopt import adopt, adopted_from
from .anatomy import Anatomy
from .engine import as_engine, pages
from .engine.decode import twin_steps
from .engine.hybrid_cache import cache_for
from .model import GPTModel
from .errors import GlassError, NonFiniteError, PromptError
from .kinds import describe
from .tokenizer import Tokenizer


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise GlassError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if not temperature >= 0:  # also refuses nan, which would make every probability nan
        raise GlassError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise GlassError(f"top_k must be a positive integer, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise GlassError(f"top_p must be in (0, 1], got {top_p}")


def glass_model(model: nn.Module) -> GPTModel:
    """The GPTModel itself: `model`, the one an Engine (compiled or not) runs, or a reader's module
    read in place (adopt.py); a Qwen3 or Llama 3 model (families/) as it is, or the glass model of one
    read in place from the book's or transformers' module."""
    return adopt(model)


@dataclass
class Timing:
    """Where a generate call's time went: the set-up apart from the decoding, so that a rate is the decoding's.

        timing = Timing()
        generate(model, ids, 50, timing=timing)
        timing.setup_s, timing.decode_rate        # e.g. 1.9 s, then 640 tokens/s

    load_s     reading the model (the caller's figure: the CLI times its load; 0 for a model already in memory)
    tune_s     making the engine and planning its decoding step: what autotune measures on this machine the
               first time (each kernel, the native step against the PyTorch forward), or reads from its cache
    prefill_s  the prompt through the model
    decode_s   the decoding steps, each new token after the first (which the prompt's logits give), with
               their picks; a refill of a full window is part of decoding
    decoded    how many tokens those steps made
    measured   the decisions this process measured ("step", "linear 768x768", ...); empty where every one
               was read from autotune's cache (a warm machine)
    clock      what is read for the seconds (a test gives a fake one)
    """

    load_s: float = 0.0
    tune_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decoded: int = 0
    measured: tuple[str, ...] = ()
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False, compare=False)

    @property
    def setup_s(self) -> float:
        """Seconds before the first decoding step: load, tune and prefill."""
        return self.load_s + self.tune_s + self.prefill_s

    @property
    def decode_rate(self) -> float | None:
        """Tokens per second of the decoding steps alone; None where none ran (a reply of one token)."""
        return self.decoded / self.decode_s if self.decoded and self.decode_s > 0 else None

    def to_dict(self) -> dict:
        return {"load_s": self.load_s, "tune_s": self.tune_s, "prefill_s": self.prefill_s, "setup_s": self.setup_s,
                "decode_s": self.decode_s, "decoded": self.decoded, "decode_tokens_per_s": self.decode_rate,
                "measured": list(self.measured)}


class GlassSteps:
    """generate's seams (prefill, decode_one) on the glass model itself over its own kv_cache(): Gemma 4, whose
    kv-shared layers keep no keys of their own (no twin or native step yet)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def prefill(self, ids: torch.Tensor, cache) -> torch.Tensor:
        cache.reset()
        return self.model(ids, cache, last_only=True)[:, -1]

    def prepare(self, cache) -> None:
        """Nothing to plan: the glass model decodes."""

    def decode_one(self, ids: torch.Tensor, cache) -> torch.Tensor:
        return self.model(ids[:, None], cache, last_only=True)[:, -1]

    def greedy(self, logits: torch.Tensor) -> None:
        return None


class OwnCache:
    """generate's view of a cache a model keeps inside its own modules: where it is (`pos`, the tokens fed since the
    last reset) and how far this call lets it go (`max_len`); the keys and values stay in the model's modules."""

    def __init__(self, model: nn.Module, max_len: int):
        self.model, self.max_len, self.pos = model, max_len, 0

    def reset(self) -> None:
        self.model.reset_kv_cache()
        self.pos = 0


class OwnCacheSteps:
    """generate's seams over a model with the book repository's cache API (chapter 4's variants): `forward(ids,
    use_cache=True)` feeds the tokens after those cached, `reset_kv_cache()` empties every module's cache. Its own
    forward decodes (the native step has no plan for what its description changes: engine/step.py's plan_of)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def prefill(self, ids: torch.Tensor, cache: OwnCache) -> torch.Tensor:
        cache.reset()
        logits = self.model(ids, use_cache=True)[:, -1]
        cache.pos = ids.shape[1]
        return logits

    def prepare(self, cache: OwnCache) -> None:
        """Nothing to plan: the model's own forward decodes."""

    def decode_one(self, ids: torch.Tensor, cache: OwnCache) -> torch.Tensor:
        logits = self.model(ids[:, None], use_cache=True)[:, -1]
        cache.pos += 1
        return logits

    def greedy(self, logits: torch.Tensor) -> None:
        return None


def keeps_own_cache(model: nn.Module) -> bool:
    """Whether `model` keeps its KV cache in its own modules, with the book repository's API (chapter 4's variants)."""
    return callable(getattr(model, "reset_kv_cache", None))


def reach(glass: nn.Module, anatomy: Anatomy | None = None) -> tuple[torch.device, int]:
    """The device `glass` computes on and the tokens it sees at once: its embedding's and its context_length, as its
    description (`anatomy`, else describe(glass)) names them."""
    anatomy = anatomy or describe(glass)
    return glass.get_submodule(anatomy.embedding.path).weight.device, anatomy.positions.context_length


def as_batch(ids: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(ids, dtype=torch.long, device=device)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise PromptError("the prompt is empty: give at least one token")
    return ids


def sampling_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None) -> torch.Tensor:
    """Logits `[b, V]` -> the probabilities `[b, V]` (float32) that sampling draws the next id from:
    the top-k cut, then the division by the temperature, then the top-p cut, then the softmax.
    Ids cut away have probability 0. Temperature 0 (greedy) draws nothing: give it 1 to see the
    softmax that greedy takes the largest of."""
    logits = logits.float()
    if top_k is not None and top_k < logits.shape[-1]:
        # Cut before dividing by the temperature, as the book's generate does: the same ids
        # survive either way, except where the division rounds two logits to one value.
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logits = logits / temperature
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop an id when the ids ranked above it already reach top_p (the first one always stays).
        drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


BROKEN_SCORES = ("the model's next-token scores are NaN or infinite, so no token can be picked: its weights are broken "
                 "(saved by a run that diverged?), or its dtype overflows (float16: try bfloat16 or float32)")


def checked(ids: torch.Tensor, finite: bool) -> torch.Tensor:
    """`ids`, greedy picks whose largest logits were `finite`; else NonFiniteError (no token comes from NaN scores)."""
    if not finite:
        raise NonFiniteError(BROKEN_SCORES)
    return ids


def pick_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
              top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Logits `[b, V]` -> next ids `[b]`: the largest (temperature 0), else drawn from `sampling_probs`."""
    if temperature == 0.0:
        # The first largest logit, as argmax gives it; `max` finds it 4x quicker in bfloat16 on
        # a CPU (argmax has no vectorized bfloat16 kernel there: ~180 us per step for gpt2).
        largest, ids = logits.max(dim=-1)  # a NaN anywhere makes it the largest: no token comes from NaN scores
        return checked(ids, bool(torch.isfinite(largest).all()))
    probs = sampling_probs(logits, temperature, top_k, top_p)
    try:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    except RuntimeError:  # "probability tensor contains either inf, nan or element < 0"
        if bool(torch.isfinite(probs).all()):
            raise
        if bool(torch.isfinite(logits).all()):  # finite scores, divided into infinities by the temperature
            raise GlassError(f"temperature {temperature:g} is so small that the scores divided by it overflow: use "
                             "0 for greedy, or a temperature of 1e-3 or more") from None
        raise NonFiniteError(BROKEN_SCORES) from None


@torch.inference_mode()
def stream(model: nn.Module, ids: torch.Tensor | Sequence[int], max_new_tokens: int,
           temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
           eos_id: int | None = None, seed: int | None = None, use_cache: bool = True,
           on_pick: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
           timing: Timing | None = None) -> Iterator[torch.Tensor]:
    """Yield the next ids `[b]` one step at a time (see `generate`).

    on_pick: called as on_pick(logits [b, V], next_id [b]) at each step, before the id is
    yielded, e.g. to show the candidates it was drawn from (`sampling_probs`); it must not
    draw from the random generator, so the ids stay those of a run without it.
    timing: a `Timing` whose set-up and decoding seconds this call adds to (the time the caller
    spends between two ids is not counted).
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    timing = timing if timing is not None else Timing(clock=_no_clock)
    clock = timing.clock
    start = clock()
    # a reader's module is read in place, checked once; a model read through its description as it is (chapter 4's
    # variants) comes back itself
    glass = adopt(model, ids, described=True)
    if hasattr(glass, "unshard"):  # sharded by FSDP: only its own forward gathers the weights
        use_cache = False
    anatomy = describe(glass)
    decoding = anatomy.decoding  # how its description says it runs over a cache (anatomy.DECODINGS)
    if use_cache and (decoding is None or decoding == "own_cache" and not keeps_own_cache(glass)):
        raise GlassError(f"{type(glass).__name__} names no cache glassgpt can run it over (no decoding in its "
                         "description, or no reset_kv_cache()): generate with use_cache=False")
    if use_cache:
        engine = (OwnCacheSteps(glass) if decoding == "own_cache" else GlassSteps(glass) if decoding == "kv_cache"
                  else twin_steps(glass) if decoding == "twin" else as_engine(glass if adopted_from(glass) else model))
    device, ctx = reach(glass, anatomy)
    prompt = as_batch(ids, device)
    if max_new_tokens == 0:
        return  # nothing to generate: no forward pass at all
    b, t = prompt.shape
    if use_cache and device.type == "cpu" and b * max_new_tokens >= pages.PAYS_AT and not glass.training \
            and getattr(engine, "compiled", None) is None:
        pages.move_to_large_pages(glass)  # a long run: the weights onto 2 MB pages (engine/pages.py)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)

    # One buffer for the whole sequence: appending writes in place, never concatenates.
    seq = torch.empty(b, t + max_new_tokens, dtype=torch.long, device=device)
    seq[:, :t] = prompt
    # The cache holds what this call can use, not a whole context: short replies stay cheap.
    # OLMo 3's and Tiny Aya's own kv_cache (a sliding layer keeps its window only); else a KVCache, or Qwen3.5's
    # HybridCache with its linear layers' states (cache_for)
    make_cache = (lambda b, max_len, **_: OwnCache(glass, max_len)) if decoding == "own_cache" else \
        glass.kv_cache if decoding == "kv_cache" else partial(cache_for, glass.cfg)
    cache = make_cache(b, max_len=min(ctx, t + max_new_tokens), device=device,
                       dtype=glass.tok_emb.weight.dtype) if use_cache else None
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    timing.tune_s += clock() - start  # the engine made (autotune's kernels measured or read), the cache allocated

    def last_logits(length: int) -> torch.Tensor:
        """Logits `[b, V]` after seq[:, :length]: one new token through the cache, else the window."""
        if cache is None:  # the book's loop: the last ctx tokens through the glass model
            return glass(seq[:, max(0, length - ctx):length])[:, -1]
        if length == t or cache.pos == cache.max_len:  # the prompt, or the window is full: refill
            return engine.prefill(seq[:, max(0, length - ctx):length], cache)
        return engine.decode_one(seq[:, length - 1], cache)

    def pick(logits: torch.Tensor) -> torch.Tensor:
        """The next ids `[b]`: greedy from the native step's own pick where it made these logits (found while
        they were in its cache: the same ids as `pick_next`'s), else `pick_next`."""
        found = engine.greedy(logits) if temperature == 0.0 and cache is not None else None
        if found is not None:
            return checked(found[0], all(math.isfinite(v) for v in found[1]))
        return pick_next(logits, temperature, top_k, top_p, generator)

    def first_ids() -> torch.Tensor:
        """The prompt's logits, the decoding step planned (set-up, timed apart), and the first new ids `[b]`."""
        start = clock()
        logits = last_logits(t)
        next_id = pick(logits)
        if on_pick is not None:
            on_pick(logits, next_id)
        timing.prefill_s += clock() - start
        if cache is not None and max_new_tokens > 1:
            start = clock()
            engine.prepare(cache)  # the native step's plan, and the first time on this machine its measurement
            choices = getattr(engine, "choices", None)
            timing.measured = tuple(sorted(choices.measured)) if choices is not None else ()
            timing.tune_s += clock() - start
        return next_id

    length = t
    for step in range(max_new_tokens):
        if step == 0:
            next_id = first_ids()  # [b]
        else:
            start = clock()
            logits = last_logits(length)
            next_id = pick(logits)  # [b]
            if on_pick is not None:
                on_pick(logits, next_id)
            timing.decode_s += clock() - start
            timing.decoded += 1
        if eos_id is not None:
            next_id = next_id.masked_fill(finished, eos_id)  # rows that ended keep emitting eos
            finished |= next_id == eos_id
        seq[:, length] = next_id
        length += 1
        yield next_id
        if step == max_new_tokens - 1 or (eos_id is not None and bool(finished.all())):
            return


def generate(model: nn.Module, ids: torch.Tensor | Sequence[int], max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             eos_id: int | None = None, seed: int | None = None, use_cache: bool = True,
             timing: Timing | None = None) -> torch.Tensor:
    """Extend `ids` (`[t]` or `[b, t]`, int64) by up to `max_new_tokens`; return `[b, t + n]` int64.

    temperature 0 is greedy; sampling with a `seed` is reproducible. Generation stops
    early once every row has produced `eos_id` (which is included). A prompt longer
    than `context_length` is kept whole in the output, but the model sees only its
    last `context_length` tokens. `timing`: a `Timing` this call fills, its set-up (the
    engine, the decoding step's measurement or plan, the prompt) apart from its decoding rate.
    """
    prompt = as_batch(ids, reach(adopt(model, described=True))[0])
    new = list(stream(model, prompt, max_new_tokens, temperature, top_k, top_p, eos_id, seed, use_cache,
                      timing=timing))
    if not new:
        return prompt
    return torch.cat([prompt, torch.stack(new, dim=1)], dim=1)


def _no_clock() -> float:
    """The clock of a call that nobody times: no reads of the system clock per token."""
    return 0.0


def decode_stream(tokenizer: Tokenizer, ids: Iterable[int]) -> Iterator[str]:
    """Text for a stream of ids, holding back bytes until they form whole characters.

    A GPT-2 token can end halfway through a multi-byte UTF-8 character (an emoji is
    often split over two or three tokens); printing each token on its own would show
    U+FFFD. The incremental decoder keeps the partial bytes until the rest arrive.
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for token_id in ids:
        text = decoder.decode(tokenizer.token_bytes(int(token_id)))
        if text:
            yield text
    tail = decoder.decode(b"", final=True)
    if tail:
        yield tail

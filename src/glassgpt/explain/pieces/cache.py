"""The reader's KV cache, checked against the same model without it.

A cache must change nothing: the logits of token j fed alone after tokens 0..j-1 (cached) equal
row j of the logits of the whole prompt fed at once (uncached). The prompt is fed token by token,
twice (reset_kv_cache() between the runs), and at the first step that parts from the uncached
logits the properties a cache keeps are read off the reader's own tensors:

  the keys     step j's new token reads j + 1 keys (more: the cache was not emptied, or keys are added
               twice; fewer: it was trimmed); min(j + 1, W) where the model's description (glassgpt.describe)
               gives its first layer a window of W (sliding-window attention), or a single attention keeps
               one (sliding_window_size, chapter 4's SWA): more, the cache is not trimmed to the window;
               fewer, it is trimmed too far; a key counts where the new token puts weight on it (a sliding
               cache may keep one more, masked); past the first layer, each softmax attention the description
               names is counted the same way, the first wrong one named by its path;
  the mask     it puts weight on every one of them (a zero on an earlier position: the causal mask is
               not offset by the cache's length);
  the counter  a position counter (current_pos, ptr_current_pos) reads j + 1 after step j, 0 after
               reset_kv_cache();
  the state    in a model with linear attentions (Qwen3.5's Gated DeltaNet, as its description says), keys,
               mask and counter right: their state and the convolution's last inputs not carried from step to step;
  positions    otherwise the new token is embedded or turned at another position than its own.

A model's blocks are trf_blocks or blocks (the Gemma and OLMo notebooks' name); its cfg a dict or a dataclass.

The book's two cache APIs are known: chapter 4's gpt_with_kv_cache (forward(idx, use_cache=True),
reset_kv_cache()) and llms_from_scratch.kv_cache's (forward(idx, cache=KVCache(n_layers)), with
use_cache=True too where forward takes it, and reset_kv_cache() where the model has it).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ...errors import GlassError
from ...kinds import describe
from .attention import _Softmaxes
from .properties import Broken, attention_rows
from .report import PieceError, PieceResult, found, run_reader

LOOKED_FOR = ("forward(idx, use_cache=True) with reset_kv_cache() (chapter 4's gpt_with_kv_cache), or "
              "forward(idx, cache=KVCache(n_layers)) (llms_from_scratch.kv_cache)")
COUNTERS = ("current_pos", "ptr_current_pos")
STEPS = 8  # tokens fed one at a time


class KVCache:
    """The book's KVCache (llms_from_scratch.kv_cache.utils): one slot per layer, get / update / reset."""

    def __init__(self, n_layers: int):
        self.cache: list[Any] = [None] * n_layers

    def get(self, layer_idx: int) -> Any:
        return self.cache[layer_idx]

    def update(self, layer_idx: int, value: Any) -> None:
        self.cache[layer_idx] = value

    def get_all(self) -> list[Any]:
        return self.cache

    def reset(self) -> None:
        self.cache = [None] * len(self.cache)


def _forward_params(model: nn.Module) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def has_cache_api(model: Any) -> bool:
    """Whether `model` is a whole model with one of the book's cache APIs (a one-line PieceError, naming
    what was looked for, when it has a cache of another kind)."""
    if not isinstance(model, nn.Module) or type(model).__module__.startswith("transformers"):
        return False
    if type(model).__module__.startswith(("glassgpt.model", "glassgpt.families")):
        return False  # glassgpt's glass models keep glassgpt's KVCache (engine/cache.py), not the book's: checked whole

    params = _forward_params(model)
    if ("use_cache" in params and hasattr(model, "reset_kv_cache")) or "cache" in params:
        return True
    hints = sorted(p for p in params if "cache" in p or p.startswith("past")) + sorted(
        m for m in vars(type(model)) if "cache" in m.lower() and callable(getattr(model, m, None)))
    if hints:
        raise PieceError(f"{type(model).__name__} has a cache ({', '.join(hints)}) but not the book's API: glassgpt "
                         f"looked for {LOOKED_FOR}")
    return False


def has_attention_cache(att: Any) -> bool:
    """A chapter-4 attention with the book's cache: forward(x, use_cache=...) and reset_cache() (or a
    forward(x, use_cache, start_pos, cache) that returns its next cache, llms_from_scratch.kv_cache.gpt2's)."""
    if not isinstance(att, nn.Module) or not hasattr(att, "W_query"):
        return False
    params = _forward_params(att)
    return "use_cache" in params and (hasattr(att, "reset_cache") or "cache" in params)


class _AttentionAsModel:
    """One attention module driven like a cached model: its outputs stand for the logits."""

    def __init__(self, att: nn.Module):
        self.att, self.next = att, None
        self.passes_cache = "cache" in _forward_params(att)

    def __call__(self, x: torch.Tensor, cached: bool, start: int) -> torch.Tensor:
        kwargs: dict[str, Any] = {"use_cache": cached}
        if self.passes_cache:
            kwargs.update(start_pos=start if cached else 0, cache=self.next if cached else None)
        out = self.att(x, **kwargs)
        if isinstance(out, tuple):
            out, nxt = out[0], out[1]
            self.next = nxt if cached else self.next
        return out.detach()

    def reset(self) -> None:
        self.next = None
        if hasattr(self.att, "reset_cache"):
            self.att.reset_cache()


def check_attention_cache(att: nn.Module, steps: int = 6) -> PieceResult:
    """A cached attention fed torch.rand(1, steps, d_in) one row at a time, twice (reset between), against
    all rows at once without its cache."""
    d_in = att.W_query.in_features
    xs = [torch.rand(1, steps, d_in, generator=torch.Generator().manual_seed(seed)) for seed in (123, 124)]
    drive = _AttentionAsModel(att)
    result = PieceResult("KV cache", f"torch.rand(1, {steps}, {d_in}) (seed 123), one row at a time through your "
                                     f"cache, then seed 124's after a reset, against all rows at once without it")
    was = att.training
    att.eval()
    fulls, runs = [], []
    try:
        with torch.no_grad():
            for x in xs:
                drive.reset()
                fulls.append(run_reader(f"{type(att).__name__}.forward without a cache",
                                        lambda: drive(x, False, 0))[0].double())
            for x in xs:
                drive.reset()
                runs.append(run_reader(f"{type(att).__name__}.forward with a cache", lambda: _attention_run(att, drive, x)))
        drive.reset()
    finally:
        att.train(was)
    return _judge_runs(result, fulls, runs, steps, "rows")


def _attention_run(att: nn.Module, drive: _AttentionAsModel, x: torch.Tensor) -> list[dict[str, Any]]:
    steps = []
    for j in range(x.shape[1]):
        mode = _Softmaxes()
        try:
            with mode:
                out = drive(x[:, j:j + 1], True, j)
        except Exception as err:  # the reader's cached step itself fails: kept, to be named at its step
            if j == 0:
                raise
            steps.append({"error": err})
            return steps
        weights = mode.used[0] if mode.used else (mode.seen[0][1] if mode.seen else None)
        steps.append({"logits": out[0, -1].double(), "weights": weights, "counters": _counters(att),
                      "window": _attention_window(att), "where": ""})
    return steps


WINDOW_NAMES = ("sliding_window_size", "sliding_window", "window_size")  # the repository's SWA, the notebooks'


def _attention_window(att: nn.Module) -> int | None:
    """The window of one sliding-window attention, by the attribute the book's code keeps it in (None: full)."""
    return next((v for v in (getattr(att, n, None) for n in WINDOW_NAMES)
                 if isinstance(v, int) and not isinstance(v, bool)), None)


def _n_layers(model: nn.Module) -> int:
    cfg = getattr(model, "cfg", None)
    if isinstance(cfg, dict) and "n_layers" in cfg:
        return int(cfg["n_layers"])
    if isinstance(getattr(cfg, "n_layers", None), int):  # a config dataclass (a port over a glass model)
        return cfg.n_layers
    return len(blocks_of(model))


def blocks_of(model: nn.Module) -> nn.ModuleList | None:
    """The model's blocks: trf_blocks (GPT-2, Qwen3, Llama, Tiny Aya, Qwen3.5) or blocks (the Gemma and OLMo
    notebooks' name); None for neither."""
    return getattr(model, "trf_blocks", None) if hasattr(model, "trf_blocks") else getattr(model, "blocks", None)


def _call(model: nn.Module, idx: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
    """The reader's forward, cached (cache given) or not, as its API wants it: the logits."""
    params = _forward_params(model)
    kwargs: dict[str, Any] = {}
    if "use_cache" in params:
        kwargs["use_cache"] = cache is not None
    if "cache" in params:
        kwargs["cache"] = cache
    out = model(idx, **kwargs)
    return (out[0] if isinstance(out, tuple) else out).detach()


def _counters(model: nn.Module) -> dict[str, int]:
    found_ = {}
    for path, module in model.named_modules():
        for name in COUNTERS:
            value = getattr(module, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                found_[f"{path}.{name}" if path else name] = value
    return found_


def _reset(model: nn.Module) -> None:
    if hasattr(model, "reset_kv_cache"):
        model.reset_kv_cache()


def _first_window(model: nn.Module) -> int | None:
    """The window of the first layer's attention (whose weights a cached run reads), as the model's description
    says; None for full attention or a model glassgpt does not describe."""
    try:
        return describe(model).blocks[0].attention.window
    except GlassError:
        return None


def _keys_read(w: torch.Tensor) -> int:
    """The keys the last query puts weight on in any head: a key the mask hides (weight 0) is not read."""
    return int((w[..., -1, :] > 0).reshape(-1, w.shape[-1]).any(0).sum())


def _attention_layers(model: nn.Module) -> list[tuple[str, int | None]]:
    """(path, window) of each softmax attention, in order, as the model's description says; [] for none known."""
    try:
        return [(b.attention.path, b.attention.window) for b in describe(model).blocks
                if getattr(b.attention, "state", None) is None]
    except GlassError:
        return []


def _linear_layers(model: nn.Module) -> list[str]:
    """The paths of the model's linear attentions (Qwen3.5's Gated DeltaNet), which keep a recurrent state and
    the convolution's last inputs in place of keys and values, as its description says; [] for none."""
    try:
        return [b.attention.path for b in describe(model).blocks if getattr(b.attention, "state", None) is not None]
    except GlassError:
        return []


def _cached_run(model: nn.Module, ids: torch.Tensor) -> list[dict[str, Any]]:
    """Each step: the logits of the one token fed, the first attention's weights, the counters after it."""
    _reset(model)
    cache = KVCache(_n_layers(model)) if "cache" in _forward_params(model) else None
    window, linear, layers, steps = _first_window(model), _linear_layers(model), _attention_layers(model), []
    for j in range(ids.shape[1]):
        mode = _Softmaxes()
        try:
            with torch.no_grad(), mode:
                logits = _call(model, ids[:, j:j + 1], cache if cache is not None else KVCache(0))
        except Exception as err:  # the reader's cached step itself fails: kept, to be named at its step
            if j == 0:
                raise
            steps.append({"error": err})
            return steps
        weights = mode.used[0] if mode.used else (mode.seen[0][1] if mode.seen else None)
        attentions = [out for _, out in mode.seen if out.dim() == 4]  # a router's softmax is [b, t, experts]
        read = [(path, w, _keys_read(a)) for (path, w), a in zip(layers, attentions)] \
            if len(attentions) == len(layers) else []  # each attention layer's keys, where they pair one to one
        steps.append({"logits": logits[0, -1].double(), "weights": weights, "counters": _counters(model),
                      "window": window, "linear": linear, "layers": read})
    return steps


def check_cache(model: nn.Module, text: str | None = None, ids: list[int] | None = None) -> PieceResult:
    """Feed the prompt token by token through the reader's cache, twice, against the uncached logits."""
    vocab = model.tok_emb.num_embeddings
    if ids is None:
        ids = [b % vocab for b in (text or "Every effort moves you").encode("utf-8")]
    ids = ids[:STEPS]
    # The second run feeds other tokens: a cache left full by the first would otherwise hold the same keys.
    batches = [torch.tensor([p], device=model.tok_emb.weight.device) for p in (ids, [(i + 1) % vocab for i in ids])]
    result = PieceResult("KV cache", f"{len(ids)} tokens ({' '.join(map(str, ids))}), one at a time through your "
                                     f"cache, then each + 1 after reset_kv_cache(), against all at once without it")
    was = model.training
    model.eval()
    try:
        fulls = []
        for batch in batches:
            _reset(model)
            with torch.no_grad():
                fulls.append(run_reader(f"{type(model).__name__}.forward without a cache",
                                        lambda: _call(model, batch, None))[0].double())
        runs = [run_reader(f"{type(model).__name__}.forward with a cache", lambda: _cached_run(model, batches[0]))]
        if not _judge_runs(result, fulls[:1], runs, len(ids), "logits").ok:
            return result  # the first run already parts: named there
        _reset(model)
        left = {k: v for k, v in _counters(model).items() if v}
        if left:  # a counter reset_kv_cache() leaves where the first run put it: the second run cannot be right
            return found(result, _counter_left(model, left), None, {})
        runs.append(run_reader(f"{type(model).__name__}.forward with a cache, after reset_kv_cache()",
                               lambda: _cached_run(model, batches[1])))
        _reset(model)
    finally:
        model.train(was)
    return _judge_runs(result, fulls, runs, len(ids), "logits", first_run=1)


def _counter_left(model: nn.Module, left: dict[str, int]) -> Broken:
    counters = ", ".join(f"{k} is {v}" for k, v in left.items())
    start = next(iter(left.values()))
    if not hasattr(model, "reset_kv_cache"):
        return Broken("cache_reset", "cache", "step 0 of run 2", f"{type(model).__name__} has no reset_kv_cache(), "
                      f"so after a prompt the position counter stays where it ended ({counters}) and a second prompt "
                      f"starts at position {start}: add reset_kv_cache() setting it back to 0, as the book's "
                      f"generate calls it before each prompt")
    return Broken("cache_reset", "cache", "step 0 of run 2 (after reset_kv_cache())", f"after reset_kv_cache() the "
                  f"position counter {counters}, not 0: reset_kv_cache() must set it back to 0 (and empty the cached "
                  f"keys and values), or a second prompt starts at position {start}")


def _judge_runs(result: PieceResult, fulls: list[torch.Tensor], runs: list[list[dict]], n: int, what: str,
                first_run: int = 0) -> PieceResult:
    """The first step of the runs from `first_run` on whose output parts from its uncached row, and why (_why)."""
    for r, (run, full) in list(enumerate(zip(runs, fulls)))[first_run:]:
        tol = 1e-4 * float(full.abs().max())
        for j, step in enumerate(run):
            if "error" in step:
                result.lines.append(f"run {r + 1}, step {j}: the cached forward failed")
                return found(result, _failed_step(step["error"], j, r), None, {})
            diff = float((step["logits"] - full[j]).abs().max())
            if diff > tol:
                result.lines.append(f"run {r + 1}, step {j}: the cached {what} differ by {diff:.3g} from the "
                                    f"uncached row {j}")
                return found(result, _why(run, j, r), None, {})
        result.lines.append(f"run {r + 1}: every step's {what} equal the uncached ones (within {tol:.2g})")
    result.finding = (f"your cache changes nothing: each of the {n} steps fed alone gives the {what} of its row "
                      f"without a cache, in both runs (the cache reset between them, the second on other inputs).")
    return result


def _failed_step(err: Exception, j: int, r: int) -> Broken:
    """A cached step after the first that raises: with a shape that does not broadcast, the mask's slice."""
    where = f"step {j} of run {r + 1}"
    text = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    if "broadcast" in text or "shape" in text or "size" in text:
        return Broken("mask_shape", "cache", where, f"at {where} (one new token, {j + 1} keys) your forward fails "
                      f"({text}): the mask must be [num_tokens, num_keys], the rows of the new queries and a column "
                      f"for every cached key: mask[start_pos:start_pos + num_tokens, :start_pos + num_tokens]")
    return Broken("cached_step_fails", "cache", where, f"at {where} your forward fails with the cache ({text}), "
                  f"where step 0 ran: the cached keys and values, or their mask, do not fit the new token's")


def _why(run: list[dict], j: int, r: int) -> Broken:
    step = run[j]
    where = f"step {j} of run {r + 1}" + (" (after reset_kv_cache())" if r else "")
    w = step["weights"]
    if r == 1 and j == 0 and w is not None and w.shape[-1] > 1:  # (a counter left behind is caught before run 2)
        return Broken("cache_reset", "cache", where, f"at {where} the cache still holds the first run "
                      f"({w.shape[-1] - 1} keys): reset_kv_cache() must empty the cached keys and values and set "
                      f"the position counter back to 0")
    window = step.get("window")
    if w is not None and window is not None and _keys_read(w) != min(j + 1, window):
        s, want = _keys_read(w), min(j + 1, window)
        words = ("more than its window holds: the cache is not trimmed to the window; keep only the last "
                 f"{window} keys and values after each step" if s > want else
                 f"fewer than its window holds: the cache is trimmed too far; keep the last {window} keys and values "
                 f"(the new token sees itself and the {window - 1} before it)")
        return Broken("window_trimming", "cache", where, f"at {where} the new token (position {j})"
                      f"{step.get('where', ' of the first layer')}, whose window is {window}, reads {s} keys where it "
                      f"should read {want}, {words}")
    if w is not None and window is None:
        s = w.shape[-1]
        if s != j + 1:
            how = "more" if s > j + 1 else "fewer"
            words = ("keys are added to the cache twice, or it is never emptied" if s > j + 1 else
                     "the cache is trimmed: keep every key up to context_length (or the window)")
            return Broken("cache_length" if s > j + 1 else "window_trimming", "cache", where,
                          f"at {where} the new token (position {j}) reads {s} keys, {how} than the {j + 1} positions "
                          f"so far: {words}")
        broken = attention_rows(w[..., -1:, :], True, offset=j)
        if broken is not None:
            if broken.prop == "reads_its_past":
                return Broken("mask_offset", "cache", where, f"at {where} the new token (position {j}) "
                              f"{broken.words.split(') ', 1)[1].split(':')[0]}: the causal mask is not offset by the "
                              f"cache's length; take rows start_pos .. start_pos + num_tokens of it, "
                              f"mask[start_pos:start_pos + num_tokens, :start_pos + num_tokens]")
            return Broken(broken.prop, "cache", where, f"at {where}: {broken.words}")
    for path, layer_window, read in step.get("layers", [])[1:]:  # the first layer's keys are judged above
        want = j + 1 if layer_window is None else min(j + 1, layer_window)
        if read != want:
            kind = "full" if layer_window is None else f"sliding (window {layer_window})"
            words = ("its cache is trimmed: a full layer keeps every key" if layer_window is None and read < want else
                     "its cache is trimmed too far" if read < want else
                     "keys are added to its cache twice, or it is not trimmed to its window")
            return Broken("cache_length" if read > want else "window_trimming", "cache", where,
                          f"at {where} the new token (position {j}) reads {read} keys in {path}, a {kind} layer, "
                          f"where it should read {want}: {words} (the first layer's cache is right)")
    wrong = {k: v for k, v in step["counters"].items() if v != j + 1}
    if wrong:
        k, v = next(iter(wrong.items()))
        return Broken("position_counter", "cache", where, f"after {where} the position counter {k} is {v}, not "
                      f"{j + 1} (the tokens fed so far): advance it by the tokens of each call, "
                      f"current_pos += num_tokens, and start the next call's positions there")
    if step.get("linear"):  # keys, mask and counter right: what a linear layer carries, or the position
        layers = ", ".join(step["linear"])
        return Broken("linear_state", "cache", where, f"at {where} the full layers' cache holds the right {j + 1} "
                      f"keys, the mask hides none of them and the counter is right, yet the logits differ: the "
                      f"linear attentions ({layers}) must carry their state and the convolution's last inputs from "
                      f"step to step (each step reads what the one before wrote, none after reset_kv_cache()); "
                      f"else the new token is turned at another position than {j} (apply_rope's offset)")
    return Broken("position", "cache", where, f"at {where} the cache holds the right {j + 1} keys and the mask "
                  f"hides none of them, yet the logits differ: the new token is embedded or turned at another "
                  f"position than {j} (pass start_pos to the position embedding or to apply_rope's offset)")

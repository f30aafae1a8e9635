"""The engine: the glass model's own forward on fused kernels with a KV cache, and the decoding seam.

    Engine(model)(ids, cache, last_only=True) -> logits [b, 1, V]
    engine.prefill(ids [b, t], cache)         -> logits [b, V] after the prompt (the cache refilled)
    engine.decode_one(ids [b], cache)         -> logits [b, V] after one more token
    engine.greedy(logits)                     -> the native step's own greedy pick of its logits, or None
    engine.decode_n(ids [b], cache, n, pick)  -> the next n ids, each picked from decode_one's logits

The seam is gpt-fast's (`prefill`, `decode_one_token`, `decode_n_tokens`): generate.stream calls
it and only samples. `decode_one` runs the native step (step.py: one C++ call for the whole
model) where autotune.py measured it faster on this machine and it covers the model; else the
forward below, one token through the cache.

`Engine` holds a `GPTModel` and its fused twin (fused.py), which shares its weights, so
int8 layers swapped into the model (int8.py) run here too. The forward pass is
GPTModel.forward itself; what the engine adds around it:
  - a `KVCache` (cache.py): keys and values of earlier tokens, so a decoding step feeds one token;
  - the fused kernels, and `attention.attend` in place of the book's attention;
  - the matrix-vector kernels and attention paths that autotune.py measured fastest on this CPU;
  - `compile_for_generation`: torch.compile with the options that measured fastest.
tests/test_engine.py proves it equal to `GPTModel.forward`.
"""

from __future__ import annotations

import types
import warnings
import weakref
from typing import Callable, Iterator

import torch
from torch import nn

from ..config import GPTConfig
from ..errors import KernelWarning
from ..kinds import describe
from ..model import GPTModel
from . import autotune, compiling, native
from .cache import KVCache
from .experts import one_token_experts
from .fused import fused
from .graphs import GraphStep
from .graphs import why_not as why_no_graph
from .int8 import is_quantized
from .linear import GemvLinear
from .linear_attention import one_token_linear_attention
from . import step as plans
from .step import PlannedStep, stamp

_said: set[str] = set()  # the reasons a native step or CUDA graph did not run, each said once per process


class Engine(nn.Module):
    """A GPTModel's forward pass on its fused twin (fused.py), with the KV cache and `last_only`.

    `Engine(model)(ids, cache, last_only=True)` is `model(ids, cache, last_only=True)`: the
    glass model's own GPTModel.forward and blocks, with the fused kernels in place of the
    book's LayerNorm, GELU and attention, on the same weights (the engine has none of its
    own). The twin takes the model's train/eval mode when the Engine is made.
    """

    compiled = None  # compile_for_generation's torch.compile of `run`
    use_graphs = True  # on a GPU, decode through a CUDA graph (graphs.py) where it covers the model

    def __init__(self, model: GPTModel):
        super().__init__()
        self.model = model
        self.fast = fused(model)
        self.choices = autotune.tune(self.fast)  # the kernels measured fastest here (None off the CPU)
        self.step: PlannedStep | None = None  # the native step over the last cache decode_one was given
        self.declined: weakref.ref | None = None  # the cache the native step was found not to run on
        self.graphs: dict[tuple, GraphStep | None] = {}  # on a GPU: the recorded step per (batch, length, dtype)

    @property
    def cfg(self) -> GPTConfig:
        return self.model.cfg

    def forward(self, in_idx: torch.Tensor, cache: KVCache | None = None, last_only: bool = False) -> torch.Tensor:
        """Token ids `[b, t]` (int64) -> logits `[b, t, V]` (`[b, 1, V]` with `last_only`).

        With a `cache`, `in_idx` holds only the new tokens, placed at positions
        `cache.pos ...`, and the cache advances by t.
        """
        return (self.compiled or self.run)(in_idx, cache, last_only)

    def run(self, in_idx: torch.Tensor, cache: KVCache | None, last_only: bool) -> torch.Tensor:
        """`forward` in PyTorch: GPTModel.forward on the fused twin."""
        return self.fast(in_idx, cache, last_only)

    def prefill(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The prompt `[b, t]` through an emptied `cache` -> the last position's logits `[b, V]`."""
        cache.reset()
        return self(ids, cache, last_only=True)[:, -1]

    def prepare(self, cache: KVCache) -> None:
        """Plan the decoding step over `cache` before the first new token (generate times it as set-up): on the
        CPU the native step where it covers the model and autotune chose it (measured once on this machine,
        then read from autotune's cache by every later process)."""
        if cache.k[0].device.type == "cpu":
            self.native_step(cache)

    def decode_one(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One new token per row, `[b]` at `cache.pos` -> its logits `[b, V]` (the cache advances by one).

        The native step's logits are float32 in a buffer that the next step overwrites."""
        step = self.native_step(cache) if cache.k[0].device.type == "cpu" else self.graph_step(cache)
        if step is not None:
            return step(ids)
        return self(ids[:, None], cache, last_only=True)[:, -1]

    def greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, list[float]] | None:
        """The native step's own greedy pick of `logits` where it made them: the ids `[b]` and each row's largest
        logit (step.py's PlannedStep.greedy); None where the logits came from elsewhere."""
        return self.step.greedy(logits) if self.step is not None else None

    def decode_n(self, ids: torch.Tensor, cache: KVCache, n: int,
                 pick: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[torch.Tensor]:
        """The next `n` ids `[b]` after `ids` `[b]`, each `pick(logits)`; stops where the cache is full."""
        for _ in range(min(n, cache.max_len - cache.pos)):
            ids = pick(self.decode_one(ids, cache))
            yield ids

    def native_step(self, cache: KVCache) -> PlannedStep | None:
        """The native step over `cache`, where autotune chose it here and it covers this model; else None
        (decided once per cache: the steps of a generate call that the PyTorch engine runs ask nothing again)."""
        step = self.step
        if step is not None and not step.stale():
            if step.cache is cache:
                return step
            if step.takes(cache) and step.stamp == stamp(self.model):
                step.point_at(cache)  # the next generate call's cache, of the same shape: the plan moves onto it
                return step
        if step is None and self.declined is not None and self.declined() is cache:
            return None
        self.step = None
        reason = plans.why_not(self.model, cache)
        if reason is None and self.choices is not None and autotune.native_step_chosen(self, cache):
            self.step = plans.native_step(self.model, cache)
        elif reason is not None and cache.k[0].device.type == "cpu" and \
                "kernels are not available" not in reason:  # that one native.py says
            say_once("native decoding step", reason)
        self.declined = weakref.ref(cache) if self.step is None else None
        return self.step

    def graph_step(self, cache: KVCache) -> GraphStep | None:
        """The CUDA graph of the decoding step over `cache` (graphs.py), recorded once per batch size and cache
        length; None where it does not cover the model or recording failed (said once), or `use_graphs` is off."""
        if not self.use_graphs:
            return None
        key = (cache.k[0].shape[0], cache.max_len, cache.k[0].dtype, cache.k[0].device)
        graph = self.graphs.get(key)
        if graph is not None and not graph.stale():
            graph.adopt(cache)
            return graph
        if key in self.graphs and graph is None:  # recording failed here before
            return None
        reason = why_no_graph(self.model, cache)
        if reason is None:
            try:
                graph = self.graphs[key] = GraphStep(self.fast, cache, compiled=self.compiled is not None)
            except Exception as e:  # a kernel that cannot be recorded: the engine's forward runs, as before
                reason = f"recording it failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                self.graphs[key] = None
        if reason is not None:
            say_once("CUDA graph of the decoding step", reason)
        return graph


class TwinSteps:
    """generate's seams (`prefill`, `prepare`, `decode_one`, `greedy`) for a model the Engine does not fuse (Qwen3,
    Llama 3): the glass model again, module by module, whose nn.Linears are GemvLinear over the very same
    Parameters (`gemv_twin`: nothing copied; RoPE's tables, the config and the hooks shared), each given
    glassgpt's matrix-vector kernel where autotune found it faster here for that shape, and each MoE feed-forward
    running one token through its routed experts alone (experts.py), each linear attention (Qwen3.5's) one token
    through its state in place (linear_attention.py); and the native step
    (step.py) where its description has a plan and autotune measured it faster than the twin.

    At batch 1 each new token multiplies one row by every weight, so a step's time is the time to read the
    weights (2.4 GB per token for Qwen3 0.6B in float32). PyTorch's matmul reads them below the memory's
    bandwidth on some CPUs, the gemv kernel at it (linear.py, kernels/gemv.cpp); every prompt of more than
    GEMV_MAX_ROWS tokens (PROMPT_ROWS where autotune's "linear prompt" measured the kernel faster on the widest
    block layer) runs F.linear as the glass model does, so the prompt's logits are the glass model's bit for bit,
    and each decoded token's within the kernel's rounding (tests/test_family_adopt.py). The
    native step runs a whole decoding step in one C++ call: no Python between the 28 blocks of Qwen3 0.6B,
    whose ~200 small operators per token otherwise cost as much as reading the weights.

    What was measured (each shape's kernel, the step against the twin) is kept in autotune's cache file, so a
    later process decodes at once at the rate the first one chose (`choices.cached`, `choices.measured`)."""

    def __init__(self, model: nn.Module, twin: nn.Module, choices: autotune.Choices | None):
        self._model = weakref.ref(model)  # weakly: twin_steps keeps these per model, and must not keep the model
        self.twin = twin
        self.choices = choices  # None off the CPU, or in float16: nothing measured, the twin decodes
        self.step: PlannedStep | None = None  # the native step over the last cache decode_one was given
        self.declined: weakref.ref | None = None  # the cache the native step was found not to run on

    @property
    def model(self) -> nn.Module:
        return self._model()

    @property
    def cfg(self):
        return self.model.cfg

    def run(self, ids: torch.Tensor, cache, last_only: bool) -> torch.Tensor:
        """The twin's forward (autotune times the native step against it)."""
        return self.twin(ids, cache, last_only=last_only)

    def prefill(self, ids: torch.Tensor, cache) -> torch.Tensor:
        cache.reset()
        return self.twin(ids, cache, last_only=True)[:, -1]

    def prepare(self, cache) -> PlannedStep | None:
        """The native step over `cache` where it covers the model and autotune chose it (Engine.prepare); else None."""
        step = self.step
        if step is not None and step.cache is cache and not step.stale():
            return step
        if step is None and self.declined is not None and self.declined() is cache:
            return None
        chosen = self.choices is not None and autotune.native_step_chosen(self, cache)
        if chosen and step is not None and not step.stale() and step.takes(cache):
            step.point_at(cache)  # a cache of the same shape: twin_steps planned this model's current tensors
        else:
            self.step = plans.native_step(self.model, cache) if chosen else None
        self.declined = weakref.ref(cache) if self.step is None else None
        return self.step

    def decode_one(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """One new token per row, `[b]` at `cache.pos` -> its logits `[b, V]` (the native step's are
        float32, in a buffer the next step overwrites)."""
        step = self.prepare(cache)
        if step is not None:
            return step(ids)
        return self.twin(ids[:, None], cache, last_only=True)[:, -1]

    def greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, list[float]] | None:
        """The native step's own greedy pick of `logits` where it made them (step.py's PlannedStep.greedy), else None."""
        return self.step.greedy(logits) if self.step is not None else None


_TWINS: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, TwinSteps]]" = weakref.WeakKeyDictionary()


def twin_steps(model: nn.Module) -> TwinSteps:
    """The steps of `model`'s twin, made once per model (again if its tensors were replaced)."""
    fingerprint = tuple((p.data_ptr(), p.dtype, p.device) for p in model.parameters())
    found = _TWINS.get(model)
    if found is None or found[0] != fingerprint:
        twin, choices = gemv_twin(model)
        found = (fingerprint, TwinSteps(model, twin, choices))
        _TWINS[model] = found
    return found[1]


def gemv_twin(model: nn.Module) -> tuple[nn.Module, autotune.Choices | None]:
    """`model` again, module by module, over the same Parameters (and RoPE tables, config and hooks), with
    each nn.Linear a GemvLinear (nothing is copied or made again), each given the kernel where autotune
    measured it faster for its shape; and those choices (None off the CPU or in float16)."""
    twin = _shallow_copy(model)
    anatomy = describe(model)
    one_token_experts(twin, anatomy)  # a MoE's decoding step runs only the routed experts, without bookkeeping
    one_token_linear_attention(twin, anatomy)  # a linear attention's step updates its state in place
    choices = autotune.twin_choices(model)
    ops = autotune.kernels_for(choices.precision) if choices is not None else None
    if ops is not None:
        prompt = choices.winners.get(autotune.PROMPT) == "glassgpt"
        for m in twin.modules():
            if isinstance(m, GemvLinear) and choices.winners.get(f"linear {m.out_features}x{m.in_features}") == "glassgpt":
                m.gemv = ops.gemv
                m.max_rows = autotune.PROMPT_ROWS[choices.precision] if prompt else m.max_rows
    return twin, choices


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object of `module`'s class (GemvLinear for an nn.Linear) sharing its Parameters,
    buffers and attributes, with its submodules copied the same way."""
    cls = GemvLinear if type(module) is nn.Linear else type(module)
    twin = cls.__new__(cls)
    twin.__dict__ = module.__dict__.copy()
    twin._parameters = dict(module._parameters)  # the same Parameter objects
    twin._modules = {name: None if child is None else _shallow_copy(child) for name, child in module._modules.items()}
    return twin


def say_once(what: str, reason: str) -> None:
    """Warn that glassgpt's `what` does not run here and why, once per process and reason."""
    if reason not in _said:
        _said.add(reason)
        warnings.warn(f"glassgpt's {what} does not run here: {reason}; the PyTorch engine runs instead",
                      KernelWarning, stacklevel=4)


def as_engine(model: nn.Module) -> Engine:
    """`model` if it is already an Engine (compiled or not), else an Engine over it."""
    return model if isinstance(model, Engine) else Engine(model)


def compile_for_generation(model: GPTModel | Engine) -> Engine:
    """An Engine over `model` (or `model` itself, an Engine) whose forward runs through torch.compile, for
    `generate`/`stream` (same results). The compiled code is kept in glassgpt's cache root
    (compiling.use_cache), where a later process finds it.

    The first call compiles twice (the prompt, then the one-token step, whose cache
    position stays symbolic), which takes tens of seconds on a CPU; later steps run
    the fused code. Graphs are made for the first batch size and prompt length; other
    sizes get dynamic-shape graphs, which run slower on a CPU (one size per process is
    the fast case). Every compiled model and batch size adds graphs for the same
    `forward` code, so the recompile limit is raised above dynamo's default of 8, past
    which it would silently fall back to eager.

    The options (measured on the benchmark CPUs, benchmarks/RESULTS.md):
    - no `freezing`: inductor's freezing treats the weights as constants and pre-packs them
      for the CPU's matmul library, which gained nothing measurable in decoding (48.0 against
      48.9 tokens/s for gpt2 in float32), while a later process then redoes most of what
      inductor's on-disk cache otherwise serves: a second `glassgpt generate --compile` took
      16 s to its first token with freezing and 6 s without. For int8 weights (int8.py) it would also constant-fold `weight.float()` into a
      float32 copy, read as 4 bytes per weight instead of 1.
    - int8 weights: a low `realize_opcount_threshold`, so that a LayerNorm's output is
      computed once and stored, not recomputed inside every dot product of the matmul that
      reads it.
    - no guards on the model's modules. Each step would otherwise check every parameter and
      buffer before running (~0.5 ms of an ~8 ms int8 step). The price is that changing the
      model's modules after compiling is not noticed; generation changes nothing, and a
      changed model should be compiled again.
    """
    compiling.use_cache()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    options: dict = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe, "freezing": False}
    engine = as_engine(model)
    if is_quantized(engine.model):
        options.update(realize_opcount_threshold=4)
    # Dynamo keeps its graphs on the code object they were traced from, and without guards on
    # the modules a second compiled model with inputs of the same shapes would run the first
    # one's graphs (an int4 model the int8 model's, reading weights it does not have). Each
    # compiled engine gets a copy of the code of its own.
    run = Engine.run
    engine.compiled = torch.compile(types.MethodType(types.FunctionType(
        run.__code__.replace(), run.__globals__, run.__name__, run.__defaults__, run.__closure__), engine),
        options=options)
    return engine
